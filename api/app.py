"""The starlette application a worker serves: routes from the endpoint table, one error
shape (problem+json) for everything that goes wrong, including what starlette raises."""

from __future__ import annotations

import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from api.auth import Authenticator
from api.body import json_response, read_json
from api.endpoints import ENDPOINTS, Call, Endpoint
from api.node import Node
from api.openapi import openapi_document
from api.problems import ApiError, problem_response
from store.errors import StoreBusy

log = logging.getLogger("renderqueue.api")


def _respond(endpoint: Endpoint, value: Any) -> Response:
    if isinstance(value, Response):
        return value
    if endpoint.media_type != "application/json":
        return Response(value, media_type=endpoint.media_type)
    return json_response(value)


def make_handler(endpoint: Endpoint, node: Node, auth: Authenticator) -> Any:
    limit = node.settings.max_body_bytes

    async def handle(request: Request) -> Response:
        try:
            auth.check(endpoint.scope, request.headers.get("authorization"))
            body: Any = None
            if endpoint.body is not None:
                body = await read_json(request, endpoint.body, limit)
            call = Call(request, node, body)
            if endpoint.is_async:
                value = await endpoint.run(call)
            else:
                value = endpoint.run(call)
            return _respond(endpoint, value)
        except ApiError as exc:
            return problem_response(exc, request.url.path)
        except StoreBusy as exc:
            busy = ApiError(
                503,
                "Store busy",
                f"{exc}; retry shortly",
                headers={"Retry-After": str(node.settings.retry_after_s)},
            )
            return problem_response(busy, request.url.path)
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


def create_app(node: Node) -> Starlette:
    auth = Authenticator(
        fleet_token=node.settings.fleet_token, admin_token=node.settings.admin_token
    )
    document = openapi_document(ENDPOINTS)

    async def openapi(request: Request) -> Response:
        return json_response(document)

    routes = [
        Route(endpoint.path, make_handler(endpoint, node, auth), methods=[endpoint.method])
        for endpoint in ENDPOINTS
    ]
    routes.append(Route("/openapi.json", openapi, methods=["GET"]))

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
    app.state.node = node
    return app
