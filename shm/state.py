"""The state buffer: the keeper's msgspec-encoded queue-state, readable by every worker.

One writer (the keeper, every 5 s), readers in any process, no mutex. A latch
double buffer, each half guarded by a sequence word (a seqlock):

- The writer picks the inactive half, zeroes its sequence word (then a fence,
  so the payload stores cannot overtake it), copies the payload, its length and
  its write time, stores the new sequence number with a release store and
  flips `active`.
- A reader reads `active`, then that half's sequence, length, time and payload
  (one C call), and re-reads the sequence after an acquire fence. A zero or
  changed sequence means the copy raced a rewrite of that half (the writer
  lapped the reader twice): the read is discarded and retried, never returned
  torn. A torn length can never make the copy run past the half.

A payload larger than the buffer is refused at `write` with a ValueError naming
the sizes; nothing is truncated. Readers get `written_at`, so they serve the
state's age (`StateSnapshot.age_ms`).
"""

from __future__ import annotations

import os

import msgspec

from shm._atomics import STRIPE_WORDS, STRIPES, Words
from shm.segment import HEADER_BYTES, Segment, align, stripe_sums

KIND = "state_buffer"

_CTRL = HEADER_BYTES // 8
_ACTIVE = _CTRL + 0
_HALF = (_CTRL + 8, _CTRL + 16)  # per half: seq, length, written_at (own cache line)
_SEQ, _LENGTH, _WRITTEN_AT = 0, 1, 2
_WRITER = _CTRL + 24  # last seq, writes, bytes written, refused (too large)
_LAST_SEQ, _WRITES, _BYTES, _REFUSED = _WRITER, _WRITER + 1, _WRITER + 2, _WRITER + 3
_STRIPES = _CTRL + 32
_S_READS, _S_TORN, _S_EMPTY = 0, 1, 2
_CTRL_WORDS = 32 + STRIPES * STRIPE_WORDS
_MAX_READ_ATTEMPTS = 100_000


def _data_offsets(capacity: int) -> tuple[int, int, int]:
    first = align(HEADER_BYTES + _CTRL_WORDS * 8)
    second = align(first + capacity)
    return first, second, align(second + capacity)


def buffer_size(capacity: int, _extra: int = 0) -> int:
    return _data_offsets(capacity)[2]


class StateSnapshot(msgspec.Struct, frozen=True):
    payload: bytes
    seq: int
    written_at: int

    def age_ms(self, now_ms: int) -> int:
        """How old the state is, for serving beside it."""
        return max(0, now_ms - self.written_at)


class StateBufferStatistics(msgspec.Struct, frozen=True):
    capacity: int
    seq: int
    written_at: int
    last_size: int
    writes: int
    bytes_written: int
    refused_too_large: int
    reads: int
    empty_reads: int
    torn_retries: int


class StateBuffer:
    """Use `create` (the owner) or `attach` (any spawned process)."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.name = segment.name
        self.capacity = segment.capacity
        first, second, _ = _data_offsets(self.capacity)
        self._data = (first, second)
        self._words = segment.register(Words(segment.mmap))
        self._stripe = _STRIPES + (os.getpid() % STRIPES) * STRIPE_WORDS

    @classmethod
    def create(cls, name: str, capacity: int = 1 << 20) -> StateBuffer:
        if capacity < 1:
            raise ValueError("state buffer capacity must be positive")
        return cls(Segment.create(name, KIND, buffer_size(capacity), capacity, 0, 1))

    @classmethod
    def attach(cls, name: str) -> StateBuffer:
        return cls(Segment.attach(name, KIND, 1, buffer_size))

    def write(self, payload: bytes, now_ms: int) -> int:
        """Publish a new state; returns its sequence number. Single writer."""
        words = self._words
        size = len(payload)
        if size > self.capacity:
            words.fetch_add(_REFUSED, 1)
            raise ValueError(
                f"state of {size} bytes does not fit state buffer {self.name} "
                f"({self.capacity} bytes); create it with a larger capacity"
            )
        half = 1 - (words.load(_ACTIVE) & 1)
        base = _HALF[half]
        seq = words.load(_LAST_SEQ) + 1
        words.begin_write(base + _SEQ, 0)
        start = self._data[half]
        self._segment.mmap[start : start + size] = payload
        words.store(base + _LENGTH, size)
        words.store(base + _WRITTEN_AT, now_ms)
        words.store(base + _SEQ, seq)
        words.store(_ACTIVE, half)
        words.store(_LAST_SEQ, seq)
        self._segment.set_generation(seq)
        words.fetch_add(_WRITES, 1)
        words.fetch_add(_BYTES, size)
        return int(seq)

    def read(self) -> StateSnapshot | None:
        """The latest state, never torn; None before the first write."""
        words = self._words
        words.fetch_add(self._stripe + _S_READS, 1)
        for _ in range(_MAX_READ_ATTEMPTS):
            half = words.load(_ACTIVE) & 1
            base = _HALF[half]
            got = words.seqlock_read(
                base + _SEQ, base + _LENGTH, base + _WRITTEN_AT, self._data[half], self.capacity
            )
            if got is not None:
                seq, written_at, payload = got
                return StateSnapshot(payload=payload, seq=seq, written_at=written_at)
            if words.load(_LAST_SEQ) == 0:
                words.fetch_add(self._stripe + _S_EMPTY, 1)
                return None
            words.fetch_add(self._stripe + _S_TORN, 1)
        raise RuntimeError(f"state buffer {self.name}: no consistent read in {_MAX_READ_ATTEMPTS}")

    def statistics(self) -> StateBufferStatistics:
        words = self._words
        sums = stripe_sums(words, _STRIPES, 3)
        half = _HALF[words.load(_ACTIVE) & 1]
        return StateBufferStatistics(
            capacity=self.capacity,
            seq=int(words.load(_LAST_SEQ)),
            written_at=int(words.load(half + _WRITTEN_AT)),
            last_size=int(words.load(half + _LENGTH)),
            writes=int(words.load(_WRITES)),
            bytes_written=int(words.load(_BYTES)),
            refused_too_large=int(words.load(_REFUSED)),
            reads=sums[_S_READS],
            empty_reads=sums[_S_EMPTY],
            torn_retries=sums[_S_TORN],
        )

    def close(self) -> None:
        """Release the C views, then unmap. Idempotent; never raises BufferError."""
        self._segment.close()

    def unlink(self) -> None:
        self._segment.unlink()

    def __enter__(self) -> StateBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
