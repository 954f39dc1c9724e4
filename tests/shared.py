"""Helpers shared by the tests: walking jaxprs, a residual MLP scanned over stacked layers,
the split of a parameter grid between the default run and the slow one."""
import os
import sys

import jax
import pytest
from jax import lax

# One jaxpr walker for the examples and the tests: examples/jaxpr_utils.py.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from jaxpr_utils import all_eqns  # noqa: E402,F401

L = 3  # layers of scan_mlp



def scan_mlp(p, x):
    h = x @ p["inp"]

    def body(h, lp):
        return jax.nn.relu(h @ lp["w"] + lp["b"]) + h, None

    h, _ = lax.scan(body, h, p["layers"])
    return h @ p["out"]


def unrolled_mlp(p, x):
    """``scan_mlp`` with the loop unrolled (per-layer keys)."""
    h = x @ p["inp"]
    for i in range(L):
        h = jax.nn.relu(h @ p["layers"]["w"][i] + p["layers"]["b"][i]) + h
    return h @ p["out"]


def ci_only(values, keep):
    """``values`` as pytest parameters: those in ``keep`` run in the default run, the others
    with the slow tests (CI runs both; the default run stays under 5 minutes on 2 cores).

    >>> [isinstance(p, str) for p in ci_only(["a", "b"], {"a"})]  # "b": a slow pytest.param
    [True, False]
    """
    return [v if v in keep else pytest.param(v, marks=pytest.mark.slow) for v in values]
