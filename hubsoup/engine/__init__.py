"""The one streaming engine: every walk over a model's tensors goes through :func:`stream`.

A :class:`Job` is a plan (the base's tensors grouped into blocks, in forward order),
the base checkpoint and the inputs' task vectors, and optionally a method. The engine
knows no method by name and no output format:

* :func:`stream` is the one cursor over the plan. It yields a :class:`TensorWork` per
  tensor — the one place that loads the base tensor (float32, on the block's device,
  checked for NaN/inf), the inputs' task vectors (one, or the ``(N, *shape)`` stack)
  and their low-rank factors — and unmaps every weight file after each block, so
  resident memory stays at about (N + 2) × the largest tensor whatever the depth.
* :meth:`TensorWork.merge` applies the method through the single fast-path policy
  (:mod:`hubsoup.engine.lowrank`): a tensor no input changes is left alone, linear
  methods on LoRA inputs work on the stacked factors, methods with their own low-rank
  path get the factors, everything else gets the dense stack.
* :func:`run` = the method's statistics passes (:func:`gather_stats`, each one a
  :func:`stream`), then one output pass handing every tensor's outcome to a **sink**
  (:mod:`hubsoup.output`: a full checkpoint, a LoRA adapter). Workflows with state of
  their own (continual merging) and data-aware preparation (LOT's expert capture)
  consume :func:`stream` directly, so they get the same loading, checks and unmapping.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Hashable, Iterator, Mapping, Protocol, Sequence

import torch
from tqdm.auto import tqdm

from hubsoup.engine import hostfeed as host_feed
from hubsoup.engine import lanes, prefetch
from hubsoup.engine import shared as shared_statistics
from hubsoup.engine.lowrank import (Copy, Dense, LowRank, Outcome, Unchanged, Weights, decide, piece_size,
                                    reads_base, tensor_position)
from hubsoup.errors import NonFiniteTensorError
from hubsoup.hubclient import Token
from hubsoup.methods import InputInfo, Method, PrepareContext, TensorContext
from hubsoup.plan import Block, Plan, TensorEntry
from hubsoup.progress import Monitor, shared_segment
from hubsoup.sources import remote
from hubsoup.sources.access import current as current_access
from hubsoup.sources.checkpoint import Checkpoint, peeking
from hubsoup.sources.taskvector import TaskVector, all_finite, byte_ranges, checkpoint, nonfinite_input, stored_name

log = logging.getLogger(__name__)

__all__ = ["Job", "TensorWork", "Sink", "stream", "gather_stats", "run", "remote_bytes",
           "Outcome", "Copy", "Unchanged", "LowRank", "Dense", "Weights"]


@dataclass
class Job:
    """What to stream: a plan over the base's tensors, the base, the inputs; the method, if merging."""

    plan: Plan
    base: Checkpoint
    inputs: Sequence[TaskVector]
    method: Method[Any] | None = None
    params: Any = None
    recipe_hash: str = ""
    quiet: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    """Results of the method's statistics passes (filled by :func:`gather_stats`)."""
    monitor: Monitor = field(default_factory=Monitor)
    """Progress and cancellation (:mod:`hubsoup.progress`): checked per tensor, stepped per block."""
    donors: Sequence[Checkpoint] = ()
    """Other checkpoints a layout's entries read θ₀ from (:attr:`hubsoup.plan.TensorSource.origin`)."""
    prefetch: bool | None = None
    """Read the next block ahead while this one is computed (:mod:`hubsoup.engine.prefetch`);
    None: ``HUBSOUP_PREFETCH`` (default on). Never changes a result."""
    device_map: Any = None
    """The merge's ``device_map`` / ``max_memory`` options, for methods that run the model (LOT's experts)."""
    max_memory: Any = None
    scratch: str | None = None
    """Where :meth:`Method.prepare` may put large temporary files (inside the output's temporary folder)."""
    shared_stats: bool = False
    """The statistics belong to a :func:`hubsoup.engine.shared.shared_statistics` block, which finishes them."""
    lanes: int | None = None
    """Threads sweeping a tensor's pieces (:mod:`hubsoup.engine.lanes`); None: torch's intra-op threads.
    Never changes a result."""
    skip_output: frozenset[str] = frozenset()
    """Plan entries (by name) whose outcome the sink does not need: :func:`run`'s output pass neither loads nor
    merges them (e.g. a resumed push's shards already on the Hub). The statistics passes still read them."""
    read_ahead: int | None = None
    """Bytes a stream fetches ahead of the merge from Hub inputs read in place (:class:`hubsoup.sources.remote.Window`);
    None: the run's ``read_ahead`` (:mod:`hubsoup.sources.access`), else 256 MiB. Never changes a result."""
    resolved: Mapping[str, Any] | None = None
    """Every mergeable tensor's parameters, resolved once by the session (:func:`hubsoup.engine.lowrank.resolve_all`);
    None: each is resolved when the merge reaches it. Never changes a result."""
    token: Token = field(default=None, repr=False)
    """The run's Hub token, handed to :meth:`Method.prepare` (:attr:`PrepareContext.token`). Never shown."""

    @functools.cached_property
    def adapters(self) -> bool:
        """Every input is a LoRA adapter: what :attr:`TensorContext.adapters` tells the method."""
        return bool(self.inputs) and all(t.kind == "lora" for t in self.inputs)

    def need_method(self) -> Method[Any]:
        """The method merging: a job without one is streamed (:func:`stream`), never merged."""
        if self.method is None:
            raise ValueError("this job has no method: it can be streamed, not merged")
        return self.method

    def release(self) -> None:
        """Unmap every weight file (see :meth:`Checkpoint.release`)."""
        self.base.release()
        for src in self.inputs:
            src.release()
        for ckpt in self.donors:
            ckpt.release()


Piece = tuple[int, int, torch.Tensor, torch.Tensor]
"""``(start, k, base, stack)``: the float32 base piece θ₀[start:start + k] of the flattened tensor and the
``(N, k)`` stack of τᵢ over it."""


class PieceSweep:
    """A tensor swept in pieces: calling it iterates the :data:`Piece` s, recomputed from the stored bytes on every
    call (buffers reused: consume each before the next; each call has buffers of its own).

    ``only``: the pieces starting at these offsets (a collection, swept in order; or a
    :class:`~hubsoup.engine.lanes.Shared` queue that concurrent sweeps take pieces from), no others.
    ``starts``: every piece's offset.
    """

    def __init__(self, flat_base: torch.Tensor, flats: list[torch.Tensor], step: int) -> None:
        self.flat_base, self.flats, self.step = flat_base, flats, step
        self.starts = range(0, flat_base.numel(), step)

    def __call__(self, only: lanes.Shared | Collection[int] | None = None) -> Iterator[Piece]:
        flat_base, flats, step = self.flat_base, self.flats, self.step
        numel, n = flat_base.numel(), len(flats)
        b, stack = torch.empty(step), torch.empty((n, step))
        for start in self.starts if only is None else only if isinstance(only, lanes.Shared) else sorted(only):
            k = min(step, numel - start)
            if k != b.numel():  # the last piece: contiguous buffers of its own size
                b, stack = torch.empty(k), torch.empty((n, k))
            b.copy_(flat_base[start:start + k])
            for i, r in enumerate(flats):  # τᵢ = θᵢ − θ₀ in float32, as delta_into (a mixed-dtype sub is slower)
                stack[i].copy_(r[start:start + k]).sub_(b)
            yield start, k, b, stack


class TensorWork:
    """One tensor of the plan on its way through the engine; loads lazily, at most once."""

    def __init__(self, job: Job, block: Block, entry: TensorEntry, feed: host_feed.Feed | None = None):
        self.job, self.block, self.entry = job, block, entry
        self.feed = feed
        """The host feed to the block's device (:mod:`hubsoup.engine.hostfeed`); None on the CPU."""
        self._base: torch.Tensor | None = None
        self._factors: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
        self._factors_loaded = False

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def device(self) -> str:
        return self.block.device

    def context(self) -> TensorContext:
        """What the method may know about this tensor."""
        return TensorContext(self.name, self.block.info, len(self.job.inputs), self.job.stats,
                             self.job.recipe_hash, dtype=self.entry.dtype,
                             adapters=self.job.adapters)

    @property
    def position(self) -> float:
        """The tensor's gradient position t for per-layer schedules (:func:`~hubsoup.engine.lowrank.tensor_position`)."""
        return tensor_position(self.block, self.entry)

    def _input_name(self, i: int) -> str | None:
        """Input ``i``'s name of this tensor (a layout renumbers layers; None: τᵢ = 0 here)."""
        src = self.entry.source
        return self.name if src is None else src.inputs[i]

    def _base_checkpoint(self) -> Checkpoint:
        src = self.entry.source
        return self.job.base if src is None or src.origin < 0 else self.job.donors[src.origin]

    def raw_base(self) -> torch.Tensor:
        """The base tensor as stored (its dtype, on the CPU; it may share the file's memory map)."""
        src = self.entry.source
        return self._base_checkpoint().tensor(self.name if src is None else src.base)

    def base(self) -> torch.Tensor:
        """The base tensor in float32 on the block's device, checked for NaN/inf. Never modify it."""
        if self._base is None:
            src = self.entry.source
            name, label = self.name if src is None else src.base, self._base_checkpoint().label

            def error(_: int = 0) -> NonFiniteTensorError:
                return NonFiniteTensorError(f"base '{label}': tensor '{name}' has NaN/inf values")

            if self.feed is not None:  # the stored bytes to the device, converted and checked there
                t = self.feed.load(self.raw_base(), _stored_range(self._base_checkpoint(), name)).to(torch.float32)
                self.feed.check(host_feed.nonfinite_count(t), error)
            else:
                t = self.raw_base().to(self.device, torch.float32)
                if not all_finite(t):
                    raise error()
            self._base = t
        return self._base

    def settle(self) -> None:
        """Raise now if a load so far failed its check (on a device the checks are read back a tensor
        later, see :mod:`hubsoup.engine.hostfeed`; on the CPU they were made at once: nothing to do)."""
        if self.feed is not None:
            self.feed.settle()

    def delta_into(self, i: int, out: torch.Tensor) -> torch.Tensor:
        """Input ``i``'s task vector into ``out`` (float32, the base's shape, on the block's device)."""
        name = self._input_name(i)
        if name is None:
            return out.zero_()
        src = self.job.inputs[i]
        if self.feed is not None:  # a full fine-tune's stored bytes to the device: τ = θ − θ₀ there
            stored = src.weights(name, tuple(self.entry.shape))
            if stored is not None:
                where = stored_name(src, name)
                out.copy_(self.feed.load(stored, _stored_range(checkpoint(src), where)))
                label = src.label
                self.feed.check(host_feed.nonfinite_count(out), lambda bad: nonfinite_input(label, where, bad))
                return out.sub_(self.base())
        src.delta_into(out, name, self.base())
        return out

    def deltas(self) -> torch.Tensor:
        """Every input's task vector, stacked: a new float32 ``(N, *shape)`` tensor the caller owns."""
        base = self.base()
        out = torch.empty((len(self.job.inputs), *base.shape), dtype=torch.float32, device=self.device)
        for i, row in enumerate(out):
            self.delta_into(i, row)
        return out

    def expert(self, i: int) -> torch.Tensor:
        """θ₀ + τᵢ: input ``i``'s own weights for this tensor (a new float32 tensor)."""
        return self.delta_into(i, torch.empty_like(self.base())).add_(self.base())

    def input_weights(self) -> list[torch.Tensor] | None:
        """Every input's θᵢ for this tensor as stored (CPU, unchecked), or None if one input does not
        hold it whole with the base's shape (a LoRA, a layout gap, a resized vocabulary)."""
        out = []
        for i, src in enumerate(self.job.inputs):
            name = self._input_name(i)
            t = None if name is None else src.weights(name, tuple(self.entry.shape))
            if t is None:
                return None
            out.append(t)
        return out

    def pieces(self, multiple: int = 1) -> PieceSweep | None:
        """A sweep over this tensor in pieces (their starts multiples of ``multiple`` entries), or None if an
        input does not hold it whole (or the block is not on the CPU): see :class:`PieceSweep`."""
        if self.feed is not None or torch.device(self.device).type != "cpu":  # a device's merge is whole-tensor
            return None
        raws = self.input_weights()
        if raws is None:
            return None
        flat_base, flats = self.raw_base().reshape(-1), [r.reshape(-1) for r in raws]
        step = -(-piece_size(len(raws)) // multiple) * multiple
        return PieceSweep(flat_base, flats, step)

    def byte_ranges(self, *, base: bool = True) -> list[tuple[str, int, int]]:
        """Where this tensor's bytes lie, the base's (unless not ``base``) and every input's: on disk (the
        read-ahead's hint), or in a Hub file read in place (:func:`hubsoup.sources.remote.is_key`)."""
        src = self.entry.source
        out = list(self._base_checkpoint().byte_ranges([self.name if src is None else src.base])) if base else []
        for i, s in enumerate(self.job.inputs):
            name, ranges = self._input_name(i), byte_ranges(s)
            if name is not None and ranges is not None and s.touches(name):
                out += ranges(name)
        return out

    def untouched(self) -> bool:
        """True when every input says it leaves this tensor unchanged (τ = 0), without reading it."""
        return not any(n is not None and src.touches(n) for src, n in
                       ((s, self._input_name(i)) for i, s in enumerate(self.job.inputs)))

    def input_factors(self) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        """Per input, ``(P, Q)`` with τᵢ = P Q on the block's device (None: τᵢ = 0); None if one is not low-rank."""
        if not self._factors_loaded:
            self._factors, self._factors_loaded = self._load_factors(), True
        return self._factors

    def _load_factors(self) -> list[tuple[torch.Tensor, torch.Tensor] | None] | None:
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        for i, src in enumerate(self.job.inputs):
            name = self._input_name(i)
            if name is None or not src.touches(name):
                out.append(None)
                continue
            f = src.factors(name)
            if f is None:
                return None
            p, q = f[0].to(self.device), f[1].to(self.device)
            if not (all_finite(p) and all_finite(q)):
                raise NonFiniteTensorError(f"input '{src.label}': the LoRA factors of '{self.name}' have NaN/inf "
                                           "values; the adapter is broken and cannot be merged")
            out.append((p, q))
        return out

    def merge(self, *, lowrank_ok: bool = True, weights_dtype: torch.dtype | None = None) -> Outcome:
        """This tensor's merged task vector, by the job's method (see :mod:`hubsoup.engine.lowrank`).

        ``lowrank_ok``: the consumer can take a :class:`LowRank` outcome, or a method's
        own low-rank path, for this tensor (a LoRA sink cannot for a module it cannot adapt).
        ``weights_dtype``: the consumer can take the merged weights themselves in this dtype
        (a :class:`Weights` outcome, computed in cache-sized pieces where the method allows).
        """
        return decide(self, lowrank_ok=lowrank_ok, weights_dtype=weights_dtype)


def _stored_range(ckpt: Any, name: str) -> tuple[str, int, int] | None:
    """Where tensor ``name``'s bytes lie in its file, when what :meth:`Checkpoint.tensor` returns is exactly
    those bytes: a plain checkpoint's safetensors tensor (a re-mapped vocabulary or a model+adapter makes
    its tensors: None, and the feed copies what they make; a pickle file has no range)."""
    if type(ckpt) is not Checkpoint:
        return None
    ranges = ckpt.byte_ranges([name])
    return ranges[0] if len(ranges) == 1 and not remote.is_key(ranges[0][0]) else None


class Sink(Protocol):
    """Where :func:`run` puts each tensor's outcome (see :mod:`hubsoup.output`)."""

    def accepts_lowrank(self, entry: TensorEntry) -> bool:
        """Whether a :class:`LowRank` outcome (τ = P Q, never formed) is welcome for ``entry``."""

    def weights_dtype(self, entry: TensorEntry) -> torch.dtype | None:
        """The dtype in which a :class:`Weights` outcome (θ itself, cast) is welcome for ``entry``;
        None: the sink wants τ."""

    def put(self, work: TensorWork, outcome: Outcome) -> None:
        """Take one tensor's outcome; called once per plan entry, in plan order."""


def stream(job: Job, *, mergeable_only: bool = False, desc: str = "", unit: str = "block",
           skip: Collection[str] = (), reads_base: Callable[[TensorWork], bool] | None = None
           ) -> Iterator[TensorWork]:
    """Every tensor of ``job.plan`` in forward order, unmapping weight files after each block.

    ``mergeable_only`` skips integer and boolean tensors (they are copied from the base); ``skip``, the
    entries of these names (nothing of them is read, not even ahead).
    ``unit="tensor"`` counts progress per tensor instead of per block. Hub files read in place are fetched
    ahead through one :class:`~hubsoup.sources.remote.Window` per stream, told which ranges each tensor reads:
    the base's unless ``reads_base`` (the consumer's own rule, e.g. the LoRA sink's) says it is not read.
    """
    blocks = job.plan.blocks
    if mergeable_only or skip:
        blocks = [b for b in blocks if any((e.mergeable or not mergeable_only) and e.name not in skip
                                           for e in b.tensors)]
    per_tensor = unit == "tensor"
    streamed = [[e for e in b.tensors if (e.mergeable or not mergeable_only) and e.name not in skip]
                for b in blocks]  # each block's
    total = sum(map(len, streamed)) if per_tensor else len(blocks)
    mon = job.monitor
    mon.segment(len(blocks), desc)  # this pass is the next segment of the caller's stage
    ahead = prefetch.ReadAhead() if prefetch.enabled(job.prefetch) else None
    feeds: dict[str, host_feed.Feed | None] = {}  # one per device the blocks are on; none for the CPU
    window = _window(job, blocks, streamed, reads_base)  # Hub files read in place: fetched ahead, in memory
    k = 0  # the tensor's index in this stream (the window's cursor)
    with tqdm(total=total, desc=desc, unit=unit, disable=job.quiet or not desc, leave=False) as bar, \
            (ahead or contextlib.nullcontext()), _closing(feeds), (window or contextlib.nullcontext()):
        for i, block in enumerate(blocks):
            # block i + 1 comes in while block i is computed; a device's feed reads its next tensor itself
            # (Feed.stage): a second copy of those bytes would only compete with it for the memory bus
            if ahead is not None and i + 1 < len(blocks) and torch.device(blocks[i + 1].device).type == "cpu":
                _read_ahead(ahead, job, blocks[i + 1], streamed[i + 1])
            if block.device not in feeds:
                feeds[block.device] = host_feed.for_device(block.device)
            fd = feeds[block.device]
            try:
                for j, entry in enumerate(streamed[i]):
                    mon.check()  # cancel: before every tensor
                    if window is not None:
                        window.at(k)
                    k += 1
                    if fd is None:
                        yield TensorWork(job, block, entry)
                    else:
                        seq = fd.next_tensor()
                        nxt = _next_on(blocks, streamed, i, j)
                        if nxt is not None:  # its bytes come in while this tensor is merged
                            _stage(fd, TensorWork(job, *nxt))
                        yield TensorWork(job, block, entry, fd)
                        fd.settle(seq - 1)  # the previous tensor's checks: the device has long done them
                    if per_tensor:
                        bar.update()
                if fd is not None:
                    fd.settle()  # a block's checks, before it counts as done
            finally:
                job.release()  # the device holds copies, never views of the mapped files
            if not per_tensor:
                bar.update()
            mon.step(f"{desc or 'pass'}: block {i + 1}/{len(blocks)}")
        if window is not None:
            window.finish()  # a file read whole that did not match its sha256 fails the run here


@contextlib.contextmanager
def _closing(feeds: dict[str, host_feed.Feed | None]) -> Iterator[None]:
    try:
        yield
    finally:
        for fd in feeds.values():
            if fd is not None:
                fd.close()


def _window(job: Job, blocks: Sequence[Block], streamed: list[list[TensorEntry]],
            reads_base: Callable[[TensorWork], bool] | None) -> remote.Window | None:
    """The read-ahead window over the Hub files this stream reads in place (None when it reads none)."""
    if not remote.any_open():
        return None
    reads = _remote_reads(job, blocks, streamed, reads_base)
    if not any(reads):
        return None
    budget = job.read_ahead or current_access().read_ahead or remote.DEFAULT_READ_AHEAD
    groups = list(itertools.accumulate(len(e) for e in streamed))  # where each block's tensors start
    return remote.Window(reads, budget, check=job.monitor.check, groups=[0, *groups[:-1]])


def remote_bytes(job: Job, reads_base: Callable[[TensorWork], bool] | None = None) -> int:
    """Bytes one pass over ``job.plan`` reads from Hub files read in place (each range once), without reading any:
    a plan's network figure (:func:`hubsoup.api.footprint`). Inputs whose weights would be downloaded count 0."""
    with peeking():
        reads = _remote_reads(job, job.plan.blocks, [list(b.tensors) for b in job.plan.blocks], reads_base)
    return sum(off + n - rf.fetch_from(off, n) for _, off, n, rf in
               {(rf.key, off, n): (rf.key, off, n, rf) for r in reads for rf, off, n in r}.values())


def _remote_reads(job: Job, blocks: Sequence[Block], streamed: list[list[TensorEntry]],
                  reads_base: Callable[[TensorWork], bool] | None) -> list[list[tuple[remote.RemoteFile, int, int]]]:
    """Per tensor of the stream, in its order: the ranges of Hub files read in place that its load reads."""
    reads: list[list[tuple[remote.RemoteFile, int, int]]] = []
    for block, entries in zip(blocks, streamed):
        for entry in entries:
            work = TensorWork(job, block, entry)
            try:
                ranges = work.byte_ranges(base=reads_base is None or reads_base(work))
            except Exception as e:  # the tensor's own read reports a real problem
                log.debug("no read-ahead for %s: %s", entry.name, e)
                ranges = []
            reads.append([(rf, off, n) for path, off, n in ranges  # bytes that came with a header need no fetch
                          if remote.is_key(path) and (rf := remote.lookup(path)) is not None
                          and not rf.in_prefix(off, n)])
    return reads


def _next_on(blocks: Sequence[Block], streamed: list[list[TensorEntry]], i: int,
             j: int) -> tuple[Block, TensorEntry] | None:
    """The tensor streamed after ``streamed[i][j]`` (block i's j-th), if it is on the same device."""
    if j + 1 < len(streamed[i]):
        return blocks[i], streamed[i][j + 1]
    if i + 1 < len(blocks) and blocks[i + 1].device == blocks[i].device and streamed[i + 1]:
        return blocks[i + 1], streamed[i + 1][0]
    return None


def _stage(fd: host_feed.Feed, work: TensorWork) -> None:
    """Start the host feed's reads of ``work``'s stored bytes (a hint, as :func:`_read_ahead`)."""
    try:
        fd.stage([r for r in work.byte_ranges() if not remote.is_key(r[0])])
    except Exception as e:  # the tensor's own load reports a real problem
        log.debug("staging %s skipped: %s", work.name, e)


def _read_ahead(ahead: prefetch.ReadAhead, job: Job, block: Block, entries: list[TensorEntry]) -> None:
    """Ask ``ahead`` for the bytes of ``block``'s streamed ``entries`` (a hint: a failure here never fails the merge)."""
    try:
        ahead.request([r for e in entries for r in TensorWork(job, block, e).byte_ranges() if not remote.is_key(r[0])])
    except Exception as e:  # the engine's own read of that block reports a real problem
        log.debug("read-ahead of block %s skipped: %s", block.name, e)


def gather_stats(job: Job) -> dict[str, Any]:
    """The method's preparation and statistics passes (one :func:`stream` each); fills ``job.stats``."""
    stats = job.stats
    # the plan's stacks (name -> number of blocks), for methods that treat stacks differently (LiNeS)
    stats["plan.stacks"] = {b.info.stack: b.info.num_layers for b in job.plan.blocks if b.info}
    shared, key = shared_statistics.current(), None
    if shared is not None:  # a search: an earlier point may have computed these already
        key = _stats_key(job)
        known = shared.get(key)
        if known is not None:
            stats.update(known)
            job.shared_stats = True
            return stats
    pctx = prepare_context(job)
    if shared is not None:  # what it keeps may serve later merges: kept where their folders are not
        pctx.shared = True
        pctx.scratch = shared.scratch or pctx.scratch
    method = job.need_method()
    stats.update(method.prepare(job.params, pctx))  # e.g. exemplar features (LOT)
    passes = method.passes(job.params, len(job.inputs))
    if passes:
        job.monitor.stage("statistics", f"{len(passes)} statistics pass(es)", parts=len(passes))
    for i, p in enumerate(passes):
        forks = lanes.forked(p, lanes.count(job.lanes)) if p.piecewise else [p]
        for work in stream(job, mergeable_only=True, unit="tensor", desc=f"statistics pass {i + 1}/{len(passes)}"):
            sweep = work.pieces() if p.piecewise else None
            if sweep is None:
                p.update(work.context(), work.base(), work.deltas())
                continue
            # a piecewise pass over full fine-tunes: no float32 stack, the pieces in lanes when p forks
            lanes.feed(forks, work.context(), sweep)
        for f in forks[1:]:
            p.join(f)
        p.finish(stats)
    if shared is not None:
        shared.put(key, method, job.params, stats)
        job.shared_stats = True
    return stats


def _stats_key(job: Job) -> tuple[Hashable, ...]:
    """What :func:`gather_stats` depends on: the method's own key, the inputs, the base and the placement."""
    method = job.need_method()
    return (method.name, method.stats_key(job.params), str(job.base.ref), tuple(str(s.ref) for s in job.inputs),
            tuple((b.name, str(b.device)) for b in job.plan.blocks), repr(job.device_map), repr(job.max_memory))


def prepare_context(job: Job) -> PrepareContext:
    """What :meth:`Method.prepare` may use: the base's folder, the inputs' names, the experts streamed."""
    names = {n: e.name for _, e in job.plan.entries() if e.mergeable for n in (e.name, *e.aliases)}

    def load_expert(i: int, assign: Callable[[str, torch.Tensor], None]) -> None:
        label = job.inputs[i].label
        if job.monitor.stage_name != "statistics":  # preparation streams the experts: part of the statistics
            job.monitor.stage("statistics", "loading the experts", parts=len(job.inputs))
        for work in stream(job, mergeable_only=True, desc=f"loading expert {i + 1} ({label})"):
            t = work.expert(i)
            for n in (work.name, *work.entry.aliases):
                assign(n, t)

    inputs = [InputInfo(s.label, s.ref.spec, s.ref.repo_id, None if s.ref.repo_id else s.ref.path)
              for s in job.inputs]
    device = job.plan.blocks[0].device if job.plan.blocks else "cpu"
    return PrepareContext(job.base.folder, job.base.label, inputs, device, names, load_expert, job.quiet,
                          device_map=job.device_map, max_memory=job.max_memory, scratch=job.scratch, token=job.token)


def _reads_base(job: Job, sink: Sink) -> Callable[[TensorWork], bool] | None:
    """Which tensors' base the output pass reads: all (None), unless the sink reads the base only where the merge
    does (``reads_base = False``, the LoRA sink): then :func:`hubsoup.engine.lowrank.reads_base` says."""
    if getattr(sink, "reads_base", True):
        return None

    def reads(work: TensorWork) -> bool:
        return reads_base(work, lowrank_ok=sink.accepts_lowrank(work.entry))

    return reads


def run(job: Job, sink: Sink) -> dict[str, Any]:
    """Merge ``job`` into ``sink``: statistics passes, then every tensor's outcome; returns the statistics.

    Blocks mapped to different devices (``Block.worker``) are merged concurrently, one worker
    thread per device, each taking its blocks in plan order; the sink takes one tensor at a
    time. Every tensor's outcome depends only on that tensor (and the statistics), so the
    output is the same bit for bit whatever the map and the interleaving.
    """
    stats = gather_stats(job)
    workers: dict[str, list[Block]] = {}
    for b in job.plan.blocks:
        workers.setdefault(b.worker or b.device, []).append(b)
    desc = f"merging ({job.need_method().name})"
    job.monitor.stage("merge", desc)
    reads_base = _reads_base(job, sink)
    if len(workers) <= 1:
        for work in stream(job, desc=desc, skip=job.skip_output, reads_base=reads_base):
            sink.put(work, work.merge(lowrank_ok=sink.accepts_lowrank(work.entry),
                                      weights_dtype=sink.weights_dtype(work.entry)))
        return stats

    lock, failed = threading.Lock(), threading.Event()
    job.monitor.segment(len(job.plan.blocks), desc)  # one segment, stepped by every worker

    def merge_blocks(blocks: list[Block]) -> None:
        # one lane per worker: the devices' workers already keep the cores busy
        sub = Job(Plan(blocks), job.base, job.inputs, job.method, job.params, job.recipe_hash, quiet=True,
                  stats=job.stats, monitor=shared_segment(job.monitor), donors=job.donors, prefetch=job.prefetch,
                  lanes=1, skip_output=job.skip_output, read_ahead=job.read_ahead, resolved=job.resolved,
                  token=job.token)
        try:
            for work in stream(sub, skip=sub.skip_output, reads_base=reads_base):
                if failed.is_set():  # another worker failed: stop at the next tensor
                    return
                outcome = work.merge(lowrank_ok=sink.accepts_lowrank(work.entry),
                                     weights_dtype=sink.weights_dtype(work.entry))
                with lock:  # the sink casts and writes one tensor at a time
                    sink.put(work, outcome)
        except BaseException:
            failed.set()
            raise

    with tqdm(total=len(workers), desc=f"{desc} on {len(workers)} devices", unit="device",
              disable=job.quiet, leave=False) as bar:
        with ThreadPoolExecutor(max_workers=len(workers), thread_name_prefix="hubsoup-merge") as pool:
            futures = [pool.submit(merge_blocks, blocks) for blocks in workers.values()]
            for f in futures:
                f.result()  # the first failure propagates (the others finish their current block)
                bar.update()
    return stats
