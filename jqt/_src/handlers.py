"""What happens at each quantizable op, per mode.

A handler implements :class:`Handler`: ``site(site, eqn, invals, ctx) ->
outvals``, and says whether it ``collects`` state (calibration statistics, or
the report's error sums) and whether it must stay ``differentiable`` (the
simulated path). A collecting handler also has ``identity(shapes)``,
``merge(a, b)`` and ``reduce_iterations(stacked)``, each on a dict keyed by op
key, which the interpreter uses under ``cond`` / ``while`` / ``scan``.

What differs between primitives comes from the site's registry entry
(``registry.py``): which rule fields apply, the group axis, the kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from . import accumulator, compat, dense, diagnostics, groups, kvcache, stats, transforms
from . import numerics as nx
from .dense import DenseAxes
from .formats import unpack_nibbles
from .layerview import LayerView
from .policy import KernelPolicy
from .qparams import OpQParams, QArray, axes_only, codes_problem, field_problems

_F32 = jnp.float32


class Handler(Protocol):
    """The interface every mode implements (calibrate, simulate, integer, report)."""

    collects: bool
    differentiable: bool

    def site(self, site, eqn, invals, ctx) -> list: ...

    # Optional, read by the loop rules of ``hops.py``: ``enter_cache(x, qtype)`` (a
    # loop's key/value cache in the handler's form, and a cache f takes and returns: ``x``
    # a float buffer, or a quantized cache passed to f); ``identity``, ``merge`` and
    # ``reduce_iterations`` (collecting handlers: statistics across iterations);
    # ``split_stacked(entry) -> (sliced, kept)`` and ``join_stacked(sliced, kept, i)``
    # (the part of a stacked op's state a scan keeps whole, indexed in the body).


class QParamsMismatchError(ValueError):
    """qparams and weights that do not belong together: qparams made for another function,
    weights other than those calibrated (``jqt.pack``, ``jqt.gptq``), or packed weights of
    another format than the qparams say.

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> try:
    ...     jqt.quantize(lambda w, x: x @ w + x @ w.T, qp)(jnp.eye(2), jnp.ones((1, 2)))
    ... except jqt.QParamsMismatchError as e:
    ...     print(str(e)[:47])
    jqt: no quantization parameters for ops ['w#1']
    """


def kept_as_is(dtypes):
    """Why an op whose operands have ``dtypes`` is kept as it is (the note its qparams
    carry), or ``None``: complex operands (quantization is of real numbers), or only
    integers among the first two (the op is exact already).

    >>> import numpy as np
    >>> kept_as_is([np.dtype("int8"), np.dtype("int8")]), kept_as_is([np.dtype("int32"), np.dtype("float32")])
    ('integer operands are kept as they are (the op is exact already)', None)
    """
    if any(jnp.issubdtype(d, jnp.complexfloating) for d in dtypes):
        return "complex operands are kept float (quantization is of real numbers)"
    if not any(jnp.issubdtype(d, jnp.inexact) for d in dtypes[:2]):
        return "integer operands are kept as they are (the op is exact already)"
    return None


def weight_range_args(site, rule, shape):
    """``(axes, qtype, group_axis)`` of :func:`groups.weight_range` for the weight of
    ``site`` (one layer, of ``shape``) under ``rule``: how calibration observes it."""
    wt = weight_qtype(site, site.entry.weight_type(rule), shape)
    return (site.contract[site.weight_operand] if wt.per_channel else None, wt,
            site.entry.groups(site) if wt.group_size else None)


def weight_qtype(site, qtype, shape):
    """The weight type an op really gets: ``qtype``; or, where its groups do not tile the
    innermost contracted axis but are a multiple of its length on a weight contracted
    over several axes (``head_dim`` 64 with ``group_size=128`` on an attention output
    projection), groups of that length (one per head: finer than asked, as groups do
    not span several axes) unless the whole contraction fits one group (4 heads of 16
    under ``group_size=64``: one scale per output channel is one group, as asked), and
    for a lookup of whole matrices one group per row whatever its length; otherwise ``qtype`` without groups (per channel) when the op cannot take groups or
    they do not tile its axis."""
    if not qtype.group_size:
        return qtype
    ax = site.entry.groups(site)
    if ax is not None and groups.fits(qtype, shape, ax):
        return qtype
    n = shape[ax % len(shape)] if ax is not None else 0
    contract = site.contract[site.weight_operand] if site.weight_operand is not None else ()
    # (n > 1: groups of 1 along a contracted axis of length 1, kcn with c = 1, were one
    # scale per element, which calibrate's size check then kept float)
    if len(contract) > 1 and n > 1 and (qtype.group_size % n == 0 or site.op == "gather") \
            and math.prod(shape[a] for a in contract) > qtype.group_size:
        # (a lookup of whole matrices, experts gathered per token: one group per row of
        # each, whatever its length, rather than one scale per matrix)
        return dataclasses.replace(qtype, group_size=n)
    return dataclasses.replace(qtype, group_size=0)


def transformed(site, qp, i, x):
    """Operand ``i`` of the op with its outlier transforms (``qp.smooth``, ``qp.rotate``)
    applied: the activation divided by the smoothing vector and rotated, the weight
    multiplied and rotated (``transforms.py``); unchanged for an op without them."""
    if qp is None or not qp.transformed or site.weight_operand is None:
        return x
    w = site.weight_operand
    if i == w:
        return transforms.weight(x, qp.smooth, qp.rotate, site.contract[w])
    return transforms.activation(x, qp.smooth, qp.rotate, site.contract[i], site.contract[w])


class Calibrate:
    """Runs the float function and records each op's statistics (a
    :class:`~jqt._src.stats.SiteStats`: the rule's activation calibrator's state
    and, while ``observe_weights``, the weight calibrator's range: every weight's with
    ``True``, with ``"computed"`` only those of weights ``f`` computes, which may follow
    the input's shape).

    Ops with an ``(OpQParams, packed)`` entry in ``ctx.state_in`` (already
    calibrated, for error-propagating calibration) run simulated instead and
    record nothing. An op with a bare :class:`jqt.OpQParams` entry (its outlier
    transforms, decided after a first pass) is observed with its operands
    transformed. With ``chan`` (names from ``stats.CHAN_MERGE``) an op whose
    rule asks for an outlier algorithm also records per-input-channel
    statistics of its activation (``transforms.channel_stats``).
    """

    collects = True
    differentiable = False

    def __init__(self, recipe, observe_weights):
        self.recipe = recipe
        self.observe_weights = observe_weights

    def site(self, site, eqn, invals, ctx):
        entry = ctx.state_in.get(site.key)
        if isinstance(entry, tuple):
            return Simulate().site(site, eqn, invals, ctx)
        outs = compat.bind_eqn(eqn, invals)
        if entry is not None:
            invals = [transformed(site, entry, i, v) for i, v in enumerate(invals)]
        rule = self.recipe.rule_for(site.op, site.key)
        w = site.weight_operand
        wt = site.entry.weight_type(rule) if rule is not None and w is not None else None
        if wt is None or kept_as_is([v.dtype for v in invals]) is not None:
            return outs
        at = site.entry.act_type(rule)
        act, weight, cal = None, None, None
        if at is not None and not at.dynamic:
            cal = rule.calibrator
            x, live = _as_f32(invals[1 - w]), site.entry.live_rows(invals)
            act = _observe(cal, x) if live is None else _observe_rows(cal, x, live)
        if self.observe_weights is True or (self.observe_weights == "computed"
                                            and site.computes_weight):
            with groups.naming(f"op '{site.key}' (weight "
                               f"'{site.source.path if site.source else '(computed)'}')"):
                lo, hi = groups.weight_range(rule.weight_calibrator, invals[w].astype(_F32),
                                             *weight_range_args(site, rule, invals[w].shape))
            weight = {"min": jnp.asarray(lo, _F32), "max": jnp.asarray(hi, _F32)}
        chan = None
        names = transforms.wanted_stats(rule) if entry is None else ()
        if names and transforms.applies(site):
            chan = transforms.channel_stats(invals[1 - w], invals[w], site, names)
        ctx.put(site.key, stats.SiteStats(act, weight, cal, chan))
        return outs

    @staticmethod
    def identity(shapes):
        return {k: stats.empty(v) for k, v in shapes.items()}

    @staticmethod
    def merge(a, b):
        return stats.combine_all(a, b)

    @staticmethod
    def reduce_iterations(stacked):
        return {k: stats.reduce_stacked(v) for k, v in stacked.items()}


def stacked_hint(n):
    """The end of a shape error whose parameters carry one leading axis of ``n`` more than
    the op needs: qparams stacked per task, seed or model, run without ``jax.vmap``."""
    return (f" If the qparams were stacked along a leading axis of {n} (one per task, seed or "
            "model: jax.tree.map(jnp.stack, ...)), run the quantized function under jax.vmap "
            "over that axis.")


def _as_f32(x):
    """``x`` in float32; (x64) float64 values below float32's normal range, which the cast
    flushes to 0 (calibrate then called the activation "0 on every batch"), at its edge
    instead, so that calibrate names them as too small for a scale."""
    if x.dtype == jnp.float64:
        tiny = float(np.finfo(np.float32).tiny)
        x = jnp.where((x != 0) & (jnp.abs(x) < tiny), jnp.sign(x) * tiny, x)
    return x.astype(_F32)


def _observe(cal, x):
    """``cal.observe(x)``; for an activation with no elements (a slice of no rows, as
    ``lax.associative_scan`` makes), the statistics of no data, ``cal.empty``, in the
    shapes ``observe`` gives (a reduction over nothing has no value to give)."""
    try:
        if x.size:
            return cal.observe(x)
        like = jax.eval_shape(cal.observe, jax.ShapeDtypeStruct(tuple(max(n, 1) for n in x.shape), x.dtype))
        return cal.empty(like)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
            jax.errors.TracerBoolConversionError, jax.errors.TracerIntegerConversionError) as e:
        if type(cal).__module__ != __name__.rsplit(".", 1)[0] + ".calibrators":  # a user's
            e.add_note(f"jqt: calibrator {type(cal).__name__}'s observe(x) (or empty) runs "
                       "traced, inside the calibration step: compute with jnp, not NumPy, "
                       "float() or Python branches on values (only range and check run on the "
                       "host).")
        raise


def _observe_rows(cal, x, n):
    """The statistics of ``x``'s first ``n`` rows (``n`` traced, ``0 <= n <= len(x)``): the
    union (``cal.combine``) of one slice per set bit ``b`` of ``n``, ``2**b`` rows long, so
    every calibrator sees exactly those rows in static shapes.

    >>> import jqt
    >>> c = jqt.calibrators.MinMax()
    >>> s = _observe_rows(c, jnp.array([[1.0], [-2.0], [3.0], [50.0]]), jnp.int32(3))
    >>> c.range(s, jqt.QuantType())
    (-2.0, 3.0)
    """
    m = x.shape[0]
    like = jax.eval_shape(cal.observe, jax.ShapeDtypeStruct((1,) + x.shape[1:], x.dtype))
    out = cal.empty(like)
    for b in range(m.bit_length()):
        start = jnp.left_shift(jnp.right_shift(n, b + 1), b + 1)  # the higher bits' rows
        part = cal.observe(jax.lax.dynamic_slice_in_dim(x, start, 1 << b, 0))
        take = jnp.bitwise_and(jnp.right_shift(n, b), 1) == 1
        part = jax.tree.map(lambda a, e: jnp.where(take, a, e).astype(a.dtype), part, cal.empty(like))
        out = cal.combine(out, part)
    return out


def _expected_scale_shape(site, i, shape, qtype):
    if not qtype.per_channel:
        return ()
    g = qtype.group_size
    if g:  # a weight's (or a table's): per group of one axis, per position of every other
        gax = site.entry.groups(site)
        return tuple(n // g if d == gax else n for d, n in enumerate(shape))
    return tuple(1 if d in site.contract[i] else n for d, n in enumerate(shape))


def _nibble_axis(packed):
    if not packed.nibbles:
        return None
    nd = packed.values.ndim
    return {"nk": nd - 1, "kn": nd - 2}.get(packed.layout, nd - 1)


def values_shape(packed):
    """The shape of a packed weight's codes with nibbles unpacked."""
    shape = list(packed.values.shape)
    ax = _nibble_axis(packed)
    if ax is not None:
        shape[ax] *= 2
    return tuple(shape)


def without_entry(site, ctx) -> bool:
    """Whether ``site`` is an optional op (``registry``: cache writes, scalar-index
    lookups) that ``ctx``'s qparams have no entry for (made before jqt quantized such
    ops), or an op whose weight f builds from iota and constants (an interpolation
    matrix, always float) that they have none for (calibrated at another input shape):
    it then runs float, unchanged."""
    return (site.entry.optional or site.built) and site.key not in ctx.state_in


def _check_real(site, qp, invals):
    """Refuses complex operands of an op the qparams quantize (either operand: a weight-only
    kernel decodes the weight to float32, which a complex activation is cast to): it was
    calibrated on real ones (an op that reads complex values is kept float), and
    quantization would drop the imaginary parts."""
    bad = [] if qp.is_float else [i for i in (0, 1) if i < len(invals)
                                  and jnp.issubdtype(invals[i].dtype, jnp.complexfloating)]
    if bad:
        raise QParamsMismatchError(
            f"jqt: op '{site.key}' ({site.op}) was calibrated on real operands and is quantized, "
            f"but here its {'lhs' if bad[0] == 0 else 'rhs'} is {invals[bad[0]].dtype}: "
            "quantizing it would drop the imaginary part. Calibrate on data of the dtypes f "
            "is called with (an op that reads complex values is kept float), or pass real "
            "values.")


def lookup(ctx, site, invals):
    """(OpQParams, packed QArray or None) for ``site``, checked against the op."""
    entry = ctx.state_in.get(site.key)
    if entry is None:
        raise QParamsMismatchError(
            f"jqt: no quantization parameters for op '{site.key}' ({site.op} at "
            f"'{site.name_stack or '<top>'}'). The qparams were made for another function or "
            "another weight_argnums; run jqt.calibrate on this function.")
    qp, packed = entry
    if isinstance(packed, LayerView):  # the integer path in a scan over stacked layers
        packed = packed.sliced
    if not isinstance(qp, OpQParams):
        raise QParamsMismatchError(f"jqt: qparams['{site.key}'] is a {type(qp).__name__}, "
                                   "expected jqt.OpQParams.")
    if qp.op != site.op or qp.weight_operand != site.weight_operand:
        raise QParamsMismatchError(
            f"jqt: qparams['{site.key}'] describes a {qp.op} with weight operand "
            f"{qp.weight_operand}, but the function has a {site.op} with weight operand "
            f"{site.weight_operand} there. Re-calibrate for this function."
            + (" Or the weight now depends on the data: where f computes it with a value "
               "calibration was given as a Python number or NumPy array (static, so part of "
               "the weight), this call traces that value (a jax array, or an argument of "
               "jax.jit): pass it as calibration did (a Python number; jax.jit's "
               "static_argnums), or bind it with functools.partial."
               if qp.weight_operand is not None and site.weight_operand is None else
               " Or an operand calibration traced (a jax array) is a constant now (a Python "
               "number or NumPy array, which JAX keeps static): this call makes it the op's "
               "weight. Pass it as calibration did, or calibrate with it as passed now."
               if qp.weight_operand is None and site.weight_operand is not None else "")
            + f"{diagnostics.einsum_order([site.name_stack or ''])}")
    _check_source(site, qp)
    _check_real(site, qp, invals)
    src = qp.source
    if (packed is not None and packed.nibbles and src is not None and src.batch
            and tuple(src.batch) != site.batch_axes()):  # (a file without them: ())
        raise QParamsMismatchError(
            f"jqt: the packed weight for '{site.key}' was packed for a {site.op} with batch axes "
            f"{tuple(src.batch)} of weight '{src.path}', but here it has "
            f"{site.batch_axes() or 'none'}: the op's structure follows the input's shape (an "
            "einsum such as 'hd,hdk->hk' given an input whose h is 1 broadcasts it and drops "
            "the batch axis), and its 4-bit codes are laid out for the other. Calibrate and "
            "pack with inputs of the shape you call it with (one qparams per shape), or give "
            "the input that axis whole (jnp.broadcast_to).")
    for i in (0, 1):
        q = qp.operand(i)
        if q is None:
            continue
        want = _expected_scale_shape(site, i, invals[i].shape, q.qtype)
        for field in ("scale", "zero_point"):
            a = getattr(q, field)
            if a is not None and tuple(jnp.shape(a)) != want:
                per_layer = (" (one layer's shapes: under the lax.scan over stacked layers the "
                             "qparams hold them with a leading layer axis)") if _scanned(site) else ""
                computed = (" This op's weight is computed in f (no leaf of params reaches it "
                            "by layout ops alone: it is keyed by position), and its shape "
                            "follows the input's: a weight tiled or broadcast to the batch "
                            "(jnp.tile(probe, [n, 1, 1]) @ w), or one sized by the sequence "
                            "length (relative positions: sinusoid(T) @ w_pos). Keep the batch "
                            "out of the weight (multiply the untiled weight, and contract the "
                            "product without a batch axis: einsum('qd,bkd->bqk', q, k), not q "
                            "broadcast to the batch), calibrate and quantize at one length (one qparams per "
                            "length), or keep this op float: a jqt.Rule(key=...) matching its "
                            "key, with no types, first in the recipe's rules."
                            ) if i == site.weight_operand and site.source is None else ""
                got = tuple(jnp.shape(a))
                stacked = stacked_hint(got[0]) if len(got) == len(want) + 1 and got[1:] == want else ""
                raise QParamsMismatchError(
                    f"jqt: qparams['{site.key}'] has a {'lhs' if i == 0 else 'rhs'} {field} of "
                    f"shape {got}, but the operand {tuple(invals[i].shape)} "
                    f"({q.qtype.describe()}) needs {want}{per_layer}. "
                    + _split_block(site, a, "its qparams", got, want,
                                   "The function or its weights changed shape since calibration, "
                                   f"or the qparams were edited; re-calibrate.{stacked}{computed}"))
    _check_smooth(site, qp, invals)
    # a packed weight's fields its type needs, whatever their values (traced under jax.jit,
    # where the eager call's check of the numbers does not run; the qparams' are checked
    # with them): its kernel reads a zero point where one is given, and decodes an
    # asymmetric weight without one as symmetric
    missing = [] if packed is None else field_problems(packed, "packed weight", packed.zero_point, packed=True)
    if missing:
        raise QParamsMismatchError(
            f"jqt: the packed weight for '{site.key}': {'; '.join(missing)}. jqt.pack gives a "
            "packed weight the fields its type needs; re-run jqt.pack(qparams, params) rather "
            "than editing them.")
    if packed is not None:
        w = site.weight_operand
        why = codes_problem(packed)  # first: cast nibbles read as other shapes
        if why:
            raise QParamsMismatchError(
                f"jqt: the packed weight for '{site.key}': {why}. A cast over the whole "
                "PackedParams (tree_map astype) changes them; leave the codes, sums and smoothing "
                "vectors as jqt.pack made them (cast the float params and scales only), or re-run "
                "jqt.pack.")
        want = _packed_shape(site, invals, packed)
        if values_shape(packed) != want:
            as_packed = f" (packed: {want})" if want != tuple(invals[w].shape) else ""
            raise QParamsMismatchError(
                f"jqt: the packed weight for '{site.key}' has shape {tuple(packed.values.shape)} "
                f"but the op reads a weight of shape {tuple(invals[w].shape)}{as_packed}. "
                + _split_block(site, packed.values, "the packed weights", packed.values.shape, want,
                               "Re-run jqt.pack." + _leading_axes(want, values_shape(packed))))
        q = qp.operand(w)
        if q is not None and packed.qtype != q.qtype:
            have, want = packed.qtype.contrast(q.qtype)
            raise QParamsMismatchError(
                f"jqt: the packed weight for '{site.key}' is {have}, but "
                f"qparams['{site.key}'] quantize it as {want}: the weights were "
                "packed with other qparams (another recipe, or before a fallback or edit). "
                "Re-run jqt.pack(qparams, params) with these qparams.")
        if q is not None and packed.scale is not None and q.scale is not None \
                and jnp.shape(packed.scale) != jnp.shape(q.scale):
            raise QParamsMismatchError(
                f"jqt: the packed weight for '{site.key}' has scales of shape "
                f"{tuple(jnp.shape(packed.scale))}, but qparams['{site.key}'] give its op scales of "
                f"shape {tuple(jnp.shape(q.scale))}: the weights were packed for another use of "
                "them (a square weight contracted over its other axis: packed for "
                "einsum('bk,kn->bn'), run as einsum('bk,nk->bn')) or with other "
                "qparams. Re-run jqt.pack(qparams, params) with these qparams.")
    return qp, packed


def smooth_mismatch(smooth, shape, contract, depth=0) -> str:
    """Why a smoothing vector does not fit a weight operand of ``shape`` (its first
    ``depth`` axes stacked layers), or ``""``: it must be full length on the contracted
    axes, 1 elsewhere (an ``(N,)`` or ``(1, N)`` vector edited into qparams failed inside
    JAX, or multiplied the codes per output channel).

    >>> smooth_mismatch(jnp.ones((16, 1)), (16, 8), (0,))
    ''
    >>> smooth_mismatch(jnp.ones((3, 1, 8)), (3, 16, 8), (0,), depth=1)[:60]
    'its smoothing vector has shape (3, 1, 8), but its weight ope'
    """
    want = tuple(shape[:depth]) + tuple(n if d in contract else 1 for d, n in enumerate(shape[depth:]))
    if smooth is None or tuple(jnp.shape(smooth)) == want:
        return ""
    return (f"its smoothing vector has shape {tuple(jnp.shape(smooth))}, but its weight operand "
            f"{tuple(shape)} needs {want}: full length on the contracted axes, 1 elsewhere. "
            "Re-calibrate, or edit it in that layout")


def _check_smooth(site, qp, invals):
    w = site.weight_operand
    why = "" if w is None or site.op != "dot_general" else \
        smooth_mismatch(qp.smooth, invals[w].shape, site.contract[w])
    if why:
        raise QParamsMismatchError(f"jqt: qparams['{site.key}']: {why}.")


def _scanned(site) -> bool:
    """Whether a ``lax.scan`` over stacked layers slices ``site``'s weight (its stack ids
    also count each ``jax.shard_map`` that splits it into blocks)."""
    if site.source is None:
        return bool(site.stack_ids)  # a computed weight's are its scans' alone
    return any(c[0] == "scan_slice" for c in site.source.chain)


def _split_block(site, a, what, got, want, otherwise) -> str:
    """The cause where ``a`` is a block of a value ``jax.shard_map``'s ``in_specs`` split
    (its type varies over manual mesh axes) and not one jqt split itself (a ``shard_map``
    inside ``f``, whose split is in the weight's chain): the quantized function reads
    weights whole; ``otherwise`` where it is not. Under ``check_vma=False`` no type says
    what varies: a dim a mesh axis's size too small says it may be so, ahead of
    ``otherwise``."""
    axes = compat.varying_axes(a)
    own = site.source is not None and any(c[0] == "shard_split" and c[1] for c in site.source.chain)
    if own:
        return otherwise
    fix = (" (a block per device: in_specs from jqt.packed_shardings, say): the quantized "
           "function reads each weight and its scales whole, at the shape it was calibrated "
           "at. Pass the packed weights and the qparams with P() in the shard_map's in_specs, "
           "or, to split the weights over devices, put the jax.shard_map inside f and calibrate "
           "that (docs/sharding.md).")
    if axes:
        return (f"This op runs inside jax.shard_map and {what} reach it split over mesh axis "
                f"{', '.join(map(repr, axes))}{fix}")
    if compat.vma_checked() or len(got) != len(want):
        return otherwise
    sizes = compat.manual_axes()
    axes = [n for n, k in sizes.items() if k > 1 and any(w == g * k for g, w in zip(got, want))]
    if not axes:
        return otherwise
    return (f"This op runs inside jax.shard_map with check_vma=False, and {what} may reach it "
            f"split over mesh axis {', '.join(map(repr, axes))} (a dim of {tuple(got)} is "
            f"{tuple(want)}'s divided by its size; no type says which values vary){fix} If they "
            f"reach it whole: {otherwise}")


def _leading_axes(want, got) -> str:
    """A hint where ``got`` is ``want`` with axes in front: a stack of models (an ensemble)
    passed whole, where ``jax.vmap`` over it runs one at a time."""
    want, got = tuple(want), tuple(got)
    if len(got) <= len(want) or got[len(got) - len(want):] != want:
        return ""
    return (f" Its shape is the expected one with leading axes {got[:len(got) - len(want)]}: "
            "for a stack of models (an ensemble), calibrate each model, stack their qparams "
            "as their weights (jax.tree.map(lambda *a: jnp.stack(a), *qparams_list)) and map "
            "the quantized function over both, jax.vmap(lambda q, p, *a: jqt.quantize(f, q)(p, "
            "*a), in_axes=(0, 0, None)), which gives each model its own scales; or calibrate "
            "the function mapped over them, jqt.calibrate(jax.vmap(f, in_axes=(0, None)), "
            "recipe, stacked_params, batches), and quantize that function: each model its own "
            "weight scales, but one activation range for them all (docs/supported-ops.md).")


def _check_source(site, qp):
    """The weight must reach the op the way it did at calibration: the same layout ops
    from its leaf and the same contracted axes (``x @ w`` and ``x @ w.T`` of a square
    ``w`` have the same key and shapes, but their scales lie on different axes)."""
    a, b = qp.source, site.source
    if a is None or b is None or qp.is_float or site.weight_operand is None:
        return
    if a.shape is not None and b.shape is not None and tuple(a.shape) != tuple(b.shape):
        raise QParamsMismatchError(
            f"jqt: qparams['{site.key}'] were calibrated for weight '{a.path}' of shape "
            f"{tuple(a.shape)}, but this call passes it with shape {tuple(b.shape)}: the weights "
            "changed shape since calibration, and their scales were computed for other weights "
            "(a per-channel scale does not see the contracted axis, so its own shape can still "
            f"fit). Re-calibrate with these weights.{_leading_axes(a.shape, b.shape)}")
    want = (axes_only(b.chain), tuple(site.contract[site.weight_operand]))
    got = (axes_only(a.chain), tuple(a.contract) if a.contract else want[1])
    if got != want and got[1] == want[1] and [c[0] for c in got[0]] == [c[0] for c in want[0]]:
        was, now = map(step_text, next((c, d) for c, d in zip(got[0], want[0]) if c != d))
    elif got != want and got[1] == want[1] and _sliced_view(got[0], want[0]):
        # a slice to the input's length is no op at the full length, and JAX leaves it out
        was, now = _chain_text(got[0]), _chain_text(want[0])
    else:
        was = None
    if was is not None:
        raise QParamsMismatchError(
            f"jqt: qparams['{site.key}'] were calibrated for weight '{a.path}' of shape "
            f"{tuple(a.shape if a.shape is not None else b.shape or ())} reached by {was}, but this call "
            f"reaches it by {now}: the layout op's arguments "
            "follow the input's shape (e.g. p['pos'][:x.shape[1]], or a broadcast to the batch "
            "size) or a Python value (a static argument, or a static field of the params: a "
            "dataclass field with static=True, a flax.struct field with pytree_node=False), so "
            "the weight's scales were computed for another view of it. Calibrate with inputs "
            "of the shape and static values you call it with (one qparams each), or read the "
            "weight the same way at every shape.")
    if got != want and any(c[0] == "broadcast_in_dim" for c in a.chain + b.chain):
        raise QParamsMismatchError(
            f"jqt: qparams['{site.key}'] were calibrated for weight '{a.path}' reached by "
            f"{[c[0] for c in a.chain] or 'no layout ops'} and contracted over axes {got[1]}, but "
            f"this call reaches it by {[c[0] for c in b.chain] or 'no layout ops'} and contracts "
            f"axes {want[1]}: a broadcast of the weight follows the input's shape (at batch 1, "
            "and so under jax.vmap of the quantized function, which calls it per example, a "
            "broadcast to the batch traces otherwise or not at all), so its scales were computed "
            "for another view of it. Read the weight the same way at every shape (index a "
            "table, p['t'][ids], rather than broadcast it for take_along_axis; contract a "
            "shared query without a batch axis, einsum('qd,bkd->bqk', q, k)), or calibrate with "
            "inputs of the shape you call it with (one qparams per shape).")
    if got != want:
        # (the axes are the op's operand's, after the layout ops: where only those differ,
        # w and w.T both contract axis 0 of what reaches the op)
        view = " (axes of the operand the layout ops make)" if got[1] == want[1] else ""
        raise QParamsMismatchError(
            f"jqt: qparams['{site.key}'] were calibrated for weight '{a.path}' reached by "
            f"{[c[0] for c in a.chain] or 'no layout ops'} and contracted over axes {got[1]}, but "
            f"this function reaches it by {[c[0] for c in b.chain] or 'no layout ops'} and "
            f"contracts axes {want[1]}{view}: the scales would lie on the wrong axes. "
            "Re-calibrate for this function.")


_VIEW_STEPS = frozenset({"slice", "dynamic_slice", "squeeze", "reshape"})  # (broadcasts: below)


def _sliced_view(a, b):
    """Whether layout chains ``a`` and ``b`` differ only by view steps that one of them
    has (a slice of the whole weight, which JAX leaves out, against a shorter one)."""
    keep = lambda chain: [c for c in chain if c[0] not in _VIEW_STEPS]  # noqa: E731
    return a != b and keep(a) == keep(b) and (len(a) != len(keep(a)) or len(b) != len(keep(b)))


def _chain_text(chain):
    return ", then ".join(map(step_text, chain)) if chain else "no layout ops (the whole weight)"


def step_text(c):
    """A layout step of a weight's chain as text: ``slice(start=(0, 0), limit=(32, 8), ...)``."""
    names = {"slice": ("start", "limit", "strides"), "broadcast_in_dim": ("shape", "dims")}.get(c[0])
    if names and len(names) == len(c) - 1:
        return f"{c[0]}({', '.join(f'{n}={v}' for n, v in zip(names, c[1:]))})"
    return f"{c[0]}{tuple(c[1:])}"


def _weight_axes(site, invals, qtype):
    if site.op != "dot_general":
        return None
    return DenseAxes.of(site.eqn.params["dimension_numbers"], [jnp.ndim(v) for v in invals],
                        site.weight_operand, grouped=bool(qtype.group_size))


def _packed_shape(site, invals, packed):
    shape = tuple(invals[site.weight_operand].shape)
    layout = packed.layout
    if site.op == "gather":  # a table is read as is, or transposed when tied to a "kn" matmul
        return shape[::-1] if layout == "kn" else shape
    ax = _weight_axes(site, invals, packed.qtype) if layout != "operand" else None
    return shape if ax is None else ax.shape_2d(shape, layout)


def operand_params(site, i, x, q):
    """Scale and zero point of operand ``i`` (computed from ``x`` if dynamic), as stored:
    per group where the type has groups."""
    if q.qtype.dynamic:
        return nx.dynamic_params(x, site.contract[i], q.qtype)
    return q.scale, q.zero_point


def _expanded(site, i, shape, q, s, z):
    g = q.qtype.group_size
    if not g:
        return s, z
    ax = site.entry.groups(site)  # only a weight (or a table) has groups
    return groups.expand(s, g, ax, shape), groups.expand(z, g, ax, shape)


def expanded_params(site, i, shape, q):
    """Static scale and (rounded) zero point of operand ``i``, broadcastable to ``shape``
    (groups expanded; a zero zero point for symmetric types)."""
    s, z = _expanded(site, i, shape, q, q.scale, q.zero_point)
    z = jnp.zeros((), _F32) if z is None else jnp.round(z.astype(_F32))
    return s.astype(_F32), z


def dequantize_packed(packed, site, invals):
    """A packed weight back to float in the op's layout (the simulated path on packed
    weights): unpack, decode, subtract the zero point, scale."""
    v = packed.values
    ax = _nibble_axis(packed)
    if ax is not None:
        v = unpack_nibbles(v, ax)
    shape = invals[site.weight_operand].shape
    if site.op == "gather":
        v = v.T if packed.layout == "kn" else v
    elif packed.layout != "operand":
        v = _weight_axes(site, invals, packed.qtype).weight_from_2d(v, packed.layout, shape)
    # the zero point rounded, as pack and the integer path do
    gax = site.entry.groups(site) if packed.qtype.group_size else None
    return groups.dequantize(v, packed.scale, packed.zero_point, packed.qtype, gax)


def cache_write(site, eqn, invals, ctx):
    """A write into a key/value cache (both paths): the update quantized per vector into
    a quantized cache, or written as the cache would hold it into a float buffer
    (``kvcache.write``); unchanged when the qparams keep it float or have no entry
    (qparams saved before jqt quantized caches)."""
    e = ctx.state_in.get(site.key)
    qp = e[0] if isinstance(e, tuple) else e
    if not isinstance(qp, OpQParams) or qp.is_float:
        return compat.bind_eqn(eqn, kvcache.materialize(invals, eqn.invars))
    if qp.op != site.op:
        raise QParamsMismatchError(
            f"jqt: qparams['{site.key}'] describes a {qp.op}, but the function writes its cache "
            f"with {site.op} there. Re-calibrate for this function.")
    with compat.op_scope(site.key, cache=True):  # an error JAX raises differentiating it names the cache
        return kvcache.write(eqn, invals, site.entry.update_index, qp.lhs.qtype, zero=site.zero)


class Simulate:
    """Float simulation: fake-quantize the operands, run the float op."""

    collects = False
    differentiable = True

    @staticmethod
    def enter_cache(x, qtype):
        return kvcache.enter(x, qtype, simulate=True)

    def site(self, site, eqn, invals, ctx):
        if site.entry.is_cache:
            return cache_write(site, eqn, invals, ctx)
        if without_entry(site, ctx):
            return compat.bind_eqn(eqn, invals)
        qp, packed = lookup(ctx, site, invals)
        vals = list(invals)
        for i in (0, 1):
            q = qp.operand(i)
            if packed is not None and q is not None and i == site.weight_operand:
                vals[i] = nx.cast_finite(dequantize_packed(packed, site, invals), _sim_dtype(eqn, invals, i))
                continue
            if not qp.is_float:
                vals[i] = transformed(site, qp, i, vals[i])
            moved = vals[i] is not invals[i]  # smoothed or rotated
            if q is not None:
                x = live_only(site, i, invals, vals[i].astype(jnp.promote_types(vals[i].dtype, _F32)))
                s, z = _expanded(site, i, x.shape, q, *operand_params(site, i, x, q))
                vals[i] = nx.fake_quant(x, s, z, q.qtype)
            if vals[i] is not invals[i]:  # a transformed weight is float32
                vals[i] = nx.cast_finite(vals[i], (_transformed_dtype if moved else _sim_dtype)(eqn, invals, i))
        if invals[0].dtype == invals[1].dtype and vals[0].dtype != vals[1].dtype:
            # one operand widened to the output's dtype (weight-only, preferred_element_type):
            # the other with it, exactly, as a conv takes operands of one dtype only
            wide = jnp.promote_types(vals[0].dtype, vals[1].dtype)
            vals[:2] = [v.astype(wide) for v in vals[:2]]
        dtype = eqn.outvars[0].aval.dtype
        if qp.accumulator < accumulator.WIDEST and not qp.is_float:  # (a float op: no sums)
            # in float32, then cast: a float16 output that overflows saturates to a value
            # it may hold (the integer path's order)
            out = compat.bind_eqn(eqn, vals, preferred_element_type=_F32)[0]
            return [accumulator.saturate(out, exact_sums(site, eqn, qp, packed, invals),
                                         qp.accumulator).astype(dtype)]
        pet = eqn.params.get("preferred_element_type")
        wider = {"preferred_element_type": _F32} if pet is not None and jnp.dtype(pet).itemsize < \
            jnp.dtype(vals[0].dtype).itemsize else {}  # (a conv refuses a narrower one)
        out = compat.bind_eqn(eqn, vals, **wider)
        if out[0].dtype != dtype:  # float16 operands kept float32 where
            # transformed (a dot_general with no preferred_element_type returns float32)
            out = [out[0].astype(dtype)] + list(out[1:])
        return out


def live_only(site, i, invals, x):
    """Operand ``i`` as it is quantized: an activation's rows the op does not read (a
    ``ragged_dot``'s padding, ``live_rows``), which give 0 whatever they hold, zeroed on
    every path, so that they reach no scale (a dynamic per-tensor one), no code and no
    gradient (a NaN there, ``jnp.take``'s fill, gave LSQ's ``0 * NaN``)."""
    live = None if i == site.weight_operand else site.entry.live_rows(invals)
    if live is None:
        return x
    return jnp.where((jnp.arange(x.shape[0]) < live)[:, None], x, jnp.zeros_like(x))


def _transformed_dtype(eqn, invals, i):
    """:func:`_sim_dtype` for an operand smoothed or rotated: float32 where that is
    float16, whose 65504 the transformed values can pass (a rotation keeps a vector's
    length, not its largest element: 64 float16 inputs of 9000 rotate to one of 72000);
    the other operand is widened with it, and the output cast back to float16."""
    d = _sim_dtype(eqn, invals, i)
    return _F32 if d == jnp.float16 else d


def _sim_dtype(eqn, invals, i):
    """The dtype operand ``i`` of a simulated op takes once fake-quantized: its own where
    both operands are floats of one dtype that the output is not wider than (the op
    computes in it); otherwise (an integer operand, mixed dtypes that the op promotes, e.g.
    int32 counts or a bfloat16 weight with float32 activations, or bfloat16 operands with
    ``preferred_element_type=float32``) the op's float output dtype, or float32 (no float
    output; or 16-bit operands into the other 16-bit float, which holds neither), so that
    the quantized values are not rounded to the operand's own integer or narrow type.

    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4))).eqns[-1]
    >>> [str(_sim_dtype(eqn, [jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4))], i)) for i in (0, 1)]
    ['float32', 'float32']
    """
    a, b = (v.dtype for v in invals[:2])
    out = eqn.outvars[0].aval.dtype
    if a == b and jnp.issubdtype(a, jnp.floating) and \
            not (jnp.issubdtype(out, jnp.floating) and jnp.dtype(out).itemsize >= jnp.dtype(a).itemsize
                 and out != a):
        return invals[i].dtype
    if a == b and jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(out, jnp.floating) \
            and jnp.dtype(out).itemsize == jnp.dtype(a).itemsize:
        return jnp.dtype(_F32)  # bfloat16 operands, a float16 output (or the reverse)
    return out if jnp.issubdtype(out, jnp.floating) else _F32


def exact_sums(site, eqn, qp, packed, invals):
    """Each output's exact sum of code products ``sum (qa - za)(qb - zb)`` (float32), for
    an op with a narrow accumulator (``accumulator.py``): the operands quantized as the
    op quantizes them (the packed weight's own codes), then the op run on the codes.
    The same on the simulated and the integer path; no gradient flows through it."""
    qp, packed, invals = jax.tree_util.tree_map(jax.lax.stop_gradient, (qp, packed, list(invals)))
    codes = []
    for i in (0, 1):
        q = qp.operand(i)
        if packed is not None and i == site.weight_operand:
            s, _ = _expanded(site, i, invals[i].shape, packed, packed.scale, packed.zero_point)
            codes.append(jnp.round(dequantize_packed(packed, site, invals) / s.astype(_F32)))
            continue
        x = live_only(site, i, invals, transformed(site, qp, i, invals[i]))
        s, z = _expanded(site, i, x.shape, q, *operand_params(site, i, x, q))
        c = nx.quantize(x, s, z, q.qtype).astype(_F32)
        codes.append(c if z is None else c - jnp.round(z.astype(_F32)))
    return accumulator.exact_sums(eqn, codes + list(invals[2:]))


def _codes(site, x, scale, zero_point, qtype, activation=False):
    """``x``'s integer codes for op ``site`` (``activation``: its activation's); under
    ``jax.grad`` the error names the op (from the equation's name scope: the derivative is
    asked for when JAX differentiates the jaxpr, under ``jax.jit`` or a scan long after the
    op was traced)."""
    with compat.op_scope(site.key, activation=activation):
        return nx.quantize(x, scale, zero_point, qtype)


def conv_products(eqn) -> int:
    """The products of codes each output of a ``conv_general_dilated`` sums: its kernel's
    elements per output feature (a group's input features times the window)."""
    shape = eqn.invars[1].aval.shape
    return math.prod(shape) // shape[eqn.params["dimension_numbers"].rhs_spec[0]]


def _check_accumulator(site, eqn, ops, wide):
    """Refuses an integer convolution (or a group of a grouped weight) whose int32
    accumulator could overflow: a contraction longer than :func:`dense.safe_k` allows.
    (A ``dot_general`` splits its contraction instead, ``dense.int_dense``.)"""
    ints = [isinstance(o, QArray) and o.qtype.kind == "int" for o in ops]
    if not all(ints):
        return  # weight-only or fp8: float accumulation
    zp = [wide == i or ops[i].zero_point is not None for i in (0, 1)]
    # int16 codes run as two int8 kernels; narrower ones in their own range (int4: |q| <= 8)
    t = [np.int8 if wide == i or ops[i].qtype.bits > 8 else ops[i].qtype for i in (0, 1)]
    kc = dense.safe_k(t[0], zp[0], t[1], zp[1])
    if site.op == "conv_general_dilated":
        k, what = conv_products(eqn), "convolution sums"
    else:
        w = site.weight_operand
        k = ops[w].qtype.group_size if w is not None else 0
        what = "group of the weight sums"
    if k > kc:
        smaller = ("fewer input channels per group (feature_group_count) or a smaller kernel"
                   if site.op == "conv_general_dilated" else "a smaller group size")
        raise ValueError(
            f"jqt.quantize: op '{site.key}': each {what} {k} products of codes, more than "
            f"the {kc} whose worst case fits its int32 accumulator (it could overflow). "
            "Quantize this op weight-only or keep it float (a recipe rule), use "
            f"{smaller}, or run it with simulate=True.")


class Integer:
    """Integer path: quantize operands to codes, run the entry's kernel in the
    formulation ``policy`` picks (default: the table's, for the backend in use
    when the function is traced)."""

    collects = False
    differentiable = False
    returns_caches = True  # a quantized cache f takes and returns comes back quantized

    def __init__(self, policy=None):
        self.policy = policy

    def enter_cache(self, x, qtype):
        return kvcache.enter(x, qtype, simulate=False, fp8_bits=kvcache.fp8_as_bits(self.policy))

    @staticmethod
    def split_stacked(entry):
        """``(sliced, kept)`` of an op's state under a scan over stacked layers: the
        qparams travel as the scan's ``xs``; the packed weight is kept whole, a
        :class:`LayerView` the body indexes (the native kernels read it in place)."""
        qp, packed = entry
        if isinstance(packed, QArray) and packed.values is not None:
            return (qp, None), LayerView(packed, ())
        if isinstance(packed, LayerView):
            return (qp, None), packed
        return entry, None

    @staticmethod
    def join_stacked(sliced, kept, i):
        """The body's state from :meth:`split_stacked`'s parts at layer ``i``."""
        return sliced if kept is None else (sliced[0], kept.at(i))

    def site(self, site, eqn, invals, ctx):
        if site.entry.is_cache:
            return cache_write(site, eqn, invals, ctx)
        if any(kvcache.is_cache(v) for v in invals):  # attention reading a quantized cache
            e = ctx.state_in.get(site.key)
            if site.op == "dot_general" and site.weight_operand is None and e is not None \
                    and e[0].is_float:
                return kvcache.dot_general(eqn, invals)
            invals = kvcache.materialize(invals, eqn.invars)
        if without_entry(site, ctx):
            return compat.bind_eqn(eqn, invals)
        qp, packed = lookup(ctx, site, invals)
        if qp.is_float:
            return compat.bind_eqn(eqn, invals)
        view = ctx.state_in[site.key][1]  # a LayerView where the entry's kernel reads one
        view = view if isinstance(view, LayerView) and site.entry.reads_layer_views else None
        ops, wide = list(invals), None
        for i in (0, 1):
            q = qp.operand(i)
            if packed is not None and q is not None and i == site.weight_operand:
                ops[i] = view or packed
                continue
            x = ops[i] = transformed(site, qp, i, invals[i])
            if q is None:  # a transformed weight is float32, an integer activation too
                ops[i] = x if x is invals[i] else x.astype(_transformed_dtype(eqn, invals, i))
                continue
            x = live_only(site, i, invals, x)
            s, z = operand_params(site, i, x, q)
            se, ze = _expanded(site, i, x.shape, q, s, z)
            ops[i] = QArray(values=_codes(site, x, se, ze, q.qtype, "act_x_act" if site.weight_operand
                                          is None else i != site.weight_operand),
                            scale=s, zero_point=z, qtype=q.qtype)
            if q.qtype.kind == "int" and q.qtype.bits > 8:
                wide = i
        _check_accumulator(site, eqn, ops, wide)
        policy = self.policy or KernelPolicy.for_backend()
        integer = functools.partial(_integer_typed, eqn.outvars[0].aval)
        if wide is None and qp.accumulator < accumulator.WIDEST:  # in float32, then cast
            e32 = compat.with_output_dtype(eqn, _F32)
            out = _integer_typed(e32.outvars[0].aval, site, e32, ops, policy)[0]
            return [accumulator.saturate(out, exact_sums(site, eqn, qp, packed, invals),
                                         qp.accumulator).astype(eqn.outvars[0].aval.dtype)]
        if wide is None or site.entry.takes_wide(site, eqn, ops, policy):
            # (a dense weight or a convolution: the int16 codes whole, kernels.takes_wide)
            return integer(site, eqn, ops, policy)
        # int16 activation (symmetric): its int8 halves, two int8 kernels, both in float32
        # and cast once (dense.int16_halves)
        ops_hi, ops_lo = list(ops), list(ops)
        ops_hi[wide], ops_lo[wide] = dense.int16_halves(ops[wide])
        e32 = compat.with_output_dtype(eqn, _F32)
        half = lambda o: _integer_typed(e32.outvars[0].aval, site, e32, o, policy)[0]
        out = 256.0 * half(ops_hi) + half(ops_lo)
        return [out.astype(eqn.outvars[0].aval.dtype)]


def _integer_typed(out_aval, site, eqn, ops, policy):
    """The op's integer kernel on ``ops``, its result typed as the float op's ``out_aval``
    on explicit mesh axes (:func:`compat.as_typed`); a :class:`LayerView` operand travels
    as its arrays."""
    views = [isinstance(o, LayerView) for o in ops]
    parts = [(o.full, o.index) if v else o for o, v in zip(ops, views)]

    def kernel(parts):
        ops = [LayerView(*p) if v else p for p, v in zip(parts, views)]
        return site.entry.integer(site, eqn, ops, policy)[0]
    try:
        return [compat.as_typed(kernel, out_aval, parts)]
    except compat.UntypedReshape as e:
        raise ValueError(str(e).replace("jqt: a quantized op", f"jqt: op '{site.key}' ({site.op} "
                                        f"at '{site.name_stack or '<top>'}')", 1)) from e
