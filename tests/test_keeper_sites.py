"""keeper/sites.py and the queue's site column: every held row's site id names its key's
site (hash and name, under its route's site pattern) whatever events, walks and pattern
changes did, each site counts exactly its held rows, and a site goes with its last row."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from keeper_helpers import NOW, MemoryStore
from test_keeper_core import load

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.counts import count_sites
from keeper.ownership import Rendezvous, placements
from keeper.queue import HeldQueue
from keeper.sites import NO_SITE_ID, HeldSites
from shm import key_hashes
from shm.keys import NO_SITE, key_site_hash, key_site_hashes, site_hash, site_of
from store.rows import Route, Row, RowEvent, RowWrite

HOSTS = [
    "https://www.shop.example/",
    "https://shop.example/",  # the same site as www.shop.example
    "http://Blog.Example:8080/",
    "https://news.example/",
    "/",  # no host: no site
]


def key_of(n: int) -> str:
    return f"{HOSTS[n % len(HOSTS)]}p/{n}"


def pattern_of(core: KeeperCore, slot: int) -> bytes:
    """The site pattern of the row's route, as the core's routes say."""
    route = core.routes.get(core.classes.get(core.queue.class_of(slot)).route)
    return b"" if route is None or route.site_pattern is None else route.site_pattern.encode()


def check_sites(queue: HeldQueue, core: KeeperCore | None = None) -> None:
    """The site column and the site table agree with the held keys (under their routes'
    site patterns, where `core` says them), exactly."""
    sites = queue.sites
    live = queue.slots.live_slots().tolist()
    want: Counter[int] = Counter()
    hashes = sites.hashes()
    for slot in live:
        key = queue.slots.key(slot)
        pattern = b"" if core is None else pattern_of(core, slot)
        site = queue.site_of(slot)
        assert int(hashes[site]) == key_site_hash(key, pattern) == site_hash(site_of(key, pattern))
        assert (site == NO_SITE_ID) == (site_of(key, pattern) == b"")
        want[site] += 1
    held = {s: sites.held_rows(s) for s in sites.table.live_slots().tolist()}
    assert held.pop(NO_SITE_ID) == want.pop(NO_SITE_ID, 0)  # always there, maybe empty
    assert held == dict(want)
    assert len(sites) == len(want)
    if live:
        site_hashes = queue.site_hashes_of(np.array(live, dtype=np.int32))
        assert site_hashes.tolist() == [int(hashes[queue.site_of(s)]) for s in live]
    del hashes


def site_names(queue: HeldQueue) -> set[str]:
    return {site_of(queue.slots.key(s)).decode() for s in queue.slots.live_slots().tolist()} - {""}


def test_a_site_is_interned_once_and_goes_with_its_last_row() -> None:
    sites = HeldSites()
    a_hash = key_site_hash(b"https://www.a.example/1")
    assert len(sites) == 0
    a = sites.intern(a_hash)
    assert sites.intern(key_site_hash(b"https://A.example/2")) == a
    assert sites.held_rows(a) == 2 and len(sites) == 1
    assert sites.intern(NO_SITE) == NO_SITE_ID and len(sites) == 1
    sites.release(a)
    assert sites.held_rows(a) == 1 and len(sites) == 1
    sites.release(a)
    assert len(sites) == 0 and sites.table.find(a_hash) < 0
    sites.release(NO_SITE_ID)
    assert sites.table.find(NO_SITE) == NO_SITE_ID  # "no site" stays, with no rows
    b = sites.intern(key_site_hash(b"https://b.example/"))
    assert b == a  # the freed id is reused
    keys = [b"https://c.example/1", b"/x", b"https://b.example/2", b"https://c.example/3"]
    ids = sites.intern_many(np.array([key_site_hash(k) for k in keys], np.uint64))
    assert ids[1] == NO_SITE_ID and ids[2] == b and ids[0] == ids[3] != b
    assert sites.hashes()[int(ids[0])] == site_hash(b"c.example")
    assert sites.held_rows(int(ids[0])) == 2 and sites.held_rows(NO_SITE_ID) == 1
    assert sites.held_rows(b) == 2 and sites.statistics().sites == 2


def _event(key: str, due: int, version: int) -> RowEvent:
    row = Row(
        key=key, route="product", cadence_s=None, sitemap=False, next_render_at=due, version=version
    )
    return RowEvent(key=key, row=row)


def test_sites_follow_events_walks_and_removals() -> None:
    store = MemoryStore()
    for n in range(40):
        store.put(key_of(n), NOW - n * 1000)
    core = KeeperCore(KeeperConfig())
    load(core, store)
    check_sites(core.queue)
    assert len(core.queue.sites) == 3  # shop.example, blog.example, news.example
    # Events: new rows (one of a new site), moves, deletions of every row of a site.
    events = [_event(key_of(n), NOW + n, 100 + n) for n in range(0, 40, 3)]
    events.append(_event("https://fresh.example/a", NOW, 1))
    events += [RowEvent(key=key_of(n), row=None) for n in range(3, 40, 5)]  # news.example
    core.apply_events(events, NOW)
    check_sites(core.queue)
    names = site_names(core.queue)
    assert "news.example" not in names and "fresh.example" in names
    assert len(core.queue.sites) == len(names)
    # Rows moved to another class (a route's new cadence) keep their sites.
    before = {
        core.queue.slots.key(s): core.queue.site_of(s)
        for s in core.queue.slots.live_slots().tolist()
    }
    assert core.apply_route(Route(route="product", default_cadence_s=60)).rows > 0
    after = {
        core.queue.slots.key(s): core.queue.site_of(s)
        for s in core.queue.slots.live_slots().tolist()
    }
    assert after == before
    check_sites(core.queue)
    # A verification walk after writes the feed never saw (removed and added rows).
    store.rows.pop(key_of(1))
    store.rows.pop("https://fresh.example/a", None)
    walk = core.begin_walk("verify", NOW)
    store.put("https://late.example/x", NOW)
    while True:
        rows = store.walk(walk.after, 6)
        core.apply_walked(walk, rows, NOW)
        if len(rows) < 6:
            break
    core.finish_walk(walk, NOW)
    check_sites(core.queue)


write = st.tuples(st.sampled_from(["put", "put", "delete", "walk"]), st.integers(0, 30))


@settings(max_examples=60, deadline=None)
@given(st.lists(write, max_size=80))
def test_random_writes_keep_every_site_exact(writes: list[tuple[str, int]]) -> None:
    store = MemoryStore()
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    for i, (what, n) in enumerate(writes):
        key = key_of(n)
        if what == "put":
            store.write([RowWrite(key=key, route="product", next_render_at=NOW - i)])
        elif what == "delete":
            store.write(delete=[key])
        else:
            core.apply_events(sub.poll(10_000).events, NOW)
            walk = core.begin_walk("verify", NOW)
            while True:
                rows = store.walk(walk.after, 4)
                core.apply_walked(walk, rows, NOW)
                if len(rows) < 4:
                    break
            core.finish_walk(walk, NOW)
        if i % 3 == 2:
            core.apply_events(sub.poll(10_000).events, NOW)
        check_sites(core.queue)
    core.apply_events(sub.poll(10_000).events, NOW)
    check_sites(core.queue)
    assert len(core.queue) == len(store.rows)


def brute_site_counts(core: KeeperCore, now: int) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Row by row: per site name, (due, held, earliest due); and due rows with no site.
    Due as count_queue counts it: due, route not paused."""
    queue = core.queue
    paused = core.classes.paused_mask()
    per: dict[str, list[int]] = {}
    no_site = 0
    for slot in queue.slots.live_slots().tolist():
        row = queue.held_slot(slot)
        site = site_of(queue.slots.key(slot), pattern_of(core, slot)).decode()
        due = row.due_at <= now and not paused[row.class_id]
        if not site:
            no_site += due
            continue
        entry = per.setdefault(site, [0, 0, 1 << 62])
        entry[1] += 1
        if due:
            entry[0] += 1
            entry[2] = min(entry[2], row.due_at)
    return {k: (d, h, e) for k, (d, h, e) in per.items() if d}, no_site


def check_site_counts(core: KeeperCore, now: int, top: int) -> None:
    want, no_site = brute_site_counts(core, now)
    counts = count_sites(core.queue, now, top)
    assert counts.at == now and counts.with_due == len(want) and counts.no_site_due == no_site
    assert counts.held == len(core.queue.sites)
    assert len(counts.top) == min(top, len(want))
    for row in counts.top:
        assert (row.due, row.held, row.oldest_due_at) == want[row.site]
        assert row.site_hash == site_hash(row.site.encode())
    ranked = sorted(want.items(), key=lambda kv: (-kv[1][0], kv[1][2]))
    assert [(r.due, r.oldest_due_at) for r in counts.top] == [
        (d, e) for _, (d, _, e) in ranked[:top]
    ]


counted_write = st.tuples(
    st.sampled_from(["put", "put", "delete", "walk", "pause", "pattern"]),
    st.integers(0, 40),
    st.integers(-3_600_000, 3_600_000),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(counted_write, max_size=60), st.integers(0, 6), st.integers(-3_600_000, 3_600_000))
def test_due_rows_per_site_are_exact_after_events_and_walks(
    writes: list[tuple[str, int, int]], top: int, at: int
) -> None:
    store = MemoryStore()
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    routes = ["product", "category"]
    for what, n, offset in writes:
        key = key_of(n)
        if what == "put":
            store.write([RowWrite(key=key, route=routes[n % 2], next_render_at=NOW + offset)])
        elif what == "delete":
            store.write(delete=[key])
        elif what == "pause":
            store.set_route(routes[n % 2], paused=offset > 0)
        elif what == "pattern":
            pattern = PATTERNS[n % len(PATTERNS)]
            store.set_route(routes[n % 2], site_pattern=pattern, clear_site_pattern=not pattern)
        else:
            core.apply_events(sub.poll(10_000).events, NOW)
            walk = core.begin_walk("verify", NOW)
            while True:
                rows = store.walk(walk.after, 4)
                core.apply_walked(walk, rows, NOW)
                if len(rows) < 4:
                    break
            core.finish_walk(walk, NOW)
        if n % 3 == 0:
            core.apply_events(sub.poll(10_000).events, NOW)
            check_site_counts(core, NOW + at, top)
    core.apply_events(sub.poll(10_000).events, NOW)
    check_site_counts(core, NOW + at, top)
    check_site_counts(core, NOW + at, 1000)
    check_sites(core.queue, core)


# A fixed site, and a wildcard that takes in every host of HOSTS (shop, blog, news).
PATTERNS = [None, "shop.example", "*.example"]


def test_a_routes_site_pattern_names_its_rows_sites_and_re_sites_them() -> None:
    keys = {
        "https://a.cust.example/1": "shop",
        "https://B.Cust.Example:8443/2": "shop",
        "https://www.cust.example/3": "shop",
        "https://other.example/4": "shop",
        "/no-host": "shop",
        "https://a.cust.example/5": "blog",
    }
    store = MemoryStore()
    for n, (key, route) in enumerate(keys.items()):
        store.put(key, NOW - n, route=route)
    core = KeeperCore(KeeperConfig())
    load(core, store)
    sub = store.subscribe("keeper", store.feed_head())

    def held_by_site() -> dict[str, int]:
        return {c.site: c.held for c in count_sites(core.queue, NOW, 100).top}

    assert held_by_site() == {
        "a.cust.example": 2,
        "b.cust.example": 1,
        "cust.example": 1,
        "other.example": 1,
    }
    # A wildcard: the route's rows under cust.example take it as their site; the blog
    # route's row keeps its host.
    store.set_route("shop", site_pattern="*.cust.example")
    core.apply_events(sub.poll().events, NOW)
    check_sites(core.queue, core)
    assert core.counters.rows_resited == 5
    assert held_by_site() == {"cust.example": 3, "a.cust.example": 1, "other.example": 1}
    # A new row of the route, and a row moving into it and out again.
    store.put("https://c.cust.example/6", NOW, route="shop")
    store.put("https://a.cust.example/5", NOW, route="shop")
    core.apply_events(sub.poll().events, NOW)
    check_sites(core.queue, core)
    assert held_by_site() == {"cust.example": 5, "other.example": 1}
    store.put("https://a.cust.example/5", NOW - 5, route="blog")
    core.apply_events(sub.poll().events, NOW)
    assert held_by_site() == {"cust.example": 4, "a.cust.example": 1, "other.example": 1}
    # A fixed name: every row of the route, hosts or none.
    store.set_route("shop", site_pattern="customer-a")
    core.apply_events(sub.poll().events, NOW)
    check_sites(core.queue, core)
    assert held_by_site() == {"customer-a": 6, "a.cust.example": 1}
    assert count_sites(core.queue, NOW, 100).no_site_due == 0
    # A load under the pattern (the walk's batch path) holds what the re-site held.
    loaded = KeeperCore(KeeperConfig())
    load(loaded, store)  # the routes first, then the walk
    check_sites(loaded.queue, loaded)
    assert {c.site: c.held for c in count_sites(loaded.queue, NOW, 100).top} == held_by_site()
    # Cleared: each key's own host again, and the pattern's sites are gone.
    store.set_route("shop", clear_site_pattern=True)
    core.apply_events(sub.poll().events, NOW)
    check_sites(core.queue, core)
    assert "customer-a" not in held_by_site() and len(core.queue.sites) == 5


def test_owned_by_site_a_key_is_placed_by_its_host_whatever_its_routes_pattern() -> None:
    """A cluster that owns keys by site places each key by its host's site, so a route's
    pattern (set at the load, or changed later) moves no key between nodes: the keeper
    holds, and places, exactly the keys whose hosts this node owns."""
    keys = [f"https://h{n}.cust.example/p/{i}".encode() for n in range(12) for i in range(3)]
    store = MemoryStore()
    store.set_route("shop", site_pattern="*.cust.example")
    for n, key in enumerate(keys):
        store.put(key.decode(), NOW - n, route="shop")
    hosts = key_site_hashes(keys)
    mine = Rendezvous("a", ["a", "b", "c"], by_site=True)
    owned = mine.owns_many(placements(key_hashes(keys), hosts, True))
    assert 0 < owned.sum() < len(keys)  # the pattern's site is split by host
    core = KeeperCore(KeeperConfig(), ownership=mine)
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    held = sorted(core.queue.slots.key(s) for s in core.queue.slots.live_slots().tolist())
    assert held == sorted(k for k, own in zip(keys, owned.tolist(), strict=True) if own)
    check_sites(core.queue, core)
    assert {c.site for c in count_sites(core.queue, NOW, 10).top} == {"cust.example"}
    hashed = key_hashes(held)
    assert core.placements_of(hashed).tolist() == key_site_hashes(held).tolist()
    # Events place by host too, and a pattern cleared moves nothing.
    store.set_route("shop", clear_site_pattern=True)
    for key in keys:
        store.put(key.decode(), NOW + 1, route="shop")
    core.apply_events(sub.poll(10_000).events, NOW)
    again = sorted(core.queue.slots.key(s) for s in core.queue.slots.live_slots().tolist())
    assert again == held
    check_sites(core.queue, core)
