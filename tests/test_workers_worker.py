"""The worker's report to its supervisor never blocks its event loop: with the status pipe
full (a supervisor stopped or busy), a report is dropped and counted."""

from __future__ import annotations

import asyncio
import os

import uvicorn

from workers.worker import REPORT_EVERY_TICKS, WorkerServer


async def nothing(scope: object, receive: object, send: object) -> None:
    return None


def test_a_full_pipe_drops_the_report_and_never_blocks() -> None:
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    try:
        line = b"report " + b"x" * 500 + b"\n"
        server = WorkerServer(uvicorn.Config(nothing), write_end, lambda: line)
        assert not os.get_blocking(write_end)
        server.started = True
        sent = 0
        # Tick until the pipe is full: every report is whole until one does not fit.
        while server.reports_dropped == 0:
            assert asyncio.run(server.on_tick(REPORT_EVERY_TICKS * (sent + 1))) is False
            sent += 1
        assert sent > 10
        received = b""
        while True:
            try:
                received += os.read(read_end, 65536)
            except BlockingIOError:
                break
            if len(received) >= (sent - 1) * len(line):
                break
        # Only whole lines went in: the dropped one left no part of itself.
        assert received == line * (sent - 1)
        # Room again: the next report goes.
        asyncio.run(server.on_tick(0))
        assert os.read(read_end, 65536) == line
        assert server.reports_dropped == 1
    finally:
        os.close(read_end)
        os.close(write_end)


def test_ticks_between_reports_send_nothing() -> None:
    read_end, write_end = os.pipe()
    try:
        calls: list[int] = []

        def report() -> bytes:
            calls.append(1)
            return b"report {}\n"

        server = WorkerServer(uvicorn.Config(nothing), write_end, report)
        server.started = True
        for counter in range(1, REPORT_EVERY_TICKS * 3 + 1):
            asyncio.run(server.on_tick(counter))
        assert len(calls) == 3
    finally:
        os.close(read_end)
        os.close(write_end)
