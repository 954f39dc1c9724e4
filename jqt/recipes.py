"""Preset recipes: ``w8a8`` (static), ``w8a8_dynamic``, ``w8`` (weight-only)."""
from jqt._src.recipe import w8 as w8
from jqt._src.recipe import w8a8 as w8a8
from jqt._src.recipe import w8a8_dynamic as w8a8_dynamic
