"""Run the hubsoup CLI for tests/test_kill_loop.py, ready to be signalled at any moment (never imported by the library).

    KILL_LOOP_READY=MARKER python tests/kill_loop_helper.py [hubsoup CLI arguments ...]

Everything a merge imports is imported first; MARKER is created once the CLI caught SIGTERM: a signal the test
sends after MARKER exists lands in the merge itself, not in Python's start-up. Pieces are made small and
lanes many (4), so that even a tiny model is swept in lanes: a signal can land while the lane threads
start (``engine/lanes.py``), while they sweep, or while the read-ahead thread starts or reads. SIGUSR1
dumps every thread's stack (a hung run says where it hangs).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)

import torch  # noqa: E402

import hubsoup.api  # noqa: E402,F401 - imported before the marker: the signal lands in the merge
import hubsoup.methods  # noqa: E402,F401
from hubsoup import cli  # noqa: E402
from hubsoup.cli import _catch_sigterm, main  # noqa: E402
from hubsoup.engine import lowrank  # noqa: E402

lowrank.PIECE_BYTES = 1 << 16  # a tiny tensor still has several pieces
torch.set_num_threads(4)  # four lanes

def _ready_once_sigterm_is_caught():
    """The CLI's SIGTERM handler, then the marker: a SIGTERM sent after it always finds the handler."""
    restore = _catch_sigterm()
    open(os.environ["KILL_LOOP_READY"], "w").close()
    return restore


if __name__ == "__main__":
    cli._catch_sigterm = _ready_once_sigterm_is_caught
    rc = main(sys.argv[1:])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # finished: a late signal is not a failure of the merge
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(rc)
