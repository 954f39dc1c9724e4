"""What happens at each quantizable op, per mode.

A handler has ``site(site, eqn, invals, ctx) -> outvals`` and says whether it
``collects`` state (calibration statistics, or the report's error sums) and
whether it must stay ``differentiable`` (the simulated path). A collecting
handler also has ``identity(shapes)``, ``merge(a, b)`` and
``reduce_iterations(stacked)``, each on a dict keyed by op key, which the
interpreter uses under ``cond`` / ``while`` / ``scan``.
"""
from __future__ import annotations

import jax.numpy as jnp

from . import compat, kernels, stats
from . import numerics as nx
from .dense import DenseAxes
from .policy import KernelPolicy
from .qparams import OpQParams

_F32 = jnp.float32


class QParamsMismatchError(ValueError):
    """qparams do not match the function they are used with.

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> try:
    ...     jqt.quantize(lambda w, x: x @ w + x @ w.T, qp)(jnp.eye(2), jnp.ones((1, 2)))
    ... except jqt.QParamsMismatchError as e:
    ...     print(str(e)[:47])
    jqt: no quantization parameters for ops ['w#1']
    """


class Calibrate:
    """Runs the float function and records each op's statistics (a
    :class:`~jqt._src.stats.SiteStats`: the rule's activation calibrator's state
    and, while ``observe_weights``, the weight calibrator's range).

    Ops with an entry in ``ctx.state_in`` (already calibrated, for
    error-propagating calibration) run simulated instead and record nothing.
    """

    collects = True
    differentiable = False

    def __init__(self, recipe, observe_weights: bool):
        self.recipe = recipe
        self.observe_weights = observe_weights

    def site(self, site, eqn, invals, ctx):
        if site.key in ctx.state_in:
            return Simulate().site(site, eqn, invals, ctx)
        outs = compat.bind_eqn(eqn, invals)
        rule = self.recipe.rule_for(site.op, site.key)
        w = site.weight_operand
        if rule is None or w is None or rule.weight is None:
            return outs
        act, weight, cal = None, None, None
        if rule.activation is not None and not rule.activation.dynamic:
            cal = rule.calibrator
            act = cal.observe(invals[1 - w].astype(_F32))
        if self.observe_weights:
            pc = rule.weight.per_channel
            lo, hi = rule.weight_calibrator.range(invals[w].astype(_F32),
                                                  site.contract[w] if pc else None, rule.weight)
            weight = {"min": jnp.asarray(lo, _F32), "max": jnp.asarray(hi, _F32)}
        ctx.state_out[site.key] = stats.SiteStats(act, weight, cal)
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


def _expected_scale_shape(site, i, shape, qtype):
    if not qtype.per_channel:
        return ()
    return tuple(1 if d in site.contract[i] else n for d, n in enumerate(shape))


def lookup(ctx, site, invals):
    """(OpQParams, PackedWeight or None) for ``site``, checked against the op."""
    entry = ctx.state_in.get(site.key)
    if entry is None:
        raise QParamsMismatchError(
            f"jqt: no quantization parameters for op '{site.key}' ({site.op} at "
            f"'{site.name_stack or '<top>'}'). The qparams were made for another function or "
            "another weight_argnums; run jqt.calibrate on this function.")
    qp, packed = entry
    if not isinstance(qp, OpQParams):
        raise QParamsMismatchError(f"jqt: qparams['{site.key}'] is a {type(qp).__name__}, "
                                   "expected jqt.OpQParams.")
    if qp.op != site.op or qp.weight_operand != site.weight_operand:
        raise QParamsMismatchError(
            f"jqt: qparams['{site.key}'] describes a {qp.op} with weight operand "
            f"{qp.weight_operand}, but the function has a {site.op} with weight operand "
            f"{site.weight_operand} there. Re-calibrate for this function.")
    for i in (0, 1):
        q = qp.operand(i)
        if q is None or q.scale is None or (i != site.weight_operand and not q.qtype.per_channel):
            continue
        want = _expected_scale_shape(site, i, invals[i].shape, q.qtype)
        if tuple(q.scale.shape) != want:
            raise QParamsMismatchError(
                f"jqt: qparams['{site.key}'] has a {'lhs' if i == 0 else 'rhs'} scale of shape "
                f"{tuple(q.scale.shape)}, but the operand {tuple(invals[i].shape)} needs "
                f"{want}. The weights changed shape since calibration; re-calibrate.")
    if packed is not None:
        w = site.weight_operand
        if tuple(packed.qvalue.shape) != _packed_shape(site, invals, packed.layout):
            raise QParamsMismatchError(
                f"jqt: the packed weight for '{site.key}' has shape {tuple(packed.qvalue.shape)} "
                f"but the op reads a weight of shape {tuple(invals[w].shape)}. Re-run jqt.pack.")
    return qp, packed


def _weight_axes(site, invals):
    if site.op != "dot_general":
        return None
    return DenseAxes.of(site.eqn.params["dimension_numbers"], [jnp.ndim(v) for v in invals],
                        site.weight_operand)


def _packed_shape(site, invals, layout):
    shape = tuple(invals[site.weight_operand].shape)
    ax = _weight_axes(site, invals) if layout != "operand" else None
    return shape if ax is None else ax.shape_2d(shape, layout)


def _operand_params(site, i, x, q):
    if q.qtype.dynamic:
        return nx.dynamic_params(x, site.contract[i], q.qtype)
    return q.scale, q.zero_point


def _dequant(packed, q, site, invals):
    v = packed.qvalue
    if packed.layout != "operand":
        v = _weight_axes(site, invals).weight_from_2d(v, packed.layout, invals[site.weight_operand].shape)
    v = v.astype(_F32)
    if q.zero_point is not None:
        v = v - jnp.round(q.zero_point.astype(_F32))  # as pack and the integer path do
    return v * q.scale


class Simulate:
    """Float simulation: fake-quantize the operands, run the float op."""

    collects = False
    differentiable = True

    def site(self, site, eqn, invals, ctx):
        qp, packed = lookup(ctx, site, invals)
        vals = list(invals)
        for i in (0, 1):
            q = qp.operand(i)
            if q is None:
                continue
            if packed is not None and i == site.weight_operand:
                vals[i] = _dequant(packed, q, site, invals).astype(invals[i].dtype)
            else:
                s, z = _operand_params(site, i, vals[i], q)
                vals[i] = nx.fake_quant(vals[i], s, z, q.qtype)
        return compat.bind_eqn(eqn, vals)


class Integer:
    """Integer path: quantize operands to int8, run the int8 x int8 -> int32 kernel
    in the formulation ``policy`` picks (default: the table's, for the backend
    in use when the function is traced)."""

    collects = False
    differentiable = False

    def __init__(self, policy=None):
        self.policy = policy

    def site(self, site, eqn, invals, ctx):
        qp, packed = lookup(ctx, site, invals)
        if qp.is_float:
            return compat.bind_eqn(eqn, invals)
        ops, layout, wide = [], "operand", None
        for i in (0, 1):
            q, x = qp.operand(i), invals[i]
            if q is None:
                ops.append((x, None, None, None))
            elif packed is not None and i == site.weight_operand:
                ops.append((packed.qvalue, q.scale, q.zero_point, packed.wsum))
                layout = packed.layout
            else:
                s, z = _operand_params(site, i, x, q)
                ops.append((nx.quantize(x, s, z, q.qtype), s, z, None))
                if q.qtype.bits > 8:
                    wide = i
        policy = self.policy or KernelPolicy.for_backend()
        if wide is None:
            return [kernels.run(site, eqn, ops, policy, layout)]
        # int16 activation (symmetric): q = 256 * hi + (lo + 128), two int8 kernels.
        q16, s, _, _ = ops[wide]
        hi, lo = nx.split_int16(q16)
        ops_hi, ops_lo = list(ops), list(ops)
        ops_hi[wide] = (hi, s, None, None)
        ops_lo[wide] = (lo, s, jnp.float32(-128.0), None)
        out_hi = kernels.run(site, eqn, ops_hi, policy, layout).astype(_F32)
        out_lo = kernels.run(site, eqn, ops_lo, policy, layout).astype(_F32)
        return [(256.0 * out_hi + out_lo).astype(eqn.outvars[0].aval.dtype)]
