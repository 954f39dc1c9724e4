"""Higher-order primitives: one table, keyed by primitive object, read by both the
analysis (how operands map to the body's inputs) and the interpreter (how the
equation is rebuilt through JAX's public API around an interpreted body).

An entry is a :class:`Hop`:

* ``subs(eqn, infos, scan_id) -> [(jaxpr, consts, inner_infos)]``: each body and
  what is known about its inputs (weight or data, the weight's source);
* ``run(eqn, invals, sub, ctx, evaluate) -> outvals``: the rebuilt equation,
  where ``evaluate(jaxpr, consts, args, plan, ctx)`` interprets a body;
* ``transparent``: the body's outputs are the equation's outputs one for one
  (a weight's source passes through);
* ``outs(eqn, infos, body_outs, loop_id, reads) -> (out infos, caches)``: for
  loops and ``cond``, which outputs are still a loop-carried buffer (``None``:
  plain data), and which carry slots are key/value caches (``kvcache.py``):
  written and read (``reads``: the buffers some op reads) by the body.

The documented default, for a primitive not in the table: the equation is
re-bound unchanged (its ops stay float; the analysis warns when its bodies hold
quantizable ops). ``jit``, ``closed_call`` and ``call`` are inlined; ``remat``
becomes ``jax.checkpoint`` with the same policy; ``custom_jvp_call`` and
``custom_vjp_call`` keep the user's rule for the inputs on the simulated path;
``scan``, ``while`` and ``cond`` thread per-op state (see ``interpreter.py``); a ``while``
whose predicate is batched (``jax.vmap`` of a loop whose stop depends on the example) runs
while any lane is live, a finished lane keeping its carry, as XLA lowers it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from . import compat, kvcache
from .handlers import QParamsMismatchError, stacked_hint
from .layerview import LayerView
from .plan import Plan, VarInfo, closed_parts, picked_weights


@dataclasses.dataclass(frozen=True)
class Hop:
    subs: Callable
    run: Callable
    transparent: bool = False
    outs: Callable = None


# ---- analysis side: operands -> body inputs ---------------------------------------------------

def _same(param):
    def f(eqn, infos, _):
        j, c = closed_parts(eqn.params[param])
        return [(j, c, list(infos))]
    return f


def _const(info):
    """A loop's constant: the same value every iteration, not a buffer the loop writes
    (zeros stay zeros: a slot cleared with zeros made before the loop)."""
    return VarInfo(info.weight, info.source, info.stack_ids, zero=info.zero, built=info.built,
                   computed=info.computed, rowwise=info.rowwise, value=info.value)


def _carries(infos, loop_id):
    """A loop body's carry inputs: data, each the buffer ``(loop_id, slot)`` (and still the
    outer buffer it was initialised from), with no writes yet."""
    return [VarInfo(False, buffer=info.buffer + (info.unflat[0] if info.unflat else ()) + ((loop_id, k),))
            for k, info in enumerate(infos)]


def _scan_subs(eqn, infos, scan_id):
    p = eqn.params
    nc, nk = compat.scan_counts(eqn)
    inner = [_const(i) for i in infos[:nc]] + _carries(infos[nc:nc + nk], scan_id)
    for var, info in zip(eqn.invars[nc + nk:], infos[nc + nk:]):  # xs: slices of the
        # stacked value, a slice of its buffer (a flag the same along its last axis: its
        # slices too, where they keep that axis)
        s = info.source
        if s is not None:
            s = dataclasses.replace(s, chain=s.chain + (("scan_slice",),))
        # a weight computed before the scan (jnp.stack of per-layer leaves, w * 2) is
        # stacked too: each iteration reads another layer, with ranges of its own
        inner.append(VarInfo(info.weight, s, info.stack_ids + ((scan_id,) if s is not None or info.weight
                                                               else ()),
                             buffer=info.buffer, writes=info.writes, built=info.built,
                             computed=info.computed, unflat=info.unflat,
                             rowwise=info.rowwise and len(var.aval.shape) > 1))
    j, c = closed_parts(p["jaxpr"])
    return [(j, c, inner)]


def _while_subs(eqn, infos, loop_id):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    j, c = closed_parts(p["body_jaxpr"])
    return [(j, c, [_const(i) for i in infos[cn:cn + bn]] + _carries(infos[cn + bn:], loop_id))]


def _carried(outer, body_out, loop_id, k):
    """The loop's output for carry slot ``k``: the outer buffer written by the body's
    writes when the body returns the slot's own buffer; None otherwise."""
    if (loop_id, k) not in body_out.buffer:
        return None
    if outer.unflat and not outer.buffer:  # a reshaped view of a buffer (an inner loop over
        buf, writes, shape = outer.unflat  # the layers carrying a (B * K, ...) merged cache)
        return VarInfo(False, unflat=(buf, writes + body_out.writes, shape))
    return VarInfo(False, buffer=outer.buffer, writes=outer.writes + body_out.writes)


def _caches(carry_outs, loop_id, reads):
    """Carry slot -> the writes of a cache: a slot the body returns written and also reads
    (attention reads its cache; a buffer that only collects outputs is not a cache)."""
    return {k: o.writes for k, o in enumerate(carry_outs)
            if (loop_id, k) in o.buffer and o.writes and (loop_id, k) in reads}


def _scan_outs(eqn, infos, body_outs, scan_id, reads):
    nc, nk = compat.scan_counts(eqn)
    body = body_outs[0]
    outs = [_carried(infos[nc + k], body[k], scan_id, k) for k in range(nk)]
    for o in body[nk:]:  # ys: restacked slices of an outer buffer are that buffer (or
        # of a reshaped view of one: the layers' scan over a (B, K, T, D) cache merged
        # to (B * K, T, D))
        own = any(b[0] == scan_id for b in o.buffer or (o.unflat[0] if o.unflat else ()))
        outs.append(VarInfo(False, buffer=o.buffer, writes=o.writes) if o.buffer and not own
                    else VarInfo(False, unflat=o.unflat) if o.unflat and not own else None)
    return outs, _caches(body[:nk], scan_id, reads)


def _while_outs(eqn, infos, body_outs, loop_id, reads):
    p = eqn.params
    init = infos[p["cond_nconsts"] + p["body_nconsts"]:]
    body = body_outs[0]
    return [_carried(i, o, loop_id, k) for k, (i, o) in enumerate(zip(init, body))], _caches(body, loop_id, reads)


def _cond_outs(eqn, infos, body_outs, _, reads):
    """A buffer every branch returns (written or not) is still that buffer. Weights the
    branches return, picked by an index from the data, are ``chosen`` (no one weight: the
    op that reads them stays float, and calibrate says so)."""
    outs = []
    for per_branch in zip(*body_outs):
        bufs = {o.buffer for o in per_branch}
        if len(bufs) == 1 and per_branch[0].buffer:
            writes = tuple(dict.fromkeys(w for o in per_branch for w in o.writes))
            outs.append(VarInfo(False, buffer=per_branch[0].buffer, writes=writes))
        elif chosen := picked_weights(infos[0], per_branch):
            outs.append(VarInfo(False, chosen=chosen))
        else:
            outs.append(None)
    return outs, {}


def shard_splits(eqn, k):
    """``(axis, blocks, mesh axis names)`` for each axis of operand ``k`` that the
    ``shard_map`` equation ``eqn`` splits over devices."""
    spec, shape = eqn.params["in_specs"][k], eqn.params["mesh"].shape
    out = []
    for d, entry in enumerate(spec):
        names = compat.spec_names(entry)
        if names:
            out.append((d, int(math.prod(shape[n] for n in names)), names))
    return tuple(out)


def _shard_map_subs(eqn, infos, shard_id):
    """The body sees each device's block of an operand: a weight split over devices is
    read per block, one set of parameters per block (stacked in front, as a scan's
    layers are: ``("shard_split", splits)`` in its chain, ``layout.split_blocks``); a
    replicated weight is the weight itself (``("shard_split", ())``: no blocks). A
    key/value cache passed in is each device's block of it (quantized as a whole where the
    shard_map keeps its last axis whole)."""
    inner = []
    for k, info in enumerate(infos):
        if info.source is None:  # data; a buffer (a key/value cache) is its block of it,
            # unless its vectors are split over devices (one scale per vector: a split last axis)
            keeps = not any(d == len(eqn.invars[k].aval.shape) - 1 for d, _, _ in shard_splits(eqn, k))
            # (a weight computed in a scan's body from its layer: still that layer's)
            inner.append(VarInfo(info.weight, indexed=info.indexed, selected=info.selected,
                                 chosen=info.chosen, mixed=info.mixed,
                                 buffer=info.buffer if keeps else (),
                                 writes=info.writes if keeps else (),
                                 stack_ids=info.stack_ids if info.weight else (),
                                 rowwise=info.rowwise))  # a block of such a flag is one too
            continue
        # a replicated weight gets an empty split: each device reads it whole (so
        # jqt.packed_shardings places it whole on every device)
        splits = shard_splits(eqn, k)
        s = dataclasses.replace(info.source, chain=info.source.chain + (("shard_split", splits),))
        inner.append(VarInfo(True, s, info.stack_ids + ((shard_id,) if splits else ())))
    return [(eqn.params["jaxpr"], (), inner)]


def _shard_map_outs(eqn, infos, body_outs, _, reads):
    """A buffer the body returns (written or not) is still that buffer: a key/value cache
    each device writes its block of."""
    return [VarInfo(False, buffer=o.buffer, writes=o.writes) if o.buffer else None
            for o in body_outs[0]], {}


def _cond_subs(eqn, infos, _):
    return [(*closed_parts(b), list(infos[1:])) for b in eqn.params["branches"]]


# ---- interpreter side: rebuild the equation around an interpreted body ------------------------

def _state_for(sub, ctx):
    return {k: ctx.state_in[k] for k in sub.keys if k in ctx.state_in}


def _runner(ctx, jaxpr, consts, plan, evaluate):
    """A function (state, *args) -> (outs, state_out) that interprets ``jaxpr``."""
    def run(state, *args):
        c = ctx.child(state)
        outs = evaluate(jaxpr, consts, args, plan, c)
        return outs, c.state_out
    return run


def _inline(param):
    def rule(eqn, invals, sub, ctx, evaluate):
        j, c = closed_parts(eqn.params[param])
        return evaluate(j, c, invals, sub.plans[0], ctx)
    return rule


def _integer_path(ctx) -> bool:
    """The integer path: not differentiated w.r.t. its state (packed codes), but w.r.t.
    the other inputs of f where its kernels allow (weight-only ops: QLoRA's adapters)."""
    return not ctx.handler.differentiable and not ctx.handler.collects


def _remat(eqn, invals, sub, ctx, evaluate):
    kw = dict(prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])
    j, c = closed_parts(eqn.params["jaxpr"])
    run = _runner(ctx, j, c, sub.plans[0], evaluate)
    if _integer_path(ctx):  # the state closed over (a LayerView is no array); it collects none
        st = _state_for(sub, ctx)
        return jax.checkpoint(lambda *a: run(st, *a)[0], **kw)(*invals)
    if not ctx.handler.differentiable:
        return _inline("jaxpr")(eqn, invals, sub, ctx, evaluate)
    outs, state_out = jax.checkpoint(run, **kw)(_state_for(sub, ctx), *invals)
    ctx.put_all(state_out)
    return outs


def _packed_in(sub, ctx) -> bool:
    """Whether an op of the body reads a packed weight whose float leaf ``jqt.pack``
    dropped (it reaches ``f``, and a custom rule, as zeros; a leaf it kept, also read as a
    float value, reaches the rule as it is)."""
    return any(k in ctx.dropped for k in sub.keys)


def _no_rule_on_codes(eqn, invals, sub, ctx, evaluate, simulated=False):
    """A custom_jvp/custom_vjp function on the integer path: with no quantized op in its
    body, the equation as it is (its own rule differentiates it); else its body inlined
    on the codes, its inputs behind an identity whose derivative is refused, naming the
    function: the user's rule takes the float weights, which packed params do not hold,
    and differentiating the body instead drops the rule (a clipped or NaN-safe gradient)."""
    qp = lambda e: e[0] if isinstance(e, tuple) else e
    quantized = sorted(k for k in sub.keys if not getattr(qp(ctx.state_in.get(k)), "is_float", True))
    if not quantized:
        if any(isinstance(v, LayerView) for v in invals):
            # a layer of packed weights it reads: the body interprets it, as before (JAX's
            # equation takes arrays only)
            return _inline("call_jaxpr")(eqn, invals, sub, ctx, evaluate)
        return bind_as_is(eqn, invals)  # its rule runs (a gradient reaching a cache's write
        # is refused, naming the cache)
    body = sorted({q.primitive.name for q in eqn.params["call_jaxpr"].jaxpr.eqns})
    kind = eqn.primitive.name.removesuffix("_call")
    msg = (f"jqt: the integer path of jqt.quantize cannot differentiate the {kind} function "
           f"{compat.where_called(eqn)} (its body: {', '.join(body)}; its quantized "
           f"ops: {', '.join(quantized)}): its derivative rule takes the float weights, "
           "which the packed codes do not hold, and the body's own derivative would not be "
           "the rule's. Differentiate the simulated path, jqt.quantize(f, qparams, "
           "simulate=True), which runs the rule; or keep these ops float (a recipe rule, "
           "weight=None).")
    if simulated:
        msg = (f"jqt: the simulated path of jqt.quantize, given packed params, cannot "
               f"differentiate the {kind} function {compat.where_called(eqn)} (its quantized "
               f"ops: {', '.join(quantized)}): its derivative rule takes the float weights, "
               "which jqt.pack dropped (they would reach the rule as zeros, and its gradients "
               "be wrong). Differentiate it with the float params, jqt.quantize(f, qparams, "
               "simulate=True)(params, ...), or keep these ops float (a recipe rule, "
               "weight=None).")

    @jax.custom_jvp
    def guard(*a):
        return a

    @guard.defjvp
    def _(primals, tangents):
        raise TypeError(msg)
    nc = eqn.params.get("num_consts", 0) if kind == "custom_vjp" else 0
    invals = as_jax(invals)
    guarded = invals[:nc] + list(guard(*invals[nc:]))
    return _inline("call_jaxpr")(eqn, guarded, sub, ctx, evaluate)


def _custom_jvp(eqn, invals, sub, ctx, evaluate):
    """Simulated path: quantized forward; tangents = the user's rule (w.r.t. the
    inputs) + autodiff of the quantized body (w.r.t. the quantization state)."""
    if _integer_path(ctx):
        return _no_rule_on_codes(eqn, invals, sub, ctx, evaluate)
    if not ctx.handler.differentiable:
        return _inline("call_jaxpr")(eqn, invals, sub, ctx, evaluate)
    if _packed_in(sub, ctx):
        return _no_rule_on_codes(eqn, invals, sub, ctx, evaluate, simulated=True)
    j, c = closed_parts(eqn.params["call_jaxpr"])
    run = _runner(ctx, j, c, sub.plans[0], evaluate)
    fwd = lambda st, *a: run(st, *a)[0]
    g = jax.custom_jvp(fwd)
    invals = as_jax(invals)

    def g_jvp(primals, tangents):
        st, *args = primals
        tst, constant = compat.jvp_tangents(tangents[0])
        targs, _ = compat.jvp_tangents(tuple(tangents[1:]))
        # (the output from g, not from the jvp of the body below, whose value is the same:
        # a transformation around this one differentiates the inputs by the user's rule)
        out = g(st, *args)
        with user_rule(eqn):
            _, t_user = jax.jvp(lambda *a: compat.bind_eqn(eqn, a), tuple(args), targs)
        if constant:  # the state is not differentiated: no second quantized forward (its
            return out, t_user  # callbacks would run twice)
        with body_transpose(eqn, "custom_jvp"):
            _, t_st = jax.jvp(lambda s: fwd(s, *args), (st,), (tst,))
        # (an integer or bool output's tangents are float0 on both sides: nothing to add)
        return out, [u if u.dtype == jax.dtypes.float0 else u + s for u, s in zip(t_user, t_st)]

    g.defjvp(g_jvp, symbolic_zeros=True)
    return g(_state_for(sub, ctx), *invals)


def _custom_vjp(eqn, invals, sub, ctx, evaluate):
    """Simulated path: quantized forward; cotangents = the user's bwd rule (w.r.t.
    the inputs) + autodiff of the quantized body (w.r.t. the quantization state)."""
    if _integer_path(ctx):
        return _no_rule_on_codes(eqn, invals, sub, ctx, evaluate)
    if not ctx.handler.differentiable:
        return _inline("call_jaxpr")(eqn, invals, sub, ctx, evaluate)
    if _packed_in(sub, ctx):
        return _no_rule_on_codes(eqn, invals, sub, ctx, evaluate, simulated=True)
    j, c = closed_parts(eqn.params["call_jaxpr"])
    run = _runner(ctx, j, c, sub.plans[0], evaluate)
    # The values the function closes over (num_consts) are not differentiated, as JAX's own
    # custom_vjp does not; differentiating them raised "with respect to a closed-over value".
    nc = eqn.params.get("num_consts", 0)
    invals = as_jax(invals)
    consts, invals = tuple(invals[:nc]), invals[nc:]
    fwd_fn = lambda st, *a: run(st, *consts, *a)[0]
    g = jax.custom_vjp(fwd_fn)

    def g_fwd(st, *args):
        # symbolic zeros: the quantization state is differentiated only where it is
        # perturbed (jax.grad of the inputs or weights alone does not need the body's
        # reverse pass, which a while_loop in it does not have)
        st, st_perturbed = compat.vjp_primal_values(st)
        args = tuple(compat.vjp_primal_values(a)[0] for a in args)
        if st_perturbed:
            with body_transpose(eqn):
                out, vjp_st = jax.vjp(lambda s: fwd_fn(s, *args), st)
        else:
            out, vjp_st = fwd_fn(st, *args), None
        with user_rule(eqn):
            _, vjp_user = jax.vjp(lambda *a: compat.bind_eqn(eqn, consts + a), *args)
        return out, (vjp_st, vjp_user)

    def g_bwd(res, ct):
        vjp_st, vjp_user = res
        ct = compat.instantiate_zeros(ct)
        with body_transpose(eqn):
            ct_st = (None,) if vjp_st is None else vjp_st(ct)
        with user_rule(eqn):
            return (*ct_st, *vjp_user(ct))

    g.defvjp(g_fwd, g_bwd, symbolic_zeros=True)
    return g(_state_for(sub, ctx), *invals)


def bind_as_is(eqn, invals) -> list:
    """``eqn`` bound as it is, on ``invals``: a quantized cache it reads decoded to its
    float buffer; for a custom_jvp/custom_vjp call, NumPy constants made JAX arrays
    (:func:`as_jax`) and its own rule run under :func:`user_rule`."""
    if any(kvcache.is_cache(x) for x in invals):  # a quantized cache read as a float
        invals = kvcache.materialize(invals, eqn.invars)
    if eqn.primitive.name in CUSTOM_RULES:  # f's NumPy constants, which its rule may index
        invals = as_jax(invals)  # with a traced index
    with user_rule(eqn):  # a custom_jvp/vjp's own rule, under a transformation
        return compat.bind_eqn(eqn, invals)


def as_jax(invals) -> list:
    """A custom_jvp/custom_vjp function's inputs with NumPy arrays made JAX arrays: an
    array constant of ``f`` (a time grid written in ``f``) reaches the interpreter as the
    jaxpr's NumPy constant, where the ``jax.jit`` jqt inlined (``odeint`` wraps its
    custom_vjp in one) gave the rule a JAX array; the user's rule then indexes it with a
    traced index (``odeint``'s backward pass, ``ts[i]``), which NumPy cannot.

    >>> [type(v).__name__ for v in as_jax([np.zeros(2), 1.0])]
    ['ArrayImpl', 'float']
    """
    return [jnp.asarray(v) if isinstance(v, (np.ndarray, np.generic)) else v for v in invals]


@contextlib.contextmanager
def body_transpose(eqn, kind="custom_vjp"):
    """The derivative of a custom_vjp (custom_jvp) function's quantized body, for the
    gradient of its quantization state: JAX has no reverse pass through a ``while_loop``
    and differentiates no host callback (the user's rule is what made the function
    differentiable). Name the function and the fix."""
    try:
        yield
    except ValueError as e:
        loop = "Reverse-mode differentiation does not work for lax.while_loop" in str(e)
        if not loop and "callbacks do not support JVP" not in str(e):
            raise
        what = ("a lax.while_loop (Equinox's checkpointed while_loop, diffrax's adjoint), which "
                "JAX cannot differentiate in reverse mode" if loop else
                "a host callback (jax.pure_callback, io_callback), which JAX cannot differentiate")
        raise TypeError(
            f"jqt: the qparams of the quantized ops inside the {kind} function "
            f"{compat.where_called(eqn)} cannot be differentiated: its body runs {what}, and "
            "the function's own rule covers its inputs, not jqt's scales (jqt differentiates "
            "the body for those). Differentiate the weights and inputs only, with the "
            "qparams frozen: jqt.qat.split(params, qparams, train='weights').") from e


CUSTOM_RULES = ("custom_jvp_call", "custom_vjp_call")


@contextlib.contextmanager
def user_rule(eqn):
    """Runs (or re-binds) an equation; a custom_jvp/custom_vjp function's own derivative
    rule may run in it. A rule that captured a value of f's trace (a nondiff_argnums
    argument, a closure over a parameter) refers to a tracer of the trace jqt made f's jaxpr
    with, which is gone: JAX raises UnexpectedTracerError from inside the rule. Name the
    function and the fix instead."""
    try:
        yield
    except jax.errors.UnexpectedTracerError as e:
        if eqn.primitive.name not in CUSTOM_RULES:
            raise
        body = sorted({q.primitive.name for q in eqn.params["call_jaxpr"].jaxpr.eqns})
        raise TypeError(
            f"jqt: the derivative rule of a {eqn.primitive.name.removesuffix('_call')} function "
            f"{compat.where_called(eqn)} (its body: {', '.join(body) or 'no ops'}) "
            "uses a value it captured when jqt traced f, through nondiff_argnums or a closure "
            "(over a parameter of f, or any array f computes). Differentiating "
            "the simulated path runs f's jaxpr again, and JAX cannot run such a rule outside the "
            "trace that made it (jax.core.eval_jaxpr cannot either). Pass that value to the "
            "function as a regular argument, or wrap the closure with jax.closure_convert.") from e


def _scan(eqn, invals, sub, ctx, evaluate):
    p = eqn.params
    nc, nk = compat.scan_counts(eqn)
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    sites = {s.key: s for pl in sub.plans for s in pl.all_sites()}
    stacked = {k for k, s in sites.items() if sub.stacked(s)}
    state = _state_for(sub, ctx)
    st_x = {k: v for k, v in state.items() if k in stacked}
    st_c = {k: v for k, v in state.items() if k not in stacked}
    kept = {}  # state kept whole and indexed in the body (the integer path's packed weights)
    split = getattr(ctx.handler, "split_stacked", None)
    if split is not None:
        for k in st_x:
            st_x[k], kept[k] = split(st_x[k])
    for k, v in st_x.items():  # one set of parameters (or statistics) per iteration
        shapes = [tuple(jnp.shape(x)) for x in jax.tree_util.tree_leaves(v)]
        if kept.get(k) is not None:
            shapes += kept[k].shapes()
        for shape in shapes:
            if not shape or shape[0] != p["length"]:
                stacked = stacked_hint(shape[0]) if len(shape) > 1 and shape[1] == p["length"] else ""
                raise QParamsMismatchError(
                    f"jqt: op '{k}' reads a weight that a lax.scan of length {p['length']} slices "
                    f"from stacked layers, so its parameters need a leading axis of {p['length']} "
                    f"(one set per layer), but one has shape {shape}. The "
                    f"qparams were made for other weights or edited; re-calibrate.{stacked}")
    j, c = closed_parts(p["jaxpr"])
    run = _runner(ctx, j, c, sub.plans[0], evaluate)
    init, entered = _enter_caches(sub, ctx, init)
    kept = {k: v for k, v in kept.items() if v is not None}
    index = jnp.arange(p["length"], dtype=jnp.int32) if kept else None  # xs: the layer

    def body(carry, x):
        xs_t, sx, layer = x
        sx = {k: ctx.handler.join_stacked(v, kept[k], layer) if k in kept else v
              for k, v in sx.items()}
        outs, so = run({**st_c, **sx}, *consts, *carry, *xs_t)
        return [kvcache.coerce(o, i) for o, i in zip(outs[:nk], carry)], (list(outs[nk:]), so)

    scanned = (list(xs), st_x, index)
    # the length comes from what is scanned over where there is any: under jax.export it
    # may be symbolic, which lax.scan's length= argument refuses
    length = None if jax.tree_util.tree_leaves(scanned) else p["length"]
    carry, (ys, st_out) = lax.scan(body, list(init), scanned, length=length,
                                   reverse=p["reverse"], unroll=p["unroll"])
    for k, v in st_out.items():
        ctx.put(k, v if k in stacked else ctx.handler.reduce_iterations({k: v})[k])
    return [*_leave_caches(carry, entered, eqn.outvars), *ys]


def _enter_caches(sub, ctx, init):
    """The loop's initial carries with its key/value caches in the handler's form (the
    integer path: a quantized :class:`jqt.QArray`); the slots this loop converted."""
    enter = getattr(ctx.handler, "enter_cache", None)
    init, entered = list(init), set()
    if enter is None:
        return init, entered
    for k, writes in sub.caches.items():
        qtype = kvcache.slot_type(writes, ctx.state_in)
        if qtype is not None:
            with compat.op_scope(writes[0], cache=True):
                x = enter(init[k], qtype)
            if kvcache.is_cache(x) and not kvcache.is_cache(init[k]):
                entered.add(k)
            init[k] = x
    return init, entered


def enter_call(plan, ctx, args, invars, name=str):
    """``f``'s flat arguments as the call runs on them, and the caches it entered (input
    index -> the cache): each key/value cache ``f`` takes and returns written
    (``Plan.boundary``: a decode step called from a Python loop) in the handler's form, as
    a loop enters its carried caches (a cache passed back quantized, as the integer path
    returned it, as it is); every other quantized cache decoded to its float buffer.
    ``name(k)``: how an error names flat argument ``k``."""
    enter = getattr(ctx.handler, "enter_cache", None)
    args, entered = list(args), {}
    for k, writes in dict(plan.boundary.values()).items():
        qtype = None if enter is None else kvcache.slot_type(writes, ctx.state_in)
        x = args[k]
        if qtype is None:
            if kvcache.is_cache(x) and getattr(ctx.handler, "returns_caches", False) and \
                    {kvcache.written_type(ctx.state_in.get(w)) for w in writes} == {None}:
                _float_cache(name(k), x.qtype, writes)
            continue
        if kvcache.is_cache(x) and x.qtype != qtype:
            _other_cache(name(k), x.qtype, writes, qtype)
        with compat.op_scope(writes[0], cache=True):
            args[k] = enter(x, qtype)
        if kvcache.is_cache(args[k]):
            entered[k] = args[k]
    for k, x in enumerate(args):  # decoded below: a loop that carries it checks its type
        if k not in entered and kvcache.is_cache(x):
            for writes in _carried_from(plan, k):
                types = {kvcache.written_type(ctx.state_in.get(w)) for w in writes}
                if len(types) == 1 and None not in types and x.qtype not in types:
                    _other_cache(name(k), x.qtype, writes, types.pop())
    return [x if k in entered else kvcache.materialize([x], [v])[0]
            for k, (x, v) in enumerate(zip(args, invars))], entered


def _carried_from(plan, k):
    """The writes (keys) of each loop cache that starts from ``f``'s flat argument ``k``
    (``Sub.passed``), through every level of ``plan``."""
    for sub in plan.subs.values():
        for slot, args in sub.passed.items():
            if k in args:
                yield sub.caches[slot]
        for p in sub.plans:
            yield from _carried_from(p, k)


def _other_cache(name, have, writes, qtype):
    """Refuses a quantized cache of another type than the one ``writes`` (the keys of the
    cache writes) put into it: made with other qparams."""
    have, want = have.contrast(qtype)
    raise QParamsMismatchError(
        f"jqt: argument {name} of f is a key/value cache of "
        f"{have}, where qparams['{writes[0]}'] write "
        f"{want} into it: the cache was made with other qparams. "
        "Pass the cache the same quantized function returned, or a float buffer; a loop "
        "around the step, whose carry starts quantized, starts it with "
        f"jqt.quantize_cache(buffer, {kvcache.kind_name(qtype)}).")


def _float_cache(name, have, writes):
    """Refuses a quantized cache passed, on the integer path, to a step whose qparams keep
    the cache it is written into float: the step would decode it and return it float (a
    decode step calibrated without ``kv_cache=``)."""
    raise QParamsMismatchError(
        f"jqt: argument {name} of f is a key/value cache of {have.describe()}, but "
        f"qparams['{writes[0]}'] keep the cache it writes float (calibrated without "
        "kv_cache=, or a rule that keeps it float): the quantized function would decode it "
        "and return it float, 4x its bytes or more. Calibrate this function with the "
        "kv_cache= the cache was made with (kv_cache=True: int8), or pass the float buffer, "
        "jqt.dequantize_cache(cache).")


def leave_call(plan, outs, entered, outvars):
    """``f``'s flat outputs: each cache it took quantized (``entered``) returned quantized,
    encoded again where a loop handed it back as float (the same codes: encoding a
    decoded cache changes nothing); every other quantized cache decoded."""
    like = {j: entered[k] for j, (k, _) in plan.boundary.items() if k in entered}
    return [kvcache.coerce(x, like[j]) if j in like else kvcache.materialize([x], [v])[0]
            for j, (x, v) in enumerate(zip(outs, outvars))]


def _leave_caches(carry, entered, outvars):
    """Caches this loop converted on entry, back to float for what follows the loop."""
    return [kvcache.decode(x, v.aval.dtype) if k in entered else x
            for k, (x, v) in enumerate(zip(carry, outvars))]


def _keep_finished(live, new, old):
    """``new`` where the lane is ``live`` (a predicate over the leading axes), else ``old``;
    a quantized cache's codes and scales alike."""
    nd = old.values.ndim if kvcache.is_cache(old) else jnp.ndim(old)
    live = live.reshape(live.shape + (1,) * (nd - live.ndim))
    return kvcache.pick(live, [old, new]) if kvcache.is_cache(old) else jnp.where(live, new, old)


def _while(eqn, invals, sub, ctx, evaluate):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cj, cc = closed_parts(p["cond_jaxpr"])
    bj, bc = closed_parts(p["body_jaxpr"])
    state = _state_for(sub, ctx)
    run = _runner(ctx, bj, bc, sub.plans[0], evaluate)
    init, entered = _enter_caches(sub, ctx, init)

    def pred(carry):
        return evaluate(cj, cc, [*cconsts, *carry], Plan(), ctx.child({}))[0]

    # jax.vmap of a loop whose stop depends on the lane leaves a while whose predicate is
    # batched (one per lane, over the carries' leading axes): it runs while any lane is
    # live, and a finished lane keeps its carry, as XLA lowers it. (A finished lane's body
    # still runs, so calibration observes it, as XLA computes it.)
    batched = bool(cj.outvars[0].aval.shape)
    cond_fn = (lambda carry: jnp.any(pred(carry))) if batched else pred

    def lanes(outs, carry):
        if not batched:
            return list(outs)
        live = pred(carry)
        return [_keep_finished(live, o, i) for o, i in zip(outs, carry)]

    if not ctx.handler.collects:
        def step(carry):
            return lanes([kvcache.coerce(o, i) for o, i in zip(run(state, *bconsts, *carry)[0], carry)], carry)
        return _leave_caches(lax.while_loop(cond_fn, step, list(init)), entered, eqn.outvars)
    lanes_axis = getattr(ctx.handler, "named_lanes", None)  # jqt.report's two lanes
    shapes, go_t = jax.eval_shape(lambda *a: (lambda o: (o[1], pred(list(o[0])) if lanes_axis else ()))(
        run(state, *bconsts, *a)), *init)
    st0 = _no_statistics(ctx, shapes)

    def body_fn(cs):
        carry, acc, n = cs
        outs, so = run(state, *bconsts, *carry)
        merged = ctx.handler.merge(acc, so)
        if lanes_axis:  # jqt.report: measured while both lanes (float, quantized) run; where
            # their trip counts differ (an adaptive step size), a finished lane's kept carry
            # is no iteration of its own to compare with (one example's, under f's vmap,
            # is measured with the others: the statistics sum over them)
            go = pred(carry)  # this lane's own iteration (per example, where f vmaps the loop)
            both = jnp.all(lax.all_gather(jnp.any(go), lanes_axis))
            merged = jax.tree_util.tree_map(lambda m, a: jnp.where(both, m, a), merged, acc)
            n = n + go.astype(jnp.int32)
        return lanes(outs, carry), merged, n

    # iterations per example, typed as the predicate varies inside shard_map (report only)
    n0 = compat.vary_like(jnp.zeros(go_t.shape, jnp.int32), go_t) if lanes_axis else ()
    carry, st_out, n = lax.while_loop(lambda cs: cond_fn(cs[0]), body_fn, (list(init), st0, n0))
    if lanes_axis:  # each op says whether the lanes ran other numbers of iterations
        trips = lax.all_gather(n, lanes_axis)
        differ = jnp.any(trips[0] != trips[1]).astype(jnp.float32)
        st_out = {k: {**v, "trips_differ_max": jnp.maximum(v.get("trips_differ_max", 0.0), differ)}
                  if isinstance(v, dict) else v for k, v in st_out.items()}
    ctx.put_all(st_out)
    return carry


def _no_statistics(ctx, shapes):
    """The handler's statistics of no data, shaped like ``shapes`` (``jax.eval_shape``'s)
    and, inside ``jax.shard_map``, typed as varying over the mesh axes they vary over
    (a while loop's carry and the branches of a cond must keep one type)."""
    return jax.tree_util.tree_map(compat.vary_like, ctx.handler.identity(shapes), shapes)


def _layer_split(site, shard_id):
    """The ``shard_split`` step of ``site``'s chain that the ``shard_map`` ``shard_id``
    made: the loops and shard_maps that stacked its weight, in order, each own one
    marker."""
    markers = [c for c in site.source.chain if c[0] == "scan_slice" or (c[0] == "shard_split" and c[1])]
    return markers[site.stack_ids.index(shard_id)][1]


def _materialized(entry):
    """An op's state with a layer view (an outer scan's packed weight read in place)
    replaced by its layer: what a ``shard_map`` can take as an operand."""
    if type(entry) is tuple:
        return tuple(_materialized(e) for e in entry)
    return entry.sliced if isinstance(entry, LayerView) else entry


def _restack(a, manual, sizes, splits):
    """A statistic each device returned, ``a`` with one leading axis per manual mesh axis,
    rearranged to ``(devices not splitting the weight, block per split axis, ...)``."""
    split_names = [n for _, _, names in splits for n in names]
    rest = [n for n in manual if n not in split_names]
    order = [manual.index(n) for n in rest + split_names]
    a = jnp.transpose(a, order + list(range(len(manual), a.ndim)))
    lead = (math.prod(sizes[n] for n in rest),) + tuple(b for _, b, _ in splits)
    return a.reshape(lead + a.shape[len(manual):])


def _shard_map(eqn, invals, sub, ctx, evaluate):
    """``jax.shard_map`` rebuilt around the interpreted body. An op whose weight the
    shard_map splits takes its state per block (a leading axis per split axis, split over
    the same mesh axes, which the body drops); other ops' state is replicated. Statistics
    come back from every device, one leading axis per manual mesh axis: an op's blocks
    keep theirs, and what the devices holding the same block saw is merged as a loop's
    iterations are."""
    if getattr(ctx.handler, "named_lanes", None):
        raise NotImplementedError(  # jqt.report says what to do instead
            f"ops {sub.keys[:4]}{' ...' if len(sub.keys) > 4 else ''} run inside a jax.shard_map, "
            "and JAX does not carry a collective over the lanes' named axis into its body")
    sites = {s.key: s for pl in sub.plans for s in pl.all_sites()}
    manual = compat.shard_map_axes(eqn)
    sizes = eqn.params["mesh"].shape
    splits = {k: _layer_split(s, sub.scan_id) if sub.stacked(s) else () for k, s in sites.items()}
    state, specs = {}, {}
    for k, v in _state_for(sub, ctx).items():
        state[k] = _materialized(v)
        specs[k] = P(*[names for _, _, names in splits[k]])
        for leaf in jax.tree_util.tree_leaves(state[k]):
            lead = tuple(jnp.shape(leaf)[:len(splits[k])])
            if lead != tuple(b for _, b, _ in splits[k]):
                raise QParamsMismatchError(
                    f"jqt: op '{k}' reads a weight that a jax.shard_map splits into blocks "
                    f"{[b for _, b, _ in splits[k]]} over mesh axes "
                    f"{[n for _, _, n in splits[k]]}, so its parameters need those leading axes "
                    f"(one set per block), but one has shape {jnp.shape(leaf)}. The qparams "
                    "were made for another function or mesh; re-calibrate.")
    run = _runner(ctx, eqn.params["jaxpr"], (), sub.plans[0], evaluate)
    collects = ctx.handler.collects

    def body(args, st):
        st = {k: jax.tree_util.tree_map(lambda a, n=len(splits[k]): a.reshape(a.shape[n:]), v)
              for k, v in st.items()}
        outs, so = run(st, *args)
        if not collects:
            return list(outs), {}
        return list(outs), jax.tree_util.tree_map(lambda a: a.reshape((1,) * len(manual) + a.shape), so)

    outs, st_out = compat.shard_map_bind(
        eqn, body, (list(invals), state), (list(eqn.params["in_specs"]), specs),
        (list(eqn.params["out_specs"]), P(*manual)))
    for k, v in st_out.items():
        v = jax.tree_util.tree_map(lambda a, k=k: _restack(compat.whole(a), manual, sizes, splits[k]), v)
        ctx.put(k, ctx.handler.reduce_iterations({k: v})[k])
    return outs


def _cond(eqn, invals, sub, ctx, evaluate):
    index, ops = invals[0], invals[1:]
    state = _state_for(sub, ctx)
    runs = [_runner(ctx, *closed_parts(b), pl, evaluate)
            for b, pl in zip(eqn.params["branches"], sub.plans)]
    if not ctx.handler.collects:
        return lax.switch(index, [lambda *a, r=r: list(r(state, *a)[0]) for r in runs], *ops)
    # Every branch returns the state of every op under the cond; a branch that
    # does not hold an op returns the handler's identity for it, so the branch
    # that did not run leaves no trace in the statistics.
    shapes = [jax.eval_shape(lambda *a, r=r: r(state, *a)[1], *ops) for r in runs]
    union = {}
    for s in shapes:
        union.update(s)

    def branch(r):
        def fn(*a):
            outs, so = r(state, *a)
            full = {k: so[k] if k in so else _no_statistics(ctx, {k: union[k]})[k] for k in union}
            return list(outs), full
        return fn

    outs, st_out = lax.switch(index, [branch(r) for r in runs], *ops)
    lanes_axis = getattr(ctx.handler, "named_lanes", None)  # jqt.report's two lanes
    if lanes_axis:  # each op under it says whether the lanes took other branches
        picked = lax.all_gather(index, lanes_axis)
        differ = jnp.any(picked[0] != picked[1]).astype(jnp.float32)
        st_out = {k: {**v, "branch_differs_max": jnp.maximum(v.get("branch_differs_max", 0.0), differ)}
                  if isinstance(v, dict) else v for k, v in st_out.items()}
    ctx.put_all(st_out)
    return outs


HIGHER_ORDER = {
    compat.jit_p: Hop(_same("jaxpr"), _inline("jaxpr"), transparent=True),
    compat.closed_call_p: Hop(_same("call_jaxpr"), _inline("call_jaxpr"), transparent=True),
    compat.call_p: Hop(_same("call_jaxpr"), _inline("call_jaxpr"), transparent=True),
    compat.remat_p: Hop(_same("jaxpr"), _remat, transparent=True),
    compat.custom_jvp_call_p: Hop(_same("call_jaxpr"), _custom_jvp, transparent=True),
    compat.custom_vjp_call_p: Hop(_same("call_jaxpr"), _custom_vjp, transparent=True),
    compat.scan_p: Hop(_scan_subs, _scan, outs=_scan_outs),
    compat.while_p: Hop(_while_subs, _while, outs=_while_outs),
    compat.cond_p: Hop(_cond_subs, _cond, outs=_cond_outs),
}
if compat.shard_map_p is not None:
    HIGHER_ORDER[compat.shard_map_p] = Hop(_shard_map_subs, _shard_map, outs=_shard_map_outs)
"""Higher-order primitive -> :class:`Hop`; a primitive not listed is re-bound unchanged."""
