#!/usr/bin/env python3
"""Per-domain validation curves on the decoder LM: a method's finer grid, scored domain by domain (issue 46).

A default must hold beyond the benchmark that chose it. SFTM's γ for LoRA adapters was chosen on the encoder's
validation (0.3); the LM's own search (``quality_lm.run``) scores a 3-point grid (γ 0.4 / 0.8 / 1.2) on 4
validation sequences per domain, too coarse and too few to say whether the LM agrees. This sweep merges every
point of a finer grid from the cached LM fine-tunes and scores it on the *whole* validation split of every
in-domain domain (16 sequences of 128 tokens each), next to the base and each fine-tune on its own domain, with
the encoder sweep's analysis (``benchmarks/quality/val_sweep.py``: the share of the fine-tunes' gain with its
paired-bootstrap interval, the domains a point makes worse than the base, the largest gain among the points
that harm none). Nothing here reads a test split.

    python -m benchmarks.quality_lm.val_sweep --kinds lora,full --rows SFTM

Merges from the cached fine-tunes (``python -m benchmarks.quality_lm.finetune``'s, no Hub server; the base
given explicitly); results in ``benchmarks/results/val_sweep_lm.json`` (a partial run adds to it) and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.quality_lm.base import WORK  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results")

# finer than the LM search's thinned grids, around the defaults in question
GRIDS = {
    "SFTM": ("sftm", {}, "gamma", {"lora": [0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6], "full": [0.4, 0.6, 0.8, 1.0, 1.2]}),
}


def analyse(out: dict) -> dict:
    """Per setting, row and grid point: the share of the fine-tunes' gain (pooled over the domains, as
    ``protocol.gain``) and each domain's change against the base in −log perplexity, with paired-bootstrap 95 %
    intervals over the validation sequences; ``harms``: the domains whose interval lies below 0 (the encoder
    sweep's table, :func:`benchmarks.quality.val_sweep.point_table`)."""
    from benchmarks.quality.val_sweep import point_table
    from benchmarks.quality_lm.run import to_scores

    return point_table(out, to_scores, lambda name: f"{name} fine-tunes")


def render(out: dict, table: dict) -> str:
    from benchmarks.quality.val_sweep import choose

    best = {}
    lines = ["# Per-domain validation curves (decoder LM)", "",
             "Written by `python -m benchmarks.quality_lm.val_sweep`. Each grid point merged from the cached "
             "fine-tunes and scored on the whole validation split of each in-domain domain (16 sequences of 128 "
             "tokens; never the test split). *gain*: share of the fine-tunes' gain in −log perplexity (pooled over "
             "the domains) with its paired-bootstrap 95 % interval; *worst domain*: the largest change against the "
             "base, in nats of −log perplexity; *harms*: domains whose interval of the change lies below 0.", ""]
    for name, rows in table.items():
        lines += [f"## {name}", "", "| row | value | gain | worst domain vs base | harms |", "|---|---|---|---|---|"]
        for label, pts in rows.items():
            key = out["settings"][name][label]["key"]
            for v, r in sorted(pts.items(), key=lambda kv: float(kv[0])):
                g = r["gain"]
                t, d = min(r["per_task"].items(), key=lambda kv: kv[1]["value"])
                lines.append(f"| {label} | {key}={v} | {g['value']:.3f} [{g['lo']:.3f}, {g['hi']:.3f}] | "
                             f"{t} {d['value']:+.3f} [{d['lo']:+.3f}, {d['hi']:+.3f}] | "
                             f"{', '.join(r['harms']) or '—'} |")
            best[(name, label)] = max(pts, key=lambda v: pts[v]["gain"]["value"])
        lines.append("")
    lines += ["## Chosen on validation", "",
              "The largest gain among the points that harm no domain (a tie: the smaller value); the largest gain "
              "overall in brackets.", "",
              "| row | " + " | ".join(table) + " |", "|---|" + "---|" * len(table)]
    for label in dict.fromkeys(label for rows in table.values() for label in rows):
        cells = [("—" if label not in rows else f"{choose(rows[label]) or 'every point harms a domain'} "
                  f"({best[(name, label)]})") for name, rows in table.items()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="lora,full")
    ap.add_argument("--rows", default="SFTM")
    ap.add_argument("--values", help="comma-separated grid values, instead of each row's own grid (GRIDS)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "val_sweep_lm"))
    args = ap.parse_args(argv)
    tmp_home = tempfile.mkdtemp(prefix="val_sweep_lm_hf_")
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_HOME": tmp_home, "TOKENIZERS_PARALLELISM": "false",
                       "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "HF_DATASETS_CACHE": os.path.join(WORK, "datasets_cache")})
    import hubsoup
    from benchmarks.quality_lm import base, data, finetune
    from benchmarks.quality_lm.run import lora_merged
    from hubsoup.engine.shared import shared_statistics
    from hubsoup.eval import TaskSpec, evaluate_model

    t_start = time.perf_counter()
    base_dir = base.build(print)
    specs = {t: TaskSpec(kind="perplexity", data=data.csv_path(t, "validation"), name=t, split="validation",
                         text="text", max_length=data.EVAL_MAX_LENGTH) for t in data.IN_DOMAIN}

    def score(folder, domains):
        res = evaluate_model(folder, [specs[t] for t in domains], batch_size=16, quiet=True, tokenizer=base_dir)
        return {r.task.name: {"perplexity": r.metrics["perplexity"], "nll": [round(x, 5) for x in r.details["nll"]],
                              "counts": [int(c) for c in r.details["counts"]]} for r in res}

    out = {}
    if os.path.isfile(args.out + ".json"):
        with open(args.out + ".json", encoding="utf-8") as f:
            out = json.load(f)
    out.setdefault("references", {})
    out.setdefault("settings", {})
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]

    def save():
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)

    refs = out["references"]
    if "base" not in refs:
        refs["base"] = score(base_dir, data.IN_DOMAIN)
        save()
    for kind in kinds:
        key = f"{kind} fine-tunes"
        if key in refs:
            continue
        refs[key] = {}
        for t in data.IN_DOMAIN:
            folder = finetune.ft_dir(kind, t)
            if kind == "lora":
                folder = lora_merged(base_dir, folder, os.path.join(WORK, "finetunes", "lora-merged", t))
            refs[key].update(score(folder, [t]))
        save()
        print(f"[{time.perf_counter() - t_start:7.1f}s] references {kind}", flush=True)

    scratch = tempfile.mkdtemp(prefix="val_sweep_lm_")
    try:
        for kind in kinds:
            inputs = [finetune.ft_dir(kind, t) for t in data.IN_DOMAIN]
            setting = out["settings"].setdefault(kind, {})
            for label in [r.strip() for r in args.rows.split(",") if r.strip()]:
                method, fixed, key, grids = GRIDS[label]
                row = setting.setdefault(label, {"key": key, "points": {}})
                # the points of one row share their statistics (SFTM: one superposition per matrix, γ scales last)
                with shared_statistics(scratch=os.path.join(scratch, "shared")):
                    for v in ([float(x) for x in args.values.split(",")] if args.values else grids[kind]):
                        if str(v) in row["points"]:
                            continue
                        t0 = time.perf_counter()
                        dest = os.path.join(scratch, "m")
                        hubsoup.merge(inputs, method, base=base_dir, out=dest, params={**fixed, key: v},
                                      quiet=True, overwrite=True)
                        t1 = time.perf_counter()
                        row["points"][str(v)] = score(dest, data.IN_DOMAIN)
                        shutil.rmtree(dest, ignore_errors=True)
                        ppl = " ".join(f"{e['perplexity']:.2f}" for e in row["points"][str(v)].values())
                        print(f"[{time.perf_counter() - t_start:7.1f}s] {kind} {label} {key}={v}: ppl {ppl} "
                              f"(merge {t1 - t0:.1f}s, eval {time.perf_counter() - t1:.1f}s)", flush=True)
                        save()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(tmp_home, ignore_errors=True)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(render(out, analyse(out)))
    print(f"wrote {args.out}.md in {time.perf_counter() - t_start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
