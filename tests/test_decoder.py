"""examples/decoder.py: the plain-JAX Llama-style decoder that examples and benchmarks import.

The default run uses the tiny config at random init (no training): shapes, causal masking,
rotary embeddings, grouped-query attention, the cached decode path against ``forward``,
a jitted ``generate``, the data split and the parameter cache. ``-m slow`` trains the tiny
model (400 steps, 1 to 2 minutes) and checks it learned.
"""
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import decoder
from jaxpr_utils import all_eqns

CONFIG = decoder.TINY
# jitted: one compilation per shape (an eager scan compiles at every call)
forward = jax.jit(decoder.forward)
rope = jax.jit(decoder.rope, static_argnums=2)


@pytest.fixture(scope="module")
def params():
    return jax.jit(decoder.init_params, static_argnums=0)(CONFIG, jax.random.key(0))


@pytest.fixture(scope="module")
def tokens():
    return next(decoder.batches("train", 2, 24, 1, seed=0))


def test_shapes_and_config(params, tokens):
    layers = params["layers"]
    assert layers["wq"].shape == (CONFIG.n_layers, 128, 4 * 32)
    assert layers["wk"].shape == layers["wv"].shape == (CONFIG.n_layers, 128, 2 * 32)
    assert layers["w_down"].shape == (CONFIG.n_layers, 384, 128)
    assert decoder.Config.from_params(params) == CONFIG
    logits = forward(params, tokens)
    assert logits.shape == (2, 24, 256) and logits.dtype == jnp.float32
    # near-uniform predictions at init: about log(256) nats
    assert abs(float(jax.jit(decoder.loss)(params, tokens)) - np.log(256)) < 0.1


@pytest.mark.parametrize("config", [decoder.DEFAULT, decoder.TINY], ids=["default", "tiny"])
def test_one_scan_of_dense_matmuls_contracting_over_multiples_of_128(config):
    """forward's jaxpr: one scan over the layers; every weight matmul (7 a layer and the tied
    logits) contracts over a multiple of 128; the two attention matmuls over head_dim and T."""
    p = jax.eval_shape(functools.partial(decoder.init_params, config), jax.random.key(0))
    jaxpr = jax.make_jaxpr(decoder.forward)(p, jax.ShapeDtypeStruct((2, 16), jnp.int32))
    assert [e.primitive.name for e in jaxpr.eqns].count("scan") == 1
    contracting = sorted(int(np.prod([e.invars[0].aval.shape[d] for d in e.params["dimension_numbers"][0][0]]))
                         for e in all_eqns(jaxpr) if e.primitive.name == "dot_general")
    d, f = config.d_model, config.d_ff
    assert contracting == sorted([16, config.head_dim] + [d] * 7 + [f])
    assert all(n % 128 == 0 for n in contracting[2:])


def test_causal(params, tokens):
    changed = tokens.copy()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    a, b = forward(params, tokens), forward(params, changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert np.abs(a[:, 10:] - b[:, 10:]).max(axis=-1).min() > 1e-4  # every later position sees it


def test_rope_rotates_by_relative_position():
    x = jax.random.normal(jax.random.key(1), (1, 6, 2, 32))
    y = jax.random.normal(jax.random.key(2), (1, 6, 2, 32))
    pos = jnp.arange(6)
    np.testing.assert_allclose(rope(x, jnp.zeros(6, jnp.int32), 1e4), x, atol=1e-6)
    np.testing.assert_allclose(jnp.linalg.norm(rope(x, pos, 1e4), axis=-1),
                               jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    # <rope(x, m), rope(y, n)> depends on m - n only
    dots = [jnp.sum(rope(x, pos + s, 1e4)[:, :, None] * rope(y, pos, 1e4)[:, None], -1)
            for s in (0, 7)]
    shifted = [jnp.sum(rope(x, pos + s, 1e4)[:, :, None] * rope(y, pos + s, 1e4)[:, None], -1)
               for s in (0, 7)]
    np.testing.assert_allclose(shifted[0], shifted[1], atol=1e-4)
    assert np.abs(dots[0] - dots[1]).max() > 1e-2


def test_grouped_query_attention_equals_multi_head_with_shared_kv(params, tokens):
    """Each key/value head repeated for its query heads: the multi-head model computes the same."""
    group = CONFIG.n_heads // CONFIG.n_kv_heads
    mha = {**params, "layers": dict(params["layers"])}
    for name in ("wk", "wv"):
        w = params["layers"][name].reshape(CONFIG.n_layers, CONFIG.d_model, CONFIG.n_kv_heads, CONFIG.head_dim)
        mha["layers"][name] = jnp.repeat(w, group, axis=2).reshape(CONFIG.n_layers, CONFIG.d_model, -1)
    assert decoder.Config.from_params(mha).n_kv_heads == CONFIG.n_heads
    np.testing.assert_allclose(forward(mha, tokens), forward(params, tokens), atol=1e-5)


def test_cached_decode_matches_forward(params, tokens):
    full = forward(params, tokens)
    logits, cache = jax.jit(decoder.prefill, static_argnums=2)(params, tokens[:, :9], 24)
    assert cache["k"].shape == cache["v"].shape == (CONFIG.n_layers, 2, 24, CONFIG.n_kv_heads, CONFIG.head_dim)
    assert int(cache["pos"]) == 9 and not np.any(cache["k"][:, :, 9:])
    np.testing.assert_allclose(logits, full[:, 8], atol=1e-5)
    step = jax.jit(decoder.decode_step)
    for t in range(9, 24):
        logits, cache = step(params, cache, jnp.asarray(tokens[:, t]))
        np.testing.assert_allclose(logits, full[:, t], atol=1e-5, err_msg=f"position {t}")
    assert int(cache["pos"]) == 24


def test_jitted_generate_is_greedy_decoding(params, tokens):
    prompt = jnp.asarray(tokens[:, :5])
    out = jax.jit(decoder.generate, static_argnames="steps")(params, prompt, steps=8)
    assert out.shape == (2, 8) and out.dtype == jnp.int32
    seq = jnp.zeros((2, 13), jnp.int32).at[:, :5].set(prompt)
    for t in range(5, 13):  # uncached: the whole sequence through forward (causal: the zeros after t are unseen)
        seq = seq.at[:, t].set(jnp.argmax(forward(params, seq)[:, t - 1], -1))
    np.testing.assert_array_equal(out, seq[:, 5:])
    assert decoder.to_text(decoder.to_tokens("def f(x):")[0]) == "def f(x):"


def test_bad_lengths_are_refused_by_name(params, tokens):
    """generate with 0 steps or an empty prompt, and the examples' flags below 1, are
    refused with a line that names them (a scan of length -1 failed inside MLIR)."""
    with pytest.raises(ValueError, match="steps=0 and a prompt of 8 tokens"):
        decoder.generate(params, tokens[:, :8], 0, CONFIG)
    with pytest.raises(ValueError, match="a prompt of 0 tokens"):
        decoder.generate(params, tokens[:, :0], 4, CONFIG)
    import argparse
    for bad in ("0", "-5"):
        with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
            decoder.positive(bad)
    assert decoder.positive("3") == 3
    import generate as G
    with pytest.raises(SystemExit):
        G.main(["--tiny", "--tokens", "0"])


def test_the_examples_count_the_carried_cache_at_every_length(params):
    """examples/generate.py's cache bytes at --length 1 and 2 (a decode loop of 0 and 1
    steps, which it skipped: IndexError) grow by one position per token, as at 3."""
    import generate as G
    sample = decoder.to_tokens("def f(x")
    got = [G.carried_cache_bytes(functools.partial(decoder.generate, steps=n), params, sample)
           for n in (1, 2, 3)]
    (b1, d1), (b2, _), (b3, _) = got
    assert d1 == ["float32"] and b2 - b1 == b3 - b2 > 0, got


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_the_streaming_loop_runs_at_a_length_below_the_calibration_prompts(params):
    """examples/generate.py --length 8: stream() sized the cache for the 17-token sample
    plus 8 and calibrated its prefill on the 32-token training prompts (a negative pad
    width, after minutes of work); the calibration prompts are cut to fit the cache, which
    stays the sample's size (test_kvcache::test_generate_example_runs: its bytes)."""
    import generate as G
    sample = decoder.to_tokens("def __init__(self")
    tokens, _, cache = G.stream(params, sample, 8, G.prompts("train", 4, 100))
    assert np.asarray(tokens).size == 8
    t = [a.shape[2] for a in jax.tree.leaves(cache) if a.ndim >= 3]
    assert t and set(t) == {sample.shape[1] + 8}, t


def test_data_split_and_batches():
    files = decoder.stdlib_files()
    assert len(files) > 100 and files == sorted(files) and not any("site-packages" in f for f in files)
    train, held = decoder.split_bytes("train"), decoder.split_bytes("heldout")
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.1
    a = list(decoder.batches("heldout", 3, 64, 2, seed=5))
    b = list(decoder.batches("heldout", 3, 64, 2, seed=5))
    assert [x.shape for x in a] == [(3, 64)] * 2 and a[0].dtype == np.int32
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], next(decoder.batches("heldout", 3, 64, 1, seed=6)))


def test_parameter_cache_round_trip(params, tmp_path, monkeypatch):
    monkeypatch.setenv("JQT_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_train(config, steps, **settings):
        calls.append((config, steps, settings))
        return params, {"train_seconds": 1.5, "heldout_loss": 2.5}

    monkeypatch.setattr(decoder, "train", fake_train)
    _, info = decoder.load_or_train(CONFIG, 7, batch=4)
    assert not info["loaded"] and os.path.dirname(info["path"]) == str(tmp_path)
    second, info2 = decoder.load_or_train(CONFIG, 7, batch=4)
    assert len(calls) == 1 and info2["loaded"] and info2["heldout_loss"] == 2.5
    assert jax.tree.structure(second) == jax.tree.structure(params)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(second), jax.tree.leaves(params)))


def test_train_takes_one_step():
    """``--steps 1`` (argparse takes any N >= 1) crashed in optax: a warmup of 1 step out
    of 1 left the cosine decay 0 steps (hunt58_docsclaims). One step now trains at lr."""
    before = decoder.init_params(CONFIG, jax.random.key(0))
    params, info = decoder.train(CONFIG, 1, batch=2, seq_len=32, log_every=0)
    assert np.isfinite(info["heldout_loss"])
    assert not np.array_equal(params["embed"], before["embed"])


def test_cache_path(tmp_path, monkeypatch):
    monkeypatch.setenv("JQT_CACHE_DIR", str(tmp_path))
    assert decoder.cache_path().startswith(str(tmp_path) + os.sep)
    # another config, step count or setting is another file; train's defaults are filled in
    paths = {decoder.cache_path(CONFIG, 7, batch=4), decoder.cache_path(CONFIG, 8, batch=4),
             decoder.cache_path(CONFIG, 7, batch=8), decoder.cache_path(decoder.DEFAULT, 7, batch=4)}
    assert len(paths) == 4
    assert decoder.cache_path(CONFIG, 7) == decoder.cache_path(CONFIG, 7, seed=0, log_every=1)
    monkeypatch.delenv("JQT_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert decoder.cache_path().startswith(os.path.join(os.path.expanduser("~"), ".cache", "jqt") + os.sep)
    # the native kernels' folder: $XDG_CACHE_HOME/jqt where it is set; "~" expanded
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert decoder.cache_path().startswith(str(tmp_path / "xdg" / "jqt") + os.sep)
    monkeypatch.setenv("JQT_CACHE_DIR", "~/models")
    assert decoder.cache_path().startswith(os.path.join(os.path.expanduser("~"), "models") + os.sep)


@pytest.mark.slow
def test_tiny_model_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("JQT_CACHE_DIR", str(tmp_path))
    params, info = decoder.load_or_train(decoder.TINY, decoder.TINY_STEPS)
    assert info["heldout_loss"] < 2.3, info  # 2.02 measured; uniform bytes: 5.5 nats
    assert abs(decoder.heldout_loss(params) - info["heldout_loss"]) < 1e-3  # saved, loaded, same model
    out = jax.jit(decoder.generate, static_argnames="steps")(params, decoder.to_tokens("def "), steps=40)
    assert np.all(out < 128), decoder.to_text(out[0])  # ASCII, like the standard library's code


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_bfloat16_weights_give_bfloat16_activations_and_cache(params, tokens):
    """benchmarks/gpu.py runs the decoder in bfloat16: rotary embeddings keep the dtype
    (their cos / sin are computed in float32 and cast), so the layer scan's carry and the
    cache stay bfloat16; the logits follow float32's."""
    p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    prefill = jax.jit(decoder.prefill, static_argnums=(2, 3))
    logits, cache = prefill(p16, tokens[:, :8], 16, CONFIG)
    assert logits.dtype == cache["k"].dtype == cache["v"].dtype == jnp.bfloat16
    step_logits, cache = jax.jit(decoder.decode_step, static_argnums=3)(p16, cache, tokens[:, 8], CONFIG)
    assert step_logits.dtype == cache["k"].dtype == jnp.bfloat16
    ref, _ = prefill(params, tokens[:, :8], 16, CONFIG)
    err = jnp.linalg.norm(logits.astype(jnp.float32) - ref) / jnp.linalg.norm(ref)
    assert float(err) < 0.05


def test_load_or_train_checks_its_cache_folder_before_training_and_names_an_unreadable_file(
        tmp_path, monkeypatch):
    """A cache folder that could not be written failed after training (minutes of it at
    the default size) with a bare FileExistsError; a damaged cached file, with a bare
    BadZipFile naming no file (hunt77_exampleflags)."""
    @functools.wraps(decoder.train)  # (its signature: cache_path binds train's settings)
    def no_training(*a, **k):
        raise AssertionError("trained before checking the folder")

    monkeypatch.setattr(decoder, "train", no_training)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("JQT_CACHE_DIR", str(blocker))
    with pytest.raises(SystemExit, match=r"cannot write the trained decoder to .*a_file.*JQT_CACHE_DIR"):
        decoder.load_or_train(decoder.TINY, 1)
    monkeypatch.setenv("JQT_CACHE_DIR", str(tmp_path / "cache"))
    path = decoder.cache_path(decoder.TINY, 1)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 not a zip")
    with pytest.raises(SystemExit, match=r"the cached decoder .*decoder-.*\.npz cannot be read .*delete it"):
        decoder.load_or_train(decoder.TINY, 1)
