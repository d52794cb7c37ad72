"""Progress reports and cancellation for apps (a Gradio Space, a notebook, a job runner).

Every entry point that writes a model (:func:`hubsoup.merge`, ``push_to_hub``, the continual
workflow, search, sweeps, soups) takes ``progress=`` and ``cancel=`` (they are
:class:`~hubsoup.options.MergeOptions` fields, not hashed: they never change the result):

* ``progress(done, stage, message)``: ``done`` is a float from 0.0 to 1.0, never decreasing,
  exactly 1.0 once the run succeeded; ``stage`` one of :data:`STAGES` (only those that happen);
  ``message`` a short human-readable line (``"merging (ties): block 3/12"``). It is called at
  least once per stage and once per block of every pass over the model. With ``progress``
  given, hubsoup prints nothing (no progress bars, neither its own nor huggingface_hub's).
* ``cancel``: a :class:`threading.Event` or a callable returning True to stop. It is checked
  before every tensor, between downloaded files (and chunks) and before the push's commit; a
  cancelled run raises :class:`~hubsoup.errors.MergeCancelled`, leaves no output, no temporary
  folder and no lock file, and uploads nothing.

One :class:`Monitor` per run carries both. The caller lays out the stages with their weights
(:meth:`Monitor.plan`) and enters them (:meth:`Monitor.stage`); the engine, which knows no
stage by name, reports each pass over the model as a *segment* of the current stage
(:meth:`Monitor.segment`, :meth:`Monitor.step`) and calls :meth:`Monitor.check` per tensor.

Example:
    >>> import threading
    >>> from hubsoup.progress import Monitor
    >>> seen = []
    >>> mon = Monitor(lambda d, s, m: seen.append((round(d, 2), s)), threading.Event())
    >>> mon.plan({"statistics": 1, "merge": 3})
    >>> mon.stage("merge"); mon.segment(2); mon.step(); mon.step(); mon.finish()
    >>> seen
    [(0.25, 'merge'), (0.62, 'merge'), (1.0, 'merge'), (1.0, 'merge')]
"""

from __future__ import annotations

import io
import threading
from typing import Any, Callable, Iterator, Literal, Protocol, Sequence, Union, cast

from hubsoup.errors import MergeCancelled, ParameterError

STAGES = ("download", "statistics", "merge", "eval", "push")
"""The stages a run may report, in the order they happen."""

class Progress(Protocol):
    """``progress(done, stage, message)``: ``done`` in [0, 1], never decreasing; ``stage`` one of :data:`STAGES`."""

    def __call__(self, done: float, stage: str, message: str, /) -> object: ...


class CancelEvent(Protocol):
    """An event whose ``is_set()`` says cancel (:class:`threading.Event`, ``multiprocessing.Event``, ...)."""

    def is_set(self) -> bool: ...


Cancel = Union[CancelEvent, Callable[[], bool]]
"""A :class:`CancelEvent` (set: cancel) or a zero-argument callable (True: cancel)."""


def _cancel_check(cancel: Cancel | None) -> Callable[[], bool] | None:
    if cancel is None:
        return None
    is_set = getattr(cancel, "is_set", None)  # threading.Event, multiprocessing.Event, asyncio.Event
    if callable(is_set):
        return cast(Callable[[], bool], is_set)  # a CancelEvent's is_set()
    if callable(cancel):
        return cancel

    raise ParameterError(f"cancel must be a threading.Event or a callable returning bool, got {type(cancel).__name__}")


class Monitor:
    """One run's progress reports and cancellation check (thread-safe; see the module's docstring).

    A Monitor without ``progress`` and ``cancel`` does nothing, cheaply: the engine always has one.
    """

    def __init__(self, progress: Progress | None = None, cancel: Cancel | None = None):
        if progress is not None and not callable(progress):
            raise ParameterError(f"progress must be a callable(done, stage, message), got {type(progress).__name__}")
        self._progress = progress
        self._cancelled = _cancel_check(cancel)
        self._lock = threading.RLock()
        self.done = 0.0
        """The last fraction reported."""
        self.stage_name = ""
        self.stages_seen: list[str] = []
        self._spans: dict[str, tuple[float, float]] = {}
        self._stage = (0.0, 0.0)
        self._parts, self._part = 1, -1
        self._seg, self._seg_total, self._seg_n = (0.0, 0.0), 1, 0
        self._expected: dict[str, int] = {}

    @property
    def reporting(self) -> bool:
        """Whether a progress callback was given (the run then prints nothing)."""
        return self._progress is not None

    @property
    def active(self) -> bool:
        return self._progress is not None or self._cancelled is not None

    # --- cancellation ------------------------------------------------------------------------------

    def cancelled(self) -> bool:
        return self._cancelled is not None and bool(self._cancelled())

    def check(self, where: str = "") -> None:
        """Raise :class:`MergeCancelled` if the run was cancelled."""
        if self._cancelled is not None and self._cancelled():
            raise MergeCancelled(f"cancelled{' ' + where if where else ''}"
                                 f"{' during ' + self.stage_name if self.stage_name else ''}; nothing was written")

    # --- progress ----------------------------------------------------------------------------------

    def plan(self, weights: dict[str, float]) -> None:
        """Lay the stages out on [0, 1] in the given order, each in proportion to its weight."""
        total = sum(w for w in weights.values() if w > 0) or 1.0
        lo = 0.0
        with self._lock:
            self._spans = {}
            for name, w in weights.items():
                hi = lo + max(w, 0.0) / total
                self._spans[name] = (lo, hi)
                lo = hi
            if self._spans:  # the last stage ends at exactly 1.0, whatever the rounding
                last = list(self._spans)[-1]
                self._spans[last] = (self._spans[last][0], 1.0)

    def stage(self, name: str, message: str = "", *, parts: int = 1) -> None:
        """Enter stage ``name`` (reported at once); its span is split into ``parts`` equal segments.

        A stage that was not planned has no span: it is reported, but ``done`` does not move.
        """
        with self._lock:
            lo, hi = self._spans.get(name, (self.done, self.done))
            lo = max(lo, self.done)
            self.stage_name = name
            if name not in self.stages_seen:
                self.stages_seen.append(name)
            self._stage = (lo, max(hi, lo))
            self._parts, self._part = max(int(parts), 1), -1
            self._seg, self._seg_total, self._seg_n = (lo, lo), 1, 0
            self._report(lo, message or name)

    def expect(self, name: str, parts: int) -> None:
        """Stage ``name``, when :meth:`enter`-ed, will have ``parts`` segments."""
        with self._lock:
            self._expected[name] = parts

    def enter(self, name: str, message: str = "") -> None:
        """:meth:`stage` ``name`` unless it is the current stage (for stages entered lazily, e.g. the download)."""
        with self._lock:
            if self.stage_name != name:
                self.stage(name, message, parts=self._expected.get(name, 1))

    def segment(self, total: int, message: str = "") -> None:
        """Start the next segment of the current stage: ``total`` :meth:`step` calls will fill it."""
        with self._lock:
            self._part += 1
            lo, hi = self._stage
            if self._part < self._parts:
                a = lo + (hi - lo) * self._part / self._parts
                b = lo + (hi - lo) * (self._part + 1) / self._parts
            else:  # more segments than announced: they report, without moving
                a = b = self.done
            a = max(a, self.done)
            self._seg, self._seg_total, self._seg_n = (a, max(a, b)), max(int(total), 1), 0
            if message:
                self._report(a, message)

    def step(self, message: str = "", n: int = 1) -> None:
        """``n`` more units of the current segment done."""
        with self._lock:
            self._seg_n = min(self._seg_n + n, self._seg_total)
            a, b = self._seg
            self._report(a + (b - a) * self._seg_n / self._seg_total, message)

    def finish(self, message: str = "done") -> None:
        """The run succeeded: report exactly 1.0."""
        with self._lock:
            self._report(1.0, message, exact=True)

    def child(self, lo: float, hi: float) -> Progress:
        """A progress callback for a nested run (a search's merge) that maps its [0, 1] into [lo, hi]."""
        def report(done: float, stage: str, message: str) -> None:
            with self._lock:
                self.stage_name = stage
                if stage not in self.stages_seen:
                    self.stages_seen.append(stage)
                self._report(lo + (hi - lo) * min(max(done, 0.0), 1.0), message)

        return report

    def _report(self, done: float, message: str, exact: bool = False) -> None:
        done = 1.0 if exact else min(max(done, self.done), 1.0)
        self.done = done
        if self._progress is not None:
            self._progress(done, self.stage_name, message)


def silent_tqdm(monitor: Monitor) -> type[Any]:
    """A ``tqdm_class`` for huggingface_hub's downloads that shows nothing, checks ``cancel`` on every
    update (each chunk and each finished file) and reports finished files as steps of ``monitor``.

    Per call: only the download it is passed to is silenced (no process-wide switch). Not a tqdm
    subclass (huggingface_hub accepts any class that behaves like one), so nothing is ever rendered.
    """

    class _Silent:
        format_dict: dict[str, Any] = {}

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.n = kwargs.get("initial") or 0
            self.total = kwargs.get("total")
            self.desc = str(kwargs.get("desc") or "")
            # the "Fetching N files" bar counts files: its updates are the download's steps
            self._files = self.desc.startswith("Fetching")
            if self._files:
                monitor.segment(int(self.total or 1), self.desc.lower())

        def update(self, n: int | None = 1) -> None:
            monitor.check("while downloading")
            self.n += n or 0
            if self._files and n:
                monitor.step("downloaded a file", int(n))

        def __enter__(self) -> _Silent:
            return self

        def __exit__(self, *exc: object) -> Literal[False]:
            return False

        def __iter__(self) -> Iterator[Any]:
            return iter(())

        def __getattr__(self, name: str) -> Callable[..., None]:  # refresh, close, set_description, set_postfix_str, ...: nothing to show
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    return _Silent


class ReadReport(io.BufferedIOBase):
    """A file object as an upload reads it: each read checks ``cancel`` and reports, as steps of ``monitor``'s
    segment, the bytes newly reached (the furthest point read: a retried upload is not counted twice)."""

    def __init__(self, raw: io.BufferedIOBase, monitor: Monitor, name: str):
        super().__init__()
        self._raw, self._monitor, self._name, self.reached = raw, monitor, name, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int | None = -1) -> bytes:
        self._monitor.check("during the upload")
        data = self._raw.read(-1 if n is None else n)
        pos = self._raw.tell()
        if pos > self.reached:
            self._monitor.step(f"uploading {self._name}", pos - self.reached)
            self.reached = pos
        return data

    def read1(self, n: int = -1) -> bytes:
        return self.read(n)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()


def upload_steps(monitor: Monitor, operations: Sequence[Any], upload: Callable[[Any], object], *,
                 segment: bool = True) -> None:
    """Upload each of ``operations`` (huggingface_hub ``CommitOperationAdd``) with ``upload(op)``, as one segment of
    the push counted in bytes (each file by its size, the commit that follows as one more unit): a model's one
    big shard moves the bar while it goes up, instead of holding it until it is done. A file given as an open file
    object is read through :class:`ReadReport`, so a cancel is noticed between two chunks of it too.
    ``segment=False``: the caller started the segment (a push whose files go up in several calls)."""
    sizes = [int(getattr(getattr(op, "upload_info", None), "size", 0) or 0) for op in operations]
    if segment:
        monitor.segment(sum(sizes) + 1, f"uploading {len(operations)} file(s)")
    for op, size in zip(operations, sizes):
        monitor.check("during the upload")
        reader = None
        if isinstance(op.path_or_fileobj, io.BufferedIOBase):  # its hash is known: only the upload reads it now
            reader = op.path_or_fileobj = ReadReport(op.path_or_fileobj, monitor, op.path_in_repo)
        upload(op)
        monitor.step(f"uploaded {op.path_in_repo}", max(size - (reader.reached if reader else 0), 0))


class _SegmentView:
    """A :class:`Monitor` whose :meth:`~Monitor.segment` does nothing: for the worker threads of one pass
    (the pass's segment is started once, by the caller; each worker only steps it)."""

    def __init__(self, monitor: Monitor):
        self._monitor = monitor

    def segment(self, total: int, message: str = "") -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._monitor, name)


def shared_segment(monitor: Monitor) -> Monitor:
    """``monitor`` for the worker threads of one pass (see :class:`_SegmentView`)."""
    return _SegmentView(monitor)  # type: ignore[return-value]


__all__ = ["Monitor", "STAGES", "Progress", "Cancel", "CancelEvent", "silent_tqdm", "shared_segment", "upload_steps"]
