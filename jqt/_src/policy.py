"""Which integer formulation runs an op, per backend and shape: one table.

The numerics of every formulation are the same (integer arithmetic is exact;
float sums run in another order, and an activation split into int8 digits
keeps 24 bits of each row's absolute maximum; 8-bit codes and fp8 values
multiplied as bfloat16 are exact products summed in float32): the policy changes speed, never
results beyond float rounding.

"Rows" are the rows M of the op as a 2-D matmul (tokens times batch): 1 when
decoding at batch 1 (a GEMV), 1024 for a prefill of 8 x 128 tokens.

==========================  ==========================  ==========================
decision                    CPU (XLA:CPU)               GPU (``for_backend("gpu")``)
==========================  ==========================  ==========================
packed dense weight, w8a8   ``(N, K)``, contract on K   ``(N, K)`` (``TN`` GEMM)
packed dense weight, w8     ``(K, N)``                  ``(N, K)``: the one-row
(weight-only per channel)   (``weight_only_kn``): the   sum over K and the digits
                            float matmul reads it       read each output's codes
                            decoded faster at many      contiguously
                            rows (all-MiniLM-L6-v2 at
                            batch 1 / 8: 0.82-0.87x /
                            0.95-0.98x float32 against
                            0.93-1.00x / 0.97-1.00x
                            ``(N, K)``); a weight
                            packed ``(N, K)`` (older
                            files) runs as packed
packed dense weight, w4,    ``(K, N)``                  ``(N, K)``: the one-row sum
nf4 (grouped weight-only)                               over K reads each output's
                                                        codes contiguously (H100,
                                                        100M generate loop, w4 g128
                                                        0.58x bfloat16 against 0.67x
                                                        ``(K, N)``; all-MiniLM-L6-v2
                                                        shape b1/b8: 1.20x/1.25x
                                                        against 1.12x/1.18x)
packed dense weight, w4a8   ``(K, N)``, the layout it   ``(N, K)``
g128 (groups, int8 acts)    is decoded in above 8 rows
                            and read in group by group
                            below (``(N, K)``: w4a8
                            0.84x float32 at one row of
                            a 4096 layer, 2.47x at 17
                            rows of all-MiniLM-L6-v2,
                            against 0.69x and 0.80x)
packed dense weight, fp8    ``(K, N)`` (decoded)        ``(N, K)`` (fp8 GEMM)
rows of an int8 matmul      padded up to 2 (one row     not padded
                            takes a 10-20x slower
                            path: a decode step 2x)
int8 matmul, more than 255  on a CPU with AVX512_BF16  an int8 matmul (bfloat16
rows: int_as_bfloat16_rows  or AMX-BF16: the codes as   not measured on a GPU)
                            bfloat16, one bfloat16
                            matmul, float32 sums
                            (exact products), for a
                            weight of <= 32 MiB as
                            float32 (decoder prefill,
                            1,024 rows, a Zen 4 EPYC:
                            w8a8_dynamic 0.612 /
                            0.606x float32 against
                            0.726 / 0.740x with int8
                            matmuls, two runs);
                            elsewhere (AVX2) an int8
                            matmul: there bfloat16 is
                            the slower (a MiniLM-sized
                            encoder block, 512 rows:
                            w8a8 1.68x float32 against
                            0.90x)
1-8 rows: w8 (weight-only)  jqt's native kernel         one row: the sum over K
                            (``jqt_channel_gemv_kn``;   (below); 2-4 rows: a
                            ``jqt_channel_gemv`` for    float32 activation as 3
                            ``(N, K)``): 4096 layer     int8 digits, one int8
                            0.34x float32 at one row    matmul (H200: 1.23-1.29x
                            against 0.73x for the       bfloat16 at one row, 1.73x
                            digits; without it, a       at 4, against 3.13-3.24x
                            ``(K, N)`` weight runs      for the cast); a 16-bit
                            K-chunks (decoder step      one from 2 rows on: the
                            0.437-0.737x at 1-4 rows),  codes cast to its dtype,
                            an ``(N, K)`` one at 1-4    untied (``cast_in_gemm``):
                            rows 3 int8 digits, one     XLA converts them in its
                            int8 matmul (0.372-0.812x)  GEMM (H100, 4096 layer at
                                                        2 / 16 rows: 0.84 / 0.83x
                                                        bfloat16 against 0.94-
                                                        1.02x for the digits and
                                                        1.81x for the tied cast)
1-4 rows: w8a8,             jqt's native kernel         an int8 matmul
w8a8_dynamic (int8 x int8   (``jqt_channel_gemv``) on
per channel):               the activation's codes as
native_int8_rows            floats, the layers read in
                            place (decoder step 0.271 /
                            0.242x float32 against
                            0.433 / 0.342x with XLA's
                            int8 matmul; 0.315-0.707x
                            against 0.459-0.752x at 1-4
                            rows, a tie at 8)
1-8 rows: w4a8 g128         one int8 matmul per group   as at any row count
                            (one batched over the
                            groups: 0.68-1.14x, slower
                            in 4 of 5 runs on an idle
                            machine)
w4a8 g128, more than 8      the int8 codes upcast       the codes upcast, the weight
rows (GPU: at any row       (exact), the weight decoded decoded whole, one float
count, grouped_float)       as on the weight-only path  matmul: XLA:GPU's compiler
                            below: K-chunks, or whole   aborted the process on the
                            (one int8 matmul per group: int8 matmuls per group at
                            2.04x float32 at 32 rows of 2-16 rows (H100, JAX
                            a 4096 layer against 0.75x, 0.11.2), which ran 11.67x /
                            2.9x at prefill)            28.89x bfloat16 at 64 / 256
                                                        rows against 2.65x / 2.93x
1 row: a weight decoded to  the formulations below      one elementwise product of
float (w8, w4, nf4, w4a8;                               the activation and the
not w8a8): reduce_rows                                  decoded weight summed over
                                                        K, which XLA:GPU fuses with
                                                        the decode (H100 generate
                                                        loop at batch 1, bfloat16 =
                                                        1: 0.72B decoder w4 g128
                                                        0.46x against 1.21x, w8
                                                        0.49x, nf4 0.73x; 100M: w8
                                                        0.58-0.59x against 0.79x,
                                                        w4 0.58x against 0.98x; a
                                                        4096 layer at one row: w8
                                                        1.02x against the digits'
                                                        1.19x; at 16 rows: 5.9-8.0x,
                                                        so one row only)
1-8 rows: fp8 (codes per    jqt's native kernel         one fp8 ``dot_general``
channel, (K, N)):           ``jqt_fp8_gemv_kn``: the    (fp8_native)
native_gemv_rows            bits decoded through
                            float16 in registers (4096
                            layer at 1-8 rows: 0.23-
                            0.47x float32 against 0.74-
                            2.05x K-chunked)
1-8 rows: w8 g128, w8a8     jqt's native kernel         as at any row count
g128 (int8 codes with       ``jqt_channel_gemv_kn``,
group scales, (K, N)):      each group's sums scaled
native_gemv_rows            (4096 layer at 1 / 8 rows:
                            w8 g128 0.36 / 0.46x
                            float32 against 1.11 /
                            0.88x, w8a8 g128 0.40 /
                            0.52x against 0.97 / 1.60x)
w8a16 (int16 activations),  the codes as float32        the halves' int8 matmuls
more than 8 rows:           (exact), the weight decoded
int16_as_float              as on the weight-only path,
                            one float matmul (4096
                            layer at 32 / 128 rows:
                            1.04 / 0.84x float32
                            against 3.82 / 1.93x for
                            the halves' int8 matmuls)
1-8 rows: w4 g128, w4a8     jqt's native kernel         as at any row count
g128, nf4 (4-bit codes      (``native.py``, an XLA FFI  (H200: digits 2.81x
with group scales, or per   custom call built on first  bfloat16 at one row of a
channel weight-only):       use): the packed codes      4096 layer against 3.90x,
native_gemv_rows            read once, decoded in       but 1.09x against 1.05x in
                            registers (4096 layer at    the decode step)
                            one row: w4 0.20x float32
                            against 0.76x K-chunked,
                            nf4 0.31x against 1.09x;
                            per channel w4 0.21-0.32x
                            at 1-8 rows against 0.46-
                            1.02x; decoder step w4
                            0.284x against 0.433x); where it
                            does not build and in
                            ``jax.export``: K-chunked
                            cast, as at any row count
weight-only matmul, up to   ``lax.scan`` over chunks    cast the weight, one
64 rows, a float copy       of <= 256 rows of K (of N   matmul
over 3 MiB                  for ``(N, K)``), cast in
                            cache (the whole weight
                            cast at one row: 0.54-
                            0.57x of the float32 decode
                            step against 0.43-0.49x);
                            a wide weight whose K-chunk
                            is over 4 MiB as float32
                            (weight_only_block_bytes):
                            blocks of output columns of
                            <= 4 MiB over all of K (LM
                            heads 512 x 50257 and 2048
                            x 32000 at 32 rows: 0.63-
                            0.89x float32 against 1.52-
                            1.88x in K-chunks; at 128:
                            1.12-1.25x against 1.29-
                            1.87x)
weight-only matmul, more    the whole weight decoded    the same
than 64 rows or a float     once after its op's input
copy of at most 3 MiB       exists (an integer zero
                            from the activation added
                            to the codes), one float
                            matmul (MiniLM: 0.74-0.97x
                            float32 at batch 1, 1.02-
                            1.12x at batch 8; without
                            the tie XLA:CPU hoists
                            every decode: 43 MB of
                            temporaries, 1.75-2.04x)
weight-only, bfloat16 /     on a CPU with AVX512_BF16   decoded to that dtype:
float16 activations         or AMX-BF16: the weight     int8 codes per channel
(decode_in_input_dtype)     decoded to that dtype, one  exactly, grouped w4 / nf4
                            16-bit matmul, float32      in float32 and rounded
                            accumulation: per-channel   (H100, 4096 layer at 2-
                            int8 codes (exact) at any   2048 rows: w4 g128 1.30-
                            rows, grouped w4 / nf4      2.08x bfloat16 against
                            above 64 rows (chosen from  2.42-3.21x for float32,
                            gpu.py --policy cpu runs    nf4 g64 1.36-2.40x against
                            on a Zen 4 EPYC, whose      2.45-3.30x; w8 at 256 /
                            output was not kept);       2048 rows 1.72 / 1.37x
                            elsewhere (AVX2) a float32  against 3.28 / 2.60x;
                            decode: there the bfloat16  all-MiniLM-L6-v2 shape:
                            matmul is the slower        w8 1.08-1.10x against
                                                        1.12-1.18x, w4 g128 1.23-
                                                        1.28x against 1.16-1.19x)
int4 / nf4 weight-only      per chunk or block: both    the same (H200: w4 g128
                            nibbles decoded by one      3.9x, nf4 4.2x bfloat16
                            shift into one float block  at one row of a 4096
                            in K's own order, the       layer: XLA did not fuse
                            activation read as it is    the decode into its GEMM)
                            (``nibble_halves``: even
                            rows, then odd, the
                            activation reordered:
                            MiniLM w4 b8 1.08x float32
                            against 1.00x; one matmul
                            per nibble: 1.39x); group
                            scales by a reshape; nf4 by a
                            tree of 15 selects on the
                            code's bits (a gather from
                            its 16-entry table was
                            slower: numerics.py)
nf4 decoded whole (more     on AVX2 (and AVX-512):      XLA's decode (the select
than 8 rows, a float copy   jqt's native kernel         tree)
of at most 3 MiB, or more   ``jqt_nibble_decode``, the
than 64 rows):              table in registers (MiniLM
native_decode               nf4 g64 b1 / b8, AVX2 CPU:
                            0.72 / 1.00x and 0.82 /
                            1.01x float32 against 0.89
                            / 1.08x and 1.00 / 1.12x;
                            AVX-512: 0.90 / 1.01x
                            against 1.09 / 1.06x);
                            int4 codes: XLA's decode
                            (faster there)
fp8 x fp8 matmul            weight decoded per K-chunk  one fp8 ``dot_general``
                            from its bits (float16 bit  (H200: 1.34x bfloat16 at
                            tricks: XLA:CPU's own fp8   one row of a 4096 layer,
                            conversion is ~10x slower), 3.09x decoded; the decode
                            activation upcast (exact)   step 0.69-0.81x)
fp8 x fp8, more than 32     on a CPU with AVX512_BF16   one fp8 ``dot_general``
rows: fp8_as_bfloat16_rows  or AMX-BF16: both operands'
                            values as bfloat16 (exact),
                            one bfloat16 matmul, float32
                            sums (MiniLM at batch 8:
                            0.94-0.96x float32 against
                            1.02-1.03x;
                            its 384 x 1536 weight at
                            1,024 rows 0.65x against
                            1.06x); a weight over 32 MiB
                            as float32 above 256 rows
                            only; with AVX2 alone, the
                            float32 path above
weight with batch axes      one expert at a time in a   the whole weight decoded,
(experts), decoded to       ``lax.map``, K-chunks as    one batched float
float (weight-only, w4a8,   above, int4 codes two per   ``dot_general`` (keeps a
nf4, fp8)                   byte along N or K (the      sharded expert axis
                            whole weight decoded at     sharded)
                            once: 4-8x float32 at 1-8
                            tokens per expert)
``lax.ragged_dot`` with     from 256 rows (all          the weight decoded to
int codes (w8a8, w8a8_dyn)  experts'): one int8         float (not measured on
(ragged_int_rows)           ragged_dot, int32 sums      a GPU)
                            (1,024 rows of 8 experts
                            of 1024 x 2816: 0.74-0.75x
                            float32 against 0.98-1.02x
                            decoded); fewer: the
                            weight decoded to float
fp8 key/value cache         carried as uint8 bits,      an fp8 buffer
(fp8_native)                decoded by integer ops
                            where attention reads it
                            (100M decoder at context
                            2048: 0.261x float32's
                            step, int8 cache 0.252x;
                            an fp8 buffer 5.09x)
int8 convolution            im2col patches + int8       native int8 convolution
                            matmul when the input has
                            < 16 channels per group,
                            native int8 conv otherwise
                            in 2-D NHWC / HWIO; in any
                            other layout float32 convs
                            of the codes, exact
                            (conv_codes_as_float)
==========================  ==========================  ==========================

Other platforms (TPU, ROCm, Metal) take the generic :class:`KernelPolicy`, which neither
column shows: its weight-only and fp8 weights are packed ``(K, N)`` and int x int ones
``(N, K)``, fp8 weights are decoded to float, a single row runs as any other, and nothing
is split into digits or cast inside the GEMM.

The figures behind the CPU column are in ``benchmarks/`` and ``docs/performance.md``;
the GPU column's (one NVIDIA H200, JAX 0.11.2) in ``benchmarks/results/gpu-h200.md``,
checked on one H100 in ``benchmarks/results/gpu-h100.md`` (``benchmarks/gpu.py``);
the few-row and many-row ones come from ``benchmarks/decode.py``, whose
``formulations`` table times a 100M-parameter decoder's decode step under each
formulation, and whose ``prefill`` table runs the many-row ones.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

_EXACT_DIGITS = 3
"""The fewest int8 digits of a float32 activation that hold its 24 bits (``gemv.py``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelPolicy:
    """How the integer path formulates its kernels (see the module table).

    Attributes:
      pad_rows: pad the rows (M) of an int8 x int8 matmul up to this many.
      weight_only_chunk: K-chunk of the weight-only matmul (N-chunk for a weight
        packed ``(N, K)``), 0 to cast the whole weight and run one matmul.
      weight_only_block_bytes: a weight packed ``(K, N)`` whose K-chunk decoded to
        float32 would exceed this many bytes (a wide weight: an LM head of 512 x
        50k) is decoded in blocks of output columns instead, all of K per block,
        each block at most this many bytes (at least 128 columns); 0: K-chunks.
      ragged_int_rows: int activation codes on a symmetric int weight per output channel
        (w8a8, w8a8_dynamic, w8a16) in a ``lax.ragged_dot`` (a mixture of experts'
        grouped matmul, ``ragged.py``) with at least this many rows (tokens, all
        experts') run one ``ragged_dot`` of the int8 codes with int32 sums, each row
        then scaled by its expert's channel scales; with fewer rows, and at 0, the
        weight is decoded to float for one float ``ragged_dot`` on the upcast codes
        (exact products, float32 sums). XLA:CPU runs a ``ragged_dot`` as a masked
        dense product over every expert. ``benchmarks/formats.py --only ragged`` (8
        experts of 1024 x 2816; ``benchmarks/results/formats-cpu-2core.md``): at 1,024
        rows the int8 one took 0.71x and 0.75x float32's time in two runs against 1.00x
        and 1.02x decoded, at 256 rows 0.98x against 0.98x and 1.01x; in a run with it
        at every row count, 1.31x and 1.19x against 1.09x and 0.95x at 8 and 64 rows.
        Unmeasured on GPUs: 0 there.
      conv_patches_below: run an int8 convolution as an im2col matmul when the
        input has fewer channels than this (0: never); ungrouped convolutions
        without input dilation only.
      conv_codes_as_float: run an int8 convolution in any layout but 2-D
        ``NHWC``/``HWIO`` (1-D, 3-D, ``NCHW``) as float32 convolutions of its codes,
        over chunks of input channels whose sums float32 holds exactly, added in
        int32: the int8 convolution's result. XLA:CPU has a fast int8 convolution in
        that 2-D layout only; elsewhere it widens to int32 (a 1-D conv 12-70x float32).
      fp8_native: run an fp8 x fp8 matmul as one ``dot_general`` on fp8 operands
        (float32 accumulation); otherwise the fp8 weight is upcast chunk by chunk
        as on the weight-only path (XLA:CPU has no fp8 GEMM; many rows: see
        ``fp8_as_bfloat16_rows``), and an fp8 key/value
        cache is carried as its uint8 bits (XLA:CPU computes on a carried fp8
        buffer in float16, converting the whole cache at every step).
      gemv_rows: an op with at most this many rows (M: tokens times batch; 1 when
        decoding at batch 1) runs the few-row formulations below (0: never).
      weight_only_digits: at few rows, a weight-only op on int weights (8 bits or
        fewer, per channel) splits the float activation into this many int8
        digits and runs them through the int8 x int8 matmul (0: the weight-only
        path as at any row count). Three digits hold 24 bits of each row's
        absolute maximum. It applies to weights packed ``"nk"`` (the CPU table packs
        w8 ``"kn"``, ``weight_only_kn``, for its K-chunks and native kernel).
      grouped_digits: the same for weight-only int weights with one scale per
        group of K (w4 g128), through one matmul batched over the groups.
      float_matmul_rows: an op with more rows than this decodes its whole weight
        once and runs one float matmul, whose arithmetic outweighs the decoding:
        weight-only ops (no K-chunks), and int8 activations with grouped int
        weights (their codes upcast exactly); 0: never.
      many_rows_block: above ``float_matmul_rows`` rows the weight is decoded
        this many output channels at a time (at most half of them) inside a
        loop, one float matmul over the whole of K per block, instead of all at
        once; 0: all at once. XLA:CPU schedules the decodes of a program's
        weights, which depend on nothing else, ahead of its first matmul, so
        decoding each weight whole keeps them all alive together (43 MB of
        temporaries for all-MiniLM-L6-v2 at batch 8, ``benchmarks/temporaries.py``),
        which the allocator maps afresh, and page-faults, at every call; a decode
        inside a loop cannot be hoisted.
      whole_decode_rows: above this many rows the whole weight is decoded at
        once after all (0: no such limit): there the matmul outweighs the
        temporaries, and blocks cost a copy of the output.
      decode_after_input: a weight decoded whole (or unpacked from nibbles for
        int8 matmuls per group) is made to depend on its op's activation (an
        integer zero computed from one element is added to the codes), so
        that it is decoded just before its matmul and freed after it. Without
        it XLA:CPU hoists the decodes of all a program's weights, which depend
        on nothing, ahead of the first matmul (see ``many_rows_block``), and
        ``lax.optimization_barrier`` does not stop it (XLA:CPU removes
        barriers before it schedules). Default ``True``: it costs one scalar
        add per code, fused into the decode.
      cast_in_gemm: a weight-only weight of per-channel 8-bit int codes cast
        exactly to the activation's 16-bit dtype (``decode_in_input_dtype``) is
        cast with no tie to its op's input (``decode_after_input`` does not
        apply to it): XLA:GPU's GEMM fusion then reads the int8 codes and
        converts them in its tiles, where the tie kept the cast out of it (H100,
        a 4096 layer at 2 / 16 / 256 / 2048 rows: 0.84 / 0.83 / 1.72 / 1.37x
        bfloat16 against 0.94 / 1.81 / 2.53 / 1.58x tied, with int8 digits at 2
        rows; ``benchmarks/results/gpu-h100.md``, fourth lease). Grouped int4 /
        nf4 and fp8 weights, decoded to memory, keep the tie (untied: 1.89-2.04x
        against 1.94-2.09x at 2-256 rows, no clear gain).
      whole_decode_bytes: a weight-only weight whose float32 copy takes at most
        this many bytes is decoded whole (after its input) for one float matmul
        at any row count, as above ``float_matmul_rows`` rows: K-chunks pay a
        loop and a sum of partial products that a small weight does not repay
        (all-MiniLM-L6-v2 at batch 1, 17 rows, weights of at most 2.4 MB:
        weight-only presets 1.03-1.31x float32 in K-chunks, 0.75-0.99x whole);
        0: by rows only.
      large_weight_bytes: a weight whose float32 copy takes more than this many
        bytes (more than the last-level cache: 32 MiB on the CPU table) keeps its
        K-chunks up to ``large_weight_rows`` rows, above ``float_matmul_rows``:
        its whole decode writes and reads the float copy through memory, about
        16 ms for a 4096 x 4096 weight on this machine's two cores, more than the
        matmul of a few hundred rows saves (at 128 rows, 1.81-1.97x float32 decoded
        whole against 1.03-1.16x in K-chunks, ``benchmarks/formats.py --only
        dense --ab large_weight_bytes=0``); 0: by ``float_matmul_rows`` alone. A
        float copy that fits the cache (the 100M decoder's 4-11 MiB projections)
        costs far less, and its K-chunks' partial sums no less, so those weights
        keep the rule above. A copy of exactly 32 MiB (1024 x 8192) decoded whole
        at 128 rows was 1.13-1.27x float32, 1.10-1.13x at 16 MiB
        (``benchmarks/formats.py --only wide``); left at 32 MiB, as the same
        threshold bounds ``int_as_bfloat16_rows``, measured on AVX512_BF16 CPUs only.
      large_weight_rows: the rows up to which such a large weight keeps its
        K-chunks (at 256 rows of the 4096 layer, 1.04-1.15x float32 against
        1.45-1.50x decoded whole; above, neither won at both 512 and 1,024 rows).

      grouped_int_rows: int8 activations with grouped int weights (w4a8 g128) run
        one int8 matmul per group at up to this many rows; above, their codes are
        upcast (exactly) for the weight-only path (K-chunks, or the whole weight
        above ``float_matmul_rows`` rows), whose one float matmul per chunk
        outruns a small int8 matmul per group. Such weights are packed ``"kn"``,
        the layout that path decodes (0: int8 matmuls per group at any row
        count, up to ``float_matmul_rows``, and ``"nk"``).

      grouped_float: int8 activations with grouped int weights (w4a8 g128) never run
        as int8 matmuls per group (nor batched over the groups): at every row count
        their codes are upcast (exactly) for the weight-only path, as above
        ``grouped_int_rows`` (one row: ``reduce_rows``' sum). On one H100, JAX 0.11.2,
        XLA:GPU's compiler aborted the process compiling the per-group int8 matmuls of
        a 4096 x 4096 layer at 2, 4, 8 and 16 rows (``triton_tiling_propagation.cc``
        check; ``benchmarks/gpu_compile.py``, ``benchmarks/results/gpu-h100.md``).

      grouped_int_min_group: int8 activations with grouped int weights whose groups
        are smaller than this (w4a8 g32, g64) never run int8 matmuls per group (nor
        batched over the groups): their codes are upcast (exactly) for the weight-only
        path at every row count, as above ``grouped_int_rows``; 0: any group size.
        A matmul per group contracts only the group's elements and writes a whole
        ``(M, N)`` partial sum, and the program holds one per group and nibble half.
        On the CPU table's XLA path (what runs without jqt's native kernels: another
        CPU, ``JQT_NATIVE=0``, a ``jax.export`` artifact), a 4096 x 4096 layer at 1-8
        rows took 1.6-7.7x float32 at g32 and 1.1-2.8x at g64 that way in two runs,
        against 0.73-1.03x upcast, and compiled in 4.3-5.2 s and 2.2-2.7 s against
        0.1-0.2 s. At g128 the two tie (0.62-0.97x against 0.67-0.85x; the 100M
        decoder's step at 1-4 rows 0.407-0.812x against 0.415-0.798x), so the table
        keeps the matmuls per group there, which compile in 1.3-1.5 s against 0.2 s
        (``JQT_NATIVE=0 benchmarks/formats.py --only groups``, ``benchmarks/decode.py
        --only "formulations,w4a8 g128"``; ``benchmarks/results/formats-cpu-2core.md``).

      batched_groups: at few rows, int weights with group scales and int8
        activations (w4a8 g128) run all groups as one matmul batched over the
        groups (instead of one matmul per group); such weights are packed
        ``"kn"``, whose ``(K, N)`` codes the batched matmul reads group by group
        in place.

      decode_in_input_dtype: a weight-only op whose activation is bfloat16 or
        float16 decodes a per-channel int weight (8 bits or fewer) to that dtype
        instead of float32, for a 16-bit matmul with float32 accumulation: exact
        (the codes are integers of at most 8 bits, which both dtypes hold; the
        scale applies to the float32 output), half the bytes of the float32 copy.
        Above ``float_matmul_rows`` rows a weight with group scales (w4, nf4) is
        decoded in float32 and rounded to that dtype too, as the simulated path
        rounds a weight of that dtype (at fewer rows XLA:CPU's 16-bit matmul was
        the slower). Per-channel NF4 and fp8 weights stay float32. Measured on the
        CPU with a bfloat16 4096 x 4096 layer (``benchmarks/gpu.py --policy cpu
        --only dense``, docs/performance.md). The CPU table sets it where the CPU
        has AVX512_BF16 or AMX-BF16 (``bfloat16_dot_is_fast``), as for
        ``int_as_bfloat16_rows``: on AVX2 alone XLA:CPU's bfloat16 matmul is the slower.

      int_as_bfloat16_rows: an int8 x int8 dense matmul of more rows than this
        runs as one bfloat16 matmul of the codes with float32 accumulation: the
        products are exact (bfloat16 holds 8-bit codes), the sums float32 (exact
        below 2**24), as on the other float paths over exact codes; 0: never.
        Not for a weight whose float32 copy exceeds ``large_weight_bytes``: its
        16-bit copy, made every call, does not fit the cache: on a Zen 4 EPYC
        a 4096 x 4096 layer at 256 rows ran slower with the codes as bfloat16
        than with the int8 matmul (that run's output is in no results file),
        while the 100M decoder's prefill there, weights of 4-11 MiB as
        float32, 1,024 rows, took w8a8_dynamic to 0.612 / 0.606x float32
        against 0.726 / 0.740x in two runs
        (benchmarks/results/decode-prefill-cpu-2core.md).
        The CPU table sets 255 on a CPU with AVX512_BF16 or AMX-BF16
        (``jqt._src.policy.bfloat16_dot_is_fast``) and 0 elsewhere.

      fp8_as_bfloat16_rows: an fp8 x fp8 dense matmul of more rows than this, where
        the backend has no fp8 matmul (``fp8_native``), runs as one bfloat16 matmul of
        both operands' values with float32 accumulation: bfloat16 holds every e4m3fn and
        e5m2 value (in ``numerics.fp8_units``) exactly, so the products are those of the
        float32 path, whose weight copy is twice the bytes, and only the order of the
        float32 sums differs; 0: never. Weights with group scales keep the float32
        path, and so does a weight whose float32 copy exceeds ``large_weight_bytes``
        up to ``large_weight_rows`` rows (there its float32 K-chunks in cache win:
        a 4096 x 4096 layer at 33-136 rows 1.16-1.24x float32 against 1.38-2.85x for its
        whole bfloat16 copy; 1.19-1.22x against 1.10x at 256 rows). ``benchmarks/formats.py --only fp8rows``
        (docs/performance.md), two runs: at 33-64 rows a tie on all-MiniLM-L6-v2's
        weights and faster on a 1024 x 2816 one (0.89-1.12x float32 against
        1.36-2.06x); from 136 rows on faster in every cell (0.42-1.30x against
        0.62-1.36x). The CPU table sets 32 on a CPU with AVX512_BF16 or AMX-BF16
        (``bfloat16_dot_is_fast``) and 0 elsewhere.

      native_gemv_rows: an op with at most this many rows and 4-bit (or fewer) int
        or NF4 weights packed ``"kn"``, with group scales or one per output channel
        (w4, w4a8, nf4: ``jqt_grouped_gemv``), int8 weights per output channel on
        float activations (w8: ``jqt_channel_gemv_kn`` for ``"kn"``, as the CPU table
        packs it, ``jqt_channel_gemv`` for ``"nk"``), int8 weights with group scales
        on float or int8 activations (w8 g128, w8a8 g128: ``jqt_channel_gemv_kn``),
        or fp8 weights per output channel (``jqt_fp8_gemv_kn``), runs jqt's native
        XLA:CPU kernels (built on first use; see :func:`jqt.native_status`), which
        read the packed codes once and decode them in registers, where they are available; elsewhere,
        and inside ``jax.export``, the formulations above. 0: never.

      nibble_halves: a weight with two 4-bit codes per byte decoded to float for a
        matmul is decoded as all its low nibbles (the even rows of K), then all its
        high ones, and the activation's columns are copied into that order before the
        matmul (the formulation before 2026-11-26); otherwise (the default) the decode
        keeps K's own order and the activation is read as it is (all-MiniLM-L6-v2 at
        batch 8, ``w4`` g128: 1.00x float32 against 1.08x; docs/performance.md).

      native_in_place: under ``lax.scan`` over stacked layers, those native kernels
        read the iteration's layer from the stacked packed weight where it lies
        (``layerview.py``) instead of the copy of it the scan's slicing makes
        (``benchmarks/decode.py``: the decode step's stacked weights).

      native_int8_rows: int8 activations on int8 weights per output channel (w8a8,
        w8a8_dynamic) also run ``jqt_channel_gemv`` at up to this many rows (and
        ``native_gemv_rows``): the activation's codes (minus its zero point) as float32
        times the part of its scale below 1 (the rest multiplies the output): float32
        products and sums, as on the float paths, with
        the stacked layers read in place (``native_in_place``); above, and at 0, XLA's
        int8 matmul, whose int32 sums are exact. w8a16's int16 activation codes run the
        kernel whole at any of its rows (``native_gemv_rows``): XLA's int8 matmuls on their
        two int8 halves took 5.66x float32 at 8 rows of the dense 4096 layer against 1.33x
        with the kernel on each half, and 0.59-0.69x with the codes whole in one call
        (``benchmarks/formats.py --only dense``: w8a16).

      int16_as_float: int16 activations on int weights (w8a16) above
        ``native_gemv_rows`` rows run as their codes in float32 (exact) times the part of
        their scale below 1, on the weight decoded as on the weight-only path (K-chunks, or
        whole at many rows): one float matmul, float32 sums, as the native kernel sums them
        at fewer rows; otherwise their two int8 halves run XLA's int8 matmuls (exact int32
        sums), which took 3.82 / 1.93 / 1.76x float32 at 32 / 128 / 256 rows of the dense
        4096 layer against 1.04 / 0.84 / 1.05x (``benchmarks/formats.py --only dense
        --quick --ab int16_as_float=0 --ab-presets w8a16``). A convolution that runs no patch
        matmul takes them as one float32 convolution of the codes, where the halves ran two.

      reduce_rows: an op with at most this many rows whose weight is decoded to float
        (weight-only int and NF4 weights, per channel or per group; int8 activations on
        grouped int weights, w4a8, their codes upcast exactly) runs as one elementwise
        product of the activation and the decoded weight summed over K, not as a
        matmul: XLA:GPU fuses the decode into that reduction, so the codes are read
        once and no float copy of the weight is written (it runs before the few-row
        formulations above). Weight-only weights are then packed ``(N, K)``, so that
        the sum reads each output's codes contiguously. int8 x int8 ops (w8a8) keep
        their int8 matmul. 0: never.

      weight_only_kn: weight-only int weights with one scale per output channel (w8)
        are packed ``(K, N)`` even where few rows run them as int8 digits
        (``weight_only_digits``), which read either layout: XLA:CPU's float matmul,
        which runs them at many rows on the decoded weight, reads a ``(K, N)`` weight
        faster, and ``jqt_channel_gemv_kn`` reads it at few rows.

      native_decode: a weight of 4-bit codes two per byte (packed ``"kn"``, group
        scales or one scale per output channel) decoded whole to float32 for a matmul
        (``dense.decodes_whole``: above ``native_gemv_rows`` rows) is decoded by jqt's
        native kernel ``jqt_nibble_decode`` (``nibbledecode.py``) where it is available:
        1 NF4 codes, which XLA:CPU decodes by a tree of 15 selects per code; 2 int codes
        too (slower than XLA's decode in the model: all-MiniLM-L6-v2 ``w4`` g64 at
        batch 1 0.67x float32 against 0.58x); 0 never. The same bits as XLA's decode;
        inside ``jax.export`` and where the kernels do not build, XLA's. The CPU table
        sets 1 on a CPU with AVX2 (with or without AVX-512), 0 elsewhere
        (``jqt._src.policy.native_nf4_decode_pays``).

      batched_map: a weight with batch axes (a mixture's experts) decoded to
        float (weight-only, grouped int8-activation and fp8 formats) runs one
        batch entry at a time in a ``lax.map``, each decoded in K-chunks of
        ``weight_only_chunk`` rows as a 2-D weight is (``experts.decoded_map``);
        otherwise the whole weight is decoded at once for one batched float
        ``dot_general``, which keeps a sharded expert axis sharded.

    >>> import jqt
    >>> jqt.KernelPolicy.for_backend("cpu").pad_rows
    2
    """

    pad_rows: int = 1
    ragged_int_rows: int = 0
    weight_only_chunk: int = 0
    weight_only_block_bytes: int = 0
    conv_patches_below: int = 0
    conv_codes_as_float: bool = False
    fp8_native: bool = False
    gemv_rows: int = 0
    weight_only_digits: int = 0
    grouped_digits: int = 0
    grouped_int_rows: int = 0
    grouped_float: bool = False
    grouped_int_min_group: int = 0
    batched_groups: bool = False
    float_matmul_rows: int = 0
    many_rows_block: int = 0
    whole_decode_rows: int = 0
    decode_after_input: bool = True
    cast_in_gemm: bool = False
    whole_decode_bytes: int = 0
    large_weight_bytes: int = 0
    large_weight_rows: int = 0
    batched_map: bool = False
    decode_in_input_dtype: bool = False
    int_as_bfloat16_rows: int = 0
    fp8_as_bfloat16_rows: int = 0
    native_gemv_rows: int = 0
    native_in_place: bool = False
    nibble_halves: bool = False
    reduce_rows: int = 0
    native_int8_rows: int = 0
    int16_as_float: bool = False
    weight_only_kn: bool = False
    native_decode: int = 0

    def __post_init__(self):
        """Each field's type and range: flags are bools, counts ints >= 0 (``pad_rows`` >= 1;
        the digit counts 0 or at least 3, as float32's 24 bits need).

        >>> import jqt
        >>> jqt.KernelPolicy(gemv_rows=-1)
        Traceback (most recent call last):
        ...
        ValueError: KernelPolicy(gemv_rows=-1): expected an int >= 0 (0 turns it off).
        """
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in (bool, "bool"):
                if not isinstance(v, (bool, np.bool_)):
                    raise TypeError(f"KernelPolicy({f.name}={v!r}): expected True or False.")
                continue
            low = 1 if f.name == "pad_rows" else 0
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < low:
                raise ValueError(f"KernelPolicy({f.name}={v!r}): expected an int >= {low}"
                                 + (" (0 turns it off)." if low == 0 else "."))
            if f.name in ("weight_only_digits", "grouped_digits") and 0 < v < _EXACT_DIGITS:
                # fewer digits would round the float activation to 8 or 16 bits: the
                # integer path would then differ from the float kernel by far more than
                # float rounding, which every formulation promises
                raise ValueError(
                    f"KernelPolicy({f.name}={v!r}): expected 0 (off) or at least "
                    f"{_EXACT_DIGITS}: {_EXACT_DIGITS} int8 digits carry the 24 bits of a "
                    f"float32 activation; {v} would round it to {8 * v} bits.")
            if f.name == "native_decode" and v > 2:
                raise ValueError(f"KernelPolicy(native_decode={v!r}): expected 0 (never), 1 (NF4 "
                                 "codes) or 2 (NF4 and int codes).")

    def dense_layout(self, weight, activation) -> str:
        """The 2-D layout a dense weight is packed in and read from, for its weight and
        activation :class:`jqt.QuantType` (``activation=None``: weight-only): ``"nk"``
        where an integer (or native fp8) matmul contracts both operands' last axis
        (int8 activations; weight-only int per-channel weights when few rows run as
        int8 digits, unless ``weight_only_kn``; every formulation of those reads
        either layout, and runs the one they were packed in), ``"kn"`` where the
        weight is decoded K-chunk by K-chunk
        (weight-only, fp8 where the backend has no fp8 matmul, and grouped int
        weights with int8 activations under ``grouped_int_rows``) or read group by
        group (the same when few rows run one batched matmul), and for int weights of
        4 bits or fewer with one scale per output channel (or per tensor) and int8
        activations (``w4a8()``) where ``native_gemv_rows`` runs few rows through jqt's native
        4-bit kernel, which reads ``"kn"`` codes two per byte (``"nk"`` nibbles were
        unpacked for XLA's int8 matmul on every call: docs/performance.md).

        >>> import jqt
        >>> cpu = jqt.KernelPolicy.for_backend("cpu")
        >>> w8, w4g = jqt.QuantType(bits=8), jqt.QuantType(bits=4, group_size=128)
        >>> cpu.dense_layout(w8, None), cpu.dense_layout(w8, w8), cpu.dense_layout(w4g, None)
        ('kn', 'nk', 'kn')
        >>> cpu.dense_layout(w4g, w8), jqt.KernelPolicy().dense_layout(w4g, w8)
        ('kn', 'nk')
        >>> w4 = jqt.QuantType(bits=4, per_channel=True)
        >>> cpu.dense_layout(w4, w8), jqt.KernelPolicy().dense_layout(w4, w8)
        ('kn', 'nk')
        """
        grouped = bool(weight.group_size)
        if activation is None:
            digits = weight.kind == "int" and not grouped and self.weight_only_digits
            return "nk" if (digits and not self.weight_only_kn) or self.reduce_rows else "kn"
        if weight.kind == "float" and not self.fp8_native:
            return "kn"
        if grouped and weight.kind == "int" and (self.grouped_int_rows
                                                  or self.gemv_rows and self.batched_groups
                                                  or self.small_groups(weight)):
            return "kn"
        if weight.kind == "int" and weight.bits <= 4 and not grouped and self.native_gemv_rows:
            return "kn"
        return "nk"

    def small_groups(self, weight) -> bool:
        """Whether int8 activations on the grouped int ``weight`` (a
        :class:`jqt.QuantType`) skip int8 matmuls per group for the float matmul on
        their upcast codes, their groups being smaller than ``grouped_int_min_group``.

        >>> import jqt
        >>> cpu = jqt.KernelPolicy.for_backend("cpu")
        >>> [cpu.small_groups(jqt.QuantType(bits=4, group_size=g)) for g in (32, 64, 128, 0)]
        [True, True, False, False]
        >>> cpu.small_groups(jqt.QuantType(dtype="nf4", group_size=32))  # int codes only
        False
        """
        return weight.kind == "int" and 0 < weight.group_size < self.grouped_int_min_group

    @staticmethod
    def for_backend(backend: str | None = None) -> "KernelPolicy":
        """The table's policy for ``backend`` (default: ``jax.default_backend()``): ``"cpu"``,
        ``"gpu"`` (or ``"cuda"``), any case; another JAX platform (``"tpu"``, ``"rocm"``,
        ``"metal"``) gets the default :class:`KernelPolicy`; other names are refused.

        >>> import jqt
        >>> jqt.KernelPolicy.for_backend("GPU") == jqt.KernelPolicy.for_backend("cuda")
        True
        """
        if backend is None:
            return POLICIES.get(jax.default_backend(), POLICIES["default"])
        name = backend.lower() if isinstance(backend, str) else None
        if name in POLICIES:
            return POLICIES[name]
        if name in _PLATFORMS:
            return POLICIES["default"]
        raise ValueError(f"jqt.KernelPolicy.for_backend({backend!r}): expected a backend name, "
                         f"one of {sorted(set(POLICIES) | _PLATFORMS)} (the policy table has rows "
                         "for 'cpu' and 'gpu'; other platforms take the default policy).")


def check_policy(policy, fn: str):
    """Raises ``TypeError`` where ``policy`` is neither ``None`` nor a
    :class:`jqt.KernelPolicy` (a backend's name, for instance)."""
    if policy is not None and not isinstance(policy, KernelPolicy):
        hint = (f" (a backend's name: pass jqt.KernelPolicy.for_backend({policy!r}))"
                if isinstance(policy, str) else "")
        raise TypeError(f"{fn}: policy is a {type(policy).__name__}{hint}; expected a "
                        "jqt.KernelPolicy, or None for the default backend's.")


def cpu_flags() -> frozenset:
    """This CPU's feature flags as Linux's ``/proc/cpuinfo`` lists them; empty where it
    cannot be read (another OS): the table then assumes none."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bfloat16_dot_is_fast(flags) -> bool:
    """Whether XLA:CPU's bfloat16 matmul with float32 sums outruns its int8 one at many rows
    on a CPU with these ``flags``: with AVX512_BF16 or AMX-BF16 (a Zen 4 EPYC: the 100M
    decoder's prefill 0.612 / 0.606x float32 against 0.726 / 0.740x with int8 matmuls,
    two runs), not with AVX2 alone (a MiniLM-sized encoder block at 512 rows: 1.68x
    against 0.90x; docs/performance.md).

    >>> bfloat16_dot_is_fast({"avx2", "fma"}), bfloat16_dot_is_fast({"avx512f", "avx512_bf16"})
    (False, True)
    """
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def native_nf4_decode_pays(flags) -> bool:
    """Whether jqt's native decode of a whole NF4 weight (``native_decode=1``) outruns
    XLA:CPU's (a tree of 15 selects per code) on a CPU with these ``flags``: with AVX2
    (a 2-core AMD EPYC without AVX-512: all-MiniLM-L6-v2 ``nf4 g64`` at batch 1 / 8 0.72 /
    1.00x and 0.82 / 1.01x float32 against 0.89 / 1.08x and 1.00 / 1.12x in two runs),
    and with AVX-512, whose loop takes 16 codes per permute (a 2-core Zen 5 EPYC:
    0.90 / 1.01x and 1.00 / 1.01x against 1.09 / 1.06x and 1.09 / 1.07x; an earlier
    AVX2-only kernel had lost to XLA's decode on a Zen 4 EPYC, batch 1 1.05x against
    0.98x); benchmarks/results/formats-cpu-2core.md.

    >>> native_nf4_decode_pays({"avx2", "fma"}), native_nf4_decode_pays({"avx2", "avx512f"})
    (True, True)
    >>> native_nf4_decode_pays({"sse4_2"})
    False
    """
    return "avx2" in flags


_GPU = KernelPolicy(fp8_native=True, gemv_rows=4, weight_only_digits=3,  # benchmarks/results/gpu-h200.md
                   decode_in_input_dtype=True, cast_in_gemm=True,  # gpu-h100.md (fourth lease)
                   reduce_rows=1,  # benchmarks/results/gpu-h100.md (2026-11-26, second lease)
                   grouped_float=True)  # the same file (2026-11-27: XLA:GPU's compiler aborted)
_PLATFORMS = {"tpu", "rocm", "metal"}  # JAX platforms without a row of their own

POLICIES = {
    "cpu": KernelPolicy(pad_rows=2, ragged_int_rows=256, weight_only_chunk=256, conv_patches_below=16,
                        conv_codes_as_float=True, gemv_rows=4,
                        weight_only_digits=3, grouped_int_rows=8, float_matmul_rows=64,
                        grouped_int_min_group=128,
                        weight_only_block_bytes=4 << 20,
                        whole_decode_bytes=3 << 20, large_weight_bytes=32 << 20,
                        large_weight_rows=256, batched_map=True,
                        decode_in_input_dtype=bfloat16_dot_is_fast(cpu_flags()),
                        int_as_bfloat16_rows=255 if bfloat16_dot_is_fast(cpu_flags()) else 0,
                        fp8_as_bfloat16_rows=32 if bfloat16_dot_is_fast(cpu_flags()) else 0,
                        native_gemv_rows=8,
                        native_in_place=True, native_int8_rows=4, weight_only_kn=True,
                        int16_as_float=True,
                        native_decode=int(native_nf4_decode_pays(cpu_flags()))),
    "gpu": _GPU,
    "cuda": _GPU,
    "default": KernelPolicy(),
}
