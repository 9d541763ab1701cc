"""The supervisor with real worker processes: kills, respawns, a keeper that reloads, and
clean exits that leave no shared memory behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from node_harness import (
    REPO,
    NodeProcess,
    claim_answered,
    claims_waiting,
    due_in_table,
    metric_samples,
    metric_total,
    node_db,
    node_process,
    nodes_on,
    now_ms,
    readme_series,
    seed_rows,
    unique,
    wait_for,
)
from test_api_report import a_report

from api.report import MAX_REPORT_BYTES, encode_report_line
from workers.config import MAX_WORKERS
from workers.segments import SUPERVISOR_STATE_BYTES, SegmentNames
from workers.supervisor import SupervisorStatistics, WorkerStatistics


def segment_files(instance: str) -> list[Path]:
    names = SegmentNames.for_instance(instance)
    return [
        Path("/dev/shm") / name.lstrip("/")
        for name in (names.ring, names.leases, names.state, names.supervisor, names.keeper)
    ]


def claim(node: NodeProcess, n: int, wait_s: float = 0) -> list[dict[str, Any]]:
    """`wait_s`: long-poll for the keeper's next publish when nothing is claimable yet."""
    with node.client() as client:
        answer = claim_answered(client, {"max": n, "worker": "t", "wait_s": wait_s})
    leases: list[dict[str, Any]] = answer["leases"]
    return leases


def claim_while_keeper_down(node: NodeProcess, n: int) -> list[dict[str, Any]]:
    """A claim while worker 0 is down: worker 1 grants from the last published set, which a
    node on SQLite drains; a clustered node (PostgreSQL) grants from it only within the
    stall limit (its keys may have moved to another node), then answers 503 `stalled` until
    the new keeper publishes."""
    clustered = str(node.db).startswith("postgresql")
    deadline = time.monotonic() + 90
    while True:
        with node.client() as client:
            response = client.post("/v1/claims", json={"max": n, "worker": "t"})
        if response.status_code == 200:
            leases: list[dict[str, Any]] = response.json()["leases"]
            return leases
        assert clustered, response.text
        assert response.status_code == 503 and response.json()["status"] == "stalled"
        assert response.headers["retry-after"]
        assert time.monotonic() < deadline, "the new keeper never published"
        time.sleep(0.2)


def exact_queue_state(node: NodeProcess) -> Any:
    with node.client() as client:
        response = client.get("/prerender_admin/queue-state")
    if response.status_code != 200:
        return None
    state = response.json()
    return state if state["now"]["due"] == due_in_table(node.db, now_ms()) else None


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def connection_counts(node: NodeProcess, connections: int) -> Counter[int]:
    """Which worker (pid) served each of `connections` new connections."""
    counts: Counter[int] = Counter()
    for _ in range(connections):
        with socket.create_connection(("127.0.0.1", node.port)) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        counts[int(json.loads(reply.partition(b"\r\n\r\n")[2])["pid"])] += 1
    return counts


def test_worker_0_gets_a_smaller_share_of_connections(tmp_path: Path) -> None:
    with node_process(tmp_path, workers=2) as node:
        assert all(path.exists() for path in segment_files(node.instance))
        counts = connection_counts(node, 300)
    zero, one = counts[node.worker_pid(0)], counts[node.worker_pid(1)]
    # Worker 0 has one listener, worker 1 two: about 100 against 200.
    assert zero + one == 300 and 0 < zero < one


def test_one_shared_listener_serves_every_worker(tmp_path: Path) -> None:
    """Which worker wins a shared listener's accept is up to the scheduler, so each worker in
    turn is stopped: with one socket between them, the other takes every connection."""
    with node_process(tmp_path, workers=2, extra_args=("--reuse-port", "false")) as node:
        for stopped, serving in ((0, 1), (1, 0)):
            os.kill(node.worker_pid(stopped), signal.SIGSTOP)
            try:
                counts = connection_counts(node, 20)
            finally:
                os.kill(node.worker_pid(stopped), signal.SIGCONT)
            assert counts == {node.worker_pid(serving): 20}


def metric(node: NodeProcess, name: str) -> float | None:
    """One unlabelled series from the node's `/metrics`; None when it is not served."""
    with node.client() as client:
        text = client.get("/metrics").text
    return metric_samples(text).get(name)


def test_the_wal_series_show_a_reader_holding_checkpoints_back(tmp_path: Path) -> None:
    """The supervisor reads the WAL's length every second. While a reader keeps an old
    snapshot, no checkpoint can copy the pages written after it; once it lets go, the
    node's own checkpoints catch up after its next write."""
    uncheckpointed = "renderqueue_sqlite_wal_uncheckpointed_frames"
    seed_rows(node_db(tmp_path), 10)
    with node_process(tmp_path, workers=1) as node:
        wait_for(lambda: metric(node, "renderqueue_sqlite_wal_file_bytes"), 30, "the WAL series")
        reader = sqlite3.connect(node.db, isolation_level=None)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM render_schedule").fetchone()
            with node.client() as client:
                for batch in range(5):
                    upsert = [{"key": f"held-{batch}-{i}", "route": "r"} for i in range(200)]
                    response = client.post("/v1/schedule", json={"upsert": upsert})
                    assert response.status_code == 200, response.text
            held = wait_for(lambda: metric(node, uncheckpointed), 30, "uncheckpointed frames")
            frames = metric(node, "renderqueue_sqlite_wal_frames")
            assert frames is not None and 0 < held <= frames

            def checkpoints() -> float:
                with node.client() as client:
                    return metric_total(client, "renderqueue_sqlite_checkpoints_total")

            # A further write, the checkpoint round after it and the WAL read after that:
            # the reader's snapshot still keeps every page written since from the database.
            rounds = checkpoints()
            with node.client() as client:
                client.post("/v1/schedule", json={"upsert": [{"key": "held-more", "route": "r"}]})
            wait_for(
                lambda: (
                    checkpoints() > rounds
                    and (metric(node, "renderqueue_sqlite_wal_frames") or 0) > frames
                ),
                30,
                "a checkpoint round and a WAL reading after a further write",
            )
            assert (metric(node, uncheckpointed) or 0) >= held
        finally:
            reader.execute("COMMIT")
            reader.close()

        # A write after the reader let go starts a checkpoint round. Another write only once
        # a round has run since the last one: the checkpoints run at idle priority, and a
        # write every turn could add frames faster than a saturated machine copies them.
        written_at = -1.0

        def caught_up() -> bool:
            nonlocal written_at
            if metric(node, uncheckpointed) == 0:
                return True
            rounds = checkpoints()
            if rounds > written_at:
                with node.client() as client:
                    after = {"upsert": [{"key": "after", "route": "r"}]}
                    assert client.post("/v1/schedule", json=after).status_code == 200
                written_at = rounds
            return False

        wait_for(caught_up, 60, "the checkpoints to catch up once the reader let go", 0.5)
        named = {n for n in readme_series()[0] if n.startswith("renderqueue_sqlite_wal_")}
        assert named == {n for n in named if metric(node, n) is not None} != set()


def test_the_largest_supervisor_record_fits_its_segment() -> None:
    """The most workers, each with a report as long as one pipe write carries."""
    padding = MAX_REPORT_BYTES
    while (line := encode_report_line(a_report(reason="x" * padding))) is None:
        padding -= 16
    assert len(line) > MAX_REPORT_BYTES - 16
    report = a_report(reason="x" * padding)
    record = SupervisorStatistics(
        pid=1,
        node="n" * 64,
        instance="i" * 64,
        host="h" * 255,
        port=8080,
        state="running",
        started_at=1,
        written_at=2,
        restarts=0,
        boot_failures=0,
        lease_sweeps=0,
        lease_slots_reclaimed=0,
        workers=[
            WorkerStatistics(
                index=index,
                state="ready",
                pid=index,
                started_at=1,
                restarts=10**6,
                boot_failures=10**6,
                last_exit="killed by signal SIGKILL " * 4,
                report=report,
                bad_reports=10**6,
            )
            for index in range(MAX_WORKERS)
        ],
    )
    assert len(msgspec.msgpack.encode(record)) < SUPERVISOR_STATE_BYTES - 32 * 1024


def per_worker(node: NodeProcess, name: str) -> dict[int, float]:
    """A series labelled by worker, from whichever worker answers."""
    with node.client() as client:
        samples = metric_samples(client.get("/metrics").text)
    found = (re.fullmatch(name + r'\{worker="(\d+)"\}', key) for key in samples)
    return {int(m.group(1)): samples[m.group(0)] for m in found if m}


def test_each_workers_counts_are_served_whichever_worker_answers(tmp_path: Path) -> None:
    """Every worker reports its own counts to the supervisor about once a second: a
    scrape answered by either worker serves both, and a restarted worker counts anew.
    One listener between the workers, so a stopped worker's share goes to the other."""
    # Rows, not transactions: a worker's store also commits upkeep (raising the log's
    # floor) on its own clock, which writes no rows.
    rows_written = "renderqueue_store_rows_written_total"
    seed_rows(node_db(tmp_path), 10)
    with node_process(tmp_path, workers=2, extra_args=("--reuse-port", "false")) as node:

        def both(name: str) -> dict[int, float] | None:
            served = per_worker(node, name)
            return served if len(served) == 2 else None

        # Until each worker's first report reaches the supervisor's record, a worker serves
        # only its own counts.
        before: dict[int, float] = wait_for(lambda: both(rows_written), 30, "both reports")
        writes = 20
        for stopped in (0, 1):  # each worker in turn takes every write
            os.kill(node.worker_pid(stopped), signal.SIGSTOP)
            try:
                for i in range(writes):
                    with node.client() as client:
                        upsert = [{"key": f"https://w.example/{stopped}/{i}", "route": "r"}]
                        response = client.post("/v1/schedule", json={"upsert": upsert})
                        assert response.status_code == 200, response.text
            finally:
                os.kill(node.worker_pid(stopped), signal.SIGCONT)
        expected = {index: before[index] + writes for index in (0, 1)}
        wait_for(
            lambda: per_worker(node, rows_written) == expected,
            30,
            f"each worker's {writes} writes in its report",
            0.2,
        )
        # The same counts from either worker: with one stopped, the other serves the
        # stopped one's last report, which ages meanwhile. The counts above may have come
        # from the worker's own live answer before its report carried them: it is stopped
        # only once the other serves its report whole (else let run on, to report again).
        for stopped in (0, 1):

            def stopped_with_its_report_served(stopped: int = stopped) -> bool:
                os.kill(node.worker_pid(stopped), signal.SIGSTOP)
                served = False
                try:
                    served = per_worker(node, rows_written) == expected
                finally:
                    if not served:
                        os.kill(node.worker_pid(stopped), signal.SIGCONT)
                return served

            wait_for(stopped_with_its_report_served, 30, f"worker {stopped}'s report served", 0.2)
            try:

                def aged(stopped: int = stopped) -> dict[int, float] | None:
                    assert per_worker(node, rows_written) == expected
                    age = per_worker(node, "renderqueue_worker_report_age_seconds")
                    return age if age[stopped] >= 1.0 else None

                age = wait_for(aged, 30, f"worker {stopped}'s report a second old", 0.2)
                assert age[stopped] > age[1 - stopped], age
            finally:
                os.kill(node.worker_pid(stopped), signal.SIGCONT)
        for name in ("renderqueue_store_writable", "renderqueue_sqlite_busy_retries_total"):
            assert set(per_worker(node, name)) == {0, 1}, name
        # A restarted worker is a new process: its report starts from zero.
        os.kill(node.worker_pid(1), signal.SIGKILL)
        wait_for(
            lambda: (
                per_worker(node, "renderqueue_worker_restarts_total").get(1) == 1
                and per_worker(node, rows_written).get(1) == 0
            ),
            60,
            "worker 1 restarted and reporting anew",
            0.2,
        )
        assert per_worker(node, rows_written)[0] == expected[0]


def test_every_worker_serves_the_keepers_statistics(tmp_path: Path) -> None:
    """The keeper runs in worker 0; worker 1 reads its record from shared memory."""
    seed_rows(tmp_path / "node.sqlite", 10)
    with node_process(tmp_path, workers=2) as node:
        wait_for(lambda: exact_queue_state(node), 60, "an exact queue-state")
        seen: dict[int, dict[str, Any]] = {}

        def from_both_workers() -> bool:
            with node.client() as client:  # a new connection: either worker may take it
                overview = client.get("/prerender_admin/overview").json()
                metrics = client.get("/metrics").text
            keeper = overview.get("keeper")
            if (
                keeper
                and keeper["phase"] == "live"
                and "renderqueue_keeper_feed_events_total" in metrics
            ):
                seen[overview["worker"]] = keeper
            return len(seen) == 2

        wait_for(from_both_workers, 30, "the keeper's record from both workers", 0.01)
    for keeper in seen.values():
        assert keeper["held"] == 10 and keeper["feed"] is not None
        assert keeper["statistics_write_failures"] == 0


def test_the_supervisor_sweeps_dead_lease_slots(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 10)
    with (
        node_process(tmp_path, workers=1, extra_args=("--lease-sweep-interval-s", "0.5")) as node,
        node.client() as client,
    ):
        wait_for(lambda: client.get("/readyz").status_code == 200, 60, "readiness")
        leases = client.post("/v1/claims", json={"max": 5, "worker": "t"}).json()["leases"]
        items = [{"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in leases]
        assert all(
            r["ok"] for r in client.post("/v1/completions", json={"items": items}).json()["results"]
        )

        def swept() -> Any:
            overview = client.get("/prerender_admin/overview").json()
            done = (
                overview["leases"]["occupied"] == 0
                and overview["supervisor"]["lease_slots_reclaimed"] >= 5
            )
            return overview if done else None

        overview = wait_for(swept, 30, "the completed leases' slots to be reclaimed", 0.2)
        assert overview["supervisor"]["lease_sweeps"] >= 2


@pytest.mark.usefixtures("node_backend")
def test_sigkill_worker_0_claims_go_on_and_the_new_keeper_reloads(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 3000, due_share=0.5)
    with node_process(tmp_path, workers=2) as node:
        wait_for(lambda: exact_queue_state(node), 60, "an exact queue-state")
        first = claim(node, 50)
        assert len(first) == 50
        old = node.worker_pid(0)
        os.kill(old, signal.SIGKILL)
        # While worker 0 is down, worker 1 still grants from the last published ring.
        while_down = claim_while_keeper_down(node, 50)
        assert len(while_down) == 50
        assert not {lease["key"] for lease in first} & {lease["key"] for lease in while_down}
        node.wait_event("worker_started", worker=0, after=1, timeout_s=30)
        node.wait_event("worker_ready", worker=0, after=1, timeout_s=60)
        assert node.worker_pid(0) != old
        # The new keeper reloads from the table and vouches for exact numbers again; the
        # leases granted before the kill are still honoured by the lease table.
        state = wait_for(lambda: exact_queue_state(node), 60, "an exact queue-state again")
        assert state["now"]["in_flight"] == 100
        with node.client() as client:
            items = [
                {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
                for lease in first + while_down
            ]
            results = client.post("/v1/completions", json={"items": items}).json()["results"]
        assert all(result["ok"] for result in results)
        again = claim(node, 1000)
        assert not {lease["key"] for lease in again} & {
            lease["key"] for lease in first + while_down
        }


def test_sigkill_a_sibling_it_is_respawned(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 100)
    with node_process(tmp_path, workers=3) as node:
        victim = node.worker_pid(2)
        os.kill(victim, signal.SIGKILL)
        node.wait_event("worker_started", worker=2, after=1, timeout_s=30)
        node.wait_event("worker_ready", worker=2, after=1, timeout_s=60)
        assert node.worker_pid(2) != victim
        assert not is_alive(victim)
        with node.client() as client:
            workers = client.get("/prerender_admin/overview").json()["supervisor"]["workers"]
        assert workers[2]["restarts"] == 1
        assert workers[2]["pid"] == node.worker_pid(2)
        assert [w["restarts"] for w in workers[:2]] == [0, 0]


def test_sigterm_finishes_requests_in_flight_and_unlinks(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 10, due_share=0.0)
    with node_process(tmp_path, workers=2) as node:
        wait_for(lambda: exact_queue_state(node), 60, "an exact queue-state")
        files = segment_files(node.instance)
        pids = [node.worker_pid(0), node.worker_pid(1)]
        outcome: dict[str, Any] = {}

        def long_poll() -> None:
            with httpx.Client(base_url=node.url, timeout=30) as client:
                response = client.post("/v1/claims", json={"max": 1, "worker": "t", "wait_s": 10})
                outcome["status"] = response.status_code
                outcome["body"] = response.json()

        poller = threading.Thread(target=long_poll)
        poller.start()
        # The gauge is as of each worker's last report (every second): the poll outlasts it.
        with node.client() as client:
            wait_for(lambda: claims_waiting(client), 30, "the long poll to be in flight")
        node.signal(signal.SIGTERM)
        poller.join(30)
        # Answered, not cut: "nothing due" (200), or, when worker 0 (the keeper) finished
        # first, a claim status saying the node cannot grant now (503, retry): its last
        # publish aged past the stall limit, or (seen once under load) no publish read.
        assert outcome["status"] in (200, 503), outcome
        if outcome["status"] == 200:
            assert outcome["body"] == {"leases": [], "status": "ready"}
        else:
            body = outcome["body"]
            assert body["status"] in ("stalled", "unready") and body["retry_after_s"], body
        assert node.wait(60) == 0
        assert node.find_events("stopping", mode="graceful")
        assert node.find_events("segments_unlinked")
        assert not any(path.exists() for path in files)
        assert not any(is_alive(pid) for pid in pids)


def test_sigint_stops_quickly_and_unlinks(tmp_path: Path) -> None:
    with node_process(tmp_path, workers=2) as node:
        files = segment_files(node.instance)
        node.signal(signal.SIGINT)
        assert node.wait(30) == 0
        assert node.find_events("stopping", mode="quick")
        assert not any(path.exists() for path in files)


def test_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    with node_process(tmp_path, workers=1) as first:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "workers.cli",
                "serve",
                "--db",
                str(tmp_path / "other.sqlite"),
                "--port",
                str(first.port),
                "--instance",
                unique("tp"),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert '"event":"listen_failed"' in done.stderr
    assert f":{first.port}" in done.stderr


def test_a_malformed_hash_secret_stops_the_start(tmp_path: Path) -> None:
    """Workers hashing under a secret no other node has would split a cluster's keys and
    find no restored lease: the node refuses to start, naming it."""
    import sqlite3

    db = tmp_path / "node.sqlite"
    seed_rows(db, 10)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("UPDATE hash_secret SET secret = ?", (b"too short",))
    conn.close()
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "serve", "--db", str(db), "--port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    failed = [json.loads(line) for line in done.stderr.splitlines() if "start_failed" in line]
    assert failed and "hash secret" in failed[0]["error"] and "9 bytes" in failed[0]["error"]


def test_a_sigkilled_nodes_segments_are_removed_by_name(tmp_path: Path) -> None:
    with node_process(tmp_path, workers=1) as node:
        files = segment_files(node.instance)
        node.signal(signal.SIGKILL)
        node.wait(30)
        assert all(path.exists() for path in files)  # nothing unlinked them
        SegmentNames.for_instance(node.instance).remove()
        assert not any(path.exists() for path in files)
        SegmentNames.for_instance(node.instance).remove()  # already gone is fine


@pytest.mark.usefixtures("node_backend")
def test_a_completion_answered_ok_survives_a_sigkill_of_the_whole_node(tmp_path: Path) -> None:
    """`ok: true` is said only after the commit: every process of the node SIGKILLed the
    moment the answer arrives loses none of it, and a restarted node does not hand the
    keys out again."""
    seed_rows(node_db(tmp_path), 2000, due_share=0.5)
    node = NodeProcess(tmp_path, workers=2).start()
    try:
        wait_for(lambda: exact_queue_state(node), 60, "an exact queue-state")
        leases = claim(node, 200, wait_s=10)
        assert len(leases) == 200
        items = [
            {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
            for lease in leases
        ]
        with node.client() as client:
            answer = client.post("/v1/completions", json={"items": items})
        workers = [node.worker_pid(i) for i in range(2)]
        node.signal(signal.SIGKILL)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        node.wait(30)
        assert answer.status_code == 200, answer.text
        assert all(result["ok"] for result in answer.json()["results"])
    except BaseException:
        node.stop()
        raise
    # Its segments are left as the kill left them: the restart takes its lease table over
    # (without it, a restart must fence its whole share while a lease of its may live).
    completed = {lease["key"] for lease in leases}
    rows = stored_rows(node_db(tmp_path), sorted(completed))
    now = now_ms()
    assert set(rows) == completed
    assert all(row.last_outcome == "rendered" for row in rows.values())
    assert all(row.next_render_at > now for row in rows.values())
    # The same instance: on PostgreSQL the killed node is still a live member by name.
    with node_process(tmp_path, workers=2, instance=node.instance) as again:
        wait_for(lambda: exact_queue_state(again), 60, "an exact queue-state after the restart")
        regranted = claim(again, 1000)
        assert len(regranted) == 800  # every other due row, none of the completed
        assert not completed & {lease["key"] for lease in regranted}


def test_completions_gathered_when_their_writer_is_sigkilled_fail_and_change_nothing(
    tmp_path: Path,
) -> None:
    """A worker's completions wait together for the write lock (here held by another
    connection); SIGKILLed with them gathered and uncommitted, every waiting request ends
    in an error, never `ok: true`, none of them reached the table, and the leases stay
    held by their tokens for a retry."""
    db = tmp_path / "node.sqlite"
    seed_rows(db, 400, due_share=1.0)
    # SQLite whichever backend the module's other tests are on: the lock is SQLite's.
    with (
        nodes_on(lambda directory: str(directory / "node.sqlite")),
        node_process(tmp_path, workers=2) as node,
    ):
        wait_for(lambda: exact_queue_state(node), 60, "an exact queue-state")
        leases = claim(node, 60, wait_s=10)
        assert len(leases) == 60
        before = stored_rows(db, [x["key"] for x in leases])
        victim = node.worker_pid(1)
        *clients, watcher = clients_of(node, victim, 4)
        holder = sqlite3.connect(db, isolation_level=None, timeout=0)
        holder.execute("BEGIN IMMEDIATE")  # as another writer's transaction would
        outcomes: list[Any] = []

        def complete(client: httpx.Client, part: list[dict[str, Any]]) -> None:
            items = [{"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in part]
            try:
                outcomes.append(client.post("/v1/completions", json={"items": items}))
            except httpx.HTTPError as exc:
                outcomes.append(exc)

        # Each on its own connection to the victim, where it waits behind the held lock.
        senders = [
            threading.Thread(target=complete, args=(client, leases[20 * i : 20 * i + 20]))
            for i, client in enumerate(clients)
        ]
        for sender in senders:
            sender.start()

        def gathered() -> bool:
            overview = watcher.get("/prerender_admin/overview").json()
            queue = overview["completions"]
            return bool(queue["waited"] == 3 and queue["requests"] == 0)

        wait_for(gathered, 30, "the three requests waiting in the victim's queue", 0.1)
        os.kill(victim, signal.SIGKILL)
        for sender in senders:
            sender.join(30)
        for client in [*clients, watcher]:
            client.close()
        holder.execute("ROLLBACK")
        holder.close()
        assert len(outcomes) == 3
        for outcome in outcomes:
            ok = isinstance(outcome, httpx.Response) and outcome.status_code == 200
            assert not ok or not any(r["ok"] for r in outcome.json()["results"]), outcome
        assert stored_rows(db, list(before)) == before
        node.wait_event("worker_ready", worker=1, after=1, timeout_s=60)
        wait_for(lambda: exact_queue_state(node), 60, "an exact queue-state again")
        with node.client() as client:
            items = [{"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in leases]
            results = client.post("/v1/completions", json={"items": items}).json()["results"]
        assert all(result["ok"] for result in results)


def stored_rows(db: Path | str, keys: list[str]) -> dict[str, Any]:
    """The rows of `keys` as the store holds them, read through a store of its own."""
    from store import open_store

    store = open_store(str(db))
    try:
        return store.get_many(keys)
    finally:
        store.close()


def clients_of(node: NodeProcess, pid: int, count: int) -> list[httpx.Client]:
    """`count` keep-alive clients whose connection the worker `pid` serves."""
    found: list[httpx.Client] = []
    for _ in range(100):
        client = node.client()
        if int(client.get("/healthz").json()["pid"]) == pid:
            found.append(client)
            if len(found) == count:
                return found
        else:
            client.close()
    raise AssertionError(f"no {count} connections reached worker {pid}")
