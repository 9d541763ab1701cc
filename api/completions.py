"""Completions: the lease must still be held by the token -> apply the result to the store
-> release the lease (and its site permit). A stale token changes nothing. A `failed`
result keeps the row due in the store but holds the key back in the lease table, growing
with each failure in a row and capped at its cadence (`LeaseTable.fail`); `rendered`
resets it.

Sites (shm.sites): an item with `site_retry_after_s` (the origin turned the render away)
blocks its key's whole site for that long and hands the key back: nothing is written for
it, its due time stays, and no miss or failure is counted. A `failed` result extends its
site's streak of failures, and the streak's limit'th blocks the site (doubling on each
repeat); a `rendered` one ends the streak.

A `not_found` result (the origin answered 404 or 410) is written like a render the origin
answered: the lease ends with no hold, and the row comes due a cadence on, until its
route's retire_after'th in a row retires it (store.rows.Completion). It is no failure of
the site: the origin answered, and answered fast, so its streak of failures ends as with
`rendered`. Counting it as a failure would block a healthy site whose sitemap lists many
dead pages, and hold back the very renders that confirm them dead.

The store's write lock is shared by every worker (and the keeper's cursor saves). A
completion that waited for it in the store's retry loop would hold the event loop's
thread, and the worker would serve nothing meanwhile: no claims, no other completions. A
`CompletionQueue` tries the lock without waiting; when it is held, the request waits with
`asyncio.sleep`, the worker goes on serving, and completions that arrive meanwhile join
the next attempt: one transaction for all of them, each request answered with its own
results. On SQLite the store call stays on the loop's thread rather than a worker thread,
because a thread hop costs every completion a GIL handoff each way
(docs/decisions/0001-completions-on-the-event-loop.md). On PostgreSQL every call is a
round trip that a silent server holds until the store's deadline, so each attempt is
made on the worker's store lane (api.lane), whole (lease checks, the write, its stamp,
the releases): completions that arrive while one is in flight join the next attempt.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgspec
from starlette.responses import Response

from api.claims import LEASE_NOT_HELD, NOT_FOUND, check_lease_s, claim, parse_token, unready
from api.lane import StoreLane
from api.node import Node
from api.problems import ApiError, invalid_field
from api.schedule import check_items
from api.status import claim_status
from shm import key_hash
from shm.segment import now_ms
from store.base import DEFAULT_BUSY_TIMEOUT_S, cluster_membership
from store.errors import StoreBusy
from store.rows import Completion, Row
from wire.schemas import (
    ClaimRequest,
    ClaimResponse,
    CompletionItem,
    CompletionsRequest,
    ItemResult,
    ItemResults,
)

# The first wait is one turn of the event loop's clock (epoll waits whole milliseconds);
# a 100-key completion holds the lock about that long.
FIRST_BACKOFF_S = 0.001
MAX_BACKOFF_S = 0.002


def apply(node: Node, requests: Sequence[CompletionsRequest], *, wait: bool) -> list[ItemResults]:
    """The requests' completions in one store transaction, in order, as if one request:
    a key an earlier item completed is stale for every later item naming it.

    `wait=False`: raise StoreBusy when another writer holds the lock; nothing has changed
    then (lease checks are reads)."""
    now = now_ms()
    results: list[list[ItemResult | None]] = [[None] * len(r.items) for r in requests]
    held: list[tuple[int, int, int, int]] = []  # (request, item, key hash, token)
    site_of: dict[int, int] = {}  # a held key's site hash, by key hash
    completions: list[Completion] = []
    seen: set[str] = set()
    leases, sites = node.leases, node.sites
    for number, request in enumerate(requests):
        for index, item in enumerate(request.items):
            hashed = key_hash(item.key.encode())
            token = parse_token(item.token, node.settings.node)
            site = None if token is None else leases.lease_site(hashed, token, now)
            if token is None or site is None or item.key in seen:
                results[number][index] = ItemResult(key=item.key, ok=False, error=LEASE_NOT_HELD)
                continue
            seen.add(item.key)
            site_of[hashed] = site
            if item.site_retry_after_s is not None:
                # The origin said "not now": block the site first, so that the permit the
                # hand-back frees lets no other key of it in, then end the lease unwritten.
                until = now + round(item.site_retry_after_s * 1000)
                blocked = sites.block(site, until, "retry_after") if sites and site else None
                leases.complete(hashed, token, now)
                results[number][index] = ItemResult(
                    key=item.key, ok=True, site_blocked_until=blocked or None
                )
                continue
            held.append((number, index, hashed, token))
            completions.append(
                Completion(
                    key=item.key,
                    outcome=item.outcome,
                    now=now,
                    next_render_at=item.next_render_at,
                    changed=item.changed,
                )
            )
    if completions:
        try:
            after = node.store.complete(completions, wait=wait)
        except ValueError as exc:
            raise ApiError(422, "Invalid completion", str(exc)) from None
        # Before any lease is released: a claim that wins one sees the write (shm.marks).
        node.stamp_written([hashed for _, _, hashed, _ in held])
        for (number, index, hashed, token), completion, row in zip(
            held, completions, after, strict=True
        ):
            site = site_of[hashed]
            if completion.outcome == "failed" and row is not None:
                # Backs off: held from now as a missed lease would be (shm.leases).
                held_until = leases.fail(hashed, token, now)
                blocked = sites.outcome(site, now, failed=True) if sites and site else 0
                results[number][index] = ItemResult(
                    key=completion.key,
                    ok=True,
                    held_until=held_until,
                    site_blocked_until=blocked or None,
                )
                continue
            leases.complete(hashed, token, now)
            if completion.outcome in ("rendered", "not_found") and sites and site:
                sites.outcome(site, now, failed=False)
            results[number][index] = written(completion, row)
    return [ItemResults(results=[r for r in mine if r is not None]) for mine in results]


def written(completion: Completion, row: Row | None) -> ItemResult:
    """A written completion's answer, from the row the store returned (None: gone)."""
    if row is None and completion.outcome != "gone":
        return ItemResult(key=completion.key, ok=False, error=NOT_FOUND)
    if completion.outcome == "not_found" and row is not None:
        return ItemResult(
            key=completion.key,
            ok=True,
            not_found_streak=row.not_found_streak,
            retired_at=row.retired_at,
        )
    return ItemResult(key=completion.key, ok=True)


def complete_handed_over(
    node: Node, owner: str, items: Sequence[CompletionItem]
) -> list[ItemResult | None]:
    """Items `owner` granted and handed over when it left (store.postgres.membership):
    each written once, in the transaction that settles its hand-over. None for an item
    not taken this way: its lease was not handed over live, another node or `owner`'s
    next start settled it, or it says `site_retry_after_s`, whose site block only the
    site's owner could keep. Nothing is released here: the lease table that held the
    lease left with its node, and the new owner fences the key until the lease's end
    (so a `failed` result holds the key back until then, not by the failure backoff)."""
    now = now_ms()
    chosen: list[int] = []
    leases: list[tuple[int, int]] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        token = parse_token(item.token, owner)
        if token is None or item.site_retry_after_s is not None or item.key in seen:
            continue
        seen.add(item.key)
        chosen.append(index)
        leases.append((key_hash(item.key.encode()), token))
    answers: list[ItemResult | None] = [None] * len(items)
    if not chosen:
        return answers
    completions = [
        Completion(
            key=items[i].key,
            outcome=items[i].outcome,
            now=now,
            next_render_at=items[i].next_render_at,
            changed=items[i].changed,
        )
        for i in chosen
    ]
    try:
        rows = cluster_membership(node.store).complete_handed_over(owner, completions, leases)
    except ValueError as exc:
        raise ApiError(422, "Invalid completion", str(exc)) from None
    for i, completion, row in zip(chosen, completions, rows, strict=True):
        if row is not False:
            answers[i] = written(completion, row if isinstance(row, Row) else None)
    return answers


def check(request: CompletionsRequest) -> None:
    """What decoding leaves to the node (a key within 2,048 characters but past 2,048 UTF-8
    bytes, a token against its pattern): 422 before anything waits, so a request that joins
    a shared transaction never makes it fail."""
    check_items(request.items)
    for index, item in enumerate(request.items):
        if item.changed is not None and item.outcome != "rendered":
            raise invalid_field(
                f"$.items[{index}].changed",
                f"said of a rendered page only, not of outcome {item.outcome!r}",
            )


async def claim_completing(
    node: Node,
    request: ClaimRequest,
    complete: Callable[[CompletionsRequest], Awaitable[ItemResults]],
) -> ClaimResponse | Response:
    """A claim that carries completions: they are applied first by `complete`, as a
    completions request is (forwarded where another node granted them), and answered in
    `completed`. A node that cannot grant applies none (503: the same request may be sent
    again); a bad claim is refused (422) before any is applied."""
    assert request.complete is not None
    status = claim_status(node)
    if not status.can_grant:
        return unready(node, status)
    check_lease_s(node, request.lease_s)
    done = await complete(CompletionsRequest(items=request.complete))
    return await claim(node, msgspec.structs.replace(request, complete=None), done.results)


class CompletionQueueStatistics(msgspec.Struct, frozen=True, kw_only=True):
    requests: int  # completion requests answered
    # Requests that waited on the event loop for the write lock (on SQLite: queued behind
    # one that found it held; on the store lane: were in an attempt that found it held).
    waited: int
    joined: int  # requests committed in a transaction with another request's items
    transactions: int  # store transactions that committed completions
    busy_attempts: int  # attempts that found the lock held
    timed_out: int  # requests answered 503 after the store's busy timeout


@dataclass(eq=False)
class _Waiting:
    request: CompletionsRequest
    done: asyncio.Future[ItemResults]
    busy: bool = False  # an attempt with it found the lock held (counted in `waited`)


@dataclass(eq=False)
class CompletionQueue:
    """One worker's completions, committed without blocking its event loop (module note).

    `commit` writes requests in one transaction, raising StoreBusy without waiting when
    the lock is held (`apply` on the node's handles); `lane` is where it runs when the
    store is not on the loop."""

    commit: Callable[[list[CompletionsRequest]], list[ItemResults]]
    lane: StoreLane
    busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S
    _waiting: list[_Waiting] = field(default_factory=list)
    _drainer: asyncio.Task[None] | None = None
    _requests: int = 0
    _waited: int = 0
    _joined: int = 0
    _transactions: int = 0
    _busy_attempts: int = 0
    _timed_out: int = 0

    async def complete(self, request: CompletionsRequest) -> ItemResults:
        check(request)
        inline = self.lane.hot_inline
        if inline and not self._waiting:  # else it joins the queue behind the others
            try:
                (results,) = self.commit([request])
            except StoreBusy:
                self._busy_attempts += 1
            else:
                self._requests += 1
                self._transactions += 1
                return results
        if inline:
            self._waited += 1
        waiting = _Waiting(request, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if self._drainer is None:
            # On the lane the first attempt goes at once; on the loop it follows a failed one.
            first = FIRST_BACKOFF_S if inline else 0.0
            self._drainer = asyncio.create_task(self._drain(first))
        return await waiting.done

    async def _attempt(self, requests: list[CompletionsRequest]) -> list[ItemResults]:
        if self.lane.hot_inline:
            return self.commit(requests)
        return await self.lane.call(lambda: self.commit(requests))

    async def _drain(self, backoff: float) -> None:
        """Commit every waiting request, oldest first, all together once the lock is free."""
        deadline = time.monotonic() + self.busy_timeout_s
        settled = FIRST_BACKOFF_S if self.lane.hot_inline else 0.0
        try:
            while self._waiting:
                if backoff:
                    await asyncio.sleep(backoff)
                batch = [w for w in self._waiting if not w.done.cancelled()]
                self._waiting = []
                if not batch:
                    continue
                try:
                    answers = await self._attempt([w.request for w in batch])
                except StoreBusy as exc:
                    self._busy_attempts += 1
                    if not self.lane.hot_inline:  # on the loop, counted as they queued
                        self._waited += sum(1 for w in batch if not w.busy)
                        for w in batch:
                            w.busy = True
                    # Before any that arrived meanwhile (on the lane, some may have).
                    self._waiting = batch + self._waiting
                    if time.monotonic() >= deadline:
                        self._fail(exc)
                        return
                    backoff = min(max(backoff * 2, FIRST_BACKOFF_S), MAX_BACKOFF_S)
                    continue
                except Exception as exc:  # the store failed: every request in it hears so
                    for waiting in batch:
                        if not waiting.done.done():
                            waiting.done.set_exception(exc)
                    continue
                self._transactions += 1
                if len(batch) > 1:
                    self._joined += len(batch)
                for waiting, answer in zip(batch, answers, strict=True):
                    self._requests += 1
                    if not waiting.done.done():
                        waiting.done.set_result(answer)
                backoff = settled
                deadline = time.monotonic() + self.busy_timeout_s
        finally:
            self._drainer = None

    def _fail(self, exc: StoreBusy) -> None:
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            self._timed_out += 1
            if not w.done.done():
                w.done.set_exception(
                    StoreBusy(
                        f"completions: the store stayed locked by other writers for "
                        f"{self.busy_timeout_s:g} s ({exc}); nothing was written"
                    )
                )

    def statistics(self) -> CompletionQueueStatistics:
        return CompletionQueueStatistics(
            requests=self._requests,
            waited=self._waited,
            joined=self._joined,
            transactions=self._transactions,
            busy_attempts=self._busy_attempts,
            timed_out=self._timed_out,
        )
