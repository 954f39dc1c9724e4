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


def int_matmul(x2, w2, layout, pad_rows):
    """int8 ``(M, K)`` x int8 weight in ``layout`` -> int32 ``(M, N)``; rows padded to ``pad_rows``."""
    m = x2.shape[0]
    if isinstance(m, int) and m < pad_rows:  # a symbolic row count (jax.export) is not padded
        x2 = jnp.pad(x2, ((0, pad_rows - m), (0, 0)))
    dn = (((1,), (_contract_dim(layout),)), ((), ()))
    return lax.dot_general(x2, w2, dn, preferred_element_type=_I32)[:m]


def int_dense(ax, x, w, layout, policy):
    """Integer matmul with zero-point corrections and rescale to float ``(M, N)``.

    ``x``/``w``: ``(q, scale, zero_point, qsum)`` with ``x`` in operand layout
    and ``w``'s ``q`` already 2-D in ``layout``; ``qsum`` of the weight is its
    ``(N,)`` int32 sum over K, or None to compute it.
    """
    qx, sx, zx, _ = x
    qw, sw, zw, wsum = w
    qx2 = ax.act_2d(qx)
    acc = int_matmul(qx2, qw, layout, policy.pad_rows)
    zx, zw = _int_zp(ax.act_vec(zx)), _int_zp(ax.weight_vec(zw))
    if zx is not None:
        if wsum is None:
            wsum = jnp.sum(qw, axis=_contract_dim(layout), dtype=_I32)
        acc = acc - zx * wsum
    if zw is not None:
        acc = acc - zw * jnp.sum(qx2, axis=1, keepdims=True, dtype=_I32)
    if zx is not None and zw is not None:
        acc = acc + zx * zw * qx2.shape[1]
    return acc.astype(_F32) * ax.act_vec(sx.astype(_F32)) * ax.weight_vec(sw.astype(_F32))


def _chunk(k, target):
    """A divisor of ``k`` in ``[target / 4, target]``, or 0 when none is (or none is needed)."""
    if not target or k <= target:
        return 0
    for c in range(target, max(target // 4, 1) - 1, -1):
        if k % c == 0:
            return c
    return 0


def weight_only_dense(ax, x, w, layout, policy, precision=None):
    """Float activation x int8 weight -> float ``(M, N)``.

    With a ``"kn"`` weight and a chunk size, the weight is cast to float one
    K-chunk at a time inside a ``lax.scan``, so no float copy of the whole
    weight is made.
    """
    qw, sw, zw, _ = w
    x2 = ax.act_2d(x)
    m, k = x2.shape
    chunk = _chunk(k, policy.weight_only_chunk) if layout == "kn" else 0
    if chunk:
        n = qw.shape[1]
        xc = x2.reshape(m, k // chunk, chunk).transpose(1, 0, 2)

        def step(acc, xw):
            xi, wi = xw
            return acc + jnp.matmul(xi, wi.astype(x2.dtype), precision=precision,
                                    preferred_element_type=_F32), None

        out, _ = lax.scan(step, jnp.zeros((m, n), _F32), (xc, qw.reshape(k // chunk, chunk, n)))
    else:
        dn = (((1,), (_contract_dim(layout),)), ((), ()))
        out = lax.dot_general(x2, qw.astype(x2.dtype), dn, precision=precision,
                              preferred_element_type=_F32)
    zw = ax.weight_vec(zw)
    if zw is not None:
        out = out - jnp.round(zw).astype(_F32) * jnp.sum(x2.astype(_F32), axis=1, keepdims=True)
    return out * ax.weight_vec(sw.astype(_F32))
