"""Hyper-parameter search: grid parsing and selection of a known best point."""

import os

import pytest
import torch

import hubsoup
from safetensors.torch import load_file

from hubsoup.errors import ParameterError
from hubsoup.workflows.search import merge_order, normalized_score, parse_grid, points, search


def test_parse_grid():
    assert parse_grid("scale=0.1:0.5:0.2") == {"scale": [0.1, 0.3, 0.5]}
    assert parse_grid("k=1,2", "scale=0:1:0.5") == {"k": ["1", "2"], "scale": [0.0, 0.5, 1.0]}
    assert parse_grid("scale", method="task_arithmetic")["scale"] == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    assert parse_grid("scale", method="ties")["scale"][-1] == 1.5
    with pytest.raises(ParameterError, match="no default grid"):
        parse_grid("density", method="linear")
    with pytest.raises(ParameterError, match="step must be positive"):
        parse_grid("scale=0:1:0")


def test_search_picks_known_best_point(llama, tmp_path):
    base, fts = llama
    b = load_file(os.path.join(base, "model.safetensors"))
    ft = load_file(os.path.join(fts[0], "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    target = b[name] + 0.4 * (ft[name] - b[name])

    def score(folder):  # closest to base + 0.4 τ wins
        got = load_file(os.path.join(folder, "model.safetensors"))[name]
        return -float((got - target).norm())

    out = tmp_path / "best"
    res = search(fts[:1], "task_arithmetic", base=base, out=str(out), grid=parse_grid("scale=0:1:0.2"),
                 score_fn=score, quiet=True)
    assert res.best == {"scale": 0.4}
    assert [round(s["params"]["scale"], 1) for s in res.scores] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert max(s["score"] for s in res.scores) == res.best_score
    got = load_file(str(out / "model.safetensors"))[name]
    torch.testing.assert_close(got, target, rtol=1e-5, atol=1e-6)
    assert res.result.search["best"] == {"scale": 0.4}
    assert sorted(os.listdir(tmp_path)) == ["best"]  # no scratch folders left


def test_normalized_selection_score():
    from hubsoup.eval import TaskResult, TaskSpec

    t1, t2 = TaskSpec.parse("classification:a.csv"), TaskSpec.parse("classification:b.csv")
    results = [TaskResult(t1, {"accuracy": 0.45}, 10), TaskResult(t2, {"accuracy": 0.8}, 10)]
    assert normalized_score(results, [0.9, 0.8]) == pytest.approx((0.5 + 1.0) / 2)
    assert normalized_score(results, None) == pytest.approx((0.45 + 0.8) / 2)


@pytest.fixture(scope="module")
def bert_task(tmp_path_factory):
    """A tiny BERT base with a tokenizer, two fine-tunes, a frozen head and a validation csv."""
    from safetensors.torch import save_file

    from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("searchbert")
    base = make_base("bert", str(root / "base"))
    save_tiny_tokenizer(base)
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i, scale=0.2) for i in (1, 2)]
    for ft in fts:
        save_tiny_tokenizer(ft)
    g = torch.Generator().manual_seed(5)
    head = str(root / "head.safetensors")
    save_file({"weight": torch.randn(2, 32, generator=g), "bias": torch.zeros(2)}, head)
    data = root / "val.csv"
    data.write_text("text,label\n" + "".join(f"w{i} w{(i * 7) % 50},{(i // 3) % 2}\n" for i in range(40)))
    return base, fts, f"classification:{data},head={head},name=toy,split=validation"


def test_cli_merge_with_eval_writes_results_and_model_index(bert_task, tmp_path, capsys):
    import json

    from huggingface_hub import ModelCard

    from hubsoup.cli import main

    base, fts, spec = bert_task
    out = tmp_path / "soup"
    assert main(["merge", *fts, "--base", base, "--method", "task_arithmetic", "--out", str(out), "-q",
                 "--eval", spec]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "eval_results.json").read_text())
    acc = results[0]["metrics"]["accuracy"]
    assert f"eval toy: accuracy={acc:.4f}" in printed
    card = ModelCard.load(str(out / "README.md"))
    entries = {(r.metric_type, r.dataset_name, r.dataset_split): r.metric_value for r in card.data.eval_results}
    assert entries[("accuracy", "toy", "validation")] == pytest.approx(acc)


def test_cli_search_records_grid_and_scores_in_card(bert_task, tmp_path, capsys):
    import json

    from hubsoup.cli import main

    base, fts, spec = bert_task
    out = tmp_path / "best"
    assert main(["merge", *fts, "--base", base, "--method", "task_arithmetic", "--out", str(out), "-q",
                 "--search", "scale=0:2:1", "--eval", spec]) == 0
    found = json.loads((out / "hubsoup_search.json").read_text())
    assert [p["params"]["scale"] for p in found["scores"]] == [0.0, 1.0, 2.0]
    best = max(found["scores"], key=lambda p: p["score"])
    assert found["best"] == best["params"]
    secs = found["seconds"]  # where the time went: each point's merge and scoring (and any references)
    assert "references" not in secs and len(secs["points"]) == 3  # one task, two inputs: no normalization
    assert all(p["merge"] > 0 and p["score"] > 0 for p in secs["points"])
    card = (out / "README.md").read_text()
    assert "## Hyper-parameter search" in card and f"| {best['params']['scale']} |" in card
    assert "seconds" not in card  # timings would make the card differ between runs
    recipe = (out / "hubsoup_recipe.yaml").read_text()
    assert f"scale: {best['params']['scale']}" in recipe
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    assert main(["merge", *fts, "--base", base, "--method", "ties", "--out", str(tmp_path / "x"),
                 "--search", "scale"]) == 2
    assert "--search needs validation tasks" in capsys.readouterr().err


def test_a_search_over_lambda_prepares_once_and_equals_separate_merges(llama, tmp_path, monkeypatch):
    """Points that differ only in λ share TIES' whole-model ranking (one set of statistics passes); each
    point's model is the separate merge's, bit for bit; a density grid ranks again per point."""
    from hubsoup.engine import shared
    from hubsoup.methods import _select

    base, fts = llama
    counted = []
    real = _select._HighPass.finish

    def finish(self, stats):
        counted.append(1)
        return real(self, stats)

    monkeypatch.setattr(_select._HighPass, "finish", finish)
    seen = {}

    def score(folder):
        seen[len(seen)] = load_file(os.path.join(folder, "model.safetensors"))
        return -len(seen)  # the first point wins

    search(fts, "ties", base=base, out=str(tmp_path / "s"), grid={"scale": [0.5, 1.0, 1.5]}, score_fn=score,
           quiet=True, density=0.3)
    assert len(counted) == 1 and len(seen) == 3
    assert shared.current() is None  # the sharing ends with the search
    for i, lam in enumerate((0.5, 1.0, 1.5)):
        ref = load_file(os.path.join(hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / f"r{i}"),
                                                   quiet=True, density=0.3, scale=lam).path, "model.safetensors"))
        assert all(torch.equal(seen[i][k], ref[k]) for k in ref)
    counted.clear()
    search(fts, "ties", base=base, out=str(tmp_path / "d"), grid={"density": [0.2, 0.4]}, score_fn=lambda f: 0.0,
           quiet=True)
    assert len(counted) == 2


def test_a_search_over_sftm_gamma_superposes_once_and_equals_separate_merges(llama, tmp_path, monkeypatch):
    """γ scales SFTM's merged matrices last: a γ search keeps each matrix's superposition from its first point
    (one set of SVDs for the whole grid), and every point is the separate merge, bit for bit."""
    base, fts = llama
    # the decompositions: SVDs, or on the CPU the float64 eigen-decompositions of the Gram matrices (numpy's)
    import numpy as np

    real_svd, real_eigh, real_np_eigh, svds = torch.linalg.svd, torch.linalg.eigh, np.linalg.eigh, []
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: svds.append(1) or real_svd(*a, **k))
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **k: svds.append(1) or real_eigh(*a, **k))
    monkeypatch.setattr(np.linalg, "eigh", lambda *a, **k: svds.append(1) or real_np_eigh(*a, **k))
    one = hubsoup.merge(fts, method="sftm", base=base, out=str(tmp_path / "one"), quiet=True)
    per_merge = len(svds)
    assert per_merge > 0
    svds.clear()
    seen = {}

    def score(folder):
        seen[len(seen)] = load_file(os.path.join(folder, "model.safetensors"))
        return -len(seen)

    search(fts, "sftm", base=base, out=str(tmp_path / "s"), grid={"gamma": [0.4, 0.6, 1.2]}, score_fn=score,
           quiet=True)
    assert len(svds) == per_merge and len(seen) == 3
    assert not any(".hubsoup-sftm" in n for _, _, files in os.walk(tmp_path) for n in files)
    assert not any(d.startswith(".hubsoup-sftm") for _, dirs, _ in os.walk(tmp_path) for d in dirs)
    ref = load_file(os.path.join(one.path, "model.safetensors"))  # γ = 0.6, the default
    assert all(torch.equal(seen[1][k], ref[k]) for k in ref)
    for i, gamma in ((0, 0.4), (2, 1.2)):
        ref = load_file(os.path.join(hubsoup.merge(fts, method="sftm", base=base, out=str(tmp_path / f"r{i}"),
                                                   quiet=True, gamma=gamma).path, "model.safetensors"))
        assert all(torch.equal(seen[i][k], ref[k]) for k in ref)
    svds.clear()
    search(fts, "sftm", base=base, out=str(tmp_path / "e"), grid={"eta": [0.2, 0.4]}, score_fn=lambda f: 0.0,
           quiet=True)
    assert len(svds) == 2 * per_merge  # η changes the trimmed matrices: superposed per point


def test_a_second_search_reuses_the_fine_tunes_scores_while_nothing_they_depend_on_changed(bert_task, tmp_path,
                                                                                         monkeypatch):
    import collections

    import hubsoup.eval
    from hubsoup.eval import TaskSpec
    from hubsoup.workflows import search as search_mod

    base, fts, spec = bert_task
    data = tmp_path / "val2.csv"  # a second task: one per input, so the selection is normalized
    data.write_text("text,label\n" + "".join(f"w{(i * 3) % 50} w{i},{i % 2}\n" for i in range(30)))
    tasks = [TaskSpec.parse(spec), TaskSpec.parse(spec.replace(spec.split(",")[0].split(":", 1)[1], str(data))
                                                  .replace("name=toy", "name=toy2"))]
    monkeypatch.setattr(search_mod, "_REFERENCES", collections.OrderedDict())
    scored = []
    real = search_mod.evaluate_model

    def counting(model, tasks_, **kw):
        if model in fts:
            scored.append((model, tasks_[0].name))
        return real(model, tasks_, **kw)

    monkeypatch.setattr(search_mod, "evaluate_model", counting)

    def run(name, grid):
        return search(fts, "task_arithmetic", base=base, out=str(tmp_path / name), grid={"scale": grid},
                      tasks=tasks, quiet=True)

    first = run("a", [0.5, 1.0])
    assert scored == [(fts[0], "toy"), (fts[1], "toy2")] and "references" in first.seconds
    scored.clear()
    second = run("b", [1.0, 1.5])
    assert scored == []  # the same pinned inputs and data: not scored again
    assert second.scores[0]["score"] == first.scores[1]["score"]  # the same point, the same normalized score
    os.utime(data, ns=(1, 1))  # the second task's data file changed (as far as its stamp says)
    run("c", [1.0])
    assert scored == [(fts[1], "toy2")]
    scored.clear()
    weights = os.path.join(fts[0], "model.safetensors")
    os.utime(weights, ns=(2, 2))  # the first fine-tune's folder changed
    run("d", [1.0])
    assert scored == [(fts[0], "toy")]


def test_a_block_with_a_scratch_folder_shares_with_the_merges_and_searches_inside_it(llama, tmp_path, monkeypatch):
    """A benchmark runs many merges and searches of the same inputs inside one block: a search nested in it
    shares with the merges before it (one TIES ranking for all of them), and each result is still its own
    merge's, bit for bit; the block's files go with it."""
    from hubsoup.engine import shared
    from hubsoup.methods import _select

    base, fts = llama
    counted = []
    real = _select._HighPass.finish
    monkeypatch.setattr(_select._HighPass, "finish", lambda self, stats: counted.append(1) or real(self, stats))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with shared.shared_statistics(scratch=str(scratch)) as block:
        hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / "a"), quiet=True, density=0.3)
        search(fts, "ties", base=base, out=str(tmp_path / "s"), grid={"scale": [0.5, 1.0]}, score_fn=lambda f: 0.0,
               quiet=True, density=0.3)
        assert shared.current() is block and len(counted) == 1  # the search's block was this one
    assert shared.current() is None and os.listdir(scratch) == []
    ref = load_file(os.path.join(hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / "r"), quiet=True,
                                               density=0.3, scale=0.5).path, "model.safetensors"))
    got = load_file(str(tmp_path / "s" / "model.safetensors"))  # the first point (scale 0.5) won
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert len(counted) == 2
    counted.clear()
    with shared.shared_statistics():  # no scratch folder: a search inside keeps its own block
        hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / "b"), quiet=True, density=0.3)
        search(fts, "ties", base=base, out=str(tmp_path / "t"), grid={"scale": [0.5]}, score_fn=lambda f: 0.0,
               quiet=True, density=0.3)
    assert len(counted) == 2


def test_a_search_merges_first_the_points_that_share_what_its_block_holds(llama, tmp_path, monkeypatch):
    """Inside a benchmark's block, an OPCM merge at α = 0.5 and then a search over α: the search merges its
    α = 0.5 point first (it reuses that merge's statistics pass), reports the points in grid order, and a tie
    still goes to the first grid point, whose output is its own merge bit for bit."""
    from hubsoup.engine import shared
    from hubsoup.methods import opcm

    base, fts = llama
    passes = []
    real = opcm._NormPass.finish
    monkeypatch.setattr(opcm._NormPass, "finish", lambda self, stats: passes.append(self.params.alpha)
                        or real(self, stats))
    visited = []

    def score(folder):
        visited.append(int(os.path.basename(folder).split("-")[1]))  # point-NNN: its grid index
        return 0.0  # a tie everywhere

    grid = {"alpha": [0.3, 0.5, 0.7]}
    assert merge_order(points(grid), "opcm") == [0, 1, 2]  # nothing held: the grid's order
    (tmp_path / "scratch").mkdir()
    with shared.shared_statistics(scratch=str(tmp_path / "scratch")):
        hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "a"), quiet=True, alpha=0.5)
        assert merge_order(points(grid), "opcm") == [1, 0, 2]
        found = search(fts, "opcm", base=base, out=str(tmp_path / "s"), grid=grid, score_fn=score, quiet=True)
    assert visited == [1, 0, 2] and passes == [0.5, 0.3, 0.7]  # no second pass at α = 0.5
    assert [s["params"]["alpha"] for s in found.scores] == [0.3, 0.5, 0.7]
    assert found.best == {"alpha": 0.3}
    ref = load_file(os.path.join(hubsoup.merge(fts, method="opcm", base=base, out=str(tmp_path / "r"), quiet=True,
                                               alpha=0.3).path, "model.safetensors"))
    got = load_file(str(tmp_path / "s" / "model.safetensors"))
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_a_lines_beta_search_prepares_once_and_equals_separate_merges(llama, tmp_path, monkeypatch):
    """β only sets LiNeS' depth factors: a β search over TIES runs the ranking and the Eq. 2 pass once, and
    every point is its own merge bit for bit."""
    from hubsoup.methods import _select, lines

    base, fts = llama
    counted = []
    for cls in (_select._HighPass, lines._HeuristicPass):
        real = cls.finish
        monkeypatch.setattr(cls, "finish", lambda self, stats, real=real, cls=cls: counted.append(cls.__name__)
                            or real(self, stats))
    seen = {}

    def score(folder):
        seen[len(seen)] = load_file(os.path.join(folder, "model.safetensors"))
        return float(len(seen))

    search(fts, "lines", base=base, out=str(tmp_path / "s"), grid={"beta": [0.2, 0.8]}, score_fn=score, quiet=True,
           base_method="ties")
    assert sorted(counted) == ["_HeuristicPass", "_HighPass"]
    for i, beta in enumerate((0.2, 0.8)):
        ref = load_file(os.path.join(hubsoup.merge(fts, method="lines", base=base, out=str(tmp_path / f"r{i}"),
                                                   quiet=True, base_method="ties", beta=beta).path,
                                     "model.safetensors"))
        assert all(torch.equal(seen[i][k], ref[k]) for k in ref)


def test_a_grid_with_no_point_is_refused_before_anything_is_written(tmp_path):
    """``grid={"scale": []}`` (the Python API; the CLI's parse_grid refuses it already): one line, not an
    AttributeError after the empty loop, and no output folder."""
    with pytest.raises(ParameterError, match="no point"):
        search([str(tmp_path / "a")], "task_arithmetic", base=str(tmp_path / "base"), out=str(tmp_path / "soup"),
               grid={"scale": []}, score_fn=lambda folder: 0.0, quiet=True)
    assert os.listdir(tmp_path) == []
