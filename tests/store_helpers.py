"""Shared by the store's contract tests, which run on both backends: a store opened from
its URL, and the few reads every backend offers beside store.base's protocol."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from store.base import Cursor, ScheduleStore, Subscription
from store.postgres import PostgresStore
from store.rows import RowEvent, RowWrite
from store.sqlite import SqliteStore

SETTLE_PROBE = "settle-probe"


class ContractStore(ScheduleStore, Protocol):
    """What both backends offer beside ScheduleStore: consumers, pruning, statistics."""

    def consumers(self) -> dict[str, Cursor]: ...

    def drop_consumer(self, consumer: str) -> bool: ...

    def prune(self, chunk: int = ...) -> int: ...

    def statistics(self) -> Any: ...  # each backend's own record: log_rows, transactions...


def is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def open_url(url: str, **options: Any) -> ContractStore:
    """The store at `url` (what store.open_store picks), with the backend's own options."""
    if is_postgres(url):
        return PostgresStore(url, **options)
    return SqliteStore(url.removeprefix("sqlite:///"), **options)


def put(key: str, at: int = 1_000, **fields: Any) -> RowWrite:
    return RowWrite(key=key, route=str(fields.pop("route", "product")), next_render_at=at, **fields)


def keys_of(events: Sequence[object]) -> list[str]:
    return [e.key for e in events if isinstance(e, RowEvent)]


def settle(store: ContractStore, timeout_s: float = 30.0) -> None:
    """Return once every commit so far can be polled.

    On PostgreSQL a transaction still running anywhere on the server (another test run,
    say) holds the feed back: delayed, never lost. A test that asserts what one poll
    returns first waits here until a probe subscription has delivered the head; SQLite's
    feed is never held back, so there the probe's first poll ends it.
    """
    head = store.feed_head()
    probe = store.subscribe(SETTLE_PROBE, head)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            batch = probe.poll(100_000)
            if not batch.more and probe.has_delivered(head):
                return
            assert time.monotonic() < deadline, "the feed stayed held back for 30 s"
            probe.wait(0.01)
    finally:
        probe.close()
        store.drop_consumer(SETTLE_PROBE)


def subscribed_after(store: ContractStore, consumer: str = "keeper") -> Any:
    """A subscription that delivers nothing written before this call. It opens at the
    feed's horizon, which a transaction still open anywhere on the server holds below
    the earlier writes, so wait for them to settle first."""
    settle(store)
    return store.subscribe(consumer)


def receive(sub: Subscription) -> list[str]:
    """Wait and poll until something arrives (a wake-up is a hint: some find nothing)."""
    for _ in range(100):
        assert sub.wait(60.0) is True
        found = keys_of(sub.poll().events)
        if found:
            return found
    raise AssertionError("woken 100 times without an event")


def close_all(store: ContractStore) -> None:
    """Drop every consumer (SQLite: with its semaphore and ring), then close."""
    for name in store.consumers():
        store.drop_consumer(name)
    store.close()
