"""Tables and the target check list, as aligned text or markdown."""
from __future__ import annotations

import dataclasses
from typing import Optional

# Targets (ratio to float32 in the same run). `batches` limits the dense checks.
TARGETS = dict(
    dense_w8a8_small=0.5,   # dense4096, jqt w8a8 static or dynamic, batch 1..8
    dense_w8a8_large=0.7,   # dense4096, jqt w8a8 static or dynamic, batch 32..64
    dense_w8_small=1.0,     # dense4096, jqt w8 weight-only, batch 1..8
    encoder_w8a8=0.8,       # encoder block, jqt w8a8
    cnn_w8a8=1.0,           # both CNNs, jqt w8a8
    packed_bytes=0.26,      # dense workloads, packed.nbytes() / float32 bytes
    calib_step=1.5,         # calibration step / float forward
)


@dataclasses.dataclass
class Row:
    """One line of the main table (a variant of a workload at a batch size)."""

    workload: str
    batch: int
    variant: str
    median_ms: Optional[float] = None
    p25_ms: Optional[float] = None
    p75_ms: Optional[float] = None
    n: int = 0
    time_ratio: Optional[float] = None
    bytes_ratio: Optional[float] = None
    err: Optional[float] = None
    rel_err: Optional[float] = None
    na: Optional[str] = None


HEADER = ("workload", "batch", "variant", "median ms", "p25-p75 ms", "n", "time/f32",
          "bytes/f32", "max abs err", "err/max(abs f32)")


def _g(x, fmt):
    return "-" if x is None else format(x, fmt)


def _ms(x):
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.2f}" if x < 100 else f"{x:.1f}")


def cells(r: Row) -> tuple:
    if r.na:
        return (r.workload, str(r.batch), r.variant, f"n/a ({r.na})")
    return (r.workload, str(r.batch), r.variant, _ms(r.median_ms),
            f"{_ms(r.p25_ms)}-{_ms(r.p75_ms)}", str(r.n), _g(r.time_ratio, ".2f"),
            _g(r.bytes_ratio, ".3f"), _g(r.err, ".2e"), _g(r.rel_err, ".2e"))


def table(header, rows, markdown=False, left=(0, 2)) -> str:
    """Aligned text (numbers right-aligned) or a markdown table. A row shorter than
    the header (an n/a row) runs its last cell on past the columns."""
    rows = [tuple(map(str, r)) for r in rows]
    if markdown:
        out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for r in rows:
            r = r + ("",) * (len(header) - len(r))
            out.append("| " + " | ".join(c.replace("|", "/") for c in r) + " |")
        return "\n".join(out)
    full = [r for r in rows if len(r) == len(header)] + [tuple(header)]
    widths = [max(len(r[i]) for r in full) for i in range(len(header))]
    lines = []
    for k, r in enumerate([tuple(header)] + rows):
        parts = []
        for i, c in enumerate(r):
            if len(r) < len(header) and i == len(r) - 1:
                parts.append(c)
            else:
                parts.append(c.ljust(widths[i]) if i in left else c.rjust(widths[i]))
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main_table(rows, markdown=False) -> str:
    return table(HEADER, [cells(r) for r in rows], markdown)


@dataclasses.dataclass
class Check:
    target: str
    limit: float
    measured: Optional[float]
    detail: str = ""

    @property
    def status(self) -> str:
        if self.measured is None:
            return "N/A"
        return "PASS" if self.measured <= self.limit else "MISS"


def _ratio(rows, workload, batch, variant, attr="time_ratio"):
    for r in rows:
        if (r.workload, r.batch, r.variant) == (workload, batch, variant) and not r.na:
            return getattr(r, attr)
    return None


def _batches(rows, workload):
    return sorted({r.batch for r in rows if r.workload == workload})


def checks(rows, calib_rows) -> list:
    """The target check list from the main rows and the calibration measurements."""
    out = []
    for b in _batches(rows, "dense4096"):
        st, dy = (_ratio(rows, "dense4096", b, v) for v in ("jqt w8a8", "jqt w8a8_dynamic"))
        best = min((v for v in (st, dy) if v is not None), default=None)
        key = "dense_w8a8_small" if b <= 8 else "dense_w8a8_large"
        out.append(Check(f"dense4096 w8a8 (static or dynamic) batch {b}", TARGETS[key], best,
                         f"static {_g(st, '.2f')}, dynamic {_g(dy, '.2f')}"))
    for b in [b for b in _batches(rows, "dense4096") if b <= 8]:
        out.append(Check(f"dense4096 w8 weight-only batch {b}", TARGETS["dense_w8_small"],
                         _ratio(rows, "dense4096", b, "jqt w8")))
    for wl, key in (("encoder", "encoder_w8a8"), ("cnn_digits", "cnn_w8a8"), ("cnn32", "cnn_w8a8")):
        for b in _batches(rows, wl):
            st, dy = (_ratio(rows, wl, b, v) for v in ("jqt w8a8", "jqt w8a8_dynamic"))
            out.append(Check(f"{wl} w8a8 batch {b}", TARGETS[key], st,
                             f"(w8a8_dynamic {_g(dy, '.2f')})"))
    for wl in ("dense4096", "dense1024"):
        bs = _batches(rows, wl)
        if bs:
            vals = [_ratio(rows, wl, bs[0], v, "bytes_ratio")
                    for v in ("jqt w8a8", "jqt w8a8_dynamic", "jqt w8")]
            vals = [v for v in vals if v is not None]
            out.append(Check(f"{wl} packed int8 bytes / float32 bytes", TARGETS["packed_bytes"],
                             max(vals) if vals else None, "largest of the three jqt presets"))
    for c in calib_rows:
        out.append(Check(f"calibration step {c['name']}", TARGETS["calib_step"], c.get("ratio"),
                         c.get("detail", "")))
    return out


def check_table(cs, markdown=False) -> str:
    header = ("status", "target", "measured", "limit", "detail")
    rows = [(c.status, c.target, _g(c.measured, ".3f"),
             f"<= {c.limit:g}", c.detail) for c in cs]
    return table(header, rows, markdown, left=(0, 1, 4))


def environment(root: str) -> str:
    """One line: jqt version and commit of ``root``, jax/flax versions, platform, load."""
    import os
    import platform
    import subprocess
    import time

    import flax
    import jax

    import jqt
    try:
        commit = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"jqt {jqt.__version__} ({commit}), jax {jax.__version__}, flax {flax.__version__}, "
            f"{jax.devices()[0].platform} x{os.cpu_count()} cores, "
            f"{platform.processor() or platform.machine()}, load average {load}, "
            f"{time.strftime('%Y-%m-%d %H:%M')}")
