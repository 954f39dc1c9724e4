"""Building, loading and registering jqt's native XLA:CPU kernels (``csrc/grouped_gemv.cc``).

The kernels are XLA FFI custom calls, built on first use with the C++ compiler found at
run time (``$CXX``, else ``c++``, ``g++`` or ``clang++``) against XLA's FFI headers
(``jax.ffi.include_dir()``) and cached under ``$JQT_CACHE_DIR`` (default
``$XDG_CACHE_HOME/jqt``, or ``~/.cache/jqt``). Where they cannot be built or run (no compiler, not x86-64, a CPU
without AVX2 + FMA, or ``JQT_NATIVE=0``) the ops that would call them run XLA
formulations instead: :func:`native_status` says which and why. On CPUs with AVX-512
(F + BW) the 4-bit and ``(K, N)`` int8 / fp8 kernels and the 4-bit decode run 16 columns
per instruction (the same numbers as their AVX2 loops, bit for bit; a NaN output may
carry another NaN's sign or payload); ``JQT_NATIVE_ISA=avx2``, set before the first use,
keeps them on AVX2. The ops themselves are
primitives in ``native.py`` (few-row matmuls) and ``nibbledecode.py`` (whole-weight
decodes); this module has no dependency on them.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shlex
import shutil
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax

from . import diagnostics, fileio

GROUPED = "jqt_grouped_gemv"  # FFI targets: 4-bit codes with group scales, packed (K, N)
CHANNEL = "jqt_channel_gemv"  # int8 codes with per-channel scales, packed (N, K)
CHANNEL_KN = "jqt_channel_gemv_kn"  # the same, packed (K, N)
FP8_KN = "jqt_fp8_gemv_kn"  # fp8 codes (e4m3fn, e5m2) with per-channel scales, packed (K, N)
DECODE = "jqt_nibble_decode"  # 4-bit codes (int, NF4) with group scales -> the float32 weight
SOURCE = Path(__file__).parent / "csrc" / "grouped_gemv.cc"


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
    """Whether jqt's native CPU kernels (packed weights at few rows; NF4 weights
    decoded whole at many) are in use in this process, building them on the first call (a few
    seconds, once per machine and jax version: the library is cached). Where they are
    not, the same ops run as XLA programs; a build or load that fails with a compiler
    present also warns once. See ``docs/performance.md``.

    It also registers the kernels with XLA, which lowering a quantized function does on
    its own where one of its ops runs a kernel (at 1-8 rows). A compiled executable
    loaded in a new process without lowering anything
    (``jax.experimental.serialize_executable.deserialize_and_load``) needs them
    registered first: call ``jqt.native_status()`` before loading it (else XLA raises
    ``No FFI handler registered for jqt_...``), in a process without ``JQT_NATIVE=0``
    (which registers nothing: such an executable runs only where the kernels do; a
    ``jax.export`` of a quantized function holds no custom call and runs anywhere).

    >>> import jqt
    >>> s = jqt.native_status()
    >>> isinstance(s.available, bool) and bool(s.reason)
    True
    """
    global _status
    with _lock:
        if _status is None:
            try:
                try:
                    _status = _build()
                except OSError as e:  # a source or header unreadable, ...: XLA programs run
                    raise _BuildError(f"{e} (JQT_NATIVE=0 skips the build)") from e
            except _BuildError as e:  # a compiler is there, but the build or load failed
                _status = NativeStatus(False, str(e))
                diagnostics.warn(f"jqt: the native CPU kernels are not used: {e}. The same ops "
                                 "run as XLA programs (slower at few rows); set JQT_NATIVE=0 to "
                                 "skip the build.", RuntimeWarning)
        return _status


class _BuildError(Exception):
    """The kernels' build or load failed (where nothing says it should not have run)."""


def _compiler():
    """The compiler's command as a list (``$CXX`` split as a shell would, so that
    ``ccache g++`` works), or ``None``."""
    try:
        cxx = shlex.split(os.environ.get("CXX", ""))
    except ValueError as e:  # (an unclosed quote): a failed build, which warns and falls back
        raise _BuildError(f"$CXX={os.environ['CXX']!r} is not a command line a shell could "
                          f"split ({e}): fix $CXX, or unset it") from None
    if cxx:
        return [shutil.which(cxx[0]) or cxx[0], *cxx[1:]]
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def _cache_dir() -> Path:
    if os.environ.get("JQT_CACHE_DIR"):  # "~/..." from a Dockerfile ENV or os.environ: the home
        return Path(os.environ["JQT_CACHE_DIR"]).expanduser().absolute()  # (after a chdir too)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jqt"


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _intact(lib: Path):
    """Whether ``lib`` is the library :func:`_compile` wrote (its SHA-256 matches the one
    written beside it): ``False`` where it is missing or differs (cut short by a copy or a
    crash: ``dlopen`` of a truncated library kills the process with SIGBUS), ``None``
    where it exists without a recorded digest (built by an earlier jqt)."""
    try:
        if not lib.exists():
            return False
        try:
            want = _digest_path(lib).read_text().strip()
        except OSError:
            return None
        return hashlib.sha256(lib.read_bytes()).hexdigest() == want
    except OSError as e:  # another user's cache (a container's root home, a 0600 library)
        raise _BuildError(f"could not read the cached library {lib}: {e} (set JQT_CACHE_DIR to "
                          "a folder of your own, or JQT_NATIVE=0 to skip the build)") from e


def _elf_whole(path) -> bool:
    """Whether ``path`` is a whole 64-bit little-endian ELF file: its header tables and the
    segments they place lie within it (``dlopen`` of one cut short kills the process with
    SIGBUS, where a load error could be caught)."""
    with open(path, "rb") as fh:
        data = fh.read()
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        return False
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 54)
    if phoff + phnum * phentsize > len(data) or shoff + shnum * shentsize > len(data) \
            or phentsize < 40:
        return False
    return all(sum(struct.unpack_from("<QQQQ", data, phoff + i * phentsize + 8)[::3]) <= len(data)
               for i in range(phnum))  # p_offset + p_filesz


def _umask() -> int:
    """The process's umask, read from /proc where Linux has it (``os.umask`` sets it, for
    a moment, for every thread)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _compile(cxx, flags, include, lib):
    """Compiles ``SOURCE`` into ``lib`` through a temporary file in its folder (removed
    whatever happens; one a killed build left, ``.grouped_gemv-*.tmp``, by a later build once
    older than the compile's time limit), renamed into place: concurrent builders each write
    their own. The library gets the modes of a plain ``c++ -o`` under the umask
    (``mkstemp`` makes 0600 files, which other users could not load from a shared cache),
    and its SHA-256 beside it (:func:`_intact`)."""
    try:
        lib.parent.mkdir(parents=True, exist_ok=True)
        _sweep(lib.parent)
        fd, tmp = tempfile.mkstemp(prefix=f".{lib.stem}.", suffix=".tmp", dir=lib.parent)
        os.close(fd)
    except OSError as e:
        raise _BuildError(f"could not write into {lib.parent}: {e} (set JQT_CACHE_DIR to a "
                          "writable directory)") from e
    try:
        run = subprocess.run([*cxx, *flags, "-I", include, str(SOURCE), "-o", tmp],
                             capture_output=True, text=True, timeout=_TIME_LIMIT)
        if run.returncode:
            tail = (run.stderr or run.stdout).strip().splitlines()[-5:] or [
                f"it exited with status {run.returncode} and printed nothing (is $CXX a C++ compiler?)"]
            raise _BuildError(f"{' '.join(cxx)} failed to build {SOURCE}: " + " | ".join(tail))
        _loads(cxx, tmp)  # before it is cached: a rebuild would write the same library
        os.chmod(tmp, 0o777 & ~_umask())
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, lib)
        fileio.atomic_write(_digest_path(lib), lambda path: Path(path).write_text(digest))
    except (OSError, subprocess.SubprocessError) as e:  # the compiler could not run
        raise _BuildError(f"the C++ compiler {' '.join(cxx)!r} could not be run: {e} (set $CXX "
                          "to a C++ compiler, or JQT_NATIVE=0 to skip the build)") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_TIME_LIMIT = 600  # seconds a build may take


def _sweep(folder):
    """Removes the temporary files of builds killed before their ``finally`` ran (SIGKILL:
    an out-of-memory kill, a CI timeout): those older than any build still running."""
    for f in Path(folder).glob(".grouped_gemv-*.tmp"):
        try:
            if time.time() - f.stat().st_mtime > 2 * _TIME_LIMIT:
                f.unlink()
        except OSError:  # another process's sweep, or not ours to remove
            pass


def _loads(cxx, tmp):
    """Refuses what a compiler that exited 0 wrote, where it is no library of jqt's kernels
    (``CXX=true`` writes nothing; ``CXX=gcc`` links no C++ runtime: undefined symbols)."""
    what = f"{' '.join(cxx)} exited 0 but"
    fix = "is $CXX a C++ compiler (g++, clang++)? Or set JQT_NATIVE=0 to skip the build"
    if not _elf_whole(tmp):
        raise _BuildError(f"{what} wrote no whole shared library ({os.path.getsize(tmp)} bytes): {fix}")
    try:
        ctypes.CDLL(tmp).jqt_native_isa  # noqa: B018 (the lookup is the check)
    except AttributeError as e:
        raise _BuildError(f"{what} built a library without jqt's kernels ({e}): {fix}") from None
    except OSError as e:  # (another failure, a folder mounted noexec: _build names it)
        if "undefined symbol" in str(e):
            raise _BuildError(f"{what} built a library that does not load ({e}): {fix}") from None


ISA_CHOICES = ("avx2", "avx512")  # JQT_NATIVE_ISA: the vector width of the kernels' loops


def _build() -> NativeStatus:
    flag = os.environ.get("JQT_NATIVE", "1").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return NativeStatus(False, f"disabled by JQT_NATIVE={os.environ['JQT_NATIVE']}")
    if flag not in ("", "1", "true", "yes", "on"):
        diagnostics.warn(f"jqt: JQT_NATIVE={os.environ['JQT_NATIVE']!r} is neither off (0, false, "
                         "no, off) nor on (1, true, yes, on): the native kernels stay on. Set "
                         "JQT_NATIVE=0 to turn them off.", RuntimeWarning)
    isa = os.environ.get("JQT_NATIVE_ISA", "")
    if isa and isa.lower() not in ISA_CHOICES:  # as the kernels read it: no spaces
        diagnostics.warn(f"jqt: JQT_NATIVE_ISA={isa!r} is not one of {', '.join(ISA_CHOICES)}: "
                         "ignored (the kernels use AVX-512 where the CPU has it). Set "
                         "JQT_NATIVE_ISA=avx2 to keep them on AVX2, or unset it.", RuntimeWarning)
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return NativeStatus(False, f"the kernel is for x86-64 CPUs (this is {platform.machine()})")
    cxx = _compiler()
    if cxx is None:
        return NativeStatus(False, "no C++ compiler found ($CXX, c++, g++ or clang++); "
                                   "install one (e.g. apt install g++) to build the kernel")
    include = jax.ffi.include_dir()
    flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w"]
    headers = [h.read_bytes() for h in sorted(Path(include, "xla", "ffi", "api").glob("*.h"))]
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), jax.__version__.encode(),
                                     " ".join(cxx).encode(), " ".join(flags).encode(),
                                     include.encode(), *headers])).hexdigest()[:16]
    lib = _cache_dir() / f"grouped_gemv-{key}.so"
    intact = _intact(lib)
    if not intact:
        try:
            _compile(cxx, flags, include, lib)
        except _BuildError as e:
            if intact is not None:  # missing or damaged: nothing to load
                raise
            # an earlier jqt's library in a folder this process cannot write: loaded as it
            # is, where it is whole (dlopen of one cut short kills the process with SIGBUS)
            if not _elf_whole(lib):
                raise _BuildError(f"the cached library {lib} is cut short (no digest beside it "
                                  f"to check), and building it again failed: {e}") from None
    try:
        handle = ctypes.CDLL(str(lib))
    except OSError as e:
        raise _BuildError(f"could not load {lib}: {e} (a folder mounted noexec cannot load "
                          "libraries: set JQT_CACHE_DIR to another folder; a damaged file: delete "
                          "it to have it built again)") from e
    try:
        isa = handle.jqt_native_isa()
        if isa < 2:
            return NativeStatus(False, "this CPU has no AVX2 + FMA, which the kernel needs")
        targets = {GROUPED: handle.JqtGroupedGemv, CHANNEL: handle.JqtChannelGemv,
                   CHANNEL_KN: handle.JqtChannelGemvKn, FP8_KN: handle.JqtFp8GemvKn,
                   DECODE: handle.JqtNibbleDecode}
    except AttributeError as e:  # another library under its name (no digest to tell)
        raise _BuildError(f"{lib} is not a library of jqt's kernels ({e}): delete it to have it "
                          "built again, or set JQT_CACHE_DIR to a folder of your own") from None
    for name, fn in targets.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
    # AVX-512 where the CPU has it (F + BW) and JQT_NATIVE_ISA is not "avx2", for the 4-bit
    # and (K, N) int8 / fp8 kernels and the 4-bit decode: the same numbers as their AVX2 loops
    kind = "AVX-512" if isa == 3 else "AVX2"
    return NativeStatus(True, f"built with {' '.join(cxx)}: {lib} ({kind} kernels)", str(lib))
