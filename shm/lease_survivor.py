"""The lease table a node killed whole left in shared memory, adopted by its next start.

POSIX shared memory outlives the processes that map it: a supervisor SIGKILLed with its
workers leaves its lease table under its name, which derives from the instance id, so
the next start of the same node finds it. Rather than replacing it with an empty table
(which would grant again at once every key the killed run had leased), the supervisor
`find`s it, checks that it is a table this node can take, and `adopt`s its slots into
the fresh table before any worker spawns: each slot at its own index, as a snapshot
restore does (shm/lease_snapshot.py), so a fleet worker's token from before the crash
still completes its key and the key is not granted to anyone else while its lease
lives. Expired leases and holds come back as what they are.

`find` takes the table only if all of these hold, and otherwise says which did not (the
segment is then replaced by an empty one, as before):

- its header is this build's (magic, layout version, kind, slot size, sizes:
  `Segment.attach`'s checks, `LayoutMismatch`);
- its capacity is the configured `lease_slots` (tokens name slot indexes, so the slots
  cannot move to a table of another size);
- its owner (the killed supervisor) is dead, so nothing else will create the table anew;
- it was made under this database's hash secret (the fingerprint its creator recorded,
  `LeaseTable.secret_print`): under another secret no key would find its slot; a table
  that records none (an older build's) is refused too;
- no other process maps it any more. A supervisor SIGKILLed alone leaves workers that
  stop gracefully (they get SIGTERM when their parent dies) and may still answer
  completions into the table: `find` waits for them, up to `wait_s`, so the slots it
  copies are the last ones, never a copy torn by a write. One that outlives the wait is
  a reason to refuse. (Who maps it is read from /proc; where there is none, `find`
  cannot tell and does not wait.)

What a killed process can leave half done in the slots (a removal under way, a key
inserted with no lease, a counter one off) is what `LeaseTable.import_slots` finishes and
`recount` rebuilds, as after any claimant killed mid-operation.

The surviving table wins over a lease snapshot file: a snapshot is a copy of a table
taken by a graceful stop after its workers exited, and the stop then unlinks the table,
so a table that survives alongside a snapshot is either that same table (the supervisor
died between the two steps) or a later run's, which loaded the snapshot at its start
and went on granting and completing (the file stays only if it could not be removed).
Either way the table is at least as new; the file is set aside (`<path>.superseded`),
so a later start cannot bring back leases that have since ended.

When nothing survives (the machine rebooted, or /dev/shm was cleared) and no snapshot
was written, the node starts with an empty table: the killed run's leases are
forgotten, a fleet worker's completion comes back `lease_not_held`, and its key may be
granted again from the keeper's first publish. Fencing that case would need a horizon
persisted beside the database (the latest expiry any grant may have) and a start that
grants nothing until it passes; that is not built.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from shm.keys import fingerprint
from shm.leases import LeaseTable
from shm.segment import SegmentMissing, _owner_alive

# How often `find` looks again for processes that still map the table.
_MAPPED_POLL_S = 0.1


@dataclass(frozen=True, eq=False)
class Survivor:
    """A killed run's table that this node can take: its slots, copied."""

    name: str
    owner_pid: int
    created_at: int  # epoch ms, when the killed run made it
    slots: np.ndarray  # SLOT records, by index
    waited_ms: int  # how long its last processes took to let go of it


class Refused(msgspec.Struct, frozen=True, kw_only=True):
    """A surviving table this node will not take, and why."""

    name: str
    reason: str


class Adopted(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    owner_pid: int
    created_at: int
    occupied: int
    live_leases: int
    held_keys: int
    waited_ms: int


def mapped_by(name: str) -> list[int] | None:
    """The pids of other processes that map the segment `name` now; None where that
    cannot be told (no /proc). Linux keeps POSIX shared memory under /dev/shm and each
    mapping names its file in the process's maps; a process whose maps this user may not
    read cannot have opened a segment made with mode 0600 either (root aside)."""
    proc = Path("/proc")
    if not (proc / "self" / "maps").exists():
        return None
    path = " /dev/shm/" + name.lstrip("/")
    me = os.getpid()
    found = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            text = (entry / "maps").read_bytes().decode("utf-8", "replace")
        except OSError:  # gone meanwhile, or another user's
            continue
        # A mapping of an unlinked segment ends "(deleted)": an older table of that name.
        if any(line.endswith(path) for line in text.splitlines()):
            found.append(int(entry.name))
    return found


def find(
    name: str,
    *,
    capacity: int,
    secret: bytes,
    wait_s: float = 0.0,
    on_wait: Callable[[list[int]], object] | None = None,
) -> Survivor | Refused | None:
    """The table a killed run left under `name`, if this node can take it; None if there
    is none. Never changes nor unlinks it (the create that follows replaces it).
    `on_wait` is told once which processes still map it, if `find` has to wait."""
    try:
        table = LeaseTable.attach(name)
    except SegmentMissing:
        return None
    except Exception as exc:  # LayoutMismatch names what differs; anything else, as it is
        return Refused(name=name, reason=str(exc) or type(exc).__name__)
    try:
        refusal = _check(table, capacity=capacity, secret=secret)
        if refusal is not None:
            return Refused(name=name, reason=refusal)
        started = time.monotonic()
        deadline = started + wait_s
        told = False
        while mappers := mapped_by(name):
            if time.monotonic() >= deadline:
                return Refused(
                    name=name,
                    reason=f"still mapped by live process(es) {sorted(mappers)} after "
                    f"{wait_s:g} s: a previous run's workers that did not exit",
                )
            if on_wait is not None and not told:
                on_wait(sorted(mappers))
                told = True
            time.sleep(_MAPPED_POLL_S)
        return Survivor(
            name=name,
            owner_pid=table.owner_pid,
            created_at=table.created_at,
            slots=table.export_slots(),
            waited_ms=int((time.monotonic() - started) * 1000),
        )
    finally:
        table.close()


def _check(table: LeaseTable, *, capacity: int, secret: bytes) -> str | None:
    if table.capacity != capacity:
        return (
            f"capacity {table.capacity}, this node is configured for {capacity} (lease_slots "
            "changed); tokens name slot indexes, so the slots cannot move to another table size"
        )
    pid, created_at = table.owner_pid, table.created_at
    if _owner_alive(pid, created_at):
        return f"its owner, process {pid}, is alive: the table is in use, not left by a crash"
    recorded, ours = table.secret_print, fingerprint(secret)
    if recorded == 0:
        return "it records no hash secret (made by an older build): its keys cannot be checked"
    if recorded != ours:
        return (
            f"its key hashes were made under the hash secret {recorded:016x}, this node's "
            f"database has {ours:016x} (another database): no key would find its lease"
        )
    return None


def adopt(survivor: Survivor, table: LeaseTable, now: int) -> Adopted:
    """Write the survivor's slots into the fresh `table` (before any other process uses
    it). Raises ValueError if the table is not fresh or not of the survivor's size."""
    table.import_slots(survivor.slots)
    census = table.census(now)
    return Adopted(
        name=survivor.name,
        owner_pid=survivor.owner_pid,
        created_at=survivor.created_at,
        occupied=census.occupied,
        live_leases=census.live_leases,
        held_keys=census.held_keys,
        waited_ms=survivor.waited_ms,
    )
