"""The durable store on its own: single-row puts with and without a feed consumer, the
consumer's lag across processes, the walk, and point reads.

`python -m bench store [--quick] [--part all|feed|hot]`

250k rows (quick: 20k) of the shared workload (bench.harness.workload). Arms per round,
in alternating order, 10k single-row writes each (quick: 2k; 5 rounds, quick 2):
- no consumer: nobody subscribed;
- feed tailing: a consumer in another process subscribed at the head, waiting on
  the store's wake-up and polling; every event is stamped as it is polled;
- feed tailing, paced: the same at 5k writes/s (half the writes), so each write
  finds the consumer waiting: its lag is wake-up and delivery, not a backlog;
- bare sqlite3 (a peer, same run): the same upsert on a same-shaped table with no
  change log, trigger, validation or retry, to show what the store's own work costs;
- semaphore wake-up alone (a peer for the paced lag): a process blocked on a POSIX
  semaphore, posted at the paced rate: what this machine's scheduler alone adds;
- feed tailing, pinned apart (a peer for the flat-out lag): the flat-out arm with the
  writing thread and the consumer each pinned to a CPU of its own (skipped on one CPU).
  Unpinned, the kernel now and then wakes the consumer onto the writer's CPU while the
  other idles, and there it can wait for the next scheduler tick (4 ms at HZ=250): that,
  not the store, is the flat-out lag's tail on a small machine (README, the feed).
Put latency is the caller's view of `write()`; lag is from the writer's commit
(`SqliteStore.last_commit_ns`, CLOCK_MONOTONIC, shared by processes) to the poll
that delivered the event. CPU per write is the writer's process CPU (plus the
consumer's, in the feed arm). Each percentile is the median over rounds of that
round's percentile (the pooled ones are in the JSON's raw section). Then: a full
walk by primary key in 5,000-row chunks (the keeper's chunk) and random point reads.

The claim and complete path (`--part hot`; 1M rows, quick 100k): per key, a claim's
`get_many` of 100 random keys and their `complete` (rendered), alone and beside another
writer (which empties this connection's page cache before each batch, as the node's
other worker does), with the bytes written per completed key into the WAL and by the
checkpoints, and the checkpoints' CPU.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import random
import shutil
import sqlite3
import statistics
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from bench.harness import report
from bench.harness.workload import Rows, Workload, generate

TABLE = "store: SQLite, single node"
CONSUMER = "bench-store"
TAG_BASE = 10**13  # next_render_at tags: each measured write carries a unique one
PACED_INTERVAL_NS = 200_000  # 5k writes/s: each write finds the consumer idle, waiting
SLEEP_OVERSHOOT_NS = 80_000
ARMS = (
    "no consumer",
    "feed tailing",
    "bare sqlite3",
    "feed tailing, paced",
    "semaphore wake-up alone",
    "feed tailing, pinned apart",
)


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    writes: int  # per arm per round
    rounds: int
    warmup: int = 200
    reads: int = 20_000


FULL = Config(rows=250_000, writes=10_000, rounds=5)
QUICK = Config(rows=20_000, writes=2_000, rounds=2)


class Delivered(msgspec.Struct, kw_only=True):
    tags: list[int]
    at_ns: list[int]
    cpu_s: float
    polls: int
    woken: int
    noticed: int


def consumer_process(conn: Connection, url: str, cpu: int | None) -> None:
    """Subscribe at the head, then stamp each event as its poll returns, until told to stop;
    on `cpu` alone when one is given. `url`: a SQLite path or any store URL
    (bench.sections.postgres)."""
    from store import open_store
    from store.rows import RowEvent
    from store.scheduling import ask_short_slice

    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    ask_short_slice()  # as the keeper's thread does (keeper.runner.Keeper.run)
    store: Any = open_store(url)  # both backends have drop_consumer
    subscription = store.subscribe(CONSUMER, store.feed_head())
    tags: list[int] = []
    at_ns: list[int] = []
    gc.freeze()  # as the node's workers do once started (workers.worker.serve)
    conn.send("ready")
    cpu0 = time.process_time()
    stopping = False
    while True:
        batch = subscription.poll(5000)
        now = time.monotonic_ns()
        for event in batch.events:
            if isinstance(event, RowEvent) and event.row is not None:
                tags.append(event.row.next_render_at)
                at_ns.append(now)
        if stopping and not batch.events:
            break
        if not stopping and conn.poll():
            conn.recv()
            stopping = True  # poll until empty after the writer stopped, then report
            continue
        # As the keeper does: wait at once; it returns straight away if anything was
        # committed since the poll began, which costs less than another empty poll.
        subscription.wait(0.05)
    stats = subscription.statistics()
    conn.send_bytes(
        msgspec.msgpack.encode(
            Delivered(
                tags=tags,
                at_ns=at_ns,
                cpu_s=time.process_time() - cpu0,
                polls=stats.polls,
                woken=stats.woken,
                noticed=stats.noticed,
            )
        )
    )
    subscription.close()
    store.drop_consumer(CONSUMER)
    store.close()


def wakeup_process(conn: Connection, name: str, count: int) -> None:
    """The machine's own wake-up latency: block on a semaphore, note when each post lands."""
    import posix_ipc

    semaphore = posix_ipc.Semaphore(name)
    woken: list[int] = []
    conn.send("ready")
    for _ in range(count):
        semaphore.acquire()
        woken.append(time.monotonic_ns())
    semaphore.close()
    conn.send(woken)


def run_wakeups(ctx: Any, count: int, arm: Arm) -> None:
    """Posts at the paced arm's rate to a process waiting as the consumer does."""
    import posix_ipc

    name = f"/rq-bench-wake-{os.getpid()}-{random.randrange(10**9)}"
    semaphore = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=0)
    try:
        ours, theirs = ctx.Pipe()
        process = ctx.Process(target=wakeup_process, args=(theirs, name, count), daemon=True)
        process.start()
        assert ours.recv() == "ready"
        posted: list[int] = []
        slot = time.perf_counter_ns()
        for _ in range(count):
            slot += PACED_INTERVAL_NS
            gap = slot - time.perf_counter_ns() - SLEEP_OVERSHOOT_NS
            if gap > 0:
                time.sleep(gap / 1e9)
            while time.perf_counter_ns() < slot:
                pass
            posted.append(time.monotonic_ns())
            semaphore.release()
        woken: list[int] = ours.recv()
        process.join(30)
        arm.lag_ns.extend(w - p for p, w in zip(posted, woken, strict=True))
        arm.writes += count
        arm.delivered += count
    finally:
        semaphore.close()
        posix_ipc.unlink_semaphore(name)


class Arm(msgspec.Struct, kw_only=True):
    seconds: float = 0.0  # wall time of the measured writes
    put_ns: list[int] = []
    lag_ns: list[int] = []
    put_marks: list[int] = []  # len(put_ns) at the end of each round
    lag_marks: list[int] = []
    writes: int = 0
    delivered: int = 0
    cpu_s: float = 0.0

    def end_round(self) -> None:
        self.put_marks.append(len(self.put_ns))
        self.lag_marks.append(len(self.lag_ns))

    def put_us(self, q: float) -> float | None:
        found = per_round(self.put_ns, self.put_marks, q)
        return None if found is None else found / 1000

    def lag_ms(self, q: float) -> float | None:
        found = per_round(self.lag_ns, self.lag_marks, q)
        return None if found is None else found / 1e6


def per_round(values: list[int], marks: list[int], q: float) -> float | None:
    """The median over rounds of each round's percentile: one noisy round (the machine is
    shared) moves the figure less than it would move the pooled percentile."""
    figures: list[float] = []
    start = 0
    for end in marks:
        found = report.percentile(values[start:end], q)
        if found is not None:
            figures.append(found)
        start = end
    return statistics.median(figures) if figures else None


def run_puts(
    store: Any,
    keys: list[str],
    count: int,
    warmup: int,
    tag0: int,
    rng: random.Random,
    arm: Arm,
    interval_ns: int = 0,
) -> dict[int, int]:
    """Single-row writes of random existing keys, flat out or one per `interval_ns`;
    returns tag -> commit time."""
    from store.rows import RowWrite

    commits: dict[int, int] = {}
    routes = ("product", "category", "article", "search")
    slot = time.perf_counter_ns()
    for i in range(warmup + count):
        index = rng.randrange(len(keys))
        tag = tag0 + i
        row = [RowWrite(key=keys[index], route=routes[index % 4], next_render_at=tag)]
        if i == warmup:
            cpu0 = time.process_time()
            wall0 = time.perf_counter()
        if interval_ns:
            slot += interval_ns
            # Sleep most of the gap (the consumer needs the core more than this loop
            # does on two cores), then spin the last stretch a sleep would overshoot.
            gap = slot - time.perf_counter_ns() - SLEEP_OVERSHOOT_NS
            if gap > 0:
                time.sleep(gap / 1e9)
            while time.perf_counter_ns() < slot:
                pass
        started = time.perf_counter_ns()
        store.write(row)
        elapsed = time.perf_counter_ns() - started
        if i >= warmup:
            arm.put_ns.append(elapsed)
            commits[tag] = store.last_commit_ns
    arm.seconds += time.perf_counter() - wall0
    arm.cpu_s += time.process_time() - cpu0
    arm.writes += count
    return commits


def tailed_puts(
    ctx: Any,
    url: str,
    store: Any,
    keys: list[str],
    count: int,
    warmup: int,
    tag0: int,
    rng: random.Random,
    arm: Arm,
    *,
    interval_ns: int = 0,
    apart: tuple[int, int] | None = None,
) -> Delivered:
    """`run_puts` with a consumer process (`consumer_process` on the store at `url`)
    subscribed at the head: each delivered write's lag, commit to the poll that returned
    it, goes into `arm`, and the consumer's CPU into `arm.cpu_s`. `apart`: (the
    consumer's CPU, the writing thread's CPU) to pin them to."""
    ours, theirs = ctx.Pipe()
    consumer_cpu = apart[0] if apart else None
    process = ctx.Process(target=consumer_process, args=(theirs, url, consumer_cpu), daemon=True)
    process.start()
    assert ours.recv() == "ready"
    cpus = sorted(os.sched_getaffinity(0))
    if apart:
        os.sched_setaffinity(0, {apart[1]})  # this thread only: upkeep stays free
    try:
        commits = run_puts(store, keys, count, warmup, tag0, rng, arm, interval_ns=interval_ns)
    finally:
        os.sched_setaffinity(0, cpus)
    ours.send("stop")
    delivered = msgspec.msgpack.decode(ours.recv_bytes(), type=Delivered)
    process.join(30)
    arm.cpu_s += delivered.cpu_s
    for event_tag, at in zip(delivered.tags, delivered.at_ns, strict=True):
        committed = commits.get(event_tag)
        if committed is not None:
            arm.lag_ns.append(at - committed)
            arm.delivered += 1
    return delivered


BARE_SCHEMA = """CREATE TABLE IF NOT EXISTS render_schedule (
    key TEXT PRIMARY KEY NOT NULL, route TEXT NOT NULL, cadence_s INTEGER,
    sitemap INTEGER NOT NULL, next_render_at INTEGER NOT NULL, last_rendered_at INTEGER,
    last_outcome TEXT, version INTEGER NOT NULL) WITHOUT ROWID"""
BARE_UPSERT = """INSERT INTO render_schedule (key, route, cadence_s, sitemap, next_render_at,
    version) VALUES (?, ?, NULL, 0, ?, 1) ON CONFLICT (key) DO UPDATE SET
    route = excluded.route, next_render_at = excluded.next_render_at, version = version + 1"""


def bare_open(path: str, rows: Any) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    for pragma in ("synchronous = NORMAL", "cache_size = -32000"):
        conn.execute(f"PRAGMA {pragma}")
    conn.execute(BARE_SCHEMA)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO render_schedule VALUES (?, ?, ?, ?, ?, NULL, NULL, 1)",
        zip(
            rows.keys, rows.routes, rows.cadences_s, rows.sitemaps, rows.next_render_at, strict=True
        ),
    )
    conn.execute("COMMIT")
    return conn


def run_bare(
    conn: sqlite3.Connection, keys: list[str], count: int, warmup: int, rng: random.Random, arm: Arm
) -> None:
    routes = ("product", "category", "article", "search")
    for i in range(warmup + count):
        index = rng.randrange(len(keys))
        if i == warmup:
            cpu0 = time.process_time()
        started = time.perf_counter_ns()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(BARE_UPSERT, (keys[index], routes[index % 4], TAG_BASE + i))
        conn.execute("COMMIT")
        elapsed = time.perf_counter_ns() - started
        if i >= warmup:
            arm.put_ns.append(elapsed)
    arm.cpu_s += time.process_time() - cpu0
    arm.writes += count


def ms(values: list[int], q: float) -> float | None:
    found = report.percentile(values, q)
    return None if found is None else found / 1e6


def us(values: list[int], q: float) -> float | None:
    found = report.percentile(values, q)
    return None if found is None else found / 1000


HOT_TABLE = "store: the node's claim and complete path"
HOT_BATCH = 100
UPKEEP_THREAD = "rq-store-upkeep"
HOT_ARMS = ("alone", "beside another writer")


class HotConfig(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    batches: int  # measured batches of HOT_BATCH keys, per arm
    warmup: int = 20


HOT_FULL = HotConfig(rows=1_000_000, batches=300)
HOT_QUICK = HotConfig(rows=100_000, batches=40)


class ThreadUse(msgspec.Struct, frozen=True, kw_only=True):
    cpu_ns: int
    write_bytes: int | None  # None: no per-thread I/O accounting here (not Linux)


def thread_use(thread: threading.Thread | None) -> ThreadUse:
    """CPU and bytes written so far by one thread of this process (None: the calling one)."""
    if thread is None:
        cpu_ns, native_id = time.thread_time_ns(), threading.get_native_id()
    else:
        if thread.ident is None or thread.native_id is None:
            return ThreadUse(cpu_ns=0, write_bytes=None)
        cpu_ns = time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
        native_id = thread.native_id
    try:
        text = Path(f"/proc/self/task/{native_id}/io").read_text()
    except OSError:
        return ThreadUse(cpu_ns=cpu_ns, write_bytes=None)
    fields = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return ThreadUse(cpu_ns=cpu_ns, write_bytes=int(fields["write_bytes"]))


def bytes_written(before: list[ThreadUse], after: list[ThreadUse]) -> int | None:
    """What the threads wrote between two readings; None without per-thread accounting."""
    total = 0
    for a, b in zip(before, after, strict=True):
        if a.write_bytes is None or b.write_bytes is None:
            return None
        total += b.write_bytes - a.write_bytes
    return total


class HotArm(msgspec.Struct, kw_only=True):
    read_ns: list[float] = []  # per key, one figure per batch
    complete_ns: list[float] = []
    read_cpu_ns: int = 0
    complete_cpu_ns: int = 0
    keys: int = 0


def run_hot(config: HotConfig, work: Path, result: report.SectionResult) -> None:
    """The node's store work per key: a claim's point read of 100 keys (`get_many`), then
    their completion (`complete`, all rendered), on random keys of a large table, with the
    store's background checkpoints. "alone": this store is the only writer, so its page
    cache survives between batches; "beside another writer": another store commits one
    row before each batch, as the node's other worker does, and SQLite drops this
    connection's page cache at its next transaction. Bytes are the kernel's per-thread
    accounting (whole 4 KiB pages dirtied): the caller's are its commits' WAL appends,
    the upkeep thread's its checkpoints' writes into the database file."""
    from store.rows import Completion, RowWrite
    from store.sqlite import SqliteStore

    path = str(work / "hot.db")
    report.progress(f"store: loading {config.rows:,} rows for the claim and complete path")
    rows = generate(Workload(rows=config.rows, now_ms=time.time_ns() // 1_000_000))
    store = SqliteStore(path)
    load_rows(store, rows)
    store.prune()
    other = SqliteStore(path)
    keys = rows.keys
    rng = random.Random(17)
    now_ms = time.time_ns() // 1_000_000

    def batch() -> tuple[list[str], list[Completion]]:
        picked = rng.sample(keys, HOT_BATCH)
        return picked, [Completion(key=k, outcome="rendered", now=now_ms) for k in picked]

    nudge = RowWrite(key=keys[0], route=rows.routes[0], next_render_at=now_ms)
    for _ in range(config.warmup):
        picked, done = batch()
        store.get_many(picked)
        store.complete(done)
    other.write([nudge])
    time.sleep(0.3)  # the warm-up's checkpoint lands before the counters are read
    # Both stores' threads: whichever finds the WAL grown checkpoints it.
    upkeep = [t for t in threading.enumerate() if t.name == UPKEEP_THREAD]
    arms = {name: HotArm() for name in HOT_ARMS}
    theirs0 = [thread_use(t) for t in upkeep]
    wal_bytes: int | None = 0
    report.progress(f"store: {config.batches} batches of {HOT_BATCH} per arm: get_many, complete")
    for n in range(config.batches * len(HOT_ARMS)):
        arm = arms[HOT_ARMS[n % len(HOT_ARMS)]]
        picked, done = batch()
        if arm is arms["beside another writer"]:
            other.write([nudge])
        mine0 = thread_use(None)
        cpu0, started = time.thread_time_ns(), time.perf_counter_ns()
        found = store.get_many(picked)
        cpu1, read = time.thread_time_ns(), time.perf_counter_ns()
        store.complete(done)
        cpu2, completed = time.thread_time_ns(), time.perf_counter_ns()
        written = bytes_written([mine0], [thread_use(None)])
        wal_bytes = None if wal_bytes is None or written is None else wal_bytes + written
        assert len(found) == HOT_BATCH
        arm.read_ns.append((read - started) / HOT_BATCH)
        arm.complete_ns.append((completed - read) / HOT_BATCH)
        arm.read_cpu_ns += cpu1 - cpu0
        arm.complete_cpu_ns += cpu2 - cpu1
        arm.keys += HOT_BATCH
    time.sleep(0.3)  # the checkpoint of the last batches, counted with the rest
    theirs1 = [thread_use(t) for t in upkeep]
    checkpoint_cpu_ns = sum(b.cpu_ns - a.cpu_ns for a, b in zip(theirs0, theirs1, strict=True))
    checkpoint_bytes = bytes_written(theirs0, theirs1)
    stats = store.statistics()
    other.close()
    store.close()
    keys_done = sum(arm.keys for arm in arms.values())
    scale = (
        f"{config.rows // 1_000_000}M rows"
        if config.rows >= 1_000_000
        else f"{config.rows // 1000}k rows"
    )

    def fig(what: str, unit: str, ours: float | None, note: str = "") -> None:
        result.figures.append(
            report.Figure(table=HOT_TABLE, what=what, unit=unit, ours=ours, note=note)
        )

    for name, arm in arms.items():
        fig(
            f"get_many, {HOT_BATCH} random keys of {scale}, per key, {name}",
            "us",
            statistics.median(arm.read_ns) / 1000,
            note=f"CPU {arm.read_cpu_ns / arm.keys / 1000:.2f} us",
        )
        fig(
            f"complete, {HOT_BATCH} random keys of {scale}, per key, {name}",
            "us",
            statistics.median(arm.complete_ns) / 1000,
            note=f"CPU {arm.complete_cpu_ns / arm.keys / 1000:.2f} us; all rendered",
        )
    fig(
        "WAL bytes written per completed key",
        "B",
        None if wal_bytes is None else wal_bytes / keys_done,
        note="the caller's thread, in get_many and complete",
    )
    fig(
        "checkpoint bytes written per completed key",
        "B",
        None if checkpoint_bytes is None else checkpoint_bytes / keys_done,
        note="the stores' upkeep threads",
    )
    fig(
        "checkpoint CPU per completed key",
        "us",
        checkpoint_cpu_ns / keys_done / 1000,
        note="the stores' upkeep threads",
    )
    result.raw["hot"] = {
        "config": msgspec.to_builtins(config),
        "read_us_p99": {n: us([int(v) for v in a.read_ns], 99) for n, a in arms.items()},
        "complete_us_p99": {n: us([int(v) for v in a.complete_ns], 99) for n, a in arms.items()},
        "upkeep": msgspec.to_builtins(stats.upkeep),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench store", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="20k rows, 2 rounds of 2k writes; 100k rows hot"
    )
    parser.add_argument(
        "--part",
        choices=("all", "feed", "hot"),
        default="all",
        help="feed: puts, the feed's lag, walk and reads; hot: the claim and complete path",
    )
    args = parser.parse_args(argv)
    result = report.new_result("store", args.quick)
    work = Path(tempfile.mkdtemp(prefix=f"rq-bench-store-{os.getpid()}-"))
    try:
        if args.part != "hot":
            run_feed(QUICK if args.quick else FULL, work, result)
        if args.part != "feed":
            run_hot(HOT_QUICK if args.quick else HOT_FULL, work, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.promised = [f.key for f in result.figures]
    return report.emit(result)


def load_rows(store: Any, rows: Rows) -> None:
    """The workload's rows, in chunks of 5,000 (no row carries its own cadence here)."""
    from store.rows import RowWrite

    for part in rows.chunks(5000):
        store.write(
            [
                RowWrite(
                    key=rows.keys[i],
                    route=rows.routes[i],
                    next_render_at=rows.next_render_at[i],
                    sitemap=rows.sitemaps[i],
                )
                for i in part
            ]
        )


def run_feed(config: Config, work: Path, result: report.SectionResult) -> None:
    from store.sqlite import SqliteStore

    path = str(work / "schedule.db")
    report.progress(f"store: loading {config.rows:,} rows into {path}")
    rows = generate(Workload(rows=config.rows, now_ms=time.time_ns() // 1_000_000))
    store = SqliteStore(path)
    load_rows(store, rows)
    bare = bare_open(str(work / "bare.db"), rows)
    keys = rows.keys
    rng = random.Random(11)
    arms = {name: Arm() for name in ARMS}
    woken = noticed = 0
    ctx = mp.get_context("spawn")
    # The pinned arm's CPUs: the consumer on the first, the writing thread on the last.
    cpus = sorted(os.sched_getaffinity(0))
    apart = (cpus[0], cpus[-1]) if len(cpus) > 1 else None
    tag = TAG_BASE
    for round_no in range(config.rounds):
        order = list(ARMS)
        if round_no % 2:
            order.reverse()
        for name in order:
            report.progress(f"store: round {round_no + 1}/{config.rounds}, {name}")
            arm = arms[name]
            if name == "bare sqlite3":
                run_bare(bare, keys, config.writes, config.warmup, rng, arm)
                arm.end_round()
                continue
            if name == "semaphore wake-up alone":
                run_wakeups(ctx, config.writes // 2, arm)
                arm.end_round()
                continue
            if name == "no consumer":
                run_puts(store, keys, config.writes, config.warmup, tag, rng, arm)
                tag += config.warmup + config.writes
                arm.end_round()
                continue
            pinned = name == "feed tailing, pinned apart"
            if pinned and apart is None:
                arm.end_round()
                continue
            is_paced = name == "feed tailing, paced"
            delivered = tailed_puts(
                ctx,
                path,
                store,
                keys,
                config.writes // 2 if is_paced else config.writes,
                config.warmup,
                tag,
                rng,
                arm,
                interval_ns=PACED_INTERVAL_NS if is_paced else 0,
                apart=apart if pinned else None,
            )
            tag += config.warmup + config.writes
            woken += delivered.woken
            noticed += delivered.noticed
            arm.end_round()

    report.progress("store: walk and point reads")
    walks: list[float] = []
    for _ in range(3):
        started = time.perf_counter()
        walked, after = 0, None
        while True:
            chunk = store.walk(after, 5000)
            walked += len(chunk)
            if len(chunk) < 5000:
                break
            after = chunk[-1].key
        walks.append(time.perf_counter() - started)
        assert walked == config.rows
    walk_s = sorted(walks)[1]
    reads: list[int] = []
    for _ in range(config.reads):
        wanted = keys[rng.randrange(len(keys))]
        started = time.perf_counter_ns()
        store.get(wanted)
        reads.append(time.perf_counter_ns() - started)
    started = time.perf_counter_ns()
    batches = max(1, config.reads // 100)
    for _ in range(batches):
        store.get_many(rng.sample(keys, 100))
    get_many_us = (time.perf_counter_ns() - started) / (batches * 100) / 1000
    stats = store.statistics()
    store.close()
    bare.close()

    quiet, fed, peer = arms["no consumer"], arms["feed tailing"], arms["bare sqlite3"]
    paced = arms["feed tailing, paced"]
    wakeups = arms["semaphore wake-up alone"]
    wake_peer = "semaphore wake-up alone"
    pinned_arm = arms["feed tailing, pinned apart"]
    pinned_peer = "pinned apart"
    bare_peer = "bare sqlite3"
    scale = f"{config.rows // 1000}k rows"

    def fig(what: str, unit: str, ours: float | None, **kw: Any) -> None:
        result.figures.append(report.Figure(table=TABLE, what=what, unit=unit, ours=ours, **kw))

    fig(
        "put p50, no consumer",
        "us",
        quiet.put_us(50),
        seed=92.0,
        target="lower",
        peers={bare_peer: peer.put_us(50)},
    )
    fig(
        "put p99, no consumer",
        "us",
        quiet.put_us(99),
        seed=183.0,
        target="lower",
        peers={bare_peer: peer.put_us(99)},
    )
    fig("put p50, consumer tailing the feed", "us", fed.put_us(50), seed=97.0, target="lower")
    fig("put p99, consumer tailing the feed", "us", fed.put_us(99), seed=188.0, target="lower")
    for arm, rate in ((paced, "5k writes/s"), (fed, "writer flat out")):
        peers = (
            {wake_peer: wakeups.lag_ms(50)}
            if arm is paced
            else {pinned_peer: pinned_arm.lag_ms(50)}
        )
        fig(
            f"lag p50, commit to delivery, across processes, {rate}",
            "ms",
            arm.lag_ms(50),
            target="lower",
            peers=peers,
        )
        peers = (
            {wake_peer: wakeups.lag_ms(99)}
            if arm is paced
            else {pinned_peer: pinned_arm.lag_ms(99)}
        )
        fig(
            f"lag p99, commit to delivery, across processes, {rate}",
            "ms",
            arm.lag_ms(99),
            seed=0.8,
            target="lower",
            peers=peers,
            note=""
            if arm is paced
            else f"{fed.writes / fed.seconds:,.0f} writes/s"
            if fed.seconds
            else "",
        )
    fig(
        "events per write (feed)",
        "",
        fed.delivered / fed.writes if fed.writes else None,
        seed=1.0,
        target="1",
        better="higher",
        note="an event coalesces repeat writes of one key within a poll",
    )
    fig(
        "process CPU per write, no consumer",
        "us",
        quiet.cpu_s / quiet.writes * 1e6 if quiet.writes else None,
        seed=106.0,
        target="lower",
        peers={bare_peer: peer.cpu_s / peer.writes * 1e6 if peer.writes else None},
    )
    fig(
        "process CPU per write, writer + consumer",
        "us",
        fed.cpu_s / fed.writes * 1e6 if fed.writes else None,
        seed=142.0,
        target="lower",
    )
    fig(
        f"walk by primary key, {scale}",
        "s",
        walk_s,
        seed=0.9,
        target="lower",
        note="seed: the keeper's whole rebuild at 250k; ours: the store's walk alone",
    )
    fig("walk per row", "us", walk_s / config.rows * 1e6)
    fig("point read p50 (get)", "us", us(reads, 50))
    fig("point read p99 (get)", "us", us(reads, 99))
    fig("get_many, per key (100 keys a call)", "us", get_many_us)
    result.raw.update(
        {
            "config": msgspec.to_builtins(config),
            "writes_per_arm": {name: arm.writes for name, arm in arms.items()},
            "events_per_write": {
                name: a.delivered / a.writes for name, a in arms.items() if a.lag_ns
            },
            "put_p999_us": {name: arm.put_us(99.9) for name, arm in arms.items()},
            "pooled_put_p99_us": {name: us(arm.put_ns, 99) for name, arm in arms.items()},
            "pooled_lag_p99_ms": {name: ms(arm.lag_ns, 99) for name, arm in arms.items()},
            "lag_max_ms": {n: max(a.lag_ns) / 1e6 for n, a in arms.items() if a.lag_ns},
            "put_us_paced": {"p50": paced.put_us(50), "p99": paced.put_us(99)},
            "consumer_waits_ended_by_post": woken,
            "consumer_waits_ended_by_data_version": noticed,
            "walk_s_runs": walks,
            "store_statistics": msgspec.to_builtins(stats),
        }
    )


if __name__ == "__main__":
    raise SystemExit(main())
