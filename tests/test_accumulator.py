"""Narrow (saturating) accumulators: Rule(accumulator=16) on the simulated and integer paths,
the report's saturation column, files, composition and clear errors (issue 14)."""
import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jqt
from jqt._src import serialization

K = 384


def _dense():
    rng = np.random.default_rng(0)
    # all-positive operands: every product adds, so long rows leave the int16 range
    w = jnp.asarray(np.abs(rng.standard_normal((K, 6))), jnp.float32)
    x = jnp.asarray(np.abs(rng.standard_normal((5, K))), jnp.float32)
    # rows of magnitudes 150x apart: the smallest stays inside int16, the largest leaves int20
    x = x * jnp.array([0.02, 0.1, 0.3, 1.0, 3.0])[:, None]
    return (lambda p, x: x @ p["w"]), {"w": w}, x


def _reference(qp, p, x, bits):
    """NumPy: codes, exact int64 sums, saturated, scaled; and the saturated fraction."""
    a, w = qp["w"].lhs, qp["w"].rhs
    sx, zx = float(a.scale), float(a.zero_point)
    qx = np.clip(np.round(np.asarray(x) / sx) + zx, -128, 127) - zx
    sw = np.asarray(w.scale).reshape(1, -1)
    qw = np.clip(np.round(np.asarray(p["w"]) / sw), -127, 127)
    acc = qx.astype(np.int64) @ qw.astype(np.int64)
    lo, hi = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    return np.clip(acc, lo, hi) * sx * sw, np.mean((acc < lo) | (acc > hi))


@pytest.fixture(scope="module")
def dense16():
    f, p, x = _dense()
    qp = jqt.calibrate(f, jqt.recipes.w8a8(accumulator=16), p, [(x,)], progress=False)
    return f, p, x, qp


def test_saturates_like_a_16_bit_accumulator_on_both_paths(dense16):
    f, p, x, qp = dense16
    assert qp["w"].accumulator == 16
    assert "int16 accumulator" in jqt.summarize(qp) and "int16 accumulator" in repr(qp["w"])
    ref, frac = _reference(qp, p, x, 16)
    assert 0.3 < frac < 1.0  # some outputs saturate, the small row does not
    yi = np.asarray(jqt.quantize(f, qp)(p, x))
    ys = np.asarray(jqt.quantize(f, qp, simulate=True)(p, x))
    np.testing.assert_allclose(yi, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ys, ref, rtol=1e-5, atol=1e-4)
    yp = jqt.quantize(f, qp)(jqt.pack(qp, p), x)  # packed weights: the same sums
    np.testing.assert_allclose(np.asarray(yp), ref, rtol=1e-5, atol=1e-4)
    # int32 (the default) never saturates: the unsaturated sums
    wide = dataclasses.replace(qp["w"], accumulator=32)
    y32 = np.asarray(jqt.quantize(f, {"w": wide})(p, x))
    assert np.abs(y32 - ref).max() > 1.0
    np.testing.assert_allclose(y32[0], ref[0], rtol=1e-5, atol=1e-5)  # the row inside the range


@pytest.mark.slow  # the default run's 5 minutes; its siblings there cover the feature
def test_gradients_pass_straight_through_the_saturation(dense16):
    """guarantees.md: gradients pass straight through a saturated accumulator, as through
    rounding: the weights', the activation's and the scales' gradients are those of the
    int32 accumulator (they were scaled by bound / sum, 1/20 to 1/30 here)."""
    f, p, x, qp = dense16
    wide = {"w": dataclasses.replace(qp["w"], accumulator=32)}
    grads = [jax.grad(lambda p, x, q: jnp.sum(jqt.quantize(f, q, simulate=True)(p, x)),
                      argnums=(0, 1, 2))(p, x, q) for q in (qp, wide)]
    leaves = [jax.tree_util.tree_leaves(g) for g in grads]
    assert len(leaves[0]) == len(leaves[1]) >= 3
    for a, b in zip(*leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_a_wider_narrow_accumulator_saturates_less(dense16):
    f, p, x, _ = dense16
    qp = jqt.calibrate(f, jqt.recipes.w8a8(accumulator=20), p, [(x,)], progress=False)
    ref, frac = _reference(qp, p, x, 20)
    assert 0.0 < frac < _reference(qp, p, x, 16)[1]
    np.testing.assert_allclose(np.asarray(jqt.quantize(f, qp)(p, x)), ref, rtol=1e-5, atol=1e-3)


def test_report_shows_the_saturated_fraction(dense16):
    f, p, x, qp = dense16
    rep = jqt.report(f, qp, p, (x,))
    _, frac = _reference(qp, p, x, 16)
    row = rep.rows[0]
    assert row.accumulator == 16 and row.acc_saturated == pytest.approx(frac)
    assert "acc sat." in str(rep) and "(int16)" in str(rep)
    plain = jqt.report(f, jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False), p, (x,))
    assert np.isnan(plain.rows[0].acc_saturated) and "acc sat." not in str(plain)


def test_conv_act_x_act_and_dynamic_activations():
    rng = np.random.default_rng(1)
    x = jnp.asarray(np.abs(rng.standard_normal((1, 6, 6, 32))), jnp.float32)
    k = jnp.asarray(np.abs(rng.standard_normal((3, 3, 32, 4))), jnp.float32)

    def conv(p, x):
        return jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))

    def attn(p, x):
        h = x @ p["w"]
        return jnp.einsum("bqd,bkd->bqk", h, h)

    pa = {"w": jnp.asarray(np.abs(rng.standard_normal((16, 64))), jnp.float32)}
    xa = jnp.asarray(np.abs(rng.standard_normal((2, 8, 16))), jnp.float32)
    for f, p, xx, r in ((conv, {"k": k}, x, jqt.recipes.w8a8(accumulator=16)),
                        (attn, pa, xa, jqt.recipes.w8a8_dynamic(act_x_act=True, accumulator=16))):
        qp = jqt.calibrate(f, r, p, [(xx,)], progress=False)
        assert all(v.accumulator == 16 for v in qp.values())
        yi = jqt.quantize(f, qp)(p, xx)
        ys = jqt.quantize(f, qp, simulate=True)(p, xx)
        np.testing.assert_allclose(np.asarray(yi), np.asarray(ys), rtol=1e-4, atol=1e-3)
        # long all-positive sums: the float output is far above what a 16-bit accumulator
        # holds, so saturation is visible (the report's fraction is tested on the dense op)
        assert float(jnp.max(f(p, xx))) > float(jnp.max(yi)) * 1.5


@pytest.mark.slow  # CI: the accumulator's numerics run in the default tests above
def test_composition_scan_jit_vmap_grad_export():
    rng = np.random.default_rng(2)
    ws = jnp.asarray(rng.standard_normal((3, 32, 32)) * 0.4, jnp.float32)

    def f(p, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w) * 4.0, None), x, p["w"])[0]

    p = {"w": ws}
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32) * 3
    qp = jqt.calibrate(f, jqt.recipes.w8a8(accumulator=16), p, [(x,)], progress=False)
    qi, qs = jqt.quantize(f, qp), jqt.quantize(f, qp, simulate=True)
    y = qi(p, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(qs(p, x)), atol=2e-3)
    np.testing.assert_allclose(np.asarray(jax.jit(qi)(p, x)), np.asarray(y), atol=1e-5)
    yv = jax.vmap(qi, in_axes=(None, 0))(p, x[:, None])
    np.testing.assert_allclose(np.asarray(yv[:, 0]), np.asarray(y), atol=2e-3)
    g = jax.grad(lambda x: jnp.sum(qs(p, x) ** 2))(x)
    assert np.isfinite(np.asarray(g)).all() and float(jnp.abs(g).sum()) > 0
    exp = jax.export.deserialize(jax.export.export(jax.jit(qi))(p, x).serialize())
    np.testing.assert_allclose(np.asarray(exp.call(p, x)), np.asarray(y), atol=1e-5)


def test_files_keep_the_accumulator_and_refuse_a_bad_one(dense16, tmp_path):
    f, p, x, qp = dense16
    y = np.asarray(jqt.quantize(f, qp)(p, x))
    for name in ("qp.safetensors", "qp.npz"):
        path = str(tmp_path / name)
        jqt.save(path, qp)
        back = jqt.load(path)
        assert back["w"].accumulator == 16
        np.testing.assert_allclose(np.asarray(jqt.quantize(f, back)(p, x)), y, rtol=1e-6)
    path = str(tmp_path / "qp.safetensors")
    # a newer format version: a jqt that does not know accumulators refuses the file
    assert serialization.versioned(serialization.ST_VERSION, qp) == serialization.ST_VERSION + 1
    packed = str(tmp_path / "packed")
    jqt.save_packed(packed, jqt.pack(qp, p), qp)
    np.testing.assert_allclose(np.asarray(jqt.quantize(f, qp)(jqt.load_packed(packed), x)), y,
                               rtol=1e-6)
    # an out-of-range width written into the header: FormatError naming the file
    from safetensors.numpy import load_file, save_file
    from safetensors import safe_open
    with safe_open(path, "np") as fh:
        meta = dict(fh.metadata())
    header = json.loads(meta["jqt"])
    header["ops"]["w"]["accumulator"] = 8
    meta["jqt"] = json.dumps(header)
    bad = str(tmp_path / "bad.safetensors")
    save_file(load_file(path), bad, metadata=meta)
    with pytest.raises(jqt.FormatError, match=r"bad\.safetensors.*accumulator=8"):
        jqt.load(bad)


def test_clear_errors():
    with pytest.raises(ValueError, match="from 16 to 32 bits"):
        jqt.recipes.w8a8(accumulator=12)
    with pytest.raises(ValueError, match="weight-only"):
        jqt.Rule(weight=jqt.QuantType(), accumulator=16)
    with pytest.raises(ValueError, match="per-group scales"):
        jqt.Rule(weight=jqt.QuantType(bits=4, group_size=32, per_channel=True),
                 activation=jqt.QuantType(), accumulator=16)
    with pytest.raises(ValueError, match=r"this rule matches only ops=\('gather',\) \(lookups and "
                       r"cache writes have no accumulator\)"):  # it was kept silently (hunt78_accumulators)
        jqt.Rule(ops=("gather",), embedding=jqt.QuantType(per_channel=True), accumulator=16)
    for bits, acc in ((16, 16), (12, 28)):  # names the width it was given
        with pytest.raises(ValueError, match=f"an int{bits} operand runs as two int8 halves"):
            jqt.Rule(weight=jqt.QuantType(), activation=jqt.QuantType(bits=bits, symmetric=True),
                     accumulator=acc)
    # qparams edited by hand: a weight-only op cannot have one; quantize names the op
    f, p, x = _dense()
    qp = jqt.calibrate(f, jqt.recipes.w8(), p, [(x,)], progress=False)
    bad = {"w": dataclasses.replace(qp["w"], accumulator=16)}
    with pytest.raises(ValueError, match="op 'w' asks for an int16 accumulator.*weight-only"):
        jqt.quantize(f, bad)


@pytest.mark.slow  # 3-4 s each: CI's slow run (CI's default run took 323 s on 2026-12-07)
def test_an_op_kept_float_by_hand_under_a_narrow_accumulator_runs_on_every_path():
    """An op made float by hand (``lhs=None, rhs=None``, as debugging.md and
    ``jqt.sensitivity``'s own error advise), its ``accumulator=16`` kept, has no integer
    sums to saturate: the simulated path, report, sensitivity and fallback run it float,
    as the integer path does (they raised AttributeError from the sums' missing operand
    type; hunt60_sensitivity)."""
    f = lambda p, x: jax.nn.relu(x @ p["a"]) @ p["b"]
    p = {"a": jnp.eye(4), "b": jnp.ones((4, 2))}
    x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    rec = jqt.recipes.w8a8(accumulator=16)
    qp = jqt.calibrate(f, rec, p, [(x,)], progress=False)
    kept = dict(qp, a=dataclasses.replace(qp["a"], lhs=None, rhs=None))
    np.testing.assert_allclose(jqt.quantize(f, kept, simulate=True)(p, x), jqt.quantize(f, kept)(p, x),
                               rtol=1e-5, atol=1e-5)
    rows = {r.key: r for r in jqt.report(f, kept, p, (x,)).rows}
    assert rows["a"].sqnr_isolated is None or not np.isfinite(rows["a"].sqnr_isolated) \
        or rows["a"].sqnr_isolated > 100
    metric = lambda g: float(jnp.abs(g(p, x) - f(p, x)).max())
    on = {sim: jqt.sensitivity(f, qp, metric, simulate=sim, higher_is_better=False)
          for sim in (False, True)}
    assert [r.key for r in on[True].rows] == [r.key for r in on[False].rows]
    for a, b in zip(on[True].rows, on[False].rows):
        np.testing.assert_allclose(a.alone, b.alone, rtol=1e-4, atol=1e-6)
    jqt.fallback(f, rec, p, [(x,)], metric, max_drop=0.0, higher_is_better=False, simulate=True,
                 progress=False)


def test_a_convolution_too_long_for_int32_stays_float_at_calibration():
    """A conv summing 66,600 products of int8 codes with an activation zero point (more
    than the 66,052 whose worst case fits int32 with narrow-range weights, |q| <= 127) was
    calibrated, then refused by the
    integer path, so jqt.fallback died on its first trial (hunt64_convens). calibrate keeps
    it float, saying so; weight-only, it is quantized."""
    rng = np.random.default_rng(0)
    f = lambda p, x: jax.lax.conv_general_dilated(  # noqa: E731
        x, p["w"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    p = {"w": jnp.asarray(rng.standard_normal((9, 7400, 2)) * 0.01, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((1, 4, 7400)), jnp.float32)
    with pytest.warns(UserWarning, match=r"op 'w' .*stays float: each output sums 66600 products .*"
                      r"66052 .*activation=None"):
        qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    assert qp["w"].is_float and "kept float" in qp["w"].note
    np.testing.assert_array_equal(jqt.quantize(f, qp)(p, x), f(p, x))
    qw = jqt.calibrate(f, jqt.recipes.w8(), p, [(x,)], progress=False)
    assert not qw["w"].is_float


def test_a_rare_saturation_shows_in_the_report_and_a_float_op_keeps_no_width(tmp_path):
    """One output in 65,536 saturating read ``0.00% (int16)``, as if none had (hunt68_accum16):
    it reads ``<0.01%`` and a line under the table names the op. An op made float by hand
    kept ``accumulator=16``: the report called it int16 and ``jqt.save`` gave its file the
    next format version, which an older jqt refuses for nothing it cannot read."""
    signs = jnp.where(jnp.arange(8) % 2 == 0, 1.0, -1.0)[:, None]
    w = jnp.ones((8, 256)).at[:, 1:].multiply(signs)  # column 0 all 1, the others +-1
    x = jnp.zeros((256, 8)).at[1, 0].set(1.0)  # sums of one product: 127 * 127 < 2**15
    f = lambda p, x: x @ p["w"]
    qp = jqt.calibrate(f, jqt.recipes.w8a8(accumulator=16), {"w": w}, [(x,)], progress=False)
    big = x.at[0].set(1.0)  # row 0 x column 0: 8 products of 127 * 127, beyond 2**15
    rep = jqt.report(f, qp, {"w": w}, (big,))
    frac = rep.rows[0].acc_saturated
    assert 0 < frac < 5e-5
    text = str(rep)
    assert "<0.01% (int16)" in text and "0.00% (int16)" not in text
    assert "accumulator saturated: w (<0.01% of outputs, int16)" in text  # (its own format,
    # which read 99.99% as 100%: hunt78_accumulators)
    assert "accumulator saturated" not in str(jqt.report(f, qp, {"w": w}, (x,)))
    kept = {"w": dataclasses.replace(qp["w"], lhs=None, rhs=None)}  # accumulator=16 kept
    assert "(int16)" not in str(jqt.report(f, kept, {"w": w}, (x,)))
    assert serialization.versioned(serialization.ST_VERSION, kept) == serialization.ST_VERSION
    jqt.save(str(tmp_path / "f.safetensors"), kept)
    assert jqt.load(str(tmp_path / "f.safetensors"))["w"].is_float
    numpy_width = {"w": dataclasses.replace(qp["w"], accumulator=np.int64(16))}
    with pytest.raises(ValueError, match=r"int64: pass a Python int, accumulator=int\(bits\)"):
        jqt.quantize(f, numpy_width)


def test_a_long_convolution_of_int4_weights_is_bounded_by_their_code_range():
    """The int32 bound counted every weight code as int8 (|q| <= 128), so a w4a8 conv
    summing 66,600 products stayed float with a warning that it could overflow, though
    int4 codes (the presets' |q| <= 7) bound it at 1,198,372 products: it runs integer now and matches
    the simulated path; the same conv at w8a8 stays float."""
    rng = np.random.default_rng(0)
    f = lambda p, x: jax.lax.conv_general_dilated(  # noqa: E731
        x, p["w"], (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    p = {"w": jnp.asarray(rng.standard_normal((9, 7400, 2)) * 0.01, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((1, 4, 7400)), jnp.float32)
    rec = jqt.recipes.w4a8()  # int8 activations with a zero point
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qp = jqt.calibrate(f, rec, p, [(x,)], progress=False)
    assert not qp["w"].is_float and qp["w"].lhs is not None
    out, sim = jqt.quantize(f, qp)(p, x), jqt.quantize(f, qp, simulate=True)(p, x)
    np.testing.assert_allclose(out, sim, rtol=1e-4, atol=1e-4 * float(jnp.abs(sim).max()))
    assert float(jnp.abs(out - f(p, x)).max()) < 0.2 * float(jnp.abs(f(p, x)).max())


def test_a_float16_output_saturates_in_float32_before_its_cast():
    """A float16 model whose unsaturated outputs overflow float16: every path gave NaN (the
    output reached the saturation as inf, and inf - inf made the straight-through term
    NaN), even where the saturated value fits float16; accumulator=31, which saturates
    nothing, turned accumulator=32's inf into NaN. The sums are now scaled and saturated in
    float32, then cast (hunt78_accumulators)."""
    f = lambda p, x: x @ p["w"]
    k = jax.random.split(jax.random.key(12), 2)
    w = {"w": (jnp.abs(jax.random.normal(k[0], (512, 4))) * 60 + 40).astype(jnp.float16)}
    x = (jnp.abs(jax.random.normal(k[1], (2, 512))) * 60 + 40).astype(jnp.float16)
    assert np.isinf(np.asarray(f(w, x), np.float32)).all()  # float16 overflows
    qp = jqt.calibrate(f, jqt.recipes.w8a8(accumulator=16), w, [(x,)], progress=False)
    unit = np.asarray(qp["w"].lhs.scale, np.float32) * np.asarray(qp["w"].rhs.scale, np.float32)
    want = (32767 * unit).astype(np.float16)  # every sum saturates high
    assert np.isfinite(want).sum() >= 2
    for got in (jqt.quantize(f, qp, simulate=True)(w, x), jqt.quantize(f, qp)(w, x),
                jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w), x)):
        assert got.dtype == jnp.float16
        np.testing.assert_allclose(np.asarray(got, np.float32), np.broadcast_to(want, got.shape).astype(np.float32),
                                   rtol=2e-3)
    g = jax.grad(lambda w: jqt.quantize(f, qp, simulate=True)(w, x).astype(jnp.float32).sum())(w)
    assert not np.isnan(np.asarray(g["w"], np.float32)).any()
    q31 = jqt.calibrate(f, jqt.recipes.w8a8(accumulator=31), w, [(x,)], progress=False)
    for simulate in (False, True):
        assert np.isposinf(np.asarray(jqt.quantize(f, q31, simulate=simulate)(w, x), np.float32)).all()
