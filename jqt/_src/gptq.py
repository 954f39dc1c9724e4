"""``jqt.gptq``: re-round quantized weights with GPTQ (Frantar et al. 2023).

GPTQ quantizes a weight ``W`` (``K`` inputs x ``N`` outputs) one input row at a
time and spreads each row's rounding error over the rows not yet quantized,
weighted by the inverse Hessian ``H^-1`` of the layer's squared output error,
``H = X^T X`` over the calibration inputs ``X``. The grid (scales and zero points,
per channel or per group) is the one in ``qparams``: GPTQ only picks, for every
weight, which point of that grid it gets, so :func:`jqt.pack` of the result is
lossless.

The ops run in evaluation order: op ``j``'s Hessian is measured with every op
before it already quantized (simulated, with its re-rounded weights), so that
it corrects the error that reaches it. Ops next to each other that read the
same input (query, key and value projections) share one pass. ``X^T X`` is a fixed-size statistic,
summed over batches, loop iterations and (stacked) layers' own slices.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat, diagnostics, groups, ragged, tracing, transforms, validate, weightcheck
from . import numerics as nx
from .calibrate import (CalibrationDataError, check_batch, check_batches, each_batch, full_args,
                        note_batch_error)
from .dense import DenseAxes
from .handlers import Simulate, transformed, without_entry
from .interpreter import Ctx
from .layout import apply_chain
from .tracing import Tracer, normalize_argnums
from .validate import check_qparams

_F32 = jnp.float32
_RAGGED = "ragged_dot_general"  # lax.ragged_dot in its plain form (registry.RaggedDot)
_INVERTIBLE = {"transpose", "reshape", "convert", "squeeze", "rev", "copy", "scan_slice", "slice",
               "shard_split"}  # shard_split: the blocks of a jax.shard_map, each with its Hessian


class _Hessians:
    """Handler: ops whose ``on`` flag is set run simulated, the others float; the op
    whose ``take`` flag is set records ``X^T X`` of its (transformed) activation."""

    collects = True
    differentiable = False

    def __init__(self, eligible):
        self.eligible = eligible

    def site(self, site, eqn, invals, ctx):
        if without_entry(site, ctx):
            return compat.bind_eqn(eqn, invals)
        qp, on, take = ctx.state_in[site.key]
        outs = compat.bind_eqn(eqn, invals)
        if not qp.is_float:
            sim = Simulate().site(site, eqn, invals, Ctx(None, {site.key: (qp, None)}))
            outs = [jnp.where(on > 0, s, o) for s, o in zip(sim, outs)]
        if site.key in self.eligible and site.op == _RAGGED:
            self._ragged(site, invals, take, ctx)
        elif site.key in self.eligible:
            w = site.weight_operand
            x = transformed(site, qp, 1 - w, invals[1 - w]).astype(_F32)
            xb = site.eqn.params["dimension_numbers"][1][1 - w]  # paired with the weight's
            lead = tuple(x.shape[d] for d in xb)
            rest = [d for d in range(x.ndim) if d not in xb]
            x = jnp.transpose(x, tuple(xb) + tuple(rest))  # batch axes first: one H each
            xc = tuple(rest.index(d) + len(xb) for d in site.contract[1 - w])
            r = transforms.rows(x, xc).reshape(lead + (-1, math.prod(x.shape[d] for d in xc)))
            k = r.shape[-1]
            gram = lambda: jnp.einsum("...mk,...ml->...kl", r, r, out_sharding=compat.replicated_if_split(r))
            # inside jax.shard_map the zeros vary over the mesh axes the Gram matrix does
            h = lax.cond(take > 0, gram, lambda: compat.vary_like(
                jnp.zeros(lead + (k, k), _F32), jax.eval_shape(gram)))
            ctx.put(site.key, {"h": h, "n": jnp.where(take > 0, r.shape[-2], 0).astype(_F32)})
        return outs

    @staticmethod
    def _ragged(site, invals, take, ctx):
        """``lax.ragged_dot(x, w, sizes)``: one Hessian per expert, from the rows routed to it
        (rows past ``sum(sizes)`` reach none)."""
        x, w, sizes = invals[0].astype(_F32), invals[1], invals[2]
        g, live = ragged.row_groups(sizes, x.shape[0])
        x = jnp.where(live[:, None], x, 0.0)  # a NaN or inf padding row: 0 * NaN is NaN
        member = (g[:, None] == jnp.arange(w.shape[0])[None, :]) & live[:, None]  # (M, G)
        gram = lambda: jnp.einsum("mg,mk,ml->gkl", member.astype(_F32), x, x)
        k = x.shape[1]
        h = lax.cond(take > 0, gram, lambda: compat.vary_like(
            jnp.zeros((w.shape[0], k, k), _F32), jax.eval_shape(gram)))
        # the rows each expert gets (padding none)
        ctx.put(site.key, {"h": h, "n": jnp.where(take > 0, jnp.sum(member, axis=0), 0).astype(_F32)})

    @staticmethod
    def identity(shapes):
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    @staticmethod
    def merge(a, b):
        return jax.tree_util.tree_map(jnp.add, a, b)

    @staticmethod
    def reduce_iterations(stacked):
        return jax.tree_util.tree_map(lambda v: jnp.sum(v, axis=0), stacked)


def _why_not(site, qp, traced, argnums, leaf_shape=None):
    """Why GPTQ leaves op ``site`` with plain rounding, or ``None`` when it re-rounds it
    (``leaf_shape``: its weight leaf's, to tell ops reading other parts of it)."""
    w = site.weight_operand
    if qp.is_float or w is None or qp.operand(w) is None or site.op == "gather":
        return "n/a"  # float, or a lookup (no products to correct): nothing to say
    if site.op not in ("dot_general", _RAGGED):
        return f"not a dense op (a {site.op})"
    src = site.source
    if src is None or src.arg not in argnums:
        return ("its weight is not a leaf of the weights reached by layout ops only (it is "
                "computed: arithmetic such as p['w'] * 2, jnp.pad, a slice at a start "
                "computed from the data, a row picked by jnp.take at a constant, several "
                "leaves; or a constant): store it as the op reads it")
    if any(c[0] not in _INVERTIBLE for c in src.chain):
        return f"its weight is computed from the leaf by {[c[0] for c in src.chain]}"
    uses = traced.analyzer.leaf_uses.get((src.arg, src.leaf), set())
    if uses != {site.key}:
        ops = sorted(uses - {site.key, "float"})
        if "float" not in uses and leaf_shape is not None and _apart(site, ops, traced, leaf_shape):
            return None  # other ops read other parts of the leaf (a fused QKV weight's slices)
        return (f"its weight leaf '{src.path}' is also read "
                + (f"by ops {ops} (tied or reused weights, reading the same elements" if ops else
                   "as a float value (by an op that stays float, or returned by f")
                + ": re-rounding it would change what they read)")
    return None


def _apart(site, others, traced, leaf_shape) -> bool:
    """Whether the ops ``others`` read elements of ``site``'s weight leaf that it does not
    (slices of one leaf: ``w[:, :d]``, ``w[:, d:]``, a Python loop's ``w[i]``)."""
    srcs = {s.key: s.source for s in traced.sites() if s.key in others}
    if set(srcs) != set(others) or any(c is None or any(step[0] not in _INVERTIBLE for step in c.chain)
                                       for c in srcs.values()):
        return False
    if not all(any(step[0] == "slice" for step in c.chain) for c in (site.source, *srcs.values())):
        return False  # an op that reads the whole leaf (a tied table's lookup): no index arrays
    size = int(np.prod(leaf_shape, dtype=np.int64))
    if size > np.iinfo(np.int32).max:  # (indices in int32, as JAX holds them by default)
        return False
    idx = jnp.arange(size, dtype=jnp.int32).reshape(leaf_shape)

    def read(src):  # the flat indices of the leaf's elements an op reads
        mask = np.zeros(size, bool)
        mask[np.ravel(np.asarray(apply_chain(idx, _values_chain(src.chain))))] = True
        return mask
    mine = read(site.source)
    return not any(np.any(mine & read(src)) for src in srcs.values())


def _values_chain(chain):
    """The chain without its casts: the same elements, in float32 (or the index type)."""
    return tuple(c for c in chain if c[0] != "convert")


def quantize_rows(w, s, z, qtype):
    """``w`` rounded onto the grid of scale ``s`` and zero point ``z`` (float values)."""
    return nx.fake_quant(w, s, z, qtype)


def _inverse_hessian_chol(h, damp, act_order):
    """NumPy float64: (permutation, upper Cholesky factor of the damped ``H^-1``), as in the
    reference code, but for dead inputs (``H_ii = 0``): the reference sets their ``H_ii`` to 1
    before the damping (``damp`` times the mean of the diagonal), so with small activations
    (``H_ii`` of 1e-4) a few dead inputs made the damping swamp the Hessian and GPTQ round
    as plainly; they get the live inputs' mean instead, which leaves the damping, and the
    result, independent of the activations' scale. (Dead inputs couple with nothing: their
    weights round plainly either way.)"""
    h = np.array(h, np.float64)
    dead = np.diag(h) == 0
    live = np.diag(h)[~dead]
    h[dead, dead] = float(np.mean(live)) if live.size else 1.0
    perm = np.argsort(-np.diag(h), kind="stable") if act_order else np.arange(h.shape[0])
    h = h[perm][:, perm]
    h[np.diag_indices_from(h)] += damp * np.mean(np.diag(h))
    hinv = np.linalg.inv(np.linalg.cholesky(h))
    hinv = hinv.T @ hinv  # H^-1 from its Cholesky factor
    u = np.linalg.cholesky(hinv).T  # upper: H^-1 = U^T U
    return perm, u


@functools.lru_cache(maxsize=None)
def _gptq_blocks(qtype, block):
    """A jitted ``(W, S, Z, U, M) -> Q`` over (permuted) rows of ``W`` (``K x N``): GPTQ's
    lazy-batch loop, ``block`` rows at a time; elements where ``M`` is set are rounded to 0
    (pruned zeros kept, as SparseGPT keeps its mask), their error spread as any other's."""

    def run(w, s, z, u, m):
        k = w.shape[0]
        q = jnp.zeros_like(w)
        for b0 in range(0, k, block):
            b1 = min(b0 + block, k)
            ub = u[b0:b1, b0:b1]
            idx = jnp.arange(b1 - b0)

            def col(i, c, ub=ub, idx=idx, b0=b0):
                wb, qb, eb = c
                row = wb[i]
                qi = jnp.where(m[b0 + i], 0.0, quantize_rows(row, s[b0 + i], z[b0 + i], qtype))
                err = (row - qi) / ub[i, i]
                wb = wb - jnp.outer(jnp.where(idx > i, ub[i], 0.0), err)
                return wb, qb.at[i].set(qi), eb.at[i].set(err)

            zeros = jnp.zeros((b1 - b0, w.shape[1]), w.dtype)
            _, qb, eb = lax.fori_loop(0, b1 - b0, col, (w[b0:b1], zeros, zeros))
            q = q.at[b0:b1].set(qb)
            if b1 < k:
                w = w.at[b1:].add(-(u[b0:b1, b1:].T @ eb))
        return q

    return jax.jit(run)


def gptq_weight(w, s, z, h, qtype, *, block_size=128, damp=0.01, act_order=True,
                keep_zeros=True, fixed=None):
    """GPTQ on one 2-D weight ``w`` (``K x N``, ``x @ w``) with the grid ``s``, ``z``
    (broadcast to ``w``'s shape; ``z`` may be ``None``) and Hessian ``h`` (``K x K``).
    Returns the re-rounded weight (float, on the grid); with ``keep_zeros``, its exact
    zeros stay zeros (0 is on every grid: a rounded zero point's code), and those where
    ``fixed`` (a mask of ``w``'s shape) is set in any case.

    >>> import numpy as np, jax.numpy as jnp, jqt
    >>> from jqt._src.gptq import gptq_weight
    >>> rng = np.random.default_rng(0)
    >>> x, w = rng.normal(size=(256, 16)), rng.normal(size=(16, 8))
    >>> s = np.abs(w).max(0, keepdims=True) / 7 + np.zeros_like(w)
    >>> q = gptq_weight(w, s, None, x.T @ x, jqt.QuantType(bits=4))
    >>> rtn = np.clip(np.round(w / s), -8, 7) * s
    >>> bool(np.sum((x @ (np.asarray(q) - w)) ** 2) < np.sum((x @ (rtn - w)) ** 2))
    True
    """
    w = np.asarray(w, np.float32)
    s = np.broadcast_to(np.asarray(s, np.float32), w.shape)
    z = np.zeros_like(w) if z is None else np.broadcast_to(np.round(np.asarray(z, np.float32)), w.shape)
    perm, u = _inverse_hessian_chol(h, damp, act_order)
    keep = (w == 0) & (keep_zeros | (np.zeros(w.shape, bool) if fixed is None else np.asarray(fixed)))
    # an input 0 in every calibration row (a dead ReLU unit, padding) keeps its weights
    # plainly rounded: the reference code zeroes them, losing them wherever that input is
    # not 0 (and jqt.pack then refused a weight that no longer reached its calibrated
    # range). Its H_ii = 1 leaves it out of H^-1's coupling: no other weight moves for it.
    w = w[perm]
    run = _gptq_blocks(qtype, block_size)
    q = run(jnp.asarray(w), jnp.asarray(s[perm]), jnp.asarray(z[perm]), jnp.asarray(u, _F32),
            jnp.asarray(keep[perm]))
    out = np.empty_like(w)
    out[perm] = np.asarray(q)
    return out


def _grid(site, q, w_shape, depth):
    """The weight's scale and zero point expanded to its operand shape (stacked)."""
    s, z = q.scale, q.zero_point
    if q.qtype.group_size:
        ax = site.entry.groups(site) + depth
        s = groups.expand(s, q.qtype.group_size, ax, w_shape)
        z = groups.expand(z, q.qtype.group_size, ax, w_shape)
    # a per-tensor scale of stacked layers is (L,): one per layer, over the layer's axes
    lead = lambda a: jnp.reshape(a, a.shape + (1,) * (len(w_shape) - a.ndim)) \
        if 0 < a.ndim <= depth else a
    s = jnp.broadcast_to(lead(jnp.asarray(s, _F32)), w_shape)
    z = None if z is None else jnp.broadcast_to(lead(jnp.asarray(z, _F32)), w_shape)
    return s, z


def _rerounded(site, qp, leaf, h, n, opts):
    """The leaf with op ``site``'s weight re-rounded by GPTQ."""
    src, w_i = site.source, site.weight_operand
    depth, contract = src.stack_depth, site.contract[w_i]
    chain = lambda a: apply_chain(a, src.chain)
    w0 = chain(jnp.asarray(leaf)).astype(_F32)
    wt = transforms.weight(w0, qp.smooth, qp.rotate, contract, depth)
    q = qp.operand(w_i)
    s, z = _grid(site, q, wt.shape, depth)
    # the weight's batch axes (a mixture's experts) go after the stacked ones: one GPTQ
    # problem per layer and expert, with that expert's Hessian
    wb = (0,) if site.op == _RAGGED else site.batch_axes()  # a ragged dot's experts: (G, K, N)
    rest = [d for d in range(wt.ndim - depth) if d not in wb]
    perm = tuple(range(depth)) + tuple(d + depth for d in tuple(wb) + tuple(rest))
    nlead = depth + len(wb)
    # K in the order the op pairs the contracted axes, as the Hessian's rows are
    # (transforms.rows); the grid is expanded to every element, so GPTQ needs no group order
    ax = DenseAxes.for_weight([rest.index(c) for c in contract], len(rest), w_i)
    to2 = lambda a: np.asarray(ax.weight_2d(jnp.transpose(a, perm), "kn", nlead))
    w2, s2, z2 = to2(wt), to2(s), None if z is None else to2(z)
    # a channel or group all zeros at calibration has a placeholder scale (1), on which
    # spread error would round to codes of an arbitrary grid: its zeros stay, either way
    gaxis = site.entry.groups(site) if q.qtype.group_size else None
    fixed2 = to2(weightcheck.placeholder_zeros(wt, q, gaxis, depth))
    h = np.asarray(h)  # (float64 a layer at a time below: all at once, 2x every layer's)
    nd = max(np.ndim(n), depth)  # per layer, and per expert where counted so (ragged)
    n = np.broadcast_to(np.asarray(n), h.shape[:nd])  # else the same rows for every expert
    lead = w2.shape[:nlead]
    out, unseen = np.empty_like(w2), []
    for i in np.ndindex(*lead):
        hi = np.asarray(h[i], np.float64) / max(float(n[i[:nd]]), 1.0)
        zi = np.zeros_like(w2[i]) if z2 is None else np.round(z2[i])
        if not np.diag(hi).any():  # no rows reached this layer or expert: every input "dead"
            unseen.append(i[0] if len(i) == 1 else i)
            out[i] = np.asarray(quantize_rows(jnp.asarray(w2[i]), s2[i], zi, q.qtype))
            continue
        where = f" (layer or expert {i[0] if len(i) == 1 else i})" if lead else ""
        if np.isnan(np.diag(hi)).any():  # (sums of squares: NaN only from NaN; batches checked)
            raise ValueError(
                f"jqt.gptq: op '{site.key}'{where}: its Hessian (the sum of x^T x over the "
                "calibration rows) holds NaN: f computes NaN at this op's input from "
                "these finite batches. Find where with jax.debug_nans, or calibrate on data f "
                "keeps finite.")
        if not np.isfinite(hi).all():  # X^T X summed in float32 past its maximum
            raise ValueError(
                f"jqt.gptq: op '{site.key}'{where}: its Hessian (the sum of x^T x over the "
                "calibration rows, in float32) holds inf: the activations reaching it are too "
                "large to square and sum (about 1e19 and beyond, less over many rows), or f "
                "computes inf there from these finite batches (find where with "
                "jax.debug_infs). Rescale the model or the data, or calibrate on data f keeps "
                "finite.")
        try:
            out[i] = gptq_weight(w2[i], s2[i], zi, hi, q.qtype, fixed=fixed2[i], **opts)
        except np.linalg.LinAlgError:
            raise ValueError(
                f"jqt.gptq: op '{site.key}'{where}: its damped Hessian is not positive definite "
                f"(damp={opts['damp']!r}; fewer calibration rows than its {hi.shape[0]} input "
                "features, or inputs that move together). " + (
                    "Pass damp > 0 (0.01 by default) or more calibration rows." if opts["damp"] == 0
                    else "Pass a larger damp (0.01 by default) or more calibration rows.")) from None
    seen = [float(n[i[:nd]]) for i in np.ndindex(*lead) if (i[0] if len(i) == 1 else i) not in unseen]
    if seen and min(seen) < w2.shape[nlead]:  # (AWQ damps this case, outliers.py)
        diagnostics.warn_grouped(
            "rows", f"jqt.gptq: op '{site.key}': {int(min(seen))} calibration rows for its "
            f"{w2.shape[nlead]} inputs: from fewer rows than inputs the Hessian GPTQ spreads the "
            "rounding error with is a poor estimate, and the re-rounded weight can do worse on "
            "other data than the nearest codes jqt.pack would take. Pass more rows (at least as many as inputs; more is "
            "better) in the batches.", f"'{site.key}'")
    if unseen and not lead and not float(np.max(n)):  # no row at all (a branch not taken)
        diagnostics.warn_grouped("unreached", f"jqt.gptq: op '{site.key}': no calibration row "
                                 "reached it (a lax.cond branch not taken, a loop of 0 "
                                 "iterations?), so it has no Hessian; it keeps plain rounding. "
                                 "Calibrate on data that reaches it.", f"'{site.key}'")
    elif unseen and not lead:  # rows, but every input "dead"
        diagnostics.warn_grouped("zero", f"jqt.gptq: op '{site.key}': its calibration inputs were "
                                 "all zero (a zero Hessian), or too small for their squares to "
                                 "stay above float32's range (below about 1e-19); it keeps plain "
                                 "rounding. Calibrate on data that reaches it with real values.", f"'{site.key}'")
    elif unseen:
        diagnostics.warn_grouped(
            "unseen", f"jqt.gptq: op '{site.key}': no calibration rows, or only rows of zeros, "
            f"reached its layers or experts {unseen[:8]}{' ...' if len(unseen) > 8 else ''} of "
            f"{int(np.prod(lead))} (a zero Hessian); they keep plain rounding. Calibrate on data "
            "that reaches them with real values (tokens for every expert).", f"'{site.key}'")
    layer_shape = tuple(wt.shape[d] for d in perm[nlead:])
    back = jnp.asarray(out).reshape((-1,) + out.shape[nlead:])
    back = jnp.stack([ax.weight_from_2d(b, "kn", layer_shape) for b in back])
    back = jnp.transpose(back.reshape(tuple(wt.shape[d] for d in perm)), tuple(np.argsort(perm)))
    # the change, in float32, placed in the leaf by the chain's transpose (without its casts:
    # a float32 weight cast to bfloat16 before its matmul gets float32 values on the grid)
    values = lambda a: apply_chain(a, _values_chain(src.chain))
    leaf32 = jnp.asarray(leaf, _F32)
    delta = transforms.unweight(back, qp.smooth, qp.rotate, contract, depth) - values(leaf32)
    (dleaf,) = jax.linear_transpose(values, jax.ShapeDtypeStruct(jnp.shape(leaf), _F32))(delta)
    exact = leaf32 + dleaf
    result = exact.astype(jnp.result_type(leaf))
    cast = chain(result).dtype
    if result.dtype != _F32 or cast != _F32:  # a cast may move values off the grid GPTQ chose
        grid = lambda a, c: quantize_rows(transforms.weight(c(a).astype(_F32), qp.smooth, qp.rotate,
                                                            contract, depth), s, z, q.qtype)
        moved = int(jnp.sum(grid(result, chain) != grid(exact, values)))
        if moved:
            narrow = result.dtype if result.dtype != _F32 else cast
            why = (" (the op's rotation or smoothing spreads the cast's rounding over every element)"
                   if qp.rotate or qp.smooth is not None else "")
            where = (f"when its result is cast back to the weight's {result.dtype}" if result.dtype != _F32
                     else f"when f casts the weight to {cast} before its matmul")
            diagnostics.warn_grouped(
                ("cast", where), f"jqt.gptq: op '{site.key}': {moved} of {exact.size} codes GPTQ "
                f"chose change {where}{why}, and jqt.pack stores the codes of the {narrow} weight. "
                + ("To keep GPTQ's codes, pass the params as float32 (jax.tree.map(lambda "
                   "a: a.astype(jnp.float32), params)) to jqt.gptq and jqt.pack."
                   if result.dtype != _F32 else "The op reads those."), f"'{site.key}'")
    return compat.weak_typed(result) if compat.is_weak(leaf) else result  # (jnp.full(s, 0.1)'s
    # weak float32 takes a bfloat16 model's dtype: a strong one would promote it)


def gptq(f, qparams, params, batches, *, weight_argnums=0, block_size: int = 128,
         damp: float = 0.01, act_order: bool = True, keep_zeros: bool = True, progress=None):
    """Re-rounds every quantized dense weight of ``f`` with GPTQ, on ``qparams``' grid.

    Args:
      f: the calibrated function.
      qparams: from :func:`jqt.calibrate` (their scales and zero points are kept).
      params: the float weights (a tuple of them with several ``weight_argnums``).
      batches: a sequence of tuples of the remaining arguments of ``f`` (one
        pass over it per op).
      weight_argnums: position(s) of the weight argument(s).
      block_size: rows updated together (the reference's lazy batches). It changes the
        speed only, not the result; the blocks are unrolled in the compiled program, so
        its compile time grows with ``K / block_size``: a small ``block_size`` (1-16) on a
        wide layer takes ten times the default's compile time or more.
      damp: added to ``H``'s diagonal, as a fraction of its mean (1%), from 0 to 1e6.
      act_order: quantize inputs in order of decreasing ``H_ii`` (the reference's
        ``act_order``; the grid stays the calibrated one).
      keep_zeros: a weight's exact zeros (a pruned weight's, 2:4 or by magnitude) stay
        zeros, their rounding error spread over the rows not yet rounded as SparseGPT does
        with its mask; ``False`` re-rounds them as any other element, so GPTQ fills some
        of them in (not those of a channel or group that was all zeros at calibration:
        its scale is a placeholder). Under ``rotate=True`` the rotation mixes the inputs,
        so only a pruned output channel keeps zeros to keep.
      progress: a progress bar (tqdm); ``None`` shows it on a terminal only.

    Returns:
      ``params`` with the same structure, each re-rounded weight's values on its
      quantization grid: ``jqt.pack(qparams, result)`` stores them exactly. (Params
      of a narrower float dtype get GPTQ's float32 result cast back to it; where the cast
      moves codes, under a rotation most of all, a warning says how many and that float32
      params keep them.)

    The weights must be those ``qparams`` were calibrated with: GPTQ rounds on the
    calibrated grids, so weights that outgrew them (or shrank to a quarter of their reach)
    raise :class:`jqt.QParamsMismatchError` naming the op, as :func:`jqt.pack` does. The
    batches are checked as :func:`jqt.calibrate` checks them (no NaN, no empty arrays).

    Ops it leaves to plain rounding (warned): convolutions; weights computed from their
    leaves by more than layout ops; weight elements also read by another op (tied
    embeddings; ops reading separate slices of one leaf, a fused QKV weight's, are each
    re-rounded). Embedding lookups keep their per-row rounding (a lookup
    has no products whose error GPTQ could correct).

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda p, x: x @ p["w"]
    >>> p = {"w": jax.random.normal(jax.random.key(0), (32, 8))}
    >>> xs = [(jax.random.normal(jax.random.key(i), (64, 32)),) for i in range(2)]
    >>> qp = jqt.calibrate(f, jqt.recipes.w4(group_size=16), p, xs, progress=False)
    >>> pq = jqt.gptq(f, qp, p, xs, progress=False)
    >>> sim = jqt.quantize(f, qp, simulate=True)
    >>> err = lambda w: float(jnp.mean((sim(w, xs[0][0]) - f(p, xs[0][0])) ** 2))
    >>> err(pq) < err(p)  # GPTQ's weights vs plain rounding, on the same grid
    True
    """
    check_qparams(qparams, "jqt.gptq")
    argnums = normalize_argnums(weight_argnums)
    validate.check_argnums(qparams, argnums, "jqt.gptq")
    params_t = list(validate.weight_args(params, argnums, "jqt.gptq"))
    validate.flags("jqt.gptq", progress=progress, act_order=act_order, keep_zeros=keep_zeros)
    check_batches(batches, "jqt.gptq")
    try:  # (a loader of unknown length raises TypeError from len)
        n = len(batches) if hasattr(batches, "__getitem__") else None
    except Exception:
        n = None
    if n is None:
        raise CalibrationDataError("jqt.gptq passes over the batches once per op; pass a non-empty "
                                   f"sequence (a list or tuple of batches), not a {type(batches).__name__}.")
    if not n:
        raise CalibrationDataError("jqt.gptq: the calibration set is empty; pass at least one batch, "
                                   "e.g. batches=[(x,)].")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"jqt.gptq: block_size={block_size!r}; expected a positive int (the rows "
                         "updated together, 128 by default).")
    # (jnp.issubdtype: bfloat16 and fp8 scalars are numbers, which np.issubdtype denies)
    if isinstance(damp, bool) or np.ndim(damp) != 0 or not jnp.issubdtype(np.asarray(damp).dtype, jnp.number) \
            or np.iscomplexobj(damp) or not (math.isfinite(float(damp)) and float(damp) >= 0):
        raise ValueError(f"jqt.gptq: damp={damp!r:.60} ({type(damp).__name__}); expected a finite real "
                         "number >= 0 (the fraction of the Hessian's mean diagonal added to it, "
                         "0.01 by default).")
    damp = float(damp)
    if damp > 1e6:  # the inverse Hessian's factor, ~1/sqrt(damp * mean H_ii), underflowed
        # float32 (from about 1e76 on): NaN weights, said by no one before jqt.pack
        raise ValueError(f"jqt.gptq: damp={damp!r}; expected at most 1e6: a damp far above 1 "
                         "already makes GPTQ plain rounding (the Hessian's coupling drowned), "
                         "and a huge one overflows its float32 update. For plain rounding, "
                         "use the qparams jqt.calibrate gave, without jqt.gptq.")
    tree = None
    for i, b in enumerate(each_batch(batches)):
        tree = check_batch(i, b, tree, "jqt.gptq")
    tracer = Tracer(f, argnums, "jqt.gptq")
    try:
        traced = tracer(full_args(argnums, params_t, batches[0]))
    except Exception as e:
        if note := validate.argnums_note(qparams, argnums, "jqt.gptq", params_t):
            e.add_note(note)
        e.add_note(f"jqt.gptq: raised while tracing f on batch 0 (argument shapes "
                   f"{[tuple(np.shape(a)) for a in jax.tree_util.tree_leaves(batches[0])]})")
        raise
    validate.check_keys(traced, qparams, "jqt.gptq")
    keys = {s.key for s in traced.sites()}
    for i in range(1, len(batches)):  # (traces are cached per static values and shapes;
        # indexed, not sliced: a sequence need not take a slice)
        try:
            traced_i = tracer(full_args(argnums, params_t, batches[i]))
        except Exception as e:
            e.add_note(f"jqt.gptq: raised while tracing f on batch {i} (argument shapes "
                       f"{[tuple(np.shape(a)) for a in jax.tree_util.tree_leaves(batches[i])]})")
            raise
        other = sorted({s.key for s in traced_i.sites()} ^ keys)
        if other:  # a KeyError in the passes, or a Hessian missing a batch
            raise CalibrationDataError(
                f"jqt.gptq: batch {i} runs other ops than batch 0 (op{'s' if len(other) > 1 else ''} "
                f"{other[:4]} {'is' if len(other) == 1 else 'are'} in one and not the other): a "
                "static argument (a Python bool or string) or a shape changes the ops f runs. "
                "One set of qparams serves every batch: pass batches that run the same ops, as "
                "jqt.calibrate requires, and run jqt.gptq once per configuration.")
    weightcheck.check(qparams, params_t, argnums, "jqt.gptq")  # it rounds on the calibrated grids
    sites = [s for s in traced.sites() if s.key in qparams]  # an optional op without an entry: float
    order = list(dict.fromkeys(s.key for s in sites))
    def leaf_shape(src):
        if src is None or src.arg not in argnums:
            return None
        return np.shape(jax.tree_util.tree_leaves(params_t[argnums.index(src.arg)])[src.leaf])
    why = {s.key: _why_not(s, qparams[s.key], traced, argnums, leaf_shape(s.source)) for s in sites}
    eligible = [k for k in order if why[k] is None]
    skipped = [k for k in order if why[k] not in (None, "n/a")]
    if skipped:
        diagnostics.warn("jqt.gptq: plain rounding for " + "; ".join(f"'{k}': {why[k]}" for k in skipped[:5])
                         + (" ..." if len(skipped) > 5 else ""))
    site_of = {s.key: s for s in sites}

    def step(params_t, batch, flags, keep):
        """The Hessians of the ops ``keep`` (static) names, from one batch; the other ops
        run as ``flags`` say, recording none (no K x K buffer each: see _chunks)."""
        args = full_args(argnums, params_t, batch)
        state = {k: (qparams[k], *flags[k]) for k in order}
        return tracer(args).run(args, _Hessians(set(keep)), state)[1]

    jstep = jax.jit(step, static_argnums=3)
    opts = dict(block_size=block_size, damp=damp, act_order=act_order, keep_zeros=keep_zeros)
    from tqdm.auto import tqdm
    with diagnostics.grouped():  # a warning per kind, naming the ops, not one per op
        groups = _groups(eligible, order, site_of)
        _passes(groups, tqdm(groups, desc="jqt.gptq", unit="pass",
                             disable=None if progress is None else not progress),
                order, site_of, argnums, params_t, batches, jstep, qparams, opts)
    return params_t[0] if len(argnums) == 1 else tuple(params_t)


_HESSIAN_BYTES = 1 << 30  # the Hessians one compiled pass computes (see _chunks)


def _hessian_bytes(site, stack):
    """The bytes of op ``site``'s float32 Hessian (``_Hessians``): ``K x K`` per layer
    (``stack``, its stacked-layer axes), batch entry of the weight (a mixture's experts)
    and expert of a ragged dot."""
    eqn = site.eqn
    if site.op == _RAGGED:
        k, lead = eqn.invars[0].aval.shape[1], eqn.invars[1].aval.shape[0]
    else:
        x = eqn.invars[1 - site.weight_operand].aval
        k = math.prod(x.shape[d] for d in site.contract[1 - site.weight_operand])
        lead = math.prod(x.shape[d] for d in eqn.params["dimension_numbers"][1][1 - site.weight_operand])
    return 4 * k * k * lead * math.prod(stack)


def _chunks(groups, nbytes, budget=None):
    """``groups`` cut into runs of consecutive groups whose Hessians (``nbytes[key]``) sum
    to at most ``budget`` bytes (a group over it alone): one compiled pass per run, which
    computes the Hessians of its ops only. One for all (a compile, the model's every K x K
    buffer at each batch) cost a LLaMA-7B-shaped model about 27 GiB per batch; one per
    group, a compile per pass (a small model's hundred passes)."""
    budget = _HESSIAN_BYTES if budget is None else budget
    out, size = [], 0
    for g in groups:
        b = sum(nbytes[k] for k in g)
        if out and size + b <= budget:
            out[-1] += g
            size += b
        else:
            out.append(list(g))
            size = b
    return {k: tuple(c) for c in out for k in c}


def _passes(groups, bar, order, site_of, argnums, params_t, batches, jstep, qparams, opts):
    """One pass over the batches per group of ops (``groups``, iterated as ``bar``, its
    progress bar): their Hessians, then their weights re-rounded in ``params_t`` (in
    place)."""
    chunk = _chunks(groups, {k: _hessian_bytes(site_of[k], _stack_shape(site_of[k].source, argnums, params_t))
                             for g in groups for k in g})  # the passes one compiled step serves
    for group in bar:
        pos = order.index(group[0])
        flags = {}
        for i, k in enumerate(order):
            lead = _stack_shape(site_of[k].source, argnums, params_t)
            flags[k] = (jnp.full(lead, float(i < pos), _F32), jnp.full(lead, float(k in group), _F32))
        acc, hosted = None, False
        marked = tracing.mark_static(params_t)  # non-array leaves reach f as they are
        for i, batch in enumerate(each_batch(batches)):
            args = tracing.mark_static(tracing.owned(tuple(batch)))
            try:
                out = jstep(marked, args, flags, chunk[group[0]])
            except Exception as e:
                note_batch_error(e, "jqt.gptq", i, args)
                raise
            out = {k: out[k] for k in group}
            acc, hosted = (out, False) if acc is None else compat.merged(
                lambda a, b: jax.tree_util.tree_map(jnp.add, a, b), acc, out, hosted)
        for key in group:
            site = site_of[key]
            src = site.source
            a = argnums.index(src.arg)
            leaves, tdef = jax.tree_util.tree_flatten(params_t[a])
            leaves[src.leaf] = _rerounded(site, qparams[key], leaves[src.leaf], acc[key]["h"],
                                          acc[key]["n"], opts)
            params_t[a] = jax.tree_util.tree_unflatten(tdef, leaves)


def _groups(eligible, order, site_of):
    """Eligible ops in evaluation order, ops next to each other that read the same input
    (the query, key and value projections of one layer) in one group: their Hessian is
    the same, and none changes the others' input, so one pass serves them all. (The same
    variable in two calls of one jaxpr, a layer under ``jax.checkpoint`` or ``jax.jit``
    in a Python loop, is two inputs: the sites' ``call`` tells them apart.)"""
    out = []
    for k in eligible:
        if out:
            prev = out[-1][-1]
            a, b = site_of[prev], site_of[k]
            same = (a.eqn.invars[1 - a.weight_operand] is b.eqn.invars[1 - b.weight_operand]
                    and a.call == b.call and order.index(k) == order.index(prev) + 1)
            if same:
                out[-1].append(k)
                continue
        out.append([k])
    return out


def _stack_shape(src, argnums, params_t):
    """The stacked-layer axes of an op's weight (its state's leading axes under a scan)."""
    if src is None or not src.stack_depth or src.arg not in argnums:
        return ()
    leaf = jax.tree_util.tree_leaves(params_t[argnums.index(src.arg)])[src.leaf]
    # the leaf's layers, and the blocks a jax.shard_map splits it into, stacked in front
    shape = jax.eval_shape(lambda a: apply_chain(a, src.chain),
                           jax.ShapeDtypeStruct(np.shape(leaf), jnp.result_type(leaf))).shape
    return tuple(shape[:src.stack_depth])
