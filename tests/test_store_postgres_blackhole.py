"""A PostgreSQL that stops answering without closing anything (a blackhole) costs a
bounded wait, never a hang.

Every store connection carries TCP keepalives and `tcp_user_timeout` (a server or path
that vanished: checked on the socket) and a deadline of its own for each answer (a
server whose host still acknowledges but which does not answer). The proxy's blackhole
is of the second kind, its kernel acknowledging everything, so the deadline is what
ends each wait here. A statement on a blackholed connection fails with
StoreUnavailable, a new connection after the heal works, and a node keeps answering its
health and metrics endpoints through the blackhole and serves claims again after it. A
URL's own settings win over the store's.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pytest

from bench.harness.tcp_proxy import TcpProxy
from store.errors import StoreBusy, StoreUnavailable
from store.postgres import PostgresStore
from store.postgres.conn import (
    ANSWER_MARGIN_S,
    IDLE_IN_TRANSACTION_TIMEOUT_MS,
    KEEPALIVES_COUNT,
    KEEPALIVES_IDLE_S,
    KEEPALIVES_INTERVAL_S,
    LONG_STATEMENT_TIMEOUT_MS,
    STATEMENT_TIMEOUT_MS,
    TCP_USER_TIMEOUT_MS,
    connect,
    limit,
    long_statements,
    translated,
)
from store.rows import RowWrite

# Generous: the machine is shared. The point is that the wait ends, not how soon.
BOUND_S = 30.0


@pytest.fixture
def proxy() -> Iterator[TcpProxy]:
    found = TcpProxy("127.0.0.1", 5432).start()
    try:
        yield found
    finally:
        found.stop()


def through(proxy: TcpProxy, url: str) -> str:
    """`url` (its database, its options) reached through the proxy."""
    parts = urlsplit(url)
    return urlunsplit(
        parts._replace(netloc=f"{parts.username or 'postgres'}@127.0.0.1:{proxy.port}")
    )


def with_params(url: str, options: str = "", **params: str) -> str:
    """`url` with libpq `params` and server `options` beside its own."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if options:
        query["options"] = f"{query.get('options', '')} {options}".strip()
    query.update(params)
    return urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))


def tcp_option(conn: Any, level: int, option: int) -> int:
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        return int(sock.getsockopt(level, option))
    finally:
        sock.close()


def setting(conn: Any, name: str) -> int:
    """A timeout's value in ms, as the session has it."""
    found = conn.execute("SELECT setting FROM pg_settings WHERE name = %s", (name,)).fetchone()
    assert found is not None
    return int(found[0])


def failing_within(call: Any) -> tuple[type[BaseException], float]:
    started = time.monotonic()
    try:
        call()
    except (StoreUnavailable, StoreBusy) as exc:
        return type(exc), time.monotonic() - started
    raise AssertionError("the call succeeded through a blackhole")


def test_every_connection_is_bounded_and_the_urls_own_values_win(pg_url: str) -> None:
    with connect(pg_url) as conn:
        assert tcp_option(conn, socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert tcp_option(conn, socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVES_IDLE_S
        assert tcp_option(conn, socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == KEEPALIVES_INTERVAL_S
        assert tcp_option(conn, socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVES_COUNT
        assert tcp_option(conn, socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == TCP_USER_TIMEOUT_MS
        assert setting(conn, "statement_timeout") == STATEMENT_TIMEOUT_MS
        assert setting(conn, "idle_in_transaction_session_timeout") == (
            IDLE_IN_TRANSACTION_TIMEOUT_MS
        )
        assert conn.execute("SHOW jit").fetchone() == ("off",)
        assert conn.answer_timeout_s == STATEMENT_TIMEOUT_MS / 1000 + ANSWER_MARGIN_S
        # A long statement's timeout, and its deadline, last only for its block.
        with long_statements(conn):
            assert setting(conn, "statement_timeout") == LONG_STATEMENT_TIMEOUT_MS
            assert conn.answer_timeout_s == LONG_STATEMENT_TIMEOUT_MS / 1000 + ANSWER_MARGIN_S
        assert setting(conn, "statement_timeout") == STATEMENT_TIMEOUT_MS
        # A statement past its timeout is the store's StoreBusy, and the connection goes on.
        limit(conn, statement_timeout_ms=50)
        with pytest.raises(StoreBusy, match="past its timeout"), translated("sleep"):
            conn.execute("SELECT pg_sleep(2)")
        assert conn.execute("SELECT 1").fetchone() == (1,)

    url = with_params(
        pg_url,
        "-c statement_timeout=1234 -c idle_in_transaction_session_timeout=0",
        keepalives_idle="17",
        tcp_user_timeout="2500",
    )
    with connect(url) as conn:
        assert setting(conn, "statement_timeout") == 1234
        assert setting(conn, "idle_in_transaction_session_timeout") == 0
        found = conn.execute("SHOW search_path").fetchone()
        assert found is not None and found[0].startswith("t_")  # the fixture's option kept
        assert tcp_option(conn, socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 17
        assert tcp_option(conn, socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 2500
        assert conn.answer_timeout_s == 1.234 + ANSWER_MARGIN_S
        with long_statements(conn):  # not the store's to change
            assert setting(conn, "statement_timeout") == 1234


def test_a_waiting_writer_has_its_lock_wait_added_to_its_statement_timeout(
    pg_url: str,
) -> None:
    store = PostgresStore(pg_url, busy_timeout_s=7, prune_interval_s=None)
    try:
        state = store._state()
        waiting = store._conn(state, wait=True)
        assert setting(waiting, "statement_timeout") == 7000 + STATEMENT_TIMEOUT_MS
        assert setting(waiting, "lock_timeout") == 7000
        reading = store._conn(state, wait=None)
        assert setting(reading, "statement_timeout") == STATEMENT_TIMEOUT_MS
        assert setting(reading, "lock_timeout") == 7000  # a read takes no row locks
        assert setting(store._conn(state, wait=False), "lock_timeout") == 50
    finally:
        store.close()


def test_a_blackholed_statement_fails_in_bounded_time_and_a_new_connection_works_after(
    pg_url: str, proxy: TcpProxy
) -> None:
    PostgresStore(pg_url, prune_interval_s=None).close()  # the schema, made directly
    store = PostgresStore(through(proxy, pg_url), prune_interval_s=None)
    sub = store.subscribe("blackhole")
    try:
        assert store.get("/before") is None
        sub.poll()
        # Last, a writer that waits: its connection's long timeout is what a read ends.
        store.write([RowWrite(key="/before", route="page", next_render_at=1)])
        proxy.blackhole()

        failed, read_s = failing_within(lambda: store.get("/before"))
        assert failed is StoreUnavailable and read_s < BOUND_S
        row = RowWrite(key="/during", route="page", next_render_at=1)
        failed, write_s = failing_within(lambda: store.write([row]))
        assert failed is StoreUnavailable and write_s < BOUND_S
        failed, poll_s = failing_within(sub.poll)
        assert failed is StoreUnavailable and poll_s < BOUND_S
        print(
            f"through the blackhole: read {read_s:.1f} s, write {write_s:.1f} s, "
            f"feed poll {poll_s:.1f} s"
        )

        proxy.heal()
        assert store.get("/before") is not None  # on a new connection
        store.write([RowWrite(key="/after", route="page", next_render_at=1)])
        assert store.get("/after") is not None
    finally:
        proxy.heal()
        sub.close()
        store.close()


def timed_get(client: Any, path: str) -> tuple[int, float]:
    started = time.monotonic()
    response = client.get(path)
    return response.status_code, time.monotonic() - started


def test_a_node_answers_health_and_metrics_through_a_blackhole_and_claims_after(
    tmp_path: Path, pg_url: str, proxy: TcpProxy
) -> None:
    from node_harness import node_process, nodes_on, seed_rows, wait_for

    seed_rows(pg_url, 2000, due_share=1.0)
    with (
        nodes_on(lambda directory: through(proxy, pg_url)),
        node_process(tmp_path, workers=2) as node,
        node.client() as client,
    ):

        def claimed() -> bool:
            response = client.post("/v1/claims", json={"max": 5, "worker": "t"})
            return response.status_code == 200 and bool(response.json()["leases"])

        def gave_up() -> int:
            return sum("no answer from the server" in line for line in node.lines)

        wait_for(claimed, 60, "a claim with leases")
        # A fleet goes on claiming meanwhile: a claim that reads the store holds its
        # worker's event loop, and the health requests behind it, while it waits.
        stop = threading.Event()
        claims: list[tuple[int, float]] = []

        def claimant() -> None:
            with node.client() as own:
                while not stop.wait(0.1):
                    started = time.monotonic()
                    status = own.post("/v1/claims", json={"max": 5, "worker": "f"}).status_code
                    claims.append((status, time.monotonic() - started))

        fleet = threading.Thread(target=claimant, daemon=True)
        proxy.blackhole()
        blackholed_at = time.monotonic()
        fleet.start()
        probes: dict[str, list[tuple[int, float]]] = {}
        noticed = []

        def probed_for_15_s() -> bool:
            for path in ("/healthz", "/readyz", "/metrics"):
                probes.setdefault(path, []).append(timed_get(client, path))
            if gave_up():
                noticed.append(time.monotonic() - blackholed_at)
            return time.monotonic() - blackholed_at >= 15

        wait_for(probed_for_15_s, 15 + BOUND_S, "15 s of probes", 0.25)
        proxy.heal()
        stop.set()
        fleet.join(BOUND_S)

        slowest = {path: max(s for _, s in found) for path, found in probes.items()}
        statuses = {path: sorted({c for c, _ in found}) for path, found in probes.items()}
        print(
            f"during a 15 s blackhole: slowest answers {slowest}, statuses {statuses}, "
            f"the node first gave up on a connection at {noticed[0] if noticed else None} s, "
            f"slowest claim {max(c for _, c in claims):.1f} s of {len(claims)}"
        )
        assert all(s < BOUND_S for s in slowest.values()), (slowest, statuses)
        assert noticed, "the node never gave up on a store connection in the blackhole"
        wait_for(claimed, 60, "a claim with leases after the heal", 0.2)


class Pending:
    """A POST sent on a connection of its own, answered in a thread: `done` is set the
    moment its answer arrives."""

    def __init__(self, node: Any, path: str, body: dict[str, Any]) -> None:
        self.done = threading.Event()
        self.response: Any = None
        self.error: BaseException | None = None

        def send() -> None:
            try:
                with node.client() as own:
                    self.response = own.post(path, json=body)
            except BaseException as exc:  # surfaced by the test's own asserts
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def answered(self) -> Any:
        assert self.done.wait(BOUND_S + 30), "never answered"
        assert self.error is None, self.error
        return self.response


def test_health_readiness_and_metrics_answer_while_a_claim_waits_on_a_blackholed_store(
    tmp_path: Path, pg_url: str, proxy: TcpProxy
) -> None:
    """One worker, so every request is the same event loop's. A claim that must call the
    store (its worker's route book has gone stale) waits on the blackholed store on the
    worker's store lane, shown waiting by `/metrics`; `/healthz`, `/readyz`, `/metrics`
    and a renewal (shared memory only) are answered while it still waits. The claim, and a
    claim and a completion queued behind it, then answer 503 with Retry-After, and after
    the heal the node grants again and takes the completion. Ordering, not timing: each
    answer is checked to have arrived before the waiting claim's. The statement timeout is
    raised through the URL (the store's deadline follows it) to 15 s, so the claim waits
    long enough that a slow machine cannot blur the order."""
    from node_harness import metric_samples, node_process, nodes_on, seed_rows, wait_for

    seed_rows(pg_url, 2000, due_share=1.0)
    url = with_params(through(proxy, pg_url), "-c statement_timeout=15000")
    # A membership that outlives the blackhole: this test is of the worker's loop, not of
    # the cluster's view (a lapsed one answers claims 503 `unready` without the store).
    membership = ("--node-ttl-s", "90")
    with (
        nodes_on(lambda directory: url),
        node_process(tmp_path, workers=1, extra_args=membership) as node,
        node.client() as client,
    ):

        def claimed() -> list[dict[str, Any]]:
            response = client.post("/v1/claims", json={"max": 5, "worker": "t"})
            return response.json()["leases"] if response.status_code == 200 else []

        def lane(name: str) -> float:
            samples = metric_samples(client.get("/metrics").text)
            return samples.get(f'renderqueue_store_lane_{name}{{worker="0"}}', 0.0)

        held = wait_for(claimed, 60, "a claim with leases")[0]
        done = {"items": [{"key": held["key"], "token": held["token"], "outcome": "rendered"}]}
        proxy.blackhole()

        # A claim answers from the ring without the store until its worker's route book
        # (a second's cache) needs reading again: send claims until one waits on the store.
        first: Pending | None = None
        for attempt in range(20):
            claim = Pending(node, "/v1/claims", {"max": 5, "worker": f"a{attempt}"})

            def answered_or_waiting(claim: Pending = claim) -> bool:
                return claim.done.is_set() or lane("running_seconds") > 0

            wait_for(answered_or_waiting, BOUND_S, "the claim's answer or its store call", 0.02)
            if not claim.done.is_set():
                first = claim
                break
            response = claim.answered()
            assert response.status_code == 200, (
                f"a claim was answered ({response.status_code}) before /metrics showed it "
                f"waiting on the store: {response.text}"
            )
            time.sleep(0.2)
        assert first is not None, "no claim ever waited on the store"

        # The claim waits; the worker's loop answers everything that needs no store.
        answers: dict[str, int] = {}
        for path in ("/healthz", "/readyz", "/metrics"):
            answers[path] = client.get(path).status_code
            assert not first.done.is_set(), f"{path} was answered only after the claim"
        renew = {"items": [{"key": held["key"], "token": held["token"]}]}
        renewed = client.post("/v1/leases/renew", json=renew)
        assert not first.done.is_set(), "the renewal was answered only after the claim"
        assert answers["/healthz"] == 200 and answers["/metrics"] == 200, answers
        assert answers["/readyz"] in (200, 503), answers  # the keeper's feed waits too
        assert renewed.status_code == 200 and renewed.json()["results"][0]["ok"], renewed.text

        # A claim (its route book still stale) and a completion queue behind the first.
        second = Pending(node, "/v1/claims", {"max": 5, "worker": "b"})
        completion = Pending(node, "/v1/completions", done)
        wait_for(
            lambda: second.done.is_set() or completion.done.is_set() or lane("pending") >= 3,
            BOUND_S,
            "a claim and a completion queued on the lane",
            0.02,
        )
        assert not first.done.is_set()

        for request in (first, second, completion):
            response = request.answered()
            assert response.status_code == 503, response.text
            assert response.headers["retry-after"] == "1"
            assert response.json()["title"] == "Store unavailable"
        assert lane("shed_total") >= 2, "the queued calls were tried one by one"

        proxy.heal()
        wait_for(claimed, 60, "a claim with leases after the heal", 0.2)
        completed = client.post("/v1/completions", json=done)
        assert completed.status_code == 200 and completed.json()["results"][0]["ok"]
