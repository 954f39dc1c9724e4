"""The few-row (GEMV) formulations: the same results as every other formulation.

Each formulation is forced through a :class:`jqt.KernelPolicy`; the jaxprs show that
the one named runs, and its output equals the others' up to float rounding.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jqt
from jqt._src import gemv
from shared import all_eqns, ci_only

R = jqt.recipes
K, N = 512, 48
# every formulation of a dense op: few rows (digits, batched groups), K-chunked casts and
# one int8 matmul per group, the generic kernels, the whole-weight float matmuls, the
# GPU table's one-row sums
POLICIES = {
    "gemv": jqt.KernelPolicy(pad_rows=2, gemv_rows=8, weight_only_digits=3, grouped_digits=3,
                             batched_groups=True, weight_only_chunk=128),
    "gemv4": jqt.KernelPolicy(gemv_rows=8, weight_only_digits=4, grouped_digits=4, batched_groups=True),
    "chunks": jqt.KernelPolicy(pad_rows=2, weight_only_chunk=128),
    "generic": jqt.KernelPolicy(),
    "float_matmul": jqt.KernelPolicy(pad_rows=2, weight_only_chunk=128, float_matmul_rows=1),
    "cpu": jqt.KernelPolicy.for_backend("cpu"),
    "gpu": jqt.KernelPolicy.for_backend("gpu"),  # one row: a product summed over K (reduce_rows)
}
RECIPES = {
    "w8": R.w8(),
    "w8_asym": jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(symmetric=False, per_channel=True),
                                          activation=None),)),
    "w4_g128": R.w4(group_size=128),
    "w4_g128_asym": R.w4(group_size=128, symmetric=False),
    "w4_per_channel": R.w4(group_size=0),
    "nf4": R.nf4(group_size=64),
    "w8a8_dynamic": R.w8a8_dynamic(),
    "w4a8_g128": R.w4a8(group_size=128),
    "w4a8_g128_asym": R.w4a8(group_size=128, symmetric=False),
}


def _setup(recipe, m=1, k=K):
    f = lambda p, x: x @ p["w"]
    keys = jax.random.split(jax.random.key(0), 3)
    p = {"w": jax.random.normal(keys[0], (k, N))}
    cal = [(jax.random.normal(keys[1], (4, k)),)]
    qp = jqt.calibrate(f, recipe, p, cal, progress=False)
    x = jax.random.normal(keys[2], (m, k)).at[0, 3].set(9.0)  # an outlier channel
    return f, p, qp, x


def _dots(f, qp, packed, x, policy):
    jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(packed, x)
    return [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]


def test_digits_hold_24_bits_of_the_row_maximum():
    x = jnp.array([[1.0, -0.3, 1e-3, 2.5e-6, 0.0], [0.0] * 5, [1e-38, -3e-39, 0, 0, 0],
                   [3e38, -1e30, 1.0, 0, 0]])
    c, s = gemv.digits(x, 3)
    assert c.dtype == jnp.int8 and c.shape == (12, 5) and s.shape == (3, 4, 1)
    back = (c.reshape(3, 4, 5).astype(jnp.float32) * s).sum(0)
    bound = jnp.max(jnp.abs(x), axis=1, keepdims=True) * 2.0 ** -24
    assert bool(jnp.all(jnp.abs(back - x) <= bound)) and bool(jnp.all(jnp.isfinite(back)))
    assert not np.any(np.asarray(c.reshape(3, 4, 5)[:, 1]))  # the zero row: zero codes
    # each digit refines the one before: one digit alone is int8's error, about 2**-8
    one = c[:4].astype(jnp.float32) * s[0]
    assert float(jnp.abs(one - x)[0].max()) > 1e-4


@pytest.mark.parametrize("m", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3 rows: CI
@pytest.mark.parametrize("name", ci_only(RECIPES, {"w4_g128_asym"}))  # the others: CI
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_every_formulation_gives_the_same_result(name, m):
    f, p, qp, x = _setup(RECIPES[name], m)
    ref = jqt.quantize(f, qp, simulate=True)(p, x)
    scale = float(jnp.abs(ref).max())
    outs = {}
    for pname, policy in POLICIES.items():
        packed = jqt.pack(qp, p, policy=policy)
        outs[pname] = jax.jit(jqt.quantize(f, qp, policy=policy))(packed, x)
        np.testing.assert_allclose(outs[pname], ref, atol=2e-6 * scale, err_msg=pname)
        # the float weights give the same result under the same policy
        np.testing.assert_allclose(jqt.quantize(f, qp, policy=policy)(p, x), outs[pname],
                                   atol=2e-6 * scale, err_msg=pname)
    assert float(jnp.abs(outs["gemv"] - f(p, x)).max()) < 0.2 * scale  # and it approximates f


@pytest.mark.parametrize("name", ci_only(["w8", "w4_g128_asym", "w4_per_channel", "nf4", "w8a8_dynamic",
                                          "w4a8_g128_asym"], {"w8", "nf4"}))
@pytest.mark.slow_variants
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_gemv_formulation_under_vmap(name):
    f, p, qp, _ = _setup(RECIPES[name])
    xs = jax.random.normal(jax.random.key(5), (3, 1, K)).at[:, 0, 7].set(-6.0)
    policy = POLICIES["gemv"]
    packed = jqt.pack(qp, p, policy=policy)
    qf = jax.jit(jqt.quantize(f, qp, policy=policy))
    batched = jax.jit(jax.vmap(qf, in_axes=(None, 0)))(packed, xs)
    one_by_one = jnp.stack([qf(packed, x) for x in xs])
    chunks = jnp.stack([jqt.quantize(f, qp, policy=POLICIES["chunks"])(p, x) for x in xs])
    scale = float(jnp.abs(chunks).max())
    np.testing.assert_allclose(batched, one_by_one, atol=1e-6 * scale)
    np.testing.assert_allclose(batched, chunks, atol=2e-6 * scale)


def test_weight_only_digits_run_one_int8_matmul():
    f, p, qp, x = _setup(R.w8(), m=3)
    policy = POLICIES["gemv"]
    packed = jqt.pack(qp, p, policy=policy)
    assert packed.weights["w"].layout == "nk"
    dots = _dots(f, qp, packed, x, policy)
    assert len(dots) == 1
    a, b = (v.aval for v in dots[0].invars)
    assert (a.shape, a.dtype, b.shape, b.dtype) == ((9, K), np.int8, (N, K), np.int8)  # 3 digits x 3 rows
    # more rows than gemv_rows: the K-chunked cast, no int8 matmul
    many = jnp.ones((9, K))
    dots = _dots(f, qp, jqt.pack(qp, p, policy=POLICIES["chunks"]), many, policy)
    assert all(d.invars[0].aval.dtype == np.float32 for d in dots)


def test_grouped_weights_run_one_batched_matmul():
    f, p, qp, x = _setup(R.w4a8(group_size=128))
    policy = POLICIES["gemv"]
    packed = jqt.pack(qp, p, policy=policy)
    assert packed.weights["w"].layout == "kn"
    dots = _dots(f, qp, packed, x, policy)
    # one batched int8 dot per nibble half (even and odd rows of K), 4 groups each
    assert len(dots) == 2
    for d in dots:
        a, b = (v.aval for v in d.invars)
        assert (a.shape, a.dtype, b.shape, b.dtype) == ((4, 2, 64), np.int8, (4, 64, N), np.int8)
        assert d.params["dimension_numbers"][1] == ((0,), (0,))
    # without the few-row formulation: one int8 matmul per group and half
    plain = POLICIES["chunks"]
    assert len(_dots(f, qp, jqt.pack(qp, p, policy=plain), x, plain)) == 8


def test_many_rows_run_one_float_matmul():
    f, p, qp, _ = _setup(R.w4a8(group_size=128))
    x = jnp.ones((3, K))
    policy = POLICIES["float_matmul"]
    dots = _dots(f, qp, jqt.pack(qp, p, policy=policy), x, policy)
    assert dots and all(d.invars[0].aval.dtype == np.float32 for d in dots)
    assert not [e for e in all_eqns(jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(p, x).jaxpr)
                if e.primitive.name == "scan"]  # the whole weight at once, no K-chunks


def test_long_contractions_leave_the_digits():
    """K beyond int32's exact range for int8 x int8 leaves weight-only ops on the cast."""
    w = jqt.PackedWeight(values=jnp.zeros((4, 140_000), jnp.int8), scale=jnp.ones((4,)),
                         qtype=jqt.QuantType(per_channel=True), layout="nk")
    assert not gemv.weight_only_applies(w, 1, POLICIES["gemv"])
    assert gemv.weight_only_applies(dataclasses.replace(w, values=w.values[:, :1024]), 1, POLICIES["gemv"])
    assert not gemv.weight_only_applies(dataclasses.replace(w, values=w.values[:, :1024]), 9, POLICIES["gemv"])


def test_cpu_table_layouts():
    cpu = jqt.KernelPolicy.for_backend("cpu")
    for recipe, layout in ((R.w8(), "kn"), (R.w8a8_dynamic(), "nk"), (R.w4(group_size=128), "kn"),
                           (R.w4a8(group_size=128), "kn"), (R.nf4(), "kn")):
        f, p, qp, _ = _setup(recipe)
        assert jqt.pack(qp, p, policy=cpu).weights["w"].layout == layout


def test_gpu_table_runs_weight_only_int8_as_digits_at_2_to_4_rows():
    """The GPU table (benchmarks/results/gpu-h200.md, gpu-h100.md): w8 at one row as one
    product and sum over K (``reduce_rows``, no matmul), at 2-4 rows as 3 int8 digits
    through one int8 matmul, the whole-weight cast above; the same result as the
    simulation either way; grouped weight-only weights packed ``(N, K)`` for that sum."""
    gpu = jqt.KernelPolicy.for_backend("gpu")
    for recipe, layout in ((R.w8a8_dynamic(), "nk"), (R.w4(group_size=128), "nk"), (R.fp8(), "nk")):
        f, p, qp, _ = _setup(recipe)
        assert jqt.pack(qp, p, policy=gpu).weights["w"].layout == layout
    f, p, qp, _ = _setup(R.w8())
    packed = jqt.pack(qp, p, policy=gpu)
    assert packed.weights["w"].layout == "nk"
    for m, dtypes in ((1, []), (2, [np.int8]), (4, [np.int8]), (5, [np.float32])):
        x = jax.random.normal(jax.random.key(m), (m, K))
        assert [d.invars[0].aval.dtype for d in _dots(f, qp, packed, x, gpu)] == dtypes, m
        ref = jqt.quantize(f, qp, simulate=True)(p, x)
        np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp, policy=gpu))(packed, x), ref,
                                   atol=2e-6 * float(jnp.abs(ref).max()), err_msg=str(m))


def test_an_inf_in_a_row_gives_the_infinities_on_the_digits_path():
    """An inf in a float activation row made every output of that row NaN on the digits
    path (the GPU table at 2-4 rows: x / inf), where float and the simulated path give
    +-inf (hunt66_lowbitnumerics); a NaN row stays NaN. With zero points too: the zero
    point's product came from the row's float sum, inf - inf (hunt66_review3)."""
    gpu = jqt.KernelPolicy.for_backend("gpu")
    for recipe in (R.w8(), R.w4(group_size=0), R.w4(group_size=32), R.w4(group_size=0, symmetric=False)):
        f, p, qp, _ = _setup(recipe)
        x = jax.random.normal(jax.random.key(5), (3, K)).at[0, 3].set(jnp.inf).at[2, 1].set(jnp.nan)
        ref = jqt.quantize(f, qp, simulate=True)(p, x)
        out = jax.jit(jqt.quantize(f, qp, policy=gpu))(jqt.pack(qp, p, policy=gpu), x)
        assert np.isinf(ref[0]).any() and np.isnan(ref[2]).all()
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref[1]).max()))


BLOCKS = {  # more rows than float_matmul_rows: blocks of 16 of the 48 output channels
    "kn": jqt.KernelPolicy(pad_rows=2, weight_only_chunk=128, float_matmul_rows=2, many_rows_block=16),
    "nk": jqt.KernelPolicy(pad_rows=2, weight_only_chunk=128, float_matmul_rows=2, many_rows_block=16,
                           gemv_rows=1, weight_only_digits=3),  # w8 packed (N, K)
}


@pytest.mark.parametrize("name", ["w8"] + [  # the others: CI (the CPU table no longer decodes in blocks)
    pytest.param(n, marks=pytest.mark.slow) for n in ("w4_g128_asym", "fp8", "nf4", "w4a8_g128")])
def test_many_rows_decode_blocks_of_output_channels(name):
    f, p, qp, _ = _setup(R.fp8() if name == "fp8" else RECIPES[name])
    x = jax.random.normal(jax.random.key(3), (5, K)).at[2, 9].set(7.0)
    ref = jqt.quantize(f, qp, simulate=True)(p, x)
    scale = float(jnp.abs(ref).max())
    for layout, policy in BLOCKS.items():
        packed = jqt.pack(qp, p, policy=policy)
        out = jax.jit(jqt.quantize(f, qp, policy=policy))(packed, x)
        np.testing.assert_allclose(out, ref, atol=2e-6 * scale, err_msg=layout)
        jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(packed, x).jaxpr
        scans = [e for e in all_eqns(jaxpr) if e.primitive.name == "scan"]
        assert len(scans) == 1 and scans[0].params["length"] == N // 16, layout
        dots = [e for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
        # one float matmul per block over the whole of K (nibbles: both unpacked into it)
        assert len(dots) == 1 and dots[0].outvars[0].aval.shape == (5, 16), layout
        assert dots[0].invars[0].aval.shape[1] == K, layout
        # above whole_decode_rows: the whole weight at once, no loop
        whole = dataclasses.replace(policy, whole_decode_rows=4)
        jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=whole))(packed, x).jaxpr
        assert not [e for e in all_eqns(jaxpr) if e.primitive.name == "scan"], layout
        np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp, policy=whole))(packed, x), ref,
                                   atol=2e-6 * scale, err_msg=layout)
