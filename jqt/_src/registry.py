"""The registry of quantizable primitives: one entry per primitive object.

An entry says everything jqt knows about one primitive, and the analysis,
calibration, both execution paths and :func:`jqt.pack` read only this table:

* ``is_site(eqn, infos)``: whether the equation is quantized at all (a lookup
  needs a weight table, a cache write a loop-carried buffer);
* ``weight_operand(eqn, infos)``: which operand is the weight (``None``: both
  operands are data);
* ``contract(eqn)``: per operand, the axes that share one scale;
* ``weight_type(rule)`` / ``act_type(rule)``: which fields of a
  :class:`jqt.Rule` apply;
* ``groups(site)``: the axis a weight's per-group scales run along, or ``None``
  when the op cannot take them;
* ``integer(site, eqn, ops, policy)``: the integer kernel (``ops`` holds a
  :class:`jqt.QArray` per quantized operand, the float array otherwise);
  ``takes_wide(site, eqn, ops, policy)``: whether it takes an int16 activation's codes whole
  (else they arrive as two int8 halves, ``dense.int16_halves``);
* ``grid_operand(site_source, op_qparams, operand)``: the weight as its codes are
  computed from it (with the op's outlier transforms, ``transforms.py``, applied) and the
  axis its groups run along;
* ``pack(site_source, op_qparams, operand, policy)``: the packed layout of its weight
  (with the op's outlier transforms folded in);
* ``optional``: whether qparams may lack the op's entry (made before jqt quantized
  such ops: key/value cache writes, scalar-index lookups), which then runs float.

``RowLookup`` (``dynamic_slice``: ``table[i]``, ``tables[m, i]`` with scalar indices) is a
``Gather`` of one row, its integer rule that gather.
``CacheWrite`` (``dynamic_update_slice``, ``scatter``) is the third kind: a write
into a key/value cache (``kvcache.py``), typed by ``Rule.kv_cache``.

The documented default, for a primitive with no entry, is to run it unchanged
in float. Adding a primitive means adding an entry here and its kernel.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from . import compat, groups, kernels, ragged, transforms
from . import numerics as nx
from .dense import DenseAxes
from .formats import pack_nibbles

_I32 = jnp.int32


def _pick_weight(ins):
    w_ops = [k for k in (0, 1) if ins[k].weight]
    if len(w_ops) == 2:  # both constant: the learned one (not a matrix f builds from iota,
        # p["w"] @ sinusoid_cf) is the weight; else the second (rhs)
        learned = [k for k in (0, 1) if not ins[k].built]
        w_ops = learned if len(learned) == 1 else [1]
    return w_ops[0] if w_ops else None


class Contraction:
    """``dot_general`` and ``conv_general_dilated``: a weight and an activation
    (or two activations), contracted."""

    needs_weight = False
    is_cache = False
    optional = False
    reads_layer_views = True  # kernels.run takes a LayerView weight (layerview.py)

    def __init__(self, prim):
        self.prim, self.name = prim, prim.name

    def is_site(self, eqn, ins):
        return True

    def weight_operand(self, eqn, ins):
        w = _pick_weight(ins)
        if self.name == "conv_general_dilated" and w == 0:
            return None  # a conv with a constant input and a data kernel: act x act
        return w

    def contract(self, eqn):
        ndims = [len(v.aval.shape) for v in eqn.invars]
        if self.name == "dot_general":
            (lc, rc), _ = eqn.params["dimension_numbers"]
            return (tuple(lc), tuple(rc))
        dn = eqn.params["dimension_numbers"]
        # a conv's activation scale may vary only along the batch axis (per example);
        # its weight scale along the output features.
        return (tuple(d for d in range(ndims[0]) if d != dn.lhs_spec[0]),
                tuple(d for d in range(ndims[1]) if d != dn.rhs_spec[0]))

    @staticmethod
    def weight_type(rule):
        return rule.weight

    @staticmethod
    def act_type(rule):
        return rule.activation

    @staticmethod
    def live_rows(invals):
        """How many leading rows of the activation the op reads (traced), or ``None``:
        all of it. A static activation's calibrator observes only those."""
        return None

    def groups(self, site):
        """Grouped scales run along the weight's innermost contracted axis (the highest:
        in K, :func:`dense.group_order`) of a dot_general, with or without batch axes
        (a weight with batch axes, e.g. a mixture's experts, runs the kernels of
        ``experts.py``)."""
        w = site.weight_operand
        if self.name != "dot_general" or not site.contract[w]:
            return None
        return max(site.contract[w])

    def integer(self, site, eqn, ops, policy):
        return [kernels.run(site, eqn, ops, policy)]

    def takes_wide(self, site, eqn, ops, policy):
        """Whether :meth:`integer` takes an int16 activation's codes whole under ``policy``
        (else the caller splits them into int8 halves, ``dense.int16_halves``)."""
        return kernels.takes_wide(site, eqn, ops, policy)

    def grid_operand(self, src, p, operand):
        """``(weight, group axis)``: the weight operand as its codes are computed from it, with
        the op's outlier transforms (smoothing, rotation) applied, and the axis its
        grouped scales run along (``None``: not grouped), before stacked axes."""
        q = p.operand(p.weight_operand)
        operand = transforms.weight(operand, p.smooth, p.rotate, src.contract, src.stack_depth)
        return operand, (max(src.contract) if q.qtype.group_size else None)

    def packed_along(self, shape, contract, batch):
        """The length of the weight's axis (``shape`` unstacked) :meth:`pack` packs 4-bit
        codes two per byte along, 0 where it keeps one code per byte: K of a matmul's 2-D
        layout, the last axis of a weight with batch axes (experts, ``experts.py``); never
        a convolution's kernel. ``calibrate`` counts a weight's bytes by it.

        >>> BY_NAME["dot_general"].packed_along((6, 4), (0,), ())
        6
        >>> BY_NAME["conv_general_dilated"].packed_along((3, 3, 8, 16), (0, 1, 2), ())
        0
        """
        if self.name != "dot_general":
            return 0
        return shape[-1] if batch else math.prod(shape[c] for c in contract)

    def pack(self, src, p, operand, policy, grid=None):
        """The weight's codes in the layout its kernel reads (``policy.dense_layout``):
        2-D ``"nk"`` or ``"kn"`` for a matmul, the op's own layout otherwise; nibbles
        packed along K. ``grid``: :meth:`grid_operand`'s result, where the caller has it."""
        depth = src.stack_depth
        q = p.operand(p.weight_operand)
        g = q.qtype.group_size
        # outlier transforms (smoothing, rotation) are folded into the stored weight
        operand, gaxis = grid or self.grid_operand(src, p, operand)
        qv = _quantize_weight(operand, q, gaxis, depth)
        act = p.operand(1 - p.weight_operand)
        # the weight's sums over K correct for the activation's zero point; without one
        # (weight-only, fp8, symmetric activations) they are not stored
        sums = act is not None and (act.zero_point is not None
                                    or (act.qtype.dynamic and not act.qtype.symmetric))
        if self.name != "dot_general" or src.batch:
            # grouped: the kernel sums each group itself (experts.py)
            wsum = jnp.sum(qv, axis=tuple(a + depth for a in src.contract), keepdims=True,
                           dtype=_I32) if sums and not g else None
            if q.qtype.nibbles_fit(self.packed_along(qv.shape[depth:], src.contract, src.batch)):
                qv = pack_nibbles(qv, qv.ndim - 1)  # read packed by experts.py (unpacked by
                # intdot.to_operand elsewhere)
            return dataclasses.replace(q, values=qv, sums=wsum, layout="operand")
        layout = policy.dense_layout(q.qtype, None if act is None else act.qtype)
        ax = DenseAxes.for_weight(src.contract, qv.ndim - depth, p.weight_operand, grouped=bool(g))
        q2 = ax.weight_2d(qv, layout, depth)
        kdim = depth + (1 if layout == "nk" else 0)
        wsum = None
        if sums and g:  # per-group sums: (..., N, G) for "nk", (..., G, N) for "kn"
            wsum = jnp.sum(compat.grouped(q2, kdim, g), axis=kdim + 1, dtype=_I32)
        elif sums:
            wsum = jnp.sum(q2, axis=kdim, dtype=_I32)
        if q.qtype.nibbles_fit(self.packed_along(qv.shape[depth:], src.contract, ())):
            # else one int8 code per byte
            q2 = pack_nibbles(q2, kdim)
        return dataclasses.replace(q, values=q2, sums=wsum, layout=layout)


def _quantize_weight(operand, q, gaxis, depth):
    shape = operand.shape
    s, z = q.scale, q.zero_point
    if q.qtype.group_size and gaxis is not None:
        s = groups.expand(s, q.qtype.group_size, gaxis + depth, shape)
        z = groups.expand(z, q.qtype.group_size, gaxis + depth, shape)
    return nx.quantize(operand, nx.per_layer(s, len(shape)), nx.per_layer(z, len(shape)), q.qtype)


class Gather:
    """``gather`` from a weight by data-dependent indices: an embedding lookup,
    quantized weight-only with one scale per row (or per group of a row). Not
    ``optional``: qparams without an entry for a lookup are refused, naming both of their
    causes (made for another function, or by a jqt from before lookups were quantized),
    since either would leave the lookup float without a word."""

    needs_weight = True
    is_cache = False
    optional = False
    reads_layer_views = False
    name = "gather"

    def __init__(self, prim):
        self.prim = prim

    def is_site(self, eqn, ins):
        return self.weight_operand(eqn, ins) is not None

    def weight_operand(self, eqn, ins):
        # a gather of a weight by constant indices is a layout op (slicing), not a lookup
        return 0 if ins[0].weight and not ins[1].weight else None

    def index_operands(self, eqn):
        """The operands that hold the lookup's indices (the ids)."""
        return range(1, len(eqn.invars))

    def contract(self, eqn):
        """The table's axes that each lookup reads whole (the embedding features);
        the scale is shared along them, one per row. Axes read whole ahead of the first
        indexed one, where some read whole follow it, are stacked tables (an ensemble's
        members under ``jax.vmap`` with shared ids, ``emb[:, ids]``): one scale per row of
        each, not one shared by every member's row (a member of small values rounded to
        0). A lookup of whole matrices (``w[expert_ids]``: every axis read whole follows
        the indexed one) keeps one scale per matrix."""
        shape = eqn.invars[0].aval.shape
        sizes = eqn.params["slice_sizes"]
        full = [d for d in range(len(shape)) if sizes[d] == shape[d] and shape[d] > 1]
        # (an outer vmap's per-member ids batch the operand: its batching axes are members)
        batching = set(getattr(eqn.params.get("dimension_numbers"), "operand_batching_dims", ()))
        indexed = [d for d in range(len(shape)) if sizes[d] < shape[d] and d not in batching]
        if indexed and any(d > indexed[0] for d in full):
            full = [d for d in full if d > indexed[0]]
        return (tuple(full), ())

    @staticmethod
    def weight_type(rule):
        return rule.embedding

    @staticmethod
    def act_type(rule):
        return None

    def groups(self, site):
        c = site.contract[0]
        return c[-1] if c else None

    def integer(self, site, eqn, ops, policy):
        return [kernels.gather(site, eqn, ops)]

    def takes_wide(self, site, eqn, ops, policy):
        return False  # no quantized activation

    def grid_operand(self, src, p, operand):
        """``(table, group axis)``: a lookup's table is quantized as it is, grouped (where
        its type has groups) along the last axis a lookup reads whole."""
        return operand, (src.contract[-1] if src.contract else None)

    def packed_along(self, shape, contract, batch):
        """The table's last axis where a lookup reads it whole (its codes pack two per byte
        along it), else 0."""
        return shape[-1] if contract and contract[-1] == len(shape) - 1 else 0

    def pack(self, src, p, operand, policy, grid=None):
        depth = src.stack_depth
        q = p.operand(0)
        operand, gaxis = grid or self.grid_operand(src, p, operand)
        qv = _quantize_weight(operand, q, gaxis, depth)
        if q.qtype.nibbles_fit(self.packed_along(qv.shape[depth:], src.contract, ())):
            qv = pack_nibbles(qv, qv.ndim - 1)
        return dataclasses.replace(q, values=qv, sums=None, layout="operand")


class RowLookup(Gather):
    """``dynamic_slice`` of one row (or column) of a 2-D weight, or of one row (the last
    axis read whole) of a stacked table ``(E, V, D)``, at indices computed from the data:
    ``table[i]`` or ``tables[m, i]`` with scalar indices (a decode step's token, a
    position), which JAX traces to a ``dynamic_slice`` where ``table[ids]`` traces to a
    ``gather``; ``tables[:, t]`` (a row of each stacked table) too. It is that lookup: op
    ``"gather"`` in the qparams, the same scales (one per row of each stacked table,
    :meth:`contract`), packed table and rule
    (``Rule.embedding``), and the integer path runs it as the gather of that row. So is a
    window of rows at a data index (``lax.dynamic_slice_in_dim(pos_emb, start, T)``: a
    learned positional table read at a decode step's position), and a part of a row
    (``t[i, a:b]``), which is kept float with a warning as ``t[ids, a:b]`` is. A slice
    of whole matrices (``w[layer]`` in a loop) is not a lookup but a view of a layer's
    weight (its matmul is the site). qparams made before jqt quantized these lookups have
    no entry for them: they then run float, as they did (``optional``)."""

    optional = True

    @staticmethod
    def axes(eqn):
        """The table axes the slice indexes (a row, a window of rows, or a part of one; its
        other axes read whole), or ``None``."""
        shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
        if len(shape) < 2 or not all(isinstance(d, int) for d in shape):
            return None  # (a symbolic dimension, jax.export's: data, never a weight table)
        if not all(isinstance(d, int) for d in sizes):
            # a window of a symbolic length (jax.export's prefill of any length at a start):
            # read as one shorter than its axis (2 <= it, a window, where the axis allows)
            if len(shape) == 2:
                return (0,) if sizes[1] == shape[1] else None
            sizes = tuple(d if isinstance(d, int) else max(shape[i] - 1, 2) for i, d in enumerate(sizes))
        if len(shape) == 2:
            # a row or a window of rows (as long as the table too: a prefill of every
            # position, the start clamped to 0), or one column, read whole
            a = next((a for a in (0, 1) if (sizes[a] < shape[a] or a == 0 and sizes[a] == shape[a])
                      and (sizes[a] == 1 or a == 0) and sizes[1 - a] == shape[1 - a]), None)
            if a is not None:
                return (a,)
            # part of a row (t[i, a:b]) or of a window of rows, or one element: a site that
            # stays float, noted
            return (0, 1) if sizes[0] < shape[0] and sizes[1] < shape[1] else None
        lead = range(len(shape) - 1)
        whole = [d for d in lead if sizes[d] == shape[d] > 1]
        indexed = [d for d in lead if sizes[d] < shape[d]]
        literal = [compat.is_literal(v) for v in eqn.invars[1:]]
        if sizes[-1] == shape[-1] and literal[-1]:
            # a window as long as its axis at a start from the data (a prefill of every
            # position of a (1, P, D) or stacked (E, P, D) table, tables[m, s:s+P]), as in
            # 2-D above: one whole axis's start not a literal, after the indexed axes (with
            # none indexed, every other start a literal)
            extra = [d for d in whole if not literal[d]]
            if len(extra) == 1 and all(d < extra[0] for d in indexed) \
                    and (indexed or sum(not a for a in literal) == 1):
                indexed, whole = sorted(indexed + extra), [d for d in whole if d != extra[0]]
        if not indexed or any(d > indexed[0] for d in whole):
            return None  # a whole axis after an indexed one: a matrix (a layer's weight)
        # (whole axes ahead of the indexed ones: stacked tables, tables[:, t] a row of each)
        axes = tuple(d for d in lead if shape[d] > 1 and d not in whole)
        if not axes or any(shape[d] == 1 for d in range(axes[-1] + 1, len(shape) - 1)):
            return None  # (L, 1, N) read at [i]: a whole matrix of one row, a layer's weight
        return axes + ((len(shape) - 1,) if sizes[-1] < shape[-1] else ())

    def contract(self, eqn):
        """As :meth:`Gather.contract`, the indexed axes those of :meth:`axes` (a window as
        long as the table is indexed too: a prefill of every position)."""
        axes, shape = self.axes(eqn) or (), eqn.invars[0].aval.shape
        full = [d for d in range(len(shape)) if d not in axes and shape[d] > 1]
        if axes and any(d > axes[0] for d in full):
            full = [d for d in full if d > axes[0]]
        return (tuple(full), ())

    def index_operands(self, eqn):
        """The start indices of the indexed axes (the others are the whole axes' zeros)."""
        return [1 + a for a in self.axes(eqn) or ()]

    def weight_operand(self, eqn, ins):
        axes = self.axes(eqn) if ins[0].weight else None
        shape, sizes = eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
        if any(a < len(shape) - 1 and sizes[a] == shape[a] and ins[1 + a].weight for a in axes or ()):
            return None  # a window as long as its axis at a constant start (a computed 0): the
            # whole axis read, a matrix (w[l] of stacked layers), not a lookup
        idx = [ins[1 + a] for a in axes or ()]
        # some index from the data; the others too, or constants (tables[0, t]: a literal;
        # lax.dynamic_slice(t, (i, 0), ...): a literal 0)
        return 0 if idx and any(not i.weight for i in idx) \
            and not any(i.weight and not (i.built or i.zero) for i in idx) else None

    @classmethod
    def window(cls, eqn) -> bool:
        """Whether the slice reads several whole rows (a window) at a data index."""
        axes, shape, sizes = cls.axes(eqn), eqn.invars[0].aval.shape, eqn.params["slice_sizes"]
        return bool(axes) and sizes[-1] == shape[-1] \
            and any(a < len(shape) - 1 and sizes[a] != 1 for a in axes)

    def integer(self, site, eqn, ops, policy):
        axes = self.axes(eqn)
        table = eqn.invars[0].aval
        sizes = tuple(eqn.params["slice_sizes"])
        geqn = compat.row_gather_eqn(tuple(table.shape), str(table.dtype), axes, sizes)
        idx = []
        for a in axes:
            i = ops[1 + a]
            if jnp.iinfo(i.dtype).max > jnp.iinfo(_I32).max:  # int64, uint32: clamped, not wrapped
                i = jnp.clip(i, 0, table.shape[a] - 1)
            idx.append(jnp.reshape(i.astype(_I32), ()))
        if geqn.invars[1].aval.shape[-1:] == (1,) and len(table.shape) == 2 and axes == (0,):
            # rows at ids (table[ids]): a window's (or one row's) start clamped as
            # dynamic_slice clamps it
            start = jnp.clip(idx[0], 0, table.shape[0] - sizes[0])
            idx = (start + lax.iota(_I32, sizes[0]))[:, None]
        else:
            idx = jnp.reshape(jnp.stack(idx), geqn.invars[1].aval.shape)
        return [kernels.gather(site, geqn, [ops[0], idx])]


class RaggedDot(Contraction):
    """``lax.ragged_dot(x, w, group_sizes)`` (``ragged_dot_general`` in that form,
    :func:`compat.is_plain_ragged_dot`): a mixture of experts' grouped matmul, rows of
    ``x (M, K)`` sorted by expert against ``w (G, K, N)``. The weight is quantized per
    expert and output channel (or per group of K), the activation per tensor or per row;
    the kernel is ``ragged.py``'s. Other forms (a ragged contraction, as in the
    backward pass) are not sites: they run float, and the analysis says so. qparams
    made before jqt quantized these ops have no entry for them: they then run float, as
    they did (``optional``)."""

    optional = True
    reads_layer_views = False

    def is_site(self, eqn, ins):
        return compat.is_plain_ragged_dot(eqn) and self.weight_operand(eqn, ins) is not None

    def weight_operand(self, eqn, ins):
        return 1 if ins[1].weight and not ins[0].weight else None

    def contract(self, eqn):
        return ((1,), (1,))

    def groups(self, site):
        return 1

    @staticmethod
    def live_rows(invals):
        """The rows in an expert: rows past ``sum(group_sizes)`` (the padding of a sorted
        token buffer) give zeros, whatever they hold, so calibration does not see them."""
        return ragged.live_count(invals[2], invals[0].shape[0])

    def integer(self, site, eqn, ops, policy):
        return ragged.run(site, eqn, ops, policy)

    def takes_wide(self, site, eqn, ops, policy):
        return False

    def grid_operand(self, src, p, operand):
        """The weight as it is (no outlier transforms), grouped along K."""
        q = p.operand(p.weight_operand)
        return operand, (1 if q.qtype.group_size else None)

    def packed_along(self, shape, contract, batch):
        """N, the last axis: the codes pack two per byte along it."""
        return shape[-1]

    def pack(self, src, p, operand, policy, grid=None):
        """The codes in the op's layout, int4 two per byte along N (where N is even)."""
        depth = src.stack_depth
        q = p.operand(1)
        operand, gaxis = grid or self.grid_operand(src, p, operand)
        qv = _quantize_weight(operand, q, gaxis, depth)
        if q.qtype.nibbles_fit(self.packed_along(qv.shape[depth:], src.contract, ())):
            qv = pack_nibbles(qv, qv.ndim - 1)
        return dataclasses.replace(q, values=qv, sums=None, layout="operand")


class CacheWrite:
    """``dynamic_update_slice`` and ``scatter`` (``.at[...].set``) of data into a buffer
    that a loop carries (a key/value cache): the written vectors are quantized with
    one scale per vector of the buffer's last axis (``kvcache.py``). A write is a
    site only when its buffer is a loop carry (or a scan's slice of one) and it
    covers the whole last axis."""

    needs_weight = True
    is_cache = True
    optional = True
    reads_layer_views = False

    def __init__(self, prim, update_index):
        self.prim, self.name, self.update_index = prim, prim.name, update_index

    def weight_operand(self, eqn, ins):
        return None

    def is_site(self, eqn, ins):
        buf, upd = eqn.invars[0].aval, eqn.invars[self.update_index].aval
        if not ins[0].buffer or buf.ndim < 2 \
                or not jnp.issubdtype(buf.dtype, jnp.floating):
            return False
        if self.name == "dynamic_update_slice":
            return upd.shape[-1] == buf.shape[-1]
        dn = eqn.params["dimension_numbers"]
        last = buf.ndim - 1
        # the last axis a window axis spanned whole (an index into it, as a batched
        # dynamic_update_slice has, can only be 0: the codes and scales take the same)
        return (last not in dn.inserted_window_dims
                and last not in dn.operand_batching_dims and bool(dn.update_window_dims)
                and upd.shape[dn.update_window_dims[-1]] == buf.shape[-1]
                and eqn.params.get("update_jaxpr") is None)

    def contract(self, eqn):
        return ((len(eqn.invars[0].aval.shape) - 1,), ())

    @staticmethod
    def weight_type(rule):
        return None

    @staticmethod
    def act_type(rule):
        return rule.kv_cache

    def groups(self, site):
        return None


OPS = {
    compat.dot_general_p: Contraction(compat.dot_general_p),
    compat.conv_general_dilated_p: Contraction(compat.conv_general_dilated_p),
    compat.gather_p: Gather(compat.gather_p),
    compat.dynamic_slice_p: RowLookup(compat.dynamic_slice_p),
    compat.dynamic_update_slice_p: CacheWrite(compat.dynamic_update_slice_p, 1),
    compat.scatter_p: CacheWrite(compat.scatter_p, 2),
}
if compat.ragged_dot_general_p is not None:
    OPS[compat.ragged_dot_general_p] = RaggedDot(compat.ragged_dot_general_p)
"""Primitive -> entry. A primitive not listed runs unchanged (float)."""

NAMES = tuple(dict.fromkeys(e.name for e in OPS.values()))  # a row lookup is a "gather"
BY_NAME = {n: next(e for e in OPS.values() if e.name == n) for n in NAMES}
# the ops that sum products (a narrow accumulator's, a quantized model's integer products)
CONTRACTIONS = tuple(n for n, e in BY_NAME.items() if isinstance(e, Contraction))
