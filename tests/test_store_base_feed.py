"""The Subscription contract (store.base), on every backend: a feed that starts at the head
sees every later commit, events are state and coalesce per batch, polls page, waits
return for commits (from other processes too), cursors resume after a restart, pruning
keeps what a registered consumer has not passed and refuses a cursor below its floor.
SQLite's wake-ups, rings and rolled-back logs stay in test_store_sqlite_feed.py;
PostgreSQL's out-of-order commits in test_store_postgres_feed.py."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import msgspec
import pytest
from store_helpers import (
    ContractStore,
    close_all,
    is_postgres,
    keys_of,
    open_url,
    put,
    receive,
    settle,
)

from store.base import Cursor, CursorBelowFloor, FeedStatistics
from store.rows import (
    Completion,
    Route,
    RouteEvent,
    RowEvent,
    SettingsEvent,
    SiteEvent,
    SiteSettings,
)

SPAWN = multiprocessing.get_context("spawn")


def test_subscribing_at_the_head_sees_only_later_commits_in_order(any_store: ContractStore) -> None:
    store = any_store
    store.write([put("/before")])
    sub = store.subscribe("keeper")
    store.write([put("/a", 1), put("/b", 2)])
    store.write([put("/c", 3)], delete=["/before"])
    head = store.feed_head()
    settle(store)
    batch = sub.poll()
    assert keys_of(batch.events) == ["/a", "/b", "/c", "/before"]
    rows = {e.key: e.row for e in batch.events if isinstance(e, RowEvent)}
    assert rows["/before"] is None
    assert rows["/a"] == store.get("/a") and rows["/c"] == store.get("/c")
    assert batch.cursor == sub.cursor and not batch.more
    assert sub.has_delivered(head)
    assert sub.poll().events == []
    sub.close()


def test_events_carry_current_state_and_coalesce_per_batch(any_store: ContractStore) -> None:
    store = any_store
    sub = store.subscribe("keeper")
    store.write([put("/a", 1)])
    store.write([put("/b", 1)])
    store.write([put("/a", 2)])
    store.write(delete=["/b"])
    settle(store)
    batch = sub.poll()
    # /a's event sits at its last entry; each key appears once, with its state now.
    assert keys_of(batch.events) == ["/a", "/b"]
    a, b = batch.events
    assert isinstance(a, RowEvent) and a.row is not None and a.row.next_render_at == 2
    assert isinstance(b, RowEvent) and b.row is None
    stats = sub.statistics()
    assert (stats.log_entries, stats.events, stats.coalesced) == (4, 2, 2)
    sub.close()


def test_a_poll_limit_pages_through_the_log(any_store: ContractStore) -> None:
    store = any_store
    sub = store.subscribe("keeper")
    store.write([put(f"/{i:02d}") for i in range(25)])
    settle(store)
    seen: list[str] = []
    more: list[bool] = []
    for _ in range(3):
        batch = sub.poll(limit=10)
        seen += keys_of(batch.events)
        more.append(batch.more)
    assert seen == [f"/{i:02d}" for i in range(25)]
    assert more == [True, True, False]  # the short batch says it read to the end
    assert sub.poll(limit=10).events == []
    with pytest.raises(ValueError, match="limit"):
        sub.poll(limit=0)
    sub.close()


def test_wait_returns_at_once_while_a_full_batch_left_entries_behind(
    any_store: ContractStore,
) -> None:
    store = any_store
    sub = store.subscribe("keeper")
    for at in (1, 2, 3):
        store.write([put("/a", at)])
    store.write([put("/b")])
    settle(store)
    batch = sub.poll(limit=3)  # three entries, one event: fewer events than the limit
    assert keys_of(batch.events) == ["/a"] and batch.more
    # No commit since the poll, and still no wait: with no time to wait in, only what the
    # poll left behind can make it True.
    assert sub.wait(0.0) is True
    assert keys_of(sub.poll(limit=3).events) == ["/b"]
    assert sub.wait(0.0) is False  # and nothing is left now
    sub.close()


def test_wait_times_out_without_commits(any_store: ContractStore) -> None:
    sub = any_store.subscribe("keeper")
    sub.poll()
    assert sub.wait(0.03) is False
    assert sub.statistics().timeouts == 1
    sub.close()


def test_route_and_settings_changes_come_through_the_same_feed(any_store: ContractStore) -> None:
    store = any_store
    sub = store.subscribe("keeper")
    store.set_route("product", default_cadence_s=600)
    store.write([put("/a")])
    store.set_route("product", paused=True, site_pattern="*.example.com")
    store.set_default_cadence_s(7_200)
    settle(store)
    batch = sub.poll()
    assert batch.events == [
        RowEvent(key="/a", row=store.get("/a")),
        RouteEvent(
            route=Route(
                route="product", default_cadence_s=600, paused=True, site_pattern="*.example.com"
            )
        ),
        SettingsEvent(default_cadence_s=7_200),
    ]
    sub.close()


def test_site_settings_come_through_the_feed_as_state(any_store: ContractStore) -> None:
    store = any_store
    sub = store.subscribe("keeper")
    store.set_site(SiteSettings(site="example.com", max_in_flight=2))
    store.set_site(SiteSettings(site="other.example", min_interval_ms=500))
    store.set_site(SiteSettings(site="example.com", max_in_flight=3, min_interval_ms=100))
    store.write([put("/a")])
    store.set_site(SiteSettings(site="other.example"))  # cleared
    settle(store)
    batch = sub.poll()
    assert batch.events == [
        SiteEvent(settings=SiteSettings(site="example.com", max_in_flight=3, min_interval_ms=100)),
        RowEvent(key="/a", row=store.get("/a")),
        SiteEvent(settings=SiteSettings(site="other.example")),
    ]
    sub.close()


def test_completions_reach_the_feed(any_store: ContractStore) -> None:
    store = any_store
    store.write([put("/a"), put("/b")])
    sub = store.subscribe("keeper")
    store.complete(
        [
            Completion(key="/a", outcome="rendered", now=5_000),
            Completion(key="/b", outcome="gone", now=5_000),
        ]
    )
    settle(store)
    assert sorted(sub.poll().events, key=lambda e: e.key) == [  # type: ignore[union-attr]
        RowEvent(key="/a", row=store.get("/a")),
        RowEvent(key="/b", row=None),
    ]
    sub.close()


def test_a_consumer_resumes_from_its_saved_cursor_after_a_restart(store_url: str) -> None:
    store = open_url(store_url)
    sub = store.subscribe("keeper")
    assert store.consumers() == {"keeper": sub.cursor}
    store.write([put("/a")])
    settle(store)
    assert keys_of(sub.poll().events) == ["/a"]
    sub.save()
    saved = sub.cursor
    assert store.consumers()["keeper"] == saved
    store.write([put("/b")])  # committed while the consumer is away
    settle(store)
    assert keys_of(sub.poll().events) == ["/b"]  # read, but not saved
    assert store.consumers()["keeper"] == saved
    sub.close()
    store.close()

    store = open_url(store_url)
    store.write([put("/c")])
    settle(store)
    again = store.subscribe("keeper")  # no cursor: the saved one
    assert again.cursor == saved
    assert keys_of(again.poll().events) == ["/b", "/c"]
    again.close()
    close_all(store)


def test_pruning_keeps_what_a_registered_consumer_has_not_passed(any_store: ContractStore) -> None:
    store = any_store
    slow = store.subscribe("slow")
    fast = store.subscribe("fast")
    early = store.feed_head()
    store.write([put(f"/{i:03d}") for i in range(30)])
    store.write([put(f"/{i:03d}") for i in range(30, 100)])
    settle(store)
    assert keys_of(slow.poll(limit=30).events) == [f"/{i:03d}" for i in range(30)]
    slow.save()  # slow has passed the first 30 entries
    assert len(fast.poll().events) == 100
    fast.save()  # fast has passed all 100
    assert store.consumers() == {"slow": slow.cursor, "fast": fast.cursor}

    behind = slow.cursor
    removed = store.prune()
    assert 0 < removed <= 30  # only what both have passed
    assert store.statistics().log_rows == 100 - removed
    assert keys_of(slow.poll().events) == [f"/{i:03d}" for i in range(30, 100)]
    assert store.prune() == 0  # slow's saved cursor has not moved

    # A cursor below the floor is refused, never replayed short.
    with pytest.raises(CursorBelowFloor, match="below the change log's pruned floor"):
        store.subscribe("late", early)
    assert "late" not in store.consumers()

    # Unregistered, a consumer no longer holds the log back; its open feed then finds
    # itself below the floor and says so.
    lagging = store.subscribe("lagging", behind)
    store.drop_consumer("slow")
    store.drop_consumer("lagging")
    assert store.prune() >= 70 - removed
    assert store.statistics().log_rows <= 1  # down to fast's cursor
    with pytest.raises(CursorBelowFloor):
        lagging.poll()
    with pytest.raises(CursorBelowFloor):
        store.subscribe("slow", behind)
    for sub in (slow, fast, lagging):
        sub.close()


def test_pruning_with_no_consumer_empties_the_log_below_the_head(any_store: ContractStore) -> None:
    store = any_store
    store.write([put(f"/{i}") for i in range(50)])
    settle(store)  # PostgreSQL prunes only below the oldest transaction running anywhere
    assert store.prune(chunk=7) >= 49  # SQLite keeps its head entry as the floor's witness
    assert store.statistics().log_rows <= 1
    sub = store.subscribe("keeper", store.feed_head())
    store.write([put("/new")])
    settle(store)
    assert keys_of(sub.poll().events) == ["/new"]
    sub.close()


def test_foreign_cursors_are_refused(any_store: ContractStore) -> None:
    for token in ("", "x", "pg:1:2", "sqlite:x:1", "sqlite:-1:0", "sqlite:1", "pg:o:-1:0:0"):
        with pytest.raises(ValueError, match="cursor"):
            any_store.subscribe("keeper", Cursor(token=token))
    assert any_store.consumers() == {}


def test_a_cursor_from_the_other_backend_is_refused(store_url: str) -> None:
    store = open_url(store_url)
    other = Cursor(token="sqlite:0:0" if is_postgres(store_url) else "pg:1.1:5:0:5")
    with pytest.raises(ValueError, match="cursor"):
        store.subscribe("keeper", other)
    store.close()


def test_statistics_are_feed_statistics_and_their_common_part_round_trips(
    any_store: ContractStore,
) -> None:
    store = any_store
    sub = store.subscribe("keeper")
    store.write([put("/a", 1)])
    store.write([put("/a", 2)])
    store.write([put("/b", 1)])
    settle(store)
    assert keys_of(sub.poll().events) == ["/a", "/b"]
    assert sub.wait(0.0) is False
    stats = sub.statistics()
    assert isinstance(stats, FeedStatistics) and type(stats) is not FeedStatistics
    common = stats.common()
    assert type(common) is FeedStatistics and common.common() is common
    assert (common.polls, common.events, common.log_entries, common.coalesced) == (1, 2, 3, 1)
    assert (common.woken, common.noticed, common.timeouts) == (
        stats.woken,
        stats.noticed,
        stats.timeouts,
    )
    assert common.timeouts == 1
    assert (common.held_back_ms, common.held_by_pid) == (stats.held_back_ms, stats.held_by_pid)
    # The backend's own fields travel too, and a reader that knows only the common part
    # drops them.
    encoded = msgspec.msgpack.encode(stats)
    assert msgspec.msgpack.decode(encoded, type=type(stats)) == stats
    assert msgspec.msgpack.decode(encoded, type=FeedStatistics) == common
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(common), type=FeedStatistics) == common
    sub.close()


def _write_later(url: str, started: Any, key: str) -> None:
    store = open_url(url)
    started.wait(30)
    time.sleep(0.05)
    store.write([put(key)])
    store.close()


def test_a_commit_in_another_process_wakes_a_waiting_consumer(
    store_url: str, any_store: ContractStore
) -> None:
    sub = any_store.subscribe("keeper")
    started = SPAWN.Event()
    child = SPAWN.Process(target=_write_later, args=(store_url, started, "/x"))
    child.start()
    sub.poll()
    started.set()
    begun = time.monotonic()
    assert receive(sub) == ["/x"]
    assert time.monotonic() - begun < 10.0
    stats = sub.statistics()
    assert stats.woken + stats.noticed >= 1 and stats.timeouts == 0
    child.join(30)
    assert child.exitcode == 0
    sub.close()


def test_has_delivered_is_false_until_polls_pass_a_head_then_true(
    any_store: ContractStore,
) -> None:
    store = any_store
    sub = store.subscribe("keeper")
    store.write([put("/a"), put("/b")])
    read = store.get_many_at(["/a", "/b"])
    assert len(read.rows) == 2
    store.write([put("/c")])
    settle(store)
    assert not sub.has_delivered(read.head)
    assert keys_of(sub.poll(limit=1).events) == ["/a"]
    assert not sub.has_delivered(read.head)  # "/b" was in the read, and is still to come
    rest: list[str] = []
    for _ in range(5):  # "/b", then "/c" and an empty poll at most
        rest += keys_of(sub.poll(limit=1).events)
        if sub.has_delivered(read.head):
            break
    assert sub.has_delivered(read.head)
    assert rest[:1] == ["/b"]
    with pytest.raises(ValueError):
        sub.has_delivered(Cursor(token="postgres:1"))
    sub.close()


def test_has_delivered_a_head_as_soon_as_the_entries_the_read_saw_are_polled(
    any_store: ContractStore,
) -> None:
    """Exact, not only eventually: after "/b" and before "/c", which came after the read."""
    store = any_store
    sub = store.subscribe("keeper")
    store.write([put("/a"), put("/b")])
    read = store.get_many_at(["/a", "/b"])
    store.write([put("/c")])
    settle(store)
    assert keys_of(sub.poll(limit=1).events) == ["/a"]
    assert not sub.has_delivered(read.head)
    assert keys_of(sub.poll(limit=1).events) == ["/b"]
    assert sub.has_delivered(read.head)  # "/c" came after the read: not needed for it
    sub.close()


def test_a_dropped_consumer_is_forgotten_once(any_store: ContractStore) -> None:
    sub = any_store.subscribe("keeper")
    sub.close()
    assert "keeper" in any_store.consumers()
    assert any_store.drop_consumer("keeper") is True
    assert any_store.drop_consumer("keeper") is False
    assert any_store.consumers() == {}


def test_a_write_position_is_vouched_for_only_once_the_write_is_polled(
    any_store: ContractStore,
) -> None:
    """`write_position` and `delivered_below` (shm.marks): a write's position stays at or
    above what the feed vouches for until a poll has delivered the write, then below it;
    positions grow with each write."""
    store = any_store
    sub = store.subscribe("keeper")
    store.write([put("/a", 1)])
    first = store.write_position
    assert first > 0 and sub.delivered_below() <= first
    settle(store)
    assert keys_of(sub.poll().events) == ["/a"]
    assert first < sub.delivered_below()
    store.complete([Completion(key="/a", outcome="rendered", now=5)])
    second = store.write_position
    assert first < second and sub.delivered_below() <= second
    settle(store)
    assert keys_of(sub.poll().events) == ["/a"]
    assert second < sub.delivered_below()
    sub.close()
