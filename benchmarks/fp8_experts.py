"""fp8 per-channel expert weights (a mixture written ``einsum("ecd,edf->ecf")``, 8 experts
of 1024 x 2816): one expert at a time in a ``lax.map`` (``experts.decoded_map``, the CPU
table's ``batched_map``, what jqt runs since hunt81_hloaudit) against the whole stack
decoded for one batched dot (``batched_map=False``: what fp8 experts ran before), and
float32, at 1, 8 and 128 tokens per expert.

    .venv/bin/python benchmarks/fp8_experts.py

Compiled once each, then 30 interleaved rounds; median ms and the ratio to float32.
"""
import dataclasses
import time
import warnings

import jax
import numpy as np

import jqt

warnings.simplefilter("ignore")


def main():
    e, d, f_ = 8, 1024, 2816
    p = {"w": jax.random.normal(jax.random.key(0), (e, d, f_)) * 0.03}
    f = lambda p, x: jax.numpy.einsum("ecd,edf->ecf", x, p["w"])  # noqa: E731
    cal = [(jax.random.normal(jax.random.key(1), (e, 16, d)),)]
    qp = jqt.calibrate(f, jqt.recipes.fp8(), p, cal, progress=False)
    cpu = jqt.KernelPolicy.for_backend()
    whole = dataclasses.replace(cpu, batched_map=False)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; fp8 experts {e} x {d} x {f_}; "
          "median ms of 30 interleaved rounds (ratio to float32)")
    for c in (1, 8, 128):
        x = jax.random.normal(jax.random.key(2), (e, c, d))
        runs = {"float32": (jax.jit(f), p)}
        for name, pol in (("per expert (map)", cpu), ("whole stack", whole)):
            runs[name] = (jax.jit(jqt.quantize(f, qp, policy=pol)), jqt.pack(qp, p, policy=pol))
        for g, a in runs.values():
            g(a, x).block_until_ready()
        ts = {k: [] for k in runs}
        for r in range(30):
            for k in (list(runs) if r % 2 else list(runs)[::-1]):
                g, a = runs[k]
                t = time.perf_counter()
                g(a, x).block_until_ready()
                ts[k].append(time.perf_counter() - t)
        med = {k: np.median(v) * 1e3 for k, v in ts.items()}
        print(f"{c:4d} tokens/expert: " + "  ".join(
            f"{k} {v:.2f} ({v / med['float32']:.2f}x)" for k, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
