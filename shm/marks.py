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
- **Owners** (a cluster's node): the live node names the keeper's view holds and a
  view number, so a claimant or a renewal can tell whether this node still owns a key,
  and until when (monotonic clock) the keeper last confirmed this node is a member.
- **The keeper's round**: when (monotonic clock) the keeper last went round its loop, so
  the supervisor can tell a keeper that stopped (a SIGSTOP, a hang) from one at work.
  The keeper bumps the view number with a full fence before it scans the lease table
  for the leases it hands over; a claimant or renewer reads it with a full fence after
  its lease CAS. So either the scan sees the lease, or the claimant sees the new view
  and hands the key back: no lease on a lost key escapes the hand-over.
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
import numpy as np
import numpy.typing as npt

from shm._atomics import STRIPE_WORDS, STRIPES, Words
from shm.segment import HEADER_BYTES, Segment, align, stripe_sums

KIND = "write_marks"
DEFAULT_CAPACITY = 1 << 20  # 8 MiB: a bucket stays marked only until the keeper reads past it
CLASS_BYTES = 256 * 1024  # about ten thousand classes' routes
OWNERS_BYTES = 8 * 1024  # a few hundred node names

_CTRL = HEADER_BYTES // 8
_VIEWS = _CTRL  # 8 x (generation, delivered_before)
_VIEW_SLOTS = 8
_CLASS_SEQ, _CLASS_LENGTH, _CLASS_AT = _CTRL + 16, _CTRL + 17, _CTRL + 18
_OWNERS_SEQ, _OWNERS_LENGTH, _OWNERS_AT = _CTRL + 19, _CTRL + 20, _CTRL + 21
_VIEW_NUMBER, _CONFIRMED_UNTIL = _CTRL + 22, _CTRL + 23
_LEASE_CEILING, _LEASE_ASKED = _CTRL + 24, _CTRL + 25
_KEEPER_HEARD = _CTRL + 26
_STRIPES = _CTRL + 27
_S_STAMPED, _S_ANSWERED, _S_READ = 0, 1, 2
_CTRL_WORDS = 27 + STRIPES * STRIPE_WORDS

_class_list = msgspec.msgpack.Decoder(list[tuple[str, bool]])


class OwnersView(msgspec.Struct, frozen=True, array_like=True):
    number: int  # the view number it was written under
    nodes: tuple[str, ...]  # the live node names, sorted (empty: this node is not live)


_owners = msgspec.msgpack.Decoder(OwnersView)


def _offsets(capacity: int) -> tuple[int, int, int, int]:
    classes = align(HEADER_BYTES + _CTRL_WORDS * 8)
    owners = align(classes + CLASS_BYTES)
    marks = align(owners + OWNERS_BYTES)
    return classes, owners, marks, align(marks + capacity * 8)


def marks_size(capacity: int, _extra: int = 0) -> int:
    return _offsets(capacity)[3]


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
        self._classes_off, self._owners_off, marks_off, _ = _offsets(self.capacity)
        self._words = segment.register(Words(segment.mmap))
        self._marks = segment.register(Words(segment.mmap, marks_off, self.capacity * 8))
        self._stripe = _STRIPES + (os.getpid() % STRIPES) * STRIPE_WORDS
        self._classes: list[tuple[str, bool]] = []
        self._classes_seq = 0
        self._owners: OwnersView | None = None
        self._owners_seq = 0

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

    def write_owners(self, nodes: Sequence[str], now_ms: int) -> int:
        """Publish the keeper's view of the live nodes; returns its number. The number is
        raised last, by a fenced add, so a lease scan after this call sees every lease a
        claimant made before it read the old number (module note)."""
        words = self._words
        number = words.load(_VIEW_NUMBER) + 1
        payload = msgspec.msgpack.encode(OwnersView(number, tuple(sorted(nodes))))
        if len(payload) > OWNERS_BYTES:
            raise ValueError(f"{len(nodes)} node names do not fit {OWNERS_BYTES} bytes")
        seq = words.load(_OWNERS_SEQ) + 1 or 1
        words.begin_write(_OWNERS_SEQ, 0)
        self._segment.mmap[self._owners_off : self._owners_off + len(payload)] = payload
        words.store(_OWNERS_LENGTH, len(payload))
        words.store(_OWNERS_AT, now_ms)
        words.store(_OWNERS_SEQ, seq)
        return int(words.fetch_add(_VIEW_NUMBER, 1)) + 1

    def confirm_until(self, monotonic_ms: int) -> None:
        """This node may grant and renew until then (CLOCK_MONOTONIC, shared by every
        process of the machine), unless the keeper confirms its membership again."""
        self._words.store(_CONFIRMED_UNTIL, monotonic_ms)

    def hear_keeper(self, monotonic_ms: int) -> None:
        """The keeper is going round its loop now (CLOCK_MONOTONIC)."""
        self._words.store(_KEEPER_HEARD, monotonic_ms)

    def raise_lease_ceiling(self, wall_ms: int) -> None:
        """No lease this node grants or renews may end after `wall_ms` (epoch ms). The
        keeper stores it only once the node's row in the database carries it, so the
        others can wait out a node that died silent by its published ceiling."""
        self._words.store(_LEASE_CEILING, max(wall_ms, self.lease_ceiling()))

    def take_lease_asked(self) -> int:
        """The longest lease (ms) asked for since the last take, reset to 0."""
        words = self._words
        while True:
            asked = int(words.load(_LEASE_ASKED))
            if asked == 0 or words.cas(_LEASE_ASKED, asked, 0):
                return asked

    # ---------------------------------------------------------------- claimants

    def confirmed_until(self) -> int:
        return int(self._words.load(_CONFIRMED_UNTIL))

    def lease_ceiling(self) -> int:
        return int(self._words.load(_LEASE_CEILING))

    def keeper_heard_at(self) -> int:
        """When the keeper last went round its loop (CLOCK_MONOTONIC ms; 0: never)."""
        return int(self._words.load(_KEEPER_HEARD))

    def note_lease_asked(self, lease_ms: int) -> None:
        """Say a claim or renewal asked for a lease this long: the keeper keeps the
        published ceiling that far ahead."""
        words = self._words
        seen = int(words.load(_LEASE_ASKED))
        while lease_ms > seen and not words.cas(_LEASE_ASKED, seen, lease_ms):
            seen = int(words.load(_LEASE_ASKED))

    def owners(self) -> OwnersView | None:
        """The keeper's view as of a fenced read of its number (after a lease CAS); None
        when it has published none."""
        number = int(self._words.fetch_add(_VIEW_NUMBER, 0))
        if number == 0:
            return None
        cached = self._owners
        if cached is not None and cached.number >= number:
            return cached
        # A writer that died mid-rewrite leaves the sequence at 0: give up, owning nothing.
        for _ in range(10_000):
            got = self._words.seqlock_read(
                _OWNERS_SEQ, _OWNERS_LENGTH, _OWNERS_AT, self._owners_off, OWNERS_BYTES
            )
            if got is None:
                continue  # being rewritten: the writer is between two stores
            try:
                view = _owners.decode(got[2])
            except msgspec.DecodeError:
                return None
            # Written before its number was raised: never older than the number read.
            if view.number >= number:
                self._owners = view
                return view
        return None

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

    def unwritten_mask(
        self, key_hashes: npt.NDArray[np.uint64], view: int
    ) -> npt.NDArray[np.bool_]:
        """`unwritten_since` for each key, in one call."""
        out = np.zeros(key_hashes.shape[0], dtype=np.bool_)
        if view > 0:
            self._marks.below(
                np.ascontiguousarray(key_hashes, dtype=np.uint64), self._mask, view, out
            )
        return out

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
