"""The code in README.md and docs/*.md runs: each page's ```python blocks, in order, as one script.

Conventions (HTML comments, invisible on GitHub and on the site):

- ``<!-- docs-test: after getting-started.md -->`` anywhere in a page: the page's blocks
  run after that page's blocks (its ``f``, ``params``, ``batches``, ``data``).
- ``<!-- no-run: reason -->`` on the line before a fence: that block is not run. Used
  only where running it needs what a test cannot have (a second process's state).

Each page runs in a fresh Python process (a page may set ``XLA_FLAGS`` before importing
jax), in a temporary directory (pages write files). Running every page takes a few
minutes, so it is marked ``slow`` (CI runs it), and so is the README's first block alone.
"""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)
NO_RUN = re.compile(r"<!--\s*no-run:[^>]*-->\s*$")
AFTER = re.compile(r"<!--\s*docs-test:\s*after\s+([\w.-]+\.md)\s*-->")
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))


def blocks(page):
    """The page's runnable ```python blocks, dedented, in order."""
    text = (ROOT / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not NO_RUN.search(before):
            out.append(textwrap.dedent(m.group("code")))
    return out


def script(page):
    """The code a page runs: the page it names as its start, then its own blocks."""
    after = AFTER.search((ROOT / page).read_text())
    prelude = script(f"docs/{after.group(1)}") if after else []
    return prelude + blocks(page)


def _run(code, cwd, what):
    env = dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, f"{what}:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


@pytest.mark.slow  # the README's block in a fresh interpreter, with the docs pages: CI
def test_readme_first_block_runs_as_pasted(tmp_path):
    """The README's first ```python block, alone: self-contained, no docs-test prelude."""
    assert not AFTER.search((ROOT / "README.md").read_text())
    _run(blocks("README.md")[0], tmp_path, "README.md, first block")


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_page_code_runs(page, tmp_path):
    _run("\n\n".join(script(page)), tmp_path, page)
