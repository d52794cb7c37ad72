"""Frozen linear classifier heads: the file format ``hubsoup.eval`` reads (``head=PATH`` in a task spec).

A head file is a safetensors file holding ``weight`` [C, H] and ``bias`` [C] (float32), with
string metadata ``pooling`` (``mean`` or ``cls``: how the encoder's last hidden state is pooled
before the head) and ``labels`` (the class names in order, as a JSON list), plus any extra
free-form keys (e.g. ``task``, ``l2``).
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hubsoup.errors import ParameterError


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``hidden`` [B, T, H] over the real tokens (``mask`` [B, T] is the attention mask): ``pooling=mean``."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1)


def save_head(path: str, weight: torch.Tensor, bias: torch.Tensor, labels: Sequence[str], **meta: str) -> None:
    """Write a frozen mean-pooling head (``weight`` [C, H], ``bias`` [C], class names ``labels``) to ``path``;
    extra keyword arguments are stored as metadata strings."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({"weight": weight.float().contiguous(), "bias": bias.float().contiguous()}, path,
              metadata={"pooling": "mean", "labels": json.dumps(list(labels)), **{k: str(v) for k, v in meta.items()}})


def load_head(path: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, str]]:
    """A frozen classifier head: ``weight`` [C, H], ``bias`` [C] and metadata (labels, pooling)."""
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
            return f.get_tensor("weight").float(), f.get_tensor("bias").float(), meta
    except Exception as e:  # noqa: BLE001
        raise ParameterError(f"cannot read classifier head {path}: {e}") from e


def head_labels(meta: Mapping[str, str]) -> list[str] | None:
    """The class names stored in a head's metadata (from :func:`load_head`), or None when it has none."""
    return json.loads(meta["labels"]) if "labels" in meta else None


__all__ = ["mean_pool", "save_head", "load_head", "head_labels"]
