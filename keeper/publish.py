"""The publish step: the best claimable rows into the ready ring, and its statistics.

Each publish selects the best `best_k` rows (due, route not paused, key neither
leased nor held: `KeeperCore.select` with the lease table's blocked mask taken at
the publish's `now`) and writes their keys into the ring as a new generation. What
follows a publish (status, the top check, the feed cursor, queue-state) is the
keeper's (keeper/runner.py).
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

    def blocked(self, now: int) -> BlockedMask:
        """The lease table's answer at `now`: which of the hashes are leased or held."""
        leases = self.leases

        def blocked(hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
            return leases.blocked_mask(hashes, now)

        return blocked

    def publish(self, now: int, refill: bool = False) -> list[bytes] | PublishFailed:
        """Publish the best rows; their keys, best first. Never raises: a failure is
        counted, logged and returned. `refill`: early, because claims drained the ring."""
        started = time.perf_counter_ns()
        try:
            selection = self.core.select(self.config.best_k, now, self.blocked(now))
            keys = self.core.queue.slots.keys(selection.slots)
            # Each entry carries its class's cadence: the grant's hold cap, so a claimant
            # grants first and reads the row once, after.
            cadence_s = (self.core.classes.cadence_ms()[selection.class_id] // 1000).astype(
                np.uint32
            )
            generation = self.ring.publish(
                keys, selection.due_at, selection.class_id, selection.key_hash, now, cadence_s
            )
        except Exception as exc:
            log.exception("keeper: publish failed")
            self.stats = msgspec.structs.replace(self.stats, failures=self.stats.failures + 1)
            return PublishFailed(f"publish failed: {type(exc).__name__}: {exc}")
        self.stats = msgspec.structs.replace(
            self.stats,
            publishes=self.stats.publishes + 1,
            refills=self.stats.refills + refill,
            last_at=now,
            last_count=len(keys),
            last_duration_us=(time.perf_counter_ns() - started) // 1000,
            last_considered=selection.considered,
            last_blocked=selection.blocked,
            generation=generation,
        )
        return keys

    def count_top_check(self, checked: TopChecked) -> None:
        self.stats = msgspec.structs.replace(
            self.stats,
            top_checked=self.stats.top_checked + checked.checked,
            top_repaired=self.stats.top_repaired + checked.repaired,
        )
