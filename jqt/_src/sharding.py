"""``jqt.packed_shardings``: ``NamedSharding`` pytrees that keep each packed int8 weight
together with its per-channel scale (and zero point) and its int32 sums.

A packed weight is stored 2-D for most matmuls (``"nk"``: ``(N, K)`` for int8 x int8,
``"kn"``: ``(K, N)`` for weight-only; stacked layers keep leading ``(L, ...)`` axes)
and in the op's own layout otherwise (``"operand"``: convolution kernels, weights with
batch axes). Its scale lives in the qparams, in the *operand's* layout with size 1 on
contracted axes (``(1, N)`` for a ``(K, N)`` kernel). Sharding the output features
means a different axis of each of the three arrays; this module finds it.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import diagnostics, validate
from .qparams import OpQParams, PackedParams, QArray

_MODES = ("out", "in", None)


def _spec(ndim, dim, axis):
    if dim is None:
        return P()
    return P(*([None] * dim + [axis] + [None] * (ndim - dim - 1)))


def _first_match(rules, name, default, used=None):
    for i, (pattern, value) in enumerate(rules):
        if re.search(pattern, name):
            if used is not None:
                used.add(i)
            return value
    return default


def _warn_unused(name, rules, used, names, what, note="", float_ops=(), weightless=()):
    """Warns of each rule of ``rules`` that was the first match of no name (``float_ops``:
    op keys kept float, which an ``ops`` rule does not place; ``weightless``: quantized ops
    with no packed weight, key/value cache writes and activation x activation ops)."""
    listed = ", ".join(repr(n) for n in names[:6]) + (" ..." if len(names) > 6 else "") + note
    for i, rule in enumerate(rules):
        if i not in used:
            taken = any(re.search(rule[0], n) for n in names)
            kept = [k for k in float_ops if re.search(rule[0], k)]
            bare = [k for k in weightless if re.search(rule[0], k)]
            taken = taken and not set(n for n in names if re.search(rule[0], n)) <= set(bare)
            why = ("an earlier rule takes every one it matches; move it ahead of them" if taken
                   else f"it matches only ops without a packed weight "
                   f"({', '.join(map(repr, bare[:6]))}: key/value cache writes, activation x "
                   "activation ops, weights f computes at run time, whose float leaves a leaves= "
                   "rule places), which it does not place" if bare
                   else f"it matches only ops kept float ({', '.join(map(repr, kept[:6]))}), "
                   "whose weights are kept float leaves: place them with a leaves= rule" if kept
                   else f"its pattern matches none of the {what} ({listed or 'none'}); check it")
            diagnostics.warn(f"jqt.packed_shardings: {name} rule {i} {tuple(rule)!r} decides "
                             f"nothing: {why}.")


def _check_leaf_spec(path, spec, aval, mesh):
    """Refuses a ``leaves=`` spec that cannot place the kept leaf at ``path`` (more entries
    than its rank, an axis the mesh lacks, a size the axis does not divide), naming the leaf;
    JAX's own error, raised later by device_put, names neither leaf nor rule."""
    shape = tuple(getattr(aval, "shape", np.shape(aval)))
    fix = "change the leaves= rule, or add an earlier rule for this leaf (None replicates it)"
    if len(spec) > len(shape):
        raise ValueError(f"jqt.packed_shardings: leaves= gives the kept leaf '{path}' "
                         f"(shape {shape}) the spec {spec}, which has {len(spec)} entries for "
                         f"{len(shape)} dimensions; {fix}.")
    try:
        NamedSharding(mesh, spec).shard_shape(shape)
    except Exception as e:  # noqa: BLE001 - ValueError, or JAX's DuplicateSpecError (not public)
        raise ValueError(f"jqt.packed_shardings: leaves= gives the kept leaf '{path}' "
                         f"(shape {shape}) the spec {spec}, which does not fit the mesh "
                         f"{dict(mesh.shape)}: {e}; {fix}.") from None


def _free_axes(op: OpQParams, ndim: int, depth: int):
    """Axes of the weight operand (after ``depth`` stacked axes) that are neither
    contracted nor batch: the output features."""
    src = op.source
    if src is None:
        return []
    return [d + depth for d in range(ndim - depth) if d not in src.contract and d not in src.batch]


def _contract_axes(op: OpQParams, ndim: int, depth: int):
    src = op.source
    return [] if src is None else [d + depth for d in src.contract if d + depth < ndim]


def _group_axis(op: OpQParams, wq: QArray, depth: int, pw: QArray):
    """The axis of a grouped weight's scale that holds its groups, where a ``"in"`` split
    of the packed ``"nk"``/``"kn"`` weight's ``K`` splits the groups with it (one
    contracted axis, the scale's groups along it); else None (scale replicated)."""
    if not wq.qtype.group_size or wq.scale is None or pw.layout not in ("nk", "kn"):
        return None
    shape = np.shape(wq.scale)
    contract = _contract_axes(op, len(shape), depth)
    return contract[0] if len(contract) == 1 and shape[contract[0]] > 1 else None


def _block_spec(op: OpQParams):
    """The spec of the leading axes of an op's arrays where a ``jax.shard_map`` of the
    function splits its weight into blocks (``("shard_split", ...)`` in its chain): each
    split axis's mesh axes, ``None`` for a scan's layers (so ``P()`` for a weight the
    ``shard_map`` hands every device whole: replicated); ``None`` for ops outside any
    ``shard_map``."""
    if op.source is None or not any(c[0] == "shard_split" for c in op.source.chain):
        return None
    lead = []
    for c in op.source.chain:
        if c[0] == "scan_slice":
            lead.append(None)
        elif c[0] == "shard_split":
            lead += [names[0] if len(names) == 1 else tuple(names) for _, _, names in c[1]]
    return P(*lead)


def _recorded_split(aval, mesh):
    """The ``PartitionSpec`` of a kept leaf's explicit split, which ``aval`` records
    (:func:`jqt.pack` of split params, ``jqt.load_packed(like=)``), where ``mesh`` has its
    axes and their sizes divide the leaf's (another mesh may not); ``None`` otherwise."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    dims = [(d, (e,) if isinstance(e, str) else tuple(e or ())) for d, e in enumerate(spec or ())]
    names = [n for _, ns in dims for n in ns]
    if not names or not all(n in mesh.shape for n in names):
        return None
    shape = tuple(aval.shape)
    fits = all(d < len(shape) and shape[d] % math.prod(mesh.shape[n] for n in ns) == 0
               for d, ns in dims if ns)
    return spec if fits else None


def packed_shardings(qparams: dict, packed: PackedParams, mesh, *, axis: str = "model",
                     ops: Sequence[tuple[str, str | None]] = (),
                     leaves: Sequence[tuple[str, Any]] = ()):
    """``(qparams_shardings, packed_shardings)``: pytrees of ``NamedSharding`` on ``mesh``
    with the structure of ``qparams`` and ``packed``, for ``jax.device_put``.

    Each packed weight is split over the mesh axis ``axis`` along its output features
    (``"out"``, the default: the ``N`` axis of a ``"nk"``/``"kn"`` weight, the first
    output-feature axis of an ``"operand"`` weight), together with its int32 sums and
    its per-channel scale and zero point in ``qparams``; or along its contracted
    features (``"in"``: the ``K`` axis of the weight; per-channel scales and sums
    replicated, a grouped weight's scale, zero point and sums split by group with it:
    each device computes a partial sum, which XLA all-reduces); or replicated (``None``).
    An axis whose size the mesh axis does not divide is replicated. Activation
    scales and zero points are replicated. An op whose weight the function's own
    ``jax.shard_map`` splits (one set of codes and scales per block, stacked in front) is
    split as that ``shard_map`` splits it, whatever ``axis`` and ``ops`` say, and one it
    hands every device whole (``P()`` in its ``in_specs``) is replicated. Float leaves
    kept in ``packed`` (biases, norms) are replicated unless a ``leaves`` rule says
    otherwise, or they were split over explicit mesh axes (packed from split params, or
    loaded with a split ``like=``): then split so, where ``mesh`` has those axes.

    Args:
      qparams: the qparams the weights were packed with.
      packed: from :func:`jqt.pack` or :func:`jqt.load_packed` (arrays, NumPy arrays or
        anything with ``.shape``).
      mesh: a ``jax.sharding.Mesh``.
      axis: the mesh axis that splits the weights.
      ops: ``(regex, "out" | "in" | None)`` pairs; the first whose regex matches
        (``re.search``) an op key decides for that op (default ``"out"``).
      leaves: ``(regex, PartitionSpec | None)`` pairs for the kept float leaves, matched
        on their path (``"params/Dense_0/bias"``); default replicated.

    >>> import jax, jax.numpy as jnp, numpy as np, jqt
    >>> from jax.sharding import Mesh
    >>> f = lambda p, x: x @ p["w"] + p["b"]
    >>> p = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(jnp.ones((2, 8)),)], progress=False)
    >>> packed = jqt.pack(qp, p)
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    >>> qs, ps = jqt.packed_shardings(qp, packed, mesh)
    >>> ps.weights["w"].values.spec, qs["w"].rhs.scale.spec     # (N, K) weight, (1, N) scale
    (P('model', None), P(None, 'model'))
    >>> qp, packed = jax.device_put((qp, packed), (qs, ps))
    """
    if not isinstance(packed, PackedParams):
        raise TypeError(f"jqt.packed_shardings: packed is a {type(packed).__name__}; expected the "
                        "jqt.PackedParams returned by jqt.pack or jqt.load_packed.")
    validate.check_mesh(mesh, "jqt.packed_shardings", abstract=True)
    if not isinstance(qparams, dict):
        raise TypeError(f"jqt.packed_shardings: qparams is a {type(qparams).__name__}; expected the "
                        "dict jqt.calibrate returns (op key -> jqt.OpQParams).")
    if not isinstance(axis, str):
        raise TypeError(f"jqt.packed_shardings: axis={axis!r}; expected the name of one mesh axis "
                        f"(one of {tuple(mesh.shape)}).")
    for name, rules in (("ops", ops), ("leaves", leaves)):
        if isinstance(rules, (str, dict)) or (isinstance(rules, tuple) and rules
                                              and isinstance(rules[0], str)):
            example = "[('attn', 'in')]" if name == "ops" else "[('bias', P())]"
            raise TypeError(f"jqt.packed_shardings: {name}={rules!r}; expected a list of "
                            f"(regex, {'mode' if name == 'ops' else 'PartitionSpec'}) pairs, e.g. "
                            f"{name}={example}.")
    ops, leaves = tuple(ops), tuple(leaves)  # read twice: checked here, matched below
    for name, rules in (("ops", ops), ("leaves", leaves)):
        for rule in rules:
            if not isinstance(rule, (tuple, list)) or len(rule) != 2:
                raise ValueError(f"jqt.packed_shardings: {name} rule {rule!r}: expected a pair "
                                 "(regex, value).")
            try:
                re.compile(rule[0])
            except (re.error, TypeError) as e:
                raise ValueError(f"jqt.packed_shardings: {name} rule {rule!r}: its first item must "
                                 f"be a regular expression ({e}).") from None
            if name == "ops" and rule[1] not in _MODES:
                raise ValueError(f"jqt.packed_shardings: ops rule {rule!r} gives {rule[1]!r}; use "
                                 "'out', 'in' or None.")
            if name == "leaves" and rule[1] is not None and not isinstance(rule[1], P):
                raise ValueError(f"jqt.packed_shardings: leaves rule {rule!r} gives {rule[1]!r}; "
                                 "use a jax.sharding.PartitionSpec or None.")
    # ops without a weight (activation x activation, caches) carry replicated scales only
    if axis not in mesh.shape and not all(_block_spec(op) is not None for op in qparams.values()
                                          if isinstance(op, OpQParams) and op.source is not None):
        raise ValueError(f"jqt.packed_shardings: the mesh has axes {tuple(mesh.shape)}, "
                         f"not {axis!r}; pass axis= the mesh axis that splits the weights "
                         f"(e.g. axis={next(iter(mesh.shape))!r}).")
    size = mesh.shape.get(axis, 1)
    rep = NamedSharding(mesh, P())

    def sharding(shape, dim):
        if dim is None or dim >= len(shape) or shape[dim] % size:
            return rep
        return NamedSharding(mesh, _spec(len(shape), dim, axis))

    def arr(a, dim):
        return None if a is None else sharding(tuple(np.shape(a)), dim)

    qp_sh, w_sh, used_ops, used_leaves = {}, {}, set(), set()
    for key, op in qparams.items():
        if not isinstance(op, OpQParams):
            raise TypeError(f"jqt.packed_shardings: qparams['{key}'] is a {type(op).__name__}; "
                            "expected jqt.OpQParams.")
        # (a rule decides only where a packed weight is: a cache write's or an activation x
        # activation op's qparams are placed alike whatever it says)
        mode = _first_match(ops, key, "out", used_ops if not op.is_float and key in packed.weights
                            else None)
        pw = packed.weights.get(key)
        blocks = _block_spec(op)
        if blocks is not None:  # split by the function's own jax.shard_map: as it splits them
            missing = [n for e in blocks for n in ((e,) if isinstance(e, str) else e or ())
                       if n not in mesh.shape]
            if missing:
                raise ValueError(f"jqt.packed_shardings: op '{key}' reads its weight in blocks a "
                                 f"jax.shard_map splits over mesh axes {missing}, which the mesh "
                                 f"(axes {tuple(mesh.shape)}) lacks; pass the shard_map's mesh.")
            for c in op.source.chain:
                for _, n, names in (c[1] if c[0] == "shard_split" else ()):
                    if math.prod(mesh.shape[a] for a in names) != n:
                        raise ValueError(
                            f"jqt.packed_shardings: op '{key}' reads its weight in {n} blocks a "
                            f"jax.shard_map splits over mesh axes {list(names)}, which have "
                            f"{math.prod(mesh.shape[a] for a in names)} devices in this mesh "
                            f"({dict(mesh.shape)}); pass the shard_map's mesh.")
            put = lambda a: NamedSharding(mesh, blocks)
            qp_sh[key] = jax.tree_util.tree_map(put, op)
            if pw is not None:
                w_sh[key] = jax.tree_util.tree_map(put, pw)
            continue
        w = op.weight_operand
        depth = op.source.stack_depth if op.source is not None else 0
        wq = None if w is None else op.operand(w)
        scale_dim = None
        if pw is not None and wq is not None and mode == "out":
            nd = np.ndim(wq.scale) if wq.scale is not None else 0
            free = _free_axes(op, nd, depth) if nd else []
            scale_dim = free[0] if free else None
        elif pw is not None and wq is not None and mode == "in":
            scale_dim = _group_axis(op, wq, depth, pw)
        sides = []
        for i, q in enumerate((op.lhs, op.rhs)):
            if q is None:
                sides.append(None)
                continue
            d = scale_dim if i == w else None
            sides.append(QArray(scale=arr(q.scale, d), zero_point=arr(q.zero_point, d),
                                qtype=q.qtype))
        qp_sh[key] = OpQParams(lhs=sides[0], rhs=sides[1], op=op.op, weight_operand=w,
                               source=op.source, note=op.note, rotate=op.rotate,
                               accumulator=op.accumulator,
                               smooth=None if op.smooth is None else rep)  # K-long: replicated
        if pw is None:
            continue
        if pw.values is None:  # a table tied to a matmul's codes: its scales only
            w_sh[key] = dataclasses.replace(pw, scale=sides[w].scale, zero_point=sides[w].zero_point,
                                            smooth=None if pw.smooth is None else rep)
            continue
        shape = tuple(np.shape(pw.values))
        nd = len(shape)
        if pw.layout in ("nk", "kn"):
            n_dim, k_dim = (nd - 2, nd - 1) if pw.layout == "nk" else (nd - 1, nd - 2)
            # sums are (..., N), or per group (..., N, G) ("nk") / (..., G, N) ("kn")
            grouped = bool(pw.qtype.group_size) and pw.layout == "nk"
            n_sum = None if pw.sums is None else np.ndim(pw.sums) - (2 if grouped else 1)
            # "in": a grouped weight's sums split by group with its K ("nk": (..., N, G),
            # "kn": (..., G, N)); per-channel sums are replicated
            g_sum = None
            if pw.sums is not None and scale_dim is not None:
                g_sum = np.ndim(pw.sums) - (1 if pw.layout == "nk" else 2)
            qdim, sdim = {"out": (n_dim, n_sum), "in": (k_dim, g_sum),
                          None: (None, None)}[mode]
        else:
            free, contract = _free_axes(op, nd, depth), _contract_axes(op, nd, depth)
            if mode == "out":
                qdim = sdim = free[0] if free else None
            elif mode == "in" and contract:
                # the largest contracted axis (a conv kernel's input features, not its window)
                qdim, sdim = max(contract, key=lambda d: shape[d]), None
            else:
                qdim = sdim = None
        w_sh[key] = QArray(values=sharding(shape, qdim), sums=arr(pw.sums, sdim),
                           scale=sides[w].scale if sides[w] is not None else None,
                           zero_point=sides[w].zero_point if sides[w] is not None else None,
                           qtype=pw.qtype, layout=pw.layout, folded=pw.folded,
                           smooth=None if pw.smooth is None else rep)  # K-long: replicated
    missing = sorted(set(packed.weights) - set(w_sh))
    if missing:
        raise ValueError(f"jqt.packed_shardings: the packed weights hold ops {missing[:5]} that "
                         "the qparams do not have; pass the qparams they were packed with.")
    from .packed_io import leaf_paths
    paths = leaf_paths(packed)
    leaf_sh = []
    for i, x in zip(packed.kept, packed.leaves):
        spec = _first_match(leaves, paths[i], None, used_leaves)
        if spec is not None:
            _check_leaf_spec(paths[i], spec, packed.avals[i], mesh)
        spec = _recorded_split(packed.avals[i], mesh) if spec is None else spec
        leaf_sh.append(rep if spec is None else NamedSharding(mesh, spec))
    _warn_unused("ops", ops, used_ops, [k for k, op in qparams.items() if not op.is_float],
                 "quantized op keys", float_ops=[k for k, op in qparams.items()
                                                 if op.is_float and op.weight_operand is not None],
                 weightless=[k for k, op in qparams.items()
                             if not op.is_float and k not in packed.weights])
    _warn_unused("leaves", leaves, used_leaves, [paths[i] for i in packed.kept],
                 "kept float leaves", "; jqt.pack drops the weights it packs")
    out = PackedParams(leaf_sh, {k: w_sh[k] for k in packed.weights}, packed.treedef, packed.avals,
                       packed.kept, packed.tied)
    return qp_sh, out
