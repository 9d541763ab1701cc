"""shm/ring.py: publish and claim, cut-off batches, a four-process claim race where every
entry is taken exactly once, and a republishing writer whose readers never accept a torn
entry."""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shm import ReadyEntry, ReadyRing, key_hash, key_hashes, segment_name
from shm.segment import remove


@pytest.fixture
def name() -> Iterator[str]:
    value = segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "ring")
    yield value
    remove(value)


def _publish(ring: ReadyRing, keys: list[bytes], now: int = 1_000) -> int:
    n = len(keys)
    return ring.publish(
        keys,
        np.arange(n, dtype=np.int64) * 10,
        np.arange(n, dtype=np.uint32) % 7,
        key_hashes(keys),
        now,
    )


def test_an_entry_carries_the_cadence_it_was_published_with(name: str) -> None:
    ring = ReadyRing.create(name, capacity=8, arena_bytes=256)
    try:
        keys = [b"/a", b"/b", b"/c"]
        ring.publish(
            keys,
            np.zeros(3, dtype=np.int64),
            np.zeros(3, dtype=np.int32),
            key_hashes(keys),
            1,
            np.array([60, 3600, 86400], dtype=np.uint32),
        )
        assert [e.cadence_s for e in ring.claim(3)] == [60, 3600, 86400]
        _publish(ring, keys)  # a publisher that does not say: 0, "read the row"
        assert [e.cadence_s for e in ring.claim(3)] == [0, 0, 0]
        with pytest.raises(ValueError, match="cadences"):
            ring.publish(
                keys, np.zeros(3), np.zeros(3), key_hashes(keys), 1, np.zeros(2, dtype=np.uint32)
            )
    finally:
        ring.close()


def test_claims_come_in_published_order_until_drained(name: str) -> None:
    ring = ReadyRing.create(name, capacity=32, arena_bytes=1024)
    try:
        assert ring.claim(5) == []  # nothing published: nothing to claim
        assert ring.generation == 0 and ring.published_at == 0 and ring.remaining() == 0
        keys = [f"/p/{i}".encode() for i in range(10)]
        assert _publish(ring, keys, now=777) == 1
        assert ring.generation == 1 and ring.published_at == 777 and ring.remaining() == 10
        first = ring.claim(3)
        assert first == [
            ReadyEntry(key=keys[i], due_at=i * 10, class_id=i % 7, key_hash=key_hash(keys[i]))
            for i in range(3)
        ]
        assert [e.key for e in ring.claim(100)] == keys[3:]
        assert ring.claim(1) == [] and ring.remaining() == 0
        assert _publish(ring, keys[:2], now=800) == 2  # a republish replaces the set
        assert [e.key for e in ring.claim(10)] == keys[:2]
        stats = ring.statistics()
        assert (stats.generation, stats.publishes, stats.published, stats.claimed) == (2, 2, 12, 12)
        assert stats.last_count == 2 and stats.remaining == 0 and stats.published_at == 800
    finally:
        ring.close()
        ring.unlink()


def test_a_batch_larger_than_the_ring_is_cut_to_the_prefix_that_fits(name: str) -> None:
    ring = ReadyRing.create(name, capacity=8, arena_bytes=100)
    try:
        _publish(ring, [b"k%02d" % i for i in range(20)])  # 8 entries fit, 3 bytes each
        assert ring.remaining() == 8
        _publish(ring, [b"x" * 30 for _ in range(5)])  # the arena holds 3 of them
        assert [e.key for e in ring.claim(10)] == [b"x" * 30] * 3
        assert ring.statistics().truncated == 12 + 2
        with pytest.raises(ValueError, match="key 1 is 2049 bytes"):
            _publish(ring, [b"a", b"b" * 2049])
        with pytest.raises(ValueError, match="2 keys but 1 due times"):
            ring.publish([b"a", b"b"], np.zeros(1), np.zeros(2), np.zeros(2), 0)
    finally:
        ring.close()
        ring.unlink()


def test_an_attached_ring_sees_the_writers_publishes(name: str) -> None:
    ring = ReadyRing.create(name, capacity=16, arena_bytes=1024)
    reader = ReadyRing.attach(name)
    try:
        _publish(ring, [b"a", b"b", b"c"])
        assert [e.key for e in reader.claim(2)] == [b"a", b"b"]
        assert [e.key for e in ring.claim(2)] == [b"c"]
        assert reader.statistics().claimed == 3
    finally:
        reader.close()
        ring.close()
        ring.unlink()


def _claim_all(name: str, start: Any, seed: int) -> list[int]:
    ring = ReadyRing.attach(name)
    rng = np.random.default_rng(seed)
    start.wait(60)  # a barrier: nobody claims until all four are attached and waiting
    taken: list[int] = []
    last_due = -1
    while True:
        batch = ring.claim(int(rng.integers(1, 65)))
        if not batch:
            break
        for entry in batch:
            index = int(entry.key.split(b"-")[1])
            assert entry.due_at == index and entry.key_hash == key_hash(entry.key)
            assert entry.due_at > last_due  # each claimant sees published order
            last_due = entry.due_at
            taken.append(index)
    ring.close()
    return taken


def test_four_processes_take_every_entry_of_100k_exactly_once(name: str) -> None:
    n = 100_000
    ring = ReadyRing.create(name, capacity=n, arena_bytes=n * 12)
    try:
        keys = [b"key-%06d" % i for i in range(n)]
        ring.publish(keys, np.arange(n), np.zeros(n), key_hashes(keys), 1)
        ctx = multiprocessing.get_context("spawn")
        # A barrier, not an event set after a sleep: on a loaded machine a pool process
        # can start late enough that one claimant drains the whole ring alone.
        start = ctx.Manager().Barrier(4)
        with ctx.Pool(4) as pool:
            results = [pool.apply_async(_claim_all, (name, start, seed)) for seed in range(4)]
            taken = [r.get(120) for r in results]
        every = np.sort(np.concatenate([np.array(t, dtype=np.int64) for t in taken]))
        assert every.size == n
        assert np.array_equal(every, np.arange(n))  # every entry, none twice
        assert sum(1 for t in taken if t) >= 2  # the claimants really raced
        assert ring.statistics().claimed == n and ring.remaining() == 0
    finally:
        ring.close()
        ring.unlink()


def _entry_key(generation: int, index: int, due: int, klass: int) -> bytes:
    body = b"%d:%d:%d:%d:" % (generation, index, due, klass)
    pad = (generation * 31 + index) % 200  # varying lengths move every offset
    return body + bytes([65 + (generation + index) % 26]) * pad


def _republish(name: str, seconds: float) -> int:
    ring = ReadyRing.attach(name)
    rng = np.random.default_rng(7)
    deadline = time.monotonic() + seconds
    publishes = 0
    while time.monotonic() < deadline:
        generation = ring.generation + 1
        n = int(rng.integers(1, ring.capacity + 1))
        dues = rng.integers(0, 2**40, n)
        classes = rng.integers(0, 2**31, n)
        keys = [_entry_key(generation, i, int(dues[i]), int(classes[i])) for i in range(n)]
        ring.publish(keys, dues, classes.astype(np.uint32), key_hashes(keys), generation)
        publishes += 1
    ring.close()
    return publishes


def _verify_claims(name: str, seconds: float) -> tuple[int, int, int]:
    ring = ReadyRing.attach(name)
    deadline = time.monotonic() + seconds
    accepted = bad = 0
    generations: set[int] = set()
    while time.monotonic() < deadline:
        for entry in ring.claim(16):
            fields = entry.key.split(b":")
            generation, _, due, klass = (int(f) for f in fields[:4])
            if (
                entry.key_hash != key_hash(entry.key)
                or entry.due_at != due
                or entry.class_id != klass
                or entry.key != _entry_key(generation, int(fields[1]), due, klass)
            ):
                bad += 1
            accepted += 1
            generations.add(generation)
    ring.close()
    return accepted, bad, len(generations)


def test_readers_never_accept_a_torn_entry_while_the_writer_republishes(name: str) -> None:
    ring = ReadyRing.create(name, capacity=64, arena_bytes=64 * 256)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(3) as pool:
            writer = pool.apply_async(_republish, (name, 3.0))
            readers = [pool.apply_async(_verify_claims, (name, 3.0)) for _ in range(2)]
            publishes = writer.get(120)
            results = [r.get(120) for r in readers]
        accepted = sum(r[0] for r in results)
        assert sum(r[1] for r in results) == 0  # zero torn entries accepted
        assert publishes > 100 and accepted > 1_000
        assert all(r[2] > 10 for r in results)  # each reader claimed across many generations
        stats = ring.statistics()
        print(f"publishes={publishes} accepted={accepted} {stats}")
    finally:
        ring.close()
        ring.unlink()
