"""keeper/csrc against the Python it stands in for.

Each C path of the keeper has one Python path beside it: the fallback for what the C
does not take, which is also the reference here. Driven with the same inputs, the
two must leave every structure of the queue identical (not merely equivalent), and
return the same answers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keeper import buckets as buckets_module
from keeper._native import BucketOps, FeedShape, Picked, QueueView, SlotIndex
from keeper.classes import ClassTable, RenderClass
from keeper.config import KeeperConfig
from keeper.core import MAX_DUE_MS, KeeperCore
from keeper.ownership import Rendezvous
from keeper.queue import HeldQueue
from keeper.slots import SlotTable
from keeper.tallies import MINUTE_MS
from shm import key_hash
from store.rows import LogRecord, Row, RowEvent, row_event_from

NOW = 1_800_000_000_000
CLASSES = [
    RenderClass("product", 86_400, False, False),
    RenderClass("category", 3_600, False, False),
    RenderClass("home", 600, True, True),
]
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tiny buckets, so a few dozen rows split, merge and tidy."""
    monkeypatch.setattr(buckets_module, "TARGET", 4)
    monkeypatch.setattr(buckets_module, "SPLIT_AT", 8)
    monkeypatch.setattr(buckets_module, "MERGE_BELOW", 2)
    monkeypatch.setattr(buckets_module, "MERGE_MAX", 6)
    yield


def new_queue() -> HeldQueue:
    table = ClassTable(1.0)
    for cls in CLASSES:
        table.intern(cls)
    return HeldQueue(table)


def key(i: int) -> bytes:
    return f"https://shop.example.com/item/{i}".encode()


def queue_state(queue: HeldQueue) -> tuple[Any, ...]:
    """Every structure of the queue, as plain values."""
    b = queue.buckets
    t = queue.tallies
    return (
        queue.rec.tolist(),
        queue.slots._table.tolist(),
        [m.tolist() for m in b.members],
        [a.tolist() for a in (b.b_class, b.b_start, b.b_live, b.b_stale, b.b_split_at)],
        b.starts,
        b.ids,
        sorted(b._free),
        [c.tolist() for c in t.counts],
        t.base,
        t.outside,
    )


def upsert_reference(queue: HeldQueue, k: bytes, class_id: int, due: int, version: int) -> int:
    """HeldQueue.upsert without its C path."""
    queue.tallies.now_minute = NOW // MINUTE_MS
    return queue.upsert_unmoved(k, key_hash(k), class_id, due, version, NOW)


def upsert_counting(
    queue: HeldQueue, k: bytes, class_id: int, due: int, version: int, taken: list[int]
) -> int:
    """HeldQueue.upsert as it is, counting the calls its C path took whole."""
    queue.tallies.now_minute = NOW // MINUTE_MS
    done = queue.moved(key_hash(k), class_id, due, version, NOW)
    if done >= 0:
        taken[0] += 1
        return done
    return queue.upsert_unmoved(k, key_hash(k), class_id, due, version, NOW)


# Dues near now (the tallies' dense range, where the C path works) and a few far off
# (beyond it, which the C hands back).
due = st.one_of(
    st.integers(-3 * 86_400_000, 86_400_000),
    st.integers(-200 * 86_400_000, 200 * 86_400_000),
)
operation = st.tuples(st.integers(0, 40), st.integers(0, len(CLASSES) - 1), due, st.booleans())


def run_both(ops: list[tuple[int, int, int, bool]]) -> tuple[HeldQueue, HeldQueue, int]:
    c_queue, py_queue = new_queue(), new_queue()
    taken = [0]
    for version, (i, class_id, offset, remove) in enumerate(ops, 1):
        if remove:
            assert c_queue.remove(key_hash(key(i))) == py_queue.remove(key_hash(key(i)))
            continue
        want = upsert_reference(py_queue, key(i), class_id, NOW + offset, version)
        got = upsert_counting(c_queue, key(i), class_id, NOW + offset, version, taken)
        assert got == want
    return c_queue, py_queue, taken[0]


@SETTINGS
@given(ops=st.lists(operation, max_size=200))
def test_upsert_moved_leaves_the_queue_as_the_python_path_does(
    small_buckets: None, ops: list[tuple[int, int, int, bool]]
) -> None:
    c_queue, py_queue, _ = run_both(ops)
    assert queue_state(c_queue) == queue_state(py_queue)


def test_the_comparison_exercises_the_c_path(small_buckets: None) -> None:
    """The comparison above means something only if the C takes many of the upserts,
    splits and tidies included."""
    rng = random.Random(3)
    ops = []
    for _ in range(3000):
        i = rng.randrange(60)
        class_id = i % 3 if rng.random() < 0.9 else rng.randrange(3)  # mostly stays put
        ops.append((i, class_id, rng.randrange(-86_400_000, 86_400_000), False))
    c_queue, py_queue, taken = run_both(ops)
    assert queue_state(c_queue) == queue_state(py_queue)
    assert taken > 2000
    assert c_queue.buckets.splits > 10 and c_queue.buckets.rebuilds > 100


# -- BucketOps: a bucket's rewrites ------------------------------------------------------


def churned_queue(seed: int) -> HeldQueue:
    """A queue whose buckets carry stale entries: rows added, moved about, removed, with
    buckets too large to be tidied, so the stale entries stay where they went stale."""
    queue = new_queue()
    rng = random.Random(seed)
    for version in range(1, 600):
        i = rng.randrange(80)
        if rng.random() < 0.15:
            queue.remove(key_hash(key(i)))
        else:
            due = NOW + rng.randrange(-86_400_000, 86_400_000)
            upsert_reference(queue, key(i), i % 3, due, version)
    return queue


def places(queue: HeldQueue, bucket: int) -> list[int]:
    return [queue.rec[4 * slot + 3] for slot in queue.buckets.members[bucket]]


def in_use(queue: HeldQueue) -> list[int]:
    b = queue.buckets
    return [bucket for bucket in range(len(b.members)) if b.b_class[bucket] >= 0]


@pytest.mark.parametrize("seed", range(6))
def test_compact_keeps_each_live_entry_in_order_and_nothing_else(seed: int) -> None:
    queue = churned_queue(seed)
    b = queue.buckets
    stale = 0
    for bucket in in_use(queue):
        live = b.live_slots(bucket).tolist()
        stale += len(b.members[bucket]) - len(live)
        assert b._ops.compact(bucket, -1) == len(live)
        assert b.members[bucket].tolist() == live
        assert places(queue, bucket) == [(bucket << 32) | i for i in range(len(live))]
        assert (b.b_live[bucket], b.b_stale[bucket]) == (len(live), 0)
    assert stale > 20  # the churn left stale entries to drop


@pytest.mark.parametrize("seed", range(6))
def test_compact_with_a_source_appends_its_live_entries(seed: int) -> None:
    queue = churned_queue(seed)
    b = queue.buckets
    buckets = in_use(queue)
    rng = random.Random(seed)
    for _ in range(len(buckets) // 2):
        kept, moved = rng.sample(buckets, 2)
        buckets.remove(moved)
        want = b.live_slots(kept).tolist() + b.live_slots(moved).tolist()
        assert b._ops.compact(kept, moved) == len(want)
        assert b.members[kept].tolist() == want
        assert places(queue, kept) == [(kept << 32) | i for i in range(len(want))]
        assert (b.b_live[kept], b.b_stale[kept]) == (len(want), 0)
        assert b.live_slots(moved).size == 0  # the moved rows' places are the kept bucket's


def test_refill_makes_the_slots_the_bucket_s_entries() -> None:
    queue = churned_queue(1)
    b = queue.buckets
    first, second = in_use(queue)[:2]
    slots = np.concatenate((b.live_slots(second), b.live_slots(first)))[::-1].copy()
    b._ops.refill(first, slots)
    assert b.members[first].tolist() == slots.tolist()
    assert places(queue, first) == [(first << 32) | i for i in range(len(slots))]
    assert (b.b_live[first], b.b_stale[first]) == (len(slots), 0)


def cuts_reference(dues: npt.NDArray[np.int64], pieces: int) -> list[int]:
    """Cut points near equal shares of sorted `dues`, each where the due time changes:
    the rule BucketOps.sort_cut follows, written plainly in numpy."""
    n = len(dues)
    cuts: list[int] = []
    for piece in range(1, pieces):
        at = piece * n // pieces
        cut = int(np.searchsorted(dues, dues[at], side="left"))
        if cut == 0:
            cut = int(np.searchsorted(dues, dues[at], side="right"))
        if 0 < cut < n and (not cuts or cut > cuts[-1]):
            cuts.append(cut)
    return cuts


@settings(max_examples=200, deadline=None)
@given(
    dues=st.lists(st.sampled_from([0, 1, 2, 5, 60_000, 86_400_000]), min_size=1, max_size=60),
    pieces=st.integers(2, 9),
)
def test_sort_cut_orders_stably_and_cuts_where_the_due_time_changes(
    dues: list[int], pieces: int
) -> None:
    queue = new_queue()
    b = queue.buckets
    for i, offset in enumerate(dues):  # one class, one wide bucket: nothing splits on the way
        queue.upsert(key(i), key_hash(key(i)), 0, NOW + offset, 1, NOW)
    (bucket,) = b.ids[0]
    b._ops.compact(bucket, -1)
    slots = np.frombuffer(b.members[bucket], dtype=np.int32).copy()
    held = queue.slots.dues()[slots]
    order = np.argsort(held, kind="stable")
    want_cuts = cuts_reference(held[order], pieces)
    got = b._ops.sort_cut(bucket, pieces)
    assert b.members[bucket].tolist() == slots[order].tolist()
    assert places(queue, bucket) == [(bucket << 32) | i for i in range(len(slots))]
    assert [a for a, _ in got] == want_cuts
    assert [due for _, due in got] == [int(held[order][a]) for a in want_cuts]


def test_bucket_ops_refuse_what_is_not_theirs() -> None:
    queue = churned_queue(2)
    b = queue.buckets
    ops = b._ops
    with pytest.raises(IndexError):
        ops.compact(len(b.members), -1)
    with pytest.raises(ValueError, match="itself"):
        ops.compact(0, 0)
    with pytest.raises(IndexError):
        ops.refill(0, np.array([len(queue.slots.offsets)], dtype=np.int32))
    with pytest.raises(TypeError):
        ops.refill(0, np.zeros(2, dtype=np.int64))
    stale = next(bucket for bucket in in_use(queue) if b.b_stale[bucket])
    with pytest.raises(ValueError, match="stale"):
        ops.sort_cut(stale, 2)
    with pytest.raises(TypeError, match="b_live"):
        BucketOps(index=queue.slots.index, members=b.members, b_live=b.b_start, b_stale=b.b_stale)


# -- apply_moves: the feed's batches --------------------------------------------------

ROUTES = ["product", "category", "home"]
Event = tuple[int, str, int | None, int, str]  # key, route, cadence, due offset, kind
event = st.tuples(
    st.integers(0, 30),  # key
    st.sampled_from(ROUTES),
    st.sampled_from([None, 60, 3600, 0]),  # cadence (0 is unreadable)
    st.one_of(due, st.sampled_from([-5, MAX_DUE_MS])),  # due, relative to now
    st.sampled_from(["ok", "ok", "ok", "ok", "delete", "float due", "text version", "other key"]),
)


def to_event(i: int, route: str, cadence: int | None, offset: int, kind: str, v: int) -> RowEvent:
    k = f"/k{i}"
    if kind == "delete":
        return RowEvent(key=k, row=None)
    due_at: Any = NOW + offset if offset not in (-5, MAX_DUE_MS) else offset
    version: Any = v
    if kind == "float due":
        due_at = float(NOW)
    if kind == "text version":
        version = str(v)
    row = Row(
        key=k,
        route=route,
        cadence_s=cadence,
        sitemap=i % 3 == 0,
        next_render_at=due_at,
        version=version,
    )
    return RowEvent(key=f"/k{i + 1}" if kind == "other key" else k, row=row)


def core_state(core: KeeperCore) -> tuple[Any, ...]:
    counters = msgspec.structs.asdict(core.counters)
    return (queue_state(core.queue), counters, dict(core._touched or {}))


def paired_cores(c_path: str, clustered: bool = False) -> tuple[KeeperCore, KeeperCore, list[int]]:
    """A keeper whose C path `c_path` (a QueueView method) counts what it takes, and the
    reference, whose C path takes no event, so the Python loop takes them all.
    `clustered`: both are node a of two, so about half the keys are b's."""

    def ownership() -> Rendezvous | None:
        return Rendezvous("a", ["a", "b"]) if clustered else None

    c_core, py_core = (
        KeeperCore(KeeperConfig(), ownership()),
        KeeperCore(KeeperConfig(), ownership()),
    )
    py_core.queue.apply_moves = lambda events, start, *rest: start
    taken = [0]
    c_apply = getattr(c_core.queue, c_path)

    def counting(items: list[Any], start: int, *rest: Any) -> int:
        stop: int = c_apply(items, start, *rest)
        taken[0] += stop - start
        return stop

    setattr(c_core.queue, c_path, counting)
    return c_core, py_core, taken


def assert_same_flow(c_core: KeeperCore, py_core: KeeperCore) -> None:
    c_flow, py_flow = c_core.flow.minutes(NOW), py_core.flow.minutes(NOW)
    assert [msgspec.structs.asdict(m) for m in c_flow] == [
        msgspec.structs.asdict(m) for m in py_flow
    ]


def run_cores(batches: list[list[Event]], walking: bool) -> int:
    """Both keepers fed the same batches, compared after each; returns the events the
    C path took."""
    c_core, py_core, taken = paired_cores("apply_moves")
    version = 0
    for n, batch in enumerate(batches):
        events = []
        for i, route, cadence, offset, kind in batch:
            version += 1
            events.append(to_event(i, route, cadence, offset, kind, version))
        if walking and n == 1:
            for core in (c_core, py_core):
                core.begin_walk("verify", NOW)
        for core in (c_core, py_core):
            core.apply_events(events, NOW)
        assert core_state(c_core) == core_state(py_core)
    assert_same_flow(c_core, py_core)
    return taken[0]


@SETTINGS
@given(batches=st.lists(st.lists(event, max_size=40), max_size=6), walking=st.booleans())
def test_apply_moves_leaves_the_keeper_as_the_python_loop_does(
    small_buckets: None, batches: list[list[Event]], walking: bool
) -> None:
    run_cores(batches, walking)


def test_the_feed_comparison_exercises_the_c_path(small_buckets: None) -> None:
    rng = random.Random(5)
    batches: list[list[Event]] = []
    for _ in range(20):
        batch: list[Event] = []
        for _ in range(200):
            i = rng.randrange(30)
            kind = "ok" if rng.random() < 0.9 else rng.choice(["delete", "float due", "other key"])
            offset = rng.randrange(-86_400_000, 86_400_000)
            batch.append((i, ROUTES[i % 3], None, offset, kind))
        batches.append(batch)
    assert run_cores(batches, walking=True) > 2000


# -- apply_records: the feed's records, no events made --------------------------------

record_kind = st.sampled_from(
    ["ok", "ok", "ok", "ok", "learned", "delete", "retired", "float due", "text version",
     "sitemap 2", "not a tuple"]
)  # fmt: skip
Record = tuple[int, str, int | None, int, str]  # key, route, cadence, due offset, kind
record_strategy = st.tuples(
    st.integers(0, 30),
    st.sampled_from(ROUTES),
    st.sampled_from([None, 60, 3600, 0]),
    st.one_of(due, st.sampled_from([-5, MAX_DUE_MS])),
    record_kind,
)


def to_record(i: int, route: str, cadence: int | None, offset: int, kind: str, v: int) -> Any:
    """A feed record (store.rows.LogRecord) as the SQLite feed ring hands it over."""
    k = f"/k{i}"
    if kind == "delete":
        return (v, 0, k, v, *([None] * 12))
    due_at: Any = NOW + offset if offset not in (-5, MAX_DUE_MS) else offset
    version: Any = str(v) if kind == "text version" else v
    if kind == "float due":
        due_at = float(NOW)
    sitemap = 2 if kind == "sitemap 2" else int(i % 3 == 0)
    learned = 120 if kind == "learned" else None
    retired = NOW if kind == "retired" else None
    record = (v, 0, k, v, route, cadence, sitemap, due_at, None, None, version, learned, 0, 0,
              retired, "not_found" if retired else None)  # fmt: skip
    return list(record) if kind == "not a tuple" else record


def run_record_cores(batches: list[list[Record]], walking: bool, clustered: bool = False) -> int:
    """A keeper fed records (apply_records) and one fed their events through the Python
    loop alone, compared after each batch; returns the records the C path took."""
    c_core, py_core, taken = paired_cores("apply_records", clustered)
    version = 0
    for n, batch in enumerate(batches):
        records: list[LogRecord] = []
        for i, route, cadence, offset, kind in batch:
            version += 1
            records.append(to_record(i, route, cadence, offset, kind, version))
        if walking and n == 1:
            for core in (c_core, py_core):
                core.begin_walk("verify", NOW)
        # The events a poll makes of the same records (RowRecords.batch).
        events = [row_event_from(tuple(r)) for r in records]  # type: ignore[arg-type]
        c_core.apply_records(records, NOW)
        py_core.apply_events(events, NOW)
        assert core_state(c_core) == core_state(py_core)
    assert_same_flow(c_core, py_core)
    return taken[0]


@SETTINGS
@given(
    batches=st.lists(st.lists(record_strategy, max_size=40), max_size=6),
    walking=st.booleans(),
    clustered=st.booleans(),
)
def test_apply_records_leaves_the_keeper_as_the_python_loop_does_with_their_events(
    small_buckets: None, batches: list[list[Record]], walking: bool, clustered: bool
) -> None:
    run_record_cores(batches, walking, clustered)


def test_the_record_comparison_exercises_the_c_path(small_buckets: None) -> None:
    rng = random.Random(7)
    batches: list[list[Record]] = []
    for _ in range(20):
        batch: list[Record] = []
        for _ in range(200):
            i = rng.randrange(30)
            kind = "ok" if rng.random() < 0.95 else rng.choice(["delete", "retired", "learned"])
            offset = rng.randrange(-86_400_000, 86_400_000)
            batch.append((i, ROUTES[i % 3], None, offset, kind))
        batches.append(batch)
    assert run_record_cores(batches, walking=True) > 3000
    # Node a of two: the records of b's keys are dropped first, a's still go through C.
    assert run_record_cores(batches, walking=True, clustered=True) > 1000


def test_a_batch_of_new_rows_goes_as_events_after_a_few_refusals() -> None:
    core = KeeperCore(KeeperConfig())
    calls: list[int] = []
    c_apply = core.queue.apply_records

    def counting(records: list[Any], start: int, *rest: Any) -> int:
        calls.append(start)
        return c_apply(records, start, *rest)

    core.queue.apply_records = counting
    core.apply_records([to_record(i, "product", None, 0, "ok", i + 1) for i in range(30)], NOW)
    assert len(core.queue) == 30 and core.counters.row_events == 30
    assert len(calls) == 9  # eight taken one by one, then the rest as events


def test_a_few_refused_records_leave_the_rest_of_the_batch_to_the_c_path() -> None:
    core = KeeperCore(KeeperConfig())
    core.apply_records([to_record(i, "product", None, 0, "ok", i + 1) for i in range(40)], NOW)
    taken = [0]
    c_apply = core.queue.apply_records

    def counting(records: list[Any], start: int, *rest: Any) -> int:
        stop = c_apply(records, start, *rest)
        taken[0] += stop - start
        return stop

    core.queue.apply_records = counting
    moved = [to_record(i, "product", None, 60_000, "ok", 100 + i) for i in range(40)]
    for at in range(0, 40, 5):  # one in five a delete: each taken by itself
        moved[at] = to_record(at, "product", None, 0, "delete", 100 + at)
    core.apply_records(moved, NOW)
    assert len(core.queue) == 32 and core.counters.row_events == 80
    assert taken[0] == 32  # every move in C


# -- the best read's columns, and the slot index ------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    blocked=st.lists(st.booleans(), max_size=60),
    spare=st.integers(0, 5),
    limit=st.integers(0, 70),
)
def test_keep_unblocked_is_a_stable_filter_up_to_the_limit(
    blocked: list[bool], spare: int, limit: int
) -> None:
    n = len(blocked) + spare  # the columns may be longer than the rows read
    cols: tuple[npt.NDArray[Any], ...] = (
        np.arange(n, dtype=np.int32),
        np.arange(n, dtype=np.float64) / 3,
        np.arange(n, dtype=np.int64) * 7,
        np.arange(n, dtype=np.uint64) + np.uint64(2**63),
        np.arange(n, dtype=np.int32) % 5,
    )
    before: list[npt.NDArray[Any]] = [c.copy() for c in cols]
    mask = np.array(blocked, dtype=np.bool_)
    kept, scanned = Picked(*cols).keep_unblocked(mask, limit)
    free = np.flatnonzero(~mask)
    assert kept == min(limit, len(free))
    if kept == limit:  # stopped at the limit, just after the last row kept
        assert scanned == (int(free[kept - 1]) + 1 if kept else 0)
    else:
        assert scanned == len(blocked)
    for col, old in zip(cols, before, strict=True):
        assert col[:kept].tolist() == old[free[:kept]].tolist()


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(st.tuples(st.booleans(), st.integers(0, 4)), max_size=60),
    budget=st.lists(st.integers(-1, 3), min_size=5, max_size=5),
    limit=st.integers(0, 70),
)
def test_keep_within_spends_each_sites_budget_in_order(
    rows: list[tuple[bool, int]], budget: list[int], limit: int
) -> None:
    n = len(rows)
    cols: tuple[npt.NDArray[Any], ...] = (
        np.arange(n, dtype=np.int32),
        np.arange(n, dtype=np.float64) / 3,
        np.arange(n, dtype=np.int64) * 7,
        np.arange(n, dtype=np.uint64),
        np.arange(n, dtype=np.int32) % 5,
    )
    mask = np.array([b for b, _ in rows], dtype=np.bool_)
    sites = np.array([s for _, s in rows], dtype=np.int32)
    left = np.array(budget, dtype=np.int64)
    # The same, row by row.
    want: list[int] = []
    spent = list(budget)
    skipped, limited, scanned = 0, set(), 0
    for i, (stopped, site) in enumerate(rows):
        if len(want) == limit:
            break
        scanned = i + 1
        if stopped:
            continue
        if spent[site] == 0:
            skipped += 1
            limited.add(site)
            continue
        spent[site] -= spent[site] > 0
        want.append(i)
    got = Picked(*cols).keep_within(mask, limit, sites, left)
    assert got == (len(want), scanned if len(want) == limit else n, skipped, len(limited))
    assert cols[0][: len(want)].tolist() == want
    if n:
        with pytest.raises(IndexError):
            Picked(*cols).keep_within(
                np.zeros(n, np.bool_), n, np.full(n, 5, np.int32), np.zeros(5, np.int64)
            )
    with pytest.raises(ValueError, match="site id per row"):
        Picked(*cols).keep_within(mask, limit, sites.astype(np.int64), left)


def test_the_c_types_check_what_they_are_given() -> None:
    i32, f64 = np.zeros(4, dtype=np.int32), np.zeros(4, dtype=np.float64)
    i64, u64 = np.zeros(4, dtype=np.int64), np.zeros(4, dtype=np.uint64)
    with pytest.raises(ValueError, match="rank"):
        Picked(i32, i64.view(np.float64)[:3], i64, u64, i32)
    with pytest.raises(ValueError, match="slots"):
        Picked(i64, f64, i64, u64, i32)  # type: ignore[arg-type]
    slots = SlotTable()
    with pytest.raises(TypeError):
        SlotIndex(slots.rec, slots.rec)  # the index is int32
    queue = new_queue()
    fields: dict[str, Any] = {
        "index": queue.slots.index,
        "b_class": queue.buckets.b_class,
        "b_live": queue.buckets.b_live,
        "b_stale": queue.buckets.b_stale,
        "b_split_at": queue.buckets.b_split_at,
        "starts": queue.buckets.starts,
        "ids": queue.buckets.ids,
        "members": queue.buckets.members,
        "tally_counts": queue.tallies.counts,
        "tally_base": queue.tallies.base,
        "buckets": queue.buckets,
        "merge_below": 2,
        "stale_slack": 2,
    }
    QueueView(**fields)
    with pytest.raises(TypeError, match="keyword arguments"):  # no b_start
        QueueView(**fields, b_start=queue.buckets.b_start)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="b_live"):
        QueueView(**{**fields, "b_live": queue.buckets.b_start})  # int64, not int32
    with pytest.raises(TypeError, match="starts"):
        QueueView(**{**fields, "starts": tuple(queue.buckets.starts)})
    with pytest.raises(TypeError, match="stale_slack"):
        QueueView(**{k: v for k, v in fields.items() if k != "stale_slack"})
    not_a_shape: Any = object()
    with pytest.raises(TypeError, match="FeedShape"):
        queue.view.apply_moves([], 0, [], not_a_shape, None, 0, NOW, [0] * 6)
    not_a_dict: Any = []
    with pytest.raises(TypeError):
        FeedShape(RowEvent, not_a_dict, MAX_DUE_MS)


@settings(max_examples=100, deadline=None)
@given(
    present=st.lists(st.integers(1, 2**64 - 1), unique=True, max_size=300),
    absent=st.lists(st.integers(1, 2**64 - 1), max_size=30),
)
def test_find_many_answers_as_the_python_find_does(present: list[int], absent: list[int]) -> None:
    table = SlotTable(index_capacity=16)  # grows, in place, several times on the way
    keys = [str(h).encode() for h in present]
    table.add_many(np.array(present, dtype=np.uint64), keys)
    probe: npt.NDArray[np.uint64] = np.array(present + absent, dtype=np.uint64)
    want = [table.find(int(h)) for h in probe]
    assert table.find_many(probe).tolist() == want
    assert all(s >= 0 for s in want[: len(present)])


def test_apply_records_wants_a_uint64_hash_a_record() -> None:
    core = KeeperCore(KeeperConfig())
    records = [to_record(1, "product", None, 0, "ok", 1)]
    args = (core._feed_shape, None, 0, NOW, [0] * 6)
    with pytest.raises(TypeError, match="one a record"):
        core.queue.apply_records(records, 0, np.zeros(2, dtype=np.uint64), *args)
    with pytest.raises(TypeError, match="one a record"):
        core.queue.apply_records(records, 0, np.zeros(1, dtype=np.int32), *args)
    with pytest.raises(TypeError):
        core.queue.apply_records(records, 0, [5], *args)  # type: ignore[arg-type]
    assert core.queue.apply_records(records, 1, np.zeros(1, dtype=np.uint64), *args) == 1
