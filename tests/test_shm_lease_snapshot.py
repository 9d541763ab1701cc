"""shm/lease_snapshot.py on real shared-memory tables: a snapshot brings every slot back
at its index (old tokens hold, keys stay taken, an expired lease reads as its hold), and
a file that is wrong in any field is rejected whole, set aside, and leaves the table
empty. The restart of a real node is in tests/test_workers_lease_snapshot.py."""

from __future__ import annotations

import os
import struct
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from shm import Grant, LeaseTable, Refusal, key_hash, segment_name
from shm import lease_snapshot as snap
from shm.keys import fingerprint
from shm.leases import SLOT
from shm.segment import LAYOUT_VERSION

CAPACITY = 4096
NOW = 1_800_000_000_000
LEASE_MS = 60_000
CADENCE_MS = 3_600_000
INSTANCE = "rqtest"
SECRET = b"the store's hash"  # what the hashes were made under, as far as a snapshot knows


def make_table(capacity: int = CAPACITY) -> LeaseTable:
    return LeaseTable.create(
        segment_name(f"t{os.getpid()}x{uuid.uuid4().hex[:8]}", "leases"), capacity
    )


@pytest.fixture
def tables() -> Iterator[Callable[..., LeaseTable]]:
    made: list[LeaseTable] = []

    def factory(capacity: int = CAPACITY) -> LeaseTable:
        made.append(make_table(capacity))
        return made[-1]

    yield factory
    for table in made:
        table.close()
        table.unlink()


def keys(n: int, prefix: str = "k") -> list[int]:
    return [key_hash(f"https://shop.example/{prefix}/{i}".encode()) for i in range(n)]


def grant_all(table: LeaseTable, hashes: list[int], now: int, lease_ms: int) -> list[Grant]:
    grants = [table.grant(h, now, lease_ms, CADENCE_MS) for h in hashes]
    assert all(isinstance(g, Grant) for g in grants)
    return grants  # type: ignore[return-value]


def is_empty(table: LeaseTable) -> bool:
    slots = table.export_slots()
    return not slots["key_hash"].any() and not slots["state"].any()


def test_a_snapshot_brings_every_lease_back_at_its_index(
    tables: Callable[..., LeaseTable], tmp_path: Path
) -> None:
    before = tables()
    live = keys(300, "live")
    done = keys(50, "done")
    expired = keys(20, "expired")
    live_grants = grant_all(before, live, NOW, LEASE_MS)
    for h, g in zip(done, grant_all(before, done, NOW, LEASE_MS), strict=True):
        assert before.complete(h, g.token, NOW + 1)
    # Granted 12 s ago for 10 s: expired 2 s ago, never answered; held for 20 s from then.
    expired_grants = grant_all(before, expired, NOW - 12_000, 10_000)
    path = tmp_path / "node.sqlite.leases"
    saved = snap.save(path, before, instance=INSTANCE, secret=SECRET, now_ms=NOW + 2)
    assert saved.live_leases == 300 and saved.bytes == snap.HEADER.size + CAPACITY * 32
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left

    after = tables()
    restored = snap.restore(path, after, instance=INSTANCE, secret=SECRET, now_ms=NOW + 3)
    assert isinstance(restored, snap.Restored), restored
    assert restored.live_leases == 300 and restored.age_ms == 1 and restored.removed
    assert not path.exists()
    assert np.array_equal(after.export_slots(), before.export_slots())
    for h, g in zip(live, live_grants, strict=True):
        assert after.holds(h, g.token, NOW + 10)
        refusal = after.grant(h, NOW + 10, LEASE_MS, CADENCE_MS)
        assert isinstance(refusal, Refusal) and refusal.reason == "taken"
    # An expired, unanswered lease comes back as the hold it turns into, not a lease.
    for h, g in zip(expired, expired_grants, strict=True):
        assert not after.holds(h, g.token, NOW + 10)
        assert after.state(h, NOW + 10).held
    # A completed key is free to grant.
    assert all(isinstance(after.grant(h, NOW + 10, LEASE_MS, CADENCE_MS), Grant) for h in done)
    # Old tokens complete in the new table; a second completion is stale.
    assert all(after.complete(h, g.token, NOW + 20) for h, g in zip(live, live_grants, strict=True))
    assert not after.complete(live[0], live_grants[0].token, NOW + 21)
    after.sweep(NOW + 22)  # settles the expired leases into holds
    stats = after.statistics(NOW + 22)
    assert stats.live_leases == len(done) and stats.held_keys == len(expired)


def test_no_file_is_no_snapshot(tables: Callable[..., LeaseTable], tmp_path: Path) -> None:
    table = tables()
    assert (
        snap.restore(tmp_path / "none.leases", table, instance=INSTANCE, secret=SECRET, now_ms=NOW)
        is None
    )


def test_save_replaces_an_older_snapshot_whole(
    tables: Callable[..., LeaseTable], tmp_path: Path
) -> None:
    table = tables()
    path = tmp_path / "db.leases"
    path.write_bytes(b"an older, longer file" * 10_000)
    grant_all(table, keys(5), NOW, LEASE_MS)
    snap.save(path, table, instance=INSTANCE, secret=SECRET, now_ms=NOW)
    assert path.stat().st_size == snap.HEADER.size + CAPACITY * SLOT.itemsize
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db.leases"]


def rewrite_header(data: bytes, **changes: object) -> bytes:
    """The snapshot with header fields changed and its checksum made right again, so the
    field itself is what a reader must catch."""
    fields = dict(
        zip(
            ("magic", "version", "capacity", "slot_bytes", "written_at", "instance", "secret"),
            snap._CHECKED.unpack(data[: snap._CHECKED.size]),
            strict=True,
        )
    )
    fields.update(changes)
    checked = snap._CHECKED.pack(*fields.values())
    body = data[snap.HEADER.size :]
    checksum = zlib.crc32(body, zlib.crc32(checked))
    return checked + struct.pack("<I4x", checksum) + body


CORRUPTIONS: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "empty": (lambda d: b"", "truncated"),
    "header cut": (lambda d: d[:40], "truncated"),
    "body cut": (lambda d: d[:-32], "truncated"),
    "body grown": (lambda d: d + b"\0" * 32, "bytes"),
    "bit flip in a slot": (
        lambda d: (
            d[: snap.HEADER.size + 40]
            + bytes([d[snap.HEADER.size + 40] ^ 1])
            + d[snap.HEADER.size + 41 :]
        ),
        "checksum",
    ),
    "bit flip in written_at": (lambda d: d[:32] + bytes([d[32] ^ 4]) + d[33:], "checksum"),
    "not a snapshot": (lambda d: b"GIF89a" + d[6:], "not a lease snapshot"),
    "other layout version": (
        lambda d: rewrite_header(d, version=LAYOUT_VERSION + 1),
        "layout version",
    ),
    "other slot size": (lambda d: rewrite_header(d, slot_bytes=40), "slots"),
    "other capacity": (lambda d: rewrite_header(d, capacity=CAPACITY * 2), "capacity"),
    "other instance": (lambda d: rewrite_header(d, instance=b"rqother"), "instance"),
    "other secret": (
        lambda d: rewrite_header(d, secret=fingerprint(b"another database")),
        "hash secret",
    ),
    "from the future": (lambda d: rewrite_header(d, written_at=NOW + 86_400_000), "written_at"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_bad_snapshot_is_set_aside_and_the_table_left_empty(
    tables: Callable[..., LeaseTable], tmp_path: Path, case: str
) -> None:
    before = tables()
    grant_all(before, keys(100), NOW, LEASE_MS)
    path = tmp_path / "db.leases"
    snap.save(path, before, instance=INSTANCE, secret=SECRET, now_ms=NOW)
    corrupt, reason = CORRUPTIONS[case]
    bad = corrupt(path.read_bytes())
    path.write_bytes(bad)

    after = tables()
    outcome = snap.restore(path, after, instance=INSTANCE, secret=SECRET, now_ms=NOW + 1)
    assert isinstance(outcome, snap.Rejected), outcome
    assert reason in outcome.reason
    assert outcome.moved_to == str(path) + ".rejected"
    assert not path.exists() and Path(outcome.moved_to).read_bytes() == bad
    assert is_empty(after)


def test_the_configured_capacity_must_match(
    tables: Callable[..., LeaseTable], tmp_path: Path
) -> None:
    before = tables()
    grant_all(before, keys(10), NOW, LEASE_MS)
    path = tmp_path / "db.leases"
    snap.save(path, before, instance=INSTANCE, secret=SECRET, now_ms=NOW)
    larger = tables(CAPACITY * 2)
    outcome = snap.restore(path, larger, instance=INSTANCE, secret=SECRET, now_ms=NOW)
    assert isinstance(outcome, snap.Rejected) and "lease_slots changed" in outcome.reason
    assert is_empty(larger)


def test_a_snapshot_names_its_secret_by_fingerprint_and_another_secret_is_refused(
    tables: Callable[..., LeaseTable], tmp_path: Path
) -> None:
    before = tables()
    grant_all(before, keys(10), NOW, LEASE_MS)
    path = tmp_path / "db.leases"
    snap.save(path, before, instance=INSTANCE, secret=SECRET, now_ms=NOW)
    written = path.read_bytes()
    assert SECRET not in written
    assert fingerprint(SECRET).to_bytes(8, "little") in written[: snap.HEADER.size]
    # The node now opens another database: its keys hash elsewhere, so none of these
    # leases could be found; the file is set aside and the table starts empty.
    after = tables()
    other = b"another database"
    outcome = snap.restore(path, after, instance=INSTANCE, secret=other, now_ms=NOW + 1)
    assert isinstance(outcome, snap.Rejected)
    assert f"{fingerprint(SECRET):016x}" in outcome.reason
    assert f"{fingerprint(other):016x}" in outcome.reason
    assert is_empty(after) and outcome.moved_to == str(path) + ".rejected"


def test_import_refuses_a_table_in_use_or_slots_of_another_shape(
    tables: Callable[..., LeaseTable],
) -> None:
    source = tables()
    grant_all(source, keys(3), NOW, LEASE_MS)
    slots = source.export_slots()
    with pytest.raises(ValueError, match="in use"):
        source.import_slots(slots)
    with pytest.raises(ValueError, match="do not fit"):
        tables(CAPACITY * 2).import_slots(slots)
    with pytest.raises(ValueError, match="do not fit"):
        tables().import_slots(slots.view(np.uint64))


def test_import_finishes_a_removal_whose_remover_is_gone(
    tables: Callable[..., LeaseTable],
) -> None:
    source = tables()
    hashes = keys(4)
    grant_all(source, hashes, NOW, LEASE_MS)
    slots = source.export_slots()
    parked = int(np.flatnonzero(slots["key_hash"])[0])
    # A remover parked this slot (phase 3, its pid in the time bits) and died.
    slots["state"][parked] = np.uint64(3 | (999_999 << 22))
    target = tables()
    target.import_slots(slots)
    after = target.export_slots()
    assert after["key_hash"][parked] == 0 and int(after["state"][parked]) & 3 == 0
    # The slot is usable again: every key but the parked one is still leased, and the
    # parked key can be granted afresh.
    parked_hash = int(slots["key_hash"][parked])
    assert isinstance(target.grant(parked_hash, NOW + 1, LEASE_MS, CADENCE_MS), Grant)
