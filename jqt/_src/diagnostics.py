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


@contextlib.contextmanager
def per_op():
    """Warnings given with :func:`warn_op` inside, one per message on exit that names every
    op it was given for (a model of 128 layers: one warning, not 128). Thread-local.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     with per_op():
    ...         for k in ("l0", "l1"):
    ...             warn_op("jqt: {ops}: slow.", k)
    >>> [str(m.message) for m in w]
    ["jqt: ops 'l0', 'l1': slow."]
    """
    outer = getattr(_local, "ops", None)
    _local.ops = groups = {}
    try:
        yield
    finally:
        _local.ops = outer
    for template, keys in groups.items():
        shown = ", ".join(f"'{k}'" for k in keys[:8]) + (f" and {len(keys) - 8} more"
                                                        if len(keys) > 8 else "")
        warn(template.format(ops=f"op {shown}" if len(keys) == 1 else f"ops {shown}"))


def warn_op(template: str, key: str) -> None:
    """:func:`warn` of ``template`` with ``{ops}`` naming op ``key``; inside :func:`per_op`,
    collected with the other ops of the same template."""
    groups = getattr(_local, "ops", None)
    if groups is None:
        warn(template.format(ops=f"op '{key}'"))
    elif key not in groups.setdefault(template, []):
        groups[template].append(key)

