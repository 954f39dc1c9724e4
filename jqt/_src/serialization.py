"""Files: ``jqt.save`` / ``jqt.load`` (qparams) here, and ``jqt.save_packed`` /
``jqt.load_packed`` (packed weights, ``packed_io.py``), in safetensors with a versioned
JSON header; the JSON codecs both use.

Formats (the JSON header is in the safetensors metadata under ``"jqt"``; ``"format"`` and
``"version"`` are also plain metadata entries, readable by any safetensors tool):

- ``jqt.qparams`` version 3 (``jqt.save`` to any path not ending in ``.npz``; version 2,
  from before formats were named by dtype, still loads): one tensor
  per scale / zero point, named ``<op key>/<lhs|rhs>.<scale|zero_point>``; the header
  holds each op's static metadata (quantization types, op, weight operand, source; and,
  where calibration recorded it, ``"weight_reach"``: ``[reach, digest]``, the
  ``WeightSource.calibrated_reach`` that :func:`jqt.pack` checks weights against, and
  ``"weight_shape"``, the leaf's shape, ``WeightSource.shape``, and ``"weight_prefixed"``,
  ``WeightSource.prefixed``: optional entries that earlier jqt ignores and files written
  before them lack).
- ``jqt.qparams`` version 1: the same header in an ``.npz`` (``jqt.save`` to a path
  ending in ``.npz``; kept so that files written by earlier jqt still load).
- ``jqt.packed`` version 2 (``jqt.save_packed``; version 1 still loads): per packed weight
  (a :class:`jqt.QArray`) ``packed/<op key>/values`` (int8, uint8 with two 4-bit codes per
  byte, or fp8 stored as its uint8 bytes), ``sums`` (int32), ``scale`` and ``zero_point``;
  ``params/<leaf path>`` per float leaf kept; the header holds each weight's type and layout, the avals of every leaf of the
  original params and a JSON description of their tree (rebuilt on load, or replaced
  by ``like=``), and optionally the qparams the weights were packed with.

Every header also lists each tensor's shape and dtype (``"tensors"``: name -> ``[shape,
dtype]``; files written before it was added still load, and are checked by what their
format implies).

Saving is atomic (``fileio.atomic_write``): a temporary file in the target's folder, flushed
to disk and renamed onto the target, so a failed save leaves the old file as it was.
Loading checks the file against its header (``fileio.Reader``, ``fileio.NpzReader``): every
field it reads, and every tensor's dtype and shape, against the list of tensors and
against what the format implies (see ``packed_io.py`` for packed weights). A damaged file
raises :class:`FormatError` naming the file, what is wrong and how to fix it.

The same JSON codecs serialize jqt's pytree aux data for ``jax.export`` (``export.py``).
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, validate
from .fileio import (FORMAT, PACKED_FORMAT, FormatError, NpzReader, Reader, atomic_write, file_path,
                     describe, dtype_from_name, is_a, is_zip, json_kind, kind_name, reading,
                     tensor_list, version_error, write)
from .qparams import OpQParams, QArray, WeightSource
from .registry import BY_NAME
from .formats import QuantType

VERSION = 1  # the .npz format
NPZ_READ = (1, 2)
# Files whose qparams hold outlier transforms (smooth, rotate) or narrow accumulators get
# the next version of their format (npz 2, safetensors 4, packed 3; packed 3 also for codes
# with a transform folded in, saved without qparams), so that a jqt that cannot apply them
# refuses the file instead of dropping them. Packed weights that hold their smoothing vector
# (a tensor 'smooth', recorded as 'smooth=<digest>') are packed 4: a jqt that reads 3 would
# call them damaged.


def versioned(version, qparams):
    """``version``, plus one when ``qparams`` hold outlier transforms or narrow
    accumulators (which an older jqt would drop)."""
    newer = qparams and any(p.transformed or (p.accumulator != 32 and not p.is_float)
                            for p in qparams.values())  # (a float op has no sums to narrow)
    return version + 1 if newer else version


ST_VERSION = 3  # the safetensors format of qparams (3: QuantType by dtype and group size)
ST_READ = (2, 3, 4)  # versions this jqt reads (2: integer types only)
PACKED_VERSION = 2  # 2: each weight a QArray (codes, sums, scale, zero point, type)
PACKED_READ = (1, 2, 3, 4)  # 4: weights that hold their smoothing vector ('smooth=<digest>')


def _tuplify(x):
    return tuple(_tuplify(i) for i in x) if isinstance(x, list) else x


# ---- JSON codecs of jqt's static metadata (also used by the jax.export registration) ------------

def qtype_to_json(t: QuantType) -> dict:
    return dataclasses.asdict(t)


def qtype_from_json(d: dict) -> QuantType:
    return QuantType(**d)


def source_to_json(s):
    """A :class:`WeightSource` as JSON, without ``calibrated_reach``, ``shape`` and
    ``prefixed`` (files store them as the op entry's own ``"weight_reach"``,
    ``"weight_shape"`` and ``"weight_prefixed"``, which a jqt that does not know them
    ignores)."""
    if s is None:
        return None
    d = dataclasses.asdict(s)
    for k in ("calibrated_reach", "shape", "prefixed"):
        d.pop(k, None)
    return d


def source_from_json(d):
    return None if d is None else WeightSource(**{k: _tuplify(v) for k, v in d.items()})


def aval_from_json(d) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(d[0]), dtype_from_name(d[1]))


class TreeNotSerializable(ValueError):
    """A pytree structure holds a node type jqt cannot describe in JSON."""


def treedef_to_json(treedef):
    """A JSON description of ``treedef``: ``"*"`` (leaf), ``None``, ``["tuple", children]``,
    ``["list", children]``, ``["dict", keys, children]`` (str or int keys), or
    ``["custom", name, base64 aux, children]`` for node types registered with
    ``jax.export.register_pytree_node_serialization`` (the rules of ``jax.export``).
    Raises :class:`TreeNotSerializable` for anything else."""
    node = treedef.node_data()
    if node is None:
        return "*"
    kind, aux = node
    ser, _ = compat.pytree_serialization_registries()
    if kind not in (type(None), tuple, list, dict) and kind not in ser:  # named before its children
        raise TreeNotSerializable(f"a node of type {kind.__module__}.{kind.__qualname__}")
    kids = [treedef_to_json(c) for c in treedef.children()]
    if kind is type(None):
        return None
    if kind is tuple:
        return ["tuple", kids]
    if kind is list:
        return ["list", kids]
    if kind is dict:
        keys = list(aux)
        if not all(type(k) in (str, int) for k in keys):  # (a str Enum's JSON is its value,
            # its path its name: rebuilt, its keys would not be the params')
            raise TreeNotSerializable(f"a dict with keys {keys[:4]} (only str and int keys, "
                                      "not subclasses such as an Enum's)")
        return ["dict", keys, kids]
    name, serialize = ser[kind]
    data = serialize(aux)
    return ["custom", name, base64.b64encode(bytes(data)).decode("ascii"), kids]


def _tree_from_json(d, leaves):
    if d == "*":
        return next(leaves)
    if d is None:
        return None
    tag = d[0]
    if tag == "tuple":
        return tuple(_tree_from_json(c, leaves) for c in d[1])
    if tag == "list":
        return [_tree_from_json(c, leaves) for c in d[1]]
    if tag == "dict":
        return {k: _tree_from_json(c, leaves) for k, c in zip(d[1], d[2])}
    if tag == "custom":
        _, de = compat.pytree_serialization_registries()
        if d[1] not in de:
            raise TreeNotSerializable(
                f"a node serialized as {d[1]!r}, which this process has not registered with "
                "jax.export.register_pytree_node_serialization (import the module that does)")
        kind, deserialize, from_children = de[d[1]]
        kids = [_tree_from_json(c, leaves) for c in d[3]]
        aux = base64.b64decode(d[2])
        try:
            return from_children(deserialize(aux), kids)
        except Exception as e:  # the user's registration, or its unflatten given placeholders
            raise TreeNotSerializable(
                f"a node serialized as {d[1]!r}, whose registered deserialize_auxdata or "
                f"unflatten fails on it ({type(e).__name__}: {str(e)[:200]}): a deserializer "
                "that does not undo its serializer (pickle copies sentinels, such as "
                "Equinox's Missing), an unflatten that computes from or checks its "
                "children (jqt rebuilds the structure with 0.0 leaves, then with "
                "jax.ShapeDtypeStruct leaves of the recorded shapes), or damaged bytes") from None
    raise FormatError(f"jqt: unknown tree node {tag!r} in the file.")


def treedef_from_json(d, avals=None):
    """Inverse of :func:`treedef_to_json`. The tree is rebuilt with ``0.0`` leaves (as
    ``jax.export`` does), or, where a node's unflatten refuses those, with ``avals``
    (``jax.ShapeDtypeStruct`` leaves: shapes to check) where given."""
    import itertools
    try:
        return jax.tree_util.tree_structure(_tree_from_json(d, itertools.repeat(0.0)))
    except TreeNotSerializable:
        if avals is None:
            raise
        try:
            leaves = itertools.chain(avals, itertools.repeat(0.0))
            return jax.tree_util.tree_structure(_tree_from_json(d, leaves))
        except TreeNotSerializable:
            pass
        raise


def qparams_entries(qparams, name, fn="jqt.save"):
    """(JSON entries, arrays): ``name(key, side, field)`` names each array. Equal arrays
    (the scales of ops that read one weight, e.g. a layer applied in a Python loop) are
    stored once, every entry naming the first."""
    if not isinstance(qparams, dict) or not all(isinstance(v, OpQParams) for v in qparams.values()):
        raise TypeError(f"{fn}: expected the qparams dict returned by jqt.calibrate, got a "
                        f"{type(qparams).__name__}.")
    arrays, entries, seen = {}, {}, {}

    def store(a, i, key, side, field, where):
        a = float32_scale(a, where, fn)
        digest = (a.shape, hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).digest())
        for n in seen.get(digest, ()):
            if np.array_equal(arrays[n], a):
                return n
        n = name(i, key, side, field)
        arrays[n] = a
        seen.setdefault(digest, []).append(n)
        return n

    for i, (key, p) in enumerate(qparams.items()):
        ops = []
        for side, q in (("lhs", p.lhs), ("rhs", p.rhs)):
            if q is None:
                ops.append(None)
                continue
            d = {"qtype": qtype_to_json(q.qtype)}
            for field in ("scale", "zero_point"):
                a = getattr(q, field)
                if a is not None:
                    d[field] = store(a, i, key, side, field, f"qparams['{key}'].{side}.{field}")
            ops.append(d)
        entries[key] = {"lhs": ops[0], "rhs": ops[1], "op": p.op,
                        "weight_operand": p.weight_operand, "note": p.note,
                        "source": source_to_json(p.source)}
        if p.smooth is not None:
            entries[key]["smooth"] = store(p.smooth, i, key, "op", "smooth",
                                           f"qparams['{key}'].smooth")
        if p.rotate:
            entries[key]["rotate"] = True
        if p.accumulator != 32 and not p.is_float:
            entries[key]["accumulator"] = p.accumulator
        reach = None if p.source is None else p.source.calibrated_reach
        if reach is not None:
            entries[key]["weight_reach"] = [float(reach[0]), str(reach[1])]
            if reach[2:] == (True,):  # pruned channels or groups (a key older jqt ignores)
                entries[key]["weight_zero_groups"] = True
        if p.source is not None and p.source.shape is not None:
            entries[key]["weight_shape"] = [int(n) for n in p.source.shape]
        if p.source is not None and p.source.prefixed is not None:
            entries[key]["weight_prefixed"] = bool(p.source.prefixed)
    return entries, arrays


def float32_scale(a, where, fn):
    """``a`` (a scale or zero point to save) as a float32 NumPy array: jqt files hold
    float32, the precision every path computes with; a scale of another float dtype (qparams
    trained under x64 or cast to bfloat16, and :func:`jqt.qat.project`'s result of them) is
    stored as its float32 value, which is what runs. A value beyond float32's range, or
    another dtype, is refused.

    >>> float32_scale(np.float64(0.1), "s", "jqt.save").dtype
    dtype('float32')
    """
    a = np.asarray(a)
    if a.dtype == np.float32:
        return a
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{fn}: {where} is {a.dtype.name}; jqt files hold float32 scales and zero "
                         "points (as jqt.calibrate makes them). Cast it to float32 first.")
    with np.errstate(over="ignore"):
        b = a.astype(np.float32)
    if np.any(np.isinf(b) & np.isfinite(a)):
        raise ValueError(f"{fn}: {where} is {a.dtype.name} with values beyond float32's range, in "
                         "which jqt computes and files hold scales; apply jqt.qat.project, which "
                         "keeps them within it.")
    return b


def qparams_from_entries(entries, r, where="the header's 'ops'"):
    """The qparams that ``entries`` (from :func:`qparams_entries`) describe, their arrays
    read from ``r`` (a :class:`Reader` or :class:`NpzReader`). Every field and array is
    checked; a damaged file raises :class:`FormatError`."""
    if not isinstance(entries, dict):
        raise r.error(f"{where} is {json_kind(entries)}, expected an object of ops")
    return {key: _op_from_entry(r, key, e) for key, e in entries.items()}


def _op_from_entry(r, key, e):
    where = f"op '{key}'"
    op = r.need(e, "op", str, where)
    if op not in BY_NAME:
        raise r.error(f"{where}: 'op' is {op!r}, which is not an op this jqt quantizes (it knows "
                      f"{', '.join(sorted(BY_NAME))}); if a newer jqt wrote the file, upgrade "
                      "jqt")
    w = r.need(e, "weight_operand", (int, type(None)), where)
    if w not in (None, 0, 1):
        raise r.error(f"{where}: 'weight_operand' is {w!r}, expected 0, 1 or null")
    source = _source_from_entry(r, r.need(e, "source", (dict, type(None)), where), where)
    if "weight_shape" in e and source is not None:  # first: the scale is checked against it
        shape = r.need(e, "weight_shape", list, where)
        if not all(is_a(n, int) and n >= 0 for n in shape):
            raise r.error(f"{where}: 'weight_shape' is {json.dumps(shape)[:80]}, expected a list "
                          "of sizes (ints >= 0)")
        source = dataclasses.replace(source, shape=tuple(shape))
    if "weight_prefixed" in e and source is not None:
        source = dataclasses.replace(source, prefixed=r.need(e, "weight_prefixed", bool, where))
    ops = [_operand_from_entry(r, r.need(e, side, (dict, type(None)), where), f"{where} {side}",
                               source if i == w else None)
           for i, side in enumerate(("lhs", "rhs"))]
    smooth = None
    if e.get("smooth") is not None:
        smooth = r.get(r.need(e, "smooth", str, where), f"{where}.smooth")
        check_scales(r, f"{where} smooth", smooth, None)
    rotate = r.need(e, "rotate", bool, where) if "rotate" in e else False
    acc = r.need(e, "accumulator", int, where) if "accumulator" in e else 32
    if "weight_reach" in e and source is not None:
        reach = _reach_from_entry(r, e, where)
        if r.need(e, "weight_zero_groups", bool, where) if "weight_zero_groups" in e else False:
            reach += (True,)
        source = dataclasses.replace(source, calibrated_reach=reach)
    p = OpQParams(lhs=ops[0], rhs=ops[1], op=op, weight_operand=w, source=source,
                  note=r.need(e, "note", str, where), smooth=smooth, rotate=rotate,
                  accumulator=acc)
    why = validate.accumulator_problem(key, p)
    if why:
        raise FormatError(f"{r.fn}: {r.path}: {why}")
    check_values(r, key, validate.problems(p))
    return p


def _reach_from_entry(r, e, where):
    """An op entry's ``"weight_reach"``: ``[reach, digest]`` (``WeightSource.calibrated_reach``)."""
    d = r.need(e, "weight_reach", list, where)
    if (len(d) != 2 or not is_a(d[0], (int, float)) or not math.isfinite(d[0]) or d[0] < 0
            or not isinstance(d[1], str)):
        raise r.error(f"{where}: 'weight_reach' is {json.dumps(d)[:80]}, expected "
                      "[a finite number >= 0, a digest string]")
    return float(d[0]), d[1]


def check_values(r, key, found):
    """A :class:`FormatError` naming the file when the numbers read for op ``key`` are
    invalid (``found``: :func:`validate.problems`)."""
    if found:
        raise FormatError(f"{r.fn}: {r.path}: {validate.describe(key, found)}. {validate.FIX}")


_SOURCE_FIELDS = {"arg": int, "path": str, "leaf": int, "chain": tuple, "float_needed": bool,
                  "contract": tuple, "batch": tuple}


def _source_from_entry(r, d, where):
    """A :class:`WeightSource` from the header, its fields type-checked."""
    if d is None:
        return None
    where = f"{where} source"
    try:
        s = source_from_json(d)
    except TypeError as e:
        raise r.error(f"{where} is not a weight source ({e})") from None
    for name, kind in _SOURCE_FIELDS.items():
        if not is_a(getattr(s, name), kind):
            raise r.error(f"{where}: {name!r} is {json_kind(getattr(s, name))}, expected "
                          f"{kind_name(kind)}")
    if not all(is_a(a, int) and a >= 0 for a in s.contract + s.batch):
        raise r.error(f"{where}: axes {s.contract} / {s.batch} are not axis numbers")
    if not all(isinstance(c, tuple) and c and isinstance(c[0], str) for c in s.chain):
        raise r.error(f"{where}: 'chain' {s.chain} is not a list of [op name, ...] entries")
    return s


def _operand_from_entry(r, d, where, source):
    """One operand's :class:`QArray` (no values); ``source`` for the weight operand."""
    if d is None:
        return None
    qtype = qtype_from_header(r, r.need(d, "qtype", dict, where), where)
    arrays = {f: r.get(r.need(d, f, str, where), f"{where}.{f}")
              for f in ("scale", "zero_point") if f in d}
    check_scales(r, where, arrays.get("scale"), arrays.get("zero_point"))
    if source is not None:
        _check_weight_scale(r, where, arrays.get("scale"), qtype, source)
    return QArray(**arrays, qtype=qtype)


def qtype_from_header(r, d, where):
    """:func:`qtype_from_json` for a file read by ``r``: a :class:`FormatError` if ``d`` is
    not a valid :class:`QuantType`."""
    try:
        t = qtype_from_json(d)
    except (TypeError, ValueError) as e:
        raise r.error(f"{where}: 'qtype' {json.dumps(d)} is not a jqt.QuantType ({e})") from None
    flags = ("symmetric", "narrow_range", "per_channel", "dynamic")
    if not all(isinstance(getattr(t, f), bool) for f in flags):
        raise r.error(f"{where}: 'qtype' {json.dumps(d)} has a flag that is not true or false")
    return t


def check_scales(r, where, scale, zero_point):
    """A scale and zero point read from a file: float32, the zero point only with a scale
    and of its shape."""
    for name, a in (("scale", scale), ("zero_point", zero_point)):
        if a is not None and a.dtype != np.float32:
            raise r.error(f"{where}.{name} is {describe(a)}; scales and zero points are float32")
    if zero_point is not None and (scale is None or zero_point.shape != scale.shape):
        got = "no scale" if scale is None else f"a scale of shape {list(scale.shape)}"
        raise r.error(f"{where} has a zero point of shape {list(zero_point.shape)} and {got}; "
                      "they have one shape")


def _check_weight_scale(r, where, scale, qtype, source):
    """A weight scale that fits its weight (:func:`validate.weight_scale_problem`): a
    per-channel one has the operand's rank and length 1 on its contracted axes, a grouped
    one no shared axis (:mod:`groups`), a per-tensor one no axis beyond the stacked ones."""
    why = validate.weight_scale_problem(scale, qtype, source, name=f"{where}.scale")
    if why:
        raise r.error(why)


# ---- qparams ------------------------------------------------------------------------------------

def save(path, qparams) -> None:
    """Saves ``qparams`` (arrays and metadata) to ``path``.

    A path ending in ``.npz`` gets the ``.npz`` format (version 1, the one every jqt
    reads; but a jqt from before formats were named by dtype, 2026-11-23, fails on the
    ``"dtype"`` entries of its types with a ``TypeError`` instead of refusing the file);
    any other path (``.safetensors`` recommended) gets a safetensors file (format
    ``jqt.qparams`` version 3). qparams with outlier transforms or narrow accumulators,
    which an older jqt would drop, get the next version (``.npz`` 2, safetensors 4), so
    that such a jqt refuses the file. :func:`jqt.load` reads them all. To store the packed weights
    too (one file to deploy), see :func:`jqt.save_packed`.

    The file is written atomically: to a temporary file in the same folder, renamed onto
    ``path`` once complete, so a failed save leaves an existing file as it was.

    >>> import os, tempfile, jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> p = os.path.join(tempfile.mkdtemp(), "qp.safetensors")
    >>> jqt.save(p, qp)
    >>> jqt.load(p)["w"].rhs.qtype == qp["w"].rhs.qtype
    True
    """
    path = file_path(path, "jqt.save", "call jqt.save(path, qparams), the path first")
    if any(compat.is_tracer(a) for a in jax.tree_util.tree_leaves(qparams)):
        raise TypeError("jqt.save: qparams hold traced values (jqt.save called inside jax.jit, "
                        "jax.grad or another transformation); return the qparams from the "
                        "transformed function and save them outside it.")
    validate.check_qparams(qparams, "jqt.save")  # a file jqt.load would refuse is not written
    for k, p in qparams.items():
        q = p.operand(p.weight_operand) if p.weight_operand is not None else None
        why = "" if q is None else validate.weight_scale_problem(q.scale, q.qtype, p.source)
        if why:
            raise ValueError(f"jqt.save: op '{k}': {why}. jqt.load would refuse the file, so it "
                             "is not written.")
    qparams = validate.numbers_as_arrays(qparams)  # Python floats as the float32 they run as
    if os.fspath(path).endswith(".npz"):
        entries, arrays = qparams_entries(qparams, lambda i, key, side, fld: f"{i}.{side}.{fld}")
        header = json.dumps({"format": FORMAT, "version": versioned(VERSION, qparams), "ops": entries,
                             "tensors": tensor_list(arrays)})
        atomic_write(path, lambda tmp: _write_npz(tmp, header, arrays))
        return
    entries, arrays = qparams_entries(qparams, _qp_tensor_name)
    write(path, arrays, {"ops": entries}, FORMAT, versioned(ST_VERSION, qparams))


def _write_npz(tmp, header, arrays):
    with open(tmp, "wb") as fh:
        np.savez(fh, __header__=np.frombuffer(header.encode(), np.uint8), **arrays)


def _qp_tensor_name(i, key, side, field):
    return f"{key}/{side}.{field}"


def load(path) -> dict:
    """Loads qparams saved by :func:`jqt.save` (``.npz``, versions 1 and 2, or
    safetensors, versions 2 to 4) or stored with packed weights by :func:`jqt.save_packed`; checks
    the format and version, and every array's dtype and shape against the file's header.
    Arrays are returned as NumPy arrays. A damaged file raises a ``ValueError`` naming
    the file and what is wrong.

    >>> import os, tempfile, jax, jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> p = os.path.join(tempfile.mkdtemp(), "qp.safetensors")
    >>> jqt.save(p, qp)
    >>> back = jqt.load(p)
    >>> jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(qp)
    True
    """
    path = file_path(path, "jqt.load")
    if is_zip(path, "jqt.load"):
        return _load_npz(path)
    with Reader(path, "jqt.load") as r, reading(r):
        return _load_qparams(r, path)


def _load_qparams(r, path):
    if r.format == PACKED_FORMAT:
        if r.version not in PACKED_READ:
            raise version_error("jqt.load", path, r.format, r.version, f"versions {PACKED_READ}",
                                PACKED_READ)
        if r.header.get("qparams") is None:
            raise FormatError(f"jqt.load: {path} holds packed weights without qparams (saved by "
                              "jqt.save_packed without qparams=); read it with jqt.load_packed.")
        return qparams_from_entries(r.header["qparams"], r, "the header's 'qparams'")
    if r.format != FORMAT:
        raise FormatError(f"jqt.load: {path} is not a jqt qparams file (format {r.format!r}).")
    if r.version not in ST_READ:
        raise version_error("jqt.load", path, r.format, r.version,
                            f"versions {NPZ_READ} (.npz) and {ST_READ} (safetensors)", ST_READ)
    return qparams_from_entries(r.need(r.header, "ops", dict, "the header"), r)


def _load_npz(path):
    with NpzReader(path, "jqt.load") as r, reading(r):
        if r.format != FORMAT:
            raise FormatError(f"jqt.load: {path} is not a jqt qparams file (format {r.format!r}).")
        if r.version not in NPZ_READ:
            raise version_error("jqt.load", path, r.format, r.version,
                                f"versions {NPZ_READ} (.npz) and {ST_READ} (safetensors)", NPZ_READ)
        return qparams_from_entries(r.need(r.header, "ops", dict, "the header"), r)
