"""The feed end to end, across real processes, on every backend: a consumer that subscribes,
walks and applies events while three writers race ends equal to the table; so does one
SIGKILLed mid-stream and restarted from its saved cursor. On SQLite, one whose cursor the
log rolled back resyncs (PostgreSQL's restored log: test_store_postgres.py)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import sqlite3
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from node_harness import wait_for
from replica import Replica, ReplicaSnapshot, ReplicaStatistics, table_rows
from store_helpers import ContractStore, close_all, open_url

from store.rows import Completion, Route, Row, RowWrite
from store.sqlite import SqliteStore
from store.sqlite.feed import parse_cursor

KEYS = 20_000
ROUTES = ("product", "article", "category")
SPAWN = multiprocessing.get_context("spawn")
CONSUMER = "replica"


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    seed: int
    delete_share: float  # of batches that are deletes
    complete_share: float  # of batches that are render completions
    mixed_share: float  # of batches that upsert and delete in one transaction
    max_batch: int
    walk_chunk: int
    settings: bool  # whether writers also change routes and the global default
    min_batches: int = 60
    max_seconds: float = 30.0


class Outcome(msgspec.Struct, kw_only=True):
    rows: dict[str, Row]
    routes: dict[str, Route]
    default_cadence_s: int
    stats: ReplicaStatistics


def key(i: int) -> str:
    return f"https://shop.example/p/{i:05d}"


def row_write(rng: random.Random, i: int) -> RowWrite:
    return RowWrite(
        key=key(i),
        route=rng.choice(ROUTES),
        next_render_at=rng.randrange(1, 10**12),
        cadence_s=rng.choice((None, 60, 3600)),
        sitemap=rng.random() < 0.3,
    )


def writer(url: str, number: int, plan: Plan, stop: Any, started: Synchronized[int]) -> None:
    store = open_url(url, prune_interval_s=None)  # pruning: explicit, below
    rng = random.Random(plan.seed * 7 + number)
    deadline = time.monotonic() + plan.max_seconds
    batches = 0
    while time.monotonic() < deadline and not (batches >= plan.min_batches and stop.is_set()):
        picked = rng.sample(range(KEYS), rng.randint(1, plan.max_batch))
        draw = rng.random()
        if draw < plan.delete_share:
            store.write(delete=[key(i) for i in picked])
        elif draw < plan.delete_share + plan.complete_share:
            outcomes = ("rendered", "rendered", "failed", "gone")
            now = 10**12 + batches
            store.complete(
                [Completion(key=key(i), outcome=rng.choice(outcomes), now=now) for i in picked]  # type: ignore[arg-type]
            )
        elif draw < plan.delete_share + plan.complete_share + plan.mixed_share:
            half = len(picked) // 2
            store.write(
                [row_write(rng, i) for i in picked[half:]], delete=[key(i) for i in picked[:half]]
            )
        else:
            store.write([row_write(rng, i) for i in picked])
        if plan.settings and rng.random() < 0.02:
            if rng.random() < 0.5:
                store.set_route(
                    rng.choice(ROUTES),
                    default_cadence_s=rng.choice((60, 600)),
                    paused=rng.random() < 0.5,
                )
            else:
                store.set_default_cadence_s(rng.choice((3600, 86_400)))
        batches += 1
        if batches == 1:
            with started.get_lock():
                started.value += 1
    store.close()


def consumer(
    url: str,
    plan: Plan,
    result: str,
    snapshot: str,
    resume: bool,
    ready: Any,
    writers_done: Any,
    events: Any,
    snapshots: Any,
) -> None:
    store = open_url(url, prune_interval_s=None)
    replica = Replica(store, CONSUMER, walk_chunk=plan.walk_chunk)
    if resume and os.path.exists(snapshot):
        saved = msgspec.msgpack.decode(Path(snapshot).read_bytes(), type=ReplicaSnapshot)
        replica.start(saved, saved=True)  # from the cursor saved in the database
    else:
        replica.start()
    ready.set()
    saved_at = time.monotonic()
    while True:
        done = writers_done.is_set()  # read first: a catch-up after it sees every write
        applied = replica.catch_up()
        events.value += applied
        if time.monotonic() - saved_at > 0.02:
            # The state first, then the cursor: the saved cursor is never ahead of the state.
            tmp = Path(snapshot + ".tmp")
            tmp.write_bytes(msgspec.msgpack.encode(replica.snapshot()))
            tmp.replace(snapshot)
            replica.subscription.save()
            saved_at = time.monotonic()
            snapshots.value += 1
        if done:
            # Every write is committed: deliver up to the head read now (on PostgreSQL a
            # transaction open elsewhere on the server can still hold entries back).
            head = store.feed_head()
            while not replica.subscription.has_delivered(head):
                replica.subscription.wait(0.05)
                replica.catch_up()
            break
        replica.subscription.wait(0.25)
    outcome = Outcome(
        rows=replica.rows,
        routes=replica.routes,
        default_cadence_s=replica.default_cadence_s,
        stats=replica.statistics(),
    )
    Path(result).write_bytes(msgspec.msgpack.encode(outcome))
    replica.close()
    store.close()


def populate(url: str, seed: int) -> None:
    store = open_url(url)
    rng = random.Random(seed)
    store.write([row_write(rng, i) for i in range(0, KEYS, 2)])  # half the key space
    store.set_route("product", default_cadence_s=900)
    store.close()


class Run:
    """Three writers and a consumer on one store, driven from the test."""

    def __init__(self, tmp: Path, url: str, plan: Plan) -> None:
        self.url = url
        self.result = str(tmp / "consumer.msgpack")
        self.snapshot = str(tmp / "snapshot.msgpack")
        self.plan = plan
        self.stop = SPAWN.Event()
        self.writers_done = SPAWN.Event()
        self.started = SPAWN.Value("q", 0)
        # Lock-free: one consumer at a time writes them, and the test SIGKILLs it, which
        # would leave a Value's lock held for ever by a dead process.
        self.events = SPAWN.RawValue("q", 0)
        self.snapshots = SPAWN.RawValue("q", 0)
        self.consumers: list[multiprocessing.process.BaseProcess] = []
        populate(url, plan.seed)
        self.writers = [
            SPAWN.Process(target=writer, args=(url, n, plan, self.stop, self.started))
            for n in range(3)
        ]
        for process in self.writers:
            process.start()
        wait_for(lambda: self.started.value == 3, 120, "the writers to start", 0.005)

    def close(self) -> None:
        """Stop every process still running (after a failed assertion, say)."""
        self.stop.set()
        self.writers_done.set()
        for process in [*self.writers, *self.consumers]:
            process.join(30)
            if process.exitcode is None:
                process.kill()
                process.join(10)

    def start_consumer(self, *, resume: bool) -> multiprocessing.process.BaseProcess:
        ready = SPAWN.Event()
        process = SPAWN.Process(
            target=consumer,
            args=(
                self.url,
                self.plan,
                self.result,
                self.snapshot,
                resume,
                ready,
                self.writers_done,
                self.events,
                self.snapshots,
            ),
        )
        self.consumers.append(process)
        process.start()
        while not ready.wait(0.1):
            assert process.exitcode is None, "the consumer failed (see its traceback above)"
        return process

    def finish(self, process: multiprocessing.process.BaseProcess) -> Outcome:
        self.stop.set()
        for writer_process in self.writers:
            writer_process.join(120)
            assert writer_process.exitcode == 0, "a writer failed (see its traceback above)"
        self.writers_done.set()
        process.join(120)
        assert process.exitcode == 0, "the consumer failed (see its traceback above)"
        return msgspec.msgpack.decode(Path(self.result).read_bytes(), type=Outcome)

    def check(self, outcome: Outcome) -> ContractStore:
        store = open_url(self.url)
        table = table_rows(store)
        assert len(outcome.rows) == len(table)
        assert outcome.rows == table  # every row, every field, every version
        assert outcome.routes == {route.route: route for route in store.routes()}
        assert outcome.default_cadence_s == store.default_cadence_s()
        return store


plans = st.builds(
    Plan,
    seed=st.integers(0, 2**32 - 1),
    delete_share=st.floats(0.0, 0.5),
    complete_share=st.floats(0.0, 0.3),
    mixed_share=st.floats(0.0, 0.2),
    max_batch=st.integers(1, 40),
    walk_chunk=st.sampled_from((97, 500, 2000)),
    settings=st.booleans(),
)


@settings(
    max_examples=int(os.environ.get("RQ_STORE_RACE_EXAMPLES", "3")),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    # Each example is seconds of racing processes and never replays exactly: report the
    # failing plan as drawn rather than shrinking it.
    phases=(Phase.explicit, Phase.generate),
)
@given(plan=plans)
def test_subscribe_then_walk_under_three_writers_ends_equal_to_the_table(
    tmp_path_factory: pytest.TempPathFactory, new_store_url: Callable[[], str], plan: Plan
) -> None:
    tmp = tmp_path_factory.mktemp("race")
    run = Run(tmp, new_store_url(), plan)
    try:
        process = run.start_consumer(resume=False)
        # Let the feed run a while beside the walk, pruning behind the consumer as it saves.
        wait_for(lambda: run.events.value >= 500, 120, "events to flow", 0.005)
        pruner = open_url(run.url)
        pruner.prune()
        wait_for(lambda: run.snapshots.value >= 2, 120, "the consumer to save its cursor", 0.005)
        pruner.prune()
        pruner.close()
        outcome = run.finish(process)
    finally:
        run.close()
    store = run.check(outcome)
    assert outcome.stats.bootstraps == 1 and outcome.stats.walked >= KEYS // 4
    close_all(store)


def test_a_consumer_killed_mid_stream_resumes_from_its_saved_cursor(
    tmp_path: Path, store_url: str
) -> None:
    plan = Plan(
        seed=20_24,
        delete_share=0.25,
        complete_share=0.2,
        mixed_share=0.1,
        max_batch=20,
        walk_chunk=500,
        settings=True,
    )
    run = Run(tmp_path, store_url, plan)
    try:
        first = run.start_consumer(resume=False)
        wait_for(
            lambda: run.events.value >= 2_000 and run.snapshots.value >= 3, 120, "progress", 0.005
        )
        os.kill(first.pid or 0, signal.SIGKILL)
        first.join(30)
        assert first.exitcode == -signal.SIGKILL
        # While it is dead: writes go on, and pruning removes only what it had passed.
        store = open_url(run.url)
        saved = store.consumers()[CONSUMER]
        assert store.prune() > 0
        assert store.consumers() == {CONSUMER: saved}
        if isinstance(store, SqliteStore):
            assert store.statistics().floor == parse_cursor(saved)[0]
        store.close()
        events_before = run.events.value
        second = run.start_consumer(resume=True)
        wait_for(
            lambda: run.events.value >= events_before + 1_000, 120, "the restarted consumer", 0.005
        )
        outcome = run.finish(second)
    finally:
        run.close()
    store = run.check(outcome)
    # It replayed the gap from its cursor: no walk, no resync.
    assert (outcome.stats.resumed, outcome.stats.bootstraps, outcome.stats.resyncs) == (1, 0, 0)
    close_all(store)


def test_a_replica_whose_cursor_the_log_rolled_back_resyncs(tmp_path: Path) -> None:
    path, copy = tmp_path / "s.db", tmp_path / "copy.db"
    store = SqliteStore(path)
    rng = random.Random(5)
    store.write([row_write(rng, i) for i in range(100)])
    replica = Replica(store, CONSUMER, walk_chunk=30)
    replica.start()
    source, target = sqlite3.connect(path), sqlite3.connect(copy)
    source.backup(target)
    source.close()
    target.close()
    store.write([row_write(rng, i) for i in range(100, 150)], delete=[key(0)])
    replica.catch_up()
    kept = replica.snapshot()  # the consumer's state and cursor, kept outside the database
    replica.close()
    close_all(store)

    for suffix in ("", "-wal", "-shm"):  # the power loss: back to the earlier file
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    source, target = sqlite3.connect(copy), sqlite3.connect(path)
    source.backup(target)
    source.close()
    target.close()
    store = SqliteStore(path)
    store.write([row_write(rng, i) for i in range(200, 260)])  # reuses the lost seqs
    replica = Replica(store, CONSUMER, walk_chunk=30)
    replica.start(kept)
    assert replica.statistics().resyncs == 1 and replica.statistics().bootstraps == 1
    assert store.statistics().resyncs == 1
    assert replica.rows == table_rows(store)
    assert key(0) in replica.rows and key(120) not in replica.rows
    replica.close()
    close_all(store)
