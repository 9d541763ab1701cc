"""A claim that carries completions (`complete`): applied before anything is granted, each
item answered in `completed` exactly as `POST /v1/completions` answers it; a node that
cannot grant, or a bad request, applies none of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from node_harness import ThreadNode, node_db, now_ms, seed_rows, thread_node

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")


def claim(client: httpx.Client, n: int, **extra: Any) -> httpx.Response:
    return client.post("/v1/claims", json={"max": n, "worker": "test", **extra})


def item(lease: dict[str, Any], outcome: str, **extra: Any) -> dict[str, Any]:
    return {"key": lease["key"], "token": lease["token"], "outcome": outcome, **extra}


def test_a_claim_without_complete_answers_no_completed(live_node: ThreadNode) -> None:
    with live_node.client() as client:
        body = claim(client, 2).json()
    assert len(body["leases"]) == 2 and "completed" not in body


def test_completions_carried_on_a_claim_apply_first_and_answer_as_completions_do(
    live_node: ThreadNode,
) -> None:
    with live_node.client() as client:
        rendered, failed, gone, not_found, pushed, twice = claim(client, 6).json()["leases"]
        stale = str(int(rendered["token"]) ^ 1)
        stamp = now_ms()
        items = [
            item(rendered, "rendered", changed=True),
            item(failed, "failed"),
            item(gone, "gone"),
            item(not_found, "not_found"),
            item(pushed, "rendered", site_retry_after_s=30),
            item(twice, "rendered"),
            item(twice, "rendered"),
            {**item(rendered, "rendered"), "token": stale},
            {"key": "https://nowhere.example/", "token": rendered["token"], "outcome": "gone"},
        ]
        response = claim(client, 100, complete=items)
        assert response.status_code == 200, response.text
        body = response.json()
        results = body["completed"]
        held_until = results[1].pop("held_until")
        assert stamp + 600_000 <= held_until <= now_ms() + 600_000
        blocked = results[4].pop("site_blocked_until")
        assert stamp + 30_000 <= blocked <= now_ms() + 30_000
        assert results == [
            {"key": rendered["key"], "ok": True},
            {"key": failed["key"], "ok": True},
            {"key": gone["key"], "ok": True},
            {"key": not_found["key"], "ok": True, "not_found_streak": 1},
            {"key": pushed["key"], "ok": True},
            {"key": twice["key"], "ok": True},
            {"key": twice["key"], "ok": False, "error": "lease_not_held"},
            {"key": rendered["key"], "ok": False, "error": "lease_not_held"},
            {"key": "https://nowhere.example/", "ok": False, "error": "lease_not_held"},
        ]
        # Applied before the grant: the rendered and not-found keys are due a cadence on, the
        # failed one is held back, the gone one deleted; none of them is granted again.
        granted = {lease["key"] for lease in body["leases"]}
        assert granted.isdisjoint({x["key"] for x in (rendered, failed, gone, not_found, twice)})
        for lease in (rendered, not_found, twice):
            row = client.get("/v1/schedule", params={"key": lease["key"]}).json()
            assert row["next_render_at"] >= stamp + 3_600_000
        row = client.get("/v1/schedule", params={"key": rendered["key"]}).json()
        assert row["last_outcome"] == "rendered"
        assert client.get("/v1/schedule", params={"key": gone["key"]}).status_code == 404
        row = client.get("/v1/schedule", params={"key": failed["key"]}).json()
        assert row["next_render_at"] == failed["due_at"] and row["last_outcome"] == "failed"
        # The tokens are spent: the same items through /v1/completions are all stale now.
        again = client.post("/v1/completions", json={"items": items[:3]}).json()["results"]
        assert [r.get("error") for r in again] == ["lease_not_held"] * 3


def test_a_bad_claim_or_item_applies_none_of_the_completions(live_node: ThreadNode) -> None:
    with live_node.client() as client:
        (lease,) = claim(client, 1).json()["leases"]
        before = client.get("/v1/schedule", params={"key": lease["key"]}).json()
        good = item(lease, "rendered")
        refusals: list[dict[str, Any]] = [
            {"complete": [good, item(lease, "failed", changed=True)]},  # changed: rendered only
            {"complete": [good], "lease_s": 10**6},  # past the node's cap
            {"complete": []},  # present, so at least one item
            {"complete": [{**good, "outcome": "done"}]},
        ]
        for extra in refusals:
            response = claim(client, 1, **extra)
            assert response.status_code == 422, (extra, response.text)
            after = client.get("/v1/schedule", params={"key": lease["key"]}).json()
            assert after == before
        # The lease is still held: the same item applies now.
        body = claim(client, 1, complete=[good]).json()
        assert body["completed"] == [{"key": lease["key"], "ok": True}]


def test_a_node_that_cannot_grant_applies_none_of_them(tmp_path: Path) -> None:
    keys = seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        before = client.get("/v1/schedule", params={"key": keys[0]}).json()
        response = claim(client, 5, complete=[{"key": keys[0], "token": "42", "outcome": "gone"}])
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        body = response.json()
        assert body["status"] == "unready" and "completed" not in body
        assert client.get("/v1/schedule", params={"key": keys[0]}).json() == before
