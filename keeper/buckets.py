"""Each class's held rows in due order, as buckets of about a hundred rows.

Per class, a sorted list of bucket start times (ms) with the bucket ids beside
it: bucket i holds the class's rows due in [start_i, start_i+1), the first
also anything earlier (its start is lowered to the earliest such row, so a
bucket's start is never later than any of its rows: the bound the best-K
merge relies on). A bucket is an `array('i')` of slots in no order; a slot's
bucket and position are one word of its record, so a move is a swap-remove
and an append. A bucket that grows past SPLIT_AT is cut at due-time boundaries
into pieces of about TARGET rows; one that shrinks below MERGE_BELOW joins a
neighbour. So bucket sizes follow the rows, not the clock: the head of a class
is a few buckets whether its rows are dense or spread over days, which keeps
the best-K merge to a few dozen buckets. (Rows sharing one due time cannot be
cut apart; such a bucket only tries again once it doubles.)
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right

import numpy as np
import numpy.typing as npt

from keeper.slots import FIELDS, PLACE, POSITION_MASK, SlotTable

TARGET = 128
SPLIT_AT = 256
MERGE_BELOW = 24
MERGE_MAX = 160


class Buckets:
    def __init__(self, slots: SlotTable) -> None:
        self._slots = slots
        self._rec = slots.rec  # grows in place, never replaced
        self.b_class: array[int] = array("i")
        self.b_start: array[int] = array("q")
        self.b_split_at: array[int] = array("i")
        self.members: list[array[int]] = []
        self._free: list[int] = []
        self.starts: list[list[int]] = []  # per class, bucket starts, ascending
        self.ids: list[list[int]] = []  # per class, bucket ids beside their starts
        self.splits = 0
        self.merges = 0

    def __len__(self) -> int:
        return len(self.members) - len(self._free)

    def add_class(self, class_id: int) -> None:
        while len(self.starts) <= class_id:
            self.starts.append([])
            self.ids.append([])

    def bucket_for(self, class_id: int, due: int) -> int:
        """The bucket a row of the class due at `due` belongs in, or -1 if none yet."""
        if class_id >= len(self.starts) or not self.starts[class_id]:
            return -1
        i = bisect_right(self.starts[class_id], due) - 1
        return self.ids[class_id][i if i > 0 else 0]

    def lower_first(self, class_id: int, due: int) -> None:
        """Keep the first bucket's start at or below its earliest row."""
        starts = self.starts[class_id]
        if due < starts[0]:
            starts[0] = due
            self.b_start[self.ids[class_id][0]] = due

    def push(self, class_id: int, due: int, slot: int) -> None:
        if class_id >= len(self.starts):
            self.add_class(class_id)
        starts = self.starts[class_id]
        if not starts:
            bucket = self._new(class_id, due)
            starts.append(due)
            self.ids[class_id].append(bucket)
        else:
            i = bisect_right(starts, due) - 1
            if i < 0:
                i = 0
                starts[0] = due
                self.b_start[self.ids[class_id][0]] = due
            bucket = self.ids[class_id][i]
        members = self.members[bucket]
        self._rec[slot * FIELDS + PLACE] = (bucket << 32) | len(members)
        members.append(slot)
        if len(members) >= self.b_split_at[bucket]:
            self._split(bucket)

    def pull(self, bucket: int, slot: int) -> None:
        members = self.members[bucket]
        last = members.pop()
        if last != slot:
            position = self._rec[slot * FIELDS + PLACE] & POSITION_MASK
            members[position] = last
            self._rec[last * FIELDS + PLACE] = (bucket << 32) | position
        if len(members) < MERGE_BELOW:
            self._shrink(bucket)

    def _new(self, class_id: int, start: int) -> int:
        if self._free:
            bucket = self._free.pop()
            self.b_class[bucket] = class_id
            self.b_start[bucket] = start
            self.b_split_at[bucket] = SPLIT_AT
        else:
            bucket = len(self.members)
            self.members.append(array("i"))
            self.b_class.append(class_id)
            self.b_start.append(start)
            self.b_split_at.append(SPLIT_AT)
        return bucket

    def _index(self, bucket: int) -> int:
        class_id = self.b_class[bucket]
        return bisect_left(self.starts[class_id], self.b_start[bucket])

    def _shrink(self, bucket: int) -> None:
        class_id = self.b_class[bucket]
        starts = self.starts[class_id]
        ids = self.ids[class_id]
        i = self._index(bucket)
        if not self.members[bucket]:
            del starts[i]
            del ids[i]
            self._free.append(bucket)
            return
        if len(ids) == 1:
            return
        # Join the neighbour on the left (its range grows over this one), or, for
        # the first bucket, take in the one on the right.
        into, gone = (i - 1, i) if i > 0 else (0, 1)
        kept = self.members[ids[into]]
        moved = self.members[ids[gone]]
        if len(kept) + len(moved) > MERGE_MAX:
            return
        slots = np.frombuffer(moved, dtype=np.int32).copy()
        self._slots.set_places(slots, ids[into], np.arange(len(kept), len(kept) + len(slots)))
        kept.extend(moved)
        del moved[:]
        self._free.append(ids[gone])
        del starts[gone]
        del ids[gone]
        self.merges += 1

    def _split(self, bucket: int) -> None:
        members = self.members[bucket]
        slots = np.frombuffer(members, dtype=np.int32).copy()
        dues = self._slots.dues()[slots]
        order = np.argsort(dues, kind="stable")
        slots = slots[order]
        dues = dues[order]
        cuts = _cuts(dues, max(2, round(len(slots) / TARGET)))
        if not cuts:
            self.b_split_at[bucket] = 2 * len(slots)  # one due time: retry once doubled
            return
        class_id = self.b_class[bucket]
        i = self._index(bucket)
        edges = [0, *cuts, len(slots)]
        new_ids: list[int] = []
        new_starts: list[int] = []
        owner = np.empty(len(slots), dtype=np.int32)
        position = np.empty(len(slots), dtype=np.int32)
        for piece in range(len(edges) - 1):
            a, b = edges[piece], edges[piece + 1]
            if piece == 0:
                target = bucket
            else:
                target = self._new(class_id, int(dues[a]))
                new_ids.append(target)
                new_starts.append(int(dues[a]))
            owner[a:b] = target
            position[a:b] = np.arange(b - a, dtype=np.int32)
            chunk = self.members[target]
            del chunk[:]
            chunk.frombytes(slots[a:b].tobytes())
        self.b_split_at[bucket] = SPLIT_AT
        self.starts[class_id][i + 1 : i + 1] = new_starts
        self.ids[class_id][i + 1 : i + 1] = new_ids
        self._slots.set_places(slots, owner, position)
        self.splits += 1

    def push_many(
        self, class_id: int, dues: npt.NDArray[np.int64], slots: npt.NDArray[np.int32]
    ) -> None:
        """Bucket many rows of one class at once (the load path)."""
        if not len(slots):
            return
        self.add_class(class_id)
        starts = self.starts[class_id]
        ids = self.ids[class_id]
        lowest = int(dues.min())
        if not starts:
            ids.append(self._new(class_id, lowest))
            starts.append(lowest)
        elif lowest < starts[0]:
            starts[0] = lowest
            self.b_start[ids[0]] = lowest
        index = np.searchsorted(np.array(starts, dtype=np.int64), dues, side="right") - 1
        order = np.argsort(index, kind="stable")
        index = index[order]
        slots = slots[order]
        bounds = np.flatnonzero(np.diff(index, prepend=-1))
        ends = np.append(bounds[1:], len(slots))
        owner = np.empty(len(slots), dtype=np.int32)
        position = np.empty(len(slots), dtype=np.int32)
        grown: list[int] = []
        for a, b in zip(bounds.tolist(), ends.tolist(), strict=True):
            bucket = ids[int(index[a])]
            members = self.members[bucket]
            owner[a:b] = bucket
            position[a:b] = np.arange(len(members), len(members) + b - a, dtype=np.int32)
            members.frombytes(slots[a:b].tobytes())
            if len(members) >= self.b_split_at[bucket]:
                grown.append(bucket)
        self._slots.set_places(slots, owner, position)
        for bucket in grown:
            self._split(bucket)

    # -- reading -------------------------------------------------------------------

    def class_slots(self, class_id: int, before: int | None = None) -> npt.NDArray[np.int32]:
        """Slots of the class's buckets that start before `before` (all if None)."""
        if class_id >= len(self.starts):
            return np.empty(0, dtype=np.int32)
        ids = self.ids[class_id]
        end = len(ids) if before is None else bisect_left(self.starts[class_id], before)
        return np.frombuffer(b"".join([self.members[b] for b in ids[:end]]), dtype=np.int32)

    def range_slots(self, class_id: int, low: int, high: int) -> npt.NDArray[np.int32]:
        """Slots of the class's buckets that may hold rows due in [low, high)."""
        if class_id >= len(self.starts) or not self.starts[class_id]:
            return np.empty(0, dtype=np.int32)
        starts = self.starts[class_id]
        first = max(0, bisect_right(starts, low) - 1)
        end = bisect_left(starts, high)
        ids = self.ids[class_id][first : max(end, first + 1)]
        return np.frombuffer(b"".join([self.members[b] for b in ids]), dtype=np.int32)

    def head_slots(self, class_id: int) -> npt.NDArray[np.int32]:
        """Slots of the class's first bucket: it holds the class's earliest due rows."""
        if class_id >= len(self.starts) or not self.ids[class_id]:
            return np.empty(0, dtype=np.int32)
        return np.frombuffer(self.members[self.ids[class_id][0]], dtype=np.int32).copy()

    def nbytes(self) -> int:
        return len(self.members) * (4 + 8 + 4) + 4 * sum(m.buffer_info()[1] for m in self.members)


def _cuts(dues: npt.NDArray[np.int64], pieces: int) -> list[int]:
    """Cut points near equal shares of sorted `dues`, each where the due time changes."""
    n = len(dues)
    cuts: list[int] = []
    for piece in range(1, pieces):
        at = piece * n // pieces
        cut = int(np.searchsorted(dues, dues[at], side="left"))
        if cut == 0:
            cut = int(np.searchsorted(dues, dues[at], side="right"))
        if 0 < cut < n and (not cuts or cut > cuts[-1]):
            cuts.append(cut)
    return cuts
