# Copyright 2026 The jqt Authors. SPDX-License-Identifier: Apache-2.0
"""Python scalars and weakly typed arrays (``jnp.full(shape, 0.1)``, ``jnp.asarray(2.0)``)
through calibrate, quantize, pack, gptq and the packed files: a quantized function
returns what ``f`` returns, dtype and weak type included."""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jqt
from jqt._src import compat

W = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)) * 0.3, jnp.float32)
X = jnp.asarray(np.random.default_rng(1).standard_normal((4, 16)), jnp.float32)


@pytest.mark.parametrize("recipe", [jqt.recipes.w8(), jqt.recipes.w8a8(), jqt.recipes.w8a8_dynamic()],
                         ids=["w8", "w8a8", "w8a8_dynamic"])
@pytest.mark.parametrize("form", ["x_dot_scalar", "scalar_dot_x", "int_scalar"])
def test_a_dot_with_a_python_scalar_operand_runs(recipe, form):
    """``jnp.dot(x, 2.0)`` is a dot_general whose operand is a jaxpr literal: its rule was
    handed JAX's literal object (AttributeError 'TypedFloat' object has no attribute 'astype')."""
    dot = {"x_dot_scalar": lambda x: jnp.dot(x, 2.0), "scalar_dot_x": lambda x: jnp.dot(2.0, x),
           "int_scalar": lambda x: jnp.dot(x, 2)}[form]
    f = lambda p, x: dot(x) @ p["w"]
    p = {"w": W}
    qp = jqt.calibrate(f, recipe, p, [(X,)], progress=False)
    y, want = jqt.quantize(f, qp)(p, X), f(p, X)
    assert y.dtype == want.dtype
    assert float(jnp.max(jnp.abs(y - want))) < 0.05 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_array_equal(jqt.quantize(f, qp)(jqt.pack(qp, p), X), y)


def _weak(x):
    return compat.weak_typed(x)


@pytest.mark.parametrize("recipe", [jqt.recipes.w8(), jqt.recipes.w8a8(), jqt.recipes.w4(group_size=16)],
                         ids=["w8", "w8a8", "w4"])
def test_a_weakly_typed_weight_packed_away_keeps_fs_dtypes(recipe, tmp_path):
    """A weak float32 weight in a bfloat16 model gives bfloat16 outputs; packed away, it was
    traced as strong float32 zeros (float32 outputs, and a scan carry error)."""
    p = {"w": _weak(W)}
    x = X.astype(jnp.bfloat16)
    f = lambda p, x: x @ p["w"]
    qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
    packed = jqt.pack(qp, p)
    assert f(p, x).dtype == jnp.bfloat16
    qf = jqt.quantize(f, qp)
    np.testing.assert_array_equal(qf(packed, x), qf(p, x))
    assert qf(packed, x).dtype == jnp.bfloat16
    assert jqt.quantize(f, qp, simulate=True)(packed, x).dtype == jnp.bfloat16
    path = str(tmp_path / "m.safetensors")
    jqt.save_packed(path, packed, qp)
    loaded = jqt.load_packed(path)
    np.testing.assert_array_equal(qf(loaded, x), qf(p, x))
    assert qf(loaded, x).dtype == jnp.bfloat16
    exp = jax.export.deserialize(jax.export.export(jax.jit(qf))(packed, x).serialize())
    np.testing.assert_array_equal(exp.call(packed, x), qf(packed, x))  # the same params tree

    ws = _weak(jnp.stack([W[:8], W[8:] * 0.5]))  # (2, 8, 8) stacked layers, a bfloat16 carry

    def g(p, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["ws"])[0]
    p = {"ws": ws}
    x = X[:, :8].astype(jnp.bfloat16)
    qp = jqt.calibrate(g, recipe, p, [(x,)], progress=False)
    y = jqt.quantize(g, qp)(jqt.pack(qp, p), x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, jqt.quantize(g, qp)(p, x))


def test_gptq_keeps_a_weak_weight_weak():
    """GPTQ's re-rounded weight was cast back strong: the user's own bfloat16 model then
    computed in float32 (and a scan with a bfloat16 carry failed)."""
    p = {"w": _weak(W)}
    f = lambda p, x: x @ p["w"]
    qp = jqt.calibrate(f, jqt.recipes.w4(group_size=8), p, [(X,)], progress=False)
    new = jqt.gptq(f, qp, p, [(X,)], progress=False)
    assert new["w"].dtype == jnp.float32 and compat.is_weak(new["w"])
    assert f(new, X.astype(jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("recipe", [jqt.recipes.w8(), jqt.recipes.w8a8(), jqt.recipes.w8a8_dynamic(),
                                    jqt.recipes.fp8()], ids=["w8", "w8a8", "w8a8_dynamic", "fp8"])
def test_a_weak_output_stays_weak(recipe):
    """Weak input times weak weight is weak in ``f``; the quantized op returned it strong
    (a bfloat16 value downstream then promoted to float32)."""
    p, x = {"w": _weak(W)}, _weak(X)
    f = lambda p, x: x @ p["w"]
    qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
    qf = jqt.quantize(f, qp)
    assert f(p, x).weak_type
    for params in (p, jqt.pack(qp, p)):
        y = qf(params, x)
        assert y.weak_type and y.dtype == jnp.float32
        assert (y * jnp.ones(1, jnp.bfloat16)).dtype == jnp.bfloat16
        assert jax.eval_shape(qf, params, x).weak_type


def test_save_packed_takes_qparams_holding_python_numbers(tmp_path):
    """``tree_map(float)``-style qparams (Python numbers) are taken by quantize, pack and save;
    save_packed refused a Python int zero point, calling it int64."""
    p = {"w": W}
    f = lambda p, x: x @ p["w"]
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(X,)], progress=False)
    w = qp["w"]
    q2 = {"w": dataclasses.replace(w, lhs=dataclasses.replace(w.lhs, scale=float(w.lhs.scale),
                                                              zero_point=int(w.lhs.zero_point)))}
    packed = jqt.pack(q2, p)
    path = str(tmp_path / "p.safetensors")
    jqt.save_packed(path, packed, q2)
    loaded, stored = jqt.load_packed(path), jqt.load(path)
    np.testing.assert_array_equal(jqt.quantize(f, stored)(loaded, X), jqt.quantize(f, qp)(p, X))


def test_an_argument_passed_as_a_constant_one_time_and_an_array_the_other_is_said():
    """Calibrated with an array, called with a Python number (a constant weight now), or
    the ids as a list then as an array: the errors spoke of other functions and of qparams
    made before 2026-11-23, not of the argument's kind."""
    p = {"w": W}
    f = lambda p, x, s: jnp.dot(x, s) @ p["w"]
    qp = jqt.calibrate(f, jqt.recipes.w8(), p, [(X, np.float32(2.0))], progress=False)
    with pytest.raises(jqt.QParamsMismatchError, match=r"an operand calibration traced \(a jax array\) "
                                                        r"is a constant now \(a Python number"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("multiplies two weights": a constant s, a weight)
        jqt.quantize(f, qp)(p, X, 2.0)
    p = {"emb": jnp.ones((32, 16)), "w": W}
    g = lambda p, ids: p["emb"][jnp.asarray(ids)] @ p["w"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (emb[constant ids] @ w: two weights multiplied)
        qp = jqt.calibrate(g, jqt.recipes.w8a8(), p, [([1, 5, 7],)], progress=False)
    with pytest.raises(jqt.QParamsMismatchError, match=r"Or the indices were a Python list or number "
                                                        r"at calibration and are an array now"):
        jqt.quantize(g, qp)(p, np.array([1, 5, 7]))


def test_a_kept_weak_leaf_leaves_the_packed_treedef_as_a_strong_ones():
    """A weak bias (jnp.full(n, 0.1)) is kept as it is; its aval in the PackedParams' treedef
    was weak, so the same params after a training step (strong) packed to another treedef:
    an exported function refused them, jit compiled again (hunt81_review)."""
    f = lambda p, x: x @ p["w"] + p["b"]
    weak = {"w": W, "b": jnp.full((8,), 0.1)}
    strong = {"w": W, "b": jnp.asarray(weak["b"], jnp.float32)}
    assert weak["b"].weak_type and not strong["b"].weak_type
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), weak, [(X,)], progress=False)
    a, b = jqt.pack(qp, weak), jqt.pack(qp, strong)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert compat.is_weak(a.leaves[0])  # the leaf itself stays weak


def test_equal_scales_in_bfloat16_share_codes_whatever_the_sign_of_zero():
    from jqt._src.quantize import _digest
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn):
        assert _digest(jnp.array([0.0, 1.0], dtype)) == _digest(jnp.array([-0.0, 1.0], dtype)), dtype
        assert _digest(jnp.array([0.5, 1.0], dtype)) != _digest(jnp.array([0.25, 1.0], dtype)), dtype
