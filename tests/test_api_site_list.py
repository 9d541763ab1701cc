"""GET /v1/sites over real HTTP, on both backends: this node's sites by due rows, exact
against the table, `top` checked, 503 while the keeper cannot vouch; and explain names a
key's site."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from node_harness import ADMIN_TOKEN, node_db, now_ms, seed_rows, thread_node, wait_for

from shm.keys import site_hash, site_of

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

# Sites and their rows: (prefix, rows, due share). www.a.example and a.example are one.
SITES = [
    ("https://www.a.example/p/", 40, 1.0),
    ("https://a.example/q/", 20, 0.5),
    ("http://B.example:8080/p/", 45, 0.6),
    ("https://c.example/x/", 12, 1.0),
    ("https://d.example/y/", 8, 0.0),
    ("/no/site/", 15, 1.0),
]


def seed(tmp_path: Path) -> dict[str, int]:
    """Seed every site's rows; return the due rows per site, counted from what was written."""
    db = node_db(tmp_path)
    now = now_ms()
    due: Counter[str] = Counter()
    for prefix, rows, share in SITES:
        keys = seed_rows(db, rows, due_share=share, prefix=prefix, now=now)
        due[site_of(keys[0].encode()).decode()] += int(rows * share)
    return dict(due)


def test_sites_are_listed_by_due_exactly(tmp_path: Path) -> None:
    due = seed(tmp_path)
    with thread_node(tmp_path, tokens=True) as node, node.client(ADMIN_TOKEN) as client:
        node.wait_exact()
        response = client.get("/v1/sites")
        assert response.status_code == 200, response.text
        body = response.json()
        listed = {s["site"]: s["due"] for s in body["sites"]}
        assert listed == {site: n for site, n in due.items() if site and n}
        assert [s["site"] for s in body["sites"]] == ["a.example", "b.example", "c.example"]
        assert [s["held"] for s in body["sites"]] == [60, 45, 12]
        assert body["sites_with_due"] == 3 and body["sites_held"] == 4
        assert body["no_site_due"] == 15 and body["truncated"] is False
        assert all(s["oldest_age_s"] > 0 for s in body["sites"])
        assert body["node"] == "test" and body["age_ms"] >= 0
        top = client.get("/v1/sites", params={"top": "1"}).json()
        assert [s["site"] for s in top["sites"]] == ["a.example"] and top["truncated"] is True
        # The same counts as queue-state's sites group, taken at the same report.
        state = client.get("/prerender_admin/queue-state").json()
        if state["trust"]["counts_at"] == body["generated_at"]:
            assert state["sites"]["with_due"] == 3
            assert [s["site"] for s in state["sites"]["top"]] == [
                "a.example",
                "b.example",
                "c.example",
            ]
        explained = client.get(
            "/prerender_admin/explain", params={"key": "https://www.a.example/p/0000001"}
        )
        assert explained.json()["site"] == "a.example"
        no_site = client.get("/prerender_admin/explain", params={"key": "/no/site/0000001"})
        assert "site" not in no_site.json()


@pytest.mark.parametrize("top", ["0", "1001", "-1", "abc", "", "2.5"])
def test_a_bad_top_is_refused(tmp_path: Path, top: str) -> None:
    seed(tmp_path)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()
        response = client.get("/v1/sites", params={"top": top})
        assert response.status_code == 422, response.text
        assert response.json()["field"] == "top"


def test_the_listing_follows_writes_at_the_next_full_report(tmp_path: Path) -> None:
    seed(tmp_path)
    with (
        thread_node(tmp_path, keeper_config={"report_interval_s": 0.5}) as node,
        node.client() as client,
    ):
        node.wait_exact()
        keys = [f"https://e.example/new/{i}" for i in range(70)]
        response = client.post(
            "/v1/schedule",
            json={"upsert": [{"key": k, "route": "product", "next_render_at": 0} for k in keys]},
        )
        assert response.status_code == 200, response.text

        def first() -> Any:
            got = client.get("/v1/sites", params={"top": "1"})
            if got.status_code != 200:
                return None
            sites = got.json()["sites"]
            return sites if sites and sites[0]["site"] == "e.example" else None

        sites = wait_for(first, 30, "e.example to lead the listing", 0.1)
        assert sites[0]["due"] == 70 and sites[0]["held"] == 70


def test_the_listing_is_503_until_the_keeper_vouches(tmp_path: Path) -> None:
    seed(tmp_path)
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        response = client.get("/v1/sites")
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["status"] == "unavailable"
        assert "not reported" in response.json()["detail"]


def test_listed_sites_say_their_leases_in_flight_and_blocks(tmp_path: Path) -> None:
    seed(tmp_path)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()
        first = client.post("/v1/claims", json={"max": 30, "worker": "t"}).json()["leases"]
        assert len(first) == 30
        assert node.node.sites is not None
        # a.example capped at 20: the table counts its permits from now on (the leases
        # above were granted with no cap, so none).
        assert node.node.sites.configure(site_hash(b"a.example"), 20, None)
        more = client.post("/v1/claims", json={"max": 40, "worker": "t"}).json()["leases"]
        capped = sum(1 for lease in more if site_of(lease["key"].encode()) == b"a.example")
        assert 0 < capped <= 20
        until = now_ms() + 600_000
        assert node.node.sites.block(site_hash(b"c.example"), until, "retry_after") == until
        body = client.get("/v1/sites").json()
        by_site = {s["site"]: s for s in body["sites"]}
        assert by_site["a.example"]["max_in_flight"] == 20
        assert by_site["a.example"]["in_flight"] == capped
        for site in ("b.example", "c.example"):  # no cap: no count of its own
            assert "max_in_flight" not in by_site[site] and "in_flight" not in by_site[site]
        assert by_site["c.example"]["blocked_until"] == until
        assert by_site["c.example"]["blocked_reason"] == "retry_after"
        assert "blocked_until" not in by_site["a.example"]
