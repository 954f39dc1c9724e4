"""Checks that jqt's public API is documented: run before (and after) ``mkdocs build``.

    python docs/check_api.py                 # the API pages and the docstrings
    python docs/check_api.py --site SITE     # also: the built site has an entry for each

Public names are the names bound in ``jqt`` (``jqt/__init__.py``) that do not start
with ``_``, and the same in each public submodule that ``jqt`` binds (``jqt.recipes``,
``jqt.calibrators``, and any added later). For each one it checks:

1. it has a ``::: <name>`` block (mkdocstrings) in ``docs/api/*.md`` or
   ``docs/api.md``: one block per name, so that every name has its own entry;
2. it is linked from the overview tables in ``docs/api.md`` (``[`name`][name]``);
3. it has a docstring: what mkdocstrings renders, read with griffe as the build
   reads it (for a constant, a string literal right after the assignment);
4. a public function or class has an example in its docstring (a ``>>>`` line;
   the examples run as doctests under pytest, ``--doctest-modules`` over ``jqt/``);
5. with ``--site``: the built pages hold an anchor for it (``id="jqt.name"``).

It also fails on a ``:::`` block that names something that is neither public nor a
member of a public name. Public methods and properties without a docstring are
listed as notes (mkdocstrings hides them); ``--strict-members`` makes them errors.

Exits 1 and prints one line per problem, naming the symbol and the fix.
"""
from __future__ import annotations

import argparse
import html.parser
import importlib
import inspect
import pathlib
import re
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PACKAGE = "jqt"

# Hidden from the reference by mkdocs.yml's filters, like private names.
PYTREE_PROTOCOL = ("tree_flatten", "tree_unflatten")
BLOCK = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)


def public_names(package: str = PACKAGE) -> dict[str, object]:
    """``{"jqt.calibrate": <function>, "jqt.recipes.w8a8": ..., "jqt.recipes": <module>}``."""
    sys.path.insert(0, str(ROOT))
    root = importlib.import_module(package)
    names, todo, seen = {}, [root], set()
    while todo:
        mod = todo.pop(0)
        if mod.__name__ in seen:
            continue
        seen.add(mod.__name__)
        for name, obj in vars(mod).items():
            if name.startswith("_"):
                continue
            if isinstance(obj, types.ModuleType):
                if not obj.__name__.startswith(package + "."):
                    continue  # `import numpy as np` in a public module: not API
                todo.append(obj)
            elif type(obj).__module__ == "__future__":
                continue  # `from __future__ import annotations`
            names[f"{mod.__name__}.{name}"] = obj
    return names


def api_pages(docs: pathlib.Path) -> list[pathlib.Path]:
    pages = [docs / "api.md"] if (docs / "api.md").exists() else []
    return pages + sorted((docs / "api").glob("*.md"))


def documented_blocks(pages) -> dict[str, list[str]]:
    """``{identifier: [page, ...]}`` for every ``::: identifier`` block."""
    found: dict[str, list[str]] = {}
    for page in pages:
        for ident in BLOCK.findall(page.read_text()):
            found.setdefault(ident, []).append(str(page.relative_to(ROOT)))
    return found


def load_griffe(package: str = PACKAGE):
    try:
        import griffe
    except ImportError:
        sys.exit("docs/check_api.py needs griffe (the parser mkdocstrings uses): "
                 'pip install -e ".[docs]"')
    return griffe.load(package, search_paths=[str(ROOT)], docstring_parser="google")


def griffe_object(pkg, path: str):
    obj = pkg.modules_collection[path]
    return obj.final_target if obj.is_alias else obj


def has_example(obj) -> bool:
    texts = [obj.docstring.value if obj.docstring else ""]
    init = obj.members.get("__init__") if obj.is_class else None
    if init is not None and init.docstring:
        texts.append(init.docstring.value)
    return any(re.search(r"^\s*>>>", t, re.MULTILINE) for t in texts)


def undocumented_members(cls) -> list[str]:
    """Public methods and properties of ``cls`` itself without a docstring, that do
    not override a base-class member (which has its own entry)."""
    inherited = set()
    try:
        for base in cls.mro():
            inherited.update(base.members)
    except Exception:  # a base outside the package: cannot tell, check everything
        pass
    out = []
    for name, m in cls.members.items():
        if name.startswith("_") or name in PYTREE_PROTOCOL or m.is_alias or name in inherited:
            continue
        if (m.is_function or "property" in m.labels) and not m.docstring:
            out.append(name)
    return out


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k == "id" and v:
                self.ids.add(v)


def site_ids(site: pathlib.Path) -> set[str]:
    parser = _Ids()
    for page in site.rglob("*.html"):
        parser.feed(page.read_text(errors="replace"))
    return parser.ids


def check(docs: pathlib.Path, site: pathlib.Path | None, strict_members: bool,
          quiet: bool = False) -> int:
    names = public_names()
    pages = api_pages(docs)
    if not pages:
        print(f"error: no API pages (docs/api.md, docs/api/*.md) under {docs}")
        return 1
    blocks = documented_blocks(pages)
    overview = (docs / "api.md").read_text() if (docs / "api.md").exists() else ""
    pkg = load_griffe()
    ids = site_ids(site) if site else set()
    errors, notes = [], []

    for path, obj in sorted(names.items()):
        kind = ("module" if isinstance(obj, types.ModuleType) else "class" if inspect.isclass(obj)
                else "function" if callable(obj) and not isinstance(obj, type) and inspect.isroutine(obj)
                else "object")
        if path not in blocks:
            errors.append(f"{path}: not in the API reference; add a line `::: {path}` to a page "
                          "in docs/api/ (and a row to the tables in docs/api.md)")
        elif len(blocks[path]) > 1:
            errors.append(f"{path}: documented more than once ({', '.join(blocks[path])}); "
                          "keep one `:::` block")
        if kind != "module" and f"][{path}]" not in overview:
            errors.append(f"{path}: not linked from the overview; add a row with "
                          f"[`{path}`][{path}] to the tables in docs/api.md")
        try:
            g = griffe_object(pkg, path)
        except Exception as e:  # KeyError, alias resolution error
            errors.append(f"{path}: griffe (the docs build's parser) cannot find it ({e!r}); "
                          "bind it with `from module import name as name`")
            continue
        if g.docstring is None or not g.docstring.value.strip():
            where = f"{g.relative_filepath}:{g.lineno}" if g.lineno else str(g.relative_filepath)
            hint = (" (for a constant: a string literal on the line after the assignment)"
                    if g.is_attribute else "")
            errors.append(f"{path}: no docstring ({where}){hint}")
        elif kind in ("class", "function") and not has_example(g):
            errors.append(f"{path}: the docstring has no example (a `>>>` line, run as a "
                          f"doctest) ({g.relative_filepath}:{g.lineno})")
        if g.is_class:
            for m in undocumented_members(g):
                (errors if strict_members else notes).append(
                    f"{path}.{m}: public {'property' if 'property' in g.members[m].labels else 'method'}"
                    f" without a docstring, hidden from the reference ({g.relative_filepath}:"
                    f"{g.members[m].lineno})")
        if site is not None and path not in ids:
            errors.append(f"{path}: no entry (id=\"{path}\") in the built site {site}")

    public = set(names) | {PACKAGE}
    for ident, where in sorted(blocks.items()):
        if ident not in public and not any(ident.startswith(p + ".") for p in names):
            errors.append(f"{ident}: documented in {', '.join(where)} but not public "
                          f"(not a name bound in {PACKAGE} or its public submodules)")

    for n in [] if quiet else notes:
        print(f"note: {n}")
    for e in errors:
        print(f"error: {e}")
    n_ok = len(names)
    if errors:
        print(f"docs/check_api.py: {len(errors)} problem(s) in {n_ok} public names")
        return 1
    print(f"docs/check_api.py: {n_ok} public names documented, each with a docstring"
          f"{' and an entry in the built site' if site else ''}; every function and class "
          f"has an example")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=pathlib.Path, default=DOCS, help="the docs directory")
    ap.add_argument("--site", type=pathlib.Path, help="a built site to check for each entry")
    ap.add_argument("--strict-members", action="store_true",
                    help="fail on public methods/properties without a docstring")
    ap.add_argument("--quiet", action="store_true", help="print errors only, no notes")
    a = ap.parse_args(argv)
    return check(a.docs, a.site, a.strict_members, a.quiet)


if __name__ == "__main__":
    sys.exit(main())
