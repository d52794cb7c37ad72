"""The first instant of the ``hubsoup`` command: a Ctrl-C or SIGTERM recorded, never raised, until ``cli.main``
installs the handlers that unwind through the cleanup (:mod:`hubsoup.cli.signals`).

``hubsoup/__init__.py`` imports this module before anything else of the package, so a signal while the command
imports its modules cannot become a traceback. Only where the signal has its default disposition, and only when
the process is the command (its console script, or ``python -m hubsoup``), never in a program that imports hubsoup.
It imports nothing of hubsoup.
"""

import os
import signal
import sys
from types import FrameType

SIGNALS: list[int] = []
"""SIGINT / SIGTERM received by the ``hubsoup`` command (:mod:`hubsoup.cli.signals` records there too)."""


def the_command() -> bool:
    """This process is the ``hubsoup`` command (its console script, or ``python -m hubsoup``), not a program that
    imports the package."""
    argv = list(getattr(sys, "orig_argv", None) or [])
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "hubsoup":
        return True
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return os.path.basename(script) in ("hubsoup", "hubsoup.exe", "hubsoup-script.py")


def _record(signum: int, frame: FrameType | None) -> None:
    SIGNALS.append(signum)


def record_signals() -> None:
    """In the command, record SIGINT and SIGTERM from now on (where they have their default disposition)."""
    if the_command():
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _record)
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _record)
