"""Every new format of issue 11 through every control-flow primitive and transformation.

One function holds a ``lax.scan`` over stacked layers, a ``lax.cond`` whose two branches
read different weights, a ``lax.while_loop`` and an embedding lookup; for each format it
is calibrated (both branches taken), run on the integer path against the simulated
path, and its integer function is checked under ``jax.vmap`` (against a loop over
inputs), ``jax.export`` (serialized and called back) and ``jqt.packed_shardings``, and
the simulated path under ``jax.jvp`` (straight-through to the weights; the scales'
derivatives, as LSQ and ``jqt.qat`` use them).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from shared import all_eqns

import jqt

K, L, V = 128, 2, 32
RNG = np.random.default_rng(7)
P = {"emb": jnp.asarray(RNG.standard_normal((V, K)) * 0.5, jnp.float32),
     "ws": jnp.asarray(RNG.standard_normal((L, K, K)) * K ** -0.5, jnp.float32),
     "a": jnp.asarray(RNG.standard_normal((K, K)) * K ** -0.5, jnp.float32),
     "b": jnp.asarray(RNG.standard_normal((K, K)) * K ** -0.5, jnp.float32),
     "c": jnp.asarray(RNG.standard_normal((K, K)) * K ** -0.5, jnp.float32)}
IDS = jnp.asarray(RNG.integers(0, V, (2, 3)), jnp.int32)
OPS = ("emb", "ws", "a", "b", "c")


def composed(p, ids):
    h = p["emb"][ids]                                                    # (2, 3, K)
    h = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["ws"])[0]    # stacked layers
    h = lax.cond(ids[0, 0] % 2 == 0, lambda h: h @ p["a"], lambda h: jnp.tanh(h @ p["b"]), h)
    _, h = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.tanh(c[1] @ p["c"])), (0, h))
    return h


EVEN = IDS.at[0, 0].set(2)   # takes the first branch
ODD = IDS.at[0, 0].set(3)    # the second
RECIPES = {
    "w4_g64": lambda: jqt.recipes.w4(group_size=64),
    "w4a8_g64": lambda: jqt.recipes.w4a8(group_size=64),
    "nf4_g64": lambda: jqt.recipes.nf4(group_size=64),
    "fp8": lambda: jqt.recipes.fp8(),
    "fp8_dynamic": lambda: jqt.recipes.fp8(dynamic=True),
    "w8a8_g32": lambda: jqt.recipes.w8a8(group_size=32),
}
BOUND = {"w4_g64": 0.5, "w4a8_g64": 0.5, "nf4_g64": 0.5, "fp8": 0.1, "fp8_dynamic": 0.1,
         "w8a8_g32": 0.1}  # relative error to float after six quantized matmuls


# About 70 s for the six formats, so all of it runs with CI's slow tests (pytest -m slow):
# the default run keeps its op-by-op checks in test_formats.py.
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) for n in RECIPES])
def setup(request):
    qp = jqt.calibrate(composed, RECIPES[request.param](), P, [(EVEN,), (ODD,)], progress=False)
    return request.param, qp, jqt.pack(qp, P)


def test_every_op_is_quantized_and_integer_matches_simulated(setup):
    name, qp, packed = setup
    assert {k for k in OPS if not qp[k].is_float} == set(OPS), name
    qf = jax.jit(jqt.quantize(composed, qp))
    sim = jax.jit(jqt.quantize(composed, qp, simulate=True))
    for ids in (EVEN, ODD):
        ref, s = composed(P, ids), sim(P, ids)
        scale = float(jnp.abs(ref).max())
        for w in (P, packed):
            assert float(jnp.abs(qf(w, ids) - s).max()) <= 1e-4 * scale, name
        rel = float(jnp.linalg.norm(s - ref) / jnp.linalg.norm(ref))
        assert rel < BOUND[name], (name, rel)
    prims = {e.primitive.name for e in all_eqns(jax.make_jaxpr(jqt.quantize(composed, qp))(packed, EVEN).jaxpr)}
    assert {"scan", "cond", "while"} <= prims


def test_vmap_equals_a_loop_over_inputs(setup):
    name, qp, packed = setup
    qf = jax.jit(jqt.quantize(composed, qp))
    batch = jnp.stack([EVEN, ODD, EVEN[::-1], ODD[:, ::-1]])
    out = jax.jit(jax.vmap(jqt.quantize(composed, qp), in_axes=(None, 0)))(packed, batch)
    loop = jnp.stack([qf(packed, ids) for ids in batch])
    np.testing.assert_allclose(out, loop, rtol=0, atol=1e-5 * float(jnp.abs(loop).max()), err_msg=name)


def test_export_round_trip(setup):
    name, qp, packed = setup
    qf = jax.jit(jqt.quantize(composed, qp))
    # an export holds XLA formulations, never the native CPU kernels (custom calls only
    # this process registered): bit for bit the CPU table's program without them for
    # weight-only formats; for int8 activations with grouped int4 or int8 weights, the float
    # formulation of their exact codes, equal to the table's int8 matmuls per group to float
    # rounding;
    # for fp8, the kernel's XLA formulation takes the activation's scale around it, where
    # the table's fp8 path folds a per-tensor one into the weight's scales (float rounding)
    xla = jax.jit(jqt.quantize(composed, qp, policy=dataclasses.replace(
        jqt.KernelPolicy.for_backend("cpu"), native_gemv_rows=0)))
    back = jax.export.deserialize(jax.export.export(qf)(packed, EVEN).serialize())
    assert "stablehlo.custom_call" not in jax.export.export(qf)(packed, EVEN).mlir_module()
    for ids in (EVEN, ODD):
        out, ref = back.call(packed, ids), xla(packed, ids)
        if name.startswith("w4a8") or name in ("w8a8_g32", "fp8"):
            np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6 * float(jnp.abs(ref).max()), err_msg=name)
        else:
            np.testing.assert_array_equal(out, ref, err_msg=name)
        np.testing.assert_allclose(out, qf(packed, ids), rtol=0, atol=1e-5 * float(jnp.abs(ref).max()),
                                   err_msg=name)


def test_packed_shardings_place_every_array(setup):
    name, qp, packed = setup
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    qs, ps = jqt.packed_shardings(qp, packed, mesh, axis="x")
    qp2, packed2 = jax.device_put((qp, packed), (qs, ps))
    for k in ("ws", "a"):
        w = packed2.weights[k]
        assert w.values.sharding.mesh == mesh and w.scale.sharding.mesh == mesh, (name, k)
    qf = jax.jit(jqt.quantize(composed, qp))
    np.testing.assert_array_equal(jax.jit(jqt.quantize(composed, qp2))(packed2, ODD), qf(packed, ODD))


def _tangent(a, scale):
    if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating):
        return scale * jnp.asarray(RNG.standard_normal(jnp.shape(a)), jnp.asarray(a).dtype)
    return np.zeros(jnp.shape(a), jax.dtypes.float0)


def test_derivatives_through_the_simulated_path(setup):
    """Forward mode: JAX's reverse mode does not go through ``lax.while_loop`` (for float
    functions too). Straight through the formats, the tangent is close to the float one;
    the scales have derivatives (LSQ, ``jqt.qat``)."""
    name, qp, _ = setup
    tp = jax.tree.map(lambda a: _tangent(a, 0.01), P)
    _, t_float = jax.jvp(lambda p: composed(p, ODD), (P,), (tp,))
    _, t_sim = jax.jit(lambda p, t: jax.jvp(lambda p: jqt.quantize(composed, qp, simulate=True)(p, ODD),
                                            (p,), (t,)))(P, tp)
    rel = float(jnp.linalg.norm(t_sim - t_float) / jnp.linalg.norm(t_float))
    assert rel < 0.5, (name, rel)
    for k in ("ws", "b", "c"):
        tq = jax.tree.map(lambda a: _tangent(a, 0.0), qp)
        tq[k] = jax.tree.map(lambda a: _tangent(a, 1e-3), qp[k])
        _, t_q = jax.jit(lambda q, t: jax.jvp(lambda q: jqt.quantize(composed, q, simulate=True)(P, ODD),
                                              (q,), (t,)))(qp, tq)
        assert bool(jnp.isfinite(t_q).all()) and float(jnp.abs(t_q).max()) > 0, (name, k)
