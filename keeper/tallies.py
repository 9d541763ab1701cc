"""Rows per (class, due minute): dense per-class counters, so counts are slices, not rows.

Per class, an `array('i')` of row counts indexed by minute - base: an event
adds and removes one count at its old and new due minute with two array
writes, and those minutes cluster near now, so they stay in cache. The full
counts read each class's array with numpy (prefix sums over a few thousand
minutes). A class's range widens on demand, a day at a time, but only within
WINDOW minutes either side of now: a minute further out (a row due at epoch 0,
or next year) goes to a small overflow dict, and `trim` drops the range's
leading minutes as time moves on.
"""

from __future__ import annotations

from array import array

import numpy as np
import numpy.typing as npt

MINUTE_MS = 60_000
WINDOW = 1 << 17  # minutes either side of now a dense range may reach (about 91 days)
GROW = 1_440  # minutes added on each side when a range widens (a day)
KEY_SPAN = 1 << 32  # overflow key = class id * KEY_SPAN + minute


class MinuteTallies:
    def __init__(self) -> None:
        self.base: list[int] = []  # per class: the minute of element 0
        self.counts: list[array[int]] = []
        self.outside: dict[int, int] = {}  # minutes beyond a class's dense range
        self.now_minute = 0  # set by the queue; only the slow path reads it
        self._classes = 0

    def __len__(self) -> int:
        """Distinct (class, minute) pairs holding a row."""
        dense = sum(int(np.count_nonzero(np.frombuffer(c, dtype=np.int32))) for c in self.counts)
        return dense + len(self.outside)

    def add(self, class_id: int, minute: int) -> None:
        if class_id < self._classes:
            counts = self.counts[class_id]
            i = minute - self.base[class_id]
            if 0 <= i < len(counts):
                counts[i] += 1
                return
        self._slow(class_id, minute, 1)

    def sub(self, class_id: int, minute: int) -> None:
        counts = self.counts[class_id]
        i = minute - self.base[class_id]
        if 0 <= i < len(counts):
            counts[i] -= 1
            return
        self._slow(class_id, minute, -1)

    def _slow(self, class_id: int, minute: int, delta: int) -> None:
        now = self.now_minute
        while class_id >= self._classes:
            self.base.append(now - GROW)
            self.counts.append(array("i", bytes(4 * 2 * GROW)))
            self._classes += 1
        counts = self.counts[class_id]
        base = self.base[class_id]
        i = minute - base
        if 0 <= i < len(counts):
            counts[i] += delta
            return
        if now - WINDOW <= minute < now + WINDOW:
            low = max(min(base, minute - GROW), now - WINDOW)
            high = min(max(base + len(counts), minute + GROW), now + WINDOW)
            self._widen(class_id, min(low, base), max(high, base + len(counts)))
            self.counts[class_id][minute - self.base[class_id]] += delta
            return
        key = class_id * KEY_SPAN + minute
        left = self.outside.get(key, 0) + delta
        if left:
            self.outside[key] = left
        else:
            del self.outside[key]

    def _widen(self, class_id: int, low: int, high: int) -> None:
        counts = self.counts[class_id]
        base = self.base[class_id]
        if low < base:
            grown = array("i", bytes(4 * (base - low)))
            grown.extend(counts)
            counts = grown
            self.counts[class_id] = counts
            self.base[class_id] = low
        if high > low + len(counts):
            counts.frombytes(bytes(4 * (high - low - len(counts))))

    def add_many(self, class_id: int, minutes: npt.NDArray[np.int64]) -> None:
        if not len(minutes):
            return
        now = self.now_minute
        near = minutes[(minutes >= now - WINDOW) & (minutes < now + WINDOW)]
        for end in (near.min(), near.max()) if len(near) else (now,):
            self.add(class_id, int(end))  # registers the class, widens toward both ends
            self.sub(class_id, int(end))
        base = self.base[class_id]
        counts = np.frombuffer(self.counts[class_id], dtype=np.int32)
        index = minutes - base
        inside = (index >= 0) & (index < len(counts))
        np.add.at(counts, index[inside], 1)
        del counts
        for minute in minutes[~inside].tolist():
            self._slow(class_id, minute, 1)

    def count(self, class_id: int, minute: int) -> int:
        if class_id >= self._classes:
            return 0
        i = minute - self.base[class_id]
        counts = self.counts[class_id]
        if 0 <= i < len(counts):
            return counts[i]
        return self.outside.get(class_id * KEY_SPAN + minute, 0)

    def dense(self, class_id: int) -> tuple[int, npt.NDArray[np.int32]]:
        """(base minute, counts view) of a class; drop the view before the next add."""
        if class_id >= self._classes:
            return 0, np.zeros(0, dtype=np.int32)
        return self.base[class_id], np.frombuffer(self.counts[class_id], dtype=np.int32)

    def outside_of(self, class_id: int) -> list[tuple[int, int]]:
        """(minute, count) pairs of a class beyond its dense range."""
        low = class_id * KEY_SPAN
        return [(k - low, n) for k, n in self.outside.items() if low <= k < low + KEY_SPAN]

    def class_total(self, class_id: int) -> int:
        _, counts = self.dense(class_id)
        return int(counts.sum()) + sum(n for _, n in self.outside_of(class_id))

    def trim(self) -> None:
        """Move minutes older than the window to the overflow, then drop leading empty ones."""
        now = self.now_minute
        for class_id in range(self._classes):
            base = self.base[class_id]
            counts = np.frombuffer(self.counts[class_id], dtype=np.int32)
            old = min(max(0, now - WINDOW - base), len(counts))
            for i in np.flatnonzero(counts[:old]).tolist():
                key = class_id * KEY_SPAN + base + i
                self.outside[key] = self.outside.get(key, 0) + int(counts[i])
            nonzero = np.flatnonzero(counts[old:])
            cut = old + (int(nonzero[0]) if len(nonzero) else len(counts) - old)
            cut = min(cut, max(0, now - GROW - base))
            del counts, nonzero
            if cut > GROW or old > 0:
                self.counts[class_id] = self.counts[class_id][cut:]
                self.base[class_id] = base + cut
        for key, n in list(self.outside.items()):
            class_id, minute = divmod(key, KEY_SPAN)
            if now - WINDOW <= minute < now + WINDOW:
                del self.outside[key]
                for _ in range(n):
                    self.add(class_id, minute)

    def nbytes(self) -> int:
        return 4 * sum(len(c) for c in self.counts) + 100 * len(self.outside)
