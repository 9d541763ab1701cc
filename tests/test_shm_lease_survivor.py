"""shm/lease_survivor.py on tables left by processes that really died: a killed run's
table is adopted slot for slot (its tokens still complete their keys, its leased keys
stay taken), and one that does not fit (capacity, layout version, hash secret, no secret
recorded, a live owner, a process that still maps it) is refused with the reason. A
node killed whole and started again is in tests/test_workers_lease_crash.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hash_secret
import pytest

from shm import Grant, LeaseTable, Refusal, key_hash, segment_name
from shm import lease_survivor as survivor
from shm.segment import LAYOUT_VERSION, now_ms, remove

REPO = Path(__file__).resolve().parent.parent
CAPACITY = 1024
SECRET = hash_secret.SECRET  # this process's: the tables below are "this database's"
OTHER_SECRET = bytes(reversed(SECRET))
LEASE_MS = 600_000


@pytest.fixture
def name() -> Iterator[str]:
    made = segment_name(f"sv{uuid.uuid4().hex[:10]}", "leases")
    yield made
    remove(made)


def keys(n: int) -> list[bytes]:
    return [f"https://shop.example/p/{i:07d}".encode() for i in range(n)]


def run_child(body: str, *, wait: bool = True) -> subprocess.Popen[str]:
    """A process hashing keys under SECRET that runs `body`, prints what `out` holds as
    JSON and dies without unlinking anything (os._exit: no atexit), as a SIGKILLed
    supervisor does; with wait=False it first blocks on stdin (a live process)."""
    code = textwrap.dedent(
        f"""
        import json, os, sys
        from shm import LeaseTable
        from shm.keys import use_secret
        use_secret({SECRET!r})
        out = {{}}
        """
    ) + textwrap.dedent(body)
    code += "\nprint(json.dumps(out), flush=True)\n"
    code += "sys.stdin.readline()\n" if not wait else ""
    code += "os._exit(0)\n"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def leave_table(
    name: str, body: str = "", *, capacity: int = CAPACITY, secret: bytes | None = SECRET
) -> dict[str, Any]:
    """Make a table in a child that then dies; what the child put in `out`."""
    child = run_child(
        f"table = LeaseTable.create({name!r}, {capacity}, secret={secret!r})\n"
        + textwrap.dedent(body)
    )
    stdout, _ = child.communicate(timeout=60)
    assert child.returncode == 0
    result: dict[str, Any] = json.loads(stdout)
    return result


LEASES = """
from shm import key_hash
from shm.segment import now_ms
keys = [f"https://shop.example/p/{i:07d}".encode() for i in range(40)]
now = now_ms()
grants = [table.grant(key_hash(k), now, 600_000, 3_600_000) for k in keys]
out["tokens"] = [g.token for g in grants]
for k, g in zip(keys[30:], grants[30:]):
    assert table.complete(key_hash(k), g.token, now)  # answered: free again
for k, g in zip(keys[20:30], grants[20:30]):
    assert table.fail(key_hash(k), g.token, now) is not None  # failed: held back
"""


def test_a_killed_runs_table_is_adopted_slot_for_slot(name: str) -> None:
    tokens = leave_table(name, LEASES)["tokens"]
    waited_for: list[list[int]] = []
    found = survivor.find(name, capacity=CAPACITY, secret=SECRET, on_wait=waited_for.append)
    assert isinstance(found, survivor.Survivor), found
    # Its processes are gone: nothing still maps it, so nothing was waited for.
    assert waited_for == [] and found.slots.shape == (CAPACITY,)
    fresh = LeaseTable.create(name, CAPACITY, secret=SECRET)  # replaces the stale one
    try:
        now = now_ms()
        adopted = survivor.adopt(found, fresh, now)
        assert (adopted.live_leases, adopted.held_keys) == (20, 10)
        hashes = [key_hash(k) for k in keys(40)]
        # Leased keys stay taken, failed ones held, answered ones free.
        for h in hashes[:20]:
            refused = fresh.grant(h, now, LEASE_MS, 3_600_000)
            assert isinstance(refused, Refusal) and refused.reason == "taken"
        for h in hashes[20:30]:
            refused = fresh.grant(h, now, LEASE_MS, 3_600_000)
            assert isinstance(refused, Refusal) and refused.reason == "held"
        for h in hashes[30:]:
            assert isinstance(fresh.grant(h, now, LEASE_MS, 3_600_000), Grant)
        # The killed run's tokens complete their keys, once.
        leased = list(zip(hashes[:20], tokens[:20], strict=True))
        assert all(fresh.complete(h, t, now) for h, t in leased)
        assert not any(fresh.complete(h, t, now) for h, t in leased)
    finally:
        fresh.close()


def test_no_table_is_none(name: str) -> None:
    assert survivor.find(name, capacity=CAPACITY, secret=SECRET) is None


@pytest.mark.parametrize(
    ("case", "capacity", "secret", "reason"),
    [
        ("capacity", CAPACITY * 2, SECRET, "capacity 2048"),
        ("secret", CAPACITY, OTHER_SECRET, "hash secret"),
        ("no secret", CAPACITY, None, "records no hash secret"),
    ],
)
def test_a_table_that_does_not_fit_is_refused(
    name: str, case: str, capacity: int, secret: bytes | None, reason: str
) -> None:
    leave_table(name, LEASES, capacity=capacity, secret=secret)
    found = survivor.find(name, capacity=CAPACITY, secret=SECRET)
    assert isinstance(found, survivor.Refused), case
    assert reason in found.reason


def test_a_table_of_another_layout_is_refused(name: str) -> None:
    leave_table(
        name,
        """
        import numpy as np
        from shm.segment import HEADER
        header = np.frombuffer(table._segment.mmap, dtype=HEADER, count=1)
        header["layout_version"] = header["layout_version"][0] - 1
        del header
        """,
    )
    found = survivor.find(name, capacity=CAPACITY, secret=SECRET)
    assert isinstance(found, survivor.Refused)
    assert f"layout version {LAYOUT_VERSION - 1}, this build reads {LAYOUT_VERSION}" in found.reason


def test_a_table_whose_owner_lives_is_refused(name: str) -> None:
    owner = run_child(
        f"table = LeaseTable.create({name!r}, {CAPACITY}, secret={SECRET!r})",
        wait=False,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline()
        found = survivor.find(name, capacity=CAPACITY, secret=SECRET)
        assert isinstance(found, survivor.Refused)
        assert f"process {owner.pid}, is alive" in found.reason
    finally:
        owner.communicate("\n", timeout=30)


def test_find_waits_for_the_processes_that_still_map_it(name: str) -> None:
    leave_table(name, LEASES)
    # A worker of the killed run, still stopping: it maps the table and answers a lease.
    worker = run_child(
        f"""
        table = LeaseTable.attach({name!r})
        out["pid"] = os.getpid()
        """,
        wait=False,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline()
        told: list[list[int]] = []
        refused = survivor.find(name, capacity=CAPACITY, secret=SECRET, wait_s=0.3)
        assert isinstance(refused, survivor.Refused)
        assert f"still mapped by live process(es) [{worker.pid}]" in refused.reason
        # Once it exits, find takes the table.
        assert worker.stdin is not None
        worker.stdin.write("\n")
        worker.stdin.flush()
        found = survivor.find(
            name, capacity=CAPACITY, secret=SECRET, wait_s=60, on_wait=told.append
        )
        assert isinstance(found, survivor.Survivor), found
        assert told in ([], [[worker.pid]])
    finally:
        worker.communicate(timeout=30)


def test_mapped_by_sees_a_mapping_and_not_an_unlinked_one(name: str) -> None:
    table = LeaseTable.create(name, CAPACITY, secret=SECRET)
    try:
        assert survivor.mapped_by(name) == []  # this process is left out
        reader = run_child(f"table = LeaseTable.attach({name!r})", wait=False)
        try:
            assert reader.stdout is not None and reader.stdout.readline()
            assert survivor.mapped_by(name) == [reader.pid]
            table.unlink()  # a new table of the name would not be this one
            assert survivor.mapped_by(name) == []
        finally:
            reader.communicate("\n", timeout=30)
    finally:
        table.close()
