"""Integer kernels: int8 x int8 -> int32 ``dot_general`` and ``conv_general_dilated``
with zero-point corrections, and the weight-only variants.

:func:`run` picks the formulation (``policy.py``): a weight matmul runs as a
2-D matmul over a packed weight (``dense.py``), a convolution with few input
channels as a patch matmul on CPU (``patches.py``), anything else through the
generic kernels below.

For ``real = (q - z) * s`` on both operands of a contraction over K:

    sum_k (qa - za)(qb - zb) = sum qa*qb - za * sum_k qb - zb * sum_k qa + K * za * zb

Scales and zero points never vary along contracted axes, so they factor out
of the sum. ``_to_out`` moves an operand-shaped (keepdims) scale, zero point
or sum to the output layout of the op.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat, dense, gemv, groups, patches
from . import numerics as nx
from .dense import DenseAxes
from .formats import unpack_nibbles
from .qparams import QArray

_I32 = jnp.int32
_F32 = jnp.float32


def _to_out_dot(a, operand, dn, ndims):
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


def _int_zp(z):
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
    to_out = lambda a, i: _to_out_dot(a, i, dn, ndims)
    if sa is not None and sb is not None:
        za, zb = _int_zp(za), _int_zp(zb)
        k = math.prod(qa.shape[d] for d in lc)
        kc = dense.safe_k(qa.dtype, za is not None, qb.dtype, zb is not None)
        if not isinstance(k, int) or k <= kc:
            acc = _int_acc(qa, za, suma, qb, zb, sumb, dn, to_out, pad_rows=pad_rows).astype(_F32)
        else:
            acc = _chunked_acc(qa, za, qb, zb, dn, to_out, kc)
        out = acc * (to_out(sa.astype(_F32), 0) * to_out(sb.astype(_F32), 1))  # scales first
        return out.astype(out_dtype)
    # weight-only: one operand is float; the integer weight is cast, not dequantized,
    # and its per-channel scale is applied to the (smaller) output.
    w = 0 if sa is not None else 1
    x = operands[1 - w][0]
    qw, sw, zw, _ = operands[w]
    args = [x, qw.astype(x.dtype)] if w == 1 else [qw.astype(x.dtype), x]
    out = lax.dot_general(*args, dn, precision=params.get("precision"),
                          preferred_element_type=params.get("preferred_element_type"))
    out = out.astype(_F32)
    if zw is not None:
        cx = (lc, rc)[1 - w]
        sumx = jnp.sum(x.astype(_F32), axis=tuple(cx), keepdims=True)
        # a trained zero point is float: round it, as the simulated path does (numerics._zp_f32)
        out = out - to_out(jnp.round(zw.astype(_F32)), w) * to_out(sumx, 1 - w)
    return (out * to_out(sw.astype(_F32), w)).astype(out_dtype)


def _one_row_padded(qa, qb, dn, acc_dtype, pad_rows):
    """``lax.dot_general`` of the codes; an operand with a single row (its free axes all of
    length 1) while the other has more is padded to ``pad_rows`` rows along its first
    free axis, and the result sliced back: XLA:CPU's int8 dot at one row takes a generic
    path that is 10-20x slower than at two (experts at one token each, ``benchmarks/
    formats.py --only experts``), as the 2-D kernels' ``dense.int_matmul`` knows."""
    (lc, rc), (lb, rb) = dn
    free = [[d for d in range(q.ndim) if d not in c and d not in b]
            for q, c, b in ((qa, lc, lb), (qb, rc, rb))]
    size = [math.prod(q.shape[d] for d in f) for q, f in zip((qa, qb), free)]
    out = lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=acc_dtype)
    for i in (0, 1):
        if (acc_dtype == _I32 and pad_rows > 1 and free[i] and all(isinstance(n, int) for n in size)
                and size[i] == 1 < size[1 - i]):  # a symbolic size (jax.export) is left as is
            ops = [qa, qb]
            pad = [(0, 0)] * ops[i].ndim
            pad[free[i][0]] = (0, pad_rows - 1)
            ops[i] = jnp.pad(ops[i], pad)
            axis = len(lb) + (0 if i == 0 else len(free[0]))  # the padded axis in the output
            return lax.slice_in_dim(out(*ops), 0, 1, axis=axis)
    return out(qa, qb)


def _int_acc(qa, za, suma, qb, zb, sumb, dn, to_out, acc_dtype=_I32, pad_rows=1):
    """``sum_k (qa - za)(qb - zb)`` over the contracted axes, accumulated in ``acc_dtype``
    (int32: the caller keeps K short enough, :func:`dense.safe_k`)."""
    (lc, rc), _ = dn
    if acc_dtype != _I32:
        qa, qb = qa.astype(acc_dtype), qb.astype(acc_dtype)
        za, zb = (None if z is None else z.astype(acc_dtype) for z in (za, zb))
        suma = sumb = None
    acc = _one_row_padded(qa, qb, dn, acc_dtype, pad_rows)
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


def _chunked_acc(qa, za, qb, zb, dn, to_out, kc):
    """:func:`_int_acc` in float32 for a contraction longer than ``kc`` (the int32 worst
    case would overflow): int32 chunks along the longest contracted axis, summed in
    float32; in float32 throughout (products of codes are exact) when even one slice
    of that axis is too long."""
    (lc, rc), _ = dn
    j = max(range(len(lc)), key=lambda i: qa.shape[lc[i]])
    n = qa.shape[lc[j]]
    per = math.prod(qa.shape[d] for d in lc) // n  # K per index of axis j
    if per > kc:
        return _int_acc(qa, za, None, qb, zb, None, dn, to_out, _F32)
    sl = lambda q, ax, lo, hi: lax.slice_in_dim(q, lo, hi, axis=ax)
    return sum(_int_acc(sl(qa, lc[j], lo, hi), za, None, sl(qb, rc[j], lo, hi), zb, None, dn,
                        to_out).astype(_F32)
               for lo, hi in dense.chunks(n, kc // per))


def _conv_params(params):
    keep = ("window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
            "feature_group_count", "batch_group_count", "precision")
    return {k: params[k] for k in keep if k in params}


def _out_channel(a, params, out_ndim):
    """Per-output-feature kernel array (keepdims, rhs-shaped) -> broadcastable to the output."""
    if a is None or a.ndim == 0:
        return a
    dn = params["dimension_numbers"]
    shape = [1] * out_ndim
    shape[dn.out_spec[1]] = a.size
    return a.reshape(shape)


def _out_batch(a, params, out_ndim):
    """Per-example lhs array (keepdims) -> broadcastable to the output."""
    if a is None or a.size == 1:
        return None if a is None else a.reshape(())
    shape = [1] * out_ndim
    shape[params["dimension_numbers"].out_spec[0]] = a.size
    return a.reshape(shape)


def conv(x_op, w_op, params, eqn):
    """Integer (or weight-only) convolution; the activation is the lhs, with a
    per-tensor or per-example scale and zero point."""
    (qx, sx, zx, _), (qw, sw, zw, wsum) = x_op, w_op
    if zw is not None:
        raise NotImplementedError("jqt: asymmetric conv weights are not supported; use "
                                  "QuantType(symmetric=True) for conv weights.")
    cp = _conv_params(params)
    out_dtype = eqn.outvars[0].aval.dtype
    out_ndim = eqn.outvars[0].aval.ndim
    dn = params["dimension_numbers"]
    if sx is None:  # weight-only
        out = lax.conv_general_dilated(qx, qw.astype(qx.dtype), **cp,
                                       preferred_element_type=params.get("preferred_element_type"))
        return (out.astype(_F32) * _out_channel(sw.astype(_F32), params, out_ndim)).astype(out_dtype)
    cp.pop("precision", None)
    zx = _out_batch(_int_zp(zx), params, out_ndim)
    if zx is not None and zx.ndim == 0 and all(d == 1 for d in cp["lhs_dilation"]):
        # pad with the zero point, whose real value is exactly 0, then correct by
        # zx * (sum of the kernel of each output channel).
        cfg = [(0, 0, 0)] * qx.ndim
        for d, (lo, hi) in zip(dn.lhs_spec[2:], cp["padding"]):
            cfg[d] = (lo, hi, 0)
        qx = lax.pad(qx, zx.astype(qx.dtype).reshape(()), cfg)
        cp["padding"] = [(0, 0)] * len(cp["padding"])
        acc = lax.conv_general_dilated(qx, qw, **cp, preferred_element_type=_I32)
        if wsum is None:
            axes = tuple(d for d in range(qw.ndim) if d != dn.rhs_spec[0])
            wsum = jnp.sum(qw, axis=axes, keepdims=True, dtype=_I32)
        acc = acc - zx * _out_channel(wsum, params, out_ndim)
    else:
        acc = lax.conv_general_dilated(qx, qw, **cp, preferred_element_type=_I32)
        if zx is not None:
            # per-example zero points or a dilated input: subtract zx times the conv of
            # the indicator of real input positions (the same for every example).
            shape = list(qx.shape)
            shape[dn.lhs_spec[0]] = 1
            ones = jnp.ones(shape, np.int8)
            acc = acc - zx * lax.conv_general_dilated(ones, qw, **cp, preferred_element_type=_I32)
    sx = _out_batch(sx.astype(_F32), params, out_ndim)
    out = acc.astype(_F32) * (sx * _out_channel(sw.astype(_F32), params, out_ndim))
    return out.astype(out_dtype)


def _tup(op):
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


def _fp8_generic(site, eqn, ops):
    """fp8 x fp8 (or fp8 weight x float) on the generic path: the fp8 values upcast to
    float32 (exact), the float op, then the scales."""
    w = site.weight_operand
    vals = [nx.decode(op.values, op.qtype.grid) if isinstance(op, QArray) else op for op in ops]
    out = compat.bind_eqn(eqn, vals)[0].astype(_F32)
    for i, op in enumerate(ops):
        if isinstance(op, QArray):
            s = op.scale.astype(_F32)
            if site.op == "dot_general":
                out = out * _to_out_dot(s, i, eqn.params["dimension_numbers"],
                                        [v.ndim for v in vals])
            else:
                nd = eqn.outvars[0].aval.ndim
                out = out * (_out_channel(s, eqn.params, nd) if i == w else
                             _out_batch(s, eqn.params, nd))
    return out


def run(site, eqn, ops, policy):
    """The op of ``site`` on ``ops``: per operand a :class:`jqt.QArray` of codes (in its
    ``layout``) or the float array. A dense weight runs through ``dense.py`` in the
    layout the policy picks; everything else through the generic kernels above."""
    params, out = eqn.params, eqn.outvars[0].aval
    w = site.weight_operand
    wq = ops[w] if w is not None else None
    packed_2d = isinstance(wq, QArray) and wq.layout != "operand"  # dense path below
    grouped = isinstance(wq, QArray) and bool(wq.qtype.group_size)
    if grouped and site.batch_axes():
        return grouped_batched(site, eqn, ops, policy).astype(out.dtype)
    if not packed_2d and any(isinstance(o, QArray) and o.qtype.kind == "float" for o in ops):
        return _fp8_generic(site, eqn, [_to_operand(site, eqn, o) for o in ops]).astype(out.dtype)
    if site.op == "conv_general_dilated":
        x_op, w_op = _tup(ops[0]), _tup(_to_operand(site, eqn, ops[1]))
        in_ch = w_op[0].shape[params["dimension_numbers"].rhs_spec[1]]
        if x_op[1] is not None and patches.applies(params, in_ch, policy):
            return patches.conv(x_op, w_op, params, out.shape).astype(out.dtype)
        return conv(x_op, w_op, params, eqn)
    ax = DenseAxes.of(params["dimension_numbers"], [v.aval.ndim for v in eqn.invars], w,
                      grouped=grouped)
    if ax is None and _batched_digits_apply(site, eqn, ops, policy):
        return batched_digits(site, eqn, ops, policy).astype(out.dtype)
    if ax is None:
        return dot_general([_tup(_to_operand(site, eqn, o)) for o in ops], params, eqn,
                           policy.pad_rows)
    x_op = ops[1 - w]
    w_shape, x_shape = eqn.invars[w].aval.shape, eqn.invars[1 - w].aval.shape
    want = policy.dense_layout(wq.qtype, x_op.qtype if isinstance(x_op, QArray) else None)
    w2 = dense.weight_in_layout(ax, wq, want, w_shape)
    m = math.prod(x_shape[d] for d in ax.x_free)
    m = m if isinstance(m, int) else -1  # a symbolic row count (jax.export)
    if not isinstance(x_op, QArray):
        if gemv.weight_only_applies(w2, m, policy):
            out2 = gemv.weight_only(ax, x_op, w2, policy)
        else:
            out2 = dense.weight_only_dense(ax, x_op, w2, policy, params.get("precision"))
    elif wq.qtype.kind == "float":
        out2 = dense.fp8_dense(ax, x_op, w2, policy)
    elif wq.qtype.group_size and gemv.grouped_applies(w2, m, policy):
        out2 = gemv.int_grouped(ax, x_op, w2, policy)
    elif wq.qtype.group_size and dense.decodes_whole(m, w2, policy):
        out2 = dense.int_grouped_as_float(ax, x_op, w2, policy)
    elif wq.qtype.group_size:
        out2 = dense.int_dense_grouped(ax, x_op, w2, policy)
    else:
        out2 = dense.int_dense(ax, x_op, w2, policy)
    return ax.out(out2, x_shape, w_shape).astype(out.dtype)


def _to_operand(site, eqn, op):
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


def _x_axes(eqn, w):
    """The activation's (operand ``1 - w``) contracted, batch and free axes."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    xc, xb = (lc, rc)[1 - w], (lb, rb)[1 - w]
    nd = eqn.invars[1 - w].aval.ndim
    return xc, xb, [d for d in range(nd) if d not in xc and d not in xb]


def _batched_digits_apply(site, eqn, ops, policy):
    """Whether a weight-only op whose weight has batch axes runs :func:`batched_digits`:
    a float activation with at most ``policy.gemv_rows`` rows per batch entry, and int
    codes of 8 bits or fewer with one scale per output channel."""
    w = site.weight_operand
    if w is None or not isinstance(ops[w], QArray) or isinstance(ops[1 - w], QArray):
        return False
    q = ops[w].qtype
    xc, _, free = _x_axes(eqn, w)
    shape = eqn.invars[1 - w].aval.shape
    rows = math.prod(shape[d] for d in free)
    k = math.prod(shape[d] for d in xc)
    return bool(policy.weight_only_digits and free and q.kind == "int" and q.bits <= 8
                and not q.group_size and isinstance(rows, int) and 0 < rows <= policy.gemv_rows
                and isinstance(k, int) and k <= dense.safe_k(np.int8, False, np.int8, True))


def batched_digits(site, eqn, ops, policy):
    """Float activation x int weight with batch axes (a mixture's experts) at few rows:
    the activation's rows become ``policy.weight_only_digits`` int8 digits each
    (:func:`gemv.digits`, per row and batch entry), stacked along its first free axis,
    for one int8 x int8 ``dot_general`` (XLA:CPU reads int8 weights fastest there,
    not through a float cast of the whole weight); the int32 results are scaled per
    digit and summed, then by the weight's scales."""
    w = site.weight_operand
    wq, x = _to_operand(site, eqn, ops[w]), ops[1 - w]
    dn = eqn.params["dimension_numbers"]
    xc, _, free = _x_axes(eqn, w)
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
    to_out = lambda a, i: _to_out_dot(a, i, dn, ndims)
    zw = _int_zp(wq.zero_point)
    acc = _int_acc(ops2[0], None, None, ops2[1], None, None, dn, to_out, pad_rows=policy.pad_rows)
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


def grouped_batched(site, eqn, ops, policy):
    """A grouped weight that keeps the op's own layout: one with batch axes (the experts
    of a mixture, ``"ecd,edf->ecf"``). The groups run along the weight's innermost
    contracted axis (``registry.groups``).

    Under ``policy.batched_groups``, int8 activations at up to
    ``policy.float_matmul_rows`` rows (any, where that is 0) split the contraction into
    groups: each grouped axis becomes ``(groups, g)``, the groups and the weight's other
    contracted axes (whose scales differ per position) become batch axes of one int8 x
    int8 -> int32 ``dot_general`` over ``g``, and the partial sums are scaled per group
    and summed. Otherwise (weight-only and fp8 formats too) the weight is decoded to
    float (codes minus zero point, times the group scales) for one float
    ``dot_general``, activation codes upcast exactly: on XLA:CPU that took 0.64-0.71x
    the time of the split groups at 1 and 8 tokens per expert (``benchmarks/formats.py
    --only experts``), as ``batched_groups=False`` in its table says of 2-D weights."""
    w = site.weight_operand
    wq = _to_operand(site, eqn, ops[w])
    dn = eqn.params["dimension_numbers"]
    (lc, rc), (lb, rb) = dn
    wc, xc = (lc, rc)[w], (lc, rc)[1 - w]
    gpos = wc.index(max(wc))  # the grouped axis, and the activation's axis paired with it
    x, (qw, sw, zw) = ops[1 - w], (wq.values, wq.scale, wq.zero_point)
    ndims = [v.aval.ndim for v in eqn.invars]
    rows = math.prod(eqn.invars[1 - w].aval.shape[d] for d in _x_axes(eqn, w)[2])
    rows = rows if isinstance(rows, int) else -1  # a symbolic row count (jax.export)
    ints = (policy.batched_groups and isinstance(x, QArray)
            and x.qtype.kind == wq.qtype.kind == "int")
    if not ints or (policy.float_matmul_rows and rows > policy.float_matmul_rows):
        wf = groups.dequantize(qw, sw, zw, wq.qtype, wc[gpos])
        if not isinstance(x, QArray):
            args = [x, wf.astype(x.dtype)] if w == 1 else [wf.astype(x.dtype), x]
            return lax.dot_general(*args, dn, precision=eqn.params.get("precision"),
                                   preferred_element_type=eqn.params.get("preferred_element_type"))
        qx, sx, zx, _ = _tup(x)  # fp8 activation codes come decoded
        xf = qx.astype(_F32) - (0 if zx is None else jnp.round(zx.astype(_F32)))
        args = [xf, wf] if w == 1 else [wf, xf]
        out = lax.dot_general(*args, dn, preferred_element_type=_F32)
        return out * _to_out_dot(sx.astype(_F32), 1 - w, dn, ndims)
    n = qw.shape[wc[gpos]] // wq.qtype.group_size
    qx, sx, zx, _ = _tup(x)
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
    to_out = lambda a, i: _to_out_dot(a, i, new_dn, new_nd)
    (qa, sa, za), (qb, sb, zb) = opnds
    acc = _int_acc(qa, _int_zp(za), None, qb, _int_zp(zb), None, new_dn, to_out,
                   pad_rows=policy.pad_rows).astype(_F32)
    out = acc * (to_out(sa.astype(_F32), 0) * to_out(sb.astype(_F32), 1))
    nb = len(lb)
    return jnp.sum(out, axis=tuple(range(nb, nb + len(others) + 1)))


def gather(site, eqn, ops):
    """An embedding lookup on a quantized table: gather the codes and the row (or
    group) scales with the same indices, decode, scale."""
    table, idx = ops
    params = dict(eqn.params)
    out = eqn.outvars[0].aval
    codes = table.values
    shape = eqn.invars[0].aval.shape
    dn = params["dimension_numbers"]
    if table.layout == "kn" and _row_lookup(eqn):
        # a table tied to a weight-only matmul, stored (K, N) = transposed: gather columns
        params["dimension_numbers"] = dn._replace(collapsed_slice_dims=(1,), start_index_map=(1,))
        params["slice_sizes"] = (codes.shape[0], 1)
    else:
        if table.layout == "kn":
            codes = codes.T
        if codes.shape != shape:  # nibbles packed along the last axis
            params["slice_sizes"] = tuple(params["slice_sizes"][:-1]) + (codes.shape[-1],)
    if params.get("fill_value") is not None and jnp.issubdtype(codes.dtype, jnp.integer):
        # jnp.take fills out-of-range rows with NaN: codes get 0, and a per-row scale
        # gathered below with the NaN fill makes those rows NaN as in float
        params["fill_value"] = 0
    g = compat.gather_p.bind(codes, idx, **params)
    if g.shape != out.shape:
        g = unpack_nibbles(g, _out_axis(eqn, len(shape) - 1))
    val = nx.decode(g, table.qtype.grid)
    s, z = table.scale, table.zero_point
    for a, is_zp in ((z, True), (s, False)):  # (codes - zero_point) * scale
        if a is None:
            continue
        a = a.astype(_F32)
        if a.ndim:
            sp = dict(eqn.params)
            sp["slice_sizes"] = tuple(min(n, a.shape[d]) for d, n in enumerate(eqn.params["slice_sizes"]))
            a = compat.gather_p.bind(a, idx, **sp)
            if table.qtype.group_size and site.contract[0]:
                d = _out_axis(eqn, site.contract[0][-1])
                a = jnp.repeat(a, table.qtype.group_size, axis=d) if a.shape[d] != out.shape[d] else a
        if is_zp:
            val = val - jnp.round(a)
        else:
            val = val * a
    return val.astype(out.dtype)


def _row_lookup(eqn):
    """Whether the gather reads whole rows of a 2-D table by row index (``table[ids]``)."""
    dn = eqn.params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    return (len(shape) == 2 and tuple(eqn.params["slice_sizes"]) == (1, shape[1])
            and tuple(dn.collapsed_slice_dims) == (0,)
            and tuple(dn.start_index_map) == (0,) and not getattr(dn, "operand_batching_dims", ()))


def _out_axis(eqn, operand_axis):
    """The output axis of a gather that holds ``operand_axis`` of the table (an offset dim)."""
    dn = eqn.params["dimension_numbers"]
    kept = [d for d in range(eqn.invars[0].aval.ndim) if d not in dn.collapsed_slice_dims
            and d not in getattr(dn, "operand_batching_dims", ())]
    return dn.offset_dims[kept.index(operand_axis)]
