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

Every page-locked buffer comes from a :class:`PinnedRing` made once per feed (staging, read-ahead, outputs)
or from one small array of check flags: pinning memory is slow (run 3's profile: 0.31 s of a 2.6 s TIES
merge in ``torch.empty``), so a merge pins a bounded number of buffers whatever its number of tensors. Streams
are switched with :class:`on_stream`, not ``torch.cuda.stream``, whose ``StreamContext`` counts the CUDA devices
twice per switch (``cudaGetDeviceCount``, ~70 µs each).

On the CPU there is no feed (:func:`for_device` returns None): the engine reads and converts as
it always has, so CPU outputs are what they were, byte for byte. On a device other than CUDA
(``mps``, ``meta``) the stored tensor is handed with a plain ``.to(device)``: still the stored
dtype, no staging. Tests instrument a feed with ``transfer`` (what moves a staged tensor to the
device) to prove the host hands only stored bytes (``tests/engine/test_hostfeed.py``).

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


STAGE_SLOTS = 16
"""Read-ahead buffers at most (:meth:`Feed.stage`): a tensor's base and inputs, for this tensor and the next."""
OUT_SLOTS = 6
"""Output buffers at most (:meth:`Feed.back`): the writer's queue (``DEVICE_WRITE_DEPTH``) and the pending one."""
FLAG_SLOTS = 256
"""Check flags on their way back at once (:meth:`Feed.check`; each is settled a tensor later)."""
RING_FLOOR = 1 << 20
"""Smallest ring buffer: a buffer grows in powers of two from here, so it is regrown a few times at most."""


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)  # torch's own (cudagraph trees use it); absent: no reuse


def _storage_uses(t: torch.Tensor) -> int:
    """How many references the memory of ``t`` has (tensors and views over it, numpy arrays of them)."""
    return _USE_COUNT(t.untyped_storage()._cdata) if _USE_COUNT is not None else 0


@dataclass(eq=False)  # compared by identity (a field-wise == would compare the buffers' bytes)
class _Slot:
    """One ring buffer and the device event after which it may be written again."""

    buf: torch.Tensor | None = None
    done: torch.cuda.Event | None = None  # the last copy that read (H2D) or wrote (D2H) it
    uses: int = 0  # :func:`_storage_uses` of ``buf`` when nothing but the ring holds it

    def held(self) -> bool:
        """True while a view of the buffer lives outside the ring (a staged read, a pending output, the writer)."""
        if self.buf is None:
            return False
        return _USE_COUNT is None or _storage_uses(self.buf) > self.uses  # unknowable: held (a one-off instead)


class PinnedRing:
    """A bounded set of host buffers (page-locked when ``pin``), allocated once and reused in turn.

    :meth:`take` hands a slot again only when (1) nothing outside the ring holds a view of its buffer (the
    memory's use count, :func:`_storage_uses`, is back to the ring's own) and (2) the device copy that last used
    it is over (its ``done`` event, waited for here). When every slot is held, or a request is larger than
    ``cap``, it returns None and the caller takes a one-off buffer: a buffer in use is never written.

    Example:
        >>> ring = PinnedRing(2, pin=False)
        >>> a = ring.take(10); view = a.buf[:10]      # held while ``view`` lives
        >>> b = ring.take(10); b is a
        False
        >>> del view; ring.take(10) is a, ring.allocations
        (True, 2)
    """

    def __init__(self, slots: int, *, pin: bool, floor: int = RING_FLOOR, cap: int | None = None):
        self.slots: list[_Slot] = []
        self.max_slots, self.pin, self.floor, self.cap = slots, pin, floor, cap
        self._next = 0
        self.allocations = 0
        """Buffers pinned so far (a slot made or grown)."""

    def take(self, nbytes: int) -> _Slot | None:
        """A free slot whose buffer has at least ``nbytes``; None if none can be had (see the class doc).

        Preferred, in turn from the slot after the last one taken: a free slot whose last copy is over, then a
        new slot (while fewer than ``slots``), then the free slot whose copy was queued first (waited for):
        the host fills one buffer while the device still copies another (double buffering)."""
        if self.cap is not None and nbytes > self.cap:
            return None
        n = len(self.slots)
        free: list[_Slot] = []  # not held, in turn
        ready: list[_Slot] = []  # of those, with their last copy over (too small so far)
        slot = None
        for k in range(n):
            s = self.slots[(self._next + k) % n]
            if s.held():
                continue
            free.append(s)
            if s.done is None or s.done.query():
                if s.buf is not None and s.buf.numel() >= nbytes:
                    slot = s  # usually the first one looked at
                    break
                ready.append(s)
        if slot is None and n < self.max_slots:
            slot = _Slot()
            self.slots.append(slot)
        if slot is None:  # every slot held or still copying: the oldest free one, waited for (regrown if small)
            slot = next((s for s in free if s.buf is not None and s.buf.numel() >= nbytes), None) or \
                next(iter(ready or free), None)
        if slot is None:
            return None
        self._next = (next(i for i, s in enumerate(self.slots) if s is slot) + 1) % len(self.slots)
        if slot.done is not None:
            slot.done.synchronize()  # its last copy is over (in turn: usually long ago)
            slot.done = None
        if slot.buf is None or slot.buf.numel() < nbytes:
            # a power of two under ``cap`` (regrown a few times at most); without a cap, what is asked
            pow2 = 1 << max(nbytes - 1, 0).bit_length()
            size = max(self.floor, pow2) if self.cap is not None else max(self.floor, nbytes)
            size = max(nbytes, size if self.cap is None else min(size, self.cap))
            slot.buf = None  # the old buffer goes back to torch's pinned cache (it reuses it after its copies)
            slot.buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            slot.uses = _storage_uses(slot.buf)
            self.allocations += 1
        return slot

    def clear(self) -> None:
        """Wait for every slot's last copy and drop the buffers (a view still held keeps its memory alive)."""
        for slot in self.slots:
            if slot.done is not None:
                slot.done.synchronize()
            slot.done = slot.buf = None
        self.slots.clear()


class on_stream:
    """``with torch.cuda.stream(stream):`` without counting the CUDA devices.

    torch's ``StreamContext`` asks for the current device through ``torch.cuda.is_available()`` in its
    ``__init__`` and again in ``__enter__`` (``current_stream(None)``), each a ``cudaGetDeviceCount`` call
    (``torch._C._cuda_getDeviceCount``, not cached). This does what it does with device indices, which count
    nothing: remember the current device's current stream (and, when ``stream`` is on another device, that
    device's), make ``stream`` current (``torch.cuda.set_stream`` also makes its device current), and on exit
    restore the stream's device's previous stream first, then the previous device's, which makes that device
    current again, exactly as ``StreamContext.__exit__`` does.
    """

    __slots__ = ("stream", "src_prev", "dst_prev")

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.src_prev: torch.cuda.Stream | None = None
        self.dst_prev: torch.cuda.Stream | None = None

    def __enter__(self) -> None:
        cur = torch.cuda.current_device()  # the runtime's current device (no device count)
        self.src_prev = torch.cuda.current_stream(cur)
        self.dst_prev = None
        if cur != self.stream.device_index:
            self.dst_prev = torch.cuda.current_stream(self.stream.device_index)
        torch.cuda.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        if self.dst_prev is not None:
            torch.cuda.set_stream(self.dst_prev)
        if self.src_prev is not None:  # set by __enter__
            torch.cuda.set_stream(self.src_prev)


class _Flags:
    """The check flags' host side: one page-locked int64 array, an entry per check on its way back."""

    def __init__(self, n: int, pin: bool):
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=pin)
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, i: int) -> None:
        # the flags are copied on one stream, in order: a later copy into entry i lands after this one's
        self._free.append(i)


@dataclass
class _Staged:
    """A read started ahead (:meth:`Feed.stage`): its buffer and the reader threads' pieces."""

    seq: int  # the tensor being fed when it was staged
    buf: torch.Tensor
    pieces: list[Future[bool]]
    slot: _Slot | None = None  # the ring slot ``buf`` is a view of (None: a one-off buffer)

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
    """A check's count on its way to the host: ``host`` (page-locked) is valid once ``copied`` is done;
    ``entry``: its place in the feed's :class:`_Flags` (None: a one-off buffer)."""

    host: torch.Tensor
    copied: torch.cuda.Event
    entry: int | None = None

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
        # the page-locked buffers: allocated once per feed and reused (PinnedRing), never per tensor
        self._in = PinnedRing(slots, pin=self.pin, floor=MIN_STAGE)  # loads not read ahead (any size)
        self._ahead = PinnedRing(STAGE_SLOTS, pin=self.pin, cap=STAGE_MAX)  # reads ahead (Feed.stage)
        self._out = PinnedRing(OUT_SLOTS, pin=self.pin, cap=STAGE_MAX)  # outputs back (Feed.back)
        self._flags: _Flags | None = None  # made with the first check
        self.one_off_pins = 0
        """Page-locked buffers taken outside the rings (a tensor over ``STAGE_MAX``, every slot held)."""
        self._fds: dict[str, int] = {}
        self._staged: dict[tuple[str, int, int], _Staged] = {}  # reads started ahead (:meth:`stage`)
        self._checks: list[tuple[int, torch.Tensor | _Flag, Callable[[int], BaseException]]] = []
        self._lock = threading.Lock()
        self.seq = 0
        """The tensor being fed (the engine calls :meth:`next_tensor` per tensor); checks are grouped by it."""
        self.handed_bytes = 0
        self.loads = 0
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
            slot = self._ahead.take(r[2])
            # held (by _Staged) till loaded
            buf = slot.buf[:r[2]] if slot is not None and slot.buf is not None else self._one_off(r[2])
            self._staged[r] = _Staged(self.seq, buf, [_readers().submit(self._read_piece, r, buf, a, k)
                                                      for a, k in _pieces(r[2])], slot)
        self.host_seconds += time.perf_counter() - t0

    @property
    def pinned_buffers(self) -> int:
        """Page-locked buffers this feed has taken so far (ring slots made or grown, one-offs, the flags)."""
        return (self._in.allocations + self._ahead.allocations + self._out.allocations + self.one_off_pins
                + (self._flags is not None))

    def _one_off(self, nbytes: int) -> torch.Tensor:
        """A buffer of its own from torch's pinned cache (it reuses the block only after the copies that used it)."""
        self.one_off_pins += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def load(self, t: torch.Tensor, where: tuple[str, int, int] | None = None) -> torch.Tensor:
        """``t`` (host, its stored dtype; it may be a view of a mapped file) on the device, same dtype and shape.

        ``where``: ``(path, offset, length)`` of ``t``'s bytes in its file, when known (safetensors): they
        are then read straight into the staging buffer (``preadv``, in parallel pieces for a large tensor),
        which is faster than copying through the file's mapping (no page faults). On CUDA the copy to the
        device is asynchronous: the result is ready on the current stream (it waits for the copy stream).
        """
        nbytes = t.numel() * t.element_size()
        self.handed_bytes += nbytes
        self.loads += 1
        if not self.stage_host:  # mps, meta: no pinned memory to stage in
            return t.to(self.device)
        t0 = time.perf_counter()
        ahead = self._staged.pop(where, None) if where is not None and where[2] == nbytes else None
        slot = None
        if ahead is not None:  # read while the previous tensor was merged: usually done by now
            staged, slot = ahead.buf, ahead.slot
            t1 = time.perf_counter()
            done = ahead.wait()
            self.read_wait_s += time.perf_counter() - t1
            del ahead  # its view of the ring buffer: only ``staged`` holds it now, until this returns
            if not done:
                staged.view(t.dtype).view(t.shape).copy_(t)  # a short read: through the mapping
            self.staged_bytes += nbytes
        else:
            slot = self._in.take(nbytes)
            staged = slot.buf[:nbytes] if slot is not None and slot.buf is not None else self._one_off(nbytes)
            if where is None or where[2] != nbytes or not self._read(where, staged):
                staged.view(t.dtype).view(t.shape).copy_(t)  # through the mapping
        staged = staged.view(t.dtype).view(t.shape)  # the host's one touch: stored bytes → staging
        self.host_seconds += time.perf_counter() - t0
        if self._transfer is not None:
            return self._transfer(staged)
        compute = torch.cuda.current_stream(self.device)
        with on_stream(self.h2d):
            dest = torch.empty(t.shape, dtype=t.dtype, device=self.device)  # from the copy stream's pool
            # a one-off buffer is dropped after this: torch's pinned cache records the copy and reuses the
            # block only once it is done; a ring slot is reused by us, after its event
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
            with self._lock:
                if self._flags is None:
                    self._flags = _Flags(FLAG_SLOTS, self.pin)
                entry = self._flags.take()
            with on_stream(self.flags):
                self.flags.wait_event(computed)
                if entry is not None:  # an entry of the flags array; a one-off scalar when all are out
                    host = self._flags.host[entry]
                    src = bad if bad.dtype == torch.int64 else bad.to(torch.int64)  # made on this stream
                else:
                    host, src = torch.empty((), dtype=bad.dtype, pin_memory=self.pin), bad
                    self.one_off_pins += 1
                host.copy_(src, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.flags)
            bad.record_stream(self.flags)
            with self._lock:
                self._checks.append((self.seq, _Flag(host, copied, entry), error))
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
        try:
            for _, bad, error in due:
                n = bad.value() if isinstance(bad, _Flag) else int(bad)
                if n:
                    raise error(n)
        finally:  # read, or dropped with the failure: their flag entries are free again
            with self._lock:
                for _, bad, _ in due:
                    if isinstance(bad, _Flag) and bad.entry is not None and self._flags is not None:
                        self._flags.give(bad.entry)

    # --- back -----------------------------------------------------------------------------
    def back(self, t: torch.Tensor, *, check: Callable[[], None] | None = None) -> Pending:
        """``t`` (on the device, in its output dtype) copied back into a pinned host buffer; the returned
        :class:`Pending`'s ``result()`` waits for the copy, settles this tensor's checks and then runs ``check``.
        Each result has a buffer of its own while it is held (a ring slot, reused only once every view of it,
        the writer's included, is dropped and the copy into it is done)."""
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
        # a buffer the writer may hold while the merge goes on: a ring slot not held by anyone else, else a one-off
        slot = self._out.take(nbytes)
        raw = slot.buf[:nbytes] if slot is not None and slot.buf is not None else self._one_off(nbytes)
        host = raw.view(t.dtype).view(t.shape)
        del raw
        if not self.cuda or t.device.type != self.device.type:  # an instrumented feed; a result left on the host
            host.copy_(t)
            return Pending(host, ready)
        compute = torch.cuda.current_stream(self.device)
        self.d2h.wait_stream(compute)  # t is computed
        with on_stream(self.d2h):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.d2h)
        if slot is not None:
            slot.done = event  # reused only after this copy, even if the output is dropped unread (an abort)
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
                            "pinned_buffers": self.pinned_buffers,
                            "open_seconds": round(time.perf_counter() - self._t_open, 4)})
        for st in self._staged.values():
            st.wait()  # no reader thread writes a buffer (or reads a descriptor) past here
        self._staged.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for ring in (self._in, self._ahead, self._out):
            ring.clear()  # a buffer is freed once no pending output or write holds a view of it
        if self._flags is not None:
            self.flags.synchronize()  # no copy into the flags array is left when it is dropped
            self._flags = None


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
