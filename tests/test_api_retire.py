"""Rows that retire, over real HTTP with the keeper running: `not_found` outcomes in a row
(the route's retire_after) retire a row, which is listed with when and why, counted per
route by queue-state and /metrics, and never granted again until an upsert or render-now
revives it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_harness import ThreadNode, metric_samples, now_ms, thread_node, wait_for

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

DEAD = "https://gone.example/page"
STRICT = "https://gone.example/strict"


@pytest.fixture
def node(tmp_path: Path, node_backend: str) -> Iterator[ThreadNode]:
    with thread_node(tmp_path) as running:
        running.wait_published()
        yield running


def upsert(client: httpx.Client, *rows: dict[str, Any]) -> None:
    response = client.post("/v1/schedule", json={"upsert": list(rows)})
    assert response.status_code == 200, response.text


def granted(client: httpx.Client, key: str, granted_keys: list[str]) -> dict[str, Any] | None:
    """One claim (a long poll to the next publish); the lease of `key` if it was granted.
    Every key granted is kept in `granted_keys`, and the others' leases are completed."""
    leases = claim(client, {key}, granted_keys)
    return leases.get(key)


def claim(client: httpx.Client, watched: set[str], granted_keys: list[str]) -> dict[str, Any]:
    """One claim: the leases of the watched keys granted, by key; every key granted is
    kept in `granted_keys`, and the others' leases are completed as rendered."""
    response = client.post("/v1/claims", json={"max": 10, "worker": "retire", "wait_s": 2})
    assert response.status_code == 200, response.text
    found = {}
    others = []
    for lease in response.json()["leases"]:
        granted_keys.append(lease["key"])
        if lease["key"] in watched:
            found[lease["key"]] = lease
        else:
            others.append({**_item(lease), "outcome": "rendered"})
    if others:
        assert all(r["ok"] for r in complete(client, others))
    return found


def complete(client: httpx.Client, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    response = client.post("/v1/completions", json={"items": items})
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    return results


def not_found(client: httpx.Client, lease: dict[str, Any]) -> dict[str, Any]:
    # Due again at once, so the next one comes without waiting a cadence out.
    item = {**_item(lease), "outcome": "not_found", "next_render_at": now_ms()}
    (result,) = complete(client, [item])
    assert result["ok"], result
    return result


def _item(lease: dict[str, Any]) -> dict[str, Any]:
    return {"key": lease["key"], "token": lease["token"]}


def test_not_found_in_a_row_retires_a_row_until_an_upsert_or_render_now(node: ThreadNode) -> None:
    keys: list[str] = []
    with node.client() as client:
        assert client.put("/v1/routes/strict", json={"retire_after": 1}).json()["retire_after"] == 1
        upsert(client, {"key": DEAD, "route": "shop", "cadence_s": 3600})
        streaks = []
        for _ in range(3):
            lease = wait_for(lambda: granted(client, DEAD, keys), 30, "the dead key's grant")
            result = not_found(client, lease)
            streaks.append((result["not_found_streak"], result.get("retired_at")))
        assert [s for s, _ in streaks] == [1, 2, 3]
        assert streaks[0][1] is None and streaks[1][1] is None and streaks[2][1] is not None
        upsert(client, {"key": STRICT, "route": "strict", "cadence_s": 3600})
        lease = wait_for(lambda: granted(client, STRICT, keys), 30, "the strict key's grant")
        assert not_found(client, lease)["retired_at"] is not None

        # A key written after the retirements is granted once the keeper has applied them:
        # from then on neither retired key comes again.
        keys.clear()
        upsert(client, {"key": "https://alive.example/probe", "route": "shop"})
        wait_for(
            lambda: granted(client, "https://alive.example/probe", keys), 30, "the probe's grant"
        )
        for _ in range(3):
            granted(client, DEAD, keys)
        assert DEAD not in keys and STRICT not in keys

        listed = client.get("/v1/schedule", params={"retired": "true"}).json()
        assert [r["key"] for r in listed["rows"]] == [DEAD, STRICT]
        assert "next_after" not in listed
        dead = listed["rows"][0]
        assert dead["retired_reason"] == "not_found" and dead["not_found_streak"] == 3
        assert dead["retired_at"] == streaks[2][1]
        page = client.get("/v1/schedule", params={"retired": "true", "limit": 1}).json()
        assert [r["key"] for r in page["rows"]] == [DEAD] and page["next_after"] == DEAD
        page = client.get(
            "/v1/schedule", params={"retired": "true", "after": DEAD, "limit": 1}
        ).json()
        assert [r["key"] for r in page["rows"]] == [STRICT]
        one = client.get("/v1/schedule", params={"key": DEAD, "retired": "true"})
        assert one.status_code == 200 and one.json()["retired_at"] == dead["retired_at"]
        probe = {"key": "https://alive.example/probe", "retired": "true"}
        assert client.get("/v1/schedule", params=probe).status_code == 404
        explained = client.get("/prerender_admin/explain", params={"key": DEAD}).json()
        assert explained["state"] == "retired" and not explained["claimable"]

        # Counted per route, apart from held rows, in queue-state and /metrics.
        def counted() -> Any:
            state = client.get("/prerender_admin/queue-state").json()
            return state.get("retired") == {"total": 2, "by_route": {"shop": 1, "strict": 1}}

        wait_for(counted, 30, "queue-state to count the retired rows")
        samples = metric_samples(client.get("/metrics").text)
        assert samples["renderqueue_rows_retired"] == 2
        assert samples['renderqueue_rows_retired_by_route{route="shop"}'] == 1

        # An upsert revives one, render-now the other: both are granted again.
        upsert(client, {"key": DEAD, "route": "shop", "cadence_s": 3600})
        revived = client.post("/prerender_admin/render-now", json={"key": STRICT}).json()
        assert revived["state"] != "retired" and revived["row"]["retired_at"] is None
        revived_leases: dict[str, Any] = {}

        def both() -> bool:
            revived_leases.update(claim(client, {DEAD, STRICT}, keys))
            return len(revived_leases) == 2

        wait_for(both, 30, "both revived keys' grants")
        for key, lease in revived_leases.items():
            row = client.get("/v1/schedule", params={"key": key}).json()
            assert row["not_found_streak"] == 0 and row["retired_at"] is None
            assert complete(client, [{**_item(lease), "outcome": "rendered"}])[0]["ok"]
        assert client.get("/v1/schedule", params={"retired": "true"}).json() == {"rows": []}
        wait_for(
            lambda: (
                client.get("/prerender_admin/queue-state").json().get("retired")
                == {"total": 0, "by_route": {}}
            ),
            30,
            "queue-state to count none retired",
        )


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"retired": "maybe"}, "retired"),
        ({"retired": "true", "limit": "0"}, "limit"),
        ({"limit": "1001"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"retired": "true", "after": ""}, "after"),
        ({"key": ""}, "key"),
    ],
)
def test_bad_query_strings_are_refused(
    node: ThreadNode, params: dict[str, str], field: str
) -> None:
    with node.client() as client:
        response = client.get("/v1/schedule", params=params)
    assert response.status_code == 422 and response.json()["field"] == field, response.text


def test_a_bad_retire_after_is_refused_and_changes_nothing(node: ThreadNode) -> None:
    with node.client() as client:
        for value in (0, 1001, "3", 2.5, True):
            response = client.put("/v1/routes/shop", json={"retire_after": value})
            assert response.status_code == 422, (value, response.text)
        assert client.get("/v1/routes").json()["routes"] == []
        # An outcome the node does not know is refused whole.
        response = client.post(
            "/v1/completions",
            json={"items": [{"key": DEAD, "token": "1", "outcome": "missing"}]},
        )
        assert response.status_code == 422
