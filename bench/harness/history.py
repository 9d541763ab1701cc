"""A fleet's history of leases, and the check that no key was held by two at once.

Jepsen's method, small: every client records what it saw (when it asked, when the grant
was answered, until when each renewal said the lease runs, when it sent its completion
and what came back), and the check judges the whole history at the end. A lease is
surely held from the moment its grant was answered until the earliest moment it can
have ended: the completion's sending if the node took it, else its last known expiry.
Two leases on one key are a double grant when the second was surely granted (asked and
answered) inside the first's sure hold. Every time is one clock: the nodes and the
fleet run on one machine.

The nodes' own records join it where the nodes keep a lease journal
(shm/lease_journal.py): every lease a node granted, fleet or no fleet, with the instants
its lease table saw. Those leases are judged among themselves, exactly (no two leases on
one key hash overlap), and each lease the fleet saw must be one a node recorded, granted
between the fleet's ask and its answer (matched by node and token).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import msgspec

from shm.lease_journal import JournaledLease, read_journals


class HeldLease(msgspec.Struct, kw_only=True):
    key: str
    node: str  # the granting node
    client: str
    asked_ms: int
    answered_ms: int
    expires_ms: int  # the last expiry a grant or an accepted renewal gave
    completed_ms: int | None = None  # when a completion the node accepted was sent
    renewals: int = 0
    refused_renewals: int = 0
    token: str = ""  # as the node answered it (`node:number` in a cluster)

    @property
    def held_until_ms(self) -> int:
        """The earliest the lease can have ended."""
        if self.completed_ms is not None:
            return min(self.completed_ms, self.expires_ms)
        return self.expires_ms


class DoubleGrant(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    first_node: str
    first_held: tuple[int, int]  # answered, held until
    second_node: str
    second_granted: tuple[int, int]  # asked, answered


class History:
    """Thread-safe: every fleet thread records into one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.leases: list[HeldLease] = []

    def granted(
        self,
        key: str,
        node: str,
        client: str,
        asked_ms: int,
        answered_ms: int,
        expires_ms: int,
        token: str = "",
    ) -> HeldLease:
        lease = HeldLease(
            key=key,
            node=node,
            client=client,
            asked_ms=asked_ms,
            answered_ms=answered_ms,
            expires_ms=expires_ms,
            token=token,
        )
        with self._lock:
            self.leases.append(lease)
        return lease

    def snapshot(self) -> list[HeldLease]:
        with self._lock:
            return list(self.leases)


def double_grants(leases: Iterable[HeldLease]) -> list[DoubleGrant]:
    """Every pair of leases on one key where the second was surely granted while the
    first was surely held (module note)."""
    by_key: dict[str, list[HeldLease]] = {}
    for lease in leases:
        by_key.setdefault(lease.key, []).append(lease)
    found: list[DoubleGrant] = []
    for key, taken in by_key.items():
        if len(taken) < 2:
            continue
        taken.sort(key=lambda lease: lease.answered_ms)
        for i, first in enumerate(taken):
            held_until = first.held_until_ms
            for second in taken[i + 1 :]:
                if second.asked_ms >= first.answered_ms and second.answered_ms <= held_until:
                    found.append(
                        DoubleGrant(
                            key=key,
                            first_node=first.node,
                            first_held=(first.answered_ms, held_until),
                            second_node=second.node,
                            second_granted=(second.asked_ms, second.answered_ms),
                        )
                    )
    return found


class DoubleHold(msgspec.Struct, frozen=True, kw_only=True):
    """Two leases a node's records show on one key at one instant."""

    key_hash: int
    first: JournaledLease
    second: JournaledLease


def double_holds(leases: Iterable[JournaledLease]) -> list[DoubleHold]:
    """Every pair of leases the nodes recorded as surely held on one key at once: by grant
    order per key, against the longest-held lease before each.

    Judged to the millisecond. A recorded grant is the millisecond read after its
    compare-and-swap and a recorded end the one read before its own, so a lease is surely
    held from the millisecond after its grant to its end, and was live at some instant of
    the millisecond around its grant. Two leases surely overlap when their sure holds
    share a millisecond, or when one's grant falls inside the other's sure hold with a
    millisecond to spare each side. A grant and an end within one millisecond (a lease
    ended and its key granted again at once, the lease table's everyday race) cannot be
    ordered from the records and are not counted."""
    by_key: dict[int, list[JournaledLease]] = {}
    for lease in leases:
        by_key.setdefault(lease.key_hash, []).append(lease)
    found: list[DoubleHold] = []
    for key_hash, taken in by_key.items():
        taken.sort(key=lambda lease: lease.granted_ms)
        longest = taken[0]
        for lease in taken[1:]:
            both_held = lease.granted_ms + 1 < min(lease.held_until_ms, longest.held_until_ms)
            granted_inside = longest.granted_ms + 1 < lease.granted_ms < longest.held_until_ms - 1
            if both_held or granted_inside:
                found.append(DoubleHold(key_hash=key_hash, first=longest, second=lease))
            if lease.held_until_ms > longest.held_until_ms:
                longest = lease
    return found


def in_one_clock(
    leases: Iterable[JournaledLease], ahead_ms: dict[str, int]
) -> list[JournaledLease]:
    """The journals' leases in the machine's clock, given how far each node's clock runs
    ahead of it (a node under libfaketime records its own instants)."""
    return [
        msgspec.structs.replace(
            lease,
            granted_ms=lease.granted_ms - ahead_ms[lease.node],
            held_until_ms=lease.held_until_ms - ahead_ms[lease.node],
        )
        if lease.node in ahead_ms
        else lease
        for lease in leases
    ]


def unrecorded(leases: Iterable[HeldLease], journaled: Iterable[JournaledLease]) -> list[HeldLease]:
    """The fleet's leases that no node recorded as granted between the ask and the answer
    (a grant the audit cannot see would make its verdict worthless)."""
    granted: dict[tuple[str, int], list[int]] = {}
    for recorded in journaled:
        granted.setdefault((recorded.node, recorded.token), []).append(recorded.granted_ms)
    missing: list[HeldLease] = []
    for seen in leases:
        name, _, digits = seen.token.rpartition(":")
        times = granted.get((name or seen.node, int(digits)), []) if digits.isdigit() else []
        if not any(seen.asked_ms <= at <= seen.answered_ms for at in times):
            missing.append(seen)
    return missing


def grants_by_node(
    leases: Sequence[HeldLease], nodes: Sequence[str], start_ms: int, step_ms: int, end_ms: int
) -> dict[str, list[int]]:
    """Grants answered per node in each step from start to end: the flow a chart shows."""
    bins = max(1, (end_ms - start_ms + step_ms - 1) // step_ms)
    counts = {node: [0] * bins for node in nodes}
    for lease in leases:
        at = (lease.answered_ms - start_ms) // step_ms
        if lease.node in counts and 0 <= at < bins:
            counts[lease.node][at] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    """Audit lease journals: print what they hold and every key two leases held at once;
    exit 1 if there is one."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m bench.harness.history", description=main.__doc__
    )
    parser.add_argument("directories", nargs="+", type=Path, help="lease_journal_dir of nodes")
    args = parser.parse_args(argv)
    try:
        leases = read_journals(*args.directories)
    except (OSError, ValueError) as exc:
        print(f"cannot read the journals: {exc}")
        return 2
    holds = double_holds(leases)
    nodes = sorted({lease.node for lease in leases})
    print(f"{len(leases):,} leases recorded by {len(nodes)} nodes ({', '.join(nodes)})")
    for hold in holds:
        first, second = hold.first, hold.second
        print(
            f"key hash {hold.key_hash:#018x}: {second.node} granted at {second.granted_ms} "
            f"while {first.node}'s lease ({first.granted_ms} to {first.held_until_ms}) held"
        )
    print(f"{len(holds)} keys held by two leases at once")
    return 1 if holds else 0


if __name__ == "__main__":
    raise SystemExit(main())
