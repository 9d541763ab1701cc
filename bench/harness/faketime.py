"""A process whose wall clock is set apart from the machine's, through libfaketime
(Debian's `faketime`): the environment that starts it so. A cluster node must not trust
its own clock for instants the others compare, so the fault bench runs one node this way
beside others on the real clock.

Only the wall clock is shifted: the monotonic clock is left alone, as on a machine whose
clock is merely set wrong, and `faketime_hook/sitecustomize.py` mends the one wait
libfaketime breaks in that mode (it says why the other mode cannot be used)."""

from __future__ import annotations

import glob
from pathlib import Path

LIBRARY = next(iter(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")), "libfaketime.so.1")
HOOK_DIR = Path(__file__).resolve().parent / "faketime_hook"
REPO = HOOK_DIR.parents[2]


def available() -> bool:
    return Path(LIBRARY).exists()


def environment(offset: str) -> dict[str, str]:
    """Variables for a Python process (and its children) whose wall clock runs `offset`
    ("+30s", "-30s", "+5m") from the real one."""
    return {
        "LD_PRELOAD": LIBRARY,
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "RQ_BENCH_FAKETIME_SLEEP": "1",
        "PYTHONPATH": f"{HOOK_DIR}:{REPO}",
    }
