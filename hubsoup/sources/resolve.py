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
from typing import Any, Callable, Iterator, TypeVar

from huggingface_hub import constants, snapshot_download, try_to_load_from_cache

from hubsoup.errors import (CorruptCheckpointError, DiskFullError, HubsoupError, InputError, MergeCancelled,
                            ParameterError, PickleRefusedError)
from hubsoup.footprint import on_disk
from hubsoup.hubclient import (Token, caused_by, causes, ensure_timeouts, error_status, hub_api, hub_failure,
                               hub_timeout, parse_spec, transient)
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
T = TypeVar("T")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


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


def _disk_full(e: BaseException) -> OSError | None:
    """The ``ENOSPC``/``EDQUOT`` error that ``e`` is or was raised from, if any."""
    return next((c for c in causes(e) if isinstance(c, OSError) and c.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1))),
                None)


def _hub(spec: str, repo_id: str, revision: str | None, allow_pickle: bool, token: Token, with_tokenizer: bool,
         role: str = "input",
         monitor: Monitor | None = None, headers_only: bool = False) -> Checkpoint:
    """A Hub input as a :class:`Checkpoint`: its metadata files fetched, its weights downloaded or read in place when
    the merge asks (:class:`_HubInput`)."""
    hub = _HubInput(spec, repo_id, revision, allow_pickle, token, role, monitor)
    hub.open(with_tokenizer)
    return hub.checkpoint(headers_only)


class _HubInput:
    """One Hub input of a run: what the Hub said of it at its pinned commit (files, sizes, sha256s), its metadata
    files in the Hub cache, and how its weights are got: downloaded into the cache, or read in place
    (:mod:`hubsoup.sources.remote`). Its checkpoint calls back into it (:meth:`checkpoint`)."""

    kind: str
    """``full`` or ``lora``, once :meth:`checkpoint` made the checkpoint."""
    ckpt: Checkpoint

    def __init__(self, spec: str, repo_id: str, revision: str | None, allow_pickle: bool, token: Token, role: str,
                 monitor: Monitor | None) -> None:
        self.spec, self.repo_id, self.revision, self.allow_pickle, self.token, self.role = (
            spec, repo_id, revision, allow_pickle, token, role)
        self.acc = access.current()  # this run's cache and download budget
        self.cache: dict[str, Any] = {"cache_dir": self.acc.cache_dir} if self.acc.cache_dir else {}
        self.who = f"{role} '{spec}'"
        self.mon = monitor or Monitor()
        # an app's run (progress or cancel given): this call's bars are silent, and each update checks cancel
        self.bars: dict[str, Any] = {"tqdm_class": silent_tqdm(self.mon)} if self.mon.active else {}
        self.files: list[str] = []
        self.sizes: dict[str, int | None] = {}
        self.sha256s: dict[str, str] = {}
        self.metadata_bytes = 0
        self.metadata_files: dict[str, int] = {}
        self.info: Any = None
        self.sha = ""
        self.folder = ""
        self.keep = False  # the weights are downloaded even where they could be read in place (LOT's base)
        self.opened: dict[str, RemoteFile] = {}
        self.opening = threading.Lock()

    def fail(self, e: BaseException, fname: str | None = None) -> BaseException:
        """One line for a failed Hub request of this input (``fname``: the file it read, then named too)."""
        cancelled = caused_by(e, MergeCancelled)
        if cancelled is not None:  # raised by the monitor inside huggingface_hub: not a Hub failure
            return cancelled
        full = _disk_full(e)
        if full is not None:  # the Hub cache's disk, while downloading: not a Hub failure either
            where = self.acc.cache_dir or constants.HF_HUB_CACHE
            return DiskFullError(f"{self.who}: disk full while downloading into the Hub cache ({where}): "
                                 f"{full.strerror}; nothing was merged. Free space, or read the inputs in place "
                                 "(leave out --cache-inputs: only the output then needs disk)")
        return hub_failure(e, f"{self.role} '{self.spec}'" + (f" ({fname})" if fname else ""), self.repo_id,
                           self.revision, self.token)

    def open(self, with_tokenizer: bool) -> None:
        """Ask the Hub for the repo at its revision and fetch its metadata files (offline: the cache's snapshot)."""
        access.check_offline(self.who)
        self.mon.check("before downloading")
        if not constants.HF_HUB_OFFLINE:
            self.mon.enter("download", f"fetching {self.repo_id}")
        try:
            if constants.HF_HUB_OFFLINE:
                # offline: whatever the cache holds for that revision, pinned to its snapshot sha
                self.folder = snapshot_download(self.repo_id, revision=self.revision, token=self.token,
                                                local_files_only=True, **self.cache)
                self.sha = os.path.basename(self.folder.rstrip("/"))
            else:
                self._ask(with_tokenizer)
        except Exception as e:  # noqa: BLE001 - mapped to one clear line
            if isinstance(e, HubsoupError) and caused_by(e, MergeCancelled) is None:
                raise
            raise self.fail(e) from e

    def _ask(self, with_tokenizer: bool) -> None:
        # asked with this run's token first, always: a cached snapshot is never a way around the Hub's answer
        # with the files' sizes and LFS sha256: the download budget, the disk plan and the check of files
        # read whole in place need them
        info = self.info = hub_api(self.token).model_info(self.repo_id, revision=self.revision,
                                                          timeout=hub_timeout(), files_metadata=True)
        self.sha = sha = info.sha
        self.files = [s.rfilename for s in (info.siblings or [])]
        self.sizes = sizes = {s.rfilename: getattr(s, "size", None) for s in (info.siblings or [])}
        for s in info.siblings or []:
            lfs = getattr(s, "lfs", None)
            digest = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
            if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest):
                self.sha256s[s.rfilename] = digest
        patterns = METADATA_FILES + (TOKENIZER_FILES if with_tokenizer else [])
        self.metadata_files = {n: int(sizes.get(n) or 0) for n in sizes if any(fnmatch.fnmatch(n, p) for p in patterns)}
        # on disk: each file in whole blocks, and the cache's ref of the commit
        self.metadata_bytes = on_disk(0) + sum(on_disk(n) for n in self.metadata_files.values())
        self.acc.charge(self.repo_id, sha, sizes, patterns, self.who)
        self.folder = snapshot_download(self.repo_id, revision=sha, token=self.token, allow_patterns=patterns,
                                        **self.bars, **self.cache)

    def checkpoint(self, headers_only: bool) -> Checkpoint:
        """The input's :class:`Checkpoint`, its weights got through this object's methods."""
        self.kind = kind = "lora" if os.path.isfile(os.path.join(self.folder, "adapter_config.json")) else "full"
        ref = InputRef(spec=self.spec, repo_id=self.repo_id, revision=self.revision, sha=self.sha, path=self.folder,
                       kind=kind)
        ckpt = self.ckpt = Checkpoint(ref=ref, folder=self.folder, allow_pickle=self.allow_pickle, role=self.role)
        if not constants.HF_HUB_OFFLINE:  # what the Hub said of the repo: a public push of a merge of it must know
            ckpt.visibility = {"private": bool(getattr(self.info, "private", False)),
                               "gated": bool(getattr(self.info, "gated", False))}
        ckpt.metadata_bytes = self.metadata_bytes
        ckpt.metadata_files = self.metadata_files
        ckpt.fetch_weights = self.fetch_weights
        ckpt.weight_bytes = self.weight_bytes
        if not constants.HF_HUB_OFFLINE:
            ckpt.streamed = self.streamed
            ckpt.downloads = lambda: not self.in_place()
            ckpt.keep_files = self.keep_files
        if headers_only and not constants.HF_HUB_OFFLINE:
            ckpt.remote_headers = self.remote_headers
            ckpt.remote_files = self.safetensors_files
        return ckpt

    def keep_files(self) -> None:
        self.keep = True

    def _top(self) -> list[str]:
        return [f for f in self.files if "/" not in f]

    def weight_patterns(self) -> list[str]:
        """The weight files to download, as ``allow_patterns``; pickle weights only when allowed."""
        top, ckpt, role = self._top(), self.ckpt, self.role
        if os.path.isfile(os.path.join(self.folder, SAFETENSORS_INDEX)):
            # exactly the shards the index names (repos often carry other *.safetensors too); every
            # entry is checked to be a file of this repo before anything is downloaded
            return sorted(set(ckpt.weight_map(SAFETENSORS_INDEX).values()))
        if self.kind == "lora":
            if "adapter_model.safetensors" in top or not self.files:
                return ["adapter_model.safetensors"]
            if "adapter_model.bin" in top and not self.allow_pickle:
                raise _pickle_refused(ckpt.label, role)
            return ["adapter_model.bin"]
        if "model.safetensors" in top:
            return ["model.safetensors"]
        if any(f.endswith(".safetensors") for f in top):
            return ["*.safetensors"]
        if any(f.startswith("pytorch_model") and f.endswith(".bin") for f in top):
            if not self.allow_pickle:  # pickle only: fetched only when the user allows loading it
                raise _pickle_refused(ckpt.label, role)
            return ["pytorch_model*.bin"]
        raise CorruptCheckpointError(
            f"{role} '{ckpt.label}': the repo holds no weights (no model.safetensors, "
            f"{SAFETENSORS_INDEX} or pytorch_model.bin)")

    def weight_bytes(self) -> int:
        """What fetching the weights would download into the Hub cache (0 when they are read in place: their
        bytes are charged as they come, and the merge's plan predicts them)."""
        if constants.HF_HUB_OFFLINE or self.in_place():
            return 0
        pats = self.weight_patterns()
        return sum(int(self.sizes.get(n) or 0) for n in self.sizes
                   if any(fnmatch.fnmatch(n, p) for p in pats)
                   and not self.acc._cached(self.repo_id, self.sha, n, "model"))

    def fetch_weights(self) -> None:
        if constants.HF_HUB_OFFLINE or self.in_place():
            return
        patterns = self.weight_patterns()
        self.acc.charge(self.repo_id, self.sha, self.sizes, patterns, self.who)
        try:
            ensure_timeouts()
            self.mon.check("before downloading")
            # huggingface_hub warns when the cache's disk looks too small, then tries: held back until it is known
            # whether the disk did fill (then the one line below says it)
            with warnings.catch_warnings(record=True) as held:
                warnings.simplefilter("always")
                snapshot_download(self.repo_id, revision=self.sha, token=self.token, allow_patterns=patterns,
                                  **self.bars, **self.cache)
        except Exception as e:  # noqa: BLE001
            raise self.fail(e) from e
        for w in held:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def safetensors_files(self) -> list[str]:
        """The safetensors files :meth:`fetch_weights` would download ([] when it would fetch anything else)."""
        top = self._top()
        if self.kind != "full":
            return []
        if os.path.isfile(os.path.join(self.folder, SAFETENSORS_INDEX)):
            return sorted(set(self.ckpt.weight_map(SAFETENSORS_INDEX).values()))
        if "model.safetensors" in top:
            return ["model.safetensors"]
        return sorted(f for f in top if f.endswith(".safetensors"))

    def cached(self, fname: str) -> bool:
        try:
            hit = try_to_load_from_cache(self.repo_id, fname, revision=self.sha, **self.cache)
        except Exception:  # noqa: BLE001 - an odd name: not cached
            return False
        return isinstance(hit, str) and os.path.isfile(hit)

    def remote_file(self, fname: str) -> RemoteFile:
        """``fname`` read in place (its header read now, once per checkpoint)."""
        if fname not in self.opened:
            if self.files and fname not in self.files:
                raise CorruptCheckpointError(f"{self.role} '{self.ckpt.label}': its weights name {fname}, which the "
                                             f"repo does not hold at {self.sha[:12]}")

            def fail_on(e: BaseException) -> BaseException:
                return self.fail(e, fname) if not isinstance(e, HubsoupError) else e

            ensure_timeouts()
            self.mon.check("before reading from the Hub")
            # one RemoteFile per file, run and token: two checkpoints of one repo (a layout's base and input) share
            # it, so the read-ahead fetches its bytes once
            shared = self.acc.remote_files
            token = self.token
            key = (self.repo_id, self.sha, fname, token if isinstance(token, (str, bool)) else None)
            rf = shared.get(key)
            if rf is None:
                rf = open_file(self.repo_id, self.sha, fname, size=self.sizes.get(fname), token=token,
                               who=f"{self.role} '{self.spec}' ({fname})", fail=fail_on, access=self.acc,
                               sha256=self.sha256s.get(fname), sleep=lambda t: _sleep(t))
                with self.opening:  # two threads may have read it at once: one object is kept
                    rf = shared.setdefault(key, rf)
            self.opened[fname] = rf
        return self.opened[fname]

    def in_place_files(self) -> list[str]:
        """The weight files a merge reads in place: safetensors only ([] for pickle weights)."""
        if self.kind == "lora":
            return ["adapter_model.safetensors"] if "adapter_model.safetensors" in self._top() or not self.files else []
        return self.safetensors_files()

    def in_place(self) -> bool:
        """Whether the weights are read in place rather than downloaded (``cache_inputs`` not asked, online,
        safetensors)."""
        return not (self.acc.cache_inputs or self.keep or constants.HF_HUB_OFFLINE) and bool(self.in_place_files())

    def open_remote(self, names: list[str]) -> None:
        """The headers of ``names`` not yet open, read concurrently (one round trip each: a sharded model's
        dozens of files would otherwise wait on each other)."""
        todo = [f for f in names if f not in self.opened]
        if len(todo) <= 1:
            for f in todo:
                self.remote_file(f)
            return
        with ThreadPoolExecutor(min(8, len(todo)), thread_name_prefix="hubsoup-headers") as pool:
            for _ in pool.map(self.remote_file, todo):  # the first failure is raised
                pass

    def streamed(self) -> dict[str, RemoteFile | None] | None:
        if not self.in_place():
            return None
        names = self.in_place_files()
        local = {f for f in names if self.cached(f)}
        self.open_remote([f for f in names if f not in local])
        return {f: None if f in local else self.remote_file(f) for f in names}

    def remote_headers(self) -> dict[str, dict[str, TensorInfo]] | None:
        names = self.safetensors_files()
        if not names:
            return None
        if all(self.cached(f) for f in names):
            return None  # every weight file is in the local cache at this commit: its headers are read there
        out: dict[str, dict[str, TensorInfo]] = {}
        self.open_remote([f for f in names if not self.cached(f)])
        for fname in names:  # two range requests at most per file: its header, never its data
            if self.cached(fname):
                self.ckpt._open_safetensors(fname)
                out[fname] = {n: self.ckpt._infos[n] for n, f in self.ckpt._files.items() if f == fname}
                continue
            out[fname] = self._header_infos(fname)
        return out

    def _header_infos(self, fname: str) -> dict[str, TensorInfo]:
        out = {}
        for name, (dtype_name, shape, _, _) in self.remote_file(fname).tensors.items():
            dtype = ST_DTYPES.get(dtype_name)
            if dtype is None:
                raise CorruptCheckpointError(f"{self.role} '{self.ckpt.label}': tensor '{name}' in {fname} has "
                                             f"unsupported dtype {dtype_name}")
            out[name] = TensorInfo(tuple(shape), dtype)
        return out


_sleep = time.sleep


MAX_REPO_FILES = 2000
"""The most files a fetched task repo (:func:`fetched_repo`) may hold."""


@contextmanager
def fetched_repo(repo_type: str, repo_id: str, revision: str | None, who: str, *, token: Token) -> Iterator[str]:
    """A Hub repo's files (an lm-eval task repo of a ``hub_only`` run) in a fresh folder, removed when the block
    ends: asked of the Hub with ``token`` (the run's; no default: a caller that forgets it fails), charged to its download budget, written inside the run's
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
            info = hub_api(token).repo_info(repo_id, repo_type=repo_type, revision=revision,
                                                timeout=hub_timeout(), files_metadata=True)
            siblings = info.siblings or []
            if len(siblings) > MAX_REPO_FILES:
                raise InputError(f"{who}: {repo_id} holds {len(siblings)} files, more than the {MAX_REPO_FILES} a task "
                                 "repo may hold")
            acc.charge(repo_id, info.sha, {f.rfilename: getattr(f, "size", None) for f in siblings}, None, who,
                       repo_type=repo_type)
            snapshot_download(repo_id, repo_type=repo_type, revision=info.sha, token=token, local_dir=folder,
                              tqdm_class=silent_tqdm(Monitor(None, None)))
        except HubsoupError:
            raise
        except Exception as e:  # noqa: BLE001 - one clear line, naming the repo only
            raise hub_failure(e, who, repo_id, revision, token) from e
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def with_backoff(call: Callable[[], T], monitor: Monitor | None = None, *, tries: int = 6, first: float = 1.0,
                 most: float = 8.0) -> T:
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
    raise ParameterError(f"with_backoff: tries must be at least 1, got {tries}")  # the last try returns or raises


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
        infos = hub_api(token).get_paths_info(ref.repo_id, names, revision=ref.sha)
    except Exception as e:  # noqa: BLE001
        raise hub_failure(e, f"{ckpt.role} '{ref.spec}'", ref.repo_id, ref.revision, token) from e
    sizes = {i.path: int(getattr(i, "size", 0) or 0) for i in infos}
    total = sum(sizes.values())
    cached = sum(size for name, size in sizes.items()
                 if isinstance(hit := try_to_load_from_cache(ref.repo_id, name, revision=ref.sha, **cache), str)
                 and os.path.isfile(hit))
    return total - cached, total
