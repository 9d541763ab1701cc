"""What this node can honestly say about itself right now: whether it can grant a claim,
and how many leases are really in flight.

Claim status, from the ready ring's header alone (two atomic loads per claim; the
ring's remaining count only once the keeper is late):

- `unready`: the keeper has not published yet; nothing can be granted.
- `ready`: the keeper published within its stall limit.
- `draining`: the keeper has not published for longer than that, but the last published
  set still has entries; claims take them, each checked against its row.
- `stalled`: the keeper is not publishing and its last set is drained: nothing can be
  granted until it publishes again. `/readyz` and claims answer 503.
- `fenced` (a cluster's node, where asked with `fences`): ready, but every due key it owns
  is fenced: gained from another node whose leases on it may still live, or its whole
  share while its membership is unconfirmed (keeper.cluster). It grants each key once its
  fence ends, with no restart or new publish needed, so `/readyz` answers 200 and says
  until when. Read from the keeper's statistics record (its count at each full report),
  so not on the claim path: a claim reads it only when it grants nothing.

Leases in flight: the lease table's counters are kept by the ops, so a lease that expired
with no result stays counted as leased until a grant of the key or a sweep settles it.
The supervisor (otherwise idle) takes a census of the table every second (a read-only
scan of every slot) and writes it with its statistics. `expired_unanswered` is
that census's count; in flight is the counters' live leases now less those, so a grant or
a result shows at once and an expiry within about a second (a lease that expired since the
census still counts; one settled since is taken off twice, floored at 0). A worker with no
fresh census (no supervisor: an embedded node, the tests' thread node) takes its own, at
most once a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

from api.node import ApiSettings, Node, read_keeper_statistics
from keeper.ceiling import capped_term_ms
from keeper.state import ClusterStatistics, FenceCount, KeeperStatistics
from shm import ReadyRing, StateBuffer
from shm.marks import WriteMarks
from shm.segment import now_ms

ClaimStatus = Literal["unready", "ready", "draining", "stalled", "fenced"]
# A census older than this is not served; the supervisor writes one every second.
CENSUS_MAX_AGE_MS = 3000
OWN_CENSUS_EVERY_MS = 1000
# The shortest lease a clustered node grants or renews under its lease ceiling: a term
# shorter than this is no use to a renderer.
MIN_TERM_MS = 1000


class StatusSource(Protocol):
    """What the claim status reads: a worker's `Node`, or the supervisor's `SegmentView`."""

    @property
    def settings(self) -> ApiSettings: ...

    @property
    def ring(self) -> ReadyRing: ...

    @property
    def marks(self) -> WriteMarks | None: ...

    def read_keeper_statistics(self) -> KeeperStatistics | None: ...


@dataclass(frozen=True, eq=False)
class SegmentView:
    """The claim status's inputs in a process that maps the segments but serves nothing
    (the supervisor, for systemd): it judges as /readyz does."""

    settings: ApiSettings
    ring: ReadyRing
    marks: WriteMarks | None
    keeper_statistics: StateBuffer | None

    def read_keeper_statistics(self) -> KeeperStatistics | None:
        return read_keeper_statistics(self.keeper_statistics)

    def keeper_publishing(self, now: int) -> bool:
        """The keeper published within its stall limit: it is live (the judgement that
        makes a node `ready` rather than `draining` or `stalled`)."""
        published_at = self.ring.published_at
        return (
            self.ring.generation > 0
            and published_at > 0
            and now - published_at <= self.settings.stall_after_ms
        )


class NodeClaimStatus(msgspec.Struct, frozen=True, kw_only=True):
    status: ClaimStatus
    reason: str
    publish_age_ms: int | None = None
    remaining: int | None = None  # entries left in the published set, when it matters
    fenced: int | None = None  # due keys its fences hold back (asked with `fences`)
    fenced_until: int | None = None  # when the last fence ends (epoch ms; 0: not known)

    @property
    def can_grant(self) -> bool:
        return self.status in ("ready", "draining", "fenced")


class Fences(msgspec.Struct, frozen=True, kw_only=True):
    """The due keys a clustered node may not grant, as its keeper last counted them."""

    due: int  # due keys fenced
    claimable: int  # due keys not fenced
    until_ms: int  # when the last fence ends (0: not known: membership unconfirmed)
    reasons: list[FenceCount]

    @property
    def all(self) -> bool:
        return self.due > 0 and self.claimable == 0

    def describe(self, now: int) -> str:
        """Which keys are fenced and until when, for a reason or a claim's detail."""
        said = "; ".join(_fence_said(r, now) for r in self.reasons if r.due)
        share = (
            f"all {self.due:,}"
            if self.all
            else f"{self.due:,} of the {self.due + self.claimable:,}"
        )
        return f"{share} due keys of this node are fenced ({said})"


def _fence_said(fence: FenceCount, now: int) -> str:
    left = f"{max(0, fence.until_ms - now) / 1000:.0f} s"
    match fence.reason:
        case "unconfirmed":
            return f"{fence.due:,}: its membership is unconfirmed"
        case "awaiting":
            return (
                f"{fence.due:,} gained from node {fence.node!r}, until it acknowledges the "
                f"new view, at the latest in {left}"
            )
        case "handed over":
            return (
                f"{fence.due:,} under leases node {fence.node!r} handed over, until they end, "
                f"the last in {left}"
            )
        case "dead":
            return (
                f"{fence.due:,} of node {fence.node!r}, gone without a word, until its "
                f"leases could have ended, in {left}"
            )
        case "restarted":
            return (
                f"{fence.due:,} its previous run may still hold leases on, until those could "
                f"have ended, in {left}"
            )
    return f"{fence.due:,} from node {fence.node!r} ({fence.reason}), for {left}"


def read_fences(node: StatusSource, now: int | None = None) -> Fences | None:
    """What the fences hold back now; None on a single node, before the keeper's first
    count, or when they hold nothing (or every fence has ended since the count)."""
    if not node.settings.clustered:
        return None
    stats = node.read_keeper_statistics()
    return fences_of(None if stats is None else stats.cluster, now_ms() if now is None else now)


def fences_of(cluster: ClusterStatistics | None, now: int) -> Fences | None:
    """`read_fences` from a statistics record already read."""
    if cluster is None or cluster.fenced is None or cluster.fenced.due == 0:
        return None
    # The count is a full report's (every few seconds); the fences' end is rewritten at
    # every publish, so a count whose fences have all ended since is no longer true.
    if cluster.confirmed and cluster.fenced_until <= now:
        return None
    return Fences(
        due=cluster.fenced.due,
        claimable=cluster.claimable,
        until_ms=cluster.fenced_until if cluster.confirmed else 0,
        reasons=cluster.fenced.reasons,
    )


def membership_lapsed(node: StatusSource) -> str | None:
    """Why a clustered node may not grant or renew now (None: it may): its keeper has not
    confirmed within the grant window that this incarnation is a live member, so the
    others may soon take its keys, or its lease ceiling (keeper.ceiling) leaves no term."""
    marks = node.marks
    if not node.settings.clustered or marks is None:
        return None
    until = marks.confirmed_until()
    if until and time.monotonic() * 1000 < until:
        if capped_term_ms(MIN_TERM_MS, marks.lease_ceiling(), now_ms()) >= MIN_TERM_MS:
            return None
        return (
            "this node's published lease ceiling has run out (its keeper could not raise "
            "it in the database); it grants and renews nothing until it does"
        )
    if not until:
        return "this node is not (yet) confirmed as a live member of the cluster"
    return (
        "this node has not confirmed it is a live member of the cluster for "
        f"{(time.monotonic() * 1000 - until) / 1000:.1f} s past its grant window (is the "
        "database reachable?); it grants and renews nothing until it does"
    )


def claim_status(
    node: StatusSource, now: int | None = None, *, fences: bool = False
) -> NodeClaimStatus:
    """`fences`: a ready node says how many of its due keys are fenced, and `fenced` when
    all are (module note); off on the claim path, which reads no record."""
    now = now_ms() if now is None else now
    status = _claim_status(node, now)
    if not fences or status.status != "ready":
        return status
    held = read_fences(node, now)
    if held is None:
        return status
    return msgspec.structs.replace(
        status,
        status="fenced" if held.all else "ready",
        reason=f"{status.reason}; {held.describe(now)}",
        fenced=held.due,
        fenced_until=held.until_ms,
    )


def _claim_status(node: StatusSource, now: int) -> NodeClaimStatus:
    lapsed = membership_lapsed(node)
    if lapsed is not None and node.ring.generation:
        return NodeClaimStatus(status="unready", reason=lapsed)
    ring = node.ring
    published_at = ring.published_at
    if ring.generation == 0 or published_at == 0:
        return NodeClaimStatus(
            status="unready", reason="the keeper has not published the queue yet"
        )
    age = max(0, now - published_at)
    limit = node.settings.stall_after_ms
    if age <= limit:
        return NodeClaimStatus(
            status="ready", reason="the keeper is publishing", publish_age_ms=age
        )
    remaining = ring.remaining()
    if remaining > 0 and node.settings.clustered:
        return NodeClaimStatus(
            status="stalled",
            reason=f"the keeper has not published for {age / 1000:.1f} s (limit "
            f"{limit / 1000:.1f} s); in a cluster its last set may name keys that have moved "
            "to another node, so nothing is granted until it publishes again",
            publish_age_ms=age,
            remaining=remaining,
        )
    if remaining > 0:
        return NodeClaimStatus(
            status="draining",
            reason=f"the keeper has not published for {age / 1000:.1f} s (limit "
            f"{limit / 1000:.1f} s); claims take the {remaining} entries left of its last set",
            publish_age_ms=age,
            remaining=remaining,
        )
    return NodeClaimStatus(
        status="stalled",
        reason=f"the keeper has not published for {age / 1000:.1f} s (limit "
        f"{limit / 1000:.1f} s) and its last set is drained: nothing to grant until it does",
        publish_age_ms=age,
        remaining=0,
    )


class LeaseView(msgspec.Struct, frozen=True, kw_only=True):
    """Leases as of a census of the whole table (`as_of`), with the counters' totals."""

    in_flight: int  # live leases: granted, not answered, not expired (as of the census)
    expired_unanswered: int  # expired with no result, not yet settled into their holds
    held_keys: int  # keys held back now (an expired, unanswered lease read as its hold)
    as_of: int  # the census's time (epoch ms)
    source: Literal["supervisor", "worker"]
    hold_events: int = 0  # leases that expired with no result and started a hold
    failures: int = 0  # failed results that held their key back
    forgiven: int = 0  # holds released by "render now"
    refusals_taken: int = 0
    refusals_held: int = 0
    refusals_probe_full: int = 0  # the bounded probe window, which can refuse below 100%


def supervisor_statistics(node: Node) -> dict[str, Any] | None:
    if node.supervisor_state is None:
        return None
    snapshot = node.supervisor_state.read()
    if snapshot is None:
        return None
    try:
        decoded = msgspec.msgpack.decode(snapshot.payload)
    except msgspec.DecodeError:
        return None
    return decoded if isinstance(decoded, dict) else None


def lease_view(
    node: Node, supervisor: dict[str, Any] | None = None, now: int | None = None
) -> LeaseView:
    now = now_ms() if now is None else now
    stats = node.leases.statistics()
    census = (supervisor or {}).get("lease_census")
    source: Literal["supervisor", "worker"] = "supervisor"
    if not isinstance(census, dict) or now - int(census.get("now", 0)) > CENSUS_MAX_AGE_MS:
        source = "worker"
        taken = node.own_census
        if taken is None or now - taken[0] >= OWN_CENSUS_EVERY_MS:
            taken = node.own_census = (now, msgspec.to_builtins(node.leases.census(now)))
        census = taken[1]
    return LeaseView(
        in_flight=max(0, stats.live_leases - int(census["expired_unanswered"])),
        expired_unanswered=int(census["expired_unanswered"]),
        held_keys=int(census["held_keys"]),
        as_of=int(census["now"]),
        source=source,
        hold_events=stats.hold_events,
        failures=stats.failures,
        forgiven=stats.forgiven,
        refusals_taken=stats.refusals_taken,
        refusals_held=stats.refusals_held,
        refusals_probe_full=stats.refusals_probe_full,
    )
