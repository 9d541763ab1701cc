"""A lean HTTP/1.1 protocol for uvicorn's `Server`, built for this API's traffic.

uvicorn's only parser here is h11 (pure Python; httptools is not among the project's
packages), and h11 with uvicorn's cycle costs about 200 us of CPU per request on this
machine, against about 20 us for the socket work itself. The fleet sends many small
requests (a claim of 10 keys is one), so that overhead bounds the node. This protocol
does only what the API needs, the way uvicorn's protocols plug in (`Config(http=...)`):

- requests: origin-form targets; `Content-Length` or `Transfer-Encoding: chunked` bodies,
  read whole before the app runs and refused with 413 past the limit (declared or as they
  arrive); `Expect: 100-continue`; keep-alive with an idle timeout; pipelining (one
  request at a time, in order); HTTP/1.0 and 1.1. Anything else is a 400 (or 501 for a
  transfer coding other than chunked), and the connection closes.
- responses: the app's whole response is written with one send, with a Content-Length.
- shutdown: uvicorn's `Server.shutdown` calls `shutdown()`: an idle connection closes at
  once, a busy one after its response. The connections and tasks sets are uvicorn's own,
  so a graceful stop waits for requests in flight exactly as it does with h11.
"""

from __future__ import annotations

import asyncio
import http
import logging
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

import msgspec
from uvicorn.config import Config
from uvicorn.server import ServerState

MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
DRAIN_S = 5.0  # how long a refused body may keep arriving before the connection closes
_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VERSIONS = {b"HTTP/1.1": "1.1", b"HTTP/1.0": "1.0"}
_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_encoder = msgspec.json.Encoder()
log = logging.getLogger("uvicorn.error")
access_log = logging.getLogger("uvicorn.access")


class BadRequest(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class Head(msgspec.Struct, kw_only=True):
    method: str
    target: bytes
    version: str
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    expect_continue: bool
    content_length: int | None
    chunked: bool


def parse_head(data: bytes) -> Head:
    """The request line and headers (without the blank line that ends them)."""
    lines = data.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        raise BadRequest(400, "malformed request line")
    method, target, raw_version = parts
    version = _VERSIONS.get(raw_version)
    if version is None:
        raise BadRequest(505 if raw_version.startswith(b"HTTP/") else 400, "unsupported version")
    if not _TOKEN.match(method):
        raise BadRequest(400, "malformed method")
    if not target.startswith(b"/") or any(byte <= 0x20 or byte >= 0x7F for byte in target):
        raise BadRequest(400, "the target must be an origin-form path")
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, "too many header fields")
    headers: list[tuple[bytes, bytes]] = []
    connection = b""
    expect = b""
    content_length: int | None = None
    transfer_encoding: bytes | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.match(name):
            raise BadRequest(400, "malformed header field")
        name = name.lower()
        value = value.strip(b" \t")
        if any((byte < 0x20 and byte != 0x09) or byte == 0x7F for byte in value):
            raise BadRequest(400, "control character in a header value")
        headers.append((name, value))
        if name == b"content-length":
            if not value.isdigit() or (content_length is not None and int(value) != content_length):
                raise BadRequest(400, "malformed Content-Length")
            content_length = int(value)
        elif name == b"transfer-encoding":
            transfer_encoding = value.lower()
        elif name == b"connection":
            connection += b"," + value.lower()
        elif name == b"expect":
            expect = value.lower()
    chunked = False
    if transfer_encoding is not None:
        if content_length is not None:
            raise BadRequest(400, "both Content-Length and Transfer-Encoding")
        if transfer_encoding != b"chunked":
            raise BadRequest(501, "only the chunked transfer coding is supported")
        chunked = True
    tokens = {token.strip() for token in connection.split(b",")}
    keep_alive = b"keep-alive" in tokens if version == "1.0" else b"close" not in tokens
    return Head(
        method=method.decode(),
        target=target,
        version=version,
        headers=headers,
        keep_alive=keep_alive,
        expect_continue=expect == b"100-continue",
        content_length=content_length,
        chunked=chunked,
    )


def decode_chunked(data: bytearray | bytes, start: int, limit: int) -> tuple[bytes, int] | None:
    """(body, end offset) once the whole chunked body is in `data`, None while it is not.

    Raises BadRequest for a malformed body and 413 past `limit` decoded bytes.
    """
    parts: list[bytes] = []
    size_total = 0
    position = start
    while True:
        line_end = data.find(b"\r\n", position)
        if line_end < 0:
            if len(data) - position > 1024:
                raise BadRequest(400, "malformed chunk size line")
            return None
        size_text = bytes(data[position:line_end]).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadRequest(400, "malformed chunk size") from None
        if size < 0:
            raise BadRequest(400, "malformed chunk size")
        size_total += size
        if size_total > limit:
            raise BadRequest(413, f"the body must be at most {limit} bytes")
        chunk_start = line_end + 2
        if size == 0:
            # Trailer fields, if any, end with a blank line; they are read and dropped.
            trailer_end = data.find(b"\r\n\r\n", line_end)
            if data[chunk_start : chunk_start + 2] == b"\r\n":
                return b"".join(parts), chunk_start + 2
            if trailer_end < 0:
                return None
            return b"".join(parts), trailer_end + 4
        if len(data) < chunk_start + size + 2:
            return None
        if data[chunk_start + size : chunk_start + size + 2] != b"\r\n":
            raise BadRequest(400, "malformed chunk")
        parts.append(bytes(data[chunk_start : chunk_start + size]))
        position = chunk_start + size + 2


def problem_bytes(status: int, detail: str, keep_alive: bool = False) -> bytes:
    body = _encoder.encode(
        {
            "type": "about:blank",
            "title": _PHRASES.get(status, b"Error").decode(),
            "status": status,
            "detail": detail,
        }
    )
    head = (
        f"HTTP/1.1 {status} ".encode()
        + _PHRASES.get(status, b"Error")
        + b"\r\ncontent-type: application/problem+json\r\ncontent-length: "
        + str(len(body)).encode()
        + (b"\r\n\r\n" if keep_alive else b"\r\nconnection: close\r\n\r\n")
    )
    return head + body


class LeanHttpProtocol(asyncio.Protocol):
    max_body_bytes = 4 * 1024 * 1024
    log_access = False

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.root_path = config.root_path
        self.keep_alive_s = config.timeout_keep_alive
        self.server_state = server_state
        self.app_state = app_state
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.busy = False
        self.closing = False
        self.lost = False
        self.reading_paused = False
        self.continued = False
        self.eof = False
        self.draining = 0  # bytes of a refused body still to read and drop
        self.idle_handle: asyncio.TimerHandle | None = None
        self.disconnected: asyncio.Future[None] | None = None
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.server_state.connections.add(self)  # type: ignore[arg-type]
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        self._arm_idle_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server_state.connections.discard(self)
        self._cancel_idle_timer()
        if self.disconnected is not None and not self.disconnected.done():
            self.disconnected.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.draining:
            self.draining = max(0, self.draining - len(data))
            if not self.draining and self.transport is not None:
                self.transport.close()
            return
        self.buffer += data
        if not self.busy:
            self._cancel_idle_timer()
            self._next_request()
        elif len(self.buffer) > MAX_HEAD_BYTES and not self.reading_paused:
            # Pipelined data piles up while a request runs: stop reading until it is done.
            self.reading_paused = True
            if self.transport is not None:
                self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        # The client is done sending; a response in the making still goes out first.
        self.eof = True
        if not self.busy:
            self._next_request()  # answers what is complete in the buffer, else closes
        return True

    # --- uvicorn's Server calls this on shutdown ---------------------------------------

    def shutdown(self) -> None:
        self.closing = True
        if not self.busy and self.transport is not None:
            self.transport.close()

    # --- requests ----------------------------------------------------------------------

    def _next_request(self) -> None:
        if self.busy or self.lost or self.transport is None:
            return
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            if len(self.buffer) > MAX_HEAD_BYTES:
                self._refuse(431, "the request head is too large")
            elif self.buffer.strip(b"\r\n") == b"" and self.buffer:
                del self.buffer[:]  # stray line breaks between requests
            self._wait_for_more()
            return
        if head_end > MAX_HEAD_BYTES:
            self._refuse(431, "the request head is too large")
            return
        try:
            head = parse_head(bytes(self.buffer[:head_end]))
            body_start = head_end + 4
            if head.chunked:
                # Past the limit the rest of a chunked body is dropped for DRAIN_S.
                self.draining = 4 * self.max_body_bytes
                found = decode_chunked(self.buffer, body_start, self.max_body_bytes)
                self.draining = 0
                if found is None:
                    self._continue(head)
                    self._wait_for_more()
                    return
                body, end = found
            else:
                length = head.content_length or 0
                if length > self.max_body_bytes:
                    # Read the declared body and drop it, so the client, still sending,
                    # sees the 413 instead of a reset connection.
                    self.draining = max(0, length - (len(self.buffer) - body_start))
                    raise BadRequest(413, f"the body must be at most {self.max_body_bytes} bytes")
                end = body_start + length
                if len(self.buffer) < end:
                    self._continue(head)
                    self._wait_for_more()
                    return
                body = bytes(self.buffer[body_start:end])
        except BadRequest as exc:
            if exc.status != 413:
                self.draining = 0
            self._refuse(exc.status, exc.detail)
            return
        del self.buffer[:end]
        self.continued = False
        self._start(head, body)

    def _wait_for_more(self) -> None:
        """A request still arriving gets the keep-alive timeout to finish arriving; after
        the client's EOF the rest will never come."""
        if self.eof and self.transport is not None:
            self.transport.close()
        else:
            self._arm_idle_timer()

    def _continue(self, head: Head) -> None:
        if head.expect_continue and not self.continued and self.transport is not None:
            self.continued = True
            self.transport.write(_CONTINUE)

    def _refuse(self, status: int, detail: str) -> None:
        """A problem response, then the connection closes (after a refused body is read)."""
        self.buffer.clear()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(problem_bytes(status, detail))
        if self.draining:
            self._cancel_idle_timer()
            self.idle_handle = self.loop.call_later(DRAIN_S, transport.close)
        else:
            transport.close()

    def _start(self, head: Head, body: bytes) -> None:
        raw_path, _, query = head.target.partition(b"?")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": head.version,
            "server": self.server,
            "client": self.client,
            "scheme": "http",
            "method": head.method,
            "root_path": self.root_path,
            "path": unquote(raw_path.decode("ascii")),
            "raw_path": raw_path,
            "query_string": query,
            "headers": head.headers,
            "state": self.app_state.copy(),
        }
        self.busy = True
        self.disconnected = self.loop.create_future()
        cycle = Cycle(self, scope, body, head.keep_alive and not self.closing)
        task = self.loop.create_task(cycle.run())
        task.add_done_callback(self.server_state.tasks.discard)
        self.server_state.tasks.add(task)

    def finished(self, keep_alive: bool) -> None:
        """A response went out: close, or take the next pipelined request."""
        self.server_state.total_requests += 1
        self.busy = False
        if self.disconnected is not None and not self.disconnected.done():
            self.disconnected.set_result(None)
        if self.transport is None or self.transport.is_closing():
            return
        if not keep_alive or self.closing:
            self.transport.close()
            return
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()
        if self.buffer:
            self.loop.call_soon(self._next_request)
        elif self.eof:
            self.transport.close()
        else:
            self._arm_idle_timer()

    # --- keep-alive timeout ------------------------------------------------------------

    def _arm_idle_timer(self) -> None:
        self._cancel_idle_timer()
        self.idle_handle = self.loop.call_later(self.keep_alive_s, self._idle_timeout)

    def _cancel_idle_timer(self) -> None:
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None

    def _idle_timeout(self) -> None:
        if not self.busy and self.transport is not None:
            self.transport.close()


class Cycle:
    """One request through the ASGI app; the response is written with one send."""

    def __init__(
        self, protocol: LeanHttpProtocol, scope: dict[str, Any], body: bytes, keep_alive: bool
    ) -> None:
        self.protocol = protocol
        self.scope = scope
        self.body: bytes | None = body
        self.keep_alive = keep_alive
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.started = False
        self.complete = False

    async def run(self) -> None:
        protocol = self.protocol
        try:
            await protocol.app(self.scope, self.receive, self.send)
        except BaseException:
            log.exception("Exception in ASGI application")
            if not self.started:
                self._write_raw(problem_bytes(500, "the node failed this request; see its log"))
            self.keep_alive = False
        else:
            if not self.complete:
                if not self.started:
                    log.error("ASGI callable returned without starting response.")
                    self._write_raw(problem_bytes(500, "no response"))
                self.keep_alive = False
        finally:
            protocol.finished(self.keep_alive)

    async def receive(self) -> dict[str, Any]:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        disconnected = self.protocol.disconnected
        if disconnected is not None and not self.complete:
            await disconnected
        return {"type": "http.disconnect"}

    async def send(self, message: Any) -> None:
        kind = message["type"]
        if kind == "http.response.start" and not self.started:
            self.started = True
            self.status = int(message["status"])
            self.headers = list(message.get("headers", []))
            return
        if kind == "http.response.body" and self.started and not self.complete:
            self.chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                self.complete = True
                self._write_response()
            return
        raise RuntimeError(f"unexpected ASGI message {kind!r}")

    def _write_response(self) -> None:
        body = b"".join(self.chunks)
        has_length = False
        lines = [b"HTTP/1.1 %d %s\r\n" % (self.status, _PHRASES.get(self.status, b""))]
        for name, value in self.protocol.server_state.default_headers:
            lines.append(b"%s: %s\r\n" % (name, value))
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length":
                has_length = True
            elif lowered == b"connection" and value.lower() == b"close":
                self.keep_alive = False
            lines.append(b"%s: %s\r\n" % (name, value))
        if not has_length:
            lines.append(b"content-length: %d\r\n" % len(body))
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        if self.scope["method"] != "HEAD":
            lines.append(body)
        self._write_raw(b"".join(lines))
        if self.protocol.log_access:
            access_log.info(
                '%s - "%s %s HTTP/%s" %d',
                "{}:{}".format(*self.protocol.client) if self.protocol.client else "",
                self.scope["method"],
                self.scope["path"],
                self.scope["http_version"],
                self.status,
            )

    def _write_raw(self, data: bytes) -> None:
        transport = self.protocol.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)


def _address(info: Any) -> tuple[str, int] | None:
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


def lean_protocol(max_body_bytes: int, access: bool = False) -> Callable[..., LeanHttpProtocol]:
    """A protocol class with this node's body limit, for `uvicorn.Config(http=...)`."""
    return type(
        "LeanHttpProtocol",
        (LeanHttpProtocol,),
        {"max_body_bytes": max_body_bytes, "log_access": access},
    )
