#!/usr/bin/env python3
"""Store the guard's "defaults − tuned" intervals in results files measured before they were kept (issue 46).

    python -m benchmarks.vs_tuned [benchmarks/results/quality.json benchmarks/results/quality_lm.json]

The guard's (b) fails where a method at its defaults is worse than the base on a task *and* worse than the
same method tuned on validation (:func:`benchmarks.protocol.versus_tuned`). The benchmarks store that
interval in each defaults summary (``vs_tuned``) when they run; this computes it for results written before,
from the per-example outcomes each run keeps (``tests``), scored as the benchmark scores them (the encoder's
balanced accuracies need each test example's class: its cached splits are rebuilt, nothing else). It merges
nothing; it rewrites each file's ``vs_tuned`` entries, its ``guard`` list and its report (``.md``).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import protocol as P  # noqa: E402

DEFAULT_FILES = [os.path.join(HERE, "results", f) for f in ("quality.json", "quality_lm.json")]


def scorer(results: dict, classes: dict[str, list[str]] | None = None):
    """The benchmark's own scoring of a run's ``tests``: the encoder's (balanced accuracy by ``classes``) or the
    LM's (per-sequence −NLL weighted by tokens)."""
    if results["benchmark"] == "encoder":
        from benchmarks.quality.run import to_scores

        return lambda evals: to_scores(evals, classes or {})
    from benchmarks.quality_lm.run import to_scores

    return to_scores


def backfill(results: dict, classes: dict[str, list[str]] | None = None) -> dict:
    """``results`` with every defaults summary's ``vs_tuned`` computed from the stored outcomes and its ``guard``
    list redone (in place; returned)."""
    scores = scorer(results, classes)
    base = scores(results["meta"]["references"]["base"])
    for s in results["settings"].values():
        P.add_versus_tuned(s, scores, base)
    results["guard"] = P.guard(results)
    return results


def main(argv=None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or DEFAULT_FILES
    for path in paths:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        classes = None
        if res["benchmark"] == "encoder":
            from benchmarks.quality import data, run

            # each test example's class, from the same (cached) splits the run scored
            classes = run.split_classes(data.build(log=lambda *a: None), res["meta"]["eval"].get("limit"))
            from benchmarks.quality.report import render
        else:
            from benchmarks.quality_lm.run import render
        backfill(res, classes)
        P.write_results(os.path.splitext(path)[0], res, render)
        print(f"{os.path.relpath(path, REPO)}: guard " + ("passes" if not res["guard"] else
                                                          "FAILS:\n  " + "\n  ".join(res["guard"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
