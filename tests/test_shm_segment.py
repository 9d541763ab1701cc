"""shm/segment.py: names, the header checks at attach, live and stale owners at create,
unlink at the owner's exit, and a close that never raises BufferError."""

from __future__ import annotations

import multiprocessing
import os
import signal
import uuid
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest

from shm import (
    LayoutMismatch,
    LeaseTable,
    ReadyRing,
    SegmentInUse,
    SegmentMissing,
    StateBuffer,
    segment_name,
)
from shm.segment import LAYOUT_VERSION, MAGIC, remove


@pytest.fixture
def name() -> Iterator[str]:
    value = segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "seg")
    yield value
    remove(value)


def _word(field: str) -> int:
    from shm.segment import _WORD

    return _WORD[field]


def test_segment_name_keeps_instances_apart() -> None:
    assert segment_name("node-a", "ring") == "/rq-node-a-ring"
    assert segment_name("node-a", "ring") != segment_name("node-b", "ring")
    for bad in ("", "a/b", "x" * 65, "sp ace"):
        with pytest.raises(ValueError):
            segment_name(bad, "ring")


def test_attach_refuses_a_missing_segment(name: str) -> None:
    with pytest.raises(SegmentMissing, match=name):
        ReadyRing.attach(name)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("magic", 0x1234, "magic 0x0000000000001234"),
        ("layout_version", LAYOUT_VERSION + 1, f"layout version {LAYOUT_VERSION + 1}"),
        ("item_size", 48, "item size 48 bytes"),
        ("total_size", 12345, "header says 12345 bytes"),
        ("capacity", 10, "layout for capacity 10"),
    ],
)
def test_attach_refuses_a_header_that_differs(
    name: str, field: str, value: int, message: str
) -> None:
    ring = ReadyRing.create(name, capacity=64, arena_bytes=4096)
    try:
        ring._segment.words.store(_word(field), value)
        with pytest.raises(LayoutMismatch) as refused:
            ReadyRing.attach(name)
        assert name in str(refused.value)
        assert message in str(refused.value)
    finally:
        ring._segment.words.store(_word("magic"), MAGIC)
        ring.close()
        ring.unlink()


def test_attach_refuses_another_kind(name: str) -> None:
    table = LeaseTable.create(name, capacity=64)
    try:
        with pytest.raises(LayoutMismatch, match="kind 'lease_table', expected 'ready_ring'"):
            ReadyRing.attach(name)
        with pytest.raises(LayoutMismatch, match="kind 'lease_table', expected 'state_buffer'"):
            StateBuffer.attach(name)
        LeaseTable.attach(name).close()
    finally:
        table.close()
        table.unlink()


def test_attach_refuses_a_segment_smaller_than_the_header(name: str) -> None:
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=64)
    shm.close_fd()
    with pytest.raises(LayoutMismatch, match="smaller than the 256-byte header"):
        StateBuffer.attach(name)


def test_header_records_owner_and_layout(name: str) -> None:
    buffer = StateBuffer.create(name, capacity=1000)
    try:
        header = buffer._segment.header()
        assert int(header["owner_pid"]) == os.getpid()
        assert int(header["layout_version"]) == LAYOUT_VERSION
        assert int(header["capacity"]) == 1000
        assert int(header["created_at"]) > 0
        assert buffer._segment.generation == 0
        buffer.write(b"x", 1)
        assert buffer._segment.generation == 1
    finally:
        buffer.close()
        buffer.unlink()


def test_create_refuses_a_live_owner(name: str) -> None:
    ring = ReadyRing.create(name, capacity=8, arena_bytes=64)
    try:
        with pytest.raises(SegmentInUse, match="already owned by this process"):
            ReadyRing.create(name, capacity=8, arena_bytes=64)
    finally:
        ring.close()
        ring.unlink()


def _create_and_wait(name: str, ready: object, done: object) -> None:
    table = LeaseTable.create(name, capacity=64)
    ready.set()  # type: ignore[attr-defined]
    done.wait(60)  # type: ignore[attr-defined]
    table.close()
    table.unlink()


def test_create_refuses_a_segment_another_live_process_owns(name: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    owner = ctx.Process(target=_create_and_wait, args=(name, ready, done))
    owner.start()
    try:
        assert ready.wait(60)
        with pytest.raises(SegmentInUse, match=f"owned by live process {owner.pid}"):
            LeaseTable.create(name, capacity=64)
    finally:
        done.set()
        owner.join(60)
    assert owner.exitcode == 0


def _create_and_die(name: str) -> None:
    table = LeaseTable.create(name, capacity=64)
    table.grant(12345, 1_000, 60_000, 60_000)
    os.kill(os.getpid(), signal.SIGKILL)


def _create_and_exit(name: str) -> None:
    LeaseTable.create(name, capacity=64)  # no close, no unlink: exit must do it


def test_a_stale_segment_whose_owner_died_is_replaced(name: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(target=_create_and_die, args=(name,))
    victim.start()
    victim.join(60)
    assert victim.exitcode == -signal.SIGKILL
    leftover = LeaseTable.attach(name)  # the dead owner's segment is still there
    assert leftover.state(12345, 2_000).leased
    leftover.close()
    table = LeaseTable.create(name, capacity=128)
    try:
        assert table._segment.replaced_stale
        assert table.capacity == 128
        assert not table.state(12345, 2_000).leased  # a fresh table, not the dead one's
        attached = LeaseTable.attach(name)
        assert attached.capacity == 128
        attached.close()
    finally:
        table.close()
        table.unlink()


def test_the_owner_unlinks_on_exit(name: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    owner = ctx.Process(target=_create_and_exit, args=(name,))
    owner.start()
    owner.join(60)
    assert owner.exitcode == 0
    with pytest.raises(SegmentMissing):
        LeaseTable.attach(name)


def test_close_never_raises_buffer_error(name: str) -> None:
    ring = ReadyRing.create(name, capacity=8, arena_bytes=64)
    exported = np.frombuffer(ring._segment.mmap, dtype=np.uint8)  # someone keeps a view
    ring.close()
    ring.close()
    assert exported[0] != 0 or exported.size > 0  # the mapping outlives close while exported
    with pytest.raises(ValueError, match="released"):
        ring.claim(1)
    ring.unlink()
    ring.unlink()  # idempotent
