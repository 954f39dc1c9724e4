"""Quantization-aware fine-tuning (QAT): which leaves of ``(params, qparams)`` train.

Fine-tuning trains the pair ``state = (params, qparams)`` through the simulated
path, :func:`jqt.quantize` with ``simulate=True`` called *inside* the
differentiated function (so that ``qparams`` are traced, not captured as
constants). The leaves of that pair fall in five parts (:data:`jqt.qat.PARTS`):

* ``"weights"``: every leaf of ``params`` (kernels, biases, norms);
* ``"weight_scales"``: the ``scale`` of each weight operand in ``qparams``;
* ``"activation_scales"``: the ``scale`` of each static activation operand;
* ``"zero_points"``: the ``zero_point`` of each asymmetric operand (weight or
  activation);
* ``"smoothing"``: the per-input-channel ``smooth`` vector of each op smoothed
  by SmoothQuant or AWQ.

``"scales"`` names both kinds of scales and the smoothing vectors, ``"all"``
every part. Dynamic operands
have no scale or zero point to train, and float ops no leaves at all.

Two ways to freeze a part, as in optax and Equinox:

* :func:`jqt.qat.labels` gives a ``"train"`` / ``"freeze"`` label per leaf for
  ``optax.multi_transform`` (``per_part=True``: the part's name instead of
  ``"train"``, for one optimizer per part); frozen leaves get a zero update.
* :func:`jqt.qat.split` returns ``(trainable, frozen)``, two pytrees shaped like
  ``(params, qparams)`` with ``None`` where the other one holds the leaf;
  differentiate with respect to ``trainable`` only and recombine with
  :func:`jqt.qat.merge` inside the loss. Frozen leaves are never touched, and pass
  through ``jax.jit`` as arguments rather than as baked-in constants.

After each optimizer update, :func:`jqt.qat.project` puts ``qparams`` back in their
domain: scales at least ``min_scale`` (a gradient step can take a small scale
through zero), zero points inside ``[qmin, qmax]``. Zero points are trained
straight-through: they stay float leaves, both paths round them in the forward
pass (see ``numerics.py``).

Adam moves a leaf by about its learning rate per step whatever the leaf's size,
and scales span orders of magnitude (an int8 input's 0.004, an int2
activation's 5): make the scales' steps relative to each leaf's scales with
``optax.chain(optax.adam(lr), optax.scale_by_param_block_rms(1e-12))`` (relative to
their RMS: where one leaf holds scales of very different sizes, a scan's stacked
layers, scale each update by its own scale elementwise, docs/fine-tuning.md).

A fine-tune of the scales and zero points of a matmul calibrated on a batch
with an outlier (its activation scale is 17 times too large), weights frozen:

>>> import jax, jax.numpy as jnp, optax, jqt
>>> f = lambda w, x: x @ w
>>> w = jax.random.normal(jax.random.key(0), (16, 8))
>>> x = jax.random.normal(jax.random.key(1), (64, 16))
>>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x.at[0, 0].set(100.0),)], progress=False)
>>> def loss(state):
...     w, qp = state    # quantize inside the differentiated function: qp is traced
...     return jnp.mean((jqt.quantize(f, qp, simulate=True)(w, x) - f(w, x)) ** 2)
>>> relative = optax.chain(optax.adam(3e-2), optax.scale_by_param_block_rms(1e-12))
>>> tx = optax.multi_transform(
...     {"weight_scales": relative, "activation_scales": relative,
...      "zero_points": optax.adam(1.0), "freeze": optax.set_to_zero()},
...     jqt.qat.labels(w, qp, train=("scales", "zero_points"), per_part=True))
>>> @jax.jit
... def step(state, opt_state):
...     grads = jax.grad(loss)(state)
...     updates, opt_state = tx.update(grads, opt_state, state)
...     w, qp = optax.apply_updates(state, updates)
...     return (w, jqt.qat.project(qp)), opt_state
>>> state = (w, qp)
>>> opt_state = tx.init(state)
>>> for _ in range(100):
...     state, opt_state = step(state, opt_state)
>>> bool(loss(state) < loss((w, qp)) / 10)
True
>>> bool((state[0] == w).all())    # the weights were frozen
True
>>> w1, qp1 = state                # re-pack: the integer path runs what was trained
>>> y_int = jax.jit(jqt.quantize(f, qp1))(jqt.pack(qp1, w1), x)
>>> bool(jnp.allclose(y_int, jqt.quantize(f, qp1, simulate=True)(w1, x), atol=1e-4))
True
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, tracing, validate
from . import numerics as nx
from .qparams import OpQParams, PackedParams

PARTS = ("weights", "weight_scales", "activation_scales", "zero_points", "smoothing")
"""The parts of ``(params, qparams)`` that :func:`jqt.qat.parts` names.

>>> import jqt
>>> jqt.qat.PARTS
('weights', 'weight_scales', 'activation_scales', 'zero_points', 'smoothing')
"""

_GROUPS = {"scales": ("weight_scales", "activation_scales", "smoothing"), "all": PARTS}

_TRAIN, _FREEZE = "train", "freeze"
_F32_MAX, _F32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def _is_qparams(x) -> bool:
    return isinstance(x, dict) and bool(x) and all(isinstance(v, OpQParams) for v in x.values())


def _check(params, qparams, fn):
    packed = [i for i, p in enumerate(params) if isinstance(p, PackedParams)] \
        if isinstance(params, (tuple, list)) else []
    if isinstance(params, PackedParams) or packed:  # (one of several weight arguments too)
        what = "params" if not packed else f"params[{packed[0]}] (a weight argument)"
        raise TypeError(f"jqt.qat.{fn}: {what} is a jqt.PackedParams; fine-tune the float params "
                        "and call jqt.pack(qparams, params) after training.")
    if _is_qparams(params) and not _is_qparams(qparams):
        raise TypeError(f"jqt.qat.{fn}: the first argument looks like qparams and the second "
                        f"does not; the order is jqt.qat.{fn}(params, qparams), the same as the "
                        "state (params, qparams) it describes.")
    if not isinstance(qparams, dict):
        raise TypeError(f"jqt.qat.{fn}: qparams is a {type(qparams).__name__}; expected the dict "
                        "returned by jqt.calibrate.")
    for k, v in qparams.items():
        if not isinstance(v, OpQParams):
            raise TypeError(f"jqt.qat.{fn}: qparams['{k}'] is a {type(v).__name__}; expected "
                            "jqt.OpQParams.")


def _resolve(train: str | Iterable[str]) -> frozenset:
    if isinstance(train, str):
        names = (train,)
    elif isinstance(train, Mapping):  # an optax-style mask: its keys alone were the names
        named = [k for k in train if isinstance(k, str) and (k in PARTS or k in _GROUPS)]
        chosen = tuple(k for k in named if bool(train[k]))
        fix = (f"pass the names of the parts to train, e.g. train={chosen!r}" if named else
               f"a mask shaped as the params is optax's, not jqt's: pass part names {PARTS} "
               "(jqt.qat.labels gives the labels optax.multi_transform takes)")
        raise TypeError(f"jqt.qat: train={train!r} is a mapping; {fix} (a mapping's keys are no "
                        "list of names: its parts marked False would be trained).")
    elif isinstance(train, Iterable):
        names = tuple(train)
    else:
        raise TypeError(f"jqt.qat: train={train!r} is not a part name or an iterable of them; "
                        f"pass one of {PARTS} or {tuple(_GROUPS)}, or a list of them.")
    out = set()
    for n in names:
        if n in _GROUPS:
            out.update(_GROUPS[n])
        elif n in PARTS:
            out.add(n)
        else:
            raise ValueError(f"jqt.qat: unknown part {n!r}; the parts are {PARTS}, and "
                             f"{tuple(_GROUPS)} name groups of them.")
    return frozenset(out)


def _op_parts(p: OpQParams) -> OpQParams:
    ops = []
    for i in (0, 1):
        q = p.operand(i)
        if q is None:
            ops.append(None)
            continue
        role = "weight" if i == p.weight_operand else "activation"
        ops.append(dataclasses.replace(
            q, scale=None if q.scale is None else f"{role}_scales",
            zero_point=None if q.zero_point is None else "zero_points"))
    return dataclasses.replace(p, lhs=ops[0], rhs=ops[1],
                               smooth=None if p.smooth is None else "smoothing")


def parts(params, qparams) -> tuple[Any, dict]:
    """The part (one of :data:`jqt.qat.PARTS`) of each leaf of ``(params, qparams)``.

    Returns a pair shaped like ``(params, qparams)`` with a string in place of
    each leaf, e.g. for ``optax.multi_transform`` with one learning rate per part:
    ``optax.multi_transform({p: optax.adam(lr[p]) for p in jqt.qat.PARTS},
    jqt.qat.parts(params, qparams))``.

    >>> import jax.numpy as jnp, jqt
    >>> f = lambda p, x: x @ p["w"] + p["b"]
    >>> p = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(jnp.ones((1, 3)),)], progress=False)
    >>> pp, qq = jqt.qat.parts(p, qp)
    >>> pp
    {'b': 'weights', 'w': 'weights'}
    >>> qq["w"].rhs.scale, qq["w"].lhs.scale, qq["w"].lhs.zero_point
    ('weight_scales', 'activation_scales', 'zero_points')
    """
    _check(params, qparams, "parts")
    return (jax.tree.map(lambda _: "weights", params),
            {k: _op_parts(v) for k, v in qparams.items()})


def labels(params, qparams, *, train: str | Iterable[str] = PARTS,
           per_part: bool = False) -> tuple[Any, dict]:
    """``"train"`` / ``"freeze"`` per leaf of ``(params, qparams)``, for ``optax.multi_transform``.

    Args:
      params: the float weights (the argument of ``f`` that holds them).
      qparams: from :func:`jqt.calibrate`.
      train: the parts to train, among :data:`jqt.qat.PARTS` (``"weights"``,
        ``"weight_scales"``, ``"activation_scales"``, ``"zero_points"``,
        ``"smoothing"``) and the groups ``"scales"`` (both kinds of scales and the
        smoothing vectors) and ``"all"``; every other
        part is frozen. Default: all. Leaves that are not floating-point arrays or
        NumPy floating-point scalars (integer counters in ``params``; Python numbers,
        which ``f`` reads as constants, such as an Equinox dropout rate) are always
        frozen, and so is a Flax linen
        ``batch_stats`` collection (``params["batch_stats"]``: running statistics, which
        the model updates, not gradients).
      per_part: label a trained leaf with its part's name (as :func:`jqt.qat.parts`)
        instead of ``"train"``, for one optimizer per trained part.

    Returns:
      a pair shaped like ``(params, qparams)`` holding ``"train"`` (or the part's
      name) or ``"freeze"`` in place of each leaf. Use it with the state
      ``(params, qparams)``::

        tx = optax.multi_transform({"train": optax.adam(1e-3), "freeze": optax.set_to_zero()},
                                   jqt.qat.labels(params, qparams, train=("weights", "scales")))
        # or one optimizer per part, scales with steps relative to their size:
        relative = optax.chain(optax.adam(1e-2), optax.scale_by_param_block_rms(1e-12))
        tx = optax.multi_transform(
            {"weights": optax.adam(1e-3), "weight_scales": relative, "activation_scales": relative,
             "smoothing": relative, "freeze": optax.set_to_zero()},
            jqt.qat.labels(params, qparams, train=("weights", "scales"), per_part=True))

    >>> import jax.numpy as jnp, jqt
    >>> f = lambda w, x: x @ w
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), jnp.eye(2), [(jnp.ones((1, 2)),)], progress=False)
    >>> lp, lq = jqt.qat.labels(jnp.eye(2), qp, train="scales")
    >>> lp, lq["w"].rhs.scale, lq["w"].lhs.scale, lq["w"].lhs.zero_point
    ('freeze', 'train', 'train', 'freeze')
    >>> lp, lq = jqt.qat.labels(jnp.eye(2), qp, train="scales", per_part=True)
    >>> lp, lq["w"].rhs.scale, lq["w"].lhs.scale, lq["w"].lhs.zero_point
    ('freeze', 'weight_scales', 'activation_scales', 'freeze')
    """
    _check(params, qparams, "labels")
    validate.flags("jqt.qat.labels", per_part=per_part)
    chosen = _resolve(train)
    state_parts = parts(params, qparams)

    def label(part, leaf):
        # an array or a NumPy number; a Python number is a constant to f (jqt.calibrate and
        # jqt.pack keep it static; eqx.is_array leaves it out): a dropout rate or a config
        # gain trained into an array changes what f computes. A string is no number, even
        # where it names a dtype ("float32"), nor is any other object
        dt = None if tracing.is_static(leaf) else getattr(leaf, "dtype", None)
        floating = dt is not None and jnp.issubdtype(dt, jnp.inexact)
        if part not in chosen or not floating:
            return _FREEZE
        return part if per_part else _TRAIN

    lp, lq = jax.tree.map(label, state_parts, (params, qparams))
    # a linen batch_stats collection, at the top of params or of one of several weight
    # arguments (a tuple of variables dicts, {'enc': variables}): updated by f, not trained
    stats = lambda path, lab: _FREEZE if any(getattr(k, "key", None) == "batch_stats" for k in path) else lab
    return jax.tree_util.tree_map_with_path(stats, lp), lq


def split(params, qparams, *, train: str | Iterable[str] = PARTS) -> tuple[tuple, tuple]:
    """Splits ``(params, qparams)`` into ``(trainable, frozen)``, as in ``eqx.partition``.

    Both halves are shaped like ``(params, qparams)``, with ``None`` where the
    other half holds the leaf; ``train`` is as in :func:`jqt.qat.labels`. Differentiate
    with respect to ``trainable`` and rebuild the pair with :func:`jqt.qat.merge` inside
    the loss; pass ``frozen`` to a jitted step as an argument.

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda w, x: x @ w
    >>> w, x = jnp.eye(2), jnp.ones((1, 2))
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    >>> trainable, frozen = jqt.qat.split(w, qp, train="weights")
    >>> trainable[1]["w"].rhs.scale is None, frozen[0] is None
    (True, True)
    >>> def loss(trainable, frozen):
    ...     w, qp = jqt.qat.merge(trainable, frozen)
    ...     return jnp.sum(jqt.quantize(f, qp, simulate=True)(w, x))
    >>> g = jax.grad(loss)(trainable, frozen)    # a gradient for the weights only
    >>> g[0]
    Array([[1., 1.],
           [1., 1.]], dtype=float32)
    """
    _check(params, qparams, "split")
    lab = labels(params, qparams, train=train)
    state = (params, qparams)
    trainable = jax.tree.map(lambda l, x: x if l == _TRAIN else None, lab, state)
    frozen = jax.tree.map(lambda l, x: None if l == _TRAIN else x, lab, state)
    return trainable, frozen


def merge(trainable, frozen) -> tuple[Any, dict]:
    """Inverse of :func:`jqt.qat.split`: the pair ``(params, qparams)``, each leaf from the
    half that holds it (``eqx.combine``).

    >>> import jax.numpy as jnp, jqt
    >>> w = {"k": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    >>> qp = jqt.calibrate(lambda w, x: x @ w["k"] + w["b"], jqt.recipes.w8a8(), w,
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> trainable, frozen = jqt.qat.split(w, qp, train="scales")
    >>> w2, qp2 = jqt.qat.merge(trainable, frozen)
    >>> w2["k"] is w["k"], qp2["k"].lhs.scale is qp["k"].lhs.scale
    (True, True)
    """
    if trainable is frozen and jax.tree_util.tree_leaves(trainable):
        raise ValueError("jqt.qat.merge: trainable and frozen are the same object; pass the two "
                         "halves jqt.qat.split returned: merge(trainable, frozen).")
    for name, half in (("trainable", trainable), ("frozen", frozen)):
        if not (isinstance(half, (tuple, list)) and len(half) == 2):  # (params, qparams): params back
            raise TypeError(f"jqt.qat.merge: {name} is a {type(half).__name__}"
                            + (f" of {len(half)}" if isinstance(half, (tuple, list)) else "")
                            + "; each half jqt.qat.split returns is a pair (params, qparams): "
                            "merge(trainable, frozen) with trainable, frozen = jqt.qat.split(...).")
    is_none = lambda x: x is None
    both = []  # a leaf in each half: the halves of two splits (each leaf is in one of a split's)

    def pick(path, t, f):
        if t is not None and f is not None and not both:
            both.append(jax.tree_util.keystr(path))
        return f if t is None else t
    try:
        out = jax.tree_util.tree_map_with_path(pick, trainable, frozen, is_leaf=is_none)
    except ValueError as e:
        raise ValueError(
            "jqt.qat.merge: trainable and frozen do not have the same pytree structure, so "
            "they are not the two halves of one jqt.qat.split call (an optax update keeps the "
            "structure of what it updates: pass its result with the frozen half of the same "
            f"split). JAX: {e}") from None
    if both:
        raise ValueError(
            f"jqt.qat.merge: both halves hold the leaf at {both[0]}, so they are not the two "
            "halves of one jqt.qat.split call, which puts each leaf in one of them (halves "
            "of two splits with different train= leave other leaves in neither: None in "
            "the merged tree). Pass the trainable half with the frozen half of its split.")
    return out


def project(qparams, *, min_scale: float = 1e-8) -> dict:
    """``qparams`` moved back into their domain after an optimizer update.

    Scales are clamped to at least ``min_scale`` (a step larger than a scale
    would make it zero or negative: a division by zero, or a sign flip of the
    operand); zero points are clipped to their type's ``[qmin, qmax]`` (a zero
    point outside it cannot be stored as a code: the int8 padding value of a
    convolution would wrap); smoothing factors are clamped as scales are.
    A scale of a dtype in which ``min_scale`` rounds to 0 (float16 qparams: 1e-8) is
    clamped to the dtype's smallest positive value instead; a float32 or bfloat16 scale
    to at least the smallest normal value (1.2e-38: XLA flushes smaller ones to 0).
    Non-finite values (a diverged step) are repaired too: a NaN scale becomes
    ``min_scale``, a NaN smoothing factor 1 (no smoothing), a NaN zero point 0
    (then clipped), and an infinite scale or smoothing factor the largest finite
    value of its dtype, the zero point of such a scale 0 (then clipped), so that its codes
    and zero point are 0 and every path gives zeros (``-inf`` is clamped as a negative
    value is); an fp8 scale is
    clamped to at most that value divided by the format's bits unit (256 for e4m3,
    32768 for e5m2), whose product with the scale must stay finite. jqt computes with
    scales in float32: float64 qparams are kept within float32's normal range, and the
    fp8 bound is float32's whatever the dtype (a float16 e5m2 scale of 16 is in it). The result
    passes the checks of :func:`jqt.quantize`, :func:`jqt.pack`, :func:`jqt.save` and
    :func:`jqt.save_packed`. Leaves that are ``None`` (the frozen half of a
    :func:`jqt.qat.split`) stay ``None``; values already in the domain are returned
    unchanged, bit for bit. Jittable.

    The result counts as fine-tuned: :func:`jqt.pack` packs weights with it without
    comparing them against the weights it was calibrated with (weights trained through
    the simulated path may lie past the grid's end, clipped there as ``pack`` clips them;
    ``WeightSource.calibrated_reach`` is dropped).

    >>> import jax.numpy as jnp, jqt
    >>> f = lambda w, x: x @ w
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), jnp.eye(2), [(jnp.ones((1, 2)),)], progress=False)
    >>> import dataclasses
    >>> a = dataclasses.replace(qp["w"].lhs, scale=jnp.float32(-0.1), zero_point=jnp.float32(300.4))
    >>> jqt.qat.project({"w": dataclasses.replace(qp["w"], lhs=a)})["w"].lhs
    QArray(int8 asym per-tensor, scale=1e-08, zero_point=127)
    """
    if not isinstance(qparams, dict):
        raise TypeError(f"jqt.qat.project: expected a qparams dict, got {type(qparams).__name__}; "
                        "project the qparams half of the state: (params, jqt.qat.project(qp)).")
    validate.check_alive(qparams, "jqt.qat.project", "qparams")  # (donated to a jitted step)
    if not compat.is_tracer(min_scale):
        try:  # (a bool or a str is no number: True floored every scale at 1.0)
            ok = (not isinstance(min_scale, (bool, np.bool_, str, bytes))
                  and np.ndim(min_scale) == 0 and np.asarray(min_scale).dtype.kind in "iuf"
                  and np.isfinite(float(min_scale)) and float(min_scale) > 0)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"jqt.qat.project: min_scale={min_scale!r} is not a finite number "
                             "above 0; scales are clamped to at least min_scale, so pass a small "
                             "positive float (the default is 1e-8).")

    def fix(q, where):
        if q is None:
            return None
        s, z = q.scale, q.zero_point
        for name, a in (("scale", s), ("zero_point", z)):
            if isinstance(a, str):  # jqt.qat.labels' tree: one label per leaf
                raise TypeError(f"jqt.qat.project: {where}.{name} is the string {a!r}, not an "
                                "array: that is a labels tree (jqt.qat.labels); project the "
                                "qparams themselves.")
        inf = None
        if s is not None:
            # (and a float64 one beyond float32's range, clamped to its largest value too)
            # (in the scale's dtype: float32's largest value is inf in bfloat16 and float16,
            # and a bfloat16 scale of inf compared unequal to it, its zero point kept)
            a = jnp.asarray(s) if not isinstance(s, str) else None
            if a is not None and jnp.issubdtype(a.dtype, jnp.floating):
                cap = jnp.asarray(min(float(jnp.finfo(a.dtype).max), _F32_MAX), a.dtype)
                inf = jnp.isposinf(a) | (a > cap)
            s = positive(s, min_scale, f"{where}.scale")
            unit = nx.FP8_BITS_UNIT.get(q.qtype.grid)
            if unit is not None:  # fp8: the scale is taken times the bits unit (XLA may
                # fold it in first): at most a value whose product stays finite, else an
                # infinite product times a code of 0 is NaN
                # (jqt computes with scales in float32, whatever dtype the qparams hold: a
                # float16 e5m2 scale of 16 is fine, not capped at 65504 / 32768 = 2)
                dt = jnp.result_type(s)
                cap = np.asarray(min(_F32_MAX / unit, float(jnp.finfo(dt).max)), dt)
                if float(cap) * unit > _F32_MAX:  # rounded up in a short mantissa (bfloat16)
                    cap = np.asarray(float(jnp.finfo(dt).max) / unit, dt)  # exact: unit is 2**k
                s = jnp.minimum(s, jnp.asarray(cap, dt))
        if z is not None:
            z = jnp.asarray(z)
            z = jnp.where(jnp.isnan(z), jnp.zeros_like(z), z)
            if inf is not None and np.broadcast_shapes(inf.shape, z.shape) == z.shape:
                # a scale repaired from inf: its codes are 0, and so is its zero point, so every
                # path gives exact zeros (the integer path's x.c - z.sum(x), times the largest
                # float, gave 1e33; hunt69_qatnew)
                z = jnp.where(inf, jnp.zeros_like(z), z)
            z = jnp.clip(z, q.qtype.qmin, q.qtype.qmax).astype(jnp.result_type(z))
        return dataclasses.replace(q, scale=s, zero_point=z)

    def positive(a, nan, where):
        if isinstance(a, str):  # a labels tree's smoothing leaf
            raise TypeError(f"jqt.qat.project: {where} is the string {a!r}, not an array: that "
                            "is a labels tree (jqt.qat.labels); project the qparams themselves.")
        a = jnp.asarray(a)
        dt = jnp.result_type(a)
        if not jnp.issubdtype(dt, jnp.floating):
            raise TypeError(f"jqt.qat.project: {where} holds {dt} values; scales and smoothing "
                            "factors are floats (an optimizer cannot step an integer leaf): "
                            "give it a float dtype, e.g. jnp.float32.")
        # a floor the dtype holds, also for a traced min_scale: 1e-8 rounds to 0 in float16
        # (whose smallest value, subnormal, is 6e-8); a subnormal float32 (bfloat16) floor
        # XLA flushes to 0, so those take at least the smallest normal value
        fi = jnp.finfo(dt)
        if not compat.is_tracer(min_scale) and float(min_scale) > float(fi.max):
            raise ValueError(f"jqt.qat.project: min_scale={min_scale!r} is above the largest "
                             f"{dt} value ({float(fi.max):.6g}), the dtype of {where}: every "
                             "scale would become inf. Pass a small positive float (the default "
                             "is 1e-8).")
        lowest = fi.smallest_subnormal if dt == jnp.float16 else fi.tiny
        # float64 qparams: jqt computes in float32, where a scale beyond its range is inf or
        # 0 (inf times a code of 0 is NaN): keep them within float32's normal range
        lowest = max(float(lowest), _F32_TINY) if fi.bits > 32 else lowest
        top = jnp.asarray(min(float(fi.max), _F32_MAX), dt)
        floor = jnp.maximum(jnp.asarray(min_scale, dt), jnp.asarray(lowest, dt))
        a = jnp.where(jnp.isnan(a), jnp.maximum(jnp.asarray(nan, dt), floor), a)
        return jnp.clip(a, floor, top)

    out = {}
    for k, p in qparams.items():
        if not isinstance(p, OpQParams):
            raise TypeError(f"jqt.qat.project: qparams['{k}'] is a {type(p).__name__}; expected "
                            "jqt.OpQParams.")
        sm = p.smooth  # a smoothing factor stays positive, as a scale does
        sm = None if sm is None else positive(sm, 1.0, f"qparams['{k}'].smooth")
        src = p.source  # fine-tuned: jqt.pack takes the weights as trained with these qparams
        if src is not None and src.calibrated_reach is not None:
            src = dataclasses.replace(src, calibrated_reach=None)
        out[k] = dataclasses.replace(p, lhs=fix(p.lhs, f"qparams['{k}'].lhs"),
                                    rhs=fix(p.rhs, f"qparams['{k}'].rhs"), smooth=sm, source=src)
    return out


__all__ = ["PARTS", "labels", "merge", "parts", "project", "split"]
