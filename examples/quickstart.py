"""jqt quickstart: train a small CNN on digits, quantize it to int8, check it still works.

    python examples/quickstart.py

Needs flax, optax and scikit-learn (``pip install -e .[examples]``); uses the
digits dataset bundled with scikit-learn (no download). Runs in about 20 s
on a 2-core CPU. Exits with an error if w8a8 loses more than 1 point of accuracy
or the integer program does not hold one integer op per quantized op.
"""
import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import jqt
from jaxpr_utils import KERNELS, all_eqns, describe, is_int8_kernel

SEED = 0
MAX_DROP = 0.01  # w8a8 may lose at most 1 point of test accuracy


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(32, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = x.reshape(x.shape[:-3] + (-1,))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def load_data():
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1) in [0, 1]
    y = d.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.25, stratify=y, random_state=SEED)


def train(model, x_train, y_train, epochs=10, batch=64, lr=3e-3):
    params = model.init(jax.random.PRNGKey(SEED), x_train[:1])
    tx = optax.adam(lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, xb), yb).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.RandomState(SEED)
    for _ in range(epochs):
        perm = rng.permutation(len(x_train))
        for i in range(0, len(perm) - batch + 1, batch):
            idx = perm[i:i + batch]
            params, opt_state, loss = step(params, opt_state, x_train[idx], y_train[idx])
    return params, float(loss)


def accuracy(logits, y):
    return float((np.asarray(jnp.argmax(logits, -1)) == y).mean())


def section(title):
    print(f"\n== {title} " + "=" * max(0, 70 - len(title)))


def print_results(example, **values):
    """One machine-readable line, ``RESULTS {json}``: what tests/test_examples.py compares
    with docs/results.json, the source of the numbers quoted in the README and the docs."""
    print("RESULTS " + json.dumps({"example": example, **values}, sort_keys=True))


def main():
    t_start = time.perf_counter()
    x_train, x_test, y_train, y_test = load_data()
    model = CNN()

    section("1. train a float model")
    t = time.perf_counter()
    params, loss = train(model, x_train, y_train)
    float_acc = accuracy(jax.jit(model.apply)(params, x_test), y_test)
    print(f"train {len(x_train)} / test {len(x_test)} images; final loss {loss:.4f}; "
          f"float test accuracy {float_acc:.2%} ({time.perf_counter() - t:.1f} s)")

    # Calibration data: 10 batches of 32 training images, each a tuple of the
    # arguments of model.apply that follow the weights.
    calib = [(x_train[i * 32:(i + 1) * 32],) for i in range(10)]

    section("2. calibrate, quantize, evaluate")
    rows, results = [], {}
    for name in ("w8a8", "w8a8_dynamic", "w8"):
        t = time.perf_counter()
        qp = jqt.calibrate(model.apply, getattr(jqt.recipes, name)(), params, calib, progress=False)
        qf = jax.jit(jqt.quantize(model.apply, qp))
        packed = jqt.pack(qp, params)
        acc = accuracy(qf(params, x_test), y_test)
        acc_packed = accuracy(qf(packed, x_test), y_test)
        results[name] = dict(qp=qp, qf=qf, packed=packed, acc=acc, acc_packed=acc_packed)
        rows.append((name, f"{acc:.2%}", f"{acc_packed:.2%}", f"{(acc - float_acc) * 100:+.2f}",
                     f"{time.perf_counter() - t:.1f} s"))
    header = ("recipe", "acc (float params)", "acc (packed)", "delta (pts)", "time")
    table = [("float", f"{float_acc:.2%}", "-", "-", "-")] + rows
    widths = [max(len(str(r[i])) for r in [header] + table) for i in range(len(header))]
    for r in [header] + table:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))

    qp, qf, packed = (results["w8a8"][k] for k in ("qp", "qf", "packed"))

    section("3. what was quantized (w8a8)")
    print(jqt.summarize(qp))

    section("4. packed int8 weights (w8a8)")
    leaves = jax.tree_util.tree_leaves(params)
    int8_bytes = sum(w.values.nbytes for w in packed.weights.values())
    kernel_bytes = sum(leaves[qp[k].source.leaf].nbytes for k in packed.weights)
    total_float = sum(x.nbytes for x in leaves)
    print(f"{'kernel':<24}{'float32 bytes':>14}{'int8 bytes':>12}")
    for k, w in packed.weights.items():
        print(f"{k:<24}{leaves[qp[k].source.leaf].nbytes:>14}{w.values.nbytes:>12}")
    print(f"quantized kernels: {int8_bytes} B int8 vs {kernel_bytes} B float32 "
          f"-> ratio {int8_bytes / kernel_bytes:.3f}")
    print(f"whole model:       {packed.nbytes()} B packed (int8 kernels + int32 sums + float "
          f"biases) vs {total_float} B float32 -> ratio {packed.nbytes() / total_float:.3f}")

    section("5. jit and vmap")
    x = x_test[:8]
    y_jit = qf(packed, x)
    qf_plain = jqt.quantize(model.apply, qp)
    # vmap over 4 groups of 2 images each, weights shared (in_axes=None).
    y_vmap = jax.jit(jax.vmap(qf_plain, in_axes=(None, 0)))(packed, x.reshape(4, 2, 8, 8, 1))
    y_vmap = y_vmap.reshape(8, 10)
    print(f"jit  output {y_jit.shape} {y_jit.dtype}; predictions {np.asarray(y_jit.argmax(-1))}")
    print(f"vmap output {y_vmap.shape} {y_vmap.dtype}; predictions {np.asarray(y_vmap.argmax(-1))}")
    print(f"labels                                 {y_test[:8]}")
    print(f"max |jit - vmap| = {float(jnp.abs(y_jit - y_vmap).max()):.2e}")

    section("6. evidence: the integer kernels in the jaxpr (w8a8, packed weights)")
    # Walk the jaxpr's equations (sub-jaxprs included) and read each operand's type;
    # the printed text of a jaxpr is not parsed (JAX colours it on a terminal).
    int_kernels = n_quant = 0
    for eqn in all_eqns(jax.make_jaxpr(qf_plain)(packed, x)):
        if eqn.primitive is jqt.quantize_p:  # float32 activation -> int8 codes
            n_quant += 1
            print(describe(eqn))
        elif eqn.primitive.name in KERNELS:
            pet = eqn.params.get("preferred_element_type")
            print(f"{describe(eqn)} (preferred_element_type={pet})")
            int_kernels += is_int8_kernel(eqn) and pet == np.int32
    print(f"-> {int_kernels} int8 x int8 -> int32 kernels, {n_quant} activation quantizations "
          "(float32 -> int8)")

    section("summary")
    drop = float_acc - results["w8a8"]["acc"]
    print("  ".join(f"{n}: {r['acc']:.2%}" for n, r in [("float", dict(acc=float_acc))] + list(results.items())))
    print(f"total {time.perf_counter() - t_start:.1f} s")
    print_results("quickstart", float_acc=float_acc,
                  **{f"{n}_acc": r["acc"] for n, r in results.items()},
                  **{f"{n}_packed_acc": r["acc_packed"] for n, r in results.items()},
                  int8_kernel_bytes=int8_bytes, float_kernel_bytes=kernel_bytes,
                  kernel_ratio=int8_bytes / kernel_bytes, model_ratio=packed.nbytes() / total_float,
                  int_kernels=int_kernels)
    if drop > MAX_DROP:
        raise SystemExit(f"FAIL: w8a8 accuracy {results['w8a8']['acc']:.2%} is "
                         f"{drop * 100:.2f} points below float ({float_acc:.2%})")
    if int_kernels != len(qp):
        raise SystemExit(f"FAIL: expected {len(qp)} integer kernels in the jaxpr, found {int_kernels}")
    print("OK")


if __name__ == "__main__":
    # no options: --help says what it runs, and a flag meant for another example is refused
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    main()
