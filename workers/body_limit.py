"""The request body limit at the edge of every worker, for every route.

uvicorn has no body limit of its own. The API reads bodies through `api.body.read_body`,
which refuses a declared or streamed body past the limit with 413 without reading on;
this middleware covers what that cannot:

- a declared `Content-Length` past the limit is refused with 413 before the app runs,
  whatever the route (one that takes no body, or none at all);
- the 413 (or any answer given before its request's body was read whole) must reach a
  client that is still sending. Most clients (urllib, httpx, requests) send the whole
  body before they read a byte of the answer, and a server that closes on them mid-body
  leaves them a broken pipe instead of the problem. So the rest of the body is read and
  discarded first, up to `discard_limit` bytes and DISCARD_TIMEOUT_S; a body that is
  read to its end keeps the connection, a longer one closes it. A client that sent
  `Expect: 100-continue` waits for the server's word before sending: it is answered at
  once and never told to send the body.
"""

from __future__ import annotations

import asyncio
from typing import Any

from api.body import too_large
from api.problems import problem_response

Scope = dict[str, Any]
Message = dict[str, Any]

# A refused body is read and discarded up to this many times the limit (and at most
# MAX_DISCARD_BYTES), for at most DISCARD_TIMEOUT_S: bounded work for an answer the
# client can read; past either bound the connection is closed instead.
DISCARD_FACTOR = 4
MAX_DISCARD_BYTES = 64 * 1024 * 1024
DISCARD_TIMEOUT_S = 10.0


class BodyLimit:
    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.discard_limit = max(limit, min(DISCARD_FACTOR * limit, MAX_DISCARD_BYTES))

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        has_body = False
        expects_continue = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                has_body = True
                # The parser has already refused a malformed value; this is defensive.
                declared = int(value) if value.isdigit() else None
            elif name == b"transfer-encoding":
                has_body = True
            elif name == b"expect":
                expects_continue = value.lower() == b"100-continue"
        if declared is not None and declared > self.limit:
            # Read on only when the client is sending anyway and the bound covers it.
            drained = (
                not expects_continue
                and declared <= self.discard_limit
                and await self._discard(receive, self.discard_limit)
            )
            response = problem_response(too_large(self.limit), scope.get("path"))
            if not drained:
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

        async def send_answering(message: Message) -> None:
            nonlocal body_done
            if message["type"] == "http.response.start" and not body_done:
                # Answered before the body was read whole (a 413 part way through it, an
                # error before it was needed): read the rest first, if it is not too long.
                body_done = not expects_continue and await self._discard(
                    receive, self.discard_limit
                )
                if not body_done:
                    headers = [
                        h for h in message.get("headers", []) if h[0].lower() != b"connection"
                    ]
                    headers.append((b"connection", b"close"))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive_tracked, send_answering)

    @staticmethod
    async def _discard(receive: Any, limit: int) -> bool:
        """Read and drop the request's body to its end; False (stop reading) past `limit`
        bytes, DISCARD_TIMEOUT_S or a disconnect."""

        async def drain() -> bool:
            received = 0
            while True:
                message: Message = await receive()
                if message["type"] != "http.request":
                    return False  # the client went away
                received += len(message.get("body", b""))
                if received > limit:
                    return False
                if not message.get("more_body", False):
                    return True

        try:
            return await asyncio.wait_for(drain(), DISCARD_TIMEOUT_S)
        except TimeoutError:
            return False
