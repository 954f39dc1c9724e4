"""Quantization-aware fine-tuning (QAT): recover the accuracy that low-bit PTQ loses.

    python examples/qat_digits.py

Trains the quickstart CNN on scikit-learn's digits, quantizes it after
training (PTQ) with int4 weights and int2 activations, then fine-tunes the
float weights, the scales and the zero points through the simulated path for
a few epochs, and re-packs. Every accuracy below is the integer path
(``jax.jit(jqt.quantize(f, qparams))``) on packed weights (int4 codes two per
byte, the conv kernels' one per byte).

Exits with an error if the fine-tune recovers less than half of the accuracy
PTQ lost, or if the integer path does not run what the simulated path
trained. Needs the examples extra (``pip install -e .[examples]``); under a minute
on a 2-core CPU.
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quickstart import CNN, accuracy, load_data, print_results, section, train  # noqa: E402

import jqt  # noqa: E402

SEED = 0
W4 = jqt.QuantType(bits=4, symmetric=True, narrow_range=True, per_channel=False)  # int4, per tensor
A2 = jqt.QuantType(bits=2, symmetric=False)   # 4 codes per activation, static per-tensor
A8 = jqt.QuantType(bits=8, symmetric=False)
# int4 weights everywhere, int2 activations except the input image (Conv_0's activation),
# which keeps 8 bits as low-bit networks usually keep their input: in trials, an int2
# input fine-tuned lower and less steadily (docs/fine-tuning.md, "Choosing the recipe";
# set A8 to A2 in the first rule to compare).
RECIPE = jqt.Recipe(rules=(jqt.Rule(key="Conv_0", weight=W4, activation=A8),
                           jqt.Rule(weight=W4, activation=A2)))
EPOCHS, BATCH = 10, 64
# One optimizer per part (jqt.qat.parts). Adam moves a leaf by about its learning rate per
# step whatever the leaf's size, while the scales here span 0.004 (the input's) to 5: so
# the scales' steps are made relative to them (optax.scale_by_param_block_rms multiplies
# a leaf's update by its RMS value): 1% per step for every activation scale (one per op
# here), and of their RMS for a weight's channel scales. Zero points
# are float leaves rounded in the forward pass: 1e-2 moves one code in about 100 steps.
LR_WEIGHTS, LR_SCALES, LR_ZERO_POINTS = 1e-3, 1e-2, 1e-2
MIN_RECOVERY = 0.5     # the fine-tune must win back at least half of what PTQ lost
MAX_MISMATCH = 0.01    # integer vs simulated: at most 1% of test images with other logits


def fine_tune(f, params, qparams, x_train, y_train):
    """QAT: Adam on (params, qparams) through the simulated path; returns the trained pair
    and the mean training loss of each epoch (a list)."""
    relative = optax.chain(optax.adam(LR_SCALES), optax.scale_by_param_block_rms(1e-12))
    tx = optax.multi_transform({"weights": optax.adam(LR_WEIGHTS), "weight_scales": relative,
                                "activation_scales": relative,
                                "zero_points": optax.adam(LR_ZERO_POINTS)},
                               jqt.qat.parts(params, qparams))

    def loss_fn(state, xb, yb):
        p, qp = state
        # quantize is called inside the differentiated function: qp is traced, so it gets
        # gradients (LSQ for scales, straight-through for zero points and weights).
        logits = jqt.quantize(f, qp, simulate=True)(p, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(state, opt_state, xb, yb):
        loss, grads = jax.value_and_grad(loss_fn)(state, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, state)
        p, qp = optax.apply_updates(state, updates)
        # projection after the update: scales >= 1e-8, zero points inside [qmin, qmax]
        return (p, jqt.qat.project(qp)), opt_state, loss

    state = (params, qparams)
    opt_state = tx.init(state)
    rng = np.random.RandomState(SEED)
    epoch_losses = []
    for _ in range(EPOCHS):
        perm = rng.permutation(len(x_train))
        losses = []
        for i in range(0, len(perm) - BATCH + 1, BATCH):
            idx = perm[i:i + BATCH]
            state, opt_state, loss = step(state, opt_state, x_train[idx], y_train[idx])
            losses.append(loss)
        epoch_losses.append(float(jnp.mean(jnp.stack(losses))))
    return state, epoch_losses


def integer_accuracy(f, qparams, params, x, y):
    """Accuracy of the integer path with packed weights, and its logits."""
    logits = jax.jit(jqt.quantize(f, qparams))(jqt.pack(qparams, params), x)
    return accuracy(logits, y), logits


def main():
    t_start = time.perf_counter()
    x_train, x_test, y_train, y_test = load_data()
    model = CNN()
    f = model.apply

    section("1. train a float model (the quickstart CNN)")
    t = time.perf_counter()
    params, _ = train(model, x_train, y_train)
    float_acc = accuracy(jax.jit(f)(params, x_test), y_test)
    t_float = time.perf_counter() - t
    print(f"float test accuracy {float_acc:.2%} ({t_float:.1f} s)")

    section("2. PTQ: int4 weights, int2 activations (input image int8)")
    t = time.perf_counter()
    calib = [(x_train[i * 32:(i + 1) * 32],) for i in range(10)]
    qp0 = jqt.calibrate(f, RECIPE, params, calib, progress=False)
    ptq_acc, _ = integer_accuracy(f, qp0, params, x_test, y_test)
    t_ptq = time.perf_counter() - t
    print(jqt.summarize(qp0))
    print(f"PTQ test accuracy {ptq_acc:.2%} ({t_ptq:.1f} s)")

    section(f"3. QAT: fine-tune weights, scales and zero points ({EPOCHS} epochs)")
    t = time.perf_counter()
    (params1, qp1), epoch_losses = fine_tune(f, params, qp0, x_train, y_train)
    t_qat = time.perf_counter() - t
    print("mean training loss per epoch: " + " ".join(f"{v:.3f}" for v in epoch_losses))
    print(f"{'op':<24}{'act scale':>20}{'act zp':>14}{'weight scale (mean)':>24}")
    for k in qp0:
        a0, a1 = qp0[k].lhs, qp1[k].lhs
        w0, w1 = qp0[k].rhs, qp1[k].rhs
        print(f"{k:<24}{float(a0.scale):>9.4f} -> {float(a1.scale):<7.4f}"
              f"{float(a0.zero_point):>5.0f} -> {float(jnp.round(a1.zero_point)):<5.0f}"
              f"{float(jnp.mean(w0.scale)):>11.5f} -> {float(jnp.mean(w1.scale)):<8.5f}")

    section("4. re-pack and run the integer path")
    qat_acc, logits_int = integer_accuracy(f, qp1, params1, x_test, y_test)
    logits_sim = jax.jit(jqt.quantize(f, qp1, simulate=True))(params1, x_test)
    sim_acc = accuracy(logits_sim, y_test)
    diff = np.abs(np.asarray(logits_int) - np.asarray(logits_sim)).max(axis=-1)
    tol = 1e-4 * float(np.abs(np.asarray(logits_sim)).max())
    mismatch = float((diff > tol).mean())
    print(f"integer (packed) vs simulated after fine-tuning: accuracy {qat_acc:.2%} vs "
          f"{sim_acc:.2%}; max |logit difference| {diff.max():.2e}; test images beyond "
          f"{tol:.1e}: {int((diff > tol).sum())} of {len(diff)}")
    print("(an image whose activation lands within float rounding of a rounding boundary "
          "gets another code on one path: that image's logits move by a code step)")

    section("summary (test accuracy, integer path, packed weights)")
    lost = float_acc - ptq_acc
    won = qat_acc - ptq_acc
    rows = [("float32", f"{float_acc:.2%}", "-", f"{t_float:.1f} s train"),
            ("PTQ  w4 / a2", f"{ptq_acc:.2%}", f"{(ptq_acc - float_acc) * 100:+.2f}",
             f"{t_ptq:.1f} s calibrate + eval"),
            (f"QAT  w4 / a2, {EPOCHS} epochs", f"{qat_acc:.2%}", f"{(qat_acc - float_acc) * 100:+.2f}",
             f"{t_qat:.1f} s fine-tune")]
    header = ("model", "test accuracy", "vs float (pts)", "time")
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(4)]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    recovered = won / lost if lost > 0 else float("nan")
    print(f"recovered {won * 100:.2f} of the {lost * 100:.2f} points PTQ lost ({recovered:.0%}); "
          f"total {time.perf_counter() - t_start:.1f} s")
    print_results("qat_digits", float_acc=float_acc, ptq_acc=ptq_acc, qat_acc=qat_acc,
                  sim_acc=sim_acc, max_logit_diff=float(diff.max()))
    if lost <= 0:
        raise SystemExit("FAIL: PTQ lost no accuracy; this example needs a recipe that does")
    if won < MIN_RECOVERY * lost:
        raise SystemExit(f"FAIL: the fine-tune recovered {recovered:.0%} of the lost accuracy, "
                         f"less than {MIN_RECOVERY:.0%}")
    if mismatch > MAX_MISMATCH:
        raise SystemExit(f"FAIL: integer and simulated paths differ on {mismatch:.1%} of the "
                         "test images after fine-tuning")
    print("OK")


if __name__ == "__main__":
    # no options: --help says what it runs, and a flag meant for another example is refused
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    main()
