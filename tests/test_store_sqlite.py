"""SqliteStore on real files: writes, reads, completions, routes, atomicity, concurrency."""

from __future__ import annotations

import multiprocessing
import random
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from store.base import RowsRead
from store.errors import StoreError
from store.rows import Completion, Route, Row, RowWrite
from store.sqlite import SqliteStore
from store.sqlite_feed import parse_cursor


def put(key: str, at: int = 1_000, **fields: object) -> RowWrite:
    return RowWrite(key=key, route=str(fields.pop("route", "product")), next_render_at=at, **fields)  # type: ignore[arg-type]


def log_size(store: SqliteStore) -> int:
    return store.statistics().log_rows


def test_upsert_get_and_versions(store: SqliteStore) -> None:
    store.write([put("/a", 5, cadence_s=60, sitemap=True), put("/b", 6)])
    a = store.get("/a")
    assert a is not None
    assert a == Row(
        key="/a", route="product", cadence_s=60, sitemap=True, next_render_at=5, version=a.version
    )
    assert a.version >= 1 and a.last_rendered_at is None and a.last_outcome is None
    first = store.get("/b")
    assert first is not None
    store.write([put("/b", 7)])
    second = store.get("/b")
    assert second is not None and second.next_render_at == 7
    assert second.version > first.version
    assert store.get("/missing") is None
    assert store.count() == 2


def test_versions_keep_rising_across_delete_and_reinsert(store: SqliteStore) -> None:
    store.write([put("/a")])
    before = store.get("/a")
    store.write(delete=["/a"])
    assert store.get("/a") is None
    store.write([put("/a")])
    after = store.get("/a")
    assert before is not None and after is not None
    assert after.version > before.version


def test_each_write_of_a_row_in_one_batch_bumps_it(store: SqliteStore) -> None:
    store.write([put("/a", 1), put("/a", 2), put("/b", 3)])
    a, b = store.get("/a"), store.get("/b")
    assert a is not None and b is not None
    assert a.next_render_at == 2
    assert b.version > a.version
    assert log_size(store) == 3


def test_get_many_and_walk(store: SqliteStore) -> None:
    keys = [f"/k/{i:04d}" for i in range(250)]
    shuffled = keys[:]
    random.Random(1).shuffle(shuffled)
    store.write([put(k) for k in shuffled])
    wanted = ["/k/0003", "/k/0100", "/nope", "/k/0003", 'weird "quote\\']
    found = store.get_many(wanted)
    assert sorted(found) == ["/k/0003", "/k/0100"]
    assert store.get_many([]) == {}
    # A key named twice is one row (the read joins the list of keys).
    read = store.get_many_at(wanted)
    assert sorted(row.key for row in read.rows) == ["/k/0003", "/k/0100"]
    assert read.rows == [found[row.key] for row in read.rows]
    walked: list[str] = []
    after = None
    while True:
        chunk = store.walk(after, 64)
        walked += [row.key for row in chunk]
        if len(chunk) < 64:
            break
        after = chunk[-1].key
    assert walked == keys
    assert [r.key for r in store.walk("/k/0247", 10)] == ["/k/0248", "/k/0249"]
    assert store.walk("/k/0249", 10) == []


def test_walk_orders_non_ascii_keys_like_python(store: SqliteStore) -> None:
    keys = ["/z", "/é", "/e", "/日本", "/E", "/ü/1", "/€"]
    store.write([put(k) for k in keys])
    assert [r.key for r in store.walk(None, 100)] == sorted(keys)


def test_iterables_are_written_whole(store: SqliteStore) -> None:
    store.write(iter([put("/a"), put("/b")]), delete=iter(["/none"]))  # type: ignore[arg-type]
    assert store.count() == 2
    store.write(delete=(k for k in ["/a"]))  # type: ignore[arg-type]
    assert store.count() == 1


def test_a_batch_with_one_bad_row_writes_nothing(store: SqliteStore) -> None:
    store.write([put("/keep")])
    size = log_size(store)
    with pytest.raises(ValueError, match=r"upsert\[2\].*cadence_s"):
        store.write([put("/x1"), put("/x2"), put("/x3", cadence_s=0)], delete=["/keep"])
    with pytest.raises(ValueError, match=r"delete\[0\].*empty"):
        store.write([put("/x1")], delete=[""])
    assert store.count() == 1 and store.get("/keep") is not None
    assert log_size(store) == size


def test_a_batch_failing_inside_the_transaction_writes_nothing(store: SqliteStore) -> None:
    store.write([put("/keep")])
    size = log_size(store)
    # A failure only SQLite sees, after the first rows of the batch were written.
    conn = sqlite3.connect(store.path)
    conn.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON render_schedule WHEN NEW.key = '/poison' "
        "BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
    )
    conn.commit()
    conn.close()
    with pytest.raises(sqlite3.IntegrityError, match="poisoned"):
        store.write([put("/x1"), put("/x2"), put("/poison")], delete=["/keep"])
    assert store.count() == 1 and store.get("/keep") is not None
    assert log_size(store) == size
    store.write([put("/x1")])  # the connection is usable afterwards
    assert store.count() == 2


def test_complete_rendered_uses_the_effective_cadence(store: SqliteStore) -> None:
    store.write(
        [
            put("/own", 1, cadence_s=60),
            put("/route", 1, route="article"),
            put("/global", 1, route="other"),
            put("/given", 1, cadence_s=60),
        ]
    )
    store.set_route("article", default_cadence_s=3600)
    now = 1_000_000
    got = store.complete(
        [
            Completion(key="/own", outcome="rendered", now=now),
            Completion(key="/route", outcome="rendered", now=now),
            Completion(key="/global", outcome="rendered", now=now),
            Completion(key="/given", outcome="rendered", now=now, next_render_at=42),
        ]
    )
    assert [r.next_render_at if r else None for r in got] == [
        now + 60_000,
        now + 3_600_000,
        now + 86_400_000,  # the global default when never set
        42,
    ]
    assert all(r is not None and r.last_rendered_at == now for r in got)
    assert all(r is not None and r.last_outcome == "rendered" for r in got)
    assert got == [store.get(k) for k in ("/own", "/route", "/global", "/given")]
    store.set_default_cadence_s(120)
    (again,) = store.complete([Completion(key="/global", outcome="rendered", now=now)])
    assert again is not None and again.next_render_at == now + 120_000


def test_the_largest_cadence_at_the_latest_time_stays_an_integer(store: SqliteStore) -> None:
    store.write([put("/far", cadence_s=2**31 - 1)])
    (row,) = store.complete([Completion(key="/far", outcome="rendered", now=2**62)])
    assert row is not None and row.next_render_at == 2**62 + 1000 * (2**31 - 1)
    assert type(row.next_render_at) is int


def test_complete_failed_keeps_it_due_and_gone_deletes(store: SqliteStore) -> None:
    store.write([put("/f", 500, cadence_s=60), put("/g", 500)])
    before = store.get("/f")
    failed, gone, missing = store.complete(
        [
            Completion(key="/f", outcome="failed", now=9_000),
            Completion(key="/g", outcome="gone", now=9_000),
            Completion(key="/nope", outcome="rendered", now=9_000),
        ]
    )
    assert before is not None and failed is not None
    assert failed.next_render_at == 500 and failed.last_rendered_at is None
    assert failed.last_outcome == "failed" and failed.version > before.version
    assert gone is None and store.get("/g") is None
    assert missing is None and store.get("/nope") is None


def test_a_key_completed_twice_in_one_call_is_applied_in_order(tmp_path: Path) -> None:
    """A batch gives each item's row as one call per item would (versions aside)."""
    keys = ["/a", "/b", "/c", "/d\x00nul", '/e "quote\\']
    rng = random.Random(7)
    items = [
        Completion(
            key=rng.choice([*keys, "/missing"]),
            outcome=rng.choice(["rendered", "rendered", "failed", "gone"]),
            now=1_000 * i,
            next_render_at=rng.choice([None, 77_000 + i]),
        )
        for i in range(60)
    ]
    batched, one_by_one = SqliteStore(tmp_path / "b.db"), SqliteStore(tmp_path / "o.db")
    for opened in (batched, one_by_one):
        opened.set_route("article", default_cadence_s=3600)
        opened.write([put(k, route="article" if i % 2 else "product") for i, k in enumerate(keys)])
    try:
        got = batched.complete(items)
        want = [one_by_one.complete([item])[0] for item in items]
        unversioned = [None if r is None else msgspec.structs.replace(r, version=0) for r in got]
        assert unversioned == [
            None if r is None else msgspec.structs.replace(r, version=0) for r in want
        ]
        assert any(r is None for r in got) and any(r is not None for r in got)
        assert [r.key for r in batched.walk(None, 10)] == [r.key for r in one_by_one.walk(None, 10)]
        assert log_size(batched) == log_size(one_by_one)  # one log entry per changed row
    finally:
        batched.close()
        one_by_one.close()


def test_each_completed_row_takes_the_seq_of_its_own_log_entry(store: SqliteStore) -> None:
    keys = [f"/v/{i:03d}" for i in range(120)]
    store.write([put(k, cadence_s=60 if i % 2 else None) for i, k in enumerate(keys)])
    size = log_size(store)
    outcomes = ["rendered", "failed", "gone"]
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


def test_a_bad_completion_changes_nothing(store: SqliteStore) -> None:
    store.write([put("/a", 5)])
    with pytest.raises(ValueError, match=r"completion\[1\]"):
        store.complete(
            [
                Completion(key="/a", outcome="gone", now=1),
                Completion(key="/a", outcome="rendered", now=1.5),  # type: ignore[arg-type]
            ]
        )
    assert store.get("/a") is not None


def test_routes_and_the_global_default(store: SqliteStore) -> None:
    assert store.routes() == [] and store.default_cadence_s() == 86_400
    assert store.set_route("product", default_cadence_s=600) == Route(
        route="product", default_cadence_s=600, paused=False
    )
    assert store.set_route("product", paused=True) == Route(
        route="product", default_cadence_s=600, paused=True
    )
    assert store.set_route("product", clear_default_cadence=True) == Route(
        route="product", default_cadence_s=None, paused=True
    )
    store.set_route("article")
    assert [r.route for r in store.routes()] == ["article", "product"]
    store.set_default_cadence_s(3_600)
    assert store.default_cadence_s() == 3_600
    with pytest.raises(ValueError, match="route name"):
        store.set_route("Bad Name")
    with pytest.raises(ValueError, match="default_cadence_s"):
        store.set_route("product", default_cadence_s=0)
    with pytest.raises(ValueError, match="default_cadence_s"):
        store.set_default_cadence_s(True)
    with pytest.raises(ValueError, match="paused"):
        store.set_route("product", paused=1)  # type: ignore[arg-type]


def test_statistics(store: SqliteStore) -> None:
    store.write([put(f"/{i}") for i in range(10)], [])
    store.write(delete=["/3"])
    stats = store.statistics()
    assert (stats.rows, stats.log_rows, stats.head, stats.floor) == (9, 11, 11, 0)
    assert (stats.transactions, stats.rows_written, stats.consumers) == (2, 11, 0)
    assert stats.schema_version >= 1 and stats.lowest_consumer_seq is None


def test_threads_share_one_store(store: SqliteStore) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(50):
                store.write([put(f"/t{n}/{i}")])
                assert store.get(f"/t{n}/{i}") is not None
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert store.count() == 200
    assert store.statistics().transactions == 200


def test_a_closed_store_refuses_work(tmp_path: Path) -> None:
    opened = SqliteStore(tmp_path / "s.db")
    opened.close()
    with pytest.raises(StoreError, match="closed"):
        opened.get("/a")


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
