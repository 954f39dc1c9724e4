"""jqt's native XLA:CPU kernels (4-bit grouped and int8 per-channel weights at few rows): built where they can be,
the same results as the XLA formulations, and composing with JAX's transformations.

Each result is compared with the same quantized function under the CPU table without
the kernel (``native_gemv_rows=0``): the XLA formulation that runs where the kernel
cannot. Agreement with the simulated path, op by op, is test_formats.py's and
test_numerics.py's (the CPU table there runs the kernel at few rows).
"""
import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jqt
from jqt._src import native, nativelib
from shared import all_eqns, ci_only

R = jqt.recipes
CPU = jqt.KernelPolicy.for_backend("cpu")
XLA = dataclasses.replace(CPU, native_gemv_rows=0)
CALLS = tuple(f"custom_call @{t}(" for t in (native.GROUPED, native.CHANNEL, native.CHANNEL_KN, native.FP8_KN))


def _buildable() -> bool:
    """x86-64 with AVX2 + FMA, a C++ compiler, not disabled: where the kernel must build."""
    if os.environ.get("JQT_NATIVE", "1") == "0" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    return bool(compiler) and "avx2" in flags and "fma" in flags


needs_kernel = pytest.mark.skipif(not jqt.native_status().available,
                                  reason=f"native kernel unavailable: {jqt.native_status().reason}")


def test_the_kernel_builds_where_it_can():
    s = jqt.native_status()
    assert s.reason
    if _buildable():
        assert s.available, s.reason
        assert os.path.exists(s.library)
    else:
        assert not s.available


def _setup(recipe, k=512, n=72, m=1, seed=0):
    f = lambda p, x: x @ p["w"]
    keys = jax.random.split(jax.random.key(seed), 3)
    p = {"w": jax.random.normal(keys[0], (k, n)) / np.sqrt(k)}
    qp = jqt.calibrate(f, recipe, p, [(jax.random.normal(keys[1], (8, k)),)], progress=False)
    x = jax.random.normal(keys[2], (m, k)).at[0, 3].set(6.0)
    return f, p, qp, x


def _custom_calls(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).as_text()
    return sum(text.count(c) for c in CALLS)


def _close(a, b, rel=2e-6):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=rel * max(1.0, float(np.abs(b).max())) * 8)


CASES = {  # recipe, K, N (not a multiple of 16: the kernel's column tail), rows
    "w4_g128": (R.w4(group_size=128), 512, 72, 1),
    "w4_g32_asym": (R.w4(group_size=32, symmetric=False), 256, 40, 3),
    "w4a8_g64_asym": (R.w4a8(group_size=64, symmetric=False), 256, 24, 2),
    "nf4_g64": (R.nf4(group_size=64), 512, 72, 5),
    "w8": (R.w8(), 512, 72, 1),
    "w8_asym_k300": (jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(symmetric=False, per_channel=True),
                                                activation=None),)), 300, 40, 3),
    "int3_g32": (jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=3, group_size=32),
                                            activation=None),)), 256, 40, 8),
    "w4_per_channel": (R.w4(group_size=0), 512, 72, 2),  # one scale row: K in blocks of 256
    "nf4_per_channel_k300": (R.nf4(group_size=0), 300, 40, 3),
    "w4_per_channel_asym_k258": (R.w4(group_size=0, symmetric=False), 258, 24, 1),  # one block
    # w4a8() per channel: packed (K, N) for the kernel (it was (N, K), unpacked by XLA per call)
    "w4a8_per_channel": (R.w4a8(), 512, 72, 2),
    "w4a8_per_channel_asym_k258": (R.w4a8(symmetric=False), 258, 24, 1),
    "w4a8_per_tensor": (R.w4a8(per_channel=False), 512, 72, 3),  # one scale, read per channel
    "w4_per_tensor": (jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=4), activation=None),)),
                      256, 40, 2),
    "w4a8_per_tensor_asym": (R.w4a8(per_channel=False, symmetric=False), 258, 24, 2),
    "fp8": (R.fp8(), 512, 72, 1),  # e4m3 weights per channel, static e4m3 activations
    "fp8_e5m2_dynamic_k301": (jqt.Recipe(rules=(jqt.Rule(
        weight=jqt.QuantType(dtype="float8_e5m2", per_channel=True),
        activation=jqt.QuantType(dtype="float8_e5m2", dynamic=True)),)), 301, 40, 6),
    # N = 56: 32 columns and 16 more, which the AVX-512 kernels take as the AVX2 ones do
    "w8_n56": (R.w8(), 256, 56, 3),
    "fp8_n56": (R.fp8(), 64, 56, 2),
    "fp8_weight_only": (jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(dtype="float8_e4m3fn", per_channel=True),
                                                   activation=None),)), 256, 24, 2),
    # int8 codes (K, N) with group scales: jqt_channel_gemv_kn, each group's sums scaled
    "w8_g128": (R.w8(group_size=128), 512, 72, 1),
    "w8_g64_asym_k320": (jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(symmetric=False, group_size=64),
                                                    activation=None),)), 320, 40, 3),
    "w8a8_g64_rows6": (R.w8a8(group_size=64), 256, 40, 6),  # past native_int8_rows: groups
}


@needs_kernel
@pytest.mark.parametrize("name", ci_only(CASES, {"nf4_g64", "w8_asym_k300", "fp8", "w4_per_channel",
                                                  "w4a8_per_channel", "w4a8_per_tensor_asym",
                                                  "w8_g64_asym_k320"}))  # the others: CI
@pytest.mark.slow_variants
def test_same_results_as_the_xla_formulation(name):
    recipe, k, n, m = CASES[name]
    f, p, qp, x = _setup(recipe, k, n, m)
    packed = jqt.pack(qp, p)
    q = jqt.quantize(f, qp)
    assert _custom_calls(q, packed, x) == 1
    assert _custom_calls(jqt.quantize(f, qp, policy=XLA), packed, x) == 0
    _close(jax.jit(q)(packed, x), jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x))


@pytest.mark.slow  # a regression case kept out of the default run's 5 minutes; CI runs it
@needs_kernel
@pytest.mark.parametrize("name", ["w4_g128", "w4_g32_asym", "w8_g64_asym_k320"])  # int8 groups too
@pytest.mark.slow_variants
def test_an_infinite_activation_gives_the_infinities_of_the_xla_formulation(name):
    """A zero point taken off with the group's sum of x could give ``inf - inf = NaN``: a
    row whose group holds an infinite x (or a huge one) is computed as x times the decoded
    weight, and gives the XLA formulation's infinities (and its finite numbers near
    float32's maximum)."""
    recipe, k, n, m = CASES[name]
    f, p, qp, x = _setup(recipe, k, n, m)
    x = x.at[0, 5].set(jnp.inf)
    packed = jqt.pack(qp, p)
    want = np.asarray(jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x))
    got = np.asarray(jax.jit(jqt.quantize(f, qp))(packed, x))
    assert np.isinf(want[0]).sum() > n // 2
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    x = x.at[0, 5].set(1.0) * 1e36  # finite, but x times (code + 8) overflows
    want = np.asarray(jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x))
    got = np.asarray(jax.jit(jqt.quantize(f, qp))(packed, x))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    # every x near float32's maximum: each product finite, the sums overflow; a group summed
    # apart to +inf and the next to -inf gave NaN where XLA's running sum stays at its
    # infinity (hunt78_nativekernels)
    x = jnp.full_like(x, 3e38)
    want = np.asarray(jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x))
    got = np.asarray(jax.jit(jqt.quantize(f, qp))(packed, x))
    assert np.isinf(want[0]).sum() >= 4 and not np.isnan(want).any()
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    assert not np.isnan(got).any()
    # a weight the kernel splits into parts (K = 4096), every column positive over the first
    # half of K and negative over the second: one part's +inf and the next's -inf gave NaN
    # (hunt78_review)
    w = np.abs(np.asarray(jax.random.normal(jax.random.key(3), (4096, 72)))) / 64
    w[2048:] *= -1
    pk = {"w": jnp.asarray(w, jnp.float32)}
    qk = jqt.calibrate(f, recipe, pk, [(jax.random.normal(jax.random.key(4), (8, 4096)),)], progress=False)
    packed_k, xk = jqt.pack(qk, pk), jnp.full((1, 4096), 3e38, jnp.float32)
    want = np.asarray(jax.jit(jqt.quantize(f, qk, policy=XLA))(packed_k, xk))
    got = np.asarray(jax.jit(jqt.quantize(f, qk))(packed_k, xk))
    assert np.isposinf(want).all()
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
@needs_kernel
@pytest.mark.parametrize("name", ["w4_per_channel", "w4_g128"])
@pytest.mark.slow_variants
def test_activations_of_one_sign_stay_within_the_documented_bound(name):
    """Activations after a ReLU (all positive) at K = 4096: the 4-bit kernel sums the codes
    as ``code + 8`` and takes ``8 * sum(x)`` off after each group, which cancels, so its
    rounding error is larger than the XLA formulation's, but within docs/performance.md's
    bound: below 2e-5 of the output's scale from a float64 product of the decoded weight
    (8.1e-6 per channel and 1.7e-6 for XLA's when written), far below 4-bit rounding."""
    recipe = CASES[name][0]
    f, p, qp, _ = _setup(recipe, 4096, 24, 1)
    x = jnp.abs(jax.random.normal(jax.random.key(9), (1, 4096)))
    packed = jqt.pack(qp, p)
    w = np.asarray(jqt.quantize(f, qp, simulate=True)(p, jnp.eye(4096)), np.float64)  # one product each
    exact = np.asarray(x, np.float64) @ w
    err = lambda y: float(np.abs(np.asarray(y, np.float64) - exact).max() / np.abs(exact).max())
    native, xla = err(jax.jit(jqt.quantize(f, qp))(packed, x)), err(jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x))
    assert native < 2e-5 and xla < 2e-5, (native, xla)
    quant = float(np.abs(np.asarray(x @ p["w"], np.float64) - exact).max() / np.abs(exact).max())
    assert native < 0.01 * quant, (native, quant)  # 4-bit rounding's error, 100x larger at least


@needs_kernel
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.slow_variants
def test_zero_weights_give_exact_zeros(m):
    """The kernel takes the codes' ``+ 8`` off with the same fused multiply-adds that
    summed them: output channels whose weights are all zero (a pruned column, the
    column tail past a multiple of 16) are 0 exactly, as on the XLA path (they were
    a few ulps of x off)."""
    f, p, qp, x = _setup(R.w4(group_size=32), 256, 72, m)
    w = p["w"].at[:, 5].set(0.0).at[:, 64:].set(0.0)
    qp = jqt.calibrate(f, R.w4(group_size=32), {"w": w}, [(x,)], progress=False)
    packed = jqt.pack(qp, {"w": w})
    q = jqt.quantize(f, qp)
    assert _custom_calls(q, packed, x) == 1
    out = np.asarray(jax.jit(q)(packed, x))
    assert (out[:, 5] == 0).all() and (out[:, 64:] == 0).all() and (out[:, :5] != 0).all()


@needs_kernel
def test_fp8_nan_codes_stay_nan():
    """e4m3fn's NaN (0x7F) is no number in float16's bits, which the kernel decodes
    through: it is made a float16 NaN, so its output channel is NaN on both paths."""
    f, p, qp, x = _setup(R.fp8(), 256, 40, 2)
    packed = jqt.pack(qp, p)
    w = packed.weights["w"]
    codes = w.values.at[7, 3].set(jnp.nan).at[9, 33].set(-jnp.nan)
    packed.weights["w"] = dataclasses.replace(w, values=codes)
    q = jqt.quantize(f, qp)
    assert _custom_calls(q, packed, x) == 1
    got, want = (np.asarray(jax.jit(g)(packed, x)) for g in (q, jqt.quantize(f, qp, policy=XLA)))
    assert np.isnan(want[:, [3, 33]]).all() and np.isnan(want).sum() == 4
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    _close(np.nan_to_num(got), np.nan_to_num(want))


E5M2 = {  # e5m2 weights per channel: weight-only, and with dynamic e5m2 activations
    "weight_only": jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(dtype="float8_e5m2", per_channel=True),
                                              activation=None),)),
    "dynamic": R.fp8(dynamic=True, weight_dtype="float8_e5m2", act_dtype="float8_e5m2"),
}


@pytest.mark.parametrize("m", [2, 40])
@pytest.mark.parametrize("name", ci_only(sorted(E5M2), {"weight_only"}))  # fp8 activations: CI
@pytest.mark.slow_variants
def test_fp8_e5m2_codes_do_not_overflow_huge_activations(name, m):
    """e5m2's float16 is its top byte: its codes are up to 57344 in their own units, and
    an activation above about 6e33 times one overflowed float32 (the kernel gave NaN, the
    XLA formulation infinities) where the simulated path is finite. The codes are summed
    in units of 2^-15 (at most 1.75; the scale carries 2^15), as e4m3fn's are in units of
    2^-8: the kernel (at 2 rows) and the XLA formulations give the simulated path's numbers.
    The kernel takes the 2^-15 from x, or from each code where an x is below 2^-111 (x
    times 2^-15 would not be exact): both ways are checked."""
    f, p, qp, x = _setup(E5M2[name], 256, 40, m)
    x = x * 1e35  # |x| up to about 6e35
    for xs in (x, x.at[0, 1].set(1e-35)):
        want = np.asarray(jax.jit(jqt.quantize(f, qp, simulate=True))(p, xs))
        assert np.isfinite(want).all()
        for pol in (CPU, XLA):
            packed = jqt.pack(qp, p, policy=pol)
            q = jqt.quantize(f, qp, policy=pol)
            if pol is CPU and m <= CPU.native_gemv_rows and jqt.native_status().available:
                assert _custom_calls(q, packed, xs) == 1
            got = np.asarray(jax.jit(q)(packed, xs))
            assert np.isfinite(got).all(), (pol is CPU, int(np.isnan(got).sum()), int(np.isinf(got).sum()))
            _close(got, want, rel=1e-6)


@pytest.mark.parametrize("name", ci_only(sorted(E5M2), {"weight_only"}))  # fp8 activations: CI
def test_fp8_e5m2_weights_near_the_float32_maximum_give_finite_outputs(name):
    """The scale times e5m2's unit (2^15) is at most 0.57x the weight's largest magnitude
    (57344 / 2^15 = 1.75 is the largest code, as 448 / 2^8 is e4m3fn's): a weight range
    near 3.3e38 gives finite outputs on the kernel and the XLA formulations, as on the
    simulated path (a unit of 2^16 would make such a scale infinite)."""
    f, p, qp, x = _setup(E5M2[name], 256, 40, 2)
    p = {"w": p["w"].at[0, 3].set(3.3e38)}
    for m in (2, 40):
        xs = jnp.tile(x.at[:, 0].set(1e-3), (m // 2, 1))
        qp = jqt.calibrate(f, E5M2[name], p, [(xs,)], progress=False)
        want = np.asarray(jax.jit(jqt.quantize(f, qp, simulate=True))(p, xs))
        assert np.isfinite(want).all()
        for pol in (CPU, XLA):
            got = np.asarray(jax.jit(jqt.quantize(f, qp, policy=pol))(jqt.pack(qp, p, policy=pol), xs))
            assert np.isfinite(got).all(), (pol is CPU, m)
            _close(got, want, rel=1e-6)


@needs_kernel
def test_more_rows_than_native_gemv_rows_run_xla():
    f, p, qp, _ = _setup(R.w4(group_size=128))
    packed = jqt.pack(qp, p)
    x = jax.random.normal(jax.random.key(5), (CPU.native_gemv_rows + 1, 512))
    assert _custom_calls(jqt.quantize(f, qp), packed, x) == 0


@needs_kernel
def test_what_the_kernels_do_not_run():
    # int8 x int8 per channel above native_int8_rows
    # (XLA's int8 matmul keeps its int32 sums exact, float32 sums would not be)
    # and int8 weights with one scale per tensor (the int8 kernels read one per output
    # channel; the 4-bit kernel reads one per tensor as one per channel, all equal)
    per_tensor = jqt.Recipe(rules=(jqt.Rule(weight=jqt.QuantType(bits=8), activation=None),))
    f, p, qp, x = _setup(per_tensor)
    assert _custom_calls(jqt.quantize(f, qp), jqt.pack(qp, p), x) == 0
    f, p, qp, x = _setup(R.w8a8_dynamic(), m=CPU.native_int8_rows + 1)
    assert _custom_calls(jqt.quantize(f, qp), jqt.pack(qp, p), x) == 0


@needs_kernel
@pytest.mark.parametrize("recipe", [R.w8a8_dynamic(), R.w8a8()], ids=["dynamic", "static_asym"])
@pytest.mark.slow_variants
def test_int8_activations_through_the_channel_kernel(recipe):
    """``native_int8_rows``: w8a8 at one row runs jqt_channel_gemv on the codes
    (exact products, float32 sums): XLA's int8 matmul's result up to float rounding, and
    each stacked layer read in place."""
    pol, xla = CPU, dataclasses.replace(CPU, native_int8_rows=0)  # 1 in the CPU table
    f, p, qp, x = _setup(recipe, 256, 40, 1)
    packed = jqt.pack(qp, p, policy=pol)
    q = jqt.quantize(f, qp, policy=pol)
    assert _custom_calls(q, packed, x) == 1
    _close(jax.jit(q)(packed, x), jax.jit(jqt.quantize(f, qp, policy=xla))(packed, x), rel=1e-5)
    keys = jax.random.split(jax.random.key(3), 2)
    ps = {"w": jax.random.normal(keys[0], (3, 64, 64)) / 8}
    g = lambda ps, h: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ps["w"])[0]
    h = jax.random.normal(keys[1], (1, 64))
    qp2 = jqt.calibrate(g, recipe, ps, [(h,)], progress=False)
    out, copies = _compiled(jqt.quantize(g, qp2, policy=pol), jqt.pack(qp2, ps, policy=pol), h)
    assert copies == 0
    _close(out, jax.jit(jqt.quantize(g, qp2, policy=xla))(jqt.pack(qp2, ps), h), rel=1e-5)


@needs_kernel
@pytest.mark.parametrize("m, k, n", [(1, 301, 40), (3, 1027, 264)])
@pytest.mark.slow_variants
def test_int8_weights_in_either_layout(m, k, n):
    """w8 packed (K, N) (the CPU table, ``weight_only_kn``: jqt_channel_gemv_kn) or (N, K)
    (jqt_channel_gemv): each through its kernel, the XLA formulation's result. K not a
    multiple of the kernel's four rows per pass, N of its 16 columns; the larger weight
    (over 256 KiB) split over two threads."""
    f, p, qp, x = _setup(R.w8(), k, n, m)
    ref = jax.jit(jqt.quantize(f, qp, policy=XLA))(jqt.pack(qp, p, policy=XLA), x)
    for pol, target in ((CPU, native.CHANNEL_KN),
                        (dataclasses.replace(CPU, weight_only_kn=False), native.CHANNEL)):
        packed, q = jqt.pack(qp, p, policy=pol), jqt.quantize(f, qp, policy=pol)
        assert packed.weights["w"].layout == ("kn" if target == native.CHANNEL_KN else "nk")
        assert jax.jit(q).lower(packed, x).as_text().count(f"custom_call @{target}(") == 1
        _close(jax.jit(q)(packed, x), ref, rel=1e-5)


@needs_kernel
def test_bfloat16_activations():
    f, p, qp, x = _setup(R.w4(group_size=128))
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    packed, xb = jqt.pack(qp, p), x.astype(jnp.bfloat16)
    out = jax.jit(jqt.quantize(f, qp))(packed, xb)
    assert out.dtype == jnp.bfloat16
    assert _custom_calls(jqt.quantize(f, qp), packed, xb) == 1
    _close(out, jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, xb), rel=1e-2)


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
@needs_kernel
def test_vmap_folds_a_batch_into_rows_and_batched_weights_run_xla():
    f, p, qp, _ = _setup(R.w4(group_size=128))
    packed = jqt.pack(qp, p)
    q, ref = jqt.quantize(f, qp), jqt.quantize(f, qp, policy=XLA)
    xs = jax.random.normal(jax.random.key(3), (3, 1, 512))
    out = jax.jit(jax.vmap(q, in_axes=(None, 0)))(packed, xs)
    assert _custom_calls(jax.vmap(q, in_axes=(None, 0)), packed, xs) == 1
    _close(out, jnp.stack([ref(packed, x) for x in xs]))
    # a batch larger than native_gemv_rows rows: the XLA formulation
    xl = jax.random.normal(jax.random.key(4), (CPU.native_gemv_rows + 2, 1, 512))
    assert _custom_calls(jax.vmap(q, in_axes=(None, 0)), packed, xl) == 0
    _close(jax.jit(jax.vmap(q, in_axes=(None, 0)))(packed, xl),
           jax.vmap(ref, in_axes=(None, 0))(packed, xl))
    # a batch of packed weights (vmap over the codes too)
    two = jax.tree.map(lambda a: jnp.stack([a, a]), packed)
    _close(jax.jit(jax.vmap(q))(two, xs[:2]), jnp.stack([ref(packed, x) for x in xs[:2]]))


@needs_kernel
def test_grad_with_respect_to_the_activation():
    f, p, qp, x = _setup(R.w4(group_size=64, symmetric=False))
    packed = jqt.pack(qp, p)
    g = lambda pol: jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(jqt.quantize(f, qp, policy=pol)(packed, x)))))(x)
    _close(g(CPU), g(XLA))


@needs_kernel
def test_export_holds_no_custom_call_and_matches():
    f, p, qp, x = _setup(R.w4(group_size=128))
    packed = jqt.pack(qp, p)
    q = jax.jit(jqt.quantize(f, qp))
    exp = jax.export.export(q)(packed, x)
    assert "stablehlo.custom_call" not in exp.mlir_module()
    back = jax.export.deserialize(exp.serialize())
    _close(back.call(packed, x), q(packed, x))


@needs_kernel
@pytest.mark.slow  # the remat / cond / while composition of the kernels: CI
def test_scan_over_stacked_layers_cond_while_and_remat():
    keys = jax.random.split(jax.random.key(7), 3)
    p = {"w": jax.random.normal(keys[0], (3, 256, 256)) / 16}

    def layers(p, h):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["w"])[0]

    def f(p, x):
        h = jax.checkpoint(layers)(p, x)
        h = jax.lax.cond(h[0, 0] > 0, lambda h: layers(p, h), lambda h: -layers(p, h), h)
        return jax.lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, layers(p, c[1])), (0, h))[1]

    x = jax.random.normal(keys[1], (1, 256))
    xc = jax.random.normal(keys[2], (1, 256))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # layers are odd in h: -xc takes the other branch
        qp = jqt.calibrate(f, R.w4(group_size=64), p, [(xc,), (-xc,)], progress=False)
    packed = jqt.pack(qp, p)
    q = jqt.quantize(f, qp)
    assert _custom_calls(q, packed, x) >= 1
    _close(jax.jit(q)(packed, x), jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x), rel=1e-5)
    eqns = [e.primitive.name for e in all_eqns(jax.make_jaxpr(q)(packed, x).jaxpr)]
    assert native.gemv_p.name in eqns


@needs_kernel
def test_custom_vjp_around_the_quantized_op():
    f0, p, qp0, x = _setup(R.w4(group_size=128))

    @jax.custom_vjp
    def f(p, x):
        return x @ p["w"]

    f.defvjp(lambda p, x: (x @ p["w"], (p, x)), lambda res, g: (jax.tree.map(jnp.zeros_like, res[0]), g @ res[0]["w"].T))
    qp = jqt.calibrate(f, R.w4(group_size=128), p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    assert _custom_calls(jqt.quantize(f, qp), packed, x) == 1
    _close(jax.jit(jqt.quantize(f, qp))(packed, x), jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x))


# kernels x row tiles (1-4 rows and 5, 8), N with a tail past 32 columns (72, 40, 24)
ISA_CASES = ("w4_g128", "w4_g32_asym", "nf4_g64", "int3_g32", "w4_per_channel_asym_k258", "w8", "w8_n56",
             "w8_asym_k300", "fp8", "fp8_n56", "fp8_e5m2_dynamic_k301", "w8_g64_asym_k320")


def _isa_outputs(names):
    """name -> the jitted quantized call's output on CASES[name]'s inputs, and for each
    of DECODED's cases ("decode <name>") the whole-weight decode's at MANY rows."""
    out = {}
    for name in names:
        recipe, k, n, m = CASES[name]
        f, p, qp, x = _setup(recipe, k, n, m)
        out[name] = np.asarray(jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, p), x))
    for name, (recipe, k, n) in DECODED.items():
        f, p, qp, x = _setup(recipe, k, n, MANY)
        out[f"decode {name}"] = np.asarray(jax.jit(jqt.quantize(f, qp, policy=NDEC))(jqt.pack(qp, p), x))
    return out


@pytest.mark.slow  # a second process builds and runs every kernel: 16-18 s of the default run
@needs_kernel
def test_avx512_kernels_give_the_bits_of_the_avx2_ones(tmp_path):
    """Where the CPU has AVX-512, the 4-bit and (K, N) int8 / fp8 kernels and the 4-bit
    decode run 16 columns per instruction; each column's operations are the AVX2 loop's,
    so a process with ``JQT_NATIVE_ISA=avx2`` gives the same bits."""
    if "AVX-512" not in jqt.native_status().reason:
        pytest.skip(f"no AVX-512 kernels here: {jqt.native_status().reason}")
    code = ("import sys, numpy as np\n"
            f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "import jqt, test_native as t\n"
            "assert '(AVX2 kernels)' in jqt.native_status().reason, jqt.native_status()\n"
            f"np.savez({str(tmp_path / 'avx2.npz')!r}, **t._isa_outputs(t.ISA_CASES))\n")
    env = {**os.environ, "JQT_NATIVE_ISA": "avx2", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    avx2 = np.load(tmp_path / "avx2.npz")
    outs = _isa_outputs(ISA_CASES)
    assert set(outs) == set(avx2.files)
    for name, out in outs.items():
        np.testing.assert_array_equal(out, avx2[name], err_msg=name)


def _status_warning(var, value, *needles):
    """jqt.native_status() in a subprocess with ``var=value`` (the other switch unset): the
    warning naming ``var=`` holds ``needles``; returns the subprocess's stdout."""
    code = ("import warnings, jqt\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    s = jqt.native_status()\n"
            f"msg = [str(x.message) for x in w if {var + '='!r} in str(x.message)]\n"
            f"assert msg and all(n in msg[0] for n in {needles!r}), msg\n"
            "print('ok', s.available)\n")
    env = {**os.environ, var: value, "JAX_PLATFORMS": "cpu"}
    env.pop("JQT_NATIVE_ISA" if var == "JQT_NATIVE" else "JQT_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_an_unknown_native_switch_is_named():
    """JQT_NATIVE=disable (neither an off nor an on word) leaves the kernels on, as before,
    but now says so and how to turn them off."""
    out = _status_warning("JQT_NATIVE", "disable", "'disable'", "JQT_NATIVE=0")
    if _buildable():
        assert "ok True" in out, out


@pytest.mark.slow  # a subprocess: CI
def test_a_serialized_executable_runs_after_native_status(tmp_path):
    """A compiled function holding a native kernel, saved with serialize_executable and
    loaded in a new process: it runs once jqt.native_status() registered the kernels, as
    the docs say (hunt32_aot: without it XLA finds no handler)."""
    if not _buildable():
        pytest.skip("the kernels are not built here")
    import pickle
    from jax.experimental.serialize_executable import serialize
    f = lambda p, x: x @ p["w"]
    p = {"w": jax.random.normal(jax.random.key(0), (32, 64))}
    x = jnp.ones((1, 32))  # one row: the native kernel
    qp = jqt.calibrate(f, jqt.recipes.w8(), p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    comp = jax.jit(jqt.quantize(f, qp)).lower(packed, x).compile()
    assert "jqt_" in comp.as_text()
    (tmp_path / "exe.pkl").write_bytes(pickle.dumps(serialize(comp)))
    jqt.save_packed(str(tmp_path / "w.safetensors"), packed, qp)
    np.save(tmp_path / "ref.npy", np.asarray(comp(packed, x)))
    code = ("import pickle, sys, numpy as np, jqt\n"
            "from jax.experimental.serialize_executable import deserialize_and_load\n"
            "if sys.argv[1] == '1':\n    jqt.native_status()\n"
            "exe = deserialize_and_load(*pickle.load(open(sys.argv[2] + '/exe.pkl', 'rb')))\n"
            "out = exe(jqt.load_packed(sys.argv[2] + '/w.safetensors'), np.ones((1, 32), np.float32))\n"
            "np.testing.assert_array_equal(np.asarray(out), np.load(sys.argv[2] + '/ref.npy'))\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = lambda first: subprocess.run([sys.executable, "-c", code, first, str(tmp_path)], env=env,
                                       capture_output=True, text=True, timeout=300)
    ok = run("1")
    assert ok.returncode == 0, ok.stderr[-2000:]
    bare = run("0")  # what the docs warn of
    assert bare.returncode != 0 and "No FFI handler registered for jqt_" in bare.stderr, bare.stderr[-2000:]


@pytest.mark.slow  # a subprocess: CI
def test_an_unknown_isa_is_named_and_ignored():
    if not _buildable():
        pytest.skip("the kernels are not built here")
    assert "ok True" in _status_warning("JQT_NATIVE_ISA", "sse4", "'sse4'", "avx2")


@pytest.mark.slow  # a subprocess: CI
def test_disabled_by_environment_variable():
    code = ("import jax, jqt, numpy as np\n"
            "s = jqt.native_status(); assert not s.available and 'JQT_NATIVE' in s.reason, s\n"
            "f = lambda w, x: x @ w\n"
            "w = jax.random.normal(jax.random.key(0), (256, 32))\n"
            "qp = jqt.calibrate(f, jqt.recipes.w4(group_size=128), w, [(w[:, :1].T,)], progress=False)\n"
            "q = jax.jit(jqt.quantize(f, qp))\n"
            "assert 'jqt_grouped_gemv' not in q.lower(jqt.pack(qp, w), w[:, :1].T).as_text()\n"
            "print('ok')\n")
    env = {**os.environ, "JQT_NATIVE": "0", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow  # a subprocess: CI
def test_a_failed_build_warns_and_falls_back(tmp_path):
    code = ("import warnings, jqt\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    s = jqt.native_status()\n"
            "assert not s.available and 'failed to build' in s.reason, s\n"
            "assert 'exited with status 1 and printed nothing' in s.reason, s  # not an empty reason\n"
            "assert any('native CPU kernels are not used' in str(x.message) for x in w), w\n"
            "print('ok')\n")
    false = shutil.which("false") or "/bin/false"
    env = {**os.environ, "CXX": false, "JQT_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("JQT_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the build is only tried on x86-64")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow  # a subprocess: CI
def test_a_compiler_that_cannot_run_is_named_and_leaves_no_file(tmp_path):
    """A $CXX that is not there is named as the reason (the message blamed the cache
    directory), $CXX may carry arguments ("ccache g++" was taken as one program name),
    and the failed build leaves no temporary file in the cache directory."""
    code = ("import warnings, jqt\n"
            "with warnings.catch_warnings():\n"
            "    warnings.simplefilter('ignore')\n"
            "    print(jqt.native_status().reason)\n")
    for cxx, program in (("/nonexistent/g++", "/nonexistent/g++"), ("/nonexistent/ccache g++", "/nonexistent/ccache")):
        env = {**os.environ, "CXX": cxx, "JQT_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
        env.pop("JQT_NATIVE", None)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        if platform.machine().lower() not in ("x86_64", "amd64"):
            pytest.skip("the build is only tried on x86-64")
        assert out.returncode == 0, out.stderr[-2000:]
        assert f"the C++ compiler {cxx!r} could not be run" in out.stdout and program in out.stdout, out.stdout
        assert "JQT_CACHE_DIR" not in out.stdout
        assert os.listdir(tmp_path) == []
    # a $CXX no shell could split (an unclosed quote): native_status and every quantized
    # call raised "ValueError: No closing quotation" (hunt78_nativekernels)
    env = {**os.environ, "CXX": 'g++ "', "JQT_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("JQT_NATIVE", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "$CXX='g++ \"' is not a command line a shell could split" in out.stdout, out.stdout



@pytest.mark.slow  # subprocesses that build the kernel: CI
def test_the_cached_library_is_rebuilt_when_damaged_and_readable_by_others(tmp_path):
    """A cached library cut short (a copy or crash) killed every process with SIGBUS in
    dlopen, and an empty one was never rebuilt; the library was written mode 0600-based
    (0711), so other users of a shared cache could not load it; ``JQT_CACHE_DIR="~/..."``
    made a folder named ``~`` in the working directory."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the build is only tried on x86-64")
    code = "import jqt; print(jqt.native_status().reason)"
    env = {**os.environ, "JQT_CACHE_DIR": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    env.pop("JQT_NATIVE", None)
    run = lambda e=env: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                                       text=True, timeout=600, cwd=tmp_path)
    out = run()
    assert out.returncode == 0 and "built with" in out.stdout, out.stderr[-2000:]
    lib = next(tmp_path.glob("grouped_gemv-*.so"))
    assert lib.stat().st_mode & 0o044 == 0o044, oct(lib.stat().st_mode)  # others may read it
    data = lib.read_bytes()
    for cut in (0, 1000, len(data) // 2):
        lib.write_bytes(data[:cut])
        out = run()
        assert out.returncode == 0 and "built with" in out.stdout, (cut, out.returncode, out.stderr[-2000:])
        assert lib.read_bytes() == data
    home = tmp_path / "home"
    home.mkdir()
    out = run({**env, "HOME": str(home), "JQT_CACHE_DIR": "~/jqtcache"})
    assert out.returncode == 0 and str(home / "jqtcache") in out.stdout, out.stdout + out.stderr[-2000:]
    assert not (tmp_path / "~").exists()


@needs_kernel
def test_a_library_cut_short_or_unreadable_is_told_apart_before_dlopen(tmp_path, monkeypatch):
    """``dlopen`` of a library cut short kills the process with SIGBUS: a cached one with no
    digest beside it was loaded unchecked where the rebuild failed; and a cache this user
    cannot read (a container's user under root's 0700 home) raised a bare PermissionError
    out of native_status and every packed few-row matmul (hunt80_nativebuild)."""
    data = open(jqt.native_status().library, "rb").read()
    whole = tmp_path / "whole.so"
    whole.write_bytes(data)
    assert nativelib._elf_whole(whole)
    for cut in (0, 63, 20000, len(data) // 2, len(data) - 1):
        whole.write_bytes(data[:cut])
        assert not nativelib._elf_whole(whole), cut

    def unreadable(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(type(tmp_path), "exists", unreadable)
    with pytest.raises(nativelib._BuildError, match=r"could not read the cached library .*x\.so: "
                       r".*Permission denied.*set JQT_CACHE_DIR to a folder of your own"):
        nativelib._intact(tmp_path / "x.so")


@needs_kernel
def test_only_a_library_the_compiler_got_wrong_blames_the_compiler(tmp_path, monkeypatch):
    """A freshly built library that does not load for want of symbols (``CXX=gcc``) names
    $CXX and is not cached; one that does not load for another reason (a cache folder
    mounted noexec: "failed to map segment") was blamed on the compiler too and rebuilt in
    every process: it is cached, and its load error names the folder (hunt80_review)."""
    lib = tmp_path / "lib.so"
    lib.write_bytes(open(jqt.native_status().library, "rb").read())
    nativelib._loads(["c++"], str(lib))  # a good library: no error

    def failing(msg):
        def cdll(path, *a, **k):
            raise OSError(f"{path}: {msg}")
        return cdll
    monkeypatch.setattr(nativelib.ctypes, "CDLL", failing("undefined symbol: _ZTVN10__cxxabiv1"))
    with pytest.raises(nativelib._BuildError, match=r"c\+\+ exited 0 but built a library that does "
                       r"not load .*undefined symbol.*is \$CXX a C\+\+ compiler"):
        nativelib._loads(["c++"], str(lib))
    monkeypatch.setattr(nativelib.ctypes, "CDLL", failing("failed to map segment from shared object"))
    nativelib._loads(["c++"], str(lib))  # left to _build's load, whose error names the folder


@pytest.mark.slow  # subprocesses: CI
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to pin one process to one")
def test_the_kernels_give_the_same_bits_on_any_thread_count():
    """The kernels split K over a number of parts that followed XLA's thread count, and
    the parts' sums are added in order: one compiled executable (a persistent compilation
    cache's, a serialized one) gave other bits on a machine of other cores
    (hunt80_compilecache). The parts follow from the shape alone."""
    if not _buildable():
        pytest.skip("the kernels are not built here")
    code = ("import os, sys\n"
            "if sys.argv[1] == 'one': os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "import hashlib, jax, jax.numpy as jnp, numpy as np, jqt\n"
            "assert jqt.native_status().available\n"
            "f = lambda w, x: x @ w\n"
            "out = []\n"
            "for r, (k, n) in ((jqt.recipes.w4(), (2048, 512)), (jqt.recipes.w8(), (2048, 512)),\n"
            "                  (jqt.recipes.nf4(), (2048, 512)), (jqt.recipes.fp8(), (2048, 512))):\n"
            "    w = jax.random.normal(jax.random.key(0), (k, n)) * 0.05\n"
            "    x = jax.random.normal(jax.random.key(1), (1, k))\n"
            "    qp = jqt.calibrate(f, r, w, [(x,)], progress=False)\n"
            "    out.append(np.asarray(jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w), x)))\n"
            "print(os.cpu_count(), len(os.sched_getaffinity(0)), hashlib.sha256(np.concatenate(out).tobytes()).hexdigest())\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JQT_NATIVE", None)
    got = [subprocess.run([sys.executable, "-c", code, how], env=env, capture_output=True, text=True,
                          timeout=600) for how in ("all", "one")]
    for out in got:
        assert out.returncode == 0, out.stderr[-2000:]
    (_, n_all, h_all), (_, n_one, h_one) = (o.stdout.split() for o in got)
    assert int(n_one) == 1 < int(n_all)
    assert h_all == h_one


@pytest.mark.slow  # subprocesses that build the kernel: CI
def test_what_a_failed_rebuild_leaves_is_not_loaded_unchecked(tmp_path):
    """A compiler that exits 0 without a library (``CXX=true``) or with one that does not
    load (``CXX=gcc``: no C++ runtime) had its output cached, and the message's advice,
    delete it, rebuilt the same; a cached library with no digest, cut short, was loaded
    where the rebuild failed (SIGBUS), and another library under its name raised
    AttributeError (hunt80_nativebuild)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the build is only tried on x86-64")
    code = "import warnings, jqt\nwarnings.simplefilter('ignore')\nprint(jqt.native_status().reason)"
    run = lambda cache, **e: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
        env={**{k: v for k, v in os.environ.items() if k != "JQT_NATIVE"}, "JQT_CACHE_DIR": str(cache),
             "JAX_PLATFORMS": "cpu", **e})
    true = shutil.which("true") or "/bin/true"
    (tmp_path / "t").mkdir()
    out = run(tmp_path / "t", CXX=true)
    assert out.returncode == 0 and "exited 0 but wrote no whole shared library (0 bytes): is $CXX " \
        "a C++ compiler" in out.stdout, out.stdout + out.stderr[-2000:]
    assert os.listdir(tmp_path / "t") == []  # nothing cached
    if shutil.which("gcc"):
        out = run(tmp_path / "t", CXX="gcc")
        assert out.returncode == 0 and "exited 0 but built a library that does not load (" in out.stdout \
            and "undefined symbol" in out.stdout, out.stdout + out.stderr[-2000:]
        assert os.listdir(tmp_path / "t") == []
    # a build killed before its finally ran (SIGKILL) left its temporary file for good: a
    # later build removes those older than any build still running (hunt80_concurrency)
    (tmp_path / "good").mkdir()
    dead, live = tmp_path / "good" / ".grouped_gemv-0.dead.tmp", tmp_path / "good" / ".grouped_gemv-0.live.tmp"
    dead.write_bytes(b"x")
    live.write_bytes(b"x")
    os.utime(dead, (dead.stat().st_atime, dead.stat().st_mtime - 7200))
    out = run(tmp_path / "good")
    assert out.returncode == 0 and "built with" in out.stdout, out.stderr[-2000:]
    assert not dead.exists() and live.exists()
    live.unlink()
    lib = next((tmp_path / "good").glob("grouped_gemv-*.so"))
    data = lib.read_bytes()
    os.unlink(f"{lib}.sha256")  # as an earlier jqt left it
    bad = tmp_path / "badinc"  # the rebuild fails under the same cache key
    bad.mkdir()
    (bad / "cstdint").write_text("#error a broken toolchain\n")
    lib.write_bytes(data[:20000])
    out = run(tmp_path / "good", CPLUS_INCLUDE_PATH=str(bad))
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7: SIGBUS
    assert f"the cached library {lib} is cut short" in out.stdout, out.stdout
    zlib = next((p for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64")
                 for p in sorted(__import__("glob").glob(f"{d}/libz.so*"))), None)
    if zlib is not None:  # another whole library under its name
        shutil.copyfile(zlib, lib)
        out = run(tmp_path / "good", CPLUS_INCLUDE_PATH=str(bad))
        assert out.returncode == 0 and f"{lib} is not a library of jqt's kernels" in out.stdout, \
            out.stdout + out.stderr[-2000:]
    lib.write_bytes(data)  # whole, with no digest: loaded as it is
    out = run(tmp_path / "good", CPLUS_INCLUDE_PATH=str(bad))
    assert out.returncode == 0 and "built with" in out.stdout, out.stdout + out.stderr[-2000:]


# ---- layers of stacked weights read in place (``layerview.py``, ``native_in_place``) -------------

COPIED = dataclasses.replace(CPU, native_in_place=False)


def _compiled(fn, *args):
    """``(outputs, copies)`` of ``jax.jit(fn)`` compiled once: its outputs on ``args`` and
    how many of its operations copy a layer's integer codes out of a stack (a dynamic
    slice, fused or not, whose result is a 2-D int8 / uint8 array)."""
    c = jax.jit(fn).lower(*args).compile()
    copies = sum(1 for line in c.as_text().splitlines()
                 if ("dynamic-slice" in line or "dynamic_slice" in line)
                 and re.search(r"=\s*[us]8\[\d+,\d+\]", line))
    return c(*args), copies


STACKED = {  # recipe, rows, scan in reverse
    "w4_g64": (R.w4(group_size=64), 1, False),
    "w4_g32_asym": (R.w4(group_size=32, symmetric=False), 2, False),
    "nf4_g64": (R.nf4(group_size=64), 1, True),
    "w4a8_g64": (R.w4a8(group_size=64), 3, False),
    "w8": (R.w8(), 1, True),
    "w4_per_channel": (R.w4(group_size=0), 2, False),
    "w8_g64": (R.w8(group_size=64), 2, False),
}


@needs_kernel
@pytest.mark.parametrize("name", ci_only(STACKED, {"w4_g64"}))  # int4 and nf4 (w4a8 reads the same
# kernel): CI
@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_scan_reads_each_layer_in_place(name):
    recipe, m, reverse = STACKED[name]
    keys = jax.random.split(jax.random.key(11), 4)
    p = {"up": jax.random.normal(keys[0], (3, 128, 192)) / 11,
         "down": jax.random.normal(keys[1], (3, 192, 128)) / 14}

    def f(p, x):
        def layer(h, w):
            return h + jnp.tanh(h @ w[0]) @ w[1], None
        return jax.lax.scan(layer, x, (p["up"], p["down"]), reverse=reverse)[0]

    qp = jqt.calibrate(f, recipe, p, [(jax.random.normal(keys[2], (m, 128)),)], progress=False)
    packed, x = jqt.pack(qp, p), jax.random.normal(keys[3], (m, 128))
    q = jqt.quantize(f, qp)
    assert _custom_calls(q, packed, x) == 2
    out, copies = _compiled(q, packed, x)
    copied, copies_before = _compiled(jqt.quantize(f, qp, policy=COPIED), packed, x)
    assert copies == 0 and copies_before > 0
    _close(out, copied, rel=1e-5)


@pytest.mark.slow  # nested scans: CI
@needs_kernel
def test_nested_scans_index_the_stack_in_place():
    """A loop over steps holding the scan over layers (a decode loop), and a weight that
    two nested scans slice ``(A, L, K, N)``: the kernels read the stack in place."""
    keys = jax.random.split(jax.random.key(12), 4)
    p = {"w": jax.random.normal(keys[0], (3, 128, 128)) / 11,
         "blocks": jax.random.normal(keys[1], (2, 3, 128, 128)) / 11}

    def f(p, x):
        def step(h, _):
            h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["w"])[0]
            return h, h[:, 0]

        h, ys = jax.lax.scan(step, x, None, length=2)
        h = jax.lax.scan(lambda h, b: (jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, b)[0], None),
                         h, p["blocks"])[0]
        return h, ys

    qp = jqt.calibrate(f, R.w4(group_size=64), p, [(jax.random.normal(keys[2], (1, 128)),)],
                       progress=False)
    packed, x = jqt.pack(qp, p), jax.random.normal(keys[3], (1, 128))
    q = jqt.quantize(f, qp)
    assert _custom_calls(q, packed, x) == 2
    out, copies = _compiled(q, packed, x)
    assert copies == 0
    for a, b in zip(out, jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x)):
        _close(a, b, rel=1e-5)


@needs_kernel
@pytest.mark.slow  # CI
def test_stacked_kernel_operands_clamp_the_layer_and_batch():
    """``jqt_gemv`` on stacked codes: the layer clamped as ``lax.dynamic_index_in_dim``
    clamps it; vmap over activations folds rows; jvp differentiates the formulation."""
    f, p, qp, x = _setup(R.w4(group_size=64, symmetric=False), k=256, n=40, m=2)
    w = jqt.pack(qp, p).weight("w")
    stack = jax.tree.map(lambda a: jnp.stack([a, 2 * a, 3 * a]) if a.dtype != jnp.uint8
                         else jnp.stack([a, a, a]), w)
    view = jqt._src.layerview.LayerView(stack, ())
    for i, want in ((-3, 0), (1, 1), (7, 2)):
        got = jax.jit(lambda x, i: native.dense_rows(x, view.at(i).sliced, CPU, view.at(i)))(x, i)
        ref = native.dense_rows(x, jax.tree.map(lambda a: a[want], stack), XLA)
        _close(got, ref)
    fn = lambda x: native.dense_rows(x, view.at(1).sliced, CPU, view.at(1))
    xs = jnp.stack([x, -x])
    _close(jax.jit(jax.vmap(fn))(xs), jnp.stack([fn(x), fn(-x)]))
    t = jnp.ones_like(x)
    _close(jax.jvp(fn, (x,), (t,))[1], fn(t) - fn(jnp.zeros_like(x)))


@needs_kernel
def test_export_of_a_scan_over_stacked_layers_slices_in_xla():
    keys = jax.random.split(jax.random.key(13), 3)
    p = {"w": jax.random.normal(keys[0], (3, 128, 128)) / 11}
    f = lambda p, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]
    qp = jqt.calibrate(f, R.w4(group_size=64), p, [(jax.random.normal(keys[1], (1, 128)),)],
                       progress=False)
    packed, x = jqt.pack(qp, p), jax.random.normal(keys[2], (1, 128))
    exp = jax.export.export(jax.jit(jqt.quantize(f, qp)))(packed, x)
    assert "stablehlo.custom_call" not in exp.mlir_module()
    _close(exp.call(packed, x), jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x), rel=1e-5)


# ---- whole weights decoded by the native kernel (``nibbledecode.py``, ``native_decode``) ---------

NDEC = dataclasses.replace(CPU, native_decode=2)  # NF4 and int codes
XDEC = dataclasses.replace(CPU, native_decode=0)  # XLA's decode
DECODE_CALL = f"custom_call @{nativelib.DECODE}("
MANY = CPU.native_gemv_rows + 5  # rows: above the few-row kernels, the weight decoded whole
DECODED = {  # recipe, K, N (not a multiple of 8: the kernel's column tail)
    "nf4_g64": (R.nf4(group_size=64), 256, 44),
    "w4_g32_asym": (R.w4(group_size=32, symmetric=False), 128, 40),
    "w4a8_g64_asym": (R.w4a8(group_size=64, symmetric=False), 128, 24),
    "w4_per_channel_asym": (R.w4(group_size=0, symmetric=False), 130, 24),
    "nf4_per_channel_k300": (R.nf4(group_size=0), 300, 20),
}


def _decode_calls(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count(DECODE_CALL)


@needs_kernel
@pytest.mark.parametrize("name", ci_only(DECODED, {"nf4_g64", "nf4_per_channel_k300"}))  # int codes: CI
@pytest.mark.slow_variants
def test_native_decode_gives_the_bits_of_xlas_decode(name):
    """The kernel's decode is XLA's float32 operations in the same order: the outputs of
    the op (one float matmul of the decoded weight) are equal, not only close."""
    recipe, k, n = DECODED[name]
    f, p, qp, x = _setup(recipe, k, n, MANY)
    packed = jqt.pack(qp, p)
    q, ref = jqt.quantize(f, qp, policy=NDEC), jqt.quantize(f, qp, policy=XDEC)
    assert _decode_calls(q, packed, x) == 1
    assert _decode_calls(ref, packed, x) == 0
    np.testing.assert_array_equal(np.asarray(jax.jit(q)(packed, x)), np.asarray(jax.jit(ref)(packed, x)))


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
@needs_kernel
def test_native_decode_waits_for_the_input_without_copying_the_codes():
    """The decode depends on the op's activation (XLA must not hoist every weight's decode
    to the program's start) through an operand of the custom call, its first element,
    which the kernel does not read: the codes reach the kernel as they are, where the
    integer zero added to them (``numerics.after``, which XLA's own decode fuses) took a
    pass of its own. Where the op lowers to XLA's decode (``jax.export``, SPMD programs)
    that zero is added from the operand, so the dependency stays."""
    f, p, qp, x = _setup(R.nf4(group_size=64), 128, 24, MANY)
    packed = jqt.pack(qp, p)
    exported = jax.export.export(jax.jit(jqt.quantize(f, qp, policy=NDEC)))(packed, x)
    assert "count_leading_zeros" in exported.mlir_module()  # numerics.after's zero
    for pol, tied in ((CPU, True), (dataclasses.replace(CPU, decode_after_input=False), False)):
        q = jqt.quantize(f, qp, policy=dataclasses.replace(pol, native_decode=1))
        eqn, = [e for e in all_eqns(jax.make_jaxpr(q)(packed, x).jaxpr) if e.primitive.name == "jqt_nibble_decode"]
        assert eqn.invars[-1].aval.shape == ((1,) if tied else (0,))
        text = jax.jit(q).lower(packed, x).compile().as_text()
        call, = [ln for ln in text.splitlines() if "custom-call(" in ln and "jqt_nibble_decode" in ln]
        assert not re.search(r"= u8\[[\d,]*\]\{[\d,]*\} fusion\(", text)  # no pass over the codes
        assert "constant" not in call.split("custom-call(")[1].split(")")[0].split(",")[-1] or not tied
        np.testing.assert_array_equal(np.asarray(jax.jit(q)(packed, x)),
                                      np.asarray(jax.jit(jqt.quantize(f, qp, policy=XDEC))(packed, x)))


@needs_kernel
@pytest.mark.slow  # which ops take the decode: CI (the default run keeps its results and composition)
def test_native_decode_levels_and_what_it_does_not_run():
    f, p, qp, x = _setup(R.nf4(group_size=64), 128, 24, MANY)
    level1 = dataclasses.replace(CPU, native_decode=1)  # NF4 only
    assert _decode_calls(jqt.quantize(f, qp, policy=level1), jqt.pack(qp, p), x) == 1
    f, p, qp, x = _setup(R.w4(group_size=64), 128, 24, MANY)
    assert _decode_calls(jqt.quantize(f, qp, policy=level1), jqt.pack(qp, p), x) == 0
    assert _decode_calls(jqt.quantize(f, qp, policy=NDEC), jqt.pack(qp, p), x) == 1
    # the few-row kernel, not the decode, at few rows
    assert _decode_calls(jqt.quantize(f, qp, policy=NDEC), jqt.pack(qp, p), x[:1]) == 0
    # int8 codes (one per byte) and the nibble_halves order: XLA's decode
    for recipe, pol in ((R.w8(), NDEC), (R.w4(group_size=64), dataclasses.replace(NDEC, nibble_halves=True))):
        f, p, qp, x = _setup(recipe, 128, 24, MANY)
        assert _decode_calls(jqt.quantize(f, qp, policy=pol), jqt.pack(qp, p, policy=pol), x) == 0


@needs_kernel
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_native_decode_under_jit_vmap_grad_scan_and_export():
    keys = jax.random.split(jax.random.key(21), 4)
    p = {"w": jax.random.normal(keys[0], (2, 128, 128)) / 11}
    f = lambda p, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]
    qp = jqt.calibrate(f, R.nf4(group_size=64), p, [(jax.random.normal(keys[1], (4, 128)),)],
                       progress=False)
    packed, x = jqt.pack(qp, p), jax.random.normal(keys[2], (MANY, 128))
    q, ref = jqt.quantize(f, qp, policy=NDEC), jqt.quantize(f, qp, policy=XDEC)
    assert _decode_calls(q, packed, x) == 1  # inside the scan's body
    eq = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    eq(jax.jit(q)(packed, x), jax.jit(ref)(packed, x))
    xs = jnp.stack([x, -x])  # vmap over activations: the decode is tied to them (its tie operand)
    eq(jax.jit(jax.vmap(q, in_axes=(None, 0)))(packed, xs), jnp.stack([jax.jit(ref)(packed, v) for v in xs]))
    g = lambda fn: jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(fn(packed, x)))))(x)
    eq(g(q), g(ref))
    exp = jax.export.export(jax.jit(q))(packed, x)
    assert "stablehlo.custom_call" not in exp.mlir_module()
    eq(exp.call(packed, x), jax.jit(ref)(packed, x))


@needs_kernel
@pytest.mark.parametrize("m", [1, 6])
@pytest.mark.slow_variants
def test_w8a16_codes_run_the_kernel_whole_at_every_row_it_takes(m):
    """w8a16's int16 activations: at 5-8 rows (past native_int8_rows) their two int8 halves
    took XLA's two int8 matmuls, slower than float32's; then the kernel took each half (two
    calls, the weight read twice); now it takes the codes whole (exact in float32), one
    call, with the same results."""
    f, p, qp, x = _setup(R.w8a16(), 256, 40, m)
    packed = jqt.pack(qp, p)
    q = jqt.quantize(f, qp)
    assert _custom_calls(q, packed, x) == 1 and _custom_calls(jqt.quantize(f, qp, policy=XLA), packed, x) == 0
    _close(jax.jit(q)(packed, x), jax.jit(jqt.quantize(f, qp, policy=XLA))(packed, x), rel=1e-5)
    _close(jax.jit(q)(packed, x), jax.jit(jqt.quantize(f, qp, simulate=True))(p, x), rel=1e-3)
