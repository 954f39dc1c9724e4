"""``jqt.quantize`` (the integer or simulated function) and ``jqt.pack``."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import re
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, diagnostics, tracing, validate, weightcheck
from .numerics import ScaleShapeError
from .handlers import Integer, QParamsMismatchError, Simulate, smooth_mismatch
from .layout import apply_chain
from .policy import KernelPolicy, check_policy
from .qparams import OpQParams, PackedParams, calibrated_args, fold_mismatch
from .registry import BY_NAME
from .analysis import path_str
from .tracing import Tracer, normalize_argnums
from .validate import (boxed_leaf, level_leaf, check_alive, check_keys, check_qparams, flags, numbers_as_arrays,
                       quantized_already, refuse_array_likes, refuse_v1, weight_scale_problem)


def _unpack(packed: PackedParams):
    """Full weight pytree for tracing (zeros where a leaf was packed away: under jit
    nothing reads them, since the op takes the packed int8 weight instead)."""
    leaves = [None] * len(packed.avals)
    for i, x in zip(packed.kept, packed.leaves):
        leaves[i] = x
    for i, a in enumerate(packed.avals):
        if leaves[i] is None:  # split over explicit mesh axes as the leaf was (jax.shard_map
            # takes such a leaf only split as its in_specs say)
            leaves[i] = compat.zeros(a.shape, a.dtype, getattr(a, "sharding", None))
            if getattr(a, "weak_type", False):  # a weakly typed weight (jnp.full(s, 0.1)) as
                # f saw it: strong float32 zeros made a bfloat16 model's outputs float32
                leaves[i] = compat.weak_typed(leaves[i])
    return jax.tree_util.tree_unflatten(packed.treedef, leaves)


def _check_packed_covers(traced, qparams, packed, dropped):
    """Every op that reads a leaf jqt.pack dropped must quantize it and get its packed
    int8 weight, and nothing else may read it (otherwise it would read the zeros
    ``_unpack`` puts there)."""
    for a, i in sorted(dropped):
        if "float" in traced.uses(a, i):
            raise QParamsMismatchError(
                f"jqt: the function reads weight '{traced.leaf_paths[a, i]}' as a float value (not only "
                "through the quantized ops that take its packed copy), but jqt.pack dropped it: "
                "the qparams were calibrated on a function that read it only through those ops. "
                "Calibrate this function (jqt.calibrate) and pack with its qparams, or pass the "
                "float params." + quantized_already(traced))
    for s in traced.sites():
        src, p = s.source, qparams.get(s.key)
        if src is None or (src.arg, src.leaf) not in dropped or p is None:
            continue
        fix = ("the qparams differ from those the weights were packed with. Pack again with "
               "these qparams (jqt.pack(qparams, params)) or pass the float params.")
        if s.key not in packed:
            raise QParamsMismatchError(
                f"jqt: op '{s.key}' reads weight '{src.path}', which jqt.pack dropped (its "
                f"quantized copy replaced it), but the packed params hold no weight for this "
                f"op: {fix}")
        if s.weight_operand is None or p.operand(s.weight_operand) is None:
            raise QParamsMismatchError(
                f"jqt: op '{s.key}' reads weight '{src.path}', which jqt.pack dropped: the packed "
                f"params hold it as {packed[s.key].qtype.describe()} codes, but these qparams keep "
                f"the op float (a jqt.fallback to float?): {fix}")


def _check_slots(traced, qparams, given):
    """Raises unless each op whose codes packed params passed as argument ``a`` of f hold
    (``given``: ``a`` -> the :class:`PackedParams`) reads its weight from argument ``a`` in
    this call: codes are found by op key, so an online network's packed params passed in a
    target network's place would run with the target's codes and the online's float
    leaves. By the ops f was traced with (a wrapper may reorder f's arguments)."""
    reads = {s.key: s.source.arg for s in traced.sites() if s.source is not None}
    cal = lambda k: qparams[k].source.arg if k in qparams and qparams[k].source is not None else None
    for a, pp in given.items():
        other = {k: reads[k] for k in pp.weights if k in reads and reads[k] != a}
        if not other:
            continue
        k = min(other)
        here = next((cal(j) for j, r in reads.items() if r == a and cal(j) is not None), None)
        raise QParamsMismatchError(_slot_message(a, cal(k), sorted(other), other[k], here))


def _slot_message(a, b, keys, there, here) -> str:
    """Packed params passed as argument ``a`` of the function called, packed for argument
    ``b`` of the one calibrated (the codes of ops ``keys``), which read argument ``there``
    here; ``here``: the calibrated argument whose ops read argument ``a`` (or ``None``)."""
    return (f"jqt: argument {a} of f is params jqt.pack packed for argument {b} of the function "
            f"calibrated (jqt.pack(qparams, params, argnum={b})): their codes are those of ops "
            f"{keys[:4]}{' ...' if len(keys) > 4 else ''}, which read argument "
            f"{there}'s weights in this call. Packed params run only in the slot they were "
            "packed for (two copies of a network, as online and target, are packed once per "
            f"slot): pass them as argument {there}"
            + (f", or pack the params passed here with jqt.pack(qparams, params, argnum={here})"
               if here is not None else "") + ".")


def _check_slot_named(qparams, packed, a, argnums, names, error):
    """Where tracing f failed: raises (from ``error``) where the packed params passed as
    argument ``a`` hold the codes of ops keyed by another weight parameter's name of f
    (``names``: its parameters'; with several weight arguments keys start with them);
    where the names tell nothing (a wrapper that renames them), adds
    :func:`_check_slot`'s verdict, by the arguments' order, to ``error`` as a note."""
    mine = {k.split("/", 1)[0] for k in packed.weights if "/" in k}
    slots = {names[b]: b for b in argnums if b < len(names)}
    if len(argnums) > 1 and len(mine) == 1 and next(iter(mine)) in slots:
        there = slots[next(iter(mine))]
        if there == a:
            return  # the right place: f's own error stands
        keys = sorted(packed.weights)
        src = lambda k: qparams[k].source if k in qparams else None
        b = next((src(k).arg for k in keys if src(k) is not None), there)
        here = next((q.source.arg for k, q in qparams.items() if q.source is not None
                     and k.split("/", 1)[0] == names[a]), None)
        raise QParamsMismatchError(_slot_message(a, b, keys, there, here)) from error
    try:
        _check_slot(qparams, packed, a, argnums)
    except QParamsMismatchError as slot:
        error.add_note(f"If packed params are in another's place: {slot}")


def _check_slot(qparams, packed, a, argnums):
    """Raises unless the packed weights passed as argument ``a`` of f were packed for it
    (``jqt.pack(..., argnum=a)``), judged before f is traced (where f fails on the float
    leaves of another slot): by the order of the weight arguments, which a wrapper keeps
    or not (:func:`_check_slots` judges by the ops f reads)."""
    calibrated = calibrated_args(qparams)
    if len(calibrated) != len(argnums) or len(argnums) < 2:
        return  # one weight argument (moved by a wrapper or not): nothing to mix up
    slot = dict(zip(sorted(argnums), calibrated))  # a wrapper may move them, in order
    here = slot[a]
    other = {k: qparams[k].source.arg for k in packed.weights if k in qparams
             and qparams[k].source is not None and qparams[k].source.arg != here}
    if other:
        b = min(other.values())
        there = {v: k for k, v in slot.items()}[b]
        raise QParamsMismatchError(
            f"jqt: argument {a} of f is params jqt.pack packed for argument {b} of the function "
            f"calibrated (jqt.pack(qparams, params, argnum={b})): their codes are those of ops "
            f"{sorted(other)[:4]}{' ...' if len(other) > 4 else ''}, which read that argument's "
            "weights. Packed params run only in the slot they were packed for (two copies of a "
            "network, as online and target, are packed once per slot): pass them as argument "
            f"{there}, or pack the params passed here with jqt.pack(qparams, params, "
            f"argnum={here}).")


def _other_arg(qparams, argnum, index, shapes=None) -> str:
    """The hint for a weight params do not hold: the other weight argument of f (from
    ``weight_argnums``) whose weights params do hold, to pack with ``argnum=``; or, for
    the tuple of weight arguments ``calibrate`` took, the one position of it that holds
    argument ``argnum``'s weights (by path and, where ``shapes`` maps paths to them, shape)."""
    srcs = [p.source for p in qparams.values() if p.weight_operand is not None
            and p.source is not None and p.operand(p.weight_operand) is not None]
    bare = list(index) == [""]  # params that are one array: its path is its argument's name
    at = lambda j, s: f"{j}/{s.path.split('/', 1)[1]}" if "/" in s.path else str(j)
    fits = lambda j, s: at(j, s) in index and (shapes is None or s.shape is None
                                               or tuple(shapes[at(j, s)]) == tuple(s.shape))
    places = {a: [j for j in range(len(index)) if all(fits(j, s) for s in srcs if s.arg == a)]
              for a in {s.arg for s in srcs}}
    tops = {k.split("/", 1)[0] for k in index}  # a tuple's positions: '0', '1', ...
    # (not a single weight argument that is itself a list: its paths start with a digit)
    several = len(places) > 1 or (len(tops) > 1 and all(t.isdigit() for t in tops)
                                  and not any(s.path.split("/", 1)[0].isdigit() for s in srcs))
    if several and all(places.values()) and len(places.get(argnum, ())) == 1:
        j = places[argnum][0]  # the tuple calibrate took: each argument's weights at a place
        others = ("and so on for the others" if len(places) > 1 else "and pass the other "
                  "arguments to f as they are (no quantized op reads their weights)")
        return (f" These params hold the weights of several arguments of f, argument {argnum}'s at "
                f"params[{j}]: jqt.pack takes one weight argument at a time. Pack each: "
                f"jqt.pack(qparams, params[{j}], argnum={argnum}), {others}.")
    for arg in sorted({s.arg for s in srcs} - {argnum}):
        if all(index.get(s.path) or index.get(s.path.split("/", 1)[-1]) or (bare and "/" not in s.path)
               for s in srcs if s.arg == arg):
            return (f" These params hold the weights of argument {arg} of f (the qparams were "
                    f"calibrated with several weight_argnums): pack them with "
                    f"jqt.pack(qparams, params, argnum={arg}).")
    return ""


def _some_empty(args, argnums) -> bool:
    """Whether an array among the inputs (the arguments that do not hold weights) has no
    elements: ``table[ids]`` with no ids traces to zeros of the output's shape, without
    the gather whose qparams are then unused."""
    return any(getattr(leaf, "size", 1) == 0 for i, a in enumerate(args) if i not in argnums
               for leaf in jax.tree_util.tree_leaves(a))


def _static_inputs(args, argnums) -> list:
    """The non-array values among the inputs (the arguments that do not hold weights), which
    reach ``f`` as constants (``tracing.is_static``), as reprs."""
    leaves = [leaf for i, a in enumerate(args) if i not in argnums
              for leaf in jax.tree_util.tree_leaves(a, is_leaf=lambda x: isinstance(x, tracing.Static))]
    return [repr(leaf.value if isinstance(leaf, tracing.Static) else leaf) for leaf in leaves
            if isinstance(leaf, tracing.Static) or tracing.is_static(leaf)]


def _check_folded(packed, folds):
    """Each packed weight holds the outlier transforms (smoothing vector, rotation) its
    op's qparams apply to the activation (``folds``: key -> ``OpQParams.fold_tag``):
    codes smoothed or rotated for other qparams would give wrong results silently."""
    for k, pw in packed.items():
        why = None if pw is None or k not in folds else fold_mismatch(pw.folded, folds[k])
        if why:
            raise QParamsMismatchError(
                f"jqt: the packed weight for '{k}' does not fit qparams['{k}']: {why}. The weights "
                "were packed with other qparams (another recipe, or before smooth/awq/rotate "
                "changed); re-run jqt.pack(qparams, params) with these qparams. Restored by a "
                "checkpointer (orbax), the packed weights take this record from the template: "
                "build it with jqt.pack from the qparams of the same calibration, or store both "
                "with jqt.save_packed(path, packed, qparams).")


_CHECKED_PER_KEY = 16  # packed weights remembered as checked, per op key and argument


class _Checked(dict):
    """``(argnum, key)`` -> ``{id: weak reference}`` of the packed weights whose numbers
    were checked; pickled empty (a weak reference does not pickle, and a copy checks anew)."""

    def __reduce__(self):
        return (_Checked, ())


def _check_packed(qparams, args, argnums, checked):
    """The packed weights' own numbers, where they are concrete (an eager call): the
    scales, zero points and smoothing vectors they run with (a ``tree_map`` that cast
    them to float16 can turn a small scale into 0), checked as ``qparams``' are; and
    :func:`_complete`'s check of a version-1 file's codes against the qparams' grid.
    ``checked`` (the quantized function's own) maps ``(argnum, key)`` to weak references
    to the packed weights checked, by id: a decode loop's calls check each weight once,
    and so do calls that alternate between packed params (two adapters, an A/B pair)."""
    for a in argnums:
        if a < len(args) and isinstance(args[a], PackedParams):
            for k, held in args[a].weights.items():
                refs = checked.setdefault((a, k), {})
                seen = refs.get(id(held))
                if held is None or (seen is not None and seen() is held):
                    continue
                w = args[a].weight(k)
                found = validate.operand_problems(w, "packed weight")
                if found:
                    raise ValueError(
                        f"jqt.quantize: argument {a} (jqt.PackedParams): "
                        f"{validate.describe(k, found)}. The packed weights run with their own "
                        "scales: re-run jqt.pack(qparams, params), or undo the change (a cast "
                        "to float16 can round a small scale to 0: keep the scales float32).")
                if k in qparams:
                    _complete(k, w, qparams[k])
                if len(refs) >= _CHECKED_PER_KEY:  # (weights since freed, most of them)
                    refs.clear()
                refs[id(held)] = weakref.ref(held)


def _with_packed(key, p, pw):
    """An op's state: its qparams ``p`` and packed weight ``pw``; the activation divided by
    the smoothing vector the codes were multiplied by (as the codes run with their own
    scales), on the integer and the simulated path alike: with packed weights the vector
    is fixed, as the weight scales are (its gradient is zero; trained, the simulated path
    ran a gain the integer path did not). Where the qparams were known when ``f`` was
    traced, their vector's digest was compared with the one the packed weight records
    (``_check_folded``); passed to ``jax.jit`` as an argument they are not, and the op
    still gives its packed weight's results. With float weights the simulated path
    divides by the qparams' vector, which it differentiates."""
    pw = _complete(key, pw, p)
    if pw is not None and pw.smooth is not None and p.smooth is not None:
        p = dataclasses.replace(p, smooth=pw.smooth)
    return p, pw


def _complete(key, pw, p):
    """A packed weight read from a version-1 file holds codes and sums only: its scale,
    zero point and type are the qparams', whose grid its codes must fit."""
    if pw is None or pw.scale is not None or p.weight_operand is None:
        return pw
    q = p.operand(p.weight_operand)
    if q is None:
        return pw
    refuse_v1("jqt", key, pw.values, q.qtype)
    return dataclasses.replace(pw, scale=q.scale, zero_point=q.zero_point, qtype=q.qtype)


def quantize(f, qparams, *, simulate: bool = False, weight_argnums=0, policy=None):
    """Returns ``f`` running with quantized ops: ``f``'s positional signature, the same
    outputs' structure. A keyword argument naming a positional parameter of ``f`` is put
    in its place (so ``jax.jit(qf, static_argnames=...)`` works; a ``functools.wraps``
    wrapper's own parameters, the wrapped function's where it passes ``*args`` on);
    keyword-only arguments
    (``train=False`` through ``**kwargs``) are refused, naming them: bind them with
    ``functools.partial`` before calibrating, as the batches are positional.

    Args:
      f: the function that was calibrated.
      qparams: from :func:`jqt.calibrate` (or :func:`jqt.load`).
      simulate: ``False`` (default) runs integer kernels (int8 x int8 -> int32);
        ``True`` runs the float simulation of the same numerics, which is
        differentiable with respect to the weights and to ``qparams``.
      weight_argnums: position(s) of the weight argument(s), as in calibrate.
      policy: a :class:`jqt.KernelPolicy` choosing how integer kernels are
        formulated; by default the table's entry for the backend in use when
        the function is traced (results agree up to float rounding).

    The weight argument may be the float weights or :func:`jqt.pack`'s
    :class:`jqt.PackedParams`. Packed weights run with the scales they were packed with,
    so on the simulated path the weights' halves of ``qparams`` (scales, zero points, the
    weight side of a smoothing vector) get zero gradients: differentiate with the float
    weights.

    Called eagerly (concrete arguments and ``qparams``), the returned function runs
    as one XLA program, compiled once per argument shapes and static values, with
    ``qparams`` passed as arguments rather than baked in as constants. The compiled
    program belongs to the returned function: a loop that calls ``jqt.quantize`` anew
    each step (an evaluation during fine-tuning) compiles each step, as ``jax.jit`` of a
    new lambda each step would; there, jit a function that takes the qparams as an argument,
    ``jax.jit(lambda qp, p, x: jqt.quantize(f, qp)(p, x))``, once. Under
    ``jax.jit``, ``vmap``, ``grad`` or ``jax.export`` it is traced into the
    enclosing computation (and ``jax.disable_jit()`` runs it op by op).

    ``qparams`` are captured when ``quantize`` is called: to differentiate with
    respect to them, call ``quantize`` inside the differentiated function,
    ``jax.grad(lambda qp: loss(jqt.quantize(f, qp, simulate=True)(params, x)))``.

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda w, x: x @ w
    >>> w, x = jnp.eye(3), jnp.arange(6.).reshape(2, 3)
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x,)], progress=False)
    >>> jnp.abs(jax.jit(jqt.quantize(f, qp))(w, x) - f(w, x)).max() < 0.02
    Array(True, dtype=bool)

    ``qparams`` holding invalid numbers (a scale that is 0, negative, NaN or infinite;
    a zero point outside its type's range; a smoothing factor that is not finite and
    positive) raise ``ValueError`` naming the op and the field (not checked when they
    are tracers, under ``jax.grad`` or ``jax.jit``); so do a :class:`jqt.PackedParams`'
    own scales, zero points and smoothing vectors, which its weights run with, at the
    first eager call that passes each packed weight.
    """
    check_qparams(qparams, "jqt.quantize")
    flags("jqt.quantize", simulate=simulate)
    check_policy(policy, "jqt.quantize")
    qparams = numbers_as_arrays(qparams)
    argnums = normalize_argnums(weight_argnums)
    tracer = Tracer(f, argnums, "jqt.quantize")
    handler = Simulate() if simulate else Integer(policy)
    folds = {k: p.fold_tag for k, p in qparams.items()}  # digests of the concrete vectors

    def run(qparams, args):
        args = list(args)
        packed, dropped, given = {}, set(), {}
        for a in argnums:
            if a < len(args) and isinstance(args[a], PackedParams):
                given[a] = args[a]
                packed.update({k: args[a].weight(k) for k in args[a].weights})
                dropped |= {(a, i) for i in range(len(args[a].avals)) if i not in args[a].kept}
                args[a] = _unpack(args[a])
        try:
            traced = _trace(tracer, args, argnums, qparams)
        except Exception as e:
            for a, pp in given.items():  # f failed on float leaves of another slot's shapes?
                _check_slot_named(qparams, pp, a, argnums, tracer.arg_names(len(args)), e)
            if not (isinstance(e, ValueError) and dropped
                    and "does not match the specs of the input" in str(e)):
                raise
            raise ValueError(
                f"{e}\njqt: if the input named is one of the weights jqt.pack dropped (not an "
                "argument of yours such as an activation, which a shard_map takes only as its "
                "in_specs say, with or without jqt), f was traced with zeros in place of them, "
                "split over explicit mesh axes as the params it packed were (or as like= says, "
                "for jqt.load_packed); a jax.shard_map of f takes them only split as its "
                "in_specs say. Pack the params as f takes them, or load the packed file with "
                "jqt.load_packed(path, like=params) where params are so split. A float leaf "
                "jqt.pack kept (a bias) is passed as it is placed: load_packed(like=) puts it "
                "split as like= is on a concrete Mesh; from a jax.eval_shape template (an "
                "AbstractMesh), pass device=lambda host: jqt.packed_shardings(qparams, host, "
                "mesh)[1], which splits it as recorded.") from e
        _check_slots(traced, qparams, given)
        empty = _some_empty(args, argnums)
        _check_folded(packed, folds)
        try:
            if dropped:
                _check_packed_covers(traced, qparams, packed, dropped)
            if not traced.keys_checked:  # (each trace belongs to this function's tracer)
                check_keys(traced, qparams, "jqt", empty)
                traced.keys_checked = True
                own = set(traced.closed.jaxpr.invars)  # (f's own arguments donated, not a
                # value f computes, which its program frees anyway)
                if not donating and any(d and not compat.is_literal(v) and v in own
                                        for e in traced.closed.jaxpr.eqns
                                        for v, d in zip(e.invars, e.params.get("donated_invars", ()))):
                    donating.append(True)  # f is a jax.jit that donates (see qf)
        except QParamsMismatchError as e:
            notes, statics = [], _static_inputs(args, argnums)
            if statics:
                notes.append(f"This call passes Python values ({', '.join(statics[:4])}), which "
                             "reach f as constants, as in a direct call: table[i] with a Python "
                             "int i is a slice, not a lookup, and a flag can change the ops f "
                             "runs. Pass the values calibration passed, or an array "
                             "(jnp.int32(i)) for a value f should trace.")
            if empty and any(getattr(q, "op", None) == "gather" for q in qparams.values()):
                # the likely cause, said first (the check's own guess comes after)
                raise QParamsMismatchError(" ".join([
                    "jqt: an input here has no elements: JAX traces a gather of no ids "
                    "(table[ids]) to zeros, without the gather, and where the table is also "
                    "read by a matmul (tied embeddings) that op takes the gather's key. Skip "
                    f"the call for an empty input. What the check found: {e}", *notes])) from None
            if not notes:
                raise
            raise QParamsMismatchError(f"{e} {' '.join(notes)}") from None
        keys = [s.key for s in traced.sites()]
        state = {k: _with_packed(k, qparams[k], packed.get(k))
                 for k in keys if k in qparams}
        gone = {s.key for s in traced.sites()
                if s.source is not None and (s.source.arg, s.source.leaf) in dropped}
        with diagnostics.grouped():
            outs = traced.run(args, handler, state, gone)[0]
        return jax.tree_util.tree_unflatten(traced.out_tree, outs)  # (non-array leaves marked)

    def eager(qparams, args):
        return run(qparams, tracing.unmark(args))

    # an eager call's program carries f's name (jax.log_compiles, the compilation cache)
    eager.__name__ = eager.__qualname__ = str(getattr(f, "__name__", "f"))
    jitted = jax.jit(eager)
    qparams_concrete = _concrete(qparams)  # tracers when quantize is called under grad

    read = []  # f's signature, read once, for calls with keywords (a plain list: the
    # quantized function pickles, cloudpickle, as jax.jit's does)
    donating = []  # f is a jax.jit with donate_argnums: an eager call keeps no donation
    said = []  # (and the warning that says so given once)
    checked = _Checked()  # the packed weights an eager call checked (_check_packed)

    def signature():
        if not read:
            try:
                read.append(tracing.call_signature(f))
            except (TypeError, ValueError):  # a builtin or a callable without one
                read.append(None)
        return read[0]

    @functools.wraps(f)
    def qf(*args, **kwargs):
        if kwargs:
            args = _positional(f, signature(), args, kwargs)
        if qparams_concrete and _concrete(args):  # called eagerly: one program, not op by op
            tracing.check_traceable(args)
            _check_packed(qparams, args, argnums, checked)  # (inside the program they are traced)
            try:
                out = tracing.unmark(jitted(qparams, tracing.mark_static(list(args))))
                if donating and not said:
                    said.append(True)
                    diagnostics.warn(
                        f"jqt.quantize: {getattr(f, '__name__', 'f')} runs a jax.jit that donates "
                        "arguments (donate_argnums), but the quantized function runs it inside a "
                        "program of its own, where a donation does nothing (as in a jax.jit "
                        "nested in another): the donated arrays (a cache) are kept, a second "
                        "copy. Jit the quantized function with the donation instead: "
                        "jax.jit(jqt.quantize(f, qparams), donate_argnums=...).")
                return out
            except (RuntimeError, ValueError) as e:  # a donated array: say which (a compiled
                # program given one reports it from XLA's Execute, a ValueError)
                if "deleted" in str(e) or "donated" in str(e):
                    check_alive(qparams, "jqt.quantize", "qparams")
                    check_alive(list(args), f"{getattr(f, '__name__', 'f')} (quantized)",
                                "argument")
                raise
        if qparams_concrete:  # closed over by jax.jit: constants, which a donation can delete
            check_alive(qparams, "jqt.quantize", "qparams")
        check_alive(list(args), f"{getattr(f, '__name__', 'f')} (quantized)", "argument")  # the same
        return tracing.unmark(run(qparams, args))  # under a transformation: traced inline

    return qf


def _trace(tracer, args, argnums, qparams=None):
    """``tracer(args)``; where ``f`` fails on its arguments and a weight argument holds
    qparams (``qf(qparams, x)``), or another argument packed params of ``qparams``' ops
    (``weight_argnums`` not passed on), says so."""
    try:
        return tracer(args)
    except Exception as e:
        is_qp = lambda v: isinstance(v, OpQParams)
        given = [a for a in argnums if a < len(args) and any(
            is_qp(v) for v in jax.tree_util.tree_leaves(args[a], is_leaf=is_qp))]
        want = calibrated_args(qparams or {})  # where the qparams' ops read weights: packed
        packed = [a for a in range(len(args)) if a not in argnums and a in want  # params elsewhere
                  and isinstance(args[a], PackedParams)]  # are f's data (it calls a quantized g)
        if packed and not given:
            raise TypeError(
                f"{type(e).__name__}: {e}\njqt: argument{'s' if len(packed) > 1 else ''} "
                f"{', '.join(map(str, packed))} of the quantized function "
                f"{'are' if len(packed) > 1 else 'is a'} jqt.PackedParams, but the quantized "
                f"function takes weights from argument(s) {list(argnums)} and hands the others to "
                "f as they are: pass jqt.quantize the weight_argnums jqt.calibrate was given, "
                f"which name argument{'s' if len(want) > 1 else ''} "
                f"{', '.join(map(str, want))} (the qparams' ops read weights there).") from e
        # qf(x, packed) for f(p, x): packed params of these qparams' ops where no weight
        # argument has their structure (not packed params f hands to a quantized g of its own)
        shaped = {jax.tree_util.tree_structure(args[a]) for a in argnums if a < len(args)}
        astray = [a for a in range(len(args)) if a not in argnums and a not in want
                  and isinstance(args[a], PackedParams) and args[a].treedef not in shaped
                  and set(args[a].weights) <= set(qparams or {})]
        if astray and not given:
            raise TypeError(
                f"{type(e).__name__}: {e}\njqt: argument {astray[0]} of the quantized function "
                f"is a jqt.PackedParams, but the quantized function takes weights from "
                f"argument(s) {list(argnums)} and hands argument {astray[0]} to f as it is: are "
                "the arguments swapped? Pass the packed params where f takes its weights.") from e
        if not given:
            raise
        raise TypeError(
            f"{type(e).__name__}: {e}\njqt: argument {given[0]} of the quantized function "
            "holds jqt.OpQParams where f takes its weights: are the arguments swapped? Call "
            "jqt.quantize(f, qparams)(params, ...) with the params (or jqt.pack(qparams, "
            "params)).") from e


def _positional(f, sig, args, kwargs) -> tuple:
    """``args`` with the keyword arguments that name positional parameters of ``f`` put in
    their places (a skipped parameter's default before them), as calibration's positional
    batches trace ``f``; keyword-only ones (``**kwargs``, flax's ``apply(..., train=False)``) are
    refused, naming them. ``sig``: ``f``'s signature, or ``None``."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = sig.parameters if sig is not None else {}
    var_keyword = any(q.kind == q.VAR_KEYWORD for q in params.values())
    keyword = sorted(k for k in kwargs if sig is None or (params[k].kind not in positional
                                                          if k in params else var_keyword))
    name = getattr(f, "__name__", type(f).__name__)
    if keyword:
        raise TypeError(f"jqt: {name} (quantized) takes its positional parameters, as "
                        f"calibration traced it; keyword-only arguments ({keyword}) reach f "
                        "only through functools.partial: calibrate and quantize "
                        "functools.partial(f, name=value), one per value.")
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"jqt: {name} (quantized): {e}") from None
    # up to the last parameter given, as a positional call would pass them: a default only
    # fills a gap before a later parameter given by keyword
    names = [n for n, q in params.items() if q.kind in positional]
    last = max(names.index(n) for n in bound.arguments if n in names)
    out = [bound.arguments[n] if n in bound.arguments else params[n].default
           for n in names[:last + 1]]
    star = next((n for n, q in params.items() if q.kind == q.VAR_POSITIONAL), None)
    return tuple(out) + tuple(bound.arguments.get(star, ()))


def _own_scales(pw, p, **changes):
    """The packed weight ``pw`` with ``changes``, holding copies of the scale, zero point
    and smoothing vector it shares with its qparams ``p``: donating packed weights to a
    jitted call (``donate_argnums``) must not delete the qparams' arrays. An integer grid's
    zero point is stored rounded, as the codes were made with it: ``jqt.qat`` trains zero
    points as floats, and a packed weight decodes as ``(values - zero_point) * scale``."""
    pw = dataclasses.replace(pw, **changes)
    if pw.zero_point is not None and pw.qtype.symmetric:  # zeros (validated): a symmetric
        pw = dataclasses.replace(pw, zero_point=None)  # packed weight holds none (its check)
    q = p.operand(p.weight_operand)
    shared = (p.smooth,) + (() if q is None else (q.scale, q.zero_point))
    if pw.zero_point is not None and pw.qtype.grid == "int":  # a new array: not shared
        pw = dataclasses.replace(pw, zero_point=jnp.round(pw.zero_point))
    changes = {}
    for name in ("scale", "zero_point", "smooth"):
        a = getattr(pw, name)
        if a is not None and any(a is b for b in shared) and not compat.is_tracer(a):
            changes[name] = jnp.array(a, copy=True)
    return dataclasses.replace(pw, **changes)


def _refuse_nans(nans):
    """Raises ``ValueError`` for the first weight of ``nans`` (``(key, path, count)``, the
    counts device scalars, read in one transfer) that holds NaN: an int or NF4 code has
    no NaN, so the element would be packed as a finite number and the NaN lost, where
    the float model gives NaN (``calibrate`` refuses such a weight too)."""
    nans = [n for n in nans if not compat.is_tracer(n[2])]  # pack traced (jax.eval_shape of it
    # with the params closed over computes the counts in the trace too): nothing to read
    if not nans:
        return
    counts = jax.device_get([c for _, _, c in nans])
    bad = [(k, path, int(c)) for (k, path, _), c in zip(nans, counts) if c]
    if bad:
        key, path, n = bad[0]
        raise ValueError(
            f"jqt.pack: op '{key}': weight '{path}' holds {n} NaN value{'s' * (n > 1)}, which its "
            "integer codes cannot hold (they would be packed as finite numbers). Fix the weights "
            "(they are not those the qparams were calibrated with, which jqt.calibrate checks), "
            "or keep the op float (a jqt.Rule with weight=None)."
            + (f" Ops {[b[0] for b in bad[1:6]]} hold NaN too." if len(bad) > 1 else ""))


def _concrete(tree) -> bool:
    """No leaf of ``tree`` is a tracer (nothing is being transformed)."""
    return not any(compat.is_tracer(x) for x in jax.tree_util.tree_leaves(tree))


def _pack_arguments(qparams, params, argnum, weight_argnums, **kw):
    """:func:`pack` of several weight arguments, ``params`` a tuple of them as
    :func:`jqt.calibrate` takes them (one pytree where ``weight_argnums`` names one)."""
    if argnum != 0:
        raise TypeError(f"jqt.pack: argnum={argnum!r} and weight_argnums={weight_argnums!r}: "
                        "pass one of them (argnum= for one argument's params, weight_argnums= "
                        "for a tuple of several, as jqt.calibrate takes them).")
    nums = tracing.normalize_argnums(weight_argnums)
    if len(nums) == 1:
        return pack(qparams, params, argnum=nums[0], **kw)
    if not isinstance(params, (tuple, list)) or len(params) != len(nums):
        got = (f"a {type(params).__name__} of {len(params)}" if isinstance(params, (tuple, list))
               else f"a {type(params).__name__}")
        raise TypeError(f"jqt.pack: weight_argnums={weight_argnums!r} names {len(nums)} weight "
                        f"arguments, and params is {got}: pass a tuple of their weights, in that "
                        "order, as jqt.calibrate takes them.")
    read = {p.source.arg for p in qparams.values()
            if isinstance(p, OpQParams) and p.source is not None and not p.is_float}
    if read - set(nums):  # (each argument packed alone would warn, naming one packed here)
        raise QParamsMismatchError(
            f"jqt.pack: weight_argnums={weight_argnums!r}, but the qparams' quantized ops read "
            f"the weights of argument(s) {sorted(read)} of f (the weight_argnums jqt.calibrate "
            f"took), {sorted(read - set(nums))} not among them: pass the weight_argnums "
            "calibrate took, with params the tuple of those arguments' weights in that order.")
    # an argument without quantized ops (norm gains) packed beside those that hold them: no
    # advice to pass another argnum (held back in this thread: warnings.catch_warnings swaps
    # process-wide filters, which two threads' overlapping windows left ignoring it for good)
    quiet = bool(read) and read <= set(nums)
    failing = True
    try:
        with diagnostics.captured() as said:
            out = tuple(pack(qparams, p, argnum=a, **kw) for p, a in zip(params, nums))
        failing = False
        return out
    finally:  # (also those of the arguments packed before one that raised)
        diagnostics.warn_held([(m, c) for m, c in said if not (
            quiet and re.match(r"jqt\.pack\(argnum=\d+\): no quantized op reads", m))], failing)


def _placements(*trees) -> set:
    """The device sets of the committed arrays in ``trees``, each as text."""
    return {str(sorted(d.id for d in a.devices())) for a in jax.tree_util.tree_leaves(trees)
            if isinstance(a, jax.Array) and not compat.is_tracer(a) and a.committed}


def pack(qparams, params, *, argnum: int = 0, policy=None, clip: bool = False,
         weight_argnums=None):
    """Stores the quantized weights as integer (or fp8) codes, once, for :func:`jqt.quantize`.

    Returns a :class:`jqt.PackedParams` to pass in place of ``params``: each quantized
    weight becomes a :class:`jqt.QArray` of codes (int8, two int4/nf4 codes per
    byte, or fp8) in the layout its kernel reads. Leaves read only by quantized
    ops are dropped (the quantized copy replaces them);
    leaves used as floats elsewhere (biases, norms, float ops) are kept.

    ``argnum`` (default 0) is the position of ``params`` among ``f``'s arguments, as
    in ``weight_argnums``: with several weight arguments, pack each on its own,
    ``jqt.pack(qp, enc, argnum=0)``, ``jqt.pack(qp, head, argnum=1)``, or all at once
    as :func:`jqt.calibrate` takes them, ``params`` a tuple of them and
    ``weight_argnums`` their positions: ``jqt.pack(qp, (enc, head), weight_argnums=(0,
    1))`` returns a tuple of :class:`jqt.PackedParams`, one per argument.

    ``policy`` (a :class:`jqt.KernelPolicy`, default: the default backend's) picks
    the layout of each dense weight (``KernelPolicy.dense_layout``); a function
    run under another policy converts the layout when it is traced.

    The weights are quantized with the scales in ``qparams``, which were computed from
    the weights :func:`jqt.calibrate` saw: an element beyond the grid's end would be
    clipped to it. So ``pack`` compares the weights with those: a weight that reaches
    further past its grid's end than the calibrated one did (by more than 1%; the
    calibrated weight reached at most the end, or further where the weight calibrator
    clips on purpose, e.g. ``WeightMSE``) raises :class:`jqt.QParamsMismatchError`
    naming the op, the element and the grid's end: params other than the calibrated
    ones (another checkpoint, weights trained further or rescaled). So does a weight that
    reaches less than a quarter as far as the calibrated one (or as the grid's edge, where
    the calibrator clipped it on purpose) and is not all zeros (two bits of every code
    lost: a unit mix-up, another checkpoint). Re-calibrate with them, or pass
    ``clip=True`` to pack them as they are (clipped). Not checked (packed as given):
    qparams whose scales, zero points or smoothing changed since calibration or that
    went through :func:`jqt.qat.project` (fine-tuned: the simulated path clipped the
    weights as ``pack`` does), qparams without the record (read from files written
    before jqt made it, built by hand; ``WeightSource.calibrated_reach``), and values
    that are tracers (``pack`` under ``jax.jit``). The check is one maximum over each
    weight. A weight holding NaN raises ``ValueError`` under int and NF4 formats, with
    ``clip=True`` too: their codes cannot hold NaN (fp8 codes keep it).

    >>> import jax, jax.numpy as jnp, jqt
    >>> f = lambda p, x: x @ p["w"] + p["b"]
    >>> p = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), p, [(jnp.ones((2, 64)),)], progress=False)
    >>> packed = jqt.pack(qp, p)
    >>> packed.weights["w"].values.dtype
    dtype('int8')
    >>> bool(jnp.allclose(jqt.quantize(f, qp)(packed, jnp.ones((2, 64))),
    ...                   jqt.quantize(f, qp)(p, jnp.ones((2, 64)))))
    True

    Weights that outgrew the calibrated ones are refused; ``clip=True`` clips them:

    >>> p2 = {"w": 2 * p["w"], "b": p["b"]}
    >>> try:
    ...     jqt.pack(qp, p2)
    ... except jqt.QParamsMismatchError as e:
    ...     print(str(e).split(". ")[0])
    jqt.pack: op 'w': weight 'w' does not fit the grid its qparams were calibrated for (int8 sym per-channel): an element of 2 lies 2x as far out as its scale's end of the grid, 1, and would be clipped to it
    >>> int(jqt.pack(qp, p2, clip=True).weights["w"].values.max())
    127
    """
    if weight_argnums is not None:
        return _pack_arguments(qparams, params, argnum, weight_argnums, policy=policy, clip=clip)
    check_qparams(qparams, "jqt.pack")
    flags("jqt.pack", clip=clip)
    if isinstance(argnum, np.integer):  # as weight_argnums takes it
        argnum = int(argnum)
    if not isinstance(argnum, int) or isinstance(argnum, bool) or argnum < 0:
        raise TypeError(f"jqt.pack: argnum={argnum!r}; expected the index (an int >= 0) of the "
                        "one argument of f whose weights params holds, as in weight_argnums. Pack "
                        "each weight argument on its own: jqt.pack(qp, enc, argnum=0), "
                        "jqt.pack(qp, head, argnum=1).")
    if isinstance(params, PackedParams):
        raise TypeError("jqt.pack: params are already jqt.PackedParams (from jqt.pack or "
                        "jqt.load_packed); pass the float params to pack, or use these as they are.")
    check_alive(params, "jqt.pack", "params")
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        tracing.refuse_mutable(x, path_str(path), "jqt.pack")
    refuse_array_likes(params, "jqt.pack")
    check_policy(policy, "jqt.pack")
    qparams = numbers_as_arrays(qparams)
    policy = policy or KernelPolicy.for_backend()
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
    flat = [x for _, x in with_paths]
    avals = [_aval(x) for x in flat]
    index = weightcheck.leaf_index([path_str(q) for q, _ in with_paths])  # weights: by path
    prefixed = weightcheck.prefixed_paths(qparams)
    weights, consumed, needed, unpackable, leaf_of, checks, nans = {}, set(), set(), [], {}, [], []
    other_args, copies = set(), []
    for key, p in qparams.items():
        w = p.weight_operand
        if w is None or p.operand(w) is None:
            continue
        src = p.source
        if src is not None and src.arg != argnum:  # another weight argument's (its own pack)
            other_args.add(src.arg)
            continue
        if src is None:
            unpackable.append(key)
            continue
        leaf = weightcheck.find_leaf(src, index, key, prefixed=prefixed)
        if leaf is None:  # leaves are found by path: params may hold other leaves too
            raise QParamsMismatchError(
                f"jqt.pack: op '{key}' reads weight '{src.path}', which params do not hold (their "
                f"leaves: {list(index)[:6]}{' ...' if len(index) > 6 else ''}). Pass the params "
                f"the qparams were calibrated with.{boxed_leaf(src.path, index)}"
                f"{level_leaf(src.path, index)}"
                f"{_other_arg(qparams, argnum, index, {q: jnp.shape(flat[i[0]]) for q, i in index.items()})}")
        if src.shape is not None and tuple(jnp.shape(flat[leaf])) != tuple(src.shape):
            raise QParamsMismatchError(
                f"jqt.pack: op '{key}' was calibrated for weight '{src.path}' of shape "
                f"{tuple(src.shape)}, but params hold it with shape {tuple(jnp.shape(flat[leaf]))}. "
                "Pass the params the qparams were calibrated with, or re-calibrate.")
        if jnp.iscomplexobj(flat[leaf]):
            raise QParamsMismatchError(
                f"jqt.pack: op '{key}' was calibrated for a real weight '{src.path}', but params "
                f"hold it as {jnp.result_type(flat[leaf])}: packing it would drop the imaginary part. "
                "Pass the params the qparams were calibrated with, or re-calibrate with these "
                "(an op that reads complex values is kept float).")
        src = dataclasses.replace(src, leaf=leaf)
        operand = apply_chain(flat[src.leaf], src.chain)
        q = p.operand(w)
        why = weight_scale_problem(q.scale, q.qtype, src, jnp.shape(operand))
        why = why or ("" if p.op != "dot_general" else
                      smooth_mismatch(p.smooth, jnp.shape(operand), src.contract, src.stack_depth))
        if why:
            raise QParamsMismatchError(f"jqt.pack: op '{key}' (weight '{src.path}'): {why}.")
        entry = BY_NAME[p.op]

        def misfit(e, key=key, src=src, operand=operand, q=q):
            return QParamsMismatchError(
                f"jqt.pack: op '{key}': weight '{src.path}' has shape {tuple(jnp.shape(operand))}, "
                f"which its scale of shape {tuple(jnp.shape(q.scale))} does not fit ({e}). "
                "Pass the params the qparams were calibrated with, or re-calibrate.")
        try:
            grid = entry.grid_operand(src, p, operand)
            weights[key] = _own_scales(entry.pack(src, p, operand, policy, grid=grid), p,
                                       folded=p.packed_tag, smooth=None if p.smooth is None
                                       else jnp.asarray(p.smooth, jnp.float32))
        except ScaleShapeError as e:  # (the quantize primitive's own check, bound eagerly)
            raise misfit(e) from None
        except ValueError as e:
            ours, theirs = _placements(operand), _placements(q, p.smooth)
            if ours and theirs and ours != theirs:  # JAX's refusal of committed arrays
                raise ValueError(  # on other devices
                    f"jqt.pack: op '{key}': weight '{src.path}' is on device ids "
                    f"{', '.join(sorted(ours))}, its qparams on {', '.join(sorted(theirs))}. Put "
                    "the qparams where the params are (jax.device_put(qparams, device or the "
                    "params' sharding)), then pack.") from e
            raise QParamsMismatchError(f"jqt.pack: op '{key}': {e} Re-calibrate.") from None
        except TypeError as e:  # the scales do not broadcast against the weight
            if compat.is_tracer(operand) and "not differentiable" in str(e):
                raise TypeError("jqt.pack cannot be differentiated (it was called under jax.grad "
                                "or jax.jvp): packed codes are integers. Pack outside the "
                                "differentiated function, or differentiate the simulated path, "
                                "jqt.quantize(f, qparams, simulate=True), with the float params."
                                ) from None
            raise misfit(e) from None
        if not clip:  # the weights against those the qparams were calibrated with
            checks.append(weightcheck.start(key, p, src, *grid))
        if p.operand(w).qtype.kind != "float" and not compat.is_tracer(operand):
            nans.append((key, src.path, jnp.sum(jnp.isnan(operand))))  # fp8 codes hold NaN
        consumed.add(src.leaf)
        leaf_of[key] = src.leaf
        if any(c[0] == "broadcast_in_dim" for c in src.chain) \
                and jnp.size(operand) > jnp.size(flat[src.leaf]):
            copies.append((key, src.path, tuple(jnp.shape(operand)), jnp.size(operand) // jnp.size(flat[src.leaf]),
                           p.op))
        if src.float_needed:
            needed.add(src.leaf)
    if other_args and not weights and not unpackable:  # a weight argument without quantized
        # ops (norm gains) packs to itself; argnum given by mistake is said
        diagnostics.warn(
            f"jqt.pack(argnum={argnum}): no quantized op reads a weight of argument {argnum} of f; "
            f"the qparams' quantized ops read argument(s) {sorted(other_args)}, so nothing is "
            f"packed: every leaf is kept as it is. Where argument {argnum}'s ops are all kept float "
            "(LoRA adapters under a Rule(..., weight=None)), that is all there is to do: pass "
            f"it to f as it is; otherwise pass argnum={min(other_args)} to pack those.")
    _refuse_nans(nans)
    several = sorted(other_args | {argnum})
    weightcheck.finish(checks, lambda p, src: BY_NAME[p.op].grid_operand(
        src, p, apply_chain(flat[src.leaf], src.chain)), fix=weightcheck.PACK_FIX if not other_args
        else f"if they are the weights of another argument of f (the qparams hold those of "
        f"arguments {several}; argnum={argnum} packs argument {argnum}'s), pass its argnum=; "
        "else " + weightcheck.PACK_FIX)
    if unpackable:
        diagnostics.warn(f"jqt.pack: ops {unpackable} read weights that are not leaves of params "
                         "reached by layout ops (constants, values computed from several leaves or "
                         "by arithmetic on one, as a weight standardization (w - mean) / std, "
                         "a leaf reordered by an index array, w[perm], or gathered across devices "
                         "inside a jax.shard_map, all_gather, as FSDP does, or w[e] in a "
                         "lax.map/lax.scan over jnp.arange(E)); they are quantized at run time. "
                         "To pack such a weight, store it as computed in params (e.g. the "
                         "reordered w) and calibrate on those params; loop over the stacked "
                         "weight itself (lax.map(body, w), each expert's matrix the body's "
                         "argument); a shard_map's weight, pass it whole (P() in in_specs) or "
                         "split as its matmul reads it (tensor parallelism).")
    if copies:
        key, path, shape, n, op = copies[0]
        how, fix = (("jnp.repeat or jnp.broadcast_to of a kernel?", "Where a convolution "
                     "with the kernel itself gives the same features, convolve with it and copy "
                     "those (a kernel jnp.repeat-ed m times along its output axis: "
                     "jnp.repeat(y, m, axis=c) on the output's features axis c); otherwise store "
                     "the kernel as the convolution uses it in params")
                    if op == "conv_general_dilated" else
                    ("jnp.broadcast_to before a batched matmul?", "Contract the weight itself, "
                     "without broadcasting it (jnp.einsum('btk,kn->btn', x, w), x @ w)"))
        diagnostics.warn(
            f"jqt.pack: op '{key}' reads weight '{path}' broadcast to shape {shape} ({how}): its "
            f"codes and scales are stored for each of the {n} copies, "
            f"{n}x the leaf's elements{f' (and {len(copies) - 1} more such ops)' if len(copies) > 1 else ''}, "
            f"so the packed weights can outgrow the float ones. {fix}, and re-calibrate.")
    # ops these qparams keep float (the recipe's choice: a lookup of a tied table under
    # embeddings=False; or made float after calibration, by a fallback or by hand, which
    # float_needed, from calibration, says nothing of): the leaves they read are kept, found
    # by path as the quantized ops' weights are (params may hold other leaves too)
    float_ops = {k: q for k, q in qparams.items() if q.source is not None and q.source.arg == argnum
                 and (q.weight_operand is None or q.operand(q.weight_operand) is None)}
    needed |= {leaf for k, q in float_ops.items()
               for leaf in [weightcheck.find_leaf(q.source, index, k, prefixed=prefixed)] if leaf is not None}
    kept = [i for i in range(len(flat)) if i not in consumed or i in needed]
    chosen = {q.source.path for q in float_ops.values()}
    _warn_kept_twice({i for i in consumed & needed if path_str(with_paths[i][0]) not in chosen},
                     leaf_of, with_paths, flat)
    _share_equal(leaf_of, weights, qparams)
    with diagnostics.grouped():
        tied = _tied(qparams, weights)
    for g, _ in tied:  # the lookup keeps its scales and reads the matmul's codes
        weights[g] = dataclasses.replace(weights[g], values=None, layout="tied")
    # a weakly typed leaf packed away keeps its weak type in its aval (see _unpack); a kept
    # one carries its own, so its aval does not: the treedef, which holds the avals, stays
    # that of the same params made strong (an export, a jit cache entry)
    kept_set = set(kept)
    avals = [a.update(weak_type=False) if i in kept_set and getattr(a, "weak_type", False) else a
             for i, a in enumerate(avals)]
    return PackedParams([flat[i] for i in kept], weights, treedef, avals, kept, tied)


def _warn_kept_twice(both, leaf_of, with_paths, flat):
    """Warns of the weights ``both`` lists, packed and also kept float (f reads them
    outside their quantized ops too): the packed params hold both, which nothing else
    would tell. The caller leaves out weights an op the recipe left float reads: those are
    kept by choice."""
    if not both:
        return
    names = [f"'{path_str(with_paths[i][0])}' (op{'s' if len(ks) > 1 else ''} "
             f"{', '.join(repr(k) for k in ks)})" for i in sorted(both)
             for ks in [[k for k, j in leaf_of.items() if j == i]]]
    extra = sum(int(jnp.size(flat[i])) * jnp.dtype(jnp.result_type(flat[i])).itemsize for i in both)
    diagnostics.warn(
        f"jqt.pack: weight{'s' if len(names) > 1 else ''} {', '.join(names[:4])}"
        f"{f' and {len(names) - 4} more' if len(names) > 4 else ''} packed and also kept as float "
        f"({extra} bytes): f reads {'them' if len(names) > 1 else 'it'} as a float outside the "
        "quantized ops too (a jax.debug.print or a norm of the weight, w * 2 or another op jqt "
        "does not quantize, or f returns it: an nnx step that returns nnx.state(model), where "
        "nnx.state(model, nnx.Cache) returns what changes), so the packed params hold both. "
        "Move such a read out of f; where the float read is meant, nothing is wrong.")


def _aval(x):
    """A params leaf's shape and dtype; a non-array leaf (a config string f reads), which
    is kept as it is, as itself (:class:`tracing.Static`): a function (an Equinox MLP's
    activation) is not asked for a shape."""
    if not (hasattr(x, "dtype") or hasattr(x, "__jax_array__")
            or isinstance(x, (bool, int, float, complex, np.generic))):
        return tracing.Static(x)
    try:
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=compat.explicit_sharding(x),
                                    weak_type=compat.is_weak(x))  # (jnp.full(s, 0.1): see _unpack)
    except TypeError:
        return tracing.Static(x)


_SHARED = ("values", "scale", "zero_point", "smooth")  # what ops reading one leaf alike share


def _share_equal(leaf_of, weights, qparams):
    """Ops that read one leaf (``leaf_of[key]``) and pack it to equal codes and scales (a
    layer applied several times in a Python loop, a shared Keras layer) share one
    :class:`QArray` object, in place: its arrays are held once, and :func:`jqt.save_packed`
    writes them once. Ops that read it through the same steps, as one type, but pack it
    to other codes or scales (scales trained apart in :mod:`jqt.qat`) get a warning: the
    packed params hold a copy per op."""
    first, apart, by_chain = {}, {}, {}
    for k, w in weights.items():
        # (not the sums: ops of other activation types, one with a zero point and one
        # without, read the same codes; each keeps its own sums)
        arrays = [getattr(w, f) for f in _SHARED]
        sig = (leaf_of[k], w.qtype, w.layout, w.folded,
               tuple(None if a is None else (a.shape, a.dtype) for a in arrays))
        if any(compat.is_tracer(a) for a in (*arrays, w.sums)):  # pack under a transformation
            continue
        # ops with other scales (trained apart) in buckets of their own: each op compared
        # with all the others' codes was quadratic (7 s for a layer applied 400 times)
        bucket = (sig, tuple(_digest(a) for a, f in zip(arrays, _SHARED) if f != "values"))
        for k0 in first.setdefault(bucket, []):
            w0 = weights[k0]
            if all(a is None or bool(jnp.array_equal(a, getattr(w0, f)))
                   for a, f in zip(arrays, _SHARED)):
                same_sums = (w.sums is None) == (w0.sums is None) and (
                    w.sums is None or (w.sums.shape == w0.sums.shape
                                       and bool(jnp.array_equal(w.sums, w0.sums))))
                weights[k] = w0 if same_sums else dataclasses.replace(
                    w, **{f: getattr(w0, f) for f in _SHARED})
                break
        else:
            chain = qparams[k].source.chain
            try:
                hash(chain)
            except TypeError:
                chain = repr(chain)
            k0 = by_chain.setdefault((sig, chain), k)
            if k0 != k:
                apart.setdefault(k0, [k0]).append(k)
            first[bucket].append(k)
    folded = {}  # ops that read a leaf alike but fold other smoothing vectors into it
    for k, w in weights.items():
        if w.folded and qparams[k].source is not None:
            folded.setdefault((leaf_of[k], w.qtype, w.layout, qparams[k].source.chain), {}) \
                .setdefault(w.folded, []).append(k)
    for by_tag in folded.values():
        if len(by_tag) > 1:
            keys = [ks[0] for ks in by_tag.values()]
            diagnostics.warn(
                f"jqt.pack: ops {', '.join(repr(k) for k in keys[:4])}{' ...' if len(keys) > 4 else ''} "
                f"read weight '{qparams[keys[0]].source.path}' alike (a layer applied several "
                f"times) but each with its own smoothing vector (smooth= or awq=, calibrated per "
                f"use), folded into its codes, so the packed params hold the codes {len(by_tag)} "
                "times (more bytes than the float weight, at enough uses). To store them once, "
                "apply the layer under a lax.scan (one op, one vector), or keep the transform "
                "off its repeated uses (a Rule for their keys without smooth=/awq=).")
    for keys in apart.values():
        diagnostics.warn(
            f"jqt.pack: ops {', '.join(repr(k) for k in keys[:4])}{' ...' if len(keys) > 4 else ''} "
            f"read weight '{qparams[keys[0]].source.path}' alike (a layer applied several times) "
            f"but with other scales or zero points (trained apart in jqt.qat, edited, or given "
            f"by other rules), so the packed params hold its codes {len(keys)} times. To store "
            "them once, give the ops one set of scales (train the weight's scales frozen: "
            "jqt.qat.labels(..., train=('weights', 'activation_scales')), which freezes the "
            "zero points too, the activations' with the weights', or copy one op's scales and "
            "zero points to the others); otherwise nothing is wrong.")


def _digest(a):
    """A key equal for arrays ``jnp.array_equal`` calls equal (a scale, a zero point: small
    arrays, read to the host), ``-0.0`` as ``0.0``."""
    if a is None:
        return None
    if not getattr(a, "is_fully_addressable", True):  # (another process holds parts)
        return (np.shape(a), str(a.dtype), None)
    h = np.asarray(a)
    if jnp.issubdtype(h.dtype, jnp.floating):  # (bfloat16, fp8: NumPy's kind 'V')
        h = np.where(h == 0, np.zeros((), h.dtype), h)
    return (h.shape, str(h.dtype), hash(np.ascontiguousarray(h).tobytes()))


def _same_grid(lookup, matmul) -> bool:
    """Whether a tied table's lookup and matmul quantize it alike (so their codes are
    equal), from their qparams: no smoothing or rotation, the table read through the same
    steps (a transpose aside), and the same scales and zero points (the matmul's may be
    the transpose). False where the qparams are traced. The rule for the codes jqt.pack
    ties too, so that a template (``jax.eval_shape``) has the structure of the pack."""
    if matmul.rotate or lookup.rotate or not (_no_smoothing(lookup) and _no_smoothing(matmul)):
        return False
    if _steps(lookup) != _steps(matmul):  # (a table read in bfloat16 by one op)
        return False
    a, b = lookup.operand(lookup.weight_operand), matmul.operand(matmul.weight_operand)
    for x, y in ((a.scale, b.scale), (a.zero_point, b.zero_point)):
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        if compat.is_tracer(x) or compat.is_tracer(y):
            return False
        x, y = np.asarray(x), np.asarray(y)
        if x.ndim == 2 and y.T.shape == x.shape and (x.shape != y.shape or _flipped(lookup, matmul)):
            y = y.T  # (a square one: (V, G) groups against the matmul's (G, V), V == G)
        if x.shape != y.shape or not np.array_equal(x, y):
            return False
    return True


def _no_smoothing(p) -> bool:
    """No smoothing vector, or one of ones (AWQ that found nothing better): codes alike."""
    v = p.smooth
    return v is None or (not compat.is_tracer(v) and bool(np.all(np.asarray(v) == 1)))


def _flipped(lookup, matmul) -> bool:
    """Whether the two ops read the 2-D table in transposed layouts (``h @ emb.T``)."""
    odd = lambda p: sum(1 for s in p.source.chain if s[0] == "transpose" and tuple(s[1]) == (1, 0)) % 2  # noqa: E731
    return odd(lookup) != odd(matmul)


def _steps(p):
    """The steps by which an op reads its weight leaf, transposes left out, and casts to
    float32 or float64, which hold a bfloat16 or float16 table exactly (a head computing
    its logits in float32, ``h @ emb.astype(jnp.float32).T``: the codes are the lookup's)."""
    return [s for s in p.source.chain
            if s[0] != "transpose" and not (s[0] == "convert" and s[1] in ("float32", "float64"))]


def _tied(qparams, weights):
    """``((gather key, matmul key), ...)``: embedding lookups whose table a matmul also
    reads (tied input and output embeddings) with the same codes, so that the codes
    are stored once. The matmul's 2-D codes are the table (``"nk"``) or its transpose
    (``"kn"``), compared byte for byte with the lookup's."""
    matmuls, others = {}, {}
    for k, w in weights.items():
        p = qparams[k]
        if p.op == "dot_general" and w.layout in ("nk", "kn") and w.values.ndim == 2:
            matmuls.setdefault((p.source.arg, p.source.leaf), []).append(k)
        elif p.op == "dot_general":  # a stacked table's (a scan over codebooks), an einsum's
            others.setdefault((p.source.arg, p.source.leaf), []).append(k)
    out = []
    for k, w in weights.items():
        p = qparams[k]
        leaf = (p.source.arg, p.source.leaf) if p.op == "gather" else None
        readers = [m for m in (*matmuls.get(leaf, ()), *others.get(leaf, ()))
                   if weights[m].values is not None and w.values is not None]
        if readers and (w.values.ndim != 2 or not matmuls.get(leaf)):  # cannot be tied
            m = readers[0]
            diagnostics.warn(
                f"jqt.pack: the lookup '{k}' and the matmul '{m}' read the same table "
                f"'{p.source.path}', but jqt stores codes once for a 2-D table that a matmul "
                f"reads whole as (N, K) or (K, N) only (here codes of shape "
                f"{tuple(weights[m].values.shape)} and {tuple(w.values.shape)}: a stacked table, "
                f"or one of three axes): its codes are stored twice. {_NO_FIX}")
        if p.op != "gather" or w.values.ndim != 2:
            continue
        apart = None  # a matmul reading the table with other codes: (its key, its type)
        for m in matmuls.get((p.source.arg, p.source.leaf), ()):
            o = weights[m]
            table = o.values if o.layout == "nk" else o.values.T
            traced = compat.is_tracer(table) or compat.is_tracer(w.values)
            if _disjoint(p.source, qparams[m].source):
                continue  # other rows of the leaf (t[:50][i] and t[50:].T): nothing stored twice
            if o.qtype != w.qtype:  # (int4 against int8 after a fallback)
                mine, its = w.qtype.contrast(o.qtype)  # (fields named where both read alike)
                apart = apart or (m, f"the lookup's type is {mine}, the matmul's {its}", _TYPE_FIX)
            elif not _contracts_features(qparams[m].source, _feature_axis(p.source)):  # A @ table
                apart = apart or (m, _OTHER_AXIS.format(tuple(table.shape), tuple(w.values.shape)), _NO_FIX)
            elif _rows_second(p.source):  # table.T[:, ids]: its codes are features x rows,
                # which a tie does not read
                sliced = any(c[0] == "slice" for c in qparams[m].source.chain)
                apart = apart or (m, "the lookup gathers rows along the second axis of what it reads "
                            "(table.T[:, ids], jnp.take(table, ids, axis=1)), and a tied lookup "
                            "reads the matmul's codes rows first", "To store them once, look "
                         "the rows up along the first axis (table[ids] of a (V, D) table, "
                         "table.T[ids] of a (D, V) one; transposed after the lookup if need be)"
                         + (", and multiply by the whole table, slicing the product ((u @ "
                            "table.T)[:, 1:] for u @ table[1:].T)." if sliced else "."))
            elif table.shape != w.values.shape and table.shape[1:] == w.values.shape[1:] and any(
                    c[0] == "slice" for c in qparams[m].source.chain):  # rows left out
                apart = apart or (m, f"the matmul reads a slice of the table (codes of shape "
                            f"{tuple(table.shape)}, the table's {tuple(w.values.shape)})",
                         "To store them once, multiply by the whole table and slice the "
                         "product ((u @ table.T)[:, 1:] for u @ table[1:].T).")
            elif table.shape != w.values.shape:
                apart = apart or (m, _OTHER_AXIS.format(tuple(table.shape), tuple(w.values.shape)), _NO_FIX)
            elif traced:  # jax.eval_shape or jax.jit of pack (a template): the codes are
                # not known, so the qparams decide, as the codes would
                if _same_grid(p, qparams[m]):
                    out.append((k, m))
                    break
                scales = (p.operand(p.weight_operand).scale, qparams[m].operand(qparams[m].weight_operand).scale)
                if any(compat.is_tracer(s) for s in scales):
                    diagnostics.warn(
                        f"jqt.pack: the lookup '{k}' and the matmul '{m}' read the same table "
                        f"'{p.source.path}' (tied embeddings), but under this transformation the "
                        "qparams are traced, so whether their codes are equal is not known: "
                        "they are stored twice, another pytree structure than jqt.pack gives "
                        "outside it. For a template, close over the qparams: "
                        "jax.eval_shape(lambda: jqt.pack(qparams, params)).")
            elif bool(jnp.array_equal(table, w.values)) and _same_grid(p, qparams[m]):
                out.append((k, m))  # (by the template's rule too: equal codes by chance apart)
                break
            elif _steps(p) != _steps(qparams[m]):  # (the table cast to bfloat16 by one op)
                apart = apart or (m, "the two read the table through other steps (one casts it to "
                            "another dtype, or reads a copy of it otherwise), so their codes "
                            "differ", "To store them once, read the table in one dtype in both "
                         "ops (cast after the lookup and after the matmul instead: "
                         "table[ids].astype(d), (h @ table.T).astype(d)); otherwise nothing "
                         "is wrong.")
            else:
                q = qparams[m]  # one type, no transform: the scales alone differ
                trained = (p.smooth is None and q.smooth is None and not p.rotate and not q.rotate
                           and w.qtype == o.qtype and not _same_grid(p, q))
                apart = apart or (m, "their codes differ (the matmul's weight is smoothed or rotated, "
                            "its weight calibrator is another, or its scales were edited or "
                            "trained)", _SCALE_FIX if trained else _TYPE_FIX)
        else:
            if apart is not None:  # (one warning per table and reason: a prefill's lookup
                m, why, fix = apart  # and a decode step's of one table, named together)
                diagnostics.warn_grouped(
                    ("tied", p.source.path, why),
                    f"jqt.pack: the lookup '{k}' and the matmul '{m}' read the same table "
                    f"'{p.source.path}' (tied embeddings), but {why}: its codes are stored twice. "
                    f"{fix}", f"the lookup '{k}' and the matmul '{m}'")
    return tuple(out)


_OTHER_AXIS = ("the matmul contracts the table's other axis (A @ table) or reads part of its "
               "features (codes of shape {}, the table's {}), so its scales are not the lookup's")
_NO_FIX = "In this form the two cannot share codes: the packed params hold both, and nothing is wrong."


def _rows_second(src) -> bool:
    """Whether a lookup gathers rows along the second axis of the 2-D operand it reads
    (``table.T[:, ids]``, ``jnp.take(table, ids, axis=1)``: its features first), so that
    its codes are stored features x rows, which a tie (the matmul's codes, rows first)
    cannot give it; ``False`` where it cannot tell. (``emb.T[ids]`` of a ``(D, V)`` leaf
    gathers along the first axis of what it reads: not this.)"""
    if src is None or src.shape is None or len(src.shape) != 2 or src.shape[0] == src.shape[1] == 1:
        return False
    return tuple(src.contract or ()) == (0,)


def _feature_axis(src) -> int:
    """The axis of a lookup's 2-D table leaf that it reads as features: 1 (``table[ids]``,
    ``table.T[:, ids]``), or 0 for a table stored transposed (``emb.T[ids]`` of a ``(D, V)``
    leaf, features along the leaf's rows); 1 where it cannot tell."""
    if src is None or src.shape is None or len(src.shape) != 2 or len(src.contract or ()) != 1:
        return 1
    op = _replayed(src, np.indices(tuple(src.shape), dtype=np.int32)[0])  # each leaf row's number
    c = src.contract[0]
    if op is None or op.ndim != 2 or not 0 <= c < 2 or op.shape[c] < 2:
        return 1
    return 0 if np.ptp(op, axis=c).min() > 0 else 1  # the leaf's rows vary along the features


def _disjoint(a, b) -> bool:
    """Whether two ops read no element of a leaf in common (slices of it through their
    chains: ``t[:50]`` and ``t[50:]``); ``False`` where no chain slices it, or a chain does
    not replay."""
    if a.shape is None or not any(c[0] == "slice" for c in a.chain + b.chain):
        return False  # (qparams saved before jqt recorded the shape: not known)
    n = math.prod(a.shape)
    grid = np.arange(n, dtype=np.int32 if n < 2 ** 31 else np.int64).reshape(tuple(a.shape))
    x, y = _replayed(a, grid), _replayed(b, grid)
    if x is None or y is None:
        return False
    seen = np.zeros(n, bool)  # (a mask, not a sort: a large table's 8M elements in 0.1 s)
    seen[x.ravel()] = True
    return not seen[y.ravel()].any()


def _replayed(src, grid):
    """``grid`` (integers of ``src.shape``) through ``src``'s layout chain, casts left out so
    that the integers stay exact (a bfloat16 copy of a large table's), concrete under
    jax.eval_shape / jax.jit of pack; ``None`` where a step does not take it."""
    chain = [c for c in src.chain if c[0] not in ("convert", "reduce_precision")]
    try:
        with jax.ensure_compile_time_eval():
            return np.asarray(apply_chain(jnp.asarray(grid), chain))
    except (TypeError, ValueError):
        return None


def _contracts_features(src, features: int = 1) -> bool:
    """Whether a matmul that reads a table (rows x features; the features along the leaf's
    axis ``features``, :func:`_feature_axis`) through ``src`` contracts the table's
    features, as ``h @ table.T`` does (``A @ table`` contracts its rows: codes per feature,
    never the lookup's, a square table's too); ``True`` where it cannot tell."""
    if src is None or src.shape is None or len(src.shape) != 2 or not src.contract:
        return True
    op = _replayed(src, np.indices(tuple(src.shape), dtype=np.int32)[features])
    if op is None:  # a step this replay does not take: as before
        return True
    axes = [c for c in src.contract if 0 <= c < op.ndim and op.shape[c] > 1]
    return not axes or all(np.ptp(op, axis=c).min() > 0 for c in axes)


_SCALE_FIX = ("Both ops have one weight type but other scales (fine-tuned apart: a lookup's "
              "scales get gradients the matmul's do not): to store the codes once, give the "
              "matmul the lookup's scales, or freeze both in training (jqt.qat.labels); "
              "otherwise nothing is wrong.")
_TYPE_FIX = ("To store them once, give the lookups and the matmuls of the table one weight type "
             "(a Rule for the lookups' keys, or the matmuls', ahead of the preset's) without "
             "smoothing or rotation.")
