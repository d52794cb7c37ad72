"""The type check the suite runs (issue 33): mypy, strict, on the public face and the method contract; and over the whole
package as a ratchet (issue 47): ``tests/mypy_ratchet.txt`` lists the strict errors each remaining file has, and no count
may rise (nor a new file have any). When a file's count drops, the test says so and asks for the file to be lowered:
``python tests/test_typecheck.py --update`` writes the counts as they are. The end state is an empty file.

Strict (``--strict``): ``hubsoup/api.py``, ``hubsoup/session.py``, ``hubsoup/options.py``, ``hubsoup/methods/_base.py`` (the method contract),
``hubsoup/methods/_easy.py`` (a method as one function), ``hubsoup/methods/_kept.py`` and the engine package
``hubsoup/engine``; what they import is read for its types only
(``--follow-imports=silent``: its own errors are not this check's). Calls into ``torch.cuda`` (``Stream``, ``Event``:
untyped in torch) are allowed (``--untyped-calls-exclude=torch.cuda``), nothing else. mypy is in the ``test`` extra; without it this test fails, it is never skipped.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

import pytest

from paths import ROOT
STRICT = ["hubsoup/api.py", "hubsoup/session.py", "hubsoup/options.py", "hubsoup/methods/_base.py", "hubsoup/methods/_easy.py",
          "hubsoup/methods/_kept.py", "hubsoup/engine"]


RATCHET = os.path.join(ROOT, "tests", "mypy_ratchet.txt")


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


def _package_errors() -> tuple[dict[str, int], str]:
    """Strict errors per file over the whole package (mypy's cache in the tree, .mypy_cache, shared with the test
    above: seconds when warm, 2 minutes cold on a busy 2-core machine), and mypy's output."""
    proc = _mypy("--strict", "hubsoup")
    assert proc.returncode in (0, 1), proc.stdout[-4000:] + proc.stderr[-2000:]  # 2: mypy itself failed
    counts = collections.Counter(m.group(1) for m in re.finditer(r"^(hubsoup/[^:]+\.py):\d+: error:", proc.stdout, re.M))
    return dict(counts), proc.stdout


def _read_ratchet() -> dict[str, int]:
    out = {}
    with open(RATCHET, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                path, n = line.rsplit(None, 1)
                out[path] = int(n)
    return out


def _write_ratchet(counts: dict[str, int]) -> None:
    with open(RATCHET, "w", encoding="utf-8") as f:
        f.write("# mypy --strict errors per file of hubsoup/ that still has some (tests/test_typecheck.py): a count may only\n"
                "# go down. Lower it when it does: python tests/test_typecheck.py --update. The goal is an empty file.\n")
        f.write(f"# total {sum(counts.values())} in {len(counts)} files\n")
        for path in sorted(counts):
            f.write(f"{path} {counts[path]}\n")


def _ratchet_failures(counts: dict[str, int], allowed: dict[str, int], out: str = "") -> list[str]:
    """What is wrong with ``counts`` (errors per file now) against ``allowed`` (the ratchet file): risen, then dropped."""
    risen = {p: (allowed.get(p, 0), n) for p, n in counts.items() if n > allowed.get(p, 0)}
    dropped = {p: (a, counts.get(p, 0)) for p, a in allowed.items() if counts.get(p, 0) < a}
    failures = []
    if risen:
        lines = [ln for ln in out.splitlines() if ln.split(":", 1)[0] in risen]
        failures.append("strict type errors rose (tests/mypy_ratchet.txt: allowed -> now): "
                        + ", ".join(f"{p}: {a} -> {n}" for p, (a, n) in sorted(risen.items())) + "\n" + "\n".join(lines[:60]))
    if dropped:
        failures.append("fewer strict type errors than tests/mypy_ratchet.txt allows: lower it "
                        "(python tests/test_typecheck.py --update): "
                        + ", ".join(f"{p}: {a} -> {n}" for p, (a, n) in sorted(dropped.items())))
    return failures


@pytest.mark.slow  # as above: minutes cold, seconds from mypy's cache
def test_strict_errors_over_the_whole_package_only_go_down():
    counts, out = _package_errors()
    failures = _ratchet_failures(counts, _read_ratchet(), out)
    assert not failures, "\n".join(failures)


def test_the_ratchet_fails_on_a_rise_a_new_file_and_a_drop():
    allowed = {"hubsoup/a.py": 3, "hubsoup/b.py": 1}
    assert _ratchet_failures({"hubsoup/a.py": 3, "hubsoup/b.py": 1}, allowed) == []
    rose = _ratchet_failures({"hubsoup/a.py": 4, "hubsoup/b.py": 1}, allowed, "hubsoup/a.py:7: error: bad  [x]")
    assert len(rose) == 1 and "hubsoup/a.py: 3 -> 4" in rose[0] and "hubsoup/a.py:7: error: bad" in rose[0]
    new = _ratchet_failures({**allowed, "hubsoup/c.py": 1}, allowed)
    assert len(new) == 1 and "hubsoup/c.py: 0 -> 1" in new[0]
    fell = _ratchet_failures({"hubsoup/a.py": 2}, allowed)  # b.py clean now: lower both
    assert len(fell) == 1 and "lower it" in fell[0] and "hubsoup/a.py: 3 -> 2" in fell[0] and "hubsoup/b.py: 1 -> 0" in fell[0]


def test_the_ratchet_file_names_real_files_in_order():
    allowed = _read_ratchet()
    assert list(allowed) == sorted(allowed) and all(n > 0 for n in allowed.values())
    missing = [p for p in allowed if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"tests/mypy_ratchet.txt names files that are gone (run --update): {missing}"
    strict = [p for p in allowed if any(p == s or p.startswith(s.rstrip("/") + "/") for s in STRICT)]
    assert not strict, f"files checked strict above have no allowance: {strict}"


if __name__ == "__main__":  # python tests/test_typecheck.py --update: the ratchet file as the package is now
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/test_typecheck.py --update")
    found, _ = _package_errors()
    _write_ratchet(found)
    print(f"{RATCHET}: {sum(found.values())} errors in {len(found)} files")
