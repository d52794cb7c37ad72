"""What a pipeline run holds while it plans, merges, evaluates, selects and publishes (:class:`Run`), shared by
its stages: :mod:`~hubsoup.workflows.pipeline.plan`, :mod:`~hubsoup.workflows.pipeline.execute`,
:mod:`~hubsoup.workflows.pipeline.publish` and :mod:`~hubsoup.workflows.pipeline.leaderboard`."""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any, Callable, TextIO

from huggingface_hub import HfApi, constants

from hubsoup.eval import TaskSpec
from hubsoup.hubclient import Token, scrub_secrets
from hubsoup.options import MergeOptions
from hubsoup.sources.access import check_specs, hub_only
from hubsoup.workflows.executors import is_local
from hubsoup.workflows.pipeline.config import Pipeline
from hubsoup.workflows.pipeline.hubio import Published, RepoInfo
from hubsoup.workflows.pipeline.report import FAILED, PlannedMerge

if TYPE_CHECKING:
    from hubsoup.workflows.executors import Executor


class Run:
    """One run of a pipeline: its file, Hub client and token, work folder, evaluation tasks, what the Hub already
    holds (published recipes, the leaderboard's rows) and the executor serving its merges."""

    opts: MergeOptions
    """The merges' options (set when the run is planned)."""
    base: RepoInfo
    """The base model, pinned (set when the run is planned)."""

    def __init__(self, p: Pipeline, api: HfApi, token: Token, work: str, out: TextIO,
                 emit: Callable[[str, PlannedMerge], None]):
        self.p, self.api, self.token, self.work, self.out, self.emit = p, api, token, work, out, emit
        self.retry = p.retry
        self.tasks = self._tasks()
        self.published: dict[str, Published] = {}
        self.repo_hash: dict[str, str] = {}
        self.previous: dict[str, dict[str, Any]] = {}
        self.executor: Any = None
        self.resources: dict[str, Any] | None = None
        self.scored: dict[str, dict[str, Any]] = {}  # recipe hash -> an executor's result, not yet used
        self.exe: Executor | None = None
        """The executor serving the whole run (its cluster connection, its workers), once one is made."""

    def _tasks(self) -> list[TaskSpec]:
        if self.p.eval is None:
            return []

        tasks = []
        for t in self.p.eval.tasks:
            spec = TaskSpec.parse(t)
            if hub_only():  # Hub datasets only, by their names: nothing relative to the pipeline file
                check_specs(tasks=[spec])
                tasks.append(spec)
                continue
            local = os.path.join(self.p.root, os.path.expanduser(spec.data))
            if not os.path.isabs(os.path.expanduser(spec.data)) and os.path.exists(local):
                spec.data = local  # relative to the pipeline file, wherever it is run from
            if spec.head and not os.path.isabs(spec.head) and os.path.exists(os.path.join(self.p.root, spec.head)):
                spec.head = os.path.join(self.p.root, spec.head)
            tasks.append(spec)
        return tasks

    def check_data(self) -> None:
        """Read the local evaluation data once, before anything is planned: a bad row is one clear error
        (exit status 2), not the same failure on every merge. Read as :meth:`TaskSpec.check` reads it: no
        datasets progress bars ("Generating validation split"), which a dry run's plan is no place for."""
        for spec in self.tasks:
            if spec.kind == "lm-eval" or spec.is_local:  # lm-eval: its names (and a hub_only run's task repo,
                spec.check(self.token)                     # fetched and checked for code) now

    @property
    def eval_signature(self) -> str:
        """What the scores were measured on (a stored score counts only for the same evaluation)."""
        if self.p.eval is None:
            return ""
        return hashlib.sha256(json.dumps([self.p.eval.tasks, self.p.eval.limit]).encode()).hexdigest()[:16]

    def public(self, e: "BaseException | str") -> str:
        """An error message fit for a published leaderboard: no token, no local path, one line."""
        text = " ".join(str(e).split())
        for path, name in ((constants.HF_HUB_CACHE, "<hf-cache>"), (self.work, "<work_dir>"),
                           (os.path.expanduser("~"), "~")):
            if path and len(path) > 1:
                text = text.replace(os.path.abspath(path), name)
        return scrub_secrets(text, self.token)

    def line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    @property
    def remote(self) -> bool:
        """Merges are scored by an executor's tasks (Ray): with evaluation tasks only (else each is written anyway)."""
        return not is_local(self.executor) and bool(self.tasks)

    def failed(self, m: PlannedMerge, reason: str) -> None:
        """``m`` failed: its status and reason set, the event emitted, one line printed."""
        m.status, m.reason = FAILED, reason
        self.emit("failed", m)
        self.line(f"failed     {m.label}: {m.reason}")
