"""Per-op calibration statistics as a pytree, and how they merge.

One :class:`SiteStats` per op: the activation calibrator's state, the
weight's per-channel range and, for the outlier algorithms, per-input-channel
statistics of the activation (``chan``: ``absmax``, ``abssum`` and ``count``,
``hessian`` = ``X^T X``), with the calibrator itself as static aux data,
so merging needs nothing but the statistics. ``combine`` unites the data of
one batch (``scan``/``while`` iterations, ``cond`` branches, devices);
``accumulate`` folds successive batches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from . import compat


@jax.tree_util.register_pytree_node_class
class SiteStats:
    def __init__(self, act, weight, calibrator, chan=None):
        self.act = act          # the calibrator's state, or None
        self.weight = weight    # {"min", "max"} arrays, or None (not observed in this step)
        self.calibrator = calibrator
        self.chan = chan        # per-input-channel statistics (see CHAN_MERGE), or None

    def tree_flatten(self):
        return (self.act, self.weight, self.chan), self.calibrator

    @classmethod
    def tree_unflatten(cls, calibrator, children):
        act, weight, chan = children
        return cls(act, weight, calibrator, chan)


def _pick(a, b, both):
    if a is None:
        return b
    if b is None:
        return a
    return both(a, b)


def _combine_w(a, b):
    return {"min": jnp.minimum(a["min"], b["min"]), "max": jnp.maximum(a["max"], b["max"])}


CHAN_MERGE = {"absmax": jnp.maximum, "abssum": jnp.add, "count": jnp.add, "hessian": jnp.add}
"""How each per-input-channel statistic merges (elementwise, so stacked per-layer
statistics merge the same way)."""


def _combine_chan(a, b):
    return {k: CHAN_MERGE[k](a[k], b[k]) for k in a}


def _reduce_chan(stacked):
    return {k: (jnp.max if k == "absmax" else jnp.sum)(v, axis=0) for k, v in stacked.items()}


# bounded: keyed by the calibrator, which a user's class may hash by identity (a new one
# each call kept its compiled program and the arrays it holds alive for ever)
@functools.lru_cache(maxsize=64)
def _ref_ndim(calibrator) -> int:
    """The rank of the statistics ``calibrator.observe`` gives one tensor, probed on a 1-D
    one: statistics of more axes are stacked per layer (a ``lax.scan`` over layers)."""
    rank = lambda shape: len(jax.tree_util.tree_leaves(jax.eval_shape(
        calibrator.observe, jax.ShapeDtypeStruct(shape, jnp.float32)))[0].shape)
    fix = ("jqt calls observe on a vector to learn the rank of its statistics, which must not "
           "depend on x's rank: reduce over every axis of x, without keepdims (e.g. "
           "jnp.max(jnp.abs(x)), not over axis 1)")
    try:
        ref = rank((2,))
    except Exception as e:  # noqa: BLE001 -- any error of the user's observe
        raise ValueError(
            f"jqt.calibrate: calibrator {type(calibrator).__name__}'s observe(x) failed on a 1-D "
            f"x of shape (2,) ({type(e).__name__}: {e}): {fix}.") from e
    if rank((2, 2)) != ref:  # statistics with keepdims read as layers of a lax.scan
        raise ValueError(
            f"jqt.calibrate: calibrator {type(calibrator).__name__}'s observe(x) returns "
            f"statistics of rank {ref} for a 1-D x and {rank((2, 2))} for a 2-D one: {fix}.")
    return ref


def stack_depth(calibrator, act) -> int:
    """How many leading axes the statistics ``act`` have beyond one tensor's: one
    per ``lax.scan`` that stacked them (an op whose weight is sliced from a
    stacked leaf keeps one set of statistics per layer)."""
    return jnp.ndim(jax.tree_util.tree_leaves(act)[0]) - _ref_ndim(calibrator)


def _stacked(fn, calibrator, a):
    for _ in range(stack_depth(calibrator, a)):
        fn = jax.vmap(fn)
    return fn


def combine(a: SiteStats, b: SiteStats) -> SiteStats:
    cal = a.calibrator
    act = _pick(a.act, b.act, lambda x, y: _stacked(cal.combine, cal, x)(x, y))
    return SiteStats(act, _pick(a.weight, b.weight, _combine_w), cal, _pick(a.chan, b.chan, _combine_chan))


def accumulate(running: SiteStats, new: SiteStats) -> SiteStats:
    cal = running.calibrator
    act = _pick(running.act, new.act, lambda x, y: _stacked(cal.accumulate, cal, x)(x, y))
    return SiteStats(act, _pick(running.weight, new.weight, _combine_w), cal,
                     _pick(running.chan, new.chan, _combine_chan))


def empty(like: SiteStats) -> SiteStats:
    """The statistics of no data, shaped like ``like`` (arrays or shape structs):
    stacked statistics (``stack_depth`` > 0) get the calibrator's empty
    statistics once per layer."""
    cal, act, weight = like.calibrator, None, None
    if like.act is not None:
        depth = stack_depth(cal, like.act)
        one = cal.empty(jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[depth:], x.dtype), like.act))
        act = jax.tree_util.tree_map(
            lambda e, x: jnp.broadcast_to(jnp.asarray(e, x.dtype), jnp.shape(x)), one, like.act)
    if like.weight is not None:
        weight = {"min": jnp.full(jnp.shape(like.weight["min"]), jnp.inf, jnp.float32),
                  "max": jnp.full(jnp.shape(like.weight["max"]), -jnp.inf, jnp.float32)}
    chan = None if like.chan is None else {k: jnp.zeros(jnp.shape(v), v.dtype) for k, v in like.chan.items()}
    return SiteStats(act, weight, cal, chan)


def reduce_stacked(stacked: SiteStats) -> SiteStats:
    """Statistics stacked over a leading axis (``lax.scan`` iterations) -> their union.

    The leading axis is the only one reduced: statistics that were already
    stacked per layer (an inner ``scan`` over stacked weights) stay per layer.
    Statistics with nothing in them (weights observed in an earlier batch, no
    activation statistics) are returned as they are."""
    leaves = jax.tree_util.tree_leaves(stacked)
    if not leaves:
        return stacked
    first = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), stacked)
    # inside jax.shard_map: the accumulator varies over the mesh axes the statistics do
    init = jax.tree_util.tree_map(compat.vary_like, empty(first), stacked)
    out, _ = lax.scan(lambda acc, s: (combine(acc, s), None), init, stacked,
                      length=leaves[0].shape[0])
    return out


def combine_all(a: dict, b: dict) -> dict:
    return {k: combine(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in dict.fromkeys([*a, *b])}


def accumulate_all(running: dict, new: dict) -> dict:
    return {k: accumulate(running[k], new[k]) if k in running and k in new
            else running.get(k, new.get(k)) for k in dict.fromkeys([*running, *new])}
