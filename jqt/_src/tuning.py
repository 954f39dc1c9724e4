"""``jqt.sensitivity`` and ``jqt.fallback``: accuracy-driven choice of the ops to keep
float (or at a higher precision), measured with the user's own metric.

A *metric* is a function ``metric(g) -> float`` that scores a function ``g``
with the signature of ``f`` (for example the accuracy of ``g(params, x_test)``);
jqt passes it jitted, quantized variants of ``f``. Each call is a *trial*.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import diagnostics
from .calibrators import WeightMinMax
from .calibrate import calibrate, check_batch, check_batches, each_batch, empty_set
from .plotting import pad, width
from .qparams import OpQParams
from .handlers import QParamsMismatchError
from .quantize import quantize
from .recipe import Recipe, Rule, symmetric_convs
from .report import NanEqual, report
from . import tracing, validate
from .tracing import normalize_argnums
from .validate import check_qparams


def _as_float(p: OpQParams, note: str) -> OpQParams:
    return dataclasses.replace(p, lhs=None, rhs=None, note=note, smooth=None, rotate=False,
                               accumulator=32)


def _same_qparams(a: OpQParams, b: OpQParams) -> bool:
    """Whether ``a`` and ``b`` quantize an op alike: the same static fields (types, note,
    transforms) and the same arrays (scales, zero points, smoothing vector)."""
    (la, ta), (lb, tb) = (jax.tree_util.tree_flatten(p) for p in (a, b))
    return ta == tb and all(np.shape(x) == np.shape(y) and np.array_equal(np.asarray(x), np.asarray(y))
                            for x, y in zip(la, lb))


def _quantized_keys(qparams):
    return [k for k, p in qparams.items() if not p.is_float]


def _weight_groups(keys, qparams) -> dict:
    """``keys`` (op keys) grouped by the weight leaf they read, each group under its
    first key, in order: ops that read one weight leaf (a layer applied in a Python loop,
    ``w`` and ``w.T``, the slices ``w[i]`` of a stacked leaf) form one group.
    :func:`jqt.pack` keeps a leaf that an op kept float reads float whole, and holds both
    formats' codes where its ops differ in type, so :func:`jqt.fallback` keeps such ops
    back together: keeping one back costs the bytes of keeping them all, which are more
    precise.

    >>> import jax.numpy as jnp, jqt
    >>> f = lambda p, x: (x @ p["w"]) @ p["w"] @ p["v"]
    >>> p = {"w": jnp.eye(4), "v": jnp.eye(4)}
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(jnp.ones((1, 4)),)], progress=False)
    >>> _weight_groups(list(qp), qp)
    {'w': ('w', 'w#1'), 'v': ('v',)}
    """
    groups = {}
    for k in keys:
        src = qparams[k].source
        gid = ("op", k) if src is None else (src.arg, src.path)
        groups.setdefault(gid, []).append(k)
    return {g[0]: tuple(g) for g in groups.values()}


def _check_metric(metric, fn):
    """Raises ``TypeError`` where ``metric`` cannot be called as ``metric(g)``."""
    how = ("pass a function metric(g) -> float that scores g, a function with f's signature, "
           "calling it with its own weights and data, e.g. metric = lambda g: "
           "float(jnp.mean(g(params, x).argmax(-1) == y)).")
    if not callable(metric):
        raise TypeError(f"{fn}: metric is a {type(metric).__name__}; {how}")
    try:
        inspect.signature(metric).bind(None)
    except ValueError:  # no signature to read (a builtin): its first call tells
        return
    except TypeError as e:
        raise TypeError(f"{fn}: metric cannot be called as metric(g) ({e}); {how}") from None


def _value(metric, g, fn, what, sign=None):
    """``metric(g)`` as a float; a ``TypeError`` or ``ValueError`` naming the metric where it
    is not one finite-or-infinite number. NaN is an error for ``f`` itself only: for a
    quantized variant it is that variant's score (quantization made a NaN: it fails any
    budget). So is an infinite score for ``f`` at the good end (``sign``: 1 where higher is
    better, -1 where lower is): every drop from it is infinite (an SQNR of g against f)."""
    try:
        v = metric(g)
    except Exception as e:  # in the user's metric or f: say what g was
        e.add_note(f"({fn} called metric(g) with g = {what}"
                   + ("; g runs f, so the metric calls g with f's float params, not packed "
                      "ones" if isinstance(e, TypeError) and "PackedParams" in str(e) else "")
                   + ".)")
        raise
    a = None if v is None or isinstance(v, (str, bytes)) else np.asarray(v)
    if a is not None and a.dtype == object and a.ndim == 0:  # a fractions.Fraction, a Decimal
        try:
            a = np.asarray(float(v))
        except (TypeError, ValueError):
            pass
    if a is None or a.size != 1 or jnp.issubdtype(a.dtype, jnp.complexfloating) or not (
            jnp.issubdtype(a.dtype, jnp.number) or a.dtype == bool):  # bfloat16 too
        got = (f"an array of shape {a.shape} and dtype {a.dtype}" if a is not None and a.ndim
               else repr(v)[:40])
        raise TypeError(f"{fn}: metric returned {got} for {what}; it must "
                        "return one number, the score of g (e.g. an accuracy or a loss: reduce "
                        "an array with jnp.mean).")
    v = float(a.reshape(()))
    if math.isnan(v) and what == "f itself":
        raise ValueError(f"{fn}: the metric returned NaN for {what}; check the metric function "
                         "(it must return a float score).")
    if sign is not None and math.isinf(v) and v * sign > 0:
        raise ValueError(f"{fn}: the metric returned {v} for {what}, so every quantized variant "
                         "falls infinitely short of it and no drop can be measured (an SQNR or "
                         "a ratio of g's outputs to f's is infinite for f itself). Pass a metric "
                         "that is finite on f: an accuracy, a loss, or the error against labels "
                         "or f's outputs as a negated mean squared error (with "
                         "higher_is_better=True) or a mean squared error (False).")
    return v


class _Once:
    """The warnings of a tool's trials, each shown once: every trial traces ``f`` again
    (a new quantized function), and its analysis warned again (a model whose 6 layers each
    warn, under 13 trials: 78 warnings). ``seen``: the messages shown already; ``same``:
    the form in which two messages are compared (default: as they are); ``skip``: the
    messages not shown at all."""

    def __init__(self, seen=(), same=str, skip=lambda m: False):
        self.same, self.skip = same, skip
        self.seen = {same(m) for m in seen}

    @contextlib.contextmanager
    def __call__(self):
        failing = True
        try:
            with diagnostics.captured() as got:
                yield
            failing = False
        finally:  # (a trial that raised too: its warnings may say why)
            new = []
            for message, category in got:
                if not self.skip(str(message)) and self.same(str(message)) not in self.seen:
                    self.seen.add(self.same(str(message)))
                    new.append((message, category))
            diagnostics.warn_held(new, failing)


def _within(drop, max_drop, *scores) -> bool:
    """Whether ``drop`` meets the budget ``max_drop``, up to float rounding: a drop of
    exactly ``k / N`` on N examples computes a few ulps above ``k / N`` (``0.99 - 0.985``
    is ``0.0050000000000000044``), and a float32 budget reads slightly below its decimal.

    >>> _within(0.99 - 0.985, 0.005, 0.99, 0.985), _within(0.0051, 0.005)
    (True, False)
    """
    ulps = 4 * math.ulp(max([abs(x) for x in scores if math.isfinite(x)], default=0.0))
    return drop <= max_drop or math.isclose(drop, max_drop, rel_tol=1e-6, abs_tol=ulps)


def _score(f, qparams, metric, weight_argnums, simulate, fn, once, what="a quantized variant"):
    with once():
        g = tracing.jit_static(quantize(f, qparams, simulate=simulate, weight_argnums=weight_argnums))
        return _value(metric, g, fn, what)


def _variant(keys, how) -> str:
    """A variant described for an error in the metric: ``how`` the ops ``keys``."""
    keys = list(keys)
    shown = ", ".join(repr(k) for k in keys[:6]) + (" ..." if len(keys) > 6 else "")
    return f"a quantized variant, {how} [{shown}]" if keys else "a quantized variant, every op quantized"


@dataclasses.dataclass(frozen=True, eq=False)
class SensitivityRow(NanEqual):
    """One op's row of :class:`jqt.Sensitivity`.

    Attributes:
      key: the op key.
      alone: the metric with only this op quantized.
      all_but: the metric with every op quantized but this one.

    >>> import jqt
    >>> jqt.SensitivityRow(key="params/Dense_0/kernel", alone=0.95, all_but=0.98).alone
    0.95
    """

    key: str
    alone: float        # metric with only this op quantized
    all_but: float      # metric with every op quantized except this one


@dataclasses.dataclass(frozen=True, eq=False)
class Sensitivity(NanEqual):
    """What :func:`jqt.sensitivity` returns; ``rows`` are ranked, most harmful first.

    Attributes:
      rows: a :class:`jqt.SensitivityRow` per quantized op, most harmful first.
      float_metric: the metric of ``f`` itself.
      quantized_metric: the metric with every op quantized.
      higher_is_better: as passed (``False``: the metric is an error).

    >>> import jqt
    >>> s = jqt.Sensitivity(rows=(jqt.SensitivityRow("a", 0.9, 0.99),), float_metric=0.99,
    ...                     quantized_metric=0.9, higher_is_better=True)
    >>> print(s)  # doctest: +NORMALIZE_WHITESPACE
    metric: float 0.99, all quantized 0.9
    op                                quantized alone     drop  all but this     drop
    a                                             0.9     0.09          0.99        0
    """

    rows: tuple
    float_metric: float
    quantized_metric: float
    higher_is_better: bool

    def _drop(self, v):
        return (self.float_metric - v) if self.higher_is_better else (v - self.float_metric)

    def __str__(self):
        w = max([32] + [width(r.key) for r in self.rows])  # the key column fits the longest key
        lines = [f"metric: float {self.float_metric:z.4g}, all quantized {self.quantized_metric:z.4g}",
                 f"{'op':<{w}} {'quantized alone':>16} {'drop':>8} {'all but this':>13} {'drop':>8}"]
        for r in self.rows:
            lines.append(f"{pad(r.key, w)} {r.alone:>z16.4g} {self._drop(r.alone):>z8.3g} "
                         f"{r.all_but:>z13.4g} {self._drop(r.all_but):>z8.3g}")
        return "\n".join(lines)


def sensitivity(f, qparams, metric: Callable, *, weight_argnums=0, simulate=False,
                higher_is_better: bool = True) -> Sensitivity:
    """The effect on ``metric`` of quantizing each op alone, and of leaving each op
    float alone; 2 trials per quantized op, plus 2.

    ``qparams``: from :func:`jqt.calibrate` on ``f``; each quantized op is tried
    with them. ``metric(g) -> float`` scores a function ``g`` with ``f``'s signature (it
    calls ``g`` with its own weights and data); jqt passes ``f`` itself and
    jitted quantized variants. Rows are ranked by the drop when the op is
    quantized alone, largest first. ``weight_argnums`` is as in :func:`jqt.calibrate`;
    ``simulate=True`` runs the variants on the simulated path (as
    ``jqt.quantize(..., simulate=True)``), default the integer path;
    ``higher_is_better=False`` for a metric that is an error (a drop is then a rise).

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda p, x: jax.nn.relu(x @ p["a"]) @ p["b"]
    >>> p = {"a": jnp.eye(4), "b": jnp.ones((4, 2))}
    >>> x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(x,)], progress=False)
    >>> err = lambda g: float(jnp.abs(g(p, x) - f(p, x)).max())
    >>> s = jqt.sensitivity(f, qp, err, higher_is_better=False)
    >>> sorted(r.key for r in s.rows)
    ['a', 'b']
    """
    check_qparams(qparams, "jqt.sensitivity")
    validate.flags("jqt.sensitivity", simulate=simulate, higher_is_better=higher_is_better)
    keys = _quantized_keys(qparams)
    allf = {k: _as_float(p, "float for jqt.sensitivity") for k, p in qparams.items()}
    _check_metric(metric, "jqt.sensitivity")
    once = _Once()
    score = lambda qp, what="a quantized variant, every op quantized": _score(
        f, qp, metric, weight_argnums, simulate, "jqt.sensitivity", once, what)
    m_float = _value(metric, tracing.jit_static(f), "jqt.sensitivity", "f itself",
                     1.0 if higher_is_better else -1.0)
    try:
        m_q = score(qparams)
    except QParamsMismatchError as e:
        hint = "" if "no quantization parameters for ops" not in str(e) else (
            " (If these qparams are part of f's, a dict restricted to the ops "
            "to compare: pass every op's entry, the others made float, {k: p if k in compared "
            "else dataclasses.replace(p, lhs=None, rhs=None) for k, p in qparams.items()}.)")
        text = str(e).removeprefix("jqt: ").replace("pass jqt.quantize the weight_argnums",
                                                    "pass jqt.sensitivity the weight_argnums")
        raise QParamsMismatchError(f"jqt.sensitivity: {text}{hint}") from None
    rows = []
    for k in keys:
        alone = score({**allf, k: qparams[k]}, _variant([k], "only"))
        all_but = score({**qparams, k: allf[k]}, _variant([k], "every op but"))
        rows.append(SensitivityRow(k, alone, all_but))
    sign = 1 if higher_is_better else -1
    # most harmful first: a NaN with only the op quantized is the worst; a NaN with all
    # but the op quantized says keeping it float does not help: the least harmful
    nan_as = lambda v, inf: inf if math.isnan(v) else v
    rows.sort(key=lambda r: (nan_as(sign * r.alone, -math.inf), nan_as(-sign * r.all_but, math.inf)))
    return Sensitivity(tuple(rows), m_float, m_q, higher_is_better)


@dataclasses.dataclass(frozen=True, eq=False)
class FallbackResult(NanEqual):
    """What :func:`jqt.fallback` returns.

    Attributes:
      recipe: reproduces the choice: ``jqt.calibrate(f, result.recipe, ...)``
        gives ``result.qparams``.
      qparams: the chosen quantization parameters.
      kept: the op keys kept float (or given the fallback rule).
      met: whether the metric is within ``max_drop`` of float.
      float_metric, quantized_metric, metric: float, before the fallback, after.
      trials: ``(kept keys, metric)`` for every trial run, the first with every op
        quantized (none kept); with ``rank="sensitivity"`` the ranking trials follow it:
        an op quantized and every other float, as the choice it is (every other op
        kept) with ``to=None``, else as ``(("quantized alone: KEY",), metric)`` (the keys
        of the ops reading one weight, joined by ", "). A
        metric of NaN (quantization made a NaN) fails the budget.

    >>> import jqt
    >>> r = jqt.FallbackResult(recipe=jqt.recipes.w8a8(), qparams={}, kept=("b",), met=True,
    ...                        float_metric=0.98, quantized_metric=0.90, metric=0.978,
    ...                        trials=(((), 0.90), (("b",), 0.978)))
    >>> print(r)
    budget met: metric 0.978 (float 0.98, all quantized 0.9) with 1 op(s) kept at the fallback: ['b']; 2 trials
    """

    recipe: Recipe
    qparams: dict
    kept: tuple
    met: bool
    float_metric: float
    quantized_metric: float
    metric: float
    trials: tuple

    def __str__(self):
        state = "met" if self.met else "NOT met"
        return (f"budget {state}: metric {self.metric:z.4g} (float {self.float_metric:z.4g}, all "
                f"quantized {self.quantized_metric:z.4g}) with {len(self.kept)} op(s) kept at the "
                f"fallback: {list(self.kept)}; {len(self.trials)} trials")


def _rank_by_report(f, qparams, params, batch, weight_argnums):
    r = report(f, qparams, params, batch, weight_argnums=weight_argnums)
    worst = {}
    for row in r.rows:
        if row.weight != "float" and not math.isnan(row.sqnr_isolated):
            worst[row.key] = min(worst.get(row.key, math.inf), row.sqnr_isolated)
    keys = _quantized_keys(qparams)
    return sorted(keys, key=lambda k: worst.get(k, math.inf))


def _sensitivity_order(drop, k):
    """The sort key of op ``k`` for rank='sensitivity', ``drop`` its drop quantized alone
    where measured: a NaN drop (the op alone made a NaN) first, then the ops measured
    harmful (largest drop first), then the unmeasured ones (which may be), then those
    measured harmless (a drop of 0 or less: ranked ahead of the unmeasured, they would
    fill the prefix the search keeps)."""
    if k not in drop:
        return (2, 0.0)
    d = drop[k]
    if math.isnan(d):
        return (0, 0.0)
    return (1, -d) if d > 0 else (3, -d)


def _search(ranked, trial, ok, max_trials, trials, all_back_score, seen):
    """Binary search for the shortest prefix of ``ranked`` that meets the budget.
    Keeping every op back scores ``all_back_score`` without a trial when known (every
    op float is the float model). Returns ``(prefix, score, narrowed)``: the shortest
    meeting prefix found (all of ``ranked`` if the trials ran out first: ``narrowed``
    is then False, as where they ran out before every choice below was tried), or all
    of ``ranked`` with its score when even that fails and no
    other choice tried meets it (a fallback rule less precise than the recipe for some
    ops: more of them kept back can score worse, so the shorter prefixes, then all
    ops but one, are tried in turn while trials are left)."""
    n = len(ranked)
    if all_back_score is None:
        if len(trials) >= max_trials:
            return ((), trials[0][1], n == 0)
        v = trial(tuple(ranked))
        if not ok(v):
            tries = [tuple(ranked[:m]) for m in range(1, n)]  # the prefixes, then all but one
            tries += [tuple(c for c in ranked if c != k) for k in reversed(ranked)]
            for j, kept in enumerate(tries):
                if len(trials) >= max_trials:  # cut short: more trials would try the rest
                    return (tuple(ranked), v, all(frozenset(t) in seen for t in tries[j:]))
                w = trial(kept)
                if ok(w):
                    return (kept, w, True)
            return (tuple(ranked), v, True)
        all_back_score = v
    best = (tuple(ranked), all_back_score)
    lo, hi = 0, n  # prefix lo fails the budget, prefix hi meets it
    # (a choice measured already, as ranking with to=None measures "all but one", costs no
    # trial: it is looked at after max_trials too, where the float model was returned)
    while hi - lo > 1 and (len(trials) < max_trials or frozenset(ranked[:(lo + hi) // 2]) in seen):
        mid = (lo + hi) // 2
        v = trial(tuple(ranked[:mid]))
        if ok(v):
            hi, best = mid, (tuple(ranked[:mid]), v)
        else:
            lo = mid
    return (*best, hi - lo <= 1)


def _kept_back(rule, key, prims):
    """``to=``'s ``rule`` for the ops ``key`` keeps back (of primitives ``prims``): a
    table's or cache's type only where it keeps one back, and the default weight
    calibrator where it then types no weight or table (``Rule`` would warn of it)."""
    emb = rule.embedding if "gather" in prims else None
    calib = {} if emb is not None or rule.weight is not None else {"weight_calibrator": WeightMinMax()}
    return dataclasses.replace(rule, key=key, embedding=emb, **calib, kv_cache=rule.kv_cache
                               if prims & {"dynamic_update_slice", "scatter"} else None)


def fallback(f, recipe: Recipe, params, batches, metric: Callable, *, max_drop: float,
             to: Optional[Rule] = None, weight_argnums=0, higher_is_better: bool = True,
             max_trials: int = 12, rank: str = "report", simulate: bool = False,
             progress=None) -> FallbackResult:
    """Calibrates ``f`` with ``recipe`` and keeps a small set of ops float (or at the
    precision of ``to``) so that ``metric`` stays within ``max_drop`` of float.

    Args:
      f: the function to quantize, as in :func:`jqt.calibrate`.
      recipe: the recipe to start from, e.g. ``jqt.recipes.w8a8()``.
      params: the float weights, as in :func:`jqt.calibrate`.
      batches: calibration batches, as in :func:`jqt.calibrate` (a sequence).
      metric: ``metric(g) -> float`` scores a function ``g`` with ``f``'s
        signature (jitted, quantized); higher is better unless
        ``higher_is_better=False``.
      max_drop: the budget: the largest allowed ``metric(f) - metric(quantized)``
        (in the metric's units, e.g. 0.005 for half a point of accuracy). A drop within
        float rounding of it (one example in 200 computes as 0.0050000000000000044)
        meets it, as does a score equal to float's.
      to: the rule for the ops kept back (of every key: fallback picks the ops), e.g.
        ``jqt.recipes.w8a16().rules[0]`` for int16 activations; ``None``
        keeps them float.
      max_trials: the most metric evaluations of quantized variants.
      rank: the order in which ops are kept back: ``"report"`` (lowest SQNR
        in :func:`jqt.report` on the first batch first; no trials) or
        ``"sensitivity"`` (largest drop when quantized alone first; one trial
        per op, for the first ``max_trials - 2`` ops: a warning names the rest).
      weight_argnums: as in :func:`jqt.calibrate`.
      higher_is_better: ``False`` for a metric such as a loss or an error.
      simulate: score the simulated path instead of the integer one.
      progress: progress bars of the calibrations, as in :func:`jqt.calibrate`.

    The search keeps back the shortest prefix of the ranking that meets the
    budget (a binary search), then tries dropping each kept op again. A quantized
    variant the metric scores NaN fails the budget. When the budget cannot be met
    within ``max_trials``, the result has ``met=False``, the best choice found, and
    a warning says so; a warning also says when the trials ran out before the
    search narrowed the choice. The ops that read one weight leaf (a layer applied in a
    Python loop, ``w`` and ``w.T``, slices of a stacked leaf) are kept back together:
    :func:`jqt.pack` keeps a leaf that any op kept float reads as float, and holds the codes
    of both types where its ops differ, so keeping one back would cost the bytes of keeping
    them all.

    Returns:
      a :class:`jqt.FallbackResult` whose ``recipe`` reproduces the choice.

    Here ``b`` reads an outlier channel (``a`` scales it by 1000, ``b`` by 1e-3),
    so its static int8 activation range is useless; the metric is an error:

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda p, x: jax.nn.relu(x @ p["a"]) @ p["b"]
    >>> p = {"a": jnp.eye(4).at[0, 0].set(1000.), "b": jnp.ones((4, 2)).at[0].set(1e-3)}
    >>> x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    >>> err = lambda g: float(jnp.abs(g(p, x) - f(p, x)).max())
    >>> res = jqt.fallback(f, jqt.recipes.w8a8(), p, [(x,)], err, max_drop=0.01,
    ...                    higher_is_better=False)
    >>> res.met, res.kept
    (True, ('b',))
    """
    validate.flags("jqt.fallback", simulate=simulate, higher_is_better=higher_is_better)
    if rank not in ("report", "sensitivity"):
        raise ValueError(f"jqt.fallback: rank={rank!r}; expected 'report' or 'sensitivity'.")
    if isinstance(max_trials, bool) or not isinstance(max_trials, (int, np.integer)):
        raise TypeError(f"jqt.fallback: max_trials={max_trials!r} is not an int; pass the most "
                        "metric evaluations of quantized variants, e.g. max_trials=12.")
    if max_trials < 1:
        raise ValueError(f"jqt.fallback: max_trials={max_trials}; expected at least 1.")
    budget = np.asarray(max_drop) if not isinstance(max_drop, (bool, str, bytes)) else None
    if budget is None or budget.size != 1 or not jnp.issubdtype(budget.dtype, jnp.number) \
            or jnp.issubdtype(budget.dtype, jnp.complexfloating) \
            or not math.isfinite(float(budget.reshape(()))) or float(budget.reshape(())) < 0:
        raise ValueError(f"jqt.fallback: max_drop={max_drop!r}; expected a finite number >= 0, the "
                         "largest drop of the metric from float's allowed (in the metric's units, "
                         "e.g. 0.005 for half a point of accuracy).")
    max_drop = float(budget.reshape(()))  # (a NumPy or JAX number made result.met an array)
    if to is not None and not isinstance(to, Rule):
        hint = (" (a recipe: pass one of its rules, e.g. jqt.recipes.w8a16().rules[0])"
                if isinstance(to, Recipe) else "")
        raise TypeError(f"jqt.fallback: to= is a {type(to).__name__}{hint}; expected a jqt.Rule "
                        "for the ops kept back, or None to keep them float.")
    _check_metric(metric, "jqt.fallback")
    argnums = normalize_argnums(weight_argnums)
    validate.weight_args(params, argnums, "jqt.fallback")
    if not isinstance(recipe, Recipe):
        raise TypeError(f"jqt.fallback: recipe is a {type(recipe).__name__}; expected a "
                        "jqt.Recipe such as jqt.recipes.w8a8() (a rule for the ops kept back "
                        "goes to to=).")
    check_batches(batches, "jqt.fallback")
    # a list or tuple as it is; from a generator or a dataset (whose items may be one buffer
    # it refills), each batch copied as it comes
    given = batches
    batches = list(batches) if isinstance(batches, (list, tuple)) else [tracing.owned(b) for b in each_batch(batches)]
    if batches:  # each checked here, so that an error names jqt.fallback, not its calibrate
        tree = None
        for i, b in enumerate(batches):
            tree = check_batch(i, b, tree, "jqt.fallback")
    else:
        raise empty_set("jqt.fallback", given)
    once = _Once()  # calibrate's warnings, shown; the trials' copies of them are not
    with once():
        qp = calibrate(f, recipe, params, batches, weight_argnums=weight_argnums, progress=progress)
    calibrated = set(once.seen)  # the final calibration shows only what is new to these
    # the rules for the ops kept back: ``to`` (convs given its weight type made symmetric,
    # as the presets do), ahead of the recipe's, whose rules decide the ops ``to`` does not
    # take (its ``ops=``): each trial quantizes an op as the final recipe will
    to_rules = () if to is None else symmetric_convs(to)
    candidates = _quantized_keys(qp)
    if to is None:
        alt = {k: _as_float(p, "kept float by jqt.fallback") for k, p in qp.items()}
    elif not candidates:  # nothing is quantized: nothing to keep back, the budget is met
        alt = {}
    else:
        anywhere = tuple(dataclasses.replace(r, key=".*") for r in to_rules)
        matched = [k for k in candidates if any(r.matches(qp[k].op, k) for r in anywhere)]
        if not matched:
            raise ValueError(f"jqt.fallback: to= applies to none of the quantized ops (its ops={to.ops}; "
                             f"the ops: {sorted({qp[k].op for k in _quantized_keys(qp)})}). Give a rule for "
                             "those ops (a preset with symmetric=False has a rule for convolutions "
                             "first: take its last, recipe.rules[-1]), or None to keep them float.")
        with diagnostics.captured():  # calibrate warned already about unreached ops
            alt = calibrate(f, Recipe(rules=anywhere + recipe.rules), params, batches,
                            weight_argnums=weight_argnums, progress=progress)
        # an op to= matches but gives no type (an act x act op without act_x_act=, a cache
        # write without kv_cache=, a lookup without embedding=) would end up float, not at
        # to='s precision: not a candidate
        unmatched = [k for k in candidates if k not in matched]
        if unmatched:  # (they keep the recipe's types: fallback cannot keep them back)
            diagnostics.warn(
                f"jqt.fallback: to= (ops={to.ops}) takes none of the quantized ops "
                f"{unmatched[:5]}{' ...' if len(unmatched) > 5 else ''} (primitives "
                f"{sorted({qp[k].op for k in unmatched})}), so fallback cannot keep them back: they "
                "keep the recipe's types whatever the budget. Widen to='s ops=, or pass to=None "
                "to keep ops back as float.")
        candidates = [k for k in matched if not alt[k].is_float]
        untyped = [k for k in matched if alt[k].is_float]
        unchanged = [k for k in candidates if _same_qparams(alt[k], qp[k])]
        candidates = [k for k in candidates if k not in unchanged]
        if unchanged and candidates:  # (none left: the error below says so)
            diagnostics.warn(f"jqt.fallback: to= gives ops {unchanged[:5]}"
                             f"{' ...' if len(unchanged) > 5 else ''} the very types the recipe "
                             "gives them, so keeping them back changes nothing: they are not "
                             f"candidates (the candidates: {candidates[:5]}"
                             f"{' ...' if len(candidates) > 5 else ''}).")

        def why(keys):  # the notes under to='s rules speak of "the recipe": say what to= lacks
            field = lambda p: ("embedding" if p.op == "gather" else "weight" if p.weight_operand
                               is not None else "act_x_act" if p.op == "dot_general" else "kv_cache")
            lacks = list(dict.fromkeys(f"{field(alt[k])}=" for k in keys if getattr(to, field(alt[k])) is None))
            notes = list(dict.fromkeys(alt[k].note for k in keys if getattr(to, field(alt[k])) is not None))
            return "; ".join(([f"to= sets no {', '.join(lacks)}"] if lacks else []) + notes[:2])
        if untyped and candidates:  # (none left: the error below says the same)
            diagnostics.warn(f"jqt.fallback: to= matches ops {untyped[:5]}"
                             f"{' ...' if len(untyped) > 5 else ''} but gives them no type "
                             f"({why(untyped)}): they stay as the recipe quantizes them. "
                             "Give to= the type they need (weight=, embedding=, kv_cache=, "
                             "act_x_act=), or pass to=None to let fallback keep them float.")
        if not candidates and unchanged:
            raise ValueError(f"jqt.fallback: to= gives every quantized op it takes "
                             f"({unchanged[:5]}{' ...' if len(unchanged) > 5 else ''}) the very "
                             "types the recipe gives them, so keeping ops back at to= changes "
                             "nothing. Give to= a more precise type than the "
                             "recipe's (e.g. w8 for int4 ops), or pass to=None to keep ops float.")
        if not candidates:
            raise ValueError(f"jqt.fallback: to= gives none of the quantized ops a type (it "
                             f"matches {untyped[:5]}, and gives them none: {why(untyped)}); "
                             "give it the type they need, or pass to=None to keep them float.")
        left = [k for k in candidates if not re.search(to.key, k)]
        if left:  # its key would be replaced by each kept-back op's: it would be lost
            raise ValueError(f"jqt.fallback: to=Rule(key={to.key!r}, ...) leaves out ops it would "
                             f"type, {left[:5]}{' ...' if len(left) > 5 else ''}, but fallback chooses "
                             "the ops it keeps back among all of them and gives each to=, whatever "
                             "to='s key. Pass the rule without key= (dataclasses.replace(to, "
                             "key='.*')); to keep ops out of the search, keep them float with "
                             "jqt.Rule(key=..., weight=None) ahead of the recipe's rules.")
    # the candidates: groups of ops reading one weight, each under its first key
    # (hunt69_reuseloops: one use of a layer applied 4 times kept float packed to more
    # than the float bytes, the weight held as float and as codes)
    groups = _weight_groups(candidates, qp)
    candidates = list(groups)
    expand = lambda ks: tuple(j for k in ks for j in groups[k])
    sign = 1.0 if higher_is_better else -1.0
    m_float = _value(metric, tracing.jit_static(f), "jqt.fallback", "f itself", sign)
    score = lambda q, what: _score(f, q, metric, weight_argnums, simulate, "jqt.fallback", once, what)
    trials = []

    seen = {}

    def trial(kept):
        if frozenset(kept) in seen:  # the pruning pass may revisit a choice
            return seen[frozenset(kept)]
        try:
            v = score({**qp, **{k: alt[k] for k in expand(kept)}},
                      _variant(expand(kept), "keeping back"))
        except ValueError as e:  # an op kept back at to='s types that quantize refuses:
            # its advice ("keep it float (a recipe rule)") is about to=, not the recipe
            at = [k for k in expand(kept) if str(e).startswith(f"jqt.quantize: op '{k}':")]
            if to is None or not at:
                raise
            raise ValueError(f"jqt.fallback: op '{at[0]}' kept back at to='s types cannot be "
                             f"quantized: {e} Here that rule is fallback's to=: give to= types "
                             "this op can take (weight-only: activation=None), or pass to=None "
                             "to keep the ops it keeps back float.") from None
        trials.append((tuple(kept), v))
        seen[frozenset(kept)] = v
        return v

    # (a score equal to float's meets any budget: f's own inf at the bad end too, whose
    # inf - inf is NaN)
    ok = lambda v: v == m_float or _within(sign * (m_float - v), max_drop, m_float, v)
    m_q = trial(())
    drop = {}  # rank='sensitivity': each op's drop quantized alone
    ranked = candidates
    if ok(m_q):
        pass  # every op quantized meets the budget: nothing to rank, nothing kept back
    elif rank == "sensitivity":
        if len(ranked) > 1:  # (one op: nothing to order)
            allf = {k: _as_float(p, "") for k, p in qp.items()}
            for k in ranked[:max(0, max_trials - 2)]:
                if to is None:  # k alone quantized is every other candidate kept float: a
                    # choice of the search's too, so the search and pruning reuse this trial
                    v = trial(tuple(c for c in ranked if c != k))
                else:
                    v = score({**allf, **{j: qp[j] for j in groups[k]}}, _variant(groups[k], "only"))
                    trials.append(((f"quantized alone: {', '.join(groups[k])}",), v))
                drop[k] = sign * (m_float - v)
            if len(drop) < len(ranked):
                n = len(ranked)
                diagnostics.warn(
                    f"jqt.fallback(rank='sensitivity'): max_trials={max_trials} ranks only the first "
                    f"{len(drop)} of the {n} candidates (an op, or the ops reading one weight leaf; one "
                    "trial each, after the "
                    "all-quantized one); the others, unmeasured, rank after those measured to worsen "
                    "the metric and before those measured not to, and the search "
                    f"has {max(0, max_trials - 1 - len(drop))} trial(s) left. Pass max_trials="
                    f"{2 * n + n.bit_length() + (0 if to is None else 2)} or more (enough to rank, "
                    "search and prune), or rank='report' (which ranks every op in one jqt.report pass).")
            ranked = sorted(ranked, key=lambda k: _sensitivity_order(drop, k))
    else:
        try:
            with once():
                rep = {j: k for k, g in groups.items() for j in g}
                ranked = list(dict.fromkeys(
                    rep[k] for k in _rank_by_report(f, qp, params, batches[0], weight_argnums)
                    if k in rep))
        except NotImplementedError as e:  # (report's own advice, to compare the qparams
            # it was given with f, is not the user's to follow here: fallback made them)
            why = str(e).split(" Compare jqt.quantize(f, qparams")[0]
            raise NotImplementedError(f"jqt.fallback(rank='report') ranks the ops by jqt.report, which "
                                      f"cannot run this f: {why} Pass rank='sensitivity', which ranks "
                                      "them by trials instead.") from None
    best = ((), m_q)  # the best-scoring choice seen; the answer when the budget is met
    narrowed = True
    if not ok(m_q):
        *best, narrowed = _search(ranked, trial, ok, max_trials, trials,
                                  m_float if to is None else None, seen)
        best = tuple(best)
        if ok(best[1]):  # prune: an op of the prefix may not be needed
            # (an op whose drop quantized alone exceeds the budget is not tried again)
            needed = lambda j: math.isnan(drop.get(j, 0.0)) or not _within(drop.get(j, 0.0), max_drop)
            for k in reversed(best[0]):
                if len(best[0]) <= 1:
                    break
                if needed(k):
                    continue
                cand = tuple(c for c in best[0] if c != k)
                if len(trials) >= max_trials and frozenset(cand) not in seen:
                    # ops of the prefix untried alone: say so (and look on at those measured)
                    narrowed = narrowed and all(frozenset(c for c in best[0] if c != j) in seen
                                                or needed(j) for j in best[0])
                    continue
                v = trial(cand)
                if ok(v):
                    best = (cand, v)
    if not ok(best[1]):  # the best-scoring choice tried (a fallback rule can score worse)
        score = lambda t: (-math.inf if math.isnan(t[1]) else sign * t[1], -len(t[0]))
        best = max(((k, v) for k, v in trials if frozenset(k) in seen), key=score)
    kept, m_final = best
    kept, met = expand(kept), ok(m_final)
    shown = tuple((t if t[:1] and t[0].startswith("quantized alone: ") else expand(t), v)
                  for t, v in trials)
    rules, out_qp = recipe.rules, qp
    if kept:
        pattern = "^(" + "|".join(re.escape(k) for k in kept) + ")$"
        # (only to='s rules for kept ops' primitives: its conv copy, for none, warned)
        prims = {qp[k].op for k in kept}
        fb = (Rule(key=pattern, weight=None),) if to is None else \
            tuple(_kept_back(r, pattern, prims) for r in to_rules if prims & set(r.ops))
        # a rule of the recipe's that decided only ops now kept back (or they and ops an
        # earlier rule of its takes) decides nothing of f's behind fb; it stays (it may
        # decide the ops of another function on these params), and calibrate's warning
        # that it is shadowed, new here (fb made it), is not shown
        rules = fb + rules
        # Calibrate with the final recipe: the same arrays as the trial's mix, and
        # metadata (which float leaves jqt.pack must keep, notes) that match it.
        # (a rule of the recipe's warned about there has another number behind fb)
        unnumbered = lambda m: re.sub(r"^(jqt\.calibrate: rule )\d+ ", r"\1", m)
        skip = lambda m: "decides no op: every op it matches is taken by an earlier rule" in m
        with _Once(calibrated, unnumbered, skip)():  # what ``to`` could not do for the kept ops (a group size)
            out_qp = calibrate(f, Recipe(rules=rules), params, batches,
                               weight_argnums=weight_argnums, progress=progress)
    result = FallbackResult(Recipe(rules=rules), out_qp, tuple(kept), met, m_float, m_q, m_final,
                            shown)
    if not met:
        every = [v for k, v in trials if ranked and frozenset(k) == frozenset(ranked)]
        if to is not None and every and not ok(every[0]):
            same = " (the same as with none: to= gives them the types they have?)" \
                if every[0] == m_q else ""
            other = sum(1 for k, _ in trials if 0 < len(k) < len(ranked)
                        and not k[0].startswith("quantized alone: "))
            why = (f"keeping every one of the {len(expand(ranked))} candidate ops back at to= scores "
                   f"{every[0]:z.4g}{same}, and the {other} smaller choice(s) tried did not meet "
                   "it either. Use a more precise fallback (to=None keeps ops float) or a larger "
                   f"max_drop{'' if narrowed else ', or more trials (max_trials)'}.")
        else:
            why = ("Allow more trials (max_trials) or a larger max_drop" + (
                "." if to is None else ", or a more precise fallback (to=None keeps ops float)."))
        diagnostics.warn(
            f"jqt.fallback: the budget max_drop={max_drop} was not met within {len(trials)} "
            f"trials: the best choice keeps {list(kept)} back and scores {m_final:z.4g} against "
            f"{m_float:z.4g} in float; {why}")
    elif not narrowed:
        diagnostics.warn(
            f"jqt.fallback: max_trials={max_trials} ran out before the search narrowed the ops to "
            f"keep back: the result keeps {len(kept)} of the {len(expand(ranked))} candidate ops back "
            "(it meets the budget), and a shorter choice may too. Pass a larger max_trials.")
    return result
