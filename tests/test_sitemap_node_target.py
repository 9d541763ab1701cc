"""sitemap.node_target: `import-sitemap --node` through a real node's schedule API gives
the same rows and the same report as writing to the store directly."""

from __future__ import annotations

import gzip
import io
import json
import time
from pathlib import Path

import httpx
import pytest
from sitemap_helpers import url_xml, urlset

from sitemap.cli import main
from sitemap.importer import import_sitemap
from sitemap.node_target import NodeScheduleTarget, NodeTargetError
from sitemap.rules import RouteRules
from store import open_store

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_a_refusing_node_is_reported_with_its_problem_detail() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            401,
            json={"title": "Unauthorized", "detail": "an admin token is required"},
            headers={"content-type": "application/problem+json"},
        )

    target = NodeScheduleTarget("http://node", transport=httpx.MockTransport(handle))
    with target, pytest.raises(NodeTargetError, match=r"HTTP 401.*admin token is required"):
        import_sitemap(
            io.BytesIO(urlset(url_xml("https://e.com/a"))),
            target,
            RouteRules.default(),
            time.time_ns() // 1_000_000,
        )


def test_import_through_a_real_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from node_harness import ADMIN_TOKEN, node_process

    sitemap = tmp_path / "sitemap.xml.gz"
    entries = [
        url_xml(f"https://shop.example/p/boot-{i}", "2024-01-01", "daily") for i in range(300)
    ]
    entries.append(url_xml("https://shop.example/", None, "hourly"))
    entries.append(url_xml("not a url"))
    sitemap.write_bytes(gzip.compress(urlset(*entries)))
    with node_process(tmp_path, workers=2, tokens=True) as node:
        argv = [
            str(sitemap),
            "--route-rules",
            str(EXAMPLES / "route-rules.toml"),
            "--node",
            node.url,
            "--json",
        ]
        assert main(argv) == 1  # no token: the node refuses, and says why
        assert "HTTP 401" in capsys.readouterr().err
        assert main([*argv, "--token", ADMIN_TOKEN]) == 0
        first = json.loads(capsys.readouterr().out)
        assert main([*argv, "--token", ADMIN_TOKEN]) == 0
        second = json.loads(capsys.readouterr().out)
    assert (first["imported"], first["updated"], first["skipped"]) == (301, 0, 1)
    assert second["imported"] == 0 and second["skipped_by_reason"]["unchanged"] == 301
    store = open_store(str(node.db))
    try:
        assert store.count() == 301
        row = store.get("https://shop.example/")
        product = store.get("https://shop.example/p/boot-7")
    finally:
        store.close()
    assert row is not None and (row.route, row.cadence_s, row.sitemap) == ("home", 3600, True)
    assert product is not None and (product.route, product.cadence_s) == ("product", 86400)
