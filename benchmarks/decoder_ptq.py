"""The outlier algorithms on the Llama-style decoder of ``examples/decoder.py``.

    python benchmarks/decoder_ptq.py              # trains the decoder once (cached), then
                                                  # about 10 minutes on 2 cores
    python benchmarks/decoder_ptq.py --markdown

The function quantized is the decoder's loss, ``decoder.loss(params, tokens)``, as it
is (layers stacked under ``lax.scan``, tied embeddings). Calibration: 8 batches of 8
windows of 256 bytes from the training split; GPTQ on the same batches. Evaluation:
the held-out loss ``decoder.heldout_loss`` measures (16 batches of 16 windows of the
held-out files), through ``jqt.quantize`` with the packed weights. Reports each
variant's loss and its increase over float, and the ratios the targets are about:
GPTQ's increase over plain rounding's (w4 g128) and rotation's over plain w4a8's.
The 4-bit rows round with absmax ranges (``WeightMinMax``), the plain rounding the
algorithms are measured against; the rows named ``mse`` use the 4-bit presets' own
default, ranges clipped at their squared-error optimum (``jqt.recipes.WEIGHT_MSE_4BIT``).

Prints a table and a ``RESULTS {json}`` line.
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
import decoder
import jqt
from formats import table

R = jqt.recipes


def head_float(recipe):
    """``recipe`` with the tied output matmul (``h @ embed.T``) kept float; the lookup of
    the same table stays quantized. GPTQ leaves a tied table to plain rounding (re-rounding
    it for the matmul would change the lookup's table), so this shows what GPTQ does on
    the ops it re-rounds."""
    return jqt.Recipe(rules=(jqt.Rule(key="embed", ops=("dot_general",), weight=None),) + recipe.rules)


ABS = jqt.calibrators.WeightMinMax()  # absmax ranges: "plain rounding" as these rows measured it
VARIANTS = {  # name -> (recipe, run GPTQ)
    "w8a8": (R.w8a8, False),
    "w8a8 smooth 0.5": (lambda: R.w8a8(smooth=0.5), False),
    "w4 g128": (lambda: R.w4(group_size=128, weight_calibrator=ABS), False),
    "w4 g128 gptq": (lambda: R.w4(group_size=128, weight_calibrator=ABS), True),
    "w4 g128 awq": (lambda: R.w4(group_size=128, awq=True, weight_calibrator=ABS), False),
    "w4 g128 awq+gptq": (lambda: R.w4(group_size=128, awq=True, weight_calibrator=ABS), True),
    "w4 g128 head float": (lambda: head_float(R.w4(group_size=128, weight_calibrator=ABS)), False),
    "w4 g128 head float gptq": (lambda: head_float(R.w4(group_size=128, weight_calibrator=ABS)), True),
    "w4a8": (lambda: R.w4a8(weight_calibrator=ABS), False),
    "w4a8 rotate": (lambda: R.w4a8(rotate=True, weight_calibrator=ABS), False),
    "w4a8 rotate+gptq": (lambda: R.w4a8(rotate=True, weight_calibrator=ABS), True),
    "w4a8 g128": (lambda: R.w4a8(group_size=128, weight_calibrator=ABS), False),
    "w4a8 g128 rotate": (lambda: R.w4a8(group_size=128, rotate=True, weight_calibrator=ABS), False),
    # the 4-bit presets as they are now: ranges clipped by jqt.recipes.WEIGHT_MSE_4BIT
    "w4 g128 mse": (lambda: R.w4(group_size=128), False),
    "w4 g128 mse+gptq": (lambda: R.w4(group_size=128), True),
    "w4a8 mse": (R.w4a8, False),
    "w4a8 g128 mse": (lambda: R.w4a8(group_size=128), False),
    "nf4 g64 absmax": (lambda: R.nf4(weight_calibrator=ABS), False),
    "nf4 g64 mse": (R.nf4, False),
}


def heldout(fn, params):
    return float(np.mean([fn(params, t) for t in decoder.batches(
        "heldout", 16, 256, decoder.EVAL_BATCHES, decoder.EVAL_SEED)]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    ap.add_argument("--only", type=cli.names(list(VARIANTS)),
                    help=f"comma-separated variant names: {', '.join(VARIANTS)} (default: all)")
    a = ap.parse_args()
    params, info = decoder.load_or_train()
    f = decoder.loss
    calib = [(t,) for t in decoder.batches("train", 8, 256, 8, seed=99)]
    base = heldout(jax.jit(f), params)
    results = {"float32": {"loss": base}}
    names = a.only or list(VARIANTS)
    for name in names:
        make, use_gptq = VARIANTS[name]
        print(f"[decoder] {name}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        qp = jqt.calibrate(f, make(), params, calib, progress=False)
        p = jqt.gptq(f, qp, params, calib, progress=False) if use_gptq else params
        secs = time.perf_counter() - t0
        loss = heldout(jax.jit(jqt.quantize(f, qp)), jqt.pack(qp, p))
        results[name] = {"loss": loss, "increase": loss - base, "quantize_s": secs}
    rows = [("float32", f"{base:.4f}", "-", "-")]
    for name in names:
        r = results[name]
        rows.append((name, f"{r['loss']:.4f}", f"{r['increase']:+.4f}", f"{r['quantize_s']:.1f}"))
    print(f"decoder: {decoder.param_count(params) / 1e6:.2f}M parameters, held-out loss "
          f"{base:.4f} nats/byte (float32)")
    table(("variant", "held-out loss", "increase", "quantize s"), rows, a.markdown)
    for new, old in (("w4 g128 gptq", "w4 g128"), ("w4 g128 awq", "w4 g128"),
                     ("w4 g128 awq+gptq", "w4 g128"),
                     ("w4 g128 head float gptq", "w4 g128 head float"), ("w4a8 rotate", "w4a8"),
                     ("w4a8 rotate+gptq", "w4a8"), ("w4a8 g128 rotate", "w4a8 g128"),
                     ("w4 g128 mse", "w4 g128"), ("w4 g128 mse+gptq", "w4 g128"),
                     ("w4a8 mse", "w4a8"), ("w4a8 g128 mse", "w4a8 g128"),
                     ("nf4 g64 mse", "nf4 g64 absmax")):
        if new in results and old in results:
            ratio = results[new]["increase"] / results[old]["increase"]
            results[f"{new} / {old}"] = ratio
            print(f"increase {new} / {old}: {ratio:.2f}")
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
