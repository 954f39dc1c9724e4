"""Per-group scales: one scale per ``g`` consecutive elements of one axis.

A grouped scale has the operand's rank, with ``n / g`` on the grouped axis
(the innermost contracted axis of a weight) and the operand's length on every
other axis, contracted ones included: a weight contracted over ``(h, d)`` (an
attention output projection ``"bthd,hdm->btm"``) has one scale per group of
``g`` along ``d``, for each ``h`` and output channel, which are the groups of
``g`` consecutive elements of its flattened contraction. :func:`expand` repeats
it to the operand's shape; :func:`weight_range` asks a weight calibrator for one
range per group.
"""
from __future__ import annotations

import contextlib

import jax.numpy as jnp

from . import compat
from . import numerics as nx


def expand(a, group_size, axis, shape):
    """A grouped scale or zero point -> broadcastable to an operand of ``shape``.

    >>> expand(jnp.array([[1.0, 2.0]]), 2, 1, (1, 4)).tolist()
    [[1.0, 1.0, 2.0, 2.0]]
    """
    if a is None or not group_size or jnp.ndim(a) == 0:
        return a
    axis = axis % len(shape)
    if a.shape[axis] in (1, shape[axis]):  # one group spans the axis: it broadcasts as it is
        return a  # (as a per-channel scale does, so jqt.pack's codes are those of a jit)
    return repeat(a, group_size, axis)


def repeat(a, n, axis):
    """``jnp.repeat(a, n, axis=axis)`` for a static ``n``, written as a broadcast and a
    reshape (``jnp.repeat`` fails eagerly on a partially manual explicit mesh).

    >>> repeat(jnp.array([[1, 2]]), 2, 1).tolist()
    [[1, 1, 2, 2]]
    """
    axis = axis % a.ndim
    b = jnp.broadcast_to(jnp.expand_dims(a, axis + 1), a.shape[:axis + 1] + (n,) + a.shape[axis + 1:])
    return b.reshape(a.shape[:axis] + (a.shape[axis] * n,) + a.shape[axis + 1:])


def dequantize(codes, scale, zero_point, qtype, axis):
    """Codes of an operand (in its layout) -> float32 values: decoded on the format's grid,
    minus the rounded zero point, times the scale, groups expanded along ``axis``.

    >>> import jqt
    >>> dequantize(jnp.array([[2, -1, 4, 0]], jnp.int8), jnp.array([[0.5, 2.0]]), None,
    ...            jqt.QuantType(bits=4, group_size=2), 1).tolist()
    [[1.0, -0.5, 8.0, 0.0]]
    """
    v = nx.decode(codes, qtype.grid)
    if zero_point is not None:
        v = v - jnp.round(expand(zero_point.astype(jnp.float32), qtype.group_size, axis, v.shape))
    return v * expand(scale.astype(jnp.float32), qtype.group_size, axis, v.shape)


def weight_range(calibrator, w, axes, qtype, group_axis):
    """The calibrator's ``(lo, hi)`` with ``keepdims`` over ``axes`` or, with groups, over
    each group of ``qtype.group_size`` along ``group_axis`` (result size ``n / g``
    there, every other axis kept).

    >>> from jqt._src.calibrators import WeightMinMax
    >>> import jqt
    >>> w = jnp.arange(16.0).reshape(2, 4, 2)  # contracted over (0, 1), groups of 2 along 1
    >>> lo, hi = weight_range(WeightMinMax(), w, (0, 1), jqt.QuantType(bits=4, group_size=2), 1)
    >>> hi.shape, hi[:, :, 0].tolist()
    ((2, 2, 2), [[2.0, 6.0], [10.0, 14.0]])
    """
    g = qtype.group_size
    if not g:
        return _checked(calibrator, w, axes, qtype)
    ax = group_axis % w.ndim
    # gathered along the groups' axis where split over explicit mesh axes (as before
    # compat.grouped: the ranges come out unsplit, as a scan's carry of them is typed)
    wg = compat.grouped(compat.unsplit(w, (ax,)), ax, g)
    gaxes = (ax + 1,)  # within each group; the other contracted axes keep their length
    lo, hi = _checked(calibrator, wg, gaxes, qtype)
    return (jnp.squeeze(jnp.asarray(lo), ax + 1), jnp.squeeze(jnp.asarray(hi), ax + 1))


@contextlib.contextmanager
def naming(where):
    """Puts ``where`` (the op and its weight) into a weight calibrator's refusal raised
    inside (:func:`_checked`'s, which does not know them).

    >>> try:
    ...     with naming("op 'b' (weight 'b')"):
    ...         raise ValueError("jqt.calibrate: weight calibrator X's range ... returned ...")
    ... except ValueError as e:
    ...     print(e)
    jqt.calibrate: op 'b' (weight 'b'): weight calibrator X's range ... returned ...
    """
    try:
        yield
    except (TypeError, ValueError) as e:
        head = "jqt.calibrate: weight calibrator "
        if not str(e).startswith(head):
            raise
        raise type(e)(f"jqt.calibrate: {where}: weight calibrator {str(e)[len(head):]}") from None


def _checked(calibrator, w, axes, qtype):
    """``calibrator.range(w, axes, qtype)``, refused unless each end has the shape of a
    reduction of ``w`` over ``axes`` with ``keepdims`` (one value where ``axes`` is None).

    >>> import jqt
    >>> class Scalar(jqt.calibrators.WeightCalibrator):
    ...     def range(self, w, axes, qtype):
    ...         return w.min(), w.max()
    >>> _checked(Scalar(), jnp.ones((4, 2)), (0,), jqt.recipes.INT8_WEIGHT)
    Traceback (most recent call last):
    ...
    ValueError: jqt.calibrate: weight calibrator Scalar's range(w, axes=(0,), qtype) returned lo of shape () for a weight w of shape (4, 2): it must reduce w over axes with keepdims, to shape (1, 2) (w.min(axis=axes, keepdims=True) and the max, as jqt.calibrators.WeightMinMax does).
    """
    out = calibrator.range(w, axes, qtype)
    try:
        lo, hi = out
    except (TypeError, ValueError):
        text = repr(out) if not hasattr(out, "shape") else f"an array of shape {tuple(out.shape)}"
        raise TypeError(f"jqt.calibrate: weight calibrator {type(calibrator).__name__}'s "
                        f"range(w, axes={axes}, qtype) returned {text[:60]}; it returns a pair "
                        "(lo, hi), w reduced over axes with keepdims.") from None
    want = () if axes is None else tuple(1 if i in {a % w.ndim for a in axes} else n
                                          for i, n in enumerate(w.shape))
    if axes is None:  # per tensor: one value, kept as a scalar (keepdims or not)
        lo, hi = (jnp.reshape(a, ()) if jnp.size(a) == 1 else a for a in (lo, hi))
    for name, a in (("lo", lo), ("hi", hi)):
        got = tuple(jnp.shape(a))
        if got != want:
            raise ValueError(
                f"jqt.calibrate: weight calibrator {type(calibrator).__name__}'s range(w, "
                f"axes={axes}, qtype) returned {name} of shape {got} for a weight w of shape {tuple(w.shape)}: it "
                f"must reduce w over axes with keepdims, to shape {want} "
                "(w.min(axis=axes, keepdims=True) and the max, as "
                "jqt.calibrators.WeightMinMax does).")
    if not type(calibrator).__module__.startswith("jqt."):
        # a calibrator of the user's that returns [0, 0] for weights not all zero (their
        # scale would be the placeholder 1): marked [inf, inf], which calibrate refuses
        # (calibrate._check_weight_finite), naming the op
        held = jnp.max(jnp.abs(w), axis=axes, keepdims=axes is not None) > 0
        lost = (jnp.asarray(lo) == 0) & (jnp.asarray(hi) == 0) & held
        lo, hi = (jnp.where(lost, jnp.inf, a) for a in (lo, hi))
    return lo, hi


def fits(qtype, shape, axis) -> bool:
    """Whether ``qtype``'s groups tile the axis (its length a multiple of the group size)."""
    g = qtype.group_size
    return not g or (shape[axis % len(shape)] % g == 0)
