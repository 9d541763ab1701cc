"""store.scheduling: each call changes only the calling thread, and only as it says."""

from __future__ import annotations

import os
import platform
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from store import scheduling

T = TypeVar("T")


def in_thread(body: Callable[[], T]) -> T:
    """Run `body` on a thread of its own: the calls here change the calling thread."""
    found: list[T] = []
    thread = threading.Thread(target=lambda: found.append(body()))
    thread.start()
    thread.join(10)
    assert len(found) == 1
    return found[0]


def kernel_has_slices() -> bool:
    release = platform.release().split(".")
    major, minor = int(release[0]), int("".join(c for c in release[1] if c.isdigit()) or 0)
    return platform.machine() in ("x86_64", "aarch64") and (major, minor) >= (6, 12)


needs_slices = pytest.mark.skipif(
    not kernel_has_slices(), reason="per-task slices need Linux 6.12+ on x86_64 or aarch64"
)


@needs_slices
def test_a_thread_gets_the_shortest_slice_and_no_other_thread_does() -> None:
    before = scheduling.slice_ns()
    assert before is not None and before > scheduling.SHORTEST_SLICE_NS

    def ask() -> tuple[bool, int | None]:
        return scheduling.ask_short_slice(), scheduling.slice_ns()

    assert in_thread(ask) == (True, scheduling.SHORTEST_SLICE_NS)
    assert scheduling.slice_ns() == before


@needs_slices
def test_the_threads_nice_value_is_kept() -> None:
    def ask() -> tuple[bool, int]:
        os.setpriority(os.PRIO_PROCESS, 0, 3)  # on Linux: this thread alone
        return scheduling.ask_short_slice(), os.getpriority(os.PRIO_PROCESS, 0)

    assert in_thread(ask) == (True, 3)
    assert os.getpriority(os.PRIO_PROCESS, 0) == 0


@needs_slices
def test_a_slice_the_kernel_would_clamp_is_reported_as_not_granted() -> None:
    def ask() -> tuple[bool, int | None]:
        return scheduling.ask_short_slice(10_000), scheduling.slice_ns()

    granted, found = in_thread(ask)
    assert granted is False and found == scheduling.SHORTEST_SLICE_NS  # clamped to 0.1 ms


def test_a_thread_at_idle_priority_is_left_there() -> None:
    def lower_then_ask() -> tuple[bool, bool, int]:
        lowered = scheduling.lower_to_idle()
        return lowered, scheduling.ask_short_slice(), os.sched_getscheduler(0)

    lowered, granted, policy = in_thread(lower_then_ask)
    assert lowered and granted is False and policy == os.SCHED_IDLE
    assert os.sched_getscheduler(0) == os.SCHED_OTHER


def test_an_unknown_platform_is_refused_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert in_thread(scheduling.ask_short_slice) is False
    assert scheduling.slice_ns() is None
