"""Narrow integer accumulators: a rule's ``accumulator`` width below 32 bits.

jqt's own integer kernels accumulate in int32 and never overflow (a contraction
that could is split, ``dense.int_dense``). Some accelerators accumulate int8 x int8
products in 16 bits (TVM's quantization framework lets a target ask for that).
``Rule(accumulator=16)`` simulates such an accumulator on an op: each output's sum
``sum_k (qa - za)(qb - zb)`` of its operands' codes is *saturated* to
``[-2**(bits-1), 2**(bits-1) - 1]`` before it is scaled back to float, on the
simulated and the integer path alike, and :func:`jqt.report` shows the fraction of
outputs that saturated (``acc_saturated``).

The model is saturation of the whole sum: what hardware that clamps when it writes an
accumulator back gives, and what sequential saturating adds give whenever no partial
sum leaves the range. (A wrapping accumulator is not modelled: its error has no bound.)

The exact sums are recomputed by the op itself on the codes as float32 (products and
sums of integers, exact while every partial sum stays below ``2**24``; a sum whose
partial sums pass it is within float32 rounding, and one that ends beyond it is far
outside a 16-bit range and saturates either way), so one function serves every op kind
and path. That
costs one more float evaluation of each such op: a narrow accumulator is for studying a
target's numerics, not for speed.

>>> import jax.numpy as jnp
>>> from jqt._src.accumulator import saturate
>>> saturate(jnp.array([1.0, 50.0]), jnp.array([100.0, 50000.0]), 16).tolist()
[1.0, 32.76700210571289]
"""
from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
from jax import lax

from . import compat

WIDEST = 32
NARROWEST = 16
_F32 = jnp.float32


def bounds(bits: int) -> tuple:
    """``(lo, hi)`` of a signed ``bits``-bit accumulator.

    >>> bounds(16)
    (-32768, 32767)
    """
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def check_bits(bits, where: str, call: bool = False) -> None:
    """Raises ``ValueError`` unless ``bits`` is an int in ``[16, 32]``; the message starts
    ``where(accumulator=...)`` with ``call``, else ``where: accumulator=...``."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not NARROWEST <= bits <= WIDEST:
        numpy = (f" (a {type(bits).__name__}: pass a Python int, accumulator=int(bits), or set "
                 "it through Rule(accumulator=...), which converts it)"
                 if isinstance(bits, np.integer) else "")
        head = f"{where}(accumulator={bits!r})" if call else f"{where}: accumulator={bits!r}"
        raise ValueError(f"{head}: the accumulator width is an int from "
                         f"{NARROWEST} to {WIDEST} bits (32, the default, is jqt's own int32 "
                         f"accumulator, which never overflows){numpy}.")


def unsupported(qtypes) -> str:
    """Why ops whose operands have ``qtypes`` (``None`` for a float operand) cannot take
    a narrow accumulator, or ``""``: it needs integer codes of at most 8 bits on both
    operands and scales that do not vary along the contraction (per tensor or per
    channel)."""
    for t in qtypes:
        if t is None:
            return "one operand is float (weight-only): its products accumulate in float32"
        if t.kind != "int":
            return f"a {t.dtype} operand accumulates in float32"
        if t.bits > 8:
            return (f"an int{t.bits} operand runs as two int8 halves (its products with "
                    "int8 codes can overflow int32) or as float32 codes, not as one narrow sum")
        if t.group_size:
            return "per-group scales sum each group separately (a per-group accumulator)"
    return ""


def exact_sums(eqn, codes):
    """The op of ``eqn`` on ``codes`` (its two float32 operands holding ``q - z``, then any
    others as they are: a ``ragged_dot``'s group sizes): each output's exact integer sum,
    in float32."""
    codes = [lax.stop_gradient(c.astype(_F32)) for c in codes[:2]] + list(codes[2:])
    return compat.bind_eqn(eqn, codes, preferred_element_type=_F32,
                                precision=lax.Precision.HIGHEST)[0]


def saturate(out, sums, bits: int):
    """``out`` (the op's float output, ``scale * sums``) with every output whose
    ``sums`` leave the ``bits``-bit range moved to the bound it saturates at. The
    factor is a constant for gradients (straight through, as rounding is)."""
    lo, hi = bounds(bits)
    safe = jnp.where(sums == 0, 1.0, sums)
    factor = jax.lax.stop_gradient(jnp.where(sums > hi, hi / safe, jnp.where(sums < lo, lo / safe, 1.0)))
    x = out.astype(_F32)
    # x * factor, whose gradient is x's (the second term is exactly 0, its gradient 1 -
    # factor; 0 where x is not finite, whose x - x would be NaN)
    zero = jnp.where(jnp.isfinite(x), x - jax.lax.stop_gradient(x), 0.0)
    return (x * factor + zero * (1.0 - factor)).astype(out.dtype)


def saturated(sums, bits: int):
    """How many of ``sums`` leave the ``bits``-bit range (float32)."""
    lo, hi = bounds(bits)
    return jnp.sum((sums < lo) | (sums > hi)).astype(_F32)
