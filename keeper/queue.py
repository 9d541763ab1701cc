"""The held queue: every owned row as (due, class), in due-ordered buckets per class.

Per row the queue keeps a slot (`keeper.slots`): the key's bytes and a record
of hash, due ms, version and place in its bucket; and the id of its site
(`keeper.sites`), taken when the row enters under its route's site pattern, and taken
again when the row moves to another route or its route's pattern changes.
Two structures are kept per class, both exact at all times: buckets of about a
hundred rows in due order (`keeper.buckets`), which give the class list in
priority order because within a class an earlier due always ranks higher;
and rows per due minute (`keeper.tallies`), from which the full counts come.

The best K is a merge over class heads (`keeper.select`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper._native import QueueView
from keeper.buckets import MERGE_BELOW, STALE_SLACK, Buckets
from keeper.classes import ClassTable
from keeper.select import Allowances, BlockedMask, BlockEnds, Selection, select_best
from keeper.sites import HeldSites
from keeper.skips import RowSkips
from keeper.slots import DUE, FIELDS, NO_PLACE, PLACE, VERSION, SlotTable
from keeper.tallies import MINUTE_MS, MinuteTallies
from shm.keys import key_site_hash, key_site_hashes

# What an upsert or remove did, for the flow counters (indexes into a tally list).
ADDED = 0
TRIGGERED = 1  # an existing row moved earlier and became due
RESCHEDULED = 2  # an existing row's due time moved otherwise
UNCHANGED = 3  # same due time (maybe another class or version)
REMOVED = 4
NOT_HELD = 5


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
        self.sites = HeldSites()
        self.skips = RowSkips()  # rows found leased, passed over by selections for a while
        # Each slot's site id, parallel to the slot records (a free slot's is stale).
        self.site_ids: array[int] = array("i")
        # The site pattern of each route that has one (shm.keys.site_of): set_site_pattern.
        self.site_patterns: dict[str, bytes] = {}
        self.buckets = Buckets(self.slots)
        self.tallies = MinuteTallies()
        buckets = self.buckets
        # The event path's common case in C, bound to the structures that live as long
        # as the queue (each grows in place, never replaced). The feed's batches call it
        # directly (KeeperCore._apply_rows), then `upsert_unmoved`.
        self.view = QueueView(
            index=self.slots.index,
            b_class=buckets.b_class,
            b_live=buckets.b_live,
            b_stale=buckets.b_stale,
            b_split_at=buckets.b_split_at,
            starts=buckets.starts,
            ids=buckets.ids,
            members=buckets.members,
            tally_counts=self.tallies.counts,
            tally_base=self.tallies.base,
            buckets=buckets,
            merge_below=MERGE_BELOW,
            stale_slack=STALE_SLACK,
        )
        self.moved = self.view.upsert_moved
        # The same for a run of feed events at once (KeeperCore._apply_rows).
        self.apply_moves = self.view.apply_moves
        # And for a run of the feed's records themselves (KeeperCore.apply_records).
        self.apply_records = self.view.apply_records

    def __len__(self) -> int:
        return len(self.slots)

    # -- the per-event path --------------------------------------------------------

    def upsert(
        self, key: bytes, key_hash: int, class_id: int, due_at: int, version: int, now_ms: int
    ) -> int:
        """Hold the row's current state; returns what changed (ADDED, TRIGGERED, ...).

        The per-event path: a held row moving within its class is one C call
        (`QueueView.upsert_moved` in keeper/csrc, which changes nothing when it returns -1);
        the rest is written out here rather than in calls to the slot table, tallies
        and buckets: on this path a Python call costs about as much as the work it
        would do. The slow cases are theirs.
        """
        self.tallies.now_minute = now_ms // MINUTE_MS
        done = self.moved(key_hash, class_id, due_at, version, now_ms)
        if done >= 0:
            return done
        return self.upsert_unmoved(key, key_hash, class_id, due_at, version, now_ms)

    def upsert_unmoved(
        self, key: bytes, key_hash: int, class_id: int, due_at: int, version: int, now_ms: int
    ) -> int:
        """`upsert` once `moved` returned -1 (and tallies.now_minute is now's minute):
        a new row, a move to another class, or one outside the C path's dense case."""
        tallies = self.tallies
        slots = self.slots
        rec = self.rec
        # SlotTable.find, inline: linear probing on the hash, records four words apart.
        table = slots._table
        mask = slots._mask
        i = key_hash & mask
        while True:
            slot = table[i]
            if slot < 0:
                break
            if rec[slot << 2] == key_hash:
                break
            i = (i + 1) & mask
        if slot < 0:
            slot = slots.add(key_hash, key)
            patterns = self.site_patterns
            site = self.sites.intern(
                key_site_hash(key, patterns.get(self.classes.get(class_id).route, b""))
                if patterns
                else key_site_hash(key)
            )
            if slot == len(self.site_ids):
                self.site_ids.append(site)
            else:
                self.site_ids[slot] = site
            base = slot * FIELDS
            rec[base + DUE] = due_at
            rec[base + VERSION] = version
            tallies.add(class_id, due_at // MINUTE_MS)
            self.buckets.push(class_id, due_at, slot)
            return ADDED
        base = slot << 2
        old_due = rec[base + DUE]
        rec[base + VERSION] = version
        buckets = self.buckets
        old_bucket = rec[base + PLACE] >> 32
        old_class = buckets.b_class[old_bucket]
        if due_at == old_due:
            if old_class != class_id:
                self._move(slot, old_bucket, old_class, old_due, class_id, due_at)
                if self.site_patterns:
                    self._resite(slot, key, old_class, class_id)
            return UNCHANGED
        rec[base + DUE] = due_at
        if class_id != old_class:
            self._move(slot, old_bucket, old_class, old_due, class_id, due_at)
            if self.site_patterns:
                self._resite(slot, key, old_class, class_id)
        else:
            minute = due_at // MINUTE_MS
            old_minute = old_due // MINUTE_MS
            if minute != old_minute:
                # MinuteTallies.sub and .add, inline for the dense case.
                counts = tallies.counts[class_id]
                first = tallies.base[class_id]
                if 0 <= old_minute - first < len(counts) and 0 <= minute - first < len(counts):
                    counts[old_minute - first] -= 1
                    counts[minute - first] += 1
                else:
                    tallies.sub(class_id, old_minute)
                    tallies.add(class_id, minute)
            # Buckets.bucket_for, push and pull, inline for a move within the class.
            starts = buckets.starts[class_id]
            k = bisect_right(starts, due_at) - 1
            target = buckets.ids[class_id][k if k > 0 else 0]
            if target == old_bucket:
                if k < 0:
                    buckets.lower_first(class_id, due_at)
            elif k < 0:
                buckets.push(class_id, due_at, slot)
                buckets.pull(old_bucket, slot)
            else:
                # Push first: the new place makes the old entry stale before the old
                # bucket (which may rebuild or merge on the pull) looks at its entries.
                members = buckets.members[target]
                rec[base + PLACE] = (target << 32) | len(members)
                members.append(slot)
                live = buckets.b_live
                live[target] += 1
                if len(members) >= buckets.b_split_at[target]:
                    buckets.rebuild(target, split=True)
                left = live[old_bucket] - 1
                live[old_bucket] = left
                stale = buckets.b_stale[old_bucket] + 1
                buckets.b_stale[old_bucket] = stale
                if left < MERGE_BELOW or stale > left + STALE_SLACK:
                    buckets.tidy(old_bucket)
        if due_at <= now_ms < old_due:
            return TRIGGERED
        return RESCHEDULED

    def _move(
        self, slot: int, old_bucket: int, old_class: int, old_due: int, class_id: int, due_at: int
    ) -> None:
        """Move a row to another class (and maybe due time): the slow path of `upsert`."""
        minute = due_at // MINUTE_MS
        old_minute = old_due // MINUTE_MS
        if minute != old_minute or class_id != old_class:
            self.tallies.sub(old_class, old_minute)
            self.tallies.add(class_id, minute)
        buckets = self.buckets
        if class_id != old_class or buckets.bucket_for(class_id, due_at) != old_bucket:
            buckets.push(class_id, due_at, slot)
            buckets.pull(old_bucket, slot)
        elif due_at < buckets.b_start[old_bucket]:
            buckets.lower_first(class_id, due_at)

    def _resite(self, slot: int, key: bytes, old_class: int, class_id: int) -> None:
        """A row moved to another class: under another route's pattern, another site."""
        patterns, classes = self.site_patterns, self.classes
        old = patterns.get(classes.get(old_class).route, b"")
        new = patterns.get(classes.get(class_id).route, b"")
        if old == new:
            return
        site = self.sites.intern(key_site_hash(key, new))
        self.sites.release(self.site_ids[slot])
        self.site_ids[slot] = site

    def set_site_pattern(self, route: str, pattern: bytes) -> int:
        """The route's site pattern is now `pattern` (b"": none): its held rows take their
        sites again under it, in one C call; returns how many rows were re-sited."""
        if self.site_patterns.get(route, b"") == pattern:
            return 0
        if pattern:
            self.site_patterns[route] = pattern
        else:
            self.site_patterns.pop(route, None)
        classes = [c for c in range(len(self.classes)) if self.classes.get(c).route == route]
        if not classes or not len(self.slots):
            return 0
        place = self.slots.items()["place"].view(np.uint64)
        live = np.flatnonzero(place != np.uint64(NO_PLACE))
        class_of = np.frombuffer(self.buckets.b_class, dtype=np.intc)
        in_route = np.isin(class_of[(place[live] >> np.uint64(32)).astype(np.intp)], classes)
        slots = live[in_route].astype(np.int32)
        del place, class_of  # live views would stop the records from growing
        if len(slots) == 0:
            return 0
        keys = self.slots.keys(slots)
        hashes = (
            key_site_hashes(keys, (pattern,), np.zeros(len(keys), np.int32))
            if pattern
            else key_site_hashes(keys)
        )
        old_ids = np.frombuffer(self.site_ids, dtype=np.int32)[slots]  # a copy
        # The new sites first: a site a row keeps keeps its id.
        new_ids = self.sites.intern_many(hashes)
        self.sites.release_many(old_ids)
        column = np.frombuffer(self.site_ids, dtype=np.int32)
        column[slots] = new_ids
        del column  # a live view would stop the column from growing
        return len(slots)

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
        self.rec[base + PLACE] = NO_PLACE  # its entry is stale before the bucket looks
        self.buckets.pull(bucket, slot)
        self.sites.release(self.site_ids[slot])
        self.slots.remove(slot)

    # -- the bulk path (load and verification walks) ------------------------------

    def add_many(
        self,
        keys: Sequence[bytes],
        key_hashes: npt.NDArray[np.uint64],
        class_ids: npt.NDArray[np.int32],
        due_at: npt.NDArray[np.int64],
        versions: npt.NDArray[np.int64],
        now_ms: int,
    ) -> npt.NDArray[np.int32]:
        """Hold rows whose keys are distinct and not held; returns their slots."""
        self.tallies.now_minute = now_ms // MINUTE_MS
        count = len(keys)
        if count == 0:
            return np.empty(0, dtype=np.int32)
        slots = self.slots.add_many(key_hashes, keys)
        site_ids = self.sites.intern_many(self._site_hashes(keys, class_ids))
        grow = self.slots.slots - len(self.site_ids)
        if grow > 0:
            self.site_ids.frombytes(bytes(4 * grow))
        column = np.frombuffer(self.site_ids, dtype=np.int32)
        column[slots] = site_ids
        del column  # a live view would stop the column from growing
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

    def _site_hashes(
        self, keys: Sequence[bytes], class_ids: npt.NDArray[np.int32]
    ) -> npt.NDArray[np.uint64]:
        """Each key's site hash under its class's route's pattern: one C call."""
        patterns = self.site_patterns
        if not patterns:
            return key_site_hashes(keys)
        table = (b"", *patterns.values())
        index = {pattern: i for i, pattern in enumerate(table)}
        of_class = np.array(
            [index[patterns.get(self.classes.get(c).route, b"")] for c in range(len(self.classes))],
            dtype=np.int32,
        )
        return key_site_hashes(keys, table, of_class.take(class_ids))

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

    def site_of(self, slot: int) -> int:
        """The row's site id (keeper.sites)."""
        return self.site_ids[slot]

    def host_site_hashes(self, slots: npt.NDArray[np.int32]) -> npt.NDArray[np.uint64]:
        """The site hash of each slot's key's host, whatever its route's pattern: what a
        cluster that owns keys by site places it by (keeper.ownership)."""
        if not self.site_patterns:
            return self.site_hashes_of(slots)
        return key_site_hashes(self.slots.keys(slots))

    def site_pattern_of(self, slot: int) -> bytes:
        """The site pattern the row's site was taken under (b"": its host's)."""
        patterns = self.site_patterns
        return patterns.get(self.classes.get(self.class_of(slot)).route, b"") if patterns else b""

    def site_hashes_of(self, slots: npt.NDArray[np.int32]) -> npt.NDArray[np.uint64]:
        """The site hash of each slot's row (NO_SITE for a key with no host)."""
        ids = np.frombuffer(self.site_ids, dtype=np.int32).take(slots)
        hashes: npt.NDArray[np.uint64] = self.sites.hashes().take(ids)
        return hashes

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

    def best(
        self,
        k: int,
        now_ms: int,
        blocked: BlockedMask | None = None,
        expect_blocked: int = 0,
        allowances: Allowances | None = None,
        slack: int = 1,
        block_ends: BlockEnds | None = None,
    ) -> Selection:
        """The best k claimable rows (due, class not paused, not blocked, within their
        sites' allowances plus `slack`), best first; `expect_blocked` sizes the read's
        margin only; `block_ends` marks blocked rows to pass over (keeper/select.py)."""
        return select_best(self, k, now_ms, blocked, expect_blocked, allowances, slack, block_ends)

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
                slots = self.buckets.live_slots(bucket)
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
            now_ms = self.tallies.now_minute * MINUTE_MS
            self.upsert(b"", self.hash_of(slot), target, due, self.version_of(slot), now_ms)
            moved += 1
        return moved

    def class_sizes(self) -> npt.NDArray[np.int64]:
        """Rows held per class id."""
        sizes = [self.tallies.class_total(c) for c in range(len(self.classes))]
        return np.array(sizes, dtype=np.int64)

    def fit(self) -> None:
        """Drop the spare room a load left in the key arena and the site column."""
        self.slots.fit()
        self.site_ids = array("i", self.site_ids)

    def nbytes(self) -> int:
        """Bytes in the queue's own buffers (allocated lengths), keys included."""
        return (
            self.slots.nbytes()
            + len(self.site_ids) * 4
            + self.sites.nbytes()
            + self.buckets.nbytes()
            + self.tallies.nbytes()
            + self.skips.nbytes()
        )
