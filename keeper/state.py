"""The queue-state record: what the keeper writes into the state buffer, and how to read it.

Versioned (`schema`), msgpack-encoded, one msgspec Struct per group of
queue-state: now, coming, lateness, flow, trust, plus two autoscaling scalars
at fixed paths (`autoscale.due_now`, `autoscale.oldest_claimable_age_s`), `sites` (due
rows by site: how many sites, the first few), and in a cluster `fenced`: the due rows
this node owns but may not grant yet. The full sites listing is a record of its own
(`SiteList`), in a buffer of its own.

Liveness is decided by the reader, not only by the keeper, because a stalled
keeper cannot say it has stalled: the keeper rewrites the record at every
publish (once a second) with `trust.heartbeat_at`, and `liveness()` reports
the keeper not live, with the reason, once the heartbeat is older than
`trust.stall_after_ms` (2 s by default). `vouches()` is the one rule workers
use to serve counts (200) or only trust and the live `now` fields (503).

The keeper's own statistics (`KeeperStatistics`) are a second record, written beside
queue-state into a buffer of their own; here too, so a worker reads both without
importing the keeper's machinery.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from keeper.flow import FlowMinute
from keeper.protocols import LeaseStatisticsLike
from keeper.walk import RepairCounts
from store.base import FeedStatistics

SCHEMA = 1
Status = Literal["unready", "ready", "stalled"]
# rebalancing: live, walking the table for the rows a membership change brought here.
Phase = Literal["starting", "loading", "live", "resyncing", "rebalancing"]


class LeaseCounts(msgspec.Struct, frozen=True, kw_only=True):
    in_flight: int = 0  # live leases
    held_keys: int = 0  # distinct keys held back now
    hold_events: int = 0  # expiries with no result that started a hold
    refusals_taken: int = 0
    refusals_held: int = 0
    refusals_probe_full: int = 0  # the bounded probe window, which can refuse below 100%


def lease_counts(stats: LeaseStatisticsLike) -> LeaseCounts:
    """The lease table's statistics as queue-state reports them (keeper and workers alike)."""
    return LeaseCounts(
        in_flight=stats.live_leases,
        held_keys=stats.held_keys,
        hold_events=stats.hold_events,
        refusals_taken=stats.refusals_taken,
        refusals_held=stats.refusals_held,
        refusals_probe_full=stats.refusals_probe_full,
    )


class NowGroup(msgspec.Struct, frozen=True, kw_only=True):
    status: Status
    status_reason: str = ""
    due: int = 0  # due rows of routes not paused, fenced ones included
    # Of those, the rows no fence holds back (a leased or held one still counts): `due`
    # less `fenced.due`; all of them on a single node.
    claimable: int = 0
    due_sitemap: int = 0
    due_discovered: int = 0
    in_flight: int = 0
    unclaimed_estimate: int = 0  # due minus in flight, floored at 0
    paused: int = 0  # due rows waiting on a paused route
    paused_routes: list[str] = []
    held: int = 0  # rows this keeper holds
    leases: LeaseCounts = LeaseCounts()


class ComingGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Not yet due, by due minute: windows end at minute boundaries."""

    due_15m: int = 0
    due_60m: int = 0
    due_24h: int = 0
    next_24h_by_hour: list[int] = []


class ClassRow(msgspec.Struct, frozen=True, kw_only=True):
    id: int
    route: str
    cadence_s: int
    cadence_from_row: bool  # part of the class's identity: without it two rows could look alike
    sitemap: bool
    paused: bool
    held: int
    due: int
    oldest_due_at: int | None  # the oldest due row of the class
    oldest_lateness: float | None  # its lateness, in cadences
    lateness: list[int]  # due rows per LatenessGroup.edges bin


class LatenessGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Due rows by lateness relative to cadence: bin i is [edges[i], edges[i+1]), the last open."""

    edges: list[float] = []
    sitemap: list[int] = []
    discovered: list[int] = []
    by_route: dict[str, list[int]] = {}
    classes: list[ClassRow] = []  # by due, most first
    classes_truncated: bool = False


class FlowTotals(msgspec.Struct, frozen=True, kw_only=True):
    came_due: int = 0
    added: int = 0
    triggered: int = 0
    rescheduled: int = 0
    removed: int = 0


class FlowGroup(msgspec.Struct, frozen=True, kw_only=True):
    minutes: list[FlowMinute] = []  # the last hour, oldest first, the current minute last
    last_hour: FlowTotals = FlowTotals()


class LoadStats(msgspec.Struct, frozen=True, kw_only=True):
    started_at: int | None = None
    finished_at: int | None = None
    first_publish_at: int | None = None
    rows: int = 0
    chunks: int = 0
    unreadable: int = 0
    skipped_touched: int = 0  # walked rows an event had already brought newer


class PublishStats(msgspec.Struct, frozen=True, kw_only=True):
    publishes: int = 0
    refills: int = 0  # of the publishes, those made early because claims drained the ring
    failures: int = 0
    last_at: int | None = None
    last_count: int = 0
    last_duration_us: int = 0  # wall time, stretched by whatever held the GIL meanwhile
    last_cpu_us: int = 0  # the keeper thread's CPU in it: what the GIL and the core paid
    last_considered: int = 0  # candidate rows read to choose them
    last_blocked: int = 0  # due candidates left out as leased or held, or over a site's cap
    last_passed: int = 0  # of them, leased rows passed over unprobed (keeper.skips)
    # Of them, those left out because their site could take no more grants (its
    # allowance and the slack), and how many sites that was.
    last_site_skipped: int = 0
    last_sites_limited: int = 0
    generation: int = 0
    top_checked: int = 0  # rows re-read after publishing
    top_repaired: int = 0


class VerifyStats(msgspec.Struct, frozen=True, kw_only=True):
    walks: int = 0
    running: bool = False
    last_reason: str = ""
    last_started_at: int | None = None
    last_finished_at: int | None = None
    last_rows: int = 0
    last_repairs: RepairCounts = RepairCounts()


class TrustGroup(msgspec.Struct, frozen=True, kw_only=True):
    live: bool
    live_reason: str
    phase: Phase
    exact: bool  # load complete and the feed applied without a gap since
    exact_reason: str = ""
    heartbeat_at: int = 0  # refreshed at every publish; stale means stalled
    stall_after_ms: int = 2000
    counts_at: int = 0  # when the counts (now, coming, lateness, flow) were taken
    counts_max_age_ms: int = 11_000
    # Since the feed was last read to its end, or held back by a transaction still
    # running (PostgreSQL), whichever is longer.
    feed_lag_ms: int = 0
    feed_held_back_ms: int = 0  # held back that long by one open transaction
    feed_held_by_pid: int = 0  # that transaction's backend pid (0: none, or unknown)
    publish_age_ms: int = -1  # since the last publish, as of writing (-1: none yet)
    feed_reopens: int = 0
    resyncs: int = 0  # full walks after a feed gap (reopen or cursor lost)
    reclassifications: int = 0
    rows_reclassified: int = 0
    events: int = 0
    held: int = 0
    unreadable: int = 0
    memory_bytes: int = 0
    load: LoadStats = LoadStats()
    publish: PublishStats = PublishStats()
    verification: VerifyStats = VerifyStats()
    repairs: RepairCounts = RepairCounts()  # every repair since start, by any check


class AutoscaleGroup(msgspec.Struct, frozen=True, kw_only=True):
    # Due rows no fence holds back (now.claimable): a fleet sized for keys no node may
    # grant would sit idle until the fence ends, and a handed-over key's render is already
    # running under the lease its old owner granted.
    due_now: int = 0
    oldest_claimable_age_s: float = 0.0  # now minus the earliest due among claimable rows


class FenceCount(msgspec.Struct, frozen=True, kw_only=True):
    """One fence (or the lapsed membership) as queue-state counts it."""

    # The node whose keys these were; this node's own name for "restarted" (its
    # predecessor's leases) and "unconfirmed".
    node: str
    # A Fence's reason, or "unconfirmed": this node has not confirmed within the grant
    # window that it is a live member, so it grants none of its keys.
    reason: str
    due: int  # due rows it holds back; a row two fences hold is counted by each
    until_ms: int  # when it ends (0 for "unconfirmed": once this node confirms itself)
    keys: int | None = None  # a hand-over: its keys still fenced, due or not


class FencedGroup(msgspec.Struct, frozen=True, kw_only=True):
    """In a cluster: due rows (routes not paused) this node owns but may not grant now,
    counted at each full report."""

    due: int = 0
    until_ms: int = 0  # when the last fence ends (0: none; "unconfirmed" has no end)
    reasons: list[FenceCount] = []


class SiteRow(msgspec.Struct, frozen=True, kw_only=True):
    """One site's due rows, as of the keeper's last full report (this node's rows only)."""

    site: str  # its host, lower-cased, without www., or its route's pattern's (site_of)
    due: int  # due rows (routes not paused), fenced ones included
    held: int  # rows held
    oldest_due_at: int  # the earliest due time among its due rows
    oldest_age_s: float  # how long that row has been due, at the report


class SitesGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Due rows by site, counted at each full report: how many sites, and the first few
    by due (GET /v1/sites lists up to SITES_LISTED)."""

    held: int = 0  # sites with a row held here
    with_due: int = 0  # of them, those with a due row
    no_site_due: int = 0  # due rows whose key names no host
    top: list[SiteRow] = []  # by due, most first (ties: the longest waiting first)


# Sites the keeper lists at each full report (GET /v1/sites?top=N takes N up to this),
# and the first few queue-state shows.
SITES_LISTED = 1000
SITES_IN_QUEUE_STATE = 5


class SiteList(msgspec.Struct, frozen=True, kw_only=True):
    """The sites listing, written at each full report into a state buffer of its own
    (workers.segments.Segments.site_list), beside queue-state, which keeps only the
    first few."""

    node: str
    generated_at: int  # the full report's time: queue-state's trust.counts_at
    sites: SitesGroup
    site_hashes: list[int]  # each listed site's hash (shm.keys.site_hash), in order
    truncated: bool  # more sites have due rows than are listed


class RetiredGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Retired rows this node owns (a streak of not_found outcomes retired them): kept in
    the table, never due, never held; deleted rows are gone and not counted. Counted
    exactly at each full report, as `now.held` is."""

    total: int = 0
    by_route: dict[str, int] = {}


class QueueState(msgspec.Struct, frozen=True, kw_only=True):
    schema: int
    node: str
    generated_at: int
    now: NowGroup
    coming: ComingGroup
    lateness: LatenessGroup
    flow: FlowGroup
    trust: TrustGroup
    autoscale: AutoscaleGroup
    fenced: FencedGroup | None = None  # None on a single node
    sites: SitesGroup = SitesGroup()
    retired: RetiredGroup = RetiredGroup()


class Liveness(msgspec.Struct, frozen=True, kw_only=True):
    live: bool
    reason: str
    status: Status


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(QueueState)


def encode_queue_state(state: QueueState) -> bytes:
    return _encoder.encode(state)


def decode_queue_state(payload: bytes) -> QueueState:
    """Raises msgspec.DecodeError (or ValidationError) on a payload of another shape."""
    state = _decoder.decode(payload)
    if state.schema != SCHEMA:
        raise msgspec.ValidationError(
            f"queue-state schema {state.schema}; this build reads {SCHEMA}"
        )
    return state


class Fence(msgspec.Struct, frozen=True, kw_only=True):
    """Keys `node` owned under `view` (or, with `keys`, the keys it handed over) are not
    granted here before `until_ms`."""

    node: str
    view: tuple[str, ...]
    until_ms: int
    # "awaiting": `node` has not yet acknowledged the view that moved its keys here;
    # "handed over": its live leases, key by key; "dead": its worst case.
    reason: str
    keys: int | None = None  # the keys a hand-over fences still (None: the whole share)


class ClusterStatistics(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    view: list[str]  # the live nodes, this one included when it is live
    generation: int  # ownership changes seen
    confirmed: bool  # this node read itself live within the grant window
    confirmed_at: int  # when it last did (epoch ms; 0: never)
    changes: int  # view changes
    reads: int
    read_failures: int
    fences: list[Fence]  # still in force
    fenced_until: int  # when the last fence ends (0: none)
    incarnation: int = 0
    acknowledged: bool = True  # the others have been told this node enforces its view
    # No lease of this node ends after this (epoch ms, keeper.ceiling; 0: none published),
    # and how many raises of it failed or were refused.
    lease_ceiling: int = 0
    lease_ceiling_failures: int = 0
    # As of the keeper's last full report (`counted_at`): its due rows fenced, and those
    # not (queue-state's `fenced` and `now.claimable`); None before the first.
    fenced: FencedGroup | None = None
    claimable: int = 0
    counted_at: int = 0


class SkipStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """`RowSkips.statistics()`: the table of leased rows publishes pass over."""

    marked: int  # rows marked, over the queue's life
    capacity: int  # entries the table holds (20 bytes each), live or dead
    rebuilds: int


# The keeper's statistics record, written beside queue-state into its own buffer
# (workers.segments.Segments.keeper) for every worker's /metrics and overview.
class KeeperStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """`Keeper.statistics()`: counters and sizes, safe to read from any thread."""

    phase: Phase
    status: Status
    status_reason: str
    live: bool
    exact: bool
    held: int
    classes: int
    buckets: int
    tallies: int
    memory_bytes: int
    events: int
    route_events: int
    settings_events: int
    reclassifications: int
    rows_reclassified: int
    unreadable: int
    collisions: int
    top_checks_waited: int  # top checks judged only once the feed caught up with their read
    walk_chunks_waited: int  # the same, for walk chunks
    feed_failures: int
    feed_reopens: int
    cursor_resets: int  # reopens where the saved cursor was pruned or ahead: walked from scratch
    resyncs: int
    walk_errors: int
    verifications: int
    state_writes: int
    state_write_failures: int
    statistics_write_failures: int  # this record's own writes into its buffer that failed
    load: LoadStats
    publish: PublishStats
    verification: VerifyStats
    repairs: RepairCounts
    short_slice: bool  # the keeper's thread got a short scheduler slice (store.scheduling)
    # The open subscription's counts, since it opened (a reopen starts them again); None
    # while the feed is closed.
    feed: FeedStatistics | None
    cluster: ClusterStatistics | None = None  # in a cluster: the view and its fences
    unowned_events: int = 0  # feed events for rows another node owns: dropped
    skips: SkipStatistics | None = None  # the table of leased rows publishes pass over
    dropped_unowned: int = 0  # held rows dropped because their key moved to another node
    sites: int = 0  # sites with a row held here (keeper.sites)
    site_list_write_failures: int = 0  # sites listings that could not be written
    site_events: int = 0  # sites' settings delivered by the feed
    site_settings_unapplied: int = 0  # sites' settings the site table had no room for


_statistics_decoder = msgspec.msgpack.Decoder(KeeperStatistics)
_site_list_decoder = msgspec.msgpack.Decoder(SiteList)


def encode_site_list(sites: SiteList) -> bytes:
    return _encoder.encode(sites)


def decode_site_list(payload: bytes) -> SiteList:
    """Raises msgspec.DecodeError (or ValidationError) on a payload of another shape."""
    return _site_list_decoder.decode(payload)


def encode_keeper_statistics(stats: KeeperStatistics) -> bytes:
    return _encoder.encode(stats)


def decode_keeper_statistics(payload: bytes) -> KeeperStatistics:
    """Raises msgspec.DecodeError (or ValidationError) on a payload of another shape."""
    return _statistics_decoder.decode(payload)


def liveness(state: QueueState, now_ms: int) -> Liveness:
    """Is the keeper live, as a reader sees it now (a stalled keeper cannot report itself)."""
    trust = state.trust
    age = now_ms - trust.heartbeat_at
    if age > trust.stall_after_ms:
        return Liveness(
            live=False,
            reason=f"keeper stalled: no publish for {age / 1000:.1f} s "
            f"(limit {trust.stall_after_ms / 1000:.1f} s)",
            status="stalled",
        )
    if not trust.live:
        return Liveness(live=False, reason=trust.live_reason, status=state.now.status)
    return Liveness(live=True, reason=trust.live_reason, status=state.now.status)


def as_read(state: QueueState, now_ms: int) -> QueueState:
    """The record with live, its reason, the status and the publish age as a reader sees
    them now: what a worker should serve."""
    seen = liveness(state, now_ms)
    last = state.trust.publish.last_at
    return msgspec.structs.replace(
        state,
        now=msgspec.structs.replace(state.now, status=seen.status),
        trust=msgspec.structs.replace(
            state.trust,
            live=seen.live,
            live_reason=seen.reason,
            publish_age_ms=-1 if last is None else max(0, now_ms - last),
        ),
    )


def vouches(state: QueueState, now_ms: int) -> bool:
    """Can the counts be served: the keeper is live, exact, ready, and the counts fresh."""
    return (
        liveness(state, now_ms).live
        and state.trust.exact
        and state.now.status == "ready"
        and now_ms - state.trust.counts_at <= state.trust.counts_max_age_ms
    )


def state_age_ms(state: QueueState, now_ms: int) -> int:
    """How old the counts are."""
    return max(0, now_ms - state.trust.counts_at)
