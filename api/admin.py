"""Admin reads: queue-state (from the keeper's state buffer), explain, overview, health;
and the one admin action that is not a schedule write as such, "render now".

None of these wait on the keeper: they read shared memory and point-read the store.
Health, readiness, queue-state and overview read shared memory only; explain and render
now, which call the store, are made on the worker's store lane (api.endpoints, api.lane).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Literal

import msgspec
from starlette.responses import Response

from api.body import json_response
from api.completions import CompletionQueueStatistics
from api.node import Node
from api.problems import not_found
from api.schedule import check_key
from api.status import claim_status, lease_view, supervisor_statistics
from keeper.classes import classify, rank
from keeper.state import as_read, decode_queue_state, state_age_ms, vouches
from shm import KeyLeaseState, key_hash
from shm.keys import site_of
from shm.segment import now_ms
from store.cadence import history_of, ladder, rung_of
from store.rows import RowWrite
from wire.schemas import Explain, ExplainState, Health, Overview, Readiness, RenderNow


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
    """200 while this node can grant a claim (ready, or draining the keeper's last set, or
    fenced: every due key it owns waits on a fence that ends by itself, said with until
    when); 503 when it cannot (no set published yet, the last one drained with the keeper
    not publishing, or its cluster membership unconfirmed)."""
    status = claim_status(node, fences=True)
    published_at = node.ring.published_at
    body = Readiness(
        status=status.status,
        reason=status.reason,
        published_at=published_at or None,
        publish_age_ms=status.publish_age_ms,
        generation=node.ring.generation or None,
        fenced=status.fenced,
        fenced_until=status.fenced_until,
    )
    if not status.can_grant:
        return json_response(body, 503, headers={"Retry-After": str(node.settings.retry_after_s)})
    return json_response(body)


def _live_now(node: Node, document: dict[str, Any], now: int) -> None:
    """Put the lease table's own counts into `now`: in flight excludes expired leases (the
    keeper's record counts them until a sweep), and the claim status is this moment's."""
    view = lease_view(node, supervisor_statistics(node), now)
    group = document.setdefault("now", {})
    group["in_flight"] = view.in_flight
    leases = dict(group.get("leases") or {})
    leases.update(builtins(view))
    group["leases"] = leases
    if "due" in group:
        group["unclaimed_estimate"] = max(0, int(group["due"]) - view.in_flight)
    status = claim_status(node, now, fences=True)
    group["claims"] = {"status": status.status, "reason": status.reason}


def queue_state(node: Node) -> Response:
    """200 with every group while the keeper vouches for its numbers; otherwise 503 with
    trust (why not) and only the `now` fields that are live without it: status, in flight
    and lease counts from the lease table. Never a stale or partial count."""
    status, document = queue_state_document(node)
    if status == 200:
        return json_response(document)
    return json_response(
        document, status, headers={"Retry-After": str(node.settings.retry_after_s)}
    )


def _cluster_view(node: Node, document: dict[str, Any]) -> None:
    """In a cluster: the live nodes whose rows the keeper holds its share of (the cluster's
    queue-state sums only counts taken under one membership)."""
    if not node.settings.clustered:
        return
    keeper = node.read_keeper_statistics()
    if keeper is None or keeper.cluster is None:
        return
    document["cluster"] = {
        "view": list(keeper.cluster.view),
        "generation": keeper.cluster.generation,
        "fenced_until": keeper.cluster.fenced_until,
    }


def queue_state_document(node: Node) -> tuple[int, dict[str, Any]]:
    """queue-state's HTTP status and body (queue_state; the cluster's fan-out reads its own
    node's this way)."""
    now = now_ms()
    snapshot = node.state.read()
    if snapshot is None:
        body: dict[str, Any] = {
            "node": node.settings.node,
            "now": {
                "status": "unready",
                "status_reason": "the keeper has not reported yet",
            },
            "trust": {"live": False, "live_reason": "no report yet", "phase": "starting"},
        }
        _live_now(node, body, now)
        _cluster_view(node, body)
        return 503, body
    reported = decode_queue_state(snapshot.payload)
    state = as_read(reported, now)
    document = builtins(state)
    document["trust"]["state_age_ms"] = state_age_ms(state, now)
    _cluster_view(node, document)
    if vouches(reported, now):
        _live_now(node, document, now)
        return 200, document
    body = {
        "node": state.node,
        "generated_at": state.generated_at,
        "now": {
            "status": state.now.status,
            "status_reason": state.now.status_reason,
        },
        "trust": document["trust"],
    }
    if "cluster" in document:
        body["cluster"] = document["cluster"]
    _live_now(node, body, now)
    return 503, body


def explain(node: Node, key: str) -> Explain:
    now = now_ms()
    lease = node.leases.state(key_hash(key.encode()), now)
    row = node.store.get(key)
    if row is None:
        return Explain(
            key=key,
            exists=False,
            claimable=False,
            reason="no such row",
            now=now,
            lease=builtins(lease),
        )
    node.routes.refresh()
    routes = node.routes.routes()
    cls = classify(row, routes, node.routes.default_cadence_s)
    route = routes.get(row.route)
    pattern = b"" if route is None or route.site_pattern is None else route.site_pattern.encode()
    paused = node.routes.paused(row.route)
    state, reason = _why(row.next_render_at, now, paused, lease, row.last_outcome)
    if row.retired_at is not None:
        state, reason = (
            "retired",
            f"retired at {row.retired_at} (epoch ms) after {row.not_found_streak} "
            f"{row.retired_reason} outcomes in a row: never due until an upsert of its key "
            "or render-now revives it",
        )
    held = lease.held and lease.held_until > now
    route_settings = routes.get(row.route)
    adapt = None if route_settings is None else route_settings.adapt
    steps = None if adapt is None else ladder(adapt.min_s, adapt.max_s)
    learned = row.learned_cadence_s
    return Explain(
        key=key,
        exists=True,
        claimable=state == "claimable",
        reason=reason,
        now=now,
        state=state,
        held_until=lease.held_until if held else None,
        held_for=_held_for(row.last_outcome) if held else None,
        attempts_in_a_row=lease.misses if lease.misses else None,
        row=row,
        site=site_of(key.encode(), pattern).decode(errors="replace") or None,
        cadence_s=cls.cadence_s,
        learned_cadence_s=learned,
        ladder_step=None if steps is None or learned is None else rung_of(steps, learned),
        ladder_steps=None if steps is None else len(steps),
        recent_changes=history_of(row.change_history) if row.change_history else None,
        route_paused=paused,
        render_class=builtins(cls),
        rank=rank(row.next_render_at, now, cls, node.settings.sitemap_boost),
        lease=builtins(lease),
    )


def _held_for(last_outcome: str | None) -> Literal["failed", "unanswered"]:
    return "failed" if last_outcome == "failed" else "unanswered"


def _why(
    due_at: int, now: int, paused: bool, lease: KeyLeaseState, last_outcome: str | None
) -> tuple[ExplainState, str]:
    if paused:
        return "paused", "its route is paused"
    if lease.leased and lease.lease_expires_at > now:
        return "leased", f"leased until {lease.lease_expires_at} (epoch ms) to a render worker"
    if lease.held and lease.held_until > now:
        why = (
            "its renders failed"
            if _held_for(last_outcome) == "failed"
            else "its leases expired with no result"
        )
        return (
            "held",
            f"held back until {lease.held_until} (in {(lease.held_until - now) // 1000} s): "
            f"{why} {lease.misses} time(s) in a row; each one doubles the wait (from 2 lease "
            "lengths, capped at its cadence) and a rendered result resets it",
        )
    if due_at > now:
        return "not_due", f"not due until {due_at} (in {(due_at - now) // 1000} s)"
    return (
        "claimable",
        f"due for {(now - due_at) // 1000} s and claimable: served in rank order as the "
        "keeper publishes it",
    )


def render_now(node: Node, request: RenderNow) -> Explain:
    """Make the key due now and end any hold on it (its misses too): an operator's "render
    this again". A live lease is left alone; the key is claimable once it ends."""
    check_key(request.key, "$.key")
    row = node.store.get(request.key)
    if row is None:
        raise not_found(f"no row has key {request.key!r}")
    now = now_ms()
    node.store.write(
        upsert=[
            RowWrite(
                key=row.key,
                route=row.route,
                next_render_at=now,
                cadence_s=row.cadence_s,
                sitemap=row.sitemap,
            )
        ]
    )
    node.stamp_keys_written([row.key])
    node.leases.forgive(key_hash(row.key.encode()), now)
    return explain(node, row.key)


def overview(node: Node, completions: CompletionQueueStatistics) -> Overview:
    """`completions`: this worker's completion queue's counts."""
    now = now_ms()
    published_at = node.ring.published_at
    supervisor = supervisor_statistics(node)
    state = node.state.read()
    keeper = node.read_keeper_statistics()
    keeper_snapshot = None if node.keeper_statistics is None else node.keeper_statistics.read()
    status = claim_status(node, now, fences=True)
    return Overview(
        now=now,
        node=node.settings.node,
        instance=node.settings.instance,
        worker=node.settings.worker,
        status=status.status,
        status_reason=status.reason,
        pid=os.getpid(),
        lease_view=builtins(lease_view(node, supervisor, now)),
        leases=builtins(node.leases.statistics()),
        ring=builtins(node.ring.statistics()),
        publish_age_ms=max(0, now - published_at) if published_at else None,
        supervisor=supervisor,
        state_age_ms=max(0, now - state.written_at) if state is not None else None,
        completions=builtins(completions),
        store=builtins(node.store.writability()),
        keeper=None if keeper is None else builtins(keeper),
        keeper_statistics_age_ms=None
        if keeper_snapshot is None
        else max(0, now - keeper_snapshot.written_at),
    )
