"""Site caps and blocks across a cluster that owns keys by site (`--ownership site`), with
three real node processes on one real PostgreSQL and a claimant process racing each
node: a site capped at 3 never has more than 3 live leases cluster-wide (a tally over
every grant of every node), also while the node that owns it is SIGKILLed and the site
moves whole to another node; an origin's Retry-After sent to any node blocks its site at
every node until then, also after the node that owns it leaves and the site moves with its
block.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import queue
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import schema_url
from node_harness import (
    ADMIN_TOKEN,
    FLEET_TOKEN,
    NodeProcess,
    nodes_on,
    now_ms,
    seed_rows,
    wait_for,
)

NAMES = ("a", "b", "c")
# Fast membership: dead after 3 s, a grant window of 1.5 s, leases of at most 5 s.
CLUSTER_ARGS = (
    *("--heartbeat-s", "0.5", "--node-ttl-s", "3", "--max-lease-s", "5"),
    *("--ownership", "site"),
)
LEASE_S = 5
BIG, SLOW = "https://big.example/p/", "https://slow.example/p/"
MOVING = "https://moving.example/p/"
CAP = 3
# A grant as the claimants report it: (key, granting node, granted at, lease end), in the
# nodes' own clock (one host: one clock).
Grant = tuple[str, str, int, int]


def _claimant(url: str, grants: Any, ready: Any, go: Any, stop: Any) -> None:
    """Claim without completing from `go` until `stop`; every grant goes to the parent."""
    headers = {"Authorization": f"Bearer {FLEET_TOKEN}"}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as client:
        ready.release()
        go.wait()
        while not stop.is_set():
            try:
                response = client.post(
                    "/v1/claims", json={"max": 20, "lease_s": LEASE_S, "worker": "race"}
                )
            except httpx.HTTPError:
                time.sleep(0.2)  # its node was killed: nothing more comes from it
                continue
            if response.status_code != 200:
                time.sleep(0.05)
                continue
            grants.put([_grant(lease) for lease in response.json()["leases"]])


def _grant(lease: dict[str, Any]) -> Grant:
    end = int(lease["lease_expires_at"])
    return lease["key"], lease["node"], end - int(lease["lease_ms"]), end


def _race(
    nodes: dict[str, NodeProcess],
    until: Callable[[list[Grant]], bool],
    on_grants: Callable[[list[Grant]], None] | None = None,
    prepare: Callable[[], None] | None = None,
    timeout_s: float = 90,
) -> list[Grant]:
    """A claimant process per node until `until(grants)` holds; every grant they saw.
    `prepare` runs once every claimant is started and ready, just before they claim."""
    ctx = multiprocessing.get_context("spawn")
    grants: Any = ctx.Queue()
    ready, go, stop = ctx.Semaphore(0), ctx.Event(), ctx.Event()
    claimants = [
        ctx.Process(target=_claimant, args=(node.url, grants, ready, go, stop))
        for node in nodes.values()
    ]
    for process in claimants:
        process.start()
    seen: list[Grant] = []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in claimants:
            assert ready.acquire(timeout=60), "a claimant process never started"
        if prepare is not None:
            prepare()
        go.set()
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
        go.set()
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


def _most_live(intervals: list[tuple[int, int]]) -> int:
    """The most intervals [start, end) live at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    live = most = 0
    for _, step in events:  # an end sorts before a start at the same instant
        live += step
        most = max(most, live)
    return most


def _of(site: str, grants: list[Grant]) -> list[Grant]:
    return [grant for grant in grants if grant[0].startswith(site)]


def _client(node: NodeProcess, token: str) -> httpx.Client:
    return httpx.Client(base_url=node.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@contextlib.contextmanager
def _three_nodes(tmp_path: Path, url: str) -> Iterator[dict[str, NodeProcess]]:
    nodes: dict[str, NodeProcess] = {}
    with nodes_on(lambda directory: url):
        try:
            for name in NAMES:
                directory = tmp_path / name
                directory.mkdir(exist_ok=True)
                peers = ",".join(n for n in NAMES if n != name)
                nodes[name] = NodeProcess(
                    directory,
                    workers=1,
                    tokens=True,
                    extra_args=("--node", name, "--peers", peers, *CLUSTER_ARGS),
                ).start(wait_ready=False)
            for node in nodes.values():
                node.wait_event("node_ready")
            yield nodes
        finally:
            for node in nodes.values():
                node.stop()


def _unfenced(node: NodeProcess) -> bool:
    with _client(node, ADMIN_TOKEN) as client:
        response = client.get("/prerender_admin/cluster/queue-state")
    return response.status_code == 200 and response.json()["fenced"]["due"] == 0


def _capped_everywhere(nodes: dict[str, NodeProcess]) -> bool:
    for node in nodes.values():
        with _client(node, ADMIN_TOKEN) as client:
            state = client.get("/v1/sites/big.example").json()
        if state["in_force"]["max_in_flight"] != CAP:
            return False
    return True


Trio = tuple[str, dict[str, NodeProcess]]  # the store's URL, the nodes live


@pytest.fixture(scope="module")
def trio(pg_database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    """Three nodes owning keys by site: 300 keys of big.example (capped at 3 once the
    nodes are up), 12 of slow.example (the most overdue), 12 sites of 15 keys."""
    import psycopg

    schema = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    url = schema_url(pg_database, schema)
    seed_rows(url, 12, prefix=SLOW, now=now_ms() - 7_200_000)
    seed_rows(url, 300, prefix=BIG)
    for n in range(12):
        seed_rows(url, 15, prefix=f"https://s{n}.example/p/")
    with _three_nodes(tmp_path_factory.mktemp("trio"), url) as nodes:
        wait_for(lambda: _unfenced(nodes["a"]), 90, "the joins' fences ended", 0.25)
        with _client(nodes["b"], ADMIN_TOKEN) as client:
            put = client.put("/v1/sites/big.example", json={"max_in_flight": CAP})
            assert put.is_success, put.text
        wait_for(lambda: _capped_everywhere(nodes), 30, "the cap in force on every node", 0.2)
        yield url, nodes


def _assert_capped(grants: list[Grant]) -> None:
    big = _of(BIG, grants)
    assert _most_live([(start, end) for _, _, start, end in big]) <= CAP, sorted(
        big, key=lambda grant: grant[2]
    )
    by_key: dict[str, list[tuple[int, int]]] = {}
    for key, _, start, end in big:
        by_key.setdefault(key, []).append((start, end))
    assert all(_most_live(leases) == 1 for leases in by_key.values())


def _first_of(site: str, nodes: dict[str, NodeProcess], taken: list[Grant]) -> dict[str, Any]:
    """One key at a time from each node until a key of `site` is granted (its keys are
    the most overdue, so its owner's next grant is one); every grant goes to `taken`."""
    first: dict[str, Any] = {}

    def granted() -> bool:
        for node in nodes.values():
            with _client(node, FLEET_TOKEN) as client:
                response = client.post(
                    "/v1/claims", json={"max": 1, "lease_s": LEASE_S, "worker": "t"}
                )
            assert response.status_code == 200, response.text
            for lease in response.json()["leases"]:
                taken.append(_grant(lease))
                if lease["key"].startswith(site) and not first:
                    first.update(lease)
        return bool(first)

    wait_for(granted, 30, f"a key of {site} granted", 0.1)
    return first


def _retry_after(node: NodeProcess, lease: dict[str, Any], seconds: int) -> int | None:
    """Complete `lease` at `node` as the origin refusing it for `seconds`; the block's end,
    or None when the lease had already ended (a loaded host can take longer than its term
    between the grant and this completion): take another grant then."""
    item = {"key": lease["key"], "token": lease["token"], "outcome": "failed"}
    item["site_retry_after_s"] = seconds
    with _client(node, FLEET_TOKEN) as client:
        response = client.post("/v1/completions", json={"items": [item]})
    assert response.status_code == 200, response.text
    (done,) = response.json()["results"]
    if not done["ok"] and done["error"] == "lease_not_held":
        return None
    assert done["ok"], done
    until: int = done["site_blocked_until"]
    return until


def test_a_retry_after_sent_to_any_node_blocks_its_site_at_every_node(trio: Trio) -> None:
    _, nodes = trio
    taken: list[Grant] = []  # this test's own grants, tallied with the claimants'
    block: list[tuple[str, int]] = []

    def blocked() -> None:
        # Granted once the claimants have started, so the lease is held when its completion
        # arrives however slow their start was; sent to another node than the owner:
        # forwarded there.
        def blocked_once() -> tuple[str, int] | None:
            first = _first_of(SLOW, nodes, taken)
            elsewhere = next(node for name, node in nodes.items() if name != first["node"])
            until = _retry_after(elsewhere, first, 4)
            return None if until is None else (first["node"], until)

        block.append(wait_for(blocked_once, 60, f"a lease of {SLOW} refused by its origin"))

    seen = _race(nodes, lambda s: len({g[0] for g in _of(SLOW, s)}) >= 3, prepare=blocked)
    ((owner, until),) = block
    slow = _of(SLOW, seen)
    assert all(at >= until for _, _, at, _ in slow), (until, slow[:3])
    assert {name for _, name, _, _ in slow} == {owner}  # its keys are all one node's
    assert [g for g in seen if g[2] < until and not g[0].startswith(SLOW)]  # others served
    _assert_capped(taken + seen)


def test_a_block_moves_with_its_site_when_the_owner_leaves(trio: Trio) -> None:
    """The owner of a blocked site stops cleanly: the node that gains the site takes the
    block with it, and grants none of its keys before the block ends."""
    url, nodes = trio
    seed_rows(url, 10, prefix=MOVING, now=now_ms() - 10_800_000)
    taken: list[Grant] = []
    first = _first_of(MOVING, nodes, taken)
    owner = first["node"]
    leaver = nodes.pop(owner)
    block: list[int] = []

    def blocked_and_left() -> None:
        # A lease of the site taken anew once the claimants have started: the first may
        # have ended during their start.
        block.append(
            wait_for(
                lambda: _retry_after(leaver, _first_of(MOVING, {owner: leaver}, taken), 10),
                60,
                f"a lease of {MOVING} refused by its origin",
            )
        )
        leaver.stop()  # a clean leave: its leases and its blocks handed over
        block.append(now_ms())

    seen = _race(
        nodes, lambda s: len({g[0] for g in _of(MOVING, s)}) >= 2, prepare=blocked_and_left
    )
    until, left_at = block
    moving = _of(MOVING, seen)
    assert all(at >= until for _, _, at, _ in moving), (until, left_at, moving[:3])
    assert len({name for _, name, _, _ in moving}) == 1 and owner not in {g[1] for g in moving}
    assert [g for g in seen if left_at <= g[2] < until]  # the others were granted meanwhile
    _assert_capped(taken + seen)


def test_a_capped_site_holds_its_cap_across_nodes_and_a_sigkill_of_its_owner(
    trio: Trio,
) -> None:
    nodes = dict(trio[1])
    killed: dict[str, int] = {}

    def kill_the_owner(seen: list[Grant]) -> None:
        big = _of(BIG, seen)
        if killed or len(big) < CAP:
            return
        owner = big[0][1]
        victim = nodes[owner]
        assert victim.process is not None
        killed[owner] = now_ms()
        victim.process.send_signal(signal.SIGKILL)
        victim.wait(10)

    def moved(seen: list[Grant]) -> bool:
        if not killed:
            return False
        (gone,) = killed
        return len([g for g in _of(BIG, seen) if g[1] != gone]) >= 2 * CAP

    seen = _race(nodes, moved, kill_the_owner)
    (gone,) = killed
    big = _of(BIG, seen)
    before = {name for _, name, at, _ in big if at < killed[gone]}
    after = {name for _, name, at, _ in big if at >= killed[gone]} - {gone}
    _assert_capped(seen)
    assert before == {gone} and len(after) == 1, (before, after)  # the site moved whole
    assert len({g[0] for g in seen if not g[0].startswith(BIG)}) >= 60  # the rest served
    print(f"big.example grants {len(big)}: {gone} then {after}; {len(seen)} grants in all")
