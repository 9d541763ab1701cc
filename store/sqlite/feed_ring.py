"""The feed ring: a subscription's newest log entries, handed over in shared memory.

A poll through SQLite is a read transaction, and under a writer running flat out
one read can take milliseconds: SQLite's reader backs off with growing sleeps
while a checkpoint or a commit moves the WAL's read marks (see store.sqlite.upkeep).
So each writer, having committed, also copies the transaction's log entries,
read back inside the transaction with the feed's own `POLL` statement (complete, which
has each changed row from its statements' RETURNING, reads only the entries and pairs
each with its key's row as the transaction left it: the record POLL would read), into
the ring of every subscribed consumer, and only then posts its semaphore. The
consumer takes entries from the ring while they continue its cursor exactly and
polls SQLite otherwise. The log stays the truth; the ring only saves a read.

One ring per subscription, created by the consumer's process (the segment's
owner) under its semaphore's name plus `.feed`, before writers can learn that
name; writers attach when they refresh their list of consumers. Entry `seq`
lives in slot `seq % slots`, so slots are never shared by two live entries
unless the consumer is a whole lap behind, when it polls SQLite anyway.

A slot is a seqlock (`Words.seqlock_read`): word 0 is the entry's seq (0 while
a writer fills it, EMPTY before the first), word 1 the payload's length, word 2
the stamp of the log entry before it. A writer takes a slot by compare-and-swap
of its seq word to 0, so two writers never fill one slot at once; a slot left
at 0 by a writer killed mid-copy is skipped for good (`busy`), costing one
SQLite poll a lap. An entry is taken only when its seq is the one after the
cursor and its previous stamp is the cursor's stamp: a ring left by another
database at the same path, or by a log that was rolled back, never continues a
cursor.

An entry the writer cannot hand over (not a row, too large for a slot, a busy
slot, a transaction of more than a quarter of the ring) bumps the ring's
`missed` word before the writer posts. A consumer that finds `missed` moved
polls SQLite until it has caught up with the log's head, so an entry that is
not in the ring is never waited for.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import msgspec
import numpy as np

from shm._atomics import Words
from shm.segment import HEADER_BYTES, Segment, SegmentError, align, remove
from store.rows import LogRecord as LogRecord  # the records it carries (re-exported)
from store.schema import KIND_ROW

KIND = "feed_ring"
SLOT_BYTES = 512
DEFAULT_SLOTS = 16_384  # 8 MiB: most of a second of a writer running flat out
# The most log records one commit hands over (a writer reads back one more to tell);
# a larger commit only bumps `missed`. A ring of fewer slots takes at most a quarter.
HANDOFF_LIMIT = DEFAULT_SLOTS // 4
EMPTY = (1 << 64) - 1  # a slot's seq word before its first entry

_CTRL = HEADER_BYTES // 8
_MISSED = _CTRL + 0  # its own cache line: read by the consumer at every poll
_PUBLISHED = _CTRL + 8
_TOO_LARGE = _CTRL + 9
_BUSY = _CTRL + 10
_CTRL_WORDS = 16
_SLOT_WORDS = SLOT_BYTES // 8
_SEQ, _LENGTH, _PREV = 0, 1, 2
_DATA = 3 * 8  # payload offset within a slot, bytes
PAYLOAD_BYTES = SLOT_BYTES - _DATA
_U64 = (1 << 64) - 1


def ring_name(wake_name: str) -> str:
    """The ring's segment name beside its subscription's semaphore."""
    return f"{wake_name}.feed"


def _slots_offset() -> int:
    return align(HEADER_BYTES + _CTRL_WORDS * 8)


def ring_size(slots: int, _extra: int = 0) -> int:
    return _slots_offset() + slots * SLOT_BYTES


class FeedRingStatistics(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    slots: int
    published: int  # entries handed over, by every writer
    missed: int  # writer transactions with an entry not handed over
    too_large: int  # entries over a slot's payload
    busy: int  # entries whose slot another writer held


class FeedRing:
    """Use `create` (the consumer) or `attach` (a writer)."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.name = segment.name
        self.slots = segment.capacity
        self._words = segment.register(Words(segment.mmap))
        self._first = _slots_offset() // 8

    @classmethod
    def create(cls, name: str, slots: int = DEFAULT_SLOTS) -> FeedRing:
        if slots < 4:
            raise ValueError(f"a feed ring needs at least 4 slots, got {slots}")
        segment = Segment.create(name, KIND, ring_size(slots), slots, 0, SLOT_BYTES)
        words = np.frombuffer(segment.mmap, dtype="<u8", offset=_slots_offset())
        words.reshape(slots, _SLOT_WORDS)[:, _SEQ] = EMPTY
        del words  # no export may outlive the mapping
        return cls(segment)

    @classmethod
    def attach(cls, name: str) -> FeedRing:
        return cls(Segment.attach(name, KIND, SLOT_BYTES, ring_size))

    # -- the writers' side ---------------------------------------------------------------

    def put(self, seq: int, prev_stamp: int, payload: bytes) -> bool:
        """Copy entry `seq` into its slot; False (counted) when it is too large or the slot
        is held by another writer. The caller then calls `miss()` before it posts."""
        return self.put_many([(seq, prev_stamp, payload)]) == 1

    def put_many(self, entries: Sequence[tuple[int, int, bytes]]) -> int:
        """`put` each (seq, prev_stamp, payload) in turn; how many went in. One call per
        commit: the per-entry work is a few atomics, less than a method call's own cost."""
        words, first, slots = self._words, self._first, self.slots
        mapped = self._segment.mmap
        written = 0
        for seq, prev_stamp, payload in entries:
            size = len(payload)
            if size > PAYLOAD_BYTES:
                words.fetch_add(_TOO_LARGE, 1)
                continue
            base = first + (seq % slots) * _SLOT_WORDS
            current = words.load(base + _SEQ)
            if current == 0 or not words.cas(base + _SEQ, current, 0):
                words.fetch_add(_BUSY, 1)
                continue
            start = base * 8 + _DATA
            mapped[start : start + size] = payload
            words.store(base + _LENGTH, size)
            words.store(base + _PREV, prev_stamp & _U64)
            words.store(base + _SEQ, seq)
            written += 1
        return written

    def published(self, entries: int) -> None:
        self._words.fetch_add(_PUBLISHED, entries)

    def miss(self) -> None:
        """Say that an entry of the last commit is not in the ring: consumers poll SQLite."""
        self._words.fetch_add(_MISSED, 1)

    # -- the consumer's side -------------------------------------------------------------

    def missed(self) -> int:
        return int(self._words.load(_MISSED))

    def ready(self, seq: int, prev_stamp: int) -> bool:
        """Whether entry `seq` seems to be in its slot after `prev_stamp`: two loads, a
        hint for waiting (`get` reads the entry whole or not at all)."""
        base = self._first + (seq % self.slots) * _SLOT_WORDS
        words = self._words
        return bool(
            words.load(base + _SEQ) == seq and words.load(base + _PREV) == prev_stamp & _U64
        )

    def get(self, seq: int, prev_stamp: int) -> bytes | None:
        """Entry `seq`'s payload if its slot holds it, untorn, right after `prev_stamp`."""
        base = self._first + (seq % self.slots) * _SLOT_WORDS
        got = self._words.seqlock_read(
            base + _SEQ, base + _LENGTH, base + _PREV, base * 8 + _DATA, PAYLOAD_BYTES
        )
        if got is None or got[0] != seq or got[1] != prev_stamp & _U64:
            return None
        return got[2]

    def get_run(self, seq: int, limit: int) -> tuple[list[int], list[bytes]]:
        """Up to `limit` entries from `seq` that their slots hold whole, in one call: each
        one's previous stamp and its payload. The caller checks that the stamps chain."""
        return self._words.seqlock_run(self._first, _SLOT_WORDS, self.slots, seq, limit,
                                       PAYLOAD_BYTES)  # fmt: skip

    def statistics(self) -> FeedRingStatistics:
        words = self._words
        return FeedRingStatistics(
            name=self.name,
            slots=self.slots,
            published=int(words.load(_PUBLISHED)),
            missed=int(words.load(_MISSED)),
            too_large=int(words.load(_TOO_LARGE)),
            busy=int(words.load(_BUSY)),
        )

    def close(self) -> None:
        self._segment.close()

    def unlink(self) -> None:
        self._segment.unlink()


def create_ring(wake_name: str) -> FeedRing | None:
    """The consumer's ring, or None where shared memory is unavailable (SQLite polls only)."""
    with contextlib.suppress(SegmentError, OSError):
        return FeedRing.create(ring_name(wake_name))
    return None


def remove_ring(wake_name: str) -> None:
    """Unlink the ring of a subscription that is gone (its consumer dropped or dead)."""
    remove(ring_name(wake_name))


# A log record (store.rows.LogRecord) is a msgpack array in the ring.
_decode_record = msgspec.msgpack.Decoder(LogRecord).decode
_encode_record = msgspec.msgpack.Encoder().encode


def decode_record(payload: bytes) -> LogRecord | None:
    """A record from a slot; None for one that does not decode (a foreign ring)."""
    try:
        return _decode_record(payload)
    except msgspec.DecodeError:
        return None


class FeedHandoff:
    """A writer's side of every consumer's ring. Thread-safe: `refresh` swaps the set of
    rings that `hand_over` writes to in one assignment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, FeedRing] = {}
        self.rings: tuple[FeedRing, ...] = ()
        self.failed = 0  # rings that could not be attached or were closed under a writer

    def refresh(self, wake_names: Sequence[str]) -> None:
        """Write to exactly these consumers' rings from now on."""
        with self._lock:
            wanted = {ring_name(name) for name in wake_names}
            for name in [n for n in self._open if n not in wanted]:
                self._open.pop(name).close()
            for name in wanted.difference(self._open):
                try:
                    self._open[name] = FeedRing.attach(name)
                except (SegmentError, OSError):
                    self.failed += 1  # not made (polls only) or gone: the next refresh
            self.rings = tuple(self._open.values())

    def hand_over(self, records: Sequence[LogRecord], prev_stamp: int, *, whole: bool) -> None:
        """Copy one committed transaction's log records, in seq order, into every ring.

        `prev_stamp`: the stamp of the entry before the first (0 for an empty log);
        `whole`: False when `records` are only the first of the transaction's."""
        rings = self.rings
        if not rings:
            return
        complete = whole and len(records) <= min(ring.slots for ring in rings) // 4
        encoded: list[tuple[int, int, bytes]] = []
        if complete:
            for record in records:
                if record[1] == KIND_ROW:
                    encoded.append((record[0], prev_stamp, _encode_record(record)))
                else:
                    complete = False  # routes and settings need their own reads
                prev_stamp = record[3]
        for ring in rings:
            try:
                written = ring.put_many(encoded)
                ring.published(written)
                if not complete or written < len(encoded):
                    ring.miss()
            except Exception:
                # The commit stands whatever happens here: the writer's caller must not see
                # an error for it. A ring closed by a refresh on another thread (dropped) is
                # the expected case; for any other, say missed so the consumer reads SQLite.
                self.failed += 1
                with contextlib.suppress(Exception):
                    ring.miss()

    def close(self) -> None:
        with self._lock:
            for ring in self._open.values():
                ring.close()
            self._open.clear()
            self.rings = ()
