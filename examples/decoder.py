"""A Llama-style decoder in plain JAX, trained on CPU on Python's standard library.

    python examples/decoder.py [--tiny] [--steps N] [--prompt TEXT] [--length N]

A byte-level (vocabulary 256) causal language model: RMSNorm, rotary position
embeddings, grouped-query attention, a SwiGLU MLP and tied input/output
embeddings, the layers stacked under ``jax.lax.scan`` (each layer weight has a
leading axis of length n_layers). The parameters are a dict of arrays and every
function is plain JAX, for ``jqt.quantize`` as any other function. Each weight
is a dense ``x @ w``, w of shape (in, out), contracting over a multiple of 128
(int4 groups of 128).

* ``forward(params, tokens)``, ``loss(params, tokens)`` (nats per byte); the
  config is read from the weight shapes (head_dim 32) unless given.
* ``prefill``, ``decode_step``, ``generate(params, prompt, steps)``: greedy
  decoding with a fixed-size KV cache, ``generate`` one jittable ``lax.scan``.
* ``batches(split, batch, seq_len, n, seed)``: windows of the standard
  library's ``.py`` files, every 20th file held out; no download.
* ``load_or_train(config, steps)``: AdamW, the parameters cached as ``.npz`` in
  ``$JQT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/jqt``, or ``~/.cache/jqt``), keyed by a hash of the config, the
  training settings and the data.

As a script: trains (or loads) the model and prints its size, training time,
held-out loss and a greedy sample with the jitted generate's speed. DEFAULT
(3.08M parameters, 700 steps of 4 x 256 bytes): held-out loss 1.77 nats/byte
(1.7669 on Python 3.11's standard library, docs/generate.md); TINY (0.43M, 400
steps) trains in a fraction of that time. Uniform bytes would be 5.55.
"""
import argparse
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pathlib
import sys
import sysconfig
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

VOCAB = 256           # bytes
HEAD_DIM = 32         # what Config.from_params assumes
HELDOUT_EVERY = 20    # every 20th standard-library file is held out
RECIPE = "decoder-v1"  # in the cache key: change it when the model, training or data code changes
EVAL_BATCHES, EVAL_SEED = 16, 1234


@dataclasses.dataclass(frozen=True)
class Config:
    """Model sizes. Weight matmuls contract over d_model, n_heads * head_dim and d_ff:
    keep those multiples of 128."""
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    d_ff: int = 768
    head_dim: int = HEAD_DIM
    vocab: int = VOCAB
    rope_theta: float = 10000.0

    @classmethod
    def from_params(cls, params, head_dim=HEAD_DIM):
        """The config of ``params``, read from the weight shapes (head_dim is not in them)."""
        layers = params["layers"]
        return cls(d_model=params["embed"].shape[1], n_layers=layers["wq"].shape[0],
                   n_heads=layers["wq"].shape[2] // head_dim, n_kv_heads=layers["wk"].shape[2] // head_dim,
                   d_ff=layers["w_up"].shape[2], head_dim=head_dim, vocab=params["embed"].shape[0])


DEFAULT = Config()                                                   # 3.08M parameters
TINY = Config(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=384)  # 0.43M
DEFAULT_STEPS, TINY_STEPS = 700, 400


# ----------------------------------------------------------------------------- model

def init_params(config, key):
    """Random parameters: normal(0, 1/sqrt(fan_in)) weights, the residual outputs (wo,
    w_down) scaled down by sqrt(2 * n_layers), embeddings normal(0, 0.02), norms 1."""
    c, L = config, config.n_layers
    shapes = {"wq": (c.d_model, c.n_heads * c.head_dim), "wk": (c.d_model, c.n_kv_heads * c.head_dim),
              "wv": (c.d_model, c.n_kv_heads * c.head_dim), "wo": (c.n_heads * c.head_dim, c.d_model),
              "w_gate": (c.d_model, c.d_ff), "w_up": (c.d_model, c.d_ff), "w_down": (c.d_ff, c.d_model)}
    keys = jax.random.split(key, len(shapes) + 1)
    layers = {"attn_norm": jnp.ones((L, c.d_model)), "mlp_norm": jnp.ones((L, c.d_model))}
    for k, (name, (n_in, n_out)) in zip(keys[1:], shapes.items()):
        std = n_in ** -0.5 / ((2 * L) ** 0.5 if name in ("wo", "w_down") else 1.0)
        layers[name] = std * jax.random.normal(k, (L, n_in, n_out))
    return {"embed": 0.02 * jax.random.normal(keys[0], (c.vocab, c.d_model)),
            "final_norm": jnp.ones((c.d_model,)), "layers": layers}


def param_count(params):
    return sum(x.size for x in jax.tree.leaves(params))


def rms_norm(x, scale, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def rope(x, positions, theta):
    """Rotary embedding of x (B, T, heads, D) at integer positions (T,): the two halves
    of each head are rotated by position * theta ** (-2i / D)."""
    half = x.shape[-1] // 2
    angles = positions[:, None].astype(jnp.float32) * theta ** (-jnp.arange(half) / half)
    cos, sin = (a(angles)[:, None, :].astype(x.dtype) for a in (jnp.cos, jnp.sin))  # keeps bf16 bf16
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _qkv(config, layer, h, positions):
    """Queries (B, T, n_heads, D) and keys (rotated) and values (B, T, n_kv_heads, D)."""
    B, T, _ = h.shape
    x = rms_norm(h, layer["attn_norm"])
    q = (x @ layer["wq"]).reshape(B, T, config.n_heads, config.head_dim)
    k = (x @ layer["wk"]).reshape(B, T, config.n_kv_heads, config.head_dim)
    v = (x @ layer["wv"]).reshape(B, T, config.n_kv_heads, config.head_dim)
    return rope(q, positions, config.rope_theta), rope(k, positions, config.rope_theta), v


def _attend(q, k, v, mask):
    """Grouped-query attention: query head i reads key/value head i // (n_heads / n_kv_heads).
    q (B, Tq, H, D), k and v (B, Tk, KV, D), mask (Tq, Tk) bool -> (B, Tq, H * D)."""
    B, Tq, H, D = q.shape
    KV = k.shape[2]
    q = q.reshape(B, Tq, KV, H // KV, D)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) * D ** -0.5
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    out = jnp.einsum("bkgqs,bskd->bqkgd", jax.nn.softmax(scores, axis=-1), v)
    return out.reshape(B, Tq, H * D)


def _finish(config, layer, h, attention):
    """The rest of a block: output projection and the SwiGLU MLP, each with its residual.
    A config with a ``tp_axis`` (tensor parallelism: the heads and d_ff split over that
    ``jax.shard_map`` mesh axis, examples/tensor_parallel.py) sums the two projections'
    partial results over the devices."""
    axis = getattr(config, "tp_axis", None)
    total = (lambda y: jax.lax.psum(y, axis)) if axis else (lambda y: y)
    h = h + total(attention @ layer["wo"])
    x = rms_norm(h, layer["mlp_norm"])
    return h + total((jax.nn.silu(x @ layer["w_gate"]) * (x @ layer["w_up"])) @ layer["w_down"])


def _logits(params, h):
    return rms_norm(h, params["final_norm"]) @ params["embed"].T  # tied embeddings


def _run(params, tokens, config, keep_kv):
    """The causal stack over tokens (B, T): final hidden states, and each layer's keys and
    values (L, B, T, KV, D) if keep_kv."""
    positions = jnp.arange(tokens.shape[1])
    mask = positions[:, None] >= positions[None, :]

    def block(h, layer):
        q, k, v = _qkv(config, layer, h, positions)
        return _finish(config, layer, h, _attend(q, k, v, mask)), ((k, v) if keep_kv else None)

    return jax.lax.scan(block, params["embed"][tokens], params["layers"])


def forward(params, tokens, config=None):
    """Logits (B, T, vocab) of int32 tokens (B, T), causal."""
    config = config or Config.from_params(params)
    h, _ = _run(params, tokens, config, keep_kv=False)
    return _logits(params, h)


def loss(params, tokens, config=None):
    """Mean next-token cross-entropy of tokens (B, T), in nats (T - 1 predictions a row)."""
    logits = forward(params, tokens[:, :-1], config)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


# ----------------------------------------------------------------------------- generation

def prefill(params, tokens, max_len, config=None):
    """Runs the prompt tokens (B, T): the last position's logits (B, vocab) and a cache
    {"k", "v": (L, B, max_len, KV, D), "pos": T} holding the prompt's keys and values."""
    config = config or Config.from_params(params)
    h, (k, v) = _run(params, tokens, config, keep_kv=True)
    pad = [(0, 0), (0, 0), (0, max_len - tokens.shape[1]), (0, 0), (0, 0)]
    cache = {"k": jnp.pad(k, pad), "v": jnp.pad(v, pad), "pos": jnp.int32(tokens.shape[1])}
    return _logits(params, h[:, -1]), cache


def decode_step(params, cache, token, config=None):
    """One token (B,) at position cache["pos"] (one position for the whole batch): its
    logits (B, vocab) and the cache with its keys and values written in.

    The scan over the layers carries the whole stacked cache and writes layer i's new
    key and value at (i, :, pos) in place. Handing each layer its slice as the scan's
    input and restacking the outputs, as this step did before 2026-12-07, made XLA:CPU
    copy the whole cache two to three times a step inside a generate loop
    (``benchmarks/decode_layouts.py`` times both forms). Called from Python, jit it with
    ``donate_argnums=1``: a call that keeps its cache argument starts from a copy of it."""
    config = config or Config.from_params(params)
    pos = cache["pos"]
    mask = (jnp.arange(cache["k"].shape[2]) <= pos)[None, :]

    def block(carry, xs):
        h, k_all, v_all = carry
        layer, i = xs
        q, k, v = _qkv(config, layer, h, pos[None])
        k_all = jax.lax.dynamic_update_slice(k_all, k[None], (i, 0, pos, 0, 0))
        v_all = jax.lax.dynamic_update_slice(v_all, v[None], (i, 0, pos, 0, 0))
        h = _finish(config, layer, h, _attend(q, k_all[i], v_all[i], mask))
        return (h, k_all, v_all), None

    (h, k, v), _ = jax.lax.scan(block, (params["embed"][token[:, None]], cache["k"], cache["v"]),
                                (params["layers"], jnp.arange(cache["k"].shape[0])))
    return _logits(params, h[:, 0]), {"k": k, "v": v, "pos": pos + 1}


def generate(params, prompt, steps, config=None):
    """Greedy continuation of prompt (B, T): the next ``steps`` tokens (B, steps), int32.
    Pure in (params, prompt); jit it with ``static_argnames="steps"``."""
    if steps < 1 or prompt.shape[1] < 1:
        raise ValueError(f"generate: steps={steps} and a prompt of {prompt.shape[1]} tokens; "
                         "both must be at least 1.")
    logits, cache = prefill(params, prompt, prompt.shape[1] + steps, config)
    first = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def step(carry, _):
        token, cache = carry
        logits, cache = decode_step(params, cache, token, config)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (token, cache), token

    _, rest = jax.lax.scan(step, (first, cache), None, length=steps - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def to_tokens(text):
    """int32 (1, n) bytes of a string."""
    return jnp.asarray(np.frombuffer(text.encode(), np.uint8)[None].astype(np.int32))


def to_text(tokens):
    return bytes(np.asarray(tokens, np.uint8).tolist()).decode(errors="replace")


# ----------------------------------------------------------------------------- data

def stdlib_files():
    """Relative paths of the standard library's .py files, sorted (site-packages excluded, and
    links to nowhere: Debian's sitecustomize.py points into /etc, which can lack it)."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__")]
        found += [os.path.relpath(os.path.join(d, f), root) for f in files
                  if f.endswith(".py") and os.path.isfile(os.path.join(d, f))]
    return sorted(found)


@functools.cache
def split_bytes(split):
    """The split's files concatenated as uint8: "heldout" is every 20th file, "train" the rest."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split is 'train' or 'heldout', not {split!r}")
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    chunks = [(root / f).read_bytes() for i, f in enumerate(stdlib_files())
              if (i % HELDOUT_EVERY == HELDOUT_EVERY - 1) == (split == "heldout")]
    return np.frombuffer(b"".join(chunks), np.uint8)


def batches(split, batch, seq_len, n, seed):
    """n int32 arrays (batch, seq_len), windows of the split at random offsets (deterministic in seed)."""
    data, rng = split_bytes(split), np.random.default_rng(seed)
    for _ in range(n):
        starts = rng.integers(0, len(data) - seq_len, batch)
        yield data[starts[:, None] + np.arange(seq_len)].astype(np.int32)


def data_digest():
    """Identifies the data: the Python version, and each file's name and size."""
    root = sysconfig.get_paths()["stdlib"]
    listing = [(f, os.path.getsize(os.path.join(root, f))) for f in stdlib_files()]
    return hashlib.sha256(json.dumps([sys.version, listing]).encode()).hexdigest()


# ----------------------------------------------------------------------------- training

def heldout_loss(params, config=None, seq_len=256):
    """Mean loss over fixed held-out windows (EVAL_BATCHES batches of 16), in nats per byte."""
    f = jax.jit(functools.partial(loss, config=config))
    return float(np.mean([f(params, t) for t in batches("heldout", 16, seq_len, EVAL_BATCHES, EVAL_SEED)]))


def train(config=DEFAULT, steps=DEFAULT_STEPS, *, batch=4, seq_len=256, lr=3e-3, seed=0, log_every=100):
    """AdamW (warmup, then cosine to lr / 10; weight decay 0.1 except on the norms'
    scales; gradients clipped at norm 1) on train windows. Returns (params, info) with info's train_seconds
    and heldout_loss."""
    # (one step: no warmup, the step at lr; optax refuses a decay of no steps)
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(max(1, steps // 20), steps - 1), steps, lr / 10)
    decay = functools.partial(jax.tree_util.tree_map_with_path, lambda path, _: "norm" not in path[-1].key)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, b2=0.95, weight_decay=0.1, mask=decay))
    params = init_params(config, jax.random.key(seed))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens, config)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    start, start_cpu = time.perf_counter(), time.process_time()
    for i, tokens in enumerate(batches("train", batch, seq_len, steps, seed)):
        params, opt_state, value = step(params, opt_state, tokens)
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"  step {i:5d}  loss {float(value):.3f}  {time.perf_counter() - start:6.1f} s", flush=True)
    jax.block_until_ready(params)
    info = {"train_seconds": time.perf_counter() - start, "train_cpu_seconds": time.process_time() - start_cpu}
    return params, {**info, "heldout_loss": heldout_loss(params, config, seq_len)}


def cache_path(config=DEFAULT, steps=DEFAULT_STEPS, **settings):
    """``$JQT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/jqt``, or ``~/.cache/jqt``: the folder of
    jqt's native kernels) / decoder-<hash>.npz: the hash of the config, the steps,
    ``train``'s settings (defaults filled in, log_every left out) and data_digest()."""
    bound = inspect.signature(train).bind(config, steps, **settings)
    bound.apply_defaults()
    recipe = {k: v for k, v in bound.arguments.items() if k not in ("config", "log_every")}
    key = json.dumps([RECIPE, dataclasses.asdict(config), recipe, data_digest()], sort_keys=True)
    root = os.path.expanduser(os.environ.get("JQT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "jqt"))
    return os.path.join(root, f"decoder-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz")


def save(path, params, info):
    """params (keys "embed", "layers/wq", ...) and info (JSON) in one .npz, written atomically."""
    flat = {"/".join(k.key for k in keys): np.asarray(v) for keys, v in jax.tree_util.tree_leaves_with_path(params)}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(tmp := f"{path}.{os.getpid()}.tmp.npz", __info__=json.dumps(info), **flat)
    os.replace(tmp, path)


def load(path):
    """(params, info) from a file written by save."""
    with np.load(path) as f:
        params = {"layers": {}}
        for name in set(f.files) - {"__info__"}:
            *outer, leaf = name.split("/")
            (params[outer[0]] if outer else params)[leaf] = jnp.asarray(f[name])
        return params, json.loads(str(f["__info__"]))


def load_or_train(config=DEFAULT, steps=DEFAULT_STEPS, **settings):
    """Trained (params, info): loaded from cache_path(...) if there, else trained (``train``'s
    keyword settings) and saved. info: train_seconds, heldout_loss, path, loaded."""
    path = cache_path(config, steps, **settings)
    if os.path.exists(path):
        try:
            params, info = load(path)
        except Exception as e:  # (a copied or synced cache, a bad disk: save writes atomically)
            raise SystemExit(f"decoder: the cached decoder {path} cannot be read ({type(e).__name__}: "
                             f"{e}); delete it to train the decoder again.") from e
        return params, {**info, "path": path, "loaded": True}
    try:  # the folder is checked before training, not after minutes of it
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path)):
            pass
    except OSError as e:
        raise SystemExit(f"decoder: cannot write the trained decoder to {os.path.dirname(path)} "
                         f"({e}); set JQT_CACHE_DIR to a folder that can be written.") from e
    params, info = train(config, steps, **settings)
    save(path, params, info)
    return params, {**info, "path": path, "loaded": False}


def positive(text):
    """argparse type: an int of at least 1."""
    n = int(text)  # argparse turns a ValueError into "invalid positive value: 'x'"
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text}")
    return n


def nonempty(text):
    """argparse type: a string of at least one character."""
    if not text:
        raise argparse.ArgumentTypeError("expected at least one character")
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny config (tests)")
    parser.add_argument("--steps", type=positive, help="training steps")
    parser.add_argument("--prompt", type=nonempty, default="def __init__(self")
    parser.add_argument("--length", type=positive, default=200, help="bytes to generate")
    args = parser.parse_args()
    config = TINY if args.tiny else DEFAULT
    steps = args.steps if args.steps is not None else (TINY_STEPS if args.tiny else DEFAULT_STEPS)

    params, info = load_or_train(config, steps)
    print(f"config {config}\nparameters {param_count(params):,}")
    print(f"{'loaded from' if info['loaded'] else 'saved to'} {info['path']}")
    print(f"training: {steps} steps, {info['train_seconds']:.0f} s ({info['train_cpu_seconds']:.0f} CPU-seconds); "
          f"held-out loss {info['heldout_loss']:.3f} nats/byte")

    gen = jax.jit(generate, static_argnames="steps")
    prompt = to_tokens(args.prompt)
    jax.block_until_ready(gen(params, prompt, args.length))  # compile
    start = time.perf_counter()
    out = jax.block_until_ready(gen(params, prompt, args.length))
    seconds = time.perf_counter() - start
    print(f"generate: {args.length / seconds:.0f} tokens/s (batch 1, jitted, greedy)")
    print("-" * 70 + "\n" + args.prompt + to_text(out[0]) + "\n" + "-" * 70)


if __name__ == "__main__":
    main()
