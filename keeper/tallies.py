"""Rows per (class, due minute), in flat columns: the full counts are numpy work over these.

The index from (class, minute) to a column position is a dict, so the
per-event path stays two dict lookups; freed positions count zero and are
reused, so a vectorized pass can read every position without a filter.
"""

from __future__ import annotations

from array import array

import numpy as np
import numpy.typing as npt

MINUTE_MS = 60_000
KEY_SPAN = 1 << 32  # key = class id * KEY_SPAN + minute (minutes fit in 32 bits to year 10000)


class MinuteTallies:
    def __init__(self) -> None:
        self.t_class: array[int] = array("i")
        self.t_minute: array[int] = array("q")
        self.t_count: array[int] = array("q")
        self._index: dict[int, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._index)

    def add(self, class_id: int, minute: int) -> None:
        key = class_id * KEY_SPAN + minute
        at = self._index.get(key)
        if at is not None:
            self.t_count[at] += 1
            return
        if self._free:
            at = self._free.pop()
            self.t_class[at] = class_id
            self.t_minute[at] = minute
            self.t_count[at] = 1
        else:
            at = len(self.t_count)
            self.t_class.append(class_id)
            self.t_minute.append(minute)
            self.t_count.append(1)
        self._index[key] = at

    def sub(self, class_id: int, minute: int) -> None:
        key = class_id * KEY_SPAN + minute
        at = self._index[key]
        left = self.t_count[at] - 1
        self.t_count[at] = left
        if left == 0:
            del self._index[key]
            self._free.append(at)

    def add_many(self, class_id: int, minutes: npt.NDArray[np.int64]) -> None:
        found, counts = np.unique(minutes, return_counts=True)
        base = class_id * KEY_SPAN
        for minute, n in zip(found.tolist(), counts.tolist(), strict=True):
            at = self._index.get(base + minute)
            if at is None:
                self.add(class_id, minute)
                at = self._index[base + minute]
                n -= 1
            self.t_count[at] += n

    def count(self, class_id: int, minute: int) -> int:
        at = self._index.get(class_id * KEY_SPAN + minute)
        return 0 if at is None else self.t_count[at]

    def columns(
        self,
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """Views of (class, minute, count); drop them before the next add."""
        return (
            np.frombuffer(self.t_class, dtype=np.int32),
            np.frombuffer(self.t_minute, dtype=np.int64),
            np.frombuffer(self.t_count, dtype=np.int64),
        )

    def nbytes(self) -> int:
        return len(self.t_count) * (4 + 8 + 8)
