"""SQLite connections and the bounded retry that keeps "database is locked" from callers.

Writers take the lock up front with BEGIN IMMEDIATE, so a transaction never
fails half way for want of it. SQLite's own busy handler sleeps 1 ms at its
first wait; the store instead retries BUSY itself from 50 us, doubling to 2 ms,
until `busy_timeout_s` has passed, then raises StoreBusy. Every retry is counted.
"""

from __future__ import annotations

import os
import random
import sqlite3
import time
from collections.abc import Callable
from typing import TypeVar

from store.errors import StoreBusy, StoreFull

T = TypeVar("T")

_BUSY_CODES = frozenset((sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED))
_FIRST_BACKOFF_S = 50e-6
_MAX_BACKOFF_S = 2e-3

# No mmap: after another connection commits, SQLite drops this connection's page cache,
# so every worker refetches pages after each other worker's commit, and pread does that
# refetch more cheaply than a mapping does.
_PRAGMAS = (
    "PRAGMA synchronous = NORMAL",
    "PRAGMA temp_store = MEMORY",
    "PRAGMA journal_size_limit = 67108864",
    "PRAGMA foreign_keys = OFF",
)


# Per connection, unless the store is opened with another. It holds the table's interior
# pages at millions of rows; a batch's leaves are random pages anyway, and another
# process's commit empties the cache, so more only sits in the process's memory.
PAGE_CACHE_KIB = 8_000

# SQLITE_IOERR and SQLITE_FULL: the disk refused a write (it is full, or failing).
_FULL_CODES = (10, 13)


def is_full(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in _FULL_CODES


def is_busy(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _BUSY_CODES
    text = str(exc)
    return "locked" in text or "busy" in text


def connect(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """A connection in autocommit mode: the store opens every transaction itself."""
    conn = sqlite3.connect(
        path,
        timeout=0,  # BUSY comes straight back to the retry loop below
        isolation_level=None,
        check_same_thread=False,  # one thread uses it; close() may come from another
        cached_statements=64,
    )
    return conn


def configure(conn: sqlite3.Connection, page_cache_kib: int = PAGE_CACHE_KIB) -> None:
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise sqlite3.OperationalError(f"could not switch the database to WAL (it is {mode})")
    for pragma in _PRAGMAS:
        conn.execute(pragma)
    conn.execute(f"PRAGMA cache_size = -{int(page_cache_kib)}")


class Retry:
    """Runs a function until it stops raising BUSY, for at most `busy_timeout_s`."""

    def __init__(self, busy_timeout_s: float) -> None:
        self.busy_timeout_s = busy_timeout_s
        self.retries = 0
        self.gave_up = 0  # calls that waited out busy_timeout_s and raised StoreBusy

    def call(self, what: str, fn: Callable[[], T], *, wait: bool = True) -> T:
        """`wait=False`: BUSY raises StoreBusy at once, for a caller that waits elsewhere."""
        deadline: float | None = None
        backoff = _FIRST_BACKOFF_S
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if is_full(exc):
                    raise StoreFull(
                        f"{what}: the disk refused the write ({exc}); nothing was written, "
                        "and writes work again once it has room"
                    ) from exc
                if not is_busy(exc):
                    raise
                if not wait:
                    raise StoreBusy(f"{what}: another writer holds the lock") from exc
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.busy_timeout_s
                elif now >= deadline:
                    self.gave_up += 1
                    raise StoreBusy(
                        f"{what}: the database stayed locked by other writers for "
                        f"{self.busy_timeout_s:g} s ({exc}); nothing was written"
                    ) from exc
                self.retries += 1
                time.sleep(backoff * (0.5 + random.random()))
                backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def transaction(
        self,
        conn: sqlite3.Connection,
        what: str,
        body: Callable[[sqlite3.Connection], T],
        *,
        write: bool,
        wait: bool = True,
    ) -> T:
        """`body` inside one transaction, retried whole on BUSY (or not: `wait`, as in
        `call`); rolled back on any error."""
        begin = "BEGIN IMMEDIATE" if write else "BEGIN"

        def attempt() -> T:
            conn.execute(begin)
            try:
                result = body(conn)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return result

        return self.call(what, attempt, wait=wait)
