"""jqt on models written with the usual JAX frameworks.

Each model is calibrated, quantized (integer path and simulated path) and
packed; the properties checked are the same for every framework:

* op keys are the weight leaf paths, and identical when ``f`` is jitted;
* the integer path agrees with the simulated path to float rounding;
* the quantized output is close to the float output;
* the packed (int8-stored) weights give the same result as the float ones,
  eagerly and under ``jax.jit``.
"""
from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jqt

# Tolerances, relative to the largest absolute float output.
INT_VS_SIM = 1e-4   # integer path vs simulated path: float rounding only
QUANT_VS_FLOAT = 0.05  # int8 quantization error


def _rel(a, b, ref):
    a, b, ref = (np.asarray(v, np.float64) for v in (a, b, ref))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(ref)), 1e-12))


def _batches(key, shape, n=2, minval=None, maxval=None):
    keys = jax.random.split(key, n)
    if minval is None:
        return [(jax.random.normal(k, shape),) for k in keys]
    return [(jax.random.uniform(k, shape, minval=minval, maxval=maxval),) for k in keys]


def check_model(f, params, batches, expected_keys, recipe=None, *, x=None,
                quant_tol=QUANT_VS_FLOAT, eager=False):
    """The common checks; returns the qparams.

    The quantized functions run under ``jax.jit`` (one compilation instead of one
    per primitive); ``eager=True`` also runs them op by op and compares."""
    recipe = recipe if recipe is not None else jqt.recipes.w8a8()
    qp = jqt.calibrate(f, recipe, params, batches, progress=False)
    assert list(qp) == list(expected_keys)
    for k, p in qp.items():
        assert isinstance(p, jqt.OpQParams), k
        assert not p.is_float, (k, p)

    # Keys do not depend on jax.jit.
    qp_jit = jqt.calibrate(jax.jit(f), recipe, params, batches, progress=False)
    assert list(qp_jit) == list(qp)
    for k in qp:
        for a, b in zip(jax.tree_util.tree_leaves(qp[k]), jax.tree_util.tree_leaves(qp_jit[k])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)

    x = batches[0][0] if x is None else x
    ref = f(params, x)
    qf = jqt.quantize(f, qp)
    sim = jqt.quantize(f, qp, simulate=True)
    out_int = jax.jit(qf)(params, x)
    out_sim = jax.jit(sim)(params, x)
    assert out_int.shape == ref.shape and out_int.dtype == ref.dtype
    assert bool(jnp.all(jnp.isfinite(out_int)))
    assert _rel(out_int, out_sim, ref) < INT_VS_SIM
    err = _rel(out_int, ref, ref)
    assert err < quant_tol, err
    # Quantization really happened (the result is not the float function's).
    assert err > 0

    if eager:
        assert _rel(qf(params, x), out_int, ref) < INT_VS_SIM
        assert _rel(sim(params, x), out_sim, ref) < INT_VS_SIM

    packed = jqt.pack(qp, params)
    assert isinstance(packed, jqt.PackedParams)
    assert set(packed.weights) == {k for k, p in qp.items()
                                   if p.weight_operand is not None
                                   and p.operand(p.weight_operand) is not None}
    for w in packed.weights.values():
        assert w.qvalue.dtype == jnp.int8
    atol = 1e-6 * float(jnp.abs(ref).max())
    np.testing.assert_allclose(np.asarray(jax.jit(qf)(packed, x)), np.asarray(out_int), rtol=0,
                               atol=atol)
    if eager:
        np.testing.assert_allclose(np.asarray(qf(packed, x)), np.asarray(out_int), rtol=0,
                                   atol=atol)
    return qp


# --------------------------------------------------------------------------- flax.linen


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(32)(x))
        x = nn.gelu(nn.Dense(32)(x))
        return nn.Dense(8)(x)


@pytest.mark.parametrize("recipe", ["w8a8", "w8a8_dynamic", "w8"])
def test_linen_mlp(recipe):
    m = LinenMLP()
    batches = _batches(jax.random.key(0), (16, 12))
    params = m.init(jax.random.key(1), batches[0][0])
    qp = check_model(m.apply, params, batches,
                     ["params/Dense_0/kernel", "params/Dense_1/kernel", "params/Dense_2/kernel"],
                     getattr(jqt.recipes, recipe)(), eager=recipe == "w8a8")
    p = qp["params/Dense_0/kernel"]
    assert p.weight_operand == 1  # x @ kernel
    assert p.rhs.scale.shape == (1, 32)  # per output channel
    if recipe == "w8":
        assert p.lhs is None
    elif recipe == "w8a8":
        assert p.lhs.scale.shape == () and p.lhs.zero_point.shape == ()
    else:
        assert p.lhs.qtype.dynamic and p.lhs.scale is None


class LinenConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), padding="SAME")(x))
        x = nn.relu(nn.Conv(8, (3, 3), strides=2, padding="SAME")(x))
        x = nn.Conv(8, (3, 3), padding="VALID", kernel_dilation=2)(x)
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(5)(x)


def test_linen_conv_net():
    m = LinenConvNet()
    batches = _batches(jax.random.key(2), (2, 10, 10, 3))
    params = m.init(jax.random.key(3), batches[0][0])
    qp = check_model(m.apply, params, batches,
                     ["params/Conv_0/kernel", "params/Conv_1/kernel", "params/Conv_2/kernel",
                      "params/Dense_0/kernel"])
    c = qp["params/Conv_0/kernel"]
    assert c.op == "conv_general_dilated"
    assert c.weight_operand == 1
    assert c.rhs.scale.shape == (1, 1, 1, 8)  # HWIO: one scale per output feature
    assert c.lhs.scale.shape == ()  # per-tensor activations
    assert qp["params/Dense_0/kernel"].op == "dot_general"


L_SCAN = 3


class Block(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return nn.gelu(nn.Dense(16)(h)) + h, None


class LinenScan(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(Block) if self.remat else Block
        layers = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=L_SCAN)
        h, _ = layers()(nn.Dense(16)(x), None)
        return nn.Dense(4)(h)


@pytest.mark.parametrize("remat", [False, True])
def test_linen_scan_stacked_layers(remat):
    m = LinenScan(remat=remat)
    batches = _batches(jax.random.key(4), (8, 6))
    params = m.init(jax.random.key(5), batches[0][0])
    stacked = ("params/ScanCheckpointBlock_0/Dense_0/kernel" if remat
               else "params/ScanBlock_0/Dense_0/kernel")
    assert jax.tree_util.tree_leaves(params["params"][stacked.split("/")[1]])[0].shape[0] == L_SCAN
    qp = check_model(m.apply, params, batches,
                     ["params/Dense_0/kernel", stacked, "params/Dense_1/kernel"])
    p = qp[stacked]
    assert p.rhs.scale.shape == (L_SCAN, 1, 16)
    assert p.lhs.scale.shape == (L_SCAN,)
    assert p.lhs.zero_point.shape == (L_SCAN,)
    # Each layer has its own scales, computed from its own slice of the stacked kernel.
    kernel = params["params"][stacked.split("/")[1]]["Dense_0"]["kernel"]
    expected = jnp.max(jnp.abs(kernel), axis=1, keepdims=True) / 127.0
    np.testing.assert_allclose(np.asarray(p.rhs.scale), np.asarray(expected), rtol=1e-5)
    # Unstacked ops have no leading axis.
    assert qp["params/Dense_0/kernel"].rhs.scale.shape == (1, 16)
    assert qp["params/Dense_0/kernel"].lhs.scale.shape == ()


class RBlock(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.relu(nn.Dense(16)(h))


class LinenRemat(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.remat(RBlock)()(x)
        return nn.Dense(4)(x)


def test_linen_remat():
    m = LinenRemat()
    batches = _batches(jax.random.key(6), (8, 6))
    params = m.init(jax.random.key(7), batches[0][0])
    qp = check_model(m.apply, params, batches,
                     ["params/CheckpointRBlock_0/Dense_0/kernel",
                      "params/CheckpointRBlock_1/Dense_0/kernel", "params/Dense_0/kernel"])
    # The simulated path stays differentiable through the remat.
    x = batches[0][0]
    g = jax.jit(jax.grad(
        lambda p: jnp.sum(jqt.quantize(m.apply, qp, simulate=True)(p, x) ** 2)))(params)
    gf = jax.jit(jax.grad(lambda p: jnp.sum(m.apply(p, x) ** 2)))(params)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(gf)):
        assert bool(jnp.all(jnp.isfinite(a)))
        assert _rel(a, b, b) < 0.1


# --------------------------------------------------------------------------- flax.nnx


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(6, 16, rngs=rngs)
        self.fc2 = nnx.Linear(16, 16, rngs=rngs)
        self.fc3 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.fc3(nnx.relu(self.fc2(nnx.relu(self.fc1(x)))))


def test_nnx_split_merge():
    model = NNXMLP(nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    def f(state, x):
        return nnx.merge(graphdef, state)(x)

    batches = _batches(jax.random.key(8), (8, 6))
    np.testing.assert_allclose(np.asarray(f(state, batches[0][0])),
                               np.asarray(model(batches[0][0])), rtol=1e-6)
    qp = check_model(f, state, batches, ["fc1/kernel/value", "fc2/kernel/value", "fc3/kernel/value"])
    assert qp["fc1/kernel/value"].rhs.scale.shape == (1, 16)


# --------------------------------------------------------------------------- equinox


def test_equinox_mlp():
    mlp = eqx.nn.MLP(6, 4, 16, 2, key=jax.random.key(9))
    params, static = eqx.partition(mlp, eqx.is_array)

    def f(params, x):
        return jax.vmap(eqx.combine(params, static))(x)

    batches = _batches(jax.random.key(10), (8, 6))
    qp = check_model(f, params, batches, ["layers/0/weight", "layers/1/weight", "layers/2/weight"])
    p = qp["layers/0/weight"]
    assert p.weight_operand == 0  # equinox computes weight @ x
    assert p.lhs.scale.shape == (16, 1)  # weight is (out, in): one scale per output row


# --------------------------------------------------------------------------- plain jax.numpy


def _dict_mlp_params(key):
    k = jax.random.split(key, 3)
    return {"w1": jax.random.normal(k[0], (12, 32)) * 0.3, "b1": jnp.full((32,), 0.1),
            "w2": jax.random.normal(k[1], (32, 32)) * 0.2, "b2": jnp.zeros((32,)),
            "w3": jax.random.normal(k[2], (8, 32)) * 0.2}  # used transposed


def dict_mlp(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    h = jnp.tanh(jnp.dot(h, p["w2"]) + p["b2"])
    return h @ p["w3"].T


def test_plain_jnp_mlp():
    p = _dict_mlp_params(jax.random.key(11))
    batches = _batches(jax.random.key(12), (16, 12))
    qp = check_model(dict_mlp, p, batches, ["w1", "w2", "w3"], eager=True)
    # The transposed weight keeps its own (out, in) layout: one scale per output channel.
    assert qp["w3"].rhs.scale.shape == (1, 8)
    packed = jqt.pack(qp, p)
    # Biases are kept as floats, weights read only by quantized ops are dropped.
    assert len(packed.leaves) == 2


# --------------------------------------------------------------------------- plain lax conv


def _conv_params(key):
    k = jax.random.split(key, 4)
    return {"w1": jax.random.normal(k[0], (3, 3, 3, 8)) * 0.3, "b1": jnp.full((8,), 0.2),
            "w2": jax.random.normal(k[1], (3, 3, 8, 8)) * 0.2,
            "w3": jax.random.normal(k[2], (8, 4, 3, 3)) * 0.2,   # OIHW, grouped
            "w4": jax.random.normal(k[3], (3, 3, 8, 4)) * 0.2}


def lax_conv_net(p, x):
    nhwc = ("NHWC", "HWIO", "NHWC")
    h = lax.conv_general_dilated(x, p["w1"], (1, 1), "SAME", dimension_numbers=nhwc)
    h = h + p["b1"]
    h = lax.conv_general_dilated(h, p["w2"], (2, 2), "SAME", dimension_numbers=nhwc)
    h = jnp.transpose(h, (0, 3, 1, 2))
    h = lax.conv_general_dilated(h, p["w3"], (1, 1), "SAME", rhs_dilation=(2, 1),
                                 dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=2)
    h = jnp.transpose(h, (0, 2, 3, 1))
    # transposed-conv style: input dilation plus asymmetric explicit padding
    return lax.conv_general_dilated(h, p["w4"], (1, 1), ((1, 2), (2, 1)), lhs_dilation=(2, 2),
                                    dimension_numbers=nhwc)


@pytest.mark.parametrize("kind", ["positive", "negative", "shifted"])
def test_lax_conv_same_padding_asymmetric(kind):
    """SAME padding with asymmetric activations: the integer path pads with the zero
    point (real value 0), so it must agree with the simulated path (float conv padded
    with 0) everywhere, borders included."""
    p = _conv_params(jax.random.key(13))
    lo, hi = {"positive": (0.5, 3.0), "negative": (-3.0, -0.5), "shifted": (-0.5, 2.5)}[kind]
    batches = _batches(jax.random.key(14), (2, 9, 9, 3), minval=lo, maxval=hi)
    qp = check_model(lax_conv_net, p, batches, ["w1", "w2", "w3", "w4"])
    zp = float(qp["w1"].lhs.zero_point)
    # The input range excludes 0 (positive/negative) or is lopsided: a zero point far from 0.
    expected_zp = {"positive": -128.0, "negative": 127.0}.get(kind)
    if expected_zp is not None:
        assert zp == expected_zp
    else:
        assert zp < -60
    for k in ("w2", "w3", "w4"):
        assert qp[k].lhs.zero_point is not None and qp[k].lhs.scale.shape == ()

    # Border pixels (where padding enters) agree between integer and simulated paths.
    x = batches[1][0]
    single = lambda p, x: lax.conv_general_dilated(
        x, p["w1"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    qp1 = jqt.calibrate(single, jqt.recipes.w8a8(), {"w1": p["w1"]}, batches, progress=False)
    out_int = jax.jit(jqt.quantize(single, qp1))({"w1": p["w1"]}, x)
    out_sim = jax.jit(jqt.quantize(single, qp1, simulate=True))({"w1": p["w1"]}, x)
    ref = single({"w1": p["w1"]}, x)
    for border in (out_int[:, 0], out_int[:, -1], out_int[:, :, 0], out_int[:, :, -1]):
        assert bool(jnp.all(jnp.isfinite(border)))
    assert _rel(out_int, out_sim, ref) < INT_VS_SIM
    assert _rel(out_int[:, 0], ref[:, 0], ref) < QUANT_VS_FLOAT
    assert _rel(out_int[:, :, -1], ref[:, :, -1], ref) < QUANT_VS_FLOAT


def test_lax_conv_dynamic_activations():
    """Per-example dynamic activation scales and zero points with SAME padding and a
    dilated input: integer and simulated paths agree, and vmap equals a loop."""
    p = _conv_params(jax.random.key(15))
    batches = _batches(jax.random.key(16), (2, 9, 9, 3), minval=0.5, maxval=3.0)
    qp = check_model(lax_conv_net, p, batches, ["w1", "w2", "w3", "w4"],
                     jqt.recipes.w8a8_dynamic())
    assert qp["w1"].lhs.qtype.dynamic and qp["w1"].lhs.scale is None
    xs = jnp.stack([b[0] for b in batches])
    qf = jqt.quantize(lax_conv_net, qp)
    batched = jax.jit(jax.vmap(qf, in_axes=(None, 0)))(p, xs)
    loop = jnp.stack([jax.jit(qf)(p, x) for x in xs])
    assert _rel(batched, loop, loop) < 1e-6
