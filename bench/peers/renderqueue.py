"""renderqueue as a peer: the in-process claim path and the real node over HTTP.

In process: the store file, the node's shared-memory segments (the node's own
sizes) and a keeper thread in this process, as worker 0 hosts it; each claimant
process attaches like a worker and calls the API's own claim path
(`api.claims.grant_from_ring`: ReadyRing.claim -> store.get_many ->
LeaseTable.grant) and completion (`api.completions.apply`).

Over HTTP: `renderqueue serve` with two workers on a loopback port, and each
claimant posts `/v1/claims` and `/v1/completions` with httpx.

`LocalNode` is also what bench/sections/churn.py restarts keepers on.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness.node import free_port
from bench.harness.workload import Rows, row_writes, unique_suffix
from bench.peers.base import Claimant, Spec
from shm.segment import now_ms

OURS = "renderqueue"
OURS_HTTP = "renderqueue HTTP"
WRITE_CHUNK = 5000
FLEET_TOKEN = "bench-fleet-token-" + "x" * 16


def node_keeper_config(settings: Any) -> Any:
    """The keeper config a node runs with: its own defaults under the [keeper] settings."""
    try:
        from workers.config import keeper_config
    except ImportError:  # a node without node-level keeper defaults: the keeper's own
        import msgspec

        from keeper.config import KeeperConfig

        return msgspec.convert(settings.keeper, KeeperConfig, strict=False)
    return keeper_config(settings)


def hash_as_node(store: Any) -> None:
    """Hash keys under the store's secret, as a worker does from its spec: a keeper thread
    or an in-process claimant of the bench is one of the node's processes."""
    from shm.keys import use_secret

    use_secret(store.hash_secret())


class LocalNode:
    """A store file, the node's segments, and a keeper thread that can be restarted."""

    def __init__(
        self,
        directory: Path | None = None,
        keeper: dict[str, Any] | None = None,
        db: str | None = None,
        site_table: bool = False,
    ) -> None:
        """`db`: a store URL (postgresql://...); None: a SQLite file in `directory`.
        `site_table`: the keeper's publish reads the site table's allowances, as a node's
        does (bench/sections/sites.py)."""
        self.site_table = site_table
        from workers.config import Settings
        from workers.segments import SegmentNames, Segments

        self.dir = directory or Path(tempfile.mkdtemp(prefix=f"rqbench_node_{unique_suffix()}_"))
        self.settings = Settings(db=db or str(self.dir / "schedule.sqlite"), keeper=keeper or {})
        self.instance = f"rqb{unique_suffix()}"
        self.names = SegmentNames.for_instance(self.instance)
        self.segments = Segments.create(
            self.names,
            ring_entries=self.settings.ring_entries,
            lease_slots=self.settings.lease_slots,
        )
        self._stop: threading.Event | None = None
        self._thread: threading.Thread | None = None
        self.keeper: Any = None
        self.keeper_error: BaseException | None = None

    @property
    def store_url(self) -> str:
        return self.settings.store_url()

    def open_store(self) -> Any:
        from store import open_store

        return open_store(self.store_url)

    def start_keeper(self) -> None:
        """Start a keeper thread the way worker 0 does: its own store, the node's config."""
        from keeper.runner import Keeper

        config = node_keeper_config(self.settings)
        # As worker 0 does: a short switch interval bounds how long the keeper thread and
        # this process's other thread (a growth probe's claims) hold each other up.
        sys.setswitchinterval(self.settings.keeper_switch_interval_ms / 1000)
        stop = threading.Event()
        ready = threading.Event()

        def run() -> None:
            from store import open_store
            from workers.worker import KEEPER_PAGE_CACHE_KIB

            store = open_store(self.store_url, page_cache_kib=KEEPER_PAGE_CACHE_KIB)
            try:
                hash_as_node(store)
                self.keeper = Keeper(
                    store,
                    self.segments.ring,
                    self.segments.leases,
                    self.segments.state,
                    config,
                    node="bench",
                    marks=self.segments.marks,
                    site_table=self.segments.sites if self.site_table else None,
                )
                ready.set()
                self.keeper.run(stop)
            except BaseException as exc:  # shown by wait_* instead of dying silently
                self.keeper_error = exc
                ready.set()
                raise
            finally:
                store.close()

        self._stop = stop
        self._thread = threading.Thread(target=run, name="keeper", daemon=True)
        self._thread.start()
        ready.wait(60)

    def stop_keeper(self) -> None:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join(60)
        self._stop = self._thread = None

    def queue_state(self) -> Any:
        from keeper.state import decode_queue_state

        snapshot = self.segments.state.read()
        return None if snapshot is None else decode_queue_state(snapshot.payload)

    def _check_keeper(self) -> None:
        if self.keeper_error is not None:
            raise RuntimeError(f"keeper failed: {self.keeper_error!r}") from self.keeper_error

    def wait_publish(self, after_generation: int, timeout_s: float) -> float:
        """Seconds until the ring's generation passes `after_generation`."""
        started = time.monotonic()
        while self.segments.ring.generation <= after_generation:
            self._check_keeper()
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"no publish within {timeout_s} s")
            time.sleep(0.002)
        return time.monotonic() - started

    def wait_exact(self, since_ms: int, timeout_s: float) -> float:
        """Seconds until the keeper is live and exact, by its own statistics, after since_ms.

        Polled every 20 ms from its statistics, not by decoding queue-state: this thread
        shares the keeper's GIL, and a tight decode loop would slow the very load it times.
        """
        started = time.monotonic()
        while True:
            self._check_keeper()
            keeper = self.keeper
            stats = None if keeper is None else keeper.statistics()
            if (
                stats is not None
                and stats.exact
                and stats.phase == "live"
                and (stats.publish.last_at or 0) >= since_ms
            ):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"keeper not live and exact within {timeout_s} s: {stats}")
            time.sleep(0.02)

    def wait_exact_shared(self, since_ms: int, timeout_s: float) -> float:
        """As wait_exact, for a keeper in another process: from the queue-state it writes.

        Its trust group is refreshed at every publish (`heartbeat_at`).
        """
        started = time.monotonic()
        while True:
            state = self.queue_state()
            trust = None if state is None else state.trust
            if (
                trust is not None
                and trust.exact
                and trust.phase == "live"
                and trust.heartbeat_at >= since_ms
            ):
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"keeper not live and exact within {timeout_s} s: {trust}")
            time.sleep(0.02)

    def close(self) -> None:
        from shm.keys import forget_secret

        self.stop_keeper()
        self.segments.close()
        self.segments.unlink()
        shutil.rmtree(self.dir, ignore_errors=True)
        forget_secret()  # the next LocalNode of this process hashes under its store's


class RenderqueuePeer:
    """The in-process claim path; the keeper publishes from this (otherwise idle) process."""

    name = OURS

    def __init__(self) -> None:
        self.node = LocalNode()
        self.store = self.node.open_store()

    def load(self, rows: Rows) -> None:
        for part in rows.chunks(WRITE_CHUNK):
            self.store.write(upsert=row_writes(rows, part))
        # The keeper starts on a full table, as a restarted node's does, and stays current
        # through the churn that follows from the change feed.
        generation = self.node.segments.ring.generation
        self.node.start_keeper()
        self.node.wait_publish(generation, 300)

    def churn(self, rows: Rows, plan: list[tuple[int, int]]) -> None:
        for start in range(0, len(plan), 1000):
            part = plan[start : start + 1000]
            for i, due in part:
                rows.next_render_at[i] = due
            self.store.write(upsert=row_writes(rows, [i for i, _ in part]))

    def settle(self) -> None:
        """Claims start once the keeper holds the whole churned table and has published it."""
        since = now_ms()
        self.node.wait_exact(since, 600)
        self.node.wait_publish(self.node.segments.ring.generation, 30)

    def spec(self) -> Spec:
        return Spec(
            kind="renderqueue",
            params={"store_url": self.node.store_url, "instance": self.node.instance},
        )

    def drop(self) -> None:
        self.store.close()
        self.node.close()


class InProcessClaimant:
    def __init__(self, params: dict[str, str]) -> None:
        from api.node import Node
        from store import open_store
        from workers.config import Settings, api_settings
        from workers.segments import SegmentNames, Segments

        self.segments = Segments.attach(SegmentNames.for_instance(params["instance"]))
        self.store = open_store(params["store_url"])
        hash_as_node(self.store)
        self.node = Node(
            settings=api_settings(
                Settings(), node="bench", instance=params["instance"], worker=1, advertised_url=""
            ),
            store=self.store,
            ring=self.segments.ring,
            leases=self.segments.leases,
            state=self.segments.state,
            marks=self.segments.marks,
        )
        self.tokens: dict[str, str] = {}
        # Imported here, not at the first claim, so no claim is timed with an import in it.
        from api.claims import grant_from_ring
        from api.completions import apply
        from wire.schemas import CompletionItem, CompletionsRequest

        self._grant, self._apply = grant_from_ring, apply
        self._item, self._request = CompletionItem, CompletionsRequest

    def claim(self, n: int, now_ms: int, lease_ms: int) -> list[str]:
        leases = self._grant(self.node, n, lease_ms)
        for lease in leases:
            self.tokens[lease.key] = lease.token
        return [lease.key for lease in leases]

    def complete(self, keys: list[str], now_ms: int) -> None:
        items = [self._item(key=k, token=self.tokens.pop(k), outcome="rendered") for k in keys]
        (done,) = self._apply(self.node, [self._request(items=items)], wait=True)
        refused = [r for r in done.results if not r.ok]
        if refused:
            raise RuntimeError(f"{len(refused)} completions refused, e.g. {refused[0]}")

    def close(self) -> None:
        self.store.close()
        self.segments.close()


class HttpPeer:
    """The real node: `renderqueue serve`, two workers, the keeper in worker 0."""

    name = OURS_HTTP

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"rqbench_http_{unique_suffix()}_"))
        self.db = str(self.dir / "schedule.sqlite")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log = open(self.dir / "node.log", "wb")  # noqa: SIM115 (closed in drop)

    def load(self, rows: Rows) -> None:
        from store import open_store

        store = open_store("sqlite:///" + self.db)
        try:
            for part in rows.chunks(WRITE_CHUNK):
                store.write(upsert=row_writes(rows, part))
        finally:
            store.close()
        env = dict(os.environ, RENDERQUEUE_FLEET_TOKEN=FLEET_TOKEN)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.cli",
                "serve",
                "--db",
                self.db,
                "--port",
                str(self.port),
                "--workers",
                "2",
                "--instance",
                f"rqbh{unique_suffix()}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self._wait_ready(300)

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx

        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"node exited {self.process.returncode}; see {self.dir}")
            try:
                response = httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=2)
                if response.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"node not ready within {timeout_s} s")

    def churn(self, rows: Rows, plan: list[tuple[int, int]]) -> None:
        from store import open_store

        store = open_store("sqlite:///" + self.db)
        try:
            for start in range(0, len(plan), 1000):
                part = plan[start : start + 1000]
                for i, due in part:
                    rows.next_render_at[i] = due
                store.write(upsert=row_writes(rows, [i for i, _ in part]))
        finally:
            store.close()

    def settle(self) -> None:
        # The keeper follows the churn through the change feed; a few publishes later
        # it has applied it (the in-process arm checks exactness itself).
        time.sleep(3)
        self._wait_ready(60)

    def spec(self) -> Spec:
        return Spec(kind="renderqueue-http", params={"url": f"http://127.0.0.1:{self.port}"})

    def carried_spec(self) -> Spec:
        """Claimants that carry each batch's completions on their next claim."""
        return Spec(
            kind="renderqueue-http",
            params={"url": f"http://127.0.0.1:{self.port}", "carry": "1"},
        )

    def cpu_s(self) -> float:
        """The node's CPU so far: the supervisor and every worker (psutil)."""
        import psutil

        if self.process is None:
            return 0.0
        root = psutil.Process(self.process.pid)
        total = 0.0
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def drop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class HttpClaimant:
    def __init__(self, params: dict[str, str]) -> None:
        import httpx

        self.client = httpx.Client(
            base_url=params["url"],
            headers={"Authorization": f"Bearer {FLEET_TOKEN}"},
            timeout=30,
        )
        self.tokens: dict[str, str] = {}
        self.worker = f"bench-{os.getpid()}"
        # Carrying: the last batch's completions, sent on the next claim.
        self.carry = params.get("carry") == "1"
        self.pending: list[dict[str, str]] = []
        # Open the keep-alive connection now, so the first timed claim doesn't pay for it.
        self.client.get("/healthz")

    def claim(self, n: int, now_ms: int, lease_ms: int) -> list[str]:
        body: dict[str, Any] = {"max": n, "lease_s": lease_ms // 1000, "worker": self.worker}
        if self.pending:
            body["complete"], self.pending = self.pending, []
        response = self.client.post("/v1/claims", json=body)
        response.raise_for_status()
        answer = response.json()
        _all_applied(answer.get("completed", []))
        keys = []
        for lease in answer["leases"]:
            self.tokens[lease["key"]] = lease["token"]
            keys.append(lease["key"])
        return keys

    def complete(self, keys: list[str], now_ms: int) -> None:
        items = [{"key": k, "token": self.tokens.pop(k), "outcome": "rendered"} for k in keys]
        if self.carry:
            self.pending += items  # on the next claim
            return
        self._send(items)

    def _send(self, items: list[dict[str, str]]) -> None:
        response = self.client.post("/v1/completions", json={"items": items})
        response.raise_for_status()
        _all_applied(response.json()["results"])

    def close(self) -> None:
        if self.pending:
            self._send(self.pending)
        self.client.close()


def _all_applied(results: list[dict[str, Any]]) -> None:
    refused = [r for r in results if not r["ok"]]
    if refused:
        raise RuntimeError(f"{len(refused)} completions refused, e.g. {refused[0]}")


def open_renderqueue_claimant(spec: Spec) -> Claimant:
    if spec.kind == "renderqueue-http":
        return HttpClaimant(spec.params)
    return InProcessClaimant(spec.params)


def factories() -> dict[str, Any]:
    return {OURS: RenderqueuePeer, OURS_HTTP: HttpPeer}
