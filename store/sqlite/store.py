"""SqliteStore: the embedded durable schedule (stdlib sqlite3, WAL) and its exact change feed.

Thread-safety: one SqliteStore may be shared by the threads of one process;
each thread gets its own connection (threading.local), so the keeper thread
and HTTP handlers never share one. Use a store only in the process that
opened it (open another after a fork or in a spawned child). A Subscription
has a connection of its own and serves one reader.

Writes are all or nothing: every batch is one BEGIN IMMEDIATE transaction,
retried whole while other writers hold the lock (see sqlite_conn). After each
commit the writer copies the commit's log records into the subscribed consumers'
rings (see feed_ring), then posts their semaphores (see wake); a daemon thread
checkpoints the WAL off the writers' path (see upkeep).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from store.base import DEFAULT_BUSY_TIMEOUT_S, Cursor, RowsRead, SqliteCounters
from store.core import SqlStore, ThreadState
from store.errors import StoreFull
from store.rows import (
    ROW_FIELDS,
    Completion,
    Row,
    RowWrite,
    completion_rounds,
    learned_from,
    row_from,
)
from store.schema import KIND_ROW
from store.sqlite import sql
from store.sqlite.conn import PAGE_CACHE_KIB, Retry, configure, connect
from store.sqlite.feed import (
    SqliteSubscription,
    Verdict,
    cursor_token,
    forget,
    head,
    judge,
    parse_cursor,
    raise_for,
    release,
)
from store.sqlite.feed_ring import HANDOFF_LIMIT, FeedHandoff, LogRecord, create_ring
from store.sqlite.schema import migrate, schema_version
from store.sqlite.upkeep import PRUNE_INTERVAL_S, WRITER_CHECKPOINT_PAGES, Upkeep, UpkeepStatistics
from store.sqlite.wake import (
    WakePoster,
    WakeStatistics,
    new_wake_name,
    open_waiter,
    wake_prefix,
)
from store.validate import check_completions, check_consumer

T = TypeVar("T")
# Reads a write transaction's log records before it commits, given the seq before them.
RecordsReader = Callable[[sqlite3.Connection, int], list[LogRecord]]

PRUNE_CHUNK = 20_000


class StoreStatistics(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    schema_version: int
    rows: int
    routes: int
    log_rows: int
    floor: int  # every log entry at or above it is present
    head: int  # the last committed log entry
    consumers: int
    lowest_consumer_seq: int | None  # pruning never passes it
    resyncs: int  # cursors found ahead of the log (rolled back), all processes, ever
    transactions: int  # write transactions committed through this object
    rows_written: int
    busy_retries: int  # transactions retried because another writer held the lock
    pruned: int  # log entries this object removed
    wake: WakeStatistics
    upkeep: UpkeepStatistics


class _ThreadState(ThreadState):
    def __init__(self, conn: sqlite3.Connection, busy_timeout_s: float) -> None:
        super().__init__()
        self.conn = conn
        self.retry = Retry(busy_timeout_s)
        self.last_commit_ns = 0
        self.write_position: int | None = 0

    @property
    def busy_refused(self) -> int:
        return self.retry.gave_up


class SqliteStore(SqlStore[sqlite3.Connection, _ThreadState]):
    """The SQLite backend of `store.base.ScheduleStore`."""

    remote = False  # a call waits on this machine's disk only (ScheduleStore.remote)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        wake_name: str | None = None,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        background_checkpoints: bool = True,
        prune_interval_s: float | None = PRUNE_INTERVAL_S,
        page_cache_kib: int = PAGE_CACHE_KIB,
    ) -> None:
        """`background_checkpoints`: checkpoint on a daemon thread (see store.sqlite.upkeep) rather
        than in commits; `prune_interval_s`: how often a write also raises the change log's
        floor, below which writes trim it (None: only explicit `raise_floor()` or
        `prune()` calls do); `page_cache_kib`: each connection's page cache."""
        if not 100 <= page_cache_kib <= 1 << 22:
            raise ValueError(f"page_cache_kib must be 100..{1 << 22}, got {page_cache_kib}")
        text = os.fspath(path)
        if not text or text == ":memory:" or text.startswith("file:"):
            raise ValueError(f"SqliteStore needs a database file path, got {text!r}")
        self.path = Path(os.path.abspath(text))  # threads and subscriptions reopen it
        super().__init__(sql, str(self.path))
        self.busy_timeout_s = busy_timeout_s
        self.page_cache_kib = page_cache_kib
        self._wake_prefix = wake_prefix(self.path, wake_name)
        self._poster = WakePoster()
        self._handoff = FeedHandoff()
        self._upkeep = (
            Upkeep(self.path, self.raise_floor, prune_interval_s)
            if background_checkpoints
            else None
        )
        self._pruned = 0
        state = self._state()  # opens, migrates, and refuses a newer schema now
        self._schema_version = state.retry.call("open", lambda: schema_version(state.conn))

    # -- connections ---------------------------------------------------------------------

    def _open_state(self) -> _ThreadState:
        conn = connect(self.path)
        retry = Retry(self.busy_timeout_s)
        try:
            retry.call("open", lambda: configure(conn, self.page_cache_kib))
            retry.call("open", lambda: migrate(conn, str(self.path)))
            if self._upkeep is not None:
                conn.execute(f"PRAGMA wal_autocheckpoint = {WRITER_CHECKPOINT_PAGES}")
        except BaseException:
            conn.close()
            raise
        state = _ThreadState(conn, self.busy_timeout_s)
        state.retry.retries = retry.retries
        return state

    def _close_state(self, state: _ThreadState) -> None:
        state.conn.close()

    def _read(self, what: str, body: Callable[[sqlite3.Connection], T]) -> T:
        state = self._state()
        return state.retry.call(what, lambda: body(state.conn))

    def _write(
        self,
        what: str,
        body: Callable[[sqlite3.Connection], T],
        *,
        rows: int,
        logged: bool,
        wait: bool = True,
        records: RecordsReader | None = None,
    ) -> T:
        try:
            result = self._write_once(
                what, body, rows=rows, logged=logged, wait=wait, records=records
            )
        except StoreFull as exc:
            self._health.refused(str(exc))
            raise
        self._health.succeeded()
        return result

    def _change(
        self, what: str, body: Callable[[sqlite3.Connection], T], *, rows: int, several: bool
    ) -> T:
        return self._write(what, body, rows=rows, logged=True)  # a transaction either way

    def _write_once(
        self,
        what: str,
        body: Callable[[sqlite3.Connection], T],
        *,
        rows: int,
        logged: bool,
        wait: bool,
        records: RecordsReader | None,
    ) -> T:
        """`records`: reads the transaction's log records after `body` (the entry before
        them given), where the body knows the rows; None: the feed's POLL reads them."""
        state = self._state()
        if logged:
            self._refresh_consumers(state)
        if logged and self._handoff.rings:
            # The transaction's own log records, read back before it commits, for the
            # consumers' rings (store.sqlite.feed_ring): the entry before them gives the chain.
            def logged_body(conn: sqlite3.Connection) -> tuple[T, list[LogRecord], int, int]:
                before, prev_stamp = head(conn)
                result = body(conn)
                if records is None:
                    read = conn.execute(sql.POLL, (before, HANDOFF_LIMIT + 1)).fetchall()
                else:
                    read = records(conn, before)
                whole = 0 < len(read) <= HANDOFF_LIMIT
                return result, read, prev_stamp, read[-1][0] if whole else head(conn)[0]

            result, read, prev_stamp, position = state.retry.transaction(
                state.conn, what, logged_body, write=True, wait=wait
            )
            self._committed(state, rows)
            state.write_position = position
            self._handoff.hand_over(read, prev_stamp, whole=len(read) <= HANDOFF_LIMIT)
        else:
            result = state.retry.transaction(state.conn, what, body, write=True, wait=wait)
            self._committed(state, rows)
            if logged:
                # Read when asked (write_position), after the commit: the head then may be
                # a later writer's, which only makes the position too high, never too low.
                state.write_position = None
        if logged:
            self._poster.post()
        return result

    def _committed(self, state: _ThreadState, rows: int) -> None:
        state.last_commit_ns = time.monotonic_ns()
        if self._upkeep is not None:
            self._upkeep.committed()
        state.transactions += 1
        state.rows_written += rows

    def _refresh_consumers(self, state: _ThreadState) -> None:
        """Learn the subscribed consumers' semaphores and rings now and then."""
        if self._poster.due():
            try:
                names = [n for (n,) in state.conn.execute(sql.WAKE_NAMES)]
            except sqlite3.OperationalError:
                return  # busy: keep the old lists; a wake-up is only a hint
            self._poster.refresh(names)
            self._handoff.refresh(names)

    @property
    def write_position(self) -> int:
        """The last log seq of this thread's last logged commit, or a later one (shm.marks)."""
        state = self._state()
        if state.write_position is None:
            state.write_position = state.retry.call("write_position", lambda: head(state.conn)[0])
        return state.write_position

    @property
    def last_commit_ns(self) -> int:
        """time.monotonic_ns() just after this thread's last commit (for lag measurements)."""
        return self._state().last_commit_ns

    # -- the schedule --------------------------------------------------------------------

    def _write_rows(self, upsert: Sequence[RowWrite], delete: Sequence[str]) -> None:
        params = [
            (r.key, r.route, r.cadence_s, 1 if r.sitemap else 0, r.next_render_at) for r in upsert
        ]
        gone = [(key,) for key in delete]

        def body(conn: sqlite3.Connection) -> None:
            if len(params) == 1:
                conn.execute(sql.UPSERT, params[0])
            elif params:
                conn.executemany(sql.UPSERT, params)
            if gone:
                conn.executemany(sql.DELETE, gone)

        self._write("write", body, rows=len(params) + len(gone), logged=True)

    def complete(self, items: Sequence[Completion], *, wait: bool = True) -> list[Row | None]:
        if not isinstance(items, list | tuple):
            items = list(items)
        check_completions(items)
        if not items:
            return []

        # One statement per outcome per round, not per item: within a round the log holds
        # the rendered rows, then the failed, the not found, then the gone (input order is
        # lost there); a key named twice is in two rounds, so its own completions apply in
        # order.
        # The statements and their parameters are made before the write lock is taken,
        # and the Rows after it is released: other writers wait only for SQLite's work.
        rounds = completion_rounds(items)
        statements = [_round_statements([items[i] for i in indices]) for indices in rounds]
        # Rendered items that say whether the page changed: decided inside the transaction,
        # from the row as it stands there (store.cadence).
        observed = [
            [items[i] for i in indices if items[i].changed is not None] for indices in rounds
        ]
        # Each changed key's row as the transaction leaves it (ROW_COLUMNS after the key;
        # None: deleted), for the log records the consumers' rings take.
        left: dict[str, tuple[object, ...] | None] = {}
        found: list[dict[str, tuple[Any, ...]]] = []  # per round: key -> ROW_COLUMNS' values

        def body(conn: sqlite3.Connection) -> None:
            left.clear()  # a retried transaction starts again
            found.clear()
            for indices, round_statements, seen in zip(rounds, statements, observed, strict=True):
                changed: dict[str, tuple[Any, ...]] = {}
                for values in [*_apply_observed(conn, seen), *_apply_round(conn, round_statements)]:
                    changed[values[0]] = values
                    left[values[0]] = values[1:]
                for index in indices:
                    if items[index].outcome == "gone":
                        left[items[index].key] = None
                found.append(changed)

        def logged(conn: sqlite3.Connection, before: int) -> list[LogRecord]:
            entries = conn.execute(sql.ENTRIES_AFTER, (before, HANDOFF_LIMIT + 1)).fetchall()
            records: list[LogRecord] = []
            for entry in entries:
                key = entry[2]
                if key not in left:  # not a change this body made: read the rows back
                    return list(conn.execute(sql.POLL, (before, HANDOFF_LIMIT + 1)))
                records.append((*entry, *(left[key] or _NO_ROW)))
            return records

        self._write("complete", body, rows=len(items), logged=True, wait=wait, records=logged)
        out: list[Row | None] = [None] * len(items)
        for indices, changed in zip(rounds, found, strict=True):
            for index in indices:
                values = changed.get(items[index].key)  # gone or missing: None
                out[index] = None if values is None else row_from(values)
        return out

    def _read_at(self, what: str, statement: str, params: tuple[object, ...]) -> RowsRead:
        """Rows, then the log's head, in one read transaction: one snapshot for both."""

        def body(conn: sqlite3.Connection) -> tuple[list[Row], tuple[int, int]]:
            rows = [row_from(values) for values in conn.execute(statement, params)]
            return rows, head(conn)

        state = self._state()
        rows, (seq, stamp) = state.retry.transaction(state.conn, what, body, write=False)
        return RowsRead(rows=rows, head=cursor_token(seq, stamp))

    def count(self) -> int:
        query = "SELECT count(*) FROM render_schedule"
        return int(self._read("count", lambda c: c.execute(query).fetchone()[0]))

    # -- the change feed -----------------------------------------------------------------

    def feed_head(self) -> Cursor:
        seq, stamp = self._state().retry.transaction(
            self._state().conn, "feed_head", head, write=False
        )
        return cursor_token(seq, stamp)

    def subscribe(self, consumer: str, cursor: Cursor | None = None) -> SqliteSubscription:
        """Open the feed at `cursor`, else at the consumer's saved cursor, else at the head.

        Registers the consumer at that position, so pruning keeps what it has not read.
        Raises CursorBelowFloor or CursorAhead (counted as a resync) instead of replaying short.
        """
        check_consumer(consumer)
        start = None if cursor is None else parse_cursor(cursor)
        # A fresh semaphore per subscription, made before writers can learn its name.
        wake = new_wake_name(self._wake_prefix)
        waiter = open_waiter(wake)
        ring = create_ring(wake) if waiter is not None else None

        def body(conn: sqlite3.Connection) -> tuple[Verdict, str, int, int, str | None]:
            saved = conn.execute(sql.CONSUMER, (consumer,)).fetchone()
            if start is not None:
                seq, stamp = start
            elif saved is not None:
                seq, stamp = int(saved[0]), int(saved[1])
            else:
                seq, stamp = head(conn)
            verdict, reason = judge(conn, seq, stamp)
            if verdict == "ahead":
                conn.execute("UPDATE feed_state SET resyncs = resyncs + 1 WHERE id = 1")
            if verdict != "ok":
                return verdict, reason, seq, stamp, None
            now_ms = time.time_ns() // 1_000_000
            conn.execute(sql.SAVE_CONSUMER, (consumer, seq, stamp, wake, now_ms))
            return verdict, reason, seq, stamp, None if saved is None else str(saved[2])

        try:
            verdict, reason, seq, stamp, previous = self._write(
                "subscribe", body, rows=0, logged=False
            )
            if verdict != "ok":
                raise_for(verdict, reason, consumer)
        except BaseException:
            release(wake, waiter, ring)
            raise
        if previous is not None and previous != wake:
            forget(previous)  # left by this consumer's last run, if it died without closing
        return SqliteSubscription(
            path=self.path,
            consumer=consumer,
            seq=seq,
            stamp=stamp,
            wake_name=wake,
            waiter=waiter,
            ring=ring,
            busy_timeout_s=self.busy_timeout_s,
        )

    def consumers(self) -> dict[str, Cursor]:
        """Every registered consumer's saved cursor."""
        found = self._read(
            "consumers",
            lambda c: c.execute("SELECT consumer, seq, stamp FROM feed_consumers").fetchall(),
        )
        return {name: cursor_token(int(seq), int(stamp)) for name, seq, stamp in found}

    def drop_consumer(self, consumer: str) -> bool:
        """Unregister a consumer (pruning stops waiting for it) and remove its semaphore."""
        check_consumer(consumer)

        def body(conn: sqlite3.Connection) -> str | None:
            found = conn.execute(sql.CONSUMER, (consumer,)).fetchone()
            conn.execute("DELETE FROM feed_consumers WHERE consumer = ?", (consumer,))
            return None if found is None else str(found[2])

        wake = self._write("drop_consumer", body, rows=0, logged=False)
        if wake is not None:
            forget(wake)
        return wake is not None

    def raise_floor(self) -> int:
        """Raise the log's floor to the lowest cursor a registered consumer saved (the head
        when none is registered); returns the entries now below it.

        Nothing is removed here: each later write trims a few entries below the floor
        in its own transaction (see store.sqlite.schema), and `prune()` removes them all.
        """

        def body(conn: sqlite3.Connection) -> int:
            last, _ = head(conn)
            lowest = conn.execute("SELECT min(seq) FROM feed_consumers").fetchone()[0]
            target = last if lowest is None else min(int(lowest), last)
            conn.execute("UPDATE feed_state SET floor = max(floor, ?) WHERE id = 1", (target,))
            floor = int(conn.execute(sql.FLOOR).fetchone()[0])
            oldest = conn.execute("SELECT min(seq) FROM change_log").fetchone()[0]
            return 0 if oldest is None else max(0, floor - int(oldest))

        return self._write("raise_floor", body, rows=0, logged=False)

    def prune(self, chunk: int = PRUNE_CHUNK, pause_s: float = 0.0) -> int:
        """Remove every log entry all registered consumers have passed; returns how many.

        The floor is raised (and committed) first, so a cursor below it is refused
        before anything it needs is gone; then entries below the floor go, a chunk
        per transaction so writers wait at most one chunk. The entry at the floor
        stays: it lets a cursor there prove it belongs to this log. The store's upkeep
        thread only raises the floor; writes trim below it a few entries at a time.
        """
        if chunk < 1:
            raise ValueError(f"prune: chunk must be at least 1, got {chunk}")
        self.raise_floor()
        floor = int(self._read("prune", lambda c: c.execute(sql.FLOOR).fetchone()[0]))
        removed = 0
        while True:

            def delete_chunk(conn: sqlite3.Connection) -> int:
                lowest = conn.execute("SELECT min(seq) FROM change_log").fetchone()[0]
                if lowest is None or lowest >= floor:
                    return 0
                bound = min(floor, int(lowest) + chunk)
                return conn.execute("DELETE FROM change_log WHERE seq < ?", (bound,)).rowcount

            done = self._write("prune", delete_chunk, rows=0, logged=False)
            if done == 0:
                break
            removed += done
            if pause_s:
                time.sleep(pause_s)
        with self._lock:
            self._pruned += removed
        return removed

    # -- upkeep --------------------------------------------------------------------------

    def statistics(self) -> StoreStatistics:
        def body(conn: sqlite3.Connection) -> tuple[int, ...]:
            def one(query: str) -> int:
                value = conn.execute(query).fetchone()[0]
                return -1 if value is None else int(value)

            return (
                one("SELECT count(*) FROM render_schedule"),
                one("SELECT count(*) FROM routes"),
                # committed seqs are contiguous: no scan of the log needed
                one(
                    "SELECT coalesce((SELECT max(seq) FROM change_log)"
                    " - (SELECT min(seq) FROM change_log) + 1, 0)"
                ),
                one(sql.FLOOR),
                one(sql.HEAD),
                one("SELECT count(*) FROM feed_consumers"),
                one("SELECT min(seq) FROM feed_consumers"),
                one("SELECT resyncs FROM feed_state WHERE id = 1"),
            )

        state = self._state()
        rows, routes, log_rows, floor, last, consumers, lowest, resyncs = state.retry.transaction(
            state.conn, "statistics", body, write=False
        )
        counted = self.counters()
        assert counted.sqlite is not None
        return StoreStatistics(
            path=str(self.path),
            schema_version=self._schema_version,
            rows=rows,
            routes=routes,
            log_rows=log_rows,
            floor=floor,
            head=last,
            consumers=consumers,
            lowest_consumer_seq=None if lowest < 0 else lowest,
            resyncs=resyncs,
            transactions=counted.transactions,
            rows_written=counted.rows_written,
            busy_retries=counted.sqlite.busy_retries,
            pruned=self._pruned,
            wake=self._poster.statistics(),
            upkeep=self._upkeep_statistics(),
        )

    def _upkeep_statistics(self) -> UpkeepStatistics:
        """The upkeep thread's counts; all zero for a store that runs none."""
        return (self._upkeep or Upkeep(self.path)).statistics()

    def _backend_counters(self, states: list[_ThreadState]) -> SqliteCounters:
        upkeep = self._upkeep_statistics()
        return SqliteCounters(
            busy_retries=sum(s.retry.retries for s in states),
            checkpoints=upkeep.checkpoints,
            restarts=upkeep.restarts,
            restarts_busy=upkeep.restarts_busy,
            checkpoint_errors=upkeep.errors,
            longest_checkpoint_ms=upkeep.longest_checkpoint_ms,
        )

    def close(self) -> None:
        """Close every thread's connection; the object is unusable afterwards."""
        if self._upkeep is not None:
            self._upkeep.close()  # first: its thread may be pruning on a connection below
        super().close()
        self._poster.close()
        self._handoff.close()


# A log record's row columns for a key whose row is gone, as POLL's LEFT JOIN reads them.
_NO_ROW = (None,) * (ROW_FIELDS - 1)


def _round_statements(round_items: list[Completion]) -> list[tuple[str, dict[str, object]]]:
    """One round's statements (no key twice): the rendered, then the failed, then the not
    found, then the gone, one statement each, with their parameters; all but the last
    return the rows they updated (ROW_COLUMNS), the last nothing."""
    rendered = [c for c in round_items if c.outcome == "rendered" and c.changed is None]
    failed = [c.key for c in round_items if c.outcome == "failed"]
    not_found = [c for c in round_items if c.outcome == "not_found"]
    gone = [c.key for c in round_items if c.outcome == "gone"]
    out: list[tuple[str, dict[str, object]]] = []
    if rendered:
        first = rendered[0]
        if all(c.now == first.now and c.next_render_at == first.next_render_at for c in rendered):
            params: dict[str, object] = {
                "now": first.now,
                "next_render_at": first.next_render_at,
                "keys": _json([c.key for c in rendered]),
            }
            out.append((sql.COMPLETE_RENDERED, params))
        else:
            each = _json([[c.key, c.now, c.next_render_at] for c in rendered])
            out.append((sql.COMPLETE_RENDERED_EACH, {"items": each}))
    if failed:
        out.append((sql.COMPLETE_FAILED, {"keys": _json(failed)}))
    if not_found:
        each = _json([[c.key, c.now, c.next_render_at] for c in not_found])
        out.append((sql.COMPLETE_NOT_FOUND, {"items": each}))
    if gone:
        out.append((sql.COMPLETE_GONE, {"keys": _json(gone)}))
    return out


def _apply_observed(conn: sqlite3.Connection, items: list[Completion]) -> list[tuple[Any, ...]]:
    """One round's rendered items that said whether the page changed (no key twice): each
    row's learned cadence and history from store.cadence, then one statement; the rows it
    updated (ROW_COLUMNS)."""
    if not items:
        return []
    read = conn.execute(sql.LEARNING, (_json([c.key for c in items]),)).fetchall()
    found = {values[0]: values for values in read}
    global_cadence_s = int(conn.execute(sql.GET_DEFAULT_CADENCE).fetchone()[0])
    each = []
    for item in items:
        values = found.get(item.key)
        if values is None or item.changed is None:
            continue  # no such row: nothing to update
        learned = learned_from(values, global_cadence_s, item.changed)
        each.append([item.key, item.now, item.next_render_at, learned.cadence_s, learned.history])
    if not each:
        return []
    return conn.execute(sql.COMPLETE_OBSERVED, {"items": _json(each)}).fetchall()


def _apply_round(
    conn: sqlite3.Connection, statements: list[tuple[str, dict[str, object]]]
) -> list[tuple[Any, ...]]:
    """Run one round's statements (`_round_statements`); the rows they updated."""
    out: list[tuple[Any, ...]] = []
    for statement, params in statements:
        out += conn.execute(statement, params).fetchall()
    return out


def _json(value: object) -> str:
    return msgspec.json.encode(value).decode()


assert KIND_ROW == 0  # the triggers in store.sqlite.schema write row entries as kind 0
