"""Issue 44, item 5: a Ctrl-C at any moment of ``hubsoup merge``, ``run``, ``evolve`` and ``pipeline``, from the
first instant, gives one line and exit 130, and leaves nothing.

The probe: a SIGINT in the first seconds (while the CLI imported torch, before its handlers) printed a 6 to 64
line traceback (30/30). Here each command is a fresh ``hubsoup`` process (its console script, as a user starts it),
started from Python with SIGINT at its default disposition, and gets one SIGINT after a seeded random delay: 30 in
all (8 ``merge``, 8 ``run``, 7 ``evolve``, 7 ``pipeline``), a third of each command's drawn from its first 2 s
(the imports, where the probe failed), the rest over the whole of that command's measured run (each is run once
unsignalled first, to time it; at most 10 s). Three run at once. Each must end with exactly one line on stderr and
exit 130 (or 0 when it finished first, its output complete), and leave nothing: no output folder (unless the line
says it was committed before the signal, and then complete), no temporary folder, no lock, nothing in its own
``TMPDIR``. An evolve study folder and a pipeline's work folder are what those commands keep by design
(resumable); neither may hold a partial or temporary file or a lock.

Only the interpreter's own start-up (``site``, the console script's first line, before ``hubsoup``'s first line)
is outside hubsoup's reach: a signal there ends the process as Python's default handler does (exit -SIGINT; a
traceback whose every frame is the interpreter's; inside ``site``, Python's own "Fatal Python error: init_import_site"
and exit 1). Such an outcome is accepted only for a moment in the first 0.5 s, only without any hubsoup frame, and
counted in the summary line. The loop's helpers (``finish``, the
process interface it waits on) are ``tests/cli/test_kill_loop.py``'s.

``HUBSOUP_SIGNAL_SEED`` changes the draw (default 44).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from tests.cli.test_kill_loop import finish  # noqa: E402 - the kill loop's wait (a hung run's stacks, then a failure)

from hubsoup.testing import make_base, make_finetune, save_tiny_tokenizer, write_card_metadata

pytestmark = pytest.mark.slow

from paths import ROOT as REPO
HUBSOUP = os.path.join(os.path.dirname(sys.executable), "hubsoup")
SEED = int(os.environ.get("HUBSOUP_SIGNAL_SEED", "44"))
RUNS = {"merge": 8, "run": 8, "evolve": 7, "pipeline": 7}
AT_ONCE = 3
LEFTOVER = re.compile(r"\.partial-|\.lock$|\.old-|hubsoup-best-|\.tmp$|hubsoup-tasks-|hubsoup-datasets-|\.tmp\.")


class Fresh:
    """A fresh ``hubsoup`` process with SIGINT at its default disposition, shaped as the kill loop's ``Run`` (what
    its ``finish`` waits on): ``pid``, ``poll``, ``wait``, ``send_signal``, ``stderr``."""

    def __init__(self, args: list[str], cwd: str, env: dict[str, str]):
        self.err, self.out = cwd + ".err", cwd + ".out"  # beside the folder: it holds only what the command leaves
        with open(self.err, "w") as f, open(self.out, "w") as o:
            self.popen = subprocess.Popen([HUBSOUP, *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                          stdout=o, stderr=f,
                                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.started = time.monotonic()
        self.pid = self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stderr(self) -> str:
        with open(self.err) as f:
            return f.read()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """Tiny Llama models with a tokenizer, a perplexity file and the configs each command runs."""
    root = tmp_path_factory.mktemp("first-instant")
    base = make_base("llama", str(root / "base"), layers=2, hidden=64, vocab=128)
    save_tiny_tokenizer(base)
    write_card_metadata(base, license="apache-2.0")
    fts = []
    for i, name in enumerate(("ft-a", "ft-b"), start=1):
        ft = make_finetune(base, str(root / name), seed=i, scale=0.05)
        save_tiny_tokenizer(ft)
        write_card_metadata(ft, base_model="alice/base", license="apache-2.0")
        fts.append(ft)
    data = root / "val.jsonl"
    data.write_text("".join('{"text": "' + " ".join(f"w{(i * 7 + j * 3) % 100}" for j in range(12)) + '"}\n'
                            for i in range(6)))
    (root / "mk.yml").write_text(yaml.safe_dump({
        "merge_method": "ties", "base_model": base, "dtype": "float32",
        "models": [{"model": fts[0], "parameters": {"weight": 0.6, "density": 0.5}},
                   {"model": fts[1], "parameters": {"weight": 0.4, "density": 0.5}}]}))
    (root / "evolve.yml").write_text(yaml.safe_dump({
        "base": base, "models": fts, "method": "task_arithmetic", "space": {"scale": [0.2, 1.0]},
        "optimizer": "random", "trials": 2, "population": 2, "seed": 0, "eval": {"tasks": [f"perplexity:{data}"]}}))
    return {"root": root, "base": base, "fts": fts}


def command(name: str, zoo, i: int, folder: str) -> list[str]:
    base, fts, root = zoo["base"], zoo["fts"], zoo["root"]
    if name == "merge":
        return ["-q", "merge", *fts, "--base", base, "--method", "ties", "-p", "density=0.5", "--out", "out"]
    if name == "run":
        return ["-q", "run", str(root / "mk.yml"), "--out", "out"]
    if name == "evolve":
        return ["-q", "evolve", str(root / "evolve.yml"), "--out", "study"]
    pipeline = root / f"{os.path.basename(folder)}.yml"  # a repo name of its own: every run merges and pushes
    pipeline.write_text(yaml.safe_dump({
        "base": "alice/base", "candidates": {"models": ["bob/ft-a", "bob/ft-b"]}, "merges": [{"method": "linear"}],
        "push": {"namespace": "alice", "name": os.path.basename(folder).replace("_", "-") + "-{method}-{hash8}"},
        "work_dir": os.path.join(folder, "work"), "retry": {"attempts": 2, "base_wait": 0.01, "max_wait": 0.05}}))
    return ["-q", "pipeline", str(pipeline)]


def leftovers(folder: str) -> list[str]:
    return [os.path.relpath(os.path.join(d, n), folder) for d, dirs, files in os.walk(folder)
            for n in dirs + files if LEFTOVER.search(n)]


def check_left(name: str, folder: str, line: str) -> None:
    """Nothing left: per command, what it may keep; never a partial or temporary file, a lock, a TMPDIR entry."""
    assert leftovers(folder) == [], (name, leftovers(folder))
    tmp = os.path.join(folder, "tmp")
    in_tmp = {n: sorted(os.listdir(os.path.join(tmp, n))) if os.path.isdir(os.path.join(tmp, n)) else "file"
              for n in os.listdir(tmp)}
    assert in_tmp == {}, (name, in_tmp, line)
    kept = sorted(set(os.listdir(folder)) - {"tmp"})
    if name in ("merge", "run"):
        if "the output written before it is complete" in line:
            assert kept == ["out"] and os.path.isfile(os.path.join(folder, "out", "model.safetensors")), kept
        else:
            assert kept == [], (name, kept)
    elif name == "evolve":  # a study is resumable by design: its folder may stay, made by hubsoup, with no partial file
        assert kept in ([], ["study"]), kept
    else:  # the pipeline's work folder (its cache) may stay
        assert kept in ([], ["work"]), kept


@pytest.fixture(scope="module")
def env_base():
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": REPO + (os.pathsep + path if path else ""), "OMP_NUM_THREADS": "1",
            "TQDM_DISABLE": "1", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def start(name: str, zoo, i: int, tmp_path, env_base, token: str) -> tuple[Fresh, str]:
    folder = str(tmp_path / f"{name}-{i:02d}")
    if os.path.basename(str(tmp_path)) == "timing":
        folder = str(tmp_path / f"timing-{name}")
    os.makedirs(os.path.join(folder, "tmp"))
    env = {**env_base, "TMPDIR": os.path.join(folder, "tmp"), "HF_TOKEN": token, "HF_HUB_OFFLINE": "0"}
    return Fresh(command(name, zoo, i, folder), folder, env), folder


def startup_only(err: str) -> bool:
    """A traceback of the interpreter's start-up alone: no frame of hubsoup's (only ``site``, importlib, the script)."""
    frames = re.findall(r'File "([^"]+)"', err)
    return "KeyboardInterrupt" in err and not any("/hubsoup/" in f for f in frames)


def test_a_sigint_at_any_moment_from_the_first_instant_is_one_line_and_130(hub, zoo, tmp_path, env_base):
    for name in ("base", "ft-a", "ft-b"):
        hub.seed("alice/base" if name == "base" else f"bob/{name}",
                 zoo["base"] if name == "base" else zoo["fts"][0 if name == "ft-a" else 1])
    token = hub.login("alice")
    took = {}
    for name in RUNS:  # each command once, whole: it works, and how long it takes here
        proc, folder = start(name, zoo, 99, tmp_path / "timing", env_base, token)
        rc, err = finish(proc, timeout=300)
        took[name] = time.monotonic() - proc.started
        assert rc == 0, (name, err[-3000:], open(proc.out).read()[-3000:])
    rng = random.Random(SEED)
    plan = []
    for name, n in RUNS.items():
        for k in range(n):
            top = min(10.0, took[name] * 1.1)
            moment = rng.uniform(0, min(2.0, top)) if k < n // 3 + 1 else rng.uniform(0, top)
            plan.append((name, k, moment))
    rng.shuffle(plan)
    outcomes: dict[str, int] = {}
    for first in range(0, len(plan), AT_ONCE):
        batch = [(name, k, moment, *start(name, zoo, k, tmp_path, env_base, token))
                 for name, k, moment in plan[first:first + AT_ONCE]]
        for name, k, moment, proc, folder in sorted(batch, key=lambda b: b[2]):
            time.sleep(max(0.0, proc.started + moment - time.monotonic()))
            proc.send_signal(signal.SIGINT)
        for name, k, moment, proc, folder in batch:
            rc, err = finish(proc, timeout=120)
            lines = [ln for ln in err.splitlines() if ln.strip()]
            what = (name, round(moment, 3), rc, err[-3000:])
            if rc == -signal.SIGINT or (rc == 1 and "Fatal Python error: init_import_site" in err):
                # the interpreter's own start-up, before hubsoup's first line: Python's default handler (or, inside
                # `site`, its fatal "failed to import the site module")
                assert moment < 0.5 and (not err.strip() or startup_only(err)), what
                kind = "start-up"
            elif rc == 0:  # it finished before the signal came
                assert lines == [] or "Traceback" not in err, what
                kind = "finished"
            else:
                assert rc == 130, what
                assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("interrupted"), what
                kind = "interrupted"
            if kind != "finished":
                check_left(name, folder, lines[0] if lines else "")
            outcomes[f"{name} {kind}"] = outcomes.get(f"{name} {kind}", 0) + 1
    print(f"\n{len(plan)} SIGINTs (seed {SEED}) over {', '.join(f'{k} {v:.1f} s' for k, v in took.items())}: "
          f"{dict(sorted(outcomes.items()))}")
    interrupted = sum(v for k, v in outcomes.items() if k.endswith(" interrupted"))
    assert interrupted >= 2 * len(plan) // 3, outcomes  # most landed in the commands themselves
    for name in RUNS:  # every command was interrupted at least once, in its imports and later
        assert outcomes.get(f"{name} interrupted", 0) >= 2, outcomes
