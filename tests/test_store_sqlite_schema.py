"""Versioned migrations, and a database from a newer schema refused with a clear error."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from store.errors import SchemaTooNew, StoreError
from store.sqlite import SqliteStore
from store.sqlite.schema import LATEST, MIGRATIONS, migrate, schema_version


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
    assert row.not_found_streak == 0 and row.retired_at is None and row.retired_reason is None
    store.close()
    conn = sqlite3.connect(path)
    assert schema_version(conn) == LATEST == 7
    triggers = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='trigger'")}
    assert "change_log_trimmed" in triggers
    conn.close()


def _at_version_2(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for version in (0, 1):
        for statement in MIGRATIONS[version]:
            conn.execute(statement)
        conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version + 1,))
    conn.close()


def test_a_version_2_database_gets_a_hash_secret_once(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    _at_version_2(path)
    store = SqliteStore(path)
    secret = store.hash_secret()
    store.close()
    assert len(secret) == 16
    again = SqliteStore(path)
    assert again.hash_secret() == secret
    again.close()
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT count(*) FROM hash_secret").fetchone()[0] == 1
    conn.close()


@pytest.mark.parametrize(
    ("stored", "says"),
    [
        (b"short", "5 bytes"),
        (b"x" * 32, "32 bytes"),
        ("a text of 16 chr", "a str, not bytes"),
        (None, "missing"),
    ],
)
def test_a_malformed_hash_secret_is_a_clear_error(
    tmp_path: Path, stored: bytes | str | None, says: str
) -> None:
    path = tmp_path / "s.db"
    SqliteStore(path).close()
    conn = sqlite3.connect(path, isolation_level=None)
    if stored is None:
        conn.execute("DELETE FROM hash_secret")
    else:
        conn.execute("UPDATE hash_secret SET secret = ?", (stored,))
    conn.close()
    store = SqliteStore(path)
    try:
        with pytest.raises(StoreError, match=says) as raised:
            store.hash_secret()
        assert str(path) in str(raised.value)
    finally:
        store.close()
