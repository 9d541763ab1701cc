"""shm/lease_journal.py: a lease table's grants, renewals and ends joined into leases by
node and token; a torn tail and foreign files; and four processes racing for the same
keys, each with its own journal, whose records show no two leases on a key at once."""

from __future__ import annotations

import multiprocessing
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import hash_secret  # noqa: F401  (spawned children import this module: they hash alike)
import numpy as np
import pytest

from bench.harness.history import double_holds
from shm import Grant, LeaseTable, key_hash, segment_name
from shm.lease_journal import GRANTED, RECORD, JournaledLease, LeaseJournal, read_journals

SPAWN = multiprocessing.get_context("spawn")
GRANTS_EACH = 50
H = key_hash(b"/product/1")


@pytest.fixture
def table() -> Iterator[LeaseTable]:
    created = LeaseTable.create(segment_name(f"t{uuid.uuid4().hex[:8]}", "leases"), 256)
    yield created
    created.close()
    created.unlink()


def test_a_lease_is_joined_from_its_grant_renewals_and_end(
    table: LeaseTable, tmp_path: Path
) -> None:
    clock = [0]
    table.journal = LeaseJournal(tmp_path, "a", clock=lambda: clock[0])

    def at(now: int) -> int:
        clock[0] = now
        return now

    first = table.grant(H, at(1_000), 100, 10_000)
    assert isinstance(first, Grant)
    assert table.renew(H, first.token, at(1_050), 200) == 1_250
    assert table.renew(H, first.token + 1, at(1_060), 200) is None  # not held: not recorded
    assert table.complete(H, first.token, at(1_210))
    second = table.grant(H, at(1_300), 100, 10_000)
    assert isinstance(second, Grant)
    assert table.fail(H, second.token, at(1_350)) is not None
    third = table.grant(key_hash(b"/other"), at(1_400), 100, 10_000)
    assert isinstance(third, Grant)  # never ended: held until its expiry
    leases = sorted(read_journals(tmp_path), key=lambda lease: lease.granted_ms)
    assert [(x.key_hash, x.token, x.granted_ms, x.held_until_ms) for x in leases] == [
        (H, first.token, 1_000, 1_210),
        (H, second.token, 1_300, 1_350),
        (third.key_hash, third.token, 1_400, 1_500),
    ]
    assert {x.node for x in leases} == {"a"}


def test_a_batch_grant_records_each_lease_it_grants(table: LeaseTable, tmp_path: Path) -> None:
    table.journal = LeaseJournal(tmp_path, "a", clock=lambda: 1_005)
    other = key_hash(b"/other")
    hashes = np.array([H, H, other], dtype=np.uint64)  # the second H is refused: taken
    tokens, _ = table.grant_batch(
        hashes, np.zeros(3, np.uint64), np.full(3, 10_000, np.uint64), 1_000, 100
    )
    assert tokens.tolist()[1] == 0
    leases = sorted(read_journals(tmp_path), key=lambda lease: lease.key_hash)
    assert sorted((x.key_hash, x.token, x.granted_ms, x.held_until_ms) for x in leases) == sorted(
        [(H, int(tokens[0]), 1_005, 1_100), (other, int(tokens[2]), 1_005, 1_100)]
    )


def test_a_torn_tail_is_dropped_and_a_foreign_file_refused(tmp_path: Path) -> None:
    journal = LeaseJournal(tmp_path, "a", pid=7)
    journal.write(GRANTED, [H], [5], 1_000, [2_000])
    journal.close()
    with open(journal.path, "ab") as torn:  # a writer killed mid-row
        torn.write(b"\x01\x02\x03")
    (tmp_path / "notes.txt").write_text("not a journal: ignored by its name")
    assert [(x.token, x.held_until_ms) for x in read_journals(tmp_path)] == [(5, 2_000)]
    bad = np.zeros(1, dtype=RECORD)
    bad["kind"] = 9
    (tmp_path / "leases-b-8.bin").write_bytes(bad.tobytes())
    with pytest.raises(ValueError, match=r"leases-b-8\.bin is not a lease journal"):
        read_journals(tmp_path)


def test_a_node_name_that_is_not_a_file_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="plain file name"):
        LeaseJournal(tmp_path, "../a")


def test_the_check_finds_two_leases_held_at_once() -> None:
    first = JournaledLease(node="a", key_hash=1, token=1, granted_ms=100, held_until_ms=500)
    inside = JournaledLease(node="b", key_hash=1, token=9, granted_ms=400, held_until_ms=900)
    after = JournaledLease(node="b", key_hash=1, token=10, granted_ms=900, held_until_ms=950)
    other_key = JournaledLease(node="c", key_hash=2, token=1, granted_ms=450, held_until_ms=600)
    found = double_holds([after, inside, first, other_key])
    assert [(d.first.node, d.second.node, d.second.token) for d in found] == [("a", "b", 9)]


def test_one_millisecond_is_not_ordered_but_a_grant_inside_a_hold_is() -> None:
    def lease(node: str, token: int, granted: int, until: int) -> JournaledLease:
        return JournaledLease(
            node=node, key_hash=1, token=token, granted_ms=granted, held_until_ms=until
        )

    # Ended and granted again within millisecond 880: the records cannot order them.
    assert double_holds([lease("a", 1, 880, 880), lease("b", 2, 880, 895)]) == []
    # Granted and ended at 900, deep inside a hold from 880 to 950: surely both live.
    found = double_holds([lease("a", 1, 880, 950), lease("b", 2, 900, 900)])
    assert [(d.first.token, d.second.token) for d in found] == [(1, 2)]


def _race(name: str, directory: str, node: str, keys: list[int], seed: int) -> int:
    """Grant, renew, complete, fail and abandon leases at random, journaled."""
    table = LeaseTable.attach(name)
    table.journal = LeaseJournal(Path(directory), node)
    rng = np.random.default_rng(seed)
    mine: dict[int, int] = {}
    granted = 0
    # Until it has granted its share (however the others' leases and holds fall out),
    # with a cap so a table that never grants ends the test instead of hanging it.
    for _ in range(1_000_000):
        if granted >= GRANTS_EACH:
            break
        h = keys[int(rng.integers(len(keys)))]
        now = time.time_ns() // 1_000_000
        token = mine.get(h)
        if token is None:
            got = table.grant(h, now, int(rng.integers(1, 20)), 30)
            if isinstance(got, Grant):
                mine[h] = got.token
                granted += 1
            continue
        action = rng.random()
        if action < 0.4:
            if table.renew(h, token, now, int(rng.integers(1, 20))) is None:
                del mine[h]
        elif action < 0.7:
            table.complete(h, token, now)
            del mine[h]
        elif action < 0.8:
            table.fail(h, token, now)
            del mine[h]
        else:
            del mine[h]  # abandoned: it runs to its expiry
    return granted


def test_racing_processes_journals_show_no_key_leased_twice_at_once(
    table: LeaseTable, tmp_path: Path
) -> None:
    keys = [key_hash(f"/k/{i}".encode()) for i in range(12)]
    with SPAWN.Pool(4) as pool:
        granted = pool.starmap(
            _race,
            [(table.name, str(tmp_path), f"n{i % 2}", keys, i) for i in range(4)],
        )
    leases = read_journals(tmp_path)
    assert sum(granted) == 4 * GRANTS_EACH
    assert len(leases) == sum(granted)
    assert double_holds(leases) == []
