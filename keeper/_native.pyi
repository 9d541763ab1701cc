"""Types of the C extension (keeper/csrc/); `make typecheck` runs stubtest against the build.

The objects hold the structures they are given (by reference: the arrays grow in
place) and check their types once, when made."""

from array import array
from typing import Any, final

import numpy as np
import numpy.typing as npt

# The skip table's columns (keeper.skips.SkipTable): slot, until, tag.
_SkipTable = tuple[npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.uint64]]

@final
class SlotIndex:
    """The slot table's index (int32 slot numbers, -1 empty, a power-of-two length)
    over its records (four uint64 words per slot, the hash first)."""

    def __init__(self, records: array[int], table: array[int]) -> None: ...
    def find_many(self, hashes: npt.NDArray[np.uint64], out: npt.NDArray[np.int32], /) -> None: ...
    def index_many(
        self, hashes: npt.NDArray[np.uint64], slots: npt.NDArray[np.int32], /
    ) -> None: ...

@final
class Picked:
    """The columns a best read fills, of one length: held until the object goes."""

    def __init__(
        self,
        slots: npt.NDArray[np.int32],
        rank: npt.NDArray[np.float64],
        due: npt.NDArray[np.int64],
        hash: npt.NDArray[np.uint64],
        class_id: npt.NDArray[np.int32],
    ) -> None: ...
    @property
    def size(self) -> int: ...
    def keep_unblocked(self, blocked: npt.NDArray[np.bool_], limit: int, /) -> tuple[int, int]: ...
    def keep_within(
        self,
        blocked: npt.NDArray[np.bool_],
        limit: int,
        site_ids: npt.NDArray[np.int32],
        budget: npt.NDArray[np.int64],
        /,
    ) -> tuple[int, int, int, int]: ...

@final
class FeedShape:
    """What apply_moves takes a feed row event to be."""

    def __init__(self, row_type: type, class_cache: dict[Any, int], max_due: int) -> None: ...

@final
class QueueView:
    """The held queue's structures, bound once by name, for its C paths."""

    def __init__(
        self,
        *,
        index: SlotIndex,
        b_class: array[int],
        b_live: array[int],
        b_stale: array[int],
        b_split_at: array[int],
        starts: list[list[int]],
        ids: list[list[int]],
        members: list[array[int]],
        tally_counts: list[array[int]],
        tally_base: list[int],
        buckets: Any,
        merge_below: int,
        stale_slack: int,
    ) -> None: ...
    def best_read(
        self,
        cadence: list[float],
        boost: list[float],
        paused: list[bool],
        now: int,
        out: Picked,
        skips: _SkipTable | None,
        /,
    ) -> tuple[int, int, float, int]: ...
    def skip_rows(
        self,
        slots: npt.NDArray[np.int32],
        until: npt.NDArray[np.int64],
        skips: _SkipTable,
        now: int,
        tags: npt.NDArray[np.uint64] | None,
        /,
    ) -> tuple[int, int]: ...
    def upsert_moved(
        self, key_hash: int, class_id: int, due: int, version: int, now: int, /
    ) -> int: ...
    def apply_moves(
        self,
        events: list[Any],
        start: int,
        hashes: list[int],
        shape: FeedShape,
        touched: dict[int, int] | None,
        epoch: int,
        now: int,
        tally: list[int],
        /,
    ) -> int: ...
    def apply_records(
        self,
        records: list[Any],
        start: int,
        hashes: npt.NDArray[np.uint64],
        shape: FeedShape,
        touched: dict[int, int] | None,
        epoch: int,
        now: int,
        tally: list[int],
        /,
    ) -> int: ...

@final
class BucketOps:
    """A bucket's entries rewritten in one call (keeper/buckets.py)."""

    def __init__(
        self,
        *,
        index: SlotIndex,
        members: list[array[int]],
        b_live: array[int],
        b_stale: array[int],
    ) -> None: ...
    def compact(self, bucket: int, source: int, /) -> int: ...
    def refill(self, bucket: int, slots: npt.NDArray[np.int32] | array[int], /) -> None: ...
    def sort_cut(self, bucket: int, pieces: int, /) -> list[tuple[int, int]]: ...
