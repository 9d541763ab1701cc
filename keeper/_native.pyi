"""Types of the C extension (keeper/_native.c)."""

from typing import Any

def best_read(
    starts_of: list[list[int]],
    ids_of: list[list[int]],
    members: list[Any],
    records: Any,
    cadence: list[float],
    boost: list[float],
    paused: list[bool],
    now: int,
    need: int,
    out_slots: Any,
    out_rank: Any,
    out_due: Any,
    out_hash: Any,
    out_class: Any,
    /,
) -> tuple[int, int, float]: ...
def keep_unblocked(
    blocked: Any,
    limit: int,
    out_slots: Any,
    out_rank: Any,
    out_due: Any,
    out_hash: Any,
    out_class: Any,
    /,
) -> int: ...
def find_many(table: Any, records: Any, mask: int, hashes: Any, out: Any, /) -> None: ...
def index_many(table: Any, records: Any, mask: int, hashes: Any, slots: Any, /) -> None: ...
def upsert_moved(
    records: Any,
    b_class: Any,
    b_live: Any,
    b_stale: Any,
    b_split_at: Any,
    starts_of: list[list[int]],
    ids_of: list[list[int]],
    members: list[Any],
    tally_counts: list[Any],
    tally_base: list[int],
    buckets: Any,
    merge_below: int,
    stale_slack: int,
    table: Any,
    mask: int,
    key_hash: int,
    class_id: int,
    due: int,
    version: int,
    now: int,
    /,
) -> int: ...
