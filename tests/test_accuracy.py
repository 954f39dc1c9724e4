"""End-to-end accuracy: a small flax CNN trained on sklearn's digits, quantized with jqt.

The model trains once per module (a few seconds on CPU). Each recipe is then
calibrated on 10 batches of training images and evaluated on the held-out
test split; the quantized accuracy must stay within 1 point of float.
"""
import functools
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jqt


@functools.cache
def quickstart():
    """The README's example (model, data split, training loop), imported so that this test
    checks exactly what the example shows; on first use, not at collection (it imports
    scikit-learn, seconds that every test worker would pay)."""
    examples = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
    if examples not in sys.path:  # quickstart imports jaxpr_utils from its own folder
        sys.path.insert(0, examples)
    return importlib.import_module("quickstart")


# End to end (trains the quickstart CNN): in the slow run, with the examples themselves.
pytestmark = pytest.mark.slow

CALIB_BATCHES, CALIB_BATCH = 10, 32
RECIPES = ("w8a8", "w8a8_dynamic", "w8")


def train(model, x_train, y_train):
    return quickstart().train(model, x_train, y_train)[0]


@pytest.fixture(scope="module")
def trained():
    x_train, x_test, y_train, y_test = quickstart().load_data()
    model = quickstart().CNN()
    params = train(model, x_train, y_train)
    float_acc = quickstart().accuracy(jax.jit(model.apply)(params, x_test), y_test)
    calib = [(x_train[i * CALIB_BATCH:(i + 1) * CALIB_BATCH],) for i in range(CALIB_BATCHES)]
    return dict(model=model, params=params, x_test=x_test, y_test=y_test,
                float_acc=float_acc, calib=calib)


@pytest.fixture(scope="module", params=RECIPES)
def quantized(request, trained):
    recipe = getattr(jqt.recipes, request.param)()
    qp = jqt.calibrate(trained["model"].apply, recipe, trained["params"], trained["calib"],
                       progress=False)
    qf = jax.jit(jqt.quantize(trained["model"].apply, qp))
    return dict(name=request.param, qp=qp, qf=qf)


def test_float_model_trains(trained):
    assert trained["float_acc"] >= 0.95, trained["float_acc"]


def test_quantized_accuracy_within_one_point(trained, quantized):
    q_acc = quickstart().accuracy(quantized["qf"](trained["params"], trained["x_test"]), trained["y_test"])
    f_acc = trained["float_acc"]
    assert q_acc >= f_acc - 0.01, (quantized["name"], f_acc, q_acc)


def test_every_op_quantized(quantized):
    # 2 convs + 2 dense layers, none left float.
    assert len(quantized["qp"]) == 4
    assert all(not p.is_float for p in quantized["qp"].values()), jqt.summarize(quantized["qp"])


def test_packed_matches_float_params(trained, quantized):
    packed = jqt.pack(quantized["qp"], trained["params"])
    assert isinstance(packed, jqt.PackedParams)
    qf, x = quantized["qf"], trained["x_test"]
    from_float = np.asarray(qf(trained["params"], x))
    from_packed = np.asarray(qf(packed, x))
    np.testing.assert_array_equal(from_packed.argmax(-1), from_float.argmax(-1))
    np.testing.assert_allclose(from_packed, from_float, rtol=1e-5, atol=1e-5)


def test_packed_size(trained, quantized):
    qp, params = quantized["qp"], trained["params"]
    packed = jqt.pack(qp, params)
    leaves = jax.tree_util.tree_leaves(params)
    assert set(packed.weights) == set(qp)
    int8_bytes = float32_bytes = 0
    for key, pw in packed.weights.items():
        kernel = leaves[qp[key].source.leaf]  # the float32 leaf this op's weight comes from
        assert pw.values.dtype == jnp.int8, (key, pw.values.dtype)
        assert kernel.dtype == jnp.float32 and kernel.size == pw.values.size, key
        int8_bytes += pw.values.nbytes
        float32_bytes += kernel.nbytes
    assert int8_bytes <= 0.26 * float32_bytes, (int8_bytes, float32_bytes)
    # Everything packed (int8 kernels, int32 sums, float biases) vs all float32 params.
    total_float = sum(x.nbytes for x in leaves)
    assert packed.nbytes() <= 0.26 * total_float, (packed.nbytes(), total_float)
