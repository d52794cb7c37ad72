"""The type check the suite runs (issue 33): mypy, strict, on the public face and the method contract.

Strict (``--strict``): ``hubsoup/api.py``, ``hubsoup/session.py``, ``hubsoup/options.py``, ``hubsoup/methods/_base.py`` (the method contract),
``hubsoup/methods/_kept.py`` and the engine package ``hubsoup/engine``; what they import is read for its types only
(``--follow-imports=silent``: its own errors are not this check's). Calls into ``torch.cuda`` (``Stream``, ``Event``:
untyped in torch) are allowed (``--untyped-calls-exclude=torch.cuda``), nothing else. mypy is in the ``test`` extra; without it this test fails, it is never skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRICT = ["hubsoup/api.py", "hubsoup/session.py", "hubsoup/options.py", "hubsoup/methods/_base.py", "hubsoup/methods/_kept.py", "hubsoup/engine"]


def _mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                           "--ignore-missing-imports", "--untyped-calls-exclude=torch.cuda", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.slow  # minutes on a busy 2-core machine (torch's stubs); seconds again from mypy's cache
def test_strict_type_check_of_the_public_face_the_method_contract_and_the_engine():
    proc = _mypy("--strict", *STRICT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_type_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    return x\n")
    proc = _mypy("--strict", str(bad))
    assert proc.returncode == 1 and "no-untyped-def" in proc.stdout
