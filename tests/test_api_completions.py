"""The completion queue: a held write lock is waited for on the event loop, which goes on
serving; completions that arrive meanwhile commit together, each answered with its own
results; a timeout or a cancelled request changes nothing.

The lock is held by another SQLite connection (BEGIN IMMEDIATE), as another worker's
transaction holds it; the HTTP path and the multi-process races are in test_api_claims.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from node_harness import local_node, now_ms, publish_with_cadence, seed_rows

from api.claims import grant_from_ring
from api.completions import CompletionQueue, apply
from api.problems import ApiError
from shm import key_hash
from store.errors import StoreBusy
from wire.schemas import CompletionItem, CompletionsRequest, Lease


@pytest.fixture
def node_with_leases(tmp_path: Path) -> Iterator[tuple[Any, Any, Any, list[Lease], Path]]:
    db = tmp_path / "node.sqlite"
    keys = seed_rows(db, 6)
    with local_node(db) as (node, store, segments):
        publish_with_cadence(node, keys, 3600)
        leases = grant_from_ring(node, 6, 60_000)
        assert len(leases) == 6
        yield node, store, segments, leases, db


def queue_of(node: Any, **options: Any) -> CompletionQueue:
    """The node's completion queue as the app builds it (api.app.build_services)."""
    return CompletionQueue(
        commit=lambda requests: apply(node, requests, wait=False), lane=node.lane, **options
    )


def request(leases: list[Lease], outcome: str = "rendered") -> CompletionsRequest:
    return CompletionsRequest(
        items=[CompletionItem(key=x.key, token=x.token, outcome=outcome) for x in leases]  # type: ignore[arg-type]
    )


def hold_write_lock(db: Path) -> sqlite3.Connection:
    holder = sqlite3.connect(db, isolation_level=None, timeout=0)
    holder.execute("BEGIN IMMEDIATE")
    return holder


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait on the loop for `condition`, well inside the queue's busy timeout."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def is_due(store: Any, key: str) -> bool:
    row = store.get(key)
    return row is not None and row.next_render_at <= now_ms()


def test_without_contention_a_request_commits_at_once(node_with_leases: Any) -> None:
    node, store, _, leases, _ = node_with_leases
    queue = queue_of(node)
    answer = asyncio.run(queue.complete(request(leases[:3])))
    assert [r.ok for r in answer.results] == [True, True, True]
    assert not any(is_due(store, x.key) for x in leases[:3])
    stats = queue.statistics()
    assert (stats.requests, stats.waited, stats.transactions, stats.busy_attempts) == (1, 0, 1, 0)


def test_a_held_lock_is_waited_for_on_the_loop_and_waiting_requests_commit_together(
    node_with_leases: Any,
) -> None:
    node, store, segments, leases, db = node_with_leases
    queue = queue_of(node)

    async def scenario() -> tuple[list[Any], int, int]:
        holder = hold_write_lock(db)
        ticks = 0

        async def ticker() -> None:  # stands for the claims the worker goes on serving
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        ticking = asyncio.create_task(ticker())
        first = asyncio.create_task(queue.complete(request(leases[:2])))
        second = asyncio.create_task(queue.complete(request(leases[2:5], outcome="failed")))
        # Both wait on the lock; from then the loop must go on ticking between the queue's
        # attempts on it, however slowly the machine runs.
        await until(lambda: queue.statistics().waited == 2, "both requests waiting")
        start, attempts = ticks, queue.statistics().busy_attempts
        await until(
            lambda: ticks - start >= 10 and queue.statistics().busy_attempts > attempts,
            "ticks and another attempt on the lock",
        )
        assert not first.done() and not second.done()
        ticks_while_locked = ticks - start
        holder.execute("COMMIT")
        holder.close()
        answers = [await first, await second]
        ticking.cancel()
        return answers, ticks_while_locked, ticks

    (first, second), ticks_while_locked, _ = asyncio.run(scenario())
    assert ticks_while_locked >= 10  # the loop was never blocked on the lock
    assert [r.key for r in first.results] == [x.key for x in leases[:2]]
    assert [r.key for r in second.results] == [x.key for x in leases[2:5]]
    assert all(r.ok for r in first.results + second.results)
    assert not any(is_due(store, x.key) for x in leases[:2])  # rendered: rescheduled
    assert all(is_due(store, x.key) for x in leases[2:5])  # failed: still due
    assert all(store.get(x.key).last_outcome == "failed" for x in leases[2:5])
    for x in leases[:5]:  # every lease released
        assert not segments.leases.state(key_hash(x.key.encode()), now_ms()).leased
    stats = queue.statistics()
    assert (stats.requests, stats.waited, stats.joined, stats.transactions) == (2, 2, 2, 1)
    assert stats.busy_attempts >= 2


def test_a_key_in_two_waiting_requests_is_completed_once(node_with_leases: Any) -> None:
    node, store, _, leases, db = node_with_leases
    queue = queue_of(node)
    head = store.statistics().head

    async def scenario() -> list[Any]:
        holder = hold_write_lock(db)
        first = asyncio.create_task(queue.complete(request(leases[:2])))
        again = asyncio.create_task(queue.complete(request(leases[:1])))  # a client's retry
        await until(lambda: queue.statistics().waited == 2, "both requests waiting")
        holder.execute("COMMIT")
        holder.close()
        return [await first, await again]

    first, again = asyncio.run(scenario())
    assert [r.ok for r in first.results] == [True, True]
    assert [(r.ok, r.error) for r in again.results] == [(False, "lease_not_held")]
    assert store.statistics().head == head + 2  # two rows written, the repeated one once


def test_a_lock_held_past_the_timeout_changes_nothing(node_with_leases: Any) -> None:
    node, store, segments, leases, db = node_with_leases
    queue = queue_of(node, busy_timeout_s=0.05)
    before = {x.key: store.get(x.key) for x in leases[:2]}

    async def scenario() -> None:
        holder = hold_write_lock(db)
        try:
            with pytest.raises(StoreBusy, match="nothing was written"):
                await queue.complete(request(leases[:2]))
        finally:
            holder.execute("ROLLBACK")
            holder.close()

    asyncio.run(scenario())
    assert {x.key: store.get(x.key) for x in leases[:2]} == before
    for x in leases[:2]:  # still leased: the renderer may retry with the same token
        assert segments.leases.state(key_hash(x.key.encode()), now_ms()).leased
    assert queue.statistics().timed_out == 1
    (answer,) = apply(node, [request(leases[:2])], wait=True)
    assert all(r.ok for r in answer.results)


def test_a_cancelled_request_is_left_out(node_with_leases: Any) -> None:
    """A client that hung up while its request waited: its leases stay held, its rows
    untouched; the requests behind it commit."""
    node, store, segments, leases, db = node_with_leases
    queue = queue_of(node)

    async def scenario() -> Any:
        holder = hold_write_lock(db)
        gone = asyncio.create_task(queue.complete(request(leases[:2])))
        kept = asyncio.create_task(queue.complete(request(leases[2:4])))
        await until(lambda: queue.statistics().waited == 2, "both requests waiting")
        gone.cancel()
        await asyncio.sleep(0.01)
        holder.execute("COMMIT")
        holder.close()
        return await kept

    kept = asyncio.run(scenario())
    assert all(r.ok for r in kept.results)
    assert all(is_due(store, x.key) for x in leases[:2])
    for x in leases[:2]:
        assert segments.leases.state(key_hash(x.key.encode()), now_ms()).leased
    assert queue.statistics().requests == 1


def test_a_key_the_store_would_refuse_is_422_before_anything_waits(
    node_with_leases: Any,
) -> None:
    node, _, _, leases, db = node_with_leases
    queue = queue_of(node)
    too_long = "/" + "é" * 1500  # 1,501 characters, 3,001 UTF-8 bytes
    bad = CompletionsRequest(items=[CompletionItem(key=too_long, token="1", outcome="rendered")])

    async def scenario() -> None:
        holder = hold_write_lock(db)
        waiting = asyncio.create_task(queue.complete(request(leases[:1])))
        await until(lambda: queue.statistics().waited == 1, "the request waiting")
        with pytest.raises(ApiError) as refused:
            await queue.complete(bad)
        assert refused.value.status == 422 and "UTF-8 bytes" in str(refused.value.detail)
        holder.execute("COMMIT")
        holder.close()
        assert (await waiting).results[0].ok

    asyncio.run(scenario())
    assert queue.statistics().waited == 1


@pytest.mark.parametrize(
    "token",
    ["", "12a", "-1", "１２", "1" * 21, "node a:1", "n" * 65 + ":1", "node-a:", ":1"],
)
def test_a_token_off_its_pattern_is_422_naming_the_item_and_changes_nothing(
    node_with_leases: Any, token: str
) -> None:
    node, store, _, leases, _ = node_with_leases
    queue = queue_of(node)
    good = [CompletionItem(key=x.key, token=x.token, outcome="rendered") for x in leases[:2]]
    bad = CompletionItem(key=leases[2].key, token=token, outcome="rendered")
    with pytest.raises(ApiError) as refused:
        asyncio.run(queue.complete(CompletionsRequest(items=[*good, bad])))
    assert refused.value.status == 422
    assert refused.value.field == "$.items[2].token"
    assert all(is_due(store, x.key) for x in leases[:3])
    assert all(node.leases.holds(key_hash(x.key.encode()), int(x.token), now_ms()) for x in leases)


def test_a_token_on_its_pattern_passes_the_check(node_with_leases: Any) -> None:
    node, _, _, leases, _ = node_with_leases
    # Well formed but never granted (another node's, a bare number): not held, not a 422.
    items = [
        CompletionItem(key=leases[0].key, token="18446744073709551615", outcome="rendered"),
        CompletionItem(key=leases[1].key, token="node-b.x_1:42", outcome="rendered"),
    ]
    answer = asyncio.run(queue_of(node).complete(CompletionsRequest(items=items)))
    assert [(r.ok, r.error) for r in answer.results] == [(False, "lease_not_held")] * 2
