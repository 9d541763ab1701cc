"""A worker's store lane: one thread of the worker's that makes its store calls, in order,
so that a request which must wait on the store waits there and not on the event loop.

Why: a PostgreSQL that stops answering without closing anything (a server or network
gone silent) holds each call until the store's deadline, several seconds
(store.postgres.conn). A call made on the event loop held every request of the worker
that long, `/healthz`, `/readyz` and `/metrics` included. On the lane only the requests
that wait for the store wait; the loop goes on serving the rest.

One thread, not a pool: the stores give each thread a connection of its own
(threading.local), so a pool would open a PostgreSQL connection per pool thread per
worker, and the worker's calls ran one at a time on the loop before anyway. A store's
`write_position` is per thread too: a write made on the lane is stamped on the lane
(`Node.stamp_written` inside the same call).

Which calls take the lane. Every PostgreSQL call (the store says so: `remote`). On
SQLite, whose calls wait only on this machine, the claim path's reads and the
completions stay on the loop (`hot_inline`): they take microseconds, and a hop to a
thread and back costs each of them more than that
(docs/decisions/0001-completions-on-the-event-loop.md); a completion that finds the
write lock held already waits with `asyncio.sleep` (api.completions). The rest (schedule
and route writes, which wait for the lock in the store's retry loop, admin reads) take
the lane on either backend.

A store that does not answer: calls queued behind one that ends in StoreUnavailable end
with it, untried (`shed`), so a request waits for at most the call ahead of it and its
own, not for a queue of calls each waiting out the same deadline. What was shed wrote
nothing; its caller hears 503 with Retry-After, as the failed call's does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from store.errors import StoreUnavailable

T = TypeVar("T")


class LaneStatistics(msgspec.Struct, frozen=True, kw_only=True):
    pending: int  # calls queued or running now
    running_s: float  # how long the call running now has run (0: none)
    calls: int  # calls made (shed ones are not)
    shed: int  # calls ended with an earlier call's StoreUnavailable, untried


@dataclass(eq=False)
class _Job:
    call: Callable[[], Any]
    seq: int
    # On an event loop (`StoreLane.call`) or in a blocked thread (`call_blocking`).
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future[Any] | concurrent.futures.Future[Any]

    def settle(self, value: Any, error: BaseException | None) -> None:
        if self.loop is None:
            future: Any = self.future
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
            return
        # A loop that has closed raises: nobody waits for the answer then.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(_resolve, self.future, value, error)


def _resolve(future: Any, value: Any, error: BaseException | None) -> None:
    if future.done():  # its request was cancelled meanwhile
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


class StoreLane:
    """One worker's store calls, made in order by one daemon thread (module note)."""

    def __init__(self, *, hot_inline: bool = True, name: str = "store-lane") -> None:
        # The claim path's reads and the completions run on the loop instead (module note).
        self.hot_inline = hot_inline
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._queued = 0  # the last job's sequence number
        self._finished = 0  # jobs settled
        self._shed_through = 0  # jobs up to this number end with `_shed_by`, untried
        self._shed_by: StoreUnavailable | None = None
        self._running_since = 0.0  # monotonic; 0: no call running
        self._calls = 0
        self._shed = 0
        self._closed = False

    async def call(self, call: Callable[[], T]) -> T:
        """`call()`'s value, made on the lane; its exception is raised here."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._submit(call, loop, future)
        return await future

    def call_blocking(self, call: Callable[[], T]) -> T:
        """`call()` made on the lane, from a thread that may wait (not an event loop's):
        a worker opens its store this way, so the connection it opens is the lane's."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._submit(call, None, future)
        return future.result()

    def _submit(
        self,
        call: Callable[[], Any],
        loop: asyncio.AbstractEventLoop | None,
        future: asyncio.Future[Any] | concurrent.futures.Future[Any],
    ) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} is closed")
        if self._thread is None:
            self._start()
        with self._start_lock:  # a loop and a blocked thread may both submit
            self._queued += 1
            seq = self._queued
        self._jobs.put(_Job(call, seq, loop, future))

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._make(job)

    def _make(self, job: _Job) -> None:
        shed_by = self._shed_by
        if shed_by is not None and job.seq <= self._shed_through:
            self._shed += 1
            self._finished += 1
            job.settle(
                None,
                StoreUnavailable(f"{shed_by} (this call was queued behind that one and not tried)"),
            )
            return
        self._calls += 1
        self._running_since = time.monotonic()
        try:
            value = job.call()
        except BaseException as exc:
            if isinstance(exc, StoreUnavailable):
                # Everything queued by now was waiting on the same silent store.
                self._shed_through = self._queued
                self._shed_by = exc
            self._running_since = 0.0
            self._finished += 1
            job.settle(None, exc)
        else:
            self._running_since = 0.0
            self._finished += 1
            job.settle(value, None)

    def statistics(self) -> LaneStatistics:
        since = self._running_since
        return LaneStatistics(
            pending=max(0, self._queued - self._finished),
            running_s=round(max(0.0, time.monotonic() - since), 3) if since else 0.0,
            calls=self._calls,
            shed=self._shed,
        )

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop taking calls and let the thread finish those queued; True once it has
        ended (False: a call is still waiting on the store, and the thread, a daemon,
        is left to end with the process)."""
        self._closed = True
        thread = self._thread
        if thread is None:
            return True
        self._jobs.put(None)
        thread.join(timeout_s)
        return not thread.is_alive()
