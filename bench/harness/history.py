"""A fleet's history of leases, and the check that no key was held by two at once.

Jepsen's method, small: every client records what it saw (when it asked, when the grant
was answered, until when each renewal said the lease runs, when it sent its completion
and what came back), and the check judges the whole history at the end. A lease is
surely held from the moment its grant was answered until the earliest moment it can
have ended: the completion's sending if the node took it, else its last known expiry.
Two leases on one key are a double grant when the second was surely granted (asked and
answered) inside the first's sure hold. Every time is one clock: the nodes and the
fleet run on one machine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import msgspec


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
        self, key: str, node: str, client: str, asked_ms: int, answered_ms: int, expires_ms: int
    ) -> HeldLease:
        lease = HeldLease(
            key=key,
            node=node,
            client=client,
            asked_ms=asked_ms,
            answered_ms=answered_ms,
            expires_ms=expires_ms,
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
