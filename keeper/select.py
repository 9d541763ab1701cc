"""The best K claimable rows: a merge over class heads, ranked once, never rescored.

Each class's buckets are in due order, so within a class they come in rank
order too. A bucket's rows rank between two bounds known without reading it:
the rank at its start (upper) and at the next bucket's start (lower). Buckets
are taken in order of their upper bound from a heap of class heads; the lower
bounds of the buckets taken say when K rows at or above some rank τ are
certainly in hand, and once no untaken bucket's upper bound beats τ the
reading stops. The rows read are checked (the entry is live, the row due, the
key neither leased nor held) and ranked in one numpy pass, and only the K best
are sorted. If leased keys leave fewer than K, or the K-th best ranks below a
bucket not read yet, reading resumes from the heap: the result always equals
a full sort of every claimable row by rank.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

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


class _Reader:
    """Buckets taken so far, and the rows they turned out to hold."""

    def __init__(self, queue: HeldQueue, now_ms: int, blocked: BlockedMask | None) -> None:
        self.queue = queue
        self.now_ms = now_ms
        self.blocked = blocked
        self.buckets: list[int] = []
        self.cadence: list[float] = []
        self.boost: list[float] = []
        self.class_ids: list[int] = []
        self.slots: list[npt.NDArray[np.int32]] = []
        self.dues: list[npt.NDArray[np.int64]] = []
        self.hashes: list[npt.NDArray[np.uint64]] = []
        self.ranks: list[npt.NDArray[np.float64]] = []
        self.classes: list[npt.NDArray[np.int32]] = []
        self.eligible = 0
        self._top: npt.NDArray[np.intp] | None = None  # the k best by kth_rank, if still current
        self.considered = 0
        self.blocked_count = 0

    def take(self, bucket: int, class_id: int, cadence: float, boost: float) -> None:
        self.buckets.append(bucket)
        self.class_ids.append(class_id)
        self.cadence.append(cadence)
        self.boost.append(boost)

    def screen(self) -> None:
        """Read the buckets taken since the last screen: one numpy pass over their entries."""
        if not self.buckets:
            return
        members = self.queue.buckets.members
        parts = [members[b] for b in self.buckets]
        sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        slots = np.frombuffer(b"".join(parts), dtype=np.int32)
        records = np.take(self.queue.slots.items(), slots)
        # An entry is live while its slot's place (bucket << 32 | index) points back at it.
        first = (np.array(self.buckets, dtype=np.int64) << 32) - (np.cumsum(sizes) - sizes)
        expected = np.repeat(first, sizes) + np.arange(len(slots))
        keep = (records["place"] == expected) & (records["due"] <= self.now_ms)
        if self.blocked is not None and keep.any():
            stopped = np.zeros(len(slots), dtype=np.bool_)
            stopped[keep] = self.blocked(records["hash"][keep])
            self.blocked_count += int(np.count_nonzero(stopped))
            keep &= ~stopped
        rows = np.flatnonzero(keep)
        kept = np.take(records, rows)
        part = np.take(np.repeat(np.arange(len(sizes)), sizes), rows)
        kept_dues = kept["due"]
        cadence = np.take(np.array(self.cadence), part)
        boost = np.take(np.array(self.boost), part)
        self.slots.append(np.take(slots, rows))
        self.dues.append(kept_dues)
        self.hashes.append(kept["hash"].view(np.uint64))
        self.classes.append(np.take(np.array(self.class_ids, dtype=np.int32), part))
        self.ranks.append((self.now_ms - kept_dues) / cadence + boost)
        self.eligible += len(kept_dues)
        self._top = None
        self.considered += len(slots)
        self.buckets.clear()
        self.class_ids.clear()
        self.cadence.clear()
        self.boost.clear()

    def kth_rank(self, k: int) -> float:
        """The k-th best rank read so far, or -inf with fewer than k rows."""
        if self.eligible < k:
            return -np.inf
        ranks = np.concatenate(self.ranks) if len(self.ranks) > 1 else self.ranks[0]
        self.ranks = [ranks]
        self._merge()
        # The k best, kept: if no bucket left can beat the k-th, they are the answer.
        self._top = np.argpartition(-ranks, k - 1)[:k] if len(ranks) > k else np.arange(len(ranks))
        return float(ranks[self._top].min())

    def _merge(self) -> None:
        if len(self.slots) > 1:
            self.slots = [np.concatenate(self.slots)]
            self.dues = [np.concatenate(self.dues)]
            self.hashes = [np.concatenate(self.hashes)]
            self.classes = [np.concatenate(self.classes)]

    def best(self, k: int) -> Selection:
        if not self.ranks:
            empty = np.empty(0, dtype=np.int32)
            return Selection(
                slots=empty,
                due_at=np.empty(0, dtype=np.int64),
                class_id=empty,
                key_hash=np.empty(0, dtype=np.uint64),
                rank=np.empty(0, dtype=np.float64),
                considered=self.considered,
                blocked=self.blocked_count,
            )
        self._merge()
        ranks = np.concatenate(self.ranks) if len(self.ranks) > 1 else self.ranks[0]
        top = self._top
        if top is None or len(self.ranks) > 1 or len(top) != min(k, len(ranks)):
            top = np.argpartition(-ranks, k - 1)[:k] if len(ranks) > k else np.arange(len(ranks))
        order = np.take(top, np.argsort(-np.take(ranks, top)))
        return Selection(
            slots=np.take(self.slots[0], order),
            due_at=np.take(self.dues[0], order),
            class_id=np.take(self.classes[0], order),
            key_hash=np.take(self.hashes[0], order),
            rank=np.take(ranks, order),
            considered=self.considered,
            blocked=self.blocked_count,
        )


def select_best(
    queue: HeldQueue, k: int, now_ms: int, blocked: BlockedMask | None = None
) -> Selection:
    """The best k claimable rows (due, route not paused, not blocked), best first."""
    k = max(k, 0)
    table = queue.classes
    cadence = table.cadence_ms().tolist()
    boost = table.boost().tolist()
    paused = table.paused_mask().tolist()
    starts_of = queue.buckets.starts
    ids_of = queue.buckets.ids
    live = queue.buckets.b_live
    heap: list[tuple[float, int, int, int]] = []  # (-upper bound, class, bucket index, end)
    for class_id, starts in enumerate(starts_of):
        if starts and starts[0] <= now_ms and not paused[class_id]:
            upper = (now_ms - starts[0]) / cadence[class_id] + boost[class_id]
            heap.append((-upper, class_id, 0, bisect_right(starts, now_ms)))
    heapq.heapify(heap)
    reader = _Reader(queue, now_ms, blocked)
    if k == 0:
        return reader.best(0)

    # Buckets whose rows are certainly at or above `floor`, by lower bound: a min-heap
    # trimmed so their rows just reach `wanted`.
    inside: list[tuple[float, int]] = []
    inside_rows = 0
    floor = -np.inf
    wanted = k

    def pop() -> None:
        nonlocal inside_rows, floor
        _, class_id, i, end = heapq.heappop(heap)
        starts = starts_of[class_id]
        bucket = ids_of[class_id][i]
        reader.take(bucket, class_id, cadence[class_id], boost[class_id])
        if i + 1 < end:
            upper = (now_ms - starts[i + 1]) / cadence[class_id] + boost[class_id]
            heapq.heappush(heap, (-upper, class_id, i + 1, end))
            # Every row of this bucket is due before the next one starts.
            lower = upper
            heapq.heappush(inside, (lower, live[bucket]))
            inside_rows += live[bucket]
            while inside_rows - inside[0][1] >= wanted:
                inside_rows -= heapq.heappop(inside)[1]
            if inside_rows >= wanted:
                floor = inside[0][0]

    while True:
        while heap and not (inside_rows >= wanted and -heap[0][0] <= floor):
            pop()
        reader.screen()
        if reader.eligible < k:
            if not heap:
                break
            # Leased keys or rows not yet due took places: read on for the rest.
            wanted = inside_rows + (k - reader.eligible)
            continue
        threshold = reader.kth_rank(k)
        if not heap or -heap[0][0] <= threshold:
            break
        while heap and -heap[0][0] > threshold:
            pop()
    return reader.best(k)
