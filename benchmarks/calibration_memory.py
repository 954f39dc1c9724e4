"""Calibration memory: process RSS over 1000 calibration batches stays flat.

    python benchmarks/calibration_memory.py            # MLP and CNN, and GPTQ on the MLP
                                                       # (1-2 minutes on 2 cores)
    python benchmarks/calibration_memory.py --quick    # the MLP only

``jqt.calibrate`` keeps fixed-size statistics per op (a min/max pair, or a
histogram) and merges each batch into them, so its memory should not depend on
the number of batches. This script calibrates a model (w8a8 preset) on a
generator of 1000 batches of 64 examples, each made on the fly from a fixed
seed (uniform [0, 1) pixels; nothing keeps the batches), and samples the
process's resident set size (``VmRSS`` in ``/proc/self/status``) and its peak
(``resource.getrusage(...).ru_maxrss``) when the generator has handed out 10,
100, 250, 500 and 1000 batches. Each (model, calibrator) runs in a fresh
subprocess, so peaks are not shared. For contrast it computes the bytes that
a buffer of every quantized op's input activation over all batches would take
(from the shapes), and the bytes of the calibrator's statistics. A last row runs
``jqt.gptq`` over the same number of batches: its statistic, ``X^T X`` of one op's
input, has a fixed size too.

The models are the two of ``calibrators.py`` (the quickstart CNN on 8x8x1
digits and the MLP 64-256-256-10) with flax's initial parameters (seed 0):
the memory does not depend on training.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the jqt of this checkout
sys.path.insert(0, HERE)

import cli  # noqa: E402

CHECKPOINTS = (10, 100, 250, 500)  # plus the number of batches
BATCH = 64
SEED = 1234
CALIBRATORS = ("MinMax", "Percentile", "Entropy")
MiB = 1024 * 1024


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --- the child: one (model, calibrator) ------------------------------------------------------

def child(model_name, cal_name, n_batches):
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    import calibrators as bench  # benchmarks/calibrators.py: the models
    import jqt

    cal = {"MinMax": jqt.calibrators.MinMax(), "Percentile": jqt.calibrators.Percentile(99.99),
           "Entropy": jqt.calibrators.Entropy(), "GPTQ": jqt.calibrators.MinMax()}[cal_name]
    make = {"cnn": bench.QS.CNN, "mlp": bench.MLP}[model_name]
    example = {"cnn": (8, 8, 1), "mlp": (64,)}[model_name]
    model = make()
    params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1,) + example, jnp.float32))

    # The input of every nn.Dense / nn.Conv: the activation operand of each quantized op.
    shapes = []

    def record(next_fun, args, kwargs, context):
        if isinstance(context.module, (nn.Dense, nn.Conv)) and context.method_name == "__call__":
            shapes.append(tuple(args[0].shape))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(model.apply, params, jax.ShapeDtypeStruct((BATCH,) + example, jnp.float32))
    per_batch = sum(int(np.prod(s)) * 4 for s in shapes)  # float32
    stat_bytes = sum(leaf.size * leaf.dtype.itemsize for s in shapes for leaf in jax.tree_util.tree_leaves(
        jax.eval_shape(cal.observe, jax.ShapeDtypeStruct(s, jnp.float32))))
    if cal_name == "GPTQ":  # X^T X of one op at a time (float32, K x K)
        stat_bytes = max(s[-1] ** 2 * 4 for s in shapes)
        return _gptq_child(jqt, model, params, example, shapes, per_batch, stat_bytes, n_batches)

    marks = set(CHECKPOINTS) | {n_batches}
    samples = {}

    def batches():
        rng = np.random.default_rng(SEED)
        for i in range(n_batches):
            if i in marks:
                samples[i] = (rss_bytes(), peak_bytes())
            yield (rng.random((BATCH,) + example, dtype=np.float32),)
        samples[n_batches] = (rss_bytes(), peak_bytes())

    before = rss_bytes()
    t = time.perf_counter()
    qp = jqt.calibrate(model.apply, jqt.recipes.w8a8(calibrator=cal), params, batches(),
                       progress=False)
    jax.block_until_ready(qp)
    wall = time.perf_counter() - t
    after, peak = rss_bytes(), peak_bytes()
    assert len(qp) == len(shapes), (list(qp), shapes)
    print("RESULT " + json.dumps(dict(
        model=model_name, calibrator=cal_name, n=n_batches, ops=len(shapes), shapes=shapes,
        per_batch=per_batch, stat_bytes=int(stat_bytes), before=before, after=after, peak=peak,
        samples={str(k): v for k, v in sorted(samples.items())}, wall=wall)))


class _LazyBatches:
    """A sequence of ``n`` batches made on the fly (``jqt.gptq`` passes over them once per
    op), sampling RSS when batch ``i`` of pass ``last_pass`` is handed out (``None``: of
    every pass, each overwriting the one before, so the last pass's remain)."""

    def __init__(self, example, n, marks, samples, last_pass):
        import numpy as np
        self.np, self.example, self.n, self.marks, self.samples = np, example, n, marks, samples
        self.last_pass, self.passes = last_pass, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        if i == 0:
            self.passes += 1
        if self.last_pass in (None, self.passes):
            for k in {i} & self.marks | ({self.n} if i == self.n - 1 else set()):
                self.samples[k] = (rss_bytes(), peak_bytes())  # (n: as the last batch is drawn)
        rng = self.np.random.default_rng([SEED, i])
        return (rng.random((BATCH,) + self.example, dtype=self.np.float32),)


def _gptq_child(jqt, model, params, example, shapes, per_batch, stat_bytes, n_batches):
    """``jqt.gptq`` (w4, groups of 32) on ``n_batches``: one pass per dense op, each
    summing ``X^T X`` over the batches; RSS sampled during the last pass."""
    import jax
    marks, samples = set(CHECKPOINTS) | {n_batches}, {}
    calib = _LazyBatches(example, 16, set(), {}, 0)
    qp = jqt.calibrate(model.apply, jqt.recipes.w4(group_size=32), params, calib, progress=False)
    # every pass sampled, the last one's kept: jqt.gptq reads the batches once to check
    # them, traces batch 0, then passes once per op
    batches = _LazyBatches(example, n_batches, marks, samples, last_pass=None)
    before = rss_bytes()
    t = time.perf_counter()
    out = jqt.gptq(model.apply, qp, params, batches, progress=False)
    jax.block_until_ready(out)
    wall = time.perf_counter() - t
    after, peak = rss_bytes(), peak_bytes()
    print("RESULT " + json.dumps(dict(
        model="mlp", calibrator="GPTQ", n=n_batches, ops=len(shapes), shapes=shapes,
        per_batch=per_batch, stat_bytes=int(stat_bytes), before=before, after=after, peak=peak,
        samples={str(k): v for k, v in sorted(samples.items())}, wall=wall)))


# --- the parent --------------------------------------------------------------------------------

def run_child(model, cal, n):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, cal, "--batches", str(n)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode or not lines:
        raise SystemExit(f"child {model} {cal} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def environment():
    from report import environment as report_environment
    return report_environment(ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the MLP only")
    p.add_argument("--batches", type=cli.at_least(max(CHECKPOINTS) + 1), default=1000,
                   help=f"calibration batches (default 1000, more than {max(CHECKPOINTS)})")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "CALIBRATOR"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def nbytes(b):
    return f"{b} B" if b < 1024 else f"{b / 1024:.1f} KiB"


def mib(b):
    return f"{b / MiB:.1f}"


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(*args.child, args.batches)
    from report import table

    n = args.batches
    models = ("mlp",) if args.quick else ("mlp", "cnn")
    t_start = time.perf_counter()
    cmd = " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    print(f"# jqt calibration memory over {n} batches ({'quick' if args.quick else 'full'} run)\n")
    print(f"Command: `{cmd}`\n\n{environment()}\n")
    results = []
    for m, c in [(m, c) for m in models for c in CALIBRATORS] + [("mlp", "GPTQ")]:
        r = run_child(m, c, n)
        results.append(r)
        s = r["samples"]
        log(f"[{m} {c}] {r['wall']:.1f} s, RSS {mib(s['100'][0])} -> {mib(s[str(n)][0])} MiB")

    print(f"`jqt.calibrate(model.apply, jqt.recipes.w8a8(calibrator=...), params, batches)` on a "
          f"generator of {n} batches of {BATCH} examples (uniform [0, 1), made on the fly from "
          f"seed {SEED}); one fresh process per row. `Percentile` is `Percentile(99.99)` "
          "(2048-bin histogram), `Entropy` the default `Entropy()` (8192 bins). `GPTQ`: "
          "`jqt.gptq(model.apply, qp, params, batches)` after a `w4(group_size=32)` calibration, "
          f"on a sequence of {n} batches made on demand; it passes over them once per op, and "
          "the RSS is sampled during the last pass.\n")
    print("## Resident set size (VmRSS, MiB) after k batches\n")
    marks = [str(k) for k in CHECKPOINTS + (n,)]
    header = (("model", "calibrator", "before calibrate") + tuple(f"after {k}" for k in marks)
              + (f"growth 100->{n} MiB", "peak RSS MiB (ru_maxrss)", "after calibrate",
                 "calibrate s"))
    rows = []
    for r in results:
        s = r["samples"]
        rows.append((r["model"], r["calibrator"], mib(r["before"]))
                    + tuple(mib(s[k][0]) for k in marks)
                    + (f"{(s[str(n)][0] - s['100'][0]) / MiB:+.2f}", mib(r["peak"]),
                       mib(r["after"]), f"{r['wall']:.1f}"))
    print(table(header, rows, markdown=True))

    print("\n## What a buffer of activations would take instead\n")
    print(f"`activation buffer`: bytes of every quantized op's float32 input activation over all "
          f"{n} batches (what a calibrator that keeps the data would hold); `statistics`: bytes of "
          "the calibrator's state for all ops (`jax.eval_shape` of its `observe`).\n")
    rows = []
    for r in results:
        s = r["samples"]
        growth = s[str(n)][0] - s["100"][0]
        buf = r["per_batch"] * n
        rows.append((r["model"], r["calibrator"], str(r["ops"]),
                     " ".join("x".join(map(str, sh)) for sh in r["shapes"]),
                     f"{r['per_batch'] / 1024:.0f} KiB", f"{buf / MiB:.1f} MiB",
                     nbytes(r["stat_bytes"]), f"{growth / MiB:+.2f} MiB",
                     f"{growth / buf:.2%}"))
    print(table(("model", "calibrator", "ops", "activation shapes (per batch)", "per batch",
                 f"activation buffer ({n} batches)", "statistics",
                 f"measured growth 100->{n}", "growth / buffer"), rows, markdown=True))
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
