"""Helpers shared by the tests: walking jaxprs, a residual MLP scanned over stacked layers,
the split of a parameter grid between the default run and the slow one, a subprocess on
several host CPU devices."""
import json
import os
import subprocess
import sys
import tempfile
import textwrap

import jax
import jax.numpy as jnp
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


def explicit_decoder(explicit, batch=2):
    """A decode loop over tokens (B, T) whose steps scan two stacked layers with a
    key/value cache; on explicit mesh axes it states the sharding JAX asks for: the
    lookup's (``.at[ids].get(out_sharding=)``, which JAX runs in an ``auto_axes``
    region) and its output projection's, split along the contracted features. Returns
    ``(f, params, tokens)``. Used by test_composition.py and test_sharding.py."""
    from jax.sharding import PartitionSpec as P
    n_l, n_h, d_h, t = 2, 2, 8, 6

    def f(p, tokens):
        b = tokens.shape[0]

        def step(carry, tok):
            (kc0, vc0), pos = carry
            h = p["emb"].at[tok].get(out_sharding=P("data", None)) if explicit else p["emb"][tok]

            def layer(h, xs):
                lp, kc, vc = xs
                q, k, v = [(h @ lp[w]).reshape(b, n_h, d_h) for w in ("wq", "wk", "wv")]
                kc = lax.dynamic_update_slice(kc, k[:, None], (0, pos, 0, 0))
                vc = lax.dynamic_update_slice(vc, v[:, None], (0, pos, 0, 0))
                s = jnp.where(jnp.arange(t) <= pos, jnp.einsum("bhd,bthd->bht", q, kc), -1e30)
                o = jnp.einsum("bht,bthd->bhd", jax.nn.softmax(s / d_h ** 0.5, axis=-1), vc)
                return h + o.reshape(b, n_h * d_h) @ lp["wo"], (kc, vc)

            h, (k, v) = lax.scan(layer, h, (p["layers"], kc0, vc0))
            out = (jax.sharding.reshard(p["out"], P("data", None)) if explicit else p["out"])
            return ((k, v), pos + 1), h @ out

        kw = {"out_sharding": P(None, "data")} if explicit else {}
        empty = jnp.zeros((n_l, b, t, n_h, d_h), **kw)
        return lax.scan(step, ((empty, empty), jnp.int32(0)), tokens.T)[1]

    normal = lambda seed, shape, scale=1.0: jax.random.normal(jax.random.key(seed), shape) * scale
    p = {"emb": normal(0, (32, 16)), "out": normal(1, (16, 32), 0.25),
         "layers": {w: normal(2 + i, (n_l, 16, 16), 0.25) for i, w in enumerate(("wq", "wk", "wv", "wo"))}}
    return f, p, jax.random.randint(jax.random.key(9), (batch, t), 0, 32)


def ci_only(values, keep):
    """``values`` as pytest parameters: those in ``keep`` run in the default run, the others
    with the slow tests (CI runs both; the default run stays under 5 minutes on 2 cores).

    >>> [isinstance(p, str) for p in ci_only(["a", "b"], {"a"})]  # "b": a slow pytest.param
    [True, False]
    """
    return [v if v in keep else pytest.param(v, marks=pytest.mark.slow) for v in values]


def on_devices(code, devices, timeout=300):
    """Runs ``code`` (dedented) in a fresh Python on ``devices`` host CPU devices
    (``XLA_FLAGS=--xla_force_host_platform_device_count``), with this directory importable
    as ``JQT_TESTS_DIR``; returns the JSON of the last line it prints after ``RESULT``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JQT_TESTS_DIR=os.path.dirname(os.path.abspath(__file__)),
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                              stdout=out, stderr=err, text=True, timeout=timeout, check=False)
        return result_json(proc.returncode, out, err)


def result_json(returncode, out, err, what="subprocess"):
    """The JSON a finished subprocess printed last after ``RESULT`` (``out``, ``err``: its
    output files); a failure shows its output."""
    out.seek(0)
    err.seek(0)
    text = out.read()
    lines = [line for line in text.splitlines() if line.startswith("RESULT")]
    assert returncode == 0 and lines, f"{what} failed:\n{text}\n{err.read()[-4000:]}"
    return json.loads(lines[-1][len("RESULT"):])
