"""Streaming, sharded safetensors writer.

safetensors' own ``save_file`` serialises a whole shard in memory. The merge plan
knows every output tensor's name, shape and dtype before the first one is computed,
so the layout (which shard, which byte offsets) is fixed up front: headers are
written first and each tensor's bytes go straight to their place on disk as soon as
it is merged. Memory stays at one tensor, whatever the shard size.

Writing overlaps merging: a writer thread takes one tensor at a time (the caller
waits while ``depth`` writes are still queued: 1 by default, so at most two tensors are
held), and each shard is synced to disk by another thread as soon as its last byte is
written, not all at the end. On Linux each tensor's bytes are also handed to the disk as
soon as they are written (``sync_file_range``, started by that other thread, so that a
busy disk queue never holds up the writes): otherwise the kernel starts writing back only
past its dirty-page threshold, and the final sync waits for the whole shard.
``HUBSOUP_FSYNC=0`` skips both (a measurement aid: the output is then not known to be
on disk when the merge reports it done).

A full disk (``ENOSPC``, or ``EDQUOT`` for a quota) is a one-line
:class:`~hubsoup.errors.DiskFullError` naming the file, the folder and the bytes the
shards need; :meth:`ShardedWriter.abort` never raises, even when closing a file fails.

**Handing complete shards on** (a push streamed to the Hub, :mod:`hubsoup.hub`). Given a
:class:`ShardHandoff`, the writer creates each shard's file only when its first bytes come, and
hands the file on as soon as its last byte is written (:meth:`ShardHandoff.shard_done`, from the
writer's own threads: it must not block). It holds at most :data:`SHARDS_IN_FLIGHT` complete
shards that the hand-off has not released, besides the one being written: before it creates
the next shard's file it waits until one is released (backpressure: the merge waits with it).
So a streamed output never has more than ``SHARDS_IN_FLIGHT + 1`` shard files on disk. Shards
whose content is already where it goes (:meth:`ShardedWriter.mark_remote`: a resumed push) are
neither created nor written; their tensors need not be computed (:meth:`ShardedWriter.remote_names`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Protocol

import torch

from hubsoup.errors import DiskFullError
from hubsoup.output.folder import final_path
from hubsoup.sources.checkpoint import ST_DTYPES

if TYPE_CHECKING:
    import numpy as np

_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}

_DTYPE_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
INDEX_NAME = "model.safetensors.index.json"

SHARDS_IN_FLIGHT = 2
"""K: complete shards a :class:`ShardHandoff` may hold (uploading) at once while the writer writes the next one.
The writer waits for one to be released before it creates another file, so a streamed output has at most
``SHARDS_IN_FLIGHT + 1`` shard files on disk (the disk a push needs: :func:`hubsoup.api.push_figures`)."""


class ShardHandoff(Protocol):
    """Where a :class:`ShardedWriter` hands each shard once its last byte is written (a streamed push)."""

    keeps_files: bool
    """The shard files stay (a local copy is kept): they are synced to disk as without a hand-off."""

    def shard_done(self, name: str, path: str, release: Callable[[], None]) -> None:
        """Shard file ``name`` at ``path`` is complete and closed. Must not block; calls ``release()`` exactly
        once when it no longer needs the file (uploaded, or given up), which lets the writer start another."""

    def failure(self) -> BaseException | None:
        """The error that stopped the hand-off, or a cancel (the writer raises it at its next write), if any."""


@dataclass(frozen=True)
class ShardLayout:
    """One shard as the writer lays it out before anything is written."""

    file: str
    header: bytes
    """The file's first bytes: the header's length (8 bytes, little-endian) and the JSON header, padded."""
    size: int
    """The whole file's length in bytes."""
    names: tuple[str, ...]
    """Its tensors, in file order."""


@dataclass
class _Slot:
    shard: int
    start: int  # absolute file offset of the tensor's bytes
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _writeback_starter() -> Callable[[int, int, int], None] | None:
    """``start(fd, offset, nbytes)``: begin writing that range to disk without waiting (Linux
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``); None where libc lacks it."""
    import ctypes  # lazy: platform-specific (Linux sync_file_range through libc)
    import ctypes.util  # lazy: platform-specific (Linux sync_file_range through libc)

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the head start (fsync follows)

    return start


_START_WRITEBACK = _writeback_starter()
_FSYNC = os.environ.get("HUBSOUP_FSYNC", "1").strip().lower() not in ("0", "false", "no", "off")


def _free(folder: str) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _lay_out(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int,
             metadata: dict[str, str] | None, prefix: str) -> tuple[list[ShardLayout], dict[str, _Slot], int]:
    """The shards of ``entries`` (``save_pretrained``'s packing: a tensor opens a new shard when it would take the
    current one past ``max_shard_size``), each tensor's place, and the tensors' total bytes."""
    metadata = {"format": "pt", **(metadata or {})}
    shards: list[list[tuple[str, tuple[int, ...], torch.dtype, int]]] = [[]]
    size = 0
    for name, shape, dtype in entries:
        nbytes = dtype.itemsize
        for s in shape:
            nbytes *= s
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(shape), dtype, nbytes))
        size += nbytes
    n = len(shards)
    files = [f"{prefix}.safetensors"] if n == 1 else [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    layout: list[ShardLayout] = []
    slots: dict[str, _Slot] = {}
    total = 0
    for i, shard in enumerate(shards):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, shape, dtype, nbytes in shard:
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data must start 8-byte aligned
        data_start = 8 + len(raw)
        layout.append(ShardLayout(files[i], len(raw).to_bytes(8, "little") + raw, data_start + offset,
                                  tuple(name for name, *_ in shard)))
        for name, shape, dtype, nbytes in shard:
            slots[name] = _Slot(i, data_start + header[name]["data_offsets"][0], nbytes, shape, dtype)
        total += offset
    return layout, slots, total


def shard_layout(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_size: int,
                 metadata: dict[str, str] | None = None, *, prefix: str = "model") -> list[ShardLayout]:
    """The shards a :class:`ShardedWriter` would write for ``entries`` (names, headers, sizes), without writing."""
    return _lay_out(entries, max_shard_size, metadata, prefix)[0]


class ShardedWriter:
    """Write the given tensors into safetensors shards of at most ``max_shard_size`` bytes.

    ``entries`` is the list of ``(name, shape, dtype)`` in output order. Shard files are
    named like ``save_pretrained``'s: ``model.safetensors`` alone, else
    ``model-00001-of-00003.safetensors`` plus ``model.safetensors.index.json``
    (``prefix`` replaces ``model``; ``index=False`` writes no index file).
    """

    def __init__(self, folder: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 max_shard_size: int, metadata: dict[str, str] | None = None, *, prefix: str = "model",
                 index: bool = True, handoff: ShardHandoff | None = None):
        self.folder, self.index = folder, index
        self.handoff = handoff
        """Where complete shards go (None: they stay, every file created up front)."""
        self.layout, self.slots, self.total_size = _lay_out(entries, max_shard_size, metadata, prefix)
        """``layout``: every shard's file name, header bytes, length and tensors (fixed before anything is written)."""
        n = len(self.layout)
        self.files = [shard.file for shard in self.layout]
        self.handles: list[Any] = [None] * n  # a shard's open file (None: not created yet, or handed off)
        self.remote: set[int] = set()
        """Shards already where they go (:meth:`mark_remote`): never created nor written."""
        self.file_bytes = sum(shard.size for shard in self.layout)
        """What the shard files take on disk once written, headers included (the "bytes needed")."""
        self.written: set[str] = set()
        self.free_at_start = _free(folder)
        self._left = [0] * n  # data bytes still to write
        for slot in self.slots.values():
            self._left[slot.shard] += slot.nbytes
        self.depth = 1
        """Writes queued before :meth:`write` waits (a device's merge hands its own pinned buffers: deeper)."""
        self._queued: deque[Future[None]] = deque()  # writes not yet waited for
        self.wait_s = self.close_s = 0.0
        """Time the caller waited for a queued write, and :meth:`close` for the last writes and syncs."""
        self._syncs: dict[int, Future[None]] = {}  # shard -> its started sync (and hand-off)
        self._created: set[int] = set()
        self._durable = _FSYNC and (handoff is None or handoff.keeps_files)  # a shard only uploaded: no fsync
        self._held = 0  # shards created and not released by the hand-off
        self._room = threading.Condition()
        self._aborted = False
        self._writer: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="hubsoup-write")
        self._syncer: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="hubsoup-fsync")
        if handoff is None:
            for i in range(n):
                try:
                    self._open(i)
                except BaseException:
                    self.abort()
                    raise

    def _open(self, i: int) -> Any:  # the shard's open file
        """Shard ``i``'s file, created (header written, length set) the first time; with a hand-off, once fewer
        than :data:`SHARDS_IN_FLIGHT` complete shards wait in it."""
        if i in self._created:
            return self.handles[i]
        if self.handoff is not None:
            self._wait_for_room()
        shard = self.layout[i]
        try:
            f = open(os.path.join(self.folder, shard.file), "w+b")
            self.handles[i] = f
            self._created.add(i)
            f.write(shard.header)
            f.truncate(shard.size)
            f.flush()  # tensors go in with pwrite on the descriptor
        except BaseException as e:
            raise self._disk_full(e, shard.file)
        return f

    def _wait_for_room(self) -> None:
        with self._room:
            while True:
                self._raise_failure()
                if self._held < SHARDS_IN_FLIGHT + 1:
                    self._held += 1
                    return
                # woken by a release, a failure of the hand-off or an abort; and every so often, to see whether the
                # hand-off stopped meanwhile (a cancel: a flag or a callable, which notifies nobody)
                self._room.wait(0.25)

    def _release(self) -> None:
        with self._room:
            self._held -= 1
            self._room.notify_all()

    def _raise_failure(self) -> None:
        if self._aborted:
            raise RuntimeError("the writer was aborted")
        err = self.handoff.failure() if self.handoff is not None else None
        if err is not None:
            raise err

    def mark_remote(self, files: Collection[str]) -> None:
        """Shards whose content is already where it goes (a resumed push): never created nor written. Call it
        before the first write."""
        for i, shard in enumerate(self.layout):
            if shard.file in files:
                self.remote.add(i)
                self._left[i] = 0
                self.written.update(shard.names)

    def remote_names(self) -> set[str]:
        """The tensors of the shards :meth:`mark_remote` named: no need to compute them."""
        return {n for i in self.remote for n in self.layout[i].names}

    def _disk_full(self, e: BaseException, file: str) -> BaseException:
        """``e``, or for a full disk the one-line :class:`DiskFullError` (caused by ``e``)."""
        if not (isinstance(e, OSError) and e.errno in _DISK_FULL):
            return e

        free = f" ({self.free_at_start} were free when writing started)" if self.free_at_start is not None else ""
        err = DiskFullError(f"disk full while writing {file} in {final_path(self.folder)}: {self.disk_bytes()} bytes "
                            f"needed{free}")
        err.__cause__ = e
        return err

    def disk_bytes(self) -> int:
        """The most the shard files take on disk at once: all of them, or with a hand-off that deletes them, the
        ``SHARDS_IN_FLIGHT + 1`` largest."""
        if self.handoff is None or self.handoff.keeps_files:
            return self.file_bytes
        return sum(sorted((shard.size for shard in self.layout), reverse=True)[:SHARDS_IN_FLIGHT + 1])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        slot = self.slots[name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"tensor '{name}': got {tuple(tensor.shape)} {tensor.dtype}, planned {slot.shape} {slot.dtype}")
        if slot.shard in self.remote:  # already where it goes (an alias of a tensor computed for another shard)
            return
        if self.handoff is not None:
            self._raise_failure()  # an upload that failed stops the merge at its next tensor
        data = tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8).numpy()
        assert data.nbytes == slot.nbytes
        self.written.add(name)
        t = time.perf_counter()
        while len(self._queued) >= self.depth:  # the merge runs at most `depth` tensors ahead of the disk
            self._queued.popleft().result()  # a failed write fails here
        self.wait_s += time.perf_counter() - t
        assert self._writer is not None  # until close (_stop)
        self._queued.append(self._writer.submit(self._put, slot, data))

    def _put(self, slot: _Slot, data: np.ndarray) -> None:
        """Write one tensor's bytes at their place; the shard's last bytes start its sync (and hand-off)."""
        if slot.nbytes:
            fd = self._open(slot.shard).fileno()
            view, pos = memoryview(data), slot.start  # type: ignore[arg-type]  # numpy's stub: __buffer__ on 3.12+ only
            try:
                while view:
                    n = os.pwrite(fd, view, pos)
                    view, pos = view[n:], pos + n
            except OSError as e:
                raise self._disk_full(e, self.files[slot.shard])
            assert self._syncer is not None  # until close (_stop), which waits for every write first
            if _START_WRITEBACK is not None and self._durable:  # on the sync thread: it may wait for the disk
                self._syncer.submit(_START_WRITEBACK, fd, slot.start, slot.nbytes)
            self._left[slot.shard] -= slot.nbytes
        if self._left[slot.shard] == 0 and slot.shard not in self._syncs:
            self._open(slot.shard)  # a shard of empty tensors has its file too
            assert self._syncer is not None  # until close (_stop), which waits for every write first
            self._syncs[slot.shard] = self._syncer.submit(self._sync, slot.shard)

    def _sync(self, shard: int) -> None:
        """A complete shard: synced to disk (unless only uploaded), then handed on."""
        try:
            if self._durable:
                os.fsync(self.handles[shard].fileno())
            if self.handoff is not None:
                f, self.handles[shard] = self.handles[shard], None
                f.close()
        except OSError as e:
            raise self._disk_full(e, self.files[shard])
        if self.handoff is not None:
            done = threading.Event()

            def release() -> None:  # once, whatever the hand-off does
                if not done.is_set():
                    done.set()
                    self._release()

            self.handoff.shard_done(self.files[shard], os.path.join(self.folder, self.files[shard]), release)

    def _drain(self) -> None:
        """Wait for every queued write and started sync (their first error is raised)."""
        queued, self._queued = self._queued, deque()
        for q in queued:
            q.result()
        for f in self._syncs.values():
            f.result()

    def close(self) -> None:
        missing = set(self.slots) - self.written
        file = ""
        t = time.perf_counter()
        try:
            self._drain()
            if self.handoff is not None and not missing:  # shards with nothing to write (every tensor empty)
                for i in range(len(self.layout)):
                    if i not in self._syncs and i not in self.remote:
                        file = self.files[i]
                        self._open(i)
                        assert self._syncer is not None  # until _stop, below
                        self._syncs[i] = self._syncer.submit(self._sync, i)
                self._drain()
            for i in range(len(self.handles)):
                if i not in self._syncs and _FSYNC and self.handles[i] is not None:  # nothing (left) to write
                    file = self.files[i]
                    os.fsync(self.handles[i].fileno())
            self._stop()
            self.close_s = time.perf_counter() - t
            for f in self.handles:
                if f is not None:
                    f.close()
            self.handles = []
            if missing:
                raise RuntimeError(f"writer closed with {len(missing)} tensors unwritten, e.g. {sorted(missing)[0]}")
            if self.index and len(self.files) > 1:
                file = INDEX_NAME
                weight_map = {name: self.files[s.shard] for name, s in self.slots.items()}
                with open(os.path.join(self.folder, INDEX_NAME), "w", encoding="utf-8") as f:
                    json.dump({"metadata": {"total_size": self.total_size}, "weight_map": weight_map}, f, indent=2)
        except BaseException as e:
            self.abort()
            raise self._disk_full(e, file)

    def _stop(self) -> None:
        for pool in (self._writer, self._syncer):
            if pool is not None:
                pool.shutdown(wait=True)
        self._writer = self._syncer = None

    def abort(self) -> None:
        """Close every file; never raises (a file whose buffer cannot be flushed, e.g. on a full disk, is dropped)."""
        with self._room:  # a write waiting for room in the hand-off gives up
            self._aborted = True
            self._room.notify_all()
        try:
            self._drain()  # the threads stop touching the files before they close
        except BaseException:  # noqa: BLE001 - the caller is already failing; its error is the one to show
            pass
        self._stop()
        handles, self.handles = self.handles, []
        for f in handles:
            if f is None:
                continue
            try:
                f.close()  # closes the descriptor even when flushing the buffer fails
            except Exception:  # noqa: BLE001 - the caller is already failing; its error is the one to show
                pass
