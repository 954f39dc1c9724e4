"""Quantized key/value caches (issue 13): a cache carried by a decode loop is stored
quantized on the integer path, simulated on the float path, and the function is
otherwise unchanged."""
import dataclasses
import functools
import math
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jqt
from jqt._src import compat
from shared import all_eqns

L, H, DH, DM, V, T, B = 2, 2, 8, 16, 32, 10, 2


def _params(seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    n = lambda k, s, fan: jax.random.normal(k, s) * fan ** -0.5
    return {"emb": n(ks[0], (V, DM), 1.0),
            "layers": {"wq": n(ks[1], (L, DM, H * DH), DM), "wk": n(ks[2], (L, DM, H * DH), DM),
                       "wv": n(ks[3], (L, DM, H * DH), DM), "wo": n(ks[4], (L, H * DH, DM), H * DH)},
            "out": n(ks[5], (DM, V), DM)}


def _dus(buf, x, pos):
    return lax.dynamic_update_slice(buf, x[:, None], (0, pos, 0, 0))


def _scatter(buf, x, pos):
    return buf.at[:, pos].set(x)


def _per_sequence(buf, x, pos):
    """Each sequence's own position (a ragged batch): ``jax.vmap`` of the write over the
    batch with a batched index, which JAX turns into a ``scatter`` that indexes every
    axis of the buffer, the head's features too."""
    at = jnp.full((B,), pos)
    return jax.vmap(lambda c, v, i: lax.dynamic_update_slice(c, v[None], (i, 0, 0)))(buf, x, at)


def _step(p, cache, tok, pos, write):
    """One token (B,) at position pos through the layers (a scan over stacked weights),
    writing its keys and values into the per-layer cache slices."""
    h = p["emb"][tok]

    def layer(h, xs):
        lp, kc, vc = xs
        q, k, v = [(h @ lp[w]).reshape(B, H, DH) for w in ("wq", "wk", "wv")]
        kc, vc = write(kc, k, pos), write(vc, v, pos)
        s = jnp.einsum("bhd,bthd->bht", q, kc) / math.sqrt(DH)
        s = jnp.where(jnp.arange(T) <= pos, s, -1e30)
        o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, axis=-1), vc).reshape(B, H * DH)
        return h + o @ lp["wo"], (kc, vc)

    h, (k, v) = lax.scan(layer, h, (p["layers"], cache[0], cache[1]))
    return h @ p["out"], (k, v)


def _empty():
    return (jnp.zeros((L, B, T, H, DH)), jnp.zeros((L, B, T, H, DH)))


def teacher(p, tokens, write=_dus):
    """Logits (n, B, V) of every position of tokens (B, n), fed one token per step
    (a scan over steps, each a scan over layers, the cache in the carry)."""
    def body(carry, tok):
        cache, pos = carry
        logits, cache = _step(p, cache, tok, pos, write)
        return (cache, pos + 1), logits
    return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]


def teacher_masked(p, tokens, lengths):
    """teacher, each sequence's cache frozen once it reaches its length (``lengths``, (B,)):
    ``jnp.where(live, written, cache)`` before the loop carries it on."""
    def body(carry, tok):
        cache, pos = carry
        logits, new = _step(p, cache, tok, pos, _dus)
        live = (pos < lengths)[None, :, None, None, None]
        return (tuple(jnp.where(live, n, c) for n, c in zip(new, cache)), pos + 1), logits
    return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]


def teacher_while(p, tokens):
    """The same with a while_loop over steps; the logits collected in a carried buffer
    (written, never read: not a cache)."""
    n = tokens.shape[1]

    def body(c):
        cache, pos, out = c
        logits, cache = _step(p, cache, lax.dynamic_index_in_dim(tokens, pos, 1, False), pos, _dus)
        return cache, pos + 1, lax.dynamic_update_slice(out, logits[None], (pos, 0, 0))
    return lax.while_loop(lambda c: c[1] < n, body, (_empty(), jnp.int32(0), jnp.zeros((n, B, V))))[2]


def _step_one(p, cache, tok, pos):
    """_step for one sequence: a cache of (L, T, H, DH) per keys and values."""
    def layer(h, xs):
        lp, kc, vc = xs
        q, k, v = [(h @ lp[w]).reshape(H, DH) for w in ("wq", "wk", "wv")]
        kc = lax.dynamic_update_slice(kc, k[None], (pos, 0, 0))
        vc = lax.dynamic_update_slice(vc, v[None], (pos, 0, 0))
        s = jnp.where(jnp.arange(T) <= pos, jnp.einsum("hd,thd->ht", q, kc) / math.sqrt(DH), -1e30)
        o = jnp.einsum("ht,thd->hd", jax.nn.softmax(s, axis=-1), vc).reshape(H * DH)
        return h + o @ lp["wo"], (kc, vc)

    h, cache = lax.scan(layer, p["emb"][tok], (p["layers"],) + cache)
    return h @ p["out"], cache


def teacher_vmapped(p, tokens):
    """teacher's loop written for one sequence and vmapped over the batch inside the
    function: the scan over layers reads the loop's cache through a transpose (vmap moves
    the batch axis behind the layer axis), and the loop carries it back through another.
    Logits (B, n, V)."""
    def one(tokens):
        def body(carry, tok):
            cache, pos = carry
            logits, cache = _step_one(p, cache, tok, pos)
            return (cache, pos + 1), logits
        empty = jnp.zeros((L, T, H, DH))
        return lax.scan(body, ((empty, empty), jnp.int32(0)), tokens)[1]
    return jax.vmap(one)(tokens)


def until(p, tokens, n):
    """One sequence's logits (len(tokens), V), fed its tokens until its own length ``n``
    (a while_loop whose stop depends on the sequence; the rest stays 0)."""
    def body(c):
        cache, pos, out = c
        logits, cache = _step_one(p, cache, tokens[pos], pos)
        return cache, pos + 1, out.at[pos].set(logits)
    empty = jnp.zeros((L, T, H, DH))
    init = ((empty, empty), jnp.int32(0), jnp.zeros((tokens.shape[0], V)))
    return lax.while_loop(lambda c: c[1] < n, body, init)[2]


def greedy(p, first, steps):
    """Greedy generation from first tokens (B,)."""
    def body(carry, _):
        cache, pos, tok = carry
        logits, cache = _step(p, cache, tok, pos, _dus)
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        return (cache, pos + 1, tok), tok
    return lax.scan(body, (_empty(), jnp.int32(0), first), None, length=steps)[1].T


@pytest.fixture(scope="module")
def setup():
    p = _params()
    toks = [jax.random.randint(jax.random.key(10 + i), (B, 8), 0, V) for i in range(3)]
    return p, [(t,) for t in toks[:2]], toks[2]


def _carry_avals(fn, *args):
    """The avals carried by the outermost loop of fn's jaxpr."""
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            nc, nk = compat.scan_counts(e)
            return [v.aval for v in e.invars[nc:nc + nk]]
        if e.primitive.name == "while":
            return [v.aval for v in e.invars[e.params["cond_nconsts"] + e.params["body_nconsts"]:]]
    raise AssertionError("no loop")


_CPU, _FP8_NATIVE = jqt.KernelPolicy.for_backend("cpu"), jqt.KernelPolicy(fp8_native=True)


@pytest.mark.parametrize("kind,code_dtype,bits,policy", [
    (True, jnp.int8, 8, _CPU), ("int4", jnp.uint8, 4, _CPU),
    ("fp8", jnp.uint8, 8, _CPU),  # fp8 codes as their bits where fp8 is not native
    pytest.param("fp8", jnp.float8_e4m3fn, 8, _FP8_NATIVE, marks=pytest.mark.slow)])  # CI
@pytest.mark.slow_variants
def test_the_loop_carries_the_cache_quantized(setup, kind, code_dtype, bits, policy):
    p, cal, x = setup
    qp = jqt.calibrate(teacher, jqt.recipes.w8a8_dynamic(kv_cache=kind), p, cal, progress=False)
    caches = [k for k in qp if k.startswith("kv_cache")]
    assert len(caches) == 2 and all(not qp[k].is_float for k in caches)
    carried = _carry_avals(jqt.quantize(teacher, qp, policy=policy), p, x)
    assert not [a for a in carried if a.ndim and a.shape[-1] == DH and a.dtype == jnp.float32]  # no float cache
    codes = [a for a in carried if a.dtype == code_dtype]
    scales = [a for a in carried if a.dtype == jnp.float16]
    assert len(codes) == 2 and len(scales) == 2
    assert codes[0].shape[:-1] == (L, B, T, H) and scales[0].shape == (L, B, T, H, 1)
    vectors = 2 * L * B * T * H  # keys and values: one float16 scale per vector of DH
    q_bytes = sum(math.prod(a.shape) * a.dtype.itemsize for a in codes + scales)
    assert q_bytes == vectors * (DH * bits // 8 + 2)  # 0.27x float32 at DH = 32 for int8
    # kept float without kv_cache: the carry holds the float buffers
    qp0 = jqt.calibrate(teacher, jqt.recipes.w8a8_dynamic(), p, cal, progress=False)
    assert all(qp0[k].is_float for k in caches)
    assert [a for a in _carry_avals(jqt.quantize(teacher, qp0), p, x) if a.ndim and a.shape[-1] == DH
            and a.dtype == jnp.float32]


_FNS = {"scan-dus": teacher, "scan-scatter": functools.partial(teacher, write=_scatter),
        "scan-per-sequence": functools.partial(teacher, write=_per_sequence), "while": teacher_while}
_CASES = [("scan-dus", "int4"), ("scan-scatter", True)]  # the default run; every other pair is
# slow (a while loop with a cache: test_collected_outputs_are_not_a_cache in the default run)
_SLOW = [pytest.param(f, k, marks=pytest.mark.slow) for f in _FNS for k in (True, "int4", "fp8")
         if (f, k) not in _CASES]


@pytest.mark.parametrize("fn,kind", _CASES + _SLOW)
@pytest.mark.slow_variants
def test_integer_matches_simulated(setup, kind, fn):
    fn = _FNS[fn]
    p, cal, x = setup
    qp = jqt.calibrate(fn, jqt.recipes.w8(kv_cache=kind), p, cal, progress=False)
    assert [k for k in qp if k.endswith(("kv_cache_0", "kv_cache_1")) and not qp[k].is_float]
    assert not [k for k in qp if qp[k].op in ("scatter", "dynamic_update_slice") and qp[k].is_float]
    y_int = jax.jit(jqt.quantize(fn, qp))(p, x)
    y_sim = jax.jit(jqt.quantize(fn, qp, simulate=True))(p, x)
    y_f = fn(p, x)
    np.testing.assert_allclose(y_int, y_sim, atol=2e-4 * float(jnp.abs(y_f).max()), rtol=1e-4)
    # the cache's rounding is visible, and the integer path follows it: the simulated
    # outputs without cache quantization are much further away
    qp0 = jqt.calibrate(fn, jqt.recipes.w8(), p, cal, progress=False)
    y_sim0 = jqt.quantize(fn, qp0, simulate=True)(p, x)
    d_cache, d_int = float(jnp.abs(y_sim - y_sim0).max()), float(jnp.abs(y_int - y_sim).max())
    assert d_int < 0.1 * d_cache
    # and the result stays close to float (int4 coarsest)
    rel = float(jnp.linalg.norm(y_int - y_f) / jnp.linalg.norm(y_f))
    assert rel < {True: 0.03, "int4": 0.15, "fp8": 0.05}[kind]


def test_an_fp8_cache_held_as_bits_decodes_to_the_same_outputs(setup):
    """Where fp8 is not native (the CPU table) the loop carries fp8 codes as uint8 bits
    (XLA:CPU computed on a carried fp8 buffer in float16, converting the whole cache at
    every step: 5.5x a float cache); the outputs equal those of an fp8 buffer."""
    p, cal, x = setup
    qp = jqt.calibrate(teacher, jqt.recipes.w8(kv_cache="fp8"), p, cal, progress=False)
    carried = [_carry_avals(jqt.quantize(teacher, qp, policy=pol), p, x) for pol in (_CPU, _FP8_NATIVE)]
    assert [a.dtype for a in carried[0] if a.ndim == 5 and a.shape[-1] == DH] == [jnp.uint8] * 2
    assert [a.dtype for a in carried[1] if a.ndim == 5 and a.shape[-1] == DH] == [jnp.float8_e4m3fn] * 2
    # fp8 matmuls run weight-only on both (w8): only the cache's storage differs
    native = dataclasses.replace(_CPU, fp8_native=True)
    y_bits, y_fp8 = (jax.jit(jqt.quantize(teacher, qp, policy=pol))(p, x) for pol in (_CPU, native))
    np.testing.assert_array_equal(y_bits, y_fp8)


@pytest.mark.slow  # CI
def test_int4_cache_with_an_odd_head_dimension(monkeypatch):
    """Head vectors of odd length do not pack two codes per byte: the int4 cache keeps
    one int8 code per byte, and the integer path still follows the simulated one."""
    monkeypatch.setattr(sys.modules[__name__], "DH", 7)
    p = _params()
    cal = [(jax.random.randint(jax.random.key(20), (B, 8), 0, V),)]
    qp = jqt.calibrate(teacher, jqt.recipes.w8(kv_cache="int4"), p, cal, progress=False)
    carried = _carry_avals(jqt.quantize(teacher, qp), p, cal[0][0])
    assert [a.shape for a in carried if a.dtype == jnp.int8] == [(L, B, T, H, 7)] * 2
    y_int = jax.jit(jqt.quantize(teacher, qp))(p, *cal[0])
    y_sim = jax.jit(jqt.quantize(teacher, qp, simulate=True))(p, *cal[0])
    np.testing.assert_allclose(y_int, y_sim, atol=2e-4 * float(jnp.abs(y_sim).max()), rtol=1e-4)


@pytest.mark.parametrize("kind", [True, "int4", "fp8"])
@pytest.mark.slow_variants
def test_a_cache_written_back_unchanged_does_not_drift(kind):
    """Each step reads the cache and writes a slice of it back as it was: that re-encodes
    decoded values, which must give the same codes and scales again (a float16 scale one
    step larger per encoding made them grow ~2**-10 per step, on both paths)."""
    w = {"w": jax.random.normal(jax.random.key(1), (DH, 4))}

    def f(p, buf):
        def body(buf, _):
            layer = buf[0]
            out = jnp.sum(layer @ p["w"])
            return lax.dynamic_update_index_in_dim(buf, layer, 0, 0), out
        return lax.scan(body, buf, None, length=300)[1]

    x = jax.random.normal(jax.random.key(0), (1, T, DH))
    qp = jqt.calibrate(f, jqt.recipes.w8(kv_cache=kind), w, [(x,)], progress=False)
    assert not qp["kv_cache_0"].is_float
    for y in (jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w), x),
              jax.jit(jqt.quantize(f, qp, simulate=True))(w, x)):
        np.testing.assert_array_equal(y, jnp.full_like(y, y[0]))


@pytest.mark.parametrize("kind", [True, "int4", "fp8"])
@pytest.mark.parametrize("shift", ["dus", "at"])
@pytest.mark.slow_variants
def test_a_window_shifted_in_place_keeps_its_codes(kind, shift):
    """A fixed window that shifts left by writing the cache's own slice into it
    (``dynamic_update_slice(c, c[1:], 0)`` or ``c.at[:-1].set(c[1:])``) and writes the new
    vector last: the integer path failed on the quantized slice (AttributeError deep in
    kvcache.write); it now copies its codes and scales, as the simulation re-quantizes
    them to the same values."""
    w_, d = 8, 16
    ks = jax.random.split(jax.random.key(0), 3)
    p = {"wk": jax.random.normal(ks[0], (d, d)), "wv": jax.random.normal(ks[1], (d, d))}

    def f(p, xs):
        def step(c, x):
            k = x @ p["wk"]
            c = lax.dynamic_update_slice(c, c[1:], (0, 0)) if shift == "dus" else c.at[:-1].set(c[1:])
            c = c.at[-1].set(k)
            return c, jax.nn.softmax(c @ x) @ c + x @ p["wv"]
        return lax.scan(step, jnp.zeros((w_, d)), xs)[1]

    xs = jax.random.normal(ks[2], (12, d))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(kv_cache=kind), p, [(xs,)], progress=False)
    assert sorted(k for k in qp if k.startswith("kv_cache")) == ["kv_cache_0", "kv_cache_1"]
    qf = jqt.quantize(f, qp)
    jaxpr = jax.make_jaxpr(qf)(p, xs)
    scan = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
    carried = [v.aval for v in scan.outvars[:scan.params["num_carry"]]]
    assert any(a.dtype in (jnp.int8, jnp.uint8) and a.shape[0] == w_ for a in carried), carried
    y_int = jax.jit(qf)(jqt.pack(qp, p), xs)
    y_sim = jax.jit(jqt.quantize(f, qp, simulate=True))(p, xs)
    np.testing.assert_allclose(y_int, y_sim, atol=1e-4 * float(jnp.abs(y_sim).max()), rtol=1e-4)


@pytest.mark.parametrize("kind,code_dtype", [(True, jnp.int8), ("int4", jnp.uint8)])
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_a_decode_loop_vmapped_inside_the_function_carries_its_cache_quantized(setup, kind, code_dtype):
    """A loop vmapped over the batch inside the function reads and returns its cache through
    transposes (the batch axis moved behind the layer axis for the scan over layers): the
    cache is found, carried quantized, and the outputs are teacher's (the same loop batched
    by hand) with the same qparams. The cache stayed float before (the analysis did not
    follow the transposes)."""
    p, cal, x = setup
    qp = jqt.calibrate(teacher_vmapped, jqt.recipes.w8a8_dynamic(kv_cache=kind), p, cal, progress=False)
    caches = [k for k in qp if "kv_cache" in k]  # vmap()/kv_cache_0: under vmap's name
    assert len(caches) == 2 and all(not qp[k].is_float for k in caches), jqt.summarize(qp)
    qf = jqt.quantize(teacher_vmapped, qp)
    carried = _carry_avals(qf, p, x)
    assert not [a for a in carried if a.ndim and a.shape[-1] == DH and a.dtype == jnp.float32]
    assert [a.shape[:-1] for a in carried if a.dtype == code_dtype] == [(B, L, T, H)] * 2
    y = jax.jit(qf)(jqt.pack(qp, p), x)
    np.testing.assert_allclose(y, jqt.quantize(teacher_vmapped, qp, simulate=True)(p, x), rtol=1e-5, atol=1e-5)
    by_hand = jqt.quantize(teacher, jqt.calibrate(teacher, jqt.recipes.w8a8_dynamic(kv_cache=kind), p, cal,
                                                  progress=False))(p, x)
    np.testing.assert_allclose(y, jnp.swapaxes(by_hand, 0, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_a_decode_loop_vmapped_with_a_stop_per_sequence(setup):
    """``jax.vmap`` of a decode ``while_loop`` that stops at each sequence's own length: a
    while whose predicate is batched. Its cache is carried quantized, a finished sequence
    keeping its codes and scales, and each sequence's logits are those of the loop run
    alone (calibrated alone: the weights' qparams and the caches' types are the same)."""
    p, cal, x = setup
    ns = jnp.array([3, 8], jnp.int32)
    f = lambda p, toks, ns: jax.vmap(lambda t, n: until(p, t, n))(toks, ns)
    qp = jqt.calibrate(f, jqt.recipes.w8a8_dynamic(kv_cache=True), p, [(c[0], ns) for c in cal], progress=False)
    assert len([k for k in qp if "kv_cache" in k]) == 2
    assert [a.shape for a in _carry_avals(jqt.quantize(f, qp), p, x, ns) if a.dtype == jnp.int8] == [(B, L, T, H, DH)] * 2
    y = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x, ns)
    qa = jqt.calibrate(until, jqt.recipes.w8a8_dynamic(kv_cache=True), p, [(c[0][0], 8) for c in cal], progress=False)
    alone = jnp.stack([jqt.quantize(until, qa)(p, t, n) for t, n in zip(x, ns)])
    np.testing.assert_allclose(y, alone, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(y[0, 3:]).max()) == 0.0  # the first sequence stopped after 3 tokens


def _carried_quantized_as_teacher(f, setup, per_row, kind, code_dtype, writes=2):
    """``f(p, tokens, per_row)``, teacher with the second sequence's cache changed from step
    3 on (``per_row``: (B,)) and the first's never: calibrated without a warning, its two
    caches carried quantized (codes of ``code_dtype``, or any non-float where ``None``), the
    integer path matching the simulated one, the first sequence teacher's logits."""
    p, cal, x = setup
    rec = jqt.recipes.w8a8_dynamic(kv_cache=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(f, rec, p, [(c[0], per_row) for c in cal], progress=False)
    assert len([k for k in qp if k.startswith("kv_cache")]) == writes
    carried = _carry_avals(jqt.quantize(f, qp), p, x, per_row)
    assert not [a for a in carried if a.ndim and a.shape[-1] == DH and a.dtype == jnp.float32]
    assert len([a for a in carried if a.ndim == 5 and a.dtype != jnp.float16
                and (code_dtype is None or a.dtype == code_dtype)]) == 2
    # nothing in the loop decodes the whole cache (jnp.where's own jit around it did,
    # hunt32_sampling); zeros made of a literal, which nothing reads, aside
    loop = next(e for e in jax.make_jaxpr(jqt.quantize(f, qp))(p, x, per_row).jaxpr.eqns
                if e.primitive.name == "scan")
    whole = [e for e in all_eqns(loop.params["jaxpr"]) for v in e.outvars
             if v.aval.shape == _empty()[0].shape and jnp.issubdtype(v.aval.dtype, jnp.floating)
             and not all(compat.is_literal(i) for i in e.invars)]
    assert not whole, whole[0]
    packed = jqt.pack(qp, p)
    out = jax.jit(jqt.quantize(f, qp))(packed, x, per_row)
    sim = jqt.quantize(f, qp, simulate=True)(p, x, per_row)
    np.testing.assert_allclose(out, sim, rtol=1e-5, atol=1e-5)
    free = jqt.quantize(teacher, jqt.calibrate(teacher, rec, p, cal, progress=False))(packed, x)
    np.testing.assert_allclose(out[:, 0], free[:, 0], rtol=1e-6, atol=1e-6)  # never changed
    assert float(jnp.abs(out[3:, 1] - free[3:, 1]).max()) > 1e-3  # changed at step 3


def teacher_bounded(p, tokens, stop):
    """teacher as equinox's ``while_loop(kind="bounded")`` runs a loop: a scan over the
    steps that copies its carry and runs each step under a ``lax.cond`` (the identity once
    ``pos`` reaches ``stop``), the logits collected in a carried buffer (not a cache)."""
    n = tokens.shape[1]

    def step(cache, pos, logs):
        tok = lax.dynamic_index_in_dim(tokens, pos, 1, False)
        logits, cache = _step(p, cache, tok, pos, _dus)
        return cache, pos + 1, logs.at[pos].set(logits)

    def body(carry, _):
        carry = jax.tree_util.tree_map(jnp.copy, carry)
        return lax.cond(carry[1] < stop, step, lambda *c: c, *carry), None
    return lax.scan(body, (_empty(), jnp.int32(0), jnp.zeros((n, B, V))), None, length=n)[0][2]


def test_a_cache_copied_under_a_cond_in_a_scan_stays_quantized(setup):
    """A copy of the carried cache (equinox's bounded while_loop copies its carry) was
    read as a use of a float buffer: the integer path decoded the cache there, and the
    cond's branches then returned a quantized and a float cache, which lax.switch refused
    (a JAX pytree error naming no op); the copied logits buffer counted as read, so it
    was quantized as a cache. Copies now pass the cache on quantized, and do not read."""
    p, cal, x = setup
    rec = jqt.recipes.w8a8_dynamic(kv_cache=True)
    stop = jnp.int32(100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(teacher_bounded, rec, p, [(c[0], stop) for c in cal], progress=False)
    assert len([k for k in qp if k.startswith("kv_cache")]) == 2  # keys and values, not logits
    carried = _carry_avals(jqt.quantize(teacher_bounded, qp), p, x, stop)
    assert [str(a.dtype) for a in carried if a.ndim == 5 and a.dtype != jnp.float16] == ["int8"] * 2
    assert [a for a in carried if a.shape == (x.shape[1], B, V)][0].dtype == jnp.float32
    out = jax.jit(jqt.quantize(teacher_bounded, qp))(jqt.pack(qp, p), x, stop)
    np.testing.assert_allclose(out, jqt.quantize(teacher_bounded, qp, simulate=True)(p, x, stop),
                               rtol=1e-5, atol=1e-5)
    free = jqt.quantize(teacher, jqt.calibrate(teacher, rec, p, cal, progress=False))(p, x)
    np.testing.assert_allclose(out, free, rtol=1e-5, atol=1e-5)
    short = jax.jit(jqt.quantize(teacher_bounded, qp))(p, x, jnp.int32(3))  # the identity taken
    np.testing.assert_allclose(short[:3], free[:3], rtol=1e-5, atol=1e-5)
    assert not jnp.any(short[3:])


def teacher_fenced(p, tokens):
    """teacher with each step's cache passed through an ``optimization_barrier`` and a
    ``stop_gradient`` before the step writes and reads it."""
    def body(carry, tok):
        cache, pos = carry
        cache = lax.stop_gradient(lax.optimization_barrier(cache))
        logits, cache = _step(p, cache, tok, pos, _dus)
        return (cache, pos + 1), logits
    return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]


def test_a_barrier_and_a_gradient_stop_on_the_cache_hold_on_its_codes(setup):
    """A copy passes the cache on quantized; an optimization_barrier or a stop_gradient
    on it was dropped there (the cache passed on as it came), losing what f asked of
    XLA and of the gradient. Both now apply to the cache's codes and scales."""
    p, cal, x = setup
    qp = jqt.calibrate(teacher_fenced, jqt.recipes.w8a8_dynamic(kv_cache=True), p, cal,
                       progress=False)
    run = jqt.quantize(teacher_fenced, qp)
    eqns = list(all_eqns(jax.make_jaxpr(run)(jqt.pack(qp, p), x)))
    fenced = {e.primitive.name: [str(v.aval.dtype) for v in e.invars] for e in eqns
              if e.primitive.name in ("optimization_barrier", "stop_gradient")
              and len(e.invars) > 1 or e.primitive.name == "stop_gradient"}  # (not jqt's own
    # barrier on one matmul's activation codes, dense.DenseAxes.act_2d)
    assert fenced["optimization_barrier"].count("int8") == 2, fenced  # keys and values
    assert "int8" in [str(e.invars[0].aval.dtype) for e in eqns if e.primitive.name == "stop_gradient"]
    free = jqt.quantize(teacher, jqt.calibrate(teacher, jqt.recipes.w8a8_dynamic(kv_cache=True),
                                               p, cal, progress=False))(p, x)
    np.testing.assert_allclose(run(jqt.pack(qp, p), x), free, rtol=1e-5, atol=1e-5)


def test_a_sharding_constraint_and_a_checkpoint_name_on_the_cache_keep_it_quantized(setup):
    """Model code that pins the cache's layout (``with_sharding_constraint`` on a split of
    batch, heads or time; ``reshard`` on explicit axes) or names it for a remat policy:
    the cache was decoded to float32 there every step, the loop still carrying int8
    (attention read the float copy, and the whole cache was re-encoded; hunt68_kvshard).
    The constraint and the name now apply to its codes and scales alike."""
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import NamedSharding, PartitionSpec as P
    p, cal, x = setup
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    pin = lambda c: jax.lax.with_sharding_constraint(c, NamedSharding(mesh, P(None, "d")))

    def placed(p, tokens):
        def body(carry, tok):
            cache, pos = carry
            cache = checkpoint_name(pin(cache), "kv")
            logits, cache = _step(p, cache, tok, pos, _dus)
            return (pin(cache), pos + 1), logits
        return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]

    rec = jqt.recipes.w8a8_dynamic(kv_cache=True)
    qp = jqt.calibrate(placed, rec, p, cal, progress=False)
    run = jqt.quantize(placed, qp)
    eqns = list(all_eqns(jax.make_jaxpr(run)(jqt.pack(qp, p), x)))
    for name in ("sharding_constraint", "name"):
        assert "int8" in [str(e.invars[0].aval.dtype) for e in eqns if e.primitive.name == name], name
    # no float32 copy of a layer's whole cache: codes times scales at its shape
    assert not [e for e in eqns if e.primitive.name == "mul"
                and e.outvars[0].aval.shape == (B, T, H, DH) and e.outvars[0].aval.dtype == jnp.float32]
    free = jqt.quantize(teacher, jqt.calibrate(teacher, rec, p, cal, progress=False))(p, x)
    np.testing.assert_allclose(run(jqt.pack(qp, p), x), free, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
@pytest.mark.parametrize("kind,code_dtype", [(True, jnp.int8), ("int4", jnp.uint8)])
@pytest.mark.slow_variants
def test_a_cache_frozen_with_jnp_where_after_the_write_is_a_cache(setup, kind, code_dtype):
    """``jnp.where(live, written, cache)`` after the write (a finished sequence's cache
    frozen) picks whole vectors: the buffer is still the cache, carried quantized, its
    codes and scales picked alike. A sequence that never finishes gets teacher's logits
    (the same qparams' cache types); the integer path matches the simulated one. The
    buffer stayed float before (calibrate warned that no loop carries a cache)."""
    _carried_quantized_as_teacher(teacher_masked, setup, jnp.array([T, 3], jnp.int32), kind, code_dtype)


def teacher_masked_broadcast(p, tokens, lengths, how="broadcast_to"):
    """teacher_masked with the flag broadcast to the cache's shape before ``jnp.where``
    (``jnp.broadcast_to``), or made there from an iota along the batch axis: ``jnp.where``
    selects inside its own jit, where the broadcast is not seen."""
    shape = _empty()[0].shape
    ends = jnp.broadcast_to(lengths[None, :, None, None, None], shape)  # before the loop

    def body(carry, tok):
        cache, pos = carry
        logits, new = _step(p, cache, tok, pos, _dus)
        if how == "broadcast_to":
            live = jnp.broadcast_to((pos < lengths)[None, :, None, None, None], shape)
        elif how == "before_the_loop":
            live = pos < ends
        elif how == "combined":  # one op of a full flag and a flag of size-1 axes
            live = (pos < ends) & (lengths > 0)[None, :, None, None, None]
        else:
            live = lax.broadcasted_iota(jnp.int32, shape, 1) < jnp.sum(pos < lengths)
        return (tuple(jnp.where(live, n, c) for n, c in zip(new, cache)), pos + 1), logits
    return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]


@pytest.mark.parametrize("how", ["broadcast_to", pytest.param("iota", marks=pytest.mark.slow),
                                 pytest.param("before_the_loop", marks=pytest.mark.slow), "combined"])
def test_a_cache_frozen_with_a_flag_broadcast_first_is_a_cache(setup, how):
    """The flag broadcast to the cache's shape before jnp.where (or an iota along the batch
    axis compared): the same along the last axis, so whole vectors, but the buffer stayed
    float, and calibrate advised the jnp.where it was (hunt62_attnlayouts). So too with the
    broadcast made before the loop, and with such a flag and one of size-1 axes combined in
    one op (hunt62_docsgenerate)."""
    f = functools.partial(teacher_masked_broadcast, how=how)
    _carried_quantized_as_teacher(f, setup, jnp.array([T, 3], jnp.int32), True, jnp.int8)


def teacher_cleared(p, tokens, clear_at, zeros="literal"):
    """teacher, each sequence's cache slot cleared with zeros at step ``clear_at`` (B,)
    before that step writes (a finished sequence's slot reused: continuous batching):
    ``jnp.where(clear, 0.0, cache)``, ``jnp.where(clear, jnp.zeros_like(cache), cache)``,
    or the same with zeros made once before the loop (``"hoisted"``)."""
    made = jnp.zeros_like(_empty()[0])

    def body(carry, tok):
        cache, pos = carry
        clear = (pos == clear_at)[None, :, None, None, None]
        zero = {"literal": lambda c: 0.0, "like": jnp.zeros_like, "hoisted": lambda c: made}[zeros]
        cache = tuple(jnp.where(clear, zero(c), c) for c in cache)
        logits, cache = _step(p, cache, tok, pos, _dus)
        return (cache, pos + 1), logits
    return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]


@pytest.mark.parametrize("kind,zeros,code_dtype", [
    (True, "literal", jnp.int8), pytest.param("int4", "like", jnp.uint8, marks=pytest.mark.slow),
    pytest.param("fp8", "hoisted", None, marks=pytest.mark.slow)])
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_a_cache_slot_cleared_with_zeros_stays_a_cache(setup, kind, zeros, code_dtype):
    """``jnp.where(clear, 0.0, cache)`` picks whole zero vectors: the buffer is still the
    cache, carried quantized, a cleared vector taking zero codes and the scale zeros
    encode to. A sequence never cleared gets teacher's logits; the integer path matches
    the simulated one. The whole cache stayed float before, and calibrate warned that no
    loop carries a buffer written with dynamic_update_slice."""
    f = functools.partial(teacher_cleared, zeros=zeros)
    _carried_quantized_as_teacher(f, setup, jnp.array([T + 1, 3], jnp.int32), kind, code_dtype)


def teacher_cleared_by_write(p, tokens, clear_at, how="at_set"):
    """teacher_cleared with the slot cleared by a write of zeros, ``cache.at[:, slots].set(0.0,
    mode="drop")`` (slot B: no sequence) or a ``dynamic_update_slice`` of zeros into the
    slot of the first sequence cleared (the other one rewritten as it is)."""
    def body(carry, tok):
        cache, pos = carry
        clear = pos == clear_at
        if how == "at_set":
            slots = jnp.where(clear, jnp.arange(B), B)
            cache = tuple(c.at[:, slots].set(0.0, mode="drop") for c in cache)
        else:
            row = jnp.argmax(clear)
            zero = jnp.where(clear.any(), 0.0, 1.0)
            cache = tuple(lax.dynamic_update_slice(
                c, zero * lax.dynamic_slice_in_dim(c, row, 1, 1), (0, row, 0, 0, 0)) for c in cache)
        logits, cache = _step(p, cache, tok, pos, _dus)
        return (cache, pos + 1), logits
    return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]


@pytest.mark.parametrize("how", ["at_set", pytest.param("dus", marks=pytest.mark.slow)])
def test_a_cache_slot_cleared_by_a_write_of_zeros_stays_a_cache(setup, how):
    """A slot cleared with ``.at[...].set(0.0)`` (a constant: jqt counted it a weight) or with
    a dynamic_update_slice is a cache write of its own: the buffer stays the cache, carried
    quantized, calibrated without a warning, the integer path matching the simulated one.
    Before, the constant write was no cache write: the whole buffer stayed float, and
    calibrate said the write "covers part of its last axis" (hunt60_beamcache)."""
    f = functools.partial(teacher_cleared_by_write, how=how)
    _carried_quantized_as_teacher(f, setup, jnp.array([T + 1, 3], jnp.int32), True, jnp.int8, writes=4)


def test_a_mask_that_varies_along_the_features_is_not_a_cache(setup):
    """A ``jnp.where`` whose mask differs along the last axis would mix codes under one
    scale: the buffer is not a cache and stays float, and calibrate says so."""
    p, cal, x = setup

    def masked_features(p, tokens):
        def body(carry, tok):
            cache, pos = carry
            logits, new = _step(p, cache, tok, pos, _dus)
            keep = (jnp.arange(DH) % 2 == 0)[None, None, None, None, :]
            if iota:  # an iota along the last axis, and such a mask & a per-sequence flag
                keep = (lax.broadcasted_iota(jnp.int32, cache[0].shape, 4) < DH // 2) \
                    & (pos < 3)[None, None, None, None, None]
            return (tuple(jnp.where(keep, n, c) for n, c in zip(new, cache)), pos + 1), logits
        return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]

    for iota in (False, True):
        with pytest.warns(UserWarning, match="no loop of f carries a buffer"):
            qp = jqt.calibrate(masked_features, jqt.recipes.w8a8_dynamic(kv_cache=True), p, cal,
                               progress=False)
        assert not [k for k in qp if "kv_cache" in k and not qp[k].is_float]


def test_a_cache_added_into_is_named_in_the_warning(setup):
    """``cache.at[:, pos].add(k)`` into a zeroed cache computes what ``.set`` does, but a
    scatter-add is no cache write: the buffer stays float, and the warning, which listed
    the other near misses, did not name it (hunt72_pagedcache)."""
    p, cal, x = setup

    def added(p, tokens):
        def body(carry, tok):
            cache, pos = carry
            logits, new = _step(p, cache, tok, pos, lambda buf, x, pos: buf.at[:, pos].add(x))
            return (new, pos + 1), logits
        return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]

    with pytest.warns(UserWarning, match=r"no loop of f carries a buffer.*added into "
                                         r"\(\.at\[\.\.\.\]\.add; write a zeroed slot with \.at\[\.\.\.\]\.set\)"):
        qp = jqt.calibrate(added, jqt.recipes.w8(kv_cache=True), p, cal, progress=False)
    assert not [k for k in qp if "kv_cache" in k]


def test_collected_outputs_are_not_a_cache(setup):
    """teacher_while's logits buffer is written in the loop but never read: it stays float."""
    p, cal, x = setup
    qp = jqt.calibrate(teacher_while, jqt.recipes.w8(kv_cache=True), p, cal, progress=False)
    assert len([k for k in qp if k.startswith("kv_cache")]) == 2  # only the key and value writes
    out = [a for a in _carry_avals(jqt.quantize(teacher_while, qp), p, x) if a.ndim and a.shape[-1] == V]
    assert out and out[0].dtype == jnp.float32


def test_vmap_over_prompts_and_jit(setup):
    p, cal, _ = setup
    g = lambda p, first: greedy(p, first, 6)  # the step count is static
    qp = jqt.calibrate(g, jqt.recipes.w8a8_dynamic(kv_cache=True), p,
                       [(jnp.arange(B, dtype=jnp.int32),), (jnp.arange(B, 2 * B, dtype=jnp.int32),)],
                       progress=False)
    qg = jax.jit(jqt.quantize(g, qp))
    firsts = jnp.arange(3 * B, dtype=jnp.int32).reshape(3, B) % V
    batched = jax.vmap(qg, in_axes=(None, 0))(p, firsts)
    one_by_one = jnp.stack([qg(p, f) for f in firsts])
    np.testing.assert_array_equal(batched, one_by_one)
    assert batched.dtype == jnp.int32 and batched.shape == (3, B, 6)
    packed = jqt.pack(qp, p)
    np.testing.assert_array_equal(qg(packed, firsts[0]), one_by_one[0])


def test_export_of_the_decode_function(setup):
    p, cal, x = setup
    qp = jqt.calibrate(teacher, jqt.recipes.w8a8_dynamic(kv_cache=True), p, cal, progress=False)
    packed = jqt.pack(qp, p)
    qf = jax.jit(jqt.quantize(teacher, qp))
    exp = jax.export.export(qf)(packed, x)
    restored = jax.export.deserialize(exp.serialize())
    np.testing.assert_allclose(restored.call(packed, x), qf(packed, x), rtol=1e-6, atol=1e-6)
    assert "xi8>" in exp.mlir_module() or "i8" in exp.mlir_module()


@pytest.mark.parametrize("recipe", ["w8a8_dynamic", "w4"])
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_decode_loop_inside_shard_map(setup, recipe):
    """The decode loop as per-device code under ``jax.shard_map``, the batch split: its
    embedding lookup gathers replicated packed codes with split token ids (cast to
    varying first, as lax's own gather casts them), and the cache stays quantized. Each
    device runs what one device runs on its sequences. Its float function casts the empty
    cache to varying (``lax.pcast``), as JAX requires of a loop carry there."""
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
    p, cal, x = setup

    def teacher_in_shard_map(p, tokens):
        empty = lax.pcast(jnp.zeros((L, B, T, H, DH)), ("d",), to="varying")

        def body(carry, tok):
            cache, pos = carry
            logits, cache = _step(p, cache, tok, pos, _dus)
            return (cache, pos + 1), logits
        return lax.scan(body, ((empty, empty), jnp.int32(0)), tokens.T)[1]

    rec = {"w8a8_dynamic": jqt.recipes.w8a8_dynamic(kv_cache=True), "w4": jqt.recipes.w4(group_size=8, kv_cache=True)}[recipe]
    qp = jqt.calibrate(teacher, rec, p, cal, progress=False)
    packed = jqt.pack(qp, p)
    smap = jax.jit(jax.shard_map(jqt.quantize(teacher_in_shard_map, qp), mesh=mesh,
                                 in_specs=(P(), P("d")), out_specs=P(None, "d")))
    np.testing.assert_array_equal(smap(packed, x), jax.jit(jqt.quantize(teacher, qp))(packed, x))


def test_grad_through_the_simulated_cache(setup):
    p, cal, x = setup
    qp = jqt.calibrate(teacher, jqt.recipes.w8a8_dynamic(kv_cache=True), p, cal, progress=False)
    loss = lambda p: jnp.mean(jqt.quantize(teacher, qp, simulate=True)(p, x) ** 2)
    g = jax.jit(jax.grad(loss))(p)
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(g))
    assert float(jnp.abs(g["layers"]["wk"]).sum()) > 0  # flows through the cached keys (straight-through)


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_save_load_and_old_qparams_without_cache_entries(setup, tmp_path):
    p, cal, x = setup
    qp = jqt.calibrate(teacher, jqt.recipes.w8(kv_cache="int4"), p, cal, progress=False)
    jqt.save(tmp_path / "qp.safetensors", qp)
    back = jqt.load(tmp_path / "qp.safetensors")
    assert back["kv_cache_0"].lhs.qtype == qp["kv_cache_0"].lhs.qtype
    np.testing.assert_array_equal(jqt.quantize(teacher, back)(p, x), jqt.quantize(teacher, qp)(p, x))
    # qparams made before caches were quantized have no cache entries: the cache stays float
    old = {k: v for k, v in qp.items() if not k.startswith("kv_cache")}
    y_old = jqt.quantize(teacher, old)(p, x)
    qp_float = jqt.calibrate(teacher, jqt.recipes.w8(), p, cal, progress=False)
    np.testing.assert_allclose(y_old, jqt.quantize(teacher, qp_float)(p, x), rtol=1e-6, atol=1e-6)


@pytest.mark.slow  # the report's cache rows: CI
def test_report_rows_for_cache_writes(setup):
    p, cal, x = setup
    qp = jqt.calibrate(teacher, jqt.recipes.w8(kv_cache="int4"), p, cal, progress=False)
    r = jqt.report(teacher, qp, p, (x,))
    rows = {row.key: row for row in r.rows}
    assert "kv_cache_0" in rows
    assert 10 < rows["kv_cache_0"].sqnr_isolated < 60  # int4 writes: a visible, finite error


def test_writes_that_are_not_a_cache_stay_unchanged(setup):
    """A write that does not span the last axis, or into a buffer no loop carries, is not
    a cache write: no qparams entry, and the function computes what it did."""
    p, cal, x = setup

    def partial_write(p, tokens):
        def body(buf, tok):
            h = p["emb"][tok]
            buf = lax.dynamic_update_slice(buf, h[:, None, :4], (0, 0, 0))
            return buf, jnp.sum(buf[..., :4] @ jnp.ones((4, 3)))
        return lax.scan(body, jnp.zeros((B, 2, DM)), tokens.T)[1]

    def no_loop(p, tokens):
        buf = lax.dynamic_update_slice(jnp.zeros((B, 8, DM)), p["emb"][tokens], (0, 0, 0))
        return buf @ p["out"]

    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def pinned_partial_write(p, tokens):  # the written buffer's layout pinned, as model
        def body(buf, tok):                # code pins a cache (the reason stayed unsaid;
            h = p["emb"][tok]              # hunt68_review2)
            buf = lax.dynamic_update_slice(buf, h[:, None, :4], (0, 0, 0))
            buf = lax.with_sharding_constraint(buf, NamedSharding(mesh, P("d")))
            return buf, jnp.sum(buf[..., :4] @ jnp.ones((4, 3)))
        return lax.scan(body, jnp.zeros((B, 2, DM)), tokens.T)[1]

    for fn, said in ((partial_write, "covers part of its last axis"), (no_loop, "no loop of f carries a buffer"),
                     (pinned_partial_write, "covers part of its last axis")):
        with pytest.warns(UserWarning, match=said):  # said, not silent
            qp = jqt.calibrate(fn, jqt.recipes.w8(kv_cache=True), p, cal, progress=False)
        assert not [k for k in qp if k.startswith("kv_cache")]


@jax.jit
def _half_write(kc, k, pos):
    return kc.at[:, pos, :, :DH // 2].set(k[..., :DH // 2])


def _keys_written(p, toks, how):
    """A decode loop whose keys are written ``how``: in two halves of the last axis, after
    a sink key from params, with jnp.put_along_axis, or half in a jitted helper."""
    def body(carry, tok):
        kc, vc, pos = carry
        h = p["emb"][tok]
        q, k, v = [(h @ p["layers"][n][0]).reshape(B, H, DH) for n in ("wq", "wk", "wv")]
        if how == "halves":
            kc = kc.at[:, pos, :, :DH // 2].set(k[..., :DH // 2]).at[:, pos, :, DH // 2:].set(k[..., DH // 2:])
        elif how == "sink":
            kc = kc.at[:, 0].set(jnp.broadcast_to(p["sink"], (B, H, DH))).at[:, pos + 1].set(k)
        elif how == "put_along":
            at = jnp.broadcast_to(jnp.full((B, 1, 1, 1), pos), (B, 1, H, DH))
            kc = jnp.put_along_axis(kc, at, k[:, None], axis=1, inplace=False)
        else:
            kc = _half_write(kc, k, pos)
        vc = vc.at[:, pos].set(v)
        s = jnp.where(jnp.arange(T) <= pos + 1, jnp.einsum("bhd,bthd->bht", q, kc), -1e30)
        o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1), vc).reshape(B, H * DH)
        return (kc, vc, pos + 1), o @ p["layers"]["wo"][0] @ p["out"]
    z = jnp.zeros((B, T, H, DH))
    return lax.scan(body, (z, z, jnp.int32(0)), toks.T[:T - 1])[1]


def test_a_write_of_single_elements_or_one_in_a_jitted_helper_is_named(setup):
    """jnp.put_along_axis of a token's vectors (a scatter of single elements, inside its
    own jit) left the cache float with only the warning that no loop carries a cache
    (hunt69_servebatch); so did a write of part of the last axis made in a jitted helper,
    whose result only the code after the helper reads."""
    p, cal, x = setup
    gen = _keys_written
    for how, said in (("put_along", r"a scatter of single elements that fills whole vectors of "
                                    r"a buffer .*jnp.put_along_axis.*cache.at\[jnp.arange\(B\), pos\]"),
                      ("jit_half", "covers part of its last axis")):
        with pytest.warns(UserWarning, match=said):
            qp = jqt.calibrate(functools.partial(gen, how=how), jqt.recipes.w8(kv_cache=True), p,
                               cal, progress=False)
        assert len([k for k in qp if k.startswith("kv_cache")]) == 1, how  # the values'

    def beams(p, toks):  # a (B, V) buffer rewritten along its last axis is no cache write
        def body(carry, tok):  # (a review found the first version of the check warning)
            vc, pos, scores = carry
            h = p["emb"][tok]
            q, v = [(h @ p["layers"][n][0]).reshape(B, H, DH) for n in ("wq", "wv")]
            vc = vc.at[:, pos].set(v)
            o = jnp.einsum("bhd,bthd->bhd", q, vc).reshape(B, H * DH)
            order = jnp.argsort(-scores, axis=-1)
            scores = jnp.put_along_axis(scores, order, scores * 0.5, axis=-1, inplace=False)
            scores = scores.at[jnp.arange(B)[:, None], order].set(scores + 1.0)
            return (vc, pos + 1, scores), o @ p["layers"]["wo"][0] @ p["out"] + jnp.sum(scores)
        init = (jnp.zeros((B, T, H, DH)), jnp.int32(0), jnp.zeros((B, 7)))
        return lax.scan(body, init, toks.T[:T - 1])[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(beams, jqt.recipes.w8(kv_cache=True), p, cal, progress=False)
    assert len([k for k in qp if k.startswith("kv_cache")]) == 1


def test_keys_written_in_two_halves_are_named_and_a_sink_from_params_is_a_cache_write(setup):
    """Keys written in two halves of the last axis (rotary features, then the rest): each
    write covers part of it, and calibrate says so, also where the second half is written
    on top of the first (it said nothing before: only a write straight into the carried
    buffer was recorded). A learned sink key written from params (``kc.at[:, 0].set(p[
    "sink"])``) is a cache write like the token's: the cache stays quantized (it stayed
    float without a word: the update counted as a weight; hunt60_beamcache)."""
    p, cal, x = setup
    p = {**p, "sink": jax.random.normal(jax.random.key(5), (H, DH))}

    gen = _keys_written
    halves = functools.partial(gen, how="halves")
    with pytest.warns(UserWarning, match="covers part of its last axis"):
        qp = jqt.calibrate(halves, jqt.recipes.w8(kv_cache=True), p, cal, progress=False)
    assert len([k for k in qp if k.startswith("kv_cache")]) == 1  # the values'
    sink = functools.partial(gen, how="sink")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(sink, jqt.recipes.w8(kv_cache=True), p, cal, progress=False)
    assert len([k for k in qp if k.startswith("kv_cache")]) == 3
    carried = _carry_avals(jqt.quantize(sink, qp), p, x)
    assert [a.dtype for a in carried if a.ndim == 4 and a.shape[-1] == DH] == [jnp.int8, jnp.int8]
    out = jax.jit(jqt.quantize(sink, qp))(jqt.pack(qp, p), x)
    np.testing.assert_allclose(out, jqt.quantize(sink, qp, simulate=True)(p, x), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(out - sink(p, x)).max()) < 0.05 * float(jnp.abs(sink(p, x)).max())

    def stacked(p, x):  # a buffer only weights are written into (layers stacked): no cache
        def body(c, i):
            h, buf = c
            buf = buf.at[i].set(p["layers"]["wq"][i])
            return (jnp.tanh(h @ buf[i]), buf), None
        return lax.scan(body, (p["emb"][x[:, 0]], jnp.zeros((L, DM, H * DH))), jnp.arange(L))[0][0]
    with pytest.warns(UserWarning, match="no loop of f carries a buffer"):
        qp = jqt.calibrate(stacked, jqt.recipes.w8(kv_cache=True), p, cal, progress=False)
    assert not [k for k in qp if k.startswith("kv_cache")]
    plain = jqt.calibrate(stacked, jqt.recipes.w8(), p, cal, progress=False)
    np.testing.assert_array_equal(jqt.quantize(stacked, qp)(p, x), jqt.quantize(stacked, plain)(p, x))


def test_bad_cache_types_are_refused():
    with pytest.raises(ValueError, match="KV cache type"):
        jqt.Rule(weight=jqt.recipes.INT8_WEIGHT, kv_cache=jqt.QuantType(bits=8))
    with pytest.raises(ValueError, match="kv_cache='int3'"):
        jqt.recipes.w8(kv_cache="int3")
    assert jqt.recipes.w4(kv_cache="fp8").rules[0].kv_cache.dtype == "float8_e4m3fn"
    # a recipe given as the cache type: named by its type, not its whole repr, with the
    # field that holds its cache type (hunt73_cachedtypes: an 886-character message)
    with pytest.raises(ValueError, match=r"^kv_cache=a Recipe: .*recipe\.rules\[i\]\.kv_cache") as e:
        jqt.quantize_cache(jnp.ones((2, 4, 8)), jqt.recipes.w8a8_dynamic(kv_cache=True))
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError, match=r"^kv_cache=a Rule: .*rule\.kv_cache\)"):
        jqt.quantize_cache(jnp.ones((2, 4, 8)), jqt.recipes.w8a8_dynamic(kv_cache=True).rules[0])
    with pytest.raises(ValueError, match=r"^kv_cache=\{'kv_cache': 'int8'\}: use True"):
        jqt.quantize_cache(jnp.ones((2, 4, 8)), {"kv_cache": "int8"})


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_buffer_updated_with_where_beside_quantized_caches_is_named(setup):
    """Keys written with dynamic_update_slice are a cache; values updated with
    jnp.where(mask, new, cache) are not, and stay float: calibrate says so, naming the
    carry slot, where it said nothing (the loops with only caches stay silent)."""
    p, cal, x = setup

    def where_write(buf, v, pos):
        return jnp.where((jnp.arange(T) == pos)[None, :, None, None], v[:, None], buf)

    def mixed(p, tokens):
        def body(carry, tok):
            cache, pos = carry
            logits, (k, _) = _step(p, cache, tok, pos, _dus)
            _, (_, v) = _step(p, cache, tok, pos, where_write)
            return ((k, v), pos + 1), logits
        return lax.scan(body, (_empty(), jnp.int32(0)), tokens.T)[1]

    with pytest.warns(UserWarning, match=r"a lax.scan at '<top>' carries key/value caches .*"
                                         r"carry slot \d+ a buffer of the same shape and dtype.*"
                                         r"keys and values only read \(cross-attention"):
        qp = jqt.calibrate(mixed, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)
    assert [k for k in qp if k.startswith("kv_cache")]
    # the loop named by its kind and the loops around it: '<top>' alone read as the
    # while_loop's own carry slot, another buffer (hunt39_specdec)
    out = lambda p, tokens: jnp.zeros(jax.eval_shape(mixed, p, tokens).shape)
    twice = lambda p, tokens: lax.while_loop(lambda c: c[0] < 1, lambda c: (c[0] + 1, mixed(p, tokens)),
                                             (0, out(p, tokens)))[1]
    with pytest.warns(UserWarning, match=r"a lax.scan inside a lax.while_loop at '<top>' carries"):
        jqt.calibrate(twice, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)

    def step(p, cache, tok, pos):  # the same as a step called from Python: it was silent
        logits, (k, _) = _step(p, cache, tok, pos, _dus)
        _, (_, v) = _step(p, cache, tok, pos, where_write)
        return logits, (k, v)
    with pytest.warns(UserWarning, match=r"f takes and returns .*among its arguments and results "
                                         r"a buffer of the same shape and dtype \(float32\["):
        qp = jqt.calibrate(step, jqt.recipes.w8(kv_cache=True), p,
                           [(_empty(), cal[0][0][:, 0], jnp.int32(0))], progress=False)
    assert [k for k in qp if k.startswith("kv_cache")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jqt.calibrate(teacher, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)


def test_every_buffer_of_a_caches_shape_left_float_is_named():
    """A while_loop that carries self-attention caches, written, and the cross-attention
    keys and values, reordered each step (beam search) but never written: the warning
    named one of the two float buffers (hunt41_whisper); now both."""
    b, t, d = 2, 8, 16
    normal = lambda seed, shape: jax.random.normal(jax.random.key(seed), shape)
    p = {"wk": normal(0, (d, d)) * 0.3, "wv": normal(2, (d, d)) * 0.3}

    def gen(p, x, enc):
        xk, xv = enc @ p["wk"], enc @ p["wv"]

        def body(c):
            kc, vc, xk, xv, pos, h = c
            xk, xv = jnp.take(xk, jnp.arange(b), axis=0), jnp.take(xv, jnp.arange(b), axis=0)
            kc = lax.dynamic_update_slice(kc, (h @ p["wk"])[:, None], (0, pos, 0))
            vc = lax.dynamic_update_slice(vc, (h @ p["wv"])[:, None], (0, pos, 0))
            att = lambda k, v: jnp.einsum("bt,btd->bd", jax.nn.softmax(jnp.einsum("bd,btd->bt", h, k)), v)
            return kc, vc, xk, xv, pos + 1, jnp.tanh(h + att(kc, vc) + att(xk, xv))
        z = jnp.zeros((b, t, d))
        return lax.while_loop(lambda c: c[4] < t, body, (z, z, xk, xv, 0, x))[5]

    x, enc = normal(1, (b, d)), normal(3, (b, t, d))
    with pytest.warns(UserWarning, match=r"a lax.while_loop at '<top>' carries key/value caches "
                                         r"that jqt quantizes, and 2 buffers of their shape and dtype "
                                         r"\(float32\[2, 8, 16\]; in carry slot 2, in carry slot 3\)"
                                         r".*those buffers stay float"):
        qp = jqt.calibrate(gen, jqt.recipes.w8a8_dynamic(kv_cache=True), p, [(x, enc)], progress=False)
    assert [k for k in qp if k.startswith("kv_cache")] == ["kv_cache_0", "kv_cache_1"]
    # two such loops: each named (they were counted as one loop's)
    twice = lambda p, x, enc: gen(p, x, enc) + gen(p, x, enc)
    with pytest.warns(UserWarning, match=r"those buffers stay float.*The same holds for the "
                                         r"buffers of another lax.while_loop at '<top>' \(in carry "
                                         r"slot 2, in carry slot 3\)\."):
        jqt.calibrate(twice, jqt.recipes.w8a8_dynamic(kv_cache=True), p, [(x, enc)], progress=False)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_writes_that_miss_the_cache_pattern_are_named(setup):
    """Writes into a buffer a loop carries and reads that jqt cannot quantize as a cache
    are named by calibrate, where they were silent: keys kept transposed, (..., DH, T), and
    written a time column per step (part of the last axis), beside a value cache that is
    quantized; and a bfloat16 cache written with a float32 value by ``.at[...].set`` (JAX
    converts the whole buffer). A step calibrated on float32 caches and given bfloat16 ones
    says so. A buffer the loop only collects results in, written a column per step, stays
    silent."""
    p, cal, x = setup

    def transposed_keys(p, tokens):
        def body(carry, tok):
            (kt, vc), pos = carry
            h = p["emb"][tok]
            lp = jax.tree.map(lambda a: a[0], p["layers"])
            q, k, v = [(h @ lp[w]).reshape(B, H, DH) for w in ("wq", "wk", "wv")]
            kt = lax.dynamic_update_slice(kt, k[..., None], (0, 0, 0, pos))
            vc = _dus(vc, v, pos)
            s = jnp.where(jnp.arange(T) <= pos, jnp.einsum("bhd,bhdt->bht", q, kt), -1e30)
            o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1), vc).reshape(B, H * DH)
            return ((kt, vc), pos + 1), (h + o @ lp["wo"]) @ p["out"]
        start = (jnp.zeros((B, H, DH, T)), jnp.zeros((B, T, H, DH)))
        return lax.scan(body, (start, jnp.int32(0)), tokens.T)[1]

    # the loop is named (it said at '<top>', as if the write were outside the scan)
    with pytest.warns(UserWarning, match=r"but at '<top>' inside a lax.scan a "
                                         r"dynamic_update_slice into a buffer of shape \(2, 2, 8, 10\) "
                                         r"that covers part of its last axis"):
        qp = jqt.calibrate(transposed_keys, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)
    assert [k for k in qp if k.startswith("kv_cache")] == ["kv_cache_0"]  # the values

    def step(p, cache, tok, pos):  # k, v float32 written into the cache as it is
        h = p["emb"][tok]
        lp = jax.tree.map(lambda a: a[0], p["layers"])
        k, v = [(h @ lp[w]).reshape(B, H, DH) for w in ("wk", "wv")]
        return {"k": cache["k"].at[:, pos].set(k), "v": cache["v"].at[:, pos].set(v)}, \
            jnp.sum(cache["k"].astype(jnp.float32)) + h @ p["out"]

    cache = lambda dt: {n: jnp.zeros((B, T, H, DH), dt) for n in ("k", "v")}
    tok = jnp.zeros((B,), jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # JAX's own, on the implicit cast
        with pytest.warns(UserWarning, match=r"scatter into a bfloat16 buffer converted to float32 first.*"
                                             r"new.astype\(cache.dtype\). These 2 buffers \(argument "
                                             r"\[1\]\['k'\] of f, argument \[1\]\['v'\] of f\) stay float"):
            qp = jqt.calibrate(step, jqt.recipes.w8(kv_cache=True), p, [(cache(jnp.bfloat16), tok, 0)],
                               progress=False)
        assert not [k for k in qp if k.startswith("kv_cache")]
        qp32 = jqt.calibrate(step, jqt.recipes.w8(kv_cache=True), p, [(cache(jnp.float32), tok, 0)],
                             progress=False)
        assert [k for k in qp32 if k.startswith("kv_cache")]
        with pytest.raises(jqt.QParamsMismatchError, match=r"key/value caches \['kv_cache_0'\] "
                                                           r".*new.astype\(cache.dtype\)"):
            jqt.quantize(step, qp32)(p, cache(jnp.bfloat16), tok, 0)

    def mixed(p, tokens):  # keys written in the cache's dtype, values float32 into bfloat16
        def body(carry, tok):
            (kc, vc), pos = carry
            h = p["emb"][tok]
            lp = jax.tree.map(lambda a: a[0], p["layers"])
            q, k, v = [(h @ lp[w]).reshape(B, H, DH) for w in ("wq", "wk", "wv")]
            kc, vc = kc.at[:, pos].set(k.astype(kc.dtype)), vc.at[:, pos].set(v)
            s = jnp.einsum("bhd,bthd->bht", q, kc.astype(jnp.float32))
            o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, -1), vc.astype(jnp.float32))
            return ((kc, vc), pos + 1), (h + o.reshape(B, H * DH) @ lp["wo"]) @ p["out"]
        start = tuple(jnp.zeros((B, T, H, DH), jnp.bfloat16) for _ in range(2))
        return lax.scan(body, (start, jnp.int32(0)), tokens.T)[1]

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        qp = jqt.calibrate(mixed, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)
    said = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    assert [k for k in qp if k.startswith("kv_cache")] == ["kv_cache_0"]  # the keys
    assert sum("at '<top>' inside a lax.scan a scatter into a bfloat16 buffer converted to "
               "float32 first" in m for m in said) == 1, said
    # the values' buffer was also said to be written by no .at[...].set, advising jnp.where
    assert not [m for m in said if "that no cache write" in m], said

    def window(p, tokens, shift):  # a shifting window: shift(cache), then a write
        def body(carry, tok):
            kc, vc = carry
            h = p["emb"][tok]
            lp = jax.tree.map(lambda a: a[0], p["layers"])
            q, k, v = [(h @ lp[w]).reshape(B, H, DH) for w in ("wq", "wk", "wv")]
            kc, vc = (shift(c).at[:, -1].set(n) for c, n in ((kc, k), (vc, v)))
            o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(jnp.einsum("bhd,bthd->bht", q, kc), -1), vc)
            return (kc, vc), (h + o.reshape(B, H * DH) @ lp["wo"]) @ p["out"]
        return lax.scan(body, tuple(c[0] for c in _empty()), tokens.T)[1]
    rolled = lambda p, tokens: window(p, tokens, lambda c: jnp.roll(c, -1, axis=1))
    sliced = lambda p, tokens: window(p, tokens, lambda c: jnp.pad(c[:, 1:], ((0, 0), (0, 1), (0, 0), (0, 0))))

    with pytest.warns(UserWarning, match=r"scatter into slices of a carried buffer concatenated.*"
                                         r"jnp.roll.*cache.at\[:, :-1\].set\(cache\[:, 1:\]\).*These 2 "
                                         r"buffers \(a loop's carry slot 0, a loop's carry slot 1\) stay float"):
        qp = jqt.calibrate(rolled, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)
    assert not [k for k in qp if k.startswith("kv_cache")]
    with warnings.catch_warnings(record=True) as seen:  # a slice padded: no word of a roll
        warnings.simplefilter("always")
        jqt.calibrate(sliced, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)
    assert seen and not any("concatenated" in str(w.message) for w in seen)

    def scores(p, tokens):  # per-step scores collected a column at a time: not a cache
        def body(carry, tok):
            (cache, pos), out = carry
            logits, cache = _step(p, cache, tok, pos, _dus)
            return ((cache, pos + 1), out.at[:, pos].set(logits.max(-1))), None
        start = ((_empty(), jnp.int32(0)), jnp.zeros((B, tokens.shape[1])))
        return lax.scan(body, start, tokens.T)[0][1]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jqt.calibrate(scores, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)

    def penalized(p, tokens):  # a presence penalty's (B, V) buffer, read and set element
        def body(carry, tok):   # by element: not a cache written along the wrong axis
            (cache, pos), seen = carry
            logits, cache = _step(p, cache, tok, pos, _dus)
            logits = logits - 1.5 * seen
            return ((cache, pos + 1), seen.at[jnp.arange(B), jnp.argmax(logits, -1)].set(1.0)), logits
        start = ((_empty(), jnp.int32(0)), jnp.zeros((B, V)))
        return lax.scan(body, start, tokens.T)[1]

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it warned to keep the features last (hunt32_sampling)
        qp = jqt.calibrate(penalized, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)
    assert len([k for k in qp if k.startswith("kv_cache")]) == 2


def test_edited_cache_types_are_refused(setup):
    """A cache type edited into qparams by hand is checked as a Rule's is: an asymmetric or
    static cache type would otherwise run with its zero point or static flag ignored."""
    p, cal, x = setup
    qp = jqt.calibrate(teacher, jqt.recipes.w8(kv_cache=True), p, cal[:1], progress=False)
    for change in (dict(symmetric=False), dict(dynamic=False)):
        e = qp["kv_cache_0"]
        bad = dict(qp, kv_cache_0=dataclasses.replace(
            e, lhs=dataclasses.replace(e.lhs, qtype=dataclasses.replace(e.lhs.qtype, **change))))
        with pytest.raises(ValueError, match=r"qparams\['kv_cache_0'\].*KV cache type"):
            jqt.quantize(teacher, bad)(p, x)


@pytest.mark.slow
def test_generate_example_runs():
    """examples/generate.py on the tiny decoder: every variant's decode loop carries an int8
    cache of at most 0.27x the float bytes, and w8a8_dynamic agrees with float."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_example", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows, streamed = mod.main(["--tiny", "--prompts", "2", "--tokens", "40", "--length", "20",
                               "--calibration", "1"])
    by_name = {r[0]: r for r in rows}
    float_bytes = by_name["float"][2]
    assert set(by_name) == {"float", *mod.VARIANTS}
    for name in mod.VARIANTS:
        _, speed, nbytes, dtypes, loss, agree, _ = by_name[name]
        assert nbytes / float_bytes <= 0.27 and "int8" in dtypes and "float32" not in dtypes
        assert speed > 0 and np.isfinite(loss)
    assert by_name["w8a8_dynamic + int8 KV"][5] >= 0.9
    # streaming: decode_step from a Python loop keeps its cache int8 between calls and follows
    # the loop's greedy text (the same numerics in another program)
    assert streamed["dtypes"] == ["float16", "int8"] and streamed["nbytes"] / float_bytes <= 0.27
    assert streamed["divergence"] is None or streamed["divergence"] > 10, streamed
    assert streamed["tokens"].shape == (20,)


def test_a_cache_kept_float_by_a_rule_says_which_rule():
    # hunt36_seq2seq: a rule Rule(key="^kv_cache_0$") ahead of w8(kv_cache=True) kept the
    # cache float, and summarize said "kv_cache=True on a preset quantizes it"
    p = {"wk": jnp.eye(4)}

    def f(p, xs):
        def step(c, x):
            c = c.at[-1].set(x @ p["wk"])
            return c, c.sum(0)
        return lax.scan(step, jnp.zeros((3, 4)), xs)[1]
    xs = jnp.ones((5, 4))
    keep = jqt.Recipe(rules=(jqt.Rule(key="^kv_cache_0$"),) + jqt.recipes.w8(kv_cache=True).rules)
    qp = jqt.calibrate(f, keep, p, [(xs,)], progress=False)
    assert qp["kv_cache_0"].is_float and "Rule(key='^kv_cache_0$')" in qp["kv_cache_0"].note
    qp = jqt.calibrate(f, jqt.recipes.w8(), p, [(xs,)], progress=False)
    assert "kv_cache=True on a preset" in qp["kv_cache_0"].note


@pytest.mark.parametrize("kind", [True, "fp8"])
def test_a_float16_model_reads_small_probabilities_over_its_cache_exactly(kind):
    """A float16 model's ``p @ v`` over a quantized cache folds the cache's scale (down
    to 2**-14) into the probabilities: in float16 that product fell below its normal range
    at a context of 512 (probabilities near 1e-3), and the integer path was 15 times
    further from the exact result than the quantization puts the simulated path."""
    T2, D2 = 512, 16

    def gen(p, q, k, v):
        def step(carry, xs):
            (kc, vc), pos = carry
            qt, kt, vt = xs
            kc = lax.dynamic_update_slice(kc, kt[None], (pos, 0))
            vc = lax.dynamic_update_slice(vc, vt[None], (pos, 0))
            s = jnp.where(jnp.arange(T2) <= pos, kc @ (qt * p["w"]), -1e4).astype(qt.dtype)
            return ((kc, vc), pos + 1), jax.nn.softmax(s) @ vc
        z = jnp.zeros((T2, D2), q.dtype)
        return lax.scan(step, ((z, z), 0), (q, k, v))[1]

    def data(seed, dt=jnp.float16):
        ks = jax.random.split(jax.random.key(seed), 3)
        return tuple((jax.random.normal(k, (T2, D2)) * s).astype(dt) for k, s in zip(ks, (0.1, 1.0, 0.01)))
    p = {"w": jnp.ones((D2,), jnp.float16)}
    qp = jqt.calibrate(gen, jqt.recipes.w8(kv_cache=kind), p, [data(0)], progress=False)
    x = data(7)
    y_int = jax.jit(jqt.quantize(gen, qp))(jqt.pack(qp, p), *x)
    # the exact result of these codes: the simulated path in float32 on the same inputs
    ref = jqt.quantize(gen, qp, simulate=True)({"w": p["w"].astype(jnp.float32)},
                                               *(a.astype(jnp.float32) for a in x))
    late = slice(-64, None)  # the last steps, whose probabilities are smallest
    rel = float(jnp.abs(y_int[late].astype(jnp.float32) - ref[late]).max() / jnp.abs(ref[late]).max())
    assert y_int.dtype == jnp.float16 and rel < 5e-3, rel


@pytest.mark.parametrize("kv", [True, "int4", "fp8"])
def test_a_float16_cache_holding_its_largest_value_decodes_finite(kv):
    """float16's largest value, 65504 (a saturating clip's), in a cache: its scale rounds
    up to a float16 value, and 127 x 516 = 65532 cast to float16 was inf, in the buffer a
    loop hands back and in jqt.dequantize_cache, where the simulated path and float keep
    65504 (hunt59_halfkv). Decoding clips to the dtype's finite range, as the simulated
    path does."""
    T, D = 4, 8

    def f(params, xs):
        def step(cache, t):
            cache = lax.dynamic_update_slice(cache, (xs[t] * params["w"])[None], (t, 0))
            return cache, jnp.einsum("d,td->t", xs[t], cache)
        return lax.scan(step, jnp.zeros((T, D), jnp.float16), jnp.arange(T))

    p = {"w": jnp.ones((D,), jnp.float16)}
    xs = jnp.full((T, D), 0.5, jnp.float16).at[1, 3].set(65504.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qp = jqt.calibrate(f, jqt.recipes.w8(kv_cache=kv), p, [(xs,)], progress=False)
    ci, _ = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), xs)
    cs, _ = jqt.quantize(f, qp, simulate=True)(p, xs)
    assert ci.dtype == jnp.float16 and float(ci[1, 3]) == float(cs[1, 3]) == 65504.0
    x = jnp.array([[65504.0, 1.0]], jnp.float16)
    assert jqt.dequantize_cache(jqt.quantize_cache(x)).tolist()[0][0] == 65504.0


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_cache_given_a_unit_axis_by_indexing_is_found_as_one_reshaped_is():
    """A one-sequence step calling a batched one, its cache given a unit axis with
    ``x[:, None]`` (or ``jnp.expand_dims``) and dropped with ``x[:, 0]`` (``jnp.squeeze``):
    only the ``reshape`` spelling was found as a cache; these warned "no loop of f
    carries a buffer" and kept it float (hunt59_halfkv). All three relabel the axes:
    each finds both caches, returns them quantized, and computes what the reshape does."""
    L, T, H, D, DM, V = 2, 8, 2, 16, 32, 50
    ks = jax.random.split(jax.random.key(0), 5)
    params = {"emb": jax.random.normal(ks[0], (V, DM)),
              "layers": {n: jax.random.normal(k, (L, DM, H * D)) * DM ** -0.5
                         for n, k in zip(("wq", "wk", "wv", "wo"), ks[1:])}}

    def decode_step(params, cache, tok):  # batched: cache (L, B, T, H, D), tok (B,)
        pos, B = cache["pos"], tok.shape[0]

        def layer(h, xs):
            lp, k_l, v_l = xs
            q, k, v = [(h @ lp[n]).reshape(B, H, D) for n in ("wq", "wk", "wv")]
            k_l = lax.dynamic_update_slice(k_l, k[:, None], (0, pos, 0, 0))
            v_l = lax.dynamic_update_slice(v_l, v[:, None], (0, pos, 0, 0))
            s = jnp.where(jnp.arange(T) <= pos, jnp.einsum("bhd,bthd->bht", q, k_l), -1e9)
            o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s / D ** 0.5), v_l)
            return h + o.reshape(B, H * D) @ lp["wo"].T, (k_l, v_l)
        h, (kc, vc) = lax.scan(layer, params["emb"][tok], (params["layers"], cache["k"], cache["v"]))
        return h @ params["emb"].T, {"k": kc, "v": vc, "pos": pos + 1}

    views = {"index": (lambda x: x[:, None], lambda x: x[:, 0]),
             "expand": (lambda x: jnp.expand_dims(x, 1), lambda x: jnp.squeeze(x, 1)),
             "reshape": (lambda x: x.reshape(L, 1, T, H, D), lambda x: x.reshape(L, T, H, D))}
    z = jnp.zeros((L, T, H, D))
    cache = {"k": z, "v": z, "pos": jnp.int32(0)}
    got = {}
    for name, (add, drop) in views.items():
        def step1(params, cache, tok, add=add, drop=drop):
            logits, c = decode_step(params, dict(cache, k=add(cache["k"]), v=add(cache["v"])), tok[None])
            return logits[0], dict(c, k=drop(c["k"]), v=drop(c["v"]))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            qp = jqt.calibrate(step1, jqt.recipes.w8a8_dynamic(kv_cache=True), params,
                               [(cache, jnp.int32(7))], progress=False)
        assert [k for k in qp if k.startswith("kv_cache")] == ["kv_cache_0", "kv_cache_1"], name
        run = jax.jit(jqt.quantize(step1, qp))
        packed, c, outs = jqt.pack(qp, params), cache, []
        for tok in (7, 3, 9):
            logits, c = run(packed, c, jnp.int32(tok))
            outs.append(logits)
        assert isinstance(c["k"], jqt.QArray), name
        got[name] = (np.asarray(jnp.stack(outs)), np.asarray(c["k"].values))
    for name in ("index", "expand"):
        np.testing.assert_array_equal(got[name][0], got["reshape"][0], err_msg=name)
        np.testing.assert_array_equal(got[name][1], got["reshape"][1], err_msg=name)
