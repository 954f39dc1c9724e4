"""The PNG of :meth:`jqt.Report.plot` (matplotlib, an optional extra)."""
from __future__ import annotations

import numpy as np

HIST_BINS = 64
"""Bins of a report histogram, over the quantized range widened by half its width on
each side (``report.py`` counts them, ``plot_report`` draws them)."""


def pct(f):
    """A fraction as a percentage of 2 decimals, a nonzero one below them as ``<0.01%``
    (one output in 65,536 is not "0.00%") and one short of 1 as ``>99.99%``.

    >>> pct(0.0), pct(1 / 65536), pct(0.5), pct(1 - 1e-6), pct(1.0)
    ('0.00%', '<0.01%', '50.00%', '>99.99%', '100.00%')
    """
    if f is None or np.isnan(f):
        return "-"
    if 0 < f < 5e-5:
        return "<0.01%"
    if 1 - 5e-5 <= f < 1:
        return ">99.99%"
    return f"{100 * f:.2f}%"


def db(v):
    """An SQNR in dB to one decimal (``inf`` where exact, ``-`` where not measured)."""
    if np.isnan(v):
        return "-"
    return f"{v:.1f}" if np.isfinite(v) else ("inf" if v > 0 else "-inf")


def plot_report(report, path, histograms):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("jqt.Report.plot needs matplotlib: pip install 'jqt[plot]' "
                          "(or pip install matplotlib).") from None
    rows = list(report.rows)
    worst = [r for r in report.worst(histograms) if r.hist is not None and r.act_qrange]
    ncols = 3
    nrows = 1 + -(-len(worst) // ncols)
    fig = plt.figure(figsize=(12, 3.2 * nrows), layout="constrained")
    grid = fig.add_gridspec(nrows, ncols)
    ax = fig.add_subplot(grid[0, :])
    idx = np.arange(len(rows))
    finite = lambda v: v if np.isfinite(v) else np.nan
    ax.bar(idx - 0.2, [finite(r.sqnr_isolated) for r in rows], 0.4, label="this op alone")
    ax.bar(idx + 0.2, [finite(r.sqnr_cumulative) for r in rows], 0.4, label="with all earlier ops")
    ax.set_xticks(idx, [r.name for r in rows], rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("output SQNR (dB)")
    ax.set_title("per-op SQNR; model output " + (
        "not measured (no float output)" if not report.float_output else
        "not measured (NaN or inf in the outputs)" if np.isnan(report.output_sqnr)
        else f"{db(report.output_sqnr)} dB"))
    ax.legend(fontsize=8)
    for n, r in enumerate(worst):
        a = fig.add_subplot(grid[1 + n // ncols, n % ncols])
        lo, hi = r.act_qrange
        edges = np.linspace(lo - (hi - lo) / 2, hi + (hi - lo) / 2, HIST_BINS + 1)
        a.stairs(r.hist[1:-1], edges, fill=True, alpha=0.7)
        a.axvline(lo, color="r", lw=1)
        a.axvline(hi, color="r", lw=1)
        a.set_yscale("log")
        out = r.hist[0] + r.hist[-1]
        a.set_title(f"{r.name}: {db(r.sqnr_isolated)} dB, clip {pct(r.act_clip)}"
                    + (f", {int(out)} beyond plot" if out else ""), fontsize=8)
        a.tick_params(labelsize=7)
    fig.savefig(path, dpi=100, format="png")  # at path as named, whatever its extension
    plt.close(fig)

