"""The coalescing h11 protocol: one send per response, bytes and order unchanged."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from node_harness import thread_node

from workers.protocol import CoalescingTransport


class RecordingTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return f"extra:{name}"


def test_writes_in_one_step_are_sent_once() -> None:
    async def scenario() -> RecordingTransport:
        real = RecordingTransport()
        transport = CoalescingTransport(real, asyncio.get_running_loop())
        transport.write(b"HTTP/1.1 200 OK\r\n\r\n")
        transport.write(b"")
        transport.write(bytearray(b"body"))
        assert real.writes == []  # nothing sent before the step ends
        await asyncio.sleep(0)
        assert real.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        transport.write(b"second")
        transport.close()  # a close flushes first
        assert real.writes[-1] == b"second" and real.closed
        assert transport.get_extra_info("peername") == "extra:peername"
        return real

    real = asyncio.run(scenario())
    assert len(real.writes) == 2


def read_response(sock: socket.socket, buffer: bytes) -> tuple[bytes, bytes]:
    while b"\r\n\r\n" not in buffer:
        buffer += sock.recv(65536)
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


def test_pipelined_requests_get_their_responses_in_order(tmp_path: Path) -> None:
    with (
        thread_node(tmp_path, keeper=False, http="h11") as node,
        socket.create_connection(("127.0.0.1", node.port)) as sock,
    ):
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        first, rest = read_response(sock, b"")
        second, rest = read_response(sock, rest)
        third, rest = read_response(sock, rest)
    assert first.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in first
    assert second.startswith(b"HTTP/1.1 503") and b'"status":"unready"' in second
    assert third.startswith(b"HTTP/1.1 404") and b"application/problem+json" in third
    assert rest == b""
