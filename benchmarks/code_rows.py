"""A/B of ``dense.rows_kept``: the optimization barrier on a code matmul's activation rows
(it keeps XLA:CPU from folding a transpose of ``f``'s into the int8 or bfloat16 dot, which
ran ``x.T @ w`` at 13x float32, or failed, hunt81_hloaudit) against none, on ``x @ w``
where nothing is transposed: the barrier's cost where it has nothing to do.

    .venv/bin/python benchmarks/code_rows.py          # 3 shapes x 4 presets x 4 row counts

Both programs are compiled once, then timed in interleaved rounds (40 each, the order
alternating); each line gives the medians and their ratio (barrier / none).
"""
import time
import warnings

import jax
import numpy as np

import jqt
from jqt._src import dense

warnings.simplefilter("ignore")
ON = dense.rows_kept


def build(f, qp, packed, x, barrier):
    dense.rows_kept = ON if barrier else (lambda a: a)
    try:
        g = jax.jit(jqt.quantize(f, qp))
        g(packed, x).block_until_ready()  # traced and compiled under this choice
    finally:
        dense.rows_kept = ON
    return g


def main():
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; median ms of 40 interleaved rounds")
    ratios = []
    for k, n in [(384, 1536), (1536, 384), (1024, 1024)]:
        p = {"w": jax.random.normal(jax.random.key(0), (k, n)) * 0.05}
        f = lambda p, x: x @ p["w"]  # noqa: E731
        for name in ["w8a8", "w8a8_dynamic", "fp8", "w4a8"]:
            for rows in [1, 8, 64, 512]:
                x = jax.random.normal(jax.random.key(1), (rows, k))
                qp = jqt.calibrate(f, getattr(jqt.recipes, name)(), p, [(x,)], progress=False)
                pk = jqt.pack(qp, p)
                gs = {b: build(f, qp, pk, x, b) for b in (True, False)}
                ts = {True: [], False: []}
                for r in range(40):
                    for b in ((True, False) if r % 2 else (False, True)):
                        t = time.perf_counter()
                        gs[b](pk, x).block_until_ready()
                        ts[b].append(time.perf_counter() - t)
                on, off = np.median(ts[True]) * 1e3, np.median(ts[False]) * 1e3
                ratios.append(on / off)
                print(f"{k}x{n} {name:13s} rows={rows:4d}  barrier {on:7.3f}  none {off:7.3f}  "
                      f"ratio {on / off:.3f}", flush=True)
    print(f"median ratio over {len(ratios)} cases: {np.median(ratios):.3f}")


if __name__ == "__main__":
    main()
