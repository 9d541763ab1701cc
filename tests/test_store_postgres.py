"""PostgresStore's own, on a real server: the schema made once however many nodes open it
at once, a database from a newer build or not from renderqueue refused, a log restored
from elsewhere started anew, consumers that stopped saving dropped by pruning, a locked
row answered with StoreBusy at once or waited for, statistics, and URLs without their
passwords. The contract both backends keep is in test_store_base*.py; the feed's
ordering under concurrent transactions in test_store_postgres_feed.py."""

from __future__ import annotations

import functools
import multiprocessing
import threading
import time
from typing import Any

import msgspec
import psycopg
import pytest
from node_harness import wait_for
from store_helpers import close_all, keys_of, put, settle

from store.base import Cursor, CursorAhead, CursorBelowFloor
from store.cadence import Adaptation
from store.errors import SchemaTooNew, StoreBusy, StoreError, StoreUnavailable
from store.postgres import PostgresStore, sql
from store.postgres.conn import connect
from store.postgres.feed import PLANNING, head, parse_cursor
from store.postgres.schema import LATEST, MIGRATIONS
from store.postgres.store import _round_statement, redacted
from store.rows import Completion

SPAWN = multiprocessing.get_context("spawn")
# One row per migration applied: each applied once.
VERSIONS = "SELECT max(version), count(*) FROM schema_version"


def run_sql(url: str, statement: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


def test_every_connection_runs_without_jit_and_keeps_the_urls_options(pg_url: str) -> None:
    """The planner's JIT would compile a feed poll for tens of milliseconds wherever it
    misjudged a table's size; the URL's own `options` still apply."""
    from urllib.parse import quote

    sep = "&" if "?" in pg_url else "?"
    url = f"{pg_url}{sep}options={quote('-c work_mem=7MB', safe='')}"
    with connect(url) as conn:
        assert conn.execute("SHOW jit").fetchone() == ("off",)
        assert conn.execute("SHOW work_mem").fetchone() == ("7MB",)
    store = PostgresStore(pg_url, prune_interval_s=None)
    try:
        sub = store.subscribe("jit")
        conn = store._conn(store._state(), wait=None)
        assert conn.execute("SHOW jit").fetchone() == ("off",)
        assert sub._conn.execute("SHOW jit").fetchone() == ("off",)  # the feed's own
        sub.close()
    finally:
        store.close()


def test_stores_opening_a_new_database_at_once_create_the_schema_once(pg_url: str) -> None:
    barrier = threading.Barrier(4)
    opened: list[PostgresStore] = []
    errors: list[BaseException] = []

    def open_one() -> None:
        barrier.wait()
        try:
            opened.append(PostgresStore(pg_url))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(opened) == 4
    assert run_sql(pg_url, VERSIONS) == [(LATEST, LATEST)]
    assert run_sql(pg_url, "SELECT count(*) FROM feed_state") == [(1,)]
    assert run_sql(pg_url, "SELECT count(*) FROM hash_secret") == [(1,)]
    assert len({store.hash_secret() for store in opened}) == 1
    opened[0].write([put("/a")])
    assert all(store.get("/a") is not None for store in opened)
    for store in opened:
        store.close()
    again = PostgresStore(pg_url)  # a reopen migrates nothing and keeps the rows
    assert again.count() == 1 and again.statistics().schema_version == LATEST
    assert run_sql(pg_url, VERSIONS) == [(LATEST, LATEST)]
    again.close()


def _open_and_write(url: str, number: int, barrier: Any) -> None:
    barrier.wait(60)
    store = PostgresStore(url)
    store.write([put(f"/p{number}")])
    store.close()


def test_many_processes_opening_a_new_database_at_once_all_open_it(pg_url: str) -> None:
    barrier = SPAWN.Barrier(6)
    processes = [SPAWN.Process(target=_open_and_write, args=(pg_url, n, barrier)) for n in range(6)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [process.exitcode for process in processes] == [0] * 6
    assert run_sql(pg_url, VERSIONS) == [(LATEST, LATEST)]
    store = PostgresStore(pg_url)
    assert [row.key for row in store.walk(None, 10)] == [f"/p{n}" for n in range(6)]
    store.close()


def test_a_row_is_looked_up_by_key_through_the_hash_index(pg_url: str) -> None:
    """The feed's poll reads each entry's row, and a completion's UPDATE each of its keys,
    through render_schedule_key_lookup: long URL keys make the primary key's B-tree too
    large to stay cached (schema._V12)."""
    store = PostgresStore(pg_url, prune_interval_s=None)
    try:
        store.write([put(f"https://example.com/p/{i}") for i in range(2000)])
    finally:
        store.close()
    keys = [f"https://example.com/p/{i}" for i in range(100)]
    with connect(pg_url) as conn:
        conn.execute("ANALYZE render_schedule")
        for setting in PLANNING:  # the feed's session (store.postgres.feed)
            conn.execute(setting)
        poll = "\n".join(
            row[0]
            for row in conn.execute("EXPLAIN " + sql.POLL, {"xid": "0", "seq": 0, "limit": 101})
        )
        assert "render_schedule_key_lookup" in poll, poll
        # A table this small is read whole for a join; at a node's size (here, with the
        # other joins off) the completion looks each of its keys up.
        for join in ("hashjoin", "mergejoin"):
            conn.execute(f"SET enable_{join} = off")
        complete = "\n".join(
            row[0]
            for row in conn.execute(
                "EXPLAIN " + sql.COMPLETE_RENDERED, {"keys": keys, "now": 1, "next_at": 2}
            )
        )
        assert "render_schedule_key_lookup on render_schedule" in complete, complete


def test_a_key_index_built_beforehand_is_taken_by_the_migration(pg_url: str) -> None:
    """An operator builds migration 12's index concurrently before upgrading a large
    table (docs/operations.md), so that no write waits for it: the migration finds it."""
    assert LATEST == 12, "this test undoes migration 12 alone: point it at that one"
    PostgresStore(pg_url, prune_interval_s=None).close()
    run_sql(pg_url, "DROP INDEX render_schedule_key_lookup")
    run_sql(pg_url, "DELETE FROM schema_version WHERE version = 12")
    run_sql(
        pg_url,
        "CREATE INDEX CONCURRENTLY render_schedule_key_lookup ON render_schedule USING hash (key)",
    )
    store = PostgresStore(pg_url, prune_interval_s=None)
    try:
        assert store.statistics().schema_version == LATEST
    finally:
        store.close()
    assert run_sql(pg_url, VERSIONS) == [(LATEST, LATEST)]


def test_a_version_2_database_is_migrated_and_gets_its_hash_secret(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE schema_version (version integer NOT NULL)")
        for version in (0, 1):
            for statement in MIGRATIONS[version]:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version + 1,))
        conn.execute(
            "INSERT INTO render_schedule (key, route, sitemap, next_render_at, version) "
            "VALUES ('/kept', 'product', false, 5, 1)"
        )
    store = PostgresStore(pg_url)
    secret = store.hash_secret()
    assert len(secret) == 16 and store.get("/kept") is not None
    store.close()
    assert run_sql(pg_url, VERSIONS) == [(LATEST, LATEST)]
    again = PostgresStore(pg_url)
    assert again.hash_secret() == secret
    again.close()


def test_a_malformed_hash_secret_is_a_clear_error(pg_url: str) -> None:
    PostgresStore(pg_url).close()
    run_sql(pg_url, "UPDATE hash_secret SET secret = %s", (b"\x00" * 20,))
    store = PostgresStore(pg_url)
    try:
        with pytest.raises(StoreError, match="is 20 bytes"):
            store.hash_secret()
        run_sql(pg_url, "DELETE FROM hash_secret")
        with pytest.raises(StoreError, match="missing"):
            store.hash_secret()
    finally:
        store.close()


def test_a_database_at_a_newer_schema_version_is_refused(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    store.write([put("/a")])
    store.close()
    run_sql(pg_url, "INSERT INTO schema_version (version) VALUES (%s)", (LATEST + 1,))
    with pytest.raises(SchemaTooNew) as refused:
        PostgresStore(pg_url)
    message = str(refused.value)
    assert f"schema version {LATEST + 1}" in message and f"versions up to {LATEST}" in message
    assert "127.0.0.1" in message  # which database
    assert "at least as new" in message  # and what to do
    assert run_sql(pg_url, "SELECT count(*) FROM render_schedule") == [(1,)]


def test_a_render_schedule_table_without_a_schema_version_is_refused(pg_url: str) -> None:
    run_sql(pg_url, "CREATE TABLE render_schedule (key text PRIMARY KEY, owner text)")
    with pytest.raises(StoreError, match="not made by renderqueue") as refused:
        PostgresStore(pg_url)
    assert not isinstance(refused.value, SchemaTooNew)
    assert run_sql(pg_url, "SELECT to_regclass('change_log'), to_regclass('schema_version')") == [
        (None, None)
    ]


def test_a_log_restored_from_another_database_is_started_anew_and_its_cursors_refused(
    pg_url: str,
) -> None:
    store = PostgresStore(pg_url)
    sub = store.subscribe("keeper")
    store.write([put("/a"), put("/b")])
    settle(store)
    assert keys_of(sub.poll().events) == ["/a", "/b"]
    sub.save()
    ours = sub.cursor
    sub.close()
    store.close()
    # The new log's floor is the server's horizon (xmin) when it is started: a cursor is
    # refused as below it once no transaction open on the shared server (another test's)
    # holds the horizon at or under the cursor's transaction.
    ours_xid = parse_cursor(ours, store.origin).xid

    def horizon() -> int:
        with connect(pg_url) as conn:
            return head(conn)[0]  # the snapshot's xmin

    wait_for(lambda: horizon() > ours_xid, 60, "the horizon past /a, /b")
    # What a dump restored here carries: the log and cursors of the database it came from.
    run_sql(pg_url, "UPDATE feed_state SET origin = 'elsewhere.1'")
    theirs = Cursor(token=ours.token.replace(f":{store.origin}:", ":elsewhere.1:"))
    assert theirs != ours

    store = PostgresStore(pg_url)
    stats = store.statistics()
    assert (stats.resyncs, stats.log_rows, stats.consumers) == (1, 0, 0)
    assert store.count() == 2  # the rows stay; only the log and its cursors are new
    with pytest.raises(CursorAhead, match="restored from a dump"):
        store.subscribe("keeper", theirs)
    with pytest.raises(CursorBelowFloor):
        store.subscribe("keeper", ours)  # issued here, but the log below it is gone
    fresh = store.subscribe("keeper")  # the saved cursor went with the log: the head
    store.write([put("/c")])
    settle(store)
    assert keys_of(fresh.poll().events) == ["/c"]
    fresh.close()
    assert PostgresStore(pg_url).statistics().resyncs == 1  # adopted once, not at each open
    close_all(store)


def test_a_cursor_past_the_next_transaction_is_refused_as_ahead(pg_url: str) -> None:
    store = PostgresStore(pg_url)
    _, _, xid, _, _ = store.feed_head().token.rsplit(":", 4)
    ahead = Cursor(token=f"pg:{store.origin}:{int(xid) + 10**9}:0:{int(xid) + 10**9}")
    with pytest.raises(CursorAhead, match="past the database's next transaction id"):
        store.subscribe("keeper", ahead)
    assert store.consumers() == {}
    store.close()


def test_pruning_vacuums_the_log_so_it_stays_as_long_as_the_writes_not_yet_read(
    pg_url: str,
) -> None:
    store = PostgresStore(pg_url, prune_interval_s=None)
    consumer = store.subscribe("reader")

    def pages() -> int:
        (found,) = run_sql(pg_url, "SELECT pg_relation_size('change_log') / 8192")
        return int(found[0])

    def vacuums() -> int:
        (found,) = run_sql(
            pg_url,
            "SELECT vacuum_count + autovacuum_count FROM pg_stat_user_tables"
            " WHERE relid = 'change_log'::regclass",
        )
        return int(found[0])

    # One round of writes and their entries, as pages: what each further round would add
    # to the log's table if the entries it prunes were never vacuumed.
    store.write([put(f"/{i}") for i in range(2000)])
    settle(store)
    round_pages = pages()
    before = vacuums()
    for round_ in range(12):
        store.write([put(f"/{i}", at=round_) for i in range(2000)])
        settle(store)
        while consumer.poll(1000).events:
            pass
        consumer.save()
        assert store.prune() >= 2000
    # Unvacuumed, 24,000 pruned entries would fill about thirteen rounds' pages.
    assert pages() <= 3 * round_pages, (pages(), round_pages)
    # And a VACUUM followed every prune: the pruner's, or autovacuum's where that held the
    # table when the pruner came (SKIP_LOCKED). The statistics reach the view a moment
    # after the backend's.
    deadline = time.monotonic() + 10
    while vacuums() < before + 12 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert vacuums() >= before + 12
    consumer.close()
    store.close()


def test_pruning_drops_consumers_that_saved_nothing_for_their_ttl(pg_url: str) -> None:
    store = PostgresStore(pg_url, consumer_ttl_s=60, prune_interval_s=None)
    dead = store.subscribe("dead")
    live = store.subscribe("live")
    store.write([put(f"/{i}") for i in range(20)])
    settle(store)
    assert len(live.poll().events) == 20
    live.save()
    assert store.prune() == 0  # "dead" holds the log at its start
    run_sql(
        pg_url,
        "UPDATE feed_consumers SET saved_at = now() - interval '61 seconds' WHERE consumer = %s",
        ("dead",),
    )
    assert store.prune() == 20
    assert set(store.consumers()) == {"live"}
    with pytest.raises(CursorBelowFloor):
        dead.poll()  # back after its TTL: told to resync, never replayed short
    store.write([put("/after")])
    settle(store)
    assert keys_of(live.poll().events) == ["/after"]
    dead.close()
    live.close()
    close_all(store)


def test_a_locked_row_makes_complete_busy_at_once_without_wait_and_waited_for_with_it(
    pg_url: str,
) -> None:
    # A busy timeout longer than the suite's own: a call that waited it out instead of
    # answering at once would hang the test, not pass it late.
    store = PostgresStore(pg_url, busy_timeout_s=3600)
    store.write([put("/free"), put("/locked")])
    before = store.get_many(["/free", "/locked"])
    items = [
        Completion(key="/free", outcome="rendered", now=5_000),
        Completion(key="/locked", outcome="rendered", now=5_000),
    ]
    holder = psycopg.connect(pg_url)  # a transaction of its own, left open
    try:
        holder.execute("SELECT 1 FROM render_schedule WHERE key = '/locked' FOR UPDATE")
        with pytest.raises(StoreBusy):  # while the lock is still held: it did not wait
            store.complete(items, wait=False)
        assert store.get_many(["/free", "/locked"]) == before  # nothing written
        assert store.statistics().busy == 1

        done: list[Any] = []
        waiter = threading.Thread(target=lambda: done.append(store.complete(items, wait=True)))
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive() and done == []  # waiting on the lock, not refused
        holder.rollback()
        waiter.join(30)
        assert not waiter.is_alive()
    finally:
        holder.close()
    (rows,) = done
    assert [row.last_outcome for row in rows] == ["rendered", "rendered"]
    assert rows == [store.get("/free"), store.get("/locked")]
    store.close()


def test_a_round_of_renders_alone_writes_what_the_whole_statement_writes(pg_url: str) -> None:
    """The usual round (every item rendered at one time toward one next render, nothing
    observed) takes the statement with one array; twin rows completed by it and by the
    statement for every outcome (the same round with a failure in it) come out alike:
    each cadence's source, a learned cadence, a retired row revived, a next render given."""
    store = PostgresStore(pg_url, prune_interval_s=None)
    try:
        store.set_route("adapting", adapt=Adaptation(min_s=3600, max_s=7 * 86400))
        store.set_route("routed", default_cadence_s=900, retire_after=1)
        twins = ("/plain", "/whole")
        for twin in twins:
            store.write(
                [
                    put(f"{twin}/own", cadence_s=60),
                    put(f"{twin}/route", route="routed"),
                    put(f"{twin}/global", route="unset"),
                    put(f"{twin}/learned", route="adapting"),
                    put(f"{twin}/retired", route="routed"),
                    put(f"{twin}/failing"),
                ]
            )
            store.complete(
                [
                    Completion(key=f"{twin}/learned", outcome="rendered", now=10, changed=False),
                    Completion(key=f"{twin}/retired", outcome="not_found", now=10),
                ]
            )
        retired = store.get("/plain/retired")
        assert retired is not None and retired.retired_at is not None
        names = ("own", "route", "global", "learned", "retired")
        for now, next_at in ((50_000, None), (90_000, 7_000_000)):

            def round_of(
                twin: str, now: int = now, next_at: int | None = next_at
            ) -> list[Completion]:
                return [
                    Completion(
                        key=f"{twin}/{n}", outcome="rendered", now=now, next_render_at=next_at
                    )
                    for n in names
                ]

            plain = round_of("/plain")
            whole = [
                *round_of("/whole"),
                Completion(key="/whole/failing", outcome="failed", now=now),
            ]
            assert (
                _round_statement(plain, [False] * 5, [None] * 5, [None] * 5)[0]
                == sql.COMPLETE_RENDERED
            )
            assert _round_statement(whole, [False] * 6, [None] * 6, [None] * 6)[0] == sql.COMPLETE
            by_plain = store.complete(plain)
            by_whole = store.complete(whole)[:5]
            for a, b in zip(by_plain, by_whole, strict=True):
                assert a is not None and b is not None
                same = {"key": a.key.replace("/plain", "/whole"), "version": b.version}
                assert msgspec.structs.replace(a, **same) == b
            learned = by_plain[3]
            assert learned is not None and learned.learned_cadence_s is not None
            assert by_plain[4] is not None and by_plain[4].retired_at is None
            if next_at is None:
                assert learned.next_render_at == now + 1000 * learned.learned_cadence_s
            else:
                assert {row.next_render_at for row in by_plain if row} == {next_at}
        assert store.complete([Completion(key="/none", outcome="rendered", now=1)]) == [None]
    finally:
        store.close()


def test_statistics_count_what_the_store_holds_and_did(pg_url: str) -> None:
    store = PostgresStore(pg_url, prune_interval_s=None)
    sub = store.subscribe("keeper")
    store.write([put(f"/{i}") for i in range(10)])
    store.write(delete=["/3"])
    store.set_route("product", default_cadence_s=60)
    stats = store.statistics()
    assert (stats.rows, stats.routes, stats.log_rows, stats.consumers) == (9, 1, 12, 1)
    assert (stats.transactions, stats.rows_written) == (4, 12)  # subscribe writes too
    assert (stats.schema_version, stats.resyncs, stats.reconnects, stats.busy) == (
        LATEST,
        0,
        0,
        0,
    )
    assert stats.origin == store.origin and stats.origin.count(".") == 1
    assert stats.url == pg_url  # no password in it to hide
    sub.close()
    close_all(store)


def test_urls_lose_their_passwords_in_statistics_and_errors(pg_url: str) -> None:
    assert (
        redacted("postgresql://rq:s3cret@db.example:5432/rq?sslmode=require")
        == "postgresql://rq:***@db.example:5432/rq?sslmode=require"
    )
    assert redacted("postgresql://rq@db.example/rq") == "postgresql://rq@db.example/rq"
    assert redacted("postgresql://rq:p%40ss@db/rq") == "postgresql://rq:***@db/rq"

    with pytest.raises(ValueError, match="postgresql://") as wrong:
        PostgresStore("mysql://rq:s3cret@db.example/rq")
    assert "s3cret" not in str(wrong.value)
    with pytest.raises(StoreUnavailable) as unreachable:
        PostgresStore("postgresql://rq:s3cret@127.0.0.1:1/rq")
    assert "s3cret" not in str(unreachable.value)

    with_password = pg_url.replace("postgresql://postgres@", "postgresql://postgres:s3cret@", 1)
    assert with_password != pg_url  # trust authentication ignores the password
    store = PostgresStore(with_password)
    assert "s3cret" not in store.statistics().url and ":***@" in store.statistics().url
    store.close()
    with pytest.raises(StoreError, match="closed") as closed:
        store.get("/a")
    assert "s3cret" not in str(closed.value)


def test_a_node_with_another_site_policy_is_refused_at_join(pg_url: str) -> None:
    """The site defaults are cluster settings: a cap enforced by some nodes only would not
    be one."""
    from store.postgres.membership import NodeMembership, SettingsDiffer

    PostgresStore(pg_url).close()  # the schema
    member = functools.partial(
        NodeMembership, pg_url, instance="i", advertised_url="http://127.0.0.1:1", ttl_s=30.0
    )
    first = member("a", site_policy="max_in_flight=4")
    second = member("b", site_policy="max_in_flight=none")
    try:
        first.join()
        with pytest.raises(
            SettingsDiffer, match=r"site settings.*max_in_flight=none.*max_in_flight=4"
        ):
            second.join()
    finally:
        first.close()
        second.close()


def test_a_node_that_divides_keys_otherwise_is_refused_at_join(pg_url: str) -> None:
    """Ownership by key on one node and by site on another would give a key two owners."""
    from store.postgres.membership import NodeMembership, SettingsDiffer

    PostgresStore(pg_url).close()  # the schema
    member = functools.partial(
        NodeMembership, pg_url, instance="i", advertised_url="http://127.0.0.1:1", ttl_s=30.0
    )
    first = member("a", ownership="site")
    second = member("b")
    try:
        first.join()
        with pytest.raises(SettingsDiffer, match="ownership: this node key, the cluster site"):
            second.join()
    finally:
        first.close()
        second.close()


def test_a_lease_a_left_node_handed_over_is_completed_once_and_its_restart_takes_back_the_rest(
    pg_url: str,
) -> None:
    """Node a leaves handing over two leases (key hash, token). Another node completes one
    through the hand-over, once: a second try, a wrong token and a lease past its end are
    not taken, and the row is written with the settle. a's next start takes back the other
    (no node completes it through the hand-over after that) and learns the first was
    completed elsewhere, so it can end it in its restored table."""
    from shm import key_hash
    from store.postgres.membership import NodeMembership
    from store.rows import Handover

    store = PostgresStore(pg_url)
    member = functools.partial(
        NodeMembership, pg_url, "a", instance="i", advertised_url="http://127.0.0.1:1"
    )
    first, second = member(), member()
    try:
        store.write([put("/one"), put("/two"), put("/three")])
        leases = {key: (key_hash(key.encode()), 100 + n) for n, key in enumerate(("/one", "/two"))}
        late = (key_hash(b"/three"), 300)
        first.join()
        db_now = first.db_now_ms()

        def complete(key: str, lease: tuple[int, int]) -> list[Any]:
            item = Completion(key=key, outcome="rendered", now=db_now)
            return store.complete_handed_over("a", [item], [lease])

        # Handed over at a view change while a stays live: a completes it itself.
        kept = Handover(
            node="a",
            incarnation=first.incarnation,
            key_hashes=[leases["/one"][0]],
            expires_at_ms=[db_now + 60_000],
            tokens=[leases["/one"][1]],
        )
        assert store.acknowledge("a", first.incarnation, [first.incarnation], kept)
        assert complete("/one", leases["/one"]) == [False], "a live incarnation keeps its own"
        first.leave(
            Handover(
                node="a",
                incarnation=first.incarnation,
                key_hashes=[leases["/one"][0], leases["/two"][0], late[0]],
                expires_at_ms=[db_now + 60_000, db_now + 60_000, db_now - 1],
                tokens=[leases["/one"][1], leases["/two"][1], late[1]],
            )
        )
        assert complete("/one", (leases["/one"][0], 999)) == [False], "another token"
        assert complete("/three", late) == [False], "a lease past its end"
        (row,) = complete("/one", leases["/one"])
        assert row is not False and row.last_outcome == "rendered"
        assert store.get("/one").last_outcome == "rendered"  # type: ignore[union-attr]
        assert complete("/one", leases["/one"]) == [False], "completed once"

        second.join()
        assert second.incarnation != first.incarnation
        assert second.take_back(list(leases.values())) == [leases["/one"]]
        assert complete("/two", leases["/two"]) == [False], "taken back by the restart"
        assert store.get("/two").last_outcome is None  # type: ignore[union-attr]
    finally:
        first.close()
        second.close()
        store.close()
