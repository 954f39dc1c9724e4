"""Which 8-bit integer matrices among the weights ``f`` decodes to float.

A model quantized before holds integer codes that ``f`` decodes, ``q.astype(float) * s``
(Keras's ``model.quantize('int4')``, a 4-bit checkpoint unpacked in ``f``); jqt then
quantizes the decoded weight again, which ``jqt.calibrate`` warns of. An integer table
``f`` reads only as indices (a T5-style ``uint8`` table of relative-position buckets
that picks rows of a float table) or as a predicate is no such sign. :func:`decoded`
follows each integer matrix's values through ``f``'s jaxpr, past the operands that only
index or select (a gather's indices, a ``select_n``'s predicate), and names the leaves
that reach a float value (a gather of single elements, a codebook looked up at the
codes, decodes them). Loops and branches are followed into their bodies; a
higher-order primitive it does not know passes its inputs' marks to every output (a
leaf it hides is named: the warning is kept where nothing shows it needless).

>>> import jax, jax.numpy as jnp
>>> f = lambda t, i, e, x: (e[i[t]], t.astype(jnp.float32) * x)
>>> closed = jax.make_jaxpr(f)(jnp.zeros((4, 4), jnp.uint8), jnp.zeros((4, 4), jnp.int32),
...                            jnp.zeros((8, 2)), jnp.ones((4, 4)))
>>> sorted(decoded(closed.jaxpr, {0: "t", 1: "i"}))
['t']
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from . import compat

# operands that index or select only: their values never reach the output's values
_INDEX_ONLY = {"gather": (1,), "dynamic_slice": "rest", "dynamic_update_slice": "rest2",
               "scatter": (1,), "scatter-add": (1,), "scatter-mul": (1,), "scatter-min": (1,),
               "scatter-max": (1,), "select_n": (0,)}
# call-like primitives whose body takes the operands one for one (HIGHER_ORDER's transparent)
_CALLS = {p: name for p, name in ((compat.jit_p, "jaxpr"), (compat.closed_call_p, "call_jaxpr"),
                                  (compat.call_p, "call_jaxpr"), (compat.remat_p, "jaxpr"),
                                  (compat.custom_jvp_call_p, "call_jaxpr"),
                                  (compat.custom_vjp_call_p, "call_jaxpr"))}


def _index_only(eqn) -> set:
    """The operands of ``eqn`` whose values only index or select. Not a gather of single
    elements: a codebook looked up at codes (NF4's ``table[codes] * absmax``, one value
    per code) decodes them, where a lookup of rows (``rel[buckets]``) only indexes."""
    if eqn.primitive.name == "gather" and math.prod(eqn.params["slice_sizes"]) == 1:
        return set()
    spec = _INDEX_ONLY.get(eqn.primitive.name)
    n = len(eqn.invars)
    return (set(range(1, n)) if spec == "rest" else set(range(2, n)) if spec == "rest2"
            else set(spec or ()))


def _jaxpr(j):
    return getattr(j, "jaxpr", j)  # a ClosedJaxpr's, or an open one (shard_map's)


def _walk(jaxpr, marks: list, found: set) -> list:
    """The marks (sets of leaf paths) of ``jaxpr``'s outputs, given its inputs'; adds to
    ``found`` the leaves whose values reach a float value."""
    env = {v: m for v, m in zip(jaxpr.invars, marks) if m}
    get = lambda v: frozenset() if compat.is_literal(v) else env.get(v, frozenset())  # noqa: E731
    for eqn in jaxpr.eqns:
        skip = _index_only(eqn)
        ins = [frozenset() if k in skip else get(v) for k, v in enumerate(eqn.invars)]
        if not any(ins):
            continue
        outs = _outs(eqn, ins, found)
        for v, m in zip(eqn.outvars, outs):
            if m and not compat.is_dropvar(v):
                env[v] = m
                if jnp.issubdtype(v.aval.dtype, jnp.inexact):
                    found |= m
    return [get(v) for v in jaxpr.outvars]


def _loop(body, ins, carry: slice, out_carry: slice, found) -> list:
    """A loop body's outputs, its carries' marks fed back until they stop growing."""
    ins = list(ins)
    while True:
        outs = _walk(body, ins, found)
        grown = [a | b for a, b in zip(ins[carry], outs[out_carry])]
        if grown == ins[carry]:
            return outs
        ins[carry] = grown


def _outs(eqn, ins, found) -> list:
    p, n = eqn.primitive, len(eqn.outvars)
    if p in _CALLS:
        return _walk(_jaxpr(eqn.params[_CALLS[p]]), ins, found)
    if p is compat.scan_p:
        consts, carry = compat.scan_counts(eqn)
        return _loop(_jaxpr(eqn.params["jaxpr"]), ins, slice(consts, consts + carry),
                     slice(0, carry), found)
    if p is compat.while_p:
        c, b = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        body = ins[c:]  # the body's constants, then the carries
        outs = _loop(_jaxpr(eqn.params["body_jaxpr"]), body, slice(b, None), slice(0, None), found)
        return [m | i for m, i in zip(outs, body[b:])]  # (no pass at all: the carries as they came)
    if p is compat.cond_p:
        outs = [_walk(_jaxpr(br), ins[1:], found) for br in eqn.params["branches"]]
        return [frozenset().union(*ms) for ms in zip(*outs)]
    if compat.shard_map_p is not None and p is compat.shard_map_p:
        return _walk(_jaxpr(eqn.params["jaxpr"]), ins, found)
    return [frozenset().union(*ins)] * n  # any other op: every output from every input


def decoded(jaxpr, leaves: dict) -> set:
    """The paths of the 8-bit integer matrices (two or more axes, one byte an element) among
    ``leaves`` (``jaxpr``'s input position -> weight leaf path) whose values ``jaxpr`` turns
    into float values: codes decoded, not indices or predicates."""
    marks = [frozenset()] * len(jaxpr.invars)
    for k, path in leaves.items():
        aval = jaxpr.invars[k].aval
        if jnp.issubdtype(aval.dtype, jnp.integer) and aval.ndim >= 2 and aval.dtype.itemsize <= 1:
            marks[k] = frozenset([path])
    found: set = set()
    if any(marks):
        _walk(jaxpr, marks, found)
    return found
