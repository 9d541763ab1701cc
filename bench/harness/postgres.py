"""The PostgreSQL server under test: scratch databases on it, and the CPU of its backends
(each client's, by port) over an interval."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import quote

import msgspec

from bench.harness import report
from bench.harness.workload import PG_DSN


def server_url() -> str:
    """The server of RENDERQUEUE_TEST_PG, without a database."""
    scheme, rest = PG_DSN.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0].split('?', 1)[0]}"


def host_port(url: str) -> tuple[str, int]:
    netloc = url.split("://", 1)[-1].split("/", 1)[0].split("@")[-1]
    host, _, port = netloc.partition(":")
    return host or "127.0.0.1", int(port or 5432)


def db_url(name: str, **settings: str) -> str:
    """A URL of database `name` whose connections start with these settings (libpq's
    `options`, `-c name=value` each), so the product opens it as it would any URL."""
    url = f"{server_url()}/{name}"
    if settings:
        options = " ".join(f"-c {key}={value}" for key, value in settings.items())
        url += "?options=" + quote(options, safe="")
    return url


def admin_conn() -> Any:
    import psycopg

    return psycopg.connect(db_url("postgres"), autocommit=True, connect_timeout=5)


class Scratch:
    """The run's databases; every one is dropped by `drop_all`, connections or not."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def create(self, suffix: str) -> str:
        name = f"rq_bench_{os.getpid()}_{suffix}"
        with admin_conn() as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {name}")
        self.names.append(name)
        return name

    def drop_all(self) -> None:
        if not self.names:
            return
        with admin_conn() as conn:
            for name in self.names:
                conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
                report.progress(f"postgres: dropped database {name}")
        self.names = []


class Backend(msgspec.Struct, frozen=True):
    pid: int
    app: str
    client_port: int
    cpu_s: float


class ServerUse(msgspec.Struct, frozen=True):
    backends: list[Backend]  # the scratch databases' backends, CPU over the interval
    all_s: float  # every PostgreSQL process, over the same interval

    @property
    def backends_s(self) -> float:
        return sum(b.cpu_s for b in self.backends)

    def by_app(self, app: str) -> float:
        return sum(b.cpu_s for b in self.backends if b.app == app)


def _cpu(process: Any) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def meter_process(conn: Connection, url: str, poll_s: float) -> None:
    """Samples the backends of the databases named by each `start` until `stop`."""
    import psutil
    import psycopg

    db = psycopg.connect(url, autocommit=True)
    me = int(db.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
    postmaster = psutil.Process(me).parent()
    assert postmaster is not None

    def everything() -> float:
        times = postmaster.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in postmaster.children():
            with contextlib.suppress(psutil.Error):
                total += _cpu(child)
        return float(total)

    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "exit":
            break
        datnames: list[str] = command
        seen: dict[int, tuple[str, int, float, float]] = {}  # pid -> app, port, first, last
        all0 = everything()
        sample(db, me, datnames, seen, initial=True)
        conn.send("started")
        while not conn.poll(poll_s):
            sample(db, me, datnames, seen, initial=False)
        conn.recv()
        sample(db, me, datnames, seen, initial=False)
        use = ServerUse(
            backends=[
                Backend(pid=pid, app=app, client_port=port, cpu_s=round(last - first, 4))
                for pid, (app, port, first, last) in seen.items()
            ],
            all_s=round(everything() - all0, 4),
        )
        conn.send_bytes(msgspec.msgpack.encode(use))
    db.close()


def sample(
    db: Any,
    me: int,
    datnames: list[str],
    seen: dict[int, tuple[str, int, float, float]],
    *,
    initial: bool,
) -> None:
    """Each backend's CPU now into `seen` (pid -> app, client port, first, last): a
    backend first seen after the interval began started after it, from 0."""
    import psutil

    found = db.execute(
        "SELECT pid, application_name, coalesce(client_port, 0) FROM pg_stat_activity"
        " WHERE datname = ANY(%s) AND pid <> %s",
        (datnames, me),
    ).fetchall()
    for pid, app, port in found:
        try:
            used = _cpu(psutil.Process(pid))
        except psutil.Error:
            continue
        first = seen[pid][2] if pid in seen else (used if initial else 0.0)
        seen[pid] = (str(app), int(port), first, used)


class Meter:
    """One process for the run: `measure(databases)` brackets an interval."""

    def __init__(self, ctx: Any) -> None:
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(
            target=meter_process, args=(theirs, db_url("postgres"), METER_POLL_S), daemon=True
        )
        self.process.start()
        if self.conn.recv() != "ready":
            raise RuntimeError("the CPU meter did not start")

    @contextlib.contextmanager
    def measure(self, *datnames: str) -> Iterator[list[ServerUse]]:
        out: list[ServerUse] = []
        self.conn.send(list(datnames))
        assert self.conn.recv() == "started"
        try:
            yield out
        finally:
            self.conn.send("stop")
            out.append(msgspec.msgpack.decode(self.conn.recv_bytes(), type=ServerUse))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("exit")
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def client_ports(pids: dict[int, str]) -> dict[int, str]:
    """Local TCP port -> the label of the process (of `pids`) that holds it."""
    import psutil

    found: dict[int, str] = {}
    for pid, label in pids.items():
        with contextlib.suppress(psutil.Error):
            for sock in psutil.Process(pid).net_connections(kind="tcp"):
                if sock.laddr:
                    found[sock.laddr.port] = label
    return found


METER_POLL_S = 0.05
