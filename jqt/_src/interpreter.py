"""The jaxpr interpreter: one evaluation loop and a rules table keyed by primitive.

``eval_jaxpr`` walks a jaxpr with the :class:`~jqt._src.analysis.Plan` built
for it. A quantizable op is handed to the *handler* of the current mode
(calibrate, simulate or integer; see ``handlers.py``). A higher-order
primitive that holds quantizable ops is rebuilt through JAX's public API by
its rule in ``RULES``, keyed by primitive name (``lax.scan``, ``lax.while_loop``, ``lax.switch``,
``jax.checkpoint``, ``jax.custom_jvp``/``custom_vjp``), threading per-op
state through it. Everything else (the documented default) is re-bound
unchanged, so float behaviour and custom derivative rules are kept.

Per-op state: ``ctx.state_in[key]`` is what a handler reads for the op with
that key (quantization parameters, packed weights) and ``ctx.state_out[key]``
what it writes (calibration statistics). Under ``lax.scan`` the state of an
op whose weight is sliced from a stacked leaf travels as ``xs``/``ys``
(stacked ``(L, ...)``); the state of other ops is shared by all iterations
and its outputs are reduced across iterations by the handler.
"""
from __future__ import annotations

import dataclasses

import jax
from jax import lax

from . import compat
from .analysis import Plan, closed_parts


@dataclasses.dataclass
class Ctx:
    handler: object
    state_in: dict
    state_out: dict = dataclasses.field(default_factory=dict)

    def child(self, state_in):
        return Ctx(self.handler, state_in)


def eval_jaxpr(jaxpr, consts, args, plan, ctx):
    env = {}

    def read(v):
        return v.val if compat.is_literal(v) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        if i in plan.sites:
            outs = ctx.handler.site(plan.sites[i], eqn, invals, ctx)
        elif i in plan.subs:
            outs = RULES[eqn.primitive.name](eqn, invals, plan.subs[i], ctx)
        else:
            outs = compat.bind_eqn(eqn, invals)
        for v, x in zip(eqn.outvars, outs):
            if not compat.is_dropvar(v):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _state_for(sub, ctx):
    return {k: ctx.state_in[k] for k in sub.keys if k in ctx.state_in}


def _run(ctx, jaxpr, consts, plan):
    """A function (state, *args) -> (outs, state_out) that interprets ``jaxpr``."""
    def run(state, *args):
        c = ctx.child(state)
        outs = eval_jaxpr(jaxpr, consts, args, plan, c)
        return outs, c.state_out
    return run


def _inline(param):
    def rule(eqn, invals, sub, ctx):
        j, c = closed_parts(eqn.params[param])
        return eval_jaxpr(j, c, invals, sub.plans[0], ctx)
    return rule


def _remat(eqn, invals, sub, ctx):
    if not ctx.handler.differentiable:
        return _inline("jaxpr")(eqn, invals, sub, ctx)
    j, c = closed_parts(eqn.params["jaxpr"])
    fn = jax.checkpoint(_run(ctx, j, c, sub.plans[0]), prevent_cse=eqn.params["prevent_cse"],
                        policy=eqn.params["policy"])
    outs, state_out = fn(_state_for(sub, ctx), *invals)
    ctx.state_out.update(state_out)
    return outs


def _custom_jvp(eqn, invals, sub, ctx):
    """Simulated path: quantized forward; tangents = the user's rule (w.r.t. the
    inputs) + autodiff of the quantized body (w.r.t. the quantization state)."""
    if not ctx.handler.differentiable:
        return _inline("call_jaxpr")(eqn, invals, sub, ctx)
    j, c = closed_parts(eqn.params["call_jaxpr"])
    run = _run(ctx, j, c, sub.plans[0])
    fwd = lambda st, *a: run(st, *a)[0]
    g = jax.custom_jvp(fwd)

    def g_jvp(primals, tangents):
        st, *args = primals
        tst, *targs = tangents
        out = g(st, *args)
        _, t_user = jax.jvp(lambda *a: compat.bind_eqn(eqn, a), tuple(args), tuple(targs))
        _, t_st = jax.jvp(lambda s: fwd(s, *args), (st,), (tst,))
        return out, [u + s for u, s in zip(t_user, t_st)]

    g.defjvp(g_jvp)
    return g(_state_for(sub, ctx), *invals)


def _custom_vjp(eqn, invals, sub, ctx):
    """Simulated path: quantized forward; cotangents = the user's bwd rule (w.r.t.
    the inputs) + autodiff of the quantized body (w.r.t. the quantization state)."""
    if not ctx.handler.differentiable:
        return _inline("call_jaxpr")(eqn, invals, sub, ctx)
    j, c = closed_parts(eqn.params["call_jaxpr"])
    run = _run(ctx, j, c, sub.plans[0])
    fwd_fn = lambda st, *a: run(st, *a)[0]
    g = jax.custom_vjp(fwd_fn)

    def g_fwd(st, *args):
        out, vjp_st = jax.vjp(lambda s: fwd_fn(s, *args), st)
        _, vjp_user = jax.vjp(lambda *a: compat.bind_eqn(eqn, a), *args)
        return out, (vjp_st, vjp_user)

    def g_bwd(res, ct):
        vjp_st, vjp_user = res
        return (*vjp_st(ct), *vjp_user(ct))

    g.defvjp(g_fwd, g_bwd)
    return g(_state_for(sub, ctx), *invals)


def _scan(eqn, invals, sub, ctx):
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
    sites = {s.key: s for pl in sub.plans for s in pl.all_sites()}
    stacked = {k for k, s in sites.items() if sub.stacked(s)}
    state = _state_for(sub, ctx)
    st_x = {k: v for k, v in state.items() if k in stacked}
    st_c = {k: v for k, v in state.items() if k not in stacked}
    j, c = closed_parts(p["jaxpr"])
    run = _run(ctx, j, c, sub.plans[0])

    def body(carry, x):
        xs_t, sx = x
        outs, so = run({**st_c, **sx}, *consts, *carry, *xs_t)
        return list(outs[:nk]), (list(outs[nk:]), so)

    carry, (ys, st_out) = lax.scan(body, list(init), (list(xs), st_x), length=p["length"],
                                   reverse=p["reverse"], unroll=p["unroll"])
    for k, v in st_out.items():
        ctx.state_out[k] = v if k in stacked else ctx.handler.reduce_iterations({k: v})[k]
    return [*carry, *ys]


def _while(eqn, invals, sub, ctx):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:cn], invals[cn:cn + bn], invals[cn + bn:]
    cj, cc = closed_parts(p["cond_jaxpr"])
    bj, bc = closed_parts(p["body_jaxpr"])
    state = _state_for(sub, ctx)
    run = _run(ctx, bj, bc, sub.plans[0])

    def cond_fn(carry):
        return eval_jaxpr(cj, cc, [*cconsts, *carry], Plan(), ctx.child({}))[0]

    if not ctx.handler.collects:
        return lax.while_loop(cond_fn, lambda carry: list(run(state, *bconsts, *carry)[0]), list(init))
    shapes = jax.eval_shape(lambda *a: run(state, *bconsts, *a)[1], *init)
    st0 = ctx.handler.identity(shapes)

    def body_fn(cs):
        carry, acc = cs
        outs, so = run(state, *bconsts, *carry)
        return list(outs), ctx.handler.merge(acc, so)

    carry, st_out = lax.while_loop(lambda cs: cond_fn(cs[0]), body_fn, (list(init), st0))
    ctx.state_out.update(st_out)
    return carry


def _cond(eqn, invals, sub, ctx):
    index, ops = invals[0], invals[1:]
    state = _state_for(sub, ctx)
    runs = [_run(ctx, *closed_parts(b), pl) for b, pl in zip(eqn.params["branches"], sub.plans)]
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
            full = {k: so[k] if k in so else ctx.handler.identity({k: union[k]})[k] for k in union}
            return list(outs), full
        return fn

    outs, st_out = lax.switch(index, [branch(r) for r in runs], *ops)
    ctx.state_out.update(st_out)
    return outs


RULES = {
    "jit": _inline("jaxpr"),
    "pjit": _inline("jaxpr"),
    "closed_call": _inline("call_jaxpr"),
    "core_call": _inline("call_jaxpr"),
    "remat2": _remat,
    "checkpoint": _remat,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
