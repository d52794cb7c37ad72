"""Turn an input spec (``org/name@rev`` or a folder) into a :class:`Checkpoint`.

Hub inputs are pinned: the revision is resolved to a commit SHA once, and every
file is then read at that SHA, so a push to the repo during a merge cannot
mix two versions. Metadata (config, card, index) is fetched first; weights only
when the engine opens them, after the inputs were checked against the base: their
safetensors files are read in place (:mod:`hubsoup.sources.remote`: headers, then the
tensors the merge reads, by range requests), unless the run asks for ``cache_inputs``
or the weights are pickle files (then downloaded into the Hub cache). A file the cache
already holds at that SHA is read there.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator

from huggingface_hub import HfApi, constants, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError,
)

from hubsoup.errors import (CorruptCheckpointError, DiskFullError, HubsoupError, InputError, MergeCancelled,
                            PickleRefusedError)
from hubsoup.footprint import on_disk
from hubsoup.hubclient import (RETRY_STATUS, Token, ensure_timeouts, error_status, hub_timeout, is_timeout,  # noqa: F401
                               scrub_secrets, server_detail, transient)
from hubsoup.progress import Monitor, silent_tqdm
from hubsoup.sources import access
from hubsoup.sources.access import current
from hubsoup.sources.checkpoint import ST_DTYPES, Checkpoint, InputRef, SAFETENSORS_INDEX, TensorInfo
from hubsoup.sources.remote import RemoteFile, open_file

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
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


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
        if (spec.startswith((".", "/", "~", "\\")) or repo_id.count("/") > 1 or not _REPO_ID.match(repo_id)
                or ".." in repo_id or re.match(r"^[A-Za-z]:", spec)):
            raise InputError(f"{role} '{spec}' is not a Hub repo ID (org/name[@revision])")
        ckpt = _hub(spec, repo_id, revision, allow_pickle, token, with_tokenizer, role, monitor, headers_only)
    else:
        expanded = os.path.expanduser(spec)
        if os.path.isdir(expanded):
            ckpt = _local(spec, expanded, allow_pickle, role)
        elif os.path.exists(expanded):
            raise InputError(f"{role} '{spec}': is a file; give the folder that holds config.json and the weights")
        elif spec.startswith((".", "/", "~")) or repo_id.count("/") > 1 or not _REPO_ID.match(repo_id):
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


def _disk_full(e: BaseException) -> OSError | None:
    """The ``ENOSPC``/``EDQUOT`` error that ``e`` is or was raised from, if any."""
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


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

    def fail(e: BaseException, fname: str | None = None) -> BaseException:
        """One line for a failed Hub request of this input (``fname``: the file it read, then named too)."""
        cancelled = _cancelled(e)
        if cancelled is not None:  # raised by the monitor inside huggingface_hub: not a Hub failure
            return cancelled
        full = _disk_full(e)
        if full is not None:  # the Hub cache's disk, while downloading: not a Hub failure either
            where = acc.cache_dir or constants.HF_HUB_CACHE
            return DiskFullError(f"{who}: disk full while downloading into the Hub cache ({where}): {full.strerror}; "
                                 "nothing was merged. Free space, or read the inputs in place (leave out "
                                 "--cache-inputs: only the output then needs disk)")
        return hub_failure(e, f"{role} '{spec}'" + (f" ({fname})" if fname else ""), repo_id, revision, token)

    mon.check("before downloading")
    if not constants.HF_HUB_OFFLINE:
        mon.enter("download", f"fetching {repo_id}")

    files: list[str] = []
    sizes: dict[str, int | None] = {}
    sha256s: dict[str, str] = {}
    metadata_bytes = 0
    metadata_files: dict[str, int] = {}
    try:
        if constants.HF_HUB_OFFLINE:
            # offline: whatever the cache holds for that revision, pinned to its snapshot sha
            folder = snapshot_download(repo_id, revision=revision, token=token, local_files_only=True, **cache)
            sha = os.path.basename(folder.rstrip("/"))
        else:
            ensure_timeouts()
            # asked with this run's token first, always: a cached snapshot is never a way around the Hub's answer
            # with the files' sizes and LFS sha256: the download budget, the disk plan and the check of files
            # read whole in place need them
            info = HfApi().model_info(repo_id, revision=revision, token=token, timeout=hub_timeout(),
                                      files_metadata=True)
            sha = info.sha
            files = [s.rfilename for s in (info.siblings or [])]
            sizes = {s.rfilename: getattr(s, "size", None) for s in (info.siblings or [])}
            for s in info.siblings or []:
                lfs = getattr(s, "lfs", None)
                digest = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
                if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest):
                    sha256s[s.rfilename] = digest
            patterns = METADATA_FILES + (TOKENIZER_FILES if with_tokenizer else [])
            metadata_files = {n: int(sizes.get(n) or 0) for n in sizes if any(fnmatch.fnmatch(n, p) for p in patterns)}
            # on disk: each file in whole blocks, and the cache's ref of the commit
            metadata_bytes = on_disk(0) + sum(on_disk(n) for n in metadata_files.values())
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
    ckpt.metadata_bytes = metadata_bytes
    ckpt.metadata_files = metadata_files

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
        """What fetching the weights would download into the Hub cache (0 when they are read in place: their
        bytes are charged as they come, and the merge's plan predicts them)."""
        if constants.HF_HUB_OFFLINE or in_place():
            return 0
        pats = weight_patterns()
        return sum(int(sizes.get(n) or 0) for n in sizes
                   if any(fnmatch.fnmatch(n, p) for p in pats) and not acc._cached(repo_id, sha, n, "model"))

    def fetch_weights() -> None:
        if constants.HF_HUB_OFFLINE or in_place():
            return
        patterns = weight_patterns()
        acc.charge(repo_id, sha, sizes, patterns, who)
        try:
            ensure_timeouts()
            mon.check("before downloading")
            # huggingface_hub warns when the cache's disk looks too small, then tries: held back until it is known
            # whether the disk did fill (then the one line below says it)
            with warnings.catch_warnings(record=True) as held:
                warnings.simplefilter("always")
                snapshot_download(repo_id, revision=sha, token=token, allow_patterns=patterns, **bars, **cache)
        except Exception as e:  # noqa: BLE001
            raise fail(e) from e
        for w in held:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

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

    def cached(fname: str) -> bool:
        try:
            hit = try_to_load_from_cache(repo_id, fname, revision=sha, **cache)
        except Exception:  # noqa: BLE001 - an odd name: not cached
            return False
        return isinstance(hit, str) and os.path.isfile(hit)

    opened: dict[str, RemoteFile] = {}
    opening = threading.Lock()

    def remote_file(fname: str) -> RemoteFile:
        """``fname`` read in place (its header read now, once per checkpoint)."""
        if fname not in opened:
            if files and fname not in files:
                raise CorruptCheckpointError(f"{role} '{ckpt.label}': its weights name {fname}, which the repo does "
                                             f"not hold at {sha[:12]}")

            def fail_on(e: BaseException) -> BaseException:
                return fail(e, fname) if not isinstance(e, HubsoupError) else e

            ensure_timeouts()
            mon.check("before reading from the Hub")
            # one RemoteFile per file, run and token: two checkpoints of one repo (a layout's base and input) share
            # it, so the read-ahead fetches its bytes once
            shared = acc.remote_files
            key = (repo_id, sha, fname, token if isinstance(token, (str, bool)) else None)
            rf = shared.get(key)
            if rf is None:
                rf = open_file(repo_id, sha, fname, size=sizes.get(fname), token=token,
                               who=f"{role} '{spec}' ({fname})", fail=fail_on, access=acc,
                               sha256=sha256s.get(fname), sleep=lambda t: _sleep(t))
                with opening:  # two threads may have read it at once: one object is kept
                    rf = shared.setdefault(key, rf)
            opened[fname] = rf
        return opened[fname]

    def in_place_files() -> list[str]:
        """The weight files a merge reads in place: safetensors only ([] for pickle weights)."""
        if kind == "lora":
            top = [f for f in files if "/" not in f]
            return ["adapter_model.safetensors"] if "adapter_model.safetensors" in top or not files else []
        return safetensors_files()

    keep = {"files": False}

    def in_place() -> bool:
        """Whether the weights are read in place rather than downloaded (``cache_inputs`` not asked, online,
        safetensors)."""
        return not (acc.cache_inputs or keep["files"] or constants.HF_HUB_OFFLINE) and bool(in_place_files())

    def open_remote(names: list[str]) -> None:
        """The headers of ``names`` not yet open, read concurrently (one round trip each: a sharded model's
        dozens of files would otherwise wait on each other)."""
        todo = [f for f in names if f not in opened]
        if len(todo) <= 1:
            for f in todo:
                remote_file(f)
            return
        with ThreadPoolExecutor(min(8, len(todo)), thread_name_prefix="hubsoup-headers") as pool:
            for _ in pool.map(remote_file, todo):  # the first failure is raised
                pass

    def streamed() -> dict[str, RemoteFile | None] | None:
        if not in_place():
            return None
        names = in_place_files()
        local = {f for f in names if cached(f)}
        open_remote([f for f in names if f not in local])
        return {f: None if f in local else remote_file(f) for f in names}

    def remote_headers() -> dict[str, dict[str, TensorInfo]] | None:
        names = safetensors_files()
        if not names:
            return None
        if all(cached(f) for f in names):
            return None  # every weight file is in the local cache at this commit: its headers are read there
        out: dict[str, dict[str, TensorInfo]] = {}
        open_remote([f for f in names if not cached(f)])
        for fname in names:  # two range requests at most per file: its header, never its data
            if cached(fname):
                ckpt._open_safetensors(fname)
                out[fname] = {n: ckpt._infos[n] for n, f in ckpt._files.items() if f == fname}
                continue
            rf = remote_file(fname)
            out[fname] = {}
            for name, (dtype_name, shape, _, _) in rf.tensors.items():
                dtype = ST_DTYPES.get(dtype_name)
                if dtype is None:
                    raise CorruptCheckpointError(f"{role} '{ckpt.label}': tensor '{name}' in {fname} has "
                                                 f"unsupported dtype {dtype_name}")
                out[fname][name] = TensorInfo(tuple(shape), dtype)
        return out

    ckpt.fetch_weights = fetch_weights
    ckpt.weight_bytes = weight_bytes
    if not constants.HF_HUB_OFFLINE:
        ckpt.streamed = streamed
        ckpt.downloads = lambda: not in_place()
        ckpt.keep_files = lambda: keep.update(files=True)
    if headers_only and not constants.HF_HUB_OFFLINE:
        ckpt.remote_headers = remote_headers
        ckpt.remote_files = safetensors_files
    return ckpt


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
            if attempt == tries - 1 or not transient(e):
                raise
            log.debug("transient Hub answer (%s); trying again in %.0f s", error_status(e) or type(e).__name__, wait)
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
