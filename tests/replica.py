"""An exact in-memory copy of the schedule, kept by the change feed.

This is the consumer side of the store's contract, in its smallest form:
subscribe first, then walk the table by primary key, applying a walked row only
if no event has touched its key since the walk began; then apply events as they
come. Events are state, so replays and duplicates are harmless. A cursor the
log can no longer honour (pruned, or rolled back) means a fresh subscription
and a full walk, counted as a resync. The keeper does the same with its own
structures; the tests use this one to check each backend's feed end to end.
"""

from __future__ import annotations

import msgspec

from store.base import Cursor, CursorAhead, CursorBelowFloor, FeedBatch, ScheduleStore, Subscription
from store.rows import Route, RouteEvent, Row, RowEvent, SettingsEvent

WALK_CHUNK = 2000


class ReplicaSnapshot(msgspec.Struct, kw_only=True):
    """What a consumer persists to restart from its cursor instead of walking."""

    cursor: Cursor
    rows: dict[str, Row]
    routes: dict[str, Route]
    default_cadence_s: int


class ReplicaStatistics(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    events: int
    walked: int  # rows read by walks
    walk_skipped: int  # walked rows dropped because an event had already touched the key
    bootstraps: int
    resyncs: int  # bootstraps forced by a cursor below the floor or ahead of the log
    resumed: int  # starts from a saved cursor (gap replay)


class Replica:
    def __init__(self, store: ScheduleStore, consumer: str, *, walk_chunk: int = WALK_CHUNK):
        self.store = store
        self.consumer = consumer
        self.walk_chunk = walk_chunk
        self.rows: dict[str, Row] = {}
        self.routes: dict[str, Route] = {}
        self.default_cadence_s = 0
        self._subscription: Subscription | None = None
        self._touched: set[str] | None = None  # keys evented during a walk
        self._more = False  # the last poll stopped at its limit
        self._events = self._walked = self._skipped = 0
        self._bootstraps = self._resyncs = self._resumed = 0

    @property
    def subscription(self) -> Subscription:
        if self._subscription is None:
            raise RuntimeError("the replica is not started")
        return self._subscription

    def start(self, snapshot: ReplicaSnapshot | None = None, *, saved: bool = False) -> None:
        """Resume from `snapshot` (at its cursor, or at the consumer's saved cursor when
        `saved`: that one is never ahead of the snapshot), else bootstrap with a walk."""
        if snapshot is None:
            self.bootstrap()
            return
        try:
            cursor = None if saved else snapshot.cursor
            self._subscription = self.store.subscribe(self.consumer, cursor)
        except (CursorAhead, CursorBelowFloor):
            self._resyncs += 1
            self.bootstrap()
            return
        self.rows = dict(snapshot.rows)
        self.routes = dict(snapshot.routes)
        self.default_cadence_s = snapshot.default_cadence_s
        self._resumed += 1

    def bootstrap(self, attempts: int = 3) -> None:
        """Subscribe at the head, then walk every row, serving events all along."""
        for attempt in range(1, attempts + 1):
            try:
                self._bootstrap_once()
                return
            except (CursorAhead, CursorBelowFloor):
                # Only a consumer dropped (and pruned past) mid-walk gets here.
                self._touched = None
                self._resyncs += 1
                if attempt == attempts:
                    raise

    def _bootstrap_once(self) -> None:
        self.close()
        self._bootstraps += 1
        self._subscription = self.store.subscribe(self.consumer, self.store.feed_head())
        self.rows = {}
        self.routes = {route.route: route for route in self.store.routes()}
        self.default_cadence_s = self.store.default_cadence_s()
        self._touched = set()
        after: str | None = None
        while True:
            chunk = self.store.walk(after, self.walk_chunk)
            self.catch_up()
            for row in chunk:
                if row.key in self._touched:
                    self._skipped += 1
                else:
                    self.rows[row.key] = row
            self._walked += len(chunk)
            if len(chunk) < self.walk_chunk:
                break
            after = chunk[-1].key
        self._touched = None

    def apply(self, batch: FeedBatch) -> None:
        touched = self._touched
        for event in batch.events:
            if isinstance(event, RowEvent):
                if event.row is None:
                    self.rows.pop(event.key, None)
                else:
                    self.rows[event.key] = event.row
                if touched is not None:
                    touched.add(event.key)
            elif isinstance(event, RouteEvent):
                self.routes[event.route.route] = event.route
            elif isinstance(event, SettingsEvent):
                self.default_cadence_s = event.default_cadence_s
        self._events += len(batch.events)

    def poll(self, limit: int = 1000) -> int:
        """Apply one batch; returns how many events it held. Resyncs when the log asks."""
        try:
            batch = self.subscription.poll(limit)
        except (CursorAhead, CursorBelowFloor):
            if self._touched is not None:
                raise  # mid-walk: the bootstrap starts over
            self._resyncs += 1
            self.bootstrap()
            return 0
        self.apply(batch)
        self._more = batch.more
        return len(batch.events)

    def catch_up(self, limit: int = 1000) -> int:
        """Apply batches until one holds everything committed when it was read; returns the
        events applied. (Until an empty poll, a consumer of a busy feed never returns.)"""
        total = 0
        while True:
            total += self.poll(limit)
            if not self._more:
                return total

    def snapshot(self) -> ReplicaSnapshot:
        return ReplicaSnapshot(
            cursor=self.subscription.cursor,
            rows=dict(self.rows),
            routes=dict(self.routes),
            default_cadence_s=self.default_cadence_s,
        )

    def statistics(self) -> ReplicaStatistics:
        return ReplicaStatistics(
            rows=len(self.rows),
            events=self._events,
            walked=self._walked,
            walk_skipped=self._skipped,
            bootstraps=self._bootstraps,
            resyncs=self._resyncs,
            resumed=self._resumed,
        )

    def close(self) -> None:
        if self._subscription is not None:
            self._subscription.close()
            self._subscription = None


def table_rows(store: ScheduleStore, chunk: int = 5000) -> dict[str, Row]:
    """Every row of the table, read by walking it."""
    rows: dict[str, Row] = {}
    after: str | None = None
    while True:
        found = store.walk(after, chunk)
        rows.update((row.key, row) for row in found)
        if len(found) < chunk:
            return rows
        after = found[-1].key
