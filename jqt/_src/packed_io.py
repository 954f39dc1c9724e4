"""``jqt.save_packed`` / ``jqt.load_packed``: packed int8 weights in safetensors (format
``jqt.packed``, described in ``serialization.py``), and the check that packed weights fit
their qparams."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .analysis import path_str
from .formats import FLOAT8
from .handlers import QParamsMismatchError, values_shape
from .qparams import PackedParams, QArray
from .serialization import (FORMAT, PACKED_FORMAT, PACKED_READ, PACKED_VERSION, FormatError,
                            TreeNotSerializable, is_zip, qparams_entries, versioned,
                            qparams_from_entries, Reader, version_error, write,
                            aval_from_json, aval_to_json, qtype_from_json, qtype_to_json,
                            treedef_from_json, treedef_to_json)


def leaf_paths(packed: PackedParams) -> list[str]:
    n = len(packed.avals)
    tree = jax.tree_util.tree_unflatten(packed.treedef, list(range(n)))
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _unique(name, used):
    out, i = name, 1
    while out in used:
        out, i = f"{name}#{i}", i + 1
    used.add(out)
    return out


def save_packed(path, packed: PackedParams, qparams=None) -> None:
    """Saves :func:`jqt.pack`'s weights to ``path`` (a safetensors file, format
    ``jqt.packed``, see ``serialization.py``).

    The file holds each quantized weight's codes, int32 sums, scale and zero point
    (``packed/<op key>/values`` etc.), the float leaves kept (``params/<leaf path>``), the
    shape and dtype of every leaf of the original params and a JSON description of
    their tree (dicts with str or int keys, lists, tuples, ``None``, and node types
    registered with ``jax.export.register_pytree_node_serialization``; for any other
    node, :func:`jqt.load_packed` needs ``like=``).

    With ``qparams`` (the ones passed to :func:`jqt.pack`), the file also holds them:
    one file to deploy, :func:`jqt.load` reads the qparams back from it, and
    :func:`jqt.load_packed` checks that the weights match them. A weight scale the
    packed weight and the qparams share is stored once.

    >>> import os, tempfile, jax.numpy as jnp, jqt
    >>> f = lambda p, x: x @ p["w"] + p["b"]
    >>> p = {"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(jnp.ones((2, 8)),)], progress=False)
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> jqt.save_packed(path, jqt.pack(qp, p), qp)
    >>> packed, qp2 = jqt.load_packed(path), jqt.load(path)
    >>> packed.weights["w"].values.dtype, packed.weights["w"].layout
    (dtype('int8'), 'nk')
    """
    if not isinstance(packed, PackedParams):
        raise TypeError(f"jqt.save_packed: expected the jqt.PackedParams returned by jqt.pack, got "
                        f"a {type(packed).__name__}.")
    try:
        tree, why = treedef_to_json(packed.treedef), None
    except TreeNotSerializable as e:
        tree, why = None, str(e)
    paths = leaf_paths(packed)
    used, tensors = set(), {}
    leaves = []
    for i, x in zip(packed.kept, packed.leaves):
        n = _unique(f"params/{paths[i]}", used)
        tensors[n] = x
        leaves.append(n)
    entries, shared = None, {}
    if qparams is not None:
        check_packed(packed, qparams, fn="jqt.save_packed")
        entries, arrays = qparams_entries(
            qparams, lambda i, key, side, field: _unique(f"qparams/{key}/{side}.{field}", used))
        tensors.update(arrays)
        shared = _weight_scales(entries, arrays)
    weights = {}
    for key, w in packed.weights.items():
        d = {"layout": w.layout, "qtype": qtype_to_json(w.qtype)}
        for field in ("values", "sums", "scale", "zero_point"):
            a = getattr(w, field)
            if a is None:
                continue
            a = np.asarray(a)
            same = shared.get((key, field))
            if same is not None and same[1].dtype == a.dtype and np.array_equal(same[1], a):
                d[field] = same[0]  # one copy of the weight scale: the qparams' tensor
                continue
            n = _unique(f"packed/{key}/{field}", used)
            if a.dtype.name in FLOAT8:  # safetensors' numpy API has no fp8: store the bytes
                d["values_dtype"] = a.dtype.name
                a = a.view(np.uint8)
            tensors[n] = a
            d[field] = n
        weights[key] = d
    header = {"tree": tree, "tree_error": why, "tree_repr": str(packed.treedef), "paths": paths,
              "avals": [aval_to_json(a) for a in packed.avals], "kept": list(packed.kept),
              "leaves": leaves, "weights": weights, "qparams": entries,
              "tied": [list(t) for t in packed.tied]}
    write(path, tensors, header, PACKED_FORMAT, versioned(PACKED_VERSION, qparams))


def _weight_scales(entries, arrays):
    """``(op key, "scale" | "zero_point") -> (tensor name, array)`` of each op's weight
    operand in the qparams entries: a packed weight's scale equal to it is stored once."""
    out = {}
    for key, e in entries.items():
        w = e["weight_operand"]
        d = None if w is None else e[("lhs", "rhs")[w]]
        for field in ("scale", "zero_point"):
            if d is not None and field in d:
                out[(key, field)] = (d[field], arrays[d[field]])
    return out


def load_packed(path, *, like=None, qparams=None, device=None) -> PackedParams:
    """Loads packed weights saved by :func:`jqt.save_packed`.

    Args:
      path: the file.
      like: optional template of the original params (a pytree of arrays or
        ``jax.ShapeDtypeStruct``, e.g. ``jax.eval_shape(model.init, ...)``): its
        structure replaces the one described in the file (needed when the params
        tree holds node types jqt cannot describe, such as ``nnx.State`` or an
        Equinox module); its leaves' shapes and dtypes must match the file's.
      qparams: optional qparams to check the weights against (the op keys, the
        weights' shapes against the per-channel scales, and, when the file holds
        qparams too, that the weights were quantized with the same weight scales).
        When the file holds qparams and this is None, the weights are checked
        against those.
      device: where to put the arrays, passed to ``jax.device_put``: ``None`` (the
        default device), a ``Device`` or ``Sharding``, a pytree of shardings with
        the structure of the result (see :func:`jqt.packed_shardings`), or a
        function of the loaded host (NumPy) ``PackedParams`` returning one of these.

    Returns:
      a :class:`jqt.PackedParams` with ``jax.Array`` leaves, whose pytree structure
      equals that of the saved one (so it can be passed to a function exported with it).

    Raises ``ValueError`` (a ``jqt`` ``FormatError``) for a file that is not a jqt
    packed file or has another version, and :class:`jqt.QParamsMismatchError` when the
    weights do not match ``like`` or ``qparams``.

    >>> import os, tempfile, jax.numpy as jnp, jqt
    >>> f = lambda p, x: x @ p["w"]
    >>> p = {"w": jnp.ones((8, 4))}
    >>> qp = jqt.calibrate(f, jqt.recipes.w8(), p, [(jnp.ones((2, 8)),)], progress=False)
    >>> path = os.path.join(tempfile.mkdtemp(), "w.safetensors")
    >>> jqt.save_packed(path, jqt.pack(qp, p))
    >>> packed = jqt.load_packed(path, qparams=qp)
    >>> packed.weights["w"].layout, packed.weights["w"].values.shape
    ('kn', (8, 4))
    """
    fn = "jqt.load_packed"
    if is_zip(path):
        raise FormatError(f"{fn}: {path} is an .npz file (jqt.save's qparams format 1?); packed "
                          "weights are saved by jqt.save_packed.")
    with Reader(path, fn) as r:
        packed, stored = _read_packed(r, path, like)
    if qparams is not None:
        check_packed(packed, qparams, fn=fn, packed_with=stored)
    elif stored is not None:
        check_packed(packed, stored, fn=fn)
    if callable(device):
        device = device(packed)
    return jax.device_put(packed, device)


def _read_packed(r, path, like):
    fn = "jqt.load_packed"
    if r.format == FORMAT:
        raise FormatError(f"{fn}: {path} holds qparams (saved by jqt.save), not packed weights; "
                          "read it with jqt.load, and save weights with jqt.save_packed.")
    if r.format != PACKED_FORMAT:
        raise FormatError(f"{fn}: {path} is not a jqt packed-weights file (format {r.format!r}).")
    if r.version not in PACKED_READ:
        raise version_error(fn, path, r.format, r.version, f"versions {PACKED_READ}")
    h = r.header
    avals = [aval_from_json(a) for a in h["avals"]]
    if like is not None:
        treedef = _check_like(like, avals, h["paths"], path)
    else:
        if h["tree"] is None and h.get("tree_error"):
            raise FormatError(
                f"{fn}: the params of {path} were a tree jqt cannot rebuild ({h['tree_error']}: "
                f"{h['tree_repr'][:200]}). Pass like=params (or a pytree of jax.ShapeDtypeStruct "
                "with the same structure, e.g. from jax.eval_shape) to rebuild it.")
        try:
            treedef = treedef_from_json(h["tree"])
        except TreeNotSerializable as e:
            raise FormatError(f"{fn}: cannot rebuild the params tree of {path}: it holds {e}. "
                              "Pass like=params to give the structure.") from None
    leaves = [r.get(n) for n in h["leaves"]]
    weights = {k: _weight_from_entry(d, r.get, r.version) for k, d in h["weights"].items()}
    packed = PackedParams(leaves, weights, treedef, avals, h["kept"], [tuple(t) for t in h.get("tied", ())])
    stored = None if h.get("qparams") is None else qparams_from_entries(h["qparams"], r.get)
    return packed, stored


def _weight_from_entry(d, get, version):
    if version == 1:  # int8 codes and sums only; quantize takes the scales from the qparams
        return QArray(values=get(d["qvalue"]), sums=get(d["wsum"]), layout=d["layout"])
    arrays = {f: get(d[f]) for f in ("values", "sums", "scale", "zero_point") if f in d}
    if "values_dtype" in d:
        arrays["values"] = np.asarray(arrays["values"]).view(FLOAT8[d["values_dtype"]])
    return QArray(**arrays, qtype=qtype_from_json(d["qtype"]), layout=d["layout"])


def _check_like(like, avals, paths, path):
    flat, treedef = jax.tree_util.tree_flatten(like)
    if len(flat) != len(avals):
        raise QParamsMismatchError(
            f"jqt.load_packed: like= has {len(flat)} leaves, but the params packed in {path} had "
            f"{len(avals)}. Pass a template of the params that were packed.")
    for i, (x, a) in enumerate(zip(flat, avals)):
        shape, dtype = tuple(np.shape(x)), x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
        if shape != tuple(a.shape) or jnp.dtype(dtype) != jnp.dtype(a.dtype):
            raise QParamsMismatchError(
                f"jqt.load_packed: leaf #{i} ('{paths[i]}') is {shape} {jnp.dtype(dtype).name} in "
                f"like=, but {tuple(a.shape)} {jnp.dtype(a.dtype).name} in {path}. The template "
                "does not describe the params that were packed.")
    return treedef


def _n_channels(q, depth):
    return int(np.prod(np.shape(q.scale)[depth:], dtype=np.int64))


def check_packed(packed: PackedParams, qparams, *, fn="jqt.check_packed", packed_with=None) -> None:
    """Checks that ``packed`` (from :func:`jqt.pack`) matches ``qparams``: every packed
    weight belongs to a quantized weight operand of ``qparams``, its shape agrees with
    that operand's per-channel scale, and every weight leaf dropped by ``pack`` is
    replaced by a packed weight. With ``packed_with`` (the qparams stored with the
    weights), also checks that the weight scales and zero points are the same.
    Raises :class:`jqt.QParamsMismatchError`."""
    if not isinstance(packed, PackedParams):
        raise TypeError(f"{fn}: expected a jqt.PackedParams, got a {type(packed).__name__}.")
    if not isinstance(qparams, dict):
        raise TypeError(f"{fn}: qparams is a {type(qparams).__name__}; expected the dict returned "
                        "by jqt.calibrate (or jqt.load).")
    extra = sorted(set(packed.weights) - set(qparams))
    if extra:
        raise QParamsMismatchError(
            f"{fn}: the packed weights hold ops {extra[:5]} that the qparams do not have (qparams "
            f"have {list(qparams)[:5]}{' ...' if len(qparams) > 5 else ''}). They were packed with "
            "other qparams; re-run jqt.pack with these.")
    dropped = set(range(len(packed.avals))) - set(packed.kept)
    # the weight argument these weights were packed from (jqt.pack's argnum)
    args = {qparams[k].source.arg for k in packed.weights if qparams[k].source is not None}
    for key, p in qparams.items():
        w, src = p.weight_operand, p.source
        q = None if w is None else p.operand(w)
        pw = packed.weight(key)
        if pw is None:
            if src is not None and src.arg in args and src.leaf in dropped:
                raise QParamsMismatchError(
                    f"{fn}: op '{key}' reads weight leaf '{src.path}', which the packed weights "
                    "dropped, but they hold no packed weight for it"
                    f"{' (the qparams keep this op float)' if q is None else ''}. They were "
                    "packed with other qparams; re-run jqt.pack with these.")
            continue
        if q is None:
            raise QParamsMismatchError(
                f"{fn}: the packed weights hold an int8 weight for op '{key}', which these qparams "
                "keep float. They were packed with other qparams; re-run jqt.pack with these.")
        shape = values_shape(pw)
        depth = 0 if src is None else src.stack_depth
        if q.qtype.per_channel and not q.qtype.group_size and q.scale is not None and np.ndim(q.scale):
            n = _n_channels(q, depth)
            if pw.layout in ("nk", "kn"):
                got = shape[-2] if pw.layout == "nk" else shape[-1]
                ok = (len(shape) == depth + 2 and got == n
                      and shape[:depth] == np.shape(q.scale)[:depth])
            else:
                ok = len(shape) == np.ndim(q.scale) and all(
                    s in (1, d) for s, d in zip(np.shape(q.scale), shape))
            if not ok:
                raise QParamsMismatchError(
                    f"{fn}: the packed weight of op '{key}' has shape {shape} (layout "
                    f"'{pw.layout}'), which does not fit its weight scale of shape "
                    f"{tuple(np.shape(q.scale))}. The weights or qparams changed; re-run jqt.pack.")
        if packed_with is not None:
            other = packed_with.get(key)
            ow = None if other is None else other.weight_operand
            oq = None if ow is None else other.operand(ow)
            same = oq is not None and oq.qtype == q.qtype and all(
                (a is None) == (b is None)
                and (a is None or np.array_equal(np.asarray(a), np.asarray(b)))
                for a, b in ((oq.scale, q.scale), (oq.zero_point, q.zero_point)))
            if not same:
                raise QParamsMismatchError(
                    f"{fn}: the weights of op '{key}' were quantized with other weight scales or "
                    "types than these qparams give (the file holds the qparams it was packed "
                    "with). Use jqt.load(path) for the qparams, or re-run jqt.pack.")

