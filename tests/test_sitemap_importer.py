"""sitemap.importer against the real SQLite store: what rows an import writes, how it
treats rows already there, what it skips and why, and that a refused document (unsafe,
oversized, malformed, a broken index) writes nothing at all."""

from __future__ import annotations

import gzip
import io
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from sitemap_helpers import (
    GIB,
    NonSeekable,
    gzip_bomb,
    http_server,
    index,
    many_urls,
    url_xml,
    urlset,
)

from shm.segment import now_ms
from sitemap.errors import SitemapError
from sitemap.fields import parse_w3c_datetime
from sitemap.importer import (
    DEFAULT_LIMITS,
    ImportLimits,
    ImportProgress,
    ImportReport,
    import_sitemap,
)
from sitemap.rules import RouteRules
from sitemap.source import SourceLimits, child_opener_for, open_location
from store import open_store
from store.base import ScheduleStore
from store.rows import Completion, RowWrite

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
RULES = RouteRules.from_toml(
    """
default_route = "page"
[[rules]]
route = "product"
path = "/p/*"
cadence_s = 86400
[[rules]]
route = "article"
path = "/blog/**"
"""
)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ScheduleStore]:
    opened = open_store(str(tmp_path / "schedule.sqlite"))
    try:
        yield opened
    finally:
        opened.close()


def run(
    store: ScheduleStore, data: bytes, now: int | None = None, **kwargs: object
) -> ImportReport:
    return import_sitemap(
        io.BytesIO(data),
        store,
        RULES,
        now_ms() if now is None else now,
        **kwargs,  # type: ignore[arg-type]
    )


def all_rows(store: ScheduleStore) -> dict[str, object]:
    return {row.key: row for row in store.walk(None, 1_000_000)}


def test_plain_urlset_rows(store: ScheduleStore) -> None:
    now = now_ms()
    data = urlset(
        url_xml("https://shop.example/p/boot", changefreq="hourly"),
        url_xml("https://shop.example/p/tent"),  # no changefreq: the rule's cadence
        url_xml("https://shop.example/blog/2024/x", changefreq="weekly"),
        url_xml("https://shop.example/about"),  # default route, no cadence at all
    )
    report = run(store, data, now)
    assert (report.imported, report.updated, report.skipped) == (4, 0, 0)
    rows = store.get_many(
        [
            "https://shop.example/p/boot",
            "https://shop.example/p/tent",
            "https://shop.example/blog/2024/x",
            "https://shop.example/about",
        ]
    )
    boot = rows["https://shop.example/p/boot"]
    assert (boot.route, boot.cadence_s, boot.sitemap, boot.next_render_at) == (
        "product",
        3600,
        True,
        now,
    )
    assert rows["https://shop.example/p/tent"].cadence_s == 86400
    assert rows["https://shop.example/blog/2024/x"].route == "article"
    assert rows["https://shop.example/blog/2024/x"].cadence_s == 604800
    about = rows["https://shop.example/about"]
    assert (about.route, about.cadence_s, about.sitemap) == ("page", None, True)


def test_lastmod_decides_the_first_due_time(store: ScheduleStore) -> None:
    now = now_ms()
    hour_ago = now - HOUR_MS
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(hour_ago / 1000))
    hour_ago_s = parse_w3c_datetime(stamp)
    assert hour_ago_s is not None
    data = urlset(
        url_xml("https://e.com/p/recent", stamp, "daily"),  # due lastmod + a day
        url_xml("https://e.com/p/old", "2001-01-01", "daily"),  # long overdue: now
        url_xml("https://e.com/p/future", "2999-01-01T00:00:00Z", "daily"),  # clock ahead
        url_xml("https://e.com/p/garbled", "last tuesday", "daily"),
        url_xml("https://e.com/p/freq", None, "fortnightly"),
    )
    report = run(store, data, now)
    assert report.imported == 5
    assert report.notes == {"bad_changefreq": 1, "bad_lastmod": 1, "future_lastmod": 1}
    rows = store.get_many(["https://e.com/p/recent", "https://e.com/p/old"])
    assert rows["https://e.com/p/recent"].next_render_at == hour_ago_s + DAY_MS
    assert rows["https://e.com/p/old"].next_render_at == now
    future = store.get("https://e.com/p/future")
    assert future is not None and future.next_render_at == now + DAY_MS
    garbled = store.get("https://e.com/p/garbled")
    assert garbled is not None and garbled.next_render_at == now
    freq = store.get("https://e.com/p/freq")
    assert freq is not None and freq.cadence_s == 86400  # the rule's, not a guess


def test_route_default_cadence_is_used_for_a_rows_first_due_time(store: ScheduleStore) -> None:
    store.set_route("page", default_cadence_s=7 * 86400)
    now = now_ms()
    lastmod = time.strftime("%Y-%m-%d", time.gmtime((now - DAY_MS) / 1000))
    run(store, urlset(url_xml("https://e.com/about", lastmod)), now)
    row = store.get("https://e.com/about")
    lastmod_ms = parse_w3c_datetime(lastmod)
    assert row is not None and lastmod_ms is not None
    assert row.cadence_s is None
    assert row.next_render_at == lastmod_ms + 7 * DAY_MS


def test_reimport_is_a_no_op_and_updates_are_counted(store: ScheduleStore) -> None:
    now = now_ms()
    data = urlset(*(url_xml(f"https://e.com/p/{i}", None, "daily") for i in range(10)))
    assert run(store, data, now).imported == 10
    versions = {row.key: row.version for row in store.walk(None, 100)}
    again = run(store, data, now + 1000)
    assert (again.imported, again.updated, again.skipped_by_reason) == (0, 0, {"unchanged": 10})
    assert {row.key: row.version for row in store.walk(None, 100)} == versions
    changed = urlset(
        *(url_xml(f"https://e.com/p/{i}", None, "hourly" if i < 3 else "daily") for i in range(10))
    )
    report = run(store, changed, now + 2000)
    assert (report.imported, report.updated) == (0, 3)
    assert store.get("https://e.com/p/0").cadence_s == 3600  # type: ignore[union-attr]


def test_existing_rows_keep_their_schedule_unless_the_page_changed(
    store: ScheduleStore,
) -> None:
    now = now_ms()
    keys = [f"https://e.com/p/{name}" for name in ("same", "changed", "discovered", "faster")]
    store.write(
        upsert=[
            RowWrite(key=key, route="product", next_render_at=now, cadence_s=86400) for key in keys
        ]
    )
    rendered_at = now - 10 * HOUR_MS
    store.complete([Completion(key=key, outcome="rendered", now=rendered_at) for key in keys])
    scheduled = rendered_at + DAY_MS
    assert all(row.next_render_at == scheduled for row in store.get_many(keys).values())
    before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((rendered_at - HOUR_MS) / 1000))
    after = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((rendered_at + HOUR_MS) / 1000))
    data = urlset(
        url_xml(keys[0], before, "daily"),  # unchanged since its render: keeps its time
        url_xml(keys[1], after, "daily"),  # changed since its render: due now
        url_xml(keys[2], before, "daily"),  # was discovered: becomes a sitemap row
        url_xml(keys[3], before, "hourly"),  # cadence shrank: render + 1 h, i.e. now
    )
    report = run(store, data, now)
    rows = store.get_many(keys)
    assert rows[keys[0]].next_render_at == scheduled
    assert rows[keys[1]].next_render_at == now
    assert rows[keys[2]].next_render_at == scheduled and rows[keys[2]].sitemap
    assert rows[keys[3]].next_render_at == now and rows[keys[3]].cadence_s == 3600
    # every row changed its sitemap flag (they were written as discovered)
    assert (report.imported, report.updated) == (0, 4)


def test_a_retired_row_stays_retired_unless_its_page_changed_since(store: ScheduleStore) -> None:
    now = now_ms()
    keys = [f"https://e.com/p/{name}" for name in ("dead", "back", "silent")]
    store.write(upsert=[RowWrite(key=key, route="product", next_render_at=now) for key in keys])
    retired_at = now - 10 * HOUR_MS
    for _ in range(3):
        store.complete([Completion(key=key, outcome="not_found", now=retired_at) for key in keys])
    assert all(row.retired_at == retired_at for row in store.get_many(keys).values())
    before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((retired_at - HOUR_MS) / 1000))
    after = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((retired_at + HOUR_MS) / 1000))
    report = run(
        store,
        urlset(url_xml(keys[0], before, "daily"), url_xml(keys[1], after), url_xml(keys[2])),
        now,
    )
    rows = store.get_many(keys)
    assert rows[keys[0]].retired_at == retired_at and rows[keys[2]].retired_at == retired_at
    assert rows[keys[1]].retired_at is None and rows[keys[1]].not_found_streak == 0
    assert report.skipped_by_reason == {"retired": 2} and report.updated == 1


def test_bad_urls_are_counted_and_the_rest_imported(store: ScheduleStore) -> None:
    data = urlset(
        url_xml("https://e.com/p/good"),
        url_xml("/relative"),
        url_xml("ftp://e.com/file"),
        url_xml(""),
        url_xml("https://e.com/" + "x" * 2100),
        url_xml("https://e.com/p/good"),
        url_xml("https://e.com/with space"),
    )
    report = run(store, data)
    assert report.imported == 1
    assert report.skipped_by_reason == {
        "bad_url": 3,
        "duplicate": 1,
        "missing_loc": 1,
        "too_long": 1,
    }
    assert report.urls_seen == 7
    assert {example.reason for example in report.examples} >= {"bad_url", "too_long"}
    assert store.count() == 1


def test_unrouted_urls_are_skipped_without_a_default_route(store: ScheduleStore) -> None:
    rules = RouteRules.from_toml('[[rules]]\nroute = "product"\npath = "/p/*"\n')
    data = urlset(url_xml("https://e.com/p/1"), url_xml("https://e.com/other"))
    report = import_sitemap(io.BytesIO(data), store, rules, now_ms())
    assert report.imported == 1
    assert report.skipped_by_reason == {"no_route": 1}


def test_the_example_site_index_of_gzipped_children(store: ScheduleStore) -> None:
    location = str(EXAMPLES / "site" / "sitemap.xml")
    limits = SourceLimits()
    report = import_sitemap(
        open_location(location, limits=limits),
        store,
        RouteRules.load(EXAMPLES / "route-rules.toml"),
        now_ms(),
        location=location,
        open_child=child_opener_for(location, limits=limits),
    )
    assert report.sitemaps_read == 6  # the index and five children, four of them gzipped
    assert report.imported == store.count() == 4007
    assert report.skipped_by_reason == {"bad_url": 2}
    routes: dict[str, int] = {}
    for row in store.walk(None, 10_000):
        assert row.sitemap
        routes[row.route] = routes.get(row.route, 0) + 1
    assert routes == {"product": 3000, "article": 800, "category": 200, "page": 6, "home": 1}


def test_writes_go_in_batches_and_progress_is_reported(store: ScheduleStore) -> None:
    calls: list[int] = []

    class Counting:
        def __init__(self, inner: ScheduleStore) -> None:
            self.inner = inner

        def write(self, upsert: Sequence[RowWrite] = (), delete: Sequence[str] = ()) -> None:
            calls.append(len(upsert))
            self.inner.write(upsert=upsert, delete=delete)

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

    seen: list[ImportProgress] = []
    report = run(Counting(store), many_urls(2500), progress=seen.append)  # type: ignore[arg-type]
    assert report.imported == 2500
    assert calls == [1000, 1000, 500]
    assert {p.phase for p in seen} == {"reading", "writing"}
    assert seen[-1].written == 2500


# -- refused documents write nothing --------------------------------------------------


def _good_then(tail: bytes) -> bytes:
    """1,500 good URLs (more than a write batch) and then the bad part."""
    head = many_urls(1500)
    return head[: -len(b"</urlset>")] + tail


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (
            b'<?xml version="1.0"?><!DOCTYPE urlset [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>'
            b'<urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
            b"<url><loc>https://e.com/&xxe;</loc></url></urlset>",
            "unsafe_xml",
        ),
        (
            b'<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
            b'<!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">'
            b'<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>'
            b"<urlset><url><loc>https://e.com/&lol3;</loc></url></urlset>",
            "unsafe_xml",
        ),
        (_good_then(b"<url><loc>https://e.com/truncated"), "malformed"),
        (_good_then(b"<url><loc>https://e.com/x</lo></url></urlset>"), "malformed"),
        (b"<html><body>Not found</body></html>", "not_a_sitemap"),
    ],
    ids=["external-entity", "billion-laughs", "truncated", "mismatched", "html"],
)
def test_refused_documents_write_nothing(store: ScheduleStore, data: bytes, reason: str) -> None:
    with pytest.raises(SitemapError) as caught:
        run(store, data)
    assert caught.value.reason == reason
    assert store.count() == 0


@pytest.fixture(scope="module")
def declared_gigabyte() -> bytes:
    """1,500 good URLs and then a gigabyte of spaces, gzipped to ~5 MB (a real gzip bomb)."""
    return gzip_bomb(many_urls(1500)[: -len(b"</urlset>")], size=GIB)


def test_a_gigabyte_gzip_bomb_is_refused_by_its_declared_size(
    store: ScheduleStore, declared_gigabyte: bytes
) -> None:
    with pytest.raises(SitemapError, match="declares 1,073,") as caught:
        run(store, declared_gigabyte)
    assert caught.value.reason == "too_large"
    assert store.count() == 0


def test_a_gigabyte_gzip_bomb_from_a_pipe_stops_at_the_cap(
    store: ScheduleStore, declared_gigabyte: bytes
) -> None:
    stream = NonSeekable(declared_gigabyte)  # no trailer to read ahead: the stream cap acts
    with pytest.raises(SitemapError, match="more than 52,428,800 decompressed") as caught:
        import_sitemap(stream, store, RULES, now_ms())  # type: ignore[arg-type]
    assert caught.value.reason == "too_large"
    assert store.count() == 0
    assert stream.closed


def test_a_gigabyte_declared_over_http_is_refused_before_reading(
    store: ScheduleStore, tmp_path: Path
) -> None:
    with http_server() as server:
        good = server.add("/good.xml", many_urls(1500))
        huge = server.add("/huge.xml.gz", b"\x1f\x8b", headers={"Content-Length": str(GIB)})
        (tmp_path / "index-source").write_text(server.url)
        location = server.url + "/index.xml"
        server.add("/index.xml", index(good, huge))
        limits = SourceLimits()
        with pytest.raises(SitemapError, match="Content-Length declares") as caught:
            import_sitemap(
                open_location(location, limits=limits),
                store,
                RULES,
                now_ms(),
                location=location,
                open_child=child_opener_for(location, limits=limits),
            )
    assert caught.value.reason == "too_large"
    assert store.count() == 0  # the good child was read first, and still nothing written


def test_an_index_with_a_missing_child_writes_nothing(store: ScheduleStore, tmp_path: Path) -> None:
    (tmp_path / "a.xml.gz").write_bytes(gzip.compress(many_urls(1200)))
    (tmp_path / "sitemap.xml").write_bytes(
        index("https://e.com/a.xml.gz", "https://e.com/missing.xml.gz")
    )
    location = str(tmp_path / "sitemap.xml")
    with pytest.raises(SitemapError, match=r"missing\.xml\.gz") as caught:
        import_sitemap(
            open_location(location, limits=SourceLimits()),
            store,
            RULES,
            now_ms(),
            location=location,
            open_child=child_opener_for(location, limits=SourceLimits()),
        )
    assert caught.value.reason == "fetch_failed"
    assert store.count() == 0


def test_index_limits(store: ScheduleStore, tmp_path: Path) -> None:
    (tmp_path / "a.xml").write_bytes(many_urls(3))
    (tmp_path / "b.xml").write_bytes(many_urls(3, start=3))
    (tmp_path / "inner.xml").write_bytes(index("https://e.com/a.xml"))
    (tmp_path / "outer.xml").write_bytes(index("https://e.com/inner.xml"))
    (tmp_path / "two.xml").write_bytes(index("https://e.com/a.xml", "https://e.com/b.xml"))

    def attempt(name: str, limits: ImportLimits = DEFAULT_LIMITS) -> ImportReport:
        location = str(tmp_path / name)
        return import_sitemap(
            open_location(location, limits=limits.source),
            store,
            RULES,
            now_ms(),
            location=location,
            open_child=child_opener_for(location, limits=limits.source),
            limits=limits,
        )

    with pytest.raises(SitemapError, match="nested more than 1 deep"):
        attempt("outer.xml", ImportLimits(max_depth=1))
    with pytest.raises(SitemapError, match="more than 1 child"):
        attempt("two.xml", ImportLimits(max_children=1))
    assert store.count() == 0
    assert attempt("outer.xml").imported == 3  # an index of indexes is within the default
    assert attempt("two.xml").imported == 3  # a.xml's rows are now unchanged
    with pytest.raises(SitemapError, match="no way to read its children"):
        run(store, index("https://e.com/a.xml"))
