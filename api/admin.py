"""Admin reads: queue-state (from the keeper's state buffer), explain, overview, health.

None of these wait on the keeper: they read shared memory and point-read the store.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import msgspec
from starlette.responses import Response

from api.body import json_response
from api.node import Node
from api.problems import invalid_query
from api.schedule import check_key
from api.schemas import Explain, Health, Overview, Readiness
from keeper.classes import classify, rank
from keeper.state import (
    LeaseCounts,
    as_read,
    decode_queue_state,
    lease_counts,
    state_age_ms,
    vouches,
)
from shm import key_hash


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


CONSOLE = Path(__file__).resolve().parent / "console.html"


@functools.cache
def console_page() -> bytes:
    return CONSOLE.read_bytes()


def console() -> Response:
    return Response(console_page(), media_type="text/html; charset=utf-8")


def healthz(node: Node) -> Health:
    return Health(status="ok", worker=node.settings.worker, pid=os.getpid())


def readyz(node: Node) -> Response:
    if not node.ready():
        return json_response(
            Readiness(status="unready"),
            503,
            headers={"Retry-After": str(node.settings.retry_after_s)},
        )
    published_at = node.ring.published_at
    return json_response(
        Readiness(
            status="ready",
            published_at=published_at,
            publish_age_ms=max(0, now_ms() - published_at),
            generation=node.ring.generation,
        )
    )


def live_leases(node: Node) -> LeaseCounts:
    """Lease counts read now from the lease table: true with or without the keeper."""
    return lease_counts(node.leases.statistics())


def queue_state(node: Node) -> Response:
    """200 with every group while the keeper vouches for its numbers; otherwise 503 with
    trust (why not) and only the `now` fields that are live without it: status, in flight
    and lease counts from the lease table. Never a stale or partial count."""
    now = now_ms()
    headers = {"Retry-After": str(node.settings.retry_after_s)}
    snapshot = node.state.read()
    if snapshot is None:
        leases = live_leases(node)
        body: dict[str, Any] = {
            "node": node.settings.node,
            "now": {
                "status": "unready",
                "status_reason": "the keeper has not reported yet",
                "in_flight": leases.in_flight,
                "leases": builtins(leases),
            },
            "trust": {"live": False, "live_reason": "no report yet", "phase": "starting"},
        }
        return json_response(body, 503, headers=headers)
    reported = decode_queue_state(snapshot.payload)
    state = as_read(reported, now)
    document = builtins(state)
    document["trust"]["state_age_ms"] = state_age_ms(state, now)
    if vouches(reported, now):
        return json_response(document)
    leases = live_leases(node)
    body = {
        "node": state.node,
        "generated_at": state.generated_at,
        "now": {
            "status": state.now.status,
            "status_reason": state.now.status_reason,
            "in_flight": leases.in_flight,
            "leases": builtins(leases),
        },
        "trust": document["trust"],
    }
    return json_response(body, 503, headers=headers)


def explain(node: Node, key: str | None) -> Explain:
    if not key:
        raise invalid_query("key", "required: the row's key")
    check_key(key, "key")
    now = now_ms()
    lease = builtins(node.leases.state(key_hash(key.encode()), now))
    row = node.store.get(key)
    if row is None:
        return Explain(
            key=key, exists=False, claimable=False, reason="no such row", now=now, lease=lease
        )
    routes = node.routes.routes()
    cls = classify(row, routes, node.routes.default_cadence_s)
    paused = node.routes.paused(row.route)
    reason, claimable = _why(row.next_render_at, now, paused, lease)
    return Explain(
        key=key,
        exists=True,
        claimable=claimable,
        reason=reason,
        now=now,
        row=row,
        cadence_s=cls.cadence_s,
        route_paused=paused,
        render_class=builtins(cls),
        rank=rank(row.next_render_at, now, cls, node.settings.sitemap_boost),
        lease=lease,
    )


def _why(due_at: int, now: int, paused: bool, lease: dict[str, Any]) -> tuple[str, bool]:
    if paused:
        return "its route is paused", False
    leased_until = lease.get("lease_expires_at") or lease.get("expires_at")
    if lease.get("leased") and leased_until:
        return f"leased until {leased_until} (epoch ms)", False
    held_until = lease.get("held_until")
    if held_until and held_until > now:
        return (
            f"held back until {held_until}: its leases kept expiring with no result",
            False,
        )
    if due_at > now:
        return f"not due until {due_at} (in {(due_at - now) // 1000} s)", False
    return (
        f"due for {(now - due_at) // 1000} s and claimable: served in rank order as the "
        "keeper publishes it",
        True,
    )


def overview(node: Node) -> Overview:
    now = now_ms()
    published_at = node.ring.published_at
    supervisor = None
    if node.supervisor_state is not None:
        snapshot = node.supervisor_state.read()
        if snapshot is not None:
            supervisor = msgspec.msgpack.decode(snapshot.payload)
    state = node.state.read()
    keeper = node.read_keeper_statistics()
    return Overview(
        now=now,
        node=node.settings.node,
        instance=node.settings.instance,
        worker=node.settings.worker,
        status="ready" if node.ready() else "unready",
        leases=builtins(node.leases.statistics()),
        ring=builtins(node.ring.statistics()),
        publish_age_ms=max(0, now - published_at) if published_at else None,
        supervisor=supervisor,
        state_age_ms=max(0, now - state.written_at) if state is not None else None,
        completions=builtins(node.completions.statistics()),
        keeper=None if keeper is None else builtins(keeper),
    )
