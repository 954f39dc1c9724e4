"""Where a decode step's time goes: XLA:CPU's own per-operation timings, grouped.

    python benchmarks/decode_profile.py --markdown      # about 4 minutes on 2 cores
    python benchmarks/decode_profile.py --only w4_g128 --rounds 3

``benchmarks/decode.py`` times the batch-1 decode step of its 100M-parameter decoder
(``CONFIG``, context 1025 in a float32 cache of 2048 positions). This script runs the
same step, float32 and quantized, under ``jax.profiler`` and sums the duration of every
operation XLA:CPU executed (the trace's events carry the compiled HLO instruction's
name; its result shape is read from the compiled HLO text), grouped as:

* ``matmul``: dots (XLA's own, or YNNPACK fusions) and custom calls (jqt's native
  kernels, named ``jqt_gemv``);
* ``slice stacked weights``: ``dynamic-slice`` whose result is a weight-sized integer
  or float array: ``lax.scan`` over stacked layers copies each layer's weight out
  before its matmul;
* ``cache slice / write / restack``: ``dynamic-slice``, ``dynamic-update-slice``,
  copies and broadcasts whose result has the cache's ``MAX_LEN`` positions: the
  decoder's scan took each layer's cache as a slice and returned it restacked
  until 2026-12-07; it now carries the whole cache and writes each layer's part in place;
* ``elementwise``: every other fusion (decoding codes, norms, rotary embedding,
  softmax, the dynamic activation scales);
* ``loop control``: ``while`` and ``conditional`` operations themselves (their bodies'
  operations are counted in their own groups; a loop's time here is its own).

Times are summed over threads and reported as ms per step (the median of ``--rounds``
rounds, the variants interleaved in each) and as a share of the step's summed busy
time (a multi-threaded operation counts on each thread it ran on). Prints tables
(``--markdown``: markdown) and a ``RESULTS {json}`` line.
"""
from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import math
import os
import re
import statistics
import sys
import tempfile

import paths  # noqa: F401  (this checkout's jqt, examples/)
import jax

import cli
import decode as D
import decoder
from formats import table

GROUPS = ("matmul", "slice stacked weights", "cache slice / write / restack", "elementwise",
          "loop control", "other")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = \S+?\[([\d,]*)\]")


def result_shapes(hlo_text):
    """HLO instruction name -> result shape, for every instruction in the module."""
    out = {}
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m:
            out[m.group(1)] = tuple(int(d) for d in m.group(2).split(",") if d)
    return out


def group(name, shapes, max_len):
    """The group of one executed HLO instruction."""
    shape = shapes.get(name, ())
    if ("dot" in name or "ynn" in name or "convolution" in name
            or name.startswith(("custom-call", "jqt_gemv"))):
        return "matmul"
    if name.startswith(("while", "conditional", "call")):
        return "loop control"
    touches_cache = max_len in shape
    if "dynamic-update-slice" in name or (touches_cache and any(
            s in name for s in ("dynamic-slice", "dynamic_slice", "copy", "broadcast", "transpose"))):
        return "cache slice / write / restack" if touches_cache else "other"
    if "dynamic-slice" in name or "dynamic_slice" in name:  # a layer's weight, or a small vector
        return "slice stacked weights" if math.prod(shape) >= 1 << 16 else "elementwise"
    if "fusion" in name or name.startswith(("copy", "transpose", "broadcast", "wrapped_")):
        return "elementwise"
    return "other"


def self_times(events):
    """(name, self duration in us) of each complete event: its duration less that of the
    events nested in it on the same thread (a loop's body runs inside the loop's event)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [end, index into out]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            if stack:
                out[stack[-1][1]][1] -= e["dur"]
            out.append([e["name"], e["dur"]])
            stack.append((e["ts"] + e["dur"], len(out) - 1))
    return out


def profile(fn, args, steps, shapes, max_len):
    """ms per step of each group, from ``steps`` calls of ``fn(*args)`` under the profiler
    (``shapes``: :func:`result_shapes` of its compiled HLO)."""
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        files = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            sys.exit("decode_profile: jax.profiler wrote no *.trace.json.gz; this jax does not "
                     "export traces as JSON, so there is nothing to read.")
        with gzip.open(files[0]) as fh:
            events = json.load(fh)["traceEvents"]
    hlo_names = set(shapes)
    sums = collections.Counter()
    for name, us in self_times(events):
        if name in hlo_names:
            sums[group(name, shapes, max_len)] += us / 1e3 / steps
    return {g: sums.get(g, 0.0) for g in GROUPS}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, type=cli.names(list(D.VARIANTS), key=lambda s: s.replace(" ", "_")),
                    help="variants of decode.py, comma-separated, a space or _ in a name: "
                         f"{', '.join(D.VARIANTS)} (default: all)")
    ap.add_argument("--steps", type=cli.positive_int, default=4, help="profiled steps per variant and round")
    ap.add_argument("--rounds", type=cli.positive_int, default=5, help="rounds, the variants interleaved in each")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    args = ap.parse_args()
    names = args.only or list(D.VARIANTS)
    params = decoder.init_params(D.CONFIG, jax.random.key(0))
    step = functools.partial(decoder.decode_step, config=D.CONFIG)
    calib = D.decode_inputs(params, (1, 2))
    cache, token = D.decode_inputs(params, (3,))[0]
    runs = {"float32": (jax.jit(step), params)}
    for name in names:
        D.progress(f"calibrating and packing {name}")
        _, packed, f = D.build(step, D.VARIANTS[name][0](), params, calib)
        runs[name] = (f, packed)
    shapes = {}
    for name, (f, p) in runs.items():
        shapes[name] = result_shapes(f.lower(p, cache, token).compile().as_text())
        for _ in range(3):
            jax.block_until_ready(f(p, cache, token))
    per_round = collections.defaultdict(list)
    for r in range(args.rounds):
        D.progress(f"round {r + 1} of {args.rounds}: {args.steps} profiled steps of each variant")
        for name, (f, p) in runs.items():
            per_round[name].append(profile(f, (p, cache, token), args.steps, shapes[name], D.MAX_LEN))
    results, rows = {}, []
    for name, rounds in per_round.items():
        ms = {g: statistics.median(r[g] for r in rounds) for g in GROUPS}
        total = sum(ms.values())
        results[name] = dict(ms, total=total)
        rows.append((name, f"{total:.1f}", *(f"{ms[g]:.1f} ({ms[g] / total:.0%})" for g in GROUPS)))
    print(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cores)\n")
    print(f"Decode step of benchmarks/decode.py's decoder (batch 1, context {D.PROMPT + 1} in a "
          f"float32 cache of {D.MAX_LEN}): XLA:CPU operation time summed over threads, ms per step "
          f"(share); medians of {args.rounds} interleaved rounds of {args.steps} profiled steps")
    table(("variant", "busy ms", *GROUPS), rows, args.markdown)
    print("RESULTS " + json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
