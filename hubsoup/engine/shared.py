"""One preparation for many merges of the same inputs: what a search over merge-time parameters shares.

A method's preparation and statistics passes (:func:`hubsoup.engine.gather_stats`: LOT runs every
expert on its exemplars; TIES ranks every magnitude of the model) often do not read the parameter a
search varies (LOT's and TIES' λ, ``scale``). :meth:`Method.stats_key` says what they do read; inside
:func:`shared_statistics`, a merge whose inputs, base, options and key equal an earlier one's takes
that merge's statistics instead of computing them again, and the method's :meth:`Method.finish` runs
once, when other statistics replace them or the block ends. The statistics are the same objects, so the merges are the same bit for bit.

Example:
    >>> with shared_statistics():                                    # doctest: +SKIP
    ...     for lam in (0.5, 1.0, 1.5):
    ...         hubsoup.merge(inputs, "lot", base=base, out=f"lot-{lam}", scale=lam, exemplars=ex)
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Hashable, Iterator

from hubsoup.methods import Method

_CURRENT: contextvars.ContextVar["SharedStatistics | None"] = contextvars.ContextVar("hubsoup_shared_statistics",
                                                                                    default=None)


class SharedStatistics:
    """The last merge's statistics, kept for the next merge with the same key; :meth:`close` finishes them
    (LOT's scratch files go). One entry only: a grid whose points change what the preparation reads
    (LOT's ``n_exemplars``) holds one set of Gram files on disk at a time, as separate merges do."""

    def __init__(self, scratch: str | None = None) -> None:
        self.entry: tuple[Hashable, Method[Any], Any, dict[str, Any]] | None = None  # key, method, params, stats
        self.scratch = scratch
        """Where shared preparations keep their files: a folder that outlives each merge's own (the
        search's temporary folder); None: each merge's scratch folder."""

    @property
    def key(self) -> Hashable | None:
        """The key of the statistics held (see :func:`hubsoup.engine._stats_key`: the method's name and its
        :meth:`Method.stats_key` first), None when none are."""
        return self.entry[0] if self.entry is not None else None

    def get(self, key: Hashable) -> dict[str, Any] | None:
        return dict(self.entry[3]) if self.entry is not None and self.entry[0] == key else None

    def put(self, key: Hashable, method: Method[Any], params: Any, stats: dict[str, Any]) -> None:
        self.close()  # the earlier merge is over: its statistics go
        self.entry = (key, method, params, dict(stats))

    def close(self) -> None:
        entry, self.entry = self.entry, None
        if entry is not None:
            entry[1].finish(entry[2], entry[3])


@contextlib.contextmanager
def shared_statistics(scratch: str | None = None) -> Iterator[SharedStatistics]:
    """Merges inside the block share equal preparations and statistics passes (see the module doc).
    ``scratch``: a folder for the files they keep, which outlives every merge of the block. A block
    inside another that has its own scratch folder is the outer one (a search inside a benchmark's block
    shares with the benchmark's other runs); inside one without, it is a block of its own (what the inner
    block keeps must not outlive the inner block's folder)."""
    outer = _CURRENT.get()
    if outer is not None and outer.scratch is not None:
        yield outer
        return
    shared = SharedStatistics(scratch)
    token = _CURRENT.set(shared)
    try:
        yield shared
    finally:
        _CURRENT.reset(token)
        shared.close()


def current() -> SharedStatistics | None:
    return _CURRENT.get()
