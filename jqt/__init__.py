"""jqt: quantize any JAX function to integer arithmetic.

>>> import jax, jax.numpy as jnp, jqt
>>> f = lambda w, x: jax.nn.relu(x @ w)
>>> w, x = jnp.eye(4), jnp.linspace(-1, 1, 8).reshape(2, 4)
>>> qp = jqt.calibrate(f, jqt.recipes.w8a8(), w, [(x,)], progress=False)
>>> bool(jnp.allclose(jax.jit(jqt.quantize(f, qp))(w, x), f(w, x), atol=0.01))
True
"""
from jqt import calibrators as calibrators
from jqt import qat as qat
from jqt import recipes as recipes
from jqt._src import export as _export  # noqa: F401  (registers jax.export serialization)
from jqt._src.calibrate import CalibrationDataError as CalibrationDataError
from jqt._src.calibrate import calibrate as calibrate
from jqt._src.frameworks import from_keras as from_keras
from jqt._src.gptq import gptq as gptq
from jqt._src.handlers import QParamsMismatchError as QParamsMismatchError
from jqt._src.kvcache import dequantize_cache as dequantize_cache
from jqt._src.kvcache import quantize_cache as quantize_cache
from jqt._src.nativelib import NativeStatus as NativeStatus
from jqt._src.nativelib import native_status as native_status
from jqt._src.numerics import fake_quant_p as fake_quant_p
from jqt._src.numerics import quantize_p as quantize_p
from jqt._src.policy import KernelPolicy as KernelPolicy
from jqt._src.qparams import OpQParams as OpQParams
from jqt._src.qparams import PackedParams as PackedParams
from jqt._src.qparams import PackedWeight as PackedWeight
from jqt._src.qparams import QArray as QArray
from jqt._src.qparams import QuantParams as QuantParams
from jqt._src.qparams import WeightSource as WeightSource
from jqt._src.qparams import summarize as summarize
from jqt._src.quantize import pack as pack
from jqt._src.quantize import quantize as quantize
from jqt._src.formats import QuantType as QuantType
from jqt._src.report import OpReport as OpReport
from jqt._src.report import Report as Report
from jqt._src.report import report as report
from jqt._src.recipe import Recipe as Recipe
from jqt._src.recipe import Rule as Rule
from jqt._src.fileio import FormatError as FormatError
from jqt._src.serialization import load as load
from jqt._src.packed_io import load_packed as load_packed
from jqt._src.serialization import save as save
from jqt._src.packed_io import save_packed as save_packed
from jqt._src.sharding import packed_shardings as packed_shardings
from jqt._src.tuning import FallbackResult as FallbackResult
from jqt._src.tuning import Sensitivity as Sensitivity
from jqt._src.tuning import SensitivityRow as SensitivityRow
from jqt._src.tuning import fallback as fallback
from jqt._src.tuning import sensitivity as sensitivity

__version__ = "0.1.0"
