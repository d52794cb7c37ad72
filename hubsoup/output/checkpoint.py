"""The full-checkpoint output: the base's config and tokenizer files beside sharded safetensors."""

from __future__ import annotations

import json
import os
import shutil

import torch

from hubsoup.engine import Copy, LowRank, Outcome, TensorWork, Unchanged
from hubsoup.options import DTYPES
from hubsoup.output.shards import ShardedWriter
from hubsoup.plan import Plan, TensorEntry
from hubsoup.sources.checkpoint import Checkpoint

_COPY_FROM_BASE = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja",
                   "chat_template.json", "preprocessor_config.json")


def copy_base_files(base: Checkpoint, dest: str, tokenizer_only: bool = False) -> list[str]:
    copied = []
    for fname in _COPY_FROM_BASE:
        if tokenizer_only and fname in ("config.json", "generation_config.json"):
            continue  # an adapter folder with a config.json would look like a full model
        src = os.path.join(base.folder, fname)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dest, fname))
            copied.append(fname)
    return copied


def set_config_dtype(path: str, dtype: str) -> None:
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    name = str(DTYPES[dtype]).replace("torch.", "")
    cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)


class CheckpointSink:
    """A full ``save_pretrained`` checkpoint: θ₀ + τ of every tensor, cast and written in place.

    The base's config, tokenizer and generation config are copied into ``folder`` (the
    config's dtype set to ``dtype`` when given); the shard layout is fixed from the plan
    up front (:class:`~hubsoup.output.shards.ShardedWriter`), so no shard is held in memory.
    """

    def __init__(self, folder: str, plan: Plan, base: Checkpoint, *, dtype: str | None = None, shard_size: int,
                 metadata: dict[str, str] | None = None):
        self.out_dtype = DTYPES[dtype] if dtype else None
        entries = [(name, e.shape, self.out_dtype if (self.out_dtype and e.mergeable) else e.dtype)
                   for name, e in plan.output_entries()]
        self.writer = ShardedWriter(folder, entries, shard_size, metadata=metadata)
        copied = copy_base_files(base, folder)
        if dtype is not None and "config.json" in copied:
            set_config_dtype(os.path.join(folder, "config.json"), dtype)

    def accepts_lowrank(self, entry: TensorEntry) -> bool:
        return True

    def put(self, work: TensorWork, outcome: Outcome) -> None:
        entry = work.entry
        if isinstance(outcome, Copy):
            out = work.raw_base()  # integer buffers, masks: the base's, untouched
        else:
            if isinstance(outcome, Unchanged):
                merged = work.base()
            elif isinstance(outcome, LowRank):  # not in place: the base may share storage with the file
                merged = torch.addmm(work.base(), outcome.p, outcome.q)
            else:
                merged = outcome.tau.add_(work.base())
            out = merged.to(self.out_dtype or entry.dtype)
        for name in (entry.name, *entry.aliases):
            self.writer.write(name, out)

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()
