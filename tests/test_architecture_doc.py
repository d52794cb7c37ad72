"""ARCHITECTURE.md names every module of the package (issue 33): a new module without its line fails here."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _named(doc: str, rel: str) -> bool:
    """Whether ``rel`` (a path under hubsoup/) is named in backticks, as itself or any tail of it
    (``ties.py``, ``metrics/accuracy/accuracy.py``); a package's ``__init__.py`` by its folder (``continual/``)."""
    parts = rel.split("/")
    if parts[-1] == "__init__.py" and len(parts) > 1:
        return any(f"`{'/'.join(parts[i:-1])}/`" in doc for i in range(len(parts) - 1))
    return any(f"`{'/'.join(parts[i:])}`" in doc for i in range(len(parts)))


def test_every_module_is_in_the_architecture_map():
    with open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8") as f:
        doc = f.read()
    pkg = os.path.join(ROOT, "hubsoup")
    rels = [os.path.relpath(os.path.join(d, fn), pkg).replace(os.sep, "/")
            for d, _, files in os.walk(pkg) for fn in files if fn.endswith(".py")]
    assert len(rels) > 100
    missing = sorted(r for r in rels if not _named(doc, r))
    assert not missing, f"modules ARCHITECTURE.md does not name: {', '.join(missing)}"
    assert not _named("`other.py`", "methods/ties.py")  # the check itself can fail
