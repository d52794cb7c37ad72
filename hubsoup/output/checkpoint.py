"""The full-checkpoint output: the base's config and tokenizer files beside sharded safetensors."""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Callable

import torch

from hubsoup.engine import Copy, LowRank, Outcome, TensorWork, Unchanged, Weights
from hubsoup.engine.hostfeed import LOG_ENV, log_record
from hubsoup.errors import NonFiniteTensorError
from hubsoup.options import DTYPES
from hubsoup.output.shards import ShardedWriter, ShardHandoff
from hubsoup.plan import Plan, TensorEntry
from hubsoup.sources.checkpoint import Checkpoint

if TYPE_CHECKING:
    from hubsoup.engine.hostfeed import Pending

BASE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json")


def copy_base_files(base: Checkpoint, dest: str, tokenizer_only: bool = False) -> list[str]:
    """Copy the base's config, tokenizer and generation config into ``dest``; returns the names copied.

    Each file must lie inside the base's folder (its Hub cache folder for a Hub base): a
    ``tokenizer.json`` that is a link to a file of the machine is refused
    (:class:`~hubsoup.errors.UnsafePathError`, checked for every file before any is copied),
    so that it is never copied into the output and pushed.
    """
    wanted = [f for f in BASE_FILES
              if not (tokenizer_only and f in ("config.json", "generation_config.json"))]  # an adapter folder with
    # a config.json would look like a full model
    sources = {}
    for fname in wanted:
        if os.path.isfile(os.path.join(base.folder, fname)) or os.path.islink(os.path.join(base.folder, fname)):
            sources[fname] = base.file(fname)  # raises for a link leading out of the base's folder
    copied = []
    for fname, src in sources.items():
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dest, fname))
            copied.append(fname)
    return copied


def output_finite(t: torch.Tensor) -> bool:
    """True when ``t`` (an output tensor, after its cast) holds no NaN or infinity.

    One reduction (min and max together; NaN propagates through both), which, unlike the
    sum of :func:`hubsoup.sources.taskvector.all_finite`, cannot overflow: a float16 sum of
    finite values easily exceeds 65504, and summing into float32 instead is ten times slower.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_output_tensor(name: str, out: torch.Tensor, merged: torch.Tensor) -> None:
    """Refuse to write output tensor ``name``: ``out`` (cast) must be finite; ``merged`` is its float32 value.

    Raises :class:`~hubsoup.errors.NonFiniteTensorError` naming the tensor and why: the cast
    to a narrower dtype overflowed (and which ``--dtype`` to use), or the merge itself gave NaN/inf.
    Only a failing tensor pays for more than the one reduction of :func:`output_finite`.
    """
    if output_finite(out):
        return
    if out is not merged and merged.is_floating_point() and bool(torch.isfinite(merged).all()):
        dt = str(out.dtype).replace("torch.", "")
        peak = float(merged.abs().max())
        wider = "float32 or bfloat16" if out.dtype == torch.float16 else "float32"
        raise NonFiniteTensorError(
            f"output tensor '{name}' reaches {peak:.4g}, which overflows {dt} (max {torch.finfo(out.dtype).max:g}); "
            f"use --dtype {wider}")
    raise NonFiniteTensorError(
        f"output tensor '{name}' has NaN/inf values after merging (the inputs and parameters were finite: "
        "the merge overflowed float32 or divided by zero); nothing was written")


def _deferred_check(name: str, out: torch.Tensor, merged: torch.Tensor, bad: torch.Tensor) -> Callable[[], None]:
    """:func:`check_output_tensor` for a device's output, from a flag computed on the device: read when the
    output is written (the tensors are kept until then, for the message)."""

    def check() -> None:
        if bool(bad):
            check_output_tensor(name, out, merged)

    return check


def set_config_dtype(path: str, dtype: str) -> None:
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    name = str(DTYPES[dtype]).replace("torch.", "")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


DEVICE_WRITE_DEPTH = 4
"""Outputs of a device's merge queued for the writer at most (each a pinned buffer of one tensor)."""


class CheckpointSink:
    """A full ``save_pretrained`` checkpoint: θ₀ + τ of every tensor, cast and written in place.

    The base's config, tokenizer and generation config are copied into ``folder`` (the
    config's dtype set to ``dtype`` when given); the shard layout is fixed from the plan
    up front (:class:`~hubsoup.output.shards.ShardedWriter`), so no shard is held in memory.
    """

    def __init__(self, folder: str, plan: Plan, base: Checkpoint, *, dtype: str | None = None, shard_size: int,
                 metadata: dict[str, str] | None = None, handoff: ShardHandoff | None = None):
        self.out_dtype = DTYPES[dtype] if dtype else None
        entries = [(name, e.shape, self.out_dtype if (self.out_dtype and e.mergeable) else e.dtype)
                   for name, e in plan.output_entries()]
        # with a hand-off (a push streamed to the Hub) each shard goes on as soon as it is complete
        self.writer = ShardedWriter(folder, entries, shard_size, metadata=metadata, handoff=handoff)
        self.plan = plan
        self._pending: tuple[tuple[str, ...], Pending] | None = None  # names, Pending: a device's output on its way
        copied = copy_base_files(base, folder)
        if dtype is not None and "config.json" in copied:
            set_config_dtype(os.path.join(folder, "config.json"), dtype)

    def unneeded(self) -> frozenset[str]:
        """Plan entries whose every name lies in a shard already where it goes (``writer.mark_remote``): the
        engine need not compute them (:attr:`hubsoup.engine.Job.skip_output`)."""
        done = self.writer.remote_names()
        if not done:
            return frozenset()
        return frozenset(e.name for _, e in self.plan.entries() if all(n in done for n in (e.name, *e.aliases)))

    def accepts_lowrank(self, entry: TensorEntry) -> bool:
        return True

    def weights_dtype(self, entry: TensorEntry) -> torch.dtype:
        return self.out_dtype or entry.dtype

    def put(self, work: TensorWork, outcome: Outcome) -> None:
        entry = work.entry
        if isinstance(outcome, Copy):
            out = work.raw_base()  # integer buffers, masks: the base's, untouched
        elif isinstance(outcome, Weights):
            out = outcome.theta  # cast and checked by the engine
        else:
            if isinstance(outcome, Unchanged):
                merged = work.base()
            elif isinstance(outcome, LowRank):  # not in place: the base may share storage with the file
                merged = torch.addmm(work.base(), outcome.p, outcome.q)
            else:
                merged = outcome.tau.add_(work.base())
            out = merged.to(self.out_dtype or entry.dtype)
            if work.feed is not None:
                # back through the feed's pinned buffers; written (and checked) when the next tensor comes. Each
                # has a buffer of its own, so the writer may queue several: the device never waits for the disk
                self.writer.depth = DEVICE_WRITE_DEPTH
                self._flush()
                lo, hi = torch.aminmax(out) if out.numel() else (out.new_zeros(()), out.new_zeros(()))
                bad = ~(torch.isfinite(lo) & torch.isfinite(hi))
                pending = work.feed.back(out, check=_deferred_check(entry.name, out, merged, bad))
                self._pending = ((entry.name, *entry.aliases), pending)
                return
            check_output_tensor(entry.name, out, merged)  # after the cast: an overflow to inf is caught too
        self._flush()
        for name in (entry.name, *entry.aliases):
            self.writer.write(name, out)

    def _flush(self) -> None:
        """Write the device output still on its way (its copy done, its checks settled)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            host = pending[1].result()
            for name in pending[0]:
                self.writer.write(name, host)

    def close(self) -> None:
        self._flush()
        self.writer.close()
        log_path = os.environ.get(LOG_ENV)
        if log_path:  # the writer's share of a device merge's time (benchmarks/bench_gpu.py)
            log_record(log_path, {"writer": {"wait_s": round(self.writer.wait_s, 4),
                                             "close_s": round(self.writer.close_s, 4)}})

    def abort(self) -> None:
        self._pending = None
        self.writer.abort()
