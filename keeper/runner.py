"""The keeper's I/O edge: subscribe, load, follow the feed, publish, check, report.

One `Keeper` runs in a thread of worker 0. Each `step` does a bounded amount of
work (a walk chunk, the feed up to the next deadline, a publish, a report), so
the publish every second is never starved by a long walk or a burst of events;
`run` loops `step` until asked to stop. Everything it decides is in
`KeeperCore`; this module only reads, writes and keeps time. The publish step
is `keeper.publish.Publisher`, the re-read of the top published rows
`keeper.topcheck.TopCheck`; the runner sequences them. Each time it rewrites
queue-state, the keeper also writes its `statistics()` (msgpack) into a second
state buffer, when it has one, for every worker's /metrics and overview.

The order of a start: write queue-state (unready, starting), subscribe at the
feed's head, read routes and the default cadence (so a change after the
subscription arrives as an event), then walk the table by primary key in
chunks, publishing from the first chunk on. A failed feed is reopened with
backoff at the cursor reached (at the head, if the store pruned past it), and
the table is walked again to repair whatever the gap hid; the keeper is not
exact until that walk ends. It never reloads: settings changes reclassify in
memory.

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
import time
from collections.abc import Callable

import msgspec

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.counts import count_queue, due_in_minute
from keeper.feed import Feed
from keeper.ownership import Ownership
from keeper.protocols import LeaseTableLike, ReadyRingLike, StateBufferLike
from keeper.publish import Publisher, PublishFailed
from keeper.report import build_queue_state
from keeper.state import (
    KeeperStatistics,
    LeaseCounts,
    LoadStats,
    Phase,
    QueueState,
    Status,
    TrustGroup,
    VerifyStats,
    encode_keeper_statistics,
    encode_queue_state,
    lease_counts,
)
from keeper.topcheck import TopCheck
from keeper.walk import Walk, WalkReason
from store.base import RowsRead, ScheduleStore
from store.scheduling import ask_short_slice

log = logging.getLogger("renderqueue.keeper")
# A refill waits at least this many times the last publish's duration (see _drained).
REFILL_COST_SHARE = 5

Clock = Callable[[], int]
MAX_WAIT_S = 0.25  # an idle keeper still looks at the clock this often


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


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
        statistics_buffer: StateBufferLike | None = None,
    ) -> None:
        self.store = store
        self.ring = ring
        self.leases = leases
        self.state_buffer = state_buffer
        # Where `statistics()` is written beside queue-state, for every worker to read.
        self.statistics_buffer = statistics_buffer
        self.config = config
        self.node = node
        self.clock = clock
        self.core = KeeperCore(config, ownership)
        self._ownership_generation = self.core.ownership.generation
        self.phase: Phase = "starting"
        self.status: Status = "unready"
        self.status_reason = "the keeper has not published yet"
        self._exact_reason = "loading"
        self._loaded = False
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
        self._walk_read_waited = False
        self._walk_retry_at = 0
        self._publisher = Publisher(self.core, ring, leases, config)
        self._top = TopCheck(self.core, store, self.feed, config, clock)
        self._next_publish = 0
        self._next_report = 0
        self._next_verify = 0
        self._heartbeat_at = 0
        self._state: QueueState | None = None
        self._started = False
        self._memory_bytes = 0  # the queue's buffers, as of the last full report
        self._tallies = 0
        # counters
        self._resyncs = 0
        self._walk_errors = 0
        self._walk_chunks_waited = 0
        self._state_writes = 0
        self._state_write_failures = 0
        self._statistics_write_failures = 0
        self._load = LoadStats()
        self._verify = VerifyStats()
        self._next_cursor_save = 0
        self._short_slice = False

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
        now = self.clock()
        self._started = True
        self._write_state(now, full=True)
        self._open_feed(now, resume=False)
        self._next_publish = now
        self._next_report = now + int(self.config.report_interval_s * 1000)
        self._next_verify = now + int(self.config.verify_interval_s * 1000)

    def step(self) -> float:
        """One bounded round of work; returns how long the loop may wait (s)."""
        now = self.clock()
        if not self.feed.open and now >= self.feed.reopen_at:
            self._open_feed(now, resume=True)
        if self._ownership_generation != self.core.ownership.generation:
            self._ownership_changed(now)
        busy = False
        if self._walk is not None and now >= self._walk_retry_at:
            self._walk_chunk(now)
            busy = self._walk is not None
        busy = not self._drain(self._next_publish) or busy
        now = self.clock()
        if now >= self._next_publish:
            self._publish_now(now)
            self._next_publish = max(
                self._next_publish + int(self.config.publish_interval_s * 1000), now + 1
            )
        elif self._drained(now):
            self._publish_now(now, refill=True)
        now = self.clock()
        if now >= self._next_report:
            self._write_state(now, full=True)
            self._next_report = now + int(self.config.report_interval_s * 1000)
        if now >= self._next_verify and self._walk is None and self._loaded:
            self._begin_walk(now, "verify")
            self._next_verify = now + int(self.config.verify_interval_s * 1000)
        if busy:
            return 0.0
        wait_s = max(0.0, (self._next_publish - self.clock()) / 1000)
        if self._claiming():
            # Claims take entries without a feed event to wake the keeper: look again soon.
            wait_s = min(wait_s, self.config.refill_min_gap_s)
        return wait_s

    def _wait(self, seconds: float, stop: threading.Event) -> None:
        if self.feed.open:
            try:
                self.feed.wait(seconds)
                return
            except Exception as exc:  # a broken wait is a broken feed
                self._feed_failed(exc, self.clock())
        stop.wait(seconds)

    def close(self) -> None:
        self._top.drop()
        self._save_cursor()  # a graceful stop replays nothing on the next start
        self.feed.close()

    # -- the feed ------------------------------------------------------------------

    def _open_feed(self, now: int, *, resume: bool) -> None:
        """Subscribe (at the cursor reached, or the head), read settings, and walk."""
        try:
            self.feed.subscribe(now, resume=resume)
            self.core.load_settings(self.store.routes(), self.store.default_cadence_s())
        except Exception as exc:
            self._feed_failed(exc, now)
            return
        if self._walk is not None:
            self.core.abandon_walk(self._walk)
            self._walk = None
        self._top.drop()
        self._begin_walk(now, "load" if not self._loaded else "resync")

    def _feed_failed(self, exc: BaseException, now: int) -> None:
        self.feed.failed(exc, now)
        # A reopened feed may start at the head: its position says nothing of what the
        # reads below saw, so they are dropped unjudged (the resync walk reads afresh).
        self._top.drop()
        if self._walk is not None:
            self.core.abandon_walk(self._walk)
            self._walk = None
        self._exact_reason = f"feed failed ({type(exc).__name__}); reopening"
        if self.phase == "live":
            self.phase = "resyncing"
        self._write_state(now)

    def _drain(self, until_ms: int) -> bool:
        """Apply feed batches until the feed is empty or `until_ms`; True when emptied."""
        try:
            return self.feed.drain(self.core.apply_events, until_ms)
        except Exception as exc:
            self._feed_failed(exc, self.clock())
            return True

    # -- walks ---------------------------------------------------------------------

    def _begin_walk(self, now: int, reason: WalkReason) -> None:
        walk = self.core.begin_walk(reason, now)
        self._walk = walk
        self._walk_read = None
        if reason == "load":
            self.phase = "loading"
            self._exact_reason = "loading: walking the table"
            self._load = LoadStats(started_at=now)
        elif reason == "resync":
            self.phase = "resyncing"
            self._resyncs += 1
            self._exact_reason = "resyncing: walking the table after a feed gap"
        else:
            self._verify = msgspec.structs.replace(
                self._verify, running=True, last_reason=reason, last_started_at=now
            )
        self._write_state(now)

    def _walk_chunk(self, now: int) -> None:
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
                read = self.store.walk_at(walk.after, self.config.walk_chunk)
            except Exception as exc:
                self._walk_errors += 1
                log.warning("keeper: walk after %r failed (%s); retrying", walk.after, exc)
                self._walk_retry_at = now + int(self.config.feed_backoff_s * 1000)
                return
            self._walk_read = read
            self._walk_read_waited = False
        if walk.judges and not self.feed.has_delivered(read.head):
            if not self._walk_read_waited:
                self._walk_read_waited = True
                self._walk_chunks_waited += 1
            return  # the step drains the feed; the chunk is applied at a later step
        self._walk_read = None
        rows = read.rows
        self.core.apply_walked(walk, rows, self.clock())
        if walk.reason == "load":
            self._load = msgspec.structs.replace(
                self._load,
                rows=walk.rows,
                chunks=walk.chunks,
                unreadable=walk.unreadable,
                skipped_touched=walk.repairs.skipped_touched,
            )
        if len(rows) < self.config.walk_chunk:
            self._finish_walk(walk)

    def _finish_walk(self, walk: Walk) -> None:
        # The feed has delivered every chunk's head (see _walk_chunk): a delete any read
        # showed has been applied, its key touched, before the sweep looks for rows gone.
        # (A walk that judges nothing has no untouched held rows to sweep.) The drain
        # brings the feed nearer the present before the keeper says it is exact.
        self._drain(self.clock() + 1000)
        now = self.clock()
        self.core.finish_walk(walk, now)
        self._walk = None
        summary = walk.summary()
        repairs = summary.repairs
        if walk.reason == "load":
            self._loaded = True
            self._load = msgspec.structs.replace(self._load, finished_at=now)
            log.info(
                "keeper: loaded %d rows in %.2f s (%d unreadable)",
                len(self.core.queue),
                (now - walk.started_at) / 1000,
                walk.unreadable,
            )
        else:
            self._verify = VerifyStats(
                walks=self._verify.walks + 1,
                running=False,
                last_reason=walk.reason,
                last_started_at=walk.started_at,
                last_finished_at=now,
                last_rows=walk.rows,
                last_repairs=repairs,
            )
            missed = repairs.missed_added + repairs.missed_changed + repairs.missed_removed
            if missed or repairs.gained:
                log.warning(
                    "keeper: %s walk repaired %d missed writes and added %d gained rows",
                    walk.reason,
                    missed,
                    repairs.gained,
                )
        if self.feed.open:
            if self.phase != "live":
                # The load's objects stay as long as the keeper: keep full collections
                # from walking them (see workers.worker.serve).
                gc.freeze()
            self.phase = "live"
            self._exact_reason = ""
        self._write_state(now, full=True)

    def _ownership_changed(self, now: int) -> None:
        self._ownership_generation = self.core.ownership.generation
        self._top.drop()
        dropped = self.core.drop_unowned()
        log.info("keeper: ownership changed; dropped %d rows no longer owned", dropped)
        if self._walk is not None:
            self.core.abandon_walk(self._walk)
            self._walk = None
        self._begin_walk(now, "membership" if self._loaded else "load")

    # -- publishing ----------------------------------------------------------------

    def _claiming(self) -> bool:
        """Claims have taken entries from the live generation."""
        published = self._publisher.stats.last_count
        return published > 0 and self.ring.remaining() < published

    def _drained(self, now: int) -> bool:
        """Claims took the ring below its refill mark, and the last publish is not too new.

        The gap grows with what a publish costs (it reads past every leased row ranked
        above the last one kept, so a fleet with many keys in flight makes it slower):
        refills take at most 1 / REFILL_COST_SHARE of the keeper's time, and of the GIL it
        shares with worker 0's claims.
        """
        stats = self._publisher.stats
        gap_ms = max(
            self.config.refill_min_gap_s * 1000,
            REFILL_COST_SHARE * stats.last_duration_us / 1000,
        )
        return (
            stats.last_at is not None
            and stats.last_count > 0
            and now - stats.last_at >= gap_ms
            and self.ring.remaining() < stats.last_count * self.config.refill_below
        )

    def _publish_now(self, now: int, refill: bool = False) -> None:
        keys = self._publisher.publish(now, refill=refill)
        if isinstance(keys, PublishFailed):
            self._set_status(now, "stalled", keys.reason)
            return
        self._heartbeat_at = now
        if self._load.first_publish_at is None:
            self._load = msgspec.structs.replace(self._load, first_publish_at=now)
        if self.status != "ready":
            self._set_status(now, "ready", "publishing")
        checked = self._top.after_publish(keys, now, self._drain)
        if checked is not None:
            self._publisher.count_top_check(checked)
        if now >= self._next_cursor_save:
            self._next_cursor_save = now + int(self.config.cursor_save_interval_s * 1000)
            self._save_cursor()
        self._write_state(self.clock())

    def _save_cursor(self) -> None:
        try:
            self.feed.save()
        except Exception as exc:
            self._feed_failed(exc, self.clock())

    def _set_status(self, now: int, status: Status, reason: str) -> None:
        changed = status != self.status
        self.status = status
        self.status_reason = reason
        if changed:
            self._write_state(now, full=True)

    # -- queue-state ---------------------------------------------------------------

    def _live(self, now: int) -> tuple[bool, str]:
        if not self._started:
            return False, "not started"
        if self.status == "stalled":
            return False, self.status_reason
        if self._heartbeat_at == 0:
            return True, "starting: first publish pending"
        return True, "publishing"

    def _exact(self) -> bool:
        return self._loaded and self.feed.open and self.phase == "live"

    def _trust(self, now: int, counts_at: int) -> TrustGroup:
        live, reason = self._live(now)
        counters = self.core.counters
        return TrustGroup(
            live=live,
            live_reason=reason,
            phase=self.phase,
            exact=self._exact(),
            exact_reason="" if self._exact() else self._exact_reason,
            # Before the first publish the heartbeat is the keeper's own: it is running.
            heartbeat_at=self._heartbeat_at or now,
            stall_after_ms=int(self.config.stall_after_s * 1000),
            counts_at=counts_at,
            counts_max_age_ms=int(2 * self.config.report_interval_s * 1000 + 1000),
            feed_lag_ms=max(0, now - self.feed.caught_up_at) if self.feed.open else -1,
            publish_age_ms=-1 if self._heartbeat_at == 0 else max(0, now - self._heartbeat_at),
            feed_reopens=self.feed.reopens,
            resyncs=self._resyncs,
            reclassifications=counters.reclassifications,
            rows_reclassified=counters.rows_reclassified,
            events=counters.events,
            held=len(self.core.queue),
            unreadable=counters.unreadable,
            memory_bytes=self._memory_bytes,
            load=self._load,
            publish=self._publisher.stats,
            verification=self._verify,
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
            return build_queue_state(
                node=self.node,
                now_ms=now,
                counts=count_queue(queue, now),
                classes=self.core.classes,
                flow=self.core.flow.minutes(now),
                leases=self._lease_counts(now),
                status=self.status,
                status_reason=self.status_reason,
                trust=self._trust(now, now),
                earliest_claimable_at=queue.earliest_claimable(now, blocked),
                rows_max=self.config.class_rows_max,
            )
        last = self._state
        return msgspec.structs.replace(
            last,
            now=msgspec.structs.replace(
                last.now, status=self.status, status_reason=self.status_reason
            ),
            trust=self._trust(now, last.trust.counts_at),
        )

    def _write_state(self, now: int, *, full: bool = False) -> None:
        try:
            state = self.queue_state(now, full=full)
            self._state = state
            payload = encode_queue_state(state)
            try:
                self.state_buffer.write(payload, now)
            except ValueError:
                # Too large for the buffer: drop the per-class and per-route detail.
                trimmed = msgspec.structs.replace(
                    state,
                    lateness=msgspec.structs.replace(
                        state.lateness, classes=[], by_route={}, classes_truncated=True
                    ),
                )
                self.state_buffer.write(encode_queue_state(trimmed), now)
            self._state_writes += 1
        except Exception:
            self._state_write_failures += 1
            log.exception("keeper: writing queue-state failed")
        self._write_statistics(now)

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
        live, _ = self._live(self.clock())
        return KeeperStatistics(
            phase=self.phase,
            status=self.status,
            status_reason=self.status_reason,
            live=live,
            exact=self._exact(),
            held=len(core.queue),
            classes=len(core.classes),
            buckets=len(core.queue.buckets),
            tallies=self._tallies,
            memory_bytes=self._memory_bytes,
            events=counters.events,
            route_events=counters.route_events,
            settings_events=counters.settings_events,
            reclassifications=counters.reclassifications,
            rows_reclassified=counters.rows_reclassified,
            unreadable=counters.unreadable,
            collisions=counters.collisions,
            top_checks_waited=self._top.waited,
            walk_chunks_waited=self._walk_chunks_waited,
            feed_failures=self.feed.failures,
            feed_reopens=self.feed.reopens,
            cursor_resets=self.feed.cursor_resets,
            resyncs=self._resyncs,
            walk_errors=self._walk_errors,
            verifications=self._verify.walks,
            state_writes=self._state_writes,
            state_write_failures=self._state_write_failures,
            statistics_write_failures=self._statistics_write_failures,
            load=self._load,
            publish=self._publisher.stats,
            verification=self._verify,
            repairs=core.repairs.snapshot(),
            short_slice=self._short_slice,
            feed=self.feed.statistics(),
        )
