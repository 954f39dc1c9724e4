"""jqt's formats on an accelerator, against bfloat16: dense 4096, all-MiniLM-L6-v2, a 100M decoder.

    python benchmarks/gpu.py --markdown          # on a GPU: a few minutes (H100 / H200)
    python benchmarks/gpu.py --only dense        # parts: dense, minilm, decode, generate
    python benchmarks/gpu.py --smoke             # tiny shapes, any backend: the script runs
    python benchmarks/gpu.py --smoke --policy gpu   # ... under the GPU table, on this machine
    python benchmarks/gpu.py --only dense --rows 1,4 --variants w8,"w8 [weight_only_digits=0]"
    python benchmarks/gpu.py --isolate --markdown   # a process per part and dense row count

Written for an NVIDIA H100 or H200 (XLA's cuBLAS / cuBLASLt and Triton paths); it runs
on any backend, under ``jqt.KernelPolicy.for_backend()`` (``--policy BACKEND``: that
backend's table instead). The float baseline is the
model in bfloat16, what a GPU serves; float32 (TF32 matmuls, JAX's default precision
on GPU) is a reference row. Every quantized variant runs the bfloat16 model through
``jqt.quantize(f, qp)(jqt.pack(qp, params), ...)`` under ``jax.jit``, calibrated on two
batches. Weights are random: speed does not depend on training.

* ``dense``: ``x @ w`` with ``w`` 4096 x 4096, at 1, 16 and 2048 rows. One call
  runs the layer ``reps`` times in a chain (each output, RMS-normalised, is the next
  input, written as a Python loop), so that kernel time, not the host's dispatch,
  is measured and XLA cannot merge or hoist the matmuls; the table gives the time
  per layer. ``[field=value]`` rows run a preset under the backend's kernel policy
  with fields replaced (the formulation the table did not choose). Also: the
  kernels XLA chose (from the compiled HLO: cuBLAS / cuBLASLt custom calls, Triton
  fusions), the error of the chain's output against float32's and the relative
  difference between the integer path and its float simulation (``simulate=True``).
* ``minilm``: all-MiniLM-L6-v2's shape (flax.linen BERT of ``examples/bert.py``, 6
  layers, hidden 384), random weights, 128 tokens, batch 1, 8 and 64.
* ``decode``: ``examples/decoder.py``'s Llama-style decoder at ``decode.py``'s 100M
  configuration, batch 1: one greedy decode step a call (``decode.step_unstacked``:
  the layers as a Python loop over per-layer weights), the key/value cache of 2048
  positions filled to 1024. Tokens per second and the ratio to bfloat16.

* ``generate``: the same decoder in a generate loop as users write it (a ``lax.scan``
  over decode steps carrying the cache, each step a ``lax.scan`` over the stacked
  layers), with int8 / fp8 key/value caches (``kv_cache=``): per-step time from the
  difference of loops of two lengths, and the bytes of the cache the loop carries.
  ``--large``: a 0.72B decoder instead (``LARGE``), whose bfloat16 weights take an
  H100 about as long to read as the 100M decoder's whole step.

JAX 0.11 (the GPU machines' release) describes ``lax.scan`` with a tree of operands
(``ft_in``) instead of ``num_consts``/``num_carry``; jqt reads both (``compat.scan_counts``).
Before it did, ``decode`` was written without scans, and it still is: it times one step.

All variants of a table run interleaved, round-robin (``timing.interleaved``); each
sample dispatches a call ``PIPELINE`` times and waits for the last (as a decode loop
whose next token stays on the device does), so the host's dispatch overlaps the
device's work. Reported: medians per call and ratios to bfloat16 in the same rounds. Prints tables and a
``RESULTS {json}`` line; ``--out FILE`` also writes the JSON after each part.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import time
import traceback

import paths  # noqa: F401  (this checkout's jqt, examples/)
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import cli
import jqt
import timing
from formats import table

R = jqt.recipes
BF16, F32 = jnp.bfloat16, jnp.float32

# name -> (recipe factory, {KernelPolicy field: value} replacing the backend's, or None)
DENSE = {
    "w8a8_dynamic": (R.w8a8_dynamic, None),
    "w8a8_dynamic [int_as_bfloat16_rows=0]": (R.w8a8_dynamic, dict(int_as_bfloat16_rows=0)),
    "w8": (R.w8, None),
    "w8 [weight_only_digits=3]": (R.w8, dict(gemv_rows=16, weight_only_digits=3)),
    "w8 [weight_only_digits=0]": (R.w8, dict(weight_only_digits=0)),
    "w8 [decode_in_input_dtype=True]": (R.w8, dict(decode_in_input_dtype=True)),
    "w8 [decode_in_input_dtype=False]": (R.w8, dict(decode_in_input_dtype=False)),
    "fp8": (R.fp8, None),
    "fp8 [fp8_native=False]": (R.fp8, dict(fp8_native=False)),
    "w4 g128": (lambda: R.w4(group_size=128), None),
    "w4 g128 [grouped_digits=3]": (lambda: R.w4(group_size=128), dict(gemv_rows=16, grouped_digits=3)),
    "w4 g128 [decode_in_input_dtype=True]": (lambda: R.w4(group_size=128), dict(decode_in_input_dtype=True)),
    "w4 g128 [decode_in_input_dtype=False]": (lambda: R.w4(group_size=128), dict(decode_in_input_dtype=False)),
    "nf4 g64 [decode_in_input_dtype=False]": (lambda: R.nf4(group_size=64), dict(decode_in_input_dtype=False)),
    "w4a8 g128": (lambda: R.w4a8(group_size=128), None),
    "w4a8 g128 [grouped_int_rows=4096]": (lambda: R.w4a8(group_size=128), dict(grouped_int_rows=4096)),
    "nf4 g64": (lambda: R.nf4(group_size=64), None),
    "w8 [reduce_rows=0]": (R.w8, dict(reduce_rows=0)),
    "w4 g128 [reduce_rows=0]": (lambda: R.w4(group_size=128), dict(reduce_rows=0)),
    # the lease of 2026-11-26 (gpu-h100.md, second part), before the table took reduce_rows=1
    "w8 [reduce_rows=16]": (R.w8, dict(reduce_rows=16)),
    "w4 g128 [reduce_rows=16]": (lambda: R.w4(group_size=128), dict(reduce_rows=16)),
    "nf4 g64 [reduce_rows=16]": (lambda: R.nf4(group_size=64), dict(reduce_rows=16)),
    "w4a8 g128 [reduce_rows=16]": (lambda: R.w4a8(group_size=128), dict(reduce_rows=16)),
    # int8 matmuls per group, the GPU table before 2026-11-27 (XLA:GPU aborted at 2-16 rows)
    "w4a8 g128 [grouped_float=False]": (lambda: R.w4a8(group_size=128), dict(grouped_float=False)),
}
MINILM = {
    "w8a8": (R.w8a8, None),
    "w8a8_dynamic": (R.w8a8_dynamic, None),
    "w8": (R.w8, None),
    "w8 [decode_in_input_dtype=True]": (R.w8, dict(decode_in_input_dtype=True)),
    "fp8": (R.fp8, None),
    "fp8 dynamic": (lambda: R.fp8(dynamic=True), None),
    "w4 g128": (lambda: R.w4(group_size=128), None),
    "w4a8 g128": (lambda: R.w4a8(group_size=128), None),
    "nf4 g64": (lambda: R.nf4(group_size=64), None),
    "w4 g128 [decode_in_input_dtype=True]": (lambda: R.w4(group_size=128), dict(decode_in_input_dtype=True)),
    "nf4 g64 [decode_in_input_dtype=True]": (lambda: R.nf4(group_size=64), dict(decode_in_input_dtype=True)),
    "w4 g128 [reduce_rows=4]": (lambda: R.w4(group_size=128), dict(reduce_rows=4)),
    "w4 g128 [reduce_rows=4 decode_in_input_dtype=True]": (
        lambda: R.w4(group_size=128), dict(reduce_rows=4, decode_in_input_dtype=True)),
    "w4a8 g128 [grouped_float=False]": (lambda: R.w4a8(group_size=128), dict(grouped_float=False)),
}
DECODE = {
    "w8": (R.w8, None),
    "w8 [weight_only_digits=0]": (R.w8, dict(weight_only_digits=0)),
    "w8a8_dynamic": (R.w8a8_dynamic, None),
    "fp8": (R.fp8, None),
    "w4 g128": (lambda: R.w4(group_size=128), None),
    "w4 g128 [grouped_digits=0]": (lambda: R.w4(group_size=128), dict(grouped_digits=0)),
    "w4a8 g128": (lambda: R.w4a8(group_size=128), None),
    "nf4 g64": (lambda: R.nf4(group_size=64), None),
}
GENERATE = {  # name -> recipe factory under the backend's kernel policy, or (factory, fields)
    "w8": R.w8,
    "w8a8_dynamic": R.w8a8_dynamic,
    "w8a8_dynamic + int8 KV": lambda: R.w8a8_dynamic(kv_cache=True),
    "fp8": R.fp8,
    "fp8 + fp8 KV": lambda: R.fp8(kv_cache="fp8"),
    "w4 g128": lambda: R.w4(group_size=128),
    "w4 g128 + int8 KV": lambda: R.w4(group_size=128, kv_cache=True),
    "nf4 g64": lambda: R.nf4(group_size=64),
    "w8 [reduce_rows=0]": (R.w8, dict(reduce_rows=0)),
    "w4 g128 [reduce_rows=0]": (lambda: R.w4(group_size=128), dict(reduce_rows=0)),
    # the lease of 2026-11-26 (gpu-h100.md, second part), before the table took reduce_rows=1
    "w8 [reduce_rows=4]": (R.w8, dict(reduce_rows=4)),
    "w4 g128 [reduce_rows=4]": (lambda: R.w4(group_size=128), dict(reduce_rows=4)),
    "w4a8 g128 [reduce_rows=4]": (lambda: R.w4a8(group_size=128), dict(reduce_rows=4)),
    "nf4 g64 [reduce_rows=4]": (lambda: R.nf4(group_size=64), dict(reduce_rows=4)),
    "w4 g128 + int8 KV [reduce_rows=4]": (lambda: R.w4(group_size=128, kv_cache=True), dict(reduce_rows=4)),
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    dense_n: int = 4096
    dense_rows: tuple = (1, 16, 2048)
    reps: int = 8
    minilm_tokens: int = 128
    minilm_batches: tuple = (1, 8, 64)
    max_len: int = 2048
    prompt: int = 1024
    rounds: int = 40
    loop_steps: tuple = (4, 36)
    full: bool = True  # the real models (False: tiny ones), whatever --rounds / --rows change
    large: bool = False  # generate: the 0.7B decoder (--large) instead of the 100M one


FULL = Sizes()
SMOKE = Sizes(dense_n=256, dense_rows=(1, 16), reps=2, minilm_tokens=16, minilm_batches=(1, 2),
              max_len=64, prompt=32, rounds=2, loop_steps=(2, 18), full=False)
PIPELINE = 4  # calls dispatched per timing sample


def _large():
    import decoder
    return decoder.Config(d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=5632, head_dim=64,
                          vocab=256)


LARGE = _large()
"""``generate --large``: 0.72B parameters (16 layers of d_model 2048, 32 query and 8 key/value
heads of 64, SwiGLU 5632), 1.4 GB in bfloat16: a step reads its weights in about 0.5 ms
at an H100's 3 TB/s, about what the 100M decoder's whole step takes there."""


def progress(msg):
    print(f"[gpu] {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


BASE = {"policy": None}  # --policy: the backend whose table every variant starts from


def policy_of(fields):
    base = BASE["policy"]
    return base if not fields else dataclasses.replace(base or jqt.KernelPolicy.for_backend(), **fields)


def to_bf16(tree):
    return jax.tree.map(lambda a: a.astype(BF16) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def kernels(jitted, *args):
    """The matmul kernels XLA chose for ``jitted(*args)``: cuBLAS / cuBLASLt / cuDNN custom
    calls and Triton GEMM fusions, counted, from the optimized HLO ("" if none)."""
    try:
        hlo = jitted.lower(*args).compile().as_text()
    except Exception as e:  # noqa: BLE001 - a report, not a check
        return f"(no HLO: {type(e).__name__})"
    found = re.findall(r'custom_call_target="([^"]+)"', hlo)
    found += re.findall(r'"kind":"(__triton[a-z_]*)"', hlo)
    found = [k for k in found if any(s in k for s in ("cublas", "cudnn", "triton", "gemm", "matmul"))]
    return ", ".join(f"{k} x{found.count(k)}" for k in sorted(set(found)))


def interleaved(calls, rounds):
    """``{name: timing.summary}`` of seconds per call: each sample times ``PIPELINE`` calls
    (before 2026-11-27 the tables of ``gpu-h100.md`` / ``gpu-h200.md`` gave that sample's
    time as one call's: their dense µs and MiniLM ms are 4x a call's, their ratios right)."""
    calls = {n: functools.partial(_pipelined, c) for n, c in calls.items()}
    timing.choose_rounds(list(calls.values()), 0.0, 1, 1, warmup=3)  # compile and warm up
    per_call = lambda d: {k: v / PIPELINE if k != "n" else v for k, v in d.items()}
    return {n: per_call(timing.summary(s)) for n, s in timing.interleaved(calls, rounds).items()}


def _pipelined(call):
    for _ in range(PIPELINE - 1):
        call()
    return call()  # the device runs them in order: the last one done, all are


def quantized(f, variants, params, calib, name, failed):
    """``{variant: (jitted quantized f, packed params, qparams)}``; a variant that fails
    is reported, named in ``failed`` and left out (the rest still run)."""
    out = {}
    for v, (make, fields) in variants.items():
        try:
            policy = policy_of(fields)
            if fields and policy == (BASE["policy"] or jqt.KernelPolicy.for_backend()):
                progress(f"{name}: {v} is the backend's own table here: not run twice")
                continue
            progress(f"{name}: calibrating and packing {v}")
            qp = jqt.calibrate(f, make(), params, calib, progress=False)
            out[v] = (jax.jit(jqt.quantize(f, qp, policy=policy)), jqt.pack(qp, params, policy=policy), qp)
        except Exception:  # noqa: BLE001 - report and go on: one device run has to give all it can
            failed.append(f"{name} {v}")
            progress(f"{name}: {v} FAILED\n{traceback.format_exc(limit=6)}")
    return out


def nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


# ----------------------------------------------------------------------------- dense

def dense(sizes, markdown, results, check=True):
    n, reps = sizes.dense_n, sizes.reps
    rng = np.random.default_rng(0)
    base = rng.standard_normal((n, n)).astype(np.float32) / np.sqrt(n)
    # a weight of its own for each layer (the base's columns rolled): with one weight for
    # all, XLA computes a decode once for the chain and the weight stays in the L2 cache
    ws32 = [jnp.asarray(np.roll(base, 7 * i, axis=1)) for i in range(reps)]
    w32 = ws32[0]
    layer = lambda w, x: x @ w

    def chain(ws, x):  # each layer in turn, each output RMS-normalised into the next input
        for w_ in ws:
            y = layer(w_, x).astype(F32)
            x = (y * lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(x.dtype)
        return x

    w = [a.astype(BF16) for a in ws32]
    calib = [(jnp.asarray(rng.standard_normal((16, n)), BF16),) for _ in range(2)]
    q = quantized(chain, DENSE, w, calib, "dense", results["failed"])
    fns = {"bfloat16": (jax.jit(chain), w), "float32": (jax.jit(chain), ws32)}
    fns.update({v: (fq, packed) for v, (fq, packed, _) in q.items()})
    rows, kern, per = [], {}, reps
    for m in sizes.dense_rows:
        progress(f"dense: {m} rows")
        x = jnp.asarray(rng.standard_normal((m, n)), BF16)
        args = {v: (p, x.astype(F32) if v == "float32" else x) for v, (_, p) in fns.items()}
        calls = {v: functools.partial(fn, *args[v]) for v, (fn, _) in fns.items()}
        med = interleaved(calls, sizes.rounds)
        base = med["bfloat16"]["median"]
        for v, s in med.items():
            results[f"dense{n} {v} m{m}"] = dict(us_per_layer=s["median"] / per * 1e6,
                                                 ratio_bf16=s["median"] / base)
        rows.append((str(m), f"{base / per * 1e6:.1f}")
                    + tuple(f"{med[v]['median'] / per * 1e6:.1f} ({med[v]['median'] / base:.2f}x)"
                            for v in fns if v != "bfloat16"))
        # on stderr as each row ends: kept where a later row runs out of a lease's time
        progress(f"dense: {m} rows: " + ", ".join(f"{v} {c}" for v, c in zip(fns, rows[-1][1:])))
        if m in (sizes.dense_rows[0], sizes.dense_rows[-1]):
            for v, (fn, _) in fns.items():
                kern[(v, m)] = kernels(fn, *args[v])
    print(f"dense {n} x {n}, {reps} chained layers a call: median microseconds per layer "
          f"(ratio to bfloat16); {sizes.rounds} interleaved rounds of {PIPELINE} calls")
    table(("rows", "bfloat16") + tuple(v for v in fns if v != "bfloat16"), rows, markdown)
    if not check:
        return
    # the chain's output against float32's; for the integer and fp8 kernels, one float32
    # layer's integer path against its float simulation (float32 rounding apart: ~1e-7)
    x1 = jnp.asarray(rng.standard_normal((16, n)), BF16)
    ref = np.asarray(jax.jit(chain)(ws32, x1.astype(F32)), np.float64)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                             / np.linalg.norm(np.asarray(b, np.float64)))
    info, first, last = [], sizes.dense_rows[0], sizes.dense_rows[-1]
    for v, (fq, packed, qp) in q.items():
        err = rel(fq(packed, x1).astype(F32), ref)
        dif = None
        if v in ("w8a8_dynamic", "fp8", "w4a8 g128"):
            x32 = x1.astype(F32)
            qp1, policy = jqt.calibrate(layer, DENSE[v][0](), w32, [(x32,)], progress=False), policy_of(None)
            out = jax.jit(jqt.quantize(layer, qp1, policy=policy))(jqt.pack(qp1, w32, policy=policy), x32)
            dif = rel(out, jax.jit(jqt.quantize(layer, qp1, simulate=True))(w32, x32))
        ratio = nbytes(packed) / nbytes(w)
        results[f"dense{n} {v}"] = dict(rel_err=err, int_vs_sim=dif, bytes_ratio=ratio)
        info.append((v, f"{ratio:.3f}", f"{err:.4f}", "-" if dif is None else f"{dif:.1e}",
                     kern.get((v, first), ""), kern.get((v, last), "")))
    info += [(v, "1.000" if v == "bfloat16" else "2.000", "-", "-", kern.get((v, first), ""),
              kern.get((v, last), "")) for v in ("bfloat16", "float32")]
    print(f"dense {n}: bytes against bfloat16, the {reps}-layer chain's error against float32, "
          "one float32 layer's integer path against its simulation, and the matmul kernels XLA chose")
    table(("variant", "bytes / bf16", "rel. error", "int vs sim", f"kernels, {first} row{'s' * (first != 1)}",
           f"kernels, {last} row{'s' * (last != 1)}"), info, markdown)


# ----------------------------------------------------------------------------- minilm

def minilm(sizes, markdown, results):
    from bert import Bert, BertConfig, mean_pool_normalize

    cfg = BertConfig() if sizes.full else BertConfig(vocab_size=512, num_hidden_layers=2)
    model = Bert(cfg)
    t = sizes.minilm_tokens
    rng = np.random.default_rng(1)
    ids = lambda b: jnp.asarray(rng.integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    params32 = model.init(jax.random.key(0), ids(1), jnp.ones((1, t), jnp.int32))
    params = to_bf16(params32)

    def embed(params, input_ids, mask):
        return mean_pool_normalize(model.apply(params, input_ids, mask), mask)

    calib = [(ids(8), jnp.ones((8, t), jnp.int32)) for _ in range(2)]
    q = quantized(embed, MINILM, params, calib, "minilm", results["failed"])
    fns = {"bfloat16": (jax.jit(embed), params), "float32": (jax.jit(embed), params32)}
    fns.update({v: (fq, packed) for v, (fq, packed, _) in q.items()})
    rows = []
    for b in sizes.minilm_batches:
        progress(f"minilm: batch {b}")
        x, mask = ids(b), jnp.ones((b, t), jnp.int32)
        calls = {v: functools.partial(fn, p, x, mask) for v, (fn, p) in fns.items()}
        med = interleaved(calls, sizes.rounds)
        base = med["bfloat16"]["median"]
        for v, s in med.items():
            results[f"minilm {v} b{b}"] = dict(ms=s["median"] * 1e3, ratio_bf16=s["median"] / base)
        rows.append((str(b), f"{base * 1e3:.3f}")
                    + tuple(f"{med[v]['median'] * 1e3:.3f} ({med[v]['median'] / base:.2f}x)"
                            for v in fns if v != "bfloat16"))
        # on stderr as each batch ends: kept where a later batch runs out of a lease's time
        progress(f"minilm: batch {b}: " + ", ".join(f"{v} {c}" for v, c in zip(fns, rows[-1][1:])))
    print(f"all-MiniLM-L6-v2's shape, random weights, {t} tokens: median ms a call (ratio to "
          f"bfloat16); {sizes.rounds} interleaved rounds; weight bytes / bfloat16: "
          + ", ".join(f"{v} {nbytes(p) / nbytes(params):.3f}" for v, (_, p) in fns.items()))
    table(("batch", "bfloat16") + tuple(v for v in fns if v != "bfloat16"), rows, markdown)


# ----------------------------------------------------------------------------- decode

def decode(sizes, markdown, results):
    import decoder
    from decode import CONFIG, step_unstacked

    config = CONFIG if sizes.full else decoder.TINY
    L = config.n_layers
    step = functools.partial(step_unstacked, config=config)
    pre = jax.jit(functools.partial(decoder.prefill, max_len=sizes.max_len, config=config))
    params32 = decoder.init_params(config, jax.random.key(0))

    def unstacked(p):  # per-layer weights: no lax.scan (see the module docstring)
        return {**p, "layers": [jax.tree.map(lambda a: a[i], p["layers"]) for i in range(L)]}

    def inputs(p, seed):  # (cache, token) at batch 1: the cache from a prefill of random tokens
        r = np.random.default_rng(seed)
        _, c = pre(p, jnp.asarray(r.integers(0, config.vocab, (1, sizes.prompt)), jnp.int32))
        c = {"k": [c["k"][i] for i in range(L)], "v": [c["v"][i] for i in range(L)], "pos": c["pos"]}
        return c, jnp.asarray(r.integers(0, config.vocab, (1,)), jnp.int32)

    stacked = to_bf16(params32)  # for the (float) prefill that fills the caches
    params, params32 = unstacked(stacked), unstacked(params32)
    calib = [inputs(stacked, s) for s in (1, 2)]
    q = quantized(step, DECODE, params, calib, "decode", results["failed"])
    cache, token = inputs(stacked, 3)
    cache32 = jax.tree.map(lambda a: a.astype(F32) if a.dtype == BF16 else a, cache)
    fns = {"bfloat16": (jax.jit(step), params, cache), "float32": (jax.jit(step), params32, cache32)}
    fns.update({v: (fq, packed, cache) for v, (fq, packed, _) in q.items()})
    calls = {v: functools.partial(fn, p, c, token) for v, (fn, p, c) in fns.items()}
    progress(f"decode: timing {len(calls)} variants")
    med = interleaved(calls, sizes.rounds)
    base = med["bfloat16"]["median"]
    ref = np.asarray(fns["bfloat16"][0](params, cache, token)[0], np.float64)
    rows = []
    for v, s in med.items():
        fn, p, c = fns[v]
        logits, new_cache = fn(p, c, token)
        err = np.linalg.norm(np.asarray(logits, np.float64) - ref) / np.linalg.norm(ref)
        t = s["median"]
        kv = nbytes(new_cache) / nbytes(cache)
        results[f"decode {v}"] = dict(ms_per_token=t * 1e3, tokens_s=1 / t, ratio_bf16=s["median"] / base,
                                      bytes_ratio=nbytes(p) / nbytes(params), cache_ratio=kv, logits_err=err)
        rows.append((v, f"{t * 1e3:.3f}", f"{1 / t:.0f}", f"{s['median'] / base:.2f}",
                     f"{nbytes(p) / nbytes(params):.3f}", f"{kv:.3f}", f"{err:.3f}"))
    print(f"Decode step, batch 1: {sum(x.size for x in jax.tree.leaves(params32)) / 1e6:.1f}M "
          f"parameters, cache of {sizes.max_len} positions filled to {sizes.prompt}; "
          f"{sizes.rounds} interleaved rounds of {PIPELINE} steps")
    table(("variant", "ms / token", "tokens / s", "time / bf16", "weight bytes / bf16",
           "cache bytes / bf16", "logits error vs bf16"), rows, markdown)


# ----------------------------------------------------------------------------- generate

def generate(sizes, markdown, results):
    """A generate loop as users write it: ``lax.scan`` over decode steps carrying the key/value
    cache, each step a ``lax.scan`` over the stacked layers, timed by ``decode_cache.cache_speed``
    (per-step time = (loop of ``n2`` steps - loop of ``n1``) / (n2 - n1), so the cache's
    one-time quantization on entry is not counted; cache bytes are those the loop carries)."""
    import decoder
    from decode import CONFIG
    from decode_cache import cache_speed

    config = (LARGE if sizes.large else CONFIG) if sizes.full else decoder.TINY
    n1, n2 = sizes.loop_steps
    variants = {"bfloat16": BF16, "float32": F32, **GENERATE}
    rows, n = cache_speed(config, sizes.max_len, n1, n2, sizes.rounds, variants, start=sizes.prompt,
                          policy=BASE["policy"], progress=lambda m: progress(f"generate: {m}"))
    out = []
    for v, sec, ratio, kv, kv_ratio, w_ratio, dtypes in rows:
        results[f"generate {v}"] = dict(ms_per_token=sec * 1e3, tokens_s=1 / sec, ratio_bf16=ratio,
                                        bytes_ratio=w_ratio, cache_ratio=kv_ratio, cache_dtypes=dtypes)
        out.append((v, f"{sec * 1e3:.3f}", f"{1 / sec:.0f}", f"{ratio:.2f}", f"{w_ratio:.3f}",
                    f"{kv_ratio:.3f} ({', '.join(dtypes)})"))
    print(f"Generate loop, batch 1: {n / 1e6:.1f}M parameters; a lax.scan over decode steps (each a "
          f"lax.scan over the layers), cache of {sizes.max_len} positions from position {sizes.prompt}; "
          f"per-step time from loops of {n2} and {n1} steps, {sizes.rounds} interleaved rounds, medians")
    table(("variant", "ms / token", "tokens / s", "time / bf16", "weight bytes / bf16",
           "carried cache bytes / bf16"), out, markdown)


PARTS = {"dense": dense, "decode": decode, "minilm": minilm, "generate": generate}


def isolated(a):
    """``--isolate``: this script again per part (per row count for ``dense``), each in its
    own process with the other arguments; their tables as they print, their results merged,
    a process that died named in ``failed`` with the end of its output."""
    argv = [x for x in sys.argv[1:] if x != "--isolate"]
    drop = {"--only", "--rows", "--out"}
    base = [x for i, x in enumerate(argv) if x not in drop and x.split("=")[0] not in drop
            and (i == 0 or argv[i - 1] not in drop)]
    rows = [str(r) for r in (a.rows or (SMOKE if a.smoke else FULL).dense_rows)]
    jobs = [(p, ["--rows", r] if p == "dense" else []) for p in a.only
            for r in (rows if p == "dense" else [None])]
    results, failed = {}, []
    # Each process takes GPU memory as it needs it. By default JAX takes 75% at start: on the
    # H100 of 2026-11-27 every process started a second after another exited got less (that
    # memory was not yet free, it seems), then failed to load its kernels (out of memory).
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    for part, extra in jobs:
        name = part + (f" rows {extra[1]}" if extra else "")
        progress(f"--isolate: {name}")
        r = subprocess.run([sys.executable, __file__, *base, "--only", part, *extra],
                           capture_output=True, text=True, env=env)
        sys.stderr.write(r.stderr)  # progress and any part's traceback
        lines = r.stdout.splitlines()
        print("\n".join(l for l in lines if not l.startswith("RESULTS ")), flush=True)
        got = [json.loads(l[len("RESULTS "):]) for l in lines if l.startswith("RESULTS ")]
        if got:
            failed += got[0].pop("failed")
            results.update(got[0])
        if r.returncode != 0 and not got:
            failed.append(f"{name} (exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1]})")
            progress(f"{name} died:\n{r.stderr[-3000:]}")
        if a.out:
            with open(a.out, "w") as fh:
                json.dump({**results, "failed": failed}, fh, indent=1)
    results["failed"] = failed
    print("RESULTS " + json.dumps(results))
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


def derive(name):
    """Adds ``"BASE [field=value ...]"`` to every table that has ``BASE`` without fields: the
    same preset under the backend's table with those ``KernelPolicy`` fields replaced.

    >>> derive("w8 [decode_in_input_dtype=True weight_only_digits=0]")
    >>> DENSE["w8 [decode_in_input_dtype=True weight_only_digits=0]"][1]
    {'decode_in_input_dtype': True, 'weight_only_digits': 0}
    """
    m = re.fullmatch(r"(.+?) \[(.+)\]", name)
    if not m:
        return
    base, fields = m.group(1), {}
    for item in m.group(2).split():
        k, _, v = item.partition("=")
        if k not in {f.name for f in dataclasses.fields(jqt.KernelPolicy)}:
            raise SystemExit(f"--variants {name!r}: KernelPolicy has no field {k!r}")
        try:
            fields[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            raise ValueError(f"{k}={v!r} is no Python literal (8, True, 0.5)") from None
    for table_ in (DENSE, MINILM, DECODE, GENERATE):
        if base in table_ and name not in table_:
            entry = table_[base]
            make, own = entry if isinstance(entry, tuple) else (entry, None)
            table_[name] = (make, {**(own or {}), **fields})


def main():
    # no abbreviations: --isolate re-runs this script without "--isolate" and the options it
    # sets per process ("--iso" or "--only=dense" would pass the filters below)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--only", default=",".join(PARTS), type=cli.names(list(PARTS)),
                    help=f"comma-separated parts, run in this order: {', '.join(PARTS)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and 2 rounds")
    ap.add_argument("--rounds", type=cli.positive_int, default=None,
                    help="interleaved timing rounds of every table (default: 40, 2 with --smoke)")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    ap.add_argument("--out", help="also write the results JSON here after each part")
    ap.add_argument("--policy", help="start every variant from this backend's kernel policy "
                    "(jqt.KernelPolicy.for_backend), e.g. gpu")
    ap.add_argument("--variants", help="comma-separated variant names (default: all)")
    ap.add_argument("--rows", type=cli.int_list, help="dense rows, comma-separated")
    ap.add_argument("--batches", type=cli.int_list, help="minilm batches, comma-separated")
    ap.add_argument("--large", action="store_true", help="generate: the 0.7B decoder (LARGE)")
    ap.add_argument("--no-check", action="store_true", help="dense: timings and kernels only (no "
                    "error table, whose float simulations of grouped formats crashed XLA:GPU's "
                    "compiler on an H200 in JAX 0.11.2; gpu_compile.py found none on an H100)")
    ap.add_argument("--isolate", action="store_true", help="run each part (and each dense row "
                    "count) in a process of its own, so that a compiler that aborts the process "
                    "(XLA:GPU did, in JAX 0.11.2) loses only that table")
    a = ap.parse_args()
    sizes = SMOKE if a.smoke else FULL
    if a.rounds is not None:
        sizes = dataclasses.replace(sizes, rounds=a.rounds)
    if a.rows:
        sizes = dataclasses.replace(sizes, dense_rows=a.rows)
    if a.batches:
        sizes = dataclasses.replace(sizes, minilm_batches=a.batches)
    if a.large:
        sizes = dataclasses.replace(sizes, large=True)
    if a.policy:
        try:
            BASE["policy"] = jqt.KernelPolicy.for_backend(a.policy)
        except ValueError as e:
            ap.error(f"--policy: {e}")
    if a.variants:
        keep = a.variants.split(",")
        for name in keep:
            try:
                derive(name)
            except ValueError as e:  # a value ast.literal_eval cannot read
                ap.error(f"--variants {name!r}: {e}")
        unknown = set(keep) - set(DENSE) - set(MINILM) - set(DECODE) - set(GENERATE)
        if unknown:
            raise SystemExit(f"--variants: no variant named {', '.join(sorted(unknown))}")
        for table_ in (DENSE, MINILM, DECODE, GENERATE):  # a value KernelPolicy refuses:
            for name in keep:  # refused before any part runs (a device lease is short)
                entry = table_.get(name)
                if isinstance(entry, tuple) and entry[1]:
                    try:  # (on a policy of no backend's: --isolate's parent starts none)
                        dataclasses.replace(BASE["policy"] or jqt.KernelPolicy(), **entry[1])
                    except (TypeError, ValueError) as e:
                        ap.error(f"--variants {name!r}: {e}")
        for table_ in (DENSE, MINILM, DECODE, GENERATE):
            for k in [k for k in table_ if k not in keep]:
                del table_[k]
    if a.isolate:  # (its processes take the arguments checked above)
        return isolated(a)
    dev = jax.devices()[0]
    results = {"device": f"{dev.platform}: {getattr(dev, 'device_kind', '')}", "jax": jax.__version__,
               "failed": []}
    print(f"{results['device']}, jax {jax.__version__}; kernel policy: "
          f"{BASE['policy'] or jqt.KernelPolicy.for_backend()}")
    failed = results["failed"]
    for part in a.only:  # every name checked by the parser, before any part ran
        try:
            kw = dict(check=not a.no_check) if part == "dense" else {}
            PARTS[part](sizes, a.markdown, results, **kw)
        except Exception:  # noqa: BLE001 - one part failing leaves the others to run
            failed.append(part)
            progress(f"{part} FAILED\n{traceback.format_exc()}")
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(results, fh, indent=1)
    print("RESULTS " + json.dumps(results))
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
