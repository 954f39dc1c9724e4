"""Calibrators: how the statistics of an activation become its real range.

A calibrator is a frozen (hashable) object; :class:`jqt.Rule` holds one for
the activations of the ops it matches (``calibrator=``) and one for their
weights (``weight_calibrator=``). Statistics are fixed-size pytrees, so
calibrating on any number of batches takes the same memory.

An activation calibrator implements, all jittable except ``range`` and ``check``
(which run on the host):

* ``observe(x) -> stats``: the statistics of one tensor (one op, one batch).
* ``combine(a, b) -> stats``: the statistics of the union of the data behind
  ``a`` and ``b``: associative and commutative, with ``empty`` as identity.
  jqt uses it across ``lax.scan`` / ``while_loop`` iterations, ``cond``
  branches and devices.
* ``empty(like) -> stats``: the statistics of no data (``like`` has the shapes of
  one tensor's statistics; under a ``lax.scan`` over stacked layers jqt repeats
  them per layer).
* ``accumulate(running, new) -> stats``: running statistics over successive
  calibration batches; ``combine`` by default.
* ``range(stats, qtype) -> (lo, hi)``: the real range to quantize, called
  once at the end (numpy); non-finite when no data was observed.
* ``check(qtype)`` (optional): raises ``ValueError`` if the calibrator cannot
  serve activations of ``qtype``; :class:`jqt.Rule` calls it when the rule is made.

Histogram calibrators share one streaming histogram: ``bins`` bins over
``[-R, R]`` with ``R`` a power of two, so two histograms merge exactly by
summing nested bins. A weight calibrator has
``range(w, axes, qtype) -> (lo, hi)``, reduced over ``axes`` (keepdims).
"""
from __future__ import annotations

import collections.abc
import dataclasses
from typing import Optional

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from . import compat
from . import numerics as nx
from .formats import FLOAT8, as_scalar

_F32 = jnp.float32


def _undefined(obj, base, sig):
    """The message of a method a calibrator subclass did not define."""
    return (f"{type(obj).__name__} subclasses jqt.calibrators.{base} without defining {sig}: "
            f"define it (jqt.calibrators.{base}'s docstring says what it returns).")


class Calibrator:
    """Base class of activation calibrators (see the module docstring).

    A user calibrator subclasses it as a frozen dataclass. This one keeps the
    mean absolute value and quantizes ``[-3 * mean, 3 * mean]``:

    >>> import dataclasses, jax.numpy as jnp, jqt
    >>> @dataclasses.dataclass(frozen=True)
    ... class MeanAbs(jqt.calibrators.Calibrator):
    ...     def observe(self, x):
    ...         return {"sum": jnp.sum(jnp.abs(x)), "n": jnp.float32(x.size)}
    ...     def combine(self, a, b):
    ...         return {"sum": a["sum"] + b["sum"], "n": a["n"] + b["n"]}
    ...     def empty(self, like):
    ...         return {"sum": jnp.float32(0), "n": jnp.float32(0)}
    ...     def range(self, stats, qtype):
    ...         m = float(stats["sum"] / stats["n"]) if stats["n"] else float("inf")
    ...         return -3 * m, 3 * m
    >>> f = lambda w, x: x @ w
    >>> r = jqt.recipes.w8a8(calibrator=MeanAbs())
    >>> qp = jqt.calibrate(f, r, jnp.eye(2), [(jnp.array([[1.0, -1.0]]),)], progress=False)
    >>> round(float(qp["w"].lhs.scale) * 255, 4)  # the range [-3, 3] in 255 steps
    6.0
    """

    def observe(self, x):
        """The statistics of one tensor ``x`` (float32): a pytree of fixed shape, the same
        whatever ``x``'s shape and rank (jqt calls it on a 1-D vector to learn that rank, and
        reads more leading axes as layers of a ``lax.scan``): reduce over every axis of
        ``x``, without ``keepdims``."""
        raise NotImplementedError(_undefined(self, "Calibrator", "observe(self, x)"))

    def combine(self, a, b):
        """The statistics of the union of the data behind ``a`` and ``b``."""
        raise NotImplementedError(_undefined(self, "Calibrator", "combine(self, a, b)"))

    def empty(self, like):
        """The statistics of no data (the identity of :meth:`combine`)."""
        raise NotImplementedError(_undefined(self, "Calibrator", "empty(self, like)"))

    def accumulate(self, running, new):
        """Running statistics after one more calibration batch (default: :meth:`combine`)."""
        return self.combine(running, new)

    def range(self, stats, qtype):
        """The real range ``(lo, hi)`` to quantize; non-finite when no data was seen."""
        raise NotImplementedError(_undefined(self, "Calibrator", "range(self, stats, qtype)"))

    def check(self, qtype):
        """Raises ``ValueError`` if this calibrator cannot serve activations of ``qtype``
        (:class:`jqt.Rule` calls it when the rule is made); the default accepts any."""


def _plain(c, *names):
    """Sets the numeric fields ``names`` of the calibrator ``c`` to the Python ints and
    floats they hold: a 0-d JAX array (a sweep over ``jnp.arange``, as the presets and
    :class:`jqt.QuantType` take) and a NumPy scalar (its repr ``np.float64(...)``)."""
    for name in names:
        v = as_scalar(getattr(c, name))
        if not isinstance(v, (bool, np.bool_)):
            v = int(v) if isinstance(v, np.integer) else float(v) if isinstance(v, np.floating) else v
        object.__setattr__(c, name, v)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _minmax(x):
    lo, hi = nx.extremes(x)
    return {"min": lo.astype(_F32), "max": hi.astype(_F32)}


def _combine_minmax(a, b):
    return {"min": jnp.minimum(a["min"], b["min"]), "max": jnp.maximum(a["max"], b["max"])}


def _empty_minmax():
    return {"min": jnp.array(jnp.inf, _F32), "max": jnp.array(-jnp.inf, _F32)}


@dataclasses.dataclass(frozen=True)
class MinMax(Calibrator):
    """The observed minimum and maximum over all batches (the default).

    >>> import jax.numpy as jnp, jqt
    >>> c = jqt.calibrators.MinMax()
    >>> s = c.accumulate(c.observe(jnp.array([-1.0, 2.0])), c.observe(jnp.array([5.0])))
    >>> c.range(s, jqt.QuantType())
    (-1.0, 5.0)
    """

    def observe(self, x):
        return _minmax(x)

    def combine(self, a, b):
        return _combine_minmax(a, b)

    def empty(self, like):
        return _empty_minmax()

    def range(self, stats, qtype):
        return float(stats["min"]), float(stats["max"])


@dataclasses.dataclass(frozen=True)
class MovingAverage(Calibrator):
    """Moving average of each batch's minimum and maximum.

    Attributes:
      momentum: ``None`` (default) weighs every batch equally (the mean of the
        per-batch extremes); a float ``m`` gives the exponential moving
        average ``m * running + (1 - m) * batch``.

    Within one batch (``scan``/``while`` iterations, devices) the extremes are
    combined by min/max; batches in which the op did not run are skipped, and so are
    batches in which it saw only zeros, the first one too (an expert no token was routed
    to in that batch, whose range of ``[0, 0]`` halved its average over two batches), as ``jqt.calibrate``
    treats an expert or layer that saw only zeros in every batch as one not reached.

    >>> import jax.numpy as jnp, jqt
    >>> c = jqt.calibrators.MovingAverage()
    >>> s = c.accumulate(c.observe(jnp.array([0.0, 2.0])), c.observe(jnp.array([0.0, 4.0])))
    >>> c.range(s, jqt.QuantType())
    (0.0, 3.0)
    >>> c.range(c.accumulate(s, c.observe(jnp.zeros(2))), jqt.QuantType())  # skipped
    (0.0, 3.0)
    """

    momentum: Optional[float] = None

    def __post_init__(self):
        _plain(self, "momentum")
        if self.momentum is not None and not (_is_real(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"MovingAverage(momentum={self.momentum!r}): expected None or a "
                             "float in [0, 1), e.g. 0.9.")

    def observe(self, x):
        mm = _minmax(x)  # (n = 0: only zeros, or no values; the first batch too, which
        # jqt.calibrate takes as the running statistics without an accumulate)
        seen = ~(mm["min"] > mm["max"]) & ((mm["min"] != 0) | (mm["max"] != 0))  # (NaN: seen,
        # and refused by jqt.calibrate)
        return {**mm, "n": seen.astype(_F32)}

    def combine(self, a, b):
        return {**_combine_minmax(a, b), "n": jnp.maximum(a["n"], b["n"])}

    def empty(self, like):
        return {**_empty_minmax(), "n": jnp.array(0.0, _F32)}

    def accumulate(self, running, new):
        n = running["n"]
        if self.momentum is None:
            w_new = 1.0 / (n + 1.0)
        else:
            w_new = jnp.where(n > 0, 1.0 - self.momentum, 1.0)
        # a batch of only zeros counts as none (observe: n = 0), but gives the range where
        # none came before (it is replaced by the first batch of values; every batch
        # zeros: [0, 0])
        seen = new["n"] > 0
        none = _combine_minmax(running, new)  # (no values yet: [0, 0] once zeros came)
        out = {k: jnp.where(seen, jnp.where(n > 0, (1 - w_new) * running[k] + w_new * new[k],
                                            new[k]), jnp.where(n > 0, running[k], none[k]))
               for k in ("min", "max")}
        return {**out, "n": n + seen}

    def range(self, stats, qtype):
        return float(stats["min"]), float(stats["max"])


# --- the streaming histogram --------------------------------------------------------------

_EMPTY_EXP = -126


def _rebin(hist, d):
    """Counts over ``[-r, r]`` -> counts over ``[-r * 2**d, r * 2**d]`` (same bin count).
    The bins nest exactly: new index = B/2 + floor((i - B/2) / 2**d)."""
    b = hist.shape[-1]
    i = jnp.arange(b, dtype=jnp.int32) - b // 2
    j = b // 2 + jnp.right_shift(i, jnp.minimum(d, 30).astype(jnp.int32))
    return jnp.zeros_like(hist).at[j].add(hist)


class _Histogram(Calibrator):
    """Streaming histogram statistics, shared by the histogram calibrators
    (dataclasses with a ``bins`` field)."""

    bins: int

    def __post_init__(self):
        # (jqt's own fields: a subclass's may be set after this, init=False)
        _plain(self, *(n for n in ("bins", "percentile", "candidates", "min_ratio", "stride")
                       if hasattr(self, n)))
        if not _is_int(self.bins) or self.bins < 64 or self.bins % 2:
            raise ValueError(f"{type(self).__name__}(bins={self.bins!r}): expected an even int "
                             ">= 64, e.g. 2048.")

    def observe(self, x):
        x = x.astype(_F32).reshape(-1)
        amax = jnp.max(jnp.abs(x))
        _, e = jnp.frexp(amax)  # amax < 2**e
        # an all-zero batch (silence, padding) at the smallest radius, not frexp(0)'s 2**0:
        # its zeros fall in the middle bin at any radius, and merging takes the largest
        e = jnp.where(amax > 0, jnp.maximum(e, _EMPTY_EXP + 1), _EMPTY_EXP + 1).astype(jnp.int32)
        # bin = B/2 + floor(x * B / (2 R)); the scaling by 2**-e is exact and x 2**-e * (B/2)
        # is rounded once, as x * (B/2) would be at any radius, so a value falls in nested
        # bins at every radius (what makes merging exact). Scaled first: x * (B/2) alone
        # overflows float32 for |x| above 3.4e38 / (B/2).
        half = self.bins // 2
        idx = jnp.floor(jnp.ldexp(x, -e) * jnp.float32(half)).astype(jnp.int32) + half
        # a negative value more than 2**126 below the radius scales to a subnormal, which
        # XLA flushes to -0 (floor 0, the bin above zero): its bin is the one below zero
        idx = jnp.where(x < 0, jnp.minimum(idx, half - 1), idx)
        # (rows split over explicit mesh axes: the counts summed over them, as a histogram
        # of the whole tensor; JAX asks for the result's sharding there)
        # counted in int32: float32 counts stop growing at 2**24 (x + 1 == x there)
        hist = jnp.zeros((self.bins,), jnp.int32).at[jnp.clip(idx, 0, self.bins - 1)].add(
            1, out_sharding=compat.replicated_if_split(idx)).astype(_F32)
        # exact zeros (ReLU outputs, padding), all in the bin above zero (``B/2``): every
        # grid holds 0 exactly, so a range's error on them is 0 (what :class:`MSE` needs)
        zeros = jnp.sum(x == 0, dtype=jnp.int32).astype(_F32)
        return {**_minmax(x), "hist": hist, "exp": e, "zeros": zeros}

    def combine(self, a, b):
        e = jnp.maximum(a["exp"], b["exp"])
        hist = _rebin(a["hist"], e - a["exp"]) + _rebin(b["hist"], e - b["exp"])
        zeros = {"zeros": a["zeros"] + b["zeros"]} if "zeros" in a and "zeros" in b else {}
        return {**_combine_minmax(a, b), "hist": hist, "exp": e, **zeros}

    def empty(self, like):
        # (the count only where observe keeps it: a subclass's observe may not)
        kept = not isinstance(like, collections.abc.Mapping) or "zeros" in like
        zeros = {"zeros": jnp.array(0.0, _F32)} if kept else {}
        return {**_empty_minmax(), "hist": jnp.zeros((self.bins,), _F32),
                "exp": jnp.array(_EMPTY_EXP, jnp.int32), **zeros}

    # numpy helpers for ``range``
    @staticmethod
    def _np(stats):
        hist = np.asarray(stats["hist"], np.float64)
        radius = float(np.ldexp(1.0, int(stats["exp"])))
        return hist, radius, float(stats["min"]), float(stats["max"])

    def _counts(self, stats, hist):
        """The counts ``_choose`` reads (:class:`MSE` leaves the exact zeros out)."""
        return hist

    def range(self, stats, qtype):
        hist, radius, lo, hi = self._np(stats)
        if hist.sum() == 0:
            return float("inf"), float("-inf")
        return self._choose(self._counts(stats, hist), radius, lo, hi, qtype)

    def _choose(self, hist, radius, lo, hi, qtype):
        raise NotImplementedError


def _fold(hist):
    """Counts over [-R, R] -> counts of |x| over [0, R] (half as many bins)."""
    h = hist.shape[0] // 2
    return hist[h:] + hist[:h][::-1]


def _quantile_edge(counts, q, width, start=0.0):
    """Upper edge of the bin where the cumulative fraction first reaches ``q``."""
    c = np.cumsum(counts) / counts.sum()
    i = int(np.searchsorted(c, q - 1e-12))
    return start + (min(i, len(counts) - 1) + 1) * width


@dataclasses.dataclass(frozen=True)
class Percentile(_Histogram):
    """Clips to a percentile of the observed values (e.g. 99.99).

    Symmetric types clip ``|x|`` at the percentile; asymmetric ones clip the
    lower tail at ``100 - percentile`` and the upper at ``percentile``. The
    range never exceeds the observed minimum and maximum.

    >>> import jax.numpy as jnp, jqt
    >>> c = jqt.calibrators.Percentile(99.0)
    >>> x = jnp.concatenate([jnp.linspace(0, 1, 1000), jnp.array([100.0])])
    >>> lo, hi = c.range(c.observe(x), jqt.QuantType(symmetric=False))
    >>> lo, round(hi, 1)
    (0.0, 1.0)
    """

    percentile: float = 99.99
    bins: int = 2048

    def __post_init__(self):
        super().__post_init__()
        if not (_is_real(self.percentile) and 50.0 < self.percentile <= 100.0):
            raise ValueError(f"Percentile({self.percentile!r}): expected a percentile in "
                             "(50, 100], e.g. 99.99.")

    def _choose(self, hist, radius, lo, hi, qtype):
        q = self.percentile / 100.0
        width = 2 * radius / len(hist)
        if qtype.symmetric:
            t = _quantile_edge(_fold(hist), q, width)
            return max(lo, -t), min(hi, t)
        top = _quantile_edge(hist, q, width, -radius)
        bottom = -_quantile_edge(hist[::-1], q, width, -radius)
        return max(lo, bottom), min(hi, top)


def _centers(n, width, start):
    return start + (np.arange(n) + 0.5) * width


def _float_step(x, qtype):
    """The fp8 grid's step at ``x`` (in units of the scale): ``2**(e - mantissa bits)`` for
    ``x`` in the binade ``[2**e, 2**(e+1))``, the subnormal step below the smallest normal.

    >>> import jqt
    >>> _float_step(np.array([1.0, 3.0, 300.0, 1e-4]), jqt.QuantType(dtype="float8_e4m3fn")).tolist()
    [0.125, 0.25, 32.0, 0.001953125]
    """
    fi = ml_dtypes.finfo(FLOAT8[qtype.dtype])
    e = np.floor(np.log2(np.maximum(np.abs(x), float(fi.smallest_normal))))
    return np.exp2(e - fi.nmant)


def _expected_sq_error(centers, counts, lo, hi, qtype):
    """Expected squared quantization error of data with this histogram for the range
    [lo, hi] (vectorized over candidate ranges: ``lo``/``hi`` of shape (C,)). Where the
    grid's step at a bin is wider than the bin, the bin's values round together: its
    error is its centre's own, rounded on the grid (clipped outside the range), plus the
    spread within the bin, ``width**2 / 12``; a bin wider than the step (fp8 near zero)
    holds many steps, and its error is the rounding noise ``step**2 / 12`` inside the
    range, the distance to its edge outside. The step is the grid's at the value: one
    scale for integers; for fp8, which is finer near zero, the step of the value's binade.
    (Until 2026-12-07 every bin inside the range cost ``step**2 / 12``, which overstated
    the error of values much smaller than a step, which round to 0: on softmax outputs
    at 4 bits it chose a range whose true error was 1.4x MinMax's.)"""
    s, z = (np.asarray(a, np.float64) if a is not None else None
            for a in nx.params_from_range(lo, hi, qtype))
    z = np.zeros_like(s) if z is None else z
    lo_r = ((qtype.qmin - z) * s)[:, None]
    hi_r = ((qtype.qmax - z) * s)[:, None]
    width = float(centers[1] - centers[0]) if len(centers) > 1 else 0.0
    held = np.asarray(counts) != 0  # (empty bins cost nothing: most of a histogram's)
    centers, counts = np.asarray(centers)[held], np.asarray(counts)[held]
    c = centers[None, :]
    clip = np.where(c < lo_r, (c - lo_r) ** 2, np.where(c > hi_r, (c - hi_r) ** 2, 0.0))
    inside = (c >= lo_r) & (c <= hi_r)
    step = s[:, None] * (_float_step(c / s[:, None], qtype) if qtype.kind == "float" else 1.0)
    noise = clip + inside * (step ** 2 / 12.0)
    u = np.clip(c / s[:, None] + z[:, None], qtype.qmin, qtype.qmax)
    if qtype.kind == "float":
        grid = u.astype(FLOAT8[qtype.dtype]).astype(np.float64)
    else:
        grid = np.round(u)
    exact = (c - (grid - z[:, None]) * s[:, None]) ** 2 + width ** 2 / 12.0
    err = np.where(step > width, exact, noise)
    return (err * counts[None, :]).sum(axis=1)


@dataclasses.dataclass(frozen=True)
class MSE(_Histogram):
    """The clipping range that minimizes the expected squared quantization error.

    Candidate ranges shrink the observed ``[min, max]`` (``|x|`` max for
    symmetric types) by factors from 1 down to ``min_ratio``; the expected
    error of each is computed from the histogram (rounding noise inside the
    range, clipping error outside).

    >>> import jax.numpy as jnp, numpy as np, jqt
    >>> x = jnp.asarray(np.random.default_rng(0).standard_normal(100_000), jnp.float32)
    >>> lo, hi = jqt.calibrators.MSE().range(jqt.calibrators.MSE().observe(x), jqt.QuantType(bits=4))
    >>> bool(hi < 0.7 * float(x.max()))
    True
    """

    candidates: int = 100
    min_ratio: float = 0.05
    bins: int = 2048

    def __post_init__(self):
        super().__post_init__()
        _check_search(self, 0.05)

    def _counts(self, stats, hist):
        """``hist`` without the exact zeros (in bin ``B/2``): they cost no error at any range
        (counted as rounding noise, a mostly-zero activation after a ReLU was clipped far
        below MinMax's error); a subclass's statistics without the count remove none."""
        out = hist.copy()
        out[len(out) // 2] = max(out[len(out) // 2] - float(stats.get("zeros", 0.0)), 0.0)
        return out

    def _choose(self, hist, radius, lo, hi, qtype):
        width = 2 * radius / len(hist)
        ratios = np.linspace(1.0, self.min_ratio, self.candidates)
        centers = _centers(len(hist), width, -radius)
        if qtype.symmetric:
            amax = max(-lo, hi)
            errs = _expected_sq_error(centers, hist, -amax * ratios, amax * ratios, qtype)
        else:
            errs = _expected_sq_error(centers, hist, min(lo, 0.0) * ratios, max(hi, 0.0) * ratios, qtype)
        r = float(ratios[int(np.argmin(errs))])
        if qtype.symmetric:
            return -amax * r, amax * r
        return min(lo, 0.0) * r, max(hi, 0.0) * r


def _check_search(c, min_ratio):
    """The fields of a clipping search (:class:`MSE`, :class:`WeightMSE`): ``candidates``
    factors from 1 down to ``min_ratio`` (its default given)."""
    name = type(c).__name__
    if not _is_int(c.candidates) or c.candidates < 1:
        raise ValueError(f"{name}(candidates={c.candidates!r}): expected a positive int (the "
                         "clipping factors tried), e.g. 100.")
    if not _is_real(c.min_ratio) or not 0 < c.min_ratio <= 1:
        raise ValueError(f"{name}(min_ratio={c.min_ratio!r}): expected a float in (0, 1] (the "
                         f"smallest fraction of the range tried), e.g. {min_ratio}.")


def _int_groups(i, levels):
    """The level of each of ``i`` bins of ``|x|`` on an integer grid whose end is bin
    ``i``'s upper edge: bin 0 alone, bins 1..i-1 split in ``levels - 1`` runs."""
    edges = np.linspace(1, i, levels).astype(int)
    return np.concatenate([[0], 1 + np.repeat(np.arange(levels - 1), np.diff(edges))])


def _float_groups(i, qtype):
    """The fp8 code each of ``i`` bins of ``|x|`` rounds to (numbered from 0) when the
    grid's largest value sits at bin ``i``'s upper edge: many bins share a code near the
    top, fewer near zero, where the grid is finer."""
    codes = ((np.arange(i) + 0.5) * (qtype.qmax / i)).astype(FLOAT8[qtype.dtype])
    return np.unique(codes.astype(np.float32), return_inverse=True)[1].reshape(-1)


def _kl_threshold(hist, levels, stride, groups=_int_groups, start=None):
    """TensorRT's entropy calibration on a histogram of |x|: the bin count ``i`` whose
    clipped distribution P (outliers folded into bin i-1) is closest in KL divergence
    to its quantization Q, bins sharing a level as ``groups(i, levels)`` says (the
    integer grid's ``levels`` levels by default).

    Two departures, both because jqt's ranges represent 0 exactly: the first bin
    (values near 0, such as the zeros after a ReLU) is a level of its own in Q
    rather than sharing one with its neighbours (which would charge every wider
    threshold for smearing it), and "clip nothing" (``i = n``) is always a
    candidate, whatever the stride. ``start`` (``levels`` by default) is the first
    threshold tried: further up where no data lie near 0, since a threshold just above
    the data's smallest |x| folds them all into a spike that Q matches exactly (a
    divergence of 0 for a clip of everything)."""
    n = len(hist)
    best, best_i = np.inf, n
    for i in [*range(levels if start is None else start, n, stride), n]:
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()
        nz = p > 0
        # Q: each level's mass spread over its nonzero bins.
        group = groups(i, levels)
        mass = np.bincount(group, weights=hist[:i], minlength=levels)
        cnt = np.bincount(group, weights=nz, minlength=levels)
        q = np.where(nz, mass[group] / np.maximum(cnt[group], 1), 0.0)
        p, q = p / p.sum(), q / max(q.sum(), 1e-30)
        m = p > 0
        kl = float(np.sum(p[m] * np.log(p[m] / np.maximum(q[m], 1e-12))))
        if kl < best:
            best, best_i = kl, i
    return best_i


@dataclasses.dataclass(frozen=True)
class Entropy(_Histogram):
    """KL-divergence (entropy) calibration, as in TensorRT and TVM (with the zero
    bin as its own level, see ``_kl_threshold``).

    Chooses the threshold ``T`` on ``|x|`` whose clipped and quantized
    distribution is closest to the observed one; the range is
    ``[max(min, -T), min(max, T)]``. One-sided data (e.g. after a ReLU) with an
    asymmetric type uses all ``2**bits`` levels, otherwise ``2**(bits-1)``.
    ``stride`` tries every ``stride``-th threshold (``None``: at most about
    500 candidates). The search needs at least ``levels`` bins below the
    threshold, hence the finer default histogram (8192 bins).

    >>> import jax.numpy as jnp, numpy as np, jqt
    >>> x = np.abs(np.random.default_rng(0).standard_normal(100_000)).astype(np.float32)
    >>> x[:10] = 50.0  # a few outliers
    >>> c = jqt.calibrators.Entropy()
    >>> lo, hi = c.range(c.observe(jnp.asarray(x)), jqt.QuantType(symmetric=False))
    >>> bool(1.0 < hi < 10.0)  # the outliers at 50 are clipped
    True
    """

    stride: Optional[int] = None
    bins: int = 8192

    def __post_init__(self):
        super().__post_init__()
        if self.stride is not None and (not _is_int(self.stride) or self.stride < 1):
            raise ValueError(f"Entropy(stride={self.stride!r}): expected None (at most about 500 "
                             "thresholds tried) or a positive int.")

    def check(self, qtype):
        """Refuses a histogram too coarse to clip ``qtype``: the data fill at least the
        upper half of the ``bins / 2`` bins of ``|x|`` (the histogram's radius is the
        power of two above their maximum), and a threshold needs more bins below it than
        the type has levels, so ``bins`` must exceed four times the levels (``2**bits``
        for asymmetric types, whose one-sided data use them all).

        >>> import jqt
        >>> jqt.calibrators.Entropy(bins=256).check(jqt.QuantType())
        Traceback (most recent call last):
        ...
        ValueError: Entropy(bins=256) for int8 sym per-tensor activations: ...
        """
        levels = 2 ** qtype.bits if not qtype.symmetric else 2 ** (qtype.bits - 1)
        if self.bins <= 4 * levels:
            raise ValueError(
                f"Entropy(bins={self.bins}) for {qtype.describe()} activations: a threshold "
                f"needs more bins of |x| below it than the type's {levels} levels, and the data "
                f"may fill as few as {self.bins // 4} of these {self.bins} bins, where the search "
                f"would keep the whole range, as MinMax does; give bins > {4 * levels} "
                f"({8 * levels} or more clips finer), or another calibrator.")

    def _choose(self, hist, radius, lo, hi, qtype):
        self.check(qtype)
        folded = _fold(hist)
        width = radius / len(folded)
        last = int(np.nonzero(folded)[0][-1]) + 1
        one_sided = (lo >= 0 or hi <= 0) and not qtype.symmetric
        levels = 2 ** qtype.bits if one_sided else 2 ** (qtype.bits - 1)
        if last <= levels:  # all the data lie within the first levels bins: nothing to clip
            return lo, hi
        stride = self.stride or max(1, (last - levels) // 500)
        # a threshold has levels bins of data below it at least (|x| far from 0: past the
        # bin holding the smallest 0.1% of |x|, not one stray small value), or it clips
        # nearly everything to one value; on the grid levels + k * stride all the same
        first = int(np.searchsorted(np.cumsum(folded), 1e-3 * folded.sum()))
        start = levels + -(-first // stride) * stride
        groups = (lambda i, _: _float_groups(i, qtype)) if qtype.kind == "float" else _int_groups
        t = _kl_threshold(folded[:last], levels, stride, groups, start) * width
        return max(lo, -t), min(hi, t)


# --- weights ------------------------------------------------------------------------------

class WeightCalibrator:
    """Base class of weight calibrators: ``range(w, axes, qtype) -> (lo, hi)``, jittable,
    reduced over ``axes`` with ``keepdims`` (``axes=None``: per tensor).

    A user weight calibrator that clips at 3 standard deviations:

    >>> import dataclasses, jax.numpy as jnp, jqt
    >>> @dataclasses.dataclass(frozen=True)
    ... class ThreeSigma(jqt.calibrators.WeightCalibrator):
    ...     def range(self, w, axes, qtype):
    ...         s = 3 * jnp.std(w, axis=axes, keepdims=axes is not None)
    ...         return -s, s
    >>> r = jqt.recipes.w8(weight_calibrator=ThreeSigma())
    >>> qp = jqt.calibrate(lambda w, x: x @ w, r, jnp.eye(4), [(jnp.ones((1, 4)),)], progress=False)
    >>> qp["w"].rhs.scale.shape
    (1, 4)
    """

    def range(self, w, axes, qtype):
        """The real range ``(lo, hi)`` of ``w``, reduced over ``axes`` (keepdims)."""
        raise NotImplementedError(_undefined(self, "WeightCalibrator", "range(self, w, axes, qtype)"))


@dataclasses.dataclass(frozen=True)
class WeightMinMax(WeightCalibrator):
    """Per-channel (or per-tensor) minimum and maximum (the default); a symmetric type's
    scale then takes the larger magnitude of the two, the absolute maximum.

    >>> import jax.numpy as jnp, jqt
    >>> w = jnp.array([[1.0, -3.0], [2.0, 0.5]])
    >>> lo, hi = jqt.calibrators.WeightMinMax().range(w, (0,), jqt.QuantType(per_channel=True))
    >>> lo.tolist(), hi.tolist()
    ([[1.0, -3.0]], [[2.0, 0.5]])
    """

    def range(self, w, axes, qtype):
        keep = axes is not None
        return nx.extremes(w, axis=axes, keepdims=keep)


@dataclasses.dataclass(frozen=True)
class WeightMSE(WeightCalibrator):
    """Per-channel clipping that minimizes the squared quantization error of the
    weight itself: the observed range shrunk by each of ``candidates`` factors
    from 1 to ``min_ratio``, the best kept per channel (exact, on the weight).

    >>> import jax.numpy as jnp, numpy as np, jqt
    >>> w = jnp.asarray(np.random.default_rng(0).standard_normal((256, 4)), jnp.float32)
    >>> q4 = jqt.QuantType(bits=4, per_channel=True)
    >>> lo, hi = jqt.calibrators.WeightMSE().range(w, (0,), q4)
    >>> bool((hi < jnp.abs(w).max(axis=0)).all())
    True
    """

    candidates: int = 100
    min_ratio: float = 0.3

    def __post_init__(self):
        _plain(self, "candidates", "min_ratio")
        _check_search(self, 0.3)

    def range(self, w, axes, qtype):
        lo0, hi0 = WeightMinMax().range(w, axes, qtype)
        w = w.astype(_F32)
        # errors in units of a power of two near each channel's range (exact scaling): the
        # same choice at any magnitude, where float32 sums of squares would overflow (a
        # weight of 1e20) or vanish (1e-20)
        _, e = jnp.frexp(jnp.maximum(jnp.abs(lo0), jnp.abs(hi0)))
        # 2 ** -e as two powers of two, each a normal float32 (e runs -148..128), made once
        # per channel: multiplying by them is exact, as jnp.ldexp(d, -e) is, up to products
        # below float32's normal range, whose squares are 0 either way; ldexp on every
        # element of every candidate was most of a 4-bit calibration's time
        h = -e // 2
        # (ones_like: e's sharding, where its channels are split over an explicit mesh axis)
        f1 = jnp.ldexp(jnp.ones_like(e, dtype=_F32), h)
        f2 = jnp.ldexp(jnp.ones_like(e, dtype=_F32), -e - h)

        def err(r):
            s, z = nx.params_from_range(lo0 * r, hi0 * r, qtype)
            d = nx.fake_quant(w, s, z, qtype) - w  # on the format's own grid (int, fp8, nf4)
            return jnp.sum(((d * f1) * f2) ** 2, axis=axes, keepdims=axes is not None)

        ratios = jnp.linspace(1.0, self.min_ratio, self.candidates, dtype=_F32)  # under x64 too

        def body(i, carry):
            best_e, best_r = carry
            e = err(ratios[i])
            better = e < best_e
            return jnp.where(better, e, best_e), jnp.where(better, ratios[i], best_r)

        e0 = err(jnp.float32(1.0))
        _, r = lax.fori_loop(1, self.candidates, body, (e0, jnp.ones_like(e0)))
        return lo0 * r, hi0 * r


__all__ = ["Calibrator", "MinMax", "MovingAverage", "Percentile", "MSE", "Entropy",
           "WeightCalibrator", "WeightMinMax", "WeightMSE"]
