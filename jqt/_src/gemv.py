"""Few-row (GEMV) formulations of a dense op: decoding at batch 1.

With one to a few rows (M) a matmul reads every weight once and does almost no
arithmetic per byte, so its time is the weight's bytes over the bandwidth the
kernel reaches. On XLA:CPU only the int8 x int8 matmul (YNNPACK) reads an int8
weight at a useful rate; a cast of the weight to float32 (whole, or chunk by
chunk) runs at a fraction of it (``benchmarks/decode.py``, ``docs/performance.md``).
So at ``M <= policy.gemv_rows`` the kernels here bring other formats to that
matmul:

* weight-only int weights (float activation): the activation is split into
  ``policy.weight_only_digits`` int8 *digits*, ``x ~= s_1 c_1 + s_2 c_2 + ...``
  with ``s_{d+1} = s_d / 254`` (each digit holds the rounding residual of the
  ones before), and the digits run as extra rows of one int8 matmul. Three
  digits carry 24 bits of each row's absolute maximum, as float32 does at that
  maximum: the result equals the float kernel's up to float rounding.
* int weights with one scale per group of K (w4a8, and weight-only through the
  digits): one ``dot_general`` batched over the groups gives the int32 partial
  sum of every group at once (instead of one small matmul per group).

The integer partial sums are exact (the caller keeps K short enough for
int32, :func:`dense.safe_k`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import dense, groups

_I32 = jnp.int32
_F32 = jnp.float32
DIGIT_RATIO = 254.0
"""Each digit's scale over the next one's: the residual of rounding to a digit is at
most half a step, which the next digit's 127 steps of ``1 / 254`` cover."""


def applies(m: int, policy) -> bool:
    """Whether an op with ``m`` rows runs a few-row formulation under ``policy``."""
    return 0 < m <= policy.gemv_rows


def weight_only_applies(w, m: int, policy, x_dtype=None) -> bool:
    """Whether the weight-only op of ``w`` (a 2-D weight QArray) runs as digits at ``m`` rows:
    int codes of 8 bits or fewer in a packed 2-D layout (``"kn"`` with group scales; ``"nk"``
    only per channel under ``policy.weight_only_kn``), and without groups a K within
    int32's exact range. Not where ``policy.cast_in_gemm`` casts the codes exactly to the
    activation's dtype ``x_dtype`` for the backend's GEMM to convert in its tiles (GPU
    table, bfloat16 activations: 0.84x bfloat16 at 2 rows of a 4096 layer against
    0.94-1.02x for the digits, ``benchmarks/results/gpu-h100.md``)."""
    q = w.qtype
    n = policy.grouped_digits if q.group_size else policy.weight_only_digits
    if dense.reduces(m, policy):
        return False
    if x_dtype is not None and policy.cast_in_gemm \
            and dense.exact_cast(w, dense.decode_dtype(x_dtype, w, policy, m)):
        return False
    # per channel (K, N) under weight_only_kn: K-chunks, not digits (the 100M decoder's step
    # at 2 / 4 rows 0.590 / 0.737x float32 against 0.657 / 0.826x, a tie at one row)
    per_channel = ("nk",) if policy.weight_only_kn else ("nk", "kn")
    if not (n and applies(m, policy) and q.kind == "int" and q.bits <= 8
            and w.layout in (("kn",) if q.group_size else per_channel)):
        return False
    # per group the partial sums are short; otherwise the whole of K must fit int32
    return bool(q.group_size) or _k(w) <= dense.safe_k(np.int8, False, np.int8, False)


def grouped_applies(w, m: int, policy) -> bool:
    """Whether an int8-activation op with grouped int weights (``"kn"``, as
    ``policy.batched_groups`` packs them) runs one batched dot at ``m`` rows."""
    return (policy.batched_groups and not policy.grouped_float and applies(m, policy)
            and w.layout == "kn" and not policy.small_groups(w.qtype))


def _k(w):
    v = w.values
    k = v.shape[1] if w.layout == "nk" else v.shape[0]
    return 2 * k if w.nibbles else k


def digits(x2, n: int):
    """Float rows ``(M, K)`` -> int8 codes ``(n * M, K)`` (digit-major) and float32 scales
    ``(n, M, 1)`` with ``x2 ~= sum_d scales[d] * codes[d * M:(d + 1) * M]``.

    The first digit is ``x2`` rounded on the grid of its row's absolute maximum over 127;
    each next one rounds what is left on a grid 254 times finer.

    >>> import jax.numpy as jnp
    >>> c, s = digits(jnp.array([[1.0, -0.3, 1e-3]]), 3)
    >>> c.shape, s.shape
    ((3, 3), (3, 1, 1))
    >>> float(jnp.abs((c.reshape(3, 1, 3) * s).sum(0) - jnp.array([[1.0, -0.3, 1e-3]])).max()) < 1e-7
    True
    """
    x = x2.astype(_F32)
    s = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127.0
    # a row holding inf: its first digit the infinities' signs (127) at scale inf, the others
    # 0 at scale 0, so its products are the infinities' as in float (they were NaN: x / inf)
    inf = jnp.isinf(s)
    codes, scales, r = [], [], x
    for d in range(n):
        ok = s > 0  # an all-zero row, or a scale that underflowed: the digit is 0
        c = jnp.clip(jnp.round(jnp.where(ok, r / jnp.where(ok, s, 1.0), 0.0)), -127, 127)
        c = jnp.where(inf, jnp.where(jnp.isinf(x), jnp.sign(x) * 127.0, 0.0) if d == 0 else 0.0, c)
        codes.append(c.astype(jnp.int8))
        scales.append(s if d == 0 else jnp.where(inf, 0.0, s))
        r = r - c * s
        s = s / DIGIT_RATIO
    return jnp.concatenate(codes, 0), jnp.stack(scales)


def _combine(acc, scales):
    """Digit-major rows ``(n * M, N)`` float32 -> ``(M, N)``: the finest digit first."""
    n = scales.shape[0]
    acc = acc.reshape(n, -1, acc.shape[-1])
    out = acc[n - 1] * scales[n - 1]
    for d in range(n - 2, -1, -1):
        out = out + acc[d] * scales[d]
    return out


def weight_only(ax, x, w, policy):
    """Float activation x int weight (see :func:`weight_only_applies`) -> float32 ``(M, N)``,
    through the int8 digits of the activation."""
    return weight_only_rows(ax.act_2d(x), w, policy)


def derivative_of(reference, fn, *args):
    """``fn(*args)``, differentiated (``jax.jvp``, ``jax.grad``) as ``reference(*args)``, the
    same function written with float operations: the digits of an activation are rounded
    (a zero derivative), so a formulation through them would pass no gradient to its
    input (a LoRA adapter before a packed base, as :func:`jqt.quantize`'s weight-only
    kernels promise). Without differentiation ``reference`` is not computed.

    >>> import jax, jax.numpy as jnp
    >>> jax.grad(lambda x: derivative_of(lambda x: 3 * x, lambda x: jnp.round(x), x))(1.2).item()
    3.0
    """
    g = jax.custom_jvp(fn)
    g.defjvp(lambda primals, tangents: (fn(*primals), jax.jvp(reference, primals, tangents)[1]))
    return g(*args)


def decoded(x2, w):
    """``x2 (M, K) @ w`` with the int weight decoded whole, in float32: what the digits
    formulations compute, written with float operations (their derivative)."""
    kd = dense.contract_dim(w.layout)
    dot = lambda a, b: lax.dot_general(a, b, (((1,), (kd,)), ((), ())), precision=dense.code_precision(),
                                       preferred_element_type=_F32)
    x, q = x2.astype(_F32), w.qtype
    if q.group_size:
        return dot(x, groups.dequantize(dense.unpacked(w), w.scale, w.zero_point, q, kd))
    out = dot(x, dense.unpacked(w).astype(_F32))
    if w.zero_point is not None:
        out = out - jnp.round(w.zero_point).astype(_F32) * jnp.sum(x, axis=1, keepdims=True)
    return out * w.scale.astype(_F32)


def weight_only_rows(x2, w, policy):
    """:func:`weight_only` on float rows ``x2 (M, K)`` (differentiated as :func:`decoded`)."""
    return derivative_of(decoded, lambda x2, w: _weight_only_rows(x2, w, policy), x2, w)


def _weight_only_rows(x2, w, policy):
    if w.qtype.group_size:
        c, scales = digits(x2, policy.grouped_digits)
        return _combine(group_sums(c, None, w, policy), scales)
    c, scales = digits(x2, policy.weight_only_digits)
    acc = sum(dense.int_matmul(c[:, r], p, w.layout, policy.pad_rows)
              for r, p in dense.parts(w.values, w.nibbles))
    if w.zero_point is not None:  # per digit: sum c (q - zw) = sum c q - zw sum c, in int32
        # where it fits (exact), else in float32; a row's infinities then meet q - zw, as in
        # float (from the float sum of the row, zw times inf was subtracted from inf: NaN)
        zw, csum = jnp.round(w.zero_point), jnp.sum(c.astype(_I32), axis=1, keepdims=True)
        if _k(w) <= dense.safe_k(np.int8, False, np.int8, True):
            acc = acc - zw.astype(_I32) * csum
        else:
            acc = acc.astype(_F32) - zw.astype(_F32) * csum.astype(_F32)
    return _combine(acc.astype(_F32), scales) * w.scale.astype(_F32)


def int_grouped(ax, x, w, policy):
    """int8 activation x grouped int weight (``"kn"``) -> float32
    ``(M, N)``: :func:`group_sums` with the activation's zero point, times its scale."""
    qx2 = ax.act_2d(x.values)
    zx = None if x.zero_point is None else jnp.round(ax.act_vec(x.zero_point)).astype(_I32)
    return group_sums(qx2, zx, w, policy, ax.act_vec(x.scale.astype(_F32)))


def group_sums(c, zx, w, policy, row_scale=None):
    """``sum_g scale[g, n] * sum_{k in g} (c[m, k] - zx[m]) (q[k, n] - zw[g, n])`` in float32
    ``(M, N)`` for a ``"kn"`` weight with one scale per group of K: the int32 partial sums
    of all groups from one ``dot_general`` batched over the groups (``(K, N)`` codes are
    ``(G, gs, N)`` as they lie), each with its zero-point corrections, then scaled and
    summed over the groups. The activation's rows are stacked per group without a
    transpose (XLA:CPU's int8 matmul takes row-major operands only). ``row_scale`` (the
    activation's scale, ``(M, 1)`` or scalar) multiplies the group scales first: the
    partial sums times one scale near float32's maximum could overflow.
    """
    nib = w.nibbles
    gs, step = w.qtype.group_size, (2 if nib else 1)
    m, k = c.shape
    g, half = k // gs, gs // step
    n = w.values.shape[1]
    wparts = [p for _, p in dense.parts(w.values.reshape(g, half, n), nib)]  # even, odd rows of K
    pad = max(policy.pad_rows, m)
    dn = (((2,), (1,)), ((0,), (0,)))
    acc = 0
    for i, part in enumerate(wparts):
        xh = c[:, i::step]
        lhs = [xh[r].reshape(g, half) for r in range(m)] + [jnp.zeros((g, half), c.dtype)] * (pad - m)
        acc = acc + lax.dot_general(jnp.stack(lhs, axis=1), part, dn, precision=dense.INT_PRECISION,
                                    preferred_element_type=_I32)[:, :m]
    if zx is not None:  # acc (G, M, N); zx (M, 1); sums, zero point and scale (G, N)
        wsum = w.sums if w.sums is not None else sum(jnp.sum(p, axis=1, dtype=_I32) for p in wparts)
        acc = acc - zx[None] * wsum[:, None, :]
    if w.zero_point is not None:
        zw = jnp.round(w.zero_point).astype(_I32)[:, None, :]
        acc = acc - zw * jnp.sum(c.reshape(m, g, gs), axis=2, dtype=_I32).T[:, :, None]
        if zx is not None:
            acc = acc + zx[None] * zw * gs
    scale = w.scale.astype(_F32)[:, None, :]
    if row_scale is not None:
        scale = scale * row_scale
    return jnp.sum(acc.astype(_F32) * scale, axis=0)
