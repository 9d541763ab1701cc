"""The fault bench's history check: a key surely held by two at once is found, and
overlaps the clocks cannot vouch for are not."""

from __future__ import annotations

from bench.harness.history import History, double_grants, grants_by_node


def test_a_grant_inside_anothers_sure_hold_is_a_double_grant() -> None:
    history = History()
    history.granted("/k", "a", "w1", asked_ms=100, answered_ms=110, expires_ms=1000)
    history.granted("/k", "b", "w2", asked_ms=500, answered_ms=510, expires_ms=1500)
    found = double_grants(history.snapshot())
    assert [(d.first_node, d.second_node) for d in found] == [("a", "b")]
    assert found[0].first_held == (110, 1000) and found[0].second_granted == (500, 510)


def test_a_completion_or_an_expiry_ends_the_hold() -> None:
    history = History()
    first = history.granted("/k", "a", "w1", asked_ms=100, answered_ms=110, expires_ms=1000)
    first.completed_ms = 400  # sent at 400, taken: held at most until then
    history.granted("/k", "b", "w2", asked_ms=450, answered_ms=460, expires_ms=2000)
    history.granted("/k", "b", "w3", asked_ms=2100, answered_ms=2110, expires_ms=3000)
    assert double_grants(history.snapshot()) == []


def test_a_renewal_extends_the_hold() -> None:
    history = History()
    first = history.granted("/k", "a", "w1", asked_ms=100, answered_ms=110, expires_ms=1000)
    first.expires_ms = 2000  # renewed
    history.granted("/k", "c", "w2", asked_ms=1500, answered_ms=1510, expires_ms=3000)
    assert len(double_grants(history.snapshot())) == 1


def test_overlaps_the_times_cannot_vouch_for_are_not_counted() -> None:
    history = History()
    history.granted("/k", "a", "w1", asked_ms=100, answered_ms=900, expires_ms=1000)
    # Asked before the first was answered: it may have been granted before, and the first
    # after the second's lease ended on the node (the fleet cannot tell the order).
    second = history.granted("/k", "b", "w2", asked_ms=500, answered_ms=950, expires_ms=1500)
    second.completed_ms = 950
    # Answered after the first's hold may have ended.
    history.granted("/k", "b", "w3", asked_ms=950, answered_ms=1100, expires_ms=1500)
    history.granted("/other", "b", "w2", asked_ms=500, answered_ms=510, expires_ms=1500)
    assert double_grants(history.snapshot()) == []


def test_grants_are_binned_per_node() -> None:
    history = History()
    for at in (0, 400, 1200):
        history.granted(f"/k{at}", "a", "w", asked_ms=at, answered_ms=at, expires_ms=at + 10)
    history.granted("/x", "b", "w", asked_ms=1500, answered_ms=1500, expires_ms=1600)
    binned = grants_by_node(history.snapshot(), ["a", "b"], 0, 1000, 2000)
    assert binned == {"a": [2, 1], "b": [0, 1]}
