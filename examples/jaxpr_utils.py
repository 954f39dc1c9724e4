"""Walking a jaxpr: the examples' evidence that the quantized model runs integer kernels.

The examples inspect ``jax.make_jaxpr(...)`` objects, never their printed text: on a
terminal JAX colours ``str(jaxpr)``, and the text format is not an interface.
"""
import numpy as np

KERNELS = ("dot_general", "conv_general_dilated")


def all_eqns(jaxpr):
    """Every equation of a (closed) jaxpr, sub-jaxprs (jit, scan, cond, remat, custom_jvp) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from all_eqns(sub)


def is_int8_kernel(eqn):
    """A dot_general or convolution on int8 x int8 operands."""
    return eqn.primitive.name in KERNELS and all(v.aval.dtype == np.int8 for v in eqn.invars)


def describe(eqn):
    """``name: operand types -> result types``, e.g. ``dot_general: i8[8,64] i8[10,64] -> i32[8,10]``."""
    ins = " ".join(v.aval.str_short(short_dtypes=True) for v in eqn.invars if hasattr(v, "aval"))
    outs = " ".join(v.aval.str_short(short_dtypes=True) for v in eqn.outvars)
    return f"{eqn.primitive.name}: {ins} -> {outs}"
