"""Whether the weights :func:`jqt.pack` quantizes fit the grid their qparams were made for.

A weight's scales (per tensor, channel or group) come from the weights ``jqt.calibrate``
saw. Packing other weights with them (another checkpoint, weights trained further or
rescaled) quantizes every element beyond the grid's end to that end: clipped, silently.
A weight calibrator may clip on purpose (``WeightMSE``, a user's calibrator), so clipping
alone is not an error; clipping further than the calibration did is. So is the other
direction: a weight far smaller than the calibrated one (a unit mix-up, another checkpoint)
rounds most of its elements to a few codes near zero.

* :func:`record` (called by ``jqt.calibrate``) measures each quantized weight's *reach*:
  its largest ``|x / scale|`` (zero point subtracted, on the operand the codes are
  computed from: layout ops replayed, smoothing and rotation applied) over the value
  where clipping starts on that side of the grid (the grid's end plus half a step for
  integers, :func:`numerics.clip_edges`); at most 1 where nothing clips. It stores
  ``(reach, digest)`` in ``WeightSource.calibrated_reach`` (nothing where the reach is
  not finite: an inf element that the weight calibrator let through), the digest covering the
  scale, zero point, smoothing vector and type it was measured with. Where some channels or
  groups were all zeros (a pruned checkpoint: their scales are the placeholder 1) it
  stores ``(reach, digest, True)``: those placeholders must still cover zeros.
* :func:`start` / :func:`finish` (``jqt.pack``; :func:`check` for ``jqt.gptq``): where
  the digest still matches (the qparams as calibrated, within float rounding:
  :func:`same`), a weight whose reach exceeds
  ``max(calibrated reach, 1)`` by more than :data:`TOLERANCE`, or is under :data:`SHRUNK`
  of ``min(calibrated reach, 1)`` (and not 0: zeros pack exactly), or is nonzero where it
  was all zeros (the whole weight, or a channel or group whose scale is a placeholder;
  int and nf4 grids, on which small values round to 0 there), raises
  :class:`QParamsMismatchError` naming the op.

Not checked: qparams whose scales, zero points or smoothing changed since calibration
(fine-tuned by QAT, edited), qparams after :func:`jqt.qat.project` (which marks them as
fine-tuned: weights trained with them through the simulated path, which clips as
``pack`` does), qparams without a record (files written before it, made by hand), and
values that are tracers (``pack`` under ``jax.jit``), and qparams returned by a
``jax.jit``-compiled function that another set of qparams went through first (the record
is static data that compares equal, so jit rebuilds outputs with the first call's: its
digest then differs, and the check is skipped as for fine-tuned qparams).
``jqt.pack(..., clip=True)`` skips the check.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import re

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, diagnostics
from . import numerics as nx
from .handlers import QParamsMismatchError
from .analysis import path_str
from .layout import apply_chain
from .qparams import calibrated_args
from .registry import BY_NAME

TOLERANCE = 0.01
"""How far past ``max(calibrated reach, 1)`` a packed weight may reach before ``jqt.pack``
refuses it: 1%, above float rounding and a cast to bfloat16 (0.4%), far below the
factor of a rescaled or retrained weight."""

SHRUNK = 0.25
"""How little of ``min(calibrated reach, 1)`` (the part of the grid the calibrated codes
span) a packed weight may reach before ``jqt.pack`` refuses it: a quarter, two bits of
precision lost on every element (half of an int4 grid's). Weights that shrank less
(trained further with weight decay) pack as given; a weight rescaled by another checkpoint
or a unit mix-up (0.01x) is refused."""

_F32 = jnp.float32


SAME = 2e-4
"""How far the sums of a digest's directions (a scale's, zero point's or smoothing
vector's values over their L2 norm, weighted by :data:`SKETCHES` sets of fixed Gaussian
weights) may move for the qparams to count as the calibrated ones. Each value's own
float rounding moves them by about its relative size: an average of copies of unchanged
qparams by about 1e-7, an ``optax.ema`` of them over thousands of steps by up to about
2e-5. An edit of one value of n by a fraction ``e`` moves each by about ``e / sqrt(n)``
times its weight there (its own fraction of the values' root mean square): a fine-tuning
step, which moves every value, is seen; an edit of a few values by hand may not be (the
smaller the edit and the more the values, the likelier: one scale of 65,536 shrunk by 10%
was missed in about one channel of ten). A missed edit counts as rounding: ``jqt.pack``
then checks the weights against the edited scales (a weight past a shrunk scale's grid is
refused, naming the op; ``clip=True`` packs it), never silently."""

NORM = 1e-3
"""How far (relatively) a digest's L2 norms may move: a common factor, as float32 rounding
of an EMA's decay and bias correction gives every value (up to about 2e-4 at a decay of
0.9999), moves the grid's reach by as much, far below :data:`TOLERANCE`."""

SKETCHES = 8
"""How many weighted sums of each direction a digest holds."""


def _arrays(p):
    q = p.operand(p.weight_operand)
    if q is None or q.scale is None:
        return None
    arrays = (q.scale, q.zero_point, p.smooth)
    if any(a is not None and compat.is_tracer(a) for a in arrays):
        return None
    return q, arrays


def _exact(p) -> str | None:
    """The digest of jqt before 2026-12-01 (files hold it): a hash of the float32 bytes."""
    got = _arrays(p)
    if got is None:
        return None
    q, arrays = got
    h = hashlib.blake2b(f"{q.qtype.describe()}|{q.qtype.grid}|{p.rotate}".encode(), digest_size=8)
    for a in arrays:
        if a is None:
            h.update(b"|-")
            continue
        raw = np.asarray(a, np.float32)
        h.update(f"|{raw.shape}".encode())
        h.update(raw.tobytes())
    return h.hexdigest()


def digest(p) -> str | None:
    """A digest of what puts op ``p``'s weight on its grid: a hash of its type, rotation
    and the shapes of its scale, zero point and the op's smoothing vector, then sketches
    of their values (their L2 norm, and :data:`SKETCHES` sums of their direction weighted by fixed
    pseudo-random weights, which a changed, rescaled or permuted value moves), which
    :func:`same` compares within :data:`SAME`; ``None`` where one is a tracer or the weight
    has no scale.

    >>> import jqt
    >>> qp = jqt.calibrate(lambda p, x: x @ p["w"], jqt.recipes.w8(), {"w": jnp.eye(4)},
    ...                    [(jnp.ones((1, 4)),)], progress=False)
    >>> d = digest(qp["w"])
    >>> moved = qp["w"].rhs.scale * (1 + 2e-7)  # an EMA of unchanged qparams
    >>> p2 = dataclasses.replace(qp["w"], rhs=dataclasses.replace(qp["w"].rhs, scale=moved))
    >>> same(digest(p2), d), same(digest(dataclasses.replace(
    ...     qp["w"], rhs=dataclasses.replace(qp["w"].rhs, scale=moved * 1.01))), d)
    (True, False)
    """
    got = _arrays(p)
    if got is None:
        return None
    q, arrays = got
    shapes = [None if a is None else tuple(np.shape(a)) for a in arrays]
    h = hashlib.blake2b(f"{q.qtype.describe()}|{q.qtype.grid}|{p.rotate}|{shapes}".encode(),
                        digest_size=8)
    sketch = []
    for a in arrays:
        if a is None:
            continue
        v = np.asarray(a, np.float64).reshape(-1)
        r = _sketch_weights(v.size)
        norm = float(np.sqrt(v @ v))
        u = v / norm if norm else v  # the direction: a rescaling of all of them is the norm's
        sketch += [norm, *(r @ u).tolist()]
    return "s2:" + h.hexdigest() + ":" + ",".join(f"{x:.9g}" for x in sketch)


@functools.lru_cache(maxsize=8)
def _sketch_weights(n):
    """The fixed Gaussian weights of a digest of ``n`` values (ops of one shape share them:
    calibrate and pack take a digest per op)."""
    r = np.random.default_rng(n).standard_normal((SKETCHES, n))
    r.flags.writeable = False
    return r


def same(now: str | None, recorded: str) -> bool:
    """Whether digest ``now`` is that of the qparams ``recorded`` was taken of, within
    float rounding (:data:`NORM`, :data:`SAME`); a record from before sketches compares
    exactly (:func:`start`), one of another sketch version never."""
    if now is None:
        return False
    a, b = now.split(":"), recorded.split(":")
    if len(b) != 3 or len(a) != 3 or a[1] != b[1]:
        return False
    x = [float(t) for t in a[2].split(",") if t]
    y = [float(t) for t in b[2].split(",") if t]
    n = SKETCHES + 1
    if a[0] != b[0] or len(x) != len(y) or len(y) % n:
        return False
    return all(abs(x[i] - y[i]) <= NORM * max(x[i], y[i])
               and all(abs(x[i + k] - y[i + k]) <= SAME for k in range(1, n))
               for i in range(0, len(y), n))


def _edges(qtype):
    """Where clipping starts below and above the grid, in units of the scale (before the
    zero point)."""
    return nx.clip_edges(qtype.qmin, qtype.qmax, qtype.grid)


def _grouping(x, s, qtype, gaxis, depth):
    """``(axis, group size)`` where the scale holds one value per group along ``axis`` of
    ``x`` (as ``registry._quantize_weight`` expands it), else ``None``."""
    g = qtype.group_size
    if not g or gaxis is None or jnp.ndim(s) == 0:
        return None
    ax = (gaxis + depth) % x.ndim
    return None if s.shape[ax] == x.shape[ax] else (ax, g)


def _split(x, s, group):
    """``x`` split into groups along ``group``'s axis (``(axis, size)`` or ``None``), and
    its scale ``s`` (per layer already) given the groups' axis."""
    if group is None:
        return x, s
    ax, g = group
    return compat.grouped(x, ax, g), jnp.expand_dims(s, ax + 1)


def _entry_axes(s, shape):
    """The axes of ``shape`` (``x`` as :func:`_split` gives it) that each value of its
    scale ``s`` spans, and ``s``'s shape aligned to it."""
    aligned = (1,) * (len(shape) - jnp.ndim(s)) + tuple(jnp.shape(s))
    return tuple(i for i in range(len(shape)) if aligned[i] == 1 and shape[i] > 1), aligned


def _ratios(x, s, z, lo, hi, group, int_grid):
    """Per element of ``x``, ``x / scale`` (zero point subtracted) over where clipping
    starts on its side; with ``group``, ``x`` split into groups along that axis."""
    x = x.astype(_F32)
    s = nx.per_layer(s.astype(_F32), x.ndim)
    z = nx.per_layer(z, x.ndim)
    zr = jnp.round(z.astype(_F32)) if int_grid else jnp.zeros((), _F32)  # as both paths round it
    x, s = _split(x, s, group)
    if group is not None and zr.ndim:
        zr = jnp.expand_dims(zr, group[0] + 1)
    u = nx.quotient(x, s)  # as the codes are computed (a division may differ by an ulp)
    r = jnp.where(u >= 0, u / (hi - zr), u / (lo - zr))
    return jnp.where(jnp.isnan(r), 0.0, r), u, s, zr  # a NaN element is no clipping question


PLACEHOLDER = 1.0
"""The scale a channel or group with no range gets (``numerics.params_from_range``): an
all-zero one, as a pruned checkpoint has them."""


def placeholders(s, shape, band=NORM):
    """Where, per element of ``shape``, the scale ``s`` (broadcastable) is the placeholder,
    within ``band`` (relative): :data:`NORM` at ``jqt.pack``, what :func:`same` takes for
    float rounding (an EMA of unchanged qparams), twice that at calibration (:func:`record`),
    so that a real scale float rounding may move into the first band was in the second
    when recorded. A real scale that close to 1 counts too; where its weight is not zero,
    the calibration's record then holds no pruned channels, and none are checked."""
    return jnp.broadcast_to(jnp.abs(s - PLACEHOLDER) <= band * PLACEHOLDER, shape)


def placeholder_zeros(x, q, gaxis, depth):
    """Per element of weight operand ``x``: whether its channel or group is all zeros
    and its scale a placeholder (a pruned one; for ``jqt.gptq``, which keeps those), not
    where a real scale is 1.

    >>> import jqt
    >>> w = jnp.array([[0.0, 127.0, 0.5], [0.0, -3.0, 0.0]])  # channel 1's real scale is 1
    >>> qp = jqt.calibrate(lambda p, x: x @ p, jqt.recipes.w8(), w, [(jnp.ones((1, 2)),)],
    ...                    progress=False)
    >>> placeholder_zeros(w, qp["p"].rhs, None, 0).tolist()
    [[True, False, False], [True, False, False]]
    """
    s = jnp.asarray(q.scale, _F32)
    group = _grouping(x, s, q.qtype, gaxis, depth)
    xs, s = _split(x, nx.per_layer(s, x.ndim), group)
    empty = ~jnp.any(xs != 0, axis=_entry_axes(s, xs.shape)[0], keepdims=True)
    return (placeholders(s, xs.shape) & empty).reshape(x.shape)


@functools.partial(jax.jit, static_argnums=(5, 6, 7))
def _max_ratio(x, s, z, lo, hi, group, int_grid, band):
    r, _, s, _ = _ratios(x, s, z, lo, hi, group, int_grid)
    held = placeholders(s, r.shape, band)
    return jnp.max(r), jnp.max(jnp.where(held, r, 0.0)), jnp.any(held)


def reach(x, q, gaxis, depth, band=NORM):
    """The reach of weight operand ``x`` on ``q``'s grid (see the module docstring), the
    reach of its elements whose scale is :data:`PLACEHOLDER`, and whether any is (device
    scalars); ``None`` where it cannot be measured (tracers, no elements)."""
    s, z = q.scale, q.zero_point
    if any(compat.is_tracer(a) for a in (x, s, z)) or s is None or jnp.size(x) == 0:
        return None
    lo, hi = (jnp.asarray(e, _F32) for e in _edges(q.qtype))
    int_grid = q.qtype.grid == "int"
    z = jnp.zeros((), _F32) if z is None else jnp.asarray(z)
    s = jnp.asarray(s)
    return _max_ratio(x, s, z, lo, hi, _grouping(x, s, q.qtype, gaxis, depth), int_grid, band)


def _worst(x, gaxis, q, depth):
    """``(value, grid end, ratio)`` of the element of ``x`` that reaches furthest: its real
    value, the real value its scale and zero point end the grid at on its side, and the
    one over the other (for the error message; eager)."""
    s = jnp.asarray(q.scale)
    z = jnp.zeros((), _F32) if q.zero_point is None else jnp.asarray(q.zero_point)
    lo, hi = (jnp.asarray(e, _F32) for e in _edges(q.qtype))
    group = _grouping(x, s, q.qtype, gaxis, depth)
    r, u, s, zr = _ratios(x, s, z, lo, hi, group, q.qtype.grid == "int")
    i = int(jnp.argmax(r.reshape(-1)))
    u_i = float(u.reshape(-1)[i])
    s_i = float(jnp.broadcast_to(s, r.shape).reshape(-1)[i])
    z_i = float(jnp.broadcast_to(zr, r.shape).reshape(-1)[i])
    blo, bhi = q.qtype.bounds
    end = ((bhi if u_i >= 0 else blo) - z_i) * s_i
    value = u_i * s_i
    return value, end, (value / end if end else float("inf"))


def leaf_index(paths) -> dict:
    """Leaf path -> positions, for :func:`find_leaf` (``paths``: the leaves' paths in order)."""
    index = {}
    for i, p in enumerate(paths):
        index.setdefault(p, []).append(i)
    return index


def prefixed_paths(qparams):
    """``True`` where ``qparams``' weight paths are known to be prefixed by their argument's
    name for sources that do not record it (their ops read weights of several arguments);
    ``None`` where that is unknown."""
    return True if len(calibrated_args(qparams)) > 1 else None


def find_leaf(src, index, key, fn="jqt.pack", prefixed=None):
    """The position in params (``index``: leaf path -> positions) of the leaf ``src`` names,
    or ``None``. ``src.path`` is the leaf's path in params, prefixed by the argument's name
    where the function has several weight arguments or params is a single array
    (``src.prefixed``; where qparams from an older jqt do not record it, ``prefixed``, or
    ``None`` where unknown: then the path without its first name is tried only where no
    leaf has the whole path). As argument ``a``, ``{"w": W, "a": {"w": V}}``'s ``W``
    prefixed and ``V`` both read ``"a/w"``. Where several leaves have the path (a key
    ``"a/b"`` beside ``{"a": {"b": ...}}``), the one at the calibrated position,
    ``src.leaf``; otherwise an error."""
    fallback = src.path.split("/", 1)[1] if "/" in src.path else ""
    whole, bare = index.get(src.path, []), index.get(fallback, [])
    found = (bare if src.prefixed else whole if src.prefixed is False  # recorded: that path
             else (bare or whole) if prefixed else (whole or bare))
    if src.leaf in found or not found:
        return src.leaf if found else None
    if len(set(found)) > 1:
        raise QParamsMismatchError(
            f"{fn}: op '{key}' reads weight '{src.path}', and params hold {len(set(found))} "
            "leaves whose paths read so (e.g. a key 'a/b' beside a nested 'a' -> 'b'); jqt "
            "names weights by their path. Rename one of them, and re-calibrate.")
    return found[0]


def _weights(qparams, params_t, argnums, fn):
    """``(key, op qparams, its weight's leaf)`` for each quantized op whose weight is a
    leaf of ``params_t`` (one pytree per weight argument), numbered as the tracer numbered
    the leaves (``WeightSource.leaf``), found by path as :func:`jqt.pack` finds them (params
    may hold other leaves too)."""
    flat = {}
    calibrated = calibrated_args(qparams)
    # a wrapper may move the weight arguments, in order (as jqt.quantize takes them)
    slot = ({} if set(calibrated) <= set(argnums) or len(calibrated) != len(argnums)
            else dict(zip(calibrated, sorted(argnums))))
    for key, p in qparams.items():
        w, src = p.weight_operand, p.source
        arg = None if src is None else slot.get(src.arg, src.arg)
        if w is None or p.operand(w) is None or src is None or arg not in argnums:
            continue
        if arg not in flat:
            with_paths = jax.tree_util.tree_flatten_with_path(params_t[argnums.index(arg)])[0]
            flat[arg] = ([x for _, x in with_paths],
                         leaf_index([path_str(q) for q, _ in with_paths]))
        leaves, index = flat[arg]
        i = find_leaf(src, index, key, fn, prefixed=len(argnums) > 1 or None)
        if i is not None and hasattr(leaves[i], "shape"):
            yield key, p, leaves[i]


def _grid_operand(p, leaf):
    """The weight as op ``p`` puts it on its grid, and its group axis (``grid_operand``)."""
    return BY_NAME[p.op].grid_operand(p.source, p, apply_chain(leaf, p.source.chain))


def record(qparams, params_t, argnums):
    """``qparams`` with each quantized weight's ``WeightSource.calibrated_reach`` measured on
    the weights they were calibrated with (``params_t``: one pytree per weight argument)."""
    pending = []
    for key, p, leaf in _weights(qparams, params_t, argnums, "jqt.calibrate"):
        tag = digest(p)
        if tag is None:
            continue
        _refuse_huge(key, p)
        x, gaxis = _grid_operand(p, leaf)
        r = reach(x, p.operand(p.weight_operand), gaxis, p.source.stack_depth, band=2 * NORM)
        if r is not None:
            pending.append((key, r + (jnp.max(x), jnp.min(x), _nonzero(x)), tag))
    if not pending:
        return qparams
    values = jax.device_get([r for _, r, _ in pending])  # one transfer for every weight
    for (key, _, _), (*_, top, bottom, _) in zip(pending, values):
        _refuse_huge(key, qparams[key], (top, bottom))
    out = dict(qparams)
    with diagnostics.grouped():
        for (key, _, _), (r, *_, top, bottom, nonzero) in zip(pending, values):
            if r == 0 and nonzero:
                _warn_tiny(key, qparams[key], max(abs(top), abs(bottom)))
            elif r == 0 and zero_below(qparams[key]):
                _warn_zero(key, qparams[key])
    for (key, _, tag), (r, held_reach, held, *_) in zip(pending, values):
        if not np.isfinite(r):  # an inf element the calibrator let through: nothing to compare
            continue
        p = out[key]
        zeros = bool(held) and held_reach == 0 and 0 < r  # pruned channels or groups (a
        # weight all zeros is told by its reach of 0)
        out[key] = dataclasses.replace(p, source=dataclasses.replace(
            p.source, calibrated_reach=(float(r), tag) + ((True,) if zeros else ())))
    return out


HUGE = 2.0 ** 126
"""Scales above this have a reciprocal below float32's normal range, which XLA:CPU flushes
to 0: every code :func:`numerics.quotient` computes with them is 0."""


def _refuse_huge(key, p, extent=None):
    """Raises where op ``p``'s weight has a scale above :data:`HUGE` (NF4 or 2-3-bit
    weights beyond about ``8.5e37``), or would have one unclipped (``extent``: the weight's
    largest and smallest values on its grid): every path would quantize those groups to
    zeros, and a clipping calibrator (``WeightMSE``, NF4's default) would otherwise pick a
    scale just under the limit and cut the weight's largest values by up to half."""
    o = p.operand(p.weight_operand)
    if o is None or o.scale is None or not np.size(o.scale):
        return
    top = float(np.max(np.abs(np.asarray(o.scale, np.float32))))
    if extent is not None and np.isfinite(extent).all():  # (an inf element: reported elsewhere)
        # the unclipped scale of the weight's whole range: the group holding the largest
        # magnitude's where symmetric; at most twice a group's where asymmetric, so a weight
        # whose values lie beyond about 8.5e37 either way is refused, as documented
        hi, lo = extent
        top = max(top, float(nx.params_from_range(lo, hi, o.qtype)[0]))
    if top > HUGE:
        raise ValueError(
            f"jqt.calibrate: op '{key}' reads weight '{p.source.path}', whose range needs a "
            f"scale of {top:.3g} on its {o.qtype.describe()} grid: above 2**126 a scale's "
            "reciprocal is below float32's normal range, and every code computed with it would "
            "be 0 (the weight lost, on every path; clipping it to fit would cut its largest "
            "values). Rescale the model (weights beyond about 8.5e37 do not "
            "occur in trained models: look for an overflow), or keep this op float with "
            f"jqt.Rule(key='^{re.escape(key)}$', weight=None) ahead of the preset's rules.")


def zero_below(p) -> str:
    """Which values round to 0 on op ``p``'s weight grid with a scale of 1 (the placeholder
    of a weight calibrated at zeros); ``""`` for e5m2, whose steps near 0 (down to 2**-16)
    keep a trained weight's values. e4m3's smallest step is 2**-9, and its steps are
    coarse below 2**-6: a weight trained to values of 1e-3 loses most of them."""
    grid = p.operand(p.weight_operand).qtype.grid
    if grid.startswith("float8_e4m3"):
        return ("under about 0.001 of the scale (half e4m3's smallest step, 2**-9; its steps "
                "are coarse up to 2**-6)")
    return {"int": "under half the scale", "nf4": "under about 0.04 of the scale (half "
            "nf4's smallest step)"}.get(grid, "")


def _warn_zero(key, p):
    """A weight that is all zeros where it is calibrated has no range: its scale is a
    placeholder (1), on which values a training gives it later round to 0."""
    diagnostics.warn_grouped(
        ("zero weight",),
        f"jqt.calibrate: op '{key}' reads weight '{p.source.path}', which is all zeros in these "
        "params: it has no range, so its scale is a placeholder (1), on which any value "
        f"{zero_below(p)} rounds to 0. If it is trained after calibration (a LoRA adapter's B, zeros "
        "at initialisation), keep it float (jqt.Rule(key=..., weight=None) ahead of the "
        "preset's rules) or pass the adapters as an argument of f that is not a weight argument "
        "(not in weight_argnums: docs/fine-tuning.md, QLoRA), or calibrate after training it.", f"'{key}'")


def _nonzero(x):
    """Whether ``x`` holds an element that is not 0, subnormal ones included (XLA:CPU
    flushes them to 0 in arithmetic and comparisons: their bits are read instead)."""
    x = jnp.asarray(x)
    if x.dtype == jnp.float64:  # (jax_enable_x64) a float64 below float32's range is not 0
        bits = jax.lax.bitcast_convert_type(x, jnp.int64)
        return jnp.any((bits & 0x7FFFFFFFFFFFFFFF) != 0)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.any((bits & 0x7FFFFFFF) != 0)


def _warn_tiny(key, p, amax):
    """A weight that is not zero but whose range needs a scale below float32's normal range:
    its scale is the placeholder (1), and every code is 0."""
    diagnostics.warn_grouped(
        ("tiny weight",),
        f"jqt.calibrate: op '{key}' reads weight '{p.source.path}', whose largest magnitude "
        f"{f'{float(amax):.3g}' if amax > 0 else '(subnormal, below 1.2e-38)'} needs a scale "
        "below float32's normal range (about 1.2e-38): it has "
        "the placeholder scale 1, on which every value rounds to 0, so the op reads this weight "
        "as zeros on every path. Rescale the model (weights this small do not occur in trained "
        f"models), or keep this op float with jqt.Rule(key='^{re.escape(key)}$', weight=None) "
        "ahead of the preset's rules.", f"'{key}'")


def start(key, p, src, x, gaxis):
    """The pending check of op ``key``'s weight (``x`` and ``gaxis`` from ``grid_operand``),
    or ``None`` where there is nothing to check against (see the module docstring). It
    holds the reach (a device scalar), not the weight."""
    rec = None if p.source is None else p.source.calibrated_reach
    if rec is None or not (same(digest(p), rec[1]) if ":" in rec[1] else _exact(p) == rec[1]):
        return None
    r = reach(x, p.operand(p.weight_operand), gaxis, src.stack_depth)
    return None if r is None else (key, p, src, r)


def check(qparams, params_t, argnums, fn):
    """:func:`start` and :func:`finish` for every quantized weight of ``params_t`` (one
    pytree per weight argument), as ``fn`` (``jqt.gptq``, which re-rounds the weights on
    the calibrated grids) reads them."""
    pending, leaf_of = [], {}
    for key, p, leaf in _weights(qparams, params_t, argnums, fn):
        leaf_of[id(p)] = leaf
        try:
            pending.append(start(key, p, p.source, *_grid_operand(p, leaf)))
        except TypeError as e:  # the scales do not broadcast against the weight
            w = p.operand(p.weight_operand)
            raise QParamsMismatchError(
                f"{fn}: op '{key}': weight '{p.source.path}' has shape {tuple(jnp.shape(leaf))}, which "
                f"its scale of shape {tuple(jnp.shape(w.scale))} does not fit ({e}). Pass the params "
                "the qparams were calibrated with, or re-calibrate.") from None
    fix = (f"re-calibrate with them (jqt.calibrate(f, recipe, params, batches)) and run {fn} "
           "with those qparams.")
    finish(pending, lambda p, src: _grid_operand(p, leaf_of[id(p)]), fn, fix=fix)


PACK_FIX = ("re-calibrate with them (jqt.calibrate(f, recipe, params, batches)), or pass "
             "jqt.pack(..., clip=True) to pack them as they are (e.g. weights fine-tuned with these "
             "qparams through the simulated path, which clips them the same way).")


def finish(pending, grid_operand, fn="jqt.pack", fix=PACK_FIX):
    """Raises :class:`QParamsMismatchError` for the first weight of ``pending`` (from
    :func:`start`) that reaches further than its calibration allows, or less than
    :data:`SHRUNK` of the part of the grid its calibrated weight's codes spanned;
    ``grid_operand(p, src)`` gives its weight again, for the message."""
    pending = [c for c in pending if c is not None and not compat.is_tracer(c[-1][0])]  # traced: no value
    if not pending:
        return
    values = jax.device_get([c[-1] for c in pending])  # one transfer for every weight
    bad, small, zeroed, regrown = [], [], [], []
    for c, (r, held_reach, _) in zip(pending, values):
        rec = c[1].source.calibrated_reach
        cal = rec[0]
        if cal == 0 and float(r) > 0 and zero_below(c[1]):  # calibrated at zeros: the
            zeroed.append((c, float(r), cal))  # scale is a placeholder (fp8 keeps small values)
        elif rec[2:] == (True,) and float(held_reach) > 0 and zero_below(c[1]):
            regrown.append((c, float(held_reach), cal))  # a pruned channel or group
        elif float(r) > max(cal, 1.0) * (1 + TOLERANCE):
            bad.append((c, float(r), cal))
        elif 0 < float(r) < min(cal, 1.0) * SHRUNK:  # zeros (a pruned weight) pack exactly
            small.append((c, float(r), cal))
    if zeroed:
        (key, p, src, _), r, _ = zeroed[0]
        raise QParamsMismatchError(
            f"{fn}: op '{key}': weight '{src.path}' was all zeros in the params the qparams were "
            "calibrated with, so its scale is a placeholder (1); these params hold it nonzero "
            f"(it reaches {r:.3g}x the edge of that grid, "
            f"{p.operand(p.weight_operand).qtype.describe()}), and on it values {zero_below(p)} "
            "round to 0. " + fix[0].upper() + fix[1:] + _also(zeroed, "were calibrated at zeros too"))
    if regrown:
        (key, p, src, _), r, _ = regrown[0]
        q = p.operand(p.weight_operand)
        x, gaxis = grid_operand(p, src)
        held, n = _regrown(x, q, gaxis, src.stack_depth)
        raise QParamsMismatchError(
            f"{fn}: op '{key}': weight '{src.path}' holds values in {n} {held} that "
            f"{'was' if n == 1 else 'were'} all zeros in the params the qparams were calibrated with "
            f"(a pruned checkpoint?): {'its scale is a placeholder' if n == 1 else 'their scales are placeholders'} "
            f"(1), a grid with no relation to these values, on which any value {zero_below(p)} rounds "
            f"to 0 (these reach {r:.3g}x its edge, {q.qtype.describe()}). "
            + fix[0].upper() + fix[1:] + _also(regrown, "have such channels or groups too")
            + (" (clip=True packs those values on the placeholder grid.)" if "clip=True" in fix else ""))
    if small and not bad:
        (key, p, src, _), r, cal = small[0]
        raise QParamsMismatchError(
            f"{fn}: op '{key}': weight '{src.path}' reaches only {r:.3g}x the edge of the grid its "
            f"qparams were calibrated for ({p.operand(p.weight_operand).qtype.describe()}), where "
            f"the weights they were calibrated with reached {cal:.3g}x: its codes would span "
            f"{r / min(cal, 1.0):.2g} of the range theirs did, most of them a few codes near zero. They are "
            "not the params the qparams were calibrated with (another checkpoint, weights "
            "rescaled?): " + fix + _also(small, "reach as little of theirs"))
    if not bad:
        return
    (key, p, src, _), r, cal = bad[0]
    q = p.operand(p.weight_operand)
    value, end, ratio = _worst(*grid_operand(p, src), q, src.stack_depth)
    was = "not clipped" if cal <= 1 else "clipped on purpose by the weight calibrator"
    where = (f"{ratio:.3g}x as far out as its scale's end of the grid, {end:.4g}"
             if end and np.isfinite(ratio) and ratio > 0 else
             f"{'below' if value < end else 'above'} its grid's end on that side, {end:.4g} (its "
             "zero point puts that end there)")
    moved = " (of the weight as the op's smoothing or rotation transforms it)" \
        if p.smooth is not None or p.rotate else ""
    raise QParamsMismatchError(
        f"{fn}: op '{key}': weight '{src.path}' does not fit the grid its qparams were calibrated "
        f"for ({q.qtype.describe()}): an element{moved} of {value:.4g} lies {where}, and would be "
        "clipped to it. The weights the "
        f"qparams were calibrated with reached {cal:.3g}x the edge where clipping starts, half a "
        f"step beyond the grid's end ({was}); these reach {r:.3g}x, more than "
        f"{TOLERANCE:.0%} beyond {max(cal, 1.0):.3g}x. They are not the params the qparams were calibrated "
        "with (another checkpoint, weights trained further or rescaled?): " + fix
        + _also(bad, "do not fit theirs either"))


def _regrown(x, q, gaxis, depth):
    """``(what, how many)``: the channel(s), group(s) or stacked layer(s) of weight operand
    ``x`` whose scale is the placeholder and which hold a nonzero value (for the message; eager)."""
    s = jnp.asarray(q.scale, _F32)
    z = jnp.zeros((), _F32) if q.zero_point is None else jnp.asarray(q.zero_point)
    lo, hi = (jnp.asarray(e, _F32) for e in _edges(q.qtype))
    group = _grouping(x, s, q.qtype, gaxis, depth)
    r, _, s_b, _ = _ratios(x, s, z, lo, hi, group, q.qtype.grid == "int")
    held = placeholders(s_b, r.shape) & (r > 0)
    axes, shape = _entry_axes(s_b, r.shape)
    n = int(jnp.sum(jnp.any(held, axis=axes)))  # one per scale value
    what = ("group" if group is not None else
            "layer" if depth and all(d == 1 for d in shape[depth:]) else "channel")
    return what + ("s" if n != 1 else ""), n


def _also(found, what):
    """The message's last sentence: the other ops ``found`` (after the first)."""
    others = [c[0][0] for c in found[1:]]
    return f" Ops {others[:5]}{' ...' if len(others) > 5 else ''} {what}." if others else ""
