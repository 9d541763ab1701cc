"""keeper/publish.py: what a publish puts into the ring, with a real shared-memory lease
table deciding which keys are leased or held; the keys copied from the slot arena leave a
real ring byte for byte as the list of keys did; and a failing ring."""

from __future__ import annotations

import os
import uuid

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st
from keeper_helpers import NOW, MemoryRing, core_with_dues

from bench.sections.keeper import old_publish
from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.publish import Publisher, PublishFailed
from shm import Grant, LeaseTable, ReadyRing, key_hash, segment_name
from shm.keys import NO_SITE, key_site_hash, site_hash
from shm.segment import HEADER_BYTES
from store.rows import Row, RowEvent


def _core(dues: list[int], best_k: int, top_check: int = 64) -> KeeperCore:
    return core_with_dues(dues, KeeperConfig(best_k=best_k, top_check=top_check))


def _table() -> LeaseTable:
    return LeaseTable.create(
        segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "publish"), capacity=1 << 12
    )


@given(
    dues=st.lists(st.integers(-7_200_000, 600_000), min_size=1, max_size=300),
    leased=st.sets(st.integers(0, 299), max_size=200),
    expired=st.sets(st.integers(0, 299), max_size=50),
    best_k=st.integers(1, 120),
    top_check=st.integers(1, 80),
)
@settings(max_examples=40, deadline=None)
def test_a_publish_is_the_best_rows_whose_keys_the_lease_table_neither_leases_nor_holds(
    dues: list[int], leased: set[int], expired: set[int], best_k: int, top_check: int
) -> None:
    """Against brute force: every claimable row best first (a selection with no lease
    table), less each key the table's own per-key probe (state) says is leased or held.
    The publish returns the first `top_check` of them as bytes, for the top check."""
    core = _core(dues, best_k, top_check)
    table = _table()
    try:
        for i in leased | expired:
            if i < len(dues):
                lease_ms = 1_000 if i in expired else 600_000  # expired: held back now
                got = table.grant(key_hash(b"/p/%d" % i), NOW - 1_500, lease_ms, 3_600_000)
                assert isinstance(got, Grant)
        ring = MemoryRing()
        publisher = Publisher(core, ring, table, core.config)
        keys = publisher.publish(NOW)
        assert not isinstance(keys, PublishFailed)
        everything = core.select(len(dues), NOW, None)
        claimable = core.queue.slots.keys(everything.slots)
        free = [k for k in claimable if not _blocked(table, k)]
        assert ring.keys == free[:best_k]
        assert keys == free[: min(best_k, top_check)]
        stats = publisher.stats
        assert stats.publishes == 1 and stats.last_count == len(ring.keys)
        assert stats.last_blocked <= len(claimable) - len(free)
    finally:
        table.close()
        table.unlink()


def _blocked(table: LeaseTable, key: bytes) -> bool:
    state = table.state(key_hash(key), NOW)
    return state.leased or state.held


def test_a_ring_that_fails_is_counted_and_reported_and_the_next_publish_goes_on() -> None:
    core = _core([-1_000, -2_000, 5_000], best_k=10)
    ring = MemoryRing()
    table = _table()
    try:
        publisher = Publisher(core, ring, table, core.config)
        ring.fail = True
        failed = publisher.publish(NOW)
        assert failed == PublishFailed("publish failed: OSError: ring unavailable (test)")
        assert publisher.stats.failures == 1 and publisher.stats.publishes == 0
        ring.fail = False
        # /p/0 is less late but from a sitemap (boosted); /p/2 is not due yet.
        assert publisher.publish(NOW) == [b"/p/0", b"/p/1"]
        assert publisher.stats.publishes == 1 and publisher.stats.generation == 1
    finally:
        table.close()
        table.unlink()


def test_each_entry_carries_its_rows_effective_cadence() -> None:
    """The row's own cadence, else its route's default, else the global default: the
    hold cap a claimant grants with before it reads the row."""
    from store.rows import Route

    core = KeeperCore(KeeperConfig(best_k=10))
    core.load_settings([Route(route="category", default_cadence_s=7_200, paused=False)], 86_400)
    own = {"/p/0": 60, "/p/1": None, "/p/2": None}
    routes = {"/p/0": "product", "/p/1": "category", "/p/2": "product"}
    core.apply_events(
        [
            RowEvent(
                key=key,
                row=Row(
                    key=key,
                    route=routes[key],
                    cadence_s=cadence_s,
                    sitemap=False,
                    next_render_at=NOW - 1_000 * (i + 1),
                    version=i + 1,
                ),
            )
            for i, (key, cadence_s) in enumerate(own.items())
        ],
        NOW,
    )
    ring = MemoryRing()
    table = _table()
    try:
        keys = Publisher(core, ring, table, core.config).publish(NOW)
        assert not isinstance(keys, PublishFailed)
        expected = {b"/p/0": 60, b"/p/1": 7_200, b"/p/2": 86_400}
        assert dict(zip(ring.keys, ring.cadence_s.tolist(), strict=True)) == expected
    finally:
        table.close()
        table.unlink()


@given(
    dues=st.lists(st.integers(-7_200_000, 600_000), min_size=1, max_size=300),
    rounds=st.lists(st.sets(st.integers(0, 299), max_size=150), min_size=1, max_size=4),
    best_k=st.integers(1, 200),
    capacity=st.integers(1, 220),
    arena_bytes=st.integers(1, 2_000),
)
@settings(max_examples=40, deadline=None)
def test_a_publish_leaves_the_ring_byte_for_byte_as_the_list_of_keys_did(
    dues: list[int], rounds: list[set[int]], best_k: int, capacity: int, arena_bytes: int
) -> None:
    """Rounds of publishes, more keys leased before each (so the selection's margin
    follows the blocked rows it found last time): each round's segment equals the one
    the old path wrote, cut-offs and truncation counts included."""
    core = _core(dues, best_k)
    table = _table()
    tag = f"t{os.getpid()}x{uuid.uuid4().hex[:8]}"
    old = ReadyRing.create(segment_name(tag, "ringold"), capacity, arena_bytes)
    new = ReadyRing.create(segment_name(tag, "ringnew"), capacity, arena_bytes)
    try:
        publisher = Publisher(core, new, table, core.config)
        for i, leased in enumerate(rounds):
            now = NOW + i
            for j in leased:
                if j < len(dues):
                    table.grant(key_hash(b"/p/%d" % j), now, 600_000, 3_600_000)
            keys = old_publish(core, old, table, now, core.config.best_k)
            top = publisher.publish(now)
            assert top == keys[: core.config.top_check]
            assert old._segment.generation == new._segment.generation == i + 1
            assert bytes(old._segment.mmap[HEADER_BYTES:]) == bytes(
                new._segment.mmap[HEADER_BYTES:]
            )
            assert old.statistics() == new.statistics()
            # What the keeper compares claims against is what the ring holds, after cuts.
            assert publisher.stats.last_count == new.published_count() <= best_k
    finally:
        for ring in (old, new):
            ring.close()
            ring.unlink()
        table.close()
        table.unlink()


def test_each_entry_carries_its_keys_site_and_a_capped_site_gets_its_allowance() -> None:
    """Entries name their key's site hash (0 for a key with no host); with the SiteTable's
    allowances, a site that can take one more grant gets that one and the slack, in rank
    order, and the rest of the ring goes to the others."""
    core = KeeperCore(KeeperConfig(best_k=8, site_slack=1))
    keys = [f"https://{'capped' if i < 10 else 'free'}.example/p/{i}" for i in range(14)]
    keys.append("/no/site")
    core.apply_events(
        [
            RowEvent(
                key=key,
                row=Row(
                    key=key,
                    route="product",
                    cadence_s=None,
                    sitemap=False,
                    next_render_at=NOW - 1_000 * (100 - i),  # the capped site's are latest
                    version=1,
                ),
            )
            for i, key in enumerate(keys)
        ],
        NOW,
    )
    ring = MemoryRing()
    table = _table()
    asked: list[tuple[list[int], int]] = []
    capped = site_hash(b"capped.example")

    def allowances(hashes: npt.NDArray[np.uint64], now: int) -> npt.NDArray[np.int64]:
        asked.append((hashes.tolist(), now))
        return np.where(hashes == capped, 1, -1).astype(np.int64)

    try:
        publisher = Publisher(core, ring, table, core.config)
        assert not isinstance(publisher.publish(NOW), PublishFailed)
        assert ring.keys[:8] == [k.encode() for k in keys[:8]]  # no caps: rank order
        assert ring.site_hash.tolist() == [key_site_hash(k) for k in ring.keys]
        publisher.site_allowances = allowances
        assert not isinstance(publisher.publish(NOW + 1), PublishFailed)
        assert ring.keys == [k.encode() for k in keys[:2] + keys[10:]]
        assert ring.site_hash.tolist()[-1] == NO_SITE
        assert all(now == NOW + 1 for _, now in asked)
        assert sorted(asked[0][0]) == sorted([capped, site_hash(b"free.example")])
        stats = publisher.stats
        assert stats.last_site_skipped >= 8 and stats.last_sites_limited == 1
    finally:
        table.close()
        table.unlink()
