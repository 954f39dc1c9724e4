"""Thin glue for frameworks whose models are not already functions of a pytree.

flax.linen (``model.apply``), flax.nnx (``nnx.split`` / ``nnx.merge``) and
Equinox (``eqx.partition`` / ``eqx.combine``) need none: their parameters are
pytrees whose paths make readable op keys. Keras 3 keeps its weights in a list
of ``keras.Variable``; :func:`from_keras` turns the model into a function of a
dict keyed by each variable's path, so op keys read ``dense/kernel`` instead
of a position in that list.

Nothing here imports a framework at import time.
"""
from __future__ import annotations

import collections
import inspect
import os

from . import validate


def from_keras(model, *, training: bool = False):
    """``(f, params)`` for a Keras 3 model on the JAX backend.

    ``params`` is a ``dict`` from each variable's path (``v.path``, e.g.
    ``"dense/kernel"``) to its value, trainable and non-trainable variables
    alike (so batch-norm statistics are weights too). ``f(params, *inputs)``
    returns ``model.stateless_call(trainable, non_trainable, *inputs,
    training=training)[0]`` (``training`` passed only where the model's ``call`` accepts
    it): the model's outputs as a pure function, ready for
    :func:`jqt.calibrate`, :func:`jqt.quantize` and :func:`jqt.pack`. Updated
    non-trainable variables (``training=True``) are dropped.

    Keys follow the layer names: name the layers (``Dense(16, name="fc1")``),
    or build the model after ``keras.backend.clear_session()``, for keys that
    do not depend on how many layers were built before in the process.

    >>> import os
    >>> os.environ["KERAS_BACKEND"] = "jax"  # before keras is first imported
    >>> import jax, keras, jqt
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, name="fc1"),
    ...                           keras.layers.ReLU(), keras.layers.Dense(2, name="fc2")],
    ...                          name="mlp")
    >>> f, params = jqt.from_keras(model)
    >>> x = jax.random.normal(jax.random.key(0), (16, 4))
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), params, [(x,)], progress=False)
    >>> list(qp)
    ['mlp/fc1/kernel', 'mlp/fc2/kernel']
    >>> y = jax.jit(jqt.quantize(f, qp))(jqt.pack(qp, params), x)
    >>> bool(abs(y - model(x)).max() < 0.05)
    True
    """
    validate.flags("jqt.from_keras", training=training)
    try:
        import keras  # only when asked for: importing keras fixes its backend
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("tensorflow", "torch", "jax", "jaxlib"):
            raise  # keras itself, or another of its dependencies, is missing
        raise ImportError(
            f"jqt.from_keras: importing keras failed ({e}): keras loads the backend "
            f"os.environ['KERAS_BACKEND'] names ({os.environ.get('KERAS_BACKEND', 'tensorflow, its default')}). "
            "Set os.environ['KERAS_BACKEND'] = 'jax' before keras is first imported.") from e

    if keras.backend.backend() != "jax":
        raise ValueError(
            f"jqt.from_keras: keras runs on the '{keras.backend.backend()}' backend; jqt needs "
            "the JAX backend. Set os.environ['KERAS_BACKEND'] = 'jax' before keras is first "
            "imported.")
    if not isinstance(model, keras.layers.Layer):
        raise TypeError(f"jqt.from_keras: model is a {type(model).__name__}; expected a Keras "
                        "model or layer (keras.Model, keras.Sequential, keras.layers.Layer). For a "
                        "JAX function (a flax apply, an Equinox model), pass it to jqt.calibrate "
                        "directly.")
    if not model.built:
        raise ValueError("jqt.from_keras: the model is not built; call it once or build it "
                         "with keras.Input so that its variables exist.")
    trainable = [v.path for v in model.trainable_variables]
    non_trainable = [v.path for v in model.non_trainable_variables]
    dup = [p for p, n in collections.Counter(trainable + non_trainable).items() if n > 1]
    if dup:
        raise ValueError(f"jqt.from_keras: several variables share the path(s) {dup[:5]}; give "
                         "the layers distinct names.")
    params = {v.path: v.value for v in model.trainable_variables + model.non_trainable_variables}
    sig = inspect.signature(model.call).parameters.values()
    takes = any(q.name == "training" or q.kind is q.VAR_KEYWORD for q in sig)
    if training and not takes:
        raise ValueError(f"jqt.from_keras(training=True): {type(model).__name__}.call takes no "
                         "'training' argument, and stateless_call calls call directly, so its "
                         "layers cannot be told to run in training mode. Add 'training=None' to "
                         "call and pass it on to the layers that use it, or use training=False.")
    mode = {"training": training} if takes else {}  # passed only where call accepts it

    def f(params, *inputs):
        outputs, _ = model.stateless_call([params[p] for p in trainable],
                                          [params[p] for p in non_trainable], *inputs, **mode)
        return outputs

    return f, params
