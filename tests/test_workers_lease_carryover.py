"""workers/lease_carryover.py without a node: what a start takes into its fresh lease
table (a surviving table's slots over a snapshot file, else the file's leases, else
nothing), what it records of that, and when the file is written. A real node's restarts
and crashes are in tests/test_workers_lease_snapshot.py and
tests/test_workers_lease_crash.py."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shm import Grant, LeaseTable, Refusal, key_hash, lease_survivor, segment_name
from shm.segment import now_ms
from workers.config import load_settings
from workers.lease_carryover import LeaseCarryover, LeaseRecovery

CAPACITY = 4096
SECRET = b"sixteen byte key"  # the store's hash secret: 16 bytes
LEASE_MS = 600_000  # long enough that no lease of a test ends while it runs
CADENCE_MS = 3_600_000


@pytest.fixture
def tables() -> Iterator[Callable[[], LeaseTable]]:
    made: list[LeaseTable] = []

    def factory() -> LeaseTable:
        name = segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "leases")
        made.append(LeaseTable.create(name, CAPACITY, secret=SECRET))
        return made[-1]

    yield factory
    for table in made:
        table.close()
        table.unlink()


def carryover(tmp_path: Path) -> LeaseCarryover:
    """A start of the node whose database is tmp_path/q.db (its snapshot beside it)."""
    settings = load_settings(
        environ={}, flags={"db": str(tmp_path / "q.db"), "lease_slots": CAPACITY}
    )
    return LeaseCarryover(settings, "rqtest", SECRET)


def lease(table: LeaseTable, count: int, prefix: str) -> list[int]:
    hashes = [key_hash(f"https://shop.example/{prefix}/{i}".encode()) for i in range(count)]
    for hashed in hashes:
        assert isinstance(table.grant(hashed, now_ms(), LEASE_MS, CADENCE_MS), Grant)
    return hashes


def leased(table: LeaseTable, hashed: int) -> bool:
    """The key is taken: a grant of it is refused (and nothing changes)."""
    return isinstance(table.grant(hashed, now_ms(), LEASE_MS, CADENCE_MS), Refusal)


def test_a_stop_writes_the_file_and_the_next_start_takes_every_lease_back(
    tables: Callable[[], LeaseTable], tmp_path: Path
) -> None:
    before = tables()
    hashes = lease(before, 50, "a")
    stopping = carryover(tmp_path)
    stopping.save(before)
    assert stopping.path == tmp_path / "q.db.leases" and stopping.path.exists()

    starting, table = carryover(tmp_path), tables()
    starting.restore(table, None)
    assert starting.inherited
    assert starting.recovery == LeaseRecovery(
        source="snapshot", occupied=50, live_leases=50, held_keys=0
    )
    assert not starting.path.exists()  # taken: a later start must not load it again
    assert all(leased(table, h) for h in hashes)


def test_a_start_with_nothing_left_behind_starts_empty_and_writes_nothing(
    tables: Callable[[], LeaseTable], tmp_path: Path
) -> None:
    starting, table = carryover(tmp_path), tables()
    unused = segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "leases")
    assert starting.find_survivor(unused, wait_s=0) is None
    starting.restore(table, None)
    assert starting.recovery == LeaseRecovery(source="none")
    assert not starting.inherited
    starting.keep_if_inherited(table)  # a start that fails now has nothing to keep
    assert not starting.path.exists()


def test_a_bad_file_is_set_aside_and_said_and_the_table_starts_empty(
    tables: Callable[[], LeaseTable], tmp_path: Path
) -> None:
    starting, table = carryover(tmp_path), tables()
    starting.path.write_bytes(b"not a lease snapshot")
    starting.restore(table, None)
    assert starting.recovery is not None
    assert starting.recovery.source == "none" and starting.recovery.snapshot_rejected
    assert not starting.inherited
    assert not starting.path.exists()
    set_aside = Path(f"{starting.path}.rejected")
    assert set_aside.read_bytes() == b"not a lease snapshot"
    assert table.census(now_ms()).occupied == 0


def test_a_surviving_table_wins_over_the_file_which_is_set_aside(
    tables: Callable[[], LeaseTable], tmp_path: Path
) -> None:
    older = tables()
    lease(older, 10, "older")
    carryover(tmp_path).save(older)
    killed = tables()
    survivors = lease(killed, 30, "killed")
    survivor = lease_survivor.Survivor(
        name=killed.name,
        owner_pid=killed.owner_pid,
        created_at=killed.created_at,
        slots=killed.export_slots(),
        waited_ms=0,
    )

    starting, table = carryover(tmp_path), tables()
    starting.restore(table, survivor)
    assert starting.inherited
    assert starting.recovery == LeaseRecovery(
        source="segment", occupied=30, live_leases=30, held_keys=0
    )
    assert all(leased(table, h) for h in survivors)
    assert not starting.path.exists()
    assert Path(f"{starting.path}.superseded").exists()
    assert table.census(now_ms()).occupied == 30  # none of the older file's leases came


def test_a_table_whose_owner_lives_is_refused_and_the_refusal_kept_beside_the_file(
    tables: Callable[[], LeaseTable], tmp_path: Path
) -> None:
    in_use = tables()  # this process made it, and is alive
    lease(in_use, 5, "in-use")
    carryover(tmp_path).save(in_use)
    starting, table = carryover(tmp_path), tables()
    assert starting.find_survivor(in_use.name, wait_s=0) is None
    assert starting.recovery is not None and "alive" in (starting.recovery.segment_rejected or "")
    starting.restore(table, None)
    recovery = starting.recovery
    assert recovery is not None
    assert (recovery.source, recovery.live_leases) == ("snapshot", 5)
    assert recovery.segment_rejected and "alive" in recovery.segment_rejected


def test_a_start_that_fails_after_taking_leases_writes_them_back_to_the_file(
    tables: Callable[[], LeaseTable], tmp_path: Path
) -> None:
    before = tables()
    hashes = lease(before, 20, "kept")
    carryover(tmp_path).save(before)
    failing, table = carryover(tmp_path), tables()
    failing.restore(table, None)
    assert failing.inherited and not failing.path.exists()
    failing.keep_if_inherited(table)  # the start failed: the table is about to be unlinked
    assert failing.path.exists()

    again, fresh = carryover(tmp_path), tables()
    again.restore(fresh, None)
    assert again.recovery is not None and again.recovery.live_leases == 20
    assert all(leased(fresh, h) for h in hashes)
