"""An int8 convolution as one int8 matmul over image patches (im2col).

XLA:CPU's int8 convolution is slow when the input has few channels (the
first layer of a CNN: 3x slower than float at 3 channels). Gathering the
``prod(kernel)`` shifted, strided views of the int8 input into a patch axis
and contracting it with the kernel reshaped to ``(prod(kernel) * C, O)`` is an
int8 GEMM with many rows, which XLA:CPU runs fast. The result is exact: it is
the same integer sum.
"""
from __future__ import annotations

import itertools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from .dense import INT_PRECISION, scaled

_I32 = jnp.int32
_F32 = jnp.float32


def applies(params, in_channels, policy, out_shape) -> bool:
    """Whether ``policy`` runs this convolution as a patch matmul (output ``out_shape``):
    not where a dimension is symbolic (``jax.export``), whose slices' limits JAX cannot
    compare with their starts, or empty (a sequence of length 0, an image smaller than the
    kernel), whose slices' limits are out of range (the convolution takes both)."""
    return (in_channels < policy.conv_patches_below and params["feature_group_count"] == 1
            and params["batch_group_count"] == 1 and all(d == 1 for d in params["lhs_dilation"])
            and all(isinstance(d, (int, np.integer)) and d > 0 for d in out_shape))


def _pad_input(x, zx, padding):
    """Pads the spatial axes of channels-last ``x`` with each example's zero point."""
    cfg = [(0, 0, 0)] + [(lo, hi, 0) for lo, hi in padding] + [(0, 0, 0)]
    if zx is None or zx.size == 1:
        fill = jnp.zeros((), x.dtype) if zx is None else zx.reshape(()).astype(x.dtype)
        return lax.pad(x, fill, cfg)
    xp = lax.pad(x, jnp.zeros((), x.dtype), cfg)
    inside = lax.pad(jnp.ones(x.shape[1:-1], jnp.int8), jnp.int8(0), cfg[1:-1]).astype(bool)
    fill = zx.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)
    return jnp.where(inside[None, ..., None], xp, fill)


def conv(x_op, w_op, params, out_shape):
    """``x_op``/``w_op``: ``(q, scale, zero_point, qsum)`` in the conv's own layouts
    (scale and zero point of ``x`` per tensor or per example, keepdims; of ``w``
    per output channel). Returns the float output in the conv's output layout."""
    (qx, sx, zx, _), (qw, sw, _, wsum) = x_op, w_op
    ls, rs, os_ = params["dimension_numbers"]
    nsp = len(ls) - 2
    x = jnp.transpose(qx, (ls[0],) + tuple(ls[2:]) + (ls[1],))   # N, spatial..., C
    w = jnp.transpose(qw, tuple(rs[2:]) + (rs[1], rs[0]))         # spatial..., I, O
    zx = None if zx is None else jnp.round(zx).astype(_I32)
    x = _pad_input(x, zx, params["padding"])
    n, c = x.shape[0], x.shape[-1]
    out_sp = [out_shape[os_[2 + i]] for i in range(nsp)]
    strides, dil = params["window_strides"], params["rhs_dilation"]
    cols = []
    for offs in itertools.product(*[range(k) for k in w.shape[:nsp]]):
        start = (0,) + tuple(o * d for o, d in zip(offs, dil)) + (0,)
        limit = (n,) + tuple(o * d + (m - 1) * s + 1 for o, d, m, s in zip(offs, dil, out_sp, strides)) + (c,)
        cols.append(lax.slice(x, start, limit, (1,) + tuple(strides) + (1,)))
    # stacking (not concatenating) lets XLA build the patches in one fusion
    patches = jnp.stack(cols, axis=-2).reshape(cols[0].shape[:-1] + (len(cols) * c,))
    w2 = w.reshape(math.prod(w.shape[:-1]), w.shape[-1])
    acc = lax.dot_general(patches, w2, (((nsp + 1,), (0,)), ((), ())), precision=INT_PRECISION,
                          preferred_element_type=_I32)
    per_example = lambda a: a.reshape(()) if a.size == 1 else a.reshape((-1,) + (1,) * (nsp + 1))
    if zx is not None:
        wsum = jnp.sum(w2, axis=0, dtype=_I32) if wsum is None else wsum.reshape(-1)
        acc = acc - per_example(zx) * wsum
    out = scaled(acc.astype(_F32), per_example(sx.astype(_F32)), sw.astype(_F32).reshape(-1))
    perm = [0] * (nsp + 2)
    perm[os_[0]], perm[os_[1]] = 0, nsp + 1
    for i in range(nsp):
        perm[os_[2 + i]] = 1 + i
    return jnp.transpose(out, perm)
