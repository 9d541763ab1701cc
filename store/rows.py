"""The durable schedule's records: what crosses the store's boundary.

Times are integer epoch milliseconds everywhere; cadences are whole seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from store.cadence import Adaptation, Learned, learn

MAX_KEY_BYTES = 2048
Outcome = Literal["rendered", "failed", "gone", "not_found"]
# A route's rows retire after this many `not_found` outcomes in a row, unless the route
# says otherwise (Route.retire_after).
DEFAULT_RETIRE_AFTER = 3
MAX_RETIRE_AFTER = 1000
RetiredReason = Literal["not_found"]


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One row of `render_schedule`, as stored."""

    key: str
    route: str
    cadence_s: int | None  # None: the route's default, then the global default
    sitemap: bool
    next_render_at: int
    last_rendered_at: int | None = None
    last_outcome: str | None = None
    version: int = 0
    # Where its route adapts (store.cadence): the rung its renders have led it to, which it
    # renders at in place of its fixed cadence; None: nothing learned.
    learned_cadence_s: int | None = None
    # Its renders' last observations, changed or not (store.cadence.history_of reads it).
    change_history: int = 0

    @property
    def scheduled_cadence_s(self) -> int | None:
        """The cadence the row's own fields give, learned first (None: its route's)."""
        return self.cadence_s if self.learned_cadence_s is None else self.learned_cadence_s

    # `not_found` outcomes in a row (any other outcome, or an upsert, resets it).
    not_found_streak: int = 0
    # A retired row is kept but never due: the keeper holds none, so none is granted,
    # until an upsert of its key (or render-now) revives it. When and why it retired.
    retired_at: int | None = None
    retired_reason: RetiredReason | None = None

    def due_by(self, now: int) -> bool:
        """Whether the row may be granted at `now`: live and its render time come."""
        return self.retired_at is None and self.next_render_at <= now


# The columns of render_schedule in Row's order, for both backends' statements.
ROW_COLUMNS = (
    "key, route, cadence_s, sitemap, next_render_at, last_rendered_at, last_outcome, version, "
    "learned_cadence_s, change_history, not_found_streak, retired_at, retired_reason"
)
ROW_FIELDS = len(ROW_COLUMNS.split(", "))


def row_from(values: tuple[Any, ...] | Any) -> Row:
    """A Row from ROW_COLUMNS' values, as either backend returns them."""
    (
        key,
        route,
        cadence_s,
        sitemap,
        next_render_at,
        last_rendered_at,
        last_outcome,
        version,
        learned_cadence_s,
        change_history,
        not_found_streak,
        retired_at,
        retired_reason,
    ) = values
    return Row(
        key=key,
        route=route,
        cadence_s=cadence_s,
        sitemap=bool(sitemap),
        next_render_at=next_render_at,
        last_rendered_at=last_rendered_at,
        last_outcome=last_outcome,
        version=version,
        learned_cadence_s=learned_cadence_s,
        change_history=change_history or 0,
        not_found_streak=not_found_streak,
        retired_at=retired_at,
        retired_reason=retired_reason,
    )


# The columns of `routes` in route_from's order, for both backends' statements.
ROUTE_COLUMNS = (
    "route, default_cadence_s, paused, adapt_min_s, adapt_max_s, adapt_inc, adapt_dec, "
    "site_pattern, retire_after"
)


def route_from(values: tuple[Any, ...] | Any) -> Route:
    """A Route from ROUTE_COLUMNS' values."""
    name, default_cadence_s, paused, min_s, max_s, inc, dec, site_pattern, retire_after = values
    adapt = None if min_s is None else Adaptation(min_s=min_s, max_s=max_s, inc=inc, dec=dec)
    return Route(
        route=name,
        default_cadence_s=default_cadence_s,
        paused=bool(paused),
        adapt=adapt,
        site_pattern=site_pattern,
        retire_after=retire_after,
    )


# What a completion that observed a change reads of its row and route, in the order
# learned_from takes: the row's key, its fixed cadence's parts, what it learned so far,
# and its route's adaptation.
LEARNING_COLUMNS = (
    "r.key, r.cadence_s, rt.default_cadence_s, r.learned_cadence_s, r.change_history, "
    "rt.adapt_min_s, rt.adapt_max_s, rt.adapt_inc, rt.adapt_dec"
)


def learned_from(values: tuple[Any, ...] | Any, global_cadence_s: int, changed: bool) -> Learned:
    """One observation applied to a row read as LEARNING_COLUMNS (store.cadence.learn)."""
    _, own_s, route_s, learned_s, history, min_s, max_s, inc, dec = values
    adapt = None if min_s is None else Adaptation(min_s=min_s, max_s=max_s, inc=inc, dec=dec)
    fixed_s = own_s if own_s is not None else route_s if route_s is not None else global_cadence_s
    return learn(adapt, learned_s, fixed_s, history or 0, changed)


def site_settings_from(values: tuple[Any, ...] | Any) -> SiteSettings:
    """SiteSettings from (site, max_in_flight, min_interval_ms)."""
    site, max_in_flight, min_interval_ms = values
    return SiteSettings(site=site, max_in_flight=max_in_flight, min_interval_ms=min_interval_ms)


class RowWrite(msgspec.Struct, frozen=True, kw_only=True):
    """An upsert of one row; the store assigns `version` and keeps render history."""

    key: str
    route: str
    next_render_at: int
    cadence_s: int | None = None
    sitemap: bool = False


class Route(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    default_cadence_s: int | None = None
    paused: bool = False
    adapt: Adaptation | None = None  # None: its rows' cadences are fixed
    # The site of the route's keys (shm.keys.site_of): `*.NAME` for NAME and every host
    # under it, or one NAME for all; None, each key's own host.
    site_pattern: str | None = None
    # Its rows retire after this many `not_found` outcomes in a row.
    retire_after: int = DEFAULT_RETIRE_AFTER


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A render's result for one key, applied by `ScheduleStore.complete`.

    `rendered` sets next_render_at to `next_render_at` if given, else now + the
    row's effective cadence; `failed` keeps the row due; `gone` deletes it. A `rendered`
    one may say whether the page `changed` since its last render: the row records it, and
    where its route adapts, learns its cadence from it first (store.cadence). `not_found`
    (the origin answered 404 or 410) reschedules it as `rendered` does, without a
    render's time, and extends its streak of them: the route's `retire_after`'th in a row
    retires the row. Any other outcome ends the streak and revives a retired row.
    """

    key: str
    outcome: Outcome
    now: int
    next_render_at: int | None = None
    changed: bool | None = None  # None: not known, nothing recorded


def completion_rounds(items: Sequence[Completion]) -> list[list[int]]:
    """Indices of `items` split so no round names a key twice: round n holds each key's
    n-th completion, so applying the rounds in order applies a key's completions in order
    (a backend applies a round in one statement, where a key can change only once)."""
    if len({item.key for item in items}) == len(items):
        return [list(range(len(items)))]  # the usual batch: every key once
    seen: dict[str, int] = {}
    rounds: list[list[int]] = [[]]
    for index, item in enumerate(items):
        n = seen.get(item.key, 0)
        seen[item.key] = n + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(index)
    return rounds


class RowEvent(msgspec.Struct, frozen=True, kw_only=True, tag="row"):
    """The key's current row, or None when the row is gone (events are state, not deltas)."""

    key: str
    row: Row | None


class RouteEvent(msgspec.Struct, frozen=True, kw_only=True, tag="route"):
    route: Route


class SettingsEvent(msgspec.Struct, frozen=True, kw_only=True, tag="settings"):
    default_cadence_s: int


class SiteSettings(msgspec.Struct, frozen=True, kw_only=True):
    """One site's own politeness settings (its name as `shm.keys.site_of` gives it); None:
    the node's default. A site with neither set has no row."""

    site: str
    max_in_flight: int | None = None
    min_interval_ms: int | None = None

    @property
    def empty(self) -> bool:
        return self.max_in_flight is None and self.min_interval_ms is None


class SiteEvent(msgspec.Struct, frozen=True, kw_only=True, tag="site"):
    """A site's settings as they are now (both None: cleared, back to the defaults)."""

    settings: SiteSettings


FeedEvent = RowEvent | RouteEvent | SettingsEvent | SiteEvent

# A change-log entry as the SQLite feed reads it (store.sqlite.feed_ring hands them over
# as these): seq, kind, key, stamp, then the row's ROW_COLUMNS after its key (all None for
# a key whose row is gone). keeper/csrc/moves.c (apply_records) reads a row entry's
# fields by these places.
LogRecord = tuple[
    int, int, str, int, str | None, int | None, int | None, int | None, int | None,
    str | None, int | None, int | None, int | None, int | None, int | None, str | None,
]  # fmt: skip


def last_of_each_key(records: Sequence[LogRecord]) -> tuple[list[LogRecord], int]:
    """A batch's records coalesced as a feed coalesces its events: one a key, at its key's
    last entry, in that order; and how many were folded away."""
    by_key: dict[str, LogRecord] = {}
    for record in records:
        key = record[2]
        by_key.pop(key, None)  # re-inserted below: the record sits at its key's last entry
        by_key[key] = record
    return list(by_key.values()), len(records) - len(by_key)


def row_event_from(record: LogRecord) -> RowEvent:
    """A row entry's event: its key's row as the entry carries it, or None (gone). As
    `row_from` makes the Row, its fields passed inline (this is a feed event's path)."""
    (_, _, key, _, route, cadence_s, sitemap, next_render_at, last_rendered_at, last_outcome,
     version, learned, history, not_found, retired_at, retired_reason) = record  # fmt: skip
    if route is None:
        return RowEvent(key=key, row=None)
    row = Row(
        key=key,
        route=route,
        cadence_s=cadence_s,
        sitemap=bool(sitemap),
        next_render_at=next_render_at,  # type: ignore[arg-type]
        last_rendered_at=last_rendered_at,
        last_outcome=last_outcome,
        version=version,  # type: ignore[arg-type]
        learned_cadence_s=learned,
        change_history=history or 0,
        not_found_streak=not_found,  # type: ignore[arg-type]
        retired_at=retired_at,
        retired_reason=retired_reason,  # type: ignore[arg-type]
    )
    return RowEvent(key=key, row=row)


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    url: str
    instance: str
    started_at_ms: int  # the database's clock
    heartbeat_age_ms: int  # by the database's clock, as of the read
    left: bool  # stopped cleanly
    live: bool  # not left, and heartbeat younger than the TTL
    # The database's clock; 0: none. A node that left: when its last lease ends. A node
    # that has not: its lease ceiling, which no lease of its ends after (keeper.ceiling).
    lease_horizon_ms: int
    max_lease_ms: int  # the longest lease it grants
    incarnation: int = 0  # this start of the node (a number never reused)
    # The incarnations of the live nodes whose view it has adopted and enforces: it grants
    # and renews no key it does not own in that view, and its live leases on those keys
    # are in the lease hand-over.
    acked_view: tuple[int, ...] = ()
    host: str = ""
    pid: int = 0


class HandedBlock(msgspec.Struct, frozen=True):
    """A site's block, handed over with the site (the database's clock)."""

    site_hash: int  # unsigned 64-bit
    until_ms: int
    reason: str  # shm.sites.BlockReason


class Handover(msgspec.Struct, frozen=True, kw_only=True):
    """A node's live leases on keys it no longer owns (or all of them, once it left)."""

    node: str
    incarnation: int
    key_hashes: list[int]  # as the lease table keeps them (unsigned 64-bit)
    expires_at_ms: list[int]  # the database's clock
    # Each lease's site hash (unsigned 64-bit, 0: none): a cluster that owns keys by site
    # counts the leases of a site it gains against the site's cap until they end.
    site_hashes: list[int] = []
    # Each lease's token (shm.leases: slot << 16 | counter; 0: not known), so a completion
    # of the lease can land once its node has left (store.postgres.membership).
    tokens: list[int] = []
    # Owned by site: the blocks of the sites it no longer owns, which go with them.
    blocks: list[HandedBlock] = []


class MemberList(msgspec.Struct, frozen=True, kw_only=True):
    """One read of the member list, with the database's clock at the read."""

    records: list[NodeRecord]
    db_now_ms: int
    handovers: list[Handover] = []
    # Whether the hand-overs were read: a read without them cannot end a fence.
    with_handovers: bool = False
