"""jqt's warnings, attributed to the caller's code.

A warning raised deep inside jqt (a calibrator, the analysis of a jaxpr) names the line
of the user's program that called jqt, not jqt's own: :func:`warn` walks the stack out of
the package first, as Python 3.12's ``skip_file_prefixes`` does. It walks out of JAX's
and jaxlib's frames too: jqt runs much of its work inside a JAX trace (``jax.jit`` of
its interpreter), where the innermost frame outside jqt is JAX's.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings

import jax
import jaxlib

_SKIPPED = tuple(os.path.dirname(os.path.abspath(path)) + os.sep
                 for path in (os.path.dirname(__file__), jax.__file__, jaxlib.__file__))


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
