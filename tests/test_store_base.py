"""The ScheduleStore contract (store.base), on every backend: writes all or nothing,
versions that only rise, reads and walks, completions, routes and the global default,
threads and processes sharing a store. SQLite's own details stay in test_store_sqlite.py,
PostgreSQL's in test_store_postgres.py."""

from __future__ import annotations

import multiprocessing
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from store_helpers import (
    ContractStore,
    close_all,
    is_postgres,
    keys_of,
    open_url,
    put,
    settle,
    subscribed_after,
)

from store.base import cluster_membership
from store.errors import StoreBusy, StoreError
from store.rows import Completion, Handover, Outcome, Route, Row, RowEvent, SiteSettings

SPAWN = multiprocessing.get_context("spawn")


def test_upsert_get_and_versions(any_store: ContractStore) -> None:
    store = any_store
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


def test_versions_keep_rising_across_delete_and_reinsert(any_store: ContractStore) -> None:
    any_store.write([put("/a")])
    before = any_store.get("/a")
    any_store.write(delete=["/a"])
    assert any_store.get("/a") is None
    any_store.write([put("/a")])
    after = any_store.get("/a")
    assert before is not None and after is not None
    assert after.version > before.version


def test_a_key_upserted_twice_in_one_batch_ends_as_its_last_write(
    any_store: ContractStore,
) -> None:
    """As if the batch were applied in order. How many versions and log entries the
    repeats take is the backend's own (SQLite: one each; PostgreSQL: the last only)."""
    any_store.write([put("/a", 0)])
    before = any_store.get("/a")
    sub = any_store.subscribe("keeper")
    any_store.write([put("/a", 1, cadence_s=60), put("/a", 2, sitemap=True), put("/b", 3)])
    a, b = any_store.get("/a"), any_store.get("/b")
    assert before is not None and a is not None and b is not None
    assert (a.next_render_at, a.cadence_s, a.sitemap) == (2, None, True)
    assert a.version > before.version and b.next_render_at == 3
    settle(any_store)
    assert sub.poll().events == [RowEvent(key="/a", row=a), RowEvent(key="/b", row=b)]
    sub.close()


def test_get_many_and_walk(any_store: ContractStore) -> None:
    store = any_store
    keys = [f"/k/{i:04d}" for i in range(250)]
    shuffled = keys[:]
    random.Random(1).shuffle(shuffled)
    store.write([put(k) for k in shuffled])
    wanted = ["/k/0003", "/k/0100", "/nope", "/k/0003", 'weird "quote\\']
    found = store.get_many(wanted)
    assert sorted(found) == ["/k/0003", "/k/0100"]
    assert store.get_many([]) == {}
    assert store.get_many_at([]).rows == []
    # A key named twice is one row.
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
    at = store.walk_at("/k/0246", 2)
    assert at.rows == store.walk("/k/0246", 2) and [r.key for r in at.rows] == [
        "/k/0247",
        "/k/0248",
    ]
    assert store.walk_at("/k/0249", 10).rows == []
    assert store.walk_at(None, 3).rows == store.walk(None, 3)
    with pytest.raises(ValueError, match="limit"):
        store.walk(None, 0)
    with pytest.raises(ValueError, match="limit"):
        store.walk_at(None, 0)


def test_walk_orders_non_ascii_keys_like_python(any_store: ContractStore) -> None:
    keys = ["/z", "/é", "/e", "/日本", "/E", "/ü/1", "/€"]
    any_store.write([put(k) for k in keys])
    assert [r.key for r in any_store.walk(None, 100)] == sorted(keys)
    assert [r.key for r in any_store.walk("/e", 100)] == sorted(k for k in keys if k > "/e")


def test_iterables_are_written_whole(any_store: ContractStore) -> None:
    any_store.write(iter([put("/a"), put("/b")]), delete=iter(["/none"]))  # type: ignore[arg-type]
    assert any_store.count() == 2
    any_store.write(delete=(k for k in ["/a"]))  # type: ignore[arg-type]
    assert any_store.count() == 1


def test_a_batch_with_one_bad_row_writes_nothing(any_store: ContractStore) -> None:
    store = any_store
    store.write([put("/keep")])
    sub = subscribed_after(store)
    with pytest.raises(ValueError, match=r"upsert\[2\].*cadence_s"):
        store.write([put("/x1"), put("/x2"), put("/x3", cadence_s=0)], delete=["/keep"])
    with pytest.raises(ValueError, match=r"delete\[0\].*empty"):
        store.write([put("/x1")], delete=[""])
    assert store.count() == 1 and store.get("/keep") is not None
    store.write([put("/after")])
    settle(store)
    batch = sub.poll()
    assert keys_of(batch.events) == ["/after"]  # nothing of the refused batches was logged
    assert sub.statistics().log_entries == 1
    sub.close()


def poison(url: str) -> None:
    """A trigger that fails any insert of '/poison', inside the writing transaction."""
    if is_postgres(url):
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                """CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                    IF NEW.key = '/poison' THEN RAISE EXCEPTION 'poisoned'; END IF;
                    RETURN NEW;
                END $$"""
            )
            conn.execute(
                "CREATE TRIGGER refuse BEFORE INSERT ON render_schedule "
                "FOR EACH ROW EXECUTE FUNCTION refuse()"
            )
        return
    lite = sqlite3.connect(url.removeprefix("sqlite:///"))
    lite.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON render_schedule WHEN NEW.key = '/poison' "
        "BEGIN SELECT RAISE(ABORT, 'poisoned'); END"
    )
    lite.commit()
    lite.close()


def test_a_batch_failing_inside_the_transaction_writes_nothing(
    store_url: str, any_store: ContractStore
) -> None:
    store = any_store
    store.write([put("/keep")])
    sub = subscribed_after(store)
    # A failure only the database sees, after the first rows of the batch were written.
    poison(store_url)
    with pytest.raises(Exception, match="poisoned"):
        store.write([put("/x1"), put("/x2"), put("/poison")], delete=["/keep"])
    assert store.count() == 1 and store.get("/keep") is not None
    store.write([put("/x1")])  # the connection is usable afterwards
    assert store.count() == 2
    settle(store)
    assert keys_of(sub.poll().events) == ["/x1"]
    assert sub.statistics().log_entries == 1
    sub.close()


def test_awkward_keys_are_stored_and_read_back(any_store: ContractStore) -> None:
    keys = ["/é/日本", '/"quote\\', "/tab\there", "/x?" + "x" * 2045, "é" * 1024]
    any_store.write([put(k) for k in keys])
    assert sorted(any_store.get_many(keys)) == sorted(keys)
    assert sorted(r.key for r in any_store.get_many_at(keys).rows) == sorted(keys)
    assert [any_store.get(k) is not None for k in keys] == [True] * len(keys)
    assert [r.key for r in any_store.walk(None, 10)] == sorted(keys)
    got = any_store.complete([Completion(key=k, outcome="rendered", now=1) for k in keys])
    assert [r.key if r else None for r in got] == keys


def test_a_key_holding_a_nul_is_refused_with_nothing_written(any_store: ContractStore) -> None:
    """No URL holds one, and PostgreSQL's text cannot: every backend refuses it alike, at
    the boundary, naming the row (never a key written and then missed by a read, nor a
    driver's error)."""
    keys = ["/a", "/nul\x00in/the/middle"]
    with pytest.raises(ValueError, match=r"upsert\[1\].*NUL"):
        any_store.write([put(k) for k in keys])
    assert any_store.count() == 0
    with pytest.raises(ValueError, match="NUL"):
        any_store.get_many(keys)
    with pytest.raises(ValueError, match="NUL"):
        any_store.complete([Completion(key=keys[1], outcome="rendered", now=1)])


def test_complete_rendered_uses_the_effective_cadence(any_store: ContractStore) -> None:
    store = any_store
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
    assert store.complete([]) == []


def test_a_batch_given_one_next_render_at_sets_it_on_every_row(
    any_store: ContractStore,
) -> None:
    any_store.write([put("/x", 1, cadence_s=60), put("/y", 1)])
    got = any_store.complete(
        [Completion(key=k, outcome="rendered", now=7_000, next_render_at=99) for k in ("/y", "/x")]
    )
    assert [(r.key, r.next_render_at, r.last_rendered_at) if r else None for r in got] == [
        ("/y", 99, 7_000),
        ("/x", 99, 7_000),
    ]
    assert got == [any_store.get("/y"), any_store.get("/x")]


def test_the_largest_cadence_at_the_latest_time_stays_an_integer(any_store: ContractStore) -> None:
    any_store.write([put("/far", cadence_s=2**31 - 1)])
    (row,) = any_store.complete([Completion(key="/far", outcome="rendered", now=2**62)])
    assert row is not None and row.next_render_at == 2**62 + 1000 * (2**31 - 1)
    assert type(row.next_render_at) is int
    assert any_store.get("/far") == row


def test_complete_failed_keeps_it_due_and_gone_deletes(any_store: ContractStore) -> None:
    store = any_store
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


def test_not_found_in_a_row_retires_a_row_and_an_upsert_revives_it(
    any_store: ContractStore,
) -> None:
    store = any_store
    store.set_route("shop", retire_after=2)
    store.write(
        [put("/dead", 500, cadence_s=60), put("/flaky", 500), put("/shop", 500, route="shop")]
    )

    def not_found(key: str, now: int, **fields: Any) -> Row | None:
        (row,) = store.complete([Completion(key=key, outcome="not_found", now=now, **fields)])
        return row

    first = not_found("/dead", 1_000)
    assert first is not None and first.not_found_streak == 1 and first.retired_at is None
    # Rescheduled a cadence on, not rendered.
    assert first.next_render_at == 61_000 and first.last_rendered_at is None
    assert first.last_outcome == "not_found"
    second = not_found("/dead", 2_000, next_render_at=5_000)
    assert second is not None and second.next_render_at == 5_000 and second.retired_at is None
    third = not_found("/dead", 3_000)
    assert third is not None and third.not_found_streak == 3
    assert (third.retired_at, third.retired_reason) == (3_000, "not_found")
    assert store.get("/dead") == third
    # The route's own retire_after; any other outcome ends the streak.
    assert not_found("/flaky", 1_000) is not None
    store.complete([Completion(key="/flaky", outcome="failed", now=1_500)])
    flaky = not_found("/flaky", 2_000)
    assert flaky is not None and flaky.not_found_streak == 1 and flaky.retired_at is None
    not_found("/shop", 1_000)
    shop = not_found("/shop", 2_000)
    assert shop is not None and shop.retired_at == 2_000
    assert [r.key for r in store.retired()] == ["/dead", "/shop"]
    assert [r.key for r in store.retired(after="/dead", limit=5)] == ["/shop"]
    assert [r.key for r in store.retired(limit=1)] == ["/dead"]
    for bad in ({"limit": 0}, {"limit": 1001}, {"after": ""}):
        with pytest.raises(ValueError):
            store.retired(**bad)
    # An upsert revives a row: its streak starts again.
    store.write([put("/dead", 7_000, cadence_s=60)])
    revived = store.get("/dead")
    assert revived is not None and revived.retired_at is None and revived.retired_reason is None
    assert revived.not_found_streak == 0 and revived.next_render_at == 7_000
    assert [r.key for r in store.retired()] == ["/shop"]
    # A render does too.
    (rendered,) = store.complete([Completion(key="/shop", outcome="rendered", now=9_000)])
    assert rendered is not None and rendered.retired_at is None and store.retired() == []


def test_a_routes_retire_after_is_checked(any_store: ContractStore) -> None:
    store = any_store
    assert store.set_route("shop").retire_after == 3
    assert store.set_route("shop", retire_after=7).retire_after == 7
    assert store.set_route("shop", paused=True).retire_after == 7
    for bad in (0, 1001, True, 2.0):
        with pytest.raises(ValueError, match="retire_after"):
            store.set_route("shop", retire_after=bad)  # type: ignore[arg-type]
    assert store.routes() == [Route(route="shop", paused=True, retire_after=7)]


def test_a_key_completed_twice_in_one_call_is_applied_in_order(
    new_store_url: Callable[[], str],
) -> None:
    """A batch gives each item's row as one call per item would (versions aside), and
    logs as many entries (one per change of a row)."""
    keys = ["/a", "/b", "/c", "/d\tnul", '/e "quote\\']
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
    batched, one_by_one = open_url(new_store_url()), open_url(new_store_url())
    subs = []
    before = []
    for opened in (batched, one_by_one):
        opened.set_route("article", default_cadence_s=3600)
        opened.write([put(k, route="article" if i % 2 else "product") for i, k in enumerate(keys)])
        sub = opened.subscribe("keeper")
        # On PostgreSQL a transaction running elsewhere when the head was read makes the
        # subscription start before the writes above: read them first, and count after.
        settle(opened)
        sub.poll(10_000)
        subs.append(sub)
        before.append(sub.statistics().log_entries)
    try:
        got = batched.complete(items)
        want = [one_by_one.complete([item])[0] for item in items]
        unversioned = [None if r is None else msgspec.structs.replace(r, version=0) for r in got]
        assert unversioned == [
            None if r is None else msgspec.structs.replace(r, version=0) for r in want
        ]
        assert any(r is None for r in got) and any(r is not None for r in got)
        assert [r.key for r in batched.walk(None, 10)] == [r.key for r in one_by_one.walk(None, 10)]
        logged = []
        for opened, sub, start in zip((batched, one_by_one), subs, before, strict=True):
            settle(opened)
            assert not sub.poll(10_000).more
            logged.append(sub.statistics().log_entries - start)
        assert logged[0] == logged[1] > 0  # one log entry per change of a row
    finally:
        for sub in subs:
            sub.close()
        close_all(batched)
        close_all(one_by_one)


def test_completing_many_keys_logs_each_changed_row_once(any_store: ContractStore) -> None:
    store = any_store
    keys = [f"/v/{i:03d}" for i in range(120)]
    store.write([put(k, cadence_s=60 if i % 2 else None) for i, k in enumerate(keys)])
    before = {k: row.version for k, row in store.get_many(keys).items()}
    sub = subscribed_after(store)
    outcomes: list[Outcome] = ["rendered", "failed", "gone"]
    got = store.complete(
        [Completion(key=k, outcome=outcomes[i % 3], now=5_000) for i, k in enumerate(keys)]
        + [Completion(key="/v/none", outcome="rendered", now=5_000)]
    )
    rows = [r for r in got if r is not None]
    assert [r.key for r in rows] == [k for i, k in enumerate(keys) if i % 3 != 2]
    assert all(r.version > before[r.key] for r in rows)
    assert len({r.version for r in rows}) == len(rows)
    assert rows == [store.get(r.key) for r in rows]
    settle(store)
    events = sub.poll(10_000).events
    assert sub.statistics().log_entries == len(keys)  # each changed row once, nothing else
    # One event per changed key, carrying what complete() returned (None: gone); their
    # order inside one transaction is the backend's own.
    assert {e.key: e.row for e in events if isinstance(e, RowEvent)} == dict(
        zip(keys, got[:-1], strict=True)
    )
    assert len(events) == len(keys)
    sub.close()


def test_a_bad_completion_changes_nothing(any_store: ContractStore) -> None:
    any_store.write([put("/a", 5)])
    with pytest.raises(ValueError, match=r"completion\[1\]"):
        any_store.complete(
            [
                Completion(key="/a", outcome="gone", now=1),
                Completion(key="/a", outcome="rendered", now=1.5),  # type: ignore[arg-type]
            ]
        )
    assert any_store.get("/a") is not None


def test_routes_and_the_global_default(any_store: ContractStore) -> None:
    store = any_store
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
    assert store.routes() == [
        Route(route="article"),
        Route(route="product", default_cadence_s=None, paused=True),
    ]
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
    assert store.default_cadence_s() == 3_600 and len(store.routes()) == 2


def test_a_routes_site_pattern_is_stored_kept_cleared_and_checked(
    any_store: ContractStore,
) -> None:
    store = any_store
    assert store.set_route("shop", site_pattern="*.example.com") == Route(
        route="shop", site_pattern="*.example.com"
    )
    # Other changes keep it; a new value replaces it; clearing ends it.
    assert store.set_route("shop", default_cadence_s=600).site_pattern == "*.example.com"
    assert store.set_route("shop", site_pattern="customer-a").site_pattern == "customer-a"
    assert store.routes() == [Route(route="shop", default_cadence_s=600, site_pattern="customer-a")]
    for bad in ("*.com", "Example.com", "www.example.com", "a/b", "*"):
        with pytest.raises(ValueError, match="site_pattern"):
            store.set_route("shop", site_pattern=bad)
    with pytest.raises(ValueError, match="both set and clear"):
        store.set_route("shop", site_pattern="a.example", clear_site_pattern=True)
    assert store.routes()[0].site_pattern == "customer-a"  # nothing changed
    assert store.set_route("shop", clear_site_pattern=True).site_pattern is None


def test_site_settings_are_stored_cleared_and_checked(any_store: ContractStore) -> None:
    store = any_store
    assert store.sites() == [] and store.get_site("example.com") is None
    shop = SiteSettings(site="shop.example.com", max_in_flight=4)
    assert store.set_site(shop) == shop
    both = SiteSettings(site="example.com", max_in_flight=0, min_interval_ms=250)
    store.set_site(both)
    assert store.sites() == [both, shop] and store.get_site("example.com") == both
    spaced = SiteSettings(site="shop.example.com", min_interval_ms=1_000)
    store.set_site(spaced)  # every field is the new one: the cap is cleared
    assert store.get_site("shop.example.com") == spaced
    assert store.set_site(SiteSettings(site="shop.example.com")) is None  # both cleared
    assert store.sites() == [both]
    store.set_site(SiteSettings(site="nothing.example"))  # clearing what is not there
    for bad, message in (
        (SiteSettings(site="Example.com", max_in_flight=1), "lower-case"),
        (SiteSettings(site="example.com/a", max_in_flight=1), "no port, path"),
        (SiteSettings(site="", max_in_flight=1), "host name"),
        (SiteSettings(site="a" * 254, max_in_flight=1), "over 253 bytes"),
        (SiteSettings(site="example.com", max_in_flight=-1), "max_in_flight -1"),
        (SiteSettings(site="example.com", max_in_flight=4097), "outside 0..4096"),
        (SiteSettings(site="example.com", min_interval_ms=86_400_001), "min_interval_ms"),
        (SiteSettings(site="example.com", max_in_flight=True), "max_in_flight True"),
    ):
        with pytest.raises(ValueError, match=message):
            store.set_site(bad)
    assert store.sites() == [both]


def test_threads_share_one_store(any_store: ContractStore) -> None:
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for i in range(50):
                any_store.write([put(f"/t{n}/{i}")])
                assert any_store.get(f"/t{n}/{i}") is not None
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert any_store.count() == 200
    assert any_store.statistics().transactions == 200


def _secret_of(url: str) -> bytes:
    store = open_url(url)
    try:
        return store.hash_secret()
    finally:
        store.close()


def test_each_database_has_its_own_hash_secret_for_good(
    new_store_url: Callable[[], str],
) -> None:
    """Made with the schema, the same for every opener and every reopen (every node of a
    cluster hashes alike), and another database's is another."""
    url = new_store_url()
    first = _secret_of(url)
    assert isinstance(first, bytes) and len(first) == 16
    with SPAWN.Pool(2) as pool:
        assert pool.map(_secret_of, [url] * 2) == [first] * 2
    assert _secret_of(url) == first
    assert _secret_of(new_store_url()) != first


def test_a_closed_store_refuses_work(store_url: str) -> None:
    opened = open_url(store_url)
    opened.close()
    with pytest.raises(StoreError, match="closed"):
        opened.get("/a")
    with pytest.raises(StoreError, match="closed"):
        opened.write([put("/a")])


def _hammer(url: str, writer: int, batches: int) -> int:
    store = open_url(url)
    rng = random.Random(writer)
    for i in range(batches):
        size = rng.randint(1, 20)
        store.write([put(f"/w{writer}/{i}/{j}", i) for j in range(size)])
        if i % 3 == 0:
            store.complete([Completion(key=f"/w{writer}/{i}/0", outcome="rendered", now=i)])
    written = int(store.statistics().rows_written)
    store.close()
    return written


def test_writer_processes_at_once_lose_no_write(store_url: str) -> None:
    open_url(store_url).close()  # the schema, before the writers race to open it
    with SPAWN.Pool(4) as pool:
        results = pool.starmap(_hammer, [(store_url, w, 150) for w in range(4)])
    store = open_url(store_url)
    expected_rows = 0
    for w in range(4):
        rng = random.Random(w)
        expected_rows += sum(rng.randint(1, 20) for _ in range(150))
    assert store.count() == expected_rows
    assert sum(results) == expected_rows + 4 * 50  # the rows and the completions
    rendered = [row for row in store.walk(None, expected_rows) if row.last_outcome == "rendered"]
    assert len(rendered) == 4 * 50
    store.close()


def _reschedule(url: str, keys: int, seconds: float) -> None:
    """Upserts only, so every row a read saw reaches the feed with that version or later."""
    store = open_url(url)
    rng = random.Random(3)
    deadline = time.monotonic() + seconds
    try:
        i = 0
        while time.monotonic() < deadline:
            chosen = [f"/k/{j:03d}" for j in rng.sample(range(keys), 5)]
            store.write([put(key, i) for key in chosen])
            i += 1
    finally:
        store.close()


def test_a_feed_that_delivered_a_reads_head_delivered_every_write_it_saw(
    store_url: str, any_store: ContractStore
) -> None:
    """get_many_at and walk_at read the rows and the head in one snapshot while another
    process writes: once a subscription has delivered that head, it has delivered every
    row the read returned, at that version or a later one."""
    store = any_store
    keys = 60
    names = [f"/k/{j:03d}" for j in range(keys)]
    store.write([put(name) for name in names])
    sub = store.subscribe("keeper")
    delivered = {row.key: row.version for row in store.walk(None, keys)}
    writer = SPAWN.Process(target=_reschedule, args=(store_url, keys, 2.0))
    writer.start()
    reads = moved = 0
    try:
        while writer.is_alive() or reads < 30:
            first = store.walk_at(None, 20)
            after = first.rows[-1].key if first.rows else None
            for read in (store.get_many_at(names[::3]), first, store.walk_at(after, 100)):
                deadline = time.monotonic() + 30
                while not sub.has_delivered(read.head):
                    assert time.monotonic() < deadline, "the feed never delivered a read's head"
                    batch = sub.poll(50)
                    moved += bool(batch.events)
                    for event in batch.events:
                        assert isinstance(event, RowEvent) and event.row is not None
                        delivered[event.key] = event.row.version
                    if not batch.events:
                        sub.wait(0.05)
                for row in read.rows:
                    assert delivered[row.key] >= row.version, (row, delivered[row.key])
                reads += 1
        writer.join(60)
        assert writer.exitcode == 0
    finally:
        writer.join(5)
        sub.close()
    assert moved > 10, "the writer never moved the feed between reads: nothing tested"


def test_counters_count_this_objects_writes_and_the_writes_it_gave_up(store_url: str) -> None:
    """`counters()` reads no table: what this object committed, and a write that waited
    out the lock another connection held, refused with StoreBusy and nothing written."""
    store = open_url(store_url, busy_timeout_s=0.3)
    try:
        start = store.counters()
        store.write([put("/a"), put("/b")])
        store.write([put("/c")])
        after = store.counters()
        assert after.transactions - start.transactions == 2
        assert after.rows_written - start.rows_written == 3
        assert after.busy_refused == start.busy_refused == 0
        assert after.writability.writable
        if is_postgres(store_url):
            import psycopg

            holder: Any = psycopg.connect(store_url)
            holder.execute("LOCK TABLE render_schedule IN EXCLUSIVE MODE")
        else:
            holder = sqlite3.connect(store_url.removeprefix("sqlite:///"), isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(StoreBusy):
                store.write([put("/d")])
        finally:
            holder.close()  # its transaction rolls back with it
        refused = store.counters()
        assert refused.busy_refused == 1
        assert refused.transactions == after.transactions and store.get("/d") is None
        if is_postgres(store_url):
            assert refused.sqlite is None and refused.postgres is not None
        else:
            assert refused.postgres is None and refused.sqlite is not None
            assert refused.sqlite.busy_retries > 0  # it tried again until the wait ran out
    finally:
        store.close()


def test_a_store_shared_by_nodes_keeps_their_member_list(
    any_store: ContractStore, store_url: str
) -> None:
    if not is_postgres(store_url):
        assert any_store.membership is None
        with pytest.raises(StoreError, match="keeps its member list"):
            cluster_membership(any_store)
        return
    membership = cluster_membership(any_store)
    assert membership is any_store.membership
    listed = membership.members(12.0, handovers=True)
    assert listed.records == [] and listed.db_now_ms > 0 and listed.with_handovers
    assert membership.nodes(12.0) == []
    # A node that never joined is no incarnation's row: nothing is acknowledged or raised.
    handover = Handover(node="nobody", incarnation=1, key_hashes=[], expires_at_ms=[])
    assert not membership.acknowledge("nobody", 1, [1], handover)
    assert not membership.raise_lease_ceiling("nobody", 12.0, 1, 60_000)
