"""Would affine regions (TVM's idea) make jqt faster under XLA? A measurement.

jqt's integer path returns to float after each quantized op: int32 accumulator ->
float (scale, bias, relu, pool) -> quantize for the next op. Affine regions instead
stay on integers: fold bias and zero-point corrections into an int32 constant, requantize
int32 -> int8 with one multiplier, run relu as ``max(q, zero_point)`` and max pool on int8.

This script builds both by hand from the same jqt calibration (the second is what an
affine-region rewrite would emit) and times them against float, interleaved, medians:
  python benchmarks/affine_regions.py
"""
from __future__ import annotations

import argparse
import time

import paths  # noqa: F401  (this checkout's jqt)
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jqt

I8, I32, F32 = jnp.int8, jnp.int32, jnp.float32


def mlp(p, x):
    for i, (w, b) in enumerate(p):
        x = x @ w + b
        if i < len(p) - 1:
            x = jax.nn.relu(x)
    return x


def _q(x, s, z):
    return jnp.clip(jnp.round(x / s) + z, -128, 127).astype(I8)


def _mm(q, w_nk):
    m = q.shape[0]
    if m < 2:
        q = jnp.pad(q, ((0, 2 - m), (0, 0)))
    return lax.dot_general(q, w_nk, (((1,), (1,)), ((), ())), preferred_element_type=I32)[:m]


def affine_mlp_consts(qp, packed, p):
    """Per layer: int8 (N, K) weight, folded int32 bias, float multiplier, next zero point."""
    keys = list(qp)
    layers = []
    for i, k in enumerate(keys):
        a, wq = qp[k].lhs, qp[k].rhs
        s_in, z_in = a.scale, jnp.round(a.zero_point)
        sw = wq.scale.reshape(-1)
        pw = packed.weights[k]
        bias = jnp.round(p[i][1] / (s_in * sw)).astype(I32) - z_in.astype(I32) * pw.sums
        if i + 1 < len(keys):
            nxt = qp[keys[i + 1]].lhs
            layers.append((pw.values, bias, s_in * sw / nxt.scale, jnp.round(nxt.zero_point)))
        else:
            layers.append((pw.values, bias, s_in * sw, None))
    first = qp[keys[0]].lhs
    return (first.scale, jnp.round(first.zero_point)), layers


def affine_mlp(consts, x):
    (s0, z0), layers = consts
    q = _q(x, s0, z0)
    for w, bias, mult, z_next in layers:
        acc = _mm(q, w) + bias
        if z_next is None:
            return acc.astype(F32) * mult
        q = jnp.clip(jnp.round(acc.astype(F32) * mult) + z_next, jnp.maximum(-128, z_next), 127).astype(I8)


def cnn(p, x):
    dn = ("NHWC", "HWIO", "NHWC")
    x = jax.nn.relu(lax.conv_general_dilated(x, p["c1"], (1, 1), "SAME", dimension_numbers=dn) + p["b1"])
    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    x = jax.nn.relu(lax.conv_general_dilated(x, p["c2"], (1, 1), "SAME", dimension_numbers=dn) + p["b2"])
    return x.mean(axis=(1, 2))


def affine_cnn_consts(qp, packed, p):
    a1, w1, a2, w2 = qp["c1"].lhs, qp["c1"].rhs, qp["c2"].lhs, qp["c2"].rhs
    s1, s2 = w1.scale.reshape(-1), w2.scale.reshape(-1)
    z1, z2 = jnp.round(a1.zero_point), jnp.round(a2.zero_point)
    b1 = jnp.round(p["b1"] / (a1.scale * s1)).astype(I32)
    b2 = jnp.round(p["b2"] / (a2.scale * s2)).astype(I32)
    return dict(s1=a1.scale, z1=z1, w1=packed.weights["c1"].values, b1=b1, ws1=packed.weights["c1"].sums,
                m1=a1.scale * s1 / a2.scale, z2=z2, w2=packed.weights["c2"].values, b2=b2,
                ws2=packed.weights["c2"].sums, m2=a2.scale * s2)


def affine_cnn(c, x):
    dn = ("NHWC", "HWIO", "NHWC")
    q = _q(x, c["s1"], c["z1"])
    q = lax.pad(q, c["z1"].astype(I8), [(0, 0, 0), (1, 1, 0), (1, 1, 0), (0, 0, 0)])
    acc = lax.conv_general_dilated(q, c["w1"], (1, 1), "VALID", dimension_numbers=dn,
                                   preferred_element_type=I32)
    acc = acc + (c["b1"] - c["z1"].astype(I32) * c["ws1"].reshape(-1))
    q = jnp.clip(jnp.round(acc.astype(F32) * c["m1"]) + c["z2"], jnp.maximum(-128, c["z2"]), 127).astype(I8)
    q = lax.reduce_window(q, jnp.int8(-128), lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")  # int8 pool
    q = lax.pad(q, c["z2"].astype(I8), [(0, 0, 0), (1, 1, 0), (1, 1, 0), (0, 0, 0)])
    acc = lax.conv_general_dilated(q, c["w2"], (1, 1), "VALID", dimension_numbers=dn,
                                   preferred_element_type=I32)
    acc = acc + (c["b2"] - c["z2"].astype(I32) * c["ws2"].reshape(-1))
    return jax.nn.relu(acc.astype(F32) * c["m2"]).mean(axis=(1, 2))


def _time(fns, rounds):
    for g, a in fns.values():
        for _ in range(3):
            jax.block_until_ready(g(*a))
    ts = {k: [] for k in fns}
    for _ in range(rounds):
        for k, (g, a) in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(g(*a))
            ts[k].append(time.perf_counter() - t)
    return {k: float(np.median(v)) * 1e3 for k, v in ts.items()}


def _row(name, fns, ref, rounds):
    t = _time(fns, rounds)
    outs = {k: np.asarray(g(*a)) for k, (g, a) in fns.items()}
    err = {k: float(np.abs(o - outs["float"]).max() / np.abs(outs["float"]).max()) for k, o in outs.items()}
    cells = "  ".join(f"{k} {t[k]:.3f} ms ({t[k] / t['float']:.2f}x, err {err[k]:.3f})" for k in fns)
    print(f"{name:<18} {cells}")


def main(rounds=40):
    rng = np.random.default_rng(0)
    width, depth = 1024, 12
    p = [(jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), F32),
          jnp.asarray(rng.normal(size=width) * 0.1, F32)) for _ in range(depth)]
    for batch in (1, 8, 64):
        xs = [jnp.asarray(rng.normal(size=(batch, width)), F32) for _ in range(4)]
        qp = jqt.calibrate(mlp, jqt.recipes.w8a8(), p, [(x,) for x in xs], progress=False)
        packed = jqt.pack(qp, p)
        consts = affine_mlp_consts(qp, packed, p)
        fns = {"float": (jax.jit(mlp), (p, xs[0])), "jqt": (jax.jit(jqt.quantize(mlp, qp)), (packed, xs[0])),
               "affine": (jax.jit(affine_mlp), (consts, xs[0]))}
        _row(f"mlp12x1024 b{batch}", fns, "float", rounds)
    pc = {"c1": jnp.asarray(rng.normal(size=(3, 3, 64, 64)) / 24, F32), "b1": jnp.zeros(64, F32) + 0.05,
          "c2": jnp.asarray(rng.normal(size=(3, 3, 64, 128)) / 24, F32), "b2": jnp.zeros(128, F32) + 0.05}
    for batch in (1, 8):
        xs = [jnp.asarray(rng.normal(size=(batch, 32, 32, 64)), F32) for _ in range(3)]
        qp = jqt.calibrate(cnn, jqt.recipes.w8a8(), pc, [(x,) for x in xs], progress=False)
        packed = jqt.pack(qp, pc)
        fns = {"float": (jax.jit(cnn), (pc, xs[0])), "jqt": (jax.jit(jqt.quantize(cnn, qp)), (packed, xs[0])),
               "affine": (jax.jit(affine_cnn), (affine_cnn_consts(qp, packed, pc), xs[0]))}
        _row(f"conv-pool-conv b{batch}", fns, "float", rounds)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    main()
