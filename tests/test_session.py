"""The merge session (issue 47, item 1): one owner of "open, plan, place, recipe", and each tensor's parameters
resolved once per merge (before: up to three times, twice in the planner and once in the merge)."""

from __future__ import annotations

import ast
import os

import pytest

import hubsoup
from hubsoup.engine import lowrank
from hubsoup.testing import make_base, make_finetune

from paths import ROOT


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("session")
    base = make_base("llama", str(root / "base"))
    return base, [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2)]


def test_each_tensor_s_parameters_are_resolved_once_per_merge(zoo, tmp_path, monkeypatch):
    base, fts = zoo
    calls: list[str] = []
    real = lowrank.resolve_params

    def counting(params, name, position):
        calls.append(name)
        return real(params, name, position)

    monkeypatch.setattr(lowrank, "resolve_params", counting)
    # a per-layer schedule: every tensor has parameters of its own (pieces, workspaces and the merge all read them)
    res = hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "o"),
                        params={"density": [0.2, 0.6], "scope": "tensor"}, quiet=True)
    mergeable = sorted(e.name for _, e in res.plan.entries() if e.mergeable)
    assert mergeable and sorted(calls) == mergeable


def test_a_trial_resolves_once_and_has_the_merge_s_recipe(zoo, tmp_path, monkeypatch):
    from hubsoup.workflows.trial import merge_in_memory

    base, fts = zoo
    params = {"density": [0.2, 0.6], "scope": "tensor"}
    written = hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "o"), params=params, quiet=True)
    calls: list[str] = []
    real = lowrank.resolve_params
    monkeypatch.setattr(lowrank, "resolve_params", lambda p, n, t: calls.append(n) or real(p, n, t))
    _, _, recipe = merge_in_memory(fts, "ties", base=base, params=params)
    assert recipe.hash == written.recipe.hash
    assert sorted(calls) == sorted(e.name for _, e in written.plan.entries() if e.mergeable)


def _calls(name: str) -> set[str]:
    """The modules of ``hubsoup/`` that call ``name``."""
    out = set()
    for d, _, files in os.walk(os.path.join(ROOT, "hubsoup")):
        for fn in files:
            if fn.endswith(".py"):
                path = os.path.join(d, fn)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call):
                        f_ = node.func
                        called = f_.id if isinstance(f_, ast.Name) else f_.attr if isinstance(f_, ast.Attribute) else ""
                        if called == name:
                            out.add(os.path.relpath(path, ROOT))
    return out


def test_only_the_session_builds_recipes_opens_a_merge_s_inputs_and_places_blocks():
    assert _calls("recipe_for") == {"hubsoup/session.py"}
    assert _calls("Recipe") <= {"hubsoup/recipe.py"}  # recipe_for's own, and Recipe.from_yaml's kin
    assert _calls("place_blocks") == {"hubsoup/session.py"}
    # a mergekit layout opens its own (re-mapped) inputs, when the session asks it to
    assert _calls("open_models") == {"hubsoup/session.py", "hubsoup/formats/mergekit/layout.py"}
    assert _calls("resolve_all") == {"hubsoup/session.py"}
