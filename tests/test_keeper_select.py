"""keeper/select.py: the best k claimable rows with blocked rows left out, whatever margin
the caller's expectation of blocked rows gives the read; and that the expectation a
selection reports (blocked_ahead) spares the next one its second read."""

from __future__ import annotations

from collections import Counter

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st
from keeper_helpers import NOW, core_with_dues

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.select import Allowances, BlockedMask, select_best
from shm import key_hash
from shm.keys import NO_SITE, site_hash, site_of
from store.rows import Row, RowEvent


def _mask(blocked: set[int]) -> BlockedMask:
    hashes = np.array([key_hash(b"/p/%d" % i) for i in sorted(blocked)], dtype=np.uint64)

    def mask(h: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        return np.isin(h, hashes)

    return mask


@given(
    dues=st.lists(st.integers(-7_200_000, 600_000), min_size=1, max_size=400),
    blocked=st.sets(st.integers(0, 399), max_size=400),
    k=st.integers(1, 300),
    expect=st.integers(-5, 3_000),
)
@settings(max_examples=80, deadline=None)
def test_the_selection_is_the_best_claimable_rows_whatever_the_expected_blocked(
    dues: list[int], blocked: set[int], k: int, expect: int
) -> None:
    """Against brute force: every due row best first (no mask), less the blocked keys."""
    core = core_with_dues(dues)
    everything = core.select(len(dues), NOW, None)
    keep = ~_mask(blocked)(everything.key_hash)
    chosen = select_best(core.queue, k, NOW, _mask(blocked), expect_blocked=expect)
    assert np.array_equal(chosen.slots, everything.slots[keep][:k])
    assert np.array_equal(chosen.rank, everything.rank[keep][:k])
    assert np.array_equal(chosen.due_at, everything.due_at[keep][:k])
    # Blocked rows ranked above the last one kept: exactly what a full sort says.
    if len(chosen.slots) == k:
        last = int(np.flatnonzero(keep)[k - 1])
        assert chosen.blocked_ahead == int(np.count_nonzero(~keep[:last]))
    assert chosen.reads >= 1


def test_the_blocked_count_a_selection_reports_spares_the_next_its_second_read() -> None:
    """A quarter of the top 1,000 blocked (the fleet's working set): the default margin
    (a sixteenth) reads twice; told the last selection's blocked_ahead, once."""
    rng = np.random.default_rng(5)
    core = core_with_dues(rng.integers(-7_200_000, 0, 4_000).tolist())
    top = core.select(1_000, NOW, None)
    index = {key_hash(b"/p/%d" % i): i for i in range(4_000)}
    picked = rng.choice(1_000, 250, replace=False)
    mask = _mask({index[int(h)] for h in top.key_hash[picked]})
    first = select_best(core.queue, 1_000, NOW, mask)
    assert first.reads == 2 and first.blocked_ahead == 250
    second = select_best(core.queue, 1_000, NOW, mask, expect_blocked=first.blocked_ahead)
    assert second.reads == 1
    assert np.array_equal(first.slots, second.slots)


def _core_with_sites(dues: list[int], sites: list[int]) -> KeeperCore:
    """Rows due at NOW + each due, row i of site sites[i] (-1: a key with no host)."""
    core = KeeperCore(KeeperConfig())
    events = []
    for i, (due, site) in enumerate(zip(dues, sites, strict=True)):
        key = f"/p/{i}" if site < 0 else f"https://s{site}.example/p/{i}"
        row = Row(
            key=key,
            route="product",
            cadence_s=None,
            sitemap=i % 4 == 0,
            next_render_at=NOW + due,
            version=1,
        )
        events.append(RowEvent(key=key, row=row))
    core.apply_events(events, NOW)
    return core


def _allowances(by_site: dict[int, int]) -> tuple[Allowances, list[npt.NDArray[np.uint64]]]:
    """A stand-in for the SiteTable's allowances: site n may take by_site[n] more grants
    (-1 or absent: no limit). It keeps what it was asked."""
    table = {site_hash(b"s%d.example" % n): allowed for n, allowed in by_site.items()}
    asked: list[npt.NDArray[np.uint64]] = []

    def allowances(hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        asked.append(hashes.copy())
        return np.array([table.get(int(h), -1) for h in hashes.tolist()], dtype=np.int64)

    return allowances, asked


def _brute_force(
    core: KeeperCore, k: int, blocked: set[int], by_site: dict[int, int], slack: int
) -> list[int]:
    """Every due row best first, less the blocked ones, keeping at most allowance + slack
    rows of each limited site."""
    everything = core.select(1 << 20, NOW, None)
    taken: Counter[bytes] = Counter()
    kept: list[int] = []
    limits = {b"s%d.example" % n: a + slack for n, a in by_site.items() if a >= 0}
    for slot in everything.slots.tolist():
        key = core.queue.slots.key(slot)
        if int(key.rsplit(b"/", 1)[1]) in blocked:
            continue
        site = site_of(key)
        if site in limits and taken[site] >= limits[site]:
            continue
        taken[site] += 1
        kept.append(slot)
        if len(kept) == k:
            break
    return kept


def _blocked_mask(core: KeeperCore, blocked: set[int]) -> BlockedMask:
    hashes = [
        core.queue.hash_of(s)
        for s in core.queue.slots.live_slots().tolist()
        if int(core.queue.slots.key(s).rsplit(b"/", 1)[1]) in blocked
    ]
    stopped = np.array(hashes, dtype=np.uint64)
    return lambda h: np.isin(h, stopped)


@given(
    rows=st.lists(
        st.tuples(st.integers(-7_200_000, 600_000), st.integers(-1, 5)), min_size=1, max_size=300
    ),
    by_site=st.dictionaries(st.integers(0, 5), st.integers(-1, 4), max_size=6),
    blocked=st.sets(st.integers(0, 299), max_size=60),
    k=st.integers(1, 200),
    slack=st.integers(0, 2),
    expect=st.integers(0, 500),
)
@settings(max_examples=120, deadline=None)
def test_the_selection_keeps_each_limited_site_within_its_allowance_in_rank_order(
    rows: list[tuple[int, int]],
    by_site: dict[int, int],
    blocked: set[int],
    k: int,
    slack: int,
    expect: int,
) -> None:
    core = _core_with_sites([d for d, _ in rows], [s for _, s in rows])
    allowances, asked = _allowances(by_site)
    chosen = select_best(
        core.queue, k, NOW, _blocked_mask(core, blocked), expect, allowances, slack
    )
    assert chosen.slots.tolist() == _brute_force(core, k, blocked, by_site, slack)
    for hashes in asked:  # distinct sites, never "no site"
        assert len(set(hashes.tolist())) == len(hashes) and NO_SITE not in hashes.tolist()
    assert chosen.site_skipped <= chosen.blocked


def test_a_capped_site_with_most_due_keys_does_not_fill_the_publish() -> None:
    """Site 0 holds 60% of 20,000 due keys, at its cap (allowance 0): the best 1,000 hold
    one of its keys (the slack) and 999 of the other sites', in rank order; the first
    selection reads again, the next, told how many it found blocked ahead, reads once."""
    rng = np.random.default_rng(7)
    n = 20_000
    sites = np.where(rng.random(n) < 0.6, 0, rng.integers(1, 50, n)).tolist()
    core = _core_with_sites(rng.integers(-7_200_000, 0, n).tolist(), sites)
    allowances, _ = _allowances({0: 0})
    first = core.select(1_000, NOW, None, 0, allowances)
    site_zero = site_hash(b"s0.example")
    picked = core.queue.site_hashes_of(first.slots)
    assert len(first.slots) == 1_000 and int(np.count_nonzero(picked == site_zero)) == 1
    assert first.reads > 1 and first.sites_limited == 1
    assert first.slots.tolist() == _brute_force(core, 1_000, set(), {0: 0}, 1)
    second = core.select(1_000, NOW, None, first.blocked_ahead, allowances)
    assert second.reads == 1 and np.array_equal(second.slots, first.slots)
    # Uncapped, the same site takes its share of the top.
    free = core.select(1_000, NOW, None)
    assert int(np.count_nonzero(core.queue.site_hashes_of(free.slots) == site_zero)) > 500
