"""The soak's own verdicts (bench/sections/soak_check.py): each is fed a log with the fault it must
find, and a log where the same events are legitimate, so a checker that cannot fail fails."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench.sections import soak, soak_check
from bench.sections.soak_check import Completion, Grant, Pause, Renewal, TableRow, Write

LEASE = 10_000


def grant(fleet: int, token: str, granted_at: int, *, sent: int | None = None,
          answered: int | None = None, key: str = "k", route: str = "r") -> Grant:  # fmt: skip
    return Grant(
        fleet, key, token, route, granted_at + LEASE, LEASE,
        granted_at - 5 if sent is None else sent, granted_at + 5 if answered is None else answered,
    )  # fmt: skip


def done(fleet: int, token: str, sent: int, *, outcome: str = "rendered", nra: int = 0,
         result: str = "ok", attempts: int = 1, key: str = "k") -> Completion:  # fmt: skip
    return Completion(fleet, key, token, outcome, nra, sent, sent + 5, result, attempts)


# --- held by two at once -------------------------------------------------------------------


def test_a_grant_while_an_unanswered_lease_is_live_is_a_double_hold() -> None:
    found = soak_check.double_holds([grant(0, "1", 0), grant(1, "2", 5_000)], [], [])
    assert len(found) == 1
    assert found[0].first.token == "1" and found[0].second.token == "2"
    assert found[0].first_expiry == LEASE


def test_the_same_fleet_granted_its_own_live_key_again_is_a_double_hold() -> None:
    assert soak_check.double_holds([grant(0, "1", 0), grant(0, "2", 9_999)], [], [])


def test_a_grant_after_expiry_or_after_the_completion_was_sent_is_not() -> None:
    after_expiry = [grant(0, "1", 0), grant(1, "2", LEASE)]
    assert soak_check.double_holds(after_expiry, [], []) == []
    # The completion was sent before the second grant's answer: it may have landed first.
    completed = [grant(0, "1", 0), grant(1, "2", 5_000, answered=5_010)]
    assert soak_check.double_holds(completed, [], [done(0, "1", 5_008)]) == []
    # Sent only after the second grant was answered: the first lease was still held.
    late = [grant(0, "1", 0), grant(1, "2", 5_000, answered=5_010)]
    assert soak_check.double_holds(late, [], [done(0, "1", 5_011)])
    # A lost completion counts as ended at its send, whatever became of it.
    lost = [done(0, "1", 4_000, result="lost")]
    assert soak_check.double_holds([grant(0, "1", 0), grant(1, "2", 5_000)], [], lost) == []


def test_a_completion_that_never_reached_the_node_ended_nothing() -> None:
    grants = [grant(0, "1", 0), grant(1, "2", 5_000, answered=5_010)]
    unsent = Completion(0, "k", "1", "rendered", 0, 0, 0, "unsent", 0)
    assert soak_check.double_holds(grants, [], [unsent])
    assert soak_check.final_rows([preload("k")], [unsent], [TableRow("k", "r", 50)]) == ([], 0)


def test_a_renewal_answered_before_the_second_grant_was_asked_extends_the_first() -> None:
    grants = [grant(0, "1", 0), grant(1, "2", 12_000, sent=11_990)]
    renewed = [Renewal(0, "k", "1", 7_000, 7_010, True, 17_000)]
    found = soak_check.double_holds(grants, renewed, [])
    assert len(found) == 1 and found[0].first_expiry == 17_000
    # Answered after the second claim was sent: it may have landed after that grant.
    renewed_late = [Renewal(0, "k", "1", 7_000, 11_995, True, 17_000)]
    assert soak_check.double_holds(grants, renewed_late, []) == []
    # A renewal whose answer was lost extends nothing.
    renewed_lost = [Renewal(0, "k", "1", 7_000, 0, False, 0)]
    assert soak_check.double_holds(grants, renewed_lost, []) == []


def test_other_keys_never_overlap() -> None:
    grants = [grant(0, "1", 0, key="a"), grant(1, "1", 5_000, key="b")]
    assert soak_check.double_holds(grants, [], []) == []


# --- paused routes ---------------------------------------------------------------------------


def test_a_grant_on_a_route_while_it_was_certainly_paused_is_found() -> None:
    pauses = [Pause("r", True, 900, 1_000), Pause("r", False, 10_000, 10_010)]
    inside = grant(0, "1", 5_000)
    assert [p.grant for p in soak_check.paused_grants([inside], pauses)] == [inside]
    # Within a worker's route view's age of the pause, after the resume, or another route.
    fine = [grant(0, "2", 1_500), grant(0, "3", 10_001), grant(0, "4", 5_000, route="other")]
    assert soak_check.paused_grants(fine, pauses) == []


def test_a_pause_never_resumed_stays_open() -> None:
    pauses = [Pause("r", True, 900, 1_000)]
    assert soak_check.paused_grants([grant(0, "1", 99_000)], pauses)


# --- final rows --------------------------------------------------------------------------------


def preload(key: str, nra: int = 50) -> Write:
    return Write(key, "preload", "r", nra, 1, 1)


def test_a_deleted_row_that_is_back_is_resurrected() -> None:
    writes = [preload("k"), Write("k", "delete", "", 0, 100, 110)]
    faults, _ = soak_check.final_rows(writes, [], [TableRow("k", "r", 50)])
    assert [f.kind for f in faults] == ["resurrected"]
    gone = soak_check.final_rows([preload("k")], [done(0, "1", 100, outcome="gone")], [])
    assert gone == ([], 0)
    faults, _ = soak_check.final_rows(
        [preload("k")], [done(0, "1", 100, outcome="gone")], [TableRow("k", "r", 50)]
    )
    assert [f.kind for f in faults] == ["resurrected"]


def test_a_missing_row_is_lost_and_an_old_due_time_is_stale() -> None:
    upserted = [Write("k", "upsert", "r", 7_777, 100, 110)]
    faults, _ = soak_check.final_rows(upserted, [], [])
    assert [f.kind for f in faults] == ["lost"]
    rendered = [done(0, "1", 200, nra=9_999)]
    faults, _ = soak_check.final_rows([preload("k")], rendered, [TableRow("k", "r", 50)])
    assert [f.kind for f in faults] == ["stale"]
    assert soak_check.final_rows([preload("k")], rendered, [TableRow("k", "r", 9_999)]) == ([], 0)
    wrong_route = soak_check.final_rows(upserted, [], [TableRow("k", "other", 7_777)])
    assert [f.kind for f in wrong_route[0]] == ["stale"]


def test_a_row_nobody_wrote_is_resurrected() -> None:
    faults, _ = soak_check.final_rows([], [], [TableRow("stranger", "r", 1)])
    assert [f.kind for f in faults] == ["resurrected"]


def test_overlapping_or_unanswered_operations_allow_either_outcome() -> None:
    # An import and a gone at the same time: present or absent are both right.
    ops = [preload("k"), Write("k", "import", "", 0, 100, 300)]
    gone = [done(0, "1", 150, outcome="gone")]
    assert soak_check.final_rows(ops, gone, [TableRow("k", "r", 50)]) == ([], 1)
    assert soak_check.final_rows(ops, gone, []) == ([], 1)
    # A completion whose answer was lost, or refused after a retry, may or may not have landed.
    for maybe in (done(0, "1", 200, nra=9_999, result="lost"),
                  done(0, "1", 200, nra=9_999, result="lease_not_held", attempts=2)):  # fmt: skip
        for row in (TableRow("k", "r", 50), TableRow("k", "r", 9_999)):
            assert soak_check.final_rows([preload("k")], [maybe], [row])[0] == []
        assert soak_check.final_rows([preload("k")], [maybe], [TableRow("k", "r", 1)])[0]
    # Refused at its only attempt: it changed nothing.
    refused = done(0, "1", 200, nra=9_999, result="lease_not_held")
    assert soak_check.final_rows([preload("k")], [refused], [TableRow("k", "r", 9_999)])[0]


def test_a_later_certain_write_closes_an_earlier_one() -> None:
    ops = [
        preload("k"),
        Write("k", "delete", "", 0, 100, 110),
        Write("k", "upsert", "r", 5, 200, 210),
    ]
    assert soak_check.final_rows(ops, [], [TableRow("k", "r", 5)]) == ([], 0)
    faults, _ = soak_check.final_rows(ops, [], [])
    assert [f.kind for f in faults] == ["lost"]


# --- HTTP, memory, queue-state ---------------------------------------------------------------


def test_5xx_fail_unless_an_unready_503_inside_a_fault_window() -> None:
    answers = [
        ("fleet 0", 1_000, 1_010, "POST", "/v1/claims", 200, ""),
        ("fleet 0", 2_000, 2_010, "POST", "/v1/claims", 503, "1"),  # inside: accepted
        ("fleet 0", 9_000, 9_010, "POST", "/v1/claims", 503, "1"),  # outside
        ("fleet 0", 2_000, 2_010, "POST", "/v1/claims", 503, ""),  # no Retry-After
        ("writer", 2_500, 2_510, "POST", "/v1/schedule", 500, "", '{"title":"Store error"}'),
        ("fleet 1", 3_000, 3_010, "POST", "/v1/completions", 0, "ReadError"),
    ]
    verdict = soak_check.judge_http(answers, [(1_500, 5_000)])
    assert verdict.unready_accepted == 1
    assert [(f.status, f.at) for f in verdict.failures] == [
        (503, 9_010),
        (503, 2_010),
        (500, 2_510),
    ]
    assert verdict.failures[-1].detail == '{"title":"Store error"}'  # kept when the book has it
    assert verdict.failures[0].detail == ""
    assert verdict.transport_errors == 1 and verdict.transport_by_kind == {"ReadError": 1}
    assert soak_check.judge_http(answers[:2] + answers[5:], [(1_500, 5_000)]).failures == []


def test_rss_growth_is_judged_over_the_second_half_of_each_life() -> None:
    flat = [(t * 1000, 1, "worker 0", 100 * 2**20) for t in range(100)]
    growing = [(t * 1000, 2, "worker 1", (100 + max(0, t - 50) // 5) * 2**20) for t in range(100)]
    short = [(t * 1000, 3, "worker 1", t * 2**20 + 1) for t in range(10)]
    by_pid = {g.pid: g for g in soak_check.rss_growth(flat + growing + short, 60_000)}
    assert by_pid[1].judged and by_pid[1].growth == 0
    assert by_pid[2].judged and by_pid[2].growth > 0.05
    assert not by_pid[3].judged


def test_queue_state_counts_must_equal_the_tables_at_counts_at() -> None:
    table = [
        TableRow("a", "r", 100, True),
        TableRow("b", "r", 200),
        TableRow("c", "p", 100),
        TableRow("d", "r", 900),
    ]
    right = {"held": 4, "due": 2, "due_sitemap": 1, "paused": 1}
    assert soak_check.queue_state_vs_table(right, 500, table, {"p"}) == []
    wrong = dict(right, due=3)
    diffs = soak_check.queue_state_vs_table(wrong, 500, table, {"p"})
    assert [(d.field, d.queue_state, d.table) for d in diffs] == [("due", 3, 2)]


# --- the fault plan ----------------------------------------------------------------------------


def test_the_plan_has_every_kind_of_fault_and_kills_worker_0_first() -> None:
    for postgres, restarts in ((False, False), (True, False), (True, True)):
        faults = soak.plan(soak.QUICK, postgres, random.Random(1), server_restarts=restarts)
        kinds = {f.kind for f in faults}
        expected = {"kill", "stop", "restart"} | ({"pg_kill", "pg_kill_all"} if postgres else set())
        expected |= {"pg_restart"} if restarts else set()
        assert kinds == expected
        kills = [f for f in faults if f.kind == "kill"]
        assert kills[0].worker == 0
        assert all(f.worker == 0 for f in faults if f.kind == "stop")
        duration = soak.QUICK.minutes * 60
        assert all(
            soak.QUICK.warmup_s <= f.at_s < duration - soak.QUICK.quiet_tail_s for f in faults
        )
        assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)


def test_regrants_after_an_unanswered_lease_are_counted() -> None:
    grants = [grant(0, "1", 0), grant(1, "2", LEASE), grant(0, "3", 2 * LEASE)]
    assert soak_check.regrants_unanswered(grants, [done(1, "2", LEASE + 100)]) == 1
    assert soak_check.regrants_unanswered(grants, []) == 2


def test_a_book_written_in_chunks_reads_back_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(soak, "FLUSH_EVERY", 3)
    book = soak.Book("fleet 0", tmp_path / "fleet0.bin")
    for i in range(10):
        book.grants.append((0, f"k{i}", str(i), "r", 10_000 + i, 10_000, i, i + 1))
        book.flush()
    book.note = {"statistics": {"claimed": 10}}
    book.flush(final=True)
    read = soak.read_book(tmp_path / "fleet0.bin")
    assert [g[1] for g in read["grants"]] == [f"k{i}" for i in range(10)]
    assert read["who"] == "fleet 0" and read["note"]["statistics"]["claimed"] == 10
    unfinished = soak.Book("writer", tmp_path / "writer.bin")
    unfinished.writes.extend([("k", "delete", "", 0, 1, 2)] * 3)
    unfinished.flush()
    try:
        soak.read_book(tmp_path / "writer.bin")
    except RuntimeError as exc:
        assert "final chunk" in str(exc)
    else:
        raise AssertionError("a log without its final chunk was read as whole")


def test_cpu_shares_sum_each_names_pids_over_the_run() -> None:
    samples = [
        (0, 1, "node worker 0", 0.0),
        (5_000, 1, "node worker 0", 2.0),  # killed here: a new pid takes over
        (5_000, 2, "node worker 0", 0.0),
        (10_000, 2, "node worker 0", 3.0),
        (0, 3, "soak-fleet-0", 1.0),
        (10_000, 3, "soak-fleet-0", 6.0),
        (0, 4, "soak-fleet-1", 0.0),
        (10_000, 4, "soak-fleet-1", 5.0),
    ]
    assert soak.cpu_shares(samples) == {"node worker 0": 0.5, "fleet": 1.0}


def test_rss_by_role_tells_a_respawn_climbing_back_from_a_leak() -> None:
    mb = 2**20
    # worker 0 at 120 MB, killed at 60 s; its successor starts at 100 and climbs back to 120.
    respawn = [(t * 1000, 1, "worker 0", 120 * mb) for t in range(0, 60)]
    respawn += [
        (t * 1000, 2, "worker 0", min(120, 100 + (t - 60) // 3) * mb) for t in range(60, 120)
    ]
    # worker 1 grows steadily: 100 MB, then one MB every 5 s.
    leak = [(t * 1000, 3, "worker 1", (100 + t // 5) * mb) for t in range(120)]
    roles = {r.role: r for r in soak_check.rss_by_role(respawn + leak, 0, 119_000, 10_000)}
    assert roles["worker 0"].growth <= 0 and roles["worker 0"].pids == 2
    assert roles["worker 1"].growth > 0.05
    # The per-process view calls the respawn's climb growth: why it is not the judged one.
    by_pid = {g.pid: g for g in soak_check.rss_growth(respawn, 30_000)}
    assert by_pid[2].growth > 0.05


def test_rss_by_role_tells_a_respawn_born_big_from_one_that_grows() -> None:
    mb = 2**20
    # worker 0 at 115 MB, killed at 65 s; its successor is born at 138 MB and stays there.
    born_big = [(t * 1000, 1, "worker 0", 115 * mb) for t in range(0, 65)]
    born_big += [(t * 1000, 2, "worker 0", 138 * mb) for t in range(65, 120)]
    # worker 1, killed at 65 s too; its successor is born at the same level and leaks.
    leaking = [(t * 1000, 3, "worker 1", 115 * mb) for t in range(0, 65)]
    leaking += [(t * 1000, 4, "worker 1", (115 + (t - 65)) * mb) for t in range(65, 120)]
    roles = {r.role: r for r in soak_check.rss_by_role(born_big + leaking, 0, 119_000, 10_000)}
    w0, w1 = roles["worker 0"], roles["worker 1"]
    assert w0.across_halves > 0.15 and w0.peak_pid == 2 and w0.peak_pid_growth == 0
    assert w0.growth == 0
    assert w1.across_halves > 0.25 and w1.peak_pid == 4
    assert w1.peak_pid_growth is not None and w1.peak_pid_growth > 0.1 and w1.growth > 0.1
    # A process with too few samples to tell is judged by the rise across the halves alone.
    young = [(t * 1000, 5, "worker 0", 100 * mb) for t in range(0, 110)]
    young += [(t * 1000, 6, "worker 0", 130 * mb) for t in range(115, 120)]
    (only,) = soak_check.rss_by_role(young, 0, 119_000, 10_000)
    assert only.peak_pid == 6 and only.peak_pid_growth is None and only.growth == 0.3
