"""Grouped scales on weights with batch axes: the experts of a mixture-of-experts layer,
``jnp.einsum("ecd,edf->ecf", x, w)`` (Mixtral, DeepSeek and MaxText's dense-dispatch
form). Each expert's weight gets the groups a 2-D matmul would give it, stored two
codes per byte, and runs the kernels of ``experts.py``: the integer path is checked
against the simulated one at one, two and many rows, with the decoded float weight
(the CPU table) and with the split int8 x int8 groups (``batched_groups=True``), with
float, packed and saved weights, through jit, vmap, grad, GPTQ, a scan over stacked
layers and ``jax.export``."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jqt

E, D, F, G = 3, 128, 64, 32
RNG = np.random.default_rng(7)


def _weights(shape):
    """Gaussian weights whose rows of D come in blocks of very different magnitude (the
    case groups are for): blocks of 32 inputs scaled by 1 to 30."""
    w = RNG.standard_normal(shape)
    block = RNG.uniform(1.0, 30.0, shape[:-2] + (shape[-2] // G, 1, shape[-1]))
    w = w.reshape(shape[:-2] + (shape[-2] // G, G, shape[-1])) * block
    return jnp.asarray(w.reshape(shape) * 0.01, jnp.float32)


P = {"w": _weights((E, D, F))}


def experts(p, x):          # x: (E, C, D), the tokens routed to each expert
    return jnp.einsum("ecd,edf->ecf", x, p["w"])


def experts_lhs(p, x):      # the weight as the lhs operand, output (E, F, C)
    return jax.lax.dot_general(p["w"], x, (((1,), (2,)), ((0,), (0,))))


def experts_2d(p, x):       # expert e alone, as a plain matmul
    return x @ p["w"]


def _x(rows):
    return jnp.asarray(RNG.standard_normal((E, rows, D)), jnp.float32)


X_FEW, X_MANY = _x(2), _x(80)   # the CPU policy decodes the weight above 64 rows

RECIPES = {
    "w4_g32": jqt.recipes.w4(group_size=G),
    "w4_asym_g32": jqt.recipes.w4(group_size=G, symmetric=False),
    "nf4_g32": jqt.recipes.nf4(group_size=G),
    "w4a8_g32": jqt.recipes.w4a8(group_size=G),
    "w4a8_asym_g32": jqt.recipes.w4a8(group_size=G, symmetric=False),
    "w8a8_g32": jqt.recipes.w8a8(group_size=G),
    "fp8_g32": jqt.Recipe(rules=(jqt.Rule(
        weight=jqt.QuantType(dtype="float8_e4m3fn", group_size=G),
        activation=jqt.QuantType(dtype="float8_e4m3fn")),)),
    "w8a8_dynamic_g32": jqt.Recipe(rules=(jqt.Rule(   # per-token int8 activations
        weight=jqt.QuantType(bits=8, group_size=G),
        activation=jqt.QuantType(bits=8, symmetric=False, per_channel=True, dynamic=True)),)),
}
DEFAULT = ()  # every case runs with the slow tests (test_experts_decoded_one_at_a_time: default run)
SPLIT = jqt.KernelPolicy(pad_rows=2, batched_groups=True, float_matmul_rows=64)


def _calibrate(f, recipe, p, x):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the groups fit: no fallback to per channel
        return jqt.calibrate(f, recipe, p, [(x,)], progress=False)


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


@pytest.mark.parametrize("f, name", [
    pytest.param(f, n, id=f"{n}-{side}", marks=() if (side, n) in DEFAULT else pytest.mark.slow)
    for n in RECIPES for f, side in ((experts, "rhs"), (experts_lhs, "lhs"))])
def test_expert_weights_get_groups_and_integer_matches_simulated(tmp_path, f, name):
    recipe = RECIPES[name]
    x = jnp.concatenate([X_FEW, X_MANY], axis=1)
    qp = _calibrate(f, recipe, P, x)
    q = qp["w"].operand(qp["w"].weight_operand)
    assert q.qtype.group_size == G and q.scale.shape == (E, D // G, F)
    # each expert's scales are those of its own 2-D matmul
    for e in range(E):
        qe = _calibrate(experts_2d, recipe, {"w": P["w"][e]}, x[e])["w"].rhs
        np.testing.assert_array_equal(q.scale[e], qe.scale)
        if q.zero_point is not None:
            np.testing.assert_array_equal(q.zero_point[e], qe.zero_point)
    packed = jqt.pack(qp, P)
    v = packed.weights["w"].values
    if q.qtype.bits == 4:  # two codes per byte along the last axis
        assert v.dtype == np.uint8 and v.shape == (E, D, F // 2)
    path = str(tmp_path / "experts.safetensors")
    jqt.save_packed(path, packed, qp)
    for rows in (X_FEW[:, :1], X_FEW, X_MANY):  # split int8 groups (one row padded to
        # two) / decoded float weight
        sim = jax.jit(jqt.quantize(f, qp, simulate=True))(P, rows)
        tol = 2e-6 * float(jnp.max(jnp.abs(sim)))
        for w in (P, packed, jqt.load_packed(path)):
            out = jax.jit(jqt.quantize(f, qp))(w, rows)
            assert out.shape == sim.shape
            assert float(jnp.max(jnp.abs(out - sim))) <= tol, name
        # int8 activations: the groups split into one int8 dot (CPU: the decoded weight)
        out = jax.jit(jqt.quantize(f, qp, policy=SPLIT))(packed, rows)
        assert float(jnp.max(jnp.abs(out - sim))) <= tol, name
        sim_packed = jax.jit(jqt.quantize(f, qp, simulate=True))(packed, rows)
        assert float(jnp.max(jnp.abs(sim_packed - sim))) <= tol, name
        assert _rel(sim, f(P, rows)) < (0.12 if q.qtype.bits == 4 else 0.05)


@pytest.mark.parametrize("name", ["w8a8_dynamic", "w8a8"])
@pytest.mark.slow_variants
def test_one_token_per_expert_per_channel(name):
    """Per-channel int8 experts at one token each: the int8 dot's single row is padded to
    two (``intdot.one_row_padded``), and the result equals the simulated path's."""
    recipe = {"w8a8_dynamic": jqt.recipes.w8a8_dynamic(), "w8a8": jqt.recipes.w8a8()}[name]
    qp = _calibrate(experts, recipe, P, X_FEW)
    x1 = X_FEW[:, :1]
    sim = jqt.quantize(experts, qp, simulate=True)(P, x1)
    out = jax.jit(jqt.quantize(experts, qp))(jqt.pack(qp, P), x1)
    assert out.shape == (E, 1, F)
    assert float(jnp.max(jnp.abs(out - sim))) <= 2e-6 * float(jnp.max(jnp.abs(sim)))


@pytest.mark.slow  # the digits formulation: test_gemv by default, experts in CI
@pytest.mark.parametrize("name", ["w8", "w4_asym_per_channel"])
def test_weight_only_experts_at_few_rows_run_int8_digits(name):
    """Weight-only per-channel experts at up to ``gemv_rows`` (4) tokens per expert run
    the activation as int8 digits through one int8 dot (``experts.batched_digits``),
    above that the cast weight; both equal the simulated path."""
    recipe = {"w8": jqt.recipes.w8(), "w4_asym_per_channel": jqt.recipes.w4(group_size=0, symmetric=False)}[name]
    for f in (experts, experts_lhs):
        qp = _calibrate(f, recipe, P, X_MANY)
        packed = jqt.pack(qp, P)
        qf = jqt.quantize(f, qp)
        for rows, digits in ((1, True), (4, True), (5, False)):
            x = X_MANY[:, :rows]
            sim = jqt.quantize(f, qp, simulate=True)(P, x)
            out = jax.jit(qf)(packed, x)
            assert float(jnp.max(jnp.abs(out - sim))) <= 2e-6 * float(jnp.max(jnp.abs(sim)))
            assert ("preferred_element_type=int32" in str(jax.make_jaxpr(qf)(packed, x))) == digits


def test_groups_beat_per_channel_on_expert_weights():
    """The point of the groups: when blocks of 32 inputs have weights of very different
    magnitude (and activations the other way round, so that each block counts as much
    in the output), int4 per group of 32 is several times more accurate than int4 per
    output channel, which these weights got before (a weight with batch axes took no
    groups)."""
    mag = jnp.asarray(np.repeat(RNG.uniform(1.0, 30.0, (E, 1, D // G)), G, axis=-1))  # (E, 1, D)
    p = {"w": P["w"] / P["w"].std() * 0.01 * jnp.swapaxes(mag, 1, 2)}
    x = X_FEW / mag
    ref = experts(p, x)
    errs = {}
    for g in (G, 0):
        qp = _calibrate(experts, jqt.recipes.w4(group_size=g), p, x)
        errs[g] = _rel(jax.jit(jqt.quantize(experts, qp))(jqt.pack(qp, p), x), ref)
    assert errs[G] < 0.5 * errs[0], errs


@pytest.mark.slow  # experts over two contracted axes (test_formats: dense ones): CI
def test_experts_with_two_contracted_axes():
    """An expert weight contracted over (heads, head_dim): groups along head_dim, per head."""
    w = _weights((E, 2, D // 2, F)).reshape(E, 2, D // 2, F)
    p = {"w": w}
    f = lambda p, x: jnp.einsum("echd,ehdf->ecf", x, p["w"])
    for rows in (2, 80):
        x = jnp.asarray(RNG.standard_normal((E, rows, 2, D // 2)), jnp.float32)
        for recipe in (jqt.recipes.w4(group_size=G), jqt.recipes.w4a8(group_size=G)):
            qp = _calibrate(f, recipe, p, x)
            assert qp["w"].rhs.scale.shape == (E, 2, D // 2 // G, F)
            sim = jqt.quantize(f, qp, simulate=True)(p, x)
            out = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x)
            assert float(jnp.max(jnp.abs(out - sim))) <= 2e-6 * float(jnp.max(jnp.abs(sim)))


L = 2
P_STACK = {"w1": jnp.stack([_weights((E, D, F)) for _ in range(L)]),
           "w2": jnp.stack([_weights((E, F, D)) * 0.1 for _ in range(L)])}


def moe_layers(p, x):       # a scan over stacked mixture layers, x: (E, C, D)
    def layer(h, w):
        u = jax.nn.gelu(jnp.einsum("ecd,edf->ecf", h, w[0]))
        return h + jnp.einsum("ecf,efd->ecd", u, w[1]), None
    return jax.lax.scan(layer, x, (p["w1"], p["w2"]))[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4a8_asym_g32", "w4_g32", "w8a8_dynamic_g32"])
def test_stacked_expert_layers_compose(name):
    """Scan over stacked layers, jit, vmap over prompts, packed_shardings, export, GPTQ
    (one Hessian per layer and expert), and gradients to the weights and scales through
    the simulated path."""
    qp = _calibrate(moe_layers, RECIPES[name], P_STACK, X_FEW)
    assert qp["w1"].rhs.scale.shape == (L, E, D // G, F)
    assert qp["w2"].rhs.scale.shape == (L, E, F // G, D)
    packed = jqt.pack(qp, P_STACK)
    qf = jax.jit(jqt.quantize(moe_layers, qp))
    sim = jqt.quantize(moe_layers, qp, simulate=True)(P_STACK, X_FEW)
    out = qf(packed, X_FEW)
    assert float(jnp.max(jnp.abs(out - sim))) <= 1e-5 * float(jnp.max(jnp.abs(sim)))
    assert _rel(out, moe_layers(P_STACK, X_FEW)) < 0.2
    xs = jnp.stack([X_FEW, 2 * X_FEW])
    np.testing.assert_allclose(jax.vmap(qf, in_axes=(None, 0))(packed, xs),
                               jnp.stack([qf(packed, x) for x in xs]), rtol=1e-5, atol=1e-5)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    qs, ps = jqt.packed_shardings(qp, packed, mesh)
    qp_d, packed_d = jax.device_put((qp, packed), (qs, ps))
    np.testing.assert_array_equal(jax.jit(jqt.quantize(moe_layers, qp_d))(packed_d, X_FEW), out)
    exp = jax.export.export(qf)(packed, X_FEW)
    back = jax.export.deserialize(exp.serialize())
    np.testing.assert_array_equal(back.call(packed, X_FEW), out)
    pq = jqt.gptq(moe_layers, qp, P_STACK, [(X_MANY,)], progress=False)  # per layer and expert
    ref = moe_layers(P_STACK, X_MANY)
    sim_of = lambda w: jqt.quantize(moe_layers, qp, simulate=True)(w, X_MANY)
    assert _rel(sim_of(pq), ref) < _rel(sim_of(P_STACK), ref)  # GPTQ beats plain rounding
    # on the grid: packing the re-rounded weights loses nothing (the simulated path reads
    # the packed codes back; the integer path may sum int4 halves in another float order,
    # and one flipped activation code between the layers shows at the output)
    np.testing.assert_array_equal(sim_of(jqt.pack(qp, pq)), sim_of(pq))
    loss = lambda p, qp: jnp.sum(jqt.quantize(moe_layers, qp, simulate=True)(p, X_FEW) ** 2)
    gp, gq = jax.grad(loss, argnums=(0, 1))(P_STACK, qp)
    assert bool(jnp.isfinite(gp["w1"]).all()) and float(jnp.abs(gp["w1"]).max()) > 0
    gs = gq["w1"].rhs.scale
    assert gs.shape == (L, E, D // G, F) and bool(jnp.isfinite(gs).all()) and float(jnp.abs(gs).max()) > 0


@pytest.mark.slow  # GPTQ per expert: CI
@pytest.mark.parametrize("f", [experts, experts_lhs], ids=["rhs", "lhs"])
def test_gptq_rerounds_each_expert_with_its_own_hessian(f):
    """GPTQ on expert weights: one problem per expert, with the Hessian of the tokens
    routed to it, the same weights as GPTQ on each expert's 2-D matmul alone; on the
    grid, so packing loses nothing."""
    x = X_MANY * jnp.asarray(RNG.uniform(0.2, 4.0, (E, 1, D)), jnp.float32)  # per-expert inputs
    recipe = jqt.recipes.w4(group_size=G)
    qp = _calibrate(f, recipe, P, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "plain rounding" warning
        # (80 rows an expert for 128 inputs: said, and better than nearest codes on these rows)
        warnings.filterwarnings("ignore", message=".*80 calibration rows for its 128 inputs")
        pq = jqt.gptq(f, qp, P, [(x,)], progress=False)
    for e in range(E):
        pe = {"w": P["w"][e]}
        qe = _calibrate(experts_2d, recipe, pe, x[e])
        np.testing.assert_allclose(pq["w"][e], jqt.gptq(experts_2d, qe, pe, [(x[e],)], progress=False)["w"],
                                   rtol=1e-5, atol=1e-6)
    sim, ref = jqt.quantize(f, qp, simulate=True), f(P, x)
    assert _rel(sim(pq, x), ref) < 0.6 * _rel(sim(P, x), ref)
    packed = jqt.pack(qp, pq)
    np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp))(packed, x), sim(pq, x),
                               rtol=1e-5, atol=2e-6 * float(jnp.max(jnp.abs(ref))))


MAP_OPS = {   # name: (function, weight shape): the weight's K first or last, nibbles along N or K
    "edf": (experts, (E, D, F)),
    "edf_lhs": (experts_lhs, (E, D, F)),
    "efd": (lambda p, x: jnp.einsum("ecd,efd->ecf", x, p["w"]), (E, F, D)),
    "def": (lambda p, x: jnp.einsum("ecd,def->ecf", x, p["w"]), (D, E, F)),   # experts in the middle
    "edhk": (lambda p, x: jnp.einsum("ecd,edhk->echk", x, p["w"]), (E, D, 4, F // 4)),
}
MAP_RECIPES = dict(RECIPES, w8=jqt.recipes.w8(),
                   w4_asym_per_channel=jqt.recipes.w4(group_size=0, symmetric=False),
                   fp8=jqt.recipes.fp8())  # per channel, fp8 activations (hunt81_hloaudit:
# decoded whole by the generic fp8 kernel, 3-4x float32 at one token per expert)
CHUNKED = jqt.KernelPolicy(pad_rows=2, batched_map=True, weight_only_chunk=64)  # K-chunks of 64
MAP_DEFAULT = (("edf", "w4_g32"), ("edf", "fp8"))  # the rest, ("def", "w8") too: slow


@pytest.mark.parametrize("op, name", [
    pytest.param(o, n, id=f"{o}-{n}", marks=() if (o, n) in MAP_DEFAULT else pytest.mark.slow)
    for o in MAP_OPS for n in ("w4_g32", "w4_asym_g32", "nf4_g32", "w4a8_asym_g32", "fp8_g32",
                               "w8", "w4_asym_per_channel", "fp8")])
@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_experts_decoded_one_at_a_time(op, name):
    """``experts.decoded_map`` (the CPU table's ``batched_map``): one expert at a time,
    whole or in K-chunks, int4 codes kept two per byte along N or along K, equals the
    simulated path at 1, 5 and 80 tokens per expert, packed and float weights; with
    ``batched_map=False`` the whole weight is decoded at once (no loop in the jaxpr)."""
    f, shape = MAP_OPS[op]
    p = {"w": _weights(shape) if shape[-2] == D else jnp.asarray(RNG.standard_normal(shape) * 0.1, jnp.float32)}
    qp = _calibrate(f, MAP_RECIPES[name], p, jnp.concatenate([X_FEW, X_MANY], axis=1))
    packed = jqt.pack(qp, p)
    loops = lambda qf, w, x: str(jax.make_jaxpr(qf)(w, x)).count("scan[")
    for rows in (1, 5, 80):
        x = X_MANY[:, :rows]
        sim = jax.jit(jqt.quantize(f, qp, simulate=True))(p, x)
        tol = 2e-6 * float(jnp.max(jnp.abs(sim)))
        for policy in (None, CHUNKED):
            qf = jqt.quantize(f, qp, policy=policy)
            for w in (p, packed):
                out = jax.jit(qf)(w, x)
                assert out.shape == sim.shape
                assert float(jnp.max(jnp.abs(out - sim))) <= tol, (rows, policy)
        # grouped or many rows: never the int8 digits; chunked: a loop over experts and one over K
        if name not in ("w8", "w4_asym_per_channel") or rows > 4:
            assert loops(jqt.quantize(f, qp, policy=CHUNKED), packed, x) == 2
    whole = jqt.KernelPolicy(pad_rows=2, batched_map=False)
    x = X_MANY[:, :5]
    assert loops(jqt.quantize(f, qp, policy=whole), packed, x) == 0
    np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp, policy=whole))(packed, x),
                               jax.jit(jqt.quantize(f, qp, simulate=True))(p, x), rtol=1e-5, atol=1e-5)


SIZES = jnp.array([3, 0, 5], jnp.int32)  # 8 rows of 10 sorted by expert: one expert gets none
X_RAGGED = jnp.asarray(RNG.standard_normal((10, D)), jnp.float32)


def ragged(p, x):           # x: (M, D), rows sorted by expert, SIZES rows each
    return jax.lax.ragged_dot(x, p["w"], SIZES)


RAGGED_RECIPES = {
    "w8a8": jqt.recipes.w8a8(), "w8a8_dynamic": jqt.recipes.w8a8_dynamic(), "w8": jqt.recipes.w8(),
    "w8a16": jqt.recipes.w8a16(), "w4_g32": RECIPES["w4_g32"], "w4_asym_g32": RECIPES["w4_asym_g32"],
    "w4_per_channel": jqt.recipes.w4(group_size=0), "nf4_g32": RECIPES["nf4_g32"],
    "w4a8_g32": RECIPES["w4a8_g32"], "fp8": jqt.recipes.fp8()}
INT_RAGGED = ("w8a8", "w8a8_dynamic", "w8a16")  # int codes x a symmetric per-channel int weight


@pytest.mark.parametrize("name", list(RAGGED_RECIPES))
@pytest.mark.slow_variants
def test_ragged_dot_integer_matches_simulated(name):
    """``lax.ragged_dot`` (tokens sorted by expert against the stacked expert weights) is
    quantized per expert and output channel (or group of K): the integer path on packed
    weights matches the simulated one, rows past the groups stay zero, an expert with no
    rows is fine. With int activation codes the op is one ragged_dot of int8 codes with
    int32 sums from ``KernelPolicy.ragged_int_rows`` rows up (forced here: 1), the
    weight decoded to float below (the CPU table at these 10 rows). It stayed float
    before (the calibration said so)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no op left float
        qp = jqt.calibrate(ragged, RAGGED_RECIPES[name], P, [(X_RAGGED,)], progress=False)
    q = qp["w"]
    assert q.op == "ragged_dot_general" and not q.is_float
    g = q.rhs.qtype.group_size
    assert q.rhs.scale.shape == (E, D // g if g else 1, F)
    sim = jqt.quantize(ragged, qp, simulate=True)(P, X_RAGGED)
    ref = ragged(P, X_RAGGED)
    table = jqt.KernelPolicy.for_backend("cpu")
    for policy, ints in ((table, False), (dataclasses.replace(table, ragged_int_rows=1), name in INT_RAGGED)):
        packed = jqt.pack(qp, P, policy=policy)
        out = jax.jit(jqt.quantize(ragged, qp, policy=policy))(packed, X_RAGGED)
        np.testing.assert_allclose(out, sim, rtol=2e-5, atol=2e-5 * float(jnp.abs(sim).max()))
        err = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        assert err < (0.03 if name in INT_RAGGED + ("w8",) else 0.06 if name == "fp8" else 0.15), err
        assert float(jnp.abs(out[8:]).max()) == 0.0
        eqns = [e for e in jax.make_jaxpr(jqt.quantize(ragged, qp, policy=policy))(packed, X_RAGGED).jaxpr.eqns
                if e.primitive.name == "ragged_dot_general"]
        dtypes = [tuple(str(v.aval.dtype) for v in e.invars[:2]) for e in eqns]
        kernels = 2 if name == "w8a16" else 1  # int16 activations: high and low bytes
        assert dtypes == [("int8", "int8") if ints else ("float32", "float32")] * kernels, dtypes
    four_bit = name.startswith(("w4", "nf4"))
    codes = packed.weights["w"].values
    assert (codes.dtype == jnp.uint8, codes.shape[-1]) == ((True, F // 2) if four_bit else (False, F))


def test_a_map_over_expert_indices_says_to_map_over_the_weight():
    """``lax.map(lambda e: x[e] @ w[e], jnp.arange(E))`` quantizes each expert at run time
    (its weight is no leaf reached by layout ops): jqt.pack's warning gave advice that did
    not apply; it names the form and the fix (hunt66_moe)."""
    x = jnp.stack([X_RAGGED[:4]] * E)
    f = lambda p, x: jax.lax.map(lambda e: x[e] @ p["w"][e], jnp.arange(E))  # noqa: E731
    qp = jqt.calibrate(f, jqt.recipes.w8(), P, [(x,)], progress=False)
    with pytest.warns(UserWarning, match=r"w\[e\] in a lax.map/lax.scan over jnp.arange\(E\).*"
                                         r"lax.map\(body, w\)"):
        packed = jqt.pack(qp, P)
    assert not packed.weights


def test_ragged_dot_with_a_per_tensor_weight_runs_its_integer_kernel():
    """A per-tensor weight type (one scale, 0-d) crashed the int8 ragged_dot kernel with an
    IndexError from ``KernelPolicy.ragged_int_rows`` rows up (256 on the CPU table: a
    300-token prefill; hunt66_moe)."""
    rule = jqt.Rule(weight=jqt.QuantType(bits=8, per_channel=False),
                    activation=jqt.QuantType(bits=8, symmetric=False, per_channel=False))
    with pytest.warns(UserWarning, match="one scale for all of them"):
        qp = jqt.calibrate(ragged, jqt.Recipe(rules=(rule,)), P, [(X_RAGGED,)], progress=False)
    assert qp["w"].rhs.scale.shape == ()
    sim = jqt.quantize(ragged, qp, simulate=True)(P, X_RAGGED)
    policy = dataclasses.replace(jqt.KernelPolicy.for_backend("cpu"), ragged_int_rows=1)
    out = jax.jit(jqt.quantize(ragged, qp, policy=policy))(jqt.pack(qp, P, policy=policy), X_RAGGED)
    np.testing.assert_allclose(out, sim, rtol=2e-5, atol=2e-5 * float(jnp.abs(sim).max()))


@pytest.mark.slow_variants
@pytest.mark.parametrize("cal", [jqt.calibrators.MinMax(), jqt.calibrators.Percentile(99.9),
                                 jqt.calibrators.Entropy()], ids=lambda c: type(c).__name__)
def test_ragged_dot_calibrates_on_the_rows_in_an_expert(cal):
    """Rows past ``sum(group_sizes)`` (the padding of a sorted token buffer) give zeros
    whatever they hold; calibration folded them into the static activation range (padding
    of 100 made w8a8's scale 14x and its error 12x). Each calibrator now sees the routed
    rows only, exactly as it would see them alone (here: ``x[:n] @ w[0]``)."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((3, 64, 32)) * .1, jnp.float32)}
    f = lambda p, x, g: jax.lax.ragged_dot(x, p["w"], g)
    x = jnp.asarray(rng.standard_normal((80, 64)), jnp.float32)
    recipe = jqt.recipes.w8a8(calibrator=cal)
    for n, gs in ((70, [40, 0, 30]), (80, [50, 20, 10]), (0, [0, 0, 0]), (1, [0, 1, 0])):
        gs = jnp.array(gs, jnp.int32)
        if n == 0:  # no row reached an expert: nothing observed, no range; the op stays float
            with pytest.warns(UserWarning, match=r"op 'w' .*never ran.*group_sizes were all 0"):
                assert jqt.calibrate(f, recipe, p, [(x, gs)], progress=False)["w"].is_float
            continue
        got = [jqt.calibrate(f, recipe, p, [(x.at[n:].set(v), gs)], progress=False)["w"].lhs
               for v in (0.0, 100.0)]
        alone = jqt.calibrate(lambda p, x: x @ p["w"][0], recipe, p, [(x[:n],)], progress=False)["w"].lhs
        for q in got:
            assert float(q.scale) == float(alone.scale) and float(q.zero_point) == float(alone.zero_point), n


@pytest.mark.parametrize("name", ["w8a8_dynamic", "fp8_dynamic"])
def test_ragged_dot_padding_rows_holding_inf_give_zeros_with_dynamic_activations(name):
    """A padding row of inf: its dynamic row scale is inf, and the decoded formulation
    (the default below ragged_int_rows, and every export with a symbolic row count)
    multiplied ragged_dot's 0 there by it, NaN; float and the simulated path give 0."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((4, 64, 32)) * 0.1, jnp.float32)}
    gs = jnp.array([3, 4, 2, 3], jnp.int32)
    f = lambda p, x: jax.lax.ragged_dot(x, p["w"], gs)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.float32)
    recipe = jqt.recipes.w8a8_dynamic() if name == "w8a8_dynamic" else jqt.recipes.fp8(dynamic=True)
    qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
    xi = x.at[12:].set(jnp.inf).at[13].set(-jnp.inf)
    sim = jqt.quantize(f, qp, simulate=True)(p, xi)
    for pol in (None, jqt.KernelPolicy(ragged_int_rows=1)):
        y = jax.jit(jqt.quantize(f, qp, policy=pol))(jqt.pack(qp, p, policy=pol), xi)
        assert not np.isnan(np.asarray(y)).any(), pol
        np.testing.assert_array_equal(np.asarray(y)[12:], 0.0)
        np.testing.assert_allclose(y, sim, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_nan_padding_rows_give_the_activation_scale_a_finite_gradient():
    """A sorted token buffer padded by jnp.take's fill (NaN rows past sum(group_sizes)):
    the forward gave zeros there, but the simulated path fake-quantized the whole buffer
    and LSQ's scale gradient took 0 * NaN: NaN, which jqt.qat.project then set to the
    smallest scale (the layer's output ~0, silently)."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=(4, 16, 8)) * .2, jnp.float32)}
    tokens = jnp.asarray(rng.normal(size=(20, 16)), jnp.float32)
    expert = jnp.asarray(rng.integers(0, 4, size=20))
    sizes = jnp.bincount(expert, length=4).astype(jnp.int32)
    idx = jnp.concatenate([jnp.argsort(expert), jnp.full((12,), 20)])  # out of range: NaN rows
    f = lambda p, t: jax.lax.ragged_dot(jnp.take(t, idx, axis=0), p["w"], sizes)[:20]
    target = jnp.asarray(rng.normal(size=(20, 8)), jnp.float32)
    for recipe in (jqt.recipes.w8a8(), jqt.recipes.fp8()):
        qp = jqt.calibrate(f, recipe, p, [(tokens,)], progress=False)
        loss = lambda q: jnp.mean((jqt.quantize(f, q, simulate=True)(p, tokens) - target) ** 2)
        g = jax.grad(loss)(qp)["w"].lhs.scale
        assert np.isfinite(np.asarray(g)).all() and float(jnp.abs(g).max()) > 0, g
        # the same gradient as the buffer of the routed rows alone (padding zeros)
        f0 = lambda p, t: jax.lax.ragged_dot(jnp.take(t, idx, axis=0, mode="fill", fill_value=0.0),
                                             p["w"], sizes)[:20]
        g0 = jax.grad(lambda q: jnp.mean((jqt.quantize(f0, q, simulate=True)(p, tokens) - target) ** 2))(qp)
        np.testing.assert_allclose(g, g0["w"].lhs.scale, rtol=1e-5)


def test_padding_rows_reach_no_per_tensor_dynamic_scale_on_either_path():
    """The padding rows are zeroed before an activation is quantized on every path: a
    per-tensor dynamic scale, computed from every row, is the routed rows' alone on the
    simulated path, the integer path and the exact sums (the simulated path alone zeroed
    them at first: the paths then disagreed by 9.44 here)."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.normal(size=(2, 16, 8)) * 0.3, jnp.float32)}
    gs = jnp.array([3, 2], jnp.int32)
    f = lambda p, x: jax.lax.ragged_dot(x, p["w"], gs)
    x = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32).at[5:].set(1000.0)
    for acc in (None, 16):
        rule = jqt.Rule(weight=jqt.QuantType(bits=8, per_channel=True),
                        activation=jqt.QuantType(bits=8, dynamic=True, per_channel=False),
                        **({} if acc is None else {"accumulator": acc}))
        qp = jqt.calibrate(f, jqt.Recipe(rules=(rule,)), p, [(x,)], progress=False)
        sim = jqt.quantize(f, qp, simulate=True)(p, x)
        for pol in (None, jqt.KernelPolicy(ragged_int_rows=1)):
            y = jax.jit(jqt.quantize(f, qp, policy=pol))(jqt.pack(qp, p, policy=pol), x)
            np.testing.assert_allclose(y, sim, atol=1e-4)
        assert float(jnp.abs(sim - f(p, x)).max()) < 0.05 * float(jnp.abs(f(p, x)[:5]).max())


@pytest.mark.slow  # GPTQ per expert on 1,536 rows: CI
def test_gptq_rerounds_a_ragged_dot_mixture_per_expert_as_its_einsum():
    """``jqt.gptq`` on a ``lax.ragged_dot`` mixture: one problem per expert with the Hessian
    of the rows routed to it (rows past the groups reach none), the same weights as GPTQ on
    the einsum form of the same experts; an expert no row reaches keeps plain rounding,
    warned. It kept plain rounding for every expert ("not a dense op")."""
    # correlated inputs (GPTQ's gain; with independent ones its best is plain rounding) and
    # rows enough for a Hessian that holds on held-out rows
    c = 512
    rng = np.random.default_rng(7)  # its own draws: the module's RNG state depends on test order
    mix = jnp.asarray(rng.standard_normal((E, D, D)) / np.sqrt(D) + np.eye(D), jnp.float32)
    draw = lambda: jnp.einsum("ecd,edk->eck", jnp.asarray(rng.standard_normal((E, c, D)), jnp.float32), mix)
    x = draw()
    sizes = jnp.full((E,), c, jnp.int32)
    rag = lambda p, x: jax.lax.ragged_dot(x, p["w"], sizes)
    recipe = jqt.recipes.w4(group_size=G)
    xr = x.reshape(E * c, D)
    qr, qe = _calibrate(rag, recipe, P, xr), _calibrate(experts, recipe, P, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "plain rounding" warning
        pr = jqt.gptq(rag, qr, P, [(xr,)], progress=False)
    np.testing.assert_allclose(pr["w"], jqt.gptq(experts, qe, P, [(x,)], progress=False)["w"],
                               rtol=1e-5, atol=1e-6)
    held = draw().reshape(E * c, D)
    sim, ref = jqt.quantize(rag, qr, simulate=True), rag(P, held)
    assert _rel(sim(pr, held), ref) < 0.9 * _rel(sim(P, held), ref)
    np.testing.assert_allclose(jax.jit(jqt.quantize(rag, qr))(jqt.pack(qr, pr), held), sim(pr, held),
                               rtol=1e-5, atol=2e-5 * float(jnp.max(jnp.abs(ref))))
    empty = lambda p, x: jax.lax.ragged_dot(x, p["w"], jnp.array([c, 0, c], jnp.int32))  # expert 1: none
    q0 = _calibrate(empty, recipe, P, xr[:2 * c])
    with pytest.warns(UserWarning, match=r"no calibration rows, or only rows of zeros, reached its layers or experts \[1\]"):
        p0 = jqt.gptq(empty, q0, P, [(xr[:2 * c],)], progress=False)
    assert not bool(jnp.array_equal(p0["w"][0], P["w"][0]))


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_ragged_dot_moe_layers_under_scan():
    """A mixture-of-experts layer written with ``lax.ragged_dot`` (routing by argmax, rows
    sorted by expert), stacked layers under ``lax.scan``: calibrated per layer and expert,
    integer matches simulated, the simulated path has gradients for the weights and the
    scales, and the packed model round-trips through save_packed/load_packed and
    ``jax.export``."""
    n_layers, m = 2, 12
    p = {"w": jnp.stack([_weights((E, D, D)) for _ in range(n_layers)]),
         "router": jnp.asarray(RNG.standard_normal((D, E)) * 0.1, jnp.float32)}

    def moe(p, x):
        def layer(h, w):
            e = jnp.argmax(h @ p["router"], axis=-1)
            order = jnp.argsort(e)
            y = jax.lax.ragged_dot(h[order], w, jnp.bincount(e, length=E).astype(jnp.int32))
            return jnp.tanh(h + jnp.zeros_like(y).at[order].set(y)), None
        return jax.lax.scan(layer, x, p["w"])[0]

    x = jnp.asarray(RNG.standard_normal((m, D)), jnp.float32)
    qp = jqt.calibrate(moe, jqt.recipes.w8a8_dynamic(), p, [(x,), (x * 0.5,)], progress=False)
    assert qp["w"].rhs.scale.shape == (n_layers, E, 1, D)
    packed = jqt.pack(qp, p)
    qf = jax.jit(jqt.quantize(moe, qp))
    out = qf(packed, x)
    np.testing.assert_allclose(out, jqt.quantize(moe, qp, simulate=True)(p, x), rtol=1e-4, atol=1e-4)
    grads = jax.grad(lambda p, q: jnp.sum(jqt.quantize(moe, q, simulate=True)(p, x) ** 2), (0, 1))(p, qp)
    assert float(jnp.abs(grads[0]["w"]).max()) > 0 and float(jnp.abs(grads[1]["w"].rhs.scale).max()) > 0
    path = str(pytest.importorskip("pathlib").Path(__import__("tempfile").mkdtemp()) / "moe.safetensors")
    jqt.save_packed(path, packed, qp)
    np.testing.assert_array_equal(qf(jqt.load_packed(path), x), out)
    exp = jax.export.deserialize(jax.export.export(qf)(packed, x).serialize())
    np.testing.assert_array_equal(exp.call(packed, x), out)


def _tanh_ragged(x, w):
    return jnp.tanh(jax.lax.ragged_dot(x, w, SIZES))


@jax.custom_vjp
def _ragged_custom_vjp(x, w):
    return _tanh_ragged(x, w)


_ragged_custom_vjp.defvjp(lambda x, w: (_tanh_ragged(x, w), (x, w)),
                          lambda res, g: jax.vjp(_tanh_ragged, *res)[1](g))

RAGGED_IN = {
    "cond": lambda p, x: jax.lax.cond(x.sum() > 0, lambda x: _tanh_ragged(x, p["w"]),
                                      lambda x: -_tanh_ragged(x, p["w"]), x),
    "while": lambda p, x: jax.lax.while_loop(  # square experts (F x F), twice
        lambda c: c[1] < 2, lambda c: (_tanh_ragged(c[0], p["w"]), c[1] + 1), (x[:, :F], 0))[0],
    "remat": lambda p, x: jax.checkpoint(lambda x: _tanh_ragged(x, p["w"]))(x),
    "custom_vjp": lambda p, x: _ragged_custom_vjp(x, p["w"]),
}


@pytest.mark.parametrize("where", list(RAGGED_IN))
@pytest.mark.slow_variants
def test_ragged_dot_inside_cond_while_remat_and_custom_vjp(where):
    """A ragged_dot inside ``lax.cond`` (both branches calibrated), ``lax.while_loop``,
    ``jax.checkpoint`` and a ``jax.custom_vjp`` function: quantized, the integer path (both
    formulations) matches the simulated one, whose gradients reach the weights (but
    through the while_loop, which JAX does not differentiate in reverse)."""
    f = RAGGED_IN[where]
    p = {"w": P["w"][:, :F]} if where == "while" else P
    x = X_RAGGED
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,), (-x,)], progress=False)
    assert qp and all(not q.is_float and q.op == "ragged_dot_general" for q in qp.values())
    sim = jqt.quantize(f, qp, simulate=True)(p, x)
    for rows in (0, 1):
        policy = jqt.KernelPolicy(ragged_int_rows=rows)
        out = jax.jit(jqt.quantize(f, qp, policy=policy))(jqt.pack(qp, p, policy=policy), x)
        np.testing.assert_allclose(out, sim, rtol=2e-5, atol=2e-5 * float(jnp.abs(sim).max()))
    if where != "while":
        g = jax.grad(lambda p: jnp.sum(jqt.quantize(f, qp, simulate=True)(p, x) ** 2))(p)
        assert float(jnp.abs(g["w"]).max()) > 0


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
@pytest.mark.parametrize("name", ["w8a8", "w4_g32", "nf4_g32"])
@pytest.mark.slow_variants
def test_ragged_dot_on_bfloat16(name, out_dtype):
    """A bfloat16 model's ragged_dot, with a bfloat16 output or with
    ``preferred_element_type=float32``: the integer path (both formulations) matches the
    simulated one, to one bfloat16 rounding of the output where it is bfloat16, to float32
    rounding where it is float32 (the decoded weight is not rounded to bfloat16 first)."""
    p = {"w": P["w"].astype(jnp.bfloat16)}
    x = X_RAGGED.astype(jnp.bfloat16)
    f = lambda p, x: jax.lax.ragged_dot(x, p["w"], SIZES, preferred_element_type=out_dtype)
    qp = jqt.calibrate(f, RAGGED_RECIPES[name], p, [(x,)], progress=False)
    sim = jqt.quantize(f, qp, simulate=True)(p, x).astype(jnp.float32)
    tol = (2 ** -7 if out_dtype is None else 2e-5) * float(jnp.abs(sim).max())
    for rows in (0, 1):
        policy = jqt.KernelPolicy(ragged_int_rows=rows)
        out = jax.jit(jqt.quantize(f, qp, policy=policy))(jqt.pack(qp, p, policy=policy), x)
        assert out.dtype == (out_dtype or jnp.bfloat16)
        np.testing.assert_allclose(out.astype(jnp.float32), sim, rtol=0, atol=tol)


def test_ragged_dot_narrow_accumulator_and_symbolic_rows():
    """A 16-bit accumulator (``w8a8(accumulator=16)``) saturates the ragged_dot's sums alike
    on the integer path (int8 codes or decoded weight) and the simulated one, and the
    quantized function exports with a symbolic row count (the weight decoded there)."""
    x = X_RAGGED * 4.0
    qp = jqt.calibrate(ragged, jqt.recipes.w8a8(accumulator=16), P, [(x,)], progress=False)
    wide = jqt.calibrate(ragged, jqt.recipes.w8a8(), P, [(x,)], progress=False)
    sim = jqt.quantize(ragged, qp, simulate=True)(P, x)
    assert float(jnp.abs(sim - jqt.quantize(ragged, wide, simulate=True)(P, x)).max()) > 0.1  # it saturates
    for rows in (0, 1):
        policy = jqt.KernelPolicy(ragged_int_rows=rows)
        out = jqt.quantize(ragged, qp, policy=policy)(jqt.pack(qp, P, policy=policy), x)
        np.testing.assert_allclose(out, sim, rtol=2e-5, atol=2e-5 * float(jnp.abs(sim).max()))
    packed = jqt.pack(qp, P)
    rows = jax.export.symbolic_shape("m, 128")
    exp = jax.export.export(jax.jit(jqt.quantize(ragged, qp)))(packed, jax.ShapeDtypeStruct(rows, jnp.float32))
    np.testing.assert_allclose(exp.call(packed, x), jqt.quantize(ragged, qp)(packed, x), rtol=1e-6, atol=1e-6)


def test_a_ragged_dot_in_another_form_says_that_its_weight_stays_float():
    """A ``ragged_dot_general`` ragged along the contraction (one output per group, as a
    weight gradient has) is not the form jqt quantizes: calibration says so, naming the
    weight and the form it quantizes, and the op runs float."""
    rd = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (0,)), ((), ())),
                                           lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
    p = {"w": P["w"][0]}
    f = lambda p, x: jax.lax.ragged_dot_general(x, p["w"], jnp.array([40, 88], jnp.int32), rd)
    with pytest.warns(UserWarning, match=r"reads weight 'w': jqt has no rule for ragged_dot_general in "
                      r"this form \(jqt quantizes lax.ragged_dot\(x, w, group_sizes\)"):
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(X_RAGGED,)], progress=False)
    assert qp == {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "jqt: a ragged_dot")  # said again where f is traced
        np.testing.assert_array_equal(jqt.quantize(f, qp)(p, X_RAGGED), f(p, X_RAGGED))


def test_a_ragged_dot_of_two_activations_says_that_it_stays_float():
    """``lax.ragged_dot(h, w, sizes)`` with ``w`` computed from the data: no weight, and
    ``act_x_act=`` applies to dot_general only, so it stays float; it did so without a word,
    even under a recipe that sets act_x_act= (hunt63_actlowbits)."""
    p = {"w_in": P["w"][0][:, :16]}
    f = lambda p, x, w: jax.lax.ragged_dot(x @ p["w_in"], w, jnp.array([40, 88], jnp.int32))  # noqa: E731
    w = jnp.ones((2, 16, 8), jnp.float32)
    rec = jqt.Recipe(rules=tuple(dataclasses.replace(r, act_x_act=jqt.QuantType(dynamic=True))
                                 for r in jqt.recipes.w8a8_dynamic().rules))
    with pytest.warns(UserWarning, match=r"a ragged_dot_general \(at '<top>'\) multiplies two values "
                      r"computed from the data.*act_x_act= applies to dot_general"):
        qp = jqt.calibrate(f, rec, p, [(X_RAGGED, w)], progress=False)
    assert list(qp) == ["w_in"]
    # a weight masked by the data: the warning says so, and how (as for a matmul; the
    # generic words above suggested act_x_act=; hunt63_review)
    masked = lambda p, x, m: jax.lax.ragged_dot(x, p["w"] * m, jnp.array([3, 4, 3], jnp.int32))  # noqa: E731
    with pytest.warns(UserWarning, match=r"a ragged_dot_general \(at '<top>'\) reads weight 'w' "
                      r"combined elementwise with the data"):
        jqt.calibrate(masked, rec, {"w": P["w"]}, [(X_RAGGED, jnp.float32(0.5))], progress=False)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_a_sparse_matmul_that_reads_a_weight_says_that_it_stays_float():
    """Multi-hot features as a ``jax.experimental.sparse`` BCOO matrix times an embedding
    table (``bcoo_dot_general``): the table stayed float without a word; now a warning
    names it and the form jqt quantizes (an embedding bag)."""
    from jax.experimental import sparse
    p = {"emb": jnp.asarray(np.random.default_rng(0).standard_normal((50, 8)), jnp.float32),
         "w": jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)), jnp.float32)}
    idx = jnp.asarray([[0, 3], [0, 7], [1, 7], [1, 49]], jnp.int32)
    data = jnp.asarray([1.0, 0.5, 2.0, 1.0], jnp.float32)
    f = lambda p, d, i: (sparse.BCOO((d, i), shape=(2, 50)) @ p["emb"]) @ p["w"]
    with pytest.warns(UserWarning, match=r"a bcoo_dot_general \(a jax.experimental.sparse matmul, at "
                      r"'<top>'\) reads weight 'emb': jqt has no rule for sparse matmuls, so it "
                      r"stays float.*embedding bag"):
        qp = jqt.calibrate(f, jqt.recipes.w8(), p, [(data, idx)], progress=False)
    assert list(qp) == ["w"]
    # a BCOO weight changed by another sparse op first (its transpose) warned of nothing,
    # and one scaled in f named its indices' leaf (hunt36_sparse)
    bw = {"s": sparse.BCOO.fromdense(p["emb"][:8, :4]), "w": p["w"][:4]}
    x = jnp.ones((2, 8))
    for g in (lambda p, x: (p["s"].T @ x.T).T @ p["w"], lambda p, x: (x @ (p["s"] * 0.5)) @ p["w"]):
        with pytest.warns(UserWarning, match=r"sparse matmul, at '<top>'\) reads a weight \(changed "
                                             r"by another op first"):
            jqt.calibrate(g, jqt.recipes.w8(), bw, [(x,)], progress=False)
    # a sparse x sparse matmul of a BCOO weight (bcoo_spdot_general) was silent (hunt47_sparse)
    xs = sparse.BCOO.fromdense(jnp.eye(2, 8))
    with pytest.warns(UserWarning, match=r"a bcoo_spdot_general \(a jax.experimental.sparse matmul"):
        qp = jqt.calibrate(lambda p, x: (x @ p["s"]).todense() @ p["w"], jqt.recipes.w8(), bw,
                           [(xs,)], progress=False)
    assert list(qp) == ["w"]


def test_ragged_dot_without_an_entry_runs_float_and_report_says_what_to_do():
    """qparams made before jqt quantized ``lax.ragged_dot`` have no entry for it: the op
    runs float, as it did. ``jqt.report``, whose two lanes ragged_dot cannot be batched
    over in this JAX, raises an error that says what to do instead."""
    qp = jqt.calibrate(ragged, jqt.recipes.w8a8(), P, [(X_RAGGED,)], progress=False)
    old = {k: v for k, v in qp.items() if k != "w"}
    np.testing.assert_array_equal(jqt.quantize(ragged, old)(P, X_RAGGED), ragged(P, X_RAGGED))
    try:
        jqt.report(ragged, qp, P, (X_RAGGED,))
    except NotImplementedError as e:  # where this JAX cannot batch ragged_dot over the lanes
        assert "jqt.report runs f on two lanes" in str(e) and "simulate=True" in str(e)
        # jqt.fallback, which ranks by jqt.report, says to rank by trials, not to compare
        # qparams the user does not hold (hunt58_fallback); that ranking runs
        ref = ragged(P, X_RAGGED)
        err = lambda g: float(jnp.abs(g(P, X_RAGGED) - ref).max())
        with pytest.raises(NotImplementedError, match="jqt.fallback") as got:
            jqt.fallback(ragged, jqt.recipes.w8a8(), P, [(X_RAGGED,)], err, max_drop=0.0,
                         higher_is_better=False)
        assert "qparams" not in str(got.value) and "Pass rank='sensitivity'" in str(got.value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a budget of 0 may not be met)
            res = jqt.fallback(ragged, jqt.recipes.w8a8(), P, [(X_RAGGED,)], err, max_drop=0.0,
                               higher_is_better=False, rank="sensitivity")
        assert res.trials


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_experts_gathered_per_token_are_named():
    """Mixtral's form, each token's expert matrix gathered (``w[expert_ids]``) and
    contracted per token: jqt can only quantize the gather as a lookup table (one scale per
    matrix) and the matmul on what it gathers stays float, so calibrate says so and names
    the forms it quantizes per expert, where it was silent. A rule keeping the lookup float
    silences it; an embedding table (a vector per index) does not warn."""
    def gathered(p, x, ids):
        return jnp.einsum("td,tdf->tf", x, p["w"][ids])

    x, ids = jnp.asarray(RNG.standard_normal((6, D)), jnp.float32), jnp.array([0, 1, 2, 0, 1, 2])
    with pytest.warns(UserWarning, match=r"op 'w' \(gather at '<top>'\) looks up whole \(128, 64\) "
                                         r"matrices.*one scale per matrix; a matmul that takes what it "
                                         r"gathers as its weight .* stays float.*einsum over the expert axis"):
        qp = jqt.calibrate(gathered, jqt.recipes.w8(), P, [(x, ids)], progress=False)
    assert qp["w"].op == "gather"
    # with groups the table takes them, as the warning now says (it said one scale per matrix)
    with pytest.warns(UserWarning, match=r"looks up whole \(128, 64\) matrices.*a lookup table, "
                                         r"scales per group along each matrix's last axis where the rule's group_size fits it"):
        qp = jqt.calibrate(gathered, jqt.recipes.nf4(group_size=32), P, [(x, ids)], progress=False)
    assert qp["w"].operand(qp["w"].weight_operand).scale.shape == (3, 128, 2)
    # a group longer than a matrix's row: one group per row, in a lookup's words (it spoke
    # of contracted axes, which a lookup has none of)
    with pytest.warns(UserWarning, match=r"cannot take group_size=128 \(groups run along axis 2 .*"
                                         r"of length 64, and a group does not span more than one "
                                         r"row\); it gets group_size=64, one group per row ") as got:
        qp = jqt.calibrate(gathered, jqt.recipes.nf4(group_size=128), P, [(x, ids)], progress=False)
    assert not any("contracted" in str(m.message) for m in got)
    assert qp["w"].operand(qp["w"].weight_operand).scale.shape == (3, 128, 1)
    # a row the groups do not divide (48 under 128, 96 under 64): one group per row too,
    # as formats.md says (it got one scale per whole matrix; hunt57_moetune)
    for f_, g in ((48, 128), (96, 64)):
        w = {"w": jnp.asarray(RNG.standard_normal((3, D, f_)), jnp.float32)}
        with pytest.warns(UserWarning, match=rf"it gets group_size={f_}, one group per row "
                                             rf"\(({'finer' if f_ < g else 'coarser'}) than asked"):
            qp = jqt.calibrate(gathered, jqt.recipes.w4(group_size=g), w, [(x, ids)], progress=False)
        assert qp["w"].operand(qp["w"].weight_operand).scale.shape == (3, D, 1)
        y = jqt.quantize(gathered, qp)(jqt.pack(qp, w), x, ids)
        np.testing.assert_allclose(y, jqt.quantize(gathered, qp, simulate=True)(w, x, ids), rtol=1e-5, atol=1e-5)
    keep = jqt.Recipe(rules=(jqt.Rule(key="^w$", embedding=None),) + tuple(jqt.recipes.w8().rules))
    table = {"emb": jnp.asarray(RNG.standard_normal((10, D)), jnp.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jqt.calibrate(gathered, keep, P, [(x, ids)], progress=False)
        jqt.calibrate(lambda p, ids: p["emb"][ids], jqt.recipes.w8(), table, [(ids,)], progress=False)


def test_gptq_on_a_ragged_dot_ignores_nan_and_inf_padding_rows():
    """Rows past ``sum(group_sizes)`` reach no expert, whatever they hold (supported-ops.md:
    a NaN padding row, ``jnp.take``'s out-of-range fill, gives no NaN output): ``jqt.gptq``
    masked them by multiplying with 0, so NaN or inf ones made every Hessian NaN and it
    raised, blaming f (hunt68_moealgos). They give zero padding's weights."""
    rng = np.random.default_rng(9)
    e, d, m = 3, 32, 24
    p = {"w": jnp.asarray(rng.standard_normal((e, d, 16)) * 0.1, jnp.float32)}
    sizes = jnp.array([10, 6, 4], jnp.int32)  # 20 rows in experts, 4 padding
    x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    make = lambda fill: (lambda p, x: jax.lax.ragged_dot(
        jnp.where(jnp.arange(m)[:, None] < 20, x, fill), p["w"], sizes))
    r = jqt.recipes.w4(group_size=16)
    zero = jqt.gptq(make(0.0), jqt.calibrate(make(0.0), r, p, [(x,)], progress=False), p, [(x,)],
                    progress=False)
    for fill in (jnp.nan, jnp.inf):
        f = make(fill)
        out = jqt.gptq(f, jqt.calibrate(f, r, p, [(x,)], progress=False), p, [(x,)], progress=False)
        np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(zero["w"]))


def test_a_per_tensor_weight_type_on_ragged_dot_experts_warns_of_one_scale_for_all():
    """The einsum and vmap forms of experts warn that a per-tensor weight type gives all
    experts one scale; ``lax.ragged_dot`` said nothing while three of four experts lost 38%
    of their output (hunt68_moealgos)."""
    p = {"w": jnp.ones((3, 8, 4)).at[0].multiply(50.0)}
    x = jnp.ones((6, 8))
    f = lambda p, x: jax.lax.ragged_dot(x, p["w"], jnp.array([2, 2, 2], jnp.int32))
    rule = jqt.Rule(weight=jqt.QuantType(bits=8, per_channel=False),
                    activation=jqt.QuantType(bits=8, symmetric=False))
    with pytest.warns(UserWarning, match=r"op 'w' \(lax.ragged_dot\) reads weight 'w' of shape "
                                         r"\(3, 8, 4\): 3 experts.*one scale for all of them"):
        jqt.calibrate(f, jqt.Recipe(rules=(rule,)), p, [(x,)], progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)


def test_packed_4bit_experts_called_with_a_broadcast_size_1_batch_axis_are_refused_clearly():
    """``einsum('hd,hdk->hk', x, w)`` given an ``x`` whose ``h`` is 1 broadcasts it: a
    dot_general without the batch axis, the same key and scale shapes. 4-bit codes packed
    for the batched op failed in a reshape (TypeError; hunt72_nnxqlora): refused, named.
    Float params and int8 codes run it."""
    f = lambda b, x: jnp.einsum("hd,hdk->hk", x, b["w"])
    base = {"w": jax.random.normal(jax.random.key(0), (4, 128, 32)) * 0.05}
    x = jax.random.normal(jax.random.key(1), (4, 128))
    for recipe in (jqt.recipes.w4(group_size=32), jqt.recipes.w8()):
        qp = jqt.calibrate(f, recipe, base, [(x,)], progress=False)
        packed, q = jqt.pack(qp, base), jqt.quantize(f, qp)
        ys = jqt.quantize(f, qp, simulate=True)(base, x[:1])
        np.testing.assert_allclose(q(base, x[:1]), ys, atol=1e-5)
        if recipe.rules[0].weight.bits == 4:
            with pytest.raises(jqt.QParamsMismatchError, match=r"packed for a dot_general with batch "
                               r"axes \(0,\) of weight 'w', but here it has none.*broadcasts it"):
                q(packed, x[:1])
        else:
            np.testing.assert_allclose(q(packed, x[:1]), ys, atol=1e-5)
