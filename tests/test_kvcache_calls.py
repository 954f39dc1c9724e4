"""A key/value cache that crosses the call: a decode step called from a Python loop
takes its cache and returns it written, and with a preset's ``kv_cache`` the quantized
step returns it quantized (a ``jqt.QArray`` with ``layout="cache"``), to be passed back
in as it is. Flax's own decode caches (linen ``decode=True``, nnx ``init_cache``) are
such caches."""
import dataclasses
import functools
import math
import warnings

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jqt
from jqt._src import kvcache

from shared import all_eqns
from test_kvcache import B, DH, DM, H, L, T, V, _params  # the same small decoder's weights

KINDS = [(True, jnp.int8), ("int4", jnp.uint8), ("fp8", jnp.uint8)]  # fp8 as bits on the CPU


def step(p, cache, tok):
    """One token (B,) at position cache["pos"] through a scan over the stacked layers,
    written into the cache: the logits and the cache (the form of examples/decoder.py's
    decode_step, called once per token from Python)."""
    pos = cache["pos"]
    h = p["emb"][tok]

    def layer(h, xs):
        lp, kc, vc = xs
        q, k, v = [(h @ lp[w]).reshape(B, H, DH) for w in ("wq", "wk", "wv")]
        kc = lax.dynamic_update_slice(kc, k[:, None], (0, pos, 0, 0))
        vc = vc.at[:, pos].set(v)
        s = jnp.where(jnp.arange(T) <= pos, jnp.einsum("bhd,bthd->bht", q, kc) / math.sqrt(DH), -1e30)
        o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, axis=-1), vc).reshape(B, H * DH)
        return h + o @ lp["wo"], (kc, vc)

    h, (k, v) = lax.scan(layer, h, (p["layers"], cache["k"], cache["v"]))
    return h @ p["out"], {"k": k, "v": v, "pos": pos + 1}


def empty(dtype=jnp.float32):
    return {"k": jnp.zeros((L, B, T, H, DH), dtype), "v": jnp.zeros((L, B, T, H, DH), dtype),
            "pos": jnp.int32(0)}


def feed(fn, params, tokens, cache=None):
    """Logits (n, B, V) of tokens (B, n) fed one per call from a Python loop, and the
    last cache."""
    cache = empty() if cache is None else cache
    out = []
    for t in range(tokens.shape[1]):
        logits, cache = fn(params, cache, tokens[:, t])
        out.append(logits)
    return jnp.stack(out), cache


def own_steps(f, params, tokens, cache):
    """Calibration batches: (cache, token) of the float step f's own steps from cache."""
    batches = []
    for t in range(tokens.shape[1]):
        batches.append((cache, tokens[:, t]))
        cache = f(params, cache, tokens[:, t])[1]
    return batches


def float_steps(params, tokens):
    return own_steps(step, params, tokens, empty())


@pytest.fixture(scope="module")
def setup():
    p = _params()
    toks = jax.random.randint(jax.random.key(3), (B, 8), 0, V)
    return p, float_steps(p, toks[:, :4]), toks


@pytest.mark.parametrize("kind,code_dtype", KINDS)
@pytest.mark.slow_variants
def test_a_decode_step_returns_its_cache_quantized(setup, kind, code_dtype):
    p, batches, toks = setup
    qp = jqt.calibrate(step, jqt.recipes.w8a8_dynamic(kv_cache=kind), p, batches, progress=False)
    assert [k for k in qp if k.startswith("kv_cache")] == ["kv_cache_0", "kv_cache_1"]
    qstep = jax.jit(jqt.quantize(step, qp))
    packed = jqt.pack(qp, p)
    out_q, cache_q = feed(qstep, packed, toks)
    out_s, cache_s = feed(jqt.quantize(step, qp, simulate=True), p, toks)
    for name in ("k", "v"):
        c = cache_q[name]
        assert isinstance(c, jqt.QArray) and c.layout == "cache" and c.values.dtype == code_dtype
        assert c.float_dtype == "float32" and c.scale.dtype == jnp.float16
        assert isinstance(cache_s[name], jax.Array) and cache_s[name].dtype == jnp.float32
        np.testing.assert_allclose(kvcache.decode(c, jnp.float32), cache_s[name], atol=2e-5)
    assert int(cache_q["pos"]) == toks.shape[1]
    np.testing.assert_allclose(out_q, out_s, atol=5e-4)
    # the quantized cache goes in as it came out: int codes and float16 scales in the jaxpr
    ins = [v.aval for v in jax.make_jaxpr(qstep)(packed, cache_q, toks[:, 0]).jaxpr.invars]
    cache_shape = (L, B, T, H, DH)
    assert not any(a.shape == cache_shape and a.dtype == jnp.float32 for a in ins)
    assert sum(a.dtype == code_dtype and a.shape[:-1] == cache_shape[:-1] for a in ins) >= 2


def test_the_cache_stays_float_without_kv_cache(setup):
    p, batches, toks = setup
    qp = jqt.calibrate(step, jqt.recipes.w8a8_dynamic(), p, batches, progress=False)
    out, cache = feed(jax.jit(jqt.quantize(step, qp)), p, toks)
    assert all(isinstance(cache[n], jax.Array) and cache[n].dtype == jnp.float32 for n in ("k", "v"))
    # qparams from before jqt found such caches (no kv_cache entries) run it float too
    old = {k: v for k, v in qp.items() if not k.startswith("kv_cache")}
    out_old, cache_old = feed(jax.jit(jqt.quantize(step, old)), p, toks)
    np.testing.assert_array_equal(out_old, out)
    assert cache_old["k"].dtype == jnp.float32


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_residual_that_experts_add_into_is_not_a_cache():
    """A scan over experts (expert-choice routing) carrying the residual and writing each
    expert's outputs back with ``acc.at[idx].set(acc[idx] + y)``: under ``kv_cache=True``
    the residual was taken for a key/value cache and rounded to int8 per row after every
    write, without a word (43.2 dB against 58.4 dB; hunt57_moetune). An accumulator is no
    cache: the output is the recipe's without kv_cache, and the warning says no cache was
    found. A cache in the same loop is still one."""
    rng = np.random.default_rng(0)
    e_, d, f_, t, c = 4, 16, 24, 32, 8
    p = {"router": jnp.asarray(rng.standard_normal((d, e_)) * 0.5, jnp.float32),
         "w_in": jnp.asarray(rng.standard_normal((e_, d, f_)) * 0.2, jnp.float32),
         "w_out": jnp.asarray(rng.standard_normal((e_, f_, d)) * 0.2, jnp.float32)}

    def moe(p, x, with_cache=False):
        gate, idx = lax.top_k(jax.nn.softmax(x @ p["router"], 0).T, c)

        def body(carry, e):
            acc, kc = carry
            w1, w2, g, i, pos = e
            y = jax.nn.relu(acc[i] @ w1) @ w2 * g[:, None]
            if with_cache:  # a cache beside it: a new vector written, then read
                kc = kc.at[pos].set(x[pos])
                y = y + jax.nn.softmax(kc @ x[pos]) @ kc
            return (acc.at[i].set(acc[i] + y), kc), None
        kc0 = jnp.zeros((e_, d))
        (acc, _), _ = lax.scan(body, (x, kc0), (p["w_in"], p["w_out"], gate, idx, jnp.arange(e_)))
        return acc

    xs = [(jnp.asarray(rng.standard_normal((t, d)), jnp.float32),) for _ in range(3)]
    with pytest.warns(UserWarning, match=r"quantizes key/value caches .* but no loop of f carries a buffer"):
        qk = jqt.calibrate(lambda p, x: moe(p, x), jqt.recipes.w8a8(kv_cache=True), p, xs, progress=False)
    q = jqt.calibrate(lambda p, x: moe(p, x), jqt.recipes.w8a8(), p, xs, progress=False)
    assert list(qk) == list(q) == ["router", "w_in", "w_out"]
    g = lambda p, x: moe(p, x)
    y = jqt.quantize(g, qk)(jqt.pack(qk, p), xs[0][0])
    assert isinstance(y, jax.Array)
    np.testing.assert_array_equal(y, jqt.quantize(g, q)(jqt.pack(q, p), xs[0][0]))
    qc = jqt.calibrate(functools.partial(moe, with_cache=True), jqt.recipes.w8a8(kv_cache=True), p, xs,
                       progress=False)
    assert [k for k in qc if k.startswith("kv_cache")] == ["kv_cache_0"]  # kc, not the residual

    def rows(p, x):  # a scalar index: acc[i] is a dynamic_slice then a squeeze (hunt57_review)
        def body(acc, i):
            return acc.at[i % 2].set(acc[i % 2] + jnp.tanh(acc[i % 2] @ p["w_in"][0]) @ p["w_out"][0]), None
        return lax.scan(body, x[:2], jnp.arange(4))[0]
    with pytest.warns(UserWarning, match=r"no loop of f carries a buffer"):
        qr = jqt.calibrate(rows, jqt.recipes.w8a8(kv_cache=True), p, xs, progress=False)
    assert not [k for k in qr if k.startswith("kv_cache")]


def test_an_accumulator_beside_a_cache_is_no_look_alike():
    """A buffer of a cache's shape written as an accumulator (``acc.at[pos].set(acc[pos] +
    y)``) beside the cache stays float by design: calibrate said no write updates it and
    advised writing it as caches are written (hunt65_eqxstate)."""
    t, d = 6, 8
    w = jax.random.normal(jax.random.key(0), (d, d)) * d ** -0.5

    def gen(w, xs):
        def step(c, x):
            kc, acc, pos = c
            kc = kc.at[pos].set(x @ w)
            y = jax.nn.softmax(jnp.where(jnp.arange(t) <= pos, kc @ x, -1e9)) @ kc
            return (kc, acc.at[pos].set(acc[pos] + y), pos + 1), y
        (_, acc, _), ys = lax.scan(step, (jnp.zeros((t, d)), jnp.zeros((t, d)), 0), xs)
        return ys, acc
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        qp = jqt.calibrate(gen, jqt.recipes.w8(kv_cache=True), w, [(jax.random.normal(jax.random.key(1), (t, d)),)],
                           progress=False)
    assert [k for k in qp if "kv_cache" in k] == ["kv_cache_0"]
    assert not [m for m in got if "of the same shape and dtype" in str(m.message)], [str(m.message) for m in got]

    def added(p, xs):  # values written by adding into zeroed slots, read by attention: warned
        def step(c, x):
            kc, vc, pos = c
            kc = kc.at[pos].set(x @ p)
            vc = vc.at[pos].set(vc[pos] + x @ p.T)
            return (kc, vc, pos + 1), jax.nn.softmax(jnp.where(jnp.arange(t) <= pos, kc @ x, -1e9)) @ vc
        return lax.scan(step, (jnp.zeros((t, d)), jnp.zeros((t, d)), 0), xs)[1]
    with pytest.warns(UserWarning, match=r"carry slot 1 a buffer of the same shape.*adding into its zeroed"):
        jqt.calibrate(added, jqt.recipes.w8(kv_cache=True), w, [(jax.random.normal(jax.random.key(1), (t, d)),)],
                      progress=False)


def test_a_one_hot_history_beside_a_cache_stays_float():
    """A sampling loop's one-hot token history (``hist.at[i].set(jax.nn.one_hot(tok, V))``,
    summed for a no-repeat rule) is written whole vectors and read, as a cache is: it was
    taken for one under ``kv_cache=``, its 1.0s decoded to 0.99994, and ``hist.sum(0) >= 1``
    was never true: tokens repeated, on the simulated path too (hunt74_sampling). A buffer
    written with bool or integer values converted to float is no cache."""
    t, d, v = 6, 8, 16
    p = {"w": jax.random.normal(jax.random.key(0), (d, d)) * d ** -0.5,
         "emb": jax.random.normal(jax.random.key(2), (v, d))}

    def gen(p, xs):
        def step(c, x):
            kc, hist, pos = c
            kc = kc.at[pos].set(x @ p["w"])
            y = jax.nn.softmax(jnp.where(jnp.arange(t) <= pos, kc @ x, -1e9)) @ kc
            logits = jnp.where(hist.sum(0) >= 1, -1e9, p["emb"] @ y)  # no token twice
            tok = jnp.argmax(logits)
            return (kc, hist.at[pos].set(jax.nn.one_hot(tok, v)), pos + 1), tok
        (_, hist, _), toks = lax.scan(step, (jnp.zeros((t, d)), jnp.zeros((t, v)), 0), xs)
        return toks, hist
    xs = jax.random.normal(jax.random.key(1), (t, d))
    qp = jqt.calibrate(gen, jqt.recipes.w8(kv_cache=True), p, [(xs,)], progress=False)
    assert [k for k in qp if "kv_cache" in k] == ["kv_cache_0"]  # the keys, not the history
    for toks, hist in (jax.jit(jqt.quantize(gen, qp))(jqt.pack(qp, p), xs),
                       jqt.quantize(gen, qp, simulate=True)(p, xs)):
        assert len(set(np.asarray(toks).tolist())) == t
        np.testing.assert_array_equal(np.asarray(hist).sum(1), np.ones(t))


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_a_float_cache_enters_quantized_and_jit_compiles_twice(setup):
    """The first call takes the float cache (a prefill's, or zeros) and quantizes it; every
    later call takes the cache the previous one returned: two programs in all, from one
    trace of f (jqt traces f with the float buffer a quantized cache stands for)."""
    p, batches, toks = setup
    traces = []

    def counted(p, cache, tok):
        traces.append(1)
        return step(p, cache, tok)

    qp = jqt.calibrate(counted, jqt.recipes.w8(kv_cache=True), p, batches, progress=False)
    traces.clear()
    programs, quantized = [], jqt.quantize(counted, qp)

    def program(*args):  # traced by jax.jit once per program it compiles
        programs.append(1)
        return quantized(*args)

    qstep = jax.jit(program)
    prefix = feed(step, p, toks[:, :3])[1]  # a float cache holding three tokens already
    out, _ = feed(qstep, p, toks[:, 3:], cache=prefix)
    # (counted by traces: the C++ dispatch cache's size, read before, is 0 on some runs)
    assert len(traces) == 1 and len(programs) == 2
    # the same as the whole sequence fed to the quantized step, up to the first three
    # tokens' keys and values, which the float steps wrote and the first call quantized
    ref, _ = feed(jax.jit(jqt.quantize(step, qp)), p, toks)
    np.testing.assert_allclose(out, ref[3:], atol=0.05)


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_donated_cache_is_updated_in_place(setup):
    p, batches, toks = setup
    qp = jqt.calibrate(step, jqt.recipes.w8a8_dynamic(kv_cache=True), p, batches, progress=False)
    donating = jax.jit(jqt.quantize(step, qp), donate_argnums=1)
    ref, _ = feed(jax.jit(jqt.quantize(step, qp)), p, toks)
    logits, cache = donating(p, empty(), toks[:, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Some donated buffers were not usable" would raise
        out = [logits]
        for t in range(1, toks.shape[1]):
            old = cache["k"].values
            logits, cache = donating(p, cache, toks[:, t])
            assert old.is_deleted()
            out.append(logits)
    np.testing.assert_allclose(jnp.stack(out), ref, atol=1e-6)


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_vmap_export_and_grad(setup):
    p, batches, toks = setup
    qp = jqt.calibrate(step, jqt.recipes.w8a8_dynamic(kv_cache="int4"), p, batches, progress=False)
    qstep = jqt.quantize(step, qp)
    _, cache = feed(jax.jit(qstep), p, toks[:, :3])
    # jax.vmap over two independent sequences' caches
    caches = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), cache)
    both = jnp.stack([toks[:, 3], toks[:, 4]])
    lg, new = jax.vmap(qstep, in_axes=(None, 0, 0))(p, caches, both)
    for i in range(2):
        one_lg, one = qstep(p, cache, both[i])
        np.testing.assert_allclose(lg[i], one_lg, atol=1e-5)
        np.testing.assert_array_equal(new["k"].values[i], one["k"].values)
    # jax.export of the step taking and returning the quantized cache
    exp = jax.export.export(jax.jit(qstep))(p, cache, toks[:, 3])
    back = jax.export.deserialize(exp.serialize())
    lg_e, new_e = back.call(p, cache, toks[:, 3])
    lg_d, new_d = qstep(p, cache, toks[:, 3])
    np.testing.assert_allclose(lg_e, lg_d, atol=1e-6)
    assert isinstance(new_e["k"], jqt.QArray) and new_e["k"].float_dtype == "float32"
    np.testing.assert_array_equal(new_e["v"].values, new_d["v"].values)
    # gradients through the simulated step, to the weights, the cache written straight-through
    def loss(p):
        return feed(jqt.quantize(step, qp, simulate=True), p, toks[:, :3])[0].sum()
    g = jax.grad(loss)(p)
    assert all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(g))
    assert float(jnp.abs(g["layers"]["wk"]).max()) > 0


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_a_bfloat16_cache_comes_back_as_bfloat16(setup):
    p, batches, toks = setup
    pb = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), p)
    cb = [(jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if x.ndim else x, c), t)
          for c, t in batches]
    qp = jqt.calibrate(step, jqt.recipes.w8(kv_cache=True), pb, cb, progress=False)
    qstep = jax.jit(jqt.quantize(step, qp))
    out_q, cache = feed(qstep, pb, toks, cache=empty(jnp.bfloat16))
    out_s, ref = feed(jqt.quantize(step, qp, simulate=True), pb, toks, cache=empty(jnp.bfloat16))
    out_f, _ = feed(step, pb, toks, cache=empty(jnp.bfloat16))
    assert cache["k"].float_dtype == "bfloat16" and out_q.dtype == jnp.bfloat16
    assert kvcache.decode(cache["k"], jnp.bfloat16).dtype == ref["k"].dtype == jnp.bfloat16
    # bfloat16 rounds the two paths' intermediates apart (logits of about 1 in magnitude):
    # on average they stay closer to each other than the simulation is to float
    mean = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).mean())
    assert mean(out_q, out_s) < mean(out_s, out_f) < 0.05


def test_a_cache_from_other_qparams_is_refused(setup):
    p, batches, toks = setup
    qp8 = jqt.calibrate(step, jqt.recipes.w8(kv_cache=True), p, batches, progress=False)
    qp4 = jqt.calibrate(step, jqt.recipes.w8(kv_cache="int4"), p, batches, progress=False)
    _, cache4 = jax.jit(jqt.quantize(step, qp4))(p, empty(), toks[:, 0])
    for simulate in (False, True):
        with pytest.raises(jqt.QParamsMismatchError,
                           match=r"argument \[1\]\['k'\] of f .* int4 .*qparams\['kv_cache_0'\].*int8.*"
                                 r"starts it with jqt.quantize_cache\(buffer, 'int8'\)"):
            jqt.quantize(step, qp8, simulate=simulate)(p, cache4, toks[:, 1])
    # the advice, followed: a cache started as jqt.quantize_cache(buffer, 'int8') is taken
    start = {**empty(), "k": jqt.quantize_cache(empty()["k"], "int8"),
             "v": jqt.quantize_cache(empty()["v"], "int8")}
    assert jqt.quantize(step, qp8)(p, start, toks[:, 0])[1]["k"].qtype.bits == 8
    # the simulated path of the same qparams decodes it
    _, sim = jqt.quantize(step, qp4, simulate=True)(p, cache4, toks[:, 1])
    assert sim["k"].dtype == jnp.float32
    # a step calibrated without kv_cache= decoded a quantized cache and returned it float,
    # 4x the bytes, with no word (hunt76_chunkprefill); its simulated path decodes it
    qpf = jqt.calibrate(step, jqt.recipes.w8(), p, batches, progress=False)
    with pytest.raises(jqt.QParamsMismatchError,
                       match=r"argument \[1\]\['k'\] of f is a key/value cache of int4 .*, but "
                             r"qparams\['kv_cache_0'\] keep the cache it writes float"):
        jqt.quantize(step, qpf)(p, cache4, toks[:, 1])
    _, sim = jqt.quantize(step, qpf, simulate=True)(p, cache4, toks[:, 1])
    assert sim["k"].dtype == jnp.float32


def test_a_returned_cache_with_its_scales_recast_is_refused_by_name(setup):
    """A state whose floating leaves were cast (to bfloat16, say) hands back a cache whose
    float16 scales changed: refused naming the argument and what a cache holds (was JAX's
    dtype error from inside the cache write, naming nothing)."""
    p, batches, toks = setup
    qp = jqt.calibrate(step, jqt.recipes.w8(kv_cache=True), p, batches, progress=False)
    qstep = jax.jit(jqt.quantize(step, qp))
    _, cache = qstep(p, empty(), toks[:, 0])
    cast = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a, cache)
    with pytest.raises(ValueError, match=r"argument \[1\]\['k'\] is a key/value cache whose codes are int8.* "
                                         r"scales bfloat16.*float16\[.*\] scales"):
        qstep(p, cast, toks[:, 1])
    # an int4 cache's codes recast to int32: the message names both dtypes an int4 cache
    # holds (it said int8 only; hunt68_exportcache)
    q4 = jqt.calibrate(step, jqt.recipes.w8(kv_cache="int4"), p, batches, progress=False)
    _, c4 = jax.jit(jqt.quantize(step, q4))(p, empty(), toks[:, 0])
    wide = {**c4, "k": dataclasses.replace(c4["k"], values=c4["k"].values.astype(jnp.int32))}
    with pytest.raises(ValueError, match=r"codes are int32.*holds int8 or uint8 codes"):
        jax.jit(jqt.quantize(step, q4))(p, wide, toks[:, 1])


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_calibrate_and_report_take_a_quantized_cache(setup):
    """A cache the quantized step returned is decoded for calibration and reports: the same
    statistics as its float buffer."""
    p, batches, toks = setup
    recipe = jqt.recipes.w8a8(kv_cache=True)
    qp = jqt.calibrate(step, recipe, p, batches, progress=False)
    _, cache = jax.jit(jqt.quantize(step, qp))(p, batches[2][0], batches[2][1])
    decoded = dict(cache, k=kvcache.decode(cache["k"], jnp.float32), v=kvcache.decode(cache["v"], jnp.float32))
    a = jqt.calibrate(step, recipe, p, [(cache, toks[:, 3])], progress=False)
    b = jqt.calibrate(step, recipe, p, [(decoded, toks[:, 3])], progress=False)
    for k in a:
        for x, y in zip(jax.tree_util.tree_leaves(a[k]), jax.tree_util.tree_leaves(b[k])):
            np.testing.assert_array_equal(x, y)
    rep = jqt.report(step, qp, p, (cache, toks[:, 3]))
    assert {"kv_cache_0", "kv_cache_1"} <= {r.key for r in rep.rows}
    # batches recorded from a quantized run: the first holds the float cache it started
    # from, the others the caches it returned (refused as batches of another structure)
    mixed = jqt.calibrate(step, recipe, p, [(decoded, toks[:, 3]), (cache, toks[:, 3])], progress=False)
    for k in a:
        for x, y in zip(jax.tree_util.tree_leaves(a[k]), jax.tree_util.tree_leaves(mixed[k])):
            np.testing.assert_array_equal(x, y)


def test_keys_of_loop_caches_are_unchanged_by_writes_into_arguments():
    """A write into an argument that f does not return (scratch) is no cache and takes no
    key: the loop's caches keep the keys they had."""
    p = _params()

    def gen(p, scratch, first):
        scratch = scratch.at[0].set(1.0)

        def body(carry, _):
            cache, tok = carry
            logits, cache = step(p, cache, tok)
            return (cache, jnp.argmax(logits + scratch[0, :V], -1).astype(jnp.int32)), logits
        return lax.scan(body, (empty(), first), None, length=4)[1]

    scratch = jnp.zeros((2, V))
    qp = jqt.calibrate(gen, jqt.recipes.w8(kv_cache=True), p, [(scratch, jnp.zeros((B,), jnp.int32))],
                       progress=False)
    assert sorted(k for k in qp if k.startswith("kv_cache")) == ["kv_cache_0", "kv_cache_1"]
    out = jax.jit(jqt.quantize(gen, qp))(p, scratch, jnp.zeros((B,), jnp.int32))
    assert out.shape == (4, B, V)


@pytest.mark.slow  # 3-4 s each: CI's slow run (CI's default run took 323 s on 2026-12-07)
def test_a_generate_function_that_takes_and_returns_the_cache(setup):
    """A loop inside f that carries the cache f was given hands it back quantized too (the
    loop's codes, re-encoded where a loop returned float: the same codes)."""
    p, batches, toks = setup

    def gen(p, cache, tokens):
        def body(cache, tok):
            logits, cache = step(p, cache, tok)
            return cache, logits
        cache, logits = lax.scan(body, cache, tokens.T)
        return logits, cache

    qp = jqt.calibrate(gen, jqt.recipes.w8a8_dynamic(kv_cache=True), p, [(empty(), toks[:, :4])],
                       progress=False)
    qgen = jax.jit(jqt.quantize(gen, qp))
    lg1, c1 = qgen(p, empty(), toks[:, :4])
    lg2, c2 = qgen(p, c1, toks[:, 4:])
    assert isinstance(c2["k"], jqt.QArray) and int(c2["pos"]) == 8
    whole, c = qgen(p, empty(), toks)
    np.testing.assert_allclose(jnp.concatenate([lg1, lg2]), whole, atol=1e-5)
    np.testing.assert_array_equal(c2["k"].values, c["k"].values)


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_flax_linen_decode_cache():
    nn = pytest.importorskip("flax.linen")

    class Dec(nn.Module):
        @nn.compact
        def __call__(self, tok):
            x = nn.Embed(V, DM)(tok)
            x = x + nn.MultiHeadDotProductAttention(num_heads=H, decode=True)(x)
            return nn.Dense(V)(x)

    m = Dec()
    variables = m.init(jax.random.key(0), jnp.zeros((B, T), jnp.int32))
    params, cache0 = variables["params"], variables["cache"]

    def lstep(params, cache, tok):  # the cache collection passed and returned, as flax's own loop
        out, mut = m.apply({"params": params, "cache": cache}, tok[:, None], mutable=["cache"])
        return out[:, 0], mut["cache"]

    toks = jax.random.randint(jax.random.key(1), (B, 6), 0, V)
    cal, c = [], cache0
    for t in range(3):
        cal.append((c, toks[:, t]))
        c = lstep(params, c, toks[:, t])[1]
    qp = jqt.calibrate(lstep, jqt.recipes.w8a8_dynamic(kv_cache=True), params, cal, progress=False)
    out_q, cache = feed(jax.jit(jqt.quantize(lstep, qp)), params, toks, cache=cache0)
    out_s, _ = feed(jqt.quantize(lstep, qp, simulate=True), params, toks, cache=cache0)
    att = cache["MultiHeadDotProductAttention_0"]
    assert att["cached_key"].values.dtype == att["cached_value"].values.dtype == jnp.int8
    assert int(att["cache_index"]) == 6
    np.testing.assert_allclose(out_q, out_s, atol=1e-4)


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_flax_nnx_decode_cache():
    nnx = pytest.importorskip("flax.nnx")

    class Dec(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(V, DM, rngs=rngs)
            self.att = nnx.MultiHeadAttention(num_heads=H, in_features=DM, decode=True, rngs=rngs)
            self.out = nnx.Linear(DM, V, rngs=rngs)

        def __call__(self, tok):
            x = self.emb(tok)
            return self.out(x + self.att(x))

    model = Dec(nnx.Rngs(0))
    model.att.init_cache((B, T, DM))
    graphdef, params, cache0 = nnx.split(model, nnx.Param, nnx.Cache)

    def nstep(params, cache, tok):
        m = nnx.merge(graphdef, params, cache)
        return m(tok[:, None])[:, 0], nnx.state(m, nnx.Cache)

    toks = jax.random.randint(jax.random.key(2), (B, 5), 0, V)
    cal, c, fstep = [], cache0, jax.jit(nstep)  # eager, nnx.merge would write into cache0 itself
    for t in range(3):
        cal.append((c, toks[:, t]))
        c = fstep(params, c, toks[:, t])[1]
    assert [int(c["att"]["cache_index"].get_value()) for c, _ in cal] == [0, 1, 2]
    qp = jqt.calibrate(nstep, jqt.recipes.w8(kv_cache="int4"), params, cal, progress=False)
    out_q, cache = feed(jax.jit(jqt.quantize(nstep, qp)), params, toks, cache=cache0)
    out_s, _ = feed(jqt.quantize(nstep, qp, simulate=True), params, toks, cache=cache0)
    assert cache["att"]["cached_key"].get_value().values.dtype == jnp.uint8  # int4, two per byte
    np.testing.assert_allclose(out_q, out_s, atol=1e-4)


@pytest.mark.parametrize("kind", [True, "int4", "fp8"])
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_a_scan_over_the_quantized_step_starts_from_quantize_cache(setup, kind):
    """lax.scan needs its carry's type to stay: the quantized step returns a quantized
    cache, so the carry starts as one (jqt.quantize_cache); the same as the Python loop."""
    p, batches, toks = setup
    qp = jqt.calibrate(step, jqt.recipes.w8(kv_cache=kind), p, batches, progress=False)
    qstep = jqt.quantize(step, qp)

    def body(cache, tok):
        logits, cache = qstep(p, cache, tok)
        return cache, logits

    start = empty()
    start = dict(start, k=jqt.quantize_cache(start["k"], kind), v=jqt.quantize_cache(start["v"], kind))
    cache, out = jax.jit(lambda c, t: lax.scan(body, c, t))(start, toks.T)
    ref, ref_cache = feed(jax.jit(qstep), p, toks)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_array_equal(cache["k"].values, ref_cache["k"].values)
    with pytest.raises(TypeError, match="carry"):  # a float carry: JAX names the QArray
        lax.scan(body, empty(), toks.T)


def test_quantize_cache_refuses_what_is_no_cache():
    with pytest.raises(ValueError, match="give a cache type"):
        jqt.quantize_cache(jnp.zeros((2, 4)), False)
    with pytest.raises(ValueError, match="int32\\[2, 4\\].*float buffer"):
        jqt.quantize_cache(jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="symmetric, dynamic and per vector"):
        jqt.quantize_cache(jnp.zeros((2, 4)), jqt.QuantType(bits=8))
    bf = jqt.quantize_cache(jnp.ones((2, 4), jnp.bfloat16), "int4")
    assert bf.float_dtype == "bfloat16" and bf.values.dtype == jnp.uint8 and bf.values.shape == (2, 2)


def test_a_cache_built_or_edited_by_hand_is_refused_where_its_fields_do_not_fit():
    """jqt.dequantize_cache decoded a cache of an asymmetric type and ignored its zero point
    ([5, -10, ...] where (codes - zero_point) x scale is [0, -15, ...]), returned an int32
    array for float_dtype='int32', and named no code dtype for an nf4 one; jqt.QArray took
    a dtype name as its type and any layout, failing later with an AttributeError
    (hunt76_qarrayapi)."""
    c = jqt.quantize_cache(jnp.array([[1.0, -2.0, 3.0, 4.0]]), "int8")
    assert jqt.dequantize_cache(c).dtype == jnp.float32
    asym = jqt.QuantType(bits=8, symmetric=False, per_channel=True, dynamic=True)
    for bad, want in [
            (dataclasses.replace(c, qtype=asym, zero_point=jnp.full(c.scale.shape, 10.0)),
             r"of type int8 asym .* where a KV cache type is symmetric"),
            (dataclasses.replace(c, zero_point=jnp.full(c.scale.shape, 10.0)),
             r"with a zero point, which its type \(int8 sym .*\) has no use for"),
            (dataclasses.replace(c, float_dtype="int32"), r"whose float_dtype \('int32'\).* not a float dtype"),
            (dataclasses.replace(c, qtype=jqt.QuantType(dtype="nf4", group_size=0, per_channel=True)),
             r"of type nf4 .* where a KV cache type")]:
        with pytest.raises(ValueError, match="jqt.dequantize_cache: a key/value cache " + want):
            jqt.dequantize_cache(bad)
    with pytest.raises(TypeError, match=r"jqt.QArray\(qtype='int8'\): a jqt.QuantType"):
        jqt.QArray(values=c.values, scale=c.scale, qtype="int8", layout="cache", float_dtype="float32")
    with pytest.raises(ValueError, match=r"jqt.QArray\(layout='Cache'\): one of 'operand'"):
        jqt.QArray(values=c.values, scale=c.scale, qtype=c.qtype, layout="Cache", float_dtype="float32")


# ---- attention reading whole vectors of the cache through another op (kvcache.is_read_view) ----
NP, PS, MAXP, KV, W = 8, 3, 3, 1, 4  # pages of PS tokens; kv heads (H / KV queries each); window
PAGES = jnp.array([[5, 0, 7], [2, 6, 1]], jnp.int32)  # each sequence's pages (B, MAXP)


def _read(cache, how, pos):
    """The keys or values attention reads: (B, S, H, DH) and the position of each of S."""
    if how == "repeat":  # grouped-query attention: each kv head repeated for its query heads
        return jnp.repeat(cache, H // KV, axis=2), jnp.arange(T)
    if how == "pages":  # a paged cache: this batch's pages, by its page table, joined
        return cache[PAGES].reshape(B, MAXP * PS, H, DH), jnp.arange(MAXP * PS)
    if how == "window":  # sliding-window attention: the last W positions
        start = jnp.clip(pos - W + 1, 0, T - W)
        return lax.dynamic_slice_in_dim(cache, start, W, axis=1), start + jnp.arange(W)
    return cache[:, :T - 2], jnp.arange(T - 2)  # "prefix": a static slice


def view_step(how):
    def f(p, cache, tok):
        pos = cache["pos"]
        lp = jax.tree_util.tree_map(lambda w: w[0], p["layers"])
        h = p["emb"][tok]
        q = (h @ lp["wq"]).reshape(B, H, DH)
        heads = KV if how == "repeat" else H
        k, v = [(h @ lp[w][:, :heads * DH]).reshape(B, heads, DH) for w in ("wk", "wv")]
        if how == "pages":
            page, slot = PAGES[jnp.arange(B), pos // PS], pos % PS
            kc, vc = cache["k"].at[page, slot].set(k), cache["v"].at[page, slot].set(v)
        else:
            kc = lax.dynamic_update_slice(cache["k"], k[:, None], (0, pos, 0, 0))
            vc = lax.dynamic_update_slice(cache["v"], v[:, None], (0, pos, 0, 0))
        (kr, at), (vr, _) = _read(kc, how, pos), _read(vc, how, pos)
        s = jnp.where(at <= pos, jnp.einsum("bhd,bthd->bht", q, kr) / math.sqrt(DH), -1e30)
        o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, axis=-1), vr).reshape(B, H * DH)
        return (h + o @ lp["wo"]) @ p["out"], {"k": kc, "v": vc, "pos": pos + 1}
    return f


def view_cache(how):
    shape = {"repeat": (B, T, KV, DH), "pages": (NP, PS, H, DH)}.get(how, (B, T, H, DH))
    return {"k": jnp.zeros(shape), "v": jnp.zeros(shape), "pos": jnp.int32(0)}


@pytest.mark.parametrize("kind", [True, "int4"])
@pytest.mark.parametrize("how", ["repeat", "pages", "window", "prefix"])
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_attention_reads_the_codes_of_what_it_selects(setup, how, kind):
    """jnp.repeat of a grouped-query cache's heads, a paged cache's pages gathered by a page
    table, a sliding window and a static slice read whole vectors: attention reads their
    codes (the cache is never decoded whole), with the simulation's results."""
    p, _, toks = setup
    f, start = view_step(how), view_cache(how)
    n = 7  # positions 0-6: within the prefix's T - 2 = 8 and each sequence's pages
    qp = jqt.calibrate(f, jqt.recipes.w8(kv_cache=kind), p, own_steps(f, p, toks[:, :3], start),
                       progress=False)
    qf = jax.jit(jqt.quantize(f, qp))
    out_q, cache = feed(qf, p, toks[:, :n], cache=start)
    out_s, _ = feed(jqt.quantize(f, qp, simulate=True), p, toks[:, :n], cache=start)
    assert isinstance(cache["k"], jqt.QArray)
    np.testing.assert_allclose(out_q, out_s, atol=2e-5)
    # no float array of the whole buffer's shape is computed (the zeros f is traced with,
    # which nothing reads, aside): nothing decodes it
    shape = start["k"].shape
    floats = [e for e in all_eqns(jax.make_jaxpr(qf)(p, cache, toks[:, 0])) for v in e.outvars
              if v.aval.shape == shape and jnp.issubdtype(v.aval.dtype, jnp.floating)
              and not all(isinstance(i, jax.extend.core.Literal) for i in e.invars)]
    assert not floats, floats[0]



REORDERS = {"index": lambda c, order: c[:, order],
            # jnp.take and a jitted helper: a nested jit around the gather, with no
            # quantized op in it (hunt32_sampling: the whole cache was decoded at it)
            "take": lambda c, order: jnp.take(c, order, axis=1),
            "jitted": jax.jit(lambda c, order: c[:, order]),
            # t5x's gather_beams: the (batch * beams) axis split, the beams gathered by
            # (batch, parent), joined again (one batch of B beams here)
            "t5x": lambda c, order: c.reshape(c.shape[0], 1, B, *c.shape[2:])[
                :, jnp.arange(1)[:, None], order[None]].reshape(c.shape),
            # the same with jnp.take (a jit of its own) on the split view, the parents
            # computed in the step (not an argument of f)
            "t5x_take": lambda c, order: jnp.take(c.reshape(c.shape[0], 1, B, *c.shape[2:]),
                                                  order * 1, axis=2).reshape(c.shape)}


def beam_step(p, cache, tok, order, reorder="index"):
    """Beam search's step: the beams' caches reordered by the surviving beams (a gather of
    whole vectors, the cache's shape kept), then one token written and attended."""
    r = REORDERS[reorder]
    return step(p, dict(cache, k=r(cache["k"], order), v=r(cache["v"], order)), tok)


def beam_loop(p, tokens, orders, reorder="index"):
    """The same in a lax.scan over steps carrying the cache: logits (n, B, V)."""
    def body(cache, xs):
        logits, cache = beam_step(p, cache, *xs, reorder=reorder)
        return cache, logits
    return lax.scan(body, empty(), (tokens.T, orders))[1]


@pytest.mark.parametrize("kind,code_dtype,reorder", [(*KINDS[0], "index"), (*KINDS[1], "index"),
                                                     (*KINDS[0], "take"), (*KINDS[1], "jitted"),
                                                     (*KINDS[0], "t5x"), (*KINDS[0], "t5x_take")])
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_beam_search_reorders_the_quantized_cache(setup, kind, code_dtype, reorder):
    """A cache reordered by beam (cache[:, order], jnp.take, a jitted gather) is still the
    cache: its codes and scales are reordered alike, in a step called from Python and in a
    loop that carries it, and nothing decodes the whole cache."""
    p, _, toks = setup
    beam_step = functools.partial(globals()["beam_step"], reorder=reorder)
    beam_loop = functools.partial(globals()["beam_loop"], reorder=reorder)
    orders = jnp.array([[1, 0], [0, 0], [1, 1], [0, 1]] * 2, jnp.int32)
    cal, c = [], empty()
    for t in range(3):
        cal.append((c, toks[:, t], orders[t]))
        c = beam_step(p, c, toks[:, t], orders[t])[1]
    recipe = jqt.recipes.w8(kv_cache=kind)
    qp = jqt.calibrate(beam_step, recipe, p, cal, progress=False)
    assert [k for k in qp if k.startswith("kv_cache")] == ["kv_cache_0", "kv_cache_1"]
    qs, ss = jax.jit(jqt.quantize(beam_step, qp)), jqt.quantize(beam_step, qp, simulate=True)
    cq, cs = empty(), empty()
    for t in range(toks.shape[1]):
        a, cq = qs(p, cq, toks[:, t], orders[t])
        b, cs = ss(p, cs, toks[:, t], orders[t])
        np.testing.assert_allclose(a, b, atol=2e-5)
    assert cq["k"].values.dtype == code_dtype
    np.testing.assert_allclose(kvcache.decode(cq["v"], jnp.float32), cs["v"], atol=2e-5)
    # the loop form: the carry is the quantized cache
    ql = jqt.calibrate(beam_loop, recipe, p, [(toks[:, :4], orders[:4])], progress=False)
    out_q = jax.jit(jqt.quantize(beam_loop, ql))(p, toks, orders)
    np.testing.assert_allclose(out_q, jqt.quantize(beam_loop, ql, simulate=True)(p, toks, orders), atol=2e-5)
    loops = [e for e in all_eqns(jax.make_jaxpr(jqt.quantize(beam_loop, ql))(p, toks, orders))
             if e.primitive.name == "scan" and e.params["length"] == toks.shape[1]]
    assert any(v.aval.dtype == code_dtype and v.aval.ndim == 5 for v in loops[0].invars)
    shape = empty()["k"].shape
    floats = [e for e in all_eqns(loops[0].params["jaxpr"]) for v in e.outvars
              if v.aval.shape == shape and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    assert not floats, floats[0]


@pytest.mark.parametrize("reorder", [False, True])
def test_a_cache_kept_with_the_beams_on_an_axis_of_their_own(setup, reorder):
    """Beam search carrying its caches (L, batch, beams, T, H, DH), merged to
    (L, batch * beams, ...) for the step (its scan over the layers writes and reads them)
    and split again after: no cache was found, every buffer stayed float with the warning
    that no loop carries one (hunt41_whisper). Now the carry is the quantized cache, with
    the beams reordered on their own axis (take_along_axis) or not."""
    p, _, toks = setup
    split = lambda c: c.reshape(L, 1, B, T, H, DH)
    merge = lambda c: c.reshape(L, B, T, H, DH)

    def loop(p, tokens, orders):
        def body(carry, xs):
            (k, v), pos = carry
            tok, order = xs
            if reorder:
                k, v = [jnp.take_along_axis(c, order[None, None, :, None, None, None], axis=2)
                        for c in (k, v)]
            logits, c = step(p, {"k": merge(k), "v": merge(v), "pos": pos}, tok)
            return ((split(c["k"]), split(c["v"])), c["pos"]), logits
        z = split(empty()["k"])
        return lax.scan(body, ((z, z), jnp.int32(0)), (tokens.T, orders))[1]

    orders = jnp.array([[1, 0], [0, 0], [1, 1], [0, 1]] * 2, jnp.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(loop, jqt.recipes.w8(kv_cache=True), p, [(toks[:, :4], orders[:4])],
                           progress=False)
    assert [k for k in qp if k.startswith("kv_cache")] == ["kv_cache_0", "kv_cache_1"]
    qf = jqt.quantize(loop, qp)
    out_q = jax.jit(qf)(p, toks, orders)
    np.testing.assert_allclose(out_q, jqt.quantize(loop, qp, simulate=True)(p, toks, orders), atol=2e-5)
    loops = [e for e in all_eqns(jax.make_jaxpr(qf)(p, toks, orders))
             if e.primitive.name == "scan" and e.params["length"] == toks.shape[1]]
    assert sum(v.aval.dtype == jnp.int8 and v.aval.ndim == 6 for v in loops[0].invars) == 2


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_cache_read_block_by_block_inside_a_loop_is_a_cache():
    """Flash-decoding style: the step writes its caches, then reads the keys block by block
    in a fori_loop and a paged pool's pages in a lax.scan over its page table. A buffer a
    loop closes over was no read (only a view of one was), so both caches stayed float
    (hunt42_paged; with no warning at all where another cache was found)."""
    blk, npage, d = 4, 6, 8
    ks = jax.random.split(jax.random.key(3), 4)
    p = {n: jax.random.normal(k, (d, d)) / 3 for n, k in zip(("wq", "wk", "wv", "wo"), ks)}

    def step(p, cache, x):
        pos, table = cache["pos"], cache["table"]  # pages of 4 slots, given by the table
        q, k, v = (x @ p[n] for n in ("wq", "wk", "wv"))
        page, slot = table[pos // blk], pos % blk
        kc = cache["k"].at[page, slot].set(k)
        vc = cache["v"].at[page, slot].set(v)

        def scores(j, s):  # the keys of page j, read inside the loop
            return lax.dynamic_update_slice_in_dim(s, kc[table[j]] @ q, j * blk, 0)
        s = lax.fori_loop(0, table.shape[0], scores, jnp.zeros(table.shape[0] * blk))
        s = jnp.where(jnp.arange(s.shape[0]) <= pos, s, -1e9)
        w = jax.nn.softmax(s).reshape(-1, blk)
        o = lax.scan(lambda acc, jw: (acc + jw[1] @ vc[table[jw[0]]], None),  # values page by page
                     jnp.zeros(d), (jnp.arange(table.shape[0]), w))[0]
        return o @ p["wo"], {"k": kc, "v": vc, "pos": pos + 1, "table": table}

    cache = {"k": jnp.zeros((npage, blk, d)), "v": jnp.zeros((npage, blk, d)),
             "pos": jnp.int32(0), "table": jnp.array([4, 1, 5], jnp.int32)}
    xs = jax.random.normal(jax.random.key(4), (5, d))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(step, jqt.recipes.w8(kv_cache=True), p, [(cache, x) for x in xs],
                           progress=False)
    assert sorted(k for k in qp if k.startswith("kv_cache")) == ["kv_cache_0", "kv_cache_1"]
    run, sim = jax.jit(jqt.quantize(step, qp)), jax.jit(jqt.quantize(step, qp, simulate=True))
    c_int, c_sim, c_f = cache, cache, cache
    for x in xs:  # a few decode steps, each cache carried back in
        (y, c_int), (ys, c_sim), (yf, c_f) = run(p, c_int, x), sim(p, c_sim, x), step(p, c_f, x)
        np.testing.assert_allclose(y, ys, atol=1e-5)
        np.testing.assert_allclose(y, yf, atol=0.05 * float(jnp.abs(yf).max()))
    assert all(isinstance(c_int[n], jqt.QArray) and c_int[n].values.dtype == jnp.int8 for n in "kv")


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_merged_views_of_buffers_are_caches_only_where_read():
    """The review of the beams' fix (hunt41_review): a buffer that only collects outputs,
    merged around its write (coll.reshape(B * K, ...).at[:, t].set(h).reshape(B, K, ...)),
    was taken for a cache and quantized, silently, because the merging reshape counted as
    a read; and a merged view carried by an inner fori_loop over the layers left the outer
    carry float. Now the collector stays float and the outer loop carries the codes."""
    nb, nk, nt, nl, d = 2, 2, 6, 2, 8
    k = jax.random.split(jax.random.key(7), 4)
    p = {"wk": jax.random.normal(k[0], (d, d)) * 0.3, "wo": jax.random.normal(k[1], (d, d)) * 0.3}
    x = jax.random.normal(k[2], (nb * nk, d))
    merge = lambda c: c.reshape(nb * nk, nt, d)
    split = lambda c: c.reshape(nb, nk, nt, d)

    def collect(p, x):
        def body(c, t):
            coll, h = c
            h = jnp.tanh(h @ p["wo"])
            return (split(merge(coll).at[:, t].set(h)), h), h
        (coll, _), hs = lax.scan(body, (jnp.zeros((nb, nk, nt, d)), x), jnp.arange(nt))
        return coll, hs
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        qc = jqt.calibrate(collect, jqt.recipes.w8(kv_cache=True), p, [(x,)], progress=False)
    assert not [key for key in qc if key.startswith("kv_cache")]
    coll, hs = jqt.quantize(collect, qc)(p, x)
    np.testing.assert_array_equal(coll, jnp.moveaxis(hs, 0, 1).reshape(nb, nk, nt, d))

    def layers(p, x):  # the decode loop carries (L, B, K, T, D); a fori_loop over the layers
        def body(c, t):  # carries the merged view and writes each layer's slice
            kc, h = c

            def layer(i, c2):
                kc2, h = c2
                kc2 = kc2.at[i, :, t].set(h @ p["wk"])
                s = jax.nn.softmax(jnp.einsum("bd,btd->bt", h, kc2[i]), -1)
                return kc2, jnp.tanh(h + jnp.einsum("bt,btd->bd", s, kc2[i]))
            kc2, h = lax.fori_loop(0, nl, layer, (kc.reshape(nl, nb * nk, nt, d), h))
            return (kc2.reshape(nl, nb, nk, nt, d), h), h
        return lax.scan(body, (jnp.zeros((nl, nb, nk, nt, d)), x), jnp.arange(nt))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ql = jqt.calibrate(layers, jqt.recipes.w8(kv_cache=True), p, [(x,)], progress=False)
    assert [key for key in ql if key.startswith("kv_cache")] == ["kv_cache_0"]
    qf = jqt.quantize(layers, ql)
    np.testing.assert_allclose(jax.jit(qf)(p, x), jqt.quantize(layers, ql, simulate=True)(p, x), atol=2e-5)
    outer = [e for e in all_eqns(jax.make_jaxpr(qf)(p, x))
             if e.primitive.name == "scan" and e.params["length"] == nt]
    assert sum(v.aval.dtype == jnp.int8 and v.aval.ndim == 5 for v in outer[0].invars) == 1

    def mapped(p, x):  # the cache read only through a view that a lax.map closes over: the
        def body(c, t):  # mend above lost that read (hunt41_review2)
            kc, h = c
            kc = kc.at[:, t].set(h @ p["wk"])
            kr = kc.reshape(nb * nk * nt, d)
            h = jnp.tanh(h + lax.map(lambda hb: jax.nn.softmax(kr @ hb) @ kr, h))
            return (kc, h), h
        return lax.scan(body, (jnp.zeros((nb * nk, nt, d)), x), jnp.arange(nt))[1]
    qm = jqt.calibrate(mapped, jqt.recipes.w8(kv_cache=True), p, [(x,)], progress=False)
    assert [key for key in qm if key.startswith("kv_cache")] == ["kv_cache_0"]
    np.testing.assert_allclose(jax.jit(jqt.quantize(mapped, qm))(p, x),
                               jqt.quantize(mapped, qm, simulate=True)(p, x), atol=2e-5)


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_a_float32_cache_read_in_bfloat16_stays_quantized(setup):
    """A float32 cache converted to bfloat16 for attention: the conversion passes the
    quantized cache on (it decodes to bfloat16), with the simulation's results, and the
    whole buffer is never decoded."""
    p, batches, toks = setup

    def mixed(p, cache, tok):
        pos = cache["pos"]
        lp = jax.tree_util.tree_map(lambda w: w[0], p["layers"])
        h = p["emb"][tok]
        q, k, v = [(h @ lp[w]).reshape(B, H, DH) for w in ("wq", "wk", "wv")]
        kc = lax.dynamic_update_slice(cache["k"], k[:, None], (0, pos, 0, 0))
        vc = lax.dynamic_update_slice(cache["v"], v[:, None], (0, pos, 0, 0))
        bf = jnp.bfloat16
        s = jnp.einsum("bhd,bthd->bht", q.astype(bf), kc.astype(bf)).astype(jnp.float32)
        s = jnp.where(jnp.arange(T) <= pos, s / math.sqrt(DH), -1e30)
        o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, axis=-1).astype(bf), vc.astype(bf))
        return (h + o.astype(jnp.float32).reshape(B, H * DH) @ lp["wo"]) @ p["out"], \
            {"k": kc, "v": vc, "pos": pos + 1}

    start = {"k": jnp.zeros((B, T, H, DH)), "v": jnp.zeros((B, T, H, DH)), "pos": jnp.int32(0)}
    qp = jqt.calibrate(mixed, jqt.recipes.w8(kv_cache=True), p, own_steps(mixed, p, toks[:, :3], start),
                       progress=False)
    qf = jax.jit(jqt.quantize(mixed, qp))
    out_q, cache = feed(qf, p, toks, cache=start)
    out_s, _ = feed(jqt.quantize(mixed, qp, simulate=True), p, toks, cache=start)
    assert cache["k"].float_dtype == "float32" and cache["k"].values.dtype == jnp.int8
    # bfloat16 rounds the decoded values (codes times scale) where the simulation rounds the
    # fake-quantized float32 ones: the same up to bfloat16's rounding
    assert float(jnp.abs(out_q - out_s).mean()) < 0.01 and float(jnp.abs(out_q - out_s).max()) < 0.1
    # the dots read the codes (upcast); nothing multiplies the whole buffer by its scales
    shape = start["k"].shape
    decoded = [e for e in all_eqns(jax.make_jaxpr(qf)(p, cache, toks[:, 0])) for v in e.outvars
               if v.aval.shape == shape and e.primitive.name == "mul"]
    assert not decoded, decoded[0]


@pytest.mark.parametrize("flag", [True, False])
def test_a_cache_selected_by_a_python_constant(flag):
    """``jnp.where(FLAG, written, cache)`` with ``FLAG`` a Python bool (a static config
    flag): the jaxpr's predicate is a literal, which reached the cache's select as a Python
    bool (AttributeError 'bool' object has no attribute 'ndim' on the integer path;
    hunt63_exportlookups). Clearing with ``jnp.where(FLAG, 0.0, written)`` too."""
    rng = np.random.default_rng(0)
    p = {"wk": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)}

    def step(p, cache, x):
        pos = cache["pos"]
        new = lax.dynamic_update_slice(cache["k"], (x @ p["wk"])[:, None], (0, pos, 0))
        kc = jnp.where(flag, new, cache["k"])
        kc = jnp.where(not flag, 0.0, kc)
        return jnp.einsum("bd,btd->bt", x, kc), {"k": kc, "pos": pos + 1}

    cache = {"k": jnp.zeros((2, 4, 8)), "pos": jnp.int32(0)}
    x = jnp.asarray(rng.standard_normal((2, 8)), jnp.float32)
    qp = jqt.calibrate(step, jqt.recipes.w8a8_dynamic(kv_cache=True), p, [(cache, x)], progress=False)
    assert any(k.startswith("kv_cache") for k in qp)
    out, c = jqt.quantize(step, qp)(jqt.pack(qp, p), cache, x)
    sim, _ = jqt.quantize(step, qp, simulate=True)(p, cache, x)
    assert kvcache.is_cache(c["k"])
    np.testing.assert_allclose(out, sim, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out, step(p, cache, x)[0], rtol=0.05, atol=0.05 * float(jnp.abs(sim).max()))


def test_pages_read_with_a_fill_value_decode_to_it():
    """A paged cache read through a page table with a sentinel page,
    ``jnp.take(..., mode="fill", fill_value=0.5)``: the codes were filled with 0 and the
    scales with 0.5, so the page decoded to 0, not 0.5 (hunt64_pagedkv). Such a read takes
    the decoded vectors; a fill of 0 or NaN still reads the codes."""
    n_pages, size, d = 4, 2, 8
    table = jnp.array([1, 3, n_pages], jnp.int32)  # the last page unallocated
    w = jax.random.normal(jax.random.key(0), (d, d))

    def step(w, cache, x, fill):
        pos = cache["pos"]
        kc = cache["k"].at[table[pos // size], pos % size].set(x @ w)
        kr = jnp.take(kc, table, axis=0, mode="fill", fill_value=fill).reshape(-1, d)
        return kr.sum(axis=0), {"k": kc, "pos": pos + 1}

    empty = {"k": jnp.zeros((n_pages, size, d)), "pos": jnp.int32(0)}
    xs = jax.random.normal(jax.random.key(1), (3, d))
    for fill in (0.5, 0.0):
        f = functools.partial(step, fill=fill)
        qp = jqt.calibrate(f, jqt.recipes.w8(kv_cache=True), w, [(empty, x) for x in xs], progress=False)
        y, c = jax.jit(jqt.quantize(f, qp))(w, empty, xs[0])
        assert kvcache.is_cache(c["k"])
        np.testing.assert_allclose(y, jqt.quantize(f, qp, simulate=True)(w, empty, xs[0])[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y, f(w, empty, xs[0])[0], rtol=0.05, atol=0.05)


def test_a_cache_reset_through_a_cond_is_named_and_jnp_where_keeps_it():
    """A loop over prompts clearing its cache with ``lax.cond(new, zeros_like, identity)``
    keeps it float; the warning did not name the reset (hunt64_pagedkv): it names the cond
    and the ``jnp.where`` that keeps it a cache."""
    t, d = 4, 8
    w = jax.random.normal(jax.random.key(0), (d, d))

    def make(reset):
        def f(w, xs):
            def body(c, ix):
                i, x = ix
                c = jax.lax.dynamic_update_slice(reset(i % t == 0, c), (x @ w)[None], (i % t, 0))
                return c, c @ x
            return jax.lax.scan(body, jnp.zeros((t, d)), (jnp.arange(2 * t), xs))[1]
        return f

    xs = jax.random.normal(jax.random.key(1), (2 * t, d))
    cond = make(lambda new, c: jax.lax.cond(new, jnp.zeros_like, lambda c: c, c))
    with pytest.warns(UserWarning, match=r"reset through a lax.cond .*jnp.where\(done, 0.0, cache\)"):
        qp = jqt.calibrate(cond, jqt.recipes.w8(kv_cache=True), w, [(xs,)], progress=False)
    assert not [k for k in qp if "kv_cache" in k]
    qp = jqt.calibrate(make(lambda new, c: jnp.where(new, 0.0, c)), jqt.recipes.w8(kv_cache=True), w,
                       [(xs,)], progress=False)
    assert [k for k in qp if "kv_cache" in k]


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_cache_of_another_type_passed_to_a_loop_that_only_reads_out_is_refused():
    """A cache prefilled outside, passed quantized to a generate whose while_loop carries it
    but whose result is only the logits, was decoded and quantized again to the loop's
    type with no word: an int4 cache ran as the int8 the qparams ask for, with int4's
    error (hunt73_ringcache). It is refused as a cache of the step's own form is; the
    loop's own type, or a float buffer, runs."""
    T, D, P, N = 8, 8, 3, 4
    rng = np.random.default_rng(0)
    p = {"wk": jnp.asarray(rng.standard_normal((D, D)) / 3, jnp.float32),
         "wv": jnp.asarray(rng.standard_normal((D, D)) / 3, jnp.float32)}

    def generate(p, kc, vc, h):
        def body(c):
            kc, vc, pos, h, out = c
            kc = jax.lax.dynamic_update_slice(kc, (h @ p["wk"])[:, None], (0, pos, 0))
            vc = vc.at[:, pos].set(h @ p["wv"])
            s = jnp.where(jnp.arange(T) <= pos, jnp.einsum("bd,btd->bt", h, kc), -1e30)
            h = jnp.tanh(jnp.einsum("bt,btd->bd", jax.nn.softmax(s, -1), vc))
            return kc, vc, pos + 1, h, out.at[pos - P].set(h)
        return jax.lax.while_loop(lambda c: c[2] < P + N, body,
                                  (kc, vc, P, h, jnp.zeros((N,) + h.shape)))[4]

    kc = jnp.asarray(rng.standard_normal((2, T, D)), jnp.float32).at[:, P:].set(0)
    vc = jnp.asarray(rng.standard_normal((2, T, D)), jnp.float32).at[:, P:].set(0)
    h = jnp.asarray(rng.standard_normal((2, D)), jnp.float32)
    # (also through a copy, and a loop under jax.checkpoint: judged by where the loop's
    # carry comes from, not by the decoded array, which those make anew; review of hunt73)
    forms = {"plain": generate,
             "copy": lambda p, kc, vc, h: generate(p, jnp.copy(kc), vc, h),
             "checkpoint": jax.checkpoint(generate)}
    for name, g in forms.items():
        qp = jqt.calibrate(g, jqt.Recipe(rules=(jqt.Rule(kv_cache=True),)), p, [(kc, vc, h)],
                           progress=False)
        qf = jqt.quantize(g, qp)
        own = qf(p, jqt.quantize_cache(kc, True), jqt.quantize_cache(vc, True), h)
        np.testing.assert_allclose(own, qf(p, kc, vc, h), atol=1e-6, err_msg=name)  # the same codes
        for other in ("int4", "fp8"):
            with pytest.raises(jqt.QParamsMismatchError, match=r"argument \[1\] of f is a key/value "
                               r"cache of .*qparams\['kv_cache_0'\] write int8.*quantize_cache\(buffer, 'int8'\)"):
                qf(p, jqt.quantize_cache(kc, other), jqt.quantize_cache(vc, other), h)
