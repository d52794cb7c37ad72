"""Run a pipeline: plan from the Hub, merge, evaluate, select, publish, write the leaderboard.

The Hub is the pipeline's memory. A merge is identified by its recipe hash (method, parameters,
base and inputs by commit SHA, dtype, result-changing options), which is computed before any
weight is read; a merge whose hash some hubsoup repo of the target namespace already holds (its
``hubsoup_recipe.yaml``) is not made again, and a merge the leaderboard on the Hub lists as not
selected is not made again either unless the selection now wants it.

**What a kill loses.** Without ``select.top_k`` each merge is published in one commit as soon as it
is selected (merged, evaluated, past the threshold), so a killed run loses only the merge in
progress (whose temporary folder the next run's output lock clears). A merge pushed without an evaluation
(``push.stream``, the default) is streamed to its repo as it is written: a kill or a failed push leaves
nothing in ``work_dir`` and nothing committed, and the next run resumes it (the shards the Hub already holds
are neither merged nor uploaded again). With ``select.top_k`` the
selection needs every score, so the pushes come once every merge is scored: a kill before them
publishes nothing, and the finished merges stay in ``work_dir`` (the shipped CI workflow caches
it), where the next run verifies and reuses them instead of merging again. A kill during the
pushes leaves every push before it published and the one in flight whole or absent (one commit).
``work_dir`` is a cache, locked for the whole run (a second run on it fails at once): a merge
there is pushed only if its files still match the checksums recorded when it was made
(``merges/HASH.manifest.json``); the card is rendered again before every push.

Failures are isolated: a candidate that cannot be read (missing, private, gated), whose config
is not the base's architecture, whose license forbids derivatives or cannot be read, or whose
weights break its merge or its evaluation (NaN/inf scores, an overflowing or constant-logits
model), is reported and left out; the other merges go on, and are pushed and put on the
leaderboard. Licenses are combined (:mod:`hubsoup.workflows.pipeline.licenses`); a merge whose
licenses cannot be combined is refused. Private and gated repos go into public merges only with
``allow_private_inputs: true`` (their cards then say so). The leaderboard on the Hub is committed
only when its content changed (compared byte for byte, on any Hub).

The stages, one module each: :mod:`~hubsoup.workflows.pipeline.plan` (query and plan),
:mod:`~hubsoup.workflows.pipeline.execute` (merge, evaluate, select: :mod:`~hubsoup.workflows.pipeline.select`),
:mod:`~hubsoup.workflows.pipeline.publish` (verify, card, push), :mod:`~hubsoup.workflows.pipeline.leaderboard`;
what a run holds is :class:`~hubsoup.workflows.pipeline.context.Run`, what it found and did
:class:`~hubsoup.workflows.pipeline.report.PipelineReport`, the work folder's cache
:mod:`~hubsoup.workflows.pipeline.workfolder`.

Example:
    >>> from hubsoup.workflows.pipeline import run_pipeline
    >>> report = run_pipeline("examples/pipelines/pipeline.yml", dry_run=True)   # doctest: +SKIP
    >>> report.exit_code                                                          # doctest: +SKIP
    0
"""


from __future__ import annotations

import os
import sys
from typing import Any, Callable, TextIO


from hubsoup.hubclient import Token, hub_api
from hubsoup.output.folder import OutputLock
from hubsoup.sources.access import scope
from hubsoup.workflows.executors import check_executor
from hubsoup.workflows.pipeline.config import Pipeline, load_pipeline
from hubsoup.workflows.pipeline.context import Run
from hubsoup.workflows.pipeline.execute import execute
from hubsoup.workflows.pipeline.leaderboard import leaderboard
from hubsoup.workflows.pipeline.plan import plan
from hubsoup.workflows.pipeline.report import PipelineReport, PlannedMerge, print_plan, print_summary


def run_pipeline(source: str | os.PathLike[str] | dict[str, Any] | Pipeline, *, dry_run: bool = False,
                 token: Token = None, work_dir: str | None = None, stream: TextIO | None = None,
                 on_event: Callable[[str, PlannedMerge], None] | None = None, hub_only: bool = False,
                 executor: Any = None, resources: dict[str, Any] | None = None,
                 allow_task_code: bool = False) -> PipelineReport:
    """Run (or with ``dry_run`` only plan) a pipeline; see :mod:`hubsoup.workflows.pipeline.run`.

    Args:
        source: a pipeline YAML file, its mapping, or a loaded :class:`Pipeline`.
        dry_run: print the plan (merges to do, skipped and why, bytes to download) and stop:
            nothing is downloaded but cards and configs, nothing is merged or pushed.
        token: Hub token (default: ``HF_TOKEN`` or the stored login). Never printed or stored.
        work_dir: overrides the pipeline's ``work_dir`` (merge outputs and the local leaderboard).
        stream: where progress lines go (default: stdout).
        on_event: called as ``on_event(kind, merge)`` with kind ``merged``, ``pushed``, ``failed``
            or ``skipped``, for apps and tests.
        hub_only: every model and evaluation dataset must be a Hub ID (no local path is looked at;
            :mod:`hubsoup.sources.access`), as for a server; an lm-eval ``task_dir`` is a Hub repo, its Python
            refused unless ``allow_task_code`` (:mod:`hubsoup.eval.lmeval`).
        executor: ``None``/``"local"`` (this process, the default), ``"ray"`` (``RAY_ADDRESS`` or a local
            cluster), ``"ray://HOST:PORT"`` or an executor object (:mod:`hubsoup.workflows.executors`). With
            Ray and ``eval`` tasks, every merge to make is a task (merged in memory and evaluated on its node,
            requesting ``resources``: ``cpus``, ``gpus``, ``memory``, default the planner's prediction), the
            scores come back here, and only the merges to publish are written (to ``work_dir``) and pushed,
            from here: the same leaderboard as a local run. The nodes read the Hub with their own login.

    Returns:
        :class:`PipelineReport` (``exit_code`` 0 when nothing failed, else 1).

    Raises:
        hubsoup.errors.HubsoupError: the pipeline itself cannot run (bad file, base unreadable, a
            private or gated base for public repos, Hub query failing after its retries, a malformed
            leaderboard on the Hub).
        hubsoup.errors.OutputLockedError: another run holds the same ``work_dir`` (it is locked for
            the whole run, so two runs at once never share merges or mark each other's failed).

    Example:
        >>> report = run_pipeline("pipeline.yml", token=os.environ["HF_TOKEN"])   # doctest: +SKIP
        >>> [m.url for m in report.by_status("published")]                         # doctest: +SKIP
    """
    check_executor(executor)
    with scope(hub_only=hub_only, allow_task_code=allow_task_code):
        return _run_pipeline(source, dry_run, token, work_dir, stream, on_event, executor, resources)


def _run_pipeline(source: str | os.PathLike[str] | dict[str, Any] | Pipeline, dry_run: bool, token: Token,
                  work_dir: str | None, stream: TextIO | None,
                  on_event: Callable[[str, PlannedMerge], None] | None, executor: Any = None,
                  resources: dict[str, Any] | None = None) -> PipelineReport:
    p = source if isinstance(source, Pipeline) else load_pipeline(source)
    out = stream or sys.stdout
    emit = on_event or (lambda kind, m: None)
    work = os.path.abspath(os.path.join(p.root, work_dir or p.work_dir))
    api = hub_api(token)
    run = Run(p, api, token, work, out, emit)
    run.executor, run.resources = executor, resources
    run.check_data()
    if dry_run:
        report = plan(run)
        report.dry_run = True
        print_plan(report, out)
        return report

    os.makedirs(os.path.dirname(work), exist_ok=True)
    with OutputLock(work, what="pipeline work folder"):
        report = plan(run)
        execute(run, report)
        leaderboard(run, report)
    print_summary(report, out)
    return report


__all__ = ["run_pipeline"]
