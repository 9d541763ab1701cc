"""The keeper's lifecycle as a machine with no I/O: told what happened and when, it
answers what to do next.

It owns the keeper's phase and status, every deadline of its loop (publish, refill,
report, verification, cursor save, member list, walk retry, the drains before a
walk's sweep and in a top check), a clustered keeper's wait to be admitted before it
loads, which walk runs and why, the trust it reports (live, exact, and why not, and
how old its counts may grow) and when a queue-state record too large for its buffer
is cut. It never reads a store, a feed, shared memory or a clock: the runner
(keeper/runner.py) does the I/O each action names, drives the core as told, and
reports the outcome as an event.

Two calls, in the manner of h11:

- `next_action(now, remaining)` walks one round of the loop, an action at a time,
  and ends the round with `Wait`. A round is bounded (one walk chunk or drop chunk,
  the feed up to the next publish, a publish or refill, a report), so the publish
  every second is never starved by a long walk or a burst of events. `remaining`
  is what the ring still holds: claims take entries without an event to say so.
- `handle(event, now)` takes an outcome and answers the actions it calls for at
  once, in order.

An event is an action's outcome, told once the action is over: an action never
raises an event in its middle. A feed that fails in a drain (the drain's own, a
walk's sweep's, a top check's) ends that action, and the failure is its outcome.
The runner performs what `handle` answers ahead of everything still pending, so a
failed feed drops the pending reads before anything else runs.

A clustered keeper first waits to be admitted: it reads the member list until it
is in it and, when peers are named, has seen one of them live or waited
`peer_wait_s` (ownership is not knowable before), saying in queue-state why it
waits. The order of a start: write queue-state (unready, starting), subscribe at the
feed's head, read routes and the default cadence (so a change after the
subscription arrives as an event), then walk the table by primary key in chunks,
publishing from the first round on. A failed feed is reopened at its backoff
(keeper/feed.py keeps it) and the table walked again to repair whatever the gap
hid; the keeper is not exact until that walk ends. It never reloads: settings
changes reclassify in memory, and an ownership change drops rows in chunks and
walks only when rows may have moved here.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from keeper.config import KeeperConfig
from keeper.state import LoadStats, Phase, PublishStats, Status, VerifyStats
from keeper.walk import WalkReason, WalkSummary

# A refill waits at least this many times the last publish's duration (see _drained).
REFILL_COST_SHARE = 5
# Rows dropped per round after an ownership change (KeeperCore.drop_unowned): a few
# milliseconds of the keeper's loop, between which it follows the feed and publishes.
DROP_CHUNK = 2_000
# Before loading, a clustered keeper reads the member list again this often (s), and
# after a failed read, this long after it.
MEMBERS_RETRY_S = 0.5
MEMBERS_ERROR_RETRY_S = 1.0
# Before a walk's sweep the feed is drained for up to this long (ms). The sweep needs
# only what the chunks' reads saw, which each chunk waited for; the drain brings the
# feed nearer the present before the keeper says it is exact.
SWEEP_DRAIN_MS = 1000
# After a top check's read the feed is drained for up to this long (ms): usually the
# read is then covered and judged at once, and a busy feed is kept ahead of publishing.
TOP_CHECK_DRAIN_MS = 1000


# -- actions: what the runner is to do ---------------------------------------------


class OpenFeed(msgspec.Struct, frozen=True):
    """Subscribe (at the cursor reached when `resume`, else at the head), then read the
    routes and the default cadence. Answer FeedOpened or FeedFailed."""

    resume: bool


class AwaitMembers(msgspec.Struct, frozen=True):
    """Before loading: read the member list with the live hand-overs, keeping the read
    for Admit. Answer MembersSeen, or MembersUnreadable."""


class Admit(msgspec.Struct, frozen=True):
    """Take the member list AwaitMembers read into the cluster view: ownership is
    known, and loading starts. `peers_unseen`: the wait for a named peer ran out."""

    peers_unseen: bool


class ReadMembers(msgspec.Struct, frozen=True):
    """Read the member list into the cluster view. Answer MembersRead, or nothing if the
    read failed (the view counts the failure)."""


class MarkUnowned(msgspec.Struct, frozen=True):
    """Drop a waiting top-check read and mark the held rows no longer owned. Answer
    Marked."""


class DropUnowned(msgspec.Struct, frozen=True):
    """Drop up to `limit` marked rows. Answer Dropped."""

    limit: int


class BeginWalk(msgspec.Struct, frozen=True):
    """Open a walk of the table (forgetting any chunk read for an earlier one)."""

    reason: WalkReason


class WalkChunk(msgspec.Struct, frozen=True):
    """Read the walk's next chunk of `rows` rows, unless one is read already; apply it once
    the feed has delivered what the read saw (a walk that judges nothing need not wait).
    Answer ChunkApplied, ChunkWaiting or ChunkFailed."""

    rows: int


class FinishWalk(msgspec.Struct, frozen=True):
    """Drain the feed for up to `drain_ms`, then sweep the walk. Answer WalkFinished,
    or FeedFailed if the feed failed in the drain (the walk is then not swept)."""

    drain_ms: int


class AbandonWalk(msgspec.Struct, frozen=True):
    """Stop the walk without its sweep."""


class DropTopCheck(msgspec.Struct, frozen=True):
    """Forget a waiting top-check read unjudged."""


class Drain(msgspec.Struct, frozen=True):
    """Apply the feed until it is empty or `until_ms`. Answer Drained."""

    until_ms: int


class Publish(msgspec.Struct, frozen=True):
    """Publish the best rows (`refill`: early, because claims drained the ring). Answer
    Published or PublishRefused."""

    refill: bool


class CheckTop(msgspec.Struct, frozen=True):
    """Take or judge the top check's read of the keys just published, draining the feed
    for up to `drain_ms` after a new read. Answer FeedFailed if the feed failed in that
    drain (the read then waits unjudged)."""

    drain_ms: int


class SaveCursor(msgspec.Struct, frozen=True):
    """Save the feed's cursor."""


class WriteState(msgspec.Struct, frozen=True):
    """Write queue-state (counts taken afresh when `full`) and the statistics record.
    `trim`: the record as last taken, without its per-class and per-route detail
    (keeper.report.trimmed_queue_state). Answer StateTooLarge if the record (untrimmed)
    is too large for its buffer; a failure otherwise is counted only."""

    full: bool = False
    trim: bool = False


class SettleAfterLoad(msgspec.Struct, frozen=True):
    """Live for the first time since loading: what the load built stays as long as the
    keeper, so keep full collections from walking it; what it freed goes back to the OS."""


class Wait(msgspec.Struct, frozen=True):
    """The round is over: wait this long (s) for the feed, then start the next."""

    seconds: float


Action = (
    OpenFeed
    | AwaitMembers
    | Admit
    | ReadMembers
    | MarkUnowned
    | DropUnowned
    | BeginWalk
    | WalkChunk
    | FinishWalk
    | AbandonWalk
    | DropTopCheck
    | Drain
    | Publish
    | CheckTop
    | SaveCursor
    | WriteState
    | SettleAfterLoad
    | Wait
)


# -- events: what happened ----------------------------------------------------------


class Started(msgspec.Struct, frozen=True):
    """The keeper's thread began."""


class MembersSeen(msgspec.Struct, frozen=True):
    live: frozenset[str]  # the nodes the member list says are live


class MembersUnreadable(msgspec.Struct, frozen=True):
    error: str


class FeedOpened(msgspec.Struct, frozen=True):
    pass


class FeedFailed(msgspec.Struct, frozen=True):
    """The feed failed (at any point, in any drain) and is closed until `reopen_at`."""

    error: str  # the exception's type name
    reopen_at: int


class MembersRead(msgspec.Struct, frozen=True):
    view_changed: bool  # the live set changed
    ownership_changed: bool  # and with it the rows this node owns


class Marked(msgspec.Struct, frozen=True):
    rows: int  # held rows no longer owned, to drop
    gains: bool  # the change may have moved rows here


class Dropped(msgspec.Struct, frozen=True):
    left: bool  # marked rows are still held


class ChunkFailed(msgspec.Struct, frozen=True):
    pass


class ChunkWaiting(msgspec.Struct, frozen=True):
    """A chunk is read; the feed has yet to deliver what the read saw."""


class ChunkApplied(msgspec.Struct, frozen=True):
    rows: int  # in this chunk
    walk: WalkSummary  # the walk so far


class WalkFinished(msgspec.Struct, frozen=True):
    walk: WalkSummary


class Drained(msgspec.Struct, frozen=True):
    emptied: bool  # False: stopped at the deadline with more to read


class Published(msgspec.Struct, frozen=True):
    stats: PublishStats  # the publisher's, after this publish


class PublishRefused(msgspec.Struct, frozen=True):
    reason: str


class StateTooLarge(msgspec.Struct, frozen=True):
    """The queue-state record did not fit its buffer, and was not written."""


Event = (
    Started
    | MembersSeen
    | MembersUnreadable
    | FeedOpened
    | FeedFailed
    | MembersRead
    | Marked
    | Dropped
    | ChunkFailed
    | ChunkWaiting
    | ChunkApplied
    | WalkFinished
    | Drained
    | Published
    | PublishRefused
    | StateTooLarge
)

# The round's stages, in order (see next_action).
_REOPEN, _MEMBERS, _WORK, _DRAIN, _PUBLISH, _REPORT, _VERIFY, _END = range(8)


class Lifecycle:
    def __init__(
        self,
        config: KeeperConfig,
        *,
        members_poll_ms: int | None = None,
        node: str = "local",
        peers: Sequence[str] = (),
        peer_wait_s: float = 0.0,
    ) -> None:
        """`members_poll_ms` makes this a clustered keeper's: it reads the member list
        this often, and ownership can change under it; before it loads, it waits to see
        its `node` live and up to `peer_wait_s` to see one of `peers` live."""
        self.config = config
        self.members_poll_ms = members_poll_ms
        self.node = node
        self.peers = list(peers)
        self.peer_wait_s = peer_wait_s
        self.phase: Phase = "starting"
        self.status: Status = "unready"
        self.status_reason = "the keeper has not published yet"
        self.exact_reason = "loading"
        self.started = False  # admitted and under way
        self.awaiting_since: int | None = None  # when the wait to be admitted began
        self.loaded = False
        self.feed_open = False
        self.reopen_at = 0
        self.walk: WalkReason | None = None  # the walk under way
        self.dropping = False  # rows no longer owned are still held
        self.heartbeat_at = 0  # the last publish (0: none yet)
        self.published = PublishStats()  # as of the last publish that went through
        self.load = LoadStats()
        self.verify = VerifyStats()
        self.resyncs = 0
        self.walk_errors = 0
        self.walk_chunks_waited = 0
        self.next_publish = 0
        self.next_report = 0
        self.next_verify = 0
        self.next_cursor_save = 0
        self.next_members = 0
        self.walk_retry_at = 0
        self._chunk_waiting = False  # the chunk read waits for the feed (counted once)
        self._stage = _REOPEN
        self._queued: list[Action] = []  # the rest of a stage's actions, in order
        self._busy = False  # the round did work that may have more to do at once
        self._chunked = False  # the round took a walk chunk

    @property
    def clustered(self) -> bool:
        return self.members_poll_ms is not None

    # -- trust -----------------------------------------------------------------------

    def live(self) -> tuple[bool, str]:
        """Whether the keeper vouches for itself as running, and why (readers also judge
        its heartbeat: a stalled keeper cannot say it has stalled)."""
        if not self.started:
            return False, "not started"
        if self.status == "stalled":
            return False, self.status_reason
        if self.heartbeat_at == 0:
            return True, "starting: first publish pending"
        return True, "publishing"

    @property
    def counts_max_age_ms(self) -> int:
        """How old queue-state's counts may be before readers distrust them: they are
        taken at each full report, so two report intervals, and a second for a slow one."""
        return _ms(2 * self.config.report_interval_s) + 1000

    @property
    def exact(self) -> bool:
        """Whether queue-state's counts are the table's: loaded, the feed open, and no
        resync or rebalancing under way (a verification walk leaves them exact)."""
        return self.loaded and self.feed_open and self.phase == "live"

    # -- before the start --------------------------------------------------------------

    def _members_wait(self, live: frozenset[str], waited_ms: int) -> str | None:
        """Why a clustered keeper may not load yet, having seen `live` after waiting
        `waited_ms`; None when it may."""
        waiting = [p for p in self.peers if p not in live]
        if waiting and len(waiting) == len(self.peers) and waited_ms < self.peer_wait_s * 1000:
            return f"waiting to see a peer live ({', '.join(waiting)})"
        if self.node not in live:
            return "this node is not in the member list yet"
        return None

    def _waiting(self, reason: str) -> list[Action]:
        """Not admitted yet, for this reason: said in queue-state once."""
        if reason == self.status_reason:
            return []
        self.status_reason = self.exact_reason = reason
        return [WriteState(full=True)]

    def _start(self, now: int) -> list[Action]:
        self.started = True
        self.awaiting_since = None
        self.next_publish = now
        self.next_report = now + _ms(self.config.report_interval_s)
        self.next_verify = now + _ms(self.config.verify_interval_s)
        if self.members_poll_ms is not None:
            self.next_members = now + self.members_poll_ms
        return [WriteState(full=True), OpenFeed(resume=False)]

    # -- what happened -----------------------------------------------------------------

    def handle(self, event: Event, now: int) -> list[Action]:
        """Take what happened at `now`; the actions it calls for, to perform at once."""
        match event:
            case Started():
                if self.clustered:
                    self.awaiting_since = now
                    self.next_members = now + _ms(MEMBERS_RETRY_S)
                    return [AwaitMembers()]
                return self._start(now)
            case MembersSeen(live):
                assert self.awaiting_since is not None
                reason = self._members_wait(live, now - self.awaiting_since)
                if reason is not None:
                    self.next_members = now + _ms(MEMBERS_RETRY_S)
                    return self._waiting(reason)
                unseen = bool(self.peers) and not live.intersection(self.peers)
                return [Admit(peers_unseen=unseen), *self._start(now)]
            case MembersUnreadable(error):
                self.next_members = now + _ms(MEMBERS_ERROR_RETRY_S)
                return self._waiting(f"cannot read the member list ({error})")
            case FeedOpened():
                self.feed_open = True
                actions: list[Action] = []
                if self.walk is not None:
                    actions.append(AbandonWalk())
                    self.walk = None
                actions.append(DropTopCheck())
                return actions + self._begin_walk(now, "load" if not self.loaded else "resync")
            case FeedFailed(error, reopen_at):
                return self._feed_failed(error, reopen_at)
            case MembersRead(view_changed, ownership_changed):
                if view_changed:
                    self.next_publish = now  # republish under the new ownership at once
                return [MarkUnowned()] if ownership_changed else []
            case Marked(rows, gains):
                return self._ownership_changed(now, rows, gains)
            case Dropped(left):
                self.dropping = left
                if not left and self.walk is None:
                    return self._rebalanced(now)
                return []
            case ChunkFailed():
                self.walk_errors += 1
                self.walk_retry_at = now + _ms(self.config.feed_backoff_s)
                return []
            case ChunkWaiting():
                if not self._chunk_waiting:
                    self._chunk_waiting = True
                    self.walk_chunks_waited += 1
                return []
            case ChunkApplied(rows, walk):
                self._chunk_waiting = False
                if walk.reason == "load":
                    self.load = msgspec.structs.replace(
                        self.load,
                        rows=walk.rows,
                        chunks=walk.chunks,
                        unreadable=walk.unreadable,
                        skipped_touched=walk.repairs.skipped_touched,
                    )
                if rows < self._chunk_rows(walk.reason):
                    return [FinishWalk(drain_ms=SWEEP_DRAIN_MS)]
                return []
            case WalkFinished(walk):
                return self._walk_finished(now, walk)
            case Drained(emptied):
                self._busy = self._busy or not emptied
                return []
            case Published(stats):
                return self._published(now, stats)
            case PublishRefused(reason):
                return self._set_status("stalled", reason)
            case StateTooLarge():
                # Readers need the totals and the trust more than the detail: write the
                # record again without the per-class and per-route rows.
                return [WriteState(trim=True)]

    def _feed_failed(self, error: str, reopen_at: int) -> list[Action]:
        self.feed_open = False
        self.reopen_at = reopen_at
        # A reopened feed may start at the head: its position says nothing of what the
        # reads under way saw, so they are dropped unjudged (the resync walk reads afresh).
        actions: list[Action] = [DropTopCheck()]
        if self.walk is not None:
            actions.append(AbandonWalk())
            self.walk = None
        self.exact_reason = f"feed failed ({error}); reopening"
        if self.phase == "live":
            self.phase = "resyncing"
        actions.append(WriteState())
        return actions

    def _chunk_rows(self, reason: WalkReason) -> int:
        return self.config.load_chunk if reason == "load" else self.config.walk_chunk

    def _begin_walk(self, now: int, reason: WalkReason) -> list[Action]:
        self.walk = reason
        self._chunk_waiting = False
        if reason == "load":
            self.phase = "loading"
            self.exact_reason = "loading: walking the table"
            self.load = LoadStats(started_at=now)
        elif reason == "resync":
            self.phase = "resyncing"
            self.resyncs += 1
            self.exact_reason = "resyncing: walking the table after a feed gap"
        else:
            if reason == "membership":
                self.phase = "rebalancing"
                self.exact_reason = (
                    "rebalancing: walking the table for rows the new members moved here"
                )
            self.verify = msgspec.structs.replace(
                self.verify, running=True, last_reason=reason, last_started_at=now
            )
        return [BeginWalk(reason), WriteState()]

    def _walk_finished(self, now: int, walk: WalkSummary) -> list[Action]:
        self.walk = None
        self._chunk_waiting = False
        if walk.reason == "load":
            self.loaded = True
            self.load = msgspec.structs.replace(self.load, finished_at=now)
        else:
            self.verify = VerifyStats(
                walks=self.verify.walks + 1,
                running=False,
                last_reason=walk.reason,
                last_started_at=walk.started_at,
                last_finished_at=now,
                last_rows=walk.rows,
                last_repairs=walk.repairs,
            )
        actions: list[Action] = []
        if self.feed_open and not self.dropping:
            if self.phase != "live":
                actions.append(SettleAfterLoad())
                self._republish_exact(now)
            self.phase = "live"
            self.exact_reason = ""
        actions.append(WriteState(full=True))
        return actions

    def _republish_exact(self, now: int) -> None:
        """Exact again: publish at once. A ring published while not exact vouches for no
        view (shm.marks), so until the next publish claims read every granted row back."""
        self.next_publish = now

    def _ownership_changed(self, now: int, marked: int, gains: bool) -> list[Action]:
        self.dropping = marked > 0
        actions: list[Action] = []
        if self.walk is not None:
            actions.append(AbandonWalk())
            self.walk = None
        elif self.loaded and self.clustered and not gains:
            # Only newcomers: they took keys from this node and gave it none, so once the
            # rows they took are dropped, what it holds is its share: nothing to walk for.
            if marked:
                self.phase = "rebalancing"
                self.exact_reason = "rebalancing: dropping the rows the new members took"
            return [WriteState(full=True)]
        return actions + self._begin_walk(now, "membership" if self.loaded else "load")

    def _rebalanced(self, now: int) -> list[Action]:
        """The marked rows are dropped and no walk is left: exact again."""
        if self.loaded and self.feed_open and self.phase == "rebalancing":
            self.phase = "live"
            self.exact_reason = ""
            self._republish_exact(now)
            return [WriteState(full=True)]
        return []

    def _published(self, now: int, stats: PublishStats) -> list[Action]:
        self.published = stats
        self.heartbeat_at = now
        if self.load.first_publish_at is None:
            self.load = msgspec.structs.replace(self.load, first_publish_at=now)
        actions: list[Action] = []
        if self.status != "ready":
            actions += self._set_status("ready", "publishing")
        actions.append(CheckTop(drain_ms=TOP_CHECK_DRAIN_MS))
        if now >= self.next_cursor_save:
            self.next_cursor_save = now + _ms(self.config.cursor_save_interval_s)
            actions.append(SaveCursor())
        actions.append(WriteState())
        return actions

    def _set_status(self, status: Status, reason: str) -> list[Action]:
        changed = status != self.status
        self.status = status
        self.status_reason = reason
        return [WriteState(full=True)] if changed else []

    # -- what to do next ---------------------------------------------------------------

    def next_action(self, now: int, remaining: int) -> Action:
        """The round's next action at `now`, with `remaining` entries left in the ring;
        Wait ends the round, and the next call starts another."""
        config = self.config
        if self._queued:
            return self._queued.pop(0)
        if self.awaiting_since is not None:
            # A clustered keeper waiting to be admitted: nothing but the member list.
            if now >= self.next_members:
                self.next_members = now + _ms(MEMBERS_RETRY_S)
                return AwaitMembers()
            return Wait(max(0.0, (self.next_members - now) / 1000))
        while True:
            stage = self._stage
            self._stage += 1
            if stage == _REOPEN:
                self._busy = self._chunked = False
                if not self.feed_open and now >= self.reopen_at:
                    return OpenFeed(resume=True)
            elif stage == _MEMBERS:
                if self.members_poll_ms is not None and now >= self.next_members:
                    self.next_members = now + self.members_poll_ms
                    return ReadMembers()
            elif stage == _WORK:
                if self.dropping:
                    # Before the walk goes on: its sweep would count the marked rows as
                    # missed deletes. The feed is drained between chunks.
                    self._busy = True
                    return DropUnowned(DROP_CHUNK)
                if self.walk is not None and now >= self.walk_retry_at:
                    self._chunked = True
                    return WalkChunk(self._chunk_rows(self.walk))
            elif stage == _DRAIN:
                if self._chunked and self.walk is not None:
                    self._busy = True
                return Drain(until_ms=self.next_publish)
            elif stage == _PUBLISH:
                if now >= self.next_publish:
                    self.next_publish = max(
                        self.next_publish + _ms(config.publish_interval_s), now + 1
                    )
                    return Publish(refill=False)
                if self._drained(now, remaining):
                    return Publish(refill=True)
            elif stage == _REPORT:
                if now >= self.next_report:
                    self.next_report = now + _ms(config.report_interval_s)
                    return WriteState(full=True)
            elif stage == _VERIFY:
                if now >= self.next_verify and self.walk is None and self.loaded:
                    self.next_verify = now + _ms(config.verify_interval_s)
                    first, *self._queued = self._begin_walk(now, "verify")
                    return first
            else:
                self._stage = _REOPEN
                return Wait(self._wait_s(now, remaining))

    def _drained(self, now: int, remaining: int) -> bool:
        """Claims took the ring below its refill mark, and the last publish is not too new.

        The gap grows with what a publish costs (it reads past every leased row ranked
        above the last one kept, so a fleet with many keys in flight makes it slower):
        refills take at most 1 / REFILL_COST_SHARE of the keeper's time, and of the GIL it
        shares with worker 0's claims. The cost is the publish's CPU, not its wall time:
        while worker 0's event loop serves claims, a publish waits for the GIL several
        times its own CPU, and a gap taken from that would hold back the very claims
        that waited.
        """
        stats = self.published
        gap_ms = max(
            self.config.refill_min_gap_s * 1000,
            REFILL_COST_SHARE * stats.last_cpu_us / 1000,
        )
        return (
            stats.last_at is not None
            and stats.last_count > 0
            and now - stats.last_at >= gap_ms
            and remaining < stats.last_count * self.config.refill_below
        )

    def _wait_s(self, now: int, remaining: int) -> float:
        if self._busy:
            return 0.0
        wait_s = max(0.0, (self.next_publish - now) / 1000)
        stats = self.published
        if stats.last_count > 0 and stats.last_at is not None:
            # Claims take entries without a feed event to wake the keeper, and can drain
            # a whole publish long before the next one is due. While they take entries,
            # look again soon; while the ring lies untouched, look again after as long
            # again as it has lain so, so that an idle node wakes a few times an interval.
            look_s = self.config.refill_min_gap_s
            if remaining >= stats.last_count:
                look_s = max(look_s, (now - stats.last_at) / 1000)
            wait_s = min(wait_s, look_s)
        return wait_s


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
