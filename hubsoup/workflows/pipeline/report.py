"""What a pipeline run found and did: its candidates (:class:`Candidate`), its merges and what became of each
(:class:`PlannedMerge`, with the statuses the leaderboard keeps), the whole (:class:`PipelineReport`), and how a
dry run's plan and a run's summary are printed."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, TextIO

from hubsoup.footprint import fmt
from hubsoup.workflows.pipeline import hubio
from hubsoup.workflows.pipeline.config import MergeSpec, Pipeline
from hubsoup.workflows.pipeline.hubio import RepoInfo
from hubsoup.workflows.pipeline.licenses import LicenseDecision

# statuses of a merge, as the leaderboard keeps them (the same on every run that finds the same state)
PUBLISHED, NOT_SELECTED, REFUSED, FAILED, PLANNED = "published", "not selected", "refused", "failed", "planned"


@dataclass
class Candidate:
    spec: str
    info: RepoInfo | None = None
    error: str | None = None
    skipped: str | None = None
    """Left out by the pipeline's policy (a private or gated repo the query found): reported, not a failure."""

    @property
    def repo_id(self) -> str:
        return self.info.repo_id if self.info else self.spec.split("@")[0]


@dataclass
class PlannedMerge:
    """One merge of the plan and what became of it."""

    spec_index: int
    spec: MergeSpec
    inputs: list[RepoInfo]
    recipe_hash: str
    params: dict[str, Any]
    repo_id: str
    license: LicenseDecision
    status: str = PLANNED
    reason: str = ""
    action: str = ""
    """What this run did: ``pushed``, ``skipped (already published)``, ``merged`` ... (not on the leaderboard)."""
    url: str | None = None
    scores: dict[str, float] = field(default_factory=dict)
    score: float | None = None
    path: str | None = None
    deferred: bool = False
    """Listed as not selected on the Hub's leaderboard: merged again only if now selected."""
    results: list[dict[str, Any]] | None = field(default=None, repr=False)
    """Scored by an executor's task (merged in memory there): its ``eval_results.json`` rows; written here
    (:attr:`path`) only when it is to be pushed."""
    work_key: str = ""
    """A ``config:`` merge: its id (the pinned config, options, hubsoup version) names its work folder; its
    recipe hash is known once merged."""
    pins: dict[str, str] = field(default_factory=dict, repr=False)
    """A ``config:`` merge: each model reference of the config → its pinned ``org/name@sha``."""

    @property
    def label(self) -> str:
        return f"{self.spec.name or self.spec.method}({', '.join(i.repo_id for i in self.inputs)})"

    def row(self, base: RepoInfo) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "url": self.url, "status": self.status, "method": self.spec.method,
                "spec": self.spec.name or self.spec.method, "params": self.params, "base": base.pinned,
                "inputs": [i.pinned for i in self.inputs], "recipe_hash": self.recipe_hash,
                "license": self.license.license, "scores": {k: finite(v) for k, v in self.scores.items()},
                "score": finite(self.score), "reason": self.reason or None}


@dataclass
class PipelineReport:
    """What a run found and did. ``exit_code``: 0 when nothing failed, 1 when a candidate or a merge failed."""

    pipeline: Pipeline
    base: RepoInfo
    candidates: list[Candidate]
    merges: list[PlannedMerge]
    dry_run: bool = False
    download_bytes: int = 0
    cached_bytes: int = 0
    leaderboard_path: str | None = None
    leaderboard_url: str | None = None

    @property
    def failures(self) -> list[str]:
        """Candidates that cannot be used, failed merges, merges refused for an input's own license terms."""
        out = [f"candidate {c.spec}: {c.error}" for c in self.candidates if c.error]
        out += [f"{m.label}: {m.reason}" for m in self.merges
                if m.status == FAILED or (m.status == REFUSED and m.license.blocking)]
        return out

    @property
    def exit_code(self) -> int:
        return 1 if self.failures else 0

    def by_status(self, status: str) -> list[PlannedMerge]:
        return [m for m in self.merges if m.status == status]


def finite(v: Any) -> Any:
    """A score for the leaderboard's JSON: NaN and ±inf are null (JSON has no such numbers)."""
    return v if not isinstance(v, float) or math.isfinite(v) else None


def print_plan(report: PipelineReport, out: TextIO) -> None:
    """The dry run's plan: candidates, merges to do and skipped (and why), bytes to download."""
    p = report.pipeline

    def w(s: str = "") -> None:
        print(s, file=out)

    b = report.base
    w(f"pipeline '{p.name}' (dry run: nothing is downloaded but cards and configs, nothing is merged or pushed)")
    w(f"base {b.pinned} (license {b.license or f'unreadable: {b.terms.error}'})")
    ok = [c for c in report.candidates if not c.error and not c.skipped]
    left = [c for c in report.candidates if c.skipped]
    w(f"candidates: {len(ok)} usable, {len(report.candidates) - len(ok) - len(left)} failing, {len(left)} left out")
    for c in report.candidates:
        if c.error:
            w(f"  failing    {c.spec}: {c.error}")
        elif c.skipped:
            w(f"  left out   {c.spec}: {c.skipped}")
        else:
            assert c.info is not None  # neither failing nor left out: its repo was read
            w(f"  ok         {c.info.pinned} ({c.info.kind}, license {c.info.license}, "
              f"{fmt(sum(c.info.weight_files.values()))})")
    todo = [m for m in report.merges if m.status == PLANNED and not m.deferred]
    w(f"merges: {len(todo)} to do, {len(report.by_status(PUBLISHED))} already published, "
      f"{len(report.by_status(REFUSED))} refused, {len(report.by_status(FAILED))} failing, "
      f"{len([m for m in report.merges if m.deferred])} not selected before")
    for m in report.merges:
        if m.status == PLANNED and not m.deferred:
            w(f"  to do      {m.label} -> {m.repo_id} (recipe {m.recipe_hash[:12]}, license "
              f"{m.license.license or 'none'})")
        elif m.deferred:
            w(f"  deferred   {m.label}: not selected on an earlier run (merged again only if selected now)")
        elif m.status == PUBLISHED:
            w(f"  skip       {m.label}: already published at {m.url}")
        else:
            w(f"  skip       {m.label}: {m.status}: {m.reason}")
    w(f"download: {fmt(report.download_bytes)} of weights "
      f"({fmt(report.cached_bytes)} already in the local cache, {fmt(report.download_bytes - report.cached_bytes)} to fetch)")
    if report.failures:
        w(f"{len(report.failures)} failure(s); the run would exit with 1")


def print_summary(report: PipelineReport, out: TextIO) -> None:
    pushed = [m for m in report.merges if m.action == "pushed"]
    skipped = [m for m in report.merges if m.action.startswith("skipped")]
    print(f"done: {len(pushed)} pushed, {len(skipped)} already published, {len(report.by_status(NOT_SELECTED))} "
          f"not selected, {len(report.by_status(REFUSED))} refused, {len(report.failures)} failure(s)", file=out)
    for f in report.failures:
        print(f"  failure: {f}", file=out)
    for c in report.candidates:
        if c.skipped:
            print(f"  left out: candidate {c.spec}: {c.skipped}", file=out)
    if report.leaderboard_path:
        print(f"leaderboard: {os.path.join(report.leaderboard_path, hubio.LEADERBOARD_MD)}", file=out)
    if report.leaderboard_url:
        print(f"leaderboard pushed: {report.leaderboard_url}", file=out)
