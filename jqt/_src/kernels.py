"""Integer kernels: :func:`run` picks the formulation of a quantized op (``policy.py``).

A weight matmul runs as a 2-D matmul over a packed weight, its activation as rows
(``denserows.py``, which picks among ``dense.py``, ``gemv.py`` at few rows and jqt's native
kernels ``native.py``), a weight with batch axes (a mixture's experts) through
``experts.py``, a convolution with few input channels as a patch matmul on CPU
(``patches.py``), anything else through the generic integer ``dot_general`` of
``intdot.py`` or the convolution below; an embedding lookup through :func:`gather`.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat, dense, denserows, diagnostics, experts, groups, intdot, native, patches
from . import numerics as nx
from .dense import DenseAxes
from .formats import FLOAT8, unpack_nibbles
from .intdot import int_zp, operand_tuple, to_operand, to_out_dot
from .layerview import LayerView
from .qparams import QArray

_I32 = jnp.int32
_F32 = jnp.float32


def _conv_params(params):
    """The op's own parameters, for :func:`_conv` (its result type chosen there)."""
    return {k: v for k, v in params.items() if k != "preferred_element_type"}


_KEEP = object()


def _conv(lhs, rhs, cp, preferred_element_type=None, precision=_KEEP):
    """``lax.conv_general_dilated(lhs, rhs, **cp)`` bound as the primitive, with the op's
    parameters ``cp`` as its equation holds them: lax's function refuses a padding in
    symbolic dimensions (a strided ``"SAME"`` convolution exported with a symbolic image
    size; ``operator.index``), which the primitive takes. ``precision``: one for both
    operands (the op's own by default).

    >>> import jax
    >>> x, w = jnp.ones((1, 4, 4, 2)), jnp.ones((3, 3, 2, 1))
    >>> op = lambda x, w: lax.conv_general_dilated(x, w, (2, 2), "SAME",
    ...                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> cp = _conv_params(jax.make_jaxpr(op)(x, w).eqns[0].params)
    >>> _conv(x, w, cp)[0, :, :, 0].tolist(), bool((_conv(x, w, cp) == op(x, w)).all())
    ([[18.0, 12.0], [12.0, 8.0]], True)
    """
    p = dict(cp, preferred_element_type=None if preferred_element_type is None
             else np.dtype(preferred_element_type))
    if precision is not _KEEP:
        p["precision"] = None if precision is None else (precision, precision)
    p["padding"] = tuple(tuple(pad) for pad in p["padding"])
    if "out_sharding" in p:
        p["out_sharding"] = None  # from the operands, as lax's function leaves it
    return compat.bind(compat.conv_general_dilated_p, lhs, rhs, **p)


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


def _nhwc_hwio(dn) -> bool:
    """Whether a convolution's dimension numbers are 2-D ``NHWC`` / ``HWIO`` / ``NHWC``."""
    return (tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)) == \
        ((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))


def _int_conv(qx, qw, cp, as_float, w_bound=128):
    """``conv(qx, qw)`` of integer codes, int32: XLA's int8 convolution, or with
    ``as_float`` (a layout XLA:CPU widens to int32, slowly) float32 convolutions of the
    codes over chunks of input channels whose sums stay below ``2**24`` (exact), added
    in int32 (a grouped convolution's chunks take the same channels of every group).
    A ``batch_group_count`` convolution whose sums may exceed that runs as XLA's.
    ``w_bound``: the largest magnitude of a weight code (8 for int4, 7 narrow)."""
    dn = cp["dimension_numbers"]
    if not as_float or _nhwc_hwio(dn):
        return _conv(qx, qw, cp, _I32)
    window = int(np.prod([qw.shape[d] for d in dn.rhs_spec[2:]]))
    per_in = window * 255 * w_bound  # |one input's terms|
    step = max((1 << 24) // per_in, 1)
    cin = qw.shape[dn.rhs_spec[1]]
    f = lambda a, b: lax.round(_conv(a.astype(_F32), b.astype(_F32), cp,
                                     precision=lax.Precision.HIGHEST)).astype(_I32)
    if cin <= step:  # one convolution, grouped or not
        return f(qx, qw)
    if cp.get("batch_group_count", 1) != 1:
        return _conv(qx, qw, cp, _I32)
    groups = cp.get("feature_group_count", 1)
    out = None
    for c0, c1 in dense.chunks(cin, step):  # the fewest chunks, of near-equal lengths
        part = f(_group_channels(qx, dn.lhs_spec[1], groups, c0, c1),
                 lax.slice_in_dim(qw, c0, c1, axis=dn.rhs_spec[1]))
        out = part if out is None else out + part
    return out


def _group_channels(x, axis, groups, c0, c1):
    """The input channels ``c0:c1`` of every one of ``groups`` feature groups of ``x``
    (its ``axis`` holds the groups one after another): the lhs of a grouped convolution
    over that slice of each group's channels."""
    if groups == 1:
        return lax.slice_in_dim(x, c0, c1, axis=axis)
    shape = x.shape
    split = x.reshape(shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1:])
    part = lax.slice_in_dim(split, c0, c1, axis=axis + 1)
    return part.reshape(shape[:axis] + (groups * (c1 - c0),) + shape[axis + 1:])


def conv(x_op, w_op, params, eqn, codes_as_float=False, w_bound=128):
    """Integer (or weight-only) convolution; the activation is the lhs, with a
    per-tensor or per-example scale and zero point (``codes_as_float``, ``w_bound``: see
    :func:`_int_conv`)."""
    (qx, sx, zx, _), (qw, sw, zw, wsum) = x_op, w_op
    if zw is not None:
        raise NotImplementedError("jqt: asymmetric conv weights are not supported; use "
                                  "QuantType(symmetric=True) for conv weights.")
    cp = _conv_params(params)
    out_dtype = eqn.outvars[0].aval.dtype
    out_ndim = eqn.outvars[0].aval.ndim
    dn = params["dimension_numbers"]
    cp["precision"] = dense.code_precision(cp.get("precision"))  # (not a preset's float16)
    if sx is None:  # weight-only
        # the codes' sums exceed float16's range: float32 there
        dt, pref = nx.codes_dot_types(qx.dtype, params.get("preferred_element_type"))
        if jnp.dtype(out_dtype) == _F32:
            # 16-bit activations into a float32 op: it computes in float32, so the decoded
            # weight (nf4's table values, which bfloat16 rounds) stays float32, as the dense
            # kernel's does
            dt, pref = _F32, _F32
        out = _conv(qx.astype(dt), qw.astype(dt), cp, pref)
        return (out.astype(_F32) * _out_channel(sw.astype(_F32), params, out_ndim)).astype(out_dtype)
    cp["precision"] = dense.INT_PRECISION
    if qx.dtype == jnp.int16:  # w8a16's codes whole (takes_wide): exact products, float32 sums
        acc = _conv(qx.astype(_F32), qw.astype(_F32), cp, precision=lax.Precision.HIGHEST)
        sx = _out_batch(sx.astype(_F32), params, out_ndim)
        return dense.scaled(acc, sx, _out_channel(sw.astype(_F32), params, out_ndim)).astype(out_dtype)
    zx = _out_batch(int_zp(zx), params, out_ndim)
    if zx is not None and zx.ndim == 0 and all(d == 1 for d in cp["lhs_dilation"]):
        # pad with the zero point, whose real value is exactly 0, then correct by
        # zx * (sum of the kernel of each output channel).
        cfg = [(0, 0, 0)] * qx.ndim
        for d, (lo, hi) in zip(dn.lhs_spec[2:], cp["padding"]):
            cfg[d] = (lo, hi, 0)
        qx = lax.pad(qx, zx.astype(qx.dtype).reshape(()), cfg)
        cp["padding"] = ((0, 0),) * len(cp["padding"])
        acc = _int_conv(qx, qw, cp, codes_as_float, w_bound)
        if wsum is None:
            axes = tuple(d for d in range(qw.ndim) if d != dn.rhs_spec[0])
            wsum = jnp.sum(qw, axis=axes, keepdims=True, dtype=_I32)
        acc = acc - zx * _out_channel(wsum, params, out_ndim)
    else:
        acc = _int_conv(qx, qw, cp, codes_as_float, w_bound)
        if zx is not None:
            # per-example zero points or a dilated input: subtract zx times the conv of
            # the indicator of real input positions (the same for every example).
            shape = list(qx.shape)
            shape[dn.lhs_spec[0]] = 1
            ones = jnp.ones(shape, np.int8)
            acc = acc - zx * _int_conv(ones, qw, cp, codes_as_float, w_bound)
    sx = _out_batch(sx.astype(_F32), params, out_ndim)
    out = dense.scaled(acc.astype(_F32), sx, _out_channel(sw.astype(_F32), params, out_ndim))
    return out.astype(out_dtype)


def _fp8_generic(site, eqn, ops):
    """fp8 x fp8 (or fp8 weight x float) on the generic path: the fp8 values upcast to
    float32 (exact), the float op summed in float32, then the scales. A weight with group scales (which
    vary along the contraction) is scaled before the op, as the simulated path does. Against
    a float operand the codes are taken in units of ``numerics.FP8_BITS_UNIT`` (at most
    1.75), the unit folded into their scale: as values (up to 448 and 57344) times
    activations above about 7e35 and 6e33 they overflowed where the real products do not
    (fp8 x fp8: values, whose products are at most 57344 ** 2)."""
    w = site.weight_operand
    grouped = [isinstance(op, QArray) and bool(op.qtype.group_size) for op in ops]  # the weight
    against_float = not all(isinstance(op, QArray) for op in ops)
    vals, units = list(ops), [1.0] * len(ops)
    for i, op in enumerate(ops):
        if not isinstance(op, QArray):
            continue
        q = op.qtype
        if against_float and not grouped[i] and q.grid in FLOAT8 and op.values.dtype == FLOAT8[q.grid]:
            units[i] = nx.FP8_BITS_UNIT[q.grid]
            vals[i] = nx.fp8_units(lax.bitcast_convert_type(op.values, jnp.uint8), q.grid)
        else:
            vals[i] = nx.decode(op.values, q.grid)
    for i, op in enumerate(ops):
        if grouped[i]:  # its groups run along the axis the registry's entry names
            vals[i] = groups.dequantize(op.values, op.scale, None, op.qtype, site.entry.groups(site))
    # in float32: fp8 values are up to 57344 units of their scale, beyond float16's range
    out = compat.bind_eqn(eqn, [v.astype(_F32) for v in vals], kernel=True, preferred_element_type=_F32,
                          precision=dense.code_precision(eqn.params.get("precision")))[0]
    each = []  # applied by dense.scaled: their product first, one by one where it is subnormal
    for i, op in enumerate(ops):
        if isinstance(op, QArray) and not grouped[i]:
            s = op.scale.astype(_F32) * units[i]
            if site.op == "dot_general":
                s = to_out_dot(s, i, eqn.params["dimension_numbers"], [v.ndim for v in vals])
            else:
                nd = eqn.outvars[0].aval.ndim
                s = _out_channel(s, eqn.params, nd) if i == w else _out_batch(s, eqn.params, nd)
            each.append(s)
    return dense.scaled(out, *each) if each else out


def takes_wide(site, eqn, ops, policy) -> bool:
    """Whether :func:`run` takes an int16 activation's codes (w8a16) whole: a
    ``dot_general`` whose int weight is dense (``DenseAxes``, no batch axes), which
    ``denserows.formulate`` runs as float codes (the native kernel, or
    ``KernelPolicy.int16_as_float``) or splits into int8 halves itself; a convolution
    under ``int16_as_float`` that is no patch matmul (:func:`conv`: one float32
    convolution of the codes). Other ops get the halves (``dense.int16_halves``)."""
    w = site.weight_operand
    if w is None or site.op not in ("dot_general", "conv_general_dilated") or site.batch_axes():
        return False
    wq = ops[w].sliced if isinstance(ops[w], LayerView) else ops[w]
    if not isinstance(wq, QArray) or wq.qtype.kind != "int":
        return False
    if site.op == "conv_general_dilated":
        in_ch = eqn.invars[1].aval.shape[eqn.params["dimension_numbers"].rhs_spec[1]]
        return policy.int16_as_float and not patches.applies(eqn.params, in_ch, policy,
                                                             eqn.outvars[0].aval.shape)
    return DenseAxes.of(eqn.params["dimension_numbers"], [v.aval.ndim for v in eqn.invars], w,
                        grouped=bool(wq.qtype.group_size)) is not None


def run(site, eqn, ops, policy):
    """The op of ``site`` on ``ops``: per operand a :class:`jqt.QArray` of codes (in its
    ``layout``) or the float array. A dense weight runs through ``dense.py`` in the
    layout the policy picks; everything else through the generic kernels above."""
    params, out = eqn.params, eqn.outvars[0].aval
    w = site.weight_operand
    view = ops[w] if w is not None and isinstance(ops[w], LayerView) else None
    if view is not None:  # a layer of stacked packed weights: the native kernels read it in place
        ops = list(ops)
        ops[w] = view.sliced
    wq = ops[w] if w is not None else None
    packed_2d = isinstance(wq, QArray) and wq.layout != "operand"  # dense path below
    grouped = isinstance(wq, QArray) and bool(wq.qtype.group_size)
    if isinstance(wq, QArray) and site.batch_axes():
        res = experts.run(site, eqn, ops, policy)
        if res is not None:
            return res.astype(out.dtype)
    if not packed_2d and any(isinstance(o, QArray) and o.qtype.kind == "float" for o in ops):
        return _fp8_generic(site, eqn, [to_operand(site, eqn, o) for o in ops]).astype(out.dtype)
    if site.op == "conv_general_dilated":
        x_op, w_op = operand_tuple(ops[0]), operand_tuple(to_operand(site, eqn, ops[1]))
        in_ch = w_op[0].shape[params["dimension_numbers"].rhs_spec[1]]
        if x_op[1] is not None and patches.applies(params, in_ch, policy, out.shape):
            return patches.conv(x_op, w_op, params, out.shape).astype(out.dtype)
        wt = ops[1].qtype if isinstance(ops[1], QArray) else None
        w_bound = max(-int(wt.qmin), int(wt.qmax)) if wt is not None and wt.kind == "int" else 128
        return conv(x_op, w_op, params, eqn, policy.conv_codes_as_float, w_bound)
    ax = DenseAxes.of(params["dimension_numbers"], [v.aval.ndim for v in eqn.invars], w,
                      grouped=grouped)
    if ax is None:
        return intdot.dot_general([operand_tuple(to_operand(site, eqn, o)) for o in ops], params, eqn,
                           policy.pad_rows)
    x_op = ops[1 - w]
    if not isinstance(x_op, QArray) and jnp.dtype(x_op.dtype) in (jnp.bfloat16, jnp.float16) \
            and jnp.dtype(out.dtype) == jnp.float32:
        # 16-bit activations into a float32 op (float32 weights): the op computes in
        # float32, so its weight decodes to float32, not to the activation's dtype
        x_op = x_op.astype(out.dtype)
    w_shape, x_shape = eqn.invars[w].aval.shape, eqn.invars[1 - w].aval.shape
    want = policy.dense_layout(wq.qtype, x_op.qtype if isinstance(x_op, QArray) else None)
    if packed_2d and not isinstance(x_op, QArray) and not grouped and wq.qtype.kind == "int":
        want = wq.layout  # weight-only per channel (w8): every formulation reads either layout
    if packed_2d and wq.layout != want:
        names = {"nk": "(N, K)", "kn": "(K, N)"}
        diagnostics.warn_grouped(
            ("layout", wq.layout), f"jqt.quantize: op '{site.key}': the weight was packed "
            f"{names[wq.layout]} (another policy, or an older file), and this kernel policy reads "
            f"it {names[want]}: it is converted on every call. Pack for this policy (jqt.pack("
            "qparams, params, policy=...), the policy given to jqt.quantize) to skip the "
            "conversion.", f"'{site.key}'")
    to_layout = lambda q: dense.weight_in_layout(ax, q, want, w_shape)
    w2 = to_layout(wq)
    stack = native.in_place(view, wq, w2, to_layout) if policy.native_in_place else None
    out2 = denserows.run(denserows.as_rows(ax, x_op), w2, stack, policy, dense.code_precision(params.get("precision")))
    return ax.out(out2, x_shape, w_shape).astype(out.dtype)


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
    filled = _in_range(eqn, idx)
    if filled is not None and jnp.issubdtype(codes.dtype, jnp.integer):
        params["fill_value"] = 0  # out-of-range rows get the fill value below
    g = compat.bind(compat.gather_p, codes, idx, **params)
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
            a = compat.bind(compat.gather_p, a, idx, **sp)
            if table.qtype.group_size and site.contract[0]:
                d = _out_axis(eqn, site.contract[0][-1])
                a = groups.repeat(a, table.qtype.group_size, d) if a.shape[d] != out.shape[d] else a
        if is_zp:
            val = val - jnp.round(a)
        else:
            val = val * a
    if filled is not None:  # as the float gather: its fill value (NaN by default) there
        fill = eqn.params.get("fill_value")
        val = jnp.where(filled, val, jnp.nan if fill is None else fill)
    return val.astype(out.dtype)


def _in_range(eqn, idx):
    """For a gather in fill mode (``jnp.take``'s default, ``.at[i].get(mode="fill")``), a
    boolean mask, broadcastable to its output, of the slices it reads in range (the others
    take ``fill_value``); ``None`` in the other modes. The same gather of a table of
    ``True`` holding only the indexed axes (size 1 on the others) with ``False`` as fill.

    >>> import jax, jax.numpy as jnp
    >>> take = jax.make_jaxpr(lambda t, i: jnp.take(t, i, axis=0))(jnp.ones((3, 4)), jnp.arange(2))
    >>> eqn = take.eqns[-1].params["jaxpr"].eqns[-1]  # the gather inside jnp.take's jit
    >>> eqn.primitive.name, eqn.params["fill_value"]
    ('gather', nan)
    >>> _in_range(eqn, jnp.array([[2], [3]])).ravel().tolist()
    [True, False]
    """
    params = dict(eqn.params)
    mode = params.get("mode")
    if getattr(mode, "name", str(mode)) != "FILL_OR_DROP":
        return None
    dn = params["dimension_numbers"]
    shape = eqn.invars[0].aval.shape
    if getattr(dn, "operand_batching_dims", ()):  # the whole table's shape, for its batch axes
        ones = jnp.ones(shape, bool)
    else:
        keep = set(dn.start_index_map)
        ones = jnp.ones(tuple(n if d in keep else 1 for d, n in enumerate(shape)), bool)
        params["slice_sizes"] = tuple(n if d in keep else 1 for d, n in enumerate(params["slice_sizes"]))
    params["fill_value"] = False
    return compat.bind(compat.gather_p, ones, idx, **params)


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
