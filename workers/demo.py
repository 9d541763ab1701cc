"""`renderqueue demo` (what `make run` starts): a node on SQLite under ./var, loaded with the
example schedule from examples/, printing the addresses to open. `renderqueue demo
--cluster 3` (what `make cluster` starts) runs three nodes on the local PostgreSQL instead,
with the example schedule loaded once and a simulated fleet across them.

A fresh demo database also gets the example site's sitemap (an index of gzipped
children, under examples/site/) imported through `renderqueue import-sitemap`, as an
operator would feed a real site. Hooks run once the node is ready (`DemoHook`);
`--with-fleet` adds the simulated fleet there (`make run` passes it), so a newcomer sees
due counts fall, flow per minute and lateness move on the console.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from store.base import ScheduleStore
from store.rows import RowWrite
from workers.config import Settings

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEMO_DB = "var/renderqueue.sqlite"
EXAMPLE_SITEMAP = EXAMPLES / "site" / "sitemap.xml"
EXAMPLE_ROUTE_RULES = EXAMPLES / "route-rules.toml"
BATCH = 1000


class ExampleRoute(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    default_cadence_s: int | None = None
    paused: bool = False
    site_pattern: str | None = None


class ExampleRoutes(msgspec.Struct, frozen=True, kw_only=True):
    default_cadence_s: int
    routes: list[ExampleRoute]


class ExampleRow(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    route: str
    due_in_s: int
    cadence_s: int | None = None
    sitemap: bool = False


class Loaded(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    due: int
    routes: int


def read_rows(path: Path) -> Iterator[ExampleRow]:
    decoder = msgspec.json.Decoder(ExampleRow)
    with path.open("rb") as file:
        for line in file:
            if line.strip():
                yield decoder.decode(line)


def load_example(store: ScheduleStore, directory: Path, now_ms: int) -> Loaded:
    """Write the example's routes and rows; due times are relative to `now_ms`."""
    settings = msgspec.json.decode((directory / "routes.json").read_bytes(), type=ExampleRoutes)
    store.set_default_cadence_s(settings.default_cadence_s)
    for route in settings.routes:
        store.set_route(
            route.route,
            default_cadence_s=route.default_cadence_s,
            paused=route.paused,
            site_pattern=route.site_pattern,
        )
    rows = due = 0
    batch: list[RowWrite] = []
    for example in read_rows(directory / "schedule.jsonl"):
        batch.append(
            RowWrite(
                key=example.key,
                route=example.route,
                next_render_at=now_ms + example.due_in_s * 1000,
                cadence_s=example.cadence_s,
                sitemap=example.sitemap,
            )
        )
        rows += 1
        due += example.due_in_s <= 0
        if len(batch) >= BATCH:
            store.write(upsert=batch)
            batch = []
    if batch:
        store.write(upsert=batch)
    return Loaded(rows=rows, due=due, routes=len(settings.routes))


DemoHook = Callable[[Settings, str], None]


FLEET: list[subprocess.Popen[bytes]] = []  # stopped when the node stops


def start_fleet(settings: Settings, base_url: str) -> None:
    """The simulated fleet, in its own process, pointed at the demo node (it reads the
    tokens from the environment, as the node does)."""
    command = [sys.executable, "-m", "workers.cli", "fleet", "--node", base_url, "--simulate"]
    FLEET.append(subprocess.Popen(command))


def stop_fleet(grace_s: float = 10.0) -> None:
    """A fleet outliving its node would only retry against a closed port."""
    for process in FLEET:
        if process.poll() is None:
            process.terminate()  # the fleet's graceful stop: finish or hand back in-flight keys
    for process in FLEET:
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()


def addresses(base_url: str) -> list[tuple[str, str]]:
    return [
        ("console", f"{base_url}/console"),
        ("queue state", f"{base_url}/prerender_admin/queue-state"),
        ("overview", f"{base_url}/prerender_admin/overview"),
        (
            "explain a key",
            f"{base_url}/prerender_admin/explain?key=https://shop.example/p/sku-10000",
        ),
        ("metrics", f"{base_url}/metrics"),
        ("API description", f"{base_url}/openapi.json"),
        ("readiness", f"{base_url}/readyz"),
    ]


def run_demo(
    args: argparse.Namespace, settings_from: Callable[[argparse.Namespace], Settings]
) -> int:
    from store import open_store
    from workers import logs
    from workers.lease_carryover import lease_snapshot_path
    from workers.supervisor import Supervisor, default_instance

    count = int(getattr(args, "cluster", 0) or 0)
    if getattr(args, "db", None) is None:
        args.db = CLUSTER_DB if count else DEMO_DB
    settings = settings_from(args)
    if count:
        return run_cluster_demo(args, settings, count)
    logs.configure("supervisor", settings.log_level, settings.log_format, node=settings.node_name())
    directory = Path(args.schedule).parent if args.schedule else EXAMPLES
    db_path = settings.store_url()
    sqlite_path = settings.sqlite_path()
    if sqlite_path is not None:
        sqlite_path.parent.mkdir(parents=True, exist_ok=True)
    store = open_store(db_path)
    try:
        fresh = args.reset or store.count() == 0
        if fresh:
            loaded = load_example(store, directory, time.time_ns() // 1_000_000)
            print(
                f"loaded the example schedule: {loaded.rows} rows ({loaded.due} due) "
                f"across {loaded.routes} routes, from {directory}",
                file=sys.stderr,
            )
        else:
            print(
                f"keeping the {store.count()} rows already in {db_path} (--reset reloads)",
                file=sys.stderr,
            )
    finally:
        store.close()
    if fresh:
        import_example_site(db_path)
        # Leases a graceful stop left name the rows just replaced: a fresh demo has none.
        instance = settings.instance or default_instance(settings, settings.port)
        snapshot = lease_snapshot_path(settings, instance)
        if snapshot.exists():
            snapshot.unlink()
            print(f"removed the previous run's lease snapshot, {snapshot}", file=sys.stderr)
    hooks: list[DemoHook] = [print_addresses]
    if args.with_fleet:
        hooks.append(start_fleet)
    supervisor = Supervisor(settings)
    supervisor.on_ready = lambda: [
        hook(settings, f"http://{url_host(settings.host)}:{supervisor.port}") for hook in hooks
    ]
    return supervisor.run()


def import_example_site(store_url: str) -> None:
    """Feed the example site's sitemap in the way an operator would: the import command."""
    from sitemap.cli import main as import_sitemap

    print(f"importing the example site's sitemap, {EXAMPLE_SITEMAP}", file=sys.stderr)
    status = import_sitemap(
        [str(EXAMPLE_SITEMAP), "--route-rules", str(EXAMPLE_ROUTE_RULES), "--db", store_url]
    )
    if status != 0:
        print("the example sitemap was not imported; the demo goes on without it", file=sys.stderr)


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def print_addresses(settings: Settings, base_url: str) -> None:
    lines = ["", f"renderqueue demo node is up at {base_url}", ""]
    width = max(len(label) for label, _ in addresses(base_url))
    lines += [f"  {label.ljust(width)}  {url}" for label, url in addresses(base_url)]
    if settings.admin_token:
        lines += ["", "  send `Authorization: Bearer $RENDERQUEUE_ADMIN_TOKEN`"]
    claim = json.dumps({"max": 5, "worker": "me"})
    lines += [
        "",
        f"  claim:  curl -s -XPOST {base_url}/v1/claims -d '{claim}'",
        "  stop:   Ctrl-C",
        "",
    ]
    print("\n".join(lines), flush=True)


# --- the cluster demo: `renderqueue demo --cluster N` (what `make cluster` starts) ---------

CLUSTER_DB = "postgresql://postgres@127.0.0.1:5432/renderqueue_demo"
# Short leases, so a node stopped mid-demo hands its keys over in well under a minute.
CLUSTER_MAX_LEASE_S = 60


def ensure_database(url: str) -> bool:
    """Create the URL's database when it is missing (the demo's own; a real operator creates
    theirs). True when it was created."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        psycopg.connect(url, connect_timeout=5).close()
        return False
    except psycopg.OperationalError as exc:
        params = conninfo_to_dict(url)
        name = str(params.get("dbname") or "")
        if not name or "does not exist" not in str(exc):
            raise
    admin = make_conninfo(url, dbname="postgres")
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return True


def free_ports(count: int, host: str) -> list[int]:
    import socket

    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ClusterDemo:
    """N node processes on one PostgreSQL database and a simulated fleet across them.

    Each child runs in a session of its own, so a Ctrl-C reaches the demo alone, which
    stops them in order: the fleet first (it finishes or hands back what it holds), then
    the nodes with SIGTERM (each leaves the cluster at once)."""

    def __init__(self, args: argparse.Namespace, settings: Settings, url: str, count: int) -> None:
        self.args = args
        self.settings = settings
        self.url = url
        self.names = [f"node-{i + 1}" for i in range(count)]
        host = settings.host
        self.ports = (
            free_ports(count, host)
            if settings.port == 0
            else [settings.port + i for i in range(count)]
        )
        self.urls = [f"http://{url_host(host)}:{port}" for port in self.ports]
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.fleet: subprocess.Popen[bytes] | None = None
        self._stop = False

    def node_command(self, index: int) -> list[str]:
        args, settings = self.args, self.settings
        peers = [name for name in self.names if name != self.names[index]]
        command = [
            sys.executable,
            "-m",
            "workers.cli",
            "serve",
            "--db",
            self.url,
            "--host",
            settings.host,
            "--port",
            str(self.ports[index]),
            "--node",
            self.names[index],
            "--workers",
            str(settings.workers),
            "--max-lease-s",
            str(args.max_lease_s or CLUSTER_MAX_LEASE_S),
            # Three nodes' info logs would bury the addresses: warnings and up, unless asked.
            "--log-level",
            args.log_level or "warning",
        ]
        if peers:
            command += ["--peers", ",".join(peers)]
        if args.config:
            command += ["--config", args.config]
        return command

    def fleet_command(self) -> list[str]:
        lease_s = min(300, int(self.args.max_lease_s or CLUSTER_MAX_LEASE_S))
        command = [sys.executable, "-m", "workers.cli", "fleet", "--simulate"]
        for url in self.urls:
            command += ["--node", url]
        return [*command, "--lease-s", str(lease_s), "--concurrency", "16"]

    def run(self) -> int:
        import signal

        def stop(signum: int, frame: object) -> None:
            self._stop = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for index in range(len(self.names)):
                command = self.node_command(index)
                self.nodes.append(subprocess.Popen(command, start_new_session=True))
            if not self._wait_serving():
                return 1
            self.fleet = subprocess.Popen(self.fleet_command(), start_new_session=True)
            self.print_addresses()
            while not self._stop:
                for name, process in zip(self.names, self.nodes, strict=True):
                    if process.poll() is not None:
                        print(f"{name} exited ({process.returncode}); stopping", flush=True)
                        return 1
                time.sleep(0.2)
            return 0
        finally:
            self.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _wait_serving(self, timeout_s: float = 120.0) -> bool:
        """Until every node answers /healthz (the keepers go on loading: the console and the
        cluster queue-state say how far)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        waiting = dict(zip(self.names, self.urls, strict=True))
        while waiting and not self._stop and time.monotonic() < deadline:
            for name, url in list(waiting.items()):
                process = self.nodes[self.names.index(name)]
                if process.poll() is not None:
                    print(f"{name} exited ({process.returncode}) before serving", flush=True)
                    return False
                try:
                    if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                        del waiting[name]
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        if waiting and not self._stop:
            print(f"not serving after {timeout_s:.0f} s: {', '.join(waiting)}", flush=True)
        return not waiting and not self._stop

    def shutdown(self) -> None:
        import signal

        def stop_all(processes: list[subprocess.Popen[bytes]], grace_s: float) -> None:
            for process in processes:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for process in processes:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()

        print("stopping: the fleet, then the nodes (each leaves the cluster)", flush=True)
        if self.fleet is not None:
            stop_all([self.fleet], 15.0)
        stop_all(self.nodes, self.settings.graceful_timeout_s + 15.0)

    def print_addresses(self) -> None:
        first = self.urls[0]
        lines = ["", f"renderqueue cluster demo: {len(self.names)} nodes on {redact(self.url)}", ""]
        width = max(len(name) for name in self.names) + len(" console")
        for name, url in zip(self.names, self.urls, strict=True):
            lines.append(f"  {(name + ' console').ljust(width)}  {url}/console")
        lines += [
            "",
            f"  cluster queue-state  {first}/prerender_admin/cluster/queue-state",
            f"  members              {first}/v1/cluster",
            f"  metrics (each node)  {first}/metrics",
        ]
        if self.settings.admin_token:
            lines += ["", "  send `Authorization: Bearer $RENDERQUEUE_ADMIN_TOKEN`"]
        lines += [
            "",
            f"  a simulated fleet claims from all {len(self.names)} "
            "(renderqueue fleet --node URL ...)",
            "  stop one node: kill -TERM <its pid>  (the others take its rows over)",
            "  stop:   Ctrl-C",
            "",
        ]
        print("\n".join(lines), flush=True)


def redact(url: str) -> str:
    from store.postgres.store import redacted

    return redacted(url)


def run_cluster_demo(args: argparse.Namespace, settings: Settings, count: int) -> int:
    from store import open_store
    from workers.lease_carryover import lease_snapshot_path
    from workers.supervisor import default_instance

    url = settings.store_url()
    if not settings.clustered:
        print(
            f"renderqueue demo --cluster needs a PostgreSQL --db (a postgresql:// URL), not {url}",
            file=sys.stderr,
        )
        return 2
    if ensure_database(url):
        print(f"created the database of {redact(url)}", file=sys.stderr)
    store = open_store(url)
    try:
        fresh = args.reset or store.count() == 0
        if fresh:
            loaded = load_example(store, EXAMPLES, time.time_ns() // 1_000_000)
            print(
                f"loaded the example schedule once, for the cluster: {loaded.rows} rows "
                f"({loaded.due} due) across {loaded.routes} routes",
                file=sys.stderr,
            )
        else:
            kept = store.count()
            print(f"keeping the {kept} rows already there (--reset reloads)", file=sys.stderr)
    finally:
        store.close()
    demo = ClusterDemo(args, settings, url, count)
    if fresh:
        import_example_site(url)
        for port in demo.ports:
            snapshot = lease_snapshot_path(settings, default_instance(settings, port))
            if snapshot.exists():
                snapshot.unlink()
    return demo.run()
