"""The SQLite change feed's own: seq cursors and their floor, a log rolled back by a power
loss, wake-ups by semaphore, feed ring and data_version, and their clean-up. What every
backend's feed promises is tested on both in test_store_base_feed.py."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from store.base import Cursor, CursorAhead, CursorBelowFloor
from store.rows import RowEvent, RowWrite
from store.sqlite import SqliteStore
from store.sqlite.feed import (
    FALLBACK_POLL_S,
    NEW_FALLBACK_POLL_S,
    NEW_FOR_S,
    SqliteSubscription,
    fallback_poll_s,
    parse_cursor,
)
from store.sqlite.wake import REFRESH_S, unlink


def drop_all(store: SqliteStore) -> None:
    for name in store.consumers():
        store.drop_consumer(name)


def put(key: str, at: int = 1_000, route: str = "product") -> RowWrite:
    return RowWrite(key=key, route=route, next_render_at=at)


def keys_of(events: Sequence[object]) -> list[str]:
    return [e.key for e in events if isinstance(e, RowEvent)]


def test_pruning_stops_at_the_slowest_saved_seq_which_stays_as_the_floor(
    store: SqliteStore,
) -> None:
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


def test_pruning_with_no_consumer_keeps_the_head_subscribable(store: SqliteStore) -> None:
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


def _write_later(path: str, started: object, key: str) -> None:
    store = SqliteStore(path)
    started.wait(30)  # type: ignore[attr-defined]
    time.sleep(0.05)
    store.write([put(key)])
    store.close()


def receive(sub: SqliteSubscription) -> list[str]:
    """Wait and poll until something arrives (a wake-up is a hint: some find nothing)."""
    for _ in range(100):
        assert sub.wait(60.0) is True
        found = keys_of(sub.poll().events)
        if found:
            return found
    raise AssertionError("woken 100 times without an event")


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
    data_version fallback notices its commit all the same."""
    sub = store.subscribe("keeper")
    assert isinstance(sub, SqliteSubscription) and sub._waiter is not None
    sub.poll()
    # The wait's first look since the poll, so the write below is a change it has not seen
    # (a write before that look would be the version it starts from).
    assert sub.wait(0.0) is False
    raw = sqlite3.connect(store.path, isolation_level=None, timeout=5)
    raw.execute(
        "INSERT INTO render_schedule (key, route, sitemap, next_render_at, version) "
        "VALUES ('/raw', 'product', 0, 1000, 1)"
    )
    raw.close()
    assert sub.wait(30.0) is True
    assert sub.statistics().noticed == 1 and sub.statistics().woken == 0
    assert keys_of(sub.poll().events) == ["/raw"]
    sub.close()


def test_a_new_subscription_is_polled_often_only_until_writers_can_know_it() -> None:
    assert fallback_poll_s(0.0) == NEW_FALLBACK_POLL_S == 0.0005
    assert fallback_poll_s(NEW_FOR_S) == FALLBACK_POLL_S == 0.025
    assert NEW_FOR_S > REFRESH_S


@pytest.mark.parametrize(
    ("age_s", "expected"), [(0.0, NEW_FALLBACK_POLL_S), (1.0, FALLBACK_POLL_S)]
)
def test_a_new_subscription_reads_data_version_often_until_writers_know_it(
    store: SqliteStore, age_s: float, expected: float
) -> None:
    """Writers post a subscription and fill its ring only once they have re-read the
    consumers (REFRESH_S): until then its waits look at data_version every 0.5 ms, not 25."""
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


def test_a_subscription_opened_at_the_head_has_delivered_it(store: SqliteStore) -> None:
    """Seq order is commit order: the head is the cursor itself, before any poll (on
    PostgreSQL a poll must first see the horizon pass the subscription's own commit)."""
    store.write([put("/a")])
    sub = store.subscribe("keeper")
    assert sub.cursor == store.feed_head()
    assert sub.has_delivered(store.feed_head())
    store.write([put("/b")])
    assert not sub.has_delivered(store.feed_head())
    sub.poll()
    assert sub.cursor == store.feed_head() and sub.has_delivered(store.feed_head())
    sub.close()
