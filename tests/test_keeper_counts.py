"""Full counts from the tallies equal counts taken row by row."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from keeper.classes import ClassTable, RenderClass
from keeper.counts import (
    HOURS_AHEAD,
    LATENESS_EDGES,
    count_queue,
    due_in_minute,
    due_key_hashes,
)
from keeper.queue import HeldQueue
from keeper.tallies import MINUTE_MS
from shm import key_hash

NOW = 1_800_000_030_500  # half a minute and a bit into a minute
CLASSES = [
    RenderClass("product", 86_400, False, False),
    RenderClass("product", 86_400, False, True),
    RenderClass("category", 3_600, True, False),
    RenderClass("home", 600, False, True),
]


def brute(rows: dict[int, tuple[int, int]], table: ClassTable, now: int) -> dict[str, object]:
    now_minute = now // MINUTE_MS
    paused = table.paused_mask()
    out: dict[str, object] = {}
    due = [(c, d) for c, d in rows.values() if d <= now]
    out["due"] = sum(1 for c, _ in due if not paused[c])
    out["due_sitemap"] = sum(1 for c, _ in due if not paused[c] and table.get(c).sitemap)
    out["paused_due"] = sum(1 for c, _ in due if paused[c])
    ahead = [d // MINUTE_MS - now_minute for _, d in rows.values() if d > now]
    out["due_15m"] = sum(1 for a in ahead if a < 15)
    out["due_60m"] = sum(1 for a in ahead if a < 60)
    out["by_hour"] = [sum(1 for a in ahead if a // 60 == h) for h in range(HOURS_AHEAD)]
    late: dict[int, list[int]] = {}
    for c, d in due:
        # lateness at the due minute's first millisecond, as the tallies see it
        start = d if d // MINUTE_MS == now_minute else (d // MINUTE_MS) * MINUTE_MS
        lateness = (now - start) / (table.get(c).cadence_s * 1000)
        b = max(i for i, e in enumerate(LATENESS_EDGES) if lateness >= e)
        late.setdefault(c, [0] * len(LATENESS_EDGES))[b] += 1
    out["late"] = late
    out["oldest"] = {c: min(d for c2, d in due if c2 == c) for c, _ in due}
    return out


@settings(max_examples=100, deadline=None)
@given(
    rows=st.dictionaries(
        st.integers(0, 500),
        st.tuples(st.integers(0, 3), st.integers(-20 * 86_400_000, 2 * 86_400_000)),
        max_size=300,
    ),
    paused=st.sets(st.sampled_from(["product", "category", "home"]), max_size=1),
)
def test_counts_equal_a_row_by_row_count(
    rows: dict[int, tuple[int, int]], paused: set[str]
) -> None:
    table = ClassTable(1.0)
    for cls in CLASSES:
        table.intern(cls)
    queue = HeldQueue(table)
    placed = {}
    for i, (c, offset) in rows.items():
        k = f"/k{i}".encode()
        queue.upsert(k, key_hash(k), c, NOW + offset, 1, NOW)
        placed[i] = (c, NOW + offset)
    table.set_paused_routes(paused)
    counts = count_queue(queue, NOW)
    want = brute(placed, table, NOW)
    assert counts.held == len(placed)
    assert counts.due == want["due"]
    assert counts.due_sitemap == want["due_sitemap"]
    assert counts.due_discovered == counts.due - counts.due_sitemap
    assert counts.paused_due == want["paused_due"]
    assert counts.due_15m == want["due_15m"]
    assert counts.due_60m == want["due_60m"]
    assert counts.next_24h_by_hour == want["by_hour"]
    assert counts.due_24h == sum(want["by_hour"])
    late = {c.class_id: c.lateness for c in counts.classes if any(c.lateness)}
    assert late == want["late"]
    oldest = {c.class_id: c.oldest_due_at for c in counts.classes if c.oldest_due_at is not None}
    assert oldest == want["oldest"]
    assert sum(c.held for c in counts.classes) == len(placed)
    # The rows the cluster's fences are counted against are the ones counted due.
    paused_ids = table.paused_mask()
    due_keys = {
        key_hash(f"/k{i}".encode())
        for i, (c, d) in placed.items()
        if d <= NOW and not paused_ids[c]
    }
    hashes = due_key_hashes(queue, NOW)
    assert len(hashes) == counts.due and set(hashes.tolist()) == due_keys


def test_came_due_counts_the_rows_due_in_a_minute() -> None:
    table = ClassTable(1.0)
    table.intern(CLASSES[0])
    queue = HeldQueue(table)
    rng = random.Random(1)
    minute = NOW // MINUTE_MS + 3
    inside = 0
    for i in range(500):
        due = NOW + rng.randrange(-600_000, 600_000)
        inside += due // MINUTE_MS == minute
        queue.upsert(f"/k{i}".encode(), key_hash(f"/k{i}".encode()), 0, due, 1, NOW)
    assert due_in_minute(queue, minute) == inside > 0


def test_rows_far_from_now_are_counted_through_the_overflow_and_trim_keeps_them() -> None:
    from keeper import tallies as tallies_module

    table = ClassTable(1.0)
    for cls in CLASSES:
        table.intern(cls)
    queue = HeldQueue(table)
    far = {
        "/epoch": 0,  # "render as soon as possible"
        "/old": NOW - 200 * 86_400_000,
        "/next-year": NOW + 365 * 86_400_000,
        "/now": NOW - 5,
        "/soon": NOW + 20 * MINUTE_MS,
    }
    for i, (k, due) in enumerate(far.items()):
        queue.upsert(k.encode(), key_hash(k.encode()), 0, due, i + 1, NOW)
    assert len(queue.tallies.outside) == 3
    counts = count_queue(queue, NOW)
    assert (counts.held, counts.due, counts.due_60m) == (5, 3, 1)
    assert counts.classes[0].lateness[-1] == 2 and counts.classes[0].oldest_due_at == 0
    # A month on: the dense range moves with now, and nothing is lost on the way.
    later = NOW + 40 * 86_400_000
    for i, k in enumerate(("/now", "/soon")):  # rendered since: due again a day later
        queue.upsert(k.encode(), key_hash(k.encode()), 0, later + 86_400_000, 10 + i, later)
    queue.tallies.trim()
    assert queue.tallies.base[0] >= later // MINUTE_MS - tallies_module.GROW
    counts = count_queue(queue, later)
    assert (counts.held, counts.due, counts.due_24h) == (5, 2, 0)
    assert sum(queue.tallies.class_total(c) for c in range(4)) == 5


def test_the_due_key_hashes_leave_out_removed_rows_and_rows_not_yet_due() -> None:
    table = ClassTable(1.0)
    table.intern(CLASSES[0])
    queue = HeldQueue(table)
    keys = [f"/k{i}".encode() for i in range(50)]
    for i, k in enumerate(keys):
        queue.upsert(k, key_hash(k), 0, NOW - 1000 if i % 2 else NOW + 1000, 1, NOW)
    for k in keys[:10]:
        queue.remove(key_hash(k))  # a freed slot's record reads due at 0: not a row
    hashes = due_key_hashes(queue, NOW)
    assert sorted(hashes.tolist()) == sorted(key_hash(k) for k in keys[11::2])
    assert len(hashes) == count_queue(queue, NOW).due
