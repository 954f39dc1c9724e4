"""Which formulation of a weight-only matmul XLA:GPU compiles best: plain JAX, no jqt.

    python benchmarks/gpu_formulations.py                  # on a GPU: about 3 minutes
    python benchmarks/gpu_formulations.py --smoke          # tiny shapes, any backend
    python benchmarks/gpu_formulations.py --only "w8 bf16,w4 g128 int4 kn" --rows 2,16

A probe for ``jqt.KernelPolicy``'s GPU column. One 4096 x 4096 layer with a bfloat16
activation, its weight stored as int8 codes, as int4 codes (``jnp.int4``, which XLA packs
two to a byte and which its Triton GEMM emitter reads packed), or as jqt's bytes of two
nibbles, decoded by the formulations below, each written as JAX ops that XLA may fuse into
its GEMM (a ``convert`` of the weight operand) or not (a decode written to memory first):

* ``w8 f32``: per-channel int8 codes cast to float32, a float32 matmul (TF32), the scale on
  the output: the GPU table for weight-only ``w8`` above 4 rows until 2026-11-27.
* ``w8 bf16``: the codes cast to bfloat16 (exact), a bfloat16 matmul with float32 sums.
* ``w4 int4``: per-channel ``jnp.int4`` codes cast to bfloat16, the same matmul.
* ``w4 g128 int4 kn`` / ``nk``: ``jnp.int4`` codes times their group scales in
  bfloat16 (a reshape to groups and back), one matmul.
* ``w4 g128 int4 batched``: one matmul per group batched over the groups (the codes cast
  to bfloat16, exact), float32 partial sums scaled per group and summed.
* ``w4 g128 nibbles f32`` / ``bf16``: jqt's packed bytes ``(N, K / 2)``, both nibbles
  decoded by one shift (``dense.interleaved_nibbles``' formulation), times the group
  scales, in float32 (the GPU table until 2026-11-27) or rounded to bfloat16.

Every formulation runs in a process of its own (an XLA compiler abort loses that one),
interleaved with the bfloat16 layer in the same rounds: ``L`` chained layers a call, each
with weights of its own (:func:`distinct`), each output RMS-normalised into the next
input; ``PIPELINE`` calls per sample, medians. Each
child also checks its layer against the float32 product of the same decoded weight and
names the kernels XLA chose (Triton GEMM fusions, cuBLAS calls) and its fusions.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time

import cli  # argument types; no jax in this (the parent) process

N, G, L, PIPELINE = 4096, 128, 8, 4
ROWS = (1, 2, 4, 16, 64, 256, 2048)


def _weights(n, g):
    import jax.numpy as jnp
    import numpy as np
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, n)).astype(np.float32) / np.sqrt(n)  # (K, N)
    s8 = np.abs(w).max(0) / 127
    q8 = np.clip(np.round(w / s8), -127, 127).astype(np.int8)
    s4 = np.abs(w).max(0) / 7
    q4 = np.clip(np.round(w / s4), -8, 7).astype(np.int8)
    wg = w.reshape(n // g, g, n)
    sg = np.abs(wg).max(1) / 7  # (G, N)
    qg = np.clip(np.round(wg / sg[:, None]), -8, 7).reshape(n, n).astype(np.int8)  # (K, N)
    nk = qg.T  # (N, K)
    nib = ((nk[:, 0::2] & 0xF) | ((nk[:, 1::2] & 0xF) << 4)).astype(np.uint8)  # (N, K / 2)
    return dict(w=w, q8=jnp.asarray(q8), s8=jnp.asarray(s8), q4=jnp.asarray(q4, jnp.int4),
                s4=jnp.asarray(s4), qg=jnp.asarray(qg, jnp.int4), qg_nk=jnp.asarray(nk, jnp.int4),
                sg=jnp.asarray(sg, jnp.bfloat16), sg_nk=jnp.asarray(sg.T, jnp.bfloat16),
                sg32=jnp.asarray(sg.T), nib=jnp.asarray(nib),
                dq8=q8 * s8, dq4=q4 * s4, dqg=(qg.reshape(n // g, g, n) * sg[:, None]).reshape(n, n))


def formulations(n, g):
    """name -> (layer(p, x) -> float32 (M, N), params, the float32 weight it should equal)."""
    import jax.numpy as jnp
    from jax import lax
    BF, F = jnp.bfloat16, jnp.float32
    k = _weights(n, g)
    dot = lambda a, b, dims=((1,), (0,)): lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=F)

    def nibbles(c):  # (N, K / 2) bytes -> (N, K) int8, K in its own order
        b = jnp.expand_dims(c.astype(jnp.int8), 2)
        v = jnp.left_shift(b, jnp.asarray([4, 0], jnp.int8)) >> 4
        return v.reshape(c.shape[0], 2 * c.shape[1])

    def grouped_nk(v, s, dt):  # (N, K) codes, (N, G) scales
        nn, kk = v.shape
        return (v.astype(F).reshape(nn, kk // g, g) * s.astype(F)[:, :, None]).reshape(nn, kk).astype(dt)

    def batched(p, x):
        m = x.shape[0]
        xs = x.reshape(m, n // g, g).transpose(1, 0, 2)  # (G, M, g)
        part = lax.dot_general(xs, p["qg"].reshape(n // g, g, n).astype(BF), (((2,), (1,)), ((0,), (0,))),
                               preferred_element_type=F)  # (G, M, N)
        return jnp.sum(part * p["sg"].astype(F)[:, None, :], axis=0)

    nk = ((1,), (1,))
    return {
        "bf16": (lambda p, x: dot(x, p["w"]), dict(w=jnp.asarray(k["w"], BF)), k["w"]),
        "w8 f32": (lambda p, x: dot(x.astype(F), p["q8"].astype(F)) * p["s8"],
                   dict(q8=k["q8"], s8=k["s8"]), k["dq8"]),
        "w8 bf16": (lambda p, x: dot(x, p["q8"].astype(BF)) * p["s8"], dict(q8=k["q8"], s8=k["s8"]), k["dq8"]),
        "w8 bf16 nk": (lambda p, x: dot(x, p["q8"].astype(BF), nk) * p["s8"],
                           dict(q8=k["q8"].T, s8=k["s8"]), k["dq8"]),
        "w4 int4": (lambda p, x: dot(x, p["q4"].astype(BF)) * p["s4"], dict(q4=k["q4"], s4=k["s4"]), k["dq4"]),
        "w4 g128 int4 kn": (
            lambda p, x: dot(x, (p["qg"].astype(BF).reshape(n // g, g, n) * p["sg"][:, None]).reshape(n, n)),
            dict(qg=k["qg"], sg=k["sg"]), k["dqg"]),
        "w4 g128 int4 nk": (lambda p, x: dot(x, grouped_nk(p["qg"], p["sg"], BF), nk),
                                dict(qg=k["qg_nk"], sg=k["sg_nk"]), k["dqg"]),
        "w4 g128 int4 batched": (batched, dict(qg=k["qg"], sg=k["sg"]), k["dqg"]),
        "w4 g128 nibbles f32": (lambda p, x: dot(x.astype(F), grouped_nk(nibbles(p["nib"]), p["sg"], F), nk),
                                dict(nib=k["nib"], sg=k["sg32"]), k["dqg"]),
        "w4 g128 nibbles bf16": (lambda p, x: dot(x, grouped_nk(nibbles(p["nib"]), p["sg"], BF), nk),
                                 dict(nib=k["nib"], sg=k["sg32"]), k["dqg"]),
    }


def _kernels(hlo):
    found = re.findall(r'custom_call_target="([^"]+)"', hlo)
    found += re.findall(r'"kind":"(__triton[a-z_]*)"', hlo)
    found += ["fusion " + k for k in re.findall(r"fusion\(.*?kind=(k[A-Za-z]+)", hlo)]
    found = [f for f in found if "cublas" in f or "triton" in f or "gemm" in f or f.startswith("fusion")]
    return ", ".join(f"{k} x{found.count(k)}" for k in sorted(set(found)))


def distinct(p, i):
    """Layer ``i``'s weights: each of ``p``'s arrays rolled by ``7 i`` along its last axis
    (the codes, scales and nibble bytes alike: the values differ from layer to layer; only
    layer 0's, unrolled, are checked). With one weight for all layers of the chain, XLA
    would decode it once for the whole chain and it would stay in the L2 cache."""
    import jax.numpy as jnp
    return {k: jnp.roll(a, 7 * i, axis=a.ndim - 1) for k, a in p.items()}


def child(name, rows, rounds, n, g):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    import paths  # noqa: F401
    import timing
    forms = formulations(n, g)
    out = {"name": name, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": {}}
    chains = {}
    for v in ("bf16", name):
        layer, p, ref = forms[v]

        def chain(ps, x, layer=layer):
            for p in ps:
                y = layer(p, x)
                x = (y * lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(x.dtype)
            return x
        chains[v] = (jax.jit(chain), [distinct(p, i) for i in range(L)])
    layer, p, ref = forms[name]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, n)), jnp.bfloat16)
    got = np.asarray(jax.jit(layer)(p, x), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(ref, np.float64)
    out["rel_err"] = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    for m in rows:
        x = jnp.asarray(np.random.default_rng(m).standard_normal((m, n)), jnp.bfloat16)

        def pipelined(fn, p):
            for _ in range(PIPELINE - 1):
                fn(p, x)
            return fn(p, x)
        calls = {v: functools.partial(pipelined, fn, p) for v, (fn, p) in chains.items()}
        timing.choose_rounds(list(calls.values()), 0.0, 1, 1, warmup=3)
        med = {v: timing.summary(s)["median"] for v, s in timing.interleaved(calls, rounds).items()}
        row = dict(us=med[name] / (PIPELINE * L) * 1e6, bf16_us=med["bf16"] / (PIPELINE * L) * 1e6,
                   ratio=med[name] / med["bf16"])
        if m in (rows[0], rows[-1]):
            row["kernels"] = _kernels(jax.jit(layer).lower(chains[name][1][0], x).compile().as_text())
        out["rows"][m] = row
        print(f"[{name}] {m} rows: {row['us']:.1f} us / layer, {row['ratio']:.2f}x bf16", file=sys.stderr,
              flush=True)
    print("RESULT " + json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated formulation names (default: all)")
    ap.add_argument("--rows", type=cli.int_list, default=ROWS,
                    help=f"row counts, comma-separated (default: {','.join(map(str, ROWS))})")
    ap.add_argument("--rounds", type=cli.positive_int, default=10, help="interleaved timing rounds (default 10)")
    ap.add_argument("--timeout", type=cli.positive_int, default=150, help="seconds per formulation's process")
    ap.add_argument("--smoke", action="store_true", help="a 256 layer, groups of 32, 2 rounds")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    n, g = (256, 32) if a.smoke else (N, G)
    rounds = 2 if a.smoke else a.rounds
    rows = a.rows
    if a.child:
        return child(a.child, rows, rounds, n, g)
    names = [v for v in formulations(n, g) if v != "bf16"]  # builds the weights once on the host
    if a.only:
        unknown = set(a.only.split(",")) - set(names)
        if unknown:
            raise SystemExit(f"--only: no formulation named {', '.join(sorted(unknown))}; "
                             f"there are: {', '.join(names)}")
        names = a.only.split(",")
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    results, failed = [], []
    for v in names:
        cmd = [sys.executable, __file__, "--child", v, "--rows", ",".join(map(str, rows)), "--rounds", str(rounds)]
        cmd += ["--smoke"] if a.smoke else []
        t = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout,
                               cwd=os.path.dirname(os.path.abspath(__file__)))
        except subprocess.TimeoutExpired:
            failed.append(f"{v}: over {a.timeout} s")
            continue
        got = [json.loads(l[7:]) for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        sys.stderr.write(p.stderr[-3000:] if not got else "")
        print(f"{v}: {time.perf_counter() - t:.0f} s" + ("" if got else f", FAILED (exit {p.returncode})"),
              file=sys.stderr, flush=True)
        if got:
            results.append(got[0])
        else:
            errs = [l for l in p.stderr.splitlines() if "Error" in l or "Check failed" in l] or ["?"]
            failed.append(f"{v}: exit {p.returncode}: {errs[-1][:300]}")
    if results:
        print(f"{results[0]['device']}, jax {results[0]['jax']}; {n} x {n} layer, bfloat16 activation, "
              f"{L} chained layers a call, {rounds} interleaved rounds: us per layer (ratio to bfloat16 "
              "in the same process)\n")
        print("| formulation | rel. error | " + " | ".join(f"{m} rows" for m in rows) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in rows) + " |")
        print("| bf16 (median over the processes) | - | " + " | ".join(
            f"{statistics.median(r['rows'][str(m)]['bf16_us'] for r in results):.1f}"
            for m in rows) + " |")
        for r in results:
            print(f"| {r['name']} | {r['rel_err']:.1e} | " + " | ".join(
                f"{r['rows'][str(m)]['us']:.1f} ({r['rows'][str(m)]['ratio']:.2f}x)" for m in rows) + " |")
        print("\nkernels and fusions XLA compiled one layer into:\n")
        for r in results:
            for m in (rows[0], rows[-1]):
                print(f"- {r['name']}, {m} rows: {r['rows'][str(m)].get('kernels', '')}")
    for f in failed:
        print(f"FAILED {f}")
    print("RESULTS " + json.dumps(dict(results=results, failed=failed)))


if __name__ == "__main__":
    main()
