"""One executor abstraction for every search (evolve, ``merge --search``, pipelines): candidates merged in memory and
scored where the executor runs them, inputs pinned once on the driver, the driver alone writing and pushing.

These tests run the executor path in this process (:class:`LocalExecutor` given as an object: the same tasks a
Ray cluster runs, :func:`hubsoup.workflows.trial.run_trial`) and check it gives what the local default gives:
the same ``hubsoup_search.json`` scores and best point, the same leaderboard, the same pushed files.
``tests/workflows/test_scale_ray.py`` runs the same on a real Ray cluster.
"""

from __future__ import annotations

import json
import os

import pytest
from method_helpers import tiny_lm_zoo  # tests/ is on sys.path

from hubsoup.cli import main
from hubsoup.errors import ParameterError
from hubsoup.eval import TaskSpec
from hubsoup.workflows.executors import LocalExecutor
from hubsoup.workflows.search import search
from tests.workflows.pipeline.test_pipeline import (example, publish, run,  # noqa: F401 - the pipeline tests' models
                                                    soup_repos, zoo)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base, fts, data = tiny_lm_zoo(tmp_path_factory.mktemp("executors"))
    return base, fts, str(data)


GRID = {"density": [0.2, 0.5, 0.8], "merge": ["mean", "sum"]}


def read(folder, name):
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


def search_table(folder):
    data = json.loads(read(folder, "hubsoup_search.json"))
    data.pop("seconds")  # where the time went differs; nothing else may
    return data


def assert_same_search(a, b):
    assert search_table(a) == search_table(b)
    for name in ("model.safetensors", "eval_results.json", "hubsoup_recipe.yaml", "config.json"):
        assert read(a, name) == read(b, name), name
    assert card(a) == card(b)


def card(folder):
    """The card with the output's own path and name (its title) written X."""
    text, name = read(folder, "README.md").decode(), os.path.basename(folder)
    return text.replace(folder, "X").replace(f"name: {name}\n", "name: X\n").replace(f"# {name}\n", "# X\n")


def search_both(tiny, tmp_path, executor, **kw):
    base, fts, data = tiny
    tasks = [TaskSpec.parse(f"perplexity:{data}")]
    a = search(fts, "ties", base=base, out=str(tmp_path / "local"), grid=GRID, tasks=tasks, quiet=True, **kw)
    b = search(fts, "ties", base=base, out=str(tmp_path / "exec"), grid=GRID, tasks=tasks, quiet=True,
               executor=executor, **kw)
    return a, b


@pytest.mark.slow
def test_search_through_an_executor_gives_the_local_search(tiny, tmp_path):
    a, b = search_both(tiny, tmp_path, LocalExecutor())
    assert a.best == b.best and a.best_score == b.best_score and len(b.scores) == 6
    assert_same_search(str(tmp_path / "local"), str(tmp_path / "exec"))
    assert sorted(os.listdir(tmp_path)) == ["exec", "local"]  # no temporary folder or lock left


def test_search_executor_errors_are_named_before_any_work(tiny, tmp_path):
    base, fts, data = tiny
    tasks = [TaskSpec.parse(f"perplexity:{data}")]
    with pytest.raises(ParameterError, match="executor must be 'local', 'ray' or 'ray://HOST:PORT', got 'rya'"):
        search(fts, "ties", base=base, out=str(tmp_path / "o"), grid=GRID, tasks=tasks, executor="rya")
    with pytest.raises(ParameterError, match="score with tasks"):
        search(fts, "ties", base=base, out=str(tmp_path / "o"), grid=GRID, score_fn=len, executor=LocalExecutor())
    with pytest.raises(ParameterError, match="'output_format' needs the local executor"):
        search(fts, "ties", base=base, out=str(tmp_path / "o"), grid=GRID, tasks=tasks, executor=LocalExecutor(),
               output_format="lora", rank=4)
    assert not os.path.exists(tmp_path / "o")
    assert main(["merge", *fts, "--base", base, "--method", "ties", "--out", str(tmp_path / "o"),
                 "--executor", "ray"]) == 2  # --executor runs a search's points
    assert not os.path.exists(tmp_path / "o")


def test_a_trial_keeps_the_drivers_hub_only_rule_in_a_worker_process(tiny):
    """A worker process has no scope of its own: the driver's ``hub_only`` travels in the payload, and a trial
    naming a local folder then fails as the driver would fail it, before the folder is opened."""
    from hubsoup.workflows.trial import run_trial

    base, fts, data = tiny
    payload = {"number": 0, "inputs": fts, "base": base, "method": "ties", "params": {},
               "tasks": [f"perplexity:{data}"]}
    assert run_trial(payload)["state"] == "complete"  # the same trial without the rule merges
    r = run_trial({**payload, "hub_only": True})
    assert r["state"] == "fail" and "only Hub repo IDs" in r["reason"], r["reason"]


def test_a_session_scores_each_trial_as_a_fresh_process_from_inputs_kept_in_memory(tiny, tmp_path):
    """A process' session (inputs opened once and kept in memory, one model whose weights each merge replaces, one
    evaluator) gives every trial exactly what a trial that opens and builds everything itself gives; once the first
    trial has read the weights, the files are not read again (they are moved away here)."""
    import shutil

    from hubsoup.workflows.trial import TrialSessions, run_trial

    base, fts, data = tiny
    payloads = [{"number": i, "inputs": fts, "base": base, "method": "ties", "params": params,
                 "tasks": [f"perplexity:{data}", f"perplexity:{data}"], "keep": True, "batch_size": 4}
                for i, params in enumerate([{"density": 0.3}, {"density": 0.8, "merge": "sum"},
                                            {"density": 0.5, "weights": [[0.2, 0.9], [0.7, 0.1]]},
                                            {"density": 0.3}])]
    fresh = [run_trial(p) for p in payloads]
    sessions = TrialSessions()
    kept = [run_trial(payloads[0], sessions)]
    away = tmp_path / "away"
    moved = []
    for folder in (base, *fts):  # the weights only: the tokenizer and config stay
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                (away / os.path.basename(folder)).mkdir(parents=True, exist_ok=True)
                moved.append((os.path.join(folder, name), str(away / os.path.basename(folder) / name)))
                shutil.move(*moved[-1])
    try:
        kept += [run_trial(p, sessions) for p in payloads[1:]]
    finally:
        for src, dst in moved:
            shutil.move(dst, src)
        sessions.close()
    for a, b in zip(fresh, kept):
        assert b["state"] == "complete", b.get("reason")
        assert (a["score"], a["metrics"]) == (b["score"], b["metrics"])
    assert len({r["score"] for r in kept}) == 3  # the points differ (the last repeats the first)
    assert [r["session"] for r in kept] == [{"new": True, "kept": True}] + [{"new": False, "kept": True}] * 3
    assert all(r["session"]["new"] for r in fresh)
    assert kept[0]["seconds"]["open"] > 0 and all(r["seconds"]["open"] < 0.01 for r in kept[1:])


def test_a_merge_written_in_place_is_the_model_a_merge_builds(tmp_path):
    """``empty_model`` + ``ModelSink`` (a session's model, filled in place) hold what ``MemorySink.model`` builds from
    the same merge: every tensor, its dtype included (here a bf16 model with float32 norms, merged to float16 and
    as stored)."""
    import torch
    from safetensors.torch import load_file, save_file

    from hubsoup.output.memory import MemorySink, ModelSink, empty_model
    from hubsoup.testing import make_base, make_finetune
    from hubsoup.session import open_inputs, parse_method
    from hubsoup.workflows.trial import _fetch, _merge, _options
    from hubsoup.plan import Plan

    base = make_base("llama", str(tmp_path / "base"), dtype=torch.bfloat16)
    f = os.path.join(base, "model.safetensors")
    sd = load_file(f)
    save_file({k: v.float() if "norm" in k else v for k, v in sd.items()}, f, metadata={"format": "pt"})
    fts = [make_finetune(base, str(tmp_path / f"ft{i}"), seed=i, scale=0.05) for i in (1, 2)]
    for dtype in (None, "float16"):
        payload = {"inputs": fts, "base": base, "method": "ties", "params": {"density": 0.5},
                   "options": {"dtype": dtype}}
        opts = _options(payload)
        m, p = parse_method("ties", {"density": 0.5})
        ckpt, sources = open_inputs(fts, base, m, p, opts, headers_only=True)
        _fetch(ckpt, sources)
        built = MemorySink(Plan.of(ckpt, "cpu"), dtype=dtype)
        _merge(ckpt, sources, "ties", {"density": 0.5}, opts, built)
        a = built.model(ckpt.folder).state_dict()
        model = empty_model(ckpt.folder, Plan.of(ckpt, "cpu"), dtype=dtype)
        _merge(ckpt, sources, "ties", {"density": 0.5}, opts, ModelSink(Plan.of(ckpt, "cpu"), model, dtype=dtype))
        b = model.state_dict()
        assert a.keys() == b.keys()
        assert {str(t.dtype) for t in b.values()} == ({"torch.bfloat16", "torch.float32"} if dtype is None
                                                      else {"torch.float16"})
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_a_session_is_replaced_by_another_searchs_trial(tiny):
    from hubsoup.workflows.trial import TrialSessions, run_trial

    base, fts, data = tiny
    p = {"number": 0, "inputs": fts, "base": base, "method": "ties", "params": {"density": 0.5},
         "tasks": [f"perplexity:{data}"]}
    sessions = TrialSessions()
    a = run_trial(p, sessions)
    b = run_trial({**p, "inputs": fts[:1] * 2}, sessions)  # other inputs: a new session
    c = run_trial(p, sessions)
    sessions.close()
    assert [r["session"]["new"] for r in (a, b, c)] == [True, True, True]
    assert a["score"] == c["score"] != b["score"]
    assert not a["session"]["kept"]  # kept in memory only when the payload asks (evolve does)


# ---- pipelines ---------------------------------------------------------------------------------------


def pipeline_round(hub, tmp_path, name, executor, **changes):
    """Run the pipeline on an empty soup-org, return (leaderboard.json bytes, pushed files, work folder's merges),
    then delete what it pushed (the next round starts from the same Hub)."""
    folder = tmp_path / name
    folder.mkdir()
    report, out, _ = run(example(folder, **changes), executor=executor)
    board = (folder / "work" / "leaderboard" / "leaderboard.json").read_bytes()
    pushed = {rid: hub.files(rid) for rid in soup_repos(hub)}
    api = hub.api("alice")
    for rid in pushed:
        api.delete_repo(rid)
    if hub.exists("soup-org/leaderboard", repo_type="dataset"):
        api.delete_repo("soup-org/leaderboard", repo_type="dataset")
    merges = sorted(n for n in os.listdir(folder / "work" / "merges") if not n.endswith(".json"))
    return report.exit_code, board, pushed, merges, out


def assert_same_pipeline(first, second):
    (rc_a, board_a, pushed_a, _, out_a), (rc_b, board_b, pushed_b, _, out_b) = first, second
    assert rc_a == rc_b
    assert board_a == board_b, (out_a, out_b)  # the leaderboard, byte for byte
    assert sorted(pushed_a) == sorted(pushed_b)
    for rid in pushed_a:
        assert pushed_a[rid] == pushed_b[rid], rid  # every pushed file, the card included


@pytest.mark.slow
def test_pipeline_through_an_executor_gives_the_local_leaderboard_and_pushes(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-c")
    hub.login("alice")
    local = pipeline_round(hub, tmp_path, "local", None)
    far = pipeline_round(hub, tmp_path, "exec", LocalExecutor())
    assert_same_pipeline(local, far)
    board = json.loads(far[1])
    assert [r["status"] for r in board["merges"]].count("published") == 3
    assert len(local[3]) == 4 and len(far[3]) == 3  # only the merges it published were written to the work folder


@pytest.mark.slow
def test_pipeline_failures_through_an_executor_are_the_local_ones(hub, zoo, tmp_path):
    publish(hub, zoo, "base", "ft-a", "ft-b", "ft-broken")
    hub.login("alice")
    changes = dict(select=None, merges=[{"method": "ties", "params": {"density": 0.5}, "combine": "pairs"},
                                        {"method": "linear", "combine": "all"}])
    local = pipeline_round(hub, tmp_path, "local", None, **changes)
    far = pipeline_round(hub, tmp_path, "exec", LocalExecutor(), **changes)
    assert local[0] == 1 and "bob/ft-broken" in local[4]
    assert_same_pipeline(local, far)


def test_no_executor_named_is_the_local_one():
    """``executor=None`` is the default everywhere (``is_local``): make_executor makes the local executor of it, as it
    does of ``"local"`` (it used to hand None back, which an evolve run then called ``run`` on)."""
    from hubsoup.workflows.executors import make_executor

    for spec in (None, "local"):
        exe = make_executor(spec)
        try:
            assert isinstance(exe, LocalExecutor)
        finally:
            exe.close()
    mine = LocalExecutor()
    try:
        assert make_executor(mine) is mine  # an executor object: returned as it is
    finally:
        mine.close()


def test_a_refused_ray_join_names_the_servers_reason(monkeypatch):
    """Ray Client's refusal is "Initialization failure from server:" over the server's traceback: the error keeps the
    traceback's last line (the reason), not only the line that introduces it (what a failed CI run showed)."""
    import types

    from hubsoup.workflows import executors

    def init(address=None, **kwargs):
        raise ConnectionAbortedError("Initialization failure from server:\nTraceback (most recent call last):\n"
                                     "  File \"proxier.py\", line 777, in Datapath\nRuntimeError: Proxy failed to "
                                     "Connect to backend! Check `ray_client_server.err`")

    monkeypatch.setitem(__import__("sys").modules, "ray", types.SimpleNamespace(is_initialized=lambda: False, init=init))
    monkeypatch.setattr(executors, "check_ray_address", lambda address, where: None)  # as if its client server answered
    with pytest.raises(ParameterError) as e:
        executors.RayExecutor("ray://head:10001")
    assert str(e.value) == ("cannot join the Ray cluster at 'ray://head:10001': Initialization failure from server: "
                            "RuntimeError: Proxy failed to Connect to backend! Check `ray_client_server.err`")
