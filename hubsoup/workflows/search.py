"""Hyper-parameter search on validation data: one streaming merge per grid point.

The papers choose every merging coefficient on held-out validation data; this does
the same. The output is locked for the whole search; each grid point is merged into
the output's temporary folder (``.NAME.partial-XXXX/point-NNN``), scored, and the best
one becomes the output (no second merge) — an interrupted search leaves the old output
as it was. With several tasks the selection score is the mean *normalized* accuracy,
accuracy divided by the matching fine-tune's own accuracy, as in the papers: task ``i``
is matched with input ``i`` when there are as many tasks as inputs; otherwise raw
accuracies are averaged. The fine-tunes' scores are kept in this process, by what pins them (the
input's commit or folder stamp, the task's data and head files): a later search of the same inputs on
the same data (a grid per row of a benchmark, an app's second search) does not score them again.
Perplexity tasks count as minus log-perplexity (the mean token NLL):
a relative change of perplexity weighs the same on every domain, so the domain with the
highest perplexity does not decide alone (the mean is that of a geometric-mean perplexity).

Example:
    >>> from hubsoup.workflows.search import parse_grid, search
    >>> parse_grid("scale=0.1:0.5:0.2")
    {'scale': [0.1, 0.3, 0.5]}
    >>> best = search(["a", "b"], "task_arithmetic", base="base", out="soup",
    ...               grid=parse_grid("scale=0.1:1.0:0.1"), tasks=[...])   # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable, Sequence, cast

import hubsoup
from hubsoup.api import keeps_inputs, scoped
from hubsoup.engine import shared
from hubsoup.engine.shared import shared_statistics
from hubsoup.errors import HubsoupError, MethodError, ParameterError
from hubsoup.eval import TaskResult, evaluate_model
from hubsoup.hubclient import Token
from hubsoup.eval.run import EVAL_FILE, write_results
from hubsoup.methods import get_method
from hubsoup.options import MergeOptions
from hubsoup.output import OutputFolder, check_output
from hubsoup.sources.access import check_specs
from hubsoup.workflows.executors import check_executor, is_local, make_executor
from hubsoup.workflows.trial import pin_inputs

if TYPE_CHECKING:
    from hubsoup.eval import TaskSpec
    from hubsoup.progress import Monitor
    from hubsoup.sources.checkpoint import InputRef


def frange(lo: float, hi: float, step: float) -> list[float]:
    if not all(math.isfinite(v) for v in (lo, hi, step)):
        raise ParameterError(f"grid {lo}:{hi}:{step}: bounds and step must be finite numbers")
    if step <= 0:
        raise ParameterError(f"grid step must be positive, got {step}")
    n = int(round((hi - lo) / step))
    return [round(lo + i * step, 10) for i in range(n + 1)]


def _paper_grid(method: str | None) -> dict[str, list[Any]]:
    """The method's paper grids (its ``search_grid``); none for an unknown method, which the merge reports."""
    try:
        return get_method(method).search_grid if method else {}
    except MethodError:
        return {}


def parse_grid(*specs: str, method: str | None = None) -> dict[str, list[Any]]:
    """``KEY=lo:hi:step``, ``KEY=a,b,c`` or a bare ``KEY`` (the method's paper grid)."""
    grid: dict[str, list[Any]] = {}
    for spec in specs:
        key, _, values = spec.partition("=")
        key = key.strip()
        if not values:
            default = _paper_grid(method).get(key)
            if default is None:
                raise ParameterError(f"--search {key}: no default grid for {key!r} of method {method!r}; give values")
            grid[key] = list(default)
        elif values.count(":") == 2:
            try:
                lo, hi, step = (float(v) for v in values.split(":"))
            except ValueError:
                raise ParameterError(f"--search {spec!r}: expected lo:hi:step numbers") from None
            grid[key] = frange(lo, hi, step)
        else:
            grid[key] = [v.strip() for v in values.split(",") if v.strip()]
        if not grid[key]:
            raise ParameterError(f"--search {spec!r}: empty grid")
    return grid


def points(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(grid)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def merge_order(grid_points: list[dict[str, Any]], method: str, params: dict[str, Any] | None = None) -> list[int]:
    """The order a search merges its points in: points whose preparation is the same
    (:meth:`Method.stats_key`, e.g. TIES' λ, LOT's λ, SFTM's γ, LiNeS' β) back to back, since a block
    of shared statistics keeps only the last one, and first those equal to what the enclosing block
    holds (a benchmark's defaults merged just before). Otherwise the grid's order. The order changes
    nothing but the time: every point is its own merge, scores are reported in grid order, and a tie
    goes to the earlier grid point.

    >>> merge_order([{"alpha": 0.3}, {"alpha": 0.5}, {"alpha": 0.3}], "opcm")
    [0, 2, 1]
    """
    m = get_method(method)
    keys = [m.stats_key(m.parse({**(params or {}), **p})) for p in grid_points]
    block = shared.current()
    held = cast("tuple[Any, ...] | None", block.key) if block is not None else None  # engine._stats_key's tuple
    ahead = held[1] if held is not None and held[0] == m.name else None  # the method's own key
    first: dict[Hashable, int] = {}  # key -> grid index of its first point: the groups in order of first appearance
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    return sorted(range(len(keys)), key=lambda i: (keys[i] != ahead, first[keys[i]], i))


@dataclass
class SearchResult:
    best: dict[str, Any]
    best_score: float
    scores: list[dict[str, Any]] = field(default_factory=list)
    """One entry per grid point: its parameters, score and per-task metrics."""
    selection: str = ""
    result: Any = None
    """The :class:`hubsoup.MergeResult` of the best point, now at the output path."""
    seconds: dict[str, Any] = field(default_factory=dict)
    """Where the search's time went: ``references`` (scoring the fine-tunes), then per point ``merge`` and
    ``score`` (in ``hubsoup_search.json``, not in the card: the card stays the same on every run)."""

    def to_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_score": self.best_score, "selection": self.selection, "scores": self.scores}


# the fine-tunes' reference scores of earlier searches in this process (key: see _reference_key)
_REFERENCES: "OrderedDict[tuple[Any, ...], float]" = OrderedDict()
_REFERENCES_MAX = 512
_REFERENCES_LOCK = threading.Lock()


def _stamp(path: str) -> tuple[Any, ...]:
    """A file's or folder's identity as far as a cache may trust it: path, and size and mtime of each file."""
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(path):
        return (path, tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                                   for e in os.scandir(path) if e.is_file())))
    st = os.stat(path)
    return (path, st.st_size, st.st_mtime_ns)


def _reference_key(ref: InputRef, base: InputRef, task: TaskSpec, limit: int | None) -> tuple[Any, ...] | None:
    """What a fine-tune's score on ``task`` depends on; None where something cannot be pinned (an input
    without its commit, data or a head that is not a local file): that score is not kept."""
    if ref.repo_id:
        if not ref.sha:
            return None
        who: tuple[Any, ...] = (ref.repo_id, ref.sha)
    elif ref.path or ref.spec:
        who = _stamp(ref.path or ref.spec)
    else:
        return None
    if not task.is_local or (task.head and not os.path.isfile(os.path.expanduser(task.head))):
        return None
    fields = tuple(sorted((k, repr(v)) for k, v in task.__dict__.items() if k not in ("data", "head")))
    head = _stamp(task.head) if task.head else None
    return (who, base.public, _stamp(task.data), head, fields, limit)


def reference_scores(inputs: Sequence[str], refs: Sequence[InputRef], base: InputRef, tasks: Sequence[TaskSpec],
                     limit: int | None, *, token: Token = None) -> list[float]:
    """Each input's score on its own task (input ``i`` on task ``i``), from this process' earlier searches
    where nothing they depend on changed. ``refs``: the inputs as the merge opened them (:class:`InputRef`);
    ``token``: the run's, for the tasks' data on the Hub."""
    out = []
    for inp, ref, task in zip(inputs, refs, tasks):
        key = _reference_key(ref, base, task, limit)
        with _REFERENCES_LOCK:
            score = _REFERENCES.get(key) if key is not None else None
        if score is None:
            score = evaluate_model(inp, [task], limit=limit, quiet=True, token=token)[0].score
            if key is not None:
                with _REFERENCES_LOCK:
                    _REFERENCES[key] = score
                    while len(_REFERENCES) > _REFERENCES_MAX:
                        _REFERENCES.popitem(last=False)
        out.append(score)
    return out


def normalized_score(results: Sequence[TaskResult], references: Sequence[float] | None) -> float:
    """Mean of each task's score, divided by its reference (fine-tune) score when given."""
    vals = []
    for i, r in enumerate(results):
        s = -math.log(r.metrics["perplexity"]) if r.task.kind == "perplexity" else r.score  # lm-eval: its metric
        if references is not None and r.task.kind == "classification":
            ref = references[i]
            s = s / ref if ref > 0 else s
        vals.append(s)
    return sum(vals) / len(vals)


@scoped  # hub_only: the inputs' text alone decides, before anything local is looked at
@keeps_inputs  # every point merges the same inputs: downloaded once into the Hub cache
def search(inputs: Sequence[str], method: str, *, out: str, grid: dict[str, list[Any]], base: str | None = None,
           tasks: Sequence[TaskSpec] | None = None, score_fn: Callable[[str], float] | None = None,
           params: dict[str, Any] | None = None, normalize: bool = True, limit: int | None = None,
           options: MergeOptions | None = None, executor: Any = None, resources: dict[str, Any] | None = None,
           **kwargs: Any) -> SearchResult:
    """Merge once per grid point, score each on validation data, keep the best as ``out``.

    Give either ``tasks`` (:class:`hubsoup.eval.TaskSpec`, validation splits) or
    ``score_fn(model_folder) -> float`` (higher is better). ``options`` (or their names as
    keywords) as :func:`hubsoup.merge`; other keywords go to every merge (``output_format``,
    method parameters).

    ``progress=`` and ``cancel=`` (options too) as for :func:`hubsoup.merge`: ``done`` covers the
    whole search (each point's merge, then its scoring, stage ``eval``); a cancel stops the point
    being merged and leaves no output.

    ``executor``: ``None``/``"local"`` (this process, the default), ``"ray"`` (``RAY_ADDRESS`` or a local
    cluster), ``"ray://HOST:PORT"`` or an executor object (:mod:`hubsoup.workflows.executors`). With Ray,
    the inputs are pinned to their commits here once, each point is a task (merged in memory and scored
    on its node, requesting ``resources``: ``cpus`` (1), ``gpus`` (1 on a CUDA ``device``, else 0),
    ``memory`` (the planner's prediction)), the scores come back here, and the best point alone is
    merged here into ``out``: the same ``hubsoup_search.json`` scores, best point and output as a local
    search. Ray's nodes read the Hub with their own login (the run's token is never sent to them); a
    Ray search scores with ``tasks`` (not ``score_fn``) and writes a full checkpoint (no LoRA output).

    Example:
        >>> res = search(["a", "b"], "ties", base="base", out="soup", grid={"density": [0.1, 0.2]},
        ...              tasks=[...], progress=lambda d, stage, msg: print(f"{d:.0%} {stage}"),
        ...              cancel=threading.Event())                                   # doctest: +SKIP
    """
    check_specs(inputs=inputs, base=base, tasks=tasks or ())
    check_executor(executor)
    opts, merge_kwargs = MergeOptions.split(kwargs, options)
    if opts.progress is not None and not opts.quiet:  # the callback replaces every print
        opts = opts.replace(quiet=True)
    if (tasks is None) == (score_fn is None):
        raise ParameterError("search needs either evaluation tasks or a score function (not both)")
    tasks = list(tasks) if tasks is not None else None
    if not is_local(executor):  # candidates are merged in memory on the cluster's nodes: full models, tasks
        if score_fn is not None:
            raise ParameterError(f"search with executor {executor!r}: score with tasks (score_fn reads a folder "
                                 "on this machine)")
        local_only = [k for k in ("output_format", "rank", "energy", "layout", "evaluate", "eval_limit")
                      if merge_kwargs.get(k) not in (None, "full")]
        if local_only:
            raise ParameterError(f"search with executor {executor!r}: '{local_only[0]}' needs the local executor "
                                 "(each point is merged in memory as a full model)")
        params = {**(params or {}), **{k: v for k, v in merge_kwargs.items() if k not in (
            "output_format", "rank", "energy", "layout", "evaluate", "eval_limit")}}
        merge_kwargs = {}
    check_output(out, opts.overwrite)
    grid_points = points(grid)
    if not grid_points:
        raise ParameterError(f"search grid {grid}: no point (a parameter with no values)")
    m = get_method(method)
    for point in grid_points:  # every point's parameters are checked (nan, out of range) before any merge
        m.parse({**(params or {}), **point})
    for t in tasks or ():  # and the validation data exists
        t.check(opts.token)
    # the lock on `out` for the whole search; the points are merged inside its temporary folder
    folder = OutputFolder(out, overwrite=opts.overwrite)
    try:
        if not is_local(executor):
            assert tasks is not None  # a remote search scores with tasks (checked above)
            return _search_remote(folder, grid_points, inputs, method, base, tasks, params, normalize, limit, opts,
                                  executor, resources)

        # points that differ only in what the merge itself reads (λ) share the preparation (LOT's exemplar
        # features) and the statistics passes (TIES' whole-model ranking): computed once
        with shared_statistics(scratch=folder.path):
            return _search(folder, grid_points, inputs, method, base, tasks, score_fn, params, normalize, limit,
                           opts, merge_kwargs)
    except BaseException as e:
        raise folder.fail(e)


def _search(folder: OutputFolder, grid_points: list[dict[str, Any]], inputs: Sequence[str], method: str,
            base: str | None, tasks: list[TaskSpec] | None, score_fn: Callable[[str], float] | None,
            params: dict[str, Any] | None, normalize: bool, limit: int | None, opts: MergeOptions,
            merge_kwargs: dict[str, Any]) -> SearchResult:
    monitor = opts.monitor()
    monitor.check("before the search")
    references = None
    point_seconds: list[dict[str, Any]] = [{} for _ in grid_points]  # in grid order, as the scores
    seconds: dict[str, Any] = {"points": point_seconds}
    selection, normalized = _selection(inputs, tasks, normalize)  # the references: after the first merge pins

    scores: list[dict[str, Any]] = [{} for _ in grid_points]
    best_i, best_score, best_res = -1, float("-inf"), None
    n = len(grid_points)
    for j, i in enumerate(merge_order(grid_points, method, params)):
        point = grid_points[i]
        point_dir = os.path.join(folder.path, f"point-{i:03d}")
        lo, mid, hi = j / n, (j + 0.8) / n, (j + 1) / n  # each point: its merge, then its scoring
        point_opts = opts.replace(quiet=True, overwrite=False,
                                  progress=monitor.child(lo, mid) if monitor.reporting else None)
        t0 = time.perf_counter()
        res = hubsoup.merge(inputs, method, base=base, out=point_dir, params={**(params or {}), **point},
                            options=point_opts, **merge_kwargs)
        t1 = time.perf_counter()
        monitor.check()
        if normalized and references is None:  # after the first merge: it pinned the inputs
            if monitor.reporting:
                monitor.child(mid, mid)(0.0, "eval", "scoring the fine-tunes (references)")
            assert tasks is not None  # normalized: scored with tasks
            references = reference_scores(inputs, res.inputs, res.base, tasks, limit, token=opts.token)
            seconds["references"] = round(time.perf_counter() - t1, 2)
            monitor.check()
            t1 = time.perf_counter()
        if monitor.reporting:
            monitor.child(mid, hi)(0.0, "eval", f"scoring point {j + 1}/{n} {point}")
        entry: dict[str, Any] = {"params": point}
        if score_fn is not None:
            score = float(score_fn(point_dir))
        else:
            assert tasks is not None  # either tasks or a score function (checked by search)
            evals = evaluate_model(point_dir, tasks, limit=limit, quiet=True, token=opts.token)
            score = normalized_score(evals, references)
            entry["metrics"] = {r.task.name: r.metrics for r in evals}
            res.evaluation = evals
        entry["score"] = score
        scores[i] = entry
        point_seconds[i] = {"merge": round(t1 - t0, 2), "score": round(time.perf_counter() - t1, 2)}
        if monitor.reporting:
            monitor.child(mid, hi)(1.0, "eval", f"point {j + 1}/{n} {point}: score {score:.4f}")
        if not opts.quiet:
            print(f"  {point} -> {score:.4f}")
        if score > best_score or (score == best_score and i < best_i):  # a tie: the earlier grid point
            if best_i >= 0:
                shutil.rmtree(os.path.join(folder.path, f"point-{best_i:03d}"), ignore_errors=True)
            best_i, best_score, best_res = i, score, res
        else:
            shutil.rmtree(point_dir, ignore_errors=True)
    best_dir = os.path.join(folder.path, f"point-{best_i:03d}")
    assert best_res is not None  # the grid has a point (checked by search)
    if best_res.evaluation:
        write_results(best_res.evaluation, os.path.join(best_dir, EVAL_FILE))
    found = SearchResult(grid_points[best_i], best_score, scores, selection, best_res, seconds)
    return _keep(folder, best_dir, found, monitor)


def _selection(inputs: Sequence[str], tasks: list[TaskSpec] | None, normalize: bool) -> tuple[str, bool]:
    """What the search maximises (its name) and whether it is normalized by the fine-tunes' own scores."""
    if tasks is None:
        return "score_fn", False
    if normalize and len(tasks) == len(inputs) and all(t.kind == "classification" for t in tasks):
        return "mean normalized accuracy (accuracy / the matching fine-tune's accuracy)", True
    return ("mean accuracy" if any(t.kind == "classification" for t in tasks) else "mean of -log(perplexity)"), False


def _keep(folder: OutputFolder, best_dir: str, found: SearchResult, monitor: Monitor) -> SearchResult:
    """The chosen point's card and ``hubsoup_search.json`` record the grid and every score; then it becomes ``out``."""
    best_res = found.result
    best_res.path = folder.target
    best_res.search = found.to_dict()
    with open(os.path.join(best_dir, "hubsoup_search.json"), "w", encoding="utf-8") as f:
        json.dump({**found.to_dict(), "seconds": found.seconds}, f, indent=2, default=str)
    best_res.write_card(best_dir)
    monitor.check("before the output was committed")
    folder.commit(best_dir)
    if monitor.reporting:
        monitor.finish(f"best {found.best} -> {folder.target}")
    return found


def _search_remote(folder: OutputFolder, grid_points: list[dict[str, Any]], inputs: Sequence[str], method: str,
                   base: str | None, tasks: list[TaskSpec], params: dict[str, Any] | None, normalize: bool,
                   limit: int | None, opts: MergeOptions, executor: Any,
                   resources: dict[str, Any] | None) -> SearchResult:
    """Each point a task of ``executor`` (merged in memory and scored where it runs: :func:`run_trial`); the
    scores come back here in grid order, and the best point alone is merged here into ``out``."""
    monitor = opts.monitor()
    monitor.check("before the search")
    n = len(grid_points)
    # pinned once here: every node merges the same commits, and the one written here is the one scored
    pinned, pinned_base, memory, base_ref, refs = pin_inputs(inputs, base, method, {**(params or {}),
                                                                                  **grid_points[0]}, opts, opts.dtype)
    selection, normalized = _selection(inputs, tasks, normalize)
    seconds: dict[str, Any] = {"points": [{} for _ in grid_points]}
    references = None
    if normalized:
        t0 = time.perf_counter()
        if monitor.reporting:
            monitor.child(0.0, 0.0)(0.0, "eval", "scoring the fine-tunes (references)")
        references = reference_scores(inputs, refs, base_ref, tasks, limit, token=opts.token)
        seconds["references"] = round(time.perf_counter() - t0, 2)
    wanted = {"cpus": 1, "gpus": 1 if str(opts.device).startswith("cuda") else 0, "memory": int(memory * 1.25),
              **(resources or {})}
    options = {k: getattr(opts, k) for k in ("device", "dtype", "allow_pickle", "ignore_extra", "shape_mismatch")}
    order = merge_order(grid_points, method, params)  # equal preparations back to back: a worker shares them
    payloads = [{"number": i, "inputs": pinned, "base": pinned_base, "method": method,
                 "params": {**(params or {}), **grid_points[i]}, "tasks": list(tasks), "limit": limit,
                 "results": True, "options": options} for i in order]
    finished = [0]

    def on_result(r: dict[str, Any]) -> None:
        finished[0] += 1
        if monitor.reporting:
            monitor.child(0.0, 0.9)(finished[0] / n, "eval", f"point {finished[0]}/{n} scored")
        if not opts.quiet:
            print(f"  {grid_points[r['number']]} -> " + ("scored" if r["state"] == "complete"
                                                         else f"failed ({r.get('reason', '')[:120]})"))

    exe = make_executor(executor, resources=wanted)
    try:
        results = {r["number"]: r for r in exe.run(payloads, on_result=on_result, monitor=monitor)}
    finally:
        exe.close()
    scores: list[dict[str, Any]] = [{} for _ in grid_points]
    best_i, best_score, best_rows = -1, float("-inf"), None
    for i in order:  # the local search's order: the same tie-breaking (the earlier grid point)
        r, point = results[i], grid_points[i]
        if r["state"] != "complete":  # as a local search, one point that cannot be merged or scored stops it
            raise HubsoupError(f"search point {point}: {r.get('reason') or 'failed'}")
        evals = [TaskResult.from_dict(row) for row in r["results"]]
        score = normalized_score(evals, references)
        scores[i] = {"params": point, "metrics": {row["task"]: row["metrics"] for row in r["results"]}, "score": score}
        seconds["points"][i] = {"merge": round(r["seconds"].get("merge", 0.0), 2),
                                "score": round(r["seconds"].get("eval", 0.0), 2)}
        if score > best_score or (score == best_score and i < best_i):
            best_i, best_score, best_rows = i, score, r["results"]
    monitor.check()
    if monitor.reporting:
        monitor.child(0.9, 0.99)(0.0, "merge", f"writing the best point {grid_points[best_i]}")
    best_dir = os.path.join(folder.path, f"point-{best_i:03d}")
    t0 = time.perf_counter()
    best_res = hubsoup.merge(pinned, method, base=pinned_base, out=best_dir,
                             params={**(params or {}), **grid_points[best_i]},
                             options=opts.replace(quiet=True, overwrite=False, progress=None))
    seconds["write"] = round(time.perf_counter() - t0, 2)
    assert best_rows is not None  # the grid has a point (checked by search)
    best_res.evaluation = [TaskResult.from_dict(row) for row in best_rows]
    with open(os.path.join(best_dir, EVAL_FILE), "w", encoding="utf-8") as f:
        json.dump(best_rows, f, indent=2)  # the scored candidate's results, as write_results writes them
    found = SearchResult(grid_points[best_i], best_score, scores, selection, best_res, seconds)
    return _keep(folder, best_dir, found, monitor)
