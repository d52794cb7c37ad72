"""Runs a plan: statistics passes, then block by block, tensor by tensor, the merge.

The engine knows no method by name. For each tensor it loads the base and every
input's task vector onto the block's device (stacked, float32), asks the method for
the merged task vector, adds it to the base, casts to the output dtype and hands it
to the writer. Only one tensor's worth of data per input is alive at a time, so peak
memory is about (inputs + 2) × the largest tensor, whatever the number of layers.
Two shortcuts skip the stack (``hubsoup.lowrank``): a tensor no input changes (e.g. one
no LoRA adapts) is the base's, and a linear method on LoRA inputs adds base + P @ Q
from the inputs' stacked factors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from hubsoup.errors import NonFiniteTensorError
from hubsoup.lowrank import merge_without_stack
from hubsoup.methods.base import Method, TensorContext
from hubsoup.plan import Block, Plan, TensorEntry
from hubsoup.sources.checkpoint import Checkpoint
from hubsoup.sources.deltas import all_finite

log = logging.getLogger(__name__)


class DeltaSource(Protocol):
    label: str

    def delta_into(self, out: torch.Tensor, name: str, base: torch.Tensor) -> None: ...


@dataclass
class Job:
    plan: Plan
    base: Checkpoint
    inputs: list[DeltaSource]
    method: Method
    params: Any
    recipe_hash: str


def _load(job: Job, block: Block, entry: TensorEntry) -> tuple[torch.Tensor, torch.Tensor]:
    base = job.base.tensor(entry.name).to(block.device, torch.float32)
    if not all_finite(base):
        raise NonFiniteTensorError(f"base '{job.base.label}': tensor '{entry.name}' has NaN/inf values")
    deltas = torch.empty((len(job.inputs), *base.shape), dtype=torch.float32, device=block.device)
    for src, row in zip(job.inputs, deltas):
        src.delta_into(row, entry.name, base)
    return base, deltas


def _release(job: Job) -> None:
    """Unmap every weight file after a block (see :meth:`Checkpoint.release`)."""
    job.base.release()
    for src in job.inputs:
        ckpt = getattr(src, "ckpt", None)
        if ckpt is not None and hasattr(ckpt, "release"):
            ckpt.release()


def _context(job: Job, block: Block, entry: TensorEntry, stats: dict) -> TensorContext:
    return TensorContext(entry.name, block.info, len(job.inputs), stats, job.recipe_hash)


def run(job: Job, writer, out_dtype: torch.dtype | None = None, quiet: bool = False) -> dict[str, Any]:
    """Execute ``job`` into ``writer``; returns the statistics the method gathered."""
    stats = gather_stats(job, quiet)
    for block in tqdm(job.plan.blocks, desc=f"merging ({job.method.name})", unit="block", disable=quiet):
        for entry in block.tensors:
            if not entry.mergeable:
                out = job.base.tensor(entry.name)  # integer buffers, masks: the base's, untouched
            elif (fast := merge_without_stack(job, block, entry)) is not None:
                out = fast.to(out_dtype or entry.dtype)  # untouched, or linear method on LoRA factors
                del fast
            else:
                base, deltas = _load(job, block, entry)
                merged = job.method.merge(base, deltas, job.params, _context(job, block, entry, stats))
                del deltas
                out = merged.add_(base).to(out_dtype or entry.dtype)
                del base, merged
            for name in (entry.name, *entry.aliases):
                writer.write(name, out)
            del out
        _release(job)
    return stats


def gather_stats(job: Job, quiet: bool = False) -> dict[str, Any]:
    """The method's statistics passes (streaming the model once per pass); returns the statistics."""
    # the plan's stacks (name -> number of blocks), for methods that treat stacks differently (LiNeS)
    stats: dict[str, Any] = {"plan.stacks": {b.info.stack: b.info.num_layers for b in job.plan.blocks if b.info}}
    stats.update(job.method.prepare(job.params, job, quiet=quiet))  # e.g. exemplar features (LOT)
    passes = job.method.passes(job.params, len(job.inputs))
    mergeable = [(b, e) for b, e in job.plan.entries() if e.mergeable]
    for i, p in enumerate(passes):
        previous = None
        for block, entry in tqdm(mergeable, desc=f"statistics pass {i + 1}/{len(passes)}", unit="tensor",
                                 disable=quiet, leave=False):
            if previous is not None and block is not previous:
                _release(job)
            previous = block
            base, deltas = _load(job, block, entry)
            p.update(_context(job, block, entry, stats), base, deltas)
            del base, deltas
        _release(job)
        p.finish(stats)
    return stats
