"""Imports sit at the top of their module (issue 33). An import inside a function is allowed only where it
says why, with a comment starting ``# lazy:`` on its line or the line just above it: an optional package
(Optuna, lm-eval, Ray, ...), a module kept off the ``hubsoup --help`` path (no torch there), or an import cost
measured to matter. Never to close an import cycle (issue 47: ``tests/test_imports.py`` finds none, counting these
imports): a cycle is dissolved by moving the name to its owner. Imports under a module-level ``if TYPE_CHECKING:``
are not in a function.
"""

from __future__ import annotations

import ast
import os

import pytest

from paths import ROOT
PKG = os.path.join(ROOT, "hubsoup")
MARK = "# lazy:"


def unexplained_imports(source: str, filename: str = "<source>") -> list[str]:
    """``"file:line: statement"`` for each import inside a function (or lambda) body of ``source`` that has
    no ``# lazy:`` comment on its first or last line or on the line just above it."""
    lines = source.splitlines()
    out = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_func and isinstance(child, (ast.Import, ast.ImportFrom)):
                near = lines[max(child.lineno - 2, 0): child.end_lineno]
                if not any(MARK in line for line in near):
                    out.append(f"{filename}:{child.lineno}: {lines[child.lineno - 1].strip()}")
            visit(child, in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source, filename), False)
    return out


def package_files() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(PKG) for f in fs if f.endswith(".py"))


def test_every_import_inside_a_function_says_why():
    bad = []
    for path in package_files():
        with open(path, encoding="utf-8") as f:
            bad += unexplained_imports(f.read(), os.path.relpath(path, ROOT))
    assert not bad, ("imports inside functions without a '# lazy: <why>' comment (move them to the module's "
                     "top, or say why they must stay):\n" + "\n".join(bad))


def test_no_import_is_lazy_to_close_a_cycle():
    said = []
    for path in package_files():
        with open(path, encoding="utf-8") as f:
            said += [f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}" for i, line in enumerate(f, 1)
                     if MARK in line and "cycle" in line.split(MARK, 1)[1]]
    assert not said, "imports kept inside functions to close an import cycle (move the name to its owner):\n" \
        + "\n".join(said)


def test_the_checker_fails_on_an_unexplained_import():
    src = (
        "import os\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    import torch\n"
        "def f():\n"
        "    import json\n"
        "    # lazy: optional extra (optuna)\n"
        "    import optuna\n"
        "    import ray  # lazy: optional extra (ray)\n"
        "    class C:\n"
        "        def g(self):\n"
        "            from math import (\n"
        "                pi,\n"
        "            )\n"
        "    return lambda: __import__('x')\n"
        "async def h():\n"
        "    try:\n"
        "        import gradio\n"
        "    except ImportError:\n"
        "        pass\n"
    )
    assert unexplained_imports(src, "m.py") == [
        "m.py:6: import json", "m.py:12: from math import (", "m.py:18: import gradio"]


@pytest.mark.parametrize("line", ["    import json  # lazy: optional extra (x)", "    # lazy: cycle\n    import json"])
def test_the_checker_accepts_a_lazy_comment(line):
    assert unexplained_imports(f"def f():\n{line}\n") == []


# What needs only the Hub client rules (repo-ID checks, specs, scrubbing): never torch (issue 47, item 2). The
# command line's modules and the Space's import these at their top; ``hubclient`` itself not even huggingface_hub.
LIGHT = ["hubsoup.hubclient", "hubsoup.errors", "hubsoup.public", "hubsoup.untrusted", "hubsoup.startup",
         "hubsoup.options", "hubsoup.cli", "hubsoup.cli.push", "hubsoup.cli.space", "hubsoup.space"]


def _imports_after(code: str) -> set[str]:
    import json
    import subprocess
    import sys

    probe = code + "\nimport json, sys\nprint(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return set(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_hub_client_rules_import_no_torch():
    assert not {"torch", "huggingface_hub"} & _imports_after("import hubsoup.hubclient")
    loaded = _imports_after(
        "import " + ", ".join(LIGHT) + "\n"
        "from hubsoup.hubclient import check_repo_id, is_hub_id, parse_spec, scrub_secrets\n"
        "assert check_repo_id('org/name') == 'org/name' and is_hub_id('org/name@v1')\n"
        "assert parse_spec('org/name@v1') == ('org/name', 'v1')\n"
        "assert scrub_secrets('hf_' + 'a' * 24) == 'hf_***'")
    assert not {"torch", "transformers", "safetensors"} & loaded


def test_the_torch_probe_can_fail():
    assert "torch" in _imports_after("import hubsoup.hub")  # the push module: card, methods, torch
