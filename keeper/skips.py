"""Rows a selection passes over for a while: keys found leased or held.

Under a claiming fleet the leased keys are the top of the queue, the fleet's work in
flight. Without this, every publish reads each of them from its bucket, ranks it, sorts
it among the candidates and probes the lease table for it, a cost that grows with the
work in flight rather than with the ring. A row found blocked is marked here with the
block's end, and the read (`QueueView.best_read`) passes over it in C until then.

A mark names its row by hash and version, so a write of the row (a completion's, a
"render now") or the slot's reuse by another key ends it at once. A lease can also end
without its row's version moving after the mark: a completion releases its lease just
after its write, and the keeper may read the write and probe the lease between the two.
So no mark outlasts `RECHECK_MS`: such a key is published again within that, and a
renewed lease or a hold that follows an unanswered one is read by the next probe.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from keeper._native import QueueView
from keeper.state import SkipStatistics

# The table's columns: slot (-1: empty), until (epoch ms), tag (keeper/csrc/skips.h).
SkipTable = tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.uint64]]

# The longest a row is passed over on one probe's word: a few publish periods, so the
# probes of the work in flight fall from one a publish to one a second.
RECHECK_MS = 1000
# The table's first size; it doubles past a quarter live (keeps chains short).
FIRST_CAPACITY = 1024


class RowSkips:
    """The marks, a table by slot that only the keeper's thread writes: its rows
    sized by the work in flight, never by the queue (keeper/csrc/skips.h)."""

    def __init__(self) -> None:
        self._columns: SkipTable | None = None
        self._taken = 0  # entries ever filled, live or dead, since the last rebuild
        self._marked = 0
        self._rebuilds = 0

    def columns(self) -> SkipTable | None:
        """What `best_read` takes: the table, or None before any mark."""
        return self._columns

    def mark(
        self,
        view: QueueView,
        slots: npt.NDArray[np.int32],
        ends: npt.NDArray[np.int64],
        now_ms: int,
    ) -> int:
        """Pass over each slot's row until its block's end, or `RECHECK_MS` on, the
        earlier; an end at or before `now_ms` (no block the lease table knows of: a
        fence, an unowned key) marks nothing. The number of rows marked."""
        keep = ends > now_ms
        count = int(np.count_nonzero(keep))
        if count == 0:
            return 0
        # Every chain must end at an empty entry: rebuild before half the table is used.
        columns = self._columns
        if columns is None or 2 * (self._taken + count) > len(columns[0]):
            columns = self._rebuild(view, count, now_ms)
        until = np.minimum(ends[keep], now_ms + RECHECK_MS).astype(np.int64)
        written, taken = view.skip_rows(
            np.ascontiguousarray(slots[keep], dtype=np.int32), until, columns, now_ms, None
        )
        self._taken += taken
        self._marked += written
        return int(written)

    def _rebuild(self, view: QueueView, more: int, now_ms: int) -> SkipTable:
        """A fresh table holding the live entries, room for `more`, at most a quarter
        full after them."""
        old = self._columns
        live = np.flatnonzero(old[1] > now_ms) if old is not None else np.empty(0, np.int64)
        capacity = FIRST_CAPACITY
        while capacity < 4 * (len(live) + more):
            capacity *= 2
        columns: SkipTable = (
            np.full(capacity, -1, dtype=np.int32),
            np.zeros(capacity, dtype=np.int64),
            np.zeros(capacity, dtype=np.uint64),
        )
        taken = 0
        if old is not None and len(live):
            _, taken = view.skip_rows(
                old[0][live], old[1][live], columns, now_ms, np.ascontiguousarray(old[2][live])
            )
        self._columns, self._taken = columns, int(taken)
        self._rebuilds += 1
        return columns

    def nbytes(self) -> int:
        """Bytes in the table's columns."""
        return 0 if self._columns is None else sum(column.nbytes for column in self._columns)

    def statistics(self) -> SkipStatistics:
        capacity = 0 if self._columns is None else len(self._columns[0])
        return SkipStatistics(marked=self._marked, capacity=capacity, rebuilds=self._rebuilds)
