"""The read-only token: it opens /metrics and the reads a console or an autoscaler makes,
and every endpoint that writes answers 403 with it."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from node_harness import local_node

from api.app import build_services, create_app
from api.auth import Authenticator
from api.endpoints import ENDPOINTS
from api.problems import ApiError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

ADMIN = "scope-admin-token-" + "a" * 16
FLEET = "scope-fleet-token-" + "f" * 16
READ = "scope-read-token-" + "r" * 16
READS = {
    ("GET", "/metrics"),
    ("GET", "/prerender_admin/queue-state"),
    ("GET", "/prerender_admin/cluster/queue-state"),
    ("GET", "/prerender_admin/overview"),
    ("GET", "/prerender_admin/explain"),
    ("GET", "/v1/routes"),
    ("GET", "/v1/schedule"),
    ("GET", "/v1/sites"),
    ("GET", "/v1/sites/{site}"),
    ("GET", "/v1/sites-in-flight"),
}


def client_for(node: Any, *, peer: str = "testclient", **settings: Any) -> TestClient:
    import msgspec

    node.settings = msgspec.structs.replace(
        node.settings, admin_token=ADMIN, fleet_token=FLEET, metrics_token=READ, **settings
    )
    return TestClient(
        create_app(node, build_services(node)), client=(peer, 50000), raise_server_exceptions=False
    )


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    with local_node(tmp_path / "node.sqlite") as (found, _, _):
        yield found


def path_of(path: str) -> str:
    return path.replace("{route}", "product").replace("{site}", "example.com")


def test_every_write_answers_403_to_the_read_only_token(node: Any) -> None:
    client = client_for(node)
    writes = [e for e in ENDPOINTS if e.scope in ("admin", "fleet")]
    assert {(e.method, e.path) for e in writes} >= {
        ("POST", "/v1/schedule"),
        ("PUT", "/v1/routes/{route}"),
        ("PUT", "/v1/settings"),
        ("PUT", "/v1/sites/{site}"),
        ("POST", "/v1/sitemaps"),
        ("POST", "/prerender_admin/render-now"),
        ("POST", "/v1/claims"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/leases/renew"),
    }
    for endpoint in writes:
        response = client.request(
            endpoint.method,
            path_of(endpoint.path),
            headers={"Authorization": f"Bearer {READ}"},
            json={},
        )
        assert response.status_code == 403, endpoint.path
        problem = response.json()
        assert "read-only token opens only reads" in problem["detail"], endpoint.path
        assert 'error="insufficient_scope"' in response.headers["www-authenticate"]
    # Nothing was written.
    assert node.store.routes() == [] and node.store.count() == 0


def test_the_read_only_token_opens_the_reads(node: Any) -> None:
    client = client_for(node)
    reads = {(e.method, e.path) for e in ENDPOINTS if e.scope in ("read", "metrics")}
    assert reads == READS
    headers = {"Authorization": f"Bearer {READ}"}
    metrics = client.get("/metrics", headers=headers)
    assert metrics.status_code == 200 and "renderqueue_ready" in metrics.text
    assert client.get("/v1/routes", headers=headers).status_code == 200
    assert client.get("/prerender_admin/overview", headers=headers).status_code == 200
    # No keeper here: 503 with trust, which is an answer, not a refusal.
    assert client.get("/prerender_admin/queue-state", headers=headers).status_code == 503
    explained = client.get("/prerender_admin/explain", params={"key": "/x"}, headers=headers)
    assert explained.status_code == 200 and explained.json()["exists"] is False
    assert client.get("/v1/schedule", params={"key": "/x"}, headers=headers).status_code == 404
    assert client.get("/v1/sites", headers=headers).status_code == 503  # no keeper here
    # No supervisor here: nothing counts the leases by site, so no minute is counted.
    hour = client.get("/v1/sites-in-flight", headers=headers)
    assert hour.status_code == 200 and set(hour.json()["total"]) == {None}
    # The fleet token does not open them, and says what it does open.
    refused = client.get("/metrics", headers={"Authorization": f"Bearer {FLEET}"})
    assert refused.status_code == 403 and "fleet token only opens" in refused.json()["detail"]
    # Without a token: 401.
    assert client.get("/metrics").status_code == 401


def test_metrics_open_on_loopback_only_when_set(node: Any) -> None:
    assert client_for(node, peer="127.0.0.1").get("/metrics").status_code == 401
    opened = client_for(node, peer="127.0.0.1", metrics_open_on_loopback=True)
    assert opened.get("/metrics").status_code == 200
    # Only /metrics, and only to loopback peers.
    assert opened.get("/prerender_admin/queue-state").status_code == 401
    remote = client_for(node, peer="192.0.2.7", metrics_open_on_loopback=True)
    assert remote.get("/metrics").status_code == 401


def test_authenticator_scopes() -> None:
    auth = Authenticator(fleet_token=FLEET, admin_token=ADMIN, read_token=READ)
    for scope in ("read", "metrics", "admin", "fleet"):
        auth.check(scope, f"Bearer {ADMIN}")
    auth.check("read", f"Bearer {READ}")
    auth.check("metrics", f"Bearer {READ}")
    for scope in ("admin", "fleet"):
        with pytest.raises(ApiError) as refused:
            auth.check(scope, f"Bearer {READ}")  # type: ignore[arg-type]
        assert refused.value.status == 403
    # No admin token: a loopback-only node, where the reads are open as the admin ones are.
    Authenticator(fleet_token=None, admin_token=None, read_token=None).check("read", None)


def test_config_takes_the_read_only_token() -> None:
    from workers.config import ConfigError, load_settings

    settings = load_settings(
        environ={"RENDERQUEUE_ADMIN_TOKEN": ADMIN, "RENDERQUEUE_METRICS_TOKEN": READ}
    )
    assert settings.metrics_token == READ and settings.metrics_open_on_loopback is False
    with pytest.raises(ConfigError, match="metrics_token"):
        load_settings(
            environ={"RENDERQUEUE_ADMIN_TOKEN": ADMIN, "RENDERQUEUE_METRICS_TOKEN": ADMIN}
        )
