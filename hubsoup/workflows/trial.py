"""One search trial: merge a candidate in memory, score it, forget it.

:func:`run_trial` is what every executor runs (in this process, or as a Ray task on another node):
its argument and its result are plain data (picklable, JSON-able), so a trial is the same function
call wherever it runs. The candidate is merged by the one engine into a model in memory
(:class:`~hubsoup.output.memory.ModelSink`) with the same recipe hash (so the same random draws) as
``hubsoup.merge`` would use, and scored there: nothing is written to disk. A process that runs many trials
keeps a :class:`TrialSession` between them (inputs kept in memory, the model, the evaluator). A trial that fails
(a point the method refuses, NaN weights, out of memory) returns ``state: "fail"`` with the reason
instead of raising, so the study goes on.

Example:
    >>> out = run_trial({"number": 0, "inputs": ["./ft-a", "./ft-b"], "base": "./base", "method": "ties",
    ...                  "params": {"density": 0.4}, "tasks": ["perplexity:val.jsonl"]})   # doctest: +SKIP
    >>> out["state"], out["score"]                                                           # doctest: +SKIP
    ('complete', -3.91)
"""

from __future__ import annotations

import math
import os
import shutil
import socket
import tempfile
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch

from hubsoup.errors import HubsoupError, MergeCancelled, ParameterError
from hubsoup.eval import Evaluator, TaskSpec
from hubsoup.options import DTYPES, MergeOptions
from hubsoup.output.memory import MemorySink, ModelSink, empty_model
from hubsoup.plan import Plan
from hubsoup.recipe import Recipe
from hubsoup.session import Session, open_inputs, parse_method
from hubsoup.sources.access import scope
from hubsoup.sources.taskvector import checkpoints_of

if TYPE_CHECKING:
    from hubsoup.sources.checkpoint import Checkpoint, InputRef
    from hubsoup.sources.taskvector import TaskVector

_OPTION_KEYS = ("device", "dtype", "allow_pickle", "ignore_extra", "shape_mismatch", "token")


KEEP_FRACTION = 0.5
"""A session keeps its inputs in memory when their stored size plus the candidate model fit in this fraction of the
memory available when it opens them; above it they are read from their files (the page cache) on every trial."""


def merge_in_memory(inputs: Sequence[str], method: str, *, base: str | None, params: dict[str, Any],
                    options: Any = None, cancel: Any = None, scratch: str | None = None
                    ) -> tuple[MemorySink, Checkpoint, Recipe]:
    """Merge like :func:`hubsoup.merge` (same validation, plan, placement and recipe hash) into memory.

    Returns ``(sink, base_checkpoint, recipe)``: ``sink.tensors`` are the output tensors (the dtype a
    checkpoint would hold), ``sink.model(base_checkpoint.folder)`` the merged model.
    """
    opts = options if options is not None else MergeOptions(quiet=True)
    m, p = parse_method(method, dict(params))
    if not inputs:
        raise ParameterError("no input models given")
    base_ckpt, sources = open_inputs(inputs, base, m, p, opts, headers_only=True)
    _fetch(base_ckpt, sources)
    sink = MemorySink(Plan.of(base_ckpt, opts.device), dtype=opts.dtype)
    recipe = _merge(base_ckpt, sources, method, params, opts, sink, cancel=cancel, scratch=scratch)
    return sink, base_ckpt, recipe


def _fetch(base_ckpt: Checkpoint, sources: Sequence[TaskVector]) -> None:
    """The weights of Hub inputs opened from their headers, downloaded now (after the fit check)."""
    for ckpt in (base_ckpt, *(getattr(s, "ckpt", None) for s in sources)):
        if ckpt is not None:
            ckpt.fetch()


def _merge(base_ckpt: Checkpoint, sources: Sequence[TaskVector], method: str, params: dict[str, Any],
           opts: MergeOptions, sink: MemorySink, *, cancel: Any = None, scratch: str | None = None,
           prefetch: bool | None = None) -> Recipe:
    """One candidate by the engine into ``sink``, the inputs opened (validation, plan, placement and the recipe hash
    as :func:`hubsoup.merge` has them); returns its recipe."""
    if cancel is not None:
        opts = opts.replace(cancel=cancel)
    m, p = parse_method(method, dict(params))
    # the same session as the written merge's: its recipe hash seeds every random choice (DARE's masks)
    session = Session.over(base_ckpt, sources, m, p, opts, monitor=opts.monitor(), name=method)
    recipe = session.recipe
    assert recipe is not None
    tmp = tempfile.mkdtemp(prefix=".hubsoup-trial-", dir=scratch)
    try:
        try:
            session.run(sink, quiet=True, prefetch=opts.prefetch if prefetch is None else prefetch, scratch=tmp)
        except BaseException:
            sink.abort()
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return recipe


class TrialSession:
    """What a process keeps between the trials of one search (same inputs, base, method, options and tasks): the
    inputs opened once; their weights read once and kept in memory when ``keep`` and they fit
    (:data:`KEEP_FRACTION`; :meth:`~hubsoup.sources.checkpoint.Checkpoint.keep`: the engine streams them from there);
    one candidate model (:func:`~hubsoup.output.memory.empty_model`) whose weights every merge replaces in place
    (:class:`~hubsoup.output.memory.ModelSink`); one :class:`~hubsoup.eval.Evaluator` (tokenizer, data, lm-eval's
    tasks), all made when the session opens. A trial then costs its merge and its evaluation, and scores exactly
    what a fresh process would.

    Example:
        >>> session = TrialSession(payload, keep=True)                                 # doctest: +SKIP
        >>> [session.evaluator.evaluate(session.merge({**payload, "params": p})) for p in points]  # doctest: +SKIP
    """

    def __init__(self, payload: dict[str, Any], *, keep: bool = False):
        self.key = session_key(payload)
        self.opts = _options(payload)
        inputs = list(payload["inputs"])
        if not inputs:
            raise ParameterError("no input models given")
        m, p = parse_method(payload["method"], dict(payload.get("params") or {}))
        self.base_ckpt, self.sources = open_inputs(inputs, payload.get("base"), m, p, self.opts, headers_only=True)
        _fetch(self.base_ckpt, self.sources)
        self.kept = keep and self._fits()
        if self.kept:  # read once, by the first merge's stream, then served from memory
            for ckpt in checkpoints_of(self.base_ckpt, *self.sources):
                ckpt.keep()
        # the model every trial's merge fills in place, and the evaluator, built before the first trial
        self.model: Any = empty_model(self.base_ckpt.folder, Plan.of(self.base_ckpt, self.opts.device),
                                      dtype=self.opts.dtype).to(self.opts.device)
        tasks = [TaskSpec.parse(t) if isinstance(t, str) else t for t in payload.get("tasks") or ()]
        self.evaluator = Evaluator(tasks, tokenizer=self.base_ckpt.folder, limit=payload.get("limit"),
                                   batch_size=int(payload.get("batch_size") or 32), device=self.opts.device,
                                   quiet=True, token=self.opts.token)
        self.evaluator.prepare(self.model)

    def _fits(self) -> bool:
        import psutil  # lazy: installed with accelerate (its memory budgets); only a kept session asks

        stored = sum(c.stored_bytes() for c in checkpoints_of(self.base_ckpt, *self.sources))
        dtype = DTYPES[self.opts.dtype] if self.opts.dtype else None
        model = sum(math.prod(e.shape) * (dtype if dtype and e.mergeable else e.dtype).itemsize
                    for _, e in Plan.of(self.base_ckpt, "cpu").entries())
        return bool(stored + model <= KEEP_FRACTION * psutil.virtual_memory().available)  # psutil: untyped

    def merge(self, payload: dict[str, Any]) -> Any:
        """The payload's candidate merged into this session's model, in place; returns the model."""
        opts = self.opts
        sink = ModelSink(Plan.of(self.base_ckpt, opts.device), self.model, dtype=opts.dtype)
        _merge(self.base_ckpt, self.sources, payload["method"], payload.get("params") or {}, opts, sink,
               cancel=payload.get("cancel"), scratch=payload.get("scratch"),
               prefetch=False if self.kept else None)  # in memory: nothing to read ahead
        return self.model

    def close(self) -> None:
        """Drop the model and what was kept (the session is not used again)."""
        self.model = None
        for ckpt in checkpoints_of(self.base_ckpt, *self.sources):
            ckpt.forget()
            ckpt.release()


def session_key(payload: dict[str, Any]) -> tuple[Any, ...]:
    """What a :class:`TrialSession` depends on: trials with the same key share one."""
    return (tuple(payload["inputs"]), payload.get("base"), payload["method"],
            tuple(sorted((k, repr(v)) for k, v in (payload.get("options") or {}).items())),
            tuple(repr(t) for t in payload.get("tasks") or ()), payload.get("limit"), payload.get("batch_size"),
            bool(payload.get("hub_only")))


class TrialSessions:
    """The session of the search a process is running (one at a time: another search's trial replaces it)."""

    def __init__(self) -> None:
        self.current: TrialSession | None = None

    def get(self, payload: dict[str, Any]) -> TrialSession:
        key = session_key(payload)
        if self.current is None or self.current.key != key:
            self.close()
            self.current = TrialSession(payload, keep=bool(payload.get("keep")))
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


def _options(payload: dict[str, Any]) -> MergeOptions:
    return MergeOptions(quiet=True, **{k: v for k, v in (payload.get("options") or {}).items()
                                       if k in _OPTION_KEYS and v is not None})


def pin_inputs(models: Sequence[str], base: str | None, method: str, params: dict[str, Any], options: Any,
               dtype: str | None = None, *, keep: bool = False
               ) -> tuple[list[str], str, int, InputRef, list[InputRef]]:
    """The inputs and base pinned once on the driver (Hub IDs -> ``org/name@SHA``), checked against each other
    from their headers, and the memory one candidate needs as the planner predicts it: the merge's peak working
    set plus the merged model held in memory (Ray's memory request); with ``keep``, plus the inputs' and base's
    stored size (a :class:`TrialSession` that keeps them in memory).

    Returns ``(inputs, base, memory, base_ref, input_refs)`` (the refs: :class:`~hubsoup.sources.InputRef`).
    """
    m, p = parse_method(method, dict(params))
    session = Session.open(list(models), m, p, options, base=base, name=method, recipe=False)
    base_ckpt, sources, plan = session.base, session.sources, session.plan
    held = sum(math.prod(e.shape) * (DTYPES[dtype] if dtype and e.mergeable else e.dtype).itemsize
               for _, e in plan.entries())
    if keep:
        held += sum(c.stored_bytes() for c in checkpoints_of(base_ckpt, *sources))
    peak = max(session.placement.peak.values())
    return ([s.ref.pinned_spec for s in sources], base_ckpt.ref.pinned_spec, peak + held,
            base_ckpt.ref, [s.ref for s in sources])


def selection_score(results: Sequence[Any], metric: str | None = None) -> float:
    """The number a search maximises: ``metric`` (``TASK/METRIC``, or ``METRIC`` with one task), else the mean
    over tasks of each task's score (accuracy; ``-log(perplexity)``; an lm-eval task's main metric).

    A metric where lower is better (perplexity, an lm-eval metric lm-eval marks so) counts negated.

    >>> from hubsoup.eval import TaskResult, TaskSpec
    >>> r = [TaskResult(TaskSpec.parse("perplexity:a.jsonl"), {"perplexity": math.e}, 3)]
    >>> selection_score(r), selection_score(r, "a/perplexity")
    (-1.0, -2.718281828459045)
    """
    if metric:
        task_name, _, name = metric.rpartition("/")
        rows = [r for r in results if not task_name or r.task.name == task_name]
        if not task_name and len(rows) > 1:
            raise ParameterError(f"eval metric '{metric}': several tasks; write TASK/METRIC "
                                 f"(tasks: {', '.join(r.task.name for r in results)})")
        if not rows:
            raise ParameterError(f"eval metric '{metric}': no task named '{task_name}' "
                                 f"(tasks: {', '.join(r.task.name for r in results)})")
        r = rows[0]
        if name not in r.metrics:
            raise ParameterError(f"eval metric '{metric}': task '{r.task.name}' has no metric '{name}' "
                                 f"(metrics: {', '.join(sorted(r.metrics))})")
        lower = name == "perplexity" or name in (r.details.get("lower_is_better") or ())
        return -float(r.metrics[name]) if lower else float(r.metrics[name])
    vals = [-math.log(r.metrics["perplexity"]) if r.task.kind == "perplexity" else float(r.score) for r in results]
    return sum(vals) / len(vals)


def run_trial(payload: dict[str, Any], sessions: "TrialSessions | None" = None) -> dict[str, Any]:
    """Merge and score one candidate; never raises for the candidate's own failure (see the module doc).

    ``payload["hub_only"]``: the driver's ``hub_only`` rule, which an executor's worker process does not
    inherit (a scope lives in the driver's thread): the worker enters it again, so a server's run stays Hub-only
    on every node, whatever the payload names.

    ``payload``: ``number``, ``inputs``, ``base``, ``method``, ``params``; ``tasks`` (spec strings or
    :class:`~hubsoup.eval.TaskSpec`), optional ``metric``, ``limit``, ``batch_size``, ``options`` (merge
    options by name: device, dtype, ...), ``scratch`` (a folder for temporary files), ``cancel``
    (local runs only), ``results`` (True: return each task's result and leave the scoring to the caller, a
    grid search's normalized accuracy or a pipeline's selection: ``score`` is then None).
    Returns ``number``, ``state`` (``complete``/``fail``), ``score``, ``metrics`` ({task: {metric: value}}),
    ``results`` (with ``results``: :meth:`TaskResult.to_dict` rows, as ``eval_results.json`` holds them),
    ``reason`` and ``error`` (a failed trial's: ``type``, ``message``, ``hubsoup``: whether it is a
    :class:`~hubsoup.errors.HubsoupError`), ``seconds`` (``open``: the session opened (once per process and
    search: inputs opened, checked and kept, the model built, the evaluator prepared), ``merge``, ``eval``,
    ``total``), ``session`` (``new``; ``kept``: the inputs held in memory) and ``host``/``pid``.

    ``sessions``: this process' :class:`TrialSessions`: the trial uses its session (inputs, model, evaluator) and
    leaves it for the next one (``payload["keep"]``: the inputs' weights kept in memory, when they fit); None: the
    trial opens and builds everything itself. Either way the same result, bit for bit.
    """
    # a scope only ever gets stricter: a no-op where it was; a trial's inputs come from the Hub cache (downloaded once
    # per machine, read by every trial), not read in place again by each; task code only where the driver's
    # operator allowed it
    with scope(hub_only=bool(payload.get("hub_only")), cache_inputs=True,
               allow_task_code=bool(payload.get("allow_task_code"))):
        return _run_trial(payload, sessions)


def _run_trial(payload: dict[str, Any], sessions: "TrialSessions | None" = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    out: dict[str, Any] = {"number": payload.get("number"), "host": socket.gethostname(), "pid": os.getpid()}
    seconds = {"open": 0.0, "merge": 0.0, "eval": 0.0}
    try:
        threads = payload.get("threads")
        if threads:  # the same reduction order wherever the trial runs: the same scores bit for bit
            torch.set_num_threads(int(threads))
        fresh = sessions is None or sessions.current is None or sessions.current.key != session_key(payload)
        session = TrialSession(payload) if sessions is None else sessions.get(payload)
        t1 = time.perf_counter()
        seconds["open"] = t1 - t0
        try:
            model = session.merge(payload)
            t2 = time.perf_counter()
            seconds["merge"] = t2 - t1
            out["session"] = {"new": fresh, "kept": session.kept}
            results = session.evaluator.evaluate(model)
            del model
        finally:
            if sessions is None:
                session.close()
        seconds["eval"] = time.perf_counter() - t2
        if payload.get("results"):  # the caller scores them
            out.update(state="complete", score=None, results=[r.to_dict() for r in results],
                       metrics={r.task.name: dict(r.metrics) for r in results})
            seconds["total"] = time.perf_counter() - t0
            out["seconds"] = {k: round(v, 4) for k, v in seconds.items()}
            return out
        score = selection_score(results, payload.get("metric"))
        if not math.isfinite(score):
            raise ParameterError(f"the score is {score} (the merged model's outputs are not finite)")
        out.update(state="complete", score=score,
                   metrics={r.task.name: {k: v for k, v in r.metrics.items() if k != "tokens"} for r in results})
    except (KeyboardInterrupt, MergeCancelled):
        raise
    except Exception as e:  # noqa: BLE001 - a bad point or an OOM fails this trial, not the study
        out.update(state="fail", score=None, metrics={}, reason=f"{type(e).__name__}: {' '.join(str(e).split())}")
        if payload.get("results"):
            out["error"] = {"type": type(e).__name__, "message": str(e), "hubsoup": isinstance(e, HubsoupError)}
    seconds["total"] = time.perf_counter() - t0
    out["seconds"] = {k: round(v, 4) for k, v in seconds.items()}
    return out
