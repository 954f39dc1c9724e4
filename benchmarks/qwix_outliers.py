"""GPTQ, AWQ and SmoothQuant: jqt against Qwix's own implementations (``qwix.contrib``).

    python benchmarks/qwix_outliers.py             # about 3-6 minutes on 2 cores
    python benchmarks/qwix_outliers.py --quick     # one timed run per row, no extra rows
    python benchmarks/qwix_outliers.py --markdown --save benchmarks/results/outliers-qwix-cpu-2core.md

One flax.linen model, one data set, one list of calibration batches, one
evaluation set for both libraries:

* **Model**: an MLP 256-512-512-10 (``nn.Dense``, GELU), trained in the script
  (Adam 2e-3, 400 steps of 256, seed 0, about 10 s) on synthetic data: 10
  classes from 32 latent factors; 8 of the 256 input channels carry 8 factors
  at 25 times the scale of the others (the loud channels that SmoothQuant and
  AWQ are for), the other 248 carry a mix of the remaining factors plus noise.
  Contracting dimensions 256 and 512, so groups of 128 fit.
* **Calibration**: 8 batches of 128 samples (a fixed seed, not the
  evaluation data), the same list for every row.
* **Evaluation**: 4096 held-out samples: the relative error of the logits
  against the float model (``||y_q - y||_F / ||y||_F``), the accuracy, and the
  share of predictions equal to the float model's.

Every dense layer (all three) is quantized in both libraries. jqt quantizes
``f = lambda p, x: model.apply({"params": p}, x)``; its rows run the packed
integer path (``jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, params), x)``; the
``simulate=True`` numbers are in the RESULTS line). Qwix follows its contrib
tests for linen: ``qwix.quantize_model(model, <Algo>CalibrationProvider(rules))``
applied eagerly over the batches (``mutable="quant_stats"``; eager is faster
than a freshly jitted step for 8 batches of this model), the abstract tree from
``jax.eval_shape`` of the ``PtqProvider`` model's ``init``, then
``<algo>.quantize_params`` and the algorithm's inference provider.

Same formats in both libraries: int4 symmetric weights with one scale per
group of 128 inputs (weight-only) for RTN, GPTQ and AWQ; int8 symmetric
per-channel weights with int8 activations for SmoothQuant (alpha 0.5). Qwix's
own symmetric grid is a little different from jqt's (Qwix: scale
``absmax / (qmax + 0.5)``, codes ``-8..7``; jqt: ``absmax / qmax``, codes
``-7..7``), so the main Qwix rows use ``weight_calibration_method =
"absmax,<(qmax + 0.5) / qmax>"``, which gives exactly jqt's grid (the RTN rows
check it); the "Qwix default grid" rows show Qwix as it comes.

Time to quantize: the whole PTQ call of each library (jqt: ``calibrate`` (+
``gptq``) + ``pack``; Qwix: calibration loop + abstract tree +
``quantize_params``; model training and evaluation excluded), wall clock. The
first call of each row is reported on its own (``first s``: compiling, and
Qwix's op-by-op compiles of its GPTQ column loop), then the median of
``--repeats`` further calls in the same process.

Prints the tables (markdown with ``--markdown``) and a ``RESULTS {json}`` line;
``--save PATH`` also writes the tables to PATH with the command at the top.
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # the jqt of this checkout
sys.path.insert(0, HERE)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import cli  # noqa: E402
import jqt  # noqa: E402
from report import environment, table  # noqa: E402

D_IN, HIDDEN, CLASSES, N_LOUD, LOUD = 256, 512, 10, 8, 25.0
N_LATENT, N_TRAIN, N_EVAL = 32, 20000, 4096
CALIB_BATCHES, CALIB_ROWS = 8, 128
GROUP, ALPHA = 128, 0.5
# Qwix's symmetric scale is absmax / (qmax + 0.5); scaling its absmax by this factor
# gives absmax / qmax, jqt's narrow-range grid (codes -qmax..qmax).
MATCH4 = f"absmax,{7.5 / 7!r}"
MATCH8 = f"absmax,{127.5 / 127!r}"


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.gelu(nn.Dense(HIDDEN)(x))
        h = nn.gelu(nn.Dense(HIDDEN)(h))
        return nn.Dense(CLASSES)(h)


# ---- data and model ------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    model: nn.Module
    params: dict
    batches: list          # [(x,), ...] calibration batches, shared by every row
    x_eval: jax.Array
    y_eval: np.ndarray
    logits: np.ndarray     # float model on x_eval
    loss: float
    train_s: float

    def f(self, p, x):
        return self.model.apply({"params": p}, x)


def make_sampler():
    rng = np.random.default_rng(0)
    teacher_lin = rng.normal(size=(16, CLASSES))
    teacher_a = rng.normal(size=(N_LATENT, 64))
    teacher_b = rng.normal(size=(64, CLASSES))
    mix = rng.normal(size=(N_LATENT - N_LOUD, D_IN - N_LOUD)) / np.sqrt(N_LATENT - N_LOUD)
    loud = np.sort(rng.choice(D_IN, N_LOUD, replace=False))
    quiet = np.setdiff1d(np.arange(D_IN), loud)

    def sample(n, seed):
        r = np.random.default_rng(seed)
        z = r.normal(size=(n, N_LATENT))
        y = np.argmax(z[:, :16] @ teacher_lin + 0.5 * np.tanh(z @ teacher_a) @ teacher_b / 8, -1)
        x = np.empty((n, D_IN))
        x[:, loud] = LOUD * (z[:, :N_LOUD] + 0.1 * r.normal(size=(n, N_LOUD)))
        x[:, quiet] = z[:, N_LOUD:] @ mix + 0.5 * r.normal(size=(n, D_IN - N_LOUD))
        return x.astype(np.float32), y

    return sample, loud


def setup(steps=400) -> Setup:
    import optax

    sample, _ = make_sampler()
    x_tr, y_tr = sample(N_TRAIN, 1)
    x_ev, y_ev = sample(N_EVAL, 2)
    x_cal, _ = sample(CALIB_BATCHES * CALIB_ROWS, 5)
    model = MLP()
    params = model.init(jax.random.key(0), x_tr[:2])["params"]
    opt = optax.adam(2e-3)

    @jax.jit
    def step(p, s, x, y):
        def loss(p):
            logits = model.apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        val, g = jax.value_and_grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, val

    t0 = time.perf_counter()
    state, r = opt.init(params), np.random.default_rng(3)
    for _ in range(steps):
        idx = r.integers(0, N_TRAIN, 256)
        params, state, val = step(params, state, x_tr[idx], y_tr[idx])
    loss = float(val)
    train_s = time.perf_counter() - t0
    batches = [(jnp.asarray(x_cal[i * CALIB_ROWS:(i + 1) * CALIB_ROWS]),) for i in range(CALIB_BATCHES)]
    x_ev = jnp.asarray(x_ev)
    logits = np.asarray(jax.jit(lambda p, x: model.apply({"params": p}, x))(params, x_ev))
    return Setup(model, params, batches, x_ev, y_ev, logits, loss, train_s)


def metrics(y, s: Setup) -> dict:
    y = np.asarray(y, np.float64)
    ref = s.logits.astype(np.float64)
    return dict(rel_err=float(np.linalg.norm(y - ref) / np.linalg.norm(ref)),
                acc=float(np.mean(y.argmax(-1) == s.y_eval)),
                agree=float(np.mean(y.argmax(-1) == ref.argmax(-1))))


# ---- jqt -----------------------------------------------------------------------------------------

def jqt_sym_dynamic(smooth=None) -> jqt.Recipe:
    """``w8a8_dynamic`` with symmetric per-token activations (Qwix's SmoothQuant needs them)."""
    rule = jqt.recipes.w8a8_dynamic(smooth=smooth).rules[0]
    act = jqt.QuantType(bits=8, symmetric=True, per_channel=True, dynamic=True)
    return jqt.Recipe(rules=(dataclasses.replace(rule, activation=act),))


def jqt_ptq(recipe_fn, use_gptq=False, **gptq_opts) -> Callable:
    """A PTQ call: ``run(setup) -> (forward(x), extra)``, calibrate (+ gptq) + pack timed."""

    def run(s: Setup):
        qp = jqt.calibrate(s.f, recipe_fn(), s.params, s.batches, progress=False)
        p = jqt.gptq(s.f, qp, s.params, s.batches, progress=False, **gptq_opts) if use_gptq else s.params
        packed = jqt.pack(qp, p)
        jax.block_until_ready(jax.tree_util.tree_leaves(packed))

        def evaluate():
            y = jax.jit(jqt.quantize(s.f, qp))(packed, s.x_eval)
            y_sim = jqt.quantize(s.f, qp, simulate=True)(p, s.x_eval)
            return y, {"simulate": metrics(y_sim, s)}
        return evaluate
    return run


# ---- Qwix ----------------------------------------------------------------------------------------

def qwix_calibrate(s: Setup, provider) -> dict:
    """Qwix's calibration loop for linen (as in its contrib tests): eager apply, quant_stats kept."""
    import qwix
    cal = qwix.quantize_model(s.model, provider)
    variables = {"params": s.params}
    for batch in s.batches:
        _, new = cal.apply(variables, *batch, mutable="quant_stats")
        variables = {**variables, **new}
    return variables["quant_stats"]


def qwix_abstract(s: Setup, rules):
    """The abstract quantized params tree (``WithAux`` leaves) of Qwix's PTQ model."""
    import qwix
    ptq_model = qwix.quantize_model(s.model, qwix.PtqProvider(rules))
    return ptq_model, jax.eval_shape(ptq_model.init, jax.random.key(0), *s.batches[0])["params"]


def qwix_forward(s: Setup, model, qparams):
    def evaluate():
        return jax.jit(lambda p, x: model.apply({"params": p}, x))(qparams, s.x_eval), {}
    return evaluate


def qwix_rtn(rule_kw) -> Callable:
    def run(s: Setup):
        import qwix
        rules = [qwix.QuantizationRule(**rule_kw)]
        model, abstract = qwix_abstract(s, rules)
        qparams = qwix.quantize_params(s.params, abstract)
        jax.block_until_ready(jax.tree_util.tree_leaves(qparams))
        return qwix_forward(s, model, qparams)
    return run


QWIX_CONTRIB = {  # algorithm -> (module of qwix.contrib, rule, calibration provider, inference
    "GPTQ": ("gptq", "GptqRule", "GptqCalibrationProvider", None),  # provider; None: PtqProvider)
    "AWQ": ("awq", "AwqRule", "AwqCalibrationProvider", "AwqInferenceProvider"),
    "SmoothQuant": ("smooth_quant", "SqRule", "SqCalibrationProvider", "SqInferenceProvider"),
}


def qwix_contrib(algo, rule_kw, patched="") -> Callable:
    """Qwix's own ``algo``: calibration provider over the batches, ``quantize_params`` (its
    defaults: GPTQ blocks of 128 and 1% damping, AWQ 20 grid points), inference provider.
    ``patched`` (SmoothQuant only): "acts" quantizes the activations, "acts+inv" also sets
    ``inv_sq_scale = 1 / mean(sq_scale)``."""

    def run(s: Setup):
        import importlib

        import qwix
        module, rule, calibration, inference = QWIX_CONTRIB[algo]
        mod = importlib.import_module(f"qwix.contrib.{module}")
        rules = [getattr(mod, rule)(**rule_kw)]
        stats = qwix_calibrate(s, getattr(mod, calibration)(rules))
        model, abstract = qwix_abstract(s, rules)
        qparams = mod.quantize_params(s.params, abstract, stats)
        if patched:
            inference = _sq_with_quantized_acts()
        elif inference is not None:
            inference = getattr(mod, inference)
        if inference is not None:
            model = qwix.quantize_model(s.model, inference(rules))
        if patched == "acts+inv":
            qparams = _exact_inverse(qparams, stats)
        jax.block_until_ready(jax.tree_util.tree_leaves(qparams))
        return qwix_forward(s, model, qparams)
    return run


def _sq_with_quantized_acts():
    """Qwix's SqInferenceProvider passes the smoothed activation to the matmul in float
    (it calls ``qwix._src.core.dot_general`` directly, so the rule's ``act_qtype`` is never
    applied). This subclass hands the same smoothed activation and the same int8 weight to
    ``PtqProvider.dot_general`` instead, which quantizes the activation as the rule says."""
    from qwix._src.providers import ptq
    from qwix.contrib import smooth_quant as sq

    class SqQuantizedActs(sq.SqInferenceProvider):
        def dot_general(self, lhs, rhs, dimension_numbers, precision=None,
                        preferred_element_type=None, *, out_sharding=None):
            if isinstance(rhs, sq.WithSqScale):
                lhs = lhs * rhs.inv_sq_scale
                rhs = ptq.WithAux(array=rhs.array, how=rhs.how)
            return ptq.PtqProvider.dot_general(self, lhs, rhs, dimension_numbers, precision,
                                               preferred_element_type, out_sharding=out_sharding)
    return SqQuantizedActs


def _exact_inverse(qparams, stats):
    """``inv_sq_scale = 1 / mean(sq_scale)``: Qwix averages ``sq_scale`` and ``1 / sq_scale``
    over the batches separately, so the two no longer cancel exactly (``mean(1/s) != 1/mean(s)``)."""
    out = {}
    for layer, leaves in qparams.items():
        st = stats[layer]["kernel_sq"]
        s = st["sum_of_sq_scale"] / st["count"]
        out[layer] = {**leaves, "kernel": leaves["kernel"].replace(inv_sq_scale=1.0 / s)}
    return out


# ---- rows ----------------------------------------------------------------------------------------

W4 = dict(weight_qtype=jnp.int4, tile_size=GROUP)
W8A8 = dict(weight_qtype=jnp.int8, act_qtype=jnp.int8)  # Qwix: dynamic per-token, absmax


ALGORITHMS = ("RTN", "GPTQ", "AWQ", "SmoothQuant")  # Case.algo: what --only selects


@dataclasses.dataclass
class Case:
    section: str
    algo: str  # one of ALGORITHMS
    lib: str
    config: str
    run: Callable
    extra: bool = False    # accuracy + one timed call (skipped with --quick)
    na: str | None = None


def cases():
    R = jqt.recipes
    ABS = jqt.calibrators.WeightMinMax()  # absmax ranges, the grid matched to Qwix's
    sec4 = f"int4 symmetric weights, groups of {GROUP}, activations float"
    sec8 = "int8 per-channel weights, int8 activations"
    qgrid = f"weight_calibration_method='{MATCH4}'"
    sq8 = dict(W8A8, weight_calibration_method=MATCH8)
    return [
        Case(sec4, "RTN", "jqt", f"w4(group_size={GROUP})", jqt_ptq(lambda: R.w4(group_size=GROUP, weight_calibrator=ABS))),
        Case(sec4, "RTN", "qwix", f"QuantizationRule(int4, tile_size={GROUP}, {qgrid})",
             qwix_rtn(dict(W4, weight_calibration_method=MATCH4))),
        Case(sec4, "GPTQ", "jqt", "w4(group_size=128) + jqt.gptq (act_order, damp 1%, block 128)",
             jqt_ptq(lambda: R.w4(group_size=GROUP, weight_calibrator=ABS), use_gptq=True)),
        Case(sec4, "GPTQ", "qwix", "GptqRule(int4, tile_size=128, same grid); block 128, damp 1%",
             qwix_contrib("GPTQ", dict(W4, weight_calibration_method=MATCH4))),
        Case(sec4, "AWQ", "jqt", "w4(group_size=128, awq=True)",
             jqt_ptq(lambda: R.w4(group_size=GROUP, awq=True, weight_calibrator=ABS))),
        Case(sec4, "AWQ", "qwix", "AwqRule(int4, tile_size=128, same grid), n_grid 20",
             qwix_contrib("AWQ", dict(W4, weight_calibration_method=MATCH4))),
        Case(sec4, "GPTQ", "jqt", "as above, act_order=False (Qwix has no act_order)",
             jqt_ptq(lambda: R.w4(group_size=GROUP, weight_calibrator=ABS), use_gptq=True, act_order=False), extra=True),
        Case(sec4, "RTN", "qwix", "Qwix default grid (absmax/7.5, codes -8..7)", qwix_rtn(W4), extra=True),
        Case(sec4, "GPTQ", "qwix", "Qwix default grid", qwix_contrib("GPTQ", W4), extra=True),
        Case(sec4, "AWQ", "qwix", "Qwix default grid", qwix_contrib("AWQ", W4), extra=True),
        Case(sec8, "RTN", "jqt", "w8a8_dynamic with symmetric per-token activations",
             jqt_ptq(jqt_sym_dynamic)),
        Case(sec8, "RTN", "qwix", f"QuantizationRule(int8, act int8 dynamic absmax, '{MATCH8}')",
             qwix_rtn(dict(W8A8, weight_calibration_method=MATCH8))),
        Case(sec8, "SmoothQuant", "jqt", f"as above, smooth={ALPHA}",
             jqt_ptq(lambda: jqt_sym_dynamic(smooth=ALPHA))),
        Case(sec8, "SmoothQuant", "qwix", f"SqRule(int8, act int8, alpha={ALPHA}, same grid), as shipped: "
             "activations NOT quantized (float)",
             qwix_contrib("SmoothQuant", sq8)),
        Case(sec8, "SmoothQuant", "qwix", "patched: activations quantized (int8 dynamic per token, "
             "through PtqProvider.dot_general)",
             qwix_contrib("SmoothQuant", sq8, patched="acts"), extra=True),
        Case(sec8, "SmoothQuant", "qwix", "patched: activations quantized and "
             "inv_sq_scale = 1/mean(sq_scale)",
             qwix_contrib("SmoothQuant", sq8, patched="acts+inv")),
        Case(sec8, "RTN", "jqt", "w8a8() (static per-tensor asymmetric activations)",
             jqt_ptq(R.w8a8)),
        Case(sec8, "SmoothQuant", "jqt", f"w8a8(smooth={ALPHA}) (static)",
             jqt_ptq(lambda: R.w8a8(smooth=ALPHA))),
        Case(sec8, "SmoothQuant", "qwix", "static activations", None,
             na="n/a: SqInferenceProvider never quantizes activations, so Qwix has no static "
                "(or any) int8-activation SmoothQuant path"),
    ]


def block(out):
    jax.block_until_ready(jax.tree_util.tree_leaves(out))
    return out


def measure(case: Case, s: Setup, repeats: int) -> dict:
    """The first call, ``repeats`` timed calls (median), then the metrics of the last one."""
    if case.na:
        return {"na": case.na}
    times = []
    try:
        for i in range(1 + repeats):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                evaluate = case.run(s)
                times.append(time.perf_counter() - t0)
            print(f"    call {i + 1}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
        y, more = evaluate()
        y = block(y)
    except Exception as e:  # report it in the table, go on
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        return {"na": f"n/a ({type(e).__name__}: {msg})"}
    return dict(metrics(y, s), first_s=times[0], median_s=statistics.median(times[1:]),
                runs=len(times) - 1, times_s=times, **more)


# ---- output --------------------------------------------------------------------------------------

def rows_of(section, results, s: Setup):
    out = []
    for c, r in results:
        if c.section != section:
            continue
        if "na" in r:
            out.append((c.algo, c.lib, c.config, r["na"]))
            continue
        out.append((c.algo, c.lib, c.config, f"{r['rel_err']:.4f}", f"{100 * r['acc']:.2f}",
                    f"{100 * r['agree']:.2f}", f"{r['median_s']:.2f}" + (" (1 run)" if c.extra and r["runs"] == 1 else ""),
                    f"{r['first_s']:.2f}"))
    return out


NOTES = """Where the implementations differ (same format, same data):

* GPTQ: jqt measures each layer's Hessian with the layers before it already quantized (in
  evaluation order), keeps the calibrated groups' scales (static groups) and uses act-order by
  default; Qwix takes every Hessian from the float model, has no act-order, and sets each
  group's scale from the error-updated weights when the column loop reaches the group. Both:
  blocks of 128 columns, 1% damping. Qwix's column loop runs op by op (not jitted), so its
  first call compiles every slice shape once per weight row count (`first s`).
* AWQ: both search `s = mean|x|^a` on 20 exponents (Qwix `linspace(0, 1, 20)`, jqt `i / 20`,
  `i < 20`); jqt scores each with the layer's output error `tr(D^T X^T X D)` from `X^T X`, Qwix
  with the diagonal approximation `mean((D * mean|x|)^2)`.
* SmoothQuant: jqt takes `max|x|` over all batches, Qwix averages the per-batch factors
  `s` and, separately, `1 / s` (so its two no longer cancel: `mean(1/s) != 1 / mean(s)`);
  Qwix's `SqInferenceProvider` multiplies the activation by that `1 / s` and never quantizes
  it (the rule's `act_qtype` is only used in calibration), so its as-shipped row is int8
  weights with float activations. Qwix's SmoothQuant requires symmetric activations, hence
  the symmetric per-token activations in both libraries' dynamic rows (jqt's presets are
  asymmetric); the static rows are jqt's `w8a8` preset.
* Time: `jqt.calibrate` and `jqt.gptq` trace and compile their steps on every call; Qwix's
  calibration runs eagerly (its contrib tests' way; faster here than a fresh `jax.jit`), and
  its weight-only RTN needs no calibration data at all.
"""


def render(results, s: Setup, args, cmd, total_s) -> str:
    buf = io.StringIO()
    p = lambda *a: print(*a, file=buf)
    p(f"# GPTQ, AWQ, SmoothQuant: jqt against Qwix {qwix_version()}\n")
    p(f"Command: `{cmd}`\n\n{environment(ROOT)}\n")
    p(f"Model: flax.linen MLP {D_IN}-{HIDDEN}-{HIDDEN}-{CLASSES} (GELU), trained in the script "
      f"({s.train_s:.1f} s, final loss {s.loss:.3f}) on synthetic 10-class data whose {N_LOUD} "
      f"of {D_IN} input channels are {LOUD:g}x louder than the rest. Float accuracy "
      f"{100 * float(np.mean(s.logits.argmax(-1) == s.y_eval)):.2f}% on {N_EVAL} held-out "
      f"samples. Calibration: the same {CALIB_BATCHES} batches of {CALIB_ROWS} for every row. "
      f"All three dense layers quantized in both libraries.\n")
    p(f"Columns: `rel err` ||logits - float logits|| / ||float logits|| on the held-out set "
      f"(lower is better); `acc %` accuracy; `agree %` predictions equal to the float model's; "
      f"`quantize s` wall time of the whole PTQ call, median of {args.repeats} call(s) after a first "
      f"call (`first s`: compiling included; the first row also pays JAX's start-up); `(1 run)`: "
      f"extra rows, one call after the first, whatever --repeats says. jqt rows run the packed integer path; Qwix rows its "
      f"inference providers. Qwix's main rows use jqt's grid (`{MATCH4}` / `{MATCH8}`: scale "
      f"absmax / qmax, codes -qmax..qmax); its own default is absmax / (qmax + 0.5), codes "
      f"-qmax-1..qmax.\n")
    p(NOTES)
    for section in dict.fromkeys(c.section for c, _ in results):
        p(f"## {section}\n")
        p(table(("algorithm", "library", "configuration", "rel err", "acc %", "agree %", "quantize s",
                 "first s"), rows_of(section, results, s), args.markdown, left=(0, 1, 2)))
        p()
    p(f"total time {total_s:.0f} s; load average at the end "
      f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return buf.getvalue()


def qwix_version():
    try:
        import qwix
        return qwix.__version__
    except Exception:  # noqa: BLE001
        return "(not installed)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    ap.add_argument("--quick", action="store_true", help="one timed call per row, no extra rows")
    ap.add_argument("--repeats", type=cli.positive_int, default=None,
                    help="timed calls per row after the first (default 3, 1 with --quick)")
    ap.add_argument("--only", default=None, type=cli.names(ALGORITHMS, key=str.lower),
                    help=f"comma-separated algorithms, any case: {','.join(ALGORITHMS)}")
    ap.add_argument("--save", default=None, help="also write the tables to this file")
    args = ap.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    cmd = " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] +
                   (sys.argv[1:] if argv is None else list(argv)))
    t_start = time.perf_counter()
    print("[qwix_outliers] training the model", file=sys.stderr, flush=True)
    s = setup()
    only = set(args.only) if args.only else None
    results = []
    for c in cases():
        if (args.quick and c.extra) or (only and c.algo not in only):
            continue
        print(f"[qwix_outliers] {c.lib} {c.algo}: {c.config}", file=sys.stderr, flush=True)
        results.append((c, measure(c, s, 1 if c.extra else args.repeats)))
    text = render(results, s, args, cmd, time.perf_counter() - t_start)
    print(text)
    if args.save:
        with open(args.save, "w") as fh:
            fh.write(text)
    print("RESULTS " + json.dumps({f"{c.lib} {c.algo} | {c.config}": r for c, r in results}))


if __name__ == "__main__":
    main()
