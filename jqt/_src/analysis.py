"""Static analysis of a jaxpr: which values are weights, where quantizable ops
are, and the stable key of each.

A value is a *weight* when it depends only on the weight argument(s) and
constants. A quantizable op (``dot_general``, ``conv_general_dilated``) with
a weight operand is keyed by the pytree path of the weight leaf it reads
(``params/Dense_0/kernel``); an op whose operands both depend on data gets
``<name stack>/<primitive>_<n>``. The walk recurses into the higher-order
primitives listed in ``SUBJAXPRS``; the result is a :class:`Plan` tree that
mirrors the jaxpr, which the interpreter follows.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

from . import compat, layout
from .qparams import WeightSource

QUANTIZABLE = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True)
class VarInfo:
    weight: bool                          # independent of the data arguments
    source: Optional[WeightSource] = None  # leaf + layout chain, if any
    stack_ids: tuple = ()                  # scans that sliced it from a stacked leaf


DATA = VarInfo(False)
CONST = VarInfo(True)


@dataclasses.dataclass
class Site:
    """One quantizable op."""

    key: str
    op: str
    eqn: object
    weight_operand: Optional[int]
    source: Optional[WeightSource]
    stack_ids: tuple
    contract: tuple  # per operand: the axes reduced by the op

    @property
    def name_stack(self):
        return compat.name_stack(self.eqn)

    def batch_axes(self) -> tuple:
        """The weight operand's ``dot_general`` batch axes."""
        if self.op != "dot_general" or self.weight_operand is None:
            return ()
        return tuple(self.eqn.params["dimension_numbers"][1][self.weight_operand])


@dataclasses.dataclass
class Sub:
    """The sub-jaxprs of one higher-order equation, analysed."""

    kind: str
    plans: list
    keys: list            # every site key below this equation
    scan_id: int = -1

    def stacked(self, site: Site) -> bool:
        return self.scan_id in site.stack_ids


@dataclasses.dataclass
class Plan:
    sites: dict = dataclasses.field(default_factory=dict)  # eqn index -> Site
    subs: dict = dataclasses.field(default_factory=dict)   # eqn index -> Sub

    def all_sites(self):
        """Every site, nested ones included, in evaluation order."""
        for i in sorted({*self.sites, *self.subs}):
            if i in self.sites:
                yield self.sites[i]
            else:
                for p in self.subs[i].plans:
                    yield from p.all_sites()


def closed_parts(j):
    """(jaxpr, consts) of a ClosedJaxpr or an open Jaxpr."""
    return (j.jaxpr, j.consts) if hasattr(j, "consts") else (j, ())


# How each higher-order primitive maps its operands to the invars of its
# sub-jaxprs: a function (eqn, infos, new_scan_id) -> list of (jaxpr, consts,
# inner infos). Primitives not listed are re-bound unchanged.
def _same(param):
    def f(eqn, infos, _):
        j, c = closed_parts(eqn.params[param])
        return [(j, c, list(infos))]
    return f


def _scan_subs(eqn, infos, scan_id):
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    inner = list(infos[:nc]) + [DATA] * nk
    for info in infos[nc + nk:]:
        if info.source is not None:
            s = info.source
            info = VarInfo(info.weight, dataclasses.replace(s, chain=s.chain + (("scan_slice",),)),
                           info.stack_ids + (scan_id,))
        inner.append(info)
    j, c = closed_parts(p["jaxpr"])
    return [(j, c, inner)]


def _while_subs(eqn, infos, _):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    n_carry = len(infos) - cn - bn
    j, c = closed_parts(p["body_jaxpr"])
    return [(j, c, list(infos[cn:cn + bn]) + [DATA] * n_carry)]


def _cond_subs(eqn, infos, _):
    return [(*closed_parts(b), list(infos[1:])) for b in eqn.params["branches"]]


SUBJAXPRS = {
    "jit": _same("jaxpr"),
    "pjit": _same("jaxpr"),
    "closed_call": _same("call_jaxpr"),
    "core_call": _same("call_jaxpr"),
    "remat2": _same("jaxpr"),
    "checkpoint": _same("jaxpr"),
    "custom_jvp_call": _same("call_jaxpr"),
    "custom_vjp_call": _same("call_jaxpr"),
    "scan": _scan_subs,
    "while": _while_subs,
    "cond": _cond_subs,
}
# Sub-jaxprs whose outputs are the equation's outputs one for one (sources pass through).
_TRANSPARENT = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint",
                "custom_jvp_call", "custom_vjp_call"}


def _contains_quantizable(jaxpr) -> bool:
    for e in jaxpr.eqns:
        if e.primitive.name in QUANTIZABLE:
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


def _contract_axes(eqn, ndims):
    if eqn.primitive.name == "dot_general":
        (lc, rc), _ = eqn.params["dimension_numbers"]
        return (tuple(lc), tuple(rc))
    dn = eqn.params["dimension_numbers"]
    lhs_spec, rhs_spec = dn.lhs_spec, dn.rhs_spec
    # a conv's activation scale may vary only along the batch axis (per example);
    # its weight scale along the output features.
    return (tuple(d for d in range(ndims[0]) if d != lhs_spec[0]),
            tuple(d for d in range(ndims[1]) if d != rhs_spec[0]))


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
            if name in QUANTIZABLE:
                plan.sites[i] = self._site(eqn, ins, stack)
            elif name in SUBJAXPRS:
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
        return plan, out_infos

    def _site(self, eqn, ins, stack):
        op = eqn.primitive.name
        w_ops = [k for k in (0, 1) if ins[k].weight]
        if len(w_ops) == 2:  # both constant: treat the second (rhs) as the weight
            w_ops = [1]
        widx = w_ops[0] if w_ops else None
        if op == "conv_general_dilated" and widx == 0:
            widx = None  # a conv with a constant input and data kernel: act x act
        src = ins[widx].source if widx is not None else None
        for k in (0, 1):
            if k != widx:
                self._use(ins[k], "float")
        if src is not None:
            base = src.path
            key = self._key(base)
        else:
            key = self._fallback_key(stack, op)
        if src is not None:
            self._use(ins[widx], key)
        ndims = [len(v.aval.shape) for v in eqn.invars]
        return Site(key=key, op=op, eqn=eqn, weight_operand=widx, source=src,
                    stack_ids=ins[widx].stack_ids if widx is not None else (),
                    contract=_contract_axes(eqn, ndims))

    def _hop(self, plan, i, eqn, ins, stack):
        name = eqn.primitive.name
        scan_id = -1
        if name == "scan":
            self.scan_ids += 1
            scan_id = self.scan_ids
        subs = SUBJAXPRS[name](eqn, ins, scan_id)
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
        plans, outs = [], None
        for j, _, inner in subs:
            sub_plan, sub_outs = self.analyze(j, inner, stack)
            plans.append(sub_plan)
            if name in _TRANSPARENT:
                outs = sub_outs
            else:
                for info in sub_outs:
                    self._use(info, "float")
        keys = [s.key for p in plans for s in p.all_sites()]
        if keys:
            plan.subs[i] = Sub(kind=name, plans=plans, keys=keys, scan_id=scan_id)
        return outs


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
