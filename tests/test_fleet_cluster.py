"""The fleet against a cluster of real node processes on one real PostgreSQL: it finds
every node from one URL, spreads its claims over them, follows a join and a leave, and
sends each result to the node that granted the lease (none forwarded, none refused).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
from conftest import schema_url
from node_harness import FLEET_TOKEN, NodeProcess, nodes_on, seed_rows, wait_for

from fleet.client import AsyncFleetClient
from fleet.cluster import ClusterDirectory
from fleet.messages import Lease
from fleet.renderers import RenderResult
from fleet.runner import FleetConfig, FleetRunner, FleetStatistics

CLUSTER_ARGS = ("--heartbeat-s", "0.5", "--node-ttl-s", "4", "--max-lease-s", "10")


def fresh_schema(database: str) -> str:
    import psycopg

    schema = f"f_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return schema_url(database, schema)


def start(tmp_path: Path, name: str, *peers: str) -> NodeProcess:
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    extra = ("--node", name, *(("--peers", ",".join(peers)) if peers else ()), *CLUSTER_ARGS)
    return NodeProcess(directory, workers=1, tokens=True, extra_args=extra).start()


class Tally:
    """Every lease the fleet rendered, by the node that granted it (its token's prefix)."""

    def __init__(self) -> None:
        self.by_node: dict[str, int] = {}
        self.lock = threading.Lock()

    async def __call__(self, lease: Lease) -> RenderResult:
        await asyncio.sleep(0.02)
        with self.lock:
            granted_by = lease.token.partition(":")[0]
            assert lease.node == granted_by
            self.by_node[granted_by] = self.by_node.get(granted_by, 0) + 1
        return RenderResult(outcome="rendered")


def run_fleet(
    seeds: list[str], steps: Callable[[FleetRunner], None]
) -> tuple[FleetStatistics, list[str]]:
    """Run a fleet on a thread of its own while `steps` drive the nodes; its statistics and
    its log."""
    log: list[str] = []
    result: list[FleetStatistics] = []
    ready = threading.Event()
    holder: list[FleetRunner] = []
    loop = asyncio.new_event_loop()

    def client_for(url: str) -> AsyncFleetClient:
        return AsyncFleetClient(url, token=FLEET_TOKEN, worker="test-fleet")

    async def main() -> None:
        directory = ClusterDirectory(seeds, client_for, token=FLEET_TOKEN, log=log.append)
        config = FleetConfig(
            concurrency=6, lease_s=10, wait_s=2, grace_s=5, state_every_s=1, discover_every_s=0.5
        )
        runner = FleetRunner(None, Tally(), config, log=log.append, directory=directory)
        holder.append(runner)
        ready.set()
        try:
            result.append(await runner.run())
        finally:
            await directory.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    try:
        ready.wait(30)
        steps(holder[0])
    finally:
        if holder:
            loop.call_soon_threadsafe(holder[0].request_stop)
        thread.join(60)
    assert result, f"the fleet did not stop; log: {log[-20:]}"
    return result[0], log


def test_the_fleet_spreads_over_the_cluster_and_follows_a_join_and_a_leave(
    pg_database: str, tmp_path: Path
) -> None:
    url = fresh_schema(pg_database)
    seed_rows(url, 20_000, due_share=1.0)
    with nodes_on(lambda directory: url):
        a = start(tmp_path, "a")
        b: NodeProcess | None = None
        try:

            def steps(runner: FleetRunner) -> None:
                nonlocal b

                def claimed(name: str) -> int:
                    counts = runner.statistics().nodes.get(name)
                    return 0 if counts is None else counts.claimed

                wait_for(lambda: claimed("a") > 20, 60, "claims from a")
                b = start(tmp_path, "b", "a")  # joins: the fleet finds it through a
                wait_for(lambda: claimed("b") > 20, 60, "claims from b once it joined", 0.2)
                # Both keep giving: claims spread over the two.
                before = {n: c.claimed for n, c in runner.statistics().nodes.items()}

                def both_gave() -> dict[str, int] | None:
                    now = {n: c.claimed for n, c in runner.statistics().nodes.items()}
                    grew = all(now[n] > before[n] + 10 for n in ("a", "b"))
                    return now if grew else None

                after = wait_for(both_gave, 30, "claims from both nodes", 0.2)
                b.stop()  # leaves: the fleet stops claiming there
                wait_for(
                    lambda: not runner.statistics().nodes["b"].live, 30, "b gone from the list"
                )
                settled = runner.statistics().nodes["b"].claimed
                wait_for(
                    lambda: runner.statistics().nodes["a"].claimed > after["a"] + 50,
                    60,
                    "a alone goes on",
                )
                assert runner.statistics().nodes["b"].claimed == settled

            stats, log = run_fleet([a.url], steps)
        finally:
            if b is not None:
                b.stop()
            a.stop()
    assert stats.fatal is None, log[-20:]
    nodes = stats.nodes
    assert set(nodes) == {"a", "b"}
    assert nodes["a"].claimed > 0 and nodes["b"].claimed > 0
    # Every result went to the node that granted it and was taken there, once; only the
    # renders of b's leases that ended after b left went elsewhere. Those land at a through
    # b's hand-over while their leases live; one that reaches a only after its lease ended
    # (b's stop can take seconds on a loaded machine) is refused. Any other refusal was
    # answered after its lease's end, never while the node still held the lease
    # (tests/test_cluster_faults.py proves the landing without a fleet's timing).
    assert nodes["a"].sent_elsewhere == 0
    assert stats.refused <= nodes["b"].sent_elsewhere + stats.refused_late, "\n".join(log)
    assert stats.completions_lost == 0, log[-20:]
    landed = sum(c.completed for c in nodes.values()) + nodes["b"].sent_elsewhere - stats.refused
    assert stats.rendered == landed and stats.rendered + stats.refused == stats.claimed, stats
    assert any("joined b" in line for line in log), log
    assert any("left b" in line for line in log), log


def test_discovery_of_a_single_node_uses_its_seed_url(tmp_path: Path) -> None:
    """A SQLite node lists itself; the fleet keeps the address it was given."""
    db = str(tmp_path / "node.sqlite")
    seed_rows(db, 30)
    with nodes_on(lambda directory: db):
        node = NodeProcess(tmp_path, workers=1, tokens=True).start()
    try:
        seed = node.url.replace("127.0.0.1", "localhost")

        def client_for(url: str) -> AsyncFleetClient:
            return AsyncFleetClient(url, token=FLEET_TOKEN)

        async def discover() -> tuple[list[str], str, bool]:
            directory = ClusterDirectory([seed], client_for, token=FLEET_TOKEN)
            try:
                await directory.refresh()
                name = directory.live[0]
                return directory.live, directory.members[name].url, directory.clustered
            finally:
                await directory.aclose()

        live, url, clustered = asyncio.run(discover())
        assert len(live) == 1 and url == seed and clustered is False
        with httpx.Client(base_url=node.url) as client:
            assert client.get("/v1/cluster").status_code == 401  # the node has tokens
    finally:
        node.stop()
