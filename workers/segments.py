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
from shm import LeaseTable, ReadyRing, StateBuffer, segment_name
from shm.marks import WriteMarks
from shm.segment import remove as remove_segment
from workers.config import MAX_WORKERS

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
        )

    def remove(self) -> None:
        """Unlink whichever of these segments exist: a node whose supervisor was SIGKILLed
        left them, and a harness done with its instance cleans up after it."""
        for name in msgspec.structs.astuple(self):
            remove_segment(name)


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

    @classmethod
    def create(
        cls,
        names: SegmentNames,
        *,
        ring_entries: int,
        lease_slots: int,
        hash_secret: bytes | None = None,
    ) -> Segments:
        """`hash_secret`: the store's, which the lease table records by its fingerprint so
        that a start after a crash can adopt it (shm/lease_survivor.py)."""
        created: list[ReadyRing | LeaseTable | StateBuffer | WriteMarks] = []
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
        except BaseException:
            for segment in created:
                segment.close()
                segment.unlink()
            raise
        return cls(names, ring, leases, state, supervisor, keeper, marks, site_list)

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
        )

    def _all(self) -> tuple[ReadyRing | LeaseTable | StateBuffer | WriteMarks, ...]:
        return (
            self.ring,
            self.leases,
            self.state,
            self.supervisor,
            self.keeper,
            self.marks,
            self.site_list,
        )

    def close(self) -> None:
        for segment in self._all():
            segment.close()

    def unlink(self) -> None:
        for segment in self._all():
            # Already gone is fine: unlink is idempotent for the caller.
            with contextlib.suppress(Exception):
                segment.unlink()
