"""The PNG of :meth:`jqt.Report.plot` (matplotlib, an optional extra)."""
from __future__ import annotations

import numpy as np

HIST_BINS = 64
"""Bins of a report histogram, over the quantized range widened by half its width on
each side (``report.py`` counts them, ``plot_report`` draws them)."""


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
    ax.set_title("per-op SQNR; model output " + ("not measured (no float output)" if np.isnan(report.output_sqnr)
                                                  else f"{report.output_sqnr:.1f} dB"))
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
        a.set_title(f"{r.name}: {r.sqnr_isolated:.1f} dB, clip {100 * r.act_clip:.2f}%"
                    + (f", {int(out)} beyond plot" if out else ""), fontsize=8)
        a.tick_params(labelsize=7)
    fig.savefig(path, dpi=100, format="png")  # at path as named, whatever its extension
    plt.close(fig)

