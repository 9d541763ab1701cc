"""Logs: one line per event on stderr, as JSON for machines or as text for people.

The supervisor, the workers and the libraries they host (uvicorn's access log, the keeper's
reports) all write through the one handler `configure` installs, so a node's log is one
stream in one format. `log_format` (workers.config) picks it: `json`, `text`, or `auto`,
text when stderr is a terminal and JSON otherwise. Every line names the node and, in a
worker, the worker's index.

    JSON: {"ts":1764934955123,"level":"info","component":"worker-0","node":"web1","worker":0,...}
    text: 2026-12-05T11:22:35.123Z INFO  worker-0 worker_serving node=web1 worker=0 pid=4242
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, Literal, TextIO

import msgspec

LogFormat = Literal["auto", "json", "text"]

_encoder = msgspec.json.Encoder()
_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
ACCESS_LOGGER = "uvicorn.access"
ACCESS_EVENT = "http_request"
# The first fields of every line, in this order; the event's own fields follow.
HEAD = ("ts", "level", "component", "event")


def choose_format(setting: LogFormat, stream: TextIO) -> Literal["json", "text"]:
    """`auto` is text for a person at a terminal, JSON for anything else (a pipe, a file,
    journald), which a machine reads."""
    if setting != "auto":
        return setting
    try:
        return "text" if stream.isatty() else "json"
    except (AttributeError, ValueError):  # a closed or file-less stream
        return "json"


class EventFormatter(logging.Formatter):
    """A record as its event: the head, the emitter (node, worker), then the fields."""

    def __init__(self, component: str, node: str | None = None, worker: int | None = None):
        super().__init__()
        self.component = component
        self.identity: dict[str, Any] = {}
        if node is not None:
            self.identity["node"] = node
        if worker is not None:
            self.identity["worker"] = worker

    def fields(self, record: logging.LogRecord) -> dict[str, Any]:
        event = getattr(record, "event", None)
        line: dict[str, Any] = {
            "ts": int(record.created * 1000),
            "level": record.levelname.lower(),
            "component": self.component,
            "event": event or record.getMessage(),
            **self.identity,
            "pid": record.process,
        }
        if record.name and not record.name.startswith("renderqueue"):
            line["logger"] = record.name
        access = _access_fields(record)
        if access is not None:
            line["event"] = ACCESS_EVENT
            line.update(access)
        elif event and record.args:
            line["message"] = record.getMessage()
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in ("event", "color_message"):
                line[key] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return line


def _access_fields(record: logging.LogRecord) -> dict[str, Any] | None:
    """uvicorn's access line (client, method, path, HTTP version, status) as fields."""
    args = record.args
    if record.name != ACCESS_LOGGER or not isinstance(args, tuple) or len(args) != 5:
        return None
    client, method, path, http_version, status = args
    return {
        "client": client,
        "method": method,
        "path": path,
        "http_version": http_version,
        "status": status,
    }


class JsonFormatter(EventFormatter):
    def format(self, record: logging.LogRecord) -> str:
        line = self.fields(record)
        try:
            return _encoder.encode(line).decode()
        except TypeError:
            return _encoder.encode({k: repr(v) for k, v in line.items()}).decode()


class TextFormatter(EventFormatter):
    """One line per event: time (UTC), level, component, event, then key=value."""

    def format(self, record: logging.LogRecord) -> str:
        line = self.fields(record)
        created = record.created
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
        head = (
            f"{stamp}.{int(created * 1000) % 1000:03d}Z "
            f"{record.levelname:<7} {line['component']} {_text_value(line['event'])}"
        )
        rest = " ".join(
            f"{key}={_text_value(value)}" for key, value in line.items() if key not in HEAD
        )
        return f"{head} {rest}" if rest else head


def _text_value(value: Any) -> str:
    """A value as one token: bare when it has no space, quote, `=` or line break in it,
    else JSON-quoted (so a traceback stays on its event's line)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        if value and not any(c in value for c in ' "=\n\r\t\\') and value.isprintable():
            return value
        return _encoder.encode(value).decode()
    if isinstance(value, int | float):
        return str(value)
    try:
        return _encoder.encode(value).decode()
    except TypeError:
        return _encoder.encode(repr(value)).decode()


def formatter(
    log_format: Literal["json", "text"],
    component: str,
    node: str | None = None,
    worker: int | None = None,
) -> EventFormatter:
    kind = TextFormatter if log_format == "text" else JsonFormatter
    return kind(component, node, worker)


def configure(
    component: str,
    level: str = "info",
    log_format: LogFormat = "auto",
    *,
    node: str | None = None,
    worker: int | None = None,
) -> None:
    """Route every logger, uvicorn's included, to one handler on stderr in one format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(choose_format(log_format, sys.stderr), component, node, worker))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", ACCESS_LOGGER):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger("renderqueue." + name)


def event(
    logger: logging.Logger,
    name: str,
    level: int = logging.INFO,
    *,
    exc_info: bool = False,
    **fields: Any,
) -> None:
    """Log one event: `name` is a stable identifier, fields are its facts."""
    logger.log(level, name, exc_info=exc_info, extra={"event": name, **fields})
