"""A dense op on rows: the formulation the kernel policy picks for ``M`` rows, and
``jax.vmap`` over the activation merged into the rows.

:func:`jqt._src.kernels.run` turns a dense op's activation into rows ``(M, K)`` (a float
array, or a :class:`jqt.QArray` of codes with one scale, or one per row) and its weight
into a 2-D :class:`jqt.QArray`; :func:`formulate` picks the formulation for ``M`` rows:
jqt's native kernels, the digits of the activation, an int8 or bfloat16 matmul, or the
weight decoded for a float matmul (docs/performance.md).

Under ``jax.vmap`` over the activation alone, the policy would see one example's rows,
while the compiled program runs all of them at once: a ``w8a8`` op vmapped over 128
single-row examples picked the native GEMV kernel for one row, whose batching rule then
fell back to a float formulation of 128 rows, where one call of 128 rows runs an int8
matmul (1.08-1.51x its time, docs/performance.md). So
:func:`run` binds such an op as ``jqt_dense_rows``, whose batching rule merges the batch
into the rows and picks the formulation for all of them (as many rows as the program
runs). The primitive lives only under the batch trace: without ``vmap`` the formulation is
traced inline, and the jaxpr shows its operations.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import compat, dense, gemv, native
from .dense import DenseAxes
from .layerview import LayerView
from .qparams import QArray

_F32 = jnp.float32
ROWS = DenseAxes((0,), (1,), (), (), 1)
"""The axes of an activation already in rows: ``(M, K)``, per-row arrays ``(M, 1)``."""


def formulate(x2, w2: QArray, stack: LayerView | None, policy, precision=None):
    """``x2 (M, K) @ w2`` in float32 ``(M, N)``, by the formulation ``policy`` picks for
    ``M`` rows. ``x2``: float rows, or a QArray of codes (its scale and zero point one
    value, or ``(M, 1)``); ``w2``: the weight in the layout the policy reads;
    ``stack``: the stacked layers ``w2`` is one of, which the native kernels read in
    place, or None."""
    ax = ROWS
    int_act = isinstance(x2, QArray)
    x_vals = x2.values if int_act else x2
    m = x_vals.shape[0]
    m = m if isinstance(m, int) else -1  # a symbolic row count (jax.export)
    if 0 in compat.sharded_dims(x_vals) or 1 in compat.sharded_dims(x_vals):
        # rows or the contraction (a row-parallel layer) split over an explicit mesh axis:
        # the formulations that keep them as they are (the few-row ones stack and reshape
        # rows, and outside jax.set_mesh JAX could not type their split contraction)
        m = -1
    grouped = bool(w2.qtype.group_size)
    wide = int_act and x2.values.dtype == jnp.int16  # w8a16's codes whole (kernels.takes_wide)
    if native.applies(w2, m, policy, int_act, x2.qtype.bits if int_act else 8) and (
            not int_act or x2.qtype.kind == "int"
                                                   or x2.qtype.kind == w2.qtype.kind == "float"):
        if int_act:  # the codes as floats (fp8: decoded), the activation's scale split around the kernel
            lo, hi = dense.split_scale(x2.scale.astype(_F32))
            return native.dense_rows(dense.float_codes(ax, x2) * lo, w2, policy, stack) * hi
        return native.dense_rows(x2, w2, policy, stack)
    if wide and policy.int16_as_float:  # the codes in float32 (exact), one float matmul
        return dense.int_codes_as_float(ax, x2, w2, policy)
    if wide:  # two int8 x int8 contractions (dense.int16_halves), in float32
        hi, lo = dense.int16_halves(x2)
        return 256.0 * formulate(hi, w2, stack, policy, precision) + formulate(lo, w2, stack, policy, precision)
    if not int_act:
        if gemv.weight_only_applies(w2, m, policy, x2.dtype):
            return gemv.weight_only(ax, x2, w2, policy)
        return dense.weight_only_dense(ax, x2, w2, policy, precision)
    if w2.qtype.kind == "float":
        return dense.fp8_dense(ax, x2, w2, policy)
    if grouped and x2.qtype.kind == "int" and dense.reduces(m, policy):
        return dense.int_codes_as_float(ax, x2, w2, policy)
    if grouped and gemv.grouped_applies(w2, m, policy):
        return gemv.int_grouped(ax, x2, w2, policy)
    if grouped and dense.grouped_as_float(m, w2, policy):
        return dense.int_codes_as_float(ax, x2, w2, policy)
    if grouped:
        return dense.int_dense_grouped(ax, x2, w2, policy)
    return dense.int_dense(ax, x2, w2, policy)


def as_rows(ax: DenseAxes, x):
    """The activation of a dense op with axes ``ax`` as rows (see :func:`formulate`)."""
    if not isinstance(x, QArray):
        return ax.act_2d(x)
    return dataclasses.replace(x, values=ax.act_2d(x.values), scale=ax.act_vec(x.scale),
                               zero_point=ax.act_vec(x.zero_point))


def run(x2, w2: QArray, stack: LayerView | None, policy, precision=None):
    """:func:`formulate`, for all the rows of a ``jax.vmap`` over ``x2`` (see the module
    docstring)."""
    if not compat.is_vmapped(x2.values if isinstance(x2, QArray) else x2):
        return formulate(x2, w2, stack, policy, precision)
    xs, x_tree = jax.tree_util.tree_flatten(x2)  # the rows first, then one value or one per row
    ws, w_tree = jax.tree_util.tree_flatten((w2, None if stack is None else (stack.full, stack.index)))
    return rows_p.bind(*xs, *ws, x_tree=x_tree, w_tree=w_tree, policy=policy, precision=precision,
                       n=w2.values.shape[0 if w2.layout == "nk" else 1])


def _weight(w_tree, leaves):
    """The weight and its stack (or None) from the primitive's operands after the rows'."""
    w2, st = jax.tree_util.tree_unflatten(w_tree, leaves)
    return w2, None if st is None else LayerView(*st)


def _reference(*args, x_tree, w_tree, policy, precision, n):
    del n
    k = x_tree.num_leaves
    return formulate(jax.tree_util.tree_unflatten(x_tree, args[:k]), *_weight(w_tree, args[k:]),
                     policy, precision)


rows_p = compat.Primitive("jqt_dense_rows")


@rows_p.def_abstract_eval
def _abstract(*args, n, **params):
    return compat.shaped((args[0].shape[0], n), _F32, args,
                         [(0,) + (None,) * (len(args) - 1), (None,) * len(args)])


def _batch(args, dims, **params):
    """The batch of activations merged into rows, the formulation picked for all of them
    (:func:`run` again: an outer ``vmap`` merges its batch too); a batch of weights (or of
    a stacked layer's index) maps the op per example instead."""
    k = params["x_tree"].num_leaves
    mapped = [d is not compat.NOT_MAPPED for d in dims]
    if any(mapped[k:]):
        axes = tuple(d if b else None for d, b in zip(dims, mapped))
        return jax.vmap(functools.partial(_reference, **params), in_axes=axes)(*args), 0
    b = next(a.shape[d] for a, d, on in zip(args, dims, mapped) if on)
    xs = [jnp.moveaxis(a, d, 0) if on else a for a, d, on in zip(args[:k], dims, mapped)]
    m, kk = xs[0].shape[mapped[0]:]
    merged = [compat.reshape(jnp.broadcast_to(xs[0], (b, m, kk)), (b * m, kk))]
    for a, on in zip(xs[1:], mapped[1:k]):  # one value for all rows, or per example, or per row
        if not on and a.ndim == 0:
            merged.append(a)
            continue
        rows = 1 if math.prod(a.shape[on:]) == 1 else m  # (shapes spelled out: b or m may be 0)
        merged.append(jnp.broadcast_to(a.reshape(b if on else 1, rows, 1), (b, m, 1)).reshape(b * m, 1))
    out = run(jax.tree_util.tree_unflatten(params["x_tree"], merged), *_weight(params["w_tree"], args[k:]),
              params["policy"], params["precision"])
    return out.reshape(b, m, out.shape[-1]), 0


compat.define_by_reference(rows_p, _reference, _batch)
