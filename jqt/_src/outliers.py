"""Deciding the outlier transforms of each op: SmoothQuant, AWQ and rotation.

After a first calibration pass (which records per-input-channel statistics of
each op's activation, ``transforms.channel_stats``), :func:`decide` computes
each op's smoothing vector from those statistics and its weight:

* SmoothQuant (Xiao et al. 2023): ``s_j = max|x_j|**alpha / max|w_j|**(1 - alpha)``.
* AWQ (Lin et al. 2024): ``s = mean|x|**a`` (normalized), with ``a`` on a grid of
  20 values in ``[0, 1)`` chosen to minimize the op's output error with the
  transformed weight quantized as the rule says. The error of a weight error
  ``D`` on the calibration inputs ``X`` is ``tr(D^T X^T X D)``, computed from the
  streaming statistic ``X^T X`` (no activations are kept).

A second pass then calibrates every range on the transformed operands.
"""
from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, diagnostics, groups, handlers, transforms
from . import numerics as nx
from .layout import apply_chain
from .qparams import OpQParams
from .stats import CHAN_MERGE

AWQ_GRID = 20
"""AWQ's search grid: exponents ``a = i / AWQ_GRID`` for ``i < AWQ_GRID``, as in the paper's code."""

AWQ_FEW_ROWS_DAMP = 0.1
"""AWQ's search on ``n`` calibration rows of ``K`` inputs (``n < K``: ``X^T X`` singular)
adds ``AWQ_FEW_ROWS_DAMP * (1 - n/K)`` of ``X^T X``'s mean diagonal to it (nothing from
``K`` rows on)."""


def wants(rule) -> bool:
    """Whether ``rule`` asks for an outlier transform."""
    return rule is not None and (rule.smooth is not None or rule.awq or rule.rotate)


def weight_operand(site, params_t, argnums):
    """The weight operand of ``site`` from the weights (stacked layers keep their
    leading axes), or ``None`` when it is not a leaf of them."""
    src = site.source
    if src is None or src.arg not in argnums:
        return None
    leaves = jax.tree_util.tree_leaves(params_t[list(argnums).index(src.arg)])
    if not 0 <= src.leaf < len(leaves):
        return None
    return apply_chain(jnp.asarray(leaves[src.leaf]), src.chain).astype(jnp.float32)


def _vmapped(fn, depth):
    for _ in range(depth):
        fn = jax.vmap(fn)
    return fn


def smoothquant(act_absmax, w, contract, alpha, depth=0):
    """SmoothQuant's factor per input channel, in the weight's layout (keepdims).

    >>> import jax.numpy as jnp
    >>> from jqt._src.outliers import smoothquant
    >>> smoothquant(jnp.array([[4.0], [1.0]]), jnp.array([[1.0, 0.5], [1.0, 1.0]]), (0,), 0.5).ravel()
    Array([2., 1.], dtype=float32)
    """
    axes = tuple(d + depth for d in range(w.ndim - depth) if d not in contract)
    wmax = jnp.max(jnp.abs(w), axis=axes, keepdims=True)
    # a channel 0 in every calibration batch (a one-hot row no batch chose) takes the
    # largest range of the channels with weights: left at 1, its values later met the range
    # the smoothed channels set and were clipped there (plain per-tensor ranges cover it).
    # A pruned channel's range (its weight row 0) is not borrowed: it may be the outlier
    dead = wmax == 0
    layer = tuple(range(depth, act_absmax.ndim))
    fill = jnp.max(jnp.where(dead, 0.0, act_absmax), axis=layer, keepdims=True)
    fill = jnp.where(fill > 0, fill, jnp.max(act_absmax, axis=layer, keepdims=True))
    act_absmax = jnp.where(act_absmax > 0, act_absmax, fill)
    ok = (act_absmax > 0) & (wmax > 0)
    s = jnp.where(ok, act_absmax ** alpha / jnp.where(ok, wmax, 1.0) ** (1 - alpha), 1.0)
    s = jnp.clip(s, 1e-5, 1e5)
    # a pruned channel (weight row 0) adds nothing to the output at any factor (0 * s = 0):
    # divided down to 1/256 of the loudest live smoothed channel, so that it never sets the
    # range (an asymmetric one included). Left at 1, its full range set the per-tensor
    # activation range and the live channels, divided by their factors, rounded towards 0
    # (worse than no smoothing; all of the output lost where the outlier sat on it)
    loud = jnp.max(jnp.where(dead, 0.0, act_absmax / s), axis=layer, keepdims=True) / 256
    down = jnp.where(loud > 0, act_absmax / jnp.where(loud > 0, loud, 1.0), 1.0)
    s = jnp.where(dead, jnp.maximum(down, 1.0), s)
    return jnp.clip(s, 1e-5, 1e5).astype(jnp.float32)


def quantized_weight(w, contract, qtype, calibrator, gaxis):
    """``w`` fake-quantized as a rule quantizes a weight: ranges from ``calibrator``, per
    channel or per group along ``gaxis``."""
    lo, hi = groups.weight_range(calibrator, w, contract if qtype.per_channel else None, qtype, gaxis)
    s, z = nx.params_from_range(lo, hi, qtype)
    g = qtype.group_size
    if g:
        s, z = groups.expand(s, g, gaxis, w.shape), groups.expand(z, g, gaxis, w.shape)
    return nx.fake_quant(w, s, z, qtype)


def rotated_hessian(h, rotated):
    """``R^T H R`` for the rotation ``R`` of ``H``'s inputs (``H`` unchanged without one)."""
    if not rotated:
        return h
    return transforms.rotate(transforms.rotate(h, (1,)).T, (1,))


def members(shape, contract) -> int:
    """How many stacked matrices a weight may hold: the product of its free axes ahead of
    its contracted ones, where free axes follow them too (``(E, K, N)``: an ensemble under
    ``jax.vmap(member, in_axes=(0, None))``, ``einsum("bk,ekn->ebn")``, flax ``nn.vmap``;
    or one layer's heads laid out first, ``(N, D, H)``, which the jaxpr cannot tell from
    them); else 1.

    >>> members((3, 16, 8), (1,)), members((16, 8), (0,)), members((8, 16), (1,))
    (3, 1, 1)
    """
    first, last = min(contract), max(contract)
    lead = [n for d, n in enumerate(shape) if d < first]
    return math.prod(lead) if lead and any(d > last for d in range(len(shape))) else 1


# bounded: keyed by the calibrator, which a user's class may hash by identity (a new one
# each call kept its compiled program and the arrays it holds alive for ever)
@functools.lru_cache(maxsize=64)
def _awq_search(contract, qtype, calibrator, gaxis, rotated):
    """A jitted ``(w, hessian, mean_abs) -> s`` for one layer."""

    def one(w, h, mean_abs, damp):
        # a channel 0 in every calibration batch weighs as the quietest one seen: at its
        # floor of 1e-4, its weight scaled by that rounded to code 0, the channel's input
        # lost at run time (its error costs nothing on the calibration data)
        seen = mean_abs > 0
        quietest = jnp.min(jnp.where(seen, mean_abs, jnp.inf))
        mean_abs = jnp.where(seen, mean_abs, jnp.where(jnp.isfinite(quietest), quietest, 1.0))

        # fewer calibration rows than inputs: X^T X is singular, and the directions the
        # rows do not span cost nothing, so the search can fit those rows and lose on
        # others; ``damp`` (a fraction of the mean diagonal) weighs them a little
        # (the mean as a sum of diag / K: a sum of the diagonal can pass float32's range
        # where every entry is finite, and 0 * inf is NaN)
        mean_diag = jnp.sum(jnp.diagonal(h) / h.shape[-1])
        h = h + jnp.where(damp > 0, damp * mean_diag, 0.0) * jnp.eye(h.shape[-1], dtype=h.dtype)

        def err(a):
            s = jnp.maximum(mean_abs ** a, 1e-4)
            s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
            w2 = transforms.weight(w, s, rotated, contract)
            d = transforms.rows(quantized_weight(w2, contract, qtype, calibrator, gaxis) - w2, contract)
            sv = transforms.rows(s, contract)  # (1, K) in pair order
            hs = rotated_hessian(h / sv / sv.T, rotated)
            return jnp.sum((d @ hs) * d), s

        errs, ss = jax.lax.map(err, jnp.arange(AWQ_GRID, dtype=jnp.float32) / AWQ_GRID)
        # a NaN error (X^T X overflowed float32) is no minimum: none finite, a = 0 (s = 1)
        return ss[jnp.argmin(jnp.where(jnp.isnan(errs), jnp.inf, errs))]

    return jax.jit(one)


def _not_finite(a) -> bool:
    """Whether concrete statistics ``a`` hold NaN or inf (traced ones cannot be read)."""
    return not compat.is_tracer(a) and not np.isfinite(np.asarray(a)).all()


def _warn_not_finite(site, algo):
    diagnostics.warn(
        f"jqt.calibrate: op '{site.key}': its activation held NaN or inf on the calibration "
        f"data, so {algo} has no finite statistics to weigh its channels by: the op keeps s = 1 "
        "(plain rounding). Where the batches were finite, f made them (an exp that "
        "overflowed, a log of 0?): make f finite on them, or keep the op float with a rule "
        f"ahead of the others, jqt.Rule(key='^{re.escape(site.key)}$', weight=None).")


def _awq(site, rule, wt, w, chan, depth, rotate):
    gaxis = site.entry.groups(site) if wt.group_size else None
    fn = _awq_search(tuple(site.contract[site.weight_operand]), wt, rule.weight_calibrator, gaxis,
                     rotate)
    count = chan["count"]
    mean_abs = chan["abssum"] / count.reshape(count.shape + (1,) * (chan["abssum"].ndim - count.ndim))
    h = chan["hessian"]
    if _not_finite(chan["abssum"]):  # the activation itself: no overflow of X^T X to blame
        _warn_not_finite(site, "AWQ")
        return None
    if _not_finite(h):
        diagnostics.warn(f"jqt.calibrate: op '{site.key}': AWQ's X^T X of its activation "
                         "overflows float32 (activations beyond about 1e19): its search scores "
                         "no scale, and the op keeps s = 1 (plain rounding). Scale the inputs "
                         "down, or calibrate it without awq (a Rule for its key).")
    k = h.shape[-1]
    damp = AWQ_FEW_ROWS_DAMP * jnp.maximum(0.0, 1.0 - jnp.asarray(count, jnp.float32) / k)
    with groups.naming(f"op '{site.key}' (weight "
                       f"'{site.source.path if site.source else '(computed)'}', AWQ's search)"):
        return _vmapped(fn, depth)(w, h, mean_abs, damp)


def decide(traced, recipe, stats, params_t, argnums, weight_qtype):
    """Op key -> the op's transforms (an :class:`jqt.OpQParams` holding only ``smooth``
    and ``rotate``), for every op whose rule asks for one and can take it."""
    out, skipped, no_leaf, unrotated, large, unreached = {}, [], [], [], [], []
    for site in traced.sites():
        rule = recipe.rule_for(site.op, site.key)
        if not wants(rule) or site.weight_operand is None or site.entry.weight_type(rule) is None \
                or site.built or handlers.kept_as_is([v.aval.dtype for v in site.eqn.invars[:2]]):
            continue  # kept float (calibrate._decide)
        if not transforms.applies(site):
            what = {"conv_general_dilated": "a convolution", "gather": "a lookup",
                    "ragged_dot_general": "a ragged dot"}.get(site.op, "a dot with batch axes: a weight "
                                                     "batched by jax.vmap, experts stacked in an einsum")
            skipped.append(f"{site.key} ({what})")
            continue
        rotate = bool(rule.rotate)
        if rotate:
            n = _contract_size(site)
            block, fs = transforms.factors(n)
            m = max((f for f in fs if f & (f - 1)), default=0)  # the Paley factor, if any
            if block == 1:
                unrotated.append(f"{site.key} ({n})")
                rotate = False
            elif m > transforms.LARGE_FACTOR:
                large.append(f"{site.key} ({n} = {m} x {n // m})")
        st = stats.get(site.key)
        smooth = None
        if (rule.smooth is not None or rule.awq) and st is not None and st.chan is not None:
            w = weight_operand(site, params_t, argnums)
            depth = site.source.stack_depth if site.source is not None else 0
            chan = pooled_where_unseen(st.chan, depth)
            never = st.weight is not None and bool(np.all(np.asarray(st.weight["min"]) == np.inf))
            if never:  # no batch reached it: quantized from its weight alone, untransformed
                unreached.append(site.key)
            elif "count" in chan and not np.asarray(chan["count"]).any():
                pass  # no rows ever (a slice of none): nothing to weigh the channels by
            elif w is None:
                no_leaf.append(site.key)
            elif rule.awq:
                wt = weight_qtype(site, site.entry.weight_type(rule), w.shape[depth:])
                smooth = _awq(site, rule, wt, w, chan, depth, rotate)
            elif _not_finite(chan["absmax"]):  # (static ranges refuse it by name after)
                _warn_not_finite(site, "SmoothQuant")
            else:
                smooth = smoothquant(chan["absmax"], w, site.contract[site.weight_operand],
                                     float(rule.smooth), depth)
        if smooth is None and not rotate:
            continue
        out[site.key] = OpQParams(lhs=None, rhs=None, op=site.op, weight_operand=site.weight_operand,
                                  source=site.source, smooth=smooth, rotate=rotate)
    if unreached:
        diagnostics.warn(
            f"jqt.calibrate: no calibration batch reached ops {unreached[:5]}"
            f"{' ...' if len(unreached) > 5 else ''} (a lax.cond branch not taken, a loop of 0 "
            "iterations?), so there are no activation statistics to weigh their channels by: "
            "they are quantized without smooth=/awq= (rotate= needs no data), from their "
            "weights alone where their activations need no range, else kept float. Add "
            "calibration data that reaches them.")
    if skipped:
        diagnostics.warn(f"jqt.calibrate: smooth/awq/rotate apply to dense ops only (a dot_general "
                         f"with a weight and no batch axes), so these are quantized without them: "
                         f"{'; '.join(skipped[:5])}{' ...' if len(skipped) > 5 else ''}.")
    if no_leaf:
        diagnostics.warn(f"jqt.calibrate: ops {no_leaf[:5]}{' ...' if len(no_leaf) > 5 else ''} read "
                         "weights that are not a leaf of the weights reached by layout ops only "
                         "(computed: arithmetic such as p['w'] * 2.0, jnp.pad, a sum of leaves, a constant); their "
                         "smoothing factor is folded into a stored weight, so they are not smoothed "
                         "(nor packed). Store the weight as the op reads it in the params to smooth it.")
    if unrotated:
        diagnostics.warn(f"jqt.calibrate: ops {unrotated[:5]}{' ...' if len(unrotated) > 5 else ''} "
                         "contract an odd number of inputs (in brackets), which has no Hadamard "
                         "rotation (docs/outliers.md, 'Rotation sizes'), so they are quantized "
                         "without it. Pad the contracted axis to a multiple of a power of two (32, "
                         "say), or give these ops a rule without rotate=True.")
    if large:
        diagnostics.warn(f"jqt.calibrate: ops {large[:5]}{' ...' if len(large) > 5 else ''} contract "
                         "a number of inputs whose only Hadamard factor other than powers of two is "
                         "large (in brackets; docs/outliers.md, 'Rotation sizes'): the rotation of "
                         "each activation row takes that many products per input, which can cost "
                         "more than the op's matmul. They are rotated; to skip it, give these ops a "
                         "rule without rotate=True.")
    return out


def pooled_where_unseen(chan, depth):
    """Per-layer channel statistics (``depth`` stacked axes) where some layers saw no rows
    (a cond on the layer index; an expert no token reached) -> those layers given the
    statistics of the others pooled (``stats.CHAN_MERGE``): their smoothing factor then
    matches the activation range they take from the others (``calibrate``), where it was
    1 (AWQ: NaN, from a mean over no rows) against the others' smoothed range.

    >>> import numpy as np
    >>> c = pooled_where_unseen({"absmax": np.array([[2.0, 1.0], [0.0, 0.0], [1.0, 3.0]])}, 1)
    >>> c["absmax"].tolist()
    [[2.0, 1.0], [2.0, 3.0], [1.0, 3.0]]
    """
    if not depth:
        return chan
    some = np.asarray(chan["count"] if "count" in chan else chan["absmax"])
    seen = some.reshape(some.shape[:depth] + (-1,)).max(-1) > 0
    if seen.all() or not seen.any():
        return chan
    out = {}
    for k, v in chan.items():
        v = np.asarray(v)
        flat, ok = v.reshape((-1,) + v.shape[depth:]), seen.reshape(-1)
        pooled = functools.reduce(CHAN_MERGE[k], list(flat[ok]))
        ok = ok.reshape((-1,) + (1,) * (flat.ndim - 1))
        out[k] = jnp.asarray(np.where(ok, flat, np.asarray(pooled)[None]).reshape(v.shape))
    return out


def _contract_size(site) -> int:
    """How many inputs the op's weight contracts: the size a rotation would mix."""
    shape = site.eqn.invars[site.weight_operand].aval.shape
    return math.prod(shape[d] for d in site.contract[site.weight_operand])
