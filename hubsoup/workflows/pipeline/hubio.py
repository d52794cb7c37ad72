"""What a pipeline asks the Hub: candidates, their commits, sizes and licenses, what is already published.

Every call goes through :func:`with_retry`: rate limits (429), server errors (5xx), 408 and
timeouts or dropped connections are retried with exponential back-off (the server's
``Retry-After`` honoured), at most ``attempts`` times and never waiting longer than
``max_wait`` at once; anything else fails at once. huggingface_hub already retries its
paginated listings, pre-uploads and downloads' ``HEAD``; this adds the rest (``model_info``,
commits, whole merges whose downloads failed), bounded.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, TypeVar

from huggingface_hub import CommitOperationAdd, constants, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError, RepositoryNotFoundError
from huggingface_hub.utils import (  # type: ignore[attr-defined]  # huggingface_hub.utils: a computed __all__
    build_hf_headers, get_session, hf_raise_for_status)

from hubsoup.errors import HubsoupError, InputError
from hubsoup.hubclient import (RETRY_STATUS, Token, ensure_timeouts, error_response, error_status, hub_failure,
                               hub_timeout, is_timeout, parse_spec, transient)
from hubsoup.public import local_path_in_file
from hubsoup.untrusted import MAX_YAML_BYTES, load_yaml
from hubsoup.workflows.pipeline.config import Query, RetryConfig
from hubsoup.workflows.pipeline.licenses import read

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoSibling

log = logging.getLogger(__name__)
T = TypeVar("T")

RECIPE_FILE = "hubsoup_recipe.yaml"
EVAL_FILE = "eval_results.json"
LEADERBOARD_JSON = "leaderboard.json"
LEADERBOARD_MD = "leaderboard.md"


def retryable(e: BaseException) -> bool:
    """A transient Hub failure: 408/429/5xx, a timeout or a connection lost on the way (unlike a download's
    :func:`hubsoup.hubclient.transient`, a timeout too: these calls are small and a pipeline runs unattended)."""
    status = error_status(e)
    return status in RETRY_STATUS if status is not None else is_timeout(e) or transient(e)


def _retry_after(e: BaseException) -> float | None:
    resp = error_response(e)
    if resp is None:
        return None
    try:
        value = resp.headers.get("Retry-After")
        return float(value) if value is not None else None
    except (TypeError, ValueError, AttributeError):
        return None


def with_retry(fn: Callable[[], T], what: str, policy: RetryConfig, *, sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried on transient Hub failures (see the module's docstring); the last error is raised."""
    wait = policy.base_wait
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - re-raised unless transient
            if attempt >= policy.attempts or not retryable(e):
                raise
            pause = _retry_after(e)
            pause = min(policy.max_wait, wait if pause is None else max(pause, 0.0))
            status = error_status(e)
            log.warning("%s: %s; retry %d/%d in %.1fs", what, f"HTTP {status}" if status else type(e).__name__,
                        attempt, policy.attempts - 1, pause)
            sleep(pause)
            wait = min(policy.max_wait, max(wait * 2, 0.001))
    raise AssertionError("unreachable")


@dataclass
class RepoInfo:
    """One model repo at one commit, as the pipeline needs it (nothing downloaded but metadata)."""

    repo_id: str
    revision: str | None
    sha: str
    kind: str
    """``full`` or ``lora``."""
    license: str | None
    """The license as shown (``mit``, ``mit + apache-2.0``; None when it cannot be read: see :attr:`terms`)."""
    card_base_model: list[str]
    weight_files: dict[str, int] = field(default_factory=dict)
    """The files a merge would download, with their sizes in bytes."""
    private: bool = False
    gated: Any = False
    terms: Any = None
    """The card's license, read (:class:`~hubsoup.workflows.pipeline.licenses.License`)."""

    @property
    def restricted(self) -> str | None:
        """``private`` or ``gated`` when the repo is (its weights are not everyone's to publish), else None."""
        if self.private:
            return "private"
        if self.gated:
            return "gated"
        return None

    @property
    def pinned(self) -> str:
        return f"{self.repo_id}@{self.sha}"

    @property
    def short(self) -> str:
        return self.repo_id.split("/")[-1]

    def cached_bytes(self) -> int:
        """Bytes of :attr:`weight_files` already in the local Hub cache at this commit."""
        total = 0
        for name, size in self.weight_files.items():
            hit = try_to_load_from_cache(self.repo_id, name, revision=self.sha)
            if isinstance(hit, str) and os.path.isfile(hit):
                total += size
        return total


def _weight_files(siblings: Iterable[RepoSibling] | None) -> dict[str, int]:
    """What ``hubsoup.sources.resolve`` would download: the adapter, ``model.safetensors``, or the top-level shards."""
    files = {s.rfilename: (s.size or 0) for s in siblings or []}
    top = {n: s for n, s in files.items() if "/" not in n}
    if "adapter_config.json" in top:
        return {n: s for n, s in top.items() if n == "adapter_model.safetensors"}
    if "model.safetensors" in top:
        return {"model.safetensors": top["model.safetensors"]}
    return {n: s for n, s in top.items() if n.endswith(".safetensors")}


def repo_info(api: HfApi, spec: str, policy: RetryConfig, token: Token = None, role: str = "candidate") -> RepoInfo:
    """Resolve ``org/name[@rev]`` to its commit, kind, license and weight sizes (``model_info(files_metadata=True)``)."""
    repo_id, revision = parse_spec(spec)
    ensure_timeouts()
    try:
        info = with_retry(lambda: api.model_info(repo_id, revision=revision, files_metadata=True, token=token,
                                                 timeout=hub_timeout()), f"model info of {spec}", policy)
    except Exception as e:  # noqa: BLE001 - one line naming the repo
        raise hub_failure(e, f"{role} '{spec}'", repo_id, revision, token) from e
    card = (info.card_data.to_dict()  # type: ignore[no-untyped-call]  # huggingface_hub: CardData.to_dict untyped
            if info.card_data is not None else {})
    base_model = card.get("base_model") or []
    siblings = info.siblings or []
    kind = "lora" if any(s.rfilename == "adapter_config.json" for s in siblings) else "full"
    terms = read(card)
    if not info.sha:  # a Hub that names no commit: nothing to pin the candidate to
        raise InputError(f"{role} '{spec}': the Hub named no commit for it, so it cannot be pinned")
    bases = [base_model] if isinstance(base_model, str) else [b for b in base_model if isinstance(b, str)] \
        if isinstance(base_model, list) else []
    return RepoInfo(repo_id, revision, info.sha, kind, " + ".join(terms.ids) if terms.ids else None, bases,
                    _weight_files(siblings), bool(info.private), info.gated or False, terms)


def query_candidates(api: HfApi, q: Query, base_repo: str, policy: RetryConfig, token: Token = None) -> list[str]:
    """Repo IDs of the Hub query's models (fine-tunes of ``q.base_model``, default the pipeline's base)."""
    filters = [f"base_model:{q.base_model or base_repo}", *q.tags]
    kwargs: dict[str, Any] = {"filter": filters, "limit": q.limit, "token": token}
    if q.author:
        kwargs["author"] = q.author
    if q.search:
        kwargs["search"] = q.search
    if q.sort:
        kwargs["sort"] = q.sort
    return with_retry(lambda: [m.id for m in api.list_models(**kwargs)], "Hub query for candidates", policy)


@dataclass
class Published:
    repo_id: str
    sha: str
    url: str
    recipe_hash: str
    scores: dict[str, float] = field(default_factory=dict)


def published_recipes(api: HfApi, namespace: str, policy: RetryConfig, token: Token = None) -> dict[str, Published]:
    """Recipe hash → the repo of ``namespace`` holding that merge, read from each hubsoup repo's
    ``hubsoup_recipe.yaml`` on the Hub (repos tagged ``hubsoup``; one without a readable recipe is ignored)."""
    repos = with_retry(lambda: [(m.id, m.sha) for m in api.list_models(author=namespace, filter="hubsoup",
                                                                        full=True, token=token)],
                       f"list of {namespace}'s models", policy)
    out: dict[str, Published] = {}
    for repo_id, sha in sorted(repos):
        try:
            path = with_retry(lambda: hf_hub_download(repo_id, RECIPE_FILE, revision=sha, token=token),
                              f"recipe of {repo_id}", policy)
            with open(path, encoding="utf-8") as f:
                h = (load_yaml(f.read(MAX_YAML_BYTES + 1), f"recipe of {repo_id}") or {}).get("hash")
        except (EntryNotFoundError, RemoteEntryNotFoundError):
            continue
        except Exception as e:  # noqa: BLE001 - an unreadable repo is not ours to judge; said, not fatal
            log.warning("cannot read the recipe of %s: %s", repo_id, type(e).__name__)
            continue
        if isinstance(h, str) and h:
            out.setdefault(h, Published(repo_id, sha or "", f"{constants.ENDPOINT}/{repo_id}", h))
    return out


def published_scores(pub: Published, policy: RetryConfig, token: Token = None) -> dict[str, float]:
    """The eval scores a published merge carries (its ``eval_results.json``), ``{"task/metric": value}``."""
    try:
        path = with_retry(lambda: hf_hub_download(pub.repo_id, EVAL_FILE, revision=pub.sha or None, token=token),
                          f"eval results of {pub.repo_id}", policy)
    except (EntryNotFoundError, RemoteEntryNotFoundError):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, ValueError):  # untrusted: its scores are unknown, not a crash
        log.warning("the eval results of %s are not valid JSON; its scores are taken as unknown", pub.repo_id)
        return {}
    return flatten_scores(data)


def flatten_scores(results: Any) -> dict[str, float]:
    """``[{"task": t, "metrics": {m: v}}]`` (``eval_results.json``) → ``{"t/m": v}``.

    A value that is not a number (text, null) is kept as NaN, NaN and ±inf as they are, so that the
    merge it belongs to is never ranked on it (see :func:`non_finite`).
    """
    out: dict[str, float] = {}
    for r in results if isinstance(results, list) else []:
        if not isinstance(r, dict) or not isinstance(r.get("metrics"), dict):
            continue
        for m, v in r["metrics"].items():
            if m == "tokens":
                continue
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            out[f"{r.get('task')}/{m}"] = float(v) if number else math.nan
    return out


def non_finite(scores: dict[str, float]) -> list[str]:
    """The metrics whose value is not a finite number."""
    return sorted(k for k, v in scores.items() if not (isinstance(v, (int, float)) and math.isfinite(v)))


_STATUSES = ("published", "not selected", "refused", "failed", "planned")


def previous_leaderboard(api: HfApi, repo_id: str, repo_type: str, policy: RetryConfig, token: Token = None
                         ) -> list[dict[str, Any]]:
    """The rows of the leaderboard last published to ``repo_id`` (empty when there is none yet).

    Raises:
        hubsoup.errors.InputError: the file is not the JSON a pipeline writes (one line naming the
            repo, the row and the key; fix or delete ``leaderboard.json`` there), before anything is done.
    """
    try:
        raw = with_retry(lambda: fetch_file(repo_id, LEADERBOARD_JSON, repo_type, token), f"leaderboard {repo_id}",
                         policy)
    except RepositoryNotFoundError:
        return []
    if raw is None:
        return []
    where = f"leaderboard {repo_id} ({LEADERBOARD_JSON})"
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=lambda c: math.nan)
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{where}: not valid JSON ({str(e)[:80]}); fix or delete that file") from None
    if isinstance(data, dict) and "merges" not in data:  # someone else's file of that name: never overwritten
        raise InputError(f"{where}: has no 'merges': not a pipeline's leaderboard, and it is not replaced; choose "
                         "another leaderboard repo, or fix or delete that file")
    if not isinstance(data, dict) or not isinstance(data["merges"], list):
        raise InputError(f"{where}: must be a mapping whose 'merges' is a list; fix or delete that file")
    return [check_row(r, f"{where}: merges[{i}]") for i, r in enumerate(data["merges"])]


def check_row(r: Any, where: str) -> dict[str, Any]:
    """One leaderboard row, checked key by key (an earlier run's file is untrusted input)."""
    def bad(key: str, what: str, value: Any) -> InputError:
        text = repr(value)
        return InputError(f"{where}.{key} must be {what}, got {text[:40] + '...' if len(text) > 40 else text}; "
                          "fix or delete that file")

    if not isinstance(r, dict):
        raise bad("(row)", "a mapping", r)
    h = r.get("recipe_hash")
    if not isinstance(h, str) or not re.fullmatch(r"[0-9a-f]{16,128}", h):
        raise bad("recipe_hash", "a hex recipe hash", h)
    if r.get("status") not in _STATUSES:
        raise bad("status", f"one of {', '.join(_STATUSES)}", r.get("status"))
    for key in ("repo_id", "url", "method", "spec", "base", "license", "reason", "eval"):
        if r.get(key) is not None and not isinstance(r[key], str):
            raise bad(key, "text or null", r[key])
    scores = r.get("scores") if r.get("scores") is not None else {}
    if not isinstance(scores, dict) or not all(isinstance(k, str) and (v is None or isinstance(v, (int, float))
                                                                      and not isinstance(v, bool))
                                               for k, v in scores.items()):
        raise bad("scores", "a mapping of metric names to numbers", scores)
    score = r.get("score")
    if score is not None and (not isinstance(score, (int, float)) or isinstance(score, bool)):
        raise bad("score", "a number or null", score)
    inputs = r.get("inputs") if r.get("inputs") is not None else []
    if not isinstance(inputs, list) or not all(isinstance(i, str) for i in inputs):
        raise bad("inputs", "a list of repo IDs", inputs)
    params = r.get("params") if r.get("params") is not None else {}
    if not isinstance(params, dict):
        raise bad("params", "a mapping", params)
    finite = {k: float(v) if v is not None and math.isfinite(v) else math.nan for k, v in scores.items()}
    return {**r, "scores": finite, "score": float(score) if score is not None and math.isfinite(score) else None,
            "inputs": inputs, "params": params}


def fetch_file(repo_id: str, filename: str, repo_type: str = "model", token: Token = None) -> bytes | None:
    """The bytes of ``filename`` on ``repo_id``'s main branch now (None when the file is not there).

    A plain GET of the file, compared by content: it works on any Hub, including one that
    answers without file hashes or ETags, and it leaves nothing in the Hub cache.
    """
    url = hf_hub_url(repo_id, filename, repo_type=repo_type, revision="main")
    resp = get_session().get(url, headers=build_hf_headers(token=token), follow_redirects=True,
                             timeout=hub_timeout())
    try:
        hf_raise_for_status(resp)
    except (EntryNotFoundError, RemoteEntryNotFoundError):
        return None
    return resp.content


def push_files(api: HfApi, repo_id: str, files: dict[str, bytes], message: str, policy: RetryConfig, *,
               repo_type: str = "dataset", private: bool | None = None, token: Token = None) -> str | None:
    """Upload ``files`` to ``repo_id`` in one commit; returns the commit URL, or None when nothing changed.

    What the repo holds now is fetched and compared byte for byte first (:func:`fetch_file`): an
    unchanged file makes no commit on any Hub, whether or not it reports file hashes.
    """
    ensure_timeouts()
    try:
        now = {n: with_retry(functools.partial(fetch_file, repo_id, n, repo_type, token), f"{n} of {repo_id}", policy)
               for n in files}
    except RepositoryNotFoundError:
        now = {}
    changed = {n: b for n, b in files.items() if now.get(n) != b}
    if not changed:
        return None
    for n, b in changed.items():  # as every push: no absolute local path, no home folder (hubsoup.public)
        if (leak := local_path_in_file(n, b)) is not None:
            raise HubsoupError(f"{n} for {repo_id} holds a local path ({leak}), which must not be published")
    with_retry(lambda: api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True),
               f"create {repo_id}", policy)
    ops: Callable[[], list[CommitOperationAdd]] = lambda: [  # noqa: E731
        CommitOperationAdd(path_in_repo=n, path_or_fileobj=b) for n, b in changed.items()]
    info = with_retry(lambda: api.create_commit(repo_id, ops(), commit_message=message, repo_type=repo_type),
                      f"push to {repo_id}", policy)
    return getattr(info, "commit_url", None)
