"""Queue-state from the keeper's counts: each of its groups, built purely."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from keeper.classes import ClassTable
from keeper.counts import LATENESS_EDGES, ClassCounts, QueueCounts, SiteCounts
from keeper.flow import FlowMinute
from keeper.state import (
    SCHEMA,
    SITES_IN_QUEUE_STATE,
    SITES_LISTED,
    AutoscaleGroup,
    ClassRow,
    ComingGroup,
    FencedGroup,
    FlowGroup,
    FlowTotals,
    LatenessGroup,
    LeaseCounts,
    NowGroup,
    QueueState,
    RetiredGroup,
    SiteList,
    SiteRow,
    SitesGroup,
    Status,
    TrustGroup,
)


def class_row(counts: ClassCounts, classes: ClassTable, now_ms: int) -> ClassRow:
    cls = classes.get(counts.class_id)
    oldest = counts.oldest_due_at
    return ClassRow(
        id=counts.class_id,
        route=cls.route,
        cadence_s=cls.cadence_s,
        cadence_from_row=cls.cadence_from_row,
        sitemap=cls.sitemap,
        paused=classes.paused(counts.class_id),
        held=counts.held,
        due=counts.due,
        oldest_due_at=oldest,
        oldest_lateness=None if oldest is None else (now_ms - oldest) / (cls.cadence_s * 1000.0),
        lateness=counts.lateness,
    )


def _sum(into: list[int], add: Sequence[int]) -> None:
    for i, n in enumerate(add):
        into[i] += n


def lateness_group(
    counts: QueueCounts, classes: ClassTable, now_ms: int, rows_max: int
) -> LatenessGroup:
    bins = len(LATENESS_EDGES)
    sitemap = [0] * bins
    discovered = [0] * bins
    by_route: dict[str, list[int]] = {}
    for c in counts.classes:
        cls = classes.get(c.class_id)
        _sum(sitemap if cls.sitemap else discovered, c.lateness)
        _sum(by_route.setdefault(cls.route, [0] * bins), c.lateness)
    ordered = sorted(counts.classes, key=lambda c: (-c.due, -c.held, c.class_id))
    routes = sorted(by_route, key=lambda r: -sum(by_route[r]))
    return LatenessGroup(
        edges=list(LATENESS_EDGES),
        sitemap=sitemap,
        discovered=discovered,
        by_route={r: by_route[r] for r in routes[:rows_max]},
        classes=[class_row(c, classes, now_ms) for c in ordered[:rows_max]],
        classes_truncated=len(ordered) > rows_max or len(routes) > rows_max,
    )


def trimmed_queue_state(state: QueueState) -> QueueState:
    """`state` without its per-class and per-route lateness, flagged as cut: what is
    left of a record too large for its buffer."""
    return msgspec.structs.replace(
        state,
        lateness=msgspec.structs.replace(
            state.lateness, classes=[], by_route={}, classes_truncated=True
        ),
    )


def flow_group(minutes: list[FlowMinute]) -> FlowGroup:
    return FlowGroup(
        minutes=minutes,
        last_hour=FlowTotals(
            came_due=sum(m.came_due for m in minutes),
            added=sum(m.added for m in minutes),
            triggered=sum(m.triggered for m in minutes),
            rescheduled=sum(m.rescheduled for m in minutes),
            removed=sum(m.removed for m in minutes),
        ),
    )


def now_group(
    counts: QueueCounts,
    classes: ClassTable,
    leases: LeaseCounts,
    status: Status,
    status_reason: str,
    fenced: FencedGroup | None = None,
) -> NowGroup:
    paused_routes = sorted(
        {classes.get(c.class_id).route for c in counts.classes if classes.paused(c.class_id)}
    )
    return NowGroup(
        status=status,
        status_reason=status_reason,
        due=counts.due,
        claimable=max(0, counts.due - (0 if fenced is None else fenced.due)),
        due_sitemap=counts.due_sitemap,
        due_discovered=counts.due_discovered,
        in_flight=leases.in_flight,
        unclaimed_estimate=max(0, counts.due - leases.in_flight),
        paused=counts.paused_due,
        paused_routes=paused_routes,
        held=counts.held,
        leases=leases,
    )


def sites_group(counts: SiteCounts, now_ms: int, top: int) -> SitesGroup:
    return SitesGroup(
        held=counts.held,
        with_due=counts.with_due,
        no_site_due=counts.no_site_due,
        top=[
            SiteRow(
                site=c.site,
                due=c.due,
                held=c.held,
                oldest_due_at=c.oldest_due_at,
                oldest_age_s=max(0.0, (now_ms - c.oldest_due_at) / 1000),
            )
            for c in counts.top[:top]
        ],
    )


def build_site_list(node: str, counts: SiteCounts) -> SiteList:
    """The sites listing of one full report (keeper.state.SiteList)."""
    return SiteList(
        node=node,
        generated_at=counts.at,
        sites=sites_group(counts, counts.at, SITES_LISTED),
        site_hashes=[c.site_hash for c in counts.top[:SITES_LISTED]],
        truncated=counts.with_due > min(len(counts.top), SITES_LISTED),
    )


def build_queue_state(
    *,
    node: str,
    now_ms: int,
    counts: QueueCounts,
    classes: ClassTable,
    flow: list[FlowMinute],
    leases: LeaseCounts,
    status: Status,
    status_reason: str,
    trust: TrustGroup,
    earliest_claimable_at: int | None,
    rows_max: int,
    fenced: FencedGroup | None = None,
    sites: SiteCounts | None = None,
    retired: dict[str, int] | None = None,
) -> QueueState:
    """`fenced`: in a cluster, the due rows its fences hold back (None on a single node);
    `sites`: the due rows by site (queue-state keeps the first few)."""
    now = now_group(counts, classes, leases, status, status_reason, fenced)
    oldest_age = 0.0 if earliest_claimable_at is None else (now_ms - earliest_claimable_at) / 1000
    return QueueState(
        schema=SCHEMA,
        node=node,
        generated_at=now_ms,
        now=now,
        coming=ComingGroup(
            due_15m=counts.due_15m,
            due_60m=counts.due_60m,
            due_24h=counts.due_24h,
            next_24h_by_hour=counts.next_24h_by_hour,
        ),
        lateness=lateness_group(counts, classes, now_ms, rows_max),
        flow=flow_group(flow),
        trust=trust,
        autoscale=AutoscaleGroup(
            due_now=now.claimable, oldest_claimable_age_s=max(0.0, oldest_age)
        ),
        fenced=fenced,
        sites=SitesGroup() if sites is None else sites_group(sites, now_ms, SITES_IN_QUEUE_STATE),
        retired=RetiredGroup(total=sum((retired or {}).values()), by_route=retired or {}),
    )
