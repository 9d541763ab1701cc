"""Real nodes for the api and workers tests, on free loopback ports.

- `ThreadNode`: the API app on uvicorn in a thread of the test process, with real
  segments, a real SQLite store and (optionally) a real keeper thread, as worker 0 runs
  them. Fast to start; used for validation, auth, 503-before-publish and the fuzz test.
- `NodeProcess`: `renderqueue serve` as a child process (the supervisor and its workers),
  its JSON log read line by line; used for races, kills and signals.

Names of segments and files carry the pid and a uuid: other test runs share the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn

from shm.segment import now_ms as now_ms  # re-exported: the tests' one clock
from store.rows import RowWrite
from workers.body_limit import BodyLimit
from workers.protocol import PROTOCOLS


def _pieces_missing() -> str | None:
    """The node stands on shm and the keeper; until they land its tests cannot run."""
    try:
        import shm

        for name in ("ReadyRing", "LeaseTable", "StateBuffer", "key_hash", "segment_name"):
            getattr(shm, name)
        import keeper.runner
        import keeper.state  # noqa: F401
    except (ImportError, AttributeError) as exc:
        return f"the node's pieces have not landed yet: {exc}"
    return None


if (_missing := _pieces_missing()) is not None:
    pytest.skip(_missing, allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
ADMIN_TOKEN = "test-admin-token-" + "a" * 16
FLEET_TOKEN = "test-fleet-token-" + "f" * 16


# Which store a node's directory stands for: its SQLite file by default; a test module
# that runs on every backend swaps this in with the `node_backend` fixture (conftest).
def _sqlite_file(directory: Path) -> str:
    return str(directory / "node.sqlite")


_db_of: Callable[[Path], str] = _sqlite_file


def node_db(directory: Path) -> str:
    """The store URL (or SQLite path) of the node whose files live in `directory`."""
    return _db_of(directory)


@contextlib.contextmanager
def nodes_on(db_of: Callable[[Path], str]) -> Iterator[None]:
    """Nodes made meanwhile keep their store where `db_of` says."""
    global _db_of
    previous, _db_of = _db_of, db_of
    try:
        yield
    finally:
        _db_of = previous


def unique(prefix: str = "t") -> str:
    return f"{prefix}{os.getpid()}x{uuid.uuid4().hex[:8]}"


def readme_series() -> tuple[set[str], set[str]]:
    """The `/metrics` series the user's documents name (the README, and the operator's
    reference in docs/operations.md): exact names, and prefixes they give as `name_*`."""
    text = "".join((REPO / doc).read_text() for doc in ("README.md", "docs/operations.md"))
    named = set(re.findall(r"`(renderqueue_[a-z_]+\*?)`", text))
    return {n for n in named if not n.endswith("*")}, {n[:-1] for n in named if n.endswith("*")}


def seed_rows(
    db: Path | str,
    count: int,
    *,
    due_share: float = 1.0,
    route: str = "product",
    cadence_s: int | None = 3600,
    prefix: str = "https://shop.example/p/",
    now: int | None = None,
) -> list[str]:
    """Write `count` rows; the first `due_share` of them due (spread over the last hour)."""
    from store import open_store

    now = now_ms() if now is None else now
    keys = [f"{prefix}{i:07d}" for i in range(count)]
    due_count = int(count * due_share)
    store = open_store(str(db))
    try:
        for start in range(0, count, 5000):
            batch = [
                RowWrite(
                    key=keys[i],
                    route=route,
                    cadence_s=cadence_s,
                    sitemap=i % 3 == 0,
                    next_render_at=(now - 1000 - (i * 7919) % 3_600_000)
                    if i < due_count
                    else now + 3_600_000 + i,
                )
                for i in range(start, min(count, start + 5000))
            ]
            store.write(upsert=batch)
    finally:
        store.close()
    return keys


def due_in_table(db: Path | str, now: int) -> int:
    """Due rows counted the slow way, straight from the table."""
    from store import open_store

    store = open_store(str(db))
    try:
        due = 0
        after: str | None = None
        while True:
            rows = store.walk(after, 5000)
            if not rows:
                return due
            due += sum(1 for row in rows if row.next_render_at <= now)
            after = rows[-1].key
    finally:
        store.close()


def wait_for(
    check: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05
) -> Any:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {last!r})")


def claim_answered(
    client: httpx.Client, body: dict[str, Any], timeout_s: float = 60
) -> dict[str, Any]:
    """A claim asked as the fleet asks it: a 503 with Retry-After (no publish yet, a keeper
    late to publish on a loaded machine, a store connection being remade) is asked again,
    until the node answers 200; the answer's body."""

    def answered() -> dict[str, Any] | None:
        response = client.post("/v1/claims", json=body)
        if response.status_code == 503 and response.headers.get("retry-after"):
            return None
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    answer: dict[str, Any] = wait_for(answered, timeout_s, "a claim answered 200", 0.1)
    return answer


def free_socket(host: str = "127.0.0.1") -> socket.socket:
    # IPPROTO_TCP, not 0, or asyncio leaves Nagle on for accepted sockets (40 ms a reply).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(256)
    return sock


def api_settings_for(node: str = "t", instance: str = "t", **overrides: Any) -> Any:
    """A single node's API settings as a worker fills them from the node's defaults
    (workers.config.api_settings), with `overrides` on top."""
    from workers.config import Settings, api_settings

    found = api_settings(Settings(), node=node, instance=instance, worker=0, advertised_url="")
    return msgspec.structs.replace(found, **overrides)


class ThreadNode:
    """The API on a free port in this process; `publish()` waits for the keeper's first."""

    def __init__(
        self,
        directory: Path,
        *,
        keeper: bool = True,
        tokens: bool | str = False,  # True: both tokens; "fleet": the fleet token only
        max_body_bytes: int = 64 * 1024,
        keeper_config: dict[str, Any] | None = None,
        http: str = "httptools",
        sitemap_route_rules: str | None = None,
    ) -> None:
        from api.app import build_services, create_app
        from api.node import Node
        from store import open_store
        from workers.segments import SegmentNames, Segments

        self.dir = directory
        self.db = node_db(directory)
        self.http = http
        self.instance = unique("ta")
        self.segments = Segments.create(
            SegmentNames.for_instance(self.instance), ring_entries=8192, lease_slots=1 << 16
        )
        self.store = open_store(str(self.db))
        self.keeper_config = keeper_config or {}
        self._keeper_stop = threading.Event()
        self._keeper_thread: threading.Thread | None = None
        self.keeper_error: BaseException | None = None
        self.node = Node(
            settings=api_settings_for(
                node="test",
                instance=self.instance,
                fleet_token=FLEET_TOKEN if tokens else None,
                admin_token=ADMIN_TOKEN if tokens is True else None,
                max_body_bytes=max_body_bytes,
                sitemap_route_rules=sitemap_route_rules,
            ),
            store=self.store,
            ring=self.segments.ring,
            leases=self.segments.leases,
            state=self.segments.state,
            supervisor_state=self.segments.supervisor,
            keeper_statistics=self.segments.keeper,
            site_list=self.segments.site_list,
            site_history=self.segments.site_history,
            marks=self.segments.marks,
        )
        self.services = build_services(self.node)
        self.sock = free_socket()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            BodyLimit(create_app(self.node, self.services), max_body_bytes),
            http=PROTOCOLS[http],
            proxy_headers=False,
            loop="uvloop",  # as a worker runs it (workers.worker)
            lifespan="off",
            log_config=None,
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self._thread.start()
        wait_for(lambda: self.server.started, 30, "the server to start")
        if keeper:
            self.start_keeper()

    def start_keeper(self) -> None:
        from keeper.config import KeeperConfig
        from keeper.runner import Keeper
        from store import open_store

        config = msgspec.convert(self.keeper_config, KeeperConfig, strict=False)

        def run() -> None:
            store = open_store(str(self.db))
            try:
                Keeper(
                    store,
                    self.segments.ring,
                    self.segments.leases,
                    self.segments.state,
                    config,
                    node="test",
                    statistics_buffer=self.segments.keeper,
                    site_list_buffer=self.segments.site_list,
                    marks=self.segments.marks,
                    site_table=self.segments.sites,
                ).run(self._keeper_stop)
            except BaseException as exc:
                self.keeper_error = exc
                raise
            finally:
                store.close()

        self._keeper_thread = threading.Thread(target=run, name="keeper", daemon=True)
        self._keeper_thread.start()

    def stop_keeper(self) -> None:
        self._keeper_stop.set()
        if self._keeper_thread is not None:
            self._keeper_thread.join(30)
        self._keeper_thread = None
        self._keeper_stop = threading.Event()

    def wait_exact(self, timeout_s: float = 60) -> dict[str, Any]:
        """Until queue-state is served (200): the keeper is live, exact and fresh."""
        with self.client(ADMIN_TOKEN) as client:

            def served() -> Any:
                if self.keeper_error is not None:
                    raise AssertionError(f"keeper failed: {self.keeper_error!r}")
                response = client.get("/prerender_admin/queue-state")
                return response.json() if response.status_code == 200 else None

            state: dict[str, Any] = wait_for(served, timeout_s, "an exact queue-state", 0.1)
            return state

    def wait_published(self, timeout_s: float = 30) -> None:
        def published() -> bool:
            if self.keeper_error is not None:
                raise AssertionError(f"keeper failed: {self.keeper_error!r}")
            return self.segments.ring.generation > 0

        wait_for(published, timeout_s, "the keeper's first publish")

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def close(self) -> None:
        self._keeper_stop.set()
        if self._keeper_thread is not None:
            self._keeper_thread.join(30)
        self.server.should_exit = True
        self._thread.join(30)
        self.sock.close()
        self.node.lane.close(30)
        self.store.close()
        self.segments.close()
        self.segments.unlink()


@contextlib.contextmanager
def thread_node(directory: Path, **kwargs: Any) -> Iterator[ThreadNode]:
    node = ThreadNode(directory, **kwargs)
    try:
        yield node
    finally:
        node.close()


class NodeProcess:
    """`renderqueue serve` in a child process; its JSON log lines are kept as events."""

    def __init__(
        self,
        directory: Path,
        *,
        workers: int = 2,
        tokens: bool = False,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        instance: str | None = None,  # another run's, to restart "the same node"
    ) -> None:
        self.dir = directory
        self.db = node_db(directory)
        self.instance = instance or unique("tn")
        self.workers = workers
        self.tokens = tokens
        self.extra_args = extra_args
        self.env = dict(os.environ)
        for name in list(self.env):
            if name.startswith("RENDERQUEUE_"):
                del self.env[name]
        if "://" in self.db:
            # A store URL's default snapshot is var/<instance>.leases under the repository:
            # keep it with the node's other files, so a test run leaves nothing behind.
            self.env["RENDERQUEUE_LEASE_SNAPSHOT"] = str(directory / f"{self.instance}.leases")
        if tokens:
            self.env["RENDERQUEUE_ADMIN_TOKEN"] = ADMIN_TOKEN
            self.env["RENDERQUEUE_FLEET_TOKEN"] = FLEET_TOKEN
        self.env.update(env or {})
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout_s: float = 60) -> NodeProcess:
        command = [
            sys.executable,
            "-m",
            "workers.cli",
            "serve",
            "--db",
            str(self.db),
            "--port",
            "0",
            "--workers",
            str(self.workers),
            "--instance",
            self.instance,
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            command, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        threading.Thread(target=self._read_log, daemon=True).start()
        listening = self.wait_event("listening", timeout_s=timeout_s)
        self.port = int(listening["port"])
        if wait_ready:
            self.wait_event("node_ready", timeout_s=timeout_s)
        return self

    def _read_log(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            try:
                parsed = json.loads(line)
            except ValueError:
                parsed = None
            with self._changed:
                self.lines.append(line)
                if isinstance(parsed, dict):
                    self.events.append(parsed)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def logged(self) -> list[dict[str, Any]]:
        """Every event logged so far, in order."""
        with self._changed:
            return list(self.events)

    def find_events(self, name: str, **fields: Any) -> list[dict[str, Any]]:
        with self._changed:
            return [
                e
                for e in self.events
                if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
            ]

    def wait_event(
        self, name: str, *, after: int = 0, timeout_s: float = 60, **fields: Any
    ) -> dict[str, Any]:
        """The first event `name` (with `fields`) beyond the first `after` such events."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = [
                    e
                    for e in self.events
                    if e.get("event") == name and all(e.get(k) == v for k, v in fields.items())
                ]
                if len(found) > after:
                    return found[after]
                remaining = deadline - time.monotonic()
                code = None if self.process is None else self.process.poll()
                if remaining <= 0 or code is not None:
                    tail = "\n".join(self.lines[-40:])
                    state = "running" if code is None else f"exited {code}"
                    raise AssertionError(
                        f"no {name} event {fields or ''} ({state}); log tail:\n{tail}"
                    )
                self._changed.wait(min(remaining, 0.2))

    def worker_pid(self, index: int) -> int:
        started = self.find_events("worker_started", worker=index)
        assert started, f"worker {index} never started"
        return int(started[-1]["worker_pid"])

    def client(self, token: str | None = None) -> httpx.Client:
        if token is None and self.tokens:
            token = ADMIN_TOKEN
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def wait(self, timeout_s: float = 60) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(45)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        # A supervisor SIGKILLed (by its test, or just above) unlinked nothing.
        from workers.segments import SegmentNames

        SegmentNames.for_instance(self.instance).remove()


def kill_whole_node(node: NodeProcess) -> None:
    """SIGKILL the supervisor and every process under it, as a crash of the machine's
    node would: nothing runs an exit path, so nothing unlinks or snapshots."""
    import psutil

    assert node.process is not None
    supervisor = psutil.Process(node.process.pid)
    supervisor.suspend()  # no respawn between the kills
    workers = supervisor.children(recursive=True)
    assert len(workers) >= node.workers
    for process in [*workers, supervisor]:
        process.send_signal(signal.SIGKILL)
    assert node.wait(30) == -signal.SIGKILL

    def gone(process: psutil.Process) -> bool:
        try:
            return bool(process.status() == psutil.STATUS_ZOMBIE)  # no mappings left
        except psutil.NoSuchProcess:
            return True

    wait_for(lambda: all(gone(p) for p in workers), 30, "the workers to die")


@contextlib.contextmanager
def node_process(directory: Path, **kwargs: Any) -> Iterator[NodeProcess]:
    node = NodeProcess(directory, **kwargs)
    try:
        yield node.start()
    finally:
        node.stop()


@contextlib.contextmanager
def local_node(db: Path | str, *, marks: bool = False) -> Iterator[tuple[Any, Any, Any]]:
    """A worker's Node on fresh segments over the store at `db`, with no server:
    (node, store, segments). `marks`: the node stamps its writes and may answer claims
    from the ring (shm.marks); without, every granted row is read."""
    from api.node import Node
    from store import open_store
    from workers.segments import SegmentNames, Segments

    segments = Segments.create(
        SegmentNames.for_instance(unique("tc")), ring_entries=64, lease_slots=1024
    )
    store = open_store(str(db))
    node = Node(
        settings=api_settings_for(),
        store=store,
        ring=segments.ring,
        leases=segments.leases,
        state=segments.state,
        marks=segments.marks if marks else None,
    )
    try:
        yield node, store, segments
    finally:
        node.lane.close(30)
        store.close()
        segments.close()
        segments.unlink()


def publish_with_cadence(
    node: Any, keys: list[str], cadence_s: int, *, view: int = 0, due_at: int | None = None
) -> int:
    """Publish `keys` into the node's ring, all due a second ago (or at `due_at`), with
    `cadence_s`, as class 0; `view`: the feed position the publish vouches for (shm.marks),
    with class 0 named ("product", not a sitemap row). Returns the generation."""
    import numpy as np

    from shm import key_hash

    now = now_ms()
    if node.marks is not None:
        node.marks.write_classes([("product", False)], now)
        node.marks.set_view(node.ring.generation + 1, view)
    generation: int = node.ring.publish(
        [k.encode() for k in keys],
        np.full(len(keys), now - 1000 if due_at is None else due_at, dtype=np.int64),
        np.zeros(len(keys), dtype=np.int32),
        np.array([key_hash(k.encode()) for k in keys], dtype=np.uint64),
        now,
        np.full(len(keys), cadence_s, dtype=np.uint32),
    )
    return generation


def feed_position(store: Any) -> int:
    """Where a feed that has read everything committed now stands (delivered_below)."""
    sub = store.subscribe(unique("view"), store.feed_head())
    try:
        while sub.poll(1000).more:
            pass
        return int(sub.delivered_below())
    finally:
        sub.close()


METRIC_SAMPLE = re.compile(r'^([a-z_:][a-z0-9_:]*)(\{([a-z_]+="[^"]*",?)*\})? (-?[0-9.e+-]+|NaN)$')


def metric_samples(text: str) -> dict[str, float]:
    """`/metrics` text checked as Prometheus text (every line a HELP, a TYPE or a sample),
    its samples keyed by name and labels."""
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("gauge", "counter") and name not in typed
            typed.add(name)
            continue
        match = METRIC_SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        assert match.group(1) in typed, f"sample before its TYPE: {line!r}"
        key = line.rsplit(" ", 1)[0]
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(line.rsplit(" ", 1)[1])
    return samples


def metric_total(client: httpx.Client, name: str, **labels: str) -> float:
    """The sum of a `/metrics` series over the labels not given (a worker's series is as of
    its last report to the supervisor, about a second old)."""
    wanted = [f'{label}="{value}"' for label, value in labels.items()]
    total = 0.0
    for key, value in metric_samples(client.get("/metrics").text).items():
        series, _, labelled = key.partition("{")
        if series == name and all(pair in labelled.rstrip("}").split(",") for pair in wanted):
            total += value
    return total


def claims_waiting(client: httpx.Client) -> int:
    """Claims long-polling on the node now, summed over its workers."""
    return int(metric_total(client, "renderqueue_claims_waiting"))
