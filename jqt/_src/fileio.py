"""The file machinery under jqt's readers and writers (``serialization.py`` for qparams,
``packed_io.py`` for packed weights): :class:`FormatError`, atomic writes, safetensors with
a JSON header, and :class:`Reader` / :class:`NpzReader`, which check every header field and
tensor they read and raise :class:`FormatError` naming the file, what is wrong and the fix.

>>> import os, tempfile, numpy as np
>>> from jqt._src import fileio
>>> path = os.path.join(tempfile.mkdtemp(), "t.safetensors")
>>> fileio.write(path, {"a": np.arange(3, dtype=np.int8)}, {}, fileio.PACKED_FORMAT, 2)
>>> with fileio.Reader(path, "example") as r:
...     print(r.format, r.version, r.get("a", "an example tensor"))
jqt.packed 2 [0 1 2]
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import secrets
import stat

import jax.numpy as jnp
import numpy as np

FORMAT = "jqt.qparams"  # the format names in a file's header: qparams (jqt.save) ...
PACKED_FORMAT = "jqt.packed"  # ... and packed weights (jqt.save_packed)

# dtypes safetensors stores natively; anything else is stored as its raw bytes (uint8).
_NATIVE = {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
           "float16", "bfloat16", "float32", "float64"}


class FormatError(ValueError):
    """A file is not a jqt file of the expected kind, is damaged (a header, dtype or shape
    that does not match, invalid numbers in its qparams), or has an unsupported version.
    The message names the file, what is wrong and how to fix it.

    >>> import os, tempfile, jqt
    >>> path = os.path.join(tempfile.mkdtemp(), "qp.safetensors")
    >>> _ = open(path, "wb").write(b"not a jqt file")
    >>> try:
    ...     jqt.load(path)
    ... except jqt.FormatError as e:
    ...     print("is not a jqt file, or a damaged one" in str(e))
    True
    """



def dtype_from_name(name: str):
    try:
        return jnp.dtype(name)
    except TypeError:
        raise FormatError(f"jqt: unknown dtype {name!r} in the file (written by a newer JAX or "
                          "ml_dtypes?).") from None


def aval_to_json(a) -> list:
    return [list(a.shape), jnp.dtype(a.dtype).name]



# ---- atomic writes ------------------------------------------------------------------------------

_TILDE = ("a leading '~' is not expanded (as open() does not expand it): pass "
          "os.path.expanduser(path).")


def _tilde(path) -> bool:
    """Whether ``path`` starts with ``~`` (a home folder the shell would have expanded)."""
    return os.fsdecode(os.fspath(path)).startswith("~")


def atomic_write(path, write_to) -> None:
    """Writes ``path`` all at once or not at all: ``write_to(tmp)`` writes a temporary file
    in the same folder, which is flushed to disk (``fsync``) and renamed onto ``path``
    (``os.replace``, atomic on POSIX and Windows). Whatever fails (``write_to``, a full
    disk, an interrupt), ``path`` keeps its old content and the temporary file is removed.
    A symbolic link is written through (its target is replaced)."""
    target = os.path.realpath(os.fspath(path))
    if os.path.isdir(target):
        raise IsADirectoryError(f"jqt: cannot write {os.fspath(path)!r}: it is a folder. Give a file "
                                "name in it, e.g. os.path.join(folder, 'model.safetensors').")
    if not os.path.isdir(os.path.dirname(target)):
        raise FileNotFoundError(f"jqt: cannot write {os.fspath(path)!r}: its folder "
                                f"{os.path.dirname(target)!r} does not exist"
                                + (f": {_TILDE}" if _tilde(path) else ". Create it first "
                                   "(os.makedirs(folder, exist_ok=True))."))
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise PermissionError(f"jqt: cannot write {os.fspath(path)!r}: the file is read-only for this "
                              "user (as open(path, 'w') would find). Make it writable (chmod u+w) "
                              "or write another file.")
    try:
        tmp, mode = _create_temp(target)
    except PermissionError as e:
        raise PermissionError(f"jqt: cannot write {os.fspath(path)!r}: this user may not create files "
                              f"in its folder {os.path.dirname(target)!r} ({e.strerror}). Write into "
                              "another folder, or make this one writable.") from None
    try:
        try:
            write_to(tmp)
        except Exception as e:
            err = _write_error(path, e)
            if err is e:
                raise
            raise err from e
        _writable(tmp)  # (a writer that made the file anew gave it the umask's mode)
        _fsync(tmp)
        with contextlib.suppress(OSError):  # an existing file keeps its permissions, a new
            # one gets those open() gives (0o666 less the umask)
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target) else mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(target))


def _write_error(path, e):
    """The error to raise for ``e``, raised while writing ``path``'s temporary file: an
    ``OSError`` keeps its type and gains a note naming ``path``; an I/O error a writer
    reports as another type (safetensors' ``SafetensorError``, for a full disk) becomes the
    ``OSError`` its ``os error N`` names, so ``except OSError`` catches a full disk on every
    format. Other errors are returned as they are."""
    unchanged = (f"jqt: writing {os.fspath(path)!r} failed; the file, if it existed, is unchanged "
                 "(free space on the disk, or write elsewhere)")
    if isinstance(e, OSError):
        e.add_note(unchanged)
        if e.filename is None:  # (str(e) then names it)
            e.filename = os.fspath(path)
        return e
    m = re.search(r"I/O error: (.*?) \(os error (\d+)\)", str(e))
    if m is None:
        return e
    return OSError(int(m.group(2)), f"jqt: cannot write {os.fspath(path)!r}: {m.group(1)}. The "
                   "file, if it existed, is unchanged; free space on the disk, or write elsewhere.")


def _create_temp(target):
    """A new empty file ``.<name>.<random>.tmp`` (the name cut to 48 characters) next to ``target``, and the mode ``open``
    gives a new file (0o666 less the umask). The temporary file stays writable by its
    owner until it is complete (a umask such as 0o222 would leave the writer, which
    reopens it, unable to)."""
    folder, name = os.path.split(target)
    # the name's first 48 characters (at most 192 bytes in UTF-8): the 18 added to a legal
    # name of up to 255 bytes went past the folder entry's limit
    tmp = os.path.join(folder, f".{name[:48]}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    mode = stat.S_IMODE(os.stat(tmp).st_mode)
    try:
        _writable(tmp)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp, mode


def _writable(path):
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if not mode & stat.S_IWUSR:
        os.chmod(path, mode | stat.S_IWUSR)


def _fsync(path):
    fd = os.open(path, os.O_RDWR)  # (Windows flushes only a handle opened for writing)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(folder):
    """Makes the rename itself durable where the OS allows (POSIX; not Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- safetensors helpers ------------------------------------------------------------------------

def _safetensors():
    try:
        import safetensors
        import safetensors.numpy
    except ImportError:  # pragma: no cover - a declared dependency
        raise ImportError("jqt: saving and loading .safetensors files needs the 'safetensors' "
                          "package: pip install safetensors") from None
    return safetensors


def _storable(a):
    """(array safetensors can store, original dtype name or None when stored as is)."""
    a = np.asarray(a)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        a = a.copy(order="C")
    if a.dtype.name in _NATIVE:
        return a, None
    return np.frombuffer(a.tobytes(), np.uint8).copy(), a.dtype.name


def tensor_list(tensors) -> dict:
    """The header's ``"tensors"``: name -> ``[shape, dtype name]`` of each array."""
    return {n: aval_to_json(np.asarray(a)) for n, a in tensors.items()}


def write(path, tensors, header, fmt, version):
    """Writes a jqt safetensors file (atomically): ``tensors`` and the JSON ``header``."""
    st = _safetensors()
    stored, encoded = {}, {}
    for n, a in tensors.items():
        stored[n], enc = _storable(a)
        if enc is not None:
            encoded[n] = [enc, list(np.shape(a))]
    header = dict(header, format=fmt, version=version, encoded=encoded,
                  tensors=tensor_list(tensors))
    meta = {"format": fmt, "version": str(version), "jqt": json.dumps(header)}

    def save(tmp):
        st.numpy.save_file(stored, tmp, metadata=meta)
        _writable(tmp)  # (safetensors made it anew, read-only under a umask of 0o222)
        _sort_header(tmp)
    atomic_write(path, save)


def _sort_header(path):
    """Rewrites the JSON header of the safetensors file ``path`` with its keys sorted, in
    place: safetensors writes its metadata entries in a hash map's order, which changes
    from one save to the next, so the same object gave files of other bytes (checksums
    and content-addressed caches saw a change). The sorted header is as long as the
    written one (the same compact JSON, non-ASCII text unescaped); one that is not is
    left as written."""
    with open(path, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        raw = fh.read(n)
        text = raw.decode("utf-8")
        body = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"),
                          ensure_ascii=False).encode("utf-8")
        body += b" " * (len(raw) - len(body))  # safetensors pads its header with spaces
        if len(body) == n:
            fh.seek(8)
            fh.write(body)


def file_path(path, fn, hint="pass the file's path (a str or os.PathLike)") -> str:
    """``path`` (a ``str``, ``bytes`` or ``os.PathLike``) as a ``str``; any other value
    raises a ``TypeError`` starting with ``fn`` and ending with ``hint``.

    >>> file_path(b"/tmp/q.safetensors", "jqt.load")
    '/tmp/q.safetensors'
    """
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{fn}: path is a {type(path).__name__}; {hint}.")
    raw = os.fspath(path)
    if isinstance(raw, bytes) and (len(raw) > 4096 or raw[:4] == b"PK\x03\x04"
                                   or (len(raw) > 8 and raw[8:9] == b"{"
                                       and int.from_bytes(raw[:8], "little") <= len(raw) - 8)):
        raise TypeError(f"{fn}: path is {len(raw)} bytes that look like a file's contents, not "
                        "its name; pass the file's path (a str or os.PathLike).")
    text = os.fsdecode(raw)
    if not text:
        raise FileNotFoundError(f"{fn}: path is empty; pass the file's path, e.g. "
                                "'model.safetensors'.")
    if "\0" in text:
        raise ValueError(f"{fn}: path {text[:80]!r} holds a NUL character, which no file name may "
                         "hold; pass the file's path.")
    return text


def is_zip(path, fn) -> bool:
    """Whether the file at ``path`` is a zip archive (an ``.npz``); a missing file, a
    folder or another unreadable path raises the ``OSError`` subclass ``open`` raised,
    its text starting with ``fn``."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{fn}: path is a {type(path).__name__}; pass the file's path (a str or "
                        "os.PathLike).")
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == b"PK\x03\x04"
    except FileNotFoundError:
        raise FileNotFoundError(f"{fn}: {os.fspath(path)!s} does not exist"
                                + (f": {_TILDE}" if _tilde(path) else "; pass the path of a file "
                                   "that jqt.save or jqt.save_packed wrote.")) from None
    except IsADirectoryError:
        raise IsADirectoryError(f"{fn}: {os.fspath(path)!s} is a folder; pass the path of the file "
                                "in it (e.g. .../qparams.safetensors for jqt.load, "
                                ".../model.safetensors for jqt.load_packed).") from None
    except OSError as e:
        raise type(e)(f"{fn}: {os.fspath(path)!s} cannot be read ({e.strerror or e}).") from None


# ---- reading, checked ---------------------------------------------------------------------------

_FIX = {FORMAT: "Re-save it with jqt.save (or restore a good copy).",
        PACKED_FORMAT: "Re-save it with jqt.save_packed (or restore a good copy)."}


_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
               int: "an integer", float: "a number", type(None): "null"}


def kind_name(kind) -> str:
    """The JSON name of a Python type (``dict``: "an object"), for errors."""
    return _JSON_KINDS.get(kind, kind.__name__)


def json_kind(v) -> str:
    """The JSON kind of ``v`` ("an object", "a list", ...), for errors."""
    return _JSON_KINDS.get(type(v), f"a {type(v).__name__}")


def is_a(v, kind) -> bool:
    """``isinstance(v, kind)``, where a bool is not an int (JSON ``true`` is not 1)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(v, kinds) and not (type(v) is bool and bool not in kinds and int in kinds)


def describe(a) -> str:
    """``"int8[64, 32]"``: an array's dtype and shape, for errors."""
    return f"{np.dtype(a.dtype).name}{list(np.shape(a))}"


def _first_line(e) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class _Checked:
    """What the readers of both formats share: errors that name the file, the fix and what
    is wrong; header fields checked as they are read; every tensor checked against the
    header's list of tensors. A subclass opens the file, sets ``fn`` and ``path`` and
    calls ``_open_checked``; it defines ``_open`` (sets ``names``, the tensors the file
    holds, and reads the header with ``_parse_header``), ``_read`` (one tensor) and
    ``close``."""

    fix = "Re-save it with jqt.save or jqt.save_packed (or restore a good copy)."
    encoded: dict = {}

    def error(self, what) -> FormatError:
        return FormatError(f"{self.fn}: {self.path} is damaged: {what}. {self.fix}")

    def need(self, d, key, kind, where):
        """``d[key]``, which must exist and be a ``kind`` (a type or tuple of types)."""
        if not isinstance(d, dict):
            raise self.error(f"{where} is {json_kind(d)}, expected an object")
        if key not in d:
            raise self.error(f"{where} has no {key!r}")
        if not is_a(d[key], kind):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            want = " or ".join(kind_name(k) for k in kinds)
            raise self.error(f"{where}: {key!r} is {json_kind(d[key])}, expected {want}")
        return d[key]

    def dtype(self, name, where):
        """The dtype named ``name`` (a number type NumPy, JAX or ml_dtypes knows)."""
        try:
            dt = np.dtype(dtype_from_name(name)) if isinstance(name, str) else None
        except FormatError:
            dt = None
        if dt is None or not (dt.kind in "biufc" or dt.type.__module__.startswith("ml_dtypes")):
            raise self.error(f"{where}: {name!r} is not a dtype this jqt knows (a file written "
                             "by a newer JAX or ml_dtypes?)")
        return dt

    def aval(self, d, where):
        """``(shape, dtype)`` from the header's ``[shape, dtype name]``."""
        ok = (isinstance(d, list) and len(d) == 2 and isinstance(d[0], list)
              and all(is_a(n, int) and n >= 0 for n in d[0]))
        if not ok:
            raise self.error(f"{where} is {json.dumps(d)}, expected [shape, dtype name]")
        return tuple(d[0]), self.dtype(d[1], where)

    def _fields(self, key, entry):
        """The header's object ``key`` (optional): name -> ``entry(value, where)``."""
        d = self.header.get(key)
        if d is None:
            return None
        if not isinstance(d, dict):
            raise self.error(f"the header's {key!r} is {json_kind(d)}, expected an object")
        return {n: entry(v, f"the header's {key!r} entry for tensor '{n}'") for n, v in d.items()}

    @functools.cached_property
    def tensors(self):
        """The header's list of tensors (``None`` in files written before it), checked
        against the tensors the file holds."""
        t = self._fields("tensors", self.aval)
        if t is not None:
            missing, extra = sorted(set(t) - self.names), sorted(self.names - set(t))
            if missing:
                raise self.error(f"the header lists tensor '{missing[0]}', which the file does "
                                 "not hold")
            if extra:
                raise self.error(f"the file holds tensor '{extra[0]}', which its header does not "
                                 "list")
        return t

    def get(self, name, what, shared=False):
        """Tensor ``name`` (``what``: its role, for errors), checked against the header's
        list of tensors. ``shared``: read once for every such call, the entries that name
        one tensor (codes that ops share) getting one array, which loaders place on the
        device once (qparams read their own: their scales train apart)."""
        if not isinstance(name, str) or name not in self.names:
            raise self.error(f"{what} is tensor {json.dumps(name)}, which the file does not hold")
        got = self.__dict__.setdefault("_got", {}) if shared else {}
        if name in got:
            return got[name]
        want = None if self.tensors is None else self.tensors[name]
        a = self._read(name, what)
        if want is not None and (a.shape, a.dtype) != want:
            raise self.error(f"tensor '{name}' ({what}) is {describe(a)}, but the header says "
                             f"{want[1].name}{list(want[0])}")
        got[name] = a
        return a

    def _open_checked(self):
        """Reads and checks the header (``_open``), closing the file if that fails."""
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _parse_header(self, text, meta):
        """The JSON header (``text``, str or bytes): an object whose format and version agree
        with ``meta`` (the plain metadata entries, if any)."""
        try:
            self.header = json.loads(text)
        except ValueError as e:  # (and UnicodeDecodeError)
            raise self.error(f"its header is not valid JSON ({_first_line(e)})") from None
        if not isinstance(self.header, dict):
            raise self.error(f"its header is {json_kind(self.header)}, expected a JSON object")
        self.format, self.version = self.header.get("format"), self.header.get("version")
        self.fix = _FIX.get(self.format, self.fix) if isinstance(self.format, str) else self.fix
        for k in ("format", "version"):
            if k in meta and meta[k] != str(self.header.get(k)):
                raise self.error(f"its metadata says {k} {meta[k]!r} but its 'jqt' header says "
                                 f"{self.header.get(k)!r}")
        v = self.version  # 2.0 == 2 and True == 1 in Python: a hand-edited header
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise self.error(f"its header's version is {json.dumps(v)}, where jqt writes an "
                             "integer")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Reader(_Checked):
    """Opens a safetensors file and checks that it is a jqt file (any kind) whose header
    is a JSON object; arrays read with :meth:`get` are checked against the header."""

    def __init__(self, path, fn):
        st = _safetensors()
        self.path, self.fn = path, fn
        try:
            self._f = st.safe_open(os.fspath(path), framework="np").__enter__()
        except FileNotFoundError:
            raise
        except Exception as e:  # noqa: BLE001 - safetensors' own error types, not exported
            what = ("neither a readable .npz archive (no zip header) nor a readable safetensors "
                    "file" if os.fspath(path).lower().endswith(".npz") else
                    "not a readable safetensors file")
            raise FormatError(f"{fn}: {path} is not a jqt file, or a damaged one ({what}: "
                              f"{_first_line(e)}). If jqt wrote it, re-save it "
                              "(jqt.save or jqt.save_packed) or restore a good copy.") from None
        self._open_checked()

    def _open(self):
        meta = self._f.metadata() or {}
        keys = list(self._f.keys())
        self.names = set(keys)
        if "jqt" not in meta:
            more = " ..." if len(keys) > 4 else ""
            raise FormatError(f"{self.fn}: {self.path} is a safetensors file but not a jqt file "
                              f"(no 'jqt' header; it holds tensors {keys[:4]}{more}). Float "
                              "weights (a model's checkpoint) are params: load them with "
                              "safetensors and quantize them with jqt.calibrate and jqt.pack; "
                              "pass this function a file jqt.save or jqt.save_packed wrote.")
        self.fix = _FIX.get(meta.get("format"), self.fix)
        self._parse_header(meta["jqt"], meta)

    def close(self):
        self._f.__exit__(None, None, None)  # closes the file (the arrays read are copies)

    @functools.cached_property
    def encoded(self):
        """Tensors stored as their bytes (``[dtype name, shape]`` in the header): name ->
        (dtype, shape)."""
        def entry(v, where):
            shape, dtype = self.aval(v[::-1] if isinstance(v, list) else v, where)
            return dtype, shape
        return self._fields("encoded", entry) or {}

    def _read(self, name, what):
        try:
            a = self._f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - safetensors' own error types, not exported
            raise self.error(f"tensor '{name}' ({what}) cannot be read "
                             f"({_first_line(e)})") from None
        enc = self.encoded.get(name)
        if enc is None:
            return a
        dtype, shape = enc
        if a.dtype != np.uint8 or a.ndim != 1 or a.size != math.prod(shape) * dtype.itemsize:
            raise self.error(f"tensor '{name}' ({what}) is {describe(a)}, not the bytes of the "
                             f"{dtype.name}{list(shape)} the header says")
        return np.frombuffer(a.tobytes(), dtype).reshape(shape)


class NpzReader(_Checked):
    """Opens a ``.npz`` qparams file (format version 1) and checks its header; arrays read
    with :meth:`get` are checked against it."""

    fix = _FIX[FORMAT]

    def __init__(self, path, fn):
        self.path, self.fn = path, fn
        self._fh = open(path, "rb")  # ours to close: np.load leaks its own on a damaged archive
        try:
            self._z = np.load(self._fh)
        except Exception as e:  # noqa: BLE001 - zipfile, zlib and NumPy raise many types
            self._fh.close()
            raise self.error(f"it is not a readable .npz archive ({_first_line(e)})") from None
        self._open_checked()

    def _open(self):
        if "__header__" not in self._z.files:
            arrays = sorted(self._z.files)
            more = " ..." if len(arrays) > 4 else ""
            raise FormatError(f"{self.fn}: {self.path} is an .npz file but not a jqt qparams file "
                              f"(no '__header__'; it holds arrays {arrays[:4]}{more}). Pass a file "
                              "jqt.save wrote; float weights saved with numpy are params (np.load "
                              "them, then jqt.calibrate and jqt.pack).")
        self.names = set(self._z.files) - {"__header__"}
        self._parse_header(self._read("__header__", "the header").tobytes(), {})

    def close(self):
        self._z.close()
        self._fh.close()

    def _read(self, name, what):
        try:
            return np.asarray(self._z[name])
        except Exception as e:  # noqa: BLE001 - a damaged member: zipfile, zlib, NumPy errors
            raise self.error(f"array '{name}' ({what}) cannot be read ({_first_line(e)})") from None


@contextlib.contextmanager
def reading(r, keep=()):
    """Turns an error the checks did not foresee, raised while ``r``'s file is read, into
    a :class:`FormatError` naming the file (the original is chained); ``keep``: error
    types that pass unchanged (a template or qparams that do not match the file)."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, OverflowError) as e:
        if isinstance(e, (FormatError,) + tuple(keep)):
            raise
        raise r.error(f"reading it failed ({type(e).__name__}: {_first_line(e)})") from e


def version_error(fn, path, fmt, version, want, read):
    """The error for a file of a version outside ``read`` (those this jqt reads of its kind;
    ``want``: all of them, said): a newer file, an older one, or one without a version
    (damaged, or not jqt's)."""
    said = f"{fn}: {path} holds format {fmt!r} version {version!r}; this jqt reads {want}."
    if not isinstance(version, int) or isinstance(version, bool):
        return FormatError(f"{said} A jqt file has an integer version: this one is damaged or "
                           "was not written by jqt. Re-save it with jqt (or restore a good copy).")
    if version > max(read):
        return FormatError(f"{said} Upgrade jqt (a newer jqt wrote it) or re-save it with this one.")
    return FormatError(f"{said} It is an older jqt's file, or a damaged one: load it with the "
                       "jqt that wrote it and re-save it with this one (or restore a good copy).")
