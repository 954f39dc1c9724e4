"""Accuracy of jqt's calibrators on two models trained on scikit-learn digits.

    python benchmarks/calibrators.py            # full run (about 4 minutes on 2 cores)
    python benchmarks/calibrators.py --quick    # fewer epochs and batches, no 3-bit recipe

Trains two float models in the script (no download): the quickstart CNN
(``examples/quickstart.py``: conv 3x3x16, conv 3x3x32, max-pool, dense 64,
dense 10) and an MLP 64-256-256-10 (ReLU), then calibrates each with every
activation calibrator (MinMax, MovingAverage, Percentile 99.9 / 99.99, MSE,
Entropy, and Entropy(stride=1), which tries every threshold) under these
recipes and reports test accuracy:

* ``w8a8``: jqt's preset (int8 symmetric per-channel weights, int8
  asymmetric static per-tensor activations);
* ``w8a4``: the same weights, 4-bit asymmetric static activations, calibrated
  plainly and with ``propagate=True`` (error propagation);
* ``w8a3``: the same with 3-bit activations (full run only), where the
  choice of range matters more;
* ``w4a8``: jqt's preset (int4 per-channel weights), ``WeightMinMax`` against
  ``WeightMSE`` (activations: MinMax);
* ``fp8``: jqt's preset (e4m3 per-channel weights, e4m3 static activations).

A last table puts fp8 activations on synthetic heavy-tailed data (``heavy_tail_fp8``).

Besides accuracy (450 test images, so one image is 0.22 points) it reports
the agreement of the predictions with the float model and the SQNR of the
logits against the float logits, which separate calibrators when accuracies
tie, and the wall time of each ``jqt.calibrate`` call (tracing and compiling
its step included; one untimed call warms JAX up first).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

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
from report import environment as report_environment  # noqa: E402
from report import table  # noqa: E402
from workloads import quickstart  # noqa: E402

C = jqt.calibrators
CALIBRATORS = (
    ("MinMax", C.MinMax()),
    ("MovingAverage", C.MovingAverage()),
    ("Percentile 99.9", C.Percentile(99.9)),
    ("Percentile 99.99", C.Percentile(99.99)),
    ("MSE", C.MSE()),
    ("Entropy", C.Entropy()),
    # Not a separate calibrator: Entropy searching every threshold, which always
    # includes the one that clips nothing (the default stride can skip it).
    ("Entropy(stride=1)", C.Entropy(stride=1)),
)
WEIGHT_CALIBRATORS = (("WeightMinMax", C.WeightMinMax()), ("WeightMSE", C.WeightMSE()))
# The weight type of the w8a8 preset: int8, symmetric, narrow range, per channel.
INT8_WEIGHT = jqt.recipes.w8a8().rules[0].weight

FULL = dict(epochs=10, calib_batches=16, act_bits=(4, 3))
QUICK = dict(epochs=5, calib_batches=10, act_bits=(4,))
CALIB_BATCH = 32


def log(msg):
    print(msg, file=sys.stderr, flush=True)


QS = quickstart()


class MLP(nn.Module):
    """64-256-256-10 with ReLU, on flattened 8x8 digits."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


# name -> (model factory, input reshape)
MODELS = {
    "cnn": (QS.CNN, lambda x: x),
    "mlp": (MLP, lambda x: x.reshape(len(x), -1)),
}
DESCRIPTIONS = {
    "cnn": "quickstart CNN (conv 3x3x16, conv 3x3x32, max-pool 2, dense 64, dense 10; ReLU)",
    "mlp": "MLP 64-256-256-10 (ReLU)",
}


def act_recipe(bits, calibrator):
    """8-bit per-channel weights (the preset's), ``bits``-bit asymmetric static activations."""
    return jqt.Recipe(rules=(jqt.Rule(weight=INT8_WEIGHT,
                                      activation=jqt.QuantType(bits=bits, symmetric=False),
                                      calibrator=calibrator),))


def sqnr_db(y, ref):
    err = float(jnp.sum((y - ref) ** 2))
    return float("inf") if err == 0 else 10 * np.log10(float(jnp.sum(ref ** 2)) / err)


def weight_rel_error(qp, params):
    """sum (dequantized - float)^2 / sum float^2 over every quantized weight."""
    leaves = jax.tree_util.tree_leaves(params)
    err = ref = 0.0
    for p in qp.values():
        q = None if p.is_float else p.operand(p.weight_operand)
        if q is None:
            continue
        w = np.asarray(leaves[p.source.leaf], np.float64)
        s = np.asarray(q.scale, np.float64)
        z = 0.0 if q.zero_point is None else np.asarray(q.zero_point, np.float64)
        deq = (np.clip(np.round(w / s) + z, q.qtype.qmin, q.qtype.qmax) - z) * s
        err += float(np.sum((deq - w) ** 2))
        ref += float(np.sum(w ** 2))
    return err / ref


def act_clip(qp):
    """The largest representable activation value of each op (the top of its range)."""
    out = []
    for p in qp.values():
        a = None if p.is_float else p.operand(1 - p.weight_operand)
        if a is None or a.scale is None:  # float op, weight-only or dynamic activations
            out.append(None)
            continue
        s = float(np.asarray(a.scale))
        z = 0.0 if a.zero_point is None else float(np.asarray(a.zero_point))
        out.append((a.qtype.qmax - z) * s)
    return out


class Bench:
    """One trained model, its data and calibration set; ``run`` evaluates one recipe."""

    def __init__(self, name, cfg):
        make, shape = MODELS[name]
        x_train, x_test, y_train, y_test = QS.load_data()
        self.x_train, self.x_test = shape(x_train), shape(x_test)
        self.y_test = y_test
        self.model = make()
        t = time.perf_counter()
        self.params, self.loss = QS.train(self.model, self.x_train, y_train, epochs=cfg["epochs"])
        self.train_s = time.perf_counter() - t
        self.apply = self.model.apply
        self.float_logits = jax.jit(self.apply)(self.params, self.x_test)
        self.float_acc = QS.accuracy(self.float_logits, y_test)
        self.float_pred = np.asarray(jnp.argmax(self.float_logits, -1))
        self.n_params = sum(x.size for x in jax.tree_util.tree_leaves(self.params))
        # Calibration data: the first n batches of 32 training images (train_test_split
        # shuffled them), each a tuple of the arguments of apply after the weights.
        n = cfg["calib_batches"]
        self.calib = [(self.x_train[i * CALIB_BATCH:(i + 1) * CALIB_BATCH],) for i in range(n)]
        jqt.calibrate(self.apply, jqt.recipes.w8a8(), self.params, self.calib[:1], progress=False)

    def run(self, recipe, propagate=False):
        t = time.perf_counter()
        qp = jqt.calibrate(self.apply, recipe, self.params, self.calib, progress=False,
                           propagate=propagate)
        calib_s = time.perf_counter() - t
        y = jax.jit(jqt.quantize(self.apply, qp))(self.params, self.x_test)
        acc = QS.accuracy(y, self.y_test)
        return dict(acc=acc, delta=(acc - self.float_acc) * 100,
                    agree=float((np.asarray(jnp.argmax(y, -1)) == self.float_pred).mean()),
                    sqnr=sqnr_db(y, self.float_logits), s=calib_s, clip=act_clip(qp),
                    werr=weight_rel_error(qp, self.params),
                    keys=list(qp))


def pct(x):
    return f"{x:.2%}"


def bench_model(name, cfg):
    t0 = time.perf_counter()
    b = Bench(name, cfg)
    log(f"[{name}] trained in {b.train_s:.1f} s, float test accuracy {b.float_acc:.2%}")
    res = {}
    for cname, cal in CALIBRATORS:
        res[("w8a8", cname, False)] = b.run(jqt.recipes.w8a8(calibrator=cal))
        for bits in cfg["act_bits"]:
            for prop in (False, True):
                res[(f"w8a{bits}", cname, prop)] = b.run(act_recipe(bits, cal), propagate=prop)
        log(f"[{name}] {cname}: done ({time.perf_counter() - t0:.0f} s)")
    for wname, wcal in WEIGHT_CALIBRATORS:
        res[("w4a8", wname, False)] = b.run(jqt.recipes.w4a8(weight_calibrator=wcal))
    log(f"[{name}] weight calibrators: done ({time.perf_counter() - t0:.0f} s)")
    for cname, cal in CALIBRATORS:
        res[("fp8", cname, False)] = b.run(jqt.recipes.fp8(calibrator=cal))
    log(f"[{name}] fp8: done ({time.perf_counter() - t0:.0f} s)")
    return b, res


def heavy_tail_fp8(seed=0):
    """fp8 (e4m3 and e5m2) static activations on heavy-tailed data: a 256 -> 128 matmul of
    Student-t (3 degrees of freedom) inputs, calibrated on 4 batches of 64 rows, measured
    on 512 other rows. fp8's relative step is the same in every binade, so clipping the
    range buys no precision for the values kept: the SQNR of the output per calibrator."""
    rng = np.random.default_rng(seed)
    k, n = 256, 128
    w = jnp.asarray(rng.standard_normal((k, n)) / 16, jnp.float32)
    f = lambda w, x: x @ w
    calib = [(jnp.asarray(rng.standard_t(3, (64, k)), jnp.float32),) for _ in range(4)]
    test = jnp.asarray(rng.standard_t(3, (512, k)), jnp.float32)
    ref = f(w, test)
    rows = []
    for cname, cal in CALIBRATORS:
        row = [cname]
        for dtype in ("float8_e4m3fn", "float8_e5m2"):
            qp = jqt.calibrate(f, jqt.recipes.fp8(calibrator=cal, act_dtype=dtype), w, calib,
                               progress=False)
            y = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, w), test)
            a = qp["w"].lhs
            row += [f"{sqnr_db(y, ref):.2f}", f"{float(a.scale) * a.qtype.qmax:.2f}"]
        rows.append(tuple(row))
    return rows


def detail_rows(res, recipe, names):
    return [(n, pct(r["acc"]), f"{r['delta']:+.2f}", pct(r["agree"]), f"{r['sqnr']:.1f}",
             f"{r['s']:.2f}") for n in names for r in [res[(recipe, n, False)]]]


def prop_rows(res, recipe):
    rows = []
    for n, _ in CALIBRATORS:
        a, p = res[(recipe, n, False)], res[(recipe, n, True)]
        rows.append((n, pct(a["acc"]), pct(p["acc"]), f"{a['delta']:+.2f} / {p['delta']:+.2f}",
                     f"{pct(a['agree'])} / {pct(p['agree'])}", f"{a['sqnr']:.1f} / {p['sqnr']:.1f}",
                     f"{a['s']:.2f} / {p['s']:.2f}"))
    return rows


def clip_rows(res, recipe):
    keys = res[(recipe, CALIBRATORS[0][0], False)]["keys"]
    header = ("calibrator",) + tuple(k.removeprefix("params/").removesuffix("/kernel") for k in keys)
    rows = [(n,) + tuple("-" if c is None else f"{c:.3f}" for c in res[(recipe, n, False)]["clip"])
            for n, _ in CALIBRATORS]
    return header, rows


def environment():
    return report_environment(ROOT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="5 training epochs, 10 calibration batches, no 3-bit recipe")
    p.add_argument("--only", default=None, type=cli.names(list(MODELS)),
                   help="comma-separated models: cnn, mlp")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    names = args.only or list(MODELS)
    t_start = time.perf_counter()
    cmd = " ".join(["python", os.path.relpath(os.path.abspath(sys.argv[0]), ROOT)] + sys.argv[1:])
    print(f"# jqt calibrators on digits ({'quick' if args.quick else 'full'} run)\n")
    print(f"Command: `{cmd}`\n\n{environment()}\n")
    results = {n: bench_model(n, cfg) for n in names}
    b0 = next(iter(results.values()))[0]
    nb = cfg["calib_batches"]
    print(f"scikit-learn digits: {len(b0.x_train)} training / {len(b0.x_test)} test images "
          f"(one test image = {100 / len(b0.x_test):.2f} points). Calibration: {nb} batches of "
          f"{CALIB_BATCH} training images (the first {nb * CALIB_BATCH}). Models trained "
          f"{cfg['epochs']} epochs (Adam 3e-3, batch 64, seed 0, the quickstart's `train`).\n")
    print("Columns: `acc` test accuracy of the quantized model; `delta` its difference to the "
          "float model in points; `agree` fraction of test predictions equal to the float "
          "model's; `SQNR` 10 log10(|float logits|^2 / |quantized - float logits|^2) over the "
          "test set in dB (higher is closer to float); `calibrate s` wall time of "
          "`jqt.calibrate` (tracing and compiling its step included); `weight rel. sq. error` "
          "sum((dequantized - float weight)^2) / sum(float weight^2) over all kernels.\n")

    print("## Models\n")
    print(table(("model", "architecture", "parameters", "final train loss", "train s",
                 "float test acc"),
                [(n, DESCRIPTIONS[n], f"{b.n_params:,}", f"{b.loss:.4f}", f"{b.train_s:.1f}",
                  pct(b.float_acc)) for n, (b, _) in results.items()], markdown=True))

    recipes = ["w8a8"] + [f"w8a{bits}" for bits in cfg["act_bits"]]
    print("\n## Summary: test accuracy by activation calibrator\n")
    print("`w8aN`: int8 symmetric per-channel weights, N-bit asymmetric static per-tensor "
          "activations (`w8a8` is the `jqt.recipes.w8a8` preset); `+prop`: "
          "`propagate=True`.\n")
    header = ["calibrator"]
    for n in results:
        header += [f"{n} {r}" + (" +prop" if p else "") for r in recipes
                   for p in ((False,) if r == "w8a8" else (False, True))]
    rows = [("float",) + tuple(pct(b.float_acc) for n, (b, _) in results.items()
                               for r in recipes for p in ((False,) if r == "w8a8" else (0, 1)))]
    for cname, _ in CALIBRATORS:
        rows.append((cname,) + tuple(pct(res[(r, cname, p)]["acc"]) for n, (b, res) in results.items()
                                     for r in recipes
                                     for p in ((False,) if r == "w8a8" else (False, True))))
    print(table(header, rows, markdown=True))

    for n, (b, res) in results.items():
        print(f"\n## {n}: {DESCRIPTIONS[n]}, float test accuracy {pct(b.float_acc)}\n")
        print("### w8a8 (preset: int8 per-channel weights, int8 static activations)\n")
        print(table(("calibrator", "acc", "delta pts", "agree", "SQNR dB", "calibrate s"),
                    detail_rows(res, "w8a8", [c for c, _ in CALIBRATORS]), markdown=True))
        for bits in cfg["act_bits"]:
            print(f"\n### w8a{bits} (int8 per-channel weights, {bits}-bit asymmetric static "
                  "activations): propagate=False / True\n")
            print(table(("calibrator", "acc", "acc +prop", "delta pts", "agree", "SQNR dB",
                         "calibrate s"), prop_rows(res, f"w8a{bits}"), markdown=True))
        print("\n### w4a8 (preset: int4 per-channel weights, int8 static activations with "
              "MinMax): weight calibrators\n")
        print(table(("weight calibrator", "acc", "delta pts", "agree", "SQNR dB", "calibrate s",
                     "weight rel. sq. error"),
                    [r + (f"{res[('w4a8', r[0], False)]['werr']:.2e}",)
                     for r in detail_rows(res, "w4a8", [c for c, _ in WEIGHT_CALIBRATORS])],
                    markdown=True))
        print("\n### fp8 (preset: e4m3 per-channel weights, e4m3 static per-tensor "
              "activations)\n")
        print(table(("calibrator", "acc", "delta pts", "agree", "SQNR dB", "calibrate s"),
                    detail_rows(res, "fp8", [c for c, _ in CALIBRATORS]), markdown=True))
        for r in recipes[:2]:
            print(f"\n### Top of each op's activation range, {r} (propagate=False)\n")
            print(table(*clip_rows(res, r), markdown=True))
    print("\n## fp8 activations on heavy-tailed data\n")
    print("A 256 -> 128 matmul of Student-t (3 degrees of freedom) inputs, calibrated on 4 "
          "batches of 64 rows and measured on 512 others (`heavy_tail_fp8`): the output SQNR "
          "in dB and the top of the activation range per calibrator (`jqt.recipes.fp8`, e4m3 "
          "weights, e4m3 or e5m2 static activations).\n")
    print(table(("calibrator", "e4m3 SQNR dB", "e4m3 range top", "e5m2 SQNR dB",
                 "e5m2 range top"), heavy_tail_fp8(), markdown=True))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\ntotal time {time.perf_counter() - t_start:.0f} s; load average at the end {load}")


if __name__ == "__main__":
    main()
