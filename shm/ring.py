"""The ready ring: the best few thousand claimable keys, republished every second.

One writer (the keeper on worker 0) and any number of claimants in any process,
with no mutex. The ring is a latch double buffer:

- The writer fills the inactive buffer: it first zeroes that buffer's
  generation word (with a fence, so no entry store can overtake it), writes the
  entries and their keys into the buffer's key arena, stores the new generation,
  resets the buffer's cursor to (generation << 32 | 0), and flips `active` with
  a release store.
- A claimant reads `active`, fetch-adds n on that buffer's cursor, copies the
  entries it reserved, then checks the buffer's generation. The old cursor word
  names the generation the reservation was made in, so a claimant that raced a
  republish knows whether its entries are the live generation's (kept: they are
  its alone) or a superseded one's (dropped: that set is gone anyway). A copy
  during which the generation changed is torn and discarded, never acted on.

The writer has two ways in: `publish` takes a list of key bytes (written with
numpy, control words through `Words`), `publish_slices` takes keys as slices of
one buffer and runs the same steps in one C call (`Ring.publish`), copying the
key bytes straight from that buffer. The keeper uses the second: its keys already
sit in its slot arena. Both leave the same bytes in the segment.

So every entry of a generation is taken by at most one claimant, and, while the
generation stays live, every entry is taken exactly once. A drained buffer is
detected before the fetch-add, so idle polling never runs the cursor up.

Entries are 40 bytes (`ENTRY`: due time, key hash, key offset and length in the
arena, class id, the row's effective cadence, the key's site hash, 0 for none);
keys are at most 2,048 bytes. A
batch larger than the ring (entries or arena) is cut to the prefix that fits:
publishing is in priority order, so the prefix is the best part, and the cut is
counted in `statistics().truncated`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from shm._atomics import RING_LAYOUT, STRIPE_WORDS, Ring, Words
from shm.segment import HEADER_BYTES, Segment, align, stripe_sums

if TYPE_CHECKING:
    from typing_extensions import Buffer

KIND = "ready_ring"
KEY_MAX = RING_LAYOUT["key_max"]
MAX_CAPACITY = 1 << 24
ENTRY = np.dtype(
    {
        "names": [
            "due_at",
            "key_hash",
            "key_off",
            "key_len",
            "class_id",
            "cadence_s",
            "site_hash",
        ],
        "formats": ["<i8", "<u8", "<u4", "<u4", "<i4", "<u4", "<u8"],
        "offsets": [
            RING_LAYOUT["entry_due_at"],
            RING_LAYOUT["entry_key_hash"],
            RING_LAYOUT["entry_key_off"],
            RING_LAYOUT["entry_key_len"],
            RING_LAYOUT["entry_class_id"],
            RING_LAYOUT["entry_cadence_s"],
            RING_LAYOUT["entry_site_hash"],
        ],
        "itemsize": RING_LAYOUT["entry_size"],
    }
)

_CTRL = HEADER_BYTES // 8  # control block starts right after the header, in words
_ACTIVE = _CTRL + RING_LAYOUT["active"]
_GENERATION = _CTRL + RING_LAYOUT["generation"]
_PUBLISHED = _CTRL + RING_LAYOUT["published"]
_PUBLISHES = _CTRL + RING_LAYOUT["publishes"]
_TRUNCATED = _CTRL + RING_LAYOUT["truncated"]
_STRIPES = _CTRL + RING_LAYOUT["stripes"]


def _buf(b: int, field: str) -> int:
    return _CTRL + RING_LAYOUT[f"buf{b}"] + RING_LAYOUT[f"buf_{field}"]


def _cursor(b: int) -> int:
    return _CTRL + RING_LAYOUT[f"cursor{b}"]


def _offsets(capacity: int, arena_bytes: int) -> tuple[int, int, int]:
    entries = align(HEADER_BYTES + RING_LAYOUT["ctrl_words"] * 8)
    arena = align(entries + 2 * capacity * ENTRY.itemsize)
    return entries, arena, align(arena + 2 * arena_bytes)


def _check_columns(
    n_in: int,
    due_at: np.ndarray,
    class_id: np.ndarray,
    key_hash: np.ndarray,
    cadence_s: np.ndarray | None,
    site_hash: np.ndarray | None,
    lengths: np.ndarray | None = None,
) -> None:
    """Every column of a publish names the same number of entries as its keys."""
    sized = len(due_at) == len(class_id) == len(key_hash) == n_in
    if not sized or (lengths is not None and len(lengths) != n_in):
        named = "" if lengths is None else f"{len(lengths)} lengths, "
        raise ValueError(
            f"publish: {n_in} keys but {named}{len(due_at)} due times, "
            f"{len(class_id)} class ids and {len(key_hash)} hashes"
        )
    if cadence_s is not None and len(cadence_s) != n_in:
        raise ValueError(f"publish: {n_in} keys but {len(cadence_s)} cadences")
    if site_hash is not None and len(site_hash) != n_in:
        raise ValueError(f"publish: {n_in} keys but {len(site_hash)} site hashes")


def ring_size(capacity: int, arena_bytes: int) -> int:
    return _offsets(capacity, arena_bytes)[2]


class ReadyEntry(msgspec.Struct, frozen=True):
    key: bytes
    due_at: int
    class_id: int
    key_hash: int
    # The row's effective cadence when it was published (a grant's hold cap), so a
    # claimant need not read the row before granting; 0 when the publisher did not say.
    cadence_s: int = 0
    # The key's site (shm.keys.site_hash), so a claimant can take the site's permit
    # before the lease; 0 when the key has no site or the publisher did not say.
    site_hash: int = 0


class ClaimedEntries:
    """A claim's entries as arrays (`claim_batch`): `entries` in the ring's `ENTRY` layout,
    their keys end to end in one bytes (an entry's key_off names its key there), so a
    claim makes a str only for the keys it answers (`keys_of`)."""

    __slots__ = ("_keys", "_raw", "_ring", "entries")

    def __init__(self, ring: Ring, raw: bytes, keys: bytes) -> None:
        self._ring, self._raw, self._keys = ring, raw, keys
        self.entries: np.ndarray = np.frombuffer(raw, dtype=ENTRY)

    def __len__(self) -> int:
        return int(self.entries.shape[0])

    def keys_of(self, indexes: npt.NDArray[np.int64]) -> list[str]:
        """The keys of the entries at `indexes`, decoded."""
        keys: list[str] = self._ring.keys_of(
            self._raw, self._keys, np.ascontiguousarray(indexes, dtype=np.int64)
        )
        return keys

    def key_bytes(self, index: int) -> bytes:
        entry = self.entries[index]
        offset = int(entry["key_off"])
        return self._keys[offset : offset + int(entry["key_len"])]


class RingStatistics(msgspec.Struct, frozen=True):
    capacity: int
    arena_bytes: int
    generation: int
    published_at: int
    last_count: int
    published: int
    publishes: int
    truncated: int
    claimed: int
    claim_calls: int
    empty_claims: int
    remaining: int
    torn_retries: int
    stale_reservations: int


class ReadyRing:
    """Use `create` (the owner) or `attach` (any spawned process)."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.name = segment.name
        self.capacity = segment.capacity
        self.arena_bytes = segment.extra_size
        self._entries_off, self._arena_off, _ = _offsets(self.capacity, self.arena_bytes)
        self._words = segment.register(Words(segment.mmap))
        self._ring = segment.register(
            Ring(
                segment.mmap,
                HEADER_BYTES,
                self._entries_off,
                self._arena_off,
                self.capacity,
                self.arena_bytes,
                ReadyEntry,
            )
        )

    @classmethod
    def create(cls, name: str, capacity: int = 8192, arena_bytes: int = 8192 * 256) -> ReadyRing:
        # The cursor keeps its index in 32 bits; claimants can run it past the count by
        # at most one batch each, so capacity stays far below 2**32.
        if not 1 <= capacity <= MAX_CAPACITY or not 1 <= arena_bytes < 2**32:
            raise ValueError(
                f"ring capacity must be in 1..{MAX_CAPACITY} and arena_bytes in 1..2**32-1"
            )
        segment = Segment.create(
            name, KIND, ring_size(capacity, arena_bytes), capacity, arena_bytes, ENTRY.itemsize
        )
        return cls(segment)

    @classmethod
    def attach(cls, name: str) -> ReadyRing:
        return cls(Segment.attach(name, KIND, ENTRY.itemsize, ring_size))

    # ------------------------------------------------------------------ writer

    def publish(
        self,
        keys: Sequence[bytes],
        due_at: np.ndarray,
        class_id: np.ndarray,
        key_hash: np.ndarray,
        now_ms: int,
        cadence_s: np.ndarray | None = None,
        site_hash: np.ndarray | None = None,
    ) -> int:
        """Replace the ring's contents with these entries; returns the new generation.

        Single writer. Entries past the ring's capacity or arena are cut off. Without
        `cadence_s` the entries say 0 (not known) and claimants read the row first;
        without `site_hash` they say 0 (no site).
        """
        n_in = len(keys)
        _check_columns(n_in, due_at, class_id, key_hash, cadence_s, site_hash)
        lengths = np.fromiter((len(k) for k in keys), dtype=np.int64, count=n_in)
        too_long = np.flatnonzero(lengths > KEY_MAX)
        if too_long.size:
            i = int(too_long[0])
            raise ValueError(f"publish: key {i} is {int(lengths[i])} bytes; at most {KEY_MAX}")
        ends = np.cumsum(lengths[: self.capacity])
        n = int(np.searchsorted(ends, self.arena_bytes, side="right"))
        words = self._words
        mm = self._segment.mmap
        b = 1 - (words.load(_ACTIVE) & 1)
        words.begin_write(_buf(b, "gen"), 0)
        entries = np.ndarray(
            (n,),
            dtype=ENTRY,
            buffer=mm,
            offset=self._entries_off + b * self.capacity * ENTRY.itemsize,
        )
        entries["due_at"] = due_at[:n]
        entries["key_hash"] = key_hash[:n]
        entries["class_id"] = class_id[:n]
        entries["cadence_s"] = 0 if cadence_s is None else cadence_s[:n]
        entries["site_hash"] = 0 if site_hash is None else site_hash[:n]
        entries["key_len"] = lengths[:n]
        entries["key_off"] = ends[:n] - lengths[:n]
        del entries
        used = int(ends[n - 1]) if n else 0
        start = self._arena_off + b * self.arena_bytes
        mm[start : start + used] = b"".join(keys[:n])
        words.store(_buf(b, "count"), n)
        words.store(_buf(b, "published_at"), now_ms)
        words.store(_buf(b, "arena_used"), used)
        generation = words.load(_GENERATION) + 1
        words.store(_buf(b, "gen"), generation)
        words.store(_cursor(b), (generation & 0xFFFFFFFF) << 32)
        words.store(_ACTIVE, b)
        words.store(_GENERATION, generation)
        self._segment.set_generation(generation)
        words.fetch_add(_PUBLISHED, n)
        words.fetch_add(_PUBLISHES, 1)
        words.fetch_add(_TRUNCATED, n_in - n)
        return int(generation)

    def publish_slices(
        self,
        source: Buffer,
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.integer],
        due_at: np.ndarray,
        class_id: np.ndarray,
        key_hash: np.ndarray,
        now_ms: int,
        cadence_s: np.ndarray | None = None,
        site_hash: np.ndarray | None = None,
    ) -> int:
        """`publish`, for keys that are slices of one buffer: key i is
        `source[starts[i] : starts[i] + lengths[i]]`. One C call writes the same entries
        and key bytes as `publish` would, with no bytes object per key (the keeper's keys
        already sit in its slot arena). A slice outside `source` is refused, as is a key
        over KEY_MAX, before anything is written."""
        n_in = len(starts)
        _check_columns(n_in, due_at, class_id, key_hash, cadence_s, site_hash, lengths)
        generation, _ = self._ring.publish(
            source,
            np.ascontiguousarray(starts, dtype=np.int64),
            np.ascontiguousarray(lengths, dtype=np.int64),
            np.ascontiguousarray(due_at, dtype=np.int64),
            np.ascontiguousarray(class_id, dtype=np.int32),
            np.ascontiguousarray(key_hash, dtype=np.uint64),
            None if cadence_s is None else np.ascontiguousarray(cadence_s, dtype=np.uint32),
            None if site_hash is None else np.ascontiguousarray(site_hash, dtype=np.uint64),
            now_ms,
        )
        self._segment.set_generation(generation)
        return int(generation)

    # --------------------------------------------------------------- claimants

    def claim(self, n: int) -> list[ReadyEntry]:
        """Up to n entries, in published order, each taken by exactly one claimant."""
        entries: list[ReadyEntry] = self._ring.claim(n)
        return entries

    def claim_batch(self, n: int) -> ClaimedEntries:
        """`claim`, as arrays: no Python object per entry."""
        raw, keys = self._ring.claim_batch(n)
        return ClaimedEntries(self._ring, raw, keys)

    @property
    def generation(self) -> int:
        return int(self._words.load(_GENERATION))

    @property
    def published_at(self) -> int:
        return int(self._words.load(_buf(self._words.load(_ACTIVE) & 1, "published_at")))

    def remaining(self) -> int:
        return int(self._ring.remaining())

    def published_count(self) -> int:
        """Entries the live generation holds: what the last publish wrote, after any cut."""
        return int(self._words.load(_buf(self._words.load(_ACTIVE) & 1, "count")))

    def statistics(self) -> RingStatistics:
        words = self._words
        sums = stripe_sums(words, _STRIPES, STRIPE_WORDS)
        active = words.load(_ACTIVE) & 1
        return RingStatistics(
            capacity=self.capacity,
            arena_bytes=self.arena_bytes,
            generation=int(words.load(_GENERATION)),
            published_at=int(words.load(_buf(active, "published_at"))),
            last_count=int(words.load(_buf(active, "count"))),
            published=int(words.load(_PUBLISHED)),
            publishes=int(words.load(_PUBLISHES)),
            truncated=int(words.load(_TRUNCATED)),
            claimed=sums[RING_LAYOUT["s_claimed"]],
            claim_calls=sums[RING_LAYOUT["s_claim_calls"]],
            empty_claims=sums[RING_LAYOUT["s_empty"]],
            remaining=self.remaining(),
            torn_retries=sums[RING_LAYOUT["s_torn"]],
            stale_reservations=sums[RING_LAYOUT["s_stale"]],
        )

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Release the C views, then unmap. Idempotent; never raises BufferError."""
        self._segment.close()

    def unlink(self) -> None:
        self._segment.unlink()

    def __enter__(self) -> ReadyRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
