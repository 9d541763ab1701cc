"""SqliteStore's own, on real files: a version and a log entry for each write of a row in a
batch, versions that are log seqs, its statistics, file paths, writer processes that never
see "database is locked", reads whose head is a seq. What every backend promises is
tested on both in test_store_base.py."""

from __future__ import annotations

import multiprocessing
import random
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from store.base import RowsRead
from store.rows import Completion, Outcome, RowWrite
from store.sqlite import SqliteStore
from store.sqlite.conn import PAGE_CACHE_KIB
from store.sqlite.feed import parse_cursor


def put(key: str, at: int = 1_000, **fields: object) -> RowWrite:
    return RowWrite(key=key, route=str(fields.pop("route", "product")), next_render_at=at, **fields)  # type: ignore[arg-type]


def log_size(store: SqliteStore) -> int:
    return store.statistics().log_rows


def test_each_write_of_a_row_in_one_batch_bumps_it(store: SqliteStore) -> None:
    store.write([put("/a", 1), put("/a", 2), put("/b", 3)])
    a, b = store.get("/a"), store.get("/b")
    assert a is not None and b is not None
    assert a.next_render_at == 2
    assert b.version > a.version
    assert log_size(store) == 3


def test_each_completed_row_takes_the_seq_of_its_own_log_entry(store: SqliteStore) -> None:
    keys = [f"/v/{i:03d}" for i in range(120)]
    store.write([put(k, cadence_s=60 if i % 2 else None) for i, k in enumerate(keys)])
    size = log_size(store)
    outcomes: list[Outcome] = ["rendered", "failed", "gone"]
    got = store.complete(
        [Completion(key=k, outcome=outcomes[i % 3], now=5_000) for i, k in enumerate(keys)]
        + [Completion(key="/v/none", outcome="rendered", now=5_000)]
    )
    assert log_size(store) == size + len(keys)  # each changed row logged once, nothing else
    rows = [r for r in got if r is not None]
    assert [r.key for r in rows] == [k for i, k in enumerate(keys) if i % 3 != 2]
    conn = sqlite3.connect(store.path)
    try:
        logged = dict(conn.execute("SELECT key, max(seq) FROM change_log GROUP BY key"))
    finally:
        conn.close()
    assert [r.version for r in rows] == [logged[r.key] for r in rows]
    assert len({r.version for r in rows}) == len(rows)
    assert rows == [store.get(r.key) for r in rows]


def test_statistics(store: SqliteStore) -> None:
    store.write([put(f"/{i}") for i in range(10)], [])
    store.write(delete=["/3"])
    stats = store.statistics()
    assert (stats.rows, stats.log_rows, stats.head, stats.floor) == (9, 11, 11, 0)
    assert (stats.transactions, stats.rows_written, stats.consumers) == (2, 11, 0)
    assert stats.schema_version >= 1 and stats.lowest_consumer_seq is None


def test_paths_that_are_not_files_are_refused() -> None:
    for bad in ("", ":memory:", "file:x.db?mode=memory"):
        with pytest.raises(ValueError, match="file path"):
            SqliteStore(bad)


def _hammer(path: str, writer: int, batches: int) -> tuple[int, int]:
    store = SqliteStore(path)
    rng = random.Random(writer)
    for i in range(batches):
        size = rng.randint(1, 20)
        store.write([put(f"/w{writer}/{i}/{j}", i) for j in range(size)])
        if i % 3 == 0:
            store.complete([Completion(key=f"/w{writer}/{i}/0", outcome="rendered", now=i)])
    stats = store.statistics()
    store.close()
    return stats.rows_written, stats.busy_retries


def test_writer_processes_never_see_database_is_locked(tmp_path: Path) -> None:
    path = str(tmp_path / "s.db")
    SqliteStore(path).close()
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(_hammer, [(path, w, 300) for w in range(4)])
    store = SqliteStore(path)
    expected_rows = 0
    for w in range(4):
        rng = random.Random(w)
        expected_rows += sum(rng.randint(1, 20) for _ in range(300))
    assert store.count() == expected_rows
    # every write reached the log, in one unbroken sequence
    assert store.statistics().head == sum(written for written, _ in results)
    store.close()


def _reschedule_ops(keys: int, commits: int) -> Iterator[tuple[list[str], str]]:
    """Each commit's upserted keys and deleted key, the same in the writer and the test."""
    rng = random.Random(3)
    for _ in range(commits):
        chosen = [f"/k/{j:03d}" for j in rng.sample(range(keys), 6)]
        yield chosen[:5], chosen[5]


def _reschedule(path: str, keys: int, commits: int) -> None:
    store = SqliteStore(path, prune_interval_s=None)
    try:
        for i, (upserted, deleted) in enumerate(_reschedule_ops(keys, commits)):
            store.write([put(key, i) for key in upserted], delete=[deleted])
    finally:
        store.close()


def test_reads_at_a_head_show_exactly_the_table_as_of_that_head(tmp_path: Path) -> None:
    """get_many_at and walk_at read the rows and the head in one snapshot while another
    process writes: replaying the writer's commits up to each read's head gives exactly
    the rows it returned, versions included (so a feed that delivered the head has
    delivered every write the read saw, and no write the read did not see is below it)."""
    path = tmp_path / "schedule.db"
    store = SqliteStore(path, prune_interval_s=None)
    keys, commits = 60, 3000
    names = [f"/k/{j:03d}" for j in range(keys)]
    store.write([put(name) for name in names])
    assert store.get_many_at([]) == RowsRead(rows=[], head=store.feed_head())
    table = {row.key: row.version for row in store.walk(None, keys)}
    start = parse_cursor(store.feed_head())[0]
    writer = multiprocessing.get_context("spawn").Process(
        target=_reschedule, args=(str(path), keys, commits)
    )
    writer.start()
    reads: list[tuple[str, str | None, RowsRead]] = []
    try:
        while writer.is_alive() or len(reads) < 30:
            reads.append(("get_many", None, store.get_many_at(names[::3])))
            first = store.walk_at(None, 20)
            after = first.rows[-1].key if first.rows else None
            reads += [("walk", None, first), ("walk", after, store.walk_at(after, 100))]
        writer.join(60)
        assert writer.exitcode == 0
    finally:
        writer.join(5)
        store.close()
    # Replay the commits in seq order (a delete of an absent row logs nothing), checking
    # each read against the table as of its head.
    reads.sort(key=lambda read: parse_cursor(read[2].head)[0])
    seq = start
    ops = iter(_reschedule_ops(keys, commits))
    heads = set()
    for kind, after, read in reads:
        head = parse_cursor(read.head)[0]
        heads.add(head)
        while seq < head:
            upserted, deleted = next(ops)
            for key in upserted:
                seq += 1
                table[key] = seq
            if deleted in table:
                seq += 1
                del table[deleted]
        assert seq == head, "a read's head fell inside a commit"
        got = {row.key: row.version for row in read.rows}
        if kind == "get_many":
            assert got == {k: v for k, v in table.items() if k in names[::3]}
        else:
            limit = 20 if after is None else 100
            later = sorted(k for k in table if after is None or k > after)[:limit]
            assert [row.key for row in read.rows] == later
            assert got == {k: table[k] for k in later}
    assert len(heads) > 10, "the writer never moved the head between reads: nothing tested"


def test_the_page_cache_is_the_one_asked_for_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    from store import open_store

    path = tmp_path / "cache.sqlite"
    for asked, expected in ((None, -PAGE_CACHE_KIB), (2_000, -2_000)):
        store = open_store(str(path), page_cache_kib=asked)
        try:
            assert isinstance(store, SqliteStore)
            seen = store._read("test", lambda c: c.execute("PRAGMA cache_size").fetchone()[0])
            assert seen == expected
        finally:
            store.close()
    for bad in (0, -5, 1 << 30):
        with pytest.raises(ValueError, match="page_cache_kib"):
            SqliteStore(path, page_cache_kib=bad)
