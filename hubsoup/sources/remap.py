"""A checkpoint seen through a re-mapping of some of its tensors (e.g. embedding rows re-indexed).

:class:`RemappedCheckpoint` wraps an opened :class:`~hubsoup.sources.checkpoint.Checkpoint`: the
tensors named in ``infos`` are presented with those shapes and dtypes, their values made on
demand by ``make(name)`` (from the wrapped checkpoint's own tensors, or others'); every other
tensor, file and attribute is the wrapped checkpoint's. The engine, the compatibility checks and
the sinks take it for the checkpoint itself, so a re-mapped input streams through the one engine
like any other. It knows nothing about merging: what the re-mapping is, its maker decides (a
mergekit config's merged vocabulary: :mod:`hubsoup.formats.mergekit.vocab`).

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

from typing import Any, Callable, Protocol

import torch

from hubsoup.sources.checkpoint import TensorInfo


class TensorStore(Protocol):
    """What a view reads of the checkpoint it wraps (a :class:`~hubsoup.sources.checkpoint.Checkpoint`, or
    another view); every other attribute is passed through as is."""

    def keys(self) -> list[str]: ...

    def info(self, name: str) -> TensorInfo: ...

    def has(self, name: str) -> bool: ...

    def tensor(self, name: str) -> torch.Tensor: ...

    def byte_ranges(self, names: list[str]) -> list[tuple[str, int, int]]: ...


class RemappedCheckpoint:
    """``ckpt`` with the tensors of ``infos`` replaced by ``make(name)`` (see the module's docstring)."""

    def __init__(self, ckpt: TensorStore, infos: dict[str, TensorInfo], make: Callable[[str], torch.Tensor]) -> None:
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


class AliasedCheckpoint:
    """``ckpt`` with tensors it does not store presented under their names, read from a stored one.

    ``aliases``: name → the stored tensor it is read from (a T5 checkpoint storing ``shared.weight``
    only, seen with ``encoder.embed_tokens.weight`` too, as the tied model is); ``keep``: which of
    its stored tensors it shows (None: all; one module of a model: that module's). Every other
    file and attribute is the wrapped checkpoint's.

    Example:
        >>> import torch
        >>> from hubsoup.sources.checkpoint import TensorInfo
        >>> class Raw:
        ...     label = "m"
        ...     def keys(self): return ["shared.weight"]
        ...     def has(self, name): return name == "shared.weight"
        ...     def info(self, name): return TensorInfo((4, 2), torch.float32)
        ...     def tensor(self, name): return torch.ones(4, 2)
        >>> view = AliasedCheckpoint(Raw(), {"encoder.embed_tokens.weight": "shared.weight"})
        >>> view.keys(), view.has("encoder.embed_tokens.weight"), view.tensor("encoder.embed_tokens.weight").shape
        (['shared.weight', 'encoder.embed_tokens.weight'], True, torch.Size([4, 2]))
    """

    def __init__(self, ckpt: TensorStore, aliases: dict[str, str], keep: Callable[[str], bool] | None = None) -> None:
        self.wrapped = ckpt
        self.tie_aliases = dict(aliases)
        self._keep = keep

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.wrapped, attr)

    def _stored(self, name: str) -> str:
        return self.tie_aliases.get(name, name)

    def keys(self) -> list[str]:
        shown = [k for k in self.wrapped.keys() if k not in self.tie_aliases and (self._keep is None or self._keep(k))]
        return [*shown, *self.tie_aliases]

    def info(self, name: str) -> TensorInfo:
        return self.wrapped.info(self._stored(name))

    def has(self, name: str) -> bool:
        return name in self.tie_aliases or (self.wrapped.has(name) and (self._keep is None or self._keep(name)))

    def tensor(self, name: str) -> torch.Tensor:
        return self.wrapped.tensor(self._stored(name))

    def byte_ranges(self, names: list[str]) -> list[tuple[str, int, int]]:
        return self.wrapped.byte_ranges(list(dict.fromkeys(self._stored(n) for n in names)))
