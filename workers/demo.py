"""`renderqueue demo` (what `make run` starts): a node on SQLite under ./var, loaded with the
example schedule from examples/, printing the addresses to open.

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
        store.set_route(route.route, default_cadence_s=route.default_cadence_s, paused=route.paused)
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
    from workers.supervisor import Supervisor, default_instance, lease_snapshot_path

    if getattr(args, "db", None) is None:
        args.db = DEMO_DB
    settings = settings_from(args)
    logs.configure("supervisor", settings.log_level)
    directory = Path(args.schedule).parent if args.schedule else EXAMPLES
    db_path = settings.store_url()
    if db_path.startswith("sqlite:///"):
        Path(db_path[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
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
