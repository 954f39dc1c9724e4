"""Artifact sizes: the files and the serialized export of a quantized MLP, per preset.

    python benchmarks/artifacts.py            # about 30 s on 2 cores

A 3-layer MLP of width 1,024 with a 10-way head (ReLU between, biases; float32,
random weights with a fixed seed: sizes do not depend on training), calibrated on
one batch of 8. For each preset it writes, in a temporary folder (removed at the end):

- the float32 params as one safetensors file (``safetensors.numpy.save_file``);
- ``jqt.save_packed(path, jqt.pack(qp, params), qp)``: the packed weights and their qparams;
- ``jqt.save(path, qp)``: the qparams alone;
- ``jax.export.export(jax.jit(jqt.quantize(mlp, qp)))(packed, x).serialize()``: the
  StableHLO artifact (the weights are its arguments, not inside it);

and prints their bytes as a markdown table (docs/export.md quotes it).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jqt  # noqa: E402

WIDTH = 1024
PRESETS = (("w8a8", jqt.recipes.w8a8()), ("w8", jqt.recipes.w8()),
           ("w4 g128", jqt.recipes.w4(group_size=128)), ("nf4 g64", jqt.recipes.nf4()),
           ("fp8", jqt.recipes.fp8()))


def mlp(p, x):
    for i in range(3):
        x = jax.nn.relu(x @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
    return x @ p["head"]["w"] + p["head"]["b"]


def parse_args(argv=None):
    return argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)


def main(argv=None):
    parse_args(argv)
    k = jax.random.split(jax.random.key(0), 5)
    params = {f"l{i}": {"w": jax.random.normal(k[i], (WIDTH, WIDTH)) * WIDTH ** -0.5,
                        "b": jnp.zeros(WIDTH)} for i in range(3)}
    params["head"] = {"w": jax.random.normal(k[3], (WIDTH, 10)) * WIDTH ** -0.5, "b": jnp.zeros(10)}
    x = jax.random.normal(k[4], (8, WIDTH))
    with tempfile.TemporaryDirectory() as folder:
        rows = write_artifacts(params, x, folder)
    print(f"jax {jax.__version__}; bytes\n")
    print("| artifact | " + " | ".join(f"`{n}`" for n, _ in PRESETS) + " |")
    print("| --- |" + " --- |" * len(PRESETS))
    for row, cells in rows.items():
        print(f"| {row} | " + " | ".join(cells) + " |")


def write_artifacts(params, x, folder):
    """Writes the float file and each preset's artifacts into ``folder``: ``{row: [cells]}``."""
    flat = {f"{a}/{b}": np.asarray(v) for a, d in params.items() for b, v in d.items()}
    safetensors.numpy.save_file(flat, os.path.join(folder, "float.safetensors"))
    float_bytes = os.path.getsize(os.path.join(folder, "float.safetensors"))
    rows = {"float32 params, as safetensors": [], "packed weights and qparams (`jqt.save_packed`)": [],
            "qparams alone (`jqt.save`, safetensors)": [], "`exp.serialize()`": []}
    for name, recipe in PRESETS:
        print(f"[artifacts] {name}", file=sys.stderr, flush=True)
        qp = jqt.calibrate(mlp, recipe, params, [(x,)], progress=False)
        packed = jqt.pack(qp, params)
        pfile, qfile = os.path.join(folder, "packed.safetensors"), os.path.join(folder, "qp.safetensors")
        jqt.save_packed(pfile, packed, qp)
        jqt.save(qfile, qp)
        exp = jax.export.export(jax.jit(jqt.quantize(mlp, qp)))(packed, jax.ShapeDtypeStruct(x.shape, x.dtype))
        psize = os.path.getsize(pfile)
        sizes = (float_bytes, psize, os.path.getsize(qfile), len(exp.serialize()))
        for (row, cells), n in zip(rows.items(), sizes):
            cells.append(f"{n:,}" + (f" ({n / float_bytes:.3f}x)" if n is psize else ""))
    return rows


if __name__ == "__main__":
    main()
