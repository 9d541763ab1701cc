"""The PostgreSQL feed is exact where transactions commit out of order.

Two naive cursors over the same log show what they lose (a `seq`-only cursor, and
`seq` with the xmin filter); the `(xid, seq)` keyset misses nothing. Then sixteen
writer processes with random delays before commit and a share of rollbacks: a
consumer tailing them ends equal to the table, with no event of a rolled-back write.
"""

from __future__ import annotations

import multiprocessing
import random
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from node_harness import wait_for
from replica import Replica
from store_helpers import settle

from store.postgres import PostgresStore
from store.postgres import feed as pg_feed
from store.postgres import sql as pg_sql
from store.postgres.conn import connect
from store.rows import FeedEvent, Route, RouteEvent, RowEvent, RowWrite, SiteEvent, SiteSettings


def row_keys(events: Sequence[FeedEvent]) -> list[str]:
    """The keys of a batch that must hold row events only."""
    assert all(isinstance(e, RowEvent) for e in events)
    return [e.key for e in events if isinstance(e, RowEvent)]


def upsert_params(key: str, next_render_at: int) -> dict[str, Any]:
    return {
        "keys": [key],
        "routes": ["page"],
        "cadences": [None],
        "sitemaps": [False],
        "nexts": [next_render_at],
    }


class SeqCursor:
    """The cursor the tests refute: entries after a seq, in seq order."""

    def __init__(self, conn: psycopg.Connection[Any], *, xmin_filter: bool) -> None:
        self.conn = conn
        self.seq = 0
        self.seen: list[str] = []
        self.xmin_filter = xmin_filter

    def poll(self) -> None:
        horizon = " AND xid < pg_snapshot_xmin(pg_current_snapshot())" if self.xmin_filter else ""
        for seq, key in self.conn.execute(
            f"SELECT seq, key FROM change_log WHERE seq > %s{horizon} ORDER BY seq", (self.seq,)
        ).fetchall():
            self.seq = seq
            self.seen.append(key)


def test_out_of_order_commits_lose_rows_to_seq_cursors_and_none_to_the_keyset(
    pg_url: str,
) -> None:
    store = PostgresStore(pg_url)
    keyset = store.subscribe("keyset")
    reader = connect(pg_url)  # autocommit, as the store's own: head() reads its horizon
    seq_only = SeqCursor(reader, xmin_filter=False)
    seq_xmin = SeqCursor(reader, xmin_filter=True)
    delivered: list[str] = []

    def poll_all() -> None:
        seq_only.poll()
        seq_xmin.poll()
        for event in keyset.poll().events:
            assert isinstance(event, RowEvent)
            delivered.append(event.key)

    early = psycopg.connect(pg_url)  # takes the lower xid, its log seq second, commits first
    late = psycopg.connect(pg_url)  # takes the higher xid, its log seq first, commits last
    try:
        xid_early = early.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        xid_late = late.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        assert xid_early is not None and xid_late is not None and xid_early[0] < xid_late[0]
        # The seq + xmin cursor reads below the server's horizon: a transaction another test
        # left open from before ours would hold '/early' back from it too.
        first = xid_early[0]

        wait_for(
            lambda: pg_feed.head(reader)[0] >= first, 60, "the transactions older than ours to end"
        )
        late.execute(pg_sql.UPSERT, upsert_params("/late", 1))
        early.execute(pg_sql.UPSERT, upsert_params("/early", 2))
        seqs: dict[str, int] = dict(reader.execute("SELECT key, seq FROM change_log").fetchall())
        assert seqs == {}  # neither has committed: nothing is visible yet
        early.commit()
        poll_all()
        late.commit()
        poll_all()
        poll_all()

        # The keyset delivers '/late' once the horizon passes it: a transaction another test
        # began between our two may hold it back a while.
        def late_delivered() -> bool:
            delivered.extend(e.key for e in keyset.poll().events if isinstance(e, RowEvent))
            return "/late" in delivered

        wait_for(late_delivered, 60, "the keyset feed to deliver '/late'")
    finally:
        early.close()
        late.close()
    seqs = dict(reader.execute("SELECT key, seq FROM change_log").fetchall())
    assert seqs["/late"] < seqs["/early"]  # the late commit took its seq first

    assert seq_only.seen == ["/early"], "a seq-only cursor skips the late commit's lower seq"
    assert seq_xmin.seen == ["/early"], "seq + xmin skips it too: its xid was above xmin"
    assert sorted(delivered) == ["/early", "/late"]
    assert store.count() == 2
    reader.close()
    keyset.close()
    store.close()


def keys_delivered(feed: Any, count: int, timeout_s: float = 30.0) -> set[str]:
    """The row keys the feed delivers, polling until `count` of them came or the timeout."""
    keys: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while len(keys) < count and time.monotonic() < deadline:
        feed.wait(0.5)
        keys |= {e.key for e in feed.poll().events if isinstance(e, RowEvent)}
    return keys


def test_a_transaction_left_open_holds_the_feed_back_and_is_named(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    feed = store.subscribe("held")
    holder = psycopg.connect(pg_url)
    try:
        holder.execute(pg_sql.UPSERT, upsert_params("/open", 1))
        holder_pid = holder.info.backend_pid
        store.write([RowWrite(key="/after", route="page", next_render_at=5)])
        # The later commit waits behind the open transaction: delayed, not lost.
        assert feed.poll().events == []

        def named() -> bool:
            assert feed.wait(0.2)  # entries are pending: the wait re-polls soon
            assert feed.poll().events == []
            return feed.statistics().held_by_pid != 0

        wait_for(named, 30, "the open transaction named", 0)
        stats = feed.statistics()
        assert stats.held_by_pid == holder_pid
        assert stats.held_back_ms >= 1000
        holder.commit()
        assert keys_delivered(feed, 2) == {"/open", "/after"}
        assert feed.statistics().held_back_ms == 0
    finally:
        holder.close()
        feed.close()
        store.close()


def test_a_transaction_left_open_keeps_later_writes_unvouched(pg_url: str) -> None:
    """A write that committed behind an open transaction with a lower xid is not vouched
    for (its position is not below `delivered_below`) until the open one ends and the feed
    has read past both: a claim keeps reading that key's row meanwhile (shm.marks)."""
    store = PostgresStore(pg_url)
    feed = store.subscribe("vouch")
    holder = psycopg.connect(pg_url)
    try:
        holder.execute(pg_sql.UPSERT, upsert_params("/open", 1))
        store.write([RowWrite(key="/after", route="page", next_render_at=5)])
        after = store.write_position
        assert feed.poll().events == []
        assert feed.delivered_below() <= after
        holder.commit()
        assert keys_delivered(feed, 2) == {"/open", "/after"}
        assert after < feed.delivered_below()
    finally:
        holder.close()
        feed.close()
        store.close()


WRITERS = 16
KEYS = 400


def _writer(url: str, number: int, commits: int, seed: int) -> None:
    rng = random.Random(seed)
    conn = psycopg.connect(url)
    done = 0
    while done < commits:
        keys = rng.sample(range(KEYS), rng.randint(1, 4))
        rollback = rng.random() < 0.25
        try:
            for k in keys:
                # A rolled-back write carries a value no committed write has: any event
                # with it would be a phantom.
                value = -1 - number if rollback else rng.randint(1, 10**9)
                conn.execute(pg_sql.UPSERT, upsert_params(f"/k/{k}", value))
            if rng.random() < 0.2:
                conn.execute(pg_sql.DELETE, {"deletes": [f"/k/{rng.randrange(KEYS)}"]})
        except psycopg.errors.DeadlockDetected:  # rows taken in random order: it happens
            conn.rollback()
            continue
        time.sleep(rng.random() * 0.004)  # hold the transaction open: commits reorder
        if rollback:
            conn.rollback()
        else:
            conn.commit()
            done += 1
    conn.close()


@pytest.mark.slow
def test_sixteen_writers_out_of_order_with_rollbacks_feed_an_exact_consumer(
    pg_url: str,
) -> None:
    store = PostgresStore(pg_url)
    replica = Replica(store, "tail")
    replica.bootstrap()
    phantoms = 0
    events = 0
    ctx = multiprocessing.get_context("spawn")
    writers = [ctx.Process(target=_writer, args=(pg_url, n, 120, 1000 + n)) for n in range(WRITERS)]
    for process in writers:
        process.start()
    sub = replica.subscription

    def follow() -> None:
        nonlocal phantoms, events
        batch = sub.poll(500)
        for event in batch.events:
            if isinstance(event, RowEvent) and event.row is not None:
                events += 1
                if event.row.next_render_at < 0:
                    phantoms += 1
        replica.apply(batch)

    deadline = time.monotonic() + 120
    while any(p.is_alive() for p in writers) and time.monotonic() < deadline:
        sub.wait(0.05)
        follow()
    for process in writers:
        process.join(timeout=10)
        assert process.exitcode == 0
    # Every write is committed: deliver up to a head read now (a transaction open
    # elsewhere on the server may still hold entries back for a while).
    head = store.feed_head()
    deadline = time.monotonic() + 60
    while not sub.has_delivered(head) and time.monotonic() < deadline:
        sub.wait(0.05)
        follow()
    follow()
    assert sub.has_delivered(head)
    table = {row.key: row for row in store.walk(None, 10 * KEYS)}
    assert len(table) > KEYS // 2
    assert phantoms == 0
    assert events > 0
    assert replica.rows == table
    assert not any(row.next_render_at < 0 for row in table.values())
    sub.close()
    store.close()


def test_a_feed_is_quiet_only_while_nothing_was_announced_since_its_last_read(
    pg_url: str,
) -> None:

    store = PostgresStore(pg_url)
    sub = store.subscribe("quiet")
    try:
        assert not sub.quiet()  # never read
        sub.poll()
        assert sub.quiet()
        store.write([RowWrite(key="/a", route="page", next_render_at=1)])
        settle(store)  # a transaction open elsewhere on the server would hold "/a" back
        wait_for(lambda: not sub.quiet(), 30, "its NOTIFY", 0.001)
        assert not sub.quiet()  # announced: the next poll must read
        assert [e.key for e in sub.poll().events if isinstance(e, RowEvent)] == ["/a"]
        assert sub.quiet()
        head = store.feed_head()
        if not sub.has_delivered(head):
            time.sleep(pg_feed.GATHER_S)
            assert not sub.quiet()  # someone waits on a head: read
            sub.poll()
        time.sleep(pg_feed.FALLBACK_POLL_S)
        assert not sub.quiet()  # and at least every FALLBACK_POLL_S
        assert sub.statistics().skipped >= 2
    finally:
        sub.close()
        store.close()


def test_commits_announced_moments_after_a_read_gather_for_the_next_one(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read within GATHER_S of the last is put off, so a stream of single-row commits
    is read a few at a time, not one statement per commit."""

    monkeypatch.setattr(pg_feed, "GATHER_S", 0.5)  # long enough for a loaded machine
    store = PostgresStore(pg_url)
    sub = store.subscribe("gather")
    try:
        read_at = time.monotonic()  # before the read: it counts from its own start
        sub.poll()
        store.write([RowWrite(key="/g/first", route="page", next_render_at=1)])
        assert sub.quiet()  # read moments ago: the announced commit gathers
        assert sub.wait(30.0)
        assert time.monotonic() - read_at >= pg_feed.GATHER_S  # the read was put off
        settle(store)  # another test's transaction on the server may hold the entry back
        assert row_keys(sub.poll().events) == ["/g/first"]
        writes = 200
        delivered: list[str] = []
        started = time.monotonic()
        for i in range(writes):
            store.write([RowWrite(key=f"/g/{i}", route="page", next_render_at=1)])
            if not sub.quiet():
                delivered += row_keys(sub.poll().events)
        head = store.feed_head()

        def caught_up() -> bool:
            if sub.has_delivered(head):
                return True
            sub.wait(0.05)
            delivered.extend(row_keys(sub.poll().events))
            return sub.has_delivered(head)

        wait_for(caught_up, 60, "the feed to deliver through the head", 0)
        assert delivered == [f"/g/{i}" for i in range(writes)]
        elapsed = time.monotonic() - started
        # At most one read a GATHER_S (plus the reads that waited on the head at the end).
        assert sub.statistics().polls <= 2 + elapsed / pg_feed.GATHER_S + 5
        assert sub.statistics().polls < writes
    finally:
        sub.close()
        store.close()


def test_a_saving_consumer_prunes_the_log_on_a_thread_of_its_own(pg_url: str) -> None:
    store = PostgresStore(pg_url, prune_interval_s=0.2)
    sub = store.subscribe("pruned")

    def caught_up() -> bool:
        if sub.has_delivered(store.feed_head()):
            return True
        sub.wait(0.05)
        sub.poll()
        return False

    try:
        store.write([RowWrite(key=f"/p/{i}", route="page", next_render_at=1) for i in range(300)])
        wait_for(caught_up, 60, "the feed to deliver the writes", 0)
        assert sub.statistics().log_retained is None  # no pruner before the first save
        sub.save()  # starts the pruner; returns at once
        wait_for(lambda: sub.statistics().pruned >= 300, 60, "the pruner's first round")
        assert store.statistics().log_rows == 0
        # Unsaved entries stay, and the pruner's count after its next round says how many.
        store.write([RowWrite(key=f"/kept/{i}", route="page", next_render_at=1) for i in range(40)])
        wait_for(lambda: sub.statistics().log_retained == 40, 60, "a round counting the kept")
        assert store.statistics().log_rows == 40
        store.write([RowWrite(key="/after", route="page", next_render_at=1)])
        wait_for(caught_up, 60, "the feed to deliver the last write", 0)
        assert sub.statistics().prune_failures == 0
        common = sub.statistics().common()  # what the keeper's record carries
        assert common.log_retained is not None and common.prune_failures == 0
    finally:
        sub.close()
        store.close()


def test_the_log_is_counted_up_to_a_cap(pg_url: str) -> None:
    store = PostgresStore(pg_url, prune_interval_s=None)
    try:
        store.write([RowWrite(key=f"/c/{i}", route="page", next_render_at=1) for i in range(25)])
        with connect(pg_url) as conn:
            assert pg_feed.count_retained(conn) == 25
            assert pg_feed.count_retained(conn, cap=10) == 10
    finally:
        store.close()


def log_entries(pg_url: str) -> list[tuple[int, int]]:
    with connect(pg_url) as conn:
        found = conn.execute(
            "SELECT xid::text::bigint, seq FROM change_log ORDER BY xid, seq"
        ).fetchall()
    return [(int(xid), int(seq)) for xid, seq in found]


def floor_of(pg_url: str) -> tuple[int, int]:
    with connect(pg_url) as conn:
        found = conn.execute(pg_sql.FLOOR).fetchone()
    assert found is not None
    return int(found[0]), int(found[1])


def test_pruning_in_chunks_removes_exactly_the_entries_below_the_floor(pg_url: str) -> None:
    """Chunks end inside a transaction's entries and on the log's last one alike."""
    store = PostgresStore(pg_url, prune_interval_s=None)
    sub = store.subscribe("reader")
    try:
        for start, count in ((0, 10), (10, 10), (20, 5)):  # 25 entries of three xids
            store.write(
                [
                    RowWrite(key=f"/k/{i}", route="page", next_render_at=i)
                    for i in range(start, start + count)
                ]
            )
        settle(store)
        for read, chunk in ((12, 5), (13, 4)):  # a floor inside the second write, then past all
            assert len(sub.poll(limit=read).events) == read
            sub.save()
            before = log_entries(pg_url)
            removed = store.prune(chunk=chunk)
            floor = floor_of(pg_url)
            below = [entry for entry in before if entry < floor]
            assert removed == len(below) > 0
            assert log_entries(pg_url) == [entry for entry in before if entry >= floor]
        assert log_entries(pg_url) == []
    finally:
        sub.close()
        store.close()


def test_pruning_reads_and_deletes_the_log_by_its_index(pg_url: str) -> None:
    """A chunk planned as a scan of the whole log would make each round of pruning cost
    the square of the log's length: every statement of a round goes by the log's index."""
    store = PostgresStore(pg_url, prune_interval_s=None)
    try:
        for start in range(0, 20_000, 5_000):
            store.write(
                [
                    RowWrite(key=f"/i/{i}", route="page", next_render_at=i)
                    for i in range(start, start + 5_000)
                ]
            )
        settle(store)
        entries = log_entries(pg_url)
        with connect(pg_url) as conn:
            conn.execute("ANALYZE change_log")
            xmin, _ = pg_feed.head(conn)
            first, middle, tail = entries[0], entries[10_000], entries[-500]
            floor = (str(xmin), 0)
            statements = (
                (pg_sql.PRUNE_CHUNK_END, (str(first[0]), first[1], *floor, 999)),
                (pg_sql.PRUNE_CHUNK_END, (str(middle[0]), middle[1], *floor, 999)),
                (
                    pg_sql.PRUNE_THROUGH,
                    (str(middle[0]), middle[1], str(entries[11_000][0]), entries[11_000][1]),
                ),
                (pg_sql.PRUNE_BELOW, (str(tail[0]), tail[1], *floor)),
            )
            for statement, params in statements:
                plan = "\n".join(row[0] for row in conn.execute("EXPLAIN " + statement, params))
                assert "change_log_pkey" in plan and "Seq Scan" not in plan, plan
                assert "Sort" not in plan, plan
    finally:
        store.close()


def test_a_pruner_that_cannot_reach_the_server_counts_its_failures() -> None:
    pruner = pg_feed.Pruner("postgresql://127.0.0.1:1/none?connect_timeout=1", 0.05, 60.0)
    try:
        deadline = time.monotonic() + 20
        while pruner.failures < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pruner.failures >= 2 and pruner.removed == 0 and pruner.retained is None
    finally:
        pruner.close()


def test_the_server_drops_a_listener_whose_socket_takes_nothing(pg_url: str) -> None:
    """A stopped listener would hold every notification in the server's shared queue
    until it filled and writes failed; the feed's session bounds that on the server."""
    store = PostgresStore(pg_url)
    try:
        sub = store.subscribe("listener")
        try:
            shown = sub._conn.execute("SHOW tcp_user_timeout").fetchone()
            assert shown == (str(pg_feed.LISTENER_TCP_USER_TIMEOUT_MS),)
        finally:
            sub.close()
    finally:
        store.close()


def test_a_poll_for_records_answers_row_entries_as_the_records_of_polls_events(
    pg_url: str,
) -> None:
    """The keeper's poll (poll_records) and the plain poll read the same entries: a batch
    of row entries comes as records (one a key, at its last entry) whose events are the
    plain poll's; a batch holding a route entry comes as events."""
    from store.base import FeedBatch, RowRecords

    store = PostgresStore(pg_url)
    records_sub = store.subscribe("records", store.feed_head())
    events_sub = store.subscribe("events", store.feed_head())
    store.write([RowWrite(key="/a", route="product", next_render_at=1_000, sitemap=True)])
    store.write([RowWrite(key="/b", route="product", next_render_at=2_000, cadence_s=60)])
    store.write([RowWrite(key="/c", route="product", next_render_at=3_000)], delete=["/a"])
    head = store.feed_head()
    settle(store)
    got = records_sub.poll_records()
    plain = events_sub.poll()
    assert isinstance(got, RowRecords)
    assert [r[2] for r in got.records] == ["/b", "/c", "/a"]  # each at its key's last entry
    assert all(type(r) is tuple and len(r) == 16 for r in got.records)  # as C reads them
    assert type(got.records[0][6]) is int  # the sitemap flag: C takes an int, not a bool
    assert (
        got.batch().events
        == plain.events
        == [
            RowEvent(key="/b", row=store.get("/b")),
            RowEvent(key="/c", row=store.get("/c")),
            RowEvent(key="/a", row=None),
        ]
    )
    # Both delivered through the head. Their cursors may differ: a poll that drained the
    # log moves to the server's xmin at its read, which other transactions move meanwhile.
    assert records_sub.has_delivered(head) and events_sub.has_delivered(head)
    assert records_sub.statistics().coalesced == 1 and records_sub.statistics().events == 3
    store.set_route("product", default_cadence_s=60)
    store.write([RowWrite(key="/d", route="product", next_render_at=4_000)])
    settle(store)
    routed = records_sub.poll_records()
    assert isinstance(routed, FeedBatch)
    assert routed.events == events_sub.poll().events and len(routed.events) == 2
    for sub in (records_sub, events_sub):
        sub.close()
    store.close()


def change_log_reads(plan: dict[str, Any]) -> list[int]:
    """Rows each scan of change_log in an EXPLAIN ANALYZE plan read, filtered out or not."""
    reads = []
    if plan.get("Relation Name") == "change_log":
        kept = plan["Actual Rows"] * plan["Actual Loops"]
        reads.append(kept + plan.get("Rows Removed by Filter", 0))
    for child in plan.get("Plans", []):
        reads += change_log_reads(child)
    return reads


def test_a_poll_planned_while_the_log_looked_empty_reads_only_its_page(pg_url: str) -> None:
    """The feed plans its poll once (pg_feed.PLANNING), from the statistics of that moment.
    Planned while they say the log is empty, it must still read the log by its index once
    the log has grown: a page after the cursor and the newest entry, not every entry."""
    store = PostgresStore(pg_url)
    try:
        with connect(pg_url) as admin:
            # No analyze may replan it meanwhile: the plan must be the one made from "empty".
            admin.execute("ALTER TABLE change_log SET (autovacuum_enabled = false)")
            admin.execute("ANALYZE change_log")
        sub = store.subscribe("planned")
        try:
            for _ in range(8):  # psycopg prepares a statement at its sixth run
                sub.poll(limit=10)
            for start in range(0, 4000, 1000):
                store.write(
                    [
                        RowWrite(key=f"/p/{i}", route="page", next_render_at=i)
                        for i in range(start, start + 1000)
                    ]
                )
            settle(store)  # another test's transaction on the server may hold the entries back
            assert len(sub.poll(limit=10).events) == 10
            ((name, generic, custom),) = sub._conn.execute(
                "SELECT name, generic_plans, custom_plans FROM pg_prepared_statements"
                " WHERE statement LIKE '%FROM change_log%ORDER BY xid, seq LIMIT%'"
            ).fetchall()
            assert generic > 0 and custom == 0
            xid, seq = sub._xid, sub._seq
            ((explained,),) = sub._conn.execute(
                f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE {name}('{int(xid)}', {int(seq)}, 11)"
            ).fetchall()
            reads = change_log_reads(explained[0]["Plan"])
            # The page (limit + 1, to see whether more follow), and `pending`'s newest entry.
            assert reads and max(reads) <= 11, reads
            assert sum(reads) >= 11  # the page was there to read: the plan did read it
        finally:
            sub.close()
    finally:
        store.close()


def test_a_route_entry_whose_route_cannot_be_read_is_delivered_by_the_next_poll(
    pg_url: str,
) -> None:
    """What a route, settings or site entry names is read after the poll's own statement
    (sql.POLL_DETAILS): when that read fails the cursor stays put, so the next poll
    delivers the same entries, none lost."""
    store = PostgresStore(pg_url)
    sub = store.subscribe("keeper", store.feed_head())
    try:
        store.write([RowWrite(key="/a", route="product", next_render_at=1_000)])
        store.set_route("product", default_cadence_s=60)
        store.set_site(SiteSettings(site="example.com", max_in_flight=2))
        settle(store)
        before = sub.cursor
        with connect(pg_url) as admin:
            admin.execute("ALTER TABLE routes RENAME TO routes_away")
        with pytest.raises(psycopg.errors.UndefinedTable):
            sub.poll()
        assert sub.cursor == before
        with connect(pg_url) as admin:
            admin.execute("ALTER TABLE routes_away RENAME TO routes")
        assert sub.poll().events == [
            RowEvent(key="/a", row=store.get("/a")),
            RouteEvent(route=Route(route="product", default_cadence_s=60)),
            SiteEvent(settings=SiteSettings(site="example.com", max_in_flight=2)),
        ]
    finally:
        sub.close()
        store.close()
