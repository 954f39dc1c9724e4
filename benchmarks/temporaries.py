"""Temporaries and page faults per call of all-MiniLM-L6-v2 at batch 8 (104 rows per
matmul), weight-only presets: why ``KernelPolicy.decode_after_input`` exists.

    python benchmarks/temporaries.py          # about a minute; needs the examples extra

For each preset and each policy (the CPU table: every weight decoded whole, after its
op's input exists; ``decode_after_input=False``: the same decodes without that
dependency; ``many_rows_block=1024``: blocks of output channels decoded in a loop, which
the table ran before ``decode_after_input``), prints the compiled program's temporary bytes
(``compile().memory_analysis().temp_size_in_bytes``) and the minor page faults per call
(``resource.getrusage``, over 10 calls after a warm-up). A last set of rows runs the
whole decodes again in a subprocess with XLA:CPU's concurrency-optimized scheduler off
(``--xla_cpu_enable_concurrency_optimized_scheduler=false``): that scheduler is what
hoists every decode ahead of the first matmul when nothing ties it to its input.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import subprocess
import sys

import paths  # noqa: F401  (this checkout's jqt, examples/)
import jax

import jqt
from formats import minilm_setup

FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
PRESETS = {"w8": jqt.recipes.w8, "w4 g128": lambda: jqt.recipes.w4(group_size=128),
           "fp8": jqt.recipes.fp8}


def rows(policies):
    m, batches, evals, *_ = minilm_setup()
    ids, mask = m.tokenize(evals[:8])
    for name, make in PRESETS.items():
        qp = jqt.calibrate(m.embed, make(), m.params, batches, progress=False)
        for pname, policy in policies.items():
            f = jax.jit(jqt.quantize(m.embed, qp, policy=policy))
            packed = jqt.pack(qp, m.params, policy=policy)
            temp = f.lower(packed, ids, mask).compile().memory_analysis().temp_size_in_bytes
            jax.block_until_ready(f(packed, ids, mask))
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(10):
                jax.block_until_ready(f(packed, ids, mask))
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
            print(f"| {name} | {pname} | {temp / 1e6:.1f} | {faults:.0f} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # internal: the last rows
    args = ap.parse_args(argv)
    cpu = jqt.KernelPolicy.for_backend("cpu")
    free = dataclasses.replace(cpu, decode_after_input=False)
    if args.child:
        rows({f"decode_after_input=False, {FLAG}": free})
        return
    print(f"jax {jax.__version__} on {jax.default_backend()}; all-MiniLM-L6-v2, batch 8 (104 rows)")
    print("| preset | policy | temporaries MB | page faults per call |\n| --- | --- | --- | --- |")
    rows({"CPU table (whole weights, each decoded after its input)": cpu,
          "decode_after_input=False": free,
          "many_rows_block=1024 (blocks in a loop)": dataclasses.replace(cpu, many_rows_block=1024)})
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + FLAG).strip())
    subprocess.run([sys.executable, __file__, "--child"], env=env, check=True)


if __name__ == "__main__":
    main()
