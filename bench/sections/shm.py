"""Shared memory: our atomics beside the PyPI `atomics` package and ctypes on libatomic,
then the key hash, the ready ring's claim, the lease table's grant, and contended grants.

    .venv/bin/python -m bench shm [--quick]

Every atomic figure is the wall time of a Python loop calling the operation on one word
of a POSIX shared memory segment, divided by the calls: what a worker pays per call,
Python's call overhead included, which is the cost that decides whether a claim path
can afford atomics at all. The three contenders run interleaved, round after round, and
each figure is the median of its rounds, so a noisy neighbour moves all three alike.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import mmap
import multiprocessing
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import posix_ipc

from bench.harness import report
from shm import Grant, LeaseTable, ReadyRing, key_hash, key_hashes, segment_name, use_secret
from shm._atomics import Words
from shm.segment import remove

SECTION = "shm"
# Key hashes are keyed (shm/keys.py); a fixed secret keeps one run's tables like the next's.
BENCH_SECRET = b"renderqueue-bnch"
ATOMICS = "atomics (PyPI)"
CTYPES = "ctypes libatomic"
ONE_PROCESS = "one process"
OPS = ("load", "store", "fetch_add", "cas")
T_ATOMIC = "atomic operations on a shared 8-byte word, called from Python"
T_PATHS = "claim path"
SEQ_CST = 5  # __ATOMIC_SEQ_CST


def _instance() -> str:
    return f"bench{os.getpid()}x{uuid.uuid4().hex[:6]}"


def _loop_ns(op: Callable[..., object], args: tuple[Any, ...], calls: int) -> float:
    """ns per call of op(*args), in a loop as tight as a caller would write."""
    started = time.perf_counter_ns()
    if not args:
        for _ in range(calls):
            op()
    elif len(args) == 1:
        (a,) = args
        for _ in range(calls):
            op(a)
    elif len(args) == 2:
        a, b = args
        for _ in range(calls):
            op(a, b)
    elif len(args) == 3:
        a, b, c = args
        for _ in range(calls):
            op(a, b, c)
    else:
        for _ in range(calls):
            op(*args)
    return (time.perf_counter_ns() - started) / calls


# ------------------------------------------------------------------ contenders


def _ours(mm: mmap.mmap) -> tuple[dict[str, Callable[[int], float]], Callable[[], None]]:
    words = Words(mm)

    def run(op: str) -> Callable[[int], float]:
        if op == "load":
            return lambda n: _loop_ns(words.load, (1,), n)
        if op == "store":
            return lambda n: _loop_ns(words.store, (1, 7), n)
        if op == "fetch_add":
            return lambda n: _loop_ns(words.fetch_add, (1, 1), n)
        return lambda n: _loop_ns(words.cas, (1, 0, 0), n)  # a failing CAS still does the work

    return {op: run(op) for op in OPS}, words.release


def _atomics_package(
    mm: mmap.mmap,
) -> tuple[dict[str, Callable[[int], float]], Callable[[], None]]:
    import atomics

    view = memoryview(mm)[16:24]
    context = atomics.atomicview(buffer=view, atype=atomics.UINT)
    word = context.__enter__()

    def close() -> None:
        context.__exit__(None, None, None)
        view.release()

    runs = {
        "load": lambda n: _loop_ns(word.load, (), n),
        "store": lambda n: _loop_ns(word.store, (7,), n),
        "fetch_add": lambda n: _loop_ns(word.fetch_add, (1,), n),
        "cas": lambda n: _loop_ns(word.cmpxchg_strong, (0, 0), n),
    }
    return runs, close


def _ctypes_libatomic(
    mm: mmap.mmap,
) -> tuple[dict[str, Callable[[int], float]], Callable[[], None]]:
    found = ctypes.util.find_library("atomic")
    if found is None:
        raise RuntimeError("libatomic not found: apt-get install -y libatomic1")
    lib = ctypes.CDLL(found)
    cell = ctypes.c_uint64.from_buffer(mm, 24)
    address = ctypes.addressof(cell)
    expected = ctypes.c_uint64(0)
    load = getattr(lib, "__atomic_load_8")
    load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
    store = getattr(lib, "__atomic_store_8")
    store.argtypes, store.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
    fetch_add = getattr(lib, "__atomic_fetch_add_8")
    fetch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]
    fetch_add.restype = ctypes.c_uint64
    cas = getattr(lib, "__atomic_compare_exchange_8")
    cas.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_int]
    cas.restype = ctypes.c_bool
    expected_address = ctypes.addressof(expected)
    runs = {
        "load": lambda n: _loop_ns(load, (address, SEQ_CST), n),
        "store": lambda n: _loop_ns(store, (address, 7, SEQ_CST), n),
        "fetch_add": lambda n: _loop_ns(fetch_add, (address, 1, SEQ_CST), n),
        "cas": lambda n: _loop_ns(cas, (address, expected_address, 0, SEQ_CST, SEQ_CST), n),
    }

    def close() -> None:
        nonlocal cell
        del cell  # the ctypes object holds an export of the mapping

    return runs, close


def measure_atomics(quick: bool) -> dict[str, dict[str, float]]:
    name = segment_name(_instance(), "atomics")
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096)
    mm = mmap.mmap(shm.fd, shm.size)
    shm.close_fd()
    contenders = {"ours": _ours(mm), ATOMICS: _atomics_package(mm), CTYPES: _ctypes_libatomic(mm)}
    calls = {"ours": 200_000, ATOMICS: 5_000, CTYPES: 100_000}
    if quick:
        calls = {k: max(500, v // 20) for k, v in calls.items()}
    rounds = 3 if quick else 7
    samples: dict[str, dict[str, list[float]]] = {c: {op: [] for op in OPS} for c in contenders}
    for round_ in range(rounds):
        report.progress(f"shm: atomics round {round_ + 1}/{rounds}")
        for op in OPS:
            for contender, (runs, _) in contenders.items():
                samples[contender][op].append(runs[op](calls[contender]))
    for _, close in contenders.values():
        close()
    try:
        mm.close()
    finally:
        posix_ipc.unlink_shared_memory(name)
    return {c: {op: statistics.median(v) for op, v in ops.items()} for c, ops in samples.items()}


# ---------------------------------------------------------------- claim path


def _keys(n: int, prefix: bytes = b"https://shop.example/product/") -> list[bytes]:
    return [prefix + b"%08d" % i for i in range(n)]


def measure_hashing(quick: bool) -> dict[str, float]:
    """Per key, over URLs of 64 bytes: key_hash called once per key from a Python loop
    (how the API hashes), and key_hashes of 5,000 in one call (how the keeper does)."""
    keys = _keys(5000, b"https://shop.example.com/category/some-sections/product/")
    assert all(len(key) == 64 for key in keys)
    rounds = 3 if quick else 15
    one, many = [], []
    for _ in range(rounds):
        started = time.perf_counter_ns()
        for key in keys:
            key_hash(key)
        one.append((time.perf_counter_ns() - started) / len(keys))
        started = time.perf_counter_ns()
        key_hashes(keys)
        many.append((time.perf_counter_ns() - started) / len(keys))
    return {"key_hash_ns": statistics.median(one), "key_hashes_ns": statistics.median(many)}


def measure_ring(quick: bool) -> dict[str, float]:
    """Per round: publish 8,192 entries and claim them all; figures are round medians."""
    name = segment_name(_instance(), "ring")
    capacity = 8192
    ring = ReadyRing.create(name, capacity=capacity, arena_bytes=capacity * 256)
    try:
        keys = _keys(capacity)
        due = np.arange(capacity, dtype=np.int64)
        classes = np.zeros(capacity, dtype=np.int32)
        hashes = key_hashes(keys)
        rounds = 3 if quick else 15
        batched: list[float] = []
        singles: list[float] = []
        publish_ms: list[float] = []
        for _ in range(rounds):
            started = time.perf_counter_ns()
            ring.publish(keys[:5000], due[:5000], classes[:5000], hashes[:5000], 1)
            publish_ms.append((time.perf_counter_ns() - started) / 1e6)
            for size, samples in ((64, batched), (1, singles)):
                ring.publish(keys, due, classes, hashes, 1)
                claim, claimed = ring.claim, 0
                started = time.perf_counter_ns()
                while batch := claim(size):
                    claimed += len(batch)
                samples.append((time.perf_counter_ns() - started) / claimed / 1000)
        return {
            "claim64_us": statistics.median(batched),
            "claim1_us": statistics.median(singles),
            "publish5000_ms": statistics.median(publish_ms),
        }
    finally:
        ring.close()
        remove(name)


def measure_grants(quick: bool) -> dict[str, float]:
    """Per round, a fresh table: first grants (insert), completes, grants again, refusals."""
    n = 8_000  # keys in 65,536 slots (12%): below where the first probe window fills
    hashes = [int(h) for h in key_hashes(_keys(n))]
    best = np.array(hashes[:5000], dtype=np.uint64)
    samples: dict[str, list[float]] = {
        k: [] for k in ("grant_insert_us", "grant_us", "refusal_us", "complete_us")
    }
    samples["blocked_mask_5000_us"] = []
    for _ in range(2 if quick else 7):
        name = segment_name(_instance(), "leases")
        table = LeaseTable.create(name, capacity=1 << 16)
        try:
            grant, complete = table.grant, table.complete
            started = time.perf_counter_ns()
            grants = [grant(h, 1_000, 60_000, 3_600_000) for h in hashes]
            samples["grant_insert_us"].append((time.perf_counter_ns() - started) / n / 1000)
            won = [
                (h, g.token) for h, g in zip(hashes, grants, strict=True) if isinstance(g, Grant)
            ]
            if len(won) != n:
                raise RuntimeError(f"{n - len(won)} of {n} uncontended grants refused")
            started = time.perf_counter_ns()
            for h, token in won:
                complete(h, token, 2_000)
            samples["complete_us"].append((time.perf_counter_ns() - started) / n / 1000)
            for key in ("grant_us", "refusal_us"):  # the second pass finds every key leased
                started = time.perf_counter_ns()
                for h in hashes:
                    grant(h, 3_000, 60_000, 3_600_000)
                samples[key].append((time.perf_counter_ns() - started) / n / 1000)
            mask = functools.partial(table.blocked_mask, best, 3_000)
            mask_ns = min(_timed(mask) for _ in range(5))
            samples["blocked_mask_5000_us"].append(mask_ns / 1000)
        finally:
            table.close()
            remove(name)
    return {key: statistics.median(values) for key, values in samples.items()}


def measure_statistics(quick: bool) -> dict[str, float]:
    """statistics() (the live counters) beside census() (the full scan it replaced), on a
    table of 2**20 slots (2**16 quick) holding 8,000 leases, a quarter of them expired."""
    capacity = 1 << (16 if quick else 20)
    name = segment_name(_instance(), "stats")
    table = LeaseTable.create(name, capacity=capacity)
    try:
        hashes = [int(h) for h in key_hashes(_keys(8_000, b"https://shop.example/s/"))]
        for i, h in enumerate(hashes):
            table.grant(h, 1_000, 1_000 if i % 4 == 0 else 60_000, 3_600_000)
        stats_ns = [_timed(table.statistics) for _ in range(51)]
        census_ns = [_timed(functools.partial(table.census, 5_000)) for _ in range(5)]
        return {
            "capacity": capacity,
            "statistics_us": statistics.median(stats_ns) / 1000,
            "census_ms": statistics.median(census_ns) / 1e6,
        }
    finally:
        table.close()
        remove(name)


def measure_occupancy(quick: bool) -> dict[str, float]:
    """How full a table gets before its bounded windows start refusing (no completions)."""
    capacity = 1 << 16
    trials = 1 if quick else 3
    first: list[float] = []
    at_half: list[float] = []
    for trial in range(trials):
        name = segment_name(_instance(), "occupancy")
        table = LeaseTable.create(name, capacity=capacity)
        try:
            hashes = key_hashes(_keys(capacity // 2, b"trial-%d/" % trial))
            refused = 0
            for i, h in enumerate(hashes.tolist()):
                if not isinstance(table.grant(h, 1_000, 60_000, 3_600_000), Grant):
                    refused += 1
                    if len(first) == trial:
                        first.append((i - refused + 1) / capacity)
            at_half.append(refused / len(hashes))
        finally:
            table.close()
            remove(name)
    return {
        "first_refusal_pct": 100 * statistics.median(first) if first else 50.0,
        "refused_to_half_pct": 100 * statistics.median(at_half),
    }


def _timed(call: Callable[[], object]) -> int:
    started = time.perf_counter_ns()
    call()
    return time.perf_counter_ns() - started


def _contend(name: str, hashes: list[int], seconds: float, start: Any) -> tuple[int, int]:
    table = LeaseTable.attach(name)
    grant, complete = table.grant, table.complete
    start.wait(60)
    calls = wins = 0
    deadline = time.monotonic() + seconds
    i = 0  # every process walks the same keys in the same order: they collide
    while time.monotonic() < deadline:
        now = time.time_ns() // 1_000_000
        for _ in range(64):
            h = hashes[i % len(hashes)]
            i += 1
            got = grant(h, now, 60_000, 3_600_000)
            calls += 1
            if isinstance(got, Grant):
                wins += 1
                complete(h, got.token, now)
    table.close()
    return calls, wins


def measure_contention(quick: bool) -> dict[str, float]:
    seconds = 1.0 if quick else 5.0
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, float] = {}
    for processes in (1, 2):
        name = segment_name(_instance(), "contend")
        table = LeaseTable.create(name, capacity=1 << 14)
        try:
            hashes = [int(h) for h in key_hashes(_keys(1_000))]  # every process, same keys
            start = ctx.Manager().Event()
            with ctx.Pool(processes) as pool:
                runs = [
                    pool.apply_async(_contend, (name, hashes, seconds, start))
                    for _ in range(processes)
                ]
                time.sleep(0.5)
                start.set()
                results = [r.get(seconds + 120) for r in runs]
            calls = sum(r[0] for r in results)
            wins = sum(r[1] for r in results)
            out[f"calls_per_s_{processes}"] = calls / seconds
            out[f"wins_per_s_{processes}"] = wins / seconds
            report.progress(f"shm: {processes} process(es): {calls / seconds:,.0f} grants/s")
        finally:
            table.close()
            remove(name)
    return out


# -------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench shm", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="scaled down; checks rows only")
    quick: bool = parser.parse_args(argv).quick
    result = report.new_result(SECTION, quick)
    use_secret(BENCH_SECRET)

    atomic = measure_atomics(quick)
    report.progress("shm: key hashes")
    hashing = measure_hashing(quick)
    report.progress("shm: ring")
    ring = measure_ring(quick)
    report.progress("shm: grants")
    grants = measure_grants(quick)
    report.progress("shm: lease statistics")
    lease_stats = measure_statistics(quick)
    report.progress("shm: occupancy")
    occupancy = measure_occupancy(quick)
    report.progress("shm: contended grants")
    contention = measure_contention(quick)

    for op in OPS:
        ours = atomic["ours"][op]
        result.figures.append(
            report.Figure(
                table=T_ATOMIC,
                what=op,
                unit="ns/op",
                ours=round(ours, 1),
                seed=100.0,
                seed_text="~100 (design)",
                target="<= 150, >= 50x faster than atomics",
                peers={
                    ATOMICS: round(atomic[ATOMICS][op], 1),
                    CTYPES: round(atomic[CTYPES][op], 1),
                },
                note=f"{atomic[ATOMICS][op] / ours:.0f}x faster than atomics, "
                f"{atomic[CTYPES][op] / ours:.1f}x than ctypes",
            )
        )
    hashed = "SipHash-2-4 under the database's secret"
    paths = [
        ("claim, per entry (batches of 64)", "us/entry", ring["claim64_us"], ""),
        ("claim, per entry (one per call)", "us/entry", ring["claim1_us"], ""),
        ("publish 5,000 keys (keeper, each second)", "ms", ring["publish5000_ms"], ""),
        ("grant, key already in the table", "us/grant", grants["grant_us"], ""),
        ("grant, first grant (inserts the key)", "us/grant", grants["grant_insert_us"], ""),
        ("grant refused (taken)", "us/call", grants["refusal_us"], ""),
        ("complete", "us/call", grants["complete_us"], ""),
        ("blocked_mask of 5,000 hashes", "us/call", grants["blocked_mask_5000_us"], ""),
        ("key_hash of a 64-byte URL, one call per key (loop included)", "ns/key",
         hashing["key_hash_ns"], hashed),
        ("key_hashes of 5,000 64-byte URLs in one call, per key", "ns/key",
         hashing["key_hashes_ns"], hashed),
    ]  # fmt: skip
    for what, unit, value, note in paths:
        result.figures.append(
            report.Figure(table=T_PATHS, what=what, unit=unit, ours=round(value, 3), note=note)
        )
    result.figures.append(
        report.Figure(
            table=T_PATHS,
            what=f"lease statistics(), {lease_stats['capacity']:,} slots",
            unit="us/call",
            ours=round(lease_stats["statistics_us"], 1),
            peers={"full scan (census)": round(lease_stats["census_ms"] * 1000, 1)},
            note="live counters kept by the ops; census() is the scan statistics() was",
        )
    )
    result.figures.append(
        report.Figure(
            table=T_PATHS,
            what="occupancy at the first probe_full (random keys, 65,536 slots)",
            unit="%",
            ours=round(occupancy["first_refusal_pct"], 1),
            better="higher",
            note="8-slot window, linear probing; no completed slots to take",
        )
    )
    result.figures.append(
        report.Figure(
            table=T_PATHS,
            what="grants refused probe_full while filling to 50%",
            unit="%",
            ours=round(occupancy["refused_to_half_pct"], 2),
        )
    )
    for kind, label in (("calls", "grant calls"), ("wins", "grants won (then completed)")):
        result.figures.append(
            report.Figure(
                table=T_PATHS,
                what=f"contended {label} per second, two processes, same 1k keys",
                unit="/s",
                ours=round(contention[f"{kind}_per_s_2"]),
                better="higher",
                peers={ONE_PROCESS: round(contention[f"{kind}_per_s_1"])},
                note="the machine has 2 cores",
            )
        )
    result.promised = [figure.key for figure in result.figures]
    result.raw = {
        "atomics_ns": atomic,
        "hashing": hashing,
        "ring": ring,
        "grants": grants,
        "lease_statistics": lease_stats,
        "occupancy": occupancy,
        "contention": contention,
    }
    worst = max(atomic["ours"][op] for op in OPS)
    slowest_ratio = min(atomic[ATOMICS][op] / atomic["ours"][op] for op in OPS)
    print(
        f"Atomics: ours at most {worst:.0f} ns an operation (target <= 150), at least "
        f"{slowest_ratio:.0f}x faster than the atomics package (target >= 50x).\n"
        f"Command: .venv/bin/python -m bench shm{' --quick' if quick else ''}\n"
    )
    return report.emit(result)


if __name__ == "__main__":
    raise SystemExit(main())
