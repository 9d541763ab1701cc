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
    due: int | None = None  # rows due now
    in_flight: int | None = None  # leases outstanding on the node
    oldest_due_s: float | None = None  # how late the most overdue row is
    worst_lateness: float | None = None  # the highest lateness in cadences, if reported
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


def _walk_numbers(node: Any, names: frozenset[str], found: list[float]) -> None:
    if isinstance(node, dict):
        for name, value in node.items():
            number = _number(value)
            if number is not None and name in names:
                found.append(number)
            else:
                _walk_numbers(value, names, found)
    elif isinstance(node, list):
        for value in node:
            _walk_numbers(value, names, found)


_AGE_MS_NAMES = frozenset({"oldest_due_age_ms", "oldest_age_ms", "age_ms", "late_ms"})
_AGE_S_NAMES = frozenset({"oldest_due_age_s", "oldest_age_s", "age_s", "late_s"})
_RATIO_NAMES = frozenset({"max_lateness", "worst_lateness", "lateness_max", "max_cadences"})


def summarize_queue_state(http_status: int, body: dict[str, Any]) -> NodeView:
    now = _get(body, "now") or {}
    status = _get(now, "status") or body.get("status") or _get(body, "trust", "phase")
    lateness = body.get("lateness")
    ages_ms: list[float] = []
    ages_s: list[float] = []
    ratios: list[float] = []
    _walk_numbers(lateness, _AGE_MS_NAMES, ages_ms)
    _walk_numbers(lateness, _AGE_S_NAMES, ages_s)
    _walk_numbers(lateness, _RATIO_NAMES, ratios)
    oldest = max([age / 1000 for age in ages_ms] + ages_s, default=None)
    oldest_due_at: list[float] = []
    _walk_numbers(lateness, frozenset({"oldest_due_at"}), oldest_due_at)
    now_ms = _number(_get(body, "now", "now")) or _number(body.get("generated_at"))
    if oldest is None and oldest_due_at and now_ms is not None:
        oldest = max(0.0, (now_ms - min(oldest_due_at)) / 1000)
    age_ms = _number(_get(body, "trust", "state_age_ms"))
    return NodeView(
        status=str(status) if status is not None else ("ready" if http_status == 200 else "?"),
        http_status=http_status,
        due=_total(_get(now, "due")),
        in_flight=_total(_get(now, "in_flight")),
        oldest_due_s=oldest,
        worst_lateness=max(ratios, default=None),
        state_age_s=age_ms / 1000 if age_ms is not None else None,
    )
