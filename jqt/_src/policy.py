"""Which integer formulation runs an op, per backend and shape: one table.

The numerics of every formulation are the same (integer arithmetic is exact;
the weight-only chunks sum in float in another order): the policy changes
speed, never results beyond float rounding.

=========================  ==========================  ==========================
decision                   CPU (XLA:CPU)               GPU and other backends
=========================  ==========================  ==========================
packed dense weight, w8a8  ``(N, K)``, contract on K   ``(N, K)`` (``TN`` GEMM)
packed dense weight, w8,   ``(K, N)``                  ``(K, N)``
w4, nf4 (weight-only)
packed dense weight, fp8   ``(K, N)`` (decoded)        ``(N, K)`` (fp8 GEMM)
rows of an int8 matmul     padded up to 2 (one row     not padded
                           takes a 20x slower path)
weight-only matmul         ``lax.scan`` over K chunks  cast the weight, one matmul
                           of <= 256 rows, cast in
                           cache (a whole-weight cast
                           is 10x slower than float)
int4 / nf4 weight-only     per K-chunk: the low and    the same (not measured
                           high nibbles (even and odd  here: no GPU was lent)
                           rows of K) decoded apart,
                           each times its strided
                           slice of the activation;
                           group scales applied by a
                           reshape; nf4 by a 16-entry
                           table lookup
w4a8 with groups           int32 partial sums per      the same
                           group (a dot batched over
                           groups), scaled, summed
fp8 x fp8 matmul           weight decoded per K-chunk  one fp8 ``dot_general``
                           from its bits (float16 bit  (cuBLASLt on H100)
                           tricks: XLA:CPU's own fp8
                           conversion is ~10x slower),
                           activation upcast (exact)
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
      fp8_native: run an fp8 x fp8 matmul as one ``dot_general`` on fp8 operands
        (float32 accumulation); otherwise the fp8 weight is upcast chunk by chunk
        as on the weight-only path (XLA:CPU has no fp8 GEMM).

    >>> import jqt
    >>> jqt.KernelPolicy.for_backend("cpu").pad_rows
    2
    """

    pad_rows: int = 1
    weight_only_chunk: int = 0
    conv_patches_below: int = 0
    fp8_native: bool = False

    def dense_layout(self, weight, activation) -> str:
        """The 2-D layout a dense weight is packed in and read from, for its weight and
        activation :class:`jqt.QuantType` (``activation=None``: weight-only): ``"nk"``
        where an integer (or native fp8) matmul contracts both operands' last axis,
        ``"kn"`` where the weight is decoded K-chunk by K-chunk (weight-only, and fp8
        where the backend has no fp8 matmul).

        >>> import jqt
        >>> cpu = jqt.KernelPolicy.for_backend("cpu")
        >>> cpu.dense_layout(jqt.QuantType(bits=8), None), cpu.dense_layout(jqt.QuantType(bits=8), jqt.QuantType(bits=8))
        ('kn', 'nk')
        """
        if activation is None or (weight.kind == "float" and not self.fp8_native):
            return "kn"
        return "nk"

    @staticmethod
    def for_backend(backend: str | None = None) -> "KernelPolicy":
        """The table's policy for ``backend`` (default: ``jax.default_backend()``)."""
        backend = backend or jax.default_backend()
        return POLICIES.get(backend, POLICIES["default"])


POLICIES = {
    "cpu": KernelPolicy(pad_rows=2, weight_only_chunk=256, conv_patches_below=16),
    "gpu": KernelPolicy(fp8_native=True),
    "cuda": KernelPolicy(fp8_native=True),
    "default": KernelPolicy(),
}
