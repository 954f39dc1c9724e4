"""``jax.export`` support: the aux data of jqt's pytree nodes, as bytes.

``jax.export`` stores the calling convention of an exported function (its input
and output pytree structure) in the serialized artifact, so every custom pytree
node in the arguments must be registered with
``jax.export.register_pytree_node_serialization`` under a stable name. jqt
registers its nodes when it is imported (``qparams.py``, at the end):

=====================  ========================  ==========================================
type                   serialized name           aux data (JSON, versioned)
=====================  ========================  ==========================================
``jqt.QArray``         ``"jqt.QArray"``          the ``QuantType`` and the layout
``jqt.OpQParams``      ``"jqt.OpQParams"``       op, weight operand, ``WeightSource``, note, rotate, accumulator
``jqt.PackedParams``   ``"jqt.PackedParams"``    the original params' tree (JSON, as in
                                                 :func:`jqt.save_packed`), avals (with the
                                                 explicit sharding of a dropped leaf), kept leaves,
                                                 tied lookups (absent in older exports: none)
=====================  ========================  ==========================================

The params tree inside ``PackedParams`` is described with the rules ``jax.export``
itself uses: dicts (str or int keys here), lists, tuples, ``None``, and node types
registered for export serialization.
"""
from __future__ import annotations

import dataclasses
import functools
import json

import jax
import numpy as np

from . import fileio, serialization as ser
from .analysis import path_str
from .qparams import OpQParams, PackedParams, QArray, WeightSource
from .formats import QuantType

AUX_VERSION = 2  # 2: one jqt.QArray node (was QuantParams / PackedWeight); QuantType by dtype


def _value_to_json(v):
    if isinstance(v, QuantType):
        return {"QuantType": ser.qtype_to_json(v)}
    if isinstance(v, WeightSource):  # with the leaf's shape (part of its equality)
        d = ser.source_to_json(v)
        d = d if v.shape is None else {**d, "shape": list(v.shape)}
        return {"WeightSource": d if v.prefixed is None else {**d, "prefixed": v.prefixed}}
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    raise ValueError(f"jqt: cannot serialize static field value {v!r} for jax.export.")


def _value_from_json(d):
    if isinstance(d, dict):
        if "QuantType" in d:
            return ser.qtype_from_json(d["QuantType"])
        if "WeightSource" in d:
            return ser.source_from_json(d["WeightSource"])
    return d


def _static_fields(cls):
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("static")]


def _dump(cls, payload) -> bytes:
    return json.dumps({"type": f"jqt.{cls.__name__}", "v": AUX_VERSION, **payload},
                      sort_keys=True).encode()


def _parse(cls, data) -> dict:
    try:
        d = json.loads(bytes(data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"jqt: the serialized aux data of a jqt.{cls.__name__} node is not "
                         "jqt's JSON (the artifact was made by another program?).") from None
    if d.get("type") != f"jqt.{cls.__name__}" or d.get("v") != AUX_VERSION:
        raise ValueError(
            f"jqt: the exported artifact holds a jqt.{cls.__name__} node serialized as "
            f"{d.get('type')!r} version {d.get('v')!r}; this jqt reads version {AUX_VERSION}. "
            "Deserialize it with the jqt version that exported it, or export again.")
    return d


# JAX's own PRNG implementations: a typed key's dtype by its name ('key<fry>'), which an
# artifact can name (one of a custom implementation it cannot)
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


@functools.lru_cache(maxsize=None)
def _key_dtypes() -> dict:
    return {str(d): d for d in (jax.eval_shape(lambda i=i: jax.random.key(0, impl=i)).dtype
                                for i in _KEY_IMPLS)}


def _aval_to_json(a) -> list:
    """A placeholder's aval: ``[shape, dtype]`` (a typed PRNG key's dtype by its name,
    ``'key<fry>'``), and where ``jqt.pack`` recorded the
    explicit sharding of the leaf it dropped (a weight a ``jax.shard_map`` splits), that
    sharding: its mesh (axis names, sizes, types, device ids) and its spec."""
    out = ([list(a.shape), str(a.dtype)] if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
           else fileio.aval_to_json(a))
    s = getattr(a, "sharding", None)
    if s is not None:
        mesh = s.mesh
        if isinstance(mesh, jax.sharding.AbstractMesh):
            raise ValueError(
                "jqt: packed weights whose recorded leaf sharding is on an AbstractMesh (loaded "
                "by jqt.load_packed with like= a jax.eval_shape template, and no device= on a "
                "concrete Mesh) cannot be serialized: the artifact records the devices. Load "
                "them with device=lambda host: jqt.packed_shardings(qparams, host, mesh)[1], "
                "mesh the concrete jax.sharding.Mesh, or like= the concrete params.")
        out.append({"axes": list(mesh.axis_names), "sizes": [int(n) for n in mesh.devices.shape],
                    "types": [t.name for t in mesh.axis_types],
                    "devices": [int(d.id) for d in mesh.devices.flat],
                    "spec": [list(e) if isinstance(e, tuple) else e for e in s.spec]})
    return out


def _aval_from_json(d) -> jax.ShapeDtypeStruct:
    """Inverse of :func:`_aval_to_json`. A sharding whose devices this process does not
    have is left out: the artifact then takes only params split over those devices."""
    a = (jax.ShapeDtypeStruct(tuple(d[0]), _key_dtypes()[d[1]]) if d[1] in _key_dtypes()
         else ser.aval_from_json(d[:2]))
    if len(d) < 3:
        return a
    m = d[2]
    have = {dev.id: dev for dev in jax.devices()}
    if not all(i in have for i in m["devices"]):
        return a
    devices = np.array([have[i] for i in m["devices"]], dtype=object).reshape(m["sizes"])
    mesh = jax.sharding.Mesh(devices, tuple(m["axes"]),
                             axis_types=tuple(jax.sharding.AxisType[t] for t in m["types"]))
    spec = jax.sharding.PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in m["spec"]])
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(mesh, spec))


def serialize_aux(cls, aux) -> bytes:
    """The aux data of a ``cls`` node (``jax.tree_util`` flatten) as bytes."""
    if cls is PackedParams:
        treedef, avals, kept, tied = aux
        try:
            tree = ser.treedef_to_json(treedef)
        except ser.TreeNotSerializable as e:
            raise ValueError(
                f"jqt: jax.export cannot serialize these jqt.PackedParams: the params they were "
                f"packed from hold {e} ({str(treedef)[:200]}). Register that node type with "
                "jax.export.register_pytree_node_serialization (a NamedTuple with "
                "jax.export.register_namedtuple_serialization), or pack params made of dicts, "
                "lists and tuples.") from None
        keys = [i for i, a in enumerate(avals) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                and str(a.dtype) not in _key_dtypes()]
        if keys:  # a key of a custom PRNG implementation
            paths = jax.tree_util.tree_flatten_with_path(
                jax.tree_util.tree_unflatten(treedef, list(range(len(avals)))))[0]
            raise ValueError(
                f"jqt: jax.export cannot serialize these jqt.PackedParams: params leaf "
                f"'{path_str(paths[keys[0]][0])}' is a typed PRNG key ({avals[keys[0]].dtype}) of "
                "a custom PRNG implementation, whose dtype the artifact cannot name (jqt names "
                f"the keys of JAX's own: {', '.join(_KEY_IMPLS)}). Pass jax.random.key_data(key) in its "
                "place, or leave the key out of the params you pack (e.g. nnx.split the Rngs "
                "state apart).")
        return _dump(cls, {"tree": tree, "avals": [_aval_to_json(a) for a in avals],
                           "kept": list(kept), "tied": [list(t) for t in tied],
                           "weak": [i for i, a in enumerate(avals) if getattr(a, "weak_type", False)]})
    names = _static_fields(cls)
    return _dump(cls, {"fields": {n: _value_to_json(v) for n, v in zip(names, aux)}})


def deserialize_aux(cls, data):
    """Inverse of :func:`serialize_aux`."""
    d = _parse(cls, data)
    if cls is PackedParams:
        avals = tuple(_aval_from_json(a) for a in d["avals"])
        avals = tuple(a.update(weak_type=True) if i in d.get("weak", ()) else a  # (jnp.full(s, 0.1))
                      for i, a in enumerate(avals))
        try:
            treedef = ser.treedef_from_json(d["tree"], avals)
        except ser.TreeNotSerializable as e:
            raise ValueError(f"jqt: cannot rebuild the params tree of a serialized "
                             f"jqt.PackedParams: it holds {e}.") from None
        return (treedef, avals, tuple(d["kept"]),
                tuple(tuple(t) for t in d.get("tied", ())))
    fields = dict(d["fields"])
    names = _static_fields(cls)
    # a field added later with a default (OpQParams.rotate) may be absent from older artifacts
    for f in dataclasses.fields(cls):
        if f.name not in fields and f.metadata.get("static") and f.default is not dataclasses.MISSING:
            fields[f.name] = _value_to_json(f.default)
    missing = [n for n in names if n not in fields]
    if missing or set(fields) - set(names):
        raise ValueError(f"jqt: a serialized jqt.{cls.__name__} has static fields "
                         f"{sorted(fields)}, this jqt expects {names}. Deserialize it with the jqt "
                         "version that exported it, or export again.")
    return tuple(_value_from_json(fields[n]) for n in names)


NODE_TYPES = (QArray, OpQParams, PackedParams)


def _register():
    """Registers jqt's pytree nodes for ``jax.export`` serialization under the stable names
    ``"jqt.QArray"``, ``"jqt.OpQParams"`` and ``"jqt.PackedParams"``, so that a function
    taking them can be exported and deserialized in another process that imports jqt
    (``jqt/__init__.py`` imports this module)."""
    from jax import export as jax_export

    for cls in NODE_TYPES:
        try:
            jax_export.register_pytree_node_serialization(
                cls, serialized_name=f"jqt.{cls.__name__}",
                serialize_auxdata=lambda aux, cls=cls: serialize_aux(cls, aux),
                deserialize_auxdata=lambda data, cls=cls: deserialize_aux(cls, data))
        except ValueError:  # already registered: this module was imported again (reload)
            pass


_register()
