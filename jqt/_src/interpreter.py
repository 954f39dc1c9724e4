"""The jaxpr interpreter: one evaluation loop over two tables keyed by primitive.

``eval_jaxpr`` walks a jaxpr with the :class:`~jqt._src.plan.Plan` built for it.
A quantizable op (an entry of ``registry.OPS``) is handed to the *handler* of
the current mode (calibrate, simulate, integer, report; see ``handlers.py``),
which applies the entry's rule for that mode. A higher-order primitive that
holds quantizable ops is rebuilt by its entry in ``hops.HIGHER_ORDER``.
Everything else (the documented default) is re-bound unchanged, so float
behaviour and custom derivative rules are kept; a quantized key/value cache
(``kvcache.py``) reaching such an equation is decoded to its float buffer.

Per-op state: ``ctx.state_in[key]`` is what a handler reads for the op with
that key (quantization parameters, packed weights) and ``ctx.state_out[key]``
what it writes (calibration statistics). Under ``lax.scan`` the state of an
op whose weight is sliced from a stacked leaf travels as ``xs``/``ys``
(stacked ``(L, ...)``); the state of other ops is shared by all iterations
and its outputs are reduced across iterations by the handler. Nested loops
compose: an op under a loop over steps that holds a scan over stacked layers
has statistics stacked by the inner scan, reduced over the outer steps (one
set per layer); an op whose weight every loop closes over has one set.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import compat, kvcache
from .hops import HIGHER_ORDER, bind_as_is
from .layerview import LayerView


@dataclasses.dataclass
class Ctx:
    handler: object
    state_in: dict
    state_out: dict = dataclasses.field(default_factory=dict)
    # the keys of ops whose weight jqt.pack dropped (its leaf reaches f as zeros)
    dropped: frozenset = frozenset()

    def child(self, state_in):
        return Ctx(self.handler, state_in, dropped=self.dropped)

    def put(self, key, value):
        """Writes op ``key``'s state. A second write for the same key (the ops of a
        ``lax.map`` remainder share the keys of the map's body, ``analysis.py``) is
        merged with the first by the handler's ``merge``."""
        if key in self.state_out:
            value = self.handler.merge({key: self.state_out[key]}, {key: value})[key]
        self.state_out[key] = value

    def put_all(self, states):
        for k, v in states.items():
            self.put(k, v)


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
            site = plan.sites[i]
            # a literal operand (jnp.dot(x, 2.0)) as the array jax.jit makes of it
            invals = [_constant(v) if compat.is_literal(v) else x for v, x in zip(eqn.invars, invals)]
            with compat.eqn_scope(eqn) as e:  # the rule's ops keep the op's named scope
                outs = _under_eqn_mesh(e, [site.key], ctx,
                                       lambda c, site=site: ctx.handler.site(site, e, invals, c))
            outs = [_weak_as(v, x) for v, x in zip(eqn.outvars, outs)]
        elif i in plan.subs:
            sub = plan.subs[i]
            with compat.eqn_scope(eqn) as e:
                outs = _under_eqn_mesh(e, sub.keys, ctx, lambda c, sub=sub: HIGHER_ORDER[e.primitive].run(
                    e, invals, sub, c, eval_jaxpr))
        elif invals and kvcache.is_cache(invals[0]) and (kvcache.is_read_view(eqn)
                                                         or kvcache.is_buffer_view(eqn)):
            outs = [kvcache.view(eqn, invals)]  # whole vectors of it (permuted), still quantized
        elif kvcache.is_plain_copy(eqn) and any(kvcache.is_cache(x) for x in invals):
            outs = kvcache.copy(eqn, invals)  # the same values: a cache stays quantized
        elif i in plan.cache_selects and any(kvcache.is_cache(x) for x in invals[1:]):
            outs = kvcache.select(eqn, invals, plan.cache_selects[i])  # whole vectors of the
            # same cache, or zero vectors
        else:
            outs = bind_as_is(eqn, invals)
        for v, x in zip(eqn.outvars, outs):
            if not compat.is_dropvar(v):
                env[v] = x
    # a constant output is a jax.Array, as under jax.jit (not the jaxpr's literal object)
    return [_constant(v) if compat.is_literal(v) else env[v] for v in jaxpr.outvars]


def _under_eqn_mesh(eqn, keys, ctx, run):
    """``run(ctx)``: a quantizable op's rule, or a higher-order primitive rebuilt. An
    equation JAX traced under another mesh than the function's (an ``auto_axes`` region:
    ``table.at[ids].get(out_sharding=...)`` on explicit axes reads its table in one) runs
    under that mesh: the state of ``keys`` is retyped onto it, and the statistics written
    back onto the function's mesh."""
    mesh, current = compat.eqn_mesh(eqn), compat.current_mesh()
    if mesh is None or mesh == current or not mesh.axis_names or not current.axis_names:
        return run(ctx)  # a jaxpr traced under a mesh and run without one runs as it is
    with compat.eqn_context(eqn):
        moved = {k: _retyped(ctx.state_in[k]) for k in keys if k in ctx.state_in}
        inner = ctx.child({**ctx.state_in, **moved})
        outs = run(inner)
    ctx.put_all(compat.to_current_mesh(inner.state_out))
    return outs


def _retyped(state):
    """``state`` (an op's qparams and packed weight, or a stacked layer's view of it) with
    its arrays retyped onto the current mesh."""
    if type(state) is tuple:
        return tuple(_retyped(s) for s in state)
    if isinstance(state, LayerView):
        return LayerView(compat.to_current_mesh(state.full), compat.to_current_mesh(state.index))
    return compat.to_current_mesh(state)


def _weak_as(var, x):
    """A site's output ``x`` weakly typed where ``f``'s is (a weak input times a weak
    weight): the rules compute strong arrays, and a strong float32 would promote the
    bfloat16 values it meets later."""
    if var.aval.weak_type and isinstance(x, jax.Array) and x.dtype == var.aval.dtype \
            and not compat.is_weak(x):
        return compat.weak_typed(x)
    return x


def _constant(lit):
    """A literal output as the array ``jax.jit`` returns for it (weak-typed for a
    Python scalar)."""
    x = jnp.asarray(lit.val) if lit.aval.weak_type else jnp.asarray(lit.val, lit.aval.dtype)
    return x if x.dtype == lit.aval.dtype else jnp.asarray(lit.val, lit.aval.dtype)
