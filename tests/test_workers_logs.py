"""Structured logs: one JSON object per line, one line per event."""

from __future__ import annotations

import io
import json
import logging

from workers import logs


def capture(component: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter(component))
    logger = logging.getLogger(f"renderqueue.test.{component}")
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


def test_an_exception_is_in_the_same_line() -> None:
    logger, stream = capture("worker-0")
    try:
        raise ValueError("boom")
    except ValueError:
        logs.event(logger, "keeper_crashed", logging.ERROR, exc_info=True, crashes=1)
    (line,) = stream.getvalue().splitlines()
    record = json.loads(line)
    assert record["event"] == "keeper_crashed" and "ValueError: boom" in record["error"]


def test_other_libraries_log_through_it() -> None:
    logger, stream = capture("worker-1")
    logger.info("Started server process [%d]", 7)
    record = json.loads(stream.getvalue())
    assert record["event"] == "Started server process [7]"
