"""Structured logs: one JSON object per line on stderr, one line per event.

The supervisor, the workers and the libraries they host (uvicorn, the keeper) all write
through the same formatter, so a node's log is one stream a machine can read.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import msgspec

_encoder = msgspec.json.Encoder()
_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": int(record.created * 1000),
            "level": record.levelname.lower(),
            "component": self.component,
            "pid": record.process,
            "event": getattr(record, "event", None) or record.getMessage(),
        }
        if record.name and not record.name.startswith("renderqueue"):
            line["logger"] = record.name
        if getattr(record, "event", None) and record.args:
            line["message"] = record.getMessage()
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in ("event", "color_message"):
                line[key] = value
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        try:
            return _encoder.encode(line).decode()
        except TypeError:
            return _encoder.encode({k: repr(v) for k, v in line.items()}).decode()


def configure(component: str, level: str = "info") -> None:
    """Route every logger, uvicorn's included, to one JSON handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
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
