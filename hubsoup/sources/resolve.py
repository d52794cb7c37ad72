"""Turn an input spec (``org/name@rev`` or a folder) into a :class:`Checkpoint`.

Hub inputs are pinned: the revision is resolved to a commit SHA once, and every
file is then downloaded at that SHA, so a push to the repo during a merge cannot
mix two versions. Metadata (config, card, index) is fetched first; weights only
when the engine opens them, after the inputs were checked against the base.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from typing import Iterator

from huggingface_hub import HfApi, constants, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
)

from hubsoup.errors import CorruptCheckpointError, HubsoupError, InputError, MergeCancelled, PickleRefusedError
from hubsoup.hubclient import Token, ensure_timeouts, error_status, hub_timeout, is_timeout, scrub_secrets, server_detail
from hubsoup.progress import Monitor, silent_tqdm
from hubsoup.sources import access
from hubsoup.sources.access import current
from hubsoup.sources.checkpoint import ST_DTYPES, Checkpoint, InputRef, SAFETENSORS_INDEX, TensorInfo

METADATA_FILES = [
    "config.json",
    "adapter_config.json",
    "README.md",
    "generation_config.json",
    "*.safetensors.index.json",
    "*.bin.index.json",
]
TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "*.model",
    "chat_template*",
    "preprocessor_config.json",
]
log = logging.getLogger(__name__)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """Split ``org/name@revision`` into ``(repo_id, revision)``.

    >>> parse_spec("org/model@v1.0")
    ('org/model', 'v1.0')
    >>> parse_spec("org/model")
    ('org/model', None)
    """
    if "@" in spec:
        repo_id, rev = spec.rsplit("@", 1)
        return repo_id, rev or None
    return spec, None



def open_input(spec: str, *, allow_pickle: bool = False, token: Token = None,
               with_tokenizer: bool = False, hub_only: bool = False, role: str = "input",
               monitor: Monitor | None = None, headers_only: bool = False) -> Checkpoint:
    """Open an input given as a local folder or a Hub repo ID (``org/name[@revision]``).

    ``hub_only``: ``spec`` came from a remote source (a Hub repo's card or adapter config naming its
    base), so it must be a Hub repo ID; a local path is refused and a local folder of that name is
    never looked at. ``headers_only`` (planning): a Hub input's tensor names, shapes and dtypes come from its
    safetensors headers on the Hub (:attr:`Checkpoint.remote_headers`), so no weight is downloaded until a
    tensor is read; :func:`download_size` then says what reading them would download. Every file the checkpoint names is checked to lie inside its own folder
    (:meth:`Checkpoint.file`) before it is read. ``monitor`` (:mod:`hubsoup.progress`): downloads
    are silent, report each finished file and stop at a cancel (:class:`MergeCancelled`).

    Example:
        >>> ckpt = open_input("./my-finetune")            # doctest: +SKIP
        >>> ckpt = open_input("org/model@main")           # doctest: +SKIP
        >>> ckpt.ref.sha                                  # doctest: +SKIP
        '3f1c...'
    """
    if access.hub_only():  # a server's run: the text alone decides, before anything on the disk is looked at
        access.require_hub_id(spec, role)
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"{role} {spec!r}: not a folder or a Hub repo ID")
    repo_id, revision = parse_spec(spec)
    if hub_only or access.hub_only():
        if (spec.startswith((".", "/", "~", "\\")) or repo_id.count("/") > 1 or not REPO_ID.match(repo_id)
                or ".." in repo_id or re.match(r"^[A-Za-z]:", spec)):
            raise InputError(f"{role} '{spec}' is not a Hub repo ID (org/name[@revision])")
        ckpt = _hub(spec, repo_id, revision, allow_pickle, token, with_tokenizer, role, monitor, headers_only)
    else:
        expanded = os.path.expanduser(spec)
        if os.path.isdir(expanded):
            ckpt = _local(spec, expanded, allow_pickle, role)
        elif os.path.exists(expanded):
            raise InputError(f"{role} '{spec}': is a file; give the folder that holds config.json and the weights")
        elif spec.startswith((".", "/", "~")) or repo_id.count("/") > 1 or not REPO_ID.match(repo_id):
            raise InputError(f"{role} '{spec}': no such local folder, and not a valid Hub repo ID (org/name[@revision])")
        else:
            ckpt = _hub(spec, repo_id, revision, allow_pickle, token, with_tokenizer, role, monitor, headers_only)
    # every metadata (and, for the base, tokenizer) file hubsoup may read or copy: no link leading out
    # (weight files are checked the same way when they are opened, before any tensor is read)
    ckpt.check_links(METADATA_FILES + (TOKENIZER_FILES if with_tokenizer else []))
    return ckpt


def _local(spec: str, folder: str, allow_pickle: bool, role: str = "input") -> Checkpoint:
    kind = "lora" if os.path.isfile(os.path.join(folder, "adapter_config.json")) else "full"
    if kind == "full" and not os.path.isfile(os.path.join(folder, "config.json")):
        raise InputError(f"{role} '{spec}': no config.json in {folder}; is this a model folder?")
    ref = InputRef(spec=spec, path=os.path.abspath(folder), kind=kind)
    return Checkpoint(ref=ref, folder=folder, allow_pickle=allow_pickle, role=role)


def _pickle_refused(label: str, role: str = "input") -> PickleRefusedError:
    return PickleRefusedError(
        f"{role} '{label}': only pickle weights (pytorch_model.bin) are available. "
        "Pickle files can run arbitrary code when loaded; pass --allow-pickle "
        "(allow_pickle=True) if you trust this source, or convert it to safetensors")


def hub_failure(e: BaseException, who: str, repo_id: str, revision: str | None = None,
                token: Token = None) -> InputError:
    """One line saying why reading ``repo_id`` from the Hub failed (``who``: ``input 'spec'``, ``base 'spec'``)."""
    def find(kind):
        seen, cur = set(), e
        while cur is not None and id(cur) not in seen:
            if isinstance(cur, kind):
                return cur
            seen.add(id(cur))
            cur = cur.__cause__ or cur.__context__
        return None

    if find(GatedRepoError):
        msg = f"{who}: the repo is gated; accept its terms on the Hub and log in (hf auth login or HF_TOKEN)"
    elif find(RevisionNotFoundError):
        msg = f"{who}: revision '{revision}' not found in {repo_id}"
    elif find(RepositoryNotFoundError):
        msg = (f"{who}: repo {repo_id} not found on {constants.ENDPOINT} "
               "(or it is private and no valid token was given: log in with `hf auth login` or set HF_TOKEN)")
    elif constants.HF_HUB_OFFLINE:
        msg = (f"{who}: not a local folder, and {repo_id}{'@' + revision if revision else ''} is not in the "
               "local Hub cache while offline (HF_HUB_OFFLINE=1)")
    elif is_timeout(e):
        msg = (f"{who}: the Hub at {constants.ENDPOINT} did not answer within {hub_timeout():g}s (timed out); "
               "try again later (HUBSOUP_HUB_TIMEOUT sets the limit)")
    elif (status := error_status(e)) is not None and status >= 500:
        msg = f"{who}: Hub server error {status}{server_detail(find(HfHubHTTPError) or e)} while fetching {repo_id}; try again later"
    elif status is not None:
        msg = f"{who}: Hub request for {repo_id} failed with HTTP {status}{server_detail(find(HfHubHTTPError) or e)}"
    elif find(LocalEntryNotFoundError):
        msg = f"{who}: cannot reach the Hub at {constants.ENDPOINT} to fetch {repo_id}, and it is not in the local cache"
    else:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        msg = f"{who}: cannot reach the Hub at {constants.ENDPOINT} ({type(e).__name__}: {first})"
    return InputError(scrub_secrets(msg, token))  # a server may echo the token back


def _cancelled(e: BaseException) -> MergeCancelled | None:
    """The :class:`MergeCancelled` that ``e`` is or was raised from (huggingface_hub may wrap it), if any."""
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, MergeCancelled):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _hub(spec, repo_id, revision, allow_pickle, token, with_tokenizer, role="input",
         monitor: Monitor | None = None, headers_only: bool = False) -> Checkpoint:
    acc = access.current()  # this run's cache and download budget (kept by the closures below)
    cache = {"cache_dir": acc.cache_dir} if acc.cache_dir else {}
    who = f"{role} '{spec}'"
    access.check_offline(who)
    mon = monitor or Monitor()
    # an app's run (progress or cancel given): this call's bars are silent, and each update checks cancel
    bars = {"tqdm_class": silent_tqdm(mon)} if mon.active else {}

    def fail(e: Exception) -> Exception:
        cancelled = _cancelled(e)
        if cancelled is not None:  # raised by the monitor inside huggingface_hub: not a Hub failure
            return cancelled
        return hub_failure(e, f"{role} '{spec}'", repo_id, revision, token)

    mon.check("before downloading")
    if not constants.HF_HUB_OFFLINE:
        mon.enter("download", f"fetching {repo_id}")

    files: list[str] = []
    sizes: dict[str, int | None] = {}
    try:
        if constants.HF_HUB_OFFLINE:
            # offline: whatever the cache holds for that revision, pinned to its snapshot sha
            folder = snapshot_download(repo_id, revision=revision, token=token, local_files_only=True, **cache)
            sha = os.path.basename(folder.rstrip("/"))
        else:
            ensure_timeouts()
            # asked with this run's token first, always: a cached snapshot is never a way around the Hub's answer
            info = HfApi().model_info(repo_id, revision=revision, token=token, timeout=hub_timeout(),
                                      files_metadata=acc.limited)
            sha = info.sha
            files = [s.rfilename for s in (info.siblings or [])]
            sizes = {s.rfilename: getattr(s, "size", None) for s in (info.siblings or [])}
            patterns = METADATA_FILES + (TOKENIZER_FILES if with_tokenizer else [])
            acc.charge(repo_id, sha, sizes, patterns, who)
            folder = snapshot_download(repo_id, revision=sha, token=token, allow_patterns=patterns, **bars, **cache)
    except Exception as e:  # noqa: BLE001 - mapped to one clear line
        if isinstance(e, HubsoupError) and _cancelled(e) is None:
            raise
        raise fail(e) from e

    kind = "lora" if os.path.isfile(os.path.join(folder, "adapter_config.json")) else "full"
    ref = InputRef(spec=spec, repo_id=repo_id, revision=revision, sha=sha, path=folder, kind=kind)
    ckpt = Checkpoint(ref=ref, folder=folder, allow_pickle=allow_pickle, role=role)
    if not constants.HF_HUB_OFFLINE:  # what the Hub said of the repo: a public push of a merge of it must know
        ckpt.visibility = {"private": bool(getattr(info, "private", False)),
                           "gated": bool(getattr(info, "gated", False))}

    def weight_patterns() -> list[str]:
        index = os.path.join(folder, SAFETENSORS_INDEX)
        top = [f for f in files if "/" not in f]
        if os.path.isfile(index):
            # exactly the shards the index names (repos often carry other *.safetensors too); every
            # entry is checked to be a file of this repo before anything is downloaded
            patterns = sorted(set(ckpt.weight_map(SAFETENSORS_INDEX).values()))
        elif kind == "lora":
            if "adapter_model.safetensors" in top or not files:
                patterns = ["adapter_model.safetensors"]
            elif "adapter_model.bin" in top and not allow_pickle:
                raise _pickle_refused(ckpt.label, role)
            else:
                patterns = ["adapter_model.bin"]
        elif "model.safetensors" in top:
            patterns = ["model.safetensors"]
        elif any(f.endswith(".safetensors") for f in top):
            patterns = ["*.safetensors"]
        elif any(f.startswith("pytorch_model") and f.endswith(".bin") for f in top):
            if not allow_pickle:  # pickle only: fetched only when the user allows loading it
                raise _pickle_refused(ckpt.label, role)
            patterns = ["pytorch_model*.bin"]
        else:
            raise CorruptCheckpointError(
                f"{role} '{ckpt.label}': the repo holds no weights (no model.safetensors, "
                f"{SAFETENSORS_INDEX} or pytorch_model.bin)")
        return patterns

    def weight_bytes() -> int:
        """What fetching the weights would charge to the run's budget (0 without one)."""
        if not acc.limited or constants.HF_HUB_OFFLINE:
            return 0
        pats = weight_patterns()
        return sum(int(sizes.get(n) or 0) for n in sizes
                   if any(fnmatch.fnmatch(n, p) for p in pats) and not acc._cached(repo_id, sha, n, "model"))

    def fetch_weights() -> None:
        if constants.HF_HUB_OFFLINE:
            return
        patterns = weight_patterns()
        acc.charge(repo_id, sha, sizes, patterns, who)
        try:
            ensure_timeouts()
            mon.check("before downloading")
            snapshot_download(repo_id, revision=sha, token=token, allow_patterns=patterns, **bars, **cache)
        except Exception as e:  # noqa: BLE001
            raise fail(e) from e

    def safetensors_files() -> list[str]:
        """The safetensors files :func:`fetch_weights` would download ([] when it would fetch anything else)."""
        top = [f for f in files if "/" not in f]
        if kind != "full":
            return []
        if os.path.isfile(os.path.join(folder, SAFETENSORS_INDEX)):
            return sorted(set(ckpt.weight_map(SAFETENSORS_INDEX).values()))
        if "model.safetensors" in top:
            return ["model.safetensors"]
        return sorted(f for f in top if f.endswith(".safetensors"))

    def remote_headers() -> dict[str, dict[str, TensorInfo]] | None:
        names = safetensors_files()
        if not names:
            return None

        if all(isinstance(try_to_load_from_cache(repo_id, f, revision=sha, **cache), str) for f in names):
            return None  # every weight file is in the local cache at this commit: its headers are read there
        api = HfApi()
        out: dict[str, dict[str, TensorInfo]] = {}
        try:
            ensure_timeouts()
            for fname in names:  # two range requests at most per file: its header, never its data
                meta = with_backoff(lambda: api.parse_safetensors_file_metadata(
                    repo_id, fname, revision=sha, token=token, timeout=hub_timeout()), mon)
                out[fname] = {}
                for name, t in meta.tensors.items():
                    dtype = ST_DTYPES.get(t.dtype)
                    if dtype is None:
                        raise CorruptCheckpointError(f"{role} '{ckpt.label}': tensor '{name}' in {fname} has "
                                                     f"unsupported dtype {t.dtype}")
                    out[fname][name] = TensorInfo(tuple(t.shape), dtype)
        except Exception as e:  # noqa: BLE001 - one line naming the repo
            if isinstance(e, HubsoupError):
                raise
            raise fail(e) from e
        return out

    ckpt.fetch_weights = fetch_weights
    ckpt.weight_bytes = weight_bytes
    if headers_only and not constants.HF_HUB_OFFLINE:
        ckpt.remote_headers = remote_headers
        ckpt.remote_files = safetensors_files
    return ckpt


RETRY_STATUS = (408, 429, 500, 502, 503, 504)
"""The answers huggingface_hub's own downloads retry (``http_backoff``): header reads retry them the same way."""
_sleep = time.sleep


MAX_REPO_FILES = 2000
"""The most files a fetched task repo (:func:`fetched_repo`) may hold."""


@contextmanager
def fetched_repo(repo_type: str, repo_id: str, revision: str | None, who: str) -> Iterator[str]:
    """A Hub repo's files (an lm-eval task repo of a ``hub_only`` run) in a fresh folder, removed when the block
    ends: asked of the Hub with the run's token, charged to its download budget, written inside the run's
    ``cache_dir`` (or a temporary folder), never a folder of the host nor the shared Hub cache.

    Raises :class:`~hubsoup.errors.InputError` (one line, ``who`` and the repo only) when the Hub refuses it.
    """
    acc = current()
    if constants.HF_HUB_OFFLINE:
        raise InputError(f"{who}: {repo_id} is fetched from the Hub with this run's token, and the Hub is offline "
                         "(HF_HUB_OFFLINE=1)")
    if acc.cache_dir:
        os.makedirs(acc.cache_dir, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="hubsoup-tasks-", dir=acc.cache_dir or None)
    try:
        try:
            ensure_timeouts()
            info = HfApi().repo_info(repo_id, repo_type=repo_type, revision=revision, token=acc.token,
                                     timeout=hub_timeout(), files_metadata=True)
            siblings = info.siblings or []
            if len(siblings) > MAX_REPO_FILES:
                raise InputError(f"{who}: {repo_id} holds {len(siblings)} files, more than the {MAX_REPO_FILES} a task "
                                 "repo may hold")
            acc.charge(repo_id, info.sha, {f.rfilename: getattr(f, "size", None) for f in siblings}, None, who,
                       repo_type=repo_type)
            snapshot_download(repo_id, repo_type=repo_type, revision=info.sha, token=acc.token, local_dir=folder,
                              tqdm_class=silent_tqdm(Monitor(None, None)))
        except HubsoupError:
            raise
        except Exception as e:  # noqa: BLE001 - one clear line, naming the repo only
            raise hub_failure(e, who, repo_id, revision, acc.token) from e
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def with_backoff(call, monitor: Monitor | None = None, *, tries: int = 6, first: float = 1.0, most: float = 8.0):
    """``call()``, tried again after 1, 2, 4, 8, 8 s on a transient Hub answer (a 5xx, 408, 429) or a dropped
    connection, as huggingface_hub retries its downloads; a timeout is not retried (every request already
    waited ``HUBSOUP_HUB_TIMEOUT``). A cancel is checked before each new try."""
    wait = first
    for attempt in range(tries):
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - re-raised unless transient
            status = error_status(e)
            dropped = status is None and any(c.__name__ in ("ConnectError", "RemoteProtocolError", "ReadError")
                                             for c in type(e).__mro__)
            if attempt == tries - 1 or is_timeout(e) or not (status in RETRY_STATUS or dropped):
                raise
            log.debug("transient Hub answer (%s); trying again in %.0f s", status or type(e).__name__, wait)
        if monitor is not None:
            monitor.check("before trying the Hub again")
        _sleep(wait)
        wait = min(wait * 2, most)


def download_size(ckpt: Checkpoint, token: Token = None) -> tuple[int, int] | None:
    """``(bytes to download, bytes of all its weight files)`` for a Hub input opened with ``headers_only``.

    The sizes are the Hub's file metadata (``HfApi.get_paths_info``) of exactly the files a merge would
    fetch; files already in the local Hub cache at the pinned commit count as downloaded. None for a
    local folder, offline, or an input whose weights are not safetensors.

    Example:
        >>> download_size(open_input("org/model", headers_only=True))   # doctest: +SKIP
        (1073741824, 1073741824)
    """
    names_of = ckpt.remote_files
    ref = ckpt.ref
    if names_of is None or not ref.repo_id:
        return None
    names = names_of()
    if not names:
        return None

    cache = {"cache_dir": current().cache_dir} if current().cache_dir else {}
    try:
        ensure_timeouts()
        infos = HfApi().get_paths_info(ref.repo_id, names, revision=ref.sha, token=token)
    except Exception as e:  # noqa: BLE001
        raise hub_failure(e, f"{ckpt.role} '{ref.spec}'", ref.repo_id, ref.revision, token) from e
    sizes = {i.path: int(getattr(i, "size", 0) or 0) for i in infos}
    total = sum(sizes.values())
    cached = sum(size for name, size in sizes.items()
                 if isinstance(hit := try_to_load_from_cache(ref.repo_id, name, revision=ref.sha, **cache), str)
                 and os.path.isfile(hit))
    return total - cached, total
