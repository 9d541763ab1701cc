"""A node restarted on rows that arrived through HTTP, beside one started on a fresh table.

`python -m bench restart [--quick]`

1M rows (quick: 50k), 20% due, the workload of the other sections. One node starts on
an empty table and takes every row through `POST /v1/schedule`, 1,000 rows a request
from four connections, as a fleet's own writers would put them; it is then stopped with
SIGTERM and started again on that table. A second node starts on a table the store's
bulk writer filled with the same rows. Each start is timed from the command to the
keeper's live and exact queue-state, so both include the processes' own start.

Memory is worker 0's resident set as the OS charges it, less what worker 0 held on the
empty table, per row held; the keeper's own count of its buffers is beside it.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import msgspec
import psutil

from bench.harness import report
from bench.harness.node import Node
from bench.harness.workload import Rows, Workload, generate, unique_suffix

BATCH = 1000  # rows per request: the API's limit
CONNECTIONS = 4
SETTLE_S = 2.0  # after exact: the keeper's report and the allocator's frees land
TABLE = "Restart on 1M rows, 20% due, two workers"
TARGET_BYTES_PER_ROW = 150


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int


FULL = Config(rows=1_000_000)
QUICK = Config(rows=50_000)


class Held(msgspec.Struct, frozen=True, kw_only=True):
    """Worker 0 as the node holds its rows."""

    rss_bytes: int
    keeper_bytes: int
    held: int


def worker0_pid(node: Node) -> int:
    return next(pid for pid, index in node.worker_of().items() if index == 0)


def held(node: Node) -> Held:
    time.sleep(SETTLE_S)
    client = node.admin()
    try:
        _, overview = client.call("GET", "/prerender_admin/overview")
    finally:
        client.close()
    keeper = overview["keeper"]
    return Held(
        rss_bytes=psutil.Process(worker0_pid(node)).memory_info().rss,
        keeper_bytes=int(keeper["memory_bytes"]),
        held=int(keeper["held"]),
    )


def timed_start(node: Node, instance: str) -> float:
    """Seconds from the command to live and exact (Node.start waits for both)."""
    started = time.perf_counter()
    node.start(instance=instance, wait_s=1800)
    return time.perf_counter() - started


def load_through_http(node: Node, rows: Rows) -> float:
    """Every row through POST /v1/schedule; returns the seconds it took."""
    batches = list(rows.chunks(BATCH))
    done = [0]
    failures: list[str] = []
    lock = threading.Lock()

    def send(share: list[range]) -> None:
        client = node.admin()
        try:
            for part in share:
                body = {
                    "upsert": [
                        {
                            "key": rows.keys[i],
                            "route": rows.routes[i],
                            "cadence_s": rows.cadences_s[i],
                            "sitemap": rows.sitemaps[i],
                            "next_render_at": rows.next_render_at[i],
                        }
                        for i in part
                    ]
                }
                status, answer = client.call("POST", "/v1/schedule", body)
                if status != 200:
                    raise RuntimeError(f"POST /v1/schedule: HTTP {status}: {answer}")
                with lock:
                    done[0] += len(part)
        except Exception as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
        finally:
            client.close()

    started = time.perf_counter()
    threads = [
        threading.Thread(target=send, args=(batches[i::CONNECTIONS],), daemon=True)
        for i in range(CONNECTIONS)
    ]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(2.0)
        elapsed = time.perf_counter() - started
        rate = done[0] / elapsed
        report.progress(f"restart: {done[0]:,}/{len(rows):,} rows through HTTP ({rate:,.0f}/s)")
    if failures:
        raise RuntimeError("; ".join(failures[:3]))
    return time.perf_counter() - started


def run(config: Config) -> dict[str, Any]:
    rows = generate(Workload(rows=config.rows, now_ms=time.time_ns() // 1_000_000))
    raw: dict[str, Any] = {"config": msgspec.to_builtins(config)}
    through_http = Node(None, load=False)
    fresh: Node | None = None
    instance = f"rqbr{unique_suffix()}"
    try:
        report.progress("restart: a node on an empty table")
        raw["empty_start_s"] = round(timed_start(through_http, instance), 3)
        empty = held(through_http)
        raw["empty"] = msgspec.to_builtins(empty)
        raw["http_load_s"] = round(load_through_http(through_http, rows), 2)
        through_http.wait_live(600)
        raw["after_http"] = msgspec.to_builtins(held(through_http))
        through_http.stop()
        report.progress("restart: the same node started again on the table HTTP filled")
        raw["http_restart_s"] = round(timed_start(through_http, instance), 3)
        raw["after_restart"] = msgspec.to_builtins(held(through_http))
        through_http.drop()
        report.progress("restart: a node on a fresh table of the same rows")
        fresh = Node(rows)
        raw["fresh_start_s"] = round(timed_start(fresh, f"rqbr{unique_suffix()}"), 3)
        raw["fresh"] = msgspec.to_builtins(held(fresh))
    finally:
        through_http.drop()
        if fresh is not None:
            fresh.drop()
    return raw


def figures(raw: dict[str, Any], rows: int) -> list[report.Figure]:
    table = TABLE if rows == 1_000_000 else TABLE.replace("1M", f"{rows:,}")
    fresh_s = raw.get("fresh_start_s")
    restart_s = raw.get("http_restart_s")
    out = [
        report.Figure(table=table, what="start on a fresh table: live and exact", unit="s",
                      ours=fresh_s, note="the store's bulk writer filled it"),
        report.Figure(table=table, what="restart on the table HTTP filled: live and exact",
                      unit="s", ours=restart_s,
                      target=f"<= {2 * fresh_s:.2f} (2x the fresh start)" if fresh_s else "",
                      note=f"{BATCH:,} rows a request, {CONNECTIONS} connections"),
        report.Figure(table=table, what="restart ÷ fresh start", unit="×",
                      ours=round(restart_s / fresh_s, 2) if fresh_s and restart_s else None,
                      target="<= 2"),
        report.Figure(table=table, what="rows through HTTP", unit="rows/s",
                      ours=round(rows / raw["http_load_s"]) if raw.get("http_load_s") else None,
                      better="higher"),
    ]  # fmt: skip
    empty = raw.get("empty") or {}
    for label, name in (
        ("after the rows arrived through HTTP", "after_http"),
        ("after a restart on them", "after_restart"),
        ("started on a fresh table", "fresh"),
    ):
        state = raw.get(name) or {}
        count = state.get("held") or 0
        rss = (state["rss_bytes"] - empty["rss_bytes"]) / count if count and empty else None
        own = state["keeper_bytes"] / count if count else None
        out.append(report.Figure(
            table=table, what=f"worker 0 resident memory per row, {label}", unit="B",
            ours=round(rss, 1) if rss is not None else None,
            target=f"<= {TARGET_BYTES_PER_ROW}",
            note=f"{count:,} rows held; RSS less worker 0's on the empty table",
        ))  # fmt: skip
        out.append(report.Figure(
            table=table, what=f"the keeper's own count per row, {label}", unit="B",
            ours=round(own, 1) if own is not None else None,
        ))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench restart", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rows", type=int, default=0)
    args = parser.parse_args(argv)
    config = QUICK if args.quick else FULL
    if args.rows:
        config = msgspec.structs.replace(config, rows=args.rows)
    result = report.new_result("restart", args.quick)
    raw: dict[str, Any] = {}
    failure = ""
    try:
        raw = run(config)
    except Exception as exc:
        failure = f"{type(exc).__name__}: {exc}"
        report.progress(f"restart: FAILED: {failure}")
    result.figures = figures(raw, config.rows)
    result.promised = [figure.key for figure in result.figures]
    result.raw = {**raw, "failure": failure}
    status = report.emit(result)
    return 1 if failure else status


if __name__ == "__main__":
    raise SystemExit(main())
