"""A cluster of real node processes on one real PostgreSQL.

Every row is held by exactly one keeper, the one rendezvous hashing names, and each
keeper's counts equal its share of the table: with two nodes, then three (a join),
then two again (a clean leave), while a writer keeps writing. Then one of three is
SIGKILLed mid-run while claimants take leases from every node: the survivors take its
rows over, and a tally of every grant and completion shows no key held by two
claimants at once.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psycopg
import pytest
from node_harness import NodeProcess, nodes_on, now_ms, seed_rows, wait_for

from keeper.ownership import winners
from shm.keys import keyed_hash
from store.postgres import PostgresStore
from store.rows import RowWrite

# Fast membership for tests: dead after 4 s, a grant window of 2 s, leases of at most 5 s.
CLUSTER_ARGS = ("--heartbeat-s", "0.5", "--node-ttl-s", "4", "--max-lease-s", "5")


@contextlib.contextmanager
def cluster(tmp_path: Path, url: str, names: list[str]) -> Iterator[dict[str, NodeProcess]]:
    nodes: dict[str, NodeProcess] = {}
    with nodes_on(lambda directory: url):
        try:
            for name in names:
                nodes[name] = start_node(tmp_path, name)
            yield nodes
        finally:
            for node in nodes.values():
                node.stop()


def start_node(tmp_path: Path, name: str) -> NodeProcess:
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    node = NodeProcess(directory, workers=1, extra_args=("--node", name, *CLUSTER_ARGS))
    return node.start()


def shares(url: str, names: list[str], now: int) -> dict[str, tuple[int, int]]:
    """Each node's (rows, due rows) of the table, by rendezvous over `names`."""
    store = PostgresStore(url)
    try:
        rows = store.walk(None, 1_000_000)
        secret = store.hash_secret()  # what the nodes hash under, not this process's
    finally:
        store.close()
    ordered = sorted(names)
    hashes = np.array([keyed_hash(secret, r.key.encode()) for r in rows], dtype=np.uint64)
    owners = winners(hashes, ordered) if len(rows) else np.zeros(0, dtype=np.intp)
    due = np.array([r.next_render_at <= now for r in rows], dtype=np.bool_)
    return {
        name: (int((owners == i).sum()), int(((owners == i) & due).sum()))
        for i, name in enumerate(ordered)
    }


def queue_state(node: NodeProcess) -> dict[str, Any] | None:
    with node.client() as client:
        response = client.get("/prerender_admin/queue-state")
    return response.json() if response.status_code == 200 else None


def each_equals_its_share(url: str, nodes: dict[str, NodeProcess]) -> dict[str, Any] | None:
    """Every node exact, live under the same view, and holding exactly its share."""
    states = {name: queue_state(node) for name, node in nodes.items()}
    if any(s is None for s in states.values()):
        return None
    expected = shares(url, list(nodes), now_ms())
    for name, state in states.items():
        assert state is not None
        held = state["trust"]["held"]
        if held != expected[name][0] or state["trust"]["phase"] != "live":
            return None
    return states


def overview(node: NodeProcess) -> dict[str, Any]:
    with node.client() as client:
        found: dict[str, Any] = client.get("/prerender_admin/overview").json()
    return found


class Writer:
    """A steady stream of upserts and deletes through the store, until stopped; paused
    while the shares are compared, since a count caught mid-stream trails the table."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop = threading.Event()
        self.hold = threading.Event()
        self.held = threading.Event()
        self.writes = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self.hold.set()
        try:
            wait_for(self.held.is_set, 30, "the writer to pause")
            yield
        finally:
            self.hold.clear()
            self.held.clear()

    def _run(self) -> None:
        store = PostgresStore(self.url)
        rng = np.random.default_rng(5)
        try:
            while not self.stop.is_set():
                if self.hold.is_set():
                    self.held.set()
                    time.sleep(0.02)
                    continue
                now = now_ms()
                ups = [
                    RowWrite(
                        key=f"https://shop.example/w/{int(k)}",
                        route="product",
                        next_render_at=now + int(rng.integers(-3_600_000, 3_600_000)),
                        cadence_s=3600,
                    )
                    for k in rng.integers(0, 3000, 20)
                ]
                gone = [f"https://shop.example/w/{int(rng.integers(3000, 3100))}"]
                store.write(ups, delete=gone)
                self.writes += 1
                time.sleep(0.02)
        finally:
            store.close()

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


@pytest.mark.slow
def test_two_then_three_then_two_nodes_each_hold_exactly_their_share(
    tmp_path: Path, pg_url: str
) -> None:
    seed_rows(pg_url, 6000, due_share=0.4)
    with cluster(tmp_path, pg_url, ["a", "b"]) as nodes, Writer(pg_url) as writer:
        with writer.paused():
            wait_for(lambda: each_equals_its_share(pg_url, nodes), 60, "two exact shares", 0.3)
        # A third joins under the write load: it takes its third; the others drop theirs.
        nodes["c"] = start_node(tmp_path, "c")
        with writer.paused():
            states = wait_for(lambda: each_equals_its_share(pg_url, nodes), 60, "three", 0.3)
        assert states is not None
        held = {name: s["trust"]["held"] for name, s in states.items()}
        assert min(held.values()) > 0.25 * sum(held.values())
        repairs = {name: overview(node)["keeper"]["repairs"] for name, node in nodes.items()}
        assert repairs["c"]["missed_added"] == 0  # c loaded; nothing was missed
        assert all(
            r["missed_added"] + r["missed_changed"] + r["missed_removed"] == 0
            for r in repairs.values()
        )
        # c leaves cleanly: a and b gain its rows, counted as gained, not as missed writes.
        nodes.pop("c").stop()
        with writer.paused():
            wait_for(lambda: each_equals_its_share(pg_url, nodes), 60, "two shares again", 0.3)
        for name in ("a", "b"):
            keeper = overview(nodes[name])["keeper"]
            assert keeper["repairs"]["gained"] > 0
            assert keeper["repairs"]["missed_added"] == 0
            assert keeper["cluster"]["view"] == ["a", "b"]
        assert writer.writes > 50


class Claimant:
    """Claims from one node until stopped, completing every other lease; logs each."""

    def __init__(self, node: NodeProcess, name: str) -> None:
        self.node = node
        self.name = name
        self.stop = threading.Event()
        # (key, node, asked at, answered at, held until at the latest, released at least by)
        self.leases: list[tuple[str, str, int, int, int, int]] = []
        self.errors = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client = httpx.Client(base_url=self.node.url, timeout=5)
        turn = 0
        while not self.stop.is_set():
            asked = now_ms()
            try:
                response = client.post(
                    "/v1/claims", json={"max": 20, "worker": self.name, "lease_s": 5}
                )
            except httpx.HTTPError:
                self.errors += 1
                time.sleep(0.1)
                continue
            answered = now_ms()
            if response.status_code != 200:
                time.sleep(0.1)
                continue
            leases = response.json()["leases"]
            done: list[dict[str, Any]] = []
            for lease in leases:
                turn += 1
                end = int(lease["lease_expires_at"])
                if turn % 2 == 0:
                    done.append(lease)
                    continue
                self.leases.append((lease["key"], self.node_name, asked, answered, end, end))
            if done:
                sent = now_ms()
                items = [
                    {"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in done
                ]
                try:
                    results = client.post("/v1/completions", json={"items": items}).json()
                    oks = [result["ok"] for result in results["results"]]
                except httpx.HTTPError:  # the node died: its leases run to their end
                    oks = [False] * len(done)
                for lease, ok in zip(done, oks, strict=True):
                    end = int(lease["lease_expires_at"])
                    # Released by the completion (after it was sent) if it took.
                    released = sent if ok else end
                    self.leases.append(
                        (lease["key"], self.node_name, asked, answered, end, released)
                    )
            time.sleep(0.05)
        client.close()

    @property
    def node_name(self) -> str:
        return self.name.split("-")[0]


@pytest.mark.slow
def test_sigkill_one_of_three_its_rows_move_and_no_key_is_held_twice(
    tmp_path: Path, pg_url: str
) -> None:
    # Every row due: claims compete for the same keys across the takeover.
    seed_rows(pg_url, 3000, due_share=1.0)
    with cluster(tmp_path, pg_url, ["a", "b", "c"]) as nodes:
        wait_for(lambda: each_equals_its_share(pg_url, nodes), 60, "three exact shares", 0.3)
        claimants = [Claimant(node, f"{name}-claimant") for name, node in nodes.items()]
        for claimant in claimants:
            claimant.thread.start()
        wait_for(
            lambda: all(claimant.leases for claimant in claimants), 120, "every node to grant", 0.1
        )
        victim = nodes["c"]
        assert victim.process is not None
        killed_at = now_ms()
        victim.process.send_signal(signal.SIGKILL)
        victim.wait(10)
        nodes.pop("c").stop()  # only its segments are left to remove
        try:
            states = wait_for(
                lambda: each_equals_its_share(pg_url, nodes), 60, "two shares after the kill", 0.3
            )
            assert states is not None
            c_leased = {lease[0] for x in claimants if x.node_name == "c" for lease in x.leases}

            def survivors_took_a_key_c_leased() -> bool:
                return any(
                    lease[0] in c_leased and lease[2] > killed_at
                    for claimant in claimants
                    if claimant.node_name != "c"
                    for lease in list(claimant.leases)
                )

            # Once c's leases can no longer live (its lease ceiling), its keys are granted.
            wait_for(survivors_took_a_key_c_leased, 120, "a survivor to grant c's keys", 0.2)
        finally:
            for claimant in claimants:
                claimant.stop.set()
            for claimant in claimants:
                claimant.thread.join(30)
    leases = [lease for claimant in claimants for lease in claimant.leases]
    by_key: dict[str, list[tuple[str, str, int, int, int, int]]] = {}
    for lease in leases:
        by_key.setdefault(lease[0], []).append(lease)
    held_twice = []
    for key, taken in by_key.items():
        taken.sort(key=lambda lease: lease[2])
        for first, second in itertools.combinations(taken, 2):
            # Surely granted after the first was granted, and surely before it was released.
            if second[2] > first[3] and second[3] < first[5]:
                held_twice.append((key, first, second))
    assert held_twice == []
    c_keys = {k for k, taken in by_key.items() if any(lease[1] == "c" for lease in taken)}
    assert c_keys, "the victim granted nothing before the kill: nothing was tested"
    retaken = [
        lease for lease in leases if lease[0] in c_keys and lease[1] != "c" and lease[2] > killed_at
    ]
    assert retaken, "no survivor granted a key the victim had leased"
    store = PostgresStore(pg_url)
    try:
        assert store.count() == 3000  # nothing lost
    finally:
        store.close()


def test_a_node_naming_a_peer_waits_for_it_and_a_taken_name_is_refused(
    tmp_path: Path, pg_url: str
) -> None:
    seed_rows(pg_url, 500, due_share=0.5)
    with nodes_on(lambda directory: pg_url):
        (tmp_path / "a").mkdir()
        waiting = NodeProcess(
            tmp_path / "a", workers=1, extra_args=("--node", "a", "--peers", "b", *CLUSTER_ARGS)
        )
        waiting.start(wait_ready=False)
        try:

            def says_it_waits_for_b() -> bool:
                try:
                    with waiting.client() as client:
                        response = client.get("/prerender_admin/queue-state")
                except httpx.HTTPError:
                    return False  # not listening yet
                return "waiting to see a peer live (b)" in response.text

            wait_for(says_it_waits_for_b, 60, "a to say it waits for b", 0.2)
            with waiting.client() as client:
                response = client.get("/prerender_admin/queue-state")
            assert response.status_code == 503
            # Another node may not take a live node's name.
            (tmp_path / "a2").mkdir()
            twin = NodeProcess(
                tmp_path / "a2", workers=1, extra_args=("--node", "a", *CLUSTER_ARGS)
            )
            with pytest.raises(AssertionError, match="is taken by a live node"):
                twin.start()
            twin.stop()
            peer = start_node(tmp_path, "b")
            try:
                nodes = {"a": waiting, "b": peer}
                wait_for(lambda: each_equals_its_share(pg_url, nodes), 60, "two shares", 0.3)
                # A clean stop leaves (its row says so), so the other holds every row
                # without waiting for the row to age out.
                peer.stop()
                with psycopg.connect(pg_url, autocommit=True) as conn:
                    row = conn.execute("SELECT left_at FROM nodes WHERE node = 'b'").fetchone()
                assert row is not None and row[0] is not None
                wait_for(lambda: each_equals_its_share(pg_url, {"a": waiting}), 60, "a alone", 0.1)
            finally:
                peer.stop()
        finally:
            waiting.stop()
