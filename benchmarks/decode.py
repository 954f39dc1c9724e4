"""Decode and prefill speed of a 100M-parameter Llama-style decoder, float32 against jqt's presets.

    python benchmarks/decode.py --markdown          # about 6 minutes on 2 idle cores
    python benchmarks/decode.py --quick             # fewer rounds (compiling stays)
    python benchmarks/decode.py --only decode       # parts: decode, prefill, formulations,
                                                    # bandwidth, cache; and/or variants:
                                                    # --only decode,w8,w4a8_g128

The model is ``examples/decoder.py``'s decoder (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU, tied embeddings, layers stacked under
``lax.scan``) at ``CONFIG`` below, with random weights (``init_params``, seed 0):
speed does not depend on training. Each variant runs under ``jax.jit``; the
quantized ones as ``jqt.quantize(f, qp)(jqt.pack(qp, params), ...)``, calibrated
on two batches of random tokens.

* ``decode``: one ``decoder.decode_step`` at batch 1 with a float32 key/value
  cache of ``MAX_LEN`` positions, at position ``PROMPT`` (the cache filled by a
  ``prefill`` of that many random tokens; calibration runs the step on two such
  caches). Each call is a step as a server streams it (docs/generate.md): jitted
  with ``donate_argnums=1``, the cache it returns passed back to the next call,
  its position held at ``PROMPT`` (``streamed``). Until 2026-12-07 this part
  timed a step that kept its cache (no donation), which the restacked step of
  ``decode_layouts.py`` ran faster than the step that writes in place, and which
  no decode loop runs (docs/performance.md). The targets (issue 13): int8 weights <= 0.4x float32's step time,
  int4 g128 <= 0.25x. A reference row runs the same float step with the layer
  loop unrolled over per-layer arrays (no stacked weights to slice): under
  ``lax.scan`` XLA:CPU copies each layer's stacked weights out before its
  matmuls, which the quantized variants pay too, on 4-8x fewer bytes. A column
  counts each variant's minor page faults per step, after the timing
  (``faults_per_call``): a step's time includes the faults on whatever the
  allocator mapped afresh for its outputs and temporaries, float32's sliced
  weights on every call, and, in some runs and not others, a quantized step's
  new cache (two blocks of 18.9 MB, under glibc's 32 MiB mmap limit, so where
  they land depends on the allocator's state). Read the step times of a run
  with its fault counts. The ``kv8`` rows run the step with an int8 key/value
  cache: it returns the cache quantized and takes it back so, timed on the
  quantized cache of the same context.
* ``prefill``: ``decoder.prefill`` of a batch of 8 x 128 random tokens; target:
  every preset <= 1.0x float32. Extra rows run three presets without the
  many-row formulation (``KernelPolicy.float_matmul_rows``), with the weight
  decoded in blocks of output channels (``many_rows_block``) instead of whole,
  and decoded whole without the dependency on its input that keeps XLA:CPU from
  hoisting it (``decode_after_input``).
* ``formulations``: the decode step of each preset under each formulation the
  kernel policy can choose for few rows (``jqt.KernelPolicy``), at 1, 2 and 4
  rows (decode batch 1, 2 and 4): the measurements behind the CPU table in
  ``jqt/_src/policy.py``.
* ``bandwidth``: the rate at which each formulation reads a weight too large
  for the cache (8 layers of 1024 x 4096), and the memory's own read rate.
* ``cache``: quantized key/value caches in a ``lax.scan`` over decode steps at
  context 2048 (``decode_cache.py``): step time and carried cache bytes against
  float32; targets: cache bytes <= 0.27x, the int8-cache step <= the float-cache one.

All variants of a table run interleaved, round-robin (``timing.interleaved``);
reported: medians and the ratio to float32's median in the same rounds. Prints
tables (``--markdown``: markdown) and a ``RESULTS {json}`` line.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import resource
import sys

import paths  # noqa: F401  (this checkout's jqt, examples/)
import jax
import jax.numpy as jnp
import numpy as np

import cli
import decoder
import jqt
import timing
from formats import table

R = jqt.recipes
CONFIG = decoder.Config(d_model=1024, n_layers=9, n_heads=16, n_kv_heads=4, d_ff=2816, head_dim=64,
                        vocab=256)
MAX_LEN, PROMPT = 2048, 1024      # decode: cache positions, and the step's position (its context)
PREFILL = (8, 128)                # prefill: batch x tokens
CPU = jqt.KernelPolicy.for_backend("cpu")

# name -> (recipe factory, time-ratio target or None)
VARIANTS = {
    "w8": (R.w8, 0.4),
    "w8a8_dynamic": (R.w8a8_dynamic, 0.4),
    "w4 g128": (lambda: R.w4(group_size=128), 0.25),
    "w4a8 g128": (lambda: R.w4a8(group_size=128), 0.25),
}
# decode only: the step with an int8 key/value cache, which it returns quantized and takes
# back so (a decode step called from a Python loop; docs/generate.md)
KV_VARIANTS = {
    "w8a8_dynamic kv8": (lambda: R.w8a8_dynamic(kv_cache=True), 0.4),
    "w4 g128 kv8": (lambda: R.w4(group_size=128, kv_cache=True), 0.25),
}
PREFILL_TARGET = 1.0
UNSTACKED = "float32, layers unstacked (reference)"

# formulations: preset -> {formulation: policy}: the CPU table with the fields that force one
# formulation at the measured batches (up to 4 rows). The CPU table column marks the one
# whose program is the table's at that batch.
def _p(**kw):
    return dataclasses.replace(CPU, **kw)


FORMULATIONS = {
    "w8": {"native kernel, jqt_channel_gemv_kn (kn)": _p(),
           "native kernel, jqt_channel_gemv (nk)": _p(weight_only_kn=False),
           "cast K-chunks of 256 (kn)": _p(weight_only_digits=0, whole_decode_bytes=0, native_gemv_rows=0),
           "cast N-chunks of 256 (nk)": _p(gemv_rows=0, whole_decode_bytes=0, native_gemv_rows=0,
                                           weight_only_kn=False),
           "whole weights, each decoded after its input (kn)": _p(weight_only_digits=0, weight_only_chunk=0,
                                                                  native_gemv_rows=0),
           "3 int8 digits, int8 matmul (nk)": _p(gemv_rows=4, weight_only_digits=3, native_gemv_rows=0,
                                                 weight_only_kn=False),
           "4 int8 digits, int8 matmul (nk)": _p(gemv_rows=4, weight_only_digits=4, native_gemv_rows=0,
                                                 weight_only_kn=False)},
    "w8a8_dynamic": {"native kernel on the int8 codes, jqt_channel_gemv (nk)": _p(native_int8_rows=8),
                     "int8 matmul, rows padded to 2": _p(pad_rows=2, native_int8_rows=0),
                     "int8 matmul, rows not padded": _p(pad_rows=1, native_int8_rows=0)},
    "w4 g128": {"native kernel, jqt_grouped_gemv (kn)": _p(),
                "cast K-chunks of 256 (kn)": _p(grouped_digits=0, whole_decode_bytes=0, native_gemv_rows=0),
                "cast K-chunks of 256, weights up to 3 MiB whole (kn)": _p(grouped_digits=0, native_gemv_rows=0),
                "whole weights, each decoded after its input (kn)": _p(grouped_digits=0, weight_only_chunk=0,
                                                                       native_gemv_rows=0),
                "3 int8 digits, batched group matmul (kn)": _p(gemv_rows=4, grouped_digits=3, native_gemv_rows=0)},
    "w4a8 g128": {"native kernel, jqt_grouped_gemv (kn)": _p(),
                  "int8 matmul per group (nk)": _p(grouped_int_rows=0, whole_decode_bytes=0, native_gemv_rows=0),
                  "int8 matmul per group, weights up to 3 MiB decoded whole (nk)": _p(grouped_int_rows=0,
                                                                                       native_gemv_rows=0),
                  "int8 matmul per group, weights up to 3 MiB decoded whole (kn)": _p(native_gemv_rows=0),
                  "batched group matmul (kn)": _p(gemv_rows=4, batched_groups=True, native_gemv_rows=0),
                  "codes upcast, K-chunks and weights up to 3 MiB whole as w4 (kn)": _p(
                      grouped_int_min_group=256, native_gemv_rows=0)},
}
# decode: A/B rows timed beside the table's (the same preset under another policy)
_NO_NATIVE = ("XLA formulations, no native kernel (native_gemv_rows=0)", _p(native_gemv_rows=0))
_COPIED = ("each layer's codes copied out of the stack (native_in_place=False)", _p(native_in_place=False))
_INT8_XLA = ("XLA's int8 matmul (native_int8_rows=0)", _p(native_int8_rows=0))
_W8_NK = ("packed (N, K), jqt_channel_gemv (weight_only_kn=False)", _p(weight_only_kn=False))
DECODE_AB = {"w8": (_W8_NK, _COPIED, _NO_NATIVE), "w4 g128": (_COPIED, _NO_NATIVE),
             "w4a8 g128": (_COPIED, _NO_NATIVE), "w8a8_dynamic": (_INT8_XLA,)}
FORMULATION_BATCHES = (1, 2, 4)
# prefill rows (1024) under the formulation the table had before float_matmul_rows: shows why
PREFILL_FORMULATIONS = {"w8": "cast K-chunks of 256", "w4 g128": "cast K-chunks of 256",
                        "w4a8 g128": "int8 matmul per group"}


def progress(msg):
    print(f"[decode] {msg}", file=sys.stderr, flush=True)


def step_unstacked(params, cache, token, config=CONFIG):
    """``decoder.decode_step`` with the layer loop unrolled over per-layer arrays
    (``params["layers"]`` a list of dicts, ``cache["k"]``/``["v"]`` lists): the same
    arithmetic without slicing stacked weights."""
    pos = cache["pos"]
    mask = (jnp.arange(cache["k"][0].shape[1]) <= pos)[None, :]
    h = params["embed"][token[:, None]]
    ks, vs = [], []
    for layer, kc, vc in zip(params["layers"], cache["k"], cache["v"]):
        q, k, v = decoder._qkv(config, layer, h, pos[None])
        kc = jax.lax.dynamic_update_slice(kc, k, (0, pos, 0, 0))
        vc = jax.lax.dynamic_update_slice(vc, v, (0, pos, 0, 0))
        h = decoder._finish(config, layer, h, decoder._attend(q, kc, vc, mask))
        ks.append(kc)
        vs.append(vc)
    return decoder._logits(params, h[:, 0]), {"k": ks, "v": vs, "pos": pos + 1}


def unstack(params, cache):
    layers = [jax.tree.map(lambda a: a[i], params["layers"]) for i in range(CONFIG.n_layers)]
    split = lambda a: [a[i] for i in range(CONFIG.n_layers)]
    return ({**params, "layers": layers},
            {"k": split(cache["k"]), "v": split(cache["v"]), "pos": cache["pos"]})


def float_bytes(params):
    return sum(x.nbytes for x in jax.tree.leaves(params))


def cache_bytes(cache):
    """Bytes of a (possibly quantized) cache: every array in it but the position."""
    return sum(x.nbytes for x in jax.tree.leaves(cache) if np.ndim(x) > 0)


def decode_inputs(params, seeds):
    """(cache, token) pairs at batch 1: the cache from a float prefill of PROMPT random tokens."""
    pre = jax.jit(functools.partial(decoder.prefill, max_len=MAX_LEN, config=CONFIG))
    out = []
    for s in seeds:
        rng = np.random.default_rng(s)
        _, cache = pre(params, jnp.asarray(rng.integers(0, 256, (1, PROMPT)), jnp.int32))
        out.append((cache, jnp.asarray(rng.integers(0, 256, (1,)), jnp.int32)))
    return out


def batched(inputs, batch):
    """A batch-1 (cache, token) repeated ``batch`` times (the cache's batch axis is 1)."""
    cache, token = inputs
    rep = lambda a: jnp.repeat(a, batch, axis=1)
    return {"k": rep(cache["k"]), "v": rep(cache["v"]), "pos": cache["pos"]}, jnp.repeat(token, batch)


def timed(calls, rounds):
    """Interleaved medians (seconds) and the 25th-75th percentiles, after compiling and
    warming every call up."""
    timing.choose_rounds(list(calls.values()), 0.0, 1, 1, warmup=2)
    return {n: timing.summary(s) for n, s in timing.interleaved(calls, rounds).items()}


def faults_per_call(call, n=5):
    """Minor page faults per call of ``call`` (the process's count, over ``n`` calls): memory
    the allocator maps afresh for a call's outputs and temporaries. glibc maps any block over
    its mmap threshold (at most 32 MiB, raised to the size of the last such block freed) and
    unmaps it when freed, so the next call faults on its pages again: a cost in the call's
    time, which varies from run to run with the allocator's state."""
    jax.block_until_ready(call())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        jax.block_until_ready(call())
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / n


def build(f, recipe, params, calib, policy=None, donate=()):
    qp = jqt.calibrate(f, recipe, params, calib, progress=False)
    packed = jqt.pack(qp, params, policy=policy)
    return qp, packed, jax.jit(jqt.quantize(f, qp, policy=policy), donate_argnums=donate)


def streamed(f, params, cache, token):
    """A call of ``f(params, cache, token)`` (jitted with ``donate_argnums=1``) as a server
    streams it: each call donates the cache the last one returned, its position held at
    ``cache["pos"]`` so every call runs the same step. ``cache`` itself is copied first
    (donation deletes the arrays it is given)."""
    held = {"cache": jax.tree.map(jnp.copy, cache)}
    pos = np.asarray(cache["pos"])  # a fresh array each call: the last one was donated

    def call():
        logits, c = f(params, held["cache"], token)
        held["cache"] = dict(c, pos=jnp.asarray(pos))
        return logits
    return call


def decode(names, rounds, markdown, results):
    params = decoder.init_params(CONFIG, jax.random.key(0))
    step = functools.partial(decoder.decode_step, config=CONFIG)
    progress(f"prefilling {PROMPT} random tokens x 3 (calibration and timing caches)")
    calib = decode_inputs(params, (1, 2))
    cache, token = decode_inputs(params, (3,))[0]
    fb = float_bytes(params)
    calls = {"float32": streamed(jax.jit(step, donate_argnums=1), params, cache, token)}
    up, uc = unstack(params, cache)
    calls[UNSTACKED] = streamed(jax.jit(step_unstacked, donate_argnums=1), up, uc, token)
    info = {"float32": dict(bytes=fb, cache=cache_bytes(cache)), UNSTACKED: dict(bytes=fb, cache=cache_bytes(cache))}
    for name in names:
        progress(f"calibrating and packing {name}")
        make, _ = {**VARIANTS, **KV_VARIANTS}[name]
        qp, packed, f = build(step, make(), params, calib, donate=1)
        # the cache the step returns, from a call that keeps ``cache``: a quantized one
        # (KV_VARIANTS) is taken back as the step returned it, at the same position
        out_cache = jax.jit(jqt.quantize(step, qp))(packed, cache, token)[1]
        held = dict(out_cache, pos=cache["pos"]) if isinstance(out_cache["k"], jqt.QArray) else cache
        calls[name] = streamed(f, packed, held, token)
        info[name] = dict(bytes=packed.nbytes(), cache=cache_bytes(out_cache))
        for label, policy in DECODE_AB.get(name, ()):
            _, pk, g = build(step, make(), params, calib, policy, donate=1)
            calls[f"{name}, {label}"] = streamed(g, pk, held, token)
            info[f"{name}, {label}"] = info[name]
    progress(f"timing {len(calls)} variants x {rounds} rounds")
    med = timed(calls, rounds)
    faults = {name: faults_per_call(call) for name, call in calls.items()}  # after the timing
    base = med["float32"]["median"]
    ref = med[UNSTACKED]["median"]
    rows = []
    for name, s in med.items():
        ratio = s["median"] / base
        target = {**VARIANTS, **KV_VARIANTS}.get(name, (None, None))[1]
        check = "-" if target is None else f"{'PASS' if ratio <= target else 'MISS'} (<= {target})"
        rows.append((name, f"{s['median'] * 1e3:.1f}", f"{s['p25'] * 1e3:.1f}-{s['p75'] * 1e3:.1f}",
                     f"{ratio:.3f}", f"{s['median'] / ref:.2f}", f"{info[name]['bytes'] / fb:.3f}",
                     f"{info[name]['cache'] / info['float32']['cache']:.2f}", f"{faults[name]:.0f}", check))
        results[f"decode {name}"] = dict(ms=s["median"] * 1e3, ratio=ratio, ratio_unstacked=s["median"] / ref,
                                         bytes_ratio=info[name]["bytes"] / fb, target=target,
                                         page_faults=faults[name])
    n = decoder.param_count(params)
    print(f"Decode step, batch 1: {n / 1e6:.1f}M parameters ({CONFIG.n_layers} layers, d_model "
          f"{CONFIG.d_model}, d_ff {CONFIG.d_ff}, {CONFIG.n_heads} heads / {CONFIG.n_kv_heads} kv heads "
          f"of {CONFIG.head_dim}, vocab {CONFIG.vocab}), float32 cache of {MAX_LEN} positions, step at "
          f"position {PROMPT} (context {PROMPT + 1}), one donated step a call, its cache passed back; "
          f"{rounds} interleaved rounds")
    table(("variant", "median ms", "p25-p75 ms", "time / float32", "time / float32 unstacked",
           "weight bytes / float32", "cache bytes / float32", "page faults / step", "target (time / float32)"),
          rows, markdown)


def prefill(names, rounds, markdown, results):
    params = decoder.init_params(CONFIG, jax.random.key(0))
    f = functools.partial(decoder.prefill, max_len=PREFILL[1], config=CONFIG)
    rng = np.random.default_rng(10)
    tok = lambda: jnp.asarray(rng.integers(0, 256, PREFILL), jnp.int32)
    calib, x = [(tok(),) for _ in range(2)], tok()
    calls = {"float32": (lambda g=jax.jit(f): g(params, x))}
    for name in names:
        progress(f"prefill: calibrating and packing {name}")
        qp, packed, g = build(f, VARIANTS[name][0](), params, calib)
        calls[name] = lambda g=g, p=packed: g(p, x)
        if name == "w8a8_dynamic":  # the other formulation of its many-row int8 matmuls
            other = 0 if CPU.int_as_bfloat16_rows else 255  # the table's choice depends on the CPU
            label = "int8 matmuls" if not other else "codes as bfloat16"
            policy = dataclasses.replace(CPU, int_as_bfloat16_rows=other)
            g0 = jax.jit(jqt.quantize(f, qp, policy=policy))
            calls[f"{name}, {label} (int_as_bfloat16_rows={other})"] = \
                lambda g=g0, p=jqt.pack(qp, params, policy=policy): g(p, x)
        if name in PREFILL_FORMULATIONS:
            for label, policy in (
                    (f"{PREFILL_FORMULATIONS[name]} (no float_matmul_rows, no whole_decode_bytes)",
                     dataclasses.replace(CPU, float_matmul_rows=0, whole_decode_bytes=0,
                                         grouped_int_rows=0)),
                    ("decoded in blocks of 1024 output channels (many_rows_block=1024)",
                     dataclasses.replace(CPU, many_rows_block=1024)),
                    ("decoded whole, not tied to its input (decode_after_input=False)",
                     dataclasses.replace(CPU, decode_after_input=False)),
                    *((("nibbles decoded in halves, the activation reordered (nibble_halves=True)",
                        dataclasses.replace(CPU, nibble_halves=True)),) if "4" in name else ()),
                    *(((f"decoded by {'XLA' if CPU.native_decode >= 2 else 'the native kernel'} "
                        f"(native_decode={0 if CPU.native_decode >= 2 else 2})",
                        dataclasses.replace(CPU, native_decode=0 if CPU.native_decode >= 2 else 2)),)
                      if "4" in name else ()),  # int codes: the table's level 1 decodes them in XLA
                    *((("packed (N, K) (weight_only_kn=False)",
                        dataclasses.replace(CPU, weight_only_kn=False)),) if name == "w8" else ())):
                g0 = jax.jit(jqt.quantize(f, qp, policy=policy))
                calls[f"{name}, {label}"] = lambda g=g0, p=jqt.pack(qp, params, policy=policy): g(p, x)
    progress(f"prefill: timing {len(calls)} variants x {rounds} rounds")
    med = timed(calls, rounds)
    base = med["float32"]["median"]
    rows = []
    for name, s in med.items():
        ratio = s["median"] / base
        check = "-" if name not in VARIANTS else f"{'PASS' if ratio <= PREFILL_TARGET else 'MISS'} (<= {PREFILL_TARGET})"
        rows.append((name, f"{s['median'] * 1e3:.0f}", f"{s['p25'] * 1e3:.0f}-{s['p75'] * 1e3:.0f}",
                     f"{ratio:.3f}", check))
        results[f"prefill {name}"] = dict(ms=s["median"] * 1e3, ratio=ratio)
    print(f"Prefill, batch {PREFILL[0]} x {PREFILL[1]} tokens; {rounds} interleaved rounds")
    table(("variant", "median ms", "p25-p75 ms", "time / float32", "target"), rows, markdown)


def bandwidth(rounds, markdown, results):
    """How fast XLA:CPU reads a weight, per formulation: 8 distinct 1024 x 4096 layers
    (128 MiB in float32, more than the last-level cache) against one activation row,
    summed; and a plain float32 sum of 256 MiB (the memory's read rate)."""
    from jax import lax
    rng = np.random.default_rng(0)
    k, n, layers = 1024, 4096, 8
    wf = [jnp.asarray(rng.standard_normal((k, n)), jnp.float32) for _ in range(layers)]
    wq = [jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8) for _ in range(layers)]  # (N, K)
    wkn = [jnp.asarray(w.T) for w in wq]
    x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)
    q = lambda rows: jnp.ones((rows, k), jnp.int8)
    nk = (((1,), (1,)), ((), ()))
    i8 = jax.jit(lambda q, ws: sum(lax.dot_general(q, w, nk, preferred_element_type=jnp.int32) for w in ws))

    def chunked(x, ws):  # the weight-only path: K-chunks of 256 cast in a lax.scan
        def one(w):
            body = lambda acc, xw: (acc + xw[0] @ xw[1].astype(jnp.float32), None)
            xs = (x.reshape(1, k // 256, 256).transpose(1, 0, 2), w.reshape(k // 256, 256, n))
            return lax.scan(body, jnp.zeros((1, n)), xs)[0]
        return sum(one(w) for w in ws)

    big = jnp.ones((64 * 2 ** 20,), jnp.float32)
    rows = {  # name: (call, bytes read)
        "float32 sum of 256 MiB": (lambda f=jax.jit(jnp.sum): f(big), big.nbytes),
        "float32 matmul, 1 row": (lambda f=jax.jit(lambda x, ws: sum(x @ w for w in ws)): f(x, wf), 4 * k * n * layers),
        "int8 x int8 matmul, 2 rows (1 padded)": (lambda: i8(q(2), wq), k * n * layers),
        "int8 x int8 matmul, 1 row": (lambda: i8(q(1), wq), k * n * layers),
        "int8 x int8 matmul, 3 rows (3 digits)": (lambda: i8(q(3), wq), k * n * layers),
        "int8 weight cast in K-chunks, float32 matmul, 1 row": (lambda f=jax.jit(chunked): f(x, wkn), k * n * layers),
    }
    med = timed({name: c for name, (c, _) in rows.items()}, rounds)
    out = []
    for name, (_, nbytes) in rows.items():
        m = med[name]["median"]
        out.append((name, f"{m * 1e3:.2f}", f"{nbytes / m / 1e9:.1f}"))
        results[f"bandwidth {name}"] = dict(ms=m * 1e3, gb_s=nbytes / m / 1e9)
    print(f"Read rates: {layers} layers of {k} x {n} weights against one activation row, summed "
          f"(float32 {4 * k * n * layers / 2 ** 20:.0f} MiB, int8 {k * n * layers / 2 ** 20:.0f} MiB); "
          f"{rounds} interleaved rounds")
    table(("formulation", "median ms", "GB/s of weight read"), out, markdown)


def formulations(names, rounds, markdown, results, batches=FORMULATION_BATCHES):
    params = decoder.init_params(CONFIG, jax.random.key(0))
    step = functools.partial(decoder.decode_step, config=CONFIG)
    progress(f"formulations: prefilling {PROMPT} random tokens x 3")
    calib1 = decode_inputs(params, (1, 2))
    timed1 = decode_inputs(params, (3,))[0]
    names = [n for n in names if n in FORMULATIONS]
    for batch in batches:
        progress(f"formulations: batch {batch}")
        calib = [batched(c, batch) for c in calib1]
        cache, token = batched(timed1, batch)
        calls = {"float32": (lambda f=jax.jit(step): f(params, cache, token))}
        picks = set()
        for name in names:
            qp = jqt.calibrate(step, VARIANTS[name][0](), params, calib, progress=False)
            program = lambda policy, packed: str(jax.make_jaxpr(jqt.quantize(step, qp, policy=policy))(
                packed, cache, token))
            table_program = program(CPU, jqt.pack(qp, params, policy=CPU))
            for form, policy in FORMULATIONS[name].items():
                packed = jqt.pack(qp, params, policy=policy)
                f = jax.jit(jqt.quantize(step, qp, policy=policy))
                calls[f"{name}: {form}"] = lambda f=f, p=packed: f(p, cache, token)
                if program(policy, packed) == table_program:
                    picks.add(f"{name}: {form}")
        med = timed(calls, rounds)
        base = med["float32"]["median"]
        rows = []
        for key, s in med.items():
            name, _, form = key.partition(": ")
            table_pick = "yes" if key in picks else ""
            rows.append((name, form or "-", f"{s['median'] * 1e3:.1f}", f"{s['median'] / base:.3f}", table_pick))
            results[f"formulation b{batch} {key}"] = dict(ms=s["median"] * 1e3, ratio=s["median"] / base)
        print(f"Decode step under each formulation, batch {batch} ({batch} rows per matmul; the CPU "
              f"table's few-row formulations run up to {CPU.gemv_rows} rows); {rounds} interleaved rounds")
        table(("preset", "formulation", "median ms", "time / float32", "CPU table"), rows, markdown)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="decode,prefill,formulations,bandwidth,cache",
                    help="parts (decode, prefill, formulations, bandwidth, cache) and/or variant names, "
                         "comma-separated")
    ap.add_argument("--quick", action="store_true", help="fewer timing rounds")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    ap.add_argument("--batches", type=cli.int_list, default=FORMULATION_BATCHES,
                    help="decode batch sizes of the formulations part, comma-separated "
                         f"(default: {','.join(map(str, FORMULATION_BATCHES))})")
    ap.add_argument("--rounds", type=cli.positive_int, default=None,
                    help="timing rounds of every table (default: by --quick)")
    args = ap.parse_args()
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    all_parts = ("decode", "prefill", "formulations", "bandwidth", "cache")
    by_key = {n.replace(" ", "_"): n for n in [*VARIANTS, *KV_VARIANTS]}  # "w4 g128" or w4_g128
    unknown = [s for s in only if s not in all_parts and s.replace(" ", "_") not in by_key]
    if unknown:
        ap.error(f"unknown parts or variants {unknown}; parts: {list(all_parts)}, variants: {list(by_key)}")
    parts = [p for p in only if p in all_parts] or list(all_parts)
    names = [by_key[s.replace(" ", "_")] for s in only if s not in all_parts] or [*VARIANTS, *KV_VARIANTS]
    results = {}
    print(f"jax {jax.__version__} on {jax.default_backend()} ({os.cpu_count()} cores)\n")
    rounds = lambda quick, full: (quick if args.quick else full) if args.rounds is None else args.rounds
    if "decode" in parts:
        decode(names, rounds(10, 30), args.markdown, results)
    if "prefill" in parts:
        prefill([n for n in names if n in VARIANTS], rounds(3, 5), args.markdown, results)
    if "formulations" in parts:
        formulations([n for n in names if n in VARIANTS], rounds(5, 15), args.markdown, results,
                     args.batches)
    if "bandwidth" in parts:
        bandwidth(rounds(10, 30), args.markdown, results)
    if "cache" in parts:
        import decode_cache
        decode_cache.report(rounds=rounds(3, 8), markdown=args.markdown, results=results)
    print("RESULTS " + json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
