"""The kernel of ``lax.ragged_dot``: a mixture of experts' grouped matmul.

``x (M, K)``, its rows sorted by expert, times the experts' weights ``w (G, K, N)``,
``group_sizes (G,)`` rows each (rows past their sum give zeros). The weight keeps its
own layout (``"operand"``, int4 codes two per byte along N), with one scale per expert
and output channel ``(G, 1, N)``, or per group of K ``(G, K / g, N)``.

- int activation codes and a symmetric per-channel int weight, from
  ``KernelPolicy.ragged_int_rows`` rows up: one integer
  ``ragged_dot`` with int32 sums; the activation's zero point is corrected by the
  weight's sums over K, and each row is scaled by its expert's channel scales
  (:func:`integer`);
- otherwise (weight-only, grouped or asymmetric weights, fp8, nf4): the weight decoded
  to float for one float ``ragged_dot``, int activation codes upcast exactly
  (:func:`decoded`).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import dense, groups
from .intdot import float_act, operand_tuple, to_operand
from .qparams import QArray

_I32 = jnp.int32
_F32 = jnp.float32


def run(site, eqn, ops, policy):
    """The op on its operands (a :class:`jqt.QArray` per quantized one)."""
    x, wq, sizes = ops
    wq = to_operand(site, eqn, wq)  # int4 codes unpacked
    k = eqn.invars[1].aval.shape[1]
    ints = isinstance(x, QArray) and x.qtype.kind == "int" and wq.qtype.kind == "int"
    rows = eqn.invars[0].aval.shape[0]
    if not (ints and policy.ragged_int_rows > 0 and not wq.qtype.group_size and wq.zero_point is None
            and k <= dense.safe_k(np.int8, x.zero_point is not None, np.int8, False)):
        return decoded(eqn, x, wq, sizes)
    if not isinstance(rows, int):  # symbolic (jax.export): which it is, chosen when it runs
        return lax.cond(jnp.asarray(rows) >= policy.ragged_int_rows,
                        lambda: integer(eqn, x, wq, sizes), lambda: decoded(eqn, x, wq, sizes))
    return (integer if rows >= policy.ragged_int_rows else decoded)(eqn, x, wq, sizes)


def row_groups(sizes, m):
    """Each of ``m`` rows' group (expert), and whether the row is in one (rows past
    ``sum(sizes)`` are not).

    >>> import jax.numpy as jnp
    >>> [a.tolist() for a in row_groups(jnp.array([2, 0, 1]), 4)]
    [[0, 0, 2, 2], [True, True, True, False]]
    """
    ends = jnp.cumsum(sizes)
    rows = jnp.arange(m)
    return jnp.minimum(jnp.searchsorted(ends, rows, side="right"), sizes.shape[0] - 1), rows < ends[-1]


def live_count(sizes, m):
    """How many of ``m`` rows are in an expert: ``min(sum(sizes), m)`` (int32, traced).

    >>> int(live_count(jnp.array([2, 0, 1]), 5)), int(live_count(jnp.array([4, 3]), 5))
    (3, 5)
    """
    return jnp.minimum(jnp.sum(sizes.astype(_I32)), m)


def integer(eqn, x, wq, sizes):
    """int codes x int codes -> int32 sums per row and channel, then scaled per row by the
    activation's scale and its expert's channel scales."""
    qx, sx, zx, _ = operand_tuple(x)
    acc = lax.ragged_dot_general(qx, wq.values, sizes, eqn.params["ragged_dot_dimension_numbers"],
                                 precision=dense.INT_PRECISION, preferred_element_type=_I32)
    g, live = row_groups(sizes, qx.shape[0])
    if zx is not None:  # sum (qx - zx) qw = sum qx qw - zx sum qw
        wsum = jnp.sum(wq.values, axis=1, dtype=_I32)  # (G, N)
        acc = acc - jnp.round(zx.astype(_F32)).astype(_I32) * wsum[g]
    sw = wq.scale.astype(_F32)  # (G, 1, N) per expert and channel, or one (per tensor)
    sw = sw[:, 0, :][g] if sw.ndim == 3 else sw
    out = dense.scaled(acc.astype(_F32), sx.astype(_F32), sw)
    return [jnp.where(live[:, None], out, 0.0).astype(eqn.outvars[0].aval.dtype)]


def decoded(eqn, x, wq, sizes):
    """The weight decoded to float (codes minus zero point, times the scales of each
    expert's channels or groups) for one float ``ragged_dot``."""
    wf = groups.dequantize(wq.values, wq.scale, wq.zero_point, wq.qtype, 1)
    rd, out_dtype = eqn.params["ragged_dot_dimension_numbers"], eqn.outvars[0].aval.dtype
    if not isinstance(x, QArray):  # in the output's type where it is wider (bfloat16 -> float32),
        ct = jnp.promote_types(x.dtype, out_dtype)  # as the simulated path computes
        return [lax.ragged_dot_general(x.astype(ct), wf.astype(ct), sizes, rd, precision=dense.code_precision(eqn.params["precision"]),
                                       preferred_element_type=eqn.params["preferred_element_type"])]
    xf, hi = float_act(x)  # exact codes, times the scale's part below 1
    out = lax.ragged_dot_general(xf, wf, sizes, rd, precision=dense.code_precision(), preferred_element_type=_F32)
    # padding rows give 0 (ragged_dot's 0 times a dynamic row scale of inf would be NaN)
    _, live = row_groups(sizes, xf.shape[0])
    return [jnp.where(live[:, None], out * hi, 0.0).astype(out_dtype)]
