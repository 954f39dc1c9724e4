"""Episodes of slow data movement between this VM's two CPUs, and what they do to timings.

    python benchmarks/crosscore.py                 # 120 s; --seconds, --rows, --markdown

On the 2-core machines these benchmarks ran on, the host now and then (in episodes)
makes passing data from one vCPU to the other about 3x slower, perhaps by running
them on cores that share no L3 (the guest cannot see which). A program that runs alone
for a few seconds then falls wholly inside or outside an episode, which looks like a
"slow process". It hits XLA:CPU programs in which one op writes a block that the next op
reads on the other thread: jqt's XLA formulation of a 4-bit weight at few rows decodes
each K-chunk in a fusion split over both threads, and a dot on one thread reads it.

This script runs, for ``--seconds``, windows of: the probe ``crosscore.c`` (built here with
the C compiler: a cache line bounced between CPU 0 and CPU 1, and both CPUs writing halves
of a 4 MiB buffer that CPU 0 then reads, against CPU 0 alone), then 7 calls of each variant
(a float32 4096 x 4096 matmul; ``w4 g128`` in jqt's XLA formulation; ``w4 g128`` through
jqt's native kernel, where it builds), in rotating order. A window is in an episode when
the probe's round trip exceeds 250 ns (100-140 ns otherwise). It prints each variant's
median over episode windows and over the others, and a ``RESULTS {json}`` line.
Linux only (thread affinity).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
import time

import paths  # noqa: F401  (this checkout's jqt)
import jax

import cli
import jqt
from formats import table

HERE = os.path.dirname(os.path.abspath(__file__))
EPISODE_NS = 250


def build_probe(d):
    exe = os.path.join(d, "crosscore")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O3", "-march=native", "-pthread", "-o", exe,
                    os.path.join(HERE, "crosscore.c")], check=True)
    return exe


def probe(exe):
    return json.loads(subprocess.run([exe, "10"], capture_output=True, text=True, check=True,
                                     timeout=60).stdout)


def variants(rows):
    n = 4096
    w = jax.random.normal(jax.random.key(0), (n, n)) * 0.02
    x = jax.random.normal(jax.random.key(1), (rows, n))
    f = lambda w, x: x @ w
    qp = jqt.calibrate(f, jqt.recipes.w4(group_size=128), w, [(x,)], progress=False)
    cpu = jqt.KernelPolicy.for_backend("cpu")
    pols = {"w4 g128, XLA K-chunks": dataclasses.replace(cpu, native_gemv_rows=0, native_decode=0)}
    if jqt.native_status().available:
        pols["w4 g128, native kernel"] = cpu
    out = {"float32": (jax.jit(f), (w, x))}
    for name, pol in pols.items():
        out[name] = (jax.jit(jqt.quantize(f, qp, policy=pol)), (jqt.pack(qp, w, policy=pol), x))
    for fn, a in out.values():
        for _ in range(3):
            jax.block_until_ready(fn(*a))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=cli.positive_float, default=120,
                    help="how long to run windows of probe and timings (default 120)")
    ap.add_argument("--rows", type=cli.positive_int, default=1,
                    help="rows of the 4096 x 4096 matmuls timed (default 1)")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        exe = build_probe(d)
        fns = variants(args.rows)
        names, windows, t0 = list(fns), [], time.time()
        while time.time() - t0 < args.seconds:
            w = probe(exe)
            names = names[1:] + names[:1]
            for k in names:
                fn, a = fns[k]
                s = []
                for _ in range(7):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(*a))
                    s.append(time.perf_counter() - t)
                w[k] = statistics.median(s) * 1e3
            windows.append(w)
    ep = [w for w in windows if w["roundtrip_ns"] > EPISODE_NS]
    calm = [w for w in windows if w["roundtrip_ns"] <= EPISODE_NS]
    med = lambda ws, k: statistics.median(w[k] for w in ws) if ws else float("nan")
    keys = ("roundtrip_ns", "split_us", "one_core_us") + tuple(fns)
    res = {"rows": args.rows, "windows": len(windows), "episode_windows": len(ep),
           "episode": {k: med(ep, k) for k in keys}, "calm": {k: med(calm, k) for k in keys}}
    # (no calm window: no calm median to compare with, null, not a count of 0 from NaN)
    slow_in = lambda ws: sum(w["w4 g128, XLA K-chunks"] > 2 * med(calm, "w4 g128, XLA K-chunks")
                             for w in ws) if calm else None
    res["xla_over_2x_calm"] = {"episode": slow_in(ep), "calm": slow_in(calm)}
    print(f"jax {jax.__version__}, {os.cpu_count()} cores, {args.rows} row(s), {len(windows)} windows "
          f"of ~{args.seconds / max(len(windows), 1):.2f} s, {len(ep)} in an episode "
          f"(probe round trip > {EPISODE_NS} ns)\n")
    rows = [("probe: round trip, ns", "roundtrip_ns", "{:.0f}"), ("probe: split 4 MiB, us", "split_us", "{:.0f}"),
            ("probe: one core, us", "one_core_us", "{:.0f}")] + [(f"{k}, ms", k, "{:.2f}") for k in fns]
    table(("median over windows", f"episode ({len(ep)})", f"calm ({len(calm)})"),
          [(label, fmt.format(res["episode"][k]), fmt.format(res["calm"][k])) for label, k, fmt in rows],
          args.markdown)
    x = res["xla_over_2x_calm"]
    if calm:
        print(f"windows where the XLA formulation took over 2x its calm median: {x['episode']} of "
              f"{len(ep)} in episodes, {x['calm']} of {len(calm)} calm")
    else:
        print(f"no calm window (all {len(ep)} in an episode): no calm median to compare the "
              "windows with; run it again when the host is quieter, or for longer (--seconds)")
    # (no window of one kind: its medians are NaN in the table, null in the JSON, which
    # has no NaN)
    nulls = lambda v: ({k: nulls(x) for k, x in v.items()} if isinstance(v, dict) else
                       None if isinstance(v, float) and v != v else v)
    print("RESULTS " + json.dumps(nulls(res), sort_keys=True, allow_nan=False))


if __name__ == "__main__":
    main()
