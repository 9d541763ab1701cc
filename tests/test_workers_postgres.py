"""A node on PostgreSQL survives losing its database mid-run.

`pg_terminate_backend` on every connection the node holds (the workers', the keeper's
and its feed's), while a writer and claimants keep going: a write caught by the cut
answers 503 and is all or nothing, the keeper's feed reopens from its cursor and walks,
and queue-state is exact again and equal to the table. Nothing acknowledged is lost.
Then the server "restarts" (a proxy in front of it cuts every connection and refuses
new ones for a while): the node answers 503 meanwhile, never 500, and recovers.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
from node_harness import (
    NodeProcess,
    claim_answered,
    due_in_table,
    node_process,
    now_ms,
    seed_rows,
    wait_for,
)


def terminate_node_connections(url: str) -> int:
    """Cut every connection renderqueue holds to this database; returns how many."""
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(
            """SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
            WHERE datname = current_database() AND pid <> pg_backend_pid()
              AND application_name LIKE 'renderqueue%'"""
        ).fetchone()
    return int(found[0]) if found else 0


def exact_state(node: NodeProcess, db: str) -> Any:
    with node.client() as client:
        response = client.get("/prerender_admin/queue-state")
    if response.status_code != 200:
        return None
    state = response.json()
    return state if state["now"]["due"] == due_in_table(db, now_ms()) else None


def test_cut_connections_mid_run_lose_nothing_and_the_keeper_is_exact_again(
    tmp_path: Path, pg_url: str
) -> None:
    from node_harness import nodes_on

    with nodes_on(lambda directory: pg_url):
        seed_rows(pg_url, 2000, due_share=0.5)
        acknowledged: list[str] = []
        refused: list[int] = []
        stop = threading.Event()
        with node_process(tmp_path, workers=2) as node:
            wait_for(lambda: exact_state(node, pg_url), 60, "an exact queue-state")

            def writer() -> None:
                batch = 0
                with httpx.Client(base_url=node.url, timeout=10) as client:
                    while not stop.is_set():
                        keys = [f"https://shop.example/w/{batch}/{i}" for i in range(20)]
                        rows = [{"key": k, "route": "product", "cadence_s": 3600} for k in keys]
                        try:
                            response = client.post("/v1/schedule", json={"upsert": rows})
                        except httpx.HTTPError as exc:
                            unexpected.append((0, repr(exc)))
                            break
                        if response.status_code == 200:
                            acknowledged.extend(keys)
                        elif response.status_code == 503 and response.headers.get("retry-after"):
                            refused.append(batch)
                        else:  # asserted after the join: a failure in this thread is lost
                            unexpected.append((response.status_code, response.text))
                        batch += 1
                        time.sleep(0.01)

            unexpected: list[tuple[int, str]] = []
            thread = threading.Thread(target=writer)
            thread.start()

            def writes_after(count: int) -> bool:
                """A write acknowledged past `count`: the node writes (again)."""
                if unexpected:
                    raise AssertionError(f"unexpected answers: {unexpected}")
                return len(acknowledged) > count

            try:
                wait_for(lambda: writes_after(100), 60, "writes in flight")
                cut = terminate_node_connections(pg_url)
                assert cut >= 3  # two workers and the keeper's feed, at least
                written = len(acknowledged)
                wait_for(lambda: writes_after(written), 60, "a write after the cut")
                with node.client() as client:
                    leases = client.post("/v1/claims", json={"max": 20, "worker": "t"})
                assert leases.status_code == 200 and len(leases.json()["leases"]) == 20
                cut += terminate_node_connections(pg_url)
                written = len(acknowledged)
                wait_for(lambda: writes_after(written), 60, "a write after the second cut")
            finally:
                stop.set()
                thread.join(30)
            assert unexpected == []  # every write answered 200, or 503 with Retry-After
            state = wait_for(
                lambda: exact_state(node, pg_url), 60, "an exact queue-state again", 0.2
            )
            assert state["trust"]["feed_reopens"] >= 1  # the keeper's feed was cut and reopened
            assert state["now"]["in_flight"] == 20
            with node.client() as client:
                overview = client.get("/prerender_admin/overview").json()
            assert overview["keeper"]["feed_failures"] >= 1

    with psycopg.connect(pg_url, autocommit=True) as conn:
        found = {
            key
            for (key,) in conn.execute(
                "SELECT key FROM render_schedule WHERE key LIKE 'https://shop.example/w/%%'"
            )
        }
        batches = {
            int(key.split("/")[-2]) for key in found
        }  # a refused batch is all or nothing: none or all 20 of its rows
        for batch in batches:
            assert sum(1 for k in found if k.split("/")[-2] == str(batch)) == 20
    assert set(acknowledged) <= found, "an acknowledged write was lost"
    assert len(acknowledged) > 100


def test_a_server_restart_is_503_meanwhile_and_the_node_recovers(
    tmp_path: Path, pg_url: str
) -> None:
    from urllib.parse import urlsplit, urlunsplit

    from node_harness import nodes_on

    from bench.harness.tcp_proxy import TcpProxy

    parts = urlsplit(pg_url)
    proxy = TcpProxy(parts.hostname or "127.0.0.1", parts.port or 5432).start()
    via_proxy = urlunsplit(parts._replace(netloc=f"postgres@127.0.0.1:{proxy.port}"))
    try:
        with nodes_on(lambda directory: via_proxy):
            seed_rows(pg_url, 500, due_share=0.5)
            with node_process(tmp_path, workers=2) as node:
                wait_for(lambda: exact_state(node, pg_url), 60, "an exact queue-state")
                proxy.stop()
                statuses: set[int] = set()
                with node.client() as client:
                    for i in range(20):
                        row = {"key": f"https://shop.example/down/{i}", "route": "product"}
                        statuses.add(
                            client.post("/v1/schedule", json={"upsert": [row]}).status_code
                        )
                        statuses.add(
                            client.get("/v1/schedule", params={"key": row["key"]}).status_code
                        )
                        time.sleep(0.05)
                    down = client.get("/prerender_admin/queue-state")
                assert statuses == {503}, statuses  # the store is unreachable: never a 500
                assert down.status_code in (200, 503)
                proxy.start()
                state = wait_for(
                    lambda: exact_state(node, pg_url), 60, "an exact queue-state again", 0.2
                )
                assert state["trust"]["feed_reopens"] >= 1
                with node.client() as client:
                    row = {"key": "https://shop.example/up", "route": "product"}
                    assert client.post("/v1/schedule", json={"upsert": [row]}).status_code == 200

                    def granted() -> bool:
                        # A worker that made no store call since the outage finds its
                        # connection gone at its first: 503 and retry, as the fleet does.
                        answer = claim_answered(client, {"max": 10, "worker": "t"})
                        return bool(answer["leases"])

                    wait_for(granted, 60, "a claim granted after the restart", 0.2)
    finally:
        proxy.stop()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM render_schedule WHERE key LIKE 'https://shop.example/down/%%'"
        ).fetchone()
    assert found is not None and found[0] == 0  # every refused write wrote nothing
