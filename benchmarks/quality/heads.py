"""One frozen linear head per task, trained on the frozen pre-trained encoder.

The protocol of the merging papers' CLIP experiments, where each task's classifier is the
zero-shot text-embedding head, fixed before any fine-tuning: here each task's head is a
multinomial logistic regression on MiniLM's mean-pooled output over a few labelled examples
per class (``PER_CLASS`` = 32, the first ones of the shuffled train split; features
standardised, L2 chosen on the validation split, standardisation folded back into the
weights). Like a CLIP zero-shot head, it is built from little task information, so that it
leaves room for fine-tuning the encoder: a head fitted on the whole train split (a full
linear probe) is already within a few points of what a fine-tune reaches on these tasks. The head is then frozen: the fine-tunes train the encoder under it, and every
encoder (zero-shot base, fine-tune, merge) is scored on a task with that task's head, so the
accuracies of different encoders are comparable.

Heads are written to ``benchmarks/.work/quality/heads/TASK.safetensors`` (``weight`` [C, H],
``bias`` [C], metadata ``pooling=mean`` and ``labels``), the format ``hubsoup.eval`` reads.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.quality import data, debian  # noqa: E402
from hubsoup.demo import train  # noqa: E402
from hubsoup.demo.data import TaskData  # noqa: E402

HEADS_DIR = os.path.join(data.WORK, "heads")
MAX_LENGTH = 64
PER_CLASS = 32


def head_path(task: str) -> str:
    return os.path.join(HEADS_DIR, f"{task}.safetensors")


def build(tasks: dict[str, TaskData], base_dir: str, log=print, force: bool = False) -> dict[str, dict]:
    """Train (or read the cached) heads; returns task -> head statistics."""
    stamp = os.path.join(HEADS_DIR, "heads.json")
    fp = debian.fingerprint(sorted((n, t.labels, t.splits["train"], t.splits["validation"]) for n, t in tasks.items()),
                            os.path.getsize(os.path.join(base_dir, "model.safetensors")), MAX_LENGTH, PER_CLASS)
    if not force and os.path.isfile(stamp):
        with open(stamp, encoding="utf-8") as f:
            cached = json.load(f)
        if cached.get("fingerprint") == fp and all(os.path.isfile(head_path(n)) for n in tasks):
            return cached["heads"]
    stats = train.train_heads(base_dir, tasks, {n: head_path(n) for n in tasks}, per_class=PER_CLASS,
                              max_length=MAX_LENGTH, tag=True, log=log)
    with open(stamp, "w", encoding="utf-8") as f:
        json.dump({"fingerprint": fp, "heads": stats}, f, indent=2)
    return stats
