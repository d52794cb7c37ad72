"""Model soups: uniform and greedy, with the LiNeS-paper variants on top.

- Uniform soup: the ``linear`` method (θ_0 + mean_i τ_i); :func:`uniform_soup`.
- Soup + task-arithmetic scale: the ``soup`` method, ``scale`` = λ_ta (1 = vanilla).
- Soup + LiNeS: ``lines`` with ``base_method=linear`` (α = 1, β to search; β = 0 = vanilla).
- Greedy soup: :func:`greedy_soup` (Wortsman et al., 2022, Recipe 1). The ingredients are
  sorted by their own validation score (best first, input order among equals); the soup
  starts with the best, and each next ingredient stays if the soup's score with it does
  not drop (``>=``, the paper's algorithm; ``strict=True`` gives ``>``, the reference
  code). The score comes from a Python callable ``score_fn(model_folder) -> float``.

  How a candidate soup is evaluated: it is merged with ``linear`` by the streaming engine
  into a temporary folder (next to ``out`` unless ``work_dir`` is given), scored, and
  deleted. This costs one merge per candidate but works for any model size and any
  input kind (LoRA adapters, Hub IDs), and the scorer always sees a normal checkpoint
  folder. A single ingredient is scored from its own folder when it is a local full
  model, otherwise from a one-input ``linear`` merge (θ_0 + τ).

  The variants of the LiNeS paper are applied after the selection, to the chosen
  ingredients only (App. B.3): pass ``method="soup", params={"scale": 1.5}`` or
  ``method="lines", params={"base_method": "linear", "beta": 0.5}`` for the final merge.

Example:
    >>> from hubsoup.workflows.soups import greedy_soup
    >>> res = greedy_soup(["ft-a", "ft-b", "ft-c"], my_val_accuracy, base="base", out="soup")  # doctest: +SKIP
    >>> res.ingredients                                                                       # doctest: +SKIP
    ['ft-b', 'ft-a']
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from hubsoup.api import MergeResult, keeps_inputs, merge, scoped
from hubsoup.errors import ParameterError
from hubsoup.options import MergeOptions
from hubsoup.output import check_output, lock_output
from hubsoup.sources import open_input
from hubsoup.sources.access import check_specs


def uniform_soup(inputs: Sequence[str], *, out: str, base: str | None = None, **kwargs: Any) -> MergeResult:
    """θ_0 + mean_i(θ_i − θ_0): the ``linear`` method with equal weights."""
    return merge(inputs, "linear", base=base, out=out, **kwargs)


@dataclass
class GreedySoupResult:
    result: MergeResult
    """The final merge of the chosen ingredients."""
    ingredients: list[str]
    """Chosen ingredients, in the order they were added (best individual score first)."""
    scores: dict[str, float]
    """Each input's individual score."""
    soup_score: float
    """Score of the chosen soup as selected (before any final LiNeS / scale variant)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One entry per candidate tried: ingredient, soup score with it, accepted."""


def _is_local_full(spec: str) -> bool:
    if not os.path.isdir(spec):
        return False

    try:
        return open_input(spec).ref.kind == "full"
    except Exception:  # noqa: BLE001 - anything unusual is merged instead, which reports it properly
        return False


@scoped  # hub_only: the inputs' text alone decides, before anything local is looked at
@keeps_inputs  # every point merges the same inputs: downloaded once into the Hub cache
def greedy_soup(inputs: Sequence[str], score_fn: Callable[[str], float], *, out: str, base: str | None = None,
                strict: bool = False, method: str = "linear", params: dict[str, Any] | None = None,
                individual_scores: Mapping[str, float] | Sequence[float] | None = None,
                work_dir: str | None = None, options: MergeOptions | None = None,
                **kwargs: Any) -> GreedySoupResult:
    """Greedy soup: keep each ingredient (best first) whose addition does not lower the soup's score.

    Args:
        inputs: the ingredients (folders or Hub IDs, full models or adapters of ``base``).
        score_fn: validation score of a model folder (higher is better), called on each
            ingredient (unless ``individual_scores``) and on each candidate soup.
        out: where the final soup is written.
        strict: add an ingredient only if the score rises (``>``); default ``>=`` (the paper).
        method, params: the final merge of the chosen ingredients (default ``linear``: the
            vanilla greedy soup; ``soup`` with ``scale`` or ``lines`` with ``base_method=linear``
            for the LiNeS paper's variants).
        individual_scores: the ingredients' own scores when already known (same order as
            ``inputs``, or a mapping from input to score).
        work_dir: where candidate soups are written while they are scored (default: beside ``out``).
        options: as :func:`hubsoup.merge` (or their names as keywords); ``quiet`` by default.
        kwargs: further :func:`hubsoup.merge` keyword arguments (``output_format``, ...).
    """
    check_specs(inputs=inputs, base=base)
    opts, merge_kwargs = MergeOptions.split(kwargs, options or MergeOptions(quiet=True))
    inputs = list(inputs)
    if not inputs:
        raise ParameterError("greedy_soup: no ingredients given")
    if len(set(inputs)) != len(inputs):
        raise ParameterError("greedy_soup: an ingredient is listed twice")
    check_output(out, opts.overwrite)
    # the lock on `out` for the whole selection and the final merge (which re-enters it)
    lock = lock_output(out)
    try:
        return _greedy_soup(inputs, score_fn, out, base, strict, method, params, individual_scores, work_dir, opts,
                            merge_kwargs)
    finally:
        lock.release()


def _greedy_soup(inputs: list[str], score_fn: Callable[[str], float], out: str, base: str | None, strict: bool,
                 method: str, params: dict[str, Any] | None,
                 individual_scores: Mapping[str, float] | Sequence[float] | None, work_dir: str | None,
                 opts: MergeOptions, merge_kwargs: dict[str, Any]) -> GreedySoupResult:
    parent = work_dir or os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    # beside `out`, a `.NAME.partial-` name: the next run on `out` removes it if this one is killed
    prefix = ".greedy-soup-" if work_dir else f".{os.path.basename(os.path.abspath(out))}.partial-greedy-"
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    counter = iter(range(1 << 30))
    # progress: at most 2N merges (N candidates, N - 1 soups, the final one), each an equal share of [0, 1]
    monitor = opts.monitor()
    shares = 2 * len(inputs)
    step = iter(range(shares))

    def child_opts(**changes: Any) -> MergeOptions:
        k = min(next(step), shares - 1)
        return opts.replace(quiet=opts.silent, **changes,
                            progress=monitor.child(k / shares, (k + 1) / shares) if monitor.reporting else None)

    def score_of(members: list[str]) -> float:
        if len(members) == 1 and _is_local_full(members[0]):
            monitor.check()
            return float(score_fn(members[0]))
        folder = os.path.join(tmp, f"candidate-{next(counter)}")
        merge(members, "linear", base=base, out=folder, options=child_opts(overwrite=False), **merge_kwargs)
        try:
            return float(score_fn(folder))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    try:
        if individual_scores is None:
            scores = {spec: score_of([spec]) for spec in inputs}
        elif isinstance(individual_scores, Mapping):
            missing = [s for s in inputs if s not in individual_scores]
            if missing:
                raise ParameterError(f"greedy_soup: no individual score for '{missing[0]}'")
            scores = {s: float(individual_scores[s]) for s in inputs}
        else:
            if len(individual_scores) != len(inputs):
                raise ParameterError(f"greedy_soup: {len(individual_scores)} scores for {len(inputs)} ingredients")
            scores = {s: float(v) for s, v in zip(inputs, individual_scores)}
        order = sorted(inputs, key=lambda s: -scores[s])  # stable: input order among equal scores
        soup, best = [order[0]], scores[order[0]]
        history = [{"ingredient": order[0], "score": best, "accepted": True}]
        for spec in order[1:]:
            s = score_of(soup + [spec])
            accepted = s > best if strict else s >= best
            history.append({"ingredient": spec, "score": s, "accepted": accepted})
            if accepted:
                soup, best = soup + [spec], s
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    final_opts = opts.replace(quiet=opts.silent,
                              progress=monitor.child(monitor.done, 1.0) if monitor.reporting else None)
    result = merge(soup, method, base=base, out=out, params=params, options=final_opts, **merge_kwargs)
    greedy = GreedySoupResult(result, soup, scores, best, history)

    result.notes.append(greedy_note(greedy, strict))
    result.write_card()
    return greedy


def greedy_note(g: GreedySoupResult, strict: bool) -> str:
    """The selection, for the model card."""
    rows = "\n".join(f"| {i + 1} | `{h['ingredient']}` | {g.scores[h['ingredient']]:.6g} | {h['score']:.6g} | "
                     f"{'added' if h['accepted'] else 'left out'} |" for i, h in enumerate(g.history))
    return (f"**Greedy soup.** Ingredients sorted by their own score; each was added when the soup's score "
            f"{'rose (>)' if strict else 'did not drop (>=)'}. {len(g.ingredients)} of {len(g.history)} kept; "
            f"soup score {g.soup_score:.6g}.\n\n| # | Ingredient | Own score | Soup score with it | |\n"
            f"|---|---|---|---|---|\n{rows}")
