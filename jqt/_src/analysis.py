"""Static analysis of a jaxpr: which values are weights, where quantizable ops
are, and the stable key of each.

A value is a *weight* when it depends only on the weight argument(s) and
constants. A quantizable op (an entry of ``registry.OPS``) with a weight
operand is keyed by the pytree path of the weight leaf it reads
(``params/Dense_0/kernel``); an op whose operands both depend on data gets
``<name stack>/<primitive>_<n>``. The walk recurses into the higher-order
primitives of ``hops.HIGHER_ORDER``; the result is a :class:`~jqt._src.plan.Plan`
tree that mirrors the jaxpr, which the interpreter follows.

A weight read at two sites gets two keys (``w``, ``w#1``: two sets of
parameters), with one exception: the remainder of ``jax.lax.map(f, xs,
batch_size=b)`` when ``b`` does not divide ``len(xs)``. JAX traces ``f`` twice
there (a ``scan`` over the full batches, then ``vmap(f)`` on the remaining
rows), and the remainder's ops are the scan body's ops on other rows: they get
the body's keys (:func:`map_remainders`), so that their statistics are merged
(``interpreter.Ctx.put``) and they run with the same parameters.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from . import compat, diagnostics, kvcache, layout
from .hops import HIGHER_ORDER
from .plan import (CONST, LITERAL, ZERO, Plan, Site, Sub, VarInfo, computed_weight, picked_weights,
                   weight_stack_ids)
from .registry import OPS


CALL = 0  # the loop id of the call itself: f's data arguments are its buffers (CALL, k)
_PENDING = "\0call-write:"  # the key of a write into such a buffer until _boundary names it
# Primitives that index their first operand by the others: a weight indexed by data (a loop
# counter) is no weight jqt can follow (a warning names the op that reads it).
_INDEXING = ("dynamic_slice", "gather")
# Elementwise ops that combine a weight matrix with the data (NoisyNet's mu + sigma * noise)
_MIXING = ("add", "sub", "mul", "div", "max", "min")
# Ops that edit a weight matrix with the data (w.at[i].set(v), segment_sum(w, seg)): the
# result is such a mix too. Not concatenate: jnp.concatenate([reg, x]) of registers, a soft
# prompt or a prefix with the tokens is a sequence, whose ops are activation x activation
_EDITING = ("scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max",
            "dynamic_update_slice")
# Matmuls jqt has no rule for: reading a weight, they say so (the weight stays float).
_GROUPED_MATMULS = ("ragged_dot", "ragged_dot_general")
_SPARSE_MATMULS = ("bcoo_dot_general", "bcsr_dot_general", "bcoo_spdot_general",  # jax.
                   "bcoo_dot_general_sampled")  # experimental.sparse
# How an op reads a weight as data (a VarInfo field naming the leaf), and what to do instead.
_MATRIX_ROWS_FIX = (" A table (or a stacked bias) whose rows are matrices, read at a position "
                    "or index from the data (a (P, H, Dh) positional table): store it as "
                    "(P, H * Dh), whose rows jqt looks up quantized, and reshape the row.")
_COLUMNS_FIX = (" A window of whole columns of a 2-D table at a data index "
                "(lax.dynamic_slice_in_dim(t, s, T, axis=1)) is no lookup jqt follows: read it "
                "as one, of columns, t[:, s + jnp.arange(T)], or of rows of the table as it "
                "is transposed, t.T[s:s + T] (or t[s:s + T].T for a window of rows read in "
                "columns), which jqt quantizes.")

_WEIGHTS_READ_AS_DATA = (
    ("indexed", "indexed by a value computed from the data (w[i] with i an argument of f or a "
     "loop's counter): jqt does not follow such an index", "Index with a Python int, or loop "
     "over the stacked weights with jax.lax.scan(body, h, w) (each layer's weights in xs)."),
    ("selected", "through a select on the data whose every case is that weight, broadcast over "
     "a batch: jax.vmap of a lax.cond with a per-example predicate runs both branches for "
     "every example and selects, and jqt does not quantize a weight broadcast per example",
     "Write the branches as jnp.where(pred, a(x), b(x)) (what vmap computes anyway), or take "
     "the cond out of the vmap."),
    ("chosen", "through a lax.cond, lax.switch or jnp.where on the data that picks between "
     "weights (or masks one), not as one weight", "Pick or mask the op's outputs instead where "
     "the model allows: lax.cond(pred, lambda x: x @ a, lambda x: x @ b, x), or "
     "jnp.where(pred, x @ a, x @ b); each weight is then an op's own."),
    ("mixed", "combined elementwise with the data (NoisyNet's mu + sigma * noise, "
     "DropConnect's w * mask, w / temperature, Equinox SpectralNorm's W / sigma with sigma "
     "from its state argument) or edited with it (rows set or added from "
     "the data: w.at[i].set(v), a dynamic_update_slice, segment_sum(w, seg)): "
     "jqt quantizes a weight as params hold it (or as f computes it from params alone), and "
     "takes such a value for an activation",
     "Apply the data to the op's input or output instead where the model allows "
     "(x @ mu + x @ (sigma * noise) quantizes x @ mu; (x @ w) / t), edit the weight in the "
     "params before calling f where the edit is fixed (added tokens: "
     "params['emb'].at[i].set(v) outside f), fold a normalization by a state value into the "
     "params (the weights W / sigma computed once and stored in plain layers), or quantize "
     "the model without the noise or mask, as it runs at inference."),
    ("windowed", "through a window of its rows at a data index (lax.dynamic_slice_in_dim(w, "
     "l * d, d): layers stored flat, read in a loop), which jqt quantizes as a lookup of "
     "those rows (a learned positional table's window), not as this op's weight",
     "Where the rows are layers' weights stored flat, store them stacked, (L, K, N), and "
     "loop over them with jax.lax.scan(body, h, w) (each layer's weights in xs); where they "
     "are a table's rows the op reads as data (relative positions in attention), nothing is "
     "wrong."),
)


def _mixed(info, var, out) -> tuple:
    """The weight matrices that ``info`` (of ``var``, an operand of an elementwise op whose
    output is ``out``) is, or holds mixed with data: a weight of two or more axes, of the
    output's shape and not broadcast to it (a bias or a gain broadcast over the data, by a
    broadcast_in_dim or over leading size-1 axes it was given, Flax's DenseGeneral bias
    reshaped to ``(1, 1, H, Dh)``, is not one, also where the data's axes are 1 too)."""
    s = info.source
    lead = lambda shape: next((i for i, d in enumerate(shape) if d != 1), len(shape))  # noqa: E731
    if s is not None and var.aval.ndim >= 2 and var.aval.shape == out.aval.shape \
            and lead(var.aval.shape) <= lead(s.shape or ()) \
            and not any(c[0] == "broadcast_in_dim" for c in s.chain):
        return (s.path,)
    return info.mixed


def _edited(ins, invars) -> tuple:
    """The weight matrices an edit by the data (an ``_EDITING`` op, some operand not a
    weight) reads: a leaf of two or more axes longer than 1, not broadcast (a class token
    broadcast over the batch and prepended is not one), or a value already mixed."""
    def matrix(info, var):
        s = info.source
        return (s is not None and sum(d > 1 for d in var.aval.shape) >= 2
                and not any(c[0] == "broadcast_in_dim" for c in s.chain))
    paths = [i.source.path for i, v in zip(ins, invars) if matrix(i, v)]
    return tuple(dict.fromkeys(paths + [p for i in ins for p in i.mixed]))


# scalar integer ops folded where every operand's value is known (jnp indexing normalizes
# a constant index with lt, add and select_n; a cast; arithmetic on a layer number, jnp's
# ``%`` and ``//`` included)
_FOLD = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
         "neg": lambda a: -a, "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
         "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b,
         "ne": lambda a, b: a != b, "max": max, "min": min,
         "convert_element_type": lambda a: a, "select_n": lambda p, *cases: _case(p, cases),
         "rem": lambda a, b: _trunc_div(a, b)[1], "div": lambda a, b: _trunc_div(a, b)[0],
         "clamp": lambda lo, x, hi: min(max(x, lo), hi), "sign": lambda a: (a > 0) - (a < 0),
         "and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b,
         "not": lambda a: (not a) if isinstance(a, bool) else ~a}


def _case(p, cases):
    """``select_n``'s case at a known ``which``; outside the cases XLA's choice is
    implementation-defined, so not folded."""
    if not 0 <= int(p) < len(cases):
        raise ValueError("select_n: which out of range")
    return cases[int(p)]


def _trunc_div(a, b):
    """XLA's integer division and remainder: the quotient rounds toward zero, the remainder
    takes the dividend's sign (``lax.div``, ``lax.rem``; ``jnp``'s ``//`` and ``%`` add a
    correction on top). Division by zero is not folded."""
    if b == 0:
        raise ValueError("division by zero")
    q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
    return q, a - q * b


def _fold(eqn, ins):
    """The value of a scalar integer (or boolean) op of known operands, else ``None``."""
    fn = _FOLD.get(eqn.primitive.name)
    if fn is None or len(eqn.outvars) != 1 or eqn.outvars[0].aval.shape \
            or not all(i.value is not None or i.zero for i in ins):
        return None
    dt = np.dtype(eqn.outvars[0].aval.dtype)
    if not (np.issubdtype(dt, np.integer) or dt == bool):
        return None
    try:
        out = fn(*[0 if i.zero else i.value for i in ins])
        return bool(out) if dt == bool else int(np.asarray(out).astype(dt))
    except (TypeError, ValueError, OverflowError, IndexError):
        return None


def _const_info(c, v):
    """A constvar's info: a weight-like constant, whose value is known where it is a
    concrete scalar integer or boolean (``L = jnp.int32(2)`` closed over, then ``w[L]``)."""
    aval = v.aval
    if c is None or getattr(aval, "shape", None) != () or not (
            jnp.issubdtype(aval.dtype, jnp.bool_) or jnp.issubdtype(aval.dtype, jnp.integer)):
        return CONST  # (not a typed PRNG key either: jnp.issubdtype knows its dtype)
    try:
        return dataclasses.replace(CONST, value=np.asarray(c).item())
    except Exception:  # a tracer (a constant of an outer trace): its value is not known
        return CONST


def _carried_tags(eqn, ins) -> dict:
    """A weight read as data (``indexed``, ``selected``, ``chosen``, ``mixed``) changed
    elementwise by constants or a scalar (``W[i] * 2``, ``-W[i]``, ``W[i] / t``): still that
    weight to the op that reads it, which warns (it stayed float without a word). Not a
    value the data is added to (``h + b[i]``: an activation, the ops after it no weight's)."""
    if len(eqn.outvars) != 1:
        return {}
    shape = eqn.outvars[0].aval.shape
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    out = {}
    for field in ("indexed", "selected", "chosen", "mixed", "windowed"):
        tagged = [getattr(i, field) for i, sh in zip(ins, shapes) if getattr(i, field) and sh == shape]
        if tagged and all(getattr(i, field) or i.weight or math.prod(sh) == 1
                          for i, sh in zip(ins, shapes)):
            out[field] = tagged[0]
    return out


def _named_weights(path):
    """``(names, phrase)`` for a ``VarInfo`` field naming one leaf or several.

    >>> _named_weights(("a", "b"))
    (('a', 'b'), "weights 'a', 'b'")
    """
    names = (path,) if isinstance(path, str) else tuple(path)
    return names, (f"weight '{names[0]}'" if len(names) == 1 else
                   "weights " + ", ".join(f"'{q}'" for q in names))


def _all_built(infos, empty=False) -> bool:
    """Whether every value of ``infos`` is made from iota and literals (or zeros); ``empty``
    for none."""
    return all(i.built or i.zero for i in infos) if infos else empty


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
    """The name stack of an equation of a body (jit, scan, cond, remat...) traced under
    ``prefix``: a body's names are relative to it, so always ``prefix/stack`` (a body
    scope ``encoder_block`` under ``enc`` is not the same scope twice)."""
    if not prefix or not stack:
        return stack or prefix
    return f"{prefix}/{stack}"


def map_remainders(jaxpr) -> dict:
    """``{scan index: end index}`` for each ``lax.map(batch_size=)`` with a remainder in
    ``jaxpr``: a ``scan`` without carries whose outputs are reshaped (the batches
    flattened) and then concatenated on axis 0 with the remainder's outputs. The
    equations strictly between the two indices compute the remainder (``vmap(f)``),
    together with those reshapes (lax.map's own, in the order of ``jax.lax.map``)."""
    eqns, out = jaxpr.eqns, {}
    users = {}  # var -> the indices of the equations reading it (one walk, not one per scan)
    for j, e in enumerate(eqns):
        for v in e.invars:
            if not compat.is_literal(v):
                users.setdefault(v, []).append(j)
    for i, e in enumerate(eqns):
        if e.primitive.name != "scan" or compat.scan_counts(e)[1] or e.params["reverse"]:
            continue
        flat = [eqns[j].outvars[0] for v in e.outvars if not compat.is_dropvar(v)
                for j in users.get(v, ()) if eqns[j].primitive.name == "reshape"
                and eqns[j].invars[0] is v]
        ends = [j for v in flat for j in users.get(v, ())
                if eqns[j].primitive.name == "concatenate" and eqns[j].params["dimension"] == 0
                and len(eqns[j].invars) == 2 and eqns[j].invars[0] is v]
        if ends:
            out[i] = min(ends)
    return out


def _signature(site, scan_id):
    """What must agree for a remainder's op to share the key of a scan body's op."""
    src = site.source
    return (site.op, site.weight_operand, None if src is None else (src.arg, src.path, src.chain),
            tuple(map(tuple, site.contract)), len(site.stack_ids), scan_id in site.stack_ids)


def _rekey(plan):
    for sub in plan.subs.values():
        for p in sub.plans:
            _rekey(p)
        sub.keys = [s.key for p in sub.plans for s in p.all_sites()]


def _empty(entry, eqn, ins) -> bool:
    """Whether a quantizable op has nothing to quantize: a weight of no elements (an
    optional block of features of width 0; its products are exact zeros). It stays float,
    without qparams: ranges of no values are undefined. (An activation of no elements is
    not one: its shape changes from call to call, and the op's key must not.)"""
    if entry.is_cache:
        return False
    w = entry.weight_operand(eqn, ins)
    return w is not None and any(d == 0 for d in eqn.invars[w].aval.shape)


def _take(eqn, ins, taken):
    """Records in ``taken`` (var -> (buffers, added)) the values an equation reads out of
    a carried buffer (a slice, a dynamic slice, a gather: ``acc[idx]``), and those values
    converted or reshaped, or plus or minus others (``acc[idx] + y``: ``added``)."""
    name = eqn.primitive.name
    if name in ("slice", "dynamic_slice", "gather") and ins and ins[0].buffer:
        taken[eqn.outvars[0]] = (ins[0].buffer, False)
        return
    summed = name in ("add", "sub", "add_any")
    if summed or name in ("convert_element_type", "reshape", "broadcast_in_dim", "squeeze",
                          "expand_dims"):
        got = [taken[v] for v in eqn.invars if not compat.is_literal(v) and v in taken]
        if got:
            taken[eqn.outvars[0]] = (tuple(dict.fromkeys(b for bufs, _ in got for b in bufs)),
                                     summed or any(a for _, a in got))


_SAME_VALUES = frozenset(("reshape", "broadcast_in_dim", "squeeze", "transpose", "copy", "rev",
                          "slice", "dynamic_slice"))


def _discrete(v, made_by, depth=0) -> bool:
    """Whether ``v`` holds bool or integer values converted to float (``jax.nn.one_hot``
    of the sampled tokens, a mask), through layout ops and jitted calls: a buffer written
    with them is a sampling loop's state (a token history summed for a no-repeat rule),
    whose values a quantized cache's codes would not give back exactly, not keys or values."""
    eqn = made_by.get(v)
    if eqn is None or depth > 64:
        return False
    name = eqn.primitive.name
    if name == "convert_element_type":
        src = eqn.invars[0].aval.dtype
        return src == np.bool_ or bool(jnp.issubdtype(src, jnp.integer))
    if name in _SAME_VALUES:
        x = eqn.invars[0]
        return not compat.is_literal(x) and _discrete(x, made_by, depth + 1)
    if eqn.primitive not in (compat.jit_p, compat.closed_call_p):
        return False
    j = getattr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")), "jaxpr", None)
    if j is None or len(j.outvars) != len(eqn.outvars) or len(j.invars) != len(eqn.invars):
        return False
    w = j.outvars[list(eqn.outvars).index(v)]
    if compat.is_literal(w):
        return False
    if w in j.invars:
        x = eqn.invars[j.invars.index(w)]
        return not compat.is_literal(x) and _discrete(x, made_by, depth + 1)
    return _discrete(w, {o: e for e in j.eqns for o in e.outvars}, depth + 1)


def _index_roots(v, made_by, depth=0) -> frozenset:
    """The variables a scalar integer index is computed from by scalar ops (jnp's wrap of a
    negative index: ``lt``, ``add``, ``select_n``), back to the first that is not one."""
    eqn = made_by.get(v)
    if eqn is None or depth > 16 or eqn.outvars[0].aval.shape != () \
            or not (eqn.outvars[0].aval.dtype == np.bool_ or jnp.issubdtype(eqn.outvars[0].aval.dtype, jnp.integer)):
        return frozenset([v])
    return frozenset().union(*(_index_roots(u, made_by, depth + 1) for u in eqn.invars
                               if not compat.is_literal(u)))


def _layer_indices(jaxpr, env) -> dict:
    """Index roots (:func:`_index_roots`) -> the leading sizes of the stacked weights
    (leaves of three or more axes) whose whole matrices ``jaxpr`` slices at them: a layer's
    weights read at a loop's counter or an argument (``w[i]``, ``fori_loop`` over stacked
    layers), which jqt does not follow. A 2-D leaf as long read at the same index is that
    layer's bias or norm gain, not a table looked up at a token or a position."""
    made_by = {o: e for e in jaxpr.eqns for o in e.outvars}
    out = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "dynamic_slice" or compat.is_literal(eqn.invars[1]):
            continue
        w = eqn.invars[0]
        info = env.get(w) if not compat.is_literal(w) else None
        shape, sizes = w.aval.shape, eqn.params["slice_sizes"]
        if info is None or info.source is None or len(shape) < 3 or sizes[0] != 1 \
                or tuple(sizes[1:]) != tuple(shape[1:]):
            continue
        for r in _index_roots(eqn.invars[1], made_by):
            out.setdefault(r, set()).add(shape[0])
    return out


def _layer_row(eqn, layers, made_by) -> bool:
    """Whether ``eqn`` reads a row of a 2-D weight at an index that also slices a stacked
    weight as long (:func:`_layer_indices`): a layer's vector, kept float as its layer's
    matrices are, not a lookup."""
    if eqn.primitive.name != "dynamic_slice" or not layers or eqn.invars[0].aval.ndim != 2 \
            or compat.is_literal(eqn.invars[1]):
        return False
    n = eqn.invars[0].aval.shape[0]
    return any(n in layers.get(r, ()) for r in _index_roots(eqn.invars[1], made_by))


def _accumulates(eqn, buffers, taken) -> bool:
    """Whether a write into ``buffers`` writes what it read from them plus something
    (``acc.at[idx].set(acc[idx] + y)``: a mixture's experts adding into the residual a loop
    carries): an accumulator, not a key/value cache, whose writes are new vectors (or its
    own vectors moved: a window shifted in place)."""
    upd = eqn.invars[OPS[eqn.primitive].update_index]
    bufs, added = (((), False) if compat.is_literal(upd) else taken.get(upd, ((), False)))
    return added and bool(set(bufs) & set(buffers))


def _rolled(eqn, ins, sliced) -> tuple:
    """The buffers a ``concatenate`` along a non-last axis of slices of them (``sliced``:
    var -> buffers) is made of (``jnp.roll`` of a cache); ``()`` otherwise."""
    if eqn.primitive.name != "concatenate" or not ins \
            or eqn.params["dimension"] == eqn.outvars[0].aval.ndim - 1:
        return ()
    parts = [i.buffer or i.rolled or (() if compat.is_literal(v) else sliced.get(v, ()))
             for v, i in zip(eqn.invars, ins)]
    return tuple(dict.fromkeys(b for q in parts for b in q)) if all(parts) else ()


EQUINOX_HIDES = {"maybe_set": 'while_loop\'s buffers=, or scan(kind="checkpointed")',
                 "select_if_vmap": 'while_loop(kind="lax" or "checkpointed"), or scan(kind="checkpointed")'}
"""Equinox's primitives that write or copy a loop's carry where jqt does not see a cache
write or a copy: the cache stays float, and calibrate's warning names them (with the
Equinox calls that run them: ``equinox.internal.scan(kind="checkpointed")`` runs a
checkpointed ``while_loop`` with ``buffers=``)."""


class Analyzer:
    """Walks a closed jaxpr once and builds its :class:`Plan`.

    ``leaf_uses`` maps ``(arg, leaf index)`` of each weight leaf to the site keys
    that read it as a weight operand, plus ``"float"`` when it is also read as
    a float value elsewhere.
    """

    def __init__(self, leaf_names=None, leaf_paths=frozenset()):
        self.leaf_names = leaf_names or {}  # (argument, leaf index) -> its path, ['a']['b']
        self.leaf_paths = frozenset(leaf_paths)  # the weight leaves' keys, a/b
        self.counters: dict[str, int] = {}
        self.used_keys: set[str] = set()
        self.key_leaves: dict = {}  # key -> (argument, leaf index) of the weight it names
        self.shard_ids: set = set()  # the ids of the shard_maps among the loops' (scan_ids)
        self.leaf_uses: dict[tuple, set] = {}
        self.scan_ids = 0
        self.bodies: list = []  # an id per entry into a body, of those the analysis is in
        self.body_ids = 0
        self.warned: list[str] = []
        self.reads: set = set()  # (loop id, slot) of carried buffers read by some op
        # (who, slot, aval, loop id, buffer): a loop's carried buffer of the shape and dtype
        # of its key/value caches, read in the body, that no cache write updates
        # (jnp.where(mask, new, c)); loop id CALL: f's arguments and results; buffer: its
        # (loop id, slot), as near misses name theirs
        self.cache_lookalikes: list = []
        # buffers written as accumulators (acc.at[i].set(acc[i] + y)): float by design, no
        # look-alikes of a cache (see _accumulates)
        self.accumulators: set = set()
        # buffers read other than by a slice (attention reading a cache): no accumulator's
        self.whole_reads: set = set()
        # weights indexed by the data whose pieces are matrices ((P, H, Dh)[s]: (H, Dh)):
        # read by an op jqt does not quantize, they warn (not a schedule's t[s], nor a
        # (L, 1, D) bias's row, never quantized anyway)
        self._matrix_rows: dict = {}  # path -> the advice of the warning
        self._matrix_said: set = set()  # those a warning named already
        self.loops: list = []  # the kinds of the loops around the equation analyzed
        # (where, why, buffers): a write into a carried or passed float buffer that is not
        # a cache write (part of the last axis; a buffer converted to another dtype first)
        self.cache_near_misses: list = []
        self._converted: dict = {}  # var -> (dtype from, dtype to, buffers): a buffer converted
        self._missed: dict = {}  # var -> buffers: the result of such a write
        self._missed_reads: set = set()  # buffers whose such results an op reads
        self.call_writes = 0  # writes into a buffer f takes (keyed once f returns it: _boundary)
        # keys of the cache writes of a weight (zeros clearing a slot, a learned sink key): a
        # buffer only these write holds no data (a loop stacking weights): no cache
        self.weight_writes = set()
        self.jqt_prims: set = set()  # jqt's own primitives f runs (a function jqt.quantize returned)
        # Equinox's primitives that hide a cache write or copy from jqt (while_loop's
        # buffers= and kind="lax"), named by the warning that no cache was found
        self.equinox_prims: set = set()
        self.empty_ops = 0  # quantizable ops whose weight has no elements (left float, unkeyed)
        self.carried: dict = {}  # weight path -> the first loop whose carry it enters
        self._carry_slots: dict = {}  # (loop id, slot) -> weight paths entering that slot
        self.carried_caches: set = set()  # weight paths whose carry slot a loop keeps as a cache

    def _use(self, info, what):
        if info.source is not None:
            self.leaf_uses.setdefault((info.source.arg, info.source.leaf), set()).add(what)

    def _carry(self, info, var, loop, slot):
        """Notes a float weight leaf entering ``loop``'s carry at ``slot`` ``(loop id, k)``
        (read as data there: JAX makes a carry the body returns unchanged a constant, but
        not one it copies or changes)."""
        if info.source is not None and jnp.issubdtype(var.aval.dtype, jnp.floating):
            self.carried.setdefault(info.source.path, loop)
            self._carry_slots.setdefault(slot, []).append(info.source.path)

    def _key(self, base, leaf=None):
        """``base``, or ``base#n`` where an op took it already; ``leaf``: the (argument, leaf
        index) of the weight the op reads, whose path ``base`` is."""
        if leaf is not None and leaf[1] >= 0:
            other = self.key_leaves.setdefault(base, leaf)
            if other != leaf:
                self._defer(("same key", base), (
                    (f"jqt: two leaves of argument {leaf[0]} of f, {self._leaf_name(other)} and "
                     f"{self._leaf_name(leaf)}," if other[0] == leaf[0] else
                     f"jqt: two leaves, {self._leaf_name(other)} of argument {other[0]} of f and "
                     f"{self._leaf_name(leaf)} of argument {leaf[0]},")
                    + f" have the same key '{base}' (a dict key holding "
                    "'/' or '#': jqt joins a leaf's path with '/' and numbers an op that reads "
                    "a leaf again '#1'; or an empty key, whose leaf takes the name of f's "
                    "parameter), so the ops that read the second are keyed as if they read "
                    "the first again, and a jqt.Rule(key=...) cannot tell the two apart. Rename the "
                    "dict keys so that none holds '/' or '#' or is empty."), f"'{base}'")
        if base not in self.used_keys:
            self.used_keys.add(base)
            return base
        n = self.counters.get(base, 0) + 1
        while f"{base}#{n}" in self.used_keys:
            n += 1
        self.counters[base] = n
        self.used_keys.add(f"{base}#{n}")
        if leaf is not None:
            self.key_leaves.setdefault(f"{base}#{n}", leaf)
        return f"{base}#{n}"

    def _leaf_name(self, leaf):
        name = self.leaf_names.get(leaf)
        return name if name else f"leaf {leaf[1]} in jax.tree_util.tree_leaves order"

    def _fallback_key(self, stack, op):
        """``op_n`` (under ``stack``), the ``n``-th op of its kind without a leaf to name it;
        not a weight leaf's path (a leaf named ``dot_general_0``, whose ops would be keyed as
        if they read it again)."""
        base = f"{stack}/{op}" if stack else op
        while True:
            n = self.counters.get("\0" + base, 0)
            self.counters["\0" + base] = n + 1
            if f"{base}_{n}" not in self.leaf_paths:
                return self._key(f"{base}_{n}")

    def analyze(self, jaxpr, infos, prefix="", top=False, consts=()):
        """Returns (plan, out infos). ``consts``: the values of ``jaxpr.constvars`` where
        known (a closed-over scalar index is then a constant one: see ``_fold``)."""
        env = {}
        for k, (v, info) in enumerate(zip(jaxpr.invars, infos)):
            if top and not info.weight and info.source is None:  # the call's own buffers
                info = dataclasses.replace(info, buffer=((CALL, k),))
            env[v] = info
        for k, v in enumerate(jaxpr.constvars):
            env[v] = _const_info(consts[k] if k < len(consts) else None, v)

        def read(v):
            if compat.is_literal(v):
                if compat.is_zero_literal(v):
                    return ZERO
                # a scalar literal; an array one is a closed-over array (JAX's
                # jax_use_simplified_jaxpr_constants), a weight like a constvar
                if getattr(v.aval, "shape", ()):
                    return CONST
                val = np.asarray(v.val)  # (an integer's value is known: see _fold)
                if val.dtype == bool or np.issubdtype(val.dtype, np.integer):
                    return dataclasses.replace(LITERAL, value=val.item())
                return LITERAL
            return env[v]

        plan = Plan()
        read_vars = {v for e in jaxpr.eqns for v in e.invars if not compat.is_literal(v)} \
            | {v for v in jaxpr.outvars if not compat.is_literal(v)}
        maps, pending = map_remainders(jaxpr), {}
        made_by = {}  # var -> the equation of this jaxpr that made it
        layers = _layer_indices(jaxpr, env)  # (w[i] of stacked layers: see _layer_row)
        sliced = {}  # var -> the buffers it is a slice of (see _rolled)
        taken = {}  # var -> the buffers its values were read from (see _accumulates)
        accumulated = {}  # var -> the buffers of the accumulator write that made it
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.outvars:
                made_by[v] = eqn
            if i - 1 in maps:  # the keys the remainder may take back (see _share_remainder):
                # those taken after the scan's own (a snapshot from before it released them
                # too, and a later read of the weight took its key again)
                pending[maps[i - 1]] = (i - 1, set(self.used_keys), dict(self.counters))
            if i in pending:
                self._share_remainder(plan, *pending.pop(i), i)
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name.startswith("jqt_"):
                self.jqt_prims.add(name)
            elif name in EQUINOX_HIDES:
                self.equinox_prims.add(name)
            stack = _join(prefix, compat.name_stack(eqn))
            outs = None
            entry = OPS.get(eqn.primitive)
            if entry is not None and _layer_row(eqn, layers, made_by):
                entry = None  # a layer's bias or gain at its index: float, as its matrices
            if entry is not None and entry.is_cache and ins and ins[0].unflat and not ins[0].buffer:
                # a write into whole vectors of a buffer reshaped (beams kept on an axis of
                # their own, (B, K, T, D), merged to (B * K, T, D) around the write): a write
                # into the buffer, whose reshape back makes it the buffer again (_unflat)
                buf, writes, shape = ins[0].unflat
                ins = [VarInfo(False, buffer=buf, writes=writes)] + ins[1:]
            else:
                shape = None
            if entry is not None and entry.is_cache and ins and ins[0].buffer \
                    and _accumulates(eqn, ins[0].buffer, taken):
                self.accumulators.update(ins[0].buffer)
                accumulated[eqn.outvars[0]] = ins[0].buffer  # (read whole after: see whole_reads)
                ins = [VarInfo(False)] + ins[1:]  # an accumulator: no cache (nor a near miss)
            if entry is not None and entry.is_cache and ins and ins[0].buffer \
                    and _discrete(eqn.invars[entry.update_index], made_by):
                ins = [VarInfo(False)] + ins[1:]  # sampling state (a one-hot history): no cache
            cache_write = entry is not None and entry.is_cache and entry.is_site(eqn, ins)
            view = kvcache.is_buffer_view(eqn) and bool(ins[0].buffer)
            picked = kvcache.is_buffer_select(
                eqn, ins, None if compat.is_literal(eqn.invars[0]) else made_by.get(eqn.invars[0])) \
                if name == "select_n" else False
            if not cache_write and not view and not picked and eqn.primitive not in HIGHER_ORDER \
                    and not kvcache.is_plain_copy(eqn):
                # a loop body's reads (loops: inside their bodies); a write of part of a
                # buffer's vectors does not read it
                skip = 1 if entry is not None and entry.is_cache else 0
                if _unflat(eqn, ins[0] if ins else None) is not None:
                    skip = 1  # a reshaped or gathered view of a buffer: read where it is read
                for v, info in zip(eqn.invars[skip:], ins[skip:]):
                    self.reads.update(info.buffer)
                    self.reads.update(info.unflat[0] if info.unflat else ())
                    if name not in ("slice", "dynamic_slice", "gather"):
                        self.whole_reads.update(info.buffer + (info.unflat[0] if info.unflat else ())
                                                + (() if compat.is_literal(v) else accumulated.get(v, ())))
                    if not compat.is_literal(v) and v in self._missed:
                        self._missed_reads.update(self._missed[v])
            if kvcache.is_plain_copy(eqn):  # the same values: still the missed write's
                for v, o in zip(eqn.invars, eqn.outvars):
                    if not compat.is_literal(v) and v in self._missed:
                        self._missed[o] = self._missed[v]
            if entry is not None and entry.is_cache and not cache_write:
                self._near_miss(eqn, ins, stack)
            elif name == "convert_element_type" and ins[0].buffer:
                self._converted[eqn.outvars[0]] = (eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype,
                                                   ins[0].buffer)
            empty = entry is not None and entry.is_site(eqn, ins) and _empty(entry, eqn, ins)
            self.empty_ops += empty
            if entry is not None and entry.is_site(eqn, ins) and not empty:
                site = plan.sites[i] = self._site(entry, entry.weight_operand(eqn, ins), eqn, ins, stack)
                if entry.is_cache and ins[entry.update_index].weight:
                    self.weight_writes.add(site.key)
                if entry.is_cache and shape is not None:  # still the reshaped buffer
                    outs = [VarInfo(False, unflat=(ins[0].buffer, ins[0].writes + (site.key,), shape))]
                elif entry.is_cache:  # the buffer after the write: still the loop's buffer
                    outs = [VarInfo(False, buffer=ins[0].buffer, writes=ins[0].writes + (site.key,))]
                elif getattr(entry, "window", None) and ins[0].source is not None and entry.window(eqn):
                    # rows looked up: a matmul that takes them for its weight says so
                    outs = [VarInfo(False, windowed=ins[0].source.path)]
            elif eqn.primitive in HIGHER_ORDER:
                unread = {k for k, v in enumerate(eqn.outvars) if compat.is_dropvar(v) or v not in read_vars}
                outs = self._hop(plan, i, eqn, ins, stack, unread)
            elif view:  # the same buffer, its axes permuted (a vmap moved the batch axis)
                outs = [VarInfo(False, buffer=ins[0].buffer, writes=ins[0].writes)]
            elif (unflat := _unflat(eqn, ins[0] if ins else None)) is not None:
                buf, writes, shape = unflat
                outs = [VarInfo(False, buffer=buf, writes=writes)
                        if eqn.outvars[0].aval.shape == shape and kvcache.is_relabel(eqn)
                        else VarInfo(False, unflat=unflat)]
            elif picked:  # the same buffer, whole vectors from before or after a write, or
                # zero vectors (a slot cleared)
                plan.cache_selects[i] = tuple(k for k, x in enumerate(ins[1:]) if not x.buffer)
                outs = [VarInfo(False, buffer=next(x.buffer for x in ins[1:] if x.buffer),
                                writes=tuple(dict.fromkeys(w for x in ins[1:] for w in x.writes)))]
            elif name in ("convert_element_type", "broadcast_in_dim") and ins[0].zero:
                outs = [ZERO]  # zeros of another dtype or shape (jnp.zeros_like(cache))
            else:
                step = layout.record(eqn)
                if step is None and name == "dynamic_slice" and ins[0].source is not None \
                        and all(i.value is not None or i.zero for i in ins[1:]):
                    # constant starts made from literals (w[jnp.int32(l)]) or passed into a
                    # jit (lax.dynamic_index_in_dim(w, l)): the slice they are
                    step = layout.constant_window(eqn, [0 if i.zero else i.value for i in ins[1:]])
                parts = layout.record_each(eqn) if ins and ins[0].source is not None else None
                if parts is not None:  # jnp.split, jnp.unstack: slices; a transposing reshape
                    s = ins[0].source
                    outs = [VarInfo(True, dataclasses.replace(s, chain=s.chain + c), ins[0].stack_ids)
                            for c in parts]
                elif step == ("copy",) and len(ins) == len(eqn.outvars):  # the same values (copy,
                    outs = list(ins)  # stop_gradient; an optimization_barrier of several)
                elif step is not None and ins and ins[0].source is not None \
                        and (len(ins) == 1 or name == "dynamic_slice"):
                    # (a dynamic_slice at constant starts: recorded only where they are)
                    s = ins[0].source
                    outs = [VarInfo(True, dataclasses.replace(s, chain=s.chain + (step,)), ins[0].stack_ids)]
                elif (step is not None or layout.record_each(eqn) is not None) and len(ins) == 1 \
                        and (ins[0].indexed or ins[0].selected or ins[0].chosen or ins[0].mixed
                             or ins[0].windowed):
                    # (a transposing reshape too: jax.vmap of a conv folds a batched kernel so)
                    outs = [VarInfo(False, indexed=ins[0].indexed, selected=ins[0].selected,
                                    chosen=ins[0].chosen, mixed=ins[0].mixed, windowed=ins[0].windowed)]
                elif name in _MIXING and not all(i.weight for i in ins) \
                        and (mixed := tuple(dict.fromkeys(p for i, v in zip(ins, eqn.invars)
                                                          for p in _mixed(i, v, eqn.outvars[0])))):
                    for info in ins:  # w * mask: an activation (see _site)
                        self._use(info, "float")
                    outs = [VarInfo(False, mixed=mixed)]
                elif name in _EDITING and not all(i.weight for i in ins) \
                        and (mixed := _edited(ins, eqn.invars)):
                    for info in ins:  # emb.at[new_ids].set(v): an activation, as above
                        self._use(info, "float")
                    outs = [VarInfo(False, mixed=mixed)]
                elif name == "select_n" and ins[1].source is not None and not ins[0].weight \
                        and all(i == ins[1] for i in ins[2:]):  # vmap of a cond: see _site
                    self._use(ins[1], "float")  # the op that reads it stays float
                    outs = [VarInfo(False, selected=ins[1].source.path)]
                elif name == "select_n" and (chosen := picked_weights(ins[0], ins[1:])):
                    for info in ins[1:]:  # jnp.where(pred, a, b) of weights: see _site
                        self._use(info, "float")
                    outs = [VarInfo(False, chosen=chosen)]
                elif name in _INDEXING and ins[0].source is not None and not all(i.weight for i in ins):
                    self._use(ins[0], "float")  # w[i] with i from the data (a loop's counter)
                    outs = [VarInfo(False, indexed=ins[0].source.path)]
                    if sum(d > 1 for d in eqn.outvars[0].aval.shape) >= 2:
                        self._matrix_rows[ins[0].source.path] = (  # (see _matrix_rows)
                            _COLUMNS_FIX if eqn.invars[0].aval.ndim == 2 else _MATRIX_ROWS_FIX)
                else:
                    for info in ins:
                        self._use(info, "float")
                    paths = [info.source.path for info in ins if info.source is not None]
                    if entry is not None and entry.needs_weight and not entry.is_cache and ins \
                            and not any(ins[k].weight for k in entry.index_operands(eqn)):
                        self._table_read_as_data(entry.name, ins[0], stack)
                    if name in _GROUPED_MATMULS and paths:
                        msg = (f"jqt: a {name} (at '{stack or '<top>'}') reads weight '{paths[0]}': "
                               f"jqt has no rule for {name} in this form (jqt quantizes "
                               "lax.ragged_dot(x, w, group_sizes) with x (M, K) ragged along M and "
                               "the weight w (G, K, N), one matrix per group), so it stays float. "
                               "Write it in that form, or the experts as an einsum over "
                               "the expert axis ('ecd,edf->ecf' on tokens dispatched per expert) "
                               "or a lax.scan over the stacked expert weights, which jqt "
                               "quantizes per expert.")
                        self._defer(("ragged", name), msg, f"'{paths[0]}' at '{stack or '<top>'}'")
                    elif name in _GROUPED_MATMULS and not any(i.weight for i in ins[:2]) \
                            and not self._read_as_data(name, ins[:2], stack):
                        msg = (f"jqt: a {name} (at '{stack or '<top>'}') multiplies two values "
                               "computed from the data: jqt quantizes lax.ragged_dot only with a "
                               "weight w (G, K, N), and a rule's act_x_act= applies to "
                               "dot_general (einsum, matmul), so it stays float. To quantize it, "
                               "compute it with dot_general ops (an einsum per group, or "
                               "jnp.einsum('md,mdn->mn', x, w[group_ids]) over each row's "
                               "matrix), which act_x_act= quantizes.")
                        self._defer(("ragged_data", name), msg, f"'{stack or '<top>'}'")
                    if name in _SPARSE_MATMULS and any(i.weight for i in ins):
                        # the values' leaf, not the indices'; a weight a sparse op (a
                        # bcoo_transpose, BCOO.fromdense in f) changed first has none
                        vals = [i.source.path for i, v in zip(ins, eqn.invars) if i.source is not None
                                and jnp.issubdtype(v.aval.dtype, jnp.inexact)]
                        what = (f"weight '{vals[0]}'" if vals else "a weight (changed by another "
                                "op first, or made sparse in f)")
                        msg = (f"jqt: a {name} (a jax.experimental.sparse matmul, at "
                               f"'{stack or '<top>'}') reads {what}: jqt has no rule "
                               "for sparse matmuls, so it stays float. Multi-hot features times "
                               "a table: look the rows up and sum them (an embedding bag, "
                               "jnp.take(table, ids, axis=0) times the per-lookup weights, summed "
                               "over the bag or with jax.ops.segment_sum), which jqt quantizes as "
                               "a lookup; a sparse weight: pass it dense (BCOO.todense()) to quantize it.")
                        self._defer(("sparse", name), msg, f"{what} at '{stack or '<top>'}'")
                    if any(_contains_quantizable(j) for j in compat.jaxprs_in_params(eqn.params)):
                        named = list(dict.fromkeys(paths))
                        reads = (f"; they read weight{'s' if len(named) > 1 else ''} "
                                 f"{', '.join(repr(q) for q in named[:4])}{' ...' if len(named) > 4 else ''}"
                                 if named else "")
                        fix = (f"to quantize these ops, apply jqt to the function {name} calls "
                               "(calibrate it, and call jqt.quantize(g, qparams) inside)")
                        if name == "custom_linear_solve":  # jnp.linalg.solve / inv, or cg
                            fix = ("it is a linear solve: for jnp.linalg.solve or inv these are "
                                   "the solve's own steps, which need float, and nothing is "
                                   "wrong (to quantize a product with an inverse, Glow's "
                                   "z @ inv(W), compute the inverse outside f and pass it in "
                                   "params); for jax.scipy.sparse.linalg's cg, they are the "
                                   "matvec you pass: to quantize it, apply jqt to it (calibrate "
                                   "it, and call jqt.quantize(g, qparams) inside) with weight-only "
                                   "or dynamic activations (w8, w8a8_dynamic: Krylov iterates "
                                   "shrink below a static activation scale); gmres and "
                                   "bicgstab transpose their matvec as they trace it, which a "
                                   "quantized one cannot be (jqt's kernels have no transpose "
                                   "rule, and quantized inputs are not linear): keep theirs float")
                        if name == "pallas_call":  # a kernel's body reads and writes Refs
                            fix = ("a Pallas kernel works on Refs, which jqt cannot quantize "
                                   "inside: to quantize these ops, compute the matmul outside "
                                   "the pallas_call, or write the kernel on integer codes "
                                   "yourself")
                        if name == "custom_partitioning":  # takes no closed-over arrays
                            fix = ("a custom_partitioning function takes no arrays it closes "
                                   "over, and a quantized function closes over its qparams, so "
                                   "jqt cannot run inside it: to quantize these ops, compute the "
                                   "matmul outside the custom_partitioning (pass its result in), "
                                   "or keep them float")
                        msg = (f"jqt: primitive '{name}' (at '{stack or '<top>'}') holds dot_general/conv "
                               f"ops that jqt cannot rewrite: they stay float, with no qparams{reads}. "
                               "jqt quantizes inside jit, closed_call, scan, while, cond, remat, shard_map and "
                               f"custom_jvp/vjp calls only; {fix}.")
                        self._defer(("holds", name), msg, f"'{name}' at '{stack or '<top>'}'")
            if name == "slice" and (ins[0].buffer or ins[0].rolled):
                sliced[eqn.outvars[0]] = ins[0].buffer or ins[0].rolled
            _take(eqn, ins, taken)
            if outs is None and (rolled := _rolled(eqn, ins, sliced)):
                outs = [VarInfo(False, rolled=rolled)]  # only for _near_miss's message
            if outs is None:
                w = all(info.weight for info in ins)
                value = _fold(eqn, ins) if w else None
                # a symbolic dimension's value (jax.export's shapes) is built as iota is
                built = name in ("iota", "dim_as_value") or (w and _all_built(ins))
                outs = [VarInfo(w, built=built, computed=computed_weight(ins),
                                stack_ids=weight_stack_ids(ins, self.shard_ids),
                                rowwise=kvcache.same_along_last(eqn, ins), value=value,
                                **({} if w else _carried_tags(eqn, ins)))] * len(eqn.outvars)
                lost = [i for i in ins if i.indexed in self._matrix_rows.keys() - self._matrix_said]
                if entry is None and not w and outs and not outs[0].indexed and lost:
                    # a weight indexed by the data read by an op jqt does not quantize
                    # (x + pos[s] of a (P, H, Dh) table): float, which nothing said
                    self._read_as_data(name, lost, stack, then="reads it in float, and the weight stays float",
                                       extra=self._matrix_rows[lost[0].indexed])
                    self._matrix_said.update(i.indexed for i in lost)
            for v, info in zip(eqn.outvars, outs):
                if not compat.is_dropvar(v):
                    env[v] = info
        out_infos = [read(v) for v in jaxpr.outvars]
        if top:
            for info in out_infos:
                self._use(info, "float")
            lost = [i for i in out_infos if i.indexed in self._matrix_rows.keys() - self._matrix_said]
            if lost:  # f returns pos[s] of a (P, H, Dh) table: float, which nothing said
                self._read_as_data("value f returns", lost, "<top>", then="is float, and the "
                                   "weight stays float", extra=self._matrix_rows[lost[0].indexed])
            named = self._boundary(plan, out_infos)
            self._boundary_lookalikes(jaxpr, plan.boundary)
            _prune_writes(plan, _cache_keys(plan) | named)
        return plan, out_infos

    def _table_read_as_data(self, op, table, stack):
        """A lookup (``gather``) from a table read as data (``tables[k][ids]`` with ``k`` a
        loop's counter): the table stays float, which the warning says."""
        for field, how, fix in _WEIGHTS_READ_AS_DATA:
            path = getattr(table, field)
            if path and field != "windowed":  # (rows looked up in looked-up rows: data)
                names, what = _named_weights(path)
                also = (" A row of one of stacked tables: index them at once (tables[m, ids], "
                        "tables[m, i]), a lookup jqt quantizes with one scale per row of each "
                        "table." if field == "indexed" else "")
                msg = (f"jqt: a {op} (at '{stack or '<top>'}') looks rows up in {what} {how}; the "
                       f"lookup stays float, as the table{' does' if len(names) == 1 else 's do'}. "
                       f"{fix}{also}")
                self._defer(("data", field, op), msg, f"{what} at '{stack or '<top>'}'")

    def _read_as_data(self, op, ins, stack, then="then stays float", extra="", key=None) -> bool:
        """Warns where an op reads a weight as data (indexed by a loop's counter, masked,
        chosen: each such way once), saying what the op ``then`` is; whether it did.
        ``key``: the op's key, where it is a quantizable op (a rule's key, a report row)."""
        said = False
        for field, how, fix in _WEIGHTS_READ_AS_DATA:
            path = next((getattr(i, field) for i in ins if getattr(i, field)), "")
            if path:
                names, what = _named_weights(path)
                also = "" if field == "windowed" or extra else \
                    f", as the weight{' does' if len(names) == 1 else 's do'}"
                named = f"op '{key}', " if key is not None else ""
                msg = (f"jqt: a {op} ({named}at '{stack or '<top>'}') reads {what} {how}; the op {then}{also}. "
                       f"{fix}{extra if field == 'indexed' else ''}")
                self._defer(("data", field, op), msg, f"{what} at '{stack or '<top>'}'")
                said = True
        return said

    def _defer(self, kind, message, label):
        """A warning about one op: one per ``kind`` for the whole function
        (:func:`diagnostics.grouped`, around the analysis)."""
        diagnostics.warn_grouped(kind, message, label)
        self.warned.append(message)

    def _boundary(self, plan, out_infos) -> set:
        """The caches ``f`` takes and returns (``Plan.boundary``): an output that is an
        argument's buffer after cache writes, which ``f`` also reads (a decode step called
        from a Python loop). Their writes outside any loop take their keys now, in
        evaluation order; the keys of the writes kept."""
        found = {j: (info.buffer[0][1], info.writes) for j, info in enumerate(out_infos)
                 if info.writes and info.buffer and info.buffer[0][0] == CALL
                 and info.buffer[0] in self.reads and not set(info.writes) <= self.weight_writes}
        held = {w for _, ws in found.values() for w in ws}
        names = {}
        for site in plan.all_sites():
            if site.key.startswith(_PENDING) and site.key in held and site.key not in names:
                names[site.key] = self._fallback_key(site.name_stack, "kv_cache")
            site.key = names.get(site.key, site.key)
        _rekey(plan)
        plan.boundary = {j: (k, tuple(dict.fromkeys(names.get(w, w) for w in ws)))
                         for j, (k, ws) in found.items()}
        return set(names.values())

    def _share_remainder(self, plan, scan, used, counters, end):
        """The ops of a ``lax.map`` remainder (equations ``scan+1 .. end-1``) take the keys
        of the scan body's ops, when they are the same ops in the same order (same
        operation, weight and layout, none reading a row of the mapped ``xs`` as its
        weight); otherwise they keep keys of their own."""
        sub = plan.subs.get(scan)
        if sub is None:
            return
        body = list(sub.plans[0].all_sites())
        rest = []
        for j in range(scan + 1, end):
            if j in plan.sites:
                rest.append(plan.sites[j])
            elif j in plan.subs:
                rest.extend(p2 for pl in plan.subs[j].plans for p2 in pl.all_sites())
        sig = [_signature(s, sub.scan_id) for s in body]
        if not body or [_signature(s, sub.scan_id) for s in rest] != sig or any(x[-1] for x in sig):
            return
        self.used_keys, self.counters = used, counters  # release the keys the remainder took
        for r, s in zip(rest, body):
            if r.source is not None:
                uses = self.leaf_uses[(r.source.arg, r.source.leaf)]
                uses.discard(r.key)
                uses.add(s.key)
            r.key = s.key
        _rekey(plan)

    def _site(self, entry, widx, eqn, ins, stack):
        op = entry.name
        src = ins[widx].source if widx is not None else None
        if entry.is_cache and all(b[0] == CALL for b in ins[0].buffer):
            # a write into a buffer f takes, outside any loop that carries it: a cache only
            # where f returns the buffer (_boundary), which is known at the end
            self.call_writes += 1
            key = f"{_PENDING}{self.call_writes}"
        elif src is not None:
            key = self._key(src.path, (src.arg, src.leaf))
        else:
            key = self._fallback_key(stack, "kv_cache" if entry.is_cache else op)
        if widx is None and not entry.is_cache:
            self._read_as_data(op, ins, stack, "is then " + (
                "a convolution with a kernel computed from the data: it stays float"
                if op == "conv_general_dilated" else "an activation x activation op: it "
                "stays float (unless the recipe quantizes those, act_x_act=)"), key=key)
        lost = [i for k, i in enumerate(ins[:2]) if k != widx and i.indexed in self._matrix_rows]
        if widx is not None and lost:  # pos[s] @ w of a (P, H, Dh) table: its row float
            self._read_as_data(op, lost, stack, then="takes it as its activation, and that weight "
                               "stays float", extra=self._matrix_rows[lost[0].indexed], key=key)
            self._matrix_said.update(i.indexed for i in lost)
        if op == "conv_general_dilated" and widx is None and ins[0].weight and not ins[1].weight:
            msg = (f"jqt: a conv_general_dilated (at '{stack or '<top>'}') reads weight "
                   f"'{ins[0].source.path if ins[0].source else '?'}' as its input (lhs), with a "
                   "kernel computed from the data: jqt quantizes a convolution's weight only as its "
                   "kernel (rhs), so this op stays float. If it is jnp.convolve or jnp.correlate "
                   "of a signal shorter than the filter (they take the shorter operand as the "
                   "kernel): pass signals at least as long as the filter, or call "
                   "lax.conv_general_dilated with the filter as the kernel.")
            self._defer(("conv_lhs",), msg, f"'{ins[0].source.path if ins[0].source else '?'}' at "
                        f"'{stack or '<top>'}'")
        other = ins[1 - widx] if op == "dot_general" and widx is not None else None
        # (an operand with no elements is "computed" from the weights alone when f's input is
        # empty, e.g. a gather of no ids traced to zeros: no product of two weights to warn of)
        empty = other is not None and getattr(eqn.invars[1 - widx].aval, "size", 1) == 0
        if other is not None and (other.source is not None or other.computed) and not ins[widx].built \
                and not empty:
            name = lambda i: f"'{i.source.path}'" if i.source is not None else "a computed weight"
            at, a, b = stack or "<top>", name(ins[widx]), name(other)
            self._defer(("products",), f"jqt: a dot_general (at '{at}') multiplies two weights, "
                        f"{a} and {b}: the product does not depend on the data, yet jqt treats "
                        f"{b} as the op's activation and recomputes the product at every call "
                        "(jqt.pack cannot store it). A jnp.einsum of three or more operands "
                        "contracts two weights first at some input shapes (the order its "
                        "optimize= picks depends on them), so other shapes give other ops and "
                        "keys: pass optimize=False, or write it as two einsums. A merged weight "
                        "(LoRA's w + a @ b): merge it into params before calibrating; likewise "
                        "a weight f computes from weights (Glow's P @ L @ U, a product in a power "
                        "iteration): compute it before calling f and pass it in params."
                        + (" An argument passed as a Python number (a diffusion timestep as an "
                           "int) is static to jqt, as one in jax.jit's static_argnums is, and so "
                           "is a value f makes from constants (the timesteps of a lax.scan over "
                           "jnp.arange(steps) or a schedule f builds), so what f computes from it "
                           "and the weights (a timestep embedding sin(params['freq'] * t)) is a "
                           "computed weight too: pass it as an array argument of f "
                           "(jnp.asarray(t), the timesteps a scan runs over) to make it data."
                           if "a computed weight" in (a, b) else ""),
                        f"{a} x {b} at '{at}'")
        for k in range(len(ins)):
            if k != widx:
                self._use(ins[k], "float")
        if src is not None:
            self._use(ins[widx], key)
        return Site(key=key, op=op, eqn=eqn, weight_operand=widx, source=src,
                    stack_ids=ins[widx].stack_ids if widx is not None else (),
                    contract=entry.contract(eqn), entry=entry, name_stack=stack,
                    built=widx is not None and ins[widx].built,
                    zero=ins[widx].zero if widx is not None else
                    entry.is_cache and ins[entry.update_index].zero, call=tuple(self.bodies))

    def _hop(self, plan, i, eqn, ins, stack, unread=frozenset()):
        """A higher-order equation: its bodies analyzed; ``unread``: the indices of its
        outputs that nothing reads (dropped)."""
        name = eqn.primitive.name
        hop = HIGHER_ORDER[eqn.primitive]
        scan_id = -1
        if name in ("scan", "while", "shard_map"):  # a loop's id: its carries are buffers
            # (loop id, slot); a shard_map's: the blocks it splits a weight into
            self.scan_ids += 1
            scan_id = self.scan_ids
            if name == "shard_map":
                self.shard_ids.add(scan_id)
        subs = hop.subs(eqn, ins, scan_id)
        if name == "while":
            if _contains_quantizable(eqn.params["cond_jaxpr"].jaxpr):
                read = sorted({i.source.path for i in ins[:eqn.params["cond_nconsts"]]
                               if i.source is not None})
                self._defer(("while_cond",), f"jqt: the cond_fun of a while_loop at "
                            f"'{stack or '<top>'}' holds a dot_general/conv"
                            f"{f' (reading weights {read})' if read else ''}; jqt leaves it "
                            "float (no op key, not in summarize or report). To quantize it, "
                            "compute the value in the body_fun and carry it to the cond_fun.",
                            f"'{stack or '<top>'}'")
        if name == "scan":  # carries are data inside; a weight carried in is a float use
            nc, nk = compat.scan_counts(eqn)
            for k, info in enumerate(ins[nc:nc + nk]):
                self._use(info, "float")
                self._carry(info, eqn.invars[nc + k], f"a lax.scan at '{stack or '<top>'}'", (scan_id, k))
            consts = ins[:nc]
        if name == "while":
            p = eqn.params
            for info in ins[:p["cond_nconsts"]] + ins[p["cond_nconsts"] + p["body_nconsts"]:]:
                self._use(info, "float")
            c0 = p["cond_nconsts"] + p["body_nconsts"]
            for k, info in enumerate(ins[c0:]):
                self._carry(info, eqn.invars[c0 + k], f"a lax.while_loop at '{stack or '<top>'}'",
                            (scan_id, k))
            consts = ins[:p["cond_nconsts"] + p["body_nconsts"]]
        if name in ("scan", "while"):  # a buffer a loop closes over, or a view of one, is
            for info in consts:  # read (attention block by block in a fori_loop over the
                # cache or its pages, or in a lax.map over a view): the body sees a constant
                self.reads.update(info.buffer + (info.unflat[0] if info.unflat else ()))
        plans, outs, body_outs = [], None, []
        self.loops.append(name)
        call = (getattr(subs[0][0], "jaxpr", subs[0][0]) if len(subs) == 1 and eqn.primitive in
                (compat.jit_p, compat.closed_call_p, compat.call_p) else None)
        if call is not None:  # a missed write's result passed into a call (a jitted
            self._map_missed(eqn.invars, call.invars)  # helper) is still it
        for j, c, inner in subs:
            self.body_ids += 1
            self.bodies.append(self.body_ids)
            sub_plan, sub_outs = self.analyze(j, inner, stack, consts=c)
            self.bodies.pop()
            plans.append(sub_plan)
            body_outs.append(sub_outs)
            if hop.transparent:
                outs = sub_outs
            else:  # what the body returns is read as a value, unless nothing reads it
                for k, info in enumerate(sub_outs):
                    if not _unread_output(eqn, k, unread):
                        self._use(info, "float")
        self.loops.pop()
        if call is not None:  # and one made inside it (jnp.put_along_axis is a jit) comes
            self._map_missed(call.outvars, eqn.outvars)  # out as it
        caches = {}
        if hop.outs is not None:
            found, caches = hop.outs(eqn, ins, body_outs, scan_id, self.reads)
            caches = {k: w for k, w in caches.items() if not set(w) <= self.weight_writes}
            w = all(info.weight for info in ins)
            # a loop or cond over values f builds (iota, scalar literals) builds its outputs:
            # lax.map/fori_loop of a filterbank's rows (a constant its bodies read is a weight)
            built = w and _all_built(ins) and _all_built(
                [info for outs_ in body_outs for info in outs_ if info.weight], empty=True)
            default = VarInfo(w, built=built, computed=computed_weight(ins),
                              stack_ids=weight_stack_ids(ins, self.shard_ids))
            outs = [default if o is None else o for o in found]
        if caches:
            self._cache_lookalikes(eqn, caches, scan_id, stack)
            for k in caches:  # a cache held in the weights (a module carried whole): a cache
                self.carried_caches.update(self._carry_slots.get((scan_id, k), ()))
        for p, names in zip(plans, eqn.params.get("branches_platforms") or ()):
            for site in p.all_sites():  # lax.platform_dependent: the innermost branch's
                if site.platforms == ():
                    site.platforms = names
        keys = [s.key for p in plans for s in p.all_sites()]
        # a call that takes a buffer (jnp.where's and jnp.take's own jit around a cache) is
        # interpreted even with no op in it, so that a quantized cache stays one through it
        takes = (eqn.primitive in (compat.jit_p, compat.closed_call_p, compat.call_p)
                 and any(info.buffer or info.unflat for info in ins))
        if keys or takes:
            carry = _carry_infos(eqn, ins)
            passed = {k: tuple(sorted({b[1] for b in carry[k].buffer if b[0] == CALL}))
                      for k in caches if k < len(carry)}
            plan.subs[i] = Sub(kind=name, plans=plans, keys=keys, scan_id=scan_id, caches=caches,
                               takes_buffer=takes, passed={k: a for k, a in passed.items() if a})
        return outs

    def _map_missed(self, src, dst):
        """Carries :attr:`_missed` from the variables ``src`` to ``dst`` (a call's operands
        to its jaxpr's inputs, or its jaxpr's outputs to its results)."""
        for a, b in zip(src, dst):
            if not compat.is_literal(a) and a in self._missed:
                self._missed[b] = self._missed[a]

    def _near_miss(self, eqn, ins, stack):
        """Records a write that is not a cache write but may be meant as one: into a float
        buffer a loop carries or ``f`` takes, covering part of its last axis; or into such
        a buffer converted to another dtype first (``.at[...].set`` of a float32 value
        into a bfloat16 buffer: JAX converts the whole buffer, writes, converts back)."""
        buf, where = eqn.invars[0], f"'{stack or '<top>'}'" + self._inside()
        if compat.is_literal(buf) or buf.aval.ndim < 2:
            return
        if buf in self._missed:  # a write on top of one missed (keys written in two halves):
            self._missed[eqn.outvars[0]] = self._missed[buf]  # reading it reads that buffer
        if jnp.issubdtype(buf.aval.dtype, jnp.complexfloating) and ins[0].buffer:
            self._missed[eqn.outvars[0]] = ins[0].buffer
            self.cache_near_misses.append((where, ins[0].buffer, (
                f"a {eqn.primitive.name} into a {buf.aval.dtype} buffer of shape "
                f"{tuple(buf.aval.shape)}: quantization is of real numbers, so a complex cache "
                "is not quantized. Cache real values (the keys before a rotary rotation done in "
                "complex numbers, or their real and imaginary parts side by side on the last "
                "axis) to quantize it")))
            return
        if not jnp.issubdtype(buf.aval.dtype, jnp.floating):
            return
        if buf in self._converted:
            src, dst, buffers = self._converted[buf]
            self._missed[eqn.outvars[0]] = buffers
            self.cache_near_misses.append((where, buffers, (
                f"a {eqn.primitive.name} into a {src} buffer converted to {dst} first (a {dst} "
                f"value written with .at[...].set into a {src} cache converts the whole buffer): "
                f"write the value in the buffer's dtype, new.astype(cache.dtype)")))
        elif ins[0].rolled:
            self._missed[eqn.outvars[0]] = ins[0].rolled
            self.cache_near_misses.append((where, ins[0].rolled, (
                f"a {eqn.primitive.name} into slices of a carried buffer concatenated along a "
                "non-last axis (jnp.roll(cache, -1, axis=1) before the write?): the roll makes "
                "a new array, not the buffer, so no cache is found. Shift it in place, "
                "cache.at[:, :-1].set(cache[:, 1:]).at[:, -1].set(new), or keep a ring "
                "buffer written at step % window")))
        elif ins[0].buffer and _elementwise_scatter(eqn) and _fills_vectors(eqn, buf):
            self._missed[eqn.outvars[0]] = ins[0].buffer
            self.cache_near_misses.append((where, ins[0].buffer, (
                f"a {eqn.primitive.name} of single elements that fills whole vectors of a buffer "
                f"of shape {tuple(buf.aval.shape)} (jnp.put_along_axis, or .at[...] indexed "
                "per element?): jqt's cache writes are whole vectors along the last axis; write "
                "them as cache.at[jnp.arange(B), pos].set(new) or with lax.dynamic_update_slice")))
        elif ins[0].buffer and not _elementwise_scatter(eqn):
            self._missed[eqn.outvars[0]] = ins[0].buffer
            upd = eqn.invars[OPS[eqn.primitive].update_index].aval.shape
            self.cache_near_misses.append((where, ins[0].buffer, (
                f"a {eqn.primitive.name} into a buffer of shape {tuple(buf.aval.shape)} that covers "
                f"part of its last axis (update {tuple(upd)}): "
                "jqt's cache vectors lie along the last axis (one scale per token and head); "
                "keep the features last, (..., T, H, D) or (..., H, T, D), and write whole vectors")))

    def near_misses(self) -> list:
        """``(where, why)`` of the writes :meth:`_near_miss` recorded into buffers that
        some op also reads, before or after the write (a cache; not a buffer of results
        the loop only collects); ``where``: the name stack quoted, and the loops around
        the write (``"'<top>' inside a lax.scan"``)."""
        return list(self.near_miss_buffers())

    def near_miss_buffers(self) -> dict:
        """:meth:`near_misses` with the buffers of each: ``(where, why) -> [(loop id or
        CALL, carry slot or argument leaf)]`` (for a message that names them)."""
        read = self.reads | self._missed_reads
        out = {}
        for w, bufs, why in self.cache_near_misses:
            if set(bufs) & read:
                seen = out.setdefault((w, why), [])
                seen += [b for b in bufs if b not in seen]
        return out

    def _inside(self) -> str:
        """The loops around the equation analyzed, innermost first: `` inside a lax.scan
        inside a lax.while_loop`` (empty outside any)."""
        return "".join(f" inside a {_LOOP_NAMES[n]}" for n in reversed(self.loops) if n in _LOOP_NAMES)

    def _cache_lookalikes(self, eqn, caches, loop_id, stack):
        p = eqn.params
        if eqn.primitive.name == "scan":
            nc, nk = compat.scan_counts(eqn)
            carries = eqn.invars[nc:nc + nk]
        else:
            carries = eqn.invars[p["cond_nconsts"] + p["body_nconsts"]:]
        kinds = {(carries[k].aval.shape, carries[k].aval.dtype) for k in caches}
        # which loop: a scan nested in a while_loop's body carries slots of its own
        where = self._inside()
        for k, v in enumerate(carries):
            if k not in caches and (v.aval.shape, v.aval.dtype) in kinds and (loop_id, k) in self.reads \
                    and ((loop_id, k) not in self.accumulators or (loop_id, k) in self.whole_reads):
                self.cache_lookalikes.append(
                    (f"a {_LOOP_NAMES.get(eqn.primitive.name, eqn.primitive.name)}{where} at '{stack or '<top>'}' carries",
                     f"in carry slot {k}", v.aval, loop_id, (loop_id, k)))

    def _boundary_lookalikes(self, jaxpr, boundary):
        """:meth:`_cache_lookalikes` for the caches ``f`` takes and returns (a decode step
        called from a Python loop): an argument of a cache's shape and dtype that ``f``
        reads, and an output of that type that is no cache."""
        if not boundary:
            return
        ins = jaxpr.invars
        args = {k for k, _ in boundary.values()}
        kinds = {(ins[k].aval.shape, ins[k].aval.dtype) for k in args}
        outs = {(v.aval.shape, v.aval.dtype) for j, v in enumerate(jaxpr.outvars) if j not in boundary}
        for k, v in enumerate(ins):
            kind = (v.aval.shape, v.aval.dtype)
            if k not in args and kind in kinds and kind in outs and (CALL, k) in self.reads \
                    and ((CALL, k) not in self.accumulators or (CALL, k) in self.whole_reads):
                self.cache_lookalikes.append(("f takes and returns (a step called from a Python loop)",
                                              "among its arguments and results", v.aval, CALL, (CALL, k)))


_LOOP_NAMES = {"scan": "lax.scan", "while": "lax.while_loop"}  # the loops jqt names in warnings


def _unread_output(eqn, k, unread) -> bool:
    """Whether output ``k`` of a higher-order equation's body feeds nothing: a
    ``lax.scan``'s stacked output or a ``cond``'s or ``shard_map``'s output that nothing
    outside reads (``unread``: a ``jax.checkpoint`` body in a scan that passes its weight
    slice back out, as ``nnx.remat`` does); not a loop's carry, which the next iteration
    reads."""
    if eqn.primitive.name == "while":
        return False
    if eqn.primitive.name == "scan" and k < compat.scan_counts(eqn)[1]:
        return False
    return k in unread


def _carry_infos(eqn, ins) -> list:
    """The infos of a loop's initial carries (those its ``caches`` slots index), ``[]``
    for another equation."""
    p = eqn.params
    if eqn.primitive.name == "while":
        return ins[p["cond_nconsts"] + p["body_nconsts"]:]
    if eqn.primitive.name == "scan":
        consts, carries = compat.scan_counts(eqn)
        return ins[consts:consts + carries]
    return []


def _cache_keys(plan) -> set:
    keys = set()
    for sub in plan.subs.values():
        for writes in sub.caches.values():
            keys.update(writes)
        for p in sub.plans:
            keys |= _cache_keys(p)
    return keys


def _elementwise_scatter(eqn) -> bool:
    """A scatter of single elements (``seen.at[rows, tok].set(1.0)``: a presence penalty's
    or a mask's buffer), no vectors: no cache written along the wrong axis."""
    return eqn.primitive.name.startswith("scatter") \
        and not eqn.params["dimension_numbers"].update_window_dims


def _fills_vectors(eqn, buf) -> bool:
    """Whether an elementwise scatter into ``buf`` writes updates of its rank that span
    its whole last axis (``jnp.put_along_axis`` of a token's vectors, its index broadcast
    to them): a cache write in a form jqt does not take; not a mask's single elements, nor
    a 2-D buffer's rows rewritten (a top-p mask, beam scores re-sorted)."""
    upd = eqn.invars[OPS[eqn.primitive].update_index].aval.shape
    shape = buf.aval.shape
    return len(upd) == len(shape) > 2 and upd[-1] == shape[-1] > 1  # ((B, V) masks and
    # beam scores aside: a cache has tokens, heads or features besides its batch)


def _unflat(eqn, first):
    """``VarInfo.unflat`` of a ``reshape`` or ``gather`` of whole vectors (their last axis
    kept) of a buffer, or of such a view of one: beam search's reorder in the t5x style
    (``cache.reshape(L, B, K, ...)``, the beams gathered, reshaped back); also of the other
    relabellings (:func:`kvcache.is_relabel`: ``cache[None]`` into a batched step,
    ``new[0]`` out); None otherwise."""
    if first is None or not (eqn.primitive is compat.gather_p and kvcache.is_read_view(eqn)
                             or kvcache.is_relabel(eqn)):
        return None
    if first.unflat or not first.buffer:
        return first.unflat or None
    return (first.buffer, first.writes, eqn.invars[0].aval.shape)


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
        if not sub.keys and not sub.takes_buffer:
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
