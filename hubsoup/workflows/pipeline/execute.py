"""Making a pipeline's merges: each merged (here, streamed straight to its repo, or as an executor's task merged in
memory and scored there), evaluated and scored; one candidate that breaks its merge is left out of the merges
after it; with ``select:``, the top ones (:mod:`~hubsoup.workflows.pipeline.select`) are published
(:mod:`~hubsoup.workflows.pipeline.publish`)."""

from __future__ import annotations

import logging
import os
from typing import Any

from hubsoup.api import MergeResult, merge
from hubsoup.errors import HubsoupError
from hubsoup.eval import evaluate_model
from hubsoup.eval.run import EVAL_FILE, write_results
from hubsoup.formats import stages
from hubsoup.hub import PushTarget as StreamTarget
from hubsoup.untrusted import read_json
from hubsoup.workflows.executors import make_executor
from hubsoup.workflows.pipeline import hubio, plan, publish, select, workfolder
from hubsoup.workflows.pipeline.context import Run
from hubsoup.workflows.pipeline.hubio import with_retry
from hubsoup.workflows.pipeline.report import FAILED, NOT_SELECTED, PLANNED, PUBLISHED, PipelineReport, PlannedMerge
from hubsoup.workflows.rerun import run_config, run_stages
from hubsoup.workflows.trial import pin_inputs

log = logging.getLogger(__name__)


def _run_config(run: Run, m: PlannedMerge, out: str | None, **push: Any) -> MergeResult:
    """Run a ``config:`` merge's mergekit config (pinned) into ``out`` (or streamed: ``push``, ``before_push``),
    then evaluate it as any merge."""
    opts = {**run.p.options, "token": run.token, "quiet": True, "overwrite": True, **push}
    if stages.is_multi_stage(m.spec.text):  # every stage's Hub models pinned (its earlier stages are folders)
        if out is None:  # streamed: the earlier stages are folders of the work folder, as beside an output
            opts["intermediate_dir"] = os.path.join(run.work, "merges", f".{m.work_key}.stages")
        result = run_stages(m.spec.text, out, pins=m.pins, **opts)
    else:
        result = run_config(m.spec.text, out, pins=m.pins, **opts)
    if run.tasks and out is not None:
        result.evaluation = evaluate_model(out, run.tasks, limit=run.p.eval.limit if run.p.eval else None,
                                           device=run.opts.device, quiet=True, token=run.token)
        write_results(result.evaluation, os.path.join(out, EVAL_FILE))
        result.write_card(out)
    return result


def execute(run: Run, report: PipelineReport) -> None:
    """Make, score, select and publish the planned merges (the executor, if one was made, closed at the end)."""
    try:
        _execute(run, report)
    finally:
        if run.exe is not None:  # an executor serves the whole run (its cluster connection, its workers)
            run.exe.close()
            run.exe = None


def _execute(run: Run, report: PipelineReport) -> None:
    sel = run.p.select
    broken: dict[str, str] = {}
    queue = [m for m in report.merges if m.status == PLANNED and not m.deferred]
    if run.remote:  # every merge to make at once, on the cluster; used below in the local run's order
        _score_remote(run, [m for m in queue if not m.work_key and _cached(run, m) is None])
    extra_all: list[PlannedMerge] = []
    while queue:
        m = queue.pop(0)
        hit = next((i.repo_id for i in m.inputs if i.repo_id in broken), None)
        if hit is not None:
            m.status, m.reason = FAILED, f"candidate {hit} failed: {broken[hit]}"
            run.emit("failed", m)
        else:
            culprit = _merge_streamed(run, m) if _streams(run, m) else _merge(run, m)
            if culprit is not None:
                broken[culprit] = m.reason
        if m.status == FAILED and m.spec.combine == "all" and m.spec.config is None:  # an `all` merge goes on without the broken candidates
            rest = [i for i in m.inputs if i.repo_id not in broken]
            if rest and len(rest) < len(m.inputs):
                replacement = plan.plan_one(run, m.spec_index, m.spec, report.base, rest)
                if replacement.recipe_hash not in {x.recipe_hash for x in report.merges + extra_all}:
                    extra_all.append(replacement)
                    if replacement.status == PLANNED and not replacement.deferred:
                        queue.append(replacement)
        if m.status in (FAILED, PUBLISHED):  # published: streamed to the Hub as it was merged
            continue
        if sel is None or (sel.top_k is None and select.passes(run.p.select, m)):
            publish.push(run, m)
        elif sel.top_k is None:
            m.status = NOT_SELECTED
    report.merges.extend(extra_all)
    for c in report.candidates:
        if c.info is not None and c.info.repo_id in broken and not c.error:
            c.error = broken[c.info.repo_id]
    if sel is not None:
        _select(run, report)


def _select(run: Run, report: PipelineReport) -> None:
    """Top-k / threshold over this run's merges, the published ones and those the Hub's leaderboard rejected."""
    sel = run.p.select
    assert sel is not None  # _execute calls it for a pipeline with select:
    for m in report.merges:
        if m.status == PUBLISHED and not m.scores and m.action.startswith("skipped"):
            pub = run.published.get(m.recipe_hash)
            if pub is not None:
                m.scores = with_retry(lambda: hubio.published_scores(pub, run.retry, run.token),
                                      f"scores of {pub.repo_id}", run.retry)
        if m.scores and m.score is None:
            m.score = select.score(run.p.select, m.scores)
    pool = [m for m in report.merges if m.status in (PUBLISHED, NOT_SELECTED)
            or (m.status == PLANNED and (m.path or m.deferred or m.results is not None))]
    sign = 1 if select.goal(sel) == "max" else -1
    ranked = sorted(pool, key=lambda m: (m.score is None, -sign * (m.score or 0.0), m.recipe_hash))
    top = {id(m) for m in (ranked[:sel.top_k] if sel.top_k is not None else ranked)}
    for m in ranked:
        if m.status != PLANNED:
            continue
        if id(m) in top and m.score is not None and select.passes(run.p.select, m):
            if m.deferred:  # rejected before, wanted now: merge it (again) and publish it
                m.deferred = False
                if _merge(run, m) is not None or m.status == FAILED:
                    continue
            publish.push(run, m)
        else:
            m.status = NOT_SELECTED
            m.action = m.action or ("not selected (stored score)" if m.deferred else "not selected")
            if m.score is None:
                m.reason = f"no finite '{sel.metric}' score"


def _merge(run: Run, m: PlannedMerge) -> str | None:
    """Make (or find, verified, in the work folder) the merge and score it; on failure its status says
    why and the culprit is returned (when the error names one input)."""
    out = workfolder.out_path(run, m)
    base_pinned = run.base.pinned
    try:
        result = _cached(run, m, report_stale=True)
        if result is None and run.remote and not m.work_key:
            return _merge_remote(run, m)
        if result is None:
            workfolder.remove(workfolder.manifest_path(run, m))  # a merge made again is trusted once its new manifest is written
            if m.work_key:
                result = with_retry(lambda: _run_config(run, m, out), f"merge {m.label}", run.retry)
                m.recipe_hash = result.recipe.hash  # known now: the manifest, leaderboard and push use it
            else:
                result = None
            result = result or with_retry(
                lambda: merge([i.pinned for i in m.inputs], m.spec.method, base=base_pinned, out=out,
                              params=dict(m.spec.params), options=run.opts.replace(overwrite=True),
                              evaluate=run.tasks or None, eval_limit=run.p.eval.limit if run.p.eval else None),
                f"merge {m.label}", run.retry)
            workfolder.write_manifest(run, m, result.path)
            m.action = "merged"
        else:
            m.action = "merged (found in the work folder)"
    except Exception as e:  # noqa: BLE001 - one candidate's merge or evaluation never stops the others
        return _merge_failed(run, m, e)
    if result.recipe.hash != m.recipe_hash:  # the plan's prediction must hold, or idempotency would not
        log.warning("recipe hash of %s is %s, planned %s", m.label, result.recipe.hash[:12], m.recipe_hash[:12])
        m.recipe_hash = result.recipe.hash
    m.path = result.path
    try:
        m.scores = hubio.flatten_scores(read_json(os.path.join(out, hubio.EVAL_FILE)) or [])
    except ValueError:
        m.scores = {}
    _scored(run, m)
    return None


def _streams(run: Run, m: PlannedMerge) -> bool:
    """Whether ``m`` is streamed to the Hub as it is merged: pushed without an evaluation, none of it in the work
    folder already (a merge found there is verified and pushed as before)."""
    return (run.p.push.stream and not run.tasks and run.p.select is None and not run.remote
            and _cached(run, m) is None)


def _merge_streamed(run: Run, m: PlannedMerge) -> str | None:
    """Merge ``m`` straight to its repo (its card rendered with the pipeline's license before the one commit);
    on failure its status says why and the culprit is returned (when the error names one input)."""
    problem = publish.target_problem(run, m)
    if problem == "same":
        run.line(f"skipped    {m.label}: {m.url} already holds it (published by another run meanwhile)")
        return None
    if problem:
        run.failed(m, problem)
        return None
    run.emit("pushing", m)
    message = f"Upload {m.spec.method} merge made with a hubsoup pipeline (recipe {m.recipe_hash[:12]})"
    target = StreamTarget(m.repo_id, private=run.p.push.private or None, token=run.token,
                          commit_message=message, allow_private_inputs=run.p.allow_private_inputs,
                          work_dir=os.path.join(run.work, "merges"))
    assert target.work_dir is not None  # given just above
    os.makedirs(target.work_dir, exist_ok=True)

    def card(result: MergeResult, folder: str) -> None:
        publish.write_card(run, m, result, folder)

    try:
        if m.work_key:
            result = with_retry(lambda: _run_config(run, m, None, push=target, before_push=card),
                                f"merge {m.label}", run.retry)
        else:
            result = with_retry(
                lambda: merge([i.pinned for i in m.inputs], m.spec.method, base=run.base.pinned, push=target,
                              params=dict(m.spec.params), options=run.opts, before_push=card),
                f"merge {m.label}", run.retry)
    except Exception as e:  # noqa: BLE001 - one candidate's merge or push never stops the others
        return _merge_failed(run, m, e)
    if result.recipe.hash != m.recipe_hash:
        if not m.work_key:
            log.warning("recipe hash of %s is %s, planned %s", m.label, result.recipe.hash[:12], m.recipe_hash[:12])
        m.recipe_hash = result.recipe.hash
    m.action = "merged"
    _scored(run, m)
    publish.pushed(run, m, result.pushed)
    return None


def _merge_failed(run: Run, m: PlannedMerge, e: Exception) -> str | None:
    """``m``'s merge (or its evaluation, or its streamed push) raised ``e``: it failed, and the other merges go on;
    returns the input the error names, when it names one (a broken candidate, left out of the merges after it)."""
    if not isinstance(e, HubsoupError):
        log.debug("merge %s failed", m.label, exc_info=True)
    text = run.public(e)
    culprits = [i.repo_id for i in m.inputs if i.repo_id in str(e)] if isinstance(e, HubsoupError) else []
    run.failed(m, text if isinstance(e, HubsoupError) else f"{type(e).__name__}: {text}")
    return culprits[0] if len(culprits) == 1 else None


def _scored(run: Run, m: PlannedMerge) -> None:
    """``m.scores`` are in: a merge that cannot be scored fails, the others are ranked."""
    bad = hubio.non_finite(m.scores)
    if run.tasks and (bad or not m.scores):  # a merge that cannot be scored is never ranked
        run.failed(m, f"evaluation gave a non-finite {bad[0]} ({m.scores[bad[0]]})" if bad
                   else "evaluation gave no scores")
        return None
    m.score = select.score(run.p.select, m.scores)
    run.emit("merged", m)
    shown = "  ".join(f"{k}={v:.4f}" for k, v in sorted(m.scores.items()))
    verb = {"merged": "merged    ", "scored": "scored    "}.get(m.action, "reused    ")  # reused: verified
    run.line(f"{verb} {m.label}" + (f"  {shown}" if shown else ""))
    return None


def _cached(run: Run, m: PlannedMerge, report_stale: bool = False) -> MergeResult | None:
    """The merge in the work folder when it is exactly this one (recipe and manifest), else None."""
    out = workfolder.out_path(run, m)
    if not os.path.isfile(os.path.join(out, hubio.RECIPE_FILE)):
        return None
    problem = workfolder.verify(run, m, out)
    if problem is not None:
        if report_stale:
            run.line(f"stale      {m.label}: the merge in the work folder {problem}; merging it again")
        return None
    try:
        cached = MergeResult.from_folder(out)
    except HubsoupError:
        return None
    if m.work_key:  # a config merge: its manifest (checked) holds its recipe hash
        m.recipe_hash = cached.recipe.hash
    return cached if cached.recipe.hash == m.recipe_hash else None


def _score_remote(run: Run, merges: list[PlannedMerge]) -> None:
    """Merge and score ``merges`` as the executor's tasks (:func:`hubsoup.workflows.trial.run_trial`); the
    results wait in :attr:`Run.scored` for the run's own order."""
    if not merges:
        return

    opts = run.opts
    options = {k: getattr(opts, k) for k in ("device", "dtype", "allow_pickle", "ignore_extra", "shape_mismatch")}
    payloads = [{"number": i, "inputs": [x.pinned for x in m.inputs], "base": run.base.pinned,
                 "method": m.spec.method, "params": dict(m.spec.params), "tasks": list(run.tasks),
                 "limit": run.p.eval.limit if run.p.eval else None, "results": True, "options": options}
                for i, m in enumerate(merges)]
    wanted = {"cpus": 1, "gpus": 1 if str(opts.device).startswith("cuda") else 0, **(run.resources or {})}
    if "memory" not in wanted and run.exe is None:  # the planner's prediction for the largest merge, +25 %
        wanted["memory"] = int(max(_memory(run, m) for m in merges) * 1.25)
    if run.exe is None:
        run.exe = make_executor(run.executor, resources=wanted)
    for m, r in zip(merges, run.exe.run(payloads)):
        run.scored[m.recipe_hash] = r


def _memory(run: Run, m: PlannedMerge) -> int:
    """The planner's prediction of ``m``'s peak memory (0 when it cannot be planned)."""
    try:
        return pin_inputs([x.pinned for x in m.inputs], run.base.pinned, m.spec.method, dict(m.spec.params),
                          run.opts, run.opts.dtype)[2]
    except Exception:  # noqa: BLE001 - its task reports what is wrong; request nothing for it
        return 0


def _merge_remote(run: Run, m: PlannedMerge) -> str | None:
    """``m`` as an executor's task merged and scored it (asked now if it was planned after the batch)."""
    r = run.scored.pop(m.recipe_hash, None)
    if r is None:  # planned after the batch (an `all` merge without a broken candidate, a deferred one)
        _score_remote(run, [m])
        r = run.scored.pop(m.recipe_hash)
    if r["state"] != "complete":
        err = r.get("error") or {}
        raw = err.get("message") or r.get("reason") or "failed"
        text = run.public(raw)  # as a local run reports it: HubsoupError text, else "Type: text"
        culprits = [i.repo_id for i in m.inputs if i.repo_id in raw] if err.get("hubsoup") else []
        run.failed(m, text if err.get("hubsoup") else f"{err.get('type', 'Error')}: {text}")
        return culprits[0] if len(culprits) == 1 else None
    m.results, m.action = r["results"], "scored"
    try:
        m.scores = hubio.flatten_scores(r["results"])
    except ValueError:
        m.scores = {}
    _scored(run, m)
    return None
