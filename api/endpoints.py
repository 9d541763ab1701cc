"""The API's one table of endpoints: path, method, scope, body and response types.

The app's routes and `/openapi.json` are both built from this table, so the description
a client (or the fuzz test) reads is the API that runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from api import admin, claims, metrics, schedule, sitemaps
from api.auth import Scope
from api.node import Node
from api.schemas import (
    ClaimRequest,
    ClaimResponse,
    CompletionsRequest,
    Explain,
    Health,
    ItemResults,
    NodeSettings,
    NodeStatus,
    Overview,
    Readiness,
    RenewRequest,
    RenewResults,
    Routes,
    RouteUpdate,
    ScheduleRequest,
    ScheduleResult,
    SettingsUpdate,
)
from sitemap.importer import ImportReport
from store.rows import Route, Row


@dataclass(frozen=True, eq=False)
class Call:
    request: Request
    node: Node
    body: Any


@dataclass(frozen=True)
class QueryParam:
    name: str
    description: str
    required: bool = True


@dataclass(frozen=True, eq=False)
class Endpoint:
    method: str
    path: str
    scope: Scope
    summary: str
    run: Callable[[Call], Any | Awaitable[Any]]
    body: type | None = None
    response: type | None = None  # the 200 body; None with `media_type` for text
    media_type: str = "application/json"
    query: tuple[QueryParam, ...] = ()
    path_params: tuple[QueryParam, ...] = ()
    errors: tuple[int, ...] = ()  # documented problem statuses beyond 401/403/413/422
    unavailable: type | None = None  # the 503 body, when the endpoint has one

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.run)


async def _claim(call: Call) -> ClaimResponse | Response:
    return await claims.claim(call.node, call.body)


async def _complete(call: Call) -> ItemResults:
    return await call.node.completions.complete(call.body)


async def _import_sitemap(call: Call) -> ImportReport:
    return await sitemaps.import_upload(call.node, call.request)


def _query(call: Call, name: str) -> str | None:
    return call.request.query_params.get(name)


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "POST",
        "/v1/claims",
        "fleet",
        "Lease up to `max` due keys, most overdue first; `wait_s` long-polls for the next publish.",
        _claim,
        body=ClaimRequest,
        response=ClaimResponse,
        unavailable=NodeStatus,
    ),
    Endpoint(
        "POST",
        "/v1/completions",
        "fleet",
        "Report render results; a stale or unknown token changes nothing (`lease_not_held`).",
        _complete,
        body=CompletionsRequest,
        response=ItemResults,
    ),
    Endpoint(
        "POST",
        "/v1/leases/renew",
        "fleet",
        "Extend leases still held by their tokens.",
        lambda call: claims.renew(call.node, call.body),
        body=RenewRequest,
        response=RenewResults,
    ),
    Endpoint(
        "POST",
        "/v1/schedule",
        "admin",
        "Upsert and delete rows, all or nothing; `next_render_at` defaults to now.",
        lambda call: schedule.write(call.node, call.body),
        body=ScheduleRequest,
        response=ScheduleResult,
    ),
    Endpoint(
        "POST",
        "/v1/sitemaps",
        "admin",
        "Import one sitemap (XML or gzip, as the raw body) with the node's route rules; "
        "a refused document writes nothing.",
        _import_sitemap,
        response=ImportReport,
    ),
    Endpoint(
        "GET",
        "/v1/schedule",
        "admin",
        "One row by key.",
        lambda call: schedule.get_row(call.node, _query(call, "key")),
        response=Row,
        query=(QueryParam("key", "the row's key"),),
        errors=(404,),
    ),
    Endpoint(
        "GET",
        "/v1/routes",
        "admin",
        "Every route with its default cadence and pause flag, and the global default.",
        lambda call: schedule.routes(call.node),
        response=Routes,
    ),
    Endpoint(
        "PUT",
        "/v1/routes/{route}",
        "admin",
        "Set a route's default cadence or pause it.",
        lambda call: schedule.set_route(call.node, call.request.path_params["route"], call.body),
        body=RouteUpdate,
        response=Route,
        path_params=(QueryParam("route", "the route's name"),),
    ),
    Endpoint(
        "PUT",
        "/v1/settings",
        "admin",
        "Set the global default cadence (used when neither row nor route has one).",
        lambda call: schedule.set_settings(call.node, call.body),
        body=SettingsUpdate,
        response=NodeSettings,
    ),
    Endpoint(
        "GET",
        "/prerender_admin/queue-state",
        "admin",
        "This node's queue state; 503 with trust and the live `now` fields when the keeper "
        "cannot vouch for its numbers.",
        lambda call: admin.queue_state(call.node),
        response=dict,
        unavailable=dict,
    ),
    Endpoint(
        "GET",
        "/prerender_admin/explain",
        "admin",
        "A key's row, class, rank, lease and hold state, and why it is or is not claimed.",
        lambda call: admin.explain(call.node, _query(call, "key")),
        response=Explain,
        query=(QueryParam("key", "the row's key"),),
    ),
    Endpoint(
        "GET",
        "/prerender_admin/overview",
        "admin",
        "Leases in flight, the ready ring, the supervisor's workers, the keeper's statistics.",
        lambda call: admin.overview(call.node),
        response=Overview,
    ),
    Endpoint(
        "GET",
        "/metrics",
        "admin",
        "Prometheus text format.",
        lambda call: metrics.render(call.node),
        media_type=metrics.CONTENT_TYPE,
    ),
    Endpoint(
        "GET",
        "/console",
        "public",
        "The operator's console: a page that reads queue-state and overview with the token "
        "entered in it.",
        lambda call: admin.console(),
        media_type="text/html; charset=utf-8",
    ),
    Endpoint(
        "GET",
        "/healthz",
        "public",
        "The worker is serving.",
        lambda call: admin.healthz(call.node),
        response=Health,
    ),
    Endpoint(
        "GET",
        "/readyz",
        "public",
        "200 once the keeper has published the queue, 503 before.",
        lambda call: admin.readyz(call.node),
        response=Readiness,
        unavailable=Readiness,
    ),
)
