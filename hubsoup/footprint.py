"""What a run needs of the machine's disk and of the network, predicted from its plan before any weight moves.

:class:`Footprint` holds the figures (bytes), says what the peak local disk is, refuses a run whose peak exceeds
``max_disk`` (:meth:`Footprint.check`, before anything is downloaded: the message says what it needs, part by part)
and prints itself for ``hubsoup plan`` (:meth:`Footprint.lines`). The figures come from the caller
(:func:`hubsoup.api.footprint` reads them off a merge session: its plan, sources and options); nothing here reads a file.

The peak local disk of a run is

* the output: all of it, unless its shards stream to the Hub as they are written (``push=`` without a local copy),
  when it is the shards that can be on disk at once (:attr:`Footprint.held_shards`: the caller gives the largest
  ``SHARDS_IN_FLIGHT + 1`` of the output's layout, :data:`hubsoup.output.shards.SHARDS_IN_FLIGHT`: the one being
  written and the finished ones waiting for their upload) and the small files beside them (config, tokenizer,
  card, recipe, index: they go in the final commit);
* what it puts in the Hub cache: the inputs' metadata (configs, cards, indexes, tokenizer files) and, with
  ``cache_inputs``, their weight files (else the tensors the merge needs are read in place, in memory:
  :mod:`hubsoup.sources.remote`);
* its temporary files (a method's kept intermediates, when the caller knows them).

Example:
    >>> f = Footprint(output_bytes=16 * 10**9, shard_bytes=2 * 10**9, output_streamed=True, metadata_bytes=10**7,
    ...               held_shards=(2 * 10**9,) * 3)
    >>> f.output_disk, f.peak_disk
    (6000000000, 6010000000)
    >>> f.check(5 * 10**9)
    Traceback (most recent call last):
    ...
    hubsoup.errors.DiskLimitError: this run needs 6.0 GB of local disk at its peak (output 6.0 GB (3 shards of at most 2.0 GB in flight while they upload, and the files beside them); Hub cache: inputs' metadata 10.0 MB), over --max-disk (max_disk) 5.0 GB; a smaller --shard-size; nothing was downloaded
"""

from __future__ import annotations

from dataclasses import dataclass

from hubsoup.errors import DiskLimitError


BLOCK = 4096
"""A file system's block: a file takes whole blocks of disk (a 40-byte ref file takes 4 kB)."""


def on_disk(size: int) -> int:
    """The disk a file of ``size`` bytes takes: whole blocks, at least one.

    >>> on_disk(0), on_disk(1), on_disk(4097)
    (4096, 4096, 8192)
    """
    return max(1, -(-size // BLOCK)) * BLOCK


def fmt(n: int | float | None) -> str:
    """Bytes in decimal units, as the Hub shows sizes (``1.5 GB``)."""
    if n is None:
        return "?"
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


@dataclass
class Footprint:
    """A run's predicted local disk and network (bytes); see the module doc."""

    output_bytes: int = 0
    """The output's files (weights in the output dtype, and the small files beside them)."""
    shard_bytes: int = 0
    output_streamed: bool = False
    """Output shards are uploaded as they are written and deleted (a push without a local copy)."""
    held_shards: tuple[int, ...] = ()
    """A streamed output: the sizes of the shards that can be on local disk at once (the one being written and the
    finished ones waiting for their upload: the largest ``SHARDS_IN_FLIGHT + 1`` of its layout)."""
    output_small: int = 0
    """Of :attr:`output_bytes`, what is not a weight shard (config, tokenizer, card, recipe, index): on disk until
    the final commit, streamed or not."""
    output_bound: bool = False
    """:attr:`output_bytes` is an upper bound (a LoRA adapter: its ranks are known once it is merged)."""
    cache_bytes: int = 0
    """Weight files the run downloads into the Hub cache (``cache_inputs``, or pickle weights)."""
    metadata_bytes: int = 0
    """The Hub inputs' configs, cards, indexes and tokenizer files (in the Hub cache)."""
    scratch_bytes: int = 0
    """Files beside the output that are not the model: a continual soup's state, a method's kept intermediates
    (when known)."""
    network_in: int = 0
    """Bytes fetched from the Hub: the tensors the merge reads (once per pass over them) and the files' headers,
    or whole files for what is downloaded."""
    passes: int = 1
    """Passes over the inputs (a method's statistics passes re-read what they need)."""
    network_out: int = 0
    """Bytes pushed to the Hub (0: no push)."""
    in_place: int = 0
    """Of :attr:`network_in`, the bytes read in place (never on disk)."""
    already_read: int = 0
    """Of :attr:`network_in`, the bytes read before the plan was made (the files' headers)."""

    @property
    def output_disk(self) -> int:
        if self.output_streamed and self.held_shards:
            return min(self.output_bytes, sum(self.held_shards) + self.output_small)
        return self.output_bytes

    @property
    def peak_disk(self) -> int:
        return self.output_disk + self.cache_bytes + self.metadata_bytes + self.scratch_bytes

    def parts(self) -> list[str]:
        """The peak's parts, in words."""
        out = []
        if self.output_streamed and self.output_disk < self.output_bytes:
            out.append(f"output {fmt(self.output_disk)} ({len(self.held_shards)} shards of at most "
                       f"{fmt(max(self.held_shards))} in flight while they upload, and the files beside them)")
        else:
            out.append(f"output {'at most ' if self.output_bound else ''}{fmt(self.output_disk)}")
        cache = []
        if self.cache_bytes:
            cache.append(f"weights {fmt(self.cache_bytes)} (--cache-inputs or pickle weights)")
        if self.metadata_bytes:
            cache.append(f"inputs' metadata {fmt(self.metadata_bytes)}")
        if cache:
            out.append("Hub cache: " + ", ".join(cache))
        if self.scratch_bytes:
            out.append(f"state and temporary files {fmt(self.scratch_bytes)}")
        return out

    def check(self, max_disk: int | None) -> None:
        """Refuse (:class:`~hubsoup.errors.DiskLimitError`) when the peak exceeds ``max_disk`` (None: no limit)."""
        if max_disk is None or self.peak_disk <= max_disk:
            return
        hints = []
        if self.cache_bytes:
            hints.append("leave out --cache-inputs (the tensors are then read from the Hub in place)")
        if not self.output_streamed and self.output_bytes > self.shard_bytes > 0:
            hints.append("push with --push and no --out (shards are uploaded as they are written)")
        if self.output_streamed and self.shard_bytes and self.output_disk > max_disk // 2:
            hints.append("a smaller --shard-size")
        hint = f"; {', or '.join(hints)}" if hints else ""
        raise DiskLimitError(f"this run needs {fmt(self.peak_disk)} of local disk at its peak "
                             f"({'; '.join(self.parts())}), over --max-disk (max_disk) {fmt(max_disk)}{hint}; "
                             "nothing was downloaded")

    def lines(self, *, bandwidth: float | None = None, merge_seconds: float | None = None,
              max_disk: int | None = None) -> list[str]:
        """``hubsoup plan``'s report: disk, network and (given a measured ``bandwidth`` in bytes/s and the
        merge's predicted ``merge_seconds``) the wall time, download, merge and upload overlapping."""
        limit = "" if max_disk is None else (f" (within --max-disk {fmt(max_disk)})" if self.peak_disk <= max_disk
                                             else f" (OVER --max-disk {fmt(max_disk)}: the merge would be refused)")
        out = [f"disk: peak {fmt(self.peak_disk)}{limit}: " + "; ".join(self.parts())]
        where = (f", {fmt(self.in_place)} read in place, in memory" if self.in_place else "")
        passes = f" ({self.passes} passes over the inputs)" if self.passes > 1 else ""
        out.append(f"network: in {fmt(self.network_in)}{where}{passes}; out {fmt(self.network_out)}")
        if bandwidth:
            down = self.network_in / bandwidth
            up = self.network_out / bandwidth
            parts = [f"download {seconds(down)} at {fmt(bandwidth)}/s (measured)"]
            if merge_seconds is not None:
                parts.append(f"merge {seconds(merge_seconds)} (measured on this machine)")
            if self.network_out:
                parts.append(f"upload {seconds(up)} (at the download's bandwidth: an upload cannot be measured "
                             "without one)")
            wall = max(down, up, merge_seconds or 0.0)
            out.append(f"time: about {seconds(wall)}, the largest of " + ", ".join(parts)
                       + " (they overlap)")
        return out


__all__ = ["BLOCK", "Footprint", "fmt", "on_disk"]
