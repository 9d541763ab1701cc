"""`GET /metrics`: Prometheus text format, built from the keeper's queue-state record and the
shared-memory primitives' `statistics()`, never re-derived from the table.

Gauges an autoscaler reads: `renderqueue_due` (claimable work) and `renderqueue_in_flight`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api.node import Node
from keeper.state import decode_queue_state, vouches

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@dataclass
class Exposition:
    lines: list[str] = field(default_factory=list)

    def metric(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float | int | None]],
    ) -> None:
        rendered = [
            f"{name}{_labels(labels)} {_number(value)}"
            for labels, value in samples
            if value is not None
        ]
        if not rendered:
            return
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        self.lines.extend(rendered)

    def gauge(self, name: str, help_text: str, value: float | int | None, **labels: str) -> None:
        self.metric(name, "gauge", help_text, [(labels, value)])

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape(str(value))}"' for key, value in sorted(labels.items()))
    return "{" + inner + "}"


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def render(node: Node) -> str:
    now = now_ms()
    out = Exposition()
    leases = node.leases.statistics()
    ring = node.ring.statistics()
    out.gauge("renderqueue_ready", "1 once the keeper has published the queue.", node.ready())
    published_at = node.ring.published_at
    out.gauge(
        "renderqueue_publish_age_seconds",
        "Seconds since the keeper last published the ready ring.",
        (now - published_at) / 1000 if published_at else None,
    )
    out.gauge("renderqueue_in_flight", "Live leases in the lease table.", leases.live_leases)
    out.gauge(
        "renderqueue_held_keys",
        "Distinct keys held back after leases expired with no result.",
        leases.held_keys,
    )
    out.metric(
        "renderqueue_lease_refusals_total",
        "counter",
        "Grants refused, by reason; a full probe window can refuse well below 100% occupancy.",
        [
            ({"reason": "taken"}, leases.refusals_taken),
            ({"reason": "held"}, leases.refusals_held),
            ({"reason": "probe_full"}, leases.refusals_probe_full),
        ],
    )
    out.metric(
        "renderqueue_lease_hold_events_total",
        "counter",
        "Expiries with no result that started a hold (the seed's claim_wedged).",
        [({}, leases.hold_events)],
    )
    out.gauge("renderqueue_lease_table_occupancy", "Share of lease slots in use.", leases.occupancy)
    out.gauge(
        "renderqueue_ready_ring_remaining",
        "Unclaimed entries left in the last published ring.",
        ring.remaining,
    )
    snapshot = node.state.read()
    if snapshot is not None:
        state = decode_queue_state(snapshot.payload)
        out.gauge(
            "renderqueue_state_age_seconds",
            "Age of the keeper's last queue-state report.",
            (now - snapshot.written_at) / 1000,
        )
        out.gauge(
            "renderqueue_keeper_live",
            "1 while the keeper vouches for its numbers.",
            vouches(state, now),
        )
        _queue_metrics(out, msgspec.to_builtins(state))
    else:
        out.gauge("renderqueue_keeper_live", "1 while the keeper vouches for its numbers.", 0)
    return out.text()


def _queue_metrics(out: Exposition, state: dict[str, Any]) -> None:
    now_group = state.get("now") or {}
    out.gauge("renderqueue_due", "Rows due now (claimable work).", now_group.get("due"))
