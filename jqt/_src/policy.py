"""Which integer formulation runs an op, per backend and shape: one table.

The numerics of every formulation are the same (integer arithmetic is exact;
the weight-only chunks sum in float in another order): the policy changes
speed, never results beyond float rounding.

=========================  ==========================  ==========================
decision                   CPU (XLA:CPU)               GPU and other backends
=========================  ==========================  ==========================
packed dense weight, w8a8  ``(N, K)``, contract on K   ``(N, K)`` (``TN`` GEMM)
packed dense weight, w8    ``(K, N)``                  ``(K, N)``
rows of an int8 matmul     padded up to 2 (one row     not padded
                           takes a 20x slower path)
weight-only matmul         ``lax.scan`` over K chunks  cast the weight, one matmul
                           of <= 512 rows, cast in
                           cache (a whole-weight cast
                           is 10x slower than float)
int8 convolution           im2col patches + int8       native int8 convolution
                           matmul when the input has
                           < 16 channels per group,
                           native int8 conv otherwise
=========================  ==========================  ==========================

The figures behind the CPU column are in ``benchmarks/`` and the README.
"""
from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelPolicy:
    """How the integer path formulates its kernels (see the module table).

    Attributes:
      pad_rows: pad the rows (M) of an int8 x int8 matmul up to this many.
      weight_only_chunk: K-chunk of the weight-only matmul, 0 to cast the
        whole weight and run one matmul.
      conv_patches_below: run an int8 convolution as an im2col matmul when the
        input has fewer channels per group than this (0: never).

    >>> import jqt
    >>> jqt.KernelPolicy.for_backend("cpu").pad_rows
    2
    """

    pad_rows: int = 1
    weight_only_chunk: int = 0
    conv_patches_below: int = 0

    @staticmethod
    def for_backend(backend: str | None = None) -> "KernelPolicy":
        """The table's policy for ``backend`` (default: ``jax.default_backend()``)."""
        backend = backend or jax.default_backend()
        return POLICIES.get(backend, POLICIES["default"])


POLICIES = {
    "cpu": KernelPolicy(pad_rows=2, weight_only_chunk=512, conv_patches_below=16),
    "default": KernelPolicy(),
}
