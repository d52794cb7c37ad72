"""A checkpoint seen through a re-mapping of some of its tensors (e.g. embedding rows re-indexed).

:class:`RemappedCheckpoint` wraps an opened :class:`~hubsoup.sources.checkpoint.Checkpoint`: the
tensors named in ``infos`` are presented with those shapes and dtypes, their values made on
demand by ``make(name)`` (from the wrapped checkpoint's own tensors, or others'); every other
tensor, file and attribute is the wrapped checkpoint's. The engine, the compatibility checks and
the sinks take it for the checkpoint itself, so a re-mapped input streams through the one engine
like any other. It knows nothing about merging: what the re-mapping is, its maker decides (a
mergekit config's merged vocabulary: :mod:`hubsoup.formats.mergekit_vocab`).

Example:
    >>> import torch
    >>> from hubsoup.sources.checkpoint import TensorInfo
    >>> class Raw:  # any checkpoint
    ...     label = "m"
    ...     def keys(self): return ["emb", "w"]
    ...     def info(self, name): return TensorInfo((2, 3), torch.float32)
    ...     def tensor(self, name): return torch.ones(2, 3)
    >>> view = RemappedCheckpoint(Raw(), {"emb": TensorInfo((4, 3), torch.float32)},
    ...                           lambda name: torch.zeros(4, 3))
    >>> view.info("emb").shape, view.info("w").shape, view.tensor("emb").shape, view.label
    ((4, 3), (2, 3), torch.Size([4, 3]), 'm')
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from hubsoup.sources.checkpoint import TensorInfo


class RemappedCheckpoint:
    """``ckpt`` with the tensors of ``infos`` replaced by ``make(name)`` (see the module's docstring)."""

    def __init__(self, ckpt: Any, infos: dict[str, TensorInfo], make: Callable[[str], torch.Tensor]):
        self.wrapped = ckpt
        self._remapped = dict(infos)
        self._make = make

    def __getattr__(self, attr: str) -> Any:  # folder, ref, config, fetch, release, read_json, ...
        return getattr(self.wrapped, attr)

    def keys(self) -> list[str]:
        return self.wrapped.keys()

    def info(self, name: str) -> TensorInfo:
        return self._remapped[name] if name in self._remapped else self.wrapped.info(name)

    def has(self, name: str) -> bool:
        return self.wrapped.has(name)

    def remapped(self, name: str) -> bool:
        """Whether tensor ``name`` is presented re-mapped."""
        return name in self._remapped

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as presented: re-mapped ones made now (a new tensor), the others read as stored."""
        if name in self._remapped:
            return self._make(name)
        return self.wrapped.tensor(name)

    def byte_ranges(self, names: list[str]) -> list[tuple[str, int, int]]:
        """The stored bytes a read of ``names`` touches (a re-mapped tensor is made from its stored one)."""
        return self.wrapped.byte_ranges(names)
