"""Issue 31: SIGINT / SIGTERM at any moment of a merge ends it promptly (130 / 143) and leaves nothing.

A loop of real CLI merges (``tests/kill_loop_helper.py``: small pieces and four lanes, so lane threads
start, sweep and read ahead even on a tiny model), each signalled after a random delay drawn over the
whole merge, or (one run in five each) signalling itself while its lane threads start or as its read-ahead
thread starts, the narrow moments where runs hung or failed before. None may hang (a hung run's thread stacks are shown), each exits 130 / 143 with one line
(or 0 when it finished first, its output complete), and nothing is left beside the output: no partial
folder, no lock.

Each merge is a child forked by the helper's fork server (``kill_loop_helper.py --serve``) once its imports are
done, its own process from there on (its folder, environment, output files, signals and exit code): fifty fresh
interpreters importing torch were most of the loop's time.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from hubsoup.testing import make_base, make_finetune

pytestmark = pytest.mark.slow

from paths import ROOT as REPO
HELPER = os.path.join(REPO, "tests", "kill_loop_helper.py")
RUNS = int(os.environ.get("HUBSOUP_KILL_LOOP_RUNS", "50"))
AT_ONCE = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill-loop-models")
    base = make_base("llama", str(root / "base"), layers=4, hidden=128, vocab=512)
    return base, [make_finetune(base, str(root / f"ft-{i}"), seed=i) for i in (1, 2)]


class Run:
    """One merge: a child of the fork server (``kill_loop_helper.py --serve``), signalled and waited by pid."""

    def __init__(self, server: "Server", pid: int, err: str):
        self.server, self.pid, self.err = server, pid, err

    def poll(self) -> int | None:
        with self.server.ended:
            return self.server.exits.get(self.pid)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen.send_signal: never a pid that may be reused
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        with self.server.ended:
            self.server.ended.wait_for(lambda: self.pid in self.server.exits, timeout)
            return self.server.exits.get(self.pid)

    def stderr(self) -> str:
        with open(self.err) as f:
            return f.read()


class Server:
    """The helper imports once and forks each merge: fifty fresh interpreters' imports were most of the time."""

    def __init__(self):
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": REPO + (os.pathsep + path if path else "")}
        self.proc = subprocess.Popen([sys.executable, HELPER, "--serve"], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)
        self.exits: dict[int, int] = {}
        self.ended = threading.Condition()
        self.pids: queue.Queue[int] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "pid" in msg:
                self.pids.put(msg["pid"])
            else:
                with self.ended:
                    self.exits[msg["exit"]] = msg["rc"]
                    self.ended.notify_all()

    def start(self, args: list[str], cwd: str, env: dict[str, str]) -> Run:
        out, err = cwd + ".out", cwd + ".err"  # beside the folder: it must hold nothing but the output
        self.proc.stdin.write(json.dumps({"args": args, "cwd": cwd, "env": env, "out": out, "err": err}) + "\n")
        self.proc.stdin.flush()
        try:
            return Run(self, self.pids.get(timeout=180), err)
        except queue.Empty:
            pytest.fail(f"the fork server never answered (exit code {self.proc.poll()})")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def start(server: Server, models, folder: str, method: str, **extra: str) -> tuple[Run, str]:
    base, fts = models
    os.makedirs(folder)
    ready = os.path.join(folder, "..", os.path.basename(folder) + ".ready")
    args = ["merge", *fts, "--base", base, "--method", method, "--out", os.path.join(folder, "out"), "-q"]
    if method == "ties":
        args += ["-p", "density=0.5"]
    return server.start(args, folder, {"KILL_LOOP_READY": ready, **extra}), ready


def wait_ready(proc: Run, ready: str) -> None:
    deadline = time.monotonic() + 180
    while not os.path.exists(ready):
        assert proc.poll() is None, proc.stderr()
        assert time.monotonic() < deadline, "the helper never got ready"
        time.sleep(0.01)


def finish(proc: Run, timeout: float = 60) -> tuple[int, str]:
    rc = proc.wait(timeout)
    if rc is None:
        os.kill(proc.pid, signal.SIGUSR1)  # the stacks of every thread: where it hangs
        time.sleep(1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        pytest.fail(f"a signalled merge hung:\n{proc.stderr()[-6000:]}")
    return rc, proc.stderr()


def test_merges_signalled_at_random_moments_exit_promptly_and_leave_nothing(server, models, tmp_path):
    rng = random.Random(int(os.environ.get("HUBSOUP_KILL_LOOP_SEED", "31")))
    # how long a merge takes here (after the imports): the signals are drawn over it
    proc, ready = start(server, models, str(tmp_path / "timing"), "ties")
    wait_ready(proc, ready)
    t0 = time.monotonic()
    rc, err = finish(proc)
    took = time.monotonic() - t0
    assert rc == 0, err
    outcomes: dict[int, int] = {}
    for first in range(0, RUNS, AT_ONCE):
        batch = []
        for i in range(first, min(first + AT_ONCE, RUNS)):
            folder = str(tmp_path / f"run-{i:03d}")
            sig = rng.choice([signal.SIGINT, signal.SIGTERM])
            delay = rng.uniform(0, took * 1.1)
            # one run in five signals itself while its lanes start, one in five as its read-ahead starts
            at = {0: "lanes", 1: "readahead"}.get(i % 5, "")
            proc, ready = start(server, models, folder, "ties" if at else rng.choice(["ties", "linear", "task_arithmetic"]),
                                KILL_LOOP_AT=at, KILL_LOOP_SIGNAL=sig.name)
            batch.append((proc, ready, folder, sig, None if at else delay, at))
        for proc, ready, folder, sig, delay, at in batch:
            wait_ready(proc, ready)
        t = time.monotonic()
        for proc, ready, folder, sig, delay, at in sorted(batch, key=lambda b: -1 if b[4] is None else b[4]):
            if delay is not None:
                time.sleep(max(0.0, t + delay - time.monotonic()))
                proc.send_signal(sig)
        for proc, ready, folder, sig, delay, at in batch:
            signalled = time.monotonic()
            rc, err = finish(proc)
            assert time.monotonic() - signalled < 60
            want = {signal.SIGINT: 130, signal.SIGTERM: 143}[sig]
            left = sorted(os.listdir(folder))
            assert rc != 0 or not at, f"the run meant to be signalled as its {at} start finished"
            if rc == 0:  # it finished before the signal: a complete output, nothing else
                assert left == ["out"] and os.path.isfile(os.path.join(folder, "out", "model.safetensors")), left
            else:
                assert rc == want, (rc, sig, delay or at, err)
                lines = [ln for ln in err.splitlines() if ln.strip()]
                assert len(lines) == 1 and "Traceback" not in err, err
                if "no output was left behind" in lines[0]:
                    assert left == [], (left, sig, delay or at)
                else:  # the signal came after the output's commit (one atomic rename): complete, and said so
                    assert "the output written before it is complete" in lines[0], err
                    assert left == ["out"] and os.path.isfile(os.path.join(folder, "out", "model.safetensors")), left
            outcomes[rc] = outcomes.get(rc, 0) + 1
    print(f"\n{RUNS} merges signalled over {took:.2f} s: exit codes {outcomes}")
    assert sum(n for rc, n in outcomes.items() if rc) >= RUNS // 2, outcomes  # most were really interrupted
