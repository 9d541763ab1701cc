"""The feed ring: writers hand their log records over in shared memory; a consumer takes
them only while they continue its cursor exactly, and reads SQLite otherwise."""

from __future__ import annotations

import multiprocessing
import os
import random
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from shm.segment import LayoutMismatch
from shm.state import StateBuffer
from store.base import FeedBatch, RowRecords
from store.rows import Completion, Row, RowEvent, RowWrite
from store.schema import KIND_ROUTE, KIND_ROW
from store.sqlite import SqliteStore
from store.sqlite import feed as sqlite_feed
from store.sqlite import sql as sqlite_sql
from store.sqlite.feed import SqliteSubscription
from store.sqlite.feed_ring import (
    PAYLOAD_BYTES,
    FeedHandoff,
    FeedRing,
    FeedRingStatistics,
    LogRecord,
    decode_record,
    ring_name,
)

SLOTS = 16


@pytest.fixture
def ring() -> Iterator[FeedRing]:
    made = FeedRing.create(f"/rqtest.{secrets.token_hex(4)}.feed", SLOTS)
    yield made
    made.close()
    made.unlink()


def record(seq: int, stamp: int, key: str = "/a", kind: int = KIND_ROW) -> LogRecord:
    return (seq, kind, key, stamp, "product", None, 0, 1_000, None, None, 1, None, 0, 0, None, None)


def encode(value: LogRecord) -> bytes:
    return msgspec.msgpack.encode(value)


def put(key: str, at: int = 1_000) -> RowWrite:
    return RowWrite(key=key, route="product", next_render_at=at)


# -- the ring --------------------------------------------------------------------------


def test_an_entry_is_got_whole_right_after_its_previous_stamp(ring: FeedRing) -> None:
    assert ring.put(5, -7, encode(record(5, 11)))
    assert ring.ready(5, -7)
    got = ring.get(5, -7)
    assert got is not None and decode_record(got) == record(5, 11)
    assert ring.statistics() == FeedRingStatistics(
        name=ring.name, slots=SLOTS, published=0, missed=0, too_large=0, busy=0
    )


def test_a_commits_entries_go_in_with_one_call_each_as_put_would(ring: FeedRing) -> None:
    entries = [(seq, seq - 1, encode(record(seq, seq))) for seq in range(3, 8)]
    too_large = (8, 7, b"x" * (PAYLOAD_BYTES + 1))
    assert ring.put_many([*entries, too_large]) == len(entries)
    for seq, prev, payload in entries:
        assert ring.get(seq, prev) == payload
    assert ring.get(8, 7) is None and ring.statistics().too_large == 1


def test_an_entry_after_another_stamp_or_for_another_seq_is_refused(ring: FeedRing) -> None:
    ring.put(5, 3, encode(record(5, 11)))
    assert ring.get(5, 4) is None  # another log: does not continue this cursor
    assert not ring.ready(5, 4)
    assert ring.get(5 + SLOTS, 3) is None  # the same slot, another lap
    assert ring.get(6, 11) is None  # never written: the slot is EMPTY


def test_a_lapped_entry_is_gone(ring: FeedRing) -> None:
    ring.put(3, 0, encode(record(3, 1)))
    ring.put(3 + SLOTS, 9, encode(record(3 + SLOTS, 2)))
    assert ring.get(3, 0) is None
    assert ring.get(3 + SLOTS, 9) is not None


def test_an_entry_too_large_for_a_slot_is_refused_and_counted(ring: FeedRing) -> None:
    assert not ring.put(1, 0, b"x" * (PAYLOAD_BYTES + 1))
    assert ring.put(2, 0, b"x" * PAYLOAD_BYTES)
    assert ring.statistics().too_large == 1


def test_a_slot_a_killed_writer_left_mid_copy_is_skipped_and_counted(ring: FeedRing) -> None:
    ring.put(4, 0, encode(record(4, 1)))
    base = ring._first + 4 * (512 // 8)
    ring._words.store(base, 0)  # as a writer SIGKILLed between its swap and its last store
    assert ring.get(4, 0) is None
    assert not ring.put(4 + SLOTS, 0, encode(record(4 + SLOTS, 1)))
    assert ring.statistics().busy == 1


def test_a_run_is_read_in_one_call_up_to_the_first_slot_not_holding_its_entry(
    ring: FeedRing,
) -> None:
    entries = [(seq, seq - 1, encode(record(seq, seq))) for seq in range(3, 9)]
    ring.put_many(entries)
    # As get reads them one by one: each entry's previous stamp and its payload.
    assert ring.get_run(3, 100) == ([e[1] for e in entries], [e[2] for e in entries])
    assert ring.get_run(3, 2) == ([2, 3], [entries[0][2], entries[1][2]])
    assert ring.get_run(9, 100) == ([], [])  # never written: the slot is EMPTY
    assert ring.get_run(3 + SLOTS, 100) == ([], [])  # the same slots, another lap
    ring._words.store(ring._first + 6 * (512 // 8), 0)  # a writer mid-copy in entry 6
    assert ring.get_run(3, 100) == ([2, 3, 4], [e[2] for e in entries[:3]])
    ring.put(9 + SLOTS, 8, encode(record(9 + SLOTS, 9)))  # a lap ahead: not entry 9
    assert ring.get_run(7, 100)[0] == [6, 7]


def test_a_run_reads_wrap_around_the_ring(ring: FeedRing) -> None:
    entries = [(seq, seq - 1, encode(record(seq, seq))) for seq in range(SLOTS - 2, SLOTS + 3)]
    ring.put_many(entries)
    assert ring.get_run(SLOTS - 2, 100)[1] == [e[2] for e in entries]


def test_a_run_never_reads_outside_the_region(ring: FeedRing) -> None:
    words, first = ring._words, ring._first
    with pytest.raises(IndexError):
        words.seqlock_run(first, 512 // 8, SLOTS + 1, 1, 10, PAYLOAD_BYTES)  # one slot too many
    with pytest.raises(IndexError):
        words.seqlock_run(first, 512 // 8, SLOTS, 1, 10, PAYLOAD_BYTES + 9)  # past a slot
    with pytest.raises(IndexError):
        words.seqlock_run(-1, 512 // 8, SLOTS, 1, 10, PAYLOAD_BYTES)


def test_a_payload_that_does_not_decode_is_no_record() -> None:
    assert decode_record(b"\xc1 not msgpack") is None
    assert decode_record(msgspec.msgpack.encode([1, 2, 3])) is None  # wrong shape
    assert decode_record(encode(record(1, 2))) == record(1, 2)


def test_attach_refuses_a_segment_of_another_kind() -> None:
    name = f"/rqtest.{secrets.token_hex(4)}.state"
    other = StateBuffer.create(name, 4096)
    try:
        with pytest.raises(LayoutMismatch, match="kind 'state_buffer', expected 'feed_ring'"):
            FeedRing.attach(name)
    finally:
        other.close()
        other.unlink()


def test_a_ring_is_created_with_every_slot_empty(ring: FeedRing) -> None:
    attached = FeedRing.attach(ring.name)
    try:
        assert attached.slots == SLOTS
        assert all(not attached.ready(seq, 0) for seq in range(SLOTS))
        assert all(attached.put(seq, 0, b"\x90") for seq in range(1, SLOTS + 1))
    finally:
        attached.close()


# -- the writers' handoff --------------------------------------------------------------


def handoff_to(ring: FeedRing) -> FeedHandoff:
    handoff = FeedHandoff()
    handoff.refresh([ring.name.removesuffix(".feed")])
    assert handoff.rings and handoff.failed == 0
    return handoff


def test_the_handoff_chains_row_records_and_marks_a_route_missed(ring: FeedRing) -> None:
    handoff = handoff_to(ring)
    records = [record(1, 10), record(2, 20, "product", KIND_ROUTE), record(3, 30)]
    handoff.hand_over(records, 0, whole=True)
    assert ring.get(1, 0) is not None
    assert ring.get(2, 10) is None  # routes are read from SQLite
    assert ring.get(3, 20) is not None  # chained after the route entry's stamp
    stats = ring.statistics()
    assert (stats.published, stats.missed) == (2, 1)
    handoff.close()


def test_a_partial_or_oversized_transaction_is_only_marked_missed(ring: FeedRing) -> None:
    handoff = handoff_to(ring)
    handoff.hand_over([record(1, 10)], 0, whole=False)
    too_many = [record(seq, seq) for seq in range(1, SLOTS // 4 + 2)]
    handoff.hand_over(too_many, 0, whole=True)
    assert ring.get(1, 0) is None
    assert ring.statistics().missed == 2
    handoff.close()


def test_refresh_drops_a_consumer_gone_and_counts_one_not_made(ring: FeedRing) -> None:
    handoff = handoff_to(ring)
    handoff.refresh(["/rqtest.never-made"])
    assert handoff.rings == () and handoff.failed == 1
    handoff.hand_over([record(1, 10)], 0, whole=True)  # nobody to hand over to
    assert ring.get(1, 0) is None
    handoff.close()


# -- through the store -----------------------------------------------------------------


def rows_of(sub: SqliteSubscription, state: dict[str, Row]) -> None:
    """Apply whatever the feed has now."""
    while True:
        batch = sub.poll(50)
        for event in batch.events:
            if isinstance(event, RowEvent):
                if event.row is None:
                    state.pop(event.key, None)
                else:
                    state[event.key] = event.row
        if not batch.more:
            return


def table(store: SqliteStore) -> dict[str, Row]:
    return {row.key: row for row in store.walk(None, 1_000_000)}


def test_a_consumer_takes_a_writers_entries_from_the_ring(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    store.write([put("/a"), put("/b")])
    store.write([put("/c")], delete=["/a"])
    assert sub.wait(0) is True  # the ring answers, no system call
    batch = sub.poll()
    assert [(e.key, e.row) for e in batch.events if isinstance(e, RowEvent)] == [
        ("/b", store.get("/b")),
        ("/c", store.get("/c")),
        ("/a", None),
    ]
    assert batch.cursor == store.feed_head()
    stats = sub.statistics()
    assert stats.ring_entries == 4 and stats.ring is not None and stats.ring.published == 4
    assert sub.wait(0) is False
    sub.close()


def test_a_poll_for_records_answers_the_rings_entries_as_records(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    store.write([put("/a"), put("/b")])
    store.write([put("/c")], delete=["/a"])
    got = sub.poll_records()
    assert isinstance(got, RowRecords)  # the ring's: row entries only, no event made
    assert [r[2] for r in got.records] == ["/b", "/c", "/a"]  # each at its key's last entry
    assert got.batch().events == [
        RowEvent(key="/b", row=store.get("/b")),
        RowEvent(key="/c", row=store.get("/c")),
        RowEvent(key="/a", row=None),
    ]
    assert got.cursor == store.feed_head() and not got.more
    assert sub.statistics().coalesced == 1 and sub.statistics().events == 3
    store.set_route("product", default_cadence_s=60)  # not a row entry: read from SQLite
    routed = sub.poll_records()
    assert isinstance(routed, FeedBatch) and len(routed.events) == 1
    sub.close()


def test_ring_and_sqlite_deliver_the_same_state(store: SqliteStore) -> None:
    ringed = store.subscribe("ringed")
    plain = store.subscribe("plain")
    ring, plain._ring = plain._ring, None
    assert ring is not None
    ring.close()
    ring.unlink()
    seen_ringed: dict[str, Row] = {}
    seen_plain: dict[str, Row] = {}
    rng = random.Random(7)
    keys = [f"/k{i}" for i in range(40)]
    for step in range(300):
        roll = rng.random()
        if roll < 0.6:
            store.write([put(rng.choice(keys), rng.randrange(10_000))])
        elif roll < 0.75:
            store.write(delete=[rng.choice(keys)])
        elif roll < 0.9:
            present = [k for k in keys if k in table(store)]
            if present:
                store.complete([Completion(key=rng.choice(present), outcome="rendered", now=5)])
        elif roll < 0.95:
            store.set_route(f"r{step % 3}", default_cadence_s=60 + step)
        else:
            store.write([put("/long/" + "x" * PAYLOAD_BYTES)])  # too large for a slot
        if step % 7 == 0:
            rows_of(ringed, seen_ringed)
        if step % 11 == 0:
            rows_of(plain, seen_plain)
    rows_of(ringed, seen_ringed)
    rows_of(plain, seen_plain)
    assert seen_ringed == seen_plain == table(store)
    stats = ringed.statistics()
    assert stats.ring is not None
    assert stats.ring_entries > 0 and stats.ring.missed > 0 and stats.ring.too_large > 0
    assert plain.statistics().ring_entries == 0
    ringed.close()
    plain.close()


def test_completes_ring_records_are_the_records_the_log_reads(store: SqliteStore) -> None:
    """complete hands over records built from the rows its statements returned and the
    log's own entries rather than reading them back with POLL: each is the record POLL
    reads after the commit, for every outcome, a key named twice (every record of it
    carries the row as the transaction left it), a key gone before its next completion,
    a missing key, and both the shared-`now` and the per-key statement."""
    sub = store.subscribe("keeper")
    ring = sub._ring
    assert ring is not None
    store.write([put(f"/k{i}") for i in range(7)])
    sub.poll()
    conn = store._state().conn
    before, prev_stamp = sqlite_feed.head(conn)
    out = store.complete(
        [
            Completion(key="/k0", outcome="rendered", now=10),
            Completion(key="/k1", outcome="failed", now=10),
            Completion(key="/k2", outcome="gone", now=10),
            Completion(key="/k3", outcome="rendered", now=10),
            Completion(key="/k3", outcome="gone", now=11),
            Completion(key="/k4", outcome="gone", now=10),
            Completion(key="/k4", outcome="rendered", now=12),
            Completion(key="/k5", outcome="rendered", now=10, next_render_at=99),
            Completion(key="/k6", outcome="failed", now=10),
            Completion(key="/k6", outcome="rendered", now=12),
            Completion(key="/missing", outcome="rendered", now=10),
        ]
    )
    assert [None if row is None else (row.key, row.last_outcome) for row in out] == [
        ("/k0", "rendered"),
        ("/k1", "failed"),
        None,
        ("/k3", "rendered"),
        None,
        None,
        None,
        ("/k5", "rendered"),
        ("/k6", "failed"),
        ("/k6", "rendered"),
        None,
    ]
    assert out[7] is not None and out[7].next_render_at == 99
    assert out[9] == store.get("/k6") and out[0] == store.get("/k0")
    polled = conn.execute(sqlite_sql.POLL, (before, 100)).fetchall()
    assert [(r[2], r[4] is None) for r in polled] == [
        ("/k0", False),  # round 1: rendered (key order), failed, gone
        ("/k3", True),
        ("/k5", False),
        ("/k1", False),
        ("/k6", False),
        ("/k2", True),
        ("/k4", True),
        ("/k6", False),  # round 2
        ("/k3", True),
    ]
    ringed = []
    for seq, _kind, _key, stamp, *_ in polled:
        payload = ring.get(seq, prev_stamp)
        assert payload is not None
        ringed.append(decode_record(payload))
        prev_stamp = stamp
    assert ringed == polled
    events = [e for e in sub.poll().events if isinstance(e, RowEvent)]
    assert {e.key: e.row for e in events} == {r[2]: store.get(r[2]) for r in polled}
    stats = sub.statistics()  # every entry, the write's 7 too, taken from the ring
    assert stats.ring_entries == 7 + len(polled)
    assert stats.ring is not None and stats.ring.missed == 0
    sub.close()


def test_a_commit_the_ring_lacks_part_of_is_read_from_sqlite_whole(store: SqliteStore) -> None:
    """The ring holds the first entry of a commit but not the second (too large). The
    writer bumped `missed` before it posted, so the poll that takes the post reads SQLite
    rather than stopping at the gap with the post spent (and the wait timing out)."""
    sub = store.subscribe("keeper")
    long_key = "/long/" + "x" * PAYLOAD_BYTES
    store.write([put("/a"), put(long_key)])
    assert [e.key for e in sub.poll().events if isinstance(e, RowEvent)] == ["/a", long_key]
    assert sub.statistics().ring_entries == 0
    assert sub.wait(0) is False
    store.write([put("/b")])
    assert [e.key for e in sub.poll().events if isinstance(e, RowEvent)] == ["/b"]
    assert sub.statistics().ring_entries == 1  # caught up in SQLite: the ring again
    sub.close()


def test_a_corrupt_slot_is_read_from_sqlite(store: SqliteStore) -> None:
    sub = store.subscribe("keeper")
    store.write([put("/a")])
    ring = sub._ring
    assert ring is not None
    seq = sub.statistics().seq + 1
    base = ring._first + (seq % ring.slots) * (512 // 8)
    start = base * 8 + 24
    ring._segment.mmap[start : start + 4] = b"\xc1\xc1\xc1\xc1"  # not msgpack
    batch = sub.poll()
    assert [e.key for e in batch.events if isinstance(e, RowEvent)] == ["/a"]
    assert sub.statistics().ring_entries == 0
    sub.close()


def _subscribe_and_die(path: str, ready: object) -> None:
    store = SqliteStore(path)
    store.subscribe("keeper")
    ready.set()  # type: ignore[attr-defined]
    time.sleep(60)


def test_the_next_subscription_removes_the_ring_a_killed_consumer_left(
    store: SqliteStore,
) -> None:
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    child = context.Process(target=_subscribe_and_die, args=(str(store.path), ready))
    child.start()
    assert ready.wait(60)
    os.kill(child.pid or 0, signal.SIGKILL)
    child.join(30)
    left = ring_name(_wake_of(store, "keeper"))
    assert Path("/dev/shm", left.lstrip("/")).exists()
    sub = store.subscribe("keeper")
    assert not Path("/dev/shm", left.lstrip("/")).exists()
    sub.close()


def _wake_of(store: SqliteStore, consumer: str) -> str:
    found = store._read(
        "wake",
        lambda c: c.execute("SELECT wake FROM feed_consumers WHERE consumer = ?", (consumer,)),
    ).fetchone()
    return str(found[0])


def _writer(path: str, seed: int, start: object, writes: int) -> None:
    store = SqliteStore(path)
    rng = random.Random(seed)
    start.wait(60)  # type: ignore[attr-defined]
    for _ in range(writes):
        keys = [f"/k{rng.randrange(500)}" for _ in range(rng.randrange(1, 6))]
        if rng.random() < 0.2:
            store.write(delete=list(dict.fromkeys(keys)))
        else:
            store.write([put(key, rng.randrange(100_000)) for key in dict.fromkeys(keys)])
    store.close()


def test_writer_processes_one_killed_mid_stream_feed_an_exact_consumer(
    store: SqliteStore,
) -> None:
    """Three writers race flat out, one is SIGKILLed mid-stream (it may die between a
    commit and its handoff, or in the middle of a slot); the consumer ends equal to the
    table, having taken entries from the ring and read SQLite where the ring fell short."""
    sub = store.subscribe("keeper")
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    # Writer 0 never runs out of writes, so it is mid-stream whenever the kill comes (a
    # fixed count finished before the kill on a fast machine).
    writers = [
        context.Process(target=_writer, args=(str(store.path), seed, start, writes))
        for seed, writes in enumerate((10**9, 3_000, 3_000))
    ]
    for writer in writers:
        writer.start()
    start.set()
    seen: dict[str, Row] = {}
    killed = False
    began = time.monotonic()
    while not killed or any(w.is_alive() for w in writers[1:]):
        if not killed and time.monotonic() - began > 0.5:
            os.kill(writers[0].pid or 0, signal.SIGKILL)
            killed = True
        sub.wait(0.05)
        rows_of(sub, seen)
        assert time.monotonic() - began < 240
    for writer in writers:
        writer.join(30)
    assert [w.exitcode for w in writers] == [-signal.SIGKILL, 0, 0]
    rows_of(sub, seen)
    assert seen == table(store)
    stats = sub.statistics()
    assert stats.ring_entries > 0 and stats.polls > 0
    sub.close()


def test_a_busy_consumer_gathers_commits_before_it_blocks(
    store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a poll that delivered, wait() first sleeps GATHER_S and looks at the ring
    again, so a writer running flat out seldom has to wake a consumer blocked on its
    semaphore; after a poll that found nothing it blocks at once."""
    sub = store.subscribe("keeper")
    store.write([put("/a")])
    assert len(sub.poll().events) == 1
    slept: list[float] = []

    def commit_while_asleep(seconds: float) -> None:
        slept.append(seconds)
        store.write([put("/b")])

    monkeypatch.setattr("store.sqlite.feed.time.sleep", commit_while_asleep)
    assert sub.wait(1.0) is True
    assert slept == [sqlite_feed.GATHER_S] and sub.statistics().gathered == 1
    assert [e.key for e in sub.poll().events if isinstance(e, RowEvent)] == ["/b"]
    sub.wait(0)  # takes the writer's pending post
    assert sub.poll().events == []
    assert sub.wait(0.01) is False
    assert slept == [sqlite_feed.GATHER_S]  # nothing delivered last: no gathering
    sub.close()


def test_a_handoff_that_fails_never_fails_the_commit(
    store: SqliteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = store.subscribe("keeper")
    store.write([put("/a")])  # the writer attaches the ring
    sub.poll()
    (ring,) = store._handoff.rings

    def broken(entries: object) -> int:
        raise RuntimeError("a ring in a state this build did not foresee")

    monkeypatch.setattr(ring, "put_many", broken)
    store.write([put("/b")])  # committed: no error reaches the caller
    assert store._handoff.failed == 1 and ring.missed() == 1
    assert [e.key for e in sub.poll().events if isinstance(e, RowEvent)] == ["/b"]
    assert sub.statistics().ring_entries == 1  # /a only: /b came from SQLite
    sub.close()
