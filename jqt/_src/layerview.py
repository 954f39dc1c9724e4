"""A layer of stacked packed weights, read in place.

Under ``lax.scan`` over stacked layers the per-op state of an op whose weight is
sliced from a stacked leaf travels as ``xs`` (``interpreter.py``): XLA copies each
layer's packed weight out of the stack before the op reads it. For the integer
path, ``hops._scan`` instead closes over the stacked packed weight and hands the
body a :class:`LayerView`: the stack and the iteration's layer index. jqt's native
kernels (``native.py``) read the layer from the stack where it lies; every other
kernel reads :attr:`LayerView.sliced`, the same slice the ``xs`` would have given
(and XLA drops the slice when nothing reads it).

Nested scans over the same stack (an op whose weight two scans slice) extend the
index: ``LayerView(full, (i, j))`` is ``full[i, j]``.

>>> import jax.numpy as jnp
>>> from jqt._src.formats import QuantType
>>> from jqt._src.qparams import QArray
>>> full = QArray(values=jnp.arange(24, dtype=jnp.int8).reshape(3, 2, 4),
...               scale=jnp.ones((3, 4)), qtype=QuantType(bits=8, per_channel=True))
>>> v = LayerView(full, ()).at(jnp.int32(1))
>>> v.sliced.values.shape, int(v.sliced.values[0, 0])
((2, 4), 8)
>>> stack, layer = v.flat()
>>> stack.values.shape, int(layer)
((3, 2, 4), 1)
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from .qparams import QArray


@dataclasses.dataclass(frozen=True, eq=False)
class LayerView:
    """``full[index]``: ``full`` a :class:`jqt.QArray` whose arrays have
    ``len(index) + k`` dimensions, ``index`` a tuple of int32 scalars (one per
    leading axis taken)."""

    full: QArray
    index: tuple

    def at(self, i) -> "LayerView":
        """The view one leading axis further in: ``full[(*index, i)]``."""
        return LayerView(self.full, self.index + (i,))

    def shapes(self):
        """The shape of each array of the view (``full``'s without the indexed axes):
        a scan slicing the view again must match their leading axis."""
        d = len(self.index)
        return [tuple(jnp.shape(a))[d:] for a in jax.tree_util.tree_leaves(self.full)]

    @functools.cached_property
    def sliced(self) -> QArray:
        """The layer as its own QArray (what a scan's ``xs`` would slice)."""
        def take(a):
            # fp8 codes sliced as their bytes: XLA:CPU slices fp8 by converting the operand
            # to float16 and back, and the conversion of the whole stack, loop-invariant,
            # was hoisted out of the loop (a float16 copy of every layer, each call)
            fp8 = jnp.issubdtype(a.dtype, jnp.floating) and jnp.dtype(a.dtype).itemsize == 1
            b = lax.bitcast_convert_type(a, jnp.uint8) if fp8 else a
            for i in self.index:  # (a stack of 0 layers: a scan of length 0, never run)
                b = lax.dynamic_index_in_dim(b, i, 0, keepdims=False) if b.shape[0] else \
                    jnp.zeros(b.shape[1:], b.dtype)
            return lax.bitcast_convert_type(b, a.dtype) if fp8 else b
        return jax.tree_util.tree_map(take, self.full)

    def flat(self):
        """``(stack, layer)``: ``full`` with the indexed leading axes merged into one of
        ``L`` layers (a reshape) and the int32 index of the layer in it, each index
        clamped to its axis as ``lax.dynamic_index_in_dim`` clamps it."""
        d = len(self.index)
        dims = jnp.shape(self.full.values)[:d]
        layer = jnp.int32(0)
        for i, n in zip(self.index, dims):
            layer = layer * n + jnp.clip(jnp.asarray(i, jnp.int32), 0, n - 1)
        merge = lambda a: None if a is None else jnp.reshape(a, (math.prod(dims),) + jnp.shape(a)[d:])
        return jax.tree_util.tree_map(merge, self.full), layer
