"""jqt's primitives and the arithmetic of affine quantization.

Two primitives appear in jaxprs that jqt produces, each with its scale and
zero point as operands:

* ``jqt_fake_quant[qmin, qmax](x, scale, zero_point)``: float in, float out,
  ``(clip(round(x / scale) + zero_point, qmin, qmax) - zero_point) * scale``.
  Used by the simulated path; its JVP is straight-through with a clipping
  mask for ``x`` and the LSQ/LSQ+ gradients for ``scale`` and ``zero_point``.
* ``jqt_quantize[qmin, qmax, dtype](x, scale, zero_point)``: float in, integer
  out (the codes of the same formula). Used by the integer path; not
  differentiable.

Both compute ``round(x / scale)`` in float32 with round-half-to-even and round
the zero point (a trained zero point drifts off the integers; its gradient is
straight-through), so the integer path and the simulated path produce the
same codes. The quotient is ``x`` times the scale's reciprocal (:func:`quotient`),
the one form XLA leaves as written in every program.
"""
from __future__ import annotations

import inspect
import re
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import compat
from .formats import FLOAT8, NF4_TABLE

_F32 = jnp.float32


def per_layer(a, ndim):
    """A per-tensor scale (or zero point) of stacked layers, ``(L,)`` for a weight ``(L, K,
    N)`` under a ``lax.scan``, with size-1 axes for the weight's own (``ndim`` in all), so
    that it broadcasts against the weight; other scales (``None``, per tensor, per channel:
    the weight's rank) as they are.

    >>> per_layer(jnp.ones(2), 3).shape
    (2, 1, 1)
    """
    if a is not None and 0 < jnp.ndim(a) < ndim:
        return jnp.reshape(a, jnp.shape(a) + (1,) * (ndim - jnp.ndim(a)))
    return a


def extremes(x, axis=None, keepdims=False):
    """``(jnp.min(x), jnp.max(x))`` over ``axis``, NaN where ``x`` holds one: XLA:CPU
    (jaxlib 0.10.2) drops NaN from min and max reductions of 4,096 elements or more, and
    calibration finds non-finite values by these extremes.

    >>> x = jnp.zeros(4096).at[3].set(jnp.nan)
    >>> [bool(jnp.isnan(e)) for e in extremes(x)]
    [True, True]
    """
    nan = jnp.isnan(x).any(axis=axis, keepdims=keepdims)
    return (jnp.where(nan, jnp.nan, jnp.min(x, axis=axis, keepdims=keepdims)),
            jnp.where(nan, jnp.nan, jnp.max(x, axis=axis, keepdims=keepdims)))


def _zp_f32(zero_point):
    # Zero points are integers; a trained (float) zero point is rounded, by both paths.
    return jnp.round(zero_point.astype(_F32))


# a NumPy constant: a jnp array made at import would start JAX's backends when jqt is
# imported (before jax.distributed.initialize() or jax_num_cpu_devices could be set)
_NF4_MIDS = np.asarray((np.asarray(NF4_TABLE[1:]) + np.asarray(NF4_TABLE[:-1])) / 2, np.float32)


FP8_BITS_UNIT = {"float8_e4m3fn": 256.0, "float8_e5m2": 32768.0}
"""What :func:`fp8_units`'s result is multiplied by to give the fp8 value (``2**8``,
``2**15``): the integer paths sum codes in these units, at most 1.75 for both grids
(448 / 2**8, 57344 / 2**15), and fold the unit into the scale, so that a code times a
float activation is at most 1.75x the activation (e5m2's codes in their own units, up to
57344, overflowed float32 with activations above about 6e33) and the scale times the unit
is at most 0.57x the weight's largest magnitude (with ``2**16``, 1.14x: infinite for a
weight range above about 3e38)."""

# per fp8 grid: mantissa bits, exponent bias, smallest normal as float32 bits
_FP8_LAYOUT = {"float8_e4m3fn": (3, 7, 0x3C800000), "float8_e5m2": (2, 15, 0x38800000)}


def fp8_encode(x, grid):
    """float32 within the grid's finite range (or NaN) -> its fp8 codes, rounded to
    nearest even, from integer operations on the float32 bits: the same codes as
    ``x.astype(float8)``, which XLA:CPU emulates at 2-3x the cost
    (``benchmarks/formats.py`` runs fp8 activations through it at every op).

    >>> import jax.numpy as jnp
    >>> c = fp8_encode(jnp.array([0.3, -448.0, 1e-3, 0.0]), "float8_e4m3fn")
    >>> c.dtype.name, bool((c == jnp.array([0.3, -448.0, 1e-3, 0.0]).astype(c.dtype)).all())
    ('float8_e4m3fn', True)
    """
    mant, bias, tiny = _FP8_LAYOUT[grid]
    u = jax.lax.bitcast_convert_type(x.astype(_F32), jnp.uint32)
    a = u & 0x7FFFFFFF
    drop = 23 - mant
    # round to nearest even at the last kept mantissa bit; the exponent re-biased
    normal = ((a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)) >> drop) - ((127 - bias) << mant)
    # below the smallest normal: multiples of the subnormal step, rounded half to even
    step = 2.0 ** (mant + bias - 1)
    sub = jnp.round(jax.lax.bitcast_convert_type(a, _F32) * step).astype(jnp.uint32)
    code = jnp.where(a < tiny, sub, normal)
    nan = 0x7E if grid == "float8_e5m2" else 0x7F  # (the NaN a cast writes: e5m2 has several)
    code = jnp.where(a > 0x7F800000, nan, code) | ((u >> 24) & 0x80)  # NaN; the sign
    return jax.lax.bitcast_convert_type(code.astype(jnp.uint8), FLOAT8[grid])


def _fp8_half(bits, grid):
    """fp8 codes as uint8 bits -> float32 through float16's bits (a shift and a mask, where
    XLA:CPU's own fp8 conversion costs as much as a matmul ten times over): e5m2's value
    (a float16's top byte), e4m3fn's value / 256 (its bias is 7 against float16's 15).
    e4m3fn's NaN (``0x7F``, no number in float16's bits: 480 / 256) is made a float16
    NaN, as jqt's native fp8 kernel decodes it."""
    u16 = bits.astype(jnp.uint16)
    if grid == "float8_e5m2":
        f16 = u16 << 8
    else:
        mag = u16 & 0x7F  # 0x7F: + 0x3E80 takes 0x3F80 (1.875) to 0x7E00 (NaN), no select
        f16 = ((u16 & 0x80) << 8) | ((mag << 7) + ((mag + 1) >> 7) * 0x3E80)
    return jax.lax.bitcast_convert_type(f16, jnp.float16).astype(_F32)


def fp8_units(bits, grid):
    """fp8 codes as uint8 bits -> float32, the fp8 value divided by
    ``FP8_BITS_UNIT[grid]`` (exact), which a caller folds into a scale: the bits placed
    in a float16 (a shift and a mask, where XLA:CPU's own fp8 conversion costs as much
    as a matmul ten times over). e4m3fn's bias is 7 against float16's 15, hence its
    ``2**8`` at no cost; e5m2 (a float16's top byte, up to 57344) is multiplied by
    ``2**-15`` in float32, so that its codes times a float activation do not overflow
    (the products are those of the values, times a power of two). e4m3fn's NaN
    (``0x7F``, no number in float16's bits: 480 / 256) is made a float16 NaN, as jqt's
    native fp8 kernel decodes it.

    >>> import jax.numpy as jnp
    >>> fp8_units(jnp.array([0x38, 0xB8, 0x7F, 0x01], jnp.uint8), "float8_e4m3fn").tolist()
    [0.00390625, -0.00390625, nan, 7.62939453125e-06]
    >>> fp8_units(jnp.array([0x3C, 0x7B, 0x01, 0x7F], jnp.uint8), "float8_e5m2").tolist()
    [3.0517578125e-05, 1.75, 4.656612873077393e-10, nan]
    """
    v = _fp8_half(bits, grid)
    return v if grid != "float8_e5m2" else v * (1.0 / FP8_BITS_UNIT[grid])


def _fp8_decode(codes, grid):
    """fp8 codes -> their float32 values (exact, NaN kept) through float16's bits."""
    if codes.dtype != FLOAT8[grid]:
        return codes.astype(_F32)
    v = _fp8_half(jax.lax.bitcast_convert_type(codes, jnp.uint8), grid)
    return v if grid == "float8_e5m2" else v * FP8_BITS_UNIT[grid]


def quotient(x, scale):
    """``x / scale`` in float32, as every code is computed: ``x`` times the scale's
    reciprocal (one correctly rounded division per scale, then a multiplication).

    Written as a division, XLA:CPU turns ``x / broadcast(scale)`` into ``x * (1 / scale)``
    in some programs and not in others (a scale that is a constant, one the program uses
    only there, a broadcast it does not share), and the two differ by an ulp: a quotient
    at a tie rounds to neighbouring codes (``0.01 / (0.02 / 3)`` is ``1.4999999``, and
    ``1.5`` the other way). XLA does not rewrite a multiplication, and folds a constant
    scale's reciprocal to the same float32, so the simulated and integer paths, eager
    calls and ``jax.jit`` with constant qparams, and ``jqt.pack`` all get the same codes.

    >>> float(quotient(jnp.float32(0.01), jnp.float32(0.02) / 3))
    1.5
    """
    return x.astype(_F32) * (jnp.float32(1) / scale.astype(_F32))


def _codes(x, scale, zero_point, qmin, qmax, grid="int"):
    """The stored codes of ``x``: float32 integers for ``int``/``nf4`` (nf4: ``i - 8`` for
    table entry ``i``), fp8 values for the fp8 grids."""
    v = quotient(x, scale)
    if grid == "int":
        return jnp.clip(jnp.round(v) + _zp_f32(zero_point), qmin, qmax)
    if grid == "nf4":
        return jnp.sum(v[..., None] > _NF4_MIDS, axis=-1).astype(_F32) - 8.0
    return fp8_encode(jnp.clip(v, qmin, qmax), grid)


def _nf4_lookup(codes):
    """NF4 codes in ``[-8, 7]`` -> the table's values, by a tree of selects on the bits of
    ``code + 8``: 15 selects between the table's constants (exact), which XLA:CPU fuses
    into the decode, where a gather from the table (``jnp.take``) was the slow part of
    nf4 matmuls (``benchmarks/results/formats-cpu-2core.md``).

    >>> _nf4_lookup(jnp.array([-8, -1, 7], jnp.int8)).tolist()
    [-1.0, 0.0, 1.0]
    >>> bool((_nf4_lookup(jnp.arange(-8, 8)) == jnp.asarray(NF4_TABLE, jnp.float32)).all())
    True
    """
    u = codes.astype(jnp.int32) + 8
    level = [jnp.float32(v) for v in NF4_TABLE]
    for b in range(4):
        bit = (u & (1 << b)) != 0
        level = [jnp.where(bit, level[i + 1], level[i]) for i in range(0, len(level), 2)]
    return level[0]


def decode(codes, grid="int"):
    """Codes -> grid values in units of the scale (float32), before the zero point."""
    if grid == "nf4":
        return _nf4_lookup(codes)
    if grid in FLOAT8:
        return _fp8_decode(codes, grid)
    return codes.astype(_F32)


def codes_dtype(dtype):
    """The float dtype in which a dot over codes in units of their scale (the scale applied
    after the sum) runs: ``dtype`` where it has float32's exponent range (bfloat16,
    float32, float64), else float32. In float16 such sums overflow its maximum of 65504
    where the real values do not: an int8 code is up to 127 units, an fp8 e5m2 one 57344.

    >>> import jax.numpy as jnp
    >>> codes_dtype(jnp.bfloat16).__name__, codes_dtype(jnp.float16).__name__
    ('bfloat16', 'float32')
    """
    return jnp.dtype(dtype).type if jnp.finfo(dtype).nexp >= 8 else _F32


def codes_dot_types(dtype, preferred):
    """``(operand dtype, preferred_element_type)`` for a dot over codes of activations of
    ``dtype`` whose equation asked for ``preferred``: both float32 where
    :func:`codes_dtype` says so, else ``dtype`` and ``preferred`` as they were.

    >>> import jax.numpy as jnp
    >>> [getattr(t, "__name__", t) for t in codes_dot_types(jnp.float16, jnp.float16)]
    ['float32', 'float32']
    """
    dt = codes_dtype(dtype)
    # (bfloat16 activations into a float16 output: the sums over the codes in float32, not
    # rounded to float16 before the scale and again after it)
    keep = dt == jnp.dtype(dtype) and (preferred is None or jnp.dtype(preferred) != jnp.float16)
    return dt, (preferred if keep else _F32)


def _fake_quant_impl(x, scale, zero_point, *, qmin, qmax, grid="int"):
    zp = _zp_f32(zero_point) if grid == "int" else jnp.zeros((), _F32)
    q = decode(_codes(x, scale, zero_point, qmin, qmax, grid), grid)
    out = (q - zp) * scale.astype(_F32)
    if grid == "nf4":  # the table's comparisons pick a code for NaN; keep NaN, as the int grid does
        out = jnp.where(jnp.isnan(x), jnp.nan, out)
    return cast_finite(out, x.dtype)


def cast_finite(x, dtype):
    """``x`` (float32) as ``dtype``, clipped to its finite range where that is narrower
    (float16): an asymmetric grid's far end, ``(qmax - zp) * scale``, can pass 65504,
    where the integer path, in float32, never casts a grid value to the model's dtype.

    >>> import jax.numpy as jnp
    >>> cast_finite(jnp.array([-66566.0, 1.0]), jnp.float16).tolist()
    [-65504.0, 1.0]
    """
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).max < jnp.finfo(_F32).max:
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -top, top)  # NaN stays NaN
    return x.astype(dtype)


def _quantize_impl(x, scale, zero_point, *, qmin, qmax, dtype, grid="int"):
    return _codes(x, scale, zero_point, qmin, qmax, grid).astype(dtype)


class ScaleShapeError(ValueError):
    """A scale or zero point that does not broadcast to the operand it quantizes (its
    callers, ``jqt.pack``, name the op and the weight)."""


def _check(name, required, x, scale, zero_point, params):
    """The checks of a bind, eager or traced: scale and zero point broadcast to the
    operand, the required parameters given, a known grid, ``qmin <= qmax``."""
    for what, a in (("scale", scale), ("zero_point", zero_point)):
        try:
            jnp.broadcast_shapes(jnp.shape(a), jnp.shape(x))
        except ValueError:
            raise ScaleShapeError(f"jqt: {what} of shape {jnp.shape(a)} does not broadcast to the "
                             f"operand's shape {jnp.shape(x)}.") from None
    missing = [a for a in required if a not in params]
    if missing:
        raise TypeError(f"jqt: {name}.bind takes the parameters {', '.join(required)}; "
                        f"{', '.join(missing)} missing (e.g. qmin=-128, qmax=127"
                        f"{', dtype=jnp.int8' if 'dtype' in required else ''}).")
    grid = params.get("grid", "int")
    if grid not in ("int", "nf4") and grid not in FLOAT8:
        raise ValueError(f"jqt: {name}: grid={grid!r} is not one of "
                         f"{['int', 'nf4', *FLOAT8]}.")
    if not params["qmin"] <= params["qmax"]:
        raise ValueError(f"jqt: {name}: qmin={params['qmin']!r} is above qmax={params['qmax']!r}; "
                         "the grid runs from qmin up to qmax.")


def _abstract(x, scale, zero_point, *, dtype=None, **_):
    # keep the operand's sharding (explicit mesh axes), as an elementwise op does, and
    # vary over the manual axes any operand varies over (jax.shard_map)
    return compat.shaped(x.shape, dtype or x.dtype, (x, scale, zero_point),
                         [(i, None, None) for i in range(x.ndim)])


def _batch_rule(prim):
    def rule(args, dims, **params):
        x, s, z = args
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not compat.NOT_MAPPED)
        r = x.ndim - (0 if dims[0] is compat.NOT_MAPPED else 1)

        def front(a, d, is_x):
            if d is compat.NOT_MAPPED:
                if is_x:
                    return jnp.broadcast_to(a, (size,) + a.shape)
                return a.reshape((1,) + (1,) * (r - a.ndim) + a.shape)
            a = jnp.moveaxis(a, d, 0)
            if is_x:
                return a
            return a.reshape((size,) + (1,) * (r - (a.ndim - 1)) + a.shape[1:])

        x, s, z = (front(a, d, i == 0) for i, (a, d) in enumerate(zip(args, dims)))
        return prim.bind(x, s, z, **params), 0
    return rule


def _primitive(name, impl):
    p = compat.Primitive(name)
    sig = inspect.signature(impl).parameters
    static = tuple(a for a in ("qmin", "qmax", "dtype", "grid") if a in sig)
    required = tuple(a for a in static if sig[a].default is inspect.Parameter.empty)
    # called eagerly (jqt.pack quantizing a weight, calibration's scales): one compiled
    # program per shape and parameters, as a JAX primitive applied outside jit runs, not
    # a dispatch per jnp operation of ``impl``; the bind's checks run there too (an eager
    # bind does not call the abstract evaluation)
    jitted = jax.jit(impl, static_argnames=static)

    def eager(x, scale, zero_point, **params):
        _check(name, required, x, scale, zero_point, params)
        return jitted(x, scale, zero_point, **params)

    def abstract(x, scale, zero_point, **params):
        _check(name, required, x, scale, zero_point, params)
        return _abstract(x, scale, zero_point, **params)

    p.def_impl(eager)
    p.def_abstract_eval(abstract)
    compat.mlir.register_lowering(p, compat.mlir.lower_fun(impl, multiple_results=False))
    compat.batching.primitive_batchers[p] = _batch_rule(p)
    return p


fake_quant_p = _primitive("jqt_fake_quant", _fake_quant_impl)
"""The simulated-quantize primitive, ``jqt_fake_quant[qmin, qmax](x, scale, zero_point)``:
float in, float out, differentiable (straight-through for ``x``, LSQ for the scale).

>>> import jax, jax.numpy as jnp, jqt
>>> jqt.fake_quant_p.bind(jnp.array([0.26, 9.0]), jnp.float32(0.5), jnp.float32(0), qmin=-8, qmax=7)
Array([0.5, 3.5], dtype=float32)
"""
quantize_p = _primitive("jqt_quantize", _quantize_impl)
"""The quantize primitive of the integer path, ``jqt_quantize[qmin, qmax, dtype](x, scale,
zero_point)``: float in, integer codes out; not differentiable.

>>> import jax.numpy as jnp, numpy as np, jqt
>>> jqt.quantize_p.bind(jnp.array([0.26, 9.0]), jnp.float32(0.5), jnp.float32(0), qmin=-8,
...                     qmax=7, dtype=np.dtype(np.int8))
Array([1, 7], dtype=int8)
"""


def clip_edges(qmin, qmax, grid):
    """The values of ``x / scale`` beyond which the gradient counts ``x`` as clipped: half
    a step past the grid's ends, where the int grid's rounding leaves ``[qmin, qmax]``.
    So an element at a range's end (a group's absolute maximum, divided by a scale
    computed from it) is inside whether its quotient lands on the end or an ulp past it,
    as float division does by backend (XLA:GPU's differs from XLA:CPU's). nf4: half its
    outermost gap; fp8: half the step of its largest binade.

    >>> clip_edges(-8, 7, "int"), clip_edges(-448.0, 448.0, "float8_e4m3fn")
    ((-8.5, 7.5), (-464.0, 464.0))
    >>> [round(v, 4) for v in clip_edges(-8, 7, "nf4")]
    [-1.1519, 1.1385]
    """
    if grid == "nf4":
        t = NF4_TABLE
        return float(t[0] - (t[1] - t[0]) / 2), float(t[-1] + (t[-1] - t[-2]) / 2)
    if grid == "int":
        return qmin - 0.5, qmax + 0.5
    fi = ml_dtypes.finfo(FLOAT8[grid])
    half = float(fi.eps) * 2.0 ** math.floor(math.log2(float(fi.max))) / 2
    return qmin - half, qmax + half


def _masks(x, scale, zero_point, qmin, qmax, grid):
    xs = quotient(x, scale)  # the codes' quotient, so that the masks agree with them
    if grid == "int":
        q = jnp.round(xs) + _zp_f32(zero_point)
        return xs, q < qmin, q > qmax
    lo, hi = clip_edges(qmin, qmax, grid)
    return xs, xs < lo, xs > hi


def _jvp_x(g, x, scale, zero_point, *, qmin, qmax, grid="int"):
    _, lo, hi = _masks(x, scale, zero_point, qmin, qmax, grid)
    return jnp.where(lo | hi, jnp.zeros_like(g), g)


def _jvp_scale(g, x, scale, zero_point, *, qmin, qmax, grid="int"):
    # LSQ: d(s * Q(x / s)) / ds = Q(x / s) - x / s inside the range, the bound outside.
    xs, lo, hi = _masks(x, scale, zero_point, qmin, qmax, grid)
    zp = _zp_f32(zero_point) if grid == "int" else jnp.zeros((), _F32)
    dq = decode(_codes(x, scale, zero_point, qmin, qmax, grid), grid) - zp
    d = jnp.where(lo | hi, dq, dq - xs)
    return (g.astype(_F32) * d).astype(x.dtype)


def _jvp_zero_point(g, x, scale, zero_point, *, qmin, qmax, grid="int"):
    if grid != "int":  # symmetric grids only: the output does not move with it
        return jnp.zeros_like(x)
    _, lo, hi = _masks(x, scale, zero_point, qmin, qmax, grid)
    d = jnp.where(lo | hi, -scale.astype(_F32), 0.0)
    return (g.astype(_F32) * d).astype(x.dtype)


compat.ad.defjvp(fake_quant_p, _jvp_x, _jvp_scale, _jvp_zero_point)


def _no_jvp(primals, tangents, **params):
    key, kind = compat.scoped_op(kind=True)
    head = ((f"op '{key}': " if key else "") + "jqt_quantize (the integer path of jqt.quantize) "
            "is not differentiable: rounding to codes (int, fp8 or nf4) has no gradient. ")
    if kind == "cache":  # what is trained reaches the keys and values the cache rounds
        raise TypeError(
            head + f"'{key}' is a key/value cache (the recipe's kv_cache=): it rounds the keys "
            "and values written into it, activations that follow what is trained. Train with "
            "the cache float (calibrate with the preset's kv_cache=False, then pack) or "
            "through the simulated path, jqt.quantize(f, qparams, simulate=True).")
    if compat.is_zero_tangent(tangents[0]) and not all(map(compat.is_zero_tangent, tangents[1:])):
        raise TypeError(  # qparams differentiated, not what the op rounds
            head + "What is differentiated here is the op's scale or zero point (its qparams), "
            "which the integer path has no gradient for. Differentiate the simulated path, "
            "jqt.quantize(f, qparams, simulate=True), as jqt.qat does.")
    common = ("Differentiate the simulated path instead: jqt.quantize(f, qparams, "
              "simulate=True). For a call you do not train through (a distillation teacher, a "
              "reference), stop the gradient of its inputs, qf(jax.lax.stop_gradient(params), "
              "x): a stop_gradient of its output comes after JAX has asked for this op's "
              "derivative. ")
    if kind == "act_x_act":  # adapters passed as data reach a product of two activations
        raise TypeError(
            head + f"Op '{key}' multiplies two activations and rounds both to codes (the "
            "recipe's act_x_act=), and what is differentiated reaches them (adapters passed "
            "as data, LoRA's x @ a and (x @ a) @ b, are such ops). " + common + "To train "
            "through the integer path, keep it float: jqt.Rule(key="
            f"'^{re.escape(key or '')}$', act_x_act=None) ahead of the recipe's rules, or "
            "calibrate without act_x_act=.")
    if kind == "activation":  # what is trained reaches an activation the op rounds
        raise TypeError(
            head + f"Op '{key}' rounds its activation to codes (the recipe quantizes "
            "activations, as w8a8, w8a8_dynamic, w4a8 and fp8 do), and what is differentiated reaches "
            "that activation. "
            + common + "To train adapters on a frozen base through the integer path, quantize "
            "the base weight-only (w8, w4, nf4: QLoRA, docs/fine-tuning.md): every op after "
            "the adapters rounds its activation under this recipe, this one first, so a rule "
            f"keeping this op's activation float (jqt.Rule(key='^{re.escape(key or '')}$', "
            "weight=<its weight type>, activation=None), ahead of the recipe's) moves the "
            "error to the next.")
    raise TypeError(
        head + common + "Training values f closes over (LoRA adapters "
        "bound with functools.partial)? Those are weights to jqt, quantized: pass them as an "
        "argument of f that is not a weight argument (docs/fine-tuning.md, QLoRA), where they "
        "stay float and their gradients flow through the integer path.")


compat.ad.primitive_jvps[quantize_p] = _no_jvp


def _zp(zero_point):
    return jnp.zeros((), _F32) if zero_point is None else jnp.asarray(zero_point)


def _grid_params(qtype):
    p = dict(qmin=qtype.qmin, qmax=qtype.qmax)
    if qtype.grid != "int":  # int jaxprs keep their old parameters
        p["grid"] = qtype.grid
    return p


def fake_quant(x, scale, zero_point, qtype):
    """Simulated quantization of ``x`` (float in, float out), differentiable.

    >>> import jax.numpy as jnp, jqt
    >>> from jqt._src.numerics import fake_quant
    >>> fake_quant(jnp.array([0.26, 9.0]), jnp.float32(0.5), None, jqt.QuantType(bits=4))
    Array([0.5, 3.5], dtype=float32)
    """
    # (jnp.asarray: a Python-number scale, from qparams through JSON, is an array to the
    # rules, also as the primal under jax.grad)
    return fake_quant_p.bind(x, jnp.asarray(scale), _zp(zero_point), **_grid_params(qtype))


def quantize(x, scale, zero_point, qtype):
    """Codes of ``x`` in ``qtype.storage`` (int8, int16 above 8 bits, or fp8)."""
    return quantize_p.bind(x, jnp.asarray(scale), _zp(zero_point), dtype=qtype.storage,
                           **_grid_params(qtype))


def split_int16(q):
    """int16 codes -> int8 ``(hi, lo)`` with ``q = 256 * hi + (lo + 128)``: an int16 x
    int8 contraction becomes two int8 x int8 -> int32 ones (``lo`` with zero point
    -128), none of which can overflow int32 the way an int16 x int8 one can."""
    q = q.astype(jnp.int32)
    hi = jnp.right_shift(q, 8)
    return hi.astype(jnp.int8), (q - 256 * hi - 128).astype(jnp.int8)


def params_from_range(lo, hi, qtype):
    """Scale and zero point (``None`` if symmetric) for the real range ``[lo, hi]``.

    The range is widened to include 0, so that 0 (padding, ReLU) is exact. Called on
    concrete ranges (calibration's), it runs as one compiled program.

    >>> import jqt
    >>> s, z = params_from_range(-1.0, 3.0, jqt.QuantType(bits=8, symmetric=False))
    >>> round(float(s) * 255, 6), float(z)
    (4.0, -64.0)
    """
    if compat.is_tracer(lo) or compat.is_tracer(hi):
        return _params_from_range(lo, hi, qtype)
    return _params_from_range_jit(lo, hi, qtype)


def _params_from_range(lo, hi, qtype):
    lo = jnp.minimum(jnp.asarray(lo, _F32), 0.0)
    hi = jnp.maximum(jnp.asarray(hi, _F32), 0.0)
    if qtype.symmetric:
        amax = jnp.maximum(-lo, hi)
        scale = amax / qtype.amax_code
        return jnp.where(scale > 0, scale, 1.0), None
    # halves first: hi - lo overflows float32 for magnitudes near its maximum (the halved
    # difference over the halved number of steps is the same quotient, bit for bit)
    scale = (hi / 2 - lo / 2) / ((qtype.qmax - qtype.qmin) / 2)
    scale = jnp.where(scale > 0, scale, 1.0)
    zp = jnp.clip(jnp.round(qtype.qmin - lo / scale), qtype.qmin, qtype.qmax)
    return scale, zp


_params_from_range_jit = jax.jit(_params_from_range, static_argnames="qtype")


def dynamic_params(x, reduce_axes, qtype):
    """Scale and zero point computed from the live tensor (no gradient flows into them).
    A NaN enters no range: it stays its own element's (attention rows masked wholly with
    -inf, which f drops after the op, do not set every other row's step)."""
    x = jax.lax.stop_gradient(x.astype(_F32))
    x = jnp.where(jnp.isnan(x), 0.0, x)
    axes = tuple(reduce_axes) if qtype.per_channel else tuple(range(x.ndim))
    # initial=0: the range holds 0 anyway (params_from_range), and a contraction over no
    # elements (attention over a sequence of length 0) then has one
    return computed_once(*params_from_range(jnp.min(x, axis=axes, keepdims=True, initial=0.0),
                                            jnp.max(x, axis=axes, keepdims=True, initial=0.0), qtype))


def computed_once(scale, zero_point=None):
    """The same values, divided by a 1 computed from ``scale`` (exactly 1.0: the sign
    of a number in [1, 2]), compiled or not.

    XLA duplicates cheap elementwise producers into every consumer fusion, so a
    dynamic activation's per-token scale and zero point (a dozen operations on the
    row's minimum and maximum) were recomputed for every element of the quantize
    and of each matmul epilogue (with an attention transpose, once per output
    element). A division is an operation XLA counts as expensive and does not
    duplicate: behind it the parameters are computed once per row and read from
    memory. ``w8a8_dynamic`` on all-MiniLM-L6-v2 went from 0.68x / 1.09x to 0.62x /
    1.01x float32 time at batch 1 / 8 (``benchmarks/formats.py``, docs/formats.md).

    >>> import jax.numpy as jnp
    >>> s = jnp.array([0.5, 3.0e-12, 7.0e30])
    >>> bool((computed_once(s)[0] == s).all())
    True
    """
    d = jnp.minimum(jnp.abs(scale), 1.0) + 1.0  # in [1, 2]: its sign is 1.0 exactly
    one = jnp.sign(d)  # (not d / d: XLA rewrites s / (d / d) as s * d / d, an ulp off in 1% of rows)
    return scale / one, (None if zero_point is None else zero_point / one)


def after(codes, x):
    """``codes`` unchanged, made to depend on the activation ``x`` (an integer zero
    computed from one of its elements is added), so that a weight's decode cannot run
    before its op's input exists.

    A weight depends on nothing, so XLA:CPU schedules the decodes of all a program's
    weights ahead of its first matmul and keeps their float copies alive together (43 MB
    for all-MiniLM-L6-v2 at batch 8, ``benchmarks/temporaries.py``), which the allocator
    maps afresh, and page-faults, at every call. ``lax.optimization_barrier`` does not
    prevent it (XLA:CPU removes barriers before it schedules). With the dependency each
    weight is decoded just before its matmul and its copy freed after it.

    The zero is one primitive (``jqt_tie``) so that under ``jax.vmap`` over activations
    it stays one unbatched scalar (taken from the batch's first element): the codes, and
    the weight decoded from them, stay unbatched, decoded once for the whole batch, and
    the matmul takes the batch as more rows (a batched zero made a decoded copy of the
    weight per batch entry and one batched matmul).

    >>> import jax.numpy as jnp
    >>> c = jnp.array([[-8, 7]], jnp.int8)
    >>> bool((after(c, jnp.array([[float("nan"), -0.0]])) == c).all())
    True
    """
    if x.size == 0:
        return codes  # no rows: nothing to wait for
    return codes + tie_p.bind(x).astype(codes.dtype)


def _tie_zero(x):
    """``jqt_tie``'s meaning: an integer zero from :func:`first_element` of ``x`` (a count
    of its bits' leading zeros, at most 32, shifted right by 6)."""
    bits = jax.lax.bitcast_convert_type(first_element(x)[0], jnp.uint32)
    return jax.lax.clz(bits) >> 6


def first_element(x):
    """``x``'s first element as a float32 ``(1,)`` array, the value that ties an op to ``x``
    (``jqt_tie``, ``nibbledecode.decode``'s ``after``). Along dimensions split over mesh
    axes in ``x``'s type (explicit sharding, where slicing them to one element is not
    implemented) the minimum instead, a scalar all-reduce.

    >>> import jax.numpy as jnp
    >>> first_element(jnp.array([[3.0, 1.0], [2.0, 0.0]])).tolist()
    [3.0]
    """
    split = compat.sharded_dims(x)
    v = x[tuple(slice(None) if d in split else 0 for d in range(x.ndim))]
    return (jnp.min(v) if v.ndim else v).astype(jnp.float32).reshape(1)


def _tie_batch(args, dims):
    """``jax.vmap`` of ``jqt_tie``: the zero of the whole batched operand (the same zero),
    unbatched (an empty batch: a constant zero, nothing to wait for)."""
    if args[0].size == 0:
        return jnp.zeros((), jnp.uint32), compat.NOT_MAPPED
    return tie_p.bind(args[0]), compat.NOT_MAPPED


tie_p = compat.Primitive("jqt_tie")
tie_p.def_abstract_eval(lambda x: compat.shaped((), jnp.uint32, (x,)))
compat.define_by_reference(tie_p, _tie_zero, _tie_batch)
