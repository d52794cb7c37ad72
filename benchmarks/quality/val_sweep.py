#!/usr/bin/env python3
"""Per-task validation curves: each method's grid in each encoder setting, scored task by task.

The quality benchmark's search picks one value per setting by the mean normalized accuracy on a
validation subsample; that mean hides a task the merge makes worse than the base. This sweep
merges every grid point of the chosen rows and scores it on the *whole* validation split of each
in-domain task (40 per class), next to the base and the fine-tunes on the same examples, so a
default can be chosen on validation both for its gain and for harming no task (issue 35's guard
(b), which the test split then checks). Nothing here reads a test split.

    python -m benchmarks.quality.val_sweep --settings lora-8,lora-4,full-8,full-4 --rows TIES,SFTM,OPCM

Merges from the cached fine-tune folders (no Hub server; the base given explicitly); results in
``benchmarks/results/val_sweep.json`` (a partial run adds to it) and ``val_sweep.md``.
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
WORK = os.path.join(REPO, "benchmarks", ".work", "quality")
RESULTS = os.path.join(REPO, "benchmarks", "results")

# wider than the benchmark's thinned grids, towards the base: where a default that harms no task lies
GRIDS = {
    "TIES": ("ties", {}, "scale", [0.1, 0.2, 0.3, 0.5, 0.7, 1.0]),
    "SFTM": ("sftm", {}, "gamma", [0.1, 0.2, 0.3, 0.4, 0.6, 0.8]),
    "OPCM": ("opcm", {}, "alpha", [0.1, 0.3, 0.5, 0.7]),
    "OPCM (λ_t = √t)": ("opcm", {"scaling": "sqrt"}, "alpha", [0.5]),
    "task arithmetic": ("task_arithmetic", {}, "scale", [0.0625, 0.125, 0.25, 0.5]),
}


def analyse(out: dict) -> dict:
    """Per setting, row and grid point: the share of the fine-tunes' gain (pooled, as the benchmark's
    ``protocol.gain``) and each task's change against the base, with paired-bootstrap 95 % intervals
    (``protocol.interval``) on the validation examples; ``harms``: the tasks whose interval lies below 0
    (the guard's (b), here on validation)."""
    from benchmarks.quality.run import to_scores

    def scores(evals):  # the benchmark's scoring; validation splits are balanced: plain accuracy
        return to_scores(evals, {})

    return point_table(out, scores, lambda name: f"{name.split('-')[0]} fine-tunes")


def point_table(out: dict, scores, fine_tunes_of) -> dict:
    """:func:`analyse`'s table for any benchmark: ``scores`` turns a stored evaluation into per-example scores,
    ``fine_tunes_of(setting)`` names the references entry of that setting's fine-tunes (the LM sweep uses it too)."""
    from benchmarks import protocol

    refs = out["references"]
    base = scores(refs["base"])
    table: dict = {}
    for name, setting in out["settings"].items():
        fts = {t: {t: s} for t, s in scores(refs[fine_tunes_of(name)]).items()}
        for label, row in setting.items():
            for v, evals in row["points"].items():
                m = scores(evals)
                tasks = list(evals)
                n = protocol.sizes(base, tasks)
                g = protocol.interval(protocol.gain(m, base, fts, tasks), n)
                per = {t: protocol.interval(protocol.change(m, base, [t]), {t: n[t]}) for t in tasks}
                table.setdefault(name, {}).setdefault(label, {})[v] = {
                    "gain": g, "per_task": per, "harms": [t for t, d in per.items() if d["hi"] < 0]}
    return table


def choose(points: dict) -> str | None:
    """The value validation picks with the guard in mind: the largest gain among the grid points that harm no
    task (``harms`` empty); None when every point harms one."""
    safe = {v: r["gain"]["value"] for v, r in points.items() if not r["harms"]}
    return max(safe, key=lambda v: (safe[v], -float(v))) if safe else None


def render(out: dict, table: dict) -> str:
    lines = ["# Per-task validation curves (encoder benchmark)", "",
             "Written by `python -m benchmarks.quality.val_sweep`. Each grid point merged from the cached fine-tunes "
             "and scored on the whole validation split of each in-domain task (never the test split). "
             "*gain*: share of the fine-tunes' gain recovered (pooled over tasks) with its paired-bootstrap 95 % "
             "interval; *worst task*: the largest drop against the base; *harms*: tasks whose interval of the "
             "change against the base lies below 0 (the guard's (b), on validation).", ""]
    for name, rows in table.items():
        lines += [f"## {name}", "", "| row | value | gain | worst task vs base | harms |", "|---|---|---|---|---|"]
        for label, pts in rows.items():
            key = out["settings"][name][label]["key"]
            for v, r in sorted(pts.items(), key=lambda kv: float(kv[0])):
                g = r["gain"]
                t, d = min(r["per_task"].items(), key=lambda kv: kv[1]["value"])
                lines.append(f"| {label} | {key}={v} | {g['value']:.2f} [{g['lo']:.2f}, {g['hi']:.2f}] | "
                             f"{t} {100 * d['value']:+.1f} [{100 * d['lo']:+.1f}, {100 * d['hi']:+.1f}] | "
                             f"{', '.join(r['harms']) or '—'} |")
        lines.append("")
    lines += ["## Chosen on validation", "",
              "The largest gain among the points that harm no task (a tie: the smaller value).", "",
              "| row | " + " | ".join(table) + " |", "|---|" + "---|" * len(table)]
    for label in dict.fromkeys(label for rows in table.values() for label in rows):
        cells = [("—" if label not in rows else choose(rows[label]) or "every point harms a task")
                 for rows in table.values()]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--settings", default="lora-8,lora-4,full-8,full-4")
    ap.add_argument("--rows", default="TIES,SFTM,OPCM")
    ap.add_argument("--values", help="comma-separated grid values, instead of each row's own grid (GRIDS)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "val_sweep"))
    args = ap.parse_args(argv)
    tmp_home = tempfile.mkdtemp(prefix="val_sweep_hf_")
    os.environ.update({"HF_HUB_OFFLINE": "1", "HF_HOME": tmp_home, "TOKENIZERS_PARALLELISM": "false",
                       "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "HF_DATASETS_CACHE": os.path.join(WORK, "datasets_cache")})
    sys.path.insert(0, REPO)
    import hubsoup
    from benchmarks.quality import data, finetune, heads
    from hubsoup.eval import TaskSpec, evaluate_model

    t_start = time.perf_counter()
    base_dir = os.path.join(WORK, "base")
    specs = {t: TaskSpec(kind="classification", data=data.csv_path(t, "validation"), name=t, split="validation",
                         head=heads.head_path(t), max_length=heads.MAX_LENGTH) for t in data.IN_DOMAIN}

    def score(folder, tasks):
        res = evaluate_model(folder, [specs[t] for t in tasks], batch_size=64, quiet=True)
        return {r.task.name: {"accuracy": r.metrics["accuracy"],
                              "correct": "".join(str(int(c)) for c in r.details["correct"])} for r in res}

    out = {}
    if os.path.isfile(args.out + ".json"):
        with open(args.out + ".json", encoding="utf-8") as f:
            out = json.load(f)
    out.setdefault("references", {})
    out.setdefault("settings", {})

    def save():
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)

    refs = out["references"]
    if "base" not in refs:
        refs["base"] = score(base_dir, data.IN_DOMAIN)
        save()
    for kind in ("full", "lora"):
        key = f"{kind} fine-tunes"
        if key in refs or not any(s.startswith(kind) for s in args.settings.split(",")):
            continue
        refs[key] = {}
        for t in data.IN_DOMAIN:
            folder = finetune.ft_dir(kind, t) if kind == "full" else os.path.join(finetune.FT_DIR, "lora-merged", t)
            refs[key].update(score(folder, [t]))
        save()

    scratch = tempfile.mkdtemp(prefix="val_sweep_")
    try:
        for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
            kind, n = name.split("-")
            tasks = data.IN_DOMAIN[:int(n)]
            inputs = [finetune.ft_dir(kind, t) for t in tasks]
            setting = out["settings"].setdefault(name, {})
            for label in [r.strip() for r in args.rows.split(",") if r.strip()]:
                method, fixed, key, grid = GRIDS[label]
                if args.values:
                    grid = [float(v) for v in args.values.split(",")]
                row = setting.setdefault(label, {"key": key, "points": {}})
                for v in grid:
                    if str(v) in row["points"]:
                        continue
                    t0 = time.perf_counter()
                    dest = os.path.join(scratch, "m")
                    hubsoup.merge(inputs, method, base=base_dir, out=dest, params={**fixed, key: v},
                                  quiet=True, overwrite=True)
                    t1 = time.perf_counter()
                    row["points"][str(v)] = score(dest, tasks)
                    shutil.rmtree(dest, ignore_errors=True)
                    accs = " ".join(f"{e['accuracy']:.3f}" for e in row["points"][str(v)].values())
                    print(f"[{time.perf_counter() - t_start:7.1f}s] {name} {label} {key}={v}: {accs} "
                          f"(merge {t1 - t0:.1f}s, eval {time.perf_counter() - t1:.1f}s)", flush=True)
                    save()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(tmp_home, ignore_errors=True)
    with open(args.out + ".md", "w", encoding="utf-8") as f:
        f.write(render(out, analyse(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
