"""Test configuration: CPU only, the `slow` marker, and a faster XLA:CPU back end.

The suite compiles a few thousand small XLA programs, and on a 2-core CPU most of its time
is XLA:CPU generating their machine code. Unless XLA_FLAGS already sets them, the tests run
with ``--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false``: XLA's HLO
passes (fusion, algebraic simplification, layout) still run, so the programs are the ones
users get; only their code generation is cheaper (LLVM does not optimize, and each fusion
is emitted by XLA's elemental emitter rather than its MLIR fusion emitters), which makes
compilation 2 to 5 times faster. To test with XLA's defaults:
``XLA_FLAGS="--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true" .venv/bin/python -m pytest``.

The pytest process and its xdist workers share one persistent compilation cache, in a
temporary directory removed when the run ends: a program one worker compiled is not
compiled again by the other (``JQT_TEST_XLA_CACHE`` names another directory, kept).

``slow``: end-to-end tests (the examples and the numbers the docs quote, docs pages that
train a model), and the longer regression cases of one narrow input, each marked with a
comment saying so (the feature it regresses has tests in the default run). The default run (pyproject.toml's addopts) leaves them out; CI runs them
with ``.venv/bin/python -m pytest -m slow``. ``slow_variants`` on a parametrized test: its
first parameter set runs by default, the others are ``slow`` (to keep the default run near
its budget of 5 minutes on a 2-core machine, where CI's has taken up to 1.5 times as
long as another's).
"""
import os

for _flag in ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

if "JQT_TEST_XLA_CACHE" not in os.environ:  # the pytest process; its xdist workers inherit it
    import atexit
    import shutil
    import tempfile

    os.environ["JQT_TEST_XLA_CACHE"] = tempfile.mkdtemp(prefix="jqt-test-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JQT_TEST_XLA_CACHE"], ignore_errors=True)

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_compilation_cache_dir", os.environ["JQT_TEST_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end; not in the default run, CI runs it (-m slow)")
    config.addinivalue_line("markers", "slow_variants: the test's first parameter set runs by default, "
                                       "the others with the slow tests")


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    """``slow_variants``: every parameter set of a test after the first one collected is
    ``slow`` (a grid of formats or shapes: the default run checks one, CI all)."""
    seen = set()
    for item in items:
        if item.get_closest_marker("slow_variants") is None:
            continue
        fn = (str(item.path), item.originalname)
        if fn in seen:
            item.add_marker(pytest.mark.slow)
        seen.add(fn)
