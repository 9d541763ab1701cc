"""The application a worker serves: routes from the endpoint table, one error shape
(problem+json) for everything that goes wrong, including what starlette raises. Paths
without parameters are dispatched straight to their handlers (DirectPaths); starlette's
router serves the rest."""

from __future__ import annotations

import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.auth import Authenticator
from api.body import check_media_type, json_response, read_json
from api.cluster import ClusterLink
from api.completions import CompletionQueue, apply, complete_handed_over
from api.endpoints import ENDPOINTS, Call, Endpoint
from api.node import Node
from api.openapi import OPENAPI_PATH, openapi_document
from api.params import read_params
from api.problems import ApiError, problem_response
from api.services import Services
from api.status import supervisor_statistics
from store.base import cluster_membership
from store.errors import StoreBusy, StoreFull, StoreUnavailable
from store.rows import MemberList

log = logging.getLogger("renderqueue.api")

# What a caller hears when the store refuses: status, title, and what follows the cause.
STORE_PROBLEMS: dict[type[Exception], tuple[int, str, str]] = {
    StoreFull: (507, "Store full", ". Claims and reads go on meanwhile."),
    StoreBusy: (503, "Store busy", "; retry shortly"),
    StoreUnavailable: (503, "Store unavailable", "; retry shortly"),
}


def _respond(endpoint: Endpoint, value: Any) -> Response:
    if isinstance(value, Response):
        return value
    if endpoint.media_type != "application/json":
        return Response(value, media_type=endpoint.media_type)
    return json_response(value)


def make_handler(endpoint: Endpoint, node: Node, services: Services, auth: Authenticator) -> Any:
    limit = node.settings.max_body_bytes

    async def handle(request: Request) -> Response:
        try:
            peer = request.client.host if request.client is not None else None
            auth.check(endpoint.scope, request.headers.get("authorization"), peer)
            params = read_params(endpoint.path_params, request.path_params)
            params.update(read_params(endpoint.query, request.query_params))
            body: Any = None
            if endpoint.raw_body:
                check_media_type(request.headers.get("content-type"), endpoint.raw_body)
            if endpoint.body is not None:
                body = await read_json(request, endpoint.body, limit)
            call = Call(request, node, services, body, params)
            if endpoint.is_async:
                value = await endpoint.run(call)
            else:
                value = endpoint.run(call)
            return _respond(endpoint, value)
        except ApiError as exc:
            return problem_response(exc, request.url.path)
        except (StoreFull, StoreBusy, StoreUnavailable) as exc:
            status, title, then = STORE_PROBLEMS[type(exc)]
            refused = ApiError(
                status,
                title,
                f"{exc}{then}",
                headers={"Retry-After": str(node.settings.retry_after_s)},
            )
            return problem_response(refused, request.url.path)
        except Exception:
            # Bad input never lands here (it is an ApiError); this is our fault.
            log.exception(
                "request_failed", extra={"event": "request_failed", "path": request.url.path}
            )
            return problem_response(
                ApiError(500, "Internal error", "the node failed this request; see its log"),
                request.url.path,
            )

    handle.__name__ = f"{endpoint.method.lower()}_{endpoint.path}"
    return handle


def served_as(method: str) -> str:
    """The method whose handler answers a request: HEAD is served by GET's."""
    return "GET" if method == "HEAD" else method


def path_routes(handlers: dict[str, dict[str, Any]]) -> list[Route]:
    """One route a path, serving each of its methods: a method it does not serve is a 405
    whose `Allow` lists every one it does (a route a method would list only its own)."""
    routes = []
    for path, by_method in handlers.items():

        async def dispatch(request: Request, by_method: dict[str, Any] = by_method) -> Response:
            method = served_as(request.method)
            response: Response = await by_method[method](request)
            return response

        routes.append(Route(path, dispatch, methods=list(by_method)))
    return routes


class DirectPaths:
    """ASGI: a request for a path the endpoint table names without parameters, by a method
    it serves there, goes straight to its handler; anything else (a templated path, a 404,
    a 405, a trailing-slash redirect) goes through starlette's router.

    The handlers already answer every outcome themselves (api.app.make_handler), so the
    router's matching and its exception middleware would add nothing to the fleet's
    calls but their cost, which at the claim rate is a share of a worker's CPU."""

    def __init__(self, app: Starlette, handlers: dict[tuple[str, str], Any]) -> None:
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            method = scope["method"]
            handler = self.handlers.get((served_as(method), scope["path"]))
            if handler is not None:
                response: Response = await handler(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_services(node: Node) -> Services:
    """The worker's shared services, each given only the handles it uses."""

    def started_at_ms() -> int:
        return int((supervisor_statistics(node) or {}).get("started_at") or 0)

    def members(ttl_s: float) -> MemberList:
        return cluster_membership(node.store).members(ttl_s)  # read in a cluster only

    return Services(
        completions=CompletionQueue(
            commit=lambda requests: apply(node, requests, wait=False), lane=node.lane
        ),
        cluster=ClusterLink(
            node.settings,
            node.lane,
            members,
            started_at_ms,
            settle_completions=lambda owner, items: complete_handed_over(node, owner, items),
        ),
    )


def create_app(node: Node, services: Services) -> DirectPaths:
    auth = Authenticator(
        fleet_token=node.settings.fleet_token,
        admin_token=node.settings.admin_token,
        read_token=node.settings.metrics_token,
        metrics_open_on_loopback=node.settings.metrics_open_on_loopback,
    )
    document = openapi_document(ENDPOINTS, node.settings)

    async def openapi(request: Request) -> Response:
        return json_response(document)

    handlers: dict[str, dict[str, Any]] = {OPENAPI_PATH: {"GET": openapi}}
    for endpoint in ENDPOINTS:
        handlers.setdefault(endpoint.path, {})[endpoint.method] = make_handler(
            endpoint, node, services, auth
        )
    routes = path_routes(handlers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        titles = {404: "Not found", 405: "Method not allowed"}
        error = ApiError(
            exc.status_code,
            titles.get(exc.status_code, "HTTP error"),
            exc.detail if exc.detail else None,
            headers=dict(exc.headers or {}),
        )
        return problem_response(error, request.url.path)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("request_failed", exc_info=exc, extra={"event": "request_failed"})
        return problem_response(ApiError(500, "Internal error"), request.url.path)

    app = Starlette(
        routes=routes,
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    direct = {
        (method, path): handler
        for path, by_method in handlers.items()
        if "{" not in path
        for method, handler in by_method.items()
    }
    return DirectPaths(app, direct)
