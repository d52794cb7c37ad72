"""A Ctrl-C while the CLI imports torch is recorded, never raised inside torch's import.

torch's import calls Python back from C++; a ``KeyboardInterrupt`` raised by a handler there cannot cross the C++
frames and the process aborts (CI, 2026-11-27: ``hubsoup run`` signalled 1.3 s in ended with SIGABRT and
pybind11's traceback instead of one line and 130). ``main()`` imports torch before the command's code, under
handlers that only record (``signals.recorded``), then ends the command as signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from hubsoup.cli import signals

HUBSOUP = os.path.join(os.path.dirname(sys.executable), "hubsoup")

# imported by `site` at the interpreter's start (PYTHONPATH): when torch's import reaches torch.nn.modules, it notes
# which SIGINT handler is installed and sends the process a SIGINT, there, inside torch's import
PROBE = '''
import os, signal, sys

class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch.nn.modules":
            sys.meta_path.remove(self)
            handler = signal.getsignal(signal.SIGINT)
            with open(os.environ["HUBSOUP_PROBE_OUT"], "w") as f:
                f.write(getattr(handler, "__qualname__", repr(handler)))
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Probe())
'''


def test_a_sigint_inside_torchs_import_is_recorded_then_one_line_and_130(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(PROBE)
    out = tmp_path / "handler"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(PYTHONPATH=str(tmp_path / "site"), HUBSOUP_PROBE_OUT=str(out), HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"))
    proc = subprocess.run([HUBSOUP, "methods"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert out.read_text() == "recorded.<locals>.record", "torch was imported under the raising handler"
    assert proc.returncode == 130, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["interrupted; no output was left behind"], proc.stderr[-3000:]


def test_recorded_records_and_restores():
    before = signal.getsignal(signal.SIGINT)
    mark = signals.mark_now()
    with signals.recorded():
        os.kill(os.getpid(), signal.SIGINT)  # handled at the next bytecode: recorded, not raised
        for _ in range(3):
            pass
    assert signals.received(mark) == signal.SIGINT
    assert signal.getsignal(signal.SIGINT) is before
