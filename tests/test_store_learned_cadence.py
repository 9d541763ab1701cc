"""Adaptive cadence in the store, on every backend: a route's adaptation, what completions
that say `changed` leave on a row (its learned cadence and history, written with the
render), what the feed delivers, and what forgets a learned cadence."""

from __future__ import annotations

import pytest
from store_helpers import ContractStore, put, settle

from store.cadence import Adaptation, history_of, ladder, rung_of
from store.rows import Completion, RouteEvent, Row, RowEvent

HOUR_TO_WEEK = Adaptation(min_s=3600, max_s=7 * 86400)
RUNGS = ladder(HOUR_TO_WEEK.min_s, HOUR_TO_WEEK.max_s)


def observe(store: ContractStore, key: str, changed: bool, now: int) -> Row:
    (row,) = store.complete([Completion(key=key, outcome="rendered", now=now, changed=changed)])
    assert row is not None
    return row


def test_a_route_turns_adaptation_on_and_the_feed_says_so(any_store: ContractStore) -> None:
    sub = any_store.subscribe("keeper")
    route = any_store.set_route("product", adapt=HOUR_TO_WEEK)
    assert route.adapt == HOUR_TO_WEEK
    assert any_store.routes()[0].adapt == HOUR_TO_WEEK
    settle(any_store)
    assert RouteEvent(route=route) in sub.poll().events
    kept = any_store.set_route("product", paused=True)
    assert kept.adapt == HOUR_TO_WEEK and kept.paused
    off = any_store.set_route("product", clear_adapt=True)
    assert off.adapt is None
    sub.close()


def test_unchanged_renders_climb_the_ladder_and_a_change_comes_down(
    any_store: ContractStore,
) -> None:
    any_store.set_route("product", adapt=HOUR_TO_WEEK)
    any_store.write([put("/a", cadence_s=3600)])
    sub = any_store.subscribe("keeper")
    now = 1_000_000
    climbed = []
    for _ in range(5):
        row = observe(any_store, "/a", False, now)
        climbed.append(row.learned_cadence_s)
        assert row.next_render_at == now + 1000 * RUNGS[len(climbed)]
    assert climbed == list(RUNGS[1:6])
    down = observe(any_store, "/a", True, now)
    assert down.learned_cadence_s == RUNGS[4]
    assert history_of(down.change_history) == [False] * 5 + [True]
    assert down.cadence_s == 3600  # the row's own cadence is kept
    assert any_store.get("/a") == down
    settle(any_store)
    assert RowEvent(key="/a", row=down) in sub.poll().events
    # A render that says nothing renders at the learned cadence and learns nothing.
    (plain,) = any_store.complete([Completion(key="/a", outcome="rendered", now=now)])
    assert plain is not None and plain.next_render_at == now + 1000 * RUNGS[4]
    assert (plain.learned_cadence_s, plain.change_history) == (RUNGS[4], down.change_history)
    sub.close()


def test_a_route_that_does_not_adapt_records_history_only(any_store: ContractStore) -> None:
    any_store.write([put("/a", cadence_s=600)])
    row = observe(any_store, "/a", True, 5_000)
    assert row.learned_cadence_s is None and history_of(row.change_history) == [True]
    assert row.next_render_at == 5_000 + 600_000


def test_a_batch_mixes_observed_plain_failed_and_repeated_keys(any_store: ContractStore) -> None:
    any_store.set_route("product", adapt=HOUR_TO_WEEK)
    any_store.write([put("/a"), put("/b"), put("/c"), put("/d", route="other")])
    now = 2_000_000
    found = any_store.complete(
        [
            Completion(key="/a", outcome="rendered", now=now, changed=False),
            Completion(key="/b", outcome="rendered", now=now),
            Completion(key="/c", outcome="failed", now=now),
            Completion(key="/a", outcome="rendered", now=now, changed=False),
            Completion(key="/d", outcome="rendered", now=now, changed=False),
            Completion(key="/missing", outcome="rendered", now=now, changed=True),
        ]
    )
    a1, b, c, a2, d, missing = found
    # /a starts from the global default (a day, quantised to its nearest rung), climbs twice.
    day = rung_of(RUNGS, 86_400)
    assert a1 is not None and a1.learned_cadence_s == RUNGS[day + 1]
    assert a2 is not None and a2.learned_cadence_s == RUNGS[day + 2]
    assert history_of(a2.change_history) == [False, False]
    assert b is not None and b.learned_cadence_s is None and b.change_history == 0
    assert c is not None and c.last_outcome == "failed"
    assert d is not None and d.learned_cadence_s is None and history_of(d.change_history) == [False]
    assert missing is None


def test_moving_the_ladder_forgets_what_rows_learned(any_store: ContractStore) -> None:
    any_store.set_route("product", adapt=HOUR_TO_WEEK)
    any_store.write([put("/a", cadence_s=3600), put("/b", cadence_s=3600, route="other")])
    learned = observe(any_store, "/a", False, 1_000)
    assert learned.learned_cadence_s == RUNGS[1]
    # New rates keep it, an upsert on the same route keeps it.
    any_store.set_route("product", adapt=Adaptation(min_s=3600, max_s=7 * 86400, inc=1.0))
    any_store.write([put("/a", 9_000, cadence_s=3600)])
    kept = any_store.get("/a")
    assert kept is not None and kept.learned_cadence_s == RUNGS[1] and kept.next_render_at == 9_000
    sub = any_store.subscribe("keeper")
    any_store.set_route("product", adapt=Adaptation(min_s=60, max_s=86_400))
    forgotten = any_store.get("/a")
    assert forgotten is not None and forgotten.learned_cadence_s is None
    assert forgotten.change_history == learned.change_history
    assert forgotten.version > kept.version
    settle(any_store)
    assert RowEvent(key="/a", row=forgotten) in sub.poll().events
    sub.close()
    # Moving the row to another route forgets it too.
    again = observe(any_store, "/a", False, 1_000)
    assert again.learned_cadence_s is not None
    any_store.write([put("/a", route="other")])
    moved = any_store.get("/a")
    assert moved is not None and moved.learned_cadence_s is None


@pytest.mark.parametrize(
    ("adapt", "message"),
    [
        (Adaptation(min_s=600, max_s=60), "above max_s"),
        (Adaptation(min_s=0, max_s=60), "min_s"),
        (Adaptation(min_s=60, max_s=600, inc=0.0), "inc"),
        (Adaptation(min_s=60, max_s=600, dec=1.0), "dec"),
    ],
)
def test_bad_adaptation_changes_nothing(
    any_store: ContractStore, adapt: Adaptation, message: str
) -> None:
    any_store.set_route("product", default_cadence_s=60)
    with pytest.raises(ValueError, match=message):
        any_store.set_route("product", adapt=adapt, default_cadence_s=120)
    (route,) = any_store.routes()
    assert route.adapt is None and route.default_cadence_s == 60


def test_changed_is_said_of_rendered_pages_only(any_store: ContractStore) -> None:
    any_store.write([put("/a")])
    before = any_store.get("/a")
    with pytest.raises(ValueError, match="rendered page only"):
        any_store.complete([Completion(key="/a", outcome="failed", now=5, changed=True)])
    assert any_store.get("/a") == before
