"""Test configuration: CPU only, the `slow` marker, and a faster XLA:CPU back end.

The suite compiles a few thousand small XLA programs, and on a 2-core CPU most of its time
is LLVM optimizing their machine code. Unless XLA_FLAGS already sets it, the tests run
with ``--xla_backend_optimization_level=0``: XLA's HLO passes (fusion, algebraic
simplification, layout) still run, so the programs are the ones users get; only LLVM's
code generation is not optimized, which makes compilation 2 to 5 times faster. To test at
XLA's default level: ``XLA_FLAGS=--xla_backend_optimization_level=2 .venv/bin/python -m pytest``.

``slow``: end-to-end tests (the examples and the numbers the docs quote, docs pages that
train a model). The default run (pyproject.toml's addopts) leaves them out; CI runs them
with ``.venv/bin/python -m pytest -m slow``.
"""
import os

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: end-to-end; not in the default run, CI runs it (-m slow)")
