"""The publish step: the best claimable rows into the ready ring, and its statistics.

Each publish selects the best `best_k` rows (due, route not paused, key neither
leased nor held: the queue's selection with the lease table's blocked mask taken at
the publish's `now`) and writes their keys into the ring as a new generation. What
follows a publish (status, the top check, the feed cursor, queue-state) is the
keeper's (keeper/runner.py).

A publish runs on worker 0's thread and holds its GIL, stolen from claims, and a
claiming fleet drains the ring several times a second. So the keys go into the
ring as slices of the slot table's arena (`publish_slices`: one C copy, where a
bytes object per key and a join took some 4 ms for 8,192), only the top check's
few keys are made bytes, and the selection's margin for blocked rows is the
number the last publish found ahead of its k-th row (the fleet's working set),
so a quarter of the top leased no longer costs a second read.
"""

from __future__ import annotations

import logging
import time

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.protocols import LeaseTableLike, ReadyRingLike
from keeper.select import BlockedMask
from keeper.state import PublishStats
from keeper.topcheck import TopChecked

log = logging.getLogger("renderqueue.keeper")


class PublishFailed(msgspec.Struct, frozen=True):
    reason: str  # for the keeper's status: "publish failed: <type>: <message>"


class Publisher:
    def __init__(
        self,
        core: KeeperCore,
        ring: ReadyRingLike,
        leases: LeaseTableLike,
        config: KeeperConfig,
    ) -> None:
        self.core = core
        self.ring = ring
        self.leases = leases
        self.config = config
        self.stats = PublishStats()
        self._expect_blocked = 0  # blocked rows the last selection found ahead of its k-th

    def blocked(self, now: int) -> BlockedMask:
        """The lease table's answer at `now`: which of the hashes are leased or held."""
        leases = self.leases

        def blocked(hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
            return leases.blocked_mask(hashes, now)

        return blocked

    def publish(self, now: int, refill: bool = False) -> list[bytes] | PublishFailed:
        """Publish the best rows; the first `top_check` of their keys (what the top check
        reads), best first. Never raises: a failure is counted, logged and returned.
        `refill`: early, because claims drained the ring."""
        started = time.perf_counter_ns()
        try:
            selection = self.core.select(
                self.config.best_k, now, self.blocked(now), expect_blocked=self._expect_blocked
            )
            slots = self.core.queue.slots
            starts, lengths = slots.key_slices(selection.slots)
            # Each entry carries its class's cadence: the grant's hold cap, so a claimant
            # grants first and reads the row once, after. Divided per class, then
            # gathered: a float division per entry took 0.13 ms of 8,192.
            per_class = (self.core.classes.cadence_ms() // 1000).astype(np.uint32)
            cadence_s = per_class.take(selection.class_id)
            generation = self.ring.publish_slices(
                slots.arena,
                starts,
                lengths,
                selection.due_at,
                selection.class_id,
                selection.key_hash,
                now,
                cadence_s,
            )
            keys = slots.keys(selection.slots[: self.config.top_check])
        except Exception as exc:
            log.exception("keeper: publish failed")
            self.stats = msgspec.structs.replace(self.stats, failures=self.stats.failures + 1)
            return PublishFailed(f"publish failed: {type(exc).__name__}: {exc}")
        self.stats = msgspec.structs.replace(
            self.stats,
            publishes=self.stats.publishes + 1,
            refills=self.stats.refills + refill,
            last_at=now,
            last_count=self.ring.published_count(),  # the selection, unless the ring cut it
            last_duration_us=(time.perf_counter_ns() - started) // 1000,
            last_considered=selection.considered,
            last_blocked=selection.blocked,
            generation=generation,
        )
        self._expect_blocked = selection.blocked_ahead
        return keys

    def count_top_check(self, checked: TopChecked) -> None:
        self.stats = msgspec.structs.replace(
            self.stats,
            top_checked=self.stats.top_checked + checked.checked,
            top_repaired=self.stats.top_repaired + checked.repaired,
        )
