"""The variants timed for each workload: float32, jqt's three presets and Qwix's PTQ modes.

:func:`prepare` does the per-workload work once (initialise the float model,
calibrate, pack, quantize, build the Qwix models and parameters); the result
is a list of :class:`Variant` objects whose ``fn(*args(x))`` runs one forward
pass for any batch of the workload. Every ``fn`` is ``jax.jit``-ed.

jqt variants call ``jax.jit(jqt.quantize(model.apply, qp))(packed, x)`` with
``packed = jqt.pack(qp, variables)`` (int8 weights stored once).

Qwix variants follow Qwix's documented PTQ flow for flax.linen:
``qwix.quantize_model(model, qwix.PtqProvider(rules))``, abstract parameters
from ``jax.eval_shape(ptq_model.init, ...)``, ``qwix.quantize_params`` for the
int8 weights, then ``ptq_model.apply({'params': qparams}, x)``. Static-range
quantization first collects ``quant_stats`` with ``qwix.QtProvider`` (rules
with ``act_static_scale=True``) over the same calibration batches jqt uses,
and passes them to ``quantize_params``. Rules quantize ``dot_general`` and
``conv_general_dilated`` only (as jqt's presets do), so the encoder's
attention einsums stay float in both libraries. Qwix's defaults are kept:
symmetric ``absmax`` activation scales, and static scales averaged over the
batch axis (one per sequence position for the encoder).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import numpy as np

import jqt

N_CALIB = 4  # calibration batches per workload (jqt and Qwix static)

JQT_RECIPES = (("jqt w8a8", "w8a8"), ("jqt w8a8_dynamic", "w8a8_dynamic"), ("jqt w8", "w8"))
QWIX_MODES = (("qwix w8", "weight-only"), ("qwix w8a8_dynamic", "dynamic"),
              ("qwix w8a8", "static"))


@dataclasses.dataclass
class Variant:
    """One way of running a workload.

    ``fn(*args(x))`` is a forward pass on ``x``; ``nbytes`` the bytes of the
    weights it reads; ``na`` the reason it cannot run (then ``fn`` is None).
    """

    name: str
    fn: Optional[Callable] = None
    args: Optional[Callable] = None
    nbytes: Optional[int] = None
    na: Optional[str] = None

    def __call__(self, x):
        return self.fn(*self.args(x))


def tree_nbytes(tree) -> int:
    """Bytes of every array leaf of ``tree``."""
    return int(sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(tree)))


def reason(e: BaseException) -> str:
    """A one-line reason for an n/a row."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:150]}"


def jqt_variant(name, recipe_name, f, variables, calib) -> Variant:
    try:
        recipe = getattr(jqt.recipes, recipe_name)()
        qp = jqt.calibrate(f, recipe, variables, calib, progress=False)
        packed = jqt.pack(qp, variables)
        qf = jax.jit(jqt.quantize(f, qp))
        return Variant(name, qf, lambda x: (packed, x), packed.nbytes())
    except Exception as e:  # report the failure in the table, go on
        return Variant(name, na=reason(e))


def qwix_rules(mode: str):
    import qwix
    ops = ("dot_general", "conv_general_dilated")
    if mode == "weight-only":
        return [qwix.QuantizationRule(module_path=".*", op_names=ops, weight_qtype="int8")]
    if mode == "dynamic":
        return [qwix.QuantizationRule(module_path=".*", op_names=ops, weight_qtype="int8",
                                      act_qtype="int8")]
    return [qwix.QuantizationRule(module_path=".*", op_names=ops, weight_qtype="int8",
                                  act_qtype="int8", act_static_scale=True)]


def qwix_static_stats(model, rules, params, calib):
    """Qwix's static-range calibration: run the QT model over ``calib``, keep quant_stats."""
    import qwix
    qt_model = qwix.quantize_model(model, qwix.QtProvider(rules))
    stats = qt_model.init(jax.random.PRNGKey(0), *calib[0])["quant_stats"]  # count 0
    # Not under jax.jit: Qwix's QT conv then leaks a tracer (its quant_stats update
    # runs inside a custom_vjp), UnexpectedTracerError.
    for (x,) in calib:
        _, upd = qt_model.apply({"params": params, "quant_stats": stats}, x,
                                mutable=["quant_stats"])
        stats = upd["quant_stats"]
    return stats


def qwix_variant(name, mode, model, variables, calib) -> Variant:
    try:
        import qwix
    except ImportError as e:
        return Variant(name, na=f"qwix not installed ({e})")
    try:
        rules = qwix_rules(mode)
        ptq_model = qwix.quantize_model(model, qwix.PtqProvider(rules))
        abstract = jax.eval_shape(ptq_model.init, jax.random.PRNGKey(0), *calib[0])
        stats = {}
        if mode == "static":
            stats = qwix_static_stats(model, rules, variables["params"], calib)
        qparams = qwix.quantize_params(variables["params"], abstract["params"], stats)
        fn = jax.jit(lambda p, x: ptq_model.apply({"params": p}, x))
        return Variant(name, fn, lambda x: (qparams, x), tree_nbytes(qparams))
    except Exception as e:
        return Variant(name, na=reason(e))


@dataclasses.dataclass
class Prepared:
    """A workload ready to run: its float variables and every variant."""

    workload: object
    variables: dict
    float_nbytes: int
    variants: list


def prepare(wl, with_qwix: bool = True) -> Prepared:
    """Initialises the float model and builds every variant of workload ``wl``."""
    model = wl.make_model()
    variables = wl.init(model)
    f = model.apply
    calib = wl.calibration_batches(N_CALIB)
    out = [Variant("float32", jax.jit(f), lambda x: (variables, x), tree_nbytes(variables))]
    out += [jqt_variant(n, r, f, variables, calib) for n, r in JQT_RECIPES]
    if with_qwix:
        out += [qwix_variant(n, m, model, variables, calib) for n, m in QWIX_MODES]
    return Prepared(wl, variables, tree_nbytes(variables), out)


def errors(y, y_ref):
    """(max |y - y_ref|, that divided by max |y_ref|)."""
    y, y_ref = np.asarray(y, np.float64), np.asarray(y_ref, np.float64)
    err = float(np.abs(y - y_ref).max())
    return err, err / max(float(np.abs(y_ref).max()), 1e-30)


def first_call(variant: Variant, x):
    """Runs ``variant`` once on ``x`` (compiling it): ``(output, None)`` or ``(None, reason)``."""
    try:
        return jax.block_until_ready(variant(x)), None
    except Exception as e:
        return None, f"at run time: {reason(e)}"
