"""Write marks (shm.marks): buckets that only rise, even under racing processes; views
tagged by generation; class names a reader caches; layout checks on attach."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import numpy as np
import pytest
from node_harness import unique

from shm.marks import CLASS_BYTES, WriteMarks
from shm.segment import LayoutMismatch, Segment

SPAWN = multiprocessing.get_context("spawn")


@pytest.fixture
def marks() -> Iterator[WriteMarks]:
    created = WriteMarks.create(f"/{unique('wm')}", capacity=1 << 10)
    try:
        yield created
    finally:
        created.close()
        created.unlink()


def test_a_bucket_only_rises_and_is_shared_by_hashes_alike_below_the_mask(
    marks: WriteMarks,
) -> None:
    marks.stamp([5], 100)
    marks.stamp([5], 50)  # a writer that read an older position stores nothing lower
    assert not marks.unwritten_since(5, 100) and marks.unwritten_since(5, 101)
    assert not marks.unwritten_since(5 + (1 << 10), 100)  # same bucket: read, to be safe
    assert marks.unwritten_since(6, 1)
    assert not marks.unwritten_since(6, 0)  # a view of 0 vouches for nothing
    assert marks.statistics().stamped == 2


def test_the_mask_of_many_keys_reads_as_each_key_alone(marks: WriteMarks) -> None:
    marks.stamp([5, 9], 100)
    hashes = np.array([5, 6, 5 + (1 << 10), 9, 2**64 - 1], dtype=np.uint64)
    for view in (0, 50, 100, 101):
        expected = [marks.unwritten_since(int(h), view) for h in hashes.tolist()]
        assert marks.unwritten_mask(hashes, view).tolist() == expected
    assert marks.unwritten_mask(np.zeros(0, dtype=np.uint64), 7).size == 0


def test_a_view_is_read_only_for_its_own_generation(marks: WriteMarks) -> None:
    marks.set_view(3, 1234)
    assert marks.view_of(3) == 1234
    assert marks.view_of(11) == 0  # same slot, another generation
    marks.set_view(11, 2000)
    assert marks.view_of(3) == 0 and marks.view_of(11) == 2000


def test_classes_are_named_for_readers_in_other_handles(marks: WriteMarks) -> None:
    reader = WriteMarks.attach(marks.name)
    try:
        assert reader.class_of(0) is None  # not named yet: the claim reads the row
        assert marks.write_classes([("product", True)], 1)
        assert reader.class_of(0) == ("product", True) and reader.class_of(1) is None
        assert marks.write_classes([("product", True), ("blog", False)], 2)
        assert reader.class_of(1) == ("blog", False)
        # A list too large names nothing rather than leave the old names to new ids.
        assert not marks.write_classes([("x" * CLASS_BYTES, False)], 3)
        reader.refresh_classes()
        assert reader.class_of(0) is None
    finally:
        reader.close()


def test_a_new_keepers_names_replace_a_readers_copy(marks: WriteMarks) -> None:
    """A restarted keeper numbers its classes afresh: a reader that held the old list
    takes the new one at its next refresh, not only when it meets an id it lacks."""
    reader = WriteMarks.attach(marks.name)
    try:
        marks.write_classes([("product", True), ("blog", False)], 1)
        assert reader.class_of(1) == ("blog", False)
        marks.write_classes([("blog", False)], 2)  # the new keeper's class 0
        reader.refresh_classes()
        assert reader.class_of(0) == ("blog", False) and reader.class_of(1) is None
    finally:
        reader.close()


def test_the_lease_ceiling_only_rises_and_asks_are_taken_as_their_longest(
    marks: WriteMarks,
) -> None:
    other = WriteMarks.attach(marks.name)
    try:
        assert other.lease_ceiling() == 0 and marks.take_lease_asked() == 0
        marks.raise_lease_ceiling(5_000)
        marks.raise_lease_ceiling(4_000)
        assert other.lease_ceiling() == 5_000
        for asked in (30_000, 300_000, 6_000):
            other.note_lease_asked(asked)
        assert marks.take_lease_asked() == 300_000
        assert marks.take_lease_asked() == 0  # taken: the next take sees only newer asks
    finally:
        other.close()


def test_the_keepers_round_is_heard_by_another_handle_apart_from_its_other_words(
    marks: WriteMarks,
) -> None:
    other = WriteMarks.attach(marks.name)
    try:
        assert other.keeper_heard_at() == 0
        marks.confirm_until(7)
        marks.raise_lease_ceiling(9)
        marks.hear_keeper(123_456)
        assert other.keeper_heard_at() == 123_456
        assert other.confirmed_until() == 7 and other.lease_ceiling() == 9
        marks.stamp([1], 5)  # the stripes' counters sit after it
        assert other.keeper_heard_at() == 123_456
    finally:
        other.close()


def test_attach_refuses_another_kind_of_segment(marks: WriteMarks) -> None:
    name = f"/{unique('wk')}"
    other = Segment.create(name, "state_buffer", 4096, 1, 0, 1)
    try:
        with pytest.raises(LayoutMismatch):
            WriteMarks.attach(name)
    finally:
        other.close()
        other.unlink()


def test_a_capacity_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        WriteMarks.create(f"/{unique('wp')}", capacity=1000)


def _stamper(name: str, start: int, rounds: int) -> None:
    marks = WriteMarks.attach(name)
    try:
        for position in range(start, start + rounds):
            marks.stamp([7, 7 + (1 << 10)], position)
            # Another writer may have raised it further, never lowered it below ours.
            if marks.unwritten_since(7, position):
                raise SystemExit(f"bucket fell below {position}")
    finally:
        marks.close()


def test_racing_writers_leave_each_bucket_at_the_highest_position(marks: WriteMarks) -> None:
    """Four processes stamp one bucket with overlapping rising positions; after each stamp
    the bucket holds at least that position, and it ends at the highest any of them
    stamped, never at a lower one a slower writer had read."""
    rounds = 20_000
    workers = [
        SPAWN.Process(target=_stamper, args=(marks.name, 1 + i * 1000, rounds)) for i in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
        assert worker.exitcode == 0
    highest = 1 + 3 * 1000 + rounds - 1
    assert not marks.unwritten_since(7, highest) and marks.unwritten_since(7, highest + 1)
    assert marks.statistics().stamped == 4 * rounds * 2
