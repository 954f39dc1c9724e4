"""What static analysis finds in a jaxpr (``analysis.py``) and the interpreter follows.

A :class:`Plan` mirrors one jaxpr: its quantizable ops (:class:`Site`, by equation
index) and the analysed bodies of its higher-order equations (:class:`Sub`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from .qparams import WeightSource


@dataclasses.dataclass(frozen=True)
class VarInfo:
    weight: bool                          # independent of the data arguments
    source: Optional[WeightSource] = None  # leaf + layout chain, if any
    stack_ids: tuple = ()                  # scans that sliced it from a stacked leaf
    buffer: tuple = ()                     # (loop id, carry slot) pairs it is (a slice of)
    writes: tuple = ()                     # keys of the cache writes it went through
    indexed: str = ""                      # the weight leaf it was indexed from by data (w[i])
    selected: str = ""                     # the weight leaf a select on the data picks in every case
    chosen: tuple = ()                     # the weight leaves a select or cond on the data picks from
    mixed: tuple = ()                      # weight matrices combined or edited with the data
    windowed: str = ""                     # the weight leaf a window of rows was looked up in
    zero: bool = False                     # all zeros (a literal 0, converted or broadcast)
    rolled: tuple = ()                     # buffers it is slices of, concatenated (jnp.roll)
    # (buffer, writes, the buffer's shape): whole vectors of a buffer, reshaped or gathered
    # (beam search's (B*K) axis split to (B, K), the beams gathered), until a reshape
    # back to its shape makes it that buffer again
    unflat: tuple = ()
    built: bool = False  # made in f from iota and literals alone (an interpolation matrix)
    computed: bool = False  # a weight f computes from weight leaves (2 * w, tril(w), qr(w)[0])
    rowwise: bool = False  # the same along its last axis (a per-sequence flag broadcast first)
    value: object = None  # a scalar integer constant's value: a literal, or made from literals


def computed_weight(infos) -> bool:
    """``VarInfo.computed`` of an op's output: every input a weight, one a leaf or computed
    from leaves itself (not only constants, zeros or values built from iota)."""
    return all(i.weight for i in infos) and any(i.source is not None or i.computed for i in infos)


def weight_stack_ids(infos, shard_ids=frozenset()) -> tuple:
    """``VarInfo.stack_ids`` of an op's output computed from weights alone: every scan that
    sliced one of them from a stacked value (a weight normalised in the body of a scan over
    layers, ``g * v / ||v||`` of each layer's slices, is each layer's own, with ranges of its
    own); ``()`` where some input is data. Not those of a ``jax.shard_map`` (``shard_ids``)
    that splits one into blocks: a weight computed from a block has no leaf to split, and its
    ranges are one over the blocks."""
    if not all(i.weight for i in infos):
        return ()
    return tuple(dict.fromkeys(s for i in infos for s in i.stack_ids if s not in shard_ids))


def picked_weights(pred, cases) -> tuple:
    """``VarInfo.chosen`` of a select or a cond: the weight leaves it picks between by a
    predicate (``pred``) from the data; ``()`` unless every case is a weight (a constant, a
    leaf, or such a pick itself) and one reaches a leaf."""
    if pred.weight or not all(c.weight or c.chosen for c in cases):
        return ()
    return tuple(dict.fromkeys(q for c in cases
                               for q in ((c.source.path,) if c.source is not None else c.chosen)))


DATA = VarInfo(False)
CONST = VarInfo(True)
LITERAL = VarInfo(True, built=True)  # a literal of the jaxpr (a constvar is a CONST)
ZERO = VarInfo(True, zero=True)


@dataclasses.dataclass
class Site:
    """One quantizable op; ``entry`` is its registry entry (``registry.py``)."""

    key: str
    op: str
    eqn: object
    weight_operand: Optional[int]
    source: Optional[WeightSource]
    stack_ids: tuple
    contract: tuple  # per operand: the axes that share one scale (reduced by the op)
    entry: object = None
    name_stack: str = ""  # the op's scopes from the top (a loop's or branch's body: theirs too)
    # the platforms of the lax.platform_dependent branch the op is in (None: the default
    # branch; () when the op is in no such branch)
    platforms: Optional[tuple] = ()
    # the weight operand is made in f from iota and literals alone: jax.image.resize's
    # interpolation matrices, lax.conv_general_dilated_patches' filter, a DFT matrix
    built: bool = False
    zero: bool = False  # the weight operand is all zeros by construction (a literal 0)
    # the bodies the op is in, one id per entry into one (two calls of one cached jaxpr,
    # a jax.checkpoint'ed layer in a Python loop: the same equations, other ids)
    call: tuple = ()

    @property
    def computes_weight(self) -> bool:
        """Its weight operand is one ``f`` computes: no leaf of the weights reaches it by
        layout ops alone, and it is not built from iota and literals."""
        return self.weight_operand is not None and self.source is None and not self.built

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
    caches: dict = dataclasses.field(default_factory=dict)  # carry slot -> keys of its writes
    takes_buffer: bool = False  # a call given a loop's buffer: interpreted with no op in it
    # carry slot of a cache -> the indices of f's flat arguments it starts from (a cache
    # passed to f that the loop carries: its type is checked against the loop's writes)
    passed: dict = dataclasses.field(default_factory=dict)

    def stacked(self, site: Site) -> bool:
        return self.scan_id in site.stack_ids


@dataclasses.dataclass
class Plan:
    sites: dict = dataclasses.field(default_factory=dict)  # eqn index -> Site
    subs: dict = dataclasses.field(default_factory=dict)   # eqn index -> Sub
    cache_selects: dict = dataclasses.field(default_factory=dict)  # select_n of a buffer's
    # cases: equation index -> the positions of its cases that are zeros (a slot cleared)
    # the top jaxpr's only: output index -> (input index, keys of its cache writes) of each
    # key/value cache f takes and returns written (a decode step; analysis.Analyzer._boundary)
    boundary: dict = dataclasses.field(default_factory=dict)

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
