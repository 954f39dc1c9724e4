"""The kernel policy: which formulation runs, and the packed layouts it relies on.

Numerical agreement of every formulation with the simulated path is checked op
by op in test_numerics.py (``POLICIES``); here the jaxprs show that the
formulation the table names is the one that runs.
"""
import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jqt
from jqt._src import native, policy

CPU = jqt.KernelPolicy.for_backend("cpu")
# the CPU table's XLA formulations: without the native kernel that runs 4-bit grouped
# weights at up to native_gemv_rows rows where it builds (test_native.py)
CPU_XLA = dataclasses.replace(CPU, native_gemv_rows=0)


def _eqns(jaxpr):
    for e in jaxpr.eqns:
        yield e
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            yield from _eqns(sub)


def _dense(recipe, k=1024, n=8, m=1):
    f = lambda p, x: x @ p["w"] + p["b"]
    p = {"w": jax.random.normal(jax.random.key(0), (k, n)), "b": jnp.zeros(n)}
    x = jax.random.normal(jax.random.key(1), (m, k))
    qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
    return f, p, x, qp, jqt.pack(qp, p)


def test_packed_layouts():
    _, _, _, _, packed = _dense(jqt.recipes.w8a8())
    w = packed.weights["w"]
    assert (w.layout, w.values.shape, w.values.dtype, w.sums.shape) == ("nk", (8, 1024), np.int8, (8,))
    # weight-only int8 on CPU: (K, N), which XLA's float matmul reads faster at many rows
    # and jqt_channel_gemv_kn at few (weight_only_kn); (N, K) without it, the same codes
    _, p, _, qp, packed = _dense(jqt.recipes.w8())
    assert (packed.weights["w"].layout, packed.weights["w"].values.shape) == ("kn", (1024, 8))
    nk = jqt.pack(qp, p, policy=dataclasses.replace(CPU, weight_only_kn=False)).weights["w"]
    assert (nk.layout, nk.values.shape) == ("nk", (8, 1024))
    np.testing.assert_array_equal(nk.values, np.asarray(packed.weights["w"].values).T)
    _, _, _, _, packed = _dense(jqt.recipes.w4(group_size=128))
    assert (packed.weights["w"].layout, packed.weights["w"].values.shape) == ("kn", (512, 8))


def test_weights_with_batch_axes_and_convs_keep_their_layout():
    f = lambda w, x: jnp.einsum("bhd,hde->bhe", x, w)
    w, x = jnp.ones((4, 6, 5)), jnp.ones((3, 4, 6))
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    assert jqt.pack(qp, w).weights["w"].layout == "operand"
    conv = lambda w, x: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    w, x = jnp.ones((3, 3, 2, 4)), jnp.ones((1, 5, 5, 2))
    qp = jqt.calibrate(conv, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    assert jqt.pack(qp, w).weights["w"].values.shape == (3, 3, 2, 4)


def test_single_row_int8_matmul_is_padded_on_cpu():
    f, _, x, qp, packed = _dense(jqt.recipes.w8a8())
    for policy, rows in ((CPU_XLA, 2), (jqt.KernelPolicy(), 1)):  # (the native kernel: test_native)
        jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(packed, x)
        dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        assert len(dots) == 1
        a, b = (v.aval for v in dots[0].invars)
        assert (a.shape, a.dtype, b.shape, b.dtype) == ((rows, 1024), np.int8, (8, 1024), np.int8)


def test_a_decode_steps_query_without_free_axes_is_padded_too():
    """``einsum("bhd,bthd->bht", q, k)`` at a decode step: the query has no free axis, so
    its int8 dot with the keys was left at one row, which XLA:CPU widened to int32 (0.82 ms
    against 0.32 ms padded at T=2048, hunt81_hloaudit). A row axis is inserted before
    its contracted one and dropped again."""
    b, h, t, d = 2, 4, 16, 8
    f = lambda p, q, k: jnp.einsum("bhd,bthd->bht", q @ p["wq"], k)
    p = {"wq": jax.random.normal(jax.random.key(0), (d, d)) * 0.3}
    q = jax.random.normal(jax.random.key(1), (b, h, d))
    k = jax.random.normal(jax.random.key(2), (b, t, h, d))
    qp = jqt.calibrate(f, jqt.recipes.w8a8_dynamic(act_x_act=True), p, [(q, k)], progress=False)
    packed = jqt.pack(qp, p, policy=CPU_XLA)
    jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=CPU_XLA))(packed, q, k)
    shapes = [tuple(v.aval.shape) for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
              for v in e.invars[:1] if v.aval.dtype == np.int8]
    assert (b, h, CPU_XLA.pad_rows, d) in shapes, shapes
    np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp, policy=CPU_XLA))(packed, q, k),
                               jqt.quantize(f, qp, simulate=True)(p, q, k), rtol=1e-5, atol=1e-5)
    # a batch-only dot (b,bt->bt: no contracted axis either) crashed the padding (hunt81_review)
    g = lambda p, x, y: lax.dot_general(x @ p["v"], y, (((), ()), ((0,), (0,))))
    pv, x, y = {"v": jnp.linspace(-1, 1, d)}, q[:, 0], k[:, :, 0, 0]
    r0 = jqt.recipes.w8a8().rules[0]  # a per-tensor dynamic act_x_act (per row, it stays float)
    per_tensor = dataclasses.replace(r0, act_x_act=dataclasses.replace(r0.activation, dynamic=True))
    qp = jqt.calibrate(g, jqt.Recipe(rules=(per_tensor,)), pv, [(x, y)], progress=False)
    assert qp["dot_general_0"].lhs is not None
    np.testing.assert_allclose(jax.jit(jqt.quantize(g, qp, policy=CPU_XLA))(jqt.pack(qp, pv, policy=CPU_XLA), x, y),
                               jqt.quantize(g, qp, simulate=True)(pv, x, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe,k_rows,kn", [pytest.param(jqt.recipes.w8(), 1024, False,  # (N, K): N-chunks (CI)
                                                           marks=pytest.mark.slow),
                                              (jqt.recipes.w8(), 256, True),  # (K, N), the CPU table's
                                              pytest.param(jqt.recipes.w4(group_size=128), 256, True,  # K-chunks
                                                           marks=pytest.mark.slow)])  # (CI)
@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_weight_only_casts_the_weight_chunk_by_chunk_on_cpu(recipe, k_rows, kn):
    # a float copy of 4 MiB, above whole_decode_bytes; more rows than gemv_rows, up to float_matmul_rows
    policy = CPU_XLA if kn else dataclasses.replace(CPU_XLA, weight_only_kn=False)
    f, p, x, qp, _ = _dense(recipe, n=1024, m=8)
    packed = jqt.pack(qp, p, policy=policy)
    assert 4 * 1024 * 1024 > CPU.whole_decode_bytes
    jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(packed, x)
    scans = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 1024 // 256
    # one float matmul per chunk, over all its rows of K (int4: both nibbles decoded into it)
    dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and dots[0].invars[0].aval.shape == (8, k_rows)
    # no float copy of the whole weight outside the loop
    casts = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "convert_element_type"
             and e.invars[0].aval.size * (2 if e.invars[0].aval.dtype == np.uint8 else 1) == 1024 * 1024]
    assert not casts
    # a weight whose float copy fits whole_decode_bytes (2 MiB) is decoded whole: no loop, one matmul
    fs, _, xs, qps, packeds = _dense(recipe, n=512, m=8)
    small = jax.make_jaxpr(jqt.quantize(fs, qps, policy=CPU_XLA))(packeds, xs)
    assert not [e for e in _eqns(small.jaxpr) if e.primitive.name == "scan"]
    assert len([e for e in _eqns(small.jaxpr) if e.primitive.name == "dot_general"]) == 1
    generic = jax.make_jaxpr(jqt.quantize(f, qp, policy=jqt.KernelPolicy()))(packed, x)
    assert not [e for e in _eqns(generic.jaxpr) if e.primitive.name == "scan"]
    ref = jqt.quantize(f, qp, policy=jqt.KernelPolicy())(packed, x)  # float sums in another order
    np.testing.assert_allclose(jqt.quantize(f, qp, policy=policy)(packed, x), ref,
                               atol=1e-5 * float(jnp.abs(ref).max()))
    # many rows: the whole weight at once, one float matmul, its codes tied to the
    # activation (an integer zero from its first element) so that XLA cannot hoist the decode
    many = jax.random.normal(jax.random.key(5), (CPU.float_matmul_rows + 1, 1024))
    for pol, tied in ((policy, True), (dataclasses.replace(policy, decode_after_input=False), False)):
        jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=pol))(packed, many)
        assert not [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"]
        assert ("jqt_tie" in {e.primitive.name for e in _eqns(jaxpr.jaxpr)}) == tied
        np.testing.assert_array_equal(jax.jit(jqt.quantize(f, qp, policy=pol))(packed, many),
                                      jax.jit(jqt.quantize(f, qp, policy=policy))(packed, many))


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_gpu_table_casts_int8_weights_to_the_activation_dtype_untied():
    """The GPU table (``decode_in_input_dtype``, ``cast_in_gemm``) under a bfloat16 activation
    at 2-64 rows: a per-channel int8 weight is cast straight to bfloat16 for one bfloat16
    matmul with float32 sums, with no tie to the activation, so that XLA:GPU's GEMM can read
    the codes and convert them in its tiles; a grouped int4 weight is decoded to bfloat16
    and keeps its tie. Both agree with the simulated path to bfloat16's rounding, and the
    int8 cast is exact: the float32 decode of the old table gives the same output to
    float32 rounding."""
    gpu = jqt.KernelPolicy.for_backend("gpu")
    old = dataclasses.replace(gpu, decode_in_input_dtype=False, cast_in_gemm=False)
    f = lambda p, x: x @ p["w"]
    p = {"w": jax.random.normal(jax.random.key(0), (256, 48), jnp.bfloat16)}
    for recipe, cast_untied in ((jqt.recipes.w8(), True), (jqt.recipes.w4(group_size=64), False)):
        x = jax.random.normal(jax.random.key(1), (64, 256), jnp.bfloat16)
        qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
        sim = np.asarray(jax.jit(jqt.quantize(f, qp, simulate=True))(p, x), np.float32)
        for rows in (2, 64):
            q = jqt.quantize(f, qp, policy=gpu)
            packed = jqt.pack(qp, p, policy=gpu)
            jaxpr = jax.make_jaxpr(q)(packed, x[:rows]).jaxpr
            names = {e.primitive.name for e in _eqns(jaxpr)}
            dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
            assert [d.invars[1].aval.dtype for d in dots] == [jnp.bfloat16], (recipe, rows)
            assert ("jqt_tie" not in names) == cast_untied, (recipe, rows)  # the tie (numerics.after)
            if cast_untied:  # the weight operand: the int8 codes, one cast
                cast = next(e for e in _eqns(jaxpr) if e.outvars[0] is dots[0].invars[1])
                assert cast.primitive.name == "convert_element_type" and cast.invars[0].aval.dtype == jnp.int8
            out = np.asarray(jax.jit(q)(packed, x[:rows]), np.float32)
            np.testing.assert_allclose(out, sim[:rows], rtol=0, atol=1e-2 * float(np.abs(sim).max()))
            if cast_untied:
                ref = jax.jit(jqt.quantize(f, qp, policy=old))(jqt.pack(qp, p, policy=old), x[:rows])
                np.testing.assert_allclose(out, np.asarray(ref, np.float32), rtol=0,
                                           atol=1e-6 * float(np.abs(ref).max()))


@pytest.mark.slow  # 4 MiB weights at three row counts: CI
@pytest.mark.parametrize("recipe", [jqt.recipes.w8(), jqt.recipes.w4(group_size=128),
                                    jqt.recipes.w4a8(group_size=128)])
def test_large_weight_keeps_its_chunks_up_to_large_weight_rows(recipe):
    # the CPU table's rule, scaled down: a float copy of 1 MiB counts as large above 512 KiB
    f, p, _, qp, packed = _dense(recipe, k=512, n=512, m=8)
    policy = dataclasses.replace(CPU, whole_decode_bytes=0, large_weight_bytes=512 << 10, large_weight_rows=96)
    assert CPU.float_matmul_rows < 96 and 4 * 512 * 512 > policy.large_weight_bytes
    loops = lambda jaxpr: [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name in ("scan", "while")]
    generic = jqt.KernelPolicy()
    for rows, chunked in ((CPU.float_matmul_rows + 1, True), (96, True), (97, False)):
        x = jax.random.normal(jax.random.key(rows), (rows, 512))
        run = jqt.quantize(f, qp, policy=policy)
        assert bool(loops(jax.make_jaxpr(run)(packed, x))) == chunked, rows
        # without the rule the weight is decoded whole above float_matmul_rows
        old = jqt.quantize(f, qp, policy=dataclasses.replace(policy, large_weight_bytes=0))
        assert not loops(jax.make_jaxpr(old)(packed, x))
        ref = jax.jit(jqt.quantize(f, qp, policy=generic))(jqt.pack(qp, p, policy=generic), x)
        np.testing.assert_allclose(jax.jit(run)(packed, x), ref, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
@pytest.mark.parametrize("recipe", [jqt.recipes.w8()] + [  # the 4-bit ones: CI
    pytest.param(r, marks=pytest.mark.slow) for r in (jqt.recipes.w4(group_size=128),
                                                      jqt.recipes.w4(group_size=64, symmetric=False))])
def test_a_wide_weight_is_decoded_in_blocks_of_output_columns(recipe):
    """A (K, N) weight whose K-chunk would decode to more than weight_only_block_bytes of
    float32 (an LM head, 512 x 50k: 1.3-1.7x float32 at 32-256 rows in K-chunks) runs
    in blocks of output columns, each decoded over all of K; a last, shorter block
    covers an N that no block divides."""
    k, n, m = 512, 1000, 8
    f, p, _, qp, _ = _dense(recipe, k=k, n=n, m=m)
    x = jax.random.normal(jax.random.key(7), (m, k))
    policy = dataclasses.replace(CPU_XLA, whole_decode_bytes=0, weight_only_block_bytes=256 << 10)
    assert 4 * CPU.weight_only_chunk * n > policy.weight_only_block_bytes  # a K-chunk: 1 MB
    packed = jqt.pack(qp, p, policy=policy)
    jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(packed, x)
    block = (256 << 10) // (4 * k)
    loops = lambda j: [e.params["length"] for e in _eqns(j.jaxpr) if e.primitive.name in ("scan", "while")]
    dots = lambda j: sorted(e.invars[1].aval.shape for e in _eqns(j.jaxpr) if e.primitive.name == "dot_general")
    assert loops(jaxpr) == [n // block]
    assert dots(jaxpr) == [(k, n % block), (k, block)]  # all of K: the loop's block, the last block
    chunked = jax.make_jaxpr(jqt.quantize(f, qp, policy=dataclasses.replace(policy, weight_only_block_bytes=0)))
    assert loops(chunked(packed, x)) == [k // CPU.weight_only_chunk]  # K-chunks of all of N
    assert [d[-1] for d in dots(chunked(packed, x))] == [n]
    generic = jqt.KernelPolicy()
    ref = jax.jit(jqt.quantize(f, qp, policy=generic))(jqt.pack(qp, p, policy=generic), x)
    np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp, policy=policy))(packed, x), ref,
                               atol=1e-5 * float(jnp.abs(ref).max()))
    # fewer columns than the smallest block (128): one block of all of them
    f, p, _, qp, _ = _dense(recipe, k=k, n=100, m=m)
    policy = dataclasses.replace(policy, weight_only_block_bytes=64 << 10)
    ref = jax.jit(jqt.quantize(f, qp, policy=generic))(jqt.pack(qp, p, policy=generic), x)
    out = jax.jit(jqt.quantize(f, qp, policy=policy))(jqt.pack(qp, p, policy=policy), x)
    np.testing.assert_allclose(out, ref, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.mark.parametrize("channels,patches", [(3, True), (32, False)])
def test_conv_formulation_follows_the_input_channels(channels, patches):
    conv = lambda w, x: lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    w = jax.random.normal(jax.random.key(0), (3, 3, channels, 8))
    x = jax.random.normal(jax.random.key(1), (2, 6, 6, channels))
    qp = jqt.calibrate(conv, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    jaxpr = jax.make_jaxpr(jqt.quantize(conv, qp, policy=CPU))(jqt.pack(qp, w), x)
    prims = [e.primitive.name for e in _eqns(jaxpr.jaxpr)]
    assert ("conv_general_dilated" not in prims) == patches
    int_dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
                and e.invars[0].aval.dtype == np.int8]
    assert len(int_dots) == (1 if patches else 0)


def test_policy_table():
    assert jqt.KernelPolicy.for_backend("cpu") == jqt.KernelPolicy(
        pad_rows=2, ragged_int_rows=256, weight_only_chunk=256, conv_patches_below=16,
        conv_codes_as_float=True, gemv_rows=4, weight_only_digits=3,
        grouped_int_rows=8, grouped_int_min_group=128, float_matmul_rows=64, whole_decode_bytes=3 << 20,
        weight_only_block_bytes=4 << 20, large_weight_bytes=32 << 20, large_weight_rows=256, batched_map=True,
        decode_in_input_dtype=policy.bfloat16_dot_is_fast(policy.cpu_flags()), native_gemv_rows=8,
        native_in_place=True, native_int8_rows=4, weight_only_kn=True, int16_as_float=True,
        int_as_bfloat16_rows=255 if policy.bfloat16_dot_is_fast(policy.cpu_flags()) else 0,
        fp8_as_bfloat16_rows=32 if policy.bfloat16_dot_is_fast(policy.cpu_flags()) else 0,
        native_decode=int(policy.native_nf4_decode_pays(policy.cpu_flags())))
    assert jqt.KernelPolicy.for_backend("gpu") == jqt.KernelPolicy(
        fp8_native=True, gemv_rows=4, weight_only_digits=3, reduce_rows=1, grouped_float=True,
        decode_in_input_dtype=True, cast_in_gemm=True)
    assert jqt.KernelPolicy.for_backend("tpu") == jqt.KernelPolicy()
    with pytest.raises(TypeError):
        jqt.KernelPolicy(2)  # keyword-only
    # each field's type and range is checked where the policy is made
    for bad, err in [(dict(weight_only_digits=-1), ValueError), (dict(gemv_rows=2.5), ValueError),
                     (dict(pad_rows=0), ValueError), (dict(native_gemv_rows=True), ValueError),
                     (dict(weight_only_kn=1), TypeError), (dict(weight_only_digits=2), ValueError),
                     (dict(grouped_digits=1), ValueError), (dict(native_decode=7), ValueError)]:
        with pytest.raises(err, match=f"KernelPolicy\\({next(iter(bad))}="):
            jqt.KernelPolicy(**bad)


def test_weight_only_int8_runs_in_the_layout_it_was_packed_in():
    # w8 packed (N, K) (files of earlier versions, or weight_only_kn=False) under the CPU
    # table, which packs (K, N): every formulation reads either, so no warning, no transpose
    f, p, x, qp, packed = _dense(jqt.recipes.w8(), k=256, n=48, m=3)
    old = jqt.pack(qp, p, policy=dataclasses.replace(CPU, weight_only_kn=False))
    assert (old.weights["w"].layout, packed.weights["w"].layout) == ("nk", "kn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = jax.jit(jqt.quantize(f, qp, policy=CPU_XLA))(old, x)
        jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=CPU_XLA))(old, x)
    assert not [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "transpose"
                and e.invars[0].aval.size == 256 * 48]  # the codes are read as they are
    want = jax.jit(jqt.quantize(f, qp, policy=CPU_XLA))(packed, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_weight_packed_for_another_policy_warns_and_still_runs():
    # w4a8 packed (N, K) by the default table (or an older file), run under the CPU
    # table, which reads (K, N): converted when traced, on every call, with a warning
    f, p, x, qp, _ = _dense(jqt.recipes.w4a8(group_size=128), k=256, n=64, m=2)
    other = jqt.pack(qp, p, policy=jqt.KernelPolicy())
    assert other.weights["w"].layout == "nk"
    with pytest.warns(UserWarning, match=r"op 'w': the weight was packed \(N, K\) .*reads it "
                                         r"\(K, N\): it is converted on every call"):
        got = jax.jit(jqt.quantize(f, qp, policy=CPU))(other, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # packed for the policy that runs it: no warning
        want = jax.jit(jqt.quantize(f, qp, policy=CPU))(jqt.pack(qp, p, policy=CPU), x)
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("recipe,converts", [(jqt.recipes.w8(), False), (jqt.recipes.w4(group_size=0), False),
                                             (jqt.recipes.w8(group_size=16), True),
                                             (jqt.recipes.w4a8(group_size=0), True)],
                         ids=["w8", "w4_g0", "w8_g16", "w4a8_g0"])
def test_which_cpu_packed_weights_the_gpu_table_converts(recipe, converts):
    """docs/export.md: a weight packed ``(K, N)`` for the CPU and run under the GPU table is
    converted on every call, with a warning, except a weight-only integer weight with one
    scale per channel (``w8``, ``w4(group_size=0)``), whose kernels read either layout;
    either way the output is the GPU-packed weight's."""
    gpu = jqt.KernelPolicy.for_backend("gpu")
    f, p, x, qp, packed = _dense(recipe, k=64, n=16, m=3)
    assert packed.weights["w"].layout == "kn"
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        y = jqt.quantize(f, qp, policy=gpu)(packed, x)
    said = any("converted on every call" in str(m.message) for m in got)
    assert said == converts, [str(m.message) for m in got]
    want = jqt.quantize(f, qp, policy=gpu)(jqt.pack(qp, p, policy=gpu), x)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_grouped_weight_with_int8_activations_on_cpu():
    """w4a8 on the CPU table, packed ``(K, N)``: a weight whose float copy fits
    ``whole_decode_bytes`` runs one float matmul on its decoded codes and the exact int8
    activation codes at any row count; a larger one runs one int8 matmul per group (and
    nibble half) up to ``grouped_int_rows`` (8) rows, and the float matmul above."""
    f, _, x9, qp, packed = _dense(jqt.recipes.w4a8(group_size=128), k=256, n=64, m=9)
    assert packed.weights["w"].layout == "kn"
    large = dataclasses.replace(CPU_XLA, whole_decode_bytes=0)
    for x in (x9[:8], x9):
        out = {}
        for policy, dtype, count in ((CPU_XLA, np.float32, 1),
                                     (large, np.int8, 4) if len(x) <= 8 else (large, np.float32, 1),
                                     # read (N, K): the nibbles unpacked when traced, one per group
                                     (dataclasses.replace(large, grouped_int_rows=0), np.int8, 2)):
            # the policy that reads (N, K) says that it converts the (K, N) packing per call
            reads_nk = count == 2
            with pytest.warns(UserWarning, match="converted on every call") if reads_nk \
                    else warnings.catch_warnings():
                if not reads_nk:
                    warnings.simplefilter("error")
                jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(packed, x)
                dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
                assert len(dots) == count and {e.invars[0].aval.dtype for e in dots} == {np.dtype(dtype)}
                out[dtype] = jax.jit(jqt.quantize(f, qp, policy=policy))(packed, x)
        np.testing.assert_allclose(out[np.float32], out[np.int8],
                                   atol=1e-5 * float(jnp.abs(out[np.int8]).max()))


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_small_groups_with_int8_activations_skip_matmuls_per_group_on_cpu():
    """``grouped_int_min_group`` (128 on the CPU table): int8 activations on int4 weights
    in groups of 32 run one float matmul on their upcast codes at every row count, a
    symbolic one (jax.export) too, where one int8 matmul per group took 1.6-7.7x
    float32 on a 4096 layer and 4.3-5.2 s to compile; groups of 128 keep their int8 matmuls per
    group up to ``grouped_int_rows`` rows. Every formulation gives the simulated result."""
    large = dataclasses.replace(CPU_XLA, whole_decode_bytes=0)  # not decoded whole for its size
    every = dataclasses.replace(large, grouped_int_min_group=0)  # before: int8 per group at any size
    batched = dataclasses.replace(large, batched_groups=True)  # one int8 dot over the groups, <= 4 rows
    for g, small in ((32, True), (128, False)):
        f, p, x, qp, _ = _dense(jqt.recipes.w4a8(group_size=g), k=256, n=64, m=8)
        sim = jax.jit(jqt.quantize(f, qp, simulate=True))(p, x)
        for pol, int_dots in ((large, not small), (every, True), (batched, not small)):
            packed, q = jqt.pack(qp, p, policy=pol), jqt.quantize(f, qp, policy=pol)
            assert packed.weights["w"].layout == "kn"
            for rows in (1, 2, 8):
                dots = [e.invars[0].aval.dtype for e in _eqns(jax.make_jaxpr(q)(packed, x[:rows]).jaxpr)
                        if e.primitive.name == "dot_general"]
                assert (jnp.int8 in dots) == int_dots, (g, pol.grouped_int_min_group, rows, dots)
                np.testing.assert_allclose(jax.jit(q)(packed, x[:rows]), sim[:rows], rtol=0,
                                           atol=2e-5 * float(jnp.abs(sim).max()))
            rows, = jax.export.symbolic_shape("m")
            lowered = jax.jit(q).trace(packed, jax.ShapeDtypeStruct((rows, 256), x.dtype)).jaxpr
            dots = [e.invars[0].aval.dtype for e in _eqns(lowered.jaxpr) if e.primitive.name == "dot_general"]
            assert (jnp.int8 in dots) == int_dots, (g, pol.grouped_int_min_group, "symbolic", dots)
    # the layout follows: the upcast codes' path reads (K, N), even where int8 matmuls per
    # group (the generic table) would read (N, K); int codes only
    generic = dataclasses.replace(jqt.KernelPolicy(), grouped_int_min_group=128)
    w8, (g32, g128) = jqt.QuantType(bits=8), (jqt.QuantType(bits=4, group_size=g) for g in (32, 128))
    assert (generic.dense_layout(g32, w8), generic.dense_layout(g128, w8)) == ("kn", "nk")
    assert not generic.small_groups(jqt.QuantType(dtype="nf4", group_size=32))


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
@pytest.mark.parametrize("rows", [pytest.param(8, marks=pytest.mark.slow), 100])  # 8: CI; N-chunks of the (N, K) weight; the whole weight
def test_bfloat16_activations_decode_per_channel_int_weights_to_bfloat16_on_cpu(rows):
    """``decode_in_input_dtype`` (the CPU table's where the CPU has AVX512_BF16): a
    weight-only op on bfloat16 activations decodes a per-channel int8 weight to bfloat16
    (exact: integer codes of 8 bits) for a bfloat16 matmul with float32 accumulation, and
    a grouped one (decoded in float32, rounded to bfloat16) above ``float_matmul_rows``
    (64) rows; float32 activations keep the float32 decode. The outputs equal the float32
    decode's to bfloat16 rounding."""
    f = lambda p, x: x @ p["w"]
    key = jax.random.key(0)
    p = {"w": (jax.random.normal(key, (512, 256)) * 0.05).astype(jnp.bfloat16)}
    x = jax.random.normal(jax.random.key(1), (rows, 512)).astype(jnp.bfloat16)
    new, old = (dataclasses.replace(CPU_XLA, decode_in_input_dtype=d) for d in (True, False))

    def dot_dtypes(recipe, x, policy):
        qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
        packed = jqt.pack(qp, p, policy=policy)
        jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=policy))(packed, x)
        dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        out = jax.jit(jqt.quantize(f, qp, policy=policy))(packed, x)
        return {str(e.invars[1].aval.dtype) for e in dots}, out

    got, y_new = dot_dtypes(jqt.recipes.w8(), x, new)
    assert got == {"bfloat16"}
    got, y_old = dot_dtypes(jqt.recipes.w8(), x, old)
    assert got == {"float32"}
    np.testing.assert_allclose(np.asarray(y_new, np.float32), np.asarray(y_old, np.float32),
                               atol=1e-2 * float(jnp.abs(y_old.astype(jnp.float32)).max()))
    assert dot_dtypes(jqt.recipes.w8(), x.astype(jnp.float32), new)[0] == {"float32"}
    got, y_new = dot_dtypes(jqt.recipes.w4(group_size=128), x, new)
    assert got == ({"bfloat16"} if rows > CPU.float_matmul_rows else {"float32"})
    y_old = dot_dtypes(jqt.recipes.w4(group_size=128), x, old)[1]
    np.testing.assert_allclose(np.asarray(y_new, np.float32), np.asarray(y_old, np.float32),
                               atol=2e-2 * float(jnp.abs(y_old.astype(jnp.float32)).max()))


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
def test_bfloat16_activations_into_float32_weights_decode_in_float32():
    """Mixed precision, bfloat16 x into a float32 weight (a float32 op): the grouped weight
    was decoded to the activation's bfloat16 above float_matmul_rows under
    decode_in_input_dtype (1.7e-3 from the simulated path, which keeps it float32)."""
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((192, 64)) * 0.1, jnp.float32)}
    f = lambda p, x: x @ p["w"]
    x = jnp.asarray(rng.standard_normal((100, 192)), jnp.bfloat16)
    policy = dataclasses.replace(CPU_XLA, decode_in_input_dtype=True)
    for recipe in (jqt.recipes.w4(group_size=32), jqt.recipes.nf4(group_size=64)):
        qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
        sim = np.asarray(jqt.quantize(f, qp, simulate=True)(p, x))
        y = np.asarray(jax.jit(jqt.quantize(f, qp, policy=policy))(jqt.pack(qp, p, policy=policy), x))
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, sim, atol=1e-5 * np.abs(sim).max())


def test_bfloat16_weight_only_conv_into_float32_keeps_nf4_values():
    """A bfloat16 convolution with preferred_element_type=float32 under a weight-only
    preset: the kernel cast the decoded weight to bfloat16, which rounds nf4's table values
    (0.72296 -> 0.72266: 1.6e-3 from the simulated path); it computes in float32 now, as
    the dense kernel does (int codes were exact either way)."""
    rng = np.random.default_rng(2)
    p = {"k": jnp.asarray(rng.standard_normal((3, 3, 4, 8)) * .2, jnp.bfloat16)}
    x = jnp.asarray(rng.standard_normal((2, 6, 6, 4)) + 1, jnp.bfloat16)
    f = lambda p, x: lax.conv_general_dilated(x, p["k"], (1, 1), "SAME", preferred_element_type=jnp.float32,
                                              dimension_numbers=("NHWC", "HWIO", "NHWC"))
    for recipe in (jqt.recipes.nf4(group_size=0), jqt.recipes.w4(group_size=0)):
        qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
        sim = np.asarray(jqt.quantize(f, qp, simulate=True)(p, x))
        y = np.asarray(jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x))
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, sim, atol=1e-5 * np.abs(sim).max())


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_bfloat16_decode_with_the_weight_on_the_left():
    """w @ x in a bfloat16 model under decode_in_input_dtype: XLA:CPU folded the
    activation's transpose into the bfloat16 dot and failed at run time ("Unsupported
    element type for DotThunk::Execute: BF16 x BF16 = F32")."""
    bf = jnp.bfloat16
    k = jax.random.split(jax.random.key(0), 3)
    p = {"w": (jax.random.normal(k[0], (48, 64)) / 8).astype(bf), "u": (jax.random.normal(k[1], (32, 48)) / 8).astype(bf)}
    f = lambda p, x: p["u"] @ jnp.tanh(p["w"] @ x)
    x = jax.random.normal(k[2], (64, 32)).astype(bf)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 32 does not divide 48: per channel
        qp = jqt.calibrate(f, jqt.recipes.w4(group_size=32), p, [(x,)], progress=False)
    sim = np.asarray(jqt.quantize(f, qp, simulate=True)(p, x), np.float32)
    policy = dataclasses.replace(CPU_XLA, decode_in_input_dtype=True)
    y = np.asarray(jax.jit(jqt.quantize(f, qp, policy=policy))(jqt.pack(qp, p, policy=policy), x), np.float32)
    np.testing.assert_allclose(y, sim, atol=2e-2 * np.abs(sim).max())


@pytest.mark.parametrize("recipe", [jqt.recipes.w8a8(), jqt.recipes.w8a8_dynamic()],
                         ids=["w8a8", "w8a8_dynamic"])
@pytest.mark.slow_variants
def test_many_row_int8_matmul_runs_as_bfloat16_codes_on_cpu(recipe):
    """``int_as_bfloat16_rows``: above 255 rows the CPU table multiplies the int8 (or
    uint8, with zero points) codes as bfloat16, which holds them exactly, with float32
    accumulation; the result equals the int32 matmul's. At 255 rows, or for a weight
    over ``large_weight_bytes``, the int8 matmul runs."""
    f, p, x, qp, _ = _dense(recipe, k=512, n=64, m=256)
    bf16 = dataclasses.replace(CPU, int_as_bfloat16_rows=255)  # the table's on AVX512_BF16 CPUs
    int8 = dataclasses.replace(CPU, int_as_bfloat16_rows=0)
    for rows, dtype in ((256, "bfloat16"), (255, "int8")):
        xr = x[:rows]
        jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=bf16))(jqt.pack(qp, p, policy=bf16), xr)
        dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
        assert {str(e.invars[0].aval.dtype) for e in dots} == {dtype}
        got = jax.jit(jqt.quantize(f, qp, policy=bf16))(jqt.pack(qp, p, policy=bf16), xr)
        want = jax.jit(jqt.quantize(f, qp, policy=int8))(jqt.pack(qp, p, policy=int8), xr)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
    # a weight whose float32 copy exceeds large_weight_bytes keeps the int8 matmul
    small_cache = dataclasses.replace(bf16, large_weight_bytes=4 * 512 * 64 - 1)
    jaxpr = jax.make_jaxpr(jqt.quantize(f, qp, policy=small_cache))(
        jqt.pack(qp, p, policy=small_cache), x)
    assert {str(e.invars[0].aval.dtype) for e in _eqns(jaxpr.jaxpr)
            if e.primitive.name == "dot_general"} == {"int8"}


@pytest.mark.parametrize("recipe,rows", [(jqt.recipes.w8a8(), 256), (jqt.recipes.w8a8(), 64),
                                         (jqt.recipes.fp8(), 64)], ids=["w8a8_bf16", "w8a8_int8", "fp8_bf16"])
def test_an_activation_transposed_in_f_keeps_its_codes_rows_first(recipe, rows):
    """``x.T @ w`` (x is (K, M)): XLA:CPU moved f's transpose past the quantization into the
    dot, whose int8 form then ran about 13x float32's time and whose bfloat16 one (the
    many-row formulations) failed on AVX512_BF16 CPUs with "Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32" (hunt81_hloaudit). The codes stay (M, K)."""
    k, n = 96, 32
    p = {"w": jax.random.normal(jax.random.key(0), (k, n)) * 0.1}
    x = jax.random.normal(jax.random.key(1), (k, rows))
    f = lambda p, x: x.T @ p["w"]
    pol = dataclasses.replace(CPU_XLA, int_as_bfloat16_rows=255, fp8_as_bfloat16_rows=32)
    qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
    packed = jqt.pack(qp, p, policy=pol)
    qf = jax.jit(jqt.quantize(f, qp, policy=pol))
    text = qf.lower(packed, x).compile().as_text()
    dots = [ln for ln in text.splitlines() if re.search(r"\bdot\(", ln)]
    assert dots and all("lhs_contracting_dims={1}" in ln for ln in dots), dots  # (M, K) codes
    np.testing.assert_allclose(qf(packed, x), jqt.quantize(f, qp, simulate=True)(p, x),
                               rtol=1e-4, atol=1e-4 * float(jnp.abs(f(p, x)).max()))


def test_bfloat16_codes_subtract_a_large_activation_zero_point_first():
    """Static asymmetric activations whose zero point is near the top code (range [-11, 0.1])
    and values near it: the raw codes' float32 sums over K = 4096 pass 2**24, and
    subtracting ``zx * sum(w)`` after them cancelled most of a rounded sum (6e-3 of the
    output against the int32 matmul, hunt54_policyfields). The codes less their zero
    point, in [-255, 255], are exact in bfloat16 and their sums stay centred."""
    k, m = 4096, 264
    f = lambda p, x: x @ p["w"]
    kw, kx = jax.random.split(jax.random.key(0))
    p = {"w": jnp.abs(jax.random.normal(kw, (k, 8))) * 0.05 + 0.05}  # positive-mean columns
    cal = jnp.concatenate([jnp.full((1, k), -11.0), jnp.full((1, k), 0.1)])
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(cal,)], progress=False)
    assert float(qp["w"].lhs.zero_point) > 120  # int8 codes: the activation's zero point near 127
    x = jax.random.uniform(kx, (m, k), minval=-0.05, maxval=0.05)
    bf16 = dataclasses.replace(CPU, int_as_bfloat16_rows=255)
    int8 = dataclasses.replace(CPU, int_as_bfloat16_rows=0)
    got = jax.jit(jqt.quantize(f, qp, policy=bf16))(jqt.pack(qp, p, policy=bf16), x)
    want = jax.jit(jqt.quantize(f, qp, policy=int8))(jqt.pack(qp, p, policy=int8), x)
    assert float(jnp.abs(got - want).max()) <= 1e-5 * float(jnp.abs(want).max())


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
@pytest.mark.parametrize("recipe", [jqt.recipes.w4(), jqt.recipes.nf4()], ids=["w4", "nf4"])
@pytest.mark.slow_variants
def test_a_weight_on_the_left_keeps_its_matmul_rows_first(recipe):
    """A dense op with the weight as the dot's lhs (output ``(N, rows)``: equinox's Linear
    under two vmaps) computes ``(rows, N)`` and transposes it: XLA:CPU folded that transpose
    into the float matmul of a decoded 4-bit weight, a dot contracting the weight's first
    axis on its slow generic path (several times float32's time, ``hunt28_speed2``)."""
    k, n, t = 256, 384, 64
    p = {"w": jax.random.normal(jax.random.key(0), (n, k)) * 0.05}
    x = jax.random.normal(jax.random.key(1), (1, t, k))
    f = lambda p, x: jnp.transpose(jax.lax.dot_general(p["w"], x, (((1,), (2,)), ((), ()))), (1, 2, 0))
    qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    text = jax.jit(jqt.quantize(f, qp)).lower(packed, x).compile().as_text()
    dots = re.findall(r"= f32\[(\d+),(\d+)\]\S* (?:dot|fusion)\(", text)
    assert (str(t), str(n)) in dots and (str(n), str(t)) not in dots, dots
    np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp))(packed, x),
                               jax.jit(jqt.quantize(f, qp, simulate=True))(p, x), rtol=0, atol=1e-4)


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_stacked_fp8_layers_are_sliced_as_bytes():
    """A scan over stacked fp8 layers at more rows than the native kernel takes: XLA:CPU
    slices fp8 by converting the operand to float16 and back, and hoisted the conversion of
    the whole stack out of the loop (a float16 copy of every layer, each call,
    ``hunt28_memory``); the layer is sliced as its bytes."""
    L, k = 3, 128
    p = {"w": jax.random.normal(jax.random.key(0), (L, k, k)) / 11}
    f = lambda p, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]
    x = jax.random.normal(jax.random.key(1), (16, k))
    qp = jqt.calibrate(f, jqt.recipes.fp8(), p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    text = jax.jit(jqt.quantize(f, qp)).lower(packed, x).compile().as_text()
    assert not re.findall(rf"(?:f16|bf16|f32)\[{L},{k},{k}\]", text)
    np.testing.assert_allclose(jax.jit(jqt.quantize(f, qp))(packed, x),
                               jax.jit(jqt.quantize(f, qp, simulate=True))(p, x), rtol=0, atol=2e-3)


def _as_the_halves_and_simulated(f, qp, p, packed, x, halves):
    """The CPU table's result (int16 codes as float32) is the halves' (``halves``) up to
    float32 sums, and the simulated path's."""
    got = jax.jit(jqt.quantize(f, qp))(packed, x)
    want = jax.jit(jqt.quantize(f, qp, policy=halves))(packed, x)
    sim = jax.jit(jqt.quantize(f, qp, simulate=True))(p, x)
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * scale)
    np.testing.assert_allclose(got, sim, rtol=0, atol=2e-5 * scale)


@pytest.mark.parametrize("m", [9, 40])
@pytest.mark.slow_variants
def test_many_row_int16_activations_run_as_float_codes_on_cpu(m):
    """``int16_as_float``: above ``native_gemv_rows`` the CPU table runs w8a16's int16
    codes whole as float32 (exact) on the decoded weight, one float matmul (two int8
    matmuls on their halves took 1.9-3.0x float32, ``benchmarks/formats.py --only
    dense``); the result is the halves' up to float32 sums, and the simulated path's."""
    f, p, x, qp, packed = _dense(jqt.recipes.w8a16(), k=384, n=64, m=m)
    halves = dataclasses.replace(CPU, int16_as_float=False)
    dots = lambda pol: [str(e.invars[0].aval.dtype) for e in _eqns(jax.make_jaxpr(
        jqt.quantize(f, qp, policy=pol))(packed, x).jaxpr) if e.primitive.name == "dot_general"]
    assert dots(CPU) == ["float32"] and dots(halves) == ["int8", "int8"]
    _as_the_halves_and_simulated(f, qp, p, packed, x, halves)


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.slow_variants
def test_int16_activations_run_convolutions_as_float_codes_on_cpu(layout):
    """``int16_as_float`` for convolutions: w8a16's int16 codes whole in one float32
    convolution (exact products, float32 sums), where their halves ran two int8 ones;
    the halves' result up to float32 sums, and the simulated path's. A conv that runs
    as a patch matmul (few input channels) keeps the halves."""
    dn = (layout, "HWIO", layout)
    f = lambda p, x: jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME", dimension_numbers=dn)
    keys = jax.random.split(jax.random.key(4), 3)
    p = {"w": jax.random.normal(keys[0], (3, 3, 24, 16)) / 9}
    shape = (2, 10, 10, 24) if layout == "NHWC" else (2, 24, 10, 10)
    x = jax.random.normal(keys[1], shape)
    qp = jqt.calibrate(f, jqt.recipes.w8a16(), p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    halves = dataclasses.replace(CPU, int16_as_float=False)
    convs = lambda pol: [str(e.invars[0].aval.dtype) for e in _eqns(jax.make_jaxpr(
        jqt.quantize(f, qp, policy=pol))(packed, x).jaxpr) if e.primitive.name == "conv_general_dilated"]
    assert convs(CPU) == ["float32"] and len(convs(halves)) == 2  # (NCHW halves: as float codes)
    _as_the_halves_and_simulated(f, qp, p, packed, x, halves)
    few = {"w": p["w"][:, :, :3]}  # 3 input channels: a patch matmul, the halves
    x3 = x[..., :3] if layout == "NHWC" else x[:, :3]
    qp3 = jqt.calibrate(f, jqt.recipes.w8a16(), few, [(x3,)], progress=False)
    if layout == "NHWC":
        assert not [e for e in _eqns(jax.make_jaxpr(jqt.quantize(f, qp3))(jqt.pack(qp3, few), x3).jaxpr)
                    if e.primitive.name in ("conv_general_dilated", "dot_general")
                    and e.invars[0].aval.dtype == jnp.int16]


@pytest.mark.parametrize("recipe", [
    jqt.recipes.fp8(), jqt.recipes.fp8(dynamic=True),
    jqt.recipes.fp8(weight_dtype="float8_e5m2", act_dtype="float8_e5m2")],
    ids=["e4m3", "e4m3_dynamic", "e5m2"])
@pytest.mark.slow_variants
def test_many_row_fp8_matmul_runs_as_bfloat16_values(recipe):
    """``fp8_as_bfloat16_rows``: above 32 rows (the CPU table's on AVX512_BF16 CPUs) an
    fp8 x fp8 matmul multiplies both operands' values as bfloat16, which holds them
    exactly, with float32 sums: the float32 path's products, summed in another order.
    At 32 rows, or for a weight over ``large_weight_bytes`` up to ``large_weight_rows``
    rows, the float32 path runs; a NaN in the activation stays NaN in its row."""
    f, p, x, qp, _ = _dense(recipe, k=384, n=96, m=33)
    bf16 = dataclasses.replace(CPU, fp8_as_bfloat16_rows=32, native_gemv_rows=0)
    f32 = dataclasses.replace(bf16, fp8_as_bfloat16_rows=0)
    dtypes = lambda pol, xr: {str(e.invars[0].aval.dtype) for e in _eqns(jax.make_jaxpr(
        jqt.quantize(f, qp, policy=pol))(jqt.pack(qp, p, policy=pol), xr).jaxpr)
        if e.primitive.name == "dot_general"}
    for rows, dtype in ((32, "float32"), (33, "bfloat16")):
        xr = x[:rows]
        assert dtypes(bf16, xr) == {dtype}
        got = jax.jit(jqt.quantize(f, qp, policy=bf16))(jqt.pack(qp, p, policy=bf16), xr)
        want = jax.jit(jqt.quantize(f, qp, policy=f32))(jqt.pack(qp, p, policy=f32), xr)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
    sim = jqt.quantize(f, qp, simulate=True)(p, x)  # the 33 rows' bfloat16 matmul
    np.testing.assert_allclose(got, sim, rtol=0, atol=1e-5 * float(jnp.abs(sim).max()))
    nan = jax.jit(jqt.quantize(f, qp, policy=bf16))(jqt.pack(qp, p, policy=bf16), x.at[3, 5].set(jnp.nan))
    assert np.isnan(nan[3]).all() and not np.isnan(np.delete(np.asarray(nan), 3, 0)).any()
    # a weight whose float32 copy exceeds large_weight_bytes: float32 K-chunks up to
    # large_weight_rows rows, bfloat16 above
    large = dataclasses.replace(bf16, large_weight_bytes=4 * 384 * 96 - 1, large_weight_rows=33)
    assert dtypes(large, x) == {"float32"}
    assert dtypes(large, jnp.concatenate([x, x])) == {"bfloat16"}


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.slow_variants
def test_fp8_as_bfloat16_near_the_float32_maximum(dynamic):
    """The bfloat16 fp8 matmul applies units and scales in the float32 path's order: an
    e5m2 weight range of 3.3e38 (its scale times e5m2's unit near float32's maximum)
    gives finite outputs, equal to the float32 path's and the simulated path's (the two
    scales' product first overflowed)."""
    e5m2 = jqt.recipes.fp8(dynamic=dynamic, weight_dtype="float8_e5m2", act_dtype="float8_e5m2")
    f = lambda p, x: x @ p["w"]
    p = {"w": (jax.random.normal(jax.random.key(0), (256, 40)) * 0.1).at[0, 3].set(3.3e38)}
    x = jax.random.normal(jax.random.key(1), (40, 256)).at[:, 0].set(1e-3)
    qp = jqt.calibrate(f, e5m2, p, [(x,)], progress=False)
    want = jqt.quantize(f, qp, simulate=True)(p, x)
    outs = []
    for rows in (32, 0):
        pol = dataclasses.replace(CPU, fp8_as_bfloat16_rows=rows, native_gemv_rows=0)
        outs.append(np.asarray(jax.jit(jqt.quantize(f, qp, policy=pol))(jqt.pack(qp, p, policy=pol), x)))
        assert np.isfinite(outs[-1]).all(), rows
        np.testing.assert_allclose(outs[-1], want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6 * float(np.abs(outs[1]).max()))


def test_fp8_as_bfloat16_under_scan_vmap_and_export():
    """The bfloat16 fp8 matmul (40 rows) inside a ``lax.scan`` over stacked layers: equal
    to the simulated path, under ``jax.vmap`` to a loop over inputs, and through
    ``jax.export`` (serialized, called back) to the jitted function."""
    k = 64
    p = {"ws": jax.random.normal(jax.random.key(0), (2, k, k)) * k ** -0.5}
    f = lambda p, x: lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["ws"])[0]
    xs = jax.random.normal(jax.random.key(1), (3, 40, k))
    qp = jqt.calibrate(f, jqt.recipes.fp8(), p, [(xs[0],)], progress=False)
    pol = dataclasses.replace(CPU, fp8_as_bfloat16_rows=32)
    packed = jqt.pack(qp, p, policy=pol)
    qf = jax.jit(jqt.quantize(f, qp, policy=pol))
    dots = [e for e in _eqns(jax.make_jaxpr(jqt.quantize(f, qp, policy=pol))(packed, xs[0]).jaxpr)
            if e.primitive.name == "dot_general"]
    assert {str(e.invars[0].aval.dtype) for e in dots} == {"bfloat16"}
    sim = jqt.quantize(f, qp, simulate=True)
    loop = jnp.stack([qf(packed, x) for x in xs])
    for x, out in zip(xs, loop):
        np.testing.assert_allclose(out, sim(p, x), rtol=0, atol=1e-5)
    vm = jax.jit(jax.vmap(jqt.quantize(f, qp, policy=pol), in_axes=(None, 0)))(packed, xs)
    np.testing.assert_allclose(vm, loop, rtol=0, atol=1e-5)
    back = jax.export.deserialize(jax.export.export(qf)(packed, xs[0]).serialize())
    np.testing.assert_allclose(back.call(packed, xs[1]), loop[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("recipe", [
    jqt.recipes.w8(), jqt.recipes.w4(group_size=64), jqt.recipes.nf4(group_size=64),
    jqt.recipes.w4a8(group_size=64), jqt.recipes.fp8(), jqt.recipes.w8a8()],
    ids=["w8", "w4_g64", "nf4_g64", "w4a8_g64", "fp8", "w8a8"])
@pytest.mark.slow_variants
def test_vmap_over_activations_decodes_each_weight_once(recipe):
    """``jax.vmap`` over activations of a weight decoded whole after its input
    (``numerics.after``; NF4: the native decode's tie operand): the tie is taken from the
    batch's first element, so the weight stays unbatched, decoded once, and each matmul
    takes the batch as more rows (a batched tie made a decoded copy per batch entry and a
    batched matmul). Equal to a loop over the inputs."""
    f, p, _, qp, _ = _dense(recipe, k=256, n=48, m=40)
    pol = dataclasses.replace(CPU, fp8_as_bfloat16_rows=32)
    packed = jqt.pack(qp, p, policy=pol)
    q = jqt.quantize(f, qp, policy=pol)
    xs = jax.random.normal(jax.random.key(3), (3, 40, 256))
    jaxpr = jax.make_jaxpr(jax.vmap(q, in_axes=(None, 0)))(packed, xs).jaxpr
    dots = [e for e in _eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(e.params["dimension_numbers"][1] == ((), ()) for e in dots)
    decodes = [e for e in _eqns(jaxpr) if e.primitive.name == "jqt_nibble_decode"]
    assert all(e.outvars[0].aval.ndim == 2 for e in decodes)
    if recipe.rules[0].weight.grid == "nf4" and native.native_status().available:
        assert len(decodes) == 1
    out = jax.jit(jax.vmap(q, in_axes=(None, 0)))(packed, xs)
    loop = jnp.stack([jax.jit(q)(packed, x) for x in xs])
    np.testing.assert_allclose(out, loop, rtol=0, atol=1e-5 * float(jnp.abs(loop).max()))
    # nested, and an empty batch (no element to tie to)
    nested = jax.jit(jax.vmap(jax.vmap(q, in_axes=(None, 0)), in_axes=(None, 0)))(packed, xs[None])
    np.testing.assert_allclose(nested[0], loop, rtol=0, atol=1e-5 * float(jnp.abs(loop).max()))
    assert jax.jit(jax.vmap(q, in_axes=(None, 0)))(packed, xs[:0]).shape == (0, 40, 48)


def _ops(jaxpr):
    """The formulation a jaxpr runs: its matmuls (operand types), jqt's primitives, pads."""
    keep = ("dot_general", "jqt_gemv", "jqt_nibble_decode", "pad", "scan", "while")
    return sorted((e.primitive.name, tuple(str(v.aval) for v in e.invars[:2]))
                  for e in _eqns(jaxpr) if e.primitive.name in keep)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
@pytest.mark.parametrize("name", ["w8a8", "w8a8_dynamic", "w8", "w4_g64", "w4a8_g64", "nf4_g64", "fp8"])
@pytest.mark.parametrize("b,m", [(64, 1), (16, 4), (4, 17)])
@pytest.mark.slow_variants
def test_vmap_over_activations_picks_the_formulation_for_all_rows(name, b, m):
    """``jax.vmap`` over activations alone: the policy picks the formulation for the
    batch's rows together (``b * m``), as one call of ``b * m`` rows does, not for one
    example's ``m``: the jaxprs run the same matmuls and kernels. Each example's rows
    decided before: at one row per example, ``w8a8`` ran the native GEMV kernel's float
    formulation over the batch instead of the int8 matmul, ``fp8`` the float32 path
    instead of the bfloat16 matmul. Equal to a loop over the examples; nested vmaps merge
    too; a vmap over the weights as well maps the op per example."""
    recipe = {"w8a8": jqt.recipes.w8a8(), "w8a8_dynamic": jqt.recipes.w8a8_dynamic(),
              "w8": jqt.recipes.w8(), "w4_g64": jqt.recipes.w4(group_size=64),
              "w4a8_g64": jqt.recipes.w4a8(group_size=64), "nf4_g64": jqt.recipes.nf4(group_size=64),
              "fp8": jqt.recipes.fp8()}[name]
    f, p, _, qp, _ = _dense(recipe, k=128, n=48, m=m)
    pol = dataclasses.replace(CPU, fp8_as_bfloat16_rows=32)  # the table's value on any CPU
    packed = jqt.pack(qp, p, policy=pol)
    q = jqt.quantize(f, qp, policy=pol)
    xs = jax.random.normal(jax.random.key(3), (b, m, 128))
    vmapped = jax.vmap(q, in_axes=(None, 0))
    one_call = lambda pk, x: q(pk, x.reshape(b * m, 128)).reshape(b, m, 48)
    jaxpr = jax.make_jaxpr(vmapped)(packed, xs).jaxpr
    assert _ops(jaxpr) == _ops(jax.make_jaxpr(one_call)(packed, xs).jaxpr)
    assert "jqt_dense_rows" not in {e.primitive.name for e in _eqns(jaxpr)}  # only under the batch trace
    loop = jnp.stack([jax.jit(q)(packed, x) for x in xs])
    tol = 1e-5 * float(jnp.abs(loop).max())
    np.testing.assert_allclose(jax.jit(vmapped)(packed, xs), loop, rtol=0, atol=tol)
    nested = jax.vmap(vmapped, in_axes=(None, 0))
    xs2 = xs.reshape(2, b // 2, m, 128) if b > 1 else xs[None]
    assert _ops(jax.make_jaxpr(nested)(packed, xs2).jaxpr) == _ops(jax.make_jaxpr(one_call)(packed, xs).jaxpr)
    np.testing.assert_allclose(jax.jit(nested)(packed, xs2).reshape(loop.shape), loop, rtol=0, atol=tol)
    two = jax.tree.map(lambda a: jnp.stack([a, a]), packed)  # weights batched too
    np.testing.assert_allclose(jax.jit(jax.vmap(q))(two, xs[:2]), loop[:2], rtol=0, atol=tol)
    # no examples, and examples of no rows (per-row scales of size 0 merged)
    assert jax.jit(vmapped)(packed, xs[:0]).shape == (0, m, 48)
    assert jax.jit(vmapped)(packed, jnp.zeros((b, 0, 128))).shape == (b, 0, 48)


@pytest.mark.parametrize("recipe,k,n,m", [
    pytest.param(jqt.recipes.w4(group_size=32, symmetric=False), 1024, 1024, 12,  # K-chunks (a 4 MiB
                 marks=pytest.mark.slow),  # float copy): CI
    (jqt.recipes.nf4(group_size=64), 256, 48, 100),  # decoded whole, many rows
    (jqt.recipes.w4a8(group_size=64), 256, 48, 70),  # int8 codes as floats, decoded whole
])
@pytest.mark.slow_variants
def test_nibbles_in_k_order_and_in_halves_agree(recipe, k, n, m):
    """Two 4-bit codes per byte decoded with K in its own order (the default) or as the
    low nibbles, then the high ones, with the activation reordered (``nibble_halves``):
    the same weight, summed in another order."""
    f, p, x, qp, packed = _dense(recipe, k=k, n=n, m=m)
    plain = dataclasses.replace(CPU, native_gemv_rows=0)
    got = jax.jit(jqt.quantize(f, qp, policy=plain))(packed, x)
    halves = jax.jit(jqt.quantize(f, qp, policy=dataclasses.replace(plain, nibble_halves=True)))(packed, x)
    np.testing.assert_allclose(got, halves, rtol=0, atol=1e-5 * float(jnp.abs(halves).max()))
    sim = jqt.quantize(f, qp, simulate=True)(p, x)
    np.testing.assert_allclose(got, sim, rtol=0, atol=1e-5 * float(jnp.abs(sim).max()))


REDUCE = dataclasses.replace(jqt.KernelPolicy.for_backend("gpu"), reduce_rows=4)


@pytest.mark.slow  # the GPU table's one-row sum for every recipe: test_gemv.py (default run)
def test_few_rows_reduce_over_k_without_a_matmul():
    """``reduce_rows``: at few rows the decoded weight times the activation is summed over K
    (one reduction, which XLA:GPU fuses with the decode); the same result as the simulated
    path, no dot_general left, and under vmap and a scan over stacked layers too. An int8
    x int8 op (w8a8_dynamic) keeps its int8 matmul."""
    k, n = 128, 16  # w4a8: int8 codes on packed nibbles; every preset at one row: test_gemv.py
    recipe = jqt.recipes.w4a8(group_size=32, symmetric=False)
    f, p, x, qp, _ = _dense(recipe, k=k, n=n, m=3)
    packed = jqt.pack(qp, p, policy=REDUCE)
    q = jqt.quantize(f, qp, policy=REDUCE)
    sim = jax.jit(jqt.quantize(f, qp, simulate=True))(p, x)  # static activation scale: rows apart
    tol = 2e-5 * float(jnp.abs(sim).max())
    for rows in (1, 3):
        np.testing.assert_allclose(jax.jit(q)(packed, x[:rows]), sim[:rows], rtol=0, atol=tol)
        prims = {e.primitive.name for e in _eqns(jax.make_jaxpr(q)(packed, x[:rows]).jaxpr)}
        assert "dot_general" not in prims and "reduce_sum" in prims
    many = jax.make_jaxpr(q)(packed, jnp.tile(x, (2, 1)))  # 6 rows: a matmul again
    assert "dot_general" in {e.primitive.name for e in _eqns(many.jaxpr)}
    np.testing.assert_allclose(jax.jit(jax.vmap(q, (None, 0)))(packed, x[:, None]), sim[:, None],
                               rtol=0, atol=tol)

    def g(ps, h):  # two stacked layers in a lax.scan
        return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ps["w"])[0]

    ps = {"w": jax.random.normal(jax.random.key(2), (2, k, k)) / 11}
    qp2 = jqt.calibrate(g, recipe, ps, [(x,)], progress=False)
    got = jax.jit(jqt.quantize(g, qp2, policy=REDUCE))(jqt.pack(qp2, ps, policy=REDUCE), x[:1])
    np.testing.assert_allclose(got, jax.jit(jqt.quantize(g, qp2, simulate=True))(ps, x[:1]), rtol=0, atol=5e-5)


@pytest.mark.slow  # the GPU table on this CPU: CI
def test_gpu_table_runs_w4a8_as_a_float_matmul_at_every_row_count():
    """``grouped_float`` (the GPU table): int8 activations on grouped int4 weights never run
    int8 matmuls per group, whose compilation aborted XLA:GPU at 2-16 rows (and which ran
    11.7x / 28.9x bfloat16 at 64 / 256 rows where it compiled: gpu-h100.md): one float
    matmul on the upcast codes (one sum over K at one row), the simulated path's result,
    under a symbolic row count (jax.export) too. Without it the same rows run int8 dots."""
    gpu = jqt.KernelPolicy.for_backend("gpu")
    old = dataclasses.replace(gpu, grouped_float=False)
    f, p, x, qp, _ = _dense(jqt.recipes.w4a8(group_size=32), k=128, n=16, m=16)
    sim = jax.jit(jqt.quantize(f, qp, simulate=True))(p, x)
    for pol, int_dots in ((gpu, False), (old, True)):
        packed, q = jqt.pack(qp, p, policy=pol), jqt.quantize(f, qp, policy=pol)
        for rows in (1, 2, 16):
            np.testing.assert_allclose(jax.jit(q)(packed, x[:rows]), sim[:rows], rtol=0,
                                       atol=2e-5 * float(jnp.abs(sim).max()))
            dots = [e.invars[0].aval.dtype for e in _eqns(jax.make_jaxpr(q)(packed, x[:rows]).jaxpr)
                    if e.primitive.name == "dot_general"]
            assert (jnp.int8 in dots) == (int_dots and rows > 1), (pol.grouped_float, rows, dots)
    packed = jqt.pack(qp, p, policy=gpu)
    rows, = jax.export.symbolic_shape("m")
    spec = jax.ShapeDtypeStruct((rows, 128), x.dtype)
    lowered = jax.jit(jqt.quantize(f, qp, policy=gpu)).trace(packed, spec).jaxpr
    assert jnp.int8 not in [e.invars[0].aval.dtype for e in _eqns(lowered.jaxpr)
                            if e.primitive.name == "dot_general"]


def test_few_rows_int8_times_int8_keeps_its_matmul_under_reduce_rows():
    f, p, x, qp, _ = _dense(jqt.recipes.w8a8_dynamic(), k=256, n=24, m=1)
    q = jqt.quantize(f, qp, policy=REDUCE)
    dots = [e for e in _eqns(jax.make_jaxpr(q)(jqt.pack(qp, p, policy=REDUCE), x).jaxpr)
            if e.primitive.name == "dot_general"]
    assert [d.invars[0].aval.dtype for d in dots] == [jnp.int8]


@pytest.mark.parametrize("spec", [("NWC", "WIO", "NWC"),
                                  pytest.param(("NCHW", "OIHW", "NCHW"), marks=pytest.mark.slow),
                                  pytest.param(("NDHWC", "DHWIO", "NDHWC"), marks=pytest.mark.slow)],
                         ids=["1d", "nchw", "3d"])
def test_int8_conv_in_other_layouts_runs_as_exact_float_convs_of_its_codes(spec):
    """``conv_codes_as_float`` (the CPU table): XLA:CPU's int8 convolution is fast in 2-D
    NHWC only (a 1-D one took 12-70x float32); in other layouts the codes run as float32
    convolutions over chunks of input channels (1-D: 2 chunks of 160 channels x 5 taps) and
    give the int8 convolution's result exactly, zero points and padding included."""
    rng = np.random.default_rng(0)
    nd = len(spec[0]) - 2
    cin = 160 if nd == 1 else 24
    k = (5,) if nd == 1 else (3,) * nd
    xs = {"NWC": (2, 12, cin), "NCHW": (2, cin, 6, 6), "NDHWC": (1, 4, 5, 5, cin)}[spec[0]]
    ws = {"WIO": k + (cin, 8), "OIHW": (8, cin) + k, "DHWIO": k + (cin, 8)}[spec[1]]
    f = lambda w, x: jax.lax.conv_general_dilated(x, w, (1,) * nd, "SAME", dimension_numbers=spec)
    w = jnp.asarray(rng.standard_normal(ws) * 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal(xs) + 0.5, jnp.float32)
    for recipe in (jqt.recipes.w8a8(), jqt.recipes.w8a8_dynamic()):
        qp = jqt.calibrate(f, recipe, w, [(x,)], progress=False)
        packed = jqt.pack(qp, w)
        outs = []
        for as_float in (True, False):
            p = dataclasses.replace(CPU, conv_codes_as_float=as_float)
            convs = [e for e in _eqns(jax.make_jaxpr(jqt.quantize(f, qp, policy=p))(packed, x).jaxpr)
                     if e.primitive.name == "conv_general_dilated"]
            kinds = {jnp.dtype(e.invars[0].aval.dtype).kind for e in convs}
            assert kinds == {"f"} if as_float else kinds <= {"i", "u"}  # float or integer codes
            if as_float and nd == 1:
                assert len(convs) in (2, 4)  # 160 input channels: 102 and 58 (and a zero point's)
            outs.append(jax.jit(jqt.quantize(f, qp, policy=p))(packed, x))
        np.testing.assert_array_equal(outs[0], outs[1])
        ys = jqt.quantize(f, qp, simulate=True)(w, x)
        np.testing.assert_allclose(outs[0], ys, atol=1e-4 * float(jnp.abs(ys).max()))


def test_int4_conv_codes_in_other_layouts_chunk_by_their_own_range():
    """The float32 chunks of ``conv_codes_as_float`` were sized for int8 weight codes
    (|q| <= 128): an int4 kernel took about 16x the chunks it needs, and a grouped conv of
    more than 57 channels per group (3x3) ran as XLA:CPU's int32 convolution, 10-30x
    slower (hunt73_conv4bit). Sized by the weight's code range (|q| <= 7), a w4a8 conv of
    2 groups of 128 channels is one float32 convolution (two with the zero point's), exact.
    An int8 kernel of 128 channels per group needs chunks: each takes the same channels of
    every group (it ran as XLA's int32 convolution, 8.3x float32's time); the outputs are
    those of the int32 convolution, bit for bit."""
    rng = np.random.default_rng(0)
    spec = ("NCHW", "OIHW", "NCHW")
    f = lambda w, x: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=spec,  # noqa: E731
                                                  feature_group_count=2)
    w = jnp.asarray(rng.standard_normal((16, 128, 3, 3)) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 256, 5, 5)) + 0.5, jnp.float32)
    outs = {}
    for name, recipe in (("w4a8", jqt.recipes.w4a8()), ("w8a8", jqt.recipes.w8a8())):
        qp = jqt.calibrate(f, recipe, w, [(x,)], progress=False)
        packed = jqt.pack(qp, w)
        convs = [e for e in _eqns(jax.make_jaxpr(jqt.quantize(f, qp, policy=CPU))(packed, x).jaxpr)
                 if e.primitive.name == "conv_general_dilated"]
        outs[name] = {jnp.dtype(e.invars[0].aval.dtype).kind for e in convs}
        y = jax.jit(jqt.quantize(f, qp, policy=CPU))(packed, x)
        ys = jqt.quantize(f, qp, simulate=True)(w, x)
        np.testing.assert_allclose(y, ys, atol=1e-5 * float(jnp.abs(ys).max()))
        int32 = dataclasses.replace(CPU, conv_codes_as_float=False)
        np.testing.assert_array_equal(y, jax.jit(jqt.quantize(f, qp, policy=int32))(packed, x))
        outs[name] = (outs[name], len(convs))
    # int8 codes: 128 channels x 9 x 255 x 127 > 2**24: three chunks of each group
    assert outs == {"w4a8": ({"f"}, 1), "w8a8": ({"f"}, 3)}


@pytest.mark.parametrize("stride,pad,length", [(2, "SAME", 0), (1, "VALID", 1), (2, "VALID", 2)])
def test_a_conv_of_few_channels_runs_to_an_empty_output(stride, pad, length):
    """A convolution of few input channels (the patch matmul on CPU) whose output has a
    spatial axis of length 0 (a sequence of length 0, one shorter than the kernel) crashed
    in JAX's slice ("limit_indices must be nonnegative"), where supported-ops.md says it
    runs to the empty output, as the float function and a 16-channel one do
    (hunt58_convexport)."""
    f = lambda p, x: jax.lax.conv_general_dilated(x, p["w"], (stride,), pad,
                                                  dimension_numbers=("NWC", "WIO", "NWC"))
    p = {"w": jax.random.normal(jax.random.key(0), (3, 4, 8)) * 0.3}
    for recipe in (jqt.recipes.w8a8(), jqt.recipes.w8a16()):
        qp = jqt.calibrate(f, recipe, p, [(jax.random.normal(jax.random.key(1), (2, 10, 4)),)], progress=False)
        x = jnp.ones((2, length, 4))
        y = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x)
        assert y.shape == f(p, x).shape == (2, 0, 8)


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
@pytest.mark.parametrize("recipe", ["w8", "w8a8", "fp8"])
def test_a_float16_dot_algorithm_does_not_reach_the_dots_over_codes(recipe):
    """A dot's ``precision=lax.DotAlgorithmPreset.F16_F16_F16``, or the same preset from
    ``jax.default_matmul_precision``, sums in float16: jqt's own dots over codes took it
    (the op's, or the global one where they had none), where codes times activations
    overflow float16 (fp8 units reach 114688) and an int8 dot in float16 gives wrong int32
    sums: inf or silently wrong outputs where float and the simulated path were finite
    (hunt72_dotprecision). jqt's dots over codes keep float32 (and int32) sums."""
    r = {"w8": jqt.recipes.w8, "w8a8": jqt.recipes.w8a8, "fp8": jqt.recipes.fp8}[recipe]()
    f16 = lax.DotAlgorithmPreset.F16_F16_F16
    rng = np.random.default_rng(0)
    p = {"w": jnp.asarray(rng.standard_normal((256, 48)) * 0.01, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((16, 256)) * 100, jnp.float32)
    conv = lambda p, x: lax.conv_general_dilated(x, p["w"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    cases = [(lambda p, x: jnp.dot(x, p["w"], precision=f16), p, x, False),
             (lambda p, x: x @ p["w"], p, x, True),
             (conv, {"w": p["w"][None]}, x[None], True)]
    for f, params, xs, globally in cases:
        qp = jqt.calibrate(f, r, params, [(xs,)], progress=False)
        for w in (params, jqt.pack(qp, params)):
            with jax.default_matmul_precision("F16_F16_F16" if globally else None):
                ys = jqt.quantize(f, qp, simulate=True)(params, xs)
                yi = jax.jit(jqt.quantize(f, qp))(w, xs)
            assert bool(jnp.isfinite(ys).all()) and bool(jnp.isfinite(yi).all()), (recipe, globally)
            assert float(jnp.max(jnp.abs(yi - ys)) / jnp.max(jnp.abs(ys))) < 3e-3, (recipe, globally)
