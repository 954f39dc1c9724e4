"""jqt benchmark suite: one command, ``python benchmarks/run.py``.

    python benchmarks/run.py                 # full run (about 6 minutes on 2 cores)
    python benchmarks/run.py --quick         # short run: fewer batch sizes and samples (a few minutes)
    python benchmarks/run.py --only dense,encoder --repeats 50 --markdown

For every workload (see ``workloads.py``) and batch size it times, interleaved
round-robin, float32, jqt's three presets with packed int8 weights and Qwix's
three PTQ modes, all under ``jax.jit``, and prints medians, time and byte ratios
to float32 and the error against the float output. Then it measures the cost of
a calibration step and the time to trace and transform a 100-layer MLP, and
prints a PASS/MISS check list against the performance targets.
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the jqt of this checkout
sys.path.insert(0, HERE)

import jax  # noqa: E402

import cli  # noqa: E402
import jqt  # noqa: E402
import report  # noqa: E402
import timing  # noqa: E402
import variants as V  # noqa: E402
import workloads as W  # noqa: E402

FULL = dict(budget_s=10.0, min_rounds=40, max_rounds=1000, calib=(2, 2.0, 3), trace_reps=3)
QUICK = dict(budget_s=1.5, min_rounds=20, max_rounds=300, calib=(2, 0.6, 2), trace_reps=1)
# (workload, batch) pairs whose calibration step is measured (jqt w8a8).
CALIB_CONFIGS = (("dense4096", 8), ("cnn_digits", 64), ("cnn32", 8), ("encoder", 8))
# A single layer's output feeds no statistic, so the calibration step skips its matmul.
NOTES = {"dense4096": " (the step computes no matmul: only the input's min/max is needed)"}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and samples")
    known = list(dict.fromkeys([w.group for w in W.WORKLOADS] + [w.name for w in W.WORKLOADS]))
    p.add_argument("--only", default=None, type=cli.names(known),
                   help="comma-separated groups or workload names: dense, mlp, cnn, encoder, "
                        "dense4096, cnn32, ... ('mlp' also selects the trace-time measurement)")
    p.add_argument("--repeats", type=cli.positive_int, default=None,
                   help="timing rounds per (workload, batch), after the same warm-up; default: "
                        "as many as fit in a time budget, at least 40 (20 with --quick)")
    p.add_argument("--markdown", action="store_true", help="print markdown tables")
    p.add_argument("--no-qwix", action="store_true", help="skip the Qwix variants")
    return p.parse_args(argv)


def environment() -> str:
    try:
        commit = subprocess.run(["git", "-C", os.path.dirname(HERE), "describe", "--always",
                                 "--dirty"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    try:
        import qwix
        qv = qwix.__version__
    except ImportError:
        qv = "not installed"
    return (f"jqt {jqt.__version__} ({commit}), jax {jax.__version__}, qwix {qv}, "
            f"{jax.devices()[0].platform} x{os.cpu_count()} cores, "
            f"{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")


def bench_workload(wl, cfg, args) -> list:
    """Times every variant of ``wl`` at each batch size; returns report rows."""
    t0 = time.perf_counter()
    prep = V.prepare(wl, with_qwix=not args.no_qwix)
    log(f"[{wl.name}] prepared {len(prep.variants)} variants in {time.perf_counter() - t0:.1f} s")
    rows = []
    for b in (wl.quick_batches if args.quick else wl.batches):
        t0 = time.perf_counter()
        x = wl.input(b)
        outs, na = {}, {}
        for v in prep.variants:
            if v.na:
                na[v.name] = v.na
                continue
            y, why = V.first_call(v, x)
            if why:
                na[v.name] = why
            else:
                outs[v.name] = y
        calls = {n: functools.partial(v, x) for v in prep.variants if (n := v.name) in outs}
        # choose_rounds compiles and warms every call up (3 calls each) before timing one
        # round; with --repeats it still warms up, and the rounds are the ones asked for
        if args.repeats is None:
            rounds = timing.choose_rounds(
                calls.values(), cfg["budget_s"], cfg["min_rounds"], cfg["max_rounds"])
        else:
            timing.choose_rounds(calls.values(), 0.0, 1, 1)
            rounds = args.repeats
        stats = {n: timing.summary(s) for n, s in timing.interleaved(calls, rounds).items()}
        f32 = stats["float32"]["median"]
        for v in prep.variants:
            if v.name in na:
                rows.append(report.Row(wl.name, b, v.name, na=na[v.name]))
                continue
            s = stats[v.name]
            err, rel = V.errors(outs[v.name], outs["float32"])
            rows.append(report.Row(
                wl.name, b, v.name, s["median"] * 1e3, s["p25"] * 1e3, s["p75"] * 1e3, s["n"],
                s["median"] / f32, v.nbytes / prep.float_nbytes, err, rel))
        log(f"[{wl.name}] batch {b}: {rounds} rounds in {time.perf_counter() - t0:.1f} s")
    return rows


def bench_calibration(selected, cfg) -> list:
    """Per-batch ``jqt.calibrate`` time against the float forward time."""
    out = []
    n1, work_s, reps = cfg["calib"]
    by_name = {w.name: w for w in selected}
    for name, b in CALIB_CONFIGS:
        if name not in by_name:
            continue
        wl = by_name[name]
        model = wl.make_model()
        variables = wl.init(model)
        x = wl.input(b)
        fwd_call = functools.partial(jax.jit(model.apply), variables, x)
        distinct = [(wl.input(b, seed=2000 + i),) for i in range(4)]
        r = timing.calibration_step(model.apply, jqt.recipes.w8a8(), variables, distinct,
                                    fwd_call, work_s=work_s, n1=n1, reps=reps)
        ratio, step, fwd = r["ratio"], r["per_batch"] * 1e3, r["fwd"] * 1e3
        totals = ", ".join(f"{a:.2f}/{c:.2f}" for a, c in r["totals"])
        reps_ratios = ", ".join(f"{x:.2f}" for x in r["ratios"])
        out.append(dict(name=f"{name} batch {b}", ratio=ratio, step_ms=step, fwd_ms=fwd,
                        ratios=reps_ratios,
                        detail=f"median of the repetitions' ratios ({reps_ratios}); medians "
                        f"{step:.2f} ms/batch, {fwd:.2f} ms forward" + NOTES.get(name, ""),
                        totals=f"{totals} (n={n1}/{r['n2']})"))
        log(f"[calibration] {name} batch {b}: {ratio:.2f}x")
    return out


def calib_table(rows, markdown):
    header = ("workload", "calibrate ms/batch (median)", "float fwd ms (median)",
              "ratio (median of repetitions' ratios)", "repetitions' ratios",
              "calibrate wall s, n1/n2 batches")
    return report.table(header, [(r["name"], f"{r['step_ms']:.2f}", f"{r['fwd_ms']:.2f}",
                                  f"{r['ratio']:.2f}", r["ratios"], r["totals"]) for r in rows],
                        markdown, left=(0,))


def trace_table(t, markdown):
    header = ("model mlp100x256 (batch 8)", "jit(f).lower", ".compile()", "total")
    fl, fc, jl, jc = t["float_lower"], t["float_compile"], t["jqt_lower"], t["jqt_compile"]
    rows = [("float32", f"{fl:.3f} s", f"{fc:.3f} s", f"{fl + fc:.3f} s"),
            ("jqt w8a8 (packed)", f"{jl:.3f} s", f"{jc:.3f} s", f"{jl + jc:.3f} s"),
            ("ratio jqt / float", f"{jl / fl:.1f}x", f"{jc / fc:.1f}x",
             f"{(jl + jc) / (fl + fc):.1f}x")]
    return (report.table(header, rows, markdown, left=(0,))
            + "\njqt.calibrate wall time, one batch (trace + compile + run): "
            f"{t['calibrate']:.3f} s")


def main(argv=None):
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    selected = W.select(",".join(args.only) if args.only else None)
    wanted = set(args.only) if args.only else None
    t_start = time.perf_counter()
    print(f"# jqt benchmarks ({'quick' if args.quick else 'full'} run)\n{environment()}")

    rows = []
    for wl in selected:
        rows += bench_workload(wl, cfg, args)
    calib = bench_calibration(selected, cfg)
    trace = None
    if wanted is None or "mlp" in wanted:
        log("[trace] 100-layer MLP")
        trace = timing.trace_transform(W.DEEP_MLP, reps=cfg["trace_reps"])

    md = args.markdown
    print("\n## Forward pass (medians of interleaved rounds; ratios to float32 of the same "
          "rounds; jqt variants run on packed int8 weights)\n")
    print(report.main_table(rows, md))
    if calib:
        print("\n## Calibration step (jqt.calibrate, w8a8): per-batch time vs float forward\n")
        print(calib_table(calib, md))
    if trace:
        print("\n## Trace + transform time (fresh function each time, median of "
              f"{cfg['trace_reps']})\n")
        print(trace_table(trace, md))
    cs = report.checks(rows, calib)
    print("\n## Targets (CPU, ratio to float32)\n")
    print(report.check_table(cs, md))
    n_pass = sum(c.status == "PASS" for c in cs)
    print(f"\n{n_pass}/{len(cs)} targets met; total time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
