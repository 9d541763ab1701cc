"""keeper/select.py: the best k claimable rows with blocked rows left out, whatever margin
the caller's expectation of blocked rows gives the read; and that the expectation a
selection reports (blocked_ahead) spares the next one its second read."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st
from keeper_helpers import NOW, core_with_dues

from keeper.select import BlockedMask, select_best
from shm import key_hash


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
