"""Tracing a user function to a jaxpr and analysing it, cached per input types."""
from __future__ import annotations

import dataclasses
import inspect
from collections import OrderedDict

import jax

from .analysis import Analyzer, path_str
from .plan import DATA, Plan, VarInfo
from .qparams import WeightSource


@dataclasses.dataclass
class Traced:
    closed: object
    out_tree: object
    plan: Plan
    analyzer: Analyzer

    def sites(self):
        return list(self.plan.all_sites())


def normalize_argnums(weight_argnums) -> tuple[int, ...]:
    nums = (weight_argnums,) if isinstance(weight_argnums, int) else tuple(weight_argnums)
    if not nums or not all(isinstance(n, int) and n >= 0 for n in nums):
        raise ValueError(f"weight_argnums={weight_argnums!r}: expected a non-negative int or a "
                         "tuple of them (the positions of the weight arguments of f).")
    return nums


def _arg_names(f, n):
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY,
                                                    params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            names.append(f"arg{i}")
    return names


def _aval_key(x):
    t = jax.typeof(x)
    return (tuple(t.shape), str(t.dtype), bool(getattr(t, "weak_type", False)))


class Tracer:
    """Traces ``f`` once per input structure and types; keeps the last 32."""

    def __init__(self, f, weight_argnums):
        self.f = f
        self.argnums = normalize_argnums(weight_argnums)
        self.cache: OrderedDict = OrderedDict()

    def __call__(self, args) -> Traced:
        flat, treedef = jax.tree_util.tree_flatten(args)
        key = (treedef, tuple(_aval_key(x) for x in flat))
        hit = self.cache.get(key)
        if hit is not None:
            self.cache.move_to_end(key)
            return hit
        for a in self.argnums:
            if a >= len(args):
                raise ValueError(f"jqt: weight_argnums={self.argnums} but f was called with "
                                 f"{len(args)} positional arguments.")
        closed, out_shape = jax.make_jaxpr(self.f, return_shape=True)(*args)
        out_tree = jax.tree_util.tree_structure(out_shape)
        names = _arg_names(self.f, len(args))
        infos = []
        for i, a in enumerate(args):
            leaves = jax.tree_util.tree_flatten_with_path(a)[0]
            if i not in self.argnums:
                infos += [DATA] * len(leaves)
                continue
            for j, (path, _) in enumerate(leaves):
                p = path_str(path)
                if len(self.argnums) > 1 or not p:
                    p = f"{names[i]}/{p}" if p else names[i]
                infos.append(VarInfo(True, WeightSource(arg=i, path=p, leaf=j)))
        analyzer = Analyzer()
        plan, _ = analyzer.analyze(closed.jaxpr, infos, top=True)
        traced = Traced(closed, out_tree, plan, analyzer)
        self.cache[key] = traced
        if len(self.cache) > 32:
            self.cache.popitem(last=False)
        return traced
