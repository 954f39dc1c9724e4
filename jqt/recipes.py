"""Preset recipes: ``w8a8`` (static), ``w8a8_dynamic``, ``w8`` (weight-only), ``w8a16``
(int16 activations), ``w4a8`` (int4 weights), ``w4`` (weight-only int4 in groups),
``nf4`` (4-bit NormalFloat), ``fp8``. Every preset quantizes embedding lookups
(``gather`` from a weight) unless ``embeddings=False``; ``kv_cache=True`` (or ``"int4"``,
``"fp8"``) quantizes the key/value caches a decode loop carries (docs/generate.md). The
4-bit presets clip each weight group at its squared-error optimum (``WEIGHT_MSE_4BIT``)."""
from jqt._src.recipe import INT8_WEIGHT as INT8_WEIGHT
from jqt._src.recipe import KV_INT8 as KV_INT8
from jqt._src.recipe import WEIGHT_MSE_4BIT as WEIGHT_MSE_4BIT
from jqt._src.recipe import fp8 as fp8
from jqt._src.recipe import nf4 as nf4
from jqt._src.recipe import w4 as w4
from jqt._src.recipe import w4a8 as w4a8
from jqt._src.recipe import w8 as w8
from jqt._src.recipe import w8a8 as w8a8
from jqt._src.recipe import w8a8_dynamic as w8a8_dynamic
from jqt._src.recipe import w8a16 as w8a16
