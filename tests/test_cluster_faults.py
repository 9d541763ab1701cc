"""A cluster keeps its promises when things go wrong: real node processes on one real
PostgreSQL, on default settings unless a test says otherwise.

- A fresh cluster grants at once: a node fences a key it gained only while the node it
  came from may hold a lease on it, and a node that holds none says so.
- A join moves keys without double grants: the old owner hands over its live leases,
  the newcomer fences exactly those, and renewals of moved keys are refused, naming the
  new owner.
- Identity is an incarnation: a paused process that wakes up after another took its
  name over grants nothing and stops; cluster settings are one set, checked at join.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from node_harness import NodeProcess, kill_whole_node, nodes_on, now_ms, seed_rows, wait_for

from bench.harness.history import double_holds
from keeper.ownership import winners
from shm.keys import keyed_hash
from shm.lease_journal import read_journals
from store.postgres import PostgresStore

# Heartbeats and a TTL short enough that a test can outlast the TTL cheaply.
FAST_TTL_S = 4
FAST_BEATS = ("--heartbeat-s", "0.5", "--node-ttl-s", str(FAST_TTL_S))
# Fast membership, for the tests that wait a dead incarnation out: dead after 4 s, leases
# of at most 5 s.
FAST = (*FAST_BEATS, "--max-lease-s", "5")


@pytest.fixture
def on_pg(pg_url: str) -> Iterator[str]:
    with nodes_on(lambda directory: pg_url):
        yield pg_url


def node(tmp_path: Path, name: str, *args: str) -> NodeProcess:
    directory = tmp_path / name
    directory.mkdir(exist_ok=True)
    return NodeProcess(directory, workers=1, extra_args=("--node", name, *args))


def why_not(process: NodeProcess) -> str:
    """What a node that grants nothing says of itself, for a failure's message: its
    readiness, a claim's answer, and its log's warnings and membership events."""
    with process.client() as client:
        ready = client.get("/readyz")
        answer = client.post("/v1/claims", json={"max": 1, "worker": "test"})
    telling = [
        json.dumps(event)[:300]
        for event in process.logged()
        if event.get("level") in ("warning", "error", "critical")
        or any(word in str(event.get("event")) for word in ("cluster", "heartbeat", "member"))
    ]
    return (
        f"/readyz {ready.status_code} {ready.text[:300]}; "
        f"claim {answer.status_code} {answer.text[:300]}; "
        "log:\n" + "\n".join(telling[-30:])
    )


def claim(process: NodeProcess, count: int, lease_s: int | None = None) -> list[dict[str, Any]]:
    body: dict[str, Any] = {"max": count, "worker": "test"}
    if lease_s is not None:
        body["lease_s"] = lease_s
    with process.client() as client:
        response = client.post("/v1/claims", json=body)
    if response.status_code != 200:
        return []
    leases: list[dict[str, Any]] = response.json()["leases"]
    return leases


def test_a_fresh_cluster_on_default_settings_grants_within_seconds(
    tmp_path: Path, on_pg: str
) -> None:
    seed_rows(on_pg, 3000, due_share=1.0)
    nodes = [node(tmp_path, name) for name in ("a", "b", "c")]
    try:
        for process in nodes:
            process.start(wait_ready=False)
        for process in nodes:
            process.wait_event("node_ready")
        ready_at = now_ms()
        granted: dict[str, list[dict[str, Any]]] = {}

        def every_node_granted() -> bool:
            for process in nodes:
                name = process.extra_args[1]
                if name not in granted:
                    got = claim(process, 50)
                    if got:
                        granted[name] = got
            return len(granted) == len(nodes)

        # Each node's default lease cap is 300 s: fencing by the worst case would keep them
        # dark for five minutes. Nothing here holds a lease, so none may wait that long.
        wait_for(every_node_granted, 120, "every node of a fresh cluster to grant", 0.2)
        first_grant_s = (now_ms() - ready_at) / 1000
        keys = [lease["key"] for leases in granted.values() for lease in leases]
        assert len(keys) == len(set(keys)), "a key was granted by two nodes"
        for name, leases in granted.items():
            assert {lease["node"] for lease in leases} == {name}
        print(f"fresh cluster: every node granted {first_grant_s:.1f} s after all were ready")
        for process in nodes:
            with process.client() as client:
                state = client.get("/prerender_admin/overview").json()
            assert state is not None
    finally:
        for process in nodes:
            process.stop()


def test_a_join_hands_over_live_leases_and_refuses_renewals_of_moved_keys(
    tmp_path: Path, on_pg: str
) -> None:
    seed_rows(on_pg, 3000, due_share=1.0)
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    c = node(tmp_path, "c")
    try:
        a.start(wait_ready=False)
        b.start(wait_ready=False)
        a.wait_event("node_ready")
        b.wait_event("node_ready")
        held: list[dict[str, Any]] = []

        def claimed_at_a() -> bool:
            held.extend(claim(a, 400 - len(held), lease_s=120))
            return len(held) >= 400

        wait_for(claimed_at_a, 120, "400 leases at a", 0.2)
        c.start()
        # c grants promptly the keys it gained that were not under a live lease at a.
        gained: list[dict[str, Any]] = []

        def granted_at_c() -> bool:
            gained.extend(claim(c, 200, lease_s=60))
            return bool(gained)

        wait_for(granted_at_c, 60, "c to grant", 0.2)
        held_keys = {lease["key"] for lease in held}
        # Keep claiming everything c will grant: none of a's live leases may be among them.
        for _ in range(10):
            gained.extend(claim(c, 500, lease_s=60))
        assert not held_keys & {lease["key"] for lease in gained}, "c granted a key a holds"
        # a refuses to renew the leases whose keys moved to c, naming c; it renews the rest.
        with a.client() as client:
            items = [{"key": x["key"], "token": x["token"], "lease_s": 120} for x in held]

            def moved_refused() -> list[dict[str, Any]] | None:
                results: list[dict[str, Any]] = client.post(
                    "/v1/leases/renew", json={"items": items}
                ).json()["results"]
                return results if any(r.get("error") == "not_owner" for r in results) else None

            results = wait_for(moved_refused, 30, "a to refuse renewals of moved keys", 0.2)
        refused = [r for r in results if not r["ok"]]
        assert refused and all(r["error"] == "not_owner" and r["owner"] == "c" for r in refused)
        # Exactly the leases whose keys moved: c owns them now.
        moved = owned_by(on_pg, [x["key"] for x in held], ["a", "b", "c"], "c")
        assert {r["key"] for r in refused} == moved
        assert any(r["ok"] for r in results)  # a keeps the keys it still owns

        # The moved keys stay fenced at c, key by key, once it has read a's hand-over.
        def handed_over_by_a() -> list[dict[str, Any]] | None:
            with c.client() as client:
                overview = client.get("/prerender_admin/overview").json()
            fences: list[dict[str, Any]] = overview["keeper"]["cluster"]["fences"]
            by_a = [f for f in fences if f["node"] == "a"]
            return by_a if by_a and by_a[0]["reason"] == "handed over" else None

        fenced = wait_for(handed_over_by_a, 30, "c to fence a's hand-over key by key", 0.2)
        assert fenced[0]["keys"] == len(moved)
    finally:
        for process in (a, b, c):
            process.stop()


def owned_by(url: str, keys: list[str], nodes: list[str], name: str) -> set[str]:
    store = PostgresStore(url)
    try:
        secret = store.hash_secret()  # what the nodes hash under
    finally:
        store.close()
    hashes = np.array([keyed_hash(secret, key.encode()) for key in keys], dtype=np.uint64)
    owners = winners(hashes, sorted(nodes))
    return {
        key
        for key, owner in zip(keys, owners.tolist(), strict=True)
        if sorted(nodes)[owner] == name
    }


def is_live(url: str, name: str) -> bool:
    store = PostgresStore(url)
    try:
        return any(r.node == name and r.live for r in store.nodes(4.0))
    finally:
        store.close()


def _pids(process: NodeProcess) -> list[int]:
    assert process.process is not None
    pids = [process.process.pid]
    pids += [int(e["worker_pid"]) for e in process.find_events("worker_started")]
    return pids


def test_a_paused_node_replaced_under_its_name_grants_nothing_and_stops(
    tmp_path: Path, on_pg: str
) -> None:
    seed_rows(on_pg, 500, due_share=1.0)
    old = node(tmp_path, "a", *FAST)
    other = node(tmp_path, "b", *FAST)
    replacement = NodeProcess(tmp_path / "a2", workers=1, extra_args=("--node", "a", *FAST))
    (tmp_path / "a2").mkdir()
    try:
        old.start()
        other.start()
        paused = _pids(old)
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            # Its row ages out; a new start under its name is then a new incarnation.
            wait_for(lambda: not is_live(on_pg, "a"), 60, "a's row to age out", 0.2)
            replacement.start()
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        # Woken, the old process grants nothing: its claims fail until it has stopped.
        refused = 0
        while old.process is not None and old.process.poll() is None:
            try:
                got = claim(old, 50)
            except httpx.HTTPError:
                break
            assert not got, "a superseded incarnation granted a lease"
            refused += 1
        assert old.wait(60) == 3
        old.wait_event("cluster_superseded")
        wait_for(lambda: claim(replacement, 10), 60, "the replacement to grant", 0.2)
    finally:
        for process in (old, other, replacement):
            process.stop()


def test_a_node_with_other_cluster_settings_is_refused_naming_both(
    tmp_path: Path, on_pg: str
) -> None:
    first = node(tmp_path, "a", *FAST)
    second = node(tmp_path, "b", "--heartbeat-s", "0.5", "--node-ttl-s", "6", "--max-lease-s", "5")
    try:
        first.start()
        with pytest.raises(AssertionError, match="node_ttl_s: this node 6, the cluster 4"):
            second.start()
    finally:
        first.stop()
        second.stop()


@pytest.mark.parametrize("offset", ["+30s", "-30s", "+5m"])
def test_a_node_whose_clock_is_set_apart_grants_no_key_twice(
    tmp_path: Path, on_pg: str, offset: str
) -> None:
    """c runs under libfaketime. Keys move to c (a join) and away from it (a clean leave)
    while leases on them live; every grant is judged in this process's clock, each lease
    ending its granted term after it was asked."""
    from bench.harness import faketime
    from bench.harness.history import History, double_grants

    if not faketime.available():
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{faketime.LIBRARY} is missing: .ci/run installs Debian's faketime")
        pytest.skip("Debian's faketime (libfaketime) is not installed")

    import psycopg

    seed_rows(on_pg, 2000, due_share=1.0)
    a, b = node(tmp_path, "a", *FAST_BEATS), node(tmp_path, "b", *FAST_BEATS)
    c = NodeProcess(
        tmp_path / "c",
        workers=1,
        extra_args=("--node", "c", *FAST_BEATS),
        # Only its wall clock is set apart, as on a machine whose clock is set wrong: with
        # the monotonic clock faked too, every timed wait in c hangs (its heartbeats stop
        # after the join, and c rightly grants nothing once its row has aged out).
        env=faketime.environment(offset),
    )
    (tmp_path / "c").mkdir()
    history = History()

    def take(process: NodeProcess, name: str, rounds: int = 1) -> int:
        got = 0
        for _ in range(rounds):
            asked = now_ms()
            leases = claim(process, 200, lease_s=30)
            answered = now_ms()
            for lease in leases:
                ends = asked + int(lease["lease_ms"])
                history.granted(lease["key"], name, "test", asked, answered, ends)
            got += len(leases)
        return got

    def c_heartbeat_past_ttl(conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(
            "SELECT heartbeat_at - started_at > make_interval(secs => %s) FROM nodes"
            " WHERE node = 'c' AND left_at IS NULL",
            (FAST_TTL_S,),
        ).fetchone()
        return bool(row and row[0])

    try:
        a.start(wait_ready=False)
        b.start(wait_ready=False)
        a.wait_event("node_ready")
        b.wait_event("node_ready")
        wait_for(lambda: take(a, "a") and take(b, "b"), 60, "leases at a and b", 0.2)
        c.start()
        joined = c.wait_event("cluster_joined")
        assert joined["clock_offset_ms"] != 0 or offset == "+0s"
        try:
            wait_for(lambda: take(c, "c"), 120, "c to grant", 0.2)
            # c stays a member on its own heartbeats, not on its join's row alone.
            with psycopg.connect(on_pg, autocommit=True) as conn:
                wait_for(lambda: c_heartbeat_past_ttl(conn), 60, "c to heartbeat a TTL on", 0.2)
            wait_for(lambda: take(c, "c"), 60, "c to grant past its TTL", 0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; {why_not(c)}") from None
        take(c, "c", rounds=5)
        c.stop()  # a clean leave: c hands its live leases over, in the database's clock
        for process, name in ((a, "a"), (b, "b")):
            take(process, name, rounds=5)
        wait_for(lambda: take(a, "a") + take(b, "b") > 0, 60, "a and b to grant c's keys", 0.2)
        found = double_grants(history.snapshot())
        assert found == [], found[:3]
        by_node = {n: sum(1 for x in history.snapshot() if x.node == n) for n in "abc"}
        assert all(by_node.values()), by_node
    finally:
        for process in (a, b, c):
            process.stop()


def test_a_node_killed_silent_is_waited_out_by_its_lease_ceiling_not_max_lease(
    tmp_path: Path, on_pg: str
) -> None:
    """On the default max_lease_s (300 s), a fleet asking 5-s leases: b publishes a lease
    ceiling that follows those asks, caps every lease by it, and when b is SIGKILLed whole
    a grants b's keys once that ceiling has passed, minutes before the worst case, and
    never while one of b's leases lived."""
    import psycopg

    seed_rows(on_pg, 600, due_share=1.0)
    a, b = node(tmp_path, "a", *FAST_BEATS), node(tmp_path, "b", *FAST_BEATS)
    b_leases: list[dict[str, Any]] = []
    try:
        for process in (a, b):
            process.start(wait_ready=False)
        for process in (a, b):
            process.wait_event("node_ready")

        def b_leased_on_a_raised_ceiling() -> bool:
            b_leases.extend(claim(b, 5, lease_s=5))
            # Once b's keeper has seen the 5-s asks, its leases get their whole term.
            return any(lease["lease_ms"] == 5000 for lease in b_leases)

        wait_for(b_leased_on_a_raised_ceiling, 120, "b to grant whole 5-s leases", 0.5)
        with psycopg.connect(on_pg, autocommit=True) as conn:
            heartbeat_ms, horizon_ms, db_now_ms = conn.execute(
                "SELECT (extract(epoch FROM heartbeat_at) * 1000)::bigint, lease_horizon_ms, "
                "(extract(epoch FROM clock_timestamp()) * 1000)::bigint FROM nodes "
                "WHERE node = 'b'"
            ).fetchone()  # type: ignore[misc]
        # The ceiling follows the asks (5 s), far short of the 300-s cap's worst case.
        assert db_now_ms < horizon_ms < heartbeat_ms + 60_000
        ends = {lease["key"]: lease["lease_expires_at"] for lease in b_leases}
        assert max(ends.values()) <= horizon_ms  # (one machine: one wall clock)
        kill_whole_node(b)
        killed_at = now_ms()
        regranted: list[dict[str, Any]] = []

        def a_grants_a_key_b_leased() -> bool:
            for lease in claim(a, 100, lease_s=5):
                if lease["key"] in ends:
                    regranted.append({**lease, "granted_at": now_ms()})
            return bool(regranted)

        # The worst case would be 4 + 2 + 300 s past b's last heartbeat.
        wait_for(a_grants_a_key_b_leased, 120, "a to grant a key b had leased", 0.5)
        for lease in regranted:
            assert lease["granted_at"] > ends[lease["key"]], "granted while b's lease lived"
        print(f"a re-granted b's keys {(now_ms() - killed_at) / 1000:.1f} s after the kill")
    finally:
        a.stop()
        b.stop()


def test_a_stopped_nodes_completions_land_through_its_hand_over_and_its_restart_keeps_the_rest(
    tmp_path: Path, on_pg: str
) -> None:
    """b stops cleanly holding two leases. One's completion lands through a while b is
    down (b handed the lease over with its token), once: sent again it is refused. b starts
    again from its snapshot: it ends the lease completed meanwhile, so a completion of it
    at b is refused too, and takes the other back, whose completion then lands at b."""
    seed_rows(on_pg, 200, due_share=1.0)
    a, b = node(tmp_path, "a"), node(tmp_path, "b")
    restarted: NodeProcess | None = None
    try:
        for process in (a, b):
            process.start(wait_ready=False)
        for process in (a, b):
            process.wait_event("node_ready")
        held: list[dict[str, Any]] = []

        def two_leases() -> bool:
            held.extend(claim(b, 2 - len(held), lease_s=120))
            return len(held) == 2

        wait_for(two_leases, 60, "two leases at b", 0.2)
        first, second = (
            {"key": lease["key"], "token": lease["token"], "outcome": "rendered"} for lease in held
        )
        b.stop()

        def complete_at(process: NodeProcess, item: dict[str, Any]) -> dict[str, Any]:
            with process.client() as client:
                response = client.post("/v1/completions", json={"items": [item]})
            assert response.status_code == 200, response.text
            result: dict[str, Any] = response.json()["results"][0]
            return result

        # a's member list may still show b live for a moment: forwarded, node_unavailable.
        wait_for(lambda: complete_at(a, first)["ok"], 60, "b's completion to land at a", 0.3)
        again = complete_at(a, first)
        assert again["ok"] is False and "'b'" in again["detail"], again

        restarted = NodeProcess(
            tmp_path / "b", workers=1, extra_args=b.extra_args, instance=b.instance
        )
        restarted.start()
        taken = restarted.wait_event("leases_taken_back")
        assert (taken["restored"], taken["completed_elsewhere"]) == (2, 1), taken
        refused = complete_at(restarted, first)
        assert refused["ok"] is False and refused["error"] == "lease_not_held", refused
        wait_for(lambda: complete_at(a, second)["ok"], 60, "the other to land at b", 0.3)
        store = PostgresStore(on_pg)
        try:
            rows = [store.get(item["key"]) for item in (first, second)]
        finally:
            store.close()
        assert all(row is not None and row.last_outcome == "rendered" for row in rows), rows
    finally:
        for each in (a, b, restarted):
            if each is not None:
                each.stop()


def test_a_node_whose_keeper_stops_gives_its_share_up_and_takes_it_back(
    tmp_path: Path, on_pg: str
) -> None:
    """b's worker 0 (its keeper) is SIGSTOPped while its supervisor runs on: b withholds
    its heartbeat once the keeper is silent for a TTL, a takes b's keys over once b's
    leases have ended, and after SIGCONT b rejoins and grants again, never a key a's
    lease still holds. Both nodes keep a lease journal: their own records show no key
    leased twice at once, and hold every lease the test was granted."""
    seed_rows(on_pg, 600, due_share=1.0)
    journal = tmp_path / "journal"
    fast = (*FAST_BEATS, "--lease-journal-dir", str(journal))
    a, b = node(tmp_path, "a", *fast), node(tmp_path, "b", *fast)
    try:
        for process in (a, b):
            process.start(wait_ready=False)
        for process in (a, b):
            process.wait_event("node_ready")
        b_leases = claimed_from(b, 20)
        ends = {lease["key"]: lease["lease_expires_at"] for lease in b_leases}
        keeper = b.worker_pid(0)
        os.kill(keeper, signal.SIGSTOP)
        taken: list[dict[str, Any]] = []
        try:
            b.wait_event("heartbeat_withheld", timeout_s=60)

            def a_grants_a_key_b_leased() -> bool:
                taken.extend(lease for lease in claim(a, 100, lease_s=5) if lease["key"] in ends)
                return bool(taken)

            wait_for(a_grants_a_key_b_leased, 120, "a to take over b's keys", 0.5)
        finally:
            os.kill(keeper, signal.SIGCONT)
        for lease in taken:
            assert granted_at(lease) > ends[lease["key"]], "granted while b's lease lived"
        b.wait_event("heartbeat_resumed", timeout_s=60)
        regained = claimed_from(b, 100)
        a_holds = {lease["key"]: lease["lease_expires_at"] for lease in taken}
        for lease in regained:
            if lease["key"] in a_holds:
                assert granted_at(lease) > a_holds[lease["key"]], "b granted a key a's lease held"
        recorded = read_journals(journal)
        assert double_holds(recorded) == []
        tokens = {f"{x.node}:{x.token}" for x in recorded}
        assert {x["token"] for x in b_leases + taken + regained} <= tokens
    finally:
        a.stop()
        b.stop()


def claimed_from(process: NodeProcess, count: int) -> list[dict[str, Any]]:
    """The first claim of 5-s leases that the node answers with some."""
    got: list[dict[str, Any]] = []

    def granted() -> bool:
        got.extend(claim(process, count, lease_s=5))
        return bool(got)

    wait_for(granted, 120, f"{process.extra_args[1]} to grant", 0.2)
    return got


def granted_at(lease: dict[str, Any]) -> int:
    """When the node granted the lease, by its own wall clock (one machine: one clock)."""
    return int(lease["lease_expires_at"]) - int(lease["lease_ms"])
