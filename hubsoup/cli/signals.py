"""Ctrl-C and SIGTERM for the CLI: raised in the main thread, and remembered.

The handlers raise (``KeyboardInterrupt``; :class:`Terminated` for SIGTERM) so that the command unwinds through
the same cleanup (temporary folder, lock) either way. They also record the signal, because an exception raised
by a handler can be lost on its way out: a signal that lands while C code runs a Python callback (torch probing
an object's attributes while safetensors builds a tensor, for one) may come back as that code's own error, a
``ValueError`` say, or not at all. The CLI asks :func:`received` what happened, not the exception's type. One
lost where Python cannot raise it (a weakref or ``__del__`` callback run by the garbage collector) is not printed
as "Exception ignored in ...": the signal is recorded, and the command ends as signalled with its one line.

**From the first instant.** When the process is the ``hubsoup`` command, the package's first lines
(``hubsoup/__init__.py`` and :mod:`hubsoup.startup`, before any other import of it) install handlers that only record a signal, never
raise it: a Ctrl-C while the command imports its modules cannot become a traceback. ``main()`` installs the
raising handlers first of all (:func:`catch`), then asks :func:`received` whether one came meanwhile
(:func:`start_mark`). Only the interpreter's own start-up (``site``, the console script's first line) is
outside: there Python's default handler applies.

Example:
    >>> mark = mark_now()
    >>> received(mark) is None
    True
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Callable, Iterator, NoReturn

from hubsoup import startup
from hubsoup.startup import SIGNALS as _RECEIVED  # the same list the package's first-instant handlers record into

EXIT_CODES: dict[int, int] = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""What a shell reports for a process its signal ended: 128 + the signal's number."""

_STARTED: list[bool] = []
"""Whether a command's :func:`start_mark` took the first instant's signals (once per process)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread: it unwinds through the same cleanup as Ctrl-C."""


def _on_sigint(signum: int, frame: FrameType | None) -> NoReturn:
    _RECEIVED.append(signal.SIGINT)
    raise KeyboardInterrupt()


def _on_sigterm(signum: int, frame: FrameType | None) -> NoReturn:
    _RECEIVED.append(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
    raise Terminated()


def the_command() -> bool:
    """This process is the ``hubsoup`` command (not a program that imports the package and calls ``main``)."""
    return startup.the_command()


def ignore() -> None:
    """SIGINT and SIGTERM ignored from now on (main thread only): the command's end is decided (its line printed,
    its exit status chosen), and a signal while the interpreter exits (Python resets its own handlers to the
    default, which would kill the process without a word, but leaves an ignored signal ignored) changes nothing."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)


def start_mark() -> int:
    """The mark a command starts from: the process's first (0: a signal recorded while the command was starting
    belongs to it), once; later commands in the same process :func:`mark_now`."""
    if not _STARTED:
        _STARTED.append(True)
        return 0 if startup.the_command() else mark_now()
    return mark_now()


def catch() -> Callable[[], None]:
    """Install both handlers (main thread only); returns what restores the previous ones."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {s: signal.signal(s, h) for s, h in ((signal.SIGINT, _on_sigint), (signal.SIGTERM, _on_sigterm))}
    mark, hook = mark_now(), sys.unraisablehook

    def unraisable(u: sys.UnraisableHookArgs) -> None:  # a handler's exception the garbage collector could not raise: already recorded
        if not (isinstance(u.exc_value, KeyboardInterrupt) and len(_RECEIVED) > mark):
            hook(u)

    sys.unraisablehook = unraisable

    def restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        sys.unraisablehook = hook

    return restore


@contextmanager
def recorded() -> Iterator[None]:
    """For the block, SIGINT and SIGTERM are recorded, never raised (main thread only; else nothing changes).

    For an import of native code that calls back into Python: torch's import runs Python callbacks from C++, and
    an exception raised there by a handler cannot cross the C++ frames: the process aborts (SIGABRT, pybind11's
    ``terminate called after throwing an instance of 'pybind11::error_already_set'``) instead of printing its one
    line. Ask :func:`received` afterwards.

    Example:
        >>> with recorded():
        ...     import json
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def record(signum: int, frame: FrameType | None) -> None:
        _RECEIVED.append(signum)

    previous = {s: signal.signal(s, record) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def mark_now() -> int:
    """A mark for :func:`received`: signals before it belong to an earlier command in this process."""
    return len(_RECEIVED)


def received(mark: int, exc: BaseException | None = None) -> int | None:
    """The first signal received since ``mark`` (``signal.SIGINT``/``SIGTERM``), else what ``exc`` says, else None.

    ``exc`` covers a ``KeyboardInterrupt`` raised by other means (a handler installed by the host program).
    """
    if len(_RECEIVED) > mark:
        return _RECEIVED[mark]
    if isinstance(exc, Terminated):
        return signal.SIGTERM
    if isinstance(exc, KeyboardInterrupt):
        return signal.SIGINT
    return None
