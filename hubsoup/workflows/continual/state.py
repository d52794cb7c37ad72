"""The continual-merging state on disk: ``state.json`` + S in safetensors, checksummed, read lazily.

``StateReader`` is also a task-vector source (:class:`~hubsoup.sources.taskvector.TaskVector`):
the engine streams the accumulated update S tensor by tensor like any input's τ, and
unmaps its files after every block.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch
from huggingface_hub import constants, snapshot_download
from safetensors import SafetensorError, safe_open

from hubsoup.errors import ContinualStateError, InputError
from hubsoup.hubclient import Token, hub_api, hub_failure, hub_timeout, parse_spec
from hubsoup.public import json_digest
from hubsoup.sources import InputRef, access
from hubsoup.sources.taskvector import all_finite

STATE_DIR = "continual_state"
STATE_FILE = "state.json"
FORMAT = "hubsoup.continual"
FORMAT_VERSION = 1


@dataclass
class ContinualState:
    """What ``state.json`` holds (S itself is in the safetensors files beside it)."""

    params: dict[str, Any]
    base: dict[str, Any]
    base_sha256: dict[str, str]
    """SHA-256 of each mergeable base tensor's stored bytes: a different base is refused."""
    models: list[dict[str, Any]]
    """Input refs in merge order."""
    task_norms: list[float]
    s_norm: float
    lam: float
    tensors: dict[str, dict[str, Any]]
    """name -> {file, shape}: where each S tensor is stored."""
    files: dict[str, str]
    """S file -> SHA-256 of its bytes."""
    dtype: str | None = None
    shape_mismatch: str = "error"
    ignore_extra: bool = False
    hubsoup_version: str = ""
    format: str = FORMAT
    version: int = FORMAT_VERSION

    @property
    def count(self) -> int:
        return len(self.models)

    def to_json(self) -> str:
        d = asdict(self)
        d["count"] = self.count
        d["lambda"] = d.pop("lam")
        d["checksum"] = json_digest(d)
        return json.dumps(d, indent=2)

    @classmethod
    def from_json(cls, text: str, where: str) -> "ContinualState":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} is not valid JSON ({e}); "
                                      "the state is corrupt") from e
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} is not a hubsoup continual state")
        if d.pop("checksum", None) != json_digest(d):
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} does not match its own checksum "
                                      "(edited or corrupt); the state cannot be trusted")
        if d.get("version") != FORMAT_VERSION:
            raise ContinualStateError(f"continual state {where}: format version {d.get('version')} is not "
                                      f"supported (this hubsoup reads version {FORMAT_VERSION})")
        try:
            d["lam"] = d.pop("lambda")
            count = d.pop("count")
            state = cls(**d)
        except (KeyError, TypeError) as e:
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} lacks or has unexpected fields "
                                      f"({e}); the state is corrupt") from e
        if count != state.count or len(state.task_norms) != state.count or state.count < 1:
            raise ContinualStateError(f"continual state {where}: count {count}, {len(state.models)} models and "
                                      f"{len(state.task_norms)} norms disagree; the state is corrupt")
        return state


# --- reading a state --------------------------------------------------------------------------

def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


class StateReader:
    """A verified state folder: ``state.json`` checked, S files checksummed, S read lazily."""

    def __init__(self, folder: str, label: str | None = None, *, verify: bool = True):
        self.folder = folder
        self.where = where = f"'{label or folder}'"
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            raise ContinualStateError(
                f"{where} has no continual state ({STATE_DIR}/{STATE_FILE}); create one with "
                "`hubsoup continual init`")
        with open(path, encoding="utf-8") as f:
            self.state = ContinualState.from_json(f.read(), where)
        self._handles: dict[str, Any] = {}  # file -> safetensors' handle (untyped), None once released
        try:
            self._open(folder, where, verify)
        except (AttributeError, TypeError, KeyError, ValueError) as e:  # fields of the wrong type
            raise ContinualStateError(f"continual state {where}: {STATE_FILE} is malformed ({type(e).__name__}: "
                                      f"{e}); the state is corrupt") from e

    def _open(self, folder: str, where: str, verify: bool) -> None:
        for fname, digest in self.state.files.items():
            fpath = os.path.join(folder, fname)
            if os.path.basename(fname) != fname or not os.path.isfile(fpath):
                raise ContinualStateError(f"continual state {where}: file {fname} is missing; the state is incomplete")
            if verify and sha256_file(fpath) != digest:
                raise ContinualStateError(
                    f"continual state {where}: {fname} does not match the checksum in {STATE_FILE} "
                    "(corrupt or modified); the state cannot be trusted: restore it, or start again with "
                    "`hubsoup continual init`")
            try:
                self._handles[fname] = safe_open(fpath, framework="pt", device="cpu")
            except SafetensorError as e:
                raise ContinualStateError(f"continual state {where}: {fname} is not a valid safetensors file: {e}") from e
        for name, info in self.state.tensors.items():
            h = self._handles.get(info.get("file", ""))  # no file name: no handle
            if h is None or name not in h.keys():
                raise ContinualStateError(f"continual state {where}: tensor '{name}' is not in its file; "
                                          "the state is corrupt")

    def tensor(self, name: str) -> torch.Tensor:
        info = self.state.tensors[name]
        fname = info["file"]
        if self._handles[fname] is None:  # released: map the file again
            self._handles[fname] = safe_open(os.path.join(self.folder, fname), framework="pt", device="cpu")
        t: torch.Tensor = self._handles[fname].get_tensor(name)  # safetensors' handle: untyped
        return t.to(torch.float32)

    # --- as a task-vector source: the accumulated (unscaled) update S, streamed by the engine ---
    kind = "state"

    @property
    def label(self) -> str:
        return f"continual state {self.where}"

    @property
    def ref(self) -> InputRef:
        return InputRef(spec=self.folder, path=self.folder, kind="state")

    def touches(self, name: str) -> bool:
        return True

    def factors(self, name: str) -> None:
        return None

    def weights(self, name: str, shape: tuple[int, ...]) -> None:
        return None  # S is an update, not weights

    def delta_into(self, out: torch.Tensor, name: str, base: torch.Tensor) -> None:
        """S of tensor ``name`` into ``out``."""
        out.copy_(self.tensor(name))
        if not all_finite(out):
            raise ContinualStateError(f"{self.label}: tensor '{name}' of S has NaN/inf values; the state is corrupt")

    def release(self) -> None:
        for fname in self._handles:
            self._handles[fname] = None


def state_folder(soup: str, token: Token) -> tuple[str, str]:
    """(local folder of the soup's state, a label) for a soup given as a folder or Hub repo ID."""
    expanded = os.path.expanduser(soup)
    if access.hub_only():  # a server's run: a Hub repo ID by its text alone, no folder of this machine
        access.require_hub_id(soup, "soup")
    elif os.path.isdir(expanded):
        return os.path.join(expanded, STATE_DIR), soup
    elif os.path.exists(expanded):
        raise InputError(f"soup '{soup}': is a file; give the merged model's folder or its Hub repo ID")

    repo_id, revision = parse_spec(soup)
    acc = access.current()
    access.check_offline(f"soup '{soup}'")
    cache: dict[str, Any] = {"cache_dir": acc.cache_dir} if acc.cache_dir else {}
    patterns = [f"{STATE_DIR}/*"]
    try:
        if not constants.HF_HUB_OFFLINE:  # asked with this run's token (and sizes for its budget) first
            info = hub_api(token).model_info(repo_id, revision=revision, timeout=hub_timeout(),
                                             files_metadata=acc.limited)
            revision = info.sha
            acc.charge(repo_id, info.sha, {s.rfilename: getattr(s, "size", None) for s in info.siblings or []},
                       patterns, f"soup '{soup}'")
        folder = snapshot_download(repo_id, revision=revision, token=token, allow_patterns=patterns, **cache)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001 - one clear line
        raise hub_failure(e, f"soup '{soup}'", repo_id, revision, token) from e
    return os.path.join(folder, STATE_DIR), soup


def load_state(soup: str, token: Token = None) -> ContinualState:
    """The verified state of a soup (folder or Hub repo ID)."""
    folder, label = state_folder(soup, token)
    return StateReader(folder, label).state


