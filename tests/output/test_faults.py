"""Faults (issue 12): concurrent runs, kills, SIGTERM, a full disk, a read-only output.

Each case asserts the exit code, the one-line message (no traceback) and that no partial
output, temporary folder or lock file is left. Kills, signals, locks and the full disk use
real subprocesses: ``tests/fault_helper.py`` runs the CLI with a fault injected (a pause at
the first tensor written, a crash inside the commit); the disk-full and read-only cases
mount a small tmpfs (root only; skipped with the reason otherwise).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

import hubsoup
from hubsoup import continual
from hubsoup.cli import main as cli_main
from hubsoup.errors import DiskFullError, OutputLockedError
from hubsoup.output import ShardedWriter, lock_output
from hubsoup.output import folder as folder_mod

from paths import ROOT as REPO
HELPER = os.path.join(REPO, "tests", "fault_helper.py")


# --- helpers ---------------------------------------------------------------------------------------

def _env(**extra) -> dict:
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": REPO + (os.pathsep + path if path else ""), **extra}


def hubsoup_cli(*args, cwd) -> subprocess.CompletedProcess:
    """A real ``python -m hubsoup`` run, from this working tree."""
    return subprocess.run([sys.executable, "-m", "hubsoup", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=180)


def paused(*args, cwd, marker) -> subprocess.Popen:
    """The CLI paused at its first tensor written (``marker`` then exists) until ``marker.go`` exists."""
    proc = subprocess.Popen([sys.executable, HELPER, *args], cwd=cwd, env=_env(FAULT_PAUSE=str(marker)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(marker):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the paused run exited early ({proc.returncode}): {err or out}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the paused run never reached its first write")
        time.sleep(0.05)
    return proc


def resume(proc: subprocess.Popen, marker) -> tuple[int, str, str]:
    open(f"{marker}.go", "w").close()
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


def leftovers(folder, name="out") -> list[str]:
    """Temporary folders, old copies and lock files of output ``name`` left in ``folder``."""
    return sorted(p for p in os.listdir(folder) if p.startswith(f".{name}."))


def weights(folder) -> bytes:
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        return f.read()


def merge_args(llama, out, *extra):
    base, fts = llama
    return ["merge", fts[0], fts[1], "--base", base, "--method", "task_arithmetic", "--out", str(out), "-q", *extra]




# --- 4. concurrent writers ---------------------------------------------------------------------------

def test_second_merge_on_the_same_out_fails_at_once_naming_the_first(llama, tmp_path):
    out, marker = tmp_path / "out", tmp_path / "first-is-writing"
    first = paused(*merge_args(llama, out), cwd=tmp_path, marker=marker)
    try:
        second = hubsoup_cli(*merge_args(llama, out, "--overwrite", "-p", "scale=0.5"), cwd=tmp_path)
        assert first.poll() is None  # the second did not wait for the first
    finally:
        code, _, err = resume(first, marker)
    assert second.returncode == 2
    line = one_line(second.stderr)
    assert line.startswith(f"error: output '{out}' is in use by another hubsoup run: pid {first.pid} on "
                           f"{socket.gethostname()}, started "), line
    assert "fault_helper.py merge" in line and "--method task_arithmetic" in line
    assert code == 0, err
    assert hubsoup.MergeResult.from_folder(str(out)).params["scale"] is None  # the first run's output (default scale)
    assert leftovers(tmp_path) == []  # no lock file, no temporary folder


def test_second_continual_add_fails_at_once_and_no_model_is_lost(llama, tmp_path):
    base, (a, b, c) = llama
    soup = str(tmp_path / "soup")
    continual.init([a, b], base=base, out=soup, quiet=True)
    marker = tmp_path / "first-is-writing"
    first = paused("continual", "add", soup, c, "-q", cwd=tmp_path, marker=marker)
    try:
        second = hubsoup_cli("continual", "add", soup, a, "-q", cwd=tmp_path)
        # export reads the state: it waits for no one either
        with pytest.raises(OutputLockedError, match=f"continual soup '{soup}' is in use by .*pid {first.pid}"):
            continual.export(soup, out=str(tmp_path / "exported"), quiet=True)
        assert first.poll() is None
    finally:
        code, _, err = resume(first, marker)
    assert second.returncode == 2
    line = one_line(second.stderr)
    assert line.startswith(f"error: continual soup '{soup}' is in use by another hubsoup run: pid {first.pid}"), line
    assert "continual add" in line
    assert code == 0, err
    assert continual.load_state(soup).count == 3  # a, b, c
    continual.add(soup, [a], quiet=True)  # the second add, once the first is done: nothing is lost
    models = [m["path"] for m in continual.load_state(soup).models]
    assert [os.path.abspath(m) for m in models] == [os.path.abspath(p) for p in (a, b, c, a)]
    assert leftovers(tmp_path, "soup") == [] and not os.path.exists(tmp_path / "exported")


def test_every_workflow_locks_its_output_before_any_work(llama, tmp_path):
    from hubsoup.workflows.search import search
    from hubsoup.workflows.soups import greedy_soup
    from hubsoup.workflows.sweep import sweep

    base, fts = llama
    out, marker = tmp_path / "out", tmp_path / "first-is-writing"
    first = paused(*merge_args(llama, out), cwd=tmp_path, marker=marker)
    busy = f"output '{out}' is in use by another hubsoup run: pid {first.pid} "
    calls = {
        "merge": lambda: hubsoup.merge(fts[:2], "linear", base=base, out=str(out), quiet=True),
        "search": lambda: search(fts[:2], "task_arithmetic", base=base, out=str(out), grid={"scale": [0.5, 1.0]},
                                 score_fn=lambda folder: pytest.fail("search scored before locking")),
        "sweep": lambda: sweep(fts[:2], "linear", str(out), "0:1:0.5", base=base, quiet=True),
        "greedy_soup": lambda: greedy_soup(fts[:2], lambda folder: pytest.fail("greedy soup scored before locking"),
                                           base=base, out=str(out)),
        "continual.init": lambda: continual.init(fts[:2], base=base, out=str(out), quiet=True),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(OutputLockedError) as info:
                call()
            assert busy in str(info.value), name
        assert first.poll() is None
    finally:
        code, _, err = resume(first, marker)
    assert code == 0, err
    assert leftovers(tmp_path) == []


def test_a_lock_on_a_file_system_without_flock_follows_the_pid_rule(llama, tmp_path, monkeypatch, caplog):
    base, fts = llama
    out = tmp_path / "out"

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(folder_mod.fcntl, "flock", no_flock)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        info = {"pid": sleeper.pid, "host": socket.gethostname(), "started": time.time(), "command": "hubsoup merge x"}
        (tmp_path / ".out.lock").write_text(json.dumps(info))
        with pytest.raises(OutputLockedError, match=f"pid {sleeper.pid} on .*`hubsoup merge x`"):
            hubsoup.merge(fts[:1], "linear", base=base, out=str(out), quiet=True)
    finally:
        sleeper.kill()
        sleeper.wait()
    # the holder is gone on this host: its lock is stale, taken over with a warning
    with caplog.at_level(logging.WARNING, logger="hubsoup.output.folder"):
        hubsoup.merge(fts[:1], "linear", base=base, out=str(out), quiet=True)
    assert f"taking over the lock on '{out}' left by another hubsoup run: pid {sleeper.pid}" in caplog.text
    assert leftovers(tmp_path) == []


def test_the_lock_is_reentrant_in_its_thread_only(tmp_path):
    import threading

    target = str(tmp_path / "out")
    outer = lock_output(target)
    inner = lock_output(target)  # e.g. a greedy soup's final merge into its own locked output
    inner.release()
    assert os.path.exists(folder_mod.lock_file(target))
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(OutputLockedError, lock_output, target)))
    t.start()
    t.join()
    assert errors and "another thread of this process" in str(errors[0].value)
    outer.release()
    assert leftovers(tmp_path) == []


# --- 6. kills, signals, the commit -----------------------------------------------------------------

def test_kill_9_mid_merge_then_the_next_run_cleans_up(llama, tmp_path, caplog, capsys):
    out, marker = tmp_path / "out", tmp_path / "first-is-writing"
    assert cli_main(merge_args(llama, out)) == 0
    old = weights(out)
    proc = paused(*merge_args(llama, out, "--overwrite", "-p", "scale=0.5"), cwd=tmp_path, marker=marker)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    left = leftovers(tmp_path)
    assert ".out.lock" in left and any(p.startswith(".out.partial-") for p in left), left
    assert weights(out) == old  # --out is never missing
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="hubsoup.output.folder"):
        assert cli_main(merge_args(llama, out, "--overwrite", "-p", "scale=0.5")) == 0
    assert f"taking over the lock on '{out}' left by another hubsoup run: pid {proc.pid}" in caplog.text
    assert "its run was killed" in caplog.text
    partial = next(p for p in left if p.startswith(".out.partial-"))
    assert f"removed 1 temporary folder(s) left beside '{out}' by an interrupted run: {partial}" in caplog.text
    assert "Traceback" not in capsys.readouterr().err
    assert leftovers(tmp_path) == [] and weights(out) != old


def test_a_crash_between_the_two_renames_of_the_commit_restores_the_old_output(llama, tmp_path, caplog, capsys):
    out = tmp_path / "out"
    assert cli_main(merge_args(llama, out)) == 0
    old = weights(out)
    proc = subprocess.run([sys.executable, HELPER, *merge_args(llama, out, "--overwrite", "-p", "scale=0.5")],
                          cwd=tmp_path, env=_env(FAULT_CRASH_IN_COMMIT="1"), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert not out.exists()
    left = leftovers(tmp_path)
    assert any(p.startswith(".out.old-") for p in left) and any(p.startswith(".out.partial-") for p in left), left
    capsys.readouterr()
    # the next run on that output restores the old one (the interrupted run has no effect), then refuses it as usual
    with caplog.at_level(logging.WARNING, logger="hubsoup.output.folder"):
        assert cli_main(merge_args(llama, out)) == 2
    assert one_line(capsys.readouterr().err) == f"error: output '{out}' already exists; pass --overwrite " \
                                                "(overwrite=True) to replace it"
    assert f"restored '{out}' from '.out.old-" in caplog.text
    assert weights(out) == old
    assert leftovers(tmp_path) == []


def test_the_commit_swaps_the_outputs_atomically_so_out_is_never_missing(llama, tmp_path, caplog, capsys):
    """Issue 31: with renameat2 (Linux), a crash at the commit leaves --out in place: the new output, complete."""
    if not folder_mod.exchange(str(tmp_path), str(tmp_path)):
        pytest.skip("no atomic exchange of folders here (renameat2): the two-rename path above covers the crash")
    out = tmp_path / "out"
    assert cli_main(merge_args(llama, out)) == 0
    old = weights(out)
    proc = subprocess.run([sys.executable, HELPER, *merge_args(llama, out, "--overwrite", "-p", "scale=0.5")],
                          cwd=tmp_path, env=_env(FAULT_CRASH_AFTER_EXCHANGE="1"), capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert out.is_dir() and weights(out) != old  # the new output, in place at once
    new = weights(out)
    assert any(p.startswith(".out.partial-") for p in leftovers(tmp_path))  # the old one, not yet removed
    capsys.readouterr()
    with caplog.at_level(logging.WARNING, logger="hubsoup.output.folder"):  # the next run cleans up
        assert cli_main(merge_args(llama, out, "--overwrite", "-p", "scale=0.5")) == 0
    assert "removed 1 temporary folder(s)" in caplog.text
    assert weights(out) == new and leftovers(tmp_path) == []


@pytest.mark.parametrize("sig,code,message", [
    (signal.SIGTERM, 143, "terminated (SIGTERM); no output was left behind"),
    (signal.SIGINT, 130, "interrupted; no output was left behind"),
], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_merge_cleans_up(llama, tmp_path, sig, code, message):
    out, marker = tmp_path / "out", tmp_path / "first-is-writing"
    proc = paused(*merge_args(llama, out), cwd=tmp_path, marker=marker)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    assert one_line(err) == message
    assert not out.exists() and leftovers(tmp_path) == []


def test_leftovers_of_other_outputs_are_not_touched(tmp_path):
    (tmp_path / "soup").mkdir()
    for name in (".soup.old-x.partial-abc", ".soup.partial-x.lock", ".soupy.partial-abc", ".soup.old-abc"):
        (tmp_path / name).mkdir()
    folder_mod.recover(str(tmp_path / "soup"))  # soup exists: its `.soup.old-abc` is an old copy to remove
    assert sorted(os.listdir(tmp_path)) == [".soup.old-x.partial-abc", ".soup.partial-x.lock", ".soupy.partial-abc",
                                            "soup"]


# --- 6. disk full, read-only -----------------------------------------------------------------------

def test_disk_full_gives_one_line_and_leaves_nothing(llama, small_disk):
    mnt = small_disk("64k")  # the tiny Llama's weights are ~110 kB
    out = os.path.join(mnt, "out")
    proc = hubsoup_cli(*merge_args(llama, out), cwd=os.path.dirname(mnt))
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert line.startswith(f"error: disk full while writing model.safetensors in {out}: "), line
    assert " bytes needed (" in line and "were free when writing started)" in line
    assert os.listdir(mnt) == []


def test_abort_never_raises_and_a_failing_write_leaves_nothing(llama, tmp_path, monkeypatch):
    class Unclosable:
        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    w = ShardedWriter(str(tmp_path), [("a", (4,), torch.float32)], 1000)
    w.handles.insert(0, Unclosable())
    w.abort()  # does not raise; the real file is closed too
    assert w.handles == []

    def full(self, name, tensor):
        self.handles.insert(0, Unclosable())  # closing fails too, as on a full disk
        raise self._disk_full(OSError(errno.ENOSPC, "No space left on device"), self.files[0])

    monkeypatch.setattr(ShardedWriter, "write", full)
    base, fts = llama
    with pytest.raises(DiskFullError, match=r"disk full while writing model.safetensors in .*/out: \d+ bytes needed"):
        hubsoup.merge(fts[:1], "linear", base=base, out=str(tmp_path / "out"), quiet=True)
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_read_only_output_folder_gives_one_line(llama, tmp_path, small_disk):
    if os.geteuid() == 0:
        ro = small_disk("64k", ro=True)  # root writes through permission bits: a read-only mount
        why = "read-only file system"
    else:
        ro = str(tmp_path / "ro")
        os.mkdir(ro, 0o555)
        why = "permission denied"
    out = os.path.join(ro, "out")
    proc = hubsoup_cli(*merge_args(llama, out), cwd=tmp_path)
    assert proc.returncode == 2
    assert one_line(proc.stderr) == (f"error: cannot write the output '{out}': {why} ({ro}/.out.lock); "
                                     "choose another --out")
    assert os.listdir(ro) == []


# --- 8. permissions --------------------------------------------------------------------------------

@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o027, 0o750)])
def test_the_output_folder_has_the_users_umask(llama, tmp_path, umask, mode):
    base, fts = llama
    previous = os.umask(umask)
    try:
        res = hubsoup.merge(fts[:1], "linear", base=base, out=str(tmp_path / "out"), quiet=True)
    finally:
        os.umask(previous)
    assert os.stat(res.path).st_mode & 0o777 == mode
