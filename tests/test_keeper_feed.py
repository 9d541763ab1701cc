"""The keeper's feed: reads to the end, backs off on failure, resumes where it was."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from keeper_helpers import NOW, ManualClock, MemoryStore

from keeper.feed import Feed
from store.rows import FeedEvent, RowEvent


def feed_of(store: MemoryStore, clock: ManualClock) -> Feed:
    return Feed(store, "keeper", poll_limit=3, backoff_s=0.1, backoff_max_s=0.5, clock=clock)


def test_drain_reads_to_the_end_or_stops_at_the_deadline() -> None:
    store, clock = MemoryStore(), ManualClock()
    feed = feed_of(store, clock)
    feed.subscribe(NOW, resume=False)
    for i in range(7):
        store.put(f"/k{i}", NOW)
    seen: list[str] = []

    def apply(events: Sequence[FeedEvent], now: int) -> None:
        seen.extend(e.key for e in events if isinstance(e, RowEvent))
        clock.advance(10)

    assert not feed.drain(apply, until_ms=NOW + 5)  # one batch, then the deadline
    assert seen == ["/k0", "/k1", "/k2"]
    polls = store.polls
    assert feed.drain(apply, until_ms=NOW + 10_000)
    assert seen == [f"/k{i}" for i in range(7)]
    assert feed.caught_up_at == clock() - 10  # when the poll that read the end was made
    assert store.polls == polls + 2  # 3 + 1 entries: a short batch ends it, no empty poll


def test_failures_back_off_doubling_to_the_cap_and_resume_at_the_cursor() -> None:
    store, clock = MemoryStore(), ManualClock()
    feed = feed_of(store, clock)
    feed.subscribe(NOW, resume=False)
    store.put("/a", NOW)
    feed.drain(lambda events, now: None, NOW + 1000)
    store.put("/b", NOW)
    store.fail_polls = 1
    with pytest.raises(ConnectionError):
        feed.drain(lambda events, now: None, NOW + 1000)
    waits = []
    for _ in range(4):
        feed.failed(ConnectionError("again"), NOW)
        waits.append(feed.reopen_at - NOW)
    assert waits == [100, 200, 400, 500] and not feed.open and feed.failures == 4
    feed.subscribe(NOW, resume=True)
    got: list[str] = []
    feed.drain(lambda events, now: got.extend(e.key for e in events), NOW + 1000)  # type: ignore[union-attr]
    assert got == ["/b"], "resumed after /a, not at the head"
    assert feed.reopens == 1 and feed.backoff_s == 0.1 and feed.cursor_resets == 0


def test_a_pruned_cursor_reopens_at_the_head_and_is_counted() -> None:
    store, clock = MemoryStore(), ManualClock()
    feed = feed_of(store, clock)
    feed.subscribe(NOW, resume=False)
    feed.failed(ConnectionError("gone"), NOW)
    store.put("/missed", NOW)
    store.floor = len(store.log)
    feed.subscribe(NOW, resume=True)
    assert feed.cursor_resets == 1 and feed.cursor is not None
    assert feed.cursor.token == str(len(store.log))
