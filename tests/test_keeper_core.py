"""The keeper's decisions without processes: events, walks, repairs, reclassification."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import numpy.typing as npt
from hypothesis import given, settings
from hypothesis import strategies as st
from keeper_helpers import NOW, MemoryStore, MemorySubscription

from keeper.classes import RenderClass, classify
from keeper.config import KeeperConfig
from keeper.core import MAX_DUE_MS, KeeperCore
from shm import key_hash
from store.rows import Row, RowEvent, RowWrite


def held_state(core: KeeperCore) -> dict[str, tuple[RenderClass, int, int]]:
    out = {}
    for slot in core.queue.slots.live_slots().tolist():
        row = core.queue.held_slot(slot)
        out[row.key] = (core.classes.get(row.class_id), row.due_at, row.version)
    return out


def table_state(store: MemoryStore) -> dict[str, tuple[RenderClass, int, int]]:
    routes = {r.route: r for r in store.routes()}
    return {
        k: (classify(r, routes, store.default_cadence), r.next_render_at, r.version)
        for k, r in store.rows.items()
        if r.retired_at is None
    }


def retired_by_route(store: MemoryStore) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in store.rows.values():
        if row.retired_at is not None:
            counts[row.route] = counts.get(row.route, 0) + 1
    return dict(sorted(counts.items()))


def assert_equal_to_table(core: KeeperCore, store: MemoryStore) -> None:
    assert held_state(core) == table_state(store)
    assert core.retired.by_route() == retired_by_route(store)


def load(core: KeeperCore, store: MemoryStore, chunk: int = 7) -> None:
    core.load_settings(store.routes(), store.default_cadence)
    walk = core.begin_walk("load", NOW)
    while True:
        rows = store.walk(walk.after, chunk)
        core.apply_walked(walk, rows, NOW)
        if len(rows) < chunk:
            break
    core.finish_walk(walk, NOW)


write = st.tuples(
    st.sampled_from(["put", "put", "put", "delete", "route", "default", "retire"]),
    st.integers(0, 40),
    st.integers(-86_400_000, 86_400_000),
    st.sampled_from([None, 60, 3600]),
    st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(
    writes=st.lists(write, max_size=120),
    cuts=st.lists(st.integers(1, 15), min_size=1, max_size=20),
    replays=st.lists(st.integers(0, 200), max_size=5),
)
def test_random_event_streams_with_replays_end_equal_to_the_table(
    writes: list[tuple[str, int, int, int | None, bool]], cuts: list[int], replays: list[int]
) -> None:
    store = MemoryStore()
    store.put("/seed", NOW)
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    routes = ["product", "category", "blog"]
    for i, (what, n, offset, cadence, sitemap) in enumerate(writes):
        route = routes[n % 3]
        if what == "put":
            store.write(
                [
                    RowWrite(
                        key=f"/k{n}",
                        route=route,
                        next_render_at=NOW + offset,
                        cadence_s=cadence,
                        sitemap=sitemap,
                    )
                ]
            )
        elif what == "delete":
            store.write(delete=[f"/k{n}"])
        elif what == "retire":
            if f"/k{n}" in store.rows:
                store.retire(f"/k{n}", NOW + offset)
        elif what == "route":
            store.set_route(route, default_cadence_s=cadence or 7200, paused=sitemap)
        else:
            store.set_default_cadence_s(3600 + n)
        # Deliver in uneven batches; now and then go back and deliver again.
        if i % 5 == 4:
            batch = sub.poll(cuts[i % len(cuts)])
            core.apply_events(batch.events, NOW)
        if replays and i == replays[0] % max(1, len(writes)):
            sub.position = max(0, sub.position - 1 - replays[0] % 9)
    while True:
        batch = sub.poll(cuts[0])
        core.apply_events(batch.events, NOW)
        if not batch.events:
            break
    assert_equal_to_table(core, store)
    # A full replay of the whole log, twice over, changes nothing.
    sub.position = 0
    core.apply_events(sub.poll(10_000).events, NOW)
    core.apply_events([store.current(e) for e in store.log], NOW)
    assert_equal_to_table(core, store)


def test_an_event_during_the_walk_is_not_overwritten_by_the_walked_row() -> None:
    store = MemoryStore()
    for i in range(20):
        store.put(f"/k{i:02}", NOW - i)
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    walk = core.begin_walk("load", NOW)
    first = store.walk(None, 10)  # read /k00../k09 as they are now
    store.put("/k03", NOW + 99_000)  # ...then /k03 changes and its event arrives first
    store.write(delete=["/k05"])
    core.apply_events(sub.poll().events, NOW)
    core.apply_walked(walk, first, NOW)
    rest = store.walk(walk.after, 10)
    store.put("/k15", NOW + 5)  # a row the walk has not reached yet changes too
    core.apply_events(sub.poll().events, NOW)
    core.apply_walked(walk, rest, NOW)
    core.apply_walked(walk, store.walk(walk.after, 10), NOW)
    core.finish_walk(walk, NOW)
    assert_equal_to_table(core, store)
    held = core.queue.held(key_hash(b"/k03"))
    assert held is not None and held.due_at == NOW + 99_000
    assert core.queue.held(key_hash(b"/k05")) is None
    assert walk.repairs.skipped_touched == 3
    assert walk.loaded == 17
    assert walk.repairs.missed == 0


def test_the_load_publishes_from_the_first_chunk() -> None:
    store = MemoryStore()
    for i in range(50):
        store.put(f"/k{i:02}", NOW - 1000 * i)
    core = KeeperCore(KeeperConfig())
    walk = core.begin_walk("load", NOW)
    core.apply_walked(walk, store.walk(None, 10), NOW)
    chosen = core.queue.slots.keys(core.select(100, NOW).slots)
    assert chosen == [f"/k{i:02}".encode() for i in range(9, -1, -1)]


def test_unreadable_rows_are_logged_counted_and_skipped() -> None:
    store = MemoryStore()
    for i in range(10):
        store.put(f"/k{i}", NOW)
    bad = [
        Row(key="/bad1", route="product", cadence_s=0, sitemap=False, next_render_at=NOW),
        Row(key="/bad2", route="product", cadence_s=None, sitemap=False, next_render_at=-5),
        Row(key="", route="product", cadence_s=None, sitemap=False, next_render_at=NOW),
        Row(key="/bad3", route="product", cadence_s=None, sitemap=False, next_render_at="x"),  # type: ignore[arg-type]
        Row(key="/bad4", route="", cadence_s=None, sitemap=False, next_render_at=NOW),
    ]
    core = KeeperCore(KeeperConfig())
    walk = core.begin_walk("load", NOW)
    rows = store.walk(None, 100)
    core.apply_walked(walk, rows[:5] + bad + rows[5:], NOW)
    core.finish_walk(walk, NOW)
    assert walk.unreadable == len(bad) == core.counters.unreadable
    assert_equal_to_table(core, store)


def test_the_verification_walk_repairs_injected_corruption_and_counts_it() -> None:
    store = MemoryStore()
    for i in range(30):
        store.put(f"/k{i:02}", NOW - i * 1000)
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    # Writes the feed never delivered: a change, an insert, a delete.
    store.silent(
        Row(key="/k01", route="product", cadence_s=None, sitemap=False, next_render_at=NOW + 5)
    )
    store.silent(Row(key="/new", route="blog", cadence_s=60, sitemap=True, next_render_at=NOW))
    store.silent(None, key="/k02")
    # And corruption of the keeper's own copy: a due time flipped in memory.
    slot = core.queue.slot_of(key_hash(b"/k03"))
    core.queue.upsert(
        b"/k03", key_hash(b"/k03"), core.queue.class_of(slot), 1, core.queue.version_of(slot), NOW
    )
    walk = core.begin_walk("verify", NOW)
    while not walk.done:
        rows = store.walk(walk.after, 8)
        core.apply_walked(walk, rows, NOW)
        core.apply_events(sub.poll().events, NOW)
        if len(rows) < 8:
            core.finish_walk(walk, NOW)
    assert_equal_to_table(core, store)
    r = walk.repairs
    assert (r.missed_added, r.missed_changed, r.missed_removed, r.gained) == (1, 2, 1, 0)
    assert core.repairs.missed == 4


def test_retired_rows_leave_the_queue_and_are_counted_by_route_through_events_and_walks() -> None:
    store = MemoryStore()
    for i in range(12):
        store.put(f"/k{i:02}", NOW - i * 1000, route="blog" if i % 2 else "product")
    store.retire("/k00", NOW)
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store, chunk=5)
    assert core.retired.by_route() == {"product": 1} and len(core.queue) == 11
    # Through the feed: retired, revived by an upsert, deleted while retired.
    for key in ("/k01", "/k02", "/k03"):
        store.retire(key, NOW)
    store.put("/k02", NOW, route="product")
    store.write(delete=["/k03"])
    core.apply_events(sub.poll().events, NOW)
    assert_equal_to_table(core, store)
    assert core.retired.by_route() == {"blog": 1, "product": 1} and len(core.queue) == 9
    # Writes the feed missed, put right by a verification walk: a retirement, a revival,
    # and a retired row deleted.
    retired = store.rows["/k04"]
    store.silent(msgspec.structs.replace(retired, retired_at=NOW, retired_reason="not_found"))
    store.silent(msgspec.structs.replace(store.rows["/k00"], retired_at=None))
    store.silent(None, key="/k01")
    walk = core.begin_walk("verify", NOW)
    while not walk.done:
        rows = store.walk(walk.after, 4)
        core.apply_walked(walk, rows, NOW)
        if len(rows) < 4:
            core.finish_walk(walk, NOW)
    assert_equal_to_table(core, store)
    assert core.retired.by_route() == {"product": 1}
    r = walk.repairs
    assert (r.missed_added, r.missed_changed, r.missed_removed) == (1, 1, 1)


def test_a_repair_never_overwrites_a_newer_event() -> None:
    store = MemoryStore()
    for i in range(10):
        store.put(f"/k{i}", NOW)
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    walk = core.begin_walk("verify", NOW)
    stale_read = store.walk(None, 100)  # the table as read before the writes below
    store.put("/k4", NOW + 4_000)  # a newer event, applied before the stale rows
    store.write(delete=["/k6"])
    core.apply_events(sub.poll().events, NOW)
    core.apply_walked(walk, stale_read, NOW)
    core.finish_walk(walk, NOW)
    assert_equal_to_table(core, store)
    assert walk.repairs.missed == 0 and walk.repairs.skipped_touched == 2
    # Without a window (a point read taken long ago), versions still decide.
    old = stale_read[3]
    store.put(old.key, NOW + 9_000)
    core.apply_events(sub.poll().events, NOW)
    token = core.open_window()
    tally = core.reconcile([old.key], {old.key: old}, token, NOW)
    core.close_window(token)
    assert tally.held_newer == 1 and tally.missed == 0
    assert_equal_to_table(core, store)


def test_the_top_check_repairs_only_keys_no_event_touched_since_the_read() -> None:
    store = MemoryStore()
    for i in range(5):
        store.put(f"/k{i}", NOW - i)
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    store.silent(
        Row(key="/k1", route="product", cadence_s=None, sitemap=False, next_render_at=NOW + 1)
    )
    store.silent(None, key="/k2")
    token = core.open_window()
    read = store.get_many(["/k0", "/k1", "/k2", "/k3"])
    store.put("/k3", NOW + 3)
    core.apply_events(sub.poll().events, NOW)
    tally = core.reconcile(["/k0", "/k1", "/k2", "/k3"], read, token, NOW)
    core.close_window(token)
    assert (tally.missed_changed, tally.missed_removed, tally.skipped_touched) == (1, 1, 1)
    assert_equal_to_table(core, store)


class Halves:
    """Ownership by the hash's low bit; `generation` changes when the half flips."""

    def __init__(self) -> None:
        self.bit = 0
        self.generation = 0
        self.owns_all = False
        self.by_site = False

    def owns(self, key_hash: int) -> bool:
        return key_hash & 1 == self.bit

    def owns_many(self, key_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        mine: npt.NDArray[np.bool_] = (key_hashes & np.uint64(1)) == np.uint64(self.bit)
        return mine


def loaded_halves() -> tuple[MemoryStore, Halves, KeeperCore, MemorySubscription]:
    """200 rows, a keeper owning the half whose hashes end in 0, loaded, and its feed."""
    store = MemoryStore()
    for i in range(200):
        store.put(f"/k{i:03}", NOW - i)
    owner = Halves()
    core = KeeperCore(KeeperConfig(), owner)
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    return store, owner, core, sub


def test_rows_gained_by_an_ownership_change_are_counted_apart_from_missed_writes() -> None:
    store, owner, core, sub = loaded_halves()
    mine = {k for k in store.rows if owner.owns(key_hash(k.encode()))}
    assert set(held_state(core)) == mine
    store.put("/k000", NOW + 1)  # events for rows owned or not
    store.put("/k001", NOW + 1)
    core.apply_events(sub.poll().events, NOW)
    assert set(held_state(core)) == mine
    owner.bit, owner.generation = 1, 1
    assert core.mark_unowned() == len(mine) and core.dropping
    store.put(sorted(mine)[0], NOW + 2)  # an event for a marked row: it goes, not dropped twice
    core.apply_events(sub.poll().events, NOW)
    dropped = 0
    while core.dropping:
        dropped += core.drop_unowned(limit=7)
    assert dropped == len(mine) - 1 and len(core.queue) == 0
    store.silent(None, key=next(iter(sorted(set(store.rows) - mine))))  # a row gone meanwhile
    walk = core.begin_walk("membership", NOW)
    while not walk.done:
        rows = store.walk(walk.after, 50)
        core.apply_walked(walk, rows, NOW)
        if len(rows) < 50:
            core.finish_walk(walk, NOW)
    theirs = {k for k in store.rows if owner.owns(key_hash(k.encode()))}
    assert set(held_state(core)) == theirs
    assert walk.repairs.gained == len(theirs) and walk.repairs.missed == 0
    assert core.counters.dropped_unowned == len(mine) - 1


def test_retired_rows_are_counted_by_the_node_that_owns_them() -> None:
    """Each node counts only its own retired rows, through events and walks; when the
    ownership flips, the ones it no longer owns leave its count and a membership walk
    brings in the other half's."""
    store, owner, core, sub = loaded_halves()
    for i in range(0, 40):
        store.retire(f"/k{i:03}", NOW)
    core.apply_events(sub.poll().events, NOW)

    def retired_owned() -> int:
        return sum(
            1
            for key, row in store.rows.items()
            if row.retired_at is not None and owner.owns(key_hash(key.encode()))
        )

    assert sum(core.retired.by_route().values()) == retired_owned() > 0
    assert len(core.queue) == sum(
        1
        for key, row in store.rows.items()
        if row.retired_at is None and owner.owns(key_hash(key.encode()))
    )
    owner.bit, owner.generation = 1, 1
    core.mark_unowned()
    while core.dropping:
        core.drop_unowned(limit=50)
    assert len(core.retired) == 0
    walk = core.begin_walk("membership", NOW)
    while not walk.done:
        rows = store.walk(walk.after, 30)
        core.apply_walked(walk, rows, NOW)
        if len(rows) < 30:
            core.finish_walk(walk, NOW)
    assert sum(core.retired.by_route().values()) == retired_owned() > 0
    assert walk.repairs.missed == 0


def test_a_batch_of_events_is_judged_for_ownership_at_once() -> None:
    """Owned rows moved, added and deleted, other nodes' rows written and deleted, all in
    one batch: the keeper holds exactly its share of the table, with the table's values,
    and counts each event for a key it does not own."""
    store, owner, core, sub = loaded_halves()
    for i in range(0, 200, 2):
        store.put(f"/k{i:03}", NOW + 1_000 + i)  # moves within the class
    for i in range(1, 200, 10):
        store.put(f"/k{i:03}", NOW + 5, route="page")  # a class change
    for i in range(30):
        store.put(f"/new{i}", NOW - i)
    store.write(delete=[f"/k{i:03}" for i in range(3, 200, 7)])
    events = sub.poll().events
    assert all(isinstance(e, RowEvent) for e in events)
    theirs = [
        e for e in events if isinstance(e, RowEvent) and not owner.owns(key_hash(e.key.encode()))
    ]
    assert theirs and len(theirs) < len(events)
    core.apply_events(events, NOW)
    mine = {k: v for k, v in table_state(store).items() if owner.owns(key_hash(k.encode()))}
    assert held_state(core) == mine
    assert core.counters.unowned == len(theirs)


def test_a_route_change_reclassifies_held_rows_without_a_reload() -> None:
    store = MemoryStore()
    store.set_route("product", default_cadence_s=86_400)
    for i in range(100):
        store.put(f"/p{i}", NOW - 3_600_000, route="product")
        store.put(f"/c{i}", NOW - 3_600_000, route="category", cadence_s=86_400)
    core = KeeperCore(KeeperConfig(sitemap_boost=0))
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    walks_before = store.walks
    # Equal lateness, equal cadence: products and categories tie.
    ranks = core.select(200, NOW).rank
    assert set(ranks.tolist()) == {3_600_000 / 86_400_000}
    store.set_route("product", default_cadence_s=3_600)
    core.apply_events(sub.poll().events, NOW)
    assert store.walks == walks_before, "no reload"
    assert core.counters.reclassifications == 1 and core.counters.rows_reclassified == 100
    assert_equal_to_table(core, store)
    top = core.queue.slots.keys(core.select(100, NOW).slots)
    assert {k.decode()[:2] for k in top} == {"/p"}, "hourly products are now far later"
    store.set_default_cadence_s(60)  # rows with no cadence of their own or their route's
    store.set_route("product", paused=True)
    core.apply_events(sub.poll().events, NOW)
    assert_equal_to_table(core, store)
    assert {k.decode()[:2] for k in core.queue.slots.keys(core.select(300, NOW).slots)} == {"/c"}


def test_a_merge_of_two_classes_after_a_settings_change_keeps_every_row() -> None:
    store = MemoryStore()
    rng = random.Random(3)
    for i in range(300):
        cadence = rng.choice([None, 3600])
        store.put(f"/k{i}", NOW - rng.randrange(10_000_000), route="blog", cadence_s=cadence)
    core = KeeperCore(KeeperConfig())
    sub = store.subscribe("keeper", store.feed_head())
    load(core, store)
    store.set_route("blog", default_cadence_s=3600)  # the same cadence as the rows' own
    core.apply_events(sub.poll().events, NOW)
    assert_equal_to_table(core, store)
    assert len({c for c, _, _ in held_state(core).values()}) == 2  # from the row or not


def test_an_unreadable_row_in_the_feed_is_skipped_and_leaves_no_half_row() -> None:
    store = MemoryStore()
    store.put("/ok", NOW)
    core = KeeperCore(KeeperConfig())
    load(core, store)
    from store.rows import RowEvent

    bad = [
        RowEvent(
            key="/v",
            row=Row(
                key="/v",
                route="r",
                cadence_s=None,
                sitemap=False,
                next_render_at=NOW,
                version="7",  # type: ignore[arg-type]
            ),
        ),
        RowEvent(
            key="/d",
            row=Row(
                key="/d",
                route="r",
                cadence_s=None,
                sitemap=False,
                next_render_at=1.5,  # type: ignore[arg-type]
            ),
        ),
        RowEvent(
            key="/c", row=Row(key="/c", route="r", cadence_s=-1, sitemap=False, next_render_at=NOW)
        ),
    ]
    core.apply_events(bad, NOW)
    assert core.counters.unreadable == 3
    assert_equal_to_table(core, store)


def test_a_held_row_moved_by_an_unreadable_event_stays_as_it_was() -> None:
    """Held rows take the C path (apply_moves): each bad field must still send the event
    to the Python loop, which counts it and changes nothing; good events around them
    are applied."""
    from store.rows import RowEvent

    store = MemoryStore()
    for i in range(8):
        store.put(f"/h{i}", NOW - 1_000 * i)
    core = KeeperCore(KeeperConfig())
    load(core, store)
    before = held_state(core)

    def moved(i: int, **fields: object) -> RowEvent:
        row = store.rows[f"/h{i}"]
        return RowEvent(key=f"/h{i}", row=Row(**{**msgspec.structs.asdict(row), **fields}))

    bad = [
        moved(0, version="9"),
        moved(1, next_render_at=float(NOW)),
        moved(2, next_render_at=True),
        moved(3, cadence_s=0),
        moved(4, next_render_at=-5),
        moved(5, next_render_at=MAX_DUE_MS),
        RowEvent(key="/h7", row=store.rows["/h6"]),  # the event's key is not the row's
    ]
    good = moved(6, next_render_at=NOW + 60_000, version=99)
    core.apply_events([bad[0], bad[1], good, *bad[2:]], NOW)
    assert core.counters.unreadable == len(bad)
    after = held_state(core)
    assert after.pop("/h6")[1:] == (NOW + 60_000, 99)
    before.pop("/h6")
    assert after == before
