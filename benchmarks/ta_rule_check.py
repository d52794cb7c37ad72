#!/usr/bin/env python3
"""Task arithmetic's λ rule on test: two results files that differ only in the rule of the defaults (issue 46).

    python -m benchmarks.ta_rule_check --rule "1/√N" A.json [A_lm.json] --rule "1/N" B.json [B_lm.json]
    python -m benchmarks.ta_rule_check --rule "1/√N" A.json#lora-8,lora-4 --rule "1/N" B.json --tuned B.json

Each file: a benchmark's results where the rows whose defaults resolve task arithmetic's λ (task arithmetic,
LiNeS + TA through its β budget, DARE + TA, LwPTV + TA) were run at their defaults under one rule, and tuned on
validation beside them with the same data, heads and fine-tunes (the tuned runs do not depend on the rule, so
both files may hold the same ones). Per rule and setting: each affected row's share of the fine-tunes' gain at
the defaults, tuned, their ratio, the guard's failures (:func:`benchmarks.protocol.guard`: (a) ≥ 0.8 × tuned
or the interval reaches it; (b) worse than the base on a task and than tuned there) and its disclosed harms;
then the minimum over settings of task arithmetic's share and of its ratio to tuned, the numbers the decision
compares. It merges nothing; it writes ``benchmarks/results/issue46/ta_rule_check.md``.

A partial re-run that ran an affected row at its defaults only may take that row's tuned run from another results
file of the same benchmark and test data (``--tuned FILE``; the tuned runs do not depend on the rule): the
defaults − tuned intervals are then computed from both runs' stored per-example outcomes (``benchmarks.vs_tuned``),
and the report names each borrowed run and whether both files' fine-tunes are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import protocol as P  # noqa: E402

AFFECTED = ("task arithmetic", "LiNeS + TA", "DARE + TA", "LwPTV + TA")
OUT = os.path.join(HERE, "results", "issue46", "ta_rule_check.md")


def compare(files: dict[str, list[dict]]) -> dict:
    """Per rule: {"settings": {(benchmark, setting): {row: {...}}}, "min_share", "min_ratio"} over the affected
    rows' defaults runs."""
    out = {}
    for rule, results in files.items():
        settings, ta_shares, ta_ratios = {}, [], []
        for res in results:
            bench = {"decoder-lm": "LM"}.get(res["benchmark"], res["benchmark"])
            fails = P.guard(res)
            harms = P.harms(res)
            for name, s in res["settings"].items():
                for label in AFFECTED:
                    v = s["rows"].get(label) or {}
                    d = ((v.get("defaults") or {}).get("summary") or {}).get("gain")
                    t = ((v.get("tuned") or {}).get("summary") or {}).get("gain")
                    if d is None:
                        continue
                    eff = (v.get("defaults") or {}).get("effective") or {}
                    at = f"N={s.get('n_tasks') or len(s.get('in_domain', []))}"
                    # task arithmetic's λ where the row resolves it (LiNeS: its base method's; its own is 1)
                    lam = {k: x for k, x in eff.items() if k in (f"base λ at {at}", f"λ at {at}")}
                    lam = {k: x for k, x in lam.items() if k.startswith("base") or f"base λ at {at}" not in lam}
                    rec = {"defaults": d, "tuned": t, "ratio": d["value"] / t["value"] if t and t["value"] > 0 else None,
                           "λ": lam, "chosen": (v.get("tuned") or {}).get("chosen"),
                           "fails": [f.split(" at its defaults: ", 1)[1] for f in fails
                                     if f.startswith(f"{res['benchmark']} / {name} / {label} at its defaults")],
                           "harms": [h for h in harms if h["setting"] == name and h["row"] == label]}
                    settings.setdefault((bench, name), {})[label] = rec
                    if label == "task arithmetic":
                        ta_shares.append(d["value"])
                        if rec["ratio"] is not None:
                            ta_ratios.append(rec["ratio"])
        out[rule] = {"settings": settings, "min_share": min(ta_shares, default=None),
                     "min_ratio": min(ta_ratios, default=None)}
    return out


def borrow_tuned(results: dict, donors: list[dict]) -> list[str]:
    """Give each affected row of ``results`` that has a defaults run and no tuned run the tuned run of a donor
    file of the same benchmark, setting and test data; recompute the defaults − tuned intervals and the guard list.
    Returns one note per borrowed run (in place)."""
    notes = []
    meta = results.get("meta") or {}
    for donor in donors:
        dm = donor.get("meta") or {}
        if donor["benchmark"] != results["benchmark"] or dm.get("fingerprint") != meta.get("fingerprint"):
            continue  # another benchmark, or other test data: its outcomes are not paired with these
        for name, s in results["settings"].items():
            ds = (donor["settings"].get(name) or {}).get("rows") or {}
            for label in AFFECTED:
                v = s["rows"].get(label) or {}
                t = (ds.get(label) or {}).get("tuned")
                if v.get("defaults") and not v.get("tuned") and t:
                    v["tuned"] = t
                    same = ((dm.get("ft_fingerprints") or {}).get(s.get("kind"))
                            == (meta.get("ft_fingerprints") or {}).get(s.get("kind")))
                    notes.append(f"{results['benchmark']} {name} {label}: tuned run from the donor file "
                                 + ("(same fine-tunes)" if same else "(same test data, fine-tunes re-made: "
                                    "another fingerprint)"))
    if notes:
        from benchmarks import vs_tuned

        classes = None
        if results["benchmark"] == "encoder":
            from benchmarks.quality import data, run

            classes = run.split_classes(data.build(log=lambda *a: None), meta["eval"].get("limit"))
        vs_tuned.backfill(results, classes)
    return notes


def render(table: dict, sources: dict[str, list[str]], notes: list[str] = ()) -> str:
    lines = ["# Task arithmetic's λ rule, checked on test (issue 46)", "",
             "Written by `python -m benchmarks.ta_rule_check` (see its docstring). Files: "
             + "; ".join(f"{rule}: " + ", ".join(f"`{p}`" for p in paths) for rule, paths in sources.items()) + ".",
             "", "| rule | benchmark / setting | row | λ at the defaults | defaults | tuned (values) | defaults / tuned | "
                 "guard | harms (Δ vs base, defaults − tuned) |", "|---|---|---|---|---|---|---|---|---|"]
    for rule, r in table.items():
        for (bench, name), rows in r["settings"].items():
            for label, rec in rows.items():
                d, t = rec["defaults"], rec["tuned"]
                harms = "; ".join(f"{h['task']} {P.ci(h['change'])}" + (f", {P.ci(h['vs_tuned'])}" if h["vs_tuned"]
                                                                           else "") for h in rec["harms"]) or "—"
                lines.append(
                    f"| {rule} | {bench} {name} | {label} | {', '.join(f'{x:.3g}' for x in rec['λ'].values()) or '—'} | "
                    f"{P.ci(d, pct=False)} | {P.ci(t, pct=False) if t else '—'}"
                    f"{' (' + ', '.join(f'{k}={v}' for k, v in rec['chosen'].items()) + ')' if rec['chosen'] else ''} | "
                    f"{'%.2f' % rec['ratio'] if rec['ratio'] is not None else '—'} | "
                    f"{'passes' if not rec['fails'] else 'FAILS: ' + '; '.join(rec['fails'])} | {harms} |")
    lines += ["", "| rule | task arithmetic's lowest share at the defaults | lowest defaults / tuned | affected rows failing "
                  "the guard |", "|---|---|---|---|"]
    for rule, r in table.items():
        failing = sorted({f"{b} {n} {label}" for (b, n), rows in r["settings"].items()
                          for label, rec in rows.items() if rec["fails"]})
        share, ratio = (("—" if x is None else f"{x:.2f}") for x in (r["min_share"], r["min_ratio"]))
        lines.append(f"| {rule} | {share} | {ratio} | {', '.join(failing) or 'none'} |")
    if notes:
        lines += ["", "Tuned runs borrowed (`--tuned`):", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rule", nargs="+", action="append", required=True, metavar=("NAME", "FILE"),
                    help="a rule's name and its results files")
    ap.add_argument("--tuned", nargs="+", default=[], metavar="FILE",
                    help="results files whose tuned runs fill an affected row that has none (same test data)")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args(argv)
    donors = []
    for p in args.tuned:
        with open(p, encoding="utf-8") as f:
            donors.append(json.load(f))
    files, sources, notes = {}, {}, []
    for name, *paths in args.rule:
        files[name] = []
        for p in paths:
            # FILE#SETTING,...: only those settings were run under this rule (a partial re-run's file also
            # holds the earlier runs it was merged into)
            p, _, only = p.partition("#")
            with open(p, encoding="utf-8") as f:
                res = json.load(f)
            if only:
                keep = {x.strip() for x in only.split(",")}
                res["settings"] = {k: v for k, v in res["settings"].items() if k in keep}
            files[name].append(res)
            notes += [f"{name}: {n}" for n in borrow_tuned(res, donors)]
        sources[name] = [os.path.relpath(os.path.abspath(p.partition("#")[0]), REPO)
                         + (f" (settings {p.partition('#')[2]} only)" if "#" in p else "") for p in paths]
    if args.tuned:
        sources["tuned runs"] = [os.path.relpath(os.path.abspath(p), REPO) for p in args.tuned]
    text = render(compare(files), sources, notes)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
