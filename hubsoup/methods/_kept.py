"""Tensors a method keeps from its statistics pass for its merge, on disk in the output's scratch folder.

A method whose global statistic needs every tensor's expensive intermediate first (OPCM: λ = ‖S‖ / mean‖τᵢ‖
needs S, and S costs an SVD per input of every linear weight) would otherwise compute that intermediate
twice, once per sweep. The store holds it between the sweeps: one safetensors file per tensor (written
once, read back exactly, so the merge is bit for bit what recomputing would give), removed with the
store. Methods see only :meth:`put` and :meth:`get`; the files are the engine's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class KeptTensors:
    """Per-tensor intermediates kept between a statistics pass and the merge (float32 as given)."""

    def __init__(self, scratch: str | None, label: str):
        if scratch is not None:
            os.makedirs(scratch, exist_ok=True)
        self.folder: str | None = tempfile.mkdtemp(prefix=f".hubsoup-{label}-", dir=scratch)
        self.label = label
        self.bytes = 0
        self._names: set[str] = set()
        self._lock = threading.Lock()  # blocks on several devices pass their tensors concurrently

    def _path(self, name: str) -> str:
        # a file name from a digest: tensor names are the checkpoint's (untrusted) and may be long
        return os.path.join(str(self.folder), hashlib.sha256(name.encode()).hexdigest()[:32] + ".safetensors")

    def put(self, name: str, tensor: torch.Tensor) -> None:
        if self.folder is None:
            raise RuntimeError(f"kept tensors '{self.label}' were closed")
        t = tensor.detach().to("cpu").contiguous()
        save_file({"t": t}, self._path(name))
        with self._lock:
            self._names.add(name)
            self.bytes += t.numel() * t.element_size()

    def get(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor | None:
        """The tensor kept under ``name`` (on ``device``), or None when the pass kept none."""
        with self._lock:
            if self.folder is None or name not in self._names:
                return None
        with safe_open(self._path(name), framework="pt", device="cpu") as h:
            t: torch.Tensor = h.get_tensor("t")
        return t.to(device) if str(device) != "cpu" else t.clone()  # the clone unmaps the file

    def close(self) -> None:
        with self._lock:
            folder, self.folder = self.folder, None
            self._names.clear()
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def __repr__(self) -> str:  # what lands in MergeResult.stats
        return f"KeptTensors({self.label}: {len(self._names)} tensors, {self.bytes / 2**20:.0f} MiB)"
