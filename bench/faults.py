"""The cluster under faults: real nodes on one PostgreSQL, a simulated fleet, a history.

`python -m bench faults [--quick]` (or `python -m bench.faults [--quick]`)

Each scenario gets a scratch database (`rq_bench_<pid>_faults_<scenario>`, dropped at
the end) of due rows, three nodes (`renderqueue serve --workers 1 --node NAME`) and a
fleet: threads that claim from their node, render for a while, renew at half-lease and
complete, each recording what it saw into one history (bench.history). At the end the
history is checked (no key held by two at once) and the table counted (no row lost).

Scenarios, on default settings unless named:
- cold start: three nodes started at once; the time from every node ready to its first
  grant (their default `max_lease_s` is 300 s: a worst-case fence would show here).
- join: c joins a and b under the fleet, whose renders outlast their leases (renewals
  across the join); the time from c ready to its first grant, and renewals refused as
  `not_owner` at the old owners.
- SIGKILL: one of three killed whole under the fleet (fast membership: dead after 4 s,
  leases of at most 10 s, so the worst case ends within the run): the time to the first
  grant of one of its keys by a survivor, beside its real lease horizon and the worst
  case the survivors wait for.
- rolling restart: each node in turn SIGTERMed and started again under the fleet; per
  restart, how long its share went ungranted (from the stop to its first grant after
  the start), how long the cluster queue-state answered 503, and whether every
  completion of a lease it granted before the stop landed.
- blackhole: every node reaches PostgreSQL through a TCP proxy of its own, and every
  proxy stops forwarding (connections open, nothing reset) for 15 s, then for 60 s
  (quick: 30 s, past the TTL, so each node sees the others, or itself, dead on its
  return); per node, the time from the heal to its first grant.

The chart shows each scenario's grants per node over time, with its events marked.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec

from bench import report
from bench.history import HeldLease, History, double_grants, grants_by_node
from bench.node import ADMIN_TOKEN, FLEET_TOKEN, REPO, Node, NodeClient
from bench.peer_base import reachable
from bench.postgres import Scratch, db_url, host_port, server_url
from bench.tcp_proxy import TcpProxy

NAMES = ("a", "b", "c")
FAST = ("--heartbeat-s", "0.5", "--node-ttl-s", "4", "--max-lease-s", "10")
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


FULL = Config(
    rows=20_000,
    threads_per_node=3,
    claim_max=5,
    lease_s=6,
    render_s=(0.3, 9.0),
    warm_s=8.0,
    after_s=10.0,
    long_blackhole_s=60.0,
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
)


# --- the nodes ---------------------------------------------------------------------------


class FaultNode(Node):
    """One node of the cluster; its instance stays across restarts (its lease snapshot)."""

    def __init__(self, name: str, url: str, args: Sequence[str] = ()) -> None:
        super().__init__(None, db=url, load=False)
        self.name = name
        self.args = tuple(args)
        self.instance = f"rqbf{os.getpid()}{name}{int(time.time())}"
        self.instances.add(self.instance)

    def launch(self) -> None:
        command = [
            sys.executable, "-m", "workers.cli", "serve", "--db", self.db,
            "--port", str(self.port), "--workers", "1", "--node", self.name,
            "--instance", self.instance, *self.args,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            command,
            cwd=REPO,
            env=self.environment(self.instance),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

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
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def start(self, names: Sequence[str]) -> None:
        for name in names:
            for index in range(self.config.threads_per_node):
                thread = threading.Thread(
                    target=self._run, args=(name, f"{name}-{index}"), daemon=True
                )
                thread.start()
                self._threads.append(thread)

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

    def _run(self, name: str, who: str) -> None:
        rng = random.Random(who)
        while not self.stop.is_set():
            if name in self.paused:
                time.sleep(0.05)
                continue
            asked = report.now_ms()
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
                        x["key"], x.get("node") or name, who, asked, answered, ends(x, asked)
                    ),
                    x["token"],
                    answered + int(rng.uniform(*self.config.render_s) * 1000),
                )
                for x in body["leases"]
            ]
            self._render(name, held)

    def _render(self, name: str, held: list[tuple[HeldLease, str, int]]) -> None:
        """Renew at half-lease until each render is done, then complete; a render whose
        renewal is refused, or whose lease is about to end, is abandoned."""
        lease_ms = self.config.lease_s * 1000
        while held and not self.stop.is_set():
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
        while pending and not self.stop.is_set():
            sent = report.now_ms()
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
                pending = left
            if pending:
                time.sleep(0.2)
        with self._lock:
            self.completions_pending += len(pending)


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
    grants: int
    renewals_refused: dict[str, int]
    completions_pending: int
    events: list[tuple[int, str]]  # (ms, what), for the chart
    start_ms: int
    end_ms: int
    flow: dict[str, list[int]] = {}  # grants per node per second


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
                        key=f"https://site{i % 50}.example/p/{i:07d}",
                        route="product",
                        cadence_s=3600,
                        next_render_at=now - 1000 - i,
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
) -> Iterator[tuple[str, dict[str, FaultNode], Fleet]]:
    """`proxies`: filled with a TCP proxy per node, each node's way to the database."""
    url = db_url(scratch.create(f"faults_{scenario.replace(' ', '_').lower()}"))
    seed(url, config.rows)
    host, port = host_port(url)
    urls = {name: url for name in NAMES}
    if proxies is not None:
        for name in NAMES:
            proxy = TcpProxy(host, port).start()
            proxies.append(proxy)
            urls[name] = url.replace(f"{host}:{port}", f"127.0.0.1:{proxy.port}", 1)
    nodes = {name: FaultNode(name, urls[name], args) for name in NAMES}
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
) -> Outcome:
    fleet.close()
    end = report.now_ms()
    leases = fleet.history.snapshot()
    doubles = double_grants(leases)
    for double in doubles[:5]:
        report.progress(f"faults: {scenario}: DOUBLE GRANT {msgspec.json.encode(double).decode()}")
    lost = config.rows - count_rows(url)
    report.progress(
        f"faults: {scenario}: {len(leases):,} grants, {len(doubles)} double, {lost} rows lost, "
        f"renewals refused {fleet.renewals_refused}, figures {figures}"
    )
    return Outcome(
        scenario=scenario,
        figures=figures,
        double_grants=len(doubles),
        rows_lost=lost,
        grants=len(leases),
        renewals_refused=dict(fleet.renewals_refused),
        completions_pending=fleet.completions_pending,
        events=events,
        start_ms=start_ms,
        end_ms=end,
        flow=grants_by_node(leases, NAMES, start_ms, 1000, end),
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
    with cluster(scratch, "sigkill", config, FAST) as (url, nodes, fleet):
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
        worst = killed + (4 + 2 + 10) * 1000  # its heartbeat is at most 0.5 s older
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
        }
        events = [(killed, "c SIGKILLed")]
        return judged("sigkill", url, config, fleet, figures, events, start)


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
)


# --- the report --------------------------------------------------------------------------


def figures_of(outcomes: Sequence[Outcome]) -> list[report.Figure]:
    by = {o.scenario: o for o in outcomes}
    rows: list[report.Figure] = []

    def add(scenario: str, what: str, value: float | None, target: str, unit: str = "s") -> None:
        rows.append(report.Figure(table=TABLE, what=f"{scenario}: {what}", unit=unit,
                                  ours=value, target=target))  # fmt: skip

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
    add("sigkill", "worst case the survivors wait for", kill["worst_case_s"], "")
    roll = by["rolling restart"].figures
    add("rolling restart", "a node's share dark (stop to first grant)", roll["dark_s"], "<= 10")
    add("rolling restart", "cluster queue-state 503, longest", roll["queue_state_503_s"], "<= 15")
    pending = by["rolling restart"].completions_pending
    add("rolling restart", "completions that never landed", pending, "0", unit="")
    for name in ("blackhole 15 s", "blackhole past the TTL"):
        got = by[name].figures
        add(name, "slowest node's first grant after the heal", got["first_grant_s"], "<= 10")
    for outcome in outcomes:
        add(outcome.scenario, "keys granted twice", outcome.double_grants, "0", unit="")
        add(outcome.scenario, "rows lost", outcome.rows_lost, "0", unit="")
    return rows


def chart(result: report.SectionResult, outcomes: Sequence[Outcome]) -> Path:
    import matplotlib.pyplot as plt

    from bench.report_chart import save

    figure, axes = plt.subplots(len(outcomes), 1, figsize=(10, 2.6 * len(outcomes)))
    for ax, outcome in zip(axes, outcomes, strict=True):
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
    axes[-1].set_xlabel("seconds since the scenario began")
    return save(figure, result, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small and fast: proves every row")
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
    broken = [o.scenario for o in outcomes if o.double_grants or o.rows_lost or not o.grants]
    if broken:
        report.progress(
            f"faults: FAILED: a key granted twice, a row lost or nothing granted in {broken}"
        )
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
