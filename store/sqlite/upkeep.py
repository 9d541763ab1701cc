"""Background upkeep of a SQLite store: WAL checkpoints off the writers' path, and pruning.

Checkpoints. By default SQLite checkpoints inside the commit that pushes the WAL
past 1,000 pages: with synchronous=NORMAL that commit also pays the checkpoint's
fsyncs, once every few hundred single-row writes, and that write's caller waits for
them. Here a daemon thread in each writing process checkpoints (PASSIVE: it
never blocks a writer or a reader) shortly after commits; a writer checkpoints
for itself only if the WAL reaches WRITER_CHECKPOINT_PAGES, when this thread is
stalled or gone. Threads of several processes share the checkpoint lock: a busy
one just tries again later.

The thread runs under SCHED_IDLE (Linux): a checkpoint only copies pages that are
already durable in the WAL, so nobody waits on it, and any runnable thread should
have the core first. At normal priority, on two cores, it is a third runnable thread
beside a writer flat out and the feed's consumer, and a consumer woken by a commit
waits for a core behind it (`python -m bench.store --part feed` measures the lag).

Restarts. A PASSIVE checkpoint copies the frames there were when it began, and under a
steady stream of commits more arrive while it syncs, so the log is never wholly copied
when the next writer starts and the WAL does not start over. Left at that, it grows
until a writer's own checkpoint at WRITER_CHECKPOINT_PAGES, which holds the write lock,
copies the rest: inside a completion's commit on a worker's event loop, where the claims
queued on that loop wait out its fsync. So once a PASSIVE checkpoint leaves the WAL
at RESTART_FRAMES or more, a second thread, at normal priority since it holds the write
lock, runs a RESTART checkpoint: it waits up to RESTART_WAIT_MS for the writer and the
readers of older snapshots, copies the few frames the PASSIVE one left, and the next
writer starts the log over. Writers wait for it as for any writer (a completion on its
event loop, where claims go on); a RESTART that cannot get its turn in time does a
PASSIVE one's work and is tried again after the next.

Pruning. Every `prune_interval_s` the log's floor is raised to the lowest cursor a
registered consumer saved; each write then trims a few entries below it inside its
own transaction (see store.sqlite.schema), since one bulk delete would hold the write
lock for as long as it takes and every writer would wait. The raise is itself a short write,
so it is made by the first writer to commit after the interval (`committed()` says
when), not by the idle-priority thread: holding the write lock there, that thread
could be kept off the core while every writer waited. The log grows only while a
consumer does not save its cursor (or is registered and gone: `drop_consumer`).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable

import msgspec

from store.scheduling import lower_to_idle
from store.sqlite.conn import connect, is_busy

INTERVAL_S = 0.05
WRITER_CHECKPOINT_PAGES = 40_000
# Well under the writers' own threshold, so the restart comes first. Each restart's sync
# holds the write lock: the rarer they are, the more the writers commit, at the price of
# a longer WAL (20,000 frames of 4 KiB pages are about 80 MB)
# (docs/decisions/0007-the-wal-restarted-off-the-event-loop.md).
RESTART_FRAMES = 20_000
RESTART_WAIT_MS = 20
PRUNE_INTERVAL_S = 10.0


class UpkeepStatistics(msgspec.Struct, frozen=True, kw_only=True):
    running: bool
    idle_priority: bool  # the thread runs under SCHED_IDLE
    checkpoints: int  # PASSIVE checkpoints run
    busy: int  # skipped because another connection held the checkpoint lock
    errors: int
    wal_frames: int  # frames in the WAL at the last checkpoint
    restarts: int  # RESTART checkpoints that started the WAL over
    restarts_busy: int  # RESTART checkpoints that could not get their turn in time
    longest_checkpoint_ms: float
    floor_raises: int
    backlog: int  # log entries below the floor at the last raise, left for writes to trim
    last_error: str


class Upkeep:
    def __init__(
        self,
        path: str | os.PathLike[str],
        raise_floor: Callable[[], int] | None = None,
        prune_interval_s: float | None = PRUNE_INTERVAL_S,
    ) -> None:
        self._path = path
        self._prune = raise_floor if prune_interval_s else None
        self._prune_interval_s = prune_interval_s or 0.0
        self._next_prune = time.monotonic() + self._prune_interval_s
        self._idle_priority = False
        self._commits = 0
        self._seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarter: threading.Thread | None = None
        self._restart_due = threading.Event()
        self._lock = threading.Lock()
        self._checkpoints = self._busy = self._errors = self._frames = 0
        self._floor_raises = self._backlog = 0
        self._longest_s = 0.0
        self._restarts = self._restarts_busy = 0
        self._last_error = ""

    def committed(self) -> None:
        """A writer's note that the WAL grew; starts the thread on the first one, and raises
        the log's floor when that is due (on the writer's thread, see the module's note)."""
        self._commits += 1
        if self._prune is not None and time.monotonic() >= self._next_prune:
            self._next_prune = time.monotonic() + self._prune_interval_s
            self._prune_once(self._prune)
        if self._thread is None:
            with self._lock:
                if self._thread is None and not self._stop.is_set():
                    self._thread = threading.Thread(
                        target=self._run, name="rq-store-upkeep", daemon=True
                    )
                    self._thread.start()

    def _run(self) -> None:
        conn: sqlite3.Connection | None = None
        self._idle_priority = lower_to_idle()
        try:
            conn = connect(self._path)
            while not self._stop.wait(INTERVAL_S):
                if self._commits != self._seen:
                    self._seen = self._commits
                    self._checkpoint(conn)
                    if self._frames >= RESTART_FRAMES:
                        self._call_restart()
        finally:
            if conn is not None:
                conn.close()

    def _call_restart(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            if self._restarter is None:
                self._restarter = threading.Thread(
                    target=self._restart_forever, name="rq-store-restart", daemon=True
                )
                self._restarter.start()
        self._restart_due.set()

    def _restart_forever(self) -> None:
        """The restarts' thread, at the process's normal priority (module note)."""
        conn: sqlite3.Connection | None = None
        try:
            conn = connect(self._path)
            conn.execute(f"PRAGMA busy_timeout = {RESTART_WAIT_MS}")
            while True:
                self._restart_due.wait()
                self._restart_due.clear()
                if self._stop.is_set():
                    return
                self._restart(conn)
        except sqlite3.Error as exc:
            self._errors += 1
            self._last_error = f"restart: {exc}"
        finally:
            if conn is not None:
                conn.close()

    def _restart(self, conn: sqlite3.Connection) -> None:
        started = time.monotonic()
        try:
            busy, frames, _ = conn.execute("PRAGMA wal_checkpoint(RESTART)").fetchone()
        except sqlite3.OperationalError as exc:
            if is_busy(exc):
                self._restarts_busy += 1
            else:
                self._errors += 1
                self._last_error = f"restart: {exc}"
            return
        if busy:
            self._restarts_busy += 1
        else:
            self._restarts += 1
        self._frames = int(frames)
        self._longest_s = max(self._longest_s, time.monotonic() - started)

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        started = time.monotonic()
        try:
            busy, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.OperationalError as exc:
            if is_busy(exc):
                self._busy += 1
            else:
                self._errors += 1
                self._last_error = f"checkpoint: {exc}"
            return
        if busy:
            self._busy += 1
        self._checkpoints += 1
        self._frames = int(frames)
        self._longest_s = max(self._longest_s, time.monotonic() - started)

    def _prune_once(self, raise_floor: Callable[[], int]) -> None:
        try:
            self._backlog = raise_floor()
            self._floor_raises += 1
        except Exception as exc:  # upkeep must outlive a bad moment; counted and shown
            self._errors += 1
            self._last_error = f"raise floor: {type(exc).__name__}: {exc}"

    def statistics(self) -> UpkeepStatistics:
        return UpkeepStatistics(
            running=self._thread is not None and self._thread.is_alive(),
            idle_priority=self._idle_priority,
            checkpoints=self._checkpoints,
            busy=self._busy,
            errors=self._errors,
            wal_frames=self._frames,
            restarts=self._restarts,
            restarts_busy=self._restarts_busy,
            longest_checkpoint_ms=round(self._longest_s * 1000, 3),
            floor_raises=self._floor_raises,
            backlog=self._backlog,
            last_error=self._last_error,
        )

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            threads = [t for t in (self._thread, self._restarter) if t is not None]
        self._restart_due.set()
        for thread in threads:
            thread.join(30)
