"""The cluster under faults: real nodes on one PostgreSQL, a simulated fleet, a history.

`python -m bench faults [--quick]` (or `python -m bench.sections.faults [--quick]`)

Each scenario gets a scratch database (`rq_bench_<pid>_faults_<scenario>`, dropped at
the end) of due rows, three nodes (`renderqueue serve --workers 1 --node NAME`) and a
fleet: threads that claim from their node, render for a while, renew at half-lease and
complete, each recording what it saw into one history (bench.harness.history). At the end the
history is checked (no key held by two at once) and the table counted (no row lost).

Scenarios, on default settings unless named:
- cold start: three nodes started at once; the time from every node ready to its first
  grant (their default `max_lease_s` is 300 s: a worst-case fence would show here).
- join: c joins a and b under the fleet, whose renders outlast their leases (renewals
  across the join); the time from c ready to its first grant, and renewals refused as
  `not_owner` at the old owners.
- SIGKILL: one of three killed whole under the fleet (fast membership: dead after 4 s;
  the default `max_lease_s`, 300 s, so the worst case is 306 s after the kill): the time
  to the first grant of one of its keys by a survivor, beside its real lease horizon, the
  lease ceiling its row published (what the survivors wait for) and the worst case.
- rolling restart: each node in turn SIGTERMed and started again under the fleet; per
  restart, how long its share went ungranted (from the stop to its first grant after
  the start), how long the cluster queue-state answered 503, and whether every
  completion of a lease it granted before the stop landed.
- blackhole: every node reaches PostgreSQL through a TCP proxy of its own, and every
  proxy stops forwarding (connections open, nothing reset) for 15 s, then for 60 s
  (quick: 30 s, past the TTL, so each node sees the others, or itself, dead on its
  return); per node, the time from the heal to its first grant.
- leave: c SIGTERMed under the fleet and not started again; the time to the first grant
  of one of its keys by a survivor, and the completions of c's leases that never landed
  (a render finished after c had gone: the survivors forward it to c, which is no longer
  a member).
- SIGKILL of all: every node killed whole at once, and the fleet's renders lost with them,
  then all started again at once on the same instances (each adopts the lease table its
  killed run left in shared memory); the slowest node's first grant after all are ready,
  and the first grant of a key that was under a lease at the kill, beside when the last
  of those leases ended.
- duplicate name: a second process started under a's name while a lives must be refused
  at start (`NameTaken`: non-zero exit, the reason in its log), and a keeps granting.
- clock +30 s, clock -30 s: c runs under libfaketime (its wall clock set apart, see
  bench/harness/faketime.py), joins a and b under the fleet, stays past the TTL, then leaves
  cleanly; its leases are judged by their terms, counted from each ask in this process's
  clock.
- renewals across a join: the fleet renders for longer than several leases at a and
  keeps renewing; c joins, a refuses the renewals of the keys that moved (`not_owner`),
  and c grants each of those only once its lease at a ended: the earliest such grant,
  measured from that end.
- worker 0 stopped: c's worker 0 (its keeper and, with one worker, its HTTP) SIGSTOPped
  for 60 s (quick: 40 s), then SIGCONTed; the share of PostgreSQL's NOTIFY queue in use
  (`pg_notification_queue_usage()`, read every second: one queue per server, held back
  by its slowest listener), how far into the stop a and b kept granting and their
  longest stretch without a grant, how soon c's keys were granted elsewhere (its
  supervisor withholds its heartbeat once the keeper is silent for a TTL, so the others
  take its share over), and c's first grant after SIGCONT.

A quick run (`--quick`, CI's) leaves out the scenarios the test suite proves on its own
nodes (TESTED_BY names the test of each) and runs the rest scaled down.

Every scenario is judged on the same history: no key held by two at once, no row lost.
The history holds what the fleet saw and what the nodes recorded (each node keeps a
lease journal): the nodes' leases must not overlap on a key, and every lease the fleet
saw must be one its node recorded.
The chart shows each scenario's grants per node over time, with its events marked.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench.harness import faketime, report
from bench.harness.history import (
    HeldLease,
    History,
    double_grants,
    double_holds,
    grants_by_node,
    in_one_clock,
    unrecorded,
)
from bench.harness.node import ADMIN_TOKEN, FLEET_TOKEN, Node, NodeClient
from bench.harness.postgres import Scratch, db_url, host_port, server_url
from bench.harness.report import REPO
from bench.harness.tcp_proxy import TcpProxy
from bench.harness.workload import reachable
from shm.lease_journal import read_journals

NAMES = ("a", "b", "c")
FAST = ("--heartbeat-s", "0.5", "--node-ttl-s", "4", "--max-lease-s", "10")
# Dead after 4 s, leases up to the default 300 s: only the lease ceiling ends the wait early.
FAST_DEATH = ("--heartbeat-s", "0.5", "--node-ttl-s", "4")
TABLE = "cluster under faults"


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    threads_per_node: int  # fleet threads claiming from each node
    claim_max: int
    lease_s: int
    render_s: tuple[float, float]  # a render's time, uniform in this range
    warm_s: float  # the fleet runs this long before a fault
    after_s: float  # and this long after the cluster settled again
    long_blackhole_s: float  # past the default TTL (12 s): the nodes see each other dead
    long_render_s: tuple[float, float]  # renders across a join: several leases long
    stop_s: float  # worker 0 stopped this long
    offset_live_s: float  # the node under libfaketime runs past the default TTL (12 s)


FULL = Config(
    rows=20_000,
    threads_per_node=3,
    claim_max=5,
    lease_s=6,
    render_s=(0.3, 9.0),
    warm_s=8.0,
    after_s=10.0,
    long_blackhole_s=60.0,
    long_render_s=(15.0, 30.0),
    stop_s=60.0,
    offset_live_s=20.0,
)
QUICK = Config(
    rows=3_000,
    threads_per_node=2,
    claim_max=4,
    lease_s=6,
    render_s=(0.2, 8.0),
    warm_s=4.0,
    after_s=5.0,
    long_blackhole_s=30.0,
    long_render_s=(12.0, 18.0),
    stop_s=40.0,  # past the keeper's silence and the TTL (12 s each), so c is taken over
    offset_live_s=15.0,
)


# --- the nodes ---------------------------------------------------------------------------


class FaultNode(Node):
    """One node of the cluster; its instance stays across restarts (its lease snapshot)."""

    def __init__(
        self,
        name: str,
        url: str,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        instance: str | None = None,
    ) -> None:
        """`env`: more environment (libfaketime's); `instance`: another than its own."""
        super().__init__(None, db=url, load=False)
        self.name = name
        self.args = tuple(args)
        self.env = dict(env or {})
        self.instance = instance or f"rqbf{os.getpid()}{name}{int(time.time())}"
        self.instances.add(self.instance)
        self.journal = self.dir / "journal"

    def launch(self) -> None:
        command = [
            sys.executable, "-m", "workers.cli", "serve", "--db", self.db,
            "--port", str(self.port), "--workers", "1", "--node", self.name,
            "--instance", self.instance, "--lease-journal-dir", str(self.journal), *self.args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env={**self.environment(self.instance), **self.env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def events(self, name: str) -> list[dict[str, Any]]:
        """The events `name` in the node's log, every start of it so far."""
        self.log.flush()
        found = []
        for line in (self.dir / "node.log").read_bytes().splitlines():
            with contextlib.suppress(msgspec.DecodeError):
                event = msgspec.json.decode(line)
                if isinstance(event, dict) and event.get("event") == name:
                    found.append(event)
        return found

    def members(self) -> list[str]:
        """The live nodes, as this node reads the member list."""
        client = NodeClient(self.port, ADMIN_TOKEN)
        try:
            status, body = client.call("GET", "/v1/cluster")
        finally:
            client.close()
        return [n["node"] for n in body["nodes"]] if status == 200 else []

    def worker0_pid(self) -> int:
        """Worker 0's pid (it hosts the keeper), from the supervisor's overview."""
        return next(pid for pid, index in self.worker_of().items() if index == 0)

    def ready(self) -> bool:
        """Serving claims (`/readyz` 200)."""
        try:
            client = NodeClient(self.port, ADMIN_TOKEN)
            try:
                status, _ = client.call("GET", "/readyz")
            finally:
                client.close()
        except OSError:
            return False
        return status == 200

    def wait_ready(self, timeout_s: float = 120) -> int:
        """Until `/readyz` says 200; returns when (ms)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"node {self.name} exited {self.process.returncode}")
            if self.ready():
                return report.now_ms()
            time.sleep(0.05)
        raise TimeoutError(f"node {self.name} not ready within {timeout_s} s; see {self.dir}")

    def kill(self) -> None:
        """SIGKILL the supervisor and its workers at once: a machine lost."""
        import psutil

        assert self.process is not None
        supervisor = psutil.Process(self.process.pid)
        for process in [supervisor, *supervisor.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self.process = None


# --- the fleet ---------------------------------------------------------------------------


def ends(lease: dict[str, Any], asked_ms: int) -> int:
    """A lease's end in this process's clock: its term counted from when it was asked (a
    node's own clock may be set apart from this one's)."""
    term = lease.get("lease_ms")
    return asked_ms + int(term) if term is not None else int(lease["lease_expires_at"])


class Fleet:
    """Threads that claim from their node, render, renew and complete, into a History."""

    def __init__(self, nodes: dict[str, FaultNode], config: Config) -> None:
        self.nodes = nodes
        self.config = config
        self.history = History()
        self.stop = threading.Event()
        self.paused: set[str] = set()  # nodes whose threads wait (a node being killed)
        self.errors = 0
        self.renewals_refused: dict[str, int] = {}
        self.completions_pending = 0  # gave up: their lease ran out before a node took them
        self.completions_refused: dict[str, int] = {}  # by the error a node answered
        self.unlanded: list[HeldLease] = []  # rendered, but no node took the completion
        self.epoch = 0  # `lose_renders` bumps it: a render of an older epoch is dropped
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, names: Sequence[str], render_s: tuple[float, float] | None = None) -> None:
        """`render_s`: these threads' renders, if not the config's."""
        for name in names:
            for index in range(self.config.threads_per_node):
                thread = threading.Thread(
                    target=self._run,
                    args=(name, f"{name}-{index}", render_s or self.config.render_s),
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def lose_renders(self) -> None:
        """Every render in flight is dropped, never renewed or completed: the fleet's own
        machines went down with the nodes."""
        with self._lock:
            self.epoch += 1

    def close(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, name: str) -> NodeClient:
        return NodeClient(self.nodes[name].port, FLEET_TOKEN)

    def _call(self, name: str, path: str, body: Any) -> tuple[int, Any]:
        client = self._client(name)
        try:
            return client.call("POST", path, body)
        except OSError:
            return 0, None
        finally:
            client.close()

    def _run(self, name: str, who: str, render_s: tuple[float, float]) -> None:
        rng = random.Random(who)
        while not self.stop.is_set():
            if name in self.paused:
                time.sleep(0.05)
                continue
            asked = report.now_ms()
            epoch = self.epoch
            status, body = self._call(
                name,
                "/v1/claims",
                {"max": self.config.claim_max, "worker": who, "lease_s": self.config.lease_s},
            )
            answered = report.now_ms()
            if status != 200 or not body or not body.get("leases"):
                if status not in (0, 200, 503):  # not a node that is down or unready
                    report.progress(f"faults: claim at {name} answered {status}: {body}")
                    with self._lock:
                        self.errors += 1
                time.sleep(0.1)
                continue
            held = [
                (
                    self.history.granted(
                        x["key"],
                        x.get("node") or name,
                        who,
                        asked,
                        answered,
                        ends(x, asked),
                        token=x["token"],
                    ),
                    x["token"],
                    answered + int(rng.uniform(*render_s) * 1000),
                )
                for x in body["leases"]
            ]
            self._render(name, held, epoch)

    def _render(self, name: str, held: list[tuple[HeldLease, str, int]], epoch: int) -> None:
        """Renew at half-lease until each render is done, then complete; a render whose
        renewal is refused, or whose lease is about to end, is abandoned."""
        lease_ms = self.config.lease_s * 1000
        while held and not self.stop.is_set() and self.epoch == epoch:
            now = report.now_ms()
            done = [h for h in held if h[2] <= now]
            if done:
                self._complete(name, done)
                held = [h for h in held if h[2] > now]
            due = [h for h in held if h[0].expires_ms - now < lease_ms // 2]
            if due:
                held = self._renew(name, held, due)
            # A lease near its end with no renewal landed: stop before it ends.
            held = [h for h in held if h[0].expires_ms - report.now_ms() > 300]
            time.sleep(0.1)

    def _renew(
        self,
        name: str,
        held: list[tuple[HeldLease, str, int]],
        due: list[tuple[HeldLease, str, int]],
    ) -> list[tuple[HeldLease, str, int]]:
        items = [{"key": h[0].key, "token": h[1], "lease_s": self.config.lease_s} for h in due]
        sent = report.now_ms()
        status, body = self._call(name, "/v1/leases/renew", {"items": items})
        if status != 200 or not body:
            return held
        dropped: set[str] = set()
        for lease, result in zip(due, body["results"], strict=True):
            if result.get("ok"):
                lease[0].expires_ms = ends(result, sent)
                lease[0].renewals += 1
            else:
                lease[0].refused_renewals += 1
                dropped.add(lease[0].key)
                reason = str(result.get("error"))
                with self._lock:
                    self.renewals_refused[reason] = self.renewals_refused.get(reason, 0) + 1
        return [h for h in held if h[0].key not in dropped]

    def _complete(self, name: str, done: list[tuple[HeldLease, str, int]]) -> None:
        """At the granting node, or any other (it forwards), until taken or the lease ends."""
        pending = list(done)
        targets = [name] + [n for n in self.nodes if n != name]
        attempt = 0
        expired: list[tuple[HeldLease, str, int]] = []
        while pending and not self.stop.is_set():
            sent = report.now_ms()
            expired += [h for h in pending if h[0].expires_ms <= sent]
            pending = [h for h in pending if h[0].expires_ms > sent]
            if not pending:
                break
            target = targets[attempt % len(targets)]
            attempt += 1
            items = [{"key": h[0].key, "token": h[1], "outcome": "rendered"} for h in pending]
            status, body = self._call(target, "/v1/completions", {"items": items})
            if status == 200 and body:
                left = []
                for lease, result in zip(pending, body["results"], strict=True):
                    if result.get("ok"):
                        lease[0].completed_ms = sent
                    elif result.get("error") == "node_unavailable":
                        left.append(lease)
                    else:
                        reason = str(result.get("error"))
                        with self._lock:
                            self.unlanded.append(lease[0])
                            self.completions_refused[reason] = (
                                self.completions_refused.get(reason, 0) + 1
                            )
                pending = left
            if pending:
                time.sleep(0.2)
        with self._lock:
            self.completions_pending += len(pending) + len(expired)
            self.unlanded += [h[0] for h in pending + expired]


class Poller:
    """Asks one path of the live nodes every `every_s`, recording (time, node, status)."""

    def __init__(self, nodes: dict[str, FaultNode], path: str, every_s: float = 0.2) -> None:
        self.nodes, self.path, self.every_s = nodes, path, every_s
        self.samples: list[tuple[int, str, int]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            for name, node in list(self.nodes.items()):
                client = NodeClient(node.port, ADMIN_TOKEN)
                try:
                    status, _ = client.call("GET", self.path)
                except OSError:
                    status = 0
                finally:
                    client.close()
                self.samples.append((report.now_ms(), name, status))
            self.stop.wait(self.every_s)

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


# --- the scenarios -----------------------------------------------------------------------


class Outcome(msgspec.Struct, kw_only=True):
    scenario: str
    figures: dict[str, float | None]
    double_grants: int
    rows_lost: int
    node_double_holds: int = 0  # leases the nodes' journals show on one key at once
    unrecorded: int = 0  # leases the fleet saw that no node's journal holds
    grants: int
    renewals_refused: dict[str, int]
    completions_pending: int
    events: list[tuple[int, str]]  # (ms, what), for the chart
    start_ms: int
    end_ms: int
    flow: dict[str, list[int]] = {}  # grants per node per second
    completions_refused: dict[str, int] = {}
    unlanded: dict[str, int] = {}  # rendered, no node took the completion: by granting node
    failed: list[str] = []  # what the scenario itself requires beyond the history, broken
    notes: dict[str, str] = {}


def key_of(index: int) -> str:
    return f"https://site{index % 50}.example/p/{index:07d}"


def seed(url: str, count: int) -> None:
    from store import open_store
    from store.rows import RowWrite

    store = open_store(url)
    now = report.now_ms()
    try:
        for start in range(0, count, 5000):
            store.write(
                upsert=[
                    RowWrite(
                        key=key_of(i),
                        route="product",
                        cadence_s=3600,
                        # A minute overdue: due too to a node whose clock runs 30 s behind.
                        next_render_at=now - 60_000 - i,
                    )
                    for i in range(start, min(count, start + 5000))
                ]
            )
    finally:
        store.close()


def count_rows(url: str) -> int:
    from store import open_store

    store = open_store(url)
    try:
        return store.count()
    finally:
        store.close()


@contextlib.contextmanager
def cluster(
    scratch: Scratch,
    scenario: str,
    config: Config,
    args: Sequence[str] = (),
    proxies: list[TcpProxy] | None = None,
    env: dict[str, dict[str, str]] | None = None,
) -> Iterator[tuple[str, dict[str, FaultNode], Fleet]]:
    """`proxies`: filled with a TCP proxy per node, each node's way to the database;
    `env`: more environment for the nodes named."""
    database = scenario.lower().replace(" ", "_").replace("+", "plus").replace("-", "minus")
    url = db_url(scratch.create(f"faults_{database}"))
    seed(url, config.rows)
    host, port = host_port(url)
    urls = {name: url for name in NAMES}
    if proxies is not None:
        for name in NAMES:
            proxy = TcpProxy(host, port).start()
            proxies.append(proxy)
            urls[name] = url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1)
    nodes = {name: FaultNode(name, urls[name], args, (env or {}).get(name)) for name in NAMES}
    fleet = Fleet(nodes, config)
    try:
        yield url, nodes, fleet
    finally:
        fleet.close()
        for node in nodes.values():
            node.drop()
        for proxy in proxies or ():
            proxy.stop()


def judged(
    scenario: str,
    url: str,
    config: Config,
    fleet: Fleet,
    figures: dict[str, float | None],
    events: list[tuple[int, str]],
    start_ms: int,
    *,
    failed: Sequence[str] = (),
    notes: dict[str, str] | None = None,
    clock_offsets_ms: dict[str, int] | None = None,
) -> Outcome:
    """`clock_offsets_ms`: how far a node's clock runs ahead of the machine's, so that its
    journal's instants are judged in the one clock."""
    fleet.close()
    end = report.now_ms()
    leases = fleet.history.snapshot()
    doubles = double_grants(leases)
    for double in doubles[:5]:
        report.progress(f"faults: {scenario}: DOUBLE GRANT {msgspec.json.encode(double).decode()}")
    journaled = in_one_clock(
        read_journals(*(node.journal for node in fleet.nodes.values())), clock_offsets_ms or {}
    )
    holds = double_holds(journaled)
    for hold in holds[:5]:
        report.progress(f"faults: {scenario}: DOUBLE HOLD {msgspec.json.encode(hold).decode()}")
    missing = unrecorded(leases, journaled)
    for lease in missing[:5]:
        report.progress(f"faults: {scenario}: UNRECORDED {msgspec.json.encode(lease).decode()}")
    lost = config.rows - count_rows(url)
    report.progress(
        f"faults: {scenario}: {len(leases):,} grants seen, {len(journaled):,} recorded, "
        f"{len(doubles)} double, {len(holds)} held twice by the records, {len(missing)} "
        f"unrecorded, {lost} rows lost, renewals refused {fleet.renewals_refused}, "
        f"figures {figures}"
    )
    for what in failed:
        report.progress(f"faults: {scenario}: FAILED: {what}")
    return Outcome(
        scenario=scenario,
        figures=figures,
        double_grants=len(doubles),
        rows_lost=lost,
        node_double_holds=len(holds),
        unrecorded=len(missing),
        grants=len(leases),
        renewals_refused=dict(fleet.renewals_refused),
        completions_pending=fleet.completions_pending,
        events=events,
        start_ms=start_ms,
        end_ms=end,
        flow=grants_by_node(leases, NAMES, start_ms, 1000, end),
        completions_refused=dict(fleet.completions_refused),
        unlanded=dict(collections.Counter(x.node for x in fleet.unlanded)),
        failed=list(failed),
        notes=dict(notes or {}),
    )


def first_grant_after(fleet: Fleet, node: str, after_ms: int, timeout_s: float) -> int | None:
    """When `node` first answered a grant asked after `after_ms` (waits up to timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [
            lease.answered_ms
            for lease in fleet.history.snapshot()
            if lease.node == node and lease.asked_ms >= after_ms
        ]
        if found:
            return min(found)
        time.sleep(0.05)
    return None


def seconds(start: int | None, end: int | None) -> float | None:
    return None if start is None or end is None else (end - start) / 1000


def cold_start(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "cold start", config) as (url, nodes, fleet):
        start = report.now_ms()
        for node in nodes.values():
            node.launch()
        ready = {name: node.wait_ready() for name, node in nodes.items()}
        all_ready = max(ready.values())
        events = [(all_ready, "all ready")]
        fleet.start(NAMES)
        waits = [
            seconds(all_ready, first_grant_after(fleet, name, all_ready, 600)) for name in NAMES
        ]
        time.sleep(config.after_s)
        slowest = None if any(w is None for w in waits) else max(w for w in waits if w is not None)
        return judged("cold start", url, config, fleet, {"first_grant_s": slowest}, events, start)


def join(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "join", config) as (url, nodes, fleet):
        start = report.now_ms()
        for name in ("a", "b"):
            nodes[name].launch()
        for name in ("a", "b"):
            nodes[name].wait_ready()
        fleet.start(("a", "b"))
        time.sleep(config.warm_s)
        joined = report.now_ms()
        nodes["c"].launch()
        ready = nodes["c"].wait_ready()
        fleet.start(("c",))
        first = first_grant_after(fleet, "c", ready, 600)
        time.sleep(config.after_s)
        events = [(joined, "c started"), (ready, "c ready")]
        return judged(
            "join", url, config, fleet, {"first_grant_s": seconds(ready, first)}, events, start
        )


def sigkill(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "sigkill", config, FAST_DEATH) as (url, nodes, fleet):
        start = report.now_ms()
        for node in nodes.values():
            node.launch()
        for node in nodes.values():
            node.wait_ready()
        fleet.start(NAMES)
        time.sleep(config.warm_s)
        fleet.paused.add("c")
        killed = report.now_ms()
        nodes["c"].kill()
        # Its leases end with their terms; what its fleet threads held is never completed.
        victims = [lease for lease in fleet.history.snapshot() if lease.node == "c"]
        keys = {lease.key for lease in victims}
        horizon = max(
            (lease.expires_ms for lease in victims if lease.completed_ms is None), default=killed
        )
        worst = killed + (4 + 2 + 300) * 1000  # its heartbeat is at most 0.5 s older
        ceiling = published_ceiling(url, "c")
        retaken = None
        deadline = time.monotonic() + 120
        while retaken is None and time.monotonic() < deadline:
            found = [
                lease.answered_ms
                for lease in fleet.history.snapshot()
                if lease.key in keys and lease.node != "c" and lease.asked_ms > killed
            ]
            retaken = min(found) if found else None
            time.sleep(0.1)
        time.sleep(config.after_s)
        figures = {
            "takeover_s": seconds(killed, retaken),
            "lease_horizon_s": seconds(killed, horizon),
            "worst_case_s": seconds(killed, worst),
            "ceiling_s": seconds(killed, ceiling),
        }
        events = [(killed, "c SIGKILLed")]
        return judged("sigkill", url, config, fleet, figures, events, start)


def published_ceiling(url: str, name: str) -> int | None:
    """The lease ceiling `name`'s row carries, in this process's clock (None: none)."""
    import psycopg

    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(
            "SELECT lease_horizon_ms, (extract(epoch FROM clock_timestamp()) * 1000)::bigint "
            "FROM nodes WHERE node = %s",
            (name,),
        ).fetchone()
    if row is None or not row[0]:
        return None
    return int(row[0]) - int(row[1]) + report.now_ms()


def _longest_503(samples: Sequence[tuple[int, str, int]], start: int, end: int) -> float:
    """The longest run of answers other than 200 in [start, end] from any one node (s)."""
    longest = 0
    by_node: dict[str, list[tuple[int, int]]] = {}
    for at, name, status in samples:
        if start <= at <= end:
            by_node.setdefault(name, []).append((at, status))
    for answers in by_node.values():
        began: int | None = None
        for at, status in answers:
            if status == 200:
                if began is not None:
                    longest = max(longest, at - began)
                began = None
            elif status != 0 and began is None:
                began = at
        if began is not None:
            longest = max(longest, answers[-1][0] - began)
    return longest / 1000


def rolling(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "rolling restart", config) as (url, nodes, fleet):
        start = report.now_ms()
        for node in nodes.values():
            node.launch()
        for node in nodes.values():
            node.wait_ready()
        fleet.start(NAMES)
        time.sleep(config.warm_s)
        events: list[tuple[int, str]] = []
        dark: list[float | None] = []
        windows: list[float] = []
        with Poller(nodes, "/prerender_admin/cluster/queue-state") as poller:
            for name, node in nodes.items():
                stopped = report.now_ms()
                node.stop()
                node.launch()
                ready = node.wait_ready()
                first = first_grant_after(fleet, name, stopped, 600)
                events += [(stopped, f"{name} SIGTERM"), (ready, f"{name} ready")]
                dark.append(seconds(stopped, first))
                time.sleep(config.warm_s)
                windows.append(_longest_503(poller.samples, stopped, report.now_ms()))
        time.sleep(config.after_s)
        figures = {
            "dark_s": None if any(d is None for d in dark) else max(d for d in dark if d),
            "queue_state_503_s": max(windows),
        }
        return judged("rolling restart", url, config, fleet, figures, events, start)


def blackhole(scratch: Scratch, config: Config, seconds_out: float, scenario: str) -> Outcome:
    proxies: list[TcpProxy] = []
    with cluster(scratch, scenario, config, proxies=proxies) as (url, nodes, fleet):
        start = report.now_ms()
        for node in nodes.values():
            node.launch()
        for node in nodes.values():
            node.wait_ready()
        fleet.start(NAMES)
        time.sleep(config.warm_s)
        cut = report.now_ms()
        for proxy in proxies:
            proxy.blackhole()
        time.sleep(seconds_out)
        healed = report.now_ms()
        for proxy in proxies:
            proxy.heal()
        waits = [seconds(healed, first_grant_after(fleet, name, healed, 600)) for name in NAMES]
        time.sleep(config.after_s)
        slowest = None if any(w is None for w in waits) else max(w for w in waits if w is not None)
        events = [(cut, "blackhole"), (healed, "healed")]
        return judged(scenario, url, config, fleet, {"first_grant_s": slowest}, events, start)


# --- judging from the history (pure, so tests/test_bench_faults.py runs them) ----------


def share_of(secret: bytes, keys: Sequence[str], nodes: Sequence[str]) -> dict[str, set[str]]:
    """Each node's keys by rendezvous over `nodes`, hashed under `secret` as the nodes hash
    them (the database's)."""
    import numpy as np

    from keeper.ownership import winners
    from shm.keys import keyed_hash

    order = sorted(nodes)  # as each keeper orders its member list
    hashes = np.array([keyed_hash(secret, key.encode()) for key in keys], dtype=np.uint64)
    shares: dict[str, set[str]] = {name: set() for name in order}
    for key, owner in zip(keys, winners(hashes, order).tolist(), strict=True):
        shares[order[owner]].add(key)
    return shares


def first_grant_of(
    leases: Sequence[HeldLease], keys: Collection[str], after_ms: int, by: Collection[str]
) -> int | None:
    """When the first grant of one of `keys` by a node in `by`, asked at `after_ms` or
    later, was answered."""
    return min(
        (
            x.answered_ms
            for x in leases
            if x.node in by and x.asked_ms >= after_ms and x.key in keys
        ),
        default=None,
    )


def live_at(leases: Sequence[HeldLease], at_ms: int) -> list[HeldLease]:
    """The leases granted by `at_ms` whose hold may reach past it."""
    return [x for x in leases if x.answered_ms <= at_ms < x.held_until_ms]


def regrant_margin(
    leases: Sequence[HeldLease], earlier: Sequence[HeldLease], by: Collection[str]
) -> float | None:
    """Over the leases in `earlier`: the next grant of the key by a node in `by`, from its
    ask, less the earlier lease's end (s); the smallest, or None when none was granted
    again. Below 0 the two may have overlapped (the history says whether they surely did)."""
    by_key: dict[str, list[HeldLease]] = {}
    for lease in leases:
        if lease.node in by:
            by_key.setdefault(lease.key, []).append(lease)
    margins = []
    for first in earlier:
        later = [
            x.asked_ms
            for x in by_key.get(first.key, ())
            if x is not first and x.asked_ms > first.answered_ms
        ]
        if later:
            margins.append(min(later) - first.held_until_ms)
    return min(margins) / 1000 if margins else None


def grants_span(
    leases: Sequence[HeldLease], by: Collection[str], start_ms: int, end_ms: int
) -> tuple[float | None, float]:
    """Over [start, end): how long the nodes in `by` kept granting (start to the last grant
    they answered, s) and the longest stretch in which they answered none (s, from start
    and to end included)."""
    times = sorted(
        x.answered_ms for x in leases if x.node in by and start_ms <= x.answered_ms < end_ms
    )
    edges = [start_ms, *times, end_ms]
    gap = max(b - a for a, b in itertools.pairwise(edges))
    return (None if not times else (times[-1] - start_ms) / 1000), gap / 1000


def grants_of(
    leases: Sequence[HeldLease],
    keys: Collection[str],
    by: Collection[str],
    start_ms: int,
    end_ms: int,
) -> list[HeldLease]:
    """The grants of `keys` by nodes in `by`, asked in [start, end)."""
    return [x for x in leases if x.node in by and start_ms <= x.asked_ms < end_ms and x.key in keys]


def refused_at_start(returncode: int | None, failures: Sequence[dict[str, Any]]) -> str | None:
    """The reason a start under a taken name gave, if it was refused for that: it exited
    non-zero and logged `start_failed` of kind NameTaken (its `failures`)."""
    if returncode is None or returncode == 0:
        return None
    for failure in failures:
        if failure.get("kind") == "NameTaken":
            return str(failure.get("error") or "NameTaken")
    return None


# --- the scenarios the fleet sees keys move in ------------------------------------------


def shares(url: str, rows: int, nodes: Sequence[str]) -> dict[str, set[str]]:
    from store import open_store

    store = open_store(url)
    try:
        secret = store.hash_secret()
    finally:
        store.close()
    return share_of(secret, [key_of(i) for i in range(rows)], nodes)


def wait_grant(
    fleet: Fleet, keys: Collection[str], after_ms: int, by: Collection[str], timeout_s: float
) -> int | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = first_grant_of(fleet.history.snapshot(), keys, after_ms, by)
        if found is not None:
            return found
        time.sleep(0.1)
    return None


def start_all(nodes: dict[str, FaultNode], names: Sequence[str] = NAMES) -> dict[str, int]:
    for name in names:
        nodes[name].launch()
    return {name: nodes[name].wait_ready() for name in names}


def leave(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "leave", config) as (url, nodes, fleet):
        start = report.now_ms()
        start_all(nodes)
        fleet.start(NAMES)
        time.sleep(config.warm_s)
        keys = shares(url, config.rows, NAMES)["c"]
        fleet.paused.add("c")
        stopped = report.now_ms()
        nodes["c"].stop()
        gone = report.now_ms()
        held = [x for x in live_at(fleet.history.snapshot(), stopped) if x.node == "c"]
        retaken = wait_grant(fleet, keys, stopped, ("a", "b"), 120)
        # c's renders go on after it left; by the end of their leases each completion
        # has landed, been refused or given up.
        time.sleep(max(config.after_s, config.lease_s + 2))
        unlanded = [x for x in fleet.unlanded if x.node == "c" and x.answered_ms <= stopped]
        figures = {
            "takeover_s": seconds(stopped, retaken),
            "handover_margin_s": regrant_margin(fleet.history.snapshot(), held, ("a", "b")),
            "leases_at_stop": float(len(held)),
            "unlanded": float(len(unlanded)),
        }
        events = [(stopped, "c SIGTERM"), (gone, "c exited")]
        return judged("leave", url, config, fleet, figures, events, start)


def kill_all(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "sigkill all", config) as (url, nodes, fleet):
        start = report.now_ms()
        start_all(nodes)
        fleet.start(NAMES)
        time.sleep(config.warm_s)
        fleet.paused.update(NAMES)
        # The fleet goes down with the nodes: a render it carried on would complete its
        # lease in the adopted table, and a completed key is never due to be granted again.
        fleet.lose_renders()
        killed = report.now_ms()
        for node in nodes.values():
            node.kill()
        held = live_at(fleet.history.snapshot(), killed)
        relaunched = report.now_ms()
        ready = max(start_all(nodes).values())
        fleet.paused.clear()
        waits = [seconds(ready, first_grant_after(fleet, name, ready, 600)) for name in NAMES]
        # A lease from before the kill lives on in the adopted table until its term ends.
        retaken = wait_grant(fleet, {x.key for x in held}, killed, NAMES, 120)
        time.sleep(config.after_s)
        figures = {
            "first_grant_s": None if None in waits else max(w for w in waits if w is not None),
            "ready_s": seconds(killed, ready),
            "takeover_s": seconds(killed, retaken),
            "lease_horizon_s": seconds(killed, max((x.held_until_ms for x in held), default=None)),
            "regrant_margin_s": regrant_margin(fleet.history.snapshot(), held, NAMES),
            "adopted": float(sum(1 for n in nodes.values() if n.events("lease_table_adopted"))),
        }
        events = [(killed, "all SIGKILLed"), (relaunched, "all started"), (ready, "all ready")]
        return judged("sigkill all", url, config, fleet, figures, events, start)


def duplicate(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "duplicate name", config) as (url, nodes, fleet):
        start = report.now_ms()
        start_all(nodes)
        fleet.start(NAMES)
        time.sleep(config.warm_s)
        # Its own port, directory and lease table: a second machine given a's name.
        twin = FaultNode("a", url, instance=f"{nodes['a'].instance}twin")
        launched = report.now_ms()
        try:
            twin.launch()
            assert twin.process is not None
            try:
                code: int | None = twin.process.wait(60)
            except subprocess.TimeoutExpired:
                code = None
            ended = report.now_ms()
            reason = refused_at_start(code, twin.events("start_failed"))
        finally:
            twin.drop()
        first = first_grant_after(fleet, "a", ended, 60)
        time.sleep(config.after_s)
        figures = {
            "refused": 1.0 if reason else 0.0,
            "refusal_s": seconds(launched, ended) if reason else None,
            "live_first_grant_s": seconds(ended, first),
        }
        failed = [] if reason else [f"a second start named a was not refused (exit {code})"]
        if first is None:
            failed.append("a granted nothing after the second start")
        events = [(launched, "second a started"), (ended, "second a exited")]
        return judged(
            "duplicate name", url, config, fleet, figures, events, start,
            failed=failed, notes={"refusal": reason or ""},
        )  # fmt: skip


def clock(scratch: Scratch, config: Config, offset_s: int) -> Outcome:
    """c's clock `offset_s` from the machine's: it joins under the fleet, then leaves."""
    scenario = f"clock {offset_s:+d} s"
    env = {"c": faketime.environment(f"{offset_s:+d}s")}
    with cluster(scratch, scenario, config, env=env) as (url, nodes, fleet):
        start = report.now_ms()
        if not faketime.available():
            return judged(
                scenario, url, config, fleet, dict.fromkeys(CLOCK_FIGURES), [], start,
                failed=[f"{faketime.LIBRARY} is missing (Debian's faketime)"],
            )  # fmt: skip
        start_all(nodes, ("a", "b"))
        fleet.start(("a", "b"))
        time.sleep(config.warm_s)
        launched = report.now_ms()
        ready = start_all(nodes, ("c",))["c"]
        fleet.start(("c",))
        first = first_grant_after(fleet, "c", ready, 600)
        # Past the TTL: a node whose heartbeats stopped (as under libfaketime's faked
        # monotonic clock, see bench/harness/faketime.py) would have been dropped by now.
        time.sleep(max(0.0, config.offset_live_s - (report.now_ms() - ready) / 1000))
        members = nodes["a"].members()
        keys = shares(url, config.rows, NAMES)["c"]
        fleet.paused.add("c")
        stopped = report.now_ms()
        nodes["c"].stop()
        retaken = wait_grant(fleet, keys, stopped, ("a", "b"), 120)
        time.sleep(config.after_s)
        joined = nodes["c"].events("cluster_joined")
        # The node measures the database's clock less its own.
        ahead = -joined[-1]["clock_offset_ms"] / 1000 if joined else None
        failed = []
        if ahead is None or abs(ahead - offset_s) > 5:
            failed.append(f"c's clock was {ahead} s from the database's, not {offset_s}")
        if "c" not in members:
            failed.append(f"c was no longer a member {config.offset_live_s} s after it was ready")
        figures = {
            "first_grant_s": seconds(ready, first),
            "takeover_s": seconds(stopped, retaken),
            "clock_ahead_s": ahead,
        }
        events = [(launched, "c started"), (ready, "c ready"), (stopped, "c SIGTERM")]
        return judged(
            scenario, url, config, fleet, figures, events, start,
            failed=failed, clock_offsets_ms={"c": offset_s * 1000},
        )  # fmt: skip


CLOCK_FIGURES = ("first_grant_s", "takeover_s", "clock_ahead_s")


def renewals(scratch: Scratch, config: Config) -> Outcome:
    """a's fleet holds three times its usual claim, rendering for several leases each."""
    wide = msgspec.structs.replace(config, claim_max=config.claim_max * 3)
    with cluster(scratch, "renewals across a join", wide) as (url, nodes, fleet):
        start = report.now_ms()
        start_all(nodes, ("a", "b"))
        fleet.start(("a",), render_s=config.long_render_s)
        time.sleep(config.warm_s)
        launched = report.now_ms()
        ready = start_all(nodes, ("c",))["c"]
        fleet.start(("c",))
        keys = shares(url, config.rows, NAMES)["c"]
        moved = [x for x in live_at(fleet.history.snapshot(), launched) if x.key in keys]
        # Each moved lease ends by its next renewal's refusal (or its render's end), so
        # within a lease and a half of c's start; then c may grant it.
        first = wait_grant(fleet, {x.key for x in moved}, launched, ("c",), 120)
        time.sleep(config.after_s)
        figures = {
            "not_owner": float(fleet.renewals_refused.get("not_owner", 0)),
            "moved_leases": float(len(moved)),
            "moved_first_grant_s": seconds(launched, first),
            "regrant_margin_s": regrant_margin(fleet.history.snapshot(), moved, ("c",)),
        }
        events = [(launched, "c started"), (ready, "c ready")]
        return judged("renewals across a join", url, wide, fleet, figures, events, start)


class QueueUsage:
    """`pg_notification_queue_usage()` every second, as (ms, share of the queue)."""

    def __init__(self, url: str, every_s: float = 1.0) -> None:
        self.url, self.every_s = url, every_s
        self.samples: list[tuple[int, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            while not self.stop.is_set():
                row = conn.execute("SELECT pg_notification_queue_usage()").fetchone()
                self.samples.append((report.now_ms(), float(row[0]) if row else 0.0))
                self.stop.wait(self.every_s)

    def __enter__(self) -> QueueUsage:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def worker_stopped(scratch: Scratch, config: Config) -> Outcome:
    with cluster(scratch, "worker 0 stopped", config) as (url, nodes, fleet):
        start = report.now_ms()
        start_all(nodes)
        fleet.start(NAMES)
        time.sleep(config.warm_s)
        keys = shares(url, config.rows, NAMES)["c"]
        pid = nodes["c"].worker0_pid()
        with QueueUsage(url) as usage:
            stopped = report.now_ms()
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(config.stop_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            resumed = report.now_ms()
            first = first_grant_after(fleet, "c", resumed, 120)
            time.sleep(config.after_s)
        leases = fleet.history.snapshot()
        span, gap = grants_span(leases, ("a", "b"), stopped, resumed)
        usage_max = max((u for at, u in usage.samples if stopped <= at <= resumed), default=None)
        figures = {
            "queue_usage_max_pct": None if usage_max is None else usage_max * 100,
            "others_granting_s": span,
            "others_longest_gap_s": gap,
            "taken_over_s": seconds(
                stopped,
                min(
                    (x.answered_ms for x in grants_of(leases, keys, ("a", "b"), stopped, resumed)),
                    default=None,
                ),
            ),
            "resume_first_grant_s": seconds(resumed, first),
        }
        events = [(stopped, "c worker 0 SIGSTOP"), (resumed, "SIGCONT")]
        return judged("worker 0 stopped", url, config, fleet, figures, events, start)


SCENARIOS: tuple[tuple[str, Callable[[Scratch, Config], Outcome]], ...] = (
    ("cold start", cold_start),
    ("join", join),
    ("sigkill", sigkill),
    ("rolling restart", rolling),
    ("blackhole 15 s", lambda scratch, config: blackhole(scratch, config, 15, "blackhole 15 s")),
    (
        "blackhole past the TTL",
        lambda scratch, config: blackhole(
            scratch, config, config.long_blackhole_s, "blackhole past the TTL"
        ),
    ),
    ("leave", leave),
    ("sigkill all", kill_all),
    ("duplicate name", duplicate),
    ("clock +30 s", lambda scratch, config: clock(scratch, config, 30)),
    ("clock -30 s", lambda scratch, config: clock(scratch, config, -30)),
    ("renewals across a join", renewals),
    ("worker 0 stopped", worker_stopped),
)
# The scenarios `make test` proves on its own nodes (the test named beside each): a quick
# run, which CI makes after the tests, leaves them out and says so. The full run has all.
_CLUSTER_FAULTS = "tests/test_cluster_faults.py"
TESTED_BY: dict[str, tuple[str, str]] = {
    "cold start": (
        _CLUSTER_FAULTS,
        "test_a_fresh_cluster_on_default_settings_grants_within_seconds",
    ),
    "join": (
        _CLUSTER_FAULTS,
        "test_a_join_hands_over_live_leases_and_refuses_renewals_of_moved_keys",
    ),
    "sigkill": (
        _CLUSTER_FAULTS,
        "test_a_node_killed_silent_is_waited_out_by_its_lease_ceiling_not_max_lease",
    ),
    "blackhole 15 s": (
        "tests/test_store_postgres_blackhole.py",
        "test_a_node_answers_health_and_metrics_through_a_blackhole_and_claims_after",
    ),
    "leave": (
        _CLUSTER_FAULTS,
        "test_a_stopped_nodes_completions_land_through_its_hand_over_and_its_restart_keeps_the_rest",
    ),
    "duplicate name": (
        "tests/test_cluster.py",
        "test_a_node_naming_a_peer_waits_for_it_and_a_taken_name_is_refused",
    ),
    "clock +30 s": (_CLUSTER_FAULTS, "test_a_node_whose_clock_is_set_apart_grants_no_key_twice"),
    "clock -30 s": (_CLUSTER_FAULTS, "test_a_node_whose_clock_is_set_apart_grants_no_key_twice"),
    "renewals across a join": (
        _CLUSTER_FAULTS,
        "test_a_join_hands_over_live_leases_and_refuses_renewals_of_moved_keys",
    ),
    "worker 0 stopped": (
        _CLUSTER_FAULTS,
        "test_a_node_whose_keeper_stops_gives_its_share_up_and_takes_it_back",
    ),
}


# --- the report --------------------------------------------------------------------------


class _NotRun(dict[str, float | None]):
    """A scenario a quick run left out: every figure asked of it is None."""

    def __missing__(self, key: str) -> None:
        return None


def figures_of(outcomes: Sequence[Outcome]) -> list[report.Figure]:
    """The table's rows, for the scenarios that ran."""
    ran = {o.scenario: o for o in outcomes}
    not_run = Outcome(scenario="", figures=_NotRun(), double_grants=0, rows_lost=0, grants=0,
                      renewals_refused={}, completions_pending=0, events=[], start_ms=0,
                      end_ms=0)  # fmt: skip
    by = {name: ran.get(name, not_run) for name, _ in SCENARIOS}
    rows: list[report.Figure] = []

    def add(
        scenario: str,
        what: str,
        value: float | None,
        target: str,
        unit: str = "s",
        better: report.Better = "lower",
    ) -> None:
        if scenario not in ran:
            return
        rows.append(report.Figure(table=TABLE, what=f"{scenario}: {what}", unit=unit,
                                  ours=value, target=target, better=better))  # fmt: skip

    add(
        "cold start",
        "first grant after every node is ready",
        by["cold start"].figures["first_grant_s"],
        "<= 5",
    )
    add(
        "join",
        "joiner's first grant after it is ready",
        by["join"].figures["first_grant_s"],
        "<= 5",
    )
    kill = by["sigkill"].figures
    add("sigkill", "takeover of the dead node's keys", kill["takeover_s"], "after its leases end")
    add("sigkill", "the dead node's last lease ends", kill["lease_horizon_s"], "")
    add("sigkill", "the lease ceiling the dead node published", kill["ceiling_s"], "")
    add("sigkill", "worst case without it", kill["worst_case_s"], "")
    roll = by["rolling restart"].figures
    add("rolling restart", "a node's share dark (stop to first grant)", roll["dark_s"], "<= 10")
    add("rolling restart", "cluster queue-state 503, longest", roll["queue_state_503_s"], "<= 15")
    # Refused ones too: a node between its leave and its next start is no member, so the
    # others answer its leases' completions `lease_not_held`.
    unlanded = sum(by["rolling restart"].unlanded.values())
    add("rolling restart", "completions that never landed", unlanded, "0", unit="")
    for name in ("blackhole 15 s", "blackhole past the TTL"):
        got = by[name].figures
        add(name, "slowest node's first grant after the heal", got["first_grant_s"], "<= 10")
    left = by["leave"].figures
    add(
        "leave",
        "the leaver's keys first granted elsewhere (from its SIGTERM)",
        left["takeover_s"],
        "<= 5",
    )
    add(
        "leave",
        "a lease it handed over: its key granted again after the lease's end, earliest",
        left["handover_margin_s"],
        ">= 0",
        better="higher",
    )
    add("leave", "its leases live at the stop", left["leases_at_stop"], "", unit="")
    add("leave", "completions of its leases that never landed", left["unlanded"], "0", unit="")
    every = by["sigkill all"].figures
    add(
        "sigkill all",
        "nodes that adopted their killed run's lease table",
        every["adopted"],
        "3",
        unit="",
        better="higher",
    )
    add("sigkill all", "all ready again (from the kill)", every["ready_s"], "")
    add(
        "sigkill all",
        "slowest node's first grant after all are ready",
        every["first_grant_s"],
        "<= 5",
    )
    add(
        "sigkill all",
        "first grant of a key leased at the kill (from the kill)",
        every["takeover_s"],
        "after its lease ends",
    )
    add(
        "sigkill all",
        "the killed run's last lease ends (from the kill)",
        every["lease_horizon_s"],
        "",
    )
    add(
        "sigkill all",
        "a key leased at the kill granted again after that lease's end, earliest",
        every["regrant_margin_s"],
        ">= 0",
        better="higher",
    )
    twin = by["duplicate name"].figures
    add(
        "duplicate name",
        "second start under a live node's name refused (1 = yes)",
        twin["refused"],
        "1",
        unit="",
        better="higher",
    )
    add("duplicate name", "its refusal (from its start)", twin["refusal_s"], "")
    add(
        "duplicate name",
        "the live node's first grant after the refusal",
        twin["live_first_grant_s"],
        "<= 5",
    )
    for name in ("clock +30 s", "clock -30 s"):
        got = by[name].figures
        add(
            name,
            "offset node's clock ahead of the database's, as it measured",
            got["clock_ahead_s"],
            name.removeprefix("clock "),
            better="higher",
        )
        add(name, "offset node's first grant after it is ready", got["first_grant_s"], "<= 5")
        add(name, "its keys first granted elsewhere after its SIGTERM", got["takeover_s"], "<= 5")
    moved = by["renewals across a join"].figures
    add(
        "renewals across a join",
        "renewals refused not_owner",
        moved["not_owner"],
        "> 0",
        unit="",
        better="higher",
    )
    add(
        "renewals across a join",
        "a's leases on keys that moved to c",
        moved["moved_leases"],
        "",
        unit="",
    )
    add(
        "renewals across a join",
        "c's first grant of a moved key (from c's start)",
        moved["moved_first_grant_s"],
        "",
    )
    add(
        "renewals across a join",
        "a moved key granted by c after its lease at a ended, earliest",
        moved["regrant_margin_s"],
        ">= 0",
        better="higher",
    )
    stop = by["worker 0 stopped"].figures
    add(
        "worker 0 stopped",
        "NOTIFY queue in use while stopped, max",
        stop["queue_usage_max_pct"],
        "",
        unit="%",
    )
    add(
        "worker 0 stopped",
        "a and b granting through the stop (to their last grant)",
        stop["others_granting_s"],
        "the whole stop",
        better="higher",
    )
    add(
        "worker 0 stopped",
        "a and b's longest stretch without a grant during it",
        stop["others_longest_gap_s"],
        "<= 5",
    )
    add(
        "worker 0 stopped",
        "its keys first granted elsewhere, after the SIGSTOP",
        stop["taken_over_s"],
        "within the stop",
    )
    add("worker 0 stopped", "its first grant after SIGCONT", stop["resume_first_grant_s"], "<= 10")
    for outcome in outcomes:
        add(outcome.scenario, "keys granted twice", outcome.double_grants, "0", unit="")
        add(
            outcome.scenario,
            "keys held twice in the nodes' journals",
            outcome.node_double_holds,
            "0",
            unit="",
        )
        add(outcome.scenario, "grants no node recorded", outcome.unrecorded, "0", unit="")
        add(outcome.scenario, "rows lost", outcome.rows_lost, "0", unit="")
    return rows


def chart(result: report.SectionResult, outcomes: Sequence[Outcome]) -> Path:
    import matplotlib.pyplot as plt

    from bench.harness.charts import save

    rows = (len(outcomes) + 1) // 2
    figure, grid = plt.subplots(rows, 2, figsize=(16, 2.6 * rows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[len(outcomes) :]:
        ax.set_visible(False)
    for ax, outcome in zip(axes, outcomes, strict=False):
        for name, counts in outcome.flow.items():
            ax.step(range(len(counts)), counts, where="post", label=name)
        for at, what in outcome.events:
            x = (at - outcome.start_ms) / 1000
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
            ax.text(x, ax.get_ylim()[1] * 0.9, what, fontsize=7, rotation=90, va="top")
        ax.set_title(
            f"{outcome.scenario}: {outcome.grants:,} grants, {outcome.double_grants} double",
            fontsize=9,
        )
        ax.set_ylabel("grants/s")
        ax.legend(fontsize=7, loc="upper right")
    for ax in axes[max(0, len(outcomes) - 2) : len(outcomes)]:
        ax.set_xlabel("seconds since the scenario began")
    return save(figure, result, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench faults", description=__doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small and fast, and only the scenarios the test suite does not run (TESTED_BY)",
    )
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    result = report.new_result("faults", args.quick)
    down = reachable(*host_port(server_url()))
    if down:
        report.progress(f"faults: FAILED: PostgreSQL {down}; the section needs it")
        return 1
    scratch = Scratch()
    outcomes: list[Outcome] = []
    try:
        for name, scenario in SCENARIOS:
            if args.quick and name in TESTED_BY:
                path, test = TESTED_BY[name]
                report.progress(f"faults: {name}: left out of a quick run ({path}::{test})")
                continue
            report.progress(f"faults: {name} ...")
            outcomes.append(scenario(scratch, config))
    finally:
        scratch.drop_all()
    result.figures = figures_of(outcomes)
    result.promised = [f.key for f in result.figures]
    result.raw = {
        "config": msgspec.to_builtins(config),
        "outcomes": [msgspec.to_builtins(o) for o in outcomes],
    }
    result.raw["chart"] = str(chart(result, outcomes))
    status = report.emit(result)
    broken = [
        o.scenario
        for o in outcomes
        if o.double_grants
        or o.node_double_holds
        or o.unrecorded
        or o.rows_lost
        or not o.grants
        or o.failed
    ]
    if broken:
        report.progress(
            "faults: FAILED: a key granted twice, a row lost, nothing granted or the "
            f"scenario's own check broken in {broken}"
        )
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
