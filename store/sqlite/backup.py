"""A consistent copy of a SQLite store, taken while its node runs.

`VACUUM INTO` reads the whole database in one read transaction, so the copy is the
table, the change log and the saved cursors as of one commit, and the node's writers go
on meanwhile (WAL mode: a reader never blocks them). The WAL cannot start over while
the copy reads, so it grows by what is written during it (`/metrics` shows it).

The copy is written beside the destination under a temporary name, synced, checked
(`PRAGMA quick_check` and the schema version) and only then linked into place: a
destination path holds a whole, checked backup or nothing.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from store.errors import StoreError, refuse_newer
from store.sqlite.schema import LATEST, schema_version

PROGRESS_EVERY_S = 1.0


class Backup(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    rows: int  # rows of the schedule in the copy
    bytes: int
    seconds: float


def backup(
    source: str | os.PathLike[str],
    destination: str | os.PathLike[str],
    progress: Callable[[int, int], object] | None = None,
) -> Backup:
    """Copy the store at `source` to the new file `destination`; `progress(written,
    expected)` in bytes about once a second while the copy is written, and once more when
    it is whole (a copy that fits SQLite's page cache is written only at its end). Raises
    StoreError, with nothing left at `destination`, when the source is not a renderqueue
    store or the destination exists or cannot be written."""
    started = time.monotonic()
    src, dest = Path(source), Path(destination)
    if not src.is_file():
        raise StoreError(f"backup: no database file at {src}")
    if dest.exists():
        raise StoreError(f"backup: {dest} exists; give a new file (a backup never overwrites)")
    if not dest.parent.is_dir():
        raise StoreError(f"backup: the directory {dest.parent} does not exist")
    partial = dest.with_name(f".{dest.name}.partial")
    partial.unlink(missing_ok=True)  # a crashed backup's leftover: never a backup itself
    conn = _open_source(src)
    try:
        try:
            expected = _check_source(conn, src)
            with _Progress(partial, expected, progress):
                conn.execute("VACUUM INTO ?", (str(partial),))
        except sqlite3.Error as exc:
            raise StoreError(f"backup: copying {src} failed: {exc}") from exc
        finally:
            conn.close()
        try:
            rows = _check_copy(partial)
            with open(partial, "rb") as written:
                os.fsync(written.fileno())
            # A link, not a rename: it fails where a file appeared at `dest` during the copy,
            # and a rename would replace that file.
            os.link(partial, dest)
            partial.unlink()
            _sync_directory(dest.parent)
        except FileExistsError as exc:
            raise StoreError(
                f"backup: {dest} appeared during the copy; it is left as it is"
            ) from exc
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"backup: finishing the copy at {dest} failed: {exc}") from exc
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return Backup(
        path=str(dest),
        rows=rows,
        bytes=dest.stat().st_size,
        seconds=round(time.monotonic() - started, 3),
    )


def _open_source(path: Path) -> sqlite3.Connection:
    """A connection that only reads. Not `mode=ro`: a read-only connection to a stopped
    node's file creates the `-wal` and `-shm` it needs and cannot remove them after; this
    one, the last to close, removes them as any connection does."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


def _check_source(conn: sqlite3.Connection, path: Path) -> int:
    """The source's size in bytes, once it is known to be a renderqueue store."""
    try:
        version = schema_version(conn)
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"backup: {path} is not a SQLite database ({exc})") from exc
    if version == 0:
        raise StoreError(f"backup: {path} holds no renderqueue schedule")
    refuse_newer(version, LATEST, str(path))
    pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
    free = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
    size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    return (pages - free) * size


def _check_copy(path: Path) -> int:
    """The copy's schedule rows, once SQLite finds it sound and at this build's schema."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        verdict = conn.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise StoreError(f"backup: the copy failed SQLite's check: {verdict}")
        if schema_version(conn) != LATEST:
            raise StoreError("backup: the copy's schema version differs from the source's")
        return int(conn.execute("SELECT count(*) FROM render_schedule").fetchone()[0])
    finally:
        conn.close()


def _sync_directory(directory: Path) -> None:
    """The rename itself survives a power loss only once its directory is synced."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _Progress:
    """Reports the copy's growing size from a thread while `VACUUM INTO` runs."""

    def __init__(
        self, path: Path, expected: int, report: Callable[[int, int], object] | None
    ) -> None:
        self._path, self._expected, self._report = path, expected, report
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="backup-progress", daemon=True)

    def __enter__(self) -> _Progress:
        if self._report is not None:
            self._thread.start()
        return self

    def __exit__(self, failed: type[BaseException] | None, *exc: object) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._report is not None and failed is None:
            self._report(self._written(), self._expected)  # the whole copy's size

    def _run(self) -> None:
        assert self._report is not None
        while not self._done.wait(PROGRESS_EVERY_S):
            self._report(self._written(), self._expected)

    def _written(self) -> int:
        try:
            return self._path.stat().st_size
        except FileNotFoundError:
            return 0
