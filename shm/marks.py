"""Write marks: where in the change feed each key was last written through this node,
against how far the keeper's view had read when it published, so a claim can skip
re-reading rows nothing has touched.

A claim grants from the ring, then reads the granted rows to hand back any that a write
made stale since the publish (completed, rescheduled, deleted). Almost always nothing
did, and the read is most of a claim's cost in the database. This segment lets the
claimant tell:

- **Marks**: one word per bucket of key hashes (`hash & (capacity - 1)`), the feed
  position of the latest write through this node to any key of the bucket
  (`ScheduleStore.write_position`: SQLite's last log seq of the transaction,
  PostgreSQL's xid), raised by compare-and-swap so it never goes back. A writer stamps
  after its commit and before it answers or releases a lease, so a claim that starts
  after the write was answered, or that won a lease the completion released, sees it.
- **Views**: per ring generation (8 kept, tagged with their generation), the feed
  position below which every write had been applied to the keeper's view when that
  generation was selected (`Subscription.delivered_below`); 0 when the keeper cannot
  vouch (loading, resyncing, feed closed).
- **Classes**: the route and sitemap flag of each class id the ring's entries carry, so
  a claimant can answer a lease without its row. A keeper only appends ids
  (keeper.classes.ClassTable), so a reader's copy stays right until the list's sequence
  word moves (a new keeper numbers afresh); a seqlock guards the rewrite.

A granted entry whose bucket's mark is below its generation's view is answered from the
entry: the keeper's view of the key already held every write this node made to it.
Anything else (a mark as new as the view, a view of 0, a class the reader cannot name)
is read as before. A bucket shared with another key only costs a read. Writes made
elsewhere (another node, the CLI) stamp nothing here; a claim honours them from the
keeper's first publish after they reach its feed.

Positions are exact where times would not be: a commit that finished before a poll can
still be below PostgreSQL's horizon, or missing from SQLite's feed ring, when the poll
reads, and its position says so.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import msgspec

from shm._atomics import STRIPE_WORDS, STRIPES, Words
from shm.segment import HEADER_BYTES, Segment, align, stripe_sums

KIND = "write_marks"
DEFAULT_CAPACITY = 1 << 20  # 8 MiB: a bucket stays marked only until the keeper reads past it
CLASS_BYTES = 256 * 1024  # about ten thousand classes' routes

_CTRL = HEADER_BYTES // 8
_VIEWS = _CTRL  # 8 x (generation, delivered_before)
_VIEW_SLOTS = 8
_CLASS_SEQ, _CLASS_LENGTH, _CLASS_AT = _CTRL + 16, _CTRL + 17, _CTRL + 18
_STRIPES = _CTRL + 24
_S_STAMPED, _S_ANSWERED, _S_READ = 0, 1, 2
_CTRL_WORDS = 24 + STRIPES * STRIPE_WORDS

_class_list = msgspec.msgpack.Decoder(list[tuple[str, bool]])


def _offsets(capacity: int) -> tuple[int, int, int]:
    classes = align(HEADER_BYTES + _CTRL_WORDS * 8)
    marks = align(classes + CLASS_BYTES)
    return classes, marks, align(marks + capacity * 8)


def marks_size(capacity: int, _extra: int = 0) -> int:
    return _offsets(capacity)[2]


class WriteMarkStatistics(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int
    classes: int  # class names this handle holds (read from the keeper's list)
    stamped: int  # keys stamped by writers
    answered_from_ring: int  # granted keys answered without reading their rows
    read_after_grant: int  # granted keys whose rows were read


class WriteMarks:
    """Use `create` (the owner) or `attach` (any spawned process)."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.name = segment.name
        self.capacity = segment.capacity
        self._mask = self.capacity - 1
        self._classes_off, marks_off, _ = _offsets(self.capacity)
        self._words = segment.register(Words(segment.mmap))
        self._marks = segment.register(Words(segment.mmap, marks_off, self.capacity * 8))
        self._stripe = _STRIPES + (os.getpid() % STRIPES) * STRIPE_WORDS
        self._classes: list[tuple[str, bool]] = []
        self._classes_seq = 0

    @classmethod
    def create(cls, name: str, capacity: int = DEFAULT_CAPACITY) -> WriteMarks:
        if capacity < 1 or capacity & (capacity - 1):
            raise ValueError(f"write marks capacity must be a power of two, got {capacity}")
        return cls(Segment.create(name, KIND, marks_size(capacity), capacity, 0, 8))

    @classmethod
    def attach(cls, name: str) -> WriteMarks:
        return cls(Segment.attach(name, KIND, 8, marks_size))

    # ------------------------------------------------------------------ writers

    def stamp(self, hashes: Sequence[int], position: int) -> None:
        """Raise each key's bucket to `position` (never lower it: writers race)."""
        marks, mask = self._marks, self._mask
        for hashed in hashes:
            index = hashed & mask
            current = marks.load(index)
            while current < position and not marks.cas(index, current, position):
                current = marks.load(index)
        self._words.fetch_add(self._stripe + _S_STAMPED, len(hashes))

    # ------------------------------------------------------------------- keeper

    def set_view(self, generation: int, delivered_below: int) -> None:
        """How far the keeper's view had read for `generation`; before it is published."""
        base = _VIEWS + 2 * (generation % _VIEW_SLOTS)
        words = self._words
        words.begin_write(base, 0)
        words.store(base + 1, delivered_below)
        words.store(base, generation)

    def write_classes(self, classes: Sequence[tuple[str, bool]], now_ms: int) -> bool:
        """Name every class id (route, sitemap), in id order. False when they do not fit:
        then none are named (an older list may not match these ids), and claimants read
        the rows of every entry."""
        payload = msgspec.msgpack.encode(list(classes))
        fits = len(payload) <= CLASS_BYTES
        if not fits:
            payload = msgspec.msgpack.encode([])
        words = self._words
        seq = words.load(_CLASS_SEQ) + 1 or 1
        words.begin_write(_CLASS_SEQ, 0)
        self._segment.mmap[self._classes_off : self._classes_off + len(payload)] = payload
        words.store(_CLASS_LENGTH, len(payload))
        words.store(_CLASS_AT, now_ms)
        words.store(_CLASS_SEQ, seq)
        return fits

    # ---------------------------------------------------------------- claimants

    def view_of(self, generation: int) -> int:
        """The keeper's view of `generation`, or 0 when it did not vouch (or the slot has
        since been reused by a later generation)."""
        base = _VIEWS + 2 * (generation % _VIEW_SLOTS)
        words = self._words
        if words.load(base) != generation:
            return 0
        delivered_below = words.load(base + 1)
        return int(delivered_below) if words.load(base) == generation else 0

    def unwritten_since(self, key_hash: int, view: int) -> bool:
        """True when every write through this node to the key's bucket is below `view`
        (0 vouches for nothing)."""
        return view > 0 and self._marks.load(key_hash & self._mask) < view

    def refresh_classes(self) -> None:
        """Drop this reader's copy if the keeper has renamed classes since: a new keeper
        (worker 0 restarted) numbers its classes afresh. Called after taking entries, so
        a generation published after a rename is never named from the old copy."""
        if self._words.load(_CLASS_SEQ) != self._classes_seq:
            self._reload_classes()

    def class_of(self, class_id: int) -> tuple[str, bool] | None:
        """(route, sitemap) of a class id, or None when the keeper has not named it."""
        if class_id >= len(self._classes):
            self._reload_classes()
        return self._classes[class_id] if 0 <= class_id < len(self._classes) else None

    def _reload_classes(self) -> None:
        words = self._words
        got = words.seqlock_read(
            _CLASS_SEQ, _CLASS_LENGTH, _CLASS_AT, self._classes_off, CLASS_BYTES
        )
        if got is None:  # never written, or torn by a rewrite: name nothing meanwhile
            self._classes, self._classes_seq = [], 0
            return
        seq, _, payload = got
        if seq != self._classes_seq:
            try:
                self._classes = _class_list.decode(payload)
            except msgspec.DecodeError:
                self._classes, self._classes_seq = [], 0
                return
            self._classes_seq = seq

    def count_claimed(self, answered: int, read: int) -> None:
        words = self._words
        if answered:
            words.fetch_add(self._stripe + _S_ANSWERED, answered)
        if read:
            words.fetch_add(self._stripe + _S_READ, read)

    def statistics(self) -> WriteMarkStatistics:
        sums = stripe_sums(self._words, _STRIPES, 3)
        return WriteMarkStatistics(
            capacity=self.capacity,
            classes=len(self._classes),
            stamped=sums[_S_STAMPED],
            answered_from_ring=sums[_S_ANSWERED],
            read_after_grant=sums[_S_READ],
        )

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        self._segment.close()

    def unlink(self) -> None:
        self._segment.unlink()

    def __enter__(self) -> WriteMarks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
