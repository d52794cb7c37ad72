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

Example:
    >>> from hubsoup.workflows.pipeline import run_pipeline
    >>> report = run_pipeline("examples/pipelines/pipeline.yml", dry_run=True)   # doctest: +SKIP
    >>> report.exit_code                                                          # doctest: +SKIP
    0
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

from huggingface_hub import HfApi, ModelCard, constants
from huggingface_hub.errors import RepositoryNotFoundError

from hubsoup import __version__
from hubsoup.api import MergeResult, merge, parse_method
from hubsoup.errors import HubsoupError, ParameterError
from hubsoup.eval import TaskSpec, evaluate_model
from hubsoup.eval.run import EVAL_FILE, write_results
from hubsoup.formats import stages
from hubsoup.formats.mergekit import _map_models
from hubsoup.formats.stages import is_multi_stage, read_stages
from hubsoup.hub import PushTarget as StreamTarget
from hubsoup.hub import check_repo_id, ensure_timeouts, scrub_secrets
from hubsoup.hubclient import Token
from hubsoup.options import MergeOptions
from hubsoup.output.folder import OutputLock
from hubsoup.recipe import recipe_for
from hubsoup.sources import InputRef, open_input
from hubsoup.sources.access import check_specs, hub_only, scope
from hubsoup.sources.compat import check_config
from hubsoup.sources.resolve import parse_spec
from hubsoup.untrusted import load_yaml
from hubsoup.workflows.executors import check_executor, is_local, make_executor
from hubsoup.workflows.pipeline import hubio
from hubsoup.workflows.pipeline.config import MergeSpec, Pipeline, load_pipeline
from hubsoup.workflows.pipeline.hubio import Published, RepoInfo, with_retry
from hubsoup.workflows.pipeline.licenses import LicenseDecision, combine, forbids_derivatives
from hubsoup.workflows.rerun import run_config, run_stages
from hubsoup.workflows.trial import pin_inputs

log = logging.getLogger(__name__)

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
    results: list | None = field(default=None, repr=False)
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
                "license": self.license.license, "scores": {k: _finite(v) for k, v in self.scores.items()},
                "score": _finite(self.score), "reason": self.reason or None}


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


def run_pipeline(source: str | os.PathLike | dict[str, Any] | Pipeline, *, dry_run: bool = False,
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


def _run_pipeline(source, dry_run, token, work_dir, stream, on_event, executor=None, resources=None) -> PipelineReport:
    p = source if isinstance(source, Pipeline) else load_pipeline(source)
    out = stream or sys.stdout
    emit = on_event or (lambda kind, m: None)
    work = os.path.abspath(os.path.join(p.root, work_dir or p.work_dir))
    ensure_timeouts()
    api = HfApi(token=token)
    runner = _Runner(p, api, token, work, out, emit)
    runner.executor, runner.resources = executor, resources
    runner.check_data()
    if dry_run:
        report = runner.plan()
        report.dry_run = True
        print_plan(report, out)
        return report

    os.makedirs(os.path.dirname(work), exist_ok=True)
    with OutputLock(work, what="pipeline work folder"):
        report = runner.plan()
        runner.execute(report)
        runner.leaderboard(report)
    print_summary(report, out)
    return report


class _Runner:
    def __init__(self, p: Pipeline, api, token, work: str, out: TextIO, emit):
        self.p, self.api, self.token, self.work, self.out, self.emit = p, api, token, work, out, emit
        self.retry = p.retry
        self.tasks = self._tasks()
        self.published: dict[str, Published] = {}
        self.repo_hash: dict[str, str] = {}
        self.previous: dict[str, dict] = {}
        self.executor: Any = None
        self.resources: dict[str, Any] | None = None
        self.scored: dict[str, dict[str, Any]] = {}  # recipe hash -> an executor's result, not yet used
        self._exe: Any = None

    # ---- planning --------------------------------------------------------------------------

    def _tasks(self) -> list:
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
                spec.check()                               # fetched and checked for code) now

    @property
    def eval_signature(self) -> str:
        """What the scores were measured on (a stored score counts only for the same evaluation)."""
        if self.p.eval is None:
            return ""
        return hashlib.sha256(json.dumps([self.p.eval.tasks, self.p.eval.limit]).encode()).hexdigest()[:16]

    def plan(self) -> PipelineReport:
        p = self.p
        self.opts = MergeOptions(**p.options, token=self.token, quiet=True)
        base = self._base = hubio.repo_info(self.api, p.base, self.retry, self.token, role="base")
        hidden = self._restricted(base)
        if hidden:
            raise ParameterError(f"base '{p.base}': {hidden}")
        base_ckpt = self._open_config(base.pinned, role="base")
        candidates = self._candidates(base, base_ckpt)
        good = [c.info for c in candidates if c.info is not None and not c.error and not c.skipped]
        self.published = hubio.published_recipes(self.api, p.push.namespace, self.retry, self.token)
        self.repo_hash = {pub.repo_id: h for h, pub in self.published.items()}
        if p.leaderboard.repo:
            rows = hubio.previous_leaderboard(self.api, p.leaderboard.repo, p.leaderboard.repo_type, self.retry,
                                              self.token)
            self.previous = {r["recipe_hash"]: r for r in rows}
        merges: list[PlannedMerge] = []
        for i, spec in enumerate(p.merges):
            if spec.config is not None:  # a mergekit config: its own models, pinned now
                merges.append(self._plan_config(i, spec, base))
                continue
            for combo in self._combinations(spec, good, candidates, i):
                merges.append(self._plan_one(i, spec, base, combo))
        seen: set[str] = set()
        unique = []
        for m in merges:  # two specs may describe the same merge: made once
            if m.recipe_hash not in seen:
                seen.add(m.recipe_hash)
                unique.append(m)
        report = PipelineReport(p, base, candidates, unique)
        self._sizes(report)
        return report

    def _open_config(self, pinned: str, role: str):
        """The repo's metadata (config, card), no weights; its architecture is checked against the base's."""
        return with_retry(lambda: open_input(pinned, token=self.token, role=role), f"metadata of {pinned}", self.retry)

    def _candidates(self, base: RepoInfo, base_ckpt) -> list[Candidate]:
        p = self.p
        specs: dict[str, str] = {}
        for s in p.candidates.models:
            specs.setdefault(parse_spec(s)[0], s)
        explicit = set(specs)
        if p.candidates.query is not None:
            for repo_id in hubio.query_candidates(self.api, p.candidates.query, base.repo_id, self.retry, self.token):
                specs.setdefault(repo_id, repo_id)
        excluded = {parse_spec(e)[0] for e in p.candidates.exclude} | {base.repo_id}
        out = []
        for repo_id in sorted(specs):  # sorted: a query's order never changes a recipe (inputs' order)
            if repo_id in excluded:
                continue
            c = Candidate(specs[repo_id])
            try:
                c.info = hubio.repo_info(self.api, c.spec, self.retry, self.token)
                hidden = self._restricted(c.info)
                if hidden and repo_id in explicit:
                    c.error = hidden
                elif hidden:
                    c.skipped = hidden
                elif c.info.terms.error or any(forbids_derivatives(i) for i in c.info.terms.ids):
                    c.error = "license: " + combine([(repo_id, c.info.terms)]).reason
                elif c.info.kind == "full":
                    check_config(base_ckpt, self._open_config(c.info.pinned, role="input"))
            except HubsoupError as e:
                c.error = self._public(e)
            out.append(c)
        return out

    def _restricted(self, info: RepoInfo) -> str | None:
        """Why a private or gated repo may not go into this pipeline's public merges (None: it may)."""
        what = info.restricted
        if what is None or self.p.allow_private_inputs or self.p.push.private:
            return None
        return (f"{what} repo: not merged into public repos (set allow_private_inputs: true in the pipeline, "
                "or push.private: true)")

    def _combinations(self, spec: MergeSpec, good: list[RepoInfo], candidates: list[Candidate], i: int):
        if spec.combine == "all":
            return [good] if good else []
        if spec.combine == "pairs":
            return [list(c) for c in itertools.combinations(good, 2)]
        if spec.combine == "each":
            return [[g] for g in good]
        partner_id = spec.partner.split("@")[0]
        partner = next((g for g in good if g.repo_id == partner_id), None)
        if partner is None:
            bad = next((c for c in candidates if c.repo_id == partner_id), None)
            if bad is None:
                try:
                    partner = hubio.repo_info(self.api, spec.partner, self.retry, self.token)
                except HubsoupError as e:
                    candidates.append(Candidate(spec.partner, error=self._public(e)))
                    return []
                hidden = self._restricted(partner)
                if hidden:
                    candidates.append(Candidate(spec.partner, partner, error=hidden))
                    return []
            else:
                return []  # the partner's failure is reported with the candidates
        return [[partner, g] for g in good if g.repo_id != partner.repo_id]

    def _plan_one(self, i: int, spec: MergeSpec, base: RepoInfo, inputs: list[RepoInfo]) -> PlannedMerge:
        decision = combine([(base.repo_id, base.terms), *((x.repo_id, x.terms) for x in inputs)],
                           self.p.license.output)
        try:
            h, params = self._predict(spec, base, inputs)
        except HubsoupError as e:
            m = PlannedMerge(i, spec, inputs, "", dict(spec.params), "", decision, FAILED, self._public(e))
            return m
        name = self._name(spec, inputs, h, base)
        m = PlannedMerge(i, spec, inputs, h, params, f"{self.p.push.namespace}/{name}", decision)
        pub = self.published.get(h)
        prev = self.previous.get(h)
        if pub is not None:
            m.status, m.action, m.repo_id, m.url = PUBLISHED, "skipped (already published)", pub.repo_id, pub.url
        elif not decision.ok and decision.blocking:  # an input's own terms: no option publishes it
            m.status, m.reason = REFUSED, f"license: {decision.reason}"
        elif not decision.ok and not self.p.license.allow_mix:
            m.status, m.reason = REFUSED, f"license: {decision.reason} (set license.allow_mix or license.output)"
        elif prev is not None and prev.get("status") == NOT_SELECTED and prev.get("eval") == self.eval_signature:
            m.deferred, m.scores = True, dict(prev.get("scores") or {})
        if m.status == PLANNED and m.repo_id in self.repo_hash and self.repo_hash[m.repo_id] != h:
            m.status, m.reason = FAILED, (f"target {m.repo_id} already holds another merge (recipe "
                                          f"{self.repo_hash[m.repo_id][:12]}); change push.name")
        return m

    def _plan_config(self, i: int, spec: MergeSpec, base: RepoInfo) -> PlannedMerge:
        """A ``config:`` merge: every Hub model the config names is an input (access and license checked as a
        candidate's), pinned to its commit; published already when the target its id names holds a merge."""
        stages = read_stages(spec.text) if is_multi_stage(spec.text) else []
        docs = [s.data for s in stages] if stages else [load_yaml(spec.text, "config")]
        stage_names = {s.name for s in stages if s.name}
        refs: list[str] = []

        def collect(ref: str) -> str:
            for part in ref.split("+"):
                if part not in refs and parse_spec(part)[0] not in stage_names:
                    refs.append(part)
            return ref

        for d in docs:
            _map_models(d, collect)
        inputs: list[RepoInfo] = []
        problem = None
        for ref in refs:
            try:
                check_repo_id(parse_spec(ref)[0])
                info = hubio.repo_info(self.api, ref, self.retry, self.token)
            except HubsoupError as e:
                problem = problem or f"{ref}: {self._public(e)}"
                continue
            hidden = self._restricted(info)
            if hidden:
                problem = problem or f"{info.repo_id}: {hidden}"
            elif info.terms.error or any(forbids_derivatives(x) for x in info.terms.ids):
                problem = problem or f"{info.repo_id}: license: " + combine([(info.repo_id, info.terms)]).reason
            if all(x.repo_id != info.repo_id for x in inputs):
                inputs.append(info)
        pins = {ref: info.pinned for ref in refs for info in inputs if info.repo_id == parse_spec(ref)[0]}
        pinned = [json.dumps(_map_models(d, lambda r: "+".join(pins.get(x, x) for x in r.split("+"))),
                             sort_keys=True, default=str) for d in docs]
        key = hashlib.sha256(json.dumps([pinned, self.opts.hashed, __version__], default=str).encode()).hexdigest()
        decision = combine([(base.repo_id, base.terms), *((x.repo_id, x.terms) for x in inputs)],
                           self.p.license.output)
        m = PlannedMerge(i, spec, inputs, key, {"config": spec.config}, "", decision, work_key=key[:16], pins=pins)
        if problem is not None:
            m.status, m.reason = FAILED, problem
            return m
        m.repo_id = f"{self.p.push.namespace}/{self._name(spec, inputs, key, base)}"
        if m.repo_id in self.repo_hash:  # the name holds the id: this pinned config is published there
            pub = self.published[self.repo_hash[m.repo_id]]
            m.recipe_hash = pub.recipe_hash
            m.status, m.action, m.url = PUBLISHED, "skipped (already published)", pub.url
        elif not decision.ok and decision.blocking:
            m.status, m.reason = REFUSED, f"license: {decision.reason}"
        elif not decision.ok and not self.p.license.allow_mix:
            m.status, m.reason = REFUSED, f"license: {decision.reason} (set license.allow_mix or license.output)"
        return m

    def _run_config(self, m: PlannedMerge, out: str | None, **push: Any):
        """Run a ``config:`` merge's mergekit config (pinned) into ``out`` (or streamed: ``push``, ``before_push``),
        then evaluate it as any merge."""
        opts = {**self.p.options, "token": self.token, "quiet": True, "overwrite": True, **push}
        if stages.is_multi_stage(m.spec.text):  # every stage's Hub models pinned (its earlier stages are folders)
            if out is None:  # streamed: the earlier stages are folders of the work folder, as beside an output
                opts["intermediate_dir"] = os.path.join(self.work, "merges", f".{m.work_key}.stages")
            result = run_stages(m.spec.text, out, pins=m.pins, **opts)
        else:
            result = run_config(m.spec.text, out, pins=m.pins, **opts)
        if self.tasks and out is not None:
            result.evaluation = evaluate_model(out, self.tasks, limit=self.p.eval.limit if self.p.eval else None,
                                               device=self.opts.device, quiet=True)
            write_results(result.evaluation, os.path.join(out, EVAL_FILE))
            result.write_card(out)
        return result

    def _predict(self, spec: MergeSpec, base: RepoInfo, inputs: list[RepoInfo]) -> tuple[str, dict]:
        """The recipe hash the merge will have (checked against the merge's own afterwards)."""
        m, params = parse_method(spec.method, dict(spec.params))
        m.check_inputs(params, len(inputs))

        def ref(r: RepoInfo) -> InputRef:
            return InputRef(spec=r.pinned, repo_id=r.repo_id, revision=r.sha, sha=r.sha, kind=r.kind)

        described = m.describe_params(params)
        recipe = recipe_for(spec.method, described, ref(base), [ref(i) for i in inputs], dtype=self.opts.dtype,
                            options=self.opts)
        return recipe.hash, json.loads(json.dumps(described, default=str))

    def _name(self, spec: MergeSpec, inputs: list[RepoInfo], h: str, base: RepoInfo) -> str:
        shorts = [i.short for i in inputs]
        inputs_short = "-".join(shorts)
        if len(inputs_short) > 48:
            inputs_short = "-".join(s[:10] for s in shorts)
        if len(inputs_short) > 48:
            inputs_short = f"{len(inputs)}models"
        fields = {"method": spec.method, "spec": spec.name or spec.method, "inputs_short": inputs_short,
                  "n": len(inputs), "hash8": h[:8], "hash": h, "base_short": base.short}
        name = self.p.push.name.format(**fields)
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
        name = re.sub(r"-{2,}", "-", name).strip("-.")
        if len(name) > 96:
            name = name[:87].rstrip("-.") + "-" + h[:8]
        return name

    def _sizes(self, report: PipelineReport) -> None:
        todo = [m for m in report.merges if m.status == PLANNED and not m.deferred]
        repos: dict[str, RepoInfo] = {}
        for m in todo:
            for r in (report.base, *m.inputs):
                repos[r.pinned] = r
        report.download_bytes = sum(sum(r.weight_files.values()) for r in repos.values())
        report.cached_bytes = sum(r.cached_bytes() for r in repos.values())

    # ---- execution ---------------------------------------------------------------------------

    @property
    def remote(self) -> bool:
        """Merges are scored by an executor's tasks (Ray): with evaluation tasks only (else each is written anyway)."""
        return not is_local(self.executor) and bool(self.tasks)

    def execute(self, report: PipelineReport) -> None:
        try:
            self._execute(report)
        finally:
            if self._exe is not None:  # an executor serves the whole run (its cluster connection, its workers)
                self._exe.close()
                self._exe = None

    def _execute(self, report: PipelineReport) -> None:
        sel = self.p.select
        broken: dict[str, str] = {}
        queue = [m for m in report.merges if m.status == PLANNED and not m.deferred]
        if self.remote:  # every merge to make at once, on the cluster; used below in the local run's order
            self._score_remote([m for m in queue if not m.work_key and self._cached(m) is None])
        extra_all: list[PlannedMerge] = []
        while queue:
            m = queue.pop(0)
            hit = next((i.repo_id for i in m.inputs if i.repo_id in broken), None)
            if hit is not None:
                m.status, m.reason = FAILED, f"candidate {hit} failed: {broken[hit]}"
                self.emit("failed", m)
            else:
                culprit = self._merge_streamed(m) if self._streams(m) else self._merge(m)
                if culprit is not None:
                    broken[culprit] = m.reason
            if m.status == FAILED and m.spec.combine == "all" and m.spec.config is None:  # an `all` merge goes on without the broken candidates
                rest = [i for i in m.inputs if i.repo_id not in broken]
                if rest and len(rest) < len(m.inputs):
                    replacement = self._plan_one(m.spec_index, m.spec, report.base, rest)
                    if replacement.recipe_hash not in {x.recipe_hash for x in report.merges + extra_all}:
                        extra_all.append(replacement)
                        if replacement.status == PLANNED and not replacement.deferred:
                            queue.append(replacement)
            if m.status in (FAILED, PUBLISHED):  # published: streamed to the Hub as it was merged
                continue
            if sel is None or (sel.top_k is None and self._passes(m)):
                self._push(m, report)
            elif sel.top_k is None:
                m.status = NOT_SELECTED
        report.merges.extend(extra_all)
        for c in report.candidates:
            if c.info is not None and c.info.repo_id in broken and not c.error:
                c.error = broken[c.info.repo_id]
        if sel is not None:
            self._select(report)

    def _passes(self, m: PlannedMerge) -> bool:
        sel = self.p.select
        if sel is None or sel.threshold is None:
            return True
        if m.score is None:
            return False
        return m.score >= sel.threshold if self._goal() == "max" else m.score <= sel.threshold

    def _goal(self) -> str:
        sel = self.p.select
        if sel.goal:
            return sel.goal
        return "min" if sel.metric.split("/")[-1] == "perplexity" else "max"

    def _score(self, scores: dict[str, float]) -> float | None:
        """The selection metric of these scores; None when missing or not a finite number (never ranked)."""
        value = self._metric(scores)
        return value if isinstance(value, (int, float)) and math.isfinite(value) else None

    def _metric(self, scores: dict[str, float]) -> float | None:
        sel = self.p.select
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

    def _select(self, report: PipelineReport) -> None:
        """Top-k / threshold over this run's merges, the published ones and those the Hub's leaderboard rejected."""
        sel = self.p.select
        for m in report.merges:
            if m.status == PUBLISHED and not m.scores and m.action.startswith("skipped"):
                pub = self.published.get(m.recipe_hash)
                if pub is not None:
                    m.scores = with_retry(lambda: hubio.published_scores(pub, self.retry, self.token),
                                          f"scores of {pub.repo_id}", self.retry)
            if m.scores and m.score is None:
                m.score = self._score(m.scores)
        pool = [m for m in report.merges if m.status in (PUBLISHED, NOT_SELECTED)
                or (m.status == PLANNED and (m.path or m.deferred or m.results is not None))]
        sign = 1 if self._goal() == "max" else -1
        ranked = sorted(pool, key=lambda m: (m.score is None, -sign * (m.score or 0.0), m.recipe_hash))
        top = {id(m) for m in (ranked[:sel.top_k] if sel.top_k is not None else ranked)}
        for m in ranked:
            if m.status != PLANNED:
                continue
            if id(m) in top and m.score is not None and self._passes(m):
                if m.deferred:  # rejected before, wanted now: merge it (again) and publish it
                    m.deferred = False
                    if self._merge(m) is not None or m.status == FAILED:
                        continue
                self._push(m, report)
            else:
                m.status = NOT_SELECTED
                m.action = m.action or ("not selected (stored score)" if m.deferred else "not selected")
                if m.score is None:
                    m.reason = f"no finite '{sel.metric}' score"

    def _merge(self, m: PlannedMerge) -> str | None:
        """Make (or find, verified, in the work folder) the merge and score it; on failure its status says
        why and the culprit is returned (when the error names one input)."""
        out = self._out(m)
        base_pinned = self._base.pinned
        try:
            result = self._cached(m, report_stale=True)
            if result is None and self.remote and not m.work_key:
                return self._merge_remote(m)
            if result is None:
                _remove(self._manifest(m))  # a merge made again is trusted once its new manifest is written
                if m.work_key:
                    result = with_retry(lambda: self._run_config(m, out), f"merge {m.label}", self.retry)
                    m.recipe_hash = result.recipe.hash  # known now: the manifest, leaderboard and push use it
                else:
                    result = None
                result = result or with_retry(
                    lambda: merge([i.pinned for i in m.inputs], m.spec.method, base=base_pinned, out=out,
                                  params=dict(m.spec.params), options=self.opts.replace(overwrite=True),
                                  evaluate=self.tasks or None, eval_limit=self.p.eval.limit if self.p.eval else None),
                    f"merge {m.label}", self.retry)
                self._write_manifest(m, result.path)
                m.action = "merged"
            else:
                m.action = "merged (found in the work folder)"
        except Exception as e:  # noqa: BLE001 - one candidate's merge or evaluation never stops the others
            if not isinstance(e, HubsoupError):
                log.debug("merge %s failed", m.label, exc_info=True)
            text = self._public(e)
            m.status, m.reason = FAILED, text if isinstance(e, HubsoupError) else f"{type(e).__name__}: {text}"
            culprits = [i.repo_id for i in m.inputs if i.repo_id in str(e)] if isinstance(e, HubsoupError) else []
            self.emit("failed", m)
            self._line(f"failed     {m.label}: {m.reason}")
            return culprits[0] if len(culprits) == 1 else None
        if result.recipe.hash != m.recipe_hash:  # the plan's prediction must hold, or idempotency would not
            log.warning("recipe hash of %s is %s, planned %s", m.label, result.recipe.hash[:12], m.recipe_hash[:12])
            m.recipe_hash = result.recipe.hash
        m.path = result.path
        try:
            m.scores = hubio.flatten_scores(_read_json(os.path.join(out, hubio.EVAL_FILE)) or [])
        except ValueError:
            m.scores = {}
        return self._scored(m)

    def _streams(self, m: PlannedMerge) -> bool:
        """Whether ``m`` is streamed to the Hub as it is merged: pushed without an evaluation, none of it in the work
        folder already (a merge found there is verified and pushed as before)."""
        return (self.p.push.stream and not self.tasks and self.p.select is None and not self.remote
                and self._cached(m) is None)

    def _merge_streamed(self, m: PlannedMerge) -> str | None:
        """Merge ``m`` straight to its repo (its card rendered with the pipeline's license before the one commit);
        on failure its status says why and the culprit is returned (when the error names one input)."""
        problem = self._target_problem(m)
        if problem == "same":
            self._line(f"skipped    {m.label}: {m.url} already holds it (published by another run meanwhile)")
            return None
        if problem:
            m.status, m.reason = FAILED, problem
            self.emit("failed", m)
            self._line(f"failed     {m.label}: {problem}")
            return None
        self.emit("pushing", m)
        message = f"Upload {m.spec.method} merge made with a hubsoup pipeline (recipe {m.recipe_hash[:12]})"
        target = StreamTarget(m.repo_id, private=self.p.push.private or None, token=self.token,
                              commit_message=message, allow_private_inputs=self.p.allow_private_inputs,
                              work_dir=os.path.join(self.work, "merges"))
        os.makedirs(target.work_dir, exist_ok=True)

        def card(result: MergeResult, folder: str) -> None:
            self._write_card(m, result, folder)

        try:
            if m.work_key:
                result = with_retry(lambda: self._run_config(m, None, push=target, before_push=card),
                                    f"merge {m.label}", self.retry)
            else:
                result = with_retry(
                    lambda: merge([i.pinned for i in m.inputs], m.spec.method, base=self._base.pinned, push=target,
                                  params=dict(m.spec.params), options=self.opts, before_push=card),
                    f"merge {m.label}", self.retry)
        except Exception as e:  # noqa: BLE001 - one candidate's merge or push never stops the others
            if not isinstance(e, HubsoupError):
                log.debug("merge %s failed", m.label, exc_info=True)
            text = self._public(e)
            m.status, m.reason = FAILED, text if isinstance(e, HubsoupError) else f"{type(e).__name__}: {text}"
            culprits = [i.repo_id for i in m.inputs if i.repo_id in str(e)] if isinstance(e, HubsoupError) else []
            self.emit("failed", m)
            self._line(f"failed     {m.label}: {m.reason}")
            return culprits[0] if len(culprits) == 1 else None
        if result.recipe.hash != m.recipe_hash:
            if not m.work_key:
                log.warning("recipe hash of %s is %s, planned %s", m.label, result.recipe.hash[:12], m.recipe_hash[:12])
            m.recipe_hash = result.recipe.hash
        m.action = "merged"
        self._scored(m)
        m.status, m.action, m.url = PUBLISHED, "pushed", f"{constants.ENDPOINT}/{m.repo_id}"
        self.published[m.recipe_hash] = Published(m.repo_id, getattr(result.pushed, "oid", "") or "", m.url,
                                                  m.recipe_hash, dict(m.scores))
        self.repo_hash[m.repo_id] = m.recipe_hash
        self.emit("pushed", m)
        self._line(f"pushed     {m.label} -> {m.url}")
        return None

    def _scored(self, m: PlannedMerge) -> None:
        """``m.scores`` are in: a merge that cannot be scored fails, the others are ranked."""
        bad = hubio.non_finite(m.scores)
        if self.tasks and (bad or not m.scores):  # a merge that cannot be scored is never ranked
            m.status = FAILED
            m.reason = (f"evaluation gave a non-finite {bad[0]} ({m.scores[bad[0]]})" if bad
                        else "evaluation gave no scores")
            self.emit("failed", m)
            self._line(f"failed     {m.label}: {m.reason}")
            return None
        m.score = self._score(m.scores)
        self.emit("merged", m)
        shown = "  ".join(f"{k}={v:.4f}" for k, v in sorted(m.scores.items()))
        verb = {"merged": "merged    ", "scored": "scored    "}.get(m.action, "reused    ")  # reused: verified
        self._line(f"{verb} {m.label}" + (f"  {shown}" if shown else ""))
        return None

    def _cached(self, m: PlannedMerge, report_stale: bool = False):
        """The merge in the work folder when it is exactly this one (recipe and manifest), else None."""
        out = self._out(m)
        if not os.path.isfile(os.path.join(out, hubio.RECIPE_FILE)):
            return None
        problem = self._verify(m, out)
        if problem is not None:
            if report_stale:
                self._line(f"stale      {m.label}: the merge in the work folder {problem}; merging it again")
            return None
        try:
            cached = MergeResult.from_folder(out)
        except HubsoupError:
            return None
        if m.work_key:  # a config merge: its manifest (checked) holds its recipe hash
            m.recipe_hash = cached.recipe.hash
        return cached if cached.recipe.hash == m.recipe_hash else None

    # ---- an executor's tasks (Ray): merged in memory and scored there; written here only to be pushed -------

    def _score_remote(self, merges: list[PlannedMerge]) -> None:
        """Merge and score ``merges`` as the executor's tasks (:func:`hubsoup.workflows.trial.run_trial`); the
        results wait in :attr:`scored` for the run's own order."""
        if not merges:
            return

        opts = self.opts
        options = {k: getattr(opts, k) for k in ("device", "dtype", "allow_pickle", "ignore_extra", "shape_mismatch")}
        payloads = [{"number": i, "inputs": [x.pinned for x in m.inputs], "base": self._base.pinned,
                     "method": m.spec.method, "params": dict(m.spec.params), "tasks": list(self.tasks),
                     "limit": self.p.eval.limit if self.p.eval else None, "results": True, "options": options}
                    for i, m in enumerate(merges)]
        wanted = {"cpus": 1, "gpus": 1 if str(opts.device).startswith("cuda") else 0, **(self.resources or {})}
        if "memory" not in wanted and self._exe is None:  # the planner's prediction for the largest merge, +25 %
            wanted["memory"] = int(max(self._memory(m) for m in merges) * 1.25)
        if self._exe is None:
            self._exe = make_executor(self.executor, resources=wanted)
        for m, r in zip(merges, self._exe.run(payloads)):
            self.scored[m.recipe_hash] = r

    def _memory(self, m: PlannedMerge) -> int:
        try:
            return pin_inputs([x.pinned for x in m.inputs], self._base.pinned, m.spec.method, dict(m.spec.params),
                              self.opts, self.opts.dtype)[2]
        except Exception:  # noqa: BLE001 - its task reports what is wrong; request nothing for it
            return 0

    def _merge_remote(self, m: PlannedMerge) -> str | None:
        r = self.scored.pop(m.recipe_hash, None)
        if r is None:  # planned after the batch (an `all` merge without a broken candidate, a deferred one)
            self._score_remote([m])
            r = self.scored.pop(m.recipe_hash)
        if r["state"] != "complete":
            err = r.get("error") or {}
            raw = err.get("message") or r.get("reason") or "failed"
            text = self._public(raw)  # as a local run reports it: HubsoupError text, else "Type: text"
            m.status, m.reason = FAILED, text if err.get("hubsoup") else f"{err.get('type', 'Error')}: {text}"
            culprits = [i.repo_id for i in m.inputs if i.repo_id in raw] if err.get("hubsoup") else []
            self.emit("failed", m)
            self._line(f"failed     {m.label}: {m.reason}")
            return culprits[0] if len(culprits) == 1 else None
        m.results, m.action = r["results"], "scored"
        try:
            m.scores = hubio.flatten_scores(r["results"])
        except ValueError:
            m.scores = {}
        return self._scored(m)

    def _write(self, m: PlannedMerge) -> str | None:
        """Write a merge an executor scored into the work folder (here, once, to push it) with its evaluation."""
        try:
            _remove(self._manifest(m))
            result = with_retry(
                lambda: merge([i.pinned for i in m.inputs], m.spec.method, base=self._base.pinned, out=self._out(m),
                              params=dict(m.spec.params), options=self.opts.replace(overwrite=True)),
                f"merge {m.label}", self.retry)
            with open(os.path.join(result.path, hubio.EVAL_FILE), "w", encoding="utf-8") as f:
                json.dump(m.results, f, indent=2)  # what the task measured, as write_results writes it
            self._write_manifest(m, result.path)
        except Exception as e:  # noqa: BLE001 - this merge fails; the others go on
            return self._public(e) if isinstance(e, HubsoupError) else f"{type(e).__name__}: {self._public(e)}"
        m.path = result.path
        return None

    # ---- the work folder: a cache, verified before anything in it is published --------------------

    def _out(self, m: PlannedMerge) -> str:
        return os.path.join(self.work, "merges", m.work_key or m.recipe_hash[:16])

    def _manifest(self, m: PlannedMerge) -> str:
        return os.path.join(self.work, "merges", f"{m.work_key or m.recipe_hash[:16]}.manifest.json")

    def _write_manifest(self, m: PlannedMerge, folder: str) -> None:
        """The recipe hash and every file's sha256 of a merge just made (the card is rendered again at push)."""
        data = {"recipe_hash": m.recipe_hash, "files": _checksums(folder), **({"work_key": m.work_key} if m.work_key else {})}
        path = self._manifest(m)
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)

    def _verify(self, m: PlannedMerge, folder: str) -> str | None:
        """None when ``folder`` holds exactly the merge this run (or an earlier one) made, else what differs."""
        try:
            with open(self._manifest(m), encoding="utf-8") as f:
                want = json.load(f)
        except FileNotFoundError:
            return "has no manifest (a run was stopped before it was written)"
        except (OSError, ValueError):
            return "has an unreadable manifest"
        if not isinstance(want, dict) or not isinstance(want.get("files"), dict) or (
                want.get("work_key") != m.work_key if m.work_key else want.get("recipe_hash") != m.recipe_hash):
            return "has a manifest of another recipe"
        try:
            have = _checksums(folder)
        except OSError as e:
            return f"cannot be read ({type(e).__name__})"
        for name in sorted(set(want["files"]) | set(have)):
            if want["files"].get(name) != have.get(name):
                what = "is missing" if name not in have else ("was added" if name not in want["files"] else "changed")
                return f"differs from its manifest ({name} {what})"
        return None

    def _push(self, m: PlannedMerge, report: PipelineReport) -> None:
        problem = self._target_problem(m)
        if problem == "same":
            self._line(f"skipped    {m.label}: {m.url} already holds it (published by another run meanwhile)")
            return
        if problem is None and m.path is None and m.results is not None:  # scored by an executor: written now
            problem = self._write(m)
        if problem is None:
            problem = self._verify(m, m.path) if m.path else "no merge"
            if problem is not None:
                problem = f"not pushed: the merge in the work folder {problem}; the next run merges it again"
        if problem:
            m.status, m.reason = FAILED, problem
            self.emit("failed", m)
            self._line(f"failed     {m.label}: {problem}")
            return
        self.emit("pushing", m)
        message = f"Upload {m.spec.method} merge made with a hubsoup pipeline (recipe {m.recipe_hash[:12]})"
        try:
            result = MergeResult.from_folder(m.path)
            self._write_card(m, result)
            info = with_retry(lambda: result.push_to_hub(m.repo_id, private=self.p.push.private or None,
                                                         token=self.token, commit_message=message,
                                                         allow_private_inputs=self.p.allow_private_inputs),
                              f"push of {m.repo_id}", self.retry)
        except HubsoupError as e:
            m.status, m.reason = FAILED, self._public(e)
            self.emit("failed", m)
            self._line(f"failed     {m.label}: {m.reason}")
            return

        m.status, m.action, m.url = PUBLISHED, "pushed", f"{constants.ENDPOINT}/{m.repo_id}"
        self.published[m.recipe_hash] = Published(m.repo_id, getattr(info, "oid", "") or "", m.url, m.recipe_hash,
                                                  dict(m.scores))
        self.repo_hash[m.repo_id] = m.recipe_hash
        self.emit("pushed", m)
        self._line(f"pushed     {m.label} -> {m.url}")

    def _write_card(self, m: PlannedMerge, result, folder: str | None = None) -> None:
        """The card, rendered again from the verified files: the license this pipeline decided (or none),
        never one inherited by default, and a note naming private or gated inputs when they were allowed."""
        d = m.license
        notes = []
        restricted = [f"`{r.repo_id}` ({r.restricted})" for r in (self._base, *m.inputs) if r.restricted]
        if restricted:
            notes.append(f"**Private or gated inputs:** {', '.join(restricted)} went into this merge; it was "
                         "published because the pipeline sets `allow_private_inputs: true`"
                         + (" (the repo is private)." if self.p.push.private else "."))
        if d.ok and d.license:
            why = f"**License:** `{d.license}`, derived from the base's and every input's license by the pipeline."
        else:
            why = ("**License:** none is set: the inputs' licenses cannot be combined and the pipeline publishes "
                   f"it anyway (`license.allow_mix`): {d.reason}. Check every input's license before using it.")
        notes.append(why)
        path = result.write_card(folder, repo_id=m.repo_id, license=d.card_license if d.ok else None, notes=notes)
        card = ModelCard.load(path)
        card.data.license = d.card_license if d.ok else None  # None: no license, not the base's by default
        card.data.license_name = d.license_name if d.ok and d.card_license == "other" else None
        card.data.license_link = d.license_link if d.ok and d.card_license == "other" else None
        card.save(path)
        result.card_text = None

    def _target_problem(self, m: PlannedMerge) -> str | None:
        """Never write into a repo that holds something else (a merge of another recipe, or any other model).

        ``"same"``: the target already holds this very merge (a concurrent run pushed it): ``m`` is published.
        """
        repo_id, h = m.repo_id, m.recipe_hash
        known = self.repo_hash.get(repo_id)
        if known is not None:
            return None if known == h else f"target {repo_id} already holds another merge (recipe {known[:12]})"
        try:
            info = with_retry(lambda: self.api.model_info(repo_id, token=self.token), f"model info of {repo_id}",
                              self.retry)
        except RepositoryNotFoundError:
            return None
        except Exception:  # noqa: BLE001 - the push itself will say what is wrong
            return None
        files = {s.rfilename for s in info.siblings or []} - {".gitattributes"}
        if not files:
            return None  # created by a run killed before its commit: ours to fill
        if hubio.RECIPE_FILE in files:
            try:
                raw = with_retry(lambda: hubio.fetch_file(repo_id, hubio.RECIPE_FILE, "model", self.token),
                                 f"recipe of {repo_id}", self.retry)
                there = (load_yaml(raw or b"", f"recipe of {repo_id}") or {}).get("hash")
            except Exception:  # noqa: BLE001 - unreadable: not ours
                there = None
            if there == h:
                m.status, m.action, m.url = PUBLISHED, "skipped (published meanwhile)", f"{constants.ENDPOINT}/{repo_id}"
                self.published[h] = Published(repo_id, info.sha or "", m.url, h, dict(m.scores))
                self.repo_hash[repo_id] = h
                return "same"
        return f"target {repo_id} exists and holds files that are not this merge; change push.name"

    # ---- leaderboard ------------------------------------------------------------------------

    def leaderboard(self, report: PipelineReport) -> None:
        p = self.p
        rows = {m.recipe_hash: {**m.row(report.base), "eval": self.eval_signature}
                for m in report.merges if m.recipe_hash}
        for h, r in self.previous.items():  # earlier runs' rows stay (a candidate gone from a query, ...)
            rows.setdefault(h, {**r, "scores": {k: _finite(v) for k, v in r["scores"].items()}})
        ordered = sorted(rows.values(), key=lambda r: (r.get("status") != PUBLISHED, r.get("score") is None,
                                                       -(r.get("score") or 0.0) * (1 if self._goal_or_max() == "max" else -1),
                                                       r.get("repo_id") or "", r["recipe_hash"]))
        data = {"pipeline": p.name, "base": report.base.pinned, "namespace": p.push.namespace,
                "select": None if p.select is None else {"metric": p.select.metric, "goal": self._goal(),
                                                         "top_k": p.select.top_k, "threshold": p.select.threshold},
                "candidates": [{"repo_id": c.repo_id, "sha": c.info.sha if c.info else None,
                                "license": c.info.license if c.info else None,
                                "status": "failed" if c.error else ("left out" if c.skipped else "ok"),
                                "reason": c.error or c.skipped} for c in report.candidates
                               if p.push.private or not _hidden(c)],
                "merges": ordered}
        hidden = [c for c in report.candidates if _hidden(c)]
        if hidden and not p.push.private:  # a private repo's name is not for a public leaderboard
            data["private_candidates"] = len(hidden)
        text_json = json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"
        text_md = render_leaderboard(data)
        folder = os.path.join(self.work, p.leaderboard.folder)
        os.makedirs(folder, exist_ok=True)
        for name, text in ((hubio.LEADERBOARD_JSON, text_json), (hubio.LEADERBOARD_MD, text_md)):
            tmp = os.path.join(folder, f".{name}.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, os.path.join(folder, name))
        report.leaderboard_path = folder
        if p.leaderboard.repo:
            files = {hubio.LEADERBOARD_JSON: text_json.encode(), "README.md": text_md.encode()}
            try:
                report.leaderboard_url = hubio.push_files(self.api, p.leaderboard.repo, files,
                                                          "Update the hubsoup pipeline leaderboard", self.retry,
                                                          repo_type=p.leaderboard.repo_type,
                                                          private=p.push.private or None, token=self.token)
            except Exception as e:  # noqa: BLE001 - the merges are published; the leaderboard push is reported
                report.candidates.append(Candidate(p.leaderboard.repo, error=(
                    f"leaderboard push failed: {scrub_secrets(str(e).splitlines()[0] if str(e) else type(e).__name__)}")))

    def _goal_or_max(self) -> str:
        return self._goal() if self.p.select is not None else "max"

    # ---- helpers ----------------------------------------------------------------------------

    def _public(self, e: "BaseException | str") -> str:
        """An error message fit for a published leaderboard: no token, no local path, one line."""
        text = " ".join(str(e).split())
        for path, name in ((constants.HF_HUB_CACHE, "<hf-cache>"), (self.work, "<work_dir>"),
                           (os.path.expanduser("~"), "~")):
            if path and len(path) > 1:
                text = text.replace(os.path.abspath(path), name)
        return scrub_secrets(text, self.token)

    def _line(self, text: str) -> None:
        print(text, file=self.out, flush=True)


def _hidden(c: Candidate) -> bool:
    """A private candidate left out: its name (not public on the Hub) stays off a public leaderboard."""
    return bool(c.info and c.info.private and (c.error or c.skipped))


def _finite(v: Any) -> Any:
    """A score for the leaderboard's JSON: NaN and ±inf are null (JSON has no such numbers)."""
    return v if not isinstance(v, float) or math.isfinite(v) else None


def _cell(v: Any) -> str:
    """A score in the markdown table: 4 decimals; a score that was not a finite number is ``n/a``."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.4f}" if _finite(float(v)) is not None else "n/a"
    return "n/a" if v is None else ""


def _checksums(folder: str) -> dict[str, str]:
    """sha256 of every file under ``folder`` but its card (``README.md``, rendered again before a push)."""
    out = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel == "README.md":
                continue
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            out[rel] = h.hexdigest()
    return out


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def render_leaderboard(data: dict) -> str:
    """The leaderboard as markdown (the JSON's content, one row per merge)."""
    lines = [f"# {data['pipeline']}: leaderboard", "",
             f"Merges of fine-tunes of `{data['base']}` made with hubsoup, published under `{data['namespace']}`.", ""]
    sel = data.get("select")
    if sel:
        what = ", ".join(x for x in (f"top {sel['top_k']}" if sel.get("top_k") else "",
                                    f"threshold {sel['threshold']}" if sel.get("threshold") is not None else "") if x)
        lines += [f"Selection: `{sel['metric']}` ({sel['goal']}){'; ' + what if what else ''}.", ""]
    metrics = sorted({k for r in data["merges"] for k in (r.get("scores") or {})})
    head = ["model", "status", "method", "inputs", *metrics, "license", "recipe"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in data["merges"]:
        model = f"[{r['repo_id']}]({r['url']})" if r.get("url") else f"`{r.get('repo_id') or '-'}`"
        status = r["status"] + (f": {r['reason']}" if r.get("reason") else "")
        inputs = "<br>".join(f"`{i.split('@')[0]}@{i.split('@')[1][:8]}`" if "@" in i else f"`{i}`"
                             for i in r.get("inputs", []))
        params = ", ".join(f"{k}={v}" for k, v in (r.get("params") or {}).items() if v is not None)
        method = f"{r['method']}" + (f" ({params})" if params else "")
        scores = [_cell((r.get("scores") or {}).get(k, "")) for k in metrics]
        cells = [model, status, method, inputs, *scores, r.get("license") or "", f"`{r['recipe_hash'][:12]}`"]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    failed = [c for c in data.get("candidates", []) if c.get("status") in ("failed", "left out")]
    if failed or data.get("private_candidates"):
        lines += ["", "## Candidates left out", ""]
        lines += [f"- `{c['repo_id']}`: {c['reason']}" for c in failed]
        if data.get("private_candidates"):
            lines.append(f"- {data['private_candidates']} private repo(s), not named here")
    return "\n".join(lines) + "\n"


def print_plan(report: PipelineReport, out: TextIO) -> None:
    """The dry run's plan: candidates, merges to do and skipped (and why), bytes to download."""
    p = report.pipeline

    def w(s=""):
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
            w(f"  ok         {c.info.pinned} ({c.info.kind}, license {c.info.license}, "
              f"{_size(sum(c.info.weight_files.values()))})")
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
    w(f"download: {_size(report.download_bytes)} of weights "
      f"({_size(report.cached_bytes)} already in the local cache, {_size(report.download_bytes - report.cached_bytes)} to fetch)")
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


__all__ = ["run_pipeline", "PipelineReport", "PlannedMerge", "Candidate", "render_leaderboard", "ParameterError"]
