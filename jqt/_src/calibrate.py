"""``jqt.calibrate``: run the function on data, collect statistics, return qparams."""
from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from . import numerics as nx
from .handlers import Calibrate
from .interpreter import Ctx, eval_jaxpr
from .qparams import OpQParams, QuantParams
from .recipe import Recipe
from .tracing import Tracer, normalize_argnums


class CalibrationDataError(ValueError):
    """The calibration data cannot be used (empty, NaN/inf, inconsistent structure)."""


def _full_args(argnums, params, batch):
    args = list(batch)
    for n, p in zip(argnums, params):
        args.insert(n, p)
    return args


def _check_batch(i, batch, first_tree):
    if not isinstance(batch, (tuple, list)):
        raise CalibrationDataError(
            f"jqt.calibrate: batch {i} is a {type(batch).__name__}; each batch must be a tuple "
            "of the remaining arguments of f, e.g. batches = [(x,) for x in xs].")
    tree = jax.tree_util.tree_structure(tuple(batch))
    if first_tree is not None and tree != first_tree:
        raise CalibrationDataError(
            f"jqt.calibrate: batch {i} has structure {tree}, but batch 0 had {first_tree}. "
            "Every batch must hold the same arguments.")
    for path, leaf in jax.tree_util.tree_flatten_with_path(tuple(batch))[0]:
        a = np.asarray(leaf)
        if np.issubdtype(a.dtype, np.inexact) and not np.isfinite(a).all():
            raise CalibrationDataError(
                f"jqt.calibrate: batch {i}, argument {jax.tree_util.keystr(path)} holds "
                f"{int((~np.isfinite(a)).sum())} NaN/inf values. Clean the calibration data "
                "(statistics from non-finite values would give infinite scales).")
    return tree


def _merge_running(acc, new):
    """Merges a step's statistics into the running ones. A step may carry statistics
    the running ones lack (weights are observed until every op has run once)."""
    out = dict(acc)
    for k, st in new.items():
        cur = acc.get(k, {})
        shared = [n for n in st if n in cur]
        merged = Calibrate.merge({n: cur[n] for n in shared}, {n: st[n] for n in shared})
        out[k] = {**cur, **st, **merged}
    return out


def calibrate(f, recipe: Recipe, params, batches, *, weight_argnums=0, progress=None):
    """Calibrates ``f`` on ``batches`` and returns its quantization parameters.

    Args:
      f: any JAX function; the argument(s) at ``weight_argnums`` hold the weights.
      recipe: a :class:`jqt.Recipe`, e.g. ``jqt.recipes.w8a8()``.
      params: the weights (a tuple of them when ``weight_argnums`` has several).
      batches: an iterable of tuples of the remaining arguments of ``f``.
      weight_argnums: position(s) of the weight argument(s); default 0.
      progress: show a progress bar (tqdm); ``None`` shows it on a terminal only.

    Returns:
      ``dict`` mapping op keys to :class:`jqt.OpQParams` (a pytree).

    Each batch runs one jitted step (compiled once per batch shape); min/max
    statistics are merged across batches as they come.

    >>> import jax.numpy as jnp, jqt
    >>> f = lambda w, x: x @ w
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), jnp.ones((3, 2)), [(jnp.ones((4, 3)),)],
    ...                    progress=False)
    >>> list(qp)
    ['w']
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"jqt.calibrate: recipe is a {type(recipe).__name__}; expected a "
                        "jqt.Recipe such as jqt.recipes.w8a8().")
    argnums = normalize_argnums(weight_argnums)
    params_t = (params,) if len(argnums) == 1 else tuple(params)
    tracer = Tracer(f, argnums)
    last = {}

    def step(params_t, batch, observe_weights):
        traced = tracer(_full_args(argnums, params_t, batch))
        last["traced"] = traced
        ctx = Ctx(Calibrate(recipe, observe_weights), {})
        eval_jaxpr(traced.closed.jaxpr, traced.closed.consts,
                   jax.tree_util.tree_leaves(_full_args(argnums, params_t, batch)), traced.plan, ctx)
        return ctx.state_out

    jstep = jax.jit(step, static_argnums=2)
    merge = jax.jit(_merge_running)
    try:
        total = len(batches)
    except TypeError:
        total = None
    from tqdm.auto import tqdm
    bar = tqdm(batches, total=total, desc="jqt.calibrate", unit="batch",
               disable=None if progress is None else not progress)
    stats, tree = None, None
    weights_seen = False  # weights are observed until every op has run once
    for i, batch in enumerate(bar):
        tree = _check_batch(i, batch, tree)
        batch = tuple(batch)
        new = jstep(params_t, batch, not weights_seen)
        stats = new if stats is None else merge(stats, new)
        if not weights_seen:
            weights_seen = all(bool(jnp.isfinite(st["w_min"]).all())
                               for st in stats.values() if "w_min" in st)
    if stats is None:
        raise CalibrationDataError("jqt.calibrate: the calibration set is empty; pass at least "
                                   "one batch, e.g. batches=[(x,)].")
    return finalize(last["traced"], recipe, stats)


def finalize(traced, recipe, stats):
    """Statistics -> qparams, one :class:`OpQParams` per op."""
    sites = traced.sites()
    decided = {}
    for s in sites:
        decided[s.key] = _decide(s, recipe.rule_for(s.op, s.key), stats.get(s.key, {}))
    quantized_w = {k for k, p in decided.items() if p.weight_operand is not None
                   and p.operand(p.weight_operand) is not None}
    out = {}
    for s in sites:
        p = decided[s.key]
        if p.source is not None:
            uses = traced.analyzer.leaf_uses.get((p.source.arg, p.source.path), set())
            needed = any(u == "float" or u not in quantized_w for u in uses)
            p = dataclasses.replace(p, source=dataclasses.replace(
                p.source, float_needed=needed, contract=s.contract[s.weight_operand],
                batch=s.batch_axes()))
        out[s.key] = p
    return out


def _decide(site, rule, st):
    base = dict(op=site.op, weight_operand=site.weight_operand, source=site.source)
    float_ = lambda note: OpQParams(lhs=None, rhs=None, note=note, **base)
    if rule is None:
        return float_("no rule of the recipe matches this op")
    w = site.weight_operand
    if w is None:
        if rule.act_x_act is None:
            return float_("activation x activation op (set Rule(act_x_act=...) to quantize)")
        if site.op != "dot_general":
            return float_("conv with a data-dependent kernel is kept float")
        q = QuantParams(scale=None, zero_point=None, qtype=rule.act_x_act)
        return OpQParams(lhs=q, rhs=q, **base)
    if rule.weight is None:
        return float_("the recipe keeps it float")
    if site.op == "conv_general_dilated" and site.eqn.params.get("batch_group_count", 1) != 1:
        return float_("conv with batch_group_count > 1 is kept float")
    if site.op == "conv_general_dilated" and (w != 1 or not rule.weight.symmetric):
        if w != 1:
            return float_("conv whose data operand is the kernel is kept float")
        raise ValueError(f"jqt: op '{site.key}' is a conv; conv weights must be symmetric "
                         "(QuantType(symmetric=True)).")
    never = (f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}') "
             "never ran on the calibration data (a lax.cond branch that was not taken, a "
             "while_loop that did not iterate?); it stays float. Add calibration data that "
             "reaches it.")
    if not np.isfinite(np.asarray(st["w_min"])).all():
        warnings.warn(never, stacklevel=3)
        return float_("never reached during calibration")
    scale, zp = nx.params_from_range(st["w_min"], st["w_max"], rule.weight)
    ops = [None, None]
    ops[w] = QuantParams(scale=scale, zero_point=zp, qtype=rule.weight)
    act = rule.activation
    if act is not None:
        if act.dynamic:
            ops[1 - w] = QuantParams(scale=None, zero_point=None, qtype=act)
        else:
            lo, hi = np.asarray(st["act_min"]), np.asarray(st["act_max"])
            if not np.isfinite(lo).all():
                warnings.warn(never, stacklevel=3)
                return float_("never reached during calibration")
            s, z = nx.params_from_range(lo, hi, act)
            ops[1 - w] = QuantParams(scale=s, zero_point=z, qtype=act)
    return OpQParams(lhs=ops[0], rhs=ops[1], **base)
