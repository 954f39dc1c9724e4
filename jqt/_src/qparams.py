"""Quantization parameters as pytrees.

``qparams`` is a plain ``dict`` mapping op keys to :class:`OpQParams`. Each
operand of an op has a :class:`QArray` without values (scale and zero point as
arrays, the :class:`~jqt.QuantType` as static aux data) or ``None`` (float). Ops under
a ``lax.scan`` over stacked layers carry stacked arrays with a leading
``(L,)`` axis per stacking level.

The invariant, as in MLIR's quant dialect: ``real ~= (q - zero_point) * scale``.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import pickle
from typing import Any, Optional

import jax
import numpy as np

from . import compat
from .formats import FLOAT8, QuantType
from .plotting import pad, width


def axes_only(chain) -> tuple:
    """A :class:`WeightSource` chain without its dtype casts and copies (``convert``,
    ``copy``): the steps that place the weight's axes, which two functions reading one
    weight must share (``x.astype(f32) @ w.astype(f32)`` and ``x @ w`` do; ``x @ w.T``
    does not).

    >>> axes_only((("convert", "float32"), ("transpose", (1, 0))))
    (('transpose', (1, 0)),)
    """
    return tuple(c for c in chain if c[0] not in ("convert", "copy"))


@dataclasses.dataclass(frozen=True)
class WeightSource:
    """Where a weight operand comes from: a leaf of the weight argument and the
    layout-only ops (``chain``) that lead from the leaf to the operand.

    ``chain`` entries are tuples ``(name, *static_args)``; ``("scan_slice",)``
    marks the slicing of a stacked leaf by ``lax.scan``, ``("shard_split", splits)`` the
    blocks of it a ``jax.shard_map`` hands each device (``layout.split_blocks``). ``float_needed`` is
    True when the leaf is used as a float value somewhere else in the
    function, so :func:`jqt.pack` must keep it. ``arg`` is the position of the weight
    argument among ``f``'s arguments (``weight_argnums``); ``leaf`` is the leaf's index
    in the flattened argument; ``contract`` the operand axes the op reduces;
    ``batch`` its ``dot_general`` batch axes. ``shape`` is the leaf's shape as ``f`` was
    given it (``None`` in qparams saved before jqt recorded it): :func:`jqt.quantize`
    refuses weights of another shape, whose scales were computed for other weights even
    where their own shape would fit (a per-channel scale does not see its contracted
    axis). It is part of equality and hash (qparams passed to ``jax.jit`` as an argument
    are told apart by it, so a function traced for one weight shape is not reused for
    another), and of the repr (JAX's error for two qparams trees of other weight shapes
    prints both sources).

    ``prefixed``: whether ``path`` starts with the argument's name (``f`` has several
    weight arguments, or params is a single array); ``None`` in qparams saved before jqt
    recorded it.

    ``calibrated_reach`` (set by :func:`jqt.calibrate`, ``None`` where unknown) is
    ``(reach, digest)``: how far the weight it was calibrated with reached on its grid
    (its largest ``|x / scale|``, zero point subtracted, over the value where clipping
    starts: at most 1 unless the weight calibrator clipped on purpose) and a digest of the
    scale, zero point, smoothing vector and type it was measured with; ``(reach, digest,
    True)`` where some channels or groups were all zeros (placeholder scales). :func:`jqt.pack`
    checks the weights it packs against it while those are unchanged. It is not part of
    the source's equality or hash (qparams of other weights have the same tree
    structure), nor of its repr.

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda p, x: x @ p["w"].T, jqt.recipes.w8a8(), {"w": jnp.eye(2)},
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> src = qp["w"].source
    >>> src.path, src.chain[0][0]
    ('w', 'transpose')
    """

    arg: int
    path: str
    leaf: int = -1
    chain: tuple = ()
    float_needed: bool = False
    contract: tuple = ()
    batch: tuple = ()
    calibrated_reach: Optional[tuple] = dataclasses.field(default=None, compare=False, repr=False)
    shape: Optional[tuple] = None
    prefixed: Optional[bool] = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def stack_depth(self) -> int:
        """How many leading stacked axes its qparams have: one per ``lax.scan`` that sliced
        the leaf, and one per axis of it a ``jax.shard_map`` splits over devices (one set
        of parameters per block)."""
        return sum(1 if c[0] == "scan_slice" else len(c[1]) for c in self.chain
                   if c[0] in ("scan_slice", "shard_split"))


def _fields_hash(a):
    """``hash(a)`` for a dataclass of :func:`_fields_equal`: its fields' hash where none holds
    an array; otherwise a ``TypeError`` that says why (it was "unhashable type:
    'jaxlib._jax.ArrayImpl'", from inside the generated ``__hash__``).

    >>> import jax.numpy as jnp, jqt
    >>> hash(jqt.QArray(scale=jnp.ones(3), qtype=jqt.QuantType(per_channel=True)))
    Traceback (most recent call last):
    ...
    TypeError: a jqt.QArray holds arrays (its scale) and is not hashable: pass it to a jitted function as an argument (traced), not as a static one.
    """
    fields = [(f.name, getattr(a, f.name)) for f in dataclasses.fields(a)]
    try:
        return hash(tuple(v for _, v in fields))
    except TypeError:
        held = [n for n, v in fields if isinstance(v, (jax.Array, np.ndarray, QArray))]
        raise TypeError(f"a jqt.{type(a).__name__} holds arrays (its {', '.join(held) or 'fields'}) "
                        "and is not hashable: pass it to a jitted function as an argument "
                        "(traced), not as a static one.") from None


def _fields_equal(a, b):
    """``a == b`` for two dataclasses of one class holding arrays: every field equal, an
    array by its shape, dtype and values (the generated ``__eq__`` compared per-channel
    scales element by element and raised "the truth value of an array ... is ambiguous";
    traced arrays compare by identity).

    >>> import copy, jax.numpy as jnp, jqt
    >>> q = jqt.QArray(scale=jnp.ones(3), qtype=jqt.QuantType(per_channel=True))
    >>> q == copy.deepcopy(q), q == jqt.QArray(scale=jnp.ones(4), qtype=q.qtype)
    (True, False)
    """
    if type(a) is not type(b):
        return NotImplemented
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x is y:
            continue
        arrays = (np.ndarray, np.generic, jax.Array)
        if isinstance(x, arrays) or isinstance(y, arrays):
            if compat.is_tracer(x) or compat.is_tracer(y) or not (isinstance(x, arrays)
                                                                  and isinstance(y, arrays)):
                return False
            if (np.shape(x) != np.shape(y) or np.dtype(x.dtype) != np.dtype(y.dtype)
                    or not np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)):
                return False
        elif x != y:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized value: codes, scale and zero point, with the format as static data.

    The invariant, as in MLIR's quant dialect: ``real ~= decode(values - zero_point) * scale``,
    where ``decode`` is the identity for integers and fp8 and ``NF4_TABLE[code + 8]``
    for nf4 (see :class:`jqt.QuantType`), on the codes unpacked into the operand's own
    layout: ``values`` may hold two 4-bit codes per byte (``nibbles``) and a packed weight's
    codes may be stored transposed (``layout``, below), a grouped ``scale`` has one row per
    group (repeat it ``group_size`` times along the grouped axis), and a key/value cache's
    fp8 codes are their uint8 bits where the backend has no fp8 (read a cache with
    :func:`jqt.dequantize_cache`).

    One type for every role:

    * in qparams (:func:`jqt.calibrate`) ``values`` is ``None``: the parameters of
      an operand, quantized when the function runs. A dynamic type has
      ``scale`` and ``zero_point`` ``None`` too (computed from the live tensor);
      a symmetric one has ``zero_point=None``.
    * in :class:`jqt.PackedParams` (:func:`jqt.pack`) ``values`` holds the
      weight's codes in ``layout``: the op's own layout (``"operand"``) or, for a
      ``dot_general`` weight with no batch axes, 2-D ``"nk"`` (output features x
      contracted) or ``"kn"``, as the kernel policy in use at :func:`jqt.pack`
      chooses (per-channel w8a8 weights ``"nk"``; weight-only, grouped w8a8, w4a8 and
      fp8 weights ``"kn"`` on the CPU, weight-only and fp8 ones under the generic
      policy; all ``"nk"`` on a GPU); stacked
      layers keep their leading axes. Codes of 4 bits or fewer are stored two
      per byte (uint8) where the axis fits (:meth:`jqt.QuantType.nibbles_fit`),
      else one int8 code per byte: along the contracted axis in the ``"nk"`` and
      ``"kn"`` layouts, along the last axis in the op's own (``"operand"``: a
      weight with batch axes, as a mixture's experts, a ``ragged_dot`` weight, a
      lookup's table) and in a cache.
      ``sums`` is the int32 sum of the codes over the contracted axes (per group
      for grouped scales), for the zero-point correction of asymmetric
      activations.
    * a key/value cache (``layout="cache"``; a preset's ``kv_cache``): ``values``
      holds the buffer's codes and ``scale`` one float16 scale per vector of its
      last axis; ``float_dtype`` names the dtype of the float buffer it stands for.
      A function that takes a cache and returns it written (a decode step called
      from a Python loop) returns it in this form from :func:`jqt.quantize`'s
      integer path, to be passed back in as it is (``docs/generate.md``).

    ``scale`` and ``zero_point`` have the operand's rank (size 1 on every axis
    that shares a scale; ``n / group_size`` on the grouped axis) or are scalars.
    ``folded`` (packed weights only) names the outlier transforms folded into the
    codes: ``""`` none, ``"smooth=<digest of the vector>"`` and/or ``"rotate"``
    (joined by ``"+"``); ``None`` where it was not recorded (a file written before
    jqt recorded it). ``smooth`` (packed weights only) is that smoothing vector
    (SmoothQuant, AWQ), which the codes were multiplied by: on the integer and simulated
    paths the weight's activation is divided by it, whatever vector the qparams hold (they are
    compared by the digest where the qparams are known when the function is traced).
    Weights packed before jqt held the vector record ``"smooth:<digest>"`` and run with
    the qparams' vector. A ``QArray`` whose ``folded`` has no ``"smooth="`` has the
    four children it always had, and one that has it five, the vector last (``None`` in
    a tree of specs), so the pytree structure of ``jax.export`` artifacts taking weights
    without smoothing is unchanged.

    >>> import jax.numpy as jnp, jqt
    >>> p = jqt.QArray(scale=jnp.float32(0.5), qtype=jqt.QuantType())
    >>> p
    QArray(int8 sym per-tensor, scale=0.5)
    """

    values: Optional[jax.Array] = None
    scale: Optional[jax.Array] = None
    zero_point: Optional[jax.Array] = None
    sums: Optional[jax.Array] = None
    qtype: QuantType = dataclasses.field(metadata=dict(static=True), default=QuantType())
    layout: str = dataclasses.field(metadata=dict(static=True), default="operand")
    folded: Optional[str] = dataclasses.field(metadata=dict(static=True), default=None)
    smooth: Optional[jax.Array] = None
    float_dtype: Optional[str] = dataclasses.field(metadata=dict(static=True), default=None)

    def __getattr__(self, name):  # only for names a QArray lacks
        hint = ""
        if name in ("ndim", "shape", "dtype", "size", "T", "astype", "reshape", "at"):
            hint = (": a jqt.QArray is no array but codes (values) and their scale; read a "
                    "quantized key/value cache with jqt.dequantize_cache(cache), and pass packed "
                    "weights to the quantized function, not to f")
        elif name in ("copy", "block_until_ready", "delete", "is_deleted"):  # a pytree's
            hint = (": a jqt.QArray is a pytree of arrays; use jax.tree.map(jnp.copy, q), "
                    "jax.block_until_ready(q), jax.tree.map(lambda a: a.delete(), q) or "
                    "any(a.is_deleted() for a in jax.tree.leaves(q))")
        raise AttributeError(f"'QArray' object has no attribute {name!r}{hint}")

    def __eq__(self, other):
        return _fields_equal(self, other)

    def __hash__(self):
        return _fields_hash(self)

    def __post_init__(self):
        if self.qtype is not None and not isinstance(self.qtype, QuantType):
            raise TypeError(f"jqt.QArray(qtype={self.qtype!r}): a jqt.QuantType, such as "
                            "jqt.QuantType(bits=8) or jqt.QuantType(dtype='float8_e4m3fn'), not a "
                            f"{type(self.qtype).__name__}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"jqt.QArray(layout={self.layout!r}): one of {', '.join(map(repr, LAYOUTS))} "
                             "('operand', the op's own, for qparams; 'cache' for a key/value cache)")
        if self.smooth is not None and not holds_smooth(self.folded):
            raise ValueError(f"jqt.QArray(smooth=...): a packed weight that holds its smoothing "
                             f"vector records it in folded ('smooth=<digest>'), not {self.folded!r}")

    @property
    def nibbles(self) -> bool:
        """Whether ``values`` hold two codes per byte (uint8 codes of 4 bits or fewer).

        >>> import jax.numpy as jnp, jqt
        >>> jqt.QArray(values=jnp.zeros((2, 4), jnp.uint8), qtype=jqt.QuantType(bits=4)).nibbles
        True
        """
        return self.qtype.packs_nibbles and getattr(self.values, "dtype", None) == np.uint8

    def __repr__(self):
        vals = ""
        if self.values is not None:
            vals = f", values {getattr(self.values, 'dtype', '?')}{list(getattr(self.values, 'shape', ()))}" \
                   f" ({self.layout})"
        return (f"QArray({self.qtype.describe()}{vals}{_arr_summary('scale', self.scale)}"
                f"{_arr_summary('zero_point', self.zero_point)}"
                f"{_arr_summary('smooth', self.smooth)})")


_QARRAY_DATA = ("values", "scale", "zero_point", "sums")
# "operand": qparams and packed weights in the op's own layout; "nk" / "kn": 2-D packed
# dot_general weights; "tied": a lookup's table read from a matmul's codes; "cache"
LAYOUTS = ("operand", "nk", "kn", "tied", "cache")


def smooth_digest(v) -> str:
    """The digest that names a smoothing vector in ``fold_tag`` and ``QArray.folded``:
    of its float32 bytes and shape.

    >>> smooth_digest(np.ones(4)) == smooth_digest(np.ones(4, np.float32)) != smooth_digest(np.ones(2))
    True
    """
    raw = np.asarray(v, np.float32)
    return hashlib.blake2b(raw.tobytes() + str(raw.shape).encode(), digest_size=6).hexdigest()


def fold_parts(tag: Optional[str]) -> dict:
    """A ``fold_tag`` or ``QArray.folded`` as ``{transform: digest}``, where a smoothing
    vector's digest follows ``":"`` (named) or ``"="`` (the packed weight holds it).

    >>> fold_parts("smooth=ab12+rotate"), fold_parts("smooth:ab12"), fold_parts(None)
    ({'smooth': 'ab12', 'rotate': ''}, {'smooth': 'ab12'}, {})
    """
    out = {}
    for part in (tag or "").split("+"):
        if part:
            name, _, digest = part.replace("=", ":", 1).partition(":")
            out[name] = digest
    return out


@functools.lru_cache(maxsize=4096)
def holds_smooth(folded: Optional[str]) -> bool:
    """Whether a packed weight whose ``QArray.folded`` is ``folded`` holds its smoothing
    vector (``"smooth=<digest>"``), a fifth pytree child.

    >>> holds_smooth("smooth=ab12+rotate"), holds_smooth("smooth:ab12"), holds_smooth(None)
    (True, False, False)
    """
    return any(p.startswith("smooth=") for p in (folded or "").split("+"))
_KEYS = tuple(jax.tree_util.GetAttrKey(n) for n in _QARRAY_DATA + ("smooth",))


def _flatten(a: QArray):
    """Four children (values, scale, zero point, sums), and the smoothing vector fifth
    where ``folded`` records that the weight holds one; the format as static data."""
    aux = (a.qtype, a.layout, a.folded, a.float_dtype)
    if holds_smooth(a.folded):
        return (a.values, a.scale, a.zero_point, a.sums, a.smooth), aux
    return (a.values, a.scale, a.zero_point, a.sums), aux


def _flatten_with_keys(a: QArray):
    children, aux = _flatten(a)
    return tuple(zip(_KEYS, children)), aux


def _unflatten(aux, children) -> QArray:
    """Rebuilds without ``__init__`` (its check), as JAX fills the children with
    placeholders (``None`` in a tree of specs, tracers, sentinels)."""
    a = object.__new__(QArray)
    children = tuple(children)
    for name, value in zip(_QARRAY_DATA, children):
        object.__setattr__(a, name, value)
    object.__setattr__(a, "smooth", children[4] if len(children) > 4 else None)
    for name, value in zip(("qtype", "layout", "folded", "float_dtype"), aux):
        object.__setattr__(a, name, value)
    return a


jax.tree_util.register_pytree_with_keys(QArray, _flatten_with_keys, _unflatten, _flatten)


def field_problems(q: QArray, where: str, z, packed: bool = False) -> list:
    """What is wrong with the fields ``q`` holds, whatever their values (traced ones too):
    a scale or zero point that its type needs and ``q`` lacks, or that it holds and its
    type has no use for, as texts such as ``"lhs.zero_point: missing, ..."``. ``z``: the
    zero point's values as NumPy (set on a symmetric type, refused only where one is not
    0), None where they are not known or there is none, or the zero point itself, refused
    on a symmetric type whatever it holds (a packed weight: ``jqt.pack`` gives one none,
    and its kernels apply one given). ``packed``: leave out the hints about
    ``jqt.qat.split``'s halves, which hold qparams.

    >>> field_problems(QArray(scale=np.ones(4), qtype=QuantType(bits=4, symmetric=False)), "rhs", None)[0][:44]
    'rhs.zero_point: missing, but its type (int4 '
    """
    out = []
    t = q.qtype
    if q.scale is None and t is not None and not t.dynamic and q.values is None:
        # (a packed weight of a version-1 file holds no scale: it takes the qparams')
        out.append(f"{where}.scale: missing, but its type ({t.describe()}) is static and needs one"
                   + ("" if packed else " (the frozen half of jqt.qat.split holds None where the "
                      "trained half holds the scales: jqt.qat.merge them first)"))
    if q.scale is not None and t is not None and t.dynamic and q.values is None:
        out.append(f"{where}.scale: set, but its type ({t.describe()}) is dynamic: its scale is "
                   "computed from each input at run time, and this one would be ignored; remove "
                   "it, or make the type static")
    if z is not None and t is not None and t.symmetric and (
            not isinstance(z, np.ndarray) or np.any(z != 0)):
        asym_ok = t.kind == "int" and t.bits <= 8  # (wider ints and fp8 are symmetric only)
        out.append(f"{where}.zero_point: set, but its type ({t.describe()}) is symmetric, whose "
                   "codes are centred on 0: remove it" + (", or make the type asymmetric "
                   "(symmetric=False)" if asym_ok else f" ({t.describe().split()[0]} types are "
                   "symmetric only)"))
    if (q.zero_point is None and q.scale is not None and t is not None and not t.symmetric
            and not t.dynamic):
        out.append(f"{where}.zero_point: missing, but its type ({t.describe()}) is asymmetric "
                   "and needs one per scale" + ("" if packed else " (the trained half of "
                   "jqt.qat.split holds None where the frozen half holds the zero points: "
                   "jqt.qat.merge them first)"))
    return out


def codes_problem(w: QArray) -> str:
    """What is wrong with the dtypes of a packed weight's codes or code sums, or ``""``:
    codes in the format's storage dtype (int8, or uint8 holding two 4-bit codes per
    byte; the fp8 dtype), sums int32. A ``tree_map`` cast over a
    :class:`jqt.PackedParams` changes them: a bfloat16 cast rounds the sums.

    >>> import jax.numpy as jnp, jqt
    >>> w = jqt.QArray(values=jnp.zeros((2, 2), jnp.float32), qtype=jqt.QuantType())
    >>> codes_problem(w)
    'its codes are float32, where int8 sym per-tensor codes are int8'
    """
    want = {w.qtype.storage} | ({np.dtype(np.uint8)} if w.qtype.packs_nibbles else set())
    if w.values is not None and np.dtype(w.values.dtype) not in want:
        return (f"its codes are {np.dtype(w.values.dtype).name}, where {w.qtype.describe()} codes "
                f"are {' or '.join(sorted(d.name for d in want))}")
    if w.sums is not None and np.dtype(w.sums.dtype) != np.int32:
        return f"its code sums are {np.dtype(w.sums.dtype).name}, where they are int32"
    if w.smooth is not None and np.dtype(w.smooth.dtype) != np.float32:
        return (f"its smoothing vector is {np.dtype(w.smooth.dtype).name}, where its codes were "
                "multiplied by a float32 one")
    return ""


def v1_problem(values, qtype) -> str:
    """Why a version-1 file's packed weight (int8 codes, no scale or type: it takes the
    qparams') cannot run as ``qtype``, or ``""``. Its codes must fit ``qtype``'s grid:
    int8 codes under int4 qparams would run 18 times too large, without a word.

    >>> import numpy as np, jqt
    >>> v1_problem(np.array([-127, 127], np.int8), jqt.QuantType(bits=4))
    'its codes reach [-127, 127], beyond the int4 sym per-tensor grid [-8, 7]'
    """
    if not (qtype.kind == "int" and qtype.bits <= 8 and not qtype.group_size):
        return f"these qparams quantize it as {qtype.describe()}"
    if values is None or compat.is_tracer(values) or not np.size(values):
        return ""
    v = np.asarray(values)
    lo, hi = int(v.min()), int(v.max())
    if lo < qtype.qmin or hi > qtype.qmax:
        return (f"its codes reach [{lo}, {hi}], beyond the {qtype.describe()} grid "
                f"[{qtype.qmin}, {qtype.qmax}]")
    return ""


QuantParams = QArray
"""The parameters of one operand in qparams: a :class:`QArray` without values (an alias).

>>> import jqt
>>> jqt.QuantParams is jqt.QArray
True
"""
PackedWeight = QArray
"""A packed weight: a :class:`QArray` with values (an alias).

>>> import jqt
>>> jqt.PackedWeight is jqt.QArray
True
"""


def _arr_summary(name, a):
    """A leaf in a repr: its value or range where it holds numbers, else its shape or own
    repr (a tracer, a ``jax.ShapeDtypeStruct`` of ``jax.eval_shape``, an optax label).

    >>> _arr_summary("scale", np.float32(0.5)), _arr_summary("scale", "frozen")
    (', scale=0.5', ", scale='frozen'")
    >>> _arr_summary("scale", np.array([1.0, np.nan, 3.0]))  # (was "in [nan, nan]")
    ', scale[3] in [1, 3], 1 NaN'
    """
    if a is None:
        return ""
    try:
        v = np.asarray(a)
    except Exception:  # a tracer
        v = None
    if v is None or not (v.dtype.kind in "biuf" or jax.numpy.issubdtype(v.dtype, jax.numpy.number)):
        # a tracer, a shape-only struct, a label (bfloat16 and fp8 are numbers: kind 'V')
        shape = getattr(a, "shape", None)
        return f", {name}: {tuple(shape)}" if shape is not None else f", {name}={a!r}"
    if v.size == 0:
        return f", {name}[{'x'.join(map(str, v.shape))}]"
    if v.size == 1:
        return f", {name}={v.reshape(()).item():.4g}"
    f = v.astype(np.float64)
    nan = int(np.isnan(f).sum())
    if nan == f.size:
        return f", {name}[{'x'.join(map(str, v.shape))}] all NaN"
    rng = f"in [{np.nanmin(f):.3g}, {np.nanmax(f):.3g}]" + (f", {nan} NaN" if nan else "")
    return f", {name}[{'x'.join(map(str, v.shape))}] {rng}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OpQParams:
    """Quantization parameters of one op: a ``dot_general``, ``conv_general_dilated``,
    embedding ``gather``, ``ragged_dot_general`` or key/value cache write
    (``supported-ops.md``).

    Attributes:
      lhs, rhs: :class:`jqt.QArray` of each operand (scale, zero point, type; no
        values), or ``None`` for float.
      op: the primitive name (static).
      weight_operand: 0 or 1, the operand computed from the weights alone, or
        ``None`` for an activation x activation op (static).
      source: where the weight operand comes from, for :func:`jqt.pack` (static).
      note: why the op stays float, when it does (static).
      smooth: the per-input-channel smoothing vector ``s`` (SmoothQuant, AWQ) in
        the weight operand's layout (full length on its contracted axes, size 1
        elsewhere), or ``None``: the activation is divided by it and the weight
        multiplied (see ``transforms.py``). Trainable like the scales.
      rotate: the contracted axes are rotated by a Hadamard matrix, the
        activation at run time and the weight once (static).
      accumulator: the width in bits of the op's integer accumulator (static):
        32 (jqt's own, which never overflows) or 16-31, a narrower one that
        saturates, simulated on both paths (``Rule(accumulator=...)``).

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> p = qp["w"]
    >>> p.op, p.weight_operand, p.lhs, p.rhs.qtype.bits, p.is_float
    ('dot_general', 1, None, 8, False)
    """

    lhs: Optional[QuantParams]
    rhs: Optional[QuantParams]
    op: str = dataclasses.field(metadata=dict(static=True))
    weight_operand: Optional[int] = dataclasses.field(metadata=dict(static=True), default=None)
    source: Optional[WeightSource] = dataclasses.field(metadata=dict(static=True), default=None)
    note: str = dataclasses.field(metadata=dict(static=True), default="")
    smooth: Optional[jax.Array] = None
    rotate: bool = dataclasses.field(metadata=dict(static=True), default=False)
    accumulator: int = dataclasses.field(metadata=dict(static=True), default=32)

    @property
    def transformed(self) -> bool:
        """True when the op's operands are smoothed or rotated before quantization."""
        return self.smooth is not None or self.rotate

    @property
    def fold_tag(self) -> str:
        """What :func:`jqt.pack` folds into this op's weight codes, as a packed weight's
        ``QArray.folded`` records it: ``""`` (nothing), ``"smooth:<digest>"`` (the
        smoothing vector, by a digest of its float32 bytes; ``"smooth:?"`` where it is
        a tracer), ``"rotate"``, or both joined by ``"+"``.

        >>> import jax.numpy as jnp, jqt
        >>> f = lambda w, x: x @ w
        >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(rotate=True), jnp.eye(4), [(jnp.ones((2, 4)),)],
        ...                    progress=False)
        >>> qp["w"].fold_tag, jqt.pack(qp, jnp.eye(4)).weights["w"].folded
        ('rotate', 'rotate')
        """
        parts = []
        if self.smooth is not None:
            if compat.is_tracer(self.smooth):
                parts.append("smooth:?")
            else:
                parts.append("smooth:" + smooth_digest(self.smooth))
        if self.rotate:
            parts.append("rotate")
        return "+".join(parts)

    @property
    def packed_tag(self) -> str:
        """:attr:`fold_tag` as :func:`jqt.pack` records it in the ``QArray.folded`` of a
        weight that holds its smoothing vector: ``"smooth=<digest>"`` for
        ``"smooth:<digest>"``.

        >>> import jax.numpy as jnp, jqt
        >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(smooth=0.5), jnp.eye(4),
        ...                    [(jnp.ones((2, 4)),)], progress=False)
        >>> qp["w"].packed_tag == jqt.pack(qp, jnp.eye(4)).weights["w"].folded
        True
        """
        return self.fold_tag.replace("smooth:", "smooth=", 1)

    @property
    def is_float(self) -> bool:
        """True when neither operand is quantized (the op runs in float)."""
        return self.lhs is None and self.rhs is None

    def operand(self, i: int) -> Optional[QuantParams]:
        """The :class:`QuantParams` of operand ``i`` (0: lhs, 1: rhs), or ``None``."""
        if isinstance(i, (bool, np.bool_)) or i not in (0, 1):  # (-1 read the rhs)
            raise ValueError(f"OpQParams.operand: i={i!r}; expected 0 (lhs) or 1 (rhs).")
        return (self.lhs, self.rhs)[i]

    def __eq__(self, other):
        return _fields_equal(self, other)

    def __hash__(self):
        return _fields_hash(self)

    def __repr__(self):
        if self.is_float:
            return f"OpQParams({self.op}, float: {self.note or 'kept float'})"
        if self.op in ("dynamic_update_slice", "scatter") and self.lhs is not None:
            # a key/value cache write: lhs is the cache's type, the update quantized into it
            return f"OpQParams({self.op}, kv cache: {self.lhs!r})"
        names = ("lhs", "rhs")
        parts = []
        for i, p in enumerate((self.lhs, self.rhs)):
            role = "weight" if i == self.weight_operand else "activation"
            parts.append(f"{names[i]} ({role}): {p!r}" if p is not None else f"{names[i]} ({role}): float")
        if self.smooth is not None:
            parts.append(f"smooth{list(np.shape(self.smooth))}")
        if self.rotate:
            parts.append("rotated")
        if self.accumulator != 32:
            parts.append(f"int{self.accumulator} accumulator")
        return f"OpQParams({self.op}, " + ", ".join(parts) + ")"


@jax.tree_util.register_pytree_with_keys_class
class PackedParams:
    """Weights with the quantized operands stored as codes: int8, int4 two per byte (uint8)
    or fp8 (see :func:`jqt.pack`).

    Holds the float leaves still needed (biases, norms, weights of float ops)
    and a dict of :class:`QArray` (with values) keyed by op key. Pass it to a
    quantized function in place of the float weights.

    >>> import jax.numpy as jnp, jqt
    >>> p = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    >>> f = lambda p, x: x @ p["w"] + p["b"]
    >>> packed = jqt.pack(jqt.calibrate(f, jqt.recipes.w8a8(), p, [(jnp.ones((2, 64)),)],
    ...                                 progress=False), p)
    >>> packed
    PackedParams(1 quantized weights, 1 float leaves kept of 2)
    >>> packed.nbytes() < (64 * 64 + 64) * 4 / 3
    True
    """

    def __init__(self, leaves, weights, treedef, avals, kept, tied=()):
        self.leaves = tuple(leaves)
        self.weights = dict(weights)
        self.treedef = treedef
        self.avals = tuple(avals)
        self.kept = tuple(kept)
        self.tied = tuple(tied)  # (gather key, matmul key): the lookup reads the matmul's codes

    def tree_flatten(self):
        return (self.leaves, self.weights), (self.treedef, self.avals, self.kept, self.tied)

    def tree_flatten_with_keys(self):
        """The children with paths that name them (``.leaves[i]``, ``.weights['key']``):
        what optax masks, orbax and JAX's error messages show."""
        children, aux = self.tree_flatten()
        names = (jax.tree_util.GetAttrKey("leaves"), jax.tree_util.GetAttrKey("weights"))
        return tuple(zip(names, children)), aux

    @classmethod
    def tree_unflatten(cls, aux, children):
        # children as they come: JAX's transformations and orbax put objects of their own
        # in place of each child (orbax one SaveArgs for an empty tuple or dict)
        out = object.__new__(cls)
        out.leaves, out.weights = children
        out.treedef, out.avals, out.kept, out.tied = aux
        return out

    def __reduce__(self):
        """Pickle and ``copy.deepcopy`` carry the params' structure as the params' own
        object with placeholder leaves, which pickles by its class: JAX pickles a treedef's
        node data by value, which copies a sentinel such as Equinox's ``_Missing`` that the
        class's unflatten compares by identity (the copy failed at its first call). A class
        that refuses placeholders keeps the treedef as it is."""
        return (_packed_from, (self.leaves, self.weights, _portable(self.treedef, len(self.avals)),
                               self.avals, self.kept, self.tied))

    def weight(self, key):
        """The packed :class:`QArray` op ``key`` reads, or ``None``. An embedding table
        tied to a matmul (``tied``) holds its own scales and the matmul's codes."""
        w = self.weights.get(key)
        owner = dict(self.tied).get(key)
        if w is None or owner is None:
            return w
        o = self.weights[owner]
        return dataclasses.replace(w, values=o.values, layout=o.layout)

    def nbytes(self) -> int:
        """Bytes of every array held (int8 weights, sums and float leaves; a typed PRNG
        key's key data), an array that several ops share counted once; a leaf that is no
        array (a function, a string) counts none."""
        held = {id(x): x for x in jax.tree_util.tree_leaves(self)}

        def size(x):  # from shapes and dtypes: no copy to the host; shapes alone count
            dtype = getattr(x, "dtype", None)
            if dtype is None and not isinstance(x, (bool, int, float, complex)):
                return 0
            if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
                x = jax.eval_shape(jax.random.key_data, x)  # a typed PRNG key: its key data
            dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
            return math.prod(np.shape(x)) * np.dtype(dtype).itemsize
        return int(sum(size(x) for x in held.values()))

    def key_paths(self):
        """The ``jax.tree_util`` key path of each leaf of the params it was packed from, in
        flattening order (the index of ``avals`` and ``kept``); ``None`` where the params'
        class refuses to be rebuilt from placeholders (one that checks its fields)."""
        try:
            tree = jax.tree_util.tree_unflatten(self.treedef, list(range(len(self.avals))))
            return [p for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        except Exception:  # noqa: BLE001 - whatever the class's own check raises
            return None

    def __getitem__(self, key):
        raise TypeError(
            f"jqt.PackedParams is not the params' tree (read at {key!r}): it holds packed "
            "weights (jqt.pack, jqt.load_packed), which only the quantized function reads. Call "
            "jqt.quantize(f, qparams)(packed, ...), not f itself, which takes the float params; "
            "packed.weight(op_key) gives an op's codes.")

    def __contains__(self, key):
        self[key]

    def __iter__(self):
        raise TypeError("jqt.PackedParams is not iterable (it is not the params' tree): it holds "
                        "packed weights (jqt.pack, jqt.load_packed), which only the quantized "
                        "function reads; jax.tree.leaves(packed) gives its arrays.")

    def __repr__(self):
        tied = f", {len(self.tied)} tied to another's codes" if self.tied else ""
        n = len(self.weights)  # ops reading one weight alike share its codes: counted once
        codes = len({id(w.values) for w in self.weights.values() if w.values is not None})
        what = (f"{n} quantized weights" if codes + len(self.tied) >= n else
                f"{n} quantized ops sharing {codes} set{'s' if codes != 1 else ''} of codes")
        return (f"PackedParams({what}{tied}, {len(self.leaves)} float leaves kept of "
                f"{len(self.avals)})")


def _portable(treedef, n):
    """``("tree", the structure as an object)`` where unflattening placeholders gives the
    same structure back, else ``("treedef", treedef)``."""
    try:
        tree = jax.tree_util.tree_unflatten(treedef, list(range(n)))
        if jax.tree_util.tree_structure(tree) == treedef:
            pickle.dumps(tree)  # (a class holding a jitted method or a lock does not pickle)
            return ("tree", tree)
    except Exception:  # noqa: BLE001 - whatever the class's own check or pickle raises
        pass
    return ("treedef", treedef)


def _packed_from(leaves, weights, structure, avals, kept, tied):
    kind, held = structure
    out = object.__new__(PackedParams)  # the children as they are, as tree_unflatten keeps
    out.leaves, out.weights, out.avals, out.kept, out.tied = leaves, weights, avals, kept, tied
    out.treedef = jax.tree_util.tree_structure(held) if kind == "tree" else held
    return out


_BARE = {  # the keys such a dict may have, and those it has (one of them for OpQParams)
    "jqt.OpQParams": ({"lhs", "rhs", "smooth"}, ({"lhs"}, {"rhs"})),
    "jqt.PackedParams": ({"leaves", "weights"}, ({"weights"},)),  # weights: QArray dicts
    "jqt.QArray": (set(_QARRAY_DATA) | {"smooth"}, ({"values", "scale"},))}


def restored_bare(v) -> Optional[str]:
    """The jqt type that the plain dict ``v`` looks like, flattened to its arrays (what a
    checkpointer such as orbax restores without a template: the formats, which are no
    arrays, are lost), or ``None``.

    >>> restored_bare({"lhs": {"scale": 1.0}, "rhs": {"scale": 1.0}}), restored_bare({"w": 1})
    ('jqt.OpQParams', None)
    >>> restored_bare({"scale": 1.0})  # flax RMSNorm's params
    >>> restored_bare({"values": np.zeros(4, np.int8), "scale": np.ones(1, np.float32)})
    'jqt.QArray'
    >>> restored_bare({"values": np.zeros(4, np.float32), "scale": np.ones(1, np.float32)})
    """
    if not isinstance(v, dict) or not v or not all(isinstance(k, str) for k in v):
        return None
    kind = next((name for name, (allowed, needs) in _BARE.items()
                 if set(v) <= allowed and any(n <= set(v) for n in needs)), None)
    if kind == "jqt.PackedParams" and not (isinstance(v["weights"], dict) and v["weights"] and all(
            restored_bare(w) == "jqt.QArray" for w in v["weights"].values())):
        return None
    if kind == "jqt.QArray" and not _code_dtype(getattr(v["values"], "dtype", None)):
        return None  # float values: a user's own parameters (a codebook), not codes
    return kind


def bare_advice(v) -> str:
    """A sentence for an error about ``v`` where it is a plain dict a checkpointer restored
    without a template (:func:`restored_bare`), else ``""``."""
    kind = restored_bare(v)
    if kind is None:
        return ""
    keep = {"jqt.OpQParams": "jqt.save / jqt.load", "jqt.PackedParams": "jqt.save_packed / "
            "jqt.load_packed", "jqt.QArray": "a template of jqt.quantize_cache(cache, kind)"}[kind]
    return (f" It is a plain dict with the fields of a {kind}: one flattened to its arrays, as a "
            "checkpointer (orbax) restores it without a template; its formats are not arrays, so "
            "they are lost. Restore with a template (jax.eval_shape of what was saved), or use "
            f"{keep}, which keep them.")


def _code_dtype(dtype) -> bool:
    """Integers (int8 codes, 4-bit pairs in uint8) or an fp8 type."""
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    return dtype.kind in "iu" or dtype in tuple(np.dtype(t) for t in FLOAT8.values())


def calibrated_args(qparams) -> list:
    """The arguments of ``f`` (indices, sorted) whose weights the ops of ``qparams`` read
    where they were calibrated (``WeightSource.arg``).

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda x, w: x @ w, jqt.recipes.w8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], weight_argnums=1, progress=False)
    >>> calibrated_args(qp)
    [1]
    """
    return sorted({p.source.arg for p in qparams.values() if getattr(p, "source", None) is not None})


def summarize(qparams: dict[str, Any]) -> str:
    """A readable table of ``qparams``: one line per op key.

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> print(jqt.summarize(qp))  # doctest: +ELLIPSIS
    key  op           weight ...
    """
    if not isinstance(qparams, dict):
        raise TypeError(f"jqt.summarize: expected the qparams dict jqt.calibrate (or jqt.load) "
                        f"returns, got a {type(qparams).__name__}.")
    if qparams and not any(isinstance(p, OpQParams) for p in qparams.values()):
        k, p = next(iter(qparams.items()))
        raise TypeError(f"jqt.summarize: qparams['{k}'] is of type {type(p).__name__}, and no entry is a "
                        "jqt.OpQParams: pass the qparams jqt.calibrate (or jqt.load) returns"
                        + ("." + bare_advice(p) if bare_advice(p) else ", not the model's params."))
    rows = [("key", "op", "weight", "activation")]
    for k, p in qparams.items():
        if not isinstance(p, OpQParams):
            text = repr(p)
            rows.append((k, "?", text if len(text) <= 60 else text[:57] + "...", ""))
            continue
        if p.is_float:
            rows.append((k, p.op, "float", p.note or "kept float"))
            continue
        if p.op in ("dynamic_update_slice", "scatter"):  # a key/value cache write
            rows.append((k, p.op, "-", f"kv cache {p.lhs.qtype.describe()}"))
            continue
        w = p.weight_operand
        wq = p.operand(w) if w is not None else None
        aq = [p.operand(i) for i in (0, 1) if i != w]
        extra = (" +smooth" if p.smooth is not None else "") + (" +rotate" if p.rotate else "")
        acc = f", int{p.accumulator} accumulator" if p.accumulator != 32 else ""
        # No weight (a product of two activations): "-", as report's rows and cache writes.
        wtext = "-" if w is None else _short(wq) + extra
        rows.append((k, p.op, wtext, ", ".join(_short(a) for a in aq) + acc))
    widths = [max(width(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(pad(c, widths[i]) for i, c in enumerate(r)).rstrip() for r in rows)


def _short(p: Optional[QArray]) -> str:
    return "float" if p is None else p.qtype.describe()


def fold_mismatch(packed: Optional[str], want: str) -> Optional[str]:
    """Why a packed weight's ``QArray.folded`` does not fit qparams whose
    ``OpQParams.fold_tag`` is ``want``, or ``None`` when it fits (or was not
    recorded). A smoothing digest ``"?"`` (traced qparams) matches any digest.
    ``"smooth=<digest>"`` (the weight holds the vector) and ``"smooth:<digest>"`` compare
    alike.

    >>> fold_mismatch("smooth:ab12", ""), fold_mismatch("smooth:ab12", "smooth:?")
    ('its codes hold a smoothing vector (SmoothQuant or AWQ) that these qparams do not apply', None)
    """
    if packed is None:
        return None
    a, b = fold_parts(packed), fold_parts(want)
    if ("rotate" in a) != ("rotate" in b):
        return ("its codes hold a Hadamard rotation that these qparams do not apply" if "rotate" in a
                else "these qparams rotate the activation, but its codes were not rotated")
    if ("smooth" in a) != ("smooth" in b):
        return ("its codes hold a smoothing vector (SmoothQuant or AWQ) that these qparams do not "
                "apply" if "smooth" in a else
                "these qparams smooth the activation, but its codes were packed without smoothing")
    if "smooth" in a and "?" not in (a["smooth"], b["smooth"]) and a["smooth"] != b["smooth"]:
        return "its codes were smoothed by another smoothing vector than these qparams hold"
    return None
