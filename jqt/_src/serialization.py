"""Files: ``jqt.save`` / ``jqt.load`` (qparams) here, and ``jqt.save_packed`` /
``jqt.load_packed`` (packed weights, ``packed_io.py``), in safetensors with a versioned
JSON header; the JSON codecs both use.

Formats (the JSON header is in the safetensors metadata under ``"jqt"``; ``"format"`` and
``"version"`` are also plain metadata entries, readable by any safetensors tool):

- ``jqt.qparams`` version 3 (``jqt.save`` to any path not ending in ``.npz``; version 2,
  from before formats were named by dtype, still loads): one tensor
  per scale / zero point, named ``<op key>/<lhs|rhs>.<scale|zero_point>``; the header
  holds each op's static metadata (quantization types, op, weight operand, source).
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

Saving is atomic (:func:`atomic_write`): a temporary file in the target's folder, flushed
to disk and renamed onto the target, so a failed save leaves the old file as it was.
Loading checks the file against its header (:class:`Reader`, :class:`NpzReader`): every
field it reads, and every tensor's dtype and shape, against the list of tensors and
against what the format implies (see ``packed_io.py`` for packed weights). A damaged file
raises :class:`FormatError` naming the file, what is wrong and how to fix it.

The same JSON codecs serialize jqt's pytree aux data for ``jax.export`` (``export.py``).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import math
import os
import secrets
import stat

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, validate
from .qparams import OpQParams, QArray, WeightSource
from .formats import QuantType

FORMAT = "jqt.qparams"
VERSION = 1  # the .npz format
NPZ_READ = (1, 2)
# Files whose qparams hold outlier transforms (smooth, rotate) or narrow accumulators get
# the next version of their format (npz 2, safetensors 4, packed 3), so that a jqt that
# cannot apply them refuses the file instead of dropping them.


def versioned(version, qparams):
    """``version``, plus one when ``qparams`` hold outlier transforms or narrow
    accumulators (which an older jqt would drop)."""
    newer = qparams and any(p.transformed or p.accumulator != 32 for p in qparams.values())
    return version + 1 if newer else version
ST_VERSION = 3  # the safetensors format of qparams (3: QuantType by dtype and group size)
ST_READ = (2, 3, 4)  # versions this jqt reads (2: integer types only)
PACKED_FORMAT = "jqt.packed"
PACKED_VERSION = 2  # 2: each weight a QArray (codes, sums, scale, zero point, type)
PACKED_READ = (1, 2, 3)

# dtypes safetensors stores natively; anything else is stored as its raw bytes (uint8).
_NATIVE = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "bfloat16", "float32", "float64"}


class FormatError(ValueError):
    """A file is not a jqt file of the expected kind, is damaged (a header, dtype or shape
    that does not match, invalid numbers in its qparams), or has an unsupported version.
    The message names the file, what is wrong and how to fix it.

    >>> import os, tempfile, jqt
    >>> path = os.path.join(tempfile.mkdtemp(), "qp.safetensors")
    >>> _ = open(path, "wb").write(b"not a jqt file")
    >>> try:
    ...     jqt.load(path)
    ... except jqt.FormatError as e:
    ...     print("is not a jqt file, or a damaged one" in str(e))
    True
    """


def _tuplify(x):
    return tuple(_tuplify(i) for i in x) if isinstance(x, list) else x


# ---- JSON codecs of jqt's static metadata (also used by the jax.export registration) ------------

def qtype_to_json(t: QuantType) -> dict:
    return dataclasses.asdict(t)


def qtype_from_json(d: dict) -> QuantType:
    return QuantType(**d)


def source_to_json(s):
    return None if s is None else dataclasses.asdict(s)


def source_from_json(d):
    return None if d is None else WeightSource(**{k: _tuplify(v) for k, v in d.items()})


def dtype_from_name(name: str):
    try:
        return jnp.dtype(name)
    except TypeError:
        raise FormatError(f"jqt: unknown dtype {name!r} in the file (written by a newer JAX or "
                          "ml_dtypes?).") from None


def aval_to_json(a) -> list:
    return [list(a.shape), jnp.dtype(a.dtype).name]


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
    kids = [treedef_to_json(c) for c in treedef.children()]
    if kind is type(None):
        return None
    if kind is tuple:
        return ["tuple", kids]
    if kind is list:
        return ["list", kids]
    if kind is dict:
        keys = list(aux)
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys):
            raise TreeNotSerializable(f"a dict with keys {keys[:4]} (only str and int keys)")
        return ["dict", keys, kids]
    ser, _ = compat.pytree_serialization_registries()
    if kind in ser:
        name, serialize = ser[kind]
        data = serialize(aux)
        return ["custom", name, base64.b64encode(bytes(data)).decode("ascii"), kids]
    raise TreeNotSerializable(f"a {kind.__module__}.{kind.__qualname__} node")


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
        return from_children(deserialize(base64.b64decode(d[2])), kids)
    raise FormatError(f"jqt: unknown tree node {tag!r} in the file.")


def treedef_from_json(d):
    """Inverse of :func:`treedef_to_json`."""
    import itertools
    return jax.tree_util.tree_structure(_tree_from_json(d, itertools.repeat(0.0)))


def qparams_entries(qparams, name, fn="jqt.save"):
    """(JSON entries, arrays): ``name(key, side, field)`` names each array."""
    if not isinstance(qparams, dict) or not all(isinstance(v, OpQParams) for v in qparams.values()):
        raise TypeError(f"{fn}: expected the qparams dict returned by jqt.calibrate, got a "
                        f"{type(qparams).__name__}.")
    arrays, entries = {}, {}
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
                    n = name(i, key, side, field)
                    arrays[n] = float32_scale(a, f"qparams['{key}'].{side}.{field}", fn)
                    d[field] = n
            ops.append(d)
        entries[key] = {"lhs": ops[0], "rhs": ops[1], "op": p.op,
                        "weight_operand": p.weight_operand, "note": p.note,
                        "source": source_to_json(p.source)}
        if p.smooth is not None:
            n = name(i, key, "op", "smooth")
            arrays[n] = float32_scale(p.smooth, f"qparams['{key}'].smooth", fn)
            entries[key]["smooth"] = n
        if p.rotate:
            entries[key]["rotate"] = True
        if p.accumulator != 32:
            entries[key]["accumulator"] = p.accumulator
    return entries, arrays


def float32_scale(a, where, fn):
    """``a`` (a scale or zero point to save) as a NumPy array; jqt files hold float32."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        raise ValueError(f"{fn}: {where} is {a.dtype.name}; jqt files hold float32 scales and zero "
                         "points (as jqt.calibrate makes them). Cast it to float32 first.")
    return a


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
    w = r.need(e, "weight_operand", (int, type(None)), where)
    if w not in (None, 0, 1):
        raise r.error(f"{where}: 'weight_operand' is {w!r}, expected 0, 1 or null")
    source = _source_from_entry(r, r.need(e, "source", (dict, type(None)), where), where)
    ops = [_operand_from_entry(r, r.need(e, side, (dict, type(None)), where), f"{where} {side}",
                               source if i == w else None)
           for i, side in enumerate(("lhs", "rhs"))]
    smooth = None
    if e.get("smooth") is not None:
        smooth = r.get(r.need(e, "smooth", str, where), f"{where}.smooth")
        check_scales(r, f"{where} smooth", smooth, None)
    rotate = r.need(e, "rotate", bool, where) if "rotate" in e else False
    acc = r.need(e, "accumulator", int, where) if "accumulator" in e else 32
    p = OpQParams(lhs=ops[0], rhs=ops[1], op=op, weight_operand=w, source=source,
                  note=r.need(e, "note", str, where), smooth=smooth, rotate=rotate,
                  accumulator=acc)
    why = validate.accumulator_problem(key, p)
    if why:
        raise FormatError(f"{r.fn}: {r.path}: {why}")
    check_values(r, key, validate.problems(p))
    return p


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
                          f"{_JSON_KINDS.get(kind, kind.__name__)}")
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
    """A per-channel weight scale has the operand's rank (after stacked axes) and length 1
    on its contracted axes; a grouped one has no shared axis (:mod:`groups`)."""
    if scale is None or not qtype.per_channel or scale.ndim == 0:
        return
    depth = source.stack_depth
    axes = [a + depth for a in source.contract]
    shared = [] if qtype.group_size else axes
    if any(a >= scale.ndim for a in axes) or any(scale.shape[a] != 1 for a in shared):
        raise r.error(f"{where}.scale has shape {list(scale.shape)}, which does not fit the "
                      f"weight: its contracted axes {list(source.contract)} (after {depth} "
                      f"stacked axes) share one scale{' per group' if qtype.group_size else ''}")


# ---- atomic writes ------------------------------------------------------------------------------

def atomic_write(path, write_to) -> None:
    """Writes ``path`` all at once or not at all: ``write_to(tmp)`` writes a temporary file
    in the same folder, which is flushed to disk (``fsync``) and renamed onto ``path``
    (``os.replace``, atomic on POSIX and Windows). Whatever fails (``write_to``, a full
    disk, an interrupt), ``path`` keeps its old content and the temporary file is removed.
    A symbolic link is written through (its target is replaced)."""
    target = os.path.realpath(os.fspath(path))
    if os.path.isdir(target):
        raise IsADirectoryError(f"jqt: cannot write {os.fspath(path)!r}: it is a folder. Give a file "
                                "name in it, e.g. os.path.join(folder, 'model.safetensors').")
    if not os.path.isdir(os.path.dirname(target)):
        raise FileNotFoundError(f"jqt: cannot write {os.fspath(path)!r}: its folder "
                                f"{os.path.dirname(target)!r} does not exist. Create it first "
                                "(os.makedirs(folder, exist_ok=True)).")
    tmp = _create_temp(target)
    try:
        write_to(tmp)
        with contextlib.suppress(OSError):  # an existing file keeps its permissions
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        _fsync(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(target))


def _create_temp(target):
    """A new empty file ``.<name>.<random>.tmp`` next to ``target`` (0o666 less the umask,
    as ``open`` creates)."""
    folder, name = os.path.split(target)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return tmp


def _fsync(path):
    fd = os.open(path, os.O_RDWR)  # (Windows flushes only a handle opened for writing)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder):
    """Makes the rename itself durable where the OS allows (POSIX; not Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- safetensors helpers ------------------------------------------------------------------------

def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:  # pragma: no cover - a declared dependency
        raise ImportError("jqt: saving and loading .safetensors files needs the 'safetensors' "
                          "package: pip install safetensors") from None
    return safetensors


def _storable(a):
    """(array safetensors can store, original dtype name or None when stored as is)."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        a = a.copy(order="C")
    if a.dtype.name in _NATIVE:
        return a, None
    return np.frombuffer(a.tobytes(), np.uint8).copy(), a.dtype.name


def tensor_list(tensors) -> dict:
    """The header's ``"tensors"``: name -> ``[shape, dtype name]`` of each array."""
    return {n: aval_to_json(np.asarray(a)) for n, a in tensors.items()}


def write(path, tensors, header, fmt, version):
    """Writes a jqt safetensors file (atomically): ``tensors`` and the JSON ``header``."""
    st = _safetensors()
    stored, encoded = {}, {}
    for n, a in tensors.items():
        stored[n], enc = _storable(a)
        if enc is not None:
            encoded[n] = [enc, list(np.shape(a))]
    header = dict(header, format=fmt, version=version, encoded=encoded,
                  tensors=tensor_list(tensors))
    meta = {"format": fmt, "version": str(version), "jqt": json.dumps(header)}
    atomic_write(path, lambda tmp: st.numpy.save_file(stored, tmp, metadata=meta))


def is_zip(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


# ---- reading, checked ---------------------------------------------------------------------------

_FIX = {FORMAT: "Re-save it with jqt.save (or restore a good copy).",
        PACKED_FORMAT: "Re-save it with jqt.save_packed (or restore a good copy)."}


_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
               int: "an integer", float: "a number", type(None): "null"}


def json_kind(v) -> str:
    """The JSON kind of ``v`` ("an object", "a list", ...), for errors."""
    return _JSON_KINDS.get(type(v), f"a {type(v).__name__}")


def is_a(v, kind) -> bool:
    """``isinstance(v, kind)``, where a bool is not an int (JSON ``true`` is not 1)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(v, kinds) and not (type(v) is bool and bool not in kinds and int in kinds)


def describe(a) -> str:
    """``"int8[64, 32]"``: an array's dtype and shape, for errors."""
    return f"{np.dtype(a.dtype).name}{list(np.shape(a))}"


def _first_line(e) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class _Checked:
    """What the readers of both formats share: errors that name the file, the fix and what
    is wrong; header fields checked as they are read; every tensor checked against the
    header's list of tensors. A subclass opens the file, sets ``fn`` and ``path`` and
    calls ``_open_checked``; it defines ``_open`` (sets ``names``, the tensors the file
    holds, and reads the header with ``_parse_header``), ``_read`` (one tensor) and
    ``close``."""

    fix = "Re-save it with jqt.save or jqt.save_packed (or restore a good copy)."
    encoded: dict = {}

    def error(self, what) -> FormatError:
        return FormatError(f"{self.fn}: {self.path} is damaged: {what}. {self.fix}")

    def need(self, d, key, kind, where):
        """``d[key]``, which must exist and be a ``kind`` (a type or tuple of types)."""
        if not isinstance(d, dict):
            raise self.error(f"{where} is {json_kind(d)}, expected an object")
        if key not in d:
            raise self.error(f"{where} has no {key!r}")
        if not is_a(d[key], kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            want = " or ".join(_JSON_KINDS.get(k, k.__name__) for k in kinds)
            raise self.error(f"{where}: {key!r} is {json_kind(d[key])}, expected {want}")
        return d[key]

    def dtype(self, name, where):
        """The dtype named ``name`` (a number type NumPy, JAX or ml_dtypes knows)."""
        try:
            dt = np.dtype(dtype_from_name(name)) if isinstance(name, str) else None
        except FormatError:
            dt = None
        if dt is None or not (dt.kind in "biufc" or dt.type.__module__.startswith("ml_dtypes")):
            raise self.error(f"{where}: {name!r} is not a dtype this jqt knows (a file written "
                             "by a newer JAX or ml_dtypes?)")
        return dt

    def aval(self, d, where):
        """``(shape, dtype)`` from the header's ``[shape, dtype name]``."""
        ok = (isinstance(d, list) and len(d) == 2 and isinstance(d[0], list)
              and all(is_a(n, int) and n >= 0 for n in d[0]))
        if not ok:
            raise self.error(f"{where} is {json.dumps(d)}, expected [shape, dtype name]")
        return tuple(d[0]), self.dtype(d[1], where)

    def _fields(self, key, entry):
        """The header's object ``key`` (optional): name -> ``entry(value, where)``."""
        d = self.header.get(key)
        if d is None:
            return None
        if not isinstance(d, dict):
            raise self.error(f"the header's {key!r} is {json_kind(d)}, expected an object")
        return {n: entry(v, f"the header's {key!r} entry for tensor '{n}'") for n, v in d.items()}

    @functools.cached_property
    def tensors(self):
        """The header's list of tensors (``None`` in files written before it), checked
        against the tensors the file holds."""
        t = self._fields("tensors", self.aval)
        if t is not None:
            missing, extra = sorted(set(t) - self.names), sorted(self.names - set(t))
            if missing:
                raise self.error(f"the header lists tensor '{missing[0]}', which the file does "
                                 "not hold")
            if extra:
                raise self.error(f"the file holds tensor '{extra[0]}', which its header does not "
                                 "list")
        return t

    def get(self, name, what):
        """Tensor ``name`` (``what``: its role, for errors), checked against the header's
        list of tensors."""
        if not isinstance(name, str) or name not in self.names:
            raise self.error(f"{what} is tensor {json.dumps(name)}, which the file does not hold")
        want = None if self.tensors is None else self.tensors[name]
        a = self._read(name, what)
        if want is not None and (a.shape, a.dtype) != want:
            raise self.error(f"tensor '{name}' ({what}) is {describe(a)}, but the header says "
                             f"{want[1].name}{list(want[0])}")
        return a

    def _open_checked(self):
        """Reads and checks the header (``_open``), closing the file if that fails."""
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _parse_header(self, text, meta):
        """The JSON header (``text``, str or bytes): an object whose format and version agree
        with ``meta`` (the plain metadata entries, if any)."""
        try:
            self.header = json.loads(text)
        except ValueError as e:  # (and UnicodeDecodeError)
            raise self.error(f"its header is not valid JSON ({_first_line(e)})") from None
        if not isinstance(self.header, dict):
            raise self.error(f"its header is {json_kind(self.header)}, expected a JSON object")
        self.format, self.version = self.header.get("format"), self.header.get("version")
        self.fix = _FIX.get(self.format, self.fix) if isinstance(self.format, str) else self.fix
        for k in ("format", "version"):
            if k in meta and meta[k] != str(self.header.get(k)):
                raise self.error(f"its metadata says {k} {meta[k]!r} but its 'jqt' header says "
                                 f"{self.header.get(k)!r}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Reader(_Checked):
    """Opens a safetensors file and checks that it is a jqt file (any kind) whose header
    is a JSON object; arrays read with :meth:`get` are checked against the header."""

    def __init__(self, path, fn):
        st = _safetensors()
        self.path, self.fn = path, fn
        try:
            self._f = st.safe_open(os.fspath(path), framework="np").__enter__()
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own error types, not exported
            raise FormatError(f"{fn}: {path} is not a jqt file, or a damaged one (not a readable "
                              f"safetensors file: {_first_line(e)}). If jqt wrote it, re-save it "
                              "(jqt.save or jqt.save_packed) or restore a good copy.") from None
        self._open_checked()

    def _open(self):
        meta = self._f.metadata() or {}
        keys = list(self._f.keys())
        self.names = set(keys)
        if "jqt" not in meta:
            more = " ..." if len(keys) > 4 else ""
            raise FormatError(f"{self.fn}: {self.path} is a safetensors file but not a jqt file "
                              f"(no 'jqt' header; it holds tensors {keys[:4]}{more}).")
        self.fix = _FIX.get(meta.get("format"), self.fix)
        self._parse_header(meta["jqt"], meta)

    def close(self):
        self._f.__exit__(None, None, None)  # closes the file (the arrays read are copies)

    @functools.cached_property
    def encoded(self):
        """Tensors stored as their bytes (``[dtype name, shape]`` in the header): name ->
        (dtype, shape)."""
        def entry(v, where):
            shape, dtype = self.aval(v[::-1] if isinstance(v, list) else v, where)
            return dtype, shape
        return self._fields("encoded", entry) or {}

    def _read(self, name, what):
        try:
            a = self._f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors' own error types, not exported
            raise self.error(f"tensor '{name}' ({what}) cannot be read "
                             f"({_first_line(e)})") from None
        enc = self.encoded.get(name)
        if enc is None:
            return a
        dtype, shape = enc
        if a.dtype != np.uint8 or a.ndim != 1 or a.size != math.prod(shape) * dtype.itemsize:
            raise self.error(f"tensor '{name}' ({what}) is {describe(a)}, not the bytes of the "
                             f"{dtype.name}{list(shape)} the header says")
        return np.frombuffer(a.tobytes(), dtype).reshape(shape)


class NpzReader(_Checked):
    """Opens a ``.npz`` qparams file (format version 1) and checks its header; arrays read
    with :meth:`get` are checked against it."""

    fix = _FIX[FORMAT]

    def __init__(self, path, fn):
        self.path, self.fn = path, fn
        try:
            self._z = np.load(path)
        except Exception as e:  # noqa: BLE001 - zipfile, zlib and NumPy raise many types
            raise self.error(f"it is not a readable .npz archive ({_first_line(e)})") from None
        self._open_checked()

    def _open(self):
        if "__header__" not in self._z.files:
            raise FormatError(f"{self.fn}: {self.path} is not a jqt qparams file (no header).")
        self.names = set(self._z.files) - {"__header__"}
        self._parse_header(self._read("__header__", "the header").tobytes(), {})

    def close(self):
        self._z.close()

    def _read(self, name, what):
        try:
            return np.asarray(self._z[name])
        except Exception as e:  # noqa: BLE001 - a damaged member: zipfile, zlib, NumPy errors
            raise self.error(f"array '{name}' ({what}) cannot be read ({_first_line(e)})") from None


@contextlib.contextmanager
def reading(r, keep=()):
    """Turns an error the checks did not foresee, raised while ``r``'s file is read, into
    a :class:`FormatError` naming the file (the original is chained); ``keep``: error
    types that pass unchanged (a template or qparams that do not match the file)."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, OverflowError) as e:
        if isinstance(e, (FormatError,) + tuple(keep)):
            raise
        raise r.error(f"reading it failed ({type(e).__name__}: {_first_line(e)})") from e


def version_error(fn, path, fmt, version, want):
    return FormatError(f"{fn}: {path} holds format {fmt!r} version {version!r}; this jqt reads "
                       f"{want}. Upgrade jqt (newer file) or re-save it with this one.")


# ---- qparams ------------------------------------------------------------------------------------

def save(path, qparams) -> None:
    """Saves ``qparams`` (arrays and metadata) to ``path``.

    A path ending in ``.npz`` gets the ``.npz`` format (version 1, readable by every jqt);
    any other path (``.safetensors`` recommended) gets a safetensors file (format
    ``jqt.qparams`` version 3). :func:`jqt.load` reads both. To store the packed weights
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
    """Loads qparams saved by :func:`jqt.save` (``.npz``, version 1, or safetensors,
    versions 2 and 3) or stored with packed weights by :func:`jqt.save_packed`; checks
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
    if is_zip(path):
        return _load_npz(path)
    with Reader(path, "jqt.load") as r, reading(r):
        return _load_qparams(r, path)


def _load_qparams(r, path):
    if r.format == PACKED_FORMAT:
        if r.version not in PACKED_READ:
            raise version_error("jqt.load", path, r.format, r.version, f"versions {PACKED_READ}")
        if r.header.get("qparams") is None:
            raise FormatError(f"jqt.load: {path} holds packed weights without qparams (saved by "
                              "jqt.save_packed without qparams=); read it with jqt.load_packed.")
        return qparams_from_entries(r.header["qparams"], r, "the header's 'qparams'")
    if r.format != FORMAT:
        raise FormatError(f"jqt.load: {path} is not a jqt qparams file (format {r.format!r}).")
    if r.version not in ST_READ:
        raise version_error("jqt.load", path, r.format, r.version,
                             f"versions {NPZ_READ} (.npz) and {ST_READ} (safetensors)")
    return qparams_from_entries(r.need(r.header, "ops", dict, "the header"), r)


def _load_npz(path):
    with NpzReader(path, "jqt.load") as r, reading(r):
        if r.format != FORMAT or r.version not in NPZ_READ:
            raise version_error("jqt.load", path, r.format, r.version,
                                 f"versions {NPZ_READ} (.npz) and {ST_READ} (safetensors)")
        return qparams_from_entries(r.need(r.header, "ops", dict, "the header"), r)
