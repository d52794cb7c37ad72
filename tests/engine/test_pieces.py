"""The engine's in-pieces path (Weights outcomes): methods whose merge is element-wise once per-tensor
statistics are known (linear ones; TIES) merge full fine-tunes in cache-sized pieces straight into the
output dtype. Same result, bit for bit, as the dense path; the same errors."""

import os
import threading

import pytest
import torch

import hubsoup
from hubsoup.engine import lowrank
from hubsoup.errors import NonFiniteTensorError
from hubsoup.output.checkpoint import CheckpointSink
from hubsoup.testing import make_base, make_finetune
from method_helpers import state


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def models(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"pieces-{str(request.param)[6:]}")
    base = make_base("llama", str(root / "base"), dtype=request.param)
    fts = [make_finetune(base, str(root / f"ft{i}"), seed=10 + i) for i in range(3)]
    return base, fts


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1000 entries (not a multiple of any vector width): every tensor spans several, ragged."""
    monkeypatch.setattr(lowrank, "PIECE_BYTES", 4 * 4 * 1000)
    monkeypatch.setattr(lowrank, "MIN_PIECE", 1000)


@pytest.fixture(params=[1, 2], ids=["1lane", "2lanes"])
def lanes(request, monkeypatch):
    """Pieces swept by one thread, or by two at once (each piece in either, whatever the machine's cores)."""
    from hubsoup.engine import lanes as module

    def count(allowed=None, n_pieces=None):
        want = request.param if allowed is None else min(allowed, request.param)
        return max(1, min(want, n_pieces or want))

    monkeypatch.setattr(module, "count", count)
    real, seen = module.run, set()

    def run(fn, n, stop=None):
        def lane(j):
            seen.add((n, j, threading.current_thread() is threading.main_thread()))
            return fn(j)
        return real(lane, n, stop=stop)

    monkeypatch.setattr(module, "run", run)
    yield request.param
    # one lane (a one-piece tensor too): this thread; more: every lane in a lane thread
    want = {(n, j, n == 1) for n in range(1, request.param + 1) for j in range(n)}
    assert seen == want, "the pieces were not swept in lanes"


@pytest.fixture
def used(monkeypatch):
    """How many tensors went through the in-pieces path."""
    calls = []
    real = lowrank.merge_in_pieces

    def counting(*a, **kw):
        out = real(*a, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(lowrank, "merge_in_pieces", counting)
    return calls


def _dense(monkeypatch):
    """No pieces anywhere: the merge (the sink wants τ) and the statistics passes (no sweep)."""
    from hubsoup.engine import TensorWork

    monkeypatch.setattr(CheckpointSink, "weights_dtype", lambda self, entry: None)
    monkeypatch.setattr(TensorWork, "pieces", lambda self: None)


@pytest.mark.parametrize("method, params", [
    ("task_arithmetic", {"scale": 0.3}),
    ("task_arithmetic", {"weights": [0.2, 1.0, -0.5], "normalize": True}),
    ("linear", {}),
    ("soup", {"scale": 0.8}),
    ("ties", {"scope": "tensor"}),  # the threshold and the majority sign from passes over the pieces
    ("ties", {"scope": "tensor", "densities": [0.1, 1.0, 0.5], "weights": [0.5, 1.0, 2.0], "merge": "sum"}),
    ("ties", {"scope": "tensor", "density": 0.0}),  # keeps nothing
    ("ties", {}),  # scope=model: the model-wide threshold (its radix passes in pieces too), the majority sign
    ("ties", {"density": 0.05, "weights": [1.0, 0.5, 2.0]}),
    ("lwptv", {"base_method": "ties", "eta": 0.3}),  # TIES' model-wide passes see the masked pieces
    ("lwptv", {"base_method": "ties", "scope": "tensor", "combine": "per_task", "eta": 0.5}),
    ("lines", {}),  # over task arithmetic
    ("lines", {"base_method": "ties", "scope": "tensor"}),
])
def test_pieces_equal_the_dense_path_bit_for_bit(models, small_pieces, lanes, used, monkeypatch, tmp_path, method,
                                                 params):
    base, fts = models
    ours = hubsoup.merge(fts, method=method, base=base, out=str(tmp_path / "pieces"), quiet=True, **params)
    assert used and all(used), "the in-pieces path was not taken"
    _dense(monkeypatch)
    used.clear()
    ref = hubsoup.merge(fts, method=method, base=base, out=str(tmp_path / "dense"), quiet=True, **params)
    assert not used
    got, want = state(ours.path), state(ref.path)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def wider(request, tmp_path_factory):
    """Tensors of several 4096-entry blocks (SLERP's sums) and 65536-entry ones (DARE's masks), the
    embeddings' ending in a partial block (2100 × 64 entries)."""
    root = tmp_path_factory.mktemp(f"wider-{str(request.param)[6:]}")
    base = make_base("llama", str(root / "base"), dtype=request.param, hidden=64, vocab=2100)
    return base, [make_finetune(base, str(root / f"ft{i}"), seed=20 + i) for i in range(3)]


@pytest.mark.parametrize("ends", ["two inputs", "base and input"])
def test_slerp_in_pieces_equals_the_dense_path(wider, small_pieces, lanes, used, monkeypatch, tmp_path, ends):
    """SLERP's norms and dot product come from a pass over the pieces (whole blocks of entries, their sums
    summed exactly, in whatever order the lanes give them), then each piece interpolates: the dense
    path's result, bit for bit."""
    base, fts = wider
    args = dict(base=base) if ends == "base and input" else {}
    ins = fts[:1] if ends == "base and input" else fts[:2]
    ours = hubsoup.merge(ins, method="slerp", out=str(tmp_path / "pieces"), quiet=True, t=0.3, **args)
    assert used and all(used), "the in-pieces path was not taken"
    _dense(monkeypatch)
    ref = hubsoup.merge(ins, method="slerp", out=str(tmp_path / "dense"), quiet=True, t=0.3, **args)
    got, want = state(ours.path), state(ref.path)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("method, params", [
    ("dare", {"then": "ties", "p": 0.5}),
    ("dare", {"then": "sum", "densities": [0.3, 1.0, 0.6], "weights": [1.0, 0.5, 2.0], "normalize": True}),
    ("dare", {"then": "ties", "p": 0.7, "rescale": False, "merge": "mean"}),
    ("lines", {"base_method": "dare", "then": "ties", "p": 0.5}),  # the pieces as DARE's, under layer scaling
])
def test_dare_mergekit_in_pieces_equals_the_dense_path(wider, small_pieces, lanes, used, monkeypatch, tmp_path,
                                                       method, params):
    """DARE's mergekit convention draws each 2¹⁶-entry block of a mask from a generator of its own and sums
    the L1 norms in a pass over the pieces: merged in pieces (in lanes, any order), the dense path's
    result bit for bit."""
    base, fts = wider
    params = {"convention": "mergekit", **params}
    ours = hubsoup.merge(fts, method=method, base=base, out=str(tmp_path / "pieces"), quiet=True, **params)
    assert used and all(used), "the in-pieces path was not taken"
    _dense(monkeypatch)
    ref = hubsoup.merge(fts, method=method, base=base, out=str(tmp_path / "dense"), quiet=True, **params)
    got, want, b = state(ours.path), state(ref.path), state(base)
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    if "densities" not in params:  # every input dropped at some entries (an input kept whole changes them all)
        emb = next(k for k in want if "embed" in k)
        assert 0.05 < float((got[emb] == b[emb]).float().mean()) < 0.95


def test_slerp_pieces_start_at_whole_blocks(wider, small_pieces, monkeypatch, tmp_path):
    """Pieces of 1000 entries asked for, SLERP's start at multiples of its blocks (``piece_multiple``)."""
    from hubsoup.engine import TensorWork
    from hubsoup.linalg import DOT_BLOCK

    steps = []
    real = TensorWork.pieces

    def spying(self, multiple=1):
        sweep = real(self, multiple)
        if sweep is not None:
            steps.append(sweep.starts.step)
        return sweep

    monkeypatch.setattr(TensorWork, "pieces", spying)
    base, fts = wider
    hubsoup.merge(fts[:2], method="slerp", out=str(tmp_path / "s"), quiet=True)
    assert steps and all(step % DOT_BLOCK == 0 for step in steps)
    steps.clear()
    hubsoup.merge(fts, method="task_arithmetic", base=base, out=str(tmp_path / "t"), quiet=True)
    assert steps and all(step == 1000 for step in steps)  # other methods keep the pieces asked for


def test_slerp_dots_from_pieces_in_any_order_are_the_whole_tensors():
    """The pass's dot products do not depend on the order its pieces come in: block sums chosen so that a
    running float64 sum in one order or the other differs (1e20 + 1 - 1e20)."""
    from hubsoup.linalg import DOT_BLOCK
    from hubsoup.methods.slerp import _DOTS, _dots, _DotsPass

    a = torch.ones(3 * DOT_BLOCK)
    big = torch.full((DOT_BLOCK,), 1e20 / DOT_BLOCK)
    b = torch.cat([big, torch.zeros(DOT_BLOCK), -big])
    b[DOT_BLOCK] = 1.0
    base = torch.zeros_like(a)
    pieces = [slice(i * DOT_BLOCK, (i + 1) * DOT_BLOCK) for i in range(3)]
    results = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        p, q = _DotsPass(), _DotsPass()
        for j, i in enumerate(order):  # two lanes, each its share
            (p if j % 2 == 0 else q).update(None, base[pieces[i]], torch.stack([a[pieces[i]], b[pieces[i]]]))
        p.join(q)
        stats = {}
        p.finish(stats)
        results.append(stats[_DOTS])
    whole = _dots(a, b)
    assert all(r == whole for r in results) and whole[2] == 1.0


def test_default_pieces_and_a_dtype_change(models, used, monkeypatch, tmp_path):
    base, fts = models
    ours = hubsoup.merge(fts, method="task_arithmetic", base=base, out=str(tmp_path / "p"), quiet=True,
                         dtype="float16")
    assert all(used)
    _dense(monkeypatch)
    ref = hubsoup.merge(fts, method="task_arithmetic", base=base, out=str(tmp_path / "d"), quiet=True,
                        dtype="float16")
    got, want = state(ours.path), state(ref.path)
    assert {v.dtype for v in got.values() if v.is_floating_point()} == {torch.float16}
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("method, params", [
    ("dare", {"then": "sum"}),  # the paper convention: peft's mask, one stream over the whole tensor
    ("ties", {"convention": "mergekit"}),  # exactly top-k per row
])
def test_methods_needing_the_whole_tensor_keep_the_dense_path(models, used, tmp_path, method, params):
    base, fts = models
    ins = fts[:2] if method == "slerp" else fts
    hubsoup.merge(ins, method=method, base=base, out=str(tmp_path / "t"), quiet=True, **params)
    assert not any(used)


def _poison(folder: str, name: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    sd = load_file(path)
    sd[name] = sd[name].clone()
    sd[name].view(-1)[3] = value
    save_file(sd, path, metadata={"format": "pt"})


def test_a_nan_input_is_named_and_nothing_is_written(models, small_pieces, used, tmp_path):
    base, fts = models
    bad = make_finetune(base, str(tmp_path / "bad"), seed=99)
    name = "model.layers.0.mlp.up_proj.weight"
    _poison(bad, name, float("nan"))
    out = tmp_path / "o"
    with pytest.raises(NonFiniteTensorError, match=rf"input '.*bad.*': tensor '{name}' has 1 NaN/inf"):
        hubsoup.merge([fts[0], bad], method="task_arithmetic", base=base, out=str(out), quiet=True)
    assert False in used  # the in-pieces result was refused; the dense path named the input
    assert not out.exists()


def test_an_output_overflow_is_named(models, tmp_path):
    base, fts = models
    with pytest.raises(NonFiniteTensorError, match="overflows float16"):
        hubsoup.merge(fts, method="task_arithmetic", base=base, out=str(tmp_path / "o"), quiet=True,
                      dtype="float16", scale=1e7)
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """Float32 weights on a coarse grid (exact arithmetic) whose task vectors cancel exactly at a stripe of
    entries (τ₁ = q, τ₂ = -q, τ₃ = 0: the elected sign is the tensor's majority) and agree elsewhere,
    negative in the MLP tensors (majority -1), positive in the others (+1)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("tied")
    base = make_base("llama", str(root / "base"), dtype=torch.float32)
    path = os.path.join(base, "model.safetensors")
    sd = {k: (torch.round(v * 16) / 16 if v.is_floating_point() else v) for k, v in load_file(path).items()}
    save_file(sd, path, metadata={"format": "pt"})
    fts = []
    for i in range(3):
        ft = make_finetune(base, str(root / f"ft{i}"), seed=i, scale=0.0)
        out = {}
        for k, v in sd.items():
            tau = torch.full(v.shape, (-1.0 if ".mlp." in k else 1.0) / 64)
            flat = tau.view(-1)
            flat[::7] = (0.5, -0.5, 0.0)[i]  # the stripe: rows summing to 0, not all 0
            out[k] = v + tau if v.is_floating_point() else v
        save_file(out, os.path.join(ft, "model.safetensors"), metadata={"format": "pt"})
        fts.append(ft)
    return base, fts


@pytest.mark.parametrize("method, params", [
    ("ties", {"scope": "tensor", "density": 1.0}),
    ("ties", {"scope": "tensor", "density": 0.6}),
    ("ties", {"density": 0.6, "weights": [1.0, 0.5, 2.0]}),
    ("ties", {"scope": "tensor", "density": 1.0, "weights": [0.0, 1.0, 1.0]}),  # the tie's +1 row weighs 0
    ("lwptv", {"base_method": "ties", "scope": "tensor", "density": 1.0, "eta": 0.0}),  # TIES' pass, masked
    ("lines", {"base_method": "ties", "scope": "tensor", "density": 1.0}),  # TIES' pass, under layer scaling
])
def test_the_majority_sign_learned_in_the_merge_sweep(tied, small_pieces, lanes, used, monkeypatch, tmp_path,
                                                     method, params):
    """TIES learns each tensor's majority sign in its merge sweep, merging with +1 first (every lane on
    its own tally): the tensors whose majority is -1 merge again the pieces that used it, and only
    those, in lanes too; the result is the dense path's."""
    from hubsoup.engine import TensorWork
    from hubsoup.engine.lanes import Shared

    n_lanes = lanes
    base, fts = tied
    again, seen = [], []
    real = TensorWork.pieces

    def spying(self, multiple=1):
        sweep = real(self, multiple)
        if sweep is None:
            return None

        def wrapped(only=None):
            some = only.starts if isinstance(only, Shared) else only
            # not a whole sweep (its queue hands out every start): merged again, once per queue (or set)
            if some is not None and some is not sweep.starts and not any(q is only for q in seen):
                seen.append(only)  # kept alive: a freed queue's id could come back
                again.append((self.name, len(some), isinstance(only, Shared)))
            return sweep(only)
        wrapped.starts = sweep.starts
        return wrapped

    monkeypatch.setattr(TensorWork, "pieces", spying)
    ours = hubsoup.merge(fts, method=method, base=base, out=str(tmp_path / "pieces"), quiet=True, **params)
    assert used and all(used)
    names = {n for n, _, _ in again}
    assert names and all(".mlp." in n for n in names)
    assert {n for n in state(base) if ".mlp." in n and n.endswith("weight")} <= names
    assert all(k >= 2 for _, k, _ in again)  # every piece of a stripe-holding tensor (pieces of 1000 entries)
    assert all(queued == (n_lanes > 1) for _, _, queued in again)  # merged again in lanes too
    monkeypatch.setattr(TensorWork, "pieces", real)
    _dense(monkeypatch)
    ref = hubsoup.merge(fts, method=method, base=base, out=str(tmp_path / "dense"), quiet=True, **params)
    got, want = state(ours.path), state(ref.path)
    mlp = next(k for k in want if ".mlp." in k)
    assert float(want[mlp].view(-1)[0] - state(base)[mlp].view(-1)[0]) < 0  # the stripe took the -1
    for k in want:
        assert torch.equal(got[k], want[k]), k


class _PositiveShare:
    """A per-tensor pass that counts τ₀'s positive entries; it does not fork, so one thread feeds it."""

    piecewise = False
    during_merge = False

    def __init__(self, threads: set):
        self.threads, self.positive, self.total = threads, 0, 0

    def fork(self):
        return None

    def update(self, ctx, base, deltas):
        self.threads.add(threading.get_ident())
        self.positive += int((deltas[0] > 0).sum())
        self.total += deltas[0].numel()

    def finish(self, stats):
        stats["share"] = self.positive / self.total


def test_a_pass_that_does_not_fork_is_fed_from_one_thread(models, small_pieces, lanes, used, monkeypatch, tmp_path):
    """A method's own per-tensor pass without ``fork`` sees every piece from one thread while its merge runs in
    the lanes; the result is the dense path's, bit for bit."""
    from dataclasses import dataclass

    from hubsoup.methods import Method, _base, param, register

    monkeypatch.setattr(_base, "_REGISTRY", dict(_base._REGISTRY))  # the test's method leaves with the test
    fed, merged_in = set(), set()

    @dataclass
    class ShareParams:
        scale: float = param(1.0, "λ", range=(None, None))

    @register
    class PositiveShareMean(Method):
        name = "test_positive_share"
        summary = "mean task vector times the share of τ₀'s positive entries (a test of the pass contract)"
        Params = ShareParams

        def tensor_passes(self, params, n_inputs):
            return [_PositiveShare(fed)]

        def merge(self, base, deltas, params, ctx):
            merged_in.add(threading.get_ident())
            share = ctx.stats.get("share")
            if share is None:  # the dense path: the whole tensor at once
                share = int((deltas[0] > 0).sum()) / deltas[0].numel()
            return deltas.mean(dim=0).mul_(share * params.scale)

    base, fts = models
    ours = hubsoup.merge(fts, method="test_positive_share", base=base, out=str(tmp_path / "p"), quiet=True)
    assert used and all(used)
    assert len(fed) == 1 and (len(merged_in) == 1 if lanes == 1 else len(merged_in) > 1)
    _dense(monkeypatch)
    ref = hubsoup.merge(fts, method="test_positive_share", base=base, out=str(tmp_path / "d"), quiet=True)
    got, want = state(ours.path), state(ref.path)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_lanes_leave_the_callers_torch_threads_alone():
    """Lane threads run torch at one intra-op thread; the caller's setting, and the default a thread started
    later takes up, stay what they were (an app merging in several threads at once)."""
    from hubsoup.engine import lanes as module

    before = torch.get_num_threads()
    got = module.run(lambda j: (torch.get_num_threads(), threading.current_thread() is threading.main_thread()), 2)
    assert got == [(1, False), (1, False)]
    later = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert torch.get_num_threads() == before and later == [before]
    with pytest.raises(ZeroDivisionError):  # a lane's failure reaches the caller
        module.run(lambda j: 1 / j, 2)


def test_lanes_in_a_forked_child(tmp_path):
    """A process forked after the lanes' threads started (a web server's workers, a dataset map) sweeps in
    lanes of its own instead of waiting for threads that do not exist there."""
    import multiprocessing

    from hubsoup.engine import lanes as module

    assert module.run(lambda j: j, 2) == [0, 1]  # the parent's lane threads exist
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(module.run, (abs, 2)).get(timeout=60) == [0, 1]


def test_shared_pieces_go_to_one_lane_each():
    """Lanes taking pieces from one queue get every piece exactly once between them."""
    from hubsoup.engine import lanes as module

    starts = range(0, 50_000, 7)
    queue = module.Shared(starts)

    def take(j):
        got = []
        for s in queue:
            got.append(s)
            torch.ones(64).sum()  # let the other lane in
        return got

    a, b = module.run(take, 2)
    assert sorted(a + b) == list(starts) and not set(a) & set(b)
