"""Leases across a restart of a real node: SIGTERM leaves the lease table beside the
database and the next start takes it back, so a fleet worker's token from before the
restart still completes its key and nobody else is granted the key meanwhile; a bad
snapshot is set aside with a log line and the node serves; SIGINT leaves none."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from node_harness import NodeProcess, now_ms, seed_rows, wait_for

from shm import LeaseTable, key_hash, segment_name
from shm import lease_snapshot as snap
from store.sqlite import SqliteStore

LEASE_SLOTS = 65536  # small, so the snapshot files of these tests are 2 MiB


def start(directory: Path, instance: str | None = None) -> NodeProcess:
    node = NodeProcess(
        directory,
        workers=2,
        instance=instance,
        extra_args=("--lease-slots", str(LEASE_SLOTS)),
    )
    return node.start()


def wait_exact(node: NodeProcess) -> None:
    """Until queue-state is served: the keeper has loaded every row and published."""
    with node.client() as client:
        wait_for(
            lambda: client.get("/prerender_admin/queue-state").status_code == 200,
            60,
            "an exact queue-state",
            0.1,
        )


def drain(node: NodeProcess, worker: str) -> list[dict[str, Any]]:
    """Every key the node will grant now."""
    claimed: list[dict[str, Any]] = []
    while batch := claim(node, 1000, worker):
        claimed += batch
    return claimed


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


def stop(node: NodeProcess, signum: int) -> None:
    node.signal(signum)
    assert node.wait(60) == 0
    node.wait_event("stopped")


def test_leases_survive_a_graceful_restart(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 300)
    snapshot = tmp_path / "node.sqlite.leases"
    first = start(tmp_path)
    try:
        wait_exact(first)
        held = claim(first, 100, "fleet-a")
        answered = claim(first, 20, "fleet-a")
        assert len(held) == 100 and len(answered) == 20
        assert all(r["ok"] for r in complete(first, answered))
        stop(first, signal.SIGTERM)
    finally:
        first.stop()
    written = first.find_events("lease_snapshot_written")
    assert len(written) == 1 and written[0]["path"] == str(snapshot)
    assert written[0]["live_leases"] == 100
    assert snapshot.exists()

    second = start(tmp_path, instance=first.instance)
    try:
        restored = second.wait_event("lease_snapshot_restored")
        assert restored["live_leases"] == 100 and restored["path"] == str(snapshot)
        assert not snapshot.exists()
        wait_exact(second)
        # Everything claimable goes to another worker, and none of the leased keys.
        others = drain(second, "fleet-b")
        assert len(others) == 300 - 100 - 20
        assert not {x["key"] for x in held} & {x["key"] for x in others}
        # The tokens from before the restart complete their keys.
        results = complete(second, held)
        assert all(r["ok"] for r in results), results
        assert [r["key"] for r in results] == [x["key"] for x in held]
        # And fence as before: used once, a token is stale.
        assert {r.get("error") for r in complete(second, held[:3])} == {"lease_not_held"}
    finally:
        second.stop()


def test_sigint_leaves_no_snapshot(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 50)
    node = start(tmp_path)
    try:
        wait_exact(node)
        assert claim(node, 10, "fleet-a")
        stop(node, signal.SIGINT)
    finally:
        node.stop()
    assert not node.find_events("lease_snapshot_written")
    assert sorted(p.name for p in tmp_path.iterdir() if "leases" in p.name) == []


def _database_secret(path: Path) -> bytes:
    store = SqliteStore(path)
    try:
        return store.hash_secret()
    finally:
        store.close()


def _valid_snapshot(path: Path, instance: str, secret: bytes) -> bytes:
    """A snapshot of ten leases, its hashes said to be made under `secret`."""
    table = LeaseTable.create(segment_name(instance + "x", "leases"), LEASE_SLOTS)
    try:
        for i in range(10):
            table.grant(key_hash(f"https://shop.example/p/{i:07d}".encode()), now_ms(), 60_000, 0)
        snap.save(path, table, instance=instance, secret=secret, now_ms=now_ms())
    finally:
        table.close()
        table.unlink()
    return path.read_bytes()


BAD: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "garbage": (lambda good: b"\x00garbage" * 100, "not a lease snapshot"),
    "truncated": (lambda good: good[: len(good) // 2], "truncated"),
    "corrupt": (lambda good: good[:-1] + bytes([good[-1] ^ 0xFF]), "checksum"),
    "other version": (
        lambda good: (
            good[:8] + (int.from_bytes(good[8:16], "little") + 1).to_bytes(8, "little") + good[16:]
        ),
        "layout version",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_snapshot_is_set_aside_and_the_node_serves(tmp_path: Path, case: str) -> None:
    seed_rows(tmp_path / "node.sqlite", 50)
    snapshot = tmp_path / "node.sqlite.leases"
    node = NodeProcess(tmp_path, workers=2, extra_args=("--lease-slots", str(LEASE_SLOTS)))
    corrupt, reason = BAD[case]
    secret = _database_secret(tmp_path / "node.sqlite")
    bad = corrupt(_valid_snapshot(snapshot, node.instance, secret))
    snapshot.write_bytes(bad)
    try:
        node.start()
        rejected = node.wait_event("lease_snapshot_rejected")
        assert reason in rejected["reason"] and rejected["level"] == "warning"
        assert rejected["moved_to"] == str(snapshot) + ".rejected"
        assert not node.find_events("lease_snapshot_restored")
        wait_exact(node)
        # An empty table: every due key is claimable, the ten the file named too.
        assert len(drain(node, "fleet")) == 50
    finally:
        node.stop()
    assert Path(str(snapshot) + ".rejected").read_bytes() == bad


def test_a_snapshot_under_another_databases_secret_is_set_aside(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 50)
    snapshot = tmp_path / "node.sqlite.leases"
    node = NodeProcess(tmp_path, workers=2, extra_args=("--lease-slots", str(LEASE_SLOTS)))
    other = bytes(reversed(_database_secret(tmp_path / "node.sqlite")))
    _valid_snapshot(snapshot, node.instance, other)
    try:
        node.start()
        rejected = node.wait_event("lease_snapshot_rejected")
        assert "hash secret" in rejected["reason"] and rejected["level"] == "warning"
        wait_exact(node)
        assert len(drain(node, "fleet")) == 50
    finally:
        node.stop()


def test_where_the_snapshot_goes(tmp_path: Path) -> None:
    from workers.config import load_settings
    from workers.lease_carryover import lease_snapshot_path

    db = tmp_path / "q.sqlite"
    assert lease_snapshot_path(load_settings(environ={}, flags={"db": str(db)}), "rqx") == Path(
        str(db.resolve()) + ".leases"
    )
    pg = load_settings(environ={}, flags={"db": "postgresql://u@h/d"})
    assert lease_snapshot_path(pg, "rqx") == Path("var/rqx.leases")
    chosen = load_settings(environ={"RENDERQUEUE_LEASE_SNAPSHOT": str(tmp_path / "l")})
    assert lease_snapshot_path(chosen, "rqx") == tmp_path / "l"
