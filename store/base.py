"""The one interface both durable backends implement (SQLite now, PostgreSQL for clusters)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from store.cadence import Adaptation
from store.errors import StoreError
from store.rows import (
    Completion,
    FeedEvent,
    Handover,
    LogRecord,
    MemberList,
    NodeRecord,
    Route,
    Row,
    RowWrite,
    SiteSettings,
    row_event_from,
)

# How long a write waits for the lock other writers hold before it raises StoreBusy, in
# either backend; a caller that waits on its own (api.completions) keeps the same bound.
DEFAULT_BUSY_TIMEOUT_S = 30.0


class Cursor(msgspec.Struct, frozen=True):
    """An opaque feed position. Only the backend that issued it reads `token`."""

    token: str


class FeedBatch(msgspec.Struct, frozen=True, kw_only=True):
    events: list[FeedEvent]
    cursor: Cursor  # the position after the last event; save it to resume there
    # The poll stopped at its limit: more may be committed already. False: the batch held
    # everything committed when the poll read, so a consumer can go straight to wait(),
    # which returns at once for anything committed since.
    more: bool = False


class RowRecords(msgspec.Struct, frozen=True, kw_only=True):
    """A FeedBatch whose events are all row events, as the records they are made from
    (store.rows.LogRecord, one a key, at its key's last entry: `row_event_from` makes
    each one's event). `RecordSubscription.poll_records` answers one where it can, so a
    consumer that reads the records' fields (the keeper, in C) makes no event at all."""

    records: list[LogRecord]
    cursor: Cursor
    more: bool = False

    def batch(self) -> FeedBatch:
        """The FeedBatch `poll` answers for the same entries."""
        return FeedBatch(
            events=[row_event_from(r) for r in self.records], cursor=self.cursor, more=self.more
        )


class RowsRead(msgspec.Struct, frozen=True, kw_only=True):
    """Rows read from the table and the feed's head, in one snapshot.

    Once a subscription has delivered `head`, every write this read saw has been
    delivered too: a difference between the rows and a copy kept from the feed is
    then a write the feed missed, not one it has yet to deliver.
    """

    rows: list[Row]
    head: Cursor


class Writability(msgspec.Struct, frozen=True, kw_only=True):
    """Whether this process's writes reach the disk, as its last write found."""

    writable: bool  # False from a write the disk refused (StoreFull) until one succeeds
    refused: int  # writes the disk refused since the store opened
    reason: str = ""  # the last refusal, while not writable


class SqliteCounters(msgspec.Struct, frozen=True, kw_only=True):
    busy_retries: int  # write transactions tried again because another writer held the lock
    checkpoints: int  # PASSIVE checkpoints run by this process's upkeep thread
    restarts: int  # RESTART checkpoints that started the WAL over
    restarts_busy: int  # RESTART checkpoints that could not get their turn in time
    checkpoint_errors: int  # upkeep rounds that failed (its thread goes on)
    longest_checkpoint_ms: float


class PostgresCounters(msgspec.Struct, frozen=True, kw_only=True):
    reconnects: int  # connections replaced after one was lost
    rollbacks: int  # writes the server rolled back (deadlocks) and the store retried


class StoreCounters(msgspec.Struct, frozen=True, kw_only=True):
    """What one process's store object has met, counted as it went: no query, so cheap
    enough to read every second. One of `sqlite` and `postgres` is set, by backend."""

    writability: Writability
    transactions: int  # write transactions committed
    rows_written: int
    busy_refused: int  # writes given up after the lock wait: StoreBusy, answered 503
    sqlite: SqliteCounters | None = None
    postgres: PostgresCounters | None = None


class WriteHealth:
    """A store's Writability, kept as its writes succeed or are refused for want of
    disk (one tracker for all of a store's threads: a refusal on one is the disk's)."""

    def __init__(self) -> None:
        self._refused = 0
        self._reason = ""

    def refused(self, reason: str) -> None:
        self._refused += 1
        self._reason = reason

    def succeeded(self) -> None:
        if self._reason:
            self._reason = ""

    def statistics(self) -> Writability:
        reason = self._reason
        return Writability(writable=not reason, refused=self._refused, reason=reason)


class CursorBelowFloor(Exception):
    """The log below this cursor was pruned: replaying from it would be short."""


class CursorAhead(Exception):
    """The cursor is past the log's end (the sequence rolled back): resync fully."""


class FeedStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A subscription's counts that mean the same for every backend, since it was opened.

    A backend may keep more (a subclass); `common()` is this part alone, for records that
    must not depend on the backend.
    """

    polls: int
    events: int  # events delivered (a key's entries in one batch are one event)
    log_entries: int  # log entries read
    coalesced: int  # log entries folded into a later event for the same key
    woken: int  # waits ended by a writer's post
    noticed: int  # waits ended by a commit seen without a post (SQLite: data_version)
    timeouts: int  # waits that ended with nothing committed
    # How long the feed has been held back by one transaction still running (PostgreSQL:
    # it holds the snapshot's xmin), and that transaction's backend pid (0: unknown).
    held_back_ms: int = 0
    held_by_pid: int = 0
    # The log's pruning, where the subscription does it (PostgreSQL: a thread of its own):
    # entries the log held after the last round (a backend may stop counting at a cap;
    # None: not counted here), and rounds that failed.
    log_retained: int | None = None
    prune_failures: int = 0

    def common(self) -> FeedStatistics:
        if type(self) is FeedStatistics:
            return self
        fields = FeedStatistics.__struct_fields__
        return FeedStatistics(**{name: getattr(self, name) for name in fields})


class Subscription(Protocol):
    """A consumer's open change feed. Not thread-safe; one reader."""

    @property
    def cursor(self) -> Cursor: ...

    def poll(self, limit: int = 1000) -> FeedBatch:
        """Events after the cursor in commit order, each carrying current state."""
        ...

    def wait(self, timeout_s: float) -> bool:
        """Block until a commit may have happened (a hint) or the timeout passes."""
        ...

    def quiet(self) -> bool:
        """True when a poll now would most likely find nothing, by what the backend already
        knows (no wake-up since the last poll, none due): a caller that polls at every
        turn of its loop may skip that poll. False whenever in doubt; a backend whose polls
        are cheap may always say False. Never a substitute for `wait`."""
        ...

    def has_delivered(self, cursor: Cursor) -> bool:
        """True when every event at or before `cursor` (a head from this store) was polled."""
        ...

    def delivered_below(self) -> int:
        """A feed position: every write whose `ScheduleStore.write_position` is below it
        has been polled (shm.marks). Positions only grow; 0 vouches for nothing."""
        ...

    def save(self) -> None:
        """Persist the cursor for this consumer; pruning may remove what is below it."""
        ...

    def statistics(self) -> FeedStatistics:
        """Counts since this subscription was opened; reads no store."""
        ...

    def close(self) -> None: ...


class RecordSubscription(Subscription, Protocol):
    """A Subscription that can also answer a poll with the entries' records."""

    def poll_records(self, limit: int = 1000) -> FeedBatch | RowRecords:
        """`poll`, but a batch of row events only may come as its records (RowRecords)."""
        ...


class Membership(Protocol):
    """A cluster's member list, kept by a backend that nodes share (PostgreSQL): each node's
    keeper and API read it, and the keeper writes what its node has adopted, on the store's
    own connections. Liveness is judged by the database's clock and the TTL given. A node's
    own row (join, heartbeat, leave) is its supervisor's: store.postgres.membership."""

    def nodes(self, ttl_s: float) -> list[NodeRecord]:
        """Every known node, live or not, by name."""
        ...

    def members(self, ttl_s: float, handovers: bool = False) -> MemberList:
        """The member list with the database's clock (and the live lease hand-overs)."""
        ...

    def acknowledge(
        self, node: str, incarnation: int, view: Sequence[int], handover: Handover
    ) -> bool:
        """Say this incarnation enforces `view` (the live incarnations) and hand over its
        live leases on keys it does not own there, at once. False when the row is no longer
        this incarnation's (superseded: it acknowledges nothing)."""
        ...

    def raise_lease_ceiling(
        self, node: str, ttl_s: float, incarnation: int, horizon_ms: int
    ) -> bool:
        """Publish that no lease of this incarnation ends after `horizon_ms` (the database's
        clock; the ceiling only rises). False when the row did not take it: superseded,
        left, or its heartbeat older than half the TTL (keeper.ceiling)."""
        ...

    def complete_handed_over(
        self, node: str, items: Sequence[Completion], leases: Sequence[tuple[int, int]]
    ) -> list[Row | bool | None]:
        """Complete items whose leases (key hash, token) `node` handed over when it left,
        each in the transaction that settles its hand-over, so it lands once: its row
        (None: gone or missing), or False where no such live, unsettled lease was there."""
        ...


class ScheduleStore(Protocol):
    @property
    def membership(self) -> Membership | None:
        """The cluster's member list where this backend keeps one (PostgreSQL); None where
        a node is alone (SQLite)."""
        ...

    @property
    def remote(self) -> bool:
        """True when every call is a round trip to a server, which a server or network gone
        silent holds until the store's deadline (PostgreSQL); False when a call waits only
        on this machine: its disk, and a writer's wait for the write lock, which
        `complete(wait=False)` does not make (SQLite)."""
        ...

    def write(self, upsert: Sequence[RowWrite] = (), delete: Sequence[str] = ()) -> None:
        """All or nothing, in one transaction; each written row's version increases."""
        ...

    @property
    def write_position(self) -> int:
        """The feed position of this thread's last committed write: a subscription whose
        `delivered_below()` is past it has delivered that write (shm.marks)."""
        ...

    def complete(self, items: Sequence[Completion], *, wait: bool = True) -> list[Row | None]:
        """Apply render results in one transaction; returns each key's row afterwards.

        `wait=False`: when another writer holds the write lock, raise StoreBusy at once
        with nothing written, so a caller on an event loop can wait there instead."""
        ...

    def get(self, key: str) -> Row | None: ...

    def get_many(self, keys: Sequence[str]) -> dict[str, Row]: ...

    def get_many_at(self, keys: Sequence[str]) -> RowsRead:
        """`get_many`, with the feed's head read in the same snapshot."""
        ...

    def walk(self, after: str | None, limit: int) -> list[Row]:
        """Rows with key > after, by primary key, at most `limit`."""
        ...

    def walk_at(self, after: str | None, limit: int) -> RowsRead:
        """`walk`, with the feed's head read in the same snapshot."""
        ...

    def retired(self, after: str | None = None, limit: int = 100) -> list[Row]:
        """Retired rows (Row.retired_at set) with key > after, by key, at most `limit`
        (1..store.validate.MAX_PAGE)."""
        ...

    def count(self) -> int: ...

    def routes(self) -> list[Route]: ...

    def set_route(
        self,
        route: str,
        *,
        default_cadence_s: int | None = None,
        paused: bool | None = None,
        clear_default_cadence: bool = False,
        adapt: Adaptation | None = None,
        clear_adapt: bool = False,
        site_pattern: str | None = None,
        clear_site_pattern: bool = False,
        retire_after: int | None = None,
    ) -> Route:
        """Create or change a route; None leaves a field as it is. `clear_default_cadence`
        sends the route back to the global default. `adapt` turns adaptive cadence on (or
        changes its settings), `clear_adapt` off; turning it off, or moving its ladder's
        ends, forgets what the route's rows learned (in the same transaction: the feed
        delivers each such row), since a learned cadence is a rung of the old ladder.
        `clear_site_pattern` sends the route's keys back to their own hosts' sites."""
        ...

    def default_cadence_s(self) -> int: ...

    def set_default_cadence_s(self, seconds: int) -> None: ...

    def sites(self) -> list[SiteSettings]:
        """Every site with settings of its own, by name."""
        ...

    def get_site(self, site: str) -> SiteSettings | None: ...

    def set_site(self, settings: SiteSettings) -> SiteSettings | None:
        """Store a site's settings (both None: remove its row); the feed delivers a
        SiteEvent. Returns what is stored now. ValueError for a bad name or value."""
        ...

    def hash_secret(self) -> bytes:
        """The database's key-hash secret (store/secret.py): made with the schema, the same
        for every node and never changed. StoreError if it is missing or malformed."""
        ...

    def feed_head(self) -> Cursor:
        """The position just after the last committed event."""
        ...

    def subscribe(self, consumer: str, cursor: Cursor | None = None) -> Subscription:
        """Open the feed at `cursor` (or the consumer's saved cursor, or the head).

        Raises CursorBelowFloor or CursorAhead rather than replaying short.
        """
        ...

    def writability(self) -> Writability:
        """Whether writes reach the disk, as this process's last write found (a full
        disk makes them raise StoreFull until space returns)."""
        ...

    def counters(self) -> StoreCounters:
        """This process's counts of its writes; no query (see StoreCounters)."""
        ...

    def close(self) -> None: ...


def cluster_membership(store: ScheduleStore) -> Membership:
    """The member list of a clustered node's store; StoreError where its backend keeps none
    (a node alone, on SQLite)."""
    membership = store.membership
    if membership is None:
        raise StoreError(
            f"a cluster needs a store that keeps its member list (PostgreSQL); "
            f"{type(store).__name__} keeps none"
        )
    return membership
