"""`POST /v1/sitemaps`: a sitemap uploaded as the body (XML, or gzip of it), imported as
`renderqueue import-sitemap` would, with the node's route rules.

An upload is one document: a sitemap index is refused, because fetching the children it
names would let any admin caller make the node fetch arbitrary URLs. Import an index with
the CLI, which reads children beside a file or from the index's own site.
"""

from __future__ import annotations

import functools
import io
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from api.body import read_body
from api.node import Node
from api.problems import ApiError
from sitemap.errors import SitemapError
from sitemap.importer import ImportReport, import_sitemap
from sitemap.rules import RouteRules


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
