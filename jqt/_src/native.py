"""jqt's native XLA:CPU kernels: few-row matmuls of packed weights, read in place.

At one to a few rows (decoding at batch 1) a matmul reads every weight once and does
little arithmetic per byte, so its time is the bytes it reads over the rate it reads
them. XLA:CPU has no matmul that reads packed int4 codes in place, and its int8 matmul
reads int8 bytes at a fraction of the rate its float32 GEMV reads float32: jqt's XLA
formulations decode the codes to float32 (chunk by chunk, in cache) or split the
activation into int8 digits, and took 0.76x (``w4`` g128) and 0.59x (``w8``) a float32
4096 x 4096 layer at one row where their bytes are 0.125x and 0.25x
(``benchmarks/formats.py``). Two kernels in ``csrc/grouped_gemv.cc`` read the codes
once, front to back, and decode them in registers (AVX2 + FMA, or AVX-512 where the CPU
has it: the same bits) into float32 sums: the arithmetic of the float32 matmul of the
decoded weight, in another order (4-bit int codes summed as ``code + 8``, the offset taken
off after each group: with activations of one sign that cancels, within the bound
``docs/performance.md`` gives).

* ``jqt_grouped_gemv``: 4-bit int or NF4 codes with group scales (or one scale per
  output channel), two per byte, packed ``(K, N)`` (``w4``, ``w4a8``, ``nf4``);
* ``jqt_channel_gemv``: int8 codes with one scale per output channel, packed ``(N, K)``
  (``w8``; and ``w8a8`` / ``w8a8_dynamic``, their int8 codes as floats, where
  ``KernelPolicy.native_int8_rows`` says so: exact products, float32 sums).

* ``jqt_channel_gemv_kn``: the same with the codes packed ``(K, N)`` (``w8`` under
  ``KernelPolicy.weight_only_kn``, as the CPU table packs it), also with group scales
  (``w8`` / ``w8a8`` with ``group_size``).
* ``jqt_fp8_gemv_kn``: fp8 codes (``float8_e4m3fn``, ``float8_e5m2``) with one scale
  per output channel, packed ``(K, N)`` (``fp8``, its activation's fp8 values taken as
  float32, exact), each code's bits decoded through float16 (F16C): XLA:CPU has no fp8
  arithmetic, and its formulation decoded the weight chunk by chunk, 1.44-2.45x a float32
  4096 x 4096 layer at one row.

They are XLA FFI custom calls, built on first use (``nativelib.py``). Where they
cannot be built or run (no compiler, not x86-64, a CPU
without AVX2 + FMA, or ``JQT_NATIVE=0``) the op runs the XLA formulation the policy
would pick without them: the same numbers up to float rounding;
:func:`jqt.native_status` says which and why.

The op is one primitive, ``jqt_gemv``, whose CPU lowering is the custom call and whose
lowering elsewhere is that XLA formulation: on other backends, inside ``jax.export``
(its artifact must run in processes that never registered the targets) and in SPMD
programs over several devices (the partitioner cannot split a custom call).
``jax.vmap`` folds a batch of activations into its rows, and ``jax.jvp`` /
``jax.grad`` differentiate the XLA formulation.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat, dense, gemv
from .formats import FLOAT8, NF4_TABLE
from .layerview import LayerView
from .nativelib import CHANNEL, CHANNEL_KN, FP8_KN, GROUPED, native_status
from .qparams import QArray

_F32 = jnp.float32


def _target(w: QArray):
    """The kernel for the 2-D weight ``w``, or ``None``: ``GROUPED`` for int codes of 4 bits
    or fewer or NF4 codes with group scales or one scale per output channel (or one per
    tensor, read as one per channel), two per byte, ``"kn"`` (w4, w4a8, nf4);
    ``CHANNEL`` (``"nk"``: w8, w8a8) or ``CHANNEL_KN`` (``"kn"``: w8) for int codes of at
    most 8 bits, one per byte, one scale per output channel (not one per tensor), and
    ``CHANNEL_KN`` for such codes ``"kn"`` with group scales (w8 and w8a8 with
    ``group_size``);
    ``FP8_KN`` for fp8 codes, ``"kn"``, one scale per output channel (fp8)."""
    q = w.qtype
    if getattr(w.values, "ndim", 0) != 2:
        return None
    n = w.values.shape[0 if w.layout == "nk" else 1]
    per_channel = math.prod(jnp.shape(w.scale)) == n and not q.group_size
    per_tensor = jnp.ndim(w.scale) == 0 and not q.group_size  # read as per channel, all equal
    if (w.layout == "kn" and w.nibbles and q.grid in ("int", "nf4")
            and (q.group_size and q.group_size % 2 == 0 or per_channel or per_tensor)):
        return GROUPED
    k = w.values.shape[0] if w.layout == "kn" else 0
    grouped8 = (w.layout == "kn" and q.kind == "int" and q.bits <= 8 and w.values.dtype == np.int8
                and bool(q.group_size) and k % q.group_size == 0
                and jnp.shape(w.scale) == (k // q.group_size, n))
    if grouped8:
        return CHANNEL_KN
    if not per_channel:  # one scale per tensor, or groups
        return None
    if (w.layout in ("nk", "kn") and q.kind == "int" and q.bits <= 8
            and w.values.dtype == np.int8):
        return CHANNEL if w.layout == "nk" else CHANNEL_KN
    if w.layout == "kn" and q.kind == "float" and w.values.dtype == FLOAT8[q.grid] \
            and w.zero_point is None:
        return FP8_KN
    return None


def kernel_group(qtype, k: int) -> int:
    """The ``group_size`` ``jqt_grouped_gemv`` runs 4-bit codes of ``qtype`` over ``k``
    rows in: the format's groups, or for one scale per output channel blocks of about 256
    rows (one scale row for all of them), which the threads share.

    >>> import jqt
    >>> kernel_group(jqt.QuantType(bits=4, group_size=64), 4096), kernel_group(jqt.QuantType(bits=4), 4096)
    (64, 256)
    >>> kernel_group(jqt.QuantType(bits=4), 300), kernel_group(jqt.QuantType(bits=4), 4098)
    (150, 4098)
    """
    return qtype.group_size or dense.chunk_size(k, 256, 2) or k


def applies(w: QArray, m: int, policy, int_activation: bool = False, act_bits: int = 8) -> bool:
    """Whether the op of the 2-D weight ``w`` at ``m`` rows runs a native kernel:
    ``0 < m <= policy.native_gemv_rows``, a weight one of the kernels reads (``GROUPED``:
    w4, w4a8, nf4; ``CHANNEL`` / ``CHANNEL_KN``: w8, and w8a8 per channel at up to
    ``policy.native_int8_rows`` rows: above, XLA's int8 matmul keeps their int8 x int8
    sums exact; w8 and w8a8 with ``group_size`` at any of the kernel's rows, as w4a8's
    groups: XLA's int8 matmul per group was slower than float32 there; w8a16's int16
    activation codes (``act_bits`` 16), whole, at any of the kernel's rows, XLA's two int8
    matmuls on their halves being slower than float32's there;
    ``FP8_KN``: fp8, whose activation's values are exact in float32 as XLA's formulation
    takes them), and the kernels available here (:func:`native_status`)."""
    target = _target(w)
    if target is None or (int_activation and act_bits <= 8 and target in (CHANNEL, CHANNEL_KN)
                          and not w.qtype.group_size and m > policy.native_int8_rows):
        return False
    return 0 < m <= policy.native_gemv_rows and native_status().available


def dense_rows(x2, w: QArray, policy, stack: LayerView | None = None):
    """``x2 (M, K) @ w`` in float32 (``x2`` float, or an int8 activation's codes minus
    their zero point) through the ``jqt_gemv`` primitive. With ``stack`` (a view of
    stacked layers whose layer is ``w``, its arrays the same up to a reshape) the kernel
    reads the layer from the stack in place."""
    target = _target(w)
    q = w.qtype
    v = w.values
    if target == GROUPED:
        shape = (v.shape[0] * 2 // q.group_size if q.group_size else 1, v.shape[1])
    elif q.group_size:  # int8 codes "kn" with group scales (CHANNEL_KN)
        shape = (v.shape[0] // q.group_size, v.shape[1])
    else:  # one scale per output channel: the codes' axis 0 "nk", axis 1 "kn" (fp8 too)
        shape = (v.shape[0] if target == CHANNEL else v.shape[1],)
    layer = jnp.int32(0)
    lead = ()
    if stack is not None:
        w, layer = stack.flat()
        lead = w.values.shape[:1]
        v = w.values.reshape(lead + v.shape)
    # (one scale and zero point per tensor: the same for every output channel; a stacked
    # one is not read in place, in_place)
    fit = lambda a: a.reshape(lead + shape) if a.size > 1 or math.prod(shape) == 1 \
        else jnp.broadcast_to(a.reshape(lead + (1,) * len(shape)), lead + shape)
    scale = fit(w.scale.astype(_F32))
    zp = (jnp.zeros(lead + (0,) + shape[1:], _F32) if w.zero_point is None
          else fit(w.zero_point.astype(_F32)))
    table = jnp.asarray(NF4_TABLE if q.grid == "nf4" else np.zeros(0), _F32)
    return gemv_p.bind(x2.astype(_F32), v, scale, zp, table, layer, target=target, qtype=q,
                       policy=dataclasses.replace(policy, native_gemv_rows=0),
                       max_rows=policy.native_gemv_rows)


def in_place(stack: LayerView | None, wq: QArray, w2: QArray, to_layout) -> LayerView | None:
    """``stack`` when the kernel can read ``w2 = to_layout(wq)`` (the weight in the
    kernel's layout) from it in place: ``w2``'s codes are ``wq``'s and its scale (and
    zero point, converted alike) ``wq``'s up to a reshape, checked at trace time on a
    probe; else ``None``."""
    if (stack is None or w2.values is not wq.values or wq.scale is None
            or jnp.ndim(wq.scale) == 0):
        return None
    n = math.prod(jnp.shape(wq.scale))
    with jax.ensure_compile_time_eval():  # a concrete probe: which element goes where
        probe = jnp.arange(n, dtype=_F32).reshape(jnp.shape(wq.scale))
        out = to_layout(dataclasses.replace(wq, scale=probe, zero_point=None)).scale
        if not np.array_equal(np.asarray(out).ravel(), np.arange(n)):
            return None
    return stack


def _reference(x2, codes, scale, zp, table, layer, *, target, qtype, policy, max_rows):
    """The op in XLA: the formulation ``policy`` (the table without the kernels) picks
    for a float activation (``table`` is the NF4 table the kernel reads, which ``qtype``
    names; stacked codes, scale and zero point are sliced at ``layer`` first)."""
    del table, max_rows
    if codes.ndim == 3:
        take = lambda a: lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
        codes, scale, zp = take(codes), take(scale), take(zp)
    w = QArray(values=codes, scale=scale, zero_point=zp if zp.shape[0] else None, qtype=qtype,
               layout="nk" if target == CHANNEL else "kn")
    m = x2.shape[0]
    m = m if isinstance(m, (int, np.integer)) else -1  # a symbolic row count (jax.export)
    if gemv.weight_only_applies(w, m, policy):
        return gemv.weight_only_rows(x2, w, policy)
    return dense.weight_only_2d(x2, w, policy, None)


gemv_p = compat.Primitive("jqt_gemv")


@gemv_p.def_abstract_eval
def _abstract(x2, codes, scale, zp, table, layer, *, target, **params):
    n_dim = -2 if target == CHANNEL else -1
    # the rows split as the activation's, the outputs as the weight's (explicit mesh axes)
    return compat.shaped((x2.shape[0], codes.shape[n_dim]), _F32, (x2, codes), ((0, None), (None, n_dim)))


def _batch(args, dims, **params):
    x2, *w = args
    bx = dims[0]
    if all(d is compat.NOT_MAPPED for d in dims[1:]):  # a batch of activations: more rows
        x = jnp.moveaxis(x2, bx, 0)
        b, m, k = x.shape
        # (a symbolic batch, jax.export's shape polymorphism: rows of any number)
        if isinstance(b * m, (int, np.integer)) and b * m <= params["max_rows"]:
            out = gemv_p.bind(x.reshape(b * m, k), *w, **params)
        else:
            out = _reference(x.reshape(b * m, k), *w, **params)
        return out.reshape(b, m, out.shape[-1]), 0  # (b or m may be 0)
    axes = tuple(None if d is compat.NOT_MAPPED else d for d in dims)
    return jax.vmap(functools.partial(_reference, **params), in_axes=axes)(*args), 0


_lower_reference = compat.define_by_reference(gemv_p, _reference, _batch)


def _lower_cpu(ctx, x2, codes, scale, zp, table, layer, *, target, **params):
    args = (x2, codes, scale, zp, table, layer)
    if compat.lowering_is_portable(ctx) or not native_status().available:
        return _lower_reference(ctx, *args, target=target, **params)
    if target == GROUPED:
        return jax.ffi.ffi_lowering(GROUPED)(
            ctx, *args, group_size=np.int64(kernel_group(params["qtype"], 2 * ctx.avals_in[1].shape[-2])))
    return jax.ffi.ffi_lowering(target)(ctx, *args)  # table: empty


compat.register_cpu_lowering(gemv_p, _lower_cpu, _lower_reference)
