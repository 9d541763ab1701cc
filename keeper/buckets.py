"""Each class's held rows in due order, as buckets of about a hundred rows.

Per class, a sorted list of bucket start times (ms) with the bucket ids beside
it: bucket i holds the class's rows due in [start_i, start_i+1), the first
also anything earlier (its start is lowered to the earliest such row, so a
bucket's start is never later than any of its rows: the bound the best-K
merge relies on).

A bucket is an `array('i')` of slots in no order, appended to and never
searched. A row's place (bucket << 32 | index) is one word of its slot's
record, and an entry is live only while its slot's place points back at it:
a row that moves is appended to its new bucket and its old entry simply goes
stale (`pull` touches a live count and nothing else), so an event writes to
memory it has just read. Stale entries are dropped when a bucket is rebuilt:
when it fills up (then it is also cut, at due-time boundaries, into pieces of
about TARGET rows), when they outnumber the live ones, or when the bucket
joins a neighbour after thinning below MERGE_BELOW. So bucket sizes follow
the rows, not the clock: the head of a class is a few buckets whether its rows
are dense or spread over days. (Rows sharing one due time cannot be cut
apart; such a bucket only tries again once it doubles.) While a load walks the
table, buckets are LOAD_WIDEN times wider, and cut to size when it ends.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from keeper._native import BucketOps
from keeper.slots import FIELDS, PLACE, SlotTable

TARGET = 128
SPLIT_AT = 256
MERGE_BELOW = 24
MERGE_MAX = 160
STALE_SLACK = 32  # stale entries a bucket may carry beyond its live count before a rebuild
# While a load walks the table its chunks arrive in key order, spread over every bucket
# of a class: buckets this many times wider take them in a few appends each and split
# rarely, and `end_load` cuts them to size once.
LOAD_WIDEN = 8


class Buckets:
    def __init__(self, slots: SlotTable) -> None:
        self._slots = slots
        self._rec = slots.rec  # grows in place, never replaced
        self.b_class: array[int] = array("i")
        self.b_start: array[int] = array("q")
        self.b_live: array[int] = array("i")
        self.b_stale: array[int] = array("i")  # entries whose row moved on
        self.b_split_at: array[int] = array("i")
        self.members: list[array[int]] = []
        self._free: list[int] = []
        self.starts: list[list[int]] = []  # per class, bucket starts, ascending
        self.ids: list[list[int]] = []  # per class, bucket ids beside their starts
        self.splits = 0
        self.merges = 0
        self.rebuilds = 0
        self._widen = 1  # LOAD_WIDEN while a load walks
        # Rebuilds and merges come every few dozen events under a claiming fleet (the
        # claims thin the head buckets, the completions fill the tail ones): their
        # rewrites are one C call each, where numpy would pay its per-call cost some
        # twenty times on a hundred rows.
        self._ops = BucketOps(
            index=slots.index, members=self.members, b_live=self.b_live, b_stale=self.b_stale
        )

    def _split_at(self) -> int:
        return SPLIT_AT * self._widen

    def begin_load(self) -> None:
        self._widen = LOAD_WIDEN

    def end_load(self) -> None:
        """Back to buckets of about TARGET rows: the wide ones a load left are cut now."""
        if self._widen == 1:
            return
        self._widen = 1
        split_at = np.frombuffer(self.b_split_at, dtype=np.int32)
        split_at[:] = SPLIT_AT
        del split_at  # a view pins the array's buffer; the rebuilds below may grow it
        wide = [
            bucket
            for bucket in range(len(self.members))
            if self.b_class[bucket] >= 0 and len(self.members[bucket]) >= SPLIT_AT
        ]
        for bucket in wide:
            self.rebuild(bucket, split=True)

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

    # -- the per-event path --------------------------------------------------------

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
        self.b_live[bucket] += 1
        if len(members) >= self.b_split_at[bucket]:
            self.rebuild(bucket, split=True)

    def pull(self, bucket: int, slot: int) -> None:
        """The row left the bucket: its entry is stale from now on (the caller moves its place)."""
        live = self.b_live[bucket] - 1
        self.b_live[bucket] = live
        stale = self.b_stale[bucket] + 1
        self.b_stale[bucket] = stale
        if live < MERGE_BELOW or stale > live + STALE_SLACK:
            self.tidy(bucket)

    def tidy(self, bucket: int) -> None:
        """After a pull: drop an empty bucket, join a thin one to a neighbour, or drop stale
        entries."""
        if self.b_live[bucket] < MERGE_BELOW:
            self._shrink(bucket)
        else:
            self.rebuild(bucket, split=False)

    # -- upkeep --------------------------------------------------------------------

    def _new(self, class_id: int, start: int) -> int:
        if self._free:
            bucket = self._free.pop()
            self.b_class[bucket] = class_id
            self.b_start[bucket] = start
            self.b_live[bucket] = 0
            self.b_stale[bucket] = 0
            self.b_split_at[bucket] = self._split_at()
        else:
            bucket = len(self.members)
            self.members.append(array("i"))
            self.b_class.append(class_id)
            self.b_start.append(start)
            self.b_live.append(0)
            self.b_stale.append(0)
            self.b_split_at.append(self._split_at())
        return bucket

    def _index(self, bucket: int) -> int:
        return bisect_left(self.starts[self.b_class[bucket]], self.b_start[bucket])

    def live_slots(self, bucket: int) -> npt.NDArray[np.int32]:
        """The bucket's live entries (stale ones, whose row moved on, left out)."""
        return self.live_of([bucket])[0]

    def live_of(self, buckets: Sequence[int]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.intp]]:
        """Live entries of many buckets in one pass: their slots, and which bucket (by
        position in `buckets`) each came from. An entry is live while its slot's place
        (bucket << 32 | index) points back at it."""
        parts = [self.members[b] for b in buckets]
        sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        slots = np.frombuffer(b"".join(parts), dtype=np.int32)
        places = self._slots.items()["place"][slots]  # (np.take would copy a strided column)
        first = (np.array(buckets, dtype=np.int64) << 32) - (np.cumsum(sizes) - sizes)
        live = places == np.repeat(first, sizes) + np.arange(len(slots))
        which = np.repeat(np.arange(len(parts)), sizes)
        return slots[live], which[live]

    def _drop(self, bucket: int, index: int) -> None:
        class_id = self.b_class[bucket]
        del self.starts[class_id][index]
        del self.ids[class_id][index]
        del self.members[bucket][:]
        self.b_live[bucket] = 0
        self.b_stale[bucket] = 0
        self.b_class[bucket] = -1  # free: no class lists it
        self._free.append(bucket)

    def _shrink(self, bucket: int) -> None:
        class_id = self.b_class[bucket]
        ids = self.ids[class_id]
        i = self._index(bucket)
        if self.b_live[bucket] == 0:
            self._drop(bucket, i)
            return
        if len(ids) == 1:
            return
        # Join the neighbour on the left (its range grows over this one), or, for
        # the first bucket, take in the one on the right.
        into, gone = (i - 1, i) if i > 0 else (0, 1)
        kept, moved = ids[into], ids[gone]
        if self.b_live[kept] + self.b_live[moved] > MERGE_MAX:
            return
        self._ops.compact(kept, moved)  # the kept bucket's live entries, then the moved's
        self._drop(moved, gone)
        self.merges += 1

    def rebuild(self, bucket: int, *, split: bool) -> None:
        """Drop stale entries; cut the bucket in pieces of about TARGET rows if it is big."""
        self.rebuilds += 1
        count = self._ops.compact(bucket, -1)
        if count < SPLIT_AT or not split:
            return
        split_at = self._split_at()
        # The entries in due order, and where to cut them (each at a change of due time).
        cuts = self._ops.sort_cut(bucket, max(2, round(count / (TARGET * self._widen))))
        if not cuts:
            self.b_split_at[bucket] = 2 * count  # one due time: retry once doubled
            return
        class_id = self.b_class[bucket]
        i = self._index(bucket)
        members = self.members[bucket]
        ends = [a for a, _ in cuts[1:]] + [count]
        new_ids: list[int] = []
        new_starts: list[int] = []
        for (a, start), b in zip(cuts, ends, strict=True):
            target = self._new(class_id, start)
            self._ops.refill(target, members[a:b])
            new_ids.append(target)
            new_starts.append(start)
        self._ops.compact(bucket, -1)  # the first piece stays: the rest went stale here
        self.b_split_at[bucket] = split_at
        self.starts[class_id][i + 1 : i + 1] = new_starts
        self.ids[class_id][i + 1 : i + 1] = new_ids
        self.splits += 1

    # -- the bulk path -------------------------------------------------------------

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
        slots = np.ascontiguousarray(slots[order], dtype=np.int32)
        bounds = np.flatnonzero(np.diff(index, prepend=-1))
        counts = np.diff(np.append(bounds, len(slots)))
        touched = np.array(ids, dtype=np.int64)[index[bounds]]
        # A load's chunk lands on most of a class's buckets a few rows each, so all but
        # the appends themselves is done over every row at once.
        parts = [self.members[bucket] for bucket in touched.tolist()]
        lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
        data = memoryview(slots.tobytes())
        ends = bounds + counts
        for part, a, b in zip(parts, (4 * bounds).tolist(), (4 * ends).tolist(), strict=True):
            part.frombytes(data[a:b])
        self._slots.set_places(
            slots,
            np.repeat(touched, counts),
            np.arange(len(slots)) - np.repeat(bounds - lengths, counts),
        )
        live = np.frombuffer(self.b_live, dtype=np.int32)
        live[touched] += counts.astype(np.int32)
        split_at = np.frombuffer(self.b_split_at, dtype=np.int32)
        grown = touched[lengths + counts >= split_at[touched]].tolist()
        del live, split_at  # views pin the arrays' buffers; a rebuild may grow them
        for bucket in grown:
            self.rebuild(bucket, split=True)

    # -- reading -------------------------------------------------------------------

    def class_slots(self, class_id: int) -> npt.NDArray[np.int32]:
        """Every live slot of the class, in bucket order."""
        if class_id >= len(self.ids) or not self.ids[class_id]:
            return np.empty(0, dtype=np.int32)
        return np.concatenate([self.live_slots(b) for b in self.ids[class_id]])

    def nbytes(self) -> int:
        return len(self.members) * (4 + 8 + 4 + 4 + 4) + 4 * sum(
            m.buffer_info()[1] for m in self.members
        )
