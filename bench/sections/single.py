"""The seed's "Single node" table, reproduced on renderqueue.

`python -m bench single [--quick]`

250k rows (quick: 20k). Two processes stand for the node's two workers: a
writer (single-row schedule writes, as a worker applying the fleet's results
would) and worker 0, which hosts the feed consumer or the keeper in a thread.
Arms, interleaved in each of 5 rounds (quick: 2), 50k single-row writes each
(quick: 2k): no feed consumer; a feed consumer without the keeper; the feed
and the keeper. Then a batch-write arm (100 rows per commit) with the keeper
still subscribed, so no replay of earlier writes lands in it.

Per arm: put p50/p99; process CPU per write (writer + worker 0, psutil); the
consuming thread's CPU per write (its own thread clock); events per write and
lag p99, commit to delivery, from a thin wrapper around the subscription that
stamps each event as it is polled (the keeper's own code is untouched). The
keeper is started before its arm and waited on until it is live and exact, so
its load is never in the arm; that start is also the rebuild figure.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from bench.harness import report
from bench.harness.workload import Workload, generate
from store.base import FeedBatch
from store.sqlite.feed import NEW_FOR_S

FEED_CONSUMER = "bench-feed"
SEED = {
    "put p50": (92.0, 97.0, 98.0),
    "put p99": (183.0, 188.0, 212.0),
    "process CPU per write": (106.0, 142.0, 152.0),
    "consumer thread busy per write": (None, 26.0, 31.0),
    "events per write": (None, 1.0, 1.0),
    "lag p99": (None, 0.8, 0.8),
}
ARMS = ("no feed consumer", "feed, no keeper", "feed + keeper")
BATCH_ARM = "batch writes (100/commit), feed + keeper"


class Config(msgspec.Struct, frozen=True, kw_only=True):
    rows: int
    writes: int
    rounds: int
    batch: int = 100


FULL = Config(rows=250_000, writes=50_000, rounds=5)
QUICK = Config(rows=20_000, writes=2_000, rounds=2)


class Snapshot(msgspec.Struct, kw_only=True):
    process_cpu_s: float
    thread_cpu_s: float
    events: int
    rss: int


class Delivered(msgspec.Struct, kw_only=True):
    # (key, time.monotonic_ns() when polled); one list, so a clear never splits a pair
    events: list[tuple[str, int]]


class StampedSubscription:
    """A subscription that notes when each event was polled; everything else passes through."""

    def __init__(self, inner: Any, log: Delivered, counter: list[int]) -> None:
        self._inner = inner
        self._log = log
        self._counter = counter

    def poll(self, limit: int = 1000) -> Any:
        return self._stamped(self._inner.poll(limit))

    def _stamped(self, batch: FeedBatch) -> FeedBatch:
        now = time.monotonic_ns()
        for event in batch.events:
            key = getattr(event, "key", None)
            if key is not None:
                self._log.events.append((key, now))
        self._counter[0] += len(batch.events)
        return batch

    def poll_records(self, limit: int = 1000) -> Any:
        # The keeper reads a feed's records where it offers them (keeper.feed): stamped
        # here too, one a key as the events they stand for.
        poll_records = getattr(self._inner, "poll_records", None)
        batch = self._inner.poll(limit) if poll_records is None else poll_records(limit)
        if isinstance(batch, FeedBatch):
            return self._stamped(batch)
        now = time.monotonic_ns()
        self._log.events.extend((record[2], now) for record in batch.records)
        self._counter[0] += len(batch.records)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StampedStore:
    """The store the consumer (or the keeper) is given: only `subscribe` is wrapped."""

    def __init__(self, inner: Any, log: Delivered, counter: list[int]) -> None:
        self._inner = inner
        self._log = log
        self._counter = counter

    def subscribe(self, consumer: str, cursor: Any = None) -> Any:
        return StampedSubscription(
            self._inner.subscribe(consumer, cursor), self._log, self._counter
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def worker0_process(conn: Connection, store_url: str, instance: str) -> None:
    """Worker 0: runs a plain feed consumer or the keeper in a thread, on command."""
    import psutil

    from store import open_store

    process = psutil.Process()
    log = Delivered(events=[])
    counter = [0]
    thread: threading.Thread | None = None
    stop = threading.Event()
    node: Any = None
    error: list[str] = []
    feeds: list[Any] = []  # the consumer's subscription, for its statistics at collect
    subscribed = threading.Event()  # the arm's writes must start after the feed is open

    def thread_cpu() -> float:
        return 0.0 if thread is None else report.thread_cpu_s(thread)

    def snapshot() -> Snapshot:
        times = process.cpu_times()
        return Snapshot(
            process_cpu_s=times.user + times.system,
            thread_cpu_s=thread_cpu(),
            events=counter[0],
            rss=process.memory_info().rss,
        )

    def consume() -> None:
        store = StampedStore(open_store(store_url), log, counter)
        subscription = store.subscribe(FEED_CONSUMER, store.feed_head())
        feeds[:] = [subscription]
        subscribed.set()
        last_save = time.monotonic()
        try:
            while not stop.is_set():
                subscription.wait(0.05)
                while subscription.poll(2000).more:  # a short batch read to the end
                    pass
                if time.monotonic() - last_save > 1.0:
                    subscription.save()
                    last_save = time.monotonic()
        except Exception as exc:
            error.append(repr(exc))
        finally:
            subscription.close()
            store.close()

    def keep() -> None:
        from bench.peers.renderqueue import hash_as_node, node_keeper_config
        from keeper.runner import Keeper
        from workers.config import Settings

        store = StampedStore(open_store(store_url), log, counter)
        try:
            hash_as_node(store)
            keeper = Keeper(
                store,
                node.ring,
                node.leases,
                node.state,
                node_keeper_config(Settings()),
                node="bench",
            )
            keeper.run(stop)
        except Exception as exc:
            error.append(repr(exc))
        finally:
            store._inner.close()

    # Imported before any RSS is read, so the keeper's memory figure holds rows, not code.
    import keeper.config
    import keeper.runner  # noqa: F401
    from workers.segments import SegmentNames, Segments

    node = Segments.attach(SegmentNames.for_instance(instance))
    # Worker 0's switch interval, which bounds how long its threads hold each other up.
    from workers.config import Settings as NodeSettings

    sys.setswitchinterval(NodeSettings().keeper_switch_interval_ms / 1000)
    while True:
        command, *args = conn.recv()
        if command == "exit":
            break
        if command == "start":
            stop.clear()
            subscribed.clear()
            feeds.clear()
            thread = threading.Thread(target=consume if args[0] == "feed" else keep, daemon=True)
            thread.start()
            if args[0] == "feed":
                subscribed.wait(60)
            conn.send(snapshot())
        elif command == "stop":
            stop.set()
            if thread is not None:
                thread.join(60)
            thread = None
            conn.send(error[:])
        elif command == "mark":
            log.events.clear()
            conn.send(snapshot())
        elif command == "collect":
            # Read from this thread: the counters are plain ints, and the consumer's own
            # loop stays free of bookkeeping (its CPU per write is a figure).
            stats = [msgspec.to_builtins(feed.statistics()) for feed in feeds]
            conn.send((snapshot(), msgspec.msgpack.encode(log), error[:], stats))
    node.close()


class WriteResult(msgspec.Struct, kw_only=True):
    put_ns: list[int]
    keys: list[str]
    commit_ns: list[int]  # the store's monotonic stamp just after each commit
    cpu_s: float


def writer_process(conn: Connection, store_url: str, rows_total: int) -> None:
    import psutil

    from bench.harness.workload import ROUTES, key_of
    from store import open_store
    from store.rows import RowWrite

    store: Any = open_store(store_url)
    process = psutil.Process()
    while True:
        command, *args = conn.recv()
        if command == "exit":
            break
        start, count, batch = args
        now = time.time_ns() // 1_000_000
        before = process.cpu_times()
        put_ns: list[int] = []
        keys: list[str] = []
        commits: list[int] = []
        for first in range(start, start + count, batch):
            upserts = []
            for n in range(first, min(first + batch, start + count)):
                index = n % rows_total
                route, cadence_s = ROUTES[index % len(ROUTES)]
                upserts.append(
                    RowWrite(
                        key=key_of(index),
                        route=route,
                        next_render_at=now + cadence_s * 1000 + n,
                        cadence_s=cadence_s,
                        sitemap=index % 3 == 0,
                    )
                )
            t0 = time.perf_counter_ns()
            store.write(upsert=upserts)
            put_ns.append(time.perf_counter_ns() - t0)
            stamp = store.last_commit_ns
            for row in upserts:
                keys.append(row.key)
                commits.append(stamp)
        after = process.cpu_times()
        conn.send(
            msgspec.msgpack.encode(
                WriteResult(
                    put_ns=put_ns,
                    keys=keys,
                    commit_ns=commits,
                    cpu_s=(after.user + after.system) - (before.user + before.system),
                )
            )
        )
    store.close()


class ArmSample(msgspec.Struct, kw_only=True):
    arm: str
    round: int
    writes: int
    put_p50_us: float | None
    put_p99_us: float | None
    process_cpu_us: float
    thread_busy_us: float | None
    events_per_write: float | None
    lag_p50_ms: float | None
    lag_p99_ms: float | None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench single", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    report.exit_on_sigterm()
    config = QUICK if args.quick else FULL
    result = report.new_result("single", args.quick)
    raw: dict[str, Any] = {"config": msgspec.to_builtins(config)}
    raw.update(run(config))
    return finish(result, config, raw)


def run(config: Config) -> dict[str, Any]:
    from bench.harness.workload import row_writes
    from bench.peers.renderqueue import LocalNode

    node = LocalNode()
    store = node.open_store()
    ctx = mp.get_context("spawn")
    to_worker0, worker0_end = ctx.Pipe()
    to_writer, writer_end = ctx.Pipe()
    worker0 = ctx.Process(
        target=worker0_process, args=(worker0_end, node.store_url, node.instance), daemon=True
    )
    writer = ctx.Process(
        target=writer_process, args=(writer_end, node.store_url, config.rows), daemon=True
    )
    samples: list[ArmSample] = []
    raw: dict[str, Any] = {}
    try:
        rows = generate(Workload(rows=config.rows, now_ms=time.time_ns() // 1_000_000))
        report.progress(f"single: loading {config.rows:,} rows")
        for part in rows.chunks(5000):
            store.write(upsert=row_writes(rows, part))
        worker0.start()
        writer.start()
        cursor = 0
        rebuilds: list[float] = []
        memory: list[float] = []
        own_memory: list[float] = []
        for round_ in range(1, config.rounds + 1):
            for arm in (*ARMS, BATCH_ARM):
                report.progress(f"single: round {round_}/{config.rounds}: {arm}")
                if arm == ARMS[1]:
                    to_worker0.send(("start", "feed"))
                    to_worker0.recv()
                    # Steady state, as the keeper's arm (started and exact before it):
                    # until writers have re-read the consumers (NEW_FOR_S), nobody posts
                    # a new subscription or fills its ring, and it finds commits by
                    # polling data_version, which was most of this row's p99 (4-5 ms, at
                    # a 4 ms poll then) when the arm began at once.
                    time.sleep(NEW_FOR_S)
                elif arm == ARMS[2]:
                    to_worker0.send(("mark",))
                    before = to_worker0.recv()
                    since = time.time_ns() // 1_000_000
                    started = time.monotonic()
                    to_worker0.send(("start", "keeper"))
                    to_worker0.recv()
                    node.wait_exact_shared(since, 900)
                    rebuilds.append(time.monotonic() - started)
                    to_worker0.send(("mark",))
                    after = to_worker0.recv()
                    memory.append((after.rss - before.rss) / config.rows)
                    trust = node.queue_state().trust
                    if trust.held:
                        own_memory.append(trust.memory_bytes / trust.held)
                batch = config.batch if arm == BATCH_ARM else 1
                samples.append(
                    measure(arm, round_, cursor, config, batch, to_worker0, to_writer, node)
                )
                cursor += config.writes
                if arm in (ARMS[1], BATCH_ARM):
                    to_worker0.send(("stop",))
                    errors = to_worker0.recv()
                    if errors:
                        raise RuntimeError(f"worker 0: {errors}")
        raw["rebuild_s"] = [round(r, 3) for r in rebuilds]
        raw["keeper_rss_bytes_per_row"] = [round(m, 1) for m in memory]
        raw["keeper_counted_bytes_per_row"] = [round(m, 1) for m in own_memory]
        # The keeper equals the table: a last keeper, loaded and live, against the table.
        since = time.time_ns() // 1_000_000
        to_worker0.send(("start", "keeper"))
        to_worker0.recv()
        node.wait_exact_shared(since, 900)
        raw["keeper_held_rows"] = held_rows(node.queue_state())
        raw["table_rows"] = store.count()
        to_worker0.send(("stop",))
        to_worker0.recv()
    finally:
        for pipe in (to_worker0, to_writer):
            with contextlib.suppress(OSError):
                pipe.send(("exit",))
        for process in (worker0, writer):
            if process.is_alive() or process.exitcode is None:
                process.join(30)
            if process.is_alive():
                process.kill()
        store.close()
        node.close()
    raw["samples"] = [msgspec.to_builtins(s) for s in samples]
    return raw


def measure(
    arm: str,
    round_: int,
    start: int,
    config: Config,
    batch: int,
    worker0: Connection,
    writer: Connection,
    node: Any,
) -> ArmSample:
    worker0.send(("mark",))
    before: Snapshot = worker0.recv()
    writer.send(("write", start, config.writes, batch))
    written = msgspec.msgpack.decode(writer.recv(), type=WriteResult)
    consuming = arm != ARMS[0]
    deadline = time.monotonic() + 60
    while True:
        worker0.send(("collect",))
        after, encoded, errors, _ = worker0.recv()
        if errors:
            raise RuntimeError(f"worker 0: {errors}")
        if not consuming or after.events - before.events >= config.writes:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    delivered = msgspec.msgpack.decode(encoded, type=Delivered)
    committed = dict(zip(written.keys, written.commit_ns, strict=True))
    lags = [max(0, at - committed[key]) / 1e6 for key, at in delivered.events if key in committed]
    writes = config.writes
    cpu = written.cpu_s + (after.process_cpu_s - before.process_cpu_s)
    events = after.events - before.events
    return ArmSample(
        arm=arm,
        round=round_,
        writes=writes,
        put_p50_us=_us(report.percentile(written.put_ns, 50)),
        put_p99_us=_us(report.percentile(written.put_ns, 99)),
        process_cpu_us=round(cpu / writes * 1e6, 2),
        thread_busy_us=round((after.thread_cpu_s - before.thread_cpu_s) / writes * 1e6, 2)
        if consuming
        else None,
        events_per_write=round(events / writes, 4) if consuming else None,
        lag_p50_ms=report.percentile(lags, 50) if consuming else None,
        lag_p99_ms=report.percentile(lags, 99) if consuming else None,
    )


def _us(ns: float | None) -> float | None:
    return None if ns is None else round(ns / 1000, 1)


def held_rows(state: Any) -> int | None:
    from bench.sections.churn import held_rows as from_state

    return from_state(state)


def _median(values: list[float]) -> float | None:
    ordered = sorted(v for v in values if v is not None)
    return ordered[len(ordered) // 2] if ordered else None


def finish(result: report.SectionResult, config: Config, raw: dict[str, Any]) -> int:
    samples = [msgspec.convert(s, ArmSample) for s in raw.get("samples", [])]
    table = (
        f"Single node: {config.rows:,} rows, two workers, {config.writes:,} writes per arm, "
        f"{config.rounds} rounds interleaved (medians over rounds)"
    )
    metrics = [
        ("put p50", "put_p50_us", "µs"),
        ("put p99", "put_p99_us", "µs"),
        ("process CPU per write", "process_cpu_us", "µs"),
        ("consumer thread busy per write", "thread_busy_us", "µs"),
        ("events per write", "events_per_write", ""),
        ("lag p99", "lag_p99_ms", "ms"),
    ]
    figures = []
    for position, arm in enumerate(ARMS):
        for label, attr, unit in metrics:
            seed = SEED[label][position]
            if seed is None:
                continue
            values = [getattr(s, attr) for s in samples if s.arm == arm]
            figures.append(
                report.Figure(
                    table=table,
                    what=f"{arm}: {label}",
                    unit=unit,
                    seed=seed,
                    target="1" if label == "events per write" else "lower",
                    ours=_median(values),
                )
            )
    batch_table = f"Batch writes, {config.batch} rows per commit, the keeper subscribed throughout"
    for label, attr, unit in metrics:
        values = [getattr(s, attr) for s in samples if s.arm == BATCH_ARM]
        per = "per commit" if attr.startswith("put") else ""
        figures.append(
            report.Figure(
                table=batch_table,
                what=f"{label} {per}".strip(),
                unit=unit,
                ours=_median(values),
                note="per row written" if attr in ("process_cpu_us", "thread_busy_us") else "",
            )
        )
    figures += [
        report.Figure(
            table=table,
            what="rebuild from the table (keeper start to live and exact)",
            unit="s",
            seed=round(0.9 * config.rows / 250_000, 3),
            target="lower",
            ours=_median(raw.get("rebuild_s", [])),
        ),
        report.Figure(
            table=table,
            what="keeper memory per row (worker 0 RSS growth)",
            unit="B",
            seed=200.0,
            target="<= 150",
            ours=_median(raw.get("keeper_rss_bytes_per_row", [])),
        ),
        report.Figure(
            table=table,
            what="keeper memory per row (its own count of its arrays)",
            unit="B",
            seed=200.0,
            target="<= 150",
            ours=_median(raw.get("keeper_counted_bytes_per_row", [])),
        ),
        report.Figure(
            table=table,
            what="keeper equals table (rows held)",
            unit="rows",
            seed=raw.get("table_rows"),
            target="every row",
            ours=raw.get("keeper_held_rows"),
        ),
    ]
    result.figures = figures
    result.promised = [] if result.pending else [f.key for f in figures]
    result.raw = raw
    status = report.emit(result)
    if raw.get("table_rows") is not None and raw.get("keeper_held_rows") != raw.get("table_rows"):
        report.progress("single: the keeper does not equal the table")
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
