"""The generic integer ``dot_general``: int8 x int8 -> int32 on the op's own layout,
with zero-point corrections, and the helpers the other kernels share.

For ``real = (q - z) * s`` on both operands of a contraction over K:

    sum_k (qa - za)(qb - zb) = sum qa*qb - za * sum_k qb - zb * sum_k qa + K * za * zb

Scales and zero points never vary along contracted axes, so they factor out
of the sum. :func:`to_out_dot` moves an operand-shaped (keepdims) scale, zero
point or sum to the output layout of the op.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from . import dense
from . import numerics as nx
from .dense import DenseAxes
from .formats import unpack_nibbles
from .qparams import QArray

_I32 = jnp.int32
_F32 = jnp.float32


def to_out_dot(a, operand, dn, ndims):
    """An operand-shaped array with size 1 on contracted axes -> broadcastable to the output."""
    if a is None or a.ndim == 0:
        return a
    (lc, rc), (lb, rb) = dn
    contract, batch = (lc, lb) if operand == 0 else (rc, rb)
    nd = ndims[operand]
    free = [d for d in range(nd) if d not in contract and d not in batch]
    rem = [d for d in range(nd) if d not in contract]
    a = jnp.squeeze(a, axis=tuple(contract))
    a = jnp.transpose(a, [rem.index(d) for d in batch] + [rem.index(d) for d in free])
    nb = len(batch)
    n_lfree = ndims[0] - len(lc) - len(lb)
    n_rfree = ndims[1] - len(rc) - len(rb)
    if operand == 0:
        return a.reshape(a.shape + (1,) * n_rfree)
    return a.reshape(a.shape[:nb] + (1,) * n_lfree + a.shape[nb:])


def int_zp(z):
    return None if z is None else jnp.round(z).astype(_I32)


def dot_general(operands, params, eqn, pad_rows=1):
    """``operands``: per operand a tuple (q, scale, zero_point, qsum) for an
    integer operand or (x, None, None, None) for a float one. ``qsum`` is the
    int32 sum of ``q`` over the contracted axes (keepdims), or None to compute it.
    A one-row operand is padded to ``pad_rows`` rows for the int8 dot."""
    dn = params["dimension_numbers"]
    (lc, rc), _ = dn
    ndims = [operands[0][0].ndim, operands[1][0].ndim]
    out_dtype = eqn.outvars[0].aval.dtype
    (qa, sa, za, suma), (qb, sb, zb, sumb) = operands
    to_out = lambda a, i: to_out_dot(a, i, dn, ndims)
    if sa is not None and sb is not None:
        za, zb = int_zp(za), int_zp(zb)
        k = math.prod(qa.shape[d] for d in lc)
        kc = dense.safe_k(qa.dtype, za is not None, qb.dtype, zb is not None)
        exact = lambda: int_acc(qa, za, suma, qb, zb, sumb, dn, to_out, pad_rows=pad_rows).astype(_F32)
        if not isinstance(k, int):  # a symbolic length (jax.export): which it is, at run time
            # (its chunks' bounds are not known: a longer one accumulates in float32, the
            # products exact, as chunked_acc does where even one slice is too long)
            acc = lax.cond(jnp.asarray(k) <= kc, exact,
                           lambda: int_acc(qa, za, None, qb, zb, None, dn, to_out, _F32))
        elif k <= kc:
            acc = exact()
        else:
            acc = chunked_acc(qa, za, qb, zb, dn, to_out, kc)
        out = acc * (to_out(sa.astype(_F32), 0) * to_out(sb.astype(_F32), 1))  # scales first
        return out.astype(out_dtype)
    # weight-only: one operand is float; the integer weight is cast, not dequantized,
    # and its per-channel scale is applied to the (smaller) output.
    w = 0 if sa is not None else 1
    x = operands[1 - w][0]
    qw, sw, zw, _ = operands[w]
    # the codes' sums exceed float16's range: float32 there
    dt, pref = nx.codes_dot_types(x.dtype, params.get("preferred_element_type"))
    args = [x.astype(dt), qw.astype(dt)][::1 if w == 1 else -1]
    out = lax.dot_general(*args, dn, precision=dense.code_precision(params.get("precision")),
                          preferred_element_type=pref)
    out = out.astype(_F32)
    if zw is not None:
        cx = (lc, rc)[1 - w]
        sumx = jnp.sum(x.astype(_F32), axis=tuple(cx), keepdims=True)
        # a trained zero point is float: round it, as the simulated path does (numerics._zp_f32)
        out = out - to_out(jnp.round(zw.astype(_F32)), w) * to_out(sumx, 1 - w)
    return (out * to_out(sw.astype(_F32), w)).astype(out_dtype)


def one_row_padded(qa, qb, dn, acc_dtype, pad_rows):
    """``lax.dot_general`` of the codes; an operand with a single row (its free axes all of
    length 1) while the other has more is padded to ``pad_rows`` rows along its first
    free axis, and the result sliced back: XLA:CPU's int8 dot at one row takes a generic
    path that is 10-20x slower than at two (experts at one token each, ``benchmarks/
    formats.py --only experts``), as the 2-D kernels' ``dense.int_matmul`` knows."""
    (lc, rc), (lb, rb) = dn
    free = [[d for d in range(q.ndim) if d not in c and d not in b]
            for q, c, b in ((qa, lc, lb), (qb, rc, rb))]
    size = [math.prod(q.shape[d] for d in f) for q, f in zip((qa, qb), free)]
    out = lambda a, b: lax.dot_general(a, b, dn, precision=dense.INT_PRECISION,
                                       preferred_element_type=acc_dtype)
    for i in (0, 1):
        if (acc_dtype == _I32 and pad_rows > 1 and all(isinstance(n, int) for n in size)
                and size[i] == 1 < size[1 - i]):  # a symbolic size (jax.export) is left as is
            ops = [qa, qb]
            axis = len(lb) + (0 if i == 0 else len(free[0]))  # the padded axis in the output
            if not free[i]:  # no free axis (a decode step's query in "bhd,bthd->bht"): one
                # inserted before its contracted axes (rows first, as a matmul's), dropped
                # from the result again
                at = min((lc, rc)[i], default=ops[i].ndim)  # (a batch-only dot: last)
                ops[i] = jnp.pad(jnp.expand_dims(ops[i], at),
                                 [(0, pad_rows - 1) if d == at else (0, 0) for d in range(ops[i].ndim + 1)])
                shift = lambda dims: tuple(d + (d >= at) for d in dims)
                cs, bs = [list(lc), list(rc)], [list(lb), list(rb)]
                cs[i], bs[i] = shift(cs[i]), shift(bs[i])
                acc = lax.dot_general(*ops, ((tuple(cs[0]), tuple(cs[1])), (tuple(bs[0]), tuple(bs[1]))),
                                      precision=dense.INT_PRECISION, preferred_element_type=acc_dtype)
                return lax.squeeze(lax.slice_in_dim(acc, 0, 1, axis=axis), (axis,))
            pad = [(0, 0)] * ops[i].ndim
            pad[free[i][0]] = (0, pad_rows - 1)
            ops[i] = jnp.pad(ops[i], pad)
            return lax.slice_in_dim(out(*ops), 0, 1, axis=axis)
    return out(qa, qb)


def int_acc(qa, za, suma, qb, zb, sumb, dn, to_out, acc_dtype=_I32, pad_rows=1):
    """``sum_k (qa - za)(qb - zb)`` over the contracted axes, accumulated in ``acc_dtype``
    (int32: the caller keeps K short enough, :func:`dense.safe_k`)."""
    (lc, rc), _ = dn
    if acc_dtype != _I32:
        qa, qb = qa.astype(acc_dtype), qb.astype(acc_dtype)
        za, zb = (None if z is None else z.astype(acc_dtype) for z in (za, zb))
        suma = sumb = None
    acc = one_row_padded(qa, qb, dn, acc_dtype, pad_rows)
    if za is not None:
        sumb = jnp.sum(qb, axis=tuple(rc), keepdims=True, dtype=acc_dtype) if sumb is None else sumb
        acc = acc - to_out(za, 0) * to_out(sumb, 1)
    if zb is not None:
        suma = jnp.sum(qa, axis=tuple(lc), keepdims=True, dtype=acc_dtype) if suma is None else suma
        acc = acc - to_out(zb, 1) * to_out(suma, 0)
    if za is not None and zb is not None:
        k = math.prod(qa.shape[d] for d in lc)
        acc = acc + to_out(za, 0) * to_out(zb, 1) * k
    return acc


def chunked_acc(qa, za, qb, zb, dn, to_out, kc):
    """:func:`int_acc` in float32 for a contraction longer than ``kc`` (the int32 worst
    case would overflow): int32 chunks along the longest contracted axis, summed in
    float32; in float32 throughout (products of codes are exact) when even one slice
    of that axis is too long."""
    (lc, rc), _ = dn
    j = max(range(len(lc)), key=lambda i: qa.shape[lc[i]])
    n = qa.shape[lc[j]]
    per = math.prod(qa.shape[d] for d in lc) // n  # K per index of axis j
    if per > kc:
        return int_acc(qa, za, None, qb, zb, None, dn, to_out, _F32)
    sl = lambda q, ax, lo, hi: lax.slice_in_dim(q, lo, hi, axis=ax)
    return sum(int_acc(sl(qa, lc[j], lo, hi), za, None, sl(qb, rc[j], lo, hi), zb, None, dn,
                        to_out).astype(_F32)
               for lo, hi in dense.chunks(n, kc // per))



def operand_tuple(op):
    """A QArray operand -> (codes, scale, zero_point, sums) for the generic kernels; a float
    operand -> (x, None, None, None). fp8 codes are upcast (exact) and nf4 codes decoded
    to their table values (a weight-only format): the generic kernels are integer or
    float arithmetic."""
    if not isinstance(op, QArray):
        return (op, None, None, None)
    v = op.values
    if op.qtype.kind in ("float", "lut"):
        return (nx.decode(v, op.qtype.grid), op.scale, None, None)
    return (v, op.scale, op.zero_point, op.sums)



def float_act(x):
    """An activation operand -> (float32 values, the factor left for the output or
    ``None``): int codes minus the rounded zero point and fp8 codes upcast (both exact),
    times the part of their scale below 1 (``dense.split_scale``: no intermediate
    overflows that the real products do not); a float one as it is."""
    if not isinstance(x, QArray):
        return x, None
    qx, sx, zx, _ = operand_tuple(x)  # fp8 activation codes come decoded
    xf = qx.astype(_F32) - (0 if zx is None else jnp.round(zx.astype(_F32)))
    lo, hi = dense.split_scale(sx.astype(_F32))
    return xf * lo, hi


def to_operand(site, eqn, op):
    """A QArray in a packed 2-D layout -> the op's own layout (nibbles unpacked)."""
    if not isinstance(op, QArray):
        return op
    if op.layout == "operand":  # int4 codes of a batched weight: packed along its last axis
        return dataclasses.replace(op, values=unpack_nibbles(op.values, -1)) if op.nibbles else op
    w = site.weight_operand
    ax = DenseAxes.of(eqn.params["dimension_numbers"], [v.aval.ndim for v in eqn.invars], w,
                      grouped=bool(op.qtype.group_size))
    v = dense.unpacked(op)
    return dataclasses.replace(op, values=ax.weight_from_2d(v, op.layout, eqn.invars[w].aval.shape),
                               sums=None, layout="operand")


def x_axes(eqn, w):
    """The activation's (operand ``1 - w``) contracted, batch and free axes."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    xc, xb = (lc, rc)[1 - w], (lb, rb)[1 - w]
    nd = eqn.invars[1 - w].aval.ndim
    return xc, xb, [d for d in range(nd) if d not in xc and d not in xb]

