"""Command-line argument types shared by the benchmark scripts.

Each function here is an ``argparse`` ``type=``: a bad value is refused by the parser
with ``error: argument --FLAG: ...`` before the script builds or runs anything. This
module imports neither jax nor jqt (``gpu_compile.py``'s parent process must not
start a backend: the accelerator's memory is its children's).
"""
from __future__ import annotations

import argparse


def at_least(minimum: int):
    """An integer type that refuses values below ``minimum``."""
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, not {value}")
        return value
    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int = at_least(1)
"""Round, repeat, step, job and row counts: integers >= 1."""


def positive_float(text):
    """A number > 0 (a duration in seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
    return value


def int_list(text):
    """``"1,2,4"`` -> ``(1, 2, 4)``: comma-separated positive integers (batch sizes, row counts)."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected comma-separated positive integers, got nothing")
    out = []
    for s in items:
        try:
            value = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{s!r} is not an integer (expected comma-separated positive integers)") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
        out.append(value)
    return tuple(out)


def names(choices, key=None):
    """A type for ``--only``-style flags: comma-separated names out of ``choices`` -> the
    list of the choices named, in the order given. ``key`` normalises a name before the
    lookup (e.g. ``str.lower`` for case-insensitive names); an unknown name is refused
    with the list of choices."""
    key = key or (lambda s: s)
    by_key = {key(c): c for c in choices}

    def parse(text):
        items = [s.strip() for s in str(text).split(",") if s.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"name at least one of {', '.join(map(repr, choices))}")
        unknown = [s for s in items if key(s) not in by_key]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(map(repr, choices))}")
        return [by_key[key(s)] for s in items]
    parse.__name__ = "names"
    return parse


BOOLEAN = {"1": True, "true": True, "0": False, "false": False}


def boolean(text):
    """``1`` / ``0`` / ``true`` / ``false`` (any case) -> bool; anything else is refused."""
    try:
        return BOOLEAN[str(text).strip().lower()]
    except KeyError:
        raise ValueError(f"{text!r} is not a boolean (1, 0, true or false)") from None


def kernel_policy_types():
    """``{field: "int" or "bool"}`` of ``jqt.KernelPolicy`` (imports this checkout's jqt)."""
    import dataclasses
    import importlib

    importlib.import_module("paths")  # this checkout's jqt first on sys.path
    import jqt
    return {f.name: getattr(f.type, "__name__", str(f.type)) for f in dataclasses.fields(jqt.KernelPolicy)}


def policy_fields(text, types=None):
    """``"field=value,..."`` -> ``{field: int or bool}``, checked against ``types``
    (``{field: "int" or "bool"}``, default :func:`kernel_policy_types`): an unknown field,
    a missing value, a bool field given anything but 1/0/true/false or an int field given
    anything but an integer raises ``ValueError`` naming it; with the default ``types``, so
    does a value ``jqt.KernelPolicy`` refuses (``native_gemv_rows=-1``)."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        return {}
    check_policy = types is None
    types = kernel_policy_types() if types is None else types
    fields = {}
    for item in items:
        key, eq, value = (s.strip() for s in item.partition("="))
        if key not in types:
            raise ValueError(f"{key!r} is not a jqt.KernelPolicy field ({', '.join(types)})")
        if not eq or not value:
            raise ValueError(f"{item!r}: give a value, {key}=VALUE")
        if types[key] == "bool":
            try:
                fields[key] = boolean(value)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        else:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"{key}={value!r}: {key} takes an integer") from None
    if check_policy:
        # The policy's own range checks (e.g. ``native_gemv_rows >= 0``) run here, so a
        # bad value is refused before any work rather than after a model was set up.
        import dataclasses
        import jqt
        dataclasses.replace(jqt.KernelPolicy(), **fields)
    return fields
