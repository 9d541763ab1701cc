"""A render worker's client for a node's fleet API, sync (httpx.Client) and asyncio.

Every call retries what is worth retrying and nothing else:

- 503 with Retry-After (the node is starting or its keeper cannot vouch for the
  queue): wait as long as the node asks, plus a little jitter so a fleet does not
  return in one wave; this never uses up the error budget, only `max_unready_s`.
- a transport error, a timeout, another 5xx, or 429: exponential backoff with
  jitter, at most `attempts` times, then FleetUnavailable.
- any other 4xx: FleetRequestError at once, with the problem+json detail; retrying
  a bad token or a malformed body cannot help.

A claim retried after a lost response can strand the leases the node did grant:
they expire after their lease_s and the key is claimable again, which is the
lease's purpose. A completion retried after a lost response may come back
`lease_not_held` for an item the first attempt applied; so may a completion carried on a
claim (`claim_completing`) that is retried, whether its response was lost or the node
answered 503 after applying it.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC
from typing import Any, TypeVar

import httpx
import msgspec

from fleet.messages import (
    DEFAULT_LEASE_S,
    ClaimRequest,
    ClaimResponse,
    CompletionItem,
    CompletionsRequest,
    ItemResult,
    Lease,
    Problem,
    RenewItem,
    RenewRequest,
    ResultsResponse,
    Unready,
)

T = TypeVar("T")

CLAIMS_PATH = "/v1/claims"
COMPLETIONS_PATH = "/v1/completions"
RENEW_PATH = "/v1/leases/renew"
QUEUE_STATE_PATH = "/prerender_admin/queue-state"
CLUSTER_QUEUE_STATE_PATH = "/prerender_admin/cluster/queue-state"


class FleetError(Exception):
    """Base of the client's errors."""


class FleetRequestError(FleetError):
    """The node refused the request (4xx): fix the request or the token, do not retry."""

    def __init__(self, status: int, problem: Problem | None, text: str = "") -> None:
        self.status = status
        self.problem = problem
        detail = ""
        if problem is not None:
            detail = problem.detail or problem.title
        super().__init__(f"HTTP {status}: {detail or text[:200] or 'refused'}")


class FleetUnavailable(FleetError):
    """Retries ran out (errors), or the node stayed unready past max_unready_s."""


class FleetCancelled(FleetError):
    """A sync call's wait was cut short by its cancel event."""


class RetryPolicy(msgspec.Struct, frozen=True, kw_only=True):
    attempts: int = 6  # transient errors retried per call, then FleetUnavailable
    base_s: float = 0.2
    factor: float = 2.0
    cap_s: float = 20.0
    max_retry_after_s: float = 60.0  # a Retry-After beyond this is read as this
    max_unready_s: float | None = None  # None: wait for the node as long as it takes


class ClientStatistics(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    retries: int  # error retries (backoff)
    unready_waits: int  # 503 Retry-After waits
    transport_errors: int
    server_errors: int  # 5xx other than an unready 503, and 429
    slept_s: float


def backoff_delay(policy: RetryPolicy, attempt: int, rng: random.Random) -> float:
    """Equal jitter: half the exponential step fixed, half random, capped.

    Full jitter can retry at once; keeping half the step bounds the rate a failing
    fleet sends at a node that is struggling.
    """
    step = min(policy.cap_s, policy.base_s * policy.factor ** max(0, attempt - 1))
    return step / 2 + rng.uniform(0, step / 2)


def parse_retry_after(value: str | None, now_s: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delta-seconds or an HTTP-date)."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    now = time.time() if now_s is None else now_s
    return max(0.0, when.timestamp() - now)


class _Retry(msgspec.Struct, frozen=True):
    unready: bool
    hint_s: float | None
    why: str


class _Core:
    """What both clients share: encoding, judging a response, the retry bookkeeping."""

    def __init__(self, policy: RetryPolicy, rng: random.Random | None) -> None:
        self.policy = policy
        self.rng = rng or random.Random()
        self.requests = 0
        self.retries = 0
        self.unready_waits = 0
        self.transport_errors = 0
        self.server_errors = 0
        self.slept_s = 0.0

    def judge(self, response: httpx.Response, result_type: type[T]) -> T | _Retry:
        status = response.status_code
        if status == 200:
            return msgspec.json.decode(response.content, type=result_type)
        retry_after = parse_retry_after(response.headers.get("retry-after"))
        if status == 503:
            try:
                state = msgspec.json.decode(response.content, type=Unready).status
            except msgspec.DecodeError:
                state = "unavailable"
            if retry_after is not None:
                return _Retry(True, retry_after, f"node {state}")
            self.server_errors += 1
            return _Retry(False, None, f"HTTP 503 ({state})")
        if status >= 500 or status == 429:
            self.server_errors += 1
            return _Retry(False, retry_after, f"HTTP {status}")
        problem: Problem | None
        try:
            problem = msgspec.json.decode(response.content, type=Problem)
        except msgspec.DecodeError:
            problem = None
        raise FleetRequestError(status, problem, response.text)

    def next_delay(
        self,
        verdict: _Retry,
        attempt: int,
        unready_since: float | None,
        max_unready_s: float | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> float:
        """How long to wait before the next try; raises FleetUnavailable when out of road."""
        policy = self.policy
        limit = policy.max_unready_s if max_unready_s is msgspec.UNSET else max_unready_s
        if verdict.unready:
            self.unready_waits += 1
            if (
                unready_since is not None
                and limit is not None
                and time.monotonic() - unready_since > limit
            ):
                raise FleetUnavailable(f"{verdict.why} for more than {limit:.0f} s")
            hint = min(verdict.hint_s or 0.0, policy.max_retry_after_s)
            return hint + self.rng.uniform(0, 0.1 * hint + 0.05)
        if attempt > policy.attempts:
            raise FleetUnavailable(f"{verdict.why}; gave up after {policy.attempts} retries")
        self.retries += 1
        delay = backoff_delay(policy, attempt, self.rng)
        if verdict.hint_s is not None:
            delay = max(delay, min(verdict.hint_s, policy.max_retry_after_s))
        return delay

    def statistics(self) -> ClientStatistics:
        return ClientStatistics(
            requests=self.requests,
            retries=self.retries,
            unready_waits=self.unready_waits,
            transport_errors=self.transport_errors,
            server_errors=self.server_errors,
            slept_s=round(self.slept_s, 3),
        )


def _headers(token: str | None) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    return headers


_ENCODER = msgspec.json.Encoder()


def _claim_body(
    max: int, worker: str, lease_s: int, wait_s: int, complete: Sequence[CompletionItem] = ()
) -> bytes:
    # wire's ClaimRequest names wire's CompletionItem; the client's own encodes alike.
    carried: Any = list(complete) or None
    return _ENCODER.encode(
        ClaimRequest(max=max, worker=worker, lease_s=lease_s, wait_s=wait_s, complete=carried)
    )


def _completed(response: ClaimResponse) -> list[ItemResult]:
    """The answers to a claim's carried completions, as a completions call returns them."""
    return [
        ItemResult(key=r.key, ok=r.ok, error=r.error, detail=r.detail)
        for r in response.completed or ()
    ]


def _renew_items(items: Sequence[Lease | RenewItem], lease_s: int | None) -> list[RenewItem]:
    return [
        item
        if isinstance(item, RenewItem)
        else RenewItem(key=item.key, token=item.token, lease_s=lease_s)
        for item in items
    ]


class FleetClient:
    """Blocking client; one per thread (httpx.Client is thread-safe, the statistics are
    approximate under sharing)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        admin_token: str | None = None,
        worker: str = "worker",
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.worker = worker
        self._timeout_s = timeout_s
        self._admin_headers = _headers(admin_token or token)
        self._http = httpx.Client(
            base_url=base_url, headers=_headers(token), timeout=timeout_s, transport=transport
        )
        self._core = _Core(retry, rng)
        self._sleep = sleep

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def statistics(self) -> ClientStatistics:
        return self._core.statistics()

    def _wait(self, delay: float, cancel: threading.Event | None) -> None:
        self._core.slept_s += delay
        if self._sleep is not None:
            self._sleep(delay)
        elif cancel is not None:
            if cancel.wait(delay):
                raise FleetCancelled("cancelled while waiting to retry")
        else:
            time.sleep(delay)

    def _post(
        self,
        path: str,
        body: bytes,
        result_type: type[T],
        *,
        timeout_s: float,
        cancel: threading.Event | None = None,
    ) -> T:
        attempt = 0
        unready_since: float | None = None
        while True:
            if cancel is not None and cancel.is_set():
                raise FleetCancelled("cancelled")
            self._core.requests += 1
            try:
                response = self._http.post(path, content=body, timeout=timeout_s)
            except httpx.TransportError as exc:
                self._core.transport_errors += 1
                verdict: T | _Retry = _Retry(False, None, f"{type(exc).__name__}: {exc}")
            else:
                verdict = self._core.judge(response, result_type)
            if not isinstance(verdict, _Retry):
                return verdict
            if verdict.unready:
                unready_since = unready_since or time.monotonic()
            else:
                attempt += 1
            self._wait(self._core.next_delay(verdict, attempt, unready_since), cancel)

    def claim(
        self,
        max: int,
        *,
        lease_s: int = DEFAULT_LEASE_S,
        wait_s: int = 0,
        cancel: threading.Event | None = None,
    ) -> list[Lease]:
        """Up to `max` leases, most overdue first; `wait_s` long-polls when nothing is due."""
        return self.claim_completing(max, (), lease_s=lease_s, wait_s=wait_s, cancel=cancel)[0]

    def claim_completing(
        self,
        max: int,
        items: Sequence[CompletionItem],
        *,
        lease_s: int = DEFAULT_LEASE_S,
        wait_s: int = 0,
        cancel: threading.Event | None = None,
    ) -> tuple[list[Lease], list[ItemResult]]:
        """A claim that first reports `items` (as `complete` does): the leases, and each
        item's result in order."""
        body = _claim_body(max, self.worker, lease_s, wait_s, items)
        response = self._post(
            CLAIMS_PATH,
            body,
            ClaimResponse,
            timeout_s=self._timeout_s + wait_s,
            cancel=cancel,
        )
        return response.leases, _completed(response)

    def renew(
        self, leases: Sequence[Lease | RenewItem], *, lease_s: int | None = None
    ) -> list[ItemResult]:
        """Extend leases; a result with ok=False means the lease is no longer this worker's."""
        if not leases:
            return []
        body = _ENCODER.encode(RenewRequest(items=_renew_items(leases, lease_s)))
        return self._post(RENEW_PATH, body, ResultsResponse, timeout_s=self._timeout_s).results

    def complete(self, items: Sequence[CompletionItem]) -> list[ItemResult]:
        """Report outcomes; an item refused with "lease_not_held" changed nothing."""
        if not items:
            return []
        body = _ENCODER.encode(CompletionsRequest(items=list(items)))
        return self._post(
            COMPLETIONS_PATH, body, ResultsResponse, timeout_s=self._timeout_s
        ).results

    def queue_state(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the node's queue-state; no retries, it is only a view."""
        response = self._http.get(QUEUE_STATE_PATH, headers=self._admin_headers)
        return response.status_code, _json_object(response.content)


def _json_object(content: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class AsyncFleetClient:
    """The asyncio twin of FleetClient; cancel a call by cancelling its task."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        admin_token: str | None = None,
        worker: str = "worker",
        timeout_s: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),  # noqa: B008 - frozen
        transport: httpx.AsyncBaseTransport | None = None,
        rng: random.Random | None = None,
        max_connections: int = 16,
    ) -> None:
        self.worker = worker
        self._timeout_s = timeout_s
        self._admin_headers = _headers(admin_token or token)
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers=_headers(token),
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(max_connections=max_connections),
        )
        self._core = _Core(retry, rng)

    async def __aenter__(self) -> AsyncFleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def statistics(self) -> ClientStatistics:
        return self._core.statistics()

    async def _post(
        self,
        path: str,
        body: bytes,
        result_type: type[T],
        *,
        timeout_s: float,
        max_unready_s: float | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> T:
        attempt = 0
        unready_since: float | None = None
        while True:
            self._core.requests += 1
            try:
                response = await self._http.post(path, content=body, timeout=timeout_s)
            except httpx.TransportError as exc:
                self._core.transport_errors += 1
                verdict: T | _Retry = _Retry(False, None, f"{type(exc).__name__}: {exc}")
            else:
                verdict = self._core.judge(response, result_type)
            if not isinstance(verdict, _Retry):
                return verdict
            if verdict.unready:
                unready_since = unready_since or time.monotonic()
            else:
                attempt += 1
            delay = self._core.next_delay(verdict, attempt, unready_since, max_unready_s)
            self._core.slept_s += delay
            await asyncio.sleep(delay)

    async def claim(
        self,
        max: int,
        *,
        lease_s: int = DEFAULT_LEASE_S,
        wait_s: int = 0,
        max_unready_s: float | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> list[Lease]:
        """`max_unready_s` overrides the policy's for this call (a fleet spread over a
        cluster gives up on an unready node quickly and claims from the others)."""
        leases, _ = await self.claim_completing(
            max, (), lease_s=lease_s, wait_s=wait_s, max_unready_s=max_unready_s
        )
        return leases

    async def claim_completing(
        self,
        max: int,
        items: Sequence[CompletionItem],
        *,
        lease_s: int = DEFAULT_LEASE_S,
        wait_s: int = 0,
        max_unready_s: float | msgspec.UnsetType | None = msgspec.UNSET,
    ) -> tuple[list[Lease], list[ItemResult]]:
        """As FleetClient.claim_completing."""
        body = _claim_body(max, self.worker, lease_s, wait_s, items)
        response = await self._post(
            CLAIMS_PATH,
            body,
            ClaimResponse,
            timeout_s=self._timeout_s + wait_s,
            max_unready_s=max_unready_s,
        )
        return response.leases, _completed(response)

    async def renew(
        self, leases: Sequence[Lease | RenewItem], *, lease_s: int | None = None
    ) -> list[ItemResult]:
        if not leases:
            return []
        body = _ENCODER.encode(RenewRequest(items=_renew_items(leases, lease_s)))
        response = await self._post(RENEW_PATH, body, ResultsResponse, timeout_s=self._timeout_s)
        return response.results

    async def complete(self, items: Sequence[CompletionItem]) -> list[ItemResult]:
        if not items:
            return []
        body = _ENCODER.encode(CompletionsRequest(items=list(items)))
        response = await self._post(
            COMPLETIONS_PATH, body, ResultsResponse, timeout_s=self._timeout_s
        )
        return response.results

    async def queue_state(self, path: str = QUEUE_STATE_PATH) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of the node's queue-state, or the cluster's
        (CLUSTER_QUEUE_STATE_PATH); no retries, it is only a view."""
        response = await self._http.get(path, headers=self._admin_headers)
        return response.status_code, _json_object(response.content)
