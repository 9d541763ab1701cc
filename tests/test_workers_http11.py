"""The lean HTTP/1.1 protocol on a real socket: framing, limits, keep-alive, pipelining,
and raw junk that must never crash it or draw a 5xx."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from node_harness import ThreadNode, thread_node

from workers.http11 import BadRequest, decode_chunked, parse_head

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadNode]:
    with thread_node(tmp_path_factory.mktemp("http11"), keeper=False, max_body_bytes=LIMIT) as n:
        yield n


def exchange(
    node: ThreadNode, data: bytes, *, responses: int = 1, timeout: float = 10, eof: bool = False
) -> bytes:
    """Send raw bytes (then EOF, if asked); read until `responses` complete responses or
    the server closes."""
    with socket.create_connection(("127.0.0.1", node.port), timeout=timeout) as sock:
        sock.sendall(data)
        if eof:
            sock.shutdown(socket.SHUT_WR)
        received = b""
        while received.count(b"HTTP/1.") < responses or not complete(received, responses):
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            received += chunk
        return received


def complete(data: bytes, responses: int) -> bool:
    rest = data
    for _ in range(responses):
        head, sep, rest = rest.partition(b"\r\n\r\n")
        if not sep:
            return False
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        if len(rest) < length:
            return False
        rest = rest[length:]
    return True


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_parse_head() -> None:
    head = parse_head(
        b"POST /v1/claims?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\nConnection: close"
    )
    assert (head.method, head.target, head.version) == ("POST", b"/v1/claims?x=1", "1.1")
    assert head.content_length == 12 and not head.keep_alive and not head.chunked
    assert parse_head(b"GET / HTTP/1.0\r\nConnection: keep-alive").keep_alive
    assert not parse_head(b"GET / HTTP/1.0").keep_alive
    for bad, status in [
        (b"GET /", 400),
        (b"GET / HTTP/2.0", 505),
        (b"GET http://x/ HTTP/1.1", 400),
        (b"G(T / HTTP/1.1", 400),
        (b"GET / HTTP/1.1\r\nBad Header: x", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: -1", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked", 400),
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: gzip", 501),
        (b"GET / HTTP/1.1\r\nX: a\x00b", 400),
    ]:
        with pytest.raises(BadRequest) as raised:
            parse_head(bad)
        assert raised.value.status == status, bad


def test_decode_chunked() -> None:
    body = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\n\r\nNEXT"
    assert decode_chunked(body, 0, 100) == (b"Wikipedia", len(body) - 4)
    assert decode_chunked(body[:10], 0, 100) is None
    with_trailer = b"3\r\nabc\r\n0\r\nX-T: 1\r\n\r\n"
    assert decode_chunked(with_trailer, 0, 100) == (b"abc", len(with_trailer))
    with pytest.raises(BadRequest) as raised:
        decode_chunked(b"zz\r\n", 0, 100)
    assert raised.value.status == 400
    with pytest.raises(BadRequest) as raised:
        decode_chunked(b"ff\r\n", 0, 100)
    assert raised.value.status == 413


def test_keep_alive_and_pipelining(node: ThreadNode) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    # EOF after the last request: the server answers all four, then closes.
    data = exchange(node, request * 3 + b"HEAD /healthz HTTP/1.1\r\n\r\n", responses=5, eof=True)
    responses = data.split(b"HTTP/1.1 ")[1:]
    assert [r[:3] for r in responses] == [b"200"] * 4
    assert responses[-1].endswith(b"\r\n\r\n")  # HEAD: the length, no body


def test_http_1_0_closes_after_the_response(node: ThreadNode) -> None:
    data = exchange(
        node, b"GET /healthz HTTP/1.0\r\n\r\nGET /healthz HTTP/1.0\r\n\r\n", responses=2
    )
    assert data.count(b"HTTP/1.1 200") == 1 and b"connection: close" in data


def test_a_chunked_body_is_read(node: ThreadNode) -> None:
    payload = b'{"max": 0, "worker": "w"}'
    chunked = (
        b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (payload[:7], payload[7:]))
        + b"0\r\n\r\n"
    )
    data = exchange(
        node,
        b"POST /v1/claims HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked,
    )
    assert status_of(data) == 422 and b'"field":"$.max"' in data


def test_expect_100_continue(node: ThreadNode) -> None:
    body = b'{"max": 1, "worker": "w"}'
    with socket.create_connection(("127.0.0.1", node.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/claims HTTP/1.1\r\nContent-Length: %d\r\nExpect: 100-continue\r\n\r\n"
            % len(body)
        )
        assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 503")  # no keeper: unready


def test_a_declared_body_past_the_limit_is_read_and_refused(node: ThreadNode) -> None:
    body = b"x" * (LIMIT + 10)
    data = exchange(
        node, b"POST /v1/schedule HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    )
    assert status_of(data) == 413 and b"application/problem+json" in data


def test_a_chunked_body_past_the_limit_is_refused(node: ThreadNode) -> None:
    chunk = b"x" * 4096
    chunks = (b"%x\r\n%s\r\n" % (len(chunk), chunk)) * (LIMIT // 4096 + 2) + b"0\r\n\r\n"
    data = exchange(
        node, b"POST /v1/schedule HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks
    )
    assert status_of(data) == 413


def test_a_huge_head_is_431(node: ThreadNode) -> None:
    data = exchange(node, b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n")
    assert status_of(data) == 431


@settings(
    max_examples=150,
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
    # EOF after the junk: a request left incomplete is closed at once, not at a timeout.
    data = exchange(node, junk, timeout=10, eof=True)
    for part in data.split(b"HTTP/1.1 ")[1:]:
        status = int(part[:3])
        assert status < 500 or status in (501, 503, 505), data[:300]
