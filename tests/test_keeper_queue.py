"""The held queue: best K equals a brute-force sort by rank; buckets and tallies stay exact."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keeper import buckets as buckets_module
from keeper.classes import ClassTable, RenderClass
from keeper.queue import ADDED, NOT_HELD, REMOVED, RESCHEDULED, TRIGGERED, UNCHANGED, HeldQueue
from keeper.slots import DUE, FIELDS, PLACE
from keeper.tallies import MINUTE_MS
from shm import key_hash

NOW = 1_800_000_000_000
CLASSES = [
    RenderClass("product", 86_400, False, False),
    RenderClass("product", 86_400, False, True),
    RenderClass("category", 3_600, False, False),
    RenderClass("home", 600, True, True),
    RenderClass("blog", 604_800, True, False),
]


@pytest.fixture
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tiny buckets, so a few dozen rows exercise splits and merges."""
    monkeypatch.setattr(buckets_module, "TARGET", 4)
    monkeypatch.setattr(buckets_module, "SPLIT_AT", 8)
    monkeypatch.setattr(buckets_module, "MERGE_BELOW", 2)
    monkeypatch.setattr(buckets_module, "MERGE_MAX", 6)
    yield


def new_queue(boost: float = 1.0) -> tuple[HeldQueue, ClassTable]:
    table = ClassTable(boost)
    for cls in CLASSES:
        table.intern(cls)
    return HeldQueue(table), table


def key(i: int) -> bytes:
    return f"https://shop.example.com/item/{i}".encode()


Model = dict[bytes, tuple[int, int, int]]  # key -> (class id, due, version)


def check_invariants(queue: HeldQueue, model: Model) -> None:
    """Every structure agrees with the model and with every other structure."""
    assert len(queue) == len(model)
    b = queue.buckets
    seen = 0
    for class_id, (starts, ids) in enumerate(zip(b.starts, b.ids, strict=True)):
        assert starts == sorted(set(starts)), "bucket starts strictly increase"
        for i, bucket in enumerate(ids):
            assert b.b_class[bucket] == class_id and b.b_start[bucket] == starts[i]
            live = 0
            for index, slot in enumerate(b.members[bucket]):
                place = queue.rec[slot * FIELDS + PLACE]
                if place != (bucket << 32 | index):
                    continue  # a stale entry: its row moved on
                live += 1
                due = queue.rec[slot * FIELDS + DUE]
                assert due >= starts[i], "a bucket's start bounds its rows"
                if i + 1 < len(starts):
                    assert due < starts[i + 1]
            assert live == b.b_live[bucket] > 0, "live counts are exact; no empty bucket listed"
            assert len(b.members[bucket]) == live + b.b_stale[bucket]
            seen += live
    assert seen == len(model)
    for k, (class_id, due, version) in model.items():
        held = queue.held(key_hash(k))
        assert held is not None and held.key.encode() == k
        assert (held.class_id, held.due_at, held.version) == (class_id, due, version)
    expected = Counter((c, d // MINUTE_MS) for c, d, _ in model.values())
    for (c, m), n in expected.items():
        assert queue.tallies.count(c, m) == n
    total = sum(queue.tallies.class_total(c) for c in range(len(queue.classes)))
    assert total == len(model), "no count anywhere else"


def brute_best(
    model: Model, table: ClassTable, k: int, now: int, blocked: set[int]
) -> list[tuple[float, bytes]]:
    cadence = table.cadence_ms()
    boost = table.boost()
    paused = table.paused_mask()
    ranked = []
    for k_, (class_id, due, _) in model.items():
        if due > now or paused[class_id] or key_hash(k_) in blocked:
            continue
        rank = (now - np.int64(due)) / cadence[class_id] + boost[class_id]
        ranked.append((float(rank), k_))
    ranked.sort(key=lambda r: -r[0])
    return ranked[:k] if k else []


def assert_same_best(
    queue: HeldQueue, model: Model, table: ClassTable, k: int, now: int, blocked: set[int]
) -> None:
    def mask(hashes: np.ndarray) -> np.ndarray:
        return np.array([int(h) in blocked for h in hashes], dtype=np.bool_)

    got = queue.best(k, now, mask if blocked else None)
    want = brute_best(model, table, k, now, blocked)
    assert got.rank.tolist() == [r for r, _ in want]
    got_keys = queue.slots.keys(got.slots)
    assert len(set(got_keys)) == len(got_keys), "no key twice"
    if want:
        cut = want[-1][0]
        # Every row ranked above the cut is in; rows at the cut are interchangeable ties.
        assert {k_ for r, k_ in want if r > cut} <= set(got_keys)
        eligible = {k_ for r, k_ in brute_best(model, table, len(model), now, blocked)}
        assert set(got_keys) <= eligible
    for k_, due, class_id in zip(got_keys, got.due_at.tolist(), got.class_id.tolist(), strict=True):
        assert model[k_][:2] == (class_id, due)


operation = st.tuples(
    st.integers(0, 60),  # key
    st.integers(0, len(CLASSES) - 1),  # class
    st.integers(-3 * 86_400_000, 86_400_000),  # due, relative to now
    st.booleans(),  # remove instead of upsert
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(operation, max_size=200),
    k=st.integers(0, 40),
    paused=st.sets(st.sampled_from(["product", "category", "home", "blog"]), max_size=2),
    blocked_keys=st.sets(st.integers(0, 60), max_size=15),
    later_ms=st.integers(0, 2 * 86_400_000),
)
def test_best_k_equals_a_brute_force_sort_by_rank(
    small_buckets: None,
    ops: list[tuple[int, int, int, bool]],
    k: int,
    paused: set[str],
    blocked_keys: set[int],
    later_ms: int,
) -> None:
    queue, table = new_queue()
    model: Model = {}
    for version, (i, class_id, offset, remove) in enumerate(ops, 1):
        h = key_hash(key(i))
        if remove:
            assert queue.remove(h) == (REMOVED if key(i) in model else NOT_HELD)
            model.pop(key(i), None)
        else:
            queue.upsert(key(i), h, class_id, NOW + offset, version, NOW)
            model[key(i)] = (class_id, NOW + offset, version)
    check_invariants(queue, model)
    table.set_paused_routes(paused)
    blocked = {key_hash(key(i)) for i in blocked_keys}
    for now in (NOW, NOW + later_ms):
        assert_same_best(queue, model, table, k, now, blocked)


def test_best_k_at_scale_with_default_buckets_matches_brute_force() -> None:
    rng = random.Random(7)
    queue, table = new_queue(boost=0.5)
    model: Model = {}
    version = 0
    for round_ in range(3):
        for _ in range(6000):
            version += 1
            i = rng.randrange(8000)
            class_id = rng.randrange(len(CLASSES))
            cadence = CLASSES[class_id].cadence_s * 1000
            # A dense recent backlog and a thin tail of very late rows.
            offset = -rng.randrange(cadence) if rng.random() < 0.8 else -rng.randrange(40 * cadence)
            if round_ and rng.random() < 0.1:
                queue.remove(key_hash(key(i)))
                model.pop(key(i), None)
                continue
            queue.upsert(
                key(i), key_hash(key(i)), class_id, NOW + offset + cadence // 2, version, NOW
            )
            model[key(i)] = (class_id, NOW + offset + cadence // 2, version)
        check_invariants(queue, model)
        blocked = {key_hash(key(rng.randrange(8000))) for _ in range(300)}
        for k in (1, 100, 1000, 5000):
            assert_same_best(queue, model, table, k, NOW, blocked)
    assert queue.buckets.splits > 0


def test_draining_a_class_merges_its_thinned_buckets() -> None:
    queue, table = new_queue()
    model: Model = {}
    for i in range(3000):
        queue.upsert(key(i), key_hash(key(i)), 0, NOW - i * 1_000, i + 1, NOW)
        model[key(i)] = (0, NOW - i * 1_000, i + 1)
    many = len(queue.buckets.ids[0])
    for i in range(3000):
        if i % 10:
            queue.remove(key_hash(key(i)))
            del model[key(i)]
    check_invariants(queue, model)
    assert queue.buckets.merges > 0
    assert len(queue.buckets.ids[0]) < many
    assert_same_best(queue, model, table, 50, NOW, set())


def test_upsert_reports_what_happened_for_the_flow_counters() -> None:
    queue, _ = new_queue()
    h = key_hash(key(1))
    assert queue.upsert(key(1), h, 0, NOW + 60_000, 1, NOW) == ADDED
    assert queue.upsert(key(1), h, 0, NOW + 60_000, 2, NOW) == UNCHANGED
    assert queue.upsert(key(1), h, 0, NOW - 1, 3, NOW) == TRIGGERED
    assert queue.upsert(key(1), h, 0, NOW + 86_400_000, 4, NOW) == RESCHEDULED
    assert queue.upsert(key(1), h, 2, NOW + 86_400_000, 5, NOW) == UNCHANGED
    assert queue.held(h).class_id == 2  # type: ignore[union-attr]
    assert queue.remove(h) == REMOVED
    assert queue.held(h) is None and len(queue) == 0


def test_a_replayed_event_changes_nothing(small_buckets: None) -> None:
    queue, _ = new_queue()
    model: Model = {}
    for i in range(40):
        queue.upsert(key(i), key_hash(key(i)), i % 3, NOW - i * 1000, i + 1, NOW)
        model[key(i)] = (i % 3, NOW - i * 1000, i + 1)
    before = queue.best(40, NOW).slots.tolist()
    for i in range(40):
        assert (
            queue.upsert(key(i), key_hash(key(i)), i % 3, NOW - i * 1000, i + 1, NOW) == UNCHANGED
        )
    check_invariants(queue, model)
    assert queue.best(40, NOW).slots.tolist() == before


def test_rows_sharing_one_due_time_stay_in_one_bucket_and_are_all_served() -> None:
    queue, table = new_queue()
    model: Model = {}
    for i in range(2000):
        queue.upsert(key(i), key_hash(key(i)), 1, NOW - 5_000, i + 1, NOW)
        model[key(i)] = (1, NOW - 5_000, i + 1)
    check_invariants(queue, model)
    assert len(queue.buckets.ids[1]) == 1
    assert len(queue.best(3000, NOW).slots) == 2000
    assert_same_best(queue, model, table, 500, NOW, set())


def test_not_yet_due_paused_and_blocked_rows_are_never_selected(small_buckets: None) -> None:
    queue, table = new_queue()
    queue.upsert(key(1), key_hash(key(1)), 0, NOW + 1, 1, NOW)  # due a millisecond later
    queue.upsert(key(2), key_hash(key(2)), 2, NOW - 1, 2, NOW)  # category: paused below
    queue.upsert(key(3), key_hash(key(3)), 0, NOW - 1, 3, NOW)  # leased
    queue.upsert(key(4), key_hash(key(4)), 0, NOW, 4, NOW)  # due exactly now
    table.set_paused_routes({"category"})
    leased = key_hash(key(3))
    got = queue.best(10, NOW, lambda hs: np.array([int(h) == leased for h in hs], dtype=np.bool_))
    assert queue.slots.keys(got.slots) == [key(4)]
    assert got.blocked == 1
    assert queue.earliest_claimable(NOW, None) == NOW - 1
    table.set_paused_routes(set())
    # A millisecond on, all four are due and none is blocked. The category row is as late
    # as the leased one, but against a 1 h cadence rather than a day, so it ranks first;
    # within the product class an earlier due ranks higher.
    assert queue.slots.keys(queue.best(10, NOW + 1).slots) == [key(2), key(3), key(4), key(1)]


def test_earliest_claimable_skips_blocked_and_paused_rows() -> None:
    queue, table = new_queue()
    for i in range(600):
        queue.upsert(key(i), key_hash(key(i)), 0, NOW - 600_000 + i * 1000, i + 1, NOW)
    queue.upsert(key(999), key_hash(key(999)), 2, NOW - 10_000_000, 1000, NOW)
    table.set_paused_routes({"category"})
    blocked = {key_hash(key(i)) for i in range(300)}
    mask = lambda hs: np.array([int(h) in blocked for h in hs], dtype=np.bool_)  # noqa: E731
    assert queue.earliest_claimable(NOW, mask) == NOW - 600_000 + 300 * 1000
    assert queue.earliest_claimable(NOW, None) == NOW - 600_000
    table.set_paused_routes(set())
    assert queue.earliest_claimable(NOW, None) == NOW - 10_000_000


def test_move_class_carries_every_row(small_buckets: None) -> None:
    queue, _ = new_queue()
    model: Model = {}
    for i in range(30):
        queue.upsert(key(i), key_hash(key(i)), 0, NOW - i * 7_000, i + 1, NOW)
        model[key(i)] = (3, NOW - i * 7_000, i + 1)
    assert queue.move_class(0, 3) == 30
    check_invariants(queue, model)
    assert queue.class_sizes().tolist()[:4] == [0, 0, 0, 30]


def test_best_k_reads_on_when_blocked_keys_outnumber_the_margin() -> None:
    # The read takes K plus a margin for leased keys; with the best 500 leased it must
    # read again, further down, and still equal the full sort.
    queue, table = new_queue()
    model: Model = {}
    for i in range(2_000):
        class_id = i % 3
        due = NOW - (i * 37 % 1_999) * 60_000
        queue.upsert(key(i), key_hash(key(i)), class_id, due, i + 1, NOW)
        model[key(i)] = (class_id, due, i + 1)
    ranked = brute_best(model, table, len(model), NOW, set())
    blocked = {key_hash(k_) for _, k_ in ranked[:500]}
    for k in (1, 40, 300):
        assert_same_best(queue, model, table, k, NOW, blocked)
        assert queue.best(k, NOW, lambda hs: np.isin(hs, list(blocked))).blocked >= 500


def test_a_load_in_wide_buckets_ends_cut_to_size_and_exact() -> None:
    """A load's chunks, spread over every bucket of each class, with events among them:
    the wide buckets of the load are cut to size when it ends, and nothing is lost."""
    rng = np.random.default_rng(3)
    queue, table = new_queue()
    model: Model = {}
    rows = 30_000
    class_ids = rng.integers(0, len(CLASSES), rows).astype(np.int32)
    dues = NOW + rng.integers(-86_400_000, 86_400_000, rows)
    queue.buckets.begin_load()
    for start in range(0, rows, 2000):
        part = range(start, min(rows, start + 2000))
        keys = [key(i) for i in part]
        queue.add_many(
            keys,
            np.array([key_hash(k) for k in keys], dtype=np.uint64),
            class_ids[start : start + len(keys)],
            dues[start : start + len(keys)],
            np.ones(len(keys), dtype=np.int64),
            NOW,
        )
        for i, k in enumerate(keys):
            model[k] = (int(class_ids[start + i]), int(dues[start + i]), 1)
        for i in rng.integers(0, start + len(keys), 50).tolist():  # the feed, meanwhile
            moved = NOW + int(rng.integers(-86_400_000, 86_400_000))
            queue.upsert(key(i), key_hash(key(i)), model[key(i)][0], moved, 2, NOW)
            model[key(i)] = (model[key(i)][0], moved, 2)
    b = queue.buckets
    widest = max(len(b.members[bucket]) for ids in b.ids for bucket in ids)
    assert widest >= buckets_module.SPLIT_AT, "a load fills buckets wider than usual"
    check_invariants(queue, model)
    b.end_load()
    check_invariants(queue, model)
    live = [b.b_live[bucket] for ids in b.ids for bucket in ids]
    assert max(live) < buckets_module.SPLIT_AT
    assert all(b.b_split_at[bucket] == buckets_module.SPLIT_AT for ids in b.ids for bucket in ids)
    for best in (1, 100, 5000):
        assert_same_best(queue, model, table, best, NOW, set())
