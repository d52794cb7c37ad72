"""Hub weight files read in place: the bytes of the tensors a merge needs, by HTTP range requests, never stored.

A Hub input is pinned to a commit SHA when it is opened (:mod:`hubsoup.sources.resolve`); its safetensors files
are then read at that commit's resolve URL (``huggingface_hub.hf_hub_url(repo, file, revision=sha)``) through
huggingface_hub's own HTTP client (``get_session()``, its headers from ``build_hf_headers(token=...)``: the run's
token). The client follows redirects as huggingface_hub's downloads do, and drops the ``Authorization`` header on
a redirect to another host (httpx's rule): a Xet-backed file's resolve URL redirects to its storage, which
answers range requests too.

* :class:`RemoteFile`: one file, known from its header (one range read of :data:`HEAD` bytes, a second one for a
  larger header), each tensor's absolute byte range checked against the file's size and the tensor's shape.
  :meth:`RemoteFile.tensor` gives a tensor built over the fetched bytes (``torch`` views of a uint8 buffer:
  safetensors is little-endian, swapped on a big-endian host; a misaligned view is copied).
* :func:`fetch_into`: one range into a buffer. A connection that drops mid-range resumes from the byte where it
  stopped; a 5xx, 408 or 429 is tried again after 1, 2, 4, 8, 8 s as huggingface_hub retries its downloads (the
  count starts again whenever bytes came in); a timeout (``HUBSOUP_HUB_TIMEOUT``) is not retried: one line
  naming the repo and the file.
* :class:`Window`: the engine's read-ahead for one stream (:func:`hubsoup.engine.stream`). It is given, in the
  order the engine will visit them, the byte ranges each tensor of the pass reads; neighbouring ranges of a file
  (at most :data:`GAP` apart) are joined into spans of at most :data:`SPAN_MAX`, each fetched as parts of at most
  :data:`PART` by :data:`THREADS` background threads, while the held bytes (fetched, or being fetched, and not
  yet passed by the engine) stay within the window's budget (``MergeOptions.read_ahead``, default 256 MiB): the
  network works while the merge computes. What the engine asks for outside the window's plan is fetched there and
  then. A span is dropped once the engine has passed the last tensor that reads it.
* A file that a window fetches whole is checked against the Hub's sha256 of it (its LFS ``sha256``) as the bytes
  come in: each part is hashed once every byte before it has been, and parts that arrive early wait (at most the
  window's budget of them; past that the file is left unverified). A file read in part cannot be checked: no
  hash of a byte range is published. A mismatch fails the merge before anything is committed.

Counters on the run's :class:`~hubsoup.sources.access.Access`: ``fetched`` (bytes received) and ``needed``
(bytes asked for: each tensor once per pass, and the headers); ``max_download`` is charged as bytes arrive.

Example:
    >>> w = Window([], 1 << 20)       # a stream that reads nothing from the Hub
    >>> w.spans, w.budget
    ([], 1048576)
    >>> w.close()
"""

from __future__ import annotations

import atexit
import hashlib
import itertools
import json
import logging
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from hubsoup.errors import CorruptCheckpointError, HubsoupError
from hubsoup.hubclient import hub_timeout, transient
from hubsoup.sources.checkpoint import ST_DTYPES

log = logging.getLogger(__name__)

DEFAULT_READ_AHEAD = 256 << 20
"""Bytes a stream may hold ahead of the merge when ``read_ahead`` is not given."""
HEAD = 32 << 10
"""Bytes of a file's first read: its 8-byte length and header (a larger header takes a second read)."""
GAP = 64 << 10
"""Two ranges of a file at most this far apart are fetched in one request (the gap's bytes are fetched too)."""
SPAN_MAX = 64 << 20
"""Largest joined request (a tensor larger than this is a span of its own); at most a quarter of the budget."""
PART = 8 << 20
"""Bytes per range request of a span: a span's parts are fetched in parallel, each resumed on its own."""
THREADS = 8
"""Background fetches per window, as many as huggingface_hub's downloads use: one connection is seldom the whole of a
link (latency, per-connection limits; measured on the test server under load, 4 reached 85 % of its link, 8 97 %)."""
HEADER_LIMIT = 100 * 1024 * 1024
"""safetensors' own limit on a header."""
KEY_PREFIX = "hf://"

EXIT_WAIT = 5.0
"""Seconds the process's exit waits, in all, for the fetching threads of windows still open (see :class:`Window`)."""

_sleep = time.sleep
_SERIAL = itertools.count()
_FILES: "weakref.WeakValueDictionary[str, RemoteFile]" = weakref.WeakValueDictionary()
_ST_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


def is_key(path: str) -> bool:
    """Whether ``path`` (a byte range's first element, :meth:`Checkpoint.byte_ranges`) names a Hub file read in
    place rather than a file on disk."""
    return isinstance(path, str) and path.startswith(KEY_PREFIX)


def lookup(key: str) -> "RemoteFile | None":
    """The open :class:`RemoteFile` of ``key`` (None when it is no longer open)."""
    return _FILES.get(key)


def any_open() -> bool:
    """Whether some checkpoint of this process reads a Hub file in place (else a stream needs no window)."""
    return len(_FILES) > 0


class _Stopped(Exception):
    """A window was closed while one of its fetches ran."""


@dataclass(eq=False)
class RemoteFile:
    """One safetensors file of a Hub repo at a pinned commit, read by range requests (see the module doc)."""

    repo_id: str
    sha: str
    name: str
    size: int
    url: str
    headers: dict[str, str] = field(repr=False)
    """The requests' headers (``build_hf_headers``: the run's token). Never shown."""
    who: str = "input"
    """How errors name the input (``input 'org/name'``)."""
    fail: Callable[[BaseException], BaseException] = field(default=lambda e: e, repr=False)
    """Maps a failed request to the one-line error the run raises (it names the repo and this file)."""
    access: Any = field(default=None, repr=False)
    """The run's :class:`~hubsoup.sources.access.Access` (counters, ``max_download``); None: nothing counted."""
    sha256: str | None = None
    """The Hub's sha256 of the whole file (its LFS oid), when the Hub gave one."""
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = field(default_factory=dict, repr=False)
    """``{name: (safetensors dtype, shape, absolute offset, length)}``."""
    data_start: int = 0
    prefix: bytes = field(default=b"", repr=False)
    """The file's first bytes, as the header read got them (its header and maybe some data)."""
    sleep: Callable[[float], None] | None = field(default=None, repr=False)
    """How a retry waits (None: ``time.sleep``); :mod:`hubsoup.sources.resolve` passes its own, which tests replace."""
    _windows: dict[int, "Window"] = field(default_factory=dict, repr=False)
    _uid: int = field(default_factory=lambda: next(_SERIAL), repr=False)

    @property
    def key(self) -> str:
        """What :meth:`Checkpoint.byte_ranges` gives in place of a path: this object's own (two runs reading one
        file, each with its token and counters, never share a window)."""
        return f"{KEY_PREFIX}{self.repo_id}@{self.sha}/{self.name}#{self._uid}"

    @property
    def label(self) -> str:
        return f"{self.repo_id}@{self.sha[:12]}/{self.name}"

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in its stored dtype and shape, from this thread's window or fetched now."""
        dtype, shape, off, n = self.tensors[name]
        buf: torch.Tensor | None
        if self.in_prefix(off, n):  # came with the header read
            buf = torch.frombuffer(bytearray(self.prefix[off:off + n]), dtype=torch.uint8) if n else torch.empty(0)
            if self.access is not None:
                self.access.asked(n)
            return as_tensor(buf, dtype, shape)
        window = self._windows.get(threading.get_ident())
        buf = window.take(self, off, n) if window is not None else None
        if buf is None:
            buf = self.read(off, n)
        return as_tensor(buf, dtype, shape)

    def in_prefix(self, off: int, n: int) -> bool:
        """Whether bytes ``[off, off + n)`` came with the header read (nothing more to fetch)."""
        return off + n <= len(self.prefix)

    def read(self, off: int, n: int) -> torch.Tensor:
        """Bytes ``[off, off + n)`` now, in a new uint8 tensor (counted as needed; what the header read brought
        is not fetched again)."""
        buf = torch.empty(n, dtype=torch.uint8)
        lo = self.fetch_from(off, n)
        if lo > off:
            buf[:lo - off] = torch.frombuffer(bytearray(self.prefix[off:lo]), dtype=torch.uint8)
        if off + n > lo:
            fetch_into(self, lo, buf[lo - off:])
        if self.access is not None:
            self.access.asked(n)
        return buf

    def fetch_from(self, off: int, n: int) -> int:
        """Where a fetch of ``[off, off + n)`` starts: past the bytes the header read brought."""
        return min(max(off, len(self.prefix)), off + n)


def as_tensor(buf: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor a safetensors entry's bytes ``buf`` (uint8) hold: a view when aligned, else a copy."""
    want = ST_DTYPES[dtype]
    size = _ST_SIZES[dtype]
    if buf.numel() == 0:
        return torch.empty(shape, dtype=want)
    if size > 1 and (buf.storage_offset() % size or buf.data_ptr() % size):
        buf = buf.clone()  # torch views need elements on their own alignment
    if size > 1 and sys.byteorder != "little":  # safetensors stores little-endian
        buf = buf.view(-1, size).flip(1).reshape(-1)
    return buf.view(want).view(shape)


# --- opening a file: its header ----------------------------------------------------------------------------------

def open_file(repo_id: str, sha: str, name: str, *, size: int | None, token: Any, who: str,
              fail: Callable[[BaseException], BaseException], access: Any = None,
              sha256: str | None = None, sleep: Callable[[float], None] | None = None) -> RemoteFile:
    """The :class:`RemoteFile` of ``repo_id@sha/name``, its header read now (one or two range requests).

    Raises :class:`~hubsoup.errors.CorruptCheckpointError` for a header that is not safetensors' (too long, not
    JSON, a tensor outside the file, a length that does not match its shape and dtype).
    """
    from huggingface_hub import hf_hub_url  # lazy: keeps hubsoup --help free of huggingface_hub
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # hf_hub's stub: not re-exported; lazy

    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"  # the bytes as stored: ranges are offsets into them
    rf = RemoteFile(repo_id, sha, name, int(size or 0), hf_hub_url(repo_id, name, revision=sha), headers, who,
                    fail, access, sha256, sleep=sleep)
    first = min(HEAD, rf.size) if rf.size else HEAD
    buf = torch.empty(first, dtype=torch.uint8)
    total = fetch_into(rf, 0, buf)
    if not rf.size:
        rf.size = int(total or first)
    bad = f"{who}: {name} is not a valid safetensors file"
    if rf.size < 8:
        raise CorruptCheckpointError(f"{bad} ({rf.size} bytes)")
    head = bytes(buf.numpy())
    n = int.from_bytes(head[:8], "little")
    if n <= 0 or n > HEADER_LIMIT or 8 + n > rf.size:
        raise CorruptCheckpointError(f"{bad} (its header length {n} does not fit in its {rf.size} bytes)")
    if 8 + n > len(head):
        rest = torch.empty(8 + n - len(head), dtype=torch.uint8)
        fetch_into(rf, len(head), rest)
        head += bytes(rest.numpy())
    rf.prefix, rf.data_start = head, 8 + n
    if access is not None:
        access.asked(8 + n)
    try:
        header = json.loads(head[8:8 + n])
    except ValueError as e:
        raise CorruptCheckpointError(f"{bad} (its header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{bad} (its header is not a JSON object)")
    data_len = rf.size - rf.data_start
    for tname, meta in header.items():
        if tname == "__metadata__":
            continue
        if not isinstance(meta, dict) or not isinstance(meta.get("dtype"), str):
            raise CorruptCheckpointError(f"{bad} (tensor {tname!r}: no dtype)")
        dtype, shape, offsets = meta["dtype"], meta.get("shape"), meta.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise CorruptCheckpointError(f"{bad} (tensor {tname!r}: shape {shape!r})")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):
            raise CorruptCheckpointError(f"{bad} (tensor {tname!r}: its bytes {offsets!r} lie outside the file)")
        numel = 1
        for d in shape:
            numel *= d
        if dtype in _ST_SIZES and numel * _ST_SIZES[dtype] != offsets[1] - offsets[0]:
            raise CorruptCheckpointError(f"{bad} (tensor {tname!r}: {offsets[1] - offsets[0]} bytes for shape "
                                         f"{shape} of {dtype})")
        rf.tensors[tname] = (dtype, tuple(shape), rf.data_start + offsets[0], offsets[1] - offsets[0])
    _FILES[rf.key] = rf
    if len(head) >= rf.size and rf.sha256 and access is not None:  # the header read brought the whole file
        v = _Verifier(rf, 0)
        if v.error is not None:
            raise v.error
        with access._lock:
            access.verified.append(rf.label)
    return rf


# --- one range --------------------------------------------------------------------------------------------------

def fetch_into(rf: RemoteFile, start: int, out: torch.Tensor | np.ndarray, stop: threading.Event | None = None,
               active: set[Any] | None = None, tries: int = 6) -> int | None:
    """Bytes ``[start, start + len(out))`` of ``rf`` into ``out`` (uint8, contiguous: a tensor, or a numpy array
    as the background fetches use: they never touch torch, see :class:`Window`); returns the file's size as the
    server gave it (``Content-Range``). See the module doc for the retries; ``stop`` ends it early
    (:class:`_Stopped`); ``active`` holds the open response, so a closing window may close it."""
    from huggingface_hub import get_session  # lazy: keeps hubsoup --help free of huggingface_hub
    from huggingface_hub.utils import hf_raise_for_status  # type: ignore[attr-defined]  # hf_hub's stub: not re-exported; lazy

    arr = out.numpy() if isinstance(out, torch.Tensor) else out
    n = arr.size
    view = memoryview(arr) if n else memoryview(b"")  # type: ignore[arg-type]  # numpy's stub: __buffer__ on 3.12+ only
    pos, failures, wait, total, failed_at = 0, 0, 1.0, None, -1
    while pos < n:
        if stop is not None and stop.is_set():
            raise _Stopped()
        try:
            headers = {**rf.headers, "Range": f"bytes={start + pos}-{start + n - 1}"}
            with get_session().stream("GET", rf.url, headers=headers, timeout=hub_timeout()) as r:
                if active is not None:
                    active.add(r)
                try:
                    if r.status_code >= 400:
                        r.read()  # the error's body, for its message
                        hf_raise_for_status(r)
                    skip = 0
                    if r.status_code == 206:
                        got = r.headers.get("Content-Range", "")
                        if got.startswith("bytes ") and "/" in got:
                            first, _, whole = got[6:].partition("/")
                            total = int(whole) if whole.isdigit() else total
                            if int(first.split("-")[0]) != start + pos:
                                raise CorruptCheckpointError(f"{rf.who}: the Hub answered bytes {got} of {rf.name} "
                                                             f"for bytes {start + pos}-")
                    elif r.status_code == 200:  # the range was ignored: the whole file comes
                        skip, total = start + pos, int(r.headers.get("Content-Length") or 0) or total
                    else:
                        raise CorruptCheckpointError(f"{rf.who}: the Hub answered {r.status_code} to a range read "
                                                     f"of {rf.name}")
                    before = pos
                    for chunk in r.iter_raw():  # as the connection gives them: a drop loses no byte received
                        if stop is not None and stop.is_set():
                            raise _Stopped()
                        if rf.access is not None:
                            rf.access.spend(len(chunk), rf.who)
                        if skip:
                            dropped = min(skip, len(chunk))
                            skip -= dropped
                            chunk = chunk[dropped:]
                        take = min(len(chunk), n - pos)
                        view[pos:pos + take] = chunk[:take]
                        pos += take
                        if pos >= n:
                            break
                    if pos < n:  # the body ended early: a dropped connection, resumed below
                        raise _Short(f"{rf.name}: the connection ended after {pos - before} bytes")
                finally:
                    if active is not None:
                        active.discard(r)
        except (_Stopped, HubsoupError):
            raise
        except Exception as e:  # noqa: BLE001 - transient answers are tried again, the rest is one line
            if stop is not None and stop.is_set():
                raise _Stopped() from None
            if pos > failed_at:  # bytes came in since the last failure: the count starts again
                failures, wait = 0, 1.0
            failures, failed_at = failures + 1, pos
            if not (isinstance(e, _Short) or transient(e)) or failures >= tries:
                raise rf.fail(e) from e
            log.debug("range read of %s: %s; again from byte %d in %.0f s", rf.label, type(e).__name__,
                      start + pos, wait)
            (rf.sleep or _sleep)(wait)
            if stop is not None and stop.is_set():
                raise _Stopped() from None
            wait = min(wait * 2, 8.0)
    return total


class _Short(Exception):
    """A response body that ended before the range did (the connection dropped)."""


def measure_bandwidth(files: Sequence[RemoteFile], most: int = 8 << 20, *, threads: int = THREADS,
                      piece: int = 1 << 20) -> tuple[int, float]:
    """``(bytes, seconds)`` of reading up to ``most`` bytes of ``files``' tensor data, in pieces of ``piece`` over
    ``threads`` connections as a merge's read-ahead does (``hubsoup plan --push``'s measured bandwidth). The bytes
    are counted by the run (``max_download``)."""
    pieces: list[tuple[RemoteFile, int, int]] = []
    left = most
    for rf in sorted(files, key=lambda f: -f.size):
        a = max(rf.data_start, len(rf.prefix))
        while a < rf.size and left > 0:
            n = min(piece, rf.size - a, left)
            pieces.append((rf, a, n))
            a, left = a + n, left - n
    if not pieces:
        return 0, 0.0
    todo: queue.Queue[tuple[RemoteFile, int, int]] = queue.Queue()
    for p in pieces:
        todo.put(p)
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            try:
                rf, a, n = todo.get_nowait()
            except queue.Empty:
                return
            try:
                fetch_into(rf, a, np.empty(n, dtype=np.uint8))
            except BaseException as e:  # noqa: BLE001 - the first is raised below
                errors.append(e)
                return

    t0 = time.perf_counter()
    workers = [threading.Thread(target=work, name="hubsoup-measure", daemon=True)
               for _ in range(min(threads, len(pieces)))]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    if errors:
        raise errors[0]
    return sum(n for _, _, n in pieces), time.perf_counter() - t0


# --- the read-ahead window ---------------------------------------------------------------------------------------

@dataclass(eq=False)
class _Part:
    span: "_Span"
    start: int
    end: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


@dataclass(eq=False)
class _Span:
    rf: RemoteFile
    start: int
    end: int
    first: int
    last: int
    parts: list[_Part] = field(default_factory=list)
    buf: np.ndarray | None = None
    """Its bytes: a numpy array, which the fetching threads fill (the engine's thread makes tensors of them)."""
    admitted: bool = False
    freed: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start


class _Verifier:
    """sha256 of a file fetched whole, updated in file order as its parts complete (see the module doc)."""

    def __init__(self, rf: RemoteFile, cap: int):
        self.rf, self.cap = rf, cap
        self.h = hashlib.sha256()
        self.pos = 0
        self.pending: list[tuple[int, Any]] = []
        self.held = 0
        self.why: str | None = None  # set: left unverified, and why
        self.error: CorruptCheckpointError | None = None
        self.lock = threading.Lock()
        self.add(0, memoryview(rf.prefix))

    @property
    def complete(self) -> bool:
        return self.pos >= self.rf.size

    def add(self, start: int, data: Any) -> None:
        with self.lock:
            if self.why is not None or self.complete:
                return
            self.pending.append((start, data))
            self.held += len(data)
            moved = True
            while moved:
                moved = False
                for i, (s, d) in enumerate(self.pending):
                    e = s + len(d)
                    if s <= self.pos < e:
                        self.h.update(d[self.pos - s:])
                        self.pos = e
                    if e <= self.pos:
                        self.held -= len(d)
                        del self.pending[i]
                        moved = True
                        break
            if self.complete:
                got = self.h.hexdigest()
                if got != self.rf.sha256:
                    self.error = CorruptCheckpointError(
                        f"{self.rf.who}: the bytes read of {self.rf.name} do not match the Hub's sha256 of it "
                        f"({got[:12]} read, {str(self.rf.sha256)[:12]} expected): the transfer was corrupted; "
                        "nothing was committed, run again")
                self.pending, self.held = [], 0
            elif self.held > self.cap:
                self.why = "fetched too far out of order to hash within the read-ahead budget"
                self.pending, self.held = [], 0


class Window:
    """The read-ahead of one stream over Hub files read in place (see the module doc).

    ``reads[k]``: the ``(RemoteFile, offset, length)`` ranges the stream's k-th tensor reads, in the order the
    engine visits them; ``budget``: bytes held at most (a span the engine is at is fetched whatever it holds);
    ``check``: called while waiting for bytes (the run's cancel check). The creating thread's
    :meth:`RemoteFile.tensor` reads go through it; :meth:`at` moves it, :meth:`finish` checks what it verified,
    :meth:`close` stops it.

    Its threads are daemons that never touch torch (their buffers are numpy arrays; the engine's thread makes the
    tensors): a daemon thread that the interpreter's exit finds inside torch's C++ code (a tensor freed as its
    frame ends) is ended by ``pthread_exit`` there, and C++ then aborts the process ("terminate called without an
    active exception") after a Ctrl-C's one line. The exit also waits for them (:data:`EXIT_WAIT`).
    """

    def __init__(self, reads: Sequence[Sequence[tuple[RemoteFile, int, int]]], budget: int, *,
                 threads: int = THREADS, check: Callable[[], None] | None = None, groups: Sequence[int] = ()):
        self.budget = max(1, int(budget))
        self.check = check
        self.span_max = max(64 << 10, min(SPAN_MAX, self.budget // 4))
        self.part = min(PART, self.span_max)
        self.spans: list[_Span] = []
        self._where: dict[tuple[str, int, int], _Span] = {}
        open_: dict[str, _Span] = {}
        # a group's ranges (a block's tensors: ``groups`` are the indices where blocks start) are joined in file
        # order, whatever order the engine reads them in: a file holds a layer's tensors by name, not in forward order
        starts = sorted({0, *groups, len(reads)})
        for a, b in zip(starts, starts[1:]):
            group = sorted(((rf, off, n, k) for k in range(a, b) for rf, off, n in reads[k]),
                           key=lambda r: (r[0].key, r[1], r[3]))
            for rf, off, n, k in group:
                if n <= 0:
                    continue
                known = self._where.get((rf.key, off, n))
                if known is not None:  # read again later in the pass (a tied tensor): kept until then
                    known.first, known.last = min(known.first, k), max(known.last, k)
                    continue
                lo = rf.fetch_from(off, n)  # the header read's bytes are not fetched again
                if lo >= off + n:
                    continue
                sp = open_.get(rf.key)
                if sp is not None and sp.end <= lo <= sp.end + GAP and off + n - sp.start <= self.span_max:
                    sp.end, sp.first, sp.last = off + n, min(sp.first, k), max(sp.last, k)
                else:
                    sp = _Span(rf, lo, off + n, k, k)
                    self.spans.append(sp)
                    open_[rf.key] = sp
                self._where[(rf.key, off, n)] = sp
        self.spans.sort(key=lambda sp: sp.first)  # fetched in the order the engine first needs them
        for sp in self.spans:
            sp.parts = [_Part(sp, a, min(a + self.part, sp.end)) for a in range(sp.start, sp.end, self.part)]
        self._asked: set[tuple[str, int, int]] = set()
        self._next = 0
        self._held = 0
        self.peak = 0
        """The most bytes held at once (fetched or being fetched, not yet passed by the engine)."""
        self._cursor = -1
        self._admitted: list[_Span] = []
        self._lock = threading.RLock()
        self._queue: queue.PriorityQueue[tuple[int, int, _Part | None]] = queue.PriorityQueue()
        self._seq = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._n_threads = max(1, threads)
        self._active: set[Any] = set()  # open HTTP responses
        self._owner = threading.get_ident()
        _WINDOWS.add(self)
        files = {sp.rf.key: sp.rf for sp in self.spans}
        self.files = list(files.values())
        self.verifiers: dict[str, _Verifier] = {}
        for key, rf in files.items():
            rf._windows[self._owner] = self
            if rf.sha256 and self._covers_whole(rf):
                self.verifiers[key] = _Verifier(rf, self.budget)
        with self._lock:
            self._admit()

    # --- planning ---------------------------------------------------------------------------------------------
    def _covers_whole(self, rf: RemoteFile) -> bool:
        """Whether the planned spans and the header read cover every byte of ``rf``."""
        pos = len(rf.prefix)
        for sp in sorted((s for s in self.spans if s.rf is rf), key=lambda s: s.start):
            if sp.start > pos:
                return False
            pos = max(pos, sp.end)
        return pos >= rf.size

    def _admit(self, force: _Span | None = None) -> None:
        """Start fetching spans in order while the budget allows (and ``force`` whatever it holds)."""
        while self._next < len(self.spans):
            sp = self.spans[self._next]
            if sp.admitted or sp.last < self._cursor:  # admitted out of order, or passed: nothing to do
                self._next += 1
                continue
            if sp.first > self._cursor and self._held and self._held + sp.size > self.budget:
                break
            self._start(sp, 1)
            self._next += 1
        if force is not None and not force.admitted:
            self._start(force, 0)

    def _start(self, sp: _Span, priority: int) -> None:
        sp.admitted = True
        sp.buf = np.empty(sp.size, dtype=np.uint8)
        self._held += sp.size
        self.peak = max(self.peak, self._held)
        self._admitted.append(sp)
        for p in sp.parts:
            self._seq += 1
            self._queue.put((priority, self._seq, p))
        while len(self._threads) < self._n_threads:  # started with the first span: a stream reading nothing starts none
            t = threading.Thread(target=self._work, name="hubsoup-fetch", daemon=True)
            self._threads.append(t)
            t.start()

    # --- the engine's side ------------------------------------------------------------------------------------
    def at(self, k: int) -> None:
        """The engine is at tensor ``k``: spans no later tensor reads are dropped, more are fetched."""
        with self._lock:
            self._cursor = k
            keep = []
            for sp in self._admitted:
                if sp.last < k:
                    sp.freed, sp.buf = True, None
                    self._held -= sp.size
                else:
                    keep.append(sp)
            self._admitted = keep
            self._admit()

    def take(self, rf: RemoteFile, off: int, n: int) -> torch.Tensor | None:
        """Bytes ``[off, off + n)`` of ``rf`` (a uint8 view) once fetched; None when not in the plan (or
        already dropped): the caller reads them itself."""
        sp = self._where.get((rf.key, off, n))
        if sp is None:
            return None
        verifier = self.verifiers.get(rf.key)
        if verifier is not None and verifier.error is not None:
            raise verifier.error
        with self._lock:
            if sp.freed:
                return None
            if not sp.admitted:
                self._admit(force=sp)
            buf = sp.buf
        assert buf is not None
        lo = rf.fetch_from(off, n)
        for p in sp.parts:
            if p.end <= lo or p.start >= off + n:
                continue
            while not p.done.wait(0.25):
                if self.check is not None:
                    self.check()
            if p.error is not None:
                raise p.error
        if rf.access is not None and (rf.key, off, n) not in self._asked:  # each range once per pass
            self._asked.add((rf.key, off, n))
            rf.access.asked(n)
        if lo > off:  # its first bytes came with the header read
            out = torch.empty(n, dtype=torch.uint8)
            out[:lo - off] = torch.frombuffer(bytearray(rf.prefix[off:lo]), dtype=torch.uint8)
            out[lo - off:] = torch.from_numpy(buf[lo - sp.start:off + n - sp.start])
            return out
        return torch.from_numpy(buf[off - sp.start:off - sp.start + n])

    def finish(self) -> None:
        """The stream ended: raise if a file fetched whole did not match its sha256; record what was checked."""
        v: _Verifier | None
        for key, v in self.verifiers.items():
            if v.error is not None:
                raise v.error
        for rf in self.files:
            acc = rf.access
            if acc is None:
                continue
            v = self.verifiers.get(rf.key)
            with acc._lock:
                if v is not None and v.complete:
                    acc.verified.append(rf.label)
                else:
                    why = (v.why or "not every byte was fetched") if v is not None else (
                        "the Hub gave no sha256 of it" if not rf.sha256 else "read in part (only the tensors needed)")
                    acc.unverified.append((rf.label, why))

    def close(self) -> None:
        """Stop the fetches (between chunks; open responses closed) and forget the buffers. Idempotent; never
        waits on a connection."""
        self._stop.set()
        for rf in self.files:
            if rf._windows.get(self._owner) is self:
                del rf._windows[self._owner]
        for r in list(self._active):
            try:
                r.close()
            except Exception:  # noqa: BLE001 - closing is best effort: the thread also stops between chunks
                pass
        for _ in self._threads:
            self._queue.put((-1, 0, None))
        with self._lock:
            for sp in self._admitted:
                sp.freed, sp.buf = True, None
            self._admitted, self._held = [], 0

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- the fetching threads ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            _, _, part = self._queue.get()
            if part is None or self._stop.is_set():
                return
            sp = part.span
            buf = sp.buf
            try:
                if sp.freed or buf is None:
                    continue
                piece = buf[part.start - sp.start:part.end - sp.start]
                fetch_into(sp.rf, part.start, piece, self._stop, self._active)
                v = self.verifiers.get(sp.rf.key)
                if v is not None:
                    v.add(part.start, memoryview(piece))  # type: ignore[arg-type]  # numpy's stub: __buffer__ on 3.12+
            except _Stopped:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the engine when it takes these bytes
                part.error = e
            finally:
                part.done.set()


_WINDOWS: "weakref.WeakSet[Window]" = weakref.WeakSet()


def _stop_windows() -> None:
    """At the process's exit: stop every window still open and wait for its threads (at most :data:`EXIT_WAIT`
    seconds in all: one blocked on a silent connection is left to the interpreter)."""
    deadline = time.monotonic() + EXIT_WAIT
    windows = list(_WINDOWS)
    for w in windows:
        w.close()
    for w in windows:
        for t in w._threads:
            t.join(max(0.0, deadline - time.monotonic()))


atexit.register(_stop_windows)


__all__ = ["RemoteFile", "Window", "open_file", "fetch_into", "as_tensor", "is_key", "lookup", "any_open",
           "measure_bandwidth",
           "DEFAULT_READ_AHEAD"]
