"""PostgresStore: the durable schedule on PostgreSQL, shared by every node of a cluster.

Thread-safety: one PostgresStore may be shared by the threads of one process; each
thread gets its own autocommit connection (threading.local), so the keeper thread
and the HTTP handlers never share one. Use a store only in the process that opened
it. A Subscription has a connection of its own that LISTENs.

Every batch (an upsert with deletes, a round of completions) is one statement, so one
round trip and one transaction. A connection lost mid-call raises StoreUnavailable and
is replaced at the next call; a read is retried once on a new connection first, a
write never is (its outcome would be unknown). `complete(wait=False)` gives up on a row
lock after NOWAIT_LOCK_MS with StoreBusy, so a caller on an event loop waits there.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import msgspec
import psycopg

from store.base import (
    DEFAULT_BUSY_TIMEOUT_S,
    Cursor,
    CursorAhead,
    CursorBelowFloor,
    Membership,
    PostgresCounters,
    RowsRead,
)
from store.core import SqlStore, ThreadState
from store.errors import StoreBusy, StoreError, StoreFull, StoreUnavailable
from store.postgres import sql
from store.postgres.conn import (
    STATEMENT_TIMEOUT_MS,
    Conn,
    connect,
    limit,
    long_statements,
    translated,
)
from store.postgres.feed import (
    CONSUMER_TTL_S,
    PRUNE_CHUNK,
    PRUNE_INTERVAL_S,
    PostgresSubscription,
    cursor_token,
    head,
    parse_cursor,
    prune,
)
from store.postgres.membership import (
    acknowledge,
    raise_lease_ceiling,
    read_members,
    read_nodes,
    settle_completed,
)
from store.postgres.schema import LATEST, migrate
from store.rows import (
    ROW_COLUMNS,
    Completion,
    Handover,
    MemberList,
    NodeRecord,
    Row,
    RowWrite,
    completion_rounds,
    learned_from,
    row_from,
)
from store.validate import check_completions, check_consumer

# COMPLETE's (and COMPLETE_RENDERED's) last row carries the transaction's xid in the
# version column.
_VERSION_AT = ROW_COLUMNS.split(", ").index("version")
T = TypeVar("T")
log = logging.getLogger("renderqueue.store")

# A caller that will not wait (an event loop) hears StoreBusy past this: long enough for
# the brief locks of the server's own upkeep, short next to a request's budget.
NOWAIT_LOCK_MS = 50
WRITE_ATTEMPTS = 3


class PostgresStoreStatistics(msgspec.Struct, frozen=True, kw_only=True):
    url: str  # without its password
    schema_version: int
    origin: str  # the cluster and database the log belongs to
    rows: int
    routes: int
    log_rows: int
    floor_xid: int  # every log entry at or above the floor is present
    consumers: int
    resyncs: int  # times the log was found restored from elsewhere and started anew
    transactions: int  # write statements committed through this object
    rows_written: int
    reconnects: int  # connections replaced after one was lost
    busy: int  # calls refused with StoreBusy
    rollbacks: int  # writes the server rolled back (deadlocks) and this store retried


class _ThreadState(ThreadState):
    def __init__(self) -> None:
        super().__init__()
        self.conn: Conn | None = None
        self.reconnects = 0
        self.busy = 0
        self.gave_up = 0  # of `busy`, writes that waited out the lock timeout
        self.rollbacks = 0
        self.write_position = 0

    @property
    def busy_refused(self) -> int:
        return self.gave_up


def redacted(url: str) -> str:
    """The URL without its password, for logs and statistics."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)
    user = netloc[0].split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc[1]}"))


class PostgresStore(SqlStore[Conn, _ThreadState]):
    """The PostgreSQL backend of `store.base.ScheduleStore`."""

    remote = True  # every call is a round trip to the server (ScheduleStore.remote)

    def __init__(
        self,
        url: str,
        *,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
        consumer_ttl_s: float = CONSUMER_TTL_S,
        prune_interval_s: float | None = PRUNE_INTERVAL_S,
    ) -> None:
        """`consumer_ttl_s`: a consumer that saved no cursor for this long stops holding the
        log; `prune_interval_s`: how often a consumer's cursor save also prunes the log
        (None: only explicit `prune()` calls do)."""
        if not url.startswith(("postgresql://", "postgres://")):
            raise ValueError(f"PostgresStore needs a postgresql:// URL, got {redacted(url)!r}")
        super().__init__(sql, redacted(url))
        self.url = url
        self.busy_timeout_s = busy_timeout_s
        self.consumer_ttl_s = consumer_ttl_s
        self.prune_interval_s = prune_interval_s
        conn = self._conn(self._state(), wait=True)
        # A migration of a large table, or a restored log's removal, takes what it takes:
        # stopped at a bound, it would only start over at the next open.
        with translated("open"), long_statements(conn):
            migrate(conn, self.where)
            self._schema_version = LATEST  # migrate() brought it there, or raised
            self.origin = self._adopt_log(conn)

    # -- connections ---------------------------------------------------------------------

    def _open_state(self) -> _ThreadState:
        return _ThreadState()  # its connection opens at its first call (_conn)

    def _conn(self, state: _ThreadState, *, wait: bool | None) -> Conn:
        """The thread's connection, with the lock timeout a writer that waits (or not) needs;
        `wait=None` (a read, which takes no row locks) leaves it as it is. A writer that
        waits for locks has its wait added to its statement timeout: the server counts
        the wait as the statement's time."""
        if self._closed:
            raise StoreError(f"the store at {self.where} is closed")
        if state.conn is not None and not state.conn.closed and not _still_open(state.conn):
            self._drop(state)
        if state.conn is None or state.conn.closed:
            if state.conn is not None:
                state.reconnects += 1
            state.conn = connect(self.url)
        busy_ms = int(self.busy_timeout_s * 1000)
        with translated("open"):
            limit(
                state.conn,
                statement_timeout_ms=STATEMENT_TIMEOUT_MS + (busy_ms if wait else 0),
                lock_timeout_ms=None if wait is None else busy_ms if wait else NOWAIT_LOCK_MS,
            )
        return state.conn

    def _close_state(self, state: _ThreadState) -> None:
        self._drop(state)

    def _drop(self, state: _ThreadState) -> None:
        if state.conn is not None:
            try:
                state.conn.close()
            except Exception:  # already broken: closing is best effort
                log.debug("closing a broken connection failed", exc_info=True)

    def _read(self, what: str, body: Callable[[Conn], T]) -> T:
        """A read, retried once on a new connection when the first one was lost; not when
        the server stopped answering, which a new connection would wait on as long."""
        state = self._state()
        for attempt in (1, 2):
            conn = self._conn(state, wait=None)
            try:
                with translated(what):
                    return body(conn)
            except StoreUnavailable:
                self._drop(state)
                if attempt == 2 or conn.unanswered:
                    raise
        raise AssertionError("unreachable")

    def _write(self, what: str, body: Callable[[Conn], T], *, rows: int, wait: bool = True) -> T:
        """A write; one the server rolled back whole (a deadlock between batches that lock
        shared rows in another order) is retried, a few times, when the caller waits."""
        state = self._state()
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            conn = self._conn(state, wait=wait)
            try:
                with translated(what):
                    try:
                        result = body(conn)
                    except psycopg.errors.TransactionRollback:
                        if not wait or attempt == WRITE_ATTEMPTS:
                            raise
                        state.rollbacks += 1
                        continue
            except StoreUnavailable:
                self._drop(state)
                raise
            except StoreBusy:
                state.busy += 1
                state.gave_up += wait
                raise
            except StoreFull as exc:
                self._health.refused(str(exc))
                raise
            state.transactions += 1
            state.rows_written += rows
            self._health.succeeded()
            return result
        raise AssertionError("unreachable")

    def _change(self, what: str, body: Callable[[Conn], T], *, rows: int, several: bool) -> T:
        if not several:
            return self._write(what, body, rows=rows)  # autocommit: one transaction

        def together(conn: Conn) -> T:
            with conn.transaction():
                return body(conn)

        return self._write(what, together, rows=rows)

    def _positioned(self, xid: int) -> None:
        """Called with a committed write's xid (autocommit: the statement has committed)."""
        self._state().write_position = int(xid)

    @property
    def write_position(self) -> int:
        """The xid of this thread's last committed write (shm.marks)."""
        return self._state().write_position

    def _adopt_log(self, conn: Conn) -> str:
        """This database's identity; a log written under another (a restored dump) is
        started anew, with every consumer's cursor: its xids mean nothing here."""
        origin = _origin(conn)
        found = conn.execute(sql.FLOOR).fetchone()
        assert found is not None
        if found[2] == origin:
            return origin
        with conn.transaction():
            locked = conn.execute("SELECT origin FROM feed_state WHERE id = 1 FOR UPDATE")
            row = locked.fetchone()
            assert row is not None
            if row[0] == origin:
                return origin  # another process adopted it meanwhile
            xmin, _ = head(conn)
            if row[0]:
                log.warning(
                    "store: the change log was written by database %s, this is %s (restored "
                    "from a dump?); starting the log and its cursors anew",
                    row[0],
                    origin,
                )
                conn.execute("DELETE FROM change_log")
                conn.execute("DELETE FROM feed_consumers")
            conn.execute(
                """UPDATE feed_state SET origin = %s, floor_xid = %s::text::xid8, floor_seq = 0,
                resyncs = resyncs + %s WHERE id = 1""",
                (origin, str(xmin), 1 if row[0] else 0),
            )
        return origin

    # -- the schedule --------------------------------------------------------------------

    def _write_rows(self, upsert: Sequence[RowWrite], delete: Sequence[str]) -> None:
        # ON CONFLICT touches a row once per statement: the last write of a key wins, as
        # if the batch had been applied in order.
        last = {row.key: row for row in upsert}
        rows = list(last.values())
        params: dict[str, Any] = {
            "keys": [r.key for r in rows],
            "routes": [r.route for r in rows],
            "cadences": [r.cadence_s for r in rows],
            "sitemaps": [r.sitemap for r in rows],
            "nexts": [r.next_render_at for r in rows],
            "deletes": list(dict.fromkeys(delete)),
        }
        if rows and delete:
            statement = sql.UPSERT_AND_DELETE
        elif rows:
            statement = sql.UPSERT
        else:
            statement = sql.DELETE

        def body(conn: Conn) -> None:
            (xid,) = conn.execute(statement, params).fetchall()[0]
            self._positioned(xid)

        self._write("write", body, rows=len(rows) + len(delete))

    def complete(self, items: Sequence[Completion], *, wait: bool = True) -> list[Row | None]:
        if not isinstance(items, list | tuple):
            items = list(items)
        check_completions(items)
        if not items:
            return []

        def body(conn: Conn) -> list[Row | None]:
            out, xid = self._apply_completions(conn, items)
            self._positioned(xid)  # committed: after the transaction, or autocommit
            return out

        return self._write("complete", body, rows=len(items), wait=wait)

    def complete_handed_over(
        self, node: str, items: Sequence[Completion], leases: Sequence[tuple[int, int]]
    ) -> list[Row | bool | None]:
        """store.base.Membership.complete_handed_over: each item, its lease (key hash,
        token) handed over by `node` once it left, written in the transaction that
        settles its hand-over row; False for an item whose lease was not there to settle."""
        check_completions(items)
        if not items:
            return []

        def body(conn: Conn) -> list[Row | bool | None]:
            with conn.transaction():
                taken = settle_completed(conn, node, leases)
                chosen = [i for i, ok in enumerate(taken) if ok]
                rows, xid = self._apply_completions(conn, [items[i] for i in chosen])
            if chosen:
                self._positioned(xid)
            out: list[Row | bool | None] = [False] * len(items)
            for i, row in zip(chosen, rows, strict=True):
                out[i] = row
            return out

        return self._write("complete handed over", body, rows=len(items))

    def _apply_completions(
        self, conn: Conn, items: Sequence[Completion]
    ) -> tuple[list[Row | None], int]:
        """The completions' rows (None: gone or missing) and the writing transaction's
        xid; one statement in autocommit where it can be, else one transaction (a
        savepoint inside the caller's)."""
        if not items:
            return [], 0
        rounds = completion_rounds(items)

        # Rendered items that say whether the page changed: their rows are read, locked, in
        # the same transaction, and store.cadence decides what each learns.
        observes = any(item.changed is not None for item in items)

        def apply_round(conn: Conn, indices: list[int], out: list[Row | None]) -> int:
            """The round's rows into `out`; returns the transaction's xid."""
            staged = [items[i] for i in indices]
            learned: list[int | None] = [None] * len(staged)
            histories: list[int | None] = [None] * len(staged)
            observed = [c.changed is not None for c in staged]
            if any(observed):
                keys = [c.key for c in staged if c.changed is not None]
                found_rows = {v[0]: v for v in conn.execute(sql.LEARNING, (keys,)).fetchall()}
                default = conn.execute(sql.GET_DEFAULT_CADENCE).fetchone()
                assert default is not None
                for n, item in enumerate(staged):
                    values = found_rows.get(item.key)
                    if values is None or item.changed is None:
                        continue
                    decided = learned_from(values, int(default[0]), item.changed)
                    learned[n], histories[n] = decided.cadence_s, decided.history
            statement, params = _round_statement(staged, observed, learned, histories)
            found: dict[str, Row] = {}
            xid = 0
            for values in conn.execute(statement, params).fetchall():
                if values[0] is None:
                    xid = values[_VERSION_AT]  # the version column carries it
                else:
                    row = row_from(values)
                    found[row.key] = row
            for index, item in zip(indices, staged, strict=True):
                out[index] = found.get(item.key)  # gone or missing: None
            return int(xid)

        out: list[Row | None] = [None] * len(items)
        if len(rounds) == 1 and not observes:
            xid = apply_round(conn, rounds[0], out)
        else:
            with conn.transaction():
                for indices in rounds:
                    xid = apply_round(conn, indices, out)
        return out, xid

    def _read_at(self, what: str, statement: str, params: tuple[object, ...]) -> RowsRead:
        """Rows and the feed's head from one statement: one snapshot for both."""
        found = self._read(what, lambda c: c.execute(statement, params).fetchall())
        xmin, xmax = int(found[0][0]), int(found[0][1])
        rows = [row_from(values[2:]) for values in found if values[2] is not None]
        return RowsRead(rows=rows, head=cursor_token(self.origin, xmin, 0, xmax))

    def count(self) -> int:
        found = self._read("count", lambda c: _counted(c, sql.COUNT))
        return 0 if found is None else int(found[0])

    # -- the change feed -----------------------------------------------------------------

    def feed_head(self) -> Cursor:
        xmin, xmax = self._read("feed_head", head)
        return cursor_token(self.origin, xmin, 0, xmax)

    def subscribe(self, consumer: str, cursor: Cursor | None = None) -> PostgresSubscription:
        """Open the feed at `cursor`, else at the consumer's saved cursor, else at the head.

        Registers the consumer at that position, so pruning keeps what it has not read.
        Raises CursorBelowFloor or CursorAhead instead of replaying short.
        """
        check_consumer(consumer)
        start = None if cursor is None else parse_cursor(cursor, self.origin)

        def body(conn: Conn) -> tuple[int, int]:
            with conn.transaction():
                floor = conn.execute(
                    "SELECT floor_xid::text::bigint, floor_seq FROM feed_state"
                    " WHERE id = 1 FOR SHARE"
                ).fetchone()
                assert floor is not None
                xmin, xmax = head(conn)
                saved = conn.execute(sql.CONSUMER, (consumer,)).fetchone()
                if start is not None:
                    position = (start.xid, start.seq)
                elif saved is not None:
                    position = (int(saved[0]), int(saved[1]))
                else:
                    position = (xmin, 0)
                if position[0] > xmax:
                    raise CursorAhead(
                        f"consumer {consumer!r}: cursor xid {position[0]} is past the "
                        f"database's next transaction id {xmax} (a restored or different "
                        "database); resync: subscribe at feed_head() and walk the table."
                    )
                if position < (int(floor[0]), int(floor[1])):
                    raise CursorBelowFloor(
                        f"consumer {consumer!r}: cursor {position} is below the change log's "
                        f"pruned floor {tuple(floor)}; replay would be short. Resync: "
                        "subscribe at feed_head() and walk the table."
                    )
                conn.execute(sql.SAVE_CONSUMER, (consumer, str(position[0]), position[1]))
                return position

        xid, seq = self._write("subscribe", body, rows=0)
        return PostgresSubscription(
            url=self.url,
            consumer=consumer,
            origin=self.origin,
            xid=xid,
            seq=seq,
            consumer_ttl_s=self.consumer_ttl_s,
            prune_interval_s=self.prune_interval_s,
        )

    def consumers(self) -> dict[str, Cursor]:
        """Every registered consumer's saved cursor."""
        found = self._read("consumers", lambda c: c.execute(sql.CONSUMERS).fetchall())
        return {name: cursor_token(self.origin, int(xid), int(seq)) for name, xid, seq in found}

    def drop_consumer(self, consumer: str) -> bool:
        """Unregister a consumer: pruning stops waiting for it."""
        check_consumer(consumer)
        found = self._write(
            "drop_consumer",
            lambda c: c.execute(sql.DROP_CONSUMER, (consumer,)).fetchone(),
            rows=0,
        )
        return found is not None

    def prune(self, chunk: int = PRUNE_CHUNK) -> int:
        """Remove every log entry all live consumers have passed; returns how many."""
        if chunk < 1:
            raise ValueError(f"prune: chunk must be at least 1, got {chunk}")
        return self._write(
            "prune",
            lambda conn: prune(conn, consumer_ttl_s=self.consumer_ttl_s, chunk=chunk),
            rows=0,
        )

    # -- the cluster's members -----------------------------------------------------------

    @property
    def membership(self) -> Membership:
        return self  # store.base.Membership, read on this store's connections

    def nodes(self, ttl_s: float) -> list[NodeRecord]:
        """Every known node, live (by the database's clock and `ttl_s`) or not."""
        return self._read("nodes", lambda conn: read_nodes(conn, ttl_s))

    def members(self, ttl_s: float, handovers: bool = False) -> MemberList:
        """The member list with the database's clock (and the live lease hand-overs)."""
        return self._read("nodes", lambda conn: read_members(conn, ttl_s, handovers))

    def acknowledge(
        self, node: str, incarnation: int, view: Sequence[int], handover: Handover
    ) -> bool:
        """store.base.Membership.acknowledge (store.postgres.membership.acknowledge)."""
        return self._read(
            "acknowledge", lambda conn: acknowledge(conn, node, incarnation, view, handover)
        )

    def raise_lease_ceiling(
        self, node: str, ttl_s: float, incarnation: int, horizon_ms: int
    ) -> bool:
        """store.base.Membership.raise_lease_ceiling (store.postgres.membership's)."""
        return self._read(
            "lease ceiling",
            lambda conn: raise_lease_ceiling(conn, node, incarnation, horizon_ms, ttl_s),
        )

    # -- upkeep --------------------------------------------------------------------------

    def statistics(self) -> PostgresStoreStatistics:
        def body(conn: Conn) -> tuple[Any, ...]:
            found = _counted(
                conn,
                """SELECT (SELECT count(*) FROM render_schedule),
                          (SELECT count(*) FROM routes),
                          (SELECT count(*) FROM change_log),
                          (SELECT floor_xid::text::bigint FROM feed_state WHERE id = 1),
                          (SELECT count(*) FROM feed_consumers),
                          (SELECT resyncs FROM feed_state WHERE id = 1)""",
            )
            assert found is not None
            return tuple(found)

        rows, routes, log_rows, floor_xid, consumers, resyncs = self._read("statistics", body)
        counted = self.counters()
        assert counted.postgres is not None
        busy = sum(s.busy for s in self._thread_states())
        return PostgresStoreStatistics(
            url=self.where,
            schema_version=self._schema_version,
            origin=self.origin,
            rows=int(rows),
            routes=int(routes),
            log_rows=int(log_rows),
            floor_xid=int(floor_xid),
            consumers=int(consumers),
            resyncs=int(resyncs),
            transactions=counted.transactions,
            rows_written=counted.rows_written,
            reconnects=counted.postgres.reconnects,
            busy=busy,
            rollbacks=counted.postgres.rollbacks,
        )

    def _backend_counters(self, states: list[_ThreadState]) -> PostgresCounters:
        return PostgresCounters(
            reconnects=sum(s.reconnects for s in states),
            rollbacks=sum(s.rollbacks for s in states),
        )

    @property
    def last_commit_ns(self) -> int:
        """time.monotonic_ns() now: a write returns only once its commit is acknowledged."""
        return time.monotonic_ns()


def _round_statement(
    staged: list[Completion],
    observed: list[bool],
    learned: list[int | None],
    histories: list[int | None],
) -> tuple[str, dict[str, object]]:
    """A round's statement and its parameters: COMPLETE_RENDERED for the usual round
    (every item rendered at one time, toward one next render, nothing observed), else
    COMPLETE with every item's fields in arrays."""
    first, keys = staged[0], [c.key for c in staged]
    if not any(observed) and all(
        c.outcome == "rendered" and c.now == first.now and c.next_render_at == first.next_render_at
        for c in staged
    ):
        return sql.COMPLETE_RENDERED, {
            "keys": keys,
            "now": first.now,
            "next_at": first.next_render_at,
        }
    return sql.COMPLETE, {
        "keys": keys,
        "outcomes": [c.outcome for c in staged],
        "nows": [c.now for c in staged],
        "nexts": [c.next_render_at for c in staged],
        "observed": observed,
        "learned": learned,
        "histories": histories,
    }


def _counted(conn: Conn, statement: str) -> tuple[Any, ...] | None:
    """A statement that counts whole tables: seconds on a large one, so a long one."""
    with long_statements(conn):
        return conn.execute(statement).fetchone()


def _still_open(conn: Conn) -> bool:
    """False when the server has closed an idle connection (a restart, a terminated
    backend): the socket reads as ready with nothing asked of it. Found before a write is
    sent, not by the write, which could not then be retried."""
    try:
        ready, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.OperationalError):
        return False
    return not ready


def _origin(conn: Conn) -> str:
    """The cluster's system identifier and the database's oid: a restore changes one."""
    try:
        with conn.transaction():
            found = conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()
        system = "" if found is None else str(found[0])
    except psycopg.errors.InsufficientPrivilege:
        system = "unknown"
    found = conn.execute(
        "SELECT oid FROM pg_database WHERE datname = current_database()"
    ).fetchone()
    assert found is not None
    return f"{system}.{found[0]}"
