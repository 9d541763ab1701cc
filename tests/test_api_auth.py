"""Bearer tokens over real HTTP: the fleet token opens the fleet endpoints, the admin token
opens everything, probes stay open, and every refusal is problem+json."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from node_harness import ADMIN_TOKEN, FLEET_TOKEN, ThreadNode, seed_rows, thread_node

Call = tuple[str, str, object]
FLEET_CALLS: list[Call] = [
    ("POST", "/v1/claims", {"max": 1, "worker": "t"}),
    ("POST", "/v1/completions", {"items": [{"key": "k", "token": "1", "outcome": "failed"}]}),
    ("POST", "/v1/leases/renew", {"items": [{"key": "k", "token": "1"}]}),
]
ADMIN_CALLS: list[Call] = [
    ("POST", "/v1/schedule", {"upsert": [{"key": "https://a.example/", "route": "product"}]}),
    ("GET", "/v1/schedule?key=https://shop.example/p/0000000", None),
    ("GET", "/v1/routes", None),
    ("PUT", "/v1/routes/product", {"paused": False}),
    ("PUT", "/v1/settings", {"default_cadence_s": 86400}),
    ("GET", "/prerender_admin/queue-state", None),
    ("GET", "/prerender_admin/explain?key=https://shop.example/p/0000000", None),
    ("GET", "/prerender_admin/overview", None),
    ("GET", "/metrics", None),
]
PUBLIC_CALLS: list[Call] = [
    ("GET", "/healthz", None),
    ("GET", "/readyz", None),
    ("GET", "/openapi.json", None),
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadNode]:
    directory = tmp_path_factory.mktemp("auth")
    seed_rows(directory / "node.sqlite", 10)
    with thread_node(directory, tokens=True) as running:
        running.wait_published()
        yield running


def call(node: ThreadNode, method: str, path: str, body: object, token: str | None) -> int:
    with node.client(token) as client:
        response = client.request(method, path, json=body)
    if response.status_code in (401, 403):
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["status"] == response.status_code
    if response.status_code == 401:
        assert response.headers["www-authenticate"].startswith("Bearer")
    return response.status_code


@pytest.mark.parametrize(("method", "path", "body"), FLEET_CALLS + ADMIN_CALLS)
def test_no_token_is_401(node: ThreadNode, method: str, path: str, body: object) -> None:
    assert call(node, method, path, body, None) == 401


@pytest.mark.parametrize(("method", "path", "body"), FLEET_CALLS + ADMIN_CALLS)
def test_an_unknown_token_is_401(node: ThreadNode, method: str, path: str, body: object) -> None:
    assert call(node, method, path, body, "not-a-token-we-issued-at-all") == 401


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
def test_the_fleet_token_on_admin_endpoints_is_403(
    node: ThreadNode, method: str, path: str, body: object
) -> None:
    assert call(node, method, path, body, FLEET_TOKEN) == 403


@pytest.mark.parametrize(("method", "path", "body"), FLEET_CALLS)
def test_the_fleet_token_opens_the_fleet_endpoints(
    node: ThreadNode, method: str, path: str, body: object
) -> None:
    assert call(node, method, path, body, FLEET_TOKEN) == 200


@pytest.mark.parametrize(("method", "path", "body"), FLEET_CALLS + ADMIN_CALLS)
def test_the_admin_token_opens_everything(
    node: ThreadNode, method: str, path: str, body: object
) -> None:
    assert call(node, method, path, body, ADMIN_TOKEN) == 200


@pytest.mark.parametrize(("method", "path", "body"), PUBLIC_CALLS)
def test_probes_and_the_description_need_no_token(
    node: ThreadNode, method: str, path: str, body: object
) -> None:
    assert call(node, method, path, body, None) == 200


def test_a_malformed_authorization_header_is_401(node: ThreadNode) -> None:
    with node.client() as client:
        for header in ("Basic dXNlcjpwYXNz", "Bearer", "Token " + ADMIN_TOKEN, ADMIN_TOKEN):
            response = client.get("/v1/routes", headers={"Authorization": header})
            assert response.status_code == 401, header


def test_without_tokens_auth_is_off(tmp_path: Path) -> None:
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        assert client.get("/v1/routes").status_code == 200


def test_with_only_the_fleet_token_the_admin_endpoints_stay_open(tmp_path: Path) -> None:
    # The settings keep such a node on loopback (tests/test_workers_config.py).
    with thread_node(tmp_path, tokens="fleet") as node:
        node.wait_published()
        with node.client() as client:
            assert client.post("/v1/claims", json={"max": 1, "worker": "t"}).status_code == 401
            assert client.get("/v1/routes").status_code == 200
        with node.client(FLEET_TOKEN) as client:
            assert client.post("/v1/claims", json={"max": 1, "worker": "t"}).status_code == 200
