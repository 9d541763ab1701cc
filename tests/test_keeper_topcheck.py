"""keeper/topcheck.py: the re-read of the top published rows, judged only once the feed
has delivered what the read saw, at most once a second a read; and, through the keeper, at
most once a minute a key."""

from __future__ import annotations

import msgspec
from keeper_helpers import NOW, ManualClock, MemoryStore, Rig

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.feed import Feed
from keeper.topcheck import TopCheck, TopChecked
from shm import key_hash

CONFIG = KeeperConfig(top_check=3, top_check_every_s=60)
KEYS = [b"/k9", b"/k8", b"/k7"]  # the most overdue first, as a publish offers them


def _nothing() -> bool:
    """A drain that applies nothing: the feed lags the read."""
    return True


class Setup:
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.store = MemoryStore()
        self.core = KeeperCore(CONFIG)
        self.feed = Feed(
            self.store, "keeper", poll_limit=100, backoff_s=1, backoff_max_s=1, clock=self.clock
        )
        self.feed.subscribe(self.clock(), resume=False)
        for i in range(10):
            self.store.put(f"/k{i}", NOW - 1000 * i)
        self.drain()
        self.top = TopCheck(self.core, self.store, self.feed, CONFIG, self.clock)

    def drain(self) -> bool:
        self.feed.drain(self.core.apply_events, self.clock() + 1000)
        return True


def _due(setup: Setup, key: bytes) -> int | None:
    held = setup.core.queue.held(key_hash(key))
    return None if held is None else held.due_at


def test_a_read_waits_for_the_feed_and_a_write_the_feed_delivers_is_no_repair() -> None:
    s = Setup()
    s.store.put("/k9", NOW + 5_000)  # written before the read, not yet delivered
    assert s.top.after_publish(KEYS, s.clock(), _nothing) is None
    assert s.top.waited == 1 and s.top.pending is not None
    assert s.top.after_publish(KEYS, s.clock(), _nothing) is None
    assert s.top.waited == 1, "a read that waits is counted once"
    s.drain()
    assert s.top.after_publish(KEYS, s.clock(), _nothing) == TopChecked(checked=3, repaired=0)
    assert _due(s, b"/k9") == NOW + 5_000 and s.top.pending is None


def test_a_write_the_feed_never_delivers_is_repaired() -> None:
    s = Setup()
    row = s.store.rows["/k8"]
    s.store.silent(msgspec.structs.replace(row, next_render_at=NOW + 9_000))
    assert s.top.after_publish(KEYS, s.clock(), s.drain) == TopChecked(checked=3, repaired=1)
    assert _due(s, b"/k8") == NOW + 9_000
    # Read a moment ago: not again within top_check_every_s, whatever is published.
    s.clock.advance(59_000)
    assert s.top.after_publish(KEYS, s.clock(), s.drain) is None and s.top.pending is None
    s.clock.advance(1_000)
    assert s.top.after_publish(KEYS, s.clock(), s.drain) == TopChecked(checked=3, repaired=0)


def test_refills_between_the_interval_publishes_take_no_read_of_their_own() -> None:
    """Claims draining the ring make a publish every few ms: the top check reads at the
    interval publishes' pace (top_check_read_every_s), not at each of those."""
    s = Setup()
    assert s.top.after_publish(KEYS, s.clock(), s.drain) == TopChecked(checked=3, repaired=0)
    refilled = [b"/k6", b"/k5", b"/k4"]  # what claims left for the next publish's top
    s.store.silent(None, key="/k6")  # would be a repair, if read
    s.clock.advance(999)
    assert s.top.after_publish(refilled, s.clock(), s.drain) is None and s.top.pending is None
    assert _due(s, b"/k6") is not None
    s.clock.advance(1)
    assert s.top.after_publish(refilled, s.clock(), s.drain) == TopChecked(checked=3, repaired=1)
    assert _due(s, b"/k6") is None


def test_a_feed_that_fails_during_the_drain_drops_the_read_unjudged() -> None:
    s = Setup()
    s.store.silent(None, key="/k9")  # would be a repair, if judged

    def failing_drain() -> bool:
        return False

    assert s.top.after_publish(KEYS, s.clock(), failing_drain) is None
    assert s.top.pending is not None and _due(s, b"/k9") is not None
    s.top.drop()  # what the keeper does first when the feed fails
    s.clock.advance(1_000)  # the next read comes at the reads' pace
    assert s.top.after_publish(KEYS, s.clock(), s.drain) == TopChecked(checked=3, repaired=1)
    assert _due(s, b"/k9") is None


def test_the_keeper_re_reads_published_rows_at_most_once_a_minute() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    rig.steps(1, advance_ms=1000)  # a publish of the whole table
    top = rig.ring.keys[0].decode()
    assert top == "/k034"
    rig.store.silent(None, key=top)  # the most overdue row is gone and nobody said so
    rig.steps(1, advance_ms=61_000)
    stats = rig.keeper.statistics()
    assert stats.publish.top_repaired == 1
    assert rig.held() == rig.table()
    checked = stats.publish.top_checked
    rig.steps(1, advance_ms=1000)
    # Only /k029, new to the top five since the repair, is read; the rest were just read.
    assert rig.keeper.statistics().publish.top_checked == checked + 1
    rig.steps(1, advance_ms=1000)
    assert rig.keeper.statistics().publish.top_checked == checked + 1, "once a minute at most"
