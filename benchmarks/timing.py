"""Timing: interleaved medians, calibration step cost, trace/transform time.

All times use ``time.perf_counter`` around a call followed by
``jax.block_until_ready``.
"""
from __future__ import annotations

import math
import statistics
import time

import jax

import jqt


def _once(call) -> float:
    t = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - t


def choose_rounds(calls, budget_s, min_rounds, max_rounds, warmup=3) -> int:
    """Warms every call up ``warmup`` times and picks how many rounds fit in ``budget_s``."""
    per_round = 0.0
    for call in calls:
        for _ in range(warmup - 1):
            _once(call)
        per_round += _once(call)
    return max(min_rounds, min(max_rounds, math.ceil(budget_s / max(per_round, 1e-9))))


def interleaved(calls: dict, rounds: int) -> dict:
    """Times each call ``rounds`` times, round-robin (each round runs every call once).

    Returns ``{name: [seconds, ...]}``. Interleaving spreads slow drifts of the
    machine (other processes, frequency, caches) evenly over the variants.
    """
    samples = {n: [] for n in calls}
    items = list(calls.items())
    for r in range(rounds):
        # Alternate the order so no variant always runs right after the same one.
        for name, call in (items if r % 2 == 0 else items[::-1]):
            samples[name].append(_once(call))
    return samples


def summary(samples) -> dict:
    """Median, 25th and 75th percentiles (seconds) and the sample count. The percentiles
    interpolate between samples (``method="inclusive"``), so they stay within the measured
    range however few the rounds (the default method extrapolates beyond two samples)."""
    s = sorted(samples)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) >= 2 else [s[0]] * 3
    return dict(median=statistics.median(s), p25=q[0], p75=q[2], n=len(s))


def median_time(call, n: int = 30) -> float:
    """Median seconds of ``n`` calls after two warm-up calls."""
    _once(call)
    _once(call)
    return statistics.median(_once(call) for _ in range(n))


def calibration_step(f, recipe, variables, distinct, fwd_call, work_s=1.0, n1=2,
                     reps=2) -> dict:
    """Seconds per calibration batch of ``jqt.calibrate``, against the float forward pass.

    ``calibrate`` runs on ``n1`` and on ``n2`` identical-shape batches (cycling
    through the ``distinct`` ones), after a warm call; the per-batch time is
    the difference divided by ``n2 - n1``, which removes the fixed cost of a
    call (tracing, compiling the step, finalising). ``n2`` is chosen so the
    extra batches hold about ``work_s`` seconds of float forward passes, at
    least 20, so the difference stands above the noise of the fixed cost.

    Each of the ``reps`` repetitions times the float forward pass (``fwd_call``,
    median of 20 calls) right before and right after its two calibrations and
    averages the two, so that load from other processes affects both sides of
    the ratio alike. ``ratio`` is the median of the repetitions' own ratios (each
    pairs a calibration with the forward passes timed beside it), which is not
    ``per_batch / fwd`` (the medians of the two times, taken separately);
    ``ratios`` lists the repetitions' ratios.
    """
    fwd0 = median_time(fwd_call, n=20)
    n2 = n1 + max(20, min(2000, math.ceil(work_s / max(fwd0, 1e-9))))
    b1 = [distinct[i % len(distinct)] for i in range(n1)]
    b2 = [distinct[i % len(distinct)] for i in range(n2)]
    jqt.calibrate(f, recipe, variables, b1, progress=False)  # warm call
    per, fwd, ratio, totals = [], [], [], []
    for _ in range(reps):
        before = median_time(fwd_call, n=20)
        t1 = _once(lambda: jqt.calibrate(f, recipe, variables, b1, progress=False))
        t2 = _once(lambda: jqt.calibrate(f, recipe, variables, b2, progress=False))
        fwd.append((before + median_time(fwd_call, n=20)) / 2)
        per.append((t2 - t1) / (n2 - n1))
        ratio.append(per[-1] / fwd[-1])
        totals.append((t1, t2))
    return dict(per_batch=statistics.median(per), fwd=statistics.median(fwd),
                ratio=statistics.median(ratio), ratios=ratio, totals=totals, n1=n1, n2=n2)


def trace_transform(wl, reps: int = 3) -> dict:
    """Trace + lower and compile times of the float and the jqt (w8a8, packed) model.

    A fresh Python function wraps ``model.apply`` for every measurement, so no
    JAX or jqt trace cache is reused; an untimed repetition runs first. Returns
    medians in seconds, and the wall
    time of ``jqt.calibrate`` on one batch (tracing, analysis, compiling the
    calibration step, running it, finalising).
    """
    model = wl.make_model()
    variables = wl.init(model)
    x = wl.input(wl.batches[0])
    calib = wl.calibration_batches(1)
    recipe = jqt.recipes.w8a8()
    rows = {k: [] for k in ("float_lower", "float_compile", "jqt_lower", "jqt_compile",
                            "calibrate")}
    def fresh():
        return lambda p, x: model.apply(p, x)

    # one untimed repetition first: the first lowering in a process pays JAX's own warm-up
    # (it went to float, always lowered first: "jqt / float" read 0.9x at --quick's 1 rep)
    for _ in range(reps + 1):
        f = fresh()

        t = time.perf_counter()
        lowered = jax.jit(f).lower(variables, x)
        rows["float_lower"].append(time.perf_counter() - t)
        t = time.perf_counter()
        lowered.compile()
        rows["float_compile"].append(time.perf_counter() - t)

        t = time.perf_counter()
        qp = jqt.calibrate(fresh(), recipe, variables, calib, progress=False)
        rows["calibrate"].append(time.perf_counter() - t)
        packed = jqt.pack(qp, variables)
        t = time.perf_counter()
        lowered = jax.jit(jqt.quantize(fresh(), qp)).lower(packed, x)
        rows["jqt_lower"].append(time.perf_counter() - t)
        t = time.perf_counter()
        lowered.compile()
        rows["jqt_compile"].append(time.perf_counter() - t)
    return {k: statistics.median(v[1:]) for k, v in rows.items()}
