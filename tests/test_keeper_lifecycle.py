"""The keeper's lifecycle, driven with events and times only: no store, feed, ring or
thread. A small script stands in for the runner: it answers each action with the
outcome a test chose (by default, the one that goes well)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import msgspec

from keeper.config import KeeperConfig
from keeper.lifecycle import (
    DROP_CHUNK,
    REFILL_COST_SHARE,
    SWEEP_DRAIN_MS,
    TOP_CHECK_DRAIN_MS,
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
from keeper.state import Phase, PublishStats, Status
from keeper.walk import RepairCounts, WalkReason, WalkSummary

NOW = 1_800_000_000_000
CONFIG = KeeperConfig(walk_chunk=10, load_chunk=10, best_k=100, verify_interval_s=3600, top_check=5)

Answer = Callable[[Action], Event | None]


def summary(reason: WalkReason, rows: int, started_at: int = NOW) -> WalkSummary:
    return WalkSummary(
        reason=reason,
        started_at=started_at,
        finished_at=None,
        rows=rows,
        chunks=(rows + 9) // 10,
        loaded=rows if reason == "load" else 0,
        unreadable=0,
        repairs=RepairCounts(),
    )


class Script:
    """The runner's part, scripted: a table of `rows` rows walked in chunks, a feed
    that drains to empty, publishes of `published` keys. `answers` overrides the
    outcome of an action type once (a queue per type)."""

    def __init__(self, lc: Lifecycle, rows: int = 35, published: int = 35) -> None:
        self.lc = lc
        self.rows = rows
        self.published = published
        self.now = NOW
        self.done: list[Action] = []
        self.walked = 0  # rows the current walk has read
        self.chunks: list[tuple[WalkReason, int]] = []  # each WalkChunk's walk and rows
        self.walk: WalkReason | None = None
        self.stats = PublishStats()
        self.overrides: dict[type, list[Event | None]] = {}
        self.dropping_left = 0  # DropUnowned chunks before the marked rows are gone

    def once(self, action: type, outcome: Event | None) -> None:
        self.overrides.setdefault(action, []).append(outcome)

    def tell(self, event: Event) -> None:
        """Hand an outcome to the lifecycle and do what it answers, as the runner does:
        each action's outcome is told once the action is over, and what that answers
        goes ahead of the rest."""
        pending = deque(self.lc.handle(event, self.now))
        while pending:
            outcome = self.do(pending.popleft())
            if outcome is not None:
                pending.extendleft(reversed(self.lc.handle(outcome, self.now)))

    def do(self, action: Action) -> Event | None:
        """Do an action; its outcome."""
        self.done.append(action)
        queued = self.overrides.get(type(action))
        if queued:
            return queued.pop(0)
        match action:
            case OpenFeed():
                return FeedOpened()
            case AwaitMembers():
                return MembersSeen(frozenset({self.lc.node}))
            case BeginWalk(reason):
                self.walk, self.walked = reason, 0
            case AbandonWalk():
                self.walk = None
            case WalkChunk(rows):
                assert self.walk is not None
                self.chunks.append((self.walk, rows))
                chunk = min(rows, self.rows - self.walked)
                self.walked += chunk
                return ChunkApplied(rows=chunk, walk=summary(self.walk, self.walked))
            case FinishWalk():
                assert self.walk is not None
                walk, self.walk = summary(self.walk, self.walked), None
                return WalkFinished(walk)
            case Drain():
                return Drained(emptied=True)
            case Publish(refill):
                self.stats = msgspec.structs.replace(
                    self.stats,
                    publishes=self.stats.publishes + 1,
                    refills=self.stats.refills + refill,
                    last_at=self.now,
                    last_count=self.published,
                )
                return Published(self.stats)
            case DropUnowned():
                self.dropping_left = max(0, self.dropping_left - 1)
                return Dropped(left=self.dropping_left > 0)
        return None

    def round(self, remaining: int | None = None, advance_ms: int = 0) -> float:
        """One round of the loop; returns its wait (s). The ring is full unless told."""
        self.now += advance_ms
        self.done = []
        while True:
            action = self.lc.next_action(
                self.now, self.published if remaining is None else remaining
            )
            if isinstance(action, Wait):
                return action.seconds
            outcome = self.do(action)
            if outcome is not None:
                self.tell(outcome)

    def kinds(self) -> list[str]:
        return [type(a).__name__ for a in self.done]


def where(lc: Lifecycle) -> tuple[Phase, Status, bool]:
    """Phase, status and exactness as of now (read afresh, after the events since)."""
    return lc.phase, lc.status, lc.exact


def started(config: KeeperConfig = CONFIG, rows: int = 35) -> Script:
    script = Script(Lifecycle(config), rows=rows)
    script.tell(Started())
    return script


def live(config: KeeperConfig = CONFIG, rows: int = 35) -> Script:
    script = started(config, rows)
    while script.lc.phase != "live":
        script.round()
    return script


def test_a_start_writes_unready_opens_the_feed_at_the_head_and_walks_to_load() -> None:
    script = Script(Lifecycle(CONFIG))
    lc = script.lc
    assert lc.live() == (False, "not started") and lc.phase == "starting"
    script.tell(Started())
    assert script.done == [
        WriteState(full=True),
        OpenFeed(resume=False),
        DropTopCheck(),
        BeginWalk("load"),
        WriteState(),
    ]
    assert where(lc) == ("loading", "unready", False)
    assert lc.exact_reason == "loading: walking the table" and lc.load.started_at == NOW
    assert lc.live() == (True, "starting: first publish pending")


def test_the_first_round_reads_a_chunk_then_publishes_and_the_load_ends_live() -> None:
    script = started()
    lc = script.lc
    assert script.round() == 0.0, "the walk goes on: no wait"
    assert script.kinds()[:4] == ["WalkChunk", "Drain", "Publish", "WriteState"]
    assert script.done[1] == Drain(until_ms=NOW) and script.done[2] == Publish(refill=False)
    assert lc.status == "ready" and lc.status_reason == "publishing"
    assert lc.live() == (True, "publishing") and lc.load.first_publish_at == NOW
    assert lc.phase == "loading" and not lc.exact
    for _ in range(3):
        script.round()
    assert "FinishWalk" in script.kinds()
    assert where(lc) == ("live", "ready", True) and lc.exact_reason == "" and lc.loaded
    assert SettleAfterLoad() in script.done and WriteState(full=True) in script.done
    assert lc.load.rows == 35 and lc.load.chunks == 4 and lc.load.finished_at == NOW
    assert script.round() > 0, "loaded, published: wait for the next tick"


def test_becoming_exact_publishes_at_once_after_a_load_and_after_a_resync() -> None:
    """A ring published while the keeper was not exact vouches for no view (shm.marks):
    until the next publish, claims read every granted row back."""
    script = started()
    script.round()  # the load's first chunk and the first publish
    due = script.lc.next_publish  # the interval's next
    while "FinishWalk" not in script.kinds():
        script.round(advance_ms=10)
    kinds = script.kinds()
    assert script.now < due and "Publish" in kinds[kinds.index("FinishWalk") :]
    script.round(advance_ms=10)
    script.tell(FeedFailed("ConnectionError", reopen_at=script.now + 100))
    script.round(advance_ms=100)  # reopened: the resync walks
    while "FinishWalk" not in script.kinds():
        script.round(advance_ms=10)
    kinds = script.kinds()
    assert script.lc.exact and "Publish" in kinds[kinds.index("FinishWalk") :]


def test_publishes_come_every_interval_and_a_late_one_does_not_bunch_up() -> None:
    script = live()
    lc = script.lc
    assert lc.next_publish == NOW + 1000
    # The ring untouched 400 ms: looked at again after as long, not past the publish.
    assert script.round(advance_ms=400) == 0.4
    assert script.round(advance_ms=400) == 0.2
    assert "Publish" not in script.kinds()
    script.round(advance_ms=200)
    assert Publish(refill=False) in script.done and lc.next_publish == NOW + 2000
    script.round(advance_ms=2500)  # a stall: one publish, not the ticks it missed
    assert script.kinds().count("Publish") == 1 and lc.next_publish == NOW + 3501
    script.round()
    assert "Publish" not in script.kinds()
    script.round(advance_ms=1)
    assert "Publish" in script.kinds() and lc.next_publish == NOW + 4501


def test_queue_state_is_rewritten_in_full_every_report_interval() -> None:
    script = live()
    script.round(advance_ms=4999)
    assert WriteState(full=True) not in script.done
    script.round(advance_ms=1)
    assert WriteState(full=True) in script.done
    assert script.lc.next_report == script.now + 5000


def test_a_ring_drained_by_claims_is_refilled_at_most_once_per_gap() -> None:
    config = msgspec.structs.replace(CONFIG, refill_below=0.25, refill_min_gap_s=0.02)
    script = live(config)
    script.round(advance_ms=1000)  # a publish of 35 keys at NOW + 1000
    assert script.round(remaining=20) == config.refill_min_gap_s, "claims: look again soon"
    script.round(remaining=8)  # below a quarter, but within the gap of the last publish
    assert "Publish" not in script.kinds()
    script.round(remaining=8, advance_ms=20)
    assert script.done[script.kinds().index("Publish")] == Publish(refill=True)
    script.round(remaining=35, advance_ms=20)
    assert "Publish" not in script.kinds()


def test_an_untouched_ring_is_looked_at_less_and_less_often_until_the_next_publish() -> None:
    """Claims take entries without waking the keeper, and may drain a whole publish well
    before the next: the keeper looks at the ring soon after a publish, then after as long
    again as it has lain untouched, never past the next publish."""
    config = msgspec.structs.replace(CONFIG, refill_min_gap_s=0.02, publish_interval_s=1.0)
    script = live(config)
    script.round(advance_ms=1000)  # a publish of 35 keys at NOW + 1000
    published_at, next_publish = script.now, script.lc.next_publish
    assert next_publish - published_at == 1000
    looks: list[float] = []
    while script.now < next_publish:
        wait_s = script.round(remaining=35, advance_ms=round(looks[-1] * 1000) if looks else 0)
        if "Publish" in script.kinds():
            break
        looks.append(wait_s)
    assert looks[:5] == [0.02, 0.02, 0.04, 0.08, 0.16], looks
    assert max(looks) <= (next_publish - published_at) / 1000
    assert len(looks) <= 8, "an idle node wakes a few times an interval, not every gap"
    assert script.round(remaining=35) == 0.02, "a new publish: the looks start over"
    script.round(remaining=35, advance_ms=20)
    assert script.round(remaining=30, advance_ms=20) == 0.02, "claims took some: look soon"


def test_a_slow_publish_spaces_the_refills_out() -> None:
    script = live()
    script.round(advance_ms=1000)
    script.lc.published = msgspec.structs.replace(
        script.lc.published, last_duration_us=10_000, last_cpu_us=10_000
    )
    script.round(remaining=2, advance_ms=20)
    assert "Publish" not in script.kinds(), "10 ms publishes: not before 50 ms"
    script.round(remaining=2, advance_ms=10 * REFILL_COST_SHARE - 20)
    assert Publish(refill=True) in script.done


def test_a_publish_that_waited_for_the_gil_does_not_space_the_refills_out() -> None:
    """A publish's wall time under claims is mostly its waits for worker 0's GIL: the
    refills are spaced by its CPU."""
    script = live()
    script.round(advance_ms=1000)
    script.lc.published = msgspec.structs.replace(
        script.lc.published, last_duration_us=40_000, last_cpu_us=1_000
    )
    script.round(remaining=2, advance_ms=20)
    assert Publish(refill=True) in script.done, "1 ms of CPU: refilled after refill_min_gap_s"


def test_a_failed_publish_stalls_the_status_and_the_next_one_restores_it() -> None:
    script = live()
    lc = script.lc
    script.once(Publish, PublishRefused("publish failed: OSError: gone"))
    script.round(advance_ms=1000)
    assert lc.status == "stalled" and lc.live() == (False, "publish failed: OSError: gone")
    assert script.kinds()[-1] == "WriteState" and WriteState(full=True) in script.done
    assert "CheckTop" not in script.kinds()
    script.round(advance_ms=1000)
    assert where(lc)[1] == "ready" and lc.live() == (True, "publishing")
    assert script.kinds()[script.kinds().index("Publish") :][:3] == [
        "Publish",
        "WriteState",
        "CheckTop",
    ]


def test_the_cursor_is_saved_after_a_publish_at_most_once_an_interval() -> None:
    config = msgspec.structs.replace(CONFIG, publish_interval_s=0.25)
    script = live(config)
    saves = 0
    for _ in range(8):
        script.round(advance_ms=250)
        saves += script.done.count(SaveCursor())
    assert saves == 2, "two seconds of publishes every 0.25 s"


def test_a_failed_feed_resyncs_after_its_backoff_and_is_exact_once_walked() -> None:
    script = live()
    lc = script.lc
    script.done = []
    script.tell(FeedFailed("ConnectionError", reopen_at=NOW + 100))
    assert script.done == [DropTopCheck(), WriteState()]
    assert lc.phase == "resyncing" and not lc.exact
    assert lc.exact_reason == "feed failed (ConnectionError); reopening"
    script.round(advance_ms=50)
    assert "OpenFeed" not in script.kinds()
    script.round(advance_ms=50)
    assert script.done[0] == OpenFeed(resume=True) and BeginWalk("resync") in script.done
    assert lc.resyncs == 1 and lc.exact_reason.startswith("resyncing")
    while where(lc)[0] != "live":
        script.round()
    assert lc.exact and lc.verify.walks == 1 and lc.verify.last_reason == "resync"
    assert SettleAfterLoad() in script.done, "live again after a resync"


def test_a_feed_failing_under_a_walk_abandons_it_and_the_reopen_walks_again() -> None:
    script = started()
    script.round()
    assert script.lc.walk == "load"
    script.tell(FeedFailed("OSError", reopen_at=NOW))
    assert AbandonWalk() in script.done and script.lc.walk is None
    assert script.lc.phase == "loading", "not live yet: no resync, the load starts again"
    script.round()
    assert BeginWalk("load") in script.done and script.lc.resyncs == 0


def test_a_feed_that_fails_at_the_start_leaves_the_keeper_starting() -> None:
    script = Script(Lifecycle(CONFIG))
    script.once(OpenFeed, FeedFailed("ConnectionError", reopen_at=NOW + 100))
    script.tell(Started())
    lc = script.lc
    assert lc.phase == "starting" and lc.status == "unready" and lc.walk is None
    assert lc.exact_reason == "feed failed (ConnectionError); reopening"
    script.round(advance_ms=100)
    assert script.done[0] == OpenFeed(resume=True) and where(lc)[0] == "loading"


def test_a_failed_chunk_read_is_retried_after_the_backoff() -> None:
    script = started()
    script.once(WalkChunk, ChunkFailed())
    script.round()
    lc = script.lc
    assert lc.walk_errors == 1 and lc.walk_retry_at == NOW + 100
    script.round(advance_ms=99)
    assert "WalkChunk" not in script.kinds()
    script.round(advance_ms=1)
    assert "WalkChunk" in script.kinds()


def test_a_chunk_waiting_for_the_feed_is_counted_once_and_keeps_the_loop_busy() -> None:
    script = started()
    for _ in range(3):
        script.once(WalkChunk, ChunkWaiting())
        assert script.round() == 0.0
    assert script.lc.walk_chunks_waited == 1
    script.round()
    script.once(WalkChunk, ChunkWaiting())
    script.round()
    assert script.lc.walk_chunks_waited == 2, "a new read, a new wait"


def test_a_drain_stopped_at_its_deadline_keeps_the_loop_busy() -> None:
    script = live()
    script.once(Drain, Drained(emptied=False))
    assert script.round() == 0.0
    assert script.round() > 0


def test_the_verification_walk_runs_every_interval_once_loaded_and_idle() -> None:
    config = msgspec.structs.replace(CONFIG, verify_interval_s=10)
    script = live(config)
    lc = script.lc
    script.round(advance_ms=9000)
    assert BeginWalk("verify") not in script.done
    script.round(advance_ms=1000)
    assert script.done[-2:] == [BeginWalk("verify"), WriteState()]
    assert lc.verify.running and lc.phase == "live" and lc.exact, "a check, not a gap"
    assert lc.next_verify == NOW + 20_000
    while lc.walk is not None:
        script.round()
    assert lc.verify.walks == 1 and not lc.verify.running and lc.verify.last_rows == 35


def test_a_load_reads_in_load_chunks_and_a_verification_in_walk_chunks() -> None:
    """A load lands each chunk on most buckets, so it reads bigger chunks than a walk
    that compares rows with what the keeper holds; each ends at its first short chunk."""
    config = msgspec.structs.replace(CONFIG, load_chunk=25, verify_interval_s=10)
    script = live(config)
    assert script.chunks == [("load", 25), ("load", 25)] and script.lc.load.rows == 35
    script.chunks.clear()
    script.round(advance_ms=10_000)
    while script.lc.walk is not None:
        script.round()
    assert script.chunks == [("verify", 10)] * 4 and script.lc.verify.last_rows == 35


def test_a_clustered_keeper_reads_the_member_list_until_it_is_in_it_then_starts() -> None:
    lc = Lifecycle(CONFIG, members_poll_ms=1000, node="a")
    assert lc.handle(Started(), NOW) == [AwaitMembers()]
    assert lc.live() == (False, "not started") and lc.phase == "starting"
    assert lc.handle(MembersSeen(frozenset({"b"})), NOW) == [WriteState(full=True)]
    assert lc.status_reason == lc.exact_reason == "this node is not in the member list yet"
    assert lc.next_action(NOW + 499, 0) == Wait(0.001), "nothing but the member list"
    assert lc.next_action(NOW + 500, 0) == AwaitMembers()
    assert lc.handle(MembersSeen(frozenset({"b"})), NOW + 500) == [], "the reason is said once"
    assert lc.handle(MembersSeen(frozenset({"a", "b"})), NOW + 1000) == [
        Admit(peers_unseen=False),
        WriteState(full=True),
        OpenFeed(resume=False),
    ]
    assert lc.started and lc.live() == (True, "starting: first publish pending")
    assert lc.next_members == NOW + 2000 and lc.next_publish == NOW + 1000


def test_a_clustered_keeper_waits_up_to_peer_wait_s_to_see_a_named_peer_live() -> None:
    lc = Lifecycle(CONFIG, members_poll_ms=1000, node="a", peers=["b", "c"], peer_wait_s=120)
    lc.handle(Started(), NOW)
    assert lc.handle(MembersSeen(frozenset({"a"})), NOW + 1000) == [WriteState(full=True)]
    assert lc.status_reason == "waiting to see a peer live (b, c)" and not lc.started
    assert lc.handle(MembersSeen(frozenset({"a"})), NOW + 119_999) == []
    admitted = lc.handle(MembersSeen(frozenset({"a"})), NOW + 120_000)
    assert admitted[0] == Admit(peers_unseen=True) and lc.started, "waited long enough"

    lc = Lifecycle(CONFIG, members_poll_ms=1000, node="a", peers=["b", "c"], peer_wait_s=120)
    lc.handle(Started(), NOW)
    lc.handle(MembersSeen(frozenset({"c"})), NOW)
    assert lc.status_reason == "this node is not in the member list yet", "a peer is live"
    assert lc.handle(MembersSeen(frozenset({"a", "c"})), NOW + 500)[0] == Admit(peers_unseen=False)


def test_an_unreadable_member_list_is_said_and_read_again_a_second_later() -> None:
    lc = Lifecycle(CONFIG, members_poll_ms=1000, node="a")
    lc.handle(Started(), NOW)
    assert lc.handle(MembersUnreadable("connection refused"), NOW) == [WriteState(full=True)]
    assert lc.status_reason == "cannot read the member list (connection refused)"
    assert lc.next_action(NOW + 999, 0) == Wait(0.001)
    assert lc.next_action(NOW + 1000, 0) == AwaitMembers()
    assert lc.handle(MembersSeen(frozenset({"a"})), NOW + 1000)[0] == Admit(peers_unseen=False)


def clustered_live() -> Script:
    script = Script(Lifecycle(CONFIG, members_poll_ms=1000, node="a"))
    script.tell(Started())
    while script.lc.phase != "live":
        script.round()
    return script


def test_the_member_list_is_read_every_poll_and_a_new_view_republishes_at_once() -> None:
    script = clustered_live()
    script.once(ReadMembers, MembersRead(view_changed=False, ownership_changed=False))
    script.round(advance_ms=999)
    assert "ReadMembers" not in script.kinds()
    script.round(advance_ms=1)
    assert "ReadMembers" in script.kinds() and "Publish" in script.kinds()
    script.once(ReadMembers, MembersRead(view_changed=True, ownership_changed=False))
    script.round(advance_ms=1000)
    assert script.lc.next_publish == script.now + 1000, "published at the read"
    assert script.kinds().index("ReadMembers") < script.kinds().index("Publish")


def test_newcomers_taking_rows_drop_them_in_chunks_then_the_keeper_is_exact_again() -> None:
    script = clustered_live()
    lc = script.lc
    script.once(ReadMembers, MembersRead(view_changed=True, ownership_changed=True))
    script.once(MarkUnowned, Marked(rows=5000, gains=False))
    script.dropping_left = 3
    assert script.round(advance_ms=1000) == 0.0
    assert script.kinds()[:3] == ["ReadMembers", "MarkUnowned", "WriteState"]
    assert DropUnowned(DROP_CHUNK) in script.done and BeginWalk("membership") not in script.done
    assert lc.phase == "rebalancing" and not lc.exact and lc.dropping
    assert lc.exact_reason == "rebalancing: dropping the rows the new members took"
    assert script.round() == 0.0 and lc.dropping
    script.round()
    assert not lc.dropping and lc.phase == "live" and lc.exact
    assert script.done[:2] == [DropUnowned(DROP_CHUNK), WriteState(full=True)]


def test_a_change_that_may_bring_rows_walks_for_them_and_is_exact_once_both_are_done() -> None:
    script = clustered_live()
    lc = script.lc
    script.once(ReadMembers, MembersRead(view_changed=True, ownership_changed=True))
    script.once(MarkUnowned, Marked(rows=10, gains=True))
    script.dropping_left = 2
    script.round(advance_ms=1000)
    assert BeginWalk("membership") in script.done and lc.phase == "rebalancing"
    assert lc.exact_reason.startswith("rebalancing: walking the table")
    assert "WalkChunk" not in script.kinds(), "the marked rows go first"
    while lc.walk is not None:
        script.round()
    assert where(lc) == ("live", "ready", True) and lc.verify.last_reason == "membership"


def test_an_ownership_change_during_a_walk_restarts_it() -> None:
    script = Script(Lifecycle(CONFIG, members_poll_ms=1000, node="a"))
    script.tell(Started())
    script.round()
    assert script.lc.walk == "load"
    script.once(ReadMembers, MembersRead(view_changed=True, ownership_changed=True))
    script.once(MarkUnowned, Marked(rows=0, gains=True))
    script.round(advance_ms=1000)
    assert script.kinds()[:4] == ["ReadMembers", "MarkUnowned", "AbandonWalk", "BeginWalk"]
    assert script.done[3] == BeginWalk("load") and script.lc.phase == "loading"


def test_the_top_check_follows_every_publish_and_is_dropped_when_the_feed_fails() -> None:
    script = live()
    script.round(advance_ms=1000)
    assert CheckTop(drain_ms=TOP_CHECK_DRAIN_MS) in script.done and TOP_CHECK_DRAIN_MS == 1000
    assert script.lc.handle(FeedFailed("OSError", reopen_at=NOW), script.now)[0] == DropTopCheck()


def test_a_walk_ends_with_a_drain_of_at_most_a_second_before_its_sweep() -> None:
    script = started()
    lc = script.lc
    assert lc.handle(ChunkApplied(rows=10, walk=summary("load", 10)), NOW) == [], "a full chunk"
    finish = lc.handle(ChunkApplied(rows=5, walk=summary("load", 15)), NOW)
    assert finish == [FinishWalk(drain_ms=SWEEP_DRAIN_MS)] and SWEEP_DRAIN_MS == 1000


def test_a_feed_failing_in_the_drain_before_the_sweep_abandons_the_walk_unswept() -> None:
    script = started()
    script.once(FinishWalk, FeedFailed("OSError", reopen_at=NOW + 100))
    while "FinishWalk" not in script.kinds():
        script.round()
    after = script.done[script.kinds().index("FinishWalk") + 1 :]
    assert after[:3] == [DropTopCheck(), AbandonWalk(), WriteState()], "before anything else"
    assert script.lc.walk is None and not script.lc.loaded and script.lc.phase == "loading"
    script.round(advance_ms=100)
    assert script.done[0] == OpenFeed(resume=True) and BeginWalk("load") in script.done


def test_counts_may_age_two_report_intervals_and_a_second() -> None:
    config = msgspec.structs.replace(CONFIG, report_interval_s=5)
    assert Lifecycle(config).counts_max_age_ms == 11_000


def test_a_record_too_large_for_its_buffer_is_written_again_trimmed() -> None:
    lc = live().lc
    assert lc.handle(StateTooLarge(), NOW) == [WriteState(trim=True)]
