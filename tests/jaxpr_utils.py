"""Helpers shared by the tests: walking jaxprs."""


def all_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, sub-jaxprs (jit, scan, remat, custom_jvp) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from all_eqns(sub)
