"""renderqueue beside what a user would pick instead, on one workload, in one run.

`python -m bench peers [--quick] [--only NAME,...]`

Workload: N rows (1M; quick 20k), 20% due, then 20% of them rescheduled (the
churn). Arms, each with two claimant processes: claim batches of 10 and 100,
and claim then complete (the completion reschedules by cadence). Then how one
claimant's claim cost grows from 100k to 1M rows (quick: 10k to 100k). Every
peer pushes a claimed row's due time to its lease's end, so its index scan meets
only unleased due rows (each at its best). Method: bench/README.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.synchronize import Event
from pathlib import Path

import msgspec

from bench.harness import report
from bench.harness.race import race
from bench.harness.workload import (
    DEFAULT_LEASE_MS,
    PG_DSN,
    REDIS_URL,
    Workload,
    churn_plan,
    due_count,
    generate,
    reachable,
)
from bench.peers.base import Claimant, Peer, Spec

OURS = "renderqueue"
OURS_HTTP = "renderqueue HTTP"
SQLITE = "SQLite index scan"
POSTGRES = "PostgreSQL SKIP LOCKED"
REDIS = "Redis zset + Lua"
PGQUEUER = "PgQueuer"
PEER_ORDER = (OURS, OURS_HTTP, SQLITE, POSTGRES, REDIS, PGQUEUER)
BATCHES = (10, 100)
CLAIMANTS = 2
IN_CI = os.environ.get("CI", "").lower() == "true"


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    growth: tuple[int, ...]
    churn_fraction: float = 0.2
    arm_share_of_due: float = 0.12  # each of 4 arms takes at most this share of the due rows
    arm_max_keys: int = 30_000
    arm_max_s: float = 30.0
    probe_claims: int = 300
    lease_ms: int = DEFAULT_LEASE_MS


FULL = Config(rows=1_000_000, growth=(100_000, 300_000, 1_000_000))
QUICK = Config(
    rows=20_000, growth=(10_000, 100_000), arm_max_keys=2_000, arm_max_s=8.0, probe_claims=60
)


class ClaimantReport(msgspec.Struct, kw_only=True):
    index: int
    started: float  # perf_counter; CLOCK_MONOTONIC, the same clock in every process
    finished: float
    claim_ns: list[int]
    complete_ns: list[int]
    keys: list[str]
    empty_claims: int
    cpu_s: float = 0.0  # the claimant process's CPU from the start to its last call
    error: str = ""


class ArmResult(msgspec.Struct, kw_only=True):
    batch: int
    complete: bool
    keys: int
    seconds: float
    keys_per_s: float
    claim_p50_us: float | None
    claim_p99_us: float | None
    complete_p50_us: float | None
    complete_p99_us: float | None
    cycle_p50_us: float | None  # claim + complete, one batch
    granted_twice: int
    empty_claims: int
    claims: int
    claimant_cpu_s: float = 0.0  # every claimant process's CPU, summed
    # The completions rode on the next claim (`complete` on POST /v1/claims).
    carried: bool = False
    node_cpu_s: float | None = None  # the server's CPU over the arm, where the bench runs it


class Growth(msgspec.Struct, kw_only=True):
    rows: int
    due: int
    claim_p50_us: float | None
    claim_p99_us: float | None
    claims: int


class PeerRun(msgspec.Struct, kw_only=True):
    name: str
    load_s: dict[str, float] = {}
    churn_rows_per_s: float | None = None
    arms: list[ArmResult] = []
    growth: list[Growth] = []
    error: str = ""


def open_claimant(spec: Spec) -> Claimant:
    if spec.kind == "sqlite":
        from bench.peers.sql import SqliteClaimant

        return SqliteClaimant(spec.params)
    if spec.kind == "postgres":
        from bench.peers.sql import PostgresClaimant

        return PostgresClaimant(spec.params)
    if spec.kind == "redis":
        from bench.peers.redis import RedisClaimant

        return RedisClaimant(spec.params)
    if spec.kind == "pgqueuer":
        from bench.peers.pgqueuer import PgQueuerClaimant

        return PgQueuerClaimant(spec.params)
    if spec.kind.startswith("renderqueue"):
        from bench.peers.renderqueue import open_renderqueue_claimant

        return open_renderqueue_claimant(spec)
    raise ValueError(f"unknown peer kind {spec.kind!r}")


def claimant_process(
    spec: Spec,
    index: int,
    batch: int,
    complete: bool,
    max_keys: int,
    max_s: float,
    lease_ms: int,
    ready: mp.Queue,  # type: ignore[type-arg]
    start: Event,
    results: mp.Queue,  # type: ignore[type-arg]
) -> None:
    claim_ns: list[int] = []
    complete_ns: list[int] = []
    keys: list[str] = []
    empty = 0
    error = ""
    cpu_s = 0.0
    claimant: Claimant | None = None
    started = finished = time.perf_counter()
    try:
        claimant = open_claimant(spec)
        ready.put(index)
        start.wait()
        started = time.perf_counter()
        cpu0 = time.process_time()
        deadline = started + max_s
        empty_since: float | None = None
        while len(keys) < max_keys and time.perf_counter() < deadline:
            now_ms = time.time_ns() // 1_000_000
            t0 = time.perf_counter_ns()
            got = claimant.claim(batch, now_ms, lease_ms)
            t1 = time.perf_counter_ns()
            if not got:
                # A peer that ran dry (or waits for its next publish) is noted, not timed.
                empty += 1
                empty_since = empty_since or time.perf_counter()
                if time.perf_counter() - empty_since > 3.0:
                    break
                time.sleep(0.001)
                continue
            empty_since = None
            claim_ns.append(t1 - t0)
            keys.extend(got)
            if complete:
                t2 = time.perf_counter_ns()
                claimant.complete(got, time.time_ns() // 1_000_000)
                complete_ns.append(time.perf_counter_ns() - t2)
        finished = time.perf_counter()
        cpu_s = time.process_time() - cpu0
    except Exception as exc:  # reported to the parent, which fails the arm loudly
        error = f"{type(exc).__name__}: {exc}"
        ready.put(index)
    finally:
        if claimant is not None:
            claimant.close()
    results.put(
        msgspec.msgpack.encode(
            ClaimantReport(
                index=index,
                started=started,
                finished=finished,
                claim_ns=claim_ns,
                complete_ns=complete_ns,
                keys=keys,
                empty_claims=empty,
                cpu_s=cpu_s,
                error=error,
            )
        )
    )


def run_arm(
    spec: Spec,
    batch: int,
    complete: bool,
    max_keys: int,
    config: Config,
    claimants: int = CLAIMANTS,
) -> ArmResult:
    own_args = [
        (spec, i, batch, complete, max_keys // claimants, config.arm_max_s, config.lease_ms)
        for i in range(claimants)
    ]
    raw = race(claimant_process, own_args, config.arm_max_s + 120, f"a claimant of {spec.kind}")
    reports = [msgspec.msgpack.decode(report, type=ClaimantReport) for report in raw]
    errors = [r.error for r in reports if r.error]
    if errors:
        raise RuntimeError("; ".join(errors))
    all_keys = [key for r in reports for key in r.keys]
    claim_ns = [ns for r in reports for ns in r.claim_ns]
    complete_ns = [ns for r in reports for ns in r.complete_ns]
    seconds = max(r.finished for r in reports) - min(r.started for r in reports)
    cycles = [c + d for r in reports for c, d in zip(r.claim_ns, r.complete_ns, strict=False)]
    return ArmResult(
        batch=batch,
        complete=complete,
        keys=len(all_keys),
        seconds=round(seconds, 3),
        keys_per_s=round(len(all_keys) / seconds, 1) if seconds > 0 else 0.0,
        claim_p50_us=_us(report.percentile(claim_ns, 50)),
        claim_p99_us=_us(report.percentile(claim_ns, 99)),
        complete_p50_us=_us(report.percentile(complete_ns, 50)),
        complete_p99_us=_us(report.percentile(complete_ns, 99)),
        cycle_p50_us=_us(report.percentile(cycles, 50)),
        granted_twice=len(all_keys) - len(set(all_keys)),
        empty_claims=sum(r.empty_claims for r in reports),
        claims=len(claim_ns),
        claimant_cpu_s=round(sum(r.cpu_s for r in reports), 4),
    )


def _us(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1000, 1)


def growth_probe(spec: Spec, rows: int, due: int, config: Config) -> Growth:
    """One claimant in this process: batches of 10, timed one by one."""
    claimant = open_claimant(spec)
    samples: list[int] = []
    try:
        for _ in range(config.probe_claims):
            now_ms = time.time_ns() // 1_000_000
            t0 = time.perf_counter_ns()
            got = claimant.claim(10, now_ms, config.lease_ms)
            elapsed = time.perf_counter_ns() - t0
            if got:
                samples.append(elapsed)
            else:
                time.sleep(0.001)
    finally:
        claimant.close()
    return Growth(
        rows=rows,
        due=due,
        claim_p50_us=_us(report.percentile(samples, 50)),
        claim_p99_us=_us(report.percentile(samples, 99)),
        claims=len(samples),
    )


PeerFactory = Callable[[], Peer]


def run_peer(name: str, factory: PeerFactory, config: Config) -> PeerRun:
    run = PeerRun(name=name)
    for size in sorted({*config.growth, config.rows}):
        workload = Workload(rows=size, now_ms=time.time_ns() // 1_000_000)
        rows = generate(workload)
        plan = churn_plan(workload, rows, config.churn_fraction)
        report.progress(f"peers: {name}: loading {size:,} rows")
        peer = factory()
        try:
            t0 = time.perf_counter()
            peer.load(rows)
            run.load_s[str(size)] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            peer.churn(rows, plan)
            churn_s = time.perf_counter() - t0
            for i, due in plan:
                rows.next_render_at[i] = due
            due = due_count(rows, time.time_ns() // 1_000_000)
            if size == config.rows:
                run.churn_rows_per_s = round(len(plan) / churn_s, 1) if churn_s else None
            spec = peer.spec()
            if hasattr(peer, "settle"):
                peer.settle()
            if size in config.growth:
                report.progress(f"peers: {name}: growth probe at {size:,} rows")
                run.growth.append(growth_probe(spec, size, due, config))
            if size == config.rows:
                max_keys = min(config.arm_max_keys, int(due * config.arm_share_of_due))
                carried = getattr(peer, "carried_spec", None)
                cpu_s = getattr(peer, "cpu_s", None)
                plan_arms = [(False, False), (True, False)]
                if carried is not None:
                    plan_arms.append((True, True))
                for complete, carry in plan_arms:
                    for batch in BATCHES:
                        what = "claim then complete" if complete else "claim"
                        what += " (carried on claims)" if carry else ""
                        report.progress(f"peers: {name}: {what}, batch {batch}, {max_keys} keys")
                        cpu0 = cpu_s() if cpu_s is not None else 0.0
                        arm_spec = carried() if carry and carried is not None else spec
                        arm = run_arm(arm_spec, batch, complete, max_keys, config)
                        arm.carried = carry
                        if cpu_s is not None:
                            arm.node_cpu_s = round(cpu_s() - cpu0, 4)
                        report.progress(
                            f"peers: {name}: {arm.keys_per_s:,.0f} keys/s, "
                            f"claim p50 {arm.claim_p50_us} us p99 {arm.claim_p99_us} us"
                            + (
                                f", node CPU {arm.node_cpu_s / arm.keys * 1e6:.1f} us/key"
                                if arm.node_cpu_s is not None and arm.keys
                                else ""
                            )
                        )
                        run.arms.append(arm)
        finally:
            peer.drop()
    return run


def factories(only: set[str] | None) -> tuple[dict[str, PeerFactory], dict[str, str]]:
    """The peers this run can measure, and why each other one cannot be measured."""
    from bench.peers import pgqueuer as peer_pgqueuer
    from bench.peers import redis as peer_redis
    from bench.peers import renderqueue as peer_renderqueue
    from bench.peers import sql as peer_sql

    made: dict[str, PeerFactory] = {}
    pending: dict[str, str] = {}
    made.update(peer_renderqueue.factories())
    made[SQLITE] = peer_sql.SqlitePeer
    pg_down = reachable(*_host_port(PG_DSN, 5432))
    redis_down = reachable(*_host_port(REDIS_URL, 6379))
    if pg_down:
        pending[POSTGRES] = pending[PGQUEUER] = f"PostgreSQL {pg_down}"
    else:
        made[POSTGRES] = peer_sql.PostgresPeer
        made[PGQUEUER] = peer_pgqueuer.PgQueuerPeer
    if redis_down:
        pending[REDIS] = f"Redis {redis_down}"
    else:
        made[REDIS] = peer_redis.RedisPeer
    if only:
        made = {name: f for name, f in made.items() if selected(name, only)}
    return made, pending


def selected(name: str, only: set[str]) -> bool:
    """`--only` matches a peer's name or a part of it, ignoring case ("redis", "sqlite")."""
    return any(part.lower() in name.lower() for part in only)


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    rest = url.split("://", 1)[-1].split("/", 1)[0].split("@")[-1]
    host, _, port = rest.partition(":")
    return host or "127.0.0.1", int(port or default_port)


def figures(runs: dict[str, PeerRun], config: Config) -> list[report.Figure]:
    table = f"Claims: {config.rows:,} rows, 20% due, churned; {CLAIMANTS} claimant processes"
    out: list[report.Figure] = []

    def arm_of(
        run: PeerRun | None, batch: int, complete: bool, carried: bool = False
    ) -> ArmResult | None:
        if run is None:
            return None
        return next(
            (
                a
                for a in run.arms
                if a.batch == batch and a.complete == complete and a.carried == carried
            ),
            None,
        )

    metrics: list[tuple[str, str, str, report.Better]] = [
        ("keys/s", "keys_per_s", "keys/s", "higher"),
        ("claim p50", "claim_p50_us", "µs", "lower"),
        ("claim p99", "claim_p99_us", "µs", "lower"),
    ]
    for complete in (False, True):
        for batch in BATCHES:
            mode = "claim then complete" if complete else "claim"
            rows = [*metrics]
            if complete:
                rows.append(("complete p50", "complete_p50_us", "µs", "lower"))
            for label, attr, unit, better in rows:
                values = {}
                for name in PEER_ORDER:
                    arm = arm_of(runs.get(name), batch, complete)
                    values[name] = None if arm is None else getattr(arm, attr)
                out.append(
                    report.Figure(
                        table=table,
                        what=f"{mode}, batch {batch}: {label}",
                        unit=unit,
                        better=better,
                        ours=values.pop(OURS),
                        peers=values,
                    )
                )
    for batch in BATCHES:
        # The node's CPU per completed key (HTTP only: the server is a process of its own),
        # with completions sent on their own and carried on the next claim.
        for carried in (False, True):
            mode = "carried on claims" if carried else "sent on their own"
            arm = arm_of(runs.get(OURS_HTTP), batch, True, carried)
            per_key = (
                None
                if arm is None or arm.node_cpu_s is None or not arm.keys
                else round(arm.node_cpu_s / arm.keys * 1e6, 1)
            )
            out.append(
                report.Figure(
                    table=table,
                    what=f"claim then complete, batch {batch}: HTTP node CPU per key, "
                    f"completions {mode}",
                    unit="µs",
                    note="the node's processes (psutil) over the arm ÷ keys; target at "
                    "batch 100: <= 35",
                    peers={OURS_HTTP: per_key},
                )
            )
        values = {}
        for name in PEER_ORDER:
            arm = arm_of(runs.get(name), batch, True, name == OURS_HTTP)
            values[name] = None if arm is None else arm.keys_per_s
        out.append(
            report.Figure(
                table=table,
                what=f"claim then complete, batch {batch}: keys/s, renderqueue HTTP carrying "
                "completions on claims",
                unit="keys/s",
                better="higher",
                note="renderqueue HTTP's column is its carried arm; the others are the same "
                "claim-then-complete arm as above",
                ours=values.pop(OURS),
                peers=values,
            )
        )
    twice = {
        name: float(sum(a.granted_twice for a in runs[name].arms)) if name in runs else None
        for name in PEER_ORDER
    }
    out.append(
        report.Figure(
            table=table,
            what="keys granted twice (all arms)",
            unit="keys",
            target="0",
            ours=twice.pop(OURS),
            peers=twice,
        )
    )
    growth_table = "Claim cost growth: one claimant, batches of 10"
    for size in config.growth:
        values = {}
        for name in PEER_ORDER:
            points = runs[name].growth if name in runs else []
            point = next((g for g in points if g.rows == size), None)
            values[name] = None if point is None else point.claim_p50_us
        out.append(
            report.Figure(
                table=growth_table,
                what=f"claim p50 at {size:,} rows",
                unit="µs",
                ours=values.pop(OURS),
                peers=values,
            )
        )
    ratios = {}
    for name in PEER_ORDER:
        points = runs[name].growth if name in runs else []
        low = next((g.claim_p50_us for g in points if g.rows == config.growth[0]), None)
        high = next((g.claim_p50_us for g in points if g.rows == config.growth[-1]), None)
        ratios[name] = round(high / low, 2) if low and high else None
    out.append(
        report.Figure(
            table=growth_table,
            what=f"growth, {config.growth[-1]:,} ÷ {config.growth[0]:,} rows",
            unit="×",
            note="1.0 = flat",
            ours=ratios.pop(OURS),
            peers=ratios,
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench peers", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated peer names to run")
    parser.add_argument("--rows", type=int, default=0, help="override the workload size")
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    if args.rows:
        config = msgspec.structs.replace(config, rows=args.rows)
    result = report.new_result("peers", args.quick, ours_label=OURS)
    only = {name.strip() for name in args.only.split(",") if name.strip()} or None
    made, pending = factories(only)
    down = [f"{name}: {why}" for name, why in pending.items() if "unreachable" in why]
    for line in down:
        report.progress(f"peers: SERVICE DOWN {line}")
    result.pending = pending
    runs: dict[str, PeerRun] = {}
    failures: list[str] = []
    for name in PEER_ORDER:
        if name not in made:
            continue
        try:
            runs[name] = run_peer(name, made[name], config)
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            report.progress(f"peers: {name} FAILED: {message}")
            failures.append(f"{name}: {message}")
            runs[name] = PeerRun(name=name, error=message)
    result.figures = figures({k: v for k, v in runs.items() if not v.error}, config)
    measured = {name for name in PEER_ORDER if not only or selected(name, only)}
    result.promised = [f.key for f in result.figures]
    for figure in result.figures:
        # The node's CPU is a figure of the HTTP arm alone (in process there is no node
        # process to measure); the row is still a gap when the HTTP arm did not fill it.
        if "HTTP node CPU per key" in figure.what and figure.peers.get(OURS_HTTP) is not None:
            result.pending[figure.key] = "in process: the node's CPU is measured through HTTP"
    for name in PEER_ORDER:
        if name not in measured and name not in result.pending:
            result.pending[name] = "not selected (--only)"
    result.raw = {
        "config": msgspec.to_builtins(config),
        "runs": {name: msgspec.to_builtins(run) for name, run in runs.items()},
        "failures": failures,
    }
    try:
        chart = peer_chart(result, runs, config)
        result.raw["chart"] = str(chart)
    except Exception as exc:
        failures.append(f"chart: {type(exc).__name__}: {exc}")
        report.progress(f"peers: chart FAILED: {exc}")
    status = report.emit(result)
    if failures:
        report.progress("peers: FAILED: " + "; ".join(failures))
        return 1
    if down and IN_CI:
        report.progress("peers: a service is down and CI=true: failing")
        return 1
    return status


def peer_chart(result: report.SectionResult, runs: dict[str, PeerRun], config: Config) -> Path:
    from bench.harness.charts import plt, save

    names = [name for name in PEER_ORDER if name in runs and not runs[name].error]
    arms = [(complete, batch) for complete in (False, True) for batch in BATCHES]
    labels = [f"{'claim+complete' if c else 'claim'}\nbatch {b}" for c, b in arms]
    figure, (throughput, latency, growth) = plt.subplots(1, 3, figsize=(18, 5.5))
    width = 0.8 / max(1, len(names))
    for position, name in enumerate(names):
        by_arm = {(a.complete, a.batch): a for a in runs[name].arms}
        xs = [i + position * width for i in range(len(arms))]
        rates = [by_arm[arm].keys_per_s if arm in by_arm else 0 for arm in arms]
        p50s = [(by_arm[arm].claim_p50_us or 0) if arm in by_arm else 0 for arm in arms]
        throughput.bar(xs, rates, width, label=name)
        latency.bar(xs, p50s, width, label=name)
        points = sorted(runs[name].growth, key=lambda g: g.rows)
        growth.plot(
            [g.rows for g in points],
            [g.claim_p50_us or float("nan") for g in points],
            marker="o",
            label=name,
        )
    centre = [i + width * (len(names) - 1) / 2 for i in range(len(arms))]
    for axis, title, unit in (
        (throughput, "claimed keys/s (2 claimants; higher is better)", "keys/s"),
        (latency, "claim p50 (lower is better)", "µs"),
    ):
        axis.set_xticks(centre, labels)
        axis.set_yscale("log")
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.grid(axis="y", alpha=0.3)
    growth.set_xscale("log")
    growth.set_yscale("log")
    growth.set_title("claim p50 vs table size (1 claimant, batch 10)")
    growth.set_xlabel("rows")
    growth.set_ylabel("µs")
    growth.grid(alpha=0.3)
    throughput.legend(fontsize=8)
    scale = "quick, scaled down" if result.quick else "full scale"
    figure.suptitle(
        f"renderqueue vs peers: {config.rows:,} rows, 20% due, churned ({scale}); "
        f"{result.machine.get('cpus', '?')} CPUs, one run"
    )
    return save(figure, result, dpi=90)


if __name__ == "__main__":
    sys.exit(main())
