"""The keeper's settings: one frozen record the node builds once and passes in."""

from __future__ import annotations

from typing import Annotated

import msgspec


class KeeperConfig(msgspec.Struct, frozen=True, kw_only=True):
    best_k: int = 4096  # keys published into the ready ring each second
    publish_interval_s: float = 1.0
    # A ring that claims have drained below this share of its last publish is refilled
    # at once rather than at the next tick (so claims are not capped at best_k per
    # interval), at most once per refill_min_gap_s.
    refill_below: float = 0.25
    refill_min_gap_s: float = 0.02
    report_interval_s: float = 5.0  # full queue-state; trust is refreshed at every publish
    verify_interval_s: float = 3600.0  # the verification walk compares every row with the table
    walk_chunk: int = 5000  # rows per store.walk call, during verification and resyncs
    # Rows per store.walk call while a load fills the queue: a chunk lands on most buckets
    # of a class a few rows each, so the fewer chunks the fewer appends (the keeper is not
    # exact yet, and a chunk read is still a short read transaction).
    load_chunk: int = 20000
    top_check: int = 64  # published rows re-read after each publish
    top_check_every_s: float = 60.0  # a key is re-read by the top check at most this often
    # A new top-check read at most this often: the interval publishes' pace. Refills come
    # as fast as claims drain the ring, and a read on each would read nearly every key the
    # fleet takes once more before its grant, for no more safety.
    top_check_read_every_s: float = 1.0
    sitemap_boost: float = 1.0  # added to a sitemap row's rank, in cadences
    stall_after_s: float = 2.0  # no publish for this long: readers see keeper_live false
    consumer: str = "keeper"  # the store's feed consumer name (its saved cursor)
    # The cursor is saved after a publish at most this often: each save is a write
    # transaction, contending with the fleet's completions for the store's lock, and a
    # restart replays at most this much of the log.
    cursor_save_interval_s: float = 1.0
    feed_poll_limit: int = 2000
    feed_backoff_s: float = 0.1  # first retry delay for a failed feed; doubles up to the max
    feed_backoff_max_s: float = 5.0
    class_rows_max: int = 256  # class rows in queue-state beyond this are cut, flagged truncated
    # A publish takes at most a capped site's allowance (the grants it can take now) plus
    # this many of its keys (keeper/select.py says why one).
    site_slack: Annotated[int, msgspec.Meta(ge=0)] = 1
