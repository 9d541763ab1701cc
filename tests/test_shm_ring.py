"""shm/ring.py: publish and claim, cut-off batches, a four-process claim race where every
entry is taken exactly once, and a republishing writer whose readers never accept a torn
entry; `publish_slices` (keys as slices of one buffer, one C call) leaves the segment
byte for byte as `publish` (a list of keys) does."""

from __future__ import annotations

import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import hash_secret  # noqa: F401  (spawned children import this module: they hash alike)
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shm import ReadyEntry, ReadyRing, key_hash, key_hashes, segment_name
from shm.segment import HEADER_BYTES, remove


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


def test_an_entry_carries_its_site_hash(name: str) -> None:
    ring = ReadyRing.create(name, capacity=8, arena_bytes=256)
    try:
        keys = [b"/a", b"/b", b"/c"]
        sites = np.array([0, 7, 2**64 - 1], dtype=np.uint64)
        zeros = np.zeros(3, dtype=np.int64)
        ring.publish(keys, zeros, zeros.astype(np.int32), key_hashes(keys), 1, None, sites)
        assert [e.site_hash for e in ring.claim(3)] == [0, 7, 2**64 - 1]
        source = b"".join(keys)
        starts = np.array([0, 2, 4], dtype=np.int64)
        lengths = np.full(3, 2, dtype=np.int64)
        ring.publish_slices(
            source, starts, lengths, zeros, zeros.astype(np.int32), key_hashes(keys), 2, None, sites
        )
        assert [e.site_hash for e in ring.claim(3)] == [0, 7, 2**64 - 1]
        _publish(ring, keys)  # a publisher that does not say: no site
        assert [e.site_hash for e in ring.claim(3)] == [0, 0, 0]
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


def test_a_batch_claim_takes_the_entries_claim_would_as_arrays(name: str) -> None:
    ring = ReadyRing.create(name, capacity=32, arena_bytes=1024)
    try:
        assert len(ring.claim_batch(5)) == 0  # nothing published
        keys = [f"/p/{i}/é".encode() for i in range(10)]
        _publish(ring, keys)
        first = ring.claim_batch(4)
        assert len(first) == 4
        assert first.entries["key_hash"].tolist() == [key_hash(k) for k in keys[:4]]
        assert first.entries["due_at"].tolist() == [0, 10, 20, 30]
        assert first.entries["class_id"].tolist() == [0, 1, 2, 3]
        assert first.keys_of(np.array([3, 0])) == [keys[3].decode(), keys[0].decode()]
        assert first.key_bytes(1) == keys[1]
        # The rest goes to the next claim, batch or not, each entry once.
        assert [e.key for e in ring.claim(2)] == keys[4:6]
        rest = ring.claim_batch(100)
        assert rest.keys_of(np.arange(len(rest))) == [k.decode() for k in keys[6:]]
        assert len(ring.claim_batch(1)) == 0 and ring.statistics().claimed == 10
        with pytest.raises(IndexError):
            rest.keys_of(np.array([4]))
    finally:
        ring.close()
        ring.unlink()


def test_a_batch_larger_than_the_ring_is_cut_to_the_prefix_that_fits(name: str) -> None:
    ring = ReadyRing.create(name, capacity=8, arena_bytes=100)
    try:
        _publish(ring, [b"k%02d" % i for i in range(20)])  # 8 entries fit, 3 bytes each
        assert ring.remaining() == ring.published_count() == 8
        _publish(ring, [b"x" * 30 for _ in range(5)])  # the arena holds 3 of them
        assert ring.published_count() == 3
        assert [e.key for e in ring.claim(10)] == [b"x" * 30] * 3
        assert ring.published_count() == 3 and ring.remaining() == 0
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


# -- publish_slices against publish ---------------------------------------------------


class _Batch:
    """One publish's input, as a list of keys and as slices of one source buffer (the
    keys in another order, with bytes of junk between them, as in the keeper's arena)."""

    def __init__(self, keys: list[bytes], seed: int, cadence: bool, sites: bool = False) -> None:
        n = len(keys)
        rng = np.random.default_rng(seed)
        self.keys = keys
        self.due = rng.integers(-(2**62), 2**62, n, dtype=np.int64)
        self.classes = rng.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
        self.hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
        self.cadence = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        self.with_cadence = cadence
        self.sites = rng.integers(0, 2**64, n, dtype=np.uint64)
        self.with_sites = sites
        self.starts = np.zeros(n, dtype=np.int64)
        self.lengths = np.array([len(k) for k in keys], dtype=np.int64)
        source = bytearray()
        for i in rng.permutation(n).tolist():
            source += bytes(rng.integers(0, 256, int(rng.integers(0, 5)), dtype=np.uint8))
            self.starts[i] = len(source)
            source += keys[i]
        self.source = source + b"~"

    def by_list(self, ring: ReadyRing, now: int) -> int:
        cadence = self.cadence if self.with_cadence else None
        sites = self.sites if self.with_sites else None
        return ring.publish(self.keys, self.due, self.classes, self.hashes, now, cadence, sites)

    def by_slices(self, ring: ReadyRing, now: int) -> int:
        cadence = self.cadence if self.with_cadence else None
        sites = self.sites if self.with_sites else None
        return ring.publish_slices(
            self.source,
            self.starts,
            self.lengths,
            self.due,
            self.classes,
            self.hashes,
            now,
            cadence,
            sites,
        )


def _segment_bytes(ring: ReadyRing) -> tuple[int, bytes]:
    """The header's generation and everything after the header (which also holds the
    creation time and owner, different for two rings)."""
    return ring._segment.generation, bytes(ring._segment.mmap[HEADER_BYTES:])


_key = st.one_of(
    st.binary(max_size=40),
    st.integers(0, 2_048).map(lambda n: bytes([n % 251]) * n),
)


@given(
    batches=st.lists(
        st.tuples(st.lists(_key, max_size=24), st.booleans(), st.booleans()),
        min_size=1,
        max_size=4,
    ),
    capacity=st.integers(1, 20),
    arena_bytes=st.integers(1, 12_000),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=60, deadline=None)
def test_publishing_slices_leaves_the_segment_as_publishing_the_keys_does(
    batches: list[tuple[list[bytes], bool, bool]], capacity: int, arena_bytes: int, seed: int
) -> None:
    """Byte for byte, after each of several publishes (both buffers, stale bytes left by
    a longer generation, cut-offs by capacity and by arena, truncation counts), and the
    claims read back the same entries."""
    tag = uuid.uuid4().hex[:8]
    old = ReadyRing.create(segment_name(f"t{os.getpid()}o{tag}", "ring"), capacity, arena_bytes)
    new = ReadyRing.create(segment_name(f"t{os.getpid()}n{tag}", "ring"), capacity, arena_bytes)
    try:
        for i, (keys, cadence, sites) in enumerate(batches):
            batch = _Batch(keys, seed + i, cadence, sites)
            assert batch.by_list(old, 100 + i) == batch.by_slices(new, 100 + i) == i + 1
            assert _segment_bytes(old) == _segment_bytes(new)
            assert old.statistics() == new.statistics()
        assert old.claim(capacity) == new.claim(capacity)
    finally:
        for ring in (old, new):
            ring.close()
            ring.unlink()


def test_a_refused_slice_publish_leaves_the_ring_as_it_was(name: str) -> None:
    """A key over KEY_MAX, a slice outside the source, or columns that disagree are
    refused before anything is written, as `publish` refuses them."""
    ring = ReadyRing.create(name, capacity=8, arena_bytes=4_096)
    try:
        _Batch([b"/a", b"/b"], 1, True).by_slices(ring, 5)
        before = _segment_bytes(ring)
        long = _Batch([b"ok", b"x" * 2_049], 2, True)
        with pytest.raises(ValueError, match="key 1 is 2049 bytes; at most 2048"):
            long.by_slices(ring, 6)
        with pytest.raises(ValueError, match="key 1 is 2049 bytes; at most 2048"):
            long.by_list(ring, 6)
        outside = _Batch([b"/c", b"/d"], 3, False)
        outside.starts[1] = len(outside.source) - 1
        with pytest.raises(ValueError, match=r"key 1 \(2 bytes at -?\d+\) lies outside a source"):
            outside.by_slices(ring, 7)
        outside.starts[1] = -1
        with pytest.raises(ValueError, match=r"key 1 \(2 bytes at -?\d+\) lies outside a source"):
            outside.by_slices(ring, 7)
        short = _Batch([b"/e", b"/f"], 4, True)
        short.due = short.due[:1]
        with pytest.raises(ValueError, match="2 keys but 2 lengths, 1 due times"):
            short.by_slices(ring, 8)
        short = _Batch([b"/e", b"/f"], 4, True)
        short.cadence = short.cadence[:1]
        with pytest.raises(ValueError, match="2 keys but 1 cadences"):
            short.by_slices(ring, 8)
        short = _Batch([b"/e", b"/f"], 4, True, True)
        short.sites = short.sites[:1]
        with pytest.raises(ValueError, match="2 keys but 1 site hashes"):
            short.by_slices(ring, 8)
        with pytest.raises(ValueError, match="2 keys but 1 site hashes"):
            short.by_list(ring, 8)
        assert _segment_bytes(ring) == before
        assert [e.key for e in ring.claim(8)] == [b"/a", b"/b"]
    finally:
        ring.close()
        ring.unlink()


def _entry_key(generation: int, index: int, due: int, klass: int) -> bytes:
    body = b"%d:%d:%d:%d:" % (generation, index, due, klass)
    pad = (generation * 31 + index) % 200  # varying lengths move every offset
    return body + bytes([65 + (generation + index) % 26]) * pad


def _entry_site(dues: np.ndarray) -> np.ndarray:
    """A site hash a reader can recompute from the entry's due time (all 64 bits used)."""
    return (dues.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)


def _republish(name: str, seconds: float, slices: bool) -> int:
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
        if slices:  # keys in reverse order in the source: every offset differs from the ring's
            source = b"".join(reversed(keys))
            lengths = np.array([len(k) for k in keys], dtype=np.int64)
            starts = len(source) - np.cumsum(lengths)
            hashes = key_hashes(keys)
            ring.publish_slices(
                source,
                starts,
                lengths,
                dues,
                classes.astype(np.int32),
                hashes,
                generation,
                None,
                _entry_site(dues),
            )
        else:
            ring.publish(
                keys,
                dues,
                classes.astype(np.uint32),
                key_hashes(keys),
                generation,
                None,
                _entry_site(dues),
            )
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
                or entry.site_hash != int(_entry_site(np.array([due]))[0])
                or entry.key != _entry_key(generation, int(fields[1]), due, klass)
            ):
                bad += 1
            accepted += 1
            generations.add(generation)
    ring.close()
    return accepted, bad, len(generations)


@pytest.mark.parametrize("slices", [False, True], ids=["publish", "publish_slices"])
def test_readers_never_accept_a_torn_entry_while_the_writer_republishes(
    name: str, slices: bool
) -> None:
    ring = ReadyRing.create(name, capacity=64, arena_bytes=64 * 256)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(3) as pool:
            writer = pool.apply_async(_republish, (name, 3.0, slices))
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
