"""The held queue: every owned row as (due, class), in due-ordered buckets per class.

Per row the queue keeps a slot (`keeper.slots`): the key's bytes and a record
of hash, due ms, version and place in its bucket.
Two structures are kept per class, both exact at all times: buckets of about a
hundred rows in due order (`keeper.buckets`), which give the class list in
priority order because within a class an earlier due always ranks higher;
and rows per due minute (`keeper.tallies`), from which the full counts come.

The best K is a merge over class heads: a heap of classes keyed by the rank
of their next bucket's start (an upper bound for every row in it), taking
buckets until K claimable rows are in hand, then an exact pass that adds every
bucket whose bound beats the K-th best rank found. Only those candidates are
ranked and sorted; nothing is ever rescored.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.buckets import Buckets
from keeper.classes import ClassTable
from keeper.slots import ABSENT, DUE, FIELDS, PLACE, VERSION, SlotTable
from keeper.tallies import MINUTE_MS, MinuteTallies

# What an upsert or remove did, for the flow counters (indexes into a tally list).
ADDED = 0
TRIGGERED = 1  # an existing row moved earlier and became due
RESCHEDULED = 2  # an existing row's due time moved otherwise
UNCHANGED = 3  # same due time (maybe another class or version)
REMOVED = 4
NOT_HELD = 5

RERANK_EVERY = 1024  # rows read in the exact pass between threshold updates

BlockedMask = Callable[[npt.NDArray[np.uint64]], npt.NDArray[np.bool_]]


class Selection(msgspec.Struct, frozen=True, kw_only=True):
    """The best claimable rows, best first."""

    slots: npt.NDArray[np.int32]
    due_at: npt.NDArray[np.int64]
    class_id: npt.NDArray[np.int32]
    key_hash: npt.NDArray[np.uint64]
    rank: npt.NDArray[np.float64]
    considered: int  # candidate rows read from buckets
    blocked: int  # due candidates left out as leased or held


class HeldRow(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    key_hash: int
    due_at: int
    class_id: int
    version: int


class HeldQueue:
    def __init__(self, classes: ClassTable, index_capacity: int = 1024) -> None:
        self.classes = classes
        self.slots = SlotTable(index_capacity)
        self.rec = self.slots.rec  # grows in place, never replaced
        self.buckets = Buckets(self.slots)
        self.tallies = MinuteTallies()

    def __len__(self) -> int:
        return len(self.slots)

    # -- the per-event path --------------------------------------------------------

    def upsert(
        self, key: bytes, key_hash: int, class_id: int, due_at: int, version: int, now_ms: int
    ) -> int:
        rec = self.rec
        slot = self.slots.find(key_hash)
        if slot == ABSENT:
            slot = self.slots.add(key_hash, key)
            base = slot * FIELDS
            rec[base + DUE] = due_at
            rec[base + VERSION] = version
            self.tallies.add(class_id, due_at // MINUTE_MS)
            self.buckets.push(class_id, due_at, slot)
            return ADDED
        base = slot * FIELDS
        old_due = rec[base + DUE]
        rec[base + VERSION] = version
        bucket = rec[base + PLACE] >> 32
        old_class = self.buckets.b_class[bucket]
        if due_at == old_due:
            if old_class != class_id:
                self._move(slot, bucket, old_class, old_due, class_id, due_at)
            return UNCHANGED
        rec[base + DUE] = due_at
        self._move(slot, bucket, old_class, old_due, class_id, due_at)
        if due_at <= now_ms < old_due:
            return TRIGGERED
        return RESCHEDULED

    def _move(
        self, slot: int, old_bucket: int, old_class: int, old_due: int, class_id: int, due_at: int
    ) -> None:
        minute = due_at // MINUTE_MS
        old_minute = old_due // MINUTE_MS
        if minute != old_minute or class_id != old_class:
            self.tallies.sub(old_class, old_minute)
            self.tallies.add(class_id, minute)
        buckets = self.buckets
        if class_id != old_class or buckets.bucket_for(class_id, due_at) != old_bucket:
            buckets.pull(old_bucket, slot)
            buckets.push(class_id, due_at, slot)
        elif due_at < buckets.b_start[old_bucket]:
            buckets.lower_first(class_id, due_at)

    def remove(self, key_hash: int) -> int:
        slot = self.slots.find(key_hash)
        if slot < 0:
            return NOT_HELD
        self.remove_slot(slot)
        return REMOVED

    def remove_slot(self, slot: int) -> None:
        base = slot * FIELDS
        bucket = self.rec[base + PLACE] >> 32
        self.tallies.sub(self.buckets.b_class[bucket], self.rec[base + DUE] // MINUTE_MS)
        self.buckets.pull(bucket, slot)
        self.slots.remove(slot)

    # -- the bulk path (load and verification walks) ------------------------------

    def add_many(
        self,
        keys: Sequence[bytes],
        key_hashes: npt.NDArray[np.uint64],
        class_ids: npt.NDArray[np.int32],
        due_at: npt.NDArray[np.int64],
        versions: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.int32]:
        """Hold rows whose keys are distinct and not held; returns their slots."""
        count = len(keys)
        if count == 0:
            return np.empty(0, dtype=np.int32)
        slots = self.slots.add_many(key_hashes, keys)
        records = self.slots.records()
        records[slots, DUE] = due_at
        records[slots, VERSION] = versions
        del records
        order = np.argsort(class_ids, kind="stable")
        ordered = class_ids[order]
        starts = np.flatnonzero(np.diff(ordered, prepend=-1))
        ends = np.append(starts[1:], count)
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            class_id = int(ordered[a])
            rows = order[a:b]
            self.tallies.add_many(class_id, due_at[rows] // MINUTE_MS)
            self.buckets.push_many(class_id, due_at[rows], slots[rows])
        return slots

    # -- reading -------------------------------------------------------------------

    def slot_of(self, key_hash: int) -> int:
        return self.slots.find(key_hash)

    def class_of(self, slot: int) -> int:
        return self.buckets.b_class[self.rec[slot * FIELDS + PLACE] >> 32]

    def due_of(self, slot: int) -> int:
        return self.rec[slot * FIELDS + DUE]

    def version_of(self, slot: int) -> int:
        return self.rec[slot * FIELDS + VERSION]

    def hash_of(self, slot: int) -> int:
        return self.rec[slot * FIELDS]

    def held(self, key_hash: int) -> HeldRow | None:
        slot = self.slots.find(key_hash)
        if slot < 0:
            return None
        return self.held_slot(slot)

    def held_slot(self, slot: int) -> HeldRow:
        return HeldRow(
            key=self.slots.key(slot).decode(),
            key_hash=self.hash_of(slot),
            due_at=self.due_of(slot),
            class_id=self.class_of(slot),
            version=self.version_of(slot),
        )

    def class_ids_in_use(self) -> list[int]:
        return [c for c, ids in enumerate(self.buckets.ids) if ids]

    def minute_slots(self, class_id: int, minute: int) -> npt.NDArray[np.int32]:
        """Slots of the class whose due time falls in `minute`."""
        low = minute * MINUTE_MS
        slots = self.buckets.range_slots(class_id, low, low + MINUTE_MS)
        in_minute: npt.NDArray[np.int32] = slots[self.slots.dues()[slots] // MINUTE_MS == minute]
        return in_minute

    def oldest_due(self, class_id: int) -> int | None:
        """The class's earliest due time (its first bucket holds its earliest rows)."""
        slots = self.buckets.head_slots(class_id)
        return int(self.slots.dues()[slots].min()) if len(slots) else None

    def best(self, k: int, now_ms: int, blocked: BlockedMask | None = None) -> Selection:
        """The best k claimable rows (due, class not paused, not blocked), best first."""
        k = max(k, 0)
        cadence = self.classes.cadence_ms().tolist()
        boost = self.classes.boost().tolist()
        paused = self.classes.paused_mask().tolist()
        starts_of = self.buckets.starts
        ids_of = self.buckets.ids
        members = self.buckets.members
        heap: list[tuple[float, int, int, int]] = []
        for class_id, starts in enumerate(starts_of):
            if not starts or starts[0] > now_ms or paused[class_id]:
                continue
            end = bisect_right(starts, now_ms)
            bound = (now_ms - starts[0]) / cadence[class_id] + boost[class_id]
            heap.append((-bound, class_id, 0, end))
        heapq.heapify(heap)
        parts: list[array[int]] = []
        part_class: list[int] = []
        part_size: list[int] = []
        dues = self.slots.dues()
        hashes = self.slots.hashes()
        cadence_np = self.classes.cadence_ms()
        boost_np = self.classes.boost()
        chosen: list[npt.NDArray[np.int32]] = []
        chosen_class: list[npt.NDArray[np.int32]] = []
        considered = 0
        blocked_count = 0

        def take(class_id: int, first: int, stop: int, budget: int) -> int:
            """Read buckets first..stop of a class, ending early once `budget` rows are read."""
            ids = ids_of[class_id]
            index = first
            while index < stop:
                held = members[ids[index]]
                parts.append(held)
                part_class.append(class_id)
                part_size.append(len(held))
                budget -= len(held)
                index += 1
                if budget <= 0:
                    break
            return index

        def screen() -> int:
            nonlocal considered, blocked_count
            if not parts:
                return 0
            slots = np.frombuffer(b"".join(parts), dtype=np.int32)
            classes = np.repeat(np.array(part_class, dtype=np.int32), part_size)
            parts.clear()
            part_class.clear()
            part_size.clear()
            considered += len(slots)
            keep = dues[slots] <= now_ms
            if blocked is not None:
                stopped = blocked(hashes[slots])
                blocked_count += int(np.count_nonzero(stopped & keep))
                keep &= ~stopped
            chosen.append(slots[keep])
            chosen_class.append(classes[keep])
            return int(np.count_nonzero(keep))

        eligible = 0
        while heap and eligible < k:
            wanted = k - eligible
            raw = 0
            while heap and raw < wanted:
                _, class_id, first, end = heapq.heappop(heap)
                starts = starts_of[class_id]
                stop = first + 1
                if heap:
                    # Run on while this class still beats the next one's head.
                    rival = -heap[0][0]
                    reach = now_ms - (rival - boost[class_id]) * cadence[class_id]
                    stop = max(stop, bisect_right(starts, reach, first, end))
                before = len(part_size)
                stop = take(class_id, first, stop, wanted - raw)
                raw += sum(part_size[before:])
                if stop < end:
                    bound = (now_ms - starts[stop]) / cadence[class_id] + boost[class_id]
                    heapq.heappush(heap, (-bound, class_id, stop, end))
            eligible += screen()
        slots = np.concatenate(chosen) if chosen else np.empty(0, dtype=np.int32)
        class_ids = np.concatenate(chosen_class) if chosen else np.empty(0, dtype=np.int32)
        ranks = (now_ms - dues[slots]) / cadence_np[class_ids] + boost_np[class_ids]
        if heap and k and len(slots) >= k:
            # Exact pass: read on, bucket by bucket in bound order, while the next bound
            # beats the k-th best rank in hand; that rank only rises as better rows come.
            threshold = _kth_best(ranks, k)
            unranked = 0
            while heap and -heap[0][0] > threshold:
                _, class_id, first, end = heapq.heappop(heap)
                take(class_id, first, first + 1, 0)
                unranked += part_size[-1]
                if first + 1 < end:
                    start = starts_of[class_id][first + 1]
                    bound = (now_ms - start) / cadence[class_id] + boost[class_id]
                    heapq.heappush(heap, (-bound, class_id, first + 1, end))
                if unranked >= RERANK_EVERY or not heap or -heap[0][0] <= threshold:
                    unranked = 0
                    if screen():
                        slots = np.concatenate([slots, chosen[-1]])
                        class_ids = np.concatenate([class_ids, chosen_class[-1]])
                        ranks = (now_ms - dues[slots]) / cadence_np[class_ids] + boost_np[class_ids]
                        threshold = _kth_best(ranks, k)
        if len(slots) > k:
            top = np.argpartition(-ranks, k - 1)[:k] if k else np.empty(0, dtype=np.intp)
            slots, class_ids, ranks = slots[top], class_ids[top], ranks[top]
        order = np.argsort(-ranks, kind="stable")
        slots = slots[order]
        return Selection(
            slots=slots,
            due_at=dues[slots],
            class_id=class_ids[order],
            key_hash=hashes[slots],
            rank=ranks[order],
            considered=considered,
            blocked=blocked_count,
        )

    def earliest_claimable(self, now_ms: int, blocked: BlockedMask | None = None) -> int | None:
        """The earliest due time among claimable rows (due, not paused, not blocked)."""
        paused = self.classes.paused_mask().tolist()
        dues = self.slots.dues()
        hashes = self.slots.hashes()
        earliest: int | None = None
        for class_id, ids in enumerate(self.buckets.ids):
            if not ids or paused[class_id]:
                continue
            # Buckets hold disjoint due ranges in order: the first with a claimable
            # row holds the class's earliest.
            for bucket in ids:
                slots = np.frombuffer(self.buckets.members[bucket], dtype=np.int32)
                bucket_dues = dues[slots]
                keep = bucket_dues <= now_ms
                if not keep.any():
                    break
                if blocked is not None:
                    keep &= ~blocked(hashes[slots])
                if keep.any():
                    found = int(bucket_dues[keep].min())
                    earliest = found if earliest is None else min(earliest, found)
                    break
        return earliest

    # -- reclassification ----------------------------------------------------------

    def move_class(self, source: int, target: int) -> int:
        """Move every row of class `source` into class `target`; returns rows moved."""
        moved = 0
        for slot in self.buckets.class_slots(source).tolist():
            due = self.due_of(slot)
            self.upsert(b"", self.hash_of(slot), target, due, self.version_of(slot), 0)
            moved += 1
        return moved

    def class_sizes(self) -> npt.NDArray[np.int64]:
        """Rows held per class id."""
        t_class, _, t_count = self.tallies.columns()
        return np.bincount(t_class, weights=t_count, minlength=len(self.classes)).astype(np.int64)

    def nbytes(self) -> int:
        """Bytes in the queue's own buffers (allocated lengths), keys included."""
        return self.slots.nbytes() + self.buckets.nbytes() + self.tallies.nbytes()


def _kth_best(ranks: npt.NDArray[np.float64], k: int) -> float:
    return float(np.partition(ranks, len(ranks) - k)[len(ranks) - k])
