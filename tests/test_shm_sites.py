"""shm/sites.py: caps by timed permits (taken, released, expired, extended, lowered and
raised), spacing, blocks, failure streaks, allowances, the sweep, a full window, a site
with two entries, and claimant processes racing for one capped site (some SIGKILLed while
they hold permits) with a tally that never passes the cap."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from shm import segment_name
from shm._atomics import Words
from shm.segment import HEADER_BYTES, Segment, remove
from shm.sites import (
    BODY_HEAD_WORDS,
    Acquired,
    FailurePolicy,
    SiteBlock,
    SiteTable,
    Skipped,
)

NOW = 1_700_000_000_000
LEASE = 60_000
A, B, C = 0x1111, 0x2222, 0x3333


@pytest.fixture
def name() -> Iterator[str]:
    value = segment_name(f"t{os.getpid()}s{uuid.uuid4().hex[:8]}", "sites")
    yield value
    remove(value)


@pytest.fixture
def table(name: str) -> Iterator[SiteTable]:
    sites = SiteTable.create(name, capacity=64, permits=8)
    yield sites
    sites.close()


def _granted(outcome: Acquired | Skipped) -> Acquired:
    assert type(outcome) is Acquired, outcome
    return outcome


def test_a_site_with_nothing_set_needs_no_entry(table: SiteTable) -> None:
    got = _granted(table.acquire(A, NOW, LEASE))
    assert got.expires_at == 0 and got.previous_last == -1  # nothing to give back
    assert table.info(A, NOW).entries == 0 and table.statistics().entries == 0
    assert table.allowances(np.array([A, 0], dtype=np.uint64), NOW).tolist() == [-1, -1]
    assert _granted(table.acquire(0, NOW, LEASE)).expires_at == 0  # no site


def test_a_cap_grants_that_many_until_one_is_released_or_expires(table: SiteTable) -> None:
    assert table.configure(A, 2, None)
    first = _granted(table.acquire(A, NOW, LEASE))
    second = _granted(table.acquire(A, NOW + 5, LEASE))
    assert (first.expires_at, second.expires_at) == (NOW + LEASE, NOW + 5 + LEASE)
    assert table.acquire(A, NOW + 10, LEASE) == Skipped("capped", NOW + LEASE)
    assert table.allowances(np.array([A, B], dtype=np.uint64), NOW + 10).tolist() == [0, -1]
    assert table.info(A, NOW + 10).in_flight == 2
    assert table.release(A, first.expires_at)
    assert not table.release(A, first.expires_at)  # one permit had that word
    assert table.allowances(np.array([A], dtype=np.uint64), NOW + 10).tolist() == [1]
    third = _granted(table.acquire(A, NOW + 10, LEASE))
    assert table.acquire(A, NOW + 11, LEASE) == Skipped("capped", NOW + 5 + LEASE)
    # A permit nobody released (its holder was killed) ends with its lease.
    assert _granted(table.acquire(A, second.expires_at, LEASE)).expires_at == (
        second.expires_at + LEASE
    )
    assert table.info(A, second.expires_at).in_flight == 2
    assert table.release(A, third.expires_at)
    stats = table.statistics()
    assert (stats.permits_taken, stats.skips_capped, stats.releases) == (4, 2, 2)


def test_a_renewal_moves_the_permit_and_a_lost_one_is_taken_again(table: SiteTable) -> None:
    table.configure(A, 1, None)
    got = _granted(table.acquire(A, NOW, LEASE))
    assert table.extend(A, got.expires_at, got.expires_at + 1_000)
    assert not table.extend(A, got.expires_at, got.expires_at + 2_000)
    assert table.acquire(A, got.expires_at + 500, LEASE) == Skipped(
        "capped", got.expires_at + 1_000
    )
    assert table.take_permit(A, NOW, LEASE) == 0  # the one permit is live
    assert table.release(A, got.expires_at + 1_000)
    assert table.take_permit(A, NOW, LEASE) == NOW + LEASE


def test_lowering_a_cap_admits_nothing_until_in_flight_drops_below_it(table: SiteTable) -> None:
    table.configure(A, 4, None)
    held = [_granted(table.acquire(A, NOW + i, LEASE)).expires_at for i in range(4)]
    table.configure(A, 2, None)
    assert table.acquire(A, NOW + 10, LEASE) == Skipped("capped", held[0])
    table.release(A, held[3])
    table.release(A, held[2])
    assert type(table.acquire(A, NOW + 10, LEASE)) is Skipped  # 2 in flight, cap 2
    table.release(A, held[1])
    _granted(table.acquire(A, NOW + 10, LEASE))
    assert type(table.acquire(A, NOW + 11, LEASE)) is Skipped
    table.configure(A, 5, None)  # raised: three more
    for i in range(3):
        _granted(table.acquire(A, NOW + 20 + i, LEASE))
    assert type(table.acquire(A, NOW + 30, LEASE)) is Skipped
    assert table.info(A, NOW + 30).in_flight == 5
    table.configure(A, 0, None)  # 0: the site is paused
    assert table.allowances(np.array([A], dtype=np.uint64), NOW).tolist() == [0]


def test_settings_fall_back_to_the_defaults_and_are_checked(name: str) -> None:
    sites = SiteTable.create(name, capacity=64, permits=8, default_max_in_flight=1)
    try:
        assert sites.default_max_in_flight == 1
        _granted(sites.acquire(A, NOW, LEASE))
        assert type(sites.acquire(A, NOW, LEASE)) is Skipped
        sites.configure(A, 3, None)
        info = sites.info(A, NOW)
        assert (info.max_in_flight, info.max_in_flight_set, info.min_interval_set) == (
            3,
            True,
            False,
        )
        _granted(sites.acquire(A, NOW, LEASE))
        sites.configure(A, None, None)  # cleared: the default again
        assert sites.info(A, NOW).max_in_flight == 1 and not sites.info(A, NOW).max_in_flight_set
        assert type(sites.acquire(A, NOW, LEASE)) is Skipped
        with pytest.raises(ValueError, match=r"max_in_flight 9 is outside 0\.\.8"):
            sites.configure(A, 9, None)
        with pytest.raises(ValueError, match="min_interval_ms 86400001"):
            sites.configure(A, None, 86_400_001)
        with pytest.raises(ValueError, match="site hash 0"):
            sites.configure(0, 1, None)
    finally:
        sites.close()
    with pytest.raises(ValueError, match="default max in flight"):
        SiteTable.create(name, capacity=64, permits=8, default_max_in_flight=9)


def test_settings_written_as_of_a_reserved_version_never_overwrite_newer_ones(
    table: SiteTable,
) -> None:
    """The keeper reserves a version, then reads the store; a worker's configure made
    meanwhile (after its own store write) is newer and stays."""
    kept = table.reserve_version()
    assert table.reserve_version() == kept  # reserving moves no version
    assert table.configure_as_of(A, 4, None, kept) == "in_force"
    assert table.configure_as_of(A, 4, 250, kept) == "in_force"  # the same version: later wins
    assert table.configure(A, 5, 100)  # a worker's, with a new version
    assert table.configure_as_of(A, 4, None, kept) == "superseded"
    info = table.info(A, NOW)
    assert (info.max_in_flight, info.min_interval_ms) == (5, 100)
    # A version reserved after the worker's configure is newer than it.
    later = table.reserve_version()
    assert later != kept
    assert table.configure_as_of(A, None, None, later) == "in_force"
    assert not table.info(A, NOW).max_in_flight_set and not table.info(A, NOW).min_interval_set
    # Clearing a site with no entry holds nothing, so nothing can supersede it.
    assert table.configure_as_of(B, None, None, kept) == "in_force"
    assert table.info(B, NOW).entries == 0
    with pytest.raises(ValueError, match="not one reserve_version"):
        table.configure_as_of(A, 1, None, 1 << 22)


def test_spacing_keeps_grants_apart_and_undo_gives_the_slot_back(table: SiteTable) -> None:
    table.configure(A, None, 200)
    first = _granted(table.acquire(A, NOW, LEASE))
    assert first.expires_at == 0 and first.previous_last == 0
    assert table.acquire(A, NOW + 199, LEASE) == Skipped("spacing", NOW + 200)
    assert table.acquire(A, NOW - 50, LEASE) == Skipped("spacing", NOW + 200)  # a stale clock
    assert table.allowances(np.array([A], dtype=np.uint64), NOW + 100).tolist() == [0]
    assert table.allowances(np.array([A], dtype=np.uint64), NOW + 200).tolist() == [1]
    second = _granted(table.acquire(A, NOW + 200, LEASE))
    assert second.previous_last == NOW
    table.undo(second)  # its lease was refused: as if it never happened
    assert table.info(A, NOW + 250).last_grant_at == NOW
    _granted(table.acquire(A, NOW + 250, LEASE))


def test_a_cap_and_a_spacing_together(table: SiteTable) -> None:
    table.configure(A, 1, 100)
    got = _granted(table.acquire(A, NOW, LEASE))
    assert table.acquire(A, NOW + 150, LEASE) == Skipped("capped", got.expires_at)
    table.undo(got)  # both the permit and the last grant are given back
    assert table.info(A, NOW).in_flight == 0 and table.info(A, NOW).last_grant_at == 0
    _granted(table.acquire(A, NOW + 1, LEASE))


def test_blocks_only_grow_and_hold_every_key_of_the_site(table: SiteTable) -> None:
    assert table.block(A, NOW + 5_000, "retry_after") == NOW + 5_000
    assert table.block(A, NOW + 1_000, "failures") == NOW + 5_000  # shorter: the longer stays
    assert table.acquire(A, NOW, LEASE) == Skipped("blocked", NOW + 5_000)
    info = table.info(A, NOW)
    assert (info.blocked_until, info.blocked_reason, info.skips) == (
        NOW + 5_000,
        "retry_after",
        1,
    )
    assert table.allowances(np.array([A], dtype=np.uint64), NOW + 4_999).tolist() == [0]
    _granted(table.acquire(A, NOW + 5_000, LEASE))
    stats = table.statistics()
    assert (stats.blocks_retry_after, stats.blocks_failures) == (1, 0)  # the one that counted


def test_failed_renders_in_a_row_block_the_site_doubling_until_a_success(name: str) -> None:
    policy = FailurePolicy(streak=3, window_ms=10_000, block_ms=1_000, block_max_ms=3_000)
    sites = SiteTable.create(name, capacity=64, permits=8, failures=policy)
    try:
        assert [sites.outcome(A, NOW + i, failed=True) for i in range(3)] == [0, 0, NOW + 2 + 1_000]
        assert sites.info(A, NOW + 3).blocked_reason == "failures"
        t = NOW + 5_000
        assert [sites.outcome(A, t + i, failed=True) for i in range(3)] == [0, 0, t + 2 + 2_000]
        t += 10_000
        assert sites.outcome(A, t, failed=True) == 0
        assert sites.outcome(A, t + 20_000, failed=True) == 0  # past the window: a new streak
        assert sites.outcome(A, t + 20_001, failed=True) == 0
        assert sites.outcome(A, t + 20_002, failed=True) == t + 20_002 + 3_000  # at the max
        sites.outcome(A, t + 30_000, failed=False)  # a success: the streak and length reset
        info = sites.info(A, t + 30_000)
        assert (info.failure_streak, info.failure_block_ms) == (0, 0)
        t += 40_000
        assert [sites.outcome(A, t + i, failed=True) for i in range(3)][-1] == t + 2 + 1_000
        sites.outcome(A, t + 3, failed=True)
        sites.outcome(A, t + 4, failed=False)  # a success ends the streak
        assert sites.outcome(A, t + 5, failed=True) == 0
        assert sites.statistics().blocks_failures == 4
    finally:
        sites.close()


def test_the_sweep_empties_idle_entries_only(table: SiteTable) -> None:
    table.configure(A, None, 100)  # a setting: kept
    _granted(table.acquire(B, NOW, LEASE))  # B has nothing: no entry at all
    table.block(C, NOW + 1_000, "retry_after")
    assert table.statistics().entries == 2
    assert table.sweep(NOW + 500) == 0
    assert table.sweep(NOW + 1_000) == 1  # C's block ended
    table.configure(A, 2, None)
    held = _granted(table.acquire(A, NOW + 2_000, 10 * LEASE))
    table.configure(A, None, None)
    assert table.sweep(NOW + 2_000 + 60_000) == 0  # a live permit keeps the entry
    table.release(A, held.expires_at)
    assert table.sweep(NOW + 2_000 + 60_000) == 1
    stats = table.statistics()
    assert (stats.entries, stats.reclaimed, stats.sweeps) == (0, 2, 4)
    assert table.info(A, NOW).entries == 0


def _raw(table: SiteTable) -> tuple[Words, int]:
    """The table's words, and the word index of its key array."""
    words = Words(table._segment.mmap)
    return words, table_slots_word(table)


def table_slots_word(table: SiteTable) -> int:
    from shm.sites import _SLOTS

    del table
    return _SLOTS // 8


def test_a_site_with_two_entries_is_counted_over_both(name: str) -> None:
    """Two inserts racing a removal can leave a site two entries: its permits are counted
    over both, the newest settings win."""
    sites = SiteTable.create(name, capacity=8, permits=4)  # one window: the whole table
    words, keys = _raw(sites)
    try:
        sites.configure(A, 2, None)
        first = _granted(sites.acquire(A, NOW, LEASE))
        slot = next(s for s in range(8) if words.load(keys + s) == A)
        other = (slot + 3) % 8
        states, bodies = keys + 8, keys + 16
        body = BODY_HEAD_WORDS + 4
        # A copy of the entry in another slot, with one permit live of its own.
        words.store(bodies + other * body + BODY_HEAD_WORDS, NOW + LEASE + 7)
        words.store(bodies + other * body + 5, 1)  # its permits' high-water
        words.store(keys + other, A)
        words.store(states + other, words.load(states + slot) & ~3 | 1)
        assert sites.info(A, NOW).entries == 2 and sites.info(A, NOW).in_flight == 2
        assert type(sites.acquire(A, NOW, LEASE)) is Skipped  # 1 + 1: at the cap
        assert sites.release(A, NOW + LEASE + 7)  # the other entry's permit
        _granted(sites.acquire(A, NOW + 1, LEASE))
        sites.configure(A, 3, None)  # written to both, with one version
        assert sites.info(A, NOW).max_in_flight == 3
        assert sites.release(A, first.expires_at)
    finally:
        words.release()
        sites.close()


def test_a_full_window_refuses_a_site_that_needs_an_entry(name: str) -> None:
    sites = SiteTable.create(name, capacity=8, permits=2, default_max_in_flight=1)
    try:
        for h in range(1, 9):
            _granted(sites.acquire(h * 0x10001, NOW, LEASE))
        assert sites.acquire(0x99999, NOW, LEASE) == Skipped("table_full", 0)
        assert not sites.configure(0x99999, 1, None)
        assert sites.statistics().skips_full == 1
    finally:
        sites.close()


def test_a_segment_of_another_layout_is_refused(name: str) -> None:
    sites = SiteTable.create(name, capacity=64, permits=8)
    try:
        other = SiteTable.attach(name)
        assert other.permits == 8 and other.capacity == 64
        other.close()
        header = np.frombuffer(sites._segment.mmap, dtype=np.uint64, count=HEADER_BYTES // 8)
        header[7] = 99  # item size
        del header
        from shm import LayoutMismatch

        with pytest.raises(LayoutMismatch, match="item size 99"):
            SiteTable.attach(name)
    finally:
        sites.close()


# -- racing processes -------------------------------------------------------------------


def _race(name: str, tally: str, site: int, cap: int, seconds: float, hold: bool) -> int:
    """Acquire, count ourselves in a shared tally, check it, count out, release; `hold`:
    keep every permit taken (a process that will be SIGKILLed holding them)."""
    sites = SiteTable.attach(name)
    shm = Segment.attach(tally, "tally", 8, lambda capacity, extra: HEADER_BYTES + 64)
    words = shm.register(Words(shm.mmap, HEADER_BYTES, 64))
    granted = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = time.time_ns() // 1_000_000
        got = sites.acquire(site, now, 2_000 if hold else 60_000)
        if type(got) is not Acquired:
            continue
        granted += 1
        inside = words.fetch_add(0, 1) + 1
        if inside > cap:
            words.fetch_add(1, 1)  # a violation
        words.fetch_add(2, 1)
        if hold:
            words.fetch_add(3, 1)  # held until killed: the tally keeps them
            continue
        words.fetch_add(0, -1)
        sites.release(site, got.expires_at)
    shm.close()
    sites.close()
    return granted


def test_racing_processes_never_pass_a_cap_and_a_killed_holder_leaks_nothing(
    name: str,
) -> None:
    cap = 3
    sites = SiteTable.create(name, capacity=64, permits=8)
    tally = segment_name(f"t{os.getpid()}t{uuid.uuid4().hex[:8]}", "tally")
    shm = Segment.create(tally, "tally", HEADER_BYTES + 64, 1, 0, 8)
    words = shm.register(Words(shm.mmap, HEADER_BYTES, 64))
    try:
        sites.configure(A, cap, None)
        ctx = multiprocessing.get_context("spawn")
        # One process takes every permit it can and is SIGKILLed holding them.
        holder = ctx.Process(target=_race, args=(name, tally, A, cap, 60.0, True))
        holder.start()
        deadline = time.monotonic() + 30
        while words.load(3) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert words.load(3) >= 1
        os.kill(holder.pid or 0, signal.SIGKILL)
        holder.join(10)
        killed_at = time.time_ns() // 1_000_000
        held = int(words.load(3))
        words.store(0, 0)  # the dead holder's permits are in no tally: they only expire
        with ctx.Pool(3) as pool:
            runs = [pool.apply_async(_race, (name, tally, A, cap, 4.0, False)) for _ in range(3)]
            granted = [r.get(120) for r in runs]
        assert words.load(1) == 0  # never more than the cap inside at once
        assert sum(granted) > 100 and all(granted)
        # The killed holder's permits ended with their leases (2 s), and nothing else
        # is left live.
        now = time.time_ns() // 1_000_000
        assert now >= killed_at + 2_000
        assert sites.info(A, now).in_flight == 0
        print(f"held by the killed process: {held}; granted after: {granted}")
        print(sites.statistics())
    finally:
        words.release()
        shm.close()
        remove(tally)
        sites.close()


def test_blocks_lists_the_sites_blocked_now_with_their_reasons(table: SiteTable) -> None:
    assert table.block(A, NOW + 5_000, "retry_after") == NOW + 5_000
    assert table.block(B, NOW + 1_000, "failures") == NOW + 1_000
    assert table.configure(C, 2, None)  # an entry, never blocked
    assert sorted(table.blocks(NOW), key=lambda block: block.site_hash) == [
        SiteBlock(A, NOW + 5_000, "retry_after"),
        SiteBlock(B, NOW + 1_000, "failures"),
    ]
    assert table.blocks(NOW + 1_000) == [SiteBlock(A, NOW + 5_000, "retry_after")]
