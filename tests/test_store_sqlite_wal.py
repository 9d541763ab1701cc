"""The WAL's length read from the wal-index, checked against what SQLite itself reports,
and a wal-index that is not one SQLite wrote, read as nothing."""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path

from store.sqlite.wal import WALINDEX_VERSION, WalState, read_wal_state


def open_wal(db: Path, page_size: int = 4096) -> sqlite3.Connection:
    """A connection in WAL mode that never checkpoints by itself."""
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(f"PRAGMA page_size = {page_size}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    conn.execute("CREATE TABLE IF NOT EXISTS t (k INTEGER PRIMARY KEY, v BLOB)")
    return conn


def write(conn: sqlite3.Connection, rows: int, start: int = 0) -> None:
    for i in range(start, start + rows):
        conn.execute("INSERT INTO t (k, v) VALUES (?, randomblob(300))", (i,))


def checkpoint(conn: sqlite3.Connection, mode: str) -> tuple[int, int]:
    """SQLite's own count after a checkpoint: (frames in the log, frames checkpointed)."""
    busy, frames, checkpointed = conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    assert busy == 0, "no checkpoint here waits on another connection"
    return frames, checkpointed


def test_no_wal_index_reads_as_none(tmp_path: Path) -> None:
    assert read_wal_state(tmp_path / "absent.db") is None
    conn = sqlite3.connect(tmp_path / "rollback.db")  # a rollback journal: no -shm
    conn.execute("CREATE TABLE t (k)")
    conn.commit()
    assert read_wal_state(tmp_path / "rollback.db") is None
    conn.close()


def test_frames_and_checkpointed_frames_agree_with_sqlite(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    conn = open_wal(db)
    write(conn, 200)
    frames, checkpointed = checkpoint(conn, "PASSIVE")
    state = read_wal_state(db)
    assert state is not None
    assert (state.frames, state.checkpointed) == (frames, checkpointed)
    assert frames > 0 and state.uncheckpointed == 0
    assert state.page_size == conn.execute("PRAGMA page_size").fetchone()[0]
    assert state.file_bytes == os.path.getsize(f"{db}-wal") > 0

    # A reader's snapshot keeps a checkpoint from copying what was written after it.
    reader = sqlite3.connect(db, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM t").fetchone()
    write(conn, 100, start=200)
    frames, checkpointed = checkpoint(conn, "PASSIVE")
    state = read_wal_state(db)
    assert state is not None
    assert (state.frames, state.checkpointed) == (frames, checkpointed)
    assert state.uncheckpointed == frames - checkpointed > 0
    reader.execute("COMMIT")
    reader.close()

    # Truncated: the log starts over, and its file is empty.
    assert checkpoint(conn, "TRUNCATE") == (0, 0)
    assert read_wal_state(db) == WalState(
        page_size=state.page_size, frames=0, checkpointed=0, file_bytes=0
    )
    conn.close()


def test_a_64_kib_page_is_read_as_such(tmp_path: Path) -> None:
    """SQLite writes 65,536 into the header's 16-bit field as 1."""
    db = tmp_path / "big.db"
    conn = open_wal(db, page_size=65_536)
    write(conn, 10)
    state = read_wal_state(db)
    assert state is not None and state.page_size == 65_536 and state.frames > 0
    conn.close()


def wal_index_bytes(tmp_path: Path) -> bytes:
    db = tmp_path / "real.db"
    conn = open_wal(db)
    write(conn, 20)
    data = Path(f"{db}-shm").read_bytes()
    conn.close()
    return data


def forged(tmp_path: Path, data: bytes) -> Path:
    db = tmp_path / "forged.db"
    Path(f"{db}-shm").write_bytes(data)
    return db


def test_a_wal_index_sqlite_did_not_write_reads_as_none(tmp_path: Path) -> None:
    real = wal_index_bytes(tmp_path)
    assert read_wal_state(forged(tmp_path, real)) is not None  # the copy itself reads

    def patched(offset: int, value: bytes, *, both: bool = True) -> bytes:
        """`real` with `value` at `offset`; in both header copies, when it is in the header."""
        data = bytearray(real)
        data[offset : offset + len(value)] = value
        if both and offset < 48:
            data[48 + offset : 48 + offset + len(value)] = value
        return bytes(data)

    other_version = (WALINDEX_VERSION + 1).to_bytes(4, sys.byteorder)
    cases = {
        "empty": b"",
        "short": real[:60],
        "zeros": bytes(len(real)),
        "another version": patched(0, other_version),
        "not initialised": patched(12, b"\x00"),
        "a page size that is not a power of two": patched(14, (1000).to_bytes(2, sys.byteorder)),
        "copies that disagree (a writer between them)": patched(
            16, (7).to_bytes(4, sys.byteorder), both=False
        ),
        "more frames checkpointed than written": patched(96, (10**6).to_bytes(4, sys.byteorder)),
    }
    for what, data in cases.items():
        assert read_wal_state(forged(tmp_path, data)) is None, what
