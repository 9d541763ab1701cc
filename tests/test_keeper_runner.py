"""The keeper's I/O edge, driven step by step on a manual clock with in-memory stand-ins."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
from keeper_helpers import (
    NOW,
    RIG_CONFIG,
    MemoryLeases,
    MemoryRing,
    MemoryStateBuffer,
    Rig,
    member_record,
)
from node_harness import wait_for
from store_helpers import open_url

from keeper.config import KeeperConfig
from keeper.runner import ClusterSettings, Keeper
from keeper.state import (
    decode_keeper_statistics,
    decode_queue_state,
    decode_site_list,
    encode_keeper_statistics,
    liveness,
    vouches,
)
from shm import key_hash, segment_name
from shm.keys import site_hash
from shm.sites import SiteTable
from store.base import FeedStatistics
from store.rows import MemberList, Row, SiteSettings

CONFIG = RIG_CONFIG


def clustered_keeper(
    store: Any,
    clock: Callable[[], int],
    members: Callable[[bool], MemberList],
    *,
    state: MemoryStateBuffer | None = None,
    cluster: ClusterSettings | None = None,
    **extra: Any,
) -> Keeper:
    """Node a's keeper over the in-memory stand-ins, reading the member list `members`."""
    return Keeper(
        store,
        MemoryRing(),
        MemoryLeases(),
        MemoryStateBuffer() if state is None else state,
        CONFIG,
        node="a",
        clock=clock,
        cluster=ClusterSettings(ttl_s=4, max_lease_s=10, poll_s=1) if cluster is None else cluster,
        members=members,
        **extra,
    )


def test_status_is_unready_until_the_first_publish_which_comes_after_the_first_chunk() -> None:
    rig = Rig(rows=35)
    rig.keeper.start()
    first = rig.states()
    assert first[0].now.status == "unready" and first[0].trust.phase == "starting"
    assert first[-1].trust.phase == "loading" and not first[-1].trust.exact
    assert rig.ring.generation == 0
    rig.keeper.step()  # one chunk, then the first publish
    assert rig.ring.generation == 1
    assert rig.ring.keys == [f"/k{i:03}".encode() for i in range(9, -1, -1)]
    after = rig.last()
    assert after.now.status == "ready" and after.trust.phase == "loading"
    assert after.trust.load.first_publish_at == NOW and after.trust.load.finished_at is None
    assert not vouches(after, NOW), "loading: counts are not exact yet"
    rig.steps(4)
    done = rig.last()
    assert done.trust.phase == "live" and done.trust.exact and vouches(done, NOW)
    assert done.now.due == 35 and done.autoscale.due_now == 35
    assert done.autoscale.oldest_claimable_age_s == 34.0
    assert rig.held() == rig.table()


def test_the_heap_is_trimmed_once_the_load_is_over(monkeypatch: pytest.MonkeyPatch) -> None:
    from keeper import heap

    trims: list[int] = []
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1))
    rig = Rig(rows=35)
    rig.keeper.start()
    rig.keeper.step()
    assert rig.last().trust.phase == "loading" and not trims
    rig.steps(4)
    assert rig.last().trust.phase == "live" and len(trims) == 1
    rig.steps(3, advance_ms=1000)
    assert len(trims) == 1  # not on every round, only after a load


def test_each_status_change_is_written_at_once() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    writes = len(rig.state.writes)
    rig.ring.fail = True
    rig.steps(1, advance_ms=1000)
    stalled = rig.last()
    assert len(rig.state.writes) > writes
    assert stalled.now.status == "stalled" and not stalled.trust.live
    assert "publish failed" in stalled.trust.live_reason
    assert not liveness(stalled, rig.clock()).live and not vouches(stalled, rig.clock())
    rig.ring.fail = False
    rig.steps(1, advance_ms=1000)
    assert rig.last().now.status == "ready" and rig.last().trust.live
    assert rig.keeper.statistics().publish.failures == 1


def test_the_statistics_record_is_written_with_each_queue_state_and_has_the_feed() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    assert len(rig.statistics.writes) == len(rig.state.writes)
    rig.store.put("/new", NOW)
    rig.steps(1, advance_ms=1000)  # applies the event, then publishes
    assert len(rig.statistics.writes) == len(rig.state.writes)
    record = decode_keeper_statistics(rig.statistics.last())
    assert record.phase == "live" and record.status == "ready" and record.exact
    assert record.events == 1 and record.held == 36 and record.publish.publishes >= 2
    assert record.short_slice is False  # run() asks for it; these steps never did
    assert record.statistics_write_failures == 0
    feed = record.feed
    assert feed is not None and type(feed) is FeedStatistics
    assert feed.events == 1 and feed.log_entries == 1 and feed.polls >= 1
    assert rig.statistics.writes[-1][1] == rig.state.writes[-1][1] == rig.clock()


def test_the_statistics_record_round_trips_and_refuses_another_shape() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    stats = rig.keeper.statistics()
    assert stats.feed is not None
    assert decode_keeper_statistics(encode_keeper_statistics(stats)) == stats
    closed = msgspec.structs.replace(stats, feed=None)
    assert decode_keeper_statistics(encode_keeper_statistics(closed)) == closed
    with pytest.raises(msgspec.DecodeError):
        decode_keeper_statistics(b"\xc1 not msgpack")
    with pytest.raises(msgspec.ValidationError):
        decode_keeper_statistics(msgspec.msgpack.encode({"phase": "live", "events": 1}))


class BrokenBuffer:
    def write(self, payload: bytes, now_ms: int) -> int:
        raise OSError("no room (test)")


def test_a_failed_statistics_write_is_counted_and_the_keeper_goes_on() -> None:
    rig = Rig()
    rig.keeper.statistics_buffer = BrokenBuffer()
    rig.keeper.start()
    rig.steps(5)
    rig.steps(2, advance_ms=1000)
    stats = rig.keeper.statistics()
    assert stats.phase == "live" and stats.status == "ready" and rig.ring.generation >= 3
    assert stats.statistics_write_failures == len(rig.state.writes) > 0
    assert stats.state_write_failures == 0 and stats.state_writes == len(rig.state.writes)
    rig.keeper.statistics_buffer = rig.statistics
    rig.steps(1, advance_ms=1000)
    record = decode_keeper_statistics(rig.statistics.last())
    assert record.statistics_write_failures == stats.statistics_write_failures


def test_while_the_feed_is_closed_the_record_has_no_feed_statistics() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    rig.store.fail_polls = 1
    rig.steps(1, advance_ms=10)
    assert rig.keeper.statistics().feed_failures == 1
    record = decode_keeper_statistics(rig.statistics.last())  # written as the feed failed
    assert record.feed_failures == 1 and record.feed is None
    for _ in range(4):
        rig.steps(1, advance_ms=500)
    reopened = decode_keeper_statistics(rig.statistics.last())
    assert reopened.feed_reopens == 1 and reopened.feed is not None


def test_a_keeper_that_stops_publishing_reads_not_live_within_two_seconds() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    rig.steps(1, advance_ms=1000)
    published = rig.clock()
    last = rig.last()
    assert liveness(last, published + 1_999).live
    # The keeper is stuck (it writes nothing more); readers still see it go stale.
    seen = liveness(last, published + 2_001)
    assert not seen.live and seen.status == "stalled" and "no publish" in seen.reason


def test_a_failed_feed_is_reopened_with_backoff_and_walked_and_both_are_counted() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    rig.store.fail_polls = 3  # the first reopen's poll fails again
    rig.store.put("/during", NOW)
    rig.steps(1, advance_ms=10)
    stats = rig.keeper.statistics()
    assert stats.feed_failures == 1 and stats.phase == "resyncing" and not stats.exact
    assert not rig.last().trust.exact
    rig.store.silent(
        Row(key="/k001", route="product", cadence_s=None, sitemap=False, next_render_at=1)
    )
    rig.steps(1, advance_ms=50)  # before the 100 ms backoff: no reopen yet
    assert rig.keeper.statistics().feed_reopens == 0
    for _ in range(12):
        rig.steps(1, advance_ms=500)
    stats = rig.keeper.statistics()
    assert stats.feed_failures == 3 and stats.feed_reopens >= 1 and stats.resyncs >= 1
    assert stats.phase == "live" and stats.exact
    assert rig.held() == rig.table()
    assert stats.repairs.missed_changed == 1, "the resync walk repaired the silent write"


def test_a_pruned_cursor_on_reopen_walks_from_scratch_and_says_so() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    rig.store.fail_polls = 1
    rig.steps(1, advance_ms=10)
    for i in range(5):
        rig.store.put(f"/gap{i}", NOW)
    rig.store.floor = len(rig.store.log)  # the log below the head was pruned
    for _ in range(10):
        rig.steps(1, advance_ms=500)
    stats = rig.keeper.statistics()
    assert stats.cursor_resets == 1 and stats.exact
    assert rig.held() == rig.table()


def test_a_route_change_reclassifies_in_memory_without_a_walk() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    walks = rig.store.walks
    rig.store.set_route("product", default_cadence_s=60)
    rig.steps(1, advance_ms=1000)
    assert rig.store.walks == walks
    trust = rig.last().trust
    assert trust.reclassifications == 1 and trust.rows_reclassified == 35 and trust.exact
    rig.steps(1, advance_ms=5000)
    classes = rig.last().lateness.classes
    assert [(c.route, c.cadence_s, c.cadence_from_row) for c in classes] == [("product", 60, False)]


def test_a_feed_that_fails_as_a_walk_finishes_abandons_the_walk_without_its_sweep() -> None:
    """The drain before a walk's sweep can fail the feed, which abandons the walk: the
    sweep must not run after it (its touch window is closed, so a row an event added
    behind the walk's position would read as gone)."""
    rig = Rig(config=msgspec.structs.replace(CONFIG, verify_interval_s=10, top_check=0))
    rig.keeper.start()
    rig.steps(5)
    assert rig.keeper.statistics().exact

    def hook(after: str | None) -> None:
        if after == "/k019":
            rig.store.put("/k0055", NOW)  # behind the walk's position: it never reads it
        elif after == "/k029" and rig.keeper.statistics().verifications == 0:
            rig.store.fail_polls = 1  # the drain before the sweep fails

    rig.store.walk_hook = hook
    for _ in range(30):
        rig.steps(1, advance_ms=1000)
    stats = rig.keeper.statistics()
    assert stats.feed_failures == 1 and stats.resyncs == 1 and stats.exact
    assert rig.held() == rig.table()
    assert stats.repairs.missed == 0, "no write was missed"


def test_the_hourly_verification_walk_repairs_missed_writes() -> None:
    rig = Rig(config=msgspec.structs.replace(CONFIG, verify_interval_s=10, top_check=0))
    rig.keeper.start()
    rig.steps(5)
    rig.store.silent(
        Row(key="/k004", route="product", cadence_s=None, sitemap=False, next_render_at=NOW + 1)
    )
    rig.store.silent(
        Row(key="/ghost", route="blog", cadence_s=None, sitemap=False, next_render_at=NOW)
    )
    rig.store.silent(None, key="/k010")
    for _ in range(16):
        rig.steps(1, advance_ms=1000)
    verify = rig.last().trust.verification
    assert verify.walks >= 1 and not verify.running
    assert rig.held() == rig.table()
    r = rig.keeper.statistics().repairs
    assert (r.missed_added, r.missed_changed, r.missed_removed) == (1, 1, 1)


def test_leased_keys_are_not_published() -> None:
    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    rig.leases.blocked = {key_hash(b"/k034"), key_hash(b"/k033")}
    rig.steps(1, advance_ms=1000)
    assert b"/k034" not in rig.ring.keys and b"/k033" not in rig.ring.keys
    assert len(rig.ring.keys) == 33
    rig.steps(1, advance_ms=5000)
    last = rig.last()
    assert last.now.in_flight == 2 and last.now.unclaimed_estimate == 33
    assert last.trust.publish.last_blocked == 2


def test_a_subscribe_that_fails_at_start_is_retried_and_the_state_stays_unready() -> None:
    rig = Rig()
    rig.store.fail_subscribes = 2
    rig.keeper.start()
    assert rig.last().now.status == "unready" and rig.keeper.statistics().feed_failures == 1
    for _ in range(10):
        rig.steps(1, advance_ms=300)
    assert rig.keeper.statistics().phase == "live"
    assert rig.held() == rig.table()


def _churn(path: str, seed: int, writes: int) -> None:
    """Another process's writes: upserts, reschedules and deletes, in small transactions."""
    import random

    from store import open_store
    from store.rows import RowWrite

    rng = random.Random(seed)
    store = open_store(path)
    try:
        for _ in range(writes // 10):
            ups = [
                RowWrite(
                    key=f"https://shop.example.com/p/{rng.randrange(4000)}",
                    route=rng.choice(["product", "category"]),
                    next_render_at=NOW_REAL() + rng.randrange(-3_600_000, 3_600_000),
                    cadence_s=rng.choice([None, 600]),
                    sitemap=rng.random() < 0.3,
                )
                for _ in range(8)
            ]
            keys = {w.key for w in ups}
            gone = [
                k for k in (f"https://shop.example.com/p/{rng.randrange(4000)}",) if k not in keys
            ]
            store.write(ups, delete=gone)
    finally:
        store.close()


def NOW_REAL() -> int:
    import time

    return time.time_ns() // 1_000_000


def test_with_the_real_store_and_shared_memory_the_keeper_ends_equal_to_the_table(
    backend_url: str,
) -> None:
    import multiprocessing
    import os
    import threading
    import time
    import uuid

    from shm import LeaseTable, ReadyRing, StateBuffer
    from store import open_store, scheduling
    from store.rows import RowWrite
    from workers.segments import KEEPER_STATE_BYTES

    path = backend_url
    store = open_store(path)
    now = NOW_REAL()
    store.write(
        [
            RowWrite(key=f"https://shop.example.com/p/{i}", route="product", next_render_at=now - i)
            for i in range(3000)
        ]
    )
    store.set_route("category", default_cadence_s=3600)
    tag = f"rqk{os.getpid()}{uuid.uuid4().hex[:6]}"
    ring = ReadyRing.create(f"/{tag}r")
    leases = LeaseTable.create(f"/{tag}l")
    state = StateBuffer.create(f"/{tag}s")
    stats = StateBuffer.create(f"/{tag}k", capacity=KEEPER_STATE_BYTES)
    stop = threading.Event()
    keeper = Keeper(
        store,
        ring,
        leases,
        state,
        KeeperConfig(walk_chunk=500),
        node="n1",
        statistics_buffer=stats,
    )
    thread = threading.Thread(target=keeper.run, args=(stop,))
    try:
        thread.start()
        context = multiprocessing.get_context("spawn")
        writer = context.Process(target=_churn, args=(path, 5, 3000))
        writer.start()
        writer.join(120)
        assert writer.exitcode == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            table = {r.key: (r.next_render_at, r.version) for r in store.walk(None, 100_000)}
            queue = keeper.core.queue
            held = {
                r.key: (r.due_at, r.version)
                for r in (queue.held_slot(s) for s in queue.slots.live_slots().tolist())
            }
            if held == table and keeper.statistics().phase == "live":
                break
            time.sleep(0.2)
        assert held == table
        # A publish begun before the queue settled may carry keys deleted since; the
        # second publish after it was begun after.
        settled_generation = ring.generation
        # The keeper's thread asked for a short slice, as a thread of its own here can,
        # and this thread's is untouched (see store.scheduling).
        granted: list[bool] = []
        probe = threading.Thread(target=lambda: granted.append(scheduling.ask_short_slice()))
        probe.start()
        probe.join()
        assert keeper.statistics().short_slice is granted[0]
        assert scheduling.slice_ns() != scheduling.SHORTEST_SLICE_NS

        def settled_publish() -> bool:
            """A ring published since the queue settled, and a report of it that counts
            the churn's events, with the statistics written beside it."""
            snapshot, written = state.read(), stats.read()
            if snapshot is None or written is None:
                return False
            read = decode_queue_state(snapshot.payload)
            record = decode_keeper_statistics(written.payload)
            return (
                liveness(read, NOW_REAL()).live
                and read.trust.exact
                and read.trust.events > 0
                and record.phase == "live"
                and ring.generation >= settled_generation + 2
            )

        wait_for(settled_publish, 60, "a report after the last write")
        snapshot = state.read()
        assert snapshot is not None
        read = decode_queue_state(snapshot.payload)
        assert read.trust.events > 0 and read.trust.repairs.missed == 0
        # Its statistics, written beside queue-state at each publish, with the feed's.
        written = stats.read()
        assert written is not None
        record = decode_keeper_statistics(written.payload)
        assert record.exact and record.events > 0
        assert record.short_slice is granted[0] and record.statistics_write_failures == 0
        assert record.feed is not None and type(record.feed) is FeedStatistics
        assert record.feed.events > 0 and record.feed.polls > 0
        assert record.feed.woken + record.feed.noticed > 0  # the churn's commits woke it
        entries = ring.claim(50)
        assert entries and all(e.due_at <= NOW_REAL() for e in entries)
        assert all(e.key.decode() in table for e in entries)
    finally:
        stop.set()
        thread.join(30)
        for segment in (ring, leases, state, stats):
            segment.close()
            segment.unlink()
        store.close()
    assert not thread.is_alive()


# -- self-checks under a lagging feed (bench churn's false "missed writes") -------------


class StepClock:
    """Wall time that moves `step_ms` at every reading: each feed batch the keeper applies
    seems to take that long, so its feed falls behind a busy writer, as it did under
    bench churn (feed lag up to seconds)."""

    def __init__(self, step_ms: int) -> None:
        self.at = NOW_REAL()
        self.step_ms = step_ms

    def __call__(self) -> int:
        self.at += self.step_ms
        return self.at


LAG_ROWS = 400
LAG_HOT = 100  # the writer rewrites these, as the most overdue rows: the top check's keys


def _lag_key(i: int) -> str:
    return f"https://shop.example.com/lag/{i:04}"


def _reschedule_hot_rows(path: str, seed: int, commits: int) -> None:
    """Another process's reschedules of the hot rows, 10 per commit; each stays overdue
    by days (so in the published top) and lands at a new due time (so a stale copy differs).
    """
    import random
    import time

    from store.rows import RowWrite

    rng = random.Random(seed)
    store = open_url(path, prune_interval_s=None)
    try:
        for _ in range(commits):
            now = NOW_REAL()
            store.write(
                [
                    RowWrite(
                        key=_lag_key(i),
                        route="product",
                        next_render_at=now - 5 * 86_400_000 - rng.randrange(86_400_000),
                    )
                    for i in rng.sample(range(LAG_HOT), 10)
                ]
            )
            time.sleep(0.001)
    finally:
        store.close()


def _held_content(keeper: Keeper) -> dict[str, tuple[object, int, int]]:
    core = keeper.core
    queue = core.queue
    return {
        r.key: (core.classes.get(r.class_id), r.due_at, r.version)
        for r in (queue.held_slot(s) for s in queue.slots.live_slots().tolist())
    }


def _table_content(store: Any) -> dict[str, tuple[object, int, int]]:
    from keeper.classes import classify

    routes = {r.route: r for r in store.routes()}
    default = store.default_cadence_s()
    return {
        r.key: (classify(r, routes, default), r.next_render_at, r.version)
        for r in store.walk(None, 100_000)
    }


def _lagging_keeper_under_churn(
    path: str, config: KeeperConfig
) -> tuple[Keeper, object, list[int]]:
    """A keeper on a real SQLite file whose feed lags a real writer process; stepped until
    the writer is done and the feed has caught up. Returns the keeper, the store, and the
    missed-write count seen after each step."""
    import multiprocessing

    from store.rows import RowWrite

    store = open_url(path, prune_interval_s=None)
    now = NOW_REAL()
    store.write(
        [
            RowWrite(key=_lag_key(i), route="product", next_render_at=now - 1000 * i)
            for i in range(LAG_ROWS)
        ]
    )
    keeper = Keeper(
        store,
        MemoryRing(),
        MemoryLeases(),
        MemoryStateBuffer(),
        config,
        node="n1",
        clock=StepClock(400),
    )
    keeper.start()
    for _ in range(200):
        keeper.step()
        if keeper.statistics().phase == "live":
            break
    assert keeper.statistics().phase == "live"
    missed: list[int] = []
    writer = multiprocessing.get_context("spawn").Process(
        target=_reschedule_hot_rows, args=(path, 7, 150)
    )
    writer.start()
    try:
        while writer.is_alive():
            keeper.step()
            missed.append(keeper.statistics().repairs.missed)
        writer.join(60)
        assert writer.exitcode == 0
        head = store.feed_head()
        for _ in range(2000):  # the feed catches up at a batch or two per step
            keeper.step()
            missed.append(keeper.statistics().repairs.missed)
            if keeper.feed.has_delivered(head) and not keeper.statistics().verification.running:
                break
        assert keeper.feed.has_delivered(head)
        for _ in range(20):  # and the checks read while it lagged are judged
            keeper.step()
            missed.append(keeper.statistics().repairs.missed)
    finally:
        writer.join(5)
    return keeper, store, missed


def test_the_top_check_counts_no_missed_writes_while_the_feed_lags_a_real_writer(
    backend_url: str,
) -> None:
    config = KeeperConfig(
        walk_chunk=100,
        best_k=128,
        feed_poll_limit=4,
        top_check=64,
        top_check_every_s=1,
        verify_interval_s=1_000_000,
    )
    keeper, store, missed = _lagging_keeper_under_churn(backend_url, config)
    try:
        stats = keeper.statistics()
        assert stats.repairs.missed == 0, (
            f"{missed[-1]} false missed writes over {len(missed)} steps"
        )
        assert _held_content(keeper) == _table_content(store)
        assert stats.publish.top_checked >= 64
        assert stats.top_checks_waited > 0, "the feed never lagged a read: nothing was tested"
    finally:
        keeper.close()
        store.close()  # type: ignore[attr-defined]


def test_the_verification_walk_counts_no_missed_writes_while_the_feed_lags_a_real_writer(
    backend_url: str,
) -> None:
    config = KeeperConfig(
        walk_chunk=50,
        best_k=128,
        feed_poll_limit=4,
        top_check=0,
        verify_interval_s=20,
    )
    keeper, store, missed = _lagging_keeper_under_churn(backend_url, config)
    try:
        stats = keeper.statistics()
        assert stats.repairs.missed == 0, (
            f"{missed[-1]} false missed writes over {len(missed)} steps"
        )
        assert _held_content(keeper) == _table_content(store)
        assert stats.verification.walks >= 1
        assert stats.walk_chunks_waited > 0, "the feed never lagged a read: nothing was tested"
        # A real difference is still found and counted, exactly once: corrupt one held row.
        queue = keeper.core.queue
        slot = queue.slot_of(key_hash(_lag_key(3).encode()))
        queue.upsert(
            _lag_key(3).encode(),
            key_hash(_lag_key(3).encode()),
            queue.class_of(slot),
            1,
            queue.version_of(slot),
            NOW_REAL(),
        )
        walks = stats.verification.walks + 2  # then one whole walk began after the damage
        for _ in range(1000):
            keeper.step()
            if keeper.statistics().verification.walks >= walks:
                break
        after = keeper.statistics()
        assert after.verification.walks >= walks
        assert (after.repairs.missed_changed, after.repairs.missed) == (1, 1)
        assert _held_content(keeper) == _table_content(store)
    finally:
        keeper.close()
        store.close()  # type: ignore[attr-defined]


def test_a_ring_drained_by_claims_is_refilled_before_the_next_tick() -> None:
    """Claims, not the clock, set the pace under load: once claimants take the ring below
    `refill_below` of its last publish, the next step publishes again (at most once per
    `refill_min_gap_s`), and the keeper looks again soon while claims are under way,
    less often while the ring lies untouched."""
    config = msgspec.structs.replace(
        RIG_CONFIG, best_k=20, publish_interval_s=1.0, refill_below=0.25, refill_min_gap_s=0.02
    )
    rig = Rig(rows=60, config=config)
    rig.keeper.start()
    rig.steps(8)  # loaded and published
    generation = rig.ring.generation
    rig.ring.take(10)  # half the ring: not yet low, but the keeper watches it
    assert rig.keeper.step() <= config.refill_min_gap_s
    assert rig.ring.generation == generation
    rig.ring.take(6)  # 4 of 20 left: below a quarter
    rig.keeper.step()
    assert rig.ring.generation == generation, "within refill_min_gap_s of the last publish"
    # The last publish's CPU spaces refills too (the next test): a loaded machine must not
    # make this one costly enough to count.
    lifecycle = rig.keeper.lifecycle
    lifecycle.published = msgspec.structs.replace(lifecycle.published, last_cpu_us=100)
    rig.steps(1, advance_ms=20)
    assert rig.ring.generation == generation + 1 and rig.ring.remaining() == 20
    stats = rig.keeper.statistics().publish
    assert stats.refills == 1 and rig.last().trust.publish.refills == 1
    rig.steps(3, advance_ms=20)  # not drained again: no more refills
    assert rig.ring.generation == generation + 1
    rig.clock.advance(100)
    # Untouched since the refill: looked at again after as long as it has lain so.
    assert rig.keeper.step() > config.refill_min_gap_s


def test_a_slow_publish_spaces_the_refills_out() -> None:
    """A publish reads past every leased row ranked above its last kept one, so a fleet
    with many keys in flight makes it slow; refills then wait REFILL_COST_SHARE times
    the last publish's CPU, not just refill_min_gap_s."""
    from keeper.lifecycle import REFILL_COST_SHARE

    config = msgspec.structs.replace(RIG_CONFIG, best_k=20, refill_min_gap_s=0.02)
    rig = Rig(rows=60, config=config)
    rig.keeper.start()
    rig.steps(8)
    lifecycle = rig.keeper.lifecycle
    lifecycle.published = msgspec.structs.replace(lifecycle.published, last_cpu_us=10_000)
    generation = rig.ring.generation
    rig.ring.take(18)
    rig.steps(1, advance_ms=20)
    assert rig.ring.generation == generation, "10 ms publishes: not before 50 ms"
    rig.steps(1, advance_ms=10 * REFILL_COST_SHARE - 20)
    assert rig.ring.generation == generation + 1


def test_the_cursor_is_saved_after_a_publish_at_most_once_a_second_and_on_close() -> None:
    """Each save is a write transaction beside the fleet's completions: publishes every
    0.25 s save the cursor once a second; a restart replays at most that much."""
    config = msgspec.structs.replace(RIG_CONFIG, publish_interval_s=0.25)
    rig = Rig(rows=20, config=config)
    rig.keeper.start()
    rig.steps(4)  # loaded and published: the first publish saved the cursor
    assert rig.ring.generation >= 1
    saved = rig.store.saved["keeper"]
    generation = rig.ring.generation
    rig.store.put("/new", NOW)
    rig.steps(3, advance_ms=250)  # three more publishes within the second
    assert rig.ring.generation == generation + 3
    assert rig.store.saved["keeper"] == saved, "not saved again within the interval"
    rig.steps(1, advance_ms=250)  # a second after the first save
    assert rig.store.saved["keeper"] == saved + 1
    rig.store.put("/newer", NOW)
    rig.steps(1, advance_ms=250)
    assert rig.store.saved["keeper"] == saved + 1
    rig.keeper.close()
    assert rig.store.saved["keeper"] == saved + 2


def test_a_transaction_holding_the_feed_back_shows_in_queue_state_with_its_pid(
    pg_url: str,
) -> None:

    import psycopg

    from store.postgres import PostgresStore
    from store.postgres import sql as pg_sql
    from store.rows import RowWrite

    store = PostgresStore(pg_url)
    store.write([RowWrite(key="/a", route="product", next_render_at=NOW_REAL())])
    keeper = Keeper(
        store, MemoryRing(), MemoryLeases(), MemoryStateBuffer(), KeeperConfig(), node="n1"
    )
    keeper.start()
    holder = psycopg.connect(pg_url)
    try:
        for _ in range(50):
            keeper.step()
            if keeper.statistics().phase == "live":
                break
        holder.execute(
            pg_sql.UPSERT,
            {
                "keys": ["/open"],
                "routes": ["product"],
                "cadences": [None],
                "sitemaps": [False],
                "nexts": [1],
            },
        )
        store.write([RowWrite(key="/b", route="product", next_render_at=NOW_REAL())])

        def held_back() -> bool:
            keeper.step()
            return keeper.queue_state(NOW_REAL(), full=False).trust.feed_held_by_pid != 0

        wait_for(held_back, 30, "the open transaction named as holding the feed back")
        trust = keeper.queue_state(NOW_REAL(), full=False).trust
        assert trust.feed_held_by_pid == holder.info.backend_pid
        assert trust.feed_held_back_ms >= 1000 and trust.feed_lag_ms >= trust.feed_held_back_ms
        assert keeper.core.queue.slot_of(key_hash(b"/b")) < 0  # delayed behind it, not lost
        holder.commit()

        def applied() -> bool:
            keeper.step()
            return keeper.core.queue.slot_of(key_hash(b"/b")) >= 0

        wait_for(applied, 30, "the write held back to be applied", 0.01)
        trust = keeper.queue_state(NOW_REAL(), full=False).trust
        assert keeper.core.queue.slot_of(key_hash(b"/open")) >= 0
        assert keeper.core.queue.slot_of(key_hash(b"/b")) >= 0
        assert trust.feed_held_back_ms == 0 and trust.feed_held_by_pid == 0
    finally:
        holder.close()
        keeper.close()
        store.close()


def test_a_clustered_keeper_holds_its_share_and_rebalances_when_a_node_dies() -> None:

    from keeper_helpers import (
        NOW,
        ManualClock,
        MemoryLeases,
        MemoryRing,
        MemoryStateBuffer,
        MemoryStore,
    )

    from keeper.ownership import winners
    from keeper.runner import ClusterSettings
    from shm import key_hashes
    from store.rows import MemberList

    member = member_record

    clock = ManualClock()
    store = MemoryStore()
    keys = [f"/k{i:03}" for i in range(200)]
    for i, key in enumerate(keys):
        store.put(key, NOW - 1000 * i)
    owners = winners(key_hashes([k.encode() for k in keys]), ["a", "b"]).tolist()
    mine = {k for k, o in zip(keys, owners, strict=True) if o == 0}
    theirs = {k for k, o in zip(keys, owners, strict=True) if o == 1}
    members = [member("a"), member("b")]
    ring = MemoryRing()
    settings = ClusterSettings(ttl_s=4, max_lease_s=10, poll_s=1)
    keeper = Keeper(
        store,
        ring,
        MemoryLeases(),
        MemoryStateBuffer(),
        msgspec.structs.replace(CONFIG, best_k=400),
        node="a",
        clock=clock,
        cluster=settings,
        members=lambda handovers: MemberList(records=members, db_now_ms=clock()),
    )
    keeper.start()

    def held() -> set[str]:
        queue = keeper.core.queue
        return {queue.held_slot(s).key for s in queue.slots.live_slots().tolist()}

    def published() -> set[str]:
        return {k.decode() for k in ring.keys}

    for _ in range(40):
        clock.advance(100)
        keeper.step()
    assert held() == mine and keeper.statistics().exact
    # It joined a live b that has not acknowledged it: its keys were b's, fenced until b's
    # leases on them have surely ended.
    joined = keeper.statistics().cluster
    assert joined is not None and joined.fences and not published()
    while clock() <= joined.fenced_until:
        clock.advance(500)
        keeper.step()
    assert published() and published() <= mine
    # b dies: at the next read of the list the keeper drops nothing, walks for b's rows
    # (rebalancing, not exact, meanwhile), counts them as gained, and fences them while
    # b's leases may live.
    members = [member("a"), member("b", live=False, age=4_500)]
    clock.advance(1000)
    keeper.step()
    stats = keeper.statistics()
    assert stats.phase == "rebalancing" and not stats.exact
    assert "rebalancing" in keeper.queue_state(clock(), full=False).trust.exact_reason
    for _ in range(40):
        clock.advance(100)
        keeper.step()
    stats = keeper.statistics()
    assert held() == mine | theirs and stats.exact and stats.phase == "live"
    assert stats.repairs.gained == len(theirs) and stats.repairs.missed == 0
    assert stats.cluster is not None and stats.cluster.view == ["a"] and stats.cluster.fences
    assert published() and published() <= mine  # b's keys are fenced
    while clock() <= stats.cluster.fenced_until:
        clock.advance(500)
        keeper.step()
    assert published() & theirs  # and published once the fence ends


def test_a_clustered_keeper_counts_its_fenced_due_rows_at_each_full_report() -> None:
    """Its due rows stay counted in now.due; the ones a fence holds back are counted apart
    (queue-state's fenced, the statistics record), and left out of now.claimable and of
    autoscale.due_now. A single node has no fenced group, and every due row claimable."""

    from keeper_helpers import ManualClock, MemoryStore

    from keeper.ownership import winners
    from shm import key_hashes
    from store.rows import MemberList

    member = member_record

    clock = ManualClock()
    store = MemoryStore()
    keys = [f"/k{i:03}" for i in range(200)]
    for i, key in enumerate(keys):
        store.put(key, NOW - 1000 * i if i % 4 else NOW + 3_600_000)  # a quarter not due
    owners = winners(key_hashes([k.encode() for k in keys]), ["a", "b"]).tolist()
    due_mine = sum(1 for i, o in enumerate(owners) if o == 0 and i % 4)
    state = MemoryStateBuffer()
    statistics = MemoryStateBuffer()
    keeper = clustered_keeper(
        store,
        clock,
        # b never acknowledges a's join: every key a owns was b's, fenced until b's leases
        # on them have surely ended.
        lambda handovers: MemberList(records=[member("a"), member("b")], db_now_ms=clock()),
        state=state,
        statistics_buffer=statistics,
    )
    keeper.start()

    def full_report(after: int) -> Any:
        """Step until queue-state holds counts taken after `after`."""
        for _ in range(200):
            clock.advance(100)
            keeper.step()
            written = decode_queue_state(state.last())
            if written.trust.counts_at > after and written.trust.exact:
                return written
        raise AssertionError("no full report")

    written = full_report(NOW)
    fenced = written.fenced
    assert fenced is not None and written.now.due == due_mine > 0
    assert fenced.due == due_mine and written.now.claimable == 0
    assert written.autoscale.due_now == 0
    assert [(r.node, r.reason, r.due) for r in fenced.reasons] == [("b", "awaiting", due_mine)]
    record = decode_keeper_statistics(statistics.last()).cluster
    assert record is not None and record.fenced == fenced and record.claimable == 0
    assert record.counted_at == written.trust.counts_at and fenced.until_ms == record.fenced_until
    # Between full reports the count stands, however often the keeper publishes.
    counted_at = record.counted_at
    clock.advance(100)
    keeper.step()
    again = decode_keeper_statistics(statistics.last()).cluster
    assert again is not None and again.counted_at == counted_at
    # Once the fence has ended, the next full report finds nothing fenced.
    while clock() <= fenced.until_ms:
        clock.advance(500)
        keeper.step()
    written = full_report(fenced.until_ms)
    assert written.fenced is not None and written.fenced.due == 0 and not written.fenced.reasons
    assert written.now.claimable == written.now.due == written.autoscale.due_now == due_mine
    record = decode_keeper_statistics(statistics.last()).cluster
    assert record is not None and record.claimable == due_mine and record.fenced_until == 0

    single = Rig()
    single.steps(60, 100)
    alone = single.last()
    assert alone.fenced is None and alone.now.due > 0
    assert alone.now.claimable == alone.now.due == alone.autoscale.due_now
    assert decode_keeper_statistics(single.statistics.last()).cluster is None


def test_a_change_of_view_reaches_the_workers_before_the_hand_over_is_acknowledged() -> None:
    """On every change of view the keeper publishes the live names to its workers (the
    write marks' owners view), then acknowledges the view with its live leases on the
    keys it no longer owns, their ends in the database's clock."""
    import time
    import uuid

    import numpy as np
    from keeper_helpers import (
        ManualClock,
        MemoryLeases,
        MemoryRing,
        MemoryStateBuffer,
        MemoryStore,
    )

    from keeper.ownership import winners
    from keeper.runner import ClusterSettings
    from shm import key_hashes
    from shm.marks import WriteMarks
    from store.rows import Handover, MemberList, NodeRecord

    def member(name: str, incarnation: int) -> NodeRecord:
        return member_record(name, incarnation=incarnation)

    clock = ManualClock()
    offset = 500  # the database's clock runs this far ahead
    members = [member("a", 1), member("b", 2)]
    leased = key_hashes([f"/leased{i}".encode() for i in range(300)])
    leases = MemoryLeases()
    leases.blocked = {int(h) for h in leased}
    acks: list[tuple[int, list[int], Handover]] = []

    def acknowledge(incarnation: int, view: Any, handover: Handover) -> bool:
        acks.append((incarnation, list(view), handover))
        return True

    marks = WriteMarks.create(f"/rqt{uuid.uuid4().hex[:12]}", capacity=1024)
    try:
        keeper = Keeper(
            MemoryStore(),
            MemoryRing(),
            leases,
            MemoryStateBuffer(),
            CONFIG,
            node="a",
            clock=clock,
            cluster=ClusterSettings(ttl_s=4, max_lease_s=10, poll_s=1, incarnation=1),
            members=lambda handovers: MemberList(
                records=members, db_now_ms=clock() + offset, with_handovers=handovers
            ),
            marks=marks,
            acknowledge=acknowledge,
        )
        keeper.start()
        view = marks.owners()
        assert view is not None and view.nodes == ("a", "b")
        assert marks.confirmed_until() > time.monotonic() * 1000
        incarnation, acked, handover = acks[-1]
        lost = leased[winners(leased, ["a", "b"]) == 1]
        assert (incarnation, acked) == (1, [1, 2])
        assert sorted(handover.key_hashes) == sorted(lost.tolist())
        assert set(handover.expires_at_ms) == {clock() + 60_000 + offset}
        members.append(member("c", 3))  # c joins: a loses the keys c now wins
        for _ in range(30):
            clock.advance(100)
            keeper.step()
        view = marks.owners()
        assert view is not None and view.nodes == ("a", "b", "c")
        incarnation, acked, handover = acks[-1]
        owners = np.array(["a", "b", "c"])[winners(leased, ["a", "b", "c"])]
        assert acked == [1, 2, 3]
        assert sorted(handover.key_hashes) == sorted(leased[owners != "a"].tolist())
    finally:
        marks.close()
        marks.unlink()


def test_a_wall_clock_stepped_forward_ends_no_fence_early() -> None:
    """Fences and the grant window run on the monotonic clock: a step of the wall clock
    (an NTP correction, an operator's `date -s`) leaves a fenced key fenced."""

    from keeper_helpers import (
        NOW,
        ManualClock,
        MemoryLeases,
        MemoryRing,
        MemoryStateBuffer,
        MemoryStore,
    )

    from keeper.runner import ClusterSettings
    from store.rows import MemberList, NodeRecord

    def member(name: str, incarnation: int) -> NodeRecord:
        return member_record(name, incarnation=incarnation)

    wall, mono = ManualClock(), ManualClock(5_000)
    store = MemoryStore()
    for i in range(200):
        store.put(f"/k{i:03}", NOW - 1000 * i)
    members = [member("a", 1), member("b", 2)]  # b never acknowledges a
    ring = MemoryRing()
    keeper = Keeper(
        store,
        ring,
        MemoryLeases(),
        MemoryStateBuffer(),
        msgspec.structs.replace(CONFIG, best_k=400),
        node="a",
        clock=wall,
        monotonic=mono,
        cluster=ClusterSettings(ttl_s=4, max_lease_s=10, poll_s=1, incarnation=1),
        members=lambda handovers: MemberList(
            records=members, db_now_ms=wall(), with_handovers=handovers
        ),
    )
    keeper.start()
    for _ in range(20):
        wall.advance(100)
        mono.advance(100)
        keeper.step()
    stats = keeper.statistics().cluster
    assert stats is not None and stats.fences and not ring.keys
    # The fence is shown in the wall clock's terms, where people read it.
    assert wall() < stats.fenced_until <= wall() + 2_000 + 10_000
    wall.advance(600_000)  # ten minutes forward, in a moment
    for _ in range(20):
        wall.advance(100)
        mono.advance(100)
        keeper.step()
    assert not ring.keys, "a wall clock step ended the fence"
    for _ in range(150):
        wall.advance(100)
        mono.advance(100)
        keeper.step()
    assert ring.keys  # once the fence ends on the monotonic clock


def test_each_full_report_writes_the_sites_listing_and_queue_state_names_the_top_sites() -> None:
    rig = Rig(rows=0)
    for i in range(30):  # a.example: 15 due, b.example: 10 (one not yet), c.example: 5
        site = "a" if i < 15 else "b" if i < 25 else "c"
        rig.store.put(f"https://www.{site}.example/p/{i}", NOW - 1000 * i if i != 24 else NOW + 9)
    rig.store.put("/no/site", NOW - 5)
    rig.keeper.start()
    rig.steps(5)
    assert rig.site_list.writes, "no listing yet"
    listing = decode_site_list(rig.site_list.last())
    state = rig.last()
    assert listing.generated_at == state.trust.counts_at and listing.node == "n1"
    assert [(r.site, r.due, r.held) for r in listing.sites.top] == [
        ("a.example", 15, 15),
        ("b.example", 9, 10),
        ("c.example", 5, 5),
    ]
    assert listing.site_hashes == [site_hash(r.site.encode()) for r in listing.sites.top]
    assert listing.sites.no_site_due == 1 and listing.sites.with_due == 3
    assert not listing.truncated
    assert state.sites == listing.sites  # fewer than queue-state's few
    assert rig.keeper.statistics().sites == 3
    # Written once a full report, not at every queue-state write.
    writes = len(rig.site_list.writes)
    rig.steps(3, advance_ms=1000)
    assert len(rig.site_list.writes) == writes and len(rig.state.writes) > writes
    rig.steps(1, advance_ms=5000)
    assert len(rig.site_list.writes) == writes + 1


def test_a_failed_sites_listing_write_is_counted_and_the_keeper_goes_on() -> None:
    rig = Rig(rows=3)
    rig.keeper.site_list_buffer = BrokenBuffer()
    rig.keeper.start()
    rig.steps(5)
    assert rig.keeper.statistics().site_list_write_failures >= 1
    assert rig.last().now.status == "ready"


@contextlib.contextmanager
def site_table(permits: int = 8) -> Iterator[SiteTable]:
    """A real shm SiteTable of this test's own, unlinked after."""
    tag = f"t{os.getpid()}x{uuid.uuid4().hex[:8]}"
    table = SiteTable.create(segment_name(tag, "sites"), capacity=64, permits=permits)
    try:
        yield table
    finally:
        table.close()
        table.unlink()


def live_rig(table: SiteTable) -> Rig:
    """A rig over `table`, its keeper started and live on no rows."""
    rig = Rig(rows=0, site_table=table)
    rig.keeper.start()
    rig.steps(10)
    return rig


def test_with_a_real_site_table_a_publish_keeps_a_capped_site_to_its_permits() -> None:
    """shm's SiteTable, a.example capped at 2 with one permit taken: a publish holds one
    of its keys (the permit left) and the slack, in rank order, and every key of the
    other site; a permit given back lets one more in at the next publish."""
    with site_table(permits=4) as table:
        capped = site_hash(b"a.example")
        assert table.configure(capped, 2, None)
        rig = Rig(rows=0, site_table=table)
        for i in range(20):  # a.example's keys are the latest
            rig.store.put(f"https://a.example/p/{i}", NOW - 100_000 + i)
            rig.store.put(f"https://b.example/p/{i}", NOW - 50_000 + i)
        permit = table.take_permit(capped, NOW, 60_000)
        assert permit
        rig.keeper.start()
        rig.steps(10)
        assert rig.keeper.statistics().phase == "live"
        rig.steps(1, advance_ms=1000)
        a_keys = [k for k in rig.ring.keys if k.startswith(b"https://a.example/")]
        assert a_keys == [b"https://a.example/p/0", b"https://a.example/p/1"]
        assert len(rig.ring.keys) == 22
        assert rig.keeper.statistics().publish.last_site_skipped == 18
        assert table.release(capped, permit)
        rig.steps(1, advance_ms=1000)
        a_keys = [k for k in rig.ring.keys if k.startswith(b"https://a.example/")]
        assert len(a_keys) == 3 and len(rig.ring.keys) == 23


def test_sites_settings_are_put_in_force_at_load_and_from_the_feed() -> None:
    """The keeper's core takes the store's site settings in (at the feed's open, then each
    SiteEvent) and the runner puts them in the node's site table, cleared ones too."""
    with site_table() as table:
        rig = Rig(rows=0, site_table=table)
        rig.store.set_site(SiteSettings(site="a.example", max_in_flight=3))
        rig.store.set_site(SiteSettings(site="b.example", min_interval_ms=500))
        rig.keeper.start()
        rig.steps(10)
        a, b = site_hash(b"a.example"), site_hash(b"b.example")
        assert table.info(a, NOW).max_in_flight == 3
        assert table.info(b, NOW).min_interval_ms == 500
        rig.store.set_site(SiteSettings(site="a.example", max_in_flight=1, min_interval_ms=10))
        rig.store.set_site(SiteSettings(site="b.example"))  # cleared: the default again
        rig.steps(3, advance_ms=1000)
        info = table.info(a, NOW)
        assert (info.max_in_flight, info.min_interval_ms) == (1, 10)
        assert not table.info(b, NOW).min_interval_set
        stats = rig.keeper.statistics()
        assert stats.site_events == 2 and stats.site_settings_unapplied == 0


def test_a_workers_site_settings_put_in_force_while_the_keeper_applied_older_ones_stay() -> None:
    """A PUT's worker writes the store, then the site table at once (api.sites); a keeper
    that read the site's older row before that write puts nothing older in force after
    it: its configure is superseded and it reads the site again."""
    with site_table() as table:
        rig = live_rig(table)
        a = site_hash(b"a.example")
        rig.store.set_site(SiteSettings(site="a.example", max_in_flight=4))
        table.configure(a, 4, None)
        take = rig.keeper.core.take_site_settings

        def the_next_put_lands_as_they_are_applied() -> list[SiteSettings]:
            taken = take()  # the first PUT's row, as the feed read it
            if taken:
                rig.store.set_site(
                    SiteSettings(site="a.example", max_in_flight=4, min_interval_ms=250)
                )
                table.configure(a, 4, 250)
            return taken

        rig.keeper.core.take_site_settings = the_next_put_lands_as_they_are_applied  # type: ignore[method-assign]
        rig.steps(1, advance_ms=1000)
        info = table.info(a, NOW)
        assert (info.max_in_flight, info.min_interval_ms) == (4, 250)
        assert rig.keeper.statistics().site_events >= 1
        rig.keeper.core.take_site_settings = take  # type: ignore[method-assign]
        rig.steps(3, advance_ms=1000)  # the second PUT's entry: the same settings
        info = table.info(a, NOW)
        assert (info.max_in_flight, info.min_interval_ms) == (4, 250)


def test_a_site_a_worker_configured_during_a_read_is_read_again_for_a_newer_write() -> None:
    """The keeper reserves its version; a worker's PUT lands (store, then the site table),
    then another node's write to the same site; the feed's read delivers both entries with
    the newest row. Its configure is superseded by the worker's, and no entry is left to
    bring the newest row: the keeper reads the site again and puts it in force."""
    with site_table() as table:
        rig = live_rig(table)
        a = site_hash(b"a.example")
        drain = rig.keeper.feed.drain
        writes = iter([True])

        def writes_land_before_the_read(*args: Any, **kwargs: Any) -> Any:
            if next(writes, False):
                rig.store.set_site(SiteSettings(site="a.example", max_in_flight=2))
                table.configure(a, 2, None)  # the worker's, at once
                rig.store.set_site(
                    SiteSettings(site="a.example", max_in_flight=1, min_interval_ms=100)
                )
            return drain(*args, **kwargs)

        rig.keeper.feed.drain = writes_land_before_the_read  # type: ignore[method-assign]
        rig.steps(3, advance_ms=1000)
        info = table.info(a, NOW)
        assert (info.max_in_flight, info.min_interval_ms) == (1, 100)
        assert rig.keeper.statistics().site_settings_unapplied == 0


def test_a_lone_clustered_keeper_whose_membership_lapsed_walks_its_rows_back() -> None:
    """Its heartbeat went past the TTL (a database outage): the first read after shows it
    not live, so it owns nothing and drops every row; when its heartbeat lands it owns
    them all again, though no other node's keys moved to it, and must walk them back."""

    from keeper_helpers import NOW, ManualClock, MemoryStore

    from store.rows import MemberList

    clock = ManualClock()
    store = MemoryStore()
    keys = [f"/k{i:03}" for i in range(100)]
    for i, key in enumerate(keys):
        store.put(key, NOW - 1000 * i)
    members = [member_record("a")]
    keeper = clustered_keeper(
        store, clock, lambda handovers: MemberList(records=members, db_now_ms=clock())
    )
    keeper.start()

    def held() -> set[str]:
        queue = keeper.core.queue
        return {queue.held_slot(s).key for s in queue.slots.live_slots().tolist()}

    def settle() -> None:
        for _ in range(40):
            clock.advance(100)
            keeper.step()

    settle()
    assert held() == set(keys) and keeper.statistics().exact
    members = [member_record("a", live=False, age=5_000)]
    settle()
    assert held() == set()
    members = [member_record("a")]
    settle()
    stats = keeper.statistics()
    assert held() == set(keys) and stats.exact and stats.phase == "live"


def test_a_feed_that_fails_in_the_top_checks_drain_drops_its_read_before_anything_else(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The failure is the check's outcome, told once the check is over: what it calls for
    (the read dropped unjudged first) is done before the round's other actions."""
    from keeper.lifecycle import TOP_CHECK_DRAIN_MS, Action, CheckTop, DropTopCheck

    rig = Rig()
    rig.keeper.start()
    rig.steps(5)
    read = rig.store.get_many_at

    def read_then_fail(keys: list[str]) -> Any:
        rig.store.fail_polls = 1  # the check's drain, after its read, fails
        return read(keys)

    monkeypatch.setattr(rig.store, "get_many_at", read_then_fail)
    done: list[Action] = []
    perform = rig.keeper._do

    def recorded(action: Action) -> Any:
        done.append(action)
        return perform(action)

    monkeypatch.setattr(rig.keeper, "_do", recorded)
    rig.steps(1, advance_ms=61_000)
    assert rig.keeper.statistics().feed_failures == 1
    assert done[done.index(CheckTop(drain_ms=TOP_CHECK_DRAIN_MS)) + 1] == DropTopCheck()
    assert rig.keeper._top.pending is None and not rig.keeper.statistics().exact


def test_a_clustered_keeper_says_why_it_waits_and_loads_once_the_member_list_has_it() -> None:
    from keeper_helpers import ManualClock, MemoryStore

    from keeper.runner import ClusterSettings
    from store.rows import MemberList, NodeRecord

    clock = ManualClock()
    store = MemoryStore()
    for i in range(35):
        store.put(f"/k{i:03}", NOW - 1000 * i)
    members: list[NodeRecord] = []
    refusals = [ConnectionError("refused")]

    def read(handovers: bool) -> MemberList:
        if refusals:
            raise refusals.pop()
        return MemberList(records=members, db_now_ms=clock())

    state = MemoryStateBuffer()
    keeper = clustered_keeper(
        store,
        clock,
        read,
        state=state,
        cluster=ClusterSettings(ttl_s=4, max_lease_s=10, poll_s=1, peer_wait_s=0),
    )

    def now() -> tuple[str, str, str]:
        record = decode_queue_state(state.last())
        return record.now.status, record.trust.phase, record.now.status_reason

    keeper.start()
    assert now() == ("unready", "starting", "cannot read the member list (refused)")
    assert keeper.step() == 1.0 and not keeper.feed.open
    clock.advance(1000)
    keeper.step()
    assert now() == ("unready", "starting", "this node is not in the member list yet")
    members.append(member_record("a"))
    clock.advance(499)
    keeper.step()
    assert now()[2] == "this node is not in the member list yet", "read again at 0.5 s"
    clock.advance(1)
    keeper.step()
    assert keeper.feed.open and keeper.statistics().cluster is not None
    for _ in range(5):
        keeper.step()
    assert now() == ("ready", "live", "publishing")


class _NoRoomForClasses(MemoryStateBuffer):
    """A state buffer too small for a record with per-class rows."""

    def write(self, payload: bytes, now_ms: int) -> int:
        if decode_queue_state(payload).lateness.classes:
            raise ValueError("too large for the buffer")
        return super().write(payload, now_ms)


def test_a_record_too_large_for_its_buffer_is_written_without_its_per_class_detail() -> None:
    rig = Rig()
    rig.keeper.state_buffer = rig.state = _NoRoomForClasses()
    rig.keeper.start()
    rig.steps(5)
    rig.steps(1, advance_ms=5000)  # a full report, with its counts
    last = rig.last()
    assert not last.lateness.classes and not last.lateness.by_route
    assert last.lateness.classes_truncated and last.now.due == 35 and last.trust.exact
    stats = rig.keeper.statistics()
    assert stats.state_writes == len(rig.state.writes) and stats.state_write_failures == 0
    assert len(rig.statistics.writes) == len(rig.state.writes), "one statistics record each"
