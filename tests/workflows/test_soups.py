"""Rewarded soups (+ LiNeS), preference sweeps, uniform / greedy soups and their LiNeS-paper variants."""

import json
import os

import pytest
import torch
from method_helpers import merge_one, state

import hubsoup
from hubsoup.cli import main
from hubsoup.errors import MethodError, OutputExistsError, ParameterError
from hubsoup.plan import BlockInfo, block_of
from hubsoup.workflows.soups import greedy_soup, uniform_soup
from hubsoup.workflows.sweep import parse_grid, simplex_grid, sweep
from hubsoup.testing import make_finetune


@pytest.fixture
def taus():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(9, 7, generator=g) for _ in range(3)]


# --- rewarded soups ----------------------------------------------------------------------------------------

def test_rewarded_soups_preference_one_zero_returns_the_first_policy(taus):
    for block in (None, BlockInfo("model.layers", 1, 2)):
        assert torch.equal(merge_one("rewarded_soups", taus[:2], block, lambdas="1,0"), taus[0])
        assert torch.equal(merge_one("rewarded_soups", taus[:2], block, lambdas="0,1"), taus[1])
    torch.testing.assert_close(merge_one("rewarded_soups", taus[:2], lambdas="0.3,0.7"), 0.3 * taus[0] + 0.7 * taus[1])
    torch.testing.assert_close(merge_one("rewarded_soups", taus), sum(taus) / 3)  # default: uniform


def test_rewarded_soups_with_lines_alpha_beta_one(taus):
    t = taus[:2]
    mix = 0.4 * t[0] + 0.6 * t[1]
    for b, lam in ((0, 1.0), (2, 1.5), (4, 2.0)):  # the deepest block's update is doubled
        out = merge_one("rewarded_soups", t, BlockInfo("model.layers", b, 5), lambdas="0.4,0.6", lines=True)
        torch.testing.assert_close(out, lam * mix)
    torch.testing.assert_close(merge_one("rewarded_soups", t, None, lambdas="0.4,0.6", lines=True), mix)
    # LiNeS off: the same everywhere
    torch.testing.assert_close(merge_one("rewarded_soups", t, BlockInfo("model.layers", 4, 5), lambdas="0.4,0.6"), mix)


def test_rewarded_soups_validates_the_simplex(taus):
    with pytest.raises(ParameterError, match="sum to 1"):
        merge_one("rewarded_soups", taus[:2], lambdas="0.5,0.6")
    with pytest.raises(ParameterError, match="out of range"):
        merge_one("rewarded_soups", taus[:2], lambdas="1.5,-0.5")
    with pytest.raises(MethodError, match="2 lambdas given for 3 inputs"):
        merge_one("rewarded_soups", taus, lambdas="0.5,0.5")


def test_rewarded_soups_end_to_end_and_card(llama, tmp_path):
    base, fts = llama
    res = hubsoup.merge(fts[:2], "rewarded_soups", base=base, out=str(tmp_path / "rs"), quiet=True, lambdas="1,0")
    merged, first = state(res.path), state(fts[0])
    for k in first:
        torch.testing.assert_close(merged[k], first[k], rtol=0, atol=1e-6)
    card = open(os.path.join(res.path, "README.md"), encoding="utf-8").read()
    assert "preference λ = (1, 0)" in card
    res = hubsoup.merge(fts[:2], "rewarded_soups", base=base, out=str(tmp_path / "rsl"), quiet=True,
                        lambdas="0.5,0.5", lines=True)
    merged, b = state(res.path), state(base)
    taus = [{k: v.float() - b[k].float() for k, v in state(f).items()} for f in fts[:2]]
    for k in b:
        hit = block_of(k)
        lam = 1.0 + hit[1] if hit else 1.0  # α = β = 1, 2 layers
        torch.testing.assert_close(merged[k].float(), b[k].float() + lam * 0.5 * (taus[0][k] + taus[1][k]),
                                   rtol=1e-5, atol=1e-6)
    assert "LiNeS depth scaling" in open(os.path.join(res.path, "README.md"), encoding="utf-8").read()


def _lora(folder, seed):
    """A peft LoRA 'policy' of the tiny Llama with random (non-zero) A and B."""
    from hubsoup.testing import make_adapter

    return make_adapter(folder, seed=seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


def test_rewarded_soups_of_lora_policies_match_their_dense_equivalents(model_dir, tmp_path):
    import transformers
    from peft import PeftModel

    base = model_dir("llama")
    policies = [_lora(tmp_path / f"policy{i}", seed=i) for i in (1, 2)]
    dense = []
    for i, p in enumerate(policies):
        model = PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), p)
        model.merge_and_unload().save_pretrained(str(tmp_path / f"dense{i}"))
        dense.append(str(tmp_path / f"dense{i}"))
    for params in ({"lambdas": "1,0"}, {"lambdas": "0.3,0.7", "lines": True}):
        a = hubsoup.merge(policies, "rewarded_soups", base=base, out=str(tmp_path / "a"), quiet=True, overwrite=True,
                          **params)
        b = hubsoup.merge(dense, "rewarded_soups", base=base, out=str(tmp_path / "b"), quiet=True, overwrite=True,
                          **params)
        assert [r.kind for r in a.inputs] == ["lora", "lora"]
        got, want = state(a.path), state(b.path)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
    first = state(dense[0])  # λ = (1, 0): the first policy, as peft merges it
    got = state(hubsoup.merge(policies, "rewarded_soups", base=base, out=str(tmp_path / "c"), quiet=True,
                              lambdas="1,0").path)
    for k in first:
        torch.testing.assert_close(got[k], first[k], rtol=1e-5, atol=1e-6)


# --- sweeps ------------------------------------------------------------------------------------------------

def test_grids():
    assert parse_grid("0:1:0.1") == [round(0.1 * i, 10) for i in range(11)]
    assert parse_grid("0.2, 0.5") == [0.2, 0.5]
    assert simplex_grid(2, parse_grid("0:1:0.5")) == [(0.0, 1.0), (0.5, 0.5), (1.0, 0.0)]
    three = simplex_grid(3, parse_grid("0:1:0.5"))
    assert len(three) == 6 and all(abs(sum(v) - 1) < 1e-12 and min(v) >= 0 for v in three)
    for bad in ("0:1", "1:0:0.1", "0:1:0.3", "0:1:-1", "a,b", ""):
        with pytest.raises(ParameterError):
            parse_grid(bad)
    with pytest.raises(ParameterError, match=r"\[0, 1\]"):
        simplex_grid(2, [0.0, 1.5])


def test_sweep_writes_one_model_per_preference(llama, tmp_path):
    base, fts = llama
    res = sweep(fts[:2], "rewarded_soups", str(tmp_path / "front"), "0:1:0.5", base=base, quiet=True, lines=True)
    names = sorted(os.listdir(res.path))
    assert names == [".hubsoup", "lambda-0.00-1.00", "lambda-0.50-0.50", "lambda-1.00-0.00", "sweep.json"]
    index = json.load(open(os.path.join(res.path, "sweep.json"), encoding="utf-8"))
    assert [p["value"] for p in index["points"]] == [[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]]
    assert [pt.result.params["lambdas"] for pt in res.points] == [[0.0, 1.0], [0.5, 0.5], [1.0, 0.0]]
    assert all(pt.result.params["lines"] is True for pt in res.points)
    # the (1, 0) end with LiNeS is θ_SFT + LiNeS(τ_1; 1, 1)
    merged, b, f = state(os.path.join(res.path, "lambda-1.00-0.00")), state(base), state(fts[0])
    k = "model.layers.1.mlp.down_proj.weight"
    torch.testing.assert_close(merged[k], b[k] + 2 * (f[k] - b[k]), rtol=1e-5, atol=1e-6)
    with pytest.raises(OutputExistsError):
        sweep(fts[:2], "rewarded_soups", str(tmp_path / "front"), "0:1:0.5", base=base, quiet=True)


def test_sweep_of_a_scalar_parameter_and_failure_leaves_nothing(llama, tmp_path):
    base, fts = llama
    res = sweep(fts, "lines", str(tmp_path / "betas"), "0,0.5", param="beta", base=base, quiet=True,
                params={"base_method": "linear"})
    assert sorted(os.listdir(res.path)) == [".hubsoup", "beta-0.00", "beta-0.50", "sweep.json"]  # marker: issue 44
    soup = uniform_soup(fts, base=base, out=str(tmp_path / "uniform"), quiet=True)
    got, want = state(os.path.join(res.path, "beta-0.00")), state(soup.path)  # β = 0: the vanilla soup
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(ParameterError, match="swept"):
        sweep(fts, "lines", str(tmp_path / "x"), "0,1", param="beta", base=base, params={"beta": 1})
    with pytest.raises(ParameterError):
        sweep(fts[:2], "rewarded_soups", str(tmp_path / "bad"), "0:1:0.5", base=base, quiet=True, lines="maybe")
    assert not os.path.exists(tmp_path / "bad")


def test_sweep_cli(llama, tmp_path, capsys):
    base, fts = llama
    out = str(tmp_path / "cli")
    rc = main(["sweep", *fts[:2], "--base", base, "--method", "rewarded_soups", "--sweep", "0:1:0.25",
               "--param", "lines=true", "--out", out, "--quiet"])
    assert rc == 0
    assert len([d for d in os.listdir(out) if d.startswith("lambda-")]) == 5
    assert "lambda-0.25-0.75" in os.listdir(out) and "5 model(s)" in capsys.readouterr().out
    assert main(["sweep", *fts[:2], "--base", base, "--method", "rewarded_soups", "--grid", "0:1:0.25",
                 "--out", out, "--quiet"]) == 2  # exists: a clear error, exit code 2


# --- model soups -------------------------------------------------------------------------------------------

@pytest.fixture
def ingredients(model_dir, tmp_path):
    """Llama fine-tunes: two close to each other, two far (larger noise)."""
    base = model_dir("llama")
    near = [model_dir("llama", f"ft{i}", scale=0.01) for i in (1, 2)]
    far = [make_finetune(base, str(tmp_path / f"far{i}"), seed=10 + i, scale=0.2) for i in (1, 2)]
    return base, near, far


def _distance_score(target):
    """Score = −‖θ − target‖² over float tensors (higher is better)."""
    calls = []

    def score(path):
        calls.append(path)
        s = state(path)
        return -sum(float((s[k].double() - v).square().sum()) for k, v in target.items())

    return score, calls


def test_greedy_soup_picks_the_expected_ingredients(ingredients, tmp_path):
    base, near, far = ingredients
    sd = [state(p) for p in near]
    # the target is 0.6·near0 + 0.4·near1: near0 scores best alone, the soup of the two is closer still,
    # and adding a far ingredient only moves the soup away
    target = {k: 0.6 * sd[0][k].double() + 0.4 * sd[1][k].double() for k in sd[0] if sd[0][k].dtype.is_floating_point}
    score, calls = _distance_score(target)
    inputs = [far[0], near[1], far[1], near[0]]
    res = greedy_soup(inputs, score, base=base, out=str(tmp_path / "greedy"))
    own = res.scores
    assert own[near[0]] > own[near[1]] > max(own[p] for p in far)
    assert res.ingredients == [near[0], near[1]]
    assert [h["ingredient"] for h in res.history] == sorted(inputs, key=lambda p: -own[p])
    assert [h["accepted"] for h in res.history] == [True, True, False, False]
    assert res.soup_score > own[near[0]]
    assert len(calls) == 4 + 3  # each ingredient from its own folder, then 3 candidate soups
    got = state(res.result.path)
    for k, v in target.items():  # the final soup is the plain mean of the chosen two
        torch.testing.assert_close(got[k].double(), (sd[0][k].double() + sd[1][k].double()) / 2, rtol=0, atol=1e-6)
    card = open(os.path.join(res.result.path, "README.md"), encoding="utf-8").read()
    assert "**Greedy soup.**" in card and "2 of 4 kept" in card
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".greedy-soup-")]  # candidates cleaned up


def test_greedy_soup_ties_accepted_with_ge_rejected_with_strict(ingredients, tmp_path):
    base, near, far = ingredients
    flat = lambda path: 1.0  # noqa: E731 - every soup scores the same
    ge = greedy_soup(near + far, flat, base=base, out=str(tmp_path / "ge"), individual_scores=[1, 1, 1, 1])
    assert ge.ingredients == near + far  # equal scores: input order, and every one is kept with >=
    strict = greedy_soup(near + far, flat, base=base, out=str(tmp_path / "gt"), strict=True,
                         individual_scores={p: 1.0 for p in near + far})
    assert strict.ingredients == near[:1]
    with pytest.raises(ParameterError, match="3 scores for 4"):
        greedy_soup(near + far, flat, base=base, out=str(tmp_path / "x"), individual_scores=[1, 1, 1])


def test_greedy_soup_then_lines_or_task_arithmetic_scale(ingredients, tmp_path):
    base, near, far = ingredients
    score = lambda path: -abs(float(state(path)["model.norm.weight"].float().mean()) - 1.0)  # noqa: E731
    vanilla = greedy_soup(near + far, score, base=base, out=str(tmp_path / "v"))
    lines0 = greedy_soup(near + far, score, base=base, out=str(tmp_path / "l0"), method="lines",
                         params={"base_method": "linear", "beta": 0.0})
    ta1 = greedy_soup(near + far, score, base=base, out=str(tmp_path / "t1"), method="soup", params={"scale": 1.0})
    assert vanilla.ingredients == lines0.ingredients == ta1.ingredients
    want = state(vanilla.result.path)
    for other in (lines0, ta1):  # α = 1, β = 0 and λ_ta = 1 are the vanilla soup
        got = state(other.result.path)
        assert all(torch.equal(got[k], want[k]) for k in want)
    deeper = greedy_soup(near + far, score, base=base, out=str(tmp_path / "l5"), method="lines",
                         params={"base_method": "linear", "beta": 0.5})
    got, b = state(deeper.result.path), state(base)
    k = "model.layers.1.mlp.up_proj.weight"  # the last of 2 blocks: factor α + β = 1.5
    torch.testing.assert_close(got[k] - b[k], 1.5 * (want[k] - b[k]), rtol=1e-4, atol=1e-6)


def test_uniform_soup_is_the_mean_of_the_models(ingredients, tmp_path):
    base, near, far = ingredients
    res = uniform_soup(near + far, base=base, out=str(tmp_path / "u"), quiet=True)
    got, sds = state(res.path), [state(p) for p in near + far]
    for k in got:
        torch.testing.assert_close(got[k], sum(s[k] for s in sds) / 4, rtol=1e-5, atol=1e-6)


def test_a_sweep_over_lambda_ranks_once(llama, tmp_path, monkeypatch):
    """A sweep of TIES' λ shares the whole-model ranking between its points (one statistics pass), and
    each point is the model its own merge makes."""
    from hubsoup.methods import _select

    base, fts = llama
    counted = []
    real = _select._HighPass.finish
    monkeypatch.setattr(_select._HighPass, "finish", lambda self, stats: (counted.append(1), real(self, stats))[1])
    res = sweep(fts, "ties", str(tmp_path / "lams"), "0.5,1.0", param="scale", base=base, quiet=True,
                params={"density": 0.3})
    assert len(counted) == 1
    for lam in ("0.50", "1.00"):
        one = hubsoup.merge(fts, method="ties", base=base, out=str(tmp_path / f"one-{lam}"), quiet=True,
                            density=0.3, scale=float(lam))
        got, want = state(os.path.join(res.path, f"scale-{lam}")), state(one.path)
        assert all(torch.equal(got[k], want[k]) for k in want)
