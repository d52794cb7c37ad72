"""The pipeline file: typed dataclasses read from YAML, every unknown key an error naming it.

A pipeline says which candidates to merge (an explicit list and/or a Hub query), onto which
base, with which methods and combinations, how to evaluate and select the results, and where
to publish them. ``examples/pipelines/pipeline.yml`` is a complete, commented example.

Example:
    >>> from hubsoup.workflows.pipeline.config import load_pipeline
    >>> p = load_pipeline({"base": "org/base", "candidates": {"models": ["org/ft-a", "org/ft-b"]},
    ...                    "merges": [{"method": "ties", "params": {"density": 0.5}}],
    ...                    "push": {"namespace": "my-org"}})
    >>> p.merges[0].combine, p.push.name
    ('all', '{method}-{inputs_short}-{hash8}')
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import string
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, TypeVar

from hubsoup.errors import ParameterError
from hubsoup.eval import TaskSpec
from hubsoup.formats.mergekit import is_mergekit_config
from hubsoup.formats.stages import is_multi_stage, read_stages
from hubsoup.hubclient import check_repo_id, parse_spec
from hubsoup.methods import get_method
from hubsoup.sources.access import hub_only
from hubsoup.untrusted import MAX_YAML_BYTES, label, load_yaml, short

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")

COMBINATIONS = ("all", "pairs", "each", "with")
"""How a merge spec combines the candidates: ``all`` (one merge of every candidate), ``pairs``
(every pair), ``each`` (every candidate alone, e.g. ``sftm`` of one model), ``with`` (every
candidate with a fixed partner, ``combine: {with: org/model}``)."""

SORTS = ("downloads", "likes", "created_at", "last_modified", "trending_score")
NAME_FIELDS = ("method", "spec", "inputs_short", "n", "hash8", "hash", "base_short")
"""Fields of the push name template, e.g. ``{method}-{inputs_short}-{hash8}``."""


@dataclass
class Query:
    """Candidates found on the Hub (``HfApi.list_models``); results are sorted by repo ID, so their order never changes a recipe."""

    base_model: str | None = None
    """Fine-tunes whose card names this base (the Hub's ``base_model:<id>`` tag); default: the pipeline's base."""
    author: str | None = None
    tags: list[str] = field(default_factory=list)
    """Every tag must be present (``list_models(filter=...)``)."""
    search: str | None = None
    sort: str | None = "downloads"
    """``downloads``, ``likes``, ``created_at``, ``last_modified`` or ``trending_score`` (descending): which ``limit`` models."""
    limit: int = 20


@dataclass
class Candidates:
    models: list[str] = field(default_factory=list)
    """Explicit repo IDs, ``org/name[@revision]``."""
    query: Query | None = None
    exclude: list[str] = field(default_factory=list)
    """Repo IDs never used (e.g. a known-bad upload)."""


@dataclass
class MergeSpec:
    method: str = ""
    """A hubsoup method (give it, or ``config``)."""
    params: dict[str, Any] = field(default_factory=dict)
    combine: str = "all"
    """``all``, ``pairs``, ``each``, or ``with`` (then ``partner`` is set: ``combine: {with: org/model}``)."""
    partner: str | None = None
    name: str | None = None
    """A label for this spec (the ``{spec}`` field of the name template; default: the method)."""
    config: str | None = None
    """A mergekit config file (relative to the pipeline file) or its YAML text (a mergekit-multi stream of stages too), run as
    ``hubsoup run`` runs it, instead of ``method``: the Hub models it names are this merge's inputs, checked
    for access and licenses as candidates are; ``params`` and ``combine`` do not apply. ``method`` then
    reads as its (final stage's) ``merge_method``."""
    text: str = field(default="", repr=False)
    """The config's text, read when the pipeline is loaded (not a YAML key)."""


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=list)
    """:class:`hubsoup.eval.TaskSpec` strings (``KIND:DATA[,key=value...]``); a relative DATA path is
    taken relative to the pipeline file."""
    limit: int | None = None
    """At most this many examples per task."""


@dataclass
class Select:
    """Which evaluated merges are published (the others are listed on the leaderboard as ``not selected``)."""

    metric: str = "score"
    """``score`` (the mean over tasks of each one's score: accuracy, or -log(perplexity)), a metric name (``accuracy``,
    ``perplexity``: mean over the tasks that report it), or ``TASK/METRIC``."""
    goal: str | None = None
    """``max`` or ``min``; default ``min`` for perplexity, ``max`` otherwise."""
    top_k: int | None = None
    """Publish only the best k merges (among this run's and those already published or rejected)."""
    threshold: float | None = None
    """Publish only merges at least this good (≥ for ``max``, ≤ for ``min``)."""


@dataclass
class PushTarget:
    namespace: str
    name: str = "{method}-{inputs_short}-{hash8}"
    """Repo name template; fields: ``method``, ``spec``, ``inputs_short``, ``n``, ``hash8``, ``hash``, ``base_short``."""
    private: bool = False
    stream: bool = True
    """A merge pushed without an evaluation (no ``eval`` and no ``select``) is streamed to the Hub as it is written
    (``hubsoup.merge(..., push=...)``): nothing of it is kept in ``work_dir``, the disk holds a few shards at once,
    and a failed or interrupted push resumes on the next run (the shards the Hub holds are neither merged nor
    uploaded again). ``false``: every merge is written whole to ``work_dir`` first, then pushed (and reused,
    verified, by the next run when its push failed)."""


@dataclass
class LicensePolicy:
    output: str | None = None
    """The license to publish under; every input's (and the base's) license must allow it. Default:
    the most restrictive license of the inputs into which all of them may go (see ``licenses.py``)."""
    allow_mix: bool = False
    """Publish even when the licenses cannot be combined (the card then names no license and lists them)."""


@dataclass
class LeaderboardConfig:
    folder: str = "leaderboard"
    """Folder inside ``work_dir`` for ``leaderboard.md`` and ``leaderboard.json``: a name (a label), not a path."""
    repo: str | None = None
    """Also publish it to this Hub repo (created if needed)."""
    repo_type: str = "dataset"


@dataclass
class RetryConfig:
    """Bounded back-off for rate limits (429), server errors (5xx) and timeouts."""

    attempts: int = 5
    base_wait: float = 2.0
    max_wait: float = 60.0


@dataclass
class Pipeline:
    base: str
    merges: list[MergeSpec]
    push: PushTarget
    candidates: Candidates = field(default_factory=Candidates)
    """Needed unless every merge is a ``config:`` merge (which names its own models)."""
    name: str = "hubsoup pipeline"
    eval: EvalConfig | None = None
    select: Select | None = None
    license: LicensePolicy = field(default_factory=LicensePolicy)
    leaderboard: LeaderboardConfig = field(default_factory=LeaderboardConfig)
    options: dict[str, Any] = field(default_factory=dict)
    """Merge options (``dtype``, ``device``, ``shard_size``, ``ignore_extra``, ``shape_mismatch``, ...)."""
    work_dir: str = "hubsoup-pipeline"
    """Local folder for merge outputs (a cache: what is published is found on the Hub) and the leaderboard;
    relative to the pipeline file."""
    retry: RetryConfig = field(default_factory=RetryConfig)
    allow_private_inputs: bool = False
    """Merge private and gated candidates (and a private or gated base) into public repos too; their
    cards then say so. Default: such a candidate is left out (a private push target takes them)."""
    root: str = field(default=".", repr=False)
    """The folder relative paths are taken from (the pipeline file's; not a YAML key)."""


_OPTION_KEYS = ("dtype", "device", "device_map", "max_memory", "shard_size", "ignore_extra", "shape_mismatch",
                "allow_pickle")


def load_pipeline(source: str | os.PathLike[str] | dict[str, Any]) -> Pipeline:
    """Read and check a pipeline (a YAML file's path or the mapping it holds).

    Raises:
        hubsoup.errors.ParameterError: one line naming the file and the key at fault.
    """
    where = "pipeline"
    root = os.getcwd()
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        where = f"pipeline '{path}'"
        if not os.path.isfile(path):
            raise ParameterError(f"{where}: no such file")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_YAML_BYTES + 1)
        _refuse_mergekit_config(text, where, path)
        data = load_yaml(text, where)
        root = os.path.dirname(os.path.abspath(path))
    else:
        data = dict(source)
    if not isinstance(data, dict):
        raise ParameterError(f"{where}: must be a YAML mapping (base, candidates, merges, push, ...)")
    p = _build(Pipeline, data, where, "")
    p.root = root
    _check(p, where)
    return p


def _refuse_mergekit_config(text: str, where: str, path: str) -> None:
    """A mergekit config (one document or a mergekit-multi stream) given as a pipeline: say what runs it."""
    multi = is_multi_stage(text)
    if not multi:
        try:
            if not is_mergekit_config(load_yaml(text, where)):
                return
        except ParameterError:
            return  # refused with its reason by the caller's own read
    raise ParameterError(f"{where}: this is a mergekit config{' (mergekit-multi stages)' if multi else ''}, not a "
                         f"pipeline (base, candidates, merges, push): run it with 'hubsoup run {path} OUT_DIR', "
                         "or name it in a pipeline's merges as {config: FILE}")


def _build(cls: type[_D], data: Any, where: str, key: str) -> _D:
    """A dataclass from a mapping: unknown keys, missing keys and wrong types are one line naming the key."""
    if cls is MergeSpec and isinstance(data, dict):
        data = _merge_spec_input(data, where, key)
    if not isinstance(data, dict):
        raise ParameterError(f"{where}: '{key or '(top)'}' must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("root", "text")}
    for k in data:
        if k not in known:
            full = f"{key}.{k}" if key else str(k)
            close = _close(str(k), known)
            raise ParameterError(f"{where}: unknown key '{full}'" + (f" (did you mean '{close}'?)" if close else "")
                                 + f"; known keys here: {', '.join(known)}")
    kwargs = {}
    for name, f in known.items():
        full = f"{key}.{name}" if key else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ParameterError(f"{where}: '{full}' is missing")
            continue
        kwargs[name] = _value(hints[name], data[name], where, full)
    return cls(**kwargs)


def _merge_spec_input(data: dict[str, Any], where: str, key: str) -> dict[str, Any]:
    """``combine: {with: org/model}`` → ``combine: with`` + ``partner``."""
    data = dict(data)
    combine = data.get("combine")
    if isinstance(combine, dict):
        if set(combine) != {"with"} or not isinstance(combine["with"], str):
            raise ParameterError(f"{where}: '{key}.combine' as a mapping must be {{with: ORG/NAME}}, got {combine!r}")
        data["combine"], data["partner"] = "with", combine["with"]
    return data


def _value(tp: Any, value: Any, where: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _value(inner[0], value, where, key)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a hint: the class itself
        return _build(tp, value, where, key)
    if origin is list:
        if isinstance(value, (str, dict)) or not isinstance(value, list):
            value = [value] if isinstance(value, (str, dict)) else value
        if not isinstance(value, list):
            raise ParameterError(f"{where}: '{key}' must be a list, got {value!r}")
        return [_value(args[0], v, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ParameterError(f"{where}: '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ParameterError(f"{where}: '{key}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParameterError(f"{where}: '{key}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParameterError(f"{where}: '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str) or not value.strip():
            raise ParameterError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
        return value.strip()
    return value


def _close(name: str, known: Iterable[str]) -> str | None:
    hits = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return hits[0] if hits else None


def _check(p: Pipeline, where: str) -> None:
    if not p.merges:
        raise ParameterError(f"{where}: 'merges' is empty; give at least one {{method: ...}}")
    if not p.candidates.models and p.candidates.query is None and not all(m.config for m in p.merges):
        raise ParameterError(f"{where}: 'candidates' needs 'models' and/or 'query'")
    for i, m in enumerate(p.merges):
        if m.config is not None:
            _check_config_spec(p, m, i, where)
            continue
        if not m.method:
            raise ParameterError(f"{where}: 'merges[{i}]' needs 'method' (a hubsoup method) or 'config' (a mergekit "
                                 "config file)")
        if m.combine not in COMBINATIONS:
            raise ParameterError(f"{where}: 'merges[{i}].combine' must be one of all, pairs, each or "
                                 f"{{with: ORG/NAME}}, got {m.combine!r}")
        if m.combine == "with" and not m.partner:
            raise ParameterError(f"{where}: 'merges[{i}].combine: with' needs the partner: combine: {{with: ORG/NAME}}")
        if m.partner and m.combine != "with":
            raise ParameterError(f"{where}: 'merges[{i}].partner' is only used with combine: {{with: ORG/NAME}}")
        try:
            get_method(m.method)
        except Exception as e:  # noqa: BLE001 - the method registry's own message, with where it came from
            raise ParameterError(f"{where}: 'merges[{i}].method': {e}") from None
    q = p.candidates.query
    if q is not None:
        if q.sort is not None and q.sort not in SORTS:
            raise ParameterError(f"{where}: 'candidates.query.sort' must be one of {', '.join(SORTS)}, got {q.sort!r}")
        if q.limit < 1:
            raise ParameterError(f"{where}: 'candidates.query.limit' must be at least 1, got {q.limit}")
    for i, spec in enumerate(p.candidates.models):
        _check_spec(spec, where, f"candidates.models[{i}]")
    _check_spec(p.base, where, "base")
    try:
        check_repo_id(f"{p.push.namespace}/x")
    except Exception:  # noqa: BLE001
        raise ParameterError(f"{where}: 'push.namespace' {p.push.namespace!r} is not a Hub user or organisation name") from None

    try:
        fields_used = {f for _, f, _, _ in string.Formatter().parse(p.push.name) if f is not None}
    except ValueError as e:
        raise ParameterError(f"{where}: 'push.name' {p.push.name!r} is not a template: {e}") from None
    bad = sorted(fields_used - set(NAME_FIELDS))
    if bad:
        raise ParameterError(f"{where}: 'push.name' uses unknown field '{{{bad[0]}}}' (fields: {', '.join(NAME_FIELDS)})")
    if p.select is not None:
        if p.eval is None or not p.eval.tasks:
            raise ParameterError(f"{where}: 'select' ranks evaluated merges; give 'eval.tasks' too")
        if p.select.goal not in (None, "max", "min"):
            raise ParameterError(f"{where}: 'select.goal' must be max or min, got {p.select.goal!r}")
        if p.select.top_k is not None and p.select.top_k < 1:
            raise ParameterError(f"{where}: 'select.top_k' must be at least 1, got {p.select.top_k}")
    if p.eval is not None:
        for i, t in enumerate(p.eval.tasks):
            try:
                TaskSpec.parse(t)
            except Exception as e:  # noqa: BLE001
                raise ParameterError(f"{where}: 'eval.tasks[{i}]': {e}") from None
    unknown = sorted(set(p.options) - set(_OPTION_KEYS))
    if unknown:
        raise ParameterError(f"{where}: unknown key 'options.{unknown[0]}' (merge options: {', '.join(_OPTION_KEYS)})")
    if p.leaderboard.repo:
        try:
            check_repo_id(p.leaderboard.repo)
        except Exception as e:  # noqa: BLE001
            raise ParameterError(f"{where}: 'leaderboard.repo': {e}") from None
    # a name in a config is a label: the leaderboard's folder is made inside work_dir, never a path it chooses
    label(p.leaderboard.folder, f"{where}: 'leaderboard.folder'")
    if p.leaderboard.repo_type not in ("dataset", "model"):
        raise ParameterError(f"{where}: 'leaderboard.repo_type' must be dataset or model, got {p.leaderboard.repo_type!r}")
    if p.retry.attempts < 1 or p.retry.base_wait < 0 or p.retry.max_wait < p.retry.base_wait:
        raise ParameterError(f"{where}: 'retry' needs attempts ≥ 1 and 0 ≤ base_wait ≤ max_wait")


def _check_config_spec(p: Pipeline, m: MergeSpec, i: int, where: str) -> None:
    """A ``config:`` merge: the file is read now (a mergekit config or mergekit-multi stream naming Hub models)."""
    key = f"merges[{i}]"
    if m.method or m.params or m.combine != "all" or m.partner:
        raise ParameterError(f"{where}: '{key}' runs a mergekit config: give 'config' alone (and 'name'), not "
                             "'method', 'params' or 'combine'")
    if not any(f in p.push.name for f in ("{hash8}", "{hash}")):
        raise ParameterError(f"{where}: 'push.name' must contain {{hash8}} or {{hash}} with a 'config' merge ("
                             "the name says which pinned config a published repo holds)")

    assert m.config is not None
    if "\n" in m.config:  # the config's YAML text itself (what a server's pipeline gives)
        text = m.config
    elif hub_only():
        raise ParameterError(f"{where}: '{key}.config' names a file, which a hub_only run never reads (give the "
                             "config's YAML text)")
    else:
        path = os.path.join(p.root, os.path.expanduser(m.config))
        if not os.path.isfile(path):
            raise ParameterError(f"{where}: '{key}.config' {m.config!r}: no such file")
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_YAML_BYTES + 1)
    if is_multi_stage(text):
        stages = read_stages(text)  # every stage's name a label (refused here, before anything is written)
        docs = [s.data for s in stages]
        needs = next((s for s in stages if s.needs), None)
        if hub_only() and needs is not None:
            raise ParameterError(f"{where}: '{key}.config': stage {short(needs.name or 'final')} merges the output of "
                                 f"stage {short(needs.needs[0])}, a local folder, which a hub_only run does not read")
    else:
        data = load_yaml(text, f"{key}.config {m.config!r}")
        if not is_mergekit_config(data):
            raise ParameterError(f"{where}: '{key}.config' {m.config[:60]!r} is not a mergekit config (no 'merge_method')")
        docs = [data]
    m.text, m.method = text, str(docs[-1].get("merge_method"))


def _check_spec(spec: str, where: str, key: str) -> None:
    repo_id, _ = parse_spec(spec)
    try:
        check_repo_id(repo_id)
    except Exception:  # noqa: BLE001
        raise ParameterError(f"{where}: '{key}' {spec!r} is not a Hub repo ID (org/name[@revision])") from None


__all__ = ["Pipeline", "Candidates", "Query", "MergeSpec", "EvalConfig", "Select", "PushTarget", "LicensePolicy",
           "LeaderboardConfig", "RetryConfig", "load_pipeline", "COMBINATIONS"]
