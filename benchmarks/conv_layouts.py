"""int8 convolutions by layout on the CPU: float32 against w8a8, w8a8_dynamic and w4a8.

    .venv/bin/python benchmarks/conv_layouts.py [--rounds 9] [--markdown]

XLA:CPU has a fast int8 convolution for 2-D ``NHWC`` / ``HWIO`` only; in a 1-D, 3-D or
``NCHW`` layout it widens the codes to int32. The CPU table runs those as float32
convolutions of the codes over chunks of input channels, exact
(``KernelPolicy.conv_codes_as_float``). Each layer is one ``lax.conv_general_dilated``
with random weights, calibrated on one batch and packed; the ``[conv_codes_as_float=
False]`` rows run XLA's int8 convolution, the table before. Every variant of a layer
runs interleaved, round-robin, after warm-up; medians and ratios to float32 in the same
rounds. Prints a table and a ``RESULTS {json}`` line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import paths  # noqa: F401  (this checkout's jqt)
import jax
import jax.numpy as jnp
import numpy as np

import cli
import jqt
import timing

# name -> (dimension numbers, input shape, kernel shape)
LAYERS = {
    "1-D NWC, 8 x 512 x 64, 3 taps, 64 out": (("NWC", "WIO", "NWC"), (8, 512, 64), (3, 64, 64)),
    "1-D NWC, 1 x 2048 x 256, 5 taps, 256 out": (("NWC", "WIO", "NWC"), (1, 2048, 256), (5, 256, 256)),
    "2-D NCHW, 8 x 64 x 32 x 32, 3x3, 64 out": (("NCHW", "OIHW", "NCHW"), (8, 64, 32, 32), (64, 64, 3, 3)),
    "3-D NDHWC, 2 x 8 x 16 x 16 x 16, 3x3x3, 32 out": (("NDHWC", "DHWIO", "NDHWC"), (2, 8, 16, 16, 16),
                                                       (3, 3, 3, 16, 32)),
    "2-D NHWC, 8 x 32 x 32 x 64, 3x3, 64 out (int8 either way)": (("NHWC", "HWIO", "NHWC"),
                                                                 (8, 32, 32, 64), (3, 3, 64, 64)),
    # grouped: one float32 convolution where every group's sums stay below 2**24 under the
    # weight's own code range (int4: |q| <= 7), XLA's int32 one otherwise
    "2-D NCHW, 1 x 256 x 16 x 16, 3x3, 2 groups of 128, 256 out": (("NCHW", "OIHW", "NCHW"),
                                                                  (1, 256, 16, 16), (256, 128, 3, 3), 2),
}
RECIPES = {"w8a8": jqt.recipes.w8a8, "w8a8_dynamic": jqt.recipes.w8a8_dynamic, "w4a8": jqt.recipes.w4a8}


def layer(spec, xs, ws, rounds, groups=1):
    rng = np.random.default_rng(0)
    nd = len(spec[0]) - 2
    f = lambda w, x: jax.lax.conv_general_dilated(x, w, (1,) * nd, "SAME", dimension_numbers=spec,
                                                  feature_group_count=groups)
    w = jnp.asarray(rng.standard_normal(ws) / np.sqrt(np.prod(ws[:-1])), jnp.float32)
    x = jnp.asarray(rng.standard_normal(xs), jnp.float32)
    cpu = jqt.KernelPolicy.for_backend("cpu")
    calls = {"float32": lambda fn=jax.jit(f): fn(w, x)}
    for name, recipe in RECIPES.items():
        qp = jqt.calibrate(f, recipe(), w, [(x,)], progress=False)
        packed = jqt.pack(qp, w)
        for label, pol in ((name, cpu), (f"{name} [conv_codes_as_float=False]",
                                         dataclasses.replace(cpu, conv_codes_as_float=False))):
            fn = jax.jit(jqt.quantize(f, qp, policy=pol))
            calls[label] = lambda fn=fn, packed=packed: fn(packed, x)
    for call in calls.values():  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(call())
    samples = timing.interleaved(calls, rounds)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {k: {"ms": 1e3 * v, "ratio": v / med["float32"]} for k, v in med.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=cli.positive_int, default=9,
                    help="interleaved timing rounds per layer (default 9)")
    ap.add_argument("--markdown", action="store_true", help="(accepted; the table is markdown either way)")
    a = ap.parse_args()
    print(f"jax {jax.__version__} on {jax.default_backend()}; {a.rounds} interleaved rounds; "
          f"policy: conv_codes_as_float={jqt.KernelPolicy.for_backend('cpu').conv_codes_as_float}")
    results = {}
    for name, (spec, xs, ws, *groups) in LAYERS.items():
        results[name] = layer(spec, xs, ws, a.rounds, *groups)
    cols = list(next(iter(results.values())))
    print("| layer | " + " | ".join(cols) + " |")
    print("| --- |" + " --- |" * len(cols))
    for name, r in results.items():
        cells = [f"{r[c]['ms']:.2f} ms" if c == "float32" else f"{r[c]['ratio']:.2f}x" for c in cols]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
