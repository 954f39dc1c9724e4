"""``jqt.report``: per-op quantization error of a calibrated function on one batch.

The function runs twice in one pass, as two lanes of a ``jax.vmap`` with an
axis name: lane 0 float, lane 1 simulated-quantized. At each op the handler
gathers both lanes' operands and measures, against the float output computed
from the float lane's operands:

* the output with only this op quantized (``sqnr_isolated``);
* the output of the quantized lane, where every op before it is quantized too
  (``sqnr_cumulative``);
* how many activation and weight values fall outside the quantized range;
* for an op with a narrow accumulator (``Rule(accumulator=16)``), how many of its
  outputs saturated it in the quantized lane.

Statistics are sums (or min/max), merged across ``scan``/``while``
iterations like calibration statistics; an op under a ``scan`` over stacked
layers whose weight the scan slices gets one row per layer (activation x activation
products and cache writes there, whose scales are computed at run time, one row for
all layers).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import accumulator, compat, kvcache, numerics, tracing, validate
from .calibrate import CalibrationDataError, check_batch, full_args
from .handlers import Simulate, exact_sums, expanded_params, lookup, transformed, without_entry
from .plotting import HIST_BINS, db as _db, pad, pct as _pct, plot_report, width
from .tracing import Tracer, normalize_argnums
from .validate import check_qparams

_AXIS = "jqt_report_lane"
_F32 = jnp.float32


def _real(a):
    """``a`` as float32; a complex array by its magnitudes."""
    return (jnp.abs(a) if jnp.iscomplexobj(a) else a).astype(_F32)


def _reduce(name):
    """The reduction of statistic ``name`` over iterations; a loop of none (a ``lax.scan``
    of length 0) gives ``identity``'s values, which ``ran`` reads as not run."""
    if name.endswith("_min"):
        return lambda v, axis: jnp.min(v, axis=axis, initial=jnp.inf)
    if name.endswith("_max"):
        return lambda v, axis: jnp.max(v, axis=axis, initial=-jnp.inf)
    return jnp.sum


class _Measure:
    """Handler: both lanes of every op; lane 0 float, lane 1 quantized."""

    collects = True
    differentiable = False
    named_lanes = _AXIS  # the lanes are a named vmap axis (not carried into jax.shard_map)

    @staticmethod
    def enter_cache(x, qtype):
        """A loop's key/value cache: float in lane 0, as the quantized cache holds it in lane 1
        (a cache passed to f quantized: decoded)."""
        if kvcache.is_cache(x):
            x = kvcache.decode(x, x.float_dtype)
        return jnp.where(lax.axis_index(_AXIS) == 0, x, kvcache.fake_quant(x, qtype))

    def site(self, site, eqn, invals, ctx):
        if without_entry(site, ctx):
            return compat.bind_eqn(eqn, invals)
        qp, packed = lookup(ctx, site, invals)
        both = [_lanes(v) for v in invals]
        xf, xq = [b[0] for b in both], [b[1] for b in both]
        sim = Simulate()
        # complex values (an op kept float) are measured by their magnitudes, and passed
        # on whole: the imaginary part is not dropped
        y_f = compat.bind_eqn(eqn, xf)[0]
        y_iso = sim.site(site, eqn, xf, ctx)[0]
        y_all = sim.site(site, eqn, xq, ctx)[0]
        sq = lambda a: jnp.sum(_real(a) ** 2)
        # where f's own float computation is NaN (a 0/0 upstream: a mean over an all-padding
        # row), both lanes are: measured on the other outputs, counted
        nan_f = jnp.isnan(_real(_wide(y_f)))
        sqm = lambda a: jnp.sum(jnp.where(nan_f, 0.0, _real(a) ** 2))
        st = {"f2": sqm(_wide(y_f)), "e_iso": sqm(_wide(y_iso) - _wide(y_f)),
              "e_all": sqm(_wide(y_all) - _wide(y_f)), "nan_f": jnp.sum(nan_f).astype(_F32),
              "out_n": jnp.float32(nan_f.size)}
        if site.entry.is_cache:  # the operands measured: the buffer and the written update
            xf = [xf[0], xf[site.entry.update_index]]
            # alone, the write's error is its update's: measured against the update, not
            # against the whole buffer (which would lift it with every vector written before)
            st["f2_iso"] = sq(_wide(xf[1]))
        w = site.weight_operand
        hist = jnp.zeros((HIST_BINS + 2,), _F32)
        for i in (0, 1):
            q = qp.operand(i)
            x = _real(transformed(site, qp, i, xf[i]))  # what is quantized
            role = "w" if i == w else ("x" if w is not None or i == 0 else "y")
            # initial=: an operand with no elements (a length-0 sequence) has the merge's identity
            # (NaN left out, as the SQNR leaves out f's own NaN: the range of the others)
            st[f"{role}_min"] = jnp.min(jnp.where(jnp.isnan(x), jnp.inf, x), initial=jnp.inf)
            st[f"{role}_max"] = jnp.max(jnp.where(jnp.isnan(x), -jnp.inf, x), initial=-jnp.inf)
            st[f"{role}_n"] = jnp.float32(x.size)
            st[f"{role}_clip"] = jnp.float32(0)
            if q is None or q.qtype.dynamic:
                continue
            s, z = expanded_params(site, i, x.shape, q)
            lo, hi = clip_range(q.qtype, s, z)
            st[f"{role}_clip"] = jnp.sum((x < lo) | (x > hi)).astype(_F32)
            if role == "x":
                hist = _histogram(x, lo.reshape(()), hi.reshape(()))
        st["hist"] = hist
        if qp.accumulator < accumulator.WIDEST and not qp.is_float:
            sums = exact_sums(site, eqn, qp, packed, xq)
            st["acc_sat"] = accumulator.saturated(sums, qp.accumulator)
            st["acc_n"] = jnp.float32(sums.size)
        ctx.put(site.key, st)
        y_all = y_all.astype(y_f.dtype)
        return [jnp.where(lax.axis_index(_AXIS) == 0, y_f, y_all).astype(eqn.outvars[0].aval.dtype)]

    @staticmethod
    def identity(shapes):
        def one(path, s):
            name = str(getattr(path[-1], "key", path[-1]))
            fill = jnp.inf if name.endswith("_min") else -jnp.inf if name.endswith("_max") else 0.0
            return jnp.full(s.shape, fill, s.dtype)
        return jax.tree_util.tree_map_with_path(one, shapes)

    @staticmethod
    def merge(a, b):
        def one(path, x, y):
            name = str(getattr(path[-1], "key", path[-1]))
            return jnp.minimum(x, y) if name.endswith("_min") else (
                jnp.maximum(x, y) if name.endswith("_max") else x + y)
        return jax.tree_util.tree_map_with_path(one, a, b)

    @staticmethod
    def reduce_iterations(stacked):
        return {k: {n: _reduce(n)(v, axis=0) for n, v in st.items()} for k, st in stacked.items()}


def _wide(a):
    """``a`` in float32 as its own dtype holds it: XLA:CPU may keep a bfloat16 or float16
    op's result in float32 (excess precision) where a cast to float32 follows, and an op's
    row would then leave out the rounding its output takes (a one-op f's row read 0.4 dB
    above the output's SQNR). A barrier keeps the narrow value (a reduce_precision would
    flush float16's subnormals and misround the float8 formats). Complex values pass
    unchanged."""
    if jnp.iscomplexobj(a):
        return a
    if jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32:
        a = lax.optimization_barrier(a)
    return a.astype(_F32)


def _lanes(v):
    """``v``'s value in lane 0 and in lane 1 (every lane gets both), gathered along a new
    last axis: JAX's ``all_gather`` types its result as ``v``'s type with the shape
    changed, so a new leading axis would take the split of ``v``'s first dimension
    where ``v``'s type splits it over explicit mesh axes."""
    both = lax.all_gather(v, _AXIS, axis=jnp.ndim(v))
    return both[..., 0], both[..., 1]


def _histogram(x, lo, hi):
    """HIST_BINS bins over [lo - w/2, hi + w/2] (w = hi - lo), plus an underflow and
    an overflow bin."""
    width = hi - lo
    a = lo - width / 2
    idx = jnp.floor((x - a) / (2 * width) * HIST_BINS).astype(jnp.int32) + 1
    idx = jnp.clip(idx, 0, HIST_BINS + 1)
    # counted in int32: float32 counts stop growing at 2**24 (x + 1 == x there)
    return jnp.zeros((HIST_BINS + 2,), jnp.int32).at[idx.reshape(-1)].add(
        1, out_sharding=compat.replicated_if_split(idx)).astype(_F32)


def _sqnr(signal, noise):
    """SQNR in dB. Defined on degenerate data too: no noise is ``inf`` (exact, even
    when the signal is 0, e.g. an all-zero batch), noise on a zero signal ``-inf``. An
    infinite signal (outputs whose energy, summed in float32, passes 3.4e38: values
    above about 1e19) is not measured: NaN, not ``inf`` ("exact")."""
    if math.isinf(signal) or math.isnan(signal):
        return math.nan
    if noise <= 0:
        return math.inf
    if signal <= 0 or (math.isinf(noise) and math.isfinite(signal)):
        return -math.inf  # an infinite error (an overflow to inf) on a finite signal
    return 10.0 * math.log10(signal / noise)


class _NaN:
    """The mark a NaN field compares and hashes as."""

    def __repr__(self):
        return "nan"


_NAN = _NaN()


def _marked(v):
    if isinstance(v, (float, np.floating)) and math.isnan(v):
        return _NAN
    return tuple(_marked(x) for x in v) if isinstance(v, tuple) else v


class NanEqual:
    """``==`` and ``hash`` of a frozen result dataclass (declared ``eq=False``) over its
    compared fields, a NaN equal to a NaN: a pickled report held new NaN objects, and the
    generated ``__eq__`` found it unequal to itself (it held only by the shared ``math.nan``).

    >>> @dataclasses.dataclass(frozen=True, eq=False)
    ... class Result(NanEqual):
    ...     value: float
    >>> a, b = Result(float("nan")), Result(float("nan"))  # two NaN objects
    >>> a == b, hash(a) == hash(b), a == Result(1.0)
    (True, True, False)
    """

    def _compared(self):
        return tuple(_marked(getattr(self, f.name)) for f in dataclasses.fields(self) if f.compare)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._compared() == other._compared()

    def __hash__(self):  # (a result holding qparams, FallbackResult's, has arrays: unhashable)
        try:
            return hash(self._compared())
        except TypeError:
            raise TypeError(f"a jqt.{type(self).__name__} holds arrays or dicts (qparams) and is not "
                            "hashable; compare it with ==.") from None


@dataclasses.dataclass(frozen=True, eq=False)
class OpReport(NanEqual):
    """One row of a :class:`Report`: one op (one layer of a stacked op).

    Attributes:
      key: the op key (as in the qparams); ``name`` adds ``[layer]``.
      layer: the step of a ``lax.scan`` over stacked layers (a tuple under nested
        scans), or ``None``.
      op: the primitive's name (``"dot_general"``, ``"conv_general_dilated"``, ``"gather"``).
      weight_shape, act_shape: the operands' shapes (``()`` for no weight).
      weight, activation: the types as text (``"int8 sym per-channel"``, ``"nf4 sym
        g64"``, ``"float"``; ``"-"`` for an op with no weight).
      weight_scale: ``(min, max)`` of the weight's scales, or ``None``.
      weight_zero_point: ``(min, max)`` of an asymmetric weight's (integer) zero points,
        or ``None``.
      act_scale, act_zero_point: the static activation scale and the integer zero point
        the paths use, or ``None`` (float or dynamic).
      act_range: the float activation's ``(min, max)`` on this batch (after smoothing or
        rotation).
      act_qrange: the real range the activation codes cover (half a step beyond the
        extreme codes), or ``None``.
      act_clip, weight_clip: the fractions (0 to 1) of activation and weight values
        outside the quantized range.
      sqnr_isolated: dB, the op's output with only this op quantized, against float.
      sqnr_cumulative: dB, with this op and every op before it quantized.
      note: why an op is float, or what to read with care; ``""`` for none.
      quantized: ``False`` for an op kept float.
      accumulator: the accumulator's width in bits (32: jqt's int32).
      acc_saturated: the fraction of outputs that saturated a narrow accumulator
        (NaN where none was measured).
      hist: the activation histogram (:meth:`Report.plot`), left out of ``as_dicts``.

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda p, x: x @ p["w"]
    >>> p, x = {"w": jnp.eye(3)}, jnp.arange(6.0).reshape(2, 3)
    >>> row = jqt.report(f, jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False),
    ...                  p, (x,)).rows[0]
    >>> row.name, row.op, row.weight_shape, row.act_clip
    ('w', 'dot_general', (3, 3), 0.0)
    """

    key: str
    layer: Optional[int]   # the step of a lax.scan over stacked layers; a tuple under nested scans
    op: str
    weight_shape: tuple
    act_shape: tuple
    weight: str            # the weight type, e.g. "int8 sym per-channel", "nf4 sym g64", or "float"
    activation: str
    weight_scale: tuple    # (min, max) of the weight scales, or None
    act_scale: Optional[float]
    act_zero_point: Optional[float]  # the integer zero point the paths use (rounded)
    act_range: tuple       # the float activation's (min, max) on this batch (smoothed/rotated)
    act_qrange: Optional[tuple]  # the real range the activation codes cover (half a step beyond)
    act_clip: float        # fraction of activation values outside the quantized range
    weight_clip: float     # fraction of weight values outside it
    sqnr_isolated: float   # dB, this op quantized alone
    sqnr_cumulative: float  # dB, this op and every op before it quantized
    note: str
    quantized: bool = True  # False for an op kept float
    accumulator: int = 32   # the accumulator's width in bits
    acc_saturated: float = math.nan  # fraction of outputs that saturated a narrow accumulator
    weight_zero_point: Optional[tuple] = None  # (min, max) of an asymmetric weight's zero points
    hist: Optional[np.ndarray] = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def name(self) -> str:
        """The key, with ``[layer]`` for a layer of a stacked op (``[i, j]`` under nested
        scans)."""
        if self.layer is None:
            return self.key
        return f"{self.key}[{', '.join(map(str, np.atleast_1d(self.layer)))}]"


@dataclasses.dataclass(frozen=True, eq=False)
class Report(NanEqual):
    """What :func:`jqt.report` returns: per-op rows and the end-to-end error.

    ``str(report)`` is a table; ``rows`` the data; :meth:`worst` ranks the ops;
    :meth:`plot` draws the per-op SQNR and activation histograms to a PNG.

    Attributes:
      rows: the :class:`OpReport` of each op, in the order ``f`` runs them.
      output_sqnr: dB, ``f``'s float outputs quantized vs float (inf: exact; NaN: ``f``
        returns no float output).
      output_rel_l2, output_max_abs: their relative L2 error (0 when exact) and largest
        absolute error.
      output_int_differ: ``(values that differ, values)`` of integer and bool outputs.
      output_leaves: ``(path, SQNR dB)`` of each float output where ``f`` returns several
        (pooled in the figures above).
      float_output: whether ``f`` returns a float output.
      output_nan: float output values NaN on both lanes (``f``'s own), left out of the
        error.
      output_nan_one_lane: float output values NaN on one lane only (the error is then NaN).

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda p, x: jax.nn.relu(x @ p["a"]) @ p["b"]
    >>> p = {"a": jnp.eye(4), "b": jnp.ones((4, 2))}
    >>> x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    >>> rep = jqt.report(f, jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False), p, (x,))
    >>> [r.name for r in rep.worst(2)] == sorted(["a", "b"], key=lambda k: {r.key: r.sqnr_isolated
    ...                                                                   for r in rep.rows}[k])
    True
    >>> sorted(rep.as_dicts()[0])[:4]
    ['acc_saturated', 'accumulator', 'act_clip', 'act_qrange']
    """

    rows: tuple
    output_sqnr: float       # dB, the function's float outputs, quantized vs float (inf: exact;
    #                          nan: f returns no float output)
    output_rel_l2: float     # 0 when exact, also on an all-zero batch
    output_max_abs: float
    output_int_differ: tuple = (0, 0)  # integer / bool outputs: (values that differ, values)
    output_leaves: tuple = ()  # (path, SQNR dB) per float output where f returns several
    #                            (logits beside the state f passes back, which pools in the above)
    float_output: bool = True  # f returns a float output (its SQNR is NaN where it holds NaN)
    output_nan: int = 0  # float output values NaN on both lanes (f's own): left out of the above
    output_nan_one_lane: int = 0  # float output values NaN on one lane only: the error is NaN

    def worst(self, n: int = 5) -> list:
        """The ``n`` quantized ops with the lowest isolated SQNR, worst first."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"Report.worst: n={n!r}; expected a count of rows >= 0, e.g. worst(3).")
        q = [r for r in self.rows if r.quantized and not math.isnan(r.sqnr_isolated)]
        return sorted(q, key=lambda r: r.sqnr_isolated)[:n]

    def as_dicts(self) -> list:
        """The rows as plain dicts (e.g. for ``pandas.DataFrame``)."""
        return [{k: v for k, v in dataclasses.asdict(r).items() if k != "hist"} for r in self.rows]

    def __str__(self):
        narrow = any(r.accumulator < accumulator.WIDEST for r in self.rows)
        head = ("op", "kind", "weight", "activation", "act scale", "act clip", "w clip",
                "SQNR alone", "SQNR cumul.") + (("acc sat.",) if narrow else ())
        lines = [head]
        for r in self.rows:
            scale = "-" if r.act_scale is None else f"{r.act_scale:.3g}"
            sat = (("-" if r.accumulator == accumulator.WIDEST else
                    f"{_pct(r.acc_saturated)} (int{r.accumulator})",) if narrow else ())
            # no clip where there is no range to clip to (a float or dynamic operand)
            wclip = "-" if r.weight in ("float", "-") or r.weight.endswith(" dyn") else _pct(r.weight_clip)
            lines.append((r.name, r.op.replace("_general", "").replace("_dilated", ""), r.weight,
                          r.activation, scale, "-" if r.act_scale is None else _pct(r.act_clip),
                          wclip, _db(r.sqnr_isolated), _db(r.sqnr_cumulative)) + sat)
        widths = [max(width(str(l[i])) for l in lines) for i in range(len(head))]
        out = ["  ".join(pad(str(c), w, right=i >= 4)
                         for i, (c, w) in enumerate(zip(l, widths))).rstrip() for l in lines]
        exact = " (exact)" if self.output_sqnr == math.inf else ""
        if not self.float_output:
            out.append("output: f returns no float output, so no output error was measured")
        else:
            out.append(f"output: SQNR {_db(self.output_sqnr)} dB{exact}, relative L2 error "
                       f"{self.output_rel_l2:.3g}, max abs error {self.output_max_abs:.3g}"
                       f"{' (all float outputs pooled)' if self.output_leaves else ''}")
            one = self.output_nan_one_lane
            if self.output_nan:
                out.append(f"f's float output is NaN at {self.output_nan} values, as the "
                           "quantized one is (a 0/0 in f itself): "
                           + ("left out of the error" if one else "nothing else to measure"
                              if math.isnan(self.output_rel_l2) else "measured on the others"))
            if one:
                out.append(f"NaN on one lane only at {one} output values (quantized vs float: a "
                           "value quantization moved out of a log's or a sqrt's domain, an "
                           "overflow), so the output error is NaN; the rows' SQNR show the op "
                           "where it starts")
            if self.output_leaves:
                worst = sorted(self.output_leaves, key=lambda t: (not math.isnan(t[1]), t[1]))
                each = [f"{k or 'out'} {'exact' if v == math.inf else _db(v) + ' dB'}" for k, v in worst]
                out.append("output SQNR per output, worst first: " + ", ".join(each[:4])
                           + (" ..." if len(each) > 4 else ""))
        kept = {}
        for r in self.rows:
            if not r.quantized or r.note in (_TRIPS, _BRANCH, _HUGE) or r.note.startswith(_NAN_F):
                # (an op made float in the qparams by hand has no note: summarize's words)
                # (a float op by key: all its layers are, one entry, so the line names more
                # ops; a note may be one layer's)
                kept.setdefault((r.quantized, r.note or "made float in the qparams"),
                                []).append(r.name if r.quantized else r.key)
        for (quantized, note), names in kept.items():
            names = list(dict.fromkeys(names))
            out.append(f"{'note' if quantized else 'kept float'} ({note}): {', '.join(names[:6])}"
                       f"{' ...' if len(names) > 6 else ''}")
        sat = [r for r in self.rows if r.acc_saturated > 0]  # (NaN: none measured)
        if sat:
            each = [f"{r.name} ({_pct(r.acc_saturated)} of outputs, int{r.accumulator})"
                    for r in sorted(sat, key=lambda r: -r.acc_saturated)]
            out.append("accumulator saturated: " + ", ".join(each[:4]) + (" ..." if len(each) > 4 else ""))
        differ, total = self.output_int_differ
        if total:
            out.append(f"integer outputs: {differ} of {total} values differ from float's")
        worst = self.worst(1)
        if worst and worst[0].sqnr_isolated < math.inf:  # every op exact: no worst one
            out.append(f"worst op (SQNR alone): {worst[0].name} ({_db(worst[0].sqnr_isolated)} dB)")
        return "\n".join(out)

    def plot(self, path: str, *, histograms: int = 6) -> None:
        """Writes a PNG to ``path`` as named (whatever its extension): per-op SQNR bars
        (alone and cumulative) and the activation histograms of the ``histograms`` worst
        ops with their quantized range. Needs matplotlib (``pip install jqt[plot]``)."""
        if not isinstance(path, (str, os.PathLike)) and not hasattr(path, "write"):
            raise TypeError(f"Report.plot: path is a {type(path).__name__}; pass the file to "
                            "write the PNG to, a str or pathlib.Path (or a binary file object).")
        if isinstance(histograms, bool) or not isinstance(histograms, (int, np.integer)) or histograms < 0:
            raise ValueError(f"Report.plot: histograms={histograms!r}; expected a count of ops >= 0 "
                             "whose activation histograms to draw, e.g. histograms=6 (0: none).")
        if isinstance(path, (str, os.PathLike)):
            folder = os.path.dirname(os.path.realpath(os.fspath(path)))
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"Report.plot: cannot write {os.fspath(path)!r}: its folder "
                                        f"{folder!r} does not exist. Create it first "
                                        "(os.makedirs(folder, exist_ok=True)).")
        plot_report(self, path, histograms)


def _short(q):
    """The type's text (``QuantType.describe``), "dynamic" shortened: "nf4 sym g64",
    "float8_e4m3fn sym per-tensor", "int8 asym per-row dyn"."""
    if q is None:
        return "float"
    return q.qtype.describe().replace(" dynamic", " dyn")


def report(f, qparams, params, batch, *, weight_argnums=0) -> Report:
    """Measures the quantization error of each op of ``f`` on one batch.

    Args:
      f: the function that was calibrated.
      qparams: its parameters, from :func:`jqt.calibrate`.
      params: the float weights (not :func:`jqt.pack`'s, which lost the float values).
      batch: a tuple of the remaining arguments of ``f``, as in calibration.
      weight_argnums: as in :func:`jqt.calibrate`.

    Returns:
      a :class:`jqt.Report`: ``print`` it for a table, ``.rows`` for the data,
      ``.worst(n)`` for the ranking, ``.plot(path)`` for a PNG.

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda p, x: jax.nn.relu(x @ p["a"]) @ p["b"]
    >>> p = {"a": jnp.eye(4), "b": jnp.ones((4, 2))}
    >>> x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    >>> r = jqt.report(f, qp, p, (x,))
    >>> [row.key for row in r.rows], r.output_sqnr > 30
    (['a', 'b'], True)
    """
    check_qparams(qparams, "jqt.report")
    argnums = normalize_argnums(weight_argnums)
    validate.check_argnums(qparams, argnums, "jqt.report")
    params_t = validate.weight_args(params, argnums, "jqt.report")
    if not isinstance(batch, (tuple, list)):  # as calibrate refuses a batch that is not one
        what = (f"an array of shape {tuple(batch.shape)}" if hasattr(batch, "shape")
                else f"of type {type(batch).__name__}")
        raise CalibrationDataError(f"jqt.report: batch is {what}; pass a tuple of the "
                                   "remaining arguments of f, e.g. (x,).")
    batches_like = isinstance(batch, list) and bool(batch) and all(isinstance(b, tuple) for b in batch)
    batch = tuple(batch)
    check_batch(0, batch, None, "jqt.report")  # no empty or non-finite arrays
    tracer = Tracer(f, argnums, "jqt.report")
    try:
        traced = tracer(full_args(argnums, params_t, batch))
    except Exception as e:
        if note := validate.argnums_note(qparams, argnums, "jqt.report", params_t):
            e.add_note(note)
        if batches_like:  # calibrate's list of batches, where report takes one batch
            e.add_note(f"jqt.report: batch is a list of {len(batch)} tuples, as jqt.calibrate's "
                       "batches are; jqt.report measures one batch, a tuple of f's remaining "
                       "arguments: pass batches[0].")
        raise
    validate.check_keys(traced, qparams, "jqt.report")
    state = {s.key: (qparams[s.key], None) for s in traced.sites() if s.key in qparams}

    def lanes_fn(params_t, state, b):
        def lane(_, *b):
            return traced.run(full_args(argnums, params_t, b), _Measure(), state)
        # the batch is the same for both lanes, not stacked: a PRNG key in it draws the same
        # bits in both (an rbg key under vmap draws other bits in each lane of a stack)
        return jax.vmap(lane, in_axes=(0,) + (None,) * len(b), axis_name=_AXIS)(jnp.arange(2), *b)

    # weights and qparams are arguments, not constants XLA would spend minutes folding
    lanes = tracing.mark_static(batch)
    try:
        outs, st = jax.jit(lanes_fn)(tracing.mark_static(params_t), state, lanes)  # config leaves static
    except (NotImplementedError, ValueError) as e:  # a primitive with no batching rule for
        # the lane axis; JAX refuses an ordered io_callback with a ValueError
        if isinstance(e, ValueError) and "vmap" not in str(e):
            raise
        raise NotImplementedError(
            "jqt.report runs f on two lanes (float and quantized) under jax.vmap, and a "
            f"primitive of f cannot be batched that way ({e}). Compare jqt.quantize(f, qparams, "
            "simulate=True) with f on the batch instead.") from e
    st = jax.tree_util.tree_map(lambda x: np.asarray(x[0], np.float64), st)
    rows = []
    for s in traced.sites():
        if s.key in qparams:  # an optional op without an entry ran float: no row
            rows.extend(_rows(s, qparams[s.key], st.get(s.key)))
    f2 = e2 = mx = 0.0
    floats, differ, total, leaves, nan_out, n_float, one_lane = False, 0, 0, [], 0, 0, 0
    paths = _output_paths(traced.out_tree, len(outs))
    for path, o in zip(paths, outs):
        if jax.dtypes.issubdtype(o.dtype, jax.dtypes.prng_key):  # a typed key f returns
            o = jax.random.key_data(o)
        if not jnp.issubdtype(np.asarray(o).dtype, jnp.inexact):  # bfloat16 and fp8 too
            o = np.asarray(o)  # integer and bool outputs (token ids, masks): counted apart
            differ, total = differ + int(np.sum(o[1] != o[0])), total + o[0].size
            continue
        floats = True
        o = np.asarray(o, np.complex128 if np.iscomplexobj(o) else np.float64)
        # equal entries are exact, matching infinities (masked logits) too: they add to
        # neither energy; an infinity or NaN that differs makes the error NaN or inf
        # NaN on both lanes: f's own (a 0/0 in the float model too), counted and left out
        both_nan = np.isnan(o[0]) & np.isnan(o[1])
        nan_out += int(np.sum(both_nan))
        one_lane += int(np.sum(np.isnan(o[0]) != np.isnan(o[1])))
        n_float += o[0].size
        same = (o[1] == o[0]) | both_nan
        ref = np.where(same & ~np.isfinite(o[0]), 0, o[0])
        with np.errstate(invalid="ignore"):
            d = np.where(same, 0, o[1] - o[0])
        lf2, le2 = float(np.sum(np.abs(ref) ** 2)), float(np.sum(np.abs(d) ** 2))
        f2, e2 = f2 + lf2, e2 + le2
        leaves.append((path, math.nan if not o[0].size or both_nan.all() else _sqnr(lf2, le2)))
        if o[0].size:
            m = float(np.max(np.abs(d)))  # NaN where a NaN differs: kept, not max()'d away
            mx = m if (math.isnan(m) or m > mx) else mx
    if not floats or not n_float:  # (float outputs of no values: nothing measured either)
        return Report(rows=tuple(rows), output_sqnr=math.nan, output_rel_l2=math.nan,
                      output_max_abs=math.nan, output_int_differ=(differ, total), float_output=False)
    if nan_out and nan_out == n_float:  # every value NaN in f itself: nothing measured
        f2 = e2 = mx = math.nan
    return Report(rows=tuple(rows), output_sqnr=_sqnr(f2, e2), output_rel_l2=_rel(f2, e2),
                  output_max_abs=mx, output_int_differ=(differ, total),
                  output_leaves=tuple(leaves) if len(leaves) > 1 else (), output_nan=nan_out,
                  output_nan_one_lane=one_lane)


def _output_paths(tree, n):
    """The paths of ``f``'s ``n`` output leaves (``[0]``, ``['logits']``); by position
    where the output's type will not be rebuilt from placeholders (a dataclass whose
    ``__post_init__`` checks its fields)."""
    try:
        leaves = jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(tree, [np.zeros(()) for _ in range(n)]))[0]
    except Exception:  # noqa: BLE001 -- any check the output's constructor makes
        return [f"[{i}]" for i in range(n)]
    return [jax.tree_util.keystr(k) for k, _ in leaves] if len(leaves) == n else \
        [f"[{i}]" for i in range(n)]


def _rel(signal, noise):
    """Relative L2 error ``sqrt(noise / signal)``: 0 when there is no error (even on a zero
    signal, e.g. an all-zero batch), ``inf`` for an error on a zero signal."""
    if math.isnan(noise) or math.isnan(signal):
        return math.nan  # a NaN in the outputs: as the SQNR
    if noise <= 0:
        return 0.0
    return math.sqrt(noise / signal) if signal > 0 else math.inf


def clip_range(qtype, s, z):
    """The real values that quantize without clipping: the grid's ends widened by half a
    step (``numerics.clip_edges``, the edges QAT's gradient uses), since a value up to
    there rounds to the end code as it would to any other: an integer step, half nf4's
    outermost gap, half the step of fp8's largest binade.

    >>> import jqt
    >>> clip_range(jqt.QuantType(bits=8), 0.5, 0.0)
    (-64.25, 63.75)
    >>> [round(v, 4) for v in clip_range(jqt.QuantType(dtype="nf4", group_size=64), 2.0, 0.0)]
    [-2.3038, 2.277]
    """
    lo, hi = numerics.clip_edges(qtype.qmin, qtype.qmax, qtype.grid)
    return (lo - z) * s, (hi - z) * s


def _qrange(q, scale, zp):
    if q is None or scale is None or q.qtype.dynamic:
        return None
    s = float(np.asarray(scale).reshape(-1)[0])
    z = 0.0 if zp is None else float(np.round(np.asarray(zp).reshape(-1)[0]))
    return clip_range(q.qtype, s, z)


_TRIPS = ("a while_loop around it ran other numbers of iterations on the float and quantized "
          "lanes (an adaptive step size, an early exit): measured over the iterations both ran, "
          "whose states differ; the output's figures are the ones to read")
_BRANCH = ("a cond or switch around it took other branches on the float and quantized lanes "
           "(an early exit whose threshold the quantization crosses): its row follows the float "
           "lane's branch; the output's figures are the ones to read")


_NAN_F = "f's float computation is NaN at "


def _nan_note(n, of):
    if n >= of:
        return (f"{_NAN_F}every one of its {int(n)} output values (a 0/0 or a log of a "
                "negative number upstream: NaN on both lanes): not measured")
    return (f"{_NAN_F}{int(n)} of its output values (a 0/0 or a log of a negative number "
            "upstream: NaN on both lanes): measured on the others")


_HUGE = ("its output's energy, summed in float32, passes 3.4e38 (values above about 1e19): its "
         "SQNR is not measured; the output's figures, in float64, are the ones to read")


def _rows(site, qp, st):
    w = site.weight_operand
    avals = [v.aval for v in site.eqn.invars]
    wq = qp.operand(w) if w is not None else None
    aq = qp.operand(1 - w) if w is not None else qp.lhs
    if st is None:  # never ran on this batch
        st = {}
    depth = np.ndim(st["f2"]) if "f2" in st else 0
    if depth and not np.size(st["f2"]):  # a scan over a stack of no layers: one row, not run
        st, depth = {}, 0
    layers = [None] if depth == 0 else list(np.ndindex(*np.shape(st["f2"])))
    out = []
    for li in layers:
        g = (lambda n: np.asarray(st[n])) if li is None else (lambda n: np.asarray(st[n])[li])
        pick = lambda a: None if a is None or not np.size(a) else (np.asarray(a) if li is None else
                                                  np.asarray(a)[li] if np.ndim(a) >= len(li) else np.asarray(a))
        ran = "f2" in st and g("x_n") > 0
        # This layer's own flags: one recorded outside the inner scans of nested ones has
        # fewer axes, and holds for every layer of those. The branch note stands where the
        # float lane did not run the op (the quantized lane did).
        flag = lambda a: np.asarray(a)[() if li is None else li[:np.ndim(a)]]
        trips = ran and bool(np.any(flag(st.get("trips_differ_max", 0.0)) > 0))
        branch = bool(np.any(flag(st.get("branch_differs_max", 0.0)) > 0))
        # f's float computation NaN at every output of the op: nothing left to measure
        all_nan = ran and "out_n" in st and g("nan_f") >= g("out_n") > 0
        wsc = None if wq is None or wq.scale is None else pick(wq.scale)
        asc = None if aq is None or aq.scale is None else pick(aq.scale)
        azp = None if aq is None or aq.zero_point is None else pick(aq.zero_point)
        # the integer zero points the paths use (a fine-tuned one is fractional)
        wzp = None if wq is None or wq.zero_point is None else np.round(pick(wq.zero_point))
        out.append(OpReport(
            key=site.key, layer=None if li is None else (li[0] if len(li) == 1 else li),
            op=site.op, weight_shape=tuple(avals[w].shape) if w is not None else (),
            act_shape=tuple(avals[1 - w].shape) if w is not None else tuple(avals[0].shape),
            weight=(_short(wq) + (" +smooth" if qp.smooth is not None else "")
                    + (" +rotate" if qp.rotate else "")) if w is not None else "-",
            activation=_short(aq) if not qp.is_float else "float",
            weight_scale=None if wsc is None else (float(wsc.min()), float(wsc.max())),
            act_scale=None if asc is None else float(asc.reshape(-1)[0]),
            act_zero_point=None if azp is None else float(np.round(azp.reshape(-1)[0])) + 0.0,  # (not -0.0)
            act_range=(float(g("x_min")), float(g("x_max"))) if ran else (math.nan, math.nan),
            act_qrange=_qrange(aq, asc, azp),
            act_clip=float(g("x_clip") / g("x_n")) if ran else math.nan,
            weight_clip=float(g("w_clip") / g("w_n")) if ran and w is not None else math.nan,
            sqnr_isolated=_sqnr(float(g("f2_iso" if "f2_iso" in st else "f2")), float(g("e_iso")))
            if ran and not all_nan else math.nan,
            sqnr_cumulative=_sqnr(float(g("f2")), float(g("e_all"))) if ran and not all_nan else math.nan,
            note=qp.note if qp.is_float else (_TRIPS if trips else _BRANCH if branch else
                                              _HUGE if ran and not np.isfinite(float(g("f2"))) else
                                              _nan_note(g("nan_f"), g("out_n")) if ran and "nan_f" in st
                                              and g("nan_f") > 0 else
                                              "" if ran else "did not run on this batch"),
            quantized=not qp.is_float,
            accumulator=accumulator.WIDEST if qp.is_float else qp.accumulator,  # (none: no sums)
            acc_saturated=float(g("acc_sat") / g("acc_n")) if ran and "acc_n" in st else math.nan,
            weight_zero_point=None if wzp is None else (float(wzp.min()) + 0.0, float(wzp.max()) + 0.0),
            hist=g("hist") if ran else None))
    return out
