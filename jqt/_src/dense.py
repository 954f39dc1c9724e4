"""A ``dot_general`` with a weight operand, as a 2-D matmul ``(M, K) x (K, N)``.

Most matmuls with weights (dense layers, attention projections, einsums over
heads) contract some axes of an activation with some axes of a weight that
has no batch axes. Such an op is the matmul of the activation reshaped to
``(M, K)`` with the weight reshaped to ``(N, K)`` (layout ``"nk"``) or
``(K, N)`` (layout ``"kn"``): :func:`jqt.pack` stores the int8 weight in the
layout that is fastest for the kernel (see ``policy.py``), once, and the
kernels here reshape only the (small) activation per call.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import numerics as nx
from .formats import unpack_nibbles

_I32 = jnp.int32
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class DenseAxes:
    """Free and contracted axes of the activation (``x``) and weight (``w``) operands."""

    x_free: tuple
    x_contract: tuple
    w_free: tuple
    w_contract: tuple
    w: int  # the weight's operand index

    @staticmethod
    def of(dimension_numbers, ndims, w):
        """The axes of a dot_general whose operand ``w`` is the weight, or None when
        the weight has batch axes (then the generic kernel runs)."""
        if w is None:
            return None
        (lc, rc), (lb, rb) = dimension_numbers
        wc, wb, xc = (lc, lb, rc) if w == 0 else (rc, rb, lc)
        if wb:
            return None
        free = lambda nd, c: tuple(d for d in range(nd) if d not in c)
        return DenseAxes(free(ndims[1 - w], xc), tuple(xc), free(ndims[w], wc), tuple(wc), w)

    @staticmethod
    def for_weight(contract, ndim, w):
        """The weight half only (what :func:`jqt.pack` needs)."""
        return DenseAxes((), (), tuple(d for d in range(ndim) if d not in contract), tuple(contract), w)

    def _wperm(self, layout):
        return self.w_free + self.w_contract if layout == "nk" else self.w_contract + self.w_free

    def shape_2d(self, shape, layout):
        """The 2-D shape of a weight of operand ``shape`` in ``layout``."""
        n = math.prod(shape[d] for d in self.w_free)
        k = math.prod(shape[d] for d in self.w_contract)
        return (n, k) if layout == "nk" else (k, n)

    def weight_2d(self, a, layout, depth=0):
        """Weight in operand layout (after ``depth`` stacked axes) -> ``(..., N, K)`` or ``(..., K, N)``."""
        perm = self._wperm(layout)
        a2 = jnp.transpose(a, tuple(range(depth)) + tuple(d + depth for d in perm))
        return a2.reshape(a.shape[:depth] + self.shape_2d(a.shape[depth:], layout))

    def weight_from_2d(self, a, layout, shape):
        """Inverse of :meth:`weight_2d` for one layer: back to the operand ``shape``."""
        perm = self._wperm(layout)
        a = a.reshape([shape[d] for d in perm])
        return jnp.transpose(a, tuple(int(i) for i in np.argsort(perm)))

    def weight_vec(self, a):
        """A keepdims per-channel weight array (size 1 on contracted axes) -> ``(N,)``."""
        if a is None or a.ndim == 0:
            return a
        return jnp.transpose(a, self.w_free + self.w_contract).reshape(-1)

    def act_2d(self, x):
        return jnp.transpose(x, self.x_free + self.x_contract).reshape(
            math.prod(x.shape[d] for d in self.x_free), -1)

    def act_vec(self, a):
        """A keepdims per-row activation array -> ``(M, 1)`` (scalars stay scalars)."""
        if a is None or a.ndim == 0:
            return a
        return jnp.transpose(a, self.x_free + self.x_contract).reshape(-1, 1)

    def out(self, out2, x_shape, w_shape):
        """``(M, N)`` result -> the dot_general's output layout."""
        xs = [x_shape[d] for d in self.x_free]
        ws = [w_shape[d] for d in self.w_free]
        if self.w == 1:
            return out2.reshape(xs + ws)
        return out2.T.reshape(ws + xs)


def _int_zp(z):
    return None if z is None else jnp.round(z).astype(_I32)


def _contract_dim(layout):
    return 1 if layout == "nk" else 0


def unpacked(w2):
    """The int8 codes of a 2-D weight QArray (nibbles unpacked along K)."""
    v = w2.values
    if w2.qtype.packs_nibbles and v.dtype == jnp.uint8:
        v = unpack_nibbles(v, v.ndim - 2 + _contract_dim(w2.layout))
    return v


def weight_in_layout(ax, wq, want, w_shape):
    """A weight QArray (packed 2-D, or codes in the op's layout) -> codes 2-D in ``want``
    with kernel-shaped scale and zero point: ``(N,)`` per channel, ``(N, G)`` / ``(G, N)``
    per group (``"nk"`` / ``"kn"``), scalars per tensor."""
    v = wq.values
    if wq.layout == "operand":
        v = ax.weight_2d(v, want)
    elif wq.layout != want:
        v = ax.weight_2d(ax.weight_from_2d(unpacked(wq), wq.layout, w_shape), want)
    grouped = bool(wq.qtype.group_size)
    conv = (lambda a: ax.weight_2d(a, want)) if grouped else ax.weight_vec
    vec = lambda a: None if a is None else (a if a.ndim == 0 else conv(a))
    sums = wq.sums if wq.layout == want else None
    return dataclasses.replace(wq, values=v, scale=vec(wq.scale), zero_point=vec(wq.zero_point),
                               sums=sums, layout=want)


def int_matmul(x2, w2, layout, pad_rows):
    """int8 ``(M, K)`` x int8 weight in ``layout`` -> int32 ``(M, N)``; rows padded to ``pad_rows``."""
    m = x2.shape[0]
    if isinstance(m, int) and m < pad_rows:  # a symbolic row count (jax.export) is not padded
        x2 = jnp.pad(x2, ((0, pad_rows - m), (0, 0)))
    dn = (((1,), (_contract_dim(layout),)), ((), ()))
    return lax.dot_general(x2, w2, dn, preferred_element_type=_I32)[:m]


def int_dense(ax, x, w, policy):
    """Integer matmul with zero-point corrections and rescale to float ``(M, N)``.

    ``x``: a QArray of int8 codes in operand layout; ``w``: from
    :func:`weight_in_layout` (``"nk"``), its ``sums`` the ``(N,)`` int32 sum over
    K or None to compute it.
    """
    qw = unpacked(w)
    qx2 = ax.act_2d(x.values)
    acc = int_matmul(qx2, qw, w.layout, policy.pad_rows)
    zx, zw = _int_zp(ax.act_vec(x.zero_point)), _int_zp(w.zero_point)
    if zx is not None:
        wsum = w.sums if w.sums is not None else jnp.sum(qw, axis=_contract_dim(w.layout), dtype=_I32)
        acc = acc - zx * wsum
    if zw is not None:
        acc = acc - zw * jnp.sum(qx2, axis=1, keepdims=True, dtype=_I32)
    if zx is not None and zw is not None:
        acc = acc + zx * zw * qx2.shape[1]
    return acc.astype(_F32) * ax.act_vec(x.scale.astype(_F32)) * w.scale.astype(_F32)


def int_dense_grouped(ax, x, w, policy):
    """int8 activation x int4 (or int8) weight with one scale per group of K: int32
    partial sums per group (a dot_general batched over groups), scaled per group,
    summed in float. ``w``: ``"nk"`` codes ``(N, K)``, scale ``(N, G)``."""
    qw = unpacked(w)
    n, k = qw.shape
    gs = w.qtype.group_size
    G = k // gs
    qx2 = ax.act_2d(x.values)
    m = qx2.shape[0]
    if isinstance(m, int) and m < policy.pad_rows:
        qx2 = jnp.pad(qx2, ((0, policy.pad_rows - m), (0, 0)))
    x3, w3 = qx2.reshape(-1, G, gs), qw.reshape(n, G, gs)
    acc = lax.dot_general(x3, w3, (((2,), (2,)), ((1,), (1,))), preferred_element_type=_I32)
    acc = acc[:, :m]                                     # (G, M, N)
    zx, zw = _int_zp(ax.act_vec(x.zero_point)), _int_zp(w.zero_point)
    if zx is not None:
        wsum = w.sums if w.sums is not None else jnp.sum(w3, axis=2, dtype=_I32)
        acc = acc - zx[None] * wsum.T[:, None, :]
    if zw is not None:
        xsum = jnp.sum(x3[:m], axis=2, dtype=_I32).T[:, :, None]    # (G, M, 1)
        acc = acc - zw.T[:, None, :] * xsum
        if zx is not None:
            acc = acc + zx[None] * zw.T[:, None, :] * gs
    out = jnp.sum(acc.astype(_F32) * w.scale.astype(_F32).T[:, None, :], axis=0)
    return out * ax.act_vec(x.scale.astype(_F32))


def fp8_dense(ax, x, w, policy):
    """fp8 activation x fp8 weight: one fp8 matmul with float32 accumulation where the
    backend has it (``policy.fp8_native``), else the weight-only path on the upcast
    (exact) activation; then both scales."""
    x2 = ax.act_2d(x.values)
    if policy.fp8_native:
        dn = (((1,), (_contract_dim(w.layout),)), ((), ()))
        out = lax.dot_general(x2, w.values, dn, preferred_element_type=_F32)
        return out * ax.act_vec(x.scale.astype(_F32)) * w.scale.astype(_F32)
    out = _weight_only_2d(x2.astype(_F32), w, policy, None)
    return out * ax.act_vec(x.scale.astype(_F32))


def _chunk(k, target, multiple=1):
    """A divisor of ``k`` that is a multiple of ``multiple``, in ``[target / 4, target]``, or 0
    when none is (or none is needed)."""
    if not target or k <= target:
        return 0
    for c in range(target - target % multiple, max(target // 4, 1) - 1, -multiple):
        if c > 0 and k % c == 0:
            return c
    return 0


def _decode_chunk(codes, w, zp, scale, kdim, dtype):
    """Codes of a K-chunk -> float weight: unpack nibbles, decode (int, fp8, nf4 table),
    subtract the zero point and, with groups, apply the group scales."""
    if w.qtype.packs_nibbles and codes.dtype == jnp.uint8:
        codes = unpack_nibbles(codes, kdim)
    v = nx.decode(codes, w.qtype.grid)
    gs = w.qtype.group_size
    if zp is not None:
        v = v - (jnp.repeat(jnp.round(zp), gs, axis=kdim) if gs else 0.0)
    if gs:
        v = v * jnp.repeat(scale.astype(_F32), gs, axis=kdim)
    return v.astype(dtype)


def _weight_only_2d(x2, w, policy, precision):
    m, k = x2.shape
    gs = w.qtype.group_size
    nib = 2 if (w.qtype.packs_nibbles and w.values.dtype == jnp.uint8) else 1
    step_mult = max(gs, 1) * nib // math.gcd(max(gs, 1), nib)
    kd = _contract_dim(w.layout)
    chunk = _chunk(k, policy.weight_only_chunk, step_mult) if w.layout == "kn" else 0
    zp_g = w.zero_point if gs else None
    if chunk:
        n = w.values.shape[1]
        nc = k // chunk
        xc = x2.reshape(m, nc, chunk).transpose(1, 0, 2)
        wc = w.values.reshape(nc, chunk // nib, n)
        sc = w.scale.reshape(nc, chunk // gs, n) if gs else jnp.zeros((nc,))
        zc = zp_g.reshape(nc, chunk // gs, n) if zp_g is not None else jnp.zeros((nc,))

        def step(acc, xw):
            xi, wi, si, zi = xw
            wf = _decode_chunk(wi, w, zi if zp_g is not None else None, si, 0, x2.dtype)
            return acc + jnp.matmul(xi, wf, precision=precision, preferred_element_type=_F32), None

        out, _ = lax.scan(step, jnp.zeros((m, n), _F32), (xc, wc, sc, zc))
    else:
        wf = _decode_chunk(w.values, w, zp_g, w.scale, kd, x2.dtype)
        dn = (((1,), (kd,)), ((), ()))
        out = lax.dot_general(x2, wf, dn, precision=precision, preferred_element_type=_F32)
    if gs:
        return out
    if w.zero_point is not None:
        out = out - jnp.round(w.zero_point).astype(_F32) * jnp.sum(x2.astype(_F32), axis=1, keepdims=True)
    return out * w.scale.astype(_F32)


def weight_only_dense(ax, x, w, policy, precision=None):
    """Float activation x quantized weight (``w`` from :func:`weight_in_layout`) -> float
    ``(M, N)``.

    With a ``"kn"`` weight and a chunk size, the weight is decoded to float one
    K-chunk at a time inside a ``lax.scan``, so no float copy of the whole
    weight is made. Per-channel scales apply to the (smaller) output; per-group
    scales to each decoded chunk.
    """
    return _weight_only_2d(ax.act_2d(x), w, policy, precision)
