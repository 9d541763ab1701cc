"""The claim path, on any worker with no mutex, and the renewals that follow it
(completions: api.completions).

Claim: take ring entries in order -> grant an exclusive lease in the lease table, with
the cadence the entry was published with as the hold cap -> read the granted rows and
hand back any gone, no longer due or on a paused route. A stale token changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from starlette.responses import Response

from api.body import json_response
from api.schemas import (
    ClaimRequest,
    ClaimResponse,
    Lease,
    NodeStatus,
    RenewRequest,
    RenewResult,
    RenewResults,
)
from shm import Grant, key_hash

if TYPE_CHECKING:
    from api.node import Node

LEASE_NOT_HELD = "lease_not_held"
NOT_FOUND = "not_found"


MAX_TOKEN = 2**64 - 1


def parse_token(token: str) -> int | None:
    """A token past 64 bits was never issued: it is simply not held."""
    value = int(token)
    return value if value <= MAX_TOKEN else None


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def unready(node: Node) -> Response:
    """The fleet's "not ready, retry in N s": plain JSON with a string `status` (a problem
    document's `status` is the HTTP code, so this one body is not problem+json)."""
    seconds = node.settings.retry_after_s
    return json_response(
        NodeStatus(
            status="unready",
            detail="the keeper has not published the queue yet; retry shortly",
            retry_after_s=seconds,
        ),
        503,
        headers={"Retry-After": str(seconds)},
    )


def grant_from_ring(node: Node, want: int, lease_ms: int) -> list[Lease]:
    """Grant up to `want` leases from the published ring; fewer if the ring runs dry.

    Grant first, then read the granted rows once. The grant's hold cap is the cadence
    the entry was published with (its class's, as of that publish). The read after the
    grant is the one trusted: a completion commits its row before it releases its lease,
    so a result that landed before our grant is in the row we read, and a key that is
    gone, no longer due or on a paused route is handed back instead of granted twice.
    Entries published without a cadence (0) are read once before their grant too, to
    learn it.
    """
    ring, store, leases, routes = node.ring, node.store, node.leases, node.routes
    granted: list[Lease] = []
    while len(granted) < want:
        entries = ring.claim(want - len(granted))
        if not entries:
            break
        now = now_ms()
        unknown = [entry.key.decode() for entry in entries if not entry.cadence_s]
        before = store.get_many(unknown) if unknown else {}
        held: list[tuple[str, int, int, int]] = []  # key, key hash, token, lease expiry
        for entry in entries:
            key = entry.key.decode()
            cadence_s: int | None = entry.cadence_s
            if not cadence_s:
                row = before.get(key)
                # Gone, or rendered since the keeper published it: not claimable now.
                if row is None or row.next_render_at > now:
                    continue
                cadence_s = routes.grant_cadence_s(row)
                if cadence_s is None:
                    continue
            outcome = leases.grant(entry.key_hash, now, lease_ms, cadence_s * 1000)
            if type(outcome) is Grant:
                held.append((key, entry.key_hash, outcome.token, outcome.expires_at))
        if not held:
            continue
        rows = store.get_many([key for key, _, _, _ in held])
        for key, hashed, token, expires_at in held:
            row = rows.get(key)
            cadence_s = None if row is None else routes.grant_cadence_s(row)
            if row is None or row.next_render_at > now or cadence_s is None:
                # Hand it back: ending the lease is not a missed render.
                leases.complete(hashed, token, now)
                continue
            granted.append(
                Lease(
                    key=key,
                    token=str(token),
                    route=row.route,
                    due_at=row.next_render_at,
                    lease_expires_at=expires_at,
                    sitemap=row.sitemap,
                    cadence_s=cadence_s,
                )
            )
    return granted


async def next_publish(node: Node, deadline: float) -> bool:
    """Sleep until the ring's generation changes (True) or the deadline passes (False)."""
    generation = node.ring.generation
    while node.ring.generation == generation:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(node.settings.poll_interval_s, remaining))
    return True


async def claim(node: Node, request: ClaimRequest) -> ClaimResponse | Response:
    if not node.ready():
        return unready(node)
    lease_ms = request.lease_s * 1000
    deadline = time.monotonic() + request.wait_s
    leases = grant_from_ring(node, request.max, lease_ms)
    # Long poll: nothing was claimable, so wait for the keeper's next publish (a new ring
    # generation) and try again, until something is granted or the wait is over.
    while not leases and await next_publish(node, deadline):
        leases = grant_from_ring(node, request.max, lease_ms)
    return ClaimResponse(leases=leases, status="ready")


def renew(node: Node, request: RenewRequest, default_lease_s: int = 300) -> RenewResults:
    now = now_ms()
    results: list[RenewResult] = []
    for item in request.items:
        lease_ms = (item.lease_s or default_lease_s) * 1000
        token = parse_token(item.token)
        expires_at = (
            None
            if token is None
            else node.leases.renew(key_hash(item.key.encode()), token, now, lease_ms)
        )
        if expires_at is None:
            results.append(RenewResult(key=item.key, ok=False, error=LEASE_NOT_HELD))
        else:
            results.append(RenewResult(key=item.key, ok=True, lease_expires_at=expires_at))
    return RenewResults(results=results)
