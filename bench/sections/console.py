"""The console's cost on a node: `python -m bench console [--quick]`.

A real node (`renderqueue serve`, two workers) on a SQLite store of rows, a paced
claimant (claims of 10, each answered `rendered` and due again at once, so the pool never
drains) through keep-alive connections to both workers, and:

1. Claim latency with no console open, then with five consoles open, interleaved round by
   round in the same run. A console is what `api/console.html` asks every 2 s: queue-state,
   overview, the routes, /healthz, /readyz, the 100 sites with the most due rows and the
   hour of leases in flight per site (the cluster view asks once; a single node answers
   404), each kind on a keep-alive connection of its own, as a browser keeps them.
2. Requests per second one worker serves for queue-state, overview, the sites and the
   in-flight hour, flat out from client processes, with that worker's CPU per request
   (psutil, the worker's own process time): worker 1, and worker 0, which also runs the
   keeper.

Not a `make bench` section: it takes a minute or two. Results in
var/bench/console.json and var/bench/console.png. The clients share the two
cores with the node; compare the arms within a run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import psutil

from bench.harness import report
from bench.harness.node import ADMIN_TOKEN, Node, NodeClient, connect
from bench.harness.workload import Workload, generate
from shm.segment import now_ms

CONSOLE_PERIOD_S = 2.0
CONSOLE_READS = (
    "/prerender_admin/queue-state",
    "/prerender_admin/overview",
    "/v1/routes",
    "/healthz",
    "/readyz",
    "/v1/sites?top=100",
    "/v1/sites-in-flight",
)
SERVED = (
    "/prerender_admin/queue-state",
    "/prerender_admin/overview",
    "/v1/sites?top=100",
    "/v1/sites-in-flight",
)


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    rounds: int
    arm_s: float
    claims_per_s: float
    batch: int
    consoles: int
    throughput_s: float
    load_processes: int
    load_connections: int


FULL = Config(
    rows=100_000,
    rounds=3,
    arm_s=10.0,
    claims_per_s=100.0,
    batch=10,
    consoles=5,
    throughput_s=5.0,
    load_processes=2,
    load_connections=2,
)
QUICK = msgspec.structs.replace(FULL, rows=10_000, rounds=1, arm_s=3.0, throughput_s=2.0)


# --- the consoles ---------------------------------------------------------------------


def console_reader(port: int, stop: Any, counts: Any, index: int) -> None:
    """One open console: every CONSOLE_PERIOD_S, each read on its own connection."""
    clients = {path: NodeClient(port, ADMIN_TOKEN) for path in CONSOLE_READS}
    cluster = NodeClient(port, ADMIN_TOKEN)
    cluster.call("GET", "/prerender_admin/cluster/queue-state")
    cluster.close()
    # Consoles opened together do not tick together.
    time.sleep(CONSOLE_PERIOD_S * index / 5)
    next_at = time.monotonic()
    try:
        while not stop.is_set():
            for path, client in clients.items():
                client.call("GET", path)
                with counts.get_lock():
                    counts.value += 1
            next_at += CONSOLE_PERIOD_S
            stop.wait(max(0.0, next_at - time.monotonic()))
    finally:
        for client in clients.values():
            client.close()


def consoles_process(port: int, n: int, stop: Any, counts: Any) -> None:
    threads = [
        threading.Thread(target=console_reader, args=(port, stop, counts, i), daemon=True)
        for i in range(n)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# --- the claimant ---------------------------------------------------------------------


class _Lease(msgspec.Struct):
    key: str
    token: str


class _Claimed(msgspec.Struct):
    leases: list[_Lease]


def claim_for(port: int, config: Config, seconds: float) -> list[int]:
    """Paced claims for `seconds`; each claim's latency in ns. Every lease is answered
    `rendered` and due again now, so the due pool stays as it was."""
    clients, _ = connect(port, 4, 2)
    for client in clients:
        client.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    latencies: list[int] = []
    period = 1.0 / config.claims_per_s
    next_at = time.monotonic()
    end = next_at + seconds
    turn = 0
    try:
        while time.monotonic() < end:
            client = clients[turn % len(clients)]
            turn += 1
            started = time.perf_counter_ns()
            status, claimed = client.call(
                "POST",
                "/v1/claims",
                {"max": config.batch, "worker": "bench", "lease_s": 60},
                _Claimed,
            )
            latencies.append(time.perf_counter_ns() - started)
            if status == 200 and claimed.leases:
                due = now_ms()
                client.call(
                    "POST",
                    "/v1/completions",
                    {
                        "items": [
                            {
                                "key": lease.key,
                                "token": lease.token,
                                "outcome": "rendered",
                                "next_render_at": due,
                            }
                            for lease in claimed.leases
                        ]
                    },
                )
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    finally:
        for client in clients:
            client.close()
    return latencies


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000  # µs


def arm_figures(latencies: list[int]) -> dict[str, float]:
    return {
        "claims": len(latencies),
        "p50_us": percentile(latencies, 0.50),
        "p99_us": percentile(latencies, 0.99),
        "mean_us": statistics.fmean(latencies) / 1000,
    }


# --- throughput -----------------------------------------------------------------------


def hammer(port: int, pid: int, path: str, connections: int, seconds: float, out: Any) -> None:
    """Flat-out GETs on connections that reach worker `pid`; the count into `out`."""
    kept: list[NodeClient] = []
    tries = 0
    while len(kept) < connections and tries < 200:
        tries += 1
        client = NodeClient(port, ADMIN_TOKEN)
        if int(client.call("GET", "/healthz")[1]["pid"]) == pid:
            kept.append(client)
        else:
            client.close()
    done = 0
    lock = threading.Lock()
    end = time.monotonic() + seconds

    def loop(client: NodeClient) -> None:
        nonlocal done
        count = 0
        while time.monotonic() < end:
            status, _ = client.call("GET", path)
            assert status in (200, 503), status
            count += 1
        with lock:
            done += count

    threads = [threading.Thread(target=loop, args=(client,)) for client in kept]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for client in kept:
        client.close()
    with out.get_lock():
        out.value += done


def throughput(port: int, pid: int, path: str, config: Config) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Value("q", 0)
    worker = psutil.Process(pid)
    processes = [
        ctx.Process(
            target=hammer,
            args=(port, pid, path, config.load_connections, config.throughput_s, out),
        )
        for _ in range(config.load_processes)
    ]
    # The worker's CPU over the whole run, its few connection probes (/healthz) included.
    cpu_before = worker.cpu_times()
    wall_before = time.monotonic()
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    wall = time.monotonic() - wall_before
    cpu_after = worker.cpu_times()
    requests = out.value
    cpu_s = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    return {
        "requests": requests,
        "requests_per_s": requests / config.throughput_s,
        "worker_cpu_us_per_request": cpu_s / max(1, requests) * 1e6,
        "worker_cpu_share": cpu_s / wall if wall else 0.0,
    }


# --- the run --------------------------------------------------------------------------


def run(config: Config) -> dict[str, Any]:
    rows = generate(Workload(rows=config.rows, now_ms=now_ms(), due_fraction=0.2))
    node = Node(rows)
    try:
        node.start()
        port = node.port
        workers = node.worker_of()  # pid -> index
        by_index = {index: pid for pid, index in workers.items()}
        ctx = mp.get_context("spawn")
        arms: dict[str, list[dict[str, float]]] = {"no console": [], "five consoles": []}
        all_latencies: dict[str, list[int]] = {"no console": [], "five consoles": []}
        console_requests = 0
        console_seconds = 0.0
        claim_for(port, config, 1.0)  # warm the connections and the code paths
        for _ in range(config.rounds):
            latencies = claim_for(port, config, config.arm_s)
            arms["no console"].append(arm_figures(latencies))
            all_latencies["no console"] += latencies
            stop = ctx.Event()
            counts = ctx.Value("q", 0)
            consoles = ctx.Process(
                target=consoles_process, args=(port, config.consoles, stop, counts)
            )
            consoles.start()
            time.sleep(CONSOLE_PERIOD_S)  # every console open and ticking
            before, started = counts.value, time.monotonic()
            latencies = claim_for(port, config, config.arm_s)
            console_requests += counts.value - before
            console_seconds += time.monotonic() - started
            stop.set()
            consoles.join(30)
            arms["five consoles"].append(arm_figures(latencies))
            all_latencies["five consoles"] += latencies
        served: dict[str, dict[str, dict[str, float]]] = {}
        for index in sorted(by_index, reverse=True):
            served[f"worker {index}"] = {
                path: throughput(port, by_index[index], path, config) for path in SERVED
            }
        state = node.admin().call("GET", "/prerender_admin/queue-state")[1]
        return {
            "config": msgspec.to_builtins(config),
            "machine": {
                "cpus": str(os.cpu_count()),
                "python": platform.python_version(),
                "kernel": platform.release(),
            },
            "due_rows": (state.get("now") or {}).get("due"),
            "claim_latency": {
                arm: {"rounds": rounds, "all": arm_figures(all_latencies[arm])}
                for arm, rounds in arms.items()
            },
            "console_requests_per_s": console_requests / console_seconds
            if console_seconds
            else 0.0,
            "served": served,
        }
    finally:
        node.drop()


def chart(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    arms = list(result["claim_latency"])
    rounds = len(result["claim_latency"][arms[0]]["rounds"])
    width = 0.8 / (rounds + 1)
    for a, arm in enumerate(arms):
        figures = result["claim_latency"][arm]
        values = [r["p99_us"] for r in figures["rounds"]] + [figures["all"]["p99_us"]]
        for i, value in enumerate(values):
            left.bar(
                a + (i - rounds / 2) * width,
                value,
                width,
                color="#58a6ff" if i < rounds else "#1f6feb",
            )
        left.text(a, max(values) * 1.02, f"p99 {figures['all']['p99_us']:.0f} µs", ha="center")
    left.set_xticks(range(len(arms)), arms)
    left.set_ylabel("claim p99 (µs), each round then all")
    left.set_title(
        f"claims of {result['config']['batch']} at {result['config']['claims_per_s']:.0f}/s"
    )
    labels, values = [], []
    for worker, paths in result["served"].items():
        for p, figures in paths.items():
            labels.append(f"{worker}\n{p.rsplit('/', 1)[-1].split('?')[0]}")
            values.append(figures["requests_per_s"])
    right.bar(range(len(values)), values, color="#bc8cff")
    right.set_xticks(range(len(values)), labels, fontsize=7, rotation=30, ha="right")
    right.set_ylabel("requests/s one worker served")
    right.set_title("flat out, clients on the same 2 cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench console", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(report.RESULTS_DIR))
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    started = time.monotonic()
    result = run(config)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "console-quick" if args.quick else "console"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    chart(result, out / f"{name}.png")
    for arm, figures in result["claim_latency"].items():
        all_ = figures["all"]
        print(
            f"{arm:>14}: {all_['claims']} claims, p50 {all_['p50_us']:.0f} µs, "
            f"p99 {all_['p99_us']:.0f} µs"
        )
    print(f"consoles' requests: {result['console_requests_per_s']:.1f}/s")
    for worker, paths in result["served"].items():
        for path, figures in paths.items():
            print(
                f"{worker} {path}: {figures['requests_per_s']:.0f} req/s, "
                f"{figures['worker_cpu_us_per_request']:.0f} µs worker CPU each"
            )
    print(f"wrote {out / name}.json and .png in {result['elapsed_s']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
