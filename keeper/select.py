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

Under a claiming fleet the leased keys are the fleet's working set, which is the
top of the last few publishes: with a quarter of the top leased, a fixed small
margin would mean a second, larger read every publish. So the caller may say how
many blocked rows to expect
(`expect_blocked`: a publisher passes the `blocked_ahead` of its last selection,
which moves little from one publish to the next), and a re-read is sized by the
share of rows the first read found blocked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from keeper._native import Picked

if TYPE_CHECKING:
    from keeper.queue import HeldQueue

BlockedMask = Callable[[npt.NDArray[np.uint64]], npt.NDArray[np.bool_]]


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """The best claimable rows, best first."""

    slots: npt.NDArray[np.int32]
    due_at: npt.NDArray[np.int64]
    class_id: npt.NDArray[np.int32]
    key_hash: npt.NDArray[np.uint64]
    rank: npt.NDArray[np.float64]
    considered: int  # entries read from buckets
    blocked: int  # due rows left out as leased or held
    # Of them, those ranked above the last row kept: what the next read's margin needs.
    blocked_ahead: int = 0
    reads: int = 0  # passes over the buckets: 1 unless the margin was too small


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


def select_best(
    queue: HeldQueue,
    k: int,
    now_ms: int,
    blocked: BlockedMask | None = None,
    expect_blocked: int = 0,
) -> Selection:
    """The best k claimable rows (due, route not paused, not blocked), best first.

    `expect_blocked`: how many blocked rows the caller expects ahead of the k-th
    claimable one; only the read's margin depends on it, never the result."""
    if k <= 0:
        return _empty(0, 0)
    table = queue.classes
    cadence = table.cadence_ms().tolist()
    boost = table.boost().tolist()
    paused = table.paused_mask().tolist()
    view = queue.view
    expect = max(0, expect_blocked)
    need = k if blocked is None else k + max((k >> 4), expect + (expect >> 2)) + 16
    reads = 0
    while True:
        reads += 1
        slots = np.empty(need, dtype=np.int32)
        rank = np.empty(need, dtype=np.float64)
        due = np.empty(need, dtype=np.int64)
        hashes = np.empty(need, dtype=np.uint64)
        classes = np.empty(need, dtype=np.int32)
        picked = Picked(slots, rank, due, hashes, classes)
        count, considered, _ = view.best_read(cadence, boost, paused, now_ms, picked)
        if blocked is None:
            kept = count
            n_blocked = ahead = 0
            break
        stopped = blocked(hashes[:count])
        kept, scanned = picked.keep_unblocked(stopped, k)
        if kept == k or count < need:  # enough, or every due row was read
            n_blocked = int(np.count_nonzero(stopped))
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
    )
