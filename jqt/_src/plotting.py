"""How reports look: the cells of their text tables and the PNG of
:meth:`jqt.Report.plot` (matplotlib, an optional extra)."""
from __future__ import annotations

import os
import unicodedata

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
    return f"{v:z.1f}" if np.isfinite(v) else ("inf" if v > 0 else "-inf")


def width(text):
    """The terminal columns ``text`` takes: two for a wide (CJK, full-width) character,
    none for a mark drawn on the one before it, a format character (a zero-width joiner)
    or a Hangul vowel or final consonant of a decomposed syllable, so that a table's
    columns line up under any op key.

    >>> width("dense"), width("層/kernel"), width("e\u0301"), width("\u0e01\u0e31"), width("a\u200db")
    (5, 9, 1, 1, 2)
    """
    return sum(0 if unicodedata.category(c) in ("Mn", "Me", "Cf") or "\u1160" <= c <= "\u11ff" else
               2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def pad(text, n, right=False):
    """``text`` padded with spaces to ``n`` terminal columns (:func:`width`), on the
    left where ``right``; a longer text is left as it is.

    >>> pad("層", 4) + "|", pad("ab", 4, right=True)
    ('層  |', '  ab')
    """
    fill = " " * max(0, n - width(text))
    return fill + text if right else text + fill


def marks(values, quantized=None):
    """``(index, text)`` for each SQNR a bar cannot show: ``exact`` (inf: the op changed
    nothing), ``float`` (inf: an op kept float, where ``quantized`` says so), ``-inf``
    (the worst: quantization lost the output to inf or NaN) and ``n/a`` (not measured);
    a bar of NaN height draws nothing, and both infinities drew none.

    >>> marks([1.0, np.inf, -np.inf, np.nan, np.inf], [True, True, True, True, False])
    [(1, 'exact'), (2, '-inf'), (3, 'n/a'), (4, 'float')]
    """
    quantized = [True] * len(values) if quantized is None else quantized
    return [(i, "n/a" if np.isnan(v) else ("exact" if q else "float") if v > 0 else "-inf")
            for i, (v, q) in enumerate(zip(values, quantized)) if not np.isfinite(v)]


def shorten(names, n=40):
    """``names`` as labels of at most ``n`` characters that keep them apart: the leading
    path segments they all share dropped, then a longer one cut in the middle, its start
    kept to the end of the segment where the labels first differ (the block or layer)
    and its end naming the weight (a cut of the start alone made every layer's label the
    same).

    >>> shorten(["params/Block_0/Attention_0/query/kernel",
    ...          "params/Block_1/Attention_0/query/kernel"], 20)
    ['Block_0/A…ery/kernel', 'Block_1/A…ery/kernel']
    """
    parts = [name.split("/") for name in names]
    common = 0
    while len(parts) > 1 and all(len(p) > common + 1 for p in parts) \
            and len({p[common] for p in parts}) == 1:
        common += 1
    cut = ["/".join(p[common:]) for p in parts]
    same = len(os.path.commonprefix(cut)) if len(cut) > 1 else 0

    def one(c):  # the start kept to the end of the segment where the labels differ
        if len(c) <= n:
            return c
        end = c.find("/", same)
        head = min(max((n - 1) // 2, len(c) if end < 0 else end), n - 2)
        return c[:head] + "…" + c[-(n - 1 - head):]
    return [one(c) for c in cut]


def plot_report(report, path, histograms):
    try:  # a Figure of its own, no pyplot: the caller's backend (a notebook's) untouched
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("jqt.Report.plot needs matplotlib: pip install 'jqt[plot]' "
                          "(or pip install matplotlib).") from None
    rows = list(report.rows)
    worst = [r for r in report.worst(len(report.rows)) if r.hist is not None and r.act_qrange]
    worst = worst[:histograms]  # (the worst ops with a histogram: not every op has one)
    ncols = 3
    nrows = 1 + -(-len(worst) // ncols)
    # (wider with many rows: 96 layers' names ran together at 12 inches)
    fig = Figure(figsize=(min(max(12, 0.2 * len(rows)), 60), 3.2 * nrows), layout="constrained")
    grid = fig.add_gridspec(nrows, ncols)
    ax = fig.add_subplot(grid[0, :])
    idx = np.arange(len(rows))
    finite = lambda v: v if np.isfinite(v) else np.nan
    series = (([r.sqnr_isolated for r in rows], -0.2, "this op alone"),
              ([r.sqnr_cumulative for r in rows], 0.2, "with all earlier ops"))
    for values, off, label in series:
        ax.bar(idx + off, [finite(v) for v in values], 0.4, label=label)
    ax.set_xlim(-0.6, len(rows) - 0.4)  # (bars of NaN height set no limits)
    bottom = ax.get_ylim()[0]
    for values, off, _ in series:  # what a bar cannot show, written where it would stand
        for i, text in marks(values, [r.quantized for r in rows]):
            ax.text(i + off, bottom, text, rotation=90, ha="center", va="bottom", fontsize=7,
                    color="red" if text == "-inf" else "gray")
    ax.set_xticks(idx, shorten([r.name for r in rows]), rotation=45, ha="right", fontsize=7)
    ax.set_ylabel("output SQNR (dB)")
    ax.set_title("per-op SQNR; model output " + (
        "not measured (no float output)" if not report.float_output else
        "not measured (NaN or inf in the outputs)" if np.isnan(report.output_sqnr)
        else f"{db(report.output_sqnr)} dB"))
    ax.legend(fontsize=8)
    titles = shorten([r.name for r in worst], 24)
    for n, r in enumerate(worst):
        a = fig.add_subplot(grid[1 + n // ncols, n % ncols])
        lo, hi = r.act_qrange
        edges = np.linspace(lo - (hi - lo) / 2, hi + (hi - lo) / 2, HIST_BINS + 1)
        a.stairs(r.hist[1:-1], edges, fill=True, alpha=0.7)
        a.axvline(lo, color="r", lw=1)
        a.axvline(hi, color="r", lw=1)
        if np.any(r.hist[1:-1] > 0):  # (every value beyond the plot: no count to log-scale)
            a.set_yscale("log")
        out = r.hist[0] + r.hist[-1]
        a.set_title(f"{titles[n]}: {db(r.sqnr_isolated)} dB, clip {pct(r.act_clip)}"
                    + (f", {int(out)} beyond plot" if out else ""), fontsize=8)
        a.tick_params(labelsize=7)
    fig.savefig(path, dpi=100, format="png")  # at path as named, whatever its extension

