"""Hyper-parameter search: grid parsing and selection of a known best point."""

import os

import pytest
import torch
from safetensors.torch import load_file

from hubsoup.errors import ParameterError
from hubsoup.search import normalized_score, parse_grid, search


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
    assert res.result.stats["search"]["best"] == {"scale": 0.4}
    assert sorted(os.listdir(tmp_path)) == ["best"]  # no scratch folders left


def test_normalized_selection_score():
    from hubsoup.eval import TaskResult, TaskSpec

    t1, t2 = TaskSpec.parse("classification:a.csv"), TaskSpec.parse("classification:b.csv")
    results = [TaskResult(t1, {"accuracy": 0.45}, 10), TaskResult(t2, {"accuracy": 0.8}, 10)]
    assert normalized_score(results, [0.9, 0.8]) == pytest.approx((0.5 + 1.0) / 2)
    assert normalized_score(results, None) == pytest.approx((0.45 + 0.8) / 2)
