"""The PostgreSQL change feed: a consumer's `(xid, seq)` keyset cursor over `change_log`.

Transactions commit in any order, so neither `seq` nor commit time orders the log.
A poll reads, in ONE statement, the entries after the cursor whose transaction id is
below its own snapshot's xmin: every such transaction has finished, so no entry can
ever appear below that horizon again, and the keyset `(xid, seq)` pages through what
is there exactly. A cursor of `seq` alone, or `seq` with the xmin filter, skips an
entry whose transaction took its seq early and committed late.
Each event carries the current state of what its entry names, read in the same
snapshot, so events are state, not deltas.

A poll that returned less than its limit has delivered every entry below the
horizon, so the cursor moves to `(xmin, 0)`; `has_delivered(head)` is then a
comparison with the head's xmax. A transaction that stays open holds xmin, and the
feed with it: delayed, never lost. The subscription measures how long, and names the
backend holding it, for the keeper to report.

Wake-ups are LISTEN/NOTIFY with a constant payload, a hint only: a wait also looks
for deliverable entries every FALLBACK_POLL_S, and re-polls soon while committed
entries wait behind a running transaction (their commit sent its notify already).
Reads are at least GATHER_S apart: a poll is a statement whose fixed cost, on both
sides of the connection, is many times an event's, so under a stream of single-row
writes one read for each commit's notify would spend the consumer's time, and the
server's, on that cost; commits made meanwhile gather and are read together.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

from store.base import (
    Cursor,
    CursorAhead,
    CursorBelowFloor,
    FeedBatch,
    FeedStatistics,
    RowRecords,
)
from store.postgres import sql
from store.postgres.conn import Conn, connect, long_statements, translated
from store.postgres.schema import NOTIFY_CHANNEL
from store.postgres.sql import (
    POLL_DETAILS_MISSING,
    POLL_KEY,
    POLL_KIND,
    POLL_RECORD,
    POLL_ROUTE,
    POLL_SETTING,
    POLL_SITE,
    POLL_XID,
)
from store.rows import (
    FeedEvent,
    LogRecord,
    Route,
    RouteEvent,
    SettingsEvent,
    SiteEvent,
    SiteSettings,
    last_of_each_key,
    route_from,
    row_event_from,
)
from store.schema import DEFAULT_CADENCE_S, KIND_ROUTE, KIND_ROW, KIND_SETTINGS, KIND_SITE

log = logging.getLogger("renderqueue.store")

_TOKEN_PREFIX = "pg"
FALLBACK_POLL_S = 0.5  # a wait looks for deliverable entries this often without a notify
# While committed entries wait behind a running transaction, a wait re-polls after this,
# doubling up to HELD_POLL_MAX_S: the commit that frees them may notify nobody.
HELD_POLL_S = 0.001
HELD_POLL_MAX_S = 0.1
GATHER_S = 0.004  # the least time between two reads (module note); a bound on added lag
HELD_REPORT_S = 1.0  # a feed held back this long has its holder looked up
PRUNE_INTERVAL_S = 10.0
# Entries one pruning statement removes. Each statement is a transaction, and a running
# transaction holds every feed's horizon (pg_snapshot_xmin) until it ends, so a chunk
# must take milliseconds even on a loaded server. The pruner pauses PRUNE_PAUSE_S
# between chunks, so the feeds read in between.
PRUNE_CHUNK = 1_000
PRUNE_PAUSE_S = 0.005
CONSUMER_TTL_S = 600.0  # a consumer that saved nothing for this long no longer holds the log
PRUNE_LOCK = 0x7271_7072_756E_6500  # "rqprune"
# The log is counted after each pruning round, up to this many: enough to show a log that
# no longer shrinks, and a count that stays cheap however far it grew.
RETAINED_COUNT_CAP = 1_000_000

DELIVERABLE = """
SELECT EXISTS (
    SELECT 1 FROM change_log
    WHERE (xid, seq) > (%(xid)s::text::xid8, %(seq)s)
      AND xid < pg_snapshot_xmin(pg_current_snapshot())
)
"""


# How long the server keeps a listener whose socket takes no data (see Subscription).
LISTENER_TCP_USER_TIMEOUT_MS = 10_000

# How the feed's session plans. By default the server plans each poll anew (it prices the
# generic plan dearer), and that planning is about a fifth of a poll's cost on the
# server. A generic plan is made once, from the statistics of that moment: one made while
# the log looked empty scans the whole log, or reads all of it for a max(), at every poll
# after. Every statement of the feed is an index range or point read whatever the log's
# size, so the session is given no other way to read a table.
PLANNING = (
    "SET plan_cache_mode = force_generic_plan",
    "SET enable_seqscan = off",
    "SET enable_bitmapscan = off",
)


class Position(NamedTuple):
    """A place in the log: entries after (xid, seq) are still to come. `xmax`, for a head
    read beside rows, is the snapshot's xmax: those rows are delivered once the feed's
    cursor reaches it."""

    xid: int
    seq: int
    xmax: int


def cursor_token(origin: str, xid: int, seq: int, xmax: int | None = None) -> Cursor:
    return Cursor(token=f"{_TOKEN_PREFIX}:{origin}:{xid}:{seq}:{xid if xmax is None else xmax}")


def parse_cursor(cursor: Cursor, origin: str) -> Position:
    """The cursor's position; CursorAhead when it belongs to another incarnation of the log
    (a dump restored elsewhere): the log and every cursor into it are new there."""
    parts = cursor.token.split(":") if isinstance(cursor, Cursor) else []
    if len(parts) != 5 or parts[0] != _TOKEN_PREFIX:
        raise ValueError(f"cursor {cursor!r} was not issued by a PostgreSQL store")
    try:
        position = Position(int(parts[2]), int(parts[3]), int(parts[4]))
    except ValueError:
        raise ValueError(f"cursor {cursor!r} is malformed") from None
    if min(position) < 0:
        raise ValueError(f"cursor {cursor!r} is malformed")
    if parts[1] != origin:
        raise CursorAhead(
            f"cursor {cursor.token!r} belongs to the log of database {parts[1]!r}, not this "
            f"one ({origin!r}): it was restored from a dump or is another database; resync"
        )
    return position


class PostgresFeedStatistics(FeedStatistics, frozen=True, kw_only=True):
    """FeedStatistics (woken: waits ended by a NOTIFY; noticed: by the fallback look),
    and PostgreSQL's own."""

    consumer: str
    xid: int  # the cursor: entries after (xid, seq) are still to come
    seq: int
    saved_xid: int  # the position last saved for pruning
    horizon: int  # the last poll's snapshot xmin
    held_polls: int  # waits cut short to re-poll entries held behind a running transaction
    skipped: int  # polls skipped: nothing announced, or the last read was moments ago
    pruned: int  # log entries this subscription's saves pruned


class PostgresSubscription:
    """One consumer's open feed, on a connection of its own that LISTENs. One reader."""

    def __init__(
        self,
        *,
        url: str,
        consumer: str,
        origin: str,
        xid: int,
        seq: int,
        consumer_ttl_s: float = CONSUMER_TTL_S,
        prune_interval_s: float | None = PRUNE_INTERVAL_S,
    ) -> None:
        self.consumer = consumer
        self._gather_s = GATHER_S
        self._origin = origin
        self._xid, self._seq = xid, seq
        self._saved_xid = xid
        self._horizon = xid
        self._consumer_ttl_s = consumer_ttl_s
        self._prune_interval_s = prune_interval_s
        self._pruner: Pruner | None = None
        self._url = url
        self._conn: Conn = connect(url, application_name="renderqueue-feed")
        try:
            with translated("subscribe"):
                # Every notifying commit queues a notification until each listener has
                # read it, and a listener whose process is stopped reads nothing: once
                # its socket buffers fill, the server's shared queue grows until it is
                # full and every writing commit in the database fails. The server drops a
                # listener whose socket has accepted nothing for this long instead; the
                # feed then reopens, and polls meanwhile, so nothing is lost.
                self._conn.execute(f"SET tcp_user_timeout = {LISTENER_TCP_USER_TIMEOUT_MS}")
                self._conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                for setting in PLANNING:
                    self._conn.execute(setting)
        except BaseException:
            self._conn.close()
            raise
        self._more = False
        self._pending = False  # committed entries wait behind a running transaction
        # Whether a poll may find something though nothing was announced (see quiet()).
        self._stale = True
        self._read_at = 0.0
        self._skipped = 0
        self._held_poll_s = HELD_POLL_S
        self._held_xmin = -1
        self._held_since = 0.0
        self._held_back_s = 0.0
        self._held_by_pid = 0
        self._holder_looked_up = -1
        self._polls = self._events = self._entries = self._coalesced = 0
        self._woken = self._noticed = self._timeouts = self._held_polls = 0
        self._closed = False

    @property
    def cursor(self) -> Cursor:
        return cursor_token(self._origin, self._xid, self._seq)

    def poll(self, limit: int = 1000) -> FeedBatch:
        entries, _ = self._read(limit)
        return FeedBatch(events=self._events_of(entries), cursor=self.cursor, more=self._more)

    def poll_records(self, limit: int = 1000) -> FeedBatch | RowRecords:
        """`poll`, but a batch of row entries only comes as their records (RowRecords),
        coalesced as `poll` coalesces them: no Row or event is made of them here."""
        entries, rows_only = self._read(limit)
        if not rows_only:
            return FeedBatch(events=self._events_of(entries), cursor=self.cursor, more=self._more)
        kept, folded = last_of_each_key([cast(LogRecord, e[POLL_RECORD]) for e in entries])
        self._coalesced += folded
        self._entries += len(entries)
        self._events += len(kept)
        return RowRecords(records=kept, cursor=self.cursor, more=self._more)

    def _read(self, limit: int) -> tuple[list[tuple[Any, ...]], bool]:
        """The next entries after the cursor, up to `limit`, each a POLL row (a route,
        settings or site entry with its details appended), and whether all are row
        entries; the cursor moves past them."""
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if self._closed:
            raise ValueError(f"subscription {self.consumer!r} is closed")
        # One entry past the limit: whether more are there, and where the next one is.
        params = {"xid": str(self._xid), "seq": self._seq, "limit": limit + 1}
        with translated("poll"):
            self._discard_notifies()  # this poll answers every commit they announced
            self._stale, self._read_at = False, time.monotonic()
            rows = self._conn.execute(sql.POLL, params).fetchall()
        xmin, xmax, floor_xid, floor_seq, pending = rows[0][:5]
        if (self._xid, self._seq) < (floor_xid, floor_seq):
            raise CursorBelowFloor(
                f"consumer {self.consumer!r}: cursor ({self._xid}, {self._seq}) is below the "
                f"change log's pruned floor ({floor_xid}, {floor_seq}); resync (walk)"
            )
        entries = rows if rows[0][POLL_XID] is not None else []
        following = entries[limit] if len(entries) > limit else None
        del entries[limit:]
        rows_only = all(entry[POLL_KIND] == KIND_ROW for entry in entries)
        if not rows_only:
            with translated("poll"):  # before the cursor moves: a failure re-reads them
                entries = self._with_details(entries)
        self._polls += 1
        with translated("poll"):
            self._held(xmin, xmax)
        self._pending = bool(pending)
        self._horizon = xmin
        self._more = following is not None
        if entries:
            self._xid, self._seq = int(entries[-1][POLL_XID]), int(entries[-1][POLL_XID + 1])
        if following is not None:
            if int(following[POLL_XID]) > self._xid:
                # Below the horizon nothing lies between the last entry and the next: the
                # cursor stands before the next transaction's, so a head whose transactions
                # were all delivered counts as delivered now, not one poll later.
                self._xid, self._seq = int(following[POLL_XID]), 0
        elif (xmin, 0) > (self._xid, self._seq):
            self._xid, self._seq = xmin, 0  # everything below the horizon is delivered
        return entries, rows_only

    def _with_details(self, entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Each route, settings or site entry with what it names appended
        (sql.POLL_DETAILS); row entries as they are."""
        named: dict[int, list[str]] = {KIND_ROUTE: [], KIND_SETTINGS: [], KIND_SITE: []}
        for entry in entries:
            if entry[POLL_KIND] in named:
                named[entry[POLL_KIND]].append(entry[POLL_KEY])
        found = {
            (detail[0], detail[1]): detail[2:]
            for detail in self._conn.execute(
                sql.POLL_DETAILS,
                {
                    "routes": named[KIND_ROUTE],
                    "settings": named[KIND_SETTINGS],
                    "sites": named[KIND_SITE],
                },
            ).fetchall()
        }
        return [
            entry
            if entry[POLL_KIND] == KIND_ROW
            else (*entry, *found.get((entry[POLL_KIND], entry[POLL_KEY]), POLL_DETAILS_MISSING))
            for entry in entries
        ]

    def _events_of(self, entries: Sequence[tuple[Any, ...]]) -> list[FeedEvent]:
        events: dict[tuple[int, str], FeedEvent] = {}
        for entry in entries:
            record = cast(LogRecord, entry[POLL_RECORD])
            kind, key = int(record[1]), str(record[2])
            slot = (kind, key)
            if slot in events:
                del events[slot]  # re-inserted below: the event sits at its key's last entry
                self._coalesced += 1
            if kind == KIND_ROW:
                events[slot] = row_event_from(record)
            elif kind == KIND_ROUTE:
                route = entry[POLL_ROUTE]
                # paused is NOT NULL: a null one is a route that is gone
                events[slot] = RouteEvent(
                    route=Route(route=key) if route[1] is None else route_from((key, *route))
                )
            elif kind == KIND_SETTINGS:
                value = entry[POLL_SETTING]
                events[slot] = SettingsEvent(
                    default_cadence_s=DEFAULT_CADENCE_S if value is None else int(value)
                )
            elif kind == KIND_SITE:
                found, most, interval = entry[POLL_SITE]
                events[slot] = SiteEvent(
                    settings=SiteSettings(site=key, max_in_flight=most, min_interval_ms=interval)
                    if found
                    else SiteSettings(site=key)
                )
        self._entries += len(entries)
        self._events += len(events)
        return list(events.values())

    def _held(self, xmin: int, xmax: int) -> None:
        """Track how long the same transaction has been the horizon while others ran."""
        now = time.monotonic()
        if xmin >= xmax:
            self._held_xmin, self._held_back_s, self._held_by_pid = -1, 0.0, 0
            return
        if xmin != self._held_xmin:
            self._held_xmin, self._held_since, self._held_by_pid = xmin, now, 0
        self._held_back_s = now - self._held_since
        if self._held_back_s >= HELD_REPORT_S and self._holder_looked_up != xmin:
            self._holder_looked_up = xmin
            found = self._conn.execute(sql.HOLDER, (xmin,)).fetchone()
            self._held_by_pid = 0 if found is None else int(found[0])

    def quiet(self) -> bool:
        """True when a poll now would most likely find nothing: no NOTIFY since the last
        read, none of its entries left behind or held back, no caller waiting on a head,
        and a read within FALLBACK_POLL_S. A poll is a statement here: a caller that polls
        at every turn of its loop (the keeper) skips those."""
        if self._more:
            return False
        since = time.monotonic() - self._read_at
        if since < self._gather_s:
            self._skipped += 1
            return True  # read moments ago: what was announced since gathers (module note)
        if self._stale or self._pending or since >= FALLBACK_POLL_S:
            return False
        with translated("poll"):
            for _ in self._conn.notifies(timeout=0, stop_after=1):
                self._stale = True  # a commit was announced since the last read
                return False
        self._skipped += 1
        return True

    def _discard_notifies(self) -> None:
        for _ in self._conn.notifies(timeout=0):
            pass

    def wait(self, timeout_s: float) -> bool:
        if self._more:
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self._stale:  # announced, or someone waits on a head: due at the next read
            return self._gathered(deadline)
        if self._pending:
            # The entries wait on a transaction still running, whose end may notify nobody.
            pause = min(self._held_poll_s, max(0.0, timeout_s))
            self._held_poll_s = min(self._held_poll_s * 2, HELD_POLL_MAX_S)
            if not self._notified(pause):
                self._held_polls += 1
            return self._gathered(deadline)
        self._held_poll_s = HELD_POLL_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._timeouts += 1
                return False
            if self._notified(min(remaining, FALLBACK_POLL_S)):
                return self._gathered(deadline)
            if deadline - time.monotonic() > 0 and self._deliverable():
                self._noticed += 1
                return True

    def _gathered(self, deadline: float) -> bool:
        """Sleep out the rest of GATHER_S since the last read (never past `deadline`), so
        the commits arriving meanwhile are read together; True: a read is due."""
        pause = min(self._read_at + self._gather_s, deadline) - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        return True

    def _notified(self, timeout_s: float) -> bool:
        """Whether a NOTIFY arrives within `timeout_s`.

        The wait is select() on the socket, and psycopg only reads what is there
        (`notifies(timeout=0)`): its own waiting `notifies(timeout=...)` keeps the CPU
        busy before it blocks, on every call, and a feed under a stream of writes waits
        at every read."""
        deadline = time.monotonic() + timeout_s
        with translated("wait"):
            while True:
                for _ in self._conn.notifies(timeout=0, stop_after=1):
                    self._woken += 1
                    self._stale = True
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                select.select([self._conn.fileno()], [], [], remaining)

    def _deliverable(self) -> bool:
        params = {"xid": str(self._xid), "seq": self._seq}
        with translated("wait"):
            found = self._conn.execute(DELIVERABLE, params).fetchone()
        self._stale = self._stale or bool(found and found[0])
        return bool(found and found[0])

    def delivered_below(self) -> int:
        # Entries are polled in (xid, seq) order and only below the horizon, where every
        # transaction has ended: each xid below the cursor's has had all its entries.
        return self._xid

    def has_delivered(self, cursor: Cursor) -> bool:
        head = parse_cursor(cursor, self._origin)
        delivered = (self._xid, self._seq) >= (head.xid, head.seq) and self._xid >= head.xmax
        if not delivered:
            self._stale = True  # someone waits on the horizon: the next poll reads
        return delivered

    def save(self) -> None:
        with translated("save cursor"):
            self._conn.execute(sql.SAVE_CONSUMER, (self.consumer, str(self._xid), self._seq))
        self._saved_xid = self._xid
        if self._pruner is None and self._prune_interval_s is not None:
            # A consumer that saves keeps the log short, on a thread of its own: pruning a
            # backlog (the writes made while it was down) takes seconds, and the consumer's
            # loop (the keeper's) must not wait on it.
            self._pruner = Pruner(self._url, self._prune_interval_s, self._consumer_ttl_s)

    def statistics(self) -> PostgresFeedStatistics:
        return PostgresFeedStatistics(
            polls=self._polls,
            events=self._events,
            log_entries=self._entries,
            coalesced=self._coalesced,
            woken=self._woken,
            noticed=self._noticed,
            timeouts=self._timeouts,
            held_back_ms=int(self._held_back_s * 1000),
            held_by_pid=self._held_by_pid,
            consumer=self.consumer,
            xid=self._xid,
            seq=self._seq,
            saved_xid=self._saved_xid,
            horizon=self._horizon,
            held_polls=self._held_polls,
            skipped=self._skipped,
            pruned=0 if self._pruner is None else self._pruner.removed,
            log_retained=None if self._pruner is None else self._pruner.retained,
            prune_failures=0 if self._pruner is None else self._pruner.failures,
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pruner is not None:
            self._pruner.close()
        self._conn.close()

    def __enter__(self) -> PostgresSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def head(conn: Conn) -> tuple[int, int]:
    """The snapshot's (xmin, xmax): a feed starting at (xmin, 0) misses no later commit."""
    found = conn.execute(sql.HEAD).fetchone()
    assert found is not None
    return int(found[0]), int(found[1])


class Pruner:
    """Prunes the log every `interval_s` on a thread and connection of its own, a chunk at
    a time; a failure is logged and counted, and the next round tries again."""

    def __init__(self, url: str, interval_s: float, consumer_ttl_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.consumer_ttl_s = consumer_ttl_s
        self.removed = 0
        self.failures = 0
        self.retained: int | None = None  # the log's entries after the last round
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prune", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn: Conn | None = None
        while not self._stop.wait(self.interval_s):
            try:
                if conn is None or conn.closed:
                    conn = connect(self.url, application_name="renderqueue-prune")
                self.removed += prune(
                    conn, consumer_ttl_s=self.consumer_ttl_s, pause_s=PRUNE_PAUSE_S
                )
                self.retained = count_retained(conn)
            except Exception as exc:
                self.failures += 1
                log.warning("store: pruning the change log failed (%s); retrying", exc)
                if conn is not None:
                    conn.close()
                    conn = None
        if conn is not None:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


def prune(
    conn: Conn,
    *,
    consumer_ttl_s: float = CONSUMER_TTL_S,
    chunk: int = PRUNE_CHUNK,
    pause_s: float = 0.0,
) -> int:
    """Raise the floor to the lowest live consumer's saved cursor (the head when there is
    none), then remove the entries below it, and vacuum the log if any went; returns how
    many went.

    Consumers that saved nothing for `consumer_ttl_s` are dropped first: a node that
    died must not hold the log forever (its next poll, if it comes back, finds the floor
    past it and resyncs). The floor commits before anything below it goes, so a cursor
    below it is refused before what it needs is gone.
    """
    with translated("prune"), conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (PRUNE_LOCK,))
        conn.execute(
            "DELETE FROM feed_consumers WHERE saved_at < now() - make_interval(secs => %s)",
            (consumer_ttl_s,),
        )
        xmin, _ = head(conn)
        lowest = conn.execute(
            "SELECT xid::text::bigint, seq FROM feed_consumers ORDER BY xid, seq LIMIT 1"
        ).fetchone()
        target = (xmin, 0) if lowest is None else min((int(lowest[0]), int(lowest[1])), (xmin, 0))
        conn.execute(
            """UPDATE feed_state SET floor_xid = %s::text::xid8, floor_seq = %s
            WHERE id = 1 AND (floor_xid, floor_seq) < (%s::text::xid8, %s)""",
            (str(target[0]), target[1], str(target[0]), target[1]),
        )
        found = conn.execute(sql.FLOOR).fetchone()
        assert found is not None
        floor = (int(found[0]), int(found[1]))
    removed = 0
    # The last entry removed: each chunk starts past it, not over the dead index entries
    # of the chunks before it (they stay until the VACUUM below). No entry has xid 0.
    after = (0, 0)
    while True:
        with translated("prune"):
            end = conn.execute(
                sql.PRUNE_CHUNK_END, (str(after[0]), after[1], str(floor[0]), floor[1], chunk - 1)
            ).fetchone()
            if end is None:  # fewer than a chunk left below the floor
                removed += conn.execute(
                    sql.PRUNE_BELOW, (str(after[0]), after[1], str(floor[0]), floor[1])
                ).rowcount
                break
            through = (int(end[0]), int(end[1]))
            removed += conn.execute(
                sql.PRUNE_THROUGH, (str(after[0]), after[1], str(through[0]), through[1])
            ).rowcount
        after = through
        if pause_s:
            time.sleep(pause_s)
    if removed:
        vacuum_log(conn)
    return removed


def count_retained(conn: Conn, cap: int = RETAINED_COUNT_CAP) -> int:
    """The log's entries, counted up to `cap`: up to a million index entries, so a long
    statement on a loaded server."""
    with translated("count the change log"), long_statements(conn):
        found = conn.execute(
            "SELECT count(*) FROM (SELECT 1 FROM change_log LIMIT %s) AS held", (cap,)
        ).fetchone()
    assert found is not None
    return int(found[0])


def vacuum_log(conn: Conn) -> None:
    """Make the pruned entries' space reusable. The log takes an entry a write, and a
    removed entry stays a dead row until vacuumed: left to autovacuum (off on some servers,
    behind on a busy one), the log's table and index would grow by every write ever made.
    SKIP_LOCKED: another node's pruner is at it. No TRUNCATE: giving pages back to the
    file system takes a lock that the writers' logging triggers would queue behind."""
    with translated("vacuum the change log"), long_statements(conn):
        conn.execute("VACUUM (SKIP_LOCKED, TRUNCATE false) change_log")
