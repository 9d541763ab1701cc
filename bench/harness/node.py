"""A node under test: `renderqueue serve` started on a loaded store, a lean keep-alive HTTP
client for it, and each of its processes' CPU."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.harness import report
from bench.harness.workload import (
    Rows,
    unique_suffix,
)

ADMIN_TOKEN = "bench-node-admin-" + "a" * 16


FLEET_TOKEN = "bench-node-fleet-" + "f" * 16


WRITE_CHUNK = 5000


class NodeClient:
    """One keep-alive connection; bodies encoded and decoded by msgspec."""

    def __init__(self, port: int, token: str | None = FLEET_TOKEN) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def call(self, method: str, path: str, body: Any = None, answer: Any = Any) -> tuple[int, Any]:
        """`answer`: the type to decode a 200 body as (msgspec skips the fields it lacks)."""
        payload = None if body is None else msgspec.json.encode(body)
        try:
            self.connection.request(method, path, body=payload, headers=self.headers)
        except (BrokenPipeError, ConnectionResetError):
            # The server closed this keep-alive connection while it sat idle (a loaded
            # machine can take longer than its keep-alive timeout to start every
            # claimant): the request never reached it, so sending it again is safe.
            self.connection.close()
            self.connection.request(method, path, body=payload, headers=self.headers)
        response = self.connection.getresponse()
        data = response.read()
        if not data:
            return response.status, None
        return response.status, msgspec.json.decode(
            data, type=answer if response.status == 200 else Any
        )

    def close(self) -> None:
        self.connection.close()


def connect(port: int, count: int, workers: int) -> tuple[list[NodeClient], list[int]]:
    """`count` keep-alive connections that reach every one of `workers` workers.

    Each worker has its own listeners and the kernel hashes connections over them, so a
    claimant's few connections could all land on one worker (worker 0 has one listener to
    every other worker's two: eight connections all miss it about one time in 25). A fleet
    has many connections; a claimant stands in for a share of them, so it keeps the first
    connection to each worker and fills the rest in the order the kernel gave them.
    Returns the connections and the pid answering on each.
    """
    opened: list[tuple[NodeClient, int]] = []
    while len(opened) < 10 * count:
        client = NodeClient(port)
        opened.append((client, int(client.call("GET", "/healthz")[1]["pid"])))
        if len(opened) >= count and len({pid for _, pid in opened}) >= workers:
            break
    first_of_worker: dict[int, int] = {}  # pid -> index in `opened`
    for i, (_, pid) in enumerate(opened):
        first_of_worker.setdefault(pid, i)
    firsts = set(first_of_worker.values())
    rest = [i for i in range(len(opened)) if i not in firsts][: max(0, count - len(firsts))]
    kept = sorted(firsts.union(rest))
    for i, (client, _) in enumerate(opened):
        if i not in kept:
            client.close()
    return [opened[i][0] for i in kept], [opened[i][1] for i in kept]


def process_cpu_s(processes: dict[str, Any]) -> dict[str, float]:
    """Each process's user + system CPU seconds so far; one that has exited is left out."""
    import psutil

    out: dict[str, float] = {}
    for label, process in processes.items():
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        out[label] = times.user + times.system
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load_store(url: str, rows: Rows, what: str = "node") -> float:
    """The workload's rows into the store at `url`, WRITE_CHUNK rows per `write`, with
    progress every 10%; returns the seconds it took."""
    from bench.harness.workload import row_writes
    from store import open_store

    store = open_store(url)
    started = time.perf_counter()
    step = max(1, len(rows) // 10)
    try:
        for part in rows.chunks(WRITE_CHUNK):
            store.write(upsert=row_writes(rows, part))
            if part.stop % step < WRITE_CHUNK and part.stop < len(rows):
                elapsed = time.perf_counter() - started
                report.progress(
                    f"{what}: loaded {part.stop:,}/{len(rows):,} rows "
                    f"({part.stop / elapsed:,.0f} rows/s)"
                )
    finally:
        store.close()
    return time.perf_counter() - started


class Node:
    """`renderqueue serve --workers 2` on a store loaded with the workload's rows.

    `db`: a store URL (postgresql://...) to load and serve; None: a SQLite file."""

    def __init__(self, rows: Rows | None, db: str | None = None, *, load: bool = True) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"rqbench_node_{unique_suffix()}_"))
        self.db = db or str(self.dir / "schedule.sqlite")
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log = (self.dir / "node.log").open("wb")
        self.instances: set[str] = set()  # every one it started as: drop() removes their segments
        if load and rows is not None:
            load_store(self.db, rows)

    def start(
        self,
        keeper_switch_interval_ms: float | None = None,
        keeper: dict[str, float | int] | None = None,
        *,
        instance: str | None = None,
        args: Sequence[str] = (),
        wait_s: float = 600,
    ) -> None:
        """`instance`: keep one across restarts (the lease snapshot is the instance's);
        `args`: more `serve` flags."""
        instance = instance or f"rqbn{unique_suffix()}"
        self.instances.add(instance)
        env = self.environment(instance)
        command = [
            sys.executable, "-m", "workers.cli", "serve", "--db", self.db,
            "--port", str(self.port), "--workers", "2",
            "--instance", instance, *args,
        ]  # fmt: skip
        if keeper_switch_interval_ms is not None:
            command += ["--keeper-switch-interval-ms", str(keeper_switch_interval_ms)]
        if keeper:
            config = self.dir / "node.toml"
            config.write_text(
                "[keeper]\n" + "".join(f"{name} = {value}\n" for name, value in keeper.items())
            )
            command += ["--config", str(config)]
        self.process = subprocess.Popen(
            command, cwd=report.REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.wait_live(wait_s)

    def environment(self, instance: str) -> dict[str, str]:
        """The node's environment: none of ours but the bench's tokens, and a store URL's
        lease snapshot in this node's directory, not var/<instance>.leases under the
        repository (a SQLite node keeps its own beside its file)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")}
        env.update(RENDERQUEUE_ADMIN_TOKEN=ADMIN_TOKEN, RENDERQUEUE_FLEET_TOKEN=FLEET_TOKEN)
        if "://" in self.db:
            env["RENDERQUEUE_LEASE_SNAPSHOT"] = str(self.dir / f"{instance}.leases")
        return env

    def admin(self) -> NodeClient:
        return NodeClient(self.port, ADMIN_TOKEN)

    def processes(self) -> dict[str, Any]:
        """The node's processes by label (the supervisor, each worker), as psutil sees them."""
        import psutil

        assert self.process is not None
        out = {"supervisor": psutil.Process(self.process.pid)}
        for pid, index in sorted(self.worker_of().items(), key=lambda item: item[1]):
            out[f"worker {index}"] = psutil.Process(pid)
        return out

    def worker_of(self) -> dict[int, int]:
        """pid -> worker index, from the supervisor's statistics."""
        client = self.admin()
        try:
            _, overview = client.call("GET", "/prerender_admin/overview")
        finally:
            client.close()
        return {w["pid"]: w["index"] for w in overview["supervisor"]["workers"] if w["pid"]}

    def wait_live(self, timeout_s: float, since_ms: int = 0) -> None:
        """Until the keeper has loaded every row and vouches for exact numbers (in a
        queue-state it wrote at `since_ms` or later: not the last one a dead keeper left)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"node exited {self.process.returncode}; see {self.dir}")
            try:
                client = self.admin()
                status, body = client.call("GET", "/prerender_admin/queue-state")
                client.close()
                trust = (body or {}).get("trust") or {}
                fresh = (body or {}).get("generated_at", 0) >= since_ms
                if status == 200 and trust.get("phase") == "live" and trust.get("exact") and fresh:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"node not live and exact within {timeout_s} s; see {self.dir}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def drop(self) -> None:
        self.stop()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        # A node stopped by SIGKILL (or one that failed its SIGTERM) left its segments.
        from workers.segments import SegmentNames

        for instance in self.instances:
            SegmentNames.for_instance(instance).remove()
