"""``jqt.calibrate``: run the function on data, collect statistics, return qparams."""
from __future__ import annotations

import collections.abc
import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from . import calibrators, codeleaves, compat, diagnostics, numerics as nx
from . import groups, kvcache, outliers, tracing, transforms, validate, weightcheck
from . import stats as stats_lib
from .handlers import Calibrate, conv_products, kept_as_is, step_text, weight_qtype, weight_range_args
from .qparams import OpQParams, QArray
from .recipe import TYPE_FIELDS, Recipe
from .registry import CONTRACTIONS, NAMES as QUANTIZABLE_OPS
from .analysis import CALL, EQUINOX_HIDES
from .dense import safe_k
from .formats import QuantType
from .tracing import Tracer, leaf_names, normalize_argnums


class CalibrationDataError(ValueError):
    """The calibration data cannot be used (empty, NaN/inf, inconsistent structure).

    >>> import jax.numpy as jnp, jqt
    >>> try:
    ...     jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8a8(), jnp.eye(2), [], progress=False)
    ... except jqt.CalibrationDataError as e:
    ...     print(e)
    jqt.calibrate: the calibration set is empty; pass at least one batch, e.g. batches=[(x,)].
    """


def full_args(argnums, params, batch):
    args = list(batch)
    for n, p in sorted(zip(argnums, params), key=lambda np_: np_[0]):  # (2, 0): 0 first
        args.insert(n, p)
    return args


def check_batches(batches, fn="jqt.calibrate"):
    """Raises :class:`CalibrationDataError` where ``batches`` is one array, a dict or a
    string, whose items are not batches (rows, keys, characters)."""
    if hasattr(batches, "shape") or isinstance(batches, (dict, str, bytes)):
        what = (f"an array of shape {tuple(batches.shape)}" if hasattr(batches, "shape")
                else f"a {type(batches).__name__}")
        raise CalibrationDataError(
            f"{fn}: batches is {what}, whose items are not batches; pass a list of tuples of f's "
            "remaining arguments, e.g. batches=[(x,)] for one batch x, [(x, y) for x, y in data] "
            "for several.")
    # (asked without calling iter(): a data loader's iterator may start its workers)
    if not isinstance(batches, collections.abc.Iterable) and not hasattr(batches, "__getitem__"):
        raise CalibrationDataError(
            f"{fn}: batches is {batches!r:.60}, which is not iterable; pass a list of tuples of "
            "f's remaining arguments, e.g. batches=[(x,)], or an iterable of them (a generator, "
            "a data loader: call a loader function to get one).")


def each_batch(batches):
    """``batches`` to iterate over: a sequence whose class has no ``__iter__`` (a
    map-style dataset: ``__len__`` and ``__getitem__``) is read by index up to its
    length, where Python's own iteration reads on until ``IndexError`` (a slice past the
    end gives an empty batch; an index taken modulo the length never ends).

    >>> class Rows:
    ...     def __len__(self): return 2
    ...     def __getitem__(self, i): return (i,)
    >>> list(each_batch(Rows()))
    [(0,), (1,)]
    """
    t = type(batches)
    if not hasattr(t, "__iter__") and hasattr(t, "__len__") and hasattr(t, "__getitem__"):
        return (batches[i] for i in range(len(batches)))
    return batches


def empty_set(fn, batches) -> CalibrationDataError:
    """The error for a calibration set with no batch (``batches`` as given: an iterator
    an earlier call used up is said to be one)."""
    spent = (" (batches is an iterator, and it yields nothing: one that an earlier call "
             "used up? An iterator is read once; pass a list to use the batches again)"
             if isinstance(batches, collections.abc.Iterator) else "")
    return CalibrationDataError(f"{fn}: the calibration set is empty; pass at least one batch, "
                                f"e.g. batches=[(x,)].{spent}")


def check_batch(i, batch, first_tree, fn="jqt.calibrate"):
    """Raises :class:`CalibrationDataError` (its text starting with ``fn``) where batch
    ``i`` is not a tuple of ``f``'s remaining arguments, differs in structure from the
    first (``first_tree``), holds a non-finite array, or is empty (every array empty: an
    empty argument beside others, a graph's edges where it has none, is data); returns its
    tree structure."""
    if not isinstance(batch, (tuple, list)):
        what = (f"an array of shape {tuple(batch.shape)}" if hasattr(batch, "shape")
                else f"a {type(batch).__name__}")
        hint = ""
        if isinstance(batch, dict):  # a loader's keyword batches: f's arguments are positional
            hint = (" Batches pass f's arguments by position, not by keyword: for f(p, x, mask) "
                    "and dict batches d, batches = [(d['x'], d['mask']) for d in loader].")
        elif i == 0 and hasattr(batch, "shape"):
            hint = (" (For one batch (x,) passed as batches itself: batches=[(x,)], a list "
                    "holding one tuple.)")
        raise CalibrationDataError(
            f"{fn}: batch {i} is {what}; each batch must be a tuple "
            f"of the remaining arguments of f, e.g. batches = [(x,) for x in xs].{hint}")
    # a quantized cache (a step's output recorded as a batch) stands for its float buffer
    tree = jax.tree_util.tree_structure(tuple(batch), is_leaf=kvcache.is_cache)
    if first_tree is not None and tree != first_tree:
        raise CalibrationDataError(
            f"{fn}: batch {i} has structure {tree}, but batch 0 had {first_tree}. "
            "Every batch must hold the same arguments.")
    sizes = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tuple(batch))[0]:
        where = f"{fn}: batch {i}, argument {jax.tree_util.keystr(path)}"
        if compat.is_tracer(leaf):
            raise CalibrationDataError(
                f"{where} is a tracer ({type(leaf).__name__}): {fn} runs eagerly on concrete "
                "batches, compiling its own steps; call it outside jax.jit (jax.vmap, jax.grad), "
                "and transform the function jqt.quantize returns instead.")
        why = tracing.untraceable(leaf)
        if why is not None:
            raise CalibrationDataError(f"{where} is {why}." + tracing.untraceable_fix(leaf))
        if isinstance(leaf, (int, float, complex)):  # static, but may scale the data
            leaf = np.asarray(leaf)
        elif tracing.is_static(leaf) or jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            continue  # passed to f as it is (static), or a PRNG key: nothing to observe
        if np.ndim(leaf):  # (a flag or a scale, 0-d, beside empty arrays is no data: below)
            sizes.append((where, leaf.shape, leaf.size))
        if leaf.size == 0:  # a graph without edges: its nodes hold data still
            continue
        a = np.asarray(leaf)
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            continue
        held = jax.dtypes.canonicalize_dtype(a.dtype)  # float64 data is float32 in f (x64 off)
        if held != a.dtype and np.isfinite(a).all():
            with np.errstate(over="ignore"):
                big = int((~np.isfinite(a.astype(held))).sum())
            if big:
                raise CalibrationDataError(
                    f"{where} holds {big} values beyond {held}'s range: JAX holds this "
                    f"{a.dtype} array as {held} (x64 is off), where they are inf. Scale or clip "
                    f"the data into {held}'s range (jnp.finfo(jnp.{held}).max), or enable x64 "
                    "(jax.config.update('jax_enable_x64', True)) if f needs them.")
        if not np.isfinite(a).all():  # bfloat16 too
            data, why = (("calibration data", "statistics from non-finite values would give "
                          "infinite scales") if fn != "jqt.report" else
                         ("batch", "non-finite values make the errors it measures NaN"))
            raise CalibrationDataError(
                f"{where} holds {int((~np.isfinite(a)).sum())} NaN/inf values. Clean the "
                f"{data} ({why}; "
                "every float argument is checked before f runs, whether or not it reaches a "
                "quantized op). Values f handles on purpose: an inf (a running max started at "
                "-inf, an additive mask), pass a large finite value (jnp.finfo(x.dtype).min); "
                "NaN marking missing values, pass them filled (jnp.nan_to_num(x)) and the mask "
                "(jnp.isnan(x)) as another argument of f.")
    if sizes and not any(n for _, _, n in sizes):  # an empty argument beside others is data
        where, shape, _ = sizes[0]
        raise CalibrationDataError(
            f"{where} is empty (shape {shape}), as every array of the batch is; an empty batch "
            "has no statistics. Drop it from the batches.")
    return tree


def note_batch_error(e, fn, i, marked):
    """Notes on ``e``, raised while running ``f`` on batch ``i`` (``marked``: its arguments),
    that batch and its shapes, and the fix where the params and it are on other devices."""
    _note(e, f"{fn}: raised while running f on batch {i} (argument shapes "
          f"{[tuple(np.shape(a)) for a in jax.tree_util.tree_leaves(marked)]})"
          + (": the params and this batch are committed to different devices; put "
             "them on the same ones (jax.device_put), or pass either uncommitted"
             if "incompatible devices" in str(e) else ""))


def _note(e, text):
    """Adds ``text`` to exception ``e``'s message as a note (Python 3.11 and later), once:
    JAX raises one shared instance for some errors (an unwrapped ``checkify.check``), on
    which every failed calibration added its note again."""
    if hasattr(e, "add_note") and text not in getattr(e, "__notes__", ()):
        e.add_note(text)


def _check_same_ops(i, traced, first):
    """Every batch must run the same ops as the first (one set of qparams serves them
    all): a static argument (a Python bool, a string) or a shape may change them.
    ``first``: ``(batch index, its ops, the traces already compared, by id; held, so that
    an id is not reused)``."""
    if first is not None and id(traced) in first[2]:
        return first
    sig = tracing.signature(traced)
    if first is None:
        return (i, sig, {id(traced): traced})
    j, ref, seen = first
    seen[id(traced)] = traced
    if sig != ref:
        a, b = {s[0]: s for s in ref}, {s[0]: s for s in sig}
        diff = sorted(set(a) ^ set(b)) or [k for k in a if a[k] != b.get(k)]
        names = [s.key for s in traced.sites()] + [s.name_stack or "" for s in traced.sites() if s.key in diff]
        cx = [k for k in diff if k in a and k in b and a[k][:-1] == b[k][:-1]]
        # the same op reading the same leaf by other layout ops (a slice to the input's length)
        view = [k for k in diff if k in a and k in b and a[k][:3] == b[k][:3] and a[k][3] and b[k][3]
                and a[k][3][0] == b[k][3][0] and a[k][4:] == b[k][4:]]
        if view and not cx:
            k, (path, was), (_, now) = view[0], a[view[0]][3], b[view[0]][3]
            if [c[0] for c in was] == [c[0] for c in now]:
                was, now = next((step_text(c), step_text(d)) for c, d in zip(was, now) if c != d)
            else:
                was, now = [c[0] for c in was] or "no layout ops", [c[0] for c in now] or "no layout ops"
            raise CalibrationDataError(
                f"jqt.calibrate: op '{k}' reads weight '{path}' by {now} in batch {i} and by {was} "
                f"in batch {j}: the layout op's arguments follow the input's shape (e.g. "
                "p['pos'][:x.shape[0]] for x's rows) or a Python value, so the weight's scales "
                "would be computed for two views of it, and one set of qparams cannot serve "
                "both. Calibrate each shape on its own (one qparams per shape, each called at "
                "its shape), or read the weight the same way at every shape (the whole table, "
                "its rows picked after the op).")
        built = {s.key for t in seen.values() for s in t.sites() if s.built}
        if set(diff) <= built:  # only interpolation matrices: the qparams serve every shape
            raise CalibrationDataError(
                f"jqt.calibrate: batch {i} runs other ops than batch {j} (they differ at "
                f"{diff[:5]}), matrices f builds from iota and constants (jax.image.resize's "
                "interpolation, one per axis whose size the resize changes, so their number "
                "follows the input's shape). They stay float, and qparams calibrated at one "
                "input shape run f at the others: calibrate on batches of one shape (or "
                "calibrate each shape on its own, where their activation ranges differ).")
        why = (f"op '{cx[0]}' reads complex values in one batch and real ones in the other (an "
               "op that reads complex values is kept float, a real one quantized)"
               ) if cx else "its non-array arguments or its shapes change which ops f runs"
        raise CalibrationDataError(
            f"jqt.calibrate: batch {i} runs other ops than batch {j} (they differ at "
            f"{diff[:5]}): {why}, and "
            "one set of qparams cannot serve both. Calibrate each variant on its own (bind the "
            "argument with functools.partial), or give every batch the same values"
            f"{' and dtypes' if cx else ''}.{diagnostics.einsum_order(names)}")
    return first


def _step_fn(tracer, argnums, recipe, mesh, data_axis):
    """One calibration step: (params, batch, observe_weights, decided) -> statistics.

    With a ``mesh``, each device observes its shard of the batch (``shard_map``
    over ``data_axis``) and the shards' statistics are combined with the
    calibrators' own ``combine`` (an all-gather, then a fold)."""
    last = {}

    def local(params_t, batch, observe_weights, decided, transformed):
        args = full_args(argnums, params_t, batch)
        traced = last["traced"] = tracer(args)
        last["names"] = leaf_names(args)
        state = {**transformed, **{k: (qp, None) for k, qp in decided.items()}}
        return traced.run(args, Calibrate(recipe, observe_weights), state)[1]

    from jax.sharding import PartitionSpec as P
    if mesh is None:
        step = local
    else:
        def step(params_t, batch, observe_weights, decided, transformed):
            n_dev = mesh.shape[data_axis]
            # a typed PRNG key of one draw (dropout's) goes whole to every device
            bspec = jax.tree_util.tree_map(lambda x: P() if _one_key(x) else P(data_axis), batch)
            for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
                where = f"jqt.calibrate(mesh=...): batch {last.get('batch', 0)}, argument " \
                        f"{jax.tree_util.keystr(path)}"
                if _one_key(leaf):
                    continue
                if not jnp.ndim(leaf):
                    raise CalibrationDataError(
                        f"{where} is a 0-d array, which has no batch axis to split over the "
                        f"devices of mesh axis '{data_axis}'. Pass it as a Python number (a "
                        "static value) or bind it with functools.partial.")
                if jnp.shape(leaf)[0] % n_dev:
                    raw_key = jnp.shape(leaf) == (2,) and jnp.result_type(leaf) == jnp.uint32
                    raise CalibrationDataError(
                        f"{where} has shape {jnp.shape(leaf)}; its leading (batch) axis must "
                        f"divide evenly over the {n_dev} devices of mesh axis '{data_axis}'. "
                        f"Give every batch a multiple of {n_dev} rows (a loader's last, smaller "
                        "batch: drop it, drop_last=True; padding rows would enter the statistics)."
                        + (" A raw jax.random.PRNGKey? Pass a typed key (jax.random.key(seed)), "
                           "which every device is given whole." if raw_key else ""))

            if compat.explicit_axes(mesh):  # shard_map takes explicitly sharded inputs as they are
                params_t, batch, decided, transformed = _reshard(
                    mesh, (params_t, batch, decided, transformed), (P(), bspec, P(), P()))

            def per_device(params_t, batch, decided, transformed):
                st = local(params_t, batch, observe_weights, decided, transformed)
                gathered = jax.lax.all_gather(st, data_axis)
                n = mesh.shape[data_axis]
                out = jax.tree_util.tree_map(lambda x: x[0], gathered)
                for i in range(1, n):
                    out = stats_lib.combine_all(out, jax.tree_util.tree_map(lambda x, i=i: x[i], gathered))
                return out

            try:
                return jax.shard_map(per_device, mesh=mesh, in_specs=(P(), bspec, P(), P()),
                                     out_specs=P(), check_vma=False)(params_t, batch, decided, transformed)
            except Exception as e:
                if "context mesh" in str(e) or "shard_map" in str(e) and "Manual" in str(e):
                    # f's own jax.shard_map (or mesh axes it names) inside calibrate's per-device
                    # one, where every axis is manual: not a split argument
                    _note(e, "jqt.calibrate(mesh=...) runs f once per device inside a "
                             "jax.shard_map over the whole mesh (every axis manual there), and f "
                             "runs its own jax.shard_map or names mesh axes, which cannot run "
                             "inside it. Leave mesh= out and pass the params and batches placed on "
                             "the devices (jax.device_put with NamedShardings): calibrate then "
                             "runs f as it is, its shard_map included.")
                    raise
                shards = [jnp.shape(x) if _one_key(x) else (jnp.shape(x)[0] // n_dev,) + tuple(jnp.shape(x)[1:])
                          for x in jax.tree_util.tree_leaves(batch)]
                _note(e, f"jqt.calibrate(mesh=...): every batch argument is split along its "
                         f"leading axis over the {n_dev} devices of mesh axis '{data_axis}', so f "
                         f"ran on shapes {shards}; an argument every device needs whole (a "
                         "matrix without a batch axis) cannot be split: bind it with "
                         "functools.partial, or pass it as part of the weights. A PRNG key: "
                         "pass a typed one (jax.random.key(seed), not jax.random.PRNGKey), "
                         "which every device is given whole.")
                raise

    jstep = jax.jit(step, static_argnums=2)
    if mesh is None:
        return jstep, last

    def placed(params_t, batch, observe_weights, decided, transformed):
        # a batch committed elsewhere (a loader's jax.device_put(x, device)) made the jitted
        # step run there, and its shard_map over the mesh refused it, naming the params
        n_dev = mesh.shape[data_axis]
        split = lambda x: _onto(mesh, x, P()) if _one_key(x) else _onto(mesh, x, P(data_axis)) \
            if jnp.ndim(x) and not jnp.shape(x)[0] % n_dev else x  # (else refused by name)
        return jstep(params_t, jax.tree_util.tree_map(split, batch), observe_weights, decided,
                     transformed)

    return placed, last


def _onto(mesh, x, spec):
    """``x`` put on ``mesh`` as ``spec`` says where it is a ``jax.Array`` committed to other
    devices than the mesh's (``jax.device_put(x, device)``); else as it is."""
    if not (isinstance(x, jax.Array) and x.committed) or x.sharding.device_set == set(mesh.devices.flat):
        return x
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))


def _one_key(x) -> bool:
    """A typed PRNG key with no batch axis (``jax.random.key(seed)``)."""
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) \
        and not jnp.ndim(x)


def _reshard(mesh, trees, specs):
    """Each tree's array leaves resharded to its spec on ``mesh`` (``jax.reshard``): one
    ``PartitionSpec`` for the tree, or a tree of them (one per leaf)."""
    from jax.sharding import NamedSharding, PartitionSpec
    put = lambda x, s: jax.reshard(x, NamedSharding(mesh, s))
    return tuple(jax.tree_util.tree_map(lambda x, s=spec: put(x, s), t)
                 if isinstance(spec, PartitionSpec) else jax.tree_util.tree_map(put, t, spec)
                 for t, spec in zip(trees, specs))


# one compiled merge per statistics structure, shared by every calibrate call
_accumulate = jax.jit(stats_lib.accumulate_all)


def _run_pass(jstep, last, params_t, batches, decided, bar_desc, progress, transformed=None):
    items = each_batch(batches)
    try:
        total = len(batches)
    except Exception:  # (no length, or a loader whose __len__ raises: the bar counts, and
        total, items = None, (b for b in items)  # tqdm, which asks again, gets no length)
    from tqdm.auto import tqdm
    bar = tqdm(items, total=total, desc=bar_desc, unit="batch",
               disable=None if progress is None else not progress)
    st, tree, first = None, None, None
    weights_seen = False  # weights are observed until every op has run once
    hosted = False  # statistics merged through the host (compat.together)
    committed = set()  # whether batches' statistics were committed to a device
    statics = set()  # ... and again for a batch of new static values: f(p, x, gain) may
    # compute its weights from them (p["w"] * gain), which are then other weights; where f
    # computes a weight, that one is observed on every batch (p["w"] * x.shape[0] follows
    # the input's shape), in one compiled step per shape as before
    computes = False
    # non-array leaves (a config string f reads) reach f as they are, in params as in a batch
    params_t = tracing.mark_static(params_t)
    for i, batch in enumerate(bar):
        tree = check_batch(i, batch, tree)
        last["batch"] = i  # for the errors raised while tracing its step
        marked = tracing.mark_static(tracing.owned(tuple(batch)))
        static = jax.tree_util.tree_structure(marked)  # holds the static values
        observe = not weights_seen or static not in statics or ("computed" if computes else False)
        try:
            new = jstep(params_t, marked, observe, decided, transformed or {})
        except Exception as e:
            if "checkify.check which was not functionalized" in str(e):
                # (a new error: JAX raises one shared instance, on which notes piled up)
                raise ValueError(
                    f"{bar_desc}: f runs a checkify.check, which JAX compiles only inside "
                    "checkify.checkify, and jqt compiles f (as jax.jit does): calibrate "
                    "cf = checkify.checkify(f) and call jqt.quantize(cf, qparams), which returns "
                    "checkify's (error, output), its error where a check fails on the quantized "
                    f"values. JAX: {e}") from None
            note_batch_error(e, bar_desc, i, marked)
            raise
        statics.add(static)
        first = _check_same_ops(i, last["traced"], first)
        computed = tracing.computed_shapes(last["traced"])
        computes = computes or bool(computed)
        for key, wshape in computed.items():
            last.setdefault("computed", {}).setdefault(key, {}).setdefault(wshape, i)
        if st is not None:  # weight ranges of two shapes do not merge: refused by name
            _check_computed_shapes({k: np.shape(v.weight["min"]) for k, v in st.items()
                                    if getattr(v, "weight", None) is not None},
                                   last.get("computed", {}))
        committed.update(x.committed for x in jax.tree_util.tree_leaves(new) if isinstance(x, jax.Array))
        st, hosted = (new, False) if st is None else compat.merged(_accumulate, st, new, hosted)
        if not weights_seen:
            weights_seen = _weights_seen(last["traced"], st)
    if st is None:
        raise empty_set("jqt.calibrate", batches)
    if committed == {True, False} and not hosted:
        # batches uncommitted (NumPy) and committed to one device: merged there, once
        # through the host, committed to no device (docs/calibration.md)
        st = jax.tree_util.tree_map(
            lambda a: jnp.asarray(np.asarray(a)) if isinstance(a, jax.Array) else a, st)
    return st


def calibrate(f, recipe: Recipe, params, batches, *, weight_argnums=0, progress=None,
              propagate: bool = False, mesh=None, data_axis: str = "data"):
    """Calibrates ``f`` on ``batches`` and returns its quantization parameters.

    Args:
      f: any JAX function; the argument(s) at ``weight_argnums`` hold the weights.
      recipe: a :class:`jqt.Recipe`, e.g. ``jqt.recipes.w8a8()``; each rule's
        calibrators (:mod:`jqt.calibrators`) decide the ranges.
      params: the weights: the weight argument itself, also with ``weight_argnums=(0,)``
        (pass ``p``, not ``(p,)``); a tuple of them when ``weight_argnums`` has several.
      batches: an iterable of tuples of the remaining arguments of ``f``.
      weight_argnums: position(s) of the weight argument(s); default 0.
      progress: show a progress bar (tqdm); ``None`` shows it on a terminal only.
      propagate: error-propagating calibration: calibrate each op's activation
        range on the outputs of the already-quantized ops before it, in
        evaluation order (one pass over ``batches`` per op with a static
        activation range; ``batches`` must be a sequence). Ops under one
        ``lax.scan`` key are calibrated together.
      mesh: data-parallel calibration (a ``jax.sharding.Mesh``): every batch
        argument is split along its leading axis over the ``data_axis`` of
        ``mesh``, each device observes its shard, and the statistics are
        combined across devices.
      data_axis: the axis of ``mesh`` that batches are split over.

    Returns:
      ``dict`` mapping op keys to :class:`jqt.OpQParams` (a pytree).

    Each batch runs one jitted step, compiled once per batch shape (and once more
    for the first batch, whose step also observes the weights). Statistics
    have a fixed size (histograms, not buffers of activations) and are merged
    as batches come, so memory does not grow with the number of batches.

    >>> import jax.numpy as jnp, jqt
    >>> f = lambda w, x: x @ w
    >>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), jnp.ones((3, 2)), [(jnp.ones((4, 3)),)],
    ...                    progress=False)
    >>> list(qp)
    ['w']
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"jqt.calibrate: recipe is a {type(recipe).__name__}; expected a "
                        "jqt.Recipe such as jqt.recipes.w8a8().")
    if mesh is not None:
        validate.check_mesh(mesh, "jqt.calibrate")
    if mesh is not None and (not isinstance(data_axis, str) or data_axis not in mesh.shape):
        one = "" if isinstance(data_axis, str) else "; expected one axis name, a str"
        raise ValueError(f"jqt.calibrate: data_axis={data_axis!r} is not an axis of the mesh "
                         f"(axes {tuple(mesh.shape)}){one}.")
    argnums = normalize_argnums(weight_argnums)
    params_t = validate.weight_args(params, argnums, "jqt.calibrate")
    if mesh is not None:  # params committed elsewhere: the qparams would be on the mesh, and
        # not run with them (a quantized call or jqt.pack mixing the two placements fails)
        away = [x for x in jax.tree_util.tree_leaves(params_t) if isinstance(x, jax.Array)
                and x.committed and x.sharding.device_set != set(mesh.devices.flat)]
        if away:
            raise ValueError(
                f"jqt.calibrate(mesh=...): the params are committed to devices "
                f"{sorted(d.id for d in away[0].sharding.device_set)}, not the mesh's "
                f"{sorted(d.id for d in mesh.devices.flat)}: put them on the mesh, "
                "jax.device_put(params, NamedSharding(mesh, PartitionSpec())), where they and the "
                "qparams then run together, or pass them uncommitted.")
    jstep, last = _step_fn(Tracer(f, argnums, "jqt.calibrate"), argnums, recipe, mesh, data_axis)
    validate.flags("jqt.calibrate", progress=progress, propagate=propagate)
    check_batches(batches)
    sequence = hasattr(batches, "__len__") and hasattr(batches, "__getitem__")
    if propagate and not sequence:
        raise CalibrationDataError(
            "jqt.calibrate(propagate=True) passes over the batches once per op; pass a sequence "
            f"(a list or tuple of batches), not a {type(batches).__name__}.")
    outlier_rules = any(outliers.wants(r) for r in recipe.rules)
    if outlier_rules and not sequence:
        raise CalibrationDataError(
            "jqt.calibrate: a recipe with smooth/awq/rotate passes over the batches twice (the "
            "transforms, then the ranges on the transformed operands); pass a sequence (a list "
            f"or tuple of batches), not a {type(batches).__name__}.")
    with diagnostics.grouped():  # batches with other static values trace f again: once per call
        st = _run_pass(jstep, last, params_t, batches, {}, "jqt.calibrate", progress)
    analyzer = last["traced"].analyzer
    # a buffer a near-miss warning names is not a look-alike too (their advice differs)
    missed = {b for bufs in list(analyzer.near_miss_buffers().values())[:_NEAR_MISSES_SHOWN]
              for b in bufs}
    lookalikes = [l for l in analyzer.cache_lookalikes if l[4] not in missed]
    _warn_unmatched(last["traced"].sites(), recipe, lookalikes, analyzer.warned,
                    _buffers_named(analyzer.near_miss_buffers(), last["names"]), analyzer.jqt_prims,
                    argnums, analyzer.empty_ops,
                    {p: l for p, l in analyzer.carried.items() if p not in analyzer.carried_caches},
                    analyzer.equinox_prims, _code_matrices(last["traced"]))
    tf = {}
    if outlier_rules:
        tf = outliers.decide(last["traced"], recipe, st, params_t, argnums, weight_qtype)
        if tf:
            st = _run_pass(jstep, last, params_t, batches, {}, "jqt.calibrate [transformed]", progress, tf)
    st = _weigh_unreached_layers(last["traced"], recipe, st, params_t, argnums, tf)
    dtypes = _leaf_dtypes(params_t, argnums)
    qparams = with_transforms(finalize(last["traced"], recipe, st, dtypes), tf)
    _check_computed_shapes(_scale_shapes(qparams), last.get("computed", {}))
    if not propagate:
        return weightcheck.record(tie_tables(qparams), params_t, argnums)
    # Error propagation: op k's activation range is re-calibrated with every op
    # before it quantized (ops without a static activation range are final already).
    keys = [s.key for s in last["traced"].sites()]
    order = [k for k in keys if _static_act(qparams[k])]
    decided = {k: p for k, p in qparams.items() if k not in order}
    for j, key in enumerate(order):
        # the first pass saw every op float: re-run for the first static op too where a
        # quantized op (weight-only, dynamic, a lookup) runs before it
        before = keys[:keys.index(key)]
        if j > 0 or any(not decided[k].is_float for k in before if k in decided):
            st_k = _run_pass(jstep, last, params_t, batches, decided, f"jqt.calibrate [{key}]", progress, tf)
            st_k = _weigh_unreached_layers(last["traced"], recipe, st_k, params_t, argnums, tf, {key})
            with diagnostics.captured():  # the first finalize warned already
                new = with_transforms(finalize(last["traced"], recipe, {**st, key: st_k[key]},
                                               dtypes), tf)[key]
            if new.is_float and not qparams[key].is_float:  # not reached in its own pass
                diagnostics.warn(
                    f"jqt.calibrate(propagate=True): op '{key}' ran on no batch once the ops "
                    "before it were quantized (a lax.cond, select or loop whose choice follows "
                    "the values takes another way in the quantized model): it keeps the range "
                    "the first pass, with every op float, gave it. An op that pass never "
                    "reached stays float, warned of above: calibrate with batches that reach "
                    "both ways.")
            else:
                qparams[key] = new
        decided[key] = qparams[key]
    return weightcheck.record(tie_tables(qparams), params_t, argnums)


def _scale_shapes(qparams) -> dict:
    """``{key: shape of its weight's scale}`` of the ops whose weight is quantized."""
    out = {}
    for key, p in qparams.items():
        w = None if p.weight_operand is None else p.operand(p.weight_operand)
        if w is not None and w.scale is not None:
            out[key] = tuple(jnp.shape(w.scale))
    return out


def _check_computed_shapes(scales, shapes):
    """A quantized op (``scales``: ``{key: the shape of its weight's scale or range}``)
    whose weight ``f`` computes in a shape that differs between batches (``shapes``:
    ``{key: {shape: first batch}}``): one set of scales cannot serve both (one scale too:
    the weight's values differ)."""
    for key, seen in shapes.items():
        if len(seen) < 2 or key not in scales:
            continue
        (a, i), (b, j) = list(seen.items())[:2]
        raise CalibrationDataError(
            f"jqt.calibrate: op '{key}' reads a weight f computes (no leaf of params reaches it "
            f"by layout ops alone) whose shape follows the inputs': {a} on batch {i}, {b} on "
            f"batch {j} (a relative-position matrix sized by the sequence length, or a weight "
            "tiled to the batch, jnp.tile(probe, [n, 1, 1]) @ w?). Its scales (shape "
            f"{scales[key]}) cannot serve both. Keep the batch out "
            "of the weight (multiply the untiled weight, and contract the product without a "
            "batch axis: einsum('qd,bkd->bqk', q, k), not q broadcast to the batch), calibrate "
            "once per length (one qparams per length), or keep the op float with a rule ahead "
            f"of the others, jqt.Rule(key='^{re.escape(key)}$', weight=None).")


def _buffers_named(near_misses, names):
    """``[(where, why, buffer names)]`` of :meth:`Analyzer.near_miss_buffers`: an argument
    leaf of ``f`` by its path (``names``, :func:`tracing.leaf_names`), a loop's carry by
    its slot."""
    name = lambda b: (f"argument {names[b[1]]} of f" if b[0] == CALL and b[1] < len(names)
                      else f"a loop's carry slot {b[1]}")
    return [(w, why, [name(b) for b in bufs]) for (w, why), bufs in near_misses.items()]


def _aval_name(aval) -> str:
    """``float32[2, 8, 16]``: an abstract value's dtype and shape, for a message.

    >>> import jax
    >>> _aval_name(jax.ShapeDtypeStruct((2, 8), "float32"))
    'float32[2, 8]'
    """
    return f"{np.dtype(aval.dtype).name}{list(aval.shape)}"


def _longer_contracted(site, shape, ax) -> str:
    """The advice for a weight whose groups are cut short by its innermost contracted axis
    while another contracted axis is longer (an output projection laid out ``(head_dim,
    heads, out)``, einsum ``dhm``: its groups run along ``heads``): where that axis is
    head_dim, lay it out last."""
    if ax is None or site.op == "gather":
        return ""
    ax = ax % len(shape)
    other = max((a for a in site.contract[site.weight_operand] if a != ax),
                key=lambda a: shape[a], default=None)
    if other is None or shape[other] <= shape[ax]:
        return ""
    # jqt cannot tell heads from head_dim: the advice says which case it is for (a
    # (heads, head_dim, out) weight with more heads than head_dim is laid out right)
    return (f"; or, if its axis {other} (length {shape[other]}) is the head_dim of an "
            "attention output projection laid out (head_dim, heads, out) (einsum "
            "'...hd,dhm->...m'), lay it out (heads, head_dim, out) (einsum '...hd,hdm->...m'), "
            "so that the groups run along head_dim")


def _loop_named(who, first) -> str:
    """The loop of a cache look-alike's ``who`` (``"a lax.scan at '<top>' carries"``) for
    the sentence about other loops: "another" where it reads as ``first``'s.

    >>> _loop_named("a lax.scan at '<top>' carries", "a lax.while_loop at '<top>' carries")
    "a lax.scan at '<top>'"
    """
    if not who.endswith(" carries"):  # f's own arguments (a step called from Python)
        return "f's arguments and results"
    return ("another " if who == first else "a ") + who.removeprefix("a ").removesuffix(" carries")


_NEAR_MISSES_SHOWN = 3  # near-miss writes warned of by calibrate, the first ones found


def _special(key: str) -> str:
    """The characters of ``key`` a regular expression reads as its own, quoted: ``'(' ')'``."""
    chars = dict.fromkeys(c for c in key if c in "()[]{}+*?^$|\\")
    return " ".join(repr(c) for c in chars) or "its metacharacters"


def _code_matrices(traced) -> list:
    """The paths of the weights' integer leaves of two or more axes and one byte or less
    an element that f turns into float values (codes of a model quantized before, whose
    f decodes them; not index tables, masks or int32 leaves: ``codeleaves.decoded``)."""
    found = codeleaves.decoded(traced.closed.jaxpr, traced.weight_invars)
    return [p for p in traced.weight_invars.values() if p in found]  # in the leaves' order


def _warn_unmatched(sites, recipe, lookalikes=(), warned=(), near_misses=(), jqt_prims=(),
                    argnums=(0,), empty_ops=0, carried=None, equinox_prims=(), int_matrices=()):
    """Warns of a function without ops to quantize, of one whose ops read no weight from
    the weight argument(s) ``argnums`` (or read weights a loop carries: ``carried``, path ->
    loop), of ops that no rule matches (they stay
    float) and of rules with a ``key``
    of their own that decide no op (a typo in the pattern, or an earlier rule takes
    every op it matches). ``jqt_prims``: jqt's primitives that f runs; ``equinox_prims``:
    Equinox's that hide a cache write or copy (``analysis.EQUINOX_HIDES``);
    ``int_matrices``: the paths of the weights' 8-bit integer matrices f decodes to float."""
    listed = lambda ks: ", ".join(repr(k) for k in ks[:6]) + (f" and {len(ks) - 6} more" if len(ks) > 6 else "")
    if not sites and jqt_prims:  # f is quantized already: the advice below would not apply
        diagnostics.warn(f"jqt.calibrate: f has no op that jqt quantizes, and it runs jqt's own "
                         f"primitives ({', '.join(sorted(jqt_prims))}): it is a function "
                         "jqt.quantize returned, quantized already. Calibrate the float "
                         "function (the f given to jqt.quantize).")
        return
    again = [s.key for s in sites if s.computes_weight]
    if jqt_prims and again:  # the simulated path's fake-quantized weights, decoded 4-bit codes
        diagnostics.warn(f"jqt.calibrate: f runs jqt's own primitives ({', '.join(sorted(jqt_prims))}), "
                         f"and ops whose weight f computes ({listed(again)}): where that weight "
                         "comes from jqt's primitives (a function jqt.quantize returned, with "
                         "simulate=True, or a 4-bit or fp8 weight it decodes), it is quantized "
                         "again. Calibrate the float function (the f given to jqt.quantize).")
    elif again and int_matrices:  # codes f decodes to a float weight (Keras's int4, float8)
        diagnostics.warn(f"jqt.calibrate: ops {listed(again)} read weights f computes, and the "
                         f"weights hold 8-bit integer matrices ({listed(int_matrices)}): if f "
                         "decodes codes to a float weight (a model quantized before: Keras's "
                         "model.quantize('int4'), a 4-bit checkpoint unpacked in f), "
                         "jqt quantizes that decoded weight again, at every call, and jqt.pack "
                         "cannot store it. Calibrate the float model.")
    if not sites and not warned:  # (where the analysis warned, it said why ops stay float)
        diagnostics.warn("jqt.calibrate: f has no op that jqt quantizes (a dot_general or einsum, a "
                         "convolution, an embedding lookup from a weight, a key/value cache write): "
                         "the qparams are empty and jqt.quantize runs f in float. docs/supported-ops.md "
                         "lists the ops; jax.make_jaxpr(f) shows f's."
                         + (f" (Its {empty_ops} op(s) whose weight has no elements, a block of "
                            "width 0, stay float: their products are exact zeros.)"
                            if empty_ops else ""))
        return
    chosen = {s.key: recipe.rule_for(s.op, s.key) for s in sites}
    keys = sorted(chosen)
    data_only = [s.key for s in sites if not s.entry.is_cache]
    two_acts = [s.key for s in sites if not s.entry.is_cache and s.weight_operand is None
                and (chosen[s.key] is None or chosen[s.key].act_x_act is None)]
    if carried and two_acts:  # (not the advice below: the weights are in the argument)
        names = list(carried)
        diagnostics.warn(
            f"jqt.calibrate: weight{'s' if len(names) > 1 else ''} {listed(names)} "
            f"enter{'' if len(names) > 1 else 's'} the carry of {carried[names[0]]}: jqt "
            "follows a weight that a loop body closes over (and a carry the body returns "
            "unchanged, which JAX makes a constant), not one the body copies or changes "
            "(equinox's loops copy their carry), so an op that reads it there reads an "
            "activation and stays float (f's ops that multiply two activations: "
            f"{listed(two_acts)}). Close over the weights in the "
            "loop body instead of carrying them (or set Rule(act_x_act=...) to quantize "
            "these ops as activation x activation).")
    elif (data_only and not warned and all(s.weight_operand is None for s in sites)
            and not any(s.entry.is_cache for s in sites)  # a cache asked for: not weights
            and not any(chosen[k] is not None and chosen[k].act_x_act is not None for k in data_only)):
        where = (f"argument {argnums[0]}" if len(argnums) == 1 else
                 f"arguments {', '.join(map(str, argnums))}")
        diagnostics.warn(f"jqt.calibrate: no op of f reads a weight from its weight {where} "
                         f"(weight_argnums): its {len(data_only)} op(s) ({listed(data_only)}) "
                         "multiply values computed from the other arguments, activation x "
                         "activation ops, and stay float. If f's weights are in another "
                         "argument, pass its position as weight_argnums (a tuple for several, "
                         "weight_argnums=(0, 1), with params a tuple of them), to jqt.calibrate "
                         "and jqt.quantize alike; a rule's act_x_act= quantizes activation x "
                         "activation ops.")
    # (products only: a lookup in a table of integers or bools, a remap or a mask, is no
    # sign of a model quantized before)
    weighted = [s for s in sites if s.weight_operand is not None and not s.entry.is_cache
                and s.op in CONTRACTIONS]
    exact = [s.key for s in weighted
             if all(jnp.issubdtype(v.aval.dtype, jnp.integer) for v in s.eqn.invars[:2])]
    if weighted and len(exact) == len(weighted) and any(chosen[k] is not None for k in exact):
        diagnostics.warn(
            f"jqt.calibrate: every op of f that reads a weight ({listed(exact)}) has integer "
            "operands only (a model quantized before: Keras's model.quantize('int8'), integer "
            "codes in the params): jqt keeps such ops as they are (exact already), so the recipe quantizes "
            "none of them and jqt.pack stores those integers unchanged. Calibrate the float "
            "model.")
    built = {s.key for s in sites if s.built}  # always float: no rule to add for them
    unmatched = [k for k in keys if chosen[k] is None and k not in built]
    if unmatched:
        diagnostics.warn(f"jqt.calibrate: no rule of the recipe matches {len(unmatched)} op(s), which "
                         f"stay float: {listed(unmatched)}. Add a rule for them (a last "
                         "jqt.Rule(key='.*', ...)) if they should be quantized.")
    with diagnostics.grouped():  # a lookup of whole matrices: experts gathered per token
        for s in sites:
            if s.op != "gather" or len(s.contract[0]) < 2 or chosen[s.key] is None \
                    or chosen[s.key].embedding is None:
                continue
            whole = tuple(s.eqn.invars[0].aval.shape[d] for d in s.contract[0])
            gs = chosen[s.key].embedding.group_size
            scales = ("scales per group along each matrix's last axis where the rule's "
                      "group_size fits it (else one group per row, or one per matrix where a "
                      "whole matrix fits a group; jqt.summarize shows which)" if gs
                      else "one scale per matrix")
            diagnostics.warn_grouped("whole", (
                f"jqt.calibrate: op '{s.key}' (gather at '{s.name_stack or '<top>'}') looks up "
                f"whole {whole} matrices of weight '{s.source.path if s.source else '(computed)'}' "
                "by index (a mixture's experts gathered per token, w[expert_ids]?): it is "
                f"quantized as a lookup table, {scales}; a matmul that takes what it gathers as "
                "its weight (an expert's matrix) reads it as an activation and stays float "
                "(unless its rule sets act_x_act=). Write experts as an einsum over the expert axis "
                "('ecd,edf->ecf' on tokens dispatched per expert), lax.ragged_dot or a lax.scan "
                "over the experts, which jqt quantizes per expert and output channel; or keep the "
                f"lookup float, a rule ahead of the others jqt.Rule(key='^{re.escape(s.key)}$', "
                "embedding=None)."), f"'{s.key}'")
    with diagnostics.grouped():  # a per-tensor weight type over stacked members
        for s in sites:
            r = chosen[s.key]
            wt = s.entry.weight_type(r) if r is not None and s.weight_operand is not None else None
            if s.op not in CONTRACTIONS \
                    or wt is None or wt.per_channel:
                continue
            shape, contract = s.eqn.invars[s.weight_operand].aval.shape, s.contract[s.weight_operand]
            if s.op == "ragged_dot_general":  # (G, K, N) experts: one scale for all of them
                if shape[0] > 1:
                    diagnostics.warn_grouped("per_tensor_members", (
                        f"jqt.calibrate: op '{s.key}' (lax.ragged_dot) reads weight "
                        f"'{s.source.path if s.source else '(computed)'}' of shape {tuple(shape)}: "
                        f"{shape[0]} experts, and its rule's weight type is per-tensor "
                        f"({wt.describe()}): one scale for all of them, so an expert of much "
                        "smaller weights rounds to few codes or to 0. Use a per-channel type "
                        "(the presets' default: one scale per expert and output channel)."),
                        f"'{s.key}'")
                continue
            if s.op == "conv_general_dilated":
                # jax.vmap of a conv over stacked kernels folds the members into its output
                # features: a kernel of one axis fewer than its leaf, reshaped
                leaf = getattr(s.source, "shape", None)
                if leaf is None or len(leaf) != len(shape) + 1 \
                        or not any(step[0] == "reshape" for step in s.source.chain):
                    continue
                shape = tuple(leaf)
            free = len(shape) - len(contract) - len(s.batch_axes())  # stacked matrices, not
            # one element per output ('bf,fd->bfd', contracting nothing)
            if s.op == "conv_general_dilated" or contract and free > 0 and (
                    s.batch_axes() or outliers.members(shape, contract) > 1):
                diagnostics.warn_grouped("per_tensor_members", (
                    f"jqt.calibrate: op '{s.key}' reads weight "
                    f"'{s.source.path if s.source else '(computed)'}' of shape {tuple(shape)} as "
                    "stacked matrices (an ensemble's members or experts under jax.vmap, flax "
                    "nn.vmap or an einsum over them; or one layer's heads laid out first, "
                    "(N, D, H), which are one tensor), and its rule's weight type is per-tensor "
                    f"({wt.describe()}): one scale for all of them, so a member of much smaller "
                    "weights rounds to few codes or to 0. Use a per-channel type (the presets' "
                    "default), or a lax.map or lax.scan over the members (one scale each)."),
                    f"'{s.key}'")
    wants_cache = [r for r in recipe.rules if r.kv_cache is not None]
    eqx = sorted(equinox_prims)
    eqx_note = (f" f runs Equinox's {' and '.join(repr(n) for n in eqx)} "
                f"({', '.join(EQUINOX_HIDES[n] for n in eqx)}), which jqt does not take as a "
                "cache write or copy: a cache written through it stays float. Decode with "
                "equinox.internal.while_loop(kind=\"bounded\") without buffers=, "
                "equinox.internal.scan(kind=\"lax\"), or a lax.scan or lax.while_loop "
                "(docs/generate.md).") if eqx else ""
    said_eqx = not (wants_cache and eqx)  # the note, once: in a warning below or on its own
    if wants_cache and not any(s.entry.is_cache for s in sites) and not near_misses:
        said_eqx = True
        diagnostics.warn("jqt.calibrate: the recipe quantizes key/value caches (kv_cache="
                         f"{wants_cache[0].kv_cache.describe()!r}), but no loop of f carries a buffer "
                         "that a dynamic_update_slice or .at[...].set writes whole vectors into and "
                         "an op then reads (attention reads its cache; a buffer that only collects "
                         "outputs is not a cache), and f returns no argument that it writes that way "
                         "and reads (weight arguments aside): every buffer stays float. A cache "
                         "updated only with jnp.where(mask, new, cache), added into (.at[...].add; "
                         "write a zeroed slot with .at[...].set), changed by arithmetic "
                         "(cache * 0), or reset through a lax.cond (lax.cond(new, jnp.zeros_like, "
                         "lambda c: c, cache)), is not written in either form: write it with one of them "
                         "(jnp.where(live, written, cache) after a write, and jnp.where(done, 0.0, "
                         "cache) clearing a slot, keep it a cache). docs/generate.md lists the cache patterns jqt "
                         "finds and those it does not: a write of part of the last axis; a cache a "
                         "jax.shard_map splits along that axis; a cache held in the weights argument "
                         "(weight_argnums: flax variables passed whole, an Equinox module's fields), "
                         "which is a weight to jqt: pass it as an argument of its own; a cache sliced "
                         "per layer or into keys and values and rebuilt with jnp.stack: write into "
                         "the stacked buffer with an index." + eqx_note)
    if wants_cache:
        for where, why, names in near_misses[:_NEAR_MISSES_SHOWN]:
            which = (f"That buffer ({names[0]}) stays" if len(names) == 1 else
                     f"These {len(names)} buffers ({', '.join(names[:6])}"
                     f"{' ...' if len(names) > 6 else ''}) stay")
            note = "" if said_eqx else eqx_note  # (once)
            said_eqx = True
            diagnostics.warn(f"jqt.calibrate: the recipe quantizes key/value caches, but at {where} "
                             f"{why}. {which} float (docs/generate.md)." + note)
    if wants_cache and lookalikes and any(s.entry.is_cache for s in sites):
        loops = {}  # loop id -> (who, [(slot, aval)]): each loop's buffers, named
        for who, where, aval, loop, _ in lookalikes:
            loops.setdefault(loop, (who, []))[1].append((where, aval))
        (who, mine), *others = loops.values()
        where, aval = mine[0]
        if len(mine) == 1:
            which = f"{where} a buffer of the same shape and dtype ({_aval_name(aval)})"
            those = "that buffer stays"
        else:  # slot by slot (keys and values alike): each named
            wheres = ", ".join(dict.fromkeys(w for w, _ in mine))
            kinds = ", ".join(dict.fromkeys(_aval_name(a) for _, a in mine))
            which = f"{len(mine)} buffers of their shape and dtype ({kinds}; {wheres})"
            those = "those buffers stay"
        more = "; ".join(f"{_loop_named(w, who)} ({', '.join(s for s, _ in b)})" for w, b in others[:3]) \
            + (f"; and {len(others) - 3} more loops" if len(others) > 3 else "")
        said_eqx = True
        diagnostics.warn(f"jqt.calibrate: {who} key/value caches that jqt quantizes, and {which} "
                         f"that no cache write (a dynamic_update_slice or .at[...].set of new vectors) "
                         f"updates: {those} float. If such a buffer is updated with "
                         "jnp.where(mask, new, cache), or by adding into its zeroed vectors "
                         "(buf.at[i].set(buf[i] + v): an accumulator to jqt), write it as the "
                         "caches are written to quantize it too; keys and values only read "
                         "(cross-attention over an encoder's output) are no cache and stay float "
                         "(docs/generate.md)."
                         + (f" The same holds for the buffers of {more}." if others else "") + eqx_note)
    if not said_eqx:  # caches found elsewhere (a prefill's lax.scan): the loop Equinox runs
        found = sorted({s.key for s in sites if s.entry.is_cache})  # may be the decode's
        diagnostics.warn(f"jqt.calibrate: the recipe quantizes key/value caches; jqt quantizes "
                         f"those {listed(found)} write, but" + eqx_note)
    for i, r in enumerate(recipe.rules):  # a type its own ops= keep from the ops it names
        for field, prims, what in (("embedding", ("gather",), "lookups"),
                                   ("kv_cache", ("dynamic_update_slice", "scatter"), "cache writes")):
            if getattr(r, field) is None:
                continue
            if set(prims) & set(r.ops):  # its key: one that misses every such op loses the type
                theirs = [s.key for s in sites if s.op in prims and (field == "embedding") != s.entry.is_cache]
                # (said where they all stay float: a preset's rule copied under a key of its
                # own, as examples/minilm.py's, carries the preset's field, and the later
                # rules' types of those ops are the recipe's)
                if theirs and any(c is r for c in chosen.values()) \
                        and not any(re.search(r.key, k) for k in theirs) \
                        and all(chosen[k] is None or getattr(chosen[k], field) is None for k in theirs):
                    hint = "kv_cache_" if field == "kv_cache" else "|".join(re.escape(k) for k in theirs[:3])
                    diagnostics.warn(
                        f"jqt.calibrate: rule {i} ({_named(r)}) sets {field}=, but its key matches "
                        f"none of the {what}, which take keys of their own ({listed(theirs)}) and stay "
                        f"float. To quantize them, widen its key (key={r.key + '|' + hint!r}) or give "
                        f"them a rule of their own (docs/{'generate' if field == 'kv_cache' else 'formats'}.md); "
                        f"to keep them float without this warning, set {field}=None on the rule.")
                continue
            # the ops it names that no earlier rule takes (those it could never have typed)
            later = lambda e: e is None or next(j for j, x in enumerate(recipe.rules) if x is e) > i
            reached = [s.key for s in sites if s.op in prims and re.search(r.key, s.key) and later(chosen[s.key])]
            left = [k for k in reached if chosen[k] is None or getattr(chosen[k], field) is None]
            # or take another rule's type (a preset's after it), this rule's lost without a word
            other = [k for k in reached if k not in left and getattr(chosen[k], field) != getattr(r, field)
                     and any(c is r for c in chosen.values())]  # (a rule of no op: said below)
            if left or other:
                by = sorted({j for k in other for j, e in enumerate(recipe.rules) if e is chosen[k]})
                diagnostics.warn(
                    f"jqt.calibrate: rule {i} (Rule(key={r.key!r})) sets {field}=, but its ops={r.ops} "
                    f"leave out the {what} ({' and '.join(map(repr, prims))}), and the {what} its key "
                    "matches " + " and ".join(
                        ([f"stay float: {listed(left)}"] if left else [])
                        + ([f"take {f'rule {by[0]}' if len(by) == 1 else f'rules {by}'}'s {field}= instead of its "
                            f"{getattr(r, field).describe()}: {listed(other)}"] if other else []))
                    + ". Add " + " and ".join(repr(p) for p in prims if any(
                        s.op == p and s.key in left + other for s in sites)) + " to its ops=.")
    _warn_untyped(sites, recipe, chosen)
    # (a rule keyed to ops that keeps them float is as meant, the whole of f too: the
    # warnings' own advice, Rule(key='^k$', weight=None); a rule of every key is not)
    types = lambda r: any(getattr(r, t) is not None for t in TYPE_FIELDS)
    if keys and not any(r is not None and types(r) for r in chosen.values()) and (
            not any(types(r) for r in recipe.rules)  # a bare Rule(): no type anywhere
            or any(r is not None and r.key != ".*" and _every_key(r.key) for r in chosen.values())):
        diagnostics.warn(
            f"jqt.calibrate: the recipe gives none of f's {len(keys)} op(s) ({listed(keys)}) a "
            "type, so all of them stay float and jqt.quantize runs f in float: the rule that "
            "decides each op (the first whose ops= and key match it) sets no weight=, "
            "activation=, embedding=, act_x_act= or kv_cache=. A Rule() keeps its ops float; "
            "start from a preset (jqt.recipes.w8a8(), ...), or give the rule a type "
            "(jqt.Rule(weight=jqt.QuantType(bits=8)))"
            + _empty_key_hint(recipe.rules, range(len(recipe.rules))) + ".")
    # a rule's position: the first of an object listed twice (the second decides nothing)
    first = {id(e): j for j, e in reversed(list(enumerate(recipe.rules)))}
    used = {first[id(r)] for r in chosen.values() if r is not None}
    for i, r in enumerate(recipe.rules):
        if i in used:
            continue
        # a rule of every key is left unused by the presets' own (a conv rule, no convs),
        # or by a rule for some ops put ahead of a preset's; one that an earlier rule of
        # every key and of all its ops shadows on any function (appended after a
        # preset's) is dead
        taken = [chosen[s.key] for s in sites if r.matches(s.op, s.key)]
        dead = any(_every_key(e.key) and set(r.ops) <= set(e.ops) for e in recipe.rules[:i])
        if r.key == ".*" and not (taken and dead):
            continue
        shadowed = bool(taken)
        others = [s for s in sites if s.op not in r.ops and re.search(r.key, s.key)]
        later = {id(e) for e in recipe.rules[i + 1:] if e.key == r.key}
        if not taken and others and all(id(chosen[s.key]) in later for s in others):
            continue  # one key's rules split by ops= (a preset's, re-keyed: its conv rule)
        other = sorted({f"{s.key!r} ({s.op})" for s in others})
        if shadowed:
            by = sorted({first[id(t)] for t in taken if t is not None})
            why = (f"every op it matches is taken by an earlier rule (rule "
                   f"{', '.join(map(str, by))}), which decides all of their types: the first rule "
                   "matching an op gives it every type (weight, activation, act_x_act, ...); move "
                   "it ahead of them, or set the types it adds on that rule "
                   f"(dataclasses.replace(recipe.rules[{by[0]}], ...))")
            if any(recipe.rules[j] is r for j in by):
                why += f"; it is rule {first[id(r)]} listed again"
            why += _empty_key_hint(recipe.rules, by)
        elif other:  # the key matches, its ops= does not
            why = (f"its key matches {', '.join(other[:6])}, but its ops={r.ops} leave out "
                   "that primitive; add it to ops= (or drop ops= for every op jqt quantizes)")
            if r.ops == ("conv_general_dilated",) and any(
                    s.op != "conv_general_dilated" for s in others):
                why += (". If this rule is a copy of a preset's first rule: a preset with "
                        "symmetric=False puts a rule for convolutions first, with their own "
                        "types (symmetric per channel); copy its last, preset.rules[-1], for "
                        "the other ops instead")
        else:
            why = (f"its key matches none of the op keys ({listed(keys)}); check the pattern "
                   "(jqt.summarize lists the keys)")
            if r.key in keys:  # a key copied as it is, '(' ')' '[' read as the regex's own
                op = next(s.op for s in sites if s.key == r.key)
                why = (f"it is the op key {r.key!r} as jqt.summarize writes it, but a rule's key "
                       "is a regular expression, in which some of its characters (such as "
                       f"{_special(r.key)}) do not match themselves: key={'^' + re.escape(r.key) + '$'!r} "
                       "('^' + re.escape(key) + '$') matches that op"
                       + ("" if op in r.ops else f", a {op}, which its ops={r.ops} leave out too: "
                          "add it to ops="))
            elif lit := [k for k in keys if re.escape(r.key) != r.key and r.key in k]:
                # a part of a key copied as it is (an einsum's 'vmap(sS,Sd->sd)')
                why = (f"it is part of the op key {lit[0]!r} as jqt.summarize writes it, but a "
                       "rule's key is a regular expression, in which some of its characters "
                       f"(such as {_special(r.key)}) do not match themselves: "
                       f"key={re.escape(r.key)!r} (re.escape) matches that op")
            elif re.search(r"\\?\[\d+(?:,\\?\s*\d+)*\\?\]", r.key) and any(s.stack_ids for s in sites):
                why += ("; jqt.report names one layer of a lax.scan over stacked weights "
                        "'key[n]', but the layers share one op key and one rule: match the key "
                        "itself for every layer, or keep that layer out of the scan")
        named = f"key={r.key!r}" if r.key != ".*" else f"ops={r.ops}" + "".join(
            f", {f.name}={v.describe()}" for f in dataclasses.fields(r)  # what tells it apart
            if isinstance(v := getattr(r, f.name), QuantType))
        diagnostics.warn(f"jqt.calibrate: rule {i} (Rule({named})) decides no op: {why}.")


def _warn_untyped(sites, recipe, chosen):
    """Warns of a rule with a key of its own that gives types, yet decides ops that take
    none of them (a lookup takes ``embedding=``, a cache write ``kv_cache=``, an
    activation x activation op ``act_x_act=``, a weight op ``weight=``): they stay float, in
    place of what the rules after it would give them. Named: where the rule types some of
    its ops, the others a later rule would have typed (``Rule(key="embed|mlp", weight=...)``
    ahead of a preset: the lookup ``embed``; ``Rule(key="attn", act_x_act=...)``: the
    projections), and where it types none of its ops, every lookup, cache and activation x
    activation op it decides (and its weight ops, where it sets act_x_act= or kv_cache=
    without embedding=, which every preset's rule sets: a copy of one with weight=None keeps
    them float as meant).
    Not named: ops no type quantizes (a table f builds, integer operands, a lookup of single
    elements), and rules that set no type (they keep their ops float, as meant)."""
    def field(s):
        if s.entry.is_cache:
            return "kv_cache"
        if s.op == "gather":
            return "embedding"
        if s.weight_operand is not None:
            return "weight"
        return "act_x_act" if s.op == "dot_general" else None

    def float_anyway(s, t):  # what _decide keeps float whatever the type: naming it helps nobody
        return s.built or kept_as_is([v.aval.dtype for v in s.eqn.invars]) is not None or (
            s.op == "gather" and not s.contract[0] and (t.per_channel or t.group_size))

    for i, r in enumerate(recipe.rules):
        if not _typed(r) or any(e is r for e in recipe.rules[:i]):
            continue  # a rule of every key (a preset's), one that keeps its ops float, or
            # one listed again (its first listing decides the ops; the second decides none)
        decided = [s for s in sites if chosen[s.key] is r]
        untyped = [(s, field(s)) for s in decided if field(s) and getattr(r, field(s)) is None]
        typed = len(untyped) < len(decided)
        tables = {s.source.path for s in decided if field(s) == "embedding" and r.embedding is not None
                  and s.source is not None}

        # a preset's rule copied with weight=None keeps its weight ops float as meant (every
        # preset's rule sets embedding=, which such a copy keeps; a rule written for
        # attention's products or a cache, act_x_act= or kv_cache= alone, is not one)
        copied = r.embedding is not None or (r.act_x_act is None and r.kv_cache is None)

        def instead(s, f):  # the type the op would have taken without this rule: a later rule's,
            if f == "weight" and (copied if not typed else
                                  r.act_x_act is None and r.kv_cache is None and not (
                                      s.source is not None and s.source.path in tables)):
                return None  # (a rule for attention's products, act_x_act=, is what takes the
            # projections under its key unmeant, also where its key matches no product (the
            # products' keys are their einsum specs, "btd,bsd->bts"), and one whose
            # embedding= types a tied table's lookup the matmul of that table, 'emb#1',
            # under key "emb")
            t = getattr(next((e for e in recipe.rules[i + 1:] if e.matches(s.op, s.key)), None), f, None)
            if t is None and not typed and f not in ("act_x_act", "kv_cache"):  # or, where the
                t = QuantType(bits=8, per_channel=True)  # rule types none of its ops, the one its
            return t  # types were meant as (not products or caches, which presets keep float)

        untyped = [(s, f) for s, f in untyped
                   if (t := instead(s, f)) is not None and not float_anyway(s, t)]
        # where it types none of its ops, the fields it sets reach no op: said first (a key
        # of a name scope, "layer1", is not its weights' keys, "l1/wq"), even where the ops
        # it decides would be float anyway
        # (not for weight ops a rule with weight=None keeps float as meant, as instead())
        meant = [s for s in decided if field(s) != "weight" or r.weight is not None or not copied]
        # (a rule of every key: no key to fix)
        unused = [f for f in TYPE_FIELDS if getattr(r, f) is not None] \
            if not typed and meant and r.key != ".*" else []
        if not (untyped or unused):
            continue
        weights = [s.key for s in sites if field(s) == "weight"][:2]
        # (the hint where its key matches no weight's leaf path: a table's is one)
        hint = ("weight" in unused and weights and not any(s.source is not None for s in meant))
        lead = "" if not unused else (
            f"sets {'= and '.join(unused)}=, which type{'s' if len(unused) == 1 else ''} none of the "
            "ops its key matches" + (" (a weight op's key is its weight's leaf path, such as "
                                     + ", ".join(map(repr, weights)) + ")" if hint else ""))
        if not untyped:
            keys = ", ".join(repr(s.key) for s in meant[:6]) + (" ..." if len(meant) > 6 else "")
            diagnostics.warn(f"jqt.calibrate: rule {i} (Rule(key={r.key!r})) {lead}: the ops it "
                             f"decides ({keys}) take none of its types. Fix the rule's key to match "
                             "the ops its types are for (jqt.summarize lists the keys).")
            continue
        ops = ", ".join(f"'{s.key}' ({f}=)" for s, f in untyped[:6])
        diagnostics.warn(
            f"jqt.calibrate: rule {i} (Rule(key={r.key!r})) {lead + '. It ' if lead else ''}decides "
            f"{len(untyped)} op(s) that take none of its types, which stay float: {ops}"
            f"{' ...' if len(untyped) > 6 else ''}. Each takes its type from the field named (a weight "
            "op's weight from weight=, an embedding lookup's table from embedding=, a cache from "
            "kv_cache=, an activation x activation op from act_x_act=): set it on the rule, or "
            "narrow the rule's key to the ops its types are for.")


def tie_tables(qparams):
    """``qparams`` where a table that an embedding lookup and a matmul both read with one
    type (tied input and output embeddings, the matmul reading it as it is or transposed)
    has one set of weight scales: the matmul takes the lookup's where the two differ in at
    most 1% of their entries. ``WeightMSE`` sums each group's squared error in its
    operand's layout, ``(V, D)`` for the lookup and ``(D, V)`` for ``table.T``; float32 sums
    in another order can settle a near-tie between two clip factors the other way, and
    ``jqt.pack`` then stored the table's codes twice (one group in 262,144 of a
    131072 x 256 table under ``w4``). Scales that differ more (other calibrators, smoothing)
    are left as they are.

    >>> import jax.numpy as jnp, jqt
    >>> f = lambda p, ids: p["emb"][ids] @ p["emb"].T
    >>> qp = jqt.calibrate(f, jqt.recipes.w8(), {"emb": jnp.eye(4)}, [(jnp.arange(2),)], progress=False)
    >>> bool((qp["emb"].lhs.scale == qp["emb#1"].rhs.scale.T).all())
    True
    """
    lookups = {}
    for k, p in qparams.items():
        if p.op == "gather" and p.source is not None and not p.source.chain \
                and p.weight_operand is not None and p.operand(p.weight_operand) is not None:
            lookups.setdefault((p.source.arg, p.source.leaf), k)
    out = dict(qparams)
    for k, p in qparams.items():
        g = None if p.op != "dot_general" or p.source is None else lookups.get((p.source.arg, p.source.leaf))
        chain = () if g is None else p.source.chain
        if g is None or p.smooth is not None or p.rotate or len(chain) > 1 \
                or (chain and chain[0][0] != "transpose"):
            continue
        a, b = qparams[g].operand(qparams[g].weight_operand), p.operand(p.weight_operand)
        if b is None or a.qtype != b.qtype or (a.zero_point is None) != (b.zero_point is None) \
                or any(compat.is_tracer(x) for x in (a.scale, b.scale)):
            continue
        # (one scale per tensor, a scalar: nothing to transpose)
        fit = lambda x: np.transpose(np.asarray(x), chain[0][1]) if chain and np.ndim(x) \
            else np.asarray(x)
        scale = fit(a.scale)
        if scale.shape != np.shape(b.scale):
            continue
        differ = np.mean(scale != np.asarray(b.scale))
        if a.zero_point is not None:
            differ = max(differ, np.mean(fit(a.zero_point) != np.asarray(b.zero_point)))
        if 0 < differ <= 0.01:
            zp = None if a.zero_point is None else jnp.asarray(fit(a.zero_point), jnp.asarray(b.zero_point).dtype)
            side = "lhs" if p.weight_operand == 0 else "rhs"
            out[k] = dataclasses.replace(p, **{side: dataclasses.replace(
                b, scale=jnp.asarray(scale, jnp.asarray(b.scale).dtype), zero_point=zp)})
    return out


def with_transforms(qparams, transforms):
    """``qparams`` with each quantized op's outlier transforms (``outliers.decide``) attached."""
    out = dict(qparams)
    for k, t in transforms.items():
        if k in out and not out[k].is_float:
            out[k] = dataclasses.replace(out[k], smooth=t.smooth, rotate=t.rotate)
    return out


def _static_act(p):
    w = p.weight_operand
    if w is None or p.is_float:
        return False
    a = p.operand(1 - w)
    return a is not None and not a.qtype.dynamic


def _weights_seen(traced, st) -> bool:
    """Whether every op's weight range is known: observed, or (an op under a scan over
    stacked leaves that ran in some layers) to be taken from the weights by
    :func:`_weigh_unreached_layers`, which need no more batches."""
    for site in traced.sites():
        s = st.get(site.key)
        if s is None or s.weight is None:
            continue
        fin = np.isfinite(np.asarray(s.weight["min"]))
        if not (fin.all() or (fin.any() and site.source is not None and site.source.stack_depth)):
            return False
    return True


def _weigh_unreached_layers(traced, recipe, st, params_t, argnums, tf, keys=None):
    """``st`` with the weight ranges an op's weight, a leaf of params, was not observed in
    taken from the weight itself, which needs no data: the layers an op under a scan over
    stacked layers did not run in (a ``lax.cond`` on the layer index: alternating layer
    types), and the whole weight of an op that never ran (a branch not taken) where its
    activation needs no range (weight-only, dynamic, a lookup). Any other op that never
    ran is left as it is (:func:`_decide` warns that it never ran and keeps it float).
    ``keys``: only these ops."""
    out = dict(st)
    for site in traced.sites():
        if keys is not None and site.key not in keys:
            continue
        s, src = st.get(site.key), site.source
        if s is None or s.weight is None or src is None:
            continue
        lo, hi = np.asarray(s.weight["min"]), np.asarray(s.weight["max"])
        unseen = (lo == np.inf) & (hi == -np.inf)
        if not unseen.any() or (not src.stack_depth and not unseen.all()):
            continue
        rule = recipe.rule_for(site.op, site.key)
        if unseen.all():  # never ran: only where no static activation range is wanted
            wt = None if rule is None or site.built else site.entry.weight_type(rule)
            at = None if wt is None else site.entry.act_type(rule)
            if wt is None or (at is not None and not at.dynamic):
                continue
        w = outliers.weight_operand(site, params_t, argnums)
        if w is None:
            continue
        t = tf.get(site.key)
        if t is not None:
            w = transforms.weight(w, t.smooth, t.rotate, site.contract[site.weight_operand], src.stack_depth)
        axes, wt, gaxis = weight_range_args(site, rule, w.shape[src.stack_depth:])
        fn = _layer_ranges(rule.weight_calibrator, None if axes is None else tuple(axes), wt, gaxis,
                           src.stack_depth)
        with groups.naming(f"op '{site.key}' (weight '{src.path}')"):
            got = fn(w)
        wlo, whi = (np.asarray(a, np.float32).reshape(lo.shape) for a in got)
        out[site.key] = stats_lib.SiteStats(s.act, {"min": np.where(unseen, wlo, lo),
                                                    "max": np.where(unseen, whi, hi)},
                                            s.calibrator, s.chan)
    return out


# bounded: keyed by the calibrator, which a user's class may hash by identity (a new one
# each call kept its compiled program and the arrays it holds alive for ever)
@functools.lru_cache(maxsize=64)
def _layer_ranges(calibrator, axes, qtype, gaxis, depth):
    """A jitted ``w -> (lo, hi)``: the weight calibrator's ranges of every layer of ``w``
    (``depth`` stacked axes), as the Calibrate handler observes one layer."""
    fn = lambda v: groups.weight_range(calibrator, v, axes, qtype, gaxis)
    for _ in range(depth):
        fn = jax.vmap(fn)
    return jax.jit(fn)


def finalize(traced, recipe, stats, leaf_dtypes):
    """Statistics -> qparams, one :class:`OpQParams` per op; ``leaf_dtypes``: the dtype of
    each weight leaf, by ``(arg, leaf)`` (:func:`_leaf_dtypes`)."""
    sites = traced.sites()
    rules = {s.key: recipe.rule_for(s.op, s.key) for s in sites}
    prims = {}  # which primitives each rule decides in f (a rule keyed to one conv: convs alone)
    for s in sites:
        prims.setdefault(id(rules[s.key]), set()).add(s.op)
    decided = {}
    with diagnostics.grouped():  # a warning per kind, naming the ops (24 layers: not 24)
        for s in sites:
            r = rules[s.key]
            broad = r is not None and r.ops != (s.op,) and (r.key in (".*", "")
                                                            or prims[id(r)] != {s.op})
            decided[s.key] = _decide(s, r, stats.get(s.key), leaf_dtypes, broad)
    quantized_w = {k for k, p in decided.items() if p.weight_operand is not None
                   and p.operand(p.weight_operand) is not None}
    _warn_zero_constants(sites, decided, quantized_w, stats)
    out = {}
    for s in sites:
        p = decided[s.key]
        if p.source is not None:
            uses = traced.analyzer.leaf_uses.get((p.source.arg, p.source.leaf), set())
            needed = any(u == "float" or u not in quantized_w for u in uses)
            p = dataclasses.replace(p, source=dataclasses.replace(
                p.source, float_needed=needed, contract=s.contract[s.weight_operand],
                batch=s.batch_axes()))
        out[s.key] = p
    return out


def _warn_zero_constants(sites, decided, quantized_w, stats):
    """Warns where a quantized op's weight is an array ``f`` closes over (not a leaf of
    params: ``weightcheck`` warns about those) that was all zeros at calibration: its scale
    is a placeholder (1), on which a value it holds later rounds to 0."""
    for s in sites:
        p, st = decided[s.key], stats.get(s.key)
        if (s.key not in quantized_w or p.source is not None or s.built or s.zero or st is None
                or st.weight is None or not weightcheck.zero_below(p)):
            continue
        lo, hi = np.asarray(st.weight["min"]), np.asarray(st.weight["max"])
        if lo.size and not lo.any() and not hi.any():
            diagnostics.warn_grouped(
                ("zero constant",),
                f"jqt.calibrate: op '{s.key}' (at '{s.name_stack or '<top>'}') reads a weight f "
                "closes over (an array bound with functools.partial or captured, not a leaf of "
                "params), which is all zeros: it has no range, so its scale is a placeholder "
                f"(1), on which any value {weightcheck.zero_below(p)} rounds to 0, and f "
                "re-bound to trained values (a LoRA adapter's B, zeros at initialisation) "
                "computes with those zeros. Pass it as an argument of f that is not a weight "
                "argument (docs/fine-tuning.md, QLoRA), where it stays float, or calibrate "
                "with its trained values.", f"'{s.key}'")


def _one_value(a, rule, key):
    """``a`` (an end of a calibrator's range) as a float32 scalar, refused unless it holds
    one value: static activations take one range per tensor (per layer, stacked)."""
    if np.size(a) != 1:
        raise ValueError(
            f"jqt.calibrate: op '{key}': calibrator {type(rule.calibrator).__name__}'s "
            f"range(stats, qtype) returned an end of shape {np.shape(a)}: it returns two scalars "
            "(lo, hi), one range for the whole activation (static activations are per tensor; "
            "per-token scales are dynamic=True).")
    try:
        return np.float32(np.reshape(a, ()))
    except (TypeError, ValueError):
        raise TypeError(f"jqt.calibrate: op '{key}': calibrator {type(rule.calibrator).__name__}'s "
                        f"range(stats, qtype) returned an end {_brief(a)}, not a number: it "
                        "returns two numbers (lo, hi).") from None


def _brief(a) -> str:
    text = repr(a)
    return text if len(text) <= 60 else text[:57] + "..."


def _pair(out, what):
    """A calibrator's ``range`` result as ``(lo, hi)``, refused naming ``what`` (the
    calibrator and the call) unless it is a pair."""
    try:
        lo, hi = out
    except (TypeError, ValueError):
        raise TypeError(f"jqt.calibrate: {what} returned {_brief(out)}; it returns a pair "
                        "(lo, hi).") from None
    return lo, hi


def _act_range(rule, act_stats, qtype, key="?"):
    """The calibrator's range; for stacked statistics (an op under a ``lax.scan``
    over layers) one range per layer, stacked."""
    stacked = stats_lib.stack_depth(rule.calibrator, act_stats)
    what = f"op '{key}': calibrator {type(rule.calibrator).__name__}'s range(stats, qtype)"
    # (writable NumPy copies, stacked or not, as docs/calibration.md says range runs on the
    # host: a range written on one kind failed on the other)
    if stacked == 0:
        lo, hi = _pair(rule.calibrator.range(jax.tree_util.tree_map(np.array, act_stats), qtype),
                       what)
        return _one_value(lo, rule, key), _one_value(hi, rule, key)
    flat = jax.tree_util.tree_map(lambda x: np.asarray(x).reshape((-1,) + x.shape[stacked:]), act_stats)
    n = jax.tree_util.tree_leaves(flat)[0].shape[0]
    shape = jax.tree_util.tree_leaves(act_stats)[0].shape[:stacked]
    pairs = [tuple(_one_value(e, rule, key) for e in _pair(rule.calibrator.range(
        jax.tree_util.tree_map(lambda x, i=i: np.array(x[i]), flat), qtype), what)) for i in range(n)]
    lo = np.array([p[0] for p in pairs], np.float32).reshape(shape)
    hi = np.array([p[1] for p in pairs], np.float32).reshape(shape)
    return lo, hi


def _leaf_dtypes(params_t, argnums):
    """``{(arg, leaf): dtype}`` of the weight arguments' float array leaves (a
    :class:`WeightSource`'s ``arg`` and ``leaf``), as JAX traces them (a NumPy float64
    leaf is float32 without x64); PRNG keys, NumPy scalar types and other leaves are left
    out."""
    return {(a, j): np.dtype(jax.dtypes.canonicalize_dtype(x.dtype))
            for a, p in zip(argnums, params_t) for j, x in enumerate(jax.tree_util.tree_leaves(p))
            if isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(x.dtype, jnp.floating)}


def _channel_bytes(wt, contracted, packed_along=None):
    """``(bytes, groups)``: the bytes :func:`jqt.pack` stores per output channel (row of a
    table) of ``contracted`` elements under weight type ``wt``, and how many scales they
    take (``packed_along``: the length of the axis its codes pack along, 0 for none;
    ``contracted`` by default). The codes (two per byte where they pack as nibbles) and a float32 scale per
    group (and zero point where asymmetric); not the int32 sums an asymmetric activation
    adds (a float32 weight of 2 inputs under ``w8a8`` is quantized).

    >>> import jqt
    >>> _channel_bytes(jqt.recipes.INT8_WEIGHT, 2)   # 2 codes and a scale; one group
    (6, 1)
    """
    g = wt.group_size
    groups = contracted // g if g and g < contracted and contracted % g == 0 else 1
    along = contracted if packed_along is None else packed_along
    codes = contracted / 2 if along and wt.nibbles_fit(along) else contracted * wt.storage.itemsize
    return codes + groups * (4 if wt.symmetric else 8), groups


def _every_key(key):
    """Whether a rule's ``key`` matches every op key of any function: ``".*"``, or a pattern
    that matches the empty string with no anchor or lookaround (``"a|"``, ``""``; not
    ``"^(?!.*head)"``, every key but the head's, nor ``"^$"``)."""
    if key == ".*":
        return True
    if re.search(r"[\^$]|\\[AZbB]|\(\?<?[=!]", key):
        return False
    try:
        return re.search(key, "") is not None
    except re.error:
        return False


def _empty_key_hint(rules, among):
    """``"; rule j's key ... matches the empty string ..."`` for the first rule ``j`` of
    ``among`` whose key (not ``".*"``) matches every key as a typo would (:func:`_every_key`),
    or ``""``."""
    j = next((j for j in among if rules[j].key != ".*" and _every_key(rules[j].key)), None)
    return "" if j is None else (f"; rule {j}'s key {rules[j].key!r} matches the empty string, "
                                 "so every op key (a trailing '|'?)")


def _typed(rule):
    """Whether ``rule`` gives some type (one that gives none keeps its ops float, as meant:
    ``jqt.fallback``'s) and has a key of its own or gives no ``weight=`` (a rule of every
    key that gives one is a preset's; one that gives only ``act_x_act=``, ``embedding=``
    or ``kv_cache=`` decides every weight op it matches, ahead of the rules after it)."""
    return (rule.key != ".*" or rule.weight is None) and any(
        getattr(rule, t) is not None for t in TYPE_FIELDS)


def _named(rule):
    """``Rule(key=...)`` for a note, a long key cut short, with its ``ops=`` where it
    names some (two rules of one key told apart).

    >>> from jqt._src.recipe import Rule
    >>> _named(Rule()), _named(Rule(ops=("conv_general_dilated",)))
    ("Rule(key='.*')", "Rule(key='.*', ops=('conv_general_dilated',))")
    """
    k = rule.key if len(rule.key) <= 48 else rule.key[:45] + "..."
    ops = "" if tuple(rule.ops) == QUANTIZABLE_OPS else f", ops={tuple(rule.ops)!r}"
    return f"Rule(key={k!r}{ops})"


def _decide(site, rule, st, leaf_dtypes, broad=True):
    """``site``'s qparams under ``rule``; ``broad``: the rule is for other primitives too
    (every op, as a preset's, or ops of another primitive in ``f``), where a convolution
    asked for groups takes one scale per output channel without a warning."""
    base = dict(op=site.op, weight_operand=site.weight_operand, source=site.source)
    float_ = lambda note: OpQParams(lhs=None, rhs=None, note=note, **base)
    if site.built:  # whatever the rule: its entry's note marks it (validate.check_keys)
        why = kept_as_is([v.aval.dtype for v in site.eqn.invars])
        return float_(f"{validate.BUILT_NOTE}; {why}" if why is not None else
                      f"{validate.BUILT_NOTE} "
                      "(jax.image.resize's interpolation, a patch filter, a DFT, or values "
                      "drawn from a literal PRNG key: weights initialised inside f, missing "
                      "from params?), not a leaf of params; pass it in params to quantize it")
    if rule is None:
        return float_("no rule of the recipe matches this op")
    if site.entry.is_cache:
        if rule.kv_cache is None:
            return float_(f"key/value cache kept float by the rule {_named(rule)}, which "
                          "sets no kv_cache=" if rule.key != ".*" else
                          "key/value cache kept float (kv_cache=True on a preset, or a rule with "
                          "kv_cache= whose key matches this op's, quantizes it)")
        return OpQParams(lhs=QArray(qtype=rule.kv_cache), rhs=None, **base)
    why = kept_as_is([v.aval.dtype for v in site.eqn.invars])
    if why is not None:
        return float_(why)
    w = site.weight_operand
    if w is None:
        if site.op != "dot_general":  # act_x_act does not apply
            return float_("conv with a data-dependent kernel is kept float (a conv's weight is "
                          "quantized as its kernel, the rhs)")
        if rule.act_x_act is None:
            return float_(f"activation x activation op kept float by the rule {_named(rule)}, "
                          "which sets no act_x_act=" if _typed(rule) else
                          "activation x activation op kept float by a rule of its key, which sets "
                          "no type" if rule.key != ".*" else
                          "activation x activation op, no operand from the weight argument(s) "
                          "alone (set Rule(act_x_act=...) to quantize)")
        # no contracted axis, not a contracted length of 1: attention calibrated on one-token
        # batches contracts its keys' length 1 there and longer ones later (it stayed float)
        if not site.contract[0] and rule.act_x_act.per_channel:
            return float_("activation x activation op that contracts no axis (a gate times an "
                          "expert's outputs, an einsum 'te,td->etd'): one dynamic scale per row "
                          "is one per element, which quantizes nothing (a rule's per-tensor "
                          "act_x_act= type, per_channel=False, quantizes it)")
        q = QArray(qtype=rule.act_x_act)
        return _narrow(site, rule, OpQParams(lhs=q, rhs=q, **base))
    wt = site.entry.weight_type(rule)
    if wt is None:
        return float_(f"the recipe keeps it float (the rule {_named(rule)} sets no "
                      f"{'embedding' if site.op == 'gather' else 'weight'}=)"
                      if _typed(rule) else "the recipe keeps it float")
    if site.op == "gather" and not site.contract[0] and (wt.per_channel or wt.group_size):
        shape, sizes = site.eqn.invars[0].aval.shape, site.eqn.params["slice_sizes"]
        part = [d for d in range(len(shape)) if 1 < sizes[d] < shape[d]]
        if part:  # t[ids, :k]: several elements of each row, not the whole row
            d = part[-1]
            diagnostics.warn_grouped(
                "part_rows", f"jqt.calibrate: op '{site.key}' (a lookup at "
                f"'{site.name_stack or '<top>'}') reads {sizes[d]} of the {shape[d]} elements of "
                f"each row of its table along axis {d} (t[ids, a:b], or t[i, a:b] at a scalar "
                "index) and stays float: jqt quantizes a lookup that reads whole rows. Look the "
                "rows up and slice them after the lookup (t[ids][..., a:b], t[i][a:b]) to "
                "quantize it, or keep it float without "
                f"this warning: jqt.Rule(key='^{re.escape(site.key)}$', embedding=None) ahead of "
                "the recipe's rules.", f"'{site.key}'")
            return float_(f"a lookup of part of each row ({sizes[d]} of {shape[d]} elements "
                          f"along axis {d} read, t[ids, a:b]) is kept float; jqt quantizes "
                          "lookups of whole rows (t[ids][..., a:b] reads them)")
        return float_("a lookup of single elements (b[ids] of a 1-D table, t[ids, j], "
                      "t[ids[:, None], cols]) is kept float: jqt quantizes lookups of whole rows "
                      "(t[ids], then t[ids][:, cols] picks the columns), and one scale per element "
                      "of a 1-D table would store more than the table (a rule's per-tensor "
                      "embedding= type, per_channel=False, quantizes it)")
    contracted = math.prod(site.eqn.invars[w].aval.shape[a] for a in site.contract[w])
    if site.op != "gather" and contracted <= 1 and (wt.per_channel or wt.group_size):
        return float_("each output reads one weight element (a Dense on one input feature, "
                      "an einsum that contracts no axis, 'bf,fd->bfd'): one scale per element "
                      "would store more than the float weight (a rule's per-tensor weight type, "
                      "per_channel=False, quantizes it)")
    if site.op == "conv_general_dilated" and site.eqn.params.get("batch_group_count", 1) != 1:
        diagnostics.warn_grouped(
            "batch_groups", f"jqt.calibrate: op '{site.key}' (conv_general_dilated at "
            f"'{site.name_stack or '<top>'}', batch_group_count="
            f"{site.eqn.params['batch_group_count']}) stays float: jqt has no integer rule for a "
            "convolution with batch_group_count > 1. To keep it float without this warning, put "
            f"jqt.Rule(key='^{re.escape(site.key)}$', weight=None) ahead of the recipe's rules.",
            f"'{site.key}'")
        return float_("conv with batch_group_count > 1 is kept float")
    if site.op == "conv_general_dilated" and (w != 1 or not wt.symmetric):
        if w != 1:
            return float_("conv whose data operand is the kernel is kept float")
        fix = ("Give its weight symmetric=True: dataclasses.replace(rule, weight="
               "dataclasses.replace(rule.weight, symmetric=True))"
               if tuple(rule.ops or ()) == ("conv_general_dilated",) else
               "Put a rule for convs ahead of it: jqt.Rule(ops=('conv_general_dilated',), "
               "weight=jqt.QuantType(..., symmetric=True)), as the presets with "
               "symmetric=False do")
        raise ValueError(f"jqt: op '{site.key}' is a conv; conv weights must be symmetric, but "
                         f"the rule {_named(rule)} gives it {wt.describe()}. {fix}.")
    at = site.entry.act_type(rule)
    if site.op == "conv_general_dilated" and wt.kind == "int" and at is not None and at.kind == "int":
        # (int16 activations run as two int8 kernels, the low half with an offset)
        k = conv_products(site.eqn)
        kc = safe_k(np.int8 if at.bits > 8 else at, at.bits > 8 or not at.symmetric,
                    np.int8 if wt.bits > 8 else wt, not wt.symmetric)
        if k > kc:
            diagnostics.warn_grouped(
                ("long_conv", kc), f"jqt.calibrate: op '{site.key}' (conv_general_dilated at "
                f"'{site.name_stack or '<top>'}') stays float: each output sums {k} products "
                f"of codes, more than the {kc} whose worst case fits an int32 accumulator "
                f"({at.describe()} activations x {wt.describe()} weights). Quantize it weight-only "
                f"(jqt.Rule(key='^{re.escape(site.key)}$', activation=None) ahead of the recipe's "
                "rules), or give it a smaller kernel or fewer input channels per group.",
                f"'{site.key}'")
            return float_(f"a convolution that sums {k} products of codes per output, more than "
                          f"the {kc} an int32 accumulator holds at worst, is kept float")
    # the weight as params hold it (a float32 leaf cast to bfloat16 at the op is stored float32)
    src = site.source
    dtype = np.dtype(leaf_dtypes.get((src.arg, src.leaf), site.eqn.invars[w].aval.dtype)
                     if src is not None else site.eqn.invars[w].aval.dtype)
    if (wt.per_channel or wt.group_size) and jnp.issubdtype(dtype, jnp.floating):
        shape = site.eqn.invars[w].aval.shape  # the groups it gets (those that tile an axis)
        grouped = lambda g: weight_qtype(site, dataclasses.replace(wt, group_size=g), shape)
        along = site.entry.packed_along(shape, site.contract[w], site.batch_axes())
        qbytes, groups = _channel_bytes(grouped(wt.group_size), contracted, along)
        fbytes = contracted * dtype.itemsize
        if qbytes > fbytes:
            what = "row of the table" if site.op == "gather" else "output channel"
            # groups too small: the smallest group length it takes that fits (or one scale
            # per channel), or a per-tensor type where one scale is too many
            small = lambda g: _channel_bytes(grouped(g), contracted, along)[0] <= fbytes
            fits = next((g for g in range(wt.group_size + 1, contracted) if grouped(g).group_size == g
                         and small(g)), 0 if small(0) else None) if groups > 1 else None
            fix = ("a rule's per-tensor type, per_channel=False, quantizes it" if fits is None else
                   f"group_size={fits}" + (f" (one scale per {what.split(' of ')[0]})" if not fits else "")
                   + " quantizes it")
            if fits is not None:
                taken = grouped(wt.group_size).group_size  # (along one axis of several)
                diagnostics.warn_grouped(
                    ("groups_outweigh", wt.group_size, fits), f"jqt.calibrate: op '{site.key}' "
                    f"({site.op} at '{site.name_stack or '<top>'}') stays float: group_size="
                    f"{wt.group_size}" + (f", which this op takes as group_size={taken} (groups "
                    "do not span its contracted axes)," if taken != wt.group_size else "")
                    + f" gives each {what} of {contracted} elements {groups} float32 "
                    f"scales{'' if wt.symmetric else ' and zero points'}, whose bytes with the codes "
                    f"({qbytes:g}) exceed the {dtype} weight's ({fbytes}); {fix}.", f"'{site.key}'")
            return float_(f"each {what} holds {contracted} weight elements: their codes and "
                          f"float32 scale{'s' if groups > 1 else ''}"
                          f"{(' and zero point' + ('s' if groups > 1 else '')) if not wt.symmetric else ''} "
                          f"({qbytes:g} bytes) would store more than the {dtype} weight "
                          f"({fbytes} bytes), so the op is kept float ({fix})")
    never = (f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}') "
             "never ran on the calibration data (a lax.cond branch that was not taken, a "
             "while_loop that did not iterate, a lax.scan of length 0, an activation of no "
             "elements, a lax.ragged_dot whose group_sizes were all 0?); it stays float. "
             "Add calibration data that reaches it.")
    unreached = "never reached during calibration"
    if site.platforms != ():
        branch = ("the default branch" if site.platforms is None
                  else f"the branch for {'/'.join(site.platforms)}")
        never = (f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}') "
                 f"is in {branch} of a lax.platform_dependent, which calibration did not run: "
                 "it runs only the branch of the platform it runs on. The op stays float (a "
                 "jax.export for that platform computes it in float, its weight kept float "
                 "by jqt.pack). To quantize it, calibrate on that platform (those qparams "
                 "quantize its branch), or move the matmul out of lax.platform_dependent so "
                 "that every platform runs it; to keep it float without this "
                 f"warning, put jqt.Rule(key='^{re.escape(site.key)}$', weight=None) ahead of "
                 "the recipe's rules.")
        unreached = f"in {branch} of a lax.platform_dependent: not run by calibration"
    if st is not None and st.weight is not None:
        _check_weight_finite(site, np.asarray(st.weight["min"]), np.asarray(st.weight["max"]), rule)
        _check_order(site, np.asarray(st.weight["min"]), np.asarray(st.weight["max"]),
                     f"weight calibrator {type(rule.weight_calibrator).__name__}", "w, axes, qtype")
    if st is None or st.weight is None or not np.isfinite(np.asarray(st.weight["min"])).all():
        seen = (np.isfinite(np.asarray(st.weight["min"])) if st is not None and st.weight is not None
                else np.zeros(0, bool))
        if seen.any():  # some iterations of a loop ran it (a lax.cond on the layer index)
            layers = seen.reshape(seen.shape[0], -1).all(axis=1) if seen.ndim else seen
            diagnostics.warn_grouped("partly", (
                f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}') "
                f"ran in {int(layers.sum())} of the {layers.size} iterations of its loop over "
                "stacked layers on the calibration data (a lax.cond or lax.switch on the layer "
                "index?), and its weight is no slice of a params leaf (computed in f, or "
                "read at the loop's index), so jqt cannot take the other layers' ranges from "
                "the params: it stays float. Pass the stacked weights in the scan's xs, "
                "lax.scan(body, h, (w, u, jnp.arange(L))), and read each layer's slice in "
                "the branch."), f"'{site.key}'")
            return float_("ran in some layers only, its weight computed in f")
        diagnostics.warn_grouped("never", never, f"'{site.key}'")
        return float_(unreached)
    shape = site.eqn.invars[w].aval.shape
    eff = weight_qtype(site, wt, shape)
    ax = site.entry.groups(site)
    k = math.prod(shape[a] for a in site.contract[w])
    # silent where per channel is what the rule means: an op that takes no groups under a
    # rule for more ops than it (a preset's; convs are per output channel), or a weight
    # whose whole contracted size fits one group (a LoRA factor of rank 4 under g16)
    quiet = (ax is None and broad) or (ax is not None and k <= wt.group_size)
    if eff != wt and not quiet:
        # (a lookup's groups run along what each lookup reads: a row, or a column under
        # jnp.take(t, ids, axis=1))
        part = "row" if site.op != "gather" or ax is None or ax % len(shape) == len(shape) - 1 else "column"
        where = f"each {part} of the table" if site.op == "gather" else "its innermost contracting axis"
        unit = f"one scale per {part} of the table" if site.op == "gather" else "one scale per output channel"
        longer = _longer_contracted(site, shape, ax)
        cannot = (f"jqt.calibrate: op '{site.key}' ({site.op}, weight {tuple(shape)}) cannot take "
                  f"group_size={wt.group_size}")
        if eff.group_size:
            span, per = ((f"and a group does not span more than one {part}", f"one group per {part}")
                         if site.op == "gather" else
                         ("and do not span the other contracted axes",
                          "one group per position of the others"))
            if eff.group_size < wt.group_size:
                finer = "finer than asked: more scales"
            else:  # a gathered matrix's row longer than the groups, which do not tile it
                span = f"{wt.group_size} does not divide it, {span}"
                finer = "coarser than asked, but finer than one scale per matrix"
            diagnostics.warn_grouped(("groups", "axis", eff.group_size, longer), f"{cannot} (groups run along axis "
                                     f"{ax % len(shape)} of the weight ({where}), of length "
                                     f"{eff.group_size}, {span}); it gets group_size={eff.group_size}, {per} "
                                     f"({finer}). "
                                     f"Pick a group size that divides {eff.group_size}, or a Rule "
                                     f"for this key{longer}.", f"'{site.key}'")
        else:
            if ax is None:
                why, fix = (f"a {site.op} weight takes no groups", "This rule with "
                            f"weight=jqt.{eff!r} (no group_size) says so without a warning.")
            else:
                why = (f"groups run along axis {ax % len(shape)} of the weight ({where}), and "
                       f"{wt.group_size} does not divide its length {shape[ax % len(shape)]}")
                fix = (f"Pick a group size that divides it, or a Rule for this key{longer}."
                       if shape[ax % len(shape)] > 1 else
                       "An axis of length 1 takes no groups: squeeze it out of the weight, or "
                       "lay the weight out with it ahead of the axis to group (groups run along "
                       "the innermost contracted axis).")
            diagnostics.warn_grouped(("groups", why), f"{cannot} ({why}); it gets {unit}. {fix}",
                                     f"'{site.key}'")
    scale, zp = nx.params_from_range(st.weight["min"], st.weight["max"], eff)
    ops = [None, None]
    ops[w] = QArray(scale=scale, zero_point=zp, qtype=eff)
    act = site.entry.act_type(rule)
    if act is not None:
        if act.dynamic:
            ops[1 - w] = QArray(qtype=act)
        else:
            _check_act_finite(site, st.act)
            ranged = _act_range(rule, st.act, act, site.key)
            _check_range_finite(site, rule, st.act, *ranged)  # (before an infinite end is
            # read as a layer that saw nothing)
            lo, hi = _unseen_iterations(site, *ranged)
            if np.isnan(lo).any() or np.isnan(hi).any():  # a calibrator of the user's:
                raise ValueError(  # its statistics passed _check_act_finite
                    f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}'): "
                    f"calibrator {type(rule.calibrator).__name__}'s range(stats, qtype) returned "
                    f"NaN ([{lo}, {hi}]) on finite statistics of the activation: fix its range.")
            _check_order(site, lo, hi, f"calibrator {type(rule.calibrator).__name__}",
                         "stats, qtype")
            if not np.isfinite(lo).all() or np.size(lo) == 0:  # (0: a stack of 0 layers)
                diagnostics.warn_grouped("never", never, f"'{site.key}'")
                return float_(unreached)
            if not np.isfinite(hi).all():  # a calibrator of the user's that saw an inf
                raise ValueError(_act_not_finite(site, f"its calibrator's range is [{lo}, {hi}]"))
            if not (np.asarray(lo) != 0).any() and not (np.asarray(hi) != 0).any():
                diagnostics.warn_grouped(
                    "zero", f"jqt.calibrate: op '{site.key}' ({site.op} at "
                    f"'{site.name_stack or '<top>'}'): its activation was 0 on every calibration "
                    "batch, so its static range is empty and any other input clips to it. "
                    "Calibrate on data that reaches it with real values, or use dynamic "
                    "activations (jqt.recipes.w8a8_dynamic()); where it is 0 whatever the data "
                    "(an RNN's first step from a zero state, unrolled), nothing clips: leave it "
                    "as it is.", f"'{site.key}'")
            _warn_tiny_act(site, lo, hi, act)
            s, z = nx.params_from_range(lo, hi, act)
            ops[1 - w] = QArray(scale=s, zero_point=z, qtype=act)
    return _narrow(site, rule, OpQParams(lhs=ops[0], rhs=ops[1], **base))


def _warn_tiny_act(site, lo, hi, act):
    """A static activation range that is not empty but whose scale is below float32's
    normal range: ``params_from_range`` gives it the placeholder scale 1, on which every
    value rounds to 0 (as for such a weight, ``weightcheck._warn_tiny``)."""
    lo = np.minimum(np.asarray(lo, np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, np.float64), 0.0)
    raw = (np.maximum(-lo, hi) / act.amax_code if act.symmetric
           else (hi - lo) / (act.qmax - act.qmin))
    bad = (raw > 0) & (raw < np.finfo(np.float32).tiny)
    if not bad.any():
        return
    where = (f" in iterations {np.argwhere(bad).ravel().tolist() if bad.ndim == 1 else np.argwhere(bad).tolist()}"
             f" of {bad.size} (stacked layers or experts)" if bad.ndim else "")
    diagnostics.warn_grouped(
        ("tiny activation",),
        f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}'): its "
        f"activation's calibrated range{where} reaches only "
        f"{float(np.max(np.maximum(-lo, hi)[bad])):.3g}, "
        "which needs a scale below float32's normal range (about 1.2e-38): it has the "
        "placeholder scale 1, on which every value rounds to 0, so the op outputs zeros there. "
        "Rescale the model (activations this small do not occur in trained models), or keep "
        f"this op's activation float with jqt.Rule(key='^{re.escape(site.key)}$', "
        "activation=None) ahead of the preset's rules.", f"'{site.key}'")


def _unseen_iterations(site, lo, hi):
    """Per-iteration activation ranges (an op under a scan over stacked layers or experts)
    where some iterations saw nothing (not reached: a cond on the layer index; or only
    zeros: an expert no token was routed to) -> those iterations given the range of the
    ones that saw values, with a warning naming them; where all or none did, as given
    (scale 1 for an empty range before: 0.69 error on an unrouted expert's tokens)."""
    if np.ndim(lo) == 0:
        return lo, hi
    lo, hi = np.asarray(lo, np.float32), np.asarray(hi, np.float32)
    unseen = ~np.isfinite(lo) | ((lo == 0) & (hi == 0))
    if not unseen.any() or unseen.all():
        return lo, hi
    a, b = lo[~unseen].min(), hi[~unseen].max()
    which = [tuple(int(i) for i in ix) if len(ix) > 1 else int(ix[0]) for ix in np.argwhere(unseen)]
    steps = {c[0] for c in site.source.chain if c[1:] != ((),)} if site.source is not None else set()
    where, parts = (("a jax.shard_map that splits its weight into blocks", "blocks (devices)")
                    if "scan_slice" not in steps and "shard_split" in steps else
                    ("a scan over stacked layers or experts and a jax.shard_map", "layers x blocks")
                    if "shard_split" in steps else
                    ("a scan over stacked layers or experts", "iterations"))
    diagnostics.warn_grouped(("unseen", where), f"jqt.calibrate: op '{site.key}' ({site.op} "
                             f"under {where}): its activation saw no values (not reached, or "
                             f"only zeros) in {parts} {which[:8]}{' ...' if len(which) > 8 else ''} "
                             f"of {unseen.size}; they take the range of the others, [{a:.4g}, "
                             f"{b:.4g}]. Calibrate on data that reaches them (tokens for every "
                             "expert), or use dynamic activations (jqt.recipes.w8a8_dynamic()).",
                             f"'{site.key}' ({parts} {which[:8]}{' ...' if len(which) > 8 else ''} "
                             f"of {unseen.size})")
    return np.where(unseen, a, lo), np.where(unseen, b, hi)


def _check_weight_finite(site, lo, hi, rule=None):
    """Raises if the weight's observed range holds NaN or inf (a range never observed is
    ``[inf, -inf]``: an op that did not run, which warns instead)."""
    src = site.source
    name = f"weight '{src.path}'" if src is not None and src.path else "its weight"
    zero = (lo == np.inf) & (hi == np.inf)  # groups._checked's mark
    if zero.any() and rule is not None:
        raise ValueError(
            f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}'): weight "
            f"calibrator {type(rule.weight_calibrator).__name__}'s range(w, axes, qtype) returned "
            f"[0, 0] at {int(zero.sum())} of {zero.size} places where {name} is not all zero: "
            "their scale would be a placeholder 1 (the weights rounded to whole numbers). Return "
            "a range that holds the weights there (w.min(axis=axes, keepdims=True) and the max "
            "where in doubt).")
    if _seen_not_finite(lo, hi).any():
        cal = "" if rule is None or type(rule.weight_calibrator).__module__ == calibrators.__name__ else (
            f" (or its weight calibrator {type(rule.weight_calibrator).__name__}, not one of "
            "jqt's, returned NaN or inf for a finite weight: fix its range)")
        raise ValueError(
            f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}') reads "
            f"{name}, which holds NaN or inf values{_wide(site, site.weight_operand)}{cal}: its "
            "scale would not be finite. Fix the "
            f"weight, or keep the op float with a rule ahead of the others, "
            f"jqt.Rule(key='^{re.escape(site.key)}$', weight=None).")


def _check_order(site, lo, hi, who, args):
    """Raises where a calibrator's range has ``lo > hi`` (a calibrator of the user's that
    returns ``(hi, lo)``: the clamp to a range holding 0 made it ``[0, 0]``, scale 1)."""
    bad = np.isfinite(lo) & np.isfinite(hi) & (np.asarray(lo) > np.asarray(hi))
    if bad.any():
        i = np.argwhere(bad)[0] if bad.ndim else ()
        raise ValueError(
            f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}'): "
            f"{who}'s range({args}) returned lo > hi at {int(bad.sum())} of {bad.size} "
            f"places (e.g. lo {float(np.asarray(lo)[tuple(i)])}, hi "
            f"{float(np.asarray(hi)[tuple(i)])}): it returns (lo, hi), the low end first.")


def _seen_not_finite(lo, hi):
    """Where observed extremes hold NaN or inf; ``[inf, -inf]`` is nothing observed."""
    return ~((lo == np.inf) & (hi == -np.inf)) & ~(np.isfinite(lo) & np.isfinite(hi))


def _wide(site, i):
    """For a float64 operand: that values beyond float32's range count as inf."""
    if site.eqn.invars[i].aval.dtype != np.float64:
        return ""
    return (" (or, this operand being float64, values beyond float32's range, 3.4e38: jqt's "
            "statistics and scales are float32)")


def _act_not_finite(site, what):
    return (f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}'): its "
            f"activation held NaN or inf on the calibration data ({what})"
            f"{_wide(site, 1 - site.weight_operand)}, so its static range "
            "and scale would not be finite. Where the batches were finite, f made them (an exp "
            "that overflowed, a log of 0, a lookup at an id out of range: jnp.take and "
            "x.at[ids].get fill those rows with NaN by default, mode='clip' does not?): make f "
            "finite on them, or keep the op float with a "
            f"rule ahead of the others, jqt.Rule(key='^{re.escape(site.key)}$', weight=None).")


def _check_range_finite(site, rule, act, lo, hi):
    """Raises where a calibrator's range is not finite although the statistics it was
    given observed values: finite extremes (``min`` and ``max``, as every built-in
    calibrator keeps), or statistics of the user's own, one range for the op, all finite
    and not all zero (an empty accumulator holds an infinity, as ``[inf, -inf]`` extremes,
    or counts of 0). A calibrator of the user's that returned an infinite end was read as
    an op that never ran, or as an activation that held inf."""
    bad = np.isinf(lo) | np.isinf(hi)  # (NaN: refused after, by name)
    if isinstance(act, dict) and "min" in act and "max" in act:
        seen = np.isfinite(np.asarray(act["min"])) & np.isfinite(np.asarray(act["max"]))
    else:  # per layer where stacked: each leaf's leading axes are the range's
        stack = np.shape(lo)
        leaves = [np.asarray(a) for a in jax.tree_util.tree_leaves(act)]
        if not leaves or any(a.shape[:len(stack)] != stack for a in leaves):
            return
        flat = [a.reshape((int(np.prod(stack)), -1)) for a in leaves]
        seen = (np.all([np.isfinite(a).all(axis=1) for a in flat], axis=0)
                & np.any([(a != 0).any(axis=1) for a in flat], axis=0)).reshape(stack)
    if np.shape(seen) != np.shape(bad) or not (seen & bad).any():
        return
    raise ValueError(
        f"jqt.calibrate: op '{site.key}' ({site.op} at '{site.name_stack or '<top>'}'): "
        f"calibrator {type(rule.calibrator).__name__}'s range(stats, qtype) returned "
        f"[{np.asarray(lo)[seen & bad].min()}, {np.asarray(hi)[seen & bad].max()}], not "
        "finite, on finite statistics of the activation: return finite ends (a one-sided "
        "range clipped at the observed min or max, stats['min'] and stats['max']).")


def _check_act_finite(site, act):
    """Raises if activation statistics that keep the observed extremes (``min`` and
    ``max``, as every built-in calibrator does) saw NaN or inf. Extremes never observed,
    ``[inf, -inf]``, are an op that did not run (:func:`_decide` warns instead)."""
    if not (isinstance(act, dict) and "min" in act and "max" in act):
        return
    lo, hi = np.asarray(act["min"]), np.asarray(act["max"])
    bad = _seen_not_finite(lo, hi)
    if bad.any():
        what = ("NaN" if np.isnan(lo[bad]).any() or np.isnan(hi[bad]).any() else
                f"extremes [{lo[bad].min()}, {hi[bad].max()}]")
        raise ValueError(_act_not_finite(site, what))


def _narrow(site, rule, p):
    """``p`` with the rule's accumulator width, where the op has one (an int x int op;
    a weight-only op accumulates in float and keeps the default)."""
    if rule.accumulator == p.accumulator or p.lhs is None or p.rhs is None:
        return p
    p = dataclasses.replace(p, accumulator=rule.accumulator)
    why = validate.accumulator_problem(site.key, p)
    if why:
        raise ValueError(f"jqt.calibrate: {why}")
    return p
