"""Quantize/dequantize properties and op-by-op agreement of the integer and simulated paths."""
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jqt
from jqt._src import numerics as nx
from shared import all_eqns, ci_only

floats = st.floats(-1e3, 1e3, allow_nan=False, width=32)


def _fake_quant_round_trip_and_saturation(x, lo, hi, bits, symmetric, narrow):
    t = jqt.QuantType(bits=bits, symmetric=symmetric, narrow_range=narrow)
    x = np.asarray(x, np.float32)
    scale, zp = nx.params_from_range(lo, hi, t)
    q = np.asarray(nx.quantize(jnp.asarray(x), scale, zp, t)).astype(np.int64)
    y = np.asarray(nx.fake_quant(jnp.asarray(x), scale, zp, t))
    s = float(scale)
    z = 0.0 if zp is None else float(zp)
    # codes respect the (narrow) range
    assert q.min() >= t.qmin and q.max() <= t.qmax
    if narrow:
        assert q.min() >= -(2 ** (bits - 1) - 1)
    # the two primitives agree bit for bit: fake_quant == dequantize(quantize), ties too
    # (both compute x / scale as x * (1 / scale): numerics.quotient)
    np.testing.assert_array_equal(y, ((q - z) * s).astype(np.float32))
    # inside the representable range: error at most half a step
    rmin, rmax = (t.qmin - z) * s, (t.qmax - z) * s
    inside = (x >= rmin) & (x <= rmax)
    assert np.all(np.abs(y[inside] - x[inside]) <= 0.5 * s * (1 + 1e-5) + 1e-6)
    # outside: saturates to the end of the range
    np.testing.assert_allclose(y[x > rmax], rmax, rtol=1e-6)
    np.testing.assert_allclose(y[x < rmin], rmin, rtol=1e-6)


_ROUND_TRIP = given(x=st.lists(floats, min_size=1, max_size=32), lo=st.floats(-100, -0.01),
                    hi=st.floats(0.01, 100), bits=st.integers(2, 8), symmetric=st.booleans(),
                    narrow=st.booleans())
# 25 examples by default, 200 more with the slow tests (each new length compiles anew)
test_fake_quant_round_trip_and_saturation = settings(max_examples=25, deadline=None)(
    _ROUND_TRIP(_fake_quant_round_trip_and_saturation))
test_fake_quant_round_trip_and_saturation_200 = pytest.mark.slow(settings(max_examples=200, deadline=None)(
    _ROUND_TRIP(_fake_quant_round_trip_and_saturation)))


@settings(max_examples=50, deadline=None)
@given(lo=st.floats(-50, 50), width=st.floats(0.0, 100), bits=st.integers(2, 8))
def test_zero_is_exact(lo, width, bits):
    t = jqt.QuantType(bits=bits, symmetric=False)
    scale, zp = nx.params_from_range(lo, lo + width, t)
    assert float(nx.fake_quant(jnp.zeros(()), scale, zp, t)) == 0.0


def test_fake_quant_gradients_are_straight_through_with_clipping_mask():
    t = jqt.QuantType(bits=8, symmetric=False)
    scale, zp = nx.params_from_range(-1.0, 1.0, t)
    x = jnp.array([-5.0, -0.5, 0.0, 0.3, 0.99, 5.0])
    gx = jax.grad(lambda x: nx.fake_quant(x, scale, zp, t).sum())(x)
    np.testing.assert_array_equal(gx, [0, 1, 1, 1, 1, 0])
    gs, gz = jax.grad(lambda s, z: nx.fake_quant(x, s, z, t).sum(), argnums=(0, 1))(scale, zp)
    # clipped values pull on the scale with (qmin - z) and (qmax - z); z gets -s per clipped value
    inside = (jnp.round(x[1:5] / scale) - x[1:5] / scale).sum()
    np.testing.assert_allclose(gs, inside + (t.qmin - zp) + (t.qmax - zp), rtol=1e-5)
    np.testing.assert_allclose(gz, -2 * scale, rtol=1e-6)


@pytest.mark.parametrize("grid", ["int", "nf4", "float8_e4m3fn"])
def test_a_zero_point_tangent_has_the_output_shape_on_every_grid(grid):
    """``jqt.fake_quant_p``'s forward-mode rule for its zero point gives a tangent shaped and
    typed as the output, on the non-uniform grids (where the output does not move with it)
    as on the int grid; it was the zero point's own shape there, which ``lax.cond`` refuses."""
    x = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.bfloat16)
    bounds = {"int": dict(qmin=-8, qmax=7), "nf4": dict(qmin=-1.0, qmax=1.0, grid="nf4"),
              "float8_e4m3fn": dict(qmin=-448.0, qmax=448.0, grid="float8_e4m3fn")}[grid]
    f = lambda z: jqt.fake_quant_p.bind(x, jnp.float32(0.1), z, **bounds)
    t = jax.jvp(f, (jnp.float32(0.0),), (jnp.float32(1.0),))[1]
    assert (t.shape, t.dtype) == (x.shape, x.dtype)
    in_cond = jax.lax.cond(True, lambda z: jax.jvp(f, (z,), (jnp.float32(1.0),))[1],
                           lambda z: jnp.zeros_like(x), jnp.float32(0.0))
    np.testing.assert_array_equal(in_cond, t)


@pytest.mark.parametrize("dtype", ci_only(["nf4", "float8_e4m3fn", "float8_e5m2", "int4"],
                                           {"float8_e5m2", "int4"}))  # nf4, e4m3: CI
@pytest.mark.slow_variants
def test_a_range_end_an_ulp_past_still_passes_its_gradient(dtype):
    """The clipping mask counts ``x`` as clipped only where ``x / scale`` rounds past the grid
    (half a step beyond its end), for every grid as for int: a weight group's absolute
    maximum divided by the scale made from it lands on the end or an ulp past it depending
    on the backend's division (an H100's nf4 weight gradients differed from the CPU's by half
    their magnitude, benchmarks/gpu_compile.py, where each group's largest weight got none)."""
    t = jqt.QuantType(dtype=dtype)
    scale = jnp.float32(0.37)
    end = jnp.float32(t.bounds[1]) * scale
    past = jnp.nextafter(end, jnp.float32(jnp.inf))
    assert float(past / scale) > t.bounds[1]  # beyond the end, as the GPU divided
    x = jnp.stack([-2 * end, -past, -end, end, past, 2 * end])
    gx = jax.grad(lambda x: nx.fake_quant(x, scale, None, t).sum())(x)
    np.testing.assert_array_equal(gx, [0, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(nx.fake_quant(x[1:5], scale, None, t), jnp.stack([-end, -end, end, end]))
    # the scale's LSQ gradient: (code - x / s) at an end and an ulp past it (about 0), the
    # bound itself for the clipped ones (int4's lower one is -8, where -2 * end is -14)
    gs = jax.grad(lambda s: nx.fake_quant(x, s, None, t).sum(), argnums=0)(scale)
    np.testing.assert_allclose(gs, sum(t.bounds), atol=1e-4 * t.bounds[1])
    g1 = jax.grad(lambda s: nx.fake_quant(x[5:], s, None, t).sum())(scale)
    assert float(g1) == t.bounds[1]


def test_integer_path_is_not_differentiable():
    t = jqt.QuantType()
    with pytest.raises(TypeError, match="simulate=True"):
        jax.grad(lambda x: nx.quantize(x, jnp.float32(0.1), None, t).astype(jnp.float32).sum())(
            jnp.ones(3))


def test_primitives_vmap_with_batched_scales():
    t = jqt.QuantType(bits=8)
    x = jnp.linspace(-2, 2, 12).reshape(3, 4)
    s = jnp.array([0.01, 0.02, 0.5])
    out = jax.vmap(lambda x, s: nx.fake_quant(x, s, None, t))(x, s)
    ref = jnp.stack([nx.fake_quant(x[i], s[i], None, t) for i in range(3)])
    np.testing.assert_array_equal(out, ref)
    qi = jax.vmap(lambda x, s: nx.quantize(x, s, None, t))(x, s)
    assert qi.dtype == jnp.int8


# ---- op by op: integer path == simulated path -------------------------------------------------

RECIPES = {"w8a8": jqt.recipes.w8a8(), "w8a8_sym": jqt.recipes.w8a8(act_symmetric=True),
           "dynamic": jqt.recipes.w8a8_dynamic(), "w8": jqt.recipes.w8(),
           "asym_weights": jqt.Recipe(rules=(jqt.Rule(
               weight=jqt.QuantType(symmetric=False, per_channel=True),
               activation=jqt.QuantType(symmetric=False)),)),
           "w8_asym": jqt.Recipe(rules=(jqt.Rule(
               weight=jqt.QuantType(symmetric=False, per_channel=True), activation=None),))}

DOTS = {
    "x@w": (lambda w, x: x @ w, (6, 5), (3, 6)),
    "w@x": (lambda w, x: w @ x, (5, 6), (6, 3)),
    "einsum_batch": (lambda w, x: jnp.einsum("bhd,hde->bhe", x, w), (4, 6, 5), (3, 4, 6)),
    "two_contracting": (lambda w, x: jnp.einsum("bij,ijk->bk", x, w), (3, 4, 5), (2, 3, 4)),
    "rank3_x": (lambda w, x: x @ w, (6, 5), (2, 3, 6)),
}


# every kernel formulation: the generic kernels, the CPU table's, and one that forces
# row padding, K-chunked weight-only matmuls and patch convolutions on small shapes.
POLICIES = {"generic": jqt.KernelPolicy(), "cpu": jqt.KernelPolicy.for_backend("cpu"),
            "forced": jqt.KernelPolicy(pad_rows=4, weight_only_chunk=2, conv_patches_below=10**6)}


def _check(f, w, xs, recipe, tol=1e-5):
    """Integer == simulated, with float weights and with packed ones, for each policy."""
    qp = jqt.calibrate(f, recipe, w, [(x,) for x in xs], progress=False)
    sim = jax.jit(jqt.quantize(f, qp, simulate=True))
    packed = jqt.pack(qp, w)
    variants = [(POLICIES["generic"], w), (POLICIES["cpu"], packed), (POLICIES["forced"], packed),
                (POLICIES["forced"], w)]
    for policy, weights in variants:
        qf = jax.jit(jqt.quantize(f, qp, policy=policy))
        for x in xs:
            yi, ys, yf = qf(weights, x), sim(w, x), f(w, x)
            scale = float(jnp.abs(yf).max())
            np.testing.assert_allclose(yi, ys, atol=tol * scale, err_msg=f"{policy}")
            assert float(jnp.abs(yi - yf).max()) < 0.1 * scale  # and it is an approximation of f
        np.testing.assert_allclose(sim(packed, xs[0]), sim(w, xs[0]), atol=tol * scale)
    return qp


# the default run: every recipe on x@w, the static and dynamic int8 recipes on
# every case; the rest of the grid runs with the slow tests (the 5-minute default run)
_DOT_GRID = [(c, r) if c == "x@w" or r == "w8a8"  # every case w8a8, every recipe x@w; the rest: CI
             else pytest.param(c, r, marks=pytest.mark.slow) for c in DOTS for r in RECIPES]


@pytest.mark.parametrize("case,recipe", _DOT_GRID)
@pytest.mark.slow_variants
def test_dot_general_integer_matches_simulated(case, recipe):
    f, wshape, xshape = DOTS[case]
    k = jax.random.split(jax.random.key(0), 4)
    w = jax.random.normal(k[0], wshape)
    xs = [jax.random.normal(k[i], xshape) + 0.5 for i in (1, 2, 3)]
    _check(f, w, xs, RECIPES[recipe])


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
@pytest.mark.parametrize("recipe", ci_only(["w8a8", "dynamic", "fp8"], {"w8a8"}))
def test_mixed_dtype_operands_simulate_as_the_integer_path_computes(recipe):
    # JAX traces int32 @ float32 (counts, one-hot rows) and bfloat16 @ float32 as one
    # dot_general of mixed operands: the simulated path fake-quantizes them in float32,
    # not in their own dtype (which truncated the int activation: 29% error; and rounded
    # the bfloat16 weight's dequantized values to bfloat16)
    # bfloat16 x bfloat16 with preferred_element_type=float32 likewise (the simulated
    # weight was rounded to bfloat16: 2.5e-3 from the integer path)
    rng = np.random.default_rng(0)
    mm = lambda w, x: x @ w
    wide = lambda w, x: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 24)) * 0.3, jnp.float32)
    r = jqt.recipes.fp8() if recipe == "fp8" else RECIPES[recipe]
    xn = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    for f, w_, x in [(mm, w, jnp.asarray(rng.integers(-3, 4, (4, 16)), jnp.int32)),
                     (mm, w, jnp.asarray(rng.integers(0, 4, (4, 16)), jnp.uint8)),
                     (mm, w.astype(jnp.bfloat16), xn),
                     (wide, w.astype(jnp.bfloat16), xn.astype(jnp.bfloat16))]:
        qp = jqt.calibrate(f, r, w_, [(x,)], progress=False)
        yi = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w_), x)
        ys = jax.jit(jqt.quantize(f, qp, simulate=True))(w_, x)
        yf = f(w_, x)
        assert yi.dtype == ys.dtype == yf.dtype
        scale = float(jnp.abs(yf).max())
        np.testing.assert_allclose(ys, yi, atol=1e-5 * scale, err_msg=f"{x.dtype} x {w_.dtype}")
        rep = jqt.report(f, qp, w_, (x,))  # the report's quantized lane is the simulated path
        assert rep.output_rel_l2 == pytest.approx(
            float(jnp.linalg.norm(ys - yf) / jnp.linalg.norm(yf)), rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("recipe", ["w8", "w8a8"])
def test_16bit_operands_into_the_other_16bit_float_simulate_as_the_integer_path(recipe):
    """bfloat16 operands with preferred_element_type=float16 (or the reverse): the
    simulated path rounded the fake-quantized weight to the operand's own dtype, which
    the integer path does not (5-11% more error than deployed; hunt80_jaxextras); and the
    integer weight-only conv rounded its sums over the codes to float16 before the scale,
    then again after it."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 3, 8, 4)) * 0.05
    x = rng.standard_normal((2, 6, 6, 8))
    conv = lambda pet: lambda w, x: jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), preferred_element_type=pet)
    dot = lambda pet: lambda w, x: jax.lax.dot_general(
        x, w.reshape(-1, 4), (((1,), (0,)), ((), ())), preferred_element_type=pet)
    for op, x_ in ((conv, x), (dot, x.reshape(-1, 72)[:3])):
        for dt, pet in ((jnp.bfloat16, jnp.float16), (jnp.float16, jnp.bfloat16)):
            f, w16, x16 = op(pet), jnp.asarray(w, dt), jnp.asarray(x_, dt)
            qp = jqt.calibrate(f, RECIPES[recipe], w16, [(x16,)], progress=False)
            ys = jax.jit(jqt.quantize(f, qp, simulate=True))(w16, x16)
            yi = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w16), x16)
            assert ys.dtype == yi.dtype == pet
            np.testing.assert_allclose(np.asarray(ys, np.float32), np.asarray(yi, np.float32),
                                       rtol=0, atol=2e-3 * float(jnp.abs(yi.astype(jnp.float32)).max()),
                                       err_msg=f"{op.__name__} {dt.__name__} -> {pet.__name__}")


def test_a_16bit_conv_with_a_float32_result_simulates_weight_only():
    # bfloat16 operands with preferred_element_type=float32 under a weight-only recipe: the
    # kernel is fake-quantized in float32, and the unquantized input is cast with it (a
    # conv takes operands of one dtype; it raised a TypeError)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 8, 3)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 3, 3, 4)) * 0.3, jnp.bfloat16)
    f = lambda w, x: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=(
        "NHWC", "HWIO", "NHWC"), preferred_element_type=jnp.float32)
    qp = jqt.calibrate(f, jqt.recipes.w8(), w, [(x,)], progress=False)
    ys = jax.jit(jqt.quantize(f, qp, simulate=True))(w, x)
    yi = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w), x)
    assert ys.dtype == yi.dtype == jnp.float32
    np.testing.assert_allclose(ys, yi, atol=1e-5 * float(jnp.abs(yi).max()))


@pytest.mark.parametrize("recipe", ci_only(["rotate", "smooth", "awq"], {"awq"}))
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_integer_activations_with_outlier_transforms(recipe):
    # the smoothing vector and the Hadamard matrix were cast to the activation's int32:
    # 0.5 became 0 (inf, NaN) and the rotation's scale 0 (a zero output)
    rng = np.random.default_rng(0)
    r = {"rotate": jqt.recipes.w8a8(rotate=True), "smooth": jqt.recipes.w8a8(smooth=0.5),
         "awq": jqt.recipes.w8(awq=True)}[recipe]
    f = lambda w, x: x @ w
    w = jnp.asarray(rng.standard_normal((16, 8)) * 0.3, jnp.float32)
    x = jnp.asarray(rng.integers(-3, 4, (4, 16)), jnp.int32)
    errs = []
    for xi in (x, x.astype(jnp.float32)):
        qp = jqt.calibrate(f, r, w, [(xi,)], progress=False)
        yi = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w), xi)
        ys = jax.jit(jqt.quantize(f, qp, simulate=True))(w, xi)
        scale = float(jnp.abs(f(w, x)).max())
        np.testing.assert_allclose(yi, ys, atol=1e-5 * scale)
        errs.append(float(jnp.abs(yi - f(w, x)).max()) / scale)
    assert errs[0] == pytest.approx(errs[1], rel=1e-5) and errs[0] < 0.03, errs


def test_activation_x_activation_dynamic():
    f = lambda w, x: jnp.einsum("bqd,bkd->bqk", x @ w, x)
    w = jax.random.normal(jax.random.key(0), (8, 8))
    xs = [jax.random.normal(jax.random.key(i), (2, 5, 8)) for i in (1, 2)]
    qp = _check(f, w, xs, jqt.recipes.w8a8_dynamic(act_x_act=True))
    attn = [k for k in qp if "dot_general_" in k]
    assert attn and not qp[attn[0]].is_float
    qp = jqt.calibrate(f, jqt.recipes.w8a8_dynamic(), w, [(xs[0],)], progress=False)
    assert qp[attn[0]].is_float  # left float by default



def test_eager_primitives_and_scales_compile_one_program_each(caplog):
    """Applied to concrete arrays (calibration's scales, jqt.pack's codes), the
    quantize primitives and ``params_from_range`` compile one program per shape and
    parameters, as JAX's own primitives do, not one per jnp operation of their rules;
    the values are those of the same computation under jit."""
    t = jqt.QuantType(bits=4, symmetric=False)
    x = jnp.linspace(-3.0, 5.0, 37)  # a length no other test uses: nothing compiled yet

    def compiles(fn, *args):
        caplog.clear()
        with jax.log_compiles(True), caplog.at_level("WARNING"):
            out = jax.block_until_ready(fn(*args))
        return out, sum("Finished XLA compilation" in r.getMessage() for r in caplog.records)

    (s, z), n = compiles(nx.params_from_range, x[:1] - 3.0, x[-1:] + 5.0, t)
    assert n == 1 and s.shape == z.shape == (1,)
    for fn in (nx.quantize, nx.fake_quant):
        (out, n1), (_, n2) = compiles(fn, x, s, z, t), compiles(fn, x, s, z, t)
        assert (n1, n2) == (1, 0)
        np.testing.assert_array_equal(out, jax.jit(fn, static_argnums=3)(x, s, z, t))
    s_jit, z_jit = jax.jit(nx.params_from_range, static_argnums=2)(x[:1] - 3.0, x[-1:] + 5.0, t)
    np.testing.assert_array_equal(s, s_jit)
    np.testing.assert_array_equal(z, z_jit)


@pytest.mark.parametrize("symmetric", [False, True])
def test_dynamic_params_are_the_plain_ones_bit_for_bit_under_jit(symmetric):
    """``nx.computed_once`` (a division by a computed 1, so XLA does not recompute the
    per-token parameters in every consumer element) changes no value: scales from 1e-30
    to 1e30, zero rows, mixed signs, compiled as the integer path compiles them."""
    q = jqt.QuantType(bits=8, per_channel=True, dynamic=True, symmetric=symmetric)
    mags = 10.0 ** np.linspace(-30, 30, 61, dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((61, 16)).astype(np.float32) * mags[:, None]
    x[3] = 0.0
    x[5] = np.abs(x[5])
    plain = lambda x: nx.params_from_range(jnp.min(x, 1, keepdims=True), jnp.max(x, 1, keepdims=True), q)
    got, want = jax.jit(lambda x: nx.dynamic_params(x, (1,), q))(x), jax.jit(plain)(x)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

def test_dynamic_scales_are_the_same_compiled_and_op_by_op():
    """``computed_once`` divided by ``d / d``: XLA rewrote ``s / (d / d)`` as ``s * d / d``,
    an ulp off ``s`` in about 1% of rows once compiled, while op by op (an eager
    ``jax.vmap`` of the quantized function, ``jax.disable_jit``) it was ``s``: activations on
    a grid (an int8 embedding's rows) sat on ties and took other codes, 0.3% of the output
    apart (hunt74_ensembles)."""
    s = jnp.asarray(np.abs(np.random.default_rng(0).normal(size=(20000, 1))) * 0.02 + 1e-3, jnp.float32)
    once = lambda s: nx.computed_once(s, s)
    for got in jax.jit(once)(s):
        np.testing.assert_array_equal(got, s)


@pytest.mark.slow  # the default run's 5 minutes: the unit case above runs there
def test_an_eager_vmap_of_a_dynamic_model_gives_the_compiled_codes():
    """The model-level case of the test above: an eager ``jax.vmap`` (op by op) of an
    embedding-then-dynamic-matmul model gave other codes than the compiled call."""
    lm = lambda p, ids: jnp.tanh(p["emb"][ids] @ p["w"]) @ p["emb"].T
    k = jax.random.split(jax.random.key(0), 2)
    p = {"emb": jax.random.normal(k[0], (50, 64)) * 0.3, "w": jax.random.normal(k[1], (64, 64)) * 0.15}
    qp = jqt.calibrate(lm, jqt.recipes.w8a8_dynamic(), p, [(jax.random.randint(k[1], (32,), 0, 50),)],
                       progress=False)
    packed, qf = jqt.pack(qp, p), jqt.quantize(lm, qp)
    ids = jax.random.randint(jax.random.key(5), (1, 5), 0, 50)
    np.testing.assert_array_equal(jax.vmap(qf, in_axes=(None, 0))(packed, ids), jax.jit(qf)(packed, ids[0])[None])


CONVS = {
    "same": dict(window_strides=(1, 1), padding="SAME"),
    "valid_stride2": dict(window_strides=(2, 2), padding="VALID"),
    "dilated": dict(window_strides=(1, 1), padding=((2, 1), (0, 2)), rhs_dilation=(2, 1)),
    "lhs_dilated": dict(window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(2, 2)),
    "nchw_stride": dict(window_strides=(2, 1), padding=((1, 0), (2, 2)),
                        dimension_numbers=("NCHW", "HWIO", "NHCW")),
}


@pytest.mark.parametrize("case,recipe", [  # beyond "same", w8a8 by default; the rest: CI
    (c, r) if r == "w8a8" or c == "same" and r != "dynamic" else pytest.param(c, r, marks=pytest.mark.slow)
    for c in CONVS for r in ("w8a8", "w8a8_sym", "dynamic", "w8")])
@pytest.mark.slow_variants
def test_conv_integer_matches_simulated(case, recipe):
    kw = dict(CONVS[case])
    dn = kw.pop("dimension_numbers", ("NHWC", "HWIO", "NHWC"))

    def f(w, x):
        return lax.conv_general_dilated(x, w, dimension_numbers=dn, **kw)

    k = jax.random.split(jax.random.key(1), 4)
    w = jax.random.normal(k[0], (3, 3, 4, 6))
    xshape = (2, 4, 7, 7) if dn[0] == "NCHW" else (2, 7, 7, 4)
    xs = [jax.nn.relu(jax.random.normal(k[i], xshape)) + 0.2 for i in (1, 2)]
    _check(f, w, xs, RECIPES[recipe])


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
@pytest.mark.parametrize("preset", ci_only(["w4", "w4a8"], {"w4"}))  # w4a8: CI
def test_asymmetric_4bit_presets_keep_conv_kernels_symmetric(preset):
    """w4/w4a8(symmetric=False) give the dense weights zero points and the conv kernels
    none (they take none): a model with a conv calibrates, where it raised before."""
    k = jax.random.split(jax.random.key(3), 3)
    p = {"k": jax.random.normal(k[0], (3, 3, 4, 8)) * 0.1, "w": jax.random.normal(k[1], (8, 10)) * 0.1}

    def cnn(p, x):
        h = lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(h).mean((1, 2)) @ p["w"]

    x = jax.random.normal(k[2], (2, 6, 6, 4))
    recipe = {"w4": jqt.recipes.w4(group_size=0, symmetric=False),
              "w4a8": jqt.recipes.w4a8(symmetric=False)}[preset]
    qp = jqt.calibrate(cnn, recipe, p, [(x,)], progress=False)
    assert qp["k"].rhs.qtype.symmetric and qp["k"].rhs.zero_point is None
    assert not qp["w"].rhs.qtype.symmetric and qp["w"].rhs.zero_point is not None
    sim = jqt.quantize(cnn, qp, simulate=True)(p, x)
    np.testing.assert_allclose(jqt.quantize(cnn, qp)(jqt.pack(qp, p), x), sim, rtol=1e-5, atol=1e-5)


def test_grouped_conv():
    def f(w, x):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", feature_group_count=2,
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))

    w = jax.random.normal(jax.random.key(0), (6, 2, 3, 3))
    xs = [jax.random.normal(jax.random.key(i), (2, 4, 5, 5)) + 1.0 for i in (1, 2)]
    _check(f, w, xs, jqt.recipes.w8a8())


def test_integer_kernels_in_jaxpr():
    f = lambda w, x: x @ w
    w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    generic = jqt.KernelPolicy()  # (the CPU table runs few rows through a native kernel: test_native)
    eqns = list(all_eqns(jax.make_jaxpr(jqt.quantize(f, qp, policy=generic))(jqt.pack(qp, w, policy=generic), x)))
    assert [e.outvars[0].aval.dtype for e in eqns if e.primitive is jqt.quantize_p] == [jnp.int8]
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert [(e.invars[0].aval.dtype, e.invars[0].aval.shape, e.invars[1].aval.dtype,
             e.params["preferred_element_type"]) for e in dots] == [(jnp.int8, (2, 4), jnp.int8, jnp.int32)]
    sim = list(all_eqns(jax.make_jaxpr(jqt.quantize(f, qp, simulate=True))(w, x)))
    assert any(e.primitive is jqt.fake_quant_p for e in sim)
    assert not any(v.aval.dtype == jnp.int32 for e in sim for v in e.outvars)


@pytest.mark.parametrize("layout", [("NHWC", "HWIO", "NHWC"),
                                    pytest.param(("NCHW", "OIHW", "NCHW"), marks=pytest.mark.slow)])
def test_dynamic_conv_scales_are_per_example(layout):
    """An example's output must not depend on the other examples in its batch."""
    def conv(w, x):
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=layout)

    w = jax.random.normal(jax.random.key(0), (3, 3, 1, 4) if layout[1] == "HWIO" else (4, 1, 3, 3))
    x = jax.random.uniform(jax.random.key(1), (2, 8, 8, 1) if layout[0] == "NHWC" else (2, 1, 8, 8))
    x = x.at[1].multiply(100.0)
    qp = jqt.calibrate(conv, jqt.recipes.w8a8_dynamic(), w, [(x,)], progress=False)
    for qf in (jqt.quantize(conv, qp), jqt.quantize(conv, qp, simulate=True)):
        np.testing.assert_allclose(qf(w, x)[:1], qf(w, x[:1]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jqt.quantize(conv, qp)(w, x), jqt.quantize(conv, qp, simulate=True)(w, x),
                               atol=1e-5 * float(jnp.abs(conv(w, x)).max()))


def test_fake_quant_and_quantize_agree_at_float32_ties():
    # each primitive alone is its own program; XLA:CPU turned quantize's x / scale into
    # x * (1 / scale) and kept fake_quant's a division (its scale is used again), so a
    # quotient within an ulp of a tie (0.01 on a 2-bit [-0.01, 0.01] grid: 1.5 against
    # 1.4999999) rounded to neighbouring codes; both now multiply by the reciprocal
    for bits, lo, hi, symmetric in ((2, -0.01, 0.01, False), (8, -0.37, 1.9, False), (8, -5.0, 5.0, True)):
        t = jqt.QuantType(bits=bits, symmetric=symmetric)
        s, zp = nx.params_from_range(lo, hi, t)
        z = 0.0 if zp is None else float(zp)
        x = np.float32(np.arange(t.qmin, t.qmax) + 0.5 - z) * np.float32(s)
        x = np.concatenate([x, np.nextafter(x, np.float32(np.inf)), np.nextafter(x, np.float32(-np.inf)),
                            np.arange(-5, 6, dtype=np.float32), np.float32([0.01])])
        q = np.asarray(nx.quantize(jnp.asarray(x), s, zp, t)).astype(np.int64)
        y = np.asarray(nx.fake_quant(jnp.asarray(x), s, zp, t))
        np.testing.assert_array_equal(y, ((q - z) * float(s)).astype(np.float32), err_msg=f"{bits} bits")


def test_smoothed_activations_at_ties_get_the_same_codes_on_every_path():
    # transforms.activation divided by the smoothing vector: XLA:CPU kept the division for
    # a one-token input and made it x * (1 / s) under jax.jit or for several rows, so a
    # smoothed activation an ulp from a tie of its grid got a neighbouring code
    rng = np.random.default_rng(0)
    f = lambda p, x: x @ p["w"]
    p = {"w": jnp.asarray(rng.normal(size=(16, 16)) * 0.3, jnp.float32)}
    cal = [(jnp.asarray(rng.normal(size=(32, 16)) * rng.uniform(0.2, 5, size=16), jnp.float32),)]
    qp = jqt.calibrate(f, jqt.recipes.w8a8(smooth=0.5, act_symmetric=True), p, cal, progress=False)
    sm = np.asarray(qp["w"].smooth, np.float32).reshape(-1)
    sx = np.float32(np.asarray(qp["w"].lhs.scale))
    row = np.zeros(16, np.float32)
    for j in range(16):   # a value that rounds to other codes as x / s and as x * (1 / s)
        for k in range(-100, 100):
            c = np.float32(np.float32(k + 0.5) * sx * sm[j])
            cands = [v for v in (c, np.nextafter(c, np.float32(1e9)), np.nextafter(c, np.float32(-1e9)))
                     if np.round(np.float32(v / sm[j]) / sx) != np.round(np.float32(v * (np.float32(1) / sm[j])) / sx)]
            if cands:
                row[j] = cands[0]
                break
    assert np.count_nonzero(row) >= 8
    x = jnp.asarray(row)
    sim, qf, packed = jqt.quantize(f, qp, simulate=True), jqt.quantize(f, qp), jqt.pack(qp, p)
    ref = np.asarray(jax.jit(sim)(p, x))
    step = float(sx) * float(np.abs(np.asarray(p["w"]) * sm[:, None]).max())
    for name, y in (("eager", sim(p, x)), ("packed", qf(packed, x)), ("jit packed", jax.jit(qf)(packed, x)),
                    ("one row", sim(p, x[None])[0]), ("two rows", sim(p, jnp.stack([x, x]))[0])):
        assert float(np.abs(np.asarray(y) - ref).max()) < 0.01 * step, name


def test_fp8_on_float_params_keeps_products_of_two_small_scales():
    """fp8 (e5m2 most: its scales are a range over 57344) on float params multiplied the
    two scales first: below float32's normal range the product flushed to 0 and every
    output was 0, at weights of 1e-30 or activations of 1e-30 (hunt66_lowbitnumerics)."""
    rng = np.random.default_rng(4)
    f = lambda p, x: x @ p["w"]  # noqa: E731
    rec = jqt.recipes.fp8(weight_dtype="float8_e5m2", act_dtype="float8_e5m2")
    for ws, xs in ((1e-30, 1.0), (1.0, 1e-30)):
        p = {"w": jnp.asarray(rng.standard_normal((64, 16)) * ws, jnp.float32)}
        x = jnp.asarray(rng.standard_normal((4, 64)) * xs, jnp.float32)
        qp = jqt.calibrate(f, rec, p, [(x,)], progress=False)
        sim = jqt.quantize(f, qp, simulate=True)(p, x)
        assert float(jnp.abs(sim).max()) > 0
        gpu = jqt.KernelPolicy.for_backend("gpu")  # packed, fp8 x fp8 in one matmul
        for out in (jax.jit(jqt.quantize(f, qp))(p, x),
                    jax.jit(jqt.quantize(f, qp, policy=gpu))(jqt.pack(qp, p, policy=gpu), x)):
            np.testing.assert_allclose(out, sim, rtol=1e-5, atol=1e-5 * float(jnp.abs(sim).max()))


@pytest.mark.parametrize("wb,ab", [(8, 3)] + [pytest.param(w, a, marks=pytest.mark.slow)  # the rest: CI
                                      for w, a in ((6, 8), (5, 7), (3, 5))])
def test_odd_bit_widths_on_both_operands_run_the_integer_path(wb, ab):
    """int3, int5, int6 and int7 codes on both operands of a dense op or a convolution
    crashed with NumPy's "data type 'int3' not understood": the accumulator bound asked
    NumPy whether the format's name was an integer dtype (hunt74_badargs). formats.md
    promises int2-int8 for weights and activations."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((48, 16)) * 0.1, jnp.float32),
         "k": jnp.asarray(rng.standard_normal((3, 3, 4, 8)) * 0.1, jnp.float32)}
    dense = lambda p, x: x @ p["w"]
    conv = lambda p, x: lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    cases = ((dense, jnp.asarray(rng.standard_normal((4, 48)), jnp.float32)),
             (conv, jnp.asarray(rng.standard_normal((2, 6, 6, 4)), jnp.float32)))
    for f, x in cases:
        for dynamic in (False, True):
            recipe = jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=wb, per_channel=True),
                                                activation=jqt.QuantType(bits=ab, dynamic=dynamic)),))
            qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
            ys = jqt.quantize(f, qp, simulate=True)(p, x)
            y = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x)
            np.testing.assert_allclose(y, ys, atol=1e-5 * float(jnp.abs(ys).max()))


def test_a_weight_whose_scale_has_no_normal_reciprocal_is_refused():
    # an nf4 or 3-bit scale above 2**126 has a subnormal reciprocal, flushed to 0: every
    # code was 0 on every path, jqt.pack included, and calibrate warned the weight "all zeros"
    f = lambda p, x: x @ p["w"]
    w = jnp.array([[3e38, -1e38], [1e38, 2e38], [-2e38, 0.5e38], [1e37, 3e38]] * 16, jnp.float32)
    for recipe in (jqt.recipes.nf4(group_size=64), jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=3)),))):
        with pytest.raises(ValueError, match=r"op 'w' reads weight 'w', whose range needs a scale of .*2\*\*126.*jqt.Rule\(key='\^w\$', weight=None\)"):
            jqt.calibrate(f, recipe, {"w": w}, [(jnp.ones((1, 64)),)], progress=False)
    # between 2**126 and twice it, nf4's clipping calibrator (WeightMSE) picked a scale just
    # under the limit: the largest values were cut by up to half, and an output flipped sign
    w2 = jnp.array([[1.0, -1.0], [0.5, 0.25], [0.1, 0.3], [-0.7, 0.2]]) * 1.5e38
    with pytest.raises(ValueError, match=r"whose range needs a scale of 1.5e\+38 on its nf4"):
        jqt.calibrate(f, jqt.recipes.nf4(), {"w": w2}, [(jnp.full((1, 4), 1e-30),)], progress=False)
    # and on an asymmetric grid, whose unclipped scale is the range's (hunt57_review)
    asym = jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=2, symmetric=False, per_channel=False),
                                      weight_calibrator=jqt.calibrators.WeightMSE()),))
    with pytest.raises(ValueError, match=r"whose range needs a scale of 1e\+38 on its int2 asym"):
        jqt.calibrate(f, asym, {"w": w2}, [(jnp.full((1, 4), 1e-30),)], progress=False)
    qp = jqt.calibrate(f, jqt.recipes.nf4(group_size=64), {"w": w * 1e-30}, [(jnp.ones((1, 64)),)], progress=False)
    assert np.abs(np.asarray(jqt.quantize(f, qp)(jqt.pack(qp, {"w": w * 1e-30}), jnp.ones((1, 64))))).min() > 1e8


def test_a_nonzero_weight_too_small_for_a_scale_is_not_called_all_zeros():
    # a weight of normal float32 values around 3e-37 needs an int8 scale below float32's
    # normal range: it gets the placeholder 1 (documented), but calibrate warned the weight
    # was "all zeros" and advised keeping a LoRA adapter float
    f = lambda p, x: x @ p["w"]
    w = jnp.array([[3e-37, -2e-37], [1e-37, 2.5e-37]], jnp.float32)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        jqt.calibrate(f, jqt.recipes.w8(), {"w": w}, [(jnp.ones((1, 2)),)], progress=False)
    texts = [str(m.message) for m in ws]
    assert not any("all zeros" in t for t in texts), texts
    assert any("op 'w' reads weight 'w', whose largest magnitude 3e-37 needs a scale below "
               "float32's normal range" in t and "jqt.Rule(key='^w$', weight=None)" in t for t in texts), texts
    with warnings.catch_warnings(record=True) as ws:  # subnormal: XLA:CPU reads them as 0
        warnings.simplefilter("always")
        sub = jnp.asarray(np.array([[3e-39, -2e-39], [1e-39, 2.5e-39]], np.float32))  # (not w * 1e-2: flushed)
        jqt.calibrate(f, jqt.recipes.w8(), {"w": sub}, [(jnp.ones((1, 2)),)], progress=False)
    texts = [str(m.message) for m in ws]
    assert any("whose largest magnitude (subnormal, below 1.2e-38) needs a scale" in t for t in texts), texts


@pytest.mark.parametrize("recipe,scale", [
    ("w8a16", 1e-32), ("fp8_e5m2", 1e-30), ("fp8", 1e-33)])
def test_tiny_weights_under_a_static_activation_scale_are_not_flushed(recipe, scale):
    """A per-tensor static activation scale folded into the weight's scales flushed their
    product to 0 for weights of 1e-33 to 1e-30 (at 16 rows: fp8's bfloat16 matmul, w8a16's
    codes as float): every output 0 where float and simulate=True were right
    (hunt75_degenerate). The scale stays on the codes there."""
    make = {"w8a16": jqt.recipes.w8a16, "fp8": jqt.recipes.fp8,
            "fp8_e5m2": lambda: jqt.recipes.fp8(weight_dtype="float8_e5m2", act_dtype="float8_e5m2")}[recipe]
    f = lambda p, x: x @ p["w"]
    rng = np.random.default_rng(5)
    p = {"w": jnp.asarray(rng.standard_normal((64, 32)) * 0.2 * scale, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    qp = jqt.calibrate(f, make(), p, [(x,)], progress=False)
    sim = jqt.quantize(f, qp, simulate=True)(p, x)
    for params in (p, jqt.pack(qp, p)):
        y = jqt.quantize(f, qp)(params, x)
        assert float(jnp.abs(y - sim).max()) <= 1e-3 * float(jnp.abs(sim).max()) > 0


def test_an_activation_too_small_for_a_scale_is_warned_of():
    # as for a weight (above): a static activation range of about 3e-37 needs a scale below
    # float32's normal range, gets the placeholder 1 and the op outputs zeros; calibrate
    # said nothing for activations
    f = lambda p, x: x @ p["w"]
    x = jnp.array([[3e-37, -2e-37]], jnp.float32)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        jqt.calibrate(f, jqt.recipes.w8a8(), {"w": jnp.eye(2)}, [(x,)], progress=False)
    texts = [str(m.message) for m in ws]
    assert any("op 'w' (dot_general at '<top>'): its activation's calibrated range reaches only "
               "3e-37" in t and "activation=None" in t for t in texts), texts
    # stacked layers: the tiny one named, with its own magnitude (it gave the largest)
    def g(ws, x):
        return jax.lax.scan(lambda h, w: (h @ w * 1e38, None), x, ws)[0]
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        jqt.calibrate(g, jqt.recipes.w8a8(), jnp.stack([jnp.eye(2)] * 2), [(x,)], progress=False)
    texts = [str(m.message) for m in ws]
    assert any("range in iterations [0] of 2 (stacked layers or experts) reaches only 3e-37" in t
               for t in texts), texts
    # float64 (x64) activations below float32's normal range: not "0 on every batch"
    with jax.enable_x64(True), warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        x64 = jnp.array([[5e-39, -2e-39]], jnp.float64)
        jqt.calibrate(f, jqt.recipes.w8a8(), {"w": jnp.eye(2)}, [(x64,)], progress=False)
    texts = [str(m.message) for m in ws]
    assert not any("was 0 on every calibration batch" in t for t in texts), texts
    assert any("its activation's calibrated range reaches only 1.18e-38" in t for t in texts), texts


def test_pack_gives_per_tensor_weights_the_simulated_codes_at_ties():
    # jqt.pack quantizes a weight in a program of its own (a division XLA:CPU made a
    # product with the reciprocal); the simulated path on float params divided: weights
    # a tie apart decoded a step apart (372 of 1536 here)
    rng = np.random.default_rng(3)
    f = lambda p, x: x @ p["w"]
    recipe = jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=8)),))
    w = rng.uniform(-1, 1, (48, 32)).astype(np.float32)
    w[0, 0] = 1.9
    eye = jnp.eye(48)
    qp = jqt.calibrate(f, recipe, {"w": jnp.asarray(w)}, [(eye,)], progress=False)
    s = np.float32(qp["w"].rhs.scale)
    w = np.float32(rng.integers(-127, 127, w.shape) + 0.5) * s
    w = np.where(rng.random(w.shape) < 0.5, np.nextafter(w, np.float32(np.inf)), w)
    w[0, 0] = 1.9
    p = {"w": jnp.asarray(w)}
    sim = jqt.quantize(f, qp, simulate=True)
    for g in (sim, jax.jit(sim)):
        np.testing.assert_array_equal(g(p, eye), g(jqt.pack(qp, p), eye))


def test_the_primitives_check_their_parameters_when_bound_eagerly():
    """jqt.fake_quant_p and jqt.quantize_p bound outside jit skipped the abstract
    evaluation's checks: a scale of another shape failed in JAX's words, an unknown grid
    raised a KeyError, qmin > qmax returned numbers, a missing dtype a TypeError of the
    implementation (hunt62_apisurface). Eager and traced binds check alike now."""
    x, s, z = jnp.array([0.26, 9.0, -3.3]), jnp.float32(0.5), jnp.float32(0)
    for call in (lambda b: b(), lambda b: jax.jit(b)()):
        with pytest.raises(ValueError, match=r"scale of shape \(2,\) does not broadcast to the "
                           r"operand's shape \(3,\)"):
            call(lambda: jqt.fake_quant_p.bind(x, jnp.ones(2), z, qmin=-8, qmax=7))
        with pytest.raises(ValueError, match=r"grid='nf5' is not one of \['int', 'nf4'"):
            call(lambda: jqt.fake_quant_p.bind(x, s, z, qmin=-8, qmax=7, grid="nf5"))
        with pytest.raises(ValueError, match="qmin=7 is above qmax=-8"):
            call(lambda: jqt.fake_quant_p.bind(x, s, z, qmin=7, qmax=-8))
        with pytest.raises(TypeError, match="jqt_quantize.bind takes the parameters qmin, qmax, "
                           "dtype; dtype missing"):
            call(lambda: jqt.quantize_p.bind(x, s, z, qmin=-8, qmax=7))
        assert call(lambda: jqt.quantize_p.bind(x, s, z, qmin=-8, qmax=7, dtype=jnp.int8)).tolist() == [1, 7, -7]


def test_a_float64_weight_below_float32s_range_is_not_called_all_zeros():
    """Under jax_enable_x64 a float64 weight of 3e-50 became 0 when its bits were read as
    float32: calibrate said "all zeros" (and nothing under fp8) for a weight that is not
    (hunt62_x64). It names its largest magnitude, as for a float32 weight too small."""
    with jax.enable_x64(True):
        p = {"w": jnp.array([[4e-50, 5e-51], [1e-50, 3e-50]], jnp.float64)}
        f = lambda p, x: x @ p["w"]  # noqa: E731
        for recipe in (jqt.recipes.w8(), jqt.recipes.fp8()):
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                jqt.calibrate(f, recipe, p, [(jnp.ones((1, 2), jnp.float64),)], progress=False)
            text = " ".join(str(w.message) for w in got)
            assert "whose largest magnitude 4e-50" in text and "all zeros" not in text, text


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_nan_row_that_f_drops_does_not_set_a_per_tensor_dynamic_scale():
    """Left padding with a -inf mask: the pad rows' probabilities are NaN, which f zeroes
    after attention. A per-tensor dynamic act_x_act scale took its range over the NaN:
    scale 1, every row's probabilities rounded to 0 or 1 (42% error; hunt73_attnmask). A
    NaN now enters no dynamic range; the rows f keeps get the error they have without it."""
    B, T, D = 2, 6, 8
    k = jax.random.split(jax.random.key(0), 4)
    p = {n: jax.random.normal(kk, (D, D)) * D ** -0.5 for n, kk in zip("qkv", k[:3])}
    x = jax.random.normal(k[3], (B, T, D))
    am = jnp.array([[1] * T, [0, 0, 1, 1, 1, 1]])

    def f(p, x, am, clean=False):
        q, kk, v = (x @ p[n] for n in "qkv")
        mask = jnp.tril(jnp.ones((T, T), bool))[None] & am[:, None, :].astype(bool)
        probs = jax.nn.softmax(jnp.where(mask, q @ jnp.swapaxes(kk, 1, 2), -jnp.inf), -1)
        o = (jnp.nan_to_num(probs) if clean else probs) @ v
        return jnp.where(am[:, :, None] > 0, o, 0.0)  # the pad rows dropped

    ref = f(p, x, am)
    assert bool(jnp.isfinite(ref).all())
    rec = jqt.Recipe(rules=(jqt.Rule(act_x_act=jqt.QuantType(bits=8, dynamic=True)),))
    err = {}
    for clean in (False, True):
        g = functools.partial(f, clean=clean)
        qp = jqt.calibrate(g, rec, p, [(x, am)], progress=False)
        for sim in (False, True):
            y = jqt.quantize(g, qp, simulate=sim)(p, x, am)
            err[clean, sim] = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert max(err.values()) < 0.03, err
    assert abs(err[False, False] - err[True, False]) < 0.01, err
