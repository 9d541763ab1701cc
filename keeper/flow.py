"""Flow per minute for the last hour: came due, added, triggered, rescheduled, removed.

Added, triggered, rescheduled and removed are counted as events apply.
"Came due" is read off the buckets when a minute starts: the rows whose due
time falls in that minute, before the fleet has had a chance to move them.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import msgspec

MINUTE_MS = 60_000
KINDS = ("came_due", "added", "triggered", "rescheduled", "removed")


class FlowMinute(msgspec.Struct, frozen=True, kw_only=True):
    minute_at: int  # the minute's first millisecond
    came_due: int = 0
    added: int = 0  # rows new to this node's queue
    triggered: int = 0  # rows moved earlier so that they became due
    rescheduled: int = 0  # rows whose due time moved otherwise (renders, edits)
    removed: int = 0  # rows deleted (or no longer owned)


class FlowLog:
    def __init__(self, minutes: int = 60) -> None:
        self.size = minutes
        self._stamp: array[int] = array("q", [-1]) * minutes
        self._counts = [array("q", [0]) * minutes for _ in KINDS]
        self._came_due_through = -1  # last minute whose came-due count is filled

    def _slot(self, minute: int) -> int:
        slot = minute % self.size
        if self._stamp[slot] != minute:
            self._stamp[slot] = minute
            for counts in self._counts:
                counts[slot] = 0
        return slot

    def add(
        self,
        now_ms: int,
        *,
        added: int = 0,
        triggered: int = 0,
        rescheduled: int = 0,
        removed: int = 0,
    ) -> None:
        slot = self._slot(now_ms // MINUTE_MS)
        self._counts[1][slot] += added
        self._counts[2][slot] += triggered
        self._counts[3][slot] += rescheduled
        self._counts[4][slot] += removed

    def tick(self, now_ms: int, due_in_minute: Callable[[int], int]) -> None:
        """Fill "came due" for each minute started since the last tick (the current one too)."""
        minute = now_ms // MINUTE_MS
        if self._came_due_through < 0:
            # Earlier minutes' buckets now hold only what is still due, not what came due.
            first = minute
        else:
            first = max(self._came_due_through + 1, minute - self.size + 1)
        for start in range(first, minute + 1):
            slot = self._slot(start)
            self._counts[0][slot] = due_in_minute(start)
        self._came_due_through = max(self._came_due_through, minute)

    def minutes(self, now_ms: int) -> list[FlowMinute]:
        """The last `size` minutes, oldest first, the current (partial) minute last."""
        minute = now_ms // MINUTE_MS
        out: list[FlowMinute] = []
        for start in range(minute - self.size + 1, minute + 1):
            slot = start % self.size
            if self._stamp[slot] != start:
                out.append(FlowMinute(minute_at=start * MINUTE_MS))
                continue
            c = [counts[slot] for counts in self._counts]
            out.append(
                FlowMinute(
                    minute_at=start * MINUTE_MS,
                    came_due=c[0],
                    added=c[1],
                    triggered=c[2],
                    rescheduled=c[3],
                    removed=c[4],
                )
            )
        return out
