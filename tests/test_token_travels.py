"""Issue 47, item 2: the run's token travels only as an argument — never through a context variable.

A path an argument misses would ask the Hub with huggingface_hub's ambient token (``HF_TOKEN`` or the stored login):
on a Space, the *server's*. Here the ambient token is alice's (the server) and the run's is bob's (a visitor); one
``hub_only`` merge reads everything a run can read from the Hub — the models (read in place), LOT's exemplars from
Hub datasets, an evaluation's Hub dataset, an lm-eval task repo and the dataset its task names — and every request
the test Hub (``tests/hub_server.py``) received must carry bob's token: none alice's, none anonymous.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import random

import pytest

import hubsoup
from hubsoup.testing import choice_task_yaml, tiny_lm_family
import paths  # tests/paths.py: the repository's root, wherever a test module sits

PKG = os.path.join(paths.ROOT, "hubsoup")

TASK = choice_task_yaml("toy_token", "bob/mc", hub_dataset=True)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny Llama base with a tokenizer, two fine-tunes, and the rows of every dataset the run reads."""
    root = tmp_path_factory.mktemp("token-zoo")
    base, fts = tiny_lm_family(str(root), base_model="bob/base")
    rng = random.Random(0)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(100)}" for _ in range(n))

    def jsonl(rows: list[dict]) -> str:
        return "".join(json.dumps(r) + "\n" for r in rows)

    mc = jsonl([{"query": words(5), "choices": [words(2) for _ in range(3)], "gold": rng.randrange(3)}
                for _ in range(4)])
    return {"base": base, "ft-a": fts[0], "ft-b": fts[1], "mc": mc,
            "ex-a": jsonl([{"text": words(8)} for _ in range(4)]), "ex-b": jsonl([{"text": words(8)} for _ in range(4)]),
            "eval": jsonl([{"text": words(12)} for _ in range(3)])}


def test_a_hub_only_run_asks_the_hub_with_its_own_token_only(hub, zoo, tmp_path):
    pytest.importorskip("lm_eval", reason="hubsoup[lmeval] is not installed")
    for name in ("base", "ft-a", "ft-b"):
        hub.seed(f"bob/{name}", zoo[name])
    for name, rows in (("mc", zoo["mc"]), ("ex-a", zoo["ex-a"]), ("ex-b", zoo["ex-b"]), ("eval-data", zoo["eval"])):
        hub.seed(f"bob/{name}", {"train.jsonl": rows}, repo_type="dataset")
    hub.seed("bob/tasks", {"toy.yaml": TASK}, repo_type="dataset")
    # public repos: a request with the wrong token still succeeds, so the run finishes and the log names the path
    hub.login("alice")  # HF_TOKEN: the server's token, the one a missed argument would fall back to
    assert os.environ["HF_TOKEN"] == hub.token("alice")
    hub.requests.clear()
    res = hubsoup.merge(["bob/ft-a", "bob/ft-b"], "lot", base="bob/base", out=str(tmp_path / "soup"), quiet=True,
                        hub_only=True, cache_dir=str(tmp_path / "cache"), token=hub.token("bob", write=False),
                        exemplars={"1": "bob/ex-a", "2": "bob/ex-b:train"}, n_exemplars=4,
                        evaluate=["perplexity:bob/eval-data,split=train",
                                  "lm-eval:toy_token,task_dir=bob/tasks,batch_size=2"])
    assert {r.task.name for r in res.evaluation} >= {"toy_token"} and len(res.evaluation) == 2
    calls = hub.calls()
    # every kind of read happened: the models, the exemplars, the eval data, the task repo and its task's data
    for part in (r"bob/ft-a", r"datasets/bob/ex-a", r"datasets/bob/ex-b", r"datasets/bob/eval-data",
                 r"datasets/bob/tasks", r"datasets/bob/mc"):
        assert hub.calls(path=part), f"no request for {part}: the test no longer covers that path"
    wrong = sorted({(c["method"], c["path"], c["user"]) for c in calls if c["user"] != "bob"})
    assert wrong == [], f"requests not made with the run's token: {wrong}"


def test_no_module_reads_a_token_from_a_context_variable():
    """``Access`` (the run's context variable) carries no token, ``scope`` refuses one, and no module reads a
    ``token`` attribute off the run's rules (``current().token``, or a name bound to ``current()``)."""
    from hubsoup.sources.access import Access, scope

    assert "token" not in {f.name for f in dataclasses.fields(Access)}
    with pytest.raises(TypeError, match="no token"):
        with scope(token="hf_x"):
            pass
    found = []
    for folder, _, files in os.walk(PKG):
        for fn in files:
            if not fn.endswith(".py"):
                continue
            path = os.path.join(folder, fn)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and _callee(node) == "ContextVar":
                    text = ast.unparse(node.args[0]) if node.args else ""
                    if "token" in text.lower():
                        found.append(f"{path}:{node.lineno}: a ContextVar for a token")
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                    continue
                bound = {t.id for n in ast.walk(node) if isinstance(n, ast.Assign) and _is_current(n.value)
                         for t in n.targets if isinstance(t, ast.Name)}
                for n in ast.walk(node):
                    if isinstance(n, ast.Attribute) and n.attr == "token" and (
                            _is_current(n.value) or (isinstance(n.value, ast.Name) and n.value.id in bound)):
                        found.append(f"{path}:{n.lineno}: {ast.unparse(n)}")
    assert found == [], found


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _is_current(node: ast.AST) -> bool:
    """A call of the run's rules: ``current()``, ``access.current()``, ``current_access()``."""
    return isinstance(node, ast.Call) and _callee(node) in ("current", "current_access")
