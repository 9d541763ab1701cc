"""renderqueue on PostgreSQL: puts and the change feed, NOTIFY's cost, claims through HTTP
beside `FOR UPDATE SKIP LOCKED`, and the keeper's rebuild.

`python -m bench postgres [--quick]` (or `python -m bench.sections.postgres [--quick]`)

Runs on the PostgreSQL at RENDERQUEUE_TEST_PG's server (default 127.0.0.1:5432, trust
auth) in two scratch databases made for the run (`rq_bench_<pid>_a`, `_b`) and dropped
at its end; an unreachable server fails the section. The workload is bench.harness.workload's.

1. Puts (database a: 250k rows, quick 10k). Single-row `PostgresStore.write`s of random
   keys, as bench/sections/store.py makes them (`run_puts`, `tailed_puts`), in rounds of
   interleaved arms: no consumer; a consumer process tailing the feed, flat out and at
   5k writes/s (lag: the writer's monotonic clock after `write` returned, to the
   consumer's poll that delivered the event); and NOTIFY's cost: the same puts with the
   log trigger's NOTIFY off (`-c renderqueue.notify=off` on the writers' connections),
   at 1 writer and at 8 concurrent writer processes. Every connection runs with
   `synchronous_commit = off`, as the SKIP LOCKED peer does (the durability of SQLite's
   WAL + NORMAL); the NOTIFY arms run once more at the server's default (`on`), where a
   commit waits for its WAL flush while holding NOTIFY's lock.
2. Claims through HTTP (database b: 1M rows, quick 30k, 20% due): `renderqueue serve
   --workers 2` on PostgreSQL, claims alone and claim then complete, batches of 10 and
   100, two claimant processes (bench/sections/node.py's claimant), and four at batch 100;
   at batch 100 with two, claim then complete once more with the completions carried on
   the next claim, as the fleet client sends them; beside them, on the same
   server in the same run, the SKIP LOCKED peer's arms (bench/peers/sql.py through
   bench/sections/peers.py's arm runner) on its own table of the same rows. Both are up at once
   and their arms alternate, the peer's then ours for each mode and batch, with both
   tables vacuumed before each arm (outside its measurement).
3. Rebuild: a keeper thread (bench/peers/renderqueue.LocalNode, the node's config) from
   start to live and exact, at both databases' sizes, each freshly loaded through
   `PostgresStore.write` in batches of 5,000.

CPU is each process's own: the writers', consumers' and claimants' (process CPU), the
node's workers' (psutil), and PostgreSQL's backends: a meter process samples every
backend of the scratch databases (pg_stat_activity, psutil) every 50 ms, so a backend
that exits loses at most its last 50 ms; backends are told apart by application name
and by which of our processes holds the other end of their socket. Beside it, the CPU
of every PostgreSQL process (the postmaster's children, live and reaped: the WAL writer
and checkpointer too, and other users' backends if any) over the same interval.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import random
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from bench.harness import report
from bench.harness.postgres import (
    Meter,
    Scratch,
    ServerUse,
    client_ports,
    db_url,
    host_port,
    server_url,
)
from bench.harness.workload import Rows, Workload, due_count, generate, reachable
from bench.sections.store import PACED_INTERVAL_NS, TAG_BASE, Arm, run_puts, tailed_puts

OURS = "renderqueue on PostgreSQL"
SKIP_LOCKED = "PostgreSQL SKIP LOCKED"
NOTIFY_OFF = "NOTIFY off"
BATCHES = (10, 100)
CLAIMANTS = 2
# (complete, batch, claimant processes, carried), in the order the arms run. Two
# claimants leave the node waiting on each claim's round trips; four load both contenders
# to saturation on this machine, as a fleet of many renderers would. Carried: our
# claimants send each batch's completions on their next claim, as the fleet client does
# (the peer's arm beside it is its claim then complete again, which has no such choice).
SHAPES = (
    (False, 10, CLAIMANTS, False),
    (False, 100, CLAIMANTS, False),
    (False, 100, 4, False),
    (True, 10, CLAIMANTS, False),
    (True, 100, CLAIMANTS, False),
    (True, 100, CLAIMANTS, True),
    (True, 100, 4, False),
)
TARGETS = {False: 1.5, True: 1.0}  # ours ÷ SKIP LOCKED keys/s at batch 100, by `complete`
# The node's backends with a role of their own, by application name, on rows of their own.
_BACKEND_ROLES = {"renderqueue-feed": " (keeper's feed)", "renderqueue-prune": " (log pruning)"}


class Config(msgspec.Struct, frozen=True, kw_only=True):
    put_rows: int  # database a: the puts, and the smaller rebuild
    node_rows: int  # database b: the claims, and the larger rebuild
    rounds: int
    writes: int  # per one-writer arm per round (the paced arm: half)
    writes_each: int  # per writer per round in the many-writer arms
    durable_writes: int  # per one-writer arm per round at synchronous_commit = on
    durable_writes_each: int
    warmup: int
    writers: int = 8
    arm_max_keys: int
    arm_max_s: float


FULL = Config(
    put_rows=250_000,
    node_rows=1_000_000,
    rounds=3,
    writes=5000,
    writes_each=1000,
    durable_writes=500,
    durable_writes_each=150,
    warmup=200,
    arm_max_keys=40_000,
    arm_max_s=20.0,
)
QUICK = Config(
    put_rows=10_000,
    # Claimants stop on whole batches, so an arm takes up to a batch a claimant more than
    # its share: the due rows leave room for that in every arm, the last included.
    node_rows=30_000,
    rounds=1,
    writes=400,
    writes_each=60,
    durable_writes=40,
    durable_writes_each=15,
    warmup=30,
    arm_max_keys=2_000,
    arm_max_s=4.0,
)


class PutArm(NamedTuple):
    name: str
    writers: int
    notify: bool
    durable: bool  # synchronous_commit = on (the server's default) rather than off
    tailing: str = ""  # "": no consumer; "flat": the writer flat out; "paced": 5k writes/s


PUT_ARMS = (
    PutArm("1 writer, no consumer", 1, True, False),
    PutArm("1 writer, no consumer, NOTIFY off", 1, False, False),
    PutArm("1 writer, consumer tailing", 1, True, False, "flat"),
    PutArm("1 writer, consumer tailing, 5k writes/s", 1, True, False, "paced"),
    PutArm("8 writers, no consumer", 8, True, False),
    PutArm("8 writers, no consumer, NOTIFY off", 8, False, False),
    PutArm("1 writer, synchronous_commit on", 1, True, True),
    PutArm("1 writer, synchronous_commit on, NOTIFY off", 1, False, True),
    PutArm("8 writers, synchronous_commit on", 8, True, True),
    PutArm("8 writers, synchronous_commit on, NOTIFY off", 8, False, True),
)


# --- 1. puts --------------------------------------------------------------------------------


def writer_process(conn: Connection, warmup: int, seed: int) -> None:
    """One of the many writers: on each command, puts through a store at the command's
    URL (`run_puts`), reports, and keeps its connection until told the meter is done."""
    from store.postgres import PostgresStore

    stores: dict[str, Any] = {}
    rng = random.Random(seed)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "exit":
            break
        url, keys, count, tag0 = command
        if url not in stores:
            for old in stores.values():
                old.close()
            stores = {url: PostgresStore(url)}
        store = stores[url]
        run_puts(store, keys, warmup, 0, tag0, rng, Arm())  # warm-up, not measured
        conn.send("warm")
        conn.recv()  # go
        arm = Arm()
        started = time.perf_counter()
        run_puts(store, keys, count, 0, tag0 + warmup, rng, arm)
        finished = time.perf_counter()
        conn.send_bytes(
            msgspec.msgpack.encode(
                {"put_ns": arm.put_ns, "cpu_s": arm.cpu_s, "t0": started, "t1": finished}
            )
        )
        conn.recv()  # measured: the connection may go idle
    for store in stores.values():
        store.close()


class Writers:
    """`count` writer processes, kept for the run (spawning eight per arm would cost more
    than an arm's writes)."""

    def __init__(self, ctx: Any, count: int, warmup: int) -> None:
        self.pipes: list[Connection] = []
        self.processes = []
        for i in range(count):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=writer_process, args=(theirs, warmup, 100 + i))
            process.daemon = True
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def run(
        self, url: str, keys: list[str], count: int, tag0: int, meter: Meter, datname: str
    ) -> tuple[list[int], float, float, ServerUse]:
        """Every writer puts `count` rows of its own share of `keys`, released together;
        returns the put times, the wall time, the writers' CPU and the server's."""
        n = len(self.pipes)
        for i, pipe in enumerate(self.pipes):
            pipe.send((url, keys[i::n], count, tag0 + i * 10**9))
        for pipe in self.pipes:
            assert pipe.recv() == "warm"
        with meter.measure(datname) as used:
            for pipe in self.pipes:
                pipe.send("go")
            reports = [msgspec.msgpack.decode(pipe.recv_bytes()) for pipe in self.pipes]
        for pipe in self.pipes:
            pipe.send("done")
        put_ns = [ns for r in reports for ns in r["put_ns"]]
        wall = max(r["t1"] for r in reports) - min(r["t0"] for r in reports)
        return put_ns, wall, sum(r["cpu_s"] for r in reports), used[0]

    def close(self) -> None:
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            with contextlib.suppress(OSError):
                pipe.send("exit")
            process.join(10)
            if process.is_alive():
                process.kill()


class PutTotals(msgspec.Struct, kw_only=True):
    server_s: float = 0.0  # the scratch database's backends
    all_s: float = 0.0  # every PostgreSQL process
    feed_s: float = 0.0  # the consumer's feed connection's backend


def run_puts_part(
    config: Config, datname: str, rows: Rows, meter: Meter, ctx: Any
) -> tuple[dict[str, Arm], dict[str, PutTotals]]:
    from store.postgres import PostgresStore

    keys = rows.keys
    rng = random.Random(11)
    arms = {arm.name: Arm() for arm in PUT_ARMS}
    totals = {arm.name: PutTotals() for arm in PUT_ARMS}
    stores: dict[str, Any] = {}

    def url_of(arm: PutArm) -> str:
        settings = {"synchronous_commit": "on" if arm.durable else "off"}
        if not arm.notify:
            settings["renderqueue.notify"] = "off"
        return db_url(datname, **settings)

    writers = Writers(ctx, config.writers, config.warmup)
    tag = TAG_BASE
    try:
        for round_no in range(config.rounds):
            order = list(PUT_ARMS) if round_no % 2 == 0 else list(reversed(PUT_ARMS))
            for spec in order:
                report.progress(
                    f"postgres: puts, round {round_no + 1}/{config.rounds}, {spec.name}"
                )
                arm, total = arms[spec.name], totals[spec.name]
                url = url_of(spec)
                if spec.writers > 1:
                    count = config.durable_writes_each if spec.durable else config.writes_each
                    put_ns, wall, cpu_s, used = writers.run(url, keys, count, tag, meter, datname)
                    tag += 10**11
                    arm.put_ns.extend(put_ns)
                    arm.seconds += wall
                    arm.cpu_s += cpu_s
                    arm.writes += len(put_ns)
                else:
                    store = stores.get(url)
                    if store is None:
                        store = stores[url] = PostgresStore(url)
                    count = config.durable_writes if spec.durable else config.writes
                    if spec.tailing == "paced":
                        count //= 2
                    with meter.measure(datname) as measured:
                        if spec.tailing:
                            tailed_puts(
                                ctx,
                                url,
                                store,
                                keys,
                                count,
                                config.warmup,
                                tag,
                                rng,
                                arm,
                                interval_ns=PACED_INTERVAL_NS if spec.tailing == "paced" else 0,
                            )
                        else:
                            run_puts(store, keys, count, config.warmup, tag, rng, arm)
                    used = measured[0]
                    tag += config.warmup + count
                    total.feed_s += used.by_app("renderqueue-feed")
                total.server_s += used.backends_s
                total.all_s += used.all_s
                arm.end_round()
    finally:
        writers.close()
        for store in stores.values():
            store.close()
    return arms, totals


# --- 2. claims through HTTP -----------------------------------------------------------------


class ClaimArm(msgspec.Struct, kw_only=True):
    peer: str
    batch: int
    complete: bool
    claimants: int = CLAIMANTS
    carried: bool = False  # our completions rode on the next claim (bench.sections.node)
    keys: int
    seconds: float
    keys_per_s: float
    claim_p50_us: float | None
    claim_p99_us: float | None
    complete_p50_us: float | None
    granted_twice: int
    cpu_s: dict[str, float]  # by process group, over the arm
    all_postgres_s: float

    @property
    def mode(self) -> str:
        if self.carried:
            return "claim then complete, carried on claims"
        return "claim then complete" if self.complete else "claims alone"

    @property
    def shape(self) -> str:
        """As the figures name it: `claims alone, batch 100` (and the claimants, if not two)."""
        more = "" if self.claimants == CLAIMANTS else f", {self.claimants} claimants"
        return f"{self.mode}, batch {self.batch}{more}"

    def cpu_us_per_key(self, group: str) -> float | None:
        value = self.cpu_s.get(group)
        return None if value is None or not self.keys else value / self.keys * 1e6


def run_claims(
    config: Config, datname: str, rows: Rows, meter: Meter, raw: dict[str, Any]
) -> list[ClaimArm]:
    """SKIP LOCKED and the node side by side on one database, their arms interleaved (the
    peer's, then ours, for each mode and batch), so a change in the machine's load during
    the run falls on both alike. The node idles through the peer's arms."""
    from bench.harness.node import Node
    from bench.peers.sql import PostgresPeer
    from bench.sections import peers

    peer = PostgresPeer(dsn=db_url(datname))
    node = Node(rows, db=db_url(datname, synchronous_commit="off"), load=False)
    out: list[ClaimArm] = []
    ok = False
    try:
        report.progress(f"postgres: {SKIP_LOCKED}: loading {len(rows):,} rows (COPY)")
        peer.load(rows)
        spec = peer.spec()
        arm_config = peers.Config(
            rows=len(rows), growth=(), arm_max_keys=config.arm_max_keys, arm_max_s=config.arm_max_s
        )
        started = time.perf_counter()
        node.start()
        raw["node_start_to_live_s"] = round(time.perf_counter() - started, 2)
        report.progress(f"postgres: node live and exact in {raw['node_start_to_live_s']} s")
        raw["load_log_pruned"] = prune_log(datname)
        worker_of = node.worker_of()
        processes = {f"node {label}": process for label, process in node.processes().items()}
        ports = client_ports({p.pid: label for label, p in processes.items()})
        per_arm = per_arm_keys(config, rows)
        granted: list[str] = []  # claims alone: leases outlive the run, so no key twice
        for complete, batch, claimants, carried in SHAPES:
            vacuum(datname, peer.table)
            out.append(
                peer_arm(
                    spec, batch, complete, claimants, carried, per_arm, arm_config, datname, meter
                )
            )
            vacuum(datname, peer.table)
            ours = node_arm(
                config, node, worker_of, processes, ports, batch, complete, claimants, carried,
                per_arm, datname, meter, granted,
            )  # fmt: skip
            out.append(ours)
        raw["claims_alone_granted_twice_across_arms"] = len(granted) - len(set(granted))
        ok = True
    finally:
        node.stop()
        if ok:
            node.drop()
        else:
            report.progress(f"postgres: the node's log is in {node.dir}")
        peer.drop()
    return out


def prune_log(datname: str) -> int:
    """The change log's entries of the load, removed before the arms (the keeper has read
    them): the node prunes every few seconds, and a round over a million loaded entries
    would be charged to whichever arm it fell in."""
    from store.postgres.store import PostgresStore

    store = PostgresStore(db_url(datname), prune_interval_s=None)
    try:
        removed = store.prune()
    finally:
        store.close()
    report.progress(f"postgres: pruned the load's {removed:,} change log entries")
    return removed


def vacuum(datname: str, peer_table: str) -> None:
    """Both contenders' tables vacuumed before an arm, outside its measurement: the arm
    before left dead rows (claims and completions update rows), and autovacuum cleaning
    them up during the next arm would be charged to whichever contender ran then."""
    import psycopg

    with psycopg.connect(db_url(datname), autocommit=True) as conn:
        for table in ("render_schedule", "change_log", peer_table):
            conn.execute(f"VACUUM (ANALYZE) {table}")


def peer_arm(
    spec: Any,
    batch: int,
    complete: bool,
    claimants: int,
    carried: bool,
    per_arm: int,
    arm_config: Any,
    datname: str,
    meter: Meter,
) -> ClaimArm:
    """`carried` only names the arm: it stands beside our carried arm."""
    from bench.sections import peers

    with meter.measure(datname) as used:
        arm = peers.run_arm(spec, batch, complete, per_arm, arm_config, claimants)
    server = used[0]
    cpu = {"claimants": arm.claimant_cpu_s, "PostgreSQL backends": server.backends_s}
    result = claim_arm(SKIP_LOCKED, arm, claimants, cpu, server.all_s, carried)
    report.progress(f"postgres: {SKIP_LOCKED}: {result.shape}: {arm.keys_per_s:,.0f} keys/s")
    return result


def node_arm(
    config: Config,
    node: Any,
    worker_of: dict[int, int],
    processes: dict[str, Any],
    ports: dict[int, str],
    batch: int,
    complete: bool,
    claimants: int,
    carried: bool,
    per_arm: int,
    datname: str,
    meter: Meter,
    granted: list[str],
) -> ClaimArm:
    from bench.sections.node import run_our_arm

    keys_out: list[str] = []
    with meter.measure(datname) as used:
        arm = run_our_arm(
            node.port,
            batch,
            claimants,
            per_arm,
            config.arm_max_s,
            worker_of,
            complete=complete,
            carry=carried,
            keys_out=keys_out,
            node_processes=processes,
        )
    server = used[0]
    if arm.not_ok:  # leases outlast the arm (LEASE_S): a refusal is the bench's own fault
        raise RuntimeError(f"postgres: {arm.not_ok} completions refused in one of our arms")
    if not complete:
        granted += keys_out
    # A worker's pool may open connections during the arm: learn their ports now, while
    # the pool still holds them, so their backends count as that worker's, not "other".
    ports = {**ports, **client_ports({p.pid: label for label, p in processes.items()})}
    cpu = dict(arm.node_cpu_s)
    cpu["claimants"] = arm.claimant_cpu_s or 0.0
    cpu["PostgreSQL backends"] = server.backends_s
    for backend in server.backends:
        owner = ports.get(backend.client_port, "other")
        group = f"backends of {owner}" + _BACKEND_ROLES.get(backend.app, "")
        cpu[group] = cpu.get(group, 0.0) + backend.cpu_s
    cpu_s = {k: round(v, 4) for k, v in cpu.items()}
    result = claim_arm(OURS, arm, claimants, cpu_s, server.all_s, carried)
    report.progress(
        f"postgres: {OURS}: {result.shape}: "
        f"{arm.keys_per_s:,.0f} keys/s, claim p50 {arm.claim_p50_us} us"
    )
    return result


def claim_arm(
    peer: str,
    arm: Any,
    claimants: int,
    cpu_s: dict[str, float],
    all_postgres_s: float,
    carried: bool,
) -> ClaimArm:
    """One arm's record from either runner's result (bench.sections.peers' or
    bench.sections.node's, which
    name their figures alike)."""
    return ClaimArm(
        peer=peer,
        batch=arm.batch,
        complete=arm.complete,
        claimants=claimants,
        carried=carried,
        keys=arm.keys,
        seconds=arm.seconds,
        keys_per_s=arm.keys_per_s,
        claim_p50_us=arm.claim_p50_us,
        claim_p99_us=arm.claim_p99_us,
        complete_p50_us=arm.complete_p50_us,
        granted_twice=arm.granted_twice,
        cpu_s=cpu_s,
        all_postgres_s=all_postgres_s,
    )


def per_arm_keys(config: Config, rows: Rows) -> int:
    """Each contender's arms together take at most six sevenths of the due rows, so none
    runs dry."""
    return min(
        config.arm_max_keys, due_count(rows, time.time_ns() // 1_000_000) // (len(SHAPES) + 1)
    )


# --- 3. rebuild -----------------------------------------------------------------------------


def rebuild(url: str, rows: int) -> dict[str, float]:
    """A keeper thread from start to its first publish and to live and exact."""
    from bench.peers.renderqueue import LocalNode

    node = LocalNode(db=url)
    try:
        generation = node.segments.ring.generation
        since = time.time_ns() // 1_000_000
        started = time.monotonic()
        node.start_keeper()
        node.wait_publish(generation, 600)
        first = time.monotonic() - started
        node.wait_exact(since, 1800)
        exact = time.monotonic() - started
        held = node.keeper.statistics().held
    finally:
        node.close()
    if held != rows:
        raise RuntimeError(f"rebuild: the keeper holds {held:,} rows, the table {rows:,}")
    report.progress(
        f"postgres: rebuild at {rows:,} rows: first publish {first:.2f} s, exact {exact:.2f} s"
    )
    return {"first_publish_s": round(first, 3), "exact_s": round(exact, 3)}


# --- the report -----------------------------------------------------------------------------


def scale(rows: int) -> str:
    return f"{rows / 1e6:g}M" if rows >= 1_000_000 else f"{rows // 1000}k"


def everything_us(arm: Arm, total: PutTotals) -> float:
    """CPU per write of the arm's own processes and every PostgreSQL process."""
    return (arm.cpu_s + total.all_s) / arm.writes * 1e6 if arm.writes else float("nan")


def put_figures(
    config: Config, arms: dict[str, Arm], totals: dict[str, PutTotals]
) -> list[report.Figure]:
    out: list[report.Figure] = []
    table = (
        f"Puts on PostgreSQL: single-row PostgresStore.write, {scale(config.put_rows)} rows, "
        "synchronous_commit off (as the SKIP LOCKED peer)"
    )

    def per_write_us(seconds: float, arm: Arm) -> float | None:
        return seconds / arm.writes * 1e6 if arm.writes else None

    quiet, fed = arms["1 writer, no consumer"], arms["1 writer, consumer tailing"]
    paced = arms["1 writer, consumer tailing, 5k writes/s"]
    for q in (50, 99):
        out.append(
            report.Figure(
                table=table, what=f"put p{q}, no consumer", unit="µs", ours=quiet.put_us(q)
            )
        )
    for q in (50, 99):
        out.append(
            report.Figure(
                table=table,
                what=f"put p{q}, consumer tailing the feed",
                unit="µs",
                ours=fed.put_us(q),
            )
        )
    for arm, rate in ((paced, "5k writes/s"), (fed, "writer flat out")):
        for q in (50, 99):
            out.append(
                report.Figure(
                    table=table,
                    what=f"lag p{q}, commit to consumer, across processes, {rate}",
                    unit="ms",
                    ours=arm.lag_ms(q),
                    note=(
                        f"reached {arm.writes / arm.seconds:,.0f} writes/s; "
                        f"{arm.delivered / arm.writes:.2f} events per write"
                        if arm.seconds and arm.writes
                        else ""
                    ),
                )
            )
    name = "1 writer, no consumer"
    out.append(
        report.Figure(
            table=table,
            what="CPU per write, no consumer: writer process",
            unit="µs",
            ours=per_write_us(quiet.cpu_s, quiet),
        )
    )
    out.append(
        report.Figure(
            table=table,
            what="CPU per write, no consumer: writer + its PostgreSQL backend",
            unit="µs",
            ours=per_write_us(quiet.cpu_s + totals[name].server_s, quiet),
            note=f"every PostgreSQL process: {everything_us(quiet, totals[name]):.0f} µs",
        )
    )
    name = "1 writer, consumer tailing"
    out.append(
        report.Figure(
            table=table,
            what="CPU per write, consumer tailing: writer + consumer + their backends",
            unit="µs",
            ours=per_write_us(fed.cpu_s + totals[name].server_s, fed),
            note=(
                f"of it the feed connection's backend {totals[name].feed_s / fed.writes * 1e6:.0f}"
                f" µs; every PostgreSQL process: {everything_us(fed, totals[name]):.0f} µs"
            ),
        )
    )
    notify_table = (
        "NOTIFY's cost: the log trigger's pg_notify per commit (ours: NOTIFY on, as shipped) "
        "beside the same puts with it off (SET renderqueue.notify = off)"
    )
    for durable in (False, True):
        sync = "synchronous_commit on" if durable else "synchronous_commit off"
        for writers in (1, config.writers):
            base = f"{writers} writer{'s' if writers > 1 else ''}, " + (
                "synchronous_commit on" if durable else "no consumer"
            )
            on, off = arms[base], arms[f"{base}, NOTIFY off"]
            t_on, t_off = totals[base], totals[f"{base}, NOTIFY off"]
            label = f"{sync}, {writers} writer{'s' if writers > 1 else ''}"
            for q in (50, 99):
                out.append(
                    report.Figure(
                        table=notify_table,
                        what=f"{label}: put p{q}",
                        unit="µs",
                        ours=on.put_us(q),
                        peers={NOTIFY_OFF: off.put_us(q)},
                    )
                )
            out.append(
                report.Figure(
                    table=notify_table,
                    what=f"{label}: writes/s (all writers)",
                    unit="writes/s",
                    better="higher",
                    ours=on.writes / on.seconds if on.seconds else None,
                    peers={NOTIFY_OFF: off.writes / off.seconds if off.seconds else None},
                )
            )
            out.append(
                report.Figure(
                    table=notify_table,
                    what=f"{label}: CPU per write, writers + their backends",
                    unit="µs",
                    ours=per_write_us(on.cpu_s + t_on.server_s, on),
                    peers={NOTIFY_OFF: per_write_us(off.cpu_s + t_off.server_s, off)},
                )
            )
    return out


def claim_figures(config: Config, arms: list[ClaimArm], raw: dict[str, Any]) -> list[report.Figure]:
    out: list[report.Figure] = []
    table = (
        f"Claims through HTTP on PostgreSQL: {scale(config.node_rows)} rows, 20% due, "
        f"two workers, {CLAIMANTS} claimant processes unless said; beside SKIP LOCKED on the "
        "same server"
    )
    pairs = []  # (shape, ours, SKIP LOCKED's), in the order the arms ran
    for shape_of in SHAPES:
        found = {
            a.peer: a for a in arms if (a.complete, a.batch, a.claimants, a.carried) == shape_of
        }
        if found:
            shape = next(iter(found.values())).shape
            pairs.append((shape, found.get(OURS), found.get(SKIP_LOCKED)))
    for shape, ours, peer in pairs:
        complete = (ours or peer).complete  # type: ignore[union-attr]
        carried = (ours or peer).carried  # type: ignore[union-attr]
        batch = (ours or peer).batch  # type: ignore[union-attr]
        metrics: list[tuple[str, str, str, report.Better]] = [
            ("keys/s", "keys_per_s", "keys/s", "higher"),
            ("claim p50", "claim_p50_us", "µs", "lower"),
            ("claim p99", "claim_p99_us", "µs", "lower"),
        ]
        if complete and not carried:
            metrics.append(("complete p50", "complete_p50_us", "µs", "lower"))
        for label, attr, unit, better in metrics:
            target = ""
            if attr == "keys_per_s" and batch == 100 and not carried:
                target = f">= {TARGETS[complete]:g}× SKIP LOCKED"
            out.append(
                report.Figure(
                    table=table,
                    what=f"{shape}: {label}",
                    unit=unit,
                    better=better,
                    ours=getattr(ours, attr) if ours else None,
                    peers={SKIP_LOCKED: getattr(peer, attr) if peer else None},
                    target=target,
                )
            )
    out.append(
        report.Figure(
            table=table,
            what="keys granted twice (within each arm, summed)",
            unit="keys",
            target="0",
            ours=float(sum(a.granted_twice for a in arms if a.peer == OURS)),
            peers={SKIP_LOCKED: float(sum(a.granted_twice for a in arms if a.peer == SKIP_LOCKED))},
        )
    )
    out.append(
        report.Figure(
            table=table,
            what="keys granted twice across the claims-alone arms (their leases outlive the run)",
            unit="keys",
            target="0",
            ours=raw.get("claims_alone_granted_twice_across_arms"),
        )
    )
    cpu_table = (
        "CPU per claimed key by process (µs; each process's own CPU over the arm ÷ keys); "
        "the node's backends told apart by which worker holds the connection"
    )
    for shape, ours, peer in pairs:
        if ours is None:
            continue
        groups = sorted(ours.cpu_s, key=_group_order)
        for group in [*groups, "total"]:
            ours_value = _total_us(ours) if group == "total" else ours.cpu_us_per_key(group)
            applies = peer is not None and (group in peer.cpu_s or group == "total")
            peer_value = None
            if peer is not None and applies:
                peer_value = _total_us(peer) if group == "total" else peer.cpu_us_per_key(group)
            note = ""
            if group == "total":
                note = (
                    "every PostgreSQL process instead of the backends: ours "
                    + (f"{_total_us(ours, all_postgres=True) or 0:.0f}")
                    + (
                        f", SKIP LOCKED {_total_us(peer, all_postgres=True) or 0:.0f}"
                        if peer
                        else ""
                    )
                )
            out.append(
                report.Figure(
                    table=cpu_table,
                    what=f"{shape}: {group}",
                    unit="µs/key",
                    ours=ours_value,
                    peers={SKIP_LOCKED: peer_value} if applies else {},
                    note=note,
                )
            )
    return out


def _group_order(group: str) -> tuple[int, str]:
    order = (
        "claimants",
        "node worker 0",
        "node worker 1",
        "node supervisor",
        "PostgreSQL backends",
    )
    return (order.index(group), group) if group in order else (len(order), group)


def _total_us(arm: ClaimArm | None, *, all_postgres: bool = False) -> float | None:
    if arm is None or not arm.keys:
        return None
    mine = sum(
        v
        for k, v in arm.cpu_s.items()
        if k != "PostgreSQL backends" and not k.startswith("backends of")
    )
    server = arm.all_postgres_s if all_postgres else arm.cpu_s.get("PostgreSQL backends", 0.0)
    return (mine + server) / arm.keys * 1e6


def rebuild_figures(
    rebuilds: dict[str, dict[str, float]], loads: dict[str, float]
) -> list[report.Figure]:
    table = "Rebuild on PostgreSQL: a keeper thread from start (the node's config), fresh table"
    out: list[report.Figure] = []
    for size, found in sorted(rebuilds.items(), key=lambda item: int(item[0])):
        rows = int(size)
        out.append(
            report.Figure(
                table=table,
                what=f"{scale(rows)} rows: keeper start to live and exact",
                unit="s",
                ours=found.get("exact_s"),
                note=f"{rows / found['exact_s']:,.0f} rows/s" if found.get("exact_s") else "",
            )
        )
        out.append(
            report.Figure(
                table=table,
                what=f"{scale(rows)} rows: keeper start to first publish",
                unit="s",
                ours=found.get("first_publish_s"),
            )
        )
    for size, seconds in sorted(loads.items(), key=lambda item: int(item[0])):
        rows = int(size)
        out.append(
            report.Figure(
                table=table,
                what=f"{scale(rows)} rows: load through PostgresStore.write, 5,000 a batch",
                unit="rows/s",
                better="higher",
                ours=rows / seconds if seconds else None,
            )
        )
    return out


# --- the run --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench postgres", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small and fast: proves every row")
    parser.add_argument("--part", choices=("all", "puts", "claims", "rebuild"), default="all")
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    result = report.new_result("postgres", args.quick, ours_label=OURS)
    down = reachable(*host_port(server_url()))
    if down:
        report.progress(f"postgres: FAILED: PostgreSQL {down}; the section needs it")
        return 1
    report.progress(f"postgres: load average {result.machine.get('load_avg_1m')} at the start")
    ctx = mp.get_context("spawn")
    scratch = Scratch()
    meter: Meter | None = None
    raw: dict[str, Any] = {"config": msgspec.to_builtins(config), "load_s": {}, "rebuild": {}}
    figures: list[report.Figure] = []
    arms: list[ClaimArm] = []
    put_arms: dict[str, Arm] = {}
    try:
        meter = Meter(ctx)
        from bench.harness.node import load_store

        if args.part in ("all", "puts", "rebuild"):
            name = scratch.create("a")
            rows = generate(Workload(rows=config.put_rows, now_ms=time.time_ns() // 1_000_000))
            raw["load_s"][str(config.put_rows)] = round(
                load_store(db_url(name), rows, f"postgres: {name}"), 2
            )
            raw["rebuild"][str(config.put_rows)] = rebuild(db_url(name), config.put_rows)
            if args.part != "rebuild":
                put_arms, totals = run_puts_part(config, name, rows, meter, ctx)
                figures += put_figures(config, put_arms, totals)
                raw["puts"] = {
                    n: {
                        "writes": a.writes,
                        "seconds": round(a.seconds, 3),
                        "put_p999_us": a.put_us(99.9),
                        "pooled_put_p99_us": (report.percentile(a.put_ns, 99) or 0) / 1000,
                        "pooled_lag_p99_ms": (report.percentile(a.lag_ns, 99) or 0) / 1e6
                        if a.lag_ns
                        else None,
                        "cpu_s": round(a.cpu_s, 4),
                        "server": msgspec.to_builtins(totals[n]),
                    }
                    for n, a in put_arms.items()
                }
        if args.part in ("all", "claims", "rebuild"):
            name = scratch.create("b")
            rows = generate(Workload(rows=config.node_rows, now_ms=time.time_ns() // 1_000_000))
            raw["load_s"][str(config.node_rows)] = round(
                load_store(db_url(name), rows, f"postgres: {name}"), 2
            )
            raw["rebuild"][str(config.node_rows)] = rebuild(db_url(name), config.node_rows)
            if args.part != "rebuild":
                raw["due"] = due_count(rows, time.time_ns() // 1_000_000)
                arms += run_claims(config, name, rows, meter, raw)
                figures += claim_figures(config, arms, raw)
                raw["claims"] = [msgspec.to_builtins(a) for a in arms]
        figures += rebuild_figures(raw["rebuild"], raw["load_s"])
    finally:
        if meter is not None:
            meter.close()
        scratch.drop_all()
    raw["load_avg_1m_at_end"] = f"{os.getloadavg()[0]:.2f}"
    result.figures = figures
    result.promised = [f.key for f in figures]
    result.raw = raw
    try:
        raw["chart"] = str(postgres_chart(result, put_arms, arms))
    except Exception as exc:
        report.progress(f"postgres: chart FAILED: {type(exc).__name__}: {exc}")
        return 1
    status = report.emit(result)
    missed = [a for a in arms if a.granted_twice]
    if missed or raw.get("claims_alone_granted_twice_across_arms"):
        report.progress("postgres: FAILED: keys granted twice")
        return 1
    return status


def postgres_chart(result: report.SectionResult, puts: dict[str, Any], claims: list[Any]) -> Path:
    """bench/sections/postgres: put latency by arm, NOTIFY's cost, claims beside SKIP LOCKED, and
    where the CPU per claimed key goes."""
    from bench.harness.charts import plt, save

    figure, axes = plt.subplots(2, 2, figsize=(17, 11))
    (put_axis, notify_axis), (claim_axis, cpu_axis) = axes
    names = [n for n, arm in puts.items() if arm.writes]
    ys = range(len(names))
    for offset, q in ((-0.2, 50), (0.2, 99)):
        put_axis.barh(
            [y + offset for y in ys],
            [puts[n].put_us(q) or 0 for n in names],
            0.4,
            label=f"put p{q}",
        )
    put_axis.set_yticks(list(ys), names, fontsize=8)
    put_axis.set_xscale("log")
    put_axis.set_xlabel("µs")
    put_axis.set_title("single-row puts by arm (lower is better)")
    put_axis.legend(fontsize=8)
    put_axis.invert_yaxis()
    pairs = [
        (n, f"{n}, NOTIFY off")
        for n in names
        if f"{n}, NOTIFY off" in puts and puts[f"{n}, NOTIFY off"].writes
    ]
    xs = range(len(pairs))
    for offset, which, label in ((-0.2, 0, "NOTIFY on (shipped)"), (0.2, 1, "NOTIFY off")):
        notify_axis.bar(
            [x + offset for x in xs],
            [
                puts[pair[which]].writes / puts[pair[which]].seconds
                if puts[pair[which]].seconds
                else 0
                for pair in pairs
            ],
            0.4,
            label=label,
        )
    notify_axis.set_xticks(list(xs), [p[0].replace(", ", "\n") for p in pairs], fontsize=8)
    notify_axis.set_ylabel("writes/s, all writers")
    notify_axis.set_title("NOTIFY's cost: throughput with the log trigger's NOTIFY on and off")
    notify_axis.legend(fontsize=8)
    notify_axis.grid(axis="y", alpha=0.3)
    modes = list(SHAPES)
    labels = [
        "\n".join(
            [
                "claim+complete" if c else "claims alone",
                *(["(carried)"] if carried else []),
                f"batch {b}",
                f"{n} claimants",
            ]
        )
        for c, b, n, carried in modes
    ]
    for offset, peer in ((-0.2, OURS), (0.2, SKIP_LOCKED)):
        by = {(a.complete, a.batch, a.claimants, a.carried): a for a in claims if a.peer == peer}
        claim_axis.bar(
            [i + offset for i in range(len(modes))],
            [by[m].keys_per_s if m in by else 0 for m in modes],
            0.4,
            label=peer,
        )
    claim_axis.set_xticks(range(len(modes)), labels, fontsize=8)
    claim_axis.set_ylabel("keys/s")
    claim_axis.set_title("claims through HTTP beside SKIP LOCKED (higher is better)")
    claim_axis.legend(fontsize=8)
    claim_axis.grid(axis="y", alpha=0.3)
    stacks = [
        (peer, complete)
        for complete in (False, True)
        for peer in (OURS, SKIP_LOCKED)
        if any(_two_at_100(a, peer, complete) for a in claims)
    ]
    groups = [
        "claimants",
        "node worker 0",
        "node worker 1",
        "node supervisor",
        "PostgreSQL backends",
    ]
    bottoms = [0.0] * len(stacks)
    for group in groups:
        heights = []
        for peer, complete in stacks:
            arm = next(a for a in claims if _two_at_100(a, peer, complete))
            heights.append(arm.cpu_us_per_key(group) or 0.0)
        cpu_axis.bar(range(len(stacks)), heights, 0.6, bottom=bottoms, label=group)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    cpu_axis.set_xticks(
        range(len(stacks)),
        [f"{p}\n{'claim+complete' if c else 'claims alone'}" for p, c in stacks],
        fontsize=8,
    )
    cpu_axis.set_ylabel("CPU µs per claimed key")
    cpu_axis.set_title("where the CPU goes, batch 100, two claimants")
    cpu_axis.legend(fontsize=8)
    cpu_axis.grid(axis="y", alpha=0.3)
    scale = "quick, scaled down" if result.quick else "full scale"
    figure.suptitle(
        f"renderqueue on PostgreSQL ({scale}); {result.machine.get('cpus', '?')} CPUs, "
        f"load {result.machine.get('load_avg_1m', '?')} at the start, one run"
    )
    return save(figure, result, dpi=90)


def _two_at_100(arm: Any, peer: str, complete: bool) -> bool:
    from bench.sections.postgres import CLAIMANTS

    shape = (arm.peer, arm.complete, arm.batch, arm.claimants, arm.carried)
    return shape == (peer, complete, 100, CLAIMANTS, False)


if __name__ == "__main__":
    sys.exit(main())
