"""Run the hubsoup CLI for tests/cli/test_kill_loop.py, ready to be signalled at any moment (never imported by the library).

    KILL_LOOP_READY=MARKER python tests/kill_loop_helper.py [hubsoup CLI arguments ...]

Everything a merge imports is imported first; MARKER is created once the CLI caught SIGTERM: a signal the test
sends after MARKER exists lands in the merge itself, not in Python's start-up. Pieces are made small and
lanes many (4), so that even a tiny model is swept in lanes: a signal can land while the lane threads
start (``engine/lanes.py``), while they sweep, or while the read-ahead thread starts or reads. SIGUSR1
dumps every thread's stack (a hung run says where it hangs).

``KILL_LOOP_AT=lanes|readahead`` and ``KILL_LOOP_SIGNAL=SIGINT|SIGTERM``: the run signals itself at that
narrow moment instead (what random delays rarely hit): while the main thread waits for the lane threads to
start (they are made slow to arrive), or between the read-ahead thread's creation and its start.

    python tests/kill_loop_helper.py --serve

A fork server for the loop (the imports above cost seconds of CPU, a merge a fraction of one: fifty fresh
interpreters were most of the loop's time): it imports once, then for each JSON line on stdin
(``{"args": [...], "cwd": ..., "env": {...}, "out": FILE, "err": FILE}``) forks a child that takes those
arguments, folder, environment and output files and goes on exactly as a fresh ``python kill_loop_helper.py
ARGS`` goes on after its imports: to the same ``__main__`` code and the interpreter's own exit. The server
answers ``{"pid": PID}`` per line, and ``{"exit": PID, "rc": RC}`` when that child ends (a negative RC: killed
by that signal). It never runs a merge itself nor starts a thread, so each child starts from a clean state.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time

faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402

import hubsoup.api  # noqa: E402,F401 - imported before the marker: the signal lands in the merge
import hubsoup.methods  # noqa: E402,F401
from hubsoup.cli import main, signals  # noqa: E402
from hubsoup.engine import lowrank  # noqa: E402

lowrank.PIECE_BYTES = 1 << 16  # a tiny tensor still has several pieces
torch.set_num_threads(4)  # four lanes

def _signal_at(where: str, sig: int) -> None:
    from hubsoup import linalg  # the lanes' threads come from linalg.one_thread_pool

    if where == "lanes":  # the lane threads arrive late at the start barrier; the signal comes while main waits
        slow = linalg._one_thread

        def late() -> None:
            time.sleep(0.3)
            slow()

        linalg._one_thread = late
        real_wait = threading.Barrier.wait

        def wait(self, timeout=None):
            if threading.current_thread() is threading.main_thread():
                threading.Timer(0.05, os.kill, (os.getpid(), sig)).start()
            return real_wait(self, timeout)

        threading.Barrier.wait = wait
    elif where == "readahead":  # the thread object exists, its start has not happened
        real_start = threading.Thread.start

        def start(self):
            if self.name == "hubsoup-readahead":
                os.kill(os.getpid(), sig)
                time.sleep(0.5)  # the handler runs here, in the main thread
            return real_start(self)

        threading.Thread.start = start


_catch = signals.catch


def _ready_once_sigterm_is_caught():
    """The CLI's signal handlers, then the marker: a signal sent after it always finds the handlers."""
    restore = _catch()
    open(os.environ["KILL_LOOP_READY"], "w").close()
    return restore


def _serve() -> list[str]:
    """The fork server's loop (see the module docstring); returns, in a child, that child's arguments."""
    import json
    import select

    children: set[int] = set()
    pending = b""

    def say(msg: dict) -> None:
        os.write(1, (json.dumps(msg) + "\n").encode())

    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        while children:  # reap whatever ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            say({"exit": pid, "rc": os.waitstatus_to_exitcode(status)})
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the test is done
            for pid in children:
                os.waitpid(pid, 0)
            sys.exit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            job = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: its own folder, environment, standard streams, then the merge
                os.chdir(job["cwd"])
                os.environ.update(job["env"])
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                for fd, path in ((1, job["out"]), (2, job["err"])):
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
                return job["args"]
            children.add(pid)
            say({"pid": pid})


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        sys.argv[1:] = _serve()
    signals.catch = _ready_once_sigterm_is_caught
    if os.environ.get("KILL_LOOP_AT"):
        _signal_at(os.environ["KILL_LOOP_AT"], getattr(signal, os.environ.get("KILL_LOOP_SIGNAL", "SIGINT")))
    rc = main(sys.argv[1:])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # finished: a late signal is not a failure of the merge
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(rc)
