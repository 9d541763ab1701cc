"""Shared fixtures. Services (PostgreSQL, Redis) are used for real: absent, a test skips
with the reason, except under CI=true, where it fails."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.sqlite import SqliteStore

IN_CI = os.environ.get("CI", "").lower() == "true"


def require_service(name: str, host: str, port: int) -> None:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        message = f"{name} is not reachable at {host}:{port} ({exc})"
        if IN_CI:
            pytest.fail(f"{message}; CI needs it running", pytrace=False)
        pytest.skip(message)


@pytest.fixture
def postgres_dsn() -> str:
    require_service("PostgreSQL", "127.0.0.1", 5432)
    return os.environ.get("RENDERQUEUE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture
def redis_url() -> str:
    require_service("Redis", "127.0.0.1", 6379)
    return "redis://127.0.0.1:6379/0"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    """A SqliteStore on a fresh file. Its consumers are dropped at the end, which removes
    the semaphores and feed rings of any subscription a test left open."""
    opened = SqliteStore(tmp_path / "schedule.db")
    yield opened
    for name in opened.consumers():
        opened.drop_consumer(name)
    opened.close()
