"""shm/leases.py: grants, tokens, hold-back, the probe window, sweep and blocked_mask;
a hypothesis state machine against a plain dict model; four processes racing for the
same keys with no overlapping live leases; a claimant SIGKILLed mid-claim; and leases
under a site table (permits taken before the lease, moved by renewals, freed after
results and refused grants)."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import hash_secret  # noqa: F401  (spawned children import this module: they hash alike)
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shm import Grant, KeyLeaseState, LeaseTable, Refusal, SiteTable, key_hash, segment_name
from shm.segment import remove


def _name(part: str = "leases") -> str:
    return segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", part)


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    created = LeaseTable.create(_name(), capacity=256)
    yield created
    created.close()
    created.unlink()


H = key_hash(b"/product/1")


def test_one_grant_per_live_lease_and_tokens_fence(table: LeaseTable) -> None:
    first = table.grant(H, 1_000, 100, 10_000)
    assert isinstance(first, Grant) and first.expires_at == 1_100 and first.key_hash == H
    assert table.grant(H, 1_050, 100, 10_000) == Refusal("taken", 1_100)
    assert table.holds(H, first.token, 1_099) and not table.holds(H, first.token, 1_100)
    assert table.renew(H, first.token, 1_050, 200) == 1_250
    assert table.grant(H, 1_200, 100, 10_000) == Refusal("taken", 1_250)
    assert table.complete(H, first.token, 1_210)
    assert table.state(H, 1_210) == KeyLeaseState(False, 0, False, 0, 0)
    second = table.grant(H, 1_220, 100, 10_000)
    assert isinstance(second, Grant) and second.token != first.token
    # The first token is stale now: it changes nothing.
    assert not table.holds(H, first.token, 1_230)
    assert table.renew(H, first.token, 1_230, 500) is None
    assert not table.complete(H, first.token, 1_230)
    assert table.state(H, 1_230).lease_expires_at == 1_320
    assert not table.complete(H + 1, second.token, 1_230)  # another key's hash
    assert table.complete(H, second.token, 1_230)
    stats = table.statistics(1_230)
    assert (stats.grants, stats.renewals, stats.completions) == (2, 1, 2)
    assert (stats.refusals_taken, stats.stale_tokens) == (2, 3)  # renew + 2 completes


def test_unanswered_leases_hold_the_key_back_2_4_8_leases_capped_at_cadence(
    table: LeaseTable,
) -> None:
    lease, cadence, now = 100, 1_000, 10_000
    holds = []
    for _ in range(5):
        grant = table.grant(H, now, lease, cadence)
        assert isinstance(grant, Grant)
        expired = grant.expires_at
        refusal = table.grant(H, expired, lease, cadence)  # expired, no result: held
        assert isinstance(refusal, Refusal) and refusal.reason == "held"
        holds.append(refusal.until - expired)
        state = table.state(H, expired)
        assert state.held and state.held_until == refusal.until and not state.leased
        assert table.grant(H, refusal.until - 1, lease, cadence) == refusal
        now = refusal.until
    assert holds == [200, 400, 800, 1_000, 1_000]
    assert table.state(H, now).misses == 5
    grant = table.grant(H, now, lease, cadence)
    assert isinstance(grant, Grant)
    assert table.complete(H, grant.token, now + 1)  # a result resets the misses
    assert table.state(H, now + 1).misses == 0
    grant = table.grant(H, now + 2, lease, cadence)
    assert isinstance(grant, Grant)
    assert table.grant(H, grant.expires_at, lease, cadence) == Refusal(
        "held", grant.expires_at + 200
    )
    stats = table.statistics(now)
    assert stats.expiries == 6 and stats.hold_events == 6 and stats.refusals_held == 11


def test_blocked_until_is_the_end_of_a_lease_then_of_the_hold_it_earned(
    table: LeaseTable,
) -> None:
    other = key_hash(b"/other")
    grant = table.grant(H, 0, 100, 10_000)
    assert isinstance(grant, Grant)
    hashes = np.array([H, other, 0], dtype=np.uint64)
    assert table.blocked_until(hashes, 50).tolist() == [100, 0, 0]
    assert table.blocked_until(hashes, 150).tolist() == [300, 0, 0]  # its hold, read
    assert table.blocked_until(hashes, 300).tolist() == [0, 0, 0]
    for now in (0, 50, 99, 100, 150, 299, 300):
        until = table.blocked_until(hashes, now)
        assert (until > 0).tolist() == table.blocked_mask(hashes, now).tolist()
    with pytest.raises(ValueError, match="8-byte output"):
        table._c.blocked_until(hashes, np.zeros(3, dtype=np.int32), 0)


def test_state_and_blocked_mask_read_an_expired_lease_as_its_hold(table: LeaseTable) -> None:
    other = key_hash(b"/other")
    grant = table.grant(H, 0, 100, 10_000)
    assert isinstance(grant, Grant)
    hashes = np.array([H, other, 0], dtype=np.uint64)
    assert table.blocked_mask(hashes, 50).tolist() == [True, False, False]
    # Expired with no result: nobody has settled it yet, it already reads as held.
    assert table.state(H, 150) == KeyLeaseState(False, 0, True, 300, 1)
    assert table.blocked_mask(hashes, 299).tolist() == [True, False, False]
    assert table.blocked_mask(hashes, 300).tolist() == [False, False, False]
    census = table.census(150)
    assert (census.expired_unanswered, census.held_keys, census.live_leases) == (1, 1, 0)
    stats = table.statistics(150)
    assert stats.expiries == 0  # reading does not settle ...
    assert (stats.live_leases, stats.held_keys) == (1, 0)  # ... so the counters lag
    assert table.sweep(150) == 0
    stats = table.statistics()
    assert (stats.live_leases, stats.held_keys, stats.expiries) == (0, 1, 1)
    assert table.sweep(300) == 0  # the hold ended: the sweep takes it off the count
    assert table.statistics().held_keys == 0 and table.census(300).held_keys == 0


def test_counters_follow_grant_renew_complete_settle_and_sweep(table: LeaseTable) -> None:
    keys = [key_hash(b"/c/%d" % i) for i in range(4)]
    grants = [table.grant(h, 0, 100, 10_000) for h in keys]
    assert all(isinstance(g, Grant) for g in grants)

    def live() -> tuple[int, int, int]:
        stats = table.statistics()
        return stats.occupied, stats.live_leases, stats.held_keys

    assert live() == (4, 4, 0)
    assert isinstance(grants[0], Grant) and table.renew(keys[0], grants[0].token, 50, 100)
    assert isinstance(grants[1], Grant) and table.complete(keys[1], grants[1].token, 50)
    assert live() == (4, 3, 0)
    assert table.grant(keys[2], 100, 100, 10_000) == Refusal("held", 300)  # settles keys[2]
    assert live() == (4, 2, 1)
    assert table.sweep(120, keep_misses_ms=1_000) == 1  # keys[1]'s slot; settles keys[3]
    assert live() == (3, 1, 2)
    census = table.census(120)
    assert (census.occupied, census.live_leases, census.held_keys) == live()
    assert isinstance(table.grant(keys[2], 300, 100, 10_000), Grant)  # the hold ended
    assert live() == (3, 2, 1)
    assert table.sweep(1_300, keep_misses_ms=1_000) == 1  # keys[3]'s hold, forgotten
    census = table.census(1_300)
    assert live() == (census.occupied, census.live_leases, census.held_keys) == (2, 0, 0)


def test_a_full_probe_window_refuses_and_is_counted() -> None:
    table = LeaseTable.create(_name(), capacity=8)  # one window: the whole table
    try:
        hashes = [key_hash(b"k%d" % i) for i in range(10)]
        grants = [table.grant(h, 0, 1_000, 10_000) for h in hashes[:8]]
        assert all(isinstance(g, Grant) for g in grants)
        assert table.grant(hashes[8], 0, 1_000, 10_000) == Refusal("probe_full", 0)
        stats = table.statistics(0)
        assert stats.refusals_probe_full == 1 and stats.occupied == 8 and stats.occupancy == 1.0
        assert table.sweep(10) == 0  # every lease is live: nothing reclaimed
        for h, g in zip(hashes[:4], grants[:4], strict=True):
            assert isinstance(g, Grant) and table.complete(h, g.token, 20)
        # A full window with a completed slot: the grant empties that slot itself.
        assert isinstance(table.grant(hashes[8], 30, 1_000, 10_000), Grant)
        assert table.statistics(30).reclaimed == 1
        assert table.sweep(40) == 3  # the sweep takes the other completed slots ...
        assert isinstance(table.grant(hashes[9], 50, 1_000, 10_000), Grant)  # ... for reuse
        for h, g in zip(hashes[4:8], grants[4:8], strict=True):
            assert isinstance(g, Grant) and table.holds(h, g.token, 50)  # live leases untouched
        assert table.statistics(50).occupied == 6
    finally:
        table.close()
        table.unlink()


def test_a_full_window_takes_a_hold_that_ended_long_ago_but_not_a_recent_one() -> None:
    from shm.leases import KEEP_MISSES_MS

    table = LeaseTable.create(_name(), capacity=8)
    try:
        hashes = [key_hash(b"h%d" % i) for i in range(9)]
        for h in hashes[:8]:
            assert isinstance(table.grant(h, 0, 100, 1_000), Grant)
            assert table.grant(h, 100, 100, 1_000) == Refusal("held", 300)  # expired: held
        # Holds ended at 300, but their misses are kept for KEEP_MISSES_MS after that.
        assert table.grant(hashes[8], 300 + KEEP_MISSES_MS - 1, 100, 1_000) == Refusal(
            "probe_full", 0
        )
        assert isinstance(table.grant(hashes[8], 300 + KEEP_MISSES_MS, 100, 1_000), Grant)
        assert table.statistics(0).reclaimed == 1
    finally:
        table.close()
        table.unlink()


def test_sweep_keeps_holds_until_they_are_old_enough(table: LeaseTable) -> None:
    table.grant(H, 0, 100, 10_000)
    assert table.sweep(100, keep_misses_ms=1_000) == 0  # settles: held until 300
    stats = table.statistics(100)
    assert stats.expiries == 1 and stats.held_keys == 1 and stats.sweeps == 1
    assert table.sweep(1_299, keep_misses_ms=1_000) == 0
    assert table.state(H, 1_299).misses == 1
    assert table.sweep(1_300, keep_misses_ms=1_000) == 1  # misses forgotten
    assert table.state(H, 1_300) == KeyLeaseState(False, 0, False, 0, 0)
    assert table.statistics(1_300).occupied == 0


def test_a_key_in_two_slots_is_granted_once_and_swept_back_to_one(table: LeaseTable) -> None:
    """Two claimants inserting one key while a sweep empties a slot can leave the key in
    two slots; build that state by hand and check every path treats the pair as one key."""
    from shm.leases import _SLOTS, SLOT

    slots = np.ndarray((table.capacity,), dtype=SLOT, buffer=table._segment.mmap, offset=_SLOTS)
    first = (H * table.capacity) >> 64  # the window's first slot
    second = (first + 1) % table.capacity
    slots["key_hash"][second] = H
    table.recount(0)  # slots written by hand: counters and tag lanes from the slots
    held = table.grant(H, 0, 100, 10_000)
    assert isinstance(held, Grant) and held.token >> 16 == second  # found, not re-inserted
    slots["key_hash"][first] = H  # a duplicate, idle, ahead of the live lease
    table.recount(20)
    assert table.grant(H, 20, 100, 10_000) == Refusal("taken", 100)  # seen across both
    assert table.blocked_mask(np.array([H], dtype=np.uint64), 20).tolist() == [True]
    assert table.state(H, 20).leased
    assert table.complete(H, held.token, 30)
    again = table.grant(H, 40, 100, 10_000)
    assert isinstance(again, Grant) and again.token >> 16 == first  # the first slot wins
    assert table.sweep(50) == 1  # the idle duplicate goes, the live lease stays
    assert table.holds(H, again.token, 50)
    assert table.statistics(50).occupied == 1
    del slots


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["grant", "complete", "sweep", "advance"]),
        st.integers(0, 39),  # which key
        st.integers(1, 300),  # lease ms, or how far to advance
    ),
    max_size=120,
)


@given(ops=_OPS, capacity=st.sampled_from([8, 16, 64]))
@settings(max_examples=60, deadline=None)
def test_blocked_mask_with_tag_lanes_equals_a_probe_of_every_key(
    ops: list[tuple[str, int, int]], capacity: int
) -> None:
    """The tag lanes let blocked_mask skip keys no slot holds; against brute force (a
    probe of every key, and the lanes read from the raw slots) in crowded tables where
    slots are emptied and taken by other keys."""
    from shm.leases import _SLOTS, SLOT, _tags_offset

    table = LeaseTable.create(_name("tags"), capacity=capacity)
    try:
        keys = [key_hash(b"/t/%d" % i) for i in range(40)]
        never = [key_hash(b"/never/%d" % i) for i in range(20)]
        hashes = np.array(keys + never, dtype=np.uint64)
        tokens: dict[int, int] = {}
        now = 1_000
        slots = np.ndarray((capacity,), dtype=SLOT, buffer=table._segment.mmap, offset=_SLOTS)
        lanes = np.ndarray(
            (capacity,), dtype=np.uint8, buffer=table._segment.mmap, offset=_tags_offset(capacity)
        )
        for op, i, amount in ops:
            h = keys[i]
            if op == "grant":
                got = table.grant(h, now, amount, 500)
                if isinstance(got, Grant):
                    tokens[h] = got.token
            elif op == "complete" and h in tokens:
                table.complete(h, tokens.pop(h), now)
            elif op == "sweep":
                table.sweep(now, amount)
            else:
                now += amount
            expected = [(lambda s: s.leased or s.held)(table.state(int(x), now)) for x in hashes]
            assert table.blocked_mask(hashes, now).tolist() == expected
            # Every key in a leased or held slot has its bit in the slot's lane.
            phase = slots["state"] & 3
            for slot in np.flatnonzero((slots["key_hash"] != 0) & ((phase == 1) | (phase == 2))):
                bit = 1 << (int(slots["key_hash"][slot]) & 7)
                assert int(lanes[slot]) & bit, (slot, op)
        del slots, lanes
    finally:
        table.close()
        table.unlink()


def test_bad_arguments_are_refused(table: LeaseTable) -> None:
    with pytest.raises(ValueError, match="key hash 0"):
        table.grant(0, 0, 100, 100)
    with pytest.raises(ValueError, match="lease_ms"):
        table.grant(H, 0, 0, 100)
    with pytest.raises(ValueError, match="now"):
        table.grant(H, -1, 100, 100)


# ------------------------------------------------------------------ sites

SITE = 0xABCDEF


@pytest.fixture
def sited(table: LeaseTable) -> Iterator[tuple[LeaseTable, SiteTable]]:
    sites = SiteTable.create(_name("sites"), capacity=64, permits=4)
    table.use_sites(sites)
    yield table, sites
    table.use_sites(None)
    sites.close()
    sites.unlink()


K1, K2, K3 = (key_hash(b"/s/%d" % i) for i in range(3))


def _lease(outcome: Grant | Refusal) -> Grant:
    assert isinstance(outcome, Grant), outcome
    return outcome


def test_a_capped_site_grants_its_keys_up_to_the_cap(
    sited: tuple[LeaseTable, SiteTable],
) -> None:
    table, sites = sited
    sites.configure(SITE, 1, None)
    first = _lease(table.grant(K1, 1_000, 100, 10_000, SITE))
    assert table.grant(K2, 1_010, 100, 10_000, SITE) == Refusal("site_capped", 1_100)
    assert table.lease_site(K1, first.token, 1_050) == SITE
    assert table.lease_site(K1, first.token, 1_100) is None  # not live
    assert table.complete(K1, first.token, 1_050)  # the lease ends, then the permit
    assert sites.info(SITE, 1_050).in_flight == 0
    second = _lease(table.grant(K2, 1_060, 100, 10_000, SITE))
    # A refused lease gives its permit back: K2 is taken, so K2 again is refused as taken.
    assert table.grant(K2, 1_070, 100, 10_000, SITE) == Refusal("site_capped", 1_160)
    sites.configure(SITE, 2, None)
    assert table.grant(K2, 1_070, 100, 10_000, SITE) == Refusal("taken", 1_160)
    assert sites.info(SITE, 1_070).in_flight == 1 and sites.statistics().undone == 1
    assert table.fail(K2, second.token, 1_080) is not None  # a failure frees it too
    assert sites.info(SITE, 1_080).in_flight == 0
    other = _lease(table.grant(K3, 1_090, 100, 10_000))  # no site: nothing taken
    assert table.lease_site(K3, other.token, 1_090) == 0


def test_live_leases_are_counted_by_site_capped_or_not(
    sited: tuple[LeaseTable, SiteTable],
) -> None:
    table, sites = sited
    sites.configure(SITE, 2, None)
    other = SITE + 1
    keys = [key_hash(b"/by-site/%d" % i) for i in range(6)]
    capped = [_lease(table.grant(k, 1_000, 100, 10_000, SITE)) for k in keys[:2]]
    uncapped = [
        _lease(table.grant(k, 1_000, 100 + i, 10_000, other)) for i, k in enumerate(keys[2:5])
    ]
    _lease(table.grant(keys[5], 1_000, 100, 10_000))  # no site
    hashes, counts = table.live_by_site(1_050)
    assert dict(zip(hashes.tolist(), counts.tolist(), strict=True)) == {other: 3, SITE: 2, 0: 1}
    assert hashes.tolist()[0] == other  # most first
    assert table.complete(keys[0], capped[0].token, 1_050)
    hashes, counts = table.live_by_site(1_100)  # expired leases are not in flight
    assert dict(zip(hashes.tolist(), counts.tolist(), strict=True)) == {other: 2}
    assert uncapped[0].expires_at == 1_100
    hashes, counts = table.live_by_site(2_000)
    assert hashes.size == 0 and counts.size == 0


def test_a_spacing_or_a_block_refuses_with_the_sites_reason(
    sited: tuple[LeaseTable, SiteTable],
) -> None:
    table, sites = sited
    sites.configure(SITE, None, 200)
    _lease(table.grant(K1, 1_000, 100, 10_000, SITE))
    assert table.grant(K2, 1_100, 100, 10_000, SITE) == Refusal("site_spacing", 1_200)
    _lease(table.grant(K2, 1_200, 100, 10_000, SITE))
    sites.block(SITE, 5_000, "retry_after")
    assert table.grant(K3, 1_400, 100, 10_000, SITE) == Refusal("site_blocked", 5_000)


def _batch(
    table: LeaseTable, hashes: list[int], sites: list[int], now: int, lease_ms: int
) -> list[tuple[int, int]]:
    tokens, expires = table.grant_batch(
        np.array(hashes, dtype=np.uint64),
        np.array(sites, dtype=np.uint64),
        np.full(len(hashes), 10_000, dtype=np.uint64),
        now,
        lease_ms,
    )
    return list(zip(tokens.tolist(), expires.tolist(), strict=True))


def test_a_batch_grant_decides_each_key_as_grant_does_in_order(
    sited: tuple[LeaseTable, SiteTable],
) -> None:
    table, sites = sited
    sites.configure(SITE, 2, None)
    held = _lease(table.grant(K3, 900, 100, 10_000))
    assert table.fail(K3, held.token, 950) is not None  # K3 held back until 1_150
    k4, k5 = (key_hash(b"/s/%d" % i) for i in (4, 5))
    # K1 twice: the first takes it, the second finds it taken; SITE's cap of 2 takes K2 and
    # refuses k4 (a permit and no lease); a hash of 0 is skipped; k5 names no site.
    got = _batch(table, [K1, K1, K2, K3, k4, 0, k5], [SITE, SITE, SITE, 0, SITE, 0, 0], 1_000, 100)
    (t1, e1), taken, (t2, e2), refused_held, capped, skipped, (t5, e5) = got
    assert t1 and t2 and t5 and e1 == e2 == e5 == 1_100
    assert taken == (0, 1_100) and refused_held == (0, 1_150) and skipped == (0, 0)
    assert capped == (0, 1_100)  # the earliest permit's end
    assert table.holds(K1, t1, 1_050) and table.holds(K2, t2, 1_050) and table.holds(k5, t5, 1_050)
    assert table.lease_site(K1, t1, 1_050) == SITE and table.lease_site(k5, t5, 1_050) == 0
    # The refused second K1 gave its permit back: only the two leases hold one.
    assert sites.info(SITE, 1_050).in_flight == 2 and sites.statistics().undone == 1
    assert table.complete(K1, t1, 1_060)  # frees a permit, as a single grant's would
    assert sites.info(SITE, 1_060).in_flight == 1
    ((t4, _),) = _batch(table, [k4], [SITE], 1_070, 100)
    assert t4 and table.lease_site(k4, t4, 1_070) == SITE


def test_a_batch_grant_without_a_site_table_takes_no_permit(table: LeaseTable) -> None:
    ((token, expires),) = _batch(table, [K1], [SITE], 1_000, 100)
    assert token and expires == 1_100 and table.lease_site(K1, token, 1_000) == SITE
    _, _, permit = table._c.lease_of(K1, token, 1_000) or (0, 0, True)
    assert not permit


def test_a_batch_grant_refuses_arrays_of_other_lengths(table: LeaseTable) -> None:
    hashes = np.array([K1, K2], dtype=np.uint64)
    with pytest.raises(ValueError, match="site_hashes"):
        table._c.grant_batch(hashes, np.zeros(1, np.uint64), np.zeros(2, np.uint64), 1, 1, None,
                             np.zeros(2, np.uint64), np.zeros(2, np.uint64))  # fmt: skip
    with pytest.raises(ValueError, match="lease_ms"):
        table.grant_batch(hashes, np.zeros(2, np.uint64), np.zeros(2, np.uint64), 1, 0)
    with pytest.raises(TypeError, match="Sites"):
        table._c.grant_batch(hashes, np.zeros(2, np.uint64), np.zeros(2, np.uint64), 1, 1,
                             object(), np.zeros(2, np.uint64),  # type: ignore[arg-type]
                             np.zeros(2, np.uint64))  # fmt: skip
    assert table.statistics().grants == 0


def test_renewals_move_the_permit_with_the_lease(sited: tuple[LeaseTable, SiteTable]) -> None:
    table, sites = sited
    sites.configure(SITE, 1, None)
    got = _lease(table.grant(K1, 1_000, 100, 10_000, SITE))
    assert table.renew(K1, got.token, 1_050, 500) == 1_550
    # The lease's first expiry has passed; its permit moved with it.
    assert table.grant(K2, 1_200, 100, 10_000, SITE) == Refusal("site_capped", 1_550)
    assert table.renew(K1, got.token, 1_300, 50) == 1_350  # shorter: the permit follows
    assert sites.info(SITE, 1_300).next_permit_free_at == 1_350
    assert table.complete(K1, got.token, 1_310)
    assert sites.info(SITE, 1_310).in_flight == 0


def test_a_renewal_whose_permit_is_gone_takes_one_or_goes_on_without(
    sited: tuple[LeaseTable, SiteTable],
) -> None:
    """A renewal killed between its two moves leaves the permit at a later word than its
    lease (it still covers the lease): the next renewal finds no permit at the lease's
    word and takes one under the cap, or, with the site full, renews without one and no
    longer frees one at its end."""
    table, sites = sited
    sites.configure(SITE, 2, None)
    got = _lease(table.grant(K1, 1_000, 100, 10_000, SITE))
    assert sites.extend(SITE, 1_100, 1_400)  # the killed renewal's first move
    assert table.renew(K1, got.token, 1_050, 100) == 1_150
    assert sites.info(SITE, 1_050).in_flight == 2  # the orphan and a fresh one
    assert table.complete(K1, got.token, 1_060)
    assert sites.info(SITE, 1_060).in_flight == 1  # the orphan, until 1_400
    sites.configure(SITE, 1, None)
    second = _lease(table.grant(K2, 1_500, 100, 10_000, SITE))
    assert sites.extend(SITE, 1_600, 1_900)
    assert table.renew(K2, second.token, 1_550, 50) == 1_600  # full: without a permit
    assert table.grant(K3, 1_560, 100, 10_000, SITE) == Refusal("site_capped", 1_900)
    assert table.complete(K2, second.token, 1_570)
    assert sites.info(SITE, 1_570).in_flight == 1  # the orphan is nobody's to free
    _lease(table.grant(K3, 1_900, 100, 10_000, SITE))


def test_imported_leases_hold_no_permit_of_the_new_site_table() -> None:
    source, target = LeaseTable.create(_name("export")), LeaseTable.create(_name("import"))
    sites = SiteTable.create(_name("sites"), capacity=64, permits=4)
    fresh = SiteTable.create(_name("sites2"), capacity=64, permits=4)
    try:
        from shm.segment import now_ms

        source.use_sites(sites)
        sites.configure(SITE, 2, None)
        fresh.configure(SITE, 2, None)
        now = now_ms()
        got = _lease(source.grant(K1, now, 60_000, 3_600_000, SITE))
        target.import_slots(source.export_slots())
        target.use_sites(fresh)
        mine = fresh.acquire(SITE, now, 60_000)  # a permit with the same word
        assert fresh.info(SITE, now).in_flight == 1
        assert target.complete(K1, got.token, now + 1)
        assert fresh.info(SITE, now + 1).in_flight == 1  # not freed by the imported lease
        assert mine is not None
    finally:
        for t in (source, target):
            t.close()
            t.unlink()
        for s in (sites, fresh):
            s.close()
            s.unlink()


# ----------------------------------------------------------------- the model


@dataclass
class ModelKey:
    phase: str = "free"  # free, leased, held
    token: int | None = None
    expires: int = 0
    held_until: int = 0
    misses: int = 0
    hold_if_missed: int = 0
    old_tokens: set[int] = field(default_factory=set)


class LeaseTableMachine(RuleBasedStateMachine):
    """LeaseTable against a dict of ModelKey. Five keys in 64 slots: never probe_full."""

    def __init__(self) -> None:
        super().__init__()
        self.name = _name("model")
        self.table = LeaseTable.create(self.name, capacity=64)
        self.keys = [key_hash(b"/k/%d" % i) for i in range(5)]
        self.model: dict[int, ModelKey] = {h: ModelKey() for h in self.keys}
        self.now = 1_000
        self.counts = {"grants": 0, "taken": 0, "held": 0, "expiries": 0, "completions": 0}
        self.swept_at = -1

    def teardown(self) -> None:
        self.table.close()
        remove(self.name)

    def settle(self, key: ModelKey) -> None:
        if key.phase == "leased" and key.expires <= self.now:
            key.phase = "held"
            key.misses = min(key.misses + 1, 15)
            key.held_until = key.expires + key.hold_if_missed
            self.counts["expiries"] += 1

    def expected_state(self, key: ModelKey) -> KeyLeaseState:
        phase, misses, held_until = key.phase, key.misses, key.held_until
        if phase == "leased" and key.expires <= self.now:
            phase, misses, held_until = (
                "held",
                min(misses + 1, 15),
                key.expires + key.hold_if_missed,
            )
        if phase == "leased":
            return KeyLeaseState(True, key.expires, False, 0, misses)
        if phase == "held":
            return KeyLeaseState(False, 0, held_until > self.now, held_until, misses)
        return KeyLeaseState(False, 0, False, 0, misses)

    @rule(dt=st.integers(0, 400))
    def advance(self, dt: int) -> None:
        self.now += dt

    @rule(
        i=st.integers(0, 4),
        lease=st.sampled_from([10, 50, 100]),
        cadence=st.sampled_from([30, 300, 1_000]),
    )
    def grant(self, i: int, lease: int, cadence: int) -> None:
        h = self.keys[i]
        key = self.model[h]
        got = self.table.grant(h, self.now, lease, cadence)
        self.settle(key)
        if key.phase == "leased":
            assert got == Refusal("taken", key.expires)
            self.counts["taken"] += 1
        elif key.phase == "held" and key.held_until > self.now:
            assert got == Refusal("held", key.held_until)
            self.counts["held"] += 1
        else:
            assert isinstance(got, Grant) and got.expires_at == self.now + lease
            assert got.token not in key.old_tokens and got.token != key.token
            if key.token is not None:
                key.old_tokens.add(key.token)
            key.phase, key.token, key.expires = "leased", got.token, self.now + lease
            key.hold_if_missed = min(lease << min(key.misses + 1, 15), cadence)
            self.counts["grants"] += 1

    def live(self, key: ModelKey, token: int | None) -> bool:
        return key.phase == "leased" and token == key.token and key.expires > self.now

    def token_for(self, key: ModelKey, stale: bool) -> int | None:
        if stale and key.old_tokens:
            return min(key.old_tokens)
        return key.token

    @rule(i=st.integers(0, 4), stale=st.booleans(), lease=st.sampled_from([10, 100]))
    def renew(self, i: int, stale: bool, lease: int) -> None:
        key = self.model[self.keys[i]]
        token = self.token_for(key, stale)
        if token is None:
            return
        got = self.table.renew(self.keys[i], token, self.now, lease)
        if self.live(key, token):
            assert got == self.now + lease
            key.expires = self.now + lease
        else:
            assert got is None

    @rule(i=st.integers(0, 4), stale=st.booleans())
    def complete(self, i: int, stale: bool) -> None:
        key = self.model[self.keys[i]]
        token = self.token_for(key, stale)
        if token is None:
            return
        done = self.table.complete(self.keys[i], token, self.now)
        assert done == self.live(key, token)
        if done:
            key.phase, key.misses, key.held_until = "free", 0, 0
            self.counts["completions"] += 1

    @rule(i=st.integers(0, 4), stale=st.booleans())
    def holds(self, i: int, stale: bool) -> None:
        key = self.model[self.keys[i]]
        token = self.token_for(key, stale)
        if token is not None:
            assert self.table.holds(self.keys[i], token, self.now) == self.live(key, token)

    @rule(keep=st.sampled_from([0, 100, 10_000]))
    def sweep(self, keep: int) -> None:
        self.table.sweep(self.now, keep)
        self.swept_at = self.now
        for key in self.model.values():
            self.settle(key)
            if key.phase == "held" and key.held_until + keep <= self.now:
                key.phase, key.misses, key.held_until = "free", 0, 0

    @invariant()
    def states_agree(self) -> None:
        expected = [self.expected_state(self.model[h]) for h in self.keys]
        assert [self.table.state(h, self.now) for h in self.keys] == expected
        mask = self.table.blocked_mask(np.array(self.keys, dtype=np.uint64), self.now)
        assert mask.tolist() == [s.leased or s.held for s in expected]

    @invariant()
    def live_counters_agree(self) -> None:
        stats, census = self.table.statistics(), self.table.census(self.now)
        assert stats.occupied == census.occupied
        # Expiry changes no counter: expired unanswered leases count as live until settled.
        assert stats.live_leases == census.live_leases + census.expired_unanswered
        if self.swept_at == self.now:  # nothing expired or ended since the sweep
            assert stats.held_keys == census.held_keys

    @invariant()
    def counters_agree(self) -> None:
        stats = self.table.statistics(self.now)
        assert stats.grants == self.counts["grants"]
        assert stats.refusals_taken == self.counts["taken"]
        assert stats.refusals_held == self.counts["held"]
        assert stats.expiries == self.counts["expiries"]
        assert stats.completions == self.counts["completions"]
        assert stats.refusals_probe_full == 0 and stats.conflicts == 0


TestLeaseTableModel = LeaseTableMachine.TestCase
TestLeaseTableModel.settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# ---------------------------------------------------------- process races


def _clock() -> int:
    """CLOCK_MONOTONIC is one clock for every process on the machine."""
    return time.monotonic_ns() // 1_000_000


# Leases each racing process sees change hands at least (the test asks four for 3,000),
# unless the race has run RACE_OVERTIME_S past its time.
RACE_MIN_INTERVALS = 1_000
RACE_OVERTIME_S = 90.0


def _race(
    name: str, keys: list[int], seconds: float, seed: int, sweeper: bool, sweep_every_ms: int = 20
) -> Any:
    """Grant, renew, complete and abandon leases at random; record each lease's interval.

    start is read after the grant returned and end before the complete was called (or
    the last expiry): an interval recorded this way lies inside the lease's real one,
    so two recorded intervals of one key overlap only if two live leases did.
    """
    table = LeaseTable.attach(name)
    rng = np.random.default_rng(seed)
    mine: dict[int, list[int]] = {}  # key -> [token, start, expires]
    intervals: list[tuple[int, int, int]] = []
    deadline = time.monotonic() + seconds
    # A loaded machine (sanitizers, stress-ng) gets through fewer steps a second: the race
    # runs on until enough leases changed hands, within the caller's wait for it.
    cap = deadline + RACE_OVERTIME_S
    last_sweep = 0
    while (now_s := time.monotonic()) < deadline or (
        len(intervals) < RACE_MIN_INTERVALS and now_s < cap
    ):
        h = keys[int(rng.integers(len(keys)))]
        now = _clock()
        held = mine.get(h)
        if held is not None and held[2] <= now:
            intervals.append((h, held[1], held[2]))  # abandoned: it ran to its expiry
            del mine[h]
            held = None
        if held is None:
            got = table.grant(h, now, int(rng.integers(2, 40)), 60)
            if isinstance(got, Grant):
                mine[h] = [got.token, _clock(), got.expires_at]
            continue
        action = rng.random()
        if action < 0.3:
            expires = table.renew(h, held[0], now, int(rng.integers(2, 40)))
            if expires is not None:
                held[2] = expires
        elif action < 0.7:
            end = _clock()
            if table.complete(h, held[0], end):
                intervals.append((h, held[1], end))
                del mine[h]
        if sweeper and now - last_sweep >= sweep_every_ms:
            table.sweep(now, 50)
            last_sweep = now
    for h, (_token, start, expires) in mine.items():
        intervals.append((h, start, expires))
    # Leases left behind, live for a minute, then held back: the live counters have
    # something to count once the race is over.
    # (A crowded table can refuse them probe_full.)
    left = 0
    for i in range(LEFT_PER_PROCESS):
        got = table.grant(key_hash(b"/left/%d/%d" % (seed, i)), _clock(), 60_000, 600_000)
        left += isinstance(got, Grant)
    stats = table.statistics()
    table.close()
    return intervals, stats, left


LEFT_PER_PROCESS = 20


def _overlaps(intervals: list[tuple[int, int, int]]) -> list[tuple[Any, ...]]:
    by_key: dict[int, list[tuple[int, int]]] = {}
    for h, start, end in intervals:
        if start < end:  # a lease that expired before its grant returned was never seen live
            by_key.setdefault(h, []).append((start, end))
    found = []
    for h, spans in by_key.items():
        spans.sort()
        for (s1, e1), (s2, e2) in itertools.pairwise(spans):
            if s2 < e1:
                found.append((h, s1, e1, s2, e2))
    return found


def test_the_overlap_check_catches_an_overlap() -> None:
    assert _overlaps([(1, 0, 10), (2, 5, 15), (1, 10, 20)]) == []
    assert _overlaps([(1, 0, 10), (1, 9, 20)]) == [(1, 0, 10, 9, 20)]
    assert _overlaps([(1, 0, 10), (1, 9, 5)]) == []  # empty: never live when recorded


@pytest.mark.parametrize(
    ("keys", "capacity", "sweep_every_ms", "seconds"),
    [
        # The brief's race: 1k keys, 10 s, a sweep every 20 ms reclaiming finished slots.
        (1_000, 2_048, 20, float(os.environ.get("RQ_LEASE_RACE_S", "10"))),
        # Churn: a few keys in a tiny table swept after every step, so slots are emptied
        # and keys re-inserted while other processes are mid-probe.
        (6, 16, 0, 3.0),
        # Crowded: 64 keys for 16 slots, so every window is full and grants empty other
        # keys' completed slots themselves, under each other's probes.
        (64, 16, 100, 3.0),
    ],
    ids=["spread", "churn", "crowded"],
)
def test_four_processes_never_hold_overlapping_leases_on_one_key(
    keys: int, capacity: int, sweep_every_ms: int, seconds: float
) -> None:
    name = _name("race")
    table = LeaseTable.create(name, capacity=capacity)
    try:
        hashes = [key_hash(b"/race/%d" % i) for i in range(keys)]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(4) as pool:
            runs = [
                pool.apply_async(_race, (name, hashes, seconds, seed, seed < 2, sweep_every_ms))
                for seed in range(4)
            ]
            results = [r.get(seconds + RACE_OVERTIME_S + 60) for r in runs]
        intervals = [span for spans, _, _ in results for span in spans]
        assert _overlaps(intervals) == []
        stats = table.statistics()
        assert len(intervals) > 3_000  # plenty of leases changed hands
        assert stats.grants >= len(intervals)
        assert stats.refusals_taken > 0 and stats.completions > 0 and stats.expiries > 0
        assert stats.reclaimed > 0  # the sweep ran under the race and reclaimed slots
        # The live counters, kept by every op of four processes, against a full scan:
        # once a sweep has settled what expired, they are the census exactly. Twice:
        # with the leases left behind live, then a minute on, with them held back.
        left = sum(n for _, _, n in results)
        assert left > 0 or keys > capacity  # a crowded table may refuse every one
        for now, later in ((_clock(), False), (_clock() + 60_000, True)):
            table.sweep(now, 50)
            census, after = table.census(now), table.statistics()
            assert census.removing == 0 and census.expired_unanswered == 0
            if later:  # the race's own leases and holds (cadence 60 ms) are over
                assert (census.live_leases, census.held_keys) == (0, left)
            else:
                assert census.live_leases >= left
            assert (after.occupied, after.live_leases, after.held_keys) == (
                census.occupied,
                census.live_leases,
                census.held_keys,
            )
        print(f"intervals={len(intervals)} {stats} {census}")
    finally:
        table.close()
        remove(name)


def _claim_forever(name: str, keys: list[int], progress: Any) -> None:
    table = LeaseTable.attach(name)
    i = 0
    while True:
        h = keys[i % len(keys)]
        table.grant(h, _clock(), 300, 1_000)
        i += 1
        if i % 97 == 0:
            progress.value = i


def test_a_claimant_killed_mid_claim_leaves_no_key_stuck_beyond_its_lease() -> None:
    name = _name("kill")
    table = LeaseTable.create(name, capacity=4_096)  # sparse: no probe window fills
    try:
        ctx = multiprocessing.get_context("spawn")
        keys = [key_hash(b"/kill/%d" % i) for i in range(300)]
        rng = np.random.default_rng(1)
        for round_ in range(3):
            progress = ctx.RawValue("q", 0)  # no lock for the victim to die holding
            victim = ctx.Process(target=_claim_forever, args=(name, keys, progress))
            victim.start()
            deadline = time.monotonic() + 60
            while progress.value < 300 * (round_ + 1) and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(float(rng.uniform(0, 0.05)))
            assert victim.pid is not None
            os.kill(victim.pid, signal.SIGKILL)  # wherever it is: mid-insert, mid-CAS, ...
            victim.join(10)
            assert victim.exitcode == -signal.SIGKILL
            killed_at = _clock()
            # The victim's leases last 300 ms and their hold at most the 1 s cadence:
            # past that, every key is grantable again.
            later = killed_at + 300 + 1_000 + 1
            for h in keys:
                got = table.grant(h, later, 50, 1_000)
                assert isinstance(got, Grant), (h, got, table.state(h, later))
                assert table.complete(h, got.token, later)
            assert table.sweep(later + 1) > 0
            assert table.census(later + 1).live_leases == 0
            assert table.statistics().conflicts == 0
        assert table.census().occupied == 0  # every slot reclaimed: nothing leaked
        # A kill between a CAS and its count leaves a live counter off by one at most.
        stats = table.statistics()
        assert stats.occupied <= 3 and stats.live_leases <= 3 and stats.held_keys <= 3
    finally:
        table.close()
        remove(name)


def test_imported_slots_come_with_their_counters_and_tag_lanes() -> None:
    """import_slots writes slots whole: the live counters and the tag lanes blocked_mask
    reads first must be rebuilt from them, or a restarted node would publish a key whose
    lease outlived the restart. (An import recounts at the wall clock, so real times.)"""
    from shm.segment import now_ms

    source, target = LeaseTable.create(_name("export")), LeaseTable.create(_name("import"))
    try:
        keys = [key_hash(b"/imp/%d" % i) for i in range(40)]
        start = now_ms() - 20_000
        for i, h in enumerate(keys[:30]):
            got = source.grant(h, start, 30_000 if i % 3 == 0 else 3_600_000, 3_600_000)
            assert isinstance(got, Grant)
            if i % 3 == 1:
                assert source.complete(h, got.token, start + 10)
        # Settle the short leases: held back until start + 90 s, a minute from now.
        source.sweep(start + 30_001, keep_misses_ms=3_600_000)
        target.import_slots(source.export_slots())
        now = now_ms()
        hashes = np.array(keys, dtype=np.uint64)
        blocked = target.blocked_mask(hashes, now).tolist()
        assert blocked == source.blocked_mask(hashes, now).tolist()
        assert sum(blocked) == 20  # 10 leased, 10 held
        census, stats = target.census(now), target.statistics()
        assert (stats.occupied, stats.live_leases, stats.held_keys) == (
            census.occupied,
            census.live_leases,
            census.held_keys,
        )
        assert (census.occupied, census.live_leases, census.held_keys) == (20, 10, 10)
    finally:
        for table in (source, target):
            table.close()
            table.unlink()
