"""The store lane (api.lane): a worker's store calls made in order on one thread, off the
event loop; calls queued behind one that finds the store unavailable end with it, untried.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import pytest

from api.lane import StoreLane
from store.errors import StoreBusy, StoreUnavailable

WAIT_S = 30.0  # generous: the machine is shared; the point is what happens, not how soon


def test_calls_run_in_order_on_one_thread_off_the_loop_and_raise_where_awaited() -> None:
    lane = StoreLane()
    ran: list[tuple[int, str]] = []

    def call(n: int) -> int:
        ran.append((n, threading.current_thread().name))
        if n == 3:
            raise StoreBusy("the lock was held")
        return n * 10

    async def main() -> list[Any]:
        return await asyncio.gather(
            *(lane.call(functools.partial(call, n)) for n in range(6)), return_exceptions=True
        )

    try:
        answers = asyncio.run(main())
        assert answers[:3] == [0, 10, 20] and answers[4:] == [40, 50]
        assert isinstance(answers[3], StoreBusy)  # not StoreUnavailable: nothing is shed
        assert [n for n, _ in ran] == list(range(6))
        assert {name for _, name in ran} == {"store-lane"}
        assert lane.call_blocking(lambda: threading.current_thread().name) == "store-lane"
        stats = lane.statistics()
        assert (stats.calls, stats.shed, stats.pending, stats.running_s) == (7, 0, 0, 0.0)
    finally:
        assert lane.close(WAIT_S)


def test_calls_queued_behind_an_unavailable_store_end_with_it_untried() -> None:
    """The first call waits on a store that does not answer, then fails; the calls queued
    meanwhile fail with it and never run; a call queued after the failure is tried."""
    lane = StoreLane()
    release = threading.Event()
    ran: list[str] = []

    def silent() -> None:
        ran.append("silent")
        release.wait(WAIT_S)
        raise StoreUnavailable("get_many: no answer from the server")

    def read(name: str) -> str:
        ran.append(name)
        return name

    async def main() -> None:
        first = asyncio.ensure_future(lane.call(silent))
        while lane.statistics().running_s == 0:  # until the lane is in the silent call
            await asyncio.sleep(0.005)
        queued = [asyncio.ensure_future(lane.call(functools.partial(read, n))) for n in "ab"]
        while lane.statistics().pending < 3:
            await asyncio.sleep(0.005)
        stats = lane.statistics()
        assert stats.pending == 3 and stats.running_s > 0
        release.set()
        with pytest.raises(StoreUnavailable, match="no answer"):
            await first
        for future in queued:
            with pytest.raises(StoreUnavailable, match="queued behind that one and not tried"):
                await future
        assert await lane.call(lambda: read("after")) == "after"

    try:
        asyncio.run(main())
        assert ran == ["silent", "after"]
        stats = lane.statistics()
        assert (stats.calls, stats.shed, stats.pending) == (2, 2, 0)
    finally:
        release.set()
        assert lane.close(WAIT_S)


def test_a_cancelled_caller_leaves_the_lane_going() -> None:
    lane = StoreLane()
    release = threading.Event()

    async def main() -> str:
        waiting = asyncio.ensure_future(lane.call(lambda: release.wait(WAIT_S)))
        while lane.statistics().running_s == 0:
            await asyncio.sleep(0.005)
        waiting.cancel()
        release.set()
        return await lane.call(lambda: "next")

    try:
        assert asyncio.run(main()) == "next"
    finally:
        release.set()
        assert lane.close(WAIT_S)


def test_close_leaves_a_call_still_waiting_on_the_store_to_the_process() -> None:
    lane = StoreLane()
    assert lane.close(0)  # never started: nothing to wait for
    lane = StoreLane()
    release = threading.Event()
    started = threading.Event()

    def stuck() -> None:
        started.set()
        release.wait(WAIT_S)

    threading.Thread(target=lambda: lane.call_blocking(stuck), daemon=True).start()
    assert started.wait(WAIT_S)
    try:
        assert not lane.close(0.05)  # the thread is a daemon: the process may still exit
        with pytest.raises(RuntimeError, match="closed"):
            lane.call_blocking(lambda: None)
    finally:
        release.set()
    assert lane.close(WAIT_S)
