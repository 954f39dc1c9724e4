"""Which kernels XLA compiles one 4096 x 4096 layer's one-row quantized matmul into.

    python benchmarks/gpu_hlo.py        # on a GPU; runs anywhere (its CPU programs differ)

Prints the ENTRY computation of the optimized HLO for ``w4 g128`` under the backend's
kernel table with ``reduce_rows=0`` (on a GPU: decode, then a matmul) and with
``reduce_rows=1`` (the GPU table: one sum over K, codes packed ``(N, K)``), and for ``w8``
with ``reduce_rows=1``; and each one's time a call, dispatch included (a probe, not a
benchmark: ``gpu.py`` times them). ``benchmarks/results/gpu-h100.md`` quotes what an H100 printed.
"""
import argparse
import dataclasses
import re
import time

import paths  # noqa: F401  (this checkout's jqt)
import jax
import jax.numpy as jnp
import numpy as np

import jqt

R = jqt.recipes
N = 4096


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    w = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((N, N)) / 64, jnp.bfloat16)}
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, N)), jnp.bfloat16)
    f = lambda p, x: x @ p["w"]
    base = dataclasses.replace(jqt.KernelPolicy.for_backend(), native_gemv_rows=0)
    w4 = lambda: R.w4(group_size=128)
    cases = [("w4 g128, reduce_rows=0", w4, dict(reduce_rows=0)),
             ("w4 g128, reduce_rows=1", w4, dict(reduce_rows=1)),
             ("w8, reduce_rows=1", R.w8, dict(reduce_rows=1))]
    for name, make, fields in cases:
        pol = dataclasses.replace(base, **fields)
        qp = jqt.calibrate(f, make(), w, [(x,)], progress=False)
        packed = jqt.pack(qp, w, policy=pol)
        fn = jax.jit(jqt.quantize(f, qp, policy=pol))
        hlo = fn.lower(packed, x).compile().as_text()
        entry = hlo[hlo.index("ENTRY"):].split("\n}\n")[0]
        lines = [re.sub(r", metadata=\{.*", "", l.strip()) for l in entry.splitlines()]
        print(f"== {name} (weight packed {packed.weights['w'].layout})")
        print("\n".join(l[:200] for l in lines if "constant(" not in l))
        fn(packed, x).block_until_ready()
        t = time.perf_counter()
        for _ in range(200):
            out = fn(packed, x)
        out.block_until_ready()
        print(f"   {(time.perf_counter() - t) / 200 * 1e6:.1f} us a call, dispatch included\n")


if __name__ == "__main__":
    main()
