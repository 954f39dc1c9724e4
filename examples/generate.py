"""Generate text with a quantized decoder: int8 weights, int4 weights and an int8 KV cache.

    python examples/generate.py [--tiny] [--prompts N] [--tokens N] [--length N] [--calibration N]

The decoder of ``examples/decoder.py`` (trained on the standard library, or loaded
from its cache). Its plain-JAX ``generate`` (a ``lax.scan`` over decode steps, each
a ``lax.scan`` over the stacked layers, the key/value cache in the carry) is
calibrated and quantized as it is, with

* ``float``: float32;
* ``w8a8_dynamic + int8 KV``: int8 weights and per-token int8 activations, the
  cache stored as int8 codes and one float16 scale per token and head;
* ``w8a8 + int8 KV``: static (calibrated) int8 activations;
* ``w4 g128 + int8 KV``: int4 weights, one scale per group of 128 inputs.

For each it prints the generation speed (batch 1, jitted), the bytes of the cache
the decode loop carries (read from the jaxpr: the carry really is int8), the
held-out loss, the next-token agreement with float along the float model's own
generation (teacher forcing: the same decode loop fed the float tokens), and
where its greedy text first diverges from float's. Greedy decoding is chaotic
(one flipped near-tie changes every later token), so identical text is not the
measure; agreement is.

Then it streams: ``decoder.decode_step`` called once per token from a Python loop
(as a server that sends each token as it comes does), quantized with
``w8a8_dynamic + int8 KV``. The step takes its cache and returns it written, so the
quantized step returns the cache quantized (a ``jqt.QArray`` of int8 codes and
float16 scales) and takes it back as it is; it prints the tokens per second, the
cache's dtypes and bytes, and where its text first differs from the loop's.
"""
import argparse
import dataclasses
import functools
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decoder as D  # noqa: E402

import jqt  # noqa: E402

PROMPT_LEN = 32
VARIANTS = {
    "w8a8_dynamic + int8 KV": lambda: jqt.recipes.w8a8_dynamic(kv_cache=True),
    "w8a8 + int8 KV": lambda: jqt.recipes.w8a8(kv_cache=True),
    "w4 g128 + int8 KV": lambda: jqt.recipes.w4(group_size=128, kv_cache=True),
}


def teacher(params, prompt, tokens, config=None):
    """The decode loop fed ``tokens`` (B, n) after ``prompt`` (B, P): the greedy next
    token (B, n) predicted at each step (prefill, then a scan over steps, each a scan
    over layers with the cache in the carry, as in ``decoder.generate``)."""
    logits, cache = D.prefill(params, prompt, prompt.shape[1] + tokens.shape[1], config)

    def step(cache, token):
        logits, cache = D.decode_step(params, cache, token, config)
        return cache, jnp.argmax(logits, -1).astype(jnp.int32)

    first = jnp.argmax(logits, -1).astype(jnp.int32)
    _, rest = jax.lax.scan(step, cache, tokens[:, :-1].T)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def prompts(split, n, seed):
    """n windows of PROMPT_LEN bytes of the split, (n, PROMPT_LEN) int32."""
    return next(D.batches(split, n, PROMPT_LEN, 1, seed))


def _consts_and_carries(params):
    """A scan equation's operand counts: JAX 0.10 names them, JAX 0.11 gives a tree of
    the (consts, carries, xs) operands."""
    if "num_carry" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()
    return len(consts), len(carries)


def carried_cache_bytes(fn, *args):
    """Bytes of the arrays the outermost decode loop of fn carries for its cache: those
    whose shape is the cache's (n_layers, batch, max_len, heads, head_dim); and their
    dtypes. The loop is the last top-level scan that carries such an array, of any length
    (a one-token generation runs it zero times and still carries the cache)."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            nc, nk = _consts_and_carries(e.params)
            avals = [v.aval for v in e.invars[nc:nc + nk] if v.aval.ndim == 5]
            if avals:
                found.append(avals)
    if not found:
        raise ValueError("carried_cache_bytes: no top-level scan of this function carries a 5-D "
                         "(n_layers, batch, max_len, heads, head_dim) cache")
    avals = found[-1]
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals), sorted({str(a.dtype) for a in avals})


def tokens_per_second(fn, params, prompt, steps, repeats=3):
    jax.block_until_ready(fn(params, prompt))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(params, prompt))
        times.append(time.perf_counter() - t)
    return steps / float(np.median(times))


def stream(params, prompt, steps, calib_prompt):
    """``steps`` greedy tokens after ``prompt`` (1, P), ``decoder.decode_step`` called
    once per token from Python with an int8 cache kept between calls: (tokens, tokens
    per second of the loop, the last cache)."""
    recipe = jqt.recipes.w8a8_dynamic(kv_cache=True)
    max_len = prompt.shape[1] + steps
    # calibration prefills its prompts and takes 3 steps in a cache of the same length
    calib_prompt = calib_prompt[:, :max_len - 3]
    prefill = functools.partial(D.prefill, max_len=max_len)
    # the prefill returns the cache float (no loop carries it): its recipe needs no kv_cache
    qp_pre = jqt.calibrate(prefill, jqt.recipes.w8a8_dynamic(), params, [(calib_prompt,)], progress=False)
    # the step calibrates on the float model's own steps after the same prompts
    logits, cache = jax.jit(prefill)(params, calib_prompt)
    calib = []
    for _ in range(3):
        token = jnp.argmax(logits, -1).astype(jnp.int32)
        calib.append((cache, token))
        logits, cache = D.decode_step(params, cache, token)
    qp = jqt.calibrate(D.decode_step, recipe, params, calib, progress=False)
    qpre = jax.jit(jqt.quantize(prefill, qp_pre))
    qstep = jax.jit(jqt.quantize(D.decode_step, qp), donate_argnums=1)
    packed_pre, packed = jqt.pack(qp_pre, params), jqt.pack(qp, params)

    def run():
        logits, cache = qpre(packed_pre, prompt)  # a float cache: the first step quantizes it
        out = []
        for _ in range(steps):
            token = jnp.argmax(logits, -1).astype(jnp.int32)
            out.append(token)
            logits, cache = qstep(packed, cache, token)
        return jnp.concatenate(out), cache

    jax.block_until_ready(run())  # compile: the step twice (a float cache, then quantized)
    t = time.perf_counter()
    tokens, cache = run()
    jax.block_until_ready(tokens)
    return tokens, steps / (time.perf_counter() - t), cache


def first_divergence(a, b):
    diff = np.nonzero(np.asarray(a) != np.asarray(b))[0]
    return int(diff[0]) if diff.size else None


def decoder_parser(doc):
    """The arguments of the examples that run the trained decoder (this one and
    examples/tensor_parallel.py): its size and the agreement's prompts and tokens."""
    parser = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()))
    parser.add_argument("--tiny", action="store_true", help="the tiny decoder (tests)")
    parser.add_argument("--prompts", type=D.positive, default=8, help="prompts for the agreement")
    parser.add_argument("--tokens", type=D.positive, default=200, help="tokens per prompt for the agreement")
    return parser


def load_decoder(args):
    """The decoder's (config, params), trained or loaded from its cache, said in one line."""
    config = D.TINY if args.tiny else D.DEFAULT
    params, info = D.load_or_train(config, D.TINY_STEPS if args.tiny else D.DEFAULT_STEPS)
    print(f"decoder: {D.param_count(params):,} parameters, held-out loss {info['heldout_loss']:.4f} nats/byte "
          f"({'loaded' if info['loaded'] else 'trained'})")
    return config, params


def main(argv=None):
    parser = decoder_parser(__doc__)
    parser.add_argument("--length", type=D.positive, default=200, help="tokens of the greedy sample")
    parser.add_argument("--calibration", type=D.positive, default=4, help="calibration batches of 4 prompts")
    args = parser.parse_args(argv)
    config, params = load_decoder(args)

    gen = functools.partial(D.generate, steps=args.length)
    # calibration runs the function being quantized: prompts from the training split
    cal_gen = [(prompts("train", 4, 100 + i),) for i in range(args.calibration)]
    heldout = prompts("heldout", args.prompts, 7)
    float_tokens = jax.jit(functools.partial(D.generate, steps=args.tokens))(params, heldout)
    # calibrated on two tokens at least (the teacher's loop runs a step per token after the
    # first: with --tokens 1 its ops never ran and stayed float)
    cal_teacher = [(p, jax.jit(functools.partial(D.generate, steps=max(args.tokens, 2)))(params, p))
                   for (p,) in cal_gen[:2]]
    sample = D.to_tokens("def __init__(self")

    text = lambda t: D.to_text(t).replace("\n", "\\n")
    rows, samples = [], {}
    float_gen = jax.jit(gen)
    float_sample = float_gen(params, sample)
    base_loss = D.heldout_loss(params)
    float_bytes, float_dtypes = carried_cache_bytes(gen, params, sample)
    rows.append(("float", tokens_per_second(float_gen, params, sample, args.length), float_bytes,
                 float_dtypes, base_loss, 1.0, None))
    for name, make in VARIANTS.items():
        recipe = make()
        qp = jqt.calibrate(gen, recipe, params, cal_gen, progress=False)
        packed = jqt.pack(qp, params)
        qgen = jax.jit(jqt.quantize(gen, qp))
        speed = tokens_per_second(qgen, packed, sample, args.length)
        nbytes, dtypes = carried_cache_bytes(jqt.quantize(gen, qp), packed, sample)
        qp_t = jqt.calibrate(teacher, recipe, params, cal_teacher, progress=False)
        pred = jax.jit(jqt.quantize(teacher, qp_t))(jqt.pack(qp_t, params), heldout, float_tokens)
        agree = float(np.mean(np.asarray(pred) == np.asarray(float_tokens)))
        # the loss reads whole sequences, with no decode loop and no cache to quantize
        no_cache = jqt.Recipe(rules=tuple(dataclasses.replace(r, kv_cache=None) for r in recipe.rules))
        qp_l = jqt.calibrate(D.loss, no_cache, params, [(t,) for t in D.batches("train", 4, 256, 4, 5)],
                             progress=False)
        qloss, packed_l = jax.jit(jqt.quantize(D.loss, qp_l)), jqt.pack(qp_l, params)
        loss = float(np.mean([qloss(packed_l, t) for t in
                              D.batches("heldout", 16, 256, D.EVAL_BATCHES, D.EVAL_SEED)]))
        q_sample = qgen(packed, sample)[0]
        samples[name] = q_sample
        rows.append((name, speed, nbytes, dtypes, loss, agree, first_divergence(q_sample, float_sample[0])))

    print(f"\nbatch-1 greedy generation of {args.length} tokens after {text(sample[0])!r}; "
          f"agreement over {args.prompts} held-out prompts x {args.tokens} tokens")
    print(f"{'variant':24s} {'tokens/s':>9s} {'cache bytes':>12s} {'vs float':>8s} {'cache dtypes':>22s} "
          f"{'loss':>7s} {'+loss':>7s} {'agree':>7s} {'diverges at':>11s}")
    for name, speed, nbytes, dtypes, loss, agree, div in rows:
        print(f"{name:24s} {speed:9.0f} {nbytes:12,d} {nbytes / float_bytes:7.3f}x {','.join(dtypes):>22s} "
              f"{loss:7.4f} {loss - base_loss:+7.4f} {agree:7.2%} {'-' if div is None else div:>11}")
    print(f"\ngreedy text after {text(sample[0])!r} (the first 80 tokens):")
    print(f"{'float':24s} {text(float_sample[0][:80])}")
    for name, t in samples.items():
        print(f"{name:24s} {text(t[:80])}")

    loop = "w8a8_dynamic + int8 KV"
    tokens, speed, cache = stream(params, sample, args.length, cal_gen[0][0])
    kv = [cache["k"], cache["v"]]
    nbytes = sum(x.values.nbytes + x.scale.nbytes for x in kv)
    dtypes = sorted({str(a.dtype) for x in kv for a in (x.values, x.scale)})
    div = first_divergence(tokens, samples[loop])
    print(f"\nstreaming, {loop}: decoder.decode_step called once per token from Python, its cache "
          f"returned quantized and passed back: {speed:.0f} tokens/s, cache {nbytes:,d} bytes "
          f"({','.join(dtypes)}), text {'the same as the loop' if div is None else f'differs from the loop at token {div}'}")
    return rows, dict(tokens=tokens, speed=speed, dtypes=dtypes, nbytes=nbytes, divergence=div)


if __name__ == "__main__":
    main()
