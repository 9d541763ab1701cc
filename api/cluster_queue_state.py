"""The cluster's queue-state from every live node's own answer, without I/O; asking the
nodes is the cluster link's (api.cluster).

The counts are summed only when every node vouches for its own; otherwise 503, naming
each node that is missing, unready, not exact, stale or holding another view of the
membership. Never a partial sum: an autoscaler reading one would under-scale.
`autoscale.due_now` sums each node's own, its due rows no fence holds back (a key moving
between nodes is fenced at its new owner only), and `fenced` sums what the fences hold
back, with the latest end.
"""

from __future__ import annotations

from typing import Any

import msgspec

from store.rows import NodeRecord

CLUSTER_QUEUE_STATE_PATH = "/prerender_admin/cluster/queue-state"


class NodeAnswer(msgspec.Struct, kw_only=True):
    record: NodeRecord
    http_status: int = 0  # 0: no answer
    document: dict[str, Any] | None = None
    error: str | None = None


class NodeView(msgspec.Struct, kw_only=True):
    """One node's line in the cluster's queue-state (the console draws these)."""

    node: str
    url: str
    answering: bool
    http_status: int
    status: str  # the node's claim status, or `missing`
    missing: bool
    exact: bool | None
    state_age_ms: int | None
    problem: str | None  # why its counts cannot be summed; None: they are
    view: list[str] | None  # the live nodes its keeper holds rows for
    now: dict[str, Any] | None  # due, in flight...: only when it vouches
    autoscale: dict[str, Any] | None
    fenced: dict[str, Any] | None = None  # its fenced group, when it vouches and has one
    document: dict[str, Any] | None = None  # left out of the answer


def builtins_of(view: NodeView) -> dict[str, Any]:
    found = msgspec.to_builtins(view)
    assert isinstance(found, dict)
    found.pop("document", None)
    return {k: v for k, v in found.items() if v is not None}


def _dig(document: dict[str, Any] | None, *path: str) -> Any:
    value: Any = document
    for name in path:
        if not isinstance(value, dict):
            return None
        value = value.get(name)
    return value


def judge(answer: NodeAnswer, live: list[str], clustered: bool, me: str) -> NodeView:
    record, document = answer.record, answer.document
    name = f"node {record.node!r} ({record.url})"
    status = str(_dig(document, "now", "claims", "status") or _dig(document, "now", "status") or "")
    trust = _dig(document, "trust") or {}
    view_names = _dig(document, "cluster", "view")
    problem: str | None = None
    if answer.http_status == 0:
        problem = f"{name} is missing: {answer.error or 'no answer'}"
        status = "missing"
    elif answer.http_status in (401, 403):
        problem = (
            f"{name} refused the read (HTTP {answer.http_status}): the cluster's nodes must "
            "share their tokens"
        )
    elif answer.http_status == 503:
        why = (
            (trust.get("live_reason") if trust.get("live") is False else None)
            or (trust.get("exact_reason") if trust.get("exact") is False else None)
            or _dig(document, "now", "status_reason")
            or status
            or "unavailable"
        )
        kind = "unready" if status in ("unready", "stalled", "") else "not exact"
        problem = f"{name} is {kind}: {why}"
    elif answer.http_status != 200 or document is None:
        problem = f"{name} answered HTTP {answer.http_status}"
    elif document.get("node") != record.node:
        problem = f"{name} answered as node {document.get('node')!r}"
    elif trust.get("exact") is not True or trust.get("live") is not True:
        problem = f"{name} is not exact: {trust.get('exact_reason') or trust.get('live_reason')}"
    elif (age := trust.get("state_age_ms")) is not None and age > int(
        trust.get("counts_max_age_ms") or 11_000
    ):
        problem = f"{name} is stale: its counts are {age} ms old"
    elif clustered and isinstance(view_names, list) and sorted(view_names) != live:
        # Its keeper holds the rows of another membership: summing would count a moved
        # row twice or not at all. It passes as soon as it reads the list again (1 s).
        problem = (
            f"{name} holds the rows of the live nodes {sorted(view_names)} while the member "
            f"list says {live}"
        )
    vouched = problem is None
    now = _dig(document, "now") if vouched else None
    return NodeView(
        node=record.node,
        url=record.url,
        answering=record.node == me,
        http_status=answer.http_status,
        status=status or ("missing" if answer.http_status == 0 else "unknown"),
        missing=answer.http_status == 0,
        exact=trust.get("exact") if document is not None else None,
        state_age_ms=trust.get("state_age_ms") if document is not None else None,
        problem=problem,
        view=view_names if isinstance(view_names, list) else None,
        now=None
        if now is None
        else {
            k: now.get(k) for k in ("due", "claimable", "in_flight", "unclaimed_estimate", "held")
        },
        autoscale=_dig(document, "autoscale") if vouched else None,
        fenced=_dig(document, "fenced") if vouched else None,
        document=document if vouched else None,
    )


NOW_SUMS = (
    "due",
    "claimable",
    "due_sitemap",
    "due_discovered",
    "in_flight",
    "unclaimed_estimate",
    "paused",
    "held",
)
COMING_SUMS = ("due_15m", "due_60m", "due_24h")
FLOW_SUMS = ("came_due", "added", "triggered", "rescheduled", "removed")


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def sums(documents: list[dict[str, Any]]) -> dict[str, Any]:
    """The cluster's counts from every node's exact ones: sums, and the oldest age."""
    now: dict[str, Any] = {k: sum(_int(_dig(d, "now", k)) for d in documents) for k in NOW_SUMS}
    now["status"] = "ready"
    hours: list[int] = []
    for document in documents:
        for i, count in enumerate(_dig(document, "coming", "next_24h_by_hour") or []):
            if i >= len(hours):
                hours.append(0)
            hours[i] += _int(count)
    coming: dict[str, Any] = {
        k: sum(_int(_dig(d, "coming", k)) for d in documents) for k in COMING_SUMS
    }
    coming["next_24h_by_hour"] = hours
    fenced = [f for f in (_dig(d, "fenced") for d in documents) if isinstance(f, dict)]
    retired: dict[str, int] = {}
    for document in documents:
        by_route = _dig(document, "retired", "by_route")
        for route, count in by_route.items() if isinstance(by_route, dict) else ():
            retired[str(route)] = retired.get(str(route), 0) + _int(count)
    ages = [_dig(d, "autoscale", "oldest_claimable_age_s") for d in documents]
    oldest = max((float(a) for a in ages if isinstance(a, int | float)), default=0.0)
    return {
        "now": now,
        "coming": coming,
        "flow": {
            "last_hour": {
                k: sum(_int(_dig(d, "flow", "last_hour", k)) for d in documents) for k in FLOW_SUMS
            }
        },
        # What an autoscaler reads (KEDA metrics-api: valueLocation `autoscale.due_now`).
        "autoscale": {
            "due_now": sum(_int(_dig(d, "autoscale", "due_now")) for d in documents),
            "oldest_claimable_age_s": oldest,
        },
        # Each row is owned by one node: the nodes' retired rows add up to the cluster's.
        "retired": {"total": sum(retired.values()), "by_route": dict(sorted(retired.items()))},
        # None unless a node counted fences (a cluster's node always does).
        "fenced": {
            "due": sum(_int(f.get("due")) for f in fenced),
            "until_ms": max((_int(f.get("until_ms")) for f in fenced), default=0),
        }
        if fenced
        else None,
    }


def summary(
    answers: list[NodeAnswer], live: list[str], clustered: bool, me: str, generated_at: int
) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body): 200 with the sums when every live node vouches for its counts;
    otherwise 503, a problem naming each node that does not. Never a partial sum: an
    autoscaler reading one would under-scale."""
    judged = [judge(answer, live, clustered, me) for answer in answers]
    nodes = [builtins_of(view) for view in judged]
    missing = [view for view in judged if view.problem is not None]
    if not answers:
        missing_detail = (
            "the member list has no live node (this node's own heartbeats may be failing)"
        )
    else:
        missing_detail = "; ".join(f"{v.problem}" for v in missing)
    if missing or not answers:
        return 503, {
            "type": "about:blank",
            "title": "Cluster counts withheld",
            "status": 503,
            "detail": f"{missing_detail}. The cluster's counts are summed only when every "
            "live node vouches for its own; retry shortly",
            "instance": CLUSTER_QUEUE_STATE_PATH,
            "node": me,
            "clustered": clustered,
            "generated_at": generated_at,
            "withheld": [v.node for v in missing],
            "nodes": nodes,
        }
    documents = [view.document for view in judged if view.document is not None]
    return 200, {
        "node": me,
        "clustered": clustered,
        "generated_at": generated_at,
        "exact": True,
        "nodes": nodes,
        **sums(documents),
    }
