"""Planning a pipeline run from the Hub, before any weight is read: the base and the candidates (queried, pinned,
their access, license and architecture checked), the merges the specs ask for, each named by its predicted recipe
hash, and what the target namespace and the leaderboard already hold (published, refused or not selected before)."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from typing import Any

from hubsoup import __version__
from hubsoup.errors import HubsoupError, ParameterError
from hubsoup.formats.stages import is_multi_stage, read_stages
from hubsoup.hubclient import check_repo_id, parse_spec
from hubsoup.options import MergeOptions
from hubsoup.public import map_models
from hubsoup.session import make_recipe, parse_method
from hubsoup.sources import Checkpoint, InputRef, open_input
from hubsoup.sources.compat import check_config
from hubsoup.untrusted import load_yaml
from hubsoup.workflows.pipeline import hubio
from hubsoup.workflows.pipeline.config import MergeSpec
from hubsoup.workflows.pipeline.context import Run
from hubsoup.workflows.pipeline.hubio import RepoInfo, with_retry
from hubsoup.workflows.pipeline.licenses import combine, forbids_derivatives
from hubsoup.workflows.pipeline.report import (FAILED, NOT_SELECTED, PLANNED, PUBLISHED, REFUSED, Candidate,
                                               PipelineReport, PlannedMerge)


def plan(run: Run) -> PipelineReport:
    """The run's plan: candidates, merges (each with its status: to do, published, refused, failing) and bytes to
    download; sets the run's options, base and what the Hub holds."""
    p = run.p
    run.opts = MergeOptions(**p.options, token=run.token, quiet=True)
    base = run.base = hubio.repo_info(run.api, p.base, run.retry, run.token, role="base")
    hidden = _restricted(run, base)
    if hidden:
        raise ParameterError(f"base '{p.base}': {hidden}")
    base_ckpt = _open_config(run, base.pinned, role="base")
    candidates = _candidates(run, base, base_ckpt)
    good = [c.info for c in candidates if c.info is not None and not c.error and not c.skipped]
    run.published = hubio.published_recipes(run.api, p.push.namespace, run.retry, run.token)
    run.repo_hash = {pub.repo_id: h for h, pub in run.published.items()}
    if p.leaderboard.repo:
        rows = hubio.previous_leaderboard(run.api, p.leaderboard.repo, p.leaderboard.repo_type, run.retry,
                                          run.token)
        run.previous = {r["recipe_hash"]: r for r in rows}
    merges: list[PlannedMerge] = []
    for i, spec in enumerate(p.merges):
        if spec.config is not None:  # a mergekit config: its own models, pinned now
            merges.append(_plan_config(run, i, spec, base))
            continue
        for combo in _combinations(run, spec, good, candidates, i):
            merges.append(plan_one(run, i, spec, base, combo))
    seen: set[str] = set()
    unique = []
    for m in merges:  # two specs may describe the same merge: made once
        if m.recipe_hash not in seen:
            seen.add(m.recipe_hash)
            unique.append(m)
    report = PipelineReport(p, base, candidates, unique)
    _sizes(run, report)
    return report


def _open_config(run: Run, pinned: str, role: str) -> Checkpoint:
    """The repo's metadata (config, card), no weights; its architecture is checked against the base's."""
    return with_retry(lambda: open_input(pinned, token=run.token, role=role), f"metadata of {pinned}", run.retry)


def _candidates(run: Run, base: RepoInfo, base_ckpt: Checkpoint) -> list[Candidate]:
    p = run.p
    specs: dict[str, str] = {}
    for s in p.candidates.models:
        specs.setdefault(parse_spec(s)[0], s)
    explicit = set(specs)
    if p.candidates.query is not None:
        for repo_id in hubio.query_candidates(run.api, p.candidates.query, base.repo_id, run.retry, run.token):
            specs.setdefault(repo_id, repo_id)
    excluded = {parse_spec(e)[0] for e in p.candidates.exclude} | {base.repo_id}
    out = []
    for repo_id in sorted(specs):  # sorted: a query's order never changes a recipe (inputs' order)
        if repo_id in excluded:
            continue
        c = Candidate(specs[repo_id])
        try:
            c.info = hubio.repo_info(run.api, c.spec, run.retry, run.token)
            hidden = _restricted(run, c.info)
            if hidden and repo_id in explicit:
                c.error = hidden
            elif hidden:
                c.skipped = hidden
            elif c.info.terms.error or any(forbids_derivatives(i) for i in c.info.terms.ids):
                c.error = "license: " + combine([(repo_id, c.info.terms)]).reason
            elif c.info.kind == "full":
                check_config(base_ckpt, _open_config(run, c.info.pinned, role="input"))
        except HubsoupError as e:
            c.error = run.public(e)
        out.append(c)
    return out


def _restricted(run: Run, info: RepoInfo) -> str | None:
    """Why a private or gated repo may not go into this pipeline's public merges (None: it may)."""
    what = info.restricted
    if what is None or run.p.allow_private_inputs or run.p.push.private:
        return None
    return (f"{what} repo: not merged into public repos (set allow_private_inputs: true in the pipeline, "
            "or push.private: true)")


def _combinations(run: Run, spec: MergeSpec, good: list[RepoInfo], candidates: list[Candidate], i: int
                  ) -> list[list[RepoInfo]]:
    if spec.combine == "all":
        return [good] if good else []
    if spec.combine == "pairs":
        return [list(c) for c in itertools.combinations(good, 2)]
    if spec.combine == "each":
        return [[g] for g in good]
    assert spec.partner is not None  # combine: with (the config's check)
    partner_id = spec.partner.split("@")[0]
    partner = next((g for g in good if g.repo_id == partner_id), None)
    if partner is None:
        bad = next((c for c in candidates if c.repo_id == partner_id), None)
        if bad is None:
            try:
                partner = hubio.repo_info(run.api, spec.partner, run.retry, run.token)
            except HubsoupError as e:
                candidates.append(Candidate(spec.partner, error=run.public(e)))
                return []
            hidden = _restricted(run, partner)
            if hidden:
                candidates.append(Candidate(spec.partner, partner, error=hidden))
                return []
        else:
            return []  # the partner's failure is reported with the candidates
    return [[partner, g] for g in good if g.repo_id != partner.repo_id]


def plan_one(run: Run, i: int, spec: MergeSpec, base: RepoInfo, inputs: list[RepoInfo]) -> PlannedMerge:
    """One merge of ``spec`` (the i-th) over ``inputs``: its predicted recipe hash, name, license and status."""
    decision = combine([(base.repo_id, base.terms), *((x.repo_id, x.terms) for x in inputs)],
                       run.p.license.output)
    try:
        h, params = _predict(run, spec, base, inputs)
    except HubsoupError as e:
        m = PlannedMerge(i, spec, inputs, "", dict(spec.params), "", decision, FAILED, run.public(e))
        return m
    name = _name(run, spec, inputs, h, base)
    m = PlannedMerge(i, spec, inputs, h, params, f"{run.p.push.namespace}/{name}", decision)
    pub = run.published.get(h)
    prev = run.previous.get(h)
    if pub is not None:
        m.status, m.action, m.repo_id, m.url = PUBLISHED, "skipped (already published)", pub.repo_id, pub.url
    elif not decision.ok and decision.blocking:  # an input's own terms: no option publishes it
        m.status, m.reason = REFUSED, f"license: {decision.reason}"
    elif not decision.ok and not run.p.license.allow_mix:
        m.status, m.reason = REFUSED, f"license: {decision.reason} (set license.allow_mix or license.output)"
    elif prev is not None and prev.get("status") == NOT_SELECTED and prev.get("eval") == run.eval_signature:
        m.deferred, m.scores = True, dict(prev.get("scores") or {})
    if m.status == PLANNED and m.repo_id in run.repo_hash and run.repo_hash[m.repo_id] != h:
        m.status, m.reason = FAILED, (f"target {m.repo_id} already holds another merge (recipe "
                                      f"{run.repo_hash[m.repo_id][:12]}); change push.name")
    return m


def _plan_config(run: Run, i: int, spec: MergeSpec, base: RepoInfo) -> PlannedMerge:
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
        map_models(d, collect)
    inputs: list[RepoInfo] = []
    problem = None
    for ref in refs:
        try:
            check_repo_id(parse_spec(ref)[0])
            info = hubio.repo_info(run.api, ref, run.retry, run.token)
        except HubsoupError as e:
            problem = problem or f"{ref}: {run.public(e)}"
            continue
        hidden = _restricted(run, info)
        if hidden:
            problem = problem or f"{info.repo_id}: {hidden}"
        elif info.terms.error or any(forbids_derivatives(x) for x in info.terms.ids):
            problem = problem or f"{info.repo_id}: license: " + combine([(info.repo_id, info.terms)]).reason
        if all(x.repo_id != info.repo_id for x in inputs):
            inputs.append(info)
    pins = {ref: info.pinned for ref in refs for info in inputs if info.repo_id == parse_spec(ref)[0]}
    pinned = [json.dumps(map_models(d, lambda r: "+".join(pins.get(x, x) for x in r.split("+"))),
                         sort_keys=True, default=str) for d in docs]
    key = hashlib.sha256(json.dumps([pinned, run.opts.hashed, __version__], default=str).encode()).hexdigest()
    decision = combine([(base.repo_id, base.terms), *((x.repo_id, x.terms) for x in inputs)],
                       run.p.license.output)
    m = PlannedMerge(i, spec, inputs, key, {"config": spec.config}, "", decision, work_key=key[:16], pins=pins)
    if problem is not None:
        m.status, m.reason = FAILED, problem
        return m
    m.repo_id = f"{run.p.push.namespace}/{_name(run, spec, inputs, key, base)}"
    if m.repo_id in run.repo_hash:  # the name holds the id: this pinned config is published there
        pub = run.published[run.repo_hash[m.repo_id]]
        m.recipe_hash = pub.recipe_hash
        m.status, m.action, m.url = PUBLISHED, "skipped (already published)", pub.url
    elif not decision.ok and decision.blocking:
        m.status, m.reason = REFUSED, f"license: {decision.reason}"
    elif not decision.ok and not run.p.license.allow_mix:
        m.status, m.reason = REFUSED, f"license: {decision.reason} (set license.allow_mix or license.output)"
    return m


def _predict(run: Run, spec: MergeSpec, base: RepoInfo, inputs: list[RepoInfo]) -> tuple[str, dict[str, Any]]:
    """The recipe hash the merge will have (checked against the merge's own afterwards)."""
    m, params = parse_method(spec.method, dict(spec.params))
    m.check_inputs(params, len(inputs))

    def ref(r: RepoInfo) -> InputRef:
        return InputRef(spec=r.pinned, repo_id=r.repo_id, revision=r.sha, sha=r.sha, kind=r.kind)

    described = m.describe_params(params)
    recipe = make_recipe(spec.method, described, ref(base), [ref(i) for i in inputs], dtype=run.opts.dtype,
                        options=run.opts)
    return recipe.hash, json.loads(json.dumps(described, default=str))


def _name(run: Run, spec: MergeSpec, inputs: list[RepoInfo], h: str, base: RepoInfo) -> str:
    shorts = [i.short for i in inputs]
    inputs_short = "-".join(shorts)
    if len(inputs_short) > 48:
        inputs_short = "-".join(s[:10] for s in shorts)
    if len(inputs_short) > 48:
        inputs_short = f"{len(inputs)}models"
    fields = {"method": spec.method, "spec": spec.name or spec.method, "inputs_short": inputs_short,
              "n": len(inputs), "hash8": h[:8], "hash": h, "base_short": base.short}
    name = run.p.push.name.format(**fields)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name)
    name = re.sub(r"-{2,}", "-", name).strip("-.")
    if len(name) > 96:
        name = name[:87].rstrip("-.") + "-" + h[:8]
    return name


def _sizes(run: Run, report: PipelineReport) -> None:
    todo = [m for m in report.merges if m.status == PLANNED and not m.deferred]
    repos: dict[str, RepoInfo] = {}
    for m in todo:
        for r in (report.base, *m.inputs):
            repos[r.pinned] = r
    report.download_bytes = sum(sum(r.weight_files.values()) for r in repos.values())
    report.cached_bytes = sum(r.cached_bytes() for r in repos.values())
