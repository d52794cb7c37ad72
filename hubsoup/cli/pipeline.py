"""``hubsoup pipeline PIPELINE.yml``: an unattended merge → eval → push pipeline (see :mod:`hubsoup.workflows.pipeline`)."""

from __future__ import annotations

import os

from hubsoup.errors import ParameterError


def cmd_pipeline(args) -> int:
    from hubsoup.workflows.pipeline import run_pipeline

    token = None
    if args.token_env:
        token = os.environ.get(args.token_env)
        if not token:
            raise ParameterError(f"--token-env {args.token_env}: that environment variable is not set or empty")
    report = run_pipeline(args.pipeline, dry_run=args.dry_run, token=token, work_dir=args.work_dir,
                          hub_only=args.hub_only)
    return report.exit_code


def register(sub) -> None:
    p = sub.add_parser(
        "pipeline", help="run an unattended merge -> eval -> push pipeline (candidates from a list or a Hub query)",
        description="Run the pipeline file: find candidates (a list and/or a Hub query), plan the merges, skip those "
                    "already published in the target namespace (found on the Hub by recipe hash), merge, evaluate, "
                    "select, push each in one commit, and write a leaderboard (markdown + JSON). A failing candidate "
                    "is reported and left out. Exit status: 0 when nothing failed, 1 when a candidate or a merge "
                    "failed (the rest was done), 2 when the pipeline cannot run at all.")
    p.add_argument("pipeline", metavar="PIPELINE.yml", help="the pipeline file (see examples/pipelines/pipeline.yml)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (merges to do, skipped and why, bytes to download) and stop: no weights are "
                        "downloaded, nothing is merged or pushed")
    p.add_argument("--token-env", metavar="NAME",
                   help="read the Hub token from this environment variable (default: HF_TOKEN or the stored login)")
    p.add_argument("--work-dir", metavar="DIR", help="overrides the pipeline's work_dir (merges and the leaderboard)")
    p.add_argument("--hub-only", action="store_true",
                   help="models and evaluation data are Hub IDs only: no local path is looked at (for servers)")
    p.set_defaults(func=cmd_pipeline)
