"""Completions of many requests committed together, off the event loop.

A completion is a write: it takes the store's write lock, which the other workers (and the
schedule writers) want too. Run on the event loop, a completion that waits for the lock
stops this worker's claims and reads from being served meanwhile, and each request pays a
whole transaction of its own. Here one thread per worker owns the completion writes:
requests queue their batches, the thread takes everything queued when it is free and
commits it in one transaction, and each request's future gets its own rows back. Under
load, transactions grow with the queue (fewer commits, wake-ups and WAL syncs per key);
when idle, a lone batch is committed at once, with one thread hop of added latency.

A group that fails (a BUSY store past its timeout, a row the store refuses) is retried
batch by batch, so each request gets its own outcome and no request's error reaches
another.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Sequence

import msgspec

from store.base import ScheduleStore
from store.rows import Completion, Row

# At most this many completions in one transaction: bounds the write lock's hold time
# (and so the other workers' wait) when a burst queues up.
MAX_GROUP = 2000

_STOP = object()


class GroupCommitStatistics(msgspec.Struct, frozen=True, kw_only=True):
    running: bool
    batches: int  # requests' batches committed
    transactions: int  # groups committed (batches / transactions = batching achieved)
    completions: int
    largest_group: int
    split_groups: int  # groups that failed whole and were retried batch by batch
    failed_batches: int


class _Batch:
    __slots__ = ("future", "items", "loop")

    def __init__(
        self,
        items: list[Completion],
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[list[Row | None]],
    ) -> None:
        self.items = items
        self.loop = loop
        self.future = future

    def settle(self, rows: list[Row | None] | None, error: BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self._settle, rows, error)

    def _settle(self, rows: list[Row | None] | None, error: BaseException | None) -> None:
        if self.future.done():  # the request went away (client gone, shutdown)
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            assert rows is not None
            self.future.set_result(rows)


class GroupCommit:
    """One per worker; `complete` is awaited on the event loop, the writes run on a thread."""

    def __init__(self, store: ScheduleStore, max_group: int = MAX_GROUP) -> None:
        self._store = store
        self._max_group = max_group
        self._queue: queue.SimpleQueue[_Batch | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._batches = self._transactions = self._completions = 0
        self._largest = self._split = self._failed = 0

    async def complete(self, items: Sequence[Completion]) -> list[Row | None]:
        """`store.complete(items)`, committed with whatever else is queued."""
        if not items:
            return []
        self._start()
        loop = asyncio.get_running_loop()
        batch = _Batch(list(items), loop, loop.create_future())
        self._queue.put(batch)
        return await batch.future

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError("group commit is closed")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="rq-group-commit", daemon=True
                )
                self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Commit what is queued, then stop the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout_s)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            first = self._queue.get()
            if not isinstance(first, _Batch):
                break
            group = [first]
            size = len(first.items)
            while size < self._max_group:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(more, _Batch):
                    stopping = True
                    break
                group.append(more)
                size += len(more.items)
            self._commit(group)

    def _commit(self, group: list[_Batch]) -> None:
        items = [item for batch in group for item in batch.items]
        try:
            rows = self._store.complete(items)
        except BaseException as exc:
            if len(group) == 1:
                self._failed += 1
                group[0].settle(None, exc)
                return
            self._split += 1
            for batch in group:
                self._commit([batch])
            return
        self._transactions += 1
        self._batches += len(group)
        self._completions += len(items)
        self._largest = max(self._largest, len(items))
        start = 0
        for batch in group:
            end = start + len(batch.items)
            batch.settle(rows[start:end], None)
            start = end

    def statistics(self) -> GroupCommitStatistics:
        thread = self._thread
        return GroupCommitStatistics(
            running=thread is not None and thread.is_alive(),
            batches=self._batches,
            transactions=self._transactions,
            completions=self._completions,
            largest_group=self._largest,
            split_groups=self._split,
            failed_batches=self._failed,
        )
