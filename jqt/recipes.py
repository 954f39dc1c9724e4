"""Preset recipes: ``w8a8`` (static), ``w8a8_dynamic``, ``w8`` (weight-only), ``w8a16``
(int16 activations), ``w4a8`` (int4 weights)."""
from jqt._src.recipe import w4a8 as w4a8
from jqt._src.recipe import w8 as w8
from jqt._src.recipe import w8a8 as w8a8
from jqt._src.recipe import w8a8_dynamic as w8a8_dynamic
from jqt._src.recipe import w8a16 as w8a16
from jqt._src.recipe import INT8_WEIGHT as INT8_WEIGHT
