"""Read-ahead (hubsoup.engine.prefetch) and the compute shortcuts of issue 11.

The read-ahead only warms the page cache, so merges with it on and off must give the same
bytes (full fine-tunes, a LoRA input, a device map with several CPU workers); it must be
asked for block k + 1 while block k is streamed, read those bytes, and leave no thread
behind however the stream ends (normally, closed early, an exception, a cancel, a failing
worker). TIES' per-tensor threshold and the finite check are exact; they are compared with
the plain definitions on random tensors with ties, zeros and non-finite values.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import hubsoup
from hubsoup.engine import Job, TensorWork, prefetch, stream
from hubsoup.errors import MergeCancelled, NonFiniteTensorError
from hubsoup.methods._kernels import kth_largest_abs
from hubsoup.plan import Plan
from hubsoup.sources.compat import open_models
from hubsoup.sources.taskvector import all_finite
from hubsoup.testing import make_adapter, make_base, make_finetune

MAP = {"model.embed_tokens": "cpu:1", "model.layers.0": "cpu:2", "model.layers.1": "cpu:1", "": "cpu"}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefetch")
    base = make_base("llama", str(root / "base"), layers=4)
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]
    lora = make_adapter(root / "lora", "llama", seed=5, model_kw={"layers": 4}, r=4, lora_alpha=8,
                        target_modules=["q_proj", "v_proj"])
    return base, fts, lora


def readahead_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "hubsoup-readahead"]


def weights(folder: str) -> dict[str, bytes]:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            with open(os.path.join(folder, f), "rb") as fh:
                out[f] = fh.read()
    return out


@pytest.mark.parametrize("method,params,which,kw", [
    ("task_arithmetic", {}, "full", {}),
    ("ties", {"density": 0.3}, "full", {}),                       # statistics passes stream too
    ("ties", {"density": 0.3, "scope": "tensor"}, "full", {"device_map": MAP}),  # several workers
    ("task_arithmetic", {}, "lora", {}),                          # LoRA factors read ahead
    ("ties", {"density": 0.5}, "lora", {"device_map": MAP}),
])
def test_outputs_are_bit_identical_with_and_without_read_ahead(zoo, tmp_path, method, params, which, kw):
    base, fts, lora = zoo
    inputs = fts if which == "full" else [fts[0], lora]
    on = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "on"), params=params, quiet=True,
                       prefetch=True, **kw)
    off = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "off"), params=params, quiet=True,
                        prefetch=False, **kw)
    assert on.recipe.hash == off.recipe.hash  # read-ahead is not part of what a merge is
    assert weights(on.path) == weights(off.path)
    assert not readahead_threads()


def test_env_turns_read_ahead_off(monkeypatch):
    monkeypatch.setenv("HUBSOUP_PREFETCH", "0")
    assert not prefetch.enabled()
    assert prefetch.enabled(True)
    monkeypatch.setenv("HUBSOUP_PREFETCH", "1")
    assert prefetch.enabled() and not prefetch.enabled(False)


def open_job(base, inputs, **kw) -> Job:
    base_ckpt, sources = open_models(inputs, base=base)
    return Job(Plan.of(base_ckpt), base_ckpt, sources, quiet=True, **kw)


def test_next_block_is_requested_and_read_while_the_current_one_streams(zoo, monkeypatch):
    base, fts, lora = zoo
    job = open_job(base, [*fts, lora])
    fetched: list[tuple[int, list]] = []  # (index of the block being streamed, ranges read ahead)
    current = {"block": -1}
    real_fetch = prefetch.ReadAhead._fetch

    def spy(self, ranges, buf):
        real_fetch(self, ranges, buf)
        fetched.append((current["block"], ranges))

    monkeypatch.setattr(prefetch.ReadAhead, "_fetch", spy)
    requests: list[tuple[int, list]] = []
    real_request = prefetch.ReadAhead.request
    monkeypatch.setattr(prefetch.ReadAhead, "request",
                        lambda self, ranges: (requests.append((current["block"], prefetch.coalesce(ranges))),
                                              real_request(self, ranges))[1])
    blocks = job.plan.blocks
    for work in stream(job):
        i = blocks.index(work.block)
        if i != current["block"]:
            current["block"] = i
            time.sleep(0.05)  # "compute": the read-ahead thread gets to run
        work.base()
        work.deltas()
    assert not readahead_threads()
    assert len(blocks) > 3
    # request j is for block j + 1, made just before block j's first tensor is handed out (while block
    # j - 1 was the last one seen): one block ahead, never further
    assert [k for k, _ in requests] == list(range(-1, len(blocks) - 2))
    for j, (_, ranges) in enumerate(requests):
        nxt = blocks[j + 1]
        want = prefetch.coalesce(r for e in nxt.tensors for r in
                                 TensorWork(job, nxt, e).byte_ranges())
        assert ranges == want
        paths = {p for p, _, _ in ranges}
        assert any(p.startswith(base) for p in paths)  # the base's bytes
        assert all(any(p.startswith(ft) for p in paths) for ft in fts)  # every full fine-tune's
        if any(n.endswith(("q_proj.weight", "v_proj.weight")) for e in nxt.tensors for n in [e.name]):
            assert any(p.startswith(str(lora)) for p in paths)  # the LoRA factors
    assert fetched, "the read-ahead thread read nothing"
    # the ranges are where the tensors' bytes really are: reading them gives the tensor's bytes
    e = blocks[1].tensors[0]
    (path, off, n), = job.base.byte_ranges([e.name])
    with open(path, "rb") as f:
        f.seek(off)
        raw = f.read(n)
    assert raw == job.base.tensor(e.name).contiguous().view(torch.uint8).numpy().tobytes()


def test_no_thread_left_after_early_close_or_exception(zoo):
    base, fts, _ = zoo
    job = open_job(base, fts)
    it = stream(job)
    next(it)
    assert readahead_threads()  # block 1 was asked for
    it.close()  # a consumer that stops early
    assert not readahead_threads()

    with pytest.raises(RuntimeError, match="boom"):
        for n, work in enumerate(stream(job)):
            if n == 3:
                raise RuntimeError("boom")
    assert not readahead_threads()


def test_no_thread_left_after_cancel_or_failed_worker(zoo, tmp_path, monkeypatch):
    base, fts, _ = zoo
    seen = []

    def cancel():
        seen.append(1)
        return len(seen) > 12  # cancel in the middle of the merge pass

    with pytest.raises(MergeCancelled):
        hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "c"), quiet=True, cancel=cancel)
    assert not readahead_threads()

    from hubsoup.methods.task_arithmetic import TaskArithmetic

    calls = []

    def failing(self, base_t, deltas, params, ctx):
        calls.append(ctx.name)
        if "layers.1." in ctx.name:
            raise RuntimeError("worker failed")
        return deltas.sum(0)

    monkeypatch.setattr(TaskArithmetic, "merge", failing)
    monkeypatch.setattr(TaskArithmetic, "linear_coefficients", lambda self, *a, **k: None, raising=False)
    with pytest.raises(RuntimeError, match="worker failed"):
        hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "w"), quiet=True, device_map=MAP)
    assert calls
    assert not readahead_threads()
    assert not os.path.exists(tmp_path / "w")


def test_close_stops_a_long_read_and_requests_never_pile_up(tmp_path):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(1 << 20))
    started, release = threading.Event(), threading.Event()
    reads = []

    class Slow(prefetch.ReadAhead):
        def _fetch(self, ranges, buf):
            reads.append(ranges)
            started.set()
            release.wait(5)
            super()._fetch(ranges, buf)

    ahead = Slow(chunk=4096)
    ahead.request([(str(path), 0, 1 << 20)])
    assert started.wait(5)
    ahead.request([(str(path), 0, 10)])  # waits: at most one request queued
    ahead.request([(str(path), 20, 10)])  # replaces the stale one
    assert ahead._q.qsize() == 1
    release.set()
    ahead.close()
    assert not readahead_threads()
    assert len(reads) <= 2 and (len(reads) == 1 or reads[1] == [(str(path), 20, 10)])
    ahead.close()  # idempotent
    assert prefetch.coalesce([("a", 10, 5), ("a", 0, 10), ("b", 0, 1), ("a", 30, 0)]) == [("a", 0, 15), ("b", 0, 1)]


def _kthvalue_threshold(x: torch.Tensor, k: int) -> float:
    flat = x.abs().flatten()
    return float(torch.kthvalue(flat, flat.numel() - min(k, flat.numel()) + 1).values)


def test_ties_tensor_threshold_equals_kthvalue_with_ties_duplicates_and_zeros():
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        n = (1 << 16) + int(torch.randint(0, 50_000, (1,), generator=g))  # above the radix cut-off
        x = torch.randn(n, generator=g)
        if trial % 4 == 0:
            x = torch.round(x * 4) / 4  # many exact duplicates
        elif trial % 4 == 1:
            x[torch.rand(n, generator=g) < 0.7] = 0.0  # mostly zeros, -0.0 too
            x[:50] = -0.0
        elif trial % 4 == 2:
            x = x.bfloat16().float()  # bf16 grid: dense ties
        else:
            x = torch.full((n,), 0.5)  # all equal
        for k in (1, 2, n // 5, n // 2, n - 1, n, n + 3):
            assert kth_largest_abs(x, k) == _kthvalue_threshold(x, k), (trial, k)
    assert kth_largest_abs(torch.randn(1 << 16), 0) == float("inf")


def test_magnitude_histograms_from_int16_halves_equal_the_shifted_bits(monkeypatch):
    """The high-half histogram reads each float32's upper int16 half, the low one masks the int32 bits in
    place (sign dropped): the same counts as shifting and masking |x|'s bits, negatives and -0.0 included."""
    from hubsoup.methods import _kernels

    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 70_001, generator=g)
    x[0, :100] = -0.0
    x[1] = x[1].bfloat16().float()
    rows = list(x)
    fast_hi = [_kernels.high_half_histogram(r) for r in rows]
    b = [int(torch.nonzero(h).flatten()[len(torch.nonzero(h)) // 2]) for h in fast_hi]
    fast_lo = [_kernels.low_half_histogram(r, bi) for r, bi in zip(rows, b)]
    monkeypatch.setattr(_kernels, "_LITTLE", False)
    for r, h, lo, bi in zip(rows, fast_hi, fast_lo, b):
        bits = r.abs().view(torch.int32)
        assert torch.equal(h, torch.bincount(bits >> 16, minlength=1 << 15))
        assert torch.equal(h, _kernels.high_half_histogram(r))  # the portable path
        assert torch.equal(lo, torch.bincount(bits[(bits >> 16) == bi] & 0xFFFF, minlength=1 << 16))
        assert int(lo.sum()) == int(h[bi]) > 0


def test_ties_scope_tensor_merge_unchanged_by_the_radix_threshold(monkeypatch):
    from hubsoup.methods import _kernels
    from hubsoup.testing import merge_tensors

    g = torch.Generator().manual_seed(1)
    taus = torch.round(torch.randn(3, 300, 300, generator=g) * 8) / 8  # 90k entries, ties everywhere
    params = {"density": 0.2, "scope": "tensor"}
    fast = merge_tensors("ties", taus.clone(), **params)
    monkeypatch.setattr(_kernels, "_RADIX_MIN", 1 << 62)  # force the kthvalue path
    slow = merge_tensors("ties", taus.clone(), **params)
    assert torch.equal(fast, slow)


def test_all_finite_is_exact():
    big = torch.full((4,), 3e38)  # finite, but its float32 sum overflows: the exact check decides
    assert all_finite(big)
    assert all_finite(torch.full((100,), 6e4, dtype=torch.float16))
    assert all_finite(torch.full((100,), 3e38, dtype=torch.bfloat16))
    assert all_finite(torch.zeros(0))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            t = torch.randn(1000).to(dtype)
            t[517] = bad
            assert not all_finite(t), (bad, dtype)
    both = torch.tensor([float("inf"), -float("inf"), 1.0])  # inf - inf = NaN: still caught
    assert not all_finite(both)


def test_non_finite_input_still_refused(tmp_path, zoo):
    base, fts, _ = zoo
    from safetensors.torch import load_file, save_file
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(fts[0], bad)
    sd = load_file(str(bad / "model.safetensors"))
    name = next(k for k in sd if k.endswith("q_proj.weight") and ".1." in k)
    sd[name] = sd[name].clone()
    sd[name].view(-1)[3] = float("nan")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteTensorError, match="q_proj"):
        hubsoup.merge([str(bad), fts[1]], "task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True)
