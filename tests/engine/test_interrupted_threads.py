"""The engine's threads interrupted while starting: the read-ahead closes, the lanes leave no thread waiting."""

from __future__ import annotations

import pytest



def test_read_ahead_closes_when_interrupted_before_its_thread_started(monkeypatch, tmp_path):
    """Ctrl-C between the read-ahead thread's creation and its start: close() must not raise
    ('cannot join thread before it is started'), and no thread is left behind."""
    import threading

    from hubsoup.engine.prefetch import ReadAhead

    data = tmp_path / "f"
    data.write_bytes(b"x" * 4096)
    real_start = threading.Thread.start

    def interrupted(self):
        if self.name == "hubsoup-readahead":
            raise KeyboardInterrupt
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", interrupted)
    ahead = ReadAhead()
    with pytest.raises(KeyboardInterrupt):
        ahead.request([(str(data), 0, 4096)])
    ahead.close()  # the engine's cleanup
    ahead.close()
    assert not [t for t in threading.enumerate() if t.name == "hubsoup-readahead"]


def test_lanes_interrupted_while_starting_leave_no_thread_waiting(monkeypatch):
    """Ctrl-C while the main thread waits for the lane threads to start: none stays in Barrier.wait
    (which made the interpreter hang at exit)."""
    import threading
    import time

    from hubsoup import linalg
    from hubsoup.engine import lanes

    slow = linalg._one_thread  # the lanes' pool is linalg's one_thread_pool
    monkeypatch.setattr(linalg, "_one_thread", lambda: (time.sleep(0.2), slow()))
    monkeypatch.setattr(linalg, "_POOLS", {})
    real_wait = threading.Barrier.wait

    def wait(self, timeout=None):
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt  # as a signal arriving while the lanes start
        return real_wait(self, timeout)

    earlier = set(threading.enumerate())  # lane threads of earlier merges in this process (kept per process)
    monkeypatch.setattr(threading.Barrier, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        lanes.run(lambda j: j, 3)

    def started() -> list:
        return [t for t in threading.enumerate() if t.name.startswith("hubsoup-lane") and t not in earlier]

    deadline = time.monotonic() + 10
    while started() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started()
    assert linalg._POOLS == {}
    monkeypatch.setattr(threading.Barrier, "wait", real_wait)
    assert lanes.run(lambda j: j * 2, 3) == [0, 2, 4]  # the next run makes a new pool
