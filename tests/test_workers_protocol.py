"""The workers' HTTP layer on a real socket, under both protocols (httptools, h11): one
send per response, keep-alive and pipelining, chunked bodies, Expect: 100-continue, the
body limit (413 problem+json, the rest of the body read only up to a bound), a bounded head, and raw
junk that must never draw a 5xx."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_harness import ThreadNode, node_process, thread_node

from workers.body_limit import DISCARD_FACTOR
from workers.protocol import MAX_HEAD_BYTES, CoalescingTransport

LIMIT = 64 * 1024


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


@pytest.fixture(scope="module", params=["httptools", "h11"])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadNode]:
    directory = tmp_path_factory.mktemp(f"http-{request.param}")
    with thread_node(directory, keeper=False, max_body_bytes=LIMIT, http=request.param) as n:
        yield n


def read_response(sock: socket.socket, buffer: bytes) -> tuple[bytes, bytes]:
    """One whole response (head and Content-Length body) and what came after it."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before a whole head: {buffer[:300]!r}")
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return head + b"\r\n\r\n" + rest[:length], rest[length:]


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def header(response: bytes, name: bytes) -> bytes | None:
    head = response.partition(b"\r\n\r\n")[0]
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value.strip().lower()
    return None


def connect(node: ThreadNode) -> socket.socket:
    return socket.create_connection(("127.0.0.1", node.port), timeout=10)


def test_pipelined_requests_get_their_responses_in_order(node: ThreadNode) -> None:
    with connect(node) as sock:
        sock.sendall(
            b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        first, rest = read_response(sock, b"")
        second, rest = read_response(sock, rest)
        third, rest = read_response(sock, rest)
        # Still open: keep-alive.
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        fourth, rest = read_response(sock, rest)
    assert first.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in first
    assert second.startswith(b"HTTP/1.1 503") and b'"status":"unready"' in second
    assert third.startswith(b"HTTP/1.1 404") and b"application/problem+json" in third
    assert fourth.startswith(b"HTTP/1.1 200")
    assert rest == b""


def test_http_1_0_closes_after_the_response(node: ThreadNode) -> None:
    with connect(node) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        data = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 200") and header(data, b"connection") == b"close"


def test_a_chunked_body_is_read(node: ThreadNode) -> None:
    payload = b'{"max": 0, "worker": "w"}'
    chunked = (
        b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (payload[:7], payload[7:]))
        + b"0\r\n\r\n"
    )
    with connect(node) as sock:
        sock.sendall(
            b"POST /v1/claims HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked
        )
        data, _ = read_response(sock, b"")
    assert status_of(data) == 422 and b'"field":"$.max"' in data
    assert header(data, b"connection") is None  # read whole: the connection stays open


def test_expect_100_continue(node: ThreadNode) -> None:
    body = b'{"max": 1, "worker": "w"}'
    with connect(node) as sock:
        sock.sendall(
            b"POST /v1/claims HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n"
            b"Expect: 100-continue\r\n\r\n" % len(body)
        )
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        data, _ = read_response(sock, b"")
    assert data.startswith(b"HTTP/1.1 503")  # no keeper: unready


@pytest.mark.parametrize("path", [b"/v1/schedule", b"/healthz", b"/nowhere"])
def test_a_declared_body_past_the_limit_is_refused_unread(node: ThreadNode, path: bytes) -> None:
    """Any route: 413 problem+json at once, no 100 Continue, the connection closed; the
    client never has to send the body."""
    with connect(node) as sock:
        sock.sendall(
            b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n"
            % (path, 1 << 30)
        )
        data = read_until_closed(sock)
    assert status_of(data) == 413, data[:300]
    assert header(data, b"content-type") == b"application/problem+json"
    assert header(data, b"connection") == b"close"
    assert b"100 Continue" not in data


def test_a_chunked_body_past_the_limit_is_refused_and_the_rest_not_read_past_a_bound(
    node: ThreadNode,
) -> None:
    chunk = b"x" * 4096
    with connect(node) as sock:
        sock.sendall(b"POST /v1/schedule HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        # Past what the server reads to answer (workers.body_limit), and no last chunk: a
        # server reading on would wait forever. The app's first read alone may take one
        # whole socket read (256 KiB) before the discard's bound starts counting, so send
        # that much beyond it: short of the bound, the discard would wait out its timeout.
        for _ in range((DISCARD_FACTOR * LIMIT + 2 * 256 * 1024) // 4096):
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
        data = read_until_closed(sock)
    assert status_of(data) == 413, data[:300]
    assert header(data, b"connection") == b"close"


def test_a_huge_head_is_refused(node: ThreadNode) -> None:
    with connect(node) as sock:
        # The header never ends: the server must give up on size, not wait for the end.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(
                b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: " + b"a" * (MAX_HEAD_BYTES + 70_000)
            )
        data = read_until_closed(sock)
    assert status_of(data) in (400, 431), data[:300]
    if node.http == "httptools":
        assert status_of(data) == 431


@settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    junk=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda method, path, headers, body: (
                method + b" " + path + b" HTTP/1.1\r\n" + headers + b"\r\n\r\n" + body
            ),
            st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"X"]),
            st.sampled_from([b"/v1/claims", b"/v1/schedule", b"/healthz", b"/%zz", b"/\xff"]),
            st.binary(max_size=80),
            st.binary(max_size=80),
        ),
    )
)
def test_raw_junk_never_draws_a_5xx(node: ThreadNode, junk: bytes) -> None:
    with connect(node) as sock:
        sock.sendall(junk)
        # EOF after the junk: a request left incomplete is closed at once, not at a timeout.
        sock.shutdown(socket.SHUT_WR)
        data = read_until_closed(sock)
    for part in data.split(b"HTTP/1.1 ")[1:]:
        status = int(part[:3])
        assert status < 500 or status in (501, 503, 505), data[:300]


@pytest.mark.parametrize("access_log", [True, False])
def test_the_access_log_setting(tmp_path: Path, access_log: bool) -> None:
    args = ("--access-log", "true" if access_log else "false")
    with node_process(tmp_path, workers=1, extra_args=args) as node:
        with node.client() as client:
            assert client.get("/healthz?probe=access").status_code == 200
        # Stopped, and its last line read: every line the request could cause is in.
        node.signal(signal.SIGTERM)
        node.wait_event("stopped")
        lines = [e for e in node.events if e.get("logger") == "uvicorn.access"]
    assert bool(lines) is access_log
    if access_log:
        assert "/healthz?probe=access" in json.dumps(lines[0])
