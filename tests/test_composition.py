"""jqt composed with JAX transformations and control flow.

``jax.jit``/``jax.vmap``/``jax.grad`` around quantized functions, quantized
functions around ``jax.jit``, ``lax.scan``/``lax.cond``/``lax.while_loop``,
``jax.checkpoint``, ``jax.custom_jvp``/``jax.custom_vjp`` inside them, optax
training of qparams and params through the simulated path, and the jaxprs the
two paths produce.
"""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import jqt
from shared import all_eqns as _all_eqns
from shared import L, explicit_decoder, scan_mlp, unrolled_mlp

INT_VS_SIM = 1e-4      # integer vs simulated path, relative to the output scale
QUANT_VS_FLOAT = 0.05  # quantized vs float, relative to the output scale


def _rel(a, b, ref=None):
    ref = b if ref is None else ref
    a, b, ref = (np.asarray(v, np.float64) for v in (a, b, ref))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(ref)), 1e-12))


def _normal(seed, shape, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape) * scale


def _check_paths(f, qp, params, *args):
    """Integer path ~ simulated path (rounding), both ~ float; returns the integer output."""
    ref = f(params, *args)
    out_int = jax.jit(jqt.quantize(f, qp))(params, *args)
    out_sim = jax.jit(jqt.quantize(f, qp, simulate=True))(params, *args)
    assert bool(jnp.all(jnp.isfinite(out_int)))
    assert _rel(out_int, out_sim, ref) < INT_VS_SIM
    assert _rel(out_int, ref) < QUANT_VS_FLOAT
    return out_int


def _int8_dots(jaxpr):
    return [e for e in _all_eqns(jaxpr) if e.primitive.name == "dot_general"
            and all(v.aval.dtype == jnp.int8 for v in e.invars)
            and e.params.get("preferred_element_type") == jnp.int32
            and e.outvars[0].aval.dtype == jnp.int32]


def _prims(jaxpr):
    return {e.primitive.name for e in _all_eqns(jaxpr)}


# --------------------------------------------------------------------------- a small MLP


def mlp_params(seed=0, d_in=8, d_h=16, d_out=4):
    return {"w1": _normal(seed, (d_in, d_h), 0.4), "b1": jnp.full((d_h,), 0.05),
            "w2": _normal(seed + 1, (d_h, d_h), 0.3), "b2": jnp.zeros((d_h,)),
            "w3": _normal(seed + 2, (d_h, d_out), 0.3)}


def mlp(p, x):
    """gelu (exact, erf-based) and relu (a custom_jvp) between the layers."""
    h = jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False)
    h = jax.nn.relu(h @ p["w2"] + p["b2"])
    return h @ p["w3"]


MLP_KEYS = ["w1", "w2", "w3"]


@pytest.fixture(scope="module")
def mlp_setup():
    p = mlp_params()
    batches = [(_normal(10 + i, (12, 8)),) for i in range(2)]
    qp = jqt.calibrate(mlp, jqt.recipes.w8a8(), p, batches, progress=False)
    return p, batches, qp


# --------------------------------------------------------------------------- jit


def test_jit_of_quantized(mlp_setup):
    p, batches, qp = mlp_setup
    x = batches[0][0]
    qf = jqt.quantize(mlp, qp)
    sim = jqt.quantize(mlp, qp, simulate=True)
    eager = qf(p, x)
    jitted = jax.jit(qf)(p, x)
    assert _rel(jitted, eager, mlp(p, x)) < INT_VS_SIM
    assert _rel(jax.jit(sim)(p, x), sim(p, x), mlp(p, x)) < INT_VS_SIM
    assert _rel(jitted, mlp(p, x)) < QUANT_VS_FLOAT
    # A second call of the jitted function, with other data of the same shape.
    x2 = batches[1][0]
    assert _rel(jax.jit(qf)(p, x2), qf(p, x2), mlp(p, x2)) < INT_VS_SIM


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_an_eager_call_is_one_compiled_program(mlp_setup, caplog):
    """Called with concrete arrays, the quantized function compiles once per input shapes
    and static values (not op by op), to what jax.jit of it computes; under
    jax.disable_jit it runs op by op, to the same result within rounding."""
    p, batches, _ = mlp_setup
    x = batches[0][0][:3]  # a batch size no other test uses: nothing compiled yet

    def g(p, x, alpha):  # alpha: a Python float, a static value
        return mlp(p, x) * alpha

    qp = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(b[0], 1.0) for b in batches], progress=False)
    qf = jqt.quantize(g, qp)

    def compiles(*args):
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level("WARNING"):
            out = jax.block_until_ready(qf(*args))
        return out, sum("Finished XLA compilation" in r.getMessage() for r in caplog.records)

    (y, n1), (y2, n2), (y3, n3) = compiles(p, x, 1.0), compiles(p, x, 1.0), compiles(p, x, 2.0)
    assert (n1, n2, n3) == (1, 0, 1)
    np.testing.assert_array_equal(y, jax.jit(qf, static_argnums=2)(p, x, 1.0))
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_allclose(y3, 2 * y, rtol=1e-6)
    with jax.disable_jit():
        assert _rel(qf(p, x, 1.0), y, mlp(p, x)) < INT_VS_SIM


def test_named_scopes_are_kept_in_the_compiled_program():
    """The ops a quantized op or a rebuilt loop traces keep the op's ``jax.named_scope``
    (a Flax module's name): profiles of the quantized model name its layers as the float
    one's do. Before, they were traced outside it: ``jit(g)/dot_general`` and
    ``jit(g)/while`` where float had ``jit(g)/decoder/...``."""
    import re
    s = {"inp": jax.random.normal(jax.random.key(0), (16, 32)) * 0.3,
         "stack": jax.random.normal(jax.random.key(1), (3, 32, 32)) * 0.2}
    x = jax.random.normal(jax.random.key(2), (8, 16))

    def g(s, x):
        with jax.named_scope("decoder"):
            def body(h, w):
                with jax.named_scope("layer"):
                    return jnp.tanh(h @ w), None
            return lax.scan(body, x @ s["inp"], s["stack"])[0]

    def names(fn, *args):
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        return sorted(set(re.findall(r'= \S+ dot\(.*?op_name="jit\([^)]*\)/([^"]*)"', hlo)))

    want = names(g, s, x)
    assert want == ["decoder/dot_general", "decoder/while/body/closed_call/layer/dot_general"], want
    qs = jqt.calibrate(g, jqt.recipes.w8a8(), s, [(x,)], progress=False)
    assert names(jqt.quantize(g, qs), jqt.pack(qs, s), x) == want
    assert names(jqt.quantize(g, qs, simulate=True), s, x) == want


def test_quantize_of_jit(mlp_setup):
    p, batches, qp = mlp_setup
    x = batches[0][0]
    assert list(qp) == MLP_KEYS
    jf = jax.jit(mlp)
    # qparams calibrated on f (no jit) fit jax.jit(f): same keys.
    assert list(jqt.calibrate(jf, jqt.recipes.w8a8(), p, batches, progress=False)) == list(qp)
    out = jqt.quantize(jf, qp)(p, x)
    assert _rel(out, jqt.quantize(mlp, qp)(p, x), mlp(p, x)) < INT_VS_SIM
    assert _rel(jax.jit(jqt.quantize(jf, qp))(p, x), out, mlp(p, x)) < INT_VS_SIM
    assert _rel(jqt.quantize(jf, qp, simulate=True)(p, x), out, mlp(p, x)) < INT_VS_SIM
    # A nested jit inside f does not change the keys either.
    nested = lambda p, x: jax.jit(mlp)(p, x)
    assert list(jqt.calibrate(nested, jqt.recipes.w8a8(), p, batches, progress=False)) == MLP_KEYS


# --------------------------------------------------------------------------- vmap


def attention(p, x):
    q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
    return jax.nn.softmax(q @ k.T / 4.0, axis=-1) @ v


@pytest.mark.parametrize("case", [  # CI's slow run (the default run's vmap checks: test_native,
    pytest.param(c, marks=pytest.mark.slow)  # test_kvcache, test_accumulator, test_formats)
    for c in ("w8a8", "w8a8_dynamic", "attention_act_x_act")])
def test_vmap_equals_loop(case):
    if case == "attention_act_x_act":
        f = attention
        p = {n: _normal(20 + i, (8, 8), 0.3) for i, n in enumerate("qkv")}
        recipe = jqt.recipes.w8a8_dynamic(act_x_act=True)
    else:
        f, p, recipe = mlp, mlp_params(), getattr(jqt.recipes, case)()
    xs = _normal(30, (4, 6, 8))
    qp = jqt.calibrate(f, recipe, p, [(x,) for x in xs[:2]], progress=False)
    if case == "attention_act_x_act":
        assert sum(1 for q in qp.values() if q.weight_operand is None and not q.is_float) == 2
    for simulate in (False, True):
        qf = jax.jit(jqt.quantize(f, qp, simulate=simulate))
        batched = jax.jit(jax.vmap(jqt.quantize(f, qp, simulate=simulate), in_axes=(None, 0)))(p, xs)
        loop = jnp.stack([qf(p, x) for x in xs])
        assert batched.shape == loop.shape
        assert _rel(batched, loop) < 1e-6
    # vmap with the packed weights too.
    qf = jqt.quantize(f, qp)
    packed = jqt.pack(qp, p)
    batched = jax.vmap(qf, in_axes=(None, 0))(packed, xs)
    assert _rel(batched, jnp.stack([jax.jit(qf)(p, x) for x in xs])) < 1e-6


# --------------------------------------------------------------------------- grad


def test_grad_wrt_qparams(mlp_setup):
    p, batches, qp = mlp_setup
    x = batches[0][0]
    y = mlp(p, x)

    @jax.jit
    def loss(qp):
        return jnp.mean((jqt.quantize(mlp, qp, simulate=True)(p, x) - y) ** 2)

    g = jax.grad(loss)(qp)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(qp)
    for k in qp:
        assert isinstance(g[k], jqt.OpQParams)
        for a, b in zip(jax.tree_util.tree_leaves(g[k]), jax.tree_util.tree_leaves(qp[k])):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert bool(jnp.all(jnp.isfinite(a)))
        # Scales get gradients (LSQ): weights and activations.
        assert float(jnp.abs(g[k].rhs.scale).max()) > 0, k
        assert float(jnp.abs(g[k].lhs.scale)) > 0, k


def test_grad_wrt_params(mlp_setup):
    p, batches, qp = mlp_setup
    x = batches[0][0]
    sim = jqt.quantize(mlp, qp, simulate=True)
    g = jax.jit(jax.grad(lambda p: jnp.sum(sim(p, x) ** 2)))(p)
    gf = jax.jit(jax.grad(lambda p: jnp.sum(mlp(p, x) ** 2)))(p)
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(p)
    for k in p:
        assert bool(jnp.all(jnp.isfinite(g[k])))
        assert float(jnp.abs(g[k]).max()) > 0
        # straight-through: close to the float gradient at int8
        assert _rel(g[k], gf[k]) < 0.1, k
    # Eager (not jitted) grad gives the same.
    ge = jax.grad(lambda p: jnp.sum(sim(p, x) ** 2))(p)
    for k in p:
        np.testing.assert_allclose(np.asarray(ge[k]), np.asarray(g[k]), rtol=1e-4,
                                   atol=1e-5 * float(jnp.abs(g[k]).max()))


W4 = jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=4, narrow_range=True, per_channel=True),
                                activation=jqt.QuantType(bits=8, symmetric=False)),))


@pytest.fixture(scope="module")
def w4_setup():
    p = mlp_params(seed=40, d_in=8, d_h=32, d_out=8)
    x = _normal(41, (64, 8))
    y = mlp(p, x)
    qp = jqt.calibrate(mlp, W4, p, [(x,)], progress=False)
    return p, x, y, qp


def _adam(loss, init, steps, lr):
    opt = optax.adam(lr)

    @jax.jit
    def step(state, opt_state):
        l, g = jax.value_and_grad(loss)(state)
        updates, opt_state = opt.update(g, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, l

    state, opt_state = init, opt.init(init)
    for _ in range(steps):
        state, opt_state, _ = step(state, opt_state)
    return state


@pytest.fixture(scope="module")
def w4_trained_qparams(w4_setup):
    p, x, y, qp = w4_setup
    loss = jax.jit(lambda qp: jnp.mean((jqt.quantize(mlp, qp, simulate=True)(p, x) - y) ** 2))
    trained = _adam(loss, qp, steps=80, lr=1e-3)
    return loss, trained


@pytest.mark.slow  # test_optax_adam_on_params_and_qparams by default: CI
def test_optax_adam_on_qparams_lowers_loss(w4_setup, w4_trained_qparams):
    p, x, y, qp = w4_setup
    loss, trained = w4_trained_qparams
    assert qp["w1"].rhs.qtype.bits == 4
    l0, l1 = float(loss(qp)), float(loss(trained))
    assert np.isfinite(l1)
    assert l1 < 0.9 * l0, (l0, l1)
    assert jax.tree_util.tree_structure(trained) == jax.tree_util.tree_structure(qp)
    for k in qp:
        assert bool(jnp.all(trained[k].rhs.scale > 0))
        assert not np.allclose(np.asarray(trained[k].rhs.scale), np.asarray(qp[k].rhs.scale))


def test_trained_qparams_integer_path_matches_simulation(w4_setup, w4_trained_qparams):
    """What was trained in simulation is what the integer path runs (after jqt.qat.project,
    which puts a zero point that drifted out of its range back: quantize refuses it)."""
    p, x, y, _ = w4_setup
    _, trained = w4_trained_qparams
    trained = jqt.qat.project(trained)
    out_sim = jax.jit(jqt.quantize(mlp, trained, simulate=True))(p, x)
    out_int = jax.jit(jqt.quantize(mlp, trained))(p, x)
    assert _rel(out_int, out_sim, y) < INT_VS_SIM


def test_optax_adam_on_params_and_qparams(w4_setup):
    """Quantization-aware training: recover the teacher's outputs from perturbed weights."""
    p, x, y, _ = w4_setup
    student = jax.tree_util.tree_map(lambda a: a + 0.1 * _normal(50, a.shape), p)
    qp = jqt.calibrate(mlp, W4, student, [(x,)], progress=False)

    def loss(state):
        qp, params = state
        return jnp.mean((jqt.quantize(mlp, qp, simulate=True)(params, x) - y) ** 2)

    l0 = float(jax.jit(loss)((qp, student)))
    qp1, student1 = _adam(loss, (qp, student), steps=80, lr=3e-3)
    l1 = float(jax.jit(loss)((qp1, student1)))
    assert np.isfinite(l1)
    assert l1 < 0.5 * l0, (l0, l1)


# --------------------------------------------------------------------------- lax.scan


def scan_params(seed=60):
    return {"inp": _normal(seed, (8, 16), 0.4),
            "layers": {"w": _normal(seed + 1, (L, 16, 16), 0.25), "b": jnp.zeros((L, 16))},
            "out": _normal(seed + 2, (16, 4), 0.3)}


@pytest.mark.slow  # scans: test_loops, test_native and test_outliers by default: CI
def test_lax_scan_stacked_layers():
    p = scan_params()
    batches = [(_normal(70 + i, (10, 8)),) for i in range(2)]
    qp = jqt.calibrate(scan_mlp, jqt.recipes.w8a8(), p, batches, progress=False)
    assert list(qp) == ["inp", "layers/w", "out"]
    assert list(jqt.calibrate(jax.jit(scan_mlp), jqt.recipes.w8a8(), p, batches,
                              progress=False)) == list(qp)
    s = qp["layers/w"]
    assert s.rhs.scale.shape == (L, 1, 16)
    assert s.lhs.scale.shape == (L,) and s.lhs.zero_point.shape == (L,)
    assert qp["inp"].lhs.scale.shape == ()

    # Per-layer qparams equal those of the unrolled function.
    qpu = jqt.calibrate(unrolled_mlp, jqt.recipes.w8a8(), p, batches, progress=False)
    layer_keys = [k for k in qpu if k.startswith("layers/w")]
    assert len(layer_keys) == L
    for i, k in enumerate(layer_keys):
        np.testing.assert_allclose(np.asarray(s.rhs.scale[i]), np.asarray(qpu[k].rhs.scale), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(s.lhs.scale[i]), np.asarray(qpu[k].lhs.scale), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(s.lhs.zero_point[i]), np.asarray(qpu[k].lhs.zero_point))

    x = batches[0][0]
    out = _check_paths(scan_mlp, qp, p, x)
    out_u = jax.jit(jqt.quantize(unrolled_mlp, qpu))(p, x)
    assert _rel(out, out_u, scan_mlp(p, x)) < INT_VS_SIM

    qf = jqt.quantize(scan_mlp, qp)
    packed = jqt.pack(qp, p)
    assert packed.weights["layers/w"].values.shape == (L, 16, 16)
    assert _rel(jax.jit(qf)(packed, x), out, out) < 1e-6

    xs = _normal(72, (3, 5, 8))
    batched = jax.vmap(qf, in_axes=(None, 0))(p, xs)
    assert _rel(batched, jnp.stack([jax.jit(qf)(p, xi) for xi in xs])) < 1e-6

    # Gradients w.r.t. stacked qparams are stacked, one non-zero entry per layer.
    g = jax.jit(jax.grad(lambda q: jnp.mean(
        (jqt.quantize(scan_mlp, q, simulate=True)(p, x) - scan_mlp(p, x)) ** 2)))(qp)
    assert g["layers/w"].lhs.scale.shape == (L,)
    assert g["layers/w"].rhs.scale.shape == (L, 1, 16)
    assert bool(jnp.all(jnp.isfinite(g["layers/w"].lhs.scale)))
    assert bool(jnp.all(jnp.abs(g["layers/w"].lhs.scale) > 0))
    assert bool(jnp.all(jnp.abs(g["layers/w"].rhs.scale).max(axis=(1, 2)) > 0))


# --------------------------------------------------------------------------- lax.cond


def cond_params():
    return {"a": _normal(80, (8, 8), 0.3), "b": _normal(81, (8, 8), 0.3)}


def cond_fn(p, x, flag):
    return lax.cond(flag, lambda h: h @ p["a"], lambda h: jnp.tanh(h @ p["b"]) * 2.0, x)


def _weight_scale(w):
    return jnp.max(jnp.abs(w), axis=0, keepdims=True) / 127.0


@pytest.mark.slow_variants
@pytest.mark.parametrize("recipe", [jqt.recipes.w4(group_size=4), jqt.recipes.w8(),
                                    jqt.recipes.w8a8_dynamic(), jqt.recipes.nf4(group_size=4)],
                         ids=["w4_g4", "w8", "w8a8_dynamic", "nf4_g4"])
def test_an_untaken_branch_is_quantized_from_its_weight_where_no_data_is_needed(recipe):
    """A weight-only or dynamic op in a branch calibration never took stayed float with a
    "never ran" warning, though its qparams need only its weight. It is now quantized
    from the weight, with the qparams that a batch reaching it gives; a lookup likewise,
    and an op under a scan over stacked layers that ran in no layer (hunt76)."""
    p = {**cond_params(), "emb": _normal(83, (5, 8)), "s": _normal(84, (3, 8, 8), 0.3)}

    def f(p, x, ids, flag):
        def other(h):
            h = jnp.tanh(h @ p["b"]) * 2.0 + p["emb"][ids]
            return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["s"])[0]
        return lax.cond(flag, lambda h: h @ p["a"], other, x)

    x, ids = _normal(82, (6, 8)), jnp.arange(6) % 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "never ran"
        qp = jqt.calibrate(f, recipe, p, [(x, ids, True)], progress=False)
        reached = jqt.calibrate(f, recipe, p, [(x, ids, True), (x, ids, False)], progress=False)
    assert sorted(qp) == sorted(reached) and len(qp) == 4
    for k in qp:
        assert not qp[k].is_float, k
        for got, want in zip(jax.tree.leaves(qp[k]), jax.tree.leaves(reached[k])):
            np.testing.assert_array_equal(got, want)
    packed = jqt.pack(qp, p)
    out = jax.jit(jqt.quantize(f, qp))(packed, x, ids, False)
    sim = jqt.quantize(f, qp, simulate=True)(p, x, ids, False)
    np.testing.assert_allclose(out, sim, atol=1e-4)
    assert float(jnp.max(jnp.abs(out - f(p, x, ids, False)))) > 0  # quantized, not float
    assert packed.nbytes() < sum(a.nbytes for a in jax.tree.leaves(p)) * 0.5


def test_an_untaken_branch_under_awq_or_smooth_says_it_goes_without_them():
    """An op no batch reached has no activation statistics for smooth=/awq=: quantized
    from its weight since 70cb94e, it went without them and without a word, under
    smooth= with a smoothing vector of ones stored; jqt.gptq blamed zero inputs
    (hunt76_untaken)."""
    p = cond_params()
    x = _normal(82, (32, 8))
    for recipe in (jqt.recipes.w4(group_size=4, awq=True), jqt.recipes.w8a8_dynamic(smooth=0.5)):
        with pytest.warns(UserWarning, match=r"no calibration batch reached ops \['b'\] .*quantized "
                                             r"without smooth=/awq="):
            qp = jqt.calibrate(cond_fn, recipe, p, [(x, True)], progress=False)
        assert not qp["b"].is_float and qp["b"].smooth is None and qp["a"].smooth is not None
    qp = jqt.calibrate(cond_fn, jqt.recipes.w4(group_size=4), p, [(x, True)], progress=False)
    with pytest.warns(UserWarning, match=r"jqt.gptq: op 'b': no calibration row reached it"):
        jqt.gptq(cond_fn, qp, p, [(x, True)], progress=False)


def test_cond_untaken_branch_warns_and_stays_float():
    p = cond_params()
    x = _normal(82, (6, 8))
    with pytest.warns(UserWarning, match="never ran"):
        qp = jqt.calibrate(cond_fn, jqt.recipes.w8a8(), p, [(x, True), (x * 2, True)],
                           progress=False)
    assert set(qp) == {"a", "b"}
    assert qp["b"].is_float
    assert not qp["a"].is_float
    qf = jax.jit(jqt.quantize(cond_fn, qp))
    sim = jax.jit(jqt.quantize(cond_fn, qp, simulate=True))
    for flag in (True, False):
        ref = cond_fn(p, x, flag)
        out = qf(p, x, flag)
        assert bool(jnp.all(jnp.isfinite(out)))
        assert bool(jnp.all(jnp.isfinite(sim(p, x, flag))))
        assert _rel(out, sim(p, x, flag), ref) < INT_VS_SIM
        assert _rel(out, ref) < QUANT_VS_FLOAT
    # the float branch is exactly the float function
    np.testing.assert_allclose(np.asarray(qf(p, x, False)), np.asarray(cond_fn(p, x, False)),
                               rtol=1e-6, atol=1e-6)
    assert _rel(qf(p, x, True), cond_fn(p, x, True)) > 0


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_matrices_f_builds_from_iota_stay_float():
    """jax.image.resize (bilinear) multiplies by interpolation matrices, and
    lax.conv_general_dilated_patches convolves with a one-hot filter, both built in f from
    iota: they were quantized as weights (a constant image no longer constant after the
    resize; hunt32_diffusion, hunt32_linen). They stay float with a note; a weight closed
    over as a constant is still quantized."""
    rng = np.random.default_rng(4)
    w = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    closed = jnp.asarray(rng.standard_normal((3, 3)), jnp.float32)

    def f(w, x):  # x (1, 4, 4, 2)
        up = jax.image.resize(x, (1, 8, 8, 2), "bilinear") @ w
        patches = lax.conv_general_dilated_patches(x, (2, 2), (1, 1), "VALID",
                                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return up.sum() + patches.sum() + (up @ closed).sum()

    x = jnp.asarray(rng.standard_normal((1, 4, 4, 2)), jnp.float32)
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    built = [k for k, v in qp.items() if "builds from iota" in v.note]
    assert len(built) == 3, {k: v.note for k, v in qp.items()}  # two einsums, one conv
    assert all(qp[k].is_float for k in built)
    quantized = [k for k, v in qp.items() if not v.is_float]
    assert "w" in quantized and len(quantized) == 2, quantized  # w and the closed-over matrix
    rep = str(jqt.report(f, qp, w, (x,)))
    assert "kept float (its weight is a matrix f builds from iota" in rep
    # the same matrix read inside a lax.scan; a weight times a built matrix, x @ (w @ m)
    # (an AttributeError in the two-weights note); smoothing passes over the float ops
    m = lambda: jnp.cos(jnp.outer(jnp.arange(3.0), jnp.arange(3.0)))
    def h(w, x):
        mm = m()  # made in f outside the loop, read inside
        return lax.scan(lambda c, _: (jnp.tanh(c @ mm[:2, :2] + (c @ w)[:, :2]), None), x, None,
                        length=2)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no pack or smoothing warning for the float ops
        qh = jqt.calibrate(h, jqt.recipes.w8a8(smooth=0.5), w, [(jnp.ones((4, 2)),)], progress=False)
        jqt.pack(qh, w)
    assert [k for k, v in qh.items() if "builds from iota" in v.note] == ["dot_general_0"]
    g = lambda w, x: x @ (w @ m())  # w @ m: the learned w is the weight (m the activation)
    qg = jqt.calibrate(g, jqt.recipes.w8a8(), w, [(jnp.ones((4, 2)),)], progress=False)
    assert sorted(qg) == ["dot_general_0", "w"] and not qg["w"].is_float, qg
    # a closed-over array JAX keeps as a literal (jax_use_simplified_jaxpr_constants) is
    # a weight still
    before = jax.config.values["jax_use_simplified_jaxpr_constants"]
    jax.config.update("jax_use_simplified_jaxpr_constants", True)
    try:
        qc = jqt.calibrate(lambda w, x: (x @ w) @ closed, jqt.recipes.w8a8(), w, [(x[0, 0],)],
                           progress=False)
    finally:
        jax.config.update("jax_use_simplified_jaxpr_constants", before)
    assert all(not v.is_float for v in qc.values()), {k: v.note for k, v in qc.items()}
    # a matrix built row by row in a loop or under a cond (lax.map of a filterbank's rows,
    # a fori_loop): it was quantized as a weight (hunt33_speech); one that reads a closed-
    # over array in the loop is a weight still
    row = lambda i: jnp.cos(i * jnp.arange(3.0))
    loops = {"map": lambda: lax.map(row, jnp.arange(3.0)),
             "fori": lambda: lax.fori_loop(0, 2, lambda i, a: a + m(), jnp.zeros((3, 3))),
             "cond": lambda: lax.cond(True, m, lambda: jnp.eye(3)),
             "closed": lambda: lax.map(lambda i: row(i) * closed[0], jnp.arange(3.0))}
    for name, mk in loops.items():
        ql = jqt.calibrate(lambda w, x: (x @ w) @ mk(), jqt.recipes.w8a8(), w, [(jnp.ones((4, 2)),)],
                           progress=False)
        assert ("builds from iota" in ql["dot_general_0"].note) == (name != "closed"), name
    # a learned matrix times a built one, channels first (w @ pos_cf): the learned one is
    # the weight (the rhs, the built one, was taken for it: w stayed float; hunt34_detect)
    qw = jqt.calibrate(lambda w, x: (x @ w) + (w @ m())[:, :2].sum(), jqt.recipes.w8(), w,
                       [(jnp.ones((4, 2)),)], progress=False)
    assert sorted(qw) == ["w", "w#1"] and not qw["w#1"].is_float and qw["w#1"].weight_operand == 0
    # the resize of a constant image stays constant
    const = jnp.full((1, 4, 4, 2), 0.7)
    g = lambda w, x: jax.image.resize(x, (1, 8, 8, 2), "bilinear")
    qg = jqt.calibrate(g, jqt.recipes.w4(), w, [(const,)], progress=False)
    np.testing.assert_allclose(jqt.quantize(g, qg)(w, const), 0.7, rtol=1e-6)


def test_qparams_run_at_input_shapes_that_change_the_number_of_interpolation_matrices():
    """jax.image.resize multiplies by one built matrix per axis whose size it changes, so a
    fully-convolutional net resizing to its skip's size has none at one image size and two
    at another. Those ops are always float: qparams calibrated at one size run at the other
    (hunt46_seg: a missing or extra key refused the call), calibrating on both sizes at once
    is refused by what differs, and a positional key that a built matrix held at one size
    and another op at the other is refused, not taken as that op's entry."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
         "v": jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)}

    def f(p, x):
        h = jax.image.resize(x @ p["w"], (x.shape[0], 8, 8, 4), "bilinear")
        return h @ p["v"]

    x8, x6 = (jnp.asarray(rng.standard_normal((2, n, n, 3)), jnp.float32) for n in (8, 6))
    for cal, run in ((x8, x6), (x6, x8)):
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(cal,)], progress=False)
        sim = jqt.quantize(f, qp, simulate=True)(p, run)
        got = jqt.quantize(f, qp)(p, run)
        np.testing.assert_allclose(got, sim, rtol=1e-5, atol=1e-5)
        ref = f(p, run)  # static ranges from other samples clip a little: an L2 bound
        assert float(jnp.linalg.norm(got - ref)) < 0.05 * float(jnp.linalg.norm(ref))
    with pytest.raises(jqt.CalibrationDataError, match=r"matrices f builds.*calibrate on batches "
                       "of one shape"):
        jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x8,), (x6,)], progress=False)
    # rules keyed to the weights: the built matrices no rule matches are marked too (their
    # entries read "no rule matches", and the call at 8x8 was refused; review hunt46_review2)
    keyed = jqt.Recipe(rules=tuple(dataclasses.replace(r, key="^(w|v)$") for r in jqt.recipes.w8a8().rules))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor is the user told to add a rule for them
        qk = jqt.calibrate(f, keyed, p, [(x6,)], progress=False)
    np.testing.assert_allclose(jqt.quantize(f, qk)(p, x8), jqt.quantize(f, qk, simulate=True)(p, x8),
                               rtol=1e-5, atol=1e-5)

    def g(p, x):  # an activation x activation product after the resize, in the same scope
        h = jax.image.resize(x @ p["w"], (x.shape[0], 8, 8, 4), "bilinear")
        return h @ jnp.swapaxes(h, -1, -2)  # keyed dot_general_0 at 8x8, dot_general_2 at 6x6

    axa = jqt.recipes.w8a8_dynamic(act_x_act=True)
    for cal, run, was in ((x6, x8, "an op whose weight f builds"), (x8, x6, "another op")):
        qg = jqt.calibrate(g, axa, p, [(cal,)], progress=False)
        with pytest.raises(jqt.QParamsMismatchError, match=f"was made for {was}.*Calibrate at "
                           "these input shapes"):
            jqt.quantize(g, qg)(p, run)


def test_a_platform_dependent_branch_of_another_platform_is_named():
    """lax.platform_dependent: calibration runs only this platform's branch; the other
    branch's op stays float with a warning that names it (not a call for more data)."""
    p = cond_params()
    x = _normal(83, (6, 8))

    def f(p, x):
        return lax.platform_dependent(x, p["a"], cpu=lambda x, w: x @ w,
                                      cuda=lambda x, w: jnp.tanh(x @ w))

    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    msgs = [str(w.message) for w in ws]
    assert not any("never ran on the calibration data" in m for m in msgs), msgs
    named = [m for m in msgs if "lax.platform_dependent" in m]
    assert len(named) == 1 and "'a#1'" in named[0] and "branch for cuda" in named[0], msgs
    assert "calibrate on that platform" in named[0]
    assert not qp["a"].is_float and qp["a#1"].is_float
    assert "platform_dependent" in qp["a#1"].note
    out = jax.jit(jqt.quantize(f, qp))(p, x)
    assert _rel(out, f(p, x)) < QUANT_VS_FLOAT


@pytest.mark.parametrize("order", [(True, False), (False, True)])
@pytest.mark.slow_variants
def test_cond_both_branches_quantized(order):
    p = cond_params()
    x = _normal(83, (6, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        qp = jqt.calibrate(cond_fn, jqt.recipes.w8a8(), p, [(x, order[0]), (x, order[1])],
                           progress=False)
    assert not qp["a"].is_float and not qp["b"].is_float
    # Each branch's weight scale comes from its own weight, whichever batch reached it.
    for k in ("a", "b"):
        np.testing.assert_allclose(np.asarray(qp[k].rhs.scale), np.asarray(_weight_scale(p[k])),
                                   rtol=1e-6, err_msg=f"weight scale of branch op '{k}'")
    for flag in (True, False):
        _check_paths(cond_fn, qp, p, x, flag)


# --------------------------------------------------------------------------- lax.while_loop


def while_fn(p, x, n):
    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ p["a"]) + 0.5 * h

    return lax.while_loop(lambda c: c[0] < n, body, (0, x))[1]


def test_while_loop():
    p = cond_params()
    x = _normal(84, (6, 8))
    qp = jqt.calibrate(while_fn, jqt.recipes.w8a8(), p, [(x, 3), (x * 1.5, 2)], progress=False)
    assert list(qp) == ["a"] and not qp["a"].is_float
    np.testing.assert_allclose(np.asarray(qp["a"].rhs.scale), np.asarray(_weight_scale(p["a"])),
                               rtol=1e-6)
    for n in (1, 3, 5):
        _check_paths(while_fn, qp, p, x, n)
    jaxpr = jax.make_jaxpr(jqt.quantize(while_fn, qp))(p, x, 3)
    whiles = [e for e in _all_eqns(jaxpr) if e.primitive.name == "while"]
    assert len(whiles) == 1
    assert _int8_dots(whiles[0].params["body_jaxpr"])


def test_while_loop_calibrated_on_zero_iterations_first():
    """The first calibration batch does not enter the loop, the second does."""
    p = cond_params()
    x = _normal(85, (6, 8))
    qp = jqt.calibrate(while_fn, jqt.recipes.w8a8(), p, [(x, 0), (x, 3)], progress=False)
    np.testing.assert_allclose(np.asarray(qp["a"].rhs.scale), np.asarray(_weight_scale(p["a"])),
                               rtol=1e-6)
    _check_paths(while_fn, qp, p, x, 3)


# --------------------------------------------------------------------------- jax.checkpoint


def ckpt_mlp(p, x, policy=None):
    h = jax.checkpoint(lambda h: jax.nn.gelu(h @ p["w1"] + p["b1"], approximate=False),
                       policy=policy)(x)
    h = jax.checkpoint(lambda h: jax.nn.relu(h @ p["w2"] + p["b2"]), policy=policy)(h)
    return h @ p["w3"]


@pytest.mark.parametrize("policy", [None, pytest.param(jax.checkpoint_policies.dots_saveable,  # CI
                                                     marks=pytest.mark.slow)])
def test_checkpoint_grad_through_simulate(mlp_setup, policy):
    p, batches, qp_plain = mlp_setup
    x = batches[0][0]
    f = lambda p, x: ckpt_mlp(p, x, policy)
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, batches, progress=False)
    assert list(qp) == MLP_KEYS
    for k in qp:  # the same statistics as without checkpoint
        for a, b in zip(jax.tree_util.tree_leaves(qp[k]), jax.tree_util.tree_leaves(qp_plain[k])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    _check_paths(f, qp, p, x)

    y = mlp(p, x)
    loss = lambda fn: (lambda qp, p: jnp.mean((jqt.quantize(fn, qp, simulate=True)(p, x) - y) ** 2))
    gq, gp = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(qp, p)
    gq_ref, gp_ref = jax.jit(jax.grad(loss(mlp), argnums=(0, 1)))(qp, p)
    for a, b in zip(jax.tree_util.tree_leaves((gq, gp)), jax.tree_util.tree_leaves((gq_ref, gp_ref))):
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                   atol=1e-5 * max(float(jnp.abs(b).max()), 1e-12))
    assert float(jnp.abs(gq["w1"].rhs.scale).max()) > 0
    assert float(jnp.abs(gp["w1"]).max()) > 0
    # the simulated jaxpr keeps the remat
    grad_jaxpr = jax.make_jaxpr(jax.grad(loss(f), argnums=1))(qp, p)
    assert _prims(grad_jaxpr) & {"remat2", "checkpoint"}


# --------------------------------------------------------------------------- activations


def test_gelu_and_relu_between_layers(mlp_setup):
    p, batches, qp = mlp_setup
    x = batches[1][0]
    prims = _prims(jax.make_jaxpr(mlp)(p, x))
    assert "custom_jvp_call" in prims  # jax.nn.relu
    assert "erf" in prims or "erfc" in prims  # exact gelu
    out = _check_paths(mlp, qp, p, x)
    # the relu output is non-negative, so the last op's activation zero point is qmin
    assert float(qp["w3"].lhs.zero_point) == -128.0
    assert out.shape == (12, 4)
    # gradients through the custom_jvp relu in simulation
    g = jax.jit(jax.grad(lambda x: jnp.sum(jqt.quantize(mlp, qp, simulate=True)(p, x))))(x)
    gf = jax.grad(lambda x: jnp.sum(mlp(p, x)))(x)
    assert _rel(g, gf) < 0.1


# --------------------------------------------------------------------------- custom_vjp / custom_jvp

SCALE = 100.0


@jax.custom_vjp
def loud_layer(w, h):
    return jnp.tanh(h @ w)


def _loud_fwd(w, h):
    return loud_layer(w, h), (w, h)


def _loud_bwd(res, g):
    w, h = res
    gz = g * (1.0 - jnp.tanh(h @ w) ** 2)
    return SCALE * (h.T @ gz), SCALE * (gz @ w.T)


loud_layer.defvjp(_loud_fwd, _loud_bwd)


@jax.custom_jvp
def loud_layer_jvp(w, h):
    return jnp.tanh(h @ w)


@loud_layer_jvp.defjvp
def _loud_jvp(primals, tangents):
    w, h = primals
    tw, th = tangents
    y = jnp.tanh(h @ w)
    return y, SCALE * (1.0 - y ** 2) * (th @ w + h @ tw)


def plain_layer(w, h):
    return jnp.tanh(h @ w)


def _custom_model(layer):
    return lambda p, x: layer(p["a"], x) @ p["b"]


@pytest.mark.slow  # custom_jvp / custom_vjp with int8 (test_formats: with int4 and fp8 by default): CI
@pytest.mark.parametrize("layer", [loud_layer, loud_layer_jvp], ids=["custom_vjp", "custom_jvp"])
def test_custom_derivative_rule_kept_in_simulation(layer):
    p = {"a": _normal(90, (8, 8), 0.3), "b": _normal(91, (8, 4), 0.3)}
    x = _normal(92, (6, 8))
    f, f_plain = _custom_model(layer), _custom_model(plain_layer)
    prim = "custom_vjp_call" if layer is loud_layer else "custom_jvp_call"
    assert prim in _prims(jax.make_jaxpr(f)(p, x))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    assert list(qp) == ["a", "b"]  # the matmul inside the custom rule is quantized
    assert not qp["a"].is_float
    _check_paths(f, qp, p, x)

    sim = jqt.quantize(f, qp, simulate=True)
    loss = lambda fn: (lambda x: jnp.sum(fn(p, x) ** 2))
    g_float = jax.grad(loss(f))(x)
    g_plain = jax.grad(loss(f_plain))(x)
    g_sim = jax.jit(jax.grad(loss(sim)))(x)
    # the float function shows the rule: 100x the plain gradient
    assert _rel(g_float, SCALE * g_plain) < 1e-4
    # ... and so does the simulated one
    assert bool(jnp.all(jnp.isfinite(g_sim)))
    assert _rel(g_sim, g_float) < 0.05
    assert float(jnp.abs(g_sim).max()) > 0.5 * SCALE * float(jnp.abs(g_plain).max())
    # w.r.t. the weights too
    gw_sim = jax.jit(jax.grad(lambda p: jnp.sum(sim(p, x) ** 2)))(p)
    gw_float = jax.grad(lambda p: jnp.sum(f(p, x) ** 2))(p)
    assert _rel(gw_sim["a"], gw_float["a"]) < 0.05
    # and the quantization parameters of the op inside the rule are differentiable
    gq = jax.jit(jax.grad(lambda q: jnp.sum(jqt.quantize(f, q, simulate=True)(p, x) ** 2)))(qp)
    assert bool(jnp.all(jnp.isfinite(gq["a"].rhs.scale)))
    assert float(jnp.abs(gq["a"].rhs.scale).max()) > 0
    assert float(jnp.abs(gq["a"].lhs.scale)) > 0
    if layer is loud_layer_jvp:  # forward mode keeps the rule too
        t = jnp.ones_like(x)
        _, t_float = jax.jvp(lambda x: f(p, x), (x,), (t,))
        _, t_sim = jax.jvp(lambda x: sim(p, x), (x,), (t,))
        assert _rel(t_sim, t_float) < 0.05


def test_a_debug_print_of_an_activation_runs_under_calibrate_and_quantize():
    """A ``jax.debug.print`` of an activation between two matmuls (an op with no outputs
    reading data) crashed calibrate and the quantized function with an IndexError
    (hunt65_serving)."""
    seen = []
    p = {"w1": _normal(96, (8, 16), 0.3), "w2": _normal(97, (16, 4), 0.3)}
    x = _normal(98, (6, 8))

    def f(p, x):
        h = jnp.tanh(x @ p["w1"])
        jax.debug.callback(lambda m: seen.append(float(m)), h.mean())
        return h @ p["w2"]
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    y = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x)
    jax.effects_barrier()
    assert sorted(qp) == ["w1", "w2"] and y.shape == (6, 4) and len(seen) >= 2


def test_a_donating_jit_quantized_eagerly_says_the_donation_is_lost():
    """``jqt.quantize(jax.jit(step, donate_argnums=1), qp)`` called eagerly runs the step
    inside jqt's own program, where the donation does nothing: the cache was kept, a second
    copy, without a word (hunt65_serving). Jitting the quantized function with the
    donation says nothing and donates."""
    p = {"w": _normal(99, (8, 8), 0.3)}
    step = jax.jit(lambda p, c: (c @ p["w"], c + 1.0), donate_argnums=1)
    c = _normal(100, (4, 8))
    qp = jqt.calibrate(step, jqt.recipes.w8(), p, [(c,)], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qf = jqt.quantize(step, qp)
        outer = jax.jit(qf, donate_argnums=1)
        c1 = c + 0.0
        outer(p, c1)
        assert c1.is_deleted()
        outer(p, c[:2] + 0.0)  # a second trace (hunt65_review2: then it said nothing)
    with pytest.warns(UserWarning, match=r"runs a jax.jit that donates.*donate_argnums=\.\.\.\)"):
        qf(p, c + 0.0)
    # a value f computes, donated to an inner jit, is no argument kept (hunt65_review3)
    inner = jax.jit(lambda c: c + 1.0, donate_argnums=0)
    g = lambda p, c: inner(c * 2.0) @ p["w"]  # noqa: E731
    qg = jqt.calibrate(g, jqt.recipes.w8(), p, [(c,)], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jqt.quantize(g, qg)(p, c)


def test_custom_jvp_layer_runs_its_quantized_forward_once_under_grad():
    """Regression: the simulated path's rule for a ``custom_jvp`` layer also took the
    derivative w.r.t. the quantization state when that was a constant, running the layer's
    quantized forward a second time: a ``jax.debug.print`` in it printed twice a step.
    Differentiated w.r.t. the qparams, the state's derivative is still taken."""
    calls = []

    @jax.custom_jvp
    def dense_relu(w, h):
        jax.debug.callback(lambda: calls.append("body"))
        return jax.nn.relu(h @ w)

    @dense_relu.defjvp
    def _(primals, tangents):
        (w, h), (dw, dh) = primals, tangents
        y = jax.nn.relu(h @ w)
        return y, (y > 0) * (dh @ w + h @ dw)

    p = {"w1": _normal(93, (8, 16), 0.3), "w2": _normal(94, (16, 4), 0.3)}
    x = _normal(95, (6, 8))
    f = lambda p, x: dense_relu(p["w1"], x) @ p["w2"]
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    sim = jqt.quantize(f, qp, simulate=True)
    calls.clear()
    g = jax.jit(jax.grad(lambda p: jnp.sum(sim(p, x) ** 2)))(p)
    jax.effects_barrier()
    assert calls == ["body"]
    # the rule is the plain layer's derivative (on float values): about the gradient of
    # the plain layer's simulated path
    plain = jqt.quantize(lambda p, x: jax.nn.relu(x @ p["w1"]) @ p["w2"], qp, simulate=True)
    g_plain = jax.grad(lambda p: jnp.sum(plain(p, x) ** 2))(p)
    assert _rel(g["w1"], g_plain["w1"]) < 0.05 and _rel(g["w2"], g_plain["w2"]) < 0.05
    gq = jax.jit(jax.grad(lambda q: jnp.sum(jqt.quantize(f, q, simulate=True)(p, x) ** 2)))(qp)
    assert float(jnp.abs(gq["w1"].rhs.scale).max()) > 0


def test_a_custom_jvp_with_an_integer_output_differentiates_the_qparams():
    """A custom_jvp layer that also returns an index (its rule's tangent float0), with the
    qparams trained: the rule added the two float0 tangents and NumPy refused
    (hunt75_customgrad)."""
    @jax.custom_jvp
    def route(x, w):
        h = x @ w
        return h, jnp.argmax(h, -1)

    @route.defjvp
    def _(primals, tangents):
        (x, w), (tx, tw) = primals, tangents
        h, i = route(x, w)
        return (h, i), (tx @ w + x @ tw, np.zeros(i.shape, jax.dtypes.float0))

    p = {"w": _normal(96, (8, 8), 0.3), "w2": _normal(97, (8, 4), 0.3)}
    x = _normal(98, (6, 8))

    def f(p, x):
        h, i = route(x, p["w"])
        return jnp.tanh(h) @ p["w2"] + 0.01 * i[:, None]

    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    loss = lambda p, q: jnp.sum(jqt.quantize(f, q, simulate=True)(p, x) ** 2)  # noqa: E731
    gp, gq = jax.grad(loss, argnums=(0, 1))(p, qp)
    assert float(jnp.abs(gq["w"].rhs.scale).max()) > 0
    assert _rel(gp["w"], jax.grad(loss)(p, qp)["w"]) < 1e-6


def test_custom_rules_closing_over_values():
    # A custom_vjp whose body holds a quantized op and closes over a constant array: its
    # closed-over values (num_consts) were differentiated, and JAX raised "differentiation of
    # a custom_vjp function with respect to a closed-over value" (plain jax.grad works).
    wc = _normal(93, (8, 8), 0.3)

    @jax.custom_vjp
    def lin(h):
        return h @ wc
    lin.defvjp(lambda h: (lin(h), None), lambda _, ct: (ct @ wc.T,))
    p = {"a": _normal(94, (8, 8), 0.3)}
    x = _normal(95, (6, 8))
    f = lambda p, x: jnp.tanh(lin(x @ p["a"]))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    assert len(qp) == 2 and not any(q.is_float for q in qp.values())  # wc keyed by position
    sim = jqt.quantize(f, qp, simulate=True)
    g_sim = jax.grad(lambda x: jnp.sum(sim(p, x)))(x)
    assert _rel(g_sim, jax.grad(lambda x: jnp.sum(f(p, x)))(x)) < 0.05
    # A rule that captured a value of f's trace (nondiff_argnums from the params) cannot run
    # again outside that trace: a jqt error naming the function and the fix, not JAX's
    # UnexpectedTracerError from inside the rule.
    from functools import partial

    @partial(jax.custom_jvp, nondiff_argnums=(0,))
    def softclip(t, y):
        return t * jnp.tanh(y / t)

    @softclip.defjvp
    def _(t, primals, tangents):
        (y,), (dy,) = primals, tangents
        return softclip(t, y), dy * (1.0 - jnp.tanh(y / t) ** 2)
    p = {"a": _normal(94, (8, 8), 0.3), "t": jnp.float32(2.0)}
    g = lambda p, x: softclip(p["t"], x @ p["a"])
    qp = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    sim = jqt.quantize(g, qp, simulate=True)
    assert jnp.all(jnp.isfinite(sim(p, x)))  # the forward pass runs
    with pytest.raises(TypeError, match=r"derivative rule of a custom_jvp function 'softclip' \(defined at "
                       r".*test_composition.py:\d+\), at '<top>' "
                       r"\(its body: div, mul, tanh\).*nondiff_argnums.*regular argument"):
        jax.grad(lambda x: jnp.sum(sim(p, x)))(x)


def test_the_simulated_path_on_packed_params_refuses_a_custom_rules_gradient():
    """Given packed params, the simulated path ran a custom_vjp/custom_jvp rule on the zeros
    standing for the weights jqt.pack dropped: gradients 0 (or 10x too small for QLoRA's
    adapters) without a word (hunt65_customprims). It is refused, naming the function; the
    forward runs, and the float params still differentiate it."""
    @jax.custom_vjp
    def layer(w, x):
        return jax.nn.relu(x @ w)
    layer.defvjp(lambda w, x: (layer(w, x), (w, x)),
                 lambda r, g: ((r[1].T @ (g * (r[1] @ r[0] > 0))), (g * (r[1] @ r[0] > 0)) @ r[0].T))
    p = {"w1": _normal(101, (8, 16), 0.3), "w2": _normal(102, (16, 4), 0.3)}
    x = _normal(103, (6, 8))
    f = lambda p, x: layer(p["w1"], x) @ p["w2"]  # noqa: E731
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    sim, packed = jqt.quantize(f, qp, simulate=True), jqt.pack(qp, p)
    np.testing.assert_allclose(sim(packed, x), sim(p, x), rtol=1e-5, atol=1e-5)
    gx = jax.grad(lambda x: jnp.sum(sim(p, x) ** 2))(x)
    assert float(jnp.linalg.norm(gx)) > 0
    with pytest.raises(TypeError, match=r"simulated path .* given packed params.*'layer'.*float params"):
        jax.grad(lambda x: jnp.sum(sim(packed, x) ** 2))(x)

    # a weight also read as a float value outside the rule: jqt.pack keeps its float leaf,
    # the rule gets the real weight, and the gradient is the float params' (it was refused,
    # hunt66_newcode)
    g = lambda p, x: layer(p["w1"], x) @ p["w2"] + jnp.tanh(p["w1"]).sum(0)[:4]  # noqa: E731
    qg = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    sim, packed = jqt.quantize(g, qg, simulate=True), jqt.pack(qg, p)
    assert 0 in packed.kept
    want = jax.grad(lambda x: jnp.sum(sim(p, x) ** 2))(x)
    got = jax.grad(lambda x: jnp.sum(sim(packed, x) ** 2))(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_custom_vjp_around_a_while_loop():
    """A custom_vjp whose forward runs a lax.while_loop (Equinox's checkpointed while_loop,
    diffrax's adjoint): its bwd rule is what makes it differentiable. The simulated path
    differentiated the quantized body with respect to the qparams on every jax.grad, so
    the gradient of the inputs or the weights alone raised JAX's "Reverse-mode
    differentiation does not work for lax.while_loop"; now only the qparams' own gradient
    needs the body's reverse pass, and its error names the function and the fix."""
    @jax.custom_vjp
    def loop(w, h):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, h))[1]

    def unrolled(w, h):
        for _ in range(3):
            h = jnp.tanh(h @ w)
        return h
    loop.defvjp(lambda w, h: (loop(w, h), (w, h)), lambda r, ct: jax.vjp(unrolled, *r)[1](ct))
    p = {"a": _normal(96, (8, 8), 0.3), "w": _normal(97, (8, 8), 0.3)}
    x = _normal(98, (6, 8))
    f = lambda p, x: loop(p["w"], x @ p["a"])
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    assert not qp["w"].is_float  # the matmul inside the loop is quantized
    sim = jqt.quantize(f, qp, simulate=True)
    loss = lambda p, x, q=qp: jnp.sum(jqt.quantize(f, q, simulate=True)(p, x) ** 2)
    f_loss = lambda p, x: jnp.sum(f(p, x) ** 2)
    assert _rel(jax.jit(jax.grad(loss, 1))(p, x), jax.grad(f_loss, 1)(p, x)) < 0.05
    gw, gw_float = jax.grad(loss)(p, x), jax.grad(f_loss)(p, x)
    assert _rel(gw["w"], gw_float["w"]) < 0.05 and _rel(gw["a"], gw_float["a"]) < 0.05
    trainable, frozen = jqt.qat.split(p, qp, train="weights")
    g = jax.grad(lambda t: loss(*jqt.qat.merge(t, frozen)[:1], x, jqt.qat.merge(t, frozen)[1]))(trainable)
    assert _rel(g[0]["w"], gw["w"]) < 1e-5
    with pytest.raises(TypeError, match=r"qparams of the quantized ops inside the custom_vjp "
                                        r"function 'loop' \(defined at .*\), at '<top>' cannot be "
                                        r"differentiated.*while_loop"
                                        r".*train='weights'"):
        jax.grad(lambda q: loss(p, x, q))(qp)
    assert sim(p, x).shape == (6, 8)


def test_gradient_of_the_qparams_through_a_custom_rule_around_a_host_callback():
    """A custom_jvp / custom_vjp layer whose body runs a jax.pure_callback (a NumPy op): the
    scales' gradient differentiates the body, which JAX cannot, and raised its "Pure
    callbacks do not support JVP" (use jax.custom_jvp: the user had). It names the function
    and the fix now; the weights' gradient works (hunt71_callbacks)."""
    calls = []

    def tanh_host(a):
        calls.append(1)
        return np.tanh(a).astype(a.dtype)

    def body(w, x):
        y = x @ w
        return jax.pure_callback(tanh_host, jax.ShapeDtypeStruct(y.shape, y.dtype), y,
                                 vmap_method="sequential")

    jvp_layer = jax.custom_jvp(body)

    @jvp_layer.defjvp
    def _(pr, tg):
        y = jvp_layer(*pr)
        return y, (1 - y ** 2) * (tg[1] @ pr[0] + pr[1] @ tg[0])
    vjp_layer = jax.custom_vjp(body)
    vjp_layer.defvjp(lambda w, x: (vjp_layer(w, x), (w, x)),
                     lambda r, ct: (r[1].T @ (ct * (1 - vjp_layer(*r) ** 2)),
                                    (ct * (1 - vjp_layer(*r) ** 2)) @ r[0].T))
    p = {"w1": _normal(90, (8, 16), 0.3), "w2": _normal(91, (16, 4), 0.3)}
    x = _normal(92, (4, 8))
    for kind, layer in (("custom_jvp", jvp_layer), ("custom_vjp", vjp_layer)):
        f = lambda p, x: layer(p["w1"], x) @ p["w2"]  # noqa: E731
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
        loss = lambda p, q: jnp.sum(jqt.quantize(f, q, simulate=True)(p, x))  # noqa: E731
        assert _rel(jax.grad(loss)(p, qp)["w1"], jax.grad(lambda p: jnp.sum(f(p, x)))(p)["w1"]) < 0.05
        with pytest.raises(TypeError, match=rf"qparams of the quantized ops inside the {kind} "
                           r"function 'body' \(defined at .*\), at '<top>' cannot be "
                           r"differentiated: its body runs a host callback.*train='weights'"):
            jax.grad(loss, 1)(p, qp)


def test_a_checkify_check_in_f_is_named_with_the_fix_that_works():
    """f with an unwrapped checkify.check runs eagerly in JAX; jqt compiles f, and JAX's
    "not functionalized" error (one shared instance) gathered a jqt note per failed
    calibration, which later errors of plain JAX showed (hunt71_callbacks). The advice
    given works: calibrate cf = checkify.checkify(f) and run the quantized cf, also with
    the params a bare array (named by the argument: checkify's *args)."""
    from jax.experimental import checkify

    def f(p, x):
        checkify.check(jnp.all(x > -100.0), "input out of range")
        return jnp.tanh(x @ p["w"])
    p, x = {"w": _normal(93, (8, 4), 0.3)}, _normal(94, (4, 8))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"jqt.calibrate: f runs a checkify.check.*calibrate "
                           r"cf = checkify.checkify\(f\) and call jqt.quantize\(cf, qparams\)") as e:
            jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
        assert not getattr(e.value.__cause__, "__notes__", None)
    g = lambda w, x: f({"w": w}, x)  # noqa: E731  (a bare array: keyed by the argument's name)
    for fn, params in ((f, p), (g, p["w"])):
        cf = checkify.checkify(fn)
        qp = jqt.calibrate(cf, jqt.recipes.w8a8(), params, [(x,)], progress=False)
        err, y = jqt.quantize(cf, qp)(jqt.pack(qp, params), x)
        assert err.get() is None and y.shape == (4, 4)
        err, _ = jqt.quantize(cf, qp)(jqt.pack(qp, params), x - 1000.0)
        assert "input out of range" in err.get()


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_custom_vjp_rule_indexing_an_array_written_in_f():
    """jax.experimental.ode.odeint with its time grid written in f: the grid is a NumPy
    constant of f's jaxpr, and odeint's backward pass indexes it with a traced step
    (ts[i]). jqt inlines the jit that gave the rule a JAX array, so the simulated path's
    gradient raised JAX's TracerArrayConversionError from inside odeint (hunt41_flows);
    now it is the gradient of the same function with the grid passed in."""
    from jax.experimental.ode import odeint
    vf = lambda y, t, p: jnp.tanh(y @ p["w1"]) @ p["w2"]
    p = {"w1": _normal(99, (2, 16), 0.5), "w2": _normal(100, (16, 2), 0.25)}
    y0 = _normal(101, (8, 2))
    ts = jnp.array([0.0, 0.5])
    f = lambda p, y0: odeint(vf, y0, jnp.array([0.0, 0.5]), p)[-1]
    f_ts = lambda p, y0, ts: odeint(vf, y0, ts, p)[-1]
    qp = jqt.calibrate(f, jqt.recipes.w8(), p, [(y0,)], progress=False)
    assert not qp["w1"].is_float
    sim = jqt.quantize(f, qp, simulate=True)
    sim_ts = jqt.quantize(f_ts, jqt.calibrate(f_ts, jqt.recipes.w8(), p, [(y0, ts)], progress=False),
                          simulate=True)
    g = jax.grad(lambda p: jnp.sum(sim(p, y0) ** 2))(p)
    g_ts = jax.grad(lambda p: jnp.sum(sim_ts(p, y0, ts) ** 2))(p)
    g_float = jax.grad(lambda p: jnp.sum(f(p, y0) ** 2))(p)
    for k in p:
        assert _rel(g[k], g_ts[k]) < 1e-5 and _rel(g[k], g_float[k]) < 0.05
    gy = jax.grad(lambda y: jnp.sum(sim(p, y)))(y0)
    assert _rel(gy, jax.grad(lambda y: jnp.sum(f(p, y)))(y0)) < 0.05


# --------------------------------------------------------------------------- jaxprs


def test_integer_jaxpr(mlp_setup):
    p, batches, qp = mlp_setup
    x = batches[0][0]
    qf = jqt.quantize(mlp, qp)
    jaxpr = jax.make_jaxpr(jax.jit(qf))(p, x)
    prims = _prims(jaxpr)
    assert "jqt_quantize" in prims
    assert "jqt_fake_quant" not in prims
    assert len(_int8_dots(jaxpr)) == 3
    quantize_eqns = [e for e in _all_eqns(jaxpr) if e.primitive is jqt.quantize_p]
    assert quantize_eqns and all(e.outvars[0].aval.dtype == jnp.int8 for e in quantize_eqns)
    # no float dot_general is left
    assert not [e for e in _all_eqns(jaxpr) if e.primitive.name == "dot_general"
                and e.invars[0].aval.dtype != jnp.int8]
    # packed: the weights are not quantized at run time
    packed_jaxpr = jax.make_jaxpr(jax.jit(qf))(jqt.pack(qp, p), x)
    assert len(_int8_dots(packed_jaxpr)) == 3
    n_q = sum(1 for e in _all_eqns(packed_jaxpr) if e.primitive is jqt.quantize_p)
    assert n_q == 3  # activations only


def test_simulated_jaxpr(mlp_setup):
    p, batches, qp = mlp_setup
    x = batches[0][0]
    jaxpr = jax.make_jaxpr(jax.jit(jqt.quantize(mlp, qp, simulate=True)))(p, x)
    prims = _prims(jaxpr)
    assert "jqt_fake_quant" in prims
    assert "jqt_quantize" not in prims
    assert not _int8_dots(jaxpr)
    fq = [e for e in _all_eqns(jaxpr) if e.primitive is jqt.fake_quant_p]
    assert len(fq) == 6  # both operands of each of the 3 matmuls
    assert all(e.outvars[0].aval.dtype == jnp.float32 for e in fq)


def test_a_weight_under_stop_gradient_is_the_leaf_it_reads():
    """``x @ lax.stop_gradient(p["w"])`` (a frozen base weight, as LoRA code writes it) reads
    leaf ``w``: its op is keyed and packed by it, where it was a computed weight, quantized
    at every call. No gradient reaches ``w`` through the simulated path."""
    p = {"w": jax.random.normal(jax.random.key(0), (32, 16)) / 6}
    x = jax.random.normal(jax.random.key(1), (8, 32))
    f = lambda p, x: x @ lax.stop_gradient(p["w"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # jqt.pack warned of a weight it could not pack
        qp = jqt.calibrate(f, jqt.recipes.w4(group_size=16), p, [(x,)], progress=False)
        packed = jqt.pack(qp, p)
    assert list(qp) == ["w"] and packed.weights["w"].values.dtype == jnp.uint8
    np.testing.assert_allclose(jqt.quantize(f, qp)(packed, x), jqt.quantize(f, qp, simulate=True)(p, x),
                               rtol=1e-5, atol=1e-6)
    g = jax.grad(lambda p: jqt.quantize(f, qp, simulate=True)(p, x).sum())(p)
    assert not np.asarray(g["w"]).any()


def _named(w):
    return checkpoint_name(w, "w")


def _constrained(w):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    return lax.with_sharding_constraint(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "d")))


@pytest.mark.parametrize("how", ["checkpoint_name", "sharding_constraint", "barrier", "barrier_with_x",
                                 "reduce_precision"])
@pytest.mark.slow_variants
def test_a_weight_through_a_value_identity_is_the_leaf_it_reads(how):
    """checkpoint_name (for a remat policy), with_sharding_constraint (FSDP code) and
    optimization_barrier pass the weight's values on: its op is keyed and packed by the
    leaf. They made it a computed weight (key 'dot_general_0', re-quantized at every call,
    with a warning naming causes that did not apply), and a barrier over (w, x) together an
    activation, left float without a word. ``lax.reduce_precision`` (a bfloat16 weight
    emulated in float32) is a step of the chain as a cast is: its op was keyed
    'dot_general_0' and quantized at run time."""
    p = {"w": jax.random.normal(jax.random.key(0), (32, 16)) / 6}
    x = jax.random.normal(jax.random.key(1), (8, 32))
    f = {"checkpoint_name": lambda p, x: jax.checkpoint(
             lambda w, x: x @ _named(w), policy=jax.checkpoint_policies.save_only_these_names("w"))(p["w"], x),
         "sharding_constraint": lambda p, x: x @ _constrained(p["w"]),
         "barrier": lambda p, x: x @ lax.optimization_barrier(p["w"]),
         "barrier_with_x": lambda p, x: (lambda w, x: x @ w)(*lax.optimization_barrier((p["w"], x))),
         "reduce_precision": lambda p, x: x @ lax.reduce_precision(p["w"], 8, 7)}[how]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # jqt.pack warned of a weight it could not pack
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
        packed = jqt.pack(qp, p)
    assert list(qp) == ["w"] and not qp["w"].is_float and packed.weights["w"].values.dtype == jnp.int8
    np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp))(packed, x), jqt.quantize(f, qp, simulate=True)(p, x),
                               rtol=1e-5, atol=1e-6)


def test_vmap_of_a_per_example_cond_says_why_its_convolutions_stay_float():
    """The same for a detector's head picked per image: jax.vmap's conv rule folds the
    batched kernel into its output features with a transposing reshape, which dropped the
    mark, so both convs stayed float without a warning, their note blaming a kernel
    computed from the data (hunt44_detect). The warning does not offer act_x_act=, which
    convolutions do not take."""
    k = jax.random.split(jax.random.key(10), 3)
    p = {"ha": jax.random.normal(k[0], (3, 3, 4, 6)) * 0.3, "hb": jax.random.normal(k[1], (1, 1, 4, 6)) * 0.3}
    xs = jax.random.uniform(k[2], (4, 8, 8, 4))
    conv = lambda x, w: lax.conv_general_dilated(x[None], w, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))[0]
    head = lambda p, x: lax.cond(x.mean() > 0.5, lambda x: conv(x, p["ha"]), lambda x: conv(x, p["hb"]), x)
    f = lambda p, xs: jax.vmap(lambda x: head(p, x))(xs)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(xs,)], progress=False)
    msgs = [str(w.message) for w in got]
    assert len(msgs) == 1 and "conv_general_dilated" in msgs[0] and "jax.vmap of a lax.cond" in msgs[0] \
        and "'ha'" in msgs[0] and "'hb'" in msgs[0] and "act_x_act" not in msgs[0], msgs
    assert all(v.is_float for v in qp.values())
    # a dot picked so beside them: a warning of its own (they were grouped under the
    # first op's wording, hunt44_review)
    p2 = {**p, "da": jax.random.normal(k[0], (4, 6))}
    dot = lambda p, x: lax.cond(x.mean() > 0.5, lambda x: x @ p["da"], lambda x: x @ (2 * p["da"]), x)
    g = lambda p, xs: (f(p, xs), jax.vmap(lambda x: dot(p, x))(xs))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        jqt.calibrate(g, jqt.recipes.w8a8(), p2, [(xs,)], progress=False)
    msgs = sorted(str(w.message) for w in got)
    assert len(msgs) == 2 and "a conv_general_dilated" in msgs[0] and "act_x_act" not in msgs[0] \
        and "a dot_general" in msgs[1] and "'da'" in msgs[1] and "act_x_act" in msgs[1], msgs


def test_vmap_of_a_per_example_cond_says_why_its_dots_stay_float():
    """``jax.vmap`` of a ``lax.cond`` whose predicate is per example runs both branches and
    selects, with the weights broadcast over the batch and selected from themselves. The
    branch dots were silently float (activation x activation); calibration now says why,
    naming the weight and the rewrite that quantizes (``jnp.where``)."""
    p = {"a": jax.random.normal(jax.random.key(0), (32, 32)) / 6,
         "b": jax.random.normal(jax.random.key(1), (32, 32)) / 6}
    x = jax.random.normal(jax.random.key(2), (16, 32))
    cond = lambda p, r: lax.cond(r.sum() > 0, lambda h: h @ p["a"], lambda h: jnp.tanh(h @ p["b"]), r)
    where = lambda p, r: jnp.where(r.sum() > 0, r @ p["a"], jnp.tanh(r @ p["b"]))
    f, g = (lambda p, x, e=e: jax.vmap(e, in_axes=(None, 0))(p, x) for e in (cond, where))
    with pytest.warns(UserWarning, match=r"reads weight '[ab]' through a select.*jax.vmap of a lax.cond"):
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    assert all(v.is_float for v in qp.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    assert sorted(qp) == ["a", "b"] and not any(v.is_float for v in qp.values())
    np.testing.assert_allclose(jqt.quantize(g, qp)(jqt.pack(qp, p), x), f(p, x), rtol=0.05, atol=0.05)
    # 'a' read by the float select and by a quantized matmul: jqt.pack keeps its float leaf
    h = lambda p, x: f(p, x) + x @ p["a"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "jqt: a dot_general .* through a select")
        qp = jqt.calibrate(h, jqt.recipes.w8a8(), p, [(x,)], progress=False)
        np.testing.assert_allclose(jqt.quantize(h, qp)(jqt.pack(qp, p), x),
                                   jqt.quantize(h, qp, simulate=True)(p, x), rtol=1e-4, atol=1e-4)


def test_a_weight_picked_by_the_data_says_why_its_op_stays_float():
    """``x @ lax.cond(m, lambda: a, lambda: b)`` (or ``lax.switch``, ``jnp.where(m, a, b)``):
    the op reads no one weight, so it is an activation x activation op and stays float, as
    both weights do; calibration said nothing. It now names both weights and the rewrite."""
    p = {"a": jax.random.normal(jax.random.key(0), (8, 8)) / 3,
         "b": jax.random.normal(jax.random.key(1), (8, 8)) / 3}
    x = jax.random.normal(jax.random.key(2), (4, 8))
    picks = {"cond": lambda p, m: lax.cond(m, lambda: p["a"], lambda: p["b"]),
             "switch": lambda p, m: lax.switch(m.astype(jnp.int32), [lambda: p["a"], lambda: p["b"]]),
             "where": lambda p, m: jnp.where(m, p["a"], p["b"]).T.T}
    for name, pick in picks.items():
        f = lambda p, x, m, pick=pick: x @ pick(p, m)
        with pytest.warns(UserWarning, match=r"reads weights '[ab]', '[ab]' through a lax.cond, "
                          r"lax.switch or jnp.where on the data that picks between weights.*stays "
                          r"float.*as the weights do.*jnp.where\(pred, x @ a"):
            qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x, jnp.bool_(True)), (x, jnp.bool_(False))],
                               progress=False)
        assert all(v.is_float for v in qp.values()), name
    # a weight masked by the data: the same; data in a case (a mask token) is data, no warning
    with pytest.warns(UserWarning, match=r"reads weight 'a' through .* \(or masks one\)"):
        jqt.calibrate(lambda p, x: x @ jnp.where(x.sum() > 0, p["a"], 0.0), jqt.recipes.w8a8(),
                      p, [(x,)], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jqt.calibrate(lambda p, x: jnp.where(x > 0, p["a"][:4], x) @ p["b"], jqt.recipes.w8a8(),
                      p, [(x,)], progress=False)
    # the rewrite it names quantizes both
    g = lambda p, x, m: jnp.where(m, x @ p["a"], x @ p["b"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(x, jnp.bool_(True))], progress=False)
    assert sorted(qp) == ["a", "b"] and not any(v.is_float for v in qp.values())


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_weight_mixed_with_the_data_says_why_its_op_stays_float():
    """NoisyNet's ``x @ (mu + sigma * noise)``, DropConnect's ``x @ (w * mask)``, a
    temperature ``x @ (w / t)``: the op reads no weight, so it stays float as an activation
    x activation op; calibration said nothing, and a whole NoisyNet ran float (hunt40_rl).
    So is a weight edited with the data (rows set or appended: added tokens). A bias or a
    gain broadcast over the data is not such a weight: no warning there."""
    p = {"mu": jax.random.normal(jax.random.key(0), (8, 4)) / 3, "sigma": jnp.full((8, 4), 0.05),
         "b": jnp.zeros(4), "g": jnp.ones(8)}
    x = jax.random.normal(jax.random.key(1), (16, 8))
    noise = jax.random.normal(jax.random.key(2), (8, 4))
    mixes = {"noisy": (lambda p, x, e: x @ (p["mu"] + p["sigma"] * e), noise, r"weights 'mu', 'sigma'"),
             "mask": (lambda p, x, m: x @ (p["mu"] * m).reshape(8, 4), noise > 0, r"weight 'mu'"),
             "temperature": (lambda p, x, t: x @ (p["mu"] / t), jnp.float32(2.0), r"weight 'mu'")}
    for name, (f, d, what) in mixes.items():
        with pytest.warns(UserWarning, match=rf"reads {what} combined elementwise with the data "
                                             r"\(NoisyNet's .*stays float.*x @ mu \+ x @ \(sigma \* noise\)"):
            qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x, d)], progress=False)
        assert all(v.is_float for v in qp.values()), name
    # edited with the data (added tokens' rows set, segment_sum by data ids): the same, the
    # table's lookup too (silent before: hunt47_sparse)
    new = jax.random.normal(jax.random.key(4), (2, 4))
    ids = jnp.array([0, 7, 8, 9])
    edits = {"at_set": lambda w, v: w.at[jnp.array([6, 7])].set(v),
             "at_add": lambda w, v: w.at[jnp.array([6, 7])].add(v),
             "dus": lambda w, v: jax.lax.dynamic_update_slice(w, v, (6, 0)),
             "segment_sum": lambda w, v: jax.ops.segment_sum(w, jnp.int32(v[:, 0] > 0).repeat(4), 2)}
    for name, edit in edits.items():
        t = lambda p, x, v, i: jnp.tanh(edit(p["mu"], v)[i % 2]) @ edit(p["mu"], v).T
        with pytest.warns(UserWarning, match=r"reads weight 'mu' combined elementwise with the data "
                          r".* or edited with it .*params\['emb'\].at\[i\].set\(v\) outside f") as got:
            qp = jqt.calibrate(t, jqt.recipes.w8a8(), p, [(x, new, ids)], progress=False)
        assert all(v.is_float for v in qp.values()), name
        assert name == "segment_sum" or any("a gather" in str(w.message) and "looks rows up in weight "
                                            "'mu'" in str(w.message) for w in got), name
    # a class token broadcast over the batch and prepended, or registers prepended to one
    # example's tokens (a sequence: its products are activation x activation ops), is no
    # such weight (the review of hunt47 found the registers named)
    cls = lambda p, x: jnp.concatenate([jnp.broadcast_to(p["g"][:4], (16, 1, 4)), (x @ p["mu"])[:, None]],
                                       axis=1).sum(1) @ p["mu"].T
    reg = lambda p, x: (lambda t: (t @ t.T)[jnp.argmax(x[:, 0])])(jnp.concatenate([p["sigma"][:2], x @ p["mu"]]))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*combined elementwise")
        assert not jqt.calibrate(cls, jqt.recipes.w8a8(), p, [(x,)], progress=False)["mu"].is_float
        assert not jqt.calibrate(reg, jqt.recipes.w8a8(), p, [(x,)], progress=False)["mu"].is_float
    # the rewrite it names quantizes x @ mu (x @ (sigma * noise) stays float, said)
    g = lambda p, x, e: x @ p["mu"] + x @ (p["sigma"] * e)
    with pytest.warns(UserWarning, match=r"reads weight 'sigma' combined elementwise"):
        qp = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(x, noise)], progress=False)
    assert not qp["mu"].is_float
    # a bias and a gain mixed with the data: no warning; nor a 2-D bias reshaped to size-1
    # axes and added over them (Flax's DenseGeneral in its attention: review hunt40_review)
    h = lambda p, x: ((x * p["g"]) @ p["mu"] + p["b"]) @ ((x * p["g"]) @ p["mu"] + p["b"]).T
    q = {"w": jax.random.normal(jax.random.key(3), (8, 2, 4)), "b": jnp.ones((2, 4))}
    qk = lambda p, x: jnp.einsum("bqhd,bkhd->bhqk", *2 * [jnp.einsum("btc,chd->bthd", x, p["w"])
                                                           + p["b"].reshape(1, 1, 2, 4)])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*combined elementwise")
        jqt.calibrate(h, jqt.recipes.w8a8(), p, [(x,)], progress=False)
        jqt.calibrate(qk, jqt.recipes.w8a8(), q, [(x.reshape(2, 8, 8),)], progress=False)
        # one token of one sequence (a decode step): the bias's shape is the output's
        jqt.calibrate(qk, jqt.recipes.w8a8(), q, [(x[:1].reshape(1, 1, 8),)], progress=False)


def test_a_product_of_two_computed_weights_says_so():
    """The product of two weights warned only where the side jqt takes as the activation was
    a leaf: Glow's ``P @ tril(l) @ triu(u)``, or ``(2 * z) @ z.T`` of a GP head's inducing
    points, gave one weight a static activation range with no word (hunt37_flows, _linalg)."""
    p = {"l": jax.random.normal(jax.random.key(0), (8, 8)) * 0.3,
         "u": jax.random.normal(jax.random.key(1), (8, 8)) * 0.3}
    xs = jax.random.normal(jax.random.key(2), (4, 8))
    f = lambda p, x: x @ (jnp.tril(p["l"]) @ jnp.triu(p["u"]))
    with pytest.warns(UserWarning, match=r"multiplies two weights, a computed weight and a computed "
                                         r"weight: .*Glow's P @ L @ U.*pass it in params"):
        jqt.calibrate(f, jqt.recipes.w8a8(), p, [(xs,)], progress=False)
    # computed before a loop whose body multiplies it by a weight (review 2)
    def looped(p, x):
        t = jnp.tril(p["l"])
        return jax.lax.fori_loop(0, 2, lambda i, h: h @ (t @ p["u"]), x)
    with pytest.warns(UserWarning, match=r"multiplies two weights, 'u' and a computed weight"):
        jqt.calibrate(looped, jqt.recipes.w8(), p, [(xs,)], progress=False)
    # a zero state, a matrix built from iota, a constant f closes over: no word (review)
    c = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
    quiet = lambda p, x: (jnp.zeros((4, 8)) @ p["l"] + x @ (c @ p["u"])  # noqa: E731
                          + x @ (jnp.cos(jnp.outer(jnp.arange(8.0), jnp.arange(8.0))) @ p["l"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jqt.calibrate(quiet, jqt.recipes.w8(), p, [(xs,)], progress=False)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_an_einsum_that_contracts_two_weights_first_says_so():
    """``jnp.einsum('bi,ij,jk->bk', x, a, b)`` contracts ``a`` and ``b`` first at large
    batches (its optimize= order follows the shapes): one weight was quantized as the other's
    activation with no word, and another batch was refused as 'another function'."""
    p = {"a": jax.random.normal(jax.random.key(0), (8, 16)) * 0.3,
         "b": jax.random.normal(jax.random.key(1), (16, 8)) * 0.3}
    xs = jax.random.normal(jax.random.key(2), (64, 8))
    f = lambda p, x: jnp.einsum("bi,ij,jk->bk", x, p["a"], p["b"])
    with pytest.warns(UserWarning, match=r"multiplies two weights, '[ab]' and '[ab]'.*optimize=False"):
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(xs,)], progress=False)
    with pytest.raises(jqt.QParamsMismatchError, match=r"An einsum of three or more operands "
                       r"\('bi,ij,jk->bk'\).*optimize=False"):
        jqt.quantize(f, qp)(p, xs[:2])
    def scoped(p, x):  # inside a module's scope (flax's 'E/...'): the hint still names it
        with jax.named_scope("E"):
            return f(p, x)
    with pytest.warns(UserWarning, match=r"multiplies two weights"):
        qs = jqt.calibrate(scoped, jqt.recipes.w8a8(), p, [(xs,)], progress=False)
    with pytest.raises(jqt.QParamsMismatchError, match=r"An einsum of three or more operands"):
        jqt.quantize(scoped, qs)(p, xs[:2])
    g = lambda p, x: jnp.einsum("bi,ij,jk->bk", x, p["a"], p["b"], optimize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(g, jqt.recipes.w8a8(), p, [(xs,)], progress=False)
    assert sorted(qp) == ["a", "b"]
    assert jqt.quantize(g, qp)(jqt.pack(qp, p), xs[:2]).shape == (2, 8)
    # one weight among three operands (AlphaFold's fused outer-product mean): at another
    # length the weight is on the other side of its matmul; quantize and calibrate say why
    h = lambda p, m: jnp.einsum("sic,sjd,cde->ije", m, m, p["o"])
    po = {"o": jax.random.normal(jax.random.key(3), (4, 4, 16))}
    m8, m64 = (jax.random.normal(jax.random.key(4), (4, n, 4)) for n in (8, 64))
    qo = jqt.calibrate(h, jqt.recipes.w8a8(), po, [(m8,)], progress=False)
    hint = r"weight operand .*An einsum of three or more operands \('sic,sjd,cde->ije'\).*optimize=False"
    with pytest.raises(jqt.QParamsMismatchError, match=hint):
        jqt.quantize(h, qo)(po, m64)
    with pytest.raises(jqt.CalibrationDataError, match=r"runs other ops .*\('sic,sjd,cde->ije'\).*optimize=False"):
        jqt.calibrate(h, jqt.recipes.w8a8(), po, [(m8,), (m64,)], progress=False)


@pytest.mark.parametrize("recipe", ["w8a8", "w8", "w4"])
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_inputs_split_in_their_type_few_rows_plain_and_vmapped(recipe):
    """Inputs whose type names a mesh axis (``jax.make_mesh``'s default, explicit axes;
    here one device), few rows, after the same function ran on an unsplit input: the
    trace cache keys on the sharding in the type (it reused the unsplit jaxpr and failed),
    a plain op's split rows take the formulations that keep rows as they are (the few-row
    ones reshape them), and vmapped the native kernel's output type keeps its input's
    split (a ``lax.scan`` batching rule refused a carry typed on no mesh). Multi-device:
    tests/test_sharding.py (slow)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("data",))
    f = lambda p, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), jax.nn.relu(x @ p["w1"]), p["ws"])[0]
    p = {"w1": _normal(0, (64, 32), 0.2), "ws": _normal(1, (3, 32, 32), 0.2)}
    x = _normal(2, (8, 64))
    rec = {"w8a8": jqt.recipes.w8a8(), "w8": jqt.recipes.w8(), "w4": jqt.recipes.w4(group_size=32)}[recipe]
    qp = jqt.calibrate(f, rec, p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    for run, xs in ((jax.jit(jqt.quantize(f, qp)), x[:2]),
                    (jax.jit(jax.vmap(jqt.quantize(f, qp), in_axes=(None, 0))), x.reshape(2, 4, 64))):
        want = run(packed, xs)
        got = run(packed, jax.device_put(xs, NamedSharding(mesh, P("data"))))
        assert jax.typeof(got).sharding.spec[0] == "data"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)  # float sums in another order


@pytest.mark.slow  # 3-4 s each: CI's slow run (CI's default run took 323 s on 2026-12-07)
def test_a_row_parallel_weight_only_op_typed_on_a_one_device_mesh():
    """A row-parallel layer (K split over an explicit axis, out_sharding= named) at 1 and
    16 rows, outside jax.set_mesh, on the one-device mesh tensor-parallel code makes on one
    GPU: the weight-only formulations cut K into chunks with a lax.scan, which JAX refuses
    on a split K ("0th dimension of all xs should be replicated"), at 16 rows always and
    at 1 row after a change of this session (review of hunt71); they keep K whole there now.
    Several devices: tests/test_sharding.py (slow)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("model",))
    f = lambda p, x: jnp.matmul(x, p["w"], out_sharding=NamedSharding(mesh, P()))
    p = {"w": jax.device_put(_normal(3, (1024, 1024), 0.05), NamedSharding(mesh, P("model", None)))}
    for rec in (jqt.recipes.w4(), jqt.recipes.w8()):
        for m in (1, 16):
            x = jax.device_put(_normal(4, (m, 1024)), NamedSharding(mesh, P(None, "model")))
            qp = jqt.calibrate(f, rec, p, [(x,)], progress=False)
            got = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x)
            want = jqt.quantize(f, qp, simulate=True)(p, x)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("recipe", ["w8a8", "w8a8_dynamic", "w4", "fp8"])
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_quantized_function_inside_shard_map(recipe):
    """``jax.shard_map`` around a quantized function (per-device code: a replicated weight
    times a split activation, which JAX types through ``pvary``), plain, vmapped, and the
    simulated path's gradient: as the same program on each device's rows. ``pvary`` is a
    layout step from the weight leaf, and jqt's primitives type their outputs as varying
    over the manual axes their operands vary over (a scan's carry typed otherwise was
    refused). Eight devices: tests/test_sharding.py (slow)."""
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))
    f = lambda p, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), jax.nn.relu(x @ p["w1"]), p["ws"])[0]
    p = {"w1": _normal(0, (64, 32), 0.2), "ws": _normal(1, (3, 32, 32), 0.2)}
    x = _normal(2, (8, 64))
    rec = {"w8a8": jqt.recipes.w8a8(), "w8a8_dynamic": jqt.recipes.w8a8_dynamic(),
           "w4": jqt.recipes.w4(group_size=32), "fp8": jqt.recipes.fp8()}[recipe]
    qp = jqt.calibrate(f, rec, p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    smap = lambda g, specs, out=P("d"): jax.jit(jax.shard_map(g, mesh=mesh, in_specs=specs, out_specs=out))
    qf = jqt.quantize(f, qp)
    np.testing.assert_array_equal(smap(qf, (P(), P("d")))(packed, x), jax.jit(qf)(packed, x))
    vq = jax.vmap(qf, in_axes=(None, 0))
    xv = x.reshape(2, 4, 64)
    np.testing.assert_array_equal(smap(vq, (P(), P("d")))(packed, xv), jax.jit(vq)(packed, xv))
    grad = jax.grad(lambda qp, p, x: jnp.sum(jqt.quantize(f, qp, simulate=True)(p, x) ** 2), argnums=(0, 1))
    got, want = smap(grad, (P(), P(), P("d")), P())(qp, p, x), jax.jit(grad)(qp, p, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_packed_shardings_of_a_tensor_parallel_shard_map_with_an_op_without_weight():
    """A tensor-parallel ``jax.shard_map`` on a mesh whose axis is not called "model", with
    an activation x activation op: its weights are split as the shard_map splits them, no
    ``axis=`` needed (the op without a weight made jqt ask for one, naming the wrong cause)."""
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((1,), ("x",), axis_types=(AxisType.Auto,))

    def f(p, x):
        def body(w1, w2, x):
            h = jax.nn.relu(x @ w1)
            h = jnp.einsum("bi,ci->bc", h, h) @ h  # activation x activation
            return lax.psum(h @ w2, "x")
        return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x", None), P()),
                             out_specs=P())(p["w1"], p["w2"], x)
    p = {"w1": _normal(0, (16, 32), 0.2), "w2": _normal(1, (32, 16), 0.2)}
    x = _normal(2, (4, 16))
    qp = jqt.calibrate(f, jqt.recipes.w8a8_dynamic(act_x_act=True), p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    qs, ps = jqt.packed_shardings(qp, packed, mesh)
    # (packed per block of the shard_map's split: a leading axis of blocks, split over "x")
    assert [ps.weights[k].values.spec for k in ("w1", "w2")] == [P("x"), P("x")]
    y = jax.jit(jqt.quantize(f, qp))(*jax.device_put((packed, x), (ps, None)))
    np.testing.assert_allclose(y, jqt.quantize(f, qp, simulate=True)(p, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", ["w8a8", pytest.param("w8a8_dynamic_kv", marks=pytest.mark.slow),
                                    pytest.param("w4_kv", marks=pytest.mark.slow)])
@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_explicit_mesh_lookup_region_and_resharded_weights(recipe):
    """Under ``jax.set_mesh`` of explicit axes (one device here; eight: test_sharding.py,
    slow), a decode loop whose embedding lookup JAX runs in an ``auto_axes`` region (typed
    on another mesh) and whose weights go through ``reshard``: calibration, the integer
    path and the simulated path's gradient give what the same loop gives without a mesh.
    Calibration failed before (statistics made in the region were combined outside it),
    and the integer path refused the table read through ``reshard``."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    rec = {"w8a8": jqt.recipes.w8a8(), "w8a8_dynamic_kv": jqt.recipes.w8a8_dynamic(kv_cache=True),
           "w4_kv": jqt.recipes.w4(group_size=8, kv_cache=True)}[recipe]
    (fe, p, tok), (fp, _, _) = explicit_decoder(True), explicit_decoder(False)
    mesh = jax.make_mesh((1,), ("data",))
    want_qp = jqt.calibrate(fp, rec, p, [(tok,)], progress=False)
    packed = jqt.pack(want_qp, p)
    grad = lambda f: jax.jit(jax.grad(lambda q, p, t: jnp.sum(jqt.quantize(f, q, simulate=True)(p, t) ** 2),
                                      argnums=(0, 1)))
    with jax.set_mesh(mesh):
        ts = jax.device_put(tok, NamedSharding(mesh, P("data")))
        qp = jqt.calibrate(fe, rec, p, [(ts,)], progress=False)
        got = jax.jit(jqt.quantize(fe, want_qp))(packed, ts)
        g = grad(fe)(want_qp, p, ts)
    assert jax.typeof(got).sharding.spec[1] == "data"
    for a, b in zip(jax.tree_util.tree_leaves(qp), jax.tree_util.tree_leaves(want_qp)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    want = jax.jit(jqt.quantize(fp, want_qp))(packed, tok)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(want))))
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(grad(fp)(want_qp, p, tok))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))


@pytest.mark.slow
def test_explicit_mesh_awq_gptq_and_report_over_split_rows():
    """Under ``jax.set_mesh`` of explicit axes with the batch split over ``"data"`` (one
    device here; eight: test_sharding.py, slow), AWQ's and GPTQ's Gram matrices and the
    report's histogram reduce over split rows: JAX asks such a reduction for its output
    sharding there, and they failed to trace. They give what the same calls give without
    a mesh."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    f = lambda p, x: jnp.tanh(x @ p["w1"]) @ p["w2"]
    p = {"w1": _normal(0, (16, 32), 0.2), "w2": _normal(1, (32, 16), 0.2)}
    x = _normal(2, (8, 16))

    def tools(xb):
        qa = jqt.calibrate(f, jqt.recipes.w4(group_size=8, awq=True), p, [(xb,)], progress=False)
        qg = jqt.calibrate(f, jqt.recipes.w4(group_size=8), p, [(xb,)], progress=False)
        rep = jqt.report(f, jqt.calibrate(f, jqt.recipes.w8a8(), p, [(xb,)], progress=False), p, (xb,))
        return qa, jqt.gptq(f, qg, p, [(xb,)], progress=False), rep

    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        got = tools(jax.device_put(x, NamedSharding(mesh, P("data"))))
    want = tools(x)
    for a, b in zip(jax.tree_util.tree_leaves(got[:2]), jax.tree_util.tree_leaves(want[:2])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(got[2].rows, want[2].rows):
        assert (a.key, a.act_clip, a.weight_clip) == (b.key, b.act_clip, b.weight_clip)
        np.testing.assert_allclose([a.sqnr_isolated, a.sqnr_cumulative], [b.sqnr_isolated, b.sqnr_cumulative],
                                   rtol=1e-4)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
@pytest.mark.parametrize("recipe", ["w8a8", "w4", "w8a8_dynamic"])
@pytest.mark.slow_variants
def test_auto_axes_region_around_a_scan_over_stacked_layers(recipe):
    """A model part the user runs under ``jax.sharding.auto_axes`` on explicit axes (one
    device here; eight: test_sharding.py, slow), holding a ``lax.scan`` over stacked
    layers: jqt rebuilds the scan under the region's mesh, its stacked packed weights
    and qparams retyped onto it. It failed before: the scan's ops read stacked weights
    typed on the function's mesh."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    part = lambda p, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), jnp.tanh(x @ p["w1"]), p["ws"])[0]
    f = lambda p, x: jax.sharding.auto_axes(part, out_sharding=P("data", None))(p, x)
    p = {"w1": _normal(0, (16, 32), 0.2), "ws": _normal(1, (3, 32, 32), 0.2)}
    x = _normal(2, (8, 16))
    rec = {"w8a8": jqt.recipes.w8a8(), "w4": jqt.recipes.w4(group_size=8),
           "w8a8_dynamic": jqt.recipes.w8a8_dynamic()}[recipe]
    want_qp = jqt.calibrate(part, rec, p, [(x,)], progress=False)
    packed = jqt.pack(want_qp, p)
    grad = lambda g, x: jax.jit(jax.grad(lambda q: jnp.sum(jqt.quantize(g, q, simulate=True)(p, x) ** 2)))(want_qp)
    mesh = jax.make_mesh((1,), ("data",))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        qp = jqt.calibrate(f, rec, p, [(xs,)], progress=False)
        got = jax.jit(jqt.quantize(f, want_qp))(packed, xs)
        g = grad(f, xs)
    for a, b in zip(jax.tree_util.tree_leaves(qp), jax.tree_util.tree_leaves(want_qp)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got, jax.jit(jqt.quantize(part, want_qp))(packed, x), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(grad(part, x))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_jqts_rules_run_under_the_users_rank_promotion_setting(mode):
    """``jax_numpy_rank_promotion='raise'`` (or 'warn'): a model that runs under it ran
    calibrated and simulated, but its integer path raised from jqt's own broadcasting
    (``acc - zx * wsum``: (M, N) - (N,)), or warned into the user's log (hunt81_jaxconfig)."""
    f = lambda p, x: jax.nn.relu(x @ p["w"])
    g = lambda p, x: lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                              dimension_numbers=("NHWC", "HWIO", "NHWC"))
    p = {"w": jax.random.normal(jax.random.key(0), (16, 32)), "k": jax.random.normal(jax.random.key(2), (3, 3, 2, 4))}
    x, xc = jax.random.normal(jax.random.key(1), (8, 16)), jax.random.normal(jax.random.key(3), (2, 6, 6, 2))
    with jax.numpy_rank_promotion(mode), warnings.catch_warnings():
        warnings.simplefilter("error")
        for fn, a, r in ((f, x, jqt.recipes.w8a8()), (f, x, jqt.recipes.w8a8_dynamic()),
                         (g, xc, jqt.recipes.w8a8())):
            qp = jqt.calibrate(fn, r, p, [(a,)], progress=False)
            qf = jqt.quantize(fn, qp)
            packed = jqt.pack(qp, p)
            y = jax.jit(qf)(packed, a)
            np.testing.assert_allclose(y, qf(p, a), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(jax.vmap(qf, (None, 0))(packed, a[None]), y[None], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(y, jqt.quantize(fn, qp, simulate=True)(p, a), rtol=1e-4, atol=1e-4)
