"""What a pipeline asks the Hub: candidates, their commits, sizes and licenses, what is already published.

Every call goes through :func:`with_retry`: rate limits (429), server errors (5xx), 408 and
timeouts or dropped connections are retried with exponential back-off (the server's
``Retry-After`` honoured), at most ``attempts`` times and never waiting longer than
``max_wait`` at once; anything else fails at once. huggingface_hub already retries its
paginated listings, pre-uploads and downloads' ``HEAD``; this adds the rest (``model_info``,
commits, whole merges whose downloads failed), bounded.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from hubsoup.workflows.pipeline.config import Query, RetryConfig

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_STATUS = (408, 429, 500, 502, 503, 504)
RECIPE_FILE = "hubsoup_recipe.yaml"
EVAL_FILE = "eval_results.json"
LEADERBOARD_JSON = "leaderboard.json"
LEADERBOARD_MD = "leaderboard.md"


def retryable(e: BaseException) -> bool:
    """A transient Hub failure: 408/429/5xx, a timeout or a connection lost on the way."""
    from hubsoup.hub import error_status, is_timeout

    status = error_status(e)
    if status is not None:
        return status in RETRY_STATUS
    if is_timeout(e):
        return True
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if any(c.__name__ in ("NetworkError", "RemoteProtocolError", "ConnectError", "ReadError", "WriteError")
               for c in type(cur).__mro__):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _retry_after(e: BaseException) -> float | None:
    seen, cur = set(), e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        resp = getattr(cur, "response", None)
        if resp is not None:
            try:
                value = resp.headers.get("Retry-After")
                return float(value) if value is not None else None
            except (TypeError, ValueError, AttributeError):
                return None
        cur = cur.__cause__ or cur.__context__
    return None


def with_retry(fn: Callable[[], T], what: str, policy: RetryConfig, *, sleep: Callable[[float], None] = time.sleep) -> T:
    """``fn()``, retried on transient Hub failures (see the module's docstring); the last error is raised."""
    from hubsoup.hub import error_status

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
    card_base_model: list[str]
    weight_files: dict[str, int] = field(default_factory=dict)
    """The files a merge would download, with their sizes in bytes."""
    private: bool = False
    gated: Any = False

    @property
    def pinned(self) -> str:
        return f"{self.repo_id}@{self.sha}"

    @property
    def short(self) -> str:
        return self.repo_id.split("/")[-1]

    def cached_bytes(self) -> int:
        """Bytes of :attr:`weight_files` already in the local Hub cache at this commit."""
        from huggingface_hub import try_to_load_from_cache

        total = 0
        for name, size in self.weight_files.items():
            hit = try_to_load_from_cache(self.repo_id, name, revision=self.sha)
            if isinstance(hit, str) and os.path.isfile(hit):
                total += size
        return total


def _weight_files(siblings) -> dict[str, int]:
    """What ``hubsoup.sources.resolve`` would download: the adapter, ``model.safetensors``, or the top-level shards."""
    files = {s.rfilename: (s.size or 0) for s in siblings or []}
    top = {n: s for n, s in files.items() if "/" not in n}
    if "adapter_config.json" in top:
        return {n: s for n, s in top.items() if n == "adapter_model.safetensors"}
    if "model.safetensors" in top:
        return {"model.safetensors": top["model.safetensors"]}
    return {n: s for n, s in top.items() if n.endswith(".safetensors")}


def repo_info(api, spec: str, policy: RetryConfig, token: Any = None) -> RepoInfo:
    """Resolve ``org/name[@rev]`` to its commit, kind, license and weight sizes (``model_info(files_metadata=True)``)."""
    from hubsoup.hub import ensure_timeouts, hub_timeout
    from hubsoup.sources.resolve import hub_failure, parse_spec
    from hubsoup.workflows.pipeline.licenses import normalize

    repo_id, revision = parse_spec(spec)
    ensure_timeouts()
    try:
        info = with_retry(lambda: api.model_info(repo_id, revision=revision, files_metadata=True, token=token,
                                                 timeout=hub_timeout()), f"model info of {spec}", policy)
    except Exception as e:  # noqa: BLE001 - one line naming the repo
        raise hub_failure(e, f"candidate '{spec}'", repo_id, revision, token) from e
    card = info.card_data.to_dict() if info.card_data is not None else {}
    base_model = card.get("base_model") or []
    siblings = info.siblings or []
    kind = "lora" if any(s.rfilename == "adapter_config.json" for s in siblings) else "full"
    return RepoInfo(repo_id, revision, info.sha, kind, normalize(card.get("license"), card.get("license_name")),
                    [base_model] if isinstance(base_model, str) else list(base_model), _weight_files(siblings),
                    bool(info.private), info.gated)


def query_candidates(api, q: Query, base_repo: str, policy: RetryConfig, token: Any = None) -> list[str]:
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


def published_recipes(api, namespace: str, policy: RetryConfig, token: Any = None) -> dict[str, Published]:
    """Recipe hash → the repo of ``namespace`` holding that merge, read from each hubsoup repo's
    ``hubsoup_recipe.yaml`` on the Hub (repos tagged ``hubsoup``; one without a readable recipe is ignored)."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

    from hubsoup.untrusted import MAX_YAML_BYTES, load_yaml

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


def published_scores(pub: Published, policy: RetryConfig, token: Any = None) -> dict[str, float]:
    """The eval scores a published merge carries (its ``eval_results.json``), ``{"task/metric": value}``."""
    import json

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError

    try:
        path = with_retry(lambda: hf_hub_download(pub.repo_id, EVAL_FILE, revision=pub.sha or None, token=token),
                          f"eval results of {pub.repo_id}", policy)
    except (EntryNotFoundError, RemoteEntryNotFoundError):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return flatten_scores(data)


def flatten_scores(results: list[dict]) -> dict[str, float]:
    """``[{"task": t, "metrics": {m: v}}]`` (``eval_results.json``) → ``{"t/m": v}``."""
    out = {}
    for r in results or []:
        if not isinstance(r, dict):
            continue
        for m, v in (r.get("metrics") or {}).items():
            if m != "tokens" and isinstance(v, (int, float)):
                out[f"{r.get('task')}/{m}"] = float(v)
    return out


def previous_leaderboard(api, repo_id: str, repo_type: str, policy: RetryConfig, token: Any = None) -> list[dict]:
    """The rows of the leaderboard last published to ``repo_id`` (empty when there is none yet)."""
    import json

    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, RemoteEntryNotFoundError, RepositoryNotFoundError

    try:
        path = with_retry(lambda: hf_hub_download(repo_id, LEADERBOARD_JSON, repo_type=repo_type, token=token),
                          f"leaderboard {repo_id}", policy)
    except (EntryNotFoundError, RemoteEntryNotFoundError, RepositoryNotFoundError):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        log.warning("the leaderboard in %s is not valid JSON; starting a new one", repo_id)
        return []
    rows = data.get("merges") if isinstance(data, dict) else None
    return [r for r in rows or [] if isinstance(r, dict) and isinstance(r.get("recipe_hash"), str)]


def push_files(api, repo_id: str, files: dict[str, bytes], message: str, policy: RetryConfig, *,
               repo_type: str = "dataset", private: bool | None = None) -> str | None:
    """Upload ``files`` to ``repo_id`` in one commit (none when nothing changed); returns the commit URL."""
    from huggingface_hub import CommitOperationAdd

    from hubsoup.hub import ensure_timeouts

    ensure_timeouts()
    with_retry(lambda: api.create_repo(repo_id, repo_type=repo_type, private=private, exist_ok=True),
               f"create {repo_id}", policy)
    ops = lambda: [CommitOperationAdd(path_in_repo=n, path_or_fileobj=b) for n, b in files.items()]  # noqa: E731
    info = with_retry(lambda: api.create_commit(repo_id, ops(), commit_message=message, repo_type=repo_type),
                      f"push to {repo_id}", policy)
    return getattr(info, "commit_url", None)
