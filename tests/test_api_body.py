"""Bodies over real HTTP: 413 past the limit (declared or streamed), 400 for broken JSON,
422 naming the field that fails validation, and nothing changed by a refused request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from node_harness import ThreadNode, node_db, seed_rows, thread_node

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, node_backend: str) -> Iterator[ThreadNode]:
    directory = tmp_path_factory.mktemp("body")
    seed_rows(node_db(directory), 10)
    with thread_node(directory, max_body_bytes=LIMIT) as running:
        running.wait_published()
        yield running


def problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["status"] == status and body["title"]
    return body


def test_a_declared_body_past_the_limit_is_413(node: ThreadNode) -> None:
    big = b'{"upsert": [' + b" " * LIMIT + b"]}"
    with node.client() as client:
        problem(client.post("/v1/schedule", content=big), 413)


def test_a_streamed_body_past_the_limit_is_413(node: ThreadNode) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"upsert": ['
        for _ in range(LIMIT // 1024 + 2):
            yield b" " * 1024
        yield b"]}"

    with node.client() as client:
        # No Content-Length: chunked transfer, counted as it arrives.
        problem(client.post("/v1/schedule", content=chunks()), 413)


@pytest.mark.parametrize(
    "content", [b"", b"{", b"not json", b'{"max": 1,}', b"\xff\xfe", b'{"max": 1']
)
def test_broken_json_is_400(node: ThreadNode, content: bytes) -> None:
    with node.client() as client:
        body = problem(client.post("/v1/claims", content=content), 400)
    assert body["field"] == "$"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/claims", {"max": 0, "worker": "w"}, "$.max"),
        ("/v1/claims", {"max": 1001, "worker": "w"}, "$.max"),
        ("/v1/claims", {"max": "5", "worker": "w"}, "$.max"),
        ("/v1/claims", {"worker": "w"}, "$.max"),
        ("/v1/claims", {"max": 1}, "$.worker"),
        ("/v1/claims", {"max": 1, "worker": ""}, "$.worker"),
        ("/v1/claims", {"max": 1, "worker": "w", "lease_s": 4}, "$.lease_s"),
        ("/v1/claims", {"max": 1, "worker": "w", "lease_s": 3601}, "$.lease_s"),
        ("/v1/claims", {"max": 1, "worker": "w", "wait_s": 31}, "$.wait_s"),
        ("/v1/claims", {"max": 1, "worker": "w", "wiat_s": 1}, "$.wiat_s"),
        ("/v1/claims", [], "$"),
        ("/v1/completions", {"items": []}, "$.items"),
        ("/v1/completions", {"items": [{"key": "k", "token": "1"}]}, "$.items[0].outcome"),
        (
            "/v1/completions",
            {"items": [{"key": "k", "token": "1", "outcome": "done"}]},
            "$.items[0].outcome",
        ),
        (
            "/v1/completions",
            {"items": [{"key": "k", "token": 12, "outcome": "failed"}]},
            "$.items[0].token",
        ),
        (
            "/v1/completions",
            {"items": [{"key": "k", "token": "-1", "outcome": "failed"}]},
            "$.items[0].token",
        ),
        (
            "/v1/completions",
            {"items": [{"key": "k", "token": "1", "outcome": "rendered", "next_render_at": -5}]},
            "$.items[0].next_render_at",
        ),
        ("/v1/leases/renew", {"items": [{"key": "k", "token": "1", "lease_s": 1}]}, None),
        ("/v1/schedule", {"upsert": [{"key": "k", "route": "Bad Route"}]}, "$.upsert[0].route"),
        ("/v1/schedule", {"upsert": [{"key": "", "route": "product"}]}, "$.upsert[0].key"),
        (
            "/v1/schedule",
            {"upsert": [{"key": "k", "route": "product", "cadence_s": 0}]},
            "$.upsert[0].cadence_s",
        ),
        ("/v1/schedule", {"delete": ["é" * 1025]}, "$.delete[0]"),
        ("/v1/schedule", {}, "$"),
        ("/v1/settings", {"default_cadence_s": 0}, "$.default_cadence_s"),
    ],
)
def test_a_body_failing_validation_is_422_naming_the_field(
    node: ThreadNode, path: str, body: Any, field: str | None
) -> None:
    with node.client() as client:
        found = problem(
            client.post(path, json=body) if path != "/v1/settings" else client.put(path, json=body),
            422,
        )
    assert found["field"] == (field or "$.items[0].lease_s")
    assert found["field"] in found["detail"]


def test_a_refused_batch_writes_nothing(node: ThreadNode) -> None:
    body = {
        "upsert": [
            {"key": "https://shop.example/fresh-1", "route": "product"},
            {"key": "https://shop.example/fresh-2", "route": "NOT VALID"},
        ]
    }
    with node.client() as client:
        problem(client.post("/v1/schedule", json=body), 422)
        assert client.get("/v1/schedule", params={"key": body["upsert"][0]["key"]}).status_code == (
            404
        )


def test_unknown_paths_and_methods_are_problems(node: ThreadNode) -> None:
    with node.client() as client:
        problem(client.get("/v2/nothing"), 404)
        problem(client.get("/v1/claims"), 405)
        problem(client.delete("/v1/routes"), 405)
