"""``jqt.save`` / ``jqt.load``: qparams to one ``.npz`` file with a JSON header."""
from __future__ import annotations

import dataclasses
import json

import numpy as np

from .qparams import OpQParams, QuantParams, WeightSource
from .recipe import QuantType

FORMAT = "jqt.qparams"
VERSION = 1


def _tuplify(x):
    return tuple(_tuplify(i) for i in x) if isinstance(x, list) else x


def save(path, qparams) -> None:
    """Saves ``qparams`` (arrays and metadata) to ``path`` (an ``.npz`` file).

    >>> import os, tempfile, jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> p = os.path.join(tempfile.mkdtemp(), "qp.npz")
    >>> jqt.save(p, qp)
    >>> jqt.load(p)["w"].rhs.qtype == qp["w"].rhs.qtype
    True
    """
    arrays, entries = {}, {}
    for i, (key, p) in enumerate(qparams.items()):
        ops = []
        for side, q in (("lhs", p.lhs), ("rhs", p.rhs)):
            if q is None:
                ops.append(None)
                continue
            d = {"qtype": dataclasses.asdict(q.qtype)}
            for name in ("scale", "zero_point"):
                a = getattr(q, name)
                if a is not None:
                    arrays[f"{i}.{side}.{name}"] = np.asarray(a)
                    d[name] = f"{i}.{side}.{name}"
            ops.append(d)
        entries[key] = {"lhs": ops[0], "rhs": ops[1], "op": p.op, "weight_operand": p.weight_operand,
                        "note": p.note,
                        "source": None if p.source is None else dataclasses.asdict(p.source)}
    header = json.dumps({"format": FORMAT, "version": VERSION, "ops": entries})
    with open(path, "wb") as fh:
        np.savez(fh, __header__=np.frombuffer(header.encode(), np.uint8), **arrays)


def load(path) -> dict:
    """Loads qparams saved by :func:`jqt.save`; checks the format version."""
    with np.load(path) as z:
        if "__header__" not in z:
            raise ValueError(f"jqt.load: {path} is not a jqt qparams file (no header).")
        header = json.loads(z["__header__"].tobytes().decode())
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ValueError(f"jqt.load: {path} has format {header.get('format')!r} version "
                             f"{header.get('version')!r}; this jqt reads {FORMAT!r} version {VERSION}.")
        out = {}
        for key, e in header["ops"].items():
            ops = []
            for d in (e["lhs"], e["rhs"]):
                if d is None:
                    ops.append(None)
                    continue
                get = lambda n: np.asarray(z[d[n]]) if n in d else None
                ops.append(QuantParams(scale=get("scale"), zero_point=get("zero_point"),
                                       qtype=QuantType(**d["qtype"])))
            src = e["source"]
            if src is not None:
                src = WeightSource(**{k: _tuplify(v) for k, v in src.items()})
            out[key] = OpQParams(lhs=ops[0], rhs=ops[1], op=e["op"], weight_operand=e["weight_operand"],
                                 source=src, note=e["note"])
    return out
