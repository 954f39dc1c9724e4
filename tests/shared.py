"""Helpers shared by the tests: walking jaxprs, a residual MLP scanned over stacked layers."""
import jax
from jax import lax

L = 3  # layers of scan_mlp



def all_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, sub-jaxprs (jit, scan, remat, custom_jvp) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from all_eqns(sub)


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
