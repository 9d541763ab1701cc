"""Claims under per-site politeness, with real processes: three claimant processes race a
node of three workers for keys of one dominant capped site (a worker SIGKILLed among
them), and a tally over every grant proves the site never has more live leases than its
cap; a site's spacing keeps its grants apart; an origin's Retry-After on a completion
blocks its site until then, after which its keys come in their order."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_harness import (
    ThreadNode,
    node_db,
    node_process,
    now_ms,
    seed_rows,
    thread_node,
    wait_for,
)

DOMINANT = "https://big.example/p/"
CAP = 4
LEASE_S = 5


def _seed_sites(directory: Path, dominant: int, others: int, sites: int) -> None:
    db = node_db(directory)
    seed_rows(db, dominant, prefix=DOMINANT)
    for n in range(sites):
        seed_rows(db, others, prefix=f"https://s{n}.example/p/")


def _claimant(url: str, name: str, grants: Any, stop: Any) -> None:
    """Claim without completing until told to stop; every grant goes to the parent as
    (key, granted at, expires at): the node's own times (lease_expires_at - lease_ms)."""
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            try:
                response = client.post(
                    "/v1/claims", json={"max": 25, "lease_s": LEASE_S, "worker": name}
                )
            except httpx.HTTPError:
                continue  # a worker killed under the request: the next one is another's
            if response.status_code != 200:
                continue
            leases = response.json()["leases"]
            if leases:
                grants.put(
                    [
                        (
                            lease["key"],
                            lease["lease_expires_at"] - lease["lease_ms"],
                            lease["lease_expires_at"],
                        )
                        for lease in leases
                    ]
                )


def _most_live(intervals: list[tuple[int, int]]) -> int:
    """The most intervals [start, end) live at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    live = most = 0
    for _, step in events:  # an end sorts before a start at the same instant
        live += step
        most = max(most, live)
    return most


def _race(url: str, until: Any, on_grants: Any = None, timeout_s: float = 120) -> list[Any]:
    """Three claimant processes until `until(grants)` holds; every grant they saw."""
    ctx = multiprocessing.get_context("spawn")
    grants: Any = ctx.Queue()
    stop = ctx.Event()
    claimants = [ctx.Process(target=_claimant, args=(url, f"c{i}", grants, stop)) for i in range(3)]
    for process in claimants:
        process.start()
    seen: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        while not until(seen):
            assert time.monotonic() < deadline, f"{len(seen)} grants, condition not met"
            try:
                seen.extend(grants.get(timeout=0.5))
            except queue.Empty:
                continue
            if on_grants is not None:
                on_grants(seen)
    finally:
        stop.set()
        for process in claimants:
            process.join(30)
            if process.is_alive():
                process.kill()
    while True:  # what was sent before the stop
        try:
            seen.extend(grants.get(timeout=0.2))
        except queue.Empty:
            break
    return seen


def test_a_dominant_capped_site_never_has_more_leases_than_its_cap(tmp_path: Path) -> None:
    """1,200 of 2,000 due keys on one site capped at 4, the rest on 40 sites; three
    claimant processes against three workers, nothing completed, so each permit comes
    back only when its lease ends. A worker is SIGKILLed once the site's first permits
    are out: whatever it held when it died ends with its leases."""
    _seed_sites(tmp_path, 1200, 20, 40)
    with node_process(tmp_path, workers=3) as node:
        with node.client() as client:
            assert client.put("/v1/sites/big.example", json={"max_in_flight": CAP}).is_success
        killed: list[int] = []

        def dominant(seen: list[Any]) -> list[Any]:
            return [g for g in seen if g[0].startswith(DOMINANT)]

        def kill_once(seen: list[Any]) -> None:
            if not killed and len(dominant(seen)) >= CAP:
                pid = node.worker_pid(1)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)

        # Three rounds of the cap after the kill: permits came back more than once.
        seen = _race(node.url, lambda s: len(dominant(s)) >= 3 * CAP + CAP, kill_once)
        grants = dominant(seen)
        assert killed and len(grants) >= 4 * CAP
        assert _most_live([(start, end) for _, start, end in grants]) <= CAP
        by_key: dict[str, list[tuple[int, int]]] = {}
        for key, start, end in grants:  # a key is granted again once its hold has ended
            by_key.setdefault(key, []).append((start, end))
        assert all(_most_live(leases) == 1 for leases in by_key.values())
        others = [g for g in seen if not g[0].startswith(DOMINANT)]
        assert len(others) >= 700  # the other sites were served meanwhile
        with node.client() as client:
            state = client.get("/v1/sites/big.example").json()
        assert state["in_force"]["max_in_flight"] == CAP and state["in_flight"] <= CAP
        print(f"dominant grants {len(grants)}, others {len(others)}, killed worker {killed}")


def test_a_sites_spacing_keeps_its_grants_apart(tmp_path: Path) -> None:
    _seed_sites(tmp_path, 300, 20, 10)
    with node_process(tmp_path, workers=3) as node:
        with node.client() as client:
            assert client.put("/v1/sites/big.example", json={"min_interval_ms": 200}).is_success
        seen = _race(node.url, lambda s: sum(g[0].startswith(DOMINANT) for g in s) >= 15)
        times = sorted(start for key, start, _ in seen if key.startswith(DOMINANT))
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert len(times) >= 15 and min(gaps) >= 200, gaps


@pytest.fixture
def backoff_node(tmp_path: Path) -> Any:
    from store import open_store
    from store.rows import RowWrite

    db = node_db(tmp_path)
    now = now_ms()
    store = open_store(str(db))
    # The slow site's keys are the most overdue, in this order; the filler's come after.
    store.write(
        [
            RowWrite(
                key=f"https://slow.example/p/{i:07d}",
                route="product",
                cadence_s=3600,
                next_render_at=now - 9_000_000 + i * 1000,
            )
            for i in range(8)
        ]
        + [
            RowWrite(
                key=f"https://fill.example/p/{i:07d}",
                route="product",
                cadence_s=3600,
                next_render_at=now - 60_000 + i,
            )
            for i in range(200)
        ]
    )
    store.close()
    with thread_node(tmp_path) as running:
        running.wait_published()
        yield running


def test_an_origins_retry_after_blocks_its_site_then_its_keys_come_in_order(
    backoff_node: ThreadNode,
) -> None:
    node = backoff_node
    slow = "https://slow.example/p/"
    with node.client() as client:

        def claim(count: int) -> list[dict[str, Any]]:
            response = client.post("/v1/claims", json={"max": count, "lease_s": 60, "worker": "t"})
            assert response.status_code == 200, response.text
            leases: list[dict[str, Any]] = response.json()["leases"]
            return leases

        first = wait_for(lambda: claim(1), 30, "a first grant")
        (lease,) = first
        assert lease["key"].startswith(slow)
        due_order = sorted(
            (node.store.get(f"{slow}{i:07d}").next_render_at, f"{slow}{i:07d}")  # type: ignore[union-attr]
            for i in range(8)
        )
        done = client.post(
            "/v1/completions",
            json={
                "items": [
                    {
                        "key": lease["key"],
                        "token": lease["token"],
                        "outcome": "failed",
                        "site_retry_after_s": 5,
                    }
                ]
            },
        ).json()["results"][0]
        assert done["ok"] and "held_until" not in done
        until = done["site_blocked_until"]
        assert until >= lease["lease_expires_at"] - lease["lease_ms"] + 5_000
        row = node.store.get(lease["key"])
        assert row is not None and row.last_outcome is None  # nothing written: handed back
        state = client.get("/v1/sites/slow.example").json()
        assert (state["blocked_until"], state["blocked_reason"]) == (until, "retry_after")
        granted: list[tuple[int, str]] = []
        while not [key for _, key in granted if key.startswith(slow)][4:]:
            for got in claim(1):
                granted.append((got["lease_expires_at"] - got["lease_ms"], got["key"]))
            assert now_ms() < until + 30_000, "the site's keys never came back"
        slow_grants = [(at, key) for at, key in granted if key.startswith(slow)]
        assert all(at >= until for at, _ in slow_grants), (until, slow_grants[:3])
        assert [key for _, key in slow_grants] == [key for _, key in due_order[:5]]
        assert any(at < until for at, key in granted if not key.startswith(slow))
