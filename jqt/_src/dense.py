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
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat
from . import nibbledecode
from . import numerics as nx
from .formats import QuantType, unpack_nibbles

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
    def of(dimension_numbers, ndims, w, grouped=False):
        """The axes of a dot_general whose operand ``w`` is the weight, or None when
        the weight has batch axes (then the generic kernel runs). K runs over the
        contracted axes in the order the dot_general pairs them, or, for a ``grouped``
        weight, in the weight's own axis order (:func:`group_order`)."""
        if w is None:
            return None
        (lc, rc), (lb, rb) = dimension_numbers
        wc, wb, xc = (lc, lb, rc) if w == 0 else (rc, rb, lc)
        if wb:
            return None
        if grouped:
            order = group_order(wc)
            wc, xc = [wc[i] for i in order], [xc[i] for i in order]
        free = lambda nd, c: tuple(d for d in range(nd) if d not in c)
        return DenseAxes(free(ndims[1 - w], xc), tuple(xc), free(ndims[w], wc), tuple(wc), w)

    @staticmethod
    def for_weight(contract, ndim, w, grouped=False):
        """The weight half only (what :func:`jqt.pack` needs)."""
        if grouped:
            contract = [contract[i] for i in group_order(contract)]
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
        shape = a.shape[:depth] + self.shape_2d(a.shape[depth:], layout)
        try:
            return compat.reshape(a2, shape)
        except compat.UntypedReshape:
            # a split axis merged under a major one (a row-parallel (H, E, D) projection split
            # over heads, its K (E, H)): those axes gathered, the result split as JAX types
            # it (jqt.packed_shardings places a packed weight as the kernels read it)
            g = len(self.w_free if layout == "nk" else self.w_contract)  # the first group's axes
            minor = [depth + i for i in range(len(perm)) if i not in (0, g)]
            a2 = compat.unsplit(a2, minor)
            # one group at a time: JAX types a merge of one group, not of two at once
            a2 = a2.reshape(a.shape[:depth] + (math.prod(a2.shape[depth:depth + g]),) + a2.shape[depth + g:])
            return a2.reshape(shape)

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
        # both sizes spelled out: with zero rows (an empty batch) -1 would be ambiguous
        # rows, then K: one reshape merging both groups cannot be typed on explicit mesh
        # axes outside jax.set_mesh where the rows are split
        m = math.prod(x.shape[d] for d in self.x_free)
        kept = [x.shape[d] for d in self.x_contract]
        rows = compat.reshape(jnp.transpose(x, self.x_free + self.x_contract), (m, *kept))
        return compat.reshape(rows, (m, math.prod(kept)))

    def act_vec(self, a):
        """A keepdims per-row activation array -> ``(M, 1)`` (scalars stay scalars)."""
        if a is None or a.ndim == 0:
            return a
        return jnp.transpose(a, self.x_free + self.x_contract).reshape(-1, 1)

    def out(self, out2, x_shape, w_shape):
        """``(M, N)`` result -> the dot_general's output layout."""
        xs = [x_shape[d] for d in self.x_free]
        ws = [w_shape[d] for d in self.w_free]
        # M and N unflattened one at a time: a reshape splitting both (a (B, T, D) input times
        # an attention projection (D, H, E)) cannot be typed on explicit mesh axes without a
        # context mesh (jax.set_mesh), where M is split over one axis and N over another
        if self.w == 1:
            return compat.reshape(out2.reshape(xs + [out2.shape[1]]), xs + ws)
        # the transpose kept out of the matmul: XLA:CPU folded it into a float matmul of a
        # decoded weight (w4, nf4: nothing between them) as a dot contracting the weight's
        # first axis, which it runs on a slow generic path (equinox's Linear under two
        # vmaps: several times float32's time), where the transpose is one copy
        t = lax.optimization_barrier(out2).T
        return compat.reshape(t.reshape(ws + [t.shape[1]]), ws + xs)


def group_order(contract):
    """Positions in ``contract`` (a grouped weight's contracted axes, in the order the
    dot_general pairs them) in the order K runs over them: the weight's own axis order,
    so that the axis the groups run along, the innermost contracted one
    (``max(contract)``), varies fastest in K. ``jnp.einsum`` may pair the axes in another
    order (``"bthd,hdm->btm"`` contracts the weight's axes ``(1, 0)``).

    >>> group_order((1, 0)), group_order((0, 2, 1))
    ([1, 0], [0, 2, 1])
    """
    return sorted(range(len(contract)), key=lambda i: contract[i])


def _int_zp(z):
    return None if z is None else jnp.round(z).astype(_I32)


def contract_dim(layout):
    """The contracted (K) axis of a 2-D weight in ``layout`` (``"nk"``: 1, ``"kn"``: 0)."""
    return 1 if layout == "nk" else 0


def unpacked(w2):
    """The int8 codes of a 2-D weight QArray (nibbles unpacked along K)."""
    v = w2.values
    if w2.nibbles:
        v = unpack_nibbles(v, v.ndim - 2 + contract_dim(w2.layout))
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


def rows_kept(x2):
    """The activation codes ``(M, K)`` of a code matmul, as they are: an activation transposed
    here or in ``f`` (``x.T @ w``) had XLA:CPU fold the transpose into the dot, whose int8
    form then ran 13x slower than float and whose bfloat16 one (many rows) failed on
    AVX512_BF16 CPUs ("Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32")."""
    return lax.optimization_barrier(x2)


def int_matmul(x2, w2, layout, pad_rows):
    """int8 ``(M, K)`` x int8 weight in ``layout`` -> int32 ``(M, N)``; rows padded to ``pad_rows``."""
    x2 = rows_kept(x2)
    m = x2.shape[0]
    if isinstance(m, int) and m < pad_rows:  # a symbolic row count (jax.export) is not padded
        x2 = jnp.pad(x2, ((0, pad_rows - m), (0, 0)))
    dn = (((1,), (contract_dim(layout),)), ((), ()))
    return lax.dot_general(x2, w2, dn, precision=INT_PRECISION, preferred_element_type=_I32)[:m]


def int_dense(ax, x, w, policy):
    """Integer matmul with zero-point corrections and rescale to float ``(M, N)``.

    ``x``: a QArray of int8 codes in operand layout; ``w``: from
    :func:`weight_in_layout` (``"nk"``), its ``sums`` the ``(N,)`` int32 sum over
    K or None to compute it.

    When the worst case of the int32 accumulator (:func:`safe_k`) could overflow
    over K, the contraction runs in chunks of K that cannot, each converted to
    float32 and summed.
    """
    qw = unpacked(w)
    qx2 = ax.act_2d(x.values)
    zx, zw = _int_zp(ax.act_vec(x.zero_point)), _int_zp(w.zero_point)
    k, kd = qx2.shape[1], contract_dim(w.layout)
    kc = safe_k(qx2.dtype, zx is not None, qw.dtype, zw is not None)
    if not isinstance(k, int) or k <= kc:
        acc = _int_dense_acc(qx2, qw, w.layout, zx, zw, w.sums, policy).astype(_F32)
    else:
        acc = sum(_int_dense_acc(qx2[:, lo:hi], lax.slice_in_dim(qw, lo, hi, axis=kd), w.layout,
                                 zx, zw, None, policy).astype(_F32)
                  for lo, hi in chunks(k, kc))
    # the scales' product first: acc * scale_x alone can overflow float32 when the
    # activation's range is near float32's maximum
    return scaled(acc, ax.act_vec(x.scale.astype(_F32)), w.scale.astype(_F32))


def codes_as_bfloat16(x2, w2, layout, policy, zx=None):
    """int8 / uint8 codes ``(M, K)``, less their integer zero point ``zx`` where given, x a
    weight in ``layout`` -> float32 ``(M, N)`` through one bfloat16 matmul, where
    ``policy.int_as_bfloat16_rows`` says so for ``M`` rows, or None. bfloat16 holds every
    integer in [-256, 256] exactly, so the products are exact; the sums are float32, exact
    while they stay below 2**24 and rounded as a float matmul's beyond. The zero point is
    subtracted first: the raw codes' sums (a zero point near the top code, values near it) grow
    with K past 2**24, and subtracting ``zx * sum(w)`` after them cancelled most of a
    rounded sum (errors of 6e-3 of the output at K = 4096). XLA:CPU's bfloat16 matmul with
    float32 accumulation outruns its int8 one at many rows, for a weight whose float32
    copy fits ``policy.large_weight_bytes`` (docs/performance.md)."""
    m, top = x2.shape[0], policy.int_as_bfloat16_rows
    if not (top and isinstance(m, int) and m > top):
        return None
    if policy.large_weight_bytes and 4 * w2.size > policy.large_weight_bytes:
        return None  # its 16-bit copy, made every call, does not fit the cache
    x2 = rows_kept(x2)
    if zx is not None:
        x2 = x2.astype(jnp.int16) - zx.astype(jnp.int16)  # in [-255, 255]
    dn = (((1,), (contract_dim(layout),)), ((), ()))
    return lax.dot_general(x2.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), dn, precision=INT_PRECISION,
                           preferred_element_type=_F32)


def _int_dense_acc(qx2, qw, layout, zx, zw, wsum, policy):
    """``sum_k (qx - zx)(qw - zw)`` in int32 (the caller keeps K short enough), or in
    float32 from a bfloat16 matmul of the codes less ``zx`` (:func:`codes_as_bfloat16`)."""
    acc = codes_as_bfloat16(qx2, qw, layout, policy, zx)
    centred = acc is not None  # the activation's zero point is subtracted already
    if acc is None:
        acc = int_matmul(qx2, qw, layout, policy.pad_rows)
    if zx is not None and not centred:
        wsum = wsum if wsum is not None else jnp.sum(qw, axis=contract_dim(layout), dtype=_I32)
        acc = acc - zx * wsum
    if zw is not None:
        acc = acc - zw * jnp.sum(qx2, axis=1, keepdims=True, dtype=_I32)
    if zx is not None and zw is not None:
        acc = acc + zx * zw * qx2.shape[1]
    return acc


_I32_MAX = 2 ** 31 - 1


def safe_k(a_dtype, a_zp: bool, b_dtype, b_zp: bool) -> int:
    """The longest contraction whose int32 accumulator cannot overflow, for codes of
    these integer dtypes, or in the code range of these :class:`QuantType` s (and zero
    points, in their range, when ``*_zp``): every partial sum of
    ``sum qa*qb - za*sum qb - zb*sum qa + K*za*zb`` is at most
    ``(|qa| + |za|) * (|qb| + |zb|) * K``.

    >>> import numpy as np, jqt
    >>> safe_k(np.int8, False, np.int8, False)  # (2**31 - 1) // (128 * 128)
    131071
    >>> safe_k(np.int8, True, np.int8, False)
    65535
    >>> safe_k(np.int8, True, jqt.QuantType(bits=4), False)  # int4 codes: |q| <= 8
    1048575
    """
    def bound(t, zp):
        if isinstance(t, QuantType):
            lo, hi = t.qmin, t.qmax
        else:
            info = np.iinfo(t)
            lo, hi = info.min, info.max
        a = max(-int(lo), int(hi))
        return 2 * a if zp else a
    # (a QuantType by its kind: int3, int5, int6 and int7 are no NumPy dtypes)
    ints = [t.kind == "int" if isinstance(t, QuantType) else jnp.issubdtype(t, jnp.integer)
            for t in (a_dtype, b_dtype)]
    if not all(ints):
        return sys.maxsize  # float accumulation (fp8 codes upcast) does not wrap
    return _I32_MAX // (bound(a_dtype, a_zp) * bound(b_dtype, b_zp))


def chunks(k: int, kc: int) -> list:
    """``[(lo, hi), ...]``: ``range(k)`` in the fewest chunks of at most ``kc``, of
    near-equal lengths.

    >>> chunks(10, 4)
    [(0, 3), (3, 6), (6, 10)]
    """
    n = -(-k // kc)
    bounds = [k * i // n for i in range(n + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(n)]


def int_dense_grouped(ax, x, w, policy):
    """int8 activation x int4 (or int8) weight with one scale per group of K: one 2-D
    int8 matmul per group (int32 partial sums), each scaled per output channel and
    summed in float. ``w``: codes ``"nk"`` ``(N, K)`` with scale and zero point ``(N, G)``,
    or ``"kn"`` ``(K, N)`` with ``(G, N)``. (At few rows ``gemv.int_grouped`` runs all
    groups as one batched dot instead.)"""
    nib = w.nibbles
    qx2 = ax.act_2d(x.values)
    v = nx.after(w.values, qx2) if policy.decode_after_input else w.values
    halves = parts(v, nib)  # nibble halves: even and odd inputs, no interleaving
    step = len(halves)
    gs = w.qtype.group_size
    kd = contract_dim(w.layout)
    k = w.values.shape[kd] * step
    zx, zw = _int_zp(ax.act_vec(x.zero_point)), _int_zp(w.zero_point)
    scale = w.scale.astype(_F32)
    sx = ax.act_vec(x.scale.astype(_F32))  # multiplies the group scales first (no overflow)
    per_group = (lambda a, g: a[:, g]) if kd == 1 else (lambda a, g: a[g])  # (N, G) or (G, N)
    out = 0.0
    for g in range(k // gs):
        cols, half = slice(g * gs, (g + 1) * gs), slice(g * gs // step, (g + 1) * gs // step)
        xg = qx2[:, cols]
        wg = [(r, lax.slice_in_dim(c, half.start, half.stop, axis=kd)) for r, c in halves]
        acc = sum(int_matmul(xg[:, r], c, w.layout, policy.pad_rows) for r, c in wg)
        if zx is not None:
            wsum = per_group(w.sums, g) if w.sums is not None else sum(
                jnp.sum(c, axis=kd, dtype=_I32) for _, c in wg)
            acc = acc - zx * wsum
        if zw is not None:
            acc = acc - per_group(zw, g) * jnp.sum(xg, axis=1, keepdims=True, dtype=_I32)
            if zx is not None:
                acc = acc + zx * per_group(zw, g) * gs
        out = out + scaled(acc.astype(_F32), sx, per_group(scale, g))
    return out


def int_codes_as_float(ax, x, w, policy):
    """int8 activation x grouped int weight (or int16 codes x an int weight, w8a16 under
    ``policy.int16_as_float``) as a float matmul: the activation codes minus
    their zero point upcast (exact), the weight decoded with its group scales as on the
    weight-only path (K-chunks, whole: :func:`decodes_whole`, or one sum over K at few
    rows: :func:`reduces`), the activation's scale split around it (:func:`split_scale`;
    a single one folded into the weight's scales). Equal to :func:`int_dense_grouped`
    up to float rounding; beyond a few rows one matmul per chunk beats a small one per
    group (:func:`grouped_as_float`)."""
    w, lo, hi = _act_scale_around(ax, x, w)  # no overflow the real op has not
    return weight_only_2d(float_codes(ax, x) * lo, w, policy, None) * hi


def int16_halves(q):
    """An int16 activation's codes (a :class:`jqt.QArray`, symmetric) -> its int8 halves
    ``(hi, lo)`` with ``q = 256 * hi + (lo + 128)`` (``lo``'s zero point -128; both keep
    the int16 type): an int16 x int8 contraction as two int8 x int8 ones, ``256 * op(hi) +
    op(lo)`` in float32 (each cast first lost the result where they cancel: -2 is
    ``256 * -1 + 254``), neither of which can overflow int32 the way an int16 x int8 one
    can."""
    hi, lo = nx.split_int16(q.values)
    return (dataclasses.replace(q, values=hi, zero_point=None),
            dataclasses.replace(q, values=lo, zero_point=jnp.float32(-128.0)))


def split_scale(sx):
    """An activation's scale -> ``(lo, hi)`` with ``lo * hi == sx``: ``lo = min(sx, 1)``
    multiplies the codes before a matmul with a decoded (scaled) weight, ``hi`` its
    output. Every intermediate then stays within the real products' magnitude, whether
    the activation's scale or the weight's is near float32's maximum (codes times a
    decoded weight overflow for the one, codes times the activation's scale times a
    weight's codes for the other); ``hi`` is exactly 1 below 1.

    >>> import jax.numpy as jnp
    >>> [v.tolist() for v in split_scale(jnp.array([0.25, 4.0]))]
    [[0.25, 1.0], [1.0, 4.0]]
    """
    lo = jnp.minimum(sx, 1.0)
    return lo, sx / lo


def _act_scale_around(ax, x, w):
    """:func:`split_scale` of the activation's scale for a matmul of its codes with the
    decoded ``w``: ``(w, lo, hi)``, ``lo`` for the codes and ``hi`` for the output. One
    scale (static, per tensor) goes into the weight's scales instead (``lo`` is then 1),
    which saves a pass over the activation at many rows, except where a folded scale would
    fall below float32's normal range (a weight of 1e-31 times an activation scale of
    1e-3: flushed to 0, every output 0); ``lo`` then stays on the codes."""
    lo, hi = split_scale(ax.act_vec(x.scale.astype(_F32)))
    if lo.size == 1:
        s, lo = w.scale.astype(_F32), lo.reshape(())
        folded = s * lo
        fine = jnp.all((jnp.abs(folded) >= jnp.finfo(_F32).tiny) | (s == 0))
        return dataclasses.replace(w, scale=jnp.where(fine, folded, s)), jnp.where(fine, 1.0, lo), hi
    return w, lo, hi


def float_codes(ax, x):
    """An int activation's codes minus its zero point (an fp8 one's values), as float32
    rows ``(M, K)`` (exact for codes of 16 bits or fewer)."""
    qx2 = nx.decode(ax.act_2d(x.values), x.qtype.grid)
    if x.zero_point is not None:
        qx2 = qx2 - jnp.round(ax.act_vec(x.zero_point).astype(_F32))
    return qx2


_SAFE_PRESETS = ("DEFAULT", "BF16_BF16_F32", "TF32_TF32_F32", "F32_F32_F32", "F64_F64_F64")
INT_PRECISION = (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
"""The precision of jqt's integer dots and dots over bfloat16 codes (exact operands): explicit,
so that no ``jax.default_matmul_precision`` preset reaches them."""


def code_precision(precision=None):
    """The precision of a float dot or convolution jqt runs over codes (or fp8 values in
    units of their scale, or decoded weights), scaled after the sum: the op's own
    (``None``: ``jax.default_matmul_precision``'s), except a dot algorithm preset with
    float16 or 8-bit operands or sums narrower than float32 (``F16_F16_F16``), where
    codes times activations overflow (fp8 units reach 114688): ``DEFAULT`` in its place.

    >>> from jax import lax
    >>> code_precision(lax.DotAlgorithmPreset.F16_F16_F16) == (lax.Precision.DEFAULT,) * 2
    True
    >>> code_precision(lax.DotAlgorithmPreset.F32_F32_F32) == lax.DotAlgorithmPreset.F32_F32_F32
    True
    >>> code_precision(None) is None   # (no preset set globally)
    True
    """
    if precision is None:
        name = jax.config.jax_default_matmul_precision
        unsafe = (isinstance(name, str) and name in lax.DotAlgorithmPreset.__members__
                  and not name.startswith(_SAFE_PRESETS))
        return INT_PRECISION if unsafe else None
    if isinstance(precision, lax.DotAlgorithmPreset) and not precision.name.startswith(_SAFE_PRESETS):
        return INT_PRECISION
    return precision


def scaled(out, *scales):
    """``out`` times the product of ``scales`` (broadcastable to it), the product first
    (the accumulator times one large scale can overflow); where that product is below
    float32's normal range (two small scales: flushed to 0) or above its maximum (two
    large ones, such as the ones ``jqt.qat.project`` puts in place of infinite scales: a
    zero accumulator would give inf x 0 = NaN), the scales one after the other, behind
    barriers (XLA folds two factors into one).

    >>> import jax.numpy as jnp
    >>> y = scaled(jnp.float32(2e11), jnp.float32(1e-4), jnp.float32(5e-35))  # 1e-39 flushed
    >>> bool(abs(float(y) / 1e-27 - 1) < 1e-6)
    True
    >>> float(scaled(jnp.float32(0), jnp.float32(1e36), jnp.float32(1e36)))  # 1e72: inf
    0.0
    """
    factor = scales[0]
    for s in scales[1:]:
        factor = factor * s
    if len(scales) == 1:
        return out * factor
    apart = out
    for s in scales:
        apart = lax.optimization_barrier(apart * s)
    size = jnp.abs(factor)
    fine = (size >= jnp.finfo(_F32).tiny) & (size <= jnp.finfo(_F32).max)
    return jnp.where(fine, out * factor, apart)  # (a 0 scale: 0 both ways)


def fp8_dense(ax, x, w, policy):
    """fp8 activation x fp8 weight: one fp8 matmul with float32 accumulation where the
    backend has it (``policy.fp8_native``) and the weight has one scale per output channel
    (a grouped weight's scales vary along K, inside that sum), else the weight-only path on
    the upcast (exact) activation; then both scales."""
    x2 = ax.act_2d(x.values)
    if policy.fp8_native and not w.qtype.group_size:
        dn = (((1,), (contract_dim(w.layout),)), ((), ()))
        out = lax.dot_general(x2, w.values, dn, precision=code_precision(), preferred_element_type=_F32)
        return scaled(out, ax.act_vec(x.scale.astype(_F32)), w.scale.astype(_F32))
    if fp8_as_bfloat16(x2.shape[0], w, policy):
        return _fp8_bfloat16(ax, x, x2, w, policy)
    w, lo, hi = _act_scale_around(ax, x, w)  # as in int_codes_as_float
    return weight_only_2d(nx.decode(x2, x.qtype.grid) * lo, w, policy, None) * hi


def fp8_as_bfloat16(m, w, policy) -> bool:
    """Whether an fp8 x fp8 op of ``m`` rows runs as one bfloat16 matmul
    (:func:`_fp8_bfloat16`): more than ``policy.fp8_as_bfloat16_rows`` rows (a symbolic
    count does not) and one scale per output channel; for a weight whose float32 copy
    exceeds ``policy.large_weight_bytes``, more than ``policy.large_weight_rows`` rows too
    (below, its float32 K-chunks in cache outrun a whole 16-bit copy made every call).

    >>> import jax.numpy as jnp, jqt
    >>> from jqt._src.qparams import QArray
    >>> w = QArray(values=jnp.zeros((4, 4), jnp.float8_e4m3fn), scale=jnp.ones((4,)),
    ...            qtype=jqt.QuantType(dtype="float8_e4m3fn", per_channel=True), layout="kn")
    >>> p = jqt.KernelPolicy(fp8_as_bfloat16_rows=8, large_weight_bytes=64, large_weight_rows=16)
    >>> fp8_as_bfloat16(9, w, p), fp8_as_bfloat16(8, w, p), fp8_as_bfloat16(-1, w, p)
    (True, False, False)
    >>> w9 = QArray(values=jnp.zeros((4, 9), jnp.float8_e4m3fn), scale=jnp.ones((9,)),
    ...             qtype=w.qtype, layout="kn")  # 144 bytes as float32
    >>> fp8_as_bfloat16(16, w9, p), fp8_as_bfloat16(17, w9, p)
    (False, True)
    """
    top = policy.fp8_as_bfloat16_rows
    if not (top and isinstance(m, int) and m > top) or w.qtype.group_size:
        return False
    large = policy.large_weight_bytes and 4 * w.values.size > policy.large_weight_bytes
    return not large or m > policy.large_weight_rows


def _fp8_bfloat16(ax, x, x2, w, policy):
    """fp8 activation ``x`` (codes ``x2``, ``(M, K)``) x fp8 weight as one bfloat16 matmul
    with float32 sums: the activation's fp8 values and the weight's
    :func:`numerics.fp8_units` (at most 4 significant bits, within bfloat16's exponent
    range: exact), so the products are exact and the sums float32, as on the float32 path
    this replaces (the decoded weight's copy half its bytes; XLA:CPU's bfloat16 matmul the
    faster one where the CPU has AVX512_BF16 or AMX-BF16). The weight is decoded after
    its input exists (``policy.decode_after_input``). The scales apply as on the float32
    path (:func:`_act_scale_around`: a per-tensor activation scale's ``lo`` folded into
    the weight's scales, a per-row one's multiplying the output), so that no product of
    two scales exceeds the real products' magnitude where one is near float32's maximum
    (with both units on the output, XLA combined them into one infinite factor for an
    e5m2 weight range of 3.3e38)."""
    w, lo, hi = _act_scale_around(ax, x, w)
    v = lax.bitcast_convert_type(w.values, jnp.uint8)
    v = nx.after(v, x2) if policy.decode_after_input else v
    wb = nx.fp8_units(v, w.qtype.grid).astype(jnp.bfloat16)
    dn = (((1,), (contract_dim(w.layout),)), ((), ()))
    out = lax.dot_general(nx.decode(rows_kept(x2), x.qtype.grid).astype(jnp.bfloat16), wb, dn,
                          precision=INT_PRECISION, preferred_element_type=_F32)
    return out * lo * (w.scale.astype(_F32) * nx.FP8_BITS_UNIT[w.qtype.grid]) * hi


def chunk_size(k, target, multiple=1):
    """A divisor of ``k`` that is a multiple of ``multiple``, in ``[target / 4, target]``, or 0
    when none is (or none is needed)."""
    if not target or k <= target:
        return 0
    for c in range(target - target % multiple, max(target // 4, 1) - 1, -multiple):
        if c > 0 and k % c == 0:
            return c
    return 0


def parts(v, nib):
    """Codes along K -> ``[(K rows, codes)]``: with two nibbles per byte the low nibbles
    hold the even rows of K and the high nibbles the odd ones, so each half multiplies
    a strided slice of the (small) activation and no interleaved copy of the weight is
    made. The integer paths use it: their int8 codes are not decoded further, and two
    constant shifts of contiguous bytes run about 4x faster on XLA:CPU than the broadcast
    shift of :func:`nibble_rows` (which the float decode hides behind its convert)."""
    if not nib:
        return [(slice(None), v)]
    b = v.astype(jnp.int8)
    return [(slice(0, None, 2), jnp.left_shift(b, 4) >> 4),  # arithmetic shifts sign-extend
            (slice(1, None, 2), b >> 4)]


def decode_rows(codes, w, scale, zp, kd, rows_per_group, dtype=_F32):
    """Codes of a block of K rows -> float32 weight: grid value (int, nf4 table, fp8 bits),
    minus the group zero point, times the group scale (both broadcast over each group's
    ``rows_per_group`` rows by a reshape, not a repeat). ``dtype`` (:func:`decode_dtype`):
    int codes without group scales are cast to it; a weight with group scales is decoded
    in float32 and rounded to it."""
    grid = w.qtype.grid
    if grid == "nf4":
        v = nx.decode(codes, grid)
    elif w.qtype.kind == "float":
        v = nx.fp8_units(codes, grid)
    else:
        v = codes.astype(_F32 if rows_per_group else dtype)
    if not rows_per_group:
        return v
    shp = v.shape
    groups = shp[kd] // rows_per_group
    if groups % compat.split_count(v, kd):
        # K split over explicit mesh axes through the groups (fewer groups than parts, the
        # "in" rule's replicated scales): no reshape into groups there, so each group's
        # scale and zero point are repeated over its rows, which keep their split
        r = lambda a: jnp.repeat(a.astype(_F32), rows_per_group, axis=kd, total_repeat_length=shp[kd])
        if zp is not None:
            v = v - jnp.round(r(zp))
        return (v * r(scale)).astype(dtype)
    split = shp[:kd] + (groups, rows_per_group) + shp[kd + 1:]
    g = lambda a: jnp.expand_dims(a.astype(_F32), kd + 1)
    v = v.reshape(split)
    if zp is not None:
        v = v - jnp.round(g(zp))
    return (v * g(scale)).reshape(shp).astype(dtype)


def many_rows(m, policy, float_bytes=0) -> bool:
    """Whether ``m`` rows (an int, or symbolic) are more than ``policy.float_matmul_rows``
    (more than ``policy.large_weight_rows`` for a weight whose float32 copy, of
    ``float_bytes``, exceeds ``policy.large_weight_bytes``): then the whole weight is
    decoded once for one float matmul, whose arithmetic outweighs the decoding (fewer
    rows cast it chunk by chunk, in cache).

    >>> import jqt
    >>> cpu = jqt.KernelPolicy.for_backend("cpu")
    >>> many_rows(128, cpu, 4 * 1024 * 2816), many_rows(128, cpu, 4 * 4096 * 4096)
    (True, False)
    >>> many_rows(257, cpu, 4 * 4096 * 4096), many_rows(None, cpu)
    (True, False)
    """
    top = policy.float_matmul_rows
    if policy.large_weight_bytes and float_bytes > policy.large_weight_bytes:
        top = max(top, policy.large_weight_rows)
    return bool(policy.float_matmul_rows) and isinstance(m, int) and m > top


def decodes_whole(m, w2, policy) -> bool:
    """Whether a 2-D weight QArray is decoded whole for one float matmul at ``m`` rows:
    :func:`many_rows`, or a weight whose float32 copy fits ``policy.whole_decode_bytes``
    (a small weight does not repay K-chunks' loop and sum)."""
    float_bytes = 4 * w2.values.size * (2 if w2.nibbles else 1)
    return many_rows(m, policy, float_bytes) or float_bytes <= policy.whole_decode_bytes


def grouped_as_float(m, w2, policy) -> bool:
    """Whether int8 activations with a grouped int weight (w4a8 g128) at ``m`` rows run
    as a float matmul on their upcast codes (:func:`int_codes_as_float`) instead of one
    int8 matmul per group: under ``policy.grouped_float``, for groups smaller than
    ``policy.grouped_int_min_group``, :func:`decodes_whole`, or more than
    ``policy.grouped_int_rows`` rows (``m = -1``, a symbolic count: int8 per group, for
    groups of at least ``grouped_int_min_group``)."""
    top = policy.grouped_int_rows
    return (policy.grouped_float or policy.small_groups(w2.qtype) or decodes_whole(m, w2, policy)
            or bool(top) and m > top)


def _many_rows_block(n, m, policy):
    """The block of output channels (of ``n``) in which a weight is decoded for an op of
    ``m`` (many) rows: ``policy.many_rows_block`` up to ``policy.whole_decode_rows`` rows,
    at most half of ``n`` so that every decode runs inside a loop; 0: the whole weight at
    once."""
    b, top = policy.many_rows_block, policy.whole_decode_rows
    return min(b, n // 2) if b and not (top and m > top) else 0


def nibble_rows(codes, kd):
    """Codes with two nibbles per byte along axis ``kd`` -> int8 codes with a new axis of 2
    at ``kd``: ``[0]`` the low nibbles (the even rows of K), ``[1]`` the high ones (the odd
    rows), from one shift of a broadcast (no concatenation, no interleaving copy). With
    that axis merged into the next, K runs in the order of :func:`k_order` (the
    ``policy.nibble_halves`` formulation; by default :func:`interleaved_nibbles` keeps
    K's own order).

    >>> import numpy as np
    >>> nibble_rows(np.array([[0x21, 0xF3]], np.uint8), 1).tolist()  # K = [1, 2, 3, -1]
    [[[1, 3], [2, -1]]]
    """
    b = jnp.expand_dims(codes.astype(jnp.int8), kd)
    shift = jnp.asarray([4, 0], jnp.int8).reshape((2,) + (1,) * (b.ndim - kd - 1))
    return jnp.left_shift(b, shift) >> 4  # arithmetic shifts sign-extend


def interleaved_nibbles(codes, kd):
    """Codes with two nibbles per byte along axis ``kd`` -> int8 codes with that axis twice
    as long, in K's own order (row ``2r`` the low nibble of byte row ``r``, row ``2r + 1``
    its high one), from one shift of a broadcast along a new axis after ``kd`` merged by a
    reshape (a bitcast): the activation is read as it is, where :func:`nibble_rows`' order
    makes every matmul copy its activation into :func:`k_order` first (all-MiniLM-L6-v2
    at batch 8 under ``w4`` g128: 1.00x float32 against 1.08x, ``benchmarks/formats.py
    --only minilm --ab nibble_halves=1``).

    >>> import numpy as np
    >>> interleaved_nibbles(np.array([[0x21, 0xF3]], np.uint8), 1).tolist()  # K = [1, 2, 3, -1]
    [[1, 2, 3, -1]]
    """
    b = jnp.expand_dims(codes.astype(jnp.int8), kd + 1)
    shift = jnp.asarray([4, 0], jnp.int8).reshape((2,) + (1,) * (b.ndim - kd - 2))
    v = jnp.left_shift(b, shift) >> 4  # arithmetic shifts sign-extend
    return v.reshape(codes.shape[:kd] + (2 * codes.shape[kd],) + codes.shape[kd + 1:])


def k_order(x2, halves, nc=1):
    """The activation ``(M, K)`` as ``nc`` K-chunks ``(nc, M, K / nc)``; with ``halves``
    each chunk's columns run even rows of K first, then odd ones, the order in which
    :func:`nibble_rows` decodes a chunk of packed codes (so that a chunk is one matmul)."""
    m, k = x2.shape
    if not halves:
        return x2.reshape(m, nc, k // nc).transpose(1, 0, 2)
    return x2.reshape(m, nc, k // nc // 2, 2).transpose(1, 0, 3, 2).reshape(nc, m, k // nc)


def decode_dtype(x_dtype, w, policy, m=None):
    """The dtype a weight-only op of ``m`` rows decodes ``w`` to: the activation's 16-bit
    float dtype where ``policy.decode_in_input_dtype`` allows it, for per-channel int
    codes of at most 8 bits (exact) and, above ``policy.float_matmul_rows`` rows, for
    weights with group scales (decoded in float32, then rounded to it, as the simulated
    path rounds a weight of that dtype; at fewer rows XLA:CPU's 16-bit matmul is the
    slower one); float32 otherwise (per-channel NF4 and fp8, whose float16 units can
    overflow).

    >>> import jax.numpy as jnp, jqt
    >>> from jqt._src.qparams import QArray
    >>> w = QArray(values=jnp.zeros((4, 4), jnp.int8), scale=jnp.ones((4,)),
    ...            qtype=jqt.QuantType(bits=8, per_channel=True), layout="kn")
    >>> p = jqt.KernelPolicy(decode_in_input_dtype=True)  # the CPU table's with AVX512_BF16
    >>> decode_dtype(jnp.bfloat16, w, p).__name__, decode_dtype(jnp.float32, w, p).__name__
    ('bfloat16', 'float32')
    """
    q = w.qtype
    exact = q.kind == "int" and q.grid == "int" and q.bits <= 8 and not q.group_size
    grouped = q.group_size and isinstance(m, int) and m > policy.float_matmul_rows
    if policy.decode_in_input_dtype and (exact or grouped) \
            and jnp.dtype(x_dtype) in (jnp.bfloat16, jnp.float16):
        return jnp.dtype(x_dtype).type
    return _F32


def exact_cast(w, dtype) -> bool:
    """Whether ``w`` decodes to ``dtype`` by one exact cast of its codes: per-channel int
    codes of 8 bits, one to a byte (no group scales, no nibbles), to a 16-bit float
    (``policy.cast_in_gemm`` leaves that cast free for the backend's GEMM to fuse).

    >>> import jax.numpy as jnp, jqt
    >>> from jqt._src.qparams import QArray
    >>> w = QArray(values=jnp.zeros((4, 4), jnp.int8), scale=jnp.ones((4,)),
    ...            qtype=jqt.QuantType(bits=8, per_channel=True), layout="nk")
    >>> exact_cast(w, jnp.bfloat16), exact_cast(w, jnp.float32)
    (True, False)
    """
    q = w.qtype
    return (q.kind == "int" and q.grid == "int" and not q.group_size and not w.nibbles
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _decode_k(codes, w, scale, zp, kd, rows, nib, dtype=_F32, halves=False):
    """:func:`decode_rows` of a block of codes (K along ``kd``), with nibbles unpacked by
    :func:`interleaved_nibbles` (K in its own order), or with ``halves`` by
    :func:`nibble_rows` (K in the order of :func:`k_order`). ``rows``: rows of the codes
    per group."""
    if not nib:
        return decode_rows(codes, w, scale, zp, kd, rows, dtype)
    if not halves:
        return decode_rows(interleaved_nibbles(codes, kd), w, scale, zp, kd, 2 * rows, dtype)
    e = lambda a: None if a is None else jnp.expand_dims(a, kd)  # the same group scale for both
    v = decode_rows(nibble_rows(codes, kd), w, e(scale), e(zp), kd + 1, rows, dtype)
    return v.reshape(codes.shape[:kd] + (2 * codes.shape[kd],) + codes.shape[kd + 1:])


def reduces(m, policy) -> bool:
    """Whether an op of ``m`` rows whose weight is decoded to float runs as one elementwise
    product and sum over K (``policy.reduce_rows``) instead of a matmul.

    >>> import dataclasses, jqt
    >>> p = dataclasses.replace(jqt.KernelPolicy(), reduce_rows=4)
    >>> reduces(1, p), reduces(5, p), reduces(-1, p), reduces(1, jqt.KernelPolicy())
    (True, False, False, False)
    """
    return isinstance(m, int) and 0 < m <= policy.reduce_rows


def weight_only_2d(x2, w, policy, precision):
    """``x2 (M, K) @ w`` for a 2-D weight QArray, in float32 (see :func:`weight_only_dense`)."""
    m, k = x2.shape
    q = w.qtype
    gs = q.group_size
    nib = w.nibbles
    kd = contract_dim(w.layout)
    v = w.values
    unit = 1.0
    if q.kind == "float":  # fp8 bits, decoded with integer ops (outside the scan: one bitcast)
        v, unit = lax.bitcast_convert_type(v, jnp.uint8), nx.FP8_BITS_UNIT[q.grid]
    scale = w.scale.astype(_F32) * unit if gs else None
    zp = w.zero_point if gs else None
    step = 2 if nib else 1
    rows = gs // step if gs else 0  # rows of the codes per group
    n = v.shape[0] if w.layout == "nk" else v.shape[1]
    many = decodes_whole(m, w, policy)
    target = _many_rows_block(n, m, policy) if many else policy.weight_only_chunk
    chunk = chunk_size(k, target, math.lcm(max(gs, 1), step)) if w.layout == "kn" and not many else 0
    n_chunk = chunk_size(n, target) if w.layout == "nk" or many else 0
    if chunk and not reduces(m, policy) and 4 * chunk * n > policy.weight_only_block_bytes > 0:
        chunk, n_chunk = 0, min(n, max(policy.weight_only_block_bytes // (4 * k), 128))  # column blocks
    if 1 in compat.sharded_dims(x2) or kd in compat.sharded_dims(v):
        # K typed split over explicit mesh axes (a row-parallel layer): a scan cannot cut it
        # into chunks, and a block of output channels cut from a split N is not typed either
        chunk = 0
        n_chunk = 0 if (1 - kd) in compat.sharded_dims(v) else n_chunk
    dot = lambda a, b: lax.dot_general(a, b, (((1,), (kd,)), ((), ())), precision=code_precision(precision),
                                       preferred_element_type=_F32)
    dt = decode_dtype(x2.dtype, w, policy, m)
    if dt != _F32:
        # XLA:CPU runs a 16-bit dot into float32 with its operands as laid out: a transpose
        # of the activation folded into the dot (contracting its dim 0: a weight on the
        # left, w @ x) ended in "Unsupported element type for DotThunk". The barrier keeps
        # the (M, K) activation as written.
        x2 = lax.optimization_barrier(x2)
    halves = nib and policy.nibble_halves
    dec = lambda c, sc, zc: _decode_k(c, w, sc, zc, kd, rows, nib, dt, halves)
    if reduces(m, policy):  # one product and sum over K, which XLA:GPU fuses with the decode
        x, terms = x2.astype(_F32), 0
        for ks, c in parts(v, nib):  # two nibbles: K's even rows and odd rows, each elementwise
            wf, xs = decode_rows(c, w, scale, zp, kd, rows, _F32), x[:, ks]
            terms = terms + (xs[:, :, None] * wf[None] if kd == 0 else xs[:, None, :] * wf[None])
        out = jnp.sum(terms, axis=1 + kd)
    elif chunk:  # K-chunks, each decoded in cache, one matmul each, summed
        nc = k // chunk
        per = lambda a: None if a is None else a.reshape(nc, chunk // gs, n)

        def body(acc, xw):
            xc, vc, sc, zc = xw
            return acc + dot(xc, dec(vc, sc, zc)), None

        ins = (k_order(x2, halves, nc), v.reshape(nc, chunk // step, n), per(scale), per(zp))
        out, _ = lax.scan(body, jnp.zeros((m, n), _F32), ins)
    else:
        xk = k_order(x2, halves)[0]
        if n_chunk:  # blocks of output channels, each decoded in cache, written in place
            def block(start, size):  # the weight's output-channel axis is the other one, 1 - kd
                cut = lambda a: None if a is None else lax.dynamic_slice_in_dim(a, start, size, 1 - kd)
                return dot(xk, dec(cut(v), cut(scale), cut(zp)))

            full = n // n_chunk * n_chunk
            out = lax.fori_loop(0, n // n_chunk, lambda i, out: lax.dynamic_update_slice_in_dim(
                out, block(i * n_chunk, n_chunk), i * n_chunk, 1), jnp.zeros((m, n), _F32))
            if full < n:  # the last, shorter block
                out = lax.dynamic_update_slice_in_dim(out, block(full, n - full), full, 1)
        else:
            tie = policy.decode_after_input and not (policy.cast_in_gemm and exact_cast(w, dt))
            if not halves and nibbledecode.applies(w, dt, policy):  # jqt's native decode
                out = dot(xk, nibbledecode.decode(v, w, after=xk if tie else None))
            else:
                out = dot(xk, dec(nx.after(v, xk) if tie else v, scale, zp))
    if gs:
        return out
    if w.zero_point is not None:
        out = out - jnp.round(w.zero_point).astype(_F32) * jnp.sum(x2.astype(_F32), axis=1, keepdims=True)
    return out * (w.scale.astype(_F32) * unit)


def weight_only_dense(ax, x, w, policy, precision=None):
    """Float activation x quantized weight (``w`` from :func:`weight_in_layout`) -> float
    ``(M, N)``.

    With a ``"kn"`` weight and a chunk size, the weight is decoded to float one
    K-chunk at a time inside a ``lax.scan`` (an ``"nk"`` weight: one block of
    output channels at a time), so no float copy of the whole weight is made.
    With more than ``policy.float_matmul_rows`` rows, or a weight whose float copy
    fits ``policy.whole_decode_bytes`` (:func:`decodes_whole`), the whole weight is
    decoded once instead, after its input exists (``numerics.after``); or in blocks of
    ``policy.many_rows_block`` output channels inside a loop where that is set (up
    to ``policy.whole_decode_rows`` rows), each over the whole of K. Per-channel
    scales apply to the (smaller) output; per-group scales to each decoded chunk.
    """
    return weight_only_2d(ax.act_2d(x), w, policy, precision)
