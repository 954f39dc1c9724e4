"""Outlier transforms of a contraction: per-input-channel smoothing and Hadamard rotation.

For an op ``y = x . w`` contracting ``K`` inputs, a smoothing vector ``s`` (one
positive number per input channel, SmoothQuant / AWQ) and an orthonormal
Hadamard matrix ``H`` (QuaRot) rewrite it as

    x' = (x / s) @ H        w' = H^T @ (s * w)        x' . w' = x . w

exactly in real arithmetic. Outlier channels of ``x`` move into ``w`` (where
per-channel weight scales absorb them) and the rotation spreads what is left
over all channels. The op's qparams hold ``smooth`` (``s`` in the weight's
layout: full length on the contracted axes, size 1 elsewhere, with a leading
axis per stacked layer level) and ``rotate``; :func:`jqt.pack` folds both into
the stored weight once, and the activation is transformed where it is
quantized.

``H`` for ``n = m * 2**a`` inputs is ``H_m (x) H_2 (x) ... (x) H_2``: Sylvester's
construction for the power of two and Paley's for ``m = q + 1`` (``q`` a prime
``= 3 mod 4``: 12, 20, 24, 44, 48, 60, ...), so 384 = 12 x 32, 1536 = 12 x 128
and 14336 = 224 x 64 rotate over all inputs. A size with no such factor rotates
within blocks of its largest power-of-two divisor (block diagonal, still
orthonormal; an odd size, blocks of 1, is not rotated, and calibration warns).
It runs as a few matmuls over a reshaped axis: ``O(n (m + log n))`` per row, not
``O(n^2)``; the smallest factor ``m`` can be large (11008 = 5504 x 2), and above
``LARGE_FACTOR`` calibration says what it costs. The factors are not stored with the
qparams: a rotation is the one this function gives its size, in every release.
"""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np

from . import compat

_MAX_FACTOR = 32  # Sylvester factors are applied in pieces of at most this size
LARGE_FACTOR = 256  # a Paley factor above this is warned about: m products per element


def _is_prime(q):
    return q > 1 and all(q % d for d in range(2, int(math.isqrt(q)) + 1))


@functools.lru_cache(maxsize=None)
def _paley(n) -> np.ndarray:
    """Paley's construction I: a Hadamard matrix of order ``n = q + 1``, ``q`` prime, ``q = 3 mod 4``."""
    q = n - 1
    chi = -np.ones(q, np.int64)  # the quadratic character mod q
    chi[0] = 0
    chi[(np.arange(1, q, dtype=np.int64) ** 2) % q] = 1
    jac = chi[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]  # Jacobsthal: chi(j - i)
    s = np.zeros((n, n), np.int64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jac
    return (np.eye(n, dtype=np.int64) + s).astype(np.float64)


def _sylvester(n) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


@functools.lru_cache(maxsize=None)
def factors(n: int) -> tuple:
    """``(block, (f1, f2, ...))``: the Kronecker factors (sizes) of the rotation of ``n``
    inputs, applied within blocks of ``block`` (``block == n``: one rotation of all
    inputs).

    >>> from jqt._src.transforms import factors
    >>> factors(384), factors(256), factors(10), factors(11008)
    ((384, (12, 32)), (256, (32, 8)), (2, (2,)), (11008, (5504, 2)))
    """
    two = n & -n  # the largest power of two dividing n
    odd = n // two
    m = 1
    if odd > 1:
        m = next((f for f in range(4, n + 1, 4) if n % f == 0 and (n // f) & (n // f - 1) == 0
                  and _is_prime(f - 1) and (f - 1) % 4 == 3), 0)
    block = n if m or odd == 1 else two
    p = block // max(m, 1)
    out = [m] if m > 1 else []
    while p > 1:
        f = min(p, _MAX_FACTOR)
        out.append(f)
        p //= f
    return block, tuple(out)


def _factor_matrix(f: int) -> np.ndarray:
    return _sylvester(f) if f & (f - 1) == 0 else _paley(f)


def hadamard_matrix(n: int) -> np.ndarray:
    """The orthonormal ``n x n`` rotation :func:`rotate` applies (``x @ H``), as a matrix
    (for tests and for reading; :func:`rotate` never builds it).

    >>> import numpy as np
    >>> from jqt._src.transforms import hadamard_matrix
    >>> h = hadamard_matrix(12)
    >>> bool(np.allclose(h @ h.T, np.eye(12)))
    True
    """
    block, fs = factors(n)
    h = np.ones((1, 1))
    for f in fs:
        h = np.kron(h, _factor_matrix(f))
    h = h / math.sqrt(block)
    return np.kron(np.eye(n // block), h)


def _rotate_last(x, n, inverse=False):
    block, fs = factors(n)
    lead = x.shape[:-1]
    y = x.reshape(lead + (n // block,) + fs)
    base = len(lead) + 1
    for j, f in enumerate(fs):
        h = _factor_matrix(f)
        h = jnp.asarray(h.T if inverse else h, x.dtype)
        y = jnp.moveaxis(jnp.tensordot(y, h, axes=([base + j], [0])), -1, base + j)
    return (y * np.asarray(1 / math.sqrt(block), x.dtype)).reshape(lead + (n,))


def rotate(x, axes, inverse=False):
    """``x`` with the vector over ``axes`` (flattened in the order given) multiplied by
    :func:`hadamard_matrix`: ``v -> v @ H``. Applied to an activation over its
    contracted axes and to a weight over its own, it leaves the contraction
    unchanged (``H`` is orthonormal). ``inverse=True`` multiplies by ``H^T`` instead.

    >>> import jax.numpy as jnp
    >>> from jqt._src.transforms import rotate
    >>> x, w = jnp.arange(24.).reshape(2, 12), jnp.ones((12, 3))
    >>> bool(jnp.allclose(rotate(x, (1,)) @ rotate(w, (0,)), x @ w, atol=1e-4))
    True
    """
    axes = tuple(axes)
    if not axes:
        return x
    rest = tuple(d for d in range(x.ndim) if d not in axes)
    perm = rest + axes
    xt = jnp.transpose(x, perm) if perm != tuple(range(x.ndim)) else x
    n = math.prod(x.shape[d] for d in axes)
    y = _rotate_last(xt.reshape(xt.shape[:len(rest)] + (n,)), n, inverse).reshape(xt.shape)
    return jnp.transpose(y, tuple(int(i) for i in np.argsort(perm))) if perm != tuple(range(x.ndim)) else y


def move_contract(v, src, dst, ndim):
    """A keepdims array over the contracted axes ``src`` of one operand -> the same
    numbers keepdims over ``dst`` (the other operand's, paired axis by axis as in
    the op's ``dimension_numbers``) in an array of rank ``ndim``."""
    sq = jnp.reshape(v, [v.shape[d] for d in sorted(src)])
    order = sorted(src)
    v = jnp.transpose(sq, [order.index(d) for d in src])  # in pair order
    ds = sorted(dst)
    v = jnp.transpose(v, [list(dst).index(d) for d in ds])
    shape = [1] * ndim
    for d, n in zip(ds, v.shape):
        shape[d] = n
    return v.reshape(shape)


def applies(site) -> bool:
    """Whether an op can take outlier transforms: a ``dot_general`` with a weight
    operand and no batch axes (dense layers, projections, einsums over heads)."""
    return site.op == "dot_general" and site.weight_operand is not None and not site.batch_axes()


def wanted_stats(rule) -> tuple:
    """The per-input-channel statistics a rule's outlier algorithm needs."""
    if rule is None:
        return ()
    if rule.awq:
        return ("abssum", "count", "hessian")
    if rule.smooth is not None:
        return ("absmax",)
    return ()


def rows(x, contract):
    """``x`` as a 2-D ``(M, K)`` matrix, ``K`` the ``contract`` axes flattened in order."""
    rest = tuple(d for d in range(x.ndim) if d not in contract)
    xt = jnp.transpose(x, rest + tuple(contract))
    return xt.reshape(-1, math.prod(x.shape[d] for d in contract))


def channel_stats(x, w, site, names):
    """Per-input-channel statistics of the activation ``x`` of ``site`` (float32):
    ``absmax`` / ``abssum`` in the weight's layout (keepdims over its contracted
    axes), ``count`` the number of rows, ``hessian`` ``X^T X`` over the contracted
    axes flattened in the op's pair order."""
    wi = site.weight_operand
    xc, wc = site.contract[1 - wi], site.contract[wi]
    x = x.astype(jnp.float32)
    free = tuple(d for d in range(x.ndim) if d not in xc)
    out = {}
    if "absmax" in names:
        out["absmax"] = move_contract(jnp.max(jnp.abs(x), axis=free, keepdims=True, initial=0.0),
                                      xc, wc, w.ndim)  # (initial: no rows, as for an empty slice)
    if "abssum" in names:
        out["abssum"] = move_contract(jnp.sum(jnp.abs(x), axis=free, keepdims=True), xc, wc, w.ndim)
    if "count" in names:
        out["count"] = jnp.float32(math.prod(x.shape[d] for d in free))
    if "hessian" in names:
        r = rows(x, xc)
        out["hessian"] = jnp.matmul(r.T, r, out_sharding=compat.replicated_if_split(r))
    return out


def weight(w, smooth, rotated, contract, depth=0):
    """The weight side: ``H^T (s * w)`` over ``contract`` (operand axes after ``depth``
    stacked axes), in float32 or wider: a 16-bit float weight's product is not rounded to
    its dtype before it is quantized (under ``jax.jit`` XLA may keep it unrounded, and
    :func:`jqt.pack`, which runs eagerly, would round it: other codes)."""
    if smooth is None and not rotated:
        return w
    w = w.astype(jnp.promote_types(w.dtype, jnp.float32))
    if smooth is not None:
        w = w * smooth.astype(w.dtype)
    if rotated:
        w = rotate(w, tuple(a + depth for a in contract))
    return w


def unweight(w, smooth, rotated, contract, depth=0):
    """The inverse of :func:`weight`: rotate back, divide by ``s``."""
    if rotated:
        w = rotate(w, tuple(a + depth for a in contract), inverse=True)
    if smooth is not None:
        w = w / smooth.astype(w.dtype)
    return w


def activation(x, smooth, rotated, x_contract, w_contract):
    """The activation side: ``(x / s) @ H`` over ``x_contract``, in float32 or wider, as
    :func:`weight` (integer activations, counts, as the op promotes them; a 16-bit
    float's quotient or the rotation's partial sums would overflow float16's 65504, and
    bfloat16 would round them before the activation is quantized).

    >>> import jax.numpy as jnp
    >>> activation(jnp.array([[3, 3]]), jnp.array([0.5, 0.5]), False, (1,), (0,)).tolist()
    [[6.0, 6.0]]
    """
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.float32)
    if smooth is not None or rotated:
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if smooth is not None:
        # times the reciprocal, as numerics.quotient: XLA:CPU rewrites a division by a
        # broadcast into this in some programs only, and the ulp between the two moves an
        # activation at a tie to a neighbouring code (jit vs eager, one row vs several)
        s = move_contract(smooth, w_contract, x_contract, x.ndim).astype(x.dtype)
        x = x * (1 / s)
    if rotated:
        x = rotate(x, x_contract)
    return x
