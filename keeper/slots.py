"""Held rows' slots: key bytes in one arena and a 32-byte record per slot, found by hash.

A row is held as a slot number that every per-row structure is indexed by. A
slot's record is four unsigned 64-bit words in one `array('Q')`: the key's
hash, the due time, the version, and its place (bucket << 32 | index in the
bucket). Keeping them side by side makes an event touch one cache line
of records instead of four columns; scalar reads of `array` are several times
cheaper than numpy scalars, and numpy views of the same buffer serve the bulk
paths. Key bytes sit in one bytearray arena (a 32-bit offset and a 16-bit
length per slot), not as a Python object per key: a node holds at most 4 GiB of
key bytes, some 50 million keys of the usual length.

Slots are found through an open-addressing index over the 64-bit key hash
(linear probing, backward-shift deletion). The hash is the key's identity, as
it is for the lease table: the odds of two of a million keys sharing one are
about 3 in 100 million. Walks compare key bytes, and count a collision if one
ever shows up.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper._native import SlotIndex

FIELDS = 4
HASH, DUE, VERSION, PLACE = 0, 1, 2, 3
POSITION_MASK = 0xFFFFFFFF
NO_PLACE = (1 << 64) - 1  # a free slot's place: no bucket entry is ever live for it
MAX_LOAD = 0.6  # index occupancy that triggers doubling
MIN_GARBAGE_TO_COMPACT = 1 << 20  # arena bytes freed by deletes before a compaction is worth it
ABSENT = -1
MAX_ARENA_BYTES = 1 << 32  # every offset fits the 32-bit column
_ZERO_RECORD = array("Q", [0] * FIELDS)
# The record as a numpy item: gathering whole records with np.take is one fast pass.
RECORD = np.dtype([("hash", "<u8"), ("due", "<i8"), ("version", "<i8"), ("place", "<i8")])


class KeyArenaFull(Exception):
    """The held keys' bytes would pass MAX_ARENA_BYTES."""


class SlotTableStatistics(msgspec.Struct, frozen=True, kw_only=True):
    keys: int
    slots: int  # slot numbers ever handed out (live + free)
    index_capacity: int
    arena_bytes: int
    arena_garbage_bytes: int
    compactions: int
    index_grows: int


class SlotTable:
    def __init__(self, index_capacity: int = 1024) -> None:
        capacity = 1 << max(4, (index_capacity - 1).bit_length())
        self.rec: array[int] = array("Q")
        self.arena = bytearray()
        self.offsets: array[int] = array("I")
        self.lengths: array[int] = array("H")
        # The index grows in place (never replaced), so the C view of it and the
        # records is made once.
        self._table: array[int] = array("i", [-1]) * capacity
        self._mask = capacity - 1
        self.index = SlotIndex(self.rec, self._table)
        self._free: array[int] = array("i")
        self._live = 0
        self._garbage = 0
        self._compactions = 0
        self._grows = 0

    def __len__(self) -> int:
        return self._live

    @property
    def slots(self) -> int:
        return len(self.offsets)

    # -- scalar path ---------------------------------------------------------------

    def find(self, key_hash: int) -> int:
        table = self._table
        rec = self.rec
        mask = self._mask
        i = key_hash & mask
        while True:
            slot = table[i]
            if slot < 0:
                return ABSENT
            if rec[slot * FIELDS] == key_hash:
                return slot
            i = (i + 1) & mask

    def add(self, key_hash: int, key: bytes) -> int:
        """Hold a key whose hash the caller found ABSENT; returns its slot."""
        if self._live + 1 > MAX_LOAD * (self._mask + 1):
            self._grow()
        self._make_room(len(key))
        offset = len(self.arena)
        self.arena += key
        if self._free:
            slot = self._free.pop()
            self.offsets[slot] = offset
            self.lengths[slot] = len(key)
        else:
            slot = len(self.offsets)
            self.offsets.append(offset)
            self.lengths.append(len(key))
            self.rec.extend(_ZERO_RECORD)
        self.rec[slot * FIELDS] = key_hash
        table = self._table
        mask = self._mask
        i = key_hash & mask
        while table[i] >= 0:
            i = (i + 1) & mask
        table[i] = slot
        self._live += 1
        return slot

    def remove(self, slot: int) -> None:
        rec = self.rec
        key_hash = rec[slot * FIELDS]
        table = self._table
        mask = self._mask
        i = key_hash & mask
        while table[i] != slot:
            i = (i + 1) & mask
        # Backward shift: pull later entries of the probe run into the hole so a
        # lookup never stops early at it.
        j = i
        while True:
            j = (j + 1) & mask
            moved = table[j]
            if moved < 0:
                break
            home = rec[moved * FIELDS] & mask
            if (i < j and (home <= i or home > j)) or (i > j and home <= i and home > j):
                table[i] = moved
                i = j
        table[i] = -1
        self._garbage += self.lengths[slot]
        self.lengths[slot] = 0
        base = slot * FIELDS
        rec[base : base + FIELDS] = _ZERO_RECORD
        rec[base + PLACE] = NO_PLACE
        self._free.append(slot)
        self._live -= 1
        if self._garbage > MIN_GARBAGE_TO_COMPACT and self._garbage * 4 > len(self.arena):
            self.compact()

    def key(self, slot: int) -> bytes:
        offset = self.offsets[slot]
        return bytes(self.arena[offset : offset + self.lengths[slot]])

    def keys(self, slots: Sequence[int] | npt.NDArray[np.int32]) -> list[bytes]:
        offsets = self.offsets
        lengths = self.lengths
        # tolist: Python ints at once, where iterating an array makes a numpy scalar each.
        numbers = slots.tolist() if isinstance(slots, np.ndarray) else [int(s) for s in slots]
        with memoryview(self.arena) as view:
            return [bytes(view[offsets[s] : offsets[s] + lengths[s]]) for s in numbers]

    def key_slices(
        self, slots: npt.NDArray[np.int32]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Where the slots' keys sit in `arena`: (starts, lengths), copies. The ring's
        publish copies the bytes from there in one C pass, with no bytes object per key."""
        offsets = np.frombuffer(self.offsets, dtype=np.uint32)
        lengths = np.frombuffer(self.lengths, dtype=np.uint16)
        starts = offsets.take(slots).astype(np.int64)
        sizes = lengths.take(slots).astype(np.int64)
        del offsets, lengths  # a live view would make the next append raise BufferError
        return starts, sizes

    # -- numpy views (drop them before the table grows) ----------------------------

    def records(self) -> npt.NDArray[np.uint64]:
        return np.frombuffer(self.rec, dtype=np.uint64).reshape(-1, FIELDS)

    def items(self) -> npt.NDArray[np.void]:
        """The records as RECORD items (hash, due, version, place)."""
        return np.frombuffer(self.rec, dtype=RECORD)

    def hashes(self) -> npt.NDArray[np.uint64]:
        return self.records()[:, HASH]

    def dues(self) -> npt.NDArray[np.int64]:
        dues: npt.NDArray[np.int64] = self.records()[:, DUE].view(np.int64)
        return dues

    def set_places(
        self,
        slots: npt.NDArray[np.int32],
        bucket: npt.NDArray[np.integer] | int,
        positions: npt.NDArray[np.integer],
    ) -> None:
        place = (np.asarray(bucket, dtype=np.uint64) << np.uint64(32)) | positions.astype(np.uint64)
        self.records()[slots, PLACE] = place

    # -- bulk path -----------------------------------------------------------------

    def add_many(
        self, key_hashes: npt.NDArray[np.uint64], keys: Sequence[bytes]
    ) -> npt.NDArray[np.int32]:
        """Hold many keys the caller knows are absent (and distinct); returns their slots."""
        count = len(keys)
        if count == 0:
            return np.empty(0, dtype=np.int32)
        while (self._live + count) > MAX_LOAD * (self._mask + 1):
            self._grow()
        lengths = np.fromiter(map(len, keys), dtype=np.int64, count=count)
        self._make_room(int(lengths.sum()))
        reuse = min(len(self._free), count)
        fresh = count - reuse
        slots = np.empty(count, dtype=np.int32)
        if reuse:
            slots[:reuse] = np.frombuffer(self._free, dtype=np.int32)[-reuse:]
            del self._free[len(self._free) - reuse :]
        first_fresh = len(self.offsets)
        slots[reuse:] = np.arange(first_fresh, first_fresh + fresh, dtype=np.int32)
        self.offsets.frombytes(bytes(4 * fresh))
        self.lengths.frombytes(bytes(2 * fresh))
        self.rec.frombytes(bytes(8 * FIELDS * fresh))
        offsets = np.empty(count, dtype=np.int64)
        offsets[0] = 0
        np.cumsum(lengths[:-1], out=offsets[1:])
        offsets += len(self.arena)
        self.arena += b"".join(keys)
        np.frombuffer(self.offsets, dtype=np.uint32)[slots] = offsets
        np.frombuffer(self.lengths, dtype=np.uint16)[slots] = lengths
        self.records()[slots, HASH] = key_hashes
        self._index_many(key_hashes, slots)
        self._live += count
        return slots

    def find_many(self, key_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.int32]:
        """Slots of held keys by hash (ABSENT where not held): one C pass."""
        found = np.empty(len(key_hashes), dtype=np.int32)
        hashes = np.ascontiguousarray(key_hashes, dtype=np.uint64)
        self.index.find_many(hashes, found)
        return found

    def live_slots(self) -> npt.NDArray[np.int32]:
        table = np.frombuffer(self._table, dtype=np.int32)
        return np.sort(table[table >= 0])

    def _index_many(self, key_hashes: npt.NDArray[np.uint64], slots: npt.NDArray[np.int32]) -> None:
        hashes = np.ascontiguousarray(key_hashes, dtype=np.uint64)
        self.index.index_many(hashes, np.ascontiguousarray(slots, np.int32))

    def _grow(self) -> None:
        capacity = (self._mask + 1) * 2
        self._table[:] = array("i", [-1]) * capacity  # in place: the SlotIndex holds it
        self._mask = capacity - 1
        self._grows += 1
        live = self._live_slots_by_free_list()
        if live.size:
            self._index_many(self.hashes()[live], live)

    def _live_slots_by_free_list(self) -> npt.NDArray[np.int32]:
        free = np.zeros(len(self.offsets), dtype=np.bool_)
        if self._free:
            free[np.frombuffer(self._free, dtype=np.int32)] = True
        return np.flatnonzero(~free).astype(np.int32)

    def compact(self) -> None:
        """Rewrite the arena with only live keys, in their current order."""
        live = self._live_slots_by_free_list()
        offsets = np.frombuffer(self.offsets, dtype=np.uint32)
        lengths = np.frombuffer(self.lengths, dtype=np.uint16).astype(np.int64)
        order = live[np.argsort(offsets[live], kind="stable")]
        starts = offsets[order].astype(np.int64)
        sizes = lengths[order]
        # One slice a run of adjacent live keys, joined: the work follows the live keys'
        # runs, where a byte mask over the whole arena makes 8 bytes of temporaries for
        # every byte of it, and the keeper's loop waits for all of it.
        packed = b""
        if len(order):
            ends = starts + sizes
            breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
            run_starts = starts[np.concatenate(([0], breaks))].tolist()
            run_ends = ends[np.concatenate((breaks - 1, [len(order) - 1]))].tolist()
            with memoryview(self.arena) as view:
                packed = b"".join(map(view.__getitem__, map(slice, run_starts, run_ends)))
        new_offsets = np.zeros(len(order), dtype=np.int64)
        if len(order) > 1:
            np.cumsum(sizes[:-1], out=new_offsets[1:])
        offsets[order] = new_offsets
        del offsets, lengths
        self.arena = bytearray(packed)
        self._garbage = 0
        self._compactions += 1

    def _make_room(self, size: int) -> None:
        if len(self.arena) + size <= MAX_ARENA_BYTES:
            return
        if self._garbage:
            self.compact()
        if len(self.arena) + size > MAX_ARENA_BYTES:
            raise KeyArenaFull(
                f"the held keys would take {len(self.arena) + size:,} bytes, over the "
                f"{MAX_ARENA_BYTES:,} one node holds: spread the rows over more nodes"
            )

    def fit(self) -> None:
        """Drop the arena's spare room: a bytearray grows by an eighth at a time, and
        after a load the arena may not grow again for hours."""
        self.arena = bytearray(self.arena)

    def nbytes(self) -> int:
        """Bytes held by this table's buffers (allocated lengths, not capacity)."""
        return (
            len(self.arena)
            + len(self.offsets) * 4
            + len(self.lengths) * 2
            + len(self.rec) * 8
            + len(self._table) * 4
            + len(self._free) * 4
        )

    def statistics(self) -> SlotTableStatistics:
        return SlotTableStatistics(
            keys=self._live,
            slots=len(self.offsets),
            index_capacity=self._mask + 1,
            arena_bytes=len(self.arena),
            arena_garbage_bytes=self._garbage,
            compactions=self._compactions,
            index_grows=self._grows,
        )
