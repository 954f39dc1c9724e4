"""Find the layer that breaks a quantized model, and repair it within an accuracy budget.

    python examples/debug_accuracy.py [--plot report.png]

Trains the quickstart CNN on scikit-learn's digits, then gives its second
convolution an *outlier input channel* without changing the float model: the
first conv's output channel j is multiplied by 300 and the second conv's
weights reading channel j are divided by 300 (ReLU commutes with positive
scaling). One huge channel makes a per-tensor int8 activation scale useless
for every other channel, as the outlier features of large language models do.
Then:

1. ``jqt.report`` shows per op the quantization error (SQNR) and clipping,
   and ranks the broken conv worst;
2. ``jqt.sensitivity`` confirms it with the accuracy itself;
3. ``jqt.fallback`` picks the ops to keep float (or at int16 activations) to
   stay within half a point of float accuracy, and returns a recipe that
   reproduces the choice;
4. the calibrators are compared on the broken model.

Exits with an error if the broken layer is not ranked worst or the budget is
not met. Needs the examples extra (``pip install -e .[examples]``); ``--plot``
needs matplotlib (``pip install -e .[plot]``).
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import CNN, accuracy, load_data, print_results, section, train  # noqa: E402

import jqt  # noqa: E402

FACTOR = 300.0
BUDGET = 0.005  # half a point of accuracy


def inject_outlier_channel(params, factor=FACTOR):
    """Conv_0 output channel j (kernel and bias) * factor, Conv_1's input channel j / factor."""
    p = jax.tree_util.tree_map(lambda a: a, params)
    c0, c1 = p["params"]["Conv_0"], p["params"]["Conv_1"]
    j = int(jnp.argmax(jnp.abs(c0["kernel"]).sum(axis=(0, 1, 2))))
    c0["kernel"] = c0["kernel"].at[..., j].multiply(factor)
    c0["bias"] = c0["bias"].at[j].multiply(factor)
    c1["kernel"] = c1["kernel"].at[:, :, j, :].divide(factor)
    return p, j


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", help="write the report's PNG here (needs matplotlib)")
    args = ap.parse_args()
    folder = os.path.dirname(os.path.abspath(args.plot)) if args.plot else None
    if folder and not os.path.isdir(folder):  # said now, not after training and calibrating
        ap.error(f"--plot {args.plot}: its folder {folder} does not exist; create it first")
    t0 = time.perf_counter()
    x_train, x_test, y_train, y_test = load_data()
    model = CNN()
    params, _ = train(model, x_train, y_train)
    f = model.apply
    acc = lambda g, p: accuracy(g(p, x_test), y_test)

    section("1. a model with an outlier channel")
    broken, j = inject_outlier_channel(params)
    float_acc = acc(jax.jit(f), params)
    print(f"float accuracy {float_acc:.2%}; with channel {j} of Conv_0 scaled by {FACTOR:g} "
          f"(and Conv_1 compensating): {acc(jax.jit(f), broken):.2%} (the same function)")
    calib = [(x_train[i * 32:(i + 1) * 32],) for i in range(10)]
    qp = jqt.calibrate(f, jqt.recipes.w8a8(), broken, calib, progress=False)
    q_acc = acc(jax.jit(jqt.quantize(f, qp)), broken)
    print(f"w8a8: {q_acc:.2%} ({(q_acc - float_acc) * 100:+.2f} points)")

    section("2. jqt.report: which op hurts")
    rep = jqt.report(f, qp, broken, (x_test[:128],))
    print(rep)
    if args.plot:
        rep.plot(args.plot)
        print(f"wrote {args.plot}")

    section("3. jqt.sensitivity: the same question, asked of the accuracy")
    metric = lambda g: acc(g, broken)
    sens = jqt.sensitivity(f, qp, metric)
    print(sens)

    section("4. jqt.fallback: meet a budget of 0.5 points")
    fallback = {}
    for to, label in ((None, "float"), (jqt.recipes.w8a16().rules[0], "int16 activations")):
        t = time.perf_counter()
        res = jqt.fallback(f, jqt.recipes.w8a8(), broken, calib, metric, max_drop=BUDGET, to=to)
        print(f"fallback to {label}: {res} ({time.perf_counter() - t:.1f} s)")
        print(f"  recipe's first rule: {res.recipe.rules[0]}")
        again = jqt.calibrate(f, res.recipe, broken, calib, progress=False)
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(again),
                                                        jax.tree_util.tree_leaves(res.qparams)))
        print(f"  jqt.calibrate(f, result.recipe, ...) reproduces the choice: {same}")
        fallback[label] = res
        if not res.met or not same:
            raise SystemExit("FAIL: the fallback did not meet the budget or is not reproducible")

    section("5. calibrators on the broken model (w8a8 static activations)")
    cal_acc = {}
    for cal in (jqt.calibrators.MinMax(), jqt.calibrators.Percentile(99.99), jqt.calibrators.MSE(),
                jqt.calibrators.Entropy()):
        q = jqt.calibrate(f, jqt.recipes.w8a8(calibrator=cal), broken, calib, progress=False)
        cal_acc[type(cal).__name__] = acc(jax.jit(jqt.quantize(f, q)), broken)
        print(f"{type(cal).__name__:<12} {cal_acc[type(cal).__name__]:.2%}")

    worst = rep.worst(1)[0].key
    print(f"\nworst op: {worst}; total {time.perf_counter() - t0:.1f} s")
    sqnr = {r.key: r.sqnr_isolated for r in rep.rows}
    scale = {r.key: r.act_scale for r in rep.rows}
    others = [k for k in sqnr if k != "params/Conv_1/kernel"]
    print_results("debug_accuracy", float_acc=float_acc, w8a8_acc=q_acc, worst_op=worst,
                  conv1_sqnr=sqnr["params/Conv_1/kernel"],
                  other_sqnr_min=min(sqnr[k] for k in others),
                  other_sqnr_max=max(sqnr[k] for k in others),
                  dense_sqnr_min=min(v for k, v in sqnr.items() if "Dense" in k),
                  conv1_act_scale=scale["params/Conv_1/kernel"],
                  other_act_scale_min=min(scale[k] for k in others),
                  other_act_scale_max=max(scale[k] for k in others),
                  output_sqnr=rep.output_sqnr, output_rel_l2=rep.output_rel_l2,
                  conv1_alone_acc=sens.rows[0].alone if sens.rows[0].key == "params/Conv_1/kernel"
                  else None,
                  fallback_float_acc=fallback["float"].metric,
                  fallback_float_trials=len(fallback["float"].trials),
                  fallback_int16_acc=fallback["int16 activations"].metric,
                  fallback_int16_trials=len(fallback["int16 activations"].trials),
                  **{f"{k}_acc": v for k, v in cal_acc.items()})
    if worst != "params/Conv_1/kernel":
        raise SystemExit(f"FAIL: expected params/Conv_1/kernel to rank worst, got {worst}")
    print("OK")


if __name__ == "__main__":
    main()
