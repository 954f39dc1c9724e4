"""Griffe extension: reST idioms in jqt's docstrings rendered as Markdown.

jqt's docstrings are Google style, written to read well in ``help()``: they name
other symbols with Sphinx roles (``:class:`jqt.Rule```, ``:meth:`worst```) and
give examples as bare doctest blocks (``>>>`` lines), which pytest runs. Markdown
would show a role verbatim and take ``>>>`` for nested block quotes, so once the
package is loaded this extension rewrites every docstring:

- a role becomes a mkdocstrings cross-reference, ``[`jqt.Rule`][jqt.Rule]``.
  Unqualified names are resolved from the documented object's scope outwards, as
  Python would (``:meth:`worst``` in ``Report``'s docstring is
  ``Report.worst``). A name that does not resolve is kept as written, so
  ``mkdocs build --strict`` fails on it (autorefs reports the unknown target)
  instead of rendering a dead link.
- a doctest block (from a ``>>>`` line to the next blank line, as docutils reads
  it) becomes a fenced ``pycon`` code block; ``# doctest: +FLAG`` comments are
  dropped from the rendering, as Sphinx's ``trim_doctest_flags`` does.
- a literal block (a paragraph ending in ``::``, then an indented block) becomes
  a fenced ``python`` code block, and the ``::`` a ``:``, as Sphinx renders it.

Loaded by ``mkdocs.yml`` (``extensions: [docs/sphinx_compat.py]``); not a page
(``exclude_docs``).
"""
from __future__ import annotations

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(class|func|meth|mod|attr|data|exc|obj):`(~?)([\w.]+)`")
_DOCTEST_FLAGS = re.compile(r"\s*#\s*doctest:.*$")
_EXAMPLES_SECTION = re.compile(r"^\s*Examples?:\s*$", re.MULTILINE)


def _target(obj: griffe.Object, name: str) -> str:
    """The full path that ``name`` refers to from inside ``obj``."""
    scope = obj if obj.is_class or obj.is_module else (obj.parent or obj)
    head, _, rest = name.partition(".")
    for candidate, suffix in ((name, ""), (head, rest)):
        try:
            path = scope.resolve(candidate)
        except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError):
            continue
        return f"{path}.{suffix}" if suffix else path
    return name


def _roles(obj: griffe.Object, text: str) -> str:
    def replace(m: re.Match) -> str:
        role, short, name = m.groups()
        shown = name.rsplit(".", 1)[-1] if short else name
        if role in ("func", "meth"):
            shown += "()"
        return f"[`{shown}`][{_target(obj, name)}]"

    return _ROLE.sub(replace, text)


def _doctests(text: str) -> str:
    """Fences each doctest block (``>>>`` to the next blank line) as ``pycon``."""
    if _EXAMPLES_SECTION.search(text):  # griffe parses an Examples: section itself
        return text
    out, block, indent = [], [], ""

    def flush():
        if block:
            out.append(f"{indent}```pycon")
            out.extend(block)
            out.append(f"{indent}```")
            block.clear()

    for line in text.splitlines():
        stripped = line.lstrip()
        if not block and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
        if block or stripped.startswith(">>>"):
            if not stripped:
                flush()
                out.append(line)
                continue
            if stripped.startswith((">>>", "...")):
                line = _DOCTEST_FLAGS.sub("", line)
            block.append(line)
        else:
            out.append(line)
    flush()
    return "\n".join(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _literal_blocks(text: str) -> str:
    """``text::`` + blank line + indented block -> ``text:`` + a fenced code block."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^(\s*)(.*?)\s*::\s*$", line)
        j = i + 1
        while m and j < len(lines) and not lines[j].strip():
            j += 1
        k = j
        while m and k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > len(m.group(1))):
            k += 1
        while k > j and not lines[k - 1].strip():
            k -= 1
        if not m or j == i + 1 or k == j:  # not "text::", blank line, indented block
            out.append(line)
            i += 1
            continue
        pad, block = m.group(1), lines[j:k]
        cut = min(_indent(b) for b in block if b.strip())
        if m.group(2):
            out += [f"{pad}{m.group(2)}:", ""]
        out.append(f"{pad}```python")
        out += [f"{pad}{b[cut:]}" if b.strip() else "" for b in block]
        out.append(f"{pad}```")
        i = k
    return "\n".join(out)


def _walk(obj: griffe.Object):
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from _walk(member)


class SphinxCompat(griffe.Extension):
    """Rewrites roles, doctest and literal blocks in every docstring of a loaded package."""

    def on_package(self, *, pkg: griffe.Module, **kwargs) -> None:
        for obj in _walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = _literal_blocks(_doctests(_roles(obj, obj.docstring.value)))
