"""Thin glue for frameworks whose models are not already functions of a pytree.

flax.linen (``model.apply``), flax.nnx (``nnx.split`` / ``nnx.merge``) and
Equinox (``eqx.partition`` / ``eqx.combine``) need none: their parameters are
pytrees whose paths make readable op keys. Keras 3 keeps its weights in a list
of ``keras.Variable``; :func:`from_keras` turns the model into a function of a
dict keyed by each variable's path, so op keys read ``sequential/dense/kernel`` instead
of a position in that list.

Nothing here imports a framework at import time.
"""
from __future__ import annotations

import collections
import inspect
import os

from . import diagnostics, validate


def from_keras(model, *, training: bool = False):
    """``(f, params)`` for a Keras 3 model on the JAX backend.

    ``params`` is a ``dict`` from each variable's path (``v.path``, e.g.
    ``"sequential/dense/kernel"`` in a ``keras.Sequential`` named ``sequential``) to its value, trainable and non-trainable variables
    alike (so batch-norm statistics are weights too). ``f(params, *inputs)``
    returns ``model.stateless_call(trainable, non_trainable, *inputs,
    training=training)[0]`` (``training`` passed only where the model's ``call`` accepts
    it): the model's outputs as a pure function, ready for
    :func:`jqt.calibrate`, :func:`jqt.quantize` and :func:`jqt.pack`. Updated
    non-trainable variables are dropped: with ``training=True`` (batch-norm statistics)
    silently, with ``training=False`` (a cache a layer assigns) with a warning that
    names them. A model of several
    inputs takes them as Keras does, as one list or dict: ``f(params, [xa, xb])``.

    Keys follow the layer names: name the layers (``Dense(16, name="fc1")``),
    or build the model after ``keras.backend.clear_session()``, for keys that
    do not depend on how many layers were built before in the process.

    Random layers keep a seed state. Keras's dropout and noise layers (``Dropout``,
    ``GaussianNoise``, ...), recurrent layers (their ``dropout``), ``Attention`` and
    ``AdditiveAttention`` (their ``dropout``) and image augmentation (``RandomFlip``,
    ``MixUp``, ...) do not draw with ``training=False``, and theirs is left out
    of ``params`` (f passes its current value). Otherwise (``training=True``, or a layer
    that samples at inference: a VAE's sampling layer, or any subclass of your own, such
    as Monte Carlo dropout) it is a ``uint32`` leaf of
    ``params`` keyed by the layer (``"model/drop/seed_generator_state"``): as with a
    fixed PRNG key in JAX, calls with the same ``params`` draw the same numbers (a
    warning says so); set it from a key for new ones,
    ``params[k] = jax.random.key_data(jax.random.fold_in(key, step))``. Its integer
    leaf is frozen by :func:`jqt.qat.labels` and :func:`jqt.qat.split` (``jax.grad``
    of the whole ``params`` refuses it: differentiate ``split``'s trainable half).
    jqt judges a layer by its class: a Keras ``Dropout`` that a layer of your own calls
    with ``training=True`` (Monte Carlo dropout by composition) is taken as quiet, and
    ``f`` applies one fixed mask; subclass it instead, or use ``training=True``.
    :mod:`jqt.qat` trains every float leaf, non-trainable variables too; to keep
    batch-norm statistics fixed, freeze their keys,
    ``[v.path for v in model.non_trainable_variables]``.

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
    seeds = _seed_keys(model)  # id(state variable) -> (its key, drawn only in training)
    by_id = {id(v): v for v in model.non_trainable_variables}
    # Dropout-like layers do not draw with training=False: their seed states are kept out of
    # params, as they are; any other layer's (one that samples at inference) stays a leaf
    fixed = {by_id[i].path: by_id[i].value for i, (_, quiet) in seeds.items()
             if i in by_id and quiet and not training}
    rename = {by_id[i].path: k for i, (k, _) in seeds.items() if i in by_id and by_id[i].path not in fixed}
    if len(set(rename.values())) != len(rename) or set(rename.values()) & set(trainable):
        rename = {p: p for p in rename}  # two layers' keys met: Keras's own paths
    non_trainable = [rename.get(p, p) for p in non_trainable]
    values = {rename.get(v.path, v.path): v.value
              for v in model.trainable_variables + model.non_trainable_variables}
    params = {p: x for p, x in values.items() if p not in fixed}
    sig = inspect.signature(model.call).parameters.values()
    takes = any(q.name == "training" or q.kind is q.VAR_KEYWORD for q in sig)
    if training and not takes:
        raise ValueError(f"jqt.from_keras(training=True): {type(model).__name__}.call takes no "
                         "'training' argument, and stateless_call calls call directly, so its "
                         "layers cannot be told to run in training mode. Add 'training=None' to "
                         "call and pass it on to the layers that use it, or use training=False.")
    mode = {"training": training} if takes else {}  # passed only where call accepts it

    if rename:
        keys = list(rename.values())
        diagnostics.warn(
            f"jqt.from_keras(training={training}): the random layers' seed states ({keys[:3]}"
            f"{' ...' if len(keys) > 3 else ''}) are uint32 leaves of params and f returns the "
            "outputs only, so every call with the same params draws the same random numbers "
            "(dropout masks, noise), as a fixed PRNG key does in JAX. For new ones on each call, "
            "set them from a key: "
            "params[k] = jax.random.key_data(jax.random.fold_in(key, step)).")

    def f(params, *inputs):
        if isinstance(params, (list, tuple)):  # model.weights, or stateless_call's pair
            raise TypeError(
                f"jqt.from_keras: f's params is a {type(params).__name__} of {len(params)}; pass "
                "the dict jqt.from_keras returned beside f, keyed by variable path (e.g. "
                f"{(trainable + non_trainable + [''])[0]!r}), not model.weights or its values.")
        if isinstance(params, dict) and (missing := [p for p in trainable + non_trainable
                                                     if p not in fixed and p not in params]):
            held = sorted(map(str, params))
            seeds = all(p.endswith("seed_generator_state") for p in missing)
            raise KeyError(
                f"jqt.from_keras: f reads the variable '{missing[0]}' of {model.name!r}"
                f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''}, which params "
                f"lack (they hold {held[:4]}{' ...' if len(held) > 4 else ''}). " + (
                    f"With training={training} params hold the random layers' seed states: pass "
                    "the params of the jqt.from_keras call that made this f." if seeds else
                    "Keras numbers unnamed layers in the order a process builds them (dense_2 "
                    "after dense_1), so a model built again, or built after another, reads other "
                    "keys: name the layers (Dense(16, name='fc1')), or build the model after "
                    "keras.backend.clear_session(), and pass the params of this f."))
        get = lambda p: fixed[p] if p in fixed else params[p]
        # the values as stateless_call holds them (its dtype): a variable it did not assign
        # comes back as the very same array
        nt_in = [keras.ops.convert_to_tensor(get(p), dtype=v.dtype)
                 for p, v in zip(non_trainable, nt_vars)]
        try:
            outputs, nt_out = model.stateless_call([get(p) for p in trainable], nt_in, *inputs, **mode)
        except TypeError as e:
            if len(inputs) > 1 and "multiple values for argument" in str(e):
                e.add_note(f"jqt.from_keras: f got {len(inputs)} input arguments; a Keras model of "
                           "several inputs takes them as one list or dict, as model(...) does: "
                           "f(params, [xa, xb]), and calibration batches [([xa, xb],), ...].")
            raise
        lost = [p for p, a, b in zip(non_trainable, nt_in, nt_out)
                if a is not b and p not in seeded and not p.endswith("seed_generator_state")]
        if lost and not training:  # (training=True: documented, batch-norm statistics)
            diagnostics.warn(
                f"jqt.from_keras: {model.name!r} assigns the non-trainable variable(s) {lost[:3]}"
                f"{' ...' if len(lost) > 3 else ''} when called (a cache or a counter a layer "
                "updates with .assign), and f returns the outputs only: every call starts again "
                "from the values in params, and the updates are lost. Make that state an input "
                "the layer returns (call(x, cache) -> (y, new_cache)), or write f yourself as "
                "model.stateless_call(trainable, non_trainable, x) returning both its results.")
        return outputs

    nt_vars = list(model.non_trainable_variables)
    seeded = set(rename.values()) | set(fixed)  # seed states: the warning above, or quiet
    return f, params


# Keras layers that draw random numbers only with training=True, by the names of their
# classes or of a base class: dropout and noise layers, the recurrent cells (their dropout
# and recurrent_dropout: LSTM, GRU, SimpleRNN, ConvLSTM) and the image augmentation layers
# (RandomFlip, RandAugment, MixUp, ...: identity or deterministic at inference), and
# Attention's (AdditiveAttention's) dropout on the scores ("if training and self.dropout")
_TRAINING_ONLY = frozenset(("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D",
                            "GaussianDropout", "GaussianNoise", "AlphaDropout", "DropoutRNNCell",
                            "BaseImagePreprocessingLayer", "Attention"))


def _draws_only_in_training(layer) -> bool:
    """Whether ``layer``, of one of Keras's own classes, is one of :data:`_TRAINING_ONLY`'s
    kinds. A class of the user's (Monte Carlo dropout: a ``Dropout`` or ``LSTMCell``
    subclass that calls its base with ``training=True``) may draw at inference: its seed
    state stays a leaf, and the warning says so."""
    cls = type(layer)
    return (cls.__module__.split(".")[0] == "keras"
            and any(c.__name__ in _TRAINING_ONLY for c in cls.__mro__))


def _seed_keys(model):
    """``{id(state variable): (key, quiet)}`` for the seed generators of ``model``'s layers,
    keyed by the layer names from the model down (``"model/drop/seed_generator_state"``):
    Keras's own path numbers them in the order they were built in the process. ``quiet``:
    the layer draws only in training (dropout and noise layers, recurrent cells, attention's
    dropout, image augmentation). Found through Keras's
    layer tracking; where a Keras version has none, ``{}`` (Keras's paths)."""
    out = {}

    def walk(layer, prefix):
        name = f"{prefix}/{layer.name}" if prefix else layer.name
        own = list(getattr(layer, "_seed_generators", None) or [])
        for i, g in enumerate(own):
            state = getattr(g, "state", None)
            if state is not None and id(state) not in out:
                out[id(state)] = (f"{name}/seed_generator_state" + (f"#{i}" if i else ""),
                                  _draws_only_in_training(layer))
        children = getattr(layer, "_flatten_layers", None)
        for child in (children(include_self=False, recursive=False) if children else ()):
            walk(child, name)

    walk(model, "")
    return out
