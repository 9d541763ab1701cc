"""A backup taken while other processes write: one consistent, checked copy, renamed into
place whole; a source or destination that is not fit is refused and nothing is left."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import subprocess
import sys
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
from node_harness import REPO, NodeProcess, node_db, node_process, seed_rows, wait_for

from store.errors import StoreError
from store.rows import RowWrite
from store.sqlite import SqliteStore
from store.sqlite import backup as backup_module
from store.sqlite.backup import backup


def keep_writing(db: str, stop: Event) -> None:
    """A writer process: one new row a commit until `stop` is set."""
    store = SqliteStore(db)
    i = 0
    try:
        while not stop.is_set():
            store.write([RowWrite(key=f"https://w.example/{i}", route="w", next_render_at=i)])
            i += 1
    finally:
        store.close()


def count(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT count(*) FROM render_schedule").fetchone()[0])


def test_a_backup_under_a_writer_is_one_consistent_checked_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backup_module, "PROGRESS_EVERY_S", 0.001)
    db = tmp_path / "node.sqlite"
    seed_rows(db, 20_000)
    spawn = multiprocessing.get_context("spawn")
    stop = spawn.Event()
    writer = spawn.Process(target=keep_writing, args=(str(db), stop))
    writer.start()
    try:
        wait_for(lambda: count(db) > 20_000, 60, "the writer to commit")
        before = count(db)
        reports: list[tuple[int, int]] = []
        done = backup(db, tmp_path / "copy.sqlite", lambda w, e: reports.append((w, e)))
        after = count(db)
        wait_for(lambda: count(db) > before, 60, "the writer to go on")  # it was writing
    finally:
        stop.set()
        writer.join(30)
    assert writer.exitcode == 0
    assert before <= done.rows <= after
    assert done.rows == count(tmp_path / "copy.sqlite") and done.bytes > 0
    assert not list(tmp_path.glob(".*partial"))
    assert reports and all(e > 0 for _, e in reports)
    # Sizes only grow, and the last report is the whole copy's (made once it is written,
    # however few the reports while it was).
    assert [w for w, _ in reports] == sorted(w for w, _ in reports)
    assert reports[-1][0] == done.bytes
    # The copy is a store: it opens, reads, and its change log and cursors came along.
    copy = SqliteStore(tmp_path / "copy.sqlite")
    try:
        assert copy.get("https://shop.example/p/0000007") is not None
        assert copy.statistics().rows == done.rows
    finally:
        copy.close()


def test_a_copy_quicker_than_a_report_period_still_reports_its_whole_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backup_module, "PROGRESS_EVERY_S", 3600.0)  # no report while copying
    db = tmp_path / "node.sqlite"
    seed_rows(db, 1_000)
    reports: list[tuple[int, int]] = []
    done = backup(db, tmp_path / "copy.sqlite", lambda w, e: reports.append((w, e)))
    assert len(reports) == 1
    assert reports[0][0] == done.bytes > 0 and reports[0][1] > 0


def test_what_is_not_fit_is_refused_and_nothing_is_left(tmp_path: Path) -> None:
    db = tmp_path / "node.sqlite"
    seed_rows(db, 10)
    existing = tmp_path / "existing.sqlite"
    existing.write_bytes(b"keep me")
    plain = tmp_path / "plain.sqlite"
    with sqlite3.connect(plain) as conn:
        conn.execute("CREATE TABLE t (x)")
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all, just bytes" * 100)
    cases = {
        "exists": (db, existing),
        "no database file": (tmp_path / "absent.sqlite", tmp_path / "a.sqlite"),
        "does not exist": (db, tmp_path / "no-such-dir" / "b.sqlite"),
        "no renderqueue schedule": (plain, tmp_path / "c.sqlite"),
        "not a SQLite database": (garbage, tmp_path / "d.sqlite"),
    }
    for said, (source, destination) in cases.items():
        with pytest.raises(StoreError, match=said):
            backup(source, destination)
        assert destination == existing or not destination.exists(), said
    assert existing.read_bytes() == b"keep me"
    assert not list(tmp_path.glob(".*partial"))


def test_a_file_that_appears_during_the_copy_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "node.sqlite"
    seed_rows(db, 10)
    destination = tmp_path / "b.sqlite"
    check_copy = backup_module._check_copy

    def another_writer_gets_there_first(path: Path) -> int:
        destination.write_bytes(b"someone else's file")
        return check_copy(path)

    monkeypatch.setattr(backup_module, "_check_copy", another_writer_gets_there_first)
    with pytest.raises(StoreError, match="appeared during the copy"):
        backup(db, destination)
    assert destination.read_bytes() == b"someone else's file"
    assert not list(tmp_path.glob(".*partial"))


def test_a_failure_after_the_copy_is_a_store_error_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "node.sqlite"
    seed_rows(db, 10)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(StoreError, match="No space left on device"):
        backup(db, tmp_path / "b.sqlite")
    assert not (tmp_path / "b.sqlite").exists()
    assert not list(tmp_path.glob(".*partial"))


def exact_due(node: NodeProcess) -> int | None:
    with node.client() as client:
        response = client.get("/prerender_admin/queue-state")
    if response.status_code != 200 or not response.json()["trust"]["exact"]:
        return None
    due: int = response.json()["now"]["due"]
    return due


def renderqueue(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )


def test_the_command(tmp_path: Path) -> None:
    db = tmp_path / "node.sqlite"
    seed_rows(db, 50)
    done = renderqueue("backup", "--db", str(db), "--to", str(tmp_path / "b.sqlite"))
    assert done.returncode == 0, done.stderr
    assert "backed up 50 rows" in done.stdout and count(tmp_path / "b.sqlite") == 50
    # The node is stopped: the backup leaves its file as it found it, no -wal or -shm.
    assert not list(tmp_path.glob("*-wal")) and not list(tmp_path.glob("*-shm"))
    again = renderqueue("backup", "--db", str(db), "--to", str(tmp_path / "b.sqlite"))
    assert again.returncode == 1 and "never overwrites" in again.stderr
    postgres = renderqueue("backup", "--db", "postgresql://x@h/d", "--to", str(tmp_path / "p"))
    assert postgres.returncode == 2 and "pg_dump" in postgres.stderr


def test_a_node_serves_a_restored_backup(tmp_path: Path) -> None:
    """Restored as the README says (the copy in place of the file): the node loads it."""
    seed_rows(tmp_path / "node.sqlite", 30)
    restored = tmp_path / "restored"
    restored.mkdir()
    backup(tmp_path / "node.sqlite", Path(node_db(restored)))
    with node_process(restored, workers=1) as node:
        state = wait_for(lambda: exact_due(node), 60, "the restored node's exact queue-state")
    assert state == 30
