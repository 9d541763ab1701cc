"""Shared fixtures. Services (PostgreSQL, Redis) are used for real: absent, a test skips
with the reason, except under CI=true, where it fails."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import hash_secret  # noqa: F401  (the session hashes keys under the tests' secret)
import pytest
from store_helpers import ContractStore, open_url

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


PG_SERVER = os.environ.get("RENDERQUEUE_TEST_PG_SERVER", "postgresql://postgres@127.0.0.1:5432")


@pytest.fixture(scope="session")
def pg_database() -> Iterator[str]:
    """A scratch database for this test run, dropped at its end: the run's URL."""
    require_service("PostgreSQL", "127.0.0.1", 5432)
    import psycopg

    name = f"rq_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        with psycopg.connect(f"{PG_SERVER}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def schema_url(database_url: str, schema: str) -> str:
    """The database's URL with `schema` first on the search path: a store of its own."""
    return f"{database_url}?options={quote(f'-csearch_path={schema}')}"


@pytest.fixture
def pg_url(pg_database: str) -> Iterator[str]:
    """A fresh, empty schema in the run's scratch database, as a store URL."""
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield schema_url(pg_database, schema)
    finally:
        with psycopg.connect(pg_database, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture(params=["sqlite", "postgres"])
def backend_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty store of each backend, as the URL (or SQLite path) other processes open."""
    if request.param == "sqlite":
        return str(tmp_path / "schedule.db")
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def node_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module's nodes on each backend: with `pytestmark =
    pytest.mark.usefixtures("node_backend")`, every node the module makes (node_harness)
    keeps its store in SQLite, then in a schema of its own in the run's PostgreSQL database."""
    if request.param == "sqlite":
        yield "sqlite"
        return
    import psycopg
    from node_harness import nodes_on

    database: str = request.getfixturevalue("pg_database")
    made: dict[Path, str] = {}

    def db_of(directory: Path) -> str:
        if directory not in made:
            schema = f"n_{uuid.uuid4().hex[:12]}"
            with psycopg.connect(database, autocommit=True) as conn:
                conn.execute(f'CREATE SCHEMA "{schema}"')
            made[directory] = schema_url(database, schema)
        return made[directory]

    with nodes_on(db_of):
        yield "postgres"


@pytest.fixture
def live_node(tmp_path: Path, node_backend: str) -> Iterator[Any]:
    """A thread node (node_harness) on 40 rows, half of them due, its first publish made."""
    from node_harness import node_db, seed_rows, thread_node

    seed_rows(node_db(tmp_path), 40, due_share=0.5)
    with thread_node(tmp_path) as node:
        node.wait_published()
        yield node


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


@pytest.fixture(params=["sqlite", "postgres"])
def new_store_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], str]]:
    """Makes the URL of a new, empty store at each call, once per backend: SQLite on a
    fresh file, PostgreSQL in a fresh schema of the run's scratch database (dropped at
    the end; skipped when the server is absent)."""
    if request.param == "sqlite":
        yield lambda: f"sqlite:///{tmp_path_factory.mktemp('store') / 'schedule.db'}"
        return
    import psycopg

    database: str = request.getfixturevalue("pg_database")
    schemas: list[str] = []

    def make() -> str:
        schema = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute(f'CREATE SCHEMA "{schema}"')
        schemas.append(schema)
        return schema_url(database, schema)

    try:
        yield make
    finally:
        if schemas:
            with psycopg.connect(database, autocommit=True) as conn:
                for schema in schemas:
                    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


@pytest.fixture
def store_url(new_store_url: Callable[[], str]) -> str:
    """The URL of an empty store, once per backend."""
    return new_store_url()


@pytest.fixture
def any_store(store_url: str) -> Iterator[ContractStore]:
    """An open store of each backend on `store_url`, for the tests of what store.base
    promises. Its consumers are dropped at the end (SQLite: with their semaphores and
    feed rings), then it is closed."""
    opened = open_url(store_url)
    yield opened
    for name in opened.consumers():
        opened.drop_consumer(name)
    opened.close()
