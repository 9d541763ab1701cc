"""Bench only: `bench.harness.faketime` puts this directory on the PYTHONPATH of a node it runs
under libfaketime, with RQ_BENCH_FAKETIME_SLEEP set, to give it a `time.sleep` that works
there.

Debian's libfaketime (0.9.10) breaks one of Python 3.11's two ways of waiting, whichever
way it is set: faking the monotonic clock hangs every timed lock wait (`Event.wait`,
`Lock.acquire(timeout=)`: glibc's `sem_clockwait` is not intercepted, libfaketime issue
390), and leaving that clock alone mistranslates the absolute monotonic deadline
`time.sleep` sleeps to (`clock_nanosleep` with TIMER_ABSTIME fails with EINVAL, issue
426). The node runs with the monotonic clock left alone, as a machine whose wall clock
is set apart has it, and sleeps here by relative waits, which libfaketime passes on."""

import os
import select
import time
from typing import SupportsIndex

if os.environ.get("RQ_BENCH_FAKETIME_SLEEP"):

    def _sleep(secs: float | SupportsIndex) -> None:
        seconds = float(secs)
        if seconds < 0:
            raise ValueError("sleep length must be non-negative")
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            select.select([], [], [], left)

    time.sleep = _sleep
