"""keeper/skips.py: rows found leased are passed over by later publishes, and never one a
publish should hold: a run of publishes against a real lease table, with grants, lease
ends and completions between them, equals brute force at every step; a mark ends with a
write of its row, with its slot's reuse, and within RECHECK_MS of a lease released with no
write; a selection without the lease table's answer reads every row."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from keeper_helpers import NOW, ROUTES, MemoryRing, core_with_dues

from keeper._native import Picked
from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.protocols import LeaseTableLike
from keeper.publish import Publisher, PublishFailed
from keeper.skips import RECHECK_MS
from shm import Grant, LeaseTable, key_hash, segment_name
from store.rows import Row, RowEvent

LEASE_MS = 30_000


def _table() -> LeaseTable:
    return LeaseTable.create(
        segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "skips"), capacity=1 << 12
    )


@contextmanager
def _rig(
    dues: list[int], best_k: int
) -> Iterator[tuple[KeeperCore, LeaseTable, MemoryRing, Publisher]]:
    """A keeper holding /p/0, /p/1, ... due at NOW + each due, a real lease table, and a
    publisher into a ring in memory."""
    core = core_with_dues(dues, KeeperConfig(best_k=best_k))
    table = _table()
    ring = MemoryRing()
    try:
        yield core, table, ring, Publisher(core, ring, table, core.config)
    finally:
        table.close()
        table.unlink()


def _free(core: KeeperCore, table: LeaseTable, now: int, k: int) -> list[bytes]:
    """Brute force: every due row best first (no lease table), less each key the
    table's own per-key probe says is leased or held, the best k of them."""
    everything = core.select(len(core.queue), now, None)
    keys = core.queue.slots.keys(everything.slots)
    free = []
    for key in keys:
        state = table.state(key_hash(key), now)
        if not (state.leased or state.held):
            free.append(key)
    return free[:k]


def _write(core: KeeperCore, i: int, due: int, version: int, now: int) -> None:
    """A store write of /p/i (a completion's): a new version and due time."""
    row = Row(
        key=f"/p/{i}",
        route=ROUTES[i % 3],
        cadence_s=None,
        sitemap=i % 4 == 0,
        next_render_at=due,
        version=version,
    )
    core.apply_events([RowEvent(key=row.key, row=row)], now)


def _publish(publisher: Publisher, ring: MemoryRing, now: int) -> list[bytes]:
    assert not isinstance(publisher.publish(now), PublishFailed)
    return list(ring.keys)


@given(
    dues=st.lists(st.integers(-600_000, 60_000), min_size=1, max_size=150),
    steps=st.lists(
        st.tuples(
            st.integers(0, 20),  # keys of the ring granted, from its top
            st.integers(0, 40_000),  # time passing (ms)
            st.sets(st.integers(0, 149), max_size=8),  # leased rows completed (a write)
        ),
        min_size=1,
        max_size=8,
    ),
    best_k=st.integers(1, 60),
)
@settings(max_examples=60, deadline=None)
def test_every_publish_is_brute_forces_answer_while_leases_end_by_time_or_by_a_write(
    dues: list[int], steps: list[tuple[int, int, set[int]]], best_k: int
) -> None:
    core = core_with_dues(dues, KeeperConfig(best_k=best_k))
    table = _table()
    ring = MemoryRing()
    publisher = Publisher(core, ring, table, core.config)
    tokens: dict[int, tuple[int, int]] = {}  # row -> (hash, token) of its live lease
    version = len(dues) + 1
    now = NOW
    try:
        for grants, elapsed, completed in steps:
            assert _publish(publisher, ring, now) == _free(core, table, now, best_k)
            for key in ring.keys[:grants]:
                got = table.grant(key_hash(key), now, LEASE_MS, 3_600_000)
                assert isinstance(got, Grant)
                tokens[int(key.split(b"/")[-1])] = (got.key_hash, got.token)
            now += elapsed
            for i in sorted(completed & set(tokens)):
                h, token = tokens.pop(i)
                # As a completion does: the row's write first, then the lease ends.
                version += 1
                _write(core, i, now + 600_000 if i % 2 else now - 1, version, now)
                table.complete(h, token, now)
            assert _publish(publisher, ring, now) == _free(core, table, now, best_k)
        assert core.queue.skips.statistics().marked > 0 or not tokens
    finally:
        table.close()
        table.unlink()


class CountingLeases:
    """The lease table, keeping the hashes a publish probes."""

    def __init__(self, table: LeaseTable) -> None:
        self.table = table
        self.probed: list[int] = []

    def blocked_mask(
        self, key_hashes: npt.NDArray[np.uint64], now_ms: int
    ) -> npt.NDArray[np.bool_]:
        self.probed.extend(key_hashes.tolist())
        return self.table.blocked_mask(key_hashes, now_ms)

    def blocked_until(
        self, key_hashes: npt.NDArray[np.uint64], now_ms: int
    ) -> npt.NDArray[np.int64]:
        self.probed.extend(key_hashes.tolist())
        return self.table.blocked_until(key_hashes, now_ms)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)


def test_a_leased_row_is_probed_once_then_passed_over_until_it_is_written() -> None:
    core = core_with_dues([-1_000 * i for i in range(1, 51)], KeeperConfig(best_k=10))
    table = _table()
    leases = CountingLeases(table)
    ring = MemoryRing()
    publisher = Publisher(core, ring, cast(LeaseTableLike, leases), core.config)
    try:
        top = _publish(publisher, ring, NOW)
        leased = {}
        for key in top:
            got = table.grant(key_hash(key), NOW, LEASE_MS, 3_600_000)
            assert isinstance(got, Grant)
            leased[key] = got
        assert _publish(publisher, ring, NOW + 1) == _free(core, table, NOW + 1, 10)
        assert publisher.stats.last_blocked == 10
        assert core.queue.skips.statistics().marked == 10
        # The next publishes pass over the ten in C: counted blocked, none of them probed.
        leases.probed.clear()
        for at in (NOW + 2, NOW + 3):
            assert _publish(publisher, ring, at) == _free(core, table, at, 10)
            assert publisher.stats.last_blocked == publisher.stats.last_passed == 10
        assert leases.probed and not {key_hash(key) for key in top} & set(leases.probed)
        # A completion of the best row: its write (due long ago, a new version), then
        # its lease's end. It is the best again at once.
        best = top[0]
        _write(core, int(best.split(b"/")[-1]), NOW - 5_000_000, 1_000, NOW + 4)
        table.complete(leased[best].key_hash, leased[best].token, NOW + 4)
        assert _publish(publisher, ring, NOW + 4)[0] == best
    finally:
        table.close()
        table.unlink()


def test_a_lease_released_with_no_write_is_published_again_within_the_recheck() -> None:
    """The write of a completion may be read before its lease ends: the mark taken
    between the two holds no longer than RECHECK_MS."""
    with _rig([-1_000, -2_000, -3_000], 3) as (_, table, ring, publisher):
        key = _publish(publisher, ring, NOW)[0]
        got = table.grant(key_hash(key), NOW, LEASE_MS, 3_600_000)
        assert isinstance(got, Grant)
        assert key not in _publish(publisher, ring, NOW)
        table.complete(got.key_hash, got.token, NOW + 1)
        assert key not in _publish(publisher, ring, NOW + RECHECK_MS - 1)  # still marked
        assert key in _publish(publisher, ring, NOW + RECHECK_MS)


def test_a_slot_given_to_another_key_is_not_passed_over() -> None:
    with _rig([-1_000, -2_000], 2) as (core, table, ring, publisher):
        key = _publish(publisher, ring, NOW)[0]
        got = table.grant(key_hash(key), NOW, LEASE_MS, 3_600_000)
        assert isinstance(got, Grant)
        _publish(publisher, ring, NOW)
        slot = core.queue.slot_of(key_hash(key))
        marks = core.queue.skips.columns()
        assert marks is not None and marks[1][marks[0] == slot].tolist() == [NOW + RECHECK_MS]
        core.queue.remove(key_hash(key))
        _write(core, 7, NOW - 9_000, 99, NOW)  # a new row, which may take the freed slot
        assert core.queue.slot_of(key_hash(b"/p/7")) == slot
        assert _publish(publisher, ring, NOW + 1)[0] == b"/p/7"


def test_a_selection_without_the_lease_tables_answer_reads_every_row() -> None:
    with _rig([-1_000, -2_000, -3_000], 3) as (core, table, ring, publisher):
        key = _publish(publisher, ring, NOW)[0]
        assert isinstance(table.grant(key_hash(key), NOW, LEASE_MS, 3_600_000), Grant)
        assert key not in _publish(publisher, ring, NOW)
        everything = core.select(3, NOW, None)
        assert key in core.queue.slots.keys(everything.slots)
        assert core.queue.skips.statistics().marked == 1


def test_the_skip_table_is_checked_at_the_c_boundary() -> None:
    core = core_with_dues([-1_000], KeeperConfig(best_k=1))
    view, skips = core.queue.view, core.queue.skips
    slots = np.zeros(1, dtype=np.int32)
    assert skips.mark(view, slots, np.array([NOW + 5], dtype=np.int64), NOW) == 1
    table = skips.columns()
    assert table is not None
    ends = np.zeros(1, dtype=np.int64)
    with pytest.raises(ValueError, match="one int64 end"):
        view.skip_rows(slots, np.zeros(2, dtype=np.int64), table, NOW, None)
    with pytest.raises(ValueError, match="power-of-two"):
        view.skip_rows(slots, ends, (table[0][:3], table[1][:3], table[2][:3]), NOW, None)
    with pytest.raises(ValueError, match="power-of-two"):
        view.skip_rows(slots, ends, (table[0], table[1][:8], table[2]), NOW, None)
    with pytest.raises(TypeError, match="skip table"):
        view.skip_rows(slots, ends, None, NOW, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="skip table"):
        view.skip_rows(slots, ends, table[:2], NOW, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="power-of-two"):
        bad = (table[0][:3], table[1], table[2])
        view.best_read([1.0], [0.0], [False], NOW, _picked(1), bad)


def _picked(n: int) -> Picked:
    return Picked(
        np.empty(n, dtype=np.int32),
        np.empty(n, dtype=np.float64),
        np.empty(n, dtype=np.int64),
        np.empty(n, dtype=np.uint64),
        np.empty(n, dtype=np.int32),
    )


@given(
    marks=st.lists(
        st.tuples(st.integers(0, 5_000), st.integers(-2_000, 2_000), st.integers(0, 3_000)),
        max_size=600,
    )
)
@settings(max_examples=60, deadline=None)
def test_the_skip_table_answers_as_a_dict_of_its_latest_marks(
    marks: list[tuple[int, int, int]],
) -> None:
    """Marks of slots at times moving on, against a dict of each slot's latest mark; the
    table rebuilds itself as it fills, dead entries taken over or dropped."""
    dues = [-1_000] * 5_001
    core = core_with_dues(dues, KeeperConfig(best_k=1))
    view, skips = core.queue.view, core.queue.skips
    latest: dict[int, int] = {}
    now = NOW
    for slot, end, step in marks:
        now += step
        until = now + end
        skips.mark(view, np.array([slot], dtype=np.int32), np.array([until], np.int64), now)
        if until > now:
            latest[slot] = min(until, now + RECHECK_MS)
    table = skips.columns()
    for slot in range(0, 5_001, 7):
        expected = latest.get(slot, 0) > now
        if table is None:
            assert not expected
            continue
        at = np.flatnonzero(table[0] == slot)
        assert len(at) <= 1
        assert bool(len(at) and table[1][at[0]] > now) == expected
    if table is not None:
        # Every chain ends at an empty entry: at most half the table is ever filled.
        capacity = skips.statistics().capacity
        assert capacity >= 1024 and capacity & (capacity - 1) == 0
        assert skips.nbytes() == 20 * capacity  # slot 4, until 8, tag 8
        assert 2 * np.count_nonzero(table[0] >= 0) <= capacity
