"""A weight of 4-bit codes (int or NF4, two per byte) decoded whole to float32 by jqt's
native kernel ``jqt_nibble_decode``, for XLA's float matmul at many rows.

Above ``KernelPolicy.native_gemv_rows`` rows a weight-only (or w4a8) op whose weight is
decoded whole (``dense.decodes_whole``) runs XLA's float32 matmul on the decoded copy.
XLA:CPU decodes an NF4 code by a tree of 15 selects on its bits (the table's constants;
a gather from the table was slower still), where an int4 code is one conversion
(all-MiniLM-L6-v2 ``nf4`` g64 at batch 1: 0.89-1.00x float32 against 0.58-0.70x for
``w4`` g64, ``benchmarks/results/formats-cpu-2core.md``). The kernel holds the table's two halves in two registers and
decodes 8 codes with two permutes and a blend (AVX2; with AVX-512, 16 codes with one
permute of the whole table), with the same float32 operations
as the XLA decode after the lookup (the group's zero point rounded and subtracted, then
its scale multiplied), so the same bits. ``KernelPolicy.native_decode`` says which
weights take it (see ``docs/performance.md``).

The op is one primitive, ``jqt_nibble_decode``, lowered on CPU to the custom call where
the kernels are available (``nativelib.native_status``) and elsewhere, inside
``jax.export`` and in SPMD programs over several devices, to the XLA decode.
``jax.vmap`` over activations alone keeps one decode of the weight (its tie to the
activation taken from the batch's first element); over weights it maps the XLA decode.
``jax.jvp`` differentiates the XLA decode (the scales and zero points; the codes are
integers).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import compat
from . import numerics as nx
from .formats import NF4_TABLE, unpack_nibbles
from .nativelib import DECODE, native_status
from .qparams import QArray

_F32 = jnp.float32


def applies(w: QArray, dtype, policy) -> bool:
    """Whether the 2-D weight ``w``, decoded whole to ``dtype``, is decoded by the native
    kernel: ``policy.native_decode`` (1: NF4 codes; 2: int codes of 4 bits or fewer too),
    codes two per byte packed ``"kn"`` with group scales of an even size or one scale per
    output channel, decoded to float32, K not split over explicit mesh axes (the XLA
    decode takes those, as it takes SPMD programs), and the kernels available here.

    >>> import jax.numpy as jnp, jqt
    >>> w = QArray(values=jnp.zeros((32, 8), jnp.uint8), scale=jnp.ones((1, 8)),
    ...            qtype=jqt.QuantType(dtype="nf4", group_size=64), layout="kn")
    >>> applies(w, jnp.float32, jqt.KernelPolicy()), applies(w, jnp.bfloat16, jqt.KernelPolicy(native_decode=1))
    (False, False)
    """
    q = w.qtype
    level = policy.native_decode
    if not level or q.grid not in ("int", "nf4") or (q.grid == "int" and level < 2):
        return False
    if not w.nibbles or w.layout != "kn" or getattr(w.values, "ndim", 0) != 2:
        return False
    if compat.split_count(w.values, 0) > 1:  # K split over explicit mesh axes: XLA's decode
        return False
    if jnp.dtype(dtype) != jnp.dtype(_F32) or q.group_size % 2:
        return False
    k, n = 2 * w.values.shape[0], w.values.shape[1]
    if q.group_size:
        fits = k % q.group_size == 0 and int(np.prod(jnp.shape(w.scale))) == k // q.group_size * n
    else:  # one scale per output channel
        fits = int(np.prod(jnp.shape(w.scale))) == n
    return fits and native_status().available


def decode(codes, w: QArray, after=None):
    """The float32 ``(K, N)`` weight of ``w`` (:func:`applies`) from its codes ``codes``. A
    weight with one scale per output channel is decoded to its codes' values alone (scale
    1: the matmul's output takes the scale), as the XLA path decodes it.

    ``after``: an activation the decode must wait for (``numerics.after``'s purpose: XLA
    cannot hoist the decode ahead of its op's input), or ``None``. Its first element is an
    operand of the custom call that the kernel does not read: the dependency costs no
    copy of the codes, where ``numerics.after``'s integer zero would be a pass of its own
    before the kernel. The XLA decode (``jax.export``, SPMD programs) adds that zero from
    it, fused into the decode, as the XLA path does."""
    q = w.qtype
    k, n = 2 * codes.shape[0], codes.shape[1]
    if q.group_size:
        scale = w.scale.astype(_F32).reshape(k // q.group_size, n)
        zp = (jnp.zeros((0, n), _F32) if w.zero_point is None
              else w.zero_point.astype(_F32).reshape(scale.shape))
        gs = q.group_size
    else:
        scale, zp, gs = jnp.ones((1, n), _F32), jnp.zeros((0, n), _F32), k
    table = jnp.asarray(NF4_TABLE if q.grid == "nf4" else np.zeros(0), _F32)
    tie = (jnp.zeros((0,), _F32) if after is None or after.size == 0
           else nx.first_element(after))
    return decode_p.bind(codes, scale, zp, table, tie, grid=q.grid, group_size=gs)


def _reference(codes, scale, zp, table, tie, *, grid, group_size):
    """The decode in XLA: the codes unpacked (K in its own order), their grid values
    (NF4: the table the kernel reads), minus the rounded zero point, times the scale,
    per group of ``group_size`` rows of K; the codes tied to ``tie`` (``numerics.after``)."""
    del table
    if tie.shape[0]:
        codes = nx.after(codes, tie)
    v = nx.decode(unpack_nibbles(codes, 0), grid)
    k, n = v.shape
    v = v.reshape(scale.shape[0], k // scale.shape[0], n)
    if zp.shape[0]:
        v = v - jnp.round(zp)[:, None]
    return (v * scale[:, None]).reshape(k, n)


decode_p = compat.Primitive("jqt_nibble_decode")


@decode_p.def_abstract_eval
def _abstract(codes, scale, zp, table, tie, **params):
    return compat.shaped((2 * codes.shape[0], codes.shape[1]), _F32, (codes, scale, zp, table, tie),
                         ((0, None, None, None, None), (1, None, None, None, None)))


def _batch(args, dims, **params):
    """``jax.vmap``: over activations alone (only ``tie`` batched) the one weight is decoded
    once, tied to the batch's first element (the decode does not read it); otherwise the
    XLA decode, mapped."""
    if all(d is compat.NOT_MAPPED for d in dims[:-1]):
        tie = args[-1]  # an empty batch: no element to tie to
        tie = nx.first_element(tie) if tie.size else jnp.zeros((0,), _F32)
        return decode_p.bind(*args[:-1], tie, **params), compat.NOT_MAPPED
    axes = tuple(None if d is compat.NOT_MAPPED else d for d in dims)
    return jax.vmap(functools.partial(_reference, **params), in_axes=axes)(*args), 0


_lower_reference = compat.define_by_reference(decode_p, _reference, _batch)


def _lower_cpu(ctx, *args, grid, group_size):
    if compat.lowering_is_portable(ctx) or not native_status().available:
        return _lower_reference(ctx, *args, grid=grid, group_size=group_size)
    return jax.ffi.ffi_lowering(DECODE)(ctx, *args, group_size=np.int64(group_size))


compat.register_cpu_lowering(decode_p, _lower_cpu, _lower_reference)
