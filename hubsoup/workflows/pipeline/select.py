"""Which merges a pipeline publishes: the selection metric of a merge's scores, its goal (max, or min for a
perplexity), the threshold, all from the pipeline's ``select:`` (:class:`~hubsoup.workflows.pipeline.config.Select`).

Example:
    >>> from hubsoup.workflows.pipeline.config import Select
    >>> metric(Select(metric="accuracy"), {"a/accuracy": 0.5, "b/accuracy": 0.7})
    0.6
    >>> goal(Select(metric="wiki/perplexity"))
    'min'
"""

from __future__ import annotations

import math

from hubsoup.workflows.pipeline.config import Select
from hubsoup.workflows.pipeline.report import PlannedMerge


def passes(sel: Select | None, m: PlannedMerge) -> bool:
    """Whether ``m``'s score passes the threshold (no threshold, no selection: every merge passes)."""
    if sel is None or sel.threshold is None:
        return True
    if m.score is None:
        return False
    return m.score >= sel.threshold if goal(sel) == "max" else m.score <= sel.threshold


def goal(sel: Select) -> str:
    """``max`` or ``min``: as ``select.goal`` says, else ``min`` for a perplexity."""
    if sel.goal:
        return sel.goal
    return "min" if sel.metric.split("/")[-1] == "perplexity" else "max"


def score(sel: Select | None, scores: dict[str, float]) -> float | None:
    """The selection metric of these scores; None when missing or not a finite number (never ranked)."""
    value = metric(sel, scores)
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def metric(sel: Select | None, scores: dict[str, float]) -> float | None:
    """The selection metric of ``scores``: one score (``task/metric``), the mean of a metric over the tasks, or
    ``score``: the mean over the tasks of accuracy, or -log(perplexity)."""
    if sel is None or not scores:
        return None
    if sel.metric == "score":
        tasks = sorted({k.rsplit("/", 1)[0] for k in scores})
        vals = []
        for t in tasks:
            if f"{t}/accuracy" in scores:
                vals.append(scores[f"{t}/accuracy"])
            elif f"{t}/perplexity" in scores:  # -log(perplexity), as TaskResult.score, search and evolve
                ppl = scores[f"{t}/perplexity"]
                vals.append(-math.log(ppl) if ppl > 0 else math.nan)
        return sum(vals) / len(vals) if vals else None
    if "/" in sel.metric:
        return scores.get(sel.metric)
    vals = [v for k, v in scores.items() if k.rsplit("/", 1)[-1] == sel.metric]
    return sum(vals) / len(vals) if vals else None
