"""Kernels for a weight with batch axes: the experts of a mixture written densely,
``jnp.einsum("ecd,edf->ecf", x, w)``, whose weight is a stack of 2-D weights.

Such a weight keeps the op's own layout (``"operand"``, int4 codes two per byte
along its last axis). :func:`run` picks the formulation (``policy.py``):

- float activations at few rows, int weights per channel: the activation as int8
  digits through one int8 ``dot_general`` (:func:`batched_digits`);
- int8 activations, grouped int weights, under ``policy.batched_groups``: one int8
  ``dot_general`` batched over the groups (:func:`split_groups`);
- otherwise, weights decoded to float: under ``policy.batched_map`` one expert at a
  time in a ``lax.map``, each in K-chunks decoded in cache (:func:`decoded_map`), or
  the whole weight at once for one batched float ``dot_general``
  (:func:`decoded_whole`);
- per-channel int weights with int8 activations: ``None``, the generic kernels.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import dense, gemv, groups
from . import numerics as nx
from .intdot import float_act, int_acc, int_zp, operand_tuple, to_operand, to_out_dot, x_axes
from .qparams import QArray

_I32 = jnp.int32
_F32 = jnp.float32


def run(site, eqn, ops, policy):
    """The op on a quantized weight with batch axes, or ``None`` where the generic
    kernels run it (per-channel weights with quantized activations)."""
    w = site.weight_operand
    wq, x = ops[w], ops[1 - w]
    q = wq.qtype
    if not q.group_size and _digits_apply(site, eqn, ops, policy):
        return batched_digits(site, eqn, ops, policy)
    ints = isinstance(x, QArray) and x.qtype.kind == q.kind == "int"
    rows = _rows(eqn, w)
    if (q.group_size and ints and policy.batched_groups and not policy.small_groups(q)
            and not dense.many_rows(rows, policy)):
        return split_groups(site, eqn, ops, policy)
    if not q.group_size and isinstance(x, QArray) and q.kind == "int":
        return None  # (fp8 weights go on: decoded whole for one batched dot, they ran 3-4x
        # float32 at one token per expert, hunt81_hloaudit)
    if policy.batched_map and _mappable(site, eqn, wq):
        return decoded_map(site, eqn, ops, policy)
    if q.group_size:
        return decoded_whole(site, eqn, ops)
    return None


def _rows(eqn, w):
    """The activation's rows per batch entry (-1 where symbolic, under ``jax.export``)."""
    rows = math.prod(eqn.invars[1 - w].aval.shape[d] for d in x_axes(eqn, w)[2])
    return rows if isinstance(rows, int) else -1


def _digits_apply(site, eqn, ops, policy):
    """Whether a weight-only op whose weight has batch axes runs :func:`batched_digits`:
    a float activation with at most ``policy.gemv_rows`` rows per batch entry, and int
    codes of 8 bits or fewer with one scale per output channel."""
    w = site.weight_operand
    if isinstance(ops[1 - w], QArray):
        return False
    q = ops[w].qtype
    xc, _, free = x_axes(eqn, w)
    k = math.prod(eqn.invars[1 - w].aval.shape[d] for d in xc)
    return bool(policy.weight_only_digits and free and q.kind == "int" and q.bits <= 8
                and not q.group_size and 0 < _rows(eqn, w) <= policy.gemv_rows
                and isinstance(k, int) and k <= dense.safe_k(np.int8, False, np.int8, True))


def batched_digits(site, eqn, ops, policy):
    """Float activation x int weight with batch axes (a mixture's experts) at few rows:
    the activation's rows become ``policy.weight_only_digits`` int8 digits each
    (:func:`gemv.digits`, per row and batch entry), stacked along its first free axis,
    for one int8 x int8 ``dot_general`` (XLA:CPU reads int8 weights fastest there,
    not through a float cast of the whole weight); the int32 results are scaled per
    digit and summed, then by the weight's scales. Differentiated as the float
    ``dot_general`` with the weight decoded (:func:`gemv.derivative_of`)."""
    w = site.weight_operand
    dn = eqn.params["dimension_numbers"]

    def decoded(x, wq):
        wf = groups.dequantize(wq.values, wq.scale, wq.zero_point, wq.qtype, 0)  # per channel
        args = [x.astype(_F32), wf] if w == 1 else [wf, x.astype(_F32)]
        return lax.dot_general(*args, dn, precision=dense.code_precision(), preferred_element_type=_F32)

    return gemv.derivative_of(decoded, lambda x, wq: _batched_digits(eqn, w, x, wq, policy),
                              ops[1 - w], to_operand(site, eqn, ops[w]))


def _batched_digits(eqn, w, x, wq, policy):
    dn = eqn.params["dimension_numbers"]
    xc, _, free = x_axes(eqn, w)
    n, ax = policy.weight_only_digits, free[0]
    # gemv.digits on the rows (every non-contracted position) x K, back in x's layout
    rest = [d for d in range(x.ndim) if d not in xc]
    perm = rest + list(xc)
    xt_shape = tuple(x.shape[d] for d in perm)
    c2, s2 = gemv.digits(jnp.transpose(x, perm).reshape(-1, math.prod(x.shape[d] for d in xc)), n)
    back = lambda a, shape: jnp.transpose(a.reshape(shape), tuple(np.argsort(perm)))
    codes = [back(c2[d * c2.shape[0] // n:(d + 1) * c2.shape[0] // n], xt_shape) for d in range(n)]
    keep = xt_shape[:len(rest)] + (1,) * len(xc)  # size 1 on the contracted axes
    scales = [back(s2[d], keep) for d in range(n)]
    c = jnp.concatenate(codes, axis=ax)  # digit-major along the first free axis
    ndims = [v.aval.ndim for v in eqn.invars]
    ops2 = [None, None]
    ops2[w], ops2[1 - w] = wq.values, c
    to_out = lambda a, i: to_out_dot(a, i, dn, ndims)
    zw = int_zp(wq.zero_point)
    acc = int_acc(ops2[0], None, None, ops2[1], None, None, dn, to_out, pad_rows=policy.pad_rows)
    (lc, rc), (lb, rb) = dn
    n_wfree = ndims[w] - len((lc, rc)[w]) - len((lb, rb)[w])
    out_ax = len(lb) + (0 if w == 1 else n_wfree)  # the output axis of the activation's free[0]
    m = x.shape[ax]
    out = 0.0
    for d in range(n - 1, -1, -1):  # the finest digit first
        part = lax.slice_in_dim(acc, d * m, (d + 1) * m, axis=out_ax).astype(_F32)
        if zw is not None:  # minus zw * sum_k of this digit's codes
            csum = jnp.sum(codes[d], axis=tuple(xc), keepdims=True, dtype=_I32)
            part = part - (to_out(zw, w) * to_out(csum, 1 - w)).astype(_F32)
        out = out + part * to_out(scales[d], 1 - w)
    return out * to_out(wq.scale.astype(_F32), w)


def _split(a, axis, n):
    """Axis ``axis`` of ``a`` (length ``n * g``, ``n`` or 1) -> two axes ``(n, g)``,
    ``(n, 1)`` or ``(1, 1)``: a grouped axis as groups and positions within them."""
    if a is None or a.ndim == 0:
        return a
    size = a.shape[axis]
    first = 1 if size == 1 else n
    return a.reshape(a.shape[:axis] + (first, size // first) + a.shape[axis + 1:])


def _grouped_axes(eqn, w):
    """The weight's and the activation's contracted axes, and the position in them of
    the grouped one (the weight's innermost contracted axis, ``registry.groups``)."""
    (lc, rc), _ = eqn.params["dimension_numbers"]
    wc, xc = (lc, rc)[w], (lc, rc)[1 - w]
    return wc, xc, wc.index(max(wc))


def decoded_whole(site, eqn, ops):
    """The whole grouped weight decoded to float (codes minus zero point, times the
    group scales) for one float ``dot_general``; int8 activation codes upcast exactly."""
    w = site.weight_operand
    wq = to_operand(site, eqn, ops[w])
    dn = eqn.params["dimension_numbers"]
    wc, _, gpos = _grouped_axes(eqn, w)
    wf = groups.dequantize(wq.values, wq.scale, wq.zero_point, wq.qtype, wc[gpos])
    x = ops[1 - w]
    if not isinstance(x, QArray):
        args = [x, wf.astype(x.dtype)] if w == 1 else [wf.astype(x.dtype), x]
        return lax.dot_general(*args, dn, precision=dense.code_precision(eqn.params.get("precision")),
                               preferred_element_type=eqn.params.get("preferred_element_type"))
    xf, sx = float_act(x)
    args = [xf, wf] if w == 1 else [wf, xf]
    out = lax.dot_general(*args, dn, precision=dense.code_precision(), preferred_element_type=_F32)
    return out * to_out_dot(sx, 1 - w, dn, [v.aval.ndim for v in eqn.invars])


def split_groups(site, eqn, ops, policy):
    """int8 activations x a grouped int weight with batch axes, the contraction split
    into groups: each grouped axis becomes ``(groups, g)``, the groups and the weight's
    other contracted axes (whose scales differ per position) become batch axes of one
    int8 x int8 -> int32 ``dot_general`` over ``g``, and the partial sums are scaled
    per group and summed. Only under ``policy.batched_groups``: on XLA:CPU the decoded
    weight took 0.64-0.71x its time at 1 and 8 tokens per expert (``benchmarks/
    formats.py --only experts``), as ``batched_groups=False`` in its table says of 2-D
    weights."""
    w = site.weight_operand
    wq = to_operand(site, eqn, ops[w])
    dn = eqn.params["dimension_numbers"]
    (lc, rc), (lb, rb) = dn
    wc, xc, gpos = _grouped_axes(eqn, w)
    qw, sw, zw = wq.values, wq.scale, wq.zero_point
    ndims = [v.aval.ndim for v in eqn.invars]
    n = qw.shape[wc[gpos]] // wq.qtype.group_size
    qx, sx, zx, _ = operand_tuple(ops[1 - w])
    axes = [None, None]
    axes[w], axes[1 - w] = wc[gpos], xc[gpos]
    split = lambda a, i: _split(a, axes[i], n)
    shift = lambda d, i: d + (d > axes[i])  # an operand's axis number after its split
    # contracted over the groups' positions; batched over the op's batch axes, then the
    # weight's other contracted axes, then the groups
    others = [j for j in range(len(lc)) if j != gpos]
    new_c = ((shift(lc[gpos], 0) + 1,), (shift(rc[gpos], 1) + 1,))
    new_b = tuple(tuple(shift(d, i) for d in b) + tuple(shift(c[j], i) for j in others)
                  + (axes[i],) for b, c, i in ((lb, lc, 0), (rb, rc, 1)))
    new_dn = (new_c, new_b)
    opnds = [None, None]
    opnds[w] = (split(qw, w), split(sw, w), split(zw, w))
    opnds[1 - w] = (split(qx, 1 - w), split(sx, 1 - w), split(zx, 1 - w))
    new_nd = [nd + 1 for nd in ndims]
    to_out = lambda a, i: to_out_dot(a, i, new_dn, new_nd)
    (qa, sa, za), (qb, sb, zb) = opnds
    acc = int_acc(qa, int_zp(za), None, qb, int_zp(zb), None, new_dn, to_out,
                   pad_rows=policy.pad_rows).astype(_F32)
    out = acc * (to_out(sa.astype(_F32), 0) * to_out(sb.astype(_F32), 1))
    nb = len(lb)
    return jnp.sum(out, axis=tuple(range(nb, nb + len(others) + 1)))



def _mappable(site, eqn, wq):
    """Whether :func:`decoded_map` runs the op: a weight in its own layout contracted
    over one axis, the first or the last of its non-batch axes, with at least one
    free axis, and its nibbles (if packed) not along a batch axis."""
    w = site.weight_operand
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    wc, wb = (lc, rc)[w], (lb, rb)[w]
    nd = eqn.invars[w].aval.ndim
    rest = [d for d in range(nd) if d not in wb]
    return (wq.layout == "operand" and len(wc) == 1 and len(rest) >= 2
            and wc[0] in (rest[0], rest[-1]) and not (wq.nibbles and nd - 1 in wb))


def decoded_map(site, eqn, ops, policy):
    """Float (or exactly upcast) activations x a weight with batch axes, one batch entry
    (expert) at a time in a ``lax.map``: each expert's weight, seen as ``(K, N)`` or
    ``(N, K)``, is decoded in K-chunks of ``policy.weight_only_chunk`` rows in cache
    (whole where its float copy fits ``policy.whole_decode_bytes`` or its rows are
    more than ``policy.float_matmul_rows``), one float matmul per chunk. Decoding the
    whole weight of a mixture at once writes and reads a float copy of every expert:
    4.4-7.5x float32 at 1 and 8 tokens per expert (``benchmarks/formats.py --only
    experts``). int4 codes stay two per byte: along K, each nibble multiplies the
    activation's even or odd columns; along N, the two products interleave."""
    w = site.weight_operand
    wq, x = ops[w], ops[1 - w]
    dn = eqn.params["dimension_numbers"]
    (lc, rc), (lb, rb) = dn
    wc, wb = (lc, rc)[w], (lb, rb)[w]
    xc, xb, xfree = x_axes(eqn, w)
    wshape, xshape = eqn.invars[w].aval.shape, eqn.invars[1 - w].aval.shape
    nd = len(wshape)
    rest = [d for d in range(nd) if d not in wb]
    kax = wc[0]
    wfree = [d for d in rest if d != kax]
    kn = rest[0] == kax  # each expert (K, N); else (N, K)
    bsz = math.prod(wshape[d] for d in wb)
    q = wq.qtype
    g = q.group_size
    keep = tuple(wshape[d] if d != kax else 1 for d in range(nd))

    def to3(a):  # weight-shaped (codes, or keepdims scales) -> (B, K, N) or (B, N, K)
        a = jnp.broadcast_to(a, tuple(wshape[d] if d in wb else a.shape[d] for d in range(nd)))
        a = jnp.transpose(a, tuple(wb) + tuple(rest))
        nf = math.prod(a.shape[len(wb) + rest.index(d)] for d in wfree)
        kk = a.shape[len(wb) + rest.index(kax)]
        return a.reshape((bsz, kk, nf) if kn else (bsz, nf, kk))

    v, unit = wq.values, 1.0
    if q.kind == "float":  # fp8 bits, decoded with integer ops (dense.decode_rows)
        v, unit = lax.bitcast_convert_type(v, jnp.uint8), nx.FP8_BITS_UNIT[q.grid]
    s = wq.scale.astype(_F32) * unit
    z = wq.zero_point
    if not g:  # per channel (or per tensor): broadcast to one scale per expert and channel
        s = jnp.broadcast_to(s, keep)
        z = None if z is None else jnp.broadcast_to(z, keep)
    xf, sx = float_act(x)
    perm_x = tuple(xb) + tuple(xfree) + tuple(xc)
    m = math.prod(xshape[d] for d in xfree)
    k = xshape[xc[0]]
    x3 = jnp.transpose(xf.astype(_F32), perm_x).reshape(bsz, m, k)
    n = math.prod(wshape[d] for d in wfree)
    rows = m if isinstance(m, int) else -1
    whole = 4 * k * n <= policy.whole_decode_bytes or dense.many_rows(rows, policy, 4 * k * n)
    nib = wq.nibbles
    step = 2 if nib and not kn else 1  # codes per byte along K
    kc = 0 if whole else dense.chunk_size(k, policy.weight_only_chunk, math.lcm(max(g, 1), step))
    expert = _expert(wq, kn, nib, kc, g, eqn.params.get("precision") if sx is None else None)
    out3 = lax.map(expert, (x3, to3(v), to3(s), None if z is None else to3(z)))
    if sx is not None and sx.ndim:
        sk = jnp.broadcast_to(sx, tuple(1 if d in xc else xshape[d] for d in range(len(xshape))))
        out3 = out3 * jnp.transpose(sk, perm_x).reshape(bsz, m, 1)
    elif sx is not None:
        out3 = out3 * sx
    bshape = [xshape[d] for d in xb]
    xs, ws = [xshape[d] for d in xfree], [wshape[d] for d in wfree]
    if w == 1:
        return out3.reshape(bshape + xs + ws)
    return jnp.swapaxes(out3, 1, 2).reshape(bshape + ws + xs)


def _expert(wq, kn, nib, kc, g, precision):
    """One expert's ``(x (M, K), codes, scale, zero point) -> (M, N)`` for
    :func:`decoded_map`: K-chunks of ``kc`` rows (0: the whole of K at once), a
    ``lax.scan`` over the chunks of ``(K, N)`` codes (reshaped in place), a loop of
    slices of ``(N, K)`` ones."""
    kd = 0 if kn else 1
    step = 2 if nib and not kn else 1  # codes per byte along K
    rows = g // step if g else 0  # rows of the codes per group (kc is a multiple of g)
    halves = nib and kn  # nibbles along N: even and odd output channels

    def dot(a, b):
        return lax.dot_general(a, b, (((1,), (kd,)), ((), ())), precision=dense.code_precision(precision),
                               preferred_element_type=_F32)

    def dec(c, s, z):
        return dense.decode_rows(c, wq, s, z, kd, rows)

    def block(x2, v, s, z):  # x2 (M, kb), codes of kb rows of K and their group scales
        # (for nibbles along N, pairs (even, odd) of them)
        if not nib:
            return dot(x2, dec(v, s, z))
        b = v.astype(jnp.int8)
        lo, hi = jnp.left_shift(b, 4) >> 4, b >> 4  # arithmetic shifts sign-extend
        if not kn:  # nibbles along K: the even rows of K, then the odd ones
            return dot(x2[:, 0::2], dec(lo, s, z)) + dot(x2[:, 1::2], dec(hi, s, z))
        j = lambda a, i: None if a is None else a[i]
        out = jnp.stack([dot(x2, dec(lo, j(s, 0), j(z, 0))), dot(x2, dec(hi, j(s, 1), j(z, 1)))],
                        axis=-1)
        return out.reshape(out.shape[0], out.shape[1] * 2)  # (M may be 0)

    def fn(args):
        x2, v, s, z = args
        m, k = x2.shape
        sg, zg = (s, z) if g else (None, None)
        if halves:  # the group scales of the even and of the odd output channels
            pair = lambda a: (None, None) if a is None else (a[:, 0::2], a[:, 1::2])
            sg, zg = pair(sg), pair(zg)
        if not kc:
            out = block(x2, v, sg, zg)
        elif kn:  # (K, N) codes: chunks of rows, reshaped in place, for the scan
            nc = k // kc
            per = lambda a, r: None if a is None else a.reshape((nc, r) + a.shape[1:])
            gch = lambda a: per(a, kc // g)
            chunks = lambda a: tuple(gch(h) for h in a) if isinstance(a, tuple) else gch(a)

            def body(acc, xs):
                xc, vc, sc, zc = xs
                return acc + block(xc, vc, sc, zc), None

            xs = (x2.reshape(m, nc, kc).transpose(1, 0, 2), per(v, kc),
                  chunks(sg) if g else None, chunks(zg) if g else None)
            n = v.shape[1] * (2 if nib else 1)
            out, _ = lax.scan(body, jnp.zeros((m, n), _F32), xs)
        else:  # (N, K) codes: slices of columns
            def body(i, acc):
                lo = i * kc
                cut = lambda a, at, size: None if a is None else lax.dynamic_slice_in_dim(a, at, size, 1)
                return acc + block(lax.dynamic_slice_in_dim(x2, lo, kc, 1), cut(v, lo // step, kc // step),
                                   cut(sg, lo // g, kc // g) if g else None,
                                   cut(zg, lo // g, kc // g) if g else None)

            out = lax.fori_loop(0, k // kc, body, jnp.zeros((m, v.shape[0]), _F32))
        if g:
            return out
        if z is not None:  # per channel: the zero point times each row's sum, then the scale
            out = out - jnp.round(z.astype(_F32)).reshape(1, -1) * jnp.sum(x2, axis=1, keepdims=True)
        return out * s.reshape(1, -1)

    return fn
