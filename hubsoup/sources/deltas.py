"""Task vectors of a full fine-tune against the base, one tensor at a time."""

from __future__ import annotations

import torch

from hubsoup.errors import IncompatibleInputError, NonFiniteTensorError
from hubsoup.sources.checkpoint import Checkpoint

SHAPE_POLICIES = ("error", "base-slice")


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no NaN or infinity.

    One reduction instead of an element-wise mask: a NaN or an infinity makes the sum
    non-finite, so a finite sum proves the tensor clean; only a non-finite sum (or an
    overflowing one) pays for the exact check.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


class FullDelta:
    """τ = θ_input − θ_base for a full checkpoint.

    ``name_map`` maps base tensor names to this input's names (e.g. a fine-tune saved
    with a task head has a ``bert.`` prefix the bare base lacks). Under the
    ``base-slice`` shape policy a tensor whose shape differs (a vocab-extended
    embedding) contributes its leading slice common with the base, and zero elsewhere:
    the output keeps the base's shape, which matches the base tokenizer it is saved with.
    """

    kind = "full"

    def __init__(self, ckpt: Checkpoint, name_map: dict[str, str], shape_policy: str = "error"):
        self.ckpt, self.name_map, self.shape_policy = ckpt, name_map, shape_policy

    @property
    def label(self) -> str:
        return self.ckpt.label

    def delta_into(self, out: torch.Tensor, name: str, base: torch.Tensor) -> None:
        """Write τ for tensor ``name`` into ``out`` (float32, base's shape and device)."""
        src = self.name_map.get(name, name)
        t = self.ckpt.tensor(src)
        if tuple(t.shape) == tuple(base.shape):
            out.copy_(t)
        else:
            common = tuple(slice(0, min(a, b)) for a, b in zip(t.shape, base.shape))
            if self.shape_policy != "base-slice" or t.dim() != base.dim():
                raise IncompatibleInputError(shape_message(self.label, src, tuple(t.shape), tuple(base.shape)))
            out.copy_(base)
            out[common] = t[common].to(out.device, out.dtype)
        if not all_finite(out):
            bad = int((~torch.isfinite(out)).sum())
            raise NonFiniteTensorError(
                f"input '{self.label}': tensor '{src}' has {bad} NaN/inf values; the fine-tune is broken "
                "(diverged training or a bad conversion) and cannot be merged"
            )
        out.sub_(base)


def shape_message(label: str, name: str, shape: tuple, base_shape: tuple) -> str:
    msg = f"input '{label}': tensor '{name}' has shape {list(shape)} but the base has {list(base_shape)}"
    if len(shape) == len(base_shape) and shape[1:] == base_shape[1:]:
        msg += (" (a resized vocabulary?). Pass --shape-mismatch base-slice to merge the rows the base has "
                "and keep the base's vocabulary, or merge models that share one tokenizer")
    return msg
