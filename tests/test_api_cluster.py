"""The cluster's HTTP surface, on real node processes sharing one real PostgreSQL:
`GET /v1/cluster`, the cluster's queue-state (the sum of every node's exact counts, or a
503 naming the node that cannot vouch), and a completion or renewal sent to a node other
than the one that granted the lease (forwarded there, applied once).
"""

from __future__ import annotations

import contextlib
import functools
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import schema_url
from node_harness import (
    ADMIN_TOKEN,
    FLEET_TOKEN,
    NodeProcess,
    due_in_table,
    nodes_on,
    now_ms,
    seed_rows,
    wait_for,
)

from api.version import VERSION

# Fast membership: dead after 4 s; leases of at most 10 s.
CLUSTER_ARGS = ("--heartbeat-s", "0.5", "--node-ttl-s", "4", "--max-lease-s", "10")
ROWS = 300


def fresh_schema(database: str) -> str:
    import psycopg

    schema = f"c_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    return schema_url(database, schema)


@contextlib.contextmanager
def two_nodes(
    tmp_path: Path, url: str, extra_args: tuple[str, ...] = ()
) -> Iterator[dict[str, NodeProcess]]:
    """Nodes a and b on the store at `url`, started together (each waits for the other);
    `extra_args` come after CLUSTER_ARGS, so they override them."""
    nodes: dict[str, NodeProcess] = {}
    with nodes_on(lambda directory: url):
        try:
            for name, peer in (("a", "b"), ("b", "a")):
                directory = tmp_path / name
                directory.mkdir(exist_ok=True)
                nodes[name] = NodeProcess(
                    directory,
                    workers=1,
                    tokens=True,
                    extra_args=("--node", name, "--peers", peer, *CLUSTER_ARGS, *extra_args),
                ).start(wait_ready=False)
            for node in nodes.values():
                node.wait_event("node_ready")
            yield nodes
        finally:
            for node in nodes.values():
                node.stop()


def get(node: NodeProcess, path: str, token: str = ADMIN_TOKEN) -> httpx.Response:
    with httpx.Client(
        base_url=node.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as client:
        return client.get(path)


def post(node: NodeProcess, path: str, body: Any, **headers: str) -> httpx.Response:
    with httpx.Client(
        base_url=node.url,
        headers={"Authorization": f"Bearer {FLEET_TOKEN}", **headers},
        timeout=30,
    ) as client:
        return client.post(path, json=body)


def cluster_state(node: NodeProcess) -> dict[str, Any] | None:
    response = get(node, "/prerender_admin/cluster/queue-state")
    return response.json() if response.status_code == 200 else None


def ready_state(node: NodeProcess) -> dict[str, Any] | None:
    """`node`'s cluster queue-state if every node it lists says `ready`."""
    state = cluster_state(node)
    if state is None or any(n["status"] != "ready" for n in state["nodes"]):
        return None
    return state


@pytest.fixture(scope="module")
def pair(
    pg_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, NodeProcess]]]:
    url = fresh_schema(pg_database)
    seed_rows(url, ROWS, due_share=0.5)
    with two_nodes(tmp_path_factory.mktemp("pair"), url) as nodes:
        wait_for(lambda: cluster_state(nodes["a"]), 90, "an exact cluster queue-state", 0.25)
        yield url, nodes


def test_v1_cluster_lists_both_nodes_to_every_token(
    pair: tuple[str, dict[str, NodeProcess]],
) -> None:
    _, nodes = pair
    for token in (ADMIN_TOKEN, FLEET_TOKEN):
        response = get(nodes["b"], "/v1/cluster", token)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["node"] == "b" and body["clustered"] is True
        listed = {n["node"]: n for n in body["nodes"]}
        assert set(listed) == {"a", "b"}
        for name, node in nodes.items():
            assert listed[name]["url"] == node.url
            assert listed[name]["answering"] is (name == "b")
            assert listed[name]["started_at"] > 0
            assert 0 <= listed[name]["heartbeat_age_ms"] < 4000
    assert get(nodes["a"], "/v1/cluster", "not-a-token-at-all-xxxxxx").status_code == 401


def test_cluster_queue_state_is_the_sum_of_the_nodes_exact_counts(
    pair: tuple[str, dict[str, NodeProcess]],
) -> None:
    url, nodes = pair
    # Nothing writes or claims here: the counts hold still while they are read, once a
    # full report has counted the fences of the nodes' joins ended (each fenced the keys
    # it gained until the other acknowledged it, and due_now left them out meanwhile).
    wait_for(
        lambda: (state := cluster_state(nodes["a"])) and state["fenced"]["due"] == 0,
        30,
        "the joins' fences counted ended",
        0.25,
    )
    own = {name: get(node, "/prerender_admin/queue-state").json() for name, node in nodes.items()}
    for name, body in own.items():
        assert body["node"] == name and body["trust"]["exact"] is True
        assert sorted(body["cluster"]["view"]) == ["a", "b"]
    for asked in nodes.values():
        # A node on a loaded machine may miss its grant window for a moment (its keeper
        # confirms membership every heartbeat) and say `unready` while its counts stay
        # exact; the sums are read from a moment both nodes say `ready`.
        body = wait_for(
            functools.partial(ready_state, asked),
            30,
            f"a cluster queue-state from {asked.url} with both nodes ready",
            0.25,
        )
        assert body["exact"] is True
        due = sum(state["now"]["due"] for state in own.values())
        assert body["now"]["due"] == due == due_in_table(url, now_ms()) == ROWS // 2
        assert body["now"]["held"] == sum(s["now"]["held"] for s in own.values()) == ROWS
        assert body["autoscale"]["due_now"] == sum(s["autoscale"]["due_now"] for s in own.values())
        assert body["autoscale"]["due_now"] == body["now"]["claimable"] == due
        assert body["fenced"] == {"due": 0, "until_ms": 0}
        # Each document's age is counted at its own report, so a later report is older by
        # the time between; no age can pass that of the oldest due row now.
        oldest = max(s["autoscale"]["oldest_claimable_age_s"] for s in own.values())
        due_since = min(
            s["generated_at"] - s["autoscale"]["oldest_claimable_age_s"] * 1000
            for s in own.values()
        )
        age = body["autoscale"]["oldest_claimable_age_s"]
        assert oldest - 0.002 <= age <= (now_ms() - due_since) / 1000 + 0.002
        listed = {n["node"]: n for n in body["nodes"]}
        assert set(listed) == {"a", "b"}
        for name in nodes:
            assert listed[name]["now"]["due"] == own[name]["now"]["due"]
            assert listed[name]["missing"] is False
    # The read-only scope: the fleet token does not open it.
    refused = get(nodes["a"], "/prerender_admin/cluster/queue-state", FLEET_TOKEN)
    assert refused.status_code == 403


def claim_at(node: NodeProcess, count: int) -> list[dict[str, Any]]:
    """`count` leases from `node`. A node that just joined grants nothing until the keys it
    gained could no longer be leased by their previous owner (keeper.cluster's fences)."""
    leases: list[dict[str, Any]] = []

    def granted() -> bool:
        response = post(
            node,
            "/v1/claims",
            {"max": count - len(leases), "worker": "test", "lease_s": 10, "wait_s": 2},
        )
        assert response.status_code in (200, 503), response.text
        if response.status_code == 200:
            leases.extend(response.json()["leases"])
        return len(leases) == count

    wait_for(granted, 45, f"{count} leases from {node.url}", 0.1)
    return leases


def test_a_completion_sent_to_the_wrong_node_completes_once(
    pair: tuple[str, dict[str, NodeProcess]],
) -> None:
    url, nodes = pair
    from store.postgres import PostgresStore

    leases = claim_at(nodes["a"], 4)
    assert len(leases) == 4
    for lease in leases:
        # The token names the node that granted it; the lease says so too.
        assert lease["node"] == "a" and lease["token"].startswith("a:")
    # A renewal at b reaches a's lease table.
    renewed = post(
        nodes["b"],
        "/v1/leases/renew",
        {"items": [{"key": x["key"], "token": x["token"], "lease_s": 10} for x in leases]},
    )
    assert renewed.status_code == 200, renewed.text
    assert all(r["ok"] for r in renewed.json()["results"]), renewed.text
    # Completed at b: forwarded to a, applied there.
    before = now_ms()
    items = [{"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in leases]
    done = post(nodes["b"], "/v1/completions", {"items": items})
    assert done.status_code == 200, done.text
    assert [r["ok"] for r in done.json()["results"]] == [True] * 4, done.text
    store = PostgresStore(url)
    try:
        rows = store.get_many([x["key"] for x in leases])
    finally:
        store.close()
    for lease in leases:
        row = rows[lease["key"]]
        assert row.last_outcome == "rendered" and row.last_rendered_at is not None
        assert row.last_rendered_at >= before and row.next_render_at > now_ms()
    # Once: sent again, at either node, nothing is held.
    for node in nodes.values():
        again = post(node, "/v1/completions", {"items": items})
        assert [r.get("error") for r in again.json()["results"]] == ["lease_not_held"] * 4
    # The lease is gone from a's table: a explains the key as not leased.
    explained = get(nodes["a"], f"/prerender_admin/explain?key={leases[0]['key']}").json()
    assert explained["lease"]["leased"] is False


def test_a_claim_carrying_completions_of_both_nodes_sends_each_to_its_own(
    pair: tuple[str, dict[str, NodeProcess]],
) -> None:
    """Completions carried on a claim are routed as a completions request's are: the items
    another node granted are forwarded there and applied once, answered in `completed`."""
    _, nodes = pair
    mine, theirs = claim_at(nodes["b"], 1), claim_at(nodes["a"], 1)
    items = [{"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in mine + theirs]

    def carried() -> Any:
        response = post(
            nodes["b"], "/v1/claims", {"max": 1, "worker": "test", "lease_s": 10, "complete": items}
        )
        assert response.status_code in (200, 503), response.text
        return response.json() if response.status_code == 200 else None

    body = wait_for(carried, 30, "a claim at b that grants")
    assert body["completed"] == [{"key": x["key"], "ok": True} for x in mine + theirs]
    again = post(nodes["a"], "/v1/completions", {"items": items}).json()["results"]
    assert [r.get("error") for r in again] == ["lease_not_held"] * 2


def test_items_of_both_nodes_in_one_request_each_go_to_their_own(
    pair: tuple[str, dict[str, NodeProcess]],
) -> None:
    _, nodes = pair
    mine, theirs = claim_at(nodes["b"], 2), claim_at(nodes["a"], 2)
    assert {x["node"] for x in mine} == {"b"} and {x["node"] for x in theirs} == {"a"}
    mixed = [theirs[0], mine[0], theirs[1], mine[1]]
    items = [{"key": x["key"], "token": x["token"], "outcome": "failed"} for x in mixed]
    done = post(nodes["b"], "/v1/completions", {"items": items})
    results = done.json()["results"]
    assert [r["key"] for r in results] == [x["key"] for x in mixed]  # the request's order
    assert all(r["ok"] and r["held_until"] > now_ms() for r in results), results


def test_a_forwarded_request_is_not_forwarded_again(
    pair: tuple[str, dict[str, NodeProcess]],
) -> None:
    _, nodes = pair
    (lease,) = claim_at(nodes["a"], 1)
    item = {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
    # As if node c had forwarded it to b: b names a and leaves the lease alone.
    bounced = post(
        nodes["b"], "/v1/completions", {"items": [item]}, **{"X-Renderqueue-Forwarded-By": "c"}
    )
    (result,) = bounced.json()["results"]
    assert result["ok"] is False and result["error"] == "lease_not_held"
    assert "'a'" in result["detail"] and "GET /v1/cluster" in result["detail"]
    # Still held at a: it completes there.
    (done,) = post(nodes["a"], "/v1/completions", {"items": [item]}).json()["results"]
    assert done["ok"] is True
    # A token of a node that is not a member: named, nothing changes.
    ghost = {"key": lease["key"], "token": "zz:12345", "outcome": "rendered"}
    (refused,) = post(nodes["a"], "/v1/completions", {"items": [ghost]}).json()["results"]
    assert refused["error"] == "lease_not_held" and "'zz'" in refused["detail"]


def test_cluster_queue_state_withholds_and_names_a_stopped_node(
    pg_database: str, tmp_path: Path
) -> None:
    url = fresh_schema(pg_database)
    seed_rows(url, ROWS, due_share=0.5)
    with two_nodes(tmp_path, url) as nodes:
        a, b = nodes["a"], nodes["b"]
        wait_for(lambda: cluster_state(a), 90, "an exact cluster queue-state", 0.25)
        # b frozen (supervisor and worker): still a member until its TTL, but silent.
        assert b.process is not None
        group = [b.process.pid, b.worker_pid(0)]
        for pid in group:
            import os

            os.kill(pid, signal.SIGSTOP)
        try:
            response = get(a, "/prerender_admin/cluster/queue-state")
            assert response.status_code == 503, response.text
            assert response.headers["content-type"].startswith("application/problem+json")
            assert "Retry-After" in response.headers
            body = response.json()
            assert body["withheld"] == ["b"] and "node 'b'" in body["detail"]
            assert "missing" in body["detail"]
            assert "now" not in body and "autoscale" not in body  # never a partial sum
            listed = {n["node"]: n for n in body["nodes"]}
            assert listed["b"]["missing"] is True and listed["b"]["status"] == "missing"
            assert listed["a"]["now"]["due"] > 0  # the console still sees a's own line
        finally:
            for pid in group:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: cluster_state(a), 60, "exact again once b answers", 0.25)
        # b stopped cleanly: it leaves, a takes its rows over, walks them (not exact
        # meanwhile: 503 naming a), and the cluster is a alone, with every row.
        b.stop()
        seen: list[str] = []

        def alone() -> dict[str, Any] | None:
            response = get(a, "/prerender_admin/cluster/queue-state")
            if response.status_code == 503:
                seen.append(response.json()["detail"])
                return None
            body: dict[str, Any] = response.json()
            return body if [n["node"] for n in body["nodes"]] == ["a"] else None

        body = wait_for(alone, 60, "a alone, exact", 0.1)
        assert body["now"]["held"] == ROWS and body["now"]["due"] == ROWS // 2
        assert all("node 'a'" in d or "node 'b'" in d for d in seen), seen


def test_a_single_node_lists_itself(tmp_path: Path) -> None:
    """SQLite: not a cluster; /v1/cluster lists the node, the cluster queue-state is its own
    counts, and tokens stay bare decimals."""
    db = str(tmp_path / "node.sqlite")
    seed_rows(db, 40, due_share=0.5)
    with nodes_on(lambda directory: db):  # whatever the module's pair left in force
        node = NodeProcess(tmp_path, workers=1, tokens=True).start()
    try:
        body = get(node, "/v1/cluster", FLEET_TOKEN).json()
        assert body["clustered"] is False and body["version"] == VERSION
        assert [(n["node"], n["url"], n["answering"]) for n in body["nodes"]] == [
            (body["node"], node.url, True)
        ]
        state = wait_for(lambda: cluster_state(node), 60, "the cluster queue-state", 0.2)
        assert state["clustered"] is False and state["now"]["due"] == 20
        (lease,) = claim_at(node, 1)
        assert lease["token"].isdigit() and "node" not in lease
    finally:
        node.stop()
