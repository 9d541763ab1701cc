"""The top check: after a publish, re-read the top published rows and repair what differs.

Each publish offers its keys; at most once every `top_check_read_every_s`, the first
`top_check` of them not read in the last `top_check_every_s` are read from the table
together with the feed's head, in one snapshot, with a touch window opened before the
read (an event from then on marks its key, and a marked key is left to its event). The
read is judged only once the feed has delivered that head, at this publish or a later
one: until then a difference may be a write the feed has yet to deliver, not one it
missed. No new read is taken while one waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.feed import Feed
from store.base import RowsRead, ScheduleStore

log = logging.getLogger("renderqueue.keeper")

Clock = Callable[[], int]


class TopRead(msgspec.Struct, kw_only=True):
    """A top check's read, waiting for the feed to deliver what it saw."""

    keys: list[bytes]
    token: int  # the touch window opened before the read
    read: RowsRead
    read_at: int
    waited: bool = False


class TopChecked(msgspec.Struct, frozen=True, kw_only=True):
    """A judged read: rows compared and rows repaired (missed writes)."""

    checked: int
    repaired: int


class TopCheck:
    def __init__(
        self,
        core: KeeperCore,
        store: ScheduleStore,
        feed: Feed,
        config: KeeperConfig,
        clock: Clock,
    ) -> None:
        self.core = core
        self.store = store
        self.feed = feed
        self.config = config
        self.clock = clock
        self.pending: TopRead | None = None
        self.checked_at: dict[bytes, int] = {}  # key -> when last re-read
        self.next_read_at = 0  # no new read before then (top_check_read_every_s)
        self.waited = 0  # reads judged only once the feed caught up with them

    def after_publish(
        self, keys: list[bytes], now: int, drain: Callable[[], bool]
    ) -> TopChecked | None:
        """Take a read of the published `keys` (best first) or judge the waiting one.

        `drain()` applies the feed after a new read, as far as the keeper's budget for
        it goes (usually the read is then covered); False when the feed failed in it:
        the read is then left unjudged, for the keeper to drop (`drop`) before it does
        anything else. Returns what a judged read found, None if nothing was judged.
        """
        check = self.pending
        if check is None:
            check = self._read(keys, now)
            if check is None:
                return None
            self.pending = check
            if not drain():
                return None  # the feed failed meanwhile: its position judges nothing
        if not self.feed.has_delivered(check.read.head):
            if not check.waited:
                check.waited = True
                self.waited += 1
            return None
        self.pending = None
        names = [k.decode() for k in check.keys]
        try:
            tally = self.core.reconcile(
                names, {r.key: r for r in check.read.rows}, check.token, self.clock()
            )
        except Exception as exc:
            log.warning("keeper: top check failed (%s)", exc)
            return None
        finally:
            self.core.close_window(check.token)
        checked = self.checked_at
        for key in check.keys:
            checked[key] = check.read_at
        if tally.missed:
            log.warning("keeper: top check repaired %d rows", tally.missed)
        return TopChecked(checked=len(check.keys), repaired=tally.missed)

    def _read(self, keys: list[bytes], now: int) -> TopRead | None:
        if now < self.next_read_at:
            return None
        due_again = now - int(self.config.top_check_every_s * 1000)
        checked = self.checked_at
        if len(checked) > 16 * self.config.top_check:
            for key in [k for k, at in checked.items() if at <= due_again]:
                del checked[key]
        picked = [k for k in keys[: self.config.top_check] if checked.get(k, -1) <= due_again]
        if not picked:
            return None
        self.next_read_at = now + int(self.config.top_check_read_every_s * 1000)
        token = self.core.open_window()
        try:
            read = self.store.get_many_at([k.decode() for k in picked])
        except Exception as exc:
            self.core.close_window(token)
            log.warning("keeper: top check failed (%s)", exc)
            return None
        return TopRead(keys=picked, token=token, read=read, read_at=now)

    def drop(self) -> None:
        """Forget a waiting read unjudged (the feed failed: its position says nothing of
        what the read saw)."""
        if self.pending is not None:
            self.core.close_window(self.pending.token)
            self.pending = None
