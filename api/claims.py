"""The claim path, on any worker with no mutex, and the renewals that follow it
(completions: api.completions).

Claim: take ring entries in order -> take the key's site permit and spacing (shm.sites;
a key whose site is at its cap, inside its spacing or blocked is skipped: it keeps its
place in the keeper's schedule, and the claim goes on down the ring) -> grant an
exclusive lease in the lease table, with the cadence the entry was published with as
the hold cap -> answer from the entry each key nothing wrote through this node since the
keeper's view (shm.marks); read the rest and hand back any gone, no longer due or on a
paused route. A stale token changes nothing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Generator
from itertools import repeat
from typing import Any, Literal

import numpy as np
from starlette.responses import Response

from api.body import json_response
from api.node import Node
from api.problems import ApiError
from api.status import (
    MIN_TERM_MS,
    NodeClaimStatus,
    claim_status,
    membership_lapsed,
    read_fences,
)
from keeper.ceiling import capped_term_ms
from keeper.ownership import placements, winners
from shm import key_hash
from shm.keys import key_site_hash, key_site_hashes
from shm.segment import now_ms
from store.rows import Row
from wire.schemas import (
    DEFAULT_LEASE_S,
    ClaimRequest,
    ClaimResponse,
    ItemResult,
    Lease,
    NodeStatus,
    RenewItem,
    RenewRequest,
    RenewResult,
    RenewResults,
)

LEASE_NOT_HELD = "lease_not_held"
NOT_OWNER = "not_owner"
NOT_FOUND = "not_found"


MAX_TOKEN = 2**64 - 1
# How long a claim waits for its node's keeper to raise the lease ceiling to its ask (it
# reads the member list every second), and how often it looks meanwhile.
CEILING_WAIT_S, CEILING_POLL_S = 3.0, 0.05


def split_token(token: str) -> tuple[str | None, str]:
    """(the granting node's name, or None when the token names none; the decimal part).

    A clustered node prefixes its tokens with its name (`node-a:4294967297`) so that any
    node can tell which lease table holds the lease; a single node issues bare decimals."""
    name, colon, value = token.rpartition(":")
    return (name, value) if colon else (None, token)


def parse_token(token: str, node: str | None = None) -> int | None:
    """The lease table's token, when the lease would be in this node's table: a token
    past 64 bits, or one another node (not `node`) granted, is simply not held here."""
    name, digits = split_token(token)
    if name is not None and name != node:
        return None
    value = int(digits)
    return value if value <= MAX_TOKEN else None


def format_token(node: Node, token: int) -> str:
    settings = node.settings
    return f"{settings.node}:{token}" if settings.clustered else str(token)


def unready(
    node: Node, status: NodeClaimStatus, completed: list[ItemResult] | None = None
) -> Response:
    """The fleet's "not ready, retry in N s": plain JSON with a string `status` (`unready`
    or `stalled`; a problem document's `status` is the HTTP code, so this one body is not
    problem+json). `completed`: a claim's completions, applied before it found so."""
    seconds = node.settings.retry_after_s
    return json_response(
        NodeStatus(
            status=status.status,
            detail=f"{status.reason}; retry shortly",
            retry_after_s=seconds,
            completed=completed,
        ),
        503,
        headers={"Retry-After": str(seconds)},
    )


def lease_ms_of(node: Node, lease_s: int | None) -> int:
    """The lease asked for, or the default: 300 s, or the node's cap when that is shorter."""
    return (lease_s or min(DEFAULT_LEASE_S, node.settings.max_lease_s)) * 1000


def lease_term_ms(node: Node, asked_ms: int, now: int) -> int:
    """The term a lease asked for now gets: on a clustered node, no later than its lease
    ceiling allows (keeper.ceiling; below MIN_TERM_MS: none is granted). The ask is
    noted for the keeper, which keeps the ceiling that far ahead."""
    if not node.settings.clustered or node.marks is None:
        return asked_ms
    node.marks.note_lease_asked(asked_ms)
    return capped_term_ms(asked_ms, node.marks.lease_ceiling(), now)


async def ceiling_covers(node: Node, lease_ms: int) -> None:
    """Wait, a few member reads at most, until a clustered node's lease ceiling covers a
    lease this long: its keeper raises it at its next read once it sees the ask (a
    node's first claims, or a longer ask than lately). Only then is a term cut short."""
    if not node.settings.clustered or node.marks is None:
        return
    deadline = time.monotonic() + CEILING_WAIT_S
    while lease_term_ms(node, lease_ms, now_ms()) < lease_ms and time.monotonic() < deadline:
        await asyncio.sleep(CEILING_POLL_S)


def check_lease_s(node: Node, lease_s: int | None) -> None:
    """A lease past the cluster's cap is refused: another node takes this one's keys once
    leases this long could have ended."""
    cap = node.settings.max_lease_s
    if lease_s is not None and lease_s > cap:
        raise ApiError(
            422,
            "Lease too long",
            f"lease_s {lease_s} is over this node's max_lease_s of {cap} s; ask for at most "
            f"{cap} and renew",
        )


def owners_now(node: Node, hashes: list[int], sites: list[int]) -> list[str | None] | None:
    """Each key's owner in the keeper's current view, read after the lease CASes (None:
    this node owns every key, not being clustered); `sites`: the keys' site hashes, what
    ownership by site is judged on (keeper.ownership.placements). An owner of None: no
    view, or this node is not live in it, so it owns nothing. The read's fence pairs with
    the keeper's (shm.marks): a key this reports as owned here was owned when the
    keeper's next hand-over scan ran, which then saw its lease."""
    settings = node.settings
    if not settings.clustered:
        return None
    view = None if node.marks is None else node.marks.owners()
    if view is None or settings.node not in view.nodes:
        return [None] * len(hashes)
    if len(view.nodes) == 1:
        return [view.nodes[0]] * len(hashes)
    placed = placements(
        np.asarray(hashes, dtype=np.uint64),
        np.asarray(sites, dtype=np.uint64),
        settings.ownership == "site",
    )
    picked = winners(placed, view.nodes)
    return [view.nodes[i] for i in picked.tolist()]


def _keep_owned(
    node: Node, granted: list[Lease], hashes: list[int], tokens: list[int], now: int
) -> list[Lease]:
    """Hand back any granted key this node no longer owns (its view moved on during the
    claim): never answered, so no one holds it but the lease table, briefly. `hashes`
    and `tokens`: each lease's, in the same order."""
    settings = node.settings
    if not settings.clustered:
        return granted
    # Placed by the host's site, not the entry's (a route's site pattern moves no key
    # between nodes: keeper.core.KeeperCore.placements_of).
    sites = (
        key_site_hashes([lease.key.encode() for lease in granted]).tolist()
        if settings.ownership == "site"
        else [0] * len(granted)
    )
    owners = owners_now(node, hashes, sites)
    if owners is None:
        return granted
    me = node.settings.node
    kept: list[Lease] = []
    for lease, hashed, token, owner in zip(granted, hashes, tokens, owners, strict=True):
        if owner == me:
            kept.append(lease)
        else:
            node.leases.complete(hashed, token, now)
    return kept


# A store call the claim path needs made: a read, or the route book's refresh. The driver
# makes it where the worker makes its store calls (api.lane) and sends back its value.
StoreCall = Callable[[], Any]


def grant_from_ring(node: Node, want: int, lease_ms: int) -> list[Lease]:
    """Grant up to `want` leases from the published ring; fewer if the ring runs dry.
    The store is called in the caller's thread (`grant`: the event loop's way)."""
    steps = _granting(node, want, lease_ms)
    try:
        call = next(steps)
        while True:
            try:
                value = call()
            except BaseException as exc:
                call = steps.throw(exc)
            else:
                call = steps.send(value)
    except StopIteration as done:
        leases: list[Lease] = done.value
        return leases


async def grant(node: Node, want: int, lease_ms: int) -> list[Lease]:
    """`grant_from_ring` on the event loop: only a claim that must touch the store (a stale
    route book, a row to read) hops to the worker's store lane and back, and then only for
    that call; on SQLite the calls stay on the loop (api.lane)."""
    lane = node.lane
    steps = _granting(node, want, lease_ms)
    try:
        call = next(steps)
        while True:
            try:
                value = call() if lane.hot_inline else await lane.call(call)
            except BaseException as exc:  # a cancelled claim hands its leases back too
                call = steps.throw(exc)
            else:
                call = steps.send(value)
    except StopIteration as done:
        leases: list[Lease] = done.value
        return leases


def _granting(node: Node, want: int, lease_ms: int) -> Generator[StoreCall, Any, list[Lease]]:
    """The claim, yielding each store call it needs made and taking back its value.

    Grant first, then check. The ring's entries come as arrays and are granted in one C
    call (`LeaseTable.grant_batch`: each key's site permit and spacing, then its lease),
    with the cadence each entry was published with (its class's, as of that publish) as
    the hold cap; the write marks are read for the granted keys in one call after it. A
    completion commits its row and stamps its write mark before it releases its lease,
    so after our grant either the mark shows the write (and the row is read) or the
    key's mark is below the view its generation was selected from, and the entry is what
    the keeper published from a view that already held every write this node made to
    it: answered unread, its lease built from the arrays. A row read after the grant is
    the one trusted: a key that is gone, retired, no longer due or on a paused route is handed
    back instead of granted twice. Entries published without a cadence (0) are read
    once before their grant too, to learn it. A key not granted gets no Python object.

    A store call that fails (the store unavailable, the claim cancelled) hands back every
    lease the claim took before it is raised: none was answered, so nobody renders them.
    """
    ring, store, leases, routes, marks = node.ring, node.store, node.leases, node.routes, node.marks
    granted: list[Lease] = []
    # Each granted lease's key hash and token, in `granted`'s order.
    granted_hashes: list[int] = []
    granted_tokens: list[int] = []
    held: list[tuple[str, int, int, int]] = []  # key, key hash, token, expiry: to read
    clustered = node.settings.clustered
    granter = node.settings.node if clustered else None
    try:
        while len(granted) < want:
            if not routes.fresh:
                yield routes.refresh
            # Read before the claim: the entries come from this generation or a later one,
            # whose view is no older (so the check below can only be too careful).
            view = 0 if marks is None else marks.view_of(ring.generation)
            if lease_term_ms(node, lease_ms, now_ms()) < MIN_TERM_MS:
                break  # the lease ceiling has run out (api.status.membership_lapsed)
            claimed = ring.claim_batch(want - len(granted))
            if not len(claimed):
                break
            if view and marks is not None:
                marks.refresh_classes()
            now = now_ms()
            term_ms = lease_term_ms(node, lease_ms, now)
            if term_ms < MIN_TERM_MS:
                break  # ran out since the check: these entries are in the next publish
            entries = claimed.entries
            # A round's columns as lists: its few numpy calls are fixed costs that a claim
            # of ten keys would feel, its list work is a few tens of ns a key.
            published = entries["cadence_s"].tolist()
            hashes = entries["key_hash"]
            cadence_ms = [cadence * 1000 for cadence in published]
            unknown = [index for index, cadence in enumerate(published) if not cadence]
            skipped: list[int] = []
            if unknown:
                unknown_keys = claimed.keys_of(np.array(unknown, dtype=np.int64))
                before: dict[str, Row] = yield functools.partial(store.get_many, unknown_keys)
                for index, key in zip(unknown, unknown_keys, strict=True):
                    row = before.get(key)
                    # Gone, retired or rendered since the keeper published it: not claimable now.
                    learned = (
                        None if row is None or not row.due_by(now) else routes.grant_cadence_s(row)
                    )
                    if learned is None:
                        skipped.append(index)
                    else:
                        cadence_ms[index] = learned * 1000
            if skipped:
                hashes = hashes.copy()
                hashes[skipped] = 0  # a hash of 0 is not granted
            # The site's permit first (its spacing, its block), then the lease: a skipped
            # key is only consumed from this generation of the ring, never rescheduled.
            tokens, expires = leases.grant_batch(
                hashes, entries["site_hash"], np.array(cadence_ms, dtype=np.uint64), now, term_ms
            )
            token_list = tokens.tolist()
            won = [index for index, token in enumerate(token_list) if token]
            # Answered from the entry: published with a cadence, unwritten here since its
            # generation's view (the marks read after every CAS of the round), its class
            # named and its route not paused.
            answer: list[int] = []
            unread: list[int] = won
            if won and marks is not None and view:
                fresh = marks.unwritten_mask(entries["key_hash"], view).tolist()
                class_list = entries["class_id"].tolist()
                named_of: dict[int, tuple[str, bool] | None] = {}
                unread = []
                for index in won:
                    class_id = class_list[index]
                    if fresh[index] and published[index] and class_id >= 0:
                        if class_id not in named_of:
                            named = marks.class_of(class_id)
                            paused = named is None or routes.paused(named[0])
                            named_of[class_id] = None if paused else named
                        if named_of[class_id] is not None:
                            answer.append(index)
                            continue
                    unread.append(index)
            if won:
                hash_list = entries["key_hash"].tolist()
                expires_list = expires.tolist()
            if answer:
                due_list = entries["due_at"].tolist()
                names = [named_of[class_list[index]] for index in answer]
                answer_tokens = [token_list[index] for index in answer]
                answer_expires = [expires_list[index] for index in answer]
                granted.extend(
                    map(
                        Lease,
                        claimed.keys_of(np.array(answer, dtype=np.int64)),
                        map(str, answer_tokens)
                        if granter is None
                        else map(f"{granter}:".__add__, map(str, answer_tokens)),
                        [name[0] for name in names if name is not None],
                        [due_list[index] for index in answer],
                        answer_expires,
                        [name[1] for name in names if name is not None],
                        [published[index] for index in answer],
                        repeat(granter),
                        [expiry - now for expiry in answer_expires],
                    )
                )
                granted_hashes.extend(hash_list[index] for index in answer)
                granted_tokens.extend(answer_tokens)
            if unread:
                held.extend(
                    zip(
                        claimed.keys_of(np.array(unread, dtype=np.int64)),
                        [hash_list[index] for index in unread],
                        [token_list[index] for index in unread],
                        [expires_list[index] for index in unread],
                        strict=True,
                    )
                )
            if marks is not None:
                marks.count_claimed(len(answer), len(held))
            if not held:
                continue
            rows: dict[str, Row] = yield functools.partial(
                store.get_many, [key for key, _, _, _ in held]
            )
            reading, held = held, []
            for key, hashed, token, expires_at in reading:
                row = rows.get(key)
                learned = None if row is None else routes.grant_cadence_s(row)
                if row is None or not row.due_by(now) or learned is None:
                    # Hand it back: ending the lease is not a missed render.
                    leases.complete(hashed, token, now)
                    continue
                granted.append(
                    Lease(
                        key=key,
                        token=format_token(node, token),
                        route=row.route,
                        due_at=row.next_render_at,
                        lease_expires_at=expires_at,
                        sitemap=row.sitemap,
                        cadence_s=learned,
                        node=granter,
                        lease_ms=expires_at - now,
                    )
                )
                granted_hashes.append(hashed)
                granted_tokens.append(token)
    except BaseException:
        now = now_ms()
        taken = [*zip(granted_hashes, granted_tokens, strict=True)] + [
            (h, t) for _, h, t, _ in held
        ]
        for hashed, token in taken:
            leases.complete(hashed, token, now)
        raise
    if not granted:
        return []
    return _keep_owned(node, granted, granted_hashes, granted_tokens, now_ms())


async def next_publish(node: Node, deadline: float) -> bool:
    """Sleep until the ring's generation changes (True) or the deadline passes (False)."""
    generation = node.ring.generation
    while node.ring.generation == generation:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(node.settings.poll_interval_s, remaining))
    return True


async def claim(
    node: Node, request: ClaimRequest, completed: list[ItemResult] | None = None
) -> ClaimResponse | Response:
    """`completed`: the answers to the completions the request carried, applied already
    (api.completions.claim_completing); every answer, granted or not, carries them."""
    status = claim_status(node)
    if not status.can_grant:
        return unready(node, status, completed)
    check_lease_s(node, request.lease_s)
    lease_ms = lease_ms_of(node, request.lease_s)
    await ceiling_covers(node, lease_ms)
    deadline = time.monotonic() + request.wait_s
    leases = await grant(node, request.max, lease_ms)
    # Long poll: nothing was claimable, so wait for the keeper's next publish (a new ring
    # generation) and try again, until something is granted or the wait is over.
    if not leases and request.wait_s > 0:
        node.claims_waiting += 1
        try:
            while not leases and await next_publish(node, deadline):
                leases = await grant(node, request.max, lease_ms)
        finally:
            node.claims_waiting -= 1
    kind: Literal["ready", "draining"] = "draining" if status.status == "draining" else "ready"
    if not leases:
        # Said as of now: a set that drained during this claim, or a keeper that stopped
        # publishing during its wait, is what the fleet needs to hear.
        status = claim_status(node)
        if not status.can_grant:
            return unready(node, status, completed)
        kind = "draining" if status.status == "draining" else "ready"
        # Only an empty answer reads the keeper's record: a grant never pays for it.
        held = read_fences(node)
        if held is not None:
            return ClaimResponse(
                leases=leases,
                status=kind,
                fenced=held.due,
                detail=f"nothing granted: {held.describe(now_ms())}",
                completed=completed,
            )
    return ClaimResponse(leases=leases, status=kind, completed=completed)


def renew(node: Node, request: RenewRequest) -> RenewResults:
    """Extend leases this node granted, only while it owns their keys.

    A clustered node renews nothing while its membership is unconfirmed, and no key its
    view has moved to another node: that node fences the key only until the lease ends
    as handed over, so an extension here would outlive the fence. Ownership is checked
    before the CAS and again after it (the view may move in between, see owners_now)."""
    now = now_ms()
    for item in request.items:
        check_lease_s(node, item.lease_s)
    encoded = [item.key.encode() for item in request.items]
    hashes = [key_hash(key) for key in encoded]
    # Each key's host's site (owned by site, what places it: keeper.ownership).
    by_site = node.settings.ownership == "site"
    sites = [key_site_hash(key) if by_site else 0 for key in encoded]
    lapsed = membership_lapsed(node)
    if lapsed is not None:
        return RenewResults(
            results=[
                RenewResult(key=item.key, ok=False, error=NOT_OWNER, detail=lapsed)
                for item in request.items
            ]
        )
    me = node.settings.node
    before = owners_now(node, hashes, sites)
    results = [
        _renewed(node, item, hashes[index], now)
        if before is None or before[index] == me
        else _not_owner(item.key, before[index])
        for index, item in enumerate(request.items)
    ]
    after = owners_now(node, hashes, sites)
    if after is not None:
        results = [
            result if not result.ok or after[index] == me else _not_owner(result.key, after[index])
            for index, result in enumerate(results)
        ]
    return RenewResults(results=results)


def _renewed(node: Node, item: RenewItem, hashed: int, now: int) -> RenewResult:
    token = parse_token(item.token, node.settings.node)
    term_ms = lease_term_ms(node, lease_ms_of(node, item.lease_s), now)
    expires_at = (
        None
        if token is None or term_ms < MIN_TERM_MS
        else node.leases.renew(hashed, token, now, term_ms)
    )
    if expires_at is None:
        return RenewResult(key=item.key, ok=False, error=LEASE_NOT_HELD)
    return RenewResult(
        key=item.key, ok=True, lease_expires_at=expires_at, lease_ms=expires_at - now
    )


def _not_owner(key: str, owner: str | None) -> RenewResult:
    return RenewResult(
        key=key,
        ok=False,
        error=NOT_OWNER,
        owner=owner,
        detail="the key belongs to another node now; stop rendering it"
        if owner
        else "this node is not a live member of the cluster now",
    )
