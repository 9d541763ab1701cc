"""Background upkeep: the WAL is checkpointed by the store's own idle-priority thread, not
by a commit, and the change log is pruned behind every registered consumer."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import pytest
from node_harness import wait_for

from store.rows import RowEvent, RowWrite
from store.sqlite import SqliteStore
from store.sqlite import store as sqlite_store_module
from store.sqlite import upkeep as upkeep_module
from store.sqlite.upkeep import WRITER_CHECKPOINT_PAGES, Upkeep
from store.sqlite.wal import read_wal_state


def put(i: int) -> RowWrite:
    return RowWrite(key=f"/k{i}", route="product", next_render_at=i)


def test_commits_are_checkpointed_by_the_thread(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    assert store.statistics().upkeep.running is False  # no thread before a write
    conn = store._state().conn
    assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == WRITER_CHECKPOINT_PAGES
    for i in range(300):
        store.write([put(i)])
    wait_for(lambda: store.statistics().upkeep.checkpoints > 0, 30, "a checkpoint")
    stats = store.statistics().upkeep
    assert stats.running and stats.errors == 0
    # Everything the thread saw is in the database file now: a checkpoint finds nothing left.
    probe = sqlite3.connect(tmp_path / "s.db")
    wait_for(
        lambda: probe.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[0] == 0,
        30,
        "a checkpoint that finds nothing left",
    )
    probe.close()
    upkeep = store._upkeep
    store.close()
    assert upkeep is not None and not upkeep.statistics().running


def test_without_the_thread_writers_checkpoint_as_sqlite_does(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db", background_checkpoints=False)
    store.write([put(1)])
    conn = store._state().conn
    assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    assert store.statistics().upkeep.running is False
    store.close()


def test_the_thread_runs_at_idle_priority(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    store.write([put(1)])
    wait_for(lambda: store.statistics().upkeep.running, 30, "the thread")
    upkeep = store._upkeep
    assert upkeep is not None and upkeep._thread is not None
    wait_for(lambda: store.statistics().upkeep.idle_priority, 30, "idle priority")
    native_id = upkeep._thread.native_id
    assert native_id is not None
    assert os.sched_getscheduler(native_id) == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the writer's own thread is untouched
    store.close()


class UpkeepClock:
    """The upkeep's monotonic clock, moved only by the test: an interval passes exactly
    where the test says, however slow the machine is."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> UpkeepClock:
    clock = UpkeepClock()
    monkeypatch.setattr(upkeep_module, "time", clock)
    return clock


def test_writes_raise_the_floor_when_due_and_trim_below_it(
    tmp_path: Path, clock: UpkeepClock
) -> None:
    store = SqliteStore(tmp_path / "s.db", prune_interval_s=1.0)
    sub = store.subscribe("keeper")
    store.write([put(i) for i in range(50)])
    sub.poll(limit=20)
    sub.save()  # passed entry 20
    clock.now += 1.05
    store.write([put(50)])  # seq 51: past the interval, this write raises the floor
    stats = store.statistics()
    assert (stats.floor, stats.log_rows, stats.upkeep.backlog) == (20, 51, 19)
    assert stats.upkeep.floor_raises == 1
    for i in range(100, 112):  # seqs 52..63: no trimming yet, and no raise before the interval
        store.write([put(i)])
    assert store.statistics().log_rows == 63
    assert store.statistics().upkeep.floor_raises == 1
    store.write([put(113)])  # seq 64: every TRIM_EVERY-th write trims below the floor
    stats = store.statistics()
    assert (stats.floor, stats.log_rows) == (20, 64 - 19)  # down to the floor's entry
    assert [e.key for e in sub.poll().events if isinstance(e, RowEvent)][:2] == [
        "/k20",
        "/k21",
    ]  # nothing it needs went
    sub.close()
    store.drop_consumer("keeper")
    clock.now += 1.05
    store.write([put(999)])  # nobody registered: all but the head may go
    assert store.statistics().floor == store.statistics().head
    for i in range(200, 240):
        store.write([put(i)])
    assert store.statistics().upkeep.errors == 0
    assert store.statistics().log_rows < 45
    store.close()


def test_no_pruning_when_asked_for_none(tmp_path: Path, clock: UpkeepClock) -> None:
    store = SqliteStore(tmp_path / "s.db", prune_interval_s=None)
    store.write([put(i) for i in range(10)])
    clock.now += 3600
    store.write([put(10)])
    assert store.statistics().log_rows == 11
    assert store.statistics().upkeep.floor_raises == 0
    store.close()


def test_an_idle_upkeep_starts_nothing(tmp_path: Path) -> None:
    upkeep = Upkeep(tmp_path / "s.db")
    assert upkeep.statistics().running is False
    upkeep.close()
    upkeep.committed()  # after close: no thread is started
    assert upkeep.statistics().running is False


def wal_frames(db: Path) -> int | None:
    state = read_wal_state(db)
    return None if state is None else state.frames


def test_a_long_wal_is_restarted_by_the_restart_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(upkeep_module, "RESTART_FRAMES", 50)
    db = tmp_path / "s.db"
    store = SqliteStore(db)
    for i in range(120):
        store.write([put(i)])
    wait_for(lambda: store.statistics().upkeep.restarts > 0, 30, "a restart")

    def starts_over() -> bool:
        store.write([put(1000)])  # the first writer after a restart writes from frame 1
        frames = wal_frames(db)
        return frames is not None and frames < 50

    wait_for(starts_over, 30, "the WAL to start over")
    stats = store.statistics().upkeep
    assert stats.errors == 0 and stats.running
    upkeep = store._upkeep
    store.close()
    assert upkeep is not None and upkeep._restarter is not None
    assert not upkeep._restarter.is_alive()


def test_the_wal_starts_over_under_a_writer_that_never_pauses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PASSIVE checkpoint alone never sees the whole log copied while commits keep coming,
    # so without the restart the WAL grows to the writers' own threshold (disabled here).
    monkeypatch.setattr(upkeep_module, "RESTART_FRAMES", 300)
    monkeypatch.setattr(sqlite_store_module, "WRITER_CHECKPOINT_PAGES", 1_000_000)
    # A restart follows a PASSIVE checkpoint, whose thread runs at idle priority: on a
    # machine kept busy by others it may not run for seconds, as intended (the writers'
    # own checkpoint is the bound then). This test is of the restart, so that thread
    # stays at normal priority here.
    monkeypatch.setattr(upkeep_module, "lower_to_idle", lambda: False)
    db = tmp_path / "s.db"
    store = SqliteStore(db)
    reader = SqliteStore(db, background_checkpoints=False)
    store.write([put(i) for i in range(5_000)])
    # Three start-overs, however long they take within a minute, rather than a bound on
    # the WAL's length in a fixed time, which a busy machine can miss.
    start_overs = last = i = 0
    deadline = time.monotonic() + 60.0
    while start_overs < 3 and time.monotonic() < deadline:
        store.write([put(i % 5_000), put((i * 7919) % 5_000)])
        reader.get(f"/k{i % 5_000}")
        frames = wal_frames(db) or 0
        start_overs += last >= upkeep_module.RESTART_FRAMES and frames < last
        last = frames
        i += 1
    restarts = store.statistics().upkeep.restarts
    reader.close()
    store.close()
    # Without the restart the log never starts over while the writer never pauses.
    assert start_overs == 3, f"the WAL started over {start_overs} times in {i} writes"
    assert restarts > 0
