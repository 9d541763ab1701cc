"""Racing claimant processes: start them, release them together, collect one report each.

A target takes its own arguments followed by `ready` (put once attached and warmed up),
`start` (an Event it waits on) and `results` (where it puts its one msgpack report).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable, Sequence
from typing import Any


def race(
    target: Callable[..., None],
    args: Sequence[tuple[Any, ...]],
    report_timeout_s: float,
    what: str = "a claimant",
) -> list[bytes]:
    """Run one spawned process per argument tuple; return their reports, raw."""
    ctx = mp.get_context("spawn")
    ready: Any = ctx.Queue()
    results: Any = ctx.Queue()
    start = ctx.Event()
    processes = [
        ctx.Process(target=target, args=(*own, ready, start, results), daemon=True) for own in args
    ]
    for process in processes:
        process.start()
    reports: list[bytes] = []
    try:
        for _ in processes:
            ready.get(timeout=120)
        start.set()
        for _ in processes:
            reports.append(results.get(timeout=report_timeout_s))
    except queue.Empty as exc:
        raise RuntimeError(f"{what} never reported") from exc
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return reports
