"""Changes ``f`` makes to its arguments in place, which a trace does not keep.

``jax.make_jaxpr`` (and ``jax.jit``) give ``f`` rebuilt copies of its arguments, so a
value ``f`` writes into one (an nnx module's decode cache, an RNG count, a dict entry)
stays inside the trace unless ``f`` returns it: each call starts again from the values
passed in. :func:`changed_leaves` finds such writes while ``f`` is traced;
:func:`forwarded_input` tells a leaf replaced by the same value back (nnx's ``scan`` and
``remat`` return a layer's state through the loop) from a change.
"""
from __future__ import annotations

import jax

from . import compat, diagnostics, layout
from .analysis import path_str
from .plan import closed_parts

_CALLS = {compat.jit_p: "jaxpr", compat.closed_call_p: "call_jaxpr", compat.call_p: "call_jaxpr",
          compat.remat_p: "jaxpr", compat.custom_jvp_call_p: "call_jaxpr",
          compat.custom_vjp_call_p: "call_jaxpr"}


def changed_leaves(marked, args, before, out):
    """What ``f`` changed in ``args`` (the copies it was given, ``before``: their
    ``tree_flatten_with_path`` when it got them) and did not return in ``out``: a list of
    ``(argument, path or None for its structure, invar index of the old leaf or None,
    leaf index)``. ``marked``: the traced arguments, whose leaves are the jaxpr's inputs."""
    inputs = {id(t): n for n, t in enumerate(jax.tree_util.tree_leaves(marked))}
    returned = {id(x) for x in jax.tree_util.tree_leaves(out)}
    found = []
    for i, (a, (old, _)) in enumerate(zip(args, before)):
        try:
            new = jax.tree_util.tree_flatten_with_path(a)[0]
        except ValueError:  # a value f consumed: an equinox State after state.set(...), which
            continue  # refuses to flatten again (its new state is what f returns)
        if [p for p, _ in new] != [p for p, _ in old]:  # an entry added or removed (a static
            found.append((i, None, None, None))  # attribute changed, model.eval(): no loss)
            continue
        found += [(i, path, inputs.get(id(x)), j) for j, ((path, x), (_, y)) in enumerate(zip(old, new))
                  if y is not x and id(y) not in returned and not _equal_static(x, y)]
    return found


def _equal_static(x, y) -> bool:
    """Two leaves that are no arrays and compare equal (a string set to the same string)."""
    if compat.is_tracer(x) or compat.is_tracer(y) or hasattr(x, "shape") or hasattr(y, "shape"):
        return False
    try:
        return bool(x == y)
    except Exception:
        return False


def forwarded_input(jaxpr, var):
    """The index of the input of ``jaxpr`` that ``var`` is, passed unchanged through calls,
    ``remat``, a loop's carry or a ``scan``'s restacked slices, a ``cond`` whose every
    branch returns it, and transposes that undo one another (layers stacked on axis 1,
    which ``nnx.scan`` moves to the front and back); ``None`` for anything computed.

    >>> j = jax.make_jaxpr(lambda a, b: (jax.lax.scan(lambda c, x: (c, x), a, b), a + 1))(1.0, jax.numpy.ones(3))
    >>> [forwarded_input(j.jaxpr, v) for v in j.jaxpr.outvars]
    [0, 1, None]
    >>> j = jax.make_jaxpr(lambda a: (a.transpose(1, 0, 2).transpose(1, 0, 2), a.transpose(1, 0, 2)))(
    ...     jax.numpy.ones((2, 3, 4)))
    >>> [forwarded_input(j.jaxpr, v) for v in j.jaxpr.outvars]
    [0, None]
    """
    inputs = {v: k for k, v in enumerate(jaxpr.invars)}
    producer = {v: (e, k) for e in jaxpr.eqns for k, v in enumerate(e.outvars)}
    perm = None  # the output is transpose(var, perm); None: the identity
    while not compat.is_literal(var):
        if var in inputs:
            return inputs[var] if perm is None or perm == tuple(range(len(perm))) else None
        if var not in producer:  # a constant
            return None
        eqn, k = producer[var]
        if eqn.primitive is compat.transpose_p:
            p = tuple(eqn.params["permutation"])
            perm = p if perm is None else tuple(p[q] for q in perm)
            var = eqn.invars[0]
            continue
        i = _through(eqn, k)
        if i is None:
            return None
        var = eqn.invars[i]
    return None


def _through(eqn, k):
    """The operand of ``eqn`` its output ``k`` is unchanged, or None."""
    prim, p = eqn.primitive, eqn.params
    if layout.record(eqn) == ("copy",) and len(eqn.invars) == len(eqn.outvars):
        return k  # stop_gradient, optimization_barrier, a sharding constraint, ...
    if prim is compat.shard_map_p:  # nnx.shard_map returns the module's state
        j = closed_parts(p["jaxpr"])[0]
        i = forwarded_input(j, j.outvars[k])
        same = i is not None and p["in_specs"][i] == p["out_specs"][k] \
            and eqn.invars[i].aval.shape == eqn.outvars[k].aval.shape
        return i if same else None
    if prim in _CALLS:
        j = closed_parts(p[_CALLS[prim]])[0]
        return forwarded_input(j, j.outvars[k])
    if prim is compat.scan_p:
        nc, nk = compat.scan_counts(eqn)
        j = closed_parts(p["jaxpr"])[0]
        i = forwarded_input(j, j.outvars[k])  # body operands: consts, carries, slices
        return i if i is not None and (i == nc + k if k < nk else i >= nc + nk) else None
    if prim is compat.while_p:
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        j = closed_parts(p["body_jaxpr"])[0]
        return cn + bn + k if forwarded_input(j, j.outvars[k]) == bn + k else None
    if prim is compat.cond_p:
        picks = {forwarded_input(b.jaxpr, b.jaxpr.outvars[k]) for b in p["branches"]}
        return 1 + picks.pop() if len(picks) == 1 and None not in picks else None
    return None


def lost_changes(found, new_leaves, args):
    """``found`` (:func:`changed_leaves`) less the leaves that ``f`` replaced by the value
    they held, or returned through an identity (``stop_gradient(new)``: another object than
    the one it wrote): ``new_leaves(found)`` traces ``f`` again returning the new leaves,
    then ``f``'s own array outputs."""
    check = [c for c in found if c[1] is not None]
    if not check:
        return found
    try:
        j = jax.make_jaxpr(lambda *a: new_leaves(a, check))(*args).jaxpr
    except Exception:  # a leaf replaced by a value of no JAX type: a change
        return found
    news, outs = j.outvars[:len(check)], j.outvars[len(check):]
    returned = {_root(j, v) for v in outs} - {None}
    same = {c for c, v in zip(check, news)
            if (c[2] is not None and forwarded_input(j, v) == c[2]) or _root(j, v) in returned}
    return [c for c in found if c not in same]


def _root(jaxpr, var):
    """``var`` before the copies that produced it (``stop_gradient``, an optimization
    barrier), or ``None`` for a literal."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    while not compat.is_literal(var) and var in producer:
        eqn = producer[var]
        if layout.record(eqn) != ("copy",) or len(eqn.invars) != len(eqn.outvars):
            return var
        var = eqn.invars[eqn.outvars.index(var)]
    return None if compat.is_literal(var) else var


def warn_lost(fn, names, lost):
    what = []
    for i in dict.fromkeys(c[0] for c in lost):
        paths = [path_str(c[1]) for c in lost if c[0] == i and c[1] is not None]
        shown = ", ".join(f"'{p}'" for p in paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
        what.append(f"'{names[i]}' ({shown})" if paths else
                    f"'{names[i]}' (its structure: an entry added or removed)")
    diagnostics.warn(
        f"{fn}: f changes its argument {' and '.join(what)} in place and does not return the new "
        "values. As under jax.jit, such a change stays inside the trace: each call starts again "
        "from the values passed in (a decode cache that does not advance, a dropout RNG count or "
        "batch statistics that do not update), in calibration too. Return the new state from f "
        "and pass it back in (flax nnx: `return y, nnx.state(model, nnx.Cache)`, then "
        "nnx.update(model, cache)); a returned cache is quantized with kv_cache=.")
