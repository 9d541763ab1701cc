"""The few numbers of a node's queue-state a fleet operator watches while it drains.

The queue-state document belongs to the node; this reads it defensively (a field it
cannot find shows as unknown, never as an error), since the fleet may talk to a
node of another version.
"""

from __future__ import annotations

from typing import Any

import msgspec


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    status: str = "unknown"
    http_status: int = 0
    due: int | None = None  # rows due now (routes not paused)
    in_flight: int | None = None  # leases outstanding on the node
    oldest_due_s: float | None = None  # how late the earliest-due claimable row is
    worst_lateness: float | None = None  # the worst class's oldest row, in cadences
    state_age_s: float | None = None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    return None


def _total(value: Any) -> int | None:
    """An int, or the sum of an object's numeric members (e.g. {sitemap, discovered})."""
    number = _number(value)
    if number is not None:
        return int(number)
    if isinstance(value, dict):
        if "total" in value:
            return _total(value["total"])
        parts = [_number(part) for part in value.values()]
        numbers = [part for part in parts if part is not None]
        return int(sum(numbers)) if numbers else None
    return None


def _get(body: dict[str, Any], *path: str) -> Any:
    node: Any = body
    for name in path:
        if not isinstance(node, dict) or name not in node:
            return None
        node = node[name]
    return node


def summarize_queue_state(http_status: int, body: dict[str, Any]) -> NodeView:
    """The view from GET /prerender_admin/queue-state (a 503 carries status, in flight
    and trust only: the counts are left unknown rather than shown stale)."""
    now = _get(body, "now") or {}
    status = _get(now, "status") or _get(body, "trust", "phase")
    ratios = [
        _number(row.get("oldest_lateness"))
        for row in (_get(body, "lateness", "classes") or [])
        if isinstance(row, dict)
    ]
    worst = max((ratio for ratio in ratios if ratio is not None), default=None)
    age_ms = _number(_get(body, "trust", "state_age_ms"))
    counted = http_status == 200
    oldest = _number(_get(body, "autoscale", "oldest_claimable_age_s"))
    return NodeView(
        status=str(status) if status is not None else ("ready" if counted else "unknown"),
        http_status=http_status,
        due=_total(_get(now, "due")) if counted else None,
        in_flight=_total(_get(now, "in_flight")),
        oldest_due_s=oldest if counted else None,
        worst_lateness=worst if counted else None,
        state_age_s=age_ms / 1000 if age_ms is not None else None,
    )
