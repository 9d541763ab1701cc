"""PUT and GET /v1/sites/{site} over real HTTP on both backends: a site's own settings
are stored, put in force at once by the worker that took them and by the keeper from the
feed (a write another node made), cleared by null, refused when out of range; the name is
taken as a key's URL names its site."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from node_harness import ThreadNode, node_db, seed_rows, thread_node, wait_for

from shm.keys import site_hash
from store.rows import SiteSettings

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")


@pytest.fixture
def node(tmp_path: Any, node_backend: str) -> Iterator[ThreadNode]:
    with thread_node(tmp_path) as running:
        running.wait_published()
        yield running


def test_a_sites_settings_are_set_read_and_cleared(node: ThreadNode) -> None:
    with node.client() as client:
        fresh = client.get("/v1/sites/example.com").json()
        assert fresh.pop("due") in (None, 0)  # 0 once the keeper's listing is served
        assert fresh == {
            "site": "example.com",
            "settings": {"max_in_flight": None, "min_interval_ms": None},
            "in_force": {"max_in_flight": None, "min_interval_ms": 0},
            "in_flight": 0,
            "blocked_until": None,
            "blocked_reason": None,
            "last_grant_at": None,
            "failure_streak": 0,
            "failure_block_ms": 0,
        }
        # Named as a key's URL would name it: www., case and port do not count.
        put = client.put("/v1/sites/WWW.Example.com:8443", json={"max_in_flight": 4})
        assert put.status_code == 200, put.text
        assert put.json()["site"] == "example.com"
        assert put.json()["settings"] == {"max_in_flight": 4, "min_interval_ms": None}
        assert put.json()["in_force"] == {"max_in_flight": 4, "min_interval_ms": 0}
        both = client.put("/v1/sites/example.com", json={"min_interval_ms": 250}).json()
        assert both["settings"] == {"max_in_flight": 4, "min_interval_ms": 250}  # absent: kept
        assert node.store.get_site("example.com") == SiteSettings(
            site="example.com", max_in_flight=4, min_interval_ms=250
        )
        sites = node.segments.sites
        info = sites.info(site_hash(b"example.com"), 0)
        assert (info.max_in_flight, info.min_interval_ms) == (4, 250)  # in force at once
        cleared = client.put("/v1/sites/example.com", json={"max_in_flight": None}).json()
        assert cleared["settings"] == {"max_in_flight": None, "min_interval_ms": 250}
        assert cleared["in_force"]["max_in_flight"] is None
        client.put("/v1/sites/example.com", json={"min_interval_ms": None})
        assert node.store.get_site("example.com") is None  # nothing left of its own
        assert client.get("/v1/sites/example.com").json()["in_force"] == {
            "max_in_flight": None,
            "min_interval_ms": 0,
        }


def test_bad_settings_are_refused_and_change_nothing(node: ThreadNode) -> None:
    with node.client() as client:
        client.put("/v1/sites/shop.example", json={"max_in_flight": 2})
        for body, field in (
            ({"max_in_flight": -1}, "max_in_flight"),
            ({"max_in_flight": 4097}, "max_in_flight"),
            ({"max_in_flight": 65}, "site_permits_max"),  # the node's permits a site
            ({"max_in_flight": 1.5}, "max_in_flight"),
            ({"max_in_flight": "3"}, "max_in_flight"),
            ({"min_interval_ms": 86_400_001}, "min_interval_ms"),
            ({"min_interval_ms": -5}, "min_interval_ms"),
            ({"max_inflight": 3}, "max_inflight"),
        ):
            refused = client.put("/v1/sites/shop.example", json=body)
            assert refused.status_code == 422, (body, refused.text)
            assert field in refused.json()["detail"], (body, refused.text)
        for path in ("/v1/sites/.example", "/v1/sites/a%20b", "/v1/sites/" + "a" * 260):
            assert client.put(path, json={"max_in_flight": 1}).status_code == 422, path
            assert client.get(path).status_code == 422, path
    assert node.store.sites() == [SiteSettings(site="shop.example", max_in_flight=2)]


def test_a_setting_another_node_stored_reaches_this_one_through_the_feed(
    node: ThreadNode,
) -> None:
    node.store.set_site(SiteSettings(site="far.example", max_in_flight=3, min_interval_ms=50))
    hashed = site_hash(b"far.example")

    def in_force() -> bool:
        info = node.segments.sites.info(hashed, 0)
        return (info.max_in_flight, info.min_interval_ms) == (3, 50)

    wait_for(in_force, 30, "the keeper to put the site's settings in force")
    with node.client() as client:
        state = client.get("/v1/sites/far.example").json()
    assert state["in_force"] == {"max_in_flight": 3, "min_interval_ms": 50}
    node.store.set_site(SiteSettings(site="far.example"))
    wait_for(
        lambda: node.segments.sites.info(hashed, 0).max_in_flight is None,
        30,
        "the keeper to clear the site's settings",
    )


def test_a_site_says_its_due_rows_from_the_keepers_listing(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 30, due_share=0.5, prefix="https://www.due.example/p/")
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()

        def due(site: str) -> Any:
            return client.get(f"/v1/sites/{site}").json()["due"]

        wait_for(lambda: due("due.example") == 15, 30, "the site's due rows")
        assert due("other.example") == 0  # every site with due rows is listed
