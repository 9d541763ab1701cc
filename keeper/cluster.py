"""The keeper's view of the cluster: who is live, which keys are this node's, and which
of those it may not grant yet. Pure: the runner reads the member list and the clock.

Leases live in each node's shared memory, so when a key changes owner the new owner
cannot see the old owner's lease on it. It fences the key instead: a key this node
gained from node X is not granted until X's leases on it have surely ended.

- X left cleanly: it granted nothing after it stopped, and said when its last lease
  ends (`lease_horizon_ms`): fenced until then.
- X died (its heartbeat is older than the TTL): a node grants only while its keeper
  confirms, at least every `grant_window_ms`, that it is live in the member list, so
  X granted nothing after its last heartbeat + TTL + the grant window, and no lease of
  its lasts past that plus its longest lease.
- X is live, and this node just joined (or came back): X stops granting the keys it
  lost once its keeper reads the new list and republishes, within the grant window:
  fenced until now + grant window + X's longest lease.

A node that cannot confirm it is live within the grant window fences every key.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.ownership import Rendezvous, winners
from keeper.state import ClusterStatistics, Fence
from store.rows import NodeRecord


def _unknown(name: str) -> NodeRecord:
    """A node in the last view whose row is gone: treated as dead a TTL ago."""
    return NodeRecord(
        node=name,
        url="",
        instance="",
        started_at_ms=0,
        heartbeat_age_ms=0,
        left=False,
        live=False,
        lease_horizon_ms=0,
        max_lease_ms=0,
    )


class ClusterView:
    def __init__(
        self,
        me: str,
        *,
        ttl_ms: int,
        grant_window_ms: int,
        max_lease_ms: int,
    ) -> None:
        self.me = me
        self.ttl_ms = ttl_ms
        self.grant_window_ms = grant_window_ms
        self.max_lease_ms = max_lease_ms
        self.ownership = Rendezvous(me)
        self.view: tuple[str, ...] | None = None  # None: never read
        self.fences: list[Fence] = []
        self.confirmed_at = 0
        self._changes = self._reads = self._read_failures = 0
        # Whether the last change can have moved keys here: a join only takes keys away
        # from the nodes already live, so they need no walk for rows gained.
        self.gains = True

    def observe(self, records: Sequence[NodeRecord], now: int) -> bool:
        """Take a fresh member list; True when the live set (and so ownership) changed."""
        self._reads += 1
        live = tuple(sorted(r.node for r in records if r.live))
        previous = self.view
        if self.me in live:
            self.confirmed_at = now
        if live == previous:
            return False
        seen = {r.node: r for r in records}
        before: tuple[str, ...] = ()
        movers: tuple[str, ...] = ()  # nodes whose keys may have moved here
        if self.me in live and (previous is None or self.me not in previous):
            # Joining, or back after dropping out: every key this node owns now was
            # another's, a live node's or one gone so recently its leases may live.
            gone = {r.node for r in records if not r.live and self._fence_for(r, live, now)}
            before = tuple(sorted((set(previous or ()) | set(live) | gone) - {self.me}))
            movers = before
        elif previous is not None and self.me in live:
            # A live node keeps its keys (a newcomer takes only its own share of each):
            # only the keys of the nodes that went move here.
            before = previous
            movers = tuple(n for n in previous if n != self.me and n not in live)
        self.gains = bool(movers) or self.me not in live
        new_fences: list[Fence] = []
        for name in movers:
            fence = self._fence_for(seen.get(name) or _unknown(name), live, now)
            if fence is not None:
                new_fences.append(msgspec.structs.replace(fence, view=before))
        self.fences = [f for f in self.fences if f.until_ms > now] + new_fences
        self.view = live
        self._changes += 1
        return self.ownership.set_nodes(live) or previous is None

    def _fence_for(self, record: NodeRecord, live: Sequence[str], now: int) -> Fence | None:
        """How long keys `record.node` owned stay fenced here (module note); None: not."""
        max_lease = record.max_lease_ms or self.max_lease_ms
        if record.node in live:
            until, reason = now + self.grant_window_ms + max_lease, "joined"
        elif record.left:
            until, reason = record.lease_horizon_ms, "left"
        else:
            # Dead: it stopped granting at most TTL + the grant window after its last
            # heartbeat, which is as old as the record says.
            age = record.heartbeat_age_ms
            until = now - age + self.ttl_ms + self.grant_window_ms + max_lease
            reason = "dead"
        if until <= now:
            return None
        return Fence(node=record.node, view=(), until_ms=until, reason=reason)

    def failed(self) -> None:
        self._read_failures += 1

    def confirmed(self, now: int) -> bool:
        return self.confirmed_at > 0 and now - self.confirmed_at <= self.grant_window_ms

    def blocked_mask(
        self, key_hashes: npt.NDArray[np.uint64], now: int
    ) -> npt.NDArray[np.bool_] | None:
        """Keys this node may not grant now; None when it may grant every one it owns."""
        if not self.confirmed(now):
            return np.ones(len(key_hashes), dtype=np.bool_)
        active = [f for f in self.fences if f.until_ms > now]
        if len(active) != len(self.fences):
            self.fences = active
        if not active or len(key_hashes) == 0:
            return None
        blocked = np.zeros(len(key_hashes), dtype=np.bool_)
        for fence in active:
            owners = winners(key_hashes, fence.view)
            blocked |= owners == fence.view.index(fence.node)
        return blocked

    def statistics(self, now: int) -> ClusterStatistics:
        active = [f for f in self.fences if f.until_ms > now]
        return ClusterStatistics(
            node=self.me,
            view=list(self.view or ()),
            generation=self.ownership.generation,
            confirmed=self.confirmed(now),
            confirmed_at=self.confirmed_at,
            changes=self._changes,
            reads=self._reads,
            read_failures=self._read_failures,
            fences=active,
            fenced_until=max((f.until_ms for f in active), default=0),
        )
