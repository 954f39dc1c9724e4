"""Benchmark workloads: flax.linen models, their batch sizes and deterministic inputs.

Every workload is a :class:`Workload`: a linen module, the shape of one example,
the batch sizes timed in a full run and in ``--quick``, and the batch size of the
calibration data. Inputs are standard-normal draws from fixed seeds
(:func:`make_input`), so two runs time and compare the same numbers.

The models (all float32):

* ``dense4096`` / ``dense1024``: one ``nn.Dense(n)`` on ``n`` inputs (with bias).
* ``mlp12x1024``: 12 ``nn.Dense(1024)`` layers on 1024 inputs, ReLU between them
  (no ReLU after the last one).
* ``cnn_digits``: the quickstart CNN (``examples/quickstart.py``) on 8x8x1:
  conv3x3x16, ReLU, conv3x3x32, ReLU, 2x2 max-pool, dense 64, ReLU, dense 10.
* ``cnn32``: 32x32x3 input, conv3x3x64, ReLU, conv3x3x64, ReLU, 2x2 max-pool,
  conv3x3x128, ReLU, conv3x3x128, ReLU, global average pool, dense 10.
* ``encoder``: one BERT-style (post-LN) transformer encoder block the size of
  MiniLM's (all-MiniLM-L6-v2's layers): hidden 384, 12 heads of 32, sequence 64,
  FFN 1536 with exact (erf) GELU, LayerNorm after each residual. q/k/v/o are
  ``nn.Dense``; the two attention einsums (scores, weighted values) multiply
  activations by activations and have no weights. Its calibration batches hold 4
  examples (the others' 8).
* ``mlp100x256``: 100 ``nn.Dense(256)`` layers with ReLU, used only for the
  trace/compile-time measurement.
"""
from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


class DenseLayer(nn.Module):
    """One ``nn.Dense(features)``."""

    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features)(x)


class MLP(nn.Module):
    """``depth`` ``nn.Dense(width)`` layers with ReLU between them."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.Dense(self.width)(x)
            if i < self.depth - 1:
                x = nn.relu(x)
        return x


def quickstart():
    """``examples/quickstart.py`` as a module (its ``CNN``, ``load_data``, ``train``)."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:  # quickstart imports jaxpr_utils from its own folder
        sys.path.insert(0, examples)
    return importlib.import_module("quickstart")


DigitsCNN = quickstart().CNN


class CNN32(nn.Module):
    """A VGG-style CNN on 32x32x3 with 64 and 128 channels."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.relu(nn.Conv(64, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = nn.relu(nn.Conv(128, (3, 3))(x))
        x = nn.relu(nn.Conv(128, (3, 3))(x))
        x = jnp.mean(x, axis=(-3, -2))
        return nn.Dense(10)(x)


class EncoderBlock(nn.Module):
    """A post-LN (BERT-style) transformer encoder block."""

    hidden: int = 384
    heads: int = 12
    ffn: int = 1536

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        hd = self.hidden // self.heads

        def split(t):
            return t.reshape(b, s, self.heads, hd)

        q = split(nn.Dense(self.hidden, name="query")(x))
        k = split(nn.Dense(self.hidden, name="key")(x))
        v = split(nn.Dense(self.hidden, name="value")(x))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(np.float32)
        probs = jax.nn.softmax(scores, axis=-1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, self.hidden)
        x = nn.LayerNorm(name="attn_ln")(x + nn.Dense(self.hidden, name="out")(ctx))
        h = nn.gelu(nn.Dense(self.ffn, name="ffn_in")(x), approximate=False)
        return nn.LayerNorm(name="ffn_ln")(x + nn.Dense(self.hidden, name="ffn_out")(h))


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model to benchmark and the inputs it runs on.

    Attributes:
      name: short name used in tables and by ``--only`` (its ``group``).
      group: the ``--only`` group (dense, mlp, cnn, encoder).
      make_model: builds the linen module.
      example_shape: shape of one example (without the batch axis).
      batches: batch sizes of a full run.
      quick_batches: batch sizes of ``--quick``.
      calib_batch: batch size of each calibration batch.
      kind: target category for the check list (dense, encoder, cnn, other).
    """

    name: str
    group: str
    make_model: Callable[[], nn.Module]
    example_shape: tuple
    batches: tuple
    quick_batches: tuple
    calib_batch: int = 8
    kind: str = "other"

    def input(self, batch: int, seed: int = 0) -> jax.Array:
        return make_input((batch,) + tuple(self.example_shape), seed)

    def calibration_batches(self, n: int, seed: int = 1000) -> list:
        """``n`` batches (tuples of the non-weight arguments of ``model.apply``)."""
        return [(self.input(self.calib_batch, seed + i),) for i in range(n)]

    def init(self, model: nn.Module, seed: int = 0):
        """The float variables dict (``{'params': ...}``), from a fixed seed."""
        x = self.input(1, seed=10_000)
        return jax.jit(model.init)(jax.random.PRNGKey(seed), x)


def make_input(shape, seed: int) -> jax.Array:
    """Standard-normal float32 data of ``shape`` from ``seed`` (deterministic)."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))


WORKLOADS = (
    Workload("dense4096", "dense", lambda: DenseLayer(4096), (4096,),
             (1, 4, 8, 32, 64), (1, 8, 64), kind="dense"),
    Workload("dense1024", "dense", lambda: DenseLayer(1024), (1024,),
             (1, 4, 8, 32, 64), (1, 64), kind="dense"),
    Workload("mlp12x1024", "mlp", lambda: MLP(1024, 12), (1024,), (1, 8), (8,)),
    Workload("cnn_digits", "cnn", DigitsCNN, (8, 8, 1), (8, 64), (64,), kind="cnn"),
    Workload("cnn32", "cnn", CNN32, (32, 32, 3), (1, 8), (8,), kind="cnn"),
    Workload("encoder", "encoder", EncoderBlock, (64, 384), (1, 8), (8,), calib_batch=4,
             kind="encoder"),
)

# Used for the trace/transform-time measurement only.
DEEP_MLP = Workload("mlp100x256", "mlp", lambda: MLP(256, 100), (256,), (8,), (8,))


def select(only: str | None) -> list:
    """Workloads whose group or name is in the comma-separated ``only`` (all if None)."""
    if not only:
        return list(WORKLOADS)
    wanted = {s.strip() for s in only.split(",") if s.strip()}
    known = {w.group for w in WORKLOADS} | {w.name for w in WORKLOADS}
    unknown = wanted - known
    if unknown:
        raise SystemExit(f"--only: unknown workload(s) {sorted(unknown)}; choose from "
                         f"{sorted(known)}")
    return [w for w in WORKLOADS if w.group in wanted or w.name in wanted]
