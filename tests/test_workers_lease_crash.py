"""Leases across a crash of a real node: the supervisor and every worker SIGKILLed at
once leave the lease table in shared memory, and the next start of the same node adopts
it (shm/lease_survivor.py), on SQLite and on PostgreSQL: no key leased before the crash
is granted again while its lease lives, however often the ring is republished, and the
old tokens complete their keys. A surviving table that does not fit (capacity, layout,
hash secret) is replaced by an empty one with the reason logged, and the node serves.
The graceful restart (a snapshot file) is tests/test_workers_lease_snapshot.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import posix_ipc
import pytest
from node_harness import REPO, NodeProcess, kill_whole_node, node_db, nodes_on, seed_rows, wait_for

from shm import segment_name
from shm.lease_snapshot import SUPERSEDED_SUFFIX
from store import open_store

LEASE_SLOTS = 65536
ROWS = 200
LEASED = 50
ANSWERED = 10
ARGS = ("--lease-slots", str(LEASE_SLOTS))
# A PostgreSQL node heartbeats its membership row; short, so its name frees up soon.
CLUSTER_ARGS = ("--node-ttl-s", "4", "--heartbeat-s", "0.5")


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Nodes made meanwhile keep their store in SQLite, or in a schema of their own."""
    if request.param == "sqlite":
        yield "sqlite"
        return
    url: str = request.getfixturevalue("pg_url")
    with nodes_on(lambda directory: url):
        yield "postgres"


def start(directory: Path, instance: str | None = None, args: tuple[str, ...] = ()) -> NodeProcess:
    extra = ARGS + (CLUSTER_ARGS if "://" in node_db(directory) else ()) + args
    return NodeProcess(directory, workers=2, instance=instance, extra_args=extra).start()


def wait_exact(node: NodeProcess) -> None:
    """Until queue-state is served: the keeper has loaded every row and published."""
    with node.client() as client:
        wait_for(
            lambda: client.get("/prerender_admin/queue-state").status_code == 200,
            60,
            "an exact queue-state",
            0.1,
        )


def claim(node: NodeProcess, n: int, worker: str) -> list[dict[str, Any]]:
    with node.client() as client:
        response = client.post("/v1/claims", json={"max": n, "worker": worker, "lease_s": 300})
    assert response.status_code == 200, response.text
    leases: list[dict[str, Any]] = response.json()["leases"]
    return leases


def complete(node: NodeProcess, leases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items = [{"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in leases]
    with node.client() as client:
        response = client.post("/v1/completions", json={"items": items})
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    return results


def generation(node: NodeProcess) -> int:
    with node.client() as client:
        return int(client.get("/readyz").json().get("generation") or 0)


def published_after(node: NodeProcess, seen: int) -> Callable[[], bool]:
    return lambda: generation(node) > seen


def claim_across_publishes(node: NodeProcess, worker: str, publishes: int = 3) -> list[str]:
    """Every key the node grants, claimed until the keeper has republished the ring
    `publishes` times since the first claim: a key left out of one publish by mistake
    would be in a later one."""
    claimed: list[str] = []
    first = generation(node)
    while True:
        seen = generation(node)
        while batch := claim(node, 1000, worker):
            claimed += [x["key"] for x in batch]
        if seen >= first + publishes:
            return claimed
        wait_for(published_after(node, seen), 30, f"a publish after generation {seen}")


def table_survives(instance: str) -> bool:
    try:
        posix_ipc.SharedMemory(segment_name(instance, "leases")).close_fd()
    except posix_ipc.ExistentialError:
        return False
    return True


def test_leases_survive_a_crash_of_the_whole_node(tmp_path: Path, backend: str) -> None:
    seed_rows(node_db(tmp_path), ROWS)
    first = start(tmp_path)
    second: NodeProcess | None = None
    try:
        wait_exact(first)
        held = claim(first, LEASED, "fleet-a")
        answered = claim(first, ANSWERED, "fleet-a")
        assert (len(held), len(answered)) == (LEASED, ANSWERED)
        assert all(r["ok"] for r in complete(first, answered))
        kill_whole_node(first)
        assert not first.find_events("lease_snapshot_written")
        assert table_survives(first.instance)

        second = start(tmp_path, instance=first.instance)
        adopted = second.wait_event("lease_table_adopted")
        assert adopted["live_leases"] == LEASED and adopted["held_keys"] == 0
        assert first.process is not None and adopted["previous_pid"] == first.process.pid
        assert not second.find_events("lease_table_not_adopted")
        wait_exact(second)
        # Everything claimable goes to another worker, none of the leased keys, through
        # several publishes of the ring.
        others = claim_across_publishes(second, "fleet-b")
        assert not {x["key"] for x in held} & set(others)
        assert len(others) == len(set(others)) == ROWS - LEASED - ANSWERED
        # The tokens from before the crash complete their keys, once.
        results = complete(second, held)
        assert all(r["ok"] for r in results), results
        assert {r.get("error") for r in complete(second, held[:3])} == {"lease_not_held"}
        statistics = supervisor_statistics(second)
        assert statistics["lease_recovery"]["source"] == "segment"
        assert statistics["lease_recovery"]["live_leases"] == LEASED
    finally:
        if second is not None:
            second.stop()
        first.stop()


def supervisor_statistics(node: NodeProcess) -> dict[str, Any]:
    with node.client() as client:
        response = client.get("/prerender_admin/overview")
    assert response.status_code == 200, response.text
    supervisor: dict[str, Any] = response.json()["supervisor"]
    return supervisor


def test_a_surviving_table_wins_over_a_snapshot(tmp_path: Path) -> None:
    """A snapshot beside a surviving table is that table or an older one: the table is
    adopted and the file set aside, so a later start cannot load its ended leases."""
    seed_rows(node_db(tmp_path), ROWS)
    snapshot = tmp_path / "node.sqlite.leases"
    first = start(tmp_path)
    try:
        wait_exact(first)
        early = claim(first, 20, "fleet-a")
        first.signal(signal.SIGTERM)  # a graceful stop: its snapshot holds these 20
        assert first.wait(60) == 0
    finally:
        first.stop()
    assert snapshot.exists()
    second = start(tmp_path, instance=first.instance)
    third: NodeProcess | None = None
    try:
        assert second.wait_event("lease_snapshot_restored")["live_leases"] == 20
        wait_exact(second)
        # The 20 are answered now, and 30 more leased; a stale copy of the file stands in
        # for one a start could not remove.
        assert all(r["ok"] for r in complete(second, early))
        later = claim(second, 30, "fleet-a")
        assert len(later) == 30
        stale = snapshot.with_name("stale")
        early_snapshot(tmp_path, first.instance, stale)
        kill_whole_node(second)
        stale.rename(snapshot)

        third = start(tmp_path, instance=first.instance)
        adopted = third.wait_event("lease_table_adopted")
        assert adopted["live_leases"] == 30
        assert adopted["snapshot_superseded"] == str(snapshot) + SUPERSEDED_SUFFIX
        assert not third.find_events("lease_snapshot_restored")
        assert not snapshot.exists()
        wait_exact(third)
        others = set(claim_across_publishes(third, "fleet-b", publishes=1))
        assert not others & {x["key"] for x in later}
        assert len(others) == ROWS - 30 - 20
    finally:
        if third is not None:
            third.stop()
        second.stop()


def early_snapshot(directory: Path, instance: str, path: Path) -> None:
    """A snapshot of the 20 early leases, as the graceful stop wrote it: what a start that
    could not remove the file would find beside the table of a later crash."""
    secret = database_secret(directory)
    code = f"""
import sys
from shm import LeaseTable, key_hash
from shm import lease_snapshot as snap
from shm.keys import use_secret
from shm.segment import now_ms
use_secret({secret!r})
table = LeaseTable.create({segment_name(instance + "s", "leases")!r}, {LEASE_SLOTS})
try:
    for i in range(20):
        table.grant(key_hash(f"https://shop.example/p/{{i:07d}}".encode()), now_ms(), 300_000, 0)
    snap.save({str(path)!r}, table, instance={instance!r}, secret={secret!r}, now_ms=now_ms())
finally:
    table.close()
    table.unlink()
"""
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# A table left by a killed run that this node cannot take, made in a process that dies
# without unlinking it: (lease slots, secret given as "db" or "other", header rewrite).
MISFITS: dict[str, tuple[int, str, str, str]] = {
    "capacity": (LEASE_SLOTS // 2, "db", "", f"capacity {LEASE_SLOTS // 2}"),
    "secret": (LEASE_SLOTS, "other", "", "hash secret"),
    "layout": (
        LEASE_SLOTS,
        "db",
        "header['layout_version'] = header['layout_version'][0] + 1",
        "layout version",
    ),
}


def database_secret(directory: Path) -> bytes:
    store = open_store(node_db(directory))
    try:
        return store.hash_secret()
    finally:
        store.close()


def leave_misfit(directory: Path, instance: str, case: str) -> None:
    slots, which, rewrite, _ = MISFITS[case]
    secret = database_secret(directory)
    if which == "other":
        secret = bytes(reversed(secret))
    code = f"""
import os
import numpy as np
from shm import LeaseTable, key_hash
from shm.keys import use_secret
from shm.segment import HEADER, now_ms
use_secret({secret!r})
table = LeaseTable.create({segment_name(instance, "leases")!r}, {slots}, secret={secret!r})
for i in range(10):
    table.grant(key_hash(f"https://shop.example/p/{{i:07d}}".encode()), now_ms(), 300_000, 0)
header = np.frombuffer(table._segment.mmap, dtype=HEADER, count=1)
{rewrite}
del header
os._exit(0)
"""
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


@pytest.mark.parametrize("case", list(MISFITS))
def test_a_surviving_table_that_does_not_fit_is_replaced(tmp_path: Path, case: str) -> None:
    seed_rows(node_db(tmp_path), 50)
    node = NodeProcess(tmp_path, workers=2, extra_args=ARGS)
    leave_misfit(tmp_path, node.instance, case)
    assert table_survives(node.instance)
    try:
        node.start()
        rejected = node.wait_event("lease_table_not_adopted")
        assert MISFITS[case][3] in rejected["reason"] and rejected["level"] == "warning"
        assert not node.find_events("lease_table_adopted")
        wait_exact(node)
        # An empty table: every due key is claimable, the ten the old table leased too.
        assert len(claim_across_publishes(node, "fleet", publishes=1)) == 50
        recovery = supervisor_statistics(node)["lease_recovery"]
        assert recovery["source"] == "none" and MISFITS[case][3] in recovery["segment_rejected"]
    finally:
        node.stop()
