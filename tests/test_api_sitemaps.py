"""`POST /v1/sitemaps` over real HTTP: an upload is imported with the node's route rules;
a refused document (unsafe, an index, not XML, empty, too large, under a media type the
document does not state) writes nothing."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from node_harness import ThreadNode, thread_node

from workers.config import ConfigError, load_settings

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

RULES = """
default_route = "page"

[[rules]]
route = "product"
path = "/p/*"
"""

URLSET = b"""<?xml version="1.0" encoding="UTF-8"?>
<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">
  <url><loc>https://shop.example/p/sku-1</loc><changefreq>daily</changefreq></url>
  <url><loc>https://shop.example/p/sku-2</loc></url>
  <url><loc>https://shop.example/about</loc><changefreq>monthly</changefreq></url>
  <url><loc>not a url</loc></url>
</urlset>
"""

EXTERNAL_ENTITY = b"""<?xml version="1.0"?>
<!DOCTYPE urlset [<!ENTITY leak SYSTEM "file:///etc/passwd">]>
<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">
  <url><loc>https://shop.example/&leak;</loc></url>
</urlset>
"""

INDEX = b"""<?xml version="1.0" encoding="UTF-8"?>
<sitemapindex xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">
  <sitemap><loc>https://shop.example/sitemap-1.xml</loc></sitemap>
</sitemapindex>
"""


@pytest.fixture
def node(tmp_path: Path, node_backend: str) -> Iterator[ThreadNode]:
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    with thread_node(tmp_path, sitemap_route_rules=str(rules)) as running:
        running.wait_published()
        yield running


def post(node: ThreadNode, body: bytes, content_type: str | None = "application/xml") -> Any:
    headers = {} if content_type is None else {"content-type": content_type}
    with node.client() as client:
        return client.post("/v1/sitemaps", content=body, headers=headers)


def test_an_uploaded_gzipped_sitemap_is_imported_with_the_rules(node: ThreadNode) -> None:
    response = post(node, gzip.compress(URLSET), "application/gzip")
    assert response.status_code == 200, response.text
    report = response.json()
    assert (report["imported"], report["skipped"]) == (3, 1)
    assert report["skipped_by_reason"] == {"bad_url": 1}
    product = node.store.get("https://shop.example/p/sku-1")
    about = node.store.get("https://shop.example/about")
    assert product is not None and about is not None
    assert (product.route, product.sitemap, product.cadence_s) == ("product", True, 86400)
    assert about.route == "page"
    # The same upload again changes nothing.
    again = post(node, URLSET).json()
    assert again["imported"] == 0 and again["updated"] == 0


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (EXTERNAL_ENTITY, 422),
        (INDEX, 422),
        (b"<urlset", 422),
        (b"not xml at all", 422),
        (b"\x1f\x8b not a gzip stream", 422),
        (b"", 400),
        (b"  ", 400),
    ],
    ids=["external-entity", "index", "truncated", "not-xml", "broken-gzip", "empty", "blank"],
)
def test_a_refused_upload_writes_nothing(node: ThreadNode, body: bytes, status: int) -> None:
    before = node.store.count()
    response = post(node, body)
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/problem+json")
    assert node.store.count() == before


@pytest.mark.parametrize(
    "content_type", ["text/xml; charset=utf-8", "APPLICATION/XML", "application/x-gzip"]
)
def test_every_stated_media_type_is_taken(node: ThreadNode, content_type: str) -> None:
    body = gzip.compress(URLSET) if "gzip" in content_type else URLSET
    response = post(node, body, content_type)
    assert response.status_code == 200, response.text
    assert response.json()["imported"] == 3


@pytest.mark.parametrize(
    "content_type",
    [None, "application/octet-stream", "application/json", "text/plain", "application/xml+x"],
)
def test_an_unstated_media_type_is_415_and_writes_nothing(
    node: ThreadNode, content_type: str | None
) -> None:
    before = node.store.count()
    response = post(node, URLSET, content_type)
    assert response.status_code == 415, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert (
        "application/xml, text/xml, application/gzip, application/x-gzip"
        in (response.json()["detail"])
    )
    assert node.store.count() == before


def test_an_upload_past_the_body_limit_is_413(node: ThreadNode) -> None:
    assert post(node, b" " * (65 * 1024)).status_code == 413


def test_unreadable_route_rules_are_a_settings_error(tmp_path: Path) -> None:
    bad = tmp_path / "rules.toml"
    bad.write_text("rules = 3")
    for path in (str(bad), str(tmp_path / "missing.toml")):
        with pytest.raises(ConfigError, match="sitemap_route_rules"):
            load_settings(environ={}, flags={"sitemap_route_rules": path})
