"""The SQLite change feed: a consumer's cursor over the trigger-filled `change_log`.

A poll reads the log after the cursor and, in the same snapshot, the current
state of every key it names, so each event is state, not a delta. Several log
entries for one key in a batch become one event (the latest state), placed at
the key's last entry. The cursor is `seq` plus the entry's random `stamp`:
a cursor whose entry now carries another stamp, or whose seq is past the log's
head, belongs to a log that was rolled back (a power loss under
synchronous=NORMAL) and is refused as CursorAhead, which calls for a resync.

Where the writers hand their records over in shared memory (store.sqlite.feed_ring), a
poll takes them from the subscription's ring while they continue the cursor, and
reads SQLite only when the ring has nothing after it or says an entry is missing.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from store.base import (
    Cursor,
    CursorAhead,
    CursorBelowFloor,
    FeedBatch,
    FeedStatistics,
    RowRecords,
)
from store.rows import (
    FeedEvent,
    LogRecord,
    Route,
    RouteEvent,
    RowEvent,
    SettingsEvent,
    SiteEvent,
    SiteSettings,
    last_of_each_key,
    route_from,
    row_from,
    site_settings_from,
)
from store.schema import DEFAULT_CADENCE_S, KIND_ROUTE, KIND_ROW, KIND_SETTINGS, KIND_SITE
from store.sqlite import sql
from store.sqlite.conn import Retry, configure, connect
from store.sqlite.feed_ring import (
    FeedRing,
    FeedRingStatistics,
    decode_record,
    remove_ring,
)
from store.sqlite.upkeep import WRITER_CHECKPOINT_PAGES
from store.sqlite.wake import REFRESH_S, WakeWaiter, unlink

_TOKEN_PREFIX = "sqlite"
_U64 = (1 << 64) - 1  # a stamp as a ring's slot word holds it
# data_version is checked this often while no post arrives. Only a writer outside
# renderqueue (the sqlite3 shell) goes unposted once writers know a consumer, while every
# timed wake-up costs CPU, most on a virtual machine: an idle keeper waits in these slices.
FALLBACK_POLL_S = 0.025
# A writer learns of a new subscription's semaphore and ring when it next re-reads the
# consumers (store.sqlite.wake.REFRESH_S); until every writer can have, nobody posts it, and it
# reads data_version this often instead, so a new consumer's lag stays this short.
NEW_FALLBACK_POLL_S = 0.0005
NEW_FOR_S = 1.5 * REFRESH_S
# After a poll that delivered, a consumer with a ring first sleeps this long for more
# to gather: a writer posting a consumer blocked on its semaphore pays a futex wake (as
# long as a whole small commit) per commit, and the consumer a wake-up per event.
GATHER_S = 0.0002

Verdict = Literal["ok", "below", "ahead"]


def fallback_poll_s(age_s: float) -> float:
    """How long a wait sleeps between data_version reads, `age_s` after subscribing."""
    return NEW_FALLBACK_POLL_S if age_s < NEW_FOR_S else FALLBACK_POLL_S


def cursor_token(seq: int, stamp: int) -> Cursor:
    return Cursor(token=f"{_TOKEN_PREFIX}:{seq}:{stamp}")


def parse_cursor(cursor: Cursor) -> tuple[int, int]:
    parts = cursor.token.split(":") if isinstance(cursor, Cursor) else []
    if len(parts) != 3 or parts[0] != _TOKEN_PREFIX:
        raise ValueError(f"cursor {cursor!r} was not issued by a SQLite store")
    try:
        seq, stamp = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(f"cursor {cursor!r} is malformed") from None
    if seq < 0:
        raise ValueError(f"cursor {cursor!r} is malformed")
    return seq, stamp


def release(wake_name: str, waiter: WakeWaiter | None, ring: FeedRing | None) -> None:
    """Close and remove one subscription's semaphore and ring: its consumer is done."""
    if waiter is not None:
        waiter.close()
    unlink(wake_name)
    if ring is not None:
        ring.close()
        ring.unlink()


def forget(wake_name: str) -> None:
    """Remove the semaphore and ring of a subscription whose process is gone or whose
    consumer was dropped (nothing of them is open here)."""
    unlink(wake_name)
    remove_ring(wake_name)


def head(conn: sqlite3.Connection) -> tuple[int, int]:
    """The last log entry's seq and stamp; (0, 0) for an empty log."""
    found = conn.execute(sql.LAST_ENTRY).fetchone()
    return (0, 0) if found is None else (int(found[0]), int(found[1]))


def judge(conn: sqlite3.Connection, seq: int, stamp: int) -> tuple[Verdict, str]:
    """Whether the log can replay exactly from (seq, stamp); run inside a transaction."""
    last, _ = head(conn)
    floor = int(conn.execute(sql.FLOOR).fetchone()[0])
    if seq > last:
        return "ahead", f"cursor seq {seq} is past the change log's head {last}"
    if seq < floor:
        return "below", f"cursor seq {seq} is below the change log's pruned floor {floor}"
    if seq > 0:
        found = conn.execute(sql.STAMP_AT, (seq,)).fetchone()
        if found is None:
            return "below", f"the change log no longer holds cursor seq {seq} (floor {floor})"
        if int(found[0]) != stamp:
            return "ahead", f"the change log's entry {seq} is not the one the cursor passed"
    return "ok", ""


class SubscriptionStatistics(FeedStatistics, frozen=True, kw_only=True):
    """FeedStatistics (noticed: waits ended by PRAGMA data_version), and SQLite's own."""

    consumer: str
    seq: int  # the cursor's position: the last log entry delivered
    saved_seq: int  # the position last saved for pruning and restarts
    wake: str  # the semaphore's name; "" when this consumer polls data_version only
    busy_retries: int
    ring_entries: int  # log entries taken from the feed ring, not read from SQLite
    gathered: int  # waits answered by the ring after a GATHER_S sleep, not by a post
    ring: FeedRingStatistics | None  # None: no ring, every poll reads SQLite


class SqliteSubscription:
    """One consumer's open feed, on its own connection. Not thread-safe: one reader."""

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        consumer: str,
        seq: int,
        stamp: int,
        wake_name: str,
        waiter: WakeWaiter | None,
        ring: FeedRing | None,
        busy_timeout_s: float,
    ) -> None:
        self.consumer = consumer
        self._opened_at = time.monotonic()
        self._seq = seq
        self._stamp = stamp
        self._saved_seq = seq
        self._wake_name = wake_name
        self._retry = Retry(busy_timeout_s)
        self._conn = connect(path)
        try:
            self._retry.call("subscribe", lambda: configure(self._conn))
            # Its only writes are cursor saves: leave checkpoints to the writers' upkeep.
            self._conn.execute(f"PRAGMA wal_autocheckpoint = {WRITER_CHECKPOINT_PAGES}")
        except BaseException:
            self._conn.close()
            release(wake_name, waiter, ring)
            raise
        self._waiter = waiter  # None: no semaphores here, data_version polling alone
        self._ring = ring
        # The ring's `missed` count this consumer has caught up with in SQLite.
        self._ring_missed = 0 if ring is None else ring.missed()
        self._ring_entries = 0
        self._gathered = 0
        self._seen_version: int | None = self._data_version()
        self._more = False
        self._delivered = False  # the last poll had events: the stream is busy
        self._polls = self._events = self._entries = self._coalesced = 0
        self._woken = self._noticed = self._timeouts = 0
        self._closed = False

    @property
    def cursor(self) -> Cursor:
        return cursor_token(self._seq, self._stamp)

    def _data_version(self) -> int:
        return int(
            self._retry.call("wait", lambda: self._conn.execute("PRAGMA data_version")).fetchone()[
                0
            ]
        )

    def poll(self, limit: int = 1000) -> FeedBatch:
        got = self.poll_records(limit)
        return got.batch() if isinstance(got, RowRecords) else got

    def poll_records(self, limit: int = 1000) -> FeedBatch | RowRecords:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        if self._closed:
            raise ValueError(f"subscription {self.consumer!r} is closed")
        # Before the snapshot: a commit after this point makes the next wait() return.
        # With a semaphore the post does, and data_version is read only when wait() has
        # no post to take (the read is a statement, a large part of a small poll). A commit by a
        # writer that does not post, made between this snapshot and that read, is then
        # seen at the next commit or when the wait times out: only a hint is late.
        if self._waiter is not None:
            self._waiter.clear()
            self._seen_version = None
        else:
            self._seen_version = self._data_version()
        ring, missed = self._ring, self._ring_missed
        if ring is not None:
            missed = ring.missed()  # after the clear: a post taken there was counted first
        records: list[Any] = []
        if ring is not None and missed == self._ring_missed:
            records = self._from_ring(ring, limit)
            self._ring_entries += len(records)
        if records:
            self._polls += 1
            return self._deliver_records(records, limit)
        after = self._seq
        # One statement is one snapshot: the log entries and the rows they name agree.
        records = self._retry.call(
            "poll", lambda: self._conn.execute(sql.POLL, (after, limit)).fetchall()
        )
        routes: dict[str, Route] = {}
        sites: dict[str, SiteSettings] = {}
        default_cadence_s = DEFAULT_CADENCE_S
        # Committed seqs are contiguous, so only a gap after the cursor can mean pruning;
        # route, settings and site entries need more reads from the same snapshot.
        if records and (records[0][0] != after + 1 or any(r[1] != KIND_ROW for r in records)):
            found = self._retry.transaction(
                self._conn, "poll", lambda conn: self._read(conn, after, limit), write=False
            )
            if isinstance(found, str):
                raise CursorBelowFloor(f"consumer {self.consumer!r}: {found}; resync (walk)")
            records, routes, default_cadence_s, sites = found
        self._polls += 1
        if len(records) < limit:
            self._ring_missed = missed  # caught up with the log's head as it was then
        return self._deliver(records, routes, default_cadence_s, limit, sites)

    def _from_ring(self, ring: FeedRing, limit: int) -> list[LogRecord]:
        """The ring's entries that continue the cursor, up to `limit`: each entry's seq is
        the one after the last's and its previous stamp the last one's stamp. The slots
        are read in one call (FeedRing.get_run), the chain checked here."""
        out: list[LogRecord] = []
        seq, stamp = self._seq, self._stamp
        prevs, payloads = ring.get_run(seq + 1, limit)
        for prev, payload in zip(prevs, payloads, strict=True):
            if prev != stamp & _U64:
                break
            record = decode_record(payload)
            if record is None or record[0] != seq + 1 or record[1] != KIND_ROW:
                break
            out.append(record)
            seq, stamp = record[0], record[3]
        return out

    def _deliver(
        self,
        records: Sequence[Sequence[Any]],
        routes: dict[str, Route],
        default_cadence_s: int,
        limit: int,
        sites: dict[str, SiteSettings] | None = None,
    ) -> FeedBatch:
        # A full batch may have left entries behind (coalescing can make the events fewer
        # than the limit all the same): the next wait() must not sleep on them.
        self._more = len(records) >= limit
        self._delivered = bool(records)
        if not records:
            return FeedBatch(events=[], cursor=self.cursor)
        events: dict[tuple[int, str], FeedEvent] = {}
        for record in records:
            kind, key = record[1], record[2]
            slot = (kind, key)
            if slot in events:
                del events[slot]  # re-inserted below: the event sits at its key's last entry
                self._coalesced += 1
            if kind == KIND_ROW:
                row = None if record[4] is None else row_from((key, *record[4:]))
                events[slot] = RowEvent(key=key, row=row)
            elif kind == KIND_ROUTE:
                events[slot] = RouteEvent(route=routes.get(key) or Route(route=key))
            elif kind == KIND_SETTINGS:
                events[slot] = SettingsEvent(default_cadence_s=default_cadence_s)
            elif kind == KIND_SITE:
                found = None if sites is None else sites.get(key)
                events[slot] = SiteEvent(settings=found or SiteSettings(site=key))
        last = records[-1]
        self._seq, self._stamp = int(last[0]), int(last[3])
        self._entries += len(records)
        self._events += len(events)
        return FeedBatch(events=list(events.values()), cursor=self.cursor, more=self._more)

    def _deliver_records(self, records: list[LogRecord], limit: int) -> RowRecords:
        """`_deliver` for records that are all row entries (the ring's), coalesced as it
        coalesces them, left as records: the caller makes events of them only if it needs
        them (RowRecords)."""
        self._more = len(records) >= limit
        self._delivered = True
        kept, folded = last_of_each_key(records)
        last = records[-1]
        self._seq, self._stamp = last[0], last[3]
        self._coalesced += folded
        self._entries += len(records)
        self._events += len(kept)
        return RowRecords(records=kept, cursor=self.cursor, more=self._more)

    def _read(
        self, conn: sqlite3.Connection, after: int, limit: int
    ) -> str | tuple[list[Any], dict[str, Route], int, dict[str, SiteSettings]]:
        floor = int(conn.execute(sql.FLOOR).fetchone()[0])
        if after < floor:
            return f"cursor seq {after} is below the change log's pruned floor {floor}"
        records = conn.execute(sql.POLL, (after, limit)).fetchall()
        route_names = [r[2] for r in records if r[1] == KIND_ROUTE]
        routes: dict[str, Route] = {}
        if route_names:
            names = msgspec.json.encode(sorted(set(route_names))).decode()
            for values in conn.execute(sql.ROUTES_NAMED, (names,)):
                route = route_from(values)
                routes[route.route] = route
        default_cadence_s = DEFAULT_CADENCE_S
        if any(r[1] == KIND_SETTINGS for r in records):
            default_cadence_s = int(conn.execute(sql.GET_DEFAULT_CADENCE).fetchone()[0])
        site_names = [r[2] for r in records if r[1] == KIND_SITE]
        sites: dict[str, SiteSettings] = {}
        if site_names:
            names = msgspec.json.encode(sorted(set(site_names))).decode()
            for values in conn.execute(sql.SITES_NAMED, (names,)):
                settings = site_settings_from(values)
                sites[settings.site] = settings
        return records, routes, default_cadence_s, sites

    def wait(self, timeout_s: float) -> bool:
        if self._more:
            return True
        ring = self._ring
        if ring is not None:
            if self._ring_says_more(ring):
                return True  # without a system call: a busy consumer's usual case
            if self._delivered and timeout_s > 0:
                self._delivered = False
                time.sleep(min(GATHER_S, timeout_s))
                if self._ring_says_more(ring):
                    self._gathered += 1
                    return True
        # A post pending since the poll began answers without a statement: a busy
        # consumer's usual case, and data_version costs a read transaction.
        if self._waiter is not None and self._waiter.take():
            self._woken += 1
            return True
        deadline = time.monotonic() + max(0.0, timeout_s)
        while True:
            version = self._data_version()
            if self._seen_version is None:
                self._seen_version = version  # the first look since the poll
            elif version != self._seen_version:
                self._seen_version = version
                self._noticed += 1
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._timeouts += 1
                return False
            slice_s = min(remaining, fallback_poll_s(time.monotonic() - self._opened_at))
            if self._waiter is None:
                time.sleep(slice_s)
            elif self._waiter.wait(slice_s):
                self._woken += 1
                return True

    def _ring_says_more(self, ring: FeedRing) -> bool:
        return ring.ready(self._seq + 1, self._stamp) or ring.missed() != self._ring_missed

    def quiet(self) -> bool:
        return False  # a poll reads the ring or one statement on a local file: cheap

    def delivered_below(self) -> int:
        # Seqs are contiguous in commit order: every entry up to the cursor's is delivered.
        return self._seq + 1

    def has_delivered(self, cursor: Cursor) -> bool:
        # Seq order is commit order (one writer at a time): every entry up to the
        # cursor's seq was committed when that head was read, and polls read in seq order.
        seq, _ = parse_cursor(cursor)
        return self._seq >= seq

    def save(self) -> None:
        seq, stamp = self._seq, self._stamp
        saved_at = time.time_ns() // 1_000_000
        params = (self.consumer, seq, stamp, self._wake_name, saved_at)
        self._retry.transaction(
            self._conn,
            "save cursor",
            lambda conn: conn.execute(sql.SAVE_CONSUMER, params),
            write=True,
        )
        self._saved_seq = seq

    def statistics(self) -> SubscriptionStatistics:
        return SubscriptionStatistics(
            consumer=self.consumer,
            seq=self._seq,
            saved_seq=self._saved_seq,
            polls=self._polls,
            events=self._events,
            log_entries=self._entries,
            coalesced=self._coalesced,
            woken=self._woken,
            noticed=self._noticed,
            timeouts=self._timeouts,
            wake=self._wake_name if self._waiter is not None else "",
            busy_retries=self._retry.retries,
            ring_entries=self._ring_entries,
            gathered=self._gathered,
            ring=None if self._ring is None else self._ring.statistics(),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        release(self._wake_name, self._waiter, self._ring)
        self._conn.close()

    def __enter__(self) -> SqliteSubscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raise_for(verdict: Verdict, reason: str, consumer: str) -> None:
    if verdict == "below":
        raise CursorBelowFloor(
            f"consumer {consumer!r}: {reason}; replay would be short. Resync: subscribe at "
            "feed_head() and walk the table."
        )
    if verdict == "ahead":
        raise CursorAhead(
            f"consumer {consumer!r}: {reason} (the log was rolled back, e.g. by a power loss); "
            "resync: subscribe at feed_head() and walk the table."
        )
