"""How many weight elements the simulated path's gradient counts as clipped (zero gradient).

    python benchmarks/clip_gradients.py        # a few seconds

A 1024 x 1024 float32 layer with random normal weights, calibrated by each preset on one
batch: the elements whose gradient through ``jqt.quantize(f, qp, simulate=True)`` is zero,
and those whose ``x / scale`` lies past the grid's end yet get a gradient (within half a
step of it, where the codes round back onto the grid). Before 2026-11-27 the nf4 and fp8
grids gave those none; the int grid always gave them one.
"""
import argparse

import paths  # noqa: F401  (this checkout's jqt)
import jax
import jax.numpy as jnp
import numpy as np

import jqt

R = jqt.recipes
N = 1024


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    rng = np.random.default_rng(0)
    w = {"w": jnp.asarray(rng.standard_normal((N, N)) / np.sqrt(N), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((8, N)), jnp.float32)
    f = lambda p, x: x @ p["w"]
    print(f"{'preset':12s} {'zero gradient':>14s} {'past the end, with a gradient':>30s}  (of {N * N})")
    for name, r in (("nf4 g64", R.nf4(group_size=64)), ("fp8", R.fp8()), ("w4 g128", R.w4(group_size=128))):
        qp = jqt.calibrate(f, r, w, [(x,)], progress=False)
        sim = jqt.quantize(f, qp, simulate=True)
        g = jax.jit(jax.grad(lambda p, x: jnp.sum(sim(p, x) ** 2)))(w, x)["w"]
        q = qp["w"].rhs
        s = np.asarray(q.scale)
        s = np.repeat(s, N // s.shape[0], axis=0) if s.ndim == 2 else s
        v, (lo, hi) = np.asarray(w["w"]) / s, q.qtype.bounds
        g = np.asarray(g)
        past = int((((v < lo) | (v > hi)) & (g != 0)).sum())
        print(f"{name:12s} {int((g == 0).sum()):14d} {past:30d}")


if __name__ == "__main__":
    main()
