"""The methods' device paths, run on the CPU: the same results as the CPU's own paths, exactly.

On an accelerator TIES selects its thresholds and elects signs without reading a value back
(``kth_largest_abs_t``, ``_trim_on_device_``, a tensor majority); SLERP reads its block sums back once
per tensor. These functions are plain tensor code: on CPU tensors they must give the CPU paths' values.
(tests/engine/test_gpu.py runs them on CUDA.)
"""

from __future__ import annotations

import pytest
import torch

from hubsoup.methods._kernels import (_fill_ties_, elect_sign, high_half_counts, high_half_histogram, kth_largest_abs,
                                     kth_largest_abs_t, trim_)
from hubsoup.methods.ties import _trim_on_device_


def tricky(n: int, seed: int) -> torch.Tensor:
    """Random values with exact zeros and many equal magnitudes (ties at a threshold)."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    x[::7] = 0.0
    x[1::11] = 0.25
    x[2::13] = -0.25
    return x


@pytest.mark.parametrize("n", [5, 1000, 70_000, 300_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 4096])
@pytest.mark.parametrize("how", ["topk", "histogram"])
def test_device_radix_select_is_the_cpus(n, dtype, chunk, how, monkeypatch):
    monkeypatch.setattr("hubsoup.methods._kernels.DEVICE_SELECT", how)  # both selections: the same exact value
    if chunk is not None:  # keyed a chunk at a time: the same counts
        monkeypatch.setattr("hubsoup.methods._kernels.SELECT_CHUNK", chunk)
    x = tricky(n, n).to(dtype)
    for k in sorted({1, 2, max(1, n // 10), n // 2, n - 1, n}):
        t = kth_largest_abs_t(x, k)
        assert t.dtype == torch.float32 and t.dim() == 0
        assert float(t) == kth_largest_abs(x, k), (n, k)


@pytest.mark.parametrize("densities", [[0.2, 0.2, 0.2], [0.05, 0.5, 1.0], [0.0, 0.3, 0.9]])
def test_device_trim_is_the_cpus(densities):
    stack = torch.stack([tricky(50_000, s) for s in (1, 2, 3)])
    want = stack.clone()
    thresholds = []
    for d, density in zip(want, densities):
        k = max(1, int(density * d.numel())) if density > 0 else 0
        thresholds.append(0.0 if density >= 1.0 else kth_largest_abs(d, k))
    trim_(want, thresholds)
    got = stack.clone()
    _trim_on_device_(got, densities)
    assert torch.equal(got, want)


def test_a_tensor_majority_fills_ties_as_a_float_one():
    sign = torch.tensor([1.0, 0.0, -1.0, 0.0])
    for m in (1.0, -1.0):
        assert torch.equal(_fill_ties_(sign.clone(), torch.tensor(m)), _fill_ties_(sign.clone(), m))
    stack = torch.tensor([[1.0, -1.0, 0.0, 2.0], [-1.0, 1.0, -3.0, 0.0]])  # sums 0, 0, -3, 2: majority +1
    assert elect_sign(stack).tolist() == [1.0, 1.0, -1.0, 1.0]
    stack = torch.tensor([[1.0, -1.0, -2.0, 0.0], [-1.0, 1.0, -3.0, 0.0]])  # sums 0, 0, -5, 0: majority -1
    assert elect_sign(stack).tolist() == [-1.0, -1.0, -1.0, -1.0]


def test_device_histogram_is_bincounts(monkeypatch):
    """TIES scope=model's statistics pass counts the high halves on the device with index_add_."""
    monkeypatch.setattr("hubsoup.methods._kernels.SELECT_CHUNK", 1 << 14)
    for x in (tricky(100_000, 4), tricky(3000, 5).to(torch.bfloat16)):
        assert torch.equal(high_half_counts(x), high_half_histogram(x))


def test_block_sums_read_back_once_are_the_same():
    """Off the CPU, block_sums reads every block's sum back once (not per chunk): the same list."""
    from hubsoup.linalg import block_sums

    x, y = tricky(3 * 4096 * 5 + 123, 1), tricky(3 * 4096 * 5 + 123, 2)
    for kw in ({}, {"y": y}, {"absolute": True}):
        assert block_sums(x, chunk=3 * 4096, once=True, **kw) == block_sums(x, chunk=3 * 4096, once=False, **kw)


def test_dare_device_drop_reads_norms_back_once_with_the_cpus_values():
    """DARE (mergekit convention, rescale) on an accelerator drops every row, then reads all their L1 norms back
    in one go: the CPU's masks and exactly rounded norms (run here on CPU tensors)."""
    from hubsoup.methods import TensorContext, get_method
    from hubsoup.methods._sparsify import l1_norm
    from hubsoup.methods.dare import _drop_on_device, _mask

    params = get_method("dare").Params(p=0.7, then="ties", convention="mergekit", densities=[0.3, 0.5, 1.0])
    ctx = TensorContext("model.layers.0.mlp.up_proj.weight", None, 3, {}, "recipe")
    stack = torch.stack([tricky(30_000, s) for s in (1, 2, 3)]).reshape(3, 100, 300)
    dropped = stack.clone()
    norms = _drop_on_device(dropped, [0.3, 0.5, 1.0], params, ctx)
    for i, density in enumerate([0.3, 0.5]):
        want = stack[i].clone().masked_fill_(~_mask(stack[i], density, params, ctx, i), 0.0)
        assert torch.equal(dropped[i], want) and not torch.equal(want, stack[i])
        assert norms[i] == (l1_norm(stack[i]), l1_norm(want))
    assert norms[2] is None and torch.equal(dropped[2], stack[2])  # density 1: kept whole


@pytest.mark.parametrize("offset", [0, 12_345, 65_536 * 3, 2**31 - 70_000, 2**32 - 5_000])
@pytest.mark.parametrize("density", [0.0, 0.2, 0.5, 0.999, 1.0])
def test_dare_cpu_drop_is_the_device_mask_bit_for_bit(offset, density):
    """On the CPU DARE (mergekit convention) drops through counter_keep_ (no boolean mask); an accelerator fills the
    mask counter_mask draws there. The same entries dropped, to +0.0, the kept ones untouched (-0.0 included),
    across blocks of 2¹⁶, the sign bit of the index and 2³²."""
    from hubsoup.methods._sparsify import counter_keep_, counter_mask

    x = tricky(150_000, 9)
    x[3::17] = -0.0
    seed = 0x1234_5678_9ABC_DEF
    want = x.clone().masked_fill_(~counter_mask(x.numel(), density, seed, offset), 0.0)
    got = counter_keep_(x.clone(), density, seed, offset)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    rows = x.clone().reshape(3, -1)  # a row of a stack (a contiguous view): only that row changes
    counter_keep_(rows[1], density, seed, offset)
    row = x.reshape(3, -1)[1].clone().masked_fill_(~counter_mask(rows.shape[1], density, seed, offset), 0.0)
    assert torch.equal(rows[1].view(torch.int32), row.view(torch.int32))
    assert torch.equal(rows[0], x.reshape(3, -1)[0]) and torch.equal(rows[2], x.reshape(3, -1)[2])
