"""Packed int8 weights sharded over a mesh of 8 host CPU devices, with their per-channel
scales and int32 sums (``jqt.packed_shardings``), against the single-device result.

Everything runs in one subprocess (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
``JAX_PLATFORMS=cpu``), started by a module fixture; each test checks a part of its
JSON result. The mesh is ``("data", "model") = (2, 4)``: the batch is split over
``"data"``, the weights over ``"model"``.
"""
import pytest
from shared import on_devices

# One 8-device subprocess, end to end: in the slow run (CI: pytest -m slow).
pytestmark = pytest.mark.slow

_CODE = r"""
import json, os, re, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
import jqt

def mlp(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    h = jax.nn.relu(h @ p["w2"] + p["b2"])
    return h @ p["w3"]

def stacked(p, x):  # L layers under lax.scan: (L, K, N) weights, (L, 1, N) scales
    def body(h, w):
        return jax.nn.relu(h @ w), None
    return jax.lax.scan(body, x, p["ws"])[0]

def cnn(p, x):  # NHWC; HWIO kernels stay in the op's layout ("operand")
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dn))
    h = jax.nn.relu(jax.lax.conv_general_dilated(h, p["c2"], (2, 2), "SAME", dimension_numbers=dn))
    return h.reshape(h.shape[0], -1) @ p["d"]

rng = np.random.default_rng(0)
normal = lambda shape, s=1.0: jnp.asarray((rng.standard_normal(shape) * s).astype(np.float32))
P_MLP = {"w1": normal((64, 128), 0.3), "b1": normal((128,), 0.1), "w2": normal((128, 256), 0.1),
         "b2": normal((256,), 0.1), "w3": normal((256, 32), 0.1)}
X_MLP = normal((16, 64))
P_STACK = {"ws": normal((3, 64, 64), 0.15)}
P_CNN = {"c1": normal((3, 3, 16, 16), 0.2), "c2": normal((3, 3, 16, 32), 0.1),
         "d": normal((4 * 4 * 32, 8), 0.05)}
X_CNN = normal((4, 8, 8, 16))
AUTO = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))  # JAX 0.10's default: Explicit axes

def shard_shape(a):  # None: no such array (weight-only weights carry no int32 sums)
    return None if a is None else list(a.addressable_shards[0].data.shape)

def case(f, p, x, recipe, mesh, ops=(), const=False, policy=None):
    qp = jqt.calibrate(f, recipe, p, [(x,)], progress=False)
    packed = jqt.pack(qp, p, policy=policy)
    g = jax.jit(lambda q, pk, x: jqt.quantize(f, q, policy=policy)(pk, x))  # qparams as arguments: shardable
    want = g(qp, packed, x)
    qs, ps = jqt.packed_shardings(qp, packed, mesh, ops=ops)
    qps, pks = jax.device_put((qp, packed), (qs, ps))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = g(qps, pks, xs)
    hlo = g.lower(qps, pks, xs).compile().as_text()
    gathers = [l for l in hlo.splitlines() if "all-gather(" in l]
    out = {"diff": float(jnp.abs(y - want).max()), "max": float(jnp.abs(want).max()),
           "equal": bool(np.array_equal(np.asarray(y), np.asarray(want))),
           "out_spec": [a if a is None or isinstance(a, str) else list(a) for a in y.sharding.spec],
           "s32_all_reduce": any(re.search(r"= s32\[[0-9,]*\]\S* all-reduce\(", l)
                                 for l in hlo.splitlines()),
           "weights": {}}
    for k, w in pks.weights.items():
        q = qps[k].operand(qps[k].weight_operand)
        hlo_dtype = {"int8": "s8", "uint8": "u8"}.get(str(w.values.dtype), str(w.values.dtype))
        shape = hlo_dtype.replace("float", "f") + "[" + ",".join(map(str, w.values.shape)) + "]"
        out["weights"][k] = {
            "layout": w.layout, "shape": list(w.values.shape), "qvalue": shard_shape(w.values),
            "wsum": shard_shape(w.sums), "scale": shard_shape(q.scale),
            "scale_shape": list(q.scale.shape), "devices": len(w.values.sharding.device_set),
            "gathered": any(shape in l.split("all-gather(")[0] for l in gathers)}
    if const:  # qparams captured as constants; weights sharded
        want_c = jax.jit(jqt.quantize(f, qp))(packed, x)
        out["diff_const"] = float(jnp.abs(jax.jit(jqt.quantize(f, qp))(pks, xs) - want_c).max())
    return out, qp, packed

res = {"devices": len(jax.devices())}
res["mlp_w8a8"], qp, packed = case(mlp, P_MLP, X_MLP, jqt.recipes.w8a8(), AUTO, const=True)
# weight-only in the "kn" layout (as the CPU table packs w8), XLA formulations only
KN = jqt.KernelPolicy(pad_rows=2, weight_only_chunk=256)
res["mlp_w8"], _, _ = case(mlp, P_MLP, X_MLP, jqt.recipes.w8(), AUTO, policy=KN)
res["mlp_dynamic"], _, _ = case(mlp, P_MLP, X_MLP, jqt.recipes.w8a8_dynamic(), AUTO)
res["mlp_megatron"], _, _ = case(mlp, P_MLP, X_MLP, jqt.recipes.w8a8(), AUTO, ops=(("w2", "in"),))
res["stacked"], _, _ = case(stacked, P_STACK, X_MLP, jqt.recipes.w8a8(), AUTO)
res["cnn"], _, _ = case(cnn, P_CNN, X_CNN, jqt.recipes.w8a8(), AUTO)
res["explicit"], _, _ = case(mlp, P_MLP, X_MLP, jqt.recipes.w8a8(), EXPLICIT)
# issue 11's formats: int4 codes two per byte (K, N), group scales (G, N), fp8 codes
W4 = jqt.recipes.w4(group_size=32)
res["w4_out"], _, _ = case(mlp, P_MLP, X_MLP, W4, AUTO)
res["w4_in"], _, _ = case(mlp, P_MLP, X_MLP, W4, AUTO, ops=(("w2", "in"),))
res["w4a8_in"], _, _ = case(mlp, P_MLP, X_MLP, jqt.recipes.w4a8(group_size=32), AUTO, ops=(("w2", "in"),))
res["nf4_stacked"], _, _ = case(stacked, P_STACK, X_MLP, jqt.recipes.nf4(group_size=32), AUTO)
res["fp8"], _, _ = case(mlp, P_MLP, X_MLP, jqt.recipes.fp8(), AUTO)
# explicit mesh axes (sharding in types) with weights decoded after their input
# (numerics.after: one element of a batch-split activation), and vmapped over a split batch
for name, rec in (("w8", jqt.recipes.w8()), ("w4", W4), ("nf4", jqt.recipes.nf4(group_size=32)),
                  ("fp8", jqt.recipes.fp8())):
    try:  # a failure is this case's result, not the other cases'
        r, qx, px = case(mlp, P_MLP, X_MLP, rec, EXPLICIT)
        xv = jax.device_put(X_MLP.reshape(2, 8, 64), NamedSharding(EXPLICIT, P("data")))
        pkv = jax.device_put(px, jqt.packed_shardings(qx, px, EXPLICIT)[1])
        yv = jax.jit(jax.vmap(lambda pk, x, qx=qx: jqt.quantize(mlp, qx)(pk, x), in_axes=(None, 0)))(pkv, xv)
        r["vmap_diff"] = float(jnp.abs(yv.reshape(16, -1) - jax.jit(jqt.quantize(mlp, qx))(px, X_MLP)).max())
    except Exception as e:
        r = {"error": f"{type(e).__name__}: {e}"[:500]}
    res["explicit_" + name] = r
# the "in" rule on explicit axes through the halves of weight groups: w2's K of 128 in 2
# groups of 64 over the 4 "model" devices (each holds half a group; the scales are
# replicated), at 16 and 2 rows; the decode reshaped the split K into groups, which JAX
# refuses on explicit axes outside jax.set_mesh (ShardingTypeError; hunt41_docs21)
for name, rec in (("w4", jqt.recipes.w4(group_size=64)), ("nf4", jqt.recipes.nf4(group_size=64)),
                  ("w8", jqt.recipes.w8(group_size=64)), ("w4a8", jqt.recipes.w4a8(group_size=64))):
    for rows in (16, 2):
        try:
            r, _, _ = case(mlp, P_MLP, X_MLP[:rows], rec, EXPLICIT, ops=(("w2", "in"),))
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
        res[f"explicit_in_halves_{name}_{rows}"] = r
# one group of K a device (w2's K of 128 in 4 groups of 32 over the 4 "model" devices) under
# the default (TPU) table, which packs int8-activation groups "nk" and runs an int8 matmul
# per group: slicing a group out of the split K failed in JAX outside jax.set_mesh
# (ShardingTypeError; hunt54_shardfmt)
for name, rec in (("w4a8", jqt.recipes.w4a8(group_size=32)), ("w8a8", jqt.recipes.w8a8(group_size=32))):
    for rows in (16, 2):
        try:
            r, _, _ = case(mlp, P_MLP, X_MLP[:rows], rec, EXPLICIT, ops=(("w2", "in"),),
                           policy=jqt.KernelPolicy())
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"[:300]}
        res[f"explicit_in_groups_{name}_{rows}"] = r
# few rows (jqt's native kernels' ops, their XLA formulations in a multi-device program),
# the rows split over "data": plain at 2 rows, and vmapped at 4 rows per example
def mlp_scan(p, x):  # an MLP, then 3 stacked layers under lax.scan
    h = jax.nn.relu(x @ p["w1"]) @ p["w2"]
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, p["ws"])[0]
P_FEW = {"w1": normal((64, 128), 0.3), "w2": normal((128, 32), 0.1), "ws": normal((3, 32, 32), 0.2)}
X_FEW = X_MLP[:8]
for mesh_name, mesh in (("auto", AUTO), ("explicit", EXPLICIT)):
    for name, rec in (("w8a8", jqt.recipes.w8a8()), ("w4", W4), ("w8", jqt.recipes.w8()),
                      ("dynamic", jqt.recipes.w8a8_dynamic()), ("w4a8", jqt.recipes.w4a8(group_size=32)),
                      ("nf4", jqt.recipes.nf4(group_size=32)), ("fp8", jqt.recipes.fp8())):
        qx = jqt.calibrate(mlp_scan, rec, P_FEW, [(X_FEW,)], progress=False)
        px = jqt.pack(qx, P_FEW)
        pkx = jax.device_put(px, jqt.packed_shardings(qx, px, mesh)[1])
        for how, run, x in (
                ("plain_2_rows", jax.jit(jqt.quantize(mlp_scan, qx)), X_FEW[:2]),
                ("vmap_4_rows", jax.jit(jax.vmap(jqt.quantize(mlp_scan, qx), in_axes=(None, 0))),
                 X_FEW.reshape(2, 4, 64))):
            try:  # each outcome is a result: the largest difference to one device, or the error
                # one device, exported: the formulations a multi-device program lowers (no
                # native kernels), so a near-tie of w8a8_dynamic's codes rounds alike
                want = np.asarray(jax.export.export(run)(px, x).call(px, x))
                y = run(pkx, jax.device_put(x, NamedSharding(mesh, P("data"))))
                d = np.abs(np.asarray(y) - want).reshape(-1, 32)
                got = {"max": float(d.max()), "rows_off": int((d.max(1) > 1e-5).sum()), "rows": len(d),
                       "out_max": float(np.abs(want).max())}
            except Exception as e:
                got = f"{type(e).__name__}: {e}"[:300]
            res[f"few_{mesh_name}_{name}_{how}"] = got
# jax.shard_map around a quantized function (per-device code, 8 rows per device), plain,
# vmapped (2 examples of 4 rows per device) and the simulated path's gradient, against
# the same program run on each device's rows on one device (the gradient: summed)
SMAP = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
X_SM = normal((64, 64))
for name, rec in (("w8a8", jqt.recipes.w8a8()), ("w4", W4), ("w8", jqt.recipes.w8()),
                  ("dynamic", jqt.recipes.w8a8_dynamic()), ("w4a8", jqt.recipes.w4a8(group_size=32)),
                  ("nf4", jqt.recipes.nf4(group_size=32)), ("fp8", jqt.recipes.fp8())):
    try:
        qx = jqt.calibrate(mlp_scan, rec, P_FEW, [(X_SM,)], progress=False)
        px = jqt.pack(qx, P_FEW)
        sm = lambda g, specs, out=P("d"): jax.jit(jax.shard_map(g, mesh=SMAP, in_specs=specs, out_specs=out))
        qf = jax.jit(jqt.quantize(mlp_scan, qx))
        vq = jax.jit(jax.vmap(jqt.quantize(mlp_scan, qx), in_axes=(None, 0)))
        grad = jax.jit(jax.grad(lambda q, p, x: jnp.sum(jqt.quantize(mlp_scan, q, simulate=True)(p, x) ** 2),
                                argnums=(0, 1)))
        xv = X_SM.reshape(16, 4, 64)
        y = sm(qf, (P(), P("d")))(px, X_SM)
        yv = sm(vq, (P(), P("d")))(px, xv)
        g = sm(grad, (P(), P(), P("d")), P())(qx, P_FEW, X_SM)
        want = np.concatenate([np.asarray(qf(px, X_SM[8 * i:8 * i + 8])) for i in range(8)])
        want_v = np.concatenate([np.asarray(vq(px, xv[2 * i:2 * i + 2])) for i in range(8)])
        parts = [grad(qx, P_FEW, X_SM[8 * i:8 * i + 8]) for i in range(8)]
        want_g = jax.tree_util.tree_map(lambda *a: sum(np.asarray(v, np.float64) for v in a), *parts)
        # relative to the sum of the parts' magnitudes: a sum of 8 float32 values that
        # cancel is exact to a few ulps of that, not of the (smaller) sum
        mag = jax.tree_util.tree_map(lambda *a: sum(np.abs(np.asarray(v, np.float64)) for v in a), *parts)
        rel = [float(np.abs(np.asarray(a) - b).max() / max(m.max(), 1e-30)) for a, b, m in
               zip(*(jax.tree_util.tree_leaves(t) for t in (g, want_g, mag)))]
        res["smap_" + name] = {"diff": float(np.abs(np.asarray(y) - want).max()),
                               "vmap_diff": float(np.abs(np.asarray(yv) - want_v).max()),
                               "grad_rel": max(rel)}
    except Exception as e:
        res["smap_" + name] = f"{type(e).__name__}: {e}"[:300]
    if name in ("w8a8", "w4"):  # blocks of the packed weights or qparams in its in_specs
        qs, ps = jqt.packed_shardings(qx, px, SMAP, axis="d")
        spec = lambda t: jax.tree_util.tree_map(lambda s: s.spec, t)
        run = lambda q, p, x: jqt.quantize(mlp_scan, q)(p, x)
        for what, specs in (("packed", (P(), spec(ps), P("d"))), ("qparams", (spec(qs), P(), P("d")))):
            for vma in (True, False):  # (check_vma=False: no type says what varies)
                key = f"smap_split_{name}_{what}" + ("" if vma else "_novma")
                try:
                    jax.jit(jax.shard_map(run, mesh=SMAP, in_specs=specs, out_specs=P("d"),
                                          check_vma=vma))(qx, px, X_SM)
                    res[key] = "ran"
                except Exception as e:
                    res[key] = f"{type(e).__name__}: {e}"
# jax.set_mesh of explicit axes: a decode loop whose embedding lookup JAX runs in an
# auto_axes region (typed on another mesh) and whose weights go through reshard, against
# the same loop without a mesh (one device, exported: the formulations a multi-device
# program lowers): calibration, the integer path, the simulated path's gradient
sys.path.insert(0, os.environ["JQT_TESTS_DIR"])
from shared import explicit_decoder
(DEC_E, P_DEC, TOK), (DEC_P, _, _) = explicit_decoder(True, 8), explicit_decoder(False, 8)
DATA = jax.make_mesh((8,), ("data",))


def region_case(rec):  # its own names: the sections below reuse qp, packed, ...
    want_qp = jqt.calibrate(DEC_P, rec, P_DEC, [(TOK,)], progress=False)
    pk = jqt.pack(want_qp, P_DEC)
    run = jax.jit(jqt.quantize(DEC_P, want_qp))
    want = np.asarray(jax.export.export(run)(pk, TOK).call(pk, TOK))
    grad = lambda f: jax.jit(jax.grad(lambda q, p, t: jnp.sum(jqt.quantize(f, q, simulate=True)(p, t) ** 2),
                                      argnums=(0, 1)))
    with jax.set_mesh(DATA):
        ts = jax.device_put(TOK, NamedSharding(DATA, P("data")))
        qp = jqt.calibrate(DEC_E, rec, P_DEC, [(ts,)], progress=False)
        y = jax.jit(jqt.quantize(DEC_E, want_qp))(jax.device_put(pk, NamedSharding(DATA, P())), ts)
        g = grad(DEC_E)(want_qp, P_DEC, ts)
    gw = grad(DEC_P)(want_qp, P_DEC, TOK)
    rel = lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()
                             / max(float(np.abs(np.asarray(b)).max()), 1e-30))
    return {
        "qp_rel": max(rel(a, b) for a, b in zip(*(jax.tree_util.tree_leaves(t) for t in (qp, want_qp)))),
        "diff": float(np.abs(np.asarray(y) - want).max()), "out_max": float(np.abs(want).max()),
        "rows_off": int((np.abs(np.asarray(y) - want).max(-1) > 1e-5 * np.abs(want).max()).sum()),
        "spec": str(jax.typeof(y).sharding.spec[1]),
        "grad_rel": max(rel(a, b) for a, b in zip(*(jax.tree_util.tree_leaves(t) for t in (g, gw))))}


for name, rec in (("w8a8", jqt.recipes.w8a8()), ("dynamic_kv", jqt.recipes.w8a8_dynamic(kv_cache=True)),
                  ("w4", jqt.recipes.w4(group_size=8)), ("w4_kv", jqt.recipes.w4(group_size=8, kv_cache=True)),
                  ("nf4", jqt.recipes.nf4(group_size=8)), ("fp8", jqt.recipes.fp8())):
    try:
        res["region_" + name] = region_case(rec)
    except Exception as e:
        res["region_" + name] = f"{type(e).__name__}: {e}"[:300]
# AWQ's and GPTQ's Gram matrices and jqt.report over rows split on explicit axes: the
# decode loop above (report; its lookup in the auto_axes region) and an MLP (AWQ, GPTQ)


def report_rows(rep):
    return [(r.key, r.layer, r.act_clip, r.weight_clip, r.sqnr_isolated, r.sqnr_cumulative) for r in rep.rows]


def tools(decoder, toks, mlp_p, x):
    q8 = jqt.calibrate(decoder, jqt.recipes.w8a8(), P_DEC, [(toks,)], progress=False)
    f = lambda p, x: jnp.tanh(x @ p["w1"]) @ p["w2"]
    qa = jqt.calibrate(f, jqt.recipes.w4(group_size=8, awq=True), mlp_p, [(x,)], progress=False)
    qg = jqt.calibrate(f, jqt.recipes.w4(group_size=8), mlp_p, [(x,)], progress=False)
    return (report_rows(jqt.report(decoder, q8, P_DEC, (toks,))), qa,
            jqt.gptq(f, qg, mlp_p, [(x,)], progress=False))


try:
    P_T = {"w1": normal((16, 32), 0.2), "w2": normal((32, 16), 0.2)}
    X_T = normal((64, 16))
    want_t = tools(DEC_P, TOK, P_T, X_T)
    with jax.set_mesh(DATA):
        got_t = tools(DEC_E, jax.device_put(TOK, NamedSharding(DATA, P("data"))), P_T,
                      jax.device_put(X_T, NamedSharding(DATA, P("data"))))
    res["explicit_tools"] = {
        "report_same_rows": [a[:4] for a in got_t[0]] == [b[:4] for b in want_t[0]],
        "report_sqnr_diff": max(abs(a[i] - b[i]) for a, b in zip(got_t[0], want_t[0]) for i in (4, 5)
                                if np.isfinite(b[i])),
        "awq_gptq_rel": max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / (np.abs(np.asarray(b)).max() + 1e-30))
                            for a, b in zip(*(jax.tree_util.tree_leaves(t[1:]) for t in (got_t, want_t))))}
except Exception as e:
    res["explicit_tools"] = f"{type(e).__name__}: {e}"[:300]
# a model part the user runs under jax.sharding.auto_axes, holding a scan over stacked
# layers, on 8 explicit devices, against the part without a mesh
PART = lambda p, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), jnp.tanh(x @ p["w1"]), p["ws"])[0]
IN_REGION = lambda p, x: jax.sharding.auto_axes(PART, out_sharding=P("data", None))(p, x)
P_PART = {"w1": normal((16, 32), 0.2), "ws": normal((3, 32, 32), 0.2)}
X_PART = normal((16, 16))
for name, rec in (("w8a8", jqt.recipes.w8a8()), ("w4", jqt.recipes.w4(group_size=8)),
                  ("dynamic", jqt.recipes.w8a8_dynamic())):
    try:
        q1 = jqt.calibrate(PART, rec, P_PART, [(X_PART,)], progress=False)
        pk1 = jqt.pack(q1, P_PART)
        want = np.asarray(jax.export.export(jax.jit(jqt.quantize(PART, q1)))(pk1, X_PART).call(pk1, X_PART))
        with jax.set_mesh(DATA):
            xs = jax.device_put(X_PART, NamedSharding(DATA, P("data")))
            q8 = jqt.calibrate(IN_REGION, rec, P_PART, [(xs,)], progress=False)
            y = jax.jit(jqt.quantize(IN_REGION, q1))(pk1, xs)
        res["auto_axes_" + name] = {
            "qp_rel": max(float(np.abs(np.asarray(a) - np.asarray(b)).max() / (np.abs(np.asarray(b)).max() + 1e-30))
                          for a, b in zip(*(jax.tree_util.tree_leaves(t) for t in (q8, q1)))),
            "diff": float(np.abs(np.asarray(y) - want).max()), "spec": str(jax.typeof(y).sharding.spec[0])}
    except Exception as e:
        res["auto_axes_" + name] = f"{type(e).__name__}: {e}"[:300]
# traced under jax.set_mesh on an unsplit input, then called without a mesh: jqt's trace
# cache reuses the jaxpr (the same input types), whose equations name the mesh
try:
    qf_r, sf_r, x_r = jqt.quantize(PART, q1), jqt.quantize(PART, q1, simulate=True), jnp.asarray(X_PART)
    with jax.set_mesh(DATA):
        inside = np.asarray(qf_r(pk1, x_r)), np.asarray(sf_r(P_PART, x_r))
    res["traced_in_mesh_run_outside"] = max(float(np.abs(np.asarray(g(w, x_r)) - y).max())
                                            for g, w, y in zip((qf_r, sf_r), (pk1, P_PART), inside))
except Exception as e:
    res["traced_in_mesh_run_outside"] = f"{type(e).__name__}: {e}"[:300]
# jqt.report of a function that vmaps its own per-example part (a scan over stacked
# layers inside), its batch split on 8 explicit devices, against the report without a mesh
try:
    VMAPPED = lambda p, x: jax.vmap(lambda xi: PART(p, xi))(x)
    X_V = normal((16, 4, 16))
    want_v, got_v = [], []
    for name, rec in (("w8a8", jqt.recipes.w8a8()), ("w4", jqt.recipes.w4(group_size=8))):
        qv = jqt.calibrate(VMAPPED, rec, P_PART, [(X_V,)], progress=False)
        want_v += report_rows(jqt.report(VMAPPED, qv, P_PART, (X_V,)))
        with jax.set_mesh(DATA):
            got_v += report_rows(jqt.report(VMAPPED, qv, P_PART,
                                            (jax.device_put(X_V, NamedSharding(DATA, P("data"))),)))
    res["explicit_report_vmap"] = {
        "rows": len(got_v), "same_rows": [a[:4] for a in got_v] == [b[:4] for b in want_v],
        "sqnr_diff": max(abs(a[i] - b[i]) for a, b in zip(got_v, want_v) for i in (4, 5) if np.isfinite(b[i]))}
except Exception as e:
    res["explicit_report_vmap"] = f"{type(e).__name__}: {e}"[:300]
# lax.ragged_dot (a mixture's grouped matmul): the expert weights split along the experts
# ("out") or along K ("in"), against the same packed weights on one device
try:
    P_RAG = {"w": normal((8, 64, 32), 0.1)}
    RAG = lambda p, x: jax.lax.ragged_dot(x, p["w"], jnp.array([3, 0, 5, 2, 4, 1, 0, 1], jnp.int32))
    X_RAG = normal((16, 64))
    res["ragged"] = {}
    for name, rec in (("w8a8", jqt.recipes.w8a8()), ("w4", jqt.recipes.w4(group_size=16))):
        for rows in (0, 1):  # the weight decoded to float, and int8 codes with int32 sums
            pol = jqt.KernelPolicy(ragged_int_rows=rows)
            qg = jqt.calibrate(RAG, rec, P_RAG, [(X_RAG,)], progress=False)
            pg = jqt.pack(qg, P_RAG, policy=pol)
            want = jax.jit(jqt.quantize(RAG, qg, policy=pol))(pg, X_RAG)
            for how in ("out", "in"):
                qs, ps = jqt.packed_shardings(qg, pg, AUTO, ops=((".*", how),))
                q2, p2 = jax.device_put((qg, pg), (qs, ps))
                got = jax.jit(jqt.quantize(RAG, q2, policy=pol))(p2, X_RAG)
                res["ragged"][f"{name} {rows} {how}"] = [shard_shape(p2.weights["w"].values),
                                                         float(jnp.abs(got - want).max() / jnp.abs(want).max())]
except Exception as e:
    res["ragged"] = f"{type(e).__name__}: {e}"[:300]
# packed weights that hold their smoothing vector (AWQ), per layer under scan: replicated
res["awq_stacked"], _, _ = case(stacked, P_STACK, X_MLP, jqt.recipes.w4(group_size=32, awq=True), AUTO)

# load straight into shards: device= takes a function of the host (NumPy) PackedParams
path = os.path.join(tempfile.mkdtemp(), "mlp.safetensors")
jqt.save_packed(path, packed, qp)
qp2 = jqt.load(path)
loaded = jqt.load_packed(path, device=lambda host: jqt.packed_shardings(qp2, host, AUTO)[1])
res["loaded"] = {k: shard_shape(w.values) for k, w in loaded.weights.items()}
xs = jax.device_put(X_MLP, NamedSharding(AUTO, P("data")))
y = jax.jit(jqt.quantize(mlp, qp2))(loaded, xs)
res["loaded_diff"] = float(jnp.abs(y - jax.jit(jqt.quantize(mlp, qp))(packed, X_MLP)).max())
# one layer applied three times: packed once, and loaded into shards once
def reuse(p, x):
    for _ in range(3):
        x = jnp.tanh(x @ p["w"])
    return x
P_REUSE = {"w": normal((64, 64), 0.15)}
qr = jqt.calibrate(reuse, jqt.recipes.w8a8(), P_REUSE, [(X_MLP,)], progress=False)
pr = jqt.pack(qr, P_REUSE)
path_r = os.path.join(tempfile.mkdtemp(), "reuse.safetensors")
jqt.save_packed(path_r, pr, qr)
lr = jqt.load_packed(path_r, device=lambda host: jqt.packed_shardings(qr, host, AUTO)[1])
res["reuse"] = {"keys": len(lr.weights), "distinct": len({id(w.values) for w in lr.weights.values()}),
                "shard": shard_shape(lr.weights["w"].values),
                "diff": float(jnp.abs(jax.jit(jqt.quantize(reuse, qr))(lr, xs)
                                      - jax.jit(jqt.quantize(reuse, qr))(pr, X_MLP)).max())}
try:
    jqt.packed_shardings(qp, packed, AUTO, axis="tensor")
except ValueError as e:
    res["bad_axis"] = str(e)
# a decode step called from Python, its cache (batch 8) split over the 8 devices: the step
# returns the cache quantized, split as the float one was, and takes it back so
def kv_step(p, cache, tok):
    pos = cache["pos"]
    def layer(h, xs):
        lp, kc, vc = xs
        q, k, v = [(h @ lp[w]).reshape(8, 2, 8) for w in ("wq", "wk", "wv")]
        kc = jax.lax.dynamic_update_slice(kc, k[:, None], (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v[:, None], (0, pos, 0, 0))
        s = jnp.where(jnp.arange(6) <= pos, jnp.einsum("bhd,bthd->bht", q, kc), -1e30)
        o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s, axis=-1), vc).reshape(8, 16)
        return h + o @ lp["wo"], (kc, vc)
    h, (k, v) = jax.lax.scan(layer, p["emb"][tok], (p["layers"], cache["k"], cache["v"]))
    return h @ p["emb"].T, {"k": k, "v": v, "pos": pos + 1}
P_KV = {"emb": normal((20, 16), 0.5), "layers": {w: normal((2, 16, 16), 0.25) for w in ("wq", "wk", "wv", "wo")}}
KV0 = {"k": jnp.zeros((2, 8, 6, 2, 8)), "v": jnp.zeros((2, 8, 6, 2, 8)), "pos": jnp.int32(0)}
TOKS = jnp.asarray(rng.integers(0, 20, (4, 8)), jnp.int32)
try:
    cal, c = [], KV0
    for t in TOKS[:2]:
        cal.append((c, t))
        c = kv_step(P_KV, c, t)[1]
    qkv = jqt.calibrate(kv_step, jqt.recipes.w8a8_dynamic(kv_cache=True), P_KV, cal, progress=False)
    run_kv = jax.jit(jqt.quantize(kv_step, qkv))
    def loop(cache, toks):
        outs = []
        for t in toks:
            lg, cache = run_kv(P_KV, cache, t)
            outs.append(np.asarray(lg))
        return np.stack(outs), cache
    want_kv, want_c = loop(KV0, TOKS)
    split = NamedSharding(AUTO, P(None, ("data", "model")))
    got_kv, got_c = loop(dict(KV0, k=jax.device_put(KV0["k"], split), v=jax.device_put(KV0["v"], split)),
                         jax.device_put(TOKS, NamedSharding(AUTO, P(None, ("data", "model")))))
    res["kv_step"] = {"diff": float(np.abs(got_kv - want_kv).max()), "out_max": float(np.abs(want_kv).max()),
                      "dtype": str(got_c["k"].values.dtype), "shard": shard_shape(got_c["k"].values),
                      "scale_shard": shard_shape(got_c["k"].scale),
                      "same_codes": bool((np.asarray(got_c["k"].values) == np.asarray(want_c["k"].values)).all())}
except Exception as e:
    res["kv_step"] = f"{type(e).__name__}: {e}"[:300]
# a matmul that names its output sharding on explicit axes (out_sharding=, which JAX asks
# for where the contraction is split: a row-parallel layer), also as a scan's carry: the
# integer kernels ran without it (JAX's error on a split contraction; another output type)
def row_parallel(p, x):
    h = jnp.matmul(x, p["w1"], out_sharding=P("data", "model"))  # column-parallel
    h = jnp.matmul(jax.nn.relu(h), p["w2"], out_sharding=P("data", None))  # row-parallel
    return jax.lax.scan(lambda c, w: (jnp.matmul(jnp.tanh(c), w, out_sharding=P("data", None)), None),
                        h, p["ws"])[0]
P_ROW = {"w1": normal((64, 128), 0.2), "w2": normal((128, 32), 0.1), "ws": normal((2, 32, 32), 0.2)}
SPLITS = {"w1": P(None, "model"), "w2": P("model", None), "ws": P()}
res["out_sharding"] = {}
with jax.set_mesh(EXPLICIT):
    p_row = {k: jax.device_put(v, NamedSharding(EXPLICIT, SPLITS[k])) for k, v in P_ROW.items()}
    x_row = jax.device_put(X_MLP, NamedSharding(EXPLICIT, P("data")))
    for name, rec in (("w8a8", jqt.recipes.w8a8()), ("w4", W4), ("fp8", jqt.recipes.fp8()),
                      ("dynamic", jqt.recipes.w8a8_dynamic())):
        try:
            qx = jqt.calibrate(row_parallel, rec, p_row, [(x_row,)], progress=False)
            sim = jax.jit(jqt.quantize(row_parallel, qx, simulate=True))(p_row, x_row)
            y = jax.jit(jqt.quantize(row_parallel, qx))(jqt.pack(qx, p_row), x_row)
            res["out_sharding"][name] = {
                "diff": float(jnp.abs(y - sim).max()), "max": float(jnp.abs(sim).max()),
                "spec": [a for a in jax.typeof(y).sharding.spec],
                "float_spec": [a for a in jax.typeof(jax.jit(row_parallel)(p_row, x_row)).sharding.spec]}
        except Exception as e:
            res["out_sharding"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
# load_packed(device=<the PackedParams of shardings of weights packed in memory>) on explicit
# axes: their avals record the split a loaded file's do not, and the tree-prefix check of
# device_put failed with JAX's message (hunt63_exportlookups); a tree that fits nothing names
# the file
with jax.set_mesh(EXPLICIT):
    try:
        qx = jqt.calibrate(row_parallel, jqt.recipes.w8a8(), p_row, [(x_row,)], progress=False)
        px = jqt.pack(qx, p_row)
        path_x = os.path.join(tempfile.mkdtemp(), "row.safetensors")
        jqt.save_packed(path_x, px, qx)
        ps = jqt.packed_shardings(qx, px, EXPLICIT)[1]
        lx = jqt.load_packed(path_x, device=ps)
        res["load_tree"] = {k: [bool(np.array_equal(w.values, px.weights[k].values)),
                                w.values.sharding == ps.weights[k].values] for k, w in lx.weights.items()}
        try:
            jqt.load_packed(path_x, device={"w1": ps.weights["w1"].values})
        except ValueError as e:
            res["load_tree_bad"] = str(e)
    except Exception as e:
        res["load_tree"] = f"{type(e).__name__}: {e}"[:300]
# a batched matmul (members of an ensemble, jax.vmap over stacked weights) whose batch axis
# is split over an explicit axis: fp8's kernel re-entered the op's explicit mesh inside its
# auto region and failed in JAX (hunt36_namedaxes)
res["batched_split"] = {}
ens = lambda p, xs: jax.vmap(lambda w, x: x @ w)(p["w"], xs)
with jax.set_mesh(EXPLICIT):
    p_ens = {"w": jax.device_put(normal((4, 16, 32), 0.3), NamedSharding(EXPLICIT, P("model")))}
    x_ens = jax.device_put(normal((4, 8, 16)), NamedSharding(EXPLICIT, P("model")))
    for name, rec in (("fp8", jqt.recipes.fp8()), ("fp8_dynamic", jqt.recipes.fp8(dynamic=True)),
                      ("w8a8", jqt.recipes.w8a8())):
        try:
            qx = jqt.calibrate(ens, rec, p_ens, [(x_ens,)], progress=False)
            sim = jax.jit(jqt.quantize(ens, qx, simulate=True))(p_ens, x_ens)
            y = jax.jit(jqt.quantize(ens, qx))(jqt.pack(qx, p_ens), x_ens)
            res["batched_split"][name] = {"diff": float(jnp.abs(y - sim).max()),
                                          "max": float(jnp.abs(sim).max())}
        except Exception as e:
            res["batched_split"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
# an int4 cache whose features are split over explicit axes into odd counts per device:
# a jqt error naming the cause (JAX's reshape error before; hunt68_kvshard); even counts pack
with jax.set_mesh(EXPLICIT):
    for d in (12, 8):
        buf = jax.device_put(jnp.ones((2, 4, d)), NamedSharding(EXPLICIT, P(None, None, "model")))
        try:
            q = jqt.quantize_cache(buf, "int4")
            res[f"int4_cache_split_{d}"] = str(q.values.dtype)
        except ValueError as e:
            res[f"int4_cache_split_{d}"] = str(e)
# weights split over an explicit axis (outside jax.set_mesh) so that each device's part is
# legal but the int4 bytes (K=36: 18 over 4) or the groups (K=64 in groups of 32: 2 over 4)
# do not divide: calibrate and pack failed with JAX's reshape error; a few-row row-parallel
# weight-only op failed while lowering the native op (hunt71_packshard)
def rowp(p, x):
    return jnp.matmul(x, p["w"], out_sharding=NamedSharding(EXPLICIT, P(None, None)))

def experts(p, x):
    return jnp.einsum("ecd,edf->ecf", x, p["w"])

res["split_groups"] = {}
for name, fn, wshape, wspec, xshape, xspec, rec in (
        ("w4_k36", rowp, (36, 16), P("model", None), (8, 36), P(None, "model"), jqt.recipes.w4(group_size=0)),
        ("nf4_k36", rowp, (36, 16), P("model", None), (16, 36), P(None, "model"), jqt.recipes.nf4(group_size=0)),
        ("w4a8_g32", rowp, (64, 16), P("model", None), (32, 64), P(None, "model"), jqt.recipes.w4a8(group_size=32)),
        ("w8a8_g32", rowp, (64, 16), P("model", None), (32, 64), P(None, "model"), jqt.recipes.w8a8(group_size=32)),
        ("w8_8_rows", rowp, (64, 16), P("model", None), (8, 64), P(None, "model"), jqt.recipes.w8()),
        ("fp8_1_row", rowp, (64, 16), P("model", None), (1, 64), P(None, "model"), jqt.recipes.fp8()),
        ("experts_f36", experts, (4, 32, 36), P(None, None, "model"), (4, 3, 32), P(), jqt.recipes.w4(group_size=16)),
        # K of 1024: the weight-only formulations' scan over K-chunks (review of hunt71)
        ("w4_k1024_1_row", rowp, (1024, 1024), P("model", None), (1, 1024), P(None, "model"), jqt.recipes.w4()),
        ("w8_k1024_16_rows", rowp, (1024, 1024), P("model", None), (16, 1024), P(None, "model"), jqt.recipes.w8())):
    try:
        ws = {"w": jax.device_put(normal(wshape, 0.2), NamedSharding(EXPLICIT, wspec))}
        xs = jax.device_put(normal(xshape), NamedSharding(EXPLICIT, xspec))
        qx = jqt.calibrate(fn, rec, ws, [(xs,)], progress=False)
        sim = jax.jit(jqt.quantize(fn, qx, simulate=True))(ws, xs)
        y = jax.jit(jqt.quantize(fn, qx))(jqt.pack(qx, ws), xs)
        res["split_groups"][name] = {"diff": float(jnp.abs(y - sim).max()), "max": float(jnp.abs(sim).max())}
    except Exception as e:
        res["split_groups"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
print("RESULT" + json.dumps(res))
"""

_RUN = {}


@pytest.fixture(scope="module")
def result():
    # a guard against a hang, not a speed test: the script took 209 s alone on a slow day
    # of the 2-core machine, and CI runs it beside another worker
    return on_devices(_CODE, 8, timeout=900)


def _matches(r):
    # the same function with the same (argument) qparams on 1 and on 8 devices
    assert r["diff"] <= 1e-5 * r["max"], r


@pytest.mark.parametrize("name", ["w4_k36", "nf4_k36", "w4a8_g32", "w8a8_g32", "w8_8_rows",
                                  "fp8_1_row", "experts_f36", "w4_k1024_1_row", "w8_k1024_16_rows"])
def test_explicit_split_weights_whose_bytes_or_groups_do_not_divide(result, name):
    """A weight split over an explicit axis where each device holds a legal part but the
    int4 bytes or the groups along the split axis do not divide over the devices: the axis
    is gathered for the reshape (JAX's ShardingTypeError in calibrate and pack before), and
    a few-row row-parallel op runs (it failed lowering the native op outside set_mesh)."""
    r = result["split_groups"][name]
    assert "error" not in r, r.get("error")
    assert r["diff"] <= 1e-5 * r["max"], r


def test_eight_devices(result):
    assert result["devices"] == 8


def test_w8a8_weights_scales_and_sums_shard_together(result):
    r = result["mlp_w8a8"]
    _matches(r)
    assert r["equal"] and r["diff_const"] == 0.0  # bit-identical here, both ways
    assert r["out_spec"] == ["data", "model"]
    for k, (n, k_) in {"w1": (128, 64), "w2": (256, 128), "w3": (32, 256)}.items():
        w = r["weights"][k]
        assert w["layout"] == "nk" and w["shape"] == [n, k_] and w["devices"] == 8
        assert w["qvalue"] == [n // 4, k_]  # (N, K): output features split over "model"
        assert w["wsum"] == [n // 4] and w["scale"] == [1, n // 4]  # (1, N) scale
        assert not w["gathered"]  # the int8 weights are never all-gathered


def test_weight_only_kn_layout(result):
    r = result["mlp_w8"]
    _matches(r)
    w = r["weights"]["w2"]
    assert w["layout"] == "kn" and w["qvalue"] == [128, 64] and w["scale"] == [1, 64]
    assert not any(v["gathered"] for v in r["weights"].values())


def test_dynamic_activations(result):
    r = result["mlp_dynamic"]
    _matches(r)
    assert r["weights"]["w1"]["qvalue"] == [32, 64] and r["out_spec"] == ["data", "model"]


def test_megatron_rule_shards_the_contracted_axis_and_all_reduces_int32(result):
    r = result["mlp_megatron"]
    _matches(r)
    w2 = r["weights"]["w2"]
    assert w2["qvalue"] == [256, 32]  # K split: partial int32 sums per device
    assert w2["scale"] == [1, 256] and w2["wsum"] == [256]  # per-N arrays replicated
    assert r["s32_all_reduce"]  # the partial sums are added exactly, in int32
    assert not any(v["gathered"] for v in r["weights"].values())


def test_stacked_layers_under_scan(result):
    r = result["stacked"]
    _matches(r)
    w = next(iter(r["weights"].values()))
    assert w["shape"] == [3, 64, 64] and w["qvalue"] == [3, 16, 64]
    assert w["scale_shape"] == [3, 1, 64] and w["scale"] == [3, 1, 16] and w["wsum"] == [3, 16]


def test_convolution_kernels_in_operand_layout(result):
    r = result["cnn"]
    _matches(r)
    c2 = r["weights"]["c2"]
    assert c2["layout"] == "operand" and c2["qvalue"] == [3, 3, 16, 8]  # HWIO: O split
    assert c2["wsum"] == [1, 1, 1, 8] and c2["scale"] == [1, 1, 1, 8]
    assert r["weights"]["d"]["qvalue"] == [2, 512]


def test_int4_codes_and_group_scales_split_their_output_features(result):
    r = result["w4_out"]
    _matches(r)
    w2 = r["weights"]["w2"]  # (128, 256) weight: (64, 256) bytes of two codes, (4, 256) scales
    assert w2["layout"] == "kn" and w2["shape"] == [64, 256] and w2["qvalue"] == [64, 64]
    assert w2["scale_shape"] == [4, 256] and w2["scale"] == [4, 64]
    assert not any(v["gathered"] for v in r["weights"].values())


def test_in_rule_splits_a_grouped_weights_scales_and_sums_with_its_groups(result):
    # K split in 4: each device holds one of w2's 4 groups of 32 inputs, with its scales
    r = result["w4_in"]
    _matches(r)
    w2 = r["weights"]["w2"]
    assert w2["qvalue"] == [16, 256] and w2["scale"] == [1, 256]
    assert not any(v["gathered"] for v in r["weights"].values())
    r = result["w4a8_in"]  # int8 activations: per-group int32 sums (G, N), split alike
    _matches(r)
    w2 = r["weights"]["w2"]
    assert w2["qvalue"] == [16, 256] and w2["scale"] == [1, 256] and w2["wsum"] == [1, 256]
    assert not any(v["gathered"] for v in r["weights"].values())



@pytest.mark.parametrize("name", ["w4", "nf4", "w8", "w4a8"])
@pytest.mark.parametrize("rows", [16, 2])
def test_in_rule_through_the_halves_of_groups_on_explicit_axes(result, name, rows):
    # 2 groups of K over 4 devices: the codes split along K, the group scales replicated
    r = result[f"explicit_in_halves_{name}_{rows}"]
    assert "error" not in r, r
    _matches(r)
    w2 = r["weights"]["w2"]
    assert w2["qvalue"][0] == w2["shape"][0] // 4 and w2["scale"] == w2["scale_shape"] == [2, 256]
    assert not w2["gathered"]  # the codes stay split: partial sums, added across devices
    assert r["out_spec"][0] == "data"


@pytest.mark.parametrize("name", ["w4a8", "w8a8"])
@pytest.mark.parametrize("rows", [16, 2])
def test_in_rule_one_group_a_device_on_explicit_axes_under_the_default_table(result, name, rows):
    # 4 groups of K over 4 devices, codes "nk": each device holds one group, its scales
    # (qparams (G, N)) and its per-group sums (packed (N, G))
    r = result[f"explicit_in_groups_{name}_{rows}"]
    assert "error" not in r, r
    _matches(r)
    w2 = r["weights"]["w2"]
    assert w2["layout"] == "nk" and w2["qvalue"] == [256, w2["shape"][1] // 4], w2
    assert w2["scale"] == [1, 256] and w2["scale_shape"] == [4, 256] and w2["wsum"] == [256, 1], w2
    assert r["out_spec"][0] == "data"


def test_nf4_stacked_layers_and_fp8(result):
    r = result["nf4_stacked"]
    _matches(r)
    w = r["weights"]["ws"]  # (3, 64, 64) weights: (3, 32, 64) bytes, (3, 2, 64) scales
    assert w["qvalue"] == [3, 32, 16] and w["scale"] == [3, 2, 16]
    r = result["fp8"]
    _matches(r)
    w2 = r["weights"]["w2"]
    assert w2["qvalue"] == [128, 64] and w2["scale"] == [1, 64]
    assert not any(v["gathered"] for v in r["weights"].values())


def test_awq_weights_shard_with_their_smoothing_vectors(result):
    r = result["awq_stacked"]
    _matches(r)
    assert r["weights"]["ws"]["qvalue"] == [3, 32, 16]


def test_explicit_mesh_matches(result):
    r = result["explicit"]
    _matches(r)
    assert r["weights"]["w2"]["qvalue"] == [64, 128]


def test_explicit_mesh_keeps_batch_sharding(result):
    assert result["explicit"]["out_spec"] == ["data", "model"]


@pytest.mark.parametrize("name", ["w8a8", "w4", "fp8", "dynamic"])
def test_explicit_mesh_ops_that_name_their_output_sharding(result, name):
    """Column- and row-parallel matmuls with ``out_sharding=`` on explicit axes, the last
    one a scan's carry: the integer path runs them (a split contraction failed in JAX) and
    its output has the float function's type (it lost the split, which broke the carry)."""
    r = result["out_sharding"][name]
    assert "error" not in r, r.get("error")
    assert r["diff"] <= 1e-5 * r["max"]
    assert r["spec"] == r["float_spec"] == ["data", None]


@pytest.mark.parametrize("name", ["w8", "w4", "nf4", "fp8"])
def test_explicit_mesh_weights_decoded_after_a_split_input(result, name):
    """Weights decoded after their op's input (numerics.after) where that input is split
    over an explicit mesh axis, whose slicing to one element JAX does not implement: the
    tie reduces over the split dimension instead. Plain and vmapped over a split batch."""
    r = result["explicit_" + name]
    assert "error" not in r, r.get("error")
    _matches(r)
    assert r["vmap_diff"] <= 1e-5 * r["max"]
    assert r["out_spec"][0] == "data"


_FEW = [f"{name}_{how}" for name in ("w8a8", "w4", "w8", "dynamic", "w4a8", "nf4", "fp8")
        for how in ("plain_2_rows", "vmap_4_rows")]


@pytest.mark.parametrize("mesh", ["auto", "explicit"])
@pytest.mark.parametrize("case", _FEW)
def test_few_rows_split_over_the_batch_axis(result, mesh, case):
    """Ops of 1-8 rows (the native kernels' XLA formulations in a multi-device program)
    with the rows split over a mesh axis, plain and vmapped, as on one device. On explicit
    axes (sharding in types) the rows of a plain op, split in its type, take the many-row
    formulations (the few-row ones stack and reshape rows), and the kernel's output type
    keeps the activation's split: a vmapped scan over stacked layers failed before in
    JAX's scan batching rule, which found a carry typed on no mesh."""
    got = result[f"few_{mesh}_{case}"]
    assert isinstance(got, dict), got  # else the error it raised
    if case == "dynamic_vmap_4_rows":
        # the partitioned program's float arithmetic (per-device shapes, other fusions)
        # rounds differently at the ulp; one row's activation here sits at a rounding
        # near-tie of its per-row scale, whose code flips: that row differs by one int8
        # step's effect, every other row within 1e-5
        assert got["rows_off"] <= 1 and got["max"] <= 0.005 * got["out_max"], got
    else:
        assert got["max"] <= 1e-5, got


@pytest.mark.parametrize("name", ["w8a8", "w4", "w8", "dynamic", "w4a8", "nf4", "fp8"])
def test_quantized_function_inside_shard_map(result, name):
    """``jax.shard_map`` around ``jqt.quantize(f, qp)`` on 8 devices: each device's output
    is the one-device program's on its rows, bit for bit, plain and vmapped; the simulated
    path's gradient with respect to qparams and params (replicated: JAX sums it over the
    devices) is the sum of the per-device gradients to float32 rounding (of the sum of
    their magnitudes: the parts of an LSQ scale's gradient cancel). Before, jqt
    refused the weight that JAX passes through ``pvary``, and its primitives typed their
    outputs as varying over no manual axis."""
    got = result["smap_" + name]
    assert isinstance(got, dict), got
    assert got["diff"] == 0.0 and got["vmap_diff"] == 0.0, got
    assert got["grad_rel"] <= 1e-5, got


@pytest.mark.parametrize("name", [f"{r}_{w}{v}" for r in ("w8a8", "w4") for w in ("packed", "qparams")
                                  for v in ("", "_novma")])
def test_weights_split_by_shard_map_in_specs_are_refused_with_the_fix(result, name):
    """Packed weights or qparams passed to a ``jax.shard_map`` around the quantized function
    split by ``jqt.packed_shardings``' specs: refused (the function reads weights whole),
    the error naming the split mesh axis and the fix (``P()``, or the ``shard_map`` inside
    ``f``). It said "Re-run jqt.pack" or "re-calibrate" before, which does not help; and
    so it did with ``check_vma=False``, where no type says what varies (hunt58_shardkv):
    a dim the mesh axis's size too small names it, ahead of the other causes (it may be a
    genuine mismatch, hunt59_review)."""
    got = result["smap_split_" + name]
    assert got.startswith("QParamsMismatchError: "), got
    assert "inside jax.shard_map" in got and "mesh axis 'd'" in got and "P()" in got, got
    first = got.split("If they reach it whole: ")[0]  # (check_vma=False: a guess, then the rest)
    assert "Re-run jqt.pack" not in first and "re-calibrate" not in first, got
    assert ("check_vma=False" in got) == name.endswith("_novma"), got


@pytest.mark.parametrize("name", ["w8a8", "dynamic_kv", "w4", "w4_kv", "nf4", "fp8"])
def test_explicit_mesh_lookup_region_and_resharded_weights(result, name):
    """Under ``jax.set_mesh`` of 8 explicit devices, a decode loop (tests/shared.py) whose
    embedding lookup JAX runs in an ``auto_axes`` region, typed on another mesh, and
    whose output projection goes through ``reshard`` (split along its contracted, grouped
    features): calibration gives the one-device qparams, the integer path the exported
    one-device program's output with the batch still split, and the simulated gradient
    the one-device gradient. Calibration failed before: statistics made in the region
    were combined outside it, and a split weight could not be cut into groups."""
    got = result["region_" + name]
    assert isinstance(got, dict), got  # else the error it raised
    assert got["qp_rel"] <= 1e-6 and got["spec"] == "data", got
    if name == "fp8":
        # fp8 has 3 mantissa bits: with XLA's default optimization (not this suite's,
        # tests/conftest.py) the 8-device program and the one-device one round one
        # activation at one decode step to neighbouring fp8 codes (a near-tie). One
        # (step, sequence) row of 48 then differs by that code's effect, and the
        # simulated gradient's scale terms with it, so for fp8 only the forward
        # output is compared
        assert got["rows_off"] <= 1 and got["diff"] <= 5e-3 * got["out_max"], got
        return
    assert got["diff"] <= 1e-5 * got["out_max"], got
    # a partitioned program sums in another order; an LSQ scale's gradient is a sum whose
    # parts cancel, so its rounding is relative to their magnitudes, not to the result
    assert got["grad_rel"] <= 5e-4, got


def test_explicit_mesh_report_awq_and_gptq_over_split_rows(result):
    """On 8 explicit devices with the batch split: ``jqt.report`` of the decode loop (its
    lookup in the ``auto_axes`` region, its ops under two scans), AWQ's smoothing vectors
    and GPTQ's weights of an MLP, as without a mesh. Each failed before: AWQ's and
    GPTQ's Gram matrices and the report's histogram reduce over split rows, which JAX
    asks for an output sharding there, and JAX typed the report's ``all_gather`` of a
    split value wrongly (the new leading lane axis took the split)."""
    got = result["explicit_tools"]
    assert isinstance(got, dict), got
    assert got["report_same_rows"] and got["report_sqnr_diff"] <= 0.01, got
    assert got["awq_gptq_rel"] <= 1e-5, got


def test_explicit_mesh_report_of_a_function_that_vmaps_its_own_part(result):
    """``jqt.report`` of a function that ``jax.vmap``s a per-example part (a scan over stacked
    layers inside), its batch split on 8 explicit devices: the rows of the report without a
    mesh, for ``w8a8`` and ``w4`` g8. The report's lane exchange (an ``all_gather`` along a new
    last axis) then runs under the user's ``vmap`` as well as its own."""
    got = result["explicit_report_vmap"]
    assert isinstance(got, dict), got
    assert got["rows"] == 8 and got["same_rows"] and got["sqnr_diff"] <= 0.01, got


@pytest.mark.parametrize("name", ["w8a8", "w4", "dynamic"])
def test_auto_axes_region_around_a_scan_over_stacked_layers(result, name):
    """A model part run under ``jax.sharding.auto_axes`` on 8 explicit devices, holding a
    ``lax.scan`` over stacked layers: the one-device qparams, and the exported one-device
    program's output with the batch still split. It failed before (the scan's ops read
    stacked weights typed on the function's mesh)."""
    got = result["auto_axes_" + name]
    assert isinstance(got, dict), got
    assert got["qp_rel"] <= 1e-6 and got["diff"] <= 1e-5 and got["spec"] == "data", got


@pytest.mark.parametrize("name", ["fp8", "fp8_dynamic", "w8a8"])
def test_explicit_mesh_batched_matmul_split_over_its_batch_axis(result, name):
    r = result["batched_split"][name]
    assert "error" not in r, r.get("error")
    _matches(r)


def test_traced_under_a_mesh_then_run_without_one(result):
    """A quantized function traced under ``jax.set_mesh`` (8 explicit devices) on an
    unsplit input and then called without a mesh reuses the jaxpr and runs as it did
    (its ops in the calling context, not retyped onto the mesh its equations name)."""
    assert result["traced_in_mesh_run_outside"] == 0.0, result["traced_in_mesh_run_outside"]


def test_ragged_dot_expert_weights_split_over_the_experts_or_k(result):
    """``lax.ragged_dot``'s packed expert weights (8 experts of 64 x 32, int8 and int4 g16
    two per byte along N) split over 4 devices of the mesh's model axis along the experts
    (``"out"``) or along K (``"in"``), run as on one device, the weight decoded to float
    or as int8 codes with int32 sums."""
    got = result["ragged"]
    assert isinstance(got, dict), got
    assert len(got) == 8
    for case, (shard, diff) in got.items():
        out = case.endswith("out")
        four_bit = case.startswith("w4")
        assert shard == ([2, 64, 16 if four_bit else 32] if out else [8, 16, 16 if four_bit else 32]), case
        assert diff <= 1e-6, (case, diff)


def test_load_packed_straight_into_shards(result):
    assert result["loaded"] == {"w1": [32, 64], "w2": [64, 128], "w3": [8, 256]}
    assert result["loaded_diff"] == 0.0


def test_load_packed_takes_the_shardings_of_weights_packed_on_explicit_axes(result):
    assert result["load_tree"] == {k: [True, True] for k in ("w1", "w2", "ws")}, result["load_tree"]
    assert result["load_tree_bad"].startswith("jqt.load_packed: ") and "row.safetensors" in \
        result["load_tree_bad"] and "jqt.packed_shardings(qparams, host, mesh)" in result["load_tree_bad"]


def test_a_weight_several_ops_read_loads_into_shards_once(result):
    # three ops, one array of codes (each op's sharding is the same): load_packed with a
    # tree of shardings put it once per op before
    assert result["reuse"] == {"keys": 3, "distinct": 1, "shard": [16, 64], "diff": 0.0}


def test_unknown_mesh_axis(result):
    assert "not 'tensor'" in result["bad_axis"]


def test_a_decode_step_returns_its_cache_quantized_and_split(result):
    """A decode step called from Python with its cache's batch split over the 8 devices
    (docs/generate.md): the quantized cache it returns stays split along the batch, codes
    and scales alike, and the logits and codes are the one-device ones."""
    got = result["kv_step"]
    assert isinstance(got, dict), got  # else the error it raised
    assert got["dtype"] == "int8" and got["shard"] == [2, 1, 6, 2, 8] and got["scale_shard"] == [2, 1, 6, 2, 1], got
    assert got["same_codes"] and got["diff"] <= 1e-5 * got["out_max"], got


def test_an_int4_cache_split_into_odd_feature_counts_names_the_cause(result):
    assert "split over explicit mesh axes into 4 parts of 3" in result["int4_cache_split_12"]
    assert "int8 cache (kv_cache=True)" in result["int4_cache_split_12"]
    assert result["int4_cache_split_8"] == "uint8"
