"""Checks of qparams: their types (:func:`check_qparams`) and the numbers they hold.

Whether edited by hand, read from a file or moved by fine-tuning, qparams must hold
numbers the kernels can use:

* every ``scale`` finite and ``> 0`` (a zero scale divides by zero, a negative one flips
  the operand's sign, NaN and inf poison every output);
* every ``zero_point`` finite and within its type's ``[qmin, qmax]`` (a code outside it
  cannot be stored: the int8 padding value of a convolution would wrap);
* every smoothing vector (``OpQParams.smooth``) finite and ``> 0`` (the activation is
  divided by it).

:func:`problems` lists what is wrong with one op; :func:`check_qparams` raises on the
first op with a problem (``jqt.quantize``, ``jqt.pack``, ``jqt.report``), and the file
readers (``serialization.py``, ``packed_io.py``) raise their ``FormatError`` naming the
file. Values that are tracers (qparams differentiated or passed through ``jax.jit``) are
not checked: their numbers are not known. :func:`jqt.qat.project` repairs them.
"""
from __future__ import annotations

import itertools
import re

import jax
import numpy as np

from . import accumulator, compat, diagnostics, kvcache, layout
from . import numerics as nx
from .qparams import OpQParams, PackedParams, calibrated_args, field_problems, restored_bare, v1_problem
from .handlers import QParamsMismatchError
from .registry import BY_NAME

FIX = "Re-calibrate, or apply jqt.qat.project(qparams) after fine-tuning."
# the note of an op whose weight operand f builds from iota and constants (an interpolation
# matrix): always float, and how many there are follows the input's shape
BUILT_NOTE = "its weight is a matrix f builds from iota and constants"


def _built_entry(q) -> bool:
    """Whether qparams entry ``q`` is that of a matrix f builds (float, with its note)."""
    return q.is_float and q.note.startswith(BUILT_NOTE)


def _concrete(a):
    """``a`` as a NumPy array, or None when it is a tracer (its values are not known)."""
    if a is None or compat.is_tracer(a):
        return None
    try:
        return np.asarray(a, dtype=np.float64)
    except Exception:  # noqa: BLE001 - a value that cannot be read on the host
        return None


_F32_MAX, _F32_TINY = float(np.finfo(np.float32).max), float(np.finfo(np.float32).tiny)


def _count(bad, a, what):
    n = int(np.count_nonzero(bad))
    if not n:
        return None
    total = a.size
    return f"{n} of {total} values {what}" if total > 1 else f"its value {what.replace('are ', 'is ', 1)}"


def _positive(a):
    """What is wrong with a scale or smoothing vector: ``[]`` when every value is finite
    and > 0."""
    out = []
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        wide = np.asarray(a)
        f32 = wide.astype(np.float32) if wide.dtype.itemsize > 4 else wide  # float64 qparams:
        # jqt computes with scales in float32, where these are inf or 0
        for bad, what in ((np.isnan(a), "are NaN"), (np.isinf(a), "are infinite"),
                          (a == 0, "are 0"), (a < 0, "are negative"),
                          (np.isfinite(wide) & np.isinf(f32), "are beyond float32's range (jqt "
                           "computes with scales in float32; jqt.qat.project clamps them)"),
                          ((wide > 0) & (f32 == 0), "are below float32's range (jqt computes "
                           "with scales in float32; jqt.qat.project clamps them)"),
                          # subnormal in float32 (a scale of 1e-39): XLA flushes it to 0, and
                          # the simulated path's code of an exact 0 was 0 * inf = NaN
                          ((wide > 0) & (f32 != 0) & (np.abs(wide.astype(np.float32)) < _F32_TINY),
                           "are below float32's smallest normal value, 1.2e-38, which XLA "
                           "flushes to 0 (jqt.qat.project clamps them)")):
            t = _count(bad, a, what)
            if t:
                out.append(t)
    return out


def _zero_point(a, qtype):
    out = []
    lo, hi = qtype.qmin, qtype.qmax
    with np.errstate(invalid="ignore"):
        fin = np.isfinite(a)
        for bad, what in ((np.isnan(a), "are NaN"), (np.isinf(a), "are infinite"),
                          (fin & ((a < lo) | (a > hi)), f"are outside [{lo}, {hi}]")):
            t = _count(bad, a, what)
            if t:
                out.append(t)
    return out


def operand_problems(q, where):
    """What is wrong with the numbers of one :class:`jqt.QArray` (its scale, zero point
    and, packed, smoothing vector): a list of texts such as ``"rhs.scale: 3 of 64 values
    are 0"``."""
    if q is None:
        return []
    out = []
    s = _concrete(q.scale)
    if s is not None:
        out += [f"{where}.scale: {t}" for t in _positive(s)]
        unit = nx.FP8_BITS_UNIT.get(q.qtype.grid)
        if unit is not None:  # fp8: the scale times the bits unit must stay finite
            with np.errstate(invalid="ignore"):
                t = _count(np.asarray(s, np.float64) > _F32_MAX / unit, s,
                           f"are above {_F32_MAX / unit:.4g}, float32's largest value over "
                           f"{q.qtype.grid}'s bits unit {unit} (the product, which jqt computes "
                           "with, would be inf; jqt.qat.project clamps them)")
            if t:
                out.append(f"{where}.scale: {t}")
    z = _concrete(q.zero_point)
    if z is not None:
        out += [f"{where}.zero_point: {t}" for t in _zero_point(z, q.qtype)]
    sm = _concrete(q.smooth)  # a packed weight's smoothing vector
    if sm is not None:
        out += [f"{where}.smooth: {t}" for t in _positive(sm)]
    return out + field_problems(q, where, z)


def problems(p: OpQParams) -> list:
    """What is wrong with the numbers of one op's qparams (``[]`` when nothing is):
    each operand's scale and zero point, and the smoothing vector."""
    out = operand_problems(p.lhs, "lhs") + operand_problems(p.rhs, "rhs")
    sm = _concrete(p.smooth)
    if sm is not None:
        out += [f"smooth: {t}" for t in _positive(sm)]
    return out


def accumulator_problem(key, p: OpQParams) -> str:
    """What is wrong with op ``key``'s accumulator width, or ``""``: it must be an int
    in ``[16, 32]``, and below 32 the op must be int x int of at most 8 bits per
    tensor or per channel (:func:`accumulator.unsupported`)."""
    bits = p.accumulator
    if bits == accumulator.WIDEST:
        return ""
    try:
        accumulator.check_bits(bits, f"op '{key}'")
    except ValueError as e:
        return str(e)
    why = "" if p.is_float else accumulator.unsupported(
        [None if q is None else q.qtype for q in (p.lhs, p.rhs)])
    if why:
        return (f"op '{key}' asks for an int{bits} accumulator, but {why}. A narrow accumulator "
                "is simulated for int x int ops of at most 8 bits with per-tensor or "
                "per-channel scales; give this op accumulator=32 (a Rule for its key).")
    return ""


def describe(key, found) -> str:
    """One message for the problems ``found`` in op ``key``."""
    return (f"op '{key}' holds invalid quantization parameters: {'; '.join(found)} (scales and "
            "smoothing factors must be finite and > 0, zero points finite and within their "
            "type's range)")


def operand_types_problem(p: OpQParams):
    """What is wrong with the pair of operand types of a contraction's qparams (the
    combinations :class:`jqt.Rule` refuses), or ``None``."""
    w = p.weight_operand
    if p.op == "gather" or getattr(BY_NAME.get(p.op), "is_cache", False):
        return None
    wide = lambda q: q is not None and q.qtype.kind == "int" and q.qtype.bits > 8
    if w is None:  # activation x activation
        if wide(p.lhs) or wide(p.rhs):
            t = (p.lhs if wide(p.lhs) else p.rhs).qtype
            return (f"takes {t.describe()} operands in an activation x activation op, which "
                    "takes 2 to 8 bits (or fp8)")
        return None
    wq, aq = p.operand(w), p.operand(1 - w)
    if wide(wq):
        return (f"has an {wq.qtype.describe()} weight: weights are stored in 2 to 8 bits "
                "(int16 is for activations)")
    if aq is not None and wq is None:
        return "quantizes the activation but not the weight: an integer kernel needs both"
    if wq is None or aq is None:
        return None
    if wq.qtype.kind == "lut":
        return (f"pairs nf4 weights with {aq.qtype.describe()} activations: nf4 weights are "
                "decoded by lookup and multiplied in float (activation None)")
    if (wq.qtype.kind == "float") != (aq.qtype.kind == "float"):
        return (f"pairs {wq.qtype.describe()} weights with {aq.qtype.describe()} activations: an "
                "integer kernel needs integer operands, an fp8 kernel fp8 operands")
    return None


def weight_scale_problem(scale, qtype, source, shape=None, name="its scale") -> str:
    """Why a weight operand's ``scale`` does not fit the weight ``source`` describes
    (operand of ``shape``, or of the leaf shape the source recorded through its layout
    chain, where known), or ``""``. A per-channel (or per-group) scale has the operand's
    axes (stacked layers first), length 1 on the contracted ones unless grouped; a
    per-tensor one is a scalar, or one per stacked layer. A scale with a leading axis of
    its own (qparams stacked over seeds or an ensemble by ``jax.vmap``) broadcasts against
    the weight, so it is told by its rank.

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8(), jnp.ones((4, 3)),
    ...                    [(jnp.ones((1, 4)),)], progress=False)
    >>> q = qp["w"].rhs
    >>> weight_scale_problem(q.scale, q.qtype, qp["w"].source, (4, 3))
    ''
    >>> weight_scale_problem(jnp.stack([q.scale] * 2), q.qtype, qp["w"].source, (4, 3))[:66]
    'its scale has shape [2, 1, 3], but the weight operand (4, 3) has 2'
    """
    if scale is None or source is None or (np.ndim(scale) == 0 and not qtype.per_channel):
        return ""
    sshape, depth = tuple(np.shape(scale)), source.stack_depth
    if shape is None and source.shape is not None:
        leaf = jax.ShapeDtypeStruct(tuple(source.shape), np.float32)
        try:
            shape = jax.eval_shape(lambda w: layout.apply_chain(w, source.chain), leaf).shape
        except (TypeError, ValueError):  # a chain that does not replay on that shape: the
            shape = None  # other checks say so
    hint = ("; qparams stacked or vmapped (over seeds, an ensemble) hold one more leading axis: "
            "take one model's, jax.tree.map(lambda a: a[i], qparams), or re-calibrate")
    if not qtype.per_channel:  # one scale per stacked layer, or one
        if len(sshape) <= depth and (shape is None or sshape == tuple(shape[:len(sshape)])):
            return ""
        return (f"{name} has shape {list(sshape)}, but the weight's type is per-tensor: one "
                f"scale{f' per stacked layer, {tuple(shape[:depth])}' if depth and shape else ''}"
                f"{hint if len(sshape) == depth + 1 else ''}")
    if shape is not None and len(sshape) != len(shape):
        return (f"{name} has shape {list(sshape)}, but the weight operand {tuple(shape)} has "
                f"{len(shape)} ax{'i' if len(shape) == 1 else 'e'}s"
                f"{hint if len(sshape) > len(shape) else ''}")
    axes = [a + depth for a in source.contract]
    shared = [] if qtype.group_size else axes
    if any(a >= len(sshape) for a in axes) or any(sshape[a] != 1 for a in shared):
        return (f"{name} has shape {list(sshape)}, which does not fit the weight: its "
                f"contracted axes {list(source.contract)} (after {depth} stacked axes) share "
                f"one scale{' per group' if qtype.group_size else ''}")
    if shape is None or not all(isinstance(n, int) for n in shape):
        return ""
    # one scale per position of every other axis; a grouped type's per group of one of
    # the contracted axes (the op's: a dot's innermost) and per position of the others
    g = qtype.group_size
    fits = (lambda cut: tuple(shape[d] // g if d == cut else 1 if d in shared else shape[d]
                              for d in range(len(shape))))
    options = [fits(a) for a in axes if shape[a] % g == 0] if g else [fits(None)]
    if sshape in options:
        return ""
    return (f"{name} has shape {list(sshape)}, which does not fit the weight operand "
            f"{tuple(shape)} ({qtype.describe()}): it needs "
            + " or ".join(str(list(o)) for o in options) if options else
            f"{name}: the weight operand {tuple(shape)} has no contracted axis of a multiple "
            f"of its group size {g}")


def check_qparams_types(qparams, fn: str = "jqt") -> None:
    """Raises ``TypeError`` unless ``qparams`` is a dict of :class:`jqt.OpQParams` (the
    first check of :func:`check_qparams`), with a hint where it looks like model parameters."""
    if not isinstance(qparams, dict):
        packed = type(qparams).__name__ == "PackedParams" and fn == "jqt.save"
        raise TypeError(f"{fn}: qparams is a {type(qparams).__name__}; expected the dict returned "
                        "by jqt.calibrate (or jqt.load)."
                        + (" Packed weights are saved with jqt.save_packed(path, packed, "
                           "qparams) and read with jqt.load_packed." if packed else ""))
    for k, v in qparams.items():
        if not isinstance(v, OpQParams):
            if restored_bare(v) == "jqt.OpQParams":
                raise TypeError(
                    f"{fn}: qparams['{k}'] is a dict with keys {sorted(v)}: jqt.OpQParams flattened "
                    "to their arrays, as a checkpointer (orbax) restores them without a template. "
                    "Their formats are not arrays, so they are lost. Restore with a template made "
                    "from qparams of the same recipe, e.g. jax.eval_shape(lambda: qparams), or "
                    "save and load with jqt.save / jqt.load, which keep them.")
            params_like = hasattr(v, "shape") or isinstance(v, (dict, list, tuple))
            swapped = (" It looks like model parameters: are the arguments swapped? qparams is "
                       f"the dict jqt.calibrate returns (see {fn}'s signature).") if params_like else ""
            raise TypeError(f"{fn}: qparams['{k}'] is of type {type(v).__name__}; expected "
                            f"jqt.OpQParams.{swapped}")
        if v.op not in BY_NAME:
            raise ValueError(f"{fn}: qparams['{k}'] describes op {v.op!r}, which is not an op jqt "
                             f"quantizes (it knows {', '.join(sorted(BY_NAME))}). Pass the qparams "
                             "jqt.calibrate or jqt.load returned; OpQParams.op names the primitive.")


def check_qparams(qparams, fn: str = "jqt", values: bool = True):
    """Raises ``TypeError`` unless ``qparams`` is a dict of :class:`jqt.OpQParams`, and
    (``values=True``) ``ValueError`` naming the op, the field and what is wrong when a
    scale, zero point or smoothing vector holds an invalid number (tracers are skipped).

    >>> import dataclasses, jax.numpy as jnp, jqt
    >>> from jqt._src.validate import check_qparams
    >>> qp = jqt.calibrate(lambda w, x: x @ w, jqt.recipes.w8(), jnp.eye(2),
    ...                    [(jnp.ones((1, 2)),)], progress=False)
    >>> check_qparams(qp, "jqt.quantize")
    >>> bad = {"w": dataclasses.replace(qp["w"], rhs=dataclasses.replace(
    ...     qp["w"].rhs, scale=jnp.zeros_like(qp["w"].rhs.scale)))}
    >>> check_qparams(bad, "jqt.quantize")
    Traceback (most recent call last):
    ...
    ValueError: jqt.quantize: op 'w' holds invalid quantization parameters: rhs.scale: 2 of 2 values are 0 (scales and smoothing factors must be finite and > 0, zero points finite and within their type's range). Re-calibrate, or apply jqt.qat.project(qparams) after fine-tuning.
    """
    check_qparams_types(qparams, fn)
    check_alive(qparams, fn, "qparams")
    for k, v in qparams.items():
        if any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree_util.tree_leaves(v)):
            raise TypeError(f"{fn}: qparams['{k}'] holds shapes, not arrays (a jax.eval_shape "
                            "template?); pass the qparams jqt.calibrate or jqt.load returned.")
        why = accumulator_problem(k, v)
        if why:
            raise ValueError(f"{fn}: {why}")
        if getattr(BY_NAME.get(v.op), "is_cache", False) and not v.is_float and v.lhs is not None:
            kvcache.check_type(v.lhs.qtype, f"{fn}: qparams['{k}'] (a key/value cache write)")
        why = operand_types_problem(v)
        if why:
            raise ValueError(f"{fn}: qparams['{k}'] {why} (qparams edited by hand?). Re-calibrate "
                             "with a recipe that asks for it; jqt.Rule checks these combinations.")
    if not values:
        return
    for k, v in qparams.items():
        found = problems(v)
        if found:
            saving = (" (jqt.save writes qparams: an optimizer state shaped like them, such as "
                      "Adam's moments, is not qparams and must not be projected; checkpoint it "
                      "with orbax, docs/export.md)") if fn == "jqt.save" else ""
            raise ValueError(f"{fn}: {describe(k, found)}. {FIX}{saving}")


def deleted(tree) -> list:
    """The paths of ``tree``'s arrays that were deleted (donated to a jitted call); a
    :class:`jqt.PackedParams`' float leaf by its path in the params it was packed from.

    >>> import jax.numpy as jnp, jqt
    >>> qp = jqt.calibrate(lambda p, x: x @ p["w"] + p["b"], jqt.recipes.w8(),
    ...                    {"w": jnp.eye(2), "b": jnp.ones(2)}, [(jnp.ones((1, 2)),)], progress=False)
    >>> packed = jqt.pack(qp, {"w": jnp.eye(2), "b": jnp.ones(2)})
    >>> packed.leaves[0].delete()
    >>> deleted([packed])
    ["[0] (packed params) ['b']"]
    """
    gone = lambda a: isinstance(a, jax.Array) and not compat.is_tracer(a) and a.is_deleted()
    out = []
    for path, a in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, PackedParams)):
        if not isinstance(a, PackedParams):
            out += [jax.tree_util.keystr(path)] if gone(a) else []
            continue
        where = jax.tree_util.keystr(path)
        dead = [i for i, x in zip(a.kept, a.leaves) if gone(x)]
        if dead:  # (named only then: the tree is rebuilt for it)
            paths = a.key_paths()
            out += [f"{where} (packed params) "
                    + (jax.tree_util.keystr(paths[i]) if paths is not None else f"(leaf {i})")
                    for i in dead]
        out += [f"{where}.weights" + jax.tree_util.keystr(q)
                for q, x in jax.tree_util.tree_leaves_with_path(a.weights) if gone(x)]
    return out


def check_alive(tree, fn: str, what: str):
    """Raises ``ValueError`` naming the leaves of ``tree`` (``what``: "qparams", "params",
    ...) whose arrays were deleted: donated to a jitted call (``donate_argnums``), which
    hands an argument's buffers to XLA, through any pytree that holds the same arrays
    (:func:`jqt.pack`'s float leaves are the params' own arrays).

    >>> import jax.numpy as jnp
    >>> from jqt._src.validate import check_alive
    >>> p = {"b": jnp.zeros(3)}
    >>> p["b"].delete()
    >>> check_alive(p, "jqt.pack", "params")
    Traceback (most recent call last):
    ...
    ValueError: jqt.pack: params leaf ['b'] has been deleted: a jitted call it was passed to with donate_argnums (directly, or in another pytree holding the same array, such as jqt.pack's PackedParams, whose float leaves are the params' own arrays) handed its buffer to XLA. Pass a copy to the donating call (jax.tree.map(jnp.copy, tree)), or rebuild the value.
    """
    gone = deleted(tree)
    if gone:
        raise ValueError(
            f"{fn}: {what} leaf {', '.join(gone[:4])}{' ...' if len(gone) > 4 else ''} "
            f"{'has' if len(gone) == 1 else 'have'} been deleted: a jitted call it was passed to "
            "with donate_argnums (directly, or in another pytree holding the same array, such as "
            "jqt.pack's PackedParams, whose float leaves are the params' own arrays) handed its "
            "buffer to XLA. Pass a copy to the donating call (jax.tree.map(jnp.copy, tree)), or "
            "rebuild the value.")


def refuse_v1(fn, key, values, qtype):
    """Raises :class:`jqt.QParamsMismatchError` where a version-1 file's packed weight of op
    ``key`` (int8 ``values``, no scale or type recorded) cannot run as the qparams'
    ``qtype`` (:func:`qparams.v1_problem`)."""
    why = v1_problem(values, qtype)
    if why:
        raise QParamsMismatchError(
            f"{fn}: the packed weight of op '{key}' holds int8 codes without scales (a "
            f"jqt.packed version 1 file), but {why}. They were packed with other qparams; "
            "re-run jqt.pack(qparams, params) with these.")


def quantized_already(traced) -> str:
    """A note where the function runs jqt's own primitives (a function jqt.quantize
    returned: its integer path has no op to quantize, its simulated path other ops)."""
    prims = traced.analyzer.jqt_prims
    if not prims:
        return ""
    return (f" Here f runs jqt's own primitives ({', '.join(sorted(prims))}): is it a "
            "function jqt.quantize returned, quantized already? Pass the float function (the "
            "f given to jqt.quantize).")


def check_keys(traced, qparams, fn: str = "jqt", some_empty: bool = False):
    """Raises :class:`jqt.QParamsMismatchError` unless ``qparams`` has an entry for each op
    of the traced function and no other: the one check of :func:`jqt.quantize`,
    :func:`jqt.report` and :func:`jqt.gptq`. An optional op (``registry``: cache writes,
    scalar-index lookups, which older qparams lack) may have none, and runs float. With an
    empty input (``some_empty``) unused gathers pass: JAX traces ``table[ids]`` with no
    ids to zeros, without the gather. An op whose weight f builds from iota and constants
    (``jax.image.resize``'s interpolation matrices, as many as the axes whose size the
    resize changes, so their number follows the input's shape) is always float: it may
    have no entry, and the qparams' entries of such ops that this call lacks are not
    extra."""
    keys = [s.key for s in traced.sites()]
    extra = sorted(k for k in set(qparams) - set(keys) if not _built_entry(qparams[k]))
    # a key the qparams gave a built matrix, which here is another op (or the reverse):
    # positional keys shift where the input's shape adds or drops interpolations
    swapped = [s for s in traced.sites() if s.key in qparams and s.op == qparams[s.key].op
               and (not qparams[s.key].is_float if s.built else _built_entry(qparams[s.key]))]
    if swapped:
        built = "an op whose weight f builds from iota and constants (an interpolation matrix)"
        was, now = ("another op", built) if swapped[0].built else (built, "another op")
        raise QParamsMismatchError(
            f"{fn}: qparams['{swapped[0].key}'] was made for {was}, and in this call that key "
            f"is {now}: the input's shape changes how many interpolation matrices f builds "
            "(jax.image.resize skips an axis whose size it keeps), and the ops after them in "
            "the same scope are numbered on. Calibrate at these input shapes (one qparams per "
            "shape), or give the ops after the resize a scope of their own (jax.named_scope, "
            "or a flax module) so that their keys do not follow the resize's.")
    if extra and some_empty:
        extra = [k for k in extra if qparams[k].op != "gather"]
    caches = [k for k in extra if qparams[k].op in ("dynamic_update_slice", "scatter")]
    if caches:
        why = "; ".join(f"at {w} {y}" for w, y in traced.analyzer.near_misses()[:2])
        raise QParamsMismatchError(
            f"{fn}: qparams hold key/value caches {caches[:5]} that this call's function does not "
            "write as caches: its cache arguments or writes differ from those it was calibrated "
            f"with ({why or 'another dtype, shape or layout?'}). Pass caches as at calibration, or "
            "calibrate with these.")
    if extra:
        rows = _layer_rows(extra, keys)  # (then not another function's or shape's)
        counted = "" if rows else (_op_count(extra + [k for k in keys if k not in qparams], keys, qparams)
                                   or _nested(keys, qparams))
        raise QParamsMismatchError(
            f"{fn}: qparams hold keys the function does not have: {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''}; the function's op keys are "
            f"{keys[:5]}{' ...' if len(keys) > 5 else ''}."
            f"{'' if rows else ' They were calibrated for another function or weight_argnums.'}{counted}"
            f"{_argnums(qparams, traced, fn) or _renamed_argument(extra, keys, qparams, traced.arg_prefixes)}"
            f"{_boxed(extra, [k for k in keys if k not in qparams])}"
            f"{rows}"
            f"{diagnostics.einsum_order(extra + [k for k in keys if k not in qparams])}"
            f"{'' if _argnums(qparams, traced, fn) else _conv_sides(qparams, traced)}"
            f"{quantized_already(traced)}")
    # an optional op without an entry stays float (qparams saved before jqt quantized caches
    # or scalar-index lookups)
    missing = [s.key for s in traced.sites()
               if s.key not in qparams and not s.entry.optional and not s.built]
    if missing:
        # an optional op whose key the qparams give to another op: made by a jqt that did
        # not quantize it yet, whose keys for the same weight's later ops were one lower
        # (or an embedding lookup: a jqt from before 2026-11-23 numbered a tied table's
        # matmul 'emb' where the lookup now is 'emb' and the matmul 'emb#1')
        moved = [s for s in traced.sites() if (s.entry.optional or s.op == "gather")
                 and s.key in qparams and qparams[s.key].op != s.op]
        what = lambda s: (f"{s.op} ({'table[i] with a scalar i' if s.entry.optional else 'an embedding lookup'})"
                          if s.op == "gather" else s.op)
        lookups = all(s.op == "gather" for s in traced.sites() if s.key in missing)
        if moved:
            why = (f" The qparams give key '{moved[0].key}' to a {qparams[moved[0].key].op}, "
                   f"where this function has a {what(moved[0])}: they were made by a jqt that "
                   "kept such ops float, and the weight's other ops have other keys now. Run "
                   "jqt.calibrate on this function.")
        elif lookups:
            why = (" They are embedding lookups: qparams made by a jqt from before 2026-11-23, "
                   "which kept lookups float, have no entries for them, nor have qparams made "
                   "for another function or weight_argnums; run jqt.calibrate on this function "
                   "with this jqt. Or the indices were a Python list or number at calibration and "
                   "are an array now (a constant index reads the table as a constant, no lookup): "
                   "pass them as calibration did.")
        else:
            why = (" The qparams were made for another function or weight_argnums; run "
                   "jqt.calibrate on this function."
                   f"{_op_count(missing + [k for k in qparams if k not in keys], keys, qparams) or _nested(keys, qparams)}")
        raise QParamsMismatchError(
            f"{fn}: no quantization parameters for ops {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''} of this function (qparams have "
            f"{list(qparams)[:5]}{' ...' if len(qparams) > 5 else ''}).{why}"
            f"{_boxed([k for k in qparams if k not in keys], missing)}"
            f"{diagnostics.einsum_order(missing + [k for k in qparams if k not in keys])}"
            f"{'' if _argnums(qparams, traced, fn) else _conv_sides(qparams, traced)}")


def _layer_rows(extra, keys) -> str:
    """A hint where a key is one of the function's with a layer's index: jqt.report's row
    of one layer of a ``lax.scan`` over stacked weights (``'layers/w[1]'``).

    >>> _layer_rows(["layers/w[1]"], ["layers/w"])[:44]
    " 'layers/w[1]' is jqt.report's row for one l"
    """
    rows = [k for k in extra if (m := re.fullmatch(r"(.+)\[\d+(?:, \d+)*\]", k)) and m[1] in keys]
    if not rows:
        return ""
    base = rows[0][:rows[0].rindex("[")]
    return (f" {rows[0]!r} is jqt.report's row for one layer of a lax.scan over stacked "
            f"weights, but the layers share one op key and one OpQParams, {base!r}: set "
            f"qparams[{base!r}] (it applies to every layer), or keep that layer out of the scan.")


def _boxed(theirs, ours, reads="the function reads") -> str:
    """A hint where the qparams' keys (``theirs``) and the function's (``ours``) differ by
    a ``/value`` part only: Flax's boxed params (``nn.with_partitioning``) on one side.

    >>> _boxed(["params/d/kernel/value"], ["params/d/kernel"])[:40]
    ' The keys differ by a /value part only: '
    >>> _boxed(["a"], ["b"])
    ''
    >>> _boxed(["p/value/kernel"], ["p/value/kernel/value"])[40:75]  # a module named value
    "the function reads Flax's boxed par"
    """
    plain = lambda ks: sorted(re.sub(r"/value(?=#\d+$|$)", "", k) for k in ks)
    if not theirs or sorted(theirs) == sorted(ours) or plain(theirs) != plain(ours):
        return ""
    boxed, plain_ = ("Flax's boxed params (linen's nn.Partitioned, from nn.with_partitioning, "
                     "or an nnx.State, whose Variables add /value)"), \
        "plain ones (nn.unbox(variables), nnx.to_pure_dict(state))"
    sides = (f"the qparams were calibrated on {boxed}, {reads} {plain_}"
             if any(re.search(r"/value(#\d+)?$", k) for k in theirs) else
             f"{reads} {boxed}, the qparams were calibrated on {plain_}")
    return (f" The keys differ by a /value part only: {sides}. Calibrate and run f on the "
            "same form: nn.unbox(variables) for both, or the boxed variables for both (nnx: "
            "the nnx.State for both, or nnx.to_pure_dict(state) for both).")


def boxed_leaf(path, leaves) -> str:
    """:func:`_boxed`'s hint for ``jqt.pack``: weight ``path`` is not among ``leaves``,
    but is with or without a ``/value`` part."""
    plain = lambda k: re.sub(r"/value$", "", k)
    match = [k for k in leaves if plain(k) == plain(path)]
    return _boxed([path], match[:1], "params hold") if match else ""


def level_leaf(path, leaves) -> str:
    """A hint for ``jqt.pack`` where weight ``path`` is among ``leaves`` under a prefix
    more or less: the qparams calibrated on a pytree a level above or below the one given
    (flax's ``variables`` against ``variables["params"]``).

    >>> level_leaf("params/Conv_0/kernel", ["Conv_0/kernel", "Conv_0/bias"])[:40]
    " The params hold it as 'Conv_0/kernel': "
    >>> level_leaf("w", ["v"])
    ''
    """
    match = [k for k in leaves if path.endswith("/" + k) or k.endswith("/" + path)]
    if not match:
        return ""
    k = match[0]
    where = (f"a pytree that holds these params under '{path[:-len(k) - 1]}'"
             if len(k) < len(path) else f"these params' part '{k[:-len(path) - 1]}'")
    return (f" The params hold it as '{k}': the qparams were calibrated on {where}, as "
            "flax's variables hold variables['params']; pass the pytree they were "
            "calibrated with.")


def _nested(keys, qparams) -> str:
    """A hint where the function's op keys hold every key of the qparams, or the qparams
    every key of the function (and some are shared): the same function, whose branch on a
    shape or a Python value adds or drops ops at these inputs.

    >>> _nested(["w", "pos"], {"w": 0})[:44]
    ' If they were made for this function at othe'
    >>> _nested(["v"], {"w": 0})  # another model
    ''
    """
    mine, theirs = set(keys), set(qparams)
    if not (mine & theirs) or not (mine <= theirs or theirs <= mine):
        return ""
    return (" If they were made for this function at other input shapes or arguments: its ops "
            f"here {'include' if theirs <= mine else 'are some of'} the qparams' ops, as where a "
            "branch on a shape or a Python value adds or drops ops (a position table "
            "interpolated at another resolution only). Then calibrate with inputs of the "
            "shapes and arguments it will be called with (one qparams per shape).")


def _op_count(mismatched, keys, qparams) -> str:
    """A hint where every mismatched key is a later op (``'w#3'``) of a weight both the
    function and the qparams have: the same function, tracing its weights' ops another
    number of times at these inputs.

    Also where they are later ops keyed by position (``'dot_general_6'``, no weight leaf
    reaches them: matmuls inside ``lax.associative_scan``'s combine function) of a kind
    and place both have.

    >>> _op_count(["sq#2", "sq#3"], ["w", "sq", "sq#1"], {"w": 0, "sq": 0, "sq#1": 0})[:45]
    ' Or they were made for this function at other'
    >>> _op_count(["a/dot_general_6"], ["a/dot_general_2"], {"a/dot_general_2": 0})[:20]
    ' Or they were made f'
    >>> _op_count(["v"], ["w"], {"v": 0})  # another model
    ''
    """
    base = lambda k: k.rsplit("#", 1)[0]
    place = lambda k: re.sub(r"_\d+$", "", k)  # a positional key without its index
    common = {base(k) for k in keys if k in qparams}
    places = {place(k) for k in keys if k in qparams and place(k) != k}
    if not mismatched or not all(("#" in k and base(k) in common)
                                 or (place(k) != k and place(k) in places) for k in mismatched):
        return ""
    return (" Or they were made for this function at other input shapes or arguments: it "
            "reads the same weights as the qparams' ops another number of times, so it traces "
            "more or fewer ops here than at calibration (a Python loop over an input's length "
            "or an argument, lax.associative_scan). Then calibrate with inputs of the shapes "
            "and arguments it will be called with (one qparams per shape), or write the loop "
            "as a lax.scan.")


def numbers_as_arrays(qparams):
    """``qparams`` with Python numbers among its leaves (``tree_map(float)``, a JSON round
    trip) as float32 arrays, the dtype ``jqt.calibrate`` gives them, so that every path
    (eager, under ``jax.jit``) reads them alike.

    >>> import jax.numpy as jnp, jqt
    >>> qp = {"w": jqt.OpQParams(op="dot_general", weight_operand=1, rhs=None,
    ...                          lhs=jqt.QArray(scale=0.5, qtype=jqt.QuantType()))}
    >>> numbers_as_arrays(qp)["w"].lhs.scale.dtype
    dtype('float32')
    """
    as_array = lambda a: np.float32(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a
    # per op: a tree_map over the dict would sort its keys, which are in evaluation order
    return {k: jax.tree_util.tree_map(as_array, v) for k, v in qparams.items()}


def _conv_sides(qparams, traced) -> str:
    """A hint where the convolutions differ in their keys only: one whose weight is its
    kernel (keyed by the weight) on one side, one keyed by position on the other, as
    ``jnp.convolve(x, w)`` gives when ``x`` is shorter than ``w`` (the shorter operand is
    its kernel)."""
    conv = "conv_general_dilated"
    theirs = {k for k, p in qparams.items() if getattr(p, "op", None) == conv}
    ours = {s.key for s in traced.sites() if s.op == conv}

    positional = lambda ks: {k for k in ks if k.split("/")[-1].split("#")[0].startswith(conv + "_")}
    a, b = theirs - ours, ours - theirs
    if not a or not b or len(theirs) != len(ours) or not (
            (positional(a) == a and not positional(b)) or (positional(b) == b and not positional(a))):
        return ""
    return (" The convolutions differ: one reads its weight as the kernel, the other not. If f "
            "calls jnp.convolve or jnp.correlate: they take the shorter operand as the kernel, "
            "so a signal shorter than the filter makes the filter the input, another op; pass "
            "signals at least as long as the filter, or call lax.conv_general_dilated with the "
            "filter as the kernel.")


def check_argnums(qparams, argnums, fn):
    """Raises :class:`jqt.QParamsMismatchError` before ``f`` is traced where the qparams'
    ops read weights of arguments of ``f`` that ``argnums`` (this call's weight_argnums)
    does not name: the batch would be short of them, and ``f``'s signature error would
    speak of the batch."""
    calibrated = calibrated_args(qparams)
    # by count, not index: a wrapper may move the weight arguments, in order (quantize's rule)
    if len(calibrated) > len(argnums):
        raise QParamsMismatchError(
            f"{fn}: the qparams' ops read weights of {len(calibrated)} arguments of f "
            f"({calibrated} where they were calibrated), and this call's weight_argnums name "
            f"{len(argnums)} ({list(argnums)}): pass {fn} the weight_argnums jqt.calibrate was "
            "given, and the weights as a tuple of those arguments.")


def argnums_note(qparams, argnums, fn, params_t=None) -> str:
    """For an error raised while ``f`` is traced with ``argnums``: where the qparams' ops
    read weights of other arguments (as many: a wrapper that moved them, or the
    weight_argnums jqt.calibrate was given forgotten), the note that says which; where
    the tuple of weights ``params_t`` holds them in another order than ``argnums`` says
    (by the leaf paths the qparams record), which position holds which; else ""."""
    calibrated = calibrated_args(qparams)
    if calibrated and set(calibrated) == set(argnums) and params_t is not None and len(argnums) > 1:
        return _order_note(qparams, argnums, params_t, fn)
    if not calibrated or set(calibrated) <= set(argnums):
        return ""
    return (f"{fn}: the qparams' ops read weights of argument(s) {calibrated} of f where they "
            f"were calibrated, and this call's weight_argnums name {list(argnums)}: if f is the "
            f"function calibrated, pass {fn} the weight_argnums jqt.calibrate was given.")


def _order_note(qparams, argnums, params_t, fn) -> str:
    """:func:`argnums_note` where ``params_t[i]`` does not hold the weights argument
    ``argnums[i]``'s ops read and another position does."""
    from .analysis import path_str  # (analysis imports the tracing that imports this)
    held = [{(path_str(p), tuple(np.shape(x))) for p, x in jax.tree_util.tree_flatten_with_path(t)[0]}
            for t in params_t]
    want = {}
    for q in qparams.values():
        src = getattr(q, "source", None)
        if src is not None and "/" in src.path and src.shape is not None:
            want.setdefault(src.arg, set()).add((src.path.split("/", 1)[1], tuple(src.shape)))
    fits = lambda j, a: want.get(a, set()) <= held[j]
    for i, a in enumerate(argnums):
        if a in want and not fits(i, a):
            js = [j for j in range(len(params_t)) if j != i and fits(j, a)]
            if js:
                return (f"{fn}: weight_argnums={tuple(argnums)} puts params[{i}] in argument {a} "
                        f"of f, but the weights argument {a}'s ops read (by their paths and shapes) are "
                        f"params[{js[0]}]'s: give weight_argnums in the order of the params "
                        "tuple, as jqt.calibrate took them.")
    return ""


def _argnums(qparams, traced, fn) -> str:
    """A note when the qparams read weights of other arguments of f than this call's
    ``weight_argnums`` name, or of several where this call names one (its keys then lack
    the argument names), or the other way round."""
    calibrated = calibrated_args(qparams)
    called = sorted({a for a, _ in traced.leaf_paths})
    if not calibrated or not called or (set(calibrated) <= set(called)
                                        and (len(calibrated) > 1) == (len(called) > 1)):
        return ""
    return (f" The qparams' ops read weights of argument(s) {calibrated} of f, and this call's "
            f"weight_argnums name {called}: pass {'jqt.quantize' if fn == 'jqt' else fn} "
            "the weight_argnums jqt.calibrate was given.")


def _renamed_argument(extra, keys, qparams, prefixes) -> str:
    """A note when the keys differ only in their first part and the function's keys start
    with the names of its weight parameters (``prefixes``: with several weight arguments,
    or where the weight is one bare array): ``f`` wrapped by a function whose parameters
    have other names.

    >>> _renamed_argument(["enc/k"], ["arg0/k"], {"enc/k": None}, {"arg0"})[:48]
    ' The keys differ in their first part only, which'
    >>> _renamed_argument(["a"], ["b"], {"a": None}, set())  # another model
    ''
    """
    first = lambda k: k.split("/", 1)[0]
    rest = lambda k: k.split("/", 1)[1] if "/" in k else ""
    missing = [k for k in keys if k not in qparams]
    if not missing or not all(first(k) in prefixes for k in missing) \
            or sorted(map(rest, extra)) != sorted(map(rest, missing)):
        return ""
    return (" The keys differ in their first part only, which is the name of f's weight "
            "parameter (with several weight arguments, or a weight that is one bare array): "
            "f is wrapped by a function whose parameters have other names (a lambda *a, a "
            "decorator without functools.wraps). Keep f's signature, or re-calibrate.")


_ARRAY_PROTOCOLS = ("__array__", "__array_interface__", "__dlpack__", "__cuda_array_interface__")


def array_like(leaf) -> str | None:
    """Why ``leaf``, an object JAX reads as an array through ``__jax_array__`` (a
    ``keras.Variable``) but not an array, cannot be an argument leaf of ``f``: jqt would
    pass it as a static value, whose current value f then reads as a constant; so for an
    array of another library (``__array__``, ``__dlpack__``: a ``torch.Tensor``), which
    ``jax.jit`` refuses as an argument. ``None`` for anything else, and for the references
    :func:`tracing.refuse_mutable` names (a ``jax.Ref``, an nnx hijax Variable)."""
    if isinstance(leaf, (jax.Array, jax.Ref, np.ndarray, np.generic)):
        return None
    if not hasattr(type(leaf), "__jax_array__"):
        proto = next((a for a in _ARRAY_PROTOCOLS if hasattr(type(leaf), a)), None)
        if proto is None:
            return None
        return (f"a {type(leaf).__name__}, an array of another library (it has {proto}; a "
                "torch.Tensor from a DataLoader?), which JAX does not take: jqt would pass it "
                "to f as a static value, its values compiled in as constants (f compiled anew "
                "for each one). Pass a NumPy or JAX array: np.asarray(x) (a torch tensor: "
                "x.numpy(), or jax.dlpack.from_dlpack(x))")
    if type(leaf).__name__ == "HijaxVariable" or type(getattr(leaf, "aval", None)).__name__ == "AbstractVariable":
        return None
    return (f"a {type(leaf).__name__}, an array-like JAX reads through __jax_array__ (a "
            "keras.Variable?), not an array: jqt would pass it to f as a static value and f "
            "would read its current value as a constant. Pass its value (v.value, or "
            "jnp.asarray(v)); for a Keras model's variables, jqt.from_keras(model) gives f and "
            "params")


def _holds_array(v) -> bool:
    return isinstance(v, jax.Array) or isinstance(v, np.ndarray) and v.dtype != object


def opaque_container(leaf) -> str | None:
    """Why ``leaf``, an unhashable object JAX does not know as a pytree (a ``dict``
    subclass, a class never registered) that holds arrays, cannot be an argument leaf of
    ``f``: JAX reads it as one leaf, which jqt (as ``jax.jit``) could pass to ``f`` only
    whole, as a static value, and a static value must be hashable; ``None`` otherwise (a
    hashable object reaches ``f`` as it is, arrays and all, docs/guarantees.md).

    >>> class AttrDict(dict):
    ...     __getattr__ = dict.__getitem__
    >>> print(opaque_container(AttrDict(w=np.ones(2))))  # doctest: +ELLIPSIS
    an AttrDict, a dict subclass JAX does not know as a pytree, holding arrays (['w']) ...
    """
    if isinstance(leaf, (jax.Array, jax.Ref, np.ndarray, np.generic, str, bytes)) or compat.is_tracer(leaf) \
            or hasattr(type(leaf), "__jax_array__") or type(leaf).__name__ == "HijaxVariable":
        return None  # (array-likes and references: array_like and tracing.refuse_mutable)
    try:
        hash(leaf)
        return None
    except Exception:
        pass
    first = lambda items: [k for k, v in itertools.islice(items, 256) if _holds_array(v)]
    try:
        if isinstance(leaf, dict):
            kind, held = "dict subclass", first(leaf.items())
        elif isinstance(leaf, (list, tuple)):
            kind = f"{'list' if isinstance(leaf, list) else 'tuple'} subclass"
            held = first(enumerate(leaf))
        elif isinstance(leaf, type) or callable(leaf):
            return None  # a class or a function: not a container of weights
        else:
            kind, held = "class", first(vars(leaf).items())
    except Exception:  # no __dict__, or one that cannot be read (a lazy proxy)
        return None
    if not held:
        return None
    name = type(leaf).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    return (f"{article} {name}, a {kind} JAX does not know as a pytree, holding arrays "
            f"({held[:4]!r}{' ...' if len(held) > 4 else ''}) and not hashable: JAX reads it as "
            "one leaf, which jqt (as jax.jit) can pass to f only whole, as a static value, and a "
            "static value must be hashable (jqt could not quantize its arrays either). Register "
            "the class as a pytree (jax.tree_util.register_pytree_with_keys, or "
            "jax.tree_util.register_dataclass), or pass a plain container of its arrays "
            "(dict(p))")


def template_leaf(leaf) -> str | None:
    """Why ``leaf`` cannot be a weight: a ``jax.ShapeDtypeStruct`` (a template from
    ``jax.eval_shape``) where the arrays belong; ``None`` otherwise. (As a data argument it
    is a static value, a ``pure_callback``'s result spec, say.)"""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (f"a jax.ShapeDtypeStruct (shape {tuple(leaf.shape)}, {leaf.dtype}: a template, "
                "from jax.eval_shape), not an array: pass the arrays themselves (a template "
                "serves as jqt.load_packed's like=)")
    return None


def weight_leaf_problem(leaf) -> str | None:
    """Why ``leaf`` cannot be a leaf of the weights: :func:`array_like`,
    :func:`template_leaf` or :func:`opaque_container`'s reason, or ``None``."""
    return array_like(leaf) or template_leaf(leaf) or opaque_container(leaf)


def check_float_params(params_t, fn: str):
    """Raises ``TypeError`` when a weight argument is a :class:`jqt.PackedParams` (``fn``
    runs the float function on the float weights; ``params_t``: one per weight argnum), or
    holds an array-like that is not an array (:func:`array_like`)."""
    if any(isinstance(p, PackedParams) for p in params_t):
        raise TypeError(f"{fn}: params are jqt.PackedParams (from jqt.pack or jqt.load_packed); "
                        f"{fn} runs the float model, so pass the float params they were packed from.")
    refuse_array_likes(params_t[0] if len(params_t) == 1 else tuple(params_t), fn)


def refuse_array_likes(params, fn: str):
    """Raises ``TypeError`` naming the first leaf of ``params`` that
    :func:`weight_leaf_problem` refuses (as ``params['w']``: an array-like, a template, an
    unhashable container of arrays), or whose path holds a key that prints as its memory
    address, with its reason and fix."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        for k in path:  # a key jqt names an op by must name it the same way at every call
            part = next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k)
            if re.search(r" at 0x[0-9a-fA-F]+>", str(part)):
                raise TypeError(
                    f"{fn}: params{jax.tree_util.keystr(path)}: a pytree key "
                    f"({type(part).__name__}) prints as {str(part)!r}, its address in memory, "
                    "which differs between processes (and between flattens where the keys are "
                    "made anew), so the keys jqt gives the ops that read it would match no "
                    "other run (a file saved, qparams loaded). Give the key's class a __str__ "
                    "(or __repr__) naming the child, or use strings as keys.")
        why = weight_leaf_problem(leaf)
        if why is not None:
            raise TypeError(f"{fn}: params{jax.tree_util.keystr(path)} is {why}.")


def flags(fn: str, **values):
    """Raises ``TypeError`` for a flag that is not a bool (``progress`` may be ``None`` too):
    ``"no"`` would be taken by its truth value.

    >>> flags("jqt.calibrate", propagate="no")
    Traceback (most recent call last):
    ...
    TypeError: jqt.calibrate: propagate='no'; expected True or False.
    """
    for name, v in values.items():
        if (v is None and name == "progress") or isinstance(v, (bool, np.bool_)):
            continue
        also = " (or None: a bar where the output is a terminal)" if name == "progress" else ""
        raise TypeError(f"{fn}: {name}={v!r}; expected True or False{also}.")


def weight_args(params, argnums, fn: str) -> tuple:
    """``params`` as one pytree per weight argument (``argnums`` from
    ``normalize_argnums``), checked as :func:`check_float_params` checks them. With several
    weight arguments ``params`` must be a tuple or list of as many: a dict or an array
    would be split into its keys or rows.

    >>> weight_args({"w": 1}, (0, 2), "jqt.calibrate")
    Traceback (most recent call last):
    ...
    TypeError: jqt.calibrate: weight_argnums=(0, 2) names 2 weight arguments, so params must be a tuple of 2 pytrees (one per weight argument, in that order), not a dict.
    """
    if len(argnums) == 1:
        params_t = (params,)
    elif not isinstance(params, (tuple, list)):
        raise TypeError(f"{fn}: weight_argnums={argnums} names {len(argnums)} weight arguments, so "
                        f"params must be a tuple of {len(argnums)} pytrees (one per weight "
                        f"argument, in that order), not a {type(params).__name__}.")
    elif len(params) != len(argnums):
        raise TypeError(f"{fn}: weight_argnums={argnums} names {len(argnums)} weight arguments, but "
                        f"params holds {len(params)}; pass one pytree per weight argument, in that "
                        "order.")
    else:
        params_t = tuple(params)
    check_float_params(params_t, fn)
    return params_t


def check_mesh(mesh, fn: str, abstract: bool = False):
    """Raises ``TypeError`` where ``mesh`` is not a ``jax.sharding.Mesh`` (a list of
    devices, a device); with ``abstract``, a ``jax.sharding.AbstractMesh`` is taken too."""
    kinds = (jax.sharding.Mesh, jax.sharding.AbstractMesh) if abstract else jax.sharding.Mesh
    if not isinstance(mesh, kinds):
        raise TypeError(f"{fn}: mesh is a {type(mesh).__name__}; pass a jax.sharding.Mesh, e.g. "
                        "jax.sharding.Mesh(np.array(jax.devices()), ('data',)) for calibrate or "
                        "('model',) for packed_shardings.")
