"""Recipes: what jqt quantizes, and how.

A :class:`Recipe` is an ordered tuple of :class:`Rule` objects. For every
quantizable op in a function (``dot_general``, ``conv_general_dilated``), the
first rule whose ``ops`` contains the op's primitive and whose ``key`` regex
matches the op's key (``re.search``) decides how it is quantized. An op that
no rule matches stays float, and :func:`jqt.calibrate` says so.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

from .calibrators import Calibrator, MinMax, WeightCalibrator, WeightMinMax

QUANTIZABLE_OPS = ("dot_general", "conv_general_dilated")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantType:
    """How one operand is quantized.

    Attributes:
      bits: integer width: 2 to 8 (stored in int8), or 9 to 16 for
        activations (stored in int16; symmetric only; each int16 x int8
        product runs as two int8 x int8 -> int32 kernels, see ``kernels.py``).
      symmetric: zero point fixed at 0 (scale from the absolute maximum) when
        True; an asymmetric range (scale and zero point from min and max) when
        False.
      narrow_range: use ``[-(2**(bits-1) - 1), 2**(bits-1) - 1]`` (e.g. -127..127),
        so that the range is symmetric around zero.
      per_channel: one scale per output channel for weights (every axis that
        is not contracted); for dynamic activations, one scale per token (every
        non-contracted axis) of a ``dot_general`` and one per example of a
        convolution. Static activations are per-tensor.
      dynamic: for activations: compute the scale from the live tensor at run
        time instead of from calibration statistics.

    >>> import jqt
    >>> jqt.QuantType(bits=8, symmetric=True, per_channel=True).qmin
    -128
    >>> jqt.QuantType(bits=8, narrow_range=True).qmin
    -127
    """

    bits: int = 8
    symmetric: bool = True
    narrow_range: bool = False
    per_channel: bool = False
    dynamic: bool = False

    def __post_init__(self):
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 16:
            raise ValueError(
                f"QuantType(bits={self.bits!r}): jqt stores integer values in int8 or int16, "
                "so bits must be an int from 2 to 16.")
        if self.bits > 8 and not self.symmetric:
            raise ValueError(
                f"QuantType(bits={self.bits}, symmetric=False): types wider than 8 bits are "
                "symmetric (zero point 0, as TFLite's int16 activations); set symmetric=True.")

    @property
    def storage(self):
        """The integer dtype that holds the codes: int8, or int16 above 8 bits."""
        return np.dtype(np.int8 if self.bits <= 8 else np.int16)

    @property
    def qmin(self) -> int:
        """The smallest integer code."""
        return -(2 ** (self.bits - 1)) + (1 if self.narrow_range else 0)

    @property
    def qmax(self) -> int:
        """The largest integer code."""
        return 2 ** (self.bits - 1) - 1


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
        data (attention scores). Must be ``dynamic``. ``None`` (the default)
        keeps such ops float.
      calibrator: how static activation ranges are found
        (:mod:`jqt.calibrators`; default ``MinMax()``).
      weight_calibrator: how weight ranges are found (default
        ``WeightMinMax()``, the absolute maximum for symmetric types).

    A rule with ``weight=None`` and ``act_x_act=None`` keeps the matched ops
    float:

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
    calibrator: Calibrator = MinMax()
    weight_calibrator: WeightCalibrator = WeightMinMax()

    def __post_init__(self):
        try:
            re.compile(self.key)
        except re.error as e:
            raise ValueError(f"Rule(key={self.key!r}) is not a valid regular expression: {e}") from None
        if isinstance(self.ops, str):
            raise TypeError(f"Rule(ops={self.ops!r}) must be a tuple of primitive names, "
                            f"e.g. ops=({self.ops!r},).")
        bad = [o for o in self.ops if o not in QUANTIZABLE_OPS]
        if bad:
            raise ValueError(f"Rule(ops=...) names {bad}; jqt quantizes {list(QUANTIZABLE_OPS)}.")
        if self.activation is not None and self.weight is None:
            raise ValueError(
                "Rule(activation=..., weight=None): an integer kernel needs both operands as "
                "integers. Set weight=QuantType(...) too, or drop activation to keep the op float.")
        if self.weight is not None and self.weight.dynamic:
            raise ValueError("Rule(weight=QuantType(dynamic=True)): weights are quantized from "
                             "their own values; 'dynamic' applies to activations only.")
        if self.activation is not None and self.activation.per_channel and not self.activation.dynamic:
            raise ValueError(
                "Rule(activation=QuantType(per_channel=True, dynamic=False)): static activation "
                "scales are per-tensor (a per-token scale changes with every input). Use "
                "dynamic=True for per-token scales.")
        if self.weight is not None and self.weight.bits > 8:
            raise ValueError(f"Rule(weight=QuantType(bits={self.weight.bits})): weights are stored "
                             "in int8; use bits <= 8 (int16 is for activations).")
        if self.act_x_act is not None and self.act_x_act.bits > 8:
            raise ValueError(f"Rule(act_x_act=QuantType(bits={self.act_x_act.bits})): "
                             "activation x activation ops are int8 x int8; use bits <= 8.")
        if not isinstance(self.calibrator, Calibrator):
            raise TypeError(f"Rule(calibrator={self.calibrator!r}): expected a "
                            "jqt.calibrators.Calibrator such as jqt.calibrators.Percentile(99.99).")
        if not isinstance(self.weight_calibrator, WeightCalibrator):
            raise TypeError(f"Rule(weight_calibrator={self.weight_calibrator!r}): expected a "
                            "jqt.calibrators.WeightCalibrator such as jqt.calibrators.WeightMSE().")
        if self.act_x_act is not None and not self.act_x_act.dynamic:
            raise ValueError("Rule(act_x_act=...): activation x activation ops have no calibrated "
                             "operand; use QuantType(dynamic=True, ...).")

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
        object.__setattr__(self, "rules", tuple(self.rules))
        for r in self.rules:
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


def _cal(calibrator, weight_calibrator):
    return dict(calibrator=calibrator or MinMax(), weight_calibrator=weight_calibrator or WeightMinMax())


def w8a8(*, act_symmetric: bool = False, calibrator=None, weight_calibrator=None) -> Recipe:
    """int8 per-channel symmetric weights, int8 static per-tensor activations.

    Activations are asymmetric by default: the output of a GELU or ReLU is
    mostly non-negative, and a symmetric range would leave half the codes
    unused.

    >>> import jqt
    >>> jqt.recipes.w8a8().rules[0].activation.symmetric
    False
    """
    return Recipe(rules=(Rule(weight=INT8_WEIGHT, activation=QuantType(bits=8, symmetric=act_symmetric),
                              **_cal(calibrator, weight_calibrator)),))


def w8a8_dynamic(*, act_x_act: bool = False, weight_calibrator=None) -> Recipe:
    """int8 per-channel weights, int8 activations with per-token scales computed at run time.

    With ``act_x_act=True`` activation x activation ops (attention) are
    quantized dynamically too.

    >>> import jqt
    >>> jqt.recipes.w8a8_dynamic().rules[0].activation.dynamic
    True
    """
    act = QuantType(bits=8, symmetric=False, per_channel=True, dynamic=True)
    return Recipe(rules=(Rule(weight=INT8_WEIGHT, activation=act, act_x_act=act if act_x_act else None,
                              **_cal(None, weight_calibrator)),))


def w8(*, weight_calibrator=None) -> Recipe:
    """Weight-only int8 (per-channel, symmetric); activations stay float.

    >>> import jqt
    >>> jqt.recipes.w8().rules[0].activation is None
    True
    """
    return Recipe(rules=(Rule(weight=INT8_WEIGHT, activation=None, **_cal(None, weight_calibrator)),))


def w8a16(*, calibrator=None, weight_calibrator=None) -> Recipe:
    """int8 per-channel weights, int16 symmetric static per-tensor activations.

    The precise fallback for an op whose activations int8 cannot hold (outlier
    channels): 256 times finer steps than int8 on the same range.

    >>> import jqt
    >>> jqt.recipes.w8a16().rules[0].activation.storage
    dtype('int16')
    """
    return Recipe(rules=(Rule(weight=INT8_WEIGHT, activation=QuantType(bits=16, symmetric=True),
                              **_cal(calibrator, weight_calibrator)),))


def w4a8(*, per_channel: bool = True, calibrator=None, weight_calibrator=None) -> Recipe:
    """int4 weights (stored in int8; per-channel by default), int8 static activations.

    >>> import jqt
    >>> jqt.recipes.w4a8().rules[0].weight.qmax
    7
    """
    wt = QuantType(bits=4, symmetric=True, narrow_range=True, per_channel=per_channel)
    return Recipe(rules=(Rule(weight=wt, activation=QuantType(bits=8, symmetric=False),
                              **_cal(calibrator, weight_calibrator)),))
