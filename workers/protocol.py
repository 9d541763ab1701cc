"""uvicorn's HTTP protocols (httptools, or h11 as the fallback), writing each response in
one send, and with a bound on a request's head under httptools.

uvicorn writes a response's head and its body with two `transport.write` calls, and on
loopback each write is its own send(2): the peer wakes twice, and each wake of another
process is a context switch on cores the node shares with its fleet. Writes made in the same event
loop step are joined and sent once at the end of the step, before anything else can run,
so the bytes and their order are unchanged; only the number of sends falls.

h11 refuses a head past `h11_max_incomplete_event_size` by itself; httptools buffers a
header until it ends, however long, so `HttpToolsProtocol` counts the bytes received while
a head is incomplete and answers 431 past `MAX_HEAD_BYTES`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# Far above any head this API's clients send (a bearer token and a few short headers).
MAX_HEAD_BYTES = 64 * 1024
_HEAD_TOO_LARGE = b"request head too large"


class CoalescingTransport:
    """Forwards everything to the real transport; `write` is buffered until the step ends."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data))

    def flush(self) -> None:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            if not self._transport.is_closing():
                self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingH11Protocol(H11Protocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    _in_head = True
    _head_bytes = 0
    _head_too_large = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        was_in_head = self._in_head
        super().data_received(data)
        if self._head_too_large or self.transport.is_closing():
            return
        if self._in_head:
            # Bytes of a chunk that ended a head belong to that head or what follows it;
            # only chunks fed wholly while a head is open count against it.
            self._head_bytes = self._head_bytes + len(data) if was_in_head else 0
            if self._head_bytes > MAX_HEAD_BYTES:
                self._head_too_large = True
                self.send_400_response(_HEAD_TOO_LARGE.decode())

    def on_message_begin(self) -> None:
        self._in_head = True
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(_HEAD_TOO_LARGE)).encode() + b"\r\n"
            b"connection: close\r\n\r\n" + _HEAD_TOO_LARGE
        )
        self.transport.close()


PROTOCOLS: dict[str, type[asyncio.Protocol]] = {
    "httptools": CoalescingHttpToolsProtocol,
    "h11": CoalescingH11Protocol,
}
