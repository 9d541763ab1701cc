"""A walk of the table by primary key, and what it found: load, verification or resync.

A walk opens a touch window on the keeper: a walked row is applied only if no
event touched its key since the window opened, since the event carries state
at least as new as the row read. At the end, held rows the walk never saw
(and no event touched) are not in the table: they are removed, as missed
deletes.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

WalkReason = Literal["load", "verify", "resync", "membership"]


class RepairTally(msgspec.Struct, kw_only=True):
    """What a self-check or walk found wrong and put right (mutable accumulator)."""

    missed_added: int = 0  # table rows the keeper lacked
    missed_changed: int = 0  # held rows that differed from the table (due, class or version)
    missed_removed: int = 0  # held rows the table no longer has
    gained: int = 0  # rows added because ownership changed: not a missed write
    held_newer: int = 0  # the keeper's row was newer than the table's: left alone
    skipped_touched: int = 0  # an event touched the key after the read: the event stands

    @property
    def missed(self) -> int:
        return self.missed_added + self.missed_changed + self.missed_removed

    def add(self, other: RepairTally) -> None:
        for field in self.__struct_fields__:
            setattr(self, field, getattr(self, field) + getattr(other, field))

    def snapshot(self) -> RepairCounts:
        return RepairCounts(**msgspec.structs.asdict(self))


class RepairCounts(msgspec.Struct, frozen=True, kw_only=True):
    missed_added: int = 0
    missed_changed: int = 0
    missed_removed: int = 0
    gained: int = 0
    held_newer: int = 0
    skipped_touched: int = 0

    @property
    def missed(self) -> int:
        """Writes the feed never delivered (or corruption), put right."""
        return self.missed_added + self.missed_changed + self.missed_removed


class WalkSummary(msgspec.Struct, frozen=True, kw_only=True):
    reason: WalkReason
    started_at: int
    finished_at: int | None
    rows: int  # rows read from the table
    chunks: int
    loaded: int  # rows added by a load walk (not repairs)
    unreadable: int
    repairs: RepairCounts


class Walk:
    def __init__(
        self, reason: WalkReason, token: int, started_at: int, *, judges: bool = True
    ) -> None:
        self.reason: WalkReason = reason
        self.token = token  # the touch window this walk reads under
        # False only for a load into an empty queue: every row held during it came from an
        # event inside its window, so a walked row is either new (loaded) or left to its
        # event, and nothing it reads is compared with a held row.
        self.judges = judges
        self.started_at = started_at
        self.finished_at: int | None = None
        self.after: str | None = None  # the last key read; the next chunk starts after it
        self.rows = 0
        self.chunks = 0
        self.loaded = 0
        self.unreadable = 0
        self.repairs = RepairTally()
        self._seen = np.zeros(1024, dtype=np.bool_)
        self.retired_seen: set[int] = set()  # retired rows' key hashes it read

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def mark_seen(self, slots: npt.NDArray[np.int32]) -> None:
        if not len(slots):
            return
        top = int(slots.max()) + 1
        if top > len(self._seen):
            grown = np.zeros(max(top, len(self._seen) * 2), dtype=np.bool_)
            grown[: len(self._seen)] = self._seen
            self._seen = grown
        self._seen[slots] = True

    def unseen(self, slots: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        inside = slots < len(self._seen)
        seen = np.zeros(len(slots), dtype=np.bool_)
        seen[inside] = self._seen[slots[inside]]
        return slots[~seen]

    def summary(self) -> WalkSummary:
        return WalkSummary(
            reason=self.reason,
            started_at=self.started_at,
            finished_at=self.finished_at,
            rows=self.rows,
            chunks=self.chunks,
            loaded=self.loaded,
            unreadable=self.unreadable,
            repairs=self.repairs.snapshot(),
        )
