"""Schedule endpoints over real HTTP: batch upsert and delete, point reads, routes, the
global default, and what a route change does to claims."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from node_harness import ThreadNode, now_ms, thread_node, wait_for

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")


@pytest.fixture
def node(tmp_path: Any, node_backend: str) -> Iterator[ThreadNode]:
    with thread_node(tmp_path) as running:
        running.wait_published()
        yield running


def test_upsert_defaults_to_due_now_and_reads_back(node: ThreadNode) -> None:
    before = now_ms()
    body = {
        "upsert": [
            {"key": "https://shop.example/a", "route": "product"},
            {
                "key": "https://shop.example/b",
                "route": "article",
                "cadence_s": 600,
                "sitemap": True,
                "next_render_at": before + 60_000,
            },
        ]
    }
    with node.client() as client:
        assert client.post("/v1/schedule", json=body).json() == {"upserted": 2, "deleted": 0}
        a = client.get("/v1/schedule", params={"key": "https://shop.example/a"}).json()
        b = client.get("/v1/schedule", params={"key": "https://shop.example/b"}).json()
    assert a["route"] == "product" and a["cadence_s"] is None and a["sitemap"] is False
    assert before <= a["next_render_at"] <= now_ms()
    assert (b["cadence_s"], b["sitemap"], b["next_render_at"]) == (600, True, before + 60_000)
    assert b["version"] >= 1


def test_upsert_and_delete_in_one_batch(node: ThreadNode) -> None:
    with node.client() as client:
        client.post("/v1/schedule", json={"upsert": [{"key": "k1", "route": "r"}]})
        result = client.post(
            "/v1/schedule",
            json={"upsert": [{"key": "k2", "route": "r"}], "delete": ["k1", "never-there"]},
        ).json()
        assert result == {"upserted": 1, "deleted": 2}
        assert client.get("/v1/schedule", params={"key": "k1"}).status_code == 404
        assert client.get("/v1/schedule", params={"key": "k2"}).status_code == 200


def test_a_key_named_twice_is_written_once(node: ThreadNode) -> None:
    """The last upsert of a key stands, and a delete of it wins over an upsert."""
    body = {
        "upsert": [
            {"key": "twice", "route": "r", "cadence_s": 60},
            {"key": "gone-anyway", "route": "r"},
            {"key": "twice", "route": "s", "cadence_s": 120},
        ],
        "delete": ["gone-anyway", "gone-anyway"],
    }
    with node.client() as client:
        client.post("/v1/schedule", json={"upsert": [{"key": "gone-anyway", "route": "r"}]})
        assert client.post("/v1/schedule", json=body).json() == {"upserted": 1, "deleted": 1}
        row = client.get("/v1/schedule", params={"key": "twice"}).json()
        assert (row["route"], row["cadence_s"]) == ("s", 120)
        assert client.get("/v1/schedule", params={"key": "gone-anyway"}).status_code == 404


def test_an_empty_batch_is_422_and_writes_nothing(node: ThreadNode) -> None:
    with node.client() as client:
        bodies: list[dict[str, Any]] = [{}, {"upsert": []}, {"upsert": [], "delete": []}]
        for body in bodies:
            response = client.post("/v1/schedule", json=body)
            assert response.status_code == 422, body
            assert response.json()["field"] == "$"


def test_without_a_key_get_lists_the_rows_a_page_at_a_time(node: ThreadNode) -> None:
    with node.client() as client:
        for key in ("k3", "k1", "k2"):
            client.post("/v1/schedule", json={"upsert": [{"key": key, "route": "r"}]})
        first = client.get("/v1/schedule", params={"limit": 2}).json()
        assert [r["key"] for r in first["rows"]] == ["k1", "k2"] and first["next_after"] == "k2"
        rest = client.get("/v1/schedule", params={"after": "k2"}).json()
        assert [r["key"] for r in rest["rows"]] == ["k3"] and "next_after" not in rest
        # None of them is retired.
        assert client.get("/v1/schedule", params={"retired": "true"}).json() == {"rows": []}


def test_routes_and_settings(node: ThreadNode) -> None:
    with node.client() as client:
        route = client.put("/v1/routes/product", json={"default_cadence_s": 900})
        assert route.json() == {
            "route": "product",
            "default_cadence_s": 900,
            "paused": False,
            "adapt": None,
            "site_pattern": None,
            "retire_after": 3,
        }
        route = client.put("/v1/routes/product", json={"paused": True})
        assert route.json()["paused"] is True and route.json()["default_cadence_s"] == 900
        assert client.put("/v1/settings", json={"default_cadence_s": 7200}).json() == {
            "default_cadence_s": 7200
        }
        listing = client.get("/v1/routes").json()
    assert listing["default_cadence_s"] == 7200
    assert {
        "route": "product",
        "default_cadence_s": 900,
        "paused": True,
        "adapt": None,
        "site_pattern": None,
        "retire_after": 3,
    } in listing["routes"]


def test_a_bad_route_name_in_the_path_is_422(node: ThreadNode) -> None:
    with node.client() as client:
        response = client.put("/v1/routes/Not%20A%20Route", json={"paused": True})
    assert response.status_code == 422 and response.json()["field"] == "route"


def test_a_paused_route_is_not_claimed_and_resumes(node: ThreadNode) -> None:
    with node.client() as client:
        client.put("/v1/routes/blog", json={"paused": True})
        client.post(
            "/v1/schedule", json={"upsert": [{"key": "https://b.example/1", "route": "blog"}]}
        )
        leases = client.post("/v1/claims", json={"max": 10, "worker": "t", "wait_s": 1.5})
        assert leases.json()["leases"] == []
        explained = client.get(
            "/prerender_admin/explain", params={"key": "https://b.example/1"}
        ).json()
        assert explained["claimable"] is False and "paused" in explained["reason"]
        client.put("/v1/routes/blog", json={"paused": False})

        def claimed() -> Any:
            body = {"max": 10, "worker": "t", "wait_s": 1}
            return client.post("/v1/claims", json=body).json()["leases"]

        leases = wait_for(claimed, 30, "the resumed route's row to be claimable")
    assert [lease["key"] for lease in leases] == ["https://b.example/1"]


def test_a_route_default_sets_a_lease_cadence(node: ThreadNode) -> None:
    with node.client() as client:
        client.put("/v1/routes/news", json={"default_cadence_s": 120})
        client.post(
            "/v1/schedule", json={"upsert": [{"key": "https://n.example/1", "route": "news"}]}
        )
        leases = client.post("/v1/claims", json={"max": 10, "worker": "t", "wait_s": 5}).json()
    assert [(lease["key"], lease["cadence_s"]) for lease in leases["leases"]] == [
        ("https://n.example/1", 120)
    ]
