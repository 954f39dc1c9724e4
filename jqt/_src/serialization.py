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

The same JSON codecs serialize jqt's pytree aux data for ``jax.export`` (``export.py``).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from . import compat
from .qparams import OpQParams, QArray, WeightSource
from .formats import QuantType

FORMAT = "jqt.qparams"
VERSION = 1  # the .npz format
NPZ_READ = (1, 2)
# Files whose qparams hold outlier transforms (smooth, rotate) get the next version of
# their format (npz 2, safetensors 4, packed 3), so that a jqt that cannot apply them
# refuses the file instead of dropping them.


def versioned(version, qparams):
    """``version``, plus one when ``qparams`` hold outlier transforms."""
    return version + 1 if qparams and any(p.transformed for p in qparams.values()) else version
ST_VERSION = 3  # the safetensors format of qparams (3: QuantType by dtype and group size)
ST_READ = (2, 3, 4)  # versions this jqt reads (2: integer types only)
PACKED_FORMAT = "jqt.packed"
PACKED_VERSION = 2  # 2: each weight a QArray (codes, sums, scale, zero point, type)
PACKED_READ = (1, 2, 3)

# dtypes safetensors stores natively; anything else is stored as its raw bytes (uint8).
_NATIVE = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "bfloat16", "float32", "float64"}


class FormatError(ValueError):
    """A file is not a jqt file of the expected kind, or has an unsupported version."""


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


def qparams_entries(qparams, name):
    """(JSON entries, arrays): ``name(key, side, field)`` names each array."""
    if not isinstance(qparams, dict) or not all(isinstance(v, OpQParams) for v in qparams.values()):
        raise TypeError(f"jqt.save: expected the qparams dict returned by jqt.calibrate, got a "
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
                    arrays[n] = np.asarray(a)
                    d[field] = n
            ops.append(d)
        entries[key] = {"lhs": ops[0], "rhs": ops[1], "op": p.op,
                        "weight_operand": p.weight_operand, "note": p.note,
                        "source": source_to_json(p.source)}
        if p.smooth is not None:
            n = name(i, key, "op", "smooth")
            arrays[n] = np.asarray(p.smooth)
            entries[key]["smooth"] = n
        if p.rotate:
            entries[key]["rotate"] = True
    return entries, arrays


def qparams_from_entries(entries, get):
    out = {}
    for key, e in entries.items():
        ops = []
        for d in (e["lhs"], e["rhs"]):
            if d is None:
                ops.append(None)
                continue
            ops.append(QArray(scale=get(d["scale"]) if "scale" in d else None,
                                   zero_point=get(d["zero_point"]) if "zero_point" in d else None,
                                   qtype=qtype_from_json(d["qtype"])))
        out[key] = OpQParams(lhs=ops[0], rhs=ops[1], op=e["op"], weight_operand=e["weight_operand"],
                             source=source_from_json(e["source"]), note=e["note"],
                             smooth=get(e["smooth"]) if e.get("smooth") else None,
                             rotate=bool(e.get("rotate", False)))
    return out


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


def write(path, tensors, header, fmt, version):
    st = _safetensors()
    stored, encoded = {}, {}
    for n, a in tensors.items():
        stored[n], enc = _storable(a)
        if enc is not None:
            encoded[n] = [enc, list(np.shape(a))]
    header = dict(header, format=fmt, version=version, encoded=encoded)
    meta = {"format": fmt, "version": str(version), "jqt": json.dumps(header)}
    st.numpy.save_file(stored, os.fspath(path), metadata=meta)


def is_zip(path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


class Reader:
    """Opens a safetensors file and checks that it is a jqt file (any kind)."""

    def __init__(self, path, fn):
        st = _safetensors()
        self.path = path
        try:
            self._f = st.safe_open(os.fspath(path), framework="np").__enter__()
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own error types, not exported
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FormatError(f"{fn}: {path} is not a jqt file (not a safetensors file: "
                              f"{why}).") from None
        meta = self._f.metadata() or {}
        if "jqt" not in meta:
            keys = list(self._f.keys())
            self.__exit__()
            more = " ..." if len(keys) > 4 else ""
            raise FormatError(f"{fn}: {path} is a safetensors file but not a jqt file (no 'jqt' "
                              f"header; it holds tensors {keys[:4]}{more}).")
        self.header = json.loads(meta["jqt"])
        self.format, self.version = self.header.get("format"), self.header.get("version")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.__exit__(None, None, None)  # closes the file (the arrays read are copies)

    def get(self, name):
        a = self._f.get_tensor(name)
        enc = self.header.get("encoded", {}).get(name)
        if enc is not None:
            a = np.frombuffer(a.tobytes(), dtype_from_name(enc[0])).reshape(enc[1])
        return a


def version_error(fn, path, fmt, version, want):
    return FormatError(f"{fn}: {path} holds format {fmt!r} version {version!r}; this jqt reads "
                       f"{want}. Upgrade jqt (newer file) or re-save it with this one.")


# ---- qparams ------------------------------------------------------------------------------------

def save(path, qparams) -> None:
    """Saves ``qparams`` (arrays and metadata) to ``path``.

    A path ending in ``.npz`` gets the ``.npz`` format (version 1, readable by every jqt);
    any other path (``.safetensors`` recommended) gets a safetensors file (format
    ``jqt.qparams`` version 2). :func:`jqt.load` reads both. To store the packed weights
    too (one file to deploy), see :func:`jqt.save_packed`.

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
        header = json.dumps({"format": FORMAT, "version": versioned(VERSION, qparams), "ops": entries})
        with open(path, "wb") as fh:
            np.savez(fh, __header__=np.frombuffer(header.encode(), np.uint8), **arrays)
        return
    entries, arrays = qparams_entries(qparams, _qp_tensor_name)
    write(path, arrays, {"ops": entries}, FORMAT, versioned(ST_VERSION, qparams))


def _qp_tensor_name(i, key, side, field):
    return f"{key}/{side}.{field}"


def load(path) -> dict:
    """Loads qparams saved by :func:`jqt.save` (``.npz``, version 1, or safetensors,
    version 2) or stored with packed weights by :func:`jqt.save_packed`; checks the
    format and version. Arrays are returned as NumPy arrays.

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
    with Reader(path, "jqt.load") as r:
        return _load_qparams(r, path)


def _load_qparams(r, path):
    if r.format == PACKED_FORMAT:
        if r.version not in PACKED_READ:
            raise version_error("jqt.load", path, r.format, r.version, f"versions {PACKED_READ}")
        if r.header.get("qparams") is None:
            raise FormatError(f"jqt.load: {path} holds packed weights without qparams (saved by "
                              "jqt.save_packed without qparams=); read it with jqt.load_packed.")
        return qparams_from_entries(r.header["qparams"], r.get)
    if r.format != FORMAT:
        raise FormatError(f"jqt.load: {path} is not a jqt qparams file (format {r.format!r}).")
    if r.version not in ST_READ:
        raise version_error("jqt.load", path, r.format, r.version,
                             f"versions {NPZ_READ} (.npz) and {ST_READ} (safetensors)")
    return qparams_from_entries(r.header["ops"], r.get)


def _load_npz(path):
    with np.load(path) as z:
        if "__header__" not in z:
            raise FormatError(f"jqt.load: {path} is not a jqt qparams file (no header).")
        header = json.loads(z["__header__"].tobytes().decode())
        if header.get("format") != FORMAT or header.get("version") not in NPZ_READ:
            raise version_error("jqt.load", path, header.get("format"), header.get("version"),
                                 f"versions {NPZ_READ} (.npz) and {ST_READ} (safetensors)")
        return qparams_from_entries(header["ops"], lambda n: np.asarray(z[n]))
