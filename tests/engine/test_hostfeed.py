"""The host feed (hubsoup.engine.hostfeed) exercised without a GPU.

* On a device other than the CPU (here ``meta``, with an instrumented transfer), the host hands only
  the stored bytes: every tensor handed is in its stored dtype (bf16), and no operation on the host
  touches a float32 tensor (a dispatch mode records every aten op that runs on the CPU).
* Through an instrumented feed on the CPU (the device path's order: staging buffers, checks deferred,
  output back through staging), a merge gives the CPU's bytes; a NaN in an input is still named.
* The checks are deferred but raised in the CPU's order and with its messages.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hubsoup
from hubsoup.engine import Job, hostfeed, run, stream
from hubsoup.errors import NonFiniteTensorError
from hubsoup.methods import get_method, parse_params
from hubsoup.plan import Plan
from hubsoup.sources.compat import open_models
from hubsoup.testing import make_base, make_finetune


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("feed")
    base = make_base("llama", str(root / "base"), dtype=torch.bfloat16)
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=i) for i in (1, 2, 3)]
    return root, base, fts


class HostOps(TorchDispatchMode):
    """Every aten op run on the CPU, with the dtypes of the CPU tensors it reads and makes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, set]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        dtypes = set()
        for t in (*_flat(args), *_flat(kwargs or {}), *_flat(out)):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.numel() > 1:
                dtypes.add(t.dtype)
        if dtypes:
            self.ops.append((str(func), dtypes))
        return out


def _flat(x):
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


class Recorder:
    """A sink that keeps what it is given (on ``meta``: shapes and dtypes only)."""

    def __init__(self):
        self.got = {}

    def accepts_lowrank(self, entry):
        return False

    def weights_dtype(self, entry):
        return entry.dtype

    def put(self, work, outcome):
        from hubsoup.engine import Copy, Dense, Unchanged

        if isinstance(outcome, Copy):
            return
        merged = work.base() if isinstance(outcome, Unchanged) else outcome.tau.add_(work.base())
        out = merged.to(work.entry.dtype)
        self.got[work.name] = work.feed.back(out).result() if work.feed is not None else out


def meta_job(base, fts, method, params):
    base_ckpt, sources = open_models(fts, base=base)
    m = get_method(method)
    return Job(Plan.of(base_ckpt, "meta"), base_ckpt, sources, m, parse_params(m.Params, params, method=method),
               quiet=True, prefetch=False)


@pytest.mark.parametrize("method,params", [("task_arithmetic", {}), ("linear", {})])
def test_on_another_device_the_host_hands_only_stored_bytes(zoo, monkeypatch, method, params):
    root, base, fts = zoo
    handed = []

    def transfer(staged):  # the staged host tensor, as the device would receive it
        handed.append((staged.dtype, staged.numel()))
        return staged.to("meta")

    feeds = []

    def make(device):
        if torch.device(device).type == "cpu":
            return None
        feeds.append(hostfeed.Feed(device, transfer=transfer))
        return feeds[-1]

    monkeypatch.setattr(hostfeed, "for_device", make)
    inputs = fts[:2] if method == "slerp" else fts
    job = meta_job(base, inputs, method, params)
    sink = Recorder()
    with HostOps() as ops:
        run(job, sink)
    merged = [e for _, e in job.plan.entries() if e.mergeable]
    assert len(sink.got) == len(merged) and all(t.device.type == "meta" for t in sink.got.values())
    assert all(t.dtype == torch.bfloat16 for t in sink.got.values())  # the output in the inputs' dtype
    # every tensor handed was the stored bf16, once per input and the base
    assert handed and {d for d, _ in handed} == {torch.bfloat16}
    stored = sum(e.numel for e in merged) * (len(inputs) + 1)
    assert sum(n for _, n in handed) == stored
    assert sum(f.handed_bytes for f in feeds) == 2 * stored
    # on the host: the file's raw bytes (uint8) and bf16 views of them, never a float32 tensor
    touched = {d for _, ds in ops.ops for d in ds}
    assert torch.bfloat16 in touched and touched <= {torch.bfloat16, torch.uint8}, \
        [op for op in ops.ops if op[1] - {torch.bfloat16, torch.uint8}][:5]
    # the bytes were read from the files straight into the staging buffers: no copy through the mapping
    assert not [op for op, ds in ops.ops if op == "aten.copy_.default"]


def test_the_cpu_path_has_no_feed(zoo, monkeypatch):
    root, base, fts = zoo
    base_ckpt, sources = open_models(fts, base=base)
    job = Job(Plan.of(base_ckpt, "cpu"), base_ckpt, sources, quiet=True)
    assert all(w.feed is None for w in stream(job))
    assert hostfeed.for_device("cpu") is None and hostfeed.for_device("meta") is not None


def files(folder):
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))
            if f.endswith(".safetensors")}


@pytest.mark.parametrize("method,params", [("ties", {"density": 0.3}), ("dare", {"p": 0.5, "then": "ties"}),
                                           pytest.param("sftm", {}, marks=pytest.mark.slow)])
def test_a_merge_through_the_feed_gives_the_cpus_bytes(zoo, tmp_path, monkeypatch, method, params):
    root, base, fts = zoo
    plain = hubsoup.merge(fts, method, base=base, out=str(tmp_path / "plain"), params=params, quiet=True)
    feeds = []

    def make(device):  # an instrumented feed on the CPU: staging, deferred checks, output back through staging
        feeds.append(hostfeed.Feed(device, transfer=lambda t: t.clone()))
        return feeds[-1]

    monkeypatch.setattr(hostfeed, "for_device", make)
    fed = hubsoup.merge(fts, method, base=base, out=str(tmp_path / "fed"), params=params, quiet=True)
    assert feeds and sum(f.handed_bytes for f in feeds) > 0 and sum(f.returned_bytes for f in feeds) > 0
    assert files(fed.path) == files(plain.path)


def test_a_nan_in_an_input_is_named_through_the_feed(zoo, tmp_path, monkeypatch):
    root, base, fts = zoo
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    make_finetune(base, str(bad), seed=9)
    sd = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    sd[name][0, :3] = float("nan")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(hostfeed, "for_device", lambda d: hostfeed.Feed(d, transfer=lambda t: t.clone()))
    with pytest.raises(NonFiniteTensorError, match=rf"input '.*bad': tensor '{name}' has 3 NaN/inf values"):
        hubsoup.merge([fts[0], str(bad)], "task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True)
    assert not (tmp_path / "o").exists()


def test_checks_are_deferred_and_raised_in_order():
    f = hostfeed.Feed("cpu", transfer=lambda t: t.clone())
    s1 = f.next_tensor()
    f.check(torch.tensor(0), lambda n: AssertionError("never"))
    f.check(torch.tensor(2), lambda n: ValueError(f"first {n}"))
    f.next_tensor()
    f.check(torch.tensor(5), lambda n: KeyError("second"))
    f.settle(s1 - 1)  # nothing due yet
    with pytest.raises(ValueError, match="first 2"):
        f.settle(s1)
    with pytest.raises(KeyError):
        f.settle()
    f.settle()  # settled checks are gone


def test_without_a_byte_range_the_mapping_is_copied(zoo, monkeypatch):
    """A tensor with no byte range (a pickle file) or a short read is staged through its mapping: same bytes."""
    root, base, fts = zoo

    path = os.path.join(base, "model.safetensors")
    f = hostfeed.Feed("cpu", transfer=lambda t: t.clone())
    from safetensors import safe_open

    name = "model.layers.0.mlp.up_proj.weight"
    with safe_open(path, "pt") as h:
        t = h.get_tensor(name)
    import json
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        a, b = json.loads(fh.read(n))[name]["data_offsets"]
    assert torch.equal(f.load(t, (path, 8 + n + a, b - a)), t)
    monkeypatch.setattr(hostfeed, "READ_PIECE", 1000)  # read in parallel pieces: the same bytes
    assert (b - a) > 3000 and torch.equal(f.load(t, (path, 8 + n + a, b - a)), t)
    assert torch.equal(f.load(t), t)
    size = os.path.getsize(path)
    assert torch.equal(f.load(t, (path, size - (b - a) // 2, b - a)), t)  # past the end: short, then mapped
    f.close()


def test_staging_buffers_are_reused_double_buffered():
    f = hostfeed.Feed("cpu", transfer=lambda t: t.clone())
    for n in (10, 1000, 10, 500):
        f.load(torch.ones(n, dtype=torch.bfloat16))
    assert len(f._in.slots) == 1 and f._in.allocations == 1  # nothing held it: one buffer, reused
    f._transfer = lambda t: t  # an instrumented transfer that hands back the staging view: its buffer is held
    kept = f.load(torch.full((7,), 2.0, dtype=torch.bfloat16))
    other = f.load(torch.full((7,), 3.0, dtype=torch.bfloat16))  # the held buffer is not written: a second one
    assert kept.tolist() == [2.0] * 7 and other.tolist() == [3.0] * 7 and f._in.allocations == 2
    third = f.load(torch.full((7,), 4.0, dtype=torch.bfloat16))  # both held (a ring of two): a one-off buffer
    assert (kept.tolist(), other.tolist(), third.tolist()) == ([2.0] * 7, [3.0] * 7, [4.0] * 7)
    assert f.one_off_pins == 1
    back = [f.back(torch.full((4,), float(i))) for i in range(3)]
    # each output has a buffer of its own while held (the writer may queue several)
    assert [b.result().tolist() for b in back] == [[float(i)] * 4 for i in range(3)]
    assert len(f._out.slots) == 3
    del back
    again = [f.back(torch.full((4,), 9.0)) for _ in range(3)]  # dropped: the same three buffers again
    assert len(f._out.slots) == 3 and f._out.allocations == 3 and all(a.result().tolist() == [9.0] * 4 for a in again)
    f.close()
    assert not f._in.slots and not f._out.slots


def test_staged_reads_are_the_bytes_load_reads(tmp_path, monkeypatch):
    """Feed.stage reads the next tensor's ranges in the reader threads; load of the same range takes them
    (the same bytes as a direct read), and a staged range never loaded is dropped two tensors later."""
    from safetensors.torch import save_file

    tensors = {"a": torch.randn(3000).to(torch.bfloat16), "b": torch.randn(50, 40).to(torch.bfloat16)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    ckpt_ranges = {}
    import json
    with open(path, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    for k in tensors:
        a, b = header[k]["data_offsets"]
        ckpt_ranges[k] = (path, 8 + n + a, b - a)
    monkeypatch.setattr(hostfeed, "READ_PIECE", 1000)  # several pieces per tensor, read concurrently
    f = hostfeed.Feed("cpu", transfer=lambda t: t.clone())
    f.next_tensor()
    f.stage([ckpt_ranges["a"], ckpt_ranges["b"]])
    assert torch.equal(f.load(tensors["a"], ckpt_ranges["a"]), tensors["a"])
    assert f.staged_bytes == tensors["a"].numel() * 2 and ckpt_ranges["b"] in f._staged
    f.next_tensor()
    assert ckpt_ranges["b"] in f._staged  # staged for the tensor after the one being fed: kept
    f.next_tensor()
    assert not f._staged  # never loaded: dropped
    assert torch.equal(f.load(tensors["b"], ckpt_ranges["b"]), tensors["b"])  # read directly now
    assert f.staged_bytes == tensors["a"].numel() * 2
    f.close()


def test_a_float16_overflow_is_named_through_the_feed(zoo, tmp_path, monkeypatch):
    """The output's check is deferred to when it is written (the device's flag read back then): same message."""
    root, base, fts = zoo
    big = make_finetune(base, str(tmp_path / "big"), seed=3, scale=1e5)
    monkeypatch.setattr(hostfeed, "for_device", lambda d: hostfeed.Feed(d, transfer=lambda t: t.clone()))
    with pytest.raises(NonFiniteTensorError, match=r"overflows float16 \(max 65504\); use --dtype float32 or bfloat16"):
        hubsoup.merge([big], "task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True, dtype="float16",
                      params={"scale": 1.0})
    assert not (tmp_path / "o").exists()


class _FakeStream:
    device_index = 0

    def __init__(self, *a, **k):
        self.waited = []

    def synchronize(self):
        pass

    def wait_stream(self, other):
        self.waited.append(other)

    def wait_event(self, event):
        self.waited.append(event)


class _FakeEvent:
    made = 0

    def __init__(self, *a, **k):
        _FakeEvent.made += 1
        self.recorded = None
        self.waited = False

    def record(self, stream=None):
        assert stream is not None, "Event.record() without a stream asks torch for the current device"
        self.recorded = stream

    def query(self):
        assert self.recorded is not None, "an event queried before it was recorded"
        return True

    def synchronize(self):
        assert self.recorded is not None, "an event waited on before it was recorded"
        self.waited = True


def test_the_cuda_branch_runs_with_stand_in_streams(zoo, tmp_path, monkeypatch):
    """The feed's CUDA code (copy streams, events, record_stream, flags read back on a side stream) run on the
    CPU with stand-ins for CUDA's streams and events: the merge gives the CPU's bytes. (Its real timing and
    pinned copies are tests/engine/test_gpu.py's.)"""
    root, base, fts = zoo
    plain = hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "plain"), params={"density": 0.3}, quiet=True)
    current, recorded = _FakeStream(), []
    now, switched = [current], []

    def set_stream(s):
        switched.append(s)
        now[0] = s

    def no_stream_context(s):
        raise AssertionError("torch.cuda.stream's StreamContext counts the CUDA devices on every switch")

    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: now[0] if device == 0 else current)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "stream", no_stream_context)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: recorded.append(s))
    feeds = []

    def make(device):
        f = hostfeed.Feed(device, pin=False)
        f.cuda = f.stage_host = True  # the CUDA branch, on CPU tensors
        f.h2d, f.d2h, f.flags = _FakeStream(), _FakeStream(), _FakeStream()
        feeds.append(f)
        return f

    monkeypatch.setattr(hostfeed, "for_device", make)
    _FakeEvent.made = 0
    fed = hubsoup.merge(fts, "ties", base=base, out=str(tmp_path / "fed"), params={"density": 0.3}, quiet=True)
    assert files(fed.path) == files(plain.path)
    assert all(f.handed_bytes for f in feeds) and feeds[-1].returned_bytes  # statistics passes, then the output
    # all but each pass's first tensor were read ahead, while the one before them was merged
    assert all(0 < f.staged_bytes < f.handed_bytes for f in feeds)
    assert _FakeEvent.made and recorded
    assert any(w is f.h2d for f in feeds for w in current.waited)  # the compute stream waited for the copies
    assert any(f.d2h.waited for f in feeds) and any(f.flags.waited for f in feeds)  # outputs and flags went back
    # every copy ran on its copy stream (switched to and back: the compute stream is current again)
    assert now[0] is current and {id(f.h2d) for f in feeds} <= {id(s) for s in switched}
    assert switched[1::2] == [current] * (len(switched) // 2)
    # a bounded number of page-locked buffers, not a few per tensor; each check's flag in the flags array
    assert all(f.pinned_buffers <= 2 + 16 + 6 + 1 and f.one_off_pins == 0 for f in feeds)
    assert sum(f.handed_bytes for f in feeds) and all(f._flags is None for f in feeds)  # closed


def test_feed_log_records_each_feed(zoo, tmp_path, monkeypatch):
    """HUBSOUP_FEED_LOG: one JSON line per feed with its counts, and one with the writer's waits (bench_gpu.py's
    host-side figures)."""
    import json

    root, base, fts = zoo
    log = tmp_path / "feed.jsonl"
    monkeypatch.setenv("HUBSOUP_FEED_LOG", str(log))
    monkeypatch.setattr(hostfeed, "for_device", lambda d: hostfeed.Feed(d, transfer=lambda t: t.clone()))
    hubsoup.merge(fts, "task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True)
    rec, writer = [json.loads(line) for line in log.read_text().splitlines()]
    assert rec["handed_bytes"] > 0 and rec["returned_bytes"] > 0 and rec["open_seconds"] >= rec["host_seconds"] >= 0
    assert rec["staged_bytes"] > 0 and rec["read_wait_s"] >= 0 and rec["back_wait_s"] >= 0
    assert writer["writer"]["wait_s"] >= 0 and writer["writer"]["close_s"] > 0  # close synced the shard


# --- the pinned ring, the flags and the stream switch, without CUDA -------------------------------------------

class _Copy:
    """A stand-in CUDA event for a copy still running until ``finish``."""

    def __init__(self):
        self.over = False
        self.waited = False

    def query(self):
        return self.over

    def synchronize(self):
        self.waited = self.over = True


def test_the_ring_reuses_a_buffer_only_when_no_view_holds_it_and_its_copy_is_over():
    ring = hostfeed.PinnedRing(3, pin=False, floor=16, cap=1 << 16)
    a = ring.take(100)
    assert a.buf.numel() == 128  # a power of two: regrown a few times at most, never per request
    view = a.buf[:100].view(torch.bfloat16)  # the writer's view of an output
    held_np = view.view(torch.uint8).numpy()
    del view
    b = ring.take(100)
    assert b is not a  # a numpy array of it still holds it
    del held_np
    a.done, b.done = _Copy(), _Copy()
    b.done.over = True
    assert ring.take(50) is b and not a.done.waited  # of the free ones, the one whose copy is over
    b.done = _Copy()
    c = ring.take(10)  # both still copying: a third slot rather than a wait
    assert c is not a and c is not b and not a.done.waited and not b.done.waited
    c.done = _Copy()
    first, d = a.done, ring.take(10)  # the ring is full: the next one in turn, after waiting for its copy
    assert d is a and first.waited and d.done is None and len(ring.slots) == 3 and ring.allocations == 3
    views = [s.buf[:1] for s in ring.slots]
    assert ring.take(10) is None  # every slot held: the caller takes a one-off buffer
    del views
    assert ring.take((1 << 16) + 1) is None  # over the cap: never in the ring
    big = ring.take(40000)
    assert big.buf.numel() == 1 << 16 and ring.allocations == 4
    for n in (10, 3000, 40000, 7, 65536) * 20:  # many requests: the buffers grow to the largest and stay
        ring.take(n)
    assert len(ring.slots) == 3 and ring.allocations <= 6


def test_the_ring_waits_for_the_last_copy_before_it_writes_a_buffer_again():
    ring = hostfeed.PinnedRing(1, pin=False)
    a = ring.take(8)
    a.done = _Copy()  # queued, not over
    assert ring.take(8) is a and a.done is None  # waited for (synchronize), then handed
    ring.clear()
    assert not ring.slots


def test_flag_entries_are_reused_after_they_are_read_or_dropped():
    flags = hostfeed._Flags(2, pin=False)
    assert [flags.take(), flags.take(), flags.take()] == [0, 1, None]  # none left: a one-off scalar then
    flags.give(1)
    assert flags.take() == 1


def test_settle_frees_the_flag_entries_of_a_failing_group():
    f = hostfeed.Feed("cpu", transfer=lambda t: t.clone())
    f._flags = hostfeed._Flags(4, pin=False)
    entries = [f._flags.take() for _ in range(3)]
    for i, e in enumerate(entries):
        f._flags.host[e] = i  # the second check (1) fails
        f._checks.append((1, hostfeed._Flag(f._flags.host[e], _Copy(), e), lambda n: ValueError(f"bad {n}")))
    with pytest.raises(ValueError, match="bad 1"):
        f.settle()
    assert sorted(f._flags._free) == [0, 1, 2, 3] and not f._checks


class _FakeCuda:
    """torch.cuda's current device and per-device current streams, as the CUDA runtime keeps them: ``set_stream``
    also makes the stream's device current (``THCPModule_setStream_wrap``). Counts the device counts."""

    class S:
        def __init__(self, name, index):
            self.name, self.device_index, self.device = name, index, torch.device("cuda", index)

        def __repr__(self):
            return self.name

    def __init__(self, monkeypatch):
        self.current = {0: self.S("default0", 0), 1: self.S("side1", 1)}  # device 1's current is not its default
        self.device, self.counts = 0, 0
        fake = self

        class device:  # torch.cuda.device: the current device for a block
            def __init__(self, d):
                self.idx = d.index if isinstance(d, torch.device) else d

            def __enter__(self):
                self.prev, fake.device = fake.device, self.idx

            def __exit__(self, *exc):
                fake.device = self.prev

        def is_available():
            fake.counts += 1
            return True

        def current_stream(d=None):
            if d is None:  # torch resolves None through _get_device_index: a device count
                is_available()
                d = fake.device
            return fake.current[d.index if isinstance(d, torch.device) else d]

        def set_stream(s):
            fake.device = s.device_index
            fake.current[s.device_index] = s

        for name, fn in {"is_available": is_available, "current_stream": current_stream, "set_stream": set_stream,
                         "current_device": lambda: fake.device, "device": device}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def state(self):
        return self.device, {d: s.name for d, s in self.current.items()}


@pytest.mark.parametrize("on", [0, 1])
def test_on_stream_switches_and_restores_as_torch_cuda_stream_does_without_counting_devices(monkeypatch, on):
    """hostfeed.on_stream against torch's own StreamContext (run on the same stand-in runtime): the same
    current device and streams inside and after, for a stream on the current device and on another one;
    StreamContext counts the devices, on_stream never does."""
    got = {}
    for how in ("torch", "hubsoup"):
        cuda = _FakeCuda(monkeypatch)
        start = cuda.state()
        s = _FakeCuda.S("copy", on)
        ctx = torch.cuda.StreamContext(s) if how == "torch" else hostfeed.on_stream(s)
        with ctx:
            inside = cuda.state()
        got[how] = (inside, cuda.state(), cuda.counts)
        assert cuda.state() == start
    assert got["hubsoup"][:2] == got["torch"][:2]
    assert got["hubsoup"][0][0] == on and got["hubsoup"][0][1][on] == "copy"
    assert got["torch"][2] >= 1 and got["hubsoup"][2] == 0


@pytest.mark.parametrize("method,params", [("ties", {"density": 0.3}), ("slerp", {})])
def test_tiny_rings_through_the_feed_give_the_cpus_bytes(zoo, tmp_path, monkeypatch, method, params):
    """Rings of one or two buffers (every buffer reused as soon as nothing holds it, one-off buffers when all are
    held): the writer's queued outputs are never overwritten, the bytes are the CPU's."""
    root, base, fts = zoo
    inputs = fts[:2] if method == "slerp" else fts
    plain = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "plain"), params=params, quiet=True)
    monkeypatch.setattr(hostfeed, "STAGE_SLOTS", 2)
    monkeypatch.setattr(hostfeed, "OUT_SLOTS", 1)
    feeds = []

    def make(device):
        feeds.append(hostfeed.Feed(device, transfer=lambda t: t.clone()))
        return feeds[-1]

    monkeypatch.setattr(hostfeed, "for_device", make)
    fed = hubsoup.merge(inputs, method, base=base, out=str(tmp_path / "fed"), params=params, quiet=True)
    assert files(fed.path) == files(plain.path)
    out = feeds[-1]
    assert out._out.allocations == 1 and out.one_off_pins > 0  # the writer held the one output buffer at times
    assert out._ahead.allocations <= 2


def test_without_torchs_use_count_a_ring_buffer_is_never_reused(monkeypatch):
    monkeypatch.setattr(hostfeed, "_USE_COUNT", None)  # a torch without torch._C._storage_Use_Count
    ring = hostfeed.PinnedRing(2, pin=False)
    a, b = ring.take(8), ring.take(8)
    assert a is not b and ring.take(8) is None  # one-off buffers from then on, as before the ring
