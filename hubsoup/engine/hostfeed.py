"""The host feed: stored bytes to a merge device, merged bytes back, pinned and overlapped.

When a block is merged on an accelerator, the host does as little as it can: it reads each
tensor's **stored bytes** (bf16/fp16 as stored, never converted) once, straight from the page
cache into a reused page-locked staging buffer (``preadv`` at the tensor's offset in its
safetensors file, in parallel pieces; through the file's mapping where no offset is known); the
device copies them over with ``non_blocking`` on a copy stream of its own, and converts them to
float32 there. Every check (NaN/inf in an input, an output that overflows its dtype) is a flag
computed on the device and read back later, a tensor behind (:meth:`Feed.settle`), so the host
never waits for the device's arithmetic: while the device merges tensor *i*, the host is already
copying tensor *i + 1*'s bytes into the other staging buffer (double buffering). The output comes
back the same way: the merged tensor, cast to its output dtype on the device, is copied into a
pinned buffer on a second copy stream, and the writer takes it from there once the copy is done
(:class:`Pending`).

On the CPU there is no feed (:func:`for_device` returns None): the engine reads and converts as
it always has, so CPU outputs are what they were, byte for byte. On a device other than CUDA
(``mps``, ``meta``) the stored tensor is handed with a plain ``.to(device)``: still the stored
dtype, no staging. Tests instrument a feed with ``transfer`` (what moves a staged tensor to the
device) to prove the host hands only stored bytes (``tests/test_hostfeed.py``).

Example:
    >>> f = Feed("meta")
    >>> t = f.load(torch.ones(4, dtype=torch.bfloat16))   # the stored bf16 bytes, handed as they are
    >>> t.dtype, t.device.type, f.handed_bytes
    (torch.bfloat16, 'meta', 8)
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

Transfer = Callable[[torch.Tensor], torch.Tensor]


def for_device(device: str | torch.device) -> "Feed | None":
    """The feed for merging on ``device``; None on the CPU (the engine reads there directly)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    return Feed(dev)


MIN_STAGE = 64 << 20
"""Bytes a staging buffer has at least: grown for a larger tensor, never per tensor (pinning is slow; torch
also keeps freed page-locked blocks for reuse, and never reuses one before the copies that read it are done)."""

STAGE_MAX = 64 << 20
"""Largest tensor read ahead (:meth:`Feed.stage`): a larger one (an embedding) is read when loaded, through the
reused staging buffers, so that the page-locked memory (slow to pin) stays about (N + 1) × this, not × the
largest tensor twice over."""

READ_PIECE = 16 << 20
"""Bytes per parallel read of a large tensor (page cache → staging)."""
READERS = 4
"""Threads reading a large tensor's pieces at once: one core copies ~3-6 GB/s out of the page cache."""
_POOL_LOCK = threading.Lock()


def _pieces(n: int) -> list[tuple[int, int]]:
    """``(start, length)`` of the :data:`READ_PIECE` pieces of ``n`` bytes, read in parallel."""
    return [(a, min(READ_PIECE, n - a)) for a in range(0, n, READ_PIECE)]
_READERS: dict[int, ThreadPoolExecutor] = {}


def _readers() -> ThreadPoolExecutor:
    """The reader threads, kept for the process (a forked child makes its own: its parent's do not exist there)."""
    with _POOL_LOCK:
        pool = _READERS.get(os.getpid())
        if pool is None:
            pool = _READERS[os.getpid()] = ThreadPoolExecutor(READERS, thread_name_prefix="hubsoup-feed")
        return pool


@dataclass
class _Slot:
    """One staging buffer and the device event after which it may be written again."""

    buf: torch.Tensor | None = None
    done: torch.cuda.Event | None = None  # the last copy that read (H2D) or wrote (D2H) it


@dataclass
class _Staged:
    """A read started ahead (:meth:`Feed.stage`): its buffer and the reader threads' pieces."""

    seq: int  # the tensor being fed when it was staged
    buf: torch.Tensor
    pieces: list[Future[bool]]

    def wait(self) -> bool:
        """Wait for every piece; True if each read all its bytes (a failed read counts as short)."""
        ok = True
        for f in self.pieces:
            try:
                ok = f.result() and ok
            except OSError:
                ok = False
        return ok


@dataclass
class _Flag:
    """A check's count on its way to the host: ``host`` (page-locked) is valid once ``copied`` is done."""

    host: torch.Tensor
    copied: torch.cuda.Event

    def value(self) -> int:
        self.copied.synchronize()
        return int(self.host)


@dataclass
class Pending:
    """A tensor on its way back to the host; :meth:`result` waits for it (and settles its checks)."""

    host: torch.Tensor
    ready: Callable[[], None]
    _done: bool = field(default=False, repr=False)

    def result(self) -> torch.Tensor:
        if not self._done:
            self.ready()
            self._done = True
        return self.host


class Feed:
    """Hands stored tensors to one device and takes merged ones back (see the module doc).

    ``transfer``: what moves a staged (host, stored-dtype) tensor to the device; the default is the
    non-blocking copy on CUDA's copy stream, or ``.to(device)`` elsewhere. Tests pass an instrumented one.
    ``pin``: stage in page-locked memory (default: when CUDA is available and the device is CUDA).
    """

    def __init__(self, device: str | torch.device, *, transfer: Transfer | None = None, pin: bool | None = None,
                 slots: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pin = (self.cuda and torch.cuda.is_available()) if pin is None else pin
        self._transfer = transfer
        self.stage_host = self.cuda or transfer is not None  # host staging buffers (pinned on CUDA)
        self._in = [_Slot() for _ in range(slots)]
        self._next_in = 0
        self._fds: dict[str, int] = {}
        self._staged: dict[tuple[str, int, int], _Staged] = {}  # reads started ahead (:meth:`stage`)
        self._checks: list[tuple[int, torch.Tensor | _Flag, Callable[[int], BaseException]]] = []
        self._lock = threading.Lock()
        self.seq = 0
        """The tensor being fed (the engine calls :meth:`next_tensor` per tensor); checks are grouped by it."""
        self.handed_bytes = 0
        """Bytes handed to the device (stored bytes only: never a float32 copy of a narrower tensor)."""
        self.returned_bytes = 0
        self.staged_bytes = 0
        self.read_wait_s = self.back_wait_s = 0.0
        """Time the engine waited for a staged read, and for an output's copy back (the pipeline's stalls)."""
        """Of ``handed_bytes``, those read ahead (:meth:`stage`) rather than when the merge asked for them."""
        self._t_open = time.perf_counter()
        self.host_seconds = 0.0
        """Time the host spent staging (waiting for a free buffer, reading): the feed's own cost."""
        if self.cuda:
            self.h2d = torch.cuda.Stream(self.device)
            self.d2h = torch.cuda.Stream(self.device)
            self.flags = torch.cuda.Stream(self.device)

    # --- in ------------------------------------------------------------------------------
    def next_tensor(self) -> int:
        """Start the next tensor's group of checks; returns its number. Reads staged for a tensor before the
        previous one and never loaded (a tensor the merge did not read through the feed) are dropped."""
        self.seq += 1
        stale = [r for r, st in self._staged.items() if st.seq < self.seq - 1]
        for r in stale:
            self._staged.pop(r).wait()  # its threads are done with the buffer before it is freed
        return self.seq

    def stage(self, ranges: list[tuple[str, int, int]]) -> None:
        """Start reading ``ranges`` (``(path, offset, length)``: the next tensor's stored bytes, the base's and
        the inputs') into page-locked buffers of their own, in the reader threads, while this tensor is merged;
        :meth:`load` of the same range then takes the staged bytes. A hint: a range never loaded costs a read."""
        if not self.stage_host:
            return
        t0 = time.perf_counter()
        for r in ranges:
            if r in self._staged or r[2] <= 0 or r[2] > STAGE_MAX:
                continue
            buf = torch.empty(r[2], dtype=torch.uint8, pin_memory=self.pin)  # torch's pinned cache reuses it
            self._staged[r] = _Staged(self.seq, buf, [_readers().submit(self._read_piece, r, buf, a, k)
                                                      for a, k in _pieces(r[2])])
        self.host_seconds += time.perf_counter() - t0

    def _slot(self, ring: list[_Slot], i: int, nbytes: int) -> tuple[_Slot, torch.Tensor]:
        """Slot ``i`` of ``ring`` once free, and its buffer of at least ``nbytes``."""
        slot = ring[i]
        if slot.done is not None:
            slot.done.synchronize()  # its last copy is over (double buffering: usually long ago)
            slot.done = None
        if slot.buf is None or slot.buf.numel() < nbytes:
            # dropped, not reused by us: a host view of it (a pending output, the writer) keeps it alive
            slot.buf = torch.empty(max(nbytes, MIN_STAGE), dtype=torch.uint8, pin_memory=self.pin)
        return slot, slot.buf

    def load(self, t: torch.Tensor, where: tuple[str, int, int] | None = None) -> torch.Tensor:
        """``t`` (host, its stored dtype; it may be a view of a mapped file) on the device, same dtype and shape.

        ``where``: ``(path, offset, length)`` of ``t``'s bytes in its file, when known (safetensors): they
        are then read straight into the staging buffer (``preadv``, in parallel pieces for a large tensor),
        which is faster than copying through the file's mapping (no page faults). On CUDA the copy to the
        device is asynchronous: the result is ready on the current stream (it waits for the copy stream).
        """
        nbytes = t.numel() * t.element_size()
        self.handed_bytes += nbytes
        if not self.stage_host:  # mps, meta: no pinned memory to stage in
            return t.to(self.device)
        t0 = time.perf_counter()
        ahead = self._staged.pop(where, None) if where is not None and where[2] == nbytes else None
        slot = None
        if ahead is not None:  # read while the previous tensor was merged: usually done by now
            staged = ahead.buf
            t1 = time.perf_counter()
            done = ahead.wait()
            self.read_wait_s += time.perf_counter() - t1
            if not done:
                staged.view(t.dtype).view(t.shape).copy_(t)  # a short read: through the mapping
            self.staged_bytes += nbytes
        else:
            slot, buf = self._slot(self._in, self._next_in, nbytes)
            self._next_in = (self._next_in + 1) % len(self._in)
            staged = buf[:nbytes]
            if where is None or where[2] != nbytes or not self._read(where, staged):
                staged.view(t.dtype).view(t.shape).copy_(t)  # through the mapping
        staged = staged.view(t.dtype).view(t.shape)  # the host's one touch: stored bytes → staging
        self.host_seconds += time.perf_counter() - t0
        if self._transfer is not None:
            return self._transfer(staged)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.h2d):
            dest = torch.empty(t.shape, dtype=t.dtype, device=self.device)  # from the copy stream's pool
            # a staged buffer is dropped after this: torch's pinned cache records the copy and reuses the
            # block only once it is done; a slot is reused by us, after its event
            dest.copy_(staged, non_blocking=True)
            if slot is not None:
                slot.done = torch.cuda.Event()
                slot.done.record(self.h2d)
        compute.wait_stream(self.h2d)
        dest.record_stream(compute)  # freed once the compute stream is done with it, not before
        return dest

    def _read(self, where: tuple[str, int, int], into: torch.Tensor) -> bool:
        """Read ``where``'s bytes into the uint8 tensor ``into``; False if the file gives fewer (the mapping
        is read instead, and reports a broken file as it always has)."""
        pieces = _pieces(where[2])
        if len(pieces) == 1 or READERS <= 1:
            return all(self._read_piece(where, into, a, k) for a, k in pieces)
        return all(_readers().map(lambda p: self._read_piece(where, into, *p), pieces))

    def _fd(self, path: str) -> int:
        """A descriptor of ``path``, opened once (the reader threads and the engine's share it)."""
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def _read_piece(self, where: tuple[str, int, int], into: torch.Tensor, a: int, k: int) -> bool:
        """One piece of a staged read (a reader thread): bytes ``a`` … ``a + k`` of ``where`` into ``into``."""
        path, offset, _ = where
        fd = self._fd(path)
        view = into.numpy().data.cast("B")
        while k > 0:
            got = os.preadv(fd, [view[a:a + k]], offset + a)
            if got <= 0:
                return False
            a, k = a + got, k - got
        return True

    def check(self, bad: torch.Tensor, error: Callable[[int], BaseException]) -> None:
        """Raise ``error(n)`` at the next :meth:`settle` of this tensor if the device scalar ``bad`` (a count) is
        not 0; nothing is read back now. On ``meta`` nothing can be read back: the check is dropped."""
        if self.device.type == "meta":
            return
        if self.cuda:  # copied back on a side stream, behind this check only (not behind the merge after it)
            computed = torch.cuda.Event()
            computed.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.flags):
                self.flags.wait_event(computed)
                host = torch.empty((), dtype=bad.dtype, pin_memory=self.pin)
                host.copy_(bad, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.flags)
            bad.record_stream(self.flags)
            with self._lock:
                self._checks.append((self.seq, _Flag(host, copied), error))
            return
        with self._lock:
            self._checks.append((self.seq, bad, error))

    def settle(self, upto: int | None = None) -> None:
        """Read back the checks of tensors up to number ``upto`` (all when None) and raise the first failing
        one, in the order they were made (the CPU's order)."""
        with self._lock:
            due = [c for c in self._checks if upto is None or c[0] <= upto]
            self._checks = [c for c in self._checks if not (upto is None or c[0] <= upto)]
        if not due:
            return
        for _, bad, error in due:
            n = bad.value() if isinstance(bad, _Flag) else int(bad)
            if n:
                raise error(n)

    # --- back -----------------------------------------------------------------------------
    def back(self, t: torch.Tensor, *, check: Callable[[], None] | None = None) -> Pending:
        """``t`` (on the device, in its output dtype) copied back into a pinned host buffer; the returned
        :class:`Pending`'s ``result()`` waits for the copy, settles this tensor's checks and then runs ``check``.
        Each result has a buffer of its own (torch's pinned cache reuses it once it is dropped)."""
        seq = self.seq
        nbytes = t.numel() * t.element_size()
        self.returned_bytes += nbytes

        def ready() -> None:
            if event is not None:
                t = time.perf_counter()
                event.synchronize()
                self.back_wait_s += time.perf_counter() - t
            self.settle(seq)
            if check is not None:
                check()

        event: torch.cuda.Event | None = None
        if t.device.type == "meta":  # a test's stand-in device: nothing to copy
            return Pending(t, ready)
        if not self.stage_host:  # mps: a plain copy back
            return Pending(t.to("cpu"), ready)
        # a buffer of its own from torch's pinned cache (freed once the writer is done with it, reused only after
        # the copy into it): the writer may hold several outputs while the merge goes on
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin).view(t.dtype).view(t.shape)
        if not self.cuda or t.device.type != self.device.type:  # an instrumented feed; a result left on the host
            host.copy_(t)
            return Pending(host, ready)
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)  # t is computed
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        t.record_stream(self.d2h)
        return Pending(host, ready)

    def close(self) -> None:
        """Wait for every copy and drop the staging buffers. With ``HUBSOUP_FEED_LOG`` set, one JSON line of
        this feed's counts is appended to that file (``benchmarks/bench_gpu.py`` reads them)."""
        log_path = os.environ.get(LOG_ENV)
        if log_path and self.handed_bytes:
            log_record(log_path, {"device": str(self.device), "handed_bytes": self.handed_bytes,
                            "staged_bytes": self.staged_bytes, "read_wait_s": round(self.read_wait_s, 4),
                            "back_wait_s": round(self.back_wait_s, 4),
                            "returned_bytes": self.returned_bytes, "host_seconds": round(self.host_seconds, 4),
                            "open_seconds": round(time.perf_counter() - self._t_open, 4)})
        for st in self._staged.values():
            st.wait()  # no reader thread writes a buffer (or reads a descriptor) past here
        self._staged.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for slot in self._in:
            if slot.done is not None:
                slot.done.synchronize()
                slot.done = None
            slot.buf = None  # freed once no pending output or write holds a view of it


LOG_ENV = "HUBSOUP_FEED_LOG"


def log_record(path: str, record: dict[str, object]) -> None:
    """Append ``record`` as a JSON line (a measurement aid: a failure to write is ignored)."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


def nonfinite_count(t: torch.Tensor) -> torch.Tensor:
    """How many NaN/inf values ``t`` holds, as a device scalar (no read-back)."""
    return (~torch.isfinite(t)).sum()
