"""``jqt.save_packed`` / ``jqt.load_packed``: packed int8 weights in safetensors (format
``jqt.packed``, described in ``serialization.py``), and the check that packed weights fit
their qparams."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, diagnostics, validate, weightcheck
from .analysis import path_str
from .formats import FLOAT8, unpack_nibbles
from .handlers import QParamsMismatchError, values_shape
from .layout import apply_chain
from .tracing import Static
from .qparams import (PackedParams, bare_advice, QArray, axes_only, codes_problem, fold_mismatch, fold_parts, holds_smooth,
                      smooth_digest)
from .fileio import (FORMAT, PACKED_FORMAT, FormatError, Reader, aval_to_json, describe, file_path, is_a,
                     is_zip, json_kind, reading, version_error, write)
from .serialization import (PACKED_READ, PACKED_VERSION, TreeNotSerializable, check_scales,
                            check_values, float32_scale, qparams_entries, qparams_from_entries,
                            qtype_from_header, qtype_to_json, treedef_from_json, treedef_to_json,
                            versioned)


def _as_recorded(x, aval, path):
    """A kept leaf as the file stores it: in the dtype ``jqt.pack`` recorded for it, which is
    the one JAX gives it (a NumPy int64 leaf is int32 and a float64 one float32 unless x64
    is on; integers must keep their values); a typed PRNG key, which the file cannot hold,
    is refused by name."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        raise TypeError(f"jqt.save_packed: params leaf '{path}' is a typed PRNG key ({x.dtype}), "
                        "which a file cannot hold. Put jax.random.key_data(key) in its place in the "
                        "params before jqt.pack (the packed params record each leaf's type), "
                        "or leave the key out of the params you pack (e.g. nnx.split the Rngs "
                        "state apart).")
    if jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key):
        raise TypeError(f"jqt.save_packed: params leaf '{path}' was a typed PRNG key ({aval.dtype}) "
                        "when jqt.pack packed these params, which recorded that type, and a file "
                        "cannot hold a key. Put jax.random.key_data(key) in its place in the params "
                        "before jqt.pack, and pack again.")
    a = np.asarray(x)
    want = np.dtype(aval.dtype)
    if a.dtype == want:
        return a
    with np.errstate(over="ignore"):
        b = a.astype(want)  # floats round as JAX rounds them; integers must keep their values
    if (a.dtype.kind in "fc" and b.dtype.kind in "fc"
            and np.any(np.isinf(b) & np.isfinite(a))):
        raise TypeError(f"jqt.save_packed: params leaf '{path}' is {a.dtype.name} with values "
                        f"beyond {want.name}'s range, the dtype jqt.pack recorded for it: they "
                        "would be saved as inf. Pass it as that dtype (with x64 enabled for "
                        "float64), or scale it into that range.")
    if a.dtype.kind in "iub" and not np.array_equal(b.astype(a.dtype), a):
        raise TypeError(f"jqt.save_packed: params leaf '{path}' is {a.dtype.name}, and its values do "
                        f"not fit {want.name}, the dtype JAX gives it (jax_enable_x64 is off). "
                        "Enable x64 or pass it as an array of a narrower dtype.")
    return b


def leaf_paths(packed: PackedParams) -> list[str]:
    paths = packed.key_paths()
    return ([path_str(p) for p in paths] if paths is not None
            else [f"(leaf {i})" for i in range(len(packed.avals))])


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

    The file is written atomically: to a temporary file in the same folder, renamed onto
    ``path`` once complete, so a failed save leaves an existing file as it was.

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
    path = file_path(path, "jqt.save_packed", "call jqt.save_packed(path, packed, qparams), the "
                     "path first")
    if not isinstance(packed, PackedParams):
        raise TypeError(f"jqt.save_packed: expected the jqt.PackedParams returned by jqt.pack, got "
                        f"a {type(packed).__name__}." + bare_advice(packed))
    for what, tree in (("the packed params", packed), ("qparams", qparams)):
        if any(compat.is_tracer(a) for a in jax.tree_util.tree_leaves(tree)):
            raise TypeError(f"jqt.save_packed: {what} hold traced values (jqt.save_packed called "
                            "inside jax.jit, jax.grad or another transformation); return them from "
                            "the transformed function and save them outside it.")
        validate.check_alive(tree, "jqt.save_packed", what)  # (donated to a jitted call)
    if isinstance(qparams, dict):  # Python numbers (tree_map(float)) as jqt.save takes them
        qparams = validate.numbers_as_arrays(qparams)
    try:
        tree, why = treedef_to_json(packed.treedef), None
    except TreeNotSerializable as e:
        tree, why = None, str(e)
    for key, w in packed.weights.items():
        bad = codes_problem(w)
        if bad:
            raise ValueError(f"jqt.save_packed: packed weight '{key}': {bad}; a file holds them "
                             "as jqt.pack made them. Re-run jqt.pack, or undo the cast.")
        _check_saved_numbers(key, w)
    paths = leaf_paths(packed)
    used, tensors = set(), {}
    leaves = []
    for i, x in zip(packed.kept, packed.leaves):
        if isinstance(packed.avals[i], Static):
            what = (f"a NumPy array of {x.dtype} (not numbers)" if isinstance(x, np.ndarray)
                    else f"a {type(x).__name__}")
            raise TypeError(f"jqt.save_packed: params leaf '{paths[i]}' is {what} "
                            f"({repr(x)[:60]}), not a numeric array, and a packed file holds arrays. "
                            "Pass such a value to f another way (functools.partial, or an argument of its own; "
                            "for an Equinox module, pack and save the arrays of "
                            "eqx.partition(model, eqx.is_array) and eqx.combine them with the "
                            "rest inside f).")
        if isinstance(x, _PY_SCALARS):
            diagnostics.warn(
                f"jqt.save_packed: params leaf '{paths[i]}' is a Python {type(x).__name__} "
                f"({x!r}), which f reads as a constant; the file holds it as a 0-d array, and "
                "jqt.load_packed returns an array, which f reads as a traced value (a bool or int "
                "f branches on or sizes a shape with fails, a float can promote bfloat16 "
                "arithmetic), unless like=params gives it back as a Python value.")
        n = _unique(f"params/{paths[i]}", used)
        tensors[n] = _as_recorded(x, packed.avals[i], paths[i])
        leaves.append(n)
    entries, shared = None, {}
    if qparams is not None:
        validate.check_qparams(qparams, "jqt.save_packed")  # a file jqt.load would refuse
        check_packed(packed, qparams, fn="jqt.save_packed")
        entries, arrays = qparams_entries(
            qparams, lambda i, key, side, field: _unique(f"qparams/{key}/{side}.{field}", used),
            fn="jqt.save_packed")
        tensors.update(arrays)
        shared = _weight_scales(entries, arrays)
    weights, written = {}, {}  # id of an array -> (the array, its tensor's name)
    by_value = {}  # (op key less '#n', field, dtype, shape, digest) -> tensor names: arrays
    # that one weight's ops share (w, w#1, ...: a layer applied several times) but jax.jit(
    # jqt.pack), jax.device_put or a tree.map copied apart, written once too; equal arrays of
    # two weights (zero-initialised LoRA B matrices) stay two, as jqt.pack keeps them
    for key, w in packed.weights.items():
        d = {"layout": w.layout, "qtype": qtype_to_json(w.qtype)}
        if w.folded is not None:
            d["folded"] = w.folded
        for field in _FIELDS:
            a = getattr(w, field)
            if a is None:
                continue
            if id(a) in written and written[id(a)][0] is a:  # shared by ops (jqt.pack)
                d[field] = written[id(a)][1]
                if a.dtype.name in FLOAT8:
                    d["values_dtype"] = a.dtype.name
                continue
            orig = a
            a = (float32_scale(a, f"packed weight '{key}' {field}", "jqt.save_packed")
                 if field in ("scale", "zero_point", "smooth") else np.asarray(a))
            same = shared.get((key, field))
            if same is not None and same[1].dtype == a.dtype and np.array_equal(same[1], a):
                d[field] = same[0]  # one copy of the weight scale: the qparams' tensor
                continue
            if a.dtype.name in FLOAT8:  # safetensors' numpy API has no fp8: store the bytes
                d["values_dtype"] = a.dtype.name
                a = a.view(np.uint8)
            sig = (re.sub(r"#\d+$", "", key), field, a.dtype.str, a.shape,  # one weight's ops
                   hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).data,
                                   digest_size=16).digest())
            n = next((m for m in by_value.get(sig, ()) if np.array_equal(tensors[m], a)), None)
            if n is None:
                n = _unique(f"packed/{key}/{field}", used)
                tensors[n] = a
                by_value.setdefault(sig, []).append(n)
            d[field] = n
            written[id(orig)] = (orig, n)
        weights[key] = d
    kept_set = set(packed.kept)  # (membership per leaf: a tuple's was quadratic)
    header = {"tree": tree, "tree_error": why, "tree_repr": str(packed.treedef), "paths": paths,
              "avals": [aval_to_json(a) for a in packed.avals], "kept": list(packed.kept),
              "leaves": leaves, "weights": weights, "qparams": entries,
              "tied": [list(t) for t in packed.tied],
              # kept leaves weakly typed (jnp.asarray(0.5)): they take the dtype of what they
              # meet, and come back so (a strong float32 one promotes bfloat16 arithmetic)
              "weak": [i for i, x in zip(packed.kept, packed.leaves) if compat.is_weak(x)],
              # and the leaves packed away that were (an older jqt ignores this: strong zeros)
              "weak_dropped": [i for i, a in enumerate(packed.avals)
                               if getattr(a, "weak_type", False) and i not in kept_set]}
    version = versioned(PACKED_VERSION, qparams)
    if any(w.folded for w in packed.weights.values()):  # codes smoothed or rotated: an older
        version = PACKED_VERSION + 1  # jqt, which ignores 'folded', must refuse the file
    if any(holds_smooth(w.folded) for w in packed.weights.values()):
        version = PACKED_VERSION + 2  # smoothing vectors held: a jqt reading 3 must refuse it
    write(path, tensors, header, PACKED_FORMAT, version)


def _weight_scales(entries, arrays):
    """``(op key, "scale" | "zero_point" | "smooth") -> (tensor name, array)`` of each op's
    weight operand, and its smoothing vector, in the qparams entries: a packed weight's
    equal to it is stored once."""
    out = {}
    for key, e in entries.items():
        w = e["weight_operand"]
        d = None if w is None else e[("lhs", "rhs")[w]]
        for field in ("scale", "zero_point"):
            if d is not None and field in d:
                out[(key, field)] = (d[field], arrays[d[field]])
        if "smooth" in e:
            out[(key, "smooth")] = (e["smooth"], arrays[e["smooth"]])
    return out


def load_packed(path, *, like=None, qparams=None, device=None) -> PackedParams:
    """Loads packed weights saved by :func:`jqt.save_packed`.

    Args:
      path: the file.
      like: optional template of the original params (a pytree of arrays or
        ``jax.ShapeDtypeStruct``, e.g. ``jax.eval_shape(model.init, ...)``): its
        structure replaces the one described in the file (needed when the params
        tree holds node types jqt cannot describe, such as ``nnx.State`` or an
        Equinox module); its leaves' shapes and dtypes must match the file's. Leaves
        split over explicit mesh axes in it (a weight a ``jax.shard_map`` of ``f`` takes
        split) are traced split so, as ``jax.shard_map`` requires; the float leaves
        kept among them (a bias it takes split) are put so where ``device`` is None and
        the template's mesh is a concrete ``Mesh`` (a ``jax.eval_shape`` template holds an
        ``AbstractMesh``: pass ``device=`` from :func:`jqt.packed_shardings` on the
        concrete ``Mesh``, which splits them as recorded).
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
      equals that of the saved one (so it can be passed to a function exported with it),
      except where the weights were packed on explicit mesh axes: the file keeps no
      sharding of the avals it records, so pass ``like=params`` (the concrete params,
      whose shardings are read) to restore them.

    Every array is checked against the file's header (its dtype and shape) and against
    what the format implies (codes of the weight's type and layout, int32 sums, float
    scales, and shapes and group counts that fit together).

    Raises ``ValueError`` (a ``jqt`` ``FormatError``, naming the file, what is wrong and
    the fix) for a file that is not a jqt packed file, has another version or is damaged,
    and :class:`jqt.QParamsMismatchError` when the weights do not match ``like`` or
    ``qparams``.

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
    if isinstance(device, str):
        raise TypeError(f"{fn}: device={device!r} is a name; pass a jax.Device (e.g. "
                        f"jax.devices({device!r})[0]) or a Sharding.")
    if isinstance(device, (int, float, np.number)):
        raise TypeError(f"{fn}: device={device!r} is a number; pass a jax.Device (e.g. "
                        f"jax.devices()[{device!r}]) or a Sharding.")
    several = (isinstance(device, (list, tuple, np.ndarray)) and len(device) and all(
        isinstance(d, jax.Device) for d in np.ravel(np.asarray(device, dtype=object))))
    if several or isinstance(device, jax.sharding.Mesh):
        what = ("a Mesh" if isinstance(device, jax.sharding.Mesh) else
                f"a {type(device).__name__} of {np.size(np.asarray(device, dtype=object))} devices")
        raise TypeError(f"{fn}: device is {what}; pass one jax.Device, or a Sharding (a "
                        "NamedSharding on a Mesh of the devices; jqt.packed_shardings builds one "
                        "per weight: device=lambda host: jqt.packed_shardings(qparams, host, "
                        "mesh)[1]).")
    if isinstance(like, (str, bytes, os.PathLike)):  # (a str is one leaf to JAX)
        raise TypeError(f"{fn}: like={like!r} is a path; like= is a template of the params that "
                        "were packed (the params themselves, or jax.eval_shape of what makes "
                        "them). The qparams stored with the weights load with jqt.load(path).")
    if qparams is not None:
        validate.check_qparams(qparams, fn)  # before reading the file
    path = file_path(path, fn)
    if is_zip(path, fn):
        raise FormatError(f"{fn}: {path} is an .npz file, which jqt.save_packed never writes "
                          "(it writes safetensors): jqt.save's qparams in its .npz form? Read "
                          "those with jqt.load; packed weights are saved by jqt.save_packed.")
    try:
        with Reader(path, fn) as r, reading(r, keep=(QParamsMismatchError, _Narrowed)):
            packed, stored, weak = _read_packed(r, path, like)
            if stored is not None:
                try:  # the file's own qparams (first, with qparams= too): a mismatch means a damaged file
                    check_packed(packed, stored, fn=fn)
                except QParamsMismatchError as e:
                    raise r.error("its packed weights do not fit the qparams stored with them ("
                                  f"{str(e).removeprefix(fn + ': ')})") from None
    except _Narrowed as e:  # a plain ValueError to the caller, not a private class
        raise ValueError(str(e)) from None
    if qparams is not None:
        try:
            check_packed(packed, qparams, fn=fn, packed_with=stored)
        except QParamsMismatchError as e:  # name the file, and where its own qparams are
            own = (" The file holds the qparams it was packed with: jqt.load(path) reads them."
                   if stored is not None and "jqt.load(path)" not in str(e) else "")
            raise QParamsMismatchError(f"{fn}: {path}: {str(e).removeprefix(fn + ': ')}{own}") from None
    if callable(device):
        device = device(packed)
    abstract = [d for d in jax.tree_util.tree_leaves(device) if isinstance(
        getattr(d, "mesh", None), jax.sharding.AbstractMesh)]
    if abstract:  # (packed_shardings takes one: a jax.eval_shape template's mesh)
        raise TypeError(f"{fn}: device= gives a sharding on an AbstractMesh, which places no "
                        "array (a jax.eval_shape template's mesh?); build the shardings on the "
                        "concrete jax.sharding.Mesh: device=lambda host: "
                        "jqt.packed_shardings(qparams, host, mesh)[1], mesh the Mesh of devices.")
    try:
        return _weakened(_on_concrete_meshes(_put_once(packed, device, split=like is not None), device),
                         weak)
    except _NotAPrefix as e:
        raise ValueError(f"{fn}: {path}: device= {e}: pass device=lambda host: "
                         "jqt.packed_shardings(qparams, host, mesh)[1] (shardings of the loaded "
                         "weights, the function called with them), one Device or Sharding for "
                         "every array, or a prefix of the loaded weights' structure.") from None


_PY_SCALARS = (bool, int, float, complex)


def _weakened(packed, weak):
    """``packed`` with the kept leaves ``weak`` lists (saved weakly typed: ``jnp.asarray(0.5)``)
    weakly typed JAX arrays again, where they were placed (NumPy has no weak type; the
    avals, and so the pytree structure, say nothing of it). A weak leaf takes the dtype of
    what it meets: a strong float32 one turned a bfloat16 model's output float32."""
    if not weak:
        return packed
    leaves = [compat.weak_typed(x) if i in weak and not isinstance(x, _PY_SCALARS) else x
              for i, x in zip(packed.kept, packed.leaves)]
    return PackedParams(leaves, packed.weights, packed.treedef, packed.avals, packed.kept, packed.tied)


class _Narrowed(ValueError):
    """An integer leaf this process would hold wrapped (int64 values without x64)."""


class _NotAPrefix(ValueError):
    """A ``device=`` tree that is no prefix of the packed weights' structure."""


def _children_places(packed, device):
    """The placements of a ``PackedParams`` of shardings whose static data differ from
    ``packed``'s (``jqt.packed_shardings`` of weights packed in memory on explicit mesh
    axes, whose avals record the split a loaded file's do not), leaf by leaf where the
    leaves and weights match; else ``None``."""
    if not isinstance(device, PackedParams):
        return None
    try:
        return jax.tree_util.tree_structure((packed.leaves, packed.weights)).flatten_up_to(
            (device.leaves, device.weights))
    except (ValueError, TypeError):
        return None


def _on_concrete_meshes(packed, device):
    """``packed`` with the recorded shardings that ``like=`` (a ``jax.eval_shape``
    template) gave on an ``AbstractMesh`` put on the concrete ``Mesh`` of that abstract
    mesh that ``device=`` or the placed arrays use: the avals ``jqt.pack`` records from
    concrete params, so that an exported artifact takes these weights and ``jax.export``
    can serialize a function called with them. Where none is found they stay abstract
    (``export._aval_to_json`` says what to pass)."""
    avals = [getattr(getattr(a, "sharding", None), "mesh", None) for a in packed.avals]
    if not any(isinstance(m, jax.sharding.AbstractMesh) for m in avals):
        return packed
    meshes = {}
    for d in jax.tree_util.tree_leaves(device) + [getattr(x, "sharding", None)
                                                  for x in jax.tree_util.tree_leaves(packed)]:
        m = getattr(d, "mesh", None)
        if isinstance(m, jax.sharding.Mesh):
            meshes.setdefault(m.abstract_mesh, m)
    out = [a if not isinstance(m, jax.sharding.AbstractMesh) or m not in meshes else
           jax.ShapeDtypeStruct(tuple(a.shape), a.dtype,
                                sharding=jax.sharding.NamedSharding(meshes[m], a.sharding.spec))
           for a, m in zip(packed.avals, avals)]
    return PackedParams(packed.leaves, packed.weights, packed.treedef, out, packed.kept, packed.tied)


def _put_once(packed, device, split=False):
    """``jax.device_put(packed, device)``, where an array that ops share (:func:`jqt.pack`)
    is put once per placement, so that the ops share the copy too. ``device``: ``None``, a
    ``Device`` or ``Sharding``, or a pytree of them with the structure of ``packed``. With
    ``device=None`` and ``split``, a kept float leaf whose aval ``like=`` split over explicit
    mesh axes (:func:`_split_as`) is put so: a ``jax.shard_map`` takes it only split."""
    leaves, treedef = jax.tree_util.tree_flatten(packed)
    if device is None and split:  # (a jax.eval_shape template's on an AbstractMesh: none)
        kept = [sh if isinstance(getattr(sh, "mesh", None), jax.sharding.Mesh) else None
                for sh in (getattr(packed.avals[i], "sharding", None) for i in packed.kept)]
        places = kept + [None] * (len(leaves) - len(kept))  # the kept leaves flatten first
    elif device is None or isinstance(device, (jax.Device, jax.sharding.Sharding)):
        places = [device] * len(leaves)
    else:
        try:
            places = treedef.flatten_up_to(device)
        except (ValueError, TypeError):
            places = _children_places(packed, device)
            if places is None:  # a prefix of packed's structure: JAX broadcasts it
                try:
                    return jax.device_put(packed, device)
                except (ValueError, TypeError) as e:
                    first = str(e).strip().splitlines()[0].strip().rstrip(";")
                    raise _NotAPrefix(
                        f"does not fit the loaded weights' structure ({first}; a tree shaped "
                        "like the float params? device= places the PackedParams: its kept "
                        "leaves and packed weights)") from None
    put, out = {}, []
    for x, d in zip(leaves, places):
        if isinstance(x, _PY_SCALARS):  # a constant of f's, as jqt.pack keeps it
            out.append(x)
            continue
        key = (id(x), d)  # equal shardings of several ops: one placement
        try:
            hash(key)
        except TypeError:  # an unhashable placement
            key = (id(x), id(d))
        if key not in put:
            put[key] = jax.device_put(x, d)
        out.append(put[key])
    return treedef.unflatten(out)


def _read_packed(r, path, like):
    """(PackedParams, the qparams stored with them or None, the kept leaves saved weakly
    typed: :func:`_weakened`) from an open file, checked
    against its header (:func:`_check_weight`, :func:`_read_leaves`, :func:`_check_tied`)."""
    fn = "jqt.load_packed"
    if r.format == FORMAT:
        raise FormatError(f"{fn}: {path} holds qparams (saved by jqt.save), not packed weights; "
                          "read it with jqt.load, and save weights with jqt.save_packed.")
    if r.format != PACKED_FORMAT:
        raise FormatError(f"{fn}: {path} is not a jqt packed-weights file (format {r.format!r}).")
    if r.version not in PACKED_READ:
        raise version_error(fn, path, r.format, r.version, f"versions {PACKED_READ}", PACKED_READ)
    h = r.header
    avals, paths = _read_avals(r, h)
    treedef = (_check_like(like, avals, paths, path, h.get("tree_repr")) if like is not None
               else _read_tree(r, h, avals))
    if like is not None:  # leaves split over explicit mesh axes in like= trace split so
        avals = [_split_as(a, x) for a, x in zip(avals, jax.tree_util.tree_leaves(like))]
    flat = [] if like is None else jax.tree_util.tree_leaves(like)
    python = {i for i, v in enumerate(flat) if isinstance(v, _PY_SCALARS)}
    kept, leaves = _read_leaves(r, h, avals, paths, python)
    # a Python value of like= comes back as one (f read it as a constant): the template's own
    # where the file holds it as saved (a float rounded to float32 without x64), else the file's
    leaves = [x if i not in python else flat[i] if np.asarray(x) == np.asarray(flat[i]).astype(x.dtype)
              else type(flat[i])(np.asarray(x).item()) for i, x in zip(kept, leaves)]
    weak = h.get("weak", [])  # (absent from files written before 2026-12-07)
    kept_set = set(kept)  # (membership per leaf: a list's was quadratic)
    if not (isinstance(weak, list) and all(is_a(i, int) and i in kept_set for i in weak)):
        raise r.error(f"the header's 'weak' {json.dumps(weak)[:200]} is not a list of kept leaf numbers")
    dropped = h.get("weak_dropped", [])  # (absent from files written before 2026-12-08)
    if not (isinstance(dropped, list) and all(is_a(i, int) and 0 <= i < len(avals) and i not in kept_set
                                              for i in dropped)):
        raise r.error(f"the header's 'weak_dropped' {json.dumps(dropped)[:200]} is not a list of "
                      "the numbers of leaves packed away")
    weak_set = set(dropped)  # (a kept leaf carries its weak type: its aval does not, see pack)
    # the leaves as this process holds them (a file packed under jax_enable_x64 records
    # float64 leaves: float32 here without it, as the kept leaves become on the device)
    avals = [jax.ShapeDtypeStruct(tuple(a.shape), jax.dtypes.canonicalize_dtype(a.dtype),
                                  sharding=getattr(a, "sharding", None),
                                  weak_type=i in weak_set)
             for i, a in enumerate(avals)]
    weights, same = {}, {}
    for k, d in r.need(h, "weights", dict, "the header").items():
        # entries that name the same tensors (ops that share codes, jqt.pack): one QArray
        sig = json.dumps(d, sort_keys=True, default=str)
        if sig not in same:
            same[sig] = _weight_from_entry(r, k, d, r.version)
        weights[k] = same[sig]
    tied = _check_tied(r, h.get("tied", []), weights)
    packed = PackedParams(leaves, weights, treedef, avals, kept, tied)
    stored = None if h.get("qparams") is None else qparams_from_entries(
        h["qparams"], r, "the header's 'qparams'")
    return packed, stored, set(weak)


def _read_avals(r, h):
    """The avals and paths of the original params' leaves."""
    avals = [jax.ShapeDtypeStruct(*r.aval(a, f"the header's aval #{i}"))
             for i, a in enumerate(r.need(h, "avals", list, "the header"))]
    paths = r.need(h, "paths", list, "the header")
    if len(paths) != len(avals) or not all(isinstance(p, str) for p in paths):
        raise r.error(f"the header has {len(avals)} avals but 'paths' {json.dumps(paths)[:200]}")
    return avals, paths


def _read_tree(r, h, avals):
    """The params' treedef from its JSON description, with one leaf per aval."""
    fn, path = r.fn, r.path
    if h.get("tree") is None and h.get("tree_error"):
        raise FormatError(
            f"{fn}: the params of {path} were a tree jqt cannot rebuild ({h['tree_error']}: "
            f"{str(h.get('tree_repr'))[:200]}). Pass like=params (or a pytree of "
            "jax.ShapeDtypeStruct with the same structure, e.g. from jax.eval_shape) to rebuild "
            "it.")
    tree = r.need(h, "tree", (str, list, type(None)), "the header")
    try:
        treedef = treedef_from_json(tree, avals)
    except TreeNotSerializable as e:
        raise FormatError(f"{fn}: cannot rebuild the params tree of {path}: it holds {e}. "
                          "Pass like=params to give the structure.") from None
    except (FormatError, KeyError, IndexError, TypeError, ValueError) as e:
        raise r.error(f"its params tree is malformed ({type(e).__name__}: {e})") from None
    if treedef.num_leaves != len(avals):
        raise r.error(f"its params tree has {treedef.num_leaves} leaves but the header has "
                      f"{len(avals)} avals")
    rebuilt = PackedParams((), {}, treedef, avals, ()).key_paths()
    paths = r.need(h, "paths", list, "the header")
    named = [(i, a, path_str(b)) for i, (a, b) in enumerate(zip(paths, rebuilt or ()))
             if a != path_str(b)]
    if named:  # (saved from the same key paths: they agree unless the header was edited)
        i, a, b = named[0]
        raise r.error(f"its params tree names leaf #{i} '{b}', but its 'paths' say '{a}' "
                      f"({len(named)} of {len(paths)} differ)")
    return treedef


def _read_leaves(r, h, avals, paths, python=()):
    """(kept leaf indices, the float leaves kept), each of its aval's shape and dtype;
    ``python``: leaves ``like=`` gives back as Python values (not narrowed)."""
    kept = r.need(h, "kept", list, "the header")
    if not (all(is_a(i, int) for i in kept) and kept == sorted(set(kept))
            and all(0 <= i < len(avals) for i in kept)):
        raise r.error(f"the header's 'kept' {json.dumps(kept)[:200]} is not a list of distinct "
                      f"leaf numbers below {len(avals)}")
    names = r.need(h, "leaves", list, "the header")
    if len(names) != len(kept):
        raise r.error(f"the header names {len(names)} tensors for {len(kept)} kept leaves")
    leaves = []
    for i, n in zip(kept, names):
        a = r.get(n, f"params leaf '{paths[i]}'")
        if a.shape != avals[i].shape or a.dtype != avals[i].dtype:
            raise r.error(f"tensor '{n}' (params leaf '{paths[i]}') is {describe(a)}, but the "
                          f"header's aval is {np.dtype(avals[i].dtype).name}{list(avals[i].shape)}")
        if np.issubdtype(a.dtype, np.integer) and a.size and i not in python:
            held = np.dtype(jax.dtypes.canonicalize_dtype(a.dtype))
            if held.itemsize < a.dtype.itemsize and (a.min() < np.iinfo(held).min or a.max() > np.iinfo(held).max):
                raise _Narrowed(
                    f"jqt.load_packed: params leaf '{paths[i]}' in {r.path} holds {a.dtype.name} "
                    f"values beyond {held.name}'s range ({a.max() if a.max() > np.iinfo(held).max else a.min()}), which this process, "
                    f"without jax_enable_x64, holds as {held.name}: they would wrap. Enable x64 "
                    "(jax.config.update('jax_enable_x64', True)) before loading.")
        if np.issubdtype(a.dtype, np.floating) and a.size and i not in python:
            held = np.dtype(jax.dtypes.canonicalize_dtype(a.dtype))
            big = np.abs(a[np.isfinite(a)]).max(initial=0.0)
            if held.itemsize < a.dtype.itemsize and big > np.finfo(held).max:
                raise _Narrowed(
                    f"jqt.load_packed: params leaf '{paths[i]}' in {r.path} holds {a.dtype.name} "
                    f"values beyond {held.name}'s range ({big:.6g}), which this process, without "
                    f"jax_enable_x64, holds as {held.name}: they would become inf. Enable x64 "
                    "(jax.config.update('jax_enable_x64', True)) before loading.")
        leaves.append(a)
    return kept, leaves


_LAYOUTS = ("nk", "kn", "operand", "tied")
_FIELDS = ("values", "sums", "scale", "zero_point", "smooth")


def _weight_from_entry(r, key, d, version):
    """A packed weight from its header entry ``d``, its arrays read and checked."""
    where = f"packed weight '{key}'"
    layout = r.need(d, "layout", str, where)
    if layout not in _LAYOUTS:
        raise r.error(f"{where}: layout {layout!r} is not one of {list(_LAYOUTS)}")
    if version == 1:  # int8 codes and sums only; quantize takes the scales from the qparams
        w = QArray(values=r.get(r.need(d, "qvalue", str, where), f"{where}.values", shared=True),
                   sums=r.get(r.need(d, "wsum", str, where), f"{where}.sums", shared=True), layout=layout)
    else:
        qtype = qtype_from_header(r, r.need(d, "qtype", dict, where), where)
        arrays = {f: r.get(r.need(d, f, str, where), f"{where}.{f}", shared=True) for f in _FIELDS if f in d}
        if "values_dtype" in d:
            arrays["values"] = _fp8_values(r, where, arrays.get("values"), d["values_dtype"], qtype)
        folded = d.get("folded")  # absent from files written before jqt recorded it
        if folded is not None and not isinstance(folded, str):
            raise r.error(f"{where}: 'folded' is a {type(folded).__name__}, expected a string")
        unknown = sorted(set(fold_parts(folded)) - {"smooth", "rotate"})
        if unknown:  # a transform this jqt would not undo: refused, not dropped
            raise r.error(f"{where}: its 'folded' is {folded!r}, which names transforms "
                          f"{unknown} this jqt does not know (it folds 'smooth' and 'rotate')")
        if version == 3 and "smooth" in arrays and not holds_smooth(folded) \
                and "smooth" in fold_parts(folded):
            # jqt of 2026-11-29 (c541e51 to 52e7ed2) stored the vector and recorded it as
            # 'smooth:<digest>', the form of a weight without it: read as 'smooth=<digest>'
            folded = "+".join("smooth=" + p[len("smooth:"):] if p.startswith("smooth:") else p
                              for p in folded.split("+"))
        if ("smooth" in arrays) != holds_smooth(folded):
            raise r.error(f"{where}: its 'folded' is {folded!r}, but it holds "
                          f"{'a' if 'smooth' in arrays else 'no'} smoothing vector ('smooth'); a "
                          "weight packed with one records 'smooth=<digest>'")
        digest = fold_parts(folded).get("smooth")
        if "smooth" in arrays and digest != "?" and smooth_digest(arrays["smooth"]) != digest:
            raise r.error(f"{where}: its smoothing vector ('smooth') is not the one its codes "
                          f"were multiplied by (its 'folded' records the digest {digest!r})")
        w = QArray(**arrays, qtype=qtype, layout=layout, folded=folded)
    _check_weight(r, where, w)
    if version > 1:  # a version-1 file's codes are checked against its qparams (v1_problem)
        _check_grid(r, where, w)
    check_values(r, key, validate.operand_problems(w, "packed weight"))
    return w


def _check_grid(r, where, w):
    """Integer (and NF4 index) codes within their type's grid, as :func:`jqt.pack` writes
    them: codes of a wider type relabelled (int4 as int2, int8 as int7) loaded and ran."""
    q, v = w.qtype, w.values
    if q is None or q.kind == "float" or v is None or not v.size:
        return
    v = np.asarray(v)
    nibbles = v.dtype == np.uint8  # two 4-bit codes per byte
    if q.qmin <= (-8 if nibbles else -128) and q.qmax >= (7 if nibbles else 127):
        return  # every code the storage holds is on the grid (int4, nf4, int8): no pass
    low, high = _code_range(v, nibbles)
    if low < q.qmin or high > q.qmax:
        raise r.error(f"{where}: its codes reach [{low}, {high}], outside the {q.describe()} "
                      f"grid [{q.qmin}, {q.qmax}] that jqt.pack writes (codes of a wider type "
                      "relabelled, or changed bytes)")


def _fp8_values(r, where, values, name, qtype):
    """fp8 codes, stored as their bytes (uint8) with ``values_dtype`` naming the type."""
    if qtype.kind != "float" or name != qtype.dtype:
        raise r.error(f"{where}: 'values_dtype' is {json.dumps(name)}, but its type is "
                      f"{qtype.dtype}")
    if values is None or values.dtype != np.uint8:
        got = "no values" if values is None else f"values {describe(values)}"
        raise r.error(f"{where} has {got}; {name} codes are stored as their bytes (uint8)")
    # e5m2 bytes that read as inf (0x7C, 0xFC), which jqt.pack never writes (it refuses
    # inf weights and clips to the grid's ends): e4m3 codes relabelled e5m2 read so (384).
    # NaN codes are a NaN weight's, which fp8 codes keep (e4m3's 448, a channel's
    # maximum, reads as NaN in e5m2: that relabel shows only where a code reads as inf).
    if name == "float8_e5m2" and any(np.any((c & 0x7F) == 0x7C) for c in _chunks(values)):
        raise r.error(f"{where}: its {name} codes hold inf, which jqt.pack never writes (it "
                      "refuses inf weights and clips to the grid's largest value): codes of "
                      "another fp8 type relabelled, or changed bytes")
    return values.view(FLOAT8[name])


def _chunks(values, size=1 << 24):
    """``values`` (1-byte items) as flat uint8 chunks: temporaries of one chunk's size."""
    flat = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
    return (flat[i:i + size] for i in range(0, flat.size, size))


def _code_range(values, nibbles):
    """The smallest and largest code of int8 codes, or of two 4-bit codes per byte
    (signed, as unpack_nibbles reads them), in chunks."""
    low, high, off = 127, -128, 8 if nibbles else 0
    for c in _chunks(values):
        parts = ((c & 0xF) ^ 8, (c >> 4) ^ 8) if nibbles else (c.view(np.int8),)
        for a in parts:  # a nibble xor 8 is its signed value + 8, in order
            low, high = min(low, int(a.min()) - off), max(high, int(a.max()) - off)
    return low, high


def _values_dtypes(w):
    """The dtypes a packed weight's codes can have: its type's storage, or uint8 for two
    codes of 4 bits per byte (in "nk" and "kn" where ``QuantType.nibbles_fit`` K, one
    int8 code per byte otherwise; for a lookup table when its rows fit)."""
    q = w.qtype
    if not q.packs_nibbles:
        return (q.storage,)
    nibbles, codes = np.dtype(np.uint8), np.dtype(np.int8)
    if w.layout in ("nk", "kn") and w.values is not None and w.values.ndim >= 2:
        k = w.values.shape[-1 if w.layout == "nk" else -2]
        return (codes,) if w.values.dtype == codes and not q.nibbles_fit(k) else (nibbles,)
    return (codes, nibbles)


def _check_weight(r, where, w):
    """What the format implies for a packed weight: the dtypes of its codes (by type and
    layout), sums (int32), scale and zero point (float32), and shapes that fit together."""
    check_scales(r, where, w.scale, w.zero_point)
    if w.sums is not None and w.sums.dtype != np.int32:
        raise r.error(f"{where}.sums are {describe(w.sums)}; sums of codes are int32")
    if w.layout == "tied":  # its scales are checked against the codes it reads (_check_tied)
        if w.values is not None or w.sums is not None:
            raise r.error(f"{where} has layout 'tied' but holds codes or sums of its own")
        return
    if w.values is None:
        raise r.error(f"{where} has no values (codes)")
    want = _values_dtypes(w)
    if w.values.dtype not in want:
        raise r.error(f"{where}.values are {describe(w.values)}, but a {w.qtype.describe()} weight "
                      f"in layout '{w.layout}' stores {' or '.join(d.name for d in want)} codes")
    if w.layout in ("nk", "kn"):
        _check_dense(r, where, w, values_shape(w))
    else:
        _check_operand(r, where, w, values_shape(w))


def _check_dense(r, where, w, shape):
    """Codes of a matmul, (stacked..., N, K) in "nk" or (stacked..., K, N) in "kn": sums
    (stacked..., N), per group (..., N, G) or (..., G, N); one scale per output channel
    (and per group of the innermost contracted axis, whose groups divide those of K)."""
    if len(shape) < 2:
        raise r.error(f"{where}.values have shape {list(w.values.shape)}; '{w.layout}' codes "
                      "have two axes after any stacked ones")
    stack, (n, k) = shape[:-2], (shape[-2:] if w.layout == "nk" else shape[-2:][::-1])
    g = w.qtype.group_size
    if g and k % g:
        raise r.error(f"{where}: its {k} contracted elements are no whole number of groups of {g}")
    groups = k // g if g else 1
    if w.sums is not None:
        want = stack + ((n,) if not g else (n, groups) if w.layout == "nk" else (groups, n))
        if w.sums.shape != want:
            raise r.error(f"{where}.sums have shape {list(w.sums.shape)}; codes of shape "
                          f"{list(shape)} in layout '{w.layout}' have sums of shape {list(want)}")
        bad = np.count_nonzero(np.asarray(w.sums) != _code_sums(w, g))
        if bad:
            raise r.error(f"{where}.sums: {bad} of {w.sums.size} are not the sums of its codes over "
                          f"K in layout '{w.layout}' (the codes, sums or layout were changed)")
    if w.scale is None or w.scale.ndim == 0:
        return
    outer, size = math.prod(stack), w.scale.size
    if not w.qtype.per_channel:
        ok = size in (1, outer)
    elif outer * n == 0:
        ok = size == 0
    else:  # per output channel, and per group: a divisor of K's groups (of its last axis)
        per, rest = divmod(size, outer * n)
        ok = rest == 0 and per >= 1 and (groups % per == 0 if g else per == 1)
    if not ok:
        raise r.error(f"{where}.scale has shape {list(w.scale.shape)}, which does not fit codes of "
                      f"shape {list(shape)} in layout '{w.layout}' ({n} output channels, "
                      f"{w.qtype.describe()})")


def _check_saved_numbers(key, w):
    """What :func:`jqt.load_packed` would refuse in a packed weight's numbers, refused
    before it is written: a scale, zero point or smoothing vector that is invalid (0,
    negative, NaN), and code sums that are not the sums of its codes (int32 sums cast
    to a float type and back are rounded)."""
    found = validate.operand_problems(w, "packed weight")
    if found:
        raise ValueError(f"jqt.save_packed: {validate.describe(key, found)}. jqt.load_packed "
                         "refuses such a file: re-run jqt.pack(qparams, params), or undo the "
                         "change to the packed weights.")
    if w.layout not in ("nk", "kn") or w.sums is None or w.values is None or w.qtype is None:
        return
    shape, g = values_shape(w), w.qtype.group_size
    if len(shape) < 2 or (g and shape[-1 if w.layout == "nk" else -2] % g):
        return  # (a shape the loader refuses, and names)
    want = _code_sums(w, g)
    bad = (np.count_nonzero(np.asarray(w.sums) != want) if np.shape(w.sums) == want.shape
           else w.sums.size)
    if bad:
        raise ValueError(f"jqt.save_packed: packed weight '{key}'.sums: {bad} of {w.sums.size} are "
                         "not the sums of its codes over K (a cast of the int32 sums to a float "
                         "type and back rounds them), and jqt.load_packed refuses such a file. "
                         "Re-run jqt.pack(qparams, params), or cast the float leaves only.")


def _code_sums(w, g):
    """The int32 sums over K of a "nk"/"kn" weight's codes (per group of ``g``), from its
    stored (host) codes: what :func:`jqt.pack` stores as its sums. Stacked layers are
    summed one at a time: unpacking a whole stack of 4-bit codes at once held about six
    times its packed bytes while the file loaded."""
    v = np.asarray(w.values)
    if v.ndim > 2 and v.size:
        flat = v.reshape((-1,) + v.shape[-2:])
        sums = np.stack([_matrix_sums(m, w.layout, w.nibbles, g) for m in flat])
        return sums.reshape(v.shape[:-2] + sums.shape[1:])
    return _matrix_sums(v, w.layout, w.nibbles, g)


def _matrix_sums(v, layout, nibbles, g):
    kax = v.ndim - (1 if layout == "nk" else 2)
    if nibbles:  # two codes per byte along K
        v = unpack_nibbles(v, kax)
    if not g:
        return np.sum(v, axis=kax, dtype=np.int32)
    split = v.shape[:kax] + (v.shape[kax] // g, g) + v.shape[kax + 1:]
    return np.sum(v.reshape(split), axis=kax + 1, dtype=np.int32)


def _check_operand(r, where, w, shape):
    """Codes in the op's own layout (or a lookup's table): scales, zero points and sums
    fit them (:func:`_fits`; sums have no groups)."""
    for name in ("scale", "zero_point", "sums"):
        a = getattr(w, name)
        if a is None or (a.ndim == 0 and name != "sums"):
            continue
        if not _fits(a.shape, shape, w.qtype.group_size if name != "sums" else 0):
            raise r.error(f"{where}.{name} has shape {list(a.shape)}, which does not fit codes of "
                          f"shape {list(shape)} (layout '{w.layout}', {w.qtype.describe()})")


def _fits(small, shape, g):
    """Whether an array of shape ``small`` holds one value per channel of codes of
    ``shape``: the same rank, each axis of length 1 (shared) or the codes' length; with
    groups of ``g``, one axis holds the number of groups along it instead."""
    if len(small) != len(shape):
        return False
    plain = [s in (1, m) for s, m in zip(small, shape)]
    if not g:
        return all(plain)
    grouped = [m % g == 0 and s == m // g for s, m in zip(small, shape)]
    return all(p or q for p, q in zip(plain, grouped)) and any(grouped)


def _check_tied(r, tied, weights):
    """``tied``: pairs (lookup key, matmul key). The lookup's weight (layout "tied") holds
    no codes and reads the matmul's 2-D codes, of the same type, whose table (the codes,
    or their transpose in "kn") its scales fit."""
    if not isinstance(tied, list):
        raise r.error(f"the header's 'tied' is {json_kind(tied)}, expected a list of pairs")
    for t in tied:
        if not (isinstance(t, list) and len(t) == 2
                and all(isinstance(k, str) and k in weights for k in t)):
            raise r.error(f"the header's 'tied' entry {json.dumps(t)} is not a pair of packed "
                          "weights")
        g, m = (weights[k] for k in t)
        if g.layout != "tied" or m.layout not in ("nk", "kn") or m.values.ndim != 2 \
                or g.qtype != m.qtype:
            raise r.error(f"the header ties packed weight '{t[0]}' (layout '{g.layout}', "
                          f"{g.qtype.describe()}) to '{t[1]}' (layout '{m.layout}', "
                          f"{m.qtype.describe()}); a tied lookup reads the 2-D codes of a matmul "
                          "of its type")
        table = values_shape(m)
        _check_operand(r, f"packed weight '{t[0]}'", g, table if m.layout == "nk" else table[::-1])
    loose = sorted(set(k for k, w in weights.items() if w.layout == "tied") - {t[0] for t in tied})
    if loose:
        raise r.error(f"packed weight '{loose[0]}' has layout 'tied' but is tied to no matmul")
    return [tuple(t) for t in tied]


def _split_as(aval, x):
    """``aval`` with the ``NamedSharding`` of the template leaf ``x`` where it splits a
    dimension over explicit mesh axes: the quantized function traces that leaf so
    (``jax.shard_map`` takes such a leaf only split as its ``in_specs`` say)."""
    sh = compat.explicit_sharding(x)
    return aval if sh is None else jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype, sharding=sh)


def _check_like(like, avals, paths, path, tree_repr=None):
    """The treedef of template ``like``, whose leaves must have the shapes and dtypes the
    file records (``avals``, at ``paths``); a template of the same leaves whose tree prints
    otherwise than the one packed (``tree_repr``: another static field) gets a warning."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    flat = [x for _, x in with_paths]
    trim = lambda p: p[:-len("/value")] if p.endswith("/value") else p  # an nnx Variable's value
    named = [(a, b) for a, b in zip(paths, (path_str(q) for q, _ in with_paths)) if trim(a) != trim(b)]
    if len(flat) == len(avals) and named:
        diagnostics.warn(
            f"jqt.load_packed: like= names its leaves otherwise than the params packed in {path} "
            f"(e.g. '{named[0][1]}' where the file has '{named[0][0]}'; {len(named)} of "
            f"{len(flat)}): leaves are matched by position, so a template of other params "
            "could swap two leaves of one shape. Pass a template of the params that were packed.")
    if len(flat) != len(avals):
        nones = sum(x is None for x in jax.tree_util.tree_leaves(like, is_leaf=lambda x: x is None))
        raise QParamsMismatchError(
            f"jqt.load_packed: like= has {len(flat)} leaves, but the params packed in {path} had "
            f"{len(avals)}. Pass a template of the params that were packed."
            + (f" like= holds None in {nones} place(s): an Equinox template partitioned with "
               "eqx.is_array has None where jax.ShapeDtypeStructs were (eqx.is_array takes "
               "arrays only): partition it with lambda v: isinstance(v, jax.ShapeDtypeStruct), "
               "or give the arrays' template, jax.eval_shape(lambda: params)."
               if len(flat) < len(avals) and nones else ""))
    for i, (x, a) in enumerate(zip(flat, avals)):
        shape, dtype = tuple(np.shape(x)), x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
        if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            data = jax.eval_shape(jax.random.key_data, x)
            if (tuple(data.shape), jnp.dtype(data.dtype)) != (tuple(a.shape), jnp.dtype(a.dtype)):
                raise QParamsMismatchError(
                    f"jqt.load_packed: leaf #{i} ('{paths[i]}') is a typed PRNG key ({dtype}) in "
                    f"like=, but {tuple(a.shape)} {jnp.dtype(a.dtype).name} in {path}. The template "
                    "does not describe the params that were packed.")
            raise QParamsMismatchError(
                f"jqt.load_packed: leaf #{i} ('{paths[i]}') of like= is a typed PRNG key ({dtype}), "
                f"which a file cannot hold: {path} has {tuple(a.shape)} {jnp.dtype(a.dtype).name} "
                "there (jax.random.key_data of a key, put in its place before jqt.pack). Pass "
                "like= with jax.random.key_data(key) in that place, and make the key again "
                "from the loaded data with jax.random.wrap_key_data.")
        # both as this process holds them: jqt.pack recorded the dtypes of its own process
        # (float64 where jax_enable_x64 was on; load_packed reads such a leaf as float32 here)
        dtype = jax.dtypes.canonicalize_dtype(dtype)
        if shape != tuple(a.shape) or jnp.dtype(dtype) != jax.dtypes.canonicalize_dtype(a.dtype):
            raise QParamsMismatchError(
                f"jqt.load_packed: leaf #{i} ('{paths[i]}') is {shape} {jnp.dtype(dtype).name} in "
                f"like=, but {tuple(a.shape)} {jnp.dtype(a.dtype).name} in {path}. The template "
                "does not describe the params that were packed.")
    if isinstance(tree_repr, str) and not named and _no_ids(str(treedef)) != _no_ids(tree_repr):
        _warn_static(_no_ids(str(treedef)), _no_ids(tree_repr), path)
    return treedef


def _no_ids(text):
    """A printed tree without the memory addresses of its static values (a function's repr,
    ``<function gelu at 0x7f...>``, differs in every process).

    >>> _no_ids("Mlp[(<function gelu at 0x7f8f12ab>,)]")
    'Mlp[(<function gelu at 0x...>,)]'
    """
    return re.sub(r" at 0x[0-9a-fA-F]+", " at 0x...", text)


def _warn_static(mine, theirs, path):
    """``like=`` has the packed params' leaves in another tree (``mine`` and ``theirs``,
    printed): where they first differ, and why it matters."""
    i = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
    at = lambda t: ("..." if i > 40 else "") + t[max(0, i - 40):i + 40] + ("..." if len(t) > i + 40 else "")
    diagnostics.warn(
        f"jqt.load_packed: like= has the leaves of the params packed in {path}, but its tree "
        f"differs from theirs ({at(mine)!r} where the file has {at(theirs)!r}): a node's type or "
        "static field (a dataclass field with static=True, a flax.struct field with "
        "pytree_node=False) is not the one packed, and f would run with it under qparams "
        "calibrated with the other. Pass a template built with the static fields of the params "
        "that were packed (or no like= where the file rebuilds the tree).")


def _check_leaf_codes(fn, key, src, aval, pw, codes):
    """The dropped weight leaf that op ``key`` reads, of the recorded ``aval``, holds as
    many elements as its packed weight's codes (of shape ``codes``), after the
    layout-only ops that lead from the leaf to the op."""
    try:
        shape = jax.eval_shape(lambda a: apply_chain(a, src.chain),
                               jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype)).shape
    except (TypeError, ValueError):
        shape = None
    if shape is None or math.prod(shape) != math.prod(codes):
        raise QParamsMismatchError(
            f"{fn}: op '{key}' reads weight leaf '{src.path}', recorded with shape "
            f"{list(aval.shape)}, but its packed weight holds codes of shape {list(codes)} "
            f"(layout '{pw.layout}'), which a weight of that shape does not give. The weights or "
            "qparams changed since jqt.pack; re-run jqt.pack (and jqt.save_packed).")


def _n_channels(q, depth):
    return int(np.prod(np.shape(q.scale)[depth:], dtype=np.int64))


def _same_values(a, b) -> bool:
    """Whether two scales (or zero points, smoothing vectors, or ``None``) hold the same
    numbers in the same order (a packed weight's are its qparams' up to a reshape); tracers
    pass. Order matters: weights with their output channels permuted have the same set of
    scales."""
    if a is None or b is None:
        return a is None and b is None
    if compat.is_tracer(a) or compat.is_tracer(b):
        return True
    # (in float32, the precision jqt computes with and files hold: float64 qparams saved
    # are their float32 values)
    a, b = (np.ravel(np.asarray(v).astype(np.float32)) for v in (a, b))
    return a.size == b.size and np.array_equal(a, b)


def check_packed(packed: PackedParams, qparams, *, fn="jqt.check_packed", packed_with=None) -> None:
    """Checks that ``packed`` (from :func:`jqt.pack`) matches ``qparams``: every packed
    weight belongs to a quantized weight operand of ``qparams`` and has its format, its
    shape agrees with that operand's per-channel scale, and every weight leaf dropped
    by ``pack`` is replaced by a packed weight, and each packed weight's own scales and
    zero points are the qparams' (a weight of a version-1 file holds none). With
    ``packed_with`` (the qparams stored with the weights), also checks that those give
    the same weight scales and zero points.
    Raises :class:`jqt.QParamsMismatchError`."""
    if not isinstance(packed, PackedParams):
        raise TypeError(f"{fn}: expected a jqt.PackedParams, got a {type(packed).__name__}.")
    validate.check_qparams_types(qparams, fn)
    extra = sorted(set(packed.weights) - set(qparams))
    if extra:
        raise QParamsMismatchError(
            f"{fn}: the packed weights hold ops {extra[:5]} that the qparams do not have (qparams "
            f"have {list(qparams)[:5]}{' ...' if len(qparams) > 5 else ''}). They were packed with "
            "other qparams; re-run jqt.pack with these.")
    dropped = set(range(len(packed.avals))) - set(packed.kept)
    # the weight argument these weights were packed from (jqt.pack's argnum)
    args = {qparams[k].source.arg for k in packed.weights if qparams[k].source is not None}
    index = weightcheck.leaf_index(leaf_paths(packed))  # weights by path, as jqt.pack finds them
    prefixed = weightcheck.prefixed_paths(qparams)
    for key, p in qparams.items():
        w, src = p.weight_operand, p.source
        q = None if w is None else p.operand(w)
        pw = packed.weight(key)
        leaf = None if src is None or src.arg not in args else weightcheck.find_leaf(
            src, index, key, fn, prefixed=prefixed)
        if pw is None:
            if leaf is not None and leaf in dropped:
                raise QParamsMismatchError(
                    f"{fn}: op '{key}' reads weight leaf '{src.path}', which the packed weights "
                    "dropped, but they hold no packed weight for it"
                    f"{' (the qparams keep this op float)' if q is None else ''}. They were "
                    "packed with other qparams; re-run jqt.pack with these.")
            continue
        if q is None:
            raise QParamsMismatchError(
                f"{fn}: the packed weights hold a weight for op '{key}' ("
                f"{'int8 codes' if pw.qtype is None else pw.qtype.describe()}), "
                "which these qparams keep float. They were packed with other qparams; re-run jqt.pack with these.")
        if pw.scale is None:  # a version-1 file's weight: int8 codes and sums, no scale or type
            validate.refuse_v1(fn, key, pw.values, q.qtype)
        elif pw.qtype != q.qtype:
            have, want = pw.qtype.contrast(q.qtype)
            raise QParamsMismatchError(
                f"{fn}: the packed weight of op '{key}' is {have}, but these "
                f"qparams quantize it as {want}. They were packed with other "
                "qparams; re-run jqt.pack with these.")
        why = fold_mismatch(pw.folded, p.fold_tag)
        if why:
            raise QParamsMismatchError(
                f"{fn}: the packed weight of op '{key}' does not fit these qparams: {why}. They "
                "were packed with other qparams; re-run jqt.pack with these (restored by a "
                "checkpointer, the packed weights take this record from the template: build it "
                "from the qparams of the same calibration).")
        shape = values_shape(pw)
        if leaf is not None and leaf in dropped:
            _check_leaf_codes(fn, key, src, packed.avals[leaf], pw, shape)
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
        if leaf is not None and leaf in dropped and src.shape is not None \
                and tuple(packed.avals[leaf].shape) != tuple(src.shape):
            raise QParamsMismatchError(
                f"{fn}: op '{key}' reads weight leaf '{src.path}', calibrated with shape "
                f"{list(src.shape)}, but the packed weights record that leaf with shape "
                f"{list(packed.avals[leaf].shape)}. The weights or qparams changed since "
                "jqt.pack; re-run jqt.pack (and jqt.save_packed).")
        side = "lhs" if w == 0 else "rhs"
        recast = next((f"qparams['{key}'].{side}.{name} is {np.dtype(b.dtype).name}" for name, a, b in
                       (("scale", pw.scale, q.scale), ("zero_point", pw.zero_point, q.zero_point))
                       if a is not None and b is not None and np.dtype(a.dtype) == np.float32
                       and np.dtype(b.dtype) != np.float32 and not _same_values(a, b)), None)
        if recast:  # the qparams were cast, not the packed weights (qparams of another float
            # dtype whose float32 values the file holds are the ones it was saved with)
            raise ValueError(
                f"{fn}: {recast}, where the packed weight's is float32 (as jqt.calibrate and "
                "jqt.pack make them, and jqt files hold them): the qparams were cast. Pass them "
                "as float32 (cast a copy for other uses).")
        if packed_with is not None:
            other = packed_with.get(key)
            ow = None if other is None else other.weight_operand
            oq = None if ow is None else other.operand(ow)
            same = oq is not None and oq.qtype == q.qtype and all(
                (a is None) == (b is None)
                and (a is None or _same_values(a, b))
                for a, b in ((oq.scale, q.scale), (oq.zero_point, q.zero_point)))
            src, osrc = p.source, None if other is None else other.source
            if same and src is not None and osrc is not None and (
                    axes_only(src.chain) != axes_only(osrc.chain)
                    or src.contract and osrc.contract and tuple(src.contract) != tuple(osrc.contract)):
                # one scale per tensor fits a square weight read either way round (casts and
                # copies aside, as jqt.quantize compares them)
                raise QParamsMismatchError(
                    f"{fn}: op '{key}' reads its weight by other layout ops in these qparams "
                    f"({list(axes_only(src.chain)) or 'none'}, contracting axes {tuple(src.contract or ())}) "
                    f"than in those it was packed with ({list(axes_only(osrc.chain)) or 'none'}, "
                    f"contracting {tuple(osrc.contract or ())}; the file holds them): another function's qparams "
                    "(x @ w.T for x @ w?). Use jqt.load(path) for the qparams, or re-run jqt.pack.")
            if not same:
                raise QParamsMismatchError(
                    f"{fn}: the weights of op '{key}' were quantized with other weight scales or "
                    "types than these qparams give (the file holds the qparams it was packed "
                    "with). Use jqt.load(path) for the qparams, or re-run jqt.pack.")
        if pw.smooth is not None and p.smooth is not None and not _same_values(pw.smooth, p.smooth):
            raise QParamsMismatchError(
                f"{fn}: the packed weight of op '{key}' was smoothed by another smoothing vector "
                "(SmoothQuant or AWQ) than these qparams hold: they are not the qparams it was "
                "packed with (another calibration?). Pass those, or re-run jqt.pack with these.")
        cast = next((f"{name} is {np.dtype(a.dtype).name}" for name, a, b in
                     (("scale", pw.scale, q.scale), ("zero point", pw.zero_point, q.zero_point))
                     if a is not None and b is not None and np.dtype(a.dtype) != np.dtype(b.dtype)
                     and not (np.dtype(a.dtype) == np.float32 and _same_values(a, b))), None)
        if cast:
            raise ValueError(
                f"{fn}: the packed weight of op '{key}': its {cast}, where jqt.pack made it "
                f"{np.dtype(q.scale.dtype).name} as the qparams' (a cast over the PackedParams' "
                "floats?). jqt files hold float32 scales and zero points: save the weights jqt.pack "
                "returned, and cast after jqt.load_packed.")
        zp = q.zero_point  # pack stores an int grid's zero point rounded (jqt.qat trains it)
        if zp is not None and q.qtype.grid == "int" and not compat.is_tracer(zp):
            zp = np.round(np.asarray(zp))
        if pw.scale is not None and not (_same_values(pw.scale, q.scale)
                                         and _same_values(pw.zero_point, zp)):
            raise QParamsMismatchError(
                f"{fn}: the packed weight of op '{key}' was quantized with other weight scales "
                "or zero points than these qparams give: they are not the qparams it was packed "
                "with (another calibration?). Pass those, or re-run jqt.pack with these.")

