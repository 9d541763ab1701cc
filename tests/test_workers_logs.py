"""Logs: one line per event, JSON for machines or text for people, naming node and worker."""

from __future__ import annotations

import io
import json
import logging
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from node_harness import REPO, node_db, node_process, seed_rows, unique

from workers import logs
from workers.segments import SegmentNames

# A value is bare, or one JSON string (which may hold spaces and escaped quotes).
VALUE = r'(?:"(?:[^"\\]|\\.)*"|[^\s"]+)'
TEXT_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?P<level>[A-Z]+) +(?P<component>\S+) "
    rf"(?P<event>{VALUE})(?P<fields>( [a-z_]+={VALUE})*)$"
)
FIELD = re.compile(rf"([a-z_]+)=({VALUE})")


def capture(
    component: str, kind: str = "json", node: str | None = "n1", worker: int | None = None
) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        logs.formatter("text" if kind == "text" else "json", component, node, worker)
    )
    logger = logging.getLogger(f"renderqueue.test.{component}.{kind}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_an_event_is_one_json_line_with_its_fields() -> None:
    logger, stream = capture("supervisor")
    logs.event(logger, "worker_started", worker=1, worker_pid=4242)
    logs.event(logger, "stopping", logging.WARNING, signal="SIGTERM", mode="graceful")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["event"] == "worker_started" and first["worker"] == 1
    assert first["worker_pid"] == 4242 and first["component"] == "supervisor"
    assert isinstance(first["ts"], int) and first["level"] == "info"
    assert second["level"] == "warning" and second["mode"] == "graceful"
    assert first["node"] == second["node"] == "n1"


def test_a_workers_lines_name_the_node_and_its_index() -> None:
    logger, stream = capture("worker-3", node="web1", worker=3)
    logs.event(logger, "keeper_loaded", rows=10)
    logger.info("keeper: the live nodes are now %s", "a, b")
    for line in stream.getvalue().splitlines():
        record = json.loads(line)
        assert record["node"] == "web1" and record["worker"] == 3


def test_an_exception_is_in_the_same_line() -> None:
    for kind in ("json", "text"):
        logger, stream = capture("worker-0", kind)
        try:
            raise ValueError("boom")
        except ValueError:
            logs.event(logger, "keeper_crashed", logging.ERROR, exc_info=True, crashes=1)
        (line,) = stream.getvalue().splitlines()
        if kind == "json":
            record = json.loads(line)
            assert record["event"] == "keeper_crashed" and "ValueError: boom" in record["error"]
        else:
            assert TEXT_LINE.match(line), line
            assert "ValueError: boom" in line and "crashes=1" in line


def test_other_libraries_log_through_it() -> None:
    logger, stream = capture("worker-1")
    logger.info("Started server process [%d]", 7)
    record = json.loads(stream.getvalue())
    assert record["event"] == "Started server process [7]"


def test_a_text_line_is_time_level_component_event_then_fields() -> None:
    logger, stream = capture("worker-0", "text", node="web1", worker=0)
    logs.event(logger, "listening", host="127.0.0.1", port=8080, auth=None, ok=True)
    logs.event(logger, "stopping", logging.WARNING, detail='said "why", a=b')
    first, second = stream.getvalue().splitlines()
    match = TEXT_LINE.match(first)
    assert match, first
    assert (match["level"], match["component"], match["event"]) == ("INFO", "worker-0", "listening")
    fields = dict(FIELD.findall(match["fields"]))
    assert fields["node"] == "web1" and fields["worker"] == "0"
    assert fields["host"] == "127.0.0.1" and fields["port"] == "8080"
    assert fields["auth"] == "-" and fields["ok"] == "true" and fields["pid"] == str(os.getpid())
    assert first.index("node=") < first.index("host=")  # who said it, then what
    assert second.startswith(first[:4]) and " WARNING worker-0 stopping " in second
    # A value with spaces, quotes or `=` is one JSON string, so the line still splits.
    assert second.endswith('detail="said \\"why\\", a=b"')


def test_an_access_line_is_an_event_with_fields_in_either_format() -> None:
    for kind in ("json", "text"):
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logs.formatter("json" if kind == "json" else "text", "worker-1"))
        access = logging.getLogger(logs.ACCESS_LOGGER)
        saved = access.handlers[:], access.propagate, access.level
        access.handlers[:], access.propagate = [handler], False
        access.setLevel(logging.INFO)
        try:
            access.info(
                '%s - "%s %s HTTP/%s" %d', "127.0.0.1:5555", "GET", "/healthz?x=1", "1.1", 200
            )
        finally:
            access.handlers[:], access.propagate, access.level = saved
        line = stream.getvalue().strip()
        if kind == "json":
            record = json.loads(line)
            assert record["event"] == "http_request" and record["logger"] == "uvicorn.access"
            assert (record["method"], record["path"], record["status"]) == (
                "GET",
                "/healthz?x=1",
                200,
            )
        else:
            assert TEXT_LINE.match(line), line
            assert (
                " http_request " in line and 'path="/healthz?x=1"' in line and "status=200" in line
            )


def test_auto_is_text_on_a_terminal_and_json_otherwise(tmp_path: Path) -> None:
    leader, follower = pty.openpty()
    read_end, write_end = os.pipe()
    with (
        open(follower, "w") as terminal,
        open(write_end, "w") as pipe,
        open(tmp_path / "log", "w") as file,
    ):
        assert logs.choose_format("auto", terminal) == "text"
        assert logs.choose_format("auto", pipe) == "json"
        assert logs.choose_format("auto", file) == "json"
        assert logs.choose_format("json", terminal) == "json"
        assert logs.choose_format("text", pipe) == "text"
    os.close(leader)
    os.close(read_end)
    assert logs.choose_format("auto", terminal) == "json"  # closed: not a terminal


def read_until(fd: int, done: re.Pattern[str], deadline_s: float) -> str:
    """What a pty's leader side gives until `done` is in it (or the deadline)."""
    seen = b""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and not done.search(seen.decode(errors="replace")):
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # every process holding the follower side has exited
                break
            if not chunk:
                break
            seen += chunk
    return seen.decode(errors="replace")


def test_a_node_on_a_terminal_writes_text(tmp_path: Path) -> None:
    """A real node whose stderr is a terminal, log_format left at auto: text lines, each
    naming the node, a worker's naming its index too; the access log follows."""
    seed_rows(node_db(tmp_path), 5)
    instance = unique("tty")
    leader, follower = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.cli",
            "serve",
            "--db",
            node_db(tmp_path),
            "--port",
            "0",
            "--workers",
            "1",
            "--node",
            "tty-node",
            "--access-log",
            "true",
            "--instance",
            instance,
        ],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=follower,
    )
    os.close(follower)
    try:
        text = read_until(leader, re.compile(r" node_ready .*\n"), 90)
        port = int(re.search(r" listening .*\bport=(\d+)", text)[1])  # type: ignore[index]
        import httpx

        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=30).status_code == 200
        process.send_signal(signal.SIGTERM)
        text += read_until(leader, re.compile(r" supervisor stopped "), 90)
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(leader)
        SegmentNames.for_instance(instance).remove()
    lines = [line for line in text.replace("\r\n", "\n").splitlines() if line.strip()]
    assert lines and all(TEXT_LINE.match(line) for line in lines), "\n".join(lines)
    assert all(" node=tty-node " in line for line in lines)
    worker_lines = [line for line in lines if " worker-0 " in line]
    assert worker_lines and all(" worker=0 " in f"{line} " for line in worker_lines)
    assert any(" http_request " in line and "path=/healthz" in line for line in worker_lines)
    assert not any(line.lstrip().startswith("{") for line in lines)


def test_a_node_on_a_pipe_writes_json_naming_node_and_worker(tmp_path: Path) -> None:
    with node_process(tmp_path, workers=2, extra_args=("--node", "pipe-node")) as node:
        node.signal(signal.SIGTERM)
        node.wait_event("stopped")
        lines, events = node.lines, node.events
    assert len(events) == len(lines)  # every line is JSON
    assert all(e["node"] == "pipe-node" for e in events)
    for index in (0, 1):
        own = [e for e in events if e["component"] == f"worker-{index}"]
        assert own and all(e["worker"] == index for e in own)


@pytest.mark.parametrize("value", ["yaml", "JSON", ""])
def test_a_bad_log_format_names_the_setting(value: str) -> None:
    from workers.config import ConfigError, load_settings

    if value == "":
        assert load_settings(environ={"RENDERQUEUE_LOG_FORMAT": ""}).log_format == "auto"
        return
    with pytest.raises(ConfigError, match="setting `log_format` \\(from --log-format\\)"):
        load_settings(environ={}, flags={"log_format": value})
