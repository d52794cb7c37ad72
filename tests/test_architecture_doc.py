"""ARCHITECTURE.md names every module of the package (issue 33): a new module without its line fails here."""

from __future__ import annotations

import os

from paths import ROOT


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


def test_every_method_hook_and_attribute_is_in_the_architecture_map():
    """Every hook of :class:`hubsoup.methods.Method` and every class attribute a method may set (issue 33)."""
    import ast

    with open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8") as f:
        doc = f.read()
    with open(os.path.join(ROOT, "hubsoup", "methods", "_base.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Method")
    hooks = [n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
             and n.name != "merge"]
    attrs = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
             and n.target.id not in ("name", "summary", "Params")]
    assert len(hooks) >= 15 and len(attrs) >= 8
    missing = [h for h in hooks if f"`{h}()`" not in doc] + [a for a in attrs if f"`{a}`" not in doc]
    assert not missing, f"Method hooks/attributes ARCHITECTURE.md does not name: {', '.join(missing)}"
