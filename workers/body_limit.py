"""The request body limit at the edge of every worker, for every route.

uvicorn has no body limit of its own. The API reads bodies through `api.body.read_body`,
which refuses a declared or streamed body past the limit with 413 without reading on;
this middleware covers what that cannot:

- a declared `Content-Length` past the limit is refused with 413 before the app runs,
  whatever the route (one that takes no body, or none at all), and nothing of the body
  is read: with `Expect: 100-continue` the client is never told to send it;
- a response that ends before its request's body was read whole (a 413 part way
  through a chunked body, an error before the body was needed) closes the connection,
  so the server does not go on receiving, and discarding, the rest of a body that
  may be unbounded.
"""

from __future__ import annotations

from typing import Any

from api.body import too_large
from api.problems import problem_response

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyLimit:
    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        has_body = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                has_body = True
                # The parser has already refused a malformed value; this is defensive.
                declared = int(value) if value.isdigit() else None
            elif name == b"transfer-encoding":
                has_body = True
        if declared is not None and declared > self.limit:
            response = problem_response(too_large(self.limit), scope.get("path"))
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        if not has_body or declared == 0:
            await self.app(scope, receive, send)
            return

        body_done = False

        async def receive_tracked() -> Message:
            nonlocal body_done
            message: Message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_done:
                headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
                headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive_tracked, send_closing)
