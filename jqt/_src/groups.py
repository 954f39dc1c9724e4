"""Per-group scales: one scale per ``g`` consecutive elements of one axis.

A grouped scale has the operand's rank, with ``n / g`` on the grouped axis
(the innermost contracting axis of a weight) and 1 on the other contracting
axes. :func:`expand` repeats it to the operand's shape; :func:`weight_range`
asks a weight calibrator for one range per group.
"""
from __future__ import annotations

import jax.numpy as jnp


def expand(a, group_size, axis, shape):
    """A grouped scale or zero point -> broadcastable to an operand of ``shape``.

    >>> expand(jnp.array([[1.0, 2.0]]), 2, 1, (1, 4)).tolist()
    [[1.0, 1.0, 2.0, 2.0]]
    """
    if a is None or not group_size or jnp.ndim(a) == 0:
        return a
    axis = axis % len(shape)
    if a.shape[axis] == shape[axis]:
        return a
    return jnp.repeat(a, group_size, axis=axis)


def weight_range(calibrator, w, axes, qtype, group_axis):
    """The calibrator's ``(lo, hi)`` with ``keepdims`` over ``axes`` or, with groups, over
    each group of ``qtype.group_size`` along ``group_axis`` (result size ``n / g``
    there)."""
    g = qtype.group_size
    if not g:
        return calibrator.range(w, axes, qtype)
    ax = group_axis % w.ndim
    n = w.shape[ax]
    wg = w.reshape(w.shape[:ax] + (n // g, g) + w.shape[ax + 1:])
    gaxes = tuple(a if a < ax else a + 1 for a in axes if a != ax) + (ax + 1,)
    lo, hi = calibrator.range(wg, gaxes, qtype)
    return (jnp.squeeze(jnp.asarray(lo), ax + 1), jnp.squeeze(jnp.asarray(hi), ax + 1))


def fits(qtype, shape, axis) -> bool:
    """Whether ``qtype``'s groups tile the axis (its length a multiple of the group size)."""
    g = qtype.group_size
    return not g or (shape[axis % len(shape)] % g == 0)
