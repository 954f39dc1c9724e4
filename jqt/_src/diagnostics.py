"""jqt's warnings, attributed to the caller's code.

A warning raised deep inside jqt (a calibrator, the analysis of a jaxpr) names the line
of the user's program that called jqt, not jqt's own: :func:`warn` walks the stack out of
the package first, as Python 3.12's ``skip_file_prefixes`` does. It walks out of JAX's
and jaxlib's frames too: jqt runs much of its work inside a JAX trace (``jax.jit`` of
its interpreter), where the innermost frame outside jqt is JAX's.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import warnings

import jax
import jaxlib


def _package_dir(name):
    """The folder of package ``name`` (not imported), or None."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return None if spec is None or not spec.origin else os.path.dirname(os.path.abspath(spec.origin))


# jqt, JAX and jaxlib; the frameworks' jit wrappers a quantized function runs under
# (equinox.filter_jit, flax.nnx.jit); contextlib's own frame (grouped warns on exit)
_SKIPPED = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                 for path in (os.path.dirname(__file__), jax.__file__, jaxlib.__file__)) + tuple(
    d + os.sep for d in map(_package_dir, ("equinox", "flax")) if d) + (
    os.path.abspath(contextlib.__file__),)


def caller_level() -> int:
    """The ``stacklevel`` of the innermost frame outside jqt, JAX and jaxlib, seen from
    ``warn``'s caller."""
    level, frame = 2, sys._getframe(2)  # the frame of warn's caller's caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level


_local = threading.local()


@contextlib.contextmanager
def captured():
    """jqt's warnings (:func:`warn`) in this thread, collected into the list it yields as
    ``(message, category)`` pairs instead of shown. Thread-local: ``warnings.catch_warnings``
    swaps process-wide state, and two threads' windows that overlapped (two
    ``jqt.fallback`` calls) left every later warning of the process in a dead list.

    >>> with captured() as got:
    ...     warn("jqt: kept")
    >>> got
    [('jqt: kept', <class 'UserWarning'>)]
    """
    stack = _local.__dict__.setdefault("stack", [])
    got = []
    stack.append(got)
    try:
        yield got
    finally:
        stack.pop()


def warn(message: str, category: type = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame outside jqt; inside
    :func:`captured`, recorded instead.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     warn("jqt: a test")
    >>> w[0].filename.endswith("diagnostics.py"), str(w[0].message)
    (False, 'jqt: a test')
    """
    stack = getattr(_local, "stack", None)
    if stack:
        stack[-1].append((message, category))
        return
    warnings.warn(message, category, stacklevel=caller_level())


def warn_held(pairs, failing: bool) -> None:
    """:func:`warn` of each held ``(message, category)``; where the call that held them is
    ``failing`` (an exception, Ctrl-C, on its way out), one that the warnings filter makes
    an error (``python -W error``) is dropped rather than raised in its place.

    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error")
    ...     warn_held([("jqt: a note", UserWarning)], failing=True)  # the caller re-raises its own
    """
    for message, category in pairs:
        if not failing:
            warn(message, category)
            continue
        try:
            warn(message, category)
        except Exception:  # (a warning as an error: the exception under way is the one)
            pass


@contextlib.contextmanager
def grouped():
    """Warnings given with :func:`warn_grouped` inside, one per kind when it ends: the
    first op's message, naming the others (a model of 24 layers: one warning, not 24).
    Thread-local; a nested one gathers into the outer one.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     with grouped():
    ...         for k in ("l0", "l1", "l2"):
    ...             warn_grouped("slow", f"jqt: op '{k}' is slow.", f"'{k}'")
    >>> [str(m.message) for m in w]
    ["jqt: op 'l0' is slow. The same holds for 2 more ops: 'l1', 'l2'."]
    """
    if getattr(_local, "groups", None) is not None:
        yield
        return
    _local.groups = groups = {}
    failing = True
    try:
        yield
        failing = False
    finally:
        _local.groups = None
        held = []
        for msgs, labels in groups.values():
            n = len(msgs) - 1
            more = "" if not n else (f" The same holds for {n} more op{'s' if n > 1 else ''}: "
                                     + ", ".join(labels[1:7]) + (f" and {n - 6} more" if n > 6
                                                                 else "") + ".")
            held.append((msgs[0] + more, UserWarning))
        warn_held(held, failing)


def warn_grouped(kind, message: str, label: str) -> None:
    """:func:`warn` of ``message`` (about one op, named ``label`` in a list); inside
    :func:`grouped`, gathered with the other messages of the same ``kind`` (an identical
    message once)."""
    groups = getattr(_local, "groups", None)
    if groups is None:
        warn(message)
        return
    msgs, labels = groups.setdefault(kind, ([], []))
    if message not in msgs:
        msgs.append(message)
        labels.append(label)


def einsum_order(keys) -> str:
    """A hint where a mismatched key is a ``jnp.einsum``'s (a scope of it is the spec,
    ``'bi,ij,jk->bk'``): with three or more operands, the order it contracts them in
    follows their shapes."""
    spec = next((part for k in keys for part in k.split("/")
                 if "->" in part and part.split("->")[0].count(",") >= 2), None)
    return ("" if spec is None else
            f" An einsum of three or more operands ('{spec}') contracts them in an order "
            "jnp.einsum picks from their shapes, so other input shapes can give other ops: "
            "pass optimize=False to it, or write it as two einsums, and re-calibrate.")
