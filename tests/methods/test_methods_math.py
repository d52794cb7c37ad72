"""Baseline methods on plain tensors: exact properties and cross-checks against peft."""

import pytest
import torch
from method_helpers import ctx
from peft.utils import merge_utils

from hubsoup.methods import get_method
from hubsoup.methods._kernels import disjoint_merge_, elect_sign, kth_largest_abs, trim_
from hubsoup.methods._select import KthLargestPass
from hubsoup.testing import merge_tensors


@pytest.fixture
def taus():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(16, 12, generator=g) for _ in range(3)]


def test_task_arithmetic_is_scaled_sum(taus):
    out = merge_tensors("task_arithmetic", taus, scale=0.7, weights="1,2,0.5")
    torch.testing.assert_close(out, 0.7 * (taus[0] + 2 * taus[1] + 0.5 * taus[2]))


def test_linear_is_weighted_mean(taus):
    out = merge_tensors("linear", taus, weights="1,1,2")
    torch.testing.assert_close(out, (taus[0] + taus[1] + 2 * taus[2]) / 4)


def test_ties_density_one_agreeing_signs_is_mean():
    g = torch.Generator().manual_seed(1)
    mag = [torch.rand(8, 8, generator=g) + 0.1 for _ in range(3)]
    sign = torch.where(torch.rand(8, 8, generator=g) > 0.5, 1.0, -1.0)
    taus = [m * sign for m in mag]
    for scope in ("tensor", "model"):
        out = merge_tensors("ties", taus, density=1.0, scope=scope, scale=1.0)
        torch.testing.assert_close(out, sum(taus) / 3)
        assert torch.equal(merge_tensors("ties", taus, density=1.0, merge="sum", scope=scope, scale=1.0), sum(taus))


def test_ties_single_input_full_density_returns_it(taus):
    torch.testing.assert_close(merge_tensors("ties", taus[:1], density=1.0, scope="tensor", scale=1.0), taus[0])


@pytest.mark.parametrize("density", [0.1, 0.2, 0.5, 0.9])
def test_ties_matches_peft(taus, density):
    ours = merge_tensors("ties", taus, density=density, scope="tensor", weights="1,0.5,2", scale=1.0)  # peft: no λ
    weights = torch.tensor([1.0, 0.5, 2.0])
    ref = merge_utils.ties(torch.stack(taus), weights, density, majority_sign_method="total")
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


def test_ties_trim_keeps_exactly_k(taus):
    t = taus[0].clone().unsqueeze(0)
    k = int(0.2 * t[0].numel())
    trim_(t, [kth_largest_abs(t[0], k)])
    assert int((t != 0).sum()) == k
    kept_min = t[t != 0].abs().min()
    dropped = taus[0][t[0] == 0].abs()
    assert float(dropped.max()) < float(kept_min)


def test_elect_sign_and_disjoint_mean_by_hand():
    stacked = torch.tensor([[1.0, -2.0, 0.0, 3.0], [2.0, 1.0, 0.0, -3.0], [-4.0, 0.5, 0.0, 1.0]])
    sign = elect_sign(stacked.clone())
    # sums: -1, -0.5, 0, 1 -> signs -1, -1, majority, +1 ; majority = sign(-1-1+1) = -1
    assert sign.tolist() == [-1.0, -1.0, -1.0, 1.0]
    out = disjoint_merge_(stacked.clone(), sign)
    assert out.tolist() == [-4.0, -2.0, 0.0, 2.0]


def test_trim_keeps_entries_at_the_threshold_and_drops_just_below():
    # the fused float32 trim (hardshrink just below t) must be exactly |x| >= t, ties and denormals included
    t = 0.5
    below = float(torch.nextafter(torch.tensor(t), torch.tensor(0.0)))
    tiny = float(torch.finfo(torch.float32).smallest_normal) / 4  # a denormal
    row = torch.tensor([t, -t, below, -below, 0.75, -0.0, tiny, float("inf"), float("nan")])
    out = trim_(row.clone().unsqueeze(0), [t])[0]
    ref = row.masked_fill(row.abs() < t, 0.0)
    assert torch.equal(out.nan_to_num(7.0), ref.nan_to_num(7.0))
    assert trim_(torch.tensor([[tiny, 0.0, -tiny]]), [tiny])[0].tolist() == [tiny, 0.0, -tiny]


@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_disjoint_merge_in_column_blocks_equals_whole_rows(mode):
    # larger than one block, with a ragged last block: the blocked merge must equal the plain formula
    g = torch.Generator().manual_seed(5)
    stacked = torch.randn(3, 700, 517, generator=g)
    stacked[stacked.abs() < 0.8] = 0.0  # trimmed rows: zeros, lone entries and sign conflicts
    sign = elect_sign(stacked.clone())
    agree = (stacked * sign) > 0
    total = (stacked * agree).sum(0)
    ref = total if mode == "sum" else total / agree.sum(0).clamp(min=1)
    out = disjoint_merge_(stacked.clone(), sign, mode)
    assert out.shape == (700, 517)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@pytest.mark.parametrize("buffer", [1 << 22, 700, 3])  # smaller: the held low halves counted as they fill
def test_global_threshold_radix_select_is_exact(monkeypatch, buffer):
    from hubsoup.methods import _select

    monkeypatch.setattr(_select._LowPass, "BUFFER", buffer)
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(2, n, generator=g) * s for n, s in ((50, 1.0), (200, 0.01), (7, 30.0), (1000, 0.3))]
    tensors.append(torch.full((2, 300), -0.125))  # one bin, duplicates
    for density in (0.0, 0.013, 0.2, 0.77, 1.0):
        sel = KthLargestPass("t", 2, density)
        stats = {}
        for p in sel.passes():
            for i, t in enumerate(tensors):
                p.update(ctx(f"t{i}", n=2, stats=stats), torch.zeros_like(t[0]), t)
            p.finish(stats)
        for task in range(2):
            flat = torch.cat([t[task].flatten() for t in tensors])
            k = int(density * flat.numel())
            assert stats["t"][task] == kth_largest_abs(flat, k)
            if k:
                assert int((flat.abs() >= stats["t"][task]).sum()) == k


def test_dare_p0_is_task_arithmetic(taus):
    torch.testing.assert_close(merge_tensors("dare", taus, p=0.0, scale=0.5), 0.5 * sum(taus))


def test_dare_matches_peft_random_pruning(taus):
    """Same Bernoulli stream => same masks as peft's dare_linear / dare_ties."""
    m = get_method("dare")
    c = ctx(n=3)
    for then, ref_fn in (("sum", merge_utils.dare_linear), ("ties", merge_utils.dare_ties)):
        p = m.parse({"p": 0.6, "then": then, "scale": 1.0})  # peft's λ = 1
        ours = m.merge(torch.zeros(16, 12), torch.stack(taus).clone(), p, c)
        # reproduce our per-input generators as peft's global RNG, one input at a time
        pruned = []
        for i, t in enumerate(taus):
            torch.manual_seed(c.generator(f"dare:0:{i}").initial_seed())
            pruned.append(merge_utils.random_pruning(t, density=0.4, rescale=True))
        if then == "sum":
            ref = merge_utils.task_arithmetic(pruned, torch.ones(3))
        else:
            st = torch.stack(pruned)
            ref = merge_utils.disjoint_merge(st, merge_utils.calculate_majority_sign_mask(st, "total"))
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
        assert ref_fn is not None


def test_dare_drops_about_p_and_is_seeded(taus):
    big = [torch.ones(200, 100)]
    a = merge_tensors("dare", big, p=0.7, scale=1.0)
    b = merge_tensors("dare", big, p=0.7, scale=1.0)
    assert torch.equal(a, b)
    frac_dropped = float((a == 0).float().mean())
    assert abs(frac_dropped - 0.7) < 0.02
    torch.testing.assert_close(a[a != 0], torch.full_like(a[a != 0], 1 / 0.3))
    c = merge_tensors("dare", big, p=0.7, seed=1, scale=1.0)
    assert not torch.equal(a, c)


def test_consensus_k0_is_task_arithmetic_and_k_above_n_is_zero(taus):
    torch.testing.assert_close(merge_tensors("consensus", taus, k=0, scale=0.4), 0.4 * sum(taus))
    assert torch.count_nonzero(merge_tensors("consensus", taus, k=4)) == 0


def test_consensus_tall_mask_by_hand():
    # τ1 = [1, 0.1], τ2 = [0.1, 1], λ = 0.5 : m1 = [1>=0.05, 0.1>=0.5] = [1,0]; m2 = [0,1]
    taus = [torch.tensor([1.0, 0.1]), torch.tensor([0.1, 1.0])]
    assert merge_tensors("consensus", taus, k=1, lambdas="0.5", scale=1.0).tolist() == pytest.approx([1.1, 1.1])
    assert merge_tensors("consensus", taus, k=2, lambdas="0.5", scale=1.0).tolist() == [0.0, 0.0]
    # a single task's TALL mask (≥ form) is all ones: |τ| ≥ λ·0
    assert torch.equal(merge_tensors("consensus", taus[:1], k=1, scale=1.0), taus[0])


def test_wise_ft_and_slerp_endpoints(taus):
    base = torch.randn(16, 12)
    torch.testing.assert_close(merge_tensors("wise_ft", taus[:1], gamma=0.25), 0.25 * taus[0])
    for t, want in ((0.0, taus[0]), (1.0, taus[1])):
        torch.testing.assert_close(merge_tensors("slerp", taus[:2], base=base, t=t), want, atol=1e-5, rtol=1e-5)
    mid = merge_tensors("slerp", taus[:2], base=base, t=0.5) + base
    a, b = base + taus[0], base + taus[1]
    # slerp keeps the norm between the endpoints' (lerp would shrink it)
    assert float(mid.norm()) >= min(float(a.norm()), float(b.norm())) - 1e-4


def test_slerp_blockwise_float64_reductions_match_the_formula():
    # more elements than one float64 block, so the cosine is summed over several blocks
    from hubsoup.methods.slerp import slerp

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 1 << 20, generator=g), torch.randn(3, 1 << 20, generator=g)
    b = 0.6 * a + 0.4 * b  # a clear angle, far from the linear fallback
    a64, b64 = a.double().flatten(), b.double().flatten()
    omega = torch.arccos((a64 / a64.norm()) @ (b64 / b64.norm()))
    want = (torch.sin(0.3 * omega) * a64 + torch.sin(0.7 * omega) * b64) / torch.sin(omega)
    got = slerp(a, b, 0.7)
    assert got.dtype == torch.float32 and got.shape == a.shape
    torch.testing.assert_close(got.double().flatten(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(slerp(a, a.clone(), 0.3), torch.lerp(a, a, 0.3))  # parallel: the linear fallback


def test_one_topk_trim_with_named_tie_rules():
    """The one top-k trim (TIES, mergekit's magnitude pruning, SFTM, SCE): the tie rule decides which of the entries
    tying at the k-th largest magnitude stay; the in-place form keeps exactly the mask's entries."""
    from hubsoup.methods._kernels import keep_topk_, topk_mask

    x = torch.tensor([0.5, -2.0, 0.5, 3.0, -0.5, 0.5, 0.25, 0.5] * 8)  # k = 20 cuts through 40 tied 0.5s
    k = 20
    keep_all = topk_mask(x, k, ties="keep_ties")
    assert int(keep_all.sum()) == 8 + 8 + 40  # 3s, 2s and every tied 0.5
    first = topk_mask(x, k, ties="first_index")
    assert int(first.sum()) == k
    tied = torch.nonzero((x.abs() == 0.5) & first).flatten()
    assert torch.equal(tied, torch.nonzero(x.abs() == 0.5).flatten()[:4])  # 16 above the cut, then the 4 first ties
    sort = topk_mask(x, k, ties="mergekit_sort")
    want = torch.zeros(x.numel(), dtype=torch.bool)
    want[torch.argsort(x.abs(), descending=True)[:k]] = True
    assert torch.equal(sort, want)
    for t in (x, x.to(torch.bfloat16)):  # SCE's: as torch.topk picks among ties, in the tensor's own dtype
        want = torch.zeros(x.numel(), dtype=torch.bool)
        want[torch.topk(t.abs(), k).indices] = True
        assert torch.equal(topk_mask(t, k, ties="mergekit_topk"), want) and int(want.sum()) == k
    for rule in ("keep_ties", "first_index", "mergekit_sort", "mergekit_topk"):
        mask = topk_mask(x, k, ties=rule)
        assert torch.equal(keep_topk_(x.clone(), k, ties=rule), x.masked_fill(~mask, 0.0)), rule
        assert topk_mask(x, 0, ties=rule).sum() == 0 and bool(topk_mask(x, x.numel(), ties=rule).all())
    assert torch.equal(topk_mask(x, ties="keep_ties", threshold=0.5), keep_all)
    with pytest.raises(ValueError, match="keep_ties"):
        topk_mask(x, ties="first_index", threshold=0.5)
