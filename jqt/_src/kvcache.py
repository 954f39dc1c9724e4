"""Quantized key/value caches: buffers that a loop carries and writes into.

A *cache* is a float buffer carried by a ``lax.scan`` or ``lax.while_loop``
(directly, or sliced per layer by an inner scan) into which the loop body
writes new values with ``dynamic_update_slice`` or ``.at[...].set``
(``scatter``), each write spanning the buffer's whole last axis (a head's
features); or an argument of the function that it returns so written (a
decode step called from a Python loop: the call is the loop). The analysis
finds them (``analysis.py``: the write is a site of
the registry's ``CacheWrite`` entry); with a rule's ``kv_cache`` type:

* the integer path carries the buffer as a :class:`jqt.QArray` with
  ``layout="cache"``: codes (int8; int4 two per byte along the last axis; or
  fp8, held as their uint8 bits where the backend has no native fp8
  (``KernelPolicy.fp8_native``: XLA:CPU computes on fp8 buffers in float16, so
  each decode step converted the whole carried cache, 5.5x a float cache; see
  :func:`encode`) and one float16 scale per vector along the last axis (per token and
  head), ``scale.shape == buffer.shape[:-1] + (1,)``. The loop quantizes the
  buffer it is given once, on entry, and returns float on exit (a cache the
  function takes and returns: quantized, passed back in as it is); every write
  quantizes the new vectors; a ``dot_general`` reading the cache (attention)
  takes the scale out of the contraction (:func:`dot_general`); any other
  reader gets the decoded float buffer.
* the simulated path keeps float buffers holding exactly the values the cache
  would decode to (:func:`fake_quant` on entry and at every write).

Scales are ``absmax / amax_code`` rounded to the nearest float16 (the largest
value takes the largest code, and encoding a decoded cache again changes
nothing) and kept within float16's normal range ``[2**-14, 65504]``: a vector
whose absolute maximum is below ``2**-14 * amax_code`` gets steps of
``2**-14``, and values beyond ``65504 * amax_code`` (8.3e6 for int8, 4.6e5 for
int4, 2.9e7 for e4m3) clip.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat, diagnostics
from . import numerics as nx
from .formats import FLOAT8, QuantType, pack_nibbles, unpack_nibbles
from .policy import KernelPolicy, check_policy
from .qparams import OpQParams, QArray, bare_advice

SCALE_DTYPE = jnp.float16
_TINY, _HUGE = 2.0 ** -14, 65504.0
_F32 = jnp.float32

INT8 = QuantType(bits=8, symmetric=True, narrow_range=True, per_channel=True, dynamic=True)
"""The default cache type: int8 codes in -127..127, one scale per token and head."""


def cache_type(kind) -> QuantType | None:
    """The cache :class:`jqt.QuantType` a preset's ``kv_cache=`` names: ``True`` or
    ``"int8"``, ``"int4"``, ``"fp8"`` (``"float8_e4m3fn"``), ``"float8_e5m2"`` (or the
    dtypes of those names), a ``QuantType``, or ``False``/``None`` (float cache); a NumPy
    bool as Python's."""
    if isinstance(kind, np.bool_):
        kind = bool(kind)
    if kind is None or kind is False:
        return None
    if not isinstance(kind, (bool, str, QuantType)):  # a dtype (jnp.float8_e5m2, jnp.int4), as
        try:  # QuantType(dtype=...) and fp8(weight_dtype=...) take it
            name = np.dtype(kind).name
        except (TypeError, ValueError):  # (a dict: NumPy's "entry not a 2- or 3- tuple")
            name = None
        if name in ("int8", "int4", "float8_e4m3fn", "float8_e5m2"):
            kind = name
    if kind is True or kind == "int8":
        return INT8
    if kind == "int4":
        return QuantType(bits=4, symmetric=True, narrow_range=True, per_channel=True, dynamic=True)
    if kind in ("fp8", "float8_e4m3fn", "float8_e5m2"):
        dtype = "float8_e4m3fn" if kind == "fp8" else kind
        return QuantType(dtype=dtype, per_channel=True, dynamic=True)
    if isinstance(kind, QuantType):
        return kind
    shown = repr(kind) if len(repr(kind)) <= 60 else f"a {type(kind).__name__}"  # (a Recipe)
    hint = (" (a rule's cache type is its kv_cache=: rule.kv_cache)" if hasattr(kind, "kv_cache")
            else " (a recipe's cache type is one of its rules' kv_cache=: recipe.rules[i].kv_cache, "
            "None where the preset was made without kv_cache=)" if hasattr(kind, "rules") else "")
    raise ValueError(f"kv_cache={shown}: use True (int8), 'int8', 'int4', 'fp8', 'float8_e5m2' or "
                     f"a jqt.QuantType(..., per_channel=True, dynamic=True){hint}.")


def kind_name(t: QuantType) -> str:
    """The ``kv_cache=`` value that names cache type ``t``, as code for a message.

    >>> kind_name(cache_type("int4")), kind_name(cache_type(True))
    ("'int4'", "'int8'")
    """
    for name in ("int8", "int4", "fp8", "float8_e5m2"):
        if cache_type(name) == t:
            return repr(name)
    return f"jqt.{t!r}"


def _cache_type(t) -> bool:
    """Whether ``t`` can type a cache: symmetric, dynamic, per vector, <= 8 bits, no table."""
    return isinstance(t, QuantType) and not (
        t.kind == "lut" or not t.symmetric or not t.dynamic or not t.per_channel or t.group_size
        or (t.kind == "int" and t.bits > 8))


_CACHE_TYPES = ("a KV cache type is symmetric, dynamic and per vector (one scale per token and "
                "head, computed at each write), int2-int8 or fp8")


def check_type(t: QuantType, where: str):
    """Raises unless ``t`` can type a cache (:func:`_cache_type`)."""
    if not _cache_type(t):
        raise ValueError(f"{where}: {_CACHE_TYPES}; got {t.describe()}. Use kv_cache=True "
                         "(int8), 'int4' or 'fp8' on a preset.")


def written_type(state):
    """The cache type a write's state (its :class:`OpQParams`, or ``(qparams, packed)``)
    gives it; ``None``: float, or no state."""
    qp = state[0] if isinstance(state, tuple) else state
    return qp.lhs.qtype if isinstance(qp, OpQParams) and not qp.is_float else None


def slot_type(writes, state_in):
    """The type a loop carries a buffer in: its writes' common ``kv_cache`` type, or
    ``None`` (float) when any of them is float or absent, or they differ (said, where
    one of them is quantized: the buffer the qparams ask to quantize is carried float, and
    its quantized writes still round their vectors, as :func:`write` into a float buffer)."""
    types = {k: written_type(state_in.get(k)) for k in writes}
    kinds = set(types.values())
    if len(kinds) == 1:
        return kinds.pop()
    if kinds != {None}:
        said = ", ".join(f"{k!r} ({'float' if t is None else t.describe()})" for k, t in types.items())
        diagnostics.warn(
            f"jqt: one key/value buffer is written by {said}: its writes' cache types differ, "
            "so it stays float: carried as float, no bytes saved, while each quantized write "
            "still rounds the vectors it writes to its own type, as a write into a float "
            "buffer does. Give every write of the buffer one type (one "
            "Rule(kv_cache=...) whose key= matches them all), or kv_cache=False for all of them.")
    return None


def is_cache(x) -> bool:
    return isinstance(x, QArray) and x.layout == "cache"


def scales(x, qtype):
    """One float16 scale per vector along the last axis of ``x`` (keepdims):
    ``absmax / amax_code`` rounded to the nearest float16. The largest value takes the
    largest code (clipped by at most ``2**-11`` of itself, far less than half a step).
    Encoding a decoded cache again gives the same codes and scales (its absmax is
    ``amax_code * scale`` to within float32 rounding, which rounds back to the same
    float16), so a loop that re-enters or rewrites a cache does not drift.

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[0.3, -1.7, 0.01]])
    >>> s = scales(x, INT8); again = jnp.round(x / s) * s.astype(jnp.float32)
    >>> bool((scales(again, INT8) == s).all()), bool((scales(again * (1 + 2**-20), INT8) == s).all())
    (True, True)
    """
    amax = jnp.max(jnp.abs(lax.stop_gradient(x).astype(_F32)), axis=-1, keepdims=True)
    return jnp.clip(amax / qtype.amax_code, _TINY, _HUGE).astype(SCALE_DTYPE)


def encode(x, qtype, fp8_bits: bool = False, float_dtype=None) -> QArray:
    """A float buffer ``x`` as a cache :class:`jqt.QArray` (codes and scales). fp8 codes
    are held as their uint8 bits where ``fp8_bits`` (a backend without native fp8): a
    loop then writes bytes into its carried buffer, and :func:`codes` decodes them
    with integer operations. ``float_dtype``: the dtype of the buffer the cache stands
    for (default ``x``'s).

    >>> import jax.numpy as jnp
    >>> t = cache_type("fp8"); x = jnp.array([[0.3, -1.7, 0.01]])
    >>> encode(x, t).values.dtype.name, encode(x, t, fp8_bits=True).values.dtype.name
    ('float8_e4m3fn', 'uint8')
    >>> bool((decode(encode(x, t), jnp.float32) == decode(encode(x, t, True), jnp.float32)).all())
    True
    """
    s = scales(x, qtype)
    v = nx.quantize(x, s.astype(_F32), None, qtype)
    if qtype.nibbles_fit(v.shape[-1]):  # else (an odd last axis) one int8 code per byte
        parts = compat.split_count(v, v.ndim - 1)
        if parts > 1 and (v.shape[-1] // parts) % 2:
            raise ValueError(
                f"jqt: a KV cache of type {qtype.describe()}, {v.shape[-1]} features per vector, its "
                f"last axis split over explicit mesh axes into {parts} parts of "
                f"{v.shape[-1] // parts}: two 4-bit codes per byte need an even count on each "
                "device. Split the heads (or batch, or time) rather than the features, give each "
                "device an even count, or use an int8 cache (kv_cache=True).")
        v = pack_nibbles(v, v.ndim - 1)
    elif fp8_bits and qtype.kind == "float":
        v = lax.bitcast_convert_type(v, jnp.uint8)
    return QArray(values=v, scale=s, qtype=qtype, layout="cache",
                  float_dtype=np.dtype(float_dtype or x.dtype).name)


def _holds_fp8_bits(c: QArray) -> bool:
    return c.qtype.kind == "float" and c.values.dtype == jnp.uint8


def codes(c: QArray, dtype):
    """The cache's codes as numbers of ``dtype`` (unpacked, decoded), without the scale."""
    v = c.values
    if c.nibbles:
        v = unpack_nibbles(v, v.ndim - 1)
    if _holds_fp8_bits(c):
        v = lax.bitcast_convert_type(v, FLOAT8[c.qtype.grid])  # free: decode reads the bits
    return nx.decode(v, c.qtype.grid).astype(dtype)


def decode(c: QArray, dtype):
    """A cache back to a float buffer of ``dtype`` (clipped to its finite range: a
    float16 cache's 65504, its scale rounded up to a float16 value, decodes past it)."""
    return nx.cast_finite(codes(c, _F32) * c.scale.astype(_F32), dtype)


def fake_quant(x, qtype):
    """``decode(encode(x))`` in float, differentiable (straight-through)."""
    return nx.fake_quant(x, scales(x, qtype).astype(_F32), None, qtype).astype(x.dtype)


def enter(x, qtype, simulate: bool, fp8_bits: bool = False):
    """A loop's initial buffer as the loop carries it (``fp8_bits``: :func:`encode`'s); a
    cache passed to the function quantized stays so (the simulated path decodes it)."""
    if is_cache(x):
        return decode(x, x.float_dtype) if simulate else x
    return fake_quant(x, qtype) if simulate else encode(x, qtype, fp8_bits)


def float_shape(c: QArray) -> tuple:
    """The shape of the float buffer a cache stands for (two codes per byte: twice the
    last axis of the codes)."""
    shape = tuple(c.values.shape)
    return shape[:-1] + (2 * shape[-1],) if c.nibbles else shape


def cache_problem(x) -> str:
    """What is wrong with quantized cache ``x`` (``is_cache``), after "a key/value cache",
    or ``""``: no codes, scales or float dtype; codes or scales of another dtype or shape
    than its type holds (a ``tree_map`` cast of a whole state casts them too)."""
    if x.float_dtype is None or x.values is None or x.scale is None:
        return (f"{x!r} without codes, scales or the float dtype it stands for (float_dtype). "
                "Pass back the cache the quantized function returned, as it is, or a float "
                "buffer.")
    again = ("Pass back the cache the quantized function returned as it is, or make one with "
             "jqt.quantize_cache(x, 'int8').")
    if not _cache_type(x.qtype):
        return f"of type {x.qtype.describe()}, where {_CACHE_TYPES}. {again}"
    if x.zero_point is not None:
        return (f"with a zero point, which its type ({x.qtype.describe()}, symmetric) has no "
                f"use for: its values are codes x scale. {again}")
    try:
        floating = jnp.issubdtype(jnp.dtype(x.float_dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        return (f"whose float_dtype ({x.float_dtype!r}), the dtype of the buffer it stands for, "
                f"is not a float dtype. {again}")
    kind = x.qtype.kind
    # (by the type: codes of another dtype are no nibbles, whatever the type packs)
    codes_ok = (("int8", "uint8") if x.qtype.bits <= 4 else ("int8",)) if kind == "int" else \
        (np.dtype(FLOAT8[x.qtype.grid]).name, "uint8") if kind == "float" else ()
    want = tuple(x.values.shape[:-1]) + (1,)
    if np.dtype(x.values.dtype).name in codes_ok and np.dtype(x.scale.dtype) == SCALE_DTYPE \
            and tuple(x.scale.shape) == want:
        return ""
    return (f"whose codes are {np.dtype(x.values.dtype).name}{list(x.values.shape)} and scales "
            f"{np.dtype(x.scale.dtype).name}{list(x.scale.shape)}, where a cache of type "
            f"{x.qtype.describe()} holds {' or '.join(codes_ok)} codes and float16{list(want)} "
            "scales (one per vector). Pass back the cache the quantized function returned as it "
            "is: casting the floating leaves of a state (to bfloat16, say) changes its scales "
            "too.")


def placeholders(args):
    """``args`` with each quantized cache (a :class:`jqt.QArray` with ``layout="cache"``,
    as a quantized decode step returns it) replaced by zeros of the float buffer it
    stands for: what ``f`` is traced with. Under ``jax.jit`` nothing reads them.

    >>> import jax.numpy as jnp
    >>> c = encode(jnp.ones((2, 3, 8), jnp.bfloat16), cache_type("int4"))
    >>> c.values.shape, placeholders([{"k": c}])[0]["k"].dtype.name
    ((2, 3, 4), 'bfloat16')
    """
    def one(path, x):
        if not is_cache(x):
            return x
        why = cache_problem(x)
        if why:
            raise ValueError(f"jqt: argument {jax.tree_util.keystr(path)} is a key/value cache {why}")
        # split over explicit mesh axes as the codes are (a cache jax.shard_map splits by heads),
        # and inside jax.shard_map varying over the manual axes they vary over: a placeholder
        # typed invariant was cast to varying in the traced function, a cast JAX refuses on
        # the cache itself
        z = compat.zeros(float_shape(x), x.float_dtype, compat.explicit_sharding(x.values, traced=True))
        return compat.vary_like(z, x.values)
    return jax.tree_util.tree_map_with_path(one, args, is_leaf=is_cache)


def quantize_cache(x, kv_cache=True, *, policy=None) -> QArray:
    """A float key/value buffer as the quantized cache a decode step returns.

    A decode step that takes its cache and returns it written, quantized with a preset's
    ``kv_cache``, returns the cache as a :class:`jqt.QArray` (``docs/generate.md``). A
    Python loop passes it back as it is; a ``lax.scan`` or ``lax.while_loop`` over the
    step needs its carry to start as one: this quantizes the initial buffer (zeros, or a
    prefill's keys and values) as the step's first call would.

    Args:
      x: the float buffer, its last axis the features of one head (one scale per vector
        along it).
      kv_cache: the cache type, as a preset's ``kv_cache=``: ``True`` or ``"int8"``,
        ``"int4"``, ``"fp8"``, ``"float8_e5m2"`` or a :class:`jqt.QuantType`; it must
        be the type the step's qparams write (else the step raises
        :class:`jqt.QParamsMismatchError`).
      policy: the :class:`jqt.KernelPolicy` the step runs under (default: the default
        backend's), which decides how fp8 codes are held.

    >>> import jax, jax.numpy as jnp, jqt
    >>> c = jqt.quantize_cache(jnp.zeros((2, 1, 16, 2, 32)))
    >>> c.values.dtype.name, c.scale.shape, c.float_dtype
    ('int8', (2, 1, 16, 2, 1), 'float32')
    """
    t = cache_type(kv_cache)
    if t is None:
        raise ValueError(f"jqt.quantize_cache(kv_cache={kv_cache!r}): give a cache type (True for "
                         "int8, 'int4', 'fp8'); a float cache needs no quantizing.")
    check_type(t, "jqt.quantize_cache")
    check_policy(policy, "jqt.quantize_cache")
    if isinstance(x, QArray):
        raise TypeError("jqt.quantize_cache: x is a jqt.QArray, a cache quantized already; pass it "
                        "to the step as it is.")
    if not hasattr(x, "shape") and not isinstance(x, (int, float)):
        kind = kind_name(t)
        raise TypeError(f"jqt.quantize_cache: x is a {type(x).__name__}; pass one float buffer, "
                        "and for a cache dict each of its buffers, e.g. dict(cache, "
                        f"k=jqt.quantize_cache(cache['k'], {kind}), v=jqt.quantize_cache(cache['v'], "
                        f"{kind})), with the type the step's preset took as kv_cache=.")
    x = jnp.asarray(x)  # a NumPy float64 buffer: JAX's float (float32 unless x64 is on)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating) or jnp.ndim(x) < 2:
        raise ValueError(f"jqt.quantize_cache: x is {jnp.result_type(x)}{list(jnp.shape(x))}, where a "
                         "key/value cache is a float buffer of 2 or more axes, the last the features.")
    if jnp.shape(x)[-1] == 0:
        raise ValueError(f"jqt.quantize_cache: x is {jnp.result_type(x)}{list(jnp.shape(x))}, whose "
                         "last axis (the features, one scale per vector of it) is empty.")
    return encode(x, t, fp8_bits=fp8_as_bits(policy))


def dequantize_cache(c, dtype=None):
    """The float buffer a quantized key/value cache stands for: the inverse of
    :func:`jqt.quantize_cache`, for a cache a decode step returned (its codes may be
    int4 two per byte, or fp8 held as their uint8 bits: ``values * scale`` is not it).
    ``dtype`` defaults to the buffer's own (``QArray.float_dtype``).

    >>> import jax.numpy as jnp, jqt
    >>> x = jnp.linspace(-1, 1, 16).reshape(2, 8)
    >>> c = jqt.quantize_cache(x, "int4")
    >>> y = jqt.dequantize_cache(c)
    >>> y.shape, y.dtype.name, bool(jnp.abs(y - x).max() < 0.08)
    ((2, 8), 'float32', True)
    """
    if dtype is not None:  # first: the advice for a pytree below repeats it
        try:
            floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise TypeError(f"jqt.dequantize_cache: dtype={dtype!r} is not a float dtype; the "
                            "decoded cache is float (float32, bfloat16, ...). The codes "
                            "themselves are the cache's .values.")
    if not is_cache(c):
        raise TypeError(f"jqt.dequantize_cache: expected a quantized cache (a jqt.QArray with "
                        f"layout 'cache', from jqt.quantize_cache or a decode step), got a "
                        f"{type(c).__name__}"
                        + (f" with layout {c.layout!r}" if isinstance(c, QArray) else "") + "."
                        + (bare_advice(c) or _tree_advice(c, dtype)))
    why = cache_problem(c)
    if why:  # (codes cast to float were read as numbers, 4-bit ones at half the width)
        raise ValueError(f"jqt.dequantize_cache: a key/value cache {why}")
    return decode(c, dtype or c.float_dtype)


def _tree_advice(tree, dtype) -> str:
    """For :func:`dequantize_cache` given a pytree that holds caches (a decode state):
    how to decode each, other leaves (a position) passed through."""
    if not any(is_cache(l) for l in jax.tree.leaves(tree, is_leaf=is_cache)):
        return ""
    d = "" if dtype is None else f", {jnp.dtype(dtype).name!r}"  # (a float dtype: checked)
    return (" For a pytree that holds caches, decode each: jax.tree.map(lambda c: "
            f"jqt.dequantize_cache(c{d}) if isinstance(c, jqt.QArray) else c, caches, "
            "is_leaf=lambda c: isinstance(c, jqt.QArray)).")


def fp8_as_bits(policy) -> bool:
    """Whether a cache's fp8 codes are held as their uint8 bits under ``policy`` (default:
    the default backend's): where the backend has no native fp8 (:func:`encode`)."""
    return not (policy or KernelPolicy.for_backend()).fp8_native


def materialize(values, variables):
    """``values`` with every quantized cache decoded to its float buffer, in the dtype of
    the jaxpr variable it stands for (an equation's operands, or a function's outputs:
    a cache stays quantized only inside the loops that carry it)."""
    return [decode(x, v.aval.dtype) if is_cache(x) else x for x, v in zip(values, variables)]


def write(eqn, invals, update_index, qtype, zero=False):
    """A ``dynamic_update_slice`` / ``scatter`` into a cache: the update is quantized per
    vector and its codes and scales are written with the same indices. Into a float
    buffer, the update is written as the cache would hold it. ``zero``: the update is
    zeros (a slot cleared, ``cache.at[slot].set(0.0)``): the codes and scales of one zero
    vector, broadcast, not a block of the cache's size encoded each step."""
    buf, upd = invals[0], invals[update_index]
    same = is_cache(buf) and is_cache(upd) and upd.qtype == buf.qtype \
        and _holds_fp8_bits(upd) == _holds_fp8_bits(buf)
    if is_cache(upd) and not same:  # a view of another cache: its values
        upd = decode(upd, eqn.invars[update_index].aval.dtype)
    if not is_cache(buf):
        vals = list(invals)
        vals[update_index] = fake_quant(upd, qtype)
        return compat.bind_eqn(eqn, vals)
    # a view of the cache written back into it (a window shifted in place, cache[1:] into
    # cache[:-1]) keeps its codes and scales: the values the simulation re-quantizes to
    if same:
        u = upd
    elif zero:
        one = encode(jnp.zeros(upd.shape[-1:], _F32), qtype, _holds_fp8_bits(buf), buf.float_dtype)
        u = dataclasses.replace(one, values=jnp.broadcast_to(one.values, upd.shape[:-1] + one.values.shape),
                                scale=jnp.broadcast_to(one.scale, upd.shape[:-1] + one.scale.shape))
    else:
        u = encode(upd.astype(_F32), qtype, _holds_fp8_bits(buf), buf.float_dtype)

    def put(b, x):
        vals = list(invals)
        vals[0], vals[update_index] = b, x
        return compat.bind_eqn(eqn, vals)[0]

    return [dataclasses.replace(buf, values=put(buf.values, u.values), scale=put(buf.scale, u.scale))]


# ops that place or name their operands, and the parameter holding each operand's
# sharding (``with_sharding_constraint``, ``jax.sharding.reshard``, ``jax.device_put``
# inside f; ``checkpoint_name``, which has none)
_PLACING = {"sharding_constraint": "sharding", "reshard": "dst_sharding", "device_put": "devices",
            "name": None}


def _places_whole_vectors(eqn) -> bool:
    """A :data:`_PLACING` op whose shardings leave every operand's last axis whole (a
    ``NamedSharding`` or ``PartitionSpec`` of no more entries than axes, none on the last):
    on a cache it places the codes and the scales (last axis 1) alike."""
    key = _PLACING[eqn.primitive.name]
    if key is None:
        return True
    given = eqn.params.get(key)
    given = given if isinstance(given, (tuple, list)) else (given,)
    for sh, v in zip(given, eqn.invars):
        spec = getattr(sh, "spec", sh)
        if not isinstance(spec, jax.sharding.PartitionSpec):
            return False  # (a device, a sharding of another kind)
        nd = len(v.aval.shape)
        if len(spec) > nd or (len(spec) == nd and nd and spec[-1] is not None):
            return False
    return True


def is_plain_copy(eqn) -> bool:
    """An identity on every operand (``copy``, ``stop_gradient``, an
    ``optimization_barrier``; equinox's loops copy their carry; a sharding constraint,
    reshard, ``device_put`` or ``checkpoint_name`` that leaves the last axis whole): a
    cache under it is the same cache, passed on quantized, and the copy does not read it."""
    name = eqn.primitive.name
    if len(eqn.invars) != len(eqn.outvars):
        return False
    if name in _PLACING:
        return _places_whole_vectors(eqn)
    return name in ("copy", "copy_p", "stop_gradient", "optimization_barrier")


def copy(eqn, invals) -> list:
    """The outputs of an :func:`is_plain_copy` equation whose operands hold a cache: the
    same values, the cache still quantized, under the same barrier, gradient stop,
    placement or name (applied to the cache's codes and scales alike)."""
    name = eqn.primitive.name
    if name == "optimization_barrier":
        return list(lax.optimization_barrier(list(invals)))
    if name == "stop_gradient":
        return [lax.stop_gradient(v) for v in invals]
    if name in _PLACING:  # one operand at a time, each leaf of a cache under its own
        key, out = _PLACING[name], []
        for i, v in enumerate(invals):
            one = {} if key is None or name != "device_put" else {
                p: (eqn.params[p][i],) for p in ("devices", "srcs", "copy_semantics")}
            out.append(jax.tree_util.tree_map(lambda a: compat.bind_eqn(eqn, [a], **one)[0], v))
        return out
    return list(invals)


def is_buffer_view(eqn) -> bool:
    """A ``transpose`` that keeps the last axis last, or a :func:`is_read_view` op whose
    output has its operand's shape. A cache under it is the same cache, its codes and
    scales rearranged alike (:func:`view`): ``jax.vmap`` of a decode loop moves the batch
    axis behind the layer axis of the buffer the loop carries before the scan over layers
    slices it, and back after; beam search reorders the beams' caches
    (``cache[:, order]``, a ``gather``) before it writes the next token."""
    if eqn.primitive is compat.transpose_p:
        perm = eqn.params["permutation"]
        return bool(perm) and perm[-1] == len(perm) - 1
    if not is_read_view(eqn):
        return False
    ins, out = eqn.invars[0].aval, eqn.outvars[0].aval
    return (ins.shape, ins.dtype) == (out.shape, out.dtype)


def view(eqn, invals) -> QArray:
    """:func:`is_buffer_view`'s or :func:`is_read_view`'s op on a cache (``invals[0]``)."""
    if eqn.primitive is not compat.transpose_p:
        return read_view(eqn, invals)
    c, perm = invals[0], eqn.params["permutation"]
    return dataclasses.replace(c, values=lax.transpose(c.values, perm), scale=lax.transpose(c.scale, perm))


def is_read_view(eqn) -> bool:
    """An op that reads whole vectors of its operand's last axis and keeps them last: a
    ``broadcast_in_dim`` that maps the last axis onto the last (``jnp.repeat`` of a
    grouped-query cache's heads), a ``reshape`` that keeps the last axis (a paged cache's
    pages joined), a ``slice``, ``dynamic_slice`` or ``gather`` that takes the last axis
    whole (a window; pages by a page table), or a ``convert_element_type`` to another
    float dtype (a float32 cache read in bfloat16). A cache under it stays quantized, its
    codes and scales read alike (:func:`read_view`), so attention reads the codes of what
    it selects instead of a decoded copy of the whole buffer."""
    prim = eqn.primitive
    if prim not in (compat.broadcast_in_dim_p, compat.reshape_p, compat.slice_p, compat.squeeze_p,
                    compat.dynamic_slice_p, compat.gather_p, compat.convert_element_type_p):
        return False
    ins, out = eqn.invars[0].aval, eqn.outvars[0].aval
    if ins.ndim < 1 or out.ndim < 1 or out.shape[-1] != ins.shape[-1]:
        return False
    p = eqn.params
    if prim is compat.squeeze_p:  # unit axes dropped (x[:, 0] of a unit axis), the last kept
        return ins.ndim - 1 not in [d % ins.ndim for d in p["dimensions"]]
    if prim is compat.convert_element_type_p:
        return jnp.issubdtype(out.dtype, jnp.floating) and jnp.issubdtype(ins.dtype, jnp.floating)
    if prim is compat.broadcast_in_dim_p:
        return bool(p["broadcast_dimensions"]) and p["broadcast_dimensions"][-1] == out.ndim - 1
    if prim is compat.reshape_p:
        return p.get("dimensions") is None
    if prim is compat.slice_p:
        return p["start_indices"][-1] == 0 and (p["strides"] is None or p["strides"][-1] == 1)
    if prim is compat.dynamic_slice_p:
        return True  # the whole last axis: its start is clamped to 0
    if prim is compat.gather_p:
        dn, last = p["dimension_numbers"], ins.ndim - 1
        fill = p.get("fill_value")
        if fill is not None and not (np.isnan(float(fill)) or float(fill) == 0):
            # jnp.take(..., mode="fill", fill_value=c): codes 0 times scales c decode to 0,
            # not c (read from the decoded buffer); NaN and 0 decode to themselves
            return False
        return (p["slice_sizes"][-1] == ins.shape[-1] and last not in dn.collapsed_slice_dims
                and last not in dn.operand_batching_dims and last not in dn.start_index_map
                and bool(dn.offset_dims) and dn.offset_dims[-1] == out.ndim - 1)
    return False


def is_relabel(eqn) -> bool:
    """A :func:`is_read_view` op that only relabels the axes of its operand, every element
    kept once: a ``reshape``, a ``squeeze``, a ``broadcast_in_dim`` that adds unit axes
    (``x[:, None]``, ``jnp.expand_dims``) or a ``slice`` of the whole. A cache written
    through such a view (a one-sequence step calling a batched one: ``cache[None]`` in,
    ``new[0]`` out) is still the buffer once the view's shape is undone."""
    if not is_read_view(eqn):
        return False
    ins, out, prim = eqn.invars[0].aval, eqn.outvars[0].aval, eqn.primitive
    if prim in (compat.reshape_p, compat.squeeze_p):
        return True
    if prim is compat.broadcast_in_dim_p:
        return math.prod(ins.shape) == math.prod(out.shape)
    return prim is compat.slice_p and tuple(ins.shape) == tuple(out.shape)


def read_view(eqn, invals) -> QArray:
    """:func:`is_read_view`'s op on a cache (``invals[0]``): the same op on its codes and
    on its scales, each with its own last axis (packed codes: half the features; scales: 1);
    a conversion changes the dtype it decodes to."""
    p, c = eqn.params, invals[0]
    if eqn.primitive is compat.convert_element_type_p:
        return dataclasses.replace(c, float_dtype=np.dtype(eqn.outvars[0].aval.dtype).name)

    def one(a):
        n = a.shape[-1]
        if eqn.primitive is compat.squeeze_p:  # (the axes it drops are not the last)
            over = {}
        elif eqn.primitive is compat.broadcast_in_dim_p:
            over = dict(shape=tuple(p["shape"][:-1]) + (n,))
        elif eqn.primitive is compat.reshape_p:
            over = dict(new_sizes=tuple(p["new_sizes"][:-1]) + (n,))
        elif eqn.primitive is compat.slice_p:
            over = dict(limit_indices=tuple(p["limit_indices"][:-1]) + (n,))
        else:  # dynamic_slice, gather
            over = dict(slice_sizes=tuple(p["slice_sizes"][:-1]) + (n,))
            if p.get("fill_value") is not None and not jnp.issubdtype(a.dtype, jnp.floating):
                over["fill_value"] = 0  # jnp.take's NaN: the codes 0, the scale NaN
        return compat.bind_eqn(eqn, [a, *invals[1:]], **over)[0]

    return dataclasses.replace(c, values=one(c.values), scale=one(c.scale))


def is_buffer_select(eqn, ins, pred_def) -> bool:
    """A ``select_n`` whose cases are all one buffer (the cache before a write and after
    it: ``jnp.where(live, written, cache)``, freezing finished sequences), or that buffer
    and zeros (``jnp.where(done, 0.0, cache)``, a finished sequence's slot cleared), on a predicate
    that is the same along the buffer's last axis (a scalar, or a ``broadcast_in_dim``
    that does not map an axis onto it, or maps one of size 1; or a value
    :func:`same_along_last` made, ``VarInfo.rowwise``): it picks whole vectors,
    so a cache under it is the same cache, its codes and scales picked alike
    (:func:`select`). ``pred_def``: the equation that made the predicate, or ``None``."""
    buffers = {i.buffer for i in ins[1:] if not i.zero}
    if eqn.primitive is not compat.select_n_p or len(buffers) != 1 or not next(iter(buffers)):
        return False
    shape = eqn.invars[0].aval.shape
    if not shape or ins[0].rowwise:
        return True
    if pred_def is None or pred_def.primitive is not compat.broadcast_in_dim_p:
        return False
    last, dims = len(shape) - 1, tuple(pred_def.params["broadcast_dimensions"])
    return last not in dims or pred_def.invars[0].aval.shape[dims.index(last)] == 1


_ROWWISE_ELEMENTWISE = frozenset((
    "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not", "xor", "convert_element_type",
    "add", "sub", "mul", "max", "min", "select_n"))


def same_along_last(eqn, ins) -> bool:
    """Whether ``eqn``'s (one) output is the same along its last axis, as a predicate that
    picks whole vectors of a cache is (``VarInfo.rowwise``): a ``broadcast_in_dim`` that
    maps no axis, or one of size 1, onto it (``jnp.broadcast_to(live[:, None, None, None],
    cache.shape)``, done before ``jnp.where``, whose select then runs inside its own jit
    where the broadcast is not seen); an ``iota`` along another axis; an elementwise op
    (a comparison, ``&``) of such values and scalars."""
    if len(eqn.outvars) != 1 or not getattr(eqn.outvars[0].aval, "shape", ()):
        return False
    out = eqn.outvars[0].aval.shape
    name = eqn.primitive.name
    if eqn.primitive is compat.broadcast_in_dim_p:
        dims = tuple(eqn.params["broadcast_dimensions"])
        last = len(out) - 1
        if last not in dims:
            return True
        src = eqn.invars[0].aval.shape
        return src[dims.index(last)] == 1 or (ins[0].rowwise and dims.index(last) == len(src) - 1)
    if name == "iota":
        return eqn.params["dimension"] != len(out) - 1
    if name in _ROWWISE_ELEMENTWISE:
        # each operand a scalar, or of the output's rank with axes of its size or 1 (JAX
        # keeps ``flag & other[None, :, None]`` one op), the same along its last axis
        def same(v, i):
            s = getattr(v.aval, "shape", ())
            if not s:
                return True
            if len(s) != len(out) or any(a not in (b, 1) for a, b in zip(s, out)):
                return False
            return s[-1] == 1 or i.rowwise
        return all(same(v, i) for v, i in zip(eqn.invars, ins))
    return False


def select(eqn, invals, zeros=()):
    """:func:`is_buffer_select`'s ``select_n`` of caches: one predicate per vector. The
    cases at ``zeros`` are zeros (the analysis saw them made so): zero codes, each vector
    with the scale :func:`encode` gives zeros (``2**-14``)."""
    pred, cases = invals[0], list(invals[1:])
    like = next(c for c in cases if is_cache(c))  # the interpreter calls it with one
    for k in zeros:
        cases[k] = dataclasses.replace(like, values=jnp.zeros_like(like.values),
                                       scale=jnp.full_like(like.scale, _TINY))
    if any(not is_cache(c) for c in cases):
        return compat.bind_eqn(eqn, materialize(invals, eqn.invars))
    pred = jnp.asarray(pred)  # a literal predicate (jnp.where on a Python bool) comes as a bool
    return [pick(pred[..., :1] if pred.ndim else pred, cases)]


def pick(which, cases):
    """``lax.select_n(which, *cases)`` of caches, vector by vector: ``which`` (bool or int,
    broadcastable to the scales' shape: one value per vector) picks each vector's codes
    and scale from the same case."""
    def one(field):
        arrays = [getattr(c, field) for c in cases]
        return lax.select_n(jnp.broadcast_to(which, arrays[0].shape), *arrays)
    return dataclasses.replace(cases[0], values=one("values"), scale=one("scale"))


def _arrange(scale, axes):
    """``scale`` (cache layout, size 1 on every axis not in ``axes``) laid out on target
    dimensions: ``axes[j]`` is the scale axis of target dimension ``j``, or ``None``."""
    keep = [a for a in axes if a is not None]
    s = jnp.squeeze(scale, tuple(a for a in range(scale.ndim) if a not in keep))
    order = sorted(keep)
    s = jnp.transpose(s, [order.index(a) for a in keep])
    return s.reshape([scale.shape[a] if a is not None else 1 for a in axes])


def dot_general(eqn, invals):
    """A float ``dot_general`` with a cache operand, reading its codes: the scale (one per
    vector of the last axis) is taken out of the contraction. Scores ``q . k`` contract
    the last axis, so the scale multiplies the output; ``p . v`` contracts the tokens,
    so the scale multiplies ``p`` first. Exact in float up to rounding; in float16, whose
    range neither sums of codes nor ``p`` times a scale fit, both run in float32."""
    if all(is_cache(x) for x in invals[:2]):
        return compat.bind_eqn(eqn, materialize(invals, eqn.invars))
    ci = 0 if is_cache(invals[0]) else 1
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contract = ((lc, rc)[ci], (lc, rc)[1 - ci])  # (the cache's, the other operand's)
    batch = ((lb, rb)[ci], (lb, rb)[1 - ci])
    c, other = invals[ci], invals[1 - ci]
    dtype = eqn.invars[ci].aval.dtype
    scaled = {a for a in range(c.scale.ndim) if c.scale.shape[a] != 1}
    vals = list(invals)
    vals[ci] = codes(c, dtype)
    if not scaled & set(contract[0]):  # the scale stays on the output
        nd = [len(v.aval.shape) for v in eqn.invars]
        free = [[d for d in range(nd[k]) if d not in (lc, rc)[k] and d not in (lb, rb)[k]] for k in (0, 1)]
        axes = list(batch[0]) + [d if k == ci else None for k in (0, 1) for d in free[k]]
        dt = nx.codes_dtype(dtype)  # sums of codes exceed float16's range: float32 there
        if dt != dtype:
            vals = [codes(c, dt) if k == ci else other.astype(dt) for k in (0, 1)]
            out = compat.bind_eqn(eqn, vals, preferred_element_type=dt)[0]
        else:
            out = compat.bind_eqn(eqn, vals)[0]
        out_dtype = eqn.outvars[0].aval.dtype
        return [(out.astype(_F32) * _arrange(c.scale, axes).astype(_F32)).astype(out_dtype)]
    if scaled <= set(contract[0]) | set(batch[0]):  # fold the scale into the other operand
        axes = []
        for d in range(other.ndim):
            if d in batch[1]:
                axes.append(batch[0][list(batch[1]).index(d)])
            elif d in contract[1]:
                axes.append(contract[0][list(contract[1]).index(d)])
            else:
                axes.append(None)
        folded = other.astype(_F32) * _arrange(c.scale, axes).astype(_F32)
        dt = nx.codes_dtype(jnp.result_type(other.dtype, dtype))
        if dt != other.dtype or dt != dtype:  # float16: p * scale (scales reach 2**-14,
            # probabilities 1e-3 at long contexts) falls below float16's normal range and keeps
            # a few bits or none; the dot runs on float32 codes there
            vals = [codes(c, dt) if k == ci else folded.astype(dt) for k in (0, 1)]
            out = compat.bind_eqn(eqn, vals, preferred_element_type=dt)[0]
            return [out.astype(eqn.outvars[0].aval.dtype)]
        vals[1 - ci] = folded.astype(other.dtype)
        return compat.bind_eqn(eqn, vals)
    return compat.bind_eqn(eqn, materialize(invals, eqn.invars))


def coerce(x, like):
    """``x`` in the carry form of ``like`` (a loop's carry must keep its type)."""
    if is_cache(like) and not is_cache(x):
        return encode(x.astype(_F32), like.qtype, _holds_fp8_bits(like), like.float_dtype)
    if is_cache(x) and not is_cache(like):
        return decode(x, jnp.result_type(like))
    return x
