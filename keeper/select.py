"""The best K claimable rows: a merge over class heads, ranked once, never rescored.

Each class's buckets are in due order, so within a class they come in rank
order too, and no row of a bucket ranks above the rank at its start (its upper
bound). Buckets are taken in order of their upper bound from a heap of class
heads; each one's live, due entries are ranked, and the reading stops once N
rows are in hand and no untaken bucket's upper bound beats the N-th best. That
read is C (`QueueView.best_read` in keeper/csrc): in numpy it would be some fifteen calls per
batch of buckets, each paying numpy's per-call overhead on a few hundred rows.

Leased or held keys are found after the read, on the N best only (one lease
table probe per row): N is K plus a margin for them, and if they take more than
the margin the read runs again with a larger N. Every row outside the N read
ranks at or below the N-th, so the K best left are exactly those of a full sort
of every claimable row by rank.

Rows found leased or held are marked with their block's end (`block_ends`, the lease
table's), and later reads pass over them in C (keeper/skips.py): the fleet's work in
flight is probed about once a second, not at every publish.

Under a claiming fleet the leased keys are the fleet's working set, which is the
top of the last few publishes: with a quarter of the top leased, a fixed small
margin would mean a second, larger read every publish. So the caller may say how
many blocked rows to expect
(`expect_blocked`: a publisher passes the `blocked_ahead` of its last selection,
which moves little from one publish to the next), and a re-read is sized by the
share of rows the first read found blocked.

Sites with a cap (or a spacing, or a block) are the shm SiteTable's: a claimant skips a
key whose site cannot take another grant. So that claims do not scan past thousands of
such entries, the selection asks `allowances` how many more grants each candidate's site
can take now (-1: no limit) and keeps, in rank order, at most the allowance plus
`slack` keys of each limited site; the rest are left out of this publish as a blocked
row is, and keep their place in the queue. The slack is for a render that ends between
two publishes: without it a site at its cap (allowance 0) would have no key in the ring
and stay idle until the next publish; with one key it is granted at once. A key of a
site still full is refused at grant time, one SiteTable probe, so the slack's cost is
one refused entry per limited site per publish, never a scan. One is enough at the
node's publish period (a quarter of a second, and sooner when claims drain the ring):
more would only matter for a site finishing several renders a period. Keys with no site
are never limited.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from keeper._native import Picked, QueueView
from keeper.classes import ClassTable
from keeper.sites import NO_SITE_ID, HeldSites
from keeper.skips import RowSkips

BlockedMask = Callable[[npt.NDArray[np.uint64]], npt.NDArray[np.bool_]]
# For each hash, until when (epoch ms) the lease table blocks its key; 0: it does not.
BlockEnds = Callable[[npt.NDArray[np.uint64]], npt.NDArray[np.int64]]
# For each site hash (distinct, never NO_SITE), how many more grants its site can take
# now: -1 no limit, 0 none (full, blocked, or inside its spacing).
Allowances = Callable[[npt.NDArray[np.uint64]], npt.NDArray[np.int64]]


class HeldRows(Protocol):
    """What a selection reads of the rows held (keeper.queue.HeldQueue)."""

    @property
    def classes(self) -> ClassTable: ...
    @property
    def view(self) -> QueueView: ...
    @property
    def sites(self) -> HeldSites: ...
    @property
    def site_ids(self) -> array[int]: ...
    @property
    def skips(self) -> RowSkips: ...


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """The best claimable rows, best first."""

    slots: npt.NDArray[np.int32]
    due_at: npt.NDArray[np.int64]
    class_id: npt.NDArray[np.int32]
    key_hash: npt.NDArray[np.uint64]
    rank: npt.NDArray[np.float64]
    considered: int  # entries read from buckets
    blocked: int  # due rows left out as leased or held, or over their site's allowance
    # Of them, those ranked above the last row kept: what the next read's margin needs.
    blocked_ahead: int = 0
    reads: int = 0  # passes over the buckets: 1 unless the margin was too small
    site_skipped: int = 0  # of `blocked`, the rows left out over their site's allowance
    passed: int = 0  # of `blocked`, rows passed over unprobed on an earlier mark (skips)
    sites_limited: int = 0  # sites among the candidates whose allowance limited them


def _empty(considered: int, blocked: int) -> Selection:
    return Selection(
        slots=np.empty(0, dtype=np.int32),
        due_at=np.empty(0, dtype=np.int64),
        class_id=np.empty(0, dtype=np.int32),
        key_hash=np.empty(0, dtype=np.uint64),
        rank=np.empty(0, dtype=np.float64),
        considered=considered,
        blocked=blocked,
    )


def site_budgets(
    queue: HeldRows,
    slots: npt.NDArray[np.int32],
    stopped: npt.NDArray[np.bool_],
    allowances: Allowances,
    slack: int,
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """Each candidate row's site id, and each site id's budget for this selection: the
    allowance plus `slack` for a limited site among the rows not `stopped`, -1 (none)
    for every other site and for "no site". The allowances are asked once, for the
    distinct sites of those rows."""
    ids = np.frombuffer(queue.site_ids, dtype=np.int32).take(slots)
    n_ids = queue.sites.table.slots
    budget = np.full(n_ids, -1, dtype=np.int64)
    present = np.bincount(ids[~stopped], minlength=n_ids).astype(np.bool_)
    present[NO_SITE_ID] = False
    distinct = np.flatnonzero(present)
    if len(distinct):
        allowed = np.asarray(allowances(queue.sites.hashes().take(distinct)), dtype=np.int64)
        budget[distinct] = np.where(allowed >= 0, allowed + slack, -1)
    return ids, budget


def select_best(
    queue: HeldRows,
    k: int,
    now_ms: int,
    blocked: BlockedMask | None = None,
    expect_blocked: int = 0,
    allowances: Allowances | None = None,
    slack: int = 1,
    block_ends: BlockEnds | None = None,
) -> Selection:
    """The best k claimable rows (due, route not paused, not blocked, within their sites'
    allowances plus `slack`), best first.

    `expect_blocked`: how many blocked rows the caller expects ahead of the k-th
    claimable one; only the read's margin depends on it, never the result.
    `block_ends`: the lease table's answer, where given: a row it blocks is left out as
    one `blocked` stops (which then says what else stops a row), and is marked to be
    passed over until its block ends (keeper/skips.py)."""
    if k <= 0:
        return _empty(0, 0)
    table = queue.classes
    cadence = table.cadence_ms().tolist()
    boost = table.boost().tolist()
    paused = table.paused_mask().tolist()
    view = queue.view
    expect = max(0, expect_blocked)
    limits = blocked is not None or allowances is not None or block_ends is not None
    # The marks stand for the lease table's answer: a selection without one reads all.
    leases_asked = blocked is not None or block_ends is not None
    need = k if not limits else k + max((k >> 4), expect + (expect >> 2)) + 16
    reads = 0
    skipped = limited = 0
    skips = queue.skips
    while True:
        reads += 1
        slots = np.empty(need, dtype=np.int32)
        rank = np.empty(need, dtype=np.float64)
        due = np.empty(need, dtype=np.int64)
        hashes = np.empty(need, dtype=np.uint64)
        classes = np.empty(need, dtype=np.int32)
        picked = Picked(slots, rank, due, hashes, classes)
        skip_table = skips.columns() if leases_asked else None
        count, considered, _, passed = view.best_read(
            cadence, boost, paused, now_ms, picked, skip_table
        )
        if not limits:
            kept = count
            n_blocked, ahead = passed, 0
            break
        if block_ends is not None:
            ends = block_ends(hashes[:count])
            stopped = ends > 0
            if stopped.any():
                skips.mark(view, slots[:count][stopped], ends[stopped], now_ms)
            if blocked is not None:
                stopped |= blocked(hashes[:count])
        elif blocked is not None:
            stopped = blocked(hashes[:count])
        else:
            stopped = np.zeros(count, dtype=np.bool_)
        if allowances is not None:
            site_ids, budget = site_budgets(queue, slots[:count], stopped, allowances, slack)
            kept, scanned, skipped, limited = picked.keep_within(stopped, k, site_ids, budget)
        else:
            kept, scanned = picked.keep_unblocked(stopped, k)
        if kept == k or count < need:  # enough, or every due row was read
            n_blocked = int(np.count_nonzero(stopped)) + skipped + passed
            ahead = scanned - kept
            break
        # The rows still wanted, at the share of rows this read found free, and an
        # eighth more; at most doubling, so a read that found nearly all blocked does
        # not ask for millions of rows at once.
        wanted = (k - kept) * count // max(kept, 1)
        need += min(wanted + (wanted >> 3), need) + 64
    return Selection(
        slots=slots[:kept],
        due_at=due[:kept],
        class_id=classes[:kept],
        key_hash=hashes[:kept],
        rank=rank[:kept],
        considered=considered,
        blocked=n_blocked,
        blocked_ahead=ahead,
        reads=reads,
        site_skipped=skipped,
        sites_limited=limited,
        passed=passed,
    )
