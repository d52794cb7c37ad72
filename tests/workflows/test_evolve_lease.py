"""One driver per evolve study: a second driver on the same storage is refused; a killed driver's lease is taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("optuna", reason="hubsoup[evolve] is not installed")

from hubsoup.errors import StudyLockedError  # noqa: E402
from hubsoup.workflows.evolve import evolve  # noqa: E402
from hubsoup.workflows.executors import LocalExecutor  # noqa: E402
from hubsoup.workflows.study_lease import TABLE, StudyLease  # noqa: E402
from tests.workflows.test_evolve import config, table, tiny  # noqa: E402,F401 - the same tiny models and config
import paths  # tests/paths.py: the repository's root, wherever a test module sits


def engine(path):
    import sqlalchemy as sa

    return sa.create_engine(f"sqlite:///{path}")


def rows(path):
    import sqlalchemy as sa

    with engine(path).connect() as c:
        return [dict(r._mapping) for r in c.execute(sa.text(f"SELECT * FROM {TABLE}"))]


# --- the lease itself -------------------------------------------------------------------------------

def test_a_live_holder_refuses_a_second_driver_and_release_frees_it(tmp_path):
    db = tmp_path / "s.db"
    a = StudyLease(engine(db), "study", "sqlite:///s.db")
    b = StudyLease(engine(db), "study", "sqlite:///s.db")
    a.acquire()
    try:
        with pytest.raises(StudyLockedError) as e:
            b.acquire()
        msg = str(e.value)
        assert "\n" not in msg and "sqlite:///s.db" in msg
        assert f"host {socket.gethostname()}, pid {os.getpid()}" in msg
        StudyLease(engine(db), "another study", "x").acquire()  # a lease is per study name
    finally:
        a.release()
    b.acquire()  # released: the next driver takes it
    b.release()
    assert [r["study"] for r in rows(db)] == ["another study"]


def test_a_stale_heartbeat_is_taken_over_and_the_old_holder_notices(tmp_path):
    db = tmp_path / "s.db"
    a = StudyLease(engine(db), "study", "db", interval=0.05, stale_after=30)
    a.acquire()
    beat = rows(db)[0]["heartbeat"]
    time.sleep(0.3)
    assert rows(db)[0]["heartbeat"] > beat  # the heartbeat thread renews it
    a._stop.set()  # a's driver hangs (its heartbeat stops), on another host
    a._thread.join()
    import sqlalchemy as sa

    with engine(db).begin() as c:
        c.execute(sa.text(f"UPDATE {TABLE} SET host='elsewhere', heartbeat=:t"), {"t": time.time() - 20})
    b = StudyLease(engine(db), "study", "db", stale_after=30)
    with pytest.raises(StudyLockedError, match="host elsewhere"):
        b.acquire()  # 20 s without a heartbeat: still alive for all we know
    with engine(db).begin() as c:
        c.execute(sa.text(f"UPDATE {TABLE} SET heartbeat=:t"), {"t": time.time() - 31})
    b.acquire()  # 31 s: a killed driver's; taken over
    assert rows(db)[0]["holder"] == b.id
    a._stop.clear()
    a._thread = threading.Thread(target=a._beat)
    a._thread.start()  # a wakes up: its next heartbeat finds the lease gone, and it stops between generations
    a._thread.join(timeout=5)
    with pytest.raises(StudyLockedError, match="taken over by another driver"):
        a.check()
    a.release()  # releases nothing of b's
    assert rows(db)[0]["holder"] == b.id
    b.release()


# --- evolve with two drivers ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_second_driver_on_the_same_storage_is_refused(tiny, tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    cfg = config(tiny, trials=2, population=4, storage=storage)
    started, go = threading.Event(), threading.Event()

    class Held(LocalExecutor):  # driver A: holds its first generation until driver B has tried
        def run(self, payloads, **kw):
            started.set()
            go.wait(60)
            return super().run(payloads, **kw)

    done = {}
    a = threading.Thread(target=lambda: done.setdefault("a", evolve(cfg, str(tmp_path / "a"), quiet=True,
                                                                     executor=Held())))
    a.start()
    assert started.wait(60)
    try:
        with pytest.raises(StudyLockedError) as e:
            evolve(cfg, str(tmp_path / "b"), quiet=True)
    finally:
        go.set()
        a.join(60)
    assert "\n" not in str(e.value) and storage in str(e.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}" in str(e.value)
    assert not os.path.exists(tmp_path / "b" / "model.safetensors")
    assert [r["number"] for r in table(str(tmp_path / "a"))["trials"]] == [0, 1]  # A ran the study alone
    assert rows(tmp_path / "shared.db") == []  # and gave the lease back


_HOLDER = """
import sqlalchemy as sa, sys, time
from hubsoup.workflows.study_lease import StudyLease
StudyLease(sa.create_engine(sys.argv[1]), "hubsoup-evolve", "x").acquire()
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_drivers_lease_does_not_block_resumption(tiny, tmp_path):
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([paths.ROOT,
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, storage], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"held"
        cfg = config(tiny, trials=2, population=4, storage=storage)
        with pytest.raises(StudyLockedError, match=f"pid {proc.pid}"):
            evolve(cfg, str(tmp_path / "out"), quiet=True)  # alive: refused
        proc.send_signal(signal.SIGKILL)  # the driver is killed: its lease stays in the database
        proc.wait(30)
        assert [r["pid"] for r in rows(tmp_path / "shared.db")] == [proc.pid]
        res = evolve(cfg, str(tmp_path / "out"), quiet=True)  # its pid is gone on this host: taken over
        assert [r["number"] for r in res.trials] == [0, 1]
        assert rows(tmp_path / "shared.db") == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
