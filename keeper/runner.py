"""The keeper's I/O edge: subscribe, walk, follow the feed, publish, check, report.

One `Keeper` runs in a thread of worker 0. It decides nothing on its own: when to
do what (phases, status, deadlines, refills, which walk and when, what queue-state
may vouch for) is `keeper.lifecycle.Lifecycle`'s, and what to do to the held
queue is `KeeperCore`'s. Each `step` asks the lifecycle for one round's actions
and performs them (a store read, a feed drain, a publish, a state write, a call
into the core). An action's outcome is an event, handed to the lifecycle once the
action is over; what it answers is performed ahead of the rest of the round. `run`
loops `step` until asked to stop, waiting on the feed between rounds. The publish
step is `keeper.publish.Publisher`, the re-read of the top published rows
`keeper.topcheck.TopCheck`. Each time it rewrites queue-state, the keeper also
writes its `statistics()` (msgpack) into a second state buffer, when it has one, for
every worker's /metrics and overview; and at each full report, the sites listing
(due rows by site, `keeper.counts.count_sites`) into a third, for GET /v1/sites.

The self-checks (the top check, the walks) read the table together with the
feed's head, in one snapshot, and judge what they read only once the feed has
delivered that head: until then a difference may be a write the feed has yet
to deliver, not one it missed (under a busy writer the feed lags by seconds,
and counting those as missed writes made every trust figure lie).
"""

from __future__ import annotations

import gc
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper import heap
from keeper.ceiling import LeaseCeiling
from keeper.cluster import ClusterView
from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.counts import SiteCounts, count_queue, count_sites, due_in_minute, due_key_hashes
from keeper.feed import Feed
from keeper.lifecycle import (
    AbandonWalk,
    Action,
    Admit,
    AwaitMembers,
    BeginWalk,
    CheckTop,
    ChunkApplied,
    ChunkFailed,
    ChunkWaiting,
    Drain,
    Drained,
    Dropped,
    DropTopCheck,
    DropUnowned,
    Event,
    FeedFailed,
    FeedOpened,
    FinishWalk,
    Lifecycle,
    Marked,
    MarkUnowned,
    MembersRead,
    MembersSeen,
    MembersUnreadable,
    OpenFeed,
    Publish,
    Published,
    PublishRefused,
    ReadMembers,
    SaveCursor,
    SettleAfterLoad,
    Started,
    StateTooLarge,
    Wait,
    WalkChunk,
    WalkFinished,
    WriteState,
)
from keeper.ownership import Ownership, placements
from keeper.protocols import (
    LeaseTableLike,
    ReadyRingLike,
    SiteTableLike,
    StateBufferLike,
    WriteMarksLike,
)
from keeper.publish import Publisher, PublishFailed
from keeper.report import build_queue_state, build_site_list, trimmed_queue_state
from keeper.state import (
    SITES_LISTED,
    ClusterStatistics,
    FencedGroup,
    KeeperStatistics,
    LeaseCounts,
    Phase,
    QueueState,
    TrustGroup,
    encode_keeper_statistics,
    encode_queue_state,
    encode_site_list,
    lease_counts,
)
from keeper.topcheck import TopCheck
from keeper.walk import Walk
from shm.keys import site_hash
from shm.segment import monotonic_ms
from shm.segment import now_ms as wall_clock_ms
from shm.sites import BlockReason, Configured
from store.base import RowsRead, ScheduleStore
from store.rows import HandedBlock, Handover, MemberList, SiteSettings
from store.scheduling import ask_short_slice

log = logging.getLogger("renderqueue.keeper")

Clock = Callable[[], int]
# A read of the member list; True also reads the live lease hand-overs.
Members = Callable[[bool], MemberList]
# Tell the cluster this incarnation enforces the view of these incarnations, handing over
# its live leases on keys it lost; False when it has been superseded.
Acknowledge = Callable[[int, Sequence[int], Handover], bool]
# Raise this incarnation's published lease ceiling to at least this instant (the
# database's clock); False when the row did not take it (superseded, or not live).
RaiseLeaseCeiling = Callable[[int, int], bool]
# What an action came to, as an event for the lifecycle, and when (the keeper's clock).
Outcome = tuple[Event, int]
MAX_WAIT_S = 0.25  # an idle keeper still looks at the clock this often
# A site's settings read again this many times in a row while workers keep putting newer
# ones in force; then again after the next drain.
SITE_REREADS = 3
# A handed-over block's reason, as another node's site table named it.
_BLOCK_REASONS: dict[str, BlockReason] = {"retry_after": "retry_after", "failures": "failures"}


class ClusterSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How a clustered keeper reads the member list (workers.config has the meanings)."""

    ttl_s: float = 12.0
    max_lease_s: int = 300
    peers: list[str] = []
    peer_wait_s: float = 120.0
    poll_s: float = 1.0  # the member list is read this often
    incarnation: int = 0  # this start of the node (store.postgres.membership)
    # Until when leases of the incarnation this start replaced may live, if its lease
    # table was not taken over (this node's clock; 0: none may).
    predecessor_until_ms: int = 0
    # Keys are owned by their site's hash, not their own (keeper.ownership): one node
    # holds every key of a site and its site table enforces the site's cap exactly.
    by_site: bool = False

    @property
    def grant_window_ms(self) -> int:
        # A node that has not read itself live for this long grants nothing: well inside
        # the TTL, so it stops before the others can call it dead and take its keys.
        return int(self.ttl_s * 500)


class Keeper:
    def __init__(
        self,
        store: ScheduleStore,
        ring: ReadyRingLike,
        leases: LeaseTableLike,
        state_buffer: StateBufferLike,
        config: KeeperConfig,
        node: str = "local",
        *,
        ownership: Ownership | None = None,
        clock: Clock = wall_clock_ms,
        monotonic: Clock | None = None,
        statistics_buffer: StateBufferLike | None = None,
        site_list_buffer: StateBufferLike | None = None,
        site_table: SiteTableLike | None = None,
        cluster: ClusterSettings | None = None,
        members: Members | None = None,
        marks: WriteMarksLike | None = None,
        acknowledge: Acknowledge | None = None,
        raise_lease_ceiling: RaiseLeaseCeiling | None = None,
    ) -> None:
        """`cluster` and `members` (a read of the member list) make this keeper one of a
        cluster's: it holds and publishes only the rows it owns, and fences what it gains.
        `marks`: where each publish says how far its view had read (shm.marks), so claims
        can skip reading rows nothing wrote since. `site_table`: the node's (shm.sites),
        whose allowances keep each capped site's keys in a publish to what it can take.
        `raise_lease_ceiling`: publishes the node's lease ceiling (keeper.ceiling), which
        the keeper then puts in force in `marks`."""
        self.store = store
        self.ring = ring
        self.leases = leases
        self.state_buffer = state_buffer
        # Where `statistics()` is written beside queue-state, for every worker to read.
        self.statistics_buffer = statistics_buffer
        # Where each full report's sites listing is written (GET /v1/sites).
        self.site_list_buffer = site_list_buffer
        self.config = config
        self.node = node
        self.clock = clock
        # The cluster's durations (fences, the grant window) run on this clock, so a step
        # of the wall clock neither ends a fence early nor stretches a confirmation. A
        # test's manual clock drives both.
        self.monotonic = monotonic or (monotonic_ms if clock is wall_clock_ms else clock)
        self.cluster_settings = cluster
        self.members = members
        self.acknowledge = acknowledge
        self.raise_lease_ceiling = raise_lease_ceiling
        self.marks = marks
        self.cluster: ClusterView | None = None
        self.ceiling: LeaseCeiling | None = None
        if cluster is not None:
            if members is None:
                raise ValueError("a clustered keeper needs `members`, the member list's read")
            self.cluster = ClusterView(
                node,
                ttl_ms=int(cluster.ttl_s * 1000),
                grant_window_ms=cluster.grant_window_ms,
                max_lease_ms=cluster.max_lease_s * 1000,
                incarnation=cluster.incarnation,
                predecessor_until_ms=cluster.predecessor_until_ms
                and self.monotonic() + cluster.predecessor_until_ms - clock(),
                by_site=cluster.by_site,
            )
            ownership = self.cluster.ownership
            self.ceiling = LeaseCeiling(
                max_lease_ms=cluster.max_lease_s * 1000,
                poll_ms=int(cluster.poll_s * 1000),
            )
        self.core = KeeperCore(config, ownership)
        self._ownership_generation = self.core.ownership.generation
        self.lifecycle = Lifecycle(
            config,
            members_poll_ms=None if cluster is None else int(cluster.poll_s * 1000),
            node=node,
            peers=() if cluster is None else cluster.peers,
            peer_wait_s=0.0 if cluster is None else cluster.peer_wait_s,
        )
        # The member list read while waiting to be admitted, and when (see Admit).
        self._members_read: tuple[MemberList, int] | None = None
        self.feed = Feed(
            store,
            config.consumer,
            poll_limit=config.feed_poll_limit,
            backoff_s=config.feed_backoff_s,
            backoff_max_s=config.feed_backoff_max_s,
            clock=clock,
        )
        self._walk: Walk | None = None
        self._walk_read: RowsRead | None = None  # a chunk read, waiting for the feed
        self._publisher = Publisher(self.core, ring, leases, config, marks)
        self.site_table = site_table
        if site_table is not None:  # its allowances keep a capped site's share of the ring
            self._publisher.site_allowances = site_table.allowances
        self._site_settings_unapplied = 0
        # Sites whose settings a worker put in force while the keeper read them: read
        # again (_apply_sites).
        self._sites_to_reread: set[str] = set()
        if self.cluster is not None:
            view = self.cluster
            place = self.core.placements_of if view.by_site else None
            self._publisher.fenced = lambda hashes, _now: view.blocked_mask(
                hashes, self.monotonic(), place
            )
        self._top = TopCheck(self.core, store, self.feed, config, clock)
        self._published_keys: list[bytes] = []  # the last publish's, for the top check
        self._state: QueueState | None = None
        self._memory_bytes = 0  # the queue's buffers, as of the last full report
        # In a cluster, the last full report's count of due rows fenced, with the due rows
        # not fenced and when it was taken, for the statistics record.
        self._fenced: tuple[FencedGroup, int, int] | None = None
        self._tallies = 0
        self._state_writes = 0
        self._state_write_failures = 0
        self._statistics_write_failures = 0
        self._site_list_write_failures = 0
        self._ceiling_failures = 0
        self._site_counts: SiteCounts | None = None  # the last full report's, not written yet
        self._short_slice = False
        # What the lifecycle answered and the keeper has yet to do, ahead of the round's
        # other actions.
        self._pending: deque[Action] = deque()

    # -- the loop ------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Start, then step until `stop` is set. Never raises for store or feed trouble."""
        # How far the keeper trails the table is mostly how soon this thread runs when a
        # commit wakes it: ask for a short scheduler slice (see store.scheduling).
        self._short_slice = ask_short_slice()
        try:
            self.start()
            while not stop.is_set():
                wait_s = self.step()
                if wait_s > 0 and not stop.is_set():
                    self._wait(min(wait_s, MAX_WAIT_S), stop)
        finally:
            self.close()

    def start(self) -> None:
        self._tell(Started(), self.clock())

    def step(self) -> float:
        """One bounded round of work, as the lifecycle lays it out; returns how long the
        loop may wait (s)."""
        while True:
            self._heard()
            if self._pending:
                action = self._pending.popleft()
            else:
                action = self.lifecycle.next_action(self.clock(), self.ring.remaining())
                if isinstance(action, Wait):
                    return action.seconds
            self._perform(action)

    def _heard(self) -> None:
        """Say the keeper is going round: a cluster node's supervisor stops vouching for
        the node when its keeper falls silent (workers.membership)."""
        if self.marks is not None:
            self.marks.hear_keeper(monotonic_ms())

    def _wait(self, seconds: float, stop: threading.Event) -> None:
        if self.feed.open:
            try:
                self.feed.wait(seconds)
                return
            except Exception as exc:  # a broken wait is a broken feed
                self._tell(*self._feed_failed(exc))
        stop.wait(seconds)

    def close(self) -> None:
        self._top.drop()
        failed = self._save_cursor()  # a graceful stop replays nothing on the next start
        if failed is not None:
            self._tell(*failed)
        self.feed.close()

    # -- doing what the lifecycle says -------------------------------------------------

    def _perform(self, action: Action) -> None:
        """Do an action, then hand its outcome to the lifecycle: what it answers goes
        ahead of everything still pending (so a failed feed drops the reads under way
        before anything else runs)."""
        outcome = self._do(action)
        if outcome is not None:
            event, now = outcome
            self._pending.extendleft(reversed(self.lifecycle.handle(event, now)))

    def _tell(self, event: Event, now: int) -> None:
        """An event outside any action (the start, a broken wait, the close): hand it
        to the lifecycle and do what it answers, at once."""
        self._pending.extendleft(reversed(self.lifecycle.handle(event, now)))
        while self._pending:
            self._perform(self._pending.popleft())

    def _do(self, action: Action) -> Outcome | None:
        """Do one action; its outcome, if it has one."""
        match action:
            case OpenFeed(resume):
                return self._open_feed(resume)
            case AwaitMembers():
                return self._await_members()
            case Admit(peers_unseen):
                self._admit(peers_unseen)
            case ReadMembers():
                return self._read_members()
            case MarkUnowned():
                return self._mark_unowned()
            case DropUnowned(limit):
                self.core.drop_unowned(limit)
                return Dropped(left=self.core.dropping), self.clock()
            case BeginWalk(reason):
                self._walk = self.core.begin_walk(reason, self.clock())
                self._walk_read = None
            case WalkChunk(rows):
                return self._walk_chunk(rows)
            case FinishWalk(drain_ms):
                return self._finish_walk(drain_ms)
            case AbandonWalk():
                if self._walk is not None:
                    self.core.abandon_walk(self._walk)
                    self._walk = None
            case DropTopCheck():
                self._top.drop()
            case Drain(until_ms):
                return self._drain(until_ms)
            case Publish(refill):
                return self._publish(refill)
            case CheckTop(drain_ms):
                return self._check_top(drain_ms)
            case SaveCursor():
                return self._save_cursor()
            case WriteState(full, trim):
                return self._write_state(self.clock(), full=full, trim=trim)
            case SettleAfterLoad():
                # The load's objects stay as long as the keeper (see workers.worker.serve).
                gc.freeze()
                heap.trim()
            case Wait():
                pass
        return None

    # -- the feed ------------------------------------------------------------------

    def _open_feed(self, resume: bool) -> Outcome:
        """Subscribe (at the cursor reached, or the head) and read the settings."""
        now = self.clock()
        version = self._reserve_site_version()
        try:
            self.feed.subscribe(now, resume=resume)
            self.core.load_settings(self.store.routes(), self.store.default_cadence_s())
            if self.site_table is not None:
                self.core.load_sites(self.store.sites())
        except Exception as exc:
            return self._feed_failed(exc)
        self._apply_sites(version)
        return FeedOpened(), now

    def _feed_failed(self, exc: BaseException) -> tuple[FeedFailed, int]:
        """Close the feed until its backoff is over; the failure, as an event."""
        now = self.clock()
        self.feed.failed(exc, now)
        return FeedFailed(type(exc).__name__, reopen_at=self.feed.reopen_at), now

    def _drain(self, until_ms: int) -> tuple[Drained | FeedFailed, int]:
        """Apply feed batches until the feed is empty or `until_ms`; Drained, or the
        feed's failure, which ends the drain."""
        version = self._reserve_site_version()
        try:
            emptied = self.feed.drain(self.core.apply_events, until_ms, self.core.apply_records)
        except Exception as exc:
            return self._feed_failed(exc)
        finally:
            self._apply_sites(version)
        return Drained(emptied=emptied), self.clock()

    def _reserve_site_version(self) -> int:
        """Taken before the store is read for sites' settings (the feed reads a site's row
        when it delivers its entry): what is read is then put in force only if no worker
        put newer settings in force since (api.sites sets them at once after its write)."""
        return 0 if self.site_table is None else self.site_table.reserve_version()

    def _apply_sites(self, version: int) -> None:
        """Put the sites' settings the core took in in force in the node's site table,
        as of `version`. A site a worker configured since is read again, with a new
        version: its settings may be older than the store's by then (another node's
        write, delivered in the same read), and no later entry would bring them."""
        changes = self.core.take_site_settings()
        table = self.site_table
        if table is None:
            return
        reread = self._sites_to_reread
        for settings in changes:
            if self._configure_site(table, settings, version) == "superseded":
                reread.add(settings.site)
        for site in sorted(reread):
            for _ in range(SITE_REREADS):
                fresh = table.reserve_version()
                try:
                    current = self.store.get_site(site) or SiteSettings(site=site)
                except Exception:  # the store is down: read again after the next drain
                    break
                if self._configure_site(table, current, fresh) != "superseded":
                    reread.discard(site)
                    break

    def _configure_site(
        self, table: SiteTableLike, settings: SiteSettings, version: int
    ) -> Configured:
        done = table.configure_as_of(
            site_hash(settings.site.encode()),
            settings.max_in_flight,
            settings.min_interval_ms,
            version,
        )
        if done == "no_room":
            self._site_settings_unapplied += 1
        return done

    # -- the cluster ---------------------------------------------------------------

    def _await_members(self) -> Outcome:
        """Before loading: read the member list and who it says is live, keeping the read
        for Admit (it enters the cluster view only then)."""
        assert self.members is not None
        now = self.clock()
        try:
            read = self.members(True)
        except Exception as exc:
            return MembersUnreadable(str(exc)), now
        self._members_read = read, now
        return MembersSeen(live=frozenset(r.node for r in read.records if r.live)), now

    def _admit(self, peers_unseen: bool) -> None:
        assert self._members_read is not None and self.cluster_settings is not None
        (read, now), self._members_read = self._members_read, None
        if peers_unseen:
            log.warning(
                "keeper: no peer of %s seen live; loading anyway", self.cluster_settings.peers
            )
        self._observe(read, now)
        self._ownership_generation = self.core.ownership.generation

    def _read_members(self) -> Outcome | None:
        assert self.cluster is not None and self.members is not None
        now = self.clock()
        try:
            read = self.members(self.cluster.awaiting)
        except Exception as exc:
            self.cluster.failed()
            log.warning("keeper: reading the member list failed (%s)", exc)
            return None
        changed = self._observe(read, now)
        if changed:
            log.info("keeper: the live nodes are now %s", ", ".join(self.cluster.view or ()))
        generation = self.core.ownership.generation
        moved = generation != self._ownership_generation
        self._ownership_generation = generation
        return MembersRead(view_changed=changed, ownership_changed=moved), now

    def _observe(self, read: MemberList, now: int) -> bool:
        """Take a member list; on a change of view, enforce it and say so (see below)."""
        assert self.cluster is not None
        mono = self.monotonic()
        changed = self.cluster.observe(read, mono, wall_now=now)
        self._take_handed_over(now)
        if self.cluster.confirmed(mono):
            self._raise_lease_ceiling(now)
        if self.marks is not None:
            # The workers judge it on the machine's monotonic clock, shared by its
            # processes: a step of the wall clock neither extends nor cuts it.
            until = self.cluster.confirmed_until()
            left_ms = until - mono if until else -1
            self.marks.confirm_until(monotonic_ms() + left_ms if left_ms > 0 else 0)
        if self.cluster.unacknowledged:
            self._enforce_view(now)
        return changed

    def _raise_lease_ceiling(self, now: int) -> None:
        """Keep the published lease ceiling ahead of the leases asked for (keeper.ceiling),
        and put it in force for the workers once the node's row carries it."""
        cluster, ceiling, marks = self.cluster, self.ceiling, self.marks
        if cluster is None or ceiling is None or marks is None or self.raise_lease_ceiling is None:
            return
        ceiling.asked(marks.take_lease_asked(), now)
        if not ceiling.due(now):
            return
        # Every lease granted under a published ceiling ends by it, and the ceiling only
        # rises: only the first raise must look at leases this run did not grant (adopted
        # from its previous run, or restored from its snapshot), a scan of the whole table.
        leases_end = 0
        if ceiling.published_ms == 0:
            _, expiries, _, _ = self.leases.live_leases(now)
            leases_end = int(expiries.max(initial=0))
        target = ceiling.target(now, leases_end)
        try:
            raised = self.raise_lease_ceiling(
                cluster.incarnation, target + cluster.offset_ms - cluster.to_wall_ms
            )
        except Exception as exc:
            self._ceiling_failures += 1
            log.warning("keeper: raising the lease ceiling failed (%s)", exc)
            return
        if raised:
            ceiling.published(target)
            marks.raise_lease_ceiling(target)
        else:
            self._ceiling_failures += 1

    def _enforce_view(self, now: int) -> None:
        """Publish the new view to the workers, then hand over the live leases on keys
        this node lost, then acknowledge: the nodes that gained them fence exactly those.

        The order is what makes the hand-over whole: `write_owners` raises the view
        number with a full fence before the lease scan, and a claimant or renewer reads
        it with one after its lease CAS (shm.marks), so a lease the scan misses is handed
        back by its claimant, never answered."""
        cluster = self.cluster
        assert cluster is not None
        if self.marks is not None:
            # The names ownership is computed over: without this node when it is not live
            # in the view (another start of its name may be), so its workers own nothing.
            live = cluster.ownership.nodes if cluster.confirmed(self.monotonic()) else ()
            self.marks.write_owners(live, now)
        if self.acknowledge is None:
            cluster.acknowledged()
            return
        hashes, expiries, sites, tokens = self.leases.live_leases(now)
        lost, sites = self._lost(hashes, sites)
        to_db = cluster.offset_ms - cluster.to_wall_ms  # the wall clock to the database's
        handover = Handover(
            node=self.node,
            incarnation=cluster.incarnation,
            key_hashes=hashes[lost].tolist(),
            expires_at_ms=(expiries[lost] + to_db).tolist(),
            site_hashes=sites[lost].tolist(),
            tokens=tokens[lost].tolist(),
            blocks=self._handed_blocks(now, to_db),
        )
        try:
            if self.acknowledge(cluster.incarnation, cluster.live_incarnations(), handover):
                cluster.acknowledged()
                log.info(
                    "keeper: acknowledged the view %s, handing over %d leases",
                    ", ".join(cluster.view or ()),
                    len(handover.key_hashes),
                )
            else:
                log.warning("keeper: this incarnation was superseded; it acknowledges nothing")
        except Exception as exc:  # the next read tries again
            log.warning("keeper: acknowledging the view failed (%s)", exc)

    def _lost(
        self, hashes: npt.NDArray[np.uint64], sites: npt.NDArray[np.uint64]
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.uint64]]:
        """Which live leases are on keys this node no longer owns (the hand-over), and
        each lease's site.

        Owned by site, a lease's site is the one its row is held under here, and where
        the row is gone the lease table's site word. A site word is written just after
        its lease's CAS, so while the scan reads it it may still name the slot's previous
        site: a lease lost under either is handed over (one too many only fences a key
        that needed no fence). A held row is placed by its host's site, which its route's
        site pattern does not change (HeldQueue.host_site_hashes)."""
        ownership = self.core.ownership
        if not len(hashes):
            return np.zeros(0, dtype=np.bool_), sites
        if not ownership.by_site:
            return ~ownership.owns_many(hashes), sites
        slots = self.core.queue.slots.find_many(hashes)
        held = slots >= 0
        rows = sites.copy()
        rows[held] = self.core.queue.site_hashes_of(slots[held])
        hosts = sites.copy()
        hosts[held] = self.core.queue.host_site_hashes(slots[held])
        lost = ~ownership.owns_many(placements(hashes, hosts, True))
        lost |= ~ownership.owns_many(placements(hashes, sites, True))
        return lost, rows

    def _handed_blocks(self, now: int, to_db: int) -> list[HandedBlock]:
        """Owned by site: every block in force here, to go with the sites this node lost
        (the others' site tables cannot see this one's). All of them, not only the lost
        sites': a site named by a route's pattern is not where its keys are placed (their
        hosts are), and a block at a node that does not own its site only stays unused."""
        table = self.site_table
        if table is None or not self.core.ownership.by_site:
            return []
        return [
            HandedBlock(block.site_hash, block.until + to_db, block.reason)
            for block in table.blocks(now)
        ]

    def _take_handed_over(self, now: int) -> None:
        """Owned by site: a permit in the site table for each lease another node handed
        over on a site (until the lease's end), so a gained site's cap counts them; and
        the sites' blocks handed over with them."""
        cluster, table = self.cluster, self.site_table
        if cluster is None or not (cluster.handed_permits or cluster.handed_blocks):
            return
        handed, cluster.handed_permits = cluster.handed_permits, []
        blocks, cluster.handed_blocks = cluster.handed_blocks, []
        if table is None:
            return
        mono = self.monotonic()
        for sites, ends in handed:
            for site, end in zip(sites.tolist(), ends.tolist(), strict=True):
                if end > mono:
                    table.take_permit(site, now, end - mono)
        for site, end, reason in blocks:
            named = _BLOCK_REASONS.get(reason)
            if end > mono and named is not None:
                table.block(site, now + end - mono, named)
        if blocks:
            log.info("keeper: took %d site blocks handed over with their sites", len(blocks))

    def _mark_unowned(self) -> Outcome:
        self._top.drop()
        marked = self.core.mark_unowned()
        log.info("keeper: ownership changed; dropping %d rows no longer owned", marked)
        gains = self.cluster is not None and self.cluster.gains
        return Marked(rows=marked, gains=gains), self.clock()

    # -- walks ---------------------------------------------------------------------

    def _walk_chunk(self, limit: int) -> Outcome:
        """Read a chunk, and apply it once the feed has delivered what the read saw.

        Applied earlier, a row the feed has yet to deliver would read as a missed write,
        and a held row deleted before the read as a missed delete at the sweep. A load
        into an empty queue compares nothing (see Walk.judges) and never waits: a
        restart under a busy writer serves and loads at the pace of the table.
        """
        walk = self._walk
        assert walk is not None
        read = self._walk_read
        if read is None:
            try:
                read = self.store.walk_at(walk.after, limit)
            except Exception as exc:
                log.warning("keeper: walk after %r failed (%s); retrying", walk.after, exc)
                return ChunkFailed(), self.clock()
            self._walk_read = read
        if walk.judges and not self.feed.has_delivered(read.head):
            # The round drains the feed; the chunk is applied in a later one.
            return ChunkWaiting(), self.clock()
        self._walk_read = None
        now = self.clock()
        self.core.apply_walked(walk, read.rows, now)
        return ChunkApplied(rows=len(read.rows), walk=walk.summary()), now

    def _finish_walk(self, drain_ms: int) -> Outcome:
        # The feed has delivered every chunk's head (see _walk_chunk): a delete any read
        # showed has been applied, its key touched, before the sweep looks for rows gone.
        # (A walk that judges nothing has no untouched held rows to sweep.) The drain
        # brings the feed nearer the present before the keeper says it is exact.
        walk = self._walk
        assert walk is not None
        drained = self._drain(self.clock() + drain_ms)
        if isinstance(drained[0], FeedFailed):
            return drained  # no sweep: the lifecycle abandons the walk at the failure
        now = self.clock()
        self.core.finish_walk(walk, now)
        self._walk = None
        summary = walk.summary()
        repairs = summary.repairs
        if walk.reason == "load":
            log.info(
                "keeper: loaded %d rows in %.2f s (%d unreadable)",
                len(self.core.queue),
                (now - walk.started_at) / 1000,
                walk.unreadable,
            )
        elif repairs.missed or repairs.gained:
            log.warning(
                "keeper: %s walk repaired %d missed writes and added %d gained rows",
                walk.reason,
                repairs.missed,
                repairs.gained,
            )
        return WalkFinished(summary), now

    # -- publishing ----------------------------------------------------------------

    def _publish(self, refill: bool) -> Outcome:
        now = self.clock()
        # Only an exact view vouches: a walk under way may still hold rows older than it.
        delivered_below = self.feed.delivered_below() if self.lifecycle.exact else 0
        keys = self._publisher.publish(now, refill=refill, delivered_below=delivered_below)
        if isinstance(keys, PublishFailed):
            return PublishRefused(keys.reason), now
        self._published_keys = keys
        return Published(self._publisher.stats), now

    def _check_top(self, drain_ms: int) -> Outcome | None:
        """The top check after a publish; the feed's failure, if it failed in the check's
        drain (the read then waits unjudged, and the failure drops it)."""
        failed: Outcome | None = None

        def drain() -> bool:
            nonlocal failed
            outcome = self._drain(self.clock() + drain_ms)
            if isinstance(outcome[0], FeedFailed):
                failed = outcome
                return False
            return True

        checked = self._top.after_publish(self._published_keys, self.clock(), drain)
        if checked is not None:
            self._publisher.count_top_check(checked)
        return failed

    def _save_cursor(self) -> Outcome | None:
        try:
            self.feed.save()
        except Exception as exc:
            return self._feed_failed(exc)
        return None

    # -- queue-state ---------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    def _trust(self, now: int, counts_at: int) -> TrustGroup:
        lifecycle = self.lifecycle
        live, reason = lifecycle.live()
        exact = lifecycle.exact
        heartbeat_at = lifecycle.heartbeat_at
        counters = self.core.counters
        feed = self.feed.statistics()
        held_back_ms = 0 if feed is None else feed.held_back_ms
        return TrustGroup(
            live=live,
            live_reason=reason,
            phase=lifecycle.phase,
            exact=exact,
            exact_reason="" if exact else lifecycle.exact_reason,
            # Before the first publish the heartbeat is the keeper's own: it is running.
            heartbeat_at=heartbeat_at or now,
            stall_after_ms=int(self.config.stall_after_s * 1000),
            counts_at=counts_at,
            counts_max_age_ms=lifecycle.counts_max_age_ms,
            feed_lag_ms=max(0, now - self.feed.caught_up_at, held_back_ms)
            if self.feed.open
            else -1,
            feed_held_back_ms=held_back_ms,
            feed_held_by_pid=0 if feed is None else feed.held_by_pid,
            publish_age_ms=-1 if heartbeat_at == 0 else max(0, now - heartbeat_at),
            feed_reopens=self.feed.reopens,
            resyncs=lifecycle.resyncs,
            reclassifications=counters.reclassifications,
            rows_reclassified=counters.rows_reclassified,
            events=counters.events,
            held=len(self.core.queue),
            unreadable=counters.unreadable,
            memory_bytes=self._memory_bytes,
            load=lifecycle.load,
            publish=self._publisher.stats,
            verification=lifecycle.verify,
            repairs=self.core.repairs.snapshot(),
        )

    def _lease_counts(self, now: int) -> LeaseCounts:
        try:
            s = self.leases.statistics(now)
        except Exception:
            log.debug("keeper: lease statistics failed", exc_info=True)
            return LeaseCounts()
        return lease_counts(s)

    def queue_state(self, now: int, *, full: bool) -> QueueState:
        """The full record (counts taken now), or the last one with trust and status refreshed."""
        if full or self._state is None:
            queue = self.core.queue
            queue.tallies.now_minute = now // 60_000
            queue.tallies.trim()
            self._memory_bytes = queue.nbytes()
            self._tallies = len(queue.tallies)
            self.core.flow.tick(now, lambda minute: due_in_minute(queue, minute))
            blocked = self._publisher.blocked(now)
            counts = count_queue(queue, now)
            fenced = self._count_fenced(now, counts.due)
            sites = count_sites(queue, now, SITES_LISTED)
            self._site_counts = sites
            return build_queue_state(
                node=self.node,
                now_ms=now,
                counts=counts,
                fenced=fenced,
                sites=sites,
                retired=self.core.retired.by_route(),
                classes=self.core.classes,
                flow=self.core.flow.minutes(now),
                leases=self._lease_counts(now),
                status=self.lifecycle.status,
                status_reason=self.lifecycle.status_reason,
                trust=self._trust(now, now),
                earliest_claimable_at=queue.earliest_claimable(now, blocked),
                rows_max=self.config.class_rows_max,
            )
        last = self._state
        return msgspec.structs.replace(
            last,
            now=msgspec.structs.replace(
                last.now,
                status=self.lifecycle.status,
                status_reason=self.lifecycle.status_reason,
            ),
            trust=self._trust(now, last.trust.counts_at),
        )

    def _count_fenced(self, now: int, due: int) -> FencedGroup | None:
        """In a cluster, how many of the due rows the fences hold back: a pass over every
        due row's hash, so only at a full report and only while a fence may hold one."""
        cluster = self.cluster
        if cluster is None:
            return None
        mono = self.monotonic()
        if cluster.fencing(mono):
            place = self.core.placements_of if cluster.by_site else None
            fenced = cluster.count_fenced(due_key_hashes(self.core.queue, now), mono, place)
        else:
            fenced = FencedGroup()
        self._fenced = (fenced, max(0, due - fenced.due), now)
        return fenced

    def _write_state(self, now: int, *, full: bool, trim: bool) -> Outcome | None:
        """Queue-state, then the sites listing and the statistics record; StateTooLarge
        (and nothing written) when the record, untrimmed, outgrows its buffer."""
        try:
            state = self.queue_state(now, full=full)
            self._state = state
            if trim:
                state = trimmed_queue_state(state)
            try:
                self.state_buffer.write(encode_queue_state(state), now)
            except ValueError:  # too large for the buffer
                if not trim:
                    return StateTooLarge(), now
                raise
            self._state_writes += 1
        except Exception:
            self._state_write_failures += 1
            log.exception("keeper: writing queue-state failed")
        self._write_site_list(now)
        self._write_statistics(now)
        return None

    def _write_site_list(self, now: int) -> None:
        """The last full report's sites listing, once; a listing too large for its buffer
        is cut in half until it fits (names are up to 253 bytes)."""
        counts, self._site_counts = self._site_counts, None
        if counts is None or self.site_list_buffer is None:
            return
        try:
            while True:
                try:
                    self.site_list_buffer.write(
                        encode_site_list(build_site_list(self.node, counts)), now
                    )
                    return
                except ValueError:
                    if not counts.top:
                        raise
                    counts = msgspec.structs.replace(counts, top=counts.top[: len(counts.top) // 2])
        except Exception:
            self._site_list_write_failures += 1
            log.exception("keeper: writing the sites listing failed")

    def _write_statistics(self, now: int) -> None:
        """The statistics record, at every queue-state write; a failure is counted only."""
        if self.statistics_buffer is None:
            return
        try:
            self.statistics_buffer.write(encode_keeper_statistics(self.statistics()), now)
        except Exception:
            self._statistics_write_failures += 1
            log.exception("keeper: writing its statistics failed")

    # -- statistics ----------------------------------------------------------------

    def statistics(self) -> KeeperStatistics:
        """Safe from any thread: it reads counters and lengths, never the queue's buffers
        (a numpy view taken here could stop the keeper's thread from growing an array)."""
        core = self.core
        counters = core.counters
        lifecycle = self.lifecycle
        live, _ = lifecycle.live()
        return KeeperStatistics(
            phase=lifecycle.phase,
            status=lifecycle.status,
            status_reason=lifecycle.status_reason,
            live=live,
            exact=lifecycle.exact,
            held=len(core.queue),
            classes=len(core.classes),
            buckets=len(core.queue.buckets),
            tallies=self._tallies,
            memory_bytes=self._memory_bytes,
            events=counters.events,
            route_events=counters.route_events,
            settings_events=counters.settings_events,
            site_events=counters.site_events,
            site_settings_unapplied=self._site_settings_unapplied,
            reclassifications=counters.reclassifications,
            rows_reclassified=counters.rows_reclassified,
            unreadable=counters.unreadable,
            collisions=counters.collisions,
            top_checks_waited=self._top.waited,
            walk_chunks_waited=lifecycle.walk_chunks_waited,
            feed_failures=self.feed.failures,
            feed_reopens=self.feed.reopens,
            cursor_resets=self.feed.cursor_resets,
            resyncs=lifecycle.resyncs,
            walk_errors=lifecycle.walk_errors,
            verifications=lifecycle.verify.walks,
            state_writes=self._state_writes,
            state_write_failures=self._state_write_failures,
            statistics_write_failures=self._statistics_write_failures,
            load=lifecycle.load,
            publish=self._publisher.stats,
            verification=lifecycle.verify,
            repairs=core.repairs.snapshot(),
            short_slice=self._short_slice,
            feed=self.feed.statistics(),
            cluster=self._cluster_statistics(),
            unowned_events=counters.unowned,
            dropped_unowned=counters.dropped_unowned,
            skips=core.queue.skips.statistics(),
            sites=len(core.queue.sites),
            site_list_write_failures=self._site_list_write_failures,
        )

    def _cluster_statistics(self) -> ClusterStatistics | None:
        if self.cluster is None:
            return None
        stats = self.cluster.statistics(self.monotonic())
        if self.ceiling is not None:
            stats = msgspec.structs.replace(
                stats,
                lease_ceiling=self.ceiling.published_ms,
                lease_ceiling_failures=self._ceiling_failures,
            )
        if self._fenced is None:
            return stats
        fenced, claimable, at = self._fenced
        return msgspec.structs.replace(stats, fenced=fenced, claimable=claimable, counted_at=at)
