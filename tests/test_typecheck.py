"""The type check the suite runs (issues 33 and 47): ``mypy --strict`` over the whole package, with no error.

Issue 47 held the count of strict errors outside the public face and the engine to a ratchet that could only go
down (914 errors in 112 files when it began); it reached zero, and the ratchet is gone: a new error anywhere in
``hubsoup/`` fails this test, naming the lines. Calls into ``torch.cuda`` (``Stream``, ``Event``: untyped in torch)
are allowed (``--untyped-calls-exclude=torch.cuda``), nothing else; third-party modules without types are read
as ``Any`` (``--ignore-missing-imports``). mypy is in the ``test`` extra; without it this test fails, it is never
skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from paths import ROOT

STRICT = ["hubsoup"]


def _mypy(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                           "--ignore-missing-imports", "--untyped-calls-exclude=torch.cuda", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT})


@pytest.mark.slow  # minutes cold on a busy 2-core machine (torch's stubs); seconds from mypy's cache (.mypy_cache)
def test_strict_type_check_of_the_whole_package():
    proc = _mypy("--strict", *STRICT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def test_the_type_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(x):\n    return x\n")
    proc = _mypy("--strict", str(bad))
    assert proc.returncode == 1 and "no-untyped-def" in proc.stdout


TYPED_METHOD = """
from dataclasses import dataclass

import torch

from hubsoup.methods import Method, TensorContext, param


@dataclass
class MyParams:
    alpha: float = param(0.5, "a weight")


class My(Method[MyParams]):
    name = "my"
    summary = "mine"
    Params = MyParams

    def merge(self, base: torch.Tensor, deltas: torch.Tensor, params: MyParams, ctx: TensorContext) -> torch.Tensor:
        return deltas.sum(dim=0) * params.alpha


def use(m: My) -> float:
    return m.parse({}).alph
"""


@pytest.mark.slow  # as above: torch's stubs, seconds from mypy's cache
def test_a_methods_hooks_see_its_own_typed_parameters(tmp_path):
    """Issue 47: ``Method`` is generic over its parameter dataclass, so ``parse`` (and every hook) is typed."""
    mine = tmp_path / "typed_method.py"
    mine.write_text(TYPED_METHOD)
    proc = _mypy("--strict", str(mine))
    assert proc.returncode == 1 and '"MyParams" has no attribute "alph"; maybe "alpha"?' in proc.stdout, proc.stdout
    mine.write_text(TYPED_METHOD.replace(".alph\n", ".alpha\n"))
    proc = _mypy("--strict", str(mine))
    assert proc.returncode == 0, proc.stdout
