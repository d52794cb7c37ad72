"""Every method family on a CUDA device gives the CPU's result (≤ 1e-5 relative), through the one engine.

Marked ``gpu``: skipped, with the reason, where CUDA is absent (CI's machines have no GPU).
Run on a GPU machine with ``python -m pytest -q -m gpu tests/engine/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from method_helpers import state as weights  # noqa: E402  (tests/ is on sys.path)

import hubsoup
from hubsoup import continual
from hubsoup.testing import make_base, make_finetune

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")]

FAMILIES = [  # (method, params): element-wise, statistics passes, random, SVD, modifiers, interpolation
    ("task_arithmetic", {"scale": 0.5}),
    ("ties", {"density": 0.3}),
    ("ties", {"density": 0.3, "scope": "tensor"}),
    ("dare", {"p": 0.5, "then": "ties"}),                       # paper: peft's CPU stream, copied over
    ("dare", {"p": 0.5, "then": "ties", "convention": "mergekit"}),  # counter masks drawn on the device
    ("consensus", {}),
    ("sftm", {}),                     # float64 Gram eigen-decompositions on the device, float64 SVDs on the CPU
    ("opcm", {}),
    ("lines", {"base_method": "ties"}),
    ("lwptv", {"base_method": "task_arithmetic"}),
    ("slerp", {}),
]


def assert_close_rel(got: dict, want: dict, tol: float = 1e-5):
    assert got.keys() == want.keys()
    for k in want:
        a, b = got[k].double(), want[k].double()
        if not b.is_floating_point():
            assert torch.equal(got[k], want[k]), k
            continue
        err = float((a - b).norm())
        assert err <= tol * max(float(b.norm()), 1e-12), f"{k}: relative error {err / float(b.norm()):.2e}"


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu")
    base = make_base("llama", str(root / "base"))
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]
    return root, base, fts


PLACES = {"cuda": {"device": "cuda"},
          # two entries: one block on the GPU, the rest on the CPU, merged concurrently
          "map": {"device_map": {"model.layers.0": 0, "": "cpu"}}}


@pytest.mark.parametrize("where", list(PLACES))
@pytest.mark.parametrize("method,params", FAMILIES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(FAMILIES)])
def test_method_on_cuda_matches_cpu(zoo, tmp_path, method, params, where):
    root, base, fts = zoo
    inputs = fts[:2] if method == "slerp" else fts
    cpu = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "cpu"), params=params, quiet=True)
    gpu = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "gpu"), params=params, quiet=True,
                        **PLACES[where])
    assert gpu.recipe.hash == cpu.recipe.hash  # the device is not part of what is merged
    # SFTM's float32 SVDs on the device measured 1.06e-5 on an H200 (2026-11-26); its Gram eigen-decompositions
    # in float64 (the device's default since) are held to the other methods' bar
    assert_close_rel(weights(gpu.path), weights(cpu.path), 1e-5)


def test_lora_output_on_cuda_matches_cpu(zoo, tmp_path):
    root, base, fts = zoo
    kw = dict(base=base, quiet=True, output_format="lora", rank=8)
    cpu = hubsoup.merge(fts, "ties", out=str(tmp_path / "cpu"), **kw)
    gpu = hubsoup.merge(fts, "ties", out=str(tmp_path / "gpu"), device="cuda", **kw)
    a, b = weights(gpu.path), weights(cpu.path)
    # factors are defined up to sign per singular pair: compare the products B A
    for k in b:
        if k.endswith("lora_A.weight"):
            kb = k.replace("lora_A", "lora_B")
            pa, pb = (a[kb].double() @ a[k].double()), (b[kb].double() @ b[k].double())
            assert float((pa - pb).norm()) <= 1e-4 * float(pb.norm()), k
    assert abs(gpu.lora["aggregate_rel_error"] - cpu.lora["aggregate_rel_error"]) < 1e-5


def test_continual_add_on_cuda_matches_cpu(zoo, tmp_path):
    root, base, fts = zoo
    for dev in ("cpu", "cuda"):
        continual.init(fts[:2], base=base, out=str(tmp_path / dev), quiet=True, device=dev)
        continual.add(str(tmp_path / dev), [fts[2]], quiet=True, device=dev)
    assert_close_rel(weights(str(tmp_path / "cuda")), weights(str(tmp_path / "cpu")))


# --- the host feed (hubsoup.engine.hostfeed) on CUDA ------------------------------------------------

@pytest.fixture(scope="module")
def bf16_zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-bf16")
    base = make_base("llama", str(root / "base"), dtype=torch.bfloat16)
    return root, base, [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]


def files(folder):
    import os

    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))
            if f.endswith(".safetensors")}


@pytest.mark.parametrize("method,params", [("task_arithmetic", {}), ("ties", {"density": 0.3}),
                                           ("dare", {"p": 0.5, "then": "ties", "convention": "mergekit"}),
                                           ("slerp", {}), ("sftm", {})])
def test_feed_gives_the_bytes_of_the_plain_device_path(bf16_zoo, tmp_path, monkeypatch, method, params):
    """Through the feed (pinned staging, copy streams, checks read back later, output back through pinned
    buffers) a CUDA merge writes the same bytes as the device path without it (convert on the host, copy,
    check at once), and what it handed was the stored bf16, once per input and tensor."""
    from hubsoup.engine import hostfeed

    root, base, fts = bf16_zoo
    inputs = fts[:2] if method == "slerp" else fts
    feeds = []
    real = hostfeed.for_device

    def spy(device):
        f = real(device)
        if f is not None:
            feeds.append(f)
        return f

    monkeypatch.setattr(hostfeed, "for_device", spy)
    fed = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "fed"), params=params, quiet=True, device="cuda")
    assert feeds and all(f.pin and f.cuda for f in feeds)
    assert sum(f.returned_bytes for f in feeds) > 0
    assert sum(f.staged_bytes for f in feeds) > 0  # the next tensor's bytes were read while one was merged
    monkeypatch.setattr(hostfeed, "for_device", lambda device: None)  # the device path as it was
    plain = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "plain"), params=params, quiet=True,
                          device="cuda")
    assert files(fed.path) == files(plain.path)
    cpu = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "cpu"), params=params, quiet=True)
    # bf16 outputs: SFTM's device triplets (to ~1e-6 of the merged matrix) may flip a few roundings
    assert_close_rel(weights(fed.path), weights(cpu.path), tol=1e-3 if method == "sftm" else 1e-5)


def test_feed_hands_only_stored_bytes_on_cuda(bf16_zoo, monkeypatch):
    """Every tensor handed to the GPU is the stored bf16 (half the float32 bytes), read into pinned memory."""
    from hubsoup.engine import Job, hostfeed, stream
    from hubsoup.plan import Plan
    from hubsoup.sources.compat import open_models

    root, base, fts = bf16_zoo
    seen = []
    real_load = hostfeed.Feed.load

    def load(self, t, where=None):
        seen.append((t.dtype, where is not None))
        out = real_load(self, t, where)
        assert out.device.type == "cuda" and out.dtype == t.dtype
        return out

    monkeypatch.setattr(hostfeed.Feed, "load", load)
    base_ckpt, sources = open_models(fts, base=base)
    job = Job(Plan.of(base_ckpt, "cuda"), base_ckpt, sources, quiet=True)
    n = 0
    for work in stream(job, mergeable_only=True):
        d = work.deltas()
        assert d.device.type == "cuda" and d.dtype == torch.float32
        n += 1
    assert seen and {d for d, _ in seen} == {torch.bfloat16} and all(w for _, w in seen)  # read by preadv
    assert len(seen) == 4 * n


def test_a_nan_input_is_named_on_cuda(bf16_zoo, tmp_path):
    from safetensors.torch import load_file, save_file

    from hubsoup.errors import NonFiniteTensorError

    root, base, fts = bf16_zoo
    bad = tmp_path / "bad"
    make_finetune(base, str(bad), seed=9)
    sd = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name][0, :3] = float("nan")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(NonFiniteTensorError, match=rf"tensor '{name}' has 3 NaN/inf values"):
        hubsoup.merge([fts[0], str(bad)], "task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True,
                      device="cuda")
    assert not (tmp_path / "o").exists()


def test_a_float16_overflow_is_named_on_cuda(zoo, tmp_path):
    from hubsoup.errors import NonFiniteTensorError

    root, base, fts = zoo
    big = make_finetune(base, str(tmp_path / "big"), seed=3, scale=1e5)
    with pytest.raises(NonFiniteTensorError, match="overflows float16"):
        hubsoup.merge([big], "task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True, device="cuda",
                      dtype="float16", params={"scale": 1.0})
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_blocks_on_two_gpus_merge_as_on_one(bf16_zoo, tmp_path):
    root, base, fts = bf16_zoo
    one = hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "one"), quiet=True, device="cuda:0")
    two = hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "two"), quiet=True,
                        device_map={"model.layers.0": 1, "": 0})
    assert {b.worker for b in two.plan.blocks} == {"cuda:0", "cuda:1"}
    assert files(two.path) == files(one.path)


def test_dare_masks_are_the_same_on_cuda_as_on_the_cpu():
    """DARE's mergekit-convention masks are drawn on the device by the counter-based generator: the CPU's
    masks, bit for bit, past 2³¹ and 2³² entries too (hubsoup.methods._sparsify.counter_mask)."""
    from hubsoup.methods._sparsify import counter_bits, counter_mask

    seed = 0x5DEECE66D_1234567
    for start in (0, 2**31 - 70_000, 2**32 - 70_000):
        cpu = counter_bits(seed, start, 140_000)
        gpu = counter_bits(seed, start, 140_000, device="cuda")
        assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu)
    n = 3_000_000
    assert torch.equal(counter_mask(n, 0.1, seed, 4096, device="cuda").cpu(), counter_mask(n, 0.1, seed, 4096))


def test_dare_mergekit_convention_on_cuda_gives_the_cpus_bytes(zoo, tmp_path):
    root, base, fts = zoo
    params = {"p": 0.7, "then": "ties", "convention": "mergekit"}
    cpu = hubsoup.merge(fts, "dare", base=base, out=str(tmp_path / "cpu"), params=params, quiet=True)
    gpu = hubsoup.merge(fts, "dare", base=base, out=str(tmp_path / "gpu"), params=params, quiet=True, device="cuda")
    a, b, theta0 = weights(gpu.path), weights(cpu.path), weights(base)
    for k in b:  # the same entries dropped: every zero of τ where the CPU has one
        assert torch.equal(a[k] == theta0[k], b[k] == theta0[k]), k
    assert_close_rel(a, b)


@pytest.mark.parametrize("how", ["topk", "histogram"])
def test_ties_device_select_is_the_cpus_on_cuda(how, monkeypatch):
    """TIES on a GPU ranks each row on the device, never reading back: the CPU's threshold, exactly."""
    from hubsoup.methods._kernels import kth_largest_abs, kth_largest_abs_t

    monkeypatch.setattr("hubsoup.methods._kernels.DEVICE_SELECT", how)
    x = torch.randn(3_000_000, generator=torch.Generator().manual_seed(0))
    x[::7] = 0.0
    x[1::11] = 0.25
    for k in (1, 1000, 600_000, 2_999_999):
        assert float(kth_largest_abs_t(x.cuda(), k)) == kth_largest_abs(x, k), k


def test_sftm_gram_triplets_on_cuda_match_the_cpus_float64_svds():
    """SFTM's float64 Gram eigen-decompositions on the device: the CPU float64 SVDs' merge to ~float32 rounding."""
    from hubsoup.methods.sftm import singular_features, singular_features_gram, superpose, trim_topk_

    g = torch.Generator().manual_seed(3)
    mats = torch.randn(3, 384, 640, generator=g) * 0.02
    mats[1] += 0.5 * mats[0]
    for row in mats:
        trim_topk_(row, 0.2)
    want, _ = superpose([singular_features(M) for M in mats], out_dtype=torch.float32)
    got, _ = superpose(singular_features_gram(mats.cuda()), out_dtype=torch.float32)
    assert float((got.cpu().double() - want.double()).norm() / want.double().norm()) <= 1e-6


# --- the feed's fixed costs: device counts and page-locked buffers (issue 50) -------------------------------

def _spy_feeds(monkeypatch):
    from hubsoup.engine import hostfeed

    feeds, real = [], hostfeed.for_device

    def spy(device):
        f = real(device)
        if f is not None:
            feeds.append(f)
        return f

    monkeypatch.setattr(hostfeed, "for_device", spy)
    return feeds


@pytest.fixture(scope="module")
def depth_zoo(tmp_path_factory):
    """bf16 base + 3 at two depths: what a merge does per tensor shows as the difference between them."""
    root = tmp_path_factory.mktemp("gpu-depth")
    out = {}
    for layers in (2, 4):
        base = make_base("llama", str(root / f"base{layers}"), dtype=torch.bfloat16, layers=layers)
        out[layers] = (base, [make_finetune(base, str(root / f"ft{layers}-{i}"), seed=i) for i in (1, 2, 3)])
    return root, out


@pytest.mark.parametrize("method,params", [("task_arithmetic", {}), ("ties", {"density": 0.3}),
                                           ("dare", {"p": 0.5, "then": "ties", "convention": "mergekit"})])
def test_a_merge_counts_the_cuda_devices_a_constant_number_of_times(depth_zoo, tmp_path, monkeypatch, method,
                                                                   params):
    """No CUDA device count per tensor (torch.cuda.stream's StreamContext made two per stream switch: ~2 650
    per TIES merge of a 1B base + 3): a model twice as deep makes as many ``_cuda_getDeviceCount`` calls."""
    root, zoo = depth_zoo
    calls = [0]
    real = torch._C._cuda_getDeviceCount

    def counting():
        calls[0] += 1
        return real()

    counts = {}
    for layers in (2, 2, 4):  # the first run warms CUDA and the caches up
        base, fts = zoo[layers]
        monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", counting)
        calls[0] = 0
        hubsoup.merge(fts, method, base=base, out=str(tmp_path / f"o{layers}"), params=params, quiet=True,
                      device="cuda", overwrite=True)
        monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", real)
        counts[layers] = calls[0]
    assert counts[4] == counts[2] and counts[4] <= 30, counts  # a few per merge (one per feed), none per tensor


def test_the_feed_pins_a_bounded_number_of_buffers(depth_zoo, tmp_path, monkeypatch):
    """Staging, read-ahead and output buffers come from rings made once per feed: a merge of 39 tensors × 4
    inputs pins a few dozen buffers at most, not a few per tensor (run 3: 2 640 ``torch.empty`` calls)."""
    from hubsoup.engine import hostfeed

    root, zoo = depth_zoo
    base, fts = zoo[4]
    feeds = _spy_feeds(monkeypatch)
    hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "o"), params={"density": 0.3}, quiet=True,
                  device="cuda")
    assert feeds and all(f.loads >= 4 * 39 for f in feeds)
    for f in feeds:
        # the tiny model's tensors all fit the rings' first buffers (1 MB): each slot pinned once
        assert f._ahead.allocations <= hostfeed.STAGE_SLOTS and f._out.allocations <= hostfeed.OUT_SLOTS
        assert f._in.allocations <= 2
        assert f.one_off_pins <= f.loads // 10, (f.one_off_pins, f.loads)  # a reader thread's late release
        assert f.pinned_buffers < f.loads // 3


@pytest.mark.parametrize("method,params", [("task_arithmetic", {}), ("ties", {"density": 0.3}),
                                           ("dare", {"p": 0.5, "then": "ties", "convention": "mergekit"}),
                                           ("slerp", {}), ("sftm", {})])
def test_tiny_rings_give_the_same_bytes(depth_zoo, tmp_path, monkeypatch, method, params):
    """With rings of one or two buffers and two flag entries (every buffer reused as soon as the rules allow,
    one-off buffers when all are held), the output is the plain device path's, byte for byte: a buffer is never
    written while a copy or the writer still reads it."""
    from hubsoup.engine import hostfeed

    root, zoo = depth_zoo
    base, fts = zoo[4]
    inputs = fts[:2] if method == "slerp" else fts
    kw = dict(base=base, params=params, quiet=True, device="cuda")
    monkeypatch.setattr(hostfeed, "STAGE_SLOTS", 2)
    monkeypatch.setattr(hostfeed, "OUT_SLOTS", 1)
    monkeypatch.setattr(hostfeed, "FLAG_SLOTS", 2)
    feeds = _spy_feeds(monkeypatch)
    tiny = hubsoup.merge(inputs, method, out=str(tmp_path / "tiny"), **kw)
    assert feeds and sum(f.one_off_pins for f in feeds) > 0  # the rings were full at times: exercised
    monkeypatch.setattr(hostfeed, "for_device", lambda device: None)  # the device path without the feed
    plain = hubsoup.merge(inputs, method, out=str(tmp_path / "plain"), **kw)
    assert files(tiny.path) == files(plain.path)
