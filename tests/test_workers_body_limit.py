"""A body past the limit, sent by the clients fleets use (urllib, httpx, curl), is answered
with a 413 problem they can read: the rest of the body is read and dropped first, up to
a bound, so a client that sends the whole body before reading is not left with a broken
pipe; past the bound, the connection is closed. Nothing is written."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_harness import ThreadNode, thread_node

from workers.body_limit import DISCARD_FACTOR

# Larger than the socket buffers on both sides, so a server that stops reading leaves
# the client blocked in its send, then broken.
LIMIT = 4 * 1024 * 1024  # the default
REFUSED = 3 * LIMIT  # within the discard bound
BEYOND = (DISCARD_FACTOR + 2) * LIMIT


@pytest.fixture(scope="module", params=["httptools", "h11"])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ThreadNode]:
    directory = tmp_path_factory.mktemp(f"limit-{request.param}")
    with thread_node(directory, keeper=False, max_body_bytes=LIMIT, http=request.param) as n:
        yield n


def schedule_body(size: int) -> bytes:
    """A valid-looking schedule batch of about `size` bytes: one upsert a line."""
    row = b'{"key": "/k/%08d", "route": "page", "next_render_at": 1},'
    count = size // len(row % 0) + 1
    return b'{"upsert": [' + b"".join(row % i for i in range(count))[:-1] + b"]}"


def assert_problem(status: int, content_type: str, body: bytes) -> None:
    assert status == 413, body[:300]
    assert content_type == "application/problem+json"
    problem: dict[str, Any] = json.loads(body)
    assert problem["status"] == 413 and str(LIMIT) in problem["detail"]


def assert_nothing_written(node: ThreadNode) -> None:
    with node.client() as client:
        answer = client.get("/v1/schedule", params={"key": "/k/00000000"})
    assert answer.status_code == 404, answer.text


def test_urllib_reads_the_413(node: ThreadNode) -> None:
    request = urllib.request.Request(
        f"{node.url}/v1/schedule",
        data=schedule_body(REFUSED),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    error = caught.value
    assert_problem(error.code, error.headers["Content-Type"], error.read())
    assert_nothing_written(node)


def test_httpx_reads_the_413_declared_and_streamed(node: ThreadNode) -> None:
    body = schedule_body(REFUSED)

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 64 * 1024):
            yield body[start : start + 64 * 1024]

    with httpx.Client(base_url=node.url, timeout=30) as client:
        for content in (body, chunks()):  # Content-Length, then chunked
            answer = client.post(
                "/v1/schedule", content=content, headers={"Content-Type": "application/json"}
            )
            assert_problem(answer.status_code, answer.headers["content-type"], answer.content)
            # Read to its end: the connection stays open for the next request.
            assert answer.headers.get("connection") != "close"
            assert client.get("/healthz").status_code == 200
    assert_nothing_written(node)


@pytest.mark.parametrize("expect", ["100-continue", ""])  # curl's default, and turned off
def test_curl_reads_the_413(node: ThreadNode, tmp_path: Path, expect: str) -> None:
    payload = tmp_path / "body.json"
    payload.write_bytes(schedule_body(REFUSED))
    out = tmp_path / "answer"
    command = [
        "curl", "-sS", "-o", str(out), "-w", "%{http_code} %{content_type}",
        "-H", "Content-Type: application/json", "-H", f"Expect: {expect}",
        "--data-binary", f"@{payload}", f"{node.url}/v1/schedule",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    status, content_type = done.stdout.decode().split(" ", 1)
    assert_problem(int(status), content_type, out.read_bytes())
    assert_nothing_written(node)


def test_a_body_past_the_discard_bound_is_answered_and_the_connection_closed(
    node: ThreadNode,
) -> None:
    host, port = node.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/schedule HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % BEYOND
        )
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            received += chunk
    head = received.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 413"), received[:300]
    assert b"connection: close" in head
