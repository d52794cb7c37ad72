"""One driver per study: a lease row in the study's own database, with its holder's host, pid and a heartbeat.

Two ``hubsoup evolve`` drivers on the same storage (a database URL shared by a cluster, or one SQLite
file named by two configs) would both ask and tell the same generations. The first driver takes the
lease (an ``INSERT`` on the study's name: the database's unique key decides a race) and renews its
heartbeat every ``interval`` seconds from a background thread; a second driver is refused at once
with one line naming the storage and the holder (host, pid, last heartbeat). A driver that was
killed leaves its row: the next driver takes it over when the holder's pid is gone on this host, or
when its heartbeat is older than ``stale_after`` seconds (any host), by a compare-and-swap
``UPDATE`` on the old holder's id, so two drivers resuming at once still get one lease. A driver whose
lease was taken over (its heartbeat stalled that long) notices at its next renewal and stops between
generations.

Example:
    >>> lease = StudyLease(storage.engine, "hubsoup-evolve", "postgresql://db/studies")   # doctest: +SKIP
    >>> lease.acquire(); ...; lease.release()                                             # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from hubsoup.errors import StudyLockedError

if TYPE_CHECKING:
    from sqlalchemy import Connection, Row

log = logging.getLogger(__name__)

TABLE = "hubsoup_study_leases"
INTERVAL = 10.0
"""Seconds between heartbeats."""
STALE_AFTER = 120.0
"""A lease whose heartbeat is older than this is a killed driver's (hosts' clocks are assumed this close)."""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


class StudyLease:
    """The lease of study ``name`` in the database of ``engine`` (an SQLAlchemy engine: Optuna's RDB storage's)."""

    def __init__(self, engine: Any, name: str, where: str, *, interval: float = INTERVAL,
                 stale_after: float = STALE_AFTER):
        import sqlalchemy as sa  # lazy: optional extra (sqlalchemy, with optuna's storage)

        self.engine, self.name, self.where = engine, name, where
        self.interval, self.stale_after = interval, stale_after
        self.id = uuid.uuid4().hex
        self.host, self.pid = socket.gethostname(), os.getpid()
        meta = sa.MetaData()
        self.table = sa.Table(TABLE, meta, sa.Column("study", sa.String(512), primary_key=True),
                              sa.Column("holder", sa.String(32), nullable=False),
                              sa.Column("host", sa.String(255)), sa.Column("pid", sa.Integer),
                              sa.Column("started", sa.Float), sa.Column("heartbeat", sa.Float))
        meta.create_all(engine, checkfirst=True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False

    def _row(self, conn: Connection) -> Row[Any] | None:
        t = self.table
        return conn.execute(t.select().where(t.c.study == self.name)).first()

    def acquire(self) -> None:
        """Take the lease, or take over a killed driver's; :class:`StudyLockedError` when a live driver holds it."""
        import sqlalchemy as sa  # lazy: optional extra (sqlalchemy, with optuna's storage)

        t = self.table
        now = time.time()
        mine = {"holder": self.id, "host": self.host, "pid": self.pid, "started": now, "heartbeat": now}
        for _ in range(5):
            try:
                with self.engine.begin() as conn:
                    conn.execute(t.insert().values(study=self.name, **mine))
                break
            except sa.exc.IntegrityError:
                pass
            with self.engine.begin() as conn:
                row = self._row(conn)
                if row is None:  # released meanwhile: insert again
                    continue
                why = self._stale(row)
                if why is None:
                    age = max(0.0, time.time() - (row.heartbeat or 0.0))
                    raise StudyLockedError(
                        f"the study '{self.name}' in {self.where} is being run by another driver (host {row.host}, "
                        f"pid {row.pid}, last heartbeat {age:.0f} s ago); wait for it to finish, or stop it "
                        f"(a killed driver's lease is taken over after {self.stale_after:.0f} s)")
                taken = conn.execute(t.update().where((t.c.study == self.name) & (t.c.holder == row.holder))
                                     .values(**mine)).rowcount
            if taken == 1:
                log.warning("taking over the study '%s' in %s from the driver on %s (pid %s): %s", self.name,
                            self.where, row.host, row.pid, why)
                break
        else:
            raise StudyLockedError(f"the study '{self.name}' in {self.where}: could not take its lease (other drivers "
                                  "keep taking it)")
        self._thread = threading.Thread(target=self._beat, name="hubsoup-study-lease", daemon=True)
        self._thread.start()

    def _stale(self, row: Row[Any]) -> str | None:
        """Why the holder of ``row`` is gone (None: it may be alive)."""
        if row.host == self.host and isinstance(row.pid, int) and row.pid != self.pid and not _alive(row.pid):
            return "its process is gone"
        age = time.time() - (row.heartbeat or 0.0)
        if age > self.stale_after:
            return f"its heartbeat stopped {age:.0f} s ago"
        return None

    def _beat(self) -> None:
        t = self.table
        while not self._stop.wait(self.interval):
            try:
                with self.engine.begin() as conn:
                    n = conn.execute(t.update().where((t.c.study == self.name) & (t.c.holder == self.id))
                                     .values(heartbeat=time.time())).rowcount
            except Exception:  # noqa: BLE001 - a database hiccup: the next beat tries again
                log.debug("heartbeat of study %s failed", self.name, exc_info=True)
                continue
            if n == 0:
                self.lost = True
                return

    def check(self) -> None:
        """Raise :class:`StudyLockedError` when another driver took the lease over (this one's heartbeat stalled)."""
        if self.lost:
            raise StudyLockedError(f"the study '{self.name}' in {self.where} was taken over by another driver (this "
                                  f"one's heartbeat stalled over {self.stale_after:.0f} s); this driver stops")

    def release(self) -> None:
        """Give the lease back (idempotent; never raises)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        t = self.table
        try:
            with self.engine.begin() as conn:
                conn.execute(t.delete().where((t.c.study == self.name) & (t.c.holder == self.id)))
        except Exception:  # noqa: BLE001 - a lease left behind is taken over by the next driver
            log.debug("could not release the lease of study %s", self.name, exc_info=True)


__all__ = ["StudyLease", "INTERVAL", "STALE_AFTER"]
