"""A model with a LoRA adapter applied, tensor by tensor: mergekit's ``model+adapter`` references.

mergekit reads ``org/model+org/lora`` (anywhere a model is named, base included) as the model
with the adapter merged into it (peft's ``merge_and_unload``, saved to a cache folder). hubsoup
reads the same reference as an :class:`AdaptedCheckpoint`: the model's checkpoint, whose
:meth:`~AdaptedCheckpoint.tensor` adds the adapter's update ΔW to each tensor it touches when the
engine asks for it (:class:`hubsoup.sources.lora.LoraDelta`, peft's exact semantics), so no merged
copy is ever written. Everything else (config, file headers, tokenizer) is the model's. The
tensors an adapter changes are handed over in float32 (W + ΔW before any rounding).

As mergekit, hubsoup applies an adapter to the model it is written after, whatever base the
adapter names (a different base is warned about, not refused).

Example:
    >>> from hubsoup.sources.adapted import split_adapter
    >>> split_adapter("org/model@v1+org/lora")
    ('org/model@v1', 'org/lora')
    >>> split_adapter("org/model")
    ('org/model', None)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable

import torch

from hubsoup.errors import InputError
from hubsoup.sources.checkpoint import Checkpoint, InputRef
from hubsoup.sources.lora import lora_source

if TYPE_CHECKING:
    from hubsoup.sources.lora import LoraDelta

log = logging.getLogger(__name__)


def split_adapter(spec: str) -> tuple[str, str | None]:
    """``(model, adapter)`` of a ``model+adapter`` reference (adapter None when there is none)."""
    if not isinstance(spec, str) or "+" not in spec:
        return spec, None
    model, adapter = spec.split("+", 1)
    if not model.strip() or not adapter.strip() or "+" in adapter:
        raise InputError(f"{spec!r} is not a model reference: write MODEL+ADAPTER, one adapter at most")
    return model.strip(), adapter.strip()


class AdaptedCheckpoint:
    """``model`` with ``adapter`` applied on read; otherwise the model's checkpoint (see the module's docs)."""

    def __init__(self, model: Checkpoint, adapter: Checkpoint, delta: LoraDelta) -> None:
        self.model, self.adapter, self.delta = model, adapter, delta

    def __getattr__(self, name: str) -> Any:  # config, keys, info, folder, read_json, ...: the model's
        return getattr(self.model, name)

    @property
    def ref(self) -> InputRef:
        return dataclasses.replace(self.model.ref, adapter=self.adapter.ref)

    @property
    def label(self) -> str:
        return self.ref.label

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` of the model with the adapter's update added (float32 where the adapter changes it)."""
        t = self.model.tensor(name)
        if not self.delta.touches(name):
            return t
        w = t.to(torch.float32)
        d = torch.empty_like(w)
        self.delta.delta_into(d, name, w)
        return d.add_(w)

    def byte_ranges(self, names: list[str]) -> list[tuple[str, int, int]]:
        return self.model.byte_ranges(names) + [r for n in names if self.delta.touches(n)
                                                for r in self.delta.byte_ranges(n)]

    def fetch(self) -> None:
        self.model.fetch()
        self.adapter.fetch()

    def release(self) -> None:
        self.model.release()
        self.adapter.release()


def open_adapted(spec: str, open_input: Callable[..., Checkpoint], **kwargs: Any) -> Any:
    """Open ``spec``; a ``model+adapter`` reference as an :class:`AdaptedCheckpoint`.

    Returns a :class:`Checkpoint`, or an :class:`AdaptedCheckpoint` (the model's attributes passed through:
    used as a checkpoint everywhere, hence ``Any``).

    ``open_input``: :func:`hubsoup.sources.resolve.open_input` (passed in: this module sits below it),
    called with ``kwargs`` for the model and, without the tokenizer, for the adapter.
    """
    model_spec, adapter_spec = split_adapter(spec)
    if adapter_spec is None:
        return open_input(spec, **kwargs)

    model = open_input(model_spec, **kwargs)
    role = kwargs.get("role", "input")
    adapter = open_input(adapter_spec, **{**kwargs, "with_tokenizer": False, "role": f"{role}'s adapter"})
    if adapter.ref.kind != "lora":
        raise InputError(f"'{adapter_spec}' (after '+' in '{spec}') is not a LoRA adapter: it has no "
                         "adapter_config.json")
    if model.ref.kind != "full":
        raise InputError(f"'{model_spec}' (before '+' in '{spec}') is an adapter, not a model")
    keys = model.keys()
    delta = lora_source(adapter, model, keys, {k: model.info(k) for k in keys}, base_claim="warn")
    return AdaptedCheckpoint(model, adapter, delta)
