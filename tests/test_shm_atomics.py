"""shm/csrc/words.c: the word operations, their checks at construction, release, and a
cross-process fetch-add race."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import uuid

import posix_ipc
import pytest

from shm._atomics import Words


def test_word_operations() -> None:
    mm = mmap.mmap(-1, 4096)
    words = Words(mm)
    assert words.nwords == 512
    assert words.load(3) == 0
    words.store(3, 41)
    assert words.fetch_add(3, 1) == 41
    assert words.load(3) == 42
    assert words.cas(3, 42, 7) is True
    assert words.cas(3, 42, 9) is False
    assert words.load(3) == 7
    assert words.fetch_add(3, -8) == 7
    assert words.load(3) == 2**64 - 1  # 64-bit wrapping
    words.store(4, 2**64 - 1)
    assert words.fetch_add(4, 1) == 2**64 - 1 and words.load(4) == 0
    assert int.from_bytes(mm[24:32], "little") == 2**64 - 1  # word 3 is bytes 24..32
    words.release()
    mm.close()


def test_region_offsets_and_bounds_are_checked_at_construction() -> None:
    mm = mmap.mmap(-1, 4096)
    with pytest.raises(ValueError, match="aligned"):
        Words(mm, 4)
    with pytest.raises(ValueError, match="aligned"):
        Words(mm, 0, 12)
    with pytest.raises(ValueError, match="overruns"):
        Words(mm, 4000, 200)
    with pytest.raises(BufferError, match="not writable"):
        Words(b"read-only bytes")
    words = Words(mm, 64, 64)
    assert words.nwords == 8
    words.store(0, 5)
    assert mm[64] == 5
    with pytest.raises(IndexError):
        words.load(8)
    with pytest.raises(IndexError):
        words.load(-1)
    words.release()
    mm.close()


def test_release_gives_the_buffer_back() -> None:
    mm = mmap.mmap(-1, 4096)
    words = Words(mm)
    with pytest.raises(BufferError):
        mm.close()  # the view still holds the buffer
    words.release()
    words.release()  # idempotent
    assert words.released
    with pytest.raises(ValueError, match="released"):
        words.load(0)
    mm.close()  # no BufferError once released


def _hammer(name: str, rounds: int) -> None:
    shm = posix_ipc.SharedMemory(name)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    words = Words(mm)
    for _ in range(rounds):
        words.fetch_add(0, 1)
        while True:  # a CAS increment too, so both paths race
            seen = words.load(1)
            if words.cas(1, seen, seen + 1):
                break
    words.release()
    mm.close()


def test_fetch_add_and_cas_are_atomic_across_processes() -> None:
    name = f"/rq-t{os.getpid()}x{uuid.uuid4().hex[:8]}-atomics"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    try:
        ctx = multiprocessing.get_context("spawn")
        rounds = 20_000
        procs = [ctx.Process(target=_hammer, args=(name, rounds)) for _ in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0
        words = Words(mm)
        assert words.load(0) == 4 * rounds
        assert words.load(1) == 4 * rounds
        words.release()
    finally:
        mm.close()
        posix_ipc.unlink_shared_memory(name)
