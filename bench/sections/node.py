"""The node through HTTP: what the fleet sees.

`python -m bench node [--quick] [--rows N] [--claimants N]`

Workload (bench/harness/workload.py): 1M rows (quick 20k), 20% due. Arms:

- claim then complete through `renderqueue serve` with two workers, batches of 10 and
  100: keys/s, claim p50/p99. Beside it, in the same run and on the same rows, the
  SQLite index scan and PostgreSQL `FOR UPDATE SKIP LOCKED` peers (bench/peers/sql.py,
  driven by bench/sections/peers.py's arm runner). The target: at least the better peer's keys/s
  at batch 100. Our claimants speak HTTP with a lean keep-alive client (http.client and
  msgspec), so the figure is the server's, not a client library's.
- CPU per completed key by process in those arms (psutil, user + system, over each arm):
  the supervisor and each worker (worker 0 hosts the keeper and its thread), their sum
  against the 40 µs target at batch 100, and the node plus our claimants beside the
  SQLite peer's claimant processes, which do all of that peer's work.
- single-row schedule writes (`POST /v1/schedule`, one row): p50/p99.
- claim latency on worker 0 (which hosts the keeper thread) against worker 1, measured
  on connections pinned to each worker while a writer keeps the keeper busy.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from typing import Any

import msgspec

from bench.harness import report
from bench.harness.node import Node, NodeClient, connect, process_cpu_s
from bench.harness.postgres import host_port
from bench.harness.race import race
from bench.harness.workload import (
    PG_DSN,
    Rows,
    Workload,
    due_count,
    generate,
    reachable,
)

OURS = "renderqueue HTTP"
SQLITE = "SQLite index scan"
POSTGRES = "PostgreSQL SKIP LOCKED"
BATCHES = (10, 100)
PEER_CLAIMANTS = 2  # as bench/sections/peers.py runs every peer
CONNECTIONS_PER_CLAIMANT = 4
LEASE_S = 300  # the node's max_lease_s default: longer than any arm


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    arm_max_keys: int
    arm_max_s: float
    claimants: tuple[int, ...]  # our claimant processes per arm (each count is an arm)
    writes: int  # single-row schedule writes
    probe_rounds: int  # claim round trips per connection in the worker probe
    probe_churn_per_s: int  # rows rescheduled per second while probing


FULL = Config(
    rows=1_000_000,
    arm_max_keys=40_000,
    arm_max_s=20.0,
    claimants=(2, 4),
    writes=2000,
    probe_rounds=150,
    probe_churn_per_s=2000,
)
QUICK = Config(
    rows=20_000,
    arm_max_keys=2_000,
    arm_max_s=6.0,
    claimants=(2, 4),
    writes=200,
    probe_rounds=15,
    probe_churn_per_s=500,
)


SPLIT_TABLE = (
    "Claims by the worker that served them, under the arms' load (worker 0 hosts the "
    "keeper and has one listener to every other worker's two)"
)


class ArmResult(msgspec.Struct, kw_only=True):
    peer: str
    batch: int
    claimants: int
    complete: bool = True  # claim then complete; False: claims alone
    carried: bool = False  # the completions rode on the next claim (no complete p50 then)
    keys: int
    seconds: float
    keys_per_s: float
    claim_p50_us: float | None
    claim_p99_us: float | None
    complete_p50_us: float | None
    complete_p99_us: float | None
    granted_twice: int
    not_ok: int = 0
    # Our arms: claims by the worker that served them (worker 0 hosts the keeper).
    worker0_share: float | None = None
    worker0_claim_p50_us: float | None = None
    worker0_claim_p99_us: float | None = None
    others_claim_p50_us: float | None = None
    others_claim_p99_us: float | None = None
    claimant_cpu_s: float | None = None  # the claimant processes' CPU, summed
    # Our arms: each node process's CPU over the arm (psutil), by label ("worker 0", ...).
    node_cpu_s: dict[str, float] = {}

    def cpu_us_per_key(self, seconds: float | None) -> float | None:
        return None if seconds is None or not self.keys else round(seconds / self.keys * 1e6, 1)


# --- a lean HTTP client ---------------------------------------------------------------


# What a claimant reads of the answers: the rest of each lease is skipped unparsed, as a
# renderer that only needs the key and token would.
class _Lease(msgspec.Struct):
    key: str
    token: str


class _Result(msgspec.Struct):
    ok: bool


class _Claimed(msgspec.Struct):
    leases: list[_Lease]
    completed: list[_Result] | None = None  # the completions the claim carried


class _Results(msgspec.Struct):
    results: list[_Result]


class _Done(msgspec.Struct):
    key: str
    token: str
    outcome: str = "rendered"


class _Completions(msgspec.Struct):
    items: list[_Done]


class _Claim(msgspec.Struct, omit_defaults=True):
    """POST /v1/claims, with the last batch's completions when they are carried."""

    max: int
    worker: str
    lease_s: int
    complete: list[_Done] | None = None


def claimant(
    port: int,
    index: int,
    batch: int,
    max_keys: int,
    max_s: float,
    workers: int,
    complete: bool,
    carry: bool,
    ready: Any,
    start: Any,
    results: Any,
) -> None:
    """Claims `batch` at a time until `max_keys` or `max_s`; each batch completed (all
    rendered) when `complete`, else its leases left to run. `carry`: each batch's
    completions ride on the next claim (`complete` on POST /v1/claims, as the fleet
    client sends them), and the last batch's go to /v1/completions once the arm is over."""
    claim_ns: list[int] = []
    complete_ns: list[int] = []
    keys: list[str] = []
    not_ok = 0
    error = ""
    cpu_s = 0.0
    started = finished = time.perf_counter()
    clients, pids = connect(port, CONNECTIONS_PER_CLAIMANT, workers)
    claim_pid: list[int] = []
    turn = 0
    try:
        ready.put(index)
        start.wait()
        started = time.perf_counter()
        cpu0 = time.process_time()
        deadline = started + max_s
        empty_since: float | None = None
        request = _Claim(max=batch, worker=f"bench-{index}", lease_s=LEASE_S)
        while len(keys) < max_keys and time.perf_counter() < deadline:
            client = clients[turn % len(clients)]
            pid = pids[turn % len(clients)]
            turn += 1
            t0 = time.perf_counter_ns()
            status, body = client.call("POST", "/v1/claims", request, _Claimed)
            t1 = time.perf_counter_ns()
            if status != 200:
                raise RuntimeError(f"claim: HTTP {status}: {body}")
            if request.complete is not None:  # applied: answered in `completed`
                not_ok += sum(1 for result in body.completed or () if not result.ok)
                request = msgspec.structs.replace(request, complete=None)
            leases = body.leases
            if not leases:
                empty_since = empty_since or time.perf_counter()
                if time.perf_counter() - empty_since > 3.0:
                    break
                time.sleep(0.001)
                continue
            empty_since = None
            claim_ns.append(t1 - t0)
            claim_pid.append(pid)
            keys.extend(lease.key for lease in leases)
            if not complete:
                continue
            items = [_Done(key=lease.key, token=lease.token) for lease in leases]
            if carry:
                request = msgspec.structs.replace(request, complete=items)
                continue
            done = _Completions(items=items)
            t2 = time.perf_counter_ns()
            status, body = client.call("POST", "/v1/completions", done, _Results)
            complete_ns.append(time.perf_counter_ns() - t2)
            if status != 200:
                raise RuntimeError(f"completions: HTTP {status}: {body}")
            not_ok += sum(1 for result in body.results if not result.ok)
        finished = time.perf_counter()
        cpu_s = time.process_time() - cpu0
        if request.complete:  # the last batch's, outside the arm's figures
            last = _Completions(items=request.complete)
            status, body = clients[0].call("POST", "/v1/completions", last, _Results)
            if status != 200:
                raise RuntimeError(f"completions: HTTP {status}: {body}")
            not_ok += sum(1 for result in body.results if not result.ok)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        ready.put(index)
    finally:
        for client in clients:
            client.close()
    results.put(
        msgspec.msgpack.encode(
            {
                "started": started,
                "finished": finished,
                "claim_ns": claim_ns,
                "claim_pid": claim_pid,
                "complete_ns": complete_ns,
                "keys": keys,
                "not_ok": not_ok,
                "cpu_s": cpu_s,
                "error": error,
            }
        )
    )


def run_our_arm(
    port: int,
    batch: int,
    claimants: int,
    max_keys: int,
    max_s: float,
    worker_of: dict[int, int] | None = None,
    *,
    complete: bool = True,
    carry: bool = False,
    keys_out: list[str] | None = None,
    node_processes: dict[str, Any] | None = None,
) -> ArmResult:
    """One arm of `claimants` racing processes (`carry`: completions ride on the next
    claim, see `claimant`); `keys_out` gets every key granted;
    `node_processes` (label -> psutil.Process): the node's, whose CPU over the arm the
    result carries."""
    workers = len(set((worker_of or {}).values()))
    node_cpu_before = process_cpu_s(node_processes or {})
    raw = race(
        claimant,
        [
            (port, i, batch, max_keys // claimants, max_s, workers, complete, carry)
            for i in range(claimants)
        ],
        max_s + 120,
    )
    node_cpu_after = process_cpu_s(node_processes or {})
    reports = [msgspec.msgpack.decode(report) for report in raw]
    errors = [r["error"] for r in reports if r["error"]]
    if errors:
        raise RuntimeError("; ".join(errors))
    keys = [key for r in reports for key in r["keys"]]
    if keys_out is not None:
        keys_out.extend(keys)
    claim_ns = [ns for r in reports for ns in r["claim_ns"]]
    complete_ns = [ns for r in reports for ns in r["complete_ns"]]
    seconds = max(r["finished"] for r in reports) - min(r["started"] for r in reports)
    by_worker: dict[bool, list[int]] = {True: [], False: []}
    for r in reports:
        for ns, pid in zip(r["claim_ns"], r["claim_pid"], strict=True):
            by_worker[(worker_of or {}).get(pid) == 0].append(ns)
    zero, others = by_worker[True], by_worker[False]
    return ArmResult(
        worker0_share=round(len(zero) / len(claim_ns), 3) if claim_ns and worker_of else None,
        worker0_claim_p50_us=us(report.percentile(zero, 50)),
        worker0_claim_p99_us=us(report.percentile(zero, 99)),
        others_claim_p50_us=us(report.percentile(others, 50)),
        others_claim_p99_us=us(report.percentile(others, 99)),
        peer=OURS,
        batch=batch,
        claimants=claimants,
        complete=complete,
        carried=carry,
        keys=len(keys),
        seconds=round(seconds, 3),
        keys_per_s=round(len(keys) / seconds, 1) if seconds > 0 else 0.0,
        claim_p50_us=us(report.percentile(claim_ns, 50)),
        claim_p99_us=us(report.percentile(claim_ns, 99)),
        complete_p50_us=us(report.percentile(complete_ns, 50)),
        complete_p99_us=us(report.percentile(complete_ns, 99)),
        granted_twice=len(keys) - len(set(keys)),
        not_ok=sum(r["not_ok"] for r in reports),
        claimant_cpu_s=round(sum(r.get("cpu_s", 0.0) for r in reports), 4),
        node_cpu_s={
            label: round(node_cpu_after[label] - before, 4)
            for label, before in node_cpu_before.items()
            if label in node_cpu_after
        },
    )


def us(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1000, 1)


# --- single-row writes and the worker probe ---------------------------------------------


def schedule_writes(node: Node, count: int) -> dict[str, float | None]:
    client = node.admin()
    samples: list[int] = []
    try:
        for i in range(count):
            body = {
                "upsert": [
                    {
                        "key": f"https://shop.example.com/bench-write/{i:08d}",
                        "route": "product",
                        "next_render_at": time.time_ns() // 1_000_000 + 3_600_000,
                    }
                ]
            }
            t0 = time.perf_counter_ns()
            status, answer = client.call("POST", "/v1/schedule", body)
            samples.append(time.perf_counter_ns() - t0)
            if status != 200:
                raise RuntimeError(f"schedule write: HTTP {status}: {answer}")
    finally:
        client.close()
    return {
        "p50_us": us(report.percentile(samples, 50)),
        "p99_us": us(report.percentile(samples, 99)),
        "writes": float(len(samples)),
    }


def churn_writer(db: str, rows: Rows, per_s: int, stop: Any) -> None:
    """Reschedules existing (not due) rows at a steady rate, so the keeper has work."""
    from store import open_store
    from store.rows import RowWrite

    store = open_store(db)
    step = max(1, per_s // 20)
    offset = len(rows) // 2
    try:
        while not stop.is_set():
            started = time.perf_counter()
            now = time.time_ns() // 1_000_000
            batch = []
            for _ in range(step):
                i = offset % len(rows)
                offset += 7919
                batch.append(
                    RowWrite(
                        key=rows.keys[i],
                        route=rows.routes[i],
                        next_render_at=now + 600_000 + i % 3_600_000,
                        cadence_s=rows.cadences_s[i],
                        sitemap=rows.sitemaps[i],
                    )
                )
            store.write(upsert=batch)
            time.sleep(max(0.0, 0.05 - (time.perf_counter() - started)))
    finally:
        store.close()


def worker_probe(node: Node, rows: Rows, config: Config) -> dict[str, Any]:
    """Claim latency by worker, on connections pinned to each worker (keep-alive)."""
    admin = node.admin()
    _, overview = admin.call("GET", "/prerender_admin/overview")
    admin.close()
    index_of = {w["pid"]: w["index"] for w in overview["supervisor"]["workers"]}
    by_worker: dict[int, list[NodeClient]] = {}
    for _ in range(40):
        client = NodeClient(node.port)
        _, health = client.call("GET", "/healthz")
        by_worker.setdefault(index_of[health["pid"]], []).append(client)
        if all(len(by_worker.get(i, [])) >= 2 for i in (0, 1)):
            break
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    writer = ctx.Process(
        target=churn_writer, args=(node.db, rows, config.probe_churn_per_s, stop), daemon=True
    )
    writer.start()
    samples: dict[int, list[int]] = {index: [] for index in by_worker}
    try:
        time.sleep(1.0)
        pinned = [(index, client) for index, clients in by_worker.items() for client in clients[:2]]
        for _ in range(config.probe_rounds):
            for index, client in pinned:
                t0 = time.perf_counter_ns()
                status, body = client.call(
                    "POST", "/v1/claims", {"max": 10, "worker": "probe", "lease_s": LEASE_S}
                )
                elapsed = time.perf_counter_ns() - t0
                if status != 200:
                    raise RuntimeError(f"probe claim: HTTP {status}: {body}")
                if body["leases"]:
                    samples[index].append(elapsed)
                    items = [
                        {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
                        for lease in body["leases"]
                    ]
                    client.call("POST", "/v1/completions", {"items": items})
    finally:
        stop.set()
        writer.join(30)
        for clients in by_worker.values():
            for client in clients:
                client.close()
    return {
        str(index): {
            "claims": len(found),
            "p50_us": us(report.percentile(found, 50)),
            "p99_us": us(report.percentile(found, 99)),
        }
        for index, found in sorted(samples.items())
    }


# --- peers --------------------------------------------------------------------------------


def run_peer_arms(name: str, rows: Rows, config: Config) -> list[ArmResult]:
    from bench.peers.sql import PostgresPeer, SqlitePeer
    from bench.sections import peers

    factory = SqlitePeer if name == SQLITE else PostgresPeer
    peer = factory()
    out: list[ArmResult] = []
    try:
        report.progress(f"node: {name}: loading {len(rows):,} rows")
        peer.load(rows)
        spec = peer.spec()
        arm_config = peers.Config(
            rows=config.rows, growth=(), arm_max_keys=config.arm_max_keys,
            arm_max_s=config.arm_max_s,
        )  # fmt: skip
        per_arm = min(config.arm_max_keys, due_count(rows, time.time_ns() // 1_000_000) // 3)
        for batch in BATCHES:
            arm = peers.run_arm(spec, batch, True, per_arm, arm_config)
            report.progress(f"node: {name}: batch {batch}: {arm.keys_per_s:,.0f} keys/s")
            out.append(
                ArmResult(
                    peer=name,
                    batch=batch,
                    claimants=PEER_CLAIMANTS,
                    keys=arm.keys,
                    seconds=arm.seconds,
                    keys_per_s=arm.keys_per_s,
                    claim_p50_us=arm.claim_p50_us,
                    claim_p99_us=arm.claim_p99_us,
                    complete_p50_us=arm.complete_p50_us,
                    complete_p99_us=arm.complete_p99_us,
                    granted_twice=arm.granted_twice,
                    claimant_cpu_s=arm.claimant_cpu_s,
                )
            )
    finally:
        peer.drop()
    return out


# --- the report ---------------------------------------------------------------------------


def figures(
    arms: list[ArmResult],
    writes: dict[str, float | None],
    probe: dict[str, dict[str, Any]],
    config: Config,
) -> list[report.Figure]:
    table = f"Claim then complete through HTTP: {config.rows:,} rows, 20% due, two workers"
    out: list[report.Figure] = []

    def find(peer: str, batch: int, claimants: int | None = None) -> ArmResult | None:
        return next(
            (
                a
                for a in arms
                if a.peer == peer and a.batch == batch and claimants in (None, a.claimants)
            ),
            None,
        )

    for batch in BATCHES:
        for claimants in config.claimants:
            ours = find(OURS, batch, claimants)
            sqlite = find(SQLITE, batch)
            postgres = find(POSTGRES, batch)
            best = max((a.keys_per_s for a in (sqlite, postgres) if a is not None), default=None)
            for label, attr, unit, better in (
                ("keys/s", "keys_per_s", "keys/s", "higher"),
                ("claim p50", "claim_p50_us", "µs", "lower"),
                ("claim p99", "claim_p99_us", "µs", "lower"),
            ):
                out.append(
                    report.Figure(
                        table=table,
                        what=f"batch {batch}, {claimants} claimants: {label}",
                        unit=unit,
                        better=better,  # type: ignore[arg-type]
                        ours=getattr(ours, attr) if ours else None,
                        peers={
                            SQLITE: getattr(sqlite, attr) if sqlite else None,
                            POSTGRES: getattr(postgres, attr) if postgres else None,
                        },
                        target=(
                            f">= {best:,.0f} (the better peer)"
                            if attr == "keys_per_s" and batch == 100 and best
                            else ""
                        ),
                        note=(
                            f"peers: {PEER_CLAIMANTS} claimant processes"
                            if attr == "keys_per_s"
                            else ""
                        ),
                    )
                )
    twice = sum(a.granted_twice for a in arms if a.peer == OURS)
    out.append(
        report.Figure(
            table=table,
            what="keys granted twice (our arms)",
            unit="keys",
            ours=float(twice),
            target="0",
        )
    )
    out += cpu_figures(arms, config)
    split_table = SPLIT_TABLE
    for batch in BATCHES:
        for claimants in config.claimants:
            arm = find(OURS, batch, claimants)
            if arm is None:
                continue
            label = f"batch {batch}, {claimants} claimants"
            out.append(
                report.Figure(
                    table=split_table,
                    what=f"{label}: worker 0's share of claims",
                    unit="share",
                    ours=arm.worker0_share,
                    note="equal share would be 0.5",
                )
            )
            for pct in ("p50", "p99"):
                out.append(
                    _by_worker(
                        split_table,
                        f"{label}: claim {pct}",
                        getattr(arm, f"worker0_claim_{pct}_us"),
                        getattr(arm, f"others_claim_{pct}_us"),
                    )
                )
    write_table = "Single-row schedule write through HTTP (POST /v1/schedule)"
    out.append(report.Figure(table=write_table, what="p50", unit="µs", ours=writes["p50_us"]))
    out.append(report.Figure(table=write_table, what="p99", unit="µs", ours=writes["p99_us"]))
    probe_table = (
        "Claim latency by worker (batch 10, keeper busy with a churn writer): worker 0 hosts "
        "the keeper thread; its GIL switch interval is the node's setting (1 ms) or Python's "
        "default (5 ms)"
    )
    for interval, by_worker in probe.items():
        zero = by_worker.get("0", {})
        other = by_worker.get("1", {})
        for label in ("p50_us", "p99_us"):
            out.append(
                _by_worker(
                    probe_table,
                    f"switch interval {interval}: claim {label[:3]}",
                    zero.get(label),
                    other.get(label),
                )
            )
    return out


CPU_TARGET_US = 40  # node CPU per completed key, every node process, batch 100


def cpu_figures(arms: list[ArmResult], config: Config) -> list[report.Figure]:
    """CPU per completed key by process (psutil, over each arm). The SQL peers' work is all
    in their claimant processes (PostgreSQL's backends are not counted here: see the
    postgres section), so theirs is the figure beside our node's plus our claimants'."""
    table = (
        f"CPU per completed key by process, claim then complete through HTTP: "
        f"{config.rows:,} rows, two workers (psutil, over each arm)"
    )
    out: list[report.Figure] = []
    for arm in arms:
        if arm.peer != OURS:
            continue
        sqlite = next((a for a in arms if a.peer == SQLITE and a.batch == arm.batch), None)
        label = f"batch {arm.batch}, {arm.claimants} claimants"
        node_s = sum(arm.node_cpu_s.values()) if arm.node_cpu_s else None
        out.append(
            report.Figure(
                table=table,
                what=f"{label}: node, every process",
                unit="µs/key",
                ours=arm.cpu_us_per_key(node_s),
                target=f"<= {CPU_TARGET_US}" if arm.batch == 100 else "",
                note=", ".join(
                    f"{name} {arm.cpu_us_per_key(seconds)}"
                    for name, seconds in sorted(arm.node_cpu_s.items())
                ),
            )
        )
        total_s = None if node_s is None else node_s + (arm.claimant_cpu_s or 0.0)
        out.append(
            report.Figure(
                table=table,
                what=f"{label}: node and claimants",
                unit="µs/key",
                ours=arm.cpu_us_per_key(total_s),
                peers={SQLITE: sqlite.cpu_us_per_key(sqlite.claimant_cpu_s) if sqlite else None},
                note=f"our claimants {arm.cpu_us_per_key(arm.claimant_cpu_s)}; "
                "the SQLite peer's claimants do all of its work",
            )
        )
    return out


def _unserved_splits(out: list[report.Figure], arms: list[ArmResult]) -> dict[str, str]:
    """The by-worker latency rows of an arm in which one side served no claim at all.

    The kernel spreads the claimants' keep-alive connections over the listeners by hash,
    so with a few claimants every connection can land away from worker 0 (or on it).
    """
    why: dict[str, str] = {}
    for arm in arms:
        if arm.peer != OURS or arm.worker0_share not in (0.0, 1.0):
            continue
        side = "worker 0" if arm.worker0_share == 0.0 else "the other workers"
        label = f"batch {arm.batch}, {arm.claimants} claimants: claim p"
        for figure in out:
            if figure.table == SPLIT_TABLE and figure.what.startswith(label):
                why[figure.key] = (
                    f"{side} served none of this arm's claims (every claimant's connection "
                    "went to the other side)"
                )
    return why


def _by_worker(table: str, what: str, worker0_us: Any, worker1_us: Any) -> report.Figure:
    """A latency of worker 0 (ours: it hosts the keeper) beside worker 1's."""
    return report.Figure(
        table=table,
        what=what,
        unit="µs",
        ours=worker0_us,
        peers={"worker 1": worker1_us},
        note="ours = worker 0",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench node", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=0)
    parser.add_argument("--claimants", default="", help="our claimant counts, e.g. 2,4")
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.rows:
        config = msgspec.structs.replace(config, rows=args.rows)
    if args.claimants:
        counts = tuple(int(c) for c in args.claimants.split(","))
        config = msgspec.structs.replace(config, claimants=counts)
    result = report.new_result("node", args.quick, ours_label=OURS)
    workload = Workload(rows=config.rows, now_ms=time.time_ns() // 1_000_000)
    report.progress(f"node: generating {config.rows:,} rows")
    rows = generate(workload)
    due = due_count(rows, time.time_ns() // 1_000_000)
    arms: list[ArmResult] = []
    failures: list[str] = []
    pg_down = reachable(*host_port(PG_DSN))
    if pg_down:
        result.pending[POSTGRES] = f"PostgreSQL {pg_down}"
    for name in (SQLITE, POSTGRES):
        if name in result.pending:
            continue
        try:
            arms += run_peer_arms(name, rows, config)
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            report.progress(f"node: {name} FAILED: {exc}")
    writes: dict[str, float | None] = {"p50_us": None, "p99_us": None}
    probe: dict[str, dict[str, Any]] = {}
    report.progress(f"node: loading {config.rows:,} rows ({due:,} due) into the node's store")
    node = Node(rows)
    try:
        started = time.perf_counter()
        node.start()
        report.progress(f"node: live and exact in {time.perf_counter() - started:.1f} s")
        # Every arm drains due keys; a share is left over for the worker probes.
        per_arm = min(config.arm_max_keys, due // (len(BATCHES) * len(config.claimants) + 2))
        for batch in BATCHES:
            for claimants in config.claimants:
                arm = run_our_arm(
                    node.port,
                    batch,
                    claimants,
                    per_arm,
                    config.arm_max_s,
                    node.worker_of(),
                    node_processes=node.processes(),
                )
                report.progress(
                    f"node: batch {batch}, {claimants} claimants: {arm.keys_per_s:,.0f} keys/s, "
                    f"claim p50 {arm.claim_p50_us} us p99 {arm.claim_p99_us} us"
                )
                arms.append(arm)
        report.progress(f"node: {config.writes} single-row schedule writes")
        writes = schedule_writes(node, config.writes)
        report.progress("node: claim latency by worker, switch interval 1 ms (the node's)")
        probe["1 ms"] = worker_probe(node, rows, config)
        node.stop()
        node.start(keeper_switch_interval_ms=5.0)
        report.progress("node: claim latency by worker, switch interval 5 ms (Python's)")
        probe["5 ms"] = worker_probe(node, rows, config)
    except Exception as exc:
        failures.append(f"{OURS}: {type(exc).__name__}: {exc}")
        report.progress(f"node: FAILED: {exc}; log in {node.dir}")
    finally:
        node.stop()
        if not failures:
            node.drop()
    result.figures = figures(arms, writes, probe, config)
    result.promised = [figure.key for figure in result.figures]
    result.pending.update(_unserved_splits(result.figures, arms))
    result.raw = {
        "config": msgspec.to_builtins(config),
        "due": due,
        "arms": [msgspec.to_builtins(arm) for arm in arms],
        "writes": writes,
        "probe": probe,
        "failures": failures,
    }
    status = report.emit(result)
    if failures:
        report.progress("node: FAILED: " + "; ".join(failures))
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
