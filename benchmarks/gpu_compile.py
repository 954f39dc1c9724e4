"""Which quantized matmuls XLA compiles and runs on this backend, row count by row count.

    python benchmarks/gpu_compile.py                 # on a GPU: about two minutes
    python benchmarks/gpu_compile.py --smoke         # tiny shapes, any backend: the script runs
    python benchmarks/gpu_compile.py --cases "w4 g128/int,w4 g128/sim" --rows 4,16

A compiler that aborts (XLA:GPU's ``triton_tiling_propagation.cc`` check, seen on an H200
and an H100 compiling grouped formats at 4 and 16 rows: ``benchmarks/results/``) kills
the process, so each case runs in a child process of its own that prints a line per row
count; where a child dies, the row it was compiling is recorded with the last line of
its error output, and a new child goes on from the next row. Children run in parallel.

A case is ``preset/path``:

* ``int``: ``jqt.quantize(f, qp)(jqt.pack(qp, w), x)`` under the backend's kernel table
  (``--policy``: with fields replaced, e.g. ``grouped_float=False``, the GPU table before
  2026-11-27);
* ``sim``: ``jqt.quantize(f, qp, simulate=True)(w, x)``, the path calibration and QAT run;
  ``sim grad``: its gradient with respect to the weight (QAT's backward matmuls);
* ``experts``: an einsum over 4 experts' weights, integer path.

``f`` is ``x @ w`` with ``w`` 4096 x 4096 in bfloat16 (experts: 4 x 1024 x 1024). Each
row prints ``ok`` with the largest difference between the output and the simulated
path's on the host CPU (relative to the latter's largest magnitude), or the failure.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import subprocess
import sys

import cli  # argument types; no jax in this (the parent) process

HERE = os.path.dirname(os.path.abspath(__file__))
PRESETS = {
    "w4 g128": "R.w4(group_size=128)",
    "w4a8 g128": "R.w4a8(group_size=128)",
    "nf4 g64": "R.nf4(group_size=64)",
    "w8 g128": "R.w8(group_size=128)",
    "w4": "R.w4()",
    "w8": "R.w8()",
    "fp8": "R.fp8()",
    "w8a8_dynamic": "R.w8a8_dynamic()",
}
GROUPED = ("w4 g128", "w4a8 g128", "nf4 g64", "w8 g128")
ROWS = (1, 2, 3, 4, 8, 16, 32, 64, 256)


PATHS = ("int", "sim", "sim grad", "experts")  # what a case runs: the integer path, the
# simulated one, its gradient, or a stack of 4 experts on the integer path


def default_cases():
    cases = []
    for p in PRESETS:
        paths = ("int", "sim", "sim grad") if p in GROUPED else ("int", "sim")
        cases += [f"{p}/{path}" for path in paths]
    return cases + ["w4 g128/experts", "nf4 g64/experts"]


def parse_fields(text, types=None):
    """``"a=1,b=False"`` -> ``{"a": 1, "b": False}``, checked against ``jqt.KernelPolicy``'s
    fields and their types (``cli.policy_fields``; ``types``: ``{field: type name}``, default
    from jqt in this process); a bad item exits naming it."""
    try:
        return cli.policy_fields(text, types)
    except ValueError as e:
        raise SystemExit(f"--policy: {e}") from None


def policy_problem(text):
    """What ``jqt.KernelPolicy`` refuses in ``--policy`` (an unknown field, a value of the
    wrong type or out of range: ``native_gemv_rows=-1``), or ``None``; read in a child
    process on the CPU: importing jqt starts JAX's backends, and this process leaves the
    accelerator to the children."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import cli\n"
            "try:\n    cli.policy_fields(sys.argv[2])\n"
            "except ValueError as e:\n    print('PROBLEM', e)")
    p = subprocess.run([sys.executable, "-c", code, HERE, text], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if p.returncode:
        raise SystemExit(f"gpu_compile: could not read jqt.KernelPolicy's fields:\n{p.stderr[-2000:]}")
    said = [l for l in p.stdout.splitlines() if l.startswith("PROBLEM ")]
    return said[-1][len("PROBLEM "):] if said else None


def child(case, rows, n, fields):
    """Run one case at each row count, printing ``ROW r ...`` lines as it goes."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import paths  # noqa: F401  (this checkout's jqt)
    import jqt

    R = jqt.recipes  # noqa: F841  (PRESETS' expressions)
    preset, path = case.split("/")
    recipe = eval(PRESETS[preset])
    rng = np.random.default_rng(0)
    cpu = jax.devices("cpu")[0]
    if path == "experts":
        e, n = 4, n // 4
        w = {"w": jnp.asarray(rng.standard_normal((e, n, n)) / np.sqrt(n), jnp.bfloat16)}
        f = lambda p, x: jnp.einsum("ecd,edf->ecf", x, p["w"])
        shape = lambda r: (e, r, n)
    else:
        w = {"w": jnp.asarray(rng.standard_normal((n, n)) / np.sqrt(n), jnp.bfloat16)}
        f = lambda p, x: x @ p["w"]
        shape = lambda r: (r, n)
    xs = {r: jnp.asarray(rng.standard_normal(shape(r)), jnp.bfloat16) for r in rows}
    qp = jqt.calibrate(f, recipe, w, [(xs[max(rows)],)], progress=False)
    policy = jqt.KernelPolicy.for_backend()
    if fields:
        policy = dataclasses.replace(policy, **fields)
    sim = jax.jit(jqt.quantize(f, qp, simulate=True))
    if path in ("int", "experts"):
        run = jax.jit(jqt.quantize(f, qp, policy=policy))
        args = jqt.pack(qp, w, policy=policy)
    elif path == "sim":
        run, args = sim, w
    elif path == "sim grad":
        run = jax.jit(jax.grad(lambda p, x: jnp.sum(sim(p, x).astype(jnp.float32) ** 2)))
        args = w
    else:
        raise SystemExit(f"unknown path {path!r} in case {case!r}")
    for r in rows:
        print(f"START {r}", flush=True)
        out = jax.tree.leaves(run(args, xs[r]))[0]
        out = np.asarray(jax.block_until_ready(out), np.float32)
        on_cpu = lambda t: jax.device_put(t, cpu)
        ref_fn = jax.grad(lambda p, x: jnp.sum(sim(p, x).astype(jnp.float32) ** 2)) \
            if path == "sim grad" else sim
        ref = np.asarray(jax.tree.leaves(ref_fn(on_cpu(w), on_cpu(xs[r])))[0], np.float32)
        err = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
        print(f"ROW {r} ok {err:.2e}", flush=True)


def run_case(case, rows, n, timeout, policy):
    """Children until every row of ``case`` has a result: ``{row: text}``."""
    results, todo = {}, list(rows)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    while todo:
        cmd = [sys.executable, __file__, "--child", case, "--rows", ",".join(map(str, todo)),
               "--n", str(n), "--policy", policy]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            out, err, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out, err, rc = (e.stdout or b"").decode(), "timed out", "timeout"
        started = None
        for line in out.splitlines():
            if line.startswith("START "):
                started = int(line.split()[1])
            elif line.startswith("ROW "):
                _, r, *rest = line.split()
                results[int(r)] = " ".join(rest)
                started = None
        if rc == 0:
            break
        last = [l for l in err.strip().splitlines() if l.strip()]
        why = next((l for l in reversed(last) if "Check failed" in l or "Error" in l),
                   last[-1] if last else f"exit {rc}")
        left = [r for r in todo if r not in results]
        if started is None and not left:
            break  # every row reported: the exit code came after them (a crash at teardown)
        bad = started if started is not None else left[0]
        results[bad] = f"FAILED (rc {rc}): {why.strip()[:300]}"
        todo = [r for r in todo if r not in results]
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--child", help=argparse.SUPPRESS)  # internal: the case a child process runs
    ap.add_argument("--cases", help="comma-separated preset/path (default: all)")
    ap.add_argument("--rows", type=cli.int_list, help="comma-separated row counts")
    ap.add_argument("--n", type=cli.positive_int, default=4096,
                    help="the layer's size, n x n (default 4096; experts: 4 of n/4 x n/4)")
    ap.add_argument("--smoke", action="store_true", help="n = 256, rows 1 and 4")
    ap.add_argument("--jobs", type=cli.positive_int, default=8,
                    help="child processes run at a time (default 8)")
    ap.add_argument("--policy", default="", help="KernelPolicy fields replacing the backend's, "
                    "e.g. grouped_float=False,gemv_rows=0 (int fields: integers; bool fields: "
                    "1, 0, true or false)")
    ap.add_argument("--timeout", type=cli.positive_int, default=240, help="seconds a child may run")
    a = ap.parse_args()
    rows = a.rows or ROWS
    if a.smoke:
        a.n, rows = 256, (1, 4)
    if a.child:
        return child(a.child, rows, a.n, parse_fields(a.policy))
    if a.policy.strip():  # a bad --policy fails here, not in every child
        why = policy_problem(a.policy)
        if why:
            ap.error(f"--policy: {why}")
    cases = a.cases.split(",") if a.cases else default_cases()
    for c in cases:  # (and a bad case here, not in a child per row)
        preset, _, path = c.partition("/")
        if preset not in PRESETS or path not in PATHS:
            ap.error(f"--cases: {c!r} is not PRESET/PATH, with PRESET one of {list(PRESETS)} and "
                     f"PATH one of {list(PATHS)}")
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        futs = {c: pool.submit(run_case, c, rows, a.n, a.timeout, a.policy) for c in cases}
        failed = 0
        for c in cases:
            res = futs[c].result()
            for r in rows:
                text = res.get(r, "not run")
                failed += not text.startswith("ok")
                print(f"{c:24s} rows {r:5d}: {text}", flush=True)
    print(f"{failed} of {len(cases) * len(rows)} failed")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
