"""The keeper's change feed: subscribe, read to the end, and come back after a failure.

A failed feed is closed and reopened after a backoff that doubles up to a cap,
at the cursor it had reached; if the store pruned past that cursor (or the log
went backwards) it reopens at the head instead, and says so, since only a full
walk can then put right what was missed. Whoever owns the feed decides what a
reopen means (the keeper walks the table either way).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from store.base import (
    Cursor,
    CursorAhead,
    CursorBelowFloor,
    FeedBatch,
    FeedStatistics,
    RowRecords,
    ScheduleStore,
    Subscription,
)
from store.rows import FeedEvent, LogRecord

log = logging.getLogger("renderqueue.keeper")

Apply = Callable[[Sequence[FeedEvent], int], None]
ApplyRecords = Callable[[list[LogRecord], int], None]


class Feed:
    def __init__(
        self,
        store: ScheduleStore,
        consumer: str,
        *,
        poll_limit: int,
        backoff_s: float,
        backoff_max_s: float,
        clock: Callable[[], int],
    ) -> None:
        self.store = store
        self.consumer = consumer
        self.poll_limit = poll_limit
        self.clock = clock
        self._first_backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self.backoff_s = backoff_s
        self.sub: Subscription | None = None
        self.cursor: Cursor | None = None
        self.reopen_at = 0
        self.caught_up_at = 0
        self.failures = 0
        self.reopens = 0
        self.cursor_resets = 0  # reopened at the head: the cursor reached was pruned or ahead

    @property
    def open(self) -> bool:
        return self.sub is not None

    def subscribe(self, now: int, *, resume: bool) -> None:
        """Open at the cursor reached (resume) or at the head; raises what the store raises."""
        sub: Subscription | None = None
        if resume and self.cursor is not None:
            try:
                sub = self.store.subscribe(self.consumer, self.cursor)
            except (CursorBelowFloor, CursorAhead) as exc:
                log.warning("keeper: feed cursor unusable (%s); reopening at the head", exc)
                self.cursor_resets += 1
        if sub is None:
            sub = self.store.subscribe(self.consumer, self.store.feed_head())
        self.sub = sub
        self.cursor = sub.cursor
        self.backoff_s = self._first_backoff_s
        self.caught_up_at = now
        if resume:
            self.reopens += 1

    def failed(self, exc: BaseException, now: int) -> None:
        """Close the feed and schedule its reopening."""
        self.failures += 1
        log.warning(
            "keeper: feed failed (%s: %s); reopening in %.1f s",
            type(exc).__name__,
            exc,
            self.backoff_s,
        )
        self.close()
        self.reopen_at = now + int(self.backoff_s * 1000)
        self.backoff_s = min(self.backoff_s * 2, self._backoff_max_s)

    def drain(self, apply: Apply, until_ms: int, apply_records: ApplyRecords | None = None) -> bool:
        """Apply batches until the feed is empty or `until_ms`; True when it was emptied.

        A batch short of its limit held everything committed when it was read: no empty
        poll after it (two read transactions a wake-up, under a steady stream of writes).
        `apply_records`: where the subscription can answer with row records (a
        RecordSubscription's RowRecords), they go there, no event made of them.

        Raises what the subscription raises; the caller calls `failed`.
        """
        sub = self.sub
        if sub is None:
            return True
        if sub.quiet():  # nothing announced since the last read: as caught up as it was
            self.caught_up_at = self.clock()
            return True
        poll: Callable[[int], FeedBatch | RowRecords] = sub.poll
        if apply_records is not None:  # a RecordSubscription's, where it is one
            poll = getattr(sub, "poll_records", poll)
        while True:
            batch = poll(self.poll_limit)
            now = self.clock()
            self.cursor = batch.cursor
            if isinstance(batch, RowRecords):
                if batch.records and apply_records is not None:
                    apply_records(batch.records, now)
            elif batch.events:
                apply(batch.events, now)
            if not batch.more:
                self.caught_up_at = now
                return True
            if self.clock() >= until_ms:
                return False

    def has_delivered(self, head: Cursor) -> bool:
        """True when the open feed has handed every event up to `head` to `apply`."""
        return self.sub is not None and self.sub.has_delivered(head)

    def delivered_below(self) -> int:
        """The open feed's position (Subscription.delivered_below); 0 while closed."""
        return 0 if self.sub is None else self.sub.delivered_below()

    def wait(self, seconds: float) -> None:
        if self.sub is not None:
            self.sub.wait(seconds)

    def save(self) -> None:
        if self.sub is not None:
            self.sub.save()

    def statistics(self) -> FeedStatistics | None:
        """The open subscription's counts (since it opened), the backend's own fields left
        out; None while the feed is closed. Never raises: another thread may be closing it."""
        sub = self.sub
        if sub is None:
            return None
        try:
            return sub.statistics().common()
        except Exception:
            log.debug("keeper: feed statistics failed", exc_info=True)
            return None

    def close(self) -> None:
        if self.sub is not None:
            try:
                self.sub.close()
            except Exception:
                log.debug("keeper: closing the feed failed", exc_info=True)
            self.sub = None
