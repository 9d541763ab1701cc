"""`POST /v1/sitemaps`: a sitemap uploaded as the body (XML, or gzip of it), imported as
`renderqueue import-sitemap` would, with the node's route rules.

The body's Content-Type says which it is: XML as application/xml or text/xml, its gzip as
application/gzip or application/x-gzip; any other is refused (415) before the body is
read. The importer tells gzip from XML by the bytes, as it does for a file, so a body sent
under the other kind's type is read all the same. Bytes that are not a sitemap: 422.

An upload is one document: a sitemap index is refused, because fetching the children it
names would let any admin caller make the node fetch arbitrary URLs. Import an index with
the CLI, which reads children beside a file or from the index's own site.
"""

from __future__ import annotations

import functools
import io
import time
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from api.body import read_body
from api.node import Node
from api.problems import ApiError
from sitemap.errors import SitemapError
from sitemap.importer import ImportReport, import_sitemap
from sitemap.rules import RouteRules

SITEMAP_NS = "http://www.sitemaps.org/schemas/sitemap/0.9"
# A urlset in the terms of OpenAPI's XML object, so a client (or a generator) can build one
# from the document: <urlset xmlns=...><url><loc>...</loc></url>...</urlset>. Below the
# root no `type` or `required`: the importer refuses a document only when it is not a
# well-formed, safe urlset; inside one, a <url> without a usable <loc> is skipped and
# counted, and an element it does not know is passed over.
URLSET_SCHEMA: dict[str, Any] = {
    "title": "Urlset",
    "type": "object",
    "xml": {"name": "urlset", "namespace": SITEMAP_NS},
    "properties": {
        "url": {
            "xml": {"name": "url"},
            "items": {"xml": {"name": "url"}, "properties": {"loc": {"xml": {"name": "loc"}}}},
        }
    },
}
GZIP_SCHEMA: dict[str, Any] = {
    "type": "string",
    "format": "binary",
    "description": "The gzip of a sitemap's XML.",
}
# What the upload takes, each media type with the schema the document states for it.
MEDIA_TYPES: dict[str, dict[str, Any]] = {
    "application/xml": URLSET_SCHEMA,
    "text/xml": URLSET_SCHEMA,
    "application/gzip": GZIP_SCHEMA,
    "application/x-gzip": GZIP_SCHEMA,
}


@functools.lru_cache(maxsize=4)
def route_rules(path: str | None) -> RouteRules:
    # Validated when the settings were loaded; read once per worker.
    return RouteRules.default() if path is None else RouteRules.load(path)


async def import_upload(node: Node, request: Request) -> ImportReport:
    data = await read_body(request, node.settings.max_body_bytes)
    if not data.strip():
        raise ApiError(400, "Empty body", "send the sitemap XML (or its gzip) as the request body")
    rules = route_rules(node.settings.sitemap_route_rules)
    now = time.time_ns() // 1_000_000

    def run() -> ImportReport:
        return import_sitemap(io.BytesIO(data), node.store, rules, now, location="<upload>")

    try:
        return await run_in_threadpool(run)
    except SitemapError as exc:
        raise ApiError(422, "Sitemap refused", f"{exc}; nothing was written") from None
