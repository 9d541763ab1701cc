"""Versioned migrations, and a database from a newer schema refused with a clear error."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from store.errors import SchemaTooNew, StoreError
from store.schema import LATEST, MIGRATIONS, migrate, schema_version
from store.sqlite import SqliteStore


def test_a_fresh_file_gets_the_latest_schema(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    SqliteStore(path).close()
    conn = sqlite3.connect(path)
    assert schema_version(conn) == LATEST
    tables = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"render_schedule", "routes", "settings", "change_log", "feed_consumers"} <= tables
    # no index on next_render_at: the keeper is the queue
    indexes = conn.execute("SELECT sql FROM sqlite_master WHERE type='index'").fetchall()
    assert not [sql for (sql,) in indexes if sql and "next_render_at" in sql]
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_reopening_migrates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    SqliteStore(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    assert migrate(conn, str(path)) == LATEST
    assert conn.execute("SELECT count(*) FROM schema_version").fetchone()[0] == LATEST
    conn.close()


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    SqliteStore(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (LATEST + 1,))
    conn.close()
    with pytest.raises(SchemaTooNew) as caught:
        SqliteStore(path)
    message = str(caught.value)
    assert f"schema version {LATEST + 1}" in message
    assert f"up to {LATEST}" in message
    assert str(path) in message


def test_a_foreign_database_with_our_tables_but_no_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE render_schedule (key TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="no schema_version"):
        SqliteStore(path)


def _open(path: str) -> int:
    store = SqliteStore(path)
    count = store.count()
    store.close()
    return count


def test_processes_opening_a_new_file_at_once_migrate_it_once(tmp_path: Path) -> None:
    path = str(tmp_path / "s.db")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert pool.map(_open, [path] * 8) == [0] * 8
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM schema_version").fetchone()[0] == LATEST
    conn.close()


def test_a_version_1_database_is_migrated_in_place(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for statement in MIGRATIONS[0]:
        conn.execute(statement)
    conn.execute("INSERT INTO schema_version (version) VALUES (1)")
    conn.execute(
        "INSERT INTO render_schedule (key, route, sitemap, next_render_at, version) "
        "VALUES ('/kept', 'product', 0, 5, 1)"
    )
    conn.close()
    store = SqliteStore(path)
    row = store.get("/kept")
    assert row is not None and row.next_render_at == 5
    store.close()
    conn = sqlite3.connect(path)
    assert schema_version(conn) == LATEST == 2
    triggers = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
    assert "change_log_trimmed" in triggers
    conn.close()
