"""Recipes: what jqt quantizes, and how.

A :class:`Recipe` is an ordered tuple of :class:`Rule` objects. For every
quantizable op in a function (``dot_general``, ``conv_general_dilated``, and
``gather`` from a weight: embedding lookups), the
first rule whose ``ops`` contains the op's primitive and whose ``key`` regex
matches the op's key (``re.search``) decides how it is quantized. An op that
no rule matches stays float, and :func:`jqt.calibrate` says so.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import re
from typing import Optional

import numpy as np

from .calibrators import Calibrator, MinMax, WeightCalibrator, WeightMinMax, WeightMSE
from . import accumulator, diagnostics, kvcache
from .formats import QuantType, as_scalar
from .registry import CONTRACTIONS, NAMES as QUANTIZABLE_OPS

# a Rule's fields that hold a jqt.QuantType (a rule that sets none keeps its ops float)
TYPE_FIELDS = ("weight", "activation", "act_x_act", "embedding", "kv_cache")


_DERIVED = (" A rule made from a preset's with dataclasses.replace keeps the preset's "
            "calibrators: to keep ops float, write a new rule, jqt.Rule(key=..., weight=None).")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
    """How the ops that match it are quantized.

    Attributes:
      key: a regular expression searched (``re.search``) in the op key, e.g.
        ``"Dense_0"`` or ``"^params/head/"``; the default matches every key.
      ops: primitive names the rule applies to.
      weight: type of the weight operand (the operand computed from the
        weights alone). ``None`` keeps the op float.
      activation: type of the data operand of a weight op. ``None`` with a
        ``weight`` type gives weight-only quantization.
      act_x_act: type of both operands of ops whose operands both depend on
        data (attention scores). Must be ``dynamic``; ``per_channel=True`` gives each
        row its own scale (as ``w8a8_dynamic(act_x_act=True)`` does), where the
        default, one scale per call, lets one example of a batch set every other's
        step. ``None`` (the default) keeps such ops float.
      embedding: type of a table read by a ``gather`` (an embedding lookup):
        weight-only, one scale per row (``per_channel``) or per group of a row.
        ``None`` keeps lookups float.
      calibrator: how static activation ranges are found
        (:mod:`jqt.calibrators`; default ``MinMax()``).
      weight_calibrator: how weight ranges are found (default
        ``WeightMinMax()``, the absolute maximum for symmetric types).
      smooth: SmoothQuant's migration strength ``alpha`` in ``[0, 1]``, or
        ``None``: each input channel ``j`` of a dense op gets the factor
        ``s_j = max|x_j|**alpha / max|w_j|**(1 - alpha)``; the activation is
        divided by it and the weight multiplied (exact in float).
      awq: AWQ: the smoothing factor ``s = mean|x|**a`` with ``a`` searched on a
        grid to minimize the op's output error with the weight quantized
        (measured with ``X^T X`` of its calibration inputs).
      rotate: rotate the contracted axes of dense ops by a Hadamard matrix
        (QuaRot): the weight once, the activation at run time.
      kv_cache: type of the key/value caches a loop carries and writes into
        (``dynamic_update_slice`` or ``.at[...].set`` of whole vectors into a
        ``lax.scan``/``lax.while_loop`` carry): symmetric, dynamic, one scale
        per vector of the buffer's last axis (per token and head), e.g.
        ``jqt.recipes.KV_INT8``; ``None`` keeps caches float. See
        docs/generate.md.
      accumulator: the width in bits of the integer accumulator of the matched
        int x int ops: 32 (the default: jqt's int32, which never overflows) or
        16-31 to simulate an accelerator's narrower accumulator, which
        saturates; :func:`jqt.report` shows the fraction of outputs that
        saturated (see docs/guarantees.md). Needs integer weights and
        activations of at most 8 bits, per tensor or per channel.

    ``smooth``, ``awq`` and ``rotate`` apply to ``dot_general`` ops with a weight
    and no batch axes (dense layers, projections); see docs/outliers.md.

    A rule with ``weight=None`` and ``act_x_act``, ``embedding`` and ``kv_cache`` left
    at ``None`` keeps the matched ops float:

    >>> import jqt
    >>> keep_head_float = jqt.Rule(key="head", weight=None)
    >>> keep_head_float.weight is None
    True
    """

    key: str = ".*"
    ops: tuple[str, ...] = QUANTIZABLE_OPS
    weight: Optional[QuantType] = None
    activation: Optional[QuantType] = None
    act_x_act: Optional[QuantType] = None
    embedding: Optional[QuantType] = None
    calibrator: Calibrator = MinMax()
    weight_calibrator: WeightCalibrator = WeightMinMax()
    smooth: Optional[float] = None
    awq: bool = False
    rotate: bool = False
    kv_cache: Optional[QuantType] = None
    accumulator: int = 32

    def __post_init__(self):
        if not isinstance(self.key, str):
            raise TypeError(f"Rule(key={self.key!r}): expected a regular expression string matched "
                            "against the op keys (jqt.summarize lists them), e.g. key='attn' or "
                            "key='.*' for every op.")
        try:
            re.compile(self.key)
        except re.error as e:
            raise ValueError(f"Rule(key={self.key!r}) is not a valid regular expression: {e}") from None
        for name in ("awq", "rotate"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise TypeError(f"Rule({name}={v!r}): expected True or False"
                                + (" (SmoothQuant's alpha is smooth=, a number in [0, 1])"
                                   if name == "awq" and isinstance(v, (int, float)) else "") + ".")
            object.__setattr__(self, name, bool(v))  # (np.True_ prints and pickles as NumPy's)
        if isinstance(self.ops, str):
            raise TypeError(f"Rule(ops={self.ops!r}) must be a tuple of primitive names, "
                            f"e.g. ops=({self.ops!r},).")
        try:
            ops = tuple(self.ops)  # a list too: a Rule is hashable
        except TypeError:  # None, a primitive object
            name = getattr(self.ops, "name", None)
            raise TypeError(f"Rule(ops={self.ops!r}) must be a tuple of primitive names, e.g. "
                            f"ops=({name if isinstance(name, str) else 'dot_general'!r},); leave "
                            "ops= out for every op jqt quantizes.") from None
        prims = [o for o in ops if not isinstance(o, str) and getattr(o, "name", None) in QUANTIZABLE_OPS]
        if prims:  # lax.dot_general_p: it prints as its name, and was refused as if unknown
            raise TypeError(f"Rule(ops=...) names the primitive object {prims[0].name}_p; ops= takes "
                            f"primitive names as strings: ops=({prims[0].name!r},).")
        bad = [o for o in ops if o not in QUANTIZABLE_OPS]
        if bad:
            seen_as = {"dynamic_slice": "a row lookup table[i] is matched as 'gather'",
                       "dot": "a matmul x @ w, jnp.dot and einsum are 'dot_general'",
                       "matmul": "a matmul x @ w, jnp.dot and einsum are 'dot_general'",
                       "einsum": "a matmul x @ w, jnp.dot and einsum are 'dot_general'",
                       "conv": "convolutions are 'conv_general_dilated'",
                       "take": "jnp.take and table[ids] are 'gather'",
                       "embedding": "an embedding lookup is 'gather'"}
            hints = list(dict.fromkeys(seen_as[o] for o in bad if o in seen_as))
            raise ValueError(f"Rule(ops=...) names {bad}; jqt quantizes {list(QUANTIZABLE_OPS)}"
                             + (f" ({'; '.join(hints)})" if hints else "") + ".")
        # in jqt's order, each once: rules that match the same ops compare equal (one
        # jit trace as a static argument), whatever order or container named them
        object.__setattr__(self, "ops", tuple(o for o in QUANTIZABLE_OPS if o in ops))
        if not self.ops:
            raise ValueError("Rule(ops=()) names no op, so the rule matches none; leave ops= out "
                             f"for every op jqt quantizes, or name some of {list(QUANTIZABLE_OPS)}.")
        cache_float = self.kv_cache is False or isinstance(self.kv_cache, np.bool_) and not self.kv_cache
        if self.kv_cache is not None and not isinstance(self.kv_cache, QuantType):
            # the names the presets take (kv_cache=True, "int4", "fp8", ...); False: float
            object.__setattr__(self, "kv_cache", kvcache.cache_type(self.kv_cache))
        for name in TYPE_FIELDS:
            t = getattr(self, name)
            if t is not None and not isinstance(t, QuantType):
                raise TypeError(f"Rule({name}={t!r}): expected a jqt.QuantType (e.g. "
                                "jqt.QuantType(bits=8) or jqt.QuantType(dtype='nf4', group_size=64)) "
                                "or None; the presets in jqt.recipes build them.")
        if self.activation is not None and self.weight is None:
            raise ValueError(
                "Rule(activation=..., weight=None): an integer kernel needs both operands as "
                "integers. Set weight=QuantType(...) too, or drop activation to keep the op float. "
                "An op whose operands are both activations (attention's q @ k.T and p @ v) takes "
                "act_x_act=QuantType(bits=8, dynamic=True) instead.")
        if self.weight is not None and self.weight.dynamic:
            raise ValueError("Rule(weight=QuantType(dynamic=True)): weights are quantized from "
                             "their own values; 'dynamic' applies to activations only.")
        if (self.activation is not None and self.activation.per_channel and not self.activation.dynamic
                and not self.activation.group_size):  # (groups: refused below, by name)
            raise ValueError(
                "Rule(activation=QuantType(per_channel=True, dynamic=False)): static activation "
                "scales are per-tensor (a per-token scale changes with every input). Use "
                "dynamic=True for per-token scales.")
        if self.weight is not None and self.weight.bits > 8:
            raise ValueError(f"Rule(weight=QuantType(bits={self.weight.bits})): weights are stored "
                             "in int8; use bits <= 8 (int16 is for activations).")
        if self.act_x_act is not None and self.act_x_act.bits > 8:
            raise ValueError(f"Rule(act_x_act=QuantType(bits={self.act_x_act.bits})): "
                             "activation x activation ops take 2 to 8 bits (or an fp8 dtype, "
                             "'float8_e4m3fn' or 'float8_e5m2'); use bits <= 8.")
        for name, kind, such in (("calibrator", Calibrator, "Percentile(99.99)"),
                                 ("weight_calibrator", WeightCalibrator, "WeightMSE()")):
            c = getattr(self, name)
            if not isinstance(c, kind):
                made = (f" (the class itself: make one, {c.__name__}())"
                        if isinstance(c, type) and issubclass(c, kind) else "")
                raise TypeError(f"Rule({name}={c!r}): expected a jqt.calibrators.{kind.__name__} "
                                f"such as jqt.calibrators.{such}{made}.")
        for name in ("calibrator", "weight_calibrator"):
            c = getattr(self, name)
            try:
                hash(c)  # a Rule is hashable (a jit static argument, a cache key)
            except TypeError as e:
                own = type(c).__dict__.get("__dataclass_params__")  # not a base class's
                frozen = own is not None and own.frozen
                fix = (f"a field of it is not ({e}); hold lists as tuples and dicts as tuples "
                       "of pairs" if frozen else "declare it @dataclasses.dataclass(frozen=True), "
                       "as jqt's calibrators are")
                raise TypeError(f"Rule({name}={c!r}): {type(c).__name__} is not hashable; "
                                f"{fix}.") from None
        if self.activation is not None and not self.activation.dynamic:
            self.calibrator.check(self.activation)
        elif self.calibrator != MinMax():
            raise ValueError(
                f"Rule(calibrator={self.calibrator!r}): a calibrator finds static activation "
                "ranges, and this rule has none ("
                + ("activation=None" if self.activation is None else "its activations are dynamic: "
                   "their scales come from each input at run time")
                + "); drop calibrator=, or give a static activation type." + _DERIVED)
        if self.weight is None and self.embedding is None and self.weight_calibrator != WeightMinMax():
            # warned, not refused: a preset's rule made float with dataclasses.replace keeps
            # the preset's weight calibrator (the 4-bit presets' WeightMSE), harmlessly
            diagnostics.warn(
                f"jqt.Rule(key={self.key!r}, weight_calibrator={self.weight_calibrator!r}): a weight "
                "calibrator finds the ranges of weights and embedding tables, and this rule "
                "quantizes neither (weight=None, embedding=None), so it has no effect; drop "
                "weight_calibrator=, or give a weight or embedding type." + _DERIVED)

        if self.weight is not None and self.embedding is None and set(self.ops) <= {"gather"}:
            raise ValueError(f"Rule(ops={self.ops}, weight=...): an embedding lookup's table takes "
                             "its type from embedding=, not weight=; set embedding=QuantType(...).")
        writes = {"dynamic_update_slice", "scatter"}
        if (self.weight is not None or self.activation is not None) and self.kv_cache is None \
                and not cache_float and set(self.ops) <= writes:
            raise ValueError(f"Rule(ops={self.ops}, {'weight' if self.weight is not None else 'activation'}"
                             "=...): a key/value cache write takes its type from kv_cache=, not "
                             "weight= or activation=; set kv_cache=True (int8), 'int4' or 'fp8', "
                             "or kv_cache=False (or weight=None) to keep the caches float.")
        for name in ("activation", "act_x_act"):
            t = getattr(self, name)
            if t is not None and t.kind == "lut":
                raise ValueError(f"Rule({name}=QuantType(dtype='nf4')): nf4 is a weight format "
                                 "(a lookup table, no arithmetic); use it for weight= with "
                                 "activation=None.")
            if t is not None and t.group_size:
                raise ValueError(f"Rule({name}=QuantType(group_size=...)): per-group scales are for "
                                 "weights; use per_channel=True with dynamic=True for per-token "
                                 "activation scales.")
        if self.weight is not None and self.activation is not None:
            if self.weight.kind == "lut":
                raise ValueError("Rule(weight=QuantType(dtype='nf4'), activation=...): nf4 weights "
                                 "are decoded by lookup and multiplied in float; set activation=None.")
            if (self.weight.kind == "float") != (self.activation.kind == "float"):
                raise ValueError(
                    f"Rule(weight={self.weight.dtype}, activation={self.activation.dtype}): an "
                    "integer kernel needs integer operands and an fp8 kernel fp8 operands; use "
                    "fp8 for both (jqt.recipes.fp8()) or integers for both.")
        if self.embedding is not None and (self.embedding.dynamic or self.embedding.bits > 8):
            raise ValueError(f"Rule(embedding={self.embedding!r}): embedding tables are weights: "
                             "static, at most 8 bits.")
        self._check_outliers()
        if self.kv_cache is not None:
            kvcache.check_type(self.kv_cache, "Rule(kv_cache=...)")
        if self.act_x_act is not None and not self.act_x_act.dynamic:
            raise ValueError("Rule(act_x_act=...): activation x activation ops have no calibrated "
                             "operand; use QuantType(dynamic=True, ...).")
        self._check_accumulator()

    def _check_accumulator(self):
        bits = as_scalar(self.accumulator)  # a NumPy integer (a sweep over np.arange) as an int
        if isinstance(bits, numbers.Integral) and not isinstance(bits, (bool, np.bool_)):
            object.__setattr__(self, "accumulator", int(bits))
        accumulator.check_bits(self.accumulator, "Rule", call=True)
        if self.accumulator == accumulator.WIDEST:
            return
        # weight ops (if the rule quantizes any) and act x act ops (if it quantizes those)
        why = ""
        if not set(self.ops) & set(CONTRACTIONS):
            why = (f"it applies to int x int dot and conv ops, and this rule matches only "
                   f"ops={tuple(self.ops)} (lookups and cache writes have no accumulator)")
        elif self.weight is None and self.act_x_act is None:
            why = ("it applies to int x int dot and conv ops, and this rule quantizes none (no "
                   "weight=, no act_x_act=: lookups and cache writes have no accumulator)")
        elif self.weight is not None:
            why = accumulator.unsupported([self.weight, self.activation])  # (act_x_act= types
            # the products of two activations, not a weight op's activation: without
            # activation= the weight ops are weight-only, which have no integer accumulator)
        if self.act_x_act is not None and not why:
            why = accumulator.unsupported([self.act_x_act])
        if why:
            raise ValueError(f"Rule(accumulator={self.accumulator}): {why}. A narrow accumulator "
                             "is simulated for integer operands of at most 8 bits with per-tensor "
                             "or per-channel scales, e.g. jqt.recipes.w8a8(accumulator=16).")

    def _check_outliers(self):
        if self.smooth is not None:
            object.__setattr__(self, "smooth", as_scalar(self.smooth))  # a 0-d array: its number
            if isinstance(self.smooth, (bool, str)) or not isinstance(self.smooth, (int, float, np.number)) \
                    or not 0.0 <= float(self.smooth) <= 1.0:
                raise ValueError(f"Rule(smooth={self.smooth!r}): SmoothQuant's alpha is a number in "
                                 "[0, 1] (0.5 is the paper's default), or None for no smoothing.")
            if self.activation is None:
                raise ValueError("Rule(smooth=..., activation=None): smoothing moves activation "
                                 "outliers into the weights, so it needs quantized activations; for "
                                 "weight-only recipes use awq=True.")
            if self.awq:
                raise ValueError("Rule(smooth=..., awq=True): both set the per-channel smoothing "
                                 "factor; pick one.")
        if (self.awq or self.rotate or self.smooth is not None) and self.weight is None:
            raise ValueError("Rule(smooth/awq/rotate=...) with weight=None: the outlier algorithms "
                             "transform quantized weights; set weight=QuantType(...).")

    def matches(self, op: str, key: str) -> bool:
        """Whether this rule applies to the op ``op`` (a primitive name) with key ``key``."""
        return op in self.ops and re.search(self.key, key) is not None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
    """An ordered tuple of rules; the first rule that matches an op decides.

    >>> import jqt
    >>> r = jqt.Recipe(rules=(jqt.Rule(key="head", weight=None),) + jqt.recipes.w8a8().rules)
    >>> r.rule_for("dot_general", "params/head/kernel").weight is None
    True
    >>> r.rule_for("dot_general", "params/Dense_0/kernel").weight.bits
    8
    """

    rules: tuple[Rule, ...]

    def __post_init__(self):
        if isinstance(self.rules, Rule):
            object.__setattr__(self, "rules", (self.rules,))
        if isinstance(self.rules, Recipe):
            raise TypeError("Recipe(rules=<a Recipe>): expected a tuple of jqt.Rule; pass "
                            "recipe.rules (or join recipes: recipe_a.rules + recipe_b.rules).")
        if isinstance(self.rules, (set, frozenset)):  # its order changes from run to run
            raise TypeError("Recipe(rules=<a set>): rules are ordered (the first that matches "
                            "an op decides), and a set's order changes from run to run; pass a "
                            "tuple, e.g. rules=(my_rule, *preset.rules).")
        try:
            object.__setattr__(self, "rules", tuple(self.rules))
        except TypeError:
            raise TypeError(f"Recipe(rules={self.rules!r}): expected a tuple of jqt.Rule, e.g. "
                            "rules=(jqt.Rule(key='head', weight=None),) + "
                            "jqt.recipes.w8a8().rules.") from None
        for r in self.rules:
            if isinstance(r, Recipe) or isinstance(r, (tuple, list)) and all(isinstance(e, Rule) for e in r):
                what = "a Recipe" if isinstance(r, Recipe) else f"a {type(r).__name__} of rules"
                raise TypeError(f"Recipe(rules=...) holds {what}; expected jqt.Rule. Unpack it: "
                                "rules=(my_rule, *preset.rules), or my_rules + preset.rules.")
            if not isinstance(r, Rule):
                raise TypeError(f"Recipe(rules=...) holds {type(r).__name__}; expected jqt.Rule.")

    def rule_for(self, op: str, key: str) -> Optional[Rule]:
        """The first rule that matches, or ``None`` (the op stays float)."""
        for r in self.rules:
            if r.matches(op, key):
                return r
        return None


INT8_WEIGHT = QuantType(bits=8, symmetric=True, narrow_range=True, per_channel=True)
"""The weight type of the int8 presets: symmetric, narrow range (-127..127), per channel.

>>> import jqt
>>> jqt.recipes.INT8_WEIGHT.qmin, jqt.recipes.INT8_WEIGHT.per_channel
(-127, True)
"""


KV_INT8 = kvcache.INT8
"""The key/value cache type of ``kv_cache=True``: int8 codes (-127..127), symmetric,
one scale per token and head computed at each write.

>>> import jqt
>>> jqt.recipes.KV_INT8.describe(), jqt.recipes.w8a8_dynamic(kv_cache="int4").rules[0].kv_cache.bits
('int8 sym per-row dynamic', 4)
"""


WEIGHT_MSE_4BIT = WeightMSE(candidates=20, min_ratio=0.5)
"""The weight calibrator of the 4-bit presets (:func:`w4`, :func:`w4a8`, :func:`nf4`):
each channel's or group's range shrunk by the factor between 1 and 0.5 (20 candidates)
whose rounded weight has the lowest squared error. Still plain rounding to the nearest
code: only the scale is searched. With 15 or 16 levels the absolute maximum wastes
codes on a group's one largest weight; on all-MiniLM-L6-v2 and the example decoder this
lowered the error of every 4-bit preset measured against ``WeightMinMax()`` (the int8
presets' default, which ``weight_calibrator=jqt.calibrators.WeightMinMax()`` restores;
docs/formats.md).

>>> import jqt
>>> jqt.recipes.w4().rules[0].weight_calibrator == jqt.recipes.WEIGHT_MSE_4BIT
True
>>> jqt.recipes.w8().rules[0].weight_calibrator
WeightMinMax()
"""


def _cal(calibrator, weight_calibrator, default_weight=WeightMinMax()):
    # (None is the default: another falsy value, False or [], is refused by Rule by name)
    return dict(calibrator=MinMax() if calibrator is None else calibrator,
                weight_calibrator=default_weight if weight_calibrator is None else weight_calibrator)


def _int_weight(bits, group_size, per_channel=True, symmetric=True):
    return QuantType(bits=bits, symmetric=symmetric, narrow_range=symmetric, per_channel=per_channel,
                     group_size=group_size or 0)


def _embedding(embeddings, bits, group_size=0, table=None):
    """Per-row (or per-group) symmetric tables for every gather (``table``, or int ``bits``),
    or ``None``."""
    if not isinstance(embeddings, (bool, np.bool_)):
        raise TypeError(f"embeddings={embeddings!r}: expected True (the preset's table type) or "
                        "False (float lookups); for another type put a rule ahead of the "
                        "preset's, jqt.Rule(ops=('gather',), embedding=jqt.QuantType(...)).")
    if not embeddings:
        return None
    return table if table is not None else _int_weight(bits, group_size)


def _groups(preset, v):
    """A preset's ``group_size`` (0 or ``None``: per channel), checked here so that the error
    names the preset's argument, not the QuantType field it fills."""
    v = as_scalar(v)
    if isinstance(v, np.integer):
        v = int(v)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ValueError(f"jqt.recipes.{preset}(group_size={v!r}): expected 0 (one scale per "
                         "output channel) or a positive group length such as 128.")
    return v or 0


def _preset(fn):
    """A preset whose argument errors name it: ``Rule(awq='yes'): ...`` (the rule it builds)
    or ``awq='yes': ...`` (its own checks) read ``jqt.recipes.w4(awq='yes'): ...``."""
    @functools.wraps(fn)
    def preset(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError) as e:
            m = re.match(r"(Rule\()?(\w+)=", str(e))
            if m is None or m.group(2) not in kwargs or len(e.args) != 1:
                raise
            v = repr(kwargs[m.group(2)]) + (")" if m.group(1) else "")
            rest = str(e)[m.end():]
            if not rest.startswith(v):  # a value the preset made from the argument
                raise
            raise type(e)(f"jqt.recipes.{fn.__name__}({m.group(2)}={v}{'' if m.group(1) else ')'}"
                          f"{rest[len(v):]}").with_traceback(e.__traceback__) from e.__cause__
    return preset


def _flag(name, v):
    """A preset's boolean argument ``name``, checked (``None`` or ``"no"`` are not taken by
    their truth value)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name}={v!r}: expected True or False.")
    return bool(v)


def symmetric_convs(rule: Rule) -> tuple:
    """A preset's rules: ``rule``, after a rule that gives convolutions its weight type
    made symmetric where it is not (conv weights take no zero point, as tables do not;
    ``symmetric=False`` is for the dense ops' weights), on the narrow grid of the symmetric
    presets (``-7..7`` at 4 bits), and without groups (per channel, or per tensor where the
    rule is: a group size there would warn of a rule the user did not write). It sets no
    ``embedding=`` or ``kv_cache=``, which a rule of convs alone would hold unused.

    >>> r = symmetric_convs(Rule(weight=QuantType(bits=4, symmetric=False, group_size=32)))
    >>> [(x.ops[0], x.weight.describe(), x.weight.narrow_range) for x in r]
    [('conv_general_dilated', 'int4 sym per-channel', True), ('dot_general', 'int4 asym g32', False)]
    """
    if rule.weight is None or rule.weight.symmetric:
        return (rule,)
    conv = dataclasses.replace(rule, ops=("conv_general_dilated",), embedding=None, kv_cache=None,
                               weight=dataclasses.replace(rule.weight, symmetric=True, group_size=0,
                                                          narrow_range=rule.weight.kind == "int"))
    return (conv, rule)


@_preset
def w8a8(*, act_symmetric: bool = False, group_size: int = 0, embeddings: bool = True,
         calibrator=None, weight_calibrator=None, smooth: Optional[float] = None,
         rotate: bool = False, kv_cache=False, accumulator: int = 32) -> Recipe:
    """int8 per-channel symmetric weights, int8 static per-tensor activations, int8
    embedding tables (one scale per row, or per group of ``group_size``, as the weights).

    Activations are asymmetric by default: the output of a GELU or ReLU is
    mostly non-negative, and a symmetric range would leave half the codes
    unused. ``group_size`` gives the weights one scale per group of inputs;
    ``embeddings=False`` keeps embedding lookups float. ``smooth=0.5`` applies
    SmoothQuant with that alpha, ``rotate=True`` a Hadamard rotation,
    ``accumulator=16`` simulates a 16-bit saturating accumulator (see
    :class:`jqt.Rule`).

    >>> import jqt
    >>> r = jqt.recipes.w8a8()
    >>> r.rules[0].activation.symmetric, r.rules[0].embedding.dtype
    (False, 'int8')
    >>> jqt.recipes.w8a8(smooth=0.5).rules[0].smooth
    0.5
    """
    group_size = _groups("w8a8", group_size)
    return Recipe(rules=(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=_int_weight(8, group_size),
                              activation=QuantType(bits=8, symmetric=_flag("act_symmetric", act_symmetric)),
                              embedding=_embedding(embeddings, 8, group_size), smooth=smooth, rotate=rotate,
                              accumulator=accumulator, **_cal(calibrator, weight_calibrator)),))


@_preset
def w8a8_dynamic(*, act_x_act: bool = False, embeddings: bool = True, weight_calibrator=None,
                 smooth: Optional[float] = None, rotate: bool = False, kv_cache=False,
                 accumulator: int = 32) -> Recipe:
    """int8 per-channel weights, int8 activations with per-token scales computed at run
    time, int8 embedding tables.

    With ``act_x_act=True`` activation x activation ops (attention) are
    quantized dynamically too. ``smooth``, ``rotate`` and ``accumulator`` as in
    :func:`w8a8`.

    >>> import jqt
    >>> jqt.recipes.w8a8_dynamic().rules[0].activation.dynamic
    True
    """
    act = QuantType(bits=8, symmetric=False, per_channel=True, dynamic=True)
    return Recipe(rules=(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=INT8_WEIGHT, activation=act,
                              act_x_act=act if _flag("act_x_act", act_x_act) else None,
                              embedding=_embedding(embeddings, 8), smooth=smooth, rotate=rotate,
                              accumulator=accumulator, **_cal(None, weight_calibrator)),))


@_preset
def w8(*, group_size: int = 0, embeddings: bool = True, weight_calibrator=None, awq: bool = False,
       rotate: bool = False,
        kv_cache=False) -> Recipe:
    """Weight-only int8 (per-channel, or per group of ``group_size`` inputs), int8
    embedding tables (grouped as the weights); activations stay float. ``awq=True`` searches AWQ's
    per-channel scales, ``rotate=True`` applies a Hadamard rotation.

    >>> import jqt
    >>> jqt.recipes.w8().rules[0].activation is None
    True
    """
    group_size = _groups("w8", group_size)
    return Recipe(rules=(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=_int_weight(8, group_size), activation=None,
                              embedding=_embedding(embeddings, 8, group_size), awq=awq, rotate=rotate,
                              **_cal(None, weight_calibrator)),))


@_preset
def w8a16(*, embeddings: bool = True, calibrator=None, weight_calibrator=None,
        kv_cache=False) -> Recipe:
    """int8 per-channel weights, int16 symmetric static per-tensor activations.

    The precise fallback for an op whose activations int8 cannot hold (outlier
    channels): 256 times finer steps than int8 on the same range.

    >>> import jqt
    >>> jqt.recipes.w8a16().rules[0].activation.storage
    dtype('int16')
    """
    return Recipe(rules=(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=INT8_WEIGHT, activation=QuantType(bits=16, symmetric=True),
                              embedding=_embedding(embeddings, 8), **_cal(calibrator, weight_calibrator)),))


@_preset
def w4a8(*, group_size: int = 0, per_channel: bool = True, symmetric: bool = True,
         embeddings: bool = True, calibrator=None, weight_calibrator=None,
         smooth: Optional[float] = None, awq: bool = False, rotate: bool = False,
        kv_cache=False) -> Recipe:
    """int4 weights (per-channel by default, or per group of ``group_size`` inputs) with
    int8 static activations; int4 embedding tables.

    The int4 x int8 products sum in int32 per group and are scaled per group.
    ``per_channel=False`` gives each dense weight one scale (per tensor; embedding tables
    stay per row); it cannot be combined with ``group_size``, whose groups are per output
    channel. ``symmetric=False`` gives each weight group of the dense ops a zero point too
    (embedding tables and convolution kernels stay symmetric). ``smooth``, ``awq`` and ``rotate`` select the outlier algorithms (:class:`jqt.Rule`).
    Weight ranges are clipped at their squared-error optimum
    (:data:`WEIGHT_MSE_4BIT`) unless ``weight_calibrator`` says otherwise.

    >>> import jqt
    >>> jqt.recipes.w4a8(group_size=128).rules[0].weight.describe()
    'int4 sym g128'
    >>> jqt.recipes.w4a8(rotate=True).rules[0].rotate
    True
    """
    group_size = _groups("w4a8", group_size)
    per_channel, symmetric = _flag("per_channel", per_channel), _flag("symmetric", symmetric)
    if group_size and not per_channel:
        raise ValueError(f"jqt.recipes.w4a8(group_size={group_size}, per_channel=False): groups lie within each "
                         "output channel, so a grouped weight is per channel; drop per_channel=False "
                         "(groups) or group_size (one scale per weight).")
    return Recipe(rules=symmetric_convs(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=_int_weight(4, group_size, per_channel, symmetric),
                              activation=QuantType(bits=8, symmetric=False),
                              embedding=_embedding(embeddings, 4, group_size),
                              smooth=smooth, awq=awq, rotate=rotate,
                              **_cal(calibrator, weight_calibrator, WEIGHT_MSE_4BIT))))


@_preset
def w4(*, group_size: int = 128, symmetric: bool = True, embeddings: bool = True,
       weight_calibrator=None, awq: bool = False, rotate: bool = False,
        kv_cache=False) -> Recipe:
    """Weight-only int4 with one scale per group of ``group_size`` inputs (0: per
    channel), stored two per byte; int4 embedding tables.

    ``symmetric=False`` gives each group of the dense ops' weights a zero point as well
    (the range ``[min, max]`` instead of ``[-absmax, absmax]``; embedding tables and
    convolution kernels stay symmetric): more accurate on skewed groups (on all-MiniLM-L6-v2, see
    docs/formats.md), one more subtraction per weight element when decoding. ``awq=True`` searches AWQ's
    per-input-channel scales; ``rotate=True`` applies a Hadamard rotation
    (:class:`jqt.Rule`); :func:`jqt.gptq` re-rounds the weights afterwards. Each
    group's range is clipped at its squared-error optimum (:data:`WEIGHT_MSE_4BIT`;
    ``weight_calibrator=jqt.calibrators.WeightMinMax()`` keeps the absolute maximum).

    >>> import jqt
    >>> jqt.recipes.w4().rules[0].weight.describe()
    'int4 sym g128'
    >>> jqt.recipes.w4(awq=True).rules[0].awq
    True
    """
    group_size = _groups("w4", group_size)
    return Recipe(rules=symmetric_convs(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=_int_weight(4, group_size, symmetric=_flag("symmetric", symmetric)),
                              activation=None,
                              embedding=_embedding(embeddings, 4, group_size), awq=awq, rotate=rotate,
                              **_cal(None, weight_calibrator, WEIGHT_MSE_4BIT))))


@_preset
def nf4(*, group_size: int = 64, embeddings: bool = True, weight_calibrator=None,
        awq: bool = False, rotate: bool = False,
        kv_cache=False) -> Recipe:
    """Weight-only 4-bit NormalFloat (QLoRA's format) with one scale per group of
    ``group_size`` inputs (0 or ``None``: per channel, as in :func:`w4`), decoded by lookup; nf4
    embedding tables; ``awq=True``, ``rotate=True`` and the clipped ranges
    (:data:`WEIGHT_MSE_4BIT`) as in :func:`w4`.

    >>> import jqt
    >>> jqt.recipes.nf4().rules[0].weight.describe(), jqt.recipes.nf4(group_size=0).rules[0].weight.describe()
    ('nf4 sym g64', 'nf4 sym per-channel')
    >>> jqt.recipes.nf4(rotate=True).rules[0].rotate
    True
    """
    t = QuantType(dtype="nf4", group_size=_groups("nf4", group_size), per_channel=True)
    return Recipe(rules=(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=t, activation=None, embedding=_embedding(embeddings, 4, table=t),
                              awq=awq, rotate=rotate,
                              **_cal(None, weight_calibrator, WEIGHT_MSE_4BIT)),))


def _fp8_type(name, v, **kw):
    """``QuantType(dtype=v, **kw)`` for :func:`fp8`'s argument ``name``: an fp8 dtype, named or
    given as a dtype (``jnp.float8_e5m2``), else fp8's error."""
    try:
        t = QuantType(dtype=v, **kw)
    except (TypeError, ValueError):
        t = None
    if t is None or t.dtype not in ("float8_e4m3fn", "float8_e5m2"):
        raise ValueError(f"jqt.recipes.fp8({name}={v!r}): takes 'float8_e4m3fn' or 'float8_e5m2' "
                         "(or jnp.float8_e4m3fn, jnp.float8_e5m2). For other formats take their "
                         "preset: jqt.recipes.w8a8() (int8), w4() (int4), nf4(); or a Rule of your own.")
    return t


@_preset
def fp8(*, dynamic: bool = False, weight_dtype: str = "float8_e4m3fn",
        act_dtype: str = "float8_e4m3fn", embeddings: bool = True, calibrator=None,
        weight_calibrator=None, smooth: Optional[float] = None, rotate: bool = False,
        kv_cache=False) -> Recipe:
    """fp8 weights (per channel) and fp8 activations (static per-tensor, or per-token
    with ``dynamic=True``), e4m3 by default: ``weight_dtype`` and ``act_dtype`` each take
    ``"float8_e4m3fn"`` or ``"float8_e5m2"`` (wider range, fewer mantissa bits: gradients'
    format); int8 embedding tables. ``smooth`` and ``rotate`` are accepted as for the
    integer presets, but an e4m3 grid keeps its relative error over its whole range, and
    on all-MiniLM-L6-v2 neither helped (docs/outliers.md, Measured).

    >>> import jqt
    >>> r = jqt.recipes.fp8()
    >>> r.rules[0].weight.dtype, r.rules[0].activation.qmax
    ('float8_e4m3fn', 448.0)
    """
    dynamic = _flag("dynamic", dynamic)
    w, a = (_fp8_type(n, v, per_channel=c, dynamic=d) for n, v, c, d in (
        ("weight_dtype", weight_dtype, True, False), ("act_dtype", act_dtype, dynamic, dynamic)))
    return Recipe(rules=(Rule(kv_cache=kvcache.cache_type(kv_cache),
                              weight=w, activation=a, embedding=_embedding(embeddings, 8),
                              smooth=smooth, rotate=rotate, **_cal(calibrator, weight_calibrator)),))
