"""The bounded BUSY retry: a held write lock is waited out, and past the bound the caller
gets StoreBusy (never "database is locked"), with nothing written."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from store.errors import StoreBusy
from store.rows import RowWrite
from store.sqlite import SqliteStore
from store.sqlite.conn import Retry, is_busy


def hold_write_lock(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN IMMEDIATE")
    return conn


def test_a_held_lock_is_waited_out(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db")
    holder = hold_write_lock(store.path)
    release = threading.Timer(0.2, lambda: holder.execute("COMMIT"))
    release.start()
    store.write([RowWrite(key="/a", route="product", next_render_at=1)])
    release.join()
    holder.close()
    assert store.get("/a") is not None
    assert store.statistics().busy_retries > 0
    store.close()


def test_past_the_bound_the_caller_gets_store_busy(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "s.db", busy_timeout_s=0.1)
    holder = hold_write_lock(store.path)
    with pytest.raises(
        StoreBusy, match=r"write: the database stayed locked .* nothing was written"
    ):
        store.write([RowWrite(key="/a", route="product", next_render_at=1)])
    holder.execute("ROLLBACK")
    holder.close()
    assert store.get("/a") is None
    store.write([RowWrite(key="/a", route="product", next_render_at=1)])  # and it recovers
    assert store.get("/a") is not None
    store.close()


def test_other_errors_are_not_retried() -> None:
    retry = Retry(busy_timeout_s=5)
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise sqlite3.OperationalError("no such table: nope")

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        retry.call("read", broken)
    assert calls == [1] and retry.retries == 0


def test_busy_is_recognised() -> None:
    assert is_busy(sqlite3.OperationalError("database is locked"))
    assert not is_busy(sqlite3.OperationalError("no such table: x"))
