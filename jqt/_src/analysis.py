"""Static analysis of a jaxpr: which values are weights, where quantizable ops
are, and the stable key of each.

A value is a *weight* when it depends only on the weight argument(s) and
constants. A quantizable op (an entry of ``registry.OPS``) with a weight
operand is keyed by the pytree path of the weight leaf it reads
(``params/Dense_0/kernel``); an op whose operands both depend on data gets
``<name stack>/<primitive>_<n>``. The walk recurses into the higher-order
primitives of ``hops.HIGHER_ORDER``; the result is a :class:`~jqt._src.plan.Plan`
tree that mirrors the jaxpr, which the interpreter follows.
"""
from __future__ import annotations

import dataclasses
import warnings

from . import compat, layout
from .hops import HIGHER_ORDER
from .plan import CONST, DATA, Plan, Site, Sub, VarInfo  # noqa: F401  (DATA: used by tracing)
from .registry import OPS


def _contains_quantizable(jaxpr) -> bool:
    for e in jaxpr.eqns:
        entry = OPS.get(e.primitive)
        if entry is not None and not entry.needs_weight:
            return True
        for sub in compat.jaxprs_in_params(e.params):
            if _contains_quantizable(sub):
                return True
    return False


def _join(prefix, stack):
    if not prefix:
        return stack
    if not stack or stack.startswith(prefix):
        return stack or prefix
    return f"{prefix}/{stack}"


class Analyzer:
    """Walks a closed jaxpr once and builds its :class:`Plan`.

    ``leaf_uses`` maps ``(arg, path)`` of each weight leaf to the site keys
    that read it as a weight operand, plus ``"float"`` when it is also read as
    a float value elsewhere.
    """

    def __init__(self):
        self.counters: dict[str, int] = {}
        self.used_keys: set[str] = set()
        self.leaf_uses: dict[tuple, set] = {}
        self.scan_ids = 0
        self.warned: list[str] = []
        self.reads: set = set()  # (loop id, slot) of carried buffers read by some op

    def _use(self, info, what):
        if info.source is not None:
            self.leaf_uses.setdefault((info.source.arg, info.source.path), set()).add(what)

    def _key(self, base):
        if base not in self.used_keys:
            self.used_keys.add(base)
            return base
        n = self.counters.get(base, 0) + 1
        while f"{base}#{n}" in self.used_keys:
            n += 1
        self.counters[base] = n
        self.used_keys.add(f"{base}#{n}")
        return f"{base}#{n}"

    def _fallback_key(self, stack, op):
        base = f"{stack}/{op}" if stack else op
        n = self.counters.get("\0" + base, 0)
        self.counters["\0" + base] = n + 1
        return self._key(f"{base}_{n}")

    def analyze(self, jaxpr, infos, prefix="", top=False):
        """Returns (plan, out infos)."""
        env = {}
        for v, info in zip(jaxpr.invars, infos):
            env[v] = info
        for v in jaxpr.constvars:
            env[v] = CONST

        def read(v):
            return CONST if compat.is_literal(v) else env[v]

        plan = Plan()
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            stack = _join(prefix, compat.name_stack(eqn))
            outs = None
            entry = OPS.get(eqn.primitive)
            cache_write = entry is not None and entry.is_cache and entry.is_site(eqn, ins)
            if not cache_write and eqn.primitive not in HIGHER_ORDER:
                for info in ins:  # a loop body's reads (loops: inside their bodies)
                    self.reads.update(info.buffer)
            if entry is not None and entry.is_site(eqn, ins):
                site = plan.sites[i] = self._site(entry, entry.weight_operand(eqn, ins), eqn, ins, stack)
                if entry.is_cache:  # the buffer after the write: still the loop's buffer
                    outs = [VarInfo(False, buffer=ins[0].buffer, writes=ins[0].writes + (site.key,))]
            elif eqn.primitive in HIGHER_ORDER:
                outs = self._hop(plan, i, eqn, ins, stack)
            else:
                step = layout.record(eqn)
                if step is not None and len(ins) == 1 and ins[0].source is not None:
                    s = ins[0].source
                    outs = [VarInfo(True, dataclasses.replace(s, chain=s.chain + (step,)), ins[0].stack_ids)]
                else:
                    for info in ins:
                        self._use(info, "float")
                    if any(_contains_quantizable(j) for j in compat.jaxprs_in_params(eqn.params)):
                        msg = (f"jqt: primitive '{name}' (at '{stack or '<top>'}') holds dot_general/conv "
                               "ops that jqt cannot rewrite; they stay float.")
                        warnings.warn(msg, stacklevel=4)
                        self.warned.append(msg)
            if outs is None:
                w = all(info.weight for info in ins)
                outs = [VarInfo(w)] * len(eqn.outvars)
            for v, info in zip(eqn.outvars, outs):
                if not compat.is_dropvar(v):
                    env[v] = info
        out_infos = [read(v) for v in jaxpr.outvars]
        if top:
            for info in out_infos:
                self._use(info, "float")
            _prune_writes(plan, _cache_keys(plan))
        return plan, out_infos

    def _site(self, entry, widx, eqn, ins, stack):
        op = entry.name
        src = ins[widx].source if widx is not None else None
        for k in range(len(ins)):
            if k != widx:
                self._use(ins[k], "float")
        key = self._key(src.path) if src is not None else \
            self._fallback_key(stack, "kv_cache" if entry.is_cache else op)
        if src is not None:
            self._use(ins[widx], key)
        return Site(key=key, op=op, eqn=eqn, weight_operand=widx, source=src,
                    stack_ids=ins[widx].stack_ids if widx is not None else (),
                    contract=entry.contract(eqn), entry=entry)

    def _hop(self, plan, i, eqn, ins, stack):
        name = eqn.primitive.name
        hop = HIGHER_ORDER[eqn.primitive]
        scan_id = -1
        if name in ("scan", "while"):  # a loop's id: its carries are buffers (loop id, slot)
            self.scan_ids += 1
            scan_id = self.scan_ids
        subs = hop.subs(eqn, ins, scan_id)
        if name == "while":
            if _contains_quantizable(eqn.params["cond_jaxpr"].jaxpr):
                warnings.warn(f"jqt: the cond_fun of a while_loop at '{stack or '<top>'}' holds a "
                              "dot_general/conv; jqt leaves it float.", stacklevel=4)
        if name == "scan":  # carries are data inside; a weight carried in is a float use
            p = eqn.params
            for info in ins[p["num_consts"]:p["num_consts"] + p["num_carry"]]:
                self._use(info, "float")
        if name == "while":
            p = eqn.params
            for info in ins[:p["cond_nconsts"]] + ins[p["cond_nconsts"] + p["body_nconsts"]:]:
                self._use(info, "float")
        plans, outs, body_outs = [], None, []
        for j, _, inner in subs:
            sub_plan, sub_outs = self.analyze(j, inner, stack)
            plans.append(sub_plan)
            body_outs.append(sub_outs)
            if hop.transparent:
                outs = sub_outs
            else:
                for info in sub_outs:
                    self._use(info, "float")
        caches = {}
        if hop.outs is not None:
            found, caches = hop.outs(eqn, ins, body_outs, scan_id, self.reads)
            default = VarInfo(all(info.weight for info in ins))
            outs = [default if o is None else o for o in found]
        keys = [s.key for p in plans for s in p.all_sites()]
        if keys:
            plan.subs[i] = Sub(kind=name, plans=plans, keys=keys, scan_id=scan_id, caches=caches)
        return outs


def _cache_keys(plan) -> set:
    keys = set()
    for sub in plan.subs.values():
        for writes in sub.caches.values():
            keys.update(writes)
        for p in sub.plans:
            keys |= _cache_keys(p)
    return keys


def _prune_writes(plan, caches):
    """Drops the writes into carried buffers that no loop keeps as a cache (written but
    never read: collected outputs); they run unchanged."""
    for i, site in list(plan.sites.items()):
        if site.entry.is_cache and site.key not in caches:
            del plan.sites[i]
    for i, sub in list(plan.subs.items()):
        for p in sub.plans:
            _prune_writes(p, caches)
        sub.keys = [k for p in sub.plans for k in (s.key for s in p.all_sites())]
        if not sub.keys:
            del plan.subs[i]


def path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)
