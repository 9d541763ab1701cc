"""A render fleet's main loop: claim, render with leases renewed, complete; stop gracefully.

Three loops share one asyncio event loop. The claimer keeps `concurrency` renders in
flight, long-polling when nothing is due. The renewer extends every lease whose
remaining term has fallen under half, so a render may run past its first term;
a lease the node says is no longer held is abandoned (its render is cancelled and
never completed: another worker may hold the key now). The completer reports
outcomes in batches.

A stop (request_stop, e.g. on SIGINT / SIGTERM) stops claiming at once, lets the
renders in flight finish for up to `grace_s`, completes every result it has, and
reports each render it had to cut short as `failed`: that keeps the key due and
frees it for another worker now, where an abandoned lease would have to expire
first and would count toward the key's hold-back. A second stop request cuts the
grace period short.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable

import msgspec

from fleet.client import AsyncFleetClient, ClientStatistics, FleetRequestError, FleetUnavailable
from fleet.messages import CompletionItem, ItemResult, Lease
from fleet.nodeview import NodeView, summarize_queue_state
from fleet.renderers import Renderer, RenderResult

MAX_CLAIM = 1000  # the API's cap on one claim
FLUSH_TIMEOUT_S = 15.0  # how long a stop waits for the last completions to go through
RATE_WINDOW_S = 60.0


class FleetConfig(msgspec.Struct, frozen=True, kw_only=True):
    concurrency: int = 8
    lease_s: int = 300
    wait_s: int = 10  # long-poll on a claim when nothing is due
    grace_s: float = 30.0
    completion_batch: int = 100
    completion_linger_s: float = 0.05  # gather completions this long into one request
    state_every_s: float = 5.0  # queue-state poll for the progress view; 0 turns it off
    renew_every_s: float | None = None  # None: lease_s / 6, at least 1 s


class FleetStatistics(msgspec.Struct, frozen=True, kw_only=True):
    claimed: int
    rendered: int  # completions the node accepted, by outcome
    failed: int
    gone: int
    aborted: int  # renders cut short by a stop, completed as failed
    refused: int  # completions the node refused (lease_not_held): the lease had gone
    completions_lost: int  # completions that could not be delivered after retries
    leases_lost: int  # renewals refused: the render was abandoned
    renewed: int
    in_flight: int
    rendered_per_min: float
    failed_per_min: float
    uptime_s: float
    stopping: bool
    fatal: str | None
    client: ClientStatistics


class _Job:
    __slots__ = ("cancel_reason", "expires_at", "lease", "task")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.expires_at = lease.lease_expires_at
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason = ""


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class _Rate:
    """Events in the last minute, per minute; scaled up while the run is younger."""

    def __init__(self, started: float) -> None:
        self._started = started
        self._times: collections.deque[float] = collections.deque()

    def add(self, count: int = 1) -> None:
        now = time.monotonic()
        self._times.extend([now] * count)

    def per_minute(self) -> float:
        now = time.monotonic()
        while self._times and self._times[0] < now - RATE_WINDOW_S:
            self._times.popleft()
        span = min(RATE_WINDOW_S, max(now - self._started, 1.0))
        return len(self._times) * 60.0 / span


class FleetRunner:
    def __init__(
        self,
        client: AsyncFleetClient,
        renderer: Renderer,
        config: FleetConfig = FleetConfig(),  # noqa: B008 - frozen
        *,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if config.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.client = client
        self.config = config
        self._renderer = renderer
        self._log = log or (lambda message: None)
        self._jobs: dict[str, _Job] = {}
        self._completions: asyncio.Queue[CompletionItem | None] = asyncio.Queue()
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._abort = asyncio.Event()
        self._stop_requests = 0
        self._started = time.monotonic()
        self._rendered_rate = _Rate(self._started)
        self._failed_rate = _Rate(self._started)
        self._counts = collections.Counter[str]()
        self.fatal: str | None = None
        self.node_view = NodeView()

    # -- control -----------------------------------------------------------------

    def request_stop(self) -> None:
        """First call: stop claiming, finish in flight within grace_s. Second: cut it short."""
        self._stop_requests += 1
        if self._stop_requests == 1:
            self._log(
                f"stopping: no new claims; waiting up to {self.config.grace_s:g} s "
                f"for {len(self._jobs)} render(s) in flight (again to cut short)"
            )
            self._stopping.set()
        else:
            self._log("stopping now: cutting renders in flight short")
            self._abort.set()

    def statistics(self) -> FleetStatistics:
        counts = self._counts
        return FleetStatistics(
            claimed=counts["claimed"],
            rendered=counts["rendered"],
            failed=counts["failed"],
            gone=counts["gone"],
            aborted=counts["aborted"],
            refused=counts["refused"],
            completions_lost=counts["completions_lost"],
            leases_lost=counts["leases_lost"],
            renewed=counts["renewed"],
            in_flight=len(self._jobs),
            rendered_per_min=round(self._rendered_rate.per_minute(), 1),
            failed_per_min=round(self._failed_rate.per_minute(), 1),
            uptime_s=round(time.monotonic() - self._started, 1),
            stopping=self._stopping.is_set(),
            fatal=self.fatal,
            client=self.client.statistics(),
        )

    # -- the run -----------------------------------------------------------------

    async def run(self) -> FleetStatistics:
        """Work until request_stop (or a fatal refusal such as a bad token)."""
        self._started = time.monotonic()
        claimer = asyncio.create_task(self._claim_loop(), name="fleet-claim")
        renewer = asyncio.create_task(self._renew_loop(), name="fleet-renew")
        completer = asyncio.create_task(self._complete_loop(), name="fleet-complete")
        watcher = None
        if self.config.state_every_s > 0:
            watcher = asyncio.create_task(self._watch_node(), name="fleet-node-view")
        try:
            await self._stopping.wait()
        finally:
            await _cancel(claimer)
            await self._drain_renders()
            await _cancel(renewer)
            await self._completions.put(None)
            try:
                async with asyncio.timeout(FLUSH_TIMEOUT_S):
                    await completer
            except TimeoutError:
                self._log("stopped before every completion was delivered")
            if watcher is not None:
                await _cancel(watcher)
        return self.statistics()

    async def _drain_renders(self) -> None:
        pending = {job.task for job in self._jobs.values() if job.task is not None}
        if pending:
            abort = asyncio.create_task(self._abort.wait())
            deadline = time.monotonic() + self.config.grace_s
            while pending and not self._abort.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                done, _ = await asyncio.wait(
                    pending | {abort}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= done
            await _cancel(abort)
        for job in list(self._jobs.values()):
            if job.task is not None and not job.task.done():
                job.cancel_reason = "aborted"
                job.task.cancel()
        leftover = [job.task for job in self._jobs.values() if job.task is not None]
        if leftover:
            await asyncio.gather(*leftover, return_exceptions=True)

    def _fail(self, message: str) -> None:
        self.fatal = message
        self._log(f"fatal: {message}")
        self._stopping.set()

    async def _claim_loop(self) -> None:
        config = self.config
        failures = 0
        while not self._stopping.is_set():
            free = config.concurrency - len(self._jobs)
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                leases = await self.client.claim(
                    min(free, MAX_CLAIM), lease_s=config.lease_s, wait_s=config.wait_s
                )
            except FleetRequestError as exc:
                self._fail(f"the node refused a claim: {exc}")
                return
            except FleetUnavailable as exc:
                failures += 1
                self._log(f"claims failing: {exc}")
                await asyncio.sleep(min(30.0, 2.0**failures))
                continue
            failures = 0
            self._counts["claimed"] += len(leases)
            for lease in leases:
                self._start(lease)
            if not leases and config.wait_s == 0:
                await asyncio.sleep(1.0)  # nothing due and no long-poll: do not spin

    def _start(self, lease: Lease) -> None:
        if lease.key in self._jobs:
            # The node granted a key this worker still holds: its lease must have
            # lapsed. Keep the render we have; the new token is the live one.
            self._jobs[lease.key].lease = lease
            self._jobs[lease.key].expires_at = lease.lease_expires_at
            return
        job = _Job(lease)
        self._jobs[lease.key] = job
        job.task = asyncio.create_task(self._render(job), name=f"render {lease.key[:80]}")

    async def _render(self, job: _Job) -> None:
        try:
            try:
                result = await self._renderer(job.lease)
            except asyncio.CancelledError:
                if job.cancel_reason == "aborted":
                    self._counts["aborted"] += 1
                    result = RenderResult(outcome="failed", detail="cut short by a stop")
                elif job.cancel_reason == "lease_lost":
                    return
                else:
                    raise
            except Exception as exc:  # a renderer bug must not take the fleet down
                result = RenderResult(outcome="failed", detail=f"renderer raised {exc!r}")
            if result.outcome == "failed" and result.detail:
                self._log(f"failed {job.lease.key}: {result.detail}")
            # the token of the lease as it is now: a regrant may have replaced it
            lease = job.lease
            await self._completions.put(
                CompletionItem(key=lease.key, token=lease.token, outcome=result.outcome)
            )
        finally:
            self._jobs.pop(job.lease.key, None)
            self._slot_freed.set()

    async def _renew_loop(self) -> None:
        config = self.config
        interval = config.renew_every_s or max(1.0, config.lease_s / 6)
        while True:
            await asyncio.sleep(interval)
            threshold = _now_ms() + config.lease_s * 500
            due = [job for job in self._jobs.values() if job.expires_at <= threshold]
            for start in range(0, len(due), MAX_CLAIM):
                chunk = due[start : start + MAX_CLAIM]
                try:
                    results = await self.client.renew(
                        [job.lease for job in chunk], lease_s=config.lease_s
                    )
                except (FleetUnavailable, FleetRequestError) as exc:
                    self._log(f"renewal failed: {exc}")
                    continue
                self._apply_renewals(chunk, results)

    def _apply_renewals(self, jobs: list[_Job], results: list[ItemResult]) -> None:
        by_key = {job.lease.key: job for job in jobs}
        for result in results:
            job = by_key.get(result.key)
            if job is None:
                continue
            if result.ok:
                self._counts["renewed"] += 1
                job.expires_at = result.lease_expires_at or (_now_ms() + self.config.lease_s * 1000)
            elif job.task is not None and not job.task.done():
                self._counts["leases_lost"] += 1
                self._log(f"lease lost on {job.lease.key} ({result.error}); render abandoned")
                job.cancel_reason = "lease_lost"
                job.task.cancel()

    async def _complete_loop(self) -> None:
        config = self.config
        closing = False
        while not closing:
            first = await self._completions.get()
            if first is None:
                break
            batch = [first]
            loop = asyncio.get_running_loop()
            deadline = loop.time() + config.completion_linger_s
            while len(batch) < config.completion_batch:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await self._completions.get()
                except TimeoutError:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            await self._deliver(batch)

    async def _deliver(self, batch: list[CompletionItem]) -> None:
        try:
            results = await self.client.complete(batch)
        except (FleetUnavailable, FleetRequestError) as exc:
            self._counts["completions_lost"] += len(batch)
            self._log(f"{len(batch)} completion(s) not delivered: {exc}")
            return
        outcomes = {item.key: item.outcome for item in batch}
        for result in results:
            if result.ok:
                outcome = outcomes.get(result.key, "rendered")
                self._counts[outcome] += 1
                if outcome == "failed":
                    self._failed_rate.add()
                else:
                    self._rendered_rate.add()
            else:
                self._counts["refused"] += 1

    async def _watch_node(self) -> None:
        while True:
            try:
                status, body = await self.client.queue_state()
                self.node_view = summarize_queue_state(status, body)
            except Exception as exc:  # a view only: never let it stop the fleet
                self.node_view = NodeView(status=f"unreachable ({type(exc).__name__})")
            await asyncio.sleep(self.config.state_every_s)


async def _cancel(task: asyncio.Task[object] | asyncio.Task[None] | asyncio.Task[bool]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
