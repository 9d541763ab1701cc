"""The seed's "Two nodes" table on PostgreSQL: a cluster of real nodes sharing one database.

`python -m bench cluster [--quick]` (or `python -m bench.sections.cluster [--quick]`)

One scratch database on RENDERQUEUE_TEST_PG's server (`rq_bench_<pid>_cluster`,
dropped at the end), loaded with 250k rows per node of bench.harness.workload's workload
(quick: a few thousand). Nodes are `renderqueue serve --workers 1 --node NAME` on it
(a supervisor and worker 0, which hosts the keeper), with fast membership settings
(`CLUSTER_ARGS`), each naming the others as peers so it loads its own share at once.
Rows are owned by rendezvous over the live node names (keeper.ownership.winners).

Per node, one writer process stands for the node's HTTP workers applying results:
single-row `PostgresStore.write`s, paced, of rows of every owner (each key at most
once per arm), all writers released together. Arms, interleaved in each round:

- keeper: the nodes running, every keeper live and exact before the arm starts;
- no keeper: the nodes stopped (SIGTERM, so they leave). The writers' path is the
  same (the log triggers and NOTIFY still run in every write); only the nodes, and
  so the keepers following the feed, are absent. A node process without a keeper
  does not exist in the product, so this is the honest pair: the node's whole cost
  against none of it.

Figures per node: process CPU per cluster write (its writer + its node's processes,
psutil), the CPU of PostgreSQL's backends serving them (bench.sections.postgres's meter,
attributed by client port), the keeper thread's CPU per cluster write (psutil's
per-thread times for the thread whose native id the probe reports), put p50/p99 of
the node's writer for rows the node owns, and lag from the writer's monotonic clock
after `write` returned to the moment the owner's keeper received the event
(bench.harness.cluster_probe stamps each batch the feed hands the keeper). Coverage: every
row a writer wrote reached its owner's keeper. Exact: after the last keeper arm, each
keeper's held rows (hash, due, version, copied by its own thread) equal its share of
the table, and together the table.

Then: a third node joins under the writers (the live keepers' CPU and lag while
they rebalance), the rounds again with three nodes, and a SIGKILL of one of three
while claimants claim from the others: time to the first grant of one of its keys
by a survivor.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from bench.harness import report
from bench.harness.node import Node, NodeClient
from bench.harness.postgres import (
    Meter,
    Scratch,
    ServerUse,
    client_ports,
    db_url,
    host_port,
    server_url,
)
from bench.harness.report import REPO
from bench.harness.workload import Rows, Workload, generate, reachable

NAMES = ("a", "b", "c")
# Fast membership, as tests/test_cluster.py runs it: dead after 4 s, a grant window of
# TTL / 2 = 2 s, leases of at most 5 s.
HEARTBEAT_S, TTL_S, MAX_LEASE_S = 0.5, 4.0, 5
WINDOW_S = TTL_S / 2
CLUSTER_ARGS = (
    "--heartbeat-s", str(HEARTBEAT_S), "--node-ttl-s", str(TTL_S),
    "--max-lease-s", str(MAX_LEASE_S),
)  # fmt: skip
HOOK_DIR = REPO / "bench" / "harness" / "cluster_hook"
OURS = "keeper"
NO_KEEPER = "no keeper (nodes stopped)"
SETTLE_S = 0.5  # after the writers stop, inside the measured window
WARMUP = 20  # writes per writer before each arm, outside it
SEED_LAG = ("0.3-0.4", "42-105")


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows_per_node: int
    writes: int  # per writer per arm
    rate: int  # per writer, writes/s (the writer runs flat out if it cannot keep it)
    rounds2: int
    rounds3: int
    join_before_s: float
    join_after_s: float
    kill_wait_s: float
    idle_s: float  # before each keeper arm: the nodes' CPU with no writes, for its rate
    join_rate: int  # per writer while c joins (writes/s): low enough not to run out of keys


FULL = Config(
    rows_per_node=250_000,
    writes=15_000,
    rate=1500,
    rounds2=3,
    rounds3=2,
    join_before_s=8.0,
    join_after_s=8.0,
    kill_wait_s=40.0,
    idle_s=3.0,
    join_rate=1500,
)
QUICK = Config(
    rows_per_node=3_000,
    writes=400,
    rate=1000,
    rounds2=1,
    rounds3=1,
    join_before_s=1.5,
    join_after_s=1.5,
    kill_wait_s=25.0,
    idle_s=1.0,
    join_rate=150,
)


# --- the nodes ------------------------------------------------------------------------------


class ClusterNode(Node):
    """`renderqueue serve --workers 1 --node NAME` on the shared database, with the probe."""

    def __init__(self, name: str, url: str, rows: Rows) -> None:
        super().__init__(rows, db=url, load=False)
        self.name = name
        self.probe = self.dir / "probe"
        self.keeper_tid = 0
        self.started_at = 0.0

    def launch(self, peers: Sequence[str]) -> None:
        """Start without waiting (the caller waits for the cluster)."""
        instance = f"rqbc{os.getpid()}{self.name}{int(time.time())}"
        self.instances.add(instance)
        self.probe.mkdir(exist_ok=True)
        for stale in self.probe.iterdir():
            stale.unlink()
        env = self.environment(instance)
        env.update(
            RQ_BENCH_PROBE=str(self.probe),
            PYTHONPATH=os.pathsep.join([str(HOOK_DIR), str(REPO)]),
        )
        command = [
            sys.executable, "-m", "workers.cli", "serve", "--db", self.db,
            "--port", str(self.port), "--workers", "1", "--node", self.name,
            "--instance", instance, *CLUSTER_ARGS,
        ]  # fmt: skip
        others = [p for p in peers if p != self.name]
        if others:
            command += ["--peers", ",".join(others)]
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT
        )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def get(self, path: str) -> tuple[int, Any]:
        client = self.admin()
        try:
            return client.call("GET", path)
        finally:
            client.close()

    def view(self) -> list[str]:
        with contextlib.suppress(OSError):
            _, body = self.get("/prerender_admin/overview")
            return list(((body or {}).get("keeper") or {}).get("cluster", {}).get("view") or [])
        return []

    def pids(self) -> tuple[int, list[int]]:
        """The supervisor's pid and its workers'."""
        import psutil

        assert self.process is not None
        supervisor = psutil.Process(self.process.pid)
        return supervisor.pid, [p.pid for p in supervisor.children(recursive=True)]

    def read_keeper_tid(self) -> int:
        found = msgspec.json.decode((self.probe / "keeper.json").read_bytes())
        self.keeper_tid = int(found["tid"])
        return self.keeper_tid

    def ask(self, what: str, timeout_s: float = 60) -> bytes:
        """A probe request (`lag`, `held`): its answer's bytes."""
        request = self.probe / f"{what}.req"
        request.touch()
        deadline = time.monotonic() + timeout_s
        while request.exists():
            if time.monotonic() > deadline or not self.running:
                raise RuntimeError(f"node {self.name}: the probe did not answer {what}")
            time.sleep(0.02)
        return (self.probe / f"{what}.bin").read_bytes()

    def status(self) -> dict[str, Any]:
        return dict(msgspec.msgpack.decode(self.ask("status", 30)))

    def delivered(self) -> list[tuple[str, int]]:
        return [(str(key), int(at)) for key, at in msgspec.msgpack.decode(self.ask("lag"))]


class Cpu(msgspec.Struct, kw_only=True):
    node_s: float = 0.0  # the supervisor and its workers
    keeper_s: float = 0.0  # worker 0's keeper thread


def cpu_of(node: ClusterNode) -> Cpu:
    import psutil

    if not node.running:
        return Cpu()
    supervisor, workers = node.pids()
    total = 0.0
    keeper = 0.0
    for pid in (supervisor, *workers):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            times = process.cpu_times()
            total += times.user + times.system
            if node.keeper_tid:
                for thread in process.threads():
                    if thread.id == node.keeper_tid:
                        keeper = thread.user_time + thread.system_time
    return Cpu(node_s=total, keeper_s=keeper)


def start_nodes(nodes: Sequence[ClusterNode], owners: np.ndarray, timeout_s: float) -> float:
    """Launch `nodes` together (each naming the others) and wait until each is live, exact
    and holds exactly its share; returns the seconds that took."""
    started = time.monotonic()
    names = [n.name for n in nodes]
    for node in nodes:
        node.launch(names)
    wait_shares(nodes, owners, timeout_s, "start")
    for node in nodes:
        node.read_keeper_tid()
        node.delivered()  # what loading delivered is not an arm's
    return time.monotonic() - started


def shares_held(nodes: Sequence[ClusterNode], owners: np.ndarray) -> bool:
    """Every node live and exact under the view of exactly these nodes, holding its share."""
    return all(on_share(node, index, owners) for index, node in enumerate(sorted_nodes(nodes)))


def sorted_nodes(nodes: Sequence[ClusterNode]) -> list[ClusterNode]:
    return sorted(nodes, key=lambda n: n.name)


def on_share(node: ClusterNode, index: int, owners: np.ndarray) -> bool:
    """The node is live and exact and holds exactly its share (`index` in the sorted view),
    as its keeper says through the probe (queue-state's counts are up to 5 s old)."""
    if not node.running:
        raise RuntimeError(f"node {node.name} exited; its log is in {node.dir}")
    if not (node.probe / "keeper.json").exists():
        return False
    status = node.status()
    if not status or status.get("phase") != "live" or not status.get("exact"):
        return False
    view = status.get("view") or []
    nodes = int(owners.max()) + 1
    return bool(len(view) == nodes and status.get("held") == int((owners == index).sum()))


def wait_shares(
    nodes: Sequence[ClusterNode], owners: np.ndarray, timeout_s: float, what: str
) -> float:
    started = time.monotonic()
    deadline = started + timeout_s
    while not shares_held(nodes, owners):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: the nodes did not hold their shares in {timeout_s} s")
        time.sleep(0.2)
    return time.monotonic() - started


def stop_nodes(nodes: Sequence[ClusterNode]) -> None:
    for node in nodes:
        if node.running:
            assert node.process is not None
            node.process.send_signal(signal.SIGTERM)
    for node in nodes:
        node.stop()


# --- the writers ----------------------------------------------------------------------------


class Written(msgspec.Struct, kw_only=True):
    indexes: list[int]
    put_ns: list[int]
    commit_ns: list[int]  # time.monotonic_ns() when `write` returned
    cpu_s: float
    t0: float
    t1: float


def writer_process(conn: Connection, url: str, total_rows: int) -> None:
    """One node's writer: on each command, warms up, then (on `go`) writes its indexes at
    the paced rate, one row per `write`; stops early when told."""
    from bench.harness.workload import ROUTES, key_of
    from store.postgres import PostgresStore
    from store.rows import RowWrite

    store = PostgresStore(url)

    def row(index: int, n: int) -> RowWrite:
        route, cadence_s = ROUTES[index % len(ROUTES)]
        return RowWrite(
            key=key_of(index),
            route=route,
            next_render_at=time.time_ns() // 1_000_000 + cadence_s * 1000 + n,
            cadence_s=cadence_s,
            sitemap=index % 3 == 0,
        )

    conn.send(os.getpid())
    tag = 0
    while True:
        command = conn.recv()
        if command[0] == "exit":
            break
        if command[0] == "stop":
            continue  # it finished its keys before the stop came
        _, indexes, warmup, rate = command
        for index in warmup:
            store.write(upsert=[row(index, tag)])
            tag += 1
        conn.send("ready")
        go_at = conn.recv()
        while time.monotonic() < go_at:
            time.sleep(0.0005)
        interval = 1.0 / rate
        put_ns: list[int] = []
        commit_ns: list[int] = []
        cpu0 = time.process_time()
        t0 = time.monotonic()
        done = 0
        for n, index in enumerate(indexes):
            if n % 64 == 0 and conn.poll():
                conn.recv()  # stop
                break
            due = t0 + n * interval
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            write = row(index, tag)
            tag += 1
            started = time.perf_counter_ns()
            store.write(upsert=[write])
            put_ns.append(time.perf_counter_ns() - started)
            commit_ns.append(time.monotonic_ns())
            done += 1
        t1 = time.monotonic()
        conn.send_bytes(
            msgspec.msgpack.encode(
                Written(
                    indexes=list(indexes[:done]),
                    put_ns=put_ns,
                    commit_ns=commit_ns,
                    cpu_s=time.process_time() - cpu0,
                    t0=t0,
                    t1=t1,
                )
            )
        )
    store.close()


class Writers:
    def __init__(self, ctx: Any, url: str, total_rows: int, count: int) -> None:
        self.pipes: list[Connection] = []
        self.processes = []
        self.pids: list[int] = []
        for _ in range(count):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=writer_process, args=(theirs, url, total_rows))
            process.daemon = True
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)
        self.pids = [pipe.recv() for pipe in self.pipes]

    def prepare(self, jobs: Sequence[list[int]], warmups: Sequence[list[int]], rate: int) -> None:
        for pipe, job, warmup in zip(self.pipes, jobs, warmups, strict=False):
            pipe.send(("write", job, warmup, rate))
        for pipe in self.pipes[: len(jobs)]:
            assert pipe.recv() == "ready"

    def go(self, count: int) -> float:
        go_at = time.monotonic() + 0.05
        for pipe in self.pipes[:count]:
            pipe.send(go_at)
        return go_at

    def stop(self, count: int) -> None:
        for pipe in self.pipes[:count]:
            pipe.send(("stop",))

    def results(self, count: int) -> list[Written]:
        return [
            msgspec.msgpack.decode(pipe.recv_bytes(), type=Written) for pipe in self.pipes[:count]
        ]

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            with contextlib.suppress(OSError):
                pipe.send(("exit",))
            process.join(10)
            if process.is_alive():
                process.kill()


class Keys:
    """Each arm's keys: a permutation of the table walked in order, so no key is written
    twice inside an arm; a reserve at its end for the writers' warm-ups."""

    def __init__(self, total: int, seed: int = 7) -> None:
        self.order = np.random.default_rng(seed).permutation(total)
        self.reserve = max(1, total // 50)
        self.position = 0
        self.warm = 0

    def take(self, count: int) -> list[int]:
        usable = len(self.order) - self.reserve
        count = min(count, usable)
        if self.position + count > usable:
            self.position = 0
        taken = self.order[self.position : self.position + count]
        self.position += count
        return [int(i) for i in taken]

    def warmup(self, count: int) -> list[int]:
        usable = len(self.order) - self.reserve
        out = []
        for _ in range(count):
            out.append(int(self.order[usable + self.warm % self.reserve]))
            self.warm += 1
        return out


# --- one arm --------------------------------------------------------------------------------


class NodeArm(msgspec.Struct, kw_only=True):
    node: str
    writer_cpu_s: float
    node_cpu_s: float
    keeper_cpu_s: float | None
    backends_s: float  # its writer's and its node's backends
    feed_backend_s: float
    put_p50_us: float | None
    put_p99_us: float | None
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    lag_max_ms: float | None
    events: int | None  # events its keeper received in the arm
    polls: int | None = None  # feed batches with events its keeper applied in the arm
    keeper_idle_per_s: float | None = None  # its keeper thread's CPU/s with no writes
    node_idle_per_s: float | None = None
    own_written: int
    own_missing: int | None  # own rows written that never reached its keeper


class ArmResult(msgspec.Struct, kw_only=True):
    nodes: int
    arm: str
    round: int
    cluster_writes: int
    seconds: float
    all_postgres_s: float
    per_node: list[NodeArm]

    @property
    def rate(self) -> float:
        return self.cluster_writes / self.seconds if self.seconds else 0.0


class Bench:
    def __init__(self, config: Config, ctx: Any, url: str, datname: str, rows: Rows) -> None:
        from keeper.ownership import winners
        from shm.keys import key_hashes, use_secret
        from store.postgres import PostgresStore

        # The nodes hash under their database's secret; so must the owners predicted here.
        store = PostgresStore(url)
        try:
            use_secret(store.hash_secret())
        finally:
            store.close()
        self.config = config
        self.url = url
        self.datname = datname
        self.rows = rows
        self.total = len(rows)
        self.hashes = key_hashes([k.encode() for k in rows.keys])
        self.owners = {
            n: winners(self.hashes, list(NAMES[:n])) for n in (2, 3)
        }  # index into sorted names
        self.nodes = [ClusterNode(name, url, rows) for name in NAMES]
        self.writers = Writers(ctx, url, self.total, len(NAMES))
        self.keys = Keys(self.total)
        self.meter = Meter(ctx)
        self.timeline: list[dict[str, float]] = []

    def close(self) -> None:
        stop_nodes(self.nodes)
        self.writers.close()
        self.meter.close()

    def labels(self, count: int) -> dict[int, str]:
        labels = {pid: NAMES[i] for i, pid in enumerate(self.writers.pids[:count])}
        for node in self.nodes[:count]:
            if node.running:
                supervisor, workers = node.pids()
                for pid in (supervisor, *workers):
                    labels[pid] = node.name
        return labels

    def arm(self, count: int, keeper: bool, round_: int) -> ArmResult:
        nodes = self.nodes[:count]
        owners = self.owners[count]
        jobs = [self.keys.take(self.config.writes) for _ in range(count)]
        warmups = [self.keys.warmup(WARMUP) for _ in range(count)]
        self.writers.prepare(jobs, warmups, self.config.rate)
        ports = client_ports(self.labels(count))
        idle: dict[str, tuple[float, float]] = {}
        if keeper:
            time.sleep(0.3)
            for node in nodes:
                node.delivered()  # the warm-ups' events: not the arm's
            quiet = {node.name: cpu_of(node) for node in nodes}
            started = time.monotonic()
            time.sleep(self.config.idle_s)
            spent = time.monotonic() - started
            for node in nodes:
                now = cpu_of(node)
                idle[node.name] = (
                    (now.keeper_s - quiet[node.name].keeper_s) / spent,
                    (now.node_s - quiet[node.name].node_s) / spent,
                )
        before = {node.name: cpu_of(node) for node in nodes}
        with self.meter.measure(self.datname) as used:
            self.writers.go(count)
            written = self.writers.results(count)
            time.sleep(SETTLE_S)
            after = {node.name: cpu_of(node) for node in nodes}
        server: ServerUse = used[0]
        deliveries = {}
        if keeper:
            for i, node in enumerate(nodes):
                deliveries[node.name] = self.collect(node, i, owners, written)
        cluster_writes = sum(len(w.put_ns) for w in written)
        seconds = max(w.t1 for w in written) - min(w.t0 for w in written)
        per_node = []
        for i, node in enumerate(nodes):
            backends = [b for b in server.backends if ports.get(b.client_port) == node.name]
            mine = written[i]
            own = [
                ns
                for index, ns in zip(mine.indexes, mine.put_ns, strict=True)
                if owners[index] == i
            ]
            got = deliveries.get(node.name)
            lags, missing, events, batches = got if got else ([], None, None, None)
            per_node.append(
                NodeArm(
                    node=node.name,
                    writer_cpu_s=mine.cpu_s,
                    node_cpu_s=after[node.name].node_s - before[node.name].node_s,
                    keeper_cpu_s=(after[node.name].keeper_s - before[node.name].keeper_s)
                    if keeper
                    else None,
                    backends_s=sum(b.cpu_s for b in backends),
                    feed_backend_s=sum(b.cpu_s for b in backends if b.app == "renderqueue-feed"),
                    put_p50_us=us(report.percentile(own, 50)),
                    put_p99_us=us(report.percentile(own, 99)),
                    lag_p50_ms=report.percentile(lags, 50),
                    lag_p99_ms=report.percentile(lags, 99),
                    lag_max_ms=max(lags) if lags else None,
                    events=events,
                    own_written=sum(
                        int(owners[index] == i) for w in written for index in w.indexes
                    ),
                    own_missing=missing,
                    polls=batches,
                    keeper_idle_per_s=idle[node.name][0] if node.name in idle else None,
                    node_idle_per_s=idle[node.name][1] if node.name in idle else None,
                )
            )
        result = ArmResult(
            nodes=count,
            arm=OURS if keeper else NO_KEEPER,
            round=round_,
            cluster_writes=cluster_writes,
            seconds=round(seconds, 3),
            all_postgres_s=server.all_s,
            per_node=per_node,
        )
        lag = "; ".join(
            f"{n.node}: lag p50 {fmt_ms(n.lag_p50_ms)} p99 {fmt_ms(n.lag_p99_ms)} ms"
            for n in per_node
            if n.lag_p99_ms is not None
        )
        report.progress(
            f"cluster: {count} nodes, round {round_}, {result.arm}: "
            f"{result.rate:,.0f} cluster writes/s" + (f"; {lag}" if lag else "")
        )
        return result

    def collect(
        self, node: ClusterNode, me: int, owners: np.ndarray, written: list[Written]
    ) -> tuple[list[float], int, int, int]:
        """Lags (ms) of the rows this node owns, how many of them never arrived (after up to
        10 s more), how many events its keeper received in the arm, in how many batches."""
        committed: dict[str, int] = {}
        for w in written:
            for i, ns in zip(w.indexes, w.commit_ns, strict=True):
                if owners[i] == me:
                    committed[self.rows.keys[i]] = ns
        arrived: dict[str, int] = {}
        events = 0
        stamps: set[int] = set()
        deadline = time.monotonic() + 10
        while True:
            batch = node.delivered()
            events += len(batch)
            stamps.update(ns for _, ns in batch)
            for key, ns in batch:
                arrived.setdefault(key, ns)
            missing = [k for k in committed if k not in arrived]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        lags = [max(0, arrived[k] - ns) / 1e6 for k, ns in committed.items() if k in arrived]
        return lags, len(missing), events, len(stamps)

    # -- exact at the end ------------------------------------------------------------------

    def exact(self, count: int) -> dict[str, Any]:
        """Each running keeper's held rows (hash, due, version) against its share of the
        table, read after the writers stopped and every feed was read to its end."""
        from store.postgres import PostgresStore

        nodes = self.nodes[:count]
        owners = self.owners[count]
        wait_shares(nodes, owners, 120, f"exact with {count} nodes")
        store = PostgresStore(self.url)
        try:
            table: dict[int, tuple[int, int]] = {}
            after: str | None = None
            while True:
                chunk = store.walk(after, 20_000)
                if not chunk:
                    break
                hashes = self.hash_of([r.key for r in chunk])
                for h, r in zip(hashes.tolist(), chunk, strict=True):
                    table[h] = (r.next_render_at, r.version)
                after = chunk[-1].key
        finally:
            store.close()
        index_of = {int(h): i for i, h in enumerate(self.hashes.tolist())}
        out: dict[str, Any] = {"table_rows": len(table), "nodes": {}}
        held_total = 0
        wrong_total = 0
        for me, node in enumerate(nodes):
            parts = msgspec.msgpack.decode(node.ask("held"))
            hashes = np.frombuffer(parts[0], dtype=np.uint64)
            dues = np.frombuffer(parts[1], dtype=np.int64)
            versions = np.frombuffer(parts[2], dtype=np.int64)
            held = {
                int(h): (int(d), int(v)) for h, d, v in zip(hashes, dues, versions, strict=True)
            }
            share = {h for h in table if owners[index_of[h]] == me}
            not_owned = sum(1 for h in held if h not in share)
            missing = sum(1 for h in share if h not in held)
            differ = sum(1 for h in share if h in held and held[h] != table[h])
            out["nodes"][node.name] = {
                "held": len(held),
                "share": len(share),
                "not_owned": not_owned,
                "missing": missing,
                "differ": differ,
            }
            held_total += len(held) - not_owned
            wrong_total += not_owned + missing + differ
        out["held_on_owner"] = held_total
        out["wrong"] = wrong_total
        report.progress(
            f"cluster: exact with {count} nodes: {held_total:,} of {len(table):,} rows held, "
            f"each on its owner; {wrong_total} wrong ({out['nodes']})"
        )
        return out

    def hash_of(self, keys: list[str]) -> np.ndarray:
        from shm.keys import key_hashes

        return key_hashes([k.encode() for k in keys])

    # -- a third node joins ---------------------------------------------------------------

    def join(self) -> dict[str, Any]:
        """a and b live and written to; c starts; until all three hold their shares, and
        a few seconds after. The live keepers' CPU and lag before, during and after."""
        live, joiner = self.nodes[:2], self.nodes[2]
        if not all(n.running for n in live):
            stop_nodes(live)
            start_nodes(live, self.owners[2], 900)
        owners3 = self.owners[3]
        seconds = self.config.join_before_s + self.config.join_after_s + 600
        rate = self.config.join_rate
        each = min(int(rate * seconds), (self.total - self.keys.reserve) // len(live))
        jobs = [self.keys.take(each) for _ in live]
        self.writers.prepare(jobs, [self.keys.warmup(WARMUP) for _ in live], rate)
        time.sleep(0.3)
        for node in live:
            node.delivered()
        marks: dict[str, float] = {}
        cpu: dict[str, dict[str, Cpu]] = {}

        def mark(name: str) -> None:
            marks[name] = time.monotonic()
            cpu[name] = {node.name: cpu_of(node) for node in live}

        mark("start")
        self.writers.go(len(live))
        timeline: list[dict[str, float]] = []
        last = {node.name: cpu_of(node) for node in live}
        last_t = time.monotonic()

        def sample() -> None:
            nonlocal last, last_t
            now = time.monotonic()
            current = {node.name: cpu_of(node) for node in live}
            if now - last_t >= 0.2:
                point = {"t": now - marks["start"]}
                for name, c in current.items():
                    point[f"{name} keeper"] = (c.keeper_s - last[name].keeper_s) / (now - last_t)
                    point[f"{name} node"] = (c.node_s - last[name].node_s) / (now - last_t)
                timeline.append(point)
                last, last_t = current, now

        while time.monotonic() - marks["start"] < self.config.join_before_s:
            time.sleep(0.25)
            sample()
        mark("join")
        joiner.launch(NAMES[:3])
        deadline = time.monotonic() + 900
        on_share_at: dict[str, float] = {}
        while True:
            time.sleep(0.25)
            sample()
            if time.monotonic() > deadline:
                raise TimeoutError("join: the nodes did not hold their three shares")
            for index, node in enumerate(self.nodes):
                if node.name not in on_share_at and on_share(node, index, owners3):
                    on_share_at[node.name] = round(time.monotonic() - marks["join"], 3)
            if len(on_share_at) == 3 and shares_held(self.nodes, owners3):
                break
        mark("exact")
        until = marks["exact"] + self.config.join_after_s
        while time.monotonic() < until:
            time.sleep(0.25)
            sample()
        mark("end")
        self.writers.stop(len(live))
        written = self.writers.results(len(live))
        joiner.read_keeper_tid()
        joiner.delivered()
        windows = (
            ("before", "start", "join"),
            ("rebalance", "join", "exact"),
            ("after", "exact", "end"),
        )
        out: dict[str, Any] = {
            "rebalance_s": round(marks["exact"] - marks["join"], 3),
            "cluster_writes_per_s": round(
                sum(len(w.put_ns) for w in written) / (marks["end"] - marks["start"]), 1
            ),
            "timeline": timeline,
            "join_at_s": marks["join"] - marks["start"],
            "on_share_after_join_s": on_share_at,
            "exact_at_s": marks["exact"] - marks["start"],
            "nodes": {},
        }
        for me, node in enumerate(live):
            committed: dict[str, int] = {}
            for w in written:
                for i, ns in zip(w.indexes, w.commit_ns, strict=True):
                    if owners3[i] == me:  # owned by this node before, during and after
                        committed[self.rows.keys[i]] = ns
            arrived: dict[str, int] = {}
            for key, ns in node.delivered():
                arrived.setdefault(key, ns)
            per: dict[str, Any] = {"missing": sum(1 for k in committed if k not in arrived)}
            for label, a, b in windows:
                lo, hi = marks[a] * 1e9, marks[b] * 1e9
                lags = [
                    max(0, arrived[k] - ns) / 1e6
                    for k, ns in committed.items()
                    if k in arrived and lo <= ns < hi
                ]
                span = marks[b] - marks[a]
                per[label] = {
                    "seconds": round(span, 3),
                    "keeper_cpu_s": round(
                        cpu[b][node.name].keeper_s - cpu[a][node.name].keeper_s, 3
                    ),
                    "node_cpu_s": round(cpu[b][node.name].node_s - cpu[a][node.name].node_s, 3),
                    "lag_p50_ms": report.percentile(lags, 50),
                    "lag_p99_ms": report.percentile(lags, 99),
                    "lag_max_ms": max(lags) if lags else None,
                    "rows": len(lags),
                }
            out["nodes"][node.name] = per
        report.progress(
            f"cluster: join: c loaded and all three held their shares {out['rebalance_s']} s "
            f"after c started; "
            + "; ".join(
                f"{n}: keeper {p['rebalance']['keeper_cpu_s']} s CPU in the rebalance, lag p99 "
                f"{fmt_ms(p['rebalance']['lag_p99_ms'])} ms "
                f"(before {fmt_ms(p['before']['lag_p99_ms'])})"
                for n, p in out["nodes"].items()
            )
        )
        return out

    # -- SIGKILL one of three --------------------------------------------------------------

    def kill(self) -> dict[str, Any]:
        """Claimants on a and b; c SIGKILLed: when a survivor first grants one of c's keys."""
        nodes = self.nodes
        if not all(n.running for n in nodes):
            stop_nodes(nodes)
            start_nodes(nodes, self.owners[3], 900)
        # Past the fences of a start (a node joining live peers fences its keys).
        time.sleep(WINDOW_S + MAX_LEASE_S + 0.5)
        owners3 = self.owners[3]
        victim_keys = {self.rows.keys[i] for i in np.flatnonzero(owners3 == 2).tolist()}
        survivors, victim = nodes[:2], nodes[2]
        stop = threading.Event()
        grants: list[tuple[str, str, float]] = []  # node, key, answered (monotonic)
        errors: list[str] = []

        def claim(node: ClusterNode) -> None:
            client = NodeClient(node.port)
            body = {"max": 20, "worker": f"bench-{node.name}", "lease_s": MAX_LEASE_S}
            try:
                while not stop.is_set():
                    try:
                        status, answer = client.call("POST", "/v1/claims", body)
                    except OSError as exc:
                        errors.append(repr(exc))
                        client.close()
                        client = NodeClient(node.port)
                        time.sleep(0.1)
                        continue
                    at = time.monotonic()
                    if status == 200:
                        grants.extend((node.name, x["key"], at) for x in answer["leases"])
                    time.sleep(0.1)
            finally:
                client.close()

        threads = [threading.Thread(target=claim, args=(n,), daemon=True) for n in survivors]
        for thread in threads:
            thread.start()
        time.sleep(1.5)
        assert victim.process is not None
        killed = time.monotonic()
        victim.process.send_signal(signal.SIGKILL)
        victim.process.wait(10)
        view_dropped: float | None = None
        first: float | None = None
        while time.monotonic() - killed < self.config.kill_wait_s:
            time.sleep(0.1)
            if view_dropped is None and all(n.view() and "c" not in n.view() for n in survivors):
                view_dropped = time.monotonic() - killed
            hits = [at for _, key, at in list(grants) if key in victim_keys and at > killed]
            if hits and first is None:
                first = min(hits) - killed
            # Both: a survivor may grant the dead node's keys (its lease ceiling passed)
            # between two looks at the views.
            if first is not None and view_dropped is not None:
                break
        stop.set()
        for thread in threads:
            thread.join(10)
        victim.stop()
        before = [at for _, key, at in grants if key in victim_keys and at <= killed]
        exact_s = wait_shares(survivors, self.owners[2], 120, "after the kill")
        out = {
            "first_grant_s": None if first is None else round(first, 3),
            "view_dropped_s": None if view_dropped is None else round(view_dropped, 3),
            "exact_after_kill_s": round(time.monotonic() - killed, 3),
            "exact_wait_s": round(exact_s, 3),
            "grants": len(grants),
            "victim_grants_before_kill": len(before),
            "claim_errors": len(errors),
            "settings": {
                "heartbeat_s": HEARTBEAT_S,
                "node_ttl_s": TTL_S,
                "grant_window_s": WINDOW_S,
                "max_lease_s": MAX_LEASE_S,
            },
        }
        report.progress(
            f"cluster: SIGKILL of c: survivors' view dropped it after {out['view_dropped_s']} s; "
            f"first grant of one of its keys by a survivor {out['first_grant_s']} s after the "
            f"kill ({len(grants)} grants in all)"
        )
        return out


def us(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1000, 1)


def fmt_ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


# --- the run --------------------------------------------------------------------------------


def run(config: Config, raw: dict[str, Any], scratch: Scratch) -> list[ArmResult]:
    from bench.harness.node import load_store

    datname = scratch.create("cluster")
    url = db_url(datname, synchronous_commit="off")
    total = config.rows_per_node * 2
    rows = generate(Workload(rows=total, now_ms=time.time_ns() // 1_000_000))
    raw["load_s"] = round(load_store(url, rows, f"cluster: {datname}"), 2)
    ctx = mp.get_context("spawn")
    bench = Bench(config, ctx, url, datname, rows)
    arms: list[ArmResult] = []
    starts: dict[str, list[float]] = {"2": [], "3": []}
    try:
        for count, rounds in ((2, config.rounds2), (3, config.rounds3)):
            nodes = bench.nodes[:count]
            if count == 3:
                raw["join"] = bench.join()
                raw["exact_3_after_join"] = bench.exact(3)
            for round_ in range(1, rounds + 1):
                # Alternate which arm goes first; two nodes end on the keeper (the join needs
                # them), three start on it (the join left them running).
                keeper_first = (round_ % 2 == 0) if count == 2 else (round_ % 2 == 1)
                for keeper in (keeper_first, not keeper_first):
                    if keeper and not all(n.running for n in nodes):
                        seconds = start_nodes(nodes, bench.owners[count], 900)
                        starts[str(count)].append(round(seconds, 2))
                        report.progress(
                            f"cluster: {count} nodes live and exact, each on its share, "
                            f"in {seconds:.1f} s"
                        )
                    elif not keeper:
                        stop_nodes(nodes)
                    arms.append(bench.arm(count, keeper, round_))
                if count == 2 and round_ == rounds:
                    raw["exact_2"] = bench.exact(2)
            if count == 3 and all(n.running for n in nodes):
                raw["exact_3"] = bench.exact(3)
        raw["kill"] = bench.kill()
        raw["exact_after_kill"] = bench.exact(2)
    finally:
        bench.close()
        for node in bench.nodes:
            node.drop()
    raw["start_s"] = starts
    raw["rows"] = total
    return arms


# --- the report -----------------------------------------------------------------------------


def _median(values: Sequence[float | None]) -> float | None:
    ordered = sorted(v for v in values if v is not None)
    return ordered[len(ordered) // 2] if ordered else None


def _range(values: Sequence[float | None], scale: float = 1.0) -> str:
    present = [v * scale for v in values if v is not None]
    if not present:
        return ""
    low, high = min(present), max(present)
    return f"rounds {report.fmt(low)}-{report.fmt(high)}" if len(present) > 1 else ""


def node_figures(config: Config, arms: list[ArmResult], count: int) -> list[report.Figure]:
    mine = [a for a in arms if a.nodes == count]
    if not mine:
        return []
    rounds = max(a.round for a in mine)
    table = (
        f"{'Two' if count == 2 else 'Three'} nodes on PostgreSQL: {config.rows_per_node * 2:,} "
        f"rows owned by rendezvous, one writer process per node writing rows of every owner "
        f"(single-row writes, {config.writes:,} per writer per arm, paced at "
        f"{config.rate:,}/s each), {rounds} round(s) interleaved; per node, medians over "
        f"rounds; ours = keeper arm, beside it the nodes stopped"
    )
    out: list[report.Figure] = []

    def values(arm: str, name: str, attr: str) -> list[float | None]:
        found = []
        for a in mine:
            if a.arm != arm:
                continue
            n = next(x for x in a.per_node if x.node == name)
            value = attr_of(a, n, attr)
            found.append(value)
        return found

    def attr_of(a: ArmResult, n: NodeArm, attr: str) -> float | None:
        writes = a.cluster_writes
        if attr == "process":
            return (n.writer_cpu_s + n.node_cpu_s) / writes * 1e6 if writes else None
        if attr == "backends":
            return n.backends_s / writes * 1e6 if writes else None
        if attr == "keeper":
            return None if n.keeper_cpu_s is None else n.keeper_cpu_s / writes * 1e6
        if attr == "keeper_net":
            if n.keeper_cpu_s is None or n.keeper_idle_per_s is None or not writes:
                return None
            # The window is the writers' span plus the settle.
            idle = n.keeper_idle_per_s * (a.seconds + SETTLE_S)
            return (n.keeper_cpu_s - idle) / writes * 1e6
        if attr == "keeper_idle":
            return None if n.keeper_idle_per_s is None else n.keeper_idle_per_s * 1000
        if attr == "polls":
            return None if n.polls is None or not writes else n.polls / writes
        if attr == "events":
            return None if n.events is None else n.events / writes
        if attr == "missing":
            return None if n.own_missing is None else float(n.own_missing)
        value = getattr(n, attr)
        return None if value is None else float(value)

    rows: list[tuple[str, str, str, str, str, bool, str]] = [
        # what, attr, unit, seed_text, target, with the no-keeper column, note
        ("process CPU per cluster write (its writer + its node)", "process", "µs",
         "137 (133-138); no subscription 134", "", True, ""),
        ("PostgreSQL backends' CPU per cluster write (its writer's + its node's)",
         "backends", "µs", "", "", True, ""),
        ("keeper thread busy per cluster write", "keeper", "µs",
         "55-59 (worker 0's thread; +7-13 over no subscription)", "", False, ""),
        ("keeper thread busy per cluster write, net of its idle rate", "keeper_net", "µs",
         "+7-13 over no subscription", "", False,
         "its CPU/s with the nodes idle just before the arm, times the arm's span, deducted"),
        ("keeper thread idle (no writes: publishing, reports, member reads)", "keeper_idle",
         "ms/s", "", "", False, ""),
        ("feed batches its keeper applied per cluster write", "polls", "", "", "", False,
         "polls that returned events; below 1: several events a poll"),
        ("put p50, own row", "put_p50_us", "µs", "126-132", "", True, ""),
        ("put p99, own row", "put_p99_us", "µs", "240-247", "", True, ""),
        ("lag p50, commit to owner's keeper", "lag_p50_ms", "ms", SEED_LAG[0], "", False, ""),
        ("lag p99, commit to owner's keeper", "lag_p99_ms", "ms", SEED_LAG[1], "< 20", False,
         ""),
        ("events its keeper received per cluster write", "events", "", "", "", False,
         "every keeper reads the whole log and drops rows it does not own"),
        ("own rows written that never reached its keeper (coverage)", "missing", "rows",
         "0 (8 of 8 windows)", "0", False, ""),
    ]  # fmt: skip
    for name in NAMES[:count]:
        for what, attr, unit, seed_text, target, paired, note in rows:
            ours = values(OURS, name, attr)
            stopped = values(NO_KEEPER, name, attr) if paired else []
            extra = _range(ours)
            if attr == "missing":
                written = sum(
                    next(x for x in a.per_node if x.node == name).own_written
                    for a in mine
                    if a.arm == OURS
                )
                lost = sum(int(v or 0) for v in ours)
                extra = f"{written - lost:,} of {written:,} own rows reached it, all rounds"
                out.append(
                    report.Figure(
                        table=table,
                        what=f"node {name}: {what}",
                        unit=unit,
                        ours=float(sum(v or 0 for v in ours)),
                        seed_text=seed_text,
                        target=target,
                        note=extra,
                    )
                )
                continue
            out.append(
                report.Figure(
                    table=table,
                    what=f"node {name}: {what}",
                    unit=unit,
                    ours=_median(ours),
                    seed_text=seed_text,
                    target=target,
                    peers={NO_KEEPER: _median(stopped)} if paired else {},
                    note="; ".join(x for x in (extra, note) if x),
                )
            )
        paired_diffs = []
        for round_ in range(1, rounds + 1):
            k = [a for a in mine if a.round == round_ and a.arm == OURS]
            s = [a for a in mine if a.round == round_ and a.arm == NO_KEEPER]
            if k and s:
                nk = next(x for x in k[0].per_node if x.node == name)
                ns = next(x for x in s[0].per_node if x.node == name)
                a_k, a_s = attr_of(k[0], nk, "process"), attr_of(s[0], ns, "process")
                if a_k is not None and a_s is not None:
                    paired_diffs.append(a_k - a_s)
        out.append(
            report.Figure(
                table=table,
                what=f"node {name}: process CPU, keeper minus stopped, paired per round",
                unit="µs",
                ours=_median(paired_diffs),
                seed_text="-4 to +12",
                note=_range(paired_diffs),
            )
        )
    for arm in (OURS, NO_KEEPER):
        rates = [a.rate for a in mine if a.arm == arm]
        out.append(
            report.Figure(
                table=table,
                what=f"cluster writes/s reached, {arm}",
                unit="writes/s",
                better="higher",
                ours=_median(rates),
                seed_text="about 15k",
                note=f"{count} writers paced at {config.rate:,}/s each; {_range(rates)}".rstrip(
                    "; "
                ),
            )
        )
    return out


def other_figures(config: Config, raw: dict[str, Any]) -> list[report.Figure]:
    out: list[report.Figure] = []
    total = raw.get("rows", config.rows_per_node * 2)
    table = "Exact at the end: each keeper's held rows (hash, due, version) against the table"
    for key, what in (
        ("exact_2", "two nodes, after the last keeper arm"),
        ("exact_3_after_join", "three nodes, after the join"),
        ("exact_3", "three nodes, after the last keeper arm"),
        ("exact_after_kill", "two survivors, after the SIGKILL of the third"),
    ):
        found = raw.get(key)
        if not found:
            continue
        out.append(
            report.Figure(
                table=table,
                what=f"{what}: rows held, each on its owner",
                unit="rows",
                better="higher",
                ours=float(found["held_on_owner"]),
                seed_text="500,000 of 500,000",
                target=f"{found['table_rows']:,} (every row)",
                note=", ".join(
                    f"{n}: {v['held']:,} held of a share of {v['share']:,}"
                    for n, v in found["nodes"].items()
                ),
            )
        )
        out.append(
            report.Figure(
                table=table,
                what=f"{what}: rows wrong (held off their owner, missing, or stale)",
                unit="rows",
                ours=float(found["wrong"]),
                target="0",
            )
        )
    starts = raw.get("start_s") or {}
    for count, seconds in sorted(starts.items()):
        if seconds:
            out.append(
                report.Figure(
                    table=table,
                    what=f"{count} nodes started together: to live, exact and on their shares",
                    unit="s",
                    ours=_median(seconds),
                    note=f"{total:,} rows in the table; {_range(seconds)}".rstrip("; "),
                )
            )
    join = raw.get("join")
    if join:
        jt = (
            "A third node joins two live ones under the writers (the seed's reload burst): "
            "the live keepers while they drop a third of their rows and walk the table"
        )
        out.append(
            report.Figure(
                table=jt,
                what="c started to all three live, exact and on their shares",
                unit="s",
                ours=join["rebalance_s"],
                seed_text="about 1.2 s per node (a full re-send, 250k rows)",
                note=f"at {join['cluster_writes_per_s']:,.0f} cluster writes/s; each node first "
                "live, exact and on its share after "
                + ", ".join(f"{n} {t:g} s" for n, t in join["on_share_after_join_s"].items()),
            )
        )
        for name, per in join["nodes"].items():
            before, during = per["before"], per["rebalance"]
            steady = before["keeper_cpu_s"] / before["seconds"] if before["seconds"] else 0.0
            burst = during["keeper_cpu_s"] - steady * during["seconds"]
            out.append(
                report.Figure(
                    table=jt,
                    what=f"node {name}: keeper thread CPU in the rebalance, beyond its steady rate",
                    unit="s",
                    ours=round(burst, 3),
                    seed_text="0.4 s of keeper work",
                    note=(
                        f"{during['keeper_cpu_s']:.2f} s in {during['seconds']:.1f} s "
                        f"({during['keeper_cpu_s'] / max(during['seconds'], 1e-9):.0%} of a core;"
                        f" {steady:.0%} before)"
                    ),
                )
            )
            out.append(
                report.Figure(
                    table=jt,
                    what=f"node {name}: node process CPU over the rebalance",
                    unit="s",
                    ours=during["node_cpu_s"],
                    note=(
                        f"{before['node_cpu_s'] / max(before['seconds'], 1e-9):.0%} of a core "
                        f"before, {during['node_cpu_s'] / max(during['seconds'], 1e-9):.0%} "
                        "during"
                    ),
                )
            )
            for q in ("p50", "p99"):
                out.append(
                    report.Figure(
                        table=jt,
                        what=f"node {name}: lag {q} during the rebalance (rows it keeps)",
                        unit="ms",
                        ours=during[f"lag_{q}_ms"],
                        peers={
                            "before the join": before[f"lag_{q}_ms"],
                            "after": per["after"][f"lag_{q}_ms"],
                        },
                        note=f"max {fmt_ms(during['lag_max_ms'])} ms; {per['missing']} rows "
                        "never reached it",
                    )
                )
    kill = raw.get("kill")
    if kill:
        kt = (
            f"SIGKILL of one of three nodes, claimants on the other two: heartbeat "
            f"{HEARTBEAT_S:g} s, --node-ttl-s {TTL_S:g} (grant window {WINDOW_S:g} s), "
            f"--max-lease-s {MAX_LEASE_S}"
        )
        bound = TTL_S + WINDOW_S + MAX_LEASE_S
        out.append(
            report.Figure(
                table=kt,
                what="kill to the survivors' member view without it",
                unit="s",
                ours=kill["view_dropped_s"],
                note=f"TTL {TTL_S:g} s after its last heartbeat, plus up to a 1 s member read",
            )
        )
        out.append(
            report.Figure(
                table=kt,
                what="kill to a survivor's first grant of one of its keys",
                unit="s",
                ours=kill["first_grant_s"],
                target=f"about TTL + window + max lease = {bound:g} s after its last heartbeat",
                note=f"{kill['grants']:,} grants by the survivors in all",
            )
        )
        out.append(
            report.Figure(
                table=kt,
                what="kill to both survivors exact on their new shares",
                unit="s",
                ours=kill["exact_after_kill_s"],
            )
        )
    return out


def chart(result: report.SectionResult, arms: list[ArmResult], raw: dict[str, Any]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (cpu_axis, lag_axis, join_axis) = plt.subplots(1, 3, figsize=(18, 5.5))
    labels: list[str] = []
    parts: dict[str, list[float]] = {"writer": [], "node": [], "backends": []}
    lag50: list[float] = []
    lag99: list[float] = []
    lag_labels: list[str] = []
    for count in (2, 3):
        for name in NAMES[:count]:
            for arm in (NO_KEEPER, OURS):
                chosen = [a for a in arms if a.nodes == count and a.arm == arm]
                if not chosen:
                    continue
                nodes = [next(x for x in a.per_node if x.node == name) for a in chosen]
                writes = [a.cluster_writes for a in chosen]
                labels.append(f"{count}n {name}\n{'keeper' if arm == OURS else 'stopped'}")
                for part, attr in (
                    ("writer", "writer_cpu_s"),
                    ("node", "node_cpu_s"),
                    ("backends", "backends_s"),
                ):
                    parts[part].append(
                        _median(
                            [getattr(n, attr) / w * 1e6 for n, w in zip(nodes, writes, strict=True)]
                        )
                        or 0.0
                    )
                if arm == OURS:
                    lag_labels.append(f"{count}n {name}")
                    lag50.append(_median([n.lag_p50_ms for n in nodes]) or 0.0)
                    lag99.append(_median([n.lag_p99_ms for n in nodes]) or 0.0)
    bottom = np.zeros(len(labels))
    for part, values in parts.items():
        cpu_axis.bar(range(len(labels)), values, bottom=bottom, label=part)
        bottom += np.array(values)
    cpu_axis.set_xticks(range(len(labels)), labels, fontsize=7)
    cpu_axis.set_title("CPU per cluster write, per node (µs)")
    cpu_axis.legend(fontsize=8)
    xs = np.arange(len(lag_labels))
    lag_axis.bar(xs - 0.2, lag50, 0.4, label="p50")
    lag_axis.bar(xs + 0.2, lag99, 0.4, label="p99")
    lag_axis.axhline(20, color="red", linestyle="--", linewidth=1, label="target p99 20 ms")
    lag_axis.set_xticks(xs, lag_labels)
    lag_axis.set_yscale("log")
    lag_axis.set_title("lag, commit to the owner's keeper (ms)")
    lag_axis.legend(fontsize=8)
    join = raw.get("join") or {}
    for name in ("a", "b"):
        points = join.get("timeline") or []
        join_axis.plot(
            [p["t"] for p in points],
            [p.get(f"{name} keeper", 0) * 100 for p in points],
            label=f"{name}: keeper thread",
        )
    if join:
        join_axis.axvline(join["join_at_s"], color="grey", linestyle="--", label="c starts")
        join_axis.axvline(join["exact_at_s"], color="green", linestyle="--", label="all exact")
    join_axis.set_title("a join: the live keepers' thread CPU (% of a core)")
    join_axis.set_xlabel("s")
    join_axis.legend(fontsize=8)
    scale = "quick, scaled down" if result.quick else "full scale"
    figure.suptitle(f"renderqueue cluster on PostgreSQL ({scale})")
    figure.tight_layout()
    path = report.RESULTS_DIR / ("cluster-quick.png" if result.quick else "cluster.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench cluster", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small and fast: proves every row")
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    result = report.new_result("cluster", args.quick, ours_label=OURS)
    down = reachable(*host_port(server_url()))
    if down:
        report.progress(f"cluster: FAILED: PostgreSQL {down}; the section needs it")
        return 1
    report.progress(f"cluster: load average {result.machine.get('load_avg_1m')} at the start")
    raw: dict[str, Any] = {"config": msgspec.to_builtins(config)}
    scratch = Scratch()
    try:
        arms = run(config, raw, scratch)
    finally:
        scratch.drop_all()
    raw["arms"] = [msgspec.to_builtins(a) for a in arms]
    raw["load_avg_1m_at_end"] = f"{os.getloadavg()[0]:.2f}"
    figures = node_figures(config, arms, 2) + node_figures(config, arms, 3)
    figures += other_figures(config, raw)
    result.figures = figures
    result.promised = [f.key for f in figures]
    result.raw = raw
    raw["chart"] = str(chart(result, arms, raw))
    status = report.emit(result)
    wrong = [k for k, v in raw.items() if k.startswith("exact") and v and v.get("wrong")]
    if wrong:
        report.progress(f"cluster: FAILED: keepers not exact: {', '.join(wrong)}")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
