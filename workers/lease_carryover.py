"""The lease table carried across a restart of the node.

Before any worker spawns, a start takes the slots of the table a run killed whole left in
shared memory (shm/lease_survivor.py says what it checks first), or else the leases a
graceful stop wrote to the snapshot file (shm/lease_snapshot.py). The surviving table
wins when both exist, and the file is set aside: it is the same table or an older one,
and loaded by a later start it would bring back leases that have since ended. A table or
file that cannot be taken is logged with why and set aside, and the node starts with an
empty table. A graceful stop writes the file once its workers have exited.

`LeaseCarryover.recovery` records what this run's table started from; the supervisor
publishes it in its statistics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shm import lease_snapshot, lease_survivor
from shm.leases import LeaseTable
from shm.segment import now_ms
from workers import logs
from workers.config import Settings

# The supervisor's logger: these events are the supervisor's start and stop, and an
# operator's log queries name them so.
log = logs.get_logger("supervisor")


class LeaseRecovery(msgspec.Struct, frozen=True, kw_only=True):
    """What this run's lease table started from, counted when it was taken."""

    # "segment": the table a killed run left in shared memory, adopted;
    # "snapshot": the file a graceful stop wrote; "none": an empty table.
    source: str
    occupied: int = 0
    live_leases: int = 0
    held_keys: int = 0
    segment_rejected: str | None = None  # why a surviving table was not adopted
    snapshot_rejected: str | None = None  # why a snapshot file was set aside


def lease_snapshot_path(settings: Settings, instance: str) -> Path:
    if settings.lease_snapshot:
        return Path(settings.lease_snapshot).expanduser()
    sqlite_path = settings.sqlite_path()
    if sqlite_path is not None:
        return Path(f"{sqlite_path}.leases")
    return Path("var") / f"{instance}.leases"


@dataclass(eq=False)
class LeaseCarryover:
    """One node instance's snapshot file and surviving table, keyed by the store's
    hash secret (a table or file made under another secret is refused)."""

    settings: Settings
    instance: str
    secret: bytes
    recovery: LeaseRecovery | None = None  # None until `restore`

    @property
    def inherited(self) -> bool:
        """The previous run's leases were restored or adopted into this run's table."""
        return self.recovery is not None and self.recovery.source != "none"

    @property
    def path(self) -> Path:
        return lease_snapshot_path(self.settings, self.instance)

    def find_survivor(self, name: str, wait_s: float) -> lease_survivor.Survivor | None:
        """The lease table a run killed whole left under `name`, if this node can take it,
        waiting up to `wait_s` for its processes to exit; a table it cannot take is logged
        with why, and the create that follows replaces it. Called before that create."""

        def waiting(pids: list[int]) -> None:
            logs.event(
                log,
                "lease_table_adoption_waiting",
                segment=name,
                pids=pids,
                detail="a previous run's processes still map the lease table; waiting for "
                "them to exit before taking it over",
            )

        try:
            found = lease_survivor.find(
                name,
                capacity=self.settings.lease_slots,
                secret=self.secret,
                wait_s=wait_s,
                on_wait=waiting,
            )
        except Exception as exc:  # find reports a table it refuses; this is the unforeseen
            found = lease_survivor.Refused(name=name, reason=f"{type(exc).__name__}: {exc}")
        if isinstance(found, lease_survivor.Refused):
            self.recovery = LeaseRecovery(source="none", segment_rejected=found.reason)
            logs.event(
                log,
                "lease_table_not_adopted",
                logging.WARNING,
                segment=found.name,
                reason=found.reason,
                detail="replacing it with an empty lease table",
            )
            return None
        return found

    def restore(self, table: LeaseTable, survivor: lease_survivor.Survivor | None) -> None:
        """Into the fresh `table`, before any worker spawns: the survivor's slots, or else
        the snapshot's leases. A bad file is logged and set aside."""
        if survivor is not None and self._adopt(table, survivor):
            return
        # What find_survivor or _adopt said of a table it could not take.
        recovery = self.recovery or LeaseRecovery(source="none")
        self.recovery = recovery
        try:
            outcome = lease_snapshot.restore(
                self.path, table, instance=self.instance, secret=self.secret, now_ms=now_ms()
            )
        except Exception as exc:  # restore reports a bad file itself; this is the unforeseen
            self.recovery = msgspec.structs.replace(recovery, snapshot_rejected=repr(exc))
            logs.event(
                log, "lease_snapshot_rejected", logging.ERROR, path=str(self.path), reason=repr(exc)
            )
            return
        if isinstance(outcome, lease_snapshot.Rejected):
            self.recovery = msgspec.structs.replace(recovery, snapshot_rejected=outcome.reason)
            logs.event(
                log,
                "lease_snapshot_rejected",
                logging.WARNING,
                path=outcome.path,
                reason=outcome.reason,
                moved_to=outcome.moved_to,
                detail="starting with an empty lease table",
            )
        elif isinstance(outcome, lease_snapshot.Restored):
            self.recovery = msgspec.structs.replace(
                recovery,
                source="snapshot",
                occupied=outcome.occupied,
                live_leases=outcome.live_leases,
                held_keys=outcome.held_keys,
            )
            logs.event(
                log,
                "lease_snapshot_restored",
                path=outcome.path,
                age_ms=outcome.age_ms,
                occupied=outcome.occupied,
                live_leases=outcome.live_leases,
                held_keys=outcome.held_keys,
            )
            if not outcome.removed:
                logs.event(
                    log,
                    "lease_snapshot_not_removed",
                    logging.WARNING,
                    path=outcome.path,
                    detail="remove it by hand: a start that finds no lease table left by a "
                    "crash would load it again",
                )

    def _adopt(self, table: LeaseTable, survivor: lease_survivor.Survivor) -> bool:
        """Take the surviving table's slots into `table` and set the snapshot file aside;
        False (logged, the table left empty) if the import fails."""
        try:
            adopted = lease_survivor.adopt(survivor, table, now_ms())
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            self.recovery = LeaseRecovery(source="none", segment_rejected=reason)
            logs.event(
                log,
                "lease_table_not_adopted",
                logging.WARNING,
                segment=survivor.name,
                reason=reason,
                detail="its slots could not be imported; starting with an empty lease table",
            )
            return False
        path = self.path
        had_snapshot = path.exists()
        superseded = lease_snapshot.set_aside(path, lease_snapshot.SUPERSEDED_SUFFIX)
        logs.event(
            log,
            "lease_table_adopted",
            segment=adopted.name,
            previous_pid=adopted.owner_pid,
            previous_created_at=adopted.created_at,
            occupied=adopted.occupied,
            live_leases=adopted.live_leases,
            held_keys=adopted.held_keys,
            waited_ms=adopted.waited_ms,
            snapshot_superseded=superseded,
        )
        if had_snapshot and superseded is None:
            logs.event(
                log,
                "lease_snapshot_not_removed",
                logging.WARNING,
                path=str(path),
                detail="the adopted lease table supersedes it, but it could not be set aside: "
                "remove it by hand, or a later start could load it again",
            )
        self.recovery = LeaseRecovery(
            source="segment",
            occupied=adopted.occupied,
            live_leases=adopted.live_leases,
            held_keys=adopted.held_keys,
        )
        return True

    def keep_if_inherited(self, table: LeaseTable) -> None:
        """The start failed after `table` took a previous run's leases, and no worker ever
        ran: on the way out the table is unlinked, so its slots go to the snapshot file,
        which the next start restores, rather than being lost."""
        if self.inherited:
            self.save(table)

    def save(self, table: LeaseTable) -> None:
        """Write `table`'s slots to the snapshot file (a failure is logged, not raised:
        the stop goes on, and the next start begins with an empty table)."""
        path = self.path
        started = time.monotonic()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            saved = lease_snapshot.save(
                path, table, instance=self.instance, secret=self.secret, now_ms=now_ms()
            )
        except Exception as exc:
            logs.event(
                log, "lease_snapshot_write_failed", logging.ERROR, path=str(path), error=str(exc)
            )
            return
        logs.event(
            log,
            "lease_snapshot_written",
            path=saved.path,
            bytes=saved.bytes,
            occupied=saved.occupied,
            live_leases=saved.live_leases,
            held_keys=saved.held_keys,
            ms=round((time.monotonic() - started) * 1000, 1),
        )
