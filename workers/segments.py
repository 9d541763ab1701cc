"""The node's shared-memory segments: the supervisor creates them, every worker attaches.

Names carry the instance id, so two nodes on one machine (or two test runs) never meet,
and a crashed run's segments are found by the next run of the same node and replaced:
its lease table's slots first adopted (shm/lease_survivor.py, workers/supervisor.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import msgspec

from api.report import MAX_REPORT_BYTES
from api.site_history import HISTORY_BYTES
from shm import LeaseTable, ReadyRing, SiteTable, StateBuffer, segment_name
from shm.marks import WriteMarks
from shm.segment import remove as remove_segment
from shm.sites import FailurePolicy
from workers.config import MAX_WORKERS, Settings

# The supervisor's statistics: a worker's report (api.report) is one pipe write at most,
# so the record of the most workers with the longest reports fits, with room for the rest.
SUPERVISOR_STATE_BYTES = 64 * 1024 + MAX_WORKERS * MAX_REPORT_BYTES
# The keeper's statistics (keeper.state.KeeperStatistics): about 1 KB of msgpack, fixed
# in shape; only its reason strings vary, and 16 KiB leaves them ample room. A record that
# does not fit is refused whole and counted (statistics_write_failures), never truncated.
KEEPER_STATE_BYTES = 16 * 1024
# The keeper's sites listing (keeper.state.SiteList): SITES_LISTED sites of some 60 bytes
# of msgpack each, names up to 253 bytes; one too large is cut in half until it fits.
SITE_LIST_BYTES = 512 * 1024


class SegmentNames(msgspec.Struct, frozen=True, kw_only=True):
    ring: str
    leases: str
    state: str
    supervisor: str
    keeper: str
    marks: str
    site_list: str
    sites: str
    site_history: str

    @classmethod
    def for_instance(cls, instance: str) -> SegmentNames:
        return cls(
            ring=segment_name(instance, "ring"),
            leases=segment_name(instance, "leases"),
            state=segment_name(instance, "state"),
            supervisor=segment_name(instance, "supervisor"),
            keeper=segment_name(instance, "keeper"),
            marks=segment_name(instance, "marks"),
            site_list=segment_name(instance, "sitelist"),
            sites=segment_name(instance, "sites"),
            site_history=segment_name(instance, "sitehist"),
        )

    def remove(self) -> None:
        """Unlink whichever of these segments exist: a node whose supervisor was SIGKILLed
        left them, and a harness done with its instance cleans up after it."""
        for name in msgspec.structs.astuple(self):
            remove_segment(name)


class SiteTableSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The site table's shape and the node's defaults (workers.config: site_*)."""

    slots: int = 1 << 13
    permits: int = 64
    default_max_in_flight: int | None = None
    default_min_interval_ms: int = 0
    failures: FailurePolicy = FailurePolicy()

    @classmethod
    def of(cls, settings: Settings) -> SiteTableSettings:
        return cls(
            slots=settings.site_slots,
            permits=settings.site_permits_max,
            default_max_in_flight=settings.site_max_in_flight,
            default_min_interval_ms=settings.site_min_interval_ms,
            failures=settings.site_failures(),
        )


@dataclass(eq=False)
class Segments:
    names: SegmentNames
    ring: ReadyRing
    leases: LeaseTable
    state: StateBuffer
    supervisor: StateBuffer
    keeper: StateBuffer
    marks: WriteMarks
    site_list: StateBuffer
    sites: SiteTable
    site_history: StateBuffer

    def __post_init__(self) -> None:
        # Every lease this node grants takes and gives back its site's permits.
        self.leases.use_sites(self.sites)

    @classmethod
    def create(
        cls,
        names: SegmentNames,
        *,
        ring_entries: int,
        lease_slots: int,
        hash_secret: bytes | None = None,
        sites: SiteTableSettings | None = None,
    ) -> Segments:
        """`hash_secret`: the store's, which the lease table records by its fingerprint so
        that a start after a crash can adopt it (shm/lease_survivor.py)."""
        site_settings = sites or SiteTableSettings()
        created: list[ReadyRing | LeaseTable | StateBuffer | WriteMarks | SiteTable] = []
        try:
            ring = ReadyRing.create(names.ring, capacity=ring_entries)
            created.append(ring)
            leases = LeaseTable.create(names.leases, capacity=lease_slots, secret=hash_secret)
            created.append(leases)
            state = StateBuffer.create(names.state)
            created.append(state)
            supervisor = StateBuffer.create(names.supervisor, capacity=SUPERVISOR_STATE_BYTES)
            created.append(supervisor)
            keeper = StateBuffer.create(names.keeper, capacity=KEEPER_STATE_BYTES)
            created.append(keeper)
            marks = WriteMarks.create(names.marks)
            created.append(marks)
            site_list = StateBuffer.create(names.site_list, capacity=SITE_LIST_BYTES)
            created.append(site_list)
            site_table = SiteTable.create(
                names.sites,
                capacity=site_settings.slots,
                permits=site_settings.permits,
                default_max_in_flight=site_settings.default_max_in_flight,
                default_min_interval_ms=site_settings.default_min_interval_ms,
                failures=site_settings.failures,
            )
            created.append(site_table)
            site_history = StateBuffer.create(names.site_history, capacity=HISTORY_BYTES)
        except BaseException:
            for segment in created:
                segment.close()
                segment.unlink()
            raise
        return cls(
            names,
            ring,
            leases,
            state,
            supervisor,
            keeper,
            marks,
            site_list,
            site_table,
            site_history,
        )

    @classmethod
    def attach(cls, names: SegmentNames) -> Segments:
        return cls(
            names,
            ReadyRing.attach(names.ring),
            LeaseTable.attach(names.leases),
            StateBuffer.attach(names.state),
            StateBuffer.attach(names.supervisor),
            StateBuffer.attach(names.keeper),
            WriteMarks.attach(names.marks),
            StateBuffer.attach(names.site_list),
            SiteTable.attach(names.sites),
            StateBuffer.attach(names.site_history),
        )

    def _all(
        self,
    ) -> tuple[ReadyRing | LeaseTable | StateBuffer | WriteMarks | SiteTable, ...]:
        return (
            self.ring,
            self.leases,
            self.state,
            self.supervisor,
            self.keeper,
            self.marks,
            self.site_list,
            self.sites,
            self.site_history,
        )

    def close(self) -> None:
        for segment in self._all():
            segment.close()

    def unlink(self) -> None:
        for segment in self._all():
            # Already gone is fine: unlink is idempotent for the caller.
            with contextlib.suppress(Exception):
                segment.unlink()
