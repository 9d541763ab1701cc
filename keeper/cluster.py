"""The keeper's view of the cluster: who is live, which keys are this node's, and which
of those it may not grant yet. Pure: the runner reads the member list and the clock.

Leases live in each node's shared memory, so when a key changes owner the new owner
cannot see the old owner's lease on it. It fences the key instead, for as long as the
evidence says, and for the worst case only when a node died without saying more:

- X is live (this node joined, or came back): X adopts the new view when its keeper
  next reads the member list, stops granting and renewing the keys it lost, and then
  acknowledges the view (`acked_view` holds this node's incarnation) together with its
  live leases on the keys it lost (the hand-over). Until the acknowledgement every key
  gained from X is fenced; after it, only the handed-over keys, each until its lease
  ends. Should X never acknowledge, the worst case applies: X stops granting lost keys
  within a grant window of the change (a node grants only while it confirms itself live
  from a fresh read, which shows the change), so its leases end by then plus its longest.
- X left cleanly: it handed over every live lease when it left: those keys are fenced
  until each lease ends, the rest are granted at once.
- X died (its heartbeat is older than the TTL): X granted nothing after its last
  heartbeat + TTL + the grant window, and no lease of its lasts past that plus its
  longest lease, nor past the lease ceiling it published (keeper.ceiling): its whole
  share is fenced until the earlier of the two.
- This node's own predecessor (the incarnation it replaced, under the same name): its
  leases are in this node's own lease table when the node took it over (a snapshot, or
  the surviving shared memory); otherwise the node's whole share is fenced until the
  predecessor's leases could have ended (`predecessor_until_ms`, from its row).

A node that cannot confirm it is live within the grant window fences every key.
Identity is (name, incarnation): a node restarted under its name is a change of view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.ownership import Rendezvous, winners
from keeper.state import ClusterStatistics, Fence, FenceCount, FencedGroup
from store.rows import Handover, MemberList, NodeRecord

Member = tuple[str, int]  # (name, incarnation)
# Key hashes to what ownership is judged on (keeper.ownership.placements); None: the keys'
# own hashes.
Place = Callable[[npt.NDArray[np.uint64]], npt.NDArray[np.uint64]]
# What another node handed over (a lease's fence, its site permit, a site's block) is held
# this much past its end: the end crossed two clocks (the old owner's to the database's,
# the database's to this node's), each offset taken over a round trip, and each may end
# late but never early: a few ms early, a key is held twice or a site is over its cap.
HANDED_MARGIN_MS = 1_000


class _ShareFence:
    """Every key `node` owned under `view`, until `until_ms`; while `awaiting` is set it
    ends early once that incarnation acknowledges a view holding this node."""

    def __init__(
        self, node: str, view: tuple[str, ...], until_ms: int, reason: str, awaiting: int = 0
    ) -> None:
        self.node, self.view, self.until_ms, self.reason = node, view, until_ms, reason
        self.awaiting = awaiting

    def blocks(
        self, hashes: npt.NDArray[np.uint64], placed: npt.NDArray[np.uint64], now: int
    ) -> npt.NDArray[np.bool_]:
        owners = winners(placed, self.view)
        blocked: npt.NDArray[np.bool_] = owners == self.view.index(self.node)
        return blocked

    def record(self, now: int) -> Fence:
        return Fence(node=self.node, view=self.view, until_ms=self.until_ms, reason=self.reason)


class _KeyFence:
    """The keys a node handed over, each until its lease ends (this node's clock)."""

    def __init__(self, node: str, hashes: npt.NDArray[np.uint64], until: npt.NDArray[np.int64]):
        order = np.argsort(hashes)
        self.node, self.hashes, self.until = node, hashes[order], until[order]
        self.until_ms = int(until.max(initial=0))
        self.reason = "handed over"

    def blocks(
        self, hashes: npt.NDArray[np.uint64], placed: npt.NDArray[np.uint64], now: int
    ) -> npt.NDArray[np.bool_]:
        at = np.searchsorted(self.hashes, hashes)
        at[at >= len(self.hashes)] = 0
        found: npt.NDArray[np.bool_] = (self.hashes[at] == hashes) & (self.until[at] > now)
        return found

    def record(self, now: int) -> Fence:
        return Fence(
            node=self.node,
            view=(),
            until_ms=self.until_ms,
            reason=self.reason,
            keys=int((self.until > now).sum()),
        )


class ClusterView:
    def __init__(
        self,
        me: str,
        *,
        ttl_ms: int,
        grant_window_ms: int,
        max_lease_ms: int,
        incarnation: int = 0,
        predecessor_until_ms: int = 0,
        by_site: bool = False,
    ) -> None:
        """`predecessor_until_ms`: until when the leases of the incarnation this start
        replaced may live, when its lease table was not taken over (0: none may).
        `by_site`: keys are owned by their site's hash (keeper.ownership)."""
        self.me = me
        self.incarnation = incarnation
        self.ttl_ms = ttl_ms
        self.grant_window_ms = grant_window_ms
        self.max_lease_ms = max_lease_ms
        self.predecessor_until_ms = predecessor_until_ms
        self.ownership = Rendezvous(me, by_site=by_site)
        self.by_site = by_site
        # Owned by site, the live leases other nodes handed over on sites now this node's:
        # (site hashes, ends on `now`'s clock), for the runner to take a permit for each
        # in the site table, so a site's cap counts the old owner's leases until they end.
        self.handed_permits: list[tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]] = []
        # And the blocks handed over with those sites: (site hash, end on `now`'s clock,
        # reason), for the runner to put in the site table.
        self.handed_blocks: list[tuple[int, int, str]] = []
        self.view: tuple[str, ...] | None = None  # names; None: never read
        self.members: tuple[Member, ...] | None = None
        self.fences: list[_ShareFence | _KeyFence] = []
        self.confirmed_at = 0
        # The database's clock less `now`'s (the clock this view runs on, monotonic in a
        # node), and the wall clock less it, as of the last read: instants other nodes
        # read are in the database's clock, the ones people read in the wall clock's.
        self.offset_ms = 0
        self.to_wall_ms = 0
        self._changes = self._reads = self._read_failures = 0
        # Whether the last change can have moved keys here: a join only takes keys away
        # from the nodes already live, so they need no walk for rows gained.
        self.gains = True
        # Set by a change of view, cleared by `acknowledged`: the runner then tells the
        # others this node enforces the new view.
        self.unacknowledged = False

    @property
    def awaiting(self) -> bool:
        """Whether a fence waits on another node's acknowledgement (read its hand-over)."""
        return any(isinstance(f, _ShareFence) and f.awaiting for f in self.fences)

    def live_incarnations(self) -> list[int]:
        return sorted(i for _, i in self.members or ())

    def observe(self, members: MemberList, now: int, wall_now: int | None = None) -> bool:
        """Take a fresh member list; True when the live set (and so ownership) changed.
        `wall_now`: the wall clock's reading at `now`, when `now` is another clock's."""
        self._reads += 1
        records = members.records
        self.offset_ms = members.db_now_ms - now if members.db_now_ms else 0
        self.to_wall_ms = 0 if wall_now is None else wall_now - now
        live = tuple(sorted((r.node, r.incarnation) for r in records if r.live))
        me_live = (self.me, self.incarnation) in live
        # A node that could not confirm itself for a grant window may have been declared
        # dead meanwhile, its keys taken and leased, and its row revived by its next
        # heartbeat: the same list as before proves nothing, so it comes back as a joiner.
        lapsed = self.confirmed_at > 0 and not self.confirmed(now)
        if me_live:
            self.confirmed_at = now
        seen = {r.node: r for r in records}
        # Without the hand-overs an acknowledgement says nothing this view can use yet.
        handovers = members.handovers if members.with_handovers else None
        self._settle(seen, handovers, now)
        previous = self.members
        if live == previous and not (lapsed and me_live):
            return False
        names = tuple(sorted(n for n, _ in live))
        was_live = previous is not None and (self.me, self.incarnation) in previous and not lapsed
        before: tuple[str, ...] = ()
        movers: list[str] = []  # nodes whose keys may have moved here
        if me_live and not was_live:
            # Joining, or back after dropping out: every key this node owns now was
            # another's, a live node's or one gone so recently its leases may live.
            gone = {r.node for r in records if not r.live and self._recent(r, now)}
            before_set = {n for n, _ in previous or ()} | set(names) | gone
            if self.predecessor_until_ms > now:
                before = tuple(sorted(before_set))
                self.fences.append(
                    _ShareFence(self.me, before, self.predecessor_until_ms, "restarted")
                )
            else:
                before = tuple(sorted(before_set - {self.me}))
            movers = [n for n in before if n != self.me]
        elif was_live and me_live:
            # A live node keeps its keys (a newcomer takes only its own share of each):
            # only the keys of the nodes that went move here.
            before = tuple(sorted({n for n, _ in previous or ()}))
            movers = [n for n in before if n != self.me and n not in names]
        # A node that was not live (a join, or back after dropping out) held none of what
        # it owns now, even when no other node's keys moved: it walks for all of it.
        self.gains = bool(movers) or not (me_live and was_live)
        for name in movers:
            fence = self._fence_for(seen.get(name), name, before, handovers, now)
            if fence is not None:
                self.fences.append(fence)
        if me_live and not was_live:
            self.predecessor_until_ms = 0  # fenced once, by the join it preceded
        self.fences = [f for f in self.fences if f.until_ms > now]
        self.members = live
        self.view = names
        self._changes += 1
        self.unacknowledged = True
        # Another incarnation live under this name owns this name's keys, not this one.
        owning = names if me_live else tuple(n for n in names if n != self.me)
        return self.ownership.set_nodes(owning) or previous is None

    def _recent(self, record: NodeRecord, now: int) -> bool:
        """Whether a node no longer live may still have a lease alive."""
        return self._leases_end(record, now) > now

    def _leases_end(self, record: NodeRecord, now: int) -> int:
        return leases_end(
            record,
            now,
            self.offset_ms,
            ttl_ms=self.ttl_ms,
            grant_window_ms=self.grant_window_ms,
            max_lease_ms=self.max_lease_ms,
        )

    def _fence_for(
        self,
        record: NodeRecord | None,
        name: str,
        before: tuple[str, ...],
        handovers: Sequence[Handover] | None,
        now: int,
    ) -> _ShareFence | _KeyFence | None:
        """How keys `name` owned under `before` are fenced here (module note); None: not.
        `handovers` None: not read, so no acknowledgement can be taken at its word yet."""
        if record is None:  # its row is gone: treated as dead a TTL ago
            return _ShareFence(name, before, now + self.grant_window_ms + self.max_lease_ms, "dead")
        max_lease = record.max_lease_ms or self.max_lease_ms
        said = record.left or (record.live and self.incarnation in record.acked_view)
        if said and handovers is not None:
            return self._handed_over(record, handovers, now)
        if record.live or record.left:
            # Until its word is read; at worst, until its leases end (module note).
            until = (
                self._leases_end(record, now)
                if record.left
                else now + self.grant_window_ms + max_lease
            )
            if self.by_site:
                # Its word also carries the blocks of its sites, which must be in force
                # here before any key of them is granted: held until read (the next
                # read, a second away), even when no lease of its outlives this one.
                until = max(until, now + self.grant_window_ms)
            return _ShareFence(name, before, until, "awaiting", awaiting=record.incarnation)
        until = self._leases_end(record, now)
        return _ShareFence(name, before, until, "dead") if until > now else None

    def _handed_over(
        self, record: NodeRecord, handovers: Sequence[Handover], now: int
    ) -> _KeyFence | None:
        for handover in handovers:
            if handover.node == record.node and handover.incarnation == record.incarnation:
                until = (
                    np.asarray(handover.expires_at_ms, dtype=np.int64)
                    - self.offset_ms
                    + HANDED_MARGIN_MS
                )
                hashes = np.asarray(handover.key_hashes, dtype=np.uint64)
                live = until > now
                if self.by_site:
                    self.handed_blocks.extend(
                        (
                            block.site_hash,
                            block.until_ms - self.offset_ms + HANDED_MARGIN_MS,
                            block.reason,
                        )
                        for block in handover.blocks
                        if block.until_ms - self.offset_ms > now
                    )
                if self.by_site and len(handover.site_hashes) == len(hashes):
                    # Every site's, not only the ones gained here: ownership may not be
                    # this view's yet, and a permit on a site owned elsewhere only expires.
                    sites = np.asarray(handover.site_hashes, dtype=np.uint64)
                    taken = live & (sites != np.uint64(0))
                    if taken.any():
                        self.handed_permits.append((sites[taken], until[taken]))
                if live.any():
                    return _KeyFence(record.node, hashes[live], until[live])
        return None

    def _settle(
        self, seen: dict[str, NodeRecord], handovers: Sequence[Handover] | None, now: int
    ) -> None:
        """Replace fences awaiting an acknowledgement by what the evidence now says."""
        for index, fence in enumerate(self.fences):
            if handovers is None:
                break
            if not isinstance(fence, _ShareFence) or not fence.awaiting:
                continue
            record = seen.get(fence.node)
            if record is None or record.incarnation != fence.awaiting:
                continue  # replaced or forgotten: its worst case stands
            if record.left or (record.live and self.incarnation in record.acked_view):
                self.fences[index] = self._handed_over(record, handovers, now) or _ended(fence)
            elif not record.live:
                fence.awaiting = 0  # died before acknowledging: its leases end by then
                fence.until_ms = min(fence.until_ms, self._leases_end(record, now))
                fence.reason = "dead"
        self.fences = [f for f in self.fences if f.until_ms > now]

    def acknowledged(self) -> None:
        self.unacknowledged = False

    def failed(self) -> None:
        self._read_failures += 1

    def confirmed(self, now: int) -> bool:
        return self.confirmed_at > 0 and now - self.confirmed_at <= self.grant_window_ms

    def confirmed_until(self) -> int:
        """When this node must stop granting unless it confirms itself live again."""
        return self.confirmed_at + self.grant_window_ms if self.confirmed_at else 0

    def blocked_mask(
        self, key_hashes: npt.NDArray[np.uint64], now: int, place: Place | None = None
    ) -> npt.NDArray[np.bool_] | None:
        """Keys this node may not grant now; None when it may grant every one it owns.
        `place`: the keys' placements, asked only while a fence is up (owned by site)."""
        if not self.confirmed(now):
            return np.ones(len(key_hashes), dtype=np.bool_)
        active = [f for f in self.fences if f.until_ms > now]
        if len(active) != len(self.fences):
            self.fences = active
        if not active or len(key_hashes) == 0:
            return None
        placed = key_hashes if place is None else place(key_hashes)
        blocked = np.zeros(len(key_hashes), dtype=np.bool_)
        for fence in active:
            blocked |= fence.blocks(key_hashes, placed, now)
        return blocked

    def fencing(self, now: int) -> bool:
        """Whether any key may be held back now: without, a count has nothing to find."""
        return not self.confirmed(now) or any(f.until_ms > now for f in self.fences)

    def count_fenced(
        self, key_hashes: npt.NDArray[np.uint64], now: int, place: Place | None = None
    ) -> FencedGroup:
        """How many of `key_hashes` (the due rows) `blocked_mask` holds back now, and by
        which fence: each fence's mask taken once, their union the total."""
        active = [f for f in self.fences if f.until_ms > now]
        confirmed = self.confirmed(now)
        counted: list[FenceCount] = []
        if not confirmed:
            counted.append(
                FenceCount(node=self.me, reason="unconfirmed", due=len(key_hashes), until_ms=0)
            )
        blocked = np.zeros(len(key_hashes), dtype=np.bool_)
        placed = key_hashes if place is None or not active else place(key_hashes)
        for fence in active:
            mask = fence.blocks(key_hashes, placed, now) if len(key_hashes) else blocked
            blocked |= mask
            record = self._on_wall(fence.record(now))
            counted.append(
                FenceCount(
                    node=record.node,
                    reason=record.reason,
                    due=int(np.count_nonzero(mask)),
                    until_ms=record.until_ms,
                    keys=record.keys,
                )
            )
        return FencedGroup(
            due=int(np.count_nonzero(blocked)) if confirmed else len(key_hashes),
            until_ms=max((f.until_ms + self.to_wall_ms for f in active), default=0),
            reasons=counted,
        )

    def statistics(self, now: int) -> ClusterStatistics:
        active = [f for f in self.fences if f.until_ms > now]
        return ClusterStatistics(
            node=self.me,
            view=list(self.view or ()),
            generation=self.ownership.generation,
            confirmed=self.confirmed(now),
            confirmed_at=self.confirmed_at and self.confirmed_at + self.to_wall_ms,
            changes=self._changes,
            reads=self._reads,
            read_failures=self._read_failures,
            fences=[self._on_wall(f.record(now)) for f in active],
            fenced_until=max((f.until_ms + self.to_wall_ms for f in active), default=0),
            incarnation=self.incarnation,
            acknowledged=not self.unacknowledged,
        )

    def _on_wall(self, fence: Fence) -> Fence:
        return msgspec.structs.replace(fence, until_ms=fence.until_ms + self.to_wall_ms)


def leases_end(
    record: NodeRecord,
    now: int,
    offset_ms: int = 0,
    *,
    ttl_ms: int,
    grant_window_ms: int,
    max_lease_ms: int,
) -> int:
    """Until when (`now`'s clock, the database's less `offset_ms`) a lease of a node that
    is not live may live. One that left: its last lease handed over. One that died
    silent: it stopped granting at most TTL + the grant window after its last heartbeat,
    as old as the record says, and no lease of its ends past its longest after that, nor
    past the lease ceiling it published (keeper.ceiling), which cannot rise once it is
    dead."""
    # The horizon is the database's instant: it crossed clocks (HANDED_MARGIN_MS).
    horizon = record.lease_horizon_ms - offset_ms + HANDED_MARGIN_MS
    if record.left:
        return horizon
    longest = record.max_lease_ms or max_lease_ms
    worst = now - record.heartbeat_age_ms + ttl_ms + grant_window_ms + longest
    if record.lease_horizon_ms > 0:
        return min(worst, horizon)
    return worst


def _ended(fence: _ShareFence) -> _ShareFence:
    fence.until_ms, fence.awaiting = 0, 0
    return fence
