"""The API's one table of endpoints: path, method, scope, body and response types.

The app's routes and `/openapi.json` are both built from this table, so the description
a client (or the fuzz test) reads is the API that runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from api import (
    admin,
    claims,
    cluster,
    completions,
    metrics,
    schedule,
    site_history,
    site_list,
    sitemaps,
    sites,
)
from api.auth import Scope
from api.node import Node
from api.params import Param, as_int
from api.services import Services
from keeper.state import SITES_LISTED
from sitemap.importer import ImportReport
from store.rows import Route, Row
from store.validate import check_key
from wire.schemas import (
    HISTORY_SITES,
    ClaimRequest,
    ClaimResponse,
    ClusterNodes,
    CompletionsRequest,
    Explain,
    Health,
    ItemResults,
    Key,
    NodeSettings,
    NodeStatus,
    Overview,
    PageLimit,
    Readiness,
    RenderNow,
    RenewRequest,
    RenewResults,
    RouteName,
    Routes,
    RouteUpdate,
    RowPage,
    ScheduleRequest,
    ScheduleResult,
    SettingsUpdate,
    SiteName,
    SitesInFlight,
    SitesListing,
    SiteState,
    SitesTop,
    SiteUpdate,
)


@dataclass(frozen=True, eq=False)
class Call:
    request: Request
    node: Node
    services: Services
    body: Any
    params: dict[str, str]  # the query and path parameters, checked (api.params)


@dataclass(frozen=True, eq=False)
class Endpoint:
    method: str
    path: str
    scope: Scope
    summary: str
    run: Callable[[Call], Any | Awaitable[Any]]
    body: type | None = None
    response: Any = None  # the 200 body (a type, or a union of them); None with `media_type`: text
    media_type: str = "application/json"
    query: tuple[Param, ...] = ()
    path_params: tuple[Param, ...] = ()
    errors: tuple[int, ...] = ()  # documented problem statuses beyond 401/403/413/422
    unavailable: type | None = None  # the 503 body, when the endpoint has one
    # The body is read raw, in one of these media types (each with the schema the document
    # states), instead of as JSON into `body`; another Content-Type is refused (415).
    raw_body: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    # Reads or writes the store, so a busy or unreachable store answers 503 (api.app).
    uses_store: bool = True
    # Writes to the store, so a full or failing disk answers 507 (api.app).
    writes_store: bool = False

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.run)


def on_lane(run: Callable[[Call], Any]) -> Callable[[Call], Awaitable[Any]]:
    """An endpoint whose handler calls the store, made whole on the worker's store lane
    (api.lane): the event loop goes on serving while it waits. Such a handler touches no
    asyncio object, and stamps its writes on the lane, where they were made."""

    async def run_on_lane(call: Call) -> Any:
        return await call.node.lane.call(lambda: run(call))

    return run_on_lane


async def _claim(call: Call) -> ClaimResponse | Response:
    if call.body.complete is None:
        return await claims.claim(call.node, call.body)
    services, forwarding = call.services, _forwarding(call)
    return await completions.claim_completing(
        call.node,
        call.body,
        lambda request: services.cluster.complete(
            request, services.completions.complete, *forwarding
        ),
    )


def _forwarding(call: Call) -> tuple[str | None, str | None]:
    """The caller's credentials (the cluster's nodes share tokens) and, on a request another
    node forwarded, that node's name."""
    headers = call.request.headers
    return headers.get("authorization"), headers.get(cluster.FORWARDED_BY)


async def _complete(call: Call) -> ItemResults:
    completions = call.services.completions
    return await call.services.cluster.complete(call.body, completions.complete, *_forwarding(call))


async def _renew(call: Call) -> RenewResults:
    node = call.node
    return await call.services.cluster.renew(
        call.body, lambda request: claims.renew(node, request), *_forwarding(call)
    )


async def _members(call: Call) -> ClusterNodes:
    return await call.services.cluster.members()


async def _cluster_queue_state(call: Call) -> Response:
    node = call.node
    return await call.services.cluster.queue_state(
        call.request.headers.get("authorization"), lambda: admin.queue_state_document(node)
    )


async def _import_sitemap(call: Call) -> ImportReport:
    return await sitemaps.import_upload(call.node, call.request)


ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "POST",
        "/v1/claims",
        "fleet",
        "Lease up to `max` due keys, most overdue first; `wait_s` long-polls for the next "
        "publish. `complete` carries the previous batch's results, applied first and answered "
        "in `completed` as `POST /v1/completions` answers them.",
        _claim,
        body=ClaimRequest,
        response=ClaimResponse,
        unavailable=NodeStatus,
        writes_store=True,
    ),
    Endpoint(
        "POST",
        "/v1/completions",
        "fleet",
        "Report render results; a stale or unknown token changes nothing (`lease_not_held`). "
        "In a cluster any node takes them: an item another node granted is forwarded there.",
        _complete,
        body=CompletionsRequest,
        response=ItemResults,
        writes_store=True,
    ),
    Endpoint(
        "POST",
        "/v1/leases/renew",
        "fleet",
        "Extend leases still held by their tokens (in a cluster, at the node that granted each).",
        _renew,
        body=RenewRequest,
        response=RenewResults,
    ),
    Endpoint(
        "GET",
        "/v1/cluster",
        "discover",
        "The live nodes (name, URL, start, heartbeat age) from the cluster's member list; a "
        "single node lists itself. The fleet finds every node from any one.",
        _members,
        response=ClusterNodes,
    ),
    Endpoint(
        "POST",
        "/v1/schedule",
        "admin",
        "Upsert and delete rows, all or nothing; `next_render_at` defaults to now.",
        on_lane(lambda call: schedule.write(call.node, call.body)),
        body=ScheduleRequest,
        response=ScheduleResult,
        writes_store=True,
    ),
    Endpoint(
        "POST",
        "/v1/sitemaps",
        "admin",
        "Import one sitemap (XML, or its gzip, as the raw body) with the node's route rules; "
        "a refused document writes nothing.",
        _import_sitemap,
        response=ImportReport,
        raw_body=sitemaps.MEDIA_TYPES,
        writes_store=True,
    ),
    Endpoint(
        "GET",
        "/v1/schedule",
        "read",
        "One row by `key` (with `retired=true`: only if it is retired); without `key`, the "
        "rows by key a page at a time (`retired=true`: the retired ones, each with when and "
        "why it retired), from after `after`.",
        on_lane(lambda call: schedule.read(call.node, call.params)),
        response=Row | RowPage,
        query=(
            Param("key", "one row's key", Key, check_key, optional=True),
            Param(
                "retired",
                "only retired rows (a streak of not_found outcomes retired them)",
                bool,
                default="false",
            ),
            Param("after", "list the rows after this key", Key, check_key, optional=True),
            Param(
                "limit",
                "list at most this many rows",
                PageLimit,
                default=str(schedule.DEFAULT_PAGE),
            ),
        ),
        errors=(404,),
    ),
    Endpoint(
        "GET",
        "/v1/routes",
        "read",
        "Every route with its default cadence and pause flag, and the global default.",
        on_lane(lambda call: schedule.routes(call.node)),
        response=Routes,
    ),
    Endpoint(
        "PUT",
        "/v1/routes/{route}",
        "admin",
        "Set or clear (`default_cadence_s: null`) a route's default cadence; pause or resume it; "
        "set after how many `not_found` outcomes in a row its rows retire (`retire_after`).",
        on_lane(lambda call: schedule.set_route(call.node, call.params["route"], call.body)),
        body=RouteUpdate,
        response=Route,
        writes_store=True,
        path_params=(Param("route", "the route's name", RouteName),),
    ),
    Endpoint(
        "PUT",
        "/v1/settings",
        "admin",
        "Set the global default cadence (used when neither row nor route has one).",
        on_lane(lambda call: schedule.set_settings(call.node, call.body)),
        body=SettingsUpdate,
        response=NodeSettings,
        writes_store=True,
    ),
    Endpoint(
        "GET",
        "/v1/sites",
        "read",
        "This node's sites (a URL's host, without www.) by due rows, most first, as of the "
        "keeper's last full report; 503 while the keeper cannot vouch for its counts.",
        lambda call: site_list.sites(call.node, as_int(call.params["top"])),
        response=SitesListing,
        unavailable=NodeStatus,
        query=(
            Param(
                "top",
                f"how many sites to list (at most {SITES_LISTED})",
                SitesTop,
                default=str(site_list.DEFAULT_TOP),
            ),
        ),
        uses_store=False,
    ),
    Endpoint(
        "GET",
        "/v1/sites-in-flight",
        "read",
        "Leases in flight per site over the last hour, each minute's highest count, as this "
        "node's supervisor counts them every second (every live lease, capped site or not): "
        f"the {HISTORY_SITES} sites with the highest peaks, the total, and the last count's "
        "sites; a minute not counted (before the node started) is null.",
        lambda call: site_history.sites_in_flight(call.node),
        response=SitesInFlight,
        unavailable=NodeStatus,
        uses_store=False,
    ),
    Endpoint(
        "GET",
        "/v1/sites/{site}",
        "read",
        "One site: its own settings (null: the node's default), what its grants follow now, "
        "its leases in flight, whether it is blocked (until when, and why), its failure "
        "streak and its due rows.",
        lambda call: sites.get_site(call.node, call.params["site"]),
        response=SiteState,
        path_params=(Param("site", "the site's host name", SiteName),),
    ),
    Endpoint(
        "PUT",
        "/v1/sites/{site}",
        "admin",
        "Set a site's own `max_in_flight` and `min_interval_ms` (absent: unchanged; null: "
        "the node's default again), for every node of the cluster; answers the site.",
        lambda call: sites.set_site(call.node, call.params["site"], call.body),
        body=SiteUpdate,
        response=SiteState,
        writes_store=True,
        path_params=(Param("site", "the site's host name", SiteName),),
    ),
    Endpoint(
        "GET",
        "/prerender_admin/queue-state",
        "read",
        "This node's queue state; 503 with trust and the live `now` fields when the keeper "
        "cannot vouch for its numbers.",
        lambda call: admin.queue_state(call.node),
        response=dict,
        unavailable=dict,
        uses_store=False,
    ),
    Endpoint(
        "GET",
        "/prerender_admin/cluster/queue-state",
        "read",
        "Every live node's queue-state, asked at once, and the cluster's counts summed from "
        "their exact ones (`autoscale.due_now` for an autoscaler); 503 naming each node that "
        "is missing, unready, not exact or stale, never a partial sum.",
        _cluster_queue_state,
        response=dict,
        unavailable=dict,
    ),
    Endpoint(
        "GET",
        "/prerender_admin/explain",
        "read",
        "A key's row, class, rank, lease and hold state, and why it is or is not claimed.",
        on_lane(lambda call: admin.explain(call.node, call.params["key"])),
        response=Explain,
        query=(Param("key", "the row's key", Key, check_key),),
    ),
    Endpoint(
        "POST",
        "/prerender_admin/render-now",
        "admin",
        "Make a key due now and end any hold on it (failures or unanswered leases); a live "
        "lease is left to end. Answers the key's explain.",
        on_lane(lambda call: admin.render_now(call.node, call.body)),
        body=RenderNow,
        response=Explain,
        writes_store=True,
        errors=(404,),
    ),
    Endpoint(
        "GET",
        "/prerender_admin/overview",
        "read",
        "Leases in flight, the ready ring, the supervisor's workers, the keeper's statistics.",
        lambda call: admin.overview(call.node, call.services.completions.statistics()),
        response=Overview,
        uses_store=False,
    ),
    Endpoint(
        "GET",
        "/metrics",
        "metrics",
        "Prometheus text format.",
        lambda call: metrics.render(call.node, call.services.completions.statistics()),
        media_type=metrics.CONTENT_TYPE,
        uses_store=False,
    ),
    Endpoint(
        "GET",
        "/console",
        "public",
        "The operator's console: a page that reads queue-state and overview with the token "
        "entered in it.",
        lambda call: admin.console(),
        media_type="text/html; charset=utf-8",
        uses_store=False,
    ),
    Endpoint(
        "GET",
        "/healthz",
        "public",
        "The worker is serving.",
        lambda call: admin.healthz(call.node),
        response=Health,
        uses_store=False,
    ),
    Endpoint(
        "GET",
        "/readyz",
        "public",
        "200 while this node can grant a claim (`ready`, or `draining` the keeper's last set); "
        "503 when it cannot (`unready`: nothing published yet; `stalled`: the keeper is not "
        "publishing and its last set is drained).",
        lambda call: admin.readyz(call.node),
        response=Readiness,
        unavailable=Readiness,
        uses_store=False,
    ),
)
