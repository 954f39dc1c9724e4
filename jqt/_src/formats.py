"""Number formats: :class:`QuantType` names a format by dtype and granularity.

A format is data, not code: its *grid* (how a scaled real value is rounded to
a representable one) is one of three kinds, and everything else (scale from a
range, storage dtype, packing) follows from the dtype.

==================  =======================  ===============================  ============
dtype               grid                     codes stored as                  packed
==================  =======================  ===============================  ============
``int2``..``int8``  round, clip to range     int8                             2 per byte
                                                                              up to 4 bits
``int9``..``int16`` round, clip (symmetric)  int16 (activations only)         no
``float8_e4m3fn``   cast to the fp8 type     ``float8_e4m3fn`` (1 byte)       no
``float8_e5m2``     cast to the fp8 type     ``float8_e5m2`` (1 byte)         no
``nf4``             nearest of 16 values     int8 code ``i - 8`` of entry i   2 per byte
                    (``NF4_TABLE``)
==================  =======================  ===============================  ============

Granularity: per tensor, per channel (``per_channel=True``: one scale per
output channel of a weight, per token of a dynamic activation), or per group
(``group_size=g``: one scale per ``g`` consecutive elements of the weight's
innermost contracting axis, per position of its other axes: per output channel,
and for a weight contracted over several axes, per position of the outer ones).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional

import ml_dtypes
import numpy as np
from jax import dtypes

# QLoRA's 4-bit NormalFloat (Dettmers et al. 2023, appendix E): the quantiles
# of N(0, 1) normalised to [-1, 1], with an exact zero.
NF4_TABLE = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)

FLOAT8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
_INTS = {f"int{b}": b for b in range(2, 17)}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def as_scalar(v):
    """``v`` as the Python int or float it holds where it is a 0-d integer or float array (a
    sweep over ``jnp.arange`` gives concrete ``jax.Array`` scalars), else ``v`` as it is.

    >>> import jax.numpy as jnp
    >>> as_scalar(jnp.asarray(64)), as_scalar(jnp.float32(0.5)), as_scalar("int8")
    (64, 0.5, 'int8')
    """
    if isinstance(v, (bool, np.bool_, numbers.Number, str)) or getattr(v, "shape", None) != ():
        return v
    dtype = getattr(v, "dtype", object)  # (NumPy's kinds miss bfloat16, float8 and int4)
    try:  # a tracer (a value under jit) has none: left for the caller's check to name
        return (int(v) if dtypes.issubdtype(dtype, np.integer) else
                float(v) if dtypes.issubdtype(dtype, np.floating) else v)
    except TypeError:
        return v


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantType:
    """A number format and its granularity, for one operand.

    Attributes:
      dtype: ``"int2"`` .. ``"int8"`` (stored in int8; weight codes of 4 bits or
        fewer two per byte where :meth:`nibbles_fit`), ``"int9"`` .. ``"int16"``
        (activations only, symmetric, stored in int16), ``"float8_e4m3fn"`` or
        ``"float8_e5m2"`` (``jnp.float8_e4m3fn`` etc. are accepted), or
        ``"nf4"`` (4-bit NormalFloat, weights only). Default ``"int8"``.
      bits: shorthand for ``dtype=f"int{bits}"``; for other dtypes it is
        derived (8 for fp8, 4 for nf4).
      symmetric: zero point fixed at 0, scale from the absolute maximum. fp8
        and nf4 are always symmetric.
      narrow_range: integers only: ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]``.
      per_channel: one scale per output channel for weights; one per token
        (dot) or per example (conv) for dynamic activations. Static
        activations are per tensor.
      group_size: weights only: one scale per group of ``group_size``
        consecutive elements of the innermost contracting axis (and per output
        channel and per position of any other contracted axis); 0 for none.
        Implies ``per_channel``. An op whose innermost contracting axis it does
        not tile gets groups of that axis's length where it is a multiple of it
        and the weight is contracted over several axes (``head_dim`` 64 with
        ``group_size=128``), one scale per output channel otherwise, with a
        warning, except where the whole contraction fits in one group (a LoRA
        factor of rank 4, 4 heads of 16 under ``group_size=64``): one scale per
        output channel is then that group.
      dynamic: activations only: scale from the live tensor at run time.

    >>> import jqt, jax.numpy as jnp
    >>> jqt.QuantType(bits=4).dtype, jqt.QuantType(dtype="int4").qmin
    ('int4', -8)
    >>> t = jqt.QuantType(dtype=jnp.float8_e4m3fn)
    >>> t.dtype, t.bits, t.qmax
    ('float8_e4m3fn', 8, 448.0)
    >>> jqt.QuantType(dtype="nf4", group_size=64).per_channel
    True
    """

    dtype: Any = None
    bits: Optional[int] = None
    symmetric: bool = True
    narrow_range: bool = False
    per_channel: bool = False
    group_size: int = 0
    dynamic: bool = False

    def __post_init__(self):
        for field in ("bits", "group_size"):  # NumPy integers (a sweep over np.arange) as ints
            v = as_scalar(getattr(self, field))
            if isinstance(v, numbers.Integral) and not isinstance(v, bool):
                object.__setattr__(self, field, int(v))
        for field in ("symmetric", "narrow_range", "per_channel", "dynamic"):
            v = getattr(self, field)
            if not isinstance(v, (bool, np.bool_)):  # None or "no" would be taken by truth value
                raise TypeError(f"QuantType({field}={v!r}): expected True or False.")
            object.__setattr__(self, field, bool(v))
        if self.dtype is None:
            bits = 8 if self.bits is None else self.bits
            if not isinstance(bits, int) or not 2 <= bits <= 16:
                raise ValueError(
                    f"QuantType(bits={self.bits!r}): jqt stores integer values in int8 or int16, "
                    "so bits must be an int from 2 to 16.")
            name = f"int{bits}"
        else:
            name = _dtype_name(self.dtype)
        if name in _INTS:
            bits = _INTS[name]
        elif name in FLOAT8:
            bits = 8
        elif name == "nf4":
            bits = 4
        else:
            raise ValueError(
                f"QuantType(dtype={self.dtype!r}): jqt's formats are int2..int16, "
                "float8_e4m3fn, float8_e5m2 and nf4.")
        if self.bits is not None and self.bits != bits:
            raise ValueError(f"QuantType(dtype={name!r}, bits={self.bits}): {name} has {bits} bits; "
                             "give one of dtype or bits (a QuantType holds both, so "
                             "dataclasses.replace(t, bits=4) needs dtype=None beside it, and "
                             "replace(t, dtype='nf4') bits=None).")
        object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "bits", bits)
        if self.narrow_range and self.kind != "int":
            raise ValueError(f"QuantType(dtype={name!r}, narrow_range=True): narrow_range drops the "
                             f"most negative integer code; {name} has no such code. Drop "
                             "narrow_range=True (with dataclasses.replace from an int type, pass "
                             "narrow_range=False).")
        if self.kind != "int" and not self.symmetric:
            raise ValueError(f"QuantType(dtype={name!r}, symmetric=False): {name} is a symmetric "
                             "format (no zero point); drop symmetric=False.")
        if self.bits > 8 and not self.symmetric:
            raise ValueError(
                f"QuantType(bits={self.bits}, symmetric=False): types wider than 8 bits are "
                "symmetric (zero point 0, as TFLite's int16 activations); set symmetric=True.")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 0:
            raise ValueError(f"QuantType(group_size={self.group_size!r}): expected 0 (no groups) "
                             "or a positive group length such as 128.")
        if self.group_size:
            if self.dynamic:
                raise ValueError("QuantType(group_size=..., dynamic=True): groups are for weights; "
                                 "dynamic activations are per token (per_channel=True).")
            object.__setattr__(self, "per_channel", True)

    @property
    def kind(self) -> str:
        """``"int"``, ``"float"`` (fp8) or ``"lut"`` (a lookup table: nf4)."""
        return "int" if self.dtype in _INTS else "float" if self.dtype in FLOAT8 else "lut"

    @property
    def grid(self) -> str:
        """The rounding grid: ``"int"``, the fp8 dtype name, or ``"nf4"``."""
        return "int" if self.kind == "int" else self.dtype

    @property
    def storage(self):
        """The dtype of the codes: int8 (int4 and nf4 codes too, before packing),
        int16 above 8 bits, or the fp8 dtype."""
        if self.kind == "float":
            return np.dtype(FLOAT8[self.dtype])
        return np.dtype(np.int8 if self.bits <= 8 else np.int16)

    @property
    def packs_nibbles(self) -> bool:
        """Whether :func:`jqt.pack` stores two codes per byte (4 bits or fewer), where
        :meth:`nibbles_fit` the axis they are packed along."""
        return self.bits <= 4 and self.kind != "float"

    def nibbles_fit(self, n: int) -> bool:
        """Whether codes along an axis of length ``n`` are stored two per byte: an even
        length, and groups of an even size, so that no byte holds codes of two groups.
        Otherwise they stay one int8 code per byte, as they do in convolution kernels
        (which the integer path reads in their own layout) whatever ``n``.

        >>> import jqt
        >>> t = jqt.QuantType(bits=4, group_size=32)
        >>> t.nibbles_fit(64), t.nibbles_fit(33)
        (True, False)
        >>> jqt.QuantType(bits=4, group_size=3).nibbles_fit(30)
        False
        >>> jqt.QuantType(bits=4).nibbles_fit(0)   # no axis to pack along (a conv kernel)
        False
        """
        g = self.group_size
        return self.packs_nibbles and n > 0 and n % 2 == 0 and not (g and g % 2)

    @property
    def qmin(self):
        """The smallest code (an int), or the smallest representable fp8 value."""
        if self.kind == "float":
            return -float(ml_dtypes.finfo(FLOAT8[self.dtype]).max)
        if self.kind == "lut":
            return -8
        return -(2 ** (self.bits - 1)) + (1 if self.narrow_range else 0)

    @property
    def qmax(self):
        """The largest code (an int), or the largest representable fp8 value."""
        if self.kind == "float":
            return float(ml_dtypes.finfo(FLOAT8[self.dtype]).max)
        if self.kind == "lut":
            return 7
        return 2 ** (self.bits - 1) - 1

    @property
    def amax_code(self) -> float:
        """The real value (in units of the scale) that a symmetric range's absolute
        maximum maps to: ``qmax`` for integers and fp8, 1 for nf4."""
        return 1.0 if self.kind == "lut" else float(self.qmax)

    @property
    def bounds(self) -> tuple:
        """``(lo, hi)`` of the grid in units of the scale (before the zero point)."""
        if self.kind == "lut":
            return (-1.0, 1.0)
        return (self.qmin, self.qmax)

    def describe(self) -> str:
        """A short text, e.g. ``"int4 sym g128"``. A dynamic type's per-channel scale is
        one per row of its operand, a vector along the op's contracted axes (per token for
        an activation contracted over its features, per feature for the values of
        ``probs @ v``, per example for a convolution's input), and reads ``per-row``.

        >>> import jqt
        >>> jqt.QuantType(bits=4, group_size=128).describe()
        'int4 sym g128'
        >>> jqt.recipes.w8a8_dynamic().rules[0].activation.describe()
        'int8 asym per-row dynamic'
        """
        gran = (f"g{self.group_size}" if self.group_size else
                ("per-row" if self.dynamic else "per-channel") if self.per_channel else "per-tensor")
        sym = "sym" if self.symmetric else "asym"
        return f"{self.dtype} {sym} {gran}{' dynamic' if self.dynamic else ''}"

    def contrast(self, other: "QuantType") -> tuple:
        """The two types' :meth:`describe` texts, for an error that names both; where
        those read the same, each names the fields that differ.

        >>> import jqt
        >>> a = jqt.QuantType(bits=8, per_channel=True)
        >>> a.contrast(jqt.QuantType(bits=8, per_channel=True, narrow_range=True))
        ('int8 sym per-channel (narrow_range=False)', 'int8 sym per-channel (narrow_range=True)')
        """
        da, db = self.describe(), other.describe()
        if da != db:
            return da, db
        diff = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]
        return tuple(f"{d} ({', '.join(f'{n}={getattr(t, n)!r}' for n in diff)})" if diff else d
                     for d, t in ((da, self), (db, other)))


def pack_nibbles(q, axis):
    """int8 codes in ``[-8, 7]`` -> uint8, two per byte along ``axis`` (even index in the
    low nibble). ``axis`` must have even length.

    >>> import jax.numpy as jnp
    >>> p = pack_nibbles(jnp.array([[1, -2, 7, -8]], jnp.int8), 1)
    >>> p.dtype, p.shape, unpack_nibbles(p, 1).tolist()
    (dtype('uint8'), (1, 2), [[1, -2, 7, -8]])
    """
    import jax.numpy as jnp
    from .compat import grouped
    axis = axis % q.ndim
    n = q.shape[axis]
    if n % 2:
        raise ValueError(f"jqt: cannot pack int4 codes two per byte along an axis of odd length {n}.")
    q = grouped(q, axis, 2).astype(jnp.uint8)
    lo = jnp.take(q, 0, axis=axis + 1) & 0xF
    hi = jnp.take(q, 1, axis=axis + 1) & 0xF
    return lo | (hi << 4)


def unpack_nibbles(p, axis):
    """Inverse of :func:`pack_nibbles`: uint8 -> int8 codes, the axis doubled; NumPy
    codes stay NumPy (a file's codes checked on the host, before any device).

    >>> import numpy as np
    >>> unpack_nibbles(np.array([[0x21, 0xF3]], np.uint8), 1).tolist()
    [[1, 2, 3, -1]]
    """
    import jax.numpy as jnp
    xp = np if isinstance(p, np.ndarray) else jnp
    axis = axis % p.ndim
    b = p.astype(np.int8)
    lo = xp.right_shift(xp.left_shift(b, 4), 4)  # arithmetic shift sign-extends
    hi = xp.right_shift(b, 4)
    both = xp.stack([lo, hi], axis=axis + 1)
    return both.reshape(p.shape[:axis] + (2 * p.shape[axis],) + p.shape[axis + 1:])
