"""A route's site pattern on a real node (a supervisor and two worker processes), on both
backends: `PUT /v1/routes/{route}` takes and checks it; set while the route's rows are
held, the keeper re-sites them, GET /v1/sites, queue-state and explain name the pattern's
site, and two subdomains under one pattern share one cap across claims."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from node_harness import node_db, node_process, now_ms, wait_for

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

CAP = 2
FILLERS = 30


def _seed(directory: Path) -> list[str]:
    """Keys of two subdomains of cust.example interleaved by due (a0, b0, a1, b1 ...,
    the most overdue first), and fillers of another site after them; returns the
    subdomains' keys in due order."""
    from store import open_store
    from store.rows import RowWrite

    now = now_ms()
    customer = [f"https://{host}.cust.example/p/{i}" for i in range(6) for host in ("a", "b")]
    store = open_store(node_db(directory))
    try:
        store.write(
            [
                RowWrite(key=key, route="shop", cadence_s=3600, next_render_at=now - 900_000 + n)
                for n, key in enumerate(customer)
            ]
            + [
                RowWrite(
                    key=f"https://filler.example/p/{i}",
                    route="shop",
                    cadence_s=3600,
                    next_render_at=now - 60_000 + i,
                )
                for i in range(FILLERS)
            ]
        )
    finally:
        store.close()
    return customer


def test_two_subdomains_under_one_pattern_share_one_cap(tmp_path: Path) -> None:
    customer = _seed(tmp_path)
    with node_process(tmp_path, workers=2) as node, node.client() as client:
        # Checked in full before anything is written.
        for bad in ("*.com", "Cust.example", "www.cust.example", "*.a.*.example", "a/b", ""):
            refused = client.put("/v1/routes/shop", json={"site_pattern": bad})
            assert refused.status_code == 422, (bad, refused.text)
        assert client.get("/v1/routes").json()["routes"] == []
        assert client.put("/v1/sites/cust.example", json={"max_in_flight": CAP}).is_success
        route = client.put("/v1/routes/shop", json={"site_pattern": "*.cust.example"})
        assert route.status_code == 200, route.text
        assert route.json()["site_pattern"] == "*.cust.example"

        def listed() -> Any:
            body = client.get("/v1/sites").json()
            return body if body.get("sites") else None

        listing = wait_for(
            lambda: (
                (b := listed())
                and {s["site"]: s["due"] for s in b["sites"]}
                == {"cust.example": len(customer), "filler.example": FILLERS}
                and b
            ),
            60,
            "the keeper to re-site the route's rows",
        )
        # Grants follow once a publish after the re-site has replaced the ring.
        wait_for(
            lambda: (
                client.get("/prerender_admin/queue-state").json()["trust"]["publish"]["last_at"]
                > listing["generated_at"]
            ),
            30,
            "a publish after the re-site",
        )
        state = client.get("/prerender_admin/queue-state").json()
        assert {s["site"] for s in state["sites"]["top"]} == {"cust.example", "filler.example"}
        explained = client.get("/prerender_admin/explain", params={"key": customer[1]}).json()
        assert explained["site"] == "cust.example"

        granted: list[dict[str, Any]] = []

        def claim_all() -> bool:
            body = {"max": 50, "worker": "t", "lease_s": 120, "wait_s": 0.5}
            granted.extend(client.post("/v1/claims", json=body).json()["leases"])
            return sum("filler" in lease["key"] for lease in granted) == FILLERS

        wait_for(claim_all, 60, "every filler key granted")
        claim_all()  # once more: nothing of the capped site comes after its cap
        ours = [lease for lease in granted if "cust.example" in lease["key"]]
        # The cap is the pattern's site's: a0 and b0, one of each subdomain, then none.
        assert [lease["key"] for lease in ours] == customer[:CAP]
        site = client.get("/v1/sites/cust.example").json()
        assert site["in_flight"] == CAP and site["due"] == len(customer)
        # A permit given back lets the next key of the site in, whichever subdomain.
        done = client.post(
            "/v1/completions",
            json={
                "items": [{"key": ours[0]["key"], "token": ours[0]["token"], "outcome": "rendered"}]
            },
        )
        assert done.status_code == 200 and done.json()["results"][0]["ok"], done.text
        more: list[dict[str, Any]] = []

        def claim_next() -> bool:
            body = {"max": 50, "worker": "t", "lease_s": 120, "wait_s": 0.5}
            more.extend(client.post("/v1/claims", json=body).json()["leases"])
            return bool(more)

        wait_for(claim_next, 30, "the site's next key")
        claim_next()
        assert [lease["key"] for lease in more] == [customer[CAP]]
        # Cleared: the subdomains are their own sites again, uncapped.
        assert (
            client.put("/v1/routes/shop", json={"site_pattern": None}).json()["site_pattern"]
            is None
        )
        wait_for(
            lambda: (
                (b := listed())
                and {s["site"] for s in b["sites"]} >= {"a.cust.example", "b.cust.example"}
            ),
            60,
            "the keeper to re-site the route's rows to their hosts",
        )
