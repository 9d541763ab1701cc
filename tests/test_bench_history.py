"""The fault bench's history check: a key surely held by two at once is found, and
overlaps the clocks cannot vouch for are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.history import (
    History,
    double_grants,
    double_holds,
    grants_by_node,
    in_one_clock,
    main,
    unrecorded,
)
from shm.lease_journal import GRANTED, JournaledLease, LeaseJournal


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


def test_a_lease_the_fleet_saw_must_be_one_a_node_recorded_between_ask_and_answer() -> None:
    history = History()
    seen = history.granted(
        "/k", "a", "w", asked_ms=100, answered_ms=110, expires_ms=900, token="a:7"
    )
    late = history.granted(
        "/j", "a", "w", asked_ms=200, answered_ms=210, expires_ms=900, token="a:8"
    )
    other = history.granted(
        "/i", "b", "w", asked_ms=300, answered_ms=310, expires_ms=900, token="9"
    )
    journaled = [
        JournaledLease(node="a", key_hash=1, token=7, granted_ms=105, held_until_ms=900),
        JournaledLease(node="a", key_hash=2, token=8, granted_ms=250, held_until_ms=900),
    ]
    assert unrecorded([seen, late, other], journaled) == [late, other]


def test_the_audit_command_reports_a_key_held_twice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for node, token, at, until in (("a", 1, 100, 500), ("b", 2, 300, 900)):
        journal = LeaseJournal(tmp_path, node, pid=1)
        journal.write(GRANTED, [42], [token], at, [until])
        journal.close()
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "2 leases recorded by 2 nodes (a, b)" in out
    assert "b granted at 300 while a's lease (100 to 500) held" in out
    assert main([str(tmp_path / "none")]) == 0  # no journal there: nothing held


def test_a_node_with_its_clock_ahead_is_judged_in_the_machines_clock() -> None:
    ahead = JournaledLease(node="c", key_hash=1, token=1, granted_ms=30_100, held_until_ms=30_500)
    other = JournaledLease(node="a", key_hash=1, token=2, granted_ms=400, held_until_ms=900)
    assert double_holds([ahead, other]) == []  # as recorded, 30 s apart
    assert len(double_holds(in_one_clock([ahead, other], {"c": 30_000}))) == 1
