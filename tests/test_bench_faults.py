"""The fault bench's judging, without nodes: the figures each scenario draws from the
fleet's history (who took a leaver's keys and when, a lease's key granted again only after
the lease ended, how long the others kept granting), the refusal of a second start under
a live name as its log says it, every scenario's rows in the report, and the libfaketime
environment a node with its clock set apart runs in."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from bench.harness import faketime
from bench.harness.history import HeldLease, History
from bench.sections import faults
from keeper.ownership import winners
from shm.keys import keyed_hash

SECRET = b"s" * 16  # a key-hash secret is 16 bytes


def lease(key: str, node: str, asked: int, answered: int, expires: int) -> HeldLease:
    return HeldLease(
        key=key, node=node, client="t", asked_ms=asked, answered_ms=answered, expires_ms=expires
    )


def test_shares_split_the_keys_as_the_keepers_rank_them() -> None:
    keys = [faults.key_of(i) for i in range(500)]
    three = faults.share_of(SECRET, keys, ["c", "a", "b"])
    assert set().union(*three.values()) == set(keys)
    assert sum(len(share) for share in three.values()) == len(keys)
    assert all(len(share) > 100 for share in three.values())
    hashes = [keyed_hash(SECRET, key.encode()) for key in keys]
    owners = winners(np.array(hashes, dtype=np.uint64), ["a", "b", "c"])
    assert {k for k, o in zip(keys, owners.tolist(), strict=True) if o == 2} == three["c"]
    # c's leave moves only c's keys.
    two = faults.share_of(SECRET, keys, ["a", "b"])
    assert three["a"] <= two["a"] and three["b"] <= two["b"]


def test_the_first_grant_of_a_leavers_keys_elsewhere() -> None:
    leases = [
        lease("/c1", "c", 0, 10, 6000),
        lease("/c1", "a", 900, 950, 7000),  # asked before the leave
        lease("/a1", "a", 1100, 1120, 7000),  # not c's key
        lease("/c2", "c", 1200, 1210, 7000),  # c itself
        lease("/c2", "b", 1500, 1530, 7000),
        lease("/c1", "a", 1600, 1610, 7000),
    ]
    assert faults.first_grant_of(leases, {"/c1", "/c2"}, 1000, ("a", "b")) == 1530
    assert faults.first_grant_of(leases, {"/c1"}, 2000, ("a", "b")) is None


def test_leases_live_at_an_instant_and_their_keys_granted_again() -> None:
    history = History()
    done = history.granted("/done", "c", "w", 0, 10, 6000)
    done.completed_ms = 500  # completed before the kill at 1000
    live = history.granted("/live", "c", "w", 0, 20, 6000)
    history.granted("/later", "c", "w", 1500, 1510, 7000)  # granted after the kill
    assert faults.live_at(history.snapshot(), 1000) == [live]
    history.granted("/live", "a", "w", 18_000, 18_010, 24_000)  # 12 s after its end
    history.granted("/live", "c", "w", 30_000, 30_010, 36_000)
    assert faults.regrant_margin(history.snapshot(), [live], ("a",)) == 12.0
    assert faults.regrant_margin(history.snapshot(), [live], ("b",)) is None
    # Asked before the earlier lease's end: the margin goes below 0.
    history.granted("/live", "b", "w", 5000, 5010, 11_000)
    assert faults.regrant_margin(history.snapshot(), [live], ("a", "b")) == -1.0


def test_how_long_the_others_kept_granting_through_a_stop() -> None:
    leases = [
        lease("/x", "a", at - 5, at, at + 6000) for at in (1000, 2500, 7000, 9000, 14_000)
    ] + [lease("/y", "c", 14_500, 14_600, 20_000)]  # c's grant does not count
    span, gap = faults.grants_span(leases, ("a", "b"), 2000, 15_000)
    assert span == 12.0  # from 2000 to the last grant at 14000
    assert gap == 5.0  # 9000 to 14000
    assert faults.grants_span(leases, ("b",), 2000, 15_000) == (None, 13.0)
    stolen = faults.grants_of(leases, {"/x"}, ("a",), 2000, 8000)  # by their asks
    assert [x.answered_ms for x in stolen] == [2500, 7000]


def test_a_second_start_is_refused_only_for_a_taken_name() -> None:
    taken = {"event": "start_failed", "kind": "NameTaken", "error": "node name 'a' is taken"}
    assert faults.refused_at_start(1, [taken]) == "node name 'a' is taken"
    assert faults.refused_at_start(0, [taken]) is None  # it ran: not refused
    assert faults.refused_at_start(None, [taken]) is None  # still running at the deadline
    other = {"event": "start_failed", "kind": "SettingsDiffer", "error": "node_ttl_s"}
    assert faults.refused_at_start(1, [other]) is None


def test_a_nodes_log_events_are_read_back() -> None:
    node = faults.FaultNode("a", "postgresql://nowhere/db")
    try:
        node.log.write(b"not json\n")
        node.log.write(json.dumps({"event": "start_failed", "kind": "NameTaken"}).encode() + b"\n")
        node.log.write(json.dumps({"event": "listening"}).encode() + b"\n")
        assert node.events("start_failed") == [{"event": "start_failed", "kind": "NameTaken"}]
    finally:
        node.drop()


def outcome(scenario: str, figures: dict[str, float | None]) -> faults.Outcome:
    return faults.Outcome(
        scenario=scenario,
        figures=figures,
        double_grants=0,
        rows_lost=0,
        grants=10,
        renewals_refused={},
        completions_pending=0,
        events=[],
        start_ms=0,
        end_ms=1000,
    )


def test_every_scenario_has_its_rows_in_the_report() -> None:
    figures: dict[str, dict[str, float | None]] = {
        "cold start": {"first_grant_s": 1.0},
        "join": {"first_grant_s": 1.0},
        "sigkill": {
            "takeover_s": 12.0,
            "lease_horizon_s": 5.0,
            "worst_case_s": 306.0,
            "ceiling_s": 11.0,
        },
        "rolling restart": {"dark_s": 3.0, "queue_state_503_s": 2.0},
        "blackhole 15 s": {"first_grant_s": 1.0},
        "blackhole past the TTL": {"first_grant_s": 1.0},
        "leave": dict.fromkeys(
            ("takeover_s", "handover_margin_s", "leases_at_stop", "unlanded"), 1.0
        ),
        "sigkill all": dict.fromkeys(
            (
                "first_grant_s",
                "ready_s",
                "takeover_s",
                "lease_horizon_s",
                "regrant_margin_s",
                "adopted",
            ),
            1.0,
        ),
        "duplicate name": {"refused": 1.0, "refusal_s": 0.4, "live_first_grant_s": 1.0},
        "clock +30 s": dict.fromkeys(faults.CLOCK_FIGURES, 1.0),
        "clock -30 s": dict.fromkeys(faults.CLOCK_FIGURES, 1.0),
        "renewals across a join": dict.fromkeys(
            ("not_owner", "moved_leases", "moved_first_grant_s", "regrant_margin_s"), 1.0
        ),
        "worker 0 stopped": dict.fromkeys(
            (
                "queue_usage_max_pct",
                "others_granting_s",
                "others_longest_gap_s",
                "taken_over_s",
                "resume_first_grant_s",
            ),
            1.0,
        ),
    }
    assert list(figures) == [name for name, _ in faults.SCENARIOS]
    outcomes = [outcome(name, got) for name, got in figures.items()]
    outcomes[3].unlanded = {"a": 2, "c": 1}  # refused by the others while a node restarted
    rows = faults.figures_of(outcomes)
    keys = [row.key for row in rows]
    by_key = {row.key: row.ours for row in rows}
    assert by_key[f"{faults.TABLE}/rolling restart: completions that never landed"] == 3
    assert len(keys) == len(set(keys))
    for name in figures:
        assert f"{faults.TABLE}/{name}: keys granted twice" in keys
        assert f"{faults.TABLE}/{name}: rows lost" in keys
    assert any("never landed" in key and "leave" in key for key in keys)
    assert any("not_owner" in key for key in keys)


@pytest.mark.skipif(not faketime.available(), reason="Debian's faketime is not installed")
def test_a_process_under_the_faketime_environment_keeps_its_waits() -> None:
    """Its wall clock is set apart; `time.sleep` and timed lock waits still return."""
    probe = (
        "import os, threading, time\n"
        "start = time.monotonic(); time.sleep(0.1); threading.Event().wait(0.1)\n"
        "print(round(time.monotonic() - start, 1), round(time.time()))\n"
    )
    env = {"PATH": "/usr/bin:/bin", **faketime.environment("+30s")}
    before = time.time()
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=20
    )
    after = time.time()
    assert done.returncode == 0, done.stderr
    waited, then = done.stdout.split()
    # The waits waited (a busy machine may stretch them; the run's return shows they end).
    assert float(waited) >= 0.2
    # Read while the process ran, 30 s ahead of the machine's clock (to the second).
    assert before + 29 <= int(then) <= after + 31


def test_a_quick_run_leaves_out_only_scenarios_a_named_test_proves() -> None:
    """Each scenario a quick run leaves out names a test that exists; the rest still run."""
    from pathlib import Path

    names = [name for name, _ in faults.SCENARIOS]
    assert set(faults.TESTED_BY) <= set(names)
    assert set(names) - set(faults.TESTED_BY), "a quick run must still run some scenario"
    root = Path(__file__).resolve().parent.parent
    for scenario, (path, test) in faults.TESTED_BY.items():
        assert f"\ndef {test}(" in (root / path).read_text(), (scenario, path, test)


def test_the_table_of_a_quick_run_has_rows_for_the_scenarios_it_ran_only() -> None:
    ran = faults.Outcome(
        scenario="sigkill all",
        figures={"adopted": 3, "ready_s": 2.0, "first_grant_s": 0.8, "takeover_s": 9.0,
                 "lease_horizon_s": 8.0, "regrant_margin_s": 1.0},
        double_grants=0, rows_lost=0, grants=10, renewals_refused={}, completions_pending=0,
        events=[], start_ms=0, end_ms=1,
    )  # fmt: skip
    rows = faults.figures_of([ran])
    assert rows and {row.what.split(":")[0] for row in rows} == {"sigkill all"}
    adopted = next(row for row in rows if "adopted" in row.what)
    assert adopted.ours == 3
