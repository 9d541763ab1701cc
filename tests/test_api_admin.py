"""Admin reads over real HTTP: queue-state (200 only when the keeper vouches, 503 with trust
and the live fields otherwise), explain, overview, the probes and the console page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from node_harness import node_db, now_ms, seed_rows, thread_node, wait_for

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

COUNT_FIELDS = {"due", "due_sitemap", "due_discovered", "unclaimed_estimate", "paused", "held"}


def test_queue_state_is_503_until_the_keeper_reports(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        response = client.get("/prerender_admin/queue-state")
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        body = response.json()
        assert body["now"]["status"] == "unready" and body["now"]["in_flight"] == 0
        assert not COUNT_FIELDS & set(body["now"]) and "coming" not in body
        assert body["trust"]["live"] is False
        readiness = client.get("/readyz")
        assert readiness.status_code == 503 and readiness.json()["status"] == "unready"


def test_queue_state_counts_match_the_table_when_served(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 300, due_share=0.4)
    with thread_node(tmp_path) as node:
        state = node.wait_exact()
        assert state["now"]["status"] == "ready"
        assert state["now"]["due"] == 120 and state["now"]["held"] == 300
        assert state["now"]["due_sitemap"] + state["now"]["due_discovered"] == 120
        assert state["autoscale"]["due_now"] == 120
        assert state["autoscale"]["oldest_claimable_age_s"] > 0
        assert state["trust"]["live"] and state["trust"]["exact"]
        assert state["trust"]["state_age_ms"] >= 0
        assert {"coming", "lateness", "flow"} <= set(state)


def test_a_stalled_keeper_withholds_counts_but_serves_live_fields(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 50)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()
        leases = client.post("/v1/claims", json={"max": 7, "worker": "t"}).json()["leases"]
        assert len(leases) == 7
        node.stop_keeper()

        def withheld() -> Any:
            response = client.get("/prerender_admin/queue-state")
            return response.json() if response.status_code == 503 else None

        body = wait_for(withheld, 30, "queue-state to turn 503 after the keeper stopped", 0.2)
        assert body["now"]["status"] == "stalled"
        assert body["now"]["in_flight"] == 7 and body["now"]["leases"]["in_flight"] == 7
        assert not COUNT_FIELDS & set(body["now"]) and "lateness" not in body
        assert body["trust"]["live"] is False and "stalled" in body["trust"]["live_reason"]
        # Claims go on from the last published ring while it lasts.
        more = client.post("/v1/claims", json={"max": 5, "worker": "t"}).json()["leases"]
        assert len(more) == 5
        # A restarted keeper reloads and vouches again.
        node.start_keeper()
        state = node.wait_exact()
        assert state["now"]["in_flight"] == 12


def test_explain_says_why(tmp_path: Path) -> None:
    keys = seed_rows(node_db(tmp_path), 20, due_share=0.5)
    due_key, future_key = keys[0], keys[-1]
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_published()
        explained = client.get("/prerender_admin/explain", params={"key": due_key}).json()
        assert explained["exists"] and explained["claimable"]
        assert explained["row"]["key"] == due_key and explained["cadence_s"] == 3600
        assert explained["render_class"]["route"] == "product" and explained["rank"] > 0
        assert explained["lease"]["leased"] is False and "claimable" in explained["reason"]

        future = client.get("/prerender_admin/explain", params={"key": future_key}).json()
        assert not future["claimable"] and future["reason"].startswith("not due until")
        assert future["rank"] < 0

        leases = client.post("/v1/claims", json={"max": 10, "worker": "t"}).json()["leases"]
        leased = leases[0]["key"]
        explained = client.get("/prerender_admin/explain", params={"key": leased}).json()
        assert not explained["claimable"] and explained["reason"].startswith("leased until")
        assert explained["lease"]["leased"] is True
        assert explained["lease"]["lease_expires_at"] == leases[0]["lease_expires_at"]

        missing = client.get("/prerender_admin/explain", params={"key": "https://no.example/"})
        assert missing.status_code == 200 and missing.json()["exists"] is False
        response = client.get("/prerender_admin/explain")
        assert response.status_code == 422 and response.json()["field"] == "key"


def test_overview_and_probes(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 20)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_published()
        client.post("/v1/claims", json={"max": 3, "worker": "t"})
        overview = client.get("/prerender_admin/overview").json()
        assert overview["status"] == "ready" and overview["worker"] == 0
        assert overview["leases"]["live_leases"] == 3
        assert overview["completions"]["requests"] == 0  # this worker's queue, none yet
        assert overview["ring"]["generation"] >= 1 and overview["publish_age_ms"] >= 0
        assert overview["now"] <= now_ms()
        health = client.get("/healthz").json()
        assert health["status"] == "ok" and health["worker"] == 0
        readiness = client.get("/readyz").json()
        assert readiness["status"] == "ready" and readiness["generation"] >= 1


def test_overview_carries_the_keepers_statistics(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 20)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()

        def live_record() -> Any:
            overview = client.get("/prerender_admin/overview").json()
            keeper = overview.get("keeper")
            return overview if keeper and keeper["phase"] == "live" else None

        overview = wait_for(live_record, 30, "the keeper's live record in the overview")
    keeper = overview["keeper"]
    assert keeper["status"] == "ready" and keeper["exact"] and keeper["held"] == 20
    assert keeper["publish"]["publishes"] >= 1 and keeper["statistics_write_failures"] == 0
    assert isinstance(keeper["short_slice"], bool)
    feed = keeper["feed"]
    assert set(feed) == {
        "polls",
        "events",
        "log_entries",
        "coalesced",
        "woken",
        "noticed",
        "timeouts",
        "held_back_ms",
        "held_by_pid",
        "log_retained",
        "prune_failures",
    }, "the backend-neutral part only"
    assert feed["polls"] >= 1


def test_the_console_page_is_served(tmp_path: Path) -> None:
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        response = client.get("/console")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "/prerender_admin/queue-state" in response.text
