"""Admin reads: queue-state (from the keeper's state buffer), explain, overview, health.

None of these wait on the keeper: they read shared memory and point-read the store.
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec
from starlette.responses import Response

from api.body import json_response
from api.node import Node
from api.problems import invalid_query
from api.schedule import check_key
from api.schemas import Explain, Health, Overview, Readiness
from keeper.classes import classify, rank
from keeper.state import decode_queue_state, vouches
from shm import key_hash


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


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


def live_now(node: Node, status: str) -> dict[str, Any]:
    """The `now` fields that stay true without the keeper: read live from the lease table."""
    return {"status": status, "in_flight": node.leases.statistics().live_leases}


def queue_state(node: Node) -> Response:
    now = now_ms()
    snapshot = node.state.read()
    headers = {"Retry-After": str(node.settings.retry_after_s)}
    if snapshot is None:
        body = {
            "now": live_now(node, "unready"),
            "trust": {"live": False, "phase": "starting", "exact": False, "state_age_ms": None},
        }
        return json_response(body, 503, headers=headers)
    state = decode_queue_state(snapshot.payload)
    document = builtins(state)
    age = max(0, now - snapshot.written_at)
    trust = dict(document.get("trust") or {})
    trust["state_age_ms"] = age
    if vouches(state, now):
        document["trust"] = trust
        return json_response(document)
    status = (document.get("now") or {}).get("status") or "unready"
    body = {"now": live_now(node, status), "trust": trust}
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
        rank=rank(row.next_render_at, now, cls, _sitemap_boost()),
        lease=lease,
    )


def _sitemap_boost() -> float:
    from keeper.config import KeeperConfig

    return KeeperConfig().sitemap_boost


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
    )
