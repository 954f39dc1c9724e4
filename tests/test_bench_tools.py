"""The benchmarks' shared helpers (benchmarks/timing.py, cli.py, formats.py, decode_cache.py):
the statistics they print and the checks they make, on made-up timings (no model runs)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import cli  # noqa: E402
import timing  # noqa: E402


def test_quartiles_stay_within_the_samples_however_few():
    """Two rounds: the default ('exclusive') quantiles extrapolated beyond both samples."""
    s = timing.summary([9.87, 38.79])
    assert 9.87 <= s["p25"] <= s["median"] <= s["p75"] <= 38.79
    s = timing.summary([3.0, 1.0, 2.0])
    assert (s["p25"], s["median"], s["p75"], s["n"]) == (1.5, 2.0, 2.5, 3)


def test_calibration_step_returns_the_repetitions_ratios(monkeypatch):
    """The printed ratio is the median of the repetitions' own ratios, listed beside it
    (it is not the ratio of the two times' medians, which are printed too)."""
    fwd = [0.010, 0.010, 0.010, 0.020, 0.020, 0.010, 0.010]  # fwd0, then before/after
    cal = [1.0, 3.0, 1.0, 4.0, 1.0, 2.0]  # t1, t2 per repetition
    monkeypatch.setattr(timing, "median_time", lambda call, n=30: fwd.pop(0) if fwd else 0.01)
    monkeypatch.setattr(timing, "_once", lambda call: cal.pop(0) if cal else 0.0)
    monkeypatch.setattr(timing.jqt, "calibrate", lambda *a, **k: None)
    r = timing.calibration_step(None, None, None, [0], None, work_s=0.0, n1=2, reps=3)
    n = r["n2"] - r["n1"]
    per = [2.0 / n, 3.0 / n, 1.0 / n]
    assert r["ratios"] == pytest.approx([per[0] / 0.01, per[1] / 0.02, per[2] / 0.01])
    assert r["ratio"] == pytest.approx(sorted(r["ratios"])[1])
    assert r["ratio"] != pytest.approx(r["per_batch"] / r["fwd"])


def test_policy_fields_refuses_a_value_the_policy_refuses():
    assert cli.policy_fields("native_gemv_rows=2") == {"native_gemv_rows": 2}
    with pytest.raises(ValueError, match="native_gemv_rows=-1"):
        cli.policy_fields("native_gemv_rows=-1")


def test_formats_refuses_ab_where_no_part_reads_it():
    r = subprocess.run([sys.executable, "benchmarks/formats.py", "--only", "experts,ragged",
                        "--ab", "native_gemv_rows=0"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "--ab: only the minilm, dense, wide parts" in r.stderr


def test_decode_cache_report_says_na_where_a_step_is_noise(monkeypatch, capsys):
    import decode_cache
    rows = [("float32, float cache", 1e-3, 1.0, 1000, 1.0, 1.0, ""),
            ("w8a8_dynamic, float cache", -2e-4, -0.2, 1000, 1.0, 0.25, ""),
            ("w8a8_dynamic + int8 KV", 1e-4, 0.1, 260, 0.26, 0.25, "")]
    monkeypatch.setattr(decode_cache, "cache_speed", lambda context, rounds: (rows, 10 ** 6))
    decode_cache.report(context=32, rounds=3)
    out = capsys.readouterr().out
    assert "PASS" not in out and "MISS" not in out and out.count("N/A (a loop difference") == 3
    rows[1] = ("w8a8_dynamic, float cache", 3e-4, 0.3, 1000, 1.0, 0.25, "")
    decode_cache.report(context=32, rounds=3)
    out = capsys.readouterr().out
    assert "N/A" not in out and out.count("PASS") == 3


def test_gpu_compile_keeps_the_rows_of_a_child_that_fails_after_them(monkeypatch):
    """A child that reports every row and then exits non-zero (an abort at XLA's teardown)
    made run_case index past its list of rows (IndexError: the whole check died)."""
    import gpu_compile

    def fake_run(cmd, **kw):
        rows = cmd[cmd.index("--rows") + 1].split(",")
        out = "".join(f"START {r}\nROW {r} ok 1.0e-07\n" for r in rows)
        return subprocess.CompletedProcess(cmd, -6, out, "Check failed: at exit\n")

    monkeypatch.setattr(gpu_compile.subprocess, "run", fake_run)
    assert gpu_compile.run_case("w4 g128/int", (1, 4), 256, 60, "") == {1: "ok 1.0e-07", 4: "ok 1.0e-07"}

    def dies_first(cmd, **kw):  # before its first row: that row is the one that failed
        return subprocess.CompletedProcess(cmd, 1, "", "ValueError: boom\n")

    monkeypatch.setattr(gpu_compile.subprocess, "run", dies_first)
    assert gpu_compile.run_case("w4 g128/int", (1, 4), 256, 60, "") == {
        1: "FAILED (rc 1): ValueError: boom", 4: "FAILED (rc 1): ValueError: boom"}


@pytest.mark.slow  # seven processes that import jax and jqt (CI runs it)
def test_bad_flags_of_the_gpu_scripts_and_the_cpu_runner_are_refused_before_any_run():
    """A one-shot device lease lost its valid variants to one bad policy value (gpu.py), or
    started a child per row that failed on a bad --policy value or --cases name
    (gpu_compile.py); run.py ran nothing and exited 0 for a blank --only (hunt70_benchscripts)."""
    cmds = [(["benchmarks/gpu.py", "--smoke", "--only", "dense", "--variants",
              "w8,w8 [weight_only_digits=2]"], "--variants 'w8 \\[weight_only_digits=2\\]': "
             "KernelPolicy\\(weight_only_digits=2\\)"),
            (["benchmarks/gpu.py", "--smoke", "--only", "dense", "--variants", "w8 [gemv_rows=x]"],
             "gemv_rows='x' is no Python literal"),
            (["benchmarks/gpu.py", "--smoke", "--policy", "gpuu"], "--policy: .*for_backend\\('gpuu'\\)"),
            (["benchmarks/gpu.py", "--isolate", "--smoke", "--only", "dense", "--variants",
              "w8 [gemv_rows=x]"], "^usage:(.|\n)*gemv_rows='x' is no Python literal"),  # (once,
            # in the parent: its processes each refused it)
            (["benchmarks/gpu_compile.py", "--smoke", "--cases", "w8/int", "--policy",
              "native_gemv_rows=-1"], "--policy: KernelPolicy\\(native_gemv_rows=-1\\)"),
            (["benchmarks/gpu_compile.py", "--smoke", "--cases", "w8/it"], "--cases: 'w8/it' is not "
             "PRESET/PATH"),
            (["benchmarks/run.py", "--only", " "], "--only: name at least one of"),
            (["benchmarks/calibrators.py", "--only", "nope"], "--only: unknown 'nope'")]
    for cmd, want in cmds:
        r = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2 and re.search(want, r.stderr), (cmd, r.stderr[-500:])


def test_decode_streamed_donates_the_cache_it_was_handed_and_holds_the_position():
    """``decode.py``'s ``streamed``: every call donates the cache the last one returned and
    runs at the first call's position (a first version handed back the one ``pos`` array
    each call, deleted by the call before's donation)."""
    import jax
    import jax.numpy as jnp
    import decode

    def step(params, cache, token):
        k = jax.lax.dynamic_update_slice(cache["k"], params + token[:, None] * 0 + cache["pos"], (0, cache["pos"]))
        return k.sum(), {"k": k, "pos": cache["pos"] + 1}

    f = jax.jit(step, donate_argnums=1)
    cache = {"k": jnp.zeros((1, 8)), "pos": jnp.asarray(3)}
    call = decode.streamed(f, jnp.ones((1, 1)), cache, jnp.zeros((1,), jnp.int32))
    for _ in range(4):
        assert float(call()) == 4.0   # written at position 3 each time: 1 + 3
    assert float(cache["k"].sum()) == 0.0 and int(cache["pos"]) == 3  # the caller's cache kept
