"""The output folder: locked for the whole run, written beside the target, renamed at the end.

An interrupted merge never leaves a folder that looks done: everything goes into
``.NAME.partial-XXXX`` beside the target, which becomes the target only on
:meth:`OutputFolder.commit`.

**The lock.** A run takes an exclusive lock on its output before any work starts and holds
it to the end: ``.NAME.lock`` beside the target, locked with ``flock`` (released by the
kernel when the process dies, however it dies) and holding one JSON line — pid, host, start
time and command — for the message a second run gets: it fails at once, naming the holder.
The file is removed at the end. A lock file whose ``flock`` is free was left by a killed
run (its pid is gone: the kernel released the lock) and is taken over with a warning; a
held ``flock`` is never broken, whatever its pid says (pid namespaces make a live holder
look dead). Where ``flock`` is not available (some network or FUSE file systems, Windows)
the file is created exclusively instead, and a holder whose pid is gone on this host is
stale and taken over with a warning (best effort: two runs taking over the same stale file
at the same instant are not excluded). The lock is re-entrant within a thread
(a greedy soup locks its output, then merges into it). See :class:`OutputLock`.

**Recovery.** The first thing a run does once it holds the lock is to clean up after an
interrupted run on the same output (:func:`recover`): ``.NAME.partial-*`` folders are
removed, with a warning. :meth:`OutputFolder.commit` replaces an existing output with two
renames (target → ``.NAME.old-XXXX``, temporary folder → target); a crash between them
leaves ``.NAME.old-XXXX`` and no ``NAME``: the next run **restores the old output** (a run
that did not exit 0 has no effect, whatever the phase it died in) and removes the
uncommitted new one. A ``.NAME.old-*`` beside an existing ``NAME`` (a crash after the second
rename) is removed.

**Faults.** :meth:`OutputFolder.fail` turns "disk full" and "read-only / no permission"
into one-line :class:`~hubsoup.errors.DiskFullError` and
:class:`~hubsoup.errors.OutputNotWritableError`, after removing the temporary folder and
releasing the lock; it never raises itself.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Iterator, Literal

from hubsoup.errors import DiskFullError, HubsoupError, OutputExistsError, OutputLockedError, OutputNotWritableError

try:
    import fcntl
except ImportError:  # Windows: exclusive creation only
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


MARKER = ".hubsoup"
"""The file hubsoup writes into every folder it makes (an output, a stage, an evolve study): a small JSON naming
the kind of folder. hubsoup replaces a folder only if it carries one (:func:`replace_problem`); a file named like
hubsoup's output (``hubsoup_recipe.yaml``, ``hubsoup_search.json``) is not a marker."""
_LEGACY_RECIPE = "hubsoup_recipe.yaml"  # hubsoup.recipe.RECIPE_FILE (a layer above this one)
_LEGACY_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors",
                   os.path.join("continual_state", "state.json"))


def write_marker(folder: str, kind: str, **extra: object) -> None:
    """Mark ``folder`` as made by hubsoup (``kind``: ``merge``, ``stage``, ``evolve``, ...; ``extra``: what that
    kind records, e.g. the files an evolve study's best model wrote)."""
    with open(os.path.join(folder, MARKER), "w", encoding="utf-8") as f:
        json.dump({"made_by": "hubsoup", "kind": kind, **extra}, f, sort_keys=True)
        f.write("\n")


def read_marker(folder: str) -> dict[str, Any] | None:
    """The marker of a folder hubsoup made (a regular file, not a link: a JSON object saying ``made_by:
    hubsoup``), else None."""
    path = os.path.join(folder, MARKER)
    try:
        if os.path.islink(folder) or not os.path.isfile(path) or os.path.islink(path):
            return None
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read(65536))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("made_by") == "hubsoup" else None


def _legacy_output(folder: str) -> bool:
    """An output of a hubsoup older than the marker: its recipe *and* its weights (or continual state)."""
    has: Callable[[str], bool] = lambda name: os.path.isfile(os.path.join(folder, name)) and not os.path.islink(os.path.join(folder, name))  # noqa: E731
    return has(_LEGACY_RECIPE) and any(has(n) for n in _LEGACY_WEIGHTS)


def holds_cwd(target: str) -> bool:
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:
        return False
    real = os.path.realpath(target)
    return cwd == real or cwd.startswith(real.rstrip(os.sep) + os.sep)


def replace_problem(target: str, overwrite: bool, *, legacy: bool | None = None, kind: str | None = None) -> str | None:
    """Why the existing ``target`` may not be replaced (None: it may, or it does not exist).

    hubsoup replaces only what it made: a folder carrying its :data:`MARKER` (of ``kind`` when given), never the
    working folder or one that holds it, never a file or a link. ``legacy`` (default: ``overwrite``): an output
    of an older hubsoup, which has no marker, counts as hubsoup's when it holds its recipe and its weights. An
    empty folder holds nothing to lose and may be replaced too. Without ``overwrite``, a folder hubsoup made is
    still refused (replacing it is the user's choice).
    """
    if not os.path.lexists(target):
        return None
    shown = f"'{target}'"
    if os.path.islink(target):
        return f"{shown} is a link; hubsoup replaces only folders it made: choose another folder"
    if not os.path.isdir(target):
        return f"{shown} is a file; hubsoup replaces only folders it made: choose another folder"
    if holds_cwd(target):
        return f"{shown} is the working folder or holds it; hubsoup never replaces it: choose another folder"
    marker = read_marker(target)
    try:
        empty = not os.listdir(target)
    except OSError:
        empty = False
    ours = (marker is not None and (kind is None or marker.get("kind") == kind)) or empty or (
        marker is None and (overwrite if legacy is None else legacy) and _legacy_output(target))
    if not ours:
        return (f"{shown} exists and hubsoup did not make it (no {MARKER} marker"
                + (f" of a {kind}" if kind and marker is not None else "") + "); hubsoup replaces only folders it "
                "made, with or without --overwrite: choose another folder, or remove it yourself")
    if not overwrite:
        return f"{shown} already exists; pass --overwrite (overwrite=True) to replace it"
    return None


def check_output(target: str, overwrite: bool, *, legacy: bool | None = None, kind: str | None = None,
                 what: str = "output") -> None:
    """Refuse to replace an existing output unless hubsoup made it and ``overwrite`` (:func:`replace_problem`);
    called before any work starts."""
    why = replace_problem(target, overwrite, legacy=legacy, kind=kind)
    if why is not None:
        raise OutputExistsError(f"{what} {why}")


def final_path(path: str) -> str:
    """Where ``path``, inside an output's temporary folder, will be once committed (for messages)."""
    parts = os.path.abspath(path).split(os.sep)
    for i, part in enumerate(parts):
        m = re.match(r"^\.(.+)\.partial-[\w-]+$", part)
        if m:
            parts[i] = m.group(1)
    return os.sep.join(parts)


def lock_file(target: str) -> str:
    """``.NAME.lock`` beside ``target``."""
    target = os.path.abspath(target)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.lock")


# --- the lock ------------------------------------------------------------------------------------

def _command() -> str:
    """This process's command line, for the lock file (a ``--token`` value is never written)."""
    argv = list(sys.argv) or ["python"]
    head = os.path.basename(argv[0])
    if head in ("__main__.py", "-m"):
        head = "hubsoup"
    elif head in ("", "-c"):
        head = "python -c ..."
    args = argv[1:]
    for i, a in enumerate(args):
        if a.startswith("--token="):
            args[i] = "--token=***"
        elif a == "--token" and i + 1 < len(args):
            args[i + 1] = "***"
    line = " ".join([head, shlex.join(args)]).strip()
    return line if len(line) <= 300 else line[:297] + "..."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "another hubsoup run (it is just starting)"
    started = info.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"another hubsoup run: pid {info.get('pid', '?')} on {info.get('host', '?')}, started {when}, "
            f"`{info.get('command', '?')}`")


def _stale(info: dict[str, Any] | None) -> bool:
    """Its holder's pid is gone on this host (never said of another host's pid: that cannot be checked)."""
    if not info or info.get("host") != socket.gethostname():
        return False
    pid = info.get("pid")
    return isinstance(pid, int) and pid != os.getpid() and not _alive(pid)


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        info = json.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return info if isinstance(info, dict) else None


def _read_fd(fd: int) -> dict[str, Any] | None:
    try:
        return _parse(os.pread(fd, 4096, 0))
    except OSError:
        return None


def _read_path(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            return _parse(f.read(4096))
    except OSError:
        return None


@dataclass
class _Held:
    fd: int | None
    """The ``flock``-ed descriptor (None: exclusive creation, no flock)."""
    owner: int
    """The thread that holds it (re-entrant in that thread only)."""
    pid: int
    """The process (a forked child does not hold its parent's locks)."""
    depth: int = 1


_HELD: dict[str, _Held] = {}
_HELD_MUTEX = threading.Lock()


class OutputLock:
    """An exclusive lock on an output path for one run: ``.NAME.lock`` beside it.

    :meth:`acquire` returns at once: True when the lock was taken, False when this thread
    already held it (re-entered); a lock held by another run raises
    :class:`~hubsoup.errors.OutputLockedError` naming the holder (pid, host, start time,
    command). :meth:`release` (idempotent, never raises) removes the file when the
    outermost holder lets go. ``what`` names the path in the message ("output",
    "continual soup").
    """

    def __init__(self, target: str, what: str = "output"):
        self.target = os.path.abspath(target)
        self.path = lock_file(self.target)
        self.what = what
        self._acquired = False

    def acquire(self) -> bool:
        with _HELD_MUTEX:
            held = _HELD.get(self.path)
            if held is not None and held.pid != os.getpid():
                del _HELD[self.path]
                held = None
            if held is not None:
                if held.owner != threading.get_ident():
                    raise OutputLockedError(self._busy({"pid": os.getpid(), "host": socket.gethostname(),
                                                        "command": "another thread of this process"}))
                held.depth += 1
                self._acquired = True
                return False
            fd = self._take()
            _HELD[self.path] = _Held(fd, threading.get_ident(), os.getpid())
            self._acquired = True
            return True

    def release(self) -> None:
        if not self._acquired:
            return
        self._acquired = False
        with _HELD_MUTEX:
            held = _HELD.get(self.path)
            if held is None:
                return
            held.depth -= 1
            if held.depth > 0:
                return
            del _HELD[self.path]
        # unlink while still holding it: a run that opened the old file sees it gone and tries again
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if held.fd is not None:
            try:
                os.close(held.fd)
            except OSError:
                pass

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # --- taking it -------------------------------------------------------------------------
    def _info(self) -> bytes:
        return (json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": round(time.time(), 3),
                            "command": _command(), "target": self.target}) + "\n").encode("utf-8")

    def _busy(self, info: dict[str, Any] | None) -> str:
        return (f"{self.what} '{self.target}' is in use by {_describe(info)}; wait for it to finish "
                f"(lock file {self.path})")

    def _take_over(self, info: dict[str, Any] | None, why: str) -> None:
        log.warning("taking over the lock on '%s' left by %s: %s", self.target, _describe(info), why)

    def _take(self) -> int | None:
        if fcntl is None:
            return self._take_exclusive()
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as e:
                raise _raise_for(e, self.target)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _read_fd(fd)
                os.close(fd)
                raise OutputLockedError(self._busy(info)) from None
            except OSError as e:
                os.close(fd)
                if e.errno in _NO_FLOCK:
                    self._take_exclusive()
                    return None
                raise
            try:
                st, now = os.fstat(fd), _stat(self.path)
                if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                    os.close(fd)  # released and removed by its holder meanwhile: lock the new one
                    continue
                if st.st_size:  # flock is free, so its holder is gone (the kernel releases it on death)
                    self._take_over(_read_fd(fd), "its run was killed")
                os.ftruncate(fd, 0)
                os.pwrite(fd, self._info(), 0)
            except OSError as e:
                _unlink_if(self.path, os.fstat(fd).st_ino)
                os.close(fd)
                raise _raise_for(e, self.target)
            return fd
        raise OutputLockedError(self._busy(_read_path(self.path)))

    def _take_exclusive(self) -> None:
        """Without ``flock``: create the file exclusively; a holder whose pid is gone on this host is stale."""
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                info = _read_path(self.path)
                if _stale(info):
                    self._take_over(info, "that process is gone")
                    try:
                        os.unlink(self.path)
                    except FileNotFoundError:
                        pass
                    continue
                raise OutputLockedError(self._busy(info)) from None
            except OSError as e:
                raise _raise_for(e, self.target)
            try:
                os.write(fd, self._info())
            except OSError as e:
                os.close(fd)
                os.unlink(self.path)
                raise _raise_for(e, self.target)
            os.close(fd)
            return None
        raise OutputLockedError(self._busy(_read_path(self.path)))


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None


def _unlink_if(path: str, ino: int) -> None:
    st = _stat(path)
    if st is not None and st.st_ino == ino:
        try:
            os.unlink(path)
        except OSError:
            pass


# --- recovery ------------------------------------------------------------------------------------

def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except OSError:
            pass


def recover(target: str) -> None:
    """Clean up after an interrupted run on ``target``; call it holding the lock.

    Restores ``NAME`` from ``.NAME.old-*`` when ``NAME`` is missing (a crash between the
    two renames of a commit), removes other ``.NAME.old-*`` and every ``.NAME.partial-*``;
    each action is logged as a warning.
    """
    target = os.path.abspath(target)
    parent, name = os.path.split(target)
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    # exactly `.NAME.old-XXXX` / `.NAME.partial-XXXX` (no dot in XXXX): never another output's `.NAME.old-x.partial-y`
    leftover = re.compile(rf"^\.{re.escape(name)}\.(partial|old)-[\w-]+$")
    found = [(m.group(1), os.path.join(parent, e)) for e in entries for m in [leftover.match(e)] if m]
    olds = [p for kind, p in found if kind == "old"]
    partials = [p for kind, p in found if kind == "partial"]
    if olds and not os.path.lexists(target):
        keep = max(olds, key=lambda p: os.lstat(p).st_ctime)
        try:
            os.rename(keep, target)
        except OSError as e:
            raise OutputNotWritableError(
                f"output '{target}' is missing and its previous version is in '{keep}' (a run was interrupted while "
                f"replacing it), which cannot be moved back ({e.strerror}); rename it to '{name}' by hand") from e
        olds.remove(keep)
        log.warning("restored '%s' from '%s': the run that was replacing it was interrupted between its two renames; "
                    "its new output is discarded", target, os.path.basename(keep))
    left = []
    for p in olds + partials:
        _remove(p)
        if os.path.lexists(p):
            left.append(os.path.basename(p))
    removed = [os.path.basename(p) for p in olds + partials if os.path.basename(p) not in left]
    if removed:
        log.warning("removed %d temporary folder(s) left beside '%s' by an interrupted run: %s", len(removed), target,
                    ", ".join(sorted(removed)))
    if left:
        log.warning("could not remove temporary folder(s) left beside '%s' by an interrupted run: %s; remove them by "
                    "hand", target, ", ".join(sorted(left)))


def lock_output(target: str, what: str = "output") -> OutputLock:
    """Take the lock on ``target`` (see :class:`OutputLock`) and, when newly taken, :func:`recover` it.

    The folder that holds ``target`` is created if needed.
    """
    lock = OutputLock(target, what)
    parent = os.path.dirname(lock.target)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        if e.errno in _NOT_WRITABLE:
            raise OutputNotWritableError(f"cannot create the folder '{parent}' for the {what} '{lock.target}': "
                                         f"{e.strerror} ({e.filename}); choose another --out") from e
        raise _raise_for(e, lock.target)
    if lock.acquire():
        try:
            recover(lock.target)
        except BaseException:
            lock.release()
            raise
    return lock


# --- faults ----------------------------------------------------------------------------------------

def _within(path: str | None, folder: str) -> bool:
    if not path:
        return False
    path, folder = os.path.abspath(os.fsdecode(path)), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def output_error(e: BaseException, folder: str) -> HubsoupError | None:
    """The one-line error for an ``OSError`` met while writing into ``folder`` (or beside it), else None.

    Disk full (``ENOSPC``/``EDQUOT``) anywhere → :class:`DiskFullError`; read-only file system or no
    permission (``EROFS``/``EACCES``/``EPERM``) on a path in ``folder``'s parent →
    :class:`OutputNotWritableError`. safetensors' own writer (``save_file``, a LoRA output) reports
    the OS error in its message only: ``... (os error 28)``.
    """
    if isinstance(e, HubsoupError):
        return e
    code, filename, strerror = getattr(e, "errno", None), getattr(e, "filename", None), getattr(e, "strerror", None)
    if not isinstance(e, OSError):
        m = re.search(r"\(os error (\d+)\)", str(e)) if type(e).__name__ == "SafetensorError" else None
        if m is None:
            return None
        code, strerror = int(m.group(1)), os.strerror(int(m.group(1)))
    folder = os.path.abspath(folder)
    if code in _DISK_FULL:
        name = os.path.basename(os.fsdecode(filename)) if filename else "the output"
        where = os.path.dirname(os.path.abspath(os.fsdecode(filename))) if filename else folder
        return DiskFullError(f"disk full while writing {name} in {final_path(where)} ({strerror}); free some space "
                             "or write elsewhere")
    parent = os.path.dirname(folder)
    if code in _NOT_WRITABLE and (_within(filename, parent) or (filename is None and code == errno.EROFS)):
        why = "read-only file system" if code == errno.EROFS else "permission denied"
        return OutputNotWritableError(f"cannot write the output '{final_path(folder)}': {why} "
                                      f"({os.fsdecode(filename) if filename else parent}); choose another --out")
    return None


def _raise_for(e: BaseException, folder: str) -> BaseException:
    """What to raise for ``e``: its one-line form (cause ``e``) when :func:`output_error` has one, else ``e``."""
    err = output_error(e, folder)
    if err is None or err is e:
        return e
    err.__cause__ = e
    return err


def umask() -> int:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # not thread-safe for that instant; only where /proc is missing
    os.umask(mask)
    return mask


_RENAME_EXCHANGE = 2  # linux/fs.h
_renameat2: Callable[..., int] | Literal[False] | None = None  # libc's (False: it has none; None: not looked up)


def exchange(a: str, b: str) -> bool:
    """Swap the folders ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot (the caller then renames twice, and :func:`recover` covers a crash)."""
    global _renameat2
    if not sys.platform.startswith("linux"):
        return False
    if _renameat2 is None:
        try:
            import ctypes  # lazy: platform-specific (Linux renameat2 through libc)

            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _renameat2 = fn
        except (OSError, AttributeError):  # an older libc: no renameat2
            _renameat2 = False
    if not _renameat2:
        return False
    at_fdcwd = -100
    return _renameat2(at_fdcwd, os.fsencode(os.path.abspath(a)), at_fdcwd, os.fsencode(os.path.abspath(b)),
                      _RENAME_EXCHANGE) == 0


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


COMMITTED: list[str] = []
"""Outputs committed by this process, in order: a signal that arrives after a commit (while a command prints
or pushes) must not be reported as having left nothing behind (the CLI reads this)."""


@contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held (delivered at the end) in the main thread; elsewhere nothing to hold.

    Masking holds the signals that arrive during the block; one that arrived just before it, whose Python
    handler has not run yet, would still run inside it (between two bytecodes, e.g. right after a rename): a
    recording handler stands in for the block, and what it recorded is raised again after it."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM)
    caught: list[int] = []
    # a handler installed outside Python (None) cannot be put back: those signals are only masked
    handlers = {s: signal.signal(s, lambda n, _frame: caught.append(n)) for s in held
                if signal.getsignal(s) is not None}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # those held are delivered to the real handlers
        for n in dict.fromkeys(caught):
            signal.raise_signal(n)


class OutputFolder:
    """A temporary folder beside ``target`` that becomes ``target`` on :meth:`commit`.

    Creating it takes the lock on ``target`` (:func:`lock_output`, which also recovers
    from an interrupted run), refuses an existing ``target`` without ``overwrite`` and
    makes ``.NAME.partial-XXXX`` with the user's umask. :meth:`commit` and :meth:`abort`
    release the lock. Used as a context manager, an exception aborts (see :meth:`fail`).
    """

    def __init__(self, target: str, overwrite: bool = False, *, what: str = "output", kind: str = "merge",
                 legacy: bool | None = None):
        self.target = os.path.abspath(target)
        self.path = ""
        self.committed = False
        self.kind = kind
        self.lock = lock_output(self.target, what)
        try:
            check_output(target, overwrite, legacy=legacy, what=what)
            self.path = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.partial-",
                                         dir=os.path.dirname(self.target))
            os.chmod(self.path, 0o777 & ~umask())  # mkdtemp's 0700 would make the output private
        except BaseException as e:
            raise self.fail(e)

    def commit(self, source: str | None = None) -> str:
        """Rename the temporary folder (or ``source``, a folder inside it) to the target; release the lock."""
        with _signals_held():  # the rename and its record are one step: a Ctrl-C lands before or after both
            target = self._commit(source)
            COMMITTED.append(target)
        return target

    def _commit(self, source: str | None = None) -> str:
        src = source or self.path
        parent = os.path.dirname(self.target)
        write_marker(src, self.kind)  # what hubsoup made, it may replace again (and nothing else)
        why = replace_problem(self.target, True)  # the target as it is now (made meanwhile by someone else?)
        if why is not None:
            raise OutputExistsError(f"output {why}")
        if os.path.isdir(self.target) and not os.path.islink(self.target) and exchange(src, self.target):
            # one atomic step: the target is the new output at every moment, the old one is now at `src`
            # (a crash before it is removed leaves a `.NAME.partial-*` folder, which the next run removes)
            _remove(src)
        elif os.path.lexists(self.target):
            suffix = os.path.basename(self.path).rsplit(".partial-", 1)[-1]
            old = os.path.join(parent, f".{os.path.basename(self.target)}.old-{suffix}")
            os.rename(self.target, old)
            # a crash here leaves `old` and no target: the next run on the target restores `old` (recover)
            try:
                os.rename(src, self.target)
            except BaseException:
                os.rename(old, self.target)
                raise
            _remove(old)
        else:
            os.rename(src, self.target)
        _fsync_dir(parent)
        if src != self.path:
            shutil.rmtree(self.path, ignore_errors=True)
        self.committed = True
        self.lock.release()
        return self.target

    def abort(self) -> None:
        """Remove the temporary folder and release the lock; never raises."""
        try:
            if self.path and not self.committed:
                shutil.rmtree(self.path, ignore_errors=True)
        except BaseException:  # noqa: BLE001 - cleanup must not hide the real error
            pass
        finally:
            self.lock.release()

    def fail(self, e: BaseException) -> BaseException:
        """:meth:`abort`, then the exception to raise for ``e``: a one-line error for a full disk or a
        read-only output (see :func:`output_error`), else ``e`` itself. Usage: ``raise folder.fail(e)``."""
        self.abort()
        return _raise_for(e, self.path or self.target)

    def __enter__(self) -> "OutputFolder":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            if not self.committed:
                self.abort()
            return
        err = self.fail(exc)
        if err is not exc:
            raise err
