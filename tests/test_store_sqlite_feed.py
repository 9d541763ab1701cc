"""The SQLite change feed: exact, in commit order, state not deltas, and honest about gaps."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from store.base import Cursor, CursorAhead, CursorBelowFloor, FeedStatistics
from store.rows import Completion, Route, RouteEvent, RowEvent, RowWrite, SettingsEvent
from store.sqlite import SqliteStore
from store.sqlite_feed import (
    FALLBACK_POLL_S,
    NEW_FALLBACK_POLL_S,
    NEW_FOR_S,
    SqliteSubscription,
    fallback_poll_s,
    parse_cursor,
)
from store.wake import REFRESH_S, unlink


def drop_all(store: SqliteStore) -> None:
    for name in store.consumers():
        store.drop_consumer(name)


def put(key: str, at: int = 1_000, route: str = "product") -> RowWrite:
    return RowWrite(key=key, route=route, next_render_at=at)


def keys_of(events: Sequence[object]) -> list[str]:
    return [e.key for e in events if isinstance(e, RowEvent)]


def test_subscribing_at_the_head_sees_only_later_commits_in_order(store: SqliteStore) -> None:
    store.write([put("/before")])
    sub = store.subscribe("keeper")
    store.write([put("/a", 1), put("/b", 2)])
    store.write([put("/c", 3)], delete=["/before"])
    batch = sub.poll()
    assert keys_of(batch.events) == ["/a", "/b", "/c", "/before"]
    rows = {e.key: e.row for e in batch.events if isinstance(e, RowEvent)}
    assert rows["/before"] is None
    assert rows["/a"] == store.get("/a") and rows["/c"] == store.get("/c")
    assert sub.poll().events == []
    assert batch.cursor == sub.cursor == store.feed_head()
    sub.close()


def test_events_carry_current_state_and_coalesce_per_batch(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    store.write([put("/a", 1)])
    store.write([put("/b", 1)])
    store.write([put("/a", 2)])
    store.write(delete=["/b"])
    batch = sub.poll()
    # /a's event sits at its last entry; each key appears once, with its state now.
    assert keys_of(batch.events) == ["/a", "/b"]
    a, b = batch.events
    assert isinstance(a, RowEvent) and a.row is not None and a.row.next_render_at == 2
    assert isinstance(b, RowEvent) and b.row is None
    stats = sub.statistics()
    assert (stats.log_entries, stats.events, stats.coalesced) == (4, 2, 2)
    sub.close()


def test_a_poll_limit_pages_through_the_log(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    store.write([put(f"/{i:02d}") for i in range(25)])
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
    store: SqliteStore,
) -> None:
    sub = store.subscribe("keeper")
    store.write([put("/a", 1), put("/a", 2), put("/a", 3), put("/b")])
    batch = sub.poll(limit=3)  # three entries, one event: fewer events than the limit
    assert keys_of(batch.events) == ["/a"] and batch.more
    assert sub.wait(30.0) is True  # no commit since the poll, and still no sleep
    assert keys_of(sub.poll(limit=3).events) == ["/b"]
    sub.close()


def test_route_and_settings_changes_come_through_the_same_feed(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    store.set_route("product", default_cadence_s=600)
    store.write([put("/a")])
    store.set_route("product", paused=True)
    store.set_default_cadence_s(7_200)
    batch = sub.poll()
    assert batch.events[0] == RowEvent(key="/a", row=store.get("/a"))
    assert batch.events[1] == RouteEvent(
        route=Route(route="product", default_cadence_s=600, paused=True)
    )
    assert batch.events[2] == SettingsEvent(default_cadence_s=7_200)
    sub.close()


def test_completions_reach_the_feed(store: SqliteStore) -> None:
    store.write([put("/a"), put("/b")])
    sub = store.subscribe("keeper")
    store.complete(
        [
            Completion(key="/a", outcome="rendered", now=5_000),
            Completion(key="/b", outcome="gone", now=5_000),
        ]
    )
    assert sub.poll().events == [
        RowEvent(key="/a", row=store.get("/a")),
        RowEvent(key="/b", row=None),
    ]
    sub.close()


def test_a_consumer_resumes_from_its_saved_cursor_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    store = SqliteStore(path)
    sub = store.subscribe("keeper")
    assert store.consumers() == {"keeper": sub.cursor}
    store.write([put("/a")])
    sub.poll()
    sub.save()
    store.write([put("/b")])  # committed while the consumer is away
    sub.close()
    store.close()

    store = SqliteStore(path)
    store.write([put("/c")])
    again = store.subscribe("keeper")  # no cursor: the saved one
    assert keys_of(again.poll().events) == ["/b", "/c"]
    assert again.statistics().saved_seq < again.statistics().seq
    again.close()
    drop_all(store)
    store.close()


def test_pruning_keeps_what_a_registered_consumer_has_not_passed(store: SqliteStore) -> None:
    slow = store.subscribe("slow")
    fast = store.subscribe("fast")
    store.write([put(f"/{i:03d}") for i in range(30)])
    store.write([put(f"/{i:03d}") for i in range(30, 100)])
    slow.poll(limit=30)
    slow.save()  # slow has passed entries 1..30
    fast.poll()
    fast.save()  # fast has passed all 100
    assert parse_cursor(slow.cursor)[0] == 30

    assert store.prune() == 29  # entries 1..29; entry 30 stays as the floor's witness
    stats = store.statistics()
    assert (stats.floor, stats.log_rows, stats.lowest_consumer_seq) == (30, 71, 30)
    assert keys_of(slow.poll().events) == [f"/{i:03d}" for i in range(30, 100)]
    assert store.prune() == 0  # slow's saved cursor has not moved

    # A cursor below the floor is refused, never replayed short.
    with pytest.raises(CursorBelowFloor, match="below the change log's pruned floor 30"):
        store.subscribe("late", Cursor(token="sqlite:10:0"))
    with pytest.raises(CursorBelowFloor):
        store.subscribe("late", Cursor(token="sqlite:0:0"))
    assert "late" not in store.consumers()

    # Unregistered, the slow consumer no longer holds the log back; its open feed now
    # finds itself below the floor and says so.
    store.drop_consumer("slow")
    slow_again = store.subscribe("slow2", Cursor(token=f"sqlite:30:{_stamp(store, 30)}"))
    store.drop_consumer("slow2")
    assert store.prune() == 70
    assert store.statistics().floor == 100
    with pytest.raises(CursorBelowFloor):
        slow_again.poll()
    for sub in (slow, fast, slow_again):
        sub.close()


def _stamp(store: SqliteStore, seq: int) -> int:
    conn = sqlite3.connect(store.path)
    (stamp,) = conn.execute("SELECT stamp FROM change_log WHERE seq = ?", (seq,)).fetchone()
    conn.close()
    return int(stamp)


def test_pruning_with_no_consumer_keeps_the_head(store: SqliteStore) -> None:
    store.write([put(f"/{i}") for i in range(50)])
    head = store.feed_head()
    assert store.prune(chunk=7) == 49
    stats = store.statistics()
    assert (stats.floor, stats.head, stats.log_rows, stats.pruned) == (50, 50, 1, 49)
    sub = store.subscribe("keeper", head)
    store.write([put("/new")])
    assert keys_of(sub.poll().events) == ["/new"]
    sub.close()


def _backup(path: Path, to: Path) -> None:
    source, target = sqlite3.connect(path), sqlite3.connect(to)
    source.backup(target)
    source.close()
    target.close()


def _restore(copy: Path, path: Path) -> None:
    """What a power loss under synchronous=NORMAL can leave: the file as of an earlier commit."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    _backup(copy, path)


def test_a_cursor_ahead_of_a_rolled_back_log_forces_a_counted_resync(tmp_path: Path) -> None:
    path, copy = tmp_path / "s.db", tmp_path / "copy.db"
    store = SqliteStore(path)
    sub = store.subscribe("keeper")
    store.write([put(f"/{i}") for i in range(10)])
    _backup(path, copy)
    store.write([put(f"/late{i}") for i in range(5)])
    sub.poll()
    held = sub.cursor  # the consumer kept it outside the database
    sub.close()
    drop_all(store)
    store.close()

    _restore(copy, path)
    store = SqliteStore(path)
    with pytest.raises(CursorAhead, match="past the change log's head 10"):
        store.subscribe("keeper", held)
    assert store.statistics().resyncs == 1

    # Writes after the loss reuse seqs 11..20: the stamp tells the cursor's entry apart.
    store.write([put(f"/new{i}") for i in range(10)])
    with pytest.raises(CursorAhead, match="not the one the cursor passed"):
        store.subscribe("keeper", held)
    assert store.statistics().resyncs == 2
    fresh = store.subscribe("keeper", store.feed_head())
    fresh.close()
    drop_all(store)
    store.close()


def test_foreign_cursors_are_refused(store: SqliteStore) -> None:
    for token in ("pg:1:2", "sqlite:x:1", "sqlite:-1:0", "sqlite:1"):
        with pytest.raises(ValueError, match="cursor"):
            store.subscribe("keeper", Cursor(token=token))


def test_wait_times_out_without_commits(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    sub.poll()
    assert sub.wait(0.03) is False
    assert sub.statistics().timeouts == 1
    sub.close()


def _write_later(path: str, started: object, key: str) -> None:
    store = SqliteStore(path)
    started.wait(30)  # type: ignore[attr-defined]
    time.sleep(0.05)
    store.write([put(key)])
    store.close()


def test_statistics_are_feed_statistics_and_their_common_part_round_trips(
    store: SqliteStore,
) -> None:
    sub = store.subscribe("keeper")
    store.write([put("/a", 1)])
    store.write([put("/a", 2)])
    store.write([put("/b", 1)])
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
    # SQLite's own fields travel too, and a reader that knows only the common part drops them.
    encoded = msgspec.msgpack.encode(stats)
    assert msgspec.msgpack.decode(encoded, type=type(stats)) == stats
    assert msgspec.msgpack.decode(encoded, type=FeedStatistics) == common
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(common), type=FeedStatistics) == common
    sub.close()


def receive(sub: SqliteSubscription) -> list[str]:
    """Wait and poll until something arrives (a wake-up is a hint: some find nothing)."""
    for _ in range(100):
        assert sub.wait(60.0) is True
        found = keys_of(sub.poll().events)
        if found:
            return found
    raise AssertionError("woken 100 times without an event")


def test_a_commit_in_another_process_wakes_a_waiting_consumer(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    assert isinstance(sub, SqliteSubscription)
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    child = context.Process(target=_write_later, args=(str(store.path), started, "/x"))
    child.start()
    sub.poll()
    started.set()
    assert receive(sub) == ["/x"]
    stats = sub.statistics()
    assert stats.woken + stats.noticed >= 1 and stats.timeouts == 0
    child.join(30)
    assert child.exitcode == 0
    sub.close()


def without_ring(sub: SqliteSubscription) -> SqliteSubscription:
    """The subscription as on a system without shared memory: semaphores and SQLite only."""
    ring, sub._ring = sub._ring, None
    assert ring is not None
    ring.close()
    ring.unlink()
    return sub


def test_a_post_pending_since_the_poll_answers_wait_at_once(store: SqliteStore) -> None:
    sub = without_ring(store.subscribe("keeper"))
    sub.poll()
    store.write([put("/z")])  # the writer posts the consumer's semaphore after its commit
    assert sub.wait(0) is True
    stats = sub.statistics()
    assert (stats.woken, stats.noticed) == (1, 0)  # the post answered, not data_version
    assert keys_of(sub.poll().events) == ["/z"]
    assert sub.wait(0) is False  # the post was taken: nothing more is pending
    sub.close()


def test_data_version_polling_alone_still_wakes(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    assert isinstance(sub, SqliteSubscription)
    waiter, sub._waiter = sub._waiter, None  # as on a system without POSIX semaphores
    assert waiter is not None
    waiter.close()
    unlink(sub.statistics().wake or waiter.name)
    sub.poll()
    context = multiprocessing.get_context("spawn")
    started = context.Event()
    child = context.Process(target=_write_later, args=(str(store.path), started, "/y"))
    child.start()
    started.set()
    assert receive(sub) == ["/y"]
    assert sub.statistics().noticed >= 1 and sub.statistics().woken == 0
    child.join(30)
    sub.close()


def test_a_commit_that_posts_nothing_is_noticed_beside_a_semaphore(store: SqliteStore) -> None:
    """A writer outside the store (the sqlite3 shell, say) posts no wake-up: the wait's
    data_version fallback notices its commit within a few milliseconds all the same."""
    sub = store.subscribe("keeper")
    assert isinstance(sub, SqliteSubscription) and sub._waiter is not None
    sub.poll()

    def write_raw() -> None:
        time.sleep(0.05)
        raw = sqlite3.connect(store.path, isolation_level=None, timeout=5)
        raw.execute(
            "INSERT INTO render_schedule (key, route, sitemap, next_render_at, version) "
            "VALUES ('/raw', 'product', 0, 1000, 1)"
        )
        raw.close()

    writer = threading.Thread(target=write_raw)
    started = time.monotonic()
    writer.start()
    assert sub.wait(5.0) is True
    assert time.monotonic() - started < 1.0
    writer.join()
    assert sub.statistics().noticed == 1 and sub.statistics().woken == 0
    assert keys_of(sub.poll().events) == ["/raw"]
    sub.close()


def test_a_new_subscription_is_polled_often_only_until_writers_can_know_it() -> None:
    assert fallback_poll_s(0.0) == NEW_FALLBACK_POLL_S == 0.0005
    assert fallback_poll_s(NEW_FOR_S) == FALLBACK_POLL_S == 0.004
    assert NEW_FOR_S > REFRESH_S


@pytest.mark.parametrize(
    ("age_s", "expected"), [(0.0, NEW_FALLBACK_POLL_S), (1.0, FALLBACK_POLL_S)]
)
def test_a_new_subscription_reads_data_version_often_until_writers_know_it(
    store: SqliteStore, age_s: float, expected: float
) -> None:
    """Writers post a subscription and fill its ring only once they have re-read the
    consumers (REFRESH_S): until then its waits look at data_version every 0.5 ms, not 4."""
    sub = store.subscribe("keeper")
    assert isinstance(sub, SqliteSubscription) and sub._waiter is not None
    sub._opened_at -= age_s
    sub.poll()
    slices: list[float] = []

    def no_post_then_commit(timeout_s: float) -> bool:
        slices.append(timeout_s)
        if len(slices) == 1:  # a commit no post announces, as before a writer's refresh
            raw = sqlite3.connect(store.path, isolation_level=None, timeout=5)
            raw.execute(
                "INSERT INTO render_schedule (key, route, sitemap, next_render_at, version) "
                "VALUES ('/raw', 'product', 0, 1000, 1)"
            )
            raw.close()
        return False

    sub._waiter.wait = no_post_then_commit  # type: ignore[method-assign]
    assert sub.wait(5.0) is True
    assert slices == [expected]
    assert sub.statistics().noticed == 1 and sub.statistics().woken == 0
    assert keys_of(sub.poll().events) == ["/raw"]
    sub.close()


def sem_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}")


def test_a_subscription_removes_its_semaphore_when_it_closes(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    name = sub.statistics().wake
    assert name and sem_exists(name)
    sub.close()
    assert not sem_exists(name)
    again = store.subscribe("keeper")
    assert again.statistics().wake not in ("", name)  # a fresh name each time
    again.close()
    assert store.drop_consumer("keeper") is True
    assert store.drop_consumer("keeper") is False


def _subscribe_and_die(path: str) -> None:
    store = SqliteStore(path)
    store.subscribe("keeper")
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_consumers_semaphore_goes_with_its_next_subscription(
    store: SqliteStore,
) -> None:
    child = multiprocessing.get_context("spawn").Process(
        target=_subscribe_and_die, args=(str(store.path),)
    )
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    conn = sqlite3.connect(store.path)
    (left,) = conn.execute("SELECT wake FROM feed_consumers WHERE consumer = 'keeper'").fetchone()
    conn.close()
    assert sem_exists(left)
    sub = store.subscribe("keeper")
    assert not sem_exists(left)
    sub.close()


def test_drop_consumer_removes_a_semaphore_left_behind(store: SqliteStore) -> None:
    child = multiprocessing.get_context("spawn").Process(
        target=_subscribe_and_die, args=(str(store.path),)
    )
    child.start()
    child.join(60)
    conn = sqlite3.connect(store.path)
    (left,) = conn.execute("SELECT wake FROM feed_consumers WHERE consumer = 'keeper'").fetchone()
    conn.close()
    assert store.drop_consumer("keeper") is True
    assert not sem_exists(left)


def test_has_delivered_is_true_once_polls_pass_a_head(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    assert sub.has_delivered(store.feed_head())
    store.write([put("/a"), put("/b")])
    read = store.get_many_at(["/a", "/b"])
    store.write([put("/c")])
    assert not sub.has_delivered(read.head)
    assert keys_of(sub.poll(limit=1).events) == ["/a"]
    assert not sub.has_delivered(read.head)
    assert keys_of(sub.poll(limit=1).events) == ["/b"]
    assert sub.has_delivered(read.head)  # "/c" came after the read: not needed for it
    assert not sub.has_delivered(store.feed_head())
    with pytest.raises(ValueError):
        sub.has_delivered(Cursor(token="postgres:1"))
    sub.close()
