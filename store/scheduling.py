"""What the store's threads ask of Linux's scheduler, each for its own thread.

Idle priority (`lower_to_idle`), for the upkeep's checkpoints: they only copy pages
already durable in the WAL, so nobody waits on them and any runnable thread should
have the core first (see store.sqlite.upkeep).

A short slice (`ask_short_slice`), for a feed's consumer. Its work comes in bursts
of tens of microseconds, and its lag is how soon it runs after a commit. Linux's
fair scheduler (EEVDF, 6.6 and newer) lets a task that is woken run at once only if
its deadline, one slice after it became eligible, falls before the running task's.
Since 6.12 a task may ask for its own slice (sched_setattr's `sched_runtime` for a
SCHED_OTHER task, no privilege needed), and a woken task with a shorter slice than
the running one preempts it. Without it, a consumer woken by its timer or a writer's
post can wait on the run queue for a whole default slice behind a kernel thread, and
those waits make the tail of the feed's lag; with the shortest slice the running
thread is cut off at its next preemption point instead. It does not help where there
is no preemption point to reach (a kernel built without preemption), nor when the
consumer is woken onto the writer's own CPU, where it waits for the next tick
(bench.store's "pinned apart" peer shows that case; the history and the figures are in
docs/decisions/0002-short-slice-for-the-feed-consumer.md). The thread's share of the
CPU is unchanged (that is its weight, its nice value); it gets its turns sooner and in
shorter pieces.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
from collections.abc import Callable

SHORTEST_SLICE_NS = 100_000  # the kernel clamps a requested slice to 0.1-100 ms

# sched_setattr(2) and sched_getattr(2) have no wrapper in glibc or in `os`.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
# struct sched_attr as of Linux 4.13: size, policy, flags, nice, priority, runtime,
# deadline, period, util_min, util_max.
_ATTR = struct.Struct("IIQiIQQQII")
_RUNTIME = 5  # the field's index: a fair task's slice, in ns


def _sched_attr_calls() -> tuple[Callable[..., int], int, int] | None:
    """libc's syscall() with this machine's sched_setattr and sched_getattr numbers; None
    on a platform without them here."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    return ctypes.CDLL(None, use_errno=True).syscall, numbers[0], numbers[1]


def lower_to_idle() -> bool:
    """Put the calling thread under SCHED_IDLE (on Linux, pid 0 is the calling thread, not
    the process). Lowering needs no privilege; False where the platform has no such policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        return False
    return True


def ask_short_slice(wanted_ns: int = SHORTEST_SLICE_NS) -> bool:
    """Ask for a `wanted_ns` slice for the calling thread, keeping its policy and nice value;
    whether the kernel now reports it. False where the thread is not SCHED_OTHER, on a
    kernel before 6.12 (it ignores the field for fair tasks) or another platform."""
    calls = _sched_attr_calls()
    if calls is None:
        return False
    syscall, set_nr, _ = calls
    with contextlib.suppress(OSError, AttributeError):
        if os.sched_getscheduler(0) != os.SCHED_OTHER:
            return False  # idle, batch or real-time: chosen by someone, left alone
        # The nice value is part of the call: pass the thread's own, never reset it.
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        attr = _ATTR.pack(_ATTR.size, os.SCHED_OTHER, 0, nice, 0, wanted_ns, 0, 0, 0, 0)
        if syscall(set_nr, 0, ctypes.create_string_buffer(attr), 0) != 0:
            return False
        return slice_ns() == wanted_ns
    return False


def slice_ns() -> int | None:
    """The calling thread's slice as the kernel reports it (0 before Linux 6.12); None
    where it cannot say."""
    calls = _sched_attr_calls()
    if calls is None:
        return None
    syscall, _, get_nr = calls
    found = ctypes.create_string_buffer(_ATTR.size)
    if syscall(get_nr, 0, found, _ATTR.size, 0) != 0:
        return None
    return int(_ATTR.unpack(found.raw)[_RUNTIME])
