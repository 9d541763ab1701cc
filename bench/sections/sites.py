"""sites: what per-site politeness costs the claim path.

    .venv/bin/python -m bench sites [--quick]

The in-process claim path (`api.claims.grant_from_ring`, as bench/peers/renderqueue.py
runs it): a store file, the node's segments and a keeper thread in this process (worker
0's place, with the site table's allowances in its publish), two claimant processes
attached like workers, started together behind a barrier, each claiming batches of 100
with 15-minute leases and completing nothing. Two workloads, each claimed first with no
site settings (the site table empty: a grant probes it and finds nothing) and then with
caps (every grant takes a permit by CAS and counts the site's permits again):

- **1,000 sites**: 1M rows (quick 50k), 20% due, spread evenly over 1,000 sites; caps of
  64 on every site (high enough not to bind: the figure is the cost of enforcing them).
  Target: caps on at least 0.9x the keys/s of caps off.
- **one dominant site**: 200k rows (quick 20k), 20% due, 60% of the due rows on one site
  capped at 4 in flight, the rest over 49 uncapped sites. Target: claim p99 with the cap
  within 1.5x of the uncapped p99. The keeper's publish holds the capped site's keys to
  its allowance, so claims do not read past thousands of unusable entries.

Each arm takes K keys (30,000, quick 2,000; the dominant workload 6,000, quick 600) from
keys still due, after a warm-up arm of K/4: each arm claims other keys than the last.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time
from typing import Any

from bench.harness import report
from bench.harness.workload import Rows, row_writes
from bench.peers.renderqueue import LocalNode

SECTION = "sites"
T_CLAIMS = "claims with per-site caps (in process, 2 claimant processes, batches of 100)"
T_GRANTS = "one grant, from Python (LeaseTable.grant with the key's site)"
BATCH = 100
LEASE_MS = 15 * 60 * 1000
CADENCE_S = 3600


def _rows(count: int, sites: int, dominant_share: float | None, seed: int) -> Rows:
    """`count` rows, 20% due (up to a cadence late), the rest due within the next cadence;
    site i of `sites` by index, or, with `dominant_share`, that share of the due rows on
    site 0 and the rest spread over the others."""
    rng = random.Random(seed)
    now = report.now_ms()
    rows = Rows(keys=[], routes=[], cadences_s=[], sitemaps=[], next_render_at=[])
    for index in range(count):
        due = rng.random() < 0.2
        if dominant_share is not None and due and rng.random() < dominant_share:
            site = 0
        else:
            site = 1 + index % (sites - 1) if dominant_share is not None else index % sites
        rows.keys.append(f"https://s{site:04d}.example/product/item-{index:08d}")
        rows.routes.append("product")
        rows.cadences_s.append(CADENCE_S)
        rows.sitemaps.append(False)
        offset = rng.random() * CADENCE_S * 1000
        rows.next_render_at.append(int(now - offset if due else now + offset))
    return rows


def _claimant(params: dict[str, Any], want: int, barrier: Any, out: Any) -> None:
    from api.claims import grant_from_ring
    from api.node import Node
    from bench.peers.renderqueue import hash_as_node
    from store import open_store
    from workers.config import Settings, api_settings
    from workers.segments import SegmentNames, Segments

    segments = Segments.attach(SegmentNames.for_instance(params["instance"]))
    store = open_store(params["store_url"])
    hash_as_node(store)
    node = Node(
        settings=api_settings(
            Settings(), node="bench", instance=params["instance"], worker=1, advertised_url=""
        ),
        store=store,
        ring=segments.ring,
        leases=segments.leases,
        state=segments.state,
        marks=segments.marks,
    )
    calls: list[float] = []
    got = empty = 0
    barrier.wait()
    started = time.perf_counter()
    deadline = started + 120
    while got < want and time.perf_counter() < deadline:
        t0 = time.perf_counter()
        leases = grant_from_ring(node, min(BATCH, want - got), LEASE_MS)
        elapsed = time.perf_counter() - t0
        if leases:
            calls.append(elapsed * 1000)
            got += len(leases)
        else:
            empty += 1
            time.sleep(0.001)  # the ring ran dry: the keeper refills it
    out.put({"got": got, "empty": empty, "calls_ms": calls, "s": time.perf_counter() - started})
    store.close()
    segments.close()


def _arm(node: LocalNode, keys: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    out: Any = ctx.Queue()
    params = {"instance": node.instance, "store_url": node.store_url}
    procs = [ctx.Process(target=_claimant, args=(params, keys // 2, barrier, out)) for _ in "ab"]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(60)
    calls = [ms for r in results for ms in r["calls_ms"]]
    got = sum(r["got"] for r in results)
    wall = max(r["s"] for r in results)
    return {
        "keys": got,
        "keys_per_s": got / wall if wall else 0.0,
        "p50_ms": report.percentile(calls, 50),
        "p99_ms": report.percentile(calls, 99),
        "calls": len(calls),
        "empty_calls": sum(r["empty"] for r in results),
    }


def _fresh_publish(node: LocalNode) -> None:
    """Claims start from a publish made after the last change of settings."""
    node.wait_publish(node.segments.ring.generation + 1, 60)


def measure(rows: Rows, caps: dict[str, int], keys: int) -> dict[str, Any]:
    """One workload: caps off, then `caps` (site name -> max in flight) on."""
    from shm.keys import site_hash

    node = LocalNode(site_table=True)
    try:
        store = node.open_store()
        try:
            for part in rows.chunks(5000):
                store.write(upsert=row_writes(rows, part))
        finally:
            store.close()
        node.start_keeper()
        node.wait_exact(report.now_ms(), 900)
        _fresh_publish(node)
        _arm(node, keys // 4)  # warm-up: the store's pages and the claimants' imports
        _fresh_publish(node)
        off = _arm(node, keys)
        sites = node.segments.sites
        for name, cap in caps.items():
            assert sites.configure(site_hash(name.encode()), cap, None)
        _fresh_publish(node)
        _fresh_publish(node)
        on = _arm(node, keys)
        stats = sites.statistics()
        return {
            "off": off,
            "on": on,
            "skips": {
                "capped": stats.skips_capped,
                "spacing": stats.skips_spacing,
                "blocked": stats.skips_blocked,
                "table_full": stats.skips_full,
            },
            "permits_taken": stats.permits_taken,
            "site_entries": stats.entries,
        }
    finally:
        node.close()


def measure_grants(quick: bool) -> dict[str, float]:
    """Per grant, the lease table alone against the lease table with the site table: keys
    of 1,000 sites, no site settings (a probe that finds nothing) and caps of 64 on every
    site (a permit taken by CAS, the site's permits counted again). Fresh tables per
    round, rounds alternating, the median round: the in-process claims above run their
    arms in a fixed order, this does not."""
    import os
    import statistics

    from shm import LeaseTable, SiteTable, key_hash, segment_name, use_secret
    from shm.keys import site_hash
    from shm.segment import remove

    use_secret(os.urandom(16))
    n = 20_000 if quick else 100_000
    hashes = [key_hash(b"https://s%04d.example/p/%d" % (i % 1000, i)) for i in range(n)]
    sites = [site_hash(b"s%04d.example" % (i % 1000)) for i in range(n)]
    rounds: dict[str, list[float]] = {"none": [], "no settings": [], "caps of 64": []}
    for round_ in range(3 if quick else 7):
        for arm in rounds:
            tag = f"b{os.getpid()}r{round_}{len(arm)}"
            leases = LeaseTable.create(segment_name(tag, "leases"), capacity=1 << 18)
            table = SiteTable.create(segment_name(tag, "sites"), capacity=1 << 13, permits=64)
            try:
                if arm != "none":
                    leases.use_sites(table)
                if arm == "caps of 64":
                    for site in set(sites):
                        table.configure(site, 64, None)
                grant = leases.grant
                now = report.now_ms()
                started = time.perf_counter_ns()
                for h, site in zip(hashes, sites, strict=True):
                    grant(h, now, LEASE_MS, 3_600_000, site)
                rounds[arm].append((time.perf_counter_ns() - started) / n / 1000)
            finally:
                leases.close()
                table.close()
                remove(leases.name)
                remove(table.name)
    return {arm: statistics.median(samples) for arm, samples in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench sites", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="scaled down; checks rows only")
    quick: bool = parser.parse_args(argv).quick
    report.exit_on_sigterm()
    result = report.new_result(SECTION, quick)

    many_rows = 50_000 if quick else 1_000_000
    report.progress(f"sites: 1,000 sites, {many_rows:,} rows")
    many = measure(
        _rows(many_rows, 1000, None, 1),
        {f"s{site:04d}.example": 64 for site in range(1000)},
        2_000 if quick else 30_000,
    )
    dominant_rows = 20_000 if quick else 200_000
    report.progress(f"sites: one dominant site, {dominant_rows:,} rows")
    dominant = measure(
        _rows(dominant_rows, 50, 0.6, 2), {"s0000.example": 4}, 600 if quick else 6_000
    )

    report.progress("sites: grants, lease table alone and with the site table")
    grants = measure_grants(quick)
    from shm.keys import forget_secret

    forget_secret()

    ratio = many["on"]["keys_per_s"] / many["off"]["keys_per_s"]
    result.figures.append(
        report.Figure(
            table=T_CLAIMS,
            what="keys/s, 1,000 sites, caps of 64 on every site",
            unit="keys/s",
            ours=round(many["on"]["keys_per_s"]),
            better="higher",
            target=">= 0.9x caps off",
            peers={"caps off": round(many["off"]["keys_per_s"])},
            note=f"{ratio:.2f}x caps off",
        )
    )
    for name, arm in (("1,000 sites", many), ("one site with 60% of due, cap 4", dominant)):
        p99_ratio = (arm["on"]["p99_ms"] or 0) / (arm["off"]["p99_ms"] or 1)
        result.figures.append(
            report.Figure(
                table=T_CLAIMS,
                what=f"claim p99 (batch 100), {name}",
                unit="ms",
                ours=round(arm["on"]["p99_ms"] or 0, 2),
                target="<= 1.5x caps off" if "cap 4" in name else "",
                peers={"caps off": round(arm["off"]["p99_ms"] or 0, 2)},
                note=f"{p99_ratio:.2f}x caps off; p50 {arm['on']['p50_ms']:.2f} ms vs "
                f"{arm['off']['p50_ms']:.2f}",
            )
        )
    result.figures.append(
        report.Figure(
            table=T_CLAIMS,
            what="keys/s, one site with 60% of due capped at 4",
            unit="keys/s",
            ours=round(dominant["on"]["keys_per_s"]),
            better="higher",
            peers={"caps off": round(dominant["off"]["keys_per_s"])},
            note=f"skipped: {dominant['skips']['capped']} capped; the capped site's keys "
            "held to its allowance by the keeper's publish",
        )
    )
    result.figures.append(
        report.Figure(
            table=T_GRANTS,
            what="grant, caps of 64 on each of 1,000 sites",
            unit="us/grant",
            ours=round(grants["caps of 64"], 3),
            peers={
                "no site table": round(grants["none"], 3),
                "site table, no settings": round(grants["no settings"], 3),
            },
            note="a permit by CAS and the site's permits counted again, before the lease CAS",
        )
    )
    result.promised = [figure.key for figure in result.figures]
    result.raw = {"many": many, "dominant": dominant, "grants_us": grants}
    return report.emit(result)


if __name__ == "__main__":
    raise SystemExit(main())
