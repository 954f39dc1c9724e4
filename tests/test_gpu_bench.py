"""benchmarks/gpu.py, the script behind benchmarks/results/gpu-h100.md and gpu-h200.md, runs: its
smoke sizes under the GPU kernel table, on this machine's CPU (slow: CI runs it). A GPU is
needed for its numbers, not for its code paths."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_benchmark_runs_under_the_gpu_table():
    """Every part in a process of its own (--isolate), the results merged."""
    variants = "w8,w8 [weight_only_digits=0],fp8,w4 g128,w4a8 g128"
    loop = "w8a8_dynamic + int8 KV,fp8 + fp8 KV,w4 g128 [reduce_rows=0]"
    r = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--policy", "gpu", "--isolate",
                        "--only", "dense,decode,generate", "--variants", f"{variants},{loop}"], cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(l for l in r.stdout.splitlines() if l.startswith("RESULTS "))
    res = json.loads(line[len("RESULTS "):])
    assert res["failed"] == []
    for v in ("bfloat16", "float32") + tuple(variants.split(",")):
        assert res[f"decode {v}"]["ms_per_token"] > 0
        assert res[f"dense256 {v} m1"]["ratio_bf16"] > 0
    # the integer kernels against their float simulation, one float32 layer under the GPU table
    assert res["dense256 fp8"]["int_vs_sim"] < 1e-5 and res["dense256 w4a8 g128"]["int_vs_sim"] < 1e-5
    # packed bytes against bfloat16: int8 about half, int4 about a quarter (plus scales)
    assert 0.5 < res["dense256 w8"]["bytes_ratio"] < 0.52 < res["dense256 w4a8 g128"]["bytes_ratio"] * 2
    assert res["decode w8"]["bytes_ratio"] < 0.55 and res["decode w4 g128"]["bytes_ratio"] < 0.3
    # the generate loop (scans over steps and layers) carries its cache quantized where asked
    for v, dtype in (("w8", "bfloat16"), ("w8a8_dynamic + int8 KV", "int8"), ("fp8 + fp8 KV", "float8_e4m3fn")):
        g = res[f"generate {v}"]
        assert g["tokens_s"] > 0 and dtype in g["cache_dtypes"]
        assert g["cache_ratio"] == 1.0 if dtype == "bfloat16" else g["cache_ratio"] < 0.55
    assert res["generate w4 g128 [reduce_rows=0]"]["bytes_ratio"] < 0.3  # a policy A/B row


@pytest.mark.slow
def test_gpu_benchmark_isolate_names_a_process_that_died(monkeypatch, capsys):
    """--isolate: a part's process that dies without results is named in ``failed`` with the
    last line of its error, and the others' results kept. (A bad --variants name made a
    process die here before; the parent refuses it now, before starting any.)"""
    r = subprocess.run([sys.executable, "benchmarks/gpu.py", "--smoke", "--isolate", "--only", "decode",
                        "--variants", "no such variant"], cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 1 and r.stderr.strip() == "--variants: no variant named no such variant" \
        and "--isolate:" not in r.stderr  # (refused in the parent: no process started)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import argparse
    import gpu

    def fake_run(cmd, **kw):
        part = cmd[cmd.index("--only") + 1]
        if part == "decode":
            return subprocess.CompletedProcess(cmd, 1, "", "Traceback ...\nValueError: boom\n")
        return subprocess.CompletedProcess(cmd, 0, 'RESULTS {"dense x": 1, "failed": []}\n', "")
    monkeypatch.setattr(gpu.subprocess, "run", fake_run)
    monkeypatch.setattr(sys, "argv", ["gpu.py", "--isolate", "--only", "dense,decode", "--rows", "1"])
    a = argparse.Namespace(only=["dense", "decode"], rows=[1], smoke=True, out=None)
    with pytest.raises(SystemExit, match=r"failed: decode \(exit 1: ValueError: boom\)"):
        gpu.isolated(a)
    out = capsys.readouterr().out
    assert '"dense x": 1' in out and '"failed": ["decode (exit 1: ValueError: boom)"]' in out


@pytest.mark.slow
def test_gpu_compile_check_runs_and_records_a_child_that_died():
    """benchmarks/gpu_compile.py (the compile check behind gpu-h100.md's 2026-11-27 lease): each
    case in a child process, a row per line, checked against the simulated path. (A child that
    dies is recorded with its error: tests/test_bench_tools.py, on made-up children; an unknown
    preset, which made one die here before, is refused before any starts.)"""
    bad = subprocess.run([sys.executable, "benchmarks/gpu_compile.py", "--smoke", "--cases",
                          "nosuch/int"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--cases: 'nosuch/int' is not PRESET/PATH" in bad.stderr
    cases = "w4a8 g128/int,w4 g128/sim grad,nf4 g64/experts"
    r = subprocess.run([sys.executable, "benchmarks/gpu_compile.py", "--smoke", "--jobs", "2",
                        "--cases", cases, "--policy", "grouped_float=True"], cwd=ROOT,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                       timeout=600)
    lines = [l for l in r.stdout.splitlines() if " rows " in l]
    assert r.returncode == 0 and "0 of 6 failed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    assert len(lines) == 6
    for line in lines:  # the integer path and the gradient agree with the simulated path
        ok = line.split(": ", 1)[1]
        assert ok.startswith("ok ") and float(ok.split()[1]) < 1e-2, line
