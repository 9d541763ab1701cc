"""Background checkpoints: the WAL is copied back by the store's own thread, not by a commit."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from store.checkpoint import WRITER_CHECKPOINT_PAGES, Checkpointer
from store.rows import RowWrite
from store.sqlite import SqliteStore


def wait_for(condition: object, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_commits_are_checkpointed_by_the_thread(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    assert store.statistics().checkpoint.running is False  # no thread before a write
    conn = store._state().conn
    assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == WRITER_CHECKPOINT_PAGES
    for i in range(300):
        store.write([RowWrite(key=f"/k{i}", route="product", next_render_at=i)])
    assert wait_for(lambda: store.statistics().checkpoint.checkpoints > 0)
    stats = store.statistics().checkpoint
    assert stats.running and stats.errors == 0
    # Everything the thread saw is in the database file now: a checkpoint finds nothing left.
    assert wait_for(
        lambda: (
            sqlite3.connect(tmp_path / "s.db")
            .execute("PRAGMA wal_checkpoint(PASSIVE)")
            .fetchone()[0]
            == 0
        )
    )
    store.close()
    assert store._checkpointer is not None and not store._checkpointer.statistics().running


def test_without_the_thread_writers_checkpoint_as_sqlite_does(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db", background_checkpoints=False)
    store.write([RowWrite(key="/k", route="product", next_render_at=1)])
    conn = store._state().conn
    assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    assert store.statistics().checkpoint.running is False
    store.close()


def test_an_idle_checkpointer_does_nothing(tmp_path: Path) -> None:
    checkpointer = Checkpointer(tmp_path / "s.db")
    time.sleep(0.1)
    assert checkpointer.statistics().running is False
    checkpointer.close()
    checkpointer.committed()  # after close: no thread is started
    assert checkpointer.statistics().running is False
