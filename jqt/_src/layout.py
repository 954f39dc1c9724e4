"""Layout-only ops that lead from a weight leaf to the operand of an op.

jqt follows a weight from its leaf in the params pytree through these ops
(transpose, reshape, cast, ...) to the ``dot_general``/``conv`` that reads it.
The steps are recorded as plain tuples, so that :func:`jqt.pack` can replay
them on the leaf without tracing the function again, and so that they can be
saved with the quantization parameters.
"""
from __future__ import annotations

import jax
import numpy as np
from jax import lax

from . import compat


def _tup(x):
    return None if x is None else tuple(int(i) for i in x)


# primitive name -> function(eqn params) -> the recorded step, or None if the
# eqn is not a pure layout change.
def _reshape(p):
    return None if p.get("dimensions") is not None else ("reshape", _tup(p["new_sizes"]))


RECORDERS = {
    "transpose": lambda p: ("transpose", _tup(p["permutation"])),
    "reshape": _reshape,
    "convert_element_type": lambda p: ("convert", np.dtype(p["new_dtype"]).name),
    # lax.reduce_precision (a bfloat16 or fp8 weight emulated in float32): a cast's rounding
    "reduce_precision": lambda p: ("reduce_precision", int(p["exponent_bits"]), int(p["mantissa_bits"])),
    "broadcast_in_dim": lambda p: ("broadcast_in_dim", _tup(p["shape"]), _tup(p["broadcast_dimensions"])),
    "squeeze": lambda p: ("squeeze", _tup(p["dimensions"])),
    "slice": lambda p: ("slice", _tup(p["start_indices"]), _tup(p["limit_indices"]), _tup(p["strides"])),
    "rev": lambda p: ("rev", _tup(p["dimensions"])),
    "copy": lambda p: ("copy",),
    "copy_p": lambda p: ("copy",),
    "stop_gradient": lambda p: ("copy",),
    # inside jax.shard_map: the same values, typed as varying over mesh axes for an op
    # with a varying operand (a replicated weight times a split activation)
    "pvary": lambda p: ("copy",),
    "reshard": lambda p: ("copy",),
    # value identities that name or place a value: jax.ad_checkpoint.checkpoint_name (for a
    # remat policy), lax.with_sharding_constraint, lax.optimization_barrier (one operand;
    # several: analysis.py follows each through)
    "name": lambda p: ("copy",),
    "sharding_constraint": lambda p: ("copy",),
    "optimization_barrier": lambda p: ("copy",),
    "device_put": lambda p: ("copy",),  # jax.device_put inside f: the same values, placed
}

# the value identities: their step reads no parameter
_COPIES = frozenset(("copy", "copy_p", "stop_gradient", "pvary", "reshard", "name",
                     "sharding_constraint", "optimization_barrier", "device_put"))
assert all(RECORDERS[k]({}) == ("copy",) for k in _COPIES)

_APPLY = {
    "transpose": lambda x, perm: lax.transpose(x, perm),
    "reshape": lambda x, sizes: lax.reshape(x, sizes),
    "convert": lambda x, dt: x.astype(np.dtype(dt)),
    "reduce_precision": lambda x, e, m: lax.reduce_precision(x, e, m),
    "broadcast_in_dim": lambda x, shape, dims: lax.broadcast_in_dim(x, shape, dims),
    "squeeze": lambda x, dims: lax.squeeze(x, dims),
    "slice": lambda x, s, l, st: lax.slice(x, s, l, st),
    "rev": lambda x, dims: lax.rev(x, dims),
    "copy": lambda x: x,
}


_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")  # (a squeeze where
# every reduced axis has length 1)


def record(eqn):
    """The step for a layout-only ``eqn``, or ``None``: also for one whose shapes have
    symbolic dimensions (``jax.export`` of a variable batch size), which reads no weight,
    a value identity aside (an ``optimization_barrier`` over a weight and an activation of
    a symbolic batch passes the weight on as it is)."""
    if eqn.primitive.name == "dynamic_slice":
        return constant_window(eqn)
    if eqn.primitive.name in _REDUCTIONS:  # over axes of length 1: einsum "bk,okn->bn" of
        shape, axes = eqn.invars[0].aval.shape, _tup(eqn.params["axes"])  # a (1, K, N) weight
        return ("squeeze", axes) if axes and all(shape[a] == 1 for a in axes) else None
    rec = RECORDERS.get(eqn.primitive.name)
    if rec is None:
        return None
    if not all(isinstance(d, int) for v in eqn.outvars for d in v.aval.shape):
        # (the other recorders read sizes, which are symbolic here)
        return ("copy",) if eqn.primitive.name in _COPIES else None
    return rec(eqn.params)


def constant_window(eqn, starts=None):
    """``lax.dynamic_slice`` (``dynamic_slice_in_dim``) at literal starts: the ``slice``
    it is, its starts clamped into the operand as ``dynamic_slice`` clamps them; ``None``
    where a start comes from a value (a lookup at a traced index,
    :class:`jqt._src.registry.RowLookup`, or a layer's weight read in a loop; and
    ``dynamic_index_in_dim``, whose start JAX passes into a ``jit`` of its own: the
    analysis passes ``starts`` it knows, made from literals).

    >>> import jax
    >>> f = lambda w: jax.lax.dynamic_slice(w, (0, 5), (4, 2))
    >>> record(jax.make_jaxpr(f)(jax.numpy.ones((4, 6))).eqns[0])
    ('slice', (0, 4), (4, 6), None)
    """
    shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
    if starts is None:
        if not all(compat.is_literal(v) and np.ndim(v.val) == 0 for v in eqn.invars[1:]):
            return None
        starts = [v.val for v in eqn.invars[1:]]
    if not all(isinstance(d, int) for d in (*shape, *sizes)):
        return None
    lo = tuple(min(max(int(v), 0), n - k) for v, n, k in zip(starts, shape, sizes))
    return ("slice", lo, tuple(a + k for a, k in zip(lo, sizes)), None)  # (as w[:, a:b] records)


def record_each(eqn):
    """The steps (a tuple per output) for a layout-only ``eqn`` that is several steps: with
    several outputs, each a part of its one operand, ``split`` (``jnp.split``: slices) and
    ``unstack`` (``jnp.unstack``: a slice and a squeeze each); a ``reshape`` with
    ``dimensions`` (a transpose, then the reshape); else ``None``.

    >>> import jax, jax.numpy as jnp
    >>> eqn = jax.make_jaxpr(lambda w: jnp.split(w, 2, 1))(jnp.ones((4, 6))).eqns[0]
    >>> record_each(eqn)[1]
    (('slice', (0, 3), (4, 6), (1, 1)),)
    """
    name = eqn.primitive.name
    if name not in ("split", "unstack", "reshape") or len(eqn.invars) != 1 \
            or (name == "reshape" and eqn.params.get("dimensions") is None):
        return None
    shape = eqn.invars[0].aval.shape
    if not all(isinstance(d, int) for v in (*eqn.invars, *eqn.outvars) for d in v.aval.shape):
        return None
    if name == "reshape":
        # a transpose, then a reshape (jax.vmap of a conv over stacked kernels folds the
        # mapped axis into the output features so)
        return [(("transpose", _tup(eqn.params["dimensions"])), ("reshape", _tup(eqn.params["new_sizes"])))]
    axis = int(eqn.params["axis"]) % len(shape)
    sizes = [int(n) for n in eqn.params["sizes"]] if name == "split" else [1] * shape[axis]
    steps, start = [], 0
    for n in sizes:
        lo = tuple(start if d == axis else 0 for d in range(len(shape)))
        hi = tuple(start + n if d == axis else shape[d] for d in range(len(shape)))
        step = (("slice", lo, hi, (1,) * len(shape)),)
        steps.append(step + ((("squeeze", (axis,)),) if name == "unstack" else ()))
        start += n
    return steps


def split_blocks(x, splits):
    """``x`` split into the blocks a ``jax.shard_map`` hands each device: ``splits`` holds
    ``(axis, blocks, mesh axis names)`` per split axis; each becomes a leading axis of
    ``blocks`` (in the order of ``splits``), the block's own axes following in their order.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(12).reshape(3, 4)
    >>> b = split_blocks(x, ((1, 2, ("x",)),))
    >>> b.shape, b[1].tolist() == x[:, 2:].tolist()
    ((2, 3, 2), True)
    """
    by_axis = {d: n for d, n, _ in splits}
    shape, blocks, rest = [], [], []
    for d, size in enumerate(x.shape):
        if d in by_axis:
            blocks.append(len(shape))
            shape += [by_axis[d], size // by_axis[d]]
            rest.append(len(shape) - 1)
        else:
            rest.append(len(shape))
            shape.append(size)
    order = {d: b for (d, _, _), b in zip(sorted(splits), blocks)}
    return lax.transpose(x.reshape(shape), tuple(order[d] for d, _, _ in splits) + tuple(rest))


def apply_chain(x, chain):
    """Replays ``chain`` on ``x``; steps after k ``scan_slice`` markers run under k vmaps,
    and so do those after a ``shard_split`` of k axes (:func:`split_blocks`).

    >>> import jax.numpy as jnp
    >>> apply_chain(jnp.ones((3, 4, 5)), (("scan_slice",), ("transpose", (1, 0)))).shape
    (3, 5, 4)
    """
    depth = 0
    for step in chain:
        name, args = step[0], step[1:]
        if name == "scan_slice":
            depth += 1
            continue
        if name == "shard_split":  # the blocks stacked in front, not split over devices
            # in their type (explicit mesh axes): stacked axes are batch axes of vmaps
            if not args[0]:  # a weight the shard_map hands every device whole
                continue
            x = compat.whole(x)
            fn = lambda v, splits=args[0]: split_blocks(v, splits)
            for _ in range(depth):
                fn = jax.vmap(fn)
            x = fn(x)
            depth += len(args[0])
            continue
        fn = lambda v, name=name, args=args: _APPLY[name](v, *args)
        for _ in range(depth):
            fn = jax.vmap(fn)
        x = fn(x)
    return x
