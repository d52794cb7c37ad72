"""A model folder whose tensors are read lazily from safetensors shards."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from huggingface_hub import metadata_load
from safetensors import SafetensorError, safe_open

from hubsoup.errors import CorruptCheckpointError, InputError, PickleRefusedError, UnsafePathError

if TYPE_CHECKING:
    from hubsoup.sources.remote import RemoteFile

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
PICKLE_INDEX = "pytorch_model.bin.index.json"
PICKLE_SINGLE = "pytorch_model.bin"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SAFETENSORS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"

# safetensors header dtype names, as written in the file (the writer uses the inverse)
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class InputRef:
    """What the recipe records about one input: enough to fetch exactly it again."""

    spec: str
    """The input as the user gave it (``org/name@rev`` or a path)."""
    repo_id: str | None = None
    revision: str | None = None
    sha: str | None = None
    """The commit the revision resolved to (Hub inputs only)."""
    path: str | None = None
    """Local folder (for Hub inputs: the snapshot in the cache)."""
    kind: str = "full"
    """``full`` (a full fine-tune / pre-trained model) or ``lora`` (a PEFT adapter)."""
    digest: str | None = None
    """Local inputs: a short SHA-256 of the weight files' headers (and a sample of their bytes) and
    index, set when the weights are opened; with :attr:`name` it names the input on the Hub."""
    name: str | None = None
    """Local inputs read back from a public recipe: the folder name (no path was recorded)."""
    adapter: "InputRef | None" = None
    """A LoRA applied to this model (mergekit's ``model+adapter``): its own reference, pinned the same way."""

    @property
    def label(self) -> str:
        if self.adapter is not None:
            return f"{dataclasses.replace(self, adapter=None).label}+{self.adapter.label}"
        if self.repo_id:
            return f"{self.repo_id}@{self.sha[:12]}" if self.sha else self.repo_id
        return self.spec or self.public

    @property
    def is_local(self) -> bool:
        return not self.repo_id

    @property
    def public_name(self) -> str:
        """What may be published about this input: the repo ID, or a local folder's name (never its path)."""
        if self.adapter is not None:
            return f"{dataclasses.replace(self, adapter=None).public_name}+{self.adapter.public_name}"
        if self.repo_id:
            return self.repo_id
        if self.name:
            return self.name
        where = (self.path or self.spec or "").rstrip("/\\")
        return os.path.basename(os.path.normpath(where)) if where else "local"

    @property
    def public(self) -> str:
        """The stable, non-identifying reference: ``org/name@sha``, or ``folder-name (sha256:…)`` for a folder."""
        if self.adapter is not None:
            return f"{dataclasses.replace(self, adapter=None).public}+{self.adapter.public}"
        if self.repo_id:
            return f"{self.repo_id}@{self.sha}" if self.sha else self.repo_id
        return f"{self.public_name} (sha256:{self.digest})" if self.digest else self.public_name

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"spec": self.spec, "kind": self.kind}
        if self.repo_id:
            d.update(repo_id=self.repo_id, revision=self.revision, sha=self.sha)
        elif self.path or self.spec:
            d["path"] = os.path.abspath(self.path or self.spec)
            if self.digest:
                d["digest"] = self.digest
        else:  # read back from a public recipe: no path to record
            d = self.public_dict()
        if self.adapter is not None:
            d["adapter"] = self.adapter.to_dict()
        return d

    def public_dict(self) -> dict[str, Any]:
        """:meth:`to_dict` without anything local: a folder is its name and digest, never its path."""
        if self.repo_id:
            return self.to_dict()
        d: dict[str, Any] = {"name": dataclasses.replace(self, adapter=None).public_name, "kind": self.kind}
        if self.digest:
            d["digest"] = self.digest
        if self.adapter is not None:
            d["adapter"] = self.adapter.public_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InputRef":
        """The reference a recipe or a continual state recorded with :meth:`to_dict` (or :meth:`public_dict`)."""
        adapter = d.get("adapter")
        return cls(spec=d.get("spec", ""), repo_id=d.get("repo_id"), revision=d.get("revision"), sha=d.get("sha"),
                   path=d.get("path"), kind=d.get("kind", "full"), digest=d.get("digest"), name=d.get("name"),
                   adapter=cls.from_dict(adapter) if isinstance(adapter, dict) else None)

    @property
    def pinned_spec(self) -> str:
        """How to open exactly this input again: ``org/name@<sha>`` for the Hub, the folder otherwise."""
        if self.adapter is not None:
            return f"{dataclasses.replace(self, adapter=None).pinned_spec}+{self.adapter.pinned_spec}"
        if self.repo_id:
            return f"{self.repo_id}@{self.sha}" if self.sha else self.repo_id
        if not (self.path or self.spec):
            raise InputError(f"input '{self.public}' was a local folder, and a published recipe does not say where "
                             "it is; run the recipe that was written beside the merge's output, or merge again")
        return self.path or self.spec


def unsafe_name(name: Any) -> str | None:
    """Why a file name from a checkpoint's own metadata may not be opened (None if it may).

    A checkpoint names its files relative to its folder; an absolute path, a ``..`` component,
    a drive letter, a NUL byte or a non-string value could make hubsoup read a file of the
    machine instead, so each is refused before anything is opened.
    """
    if not isinstance(name, str):
        return f"is not a file name (a {type(name).__name__})"
    if not name or "\x00" in name:
        return "is not a file name"
    if name.startswith(("/", "\\")) or os.path.isabs(name) or re.match(r"^[A-Za-z]:", name):
        return "is an absolute path"
    if any(part == ".." for part in re.split(r"[/\\]", name)):
        return "climbs out of the folder ('..')"
    return None


def repo_cache_root(folder: str) -> str | None:
    """The Hub cache's repo folder (``.../models--org--name``) when ``folder`` is one of its snapshots.

    A snapshot's files are symlinks into ``../../blobs/`` of the same repo cache folder; those
    count as inside the checkpoint.
    """
    real = os.path.realpath(folder)
    parent = os.path.dirname(real)
    repo = os.path.dirname(parent)
    if os.path.basename(parent) == "snapshots" and re.match(r"^(models|datasets|spaces)--.+--.+", os.path.basename(repo)):
        return repo
    return None


def is_inside(path: str, root: str) -> bool:
    """Whether the real path of ``path`` lies in (or is) the real folder ``root``."""
    real, root = os.path.realpath(path), os.path.realpath(root)
    try:
        return os.path.commonpath([real, root]) == root
    except ValueError:  # different drives
        return False


@dataclass
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Checkpoint:
    """A model (pre-trained or full fine-tune) in a folder.

    Headers are read when the weights are opened; tensor data only when
    :meth:`tensor` is called. ``fetch_weights`` downloads the weight files of a Hub
    input on first use, so that configs can be checked before any weight moves.
    """

    ref: InputRef
    folder: str
    fetch_weights: Callable[[], None] | None = None
    allow_pickle: bool = False
    role: str = "input"
    """How messages name it: ``input`` or ``base``."""
    remote_headers: Callable[[], dict[str, dict[str, "TensorInfo"]] | None] | None = None
    """A Hub input opened for planning (``open_input(..., headers_only=True)``): ``{file: {tensor: info}}``
    from the weight files' headers on the Hub (range requests), so names, shapes and dtypes are known
    before any weight is downloaded; None from it (no safetensors to read so): the weights are fetched."""
    remote_files: Callable[[], list[str]] | None = None
    """With :attr:`remote_headers`: the weight files a merge would download (for ``resolve.download_size``)."""
    weight_bytes: Callable[[], int] | None = None
    """A Hub input: the bytes fetching its weights would charge to the run's ``max_download`` (0 without one)."""
    visibility: dict[str, bool] | None = None
    """A Hub input opened online: ``{"private": ..., "gated": ...}`` as the Hub said (for a public push's check)."""
    streamed: Callable[[], dict[str, Any] | None] | None = None
    """A Hub input read in place (:mod:`hubsoup.sources.remote`): ``{file: RemoteFile, or None when the local Hub
    cache holds it at the pinned commit}`` for its weight files; None from it (pickle weights, ``cache_inputs``):
    the weights are downloaded (:attr:`fetch_weights`) and opened from the folder."""
    _files: dict[str, str] = field(default_factory=dict, repr=False)  # tensor -> file
    _infos: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)
    _paths: dict[str, str] = field(default_factory=dict, repr=False)  # file -> checked path
    _pickled: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict, repr=False)
    _opened: bool = field(default=False, repr=False)
    _extents: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict, repr=False)  # file -> data extents
    _from_headers: bool = field(default=False, repr=False)  # _infos came from remote_headers, nothing opened
    _remote: dict[str, RemoteFile] = field(default_factory=dict, repr=False)  # file -> RemoteFile (read in place)
    metadata_bytes: int = 0
    """A Hub input: the disk its metadata (and tokenizer) files take in the Hub cache, from the Hub's sizes."""
    metadata_files: dict[str, int] = field(default_factory=dict, repr=False)
    """A Hub input: those files' sizes in bytes (``{name: size}``), from the Hub."""
    downloads: Callable[[], bool] | None = None
    """A Hub input: whether opening its weights downloads files (``cache_inputs``, pickle weights)."""
    keep_files: Callable[[], None] | None = None
    """A Hub input: have its weight files downloaded into the Hub cache rather than read in place (before it is
    opened: a method that builds the model from the folder, :attr:`hubsoup.methods.Method.needs_base_files`)."""
    _kept: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # keep(): tensors read, in memory

    # --- metadata -------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.ref.label

    def root(self) -> str:
        """The folder every file of this checkpoint must resolve into: its own folder, or for a
        snapshot of the Hub cache the repo's cache folder (``models--org--name``, which holds the blobs
        the snapshot's symlinks point to)."""
        return repo_cache_root(self.folder) or os.path.realpath(self.folder)

    def file(self, name: Any, *, named_by: str | None = None) -> str:
        """The path of the checkpoint's file ``name``; raises :class:`UnsafePathError` if it is not inside.

        ``name`` comes from the checkpoint (an index's ``weight_map`` value, a file the folder holds):
        an absolute path, ``..``, a non-string value or a symlink leading out of :meth:`root` is refused,
        before the file is opened. ``named_by``: the file that named it (for the message).
        """
        where = f"{named_by} names {name!r}" if named_by else f"{name!r}"
        problem = unsafe_name(name)
        if problem:
            raise UnsafePathError(
                f"{self.role} '{self.label}': {where}, which {problem}; refused: a checkpoint may only name files "
                "inside its own folder")
        path = os.path.join(self.folder, *re.split(r"[/\\]", name))
        if (os.path.islink(path) or os.path.exists(path)) and not is_inside(path, self.root()):
            raise UnsafePathError(
                f"{self.role} '{self.label}': {where}, which is a link to a file outside the checkpoint's folder; "
                "refused: a checkpoint may only name files inside its own folder (replace the link by the file, "
                "or by a hard link)")
        return path

    def check_links(self, patterns: list[str]) -> None:
        """Refuse (:meth:`file`) any file of the folder matching ``patterns`` that is a link leading out of it."""
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return
        for name in names:
            if any(fnmatch.fnmatch(name, p) for p in patterns) and os.path.islink(os.path.join(self.folder, name)):
                self.file(name)

    def weight_map(self, name: str) -> dict[str, str]:
        """The ``weight_map`` of the index file ``name``, every file it names checked (:meth:`file`)."""
        index = self.read_json(name)
        if not index or not isinstance(index.get("weight_map"), dict):
            raise CorruptCheckpointError(f"{self.role} '{self.label}': {name} has no weight_map")
        wm: dict[str, str] = index["weight_map"]  # checked below: every value a file of the folder
        for tensor, fname in wm.items():
            self.file(fname, named_by=f"{name} (tensor {tensor!r})")
        return wm

    def read_json(self, name: str) -> dict[str, Any] | None:
        path = os.path.join(self.folder, name)
        if not os.path.isfile(path):
            return None
        path = self.file(name)
        try:
            with open(path, encoding="utf-8") as f:
                data: dict[str, Any] | None = json.load(f)  # a JSON object: config, index, adapter config
                return data
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"input '{self.label}': cannot read {name}: {e}") from e

    @property
    def config(self) -> dict[str, Any]:
        cfg = self.read_json("config.json")
        return cfg or {}

    def card_metadata(self) -> dict[str, Any]:
        """YAML front matter of the input's README.md (empty if none)."""
        path = os.path.join(self.folder, "README.md")
        if not os.path.isfile(path):
            return {}
        path = self.file("README.md")

        try:
            return metadata_load(path) or {}
        except Exception:  # a malformed card is not a reason to refuse a model
            return {}

    # --- weights ----------------------------------------------------------------------
    def _meta(self) -> None:
        """Know the tensors' names, shapes and dtypes: from :attr:`remote_headers` when given and the
        weights are not open yet (nothing downloaded), else by opening the weight files."""
        if self._opened or self._from_headers:
            return
        headers = self.remote_headers() if self.remote_headers is not None else None
        if headers is None:
            return self._open()
        for fname, tensors in headers.items():
            for name, info in tensors.items():
                self._infos[name], self._files[name] = info, fname
        self._from_headers = True

    def fetch(self) -> None:
        """Open the weight files now (a Hub input's: read in place, or downloaded with ``cache_inputs``).

        A checkpoint opened with ``headers_only`` knows its tensors from the Hub's headers; a merge
        calls this once its fit check has passed, so any download happens in its download stage.

        Example:
            >>> ckpt = open_input("org/model", headers_only=True)   # doctest: +SKIP
            >>> ckpt.fetch()                                          # doctest: +SKIP
        """
        self._open()

    def _open(self) -> None:
        if self._opened:
            return
        if self._from_headers:  # the downloaded files' own headers replace the remote ones
            self._infos.clear()
            self._files.clear()
            self._from_headers = False
        if self.fetch_weights is not None:
            self.fetch_weights()
        folder = self.folder
        index = os.path.join(folder, SAFETENSORS_INDEX)
        single = os.path.join(folder, SAFETENSORS_SINGLE)
        streamed = self.streamed() if self.streamed is not None else None
        if streamed is not None:  # a Hub input read in place: its weight files' headers came by range requests
            for fname, rf in streamed.items():
                if rf is None:
                    self._open_safetensors(fname)  # the Hub cache holds it at this commit
                else:
                    self._open_remote(fname, rf)
            if os.path.isfile(index):
                missing = [k for k in self.weight_map(SAFETENSORS_INDEX) if k not in self._infos]
                if missing:
                    raise CorruptCheckpointError(
                        f"input '{self.label}': {SAFETENSORS_INDEX} lists {len(missing)} tensors that "
                        f"are in no shard (e.g. '{missing[0]}'); the checkpoint is incomplete")
        elif os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)):
            self._open_adapter()
        elif os.path.isfile(index):
            weight_map = self.weight_map(SAFETENSORS_INDEX)
            files = sorted(set(weight_map.values()))
            for fname in files:
                self._open_safetensors(fname)
            missing = [k for k, f in weight_map.items() if k not in self._infos]
            if missing:
                raise CorruptCheckpointError(
                    f"input '{self.label}': {SAFETENSORS_INDEX} lists {len(missing)} tensors that "
                    f"are in no shard (e.g. '{missing[0]}'); the checkpoint is incomplete"
                )
        elif os.path.isfile(single):
            self._open_safetensors(SAFETENSORS_SINGLE)
        else:
            others = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            if others and not os.path.isfile(os.path.join(folder, "adapter_config.json")):
                for fname in others:
                    self._open_safetensors(fname)
            elif os.path.isfile(os.path.join(folder, PICKLE_INDEX)) or os.path.isfile(
                os.path.join(folder, PICKLE_SINGLE)
            ):
                self._open_pickle()
            else:
                raise InputError(
                    f"input '{self.label}': no weights found in {folder} "
                    f"(expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX})"
                )
        self._opened = True
        if self.ref.is_local and not self.ref.digest:
            self.ref.digest = self.content_digest()

    def content_digest(self) -> str:
        """A short SHA-256 that names a local checkpoint without its path (:attr:`InputRef.digest`).

        Covers each weight file's name, size and header (safetensors: its JSON header) and its first
        and last 64 KiB, plus the index and adapter config: it tells two fine-tunes of one base
        apart without reading whole models.
        """
        h = hashlib.sha256()
        for name in (SAFETENSORS_INDEX, PICKLE_INDEX, ADAPTER_CONFIG):
            if os.path.isfile(os.path.join(self.folder, name)):
                with open(self.file(name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
        for fname in sorted(set(self._files.values())):
            path = self._paths.get(fname) or self.file(fname)
            size = os.path.getsize(path)
            h.update(f"{fname}\0{size}\0".encode())
            with open(path, "rb") as f:
                start = 0
                if fname.endswith(".safetensors") and size >= 8:
                    n = int.from_bytes(f.read(8), "little")
                    start = 8 + min(n, size - 8, 100 * 1024 * 1024)  # safetensors' own header limit
                    f.seek(0)
                    h.update(f.read(start))
                sample = 64 * 1024
                f.seek(start)
                h.update(f.read(sample))
                f.seek(max(start, size - sample))
                h.update(f.read(sample))
        return h.hexdigest()[:16]

    def _open_adapter(self) -> None:
        """A PEFT adapter folder: ``adapter_model.safetensors`` (or, if allowed, ``adapter_model.bin``)."""
        if os.path.isfile(os.path.join(self.folder, ADAPTER_SAFETENSORS)):
            self._open_safetensors(ADAPTER_SAFETENSORS)
        elif os.path.isfile(os.path.join(self.folder, ADAPTER_PICKLE)):
            self._open_pickle([ADAPTER_PICKLE])
        else:
            raise CorruptCheckpointError(
                f"adapter '{self.label}': {ADAPTER_CONFIG} is there but its weights file {ADAPTER_SAFETENSORS} "
                f"is missing from {self.folder}; the adapter is incomplete (interrupted download or save?)"
            )

    def _read_index(self, name: str) -> dict[str, str]:
        return self.weight_map(name)

    def _open_safetensors(self, fname: str) -> None:
        path = self.file(fname)
        self._paths[fname] = path
        if not os.path.isfile(path):
            raise CorruptCheckpointError(f"input '{self.label}': weight file {fname} is missing")
        try:
            handle: Any = safe_open(path, framework="pt", device="cpu")  # safetensors' stub: untyped methods
            names = list(handle.keys())
            for name in names:
                sl = handle.get_slice(name)
                dtype = ST_DTYPES.get(sl.get_dtype())
                if dtype is None:
                    raise CorruptCheckpointError(
                        f"input '{self.label}': tensor '{name}' in {fname} has unsupported "
                        f"dtype {sl.get_dtype()}"
                    )
                self._infos[name] = TensorInfo(tuple(sl.get_shape()), dtype)
                self._files[name] = fname
        except SafetensorError as e:
            raise CorruptCheckpointError(
                f"input '{self.label}': {fname} is not a valid safetensors file "
                f"(truncated or corrupt download?): {e}. Delete it and download again."
            ) from e
        self._handles[fname] = handle

    def _open_remote(self, fname: str, rf: Any) -> None:
        """A weight file read in place (:class:`~hubsoup.sources.remote.RemoteFile`, its header already read)."""
        for name, (dtype_name, shape, _, _) in rf.tensors.items():
            dtype = ST_DTYPES.get(dtype_name)
            if dtype is None:
                raise CorruptCheckpointError(
                    f"input '{self.label}': tensor '{name}' in {fname} has unsupported dtype {dtype_name}")
            self._infos[name] = TensorInfo(tuple(shape), dtype)
            self._files[name] = fname
        self._remote[fname] = rf

    def _open_pickle(self, files: list[str] | None = None) -> None:
        if not self.allow_pickle:
            raise PickleRefusedError(
                f"input '{self.label}': only pickle weights (pytorch_model.bin) are available. "
                "Pickle files can run arbitrary code when loaded; pass --allow-pickle "
                "(allow_pickle=True) if you trust this source, or convert it to safetensors"
            )
        if files is not None:
            pass
        elif os.path.isfile(os.path.join(self.folder, PICKLE_INDEX)):
            files = sorted(set(self._read_index(PICKLE_INDEX).values()))
        else:
            files = [PICKLE_SINGLE]
        for fname in files:
            path = self.file(fname)
            self._paths[fname] = path
            try:
                # mmap keeps it lazy; weights_only refuses code objects even when allowed
                sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            except Exception as e:
                raise CorruptCheckpointError(f"input '{self.label}': cannot load {fname}: {e}") from e
            self._pickled[fname] = sd
            for name, t in sd.items():
                self._infos[name] = TensorInfo(tuple(t.shape), t.dtype)
                self._files[name] = fname

    def keys(self) -> list[str]:
        self._meta()
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        self._meta()
        return self._infos[name]

    def has(self, name: str) -> bool:
        self._meta()
        return name in self._infos

    def keep(self) -> int:
        """Keep every tensor in memory once read (a copy, off the file's mapping): read once, then served from
        memory, and :meth:`release` no longer drops it. For a process that streams the same model many times (a
        search's trials). Returns the bytes it will hold once every tensor was read (their stored size).

        Example:
            >>> ckpt.keep()                                  # doctest: +SKIP
            75194368
        """
        if self._kept is None:
            self._kept = {}
        return self.stored_bytes()

    def stored_bytes(self) -> int:
        """The size of every tensor as stored (from the headers)."""
        return sum(math.prod(self.info(k).shape) * self.info(k).dtype.itemsize for k in self.keys())

    def forget(self) -> None:
        """Undo :meth:`keep`: the tensors held are dropped, and later reads go to the files again."""
        self._kept = None

    @property
    def kept(self) -> bool:
        """Whether :meth:`keep` was called: tensors are served from memory once read."""
        return self._kept is not None

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor, in its stored dtype (from memory after :meth:`keep`: never modify it)."""
        if self._kept is not None:
            t = self._kept.get(name)
            if t is None:
                t = self._kept[name] = self._read(name).clone()
            return t
        return self._read(name)

    def _read(self, name: str) -> torch.Tensor:
        self._open()
        fname = self._files.get(name)
        if fname is None:
            raise InputError(f"input '{self.label}': has no tensor '{name}'")
        if fname in self._pickled:
            return self._pickled[fname][name]
        if fname in self._remote:
            return self._remote[fname].tensor(name)
        try:
            handle = self._handles[fname]
            if handle is None:  # released: map the file again
                handle = self._handles[fname] = safe_open(self._paths[fname], framework="pt", device="cpu")
            return handle.get_tensor(name)  # type: ignore[no-any-return]  # safetensors' stub: get_tensor untyped
        except SafetensorError as e:
            raise CorruptCheckpointError(
                f"input '{self.label}': cannot read tensor '{name}' from {fname}: {e}"
            ) from e

    def byte_ranges(self, names: list[str]) -> list[tuple[str, int, int]]:
        """Where tensors' bytes lie on disk: ``(path, offset, length)`` per safetensors tensor of ``names``.

        For the engine's read-ahead (:mod:`hubsoup.engine.prefetch`), which only hints the
        page cache: names it does not know and pickle files give no range, and a header that
        cannot be read gives none either (the real read reports the problem). A file read from the Hub in
        place gives its key instead of a path (:func:`hubsoup.sources.remote.is_key`): the engine's
        :class:`~hubsoup.sources.remote.Window` fetches those ranges.

        Example:
            >>> ckpt.byte_ranges(["model.embed_tokens.weight"])  # doctest: +SKIP
            [('/models/base/model.safetensors', 8, 262144)]
        """
        if not self._opened and _PEEKING.get() and self.downloads is not None and self.downloads():
            return []  # a plan's look (:func:`peeking`): never a download
        self._open()
        out = []
        for name in names:
            if self._kept is not None and name in self._kept:
                continue  # in memory: nothing to read ahead
            fname = self._files.get(name)
            if fname is not None and fname in self._remote:  # read in place: the file's key, not a path
                rf = self._remote[fname]
                _, _, off, n = rf.tensors[name]
                out.append((rf.key, off, n))
                continue
            if fname is None or fname in self._pickled or fname not in self._paths:
                continue
            extents = self._extents.get(fname)
            if extents is None:
                extents = self._extents[fname] = _data_extents(self._paths[fname])
            if name in extents:
                out.append((self._paths[fname], *extents[name]))
        return out

    def release(self) -> None:
        """Unmap the weight files (they are mapped again on the next read).

        Pages of a memory-mapped file stay in the process's resident set once touched;
        the engine releases after every block so that resident memory stays at about
        one block per input instead of growing to whole models.
        """
        for fname in self._handles:
            self._handles[fname] = None


_PEEKING: contextvars.ContextVar[bool] = contextvars.ContextVar("hubsoup_peeking", default=False)


@contextlib.contextmanager
def peeking() -> Iterator[None]:
    """Inside, :meth:`Checkpoint.byte_ranges` of a Hub input whose weights would be downloaded gives no range
    instead of opening it: a plan may count what the merge reads before any weight moves."""
    token = _PEEKING.set(True)
    try:
        yield
    finally:
        _PEEKING.reset(token)


def _data_extents(path: str) -> dict[str, tuple[int, int]]:
    """``{tensor: (offset, length)}`` from a safetensors file's header ({} when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > 100 * 1024 * 1024:  # safetensors' own header limit
                return {}
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return {}
    out = {}
    for name, meta in header.items() if isinstance(header, dict) else ():
        offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
        if (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            out[name] = (8 + n + offsets[0], offsets[1] - offsets[0])
    return out
