"""A model folder whose tensors are read lazily from safetensors shards."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from safetensors import SafetensorError, safe_open

from hubsoup.errors import CorruptCheckpointError, InputError, PickleRefusedError

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

    @property
    def label(self) -> str:
        if self.repo_id:
            return f"{self.repo_id}@{self.sha[:12]}" if self.sha else self.repo_id
        return self.spec

    def to_dict(self) -> dict[str, Any]:
        d = {"spec": self.spec, "kind": self.kind}
        if self.repo_id:
            d.update(repo_id=self.repo_id, revision=self.revision, sha=self.sha)
        else:
            d["path"] = os.path.abspath(self.path or self.spec)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "InputRef":
        """The reference a recipe or a continual state recorded with :meth:`to_dict`."""
        return cls(spec=d.get("spec", ""), repo_id=d.get("repo_id"), revision=d.get("revision"), sha=d.get("sha"),
                   path=d.get("path"), kind=d.get("kind", "full"))

    @property
    def pinned_spec(self) -> str:
        """How to open exactly this input again: ``org/name@<sha>`` for the Hub, the folder otherwise."""
        if self.repo_id:
            return f"{self.repo_id}@{self.sha}" if self.sha else self.repo_id
        return self.path or self.spec


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
    _files: dict[str, str] = field(default_factory=dict, repr=False)  # tensor -> file
    _infos: dict[str, TensorInfo] = field(default_factory=dict, repr=False)
    _handles: dict[str, Any] = field(default_factory=dict, repr=False)
    _pickled: dict[str, dict] = field(default_factory=dict, repr=False)
    _opened: bool = field(default=False, repr=False)

    # --- metadata -------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.ref.label

    def read_json(self, name: str) -> dict | None:
        path = os.path.join(self.folder, name)
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise InputError(f"input '{self.label}': cannot read {name}: {e}") from e

    @property
    def config(self) -> dict:
        cfg = self.read_json("config.json")
        return cfg or {}

    def card_metadata(self) -> dict:
        """YAML front matter of the input's README.md (empty if none)."""
        path = os.path.join(self.folder, "README.md")
        if not os.path.isfile(path):
            return {}
        from huggingface_hub import metadata_load

        try:
            return metadata_load(path) or {}
        except Exception:  # a malformed card is not a reason to refuse a model
            return {}

    # --- weights ----------------------------------------------------------------------
    def _open(self) -> None:
        if self._opened:
            return
        if self.fetch_weights is not None:
            self.fetch_weights()
        folder = self.folder
        index = os.path.join(folder, SAFETENSORS_INDEX)
        single = os.path.join(folder, SAFETENSORS_SINGLE)
        if os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)):
            self._open_adapter()
        elif os.path.isfile(index):
            weight_map = self._read_index(SAFETENSORS_INDEX)
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
        index = self.read_json(name)
        if not index or not isinstance(index.get("weight_map"), dict):
            raise CorruptCheckpointError(f"input '{self.label}': {name} has no weight_map")
        return index["weight_map"]

    def _open_safetensors(self, fname: str) -> None:
        path = os.path.join(self.folder, fname)
        if not os.path.isfile(path):
            raise CorruptCheckpointError(f"input '{self.label}': weight file {fname} is missing")
        try:
            handle = safe_open(path, framework="pt", device="cpu")
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
            path = os.path.join(self.folder, fname)
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
        self._open()
        return list(self._infos)

    def info(self, name: str) -> TensorInfo:
        self._open()
        return self._infos[name]

    def has(self, name: str) -> bool:
        self._open()
        return name in self._infos

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor, in its stored dtype."""
        self._open()
        fname = self._files.get(name)
        if fname is None:
            raise InputError(f"input '{self.label}': has no tensor '{name}'")
        if fname in self._pickled:
            return self._pickled[fname][name]
        try:
            handle = self._handles[fname]
            if handle is None:  # released: map the file again
                handle = self._handles[fname] = safe_open(os.path.join(self.folder, fname), framework="pt", device="cpu")
            return handle.get_tensor(name)
        except SafetensorError as e:
            raise CorruptCheckpointError(
                f"input '{self.label}': cannot read tensor '{name}' from {fname}: {e}"
            ) from e

    def release(self) -> None:
        """Unmap the weight files (they are mapped again on the next read).

        Pages of a memory-mapped file stay in the process's resident set once touched;
        the engine releases after every block so that resident memory stays at about
        one block per input instead of growing to whole models.
        """
        for fname in self._handles:
            self._handles[fname] = None

    def weight_files(self) -> list[str]:
        self._open()
        return sorted(set(self._files.values()))
