"""LwPTV: exact properties of lwptv.md §6, composition with TA / TIES / consensus / LiNeS, card."""

import os

import pytest
import torch
from method_helpers import ctx, merge_all, merge_one, run_stats, state

import hubsoup
from hubsoup.errors import MethodError, ParameterError
from hubsoup.methods import get_method
from hubsoup.methods._kernels import kth_largest_abs
from hubsoup.methods.lwptv import layer_masks
from hubsoup.plan import BlockInfo


def model_tensors(k=3, layers=10, seed=0, scales=None):
    """{name: (block, [τ_1..τ_K])}: tensors of different sizes and per-layer spread."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        shape = (4 + i, 6) if i % 3 else (7,)
        spread = scales[i] if scales else 0.1 * (i + 1)
        common = torch.randn(shape, generator=g)
        block = BlockInfo("model.layers", i // 2, layers // 2) if i < layers - 1 else None
        out[f"model.layers.{i // 2}.t{i}" if block else "norm.weight"] = (
            block, [common + spread * torch.randn(shape, generator=g) for _ in range(k)])
    return out


def scores(tensors, **params):
    _, _, stats = run_stats("lwptv", tensors, **params)
    return stats


# --- the masks ---------------------------------------------------------------------------------------------

def test_each_task_keeps_exactly_l_minus_floor_eta_l_distinct_scores():
    g = torch.Generator().manual_seed(3)
    s = [torch.rand(20, generator=g).tolist() for _ in range(4)]
    for eta in (0.0, 0.1, 0.35, 0.7, 0.99, 1.0):
        masks = layer_masks(s, eta)
        q = int(eta * 20 + 1e-9)
        assert all(sum(m) == 20 - q for m in masks), eta
        union = [any(col) for col in zip(*masks)]
        assert all(u or not m for mask in masks for u, m in zip(union, mask))  # m̂ ⊇ m_k
        assert sum(union) >= max(sum(m) for m in masks)
        literal = layer_masks(s, eta, literal=True)
        assert all(sum(m) == max(20 - q - 1, 0) for m in literal), eta  # the 0-based Eq. 6 drops one more
    assert all(all(m) for m in layer_masks(s, 0.0))  # η = 0 prunes nothing ...
    assert not any(all(m) for m in layer_masks(s, 0.0, literal=True))  # ... unless Eq. 6 is read literally
    assert not any(any(m) for m in layer_masks(s, 1.0))  # η = 1 prunes everything


def test_hand_example_scores():
    tensors = {"a": (None, [torch.tensor([1.0, -1.0]), torch.tensor([3.0, 1.0])]),
               "b": (None, [torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])])}
    stats = scores(tensors, eta=0.5)
    assert stats["lwptv.scores"]["a"] == [1.0, 1.0]  # τ̄ = [2, 0]: |1-2|+|-1-0| over 2 = 1, same for task 2
    assert stats["lwptv.scores"]["b"] == [0.5, 0.5]
    assert stats["lwptv.keep"] == {"a": True, "b": False}
    assert stats["lwptv.pruned"] == ["b"]


def test_two_tasks_have_equal_scores_and_masks():
    stats = scores(model_tensors(k=2), eta=0.5, combine="per_task")
    for s1, s2 in stats["lwptv.scores"].values():
        assert s1 == pytest.approx(s2, rel=1e-12)
    for name, (m1, m2) in stats["lwptv.keep_tasks"].items():
        assert m1 == m2 == stats["lwptv.keep"][name]


def test_scores_invariances():
    tensors = model_tensors(k=3)
    base = scores(tensors, eta=0.6)
    shift = {n: (b, [t + ts[0] * 0.5 + 3.0 for t in ts]) for n, (b, ts) in tensors.items()}
    shifted = scores(shift, eta=0.6)
    scaled = scores({n: (b, [-2.5 * t for t in ts]) for n, (b, ts) in tensors.items()}, eta=0.6)
    permuted = scores({n: (b, ts[::-1]) for n, (b, ts) in tensors.items()}, eta=0.6)
    for name, s in base["lwptv.scores"].items():
        assert shifted["lwptv.scores"][name] == pytest.approx(s, rel=1e-5)  # same tensor added to every τ_k
        assert scaled["lwptv.scores"][name] == pytest.approx([2.5 * x for x in s], rel=1e-5)
        assert permuted["lwptv.scores"][name] == pytest.approx(s[::-1], rel=1e-12)
    assert shifted["lwptv.keep"] == scaled["lwptv.keep"] == permuted["lwptv.keep"] == base["lwptv.keep"]
    assert 0 < base["lwptv.kept_layers"] < len(tensors)


def test_identical_layer_scores_zero_and_is_pruned_by_every_task():
    tensors = model_tensors(k=3)
    same = torch.randn(5, 5)
    tensors["model.layers.0.same"] = (BlockInfo("model.layers", 0, 5), [same.clone() for _ in range(3)])
    stats = scores(tensors, eta=0.1, combine="per_task")  # q = 1
    assert stats["lwptv.scores"]["model.layers.0.same"] == [0.0, 0.0, 0.0]
    assert stats["lwptv.keep_tasks"]["model.layers.0.same"] == [False] * 3
    assert stats["lwptv.pruned"] == ["model.layers.0.same"]


def test_zero_layers_count_or_excluded():
    tensors = model_tensors(k=3)
    tensors["frozen"] = (None, [torch.zeros(4) for _ in range(3)])
    counted = scores(tensors, eta=0.1)
    assert counted["lwptv.layers"] == 11 and counted["lwptv.pruned"] == ["frozen"]  # it used up the budget
    excluded = scores(tensors, eta=0.1, zero_layers="exclude")
    assert excluded["lwptv.layers"] == 10 and "frozen" not in excluded["lwptv.pruned"]
    assert len(excluded["lwptv.pruned"]) == 1


def test_block_unit_groups_a_blocks_tensors():
    stats = scores(model_tensors(k=3), eta=0.5, unit="block")
    assert set(stats["lwptv.keep"]) == {f"model.layers.{b}" for b in range(5)} | {"norm.weight"}
    pruned_blocks = {n.rsplit(".", 1)[0] for n in stats["lwptv.pruned"] if n.startswith("model.layers")}
    for b in pruned_blocks:  # a pruned block loses all its tensors
        assert all(n in stats["lwptv.pruned"] for n in model_tensors(k=3) if n.startswith(b + "."))


# --- the merge ---------------------------------------------------------------------------------------------

def test_eta_zero_equals_the_base_method_bit_for_bit():
    tensors = model_tensors(k=3)
    for base_method, extra in (("task_arithmetic", {}), ("ties", {"density": 0.3}), ("consensus", {"k": 2})):
        ours, stats = merge_all("lwptv", tensors, eta=0.0, base_method=base_method, **extra)
        ref, _ = merge_all(base_method, tensors, **extra)
        assert stats["lwptv.pruned"] == []
        for name in tensors:
            assert torch.equal(ours[name], ref[name]), (base_method, name)


def test_everything_pruned_returns_the_base():
    ours, stats = merge_all("lwptv", model_tensors(k=3), eta=1.0)
    assert len(stats["lwptv.pruned"]) == len(ours)
    assert all(not t.any() for t in ours.values())


def test_pruned_layers_revert_kept_layers_equal_task_arithmetic():
    tensors = model_tensors(k=4)
    ours, stats = merge_all("lwptv", tensors, eta=0.7, scale=0.3)
    ref, _ = merge_all("task_arithmetic", tensors, scale=0.3)
    pruned = set(stats["lwptv.pruned"])
    assert 0 < len(pruned) < len(tensors)
    for name in tensors:
        if name in pruned:
            assert not ours[name].any()
        else:
            assert torch.equal(ours[name], ref[name])


def test_ties_runs_on_the_masked_vectors():
    tensors = model_tensors(k=3)  # the paper's TIES setting (disjoint sum at λ = 0.3), given as parameters
    ours, stats = merge_all("lwptv", tensors, base_method="ties", eta=0.5, density=0.2, merge="sum", scale=0.3)
    keep = stats["lwptv.keep"]
    masked = {n: [t if keep[n] else torch.zeros_like(t) for t in ts] for n, (_, ts) in tensors.items()}
    # the global top-20% counts the pruned layers' zeros
    flat = [torch.cat([ts[i].flatten() for ts in masked.values()]) for i in range(3)]
    thresholds = [kth_largest_abs(f, int(0.2 * f.numel())) for f in flat]
    assert stats["ties.threshold"] == thresholds
    for name, (block, _) in tensors.items():
        ref = merge_one("ties", masked[name], block, stats={"ties.threshold": thresholds},
                        density=0.2, merge="sum", scale=0.3)
        assert torch.equal(ours[name], ref), name
    # without them TIES runs at its own defaults
    p = get_method("lwptv").parse({"base_method": "ties"})
    assert (p.inner_params.merge, p.inner_params.scale) == ("mean", None)  # None: λ = 0.7 (convention=paper)


def test_per_task_combine_masks_each_task_vector():
    tensors = model_tensors(k=3, scales=[0.5] * 10)  # equal spreads: the tasks rank the layers differently
    ours, stats = merge_all("lwptv", tensors, eta=0.5, combine="per_task", scale=1.0)
    assert any(0 < sum(m) < 3 for m in stats["lwptv.keep_tasks"].values())  # the masks differ somewhere
    for name, (_, ts) in tensors.items():
        expected = sum(t * float(k) for t, k in zip(ts, stats["lwptv.keep_tasks"][name]))
        torch.testing.assert_close(ours[name], expected)


def test_composes_with_lines_both_ways():
    tensors = model_tensors(k=3)
    stats = scores(tensors, eta=0.5)
    keep = stats["lwptv.keep"]
    # lwptv over lines: masks from the raw τ, LiNeS on the masked vectors
    ours, st = merge_all("lwptv", tensors, eta=0.5, base_method="lines+task_arithmetic", alpha=0.2, beta=0.6)
    for name, (block, ts) in tensors.items():
        lam = 0.2 + 0.6 * block.depth if block else 0.2
        if keep[name]:
            torch.testing.assert_close(ours[name], lam * sum(ts))
        else:
            assert not ours[name].any()
    # lines over lwptv: the same when α is given (LiNeS sets the inner scale to 1 through the chain too);
    # the heuristic α sees the masked τ_MTL
    ours2, _ = merge_all("lines", tensors, base_method="lwptv+task_arithmetic", eta=0.5, alpha=0.2, beta=0.6)
    for name in tensors:
        torch.testing.assert_close(ours2[name], ours[name])
    _, st3 = merge_all("lines", tensors, base_method="lwptv", eta=0.5)
    assert st3["lines.alpha"] > 1 / 3  # ‖τ_MTL‖ lost the pruned layers
    # lwptv over consensus
    ours4, _ = merge_all("lwptv", tensors, eta=0.5, base_method="consensus", k=2)
    ref4, _ = merge_all("consensus", tensors, k=2)
    for name in tensors:
        assert torch.equal(ours4[name], ref4[name]) if keep[name] else not ours4[name].any()


def test_base_method_defaults_through_a_chain():
    def ties_of(method, **given):
        p = get_method(method).parse(given)
        while hasattr(p, "inner_params"):
            p = p.inner_params
        return p.merge, p.scale

    assert ties_of("lwptv", base_method="ties") == ("mean", None)  # TIES' own defaults (λ resolves to 0.7)
    assert ties_of("lwptv", base_method="lines+ties") == ("mean", 1.0)  # LiNeS's β replaces λ
    assert ties_of("lines", base_method="lwptv+ties") == ("mean", 1.0)
    assert ties_of("lwptv", base_method="ties", merge="sum", scale=0.3) == ("sum", 0.3)  # the paper's setting
    assert ties_of("lines", base_method="ties") == ("mean", 1.0)  # LiNeS's β replaces λ
    assert ties_of("lwptv", base_method="lines+ties", scale=0.5, merge="mean") == ("mean", 0.5)  # the user's win


def test_input_and_parameter_checks():
    with pytest.raises(MethodError, match="at least 2"):
        run_stats("lwptv", {"a": (None, [torch.ones(3)])})
    with pytest.raises(ParameterError, match="eta"):
        get_method("lwptv").parse({"eta": 1.5})
    with pytest.raises(ParameterError, match="belongs to none of 'lwptv', 'task_arithmetic'"):
        get_method("lwptv").parse({"density": 0.2})


# --- end to end --------------------------------------------------------------------------------------------

def test_end_to_end_pruned_tensors_are_the_base_bit_for_bit(model_dir, tmp_path):
    base = model_dir("bert")
    fts = [model_dir("bert", f"ft{i}") for i in (1, 2, 3)]
    res = hubsoup.merge(fts, "lwptv", base=base, out=str(tmp_path / "lw"), quiet=True, eta=0.7)
    ta = hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "ta"), quiet=True)
    merged, ref, b = state(res.path), state(ta.path), state(base)
    pruned = set(res.stats["lwptv.pruned"])
    floats = [k for k in b if b[k].dtype.is_floating_point]
    assert 0 < len(pruned) < len(floats)
    for k in b:
        if k in pruned or not b[k].dtype.is_floating_point:
            assert torch.equal(merged[k], b[k]), k
        else:
            assert torch.equal(merged[k], ref[k]), k
    card = open(os.path.join(res.path, "README.md"), encoding="utf-8").read()
    assert "LwPTV layer mask" in card and f"{len(pruned)} tensor(s) were reverted" in card
    assert all(f"- `{k}`" in card for k in pruned)
    assert "default: ours (the paper is silent)" in card  # the choices where the paper is silent are marked


def test_end_to_end_eta_zero_equals_task_arithmetic_file_for_file(model_dir, tmp_path):
    base = model_dir("gpt2")
    fts = [model_dir("gpt2", f"ft{i}") for i in (1, 2)]
    res = hubsoup.merge(fts, "lwptv", base=base, out=str(tmp_path / "lw"), quiet=True, eta=0.0)
    ta = hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "ta"), quiet=True)
    merged, ref = state(res.path), state(ta.path)
    assert merged.keys() == ref.keys() and all(torch.equal(merged[k], ref[k]) for k in ref)
