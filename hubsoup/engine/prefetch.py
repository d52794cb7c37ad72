"""Read-ahead: the next block's bytes come in from disk while the current block is computed.

:func:`hubsoup.engine.stream` asks a :class:`ReadAhead` for block k + 1 when it starts
block k. One background thread per stream takes the request, hints the kernel
(``posix_fadvise(WILLNEED)``, which starts the disk reads at once) and then reads the byte
ranges through a small reused buffer, so that by the time the engine maps block k + 1 its
pages are in the page cache. Nothing is kept: the page cache is the kernel's, not the
process's resident memory, so peak memory stays one block × (N + 2) — the read-ahead
costs one 4 MiB buffer.

Bounded: at most one request waits; a newer request replaces a stale one (the engine
is already reading that block itself), so the thread is never more than one block
ahead. :meth:`ReadAhead.close` stops it between chunks and joins it; the engine calls it
when the stream ends, is closed early, fails or is cancelled. Read-ahead never changes
a result (it only warms the cache) and its errors are ignored (the real read reports
them). ``HUBSOUP_PREFETCH=0`` or ``MergeOptions(prefetch=False)`` turns it off.

Example:
    >>> ahead = ReadAhead()
    >>> ahead.request([("/models/base/model.safetensors", 8, 4096)])  # doctest: +SKIP
    >>> ahead.close()
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from types import TracebackType
from typing import Iterable

log = logging.getLogger(__name__)

ENV = "HUBSOUP_PREFETCH"
CHUNK = 4 * 1024 * 1024

Range = tuple[str, int, int]  # (path, offset, length)


def enabled(setting: bool | None = None) -> bool:
    """Whether streams read ahead: ``setting`` when given, else ``HUBSOUP_PREFETCH`` (default on)."""
    if setting is not None:
        return bool(setting)
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def coalesce(ranges: Iterable[Range]) -> list[Range]:
    """Ranges sorted by file and offset, overlapping or adjacent ones joined (sequential reads)."""
    out: list[Range] = []
    for path, off, n in sorted(r for r in ranges if r[2] > 0):
        if out and out[-1][0] == path and off <= out[-1][1] + out[-1][2]:
            last = out[-1]
            out[-1] = (path, last[1], max(last[2], off + n - last[1]))
        else:
            out.append((path, off, n))
    return out


class ReadAhead:
    """One background thread bringing requested byte ranges into the page cache; see the module doc."""

    def __init__(self, *, chunk: int = CHUNK):
        self.chunk = chunk
        self._q: queue.Queue[list[Range] | None] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def request(self, ranges: Iterable[Range]) -> None:
        """Read ``ranges`` in the background; replaces a request the thread has not started yet."""
        ranges = coalesce(ranges)
        if not ranges or self._stop.is_set():
            return
        if self._thread is None:  # started on the first request: a stream that reads nothing starts nothing
            self._thread = threading.Thread(target=self._run, name="hubsoup-readahead", daemon=True)
            self._thread.start()
        try:
            self._q.get_nowait()  # stale: the engine has reached that block and reads it itself
        except queue.Empty:
            pass
        self._q.put_nowait(ranges)

    def close(self) -> None:
        """Stop (between chunks) and join the thread; idempotent, and safe at any moment of :meth:`request`
        (a signal may have come between the thread's creation and its start)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        try:
            self._q.get_nowait()
        except queue.Empty:
            pass
        try:
            self._q.put_nowait(None)  # wakes a thread waiting for work (or one that starts later)
        except queue.Full:
            pass
        if thread.ident is not None:  # never started: nothing to join (it would find the None and end)
            thread.join()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _run(self) -> None:
        buf = None
        while not self._stop.is_set():
            ranges = self._q.get()
            if ranges is None or self._stop.is_set():
                return
            if buf is None:
                buf = bytearray(self.chunk)
            try:
                self._fetch(ranges, memoryview(buf))
            except Exception as e:  # a hint only: the engine's own read reports a bad file
                log.debug("read-ahead failed: %s", e)

    def _fetch(self, ranges: list[Range], buf: memoryview) -> None:
        """Hint then read every range (sequentially, one reused buffer), stopping early on close."""
        fds: dict[str, int] = {}
        try:
            for path, off, n in ranges:
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fds[path], off, n, os.POSIX_FADV_WILLNEED)  # the disk starts on all of it
            for path, off, n in ranges:
                end = off + n
                while off < end:
                    if self._stop.is_set():
                        return
                    got = os.preadv(fds[path], [buf[:min(self.chunk, end - off)]], off)
                    if got <= 0:
                        break
                    off += got
        finally:
            for fd in fds.values():
                os.close(fd)
