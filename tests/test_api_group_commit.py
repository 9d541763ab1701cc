"""api/group_commit.py: completions of concurrent requests committed together on one
thread, each request getting its own rows or its own error; against a real SQLite store."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from node_harness import now_ms, seed_rows

from api.group_commit import GroupCommit
from store import open_store
from store.rows import Completion
from store.sqlite import SqliteStore


def _rendered(keys: list[str], now: int) -> list[Completion]:
    return [Completion(key=k, outcome="rendered", now=now) for k in keys]


class GatedStore(SqliteStore):
    """A real store whose first complete() waits for a gate, so later batches queue up."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.gate = threading.Event()
        self.calls: list[int] = []

    def complete(self, items):  # type: ignore[no-untyped-def]
        if not self.calls:
            self.gate.wait(10)
        self.calls.append(len(items))
        return super().complete(items)


def test_batches_queued_meanwhile_share_one_transaction_and_get_their_own_rows(
    tmp_path: Path,
) -> None:
    db = tmp_path / "s.sqlite"
    keys = seed_rows(db, 40)
    store = GatedStore(db)
    commit = GroupCommit(store)

    async def run() -> list[list[str | None]]:
        now = now_ms()
        first = asyncio.ensure_future(commit.complete(_rendered(keys[:10], now)))
        await asyncio.sleep(0.05)  # the thread holds the first batch at the gate
        rest = [
            asyncio.ensure_future(commit.complete(_rendered(keys[i : i + 10], now)))
            for i in (10, 20, 30)
        ]
        await asyncio.sleep(0.05)
        store.gate.set()
        done = await asyncio.gather(first, *rest)
        return [[row.key if row else None for row in rows] for rows in done]

    try:
        got = asyncio.run(run())
        assert got == [keys[i : i + 10] for i in (0, 10, 20, 30)]
        assert store.calls == [10, 30], "the three queued batches went in one transaction"
        stats = commit.statistics()
        assert (stats.batches, stats.transactions, stats.completions) == (4, 2, 40)
        reader = open_store(str(db))
        assert all(row.last_outcome == "rendered" for row in reader.get_many(keys).values())
        reader.close()
    finally:
        commit.close()
        store.close()
    assert not commit.statistics().running


def test_a_batch_the_store_refuses_fails_alone(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    keys = seed_rows(db, 20)
    store = GatedStore(db)
    commit = GroupCommit(store)

    async def run() -> tuple[object, object, object]:
        now = now_ms()
        first = asyncio.ensure_future(commit.complete(_rendered(keys[:5], now)))
        await asyncio.sleep(0.05)
        bad = asyncio.ensure_future(
            commit.complete([Completion(key=keys[5], outcome="rendered", now=2**63)])
        )
        good = asyncio.ensure_future(commit.complete(_rendered(keys[6:10], now)))
        await asyncio.sleep(0.05)
        store.gate.set()
        return tuple(await asyncio.gather(first, bad, good, return_exceptions=True))  # type: ignore[return-value]

    try:
        first, bad, good = asyncio.run(run())
        assert isinstance(bad, ValueError) and "now" in str(bad)
        assert [row.key for row in first] == keys[:5]  # type: ignore[attr-defined]
        assert [row.key for row in good] == keys[6:10]  # type: ignore[attr-defined]
        stats = commit.statistics()
        assert stats.split_groups == 1 and stats.failed_batches == 1
        reader = open_store(str(db))
        assert reader.get(keys[5]).last_outcome is None  # type: ignore[union-attr]
        reader.close()
    finally:
        commit.close()
        store.close()
