"""Run the hubsoup CLI with a fault injected, for tests/output/test_faults.py (never imported by the library).

    python tests/fault_helper.py [hubsoup CLI arguments ...]

The environment chooses the fault (read here only, never by hubsoup itself):

* ``FAULT_PAUSE=MARKER``: at the first tensor written into an output, create the file
  MARKER and wait there (sleeping in Python, so signals are handled) until the file
  ``MARKER.go`` exists; a test kills the process, signals it, or starts a second run
  meanwhile.
* ``FAULT_CRASH_IN_COMMIT=1``: SIGKILL this process between the two renames with which
  an output folder replaces an existing one where the system cannot swap two folders atomically
  (the atomic exchange is turned off).
* ``FAULT_CRASH_AFTER_EXCHANGE=1``: SIGKILL this process right after the atomic exchange that
  puts the new output in place, before the old one (now in the temporary folder) is removed.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _pause_at_first_write(marker: str) -> None:
    from hubsoup.output import shards

    original = shards.ShardedWriter.write
    state = {"paused": False}

    def write(self, name, tensor):
        if not state["paused"]:
            state["paused"] = True
            open(marker, "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(marker + ".go") and time.monotonic() < deadline:
                time.sleep(0.02)
        return original(self, name, tensor)

    shards.ShardedWriter.write = write


def _crash_in_commit() -> None:
    from hubsoup.output import folder

    folder.exchange = lambda a, b: False  # the two renames of a system without renameat2
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        src_name, dst_name = os.path.basename(os.fspath(src)), os.path.basename(os.fspath(dst))
        if ".partial-" in src_name and not dst_name.startswith(".") and os.path.lexists(dst) is False:
            parent = os.path.dirname(os.path.abspath(os.fspath(dst)))
            if any(e.startswith(f".{dst_name}.old-") for e in os.listdir(parent)):
                os.kill(os.getpid(), signal.SIGKILL)  # the old output is moved aside, the new one not yet in place
        return real_rename(src, dst, *args, **kwargs)

    os.rename = rename


def _crash_after_exchange() -> None:
    from hubsoup.output import folder

    real = folder.exchange

    def exchange(a, b):
        done = real(a, b)
        if done:
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    folder.exchange = exchange


if __name__ == "__main__":
    if os.environ.get("FAULT_PAUSE"):
        _pause_at_first_write(os.environ["FAULT_PAUSE"])
    if os.environ.get("FAULT_CRASH_IN_COMMIT"):
        _crash_in_commit()
    if os.environ.get("FAULT_CRASH_AFTER_EXCHANGE"):
        _crash_after_exchange()
    from hubsoup.cli import main

    sys.exit(main(sys.argv[1:]))
