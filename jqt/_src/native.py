"""jqt's native XLA:CPU kernels: few-row matmuls of packed weights, read in place.

At one to a few rows (decoding at batch 1) a matmul reads every weight once and does
little arithmetic per byte, so its time is the bytes it reads over the rate it reads
them. XLA:CPU has no matmul that reads packed int4 codes in place, and its int8 matmul
reads int8 bytes at a fraction of the rate its float32 GEMV reads float32: jqt's XLA
formulations decode the codes to float32 (chunk by chunk, in cache) or split the
activation into int8 digits, and took 0.76x (``w4`` g128) and 0.59x (``w8``) a float32
4096 x 4096 layer at one row where their bytes are 0.125x and 0.25x
(``benchmarks/formats.py``). Two kernels in ``csrc/grouped_gemv.cc`` read the codes
once, front to back, and decode them in registers (AVX2 + FMA) into float32 sums: the
arithmetic of the float32 matmul of the decoded weight, in another order.

* ``jqt_grouped_gemv``: 4-bit int or NF4 codes with group scales (or one scale per
  output channel), two per byte, packed ``(K, N)`` (``w4``, ``w4a8``, ``nf4``);
* ``jqt_channel_gemv``: int8 codes with one scale per output channel, packed ``(N, K)``
  (``w8``; and ``w8a8`` / ``w8a8_dynamic``, their int8 codes as floats, where
  ``KernelPolicy.native_int8_rows`` says so: exact products, float32 sums).

* ``jqt_channel_gemv_kn``: the same with the codes packed ``(K, N)`` (``w8`` under
  ``KernelPolicy.weight_only_kn``, as the CPU table packs it).
* ``jqt_fp8_gemv_kn``: fp8 codes (``float8_e4m3fn``, ``float8_e5m2``) with one scale
  per output channel, packed ``(K, N)`` (``fp8``, its activation's fp8 values taken as
  float32, exact), each code's bits decoded through float16 (F16C): XLA:CPU has no fp8
  arithmetic, and its formulation decoded the weight chunk by chunk, 1.44-2.45x a float32
  4096 x 4096 layer at one row.

They are XLA FFI custom calls, built on first use with the C++ compiler found at run
time (``$CXX``, else ``c++``, ``g++`` or ``clang++``) against XLA's FFI headers
(``jax.ffi.include_dir()``) and cached under ``$JQT_CACHE_DIR`` (default
``~/.cache/jqt``). Where they cannot be built or run (no compiler, not x86-64, a CPU
without AVX2 + FMA, or ``JQT_NATIVE=0``) the op runs the XLA formulation the policy
would pick without them: the same numbers up to float rounding;
:func:`jqt.native_status` says which and why.

The op is one primitive, ``jqt_gemv``, whose CPU lowering is the custom call and whose
lowering elsewhere is that XLA formulation: on other backends, inside ``jax.export``
(its artifact must run in processes that never registered the targets) and in SPMD
programs over several devices (the partitioner cannot split a custom call).
``jax.vmap`` folds a batch of activations into its rows, and ``jax.jvp`` /
``jax.grad`` differentiate the XLA formulation.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import compat, dense, gemv
from .formats import FLOAT8, NF4_TABLE
from .layerview import LayerView
from .qparams import QArray

GROUPED = "jqt_grouped_gemv"  # FFI targets: 4-bit codes with group scales, packed (K, N)
CHANNEL = "jqt_channel_gemv"  # int8 codes with per-channel scales, packed (N, K)
CHANNEL_KN = "jqt_channel_gemv_kn"  # the same, packed (K, N)
FP8_KN = "jqt_fp8_gemv_kn"  # fp8 codes (e4m3fn, e5m2) with per-channel scales, packed (K, N)
SOURCE = Path(__file__).parent / "csrc" / "grouped_gemv.cc"
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    """Whether jqt's native CPU kernels run in this process, and why (not).

    Attributes:
      available: the kernels are built, loaded and registered with XLA.
      reason: where the library is, or why it is not used.
      library: the path of the shared library, or ``None``.

    >>> import jqt
    >>> jqt.NativeStatus(False, "disabled by JQT_NATIVE=0")
    NativeStatus(available=False, reason='disabled by JQT_NATIVE=0', library=None)
    """

    available: bool
    reason: str
    library: str | None = None


_lock = threading.Lock()
_status: NativeStatus | None = None


def native_status() -> NativeStatus:
    """Whether jqt's native CPU kernels (4-bit grouped and int8 per-channel weights at
    few rows) are in use in this process, building them on the first call (a few
    seconds, once per machine and jax version: the library is cached). Where they are
    not, the same ops run as XLA programs; a build or load that fails with a compiler
    present also warns once. See ``docs/performance.md``.

    >>> import jqt
    >>> s = jqt.native_status()
    >>> isinstance(s.available, bool) and bool(s.reason)
    True
    """
    global _status
    with _lock:
        if _status is None:
            try:
                _status = _build()
            except _BuildError as e:  # a compiler is there, but the build or load failed
                _status = NativeStatus(False, str(e))
                warnings.warn(f"jqt: the native CPU kernels are not used: {e}. The same ops "
                              "run as XLA programs (slower at few rows); set JQT_NATIVE=0 to "
                              "skip the build.", RuntimeWarning, stacklevel=2)
        return _status


class _BuildError(Exception):
    """The kernels' build or load failed (where nothing says it should not have run)."""


def _compiler():
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or cxx
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cache_dir() -> Path:
    if os.environ.get("JQT_CACHE_DIR"):
        return Path(os.environ["JQT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jqt"


def _build() -> NativeStatus:
    if os.environ.get("JQT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return NativeStatus(False, "disabled by JQT_NATIVE=0")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return NativeStatus(False, f"the kernel is for x86-64 CPUs (this is {platform.machine()})")
    cxx = _compiler()
    if cxx is None:
        return NativeStatus(False, "no C++ compiler found ($CXX, c++, g++ or clang++); "
                                   "install one (e.g. apt install g++) to build the kernel")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w"]
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), jax.__version__.encode(),
                                     cxx.encode(), " ".join(flags).encode(),
                                     include.encode()])).hexdigest()[:16]
    lib = _cache_dir() / f"grouped_gemv-{key}.so"
    if not lib.exists():
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
            os.close(fd)
            run = subprocess.run([cxx, *flags, "-I", include, str(SOURCE), "-o", tmp],
                                 capture_output=True, text=True, timeout=600)
            if run.returncode:
                os.unlink(tmp)
                tail = (run.stderr or run.stdout).strip().splitlines()[-5:]
                raise _BuildError(f"{cxx} failed to build {SOURCE}: " + " | ".join(tail))
            os.replace(tmp, lib)  # atomic: concurrent builders each write their own file
        except (OSError, subprocess.SubprocessError) as e:
            raise _BuildError(f"could not build {SOURCE} into {lib.parent}: {e} (set "
                              "JQT_CACHE_DIR to a writable directory)") from e
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as e:
        raise _BuildError(f"could not load {lib}: {e}") from e
    if handle.jqt_native_isa() < 2:
        return NativeStatus(False, "this CPU has no AVX2 + FMA, which the kernel needs")
    jax.ffi.register_ffi_target(GROUPED, jax.ffi.pycapsule(handle.JqtGroupedGemv), platform="cpu")
    jax.ffi.register_ffi_target(CHANNEL, jax.ffi.pycapsule(handle.JqtChannelGemv), platform="cpu")
    jax.ffi.register_ffi_target(CHANNEL_KN, jax.ffi.pycapsule(handle.JqtChannelGemvKn), platform="cpu")
    jax.ffi.register_ffi_target(FP8_KN, jax.ffi.pycapsule(handle.JqtFp8GemvKn), platform="cpu")
    return NativeStatus(True, f"built with {cxx}: {lib}", str(lib))


def _target(w: QArray):
    """The kernel for the 2-D weight ``w``, or ``None``: ``GROUPED`` for int codes of 4 bits
    or fewer or NF4 codes with group scales or one scale per output channel, two per
    byte, ``"kn"`` (w4, w4a8, nf4);
    ``CHANNEL`` (``"nk"``: w8, w8a8) or ``CHANNEL_KN`` (``"kn"``: w8) for int codes of at
    most 8 bits, one per byte, one scale per output channel (not one per tensor);
    ``FP8_KN`` for fp8 codes, ``"kn"``, one scale per output channel (fp8)."""
    q = w.qtype
    if getattr(w.values, "ndim", 0) != 2:
        return None
    n = w.values.shape[0 if w.layout == "nk" else 1]
    per_channel = math.prod(jnp.shape(w.scale)) == n and not q.group_size
    if (w.layout == "kn" and w.nibbles and q.grid in ("int", "nf4")
            and (q.group_size and q.group_size % 2 == 0 or per_channel)):
        return GROUPED
    if not per_channel:  # one scale per tensor, or groups
        return None
    if (w.layout in ("nk", "kn") and q.kind == "int" and q.bits <= 8
            and w.values.dtype == np.int8):
        return CHANNEL if w.layout == "nk" else CHANNEL_KN
    if w.layout == "kn" and q.kind == "float" and w.values.dtype == FLOAT8[q.grid] \
            and w.zero_point is None:
        return FP8_KN
    return None


def kernel_group(qtype, k: int) -> int:
    """The ``group_size`` ``jqt_grouped_gemv`` runs 4-bit codes of ``qtype`` over ``k``
    rows in: the format's groups, or for one scale per output channel blocks of about 256
    rows (one scale row for all of them), which the threads share.

    >>> import jqt
    >>> kernel_group(jqt.QuantType(bits=4, group_size=64), 4096), kernel_group(jqt.QuantType(bits=4), 4096)
    (64, 256)
    >>> kernel_group(jqt.QuantType(bits=4), 300), kernel_group(jqt.QuantType(bits=4), 4098)
    (150, 4098)
    """
    return qtype.group_size or dense.chunk_size(k, 256, 2) or k


def applies(w: QArray, m: int, policy, int_activation: bool = False) -> bool:
    """Whether the op of the 2-D weight ``w`` at ``m`` rows runs a native kernel:
    ``0 < m <= policy.native_gemv_rows``, a weight one of the kernels reads (``GROUPED``:
    w4, w4a8, nf4; ``CHANNEL``: w8, and w8a8 at up to ``policy.native_int8_rows`` rows:
    above, XLA's int8 matmul keeps their int8 x int8 sums exact; ``FP8_KN``: fp8, whose
    activation's values are exact in float32 as XLA's formulation takes them), and the
    kernels available here (:func:`native_status`)."""
    target = _target(w)
    if target is None or (int_activation and target in (CHANNEL, CHANNEL_KN)
                          and m > policy.native_int8_rows):
        return False
    return 0 < m <= policy.native_gemv_rows and native_status().available


def dense_rows(x2, w: QArray, policy, stack: LayerView | None = None):
    """``x2 (M, K) @ w`` in float32 (``x2`` float, or an int8 activation's codes minus
    their zero point) through the ``jqt_gemv`` primitive. With ``stack`` (a view of
    stacked layers whose layer is ``w``, its arrays the same up to a reshape) the kernel
    reads the layer from the stack in place."""
    target = _target(w)
    q = w.qtype
    v = w.values
    if target == GROUPED:
        shape = (v.shape[0] * 2 // q.group_size if q.group_size else 1, v.shape[1])
    else:  # one scale per output channel: the codes' axis 0 "nk", axis 1 "kn" (fp8 too)
        shape = (v.shape[0] if target == CHANNEL else v.shape[1],)
    layer = jnp.int32(0)
    lead = ()
    if stack is not None:
        w, layer = stack.flat()
        lead = w.values.shape[:1]
        v = w.values.reshape(lead + v.shape)
    scale = w.scale.astype(_F32).reshape(lead + shape)
    zp = (jnp.zeros(lead + (0,) + shape[1:], _F32) if w.zero_point is None
          else w.zero_point.astype(_F32).reshape(lead + shape))
    table = jnp.asarray(NF4_TABLE if q.grid == "nf4" else np.zeros(0), _F32)
    return gemv_p.bind(x2.astype(_F32), v, scale, zp, table, layer, target=target, qtype=q,
                       policy=dataclasses.replace(policy, native_gemv_rows=0),
                       max_rows=policy.native_gemv_rows)


def in_place(stack: LayerView | None, wq: QArray, w2: QArray, to_layout) -> LayerView | None:
    """``stack`` when the kernel can read ``w2 = to_layout(wq)`` (the weight in the
    kernel's layout) from it in place: ``w2``'s codes are ``wq``'s and its scale (and
    zero point, converted alike) ``wq``'s up to a reshape, checked at trace time on a
    probe; else ``None``."""
    if (stack is None or w2.values is not wq.values or wq.scale is None
            or jnp.ndim(wq.scale) == 0):
        return None
    n = math.prod(jnp.shape(wq.scale))
    with jax.ensure_compile_time_eval():  # a concrete probe: which element goes where
        probe = jnp.arange(n, dtype=_F32).reshape(jnp.shape(wq.scale))
        out = to_layout(dataclasses.replace(wq, scale=probe, zero_point=None)).scale
        if not np.array_equal(np.asarray(out).ravel(), np.arange(n)):
            return None
    return stack


def _reference(x2, codes, scale, zp, table, layer, *, target, qtype, policy, max_rows):
    """The op in XLA: the formulation ``policy`` (the table without the kernels) picks
    for a float activation (``table`` is the NF4 table the kernel reads, which ``qtype``
    names; stacked codes, scale and zero point are sliced at ``layer`` first)."""
    del table, max_rows
    if codes.ndim == 3:
        take = lambda a: lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
        codes, scale, zp = take(codes), take(scale), take(zp)
    w = QArray(values=codes, scale=scale, zero_point=zp if zp.shape[0] else None, qtype=qtype,
               layout="nk" if target == CHANNEL else "kn")
    if gemv.weight_only_applies(w, x2.shape[0], policy):
        return gemv.weight_only_rows(x2, w, policy)
    return dense.weight_only_2d(x2, w, policy, None)


gemv_p = compat.Primitive("jqt_gemv")


@gemv_p.def_abstract_eval
def _abstract(x2, codes, scale, zp, table, layer, *, target, **params):
    n = codes.shape[-2] if target == CHANNEL else codes.shape[-1]
    return jax.core.ShapedArray((x2.shape[0], n), _F32)


@gemv_p.def_impl
def _impl(*args, **params):
    with jax.disable_jit(False):  # compiled even under jax.disable_jit (else bind recurses)
        return jax.jit(functools.partial(gemv_p.bind, **params))(*args)


def _lower_cpu(ctx, x2, codes, scale, zp, table, layer, *, target, **params):
    args = (x2, codes, scale, zp, table, layer)
    if compat.lowering_is_portable(ctx) or not native_status().available:
        return _lower_reference(ctx, *args, target=target, **params)
    if target == GROUPED:
        return jax.ffi.ffi_lowering(GROUPED)(
            ctx, *args, group_size=np.int64(kernel_group(params["qtype"], 2 * ctx.avals_in[1].shape[-2])))
    return jax.ffi.ffi_lowering(target)(ctx, *args)  # table: empty


def _lower_reference(ctx, *args, **params):
    return compat.mlir.lower_fun(functools.partial(_reference, **params),
                                 multiple_results=False)(ctx, *args)


compat.mlir.register_lowering(gemv_p, _lower_reference, cacheable=False)
compat.mlir.register_lowering(gemv_p, _lower_cpu, platform="cpu", cacheable=False)


def _batch(args, dims, **params):
    x2, *w = args
    bx = dims[0]
    if all(d is compat.NOT_MAPPED for d in dims[1:]):  # a batch of activations: more rows
        x = jnp.moveaxis(x2, bx, 0)
        b, m, k = x.shape
        if b * m <= params["max_rows"]:
            out = gemv_p.bind(x.reshape(b * m, k), *w, **params)
        else:
            out = _reference(x.reshape(b * m, k), *w, **params)
        return out.reshape(b, m, out.shape[-1]), 0  # (b or m may be 0)
    axes = tuple(None if d is compat.NOT_MAPPED else d for d in dims)
    return jax.vmap(functools.partial(_reference, **params), in_axes=axes)(*args), 0


compat.batching.primitive_batchers[gemv_p] = _batch


def _jvp(primals, tangents, **params):
    tangents = [compat.ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(functools.partial(_reference, **params), tuple(primals), tuple(tangents))


compat.ad.primitive_jvps[gemv_p] = _jvp
