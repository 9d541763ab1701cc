"""shm/state.py: write and read, the too-large error, age, and a writer rewriting as fast
as it can while readers in other processes verify a checksum in every state."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
import uuid
from collections.abc import Iterator

import msgspec
import pytest

from shm import StateBuffer, StateSnapshot, segment_name
from shm.segment import remove


@pytest.fixture
def name() -> Iterator[str]:
    value = segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "state")
    yield value
    remove(value)


def test_write_then_read_in_another_attachment(name: str) -> None:
    buffer = StateBuffer.create(name, capacity=4096)
    reader = StateBuffer.attach(name)
    try:
        assert reader.read() is None  # before the first write
        state = {"status": "live", "due": 12}
        assert buffer.write(msgspec.msgpack.encode(state), 1_000) == 1
        snapshot = reader.read()
        assert snapshot == StateSnapshot(msgspec.msgpack.encode(state), 1, 1_000)
        assert msgspec.msgpack.decode(snapshot.payload) == state
        assert snapshot.age_ms(6_000) == 5_000
        assert buffer.write(b"", 2_000) == 2  # an empty state is still a state
        assert reader.read() == StateSnapshot(b"", 2, 2_000)
        stats = reader.statistics()
        assert (stats.seq, stats.writes, stats.written_at, stats.last_size) == (2, 2, 2_000, 0)
        assert stats.reads == 3 and stats.empty_reads == 1
    finally:
        reader.close()
        buffer.close()
        buffer.unlink()


def test_a_state_too_large_is_refused_at_write(name: str) -> None:
    buffer = StateBuffer.create(name, capacity=100)
    try:
        buffer.write(b"a" * 100, 1)  # exactly the capacity fits
        with pytest.raises(ValueError, match=r"state of 101 bytes does not fit .* \(100 bytes\)"):
            buffer.write(b"b" * 101, 2)
        assert buffer.read() == StateSnapshot(b"a" * 100, 1, 1)  # nothing changed
        assert buffer.statistics().refused_too_large == 1
    finally:
        buffer.close()
        buffer.unlink()


def _state(seq: int, size: int) -> bytes:
    body = bytes([seq % 251]) * size + seq.to_bytes(8, "little")
    return body + hashlib.blake2b(body, digest_size=16).digest()


def _rewrite(name: str, seconds: float) -> int:
    buffer = StateBuffer.attach(name)
    deadline = time.monotonic() + seconds
    writes = 0
    while time.monotonic() < deadline:
        writes += 1
        size = (writes * 7919) % (buffer.capacity - 24)  # lengths change every write
        buffer.write(_state(writes, size), writes)
    buffer.close()
    return writes


def _verify_reads(name: str, seconds: float) -> tuple[int, int, int]:
    buffer = StateBuffer.attach(name)
    deadline = time.monotonic() + seconds
    reads = bad = 0
    seqs: set[int] = set()
    while time.monotonic() < deadline:
        snapshot = buffer.read()
        if snapshot is None:
            continue
        reads += 1
        body, digest = snapshot.payload[:-16], snapshot.payload[-16:]
        seq = int.from_bytes(body[-8:], "little")
        if (
            hashlib.blake2b(body, digest_size=16).digest() != digest
            or seq != snapshot.seq
            or snapshot.written_at != seq
        ):
            bad += 1
        seqs.add(seq)
    buffer.close()
    return reads, bad, len(seqs)


def test_readers_never_accept_a_torn_state_while_the_writer_rewrites(name: str) -> None:
    buffer = StateBuffer.create(name, capacity=64 * 1024)
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(3) as pool:
            writer = pool.apply_async(_rewrite, (name, 3.0))
            readers = [pool.apply_async(_verify_reads, (name, 3.0)) for _ in range(2)]
            writes = writer.get(120)
            results = [r.get(120) for r in readers]
        assert sum(r[1] for r in results) == 0  # zero torn states accepted
        assert writes > 100 and all(r[0] > 100 and r[2] > 10 for r in results)
        print(f"writes={writes} reads={results} {buffer.statistics()}")
    finally:
        buffer.close()
        buffer.unlink()
