"""A client generated from the node's own `/openapi.json` by openapi-python-client (a
standard generator, run here as a fleet in another codebase would run it) claims, renews,
completes, and claims carrying completions against a live node: the document is enough to
build a fleet from.

The client is generated at test time into tmp_path from the live document, never
committed, so it is always the current document's client.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from node_harness import ADMIN_TOKEN, FLEET_TOKEN, ThreadNode, now_ms, seed_rows, thread_node

PACKAGE = "renderqueue_client"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadNode]:
    directory = tmp_path_factory.mktemp("generated")
    seed_rows(directory / "node.sqlite", 5)
    with thread_node(directory, tokens=True) as running:
        running.wait_published()
        yield running


@pytest.fixture(scope="module")
def client_package(node: ThreadNode, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    out = tmp_path_factory.mktemp("client")
    with node.client() as http:
        (out / "openapi.json").write_bytes(http.get("/openapi.json").content)
    # The generator has no XML bodies: it is told to send the sitemap upload's (XML or its
    # gzip, as the document states) as the bytes they are, its documented override.
    (out / "config.json").write_text(
        '{"content_type_overrides": {"application/xml": "application/octet-stream", '
        '"text/xml": "application/octet-stream", "application/gzip": "application/octet-stream", '
        '"application/x-gzip": "application/octet-stream"}}'
    )
    bin_dir = Path(sys.executable).parent
    generated = subprocess.run(
        [
            str(bin_dir / "openapi-python-client"),
            *("generate", "--path", "openapi.json", "--config", "config.json"),
            *("--meta", "none", "--fail-on-warning"),
        ],
        cwd=out,
        # Its post-generation step formats the client with ruff, found on PATH.
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert generated.returncode == 0, generated.stdout + generated.stderr
    sys.path.insert(0, str(out))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(out))
        for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
            del sys.modules[name]


def test_a_generated_client_claims_renews_and_completes(
    node: ThreadNode, client_package: Any
) -> None:
    api = importlib.import_module(f"{PACKAGE}.api.default")
    models = importlib.import_module(f"{PACKAGE}.models")
    claims = importlib.import_module(f"{PACKAGE}.api.default.post_v1_claims")
    renew = importlib.import_module(f"{PACKAGE}.api.default.post_v1_leases_renew")
    complete = importlib.import_module(f"{PACKAGE}.api.default.post_v1_completions")
    get_row = importlib.import_module(f"{PACKAGE}.api.default.get_v1_schedule")
    assert api is not None

    fleet = client_package.AuthenticatedClient(base_url=node.url, token=FLEET_TOKEN)
    with fleet:
        claimed = claims.sync_detailed(
            client=fleet, body=models.ClaimRequest(max_=2, worker="generated", lease_s=30)
        )
        assert claimed.status_code == 200, claimed.content
        response = claimed.parsed
        assert isinstance(response, models.ClaimResponse)
        assert len(response.leases) == 2 and response.status == "ready"
        first, second = response.leases
        assert first.lease_expires_at <= now_ms() + 30_000

        renewed = renew.sync(
            client=fleet,
            body=models.RenewRequest(
                items=[models.RenewItem(key=first.key, token=first.token, lease_s=600)]
            ),
        )
        assert isinstance(renewed, models.RenewResults)
        (result,) = renewed.results
        assert result.ok is True and result.lease_expires_at > first.lease_expires_at

        later = now_ms() + 3_600_000
        done = complete.sync(
            client=fleet,
            body=models.CompletionsRequest(
                items=[
                    models.CompletionItem(
                        key=first.key,
                        token=first.token,
                        outcome=models.CompletionItemOutcome.RENDERED,
                        next_render_at=later,
                    ),
                    models.CompletionItem(
                        key=second.key,
                        token=str(int(second.token) + 1),  # not the token it was granted
                        outcome=models.CompletionItemOutcome.RENDERED,
                    ),
                ]
            ),
        )
        assert isinstance(done, models.ItemResults)
        assert [(r.key, r.ok) for r in done.results] == [(first.key, True), (second.key, False)]
        assert done.results[1].error == "lease_not_held"

        # The next claim carries the second lease's result: applied first, answered beside
        # the new leases.
        carried = claims.sync(
            client=fleet,
            body=models.ClaimRequest(
                max_=1,
                worker="generated",
                lease_s=30,
                complete=[
                    models.CompletionItem(
                        key=second.key,
                        token=second.token,
                        outcome=models.CompletionItemOutcome.FAILED,
                    )
                ],
            ),
        )
        assert isinstance(carried, models.ClaimResponse)
        assert len(carried.leases) == 1 and carried.leases[0].key not in (first.key, second.key)
        assert isinstance(carried.completed, list)
        (applied,) = carried.completed
        assert (applied.key, applied.ok) == (second.key, True) and applied.held_until > now_ms()

        # The fleet token opens nothing else: the generated client hears the 403 as a Problem.
        refused = get_row.sync_detailed(client=fleet, key=first.key)
        assert refused.status_code == 403 and isinstance(refused.parsed, models.Problem)

    admin = client_package.AuthenticatedClient(base_url=node.url, token=ADMIN_TOKEN)
    with admin:
        row = get_row.sync(client=admin, key=first.key)
        assert isinstance(row, models.Row) and row.next_render_at == later
        missing = get_row.sync_detailed(client=admin, key="https://nowhere.example/")
        assert missing.status_code == 404 and isinstance(missing.parsed, models.Problem)
