"""``hubsoup pipeline PIPELINE.yml``: an unattended merge → eval → push pipeline (see :mod:`hubsoup.workflows.pipeline`)."""

from __future__ import annotations

import os
import signal
import sys
from typing import TYPE_CHECKING

from hubsoup.cli import signals
from hubsoup.errors import ParameterError

if TYPE_CHECKING:
    import argparse

    from hubsoup.workflows.pipeline.report import PlannedMerge


def cmd_pipeline(args: argparse.Namespace) -> int:
    from hubsoup.workflows.pipeline import run_pipeline  # lazy: keeps hubsoup --help free of torch

    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise ParameterError(f"--token-env {args.token_env}: that environment variable is not set or empty")
    done: list[str] = []
    pushing: list[str] = []

    def on_event(kind: str, m: PlannedMerge) -> None:
        if kind == "pushing":
            pushing[:] = [m.repo_id]
        elif kind in ("pushed", "failed"):
            if kind == "pushed":
                done.append(m.repo_id)
            pushing.clear()

    mark = signals.mark_now()
    try:
        report = run_pipeline(args.pipeline, dry_run=args.dry_run, token=token, work_dir=args.work_dir,
                              on_event=on_event, hub_only=args.hub_only, executor=args.executor,
                              allow_task_code=args.allow_task_code)
    except BaseException as e:  # what was published stays published: say so, not "nothing was left"
        sig = signals.received(mark, e)  # a signal may arrive as another error (see hubsoup.cli.signals)
        if sig is None:
            raise
        print(interrupted_message(sig == signal.SIGTERM, done, pushing[0] if pushing else None), file=sys.stderr)
        return signals.EXIT_CODES[sig]
    return report.exit_code


def interrupted_message(sigterm: bool, pushed: list[str], pushing: str | None) -> str:
    """What an interrupted pipeline run leaves, in one line (every interrupted command ends with one): the merges it
    pushed, the push in flight, nothing else on the Hub.

    Example:
        >>> print(interrupted_message(True, ["org/a"], "org/b"))
        terminated (SIGTERM): 1 merge(s) were published by this run and stay on the Hub: org/a; the push of org/b was in flight: a push is one commit, so it is on the Hub whole or not at all; the leaderboard was not updated and finished merges not yet pushed stay in the work folder: run the pipeline again to finish (what is published is found on the Hub and not made again)
    """
    head = "terminated (SIGTERM)" if sigterm else "interrupted"
    parts = [f"{head}: {len(pushed)} merge(s) were published by this run and stay on the Hub: {', '.join(pushed)}"
             if pushed else f"{head}: no merge was published by this run"]
    if pushing:
        parts.append(f"the push of {pushing} was in flight: a push is one commit, so it is on the Hub whole or not at "
                     "all")
    parts.append("the leaderboard was not updated and finished merges not yet pushed stay in the work folder: run the "
                 "pipeline again to finish (what is published is found on the Hub and not made again)")
    return "; ".join(parts)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "pipeline", help="run an unattended merge -> eval -> push pipeline (candidates from a list or a Hub query)",
        description="Run the pipeline file: find candidates (a list and/or a Hub query), plan the merges, skip those "
                    "already published in the target namespace (found on the Hub by recipe hash), merge, evaluate, "
                    "select, push each in one commit as soon as it is selected (with select.top_k: once every "
                    "merge is scored), and write a leaderboard (markdown + JSON; a Hub commit only when it changed). "
                    "A failing candidate is reported and left out. Exit status: 0 when nothing failed, 1 when a "
                    "candidate or a merge failed or was refused for its license's terms (the rest was done), 2 when "
                    "the pipeline cannot run at all (another run holds the work folder, a malformed leaderboard "
                    "on the Hub, ...), 130/143 when interrupted (what was pushed stays published).")
    p.add_argument("pipeline", metavar="PIPELINE.yml", help="the pipeline file (see examples/pipelines/pipeline.yml)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (merges to do, skipped and why, bytes to download) and stop: no weights are "
                        "downloaded, nothing is merged or pushed")
    p.add_argument("--token-env", metavar="NAME",
                   help="read the Hub token from this environment variable (default: HF_TOKEN or the stored login)")
    p.add_argument("--work-dir", metavar="DIR", help="overrides the pipeline's work_dir (merges and the leaderboard)")
    p.add_argument("--hub-only", action="store_true",
                   help="models and evaluation data are Hub IDs only: no local path is looked at (for servers)")
    p.add_argument("--allow-task-code", action="store_true",
                   help="with --hub-only: let an lm-eval task_dir fetched from the Hub run its Python (!function, "
                        ".py files; it runs code!)")
    p.add_argument("--executor", default="local",
                   help="where merges are evaluated: local (default), ray (RAY_ADDRESS or a local cluster) or "
                        "ray://HOST:PORT (each merge a Ray task, merged in memory and scored there; only the merges "
                        "to publish are written and pushed, from here)")
    p.set_defaults(func=cmd_pipeline)
