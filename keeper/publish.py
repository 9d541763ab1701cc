"""The publish step: the best claimable rows into the ready ring, and its statistics.

Each publish selects the best `best_k` rows (due, route not paused, key neither
leased nor held: the queue's selection with the lease table's blocked mask taken at
the publish's `now`) and writes their keys into the ring as a new generation. What
follows a publish (status, the top check, the feed cursor, queue-state) is the
keeper's (keeper/runner.py).

A publish runs on worker 0's thread and holds its GIL, stolen from claims, and a
claiming fleet drains the ring several times a second. So the keys go into the
ring as slices of the slot table's arena (`publish_slices`: one C copy, not a
bytes object per key and a join, which would hold the GIL for milliseconds), only the top check's
few keys are made bytes, and the selection's margin for blocked rows is the
number the last publish found ahead of its k-th row (the fleet's working set),
so a quarter of the top leased no longer costs a second read.

Each entry carries its key's site hash, for the claimant's per-site permit (the shm
SiteTable); where a SiteTable is attached, `allowances` reads how many more grants each
candidate's site can take, and the selection keeps a capped site to that many keys and
the slack (keeper/select.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.protocols import LeaseTableLike, ReadyRingLike, WriteMarksLike
from keeper.select import Allowances, BlockedMask
from keeper.state import PublishStats
from keeper.topcheck import TopChecked

log = logging.getLogger("renderqueue.keeper")


Fenced = Callable[[npt.NDArray[np.uint64], int], "npt.NDArray[np.bool_] | None"]
# Each site's grants left now (-1: no limit), for distinct site hashes, at a time.
SiteAllowances = Callable[[npt.NDArray[np.uint64], int], npt.NDArray[np.int64]]


class PublishFailed(msgspec.Struct, frozen=True):
    reason: str  # for the keeper's status: "publish failed: <type>: <message>"


class Publisher:
    def __init__(
        self,
        core: KeeperCore,
        ring: ReadyRingLike,
        leases: LeaseTableLike,
        config: KeeperConfig,
        marks: WriteMarksLike | None = None,
    ) -> None:
        self.core = core
        self.ring = ring
        self.leases = leases
        self.config = config
        self.marks = marks
        self._classes_named = 0  # class ids the marks segment names (ids only grow)
        self.stats = PublishStats()
        self._expect_blocked = 0  # blocked rows the last selection found ahead of its k-th
        # In a cluster: keys this node owns but may not grant yet (keeper.cluster fences).
        self.fenced: Fenced | None = None
        # Where sites are capped: each site's grants left at a publish's `now` (the shm
        # SiteTable's allowances); None publishes every site's keys by rank alone.
        self.site_allowances: SiteAllowances | None = None

    def blocked(self, now: int) -> BlockedMask:
        """Which of the hashes may not be granted at `now`: leased or held (the lease
        table), or what `beyond_leases` says."""
        leases, beyond = self.leases, self.beyond_leases(now)

        def blocked(hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
            mask = leases.blocked_mask(hashes, now)
            return mask if beyond is None else mask | beyond(hashes)

        return blocked

    def beyond_leases(self, now: int) -> BlockedMask | None:
        """What stops a key beside the lease table: (in a cluster) a fence, or a row still
        held though another node owns it now (the keeper drops those in chunks after an
        ownership change); None when nothing does."""
        fenced, core = self.fenced, self.core
        unowned = (
            (lambda hashes: core.ownership.owns_many(core.placements_of(hashes)))
            if core.dropping
            else None
        )
        if fenced is None and unowned is None:
            return None

        def beyond(hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
            mask = np.zeros(len(hashes), dtype=np.bool_)
            if fenced is not None:
                more = fenced(hashes, now)
                if more is not None:
                    mask |= more
            if unowned is not None:
                mask |= ~unowned(hashes)
            return mask

        return beyond

    def allowances(self, now: int) -> Allowances | None:
        """The SiteTable's allowances at `now`, as the selection asks them."""
        read = self.site_allowances
        if read is None:
            return None
        return lambda site_hashes: read(site_hashes, now)

    def publish(
        self, now: int, refill: bool = False, delivered_below: int = 0
    ) -> list[bytes] | PublishFailed:
        """Publish the best rows; the first `top_check` of their keys (what the top check
        reads), best first. Never raises: a failure is counted, logged and returned.
        `refill`: early, because claims drained the ring. `delivered_below`: the feed
        position the view holds every write below (shm.marks; 0 vouches for nothing)."""
        started, cpu_started = time.perf_counter_ns(), time.thread_time_ns()
        try:
            selection = self.core.select(
                self.config.best_k,
                now,
                self.beyond_leases(now),
                expect_blocked=self._expect_blocked,
                allowances=self.allowances(now),
                # One probe a row answers both whether and until when it is blocked.
                block_ends=lambda hashes: self.leases.blocked_until(hashes, now),
            )
            slots = self.core.queue.slots
            starts, lengths = slots.key_slices(selection.slots)
            # Each entry carries its class's cadence: the grant's hold cap, so a claimant
            # grants first and reads the row once, after. Divided once per class, then
            # gathered, rather than once per entry.
            per_class = (self.core.classes.cadence_ms() // 1000).astype(np.uint32)
            cadence_s = per_class.take(selection.class_id)
            if self.marks is not None:
                self._name_classes(self.marks, now)
                self.marks.set_view(self.ring.generation + 1, delivered_below)
            generation = self.ring.publish_slices(
                slots.arena,
                starts,
                lengths,
                selection.due_at,
                selection.class_id,
                selection.key_hash,
                now,
                cadence_s,
                self.core.queue.site_hashes_of(selection.slots),
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
            last_cpu_us=(time.thread_time_ns() - cpu_started) // 1000,
            last_considered=selection.considered,
            last_blocked=selection.blocked,
            last_passed=selection.passed,
            last_site_skipped=selection.site_skipped,
            last_sites_limited=selection.sites_limited,
            generation=generation,
        )
        self._expect_blocked = selection.blocked_ahead
        return keys

    def _name_classes(self, marks: WriteMarksLike, now: int) -> None:
        """Name new class ids for claimants (route, sitemap), which never change per id."""
        classes = self.core.classes
        if len(classes) == self._classes_named:
            return
        named = [(c.route, c.sitemap) for c in (classes.get(i) for i in range(len(classes)))]
        if marks.write_classes(named, now):
            self._classes_named = len(named)

    def count_top_check(self, checked: TopChecked) -> None:
        self.stats = msgspec.structs.replace(
            self.stats,
            top_checked=self.stats.top_checked + checked.checked,
            top_repaired=self.stats.top_repaired + checked.repaired,
        )
