"""A render fleet's main loop: claim, render with leases renewed, complete; stop gracefully.

Three loops share one asyncio event loop. The claimer keeps `concurrency` renders in
flight, long-polling when nothing is due. The renewer extends every lease whose
remaining term has fallen under half, so a render may run past its first term. The
completer reports outcomes in batches. A result rides on the next claim to the node that
granted its lease (`carry_completions`): one round trip reports it and claims its
successor. One that no claim has taken within `completion_linger_s` (its node's claimer is
long-polling, or stopped) goes to the completer, as does one whose claim failed.

A render is abandoned (cancelled, never completed: another worker may hold the key now)
when the node refuses its renewal, and also once its lease is within a margin of its end,
max(1 s, a tenth of its term), with no renewal landed: a renewal that failed or went
unanswered leaves the lease to lapse at the node, and stopping that margin early rather
than at the end absorbs the event loop's lag and a clock somewhat behind the node's, so a
result is never reported from a lease a new holder may have been granted.

A stop (request_stop, e.g. on SIGINT / SIGTERM) stops claiming at once, lets the
renders in flight finish for up to `grace_s`, completes every result it has, and
reports each render it had to cut short as `failed`: that keeps the key due and
frees it for another worker now, where an abandoned lease would have to expire
first and would count toward the key's hold-back. A second stop request cuts the
grace period short.

Against a cluster (a `ClusterDirectory`) there is a claimer per live node, started and
stopped as the member list changes (re-read every few seconds). They share the
concurrency: each claim asks for at most an even share of it, and a node that had
nothing to give asks for one key (its long poll still notices work coming due) until it
has some again, so the renders go where the work is. A lease remembers the node that
granted it, and its renewals and completion go to that node; one whose node has left is
sent to another node, which forwards it or answers that the lease ended with its node.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import msgspec

from fleet.client import (
    CLUSTER_QUEUE_STATE_PATH,
    AsyncFleetClient,
    ClientStatistics,
    FleetRequestError,
    FleetUnavailable,
)
from fleet.cluster import ClusterDirectory
from fleet.messages import CompletionItem, ItemResult, Lease
from fleet.nodeview import NodeView, summarize_queue_state
from fleet.renderers import Renderer, RenderResult

T = TypeVar("T")

MAX_CLAIM = 1000  # the API's cap on one claim
MAX_DELIVERIES = 8  # completion requests in flight at once against a cluster
SINGLE = ""  # the one node's name in the runner's books, without a directory
# A cluster's claimer gives up on an unready node after this long and claims elsewhere
# (it tries that node again after a pause); a single node is waited for as long as it takes.
CLUSTER_UNREADY_S = 2.0
COMPLETION_RETRY_MS = 1000  # a completion answered node_unavailable is sent again after this
FLUSH_TIMEOUT_S = 15.0  # how long a stop waits for the last completions to go through
RATE_WINDOW_S = 60.0


class FleetConfig(msgspec.Struct, frozen=True, kw_only=True):
    concurrency: int = 8
    lease_s: int = 300
    wait_s: int = 10  # long-poll on a claim when nothing is due
    grace_s: float = 30.0
    completion_batch: int = 100
    completion_linger_s: float = 0.05  # gather completions this long into one request
    carry_completions: bool = True  # results ride on the next claim (module note)
    state_every_s: float = 5.0  # queue-state poll for the progress view; 0 turns it off
    renew_every_s: float | None = None  # None: lease_s / 6, at least 1 s
    # With a directory: re-read the cluster's member list this often (joins and leaves).
    discover_every_s: float = 3.0


class NodeCounts(msgspec.Struct, frozen=True, kw_only=True):
    """One node's share of the fleet's work."""

    claimed: int  # leases it granted
    completed: int  # results sent to it that it accepted
    sent_elsewhere: int  # results for its leases sent to another node (it had left)
    live: bool


class FleetStatistics(msgspec.Struct, frozen=True, kw_only=True):
    claimed: int
    rendered: int  # completions the node accepted, by outcome
    failed: int
    gone: int
    not_found: int = 0  # the origin answered 404 or 410
    aborted: int  # renders cut short by a stop, completed as failed
    # Renders the origin turned away (Retry-After): handed back, their site blocked.
    pushed_back: int = 0
    refused: int  # completions the node refused (lease_not_held): the lease had gone
    # Of those, answered after the lease's end as this fleet counts it (from when it
    # asked): a render or a delivery that took too long, not a lease taken back early.
    refused_late: int = 0
    completions_lost: int  # completions that could not be delivered after retries
    leases_lost: int  # renewals refused: the render was abandoned
    # Leases that came within their margin of the end with no renewal landed (one failed,
    # timed out or was not answered yet): the render was abandoned.
    leases_expired: int = 0
    renewed: int
    in_flight: int
    rendered_per_min: float
    failed_per_min: float
    uptime_s: float
    stopping: bool
    fatal: str | None
    client: ClientStatistics
    nodes: dict[str, NodeCounts] = {}  # with a directory: per node, by name


ABANDONED = ("lease_lost", "lease_expired")  # cancel reasons that never complete
MIN_MARGIN_MS = 1000
MIN_RENEW_EVERY_MS = 250  # the renew loop looks no more often than this


class _Job:
    __slots__ = (
        "cancel_reason",
        "expires_at",
        "lease",
        "node",
        "renew_failure",
        "renewing",
        "task",
        "term_ms",
        "timer",
    )

    def __init__(self, lease: Lease, node: str, lease_s: int, asked_at: int) -> None:
        self.lease = lease
        self.node = node  # the node that granted the lease: its results go there
        self.task: asyncio.Task[None] | None = None
        self.cancel_reason = ""
        self.renewing = False  # a renewal request for it is out
        self.renew_failure = ""  # why its last renewal did not land, for the log
        self.timer: asyncio.TimerHandle | None = None
        self.expires_at = 0
        self.term_ms = 0
        self.extend(lease.lease_expires_at, lease_s, lease.lease_ms, asked_at)

    def extend(
        self, expires_at: int, lease_s: int, term_ms: int | None = None, asked_at: int = 0
    ) -> None:
        """`expires_at` is in the node's clock; with the term it granted (`term_ms`), the
        end is taken in this clock instead, counted from `asked_at`: a node whose clock
        runs ahead of this one's would otherwise keep a render going past its lease."""
        if term_ms is not None and asked_at:
            expires_at = asked_at + term_ms
        self.expires_at = expires_at
        # The term the node granted, as far as this clock can tell: a node may cap it
        # below what was asked, and the margin must shrink with it.
        self.term_ms = max(0, min(lease_s * 1000, expires_at - _now_ms()))
        self.renew_failure = ""

    def deadline_ms(self) -> int:
        """When the render stops unless a renewal lands first (module note)."""
        return self.expires_at - max(MIN_MARGIN_MS, self.term_ms // 10)


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
        client: AsyncFleetClient | None,
        renderer: Renderer,
        config: FleetConfig = FleetConfig(),  # noqa: B008 - frozen
        *,
        log: Callable[[str], None] | None = None,
        directory: ClusterDirectory | None = None,
    ) -> None:
        """One node's `client`, or a cluster's `directory` (then `client` is unused)."""
        if config.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if client is None and directory is None:
            raise ValueError("a client or a directory is needed")
        self.client = client
        self.directory = directory
        self.config = config
        self._renderer = renderer
        self._log = log or (lambda message: None)
        self._jobs: dict[str, _Job] = {}
        # (granting node, item, its lease's end in this clock), or None: no more.
        self._completions: asyncio.Queue[tuple[str, CompletionItem, int] | None] = asyncio.Queue()
        # By granting node: (item, its lease's end, when it was queued) for the next claim.
        self._outbox: dict[str, list[tuple[CompletionItem, int, float]]] = collections.defaultdict(
            list
        )
        self._reserved = 0  # slots a claim in flight may fill
        self._redeliveries: set[asyncio.Task[None]] = set()  # carried items sent again
        self._claimers: dict[str, asyncio.Task[None]] = {}
        self._idle: set[str] = set()  # nodes whose last claim found nothing
        self._per_node: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
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
            not_found=counts["not_found"],
            aborted=counts["aborted"],
            pushed_back=counts["pushed_back"],
            refused=counts["refused"],
            refused_late=counts["refused_late"],
            completions_lost=counts["completions_lost"],
            leases_lost=counts["leases_lost"],
            leases_expired=counts["leases_expired"],
            renewed=counts["renewed"],
            in_flight=len(self._jobs),
            rendered_per_min=round(self._rendered_rate.per_minute(), 1),
            failed_per_min=round(self._failed_rate.per_minute(), 1),
            uptime_s=round(time.monotonic() - self._started, 1),
            stopping=self._stopping.is_set(),
            fatal=self.fatal,
            client=self._client_statistics(),
            nodes=self._node_counts(),
        )

    def _client_statistics(self) -> ClientStatistics:
        if self.directory is not None:
            return self.directory.statistics()
        assert self.client is not None
        return self.client.statistics()

    def _node_counts(self) -> dict[str, NodeCounts]:
        if self.directory is None:
            return {}
        live = set(self.directory.live)
        return {
            name: NodeCounts(
                claimed=counts["claimed"],
                completed=counts["completed"],
                sent_elsewhere=counts["sent_elsewhere"],
                live=name in live,
            )
            for name, counts in sorted(self._per_node.items())
        }

    # -- the nodes -----------------------------------------------------------------

    def _nodes(self) -> list[str]:
        return [SINGLE] if self.directory is None else self.directory.live

    def _client_for(self, node: str) -> tuple[AsyncFleetClient | None, bool]:
        """(the client to send a node's results to, whether it is that node's own)."""
        if self.directory is None:
            return self.client, True
        own = self.directory.client(node)
        if own is not None:
            return own, True
        return self.directory.any_client(), False

    # -- the run -----------------------------------------------------------------

    async def run(self) -> FleetStatistics:
        """Work until request_stop (or a fatal refusal such as a bad token)."""
        self._started = time.monotonic()
        if self.directory is not None:
            await self.directory.refresh()
        claimer = asyncio.create_task(self._follow_nodes(), name="fleet-claim")
        renewer = asyncio.create_task(self._renew_loop(), name="fleet-renew")
        completer = asyncio.create_task(self._complete_loop(), name="fleet-complete")
        outbox = asyncio.create_task(self._outbox_loop(), name="fleet-outbox")
        watcher = None
        if self.config.state_every_s > 0:
            watcher = asyncio.create_task(self._watch_node(), name="fleet-node-view")
        try:
            await self._stopping.wait()
        finally:
            await _cancel(claimer)
            for task in list(self._claimers.values()):
                await _cancel(task)
            self._claimers.clear()
            await self._drain_renders()
            await _cancel(renewer)
            await _cancel(outbox)
            if self._redeliveries:  # claims that carried results, cut off by the stop
                await asyncio.wait(set(self._redeliveries), timeout=FLUSH_TIMEOUT_S)
            self._flush_outbox(None)
            await self._completions.put(None)
            try:
                async with asyncio.timeout(FLUSH_TIMEOUT_S):
                    await completer
            except TimeoutError:
                self._log("stopped before every completion was delivered")
            if self._redeliveries:
                await asyncio.wait(set(self._redeliveries), timeout=FLUSH_TIMEOUT_S)
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
            # An abandoned render still winding down stays abandoned: never completed.
            if job.task is not None and not job.task.done() and not job.cancel_reason:
                job.cancel_reason = "aborted"
                job.task.cancel()
        leftover = [job.task for job in self._jobs.values() if job.task is not None]
        if leftover:
            await asyncio.gather(*leftover, return_exceptions=True)

    def _fail(self, message: str) -> None:
        self.fatal = message
        self._log(f"fatal: {message}")
        self._stopping.set()

    async def _follow_nodes(self) -> None:
        """A claimer per live node, started and stopped as the member list changes."""
        while not self._stopping.is_set():
            live = self._nodes()
            for name in live:
                if name not in self._claimers or self._claimers[name].done():
                    self._claimers[name] = asyncio.create_task(
                        self._claim_loop(name), name=f"fleet-claim {name}"
                    )
            for name in [n for n in self._claimers if n not in live]:
                # Gone from the list: claim there no more. A claim in flight is cut off;
                # what it was granted, if anything, expires unanswered (the node left).
                await _cancel(self._claimers.pop(name))
                self._idle.discard(name)
            if self.directory is None:
                await self._stopping.wait()
                return
            await asyncio.sleep(self.config.discover_every_s)
            await self.directory.refresh()

    def _want(self, node: str) -> int:
        """How many keys this node's next claim asks for (module note)."""
        free = self.config.concurrency - len(self._jobs) - self._reserved
        if free <= 0:
            return 0
        nodes = self._nodes()
        if len(nodes) <= 1:
            return min(free, MAX_CLAIM)
        if node in self._idle:
            return 1
        busy = max(1, sum(1 for n in nodes if n not in self._idle))
        return min(free, MAX_CLAIM, math.ceil(self.config.concurrency / busy))

    async def _claim_loop(self, node: str) -> None:
        config = self.config
        client = self.client if self.directory is None else self.directory.client(node)
        if client is None:
            return
        clustered = self.directory is not None and self.directory.clustered
        unready_s = CLUSTER_UNREADY_S if clustered else msgspec.UNSET
        failures = 0
        while not self._stopping.is_set():
            want = self._want(node)
            if want <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            self._reserved += want
            asked_at = _now_ms()
            carried = self._outbox.pop(node, [])
            # A claim that carries results does not long-poll, and a stop lets it finish:
            # cut off, it could not tell which of them the node applied.
            call = _task(
                client.claim_completing(
                    want,
                    [item for item, _, _ in carried],
                    lease_s=config.lease_s,
                    wait_s=0 if carried else config.wait_s,
                    max_unready_s=unready_s,
                )
            )
            try:
                leases, results = await (asyncio.shield(call) if carried else call)
            except FleetRequestError as exc:
                if carried:
                    # Maybe an item's fault: they go on their own, the claim goes again.
                    self._requeue(node, carried)
                    self._reserved -= want
                    continue
                self._fail(f"{'node ' + node if node else 'the node'} refused a claim: {exc}")
                return
            except FleetUnavailable as exc:
                self._requeue(node, carried)
                failures += 1
                self._log(f"claims failing{' at ' + node if node else ''}: {exc}")
                self._idle.add(node)
                self._reserved -= want
                self._slot_freed.set()  # its share is the others' meanwhile
                await asyncio.sleep(min(30.0, 2.0 ** (failures - 1)))
                continue
            except BaseException:
                self._reserved -= want
                if carried:
                    self._track(self._settle_later(node, call, carried))
                raise
            self._reserved -= want
            failures = 0
            if carried:
                ends = {item.key: end for item, end, _ in carried}
                again = self._settle(node, [item for item, _, _ in carried], results, True, ends)
                if again:
                    self._track(self._deliver_again(node, carried, again, ends))
            self._counts["claimed"] += len(leases)
            self._per_node[node]["claimed"] += len(leases)
            if leases:
                self._idle.discard(node)
            else:
                self._idle.add(node)
            for lease in leases:
                self._start(lease, lease.node or node, asked_at)
            if len(leases) < want:
                self._slot_freed.set()  # slots it reserved and did not fill
            if not leases and config.wait_s == 0:
                await asyncio.sleep(1.0)  # nothing due and no long-poll: do not spin

    def _start(self, lease: Lease, node: str = SINGLE, asked_at: int = 0) -> None:
        if lease.key in self._jobs:
            # The node granted a key this worker still holds: its lease must have
            # lapsed. Keep the render we have; the new token is the live one.
            self._jobs[lease.key].lease = lease
            self._jobs[lease.key].node = node
            self._jobs[lease.key].extend(
                lease.lease_expires_at, self.config.lease_s, lease.lease_ms, asked_at
            )
            return
        job = _Job(lease, node, self.config.lease_s, asked_at)
        self._jobs[lease.key] = job
        job.task = asyncio.create_task(self._render(job), name=f"render {lease.key[:80]}")
        self._watch_lease(job)

    def _watch_lease(self, job: _Job) -> None:
        """Abandon the render at its deadline unless a renewal has moved it on since.

        A timer of its own rather than a check in the renew loop: that loop ticks every
        sixth of a lease, coarser than the margin, and its requests can hang.
        """
        job.timer = None
        if job.task is None or job.task.done() or job.cancel_reason in ABANDONED:
            return
        wait_ms = job.deadline_ms() - _now_ms()
        if wait_ms > 0:
            loop = asyncio.get_running_loop()
            job.timer = loop.call_later(wait_ms / 1000, self._watch_lease, job)
            return
        self._abandon_expired(job)

    def _abandon_expired(self, job: _Job) -> None:
        self._counts["leases_expired"] += 1
        why = job.renew_failure or ("renewal not answered yet" if job.renewing else "not renewed")
        self._log(f"lease expiring on {job.lease.key} with no renewal ({why}); render abandoned")
        self._cancel_render(job, "lease_expired")

    def _cancel_render(self, job: _Job, reason: str) -> None:
        cancelled = bool(job.cancel_reason)
        job.cancel_reason = reason
        # Cancelled once is enough: a second cancel would cut a renderer's own clean-up
        # short (the command renderer waiting for its killed process group).
        if not cancelled and job.task is not None and job.task is not asyncio.current_task():
            job.task.cancel()

    async def _render(self, job: _Job) -> None:
        try:
            cut_short = False
            try:
                result = await self._renderer(job.lease)
            except asyncio.CancelledError:
                if job.cancel_reason in ABANDONED:
                    return
                if job.cancel_reason != "aborted":
                    raise
                cut_short = True
                result = RenderResult(outcome="failed", detail="cut short by a stop")
            except Exception as exc:  # a renderer bug must not take the fleet down
                result = RenderResult(outcome="failed", detail=f"renderer raised {exc!r}")
            if job.cancel_reason not in ABANDONED and _now_ms() >= job.deadline_ms():
                # Done past its deadline before the timer could fire (a busy loop): the
                # lease is as good as gone, whatever the renderer made of it.
                self._abandon_expired(job)
            if job.cancel_reason in ABANDONED:
                return  # also when a renderer swallowed the cancel and returned anyway
            if cut_short:
                self._counts["aborted"] += 1
            if result.outcome == "failed" and result.detail:
                self._log(f"failed {job.lease.key}: {result.detail}")
            # the token of the lease as it is now: a regrant may have replaced it
            lease = job.lease
            item = CompletionItem(
                key=lease.key,
                token=lease.token,
                outcome=result.outcome,
                next_render_at=result.next_render_at,
                site_retry_after_s=result.site_retry_after_s,
                changed=result.changed if result.outcome == "rendered" else None,
            )
            if self.config.carry_completions and not self._stopping.is_set():
                self._outbox[job.node].append((item, job.expires_at, time.monotonic()))
            else:
                await self._completions.put((job.node, item, job.expires_at))
        finally:
            if job.timer is not None:
                job.timer.cancel()
            self._jobs.pop(job.lease.key, None)
            self._slot_freed.set()

    async def _renew_loop(self) -> None:
        config = self.config
        every_ms = int((config.renew_every_s or max(1.0, config.lease_s / 6)) * 1000)
        # Requests are not awaited here: one that hangs (a node stopped, not down) must
        # not hold up the next round, for its own node's other leases or anyone's.
        requests: set[asyncio.Task[None]] = set()
        try:
            while True:
                # A node may grant a shorter term than asked (a cluster's lease ceiling):
                # such a lease is renewed at half its term too, so look that often.
                shortest = min((job.term_ms for job in self._jobs.values()), default=every_ms)
                await asyncio.sleep(max(MIN_RENEW_EVERY_MS, min(every_ms, shortest // 4)) / 1000)
                now = _now_ms()
                by_node: dict[str, list[_Job]] = collections.defaultdict(list)
                for job in self._jobs.values():
                    if job.renewing or job.cancel_reason in ABANDONED:
                        continue
                    if job.expires_at <= now + job.term_ms // 2:
                        by_node[job.node].append(job)
                for node, jobs in by_node.items():
                    for job in jobs:
                        job.renewing = True
                    task = asyncio.create_task(self._renew_at(node, jobs))
                    requests.add(task)
                    task.add_done_callback(requests.discard)
        finally:
            for task in list(requests):
                await _cancel(task)

    async def _renew_at(self, node: str, jobs: list[_Job]) -> None:
        try:
            client, _ = self._client_for(node)
            if client is None:
                for job in jobs:
                    job.renew_failure = "no live node to renew at"
                return
            for start in range(0, len(jobs), MAX_CLAIM):
                chunk = jobs[start : start + MAX_CLAIM]
                # Retrying past the last deadline in the chunk is pointless: each of its
                # renders has been abandoned by then, whatever the node would say.
                wait_ms = max(job.deadline_ms() for job in chunk) - _now_ms()
                asked_at = _now_ms()
                try:
                    async with asyncio.timeout(max(0, wait_ms) / 1000):
                        results = await client.renew(
                            [job.lease for job in chunk], lease_s=self.config.lease_s
                        )
                except TimeoutError:
                    failure = "renewal not answered in time"
                except (FleetUnavailable, FleetRequestError) as exc:
                    failure = f"renewal failed: {exc}"
                    self._log(failure)
                else:
                    self._apply_renewals(chunk, results, asked_at)
                    continue
                for job in chunk:
                    job.renew_failure = failure
        finally:
            for job in jobs:
                job.renewing = False

    def _apply_renewals(
        self, jobs: list[_Job], results: list[ItemResult], asked_at: int = 0
    ) -> None:
        by_key = {job.lease.key: job for job in jobs}
        for result in results:
            job = by_key.get(result.key)
            if job is None:
                continue
            if result.ok:
                self._counts["renewed"] += 1
                expires_at = result.lease_expires_at or (_now_ms() + self.config.lease_s * 1000)
                job.extend(expires_at, self.config.lease_s, result.lease_ms, asked_at)
            elif job.cancel_reason not in ABANDONED and job.task and not job.task.done():
                # Whatever the reason (lease_not_held, not_owner, ...): the node does not
                # hold this lease for us any more, so no result of ours can count.
                self._counts["leases_lost"] += 1
                why = result.error or "refused"
                if result.owner:
                    why += f", owner {result.owner}"
                if result.detail:
                    why += f": {result.detail}"
                self._log(f"lease lost on {job.lease.key} ({why}); render abandoned")
                self._cancel_render(job, "lease_lost")

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        """Carried results still on their way: a stop waits for them."""
        task = asyncio.create_task(work)
        self._redeliveries.add(task)
        task.add_done_callback(self._redeliveries.discard)

    async def _settle_later(
        self,
        node: str,
        call: asyncio.Future[tuple[list[Lease], list[ItemResult]]],
        carried: list[tuple[CompletionItem, int, float]],
    ) -> None:
        """The answer to a claim whose claimer was cancelled: its carried results count
        (its leases are left to expire, as any claim's cut off)."""
        try:
            _, results = await call
        except Exception:
            self._requeue(node, carried)
            return
        ends = {item.key: end for item, end, _ in carried}
        again = self._settle(node, [item for item, _, _ in carried], results, True, ends)
        if again:
            await self._deliver_again(node, carried, again, ends)

    def _requeue(self, node: str, carried: list[tuple[CompletionItem, int, float]]) -> None:
        """Carried items whose claim failed: the completer sends them on their own."""
        for item, end, _ in carried:
            self._completions.put_nowait((node, item, end))

    def _flush_outbox(self, older_than: float | None) -> None:
        """Hand the completer each item no claim has taken since `older_than` (None: all)."""
        for node, waiting in list(self._outbox.items()):
            # Queued in time order, so the stale items are a prefix.
            cut = len(waiting)
            if older_than is not None:
                cut = next((i for i, x in enumerate(waiting) if x[2] > older_than), cut)
            if not cut:
                continue
            if cut == len(waiting):
                del self._outbox[node]
            else:
                self._outbox[node] = waiting[cut:]
            self._requeue(node, waiting[:cut])

    async def _outbox_loop(self) -> None:
        linger = max(self.config.completion_linger_s, 0.001)
        while True:
            await asyncio.sleep(linger)
            self._flush_outbox(time.monotonic() - linger)

    async def _deliver_again(
        self,
        node: str,
        carried: list[tuple[CompletionItem, int, float]],
        again: set[str],
        ends: dict[str, int],
    ) -> None:
        await asyncio.sleep(COMPLETION_RETRY_MS / 1000)
        await self._deliver_to(node, [item for item, _, _ in carried if item.key in again], ends)

    async def _complete_loop(self) -> None:
        closing = False
        # Against a cluster each batch is delivered on a task of its own, at most a few at
        # once: a node that stops answering (its retries take seconds) must not hold up the
        # results of the others' leases until those expire.
        pending: set[asyncio.Task[None]] = set()
        try:
            while not closing:
                closing = await self._complete_batch(pending)
        finally:
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def _complete_batch(self, pending: set[asyncio.Task[None]]) -> bool:
        """Gather one batch and deliver it; True once the queue is closed."""
        config = self.config
        closing = False
        first = await self._completions.get()
        if first is None:
            return True
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
        if self.directory is None:
            await self._deliver(batch)
            return closing
        while len(pending) >= MAX_DELIVERIES:
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        task = asyncio.create_task(self._deliver(batch))
        pending.add(task)
        task.add_done_callback(pending.discard)
        return closing

    async def _deliver(self, batch: list[tuple[str, CompletionItem, int]]) -> None:
        """Each completion to the node that granted its lease, a request per node at once."""
        by_node: dict[str, list[CompletionItem]] = collections.defaultdict(list)
        ends = {item.key: end for _, item, end in batch}
        for node, item, _ in batch:
            by_node[node].append(item)
        await asyncio.gather(
            *(self._deliver_to(node, items, ends) for node, items in by_node.items())
        )

    async def _deliver_to(
        self, node: str, batch: list[CompletionItem], ends: dict[str, int]
    ) -> None:
        """`ends`: each item's lease end, until which an item answered `node_unavailable`
        is sent again (its node may be restarting, and takes its leases back)."""
        client, own = self._client_for(node)
        if client is None:
            self._counts["completions_lost"] += len(batch)
            self._log(f"{len(batch)} completion(s) not delivered: no live node to send them to")
            return
        if not own:
            self._per_node[node]["sent_elsewhere"] += len(batch)
        try:
            results = await client.complete(batch)
        except FleetUnavailable as exc:
            if own and self.directory is not None and self.directory.clustered:
                # The node stopped answering: if it has left, another node says what became
                # of its leases (or forwards them, should it be back).
                await self.directory.refresh()
                if self.directory.client(node) is None and self.directory.live:
                    await self._deliver_to(node, batch, ends)
                    return
            self._counts["completions_lost"] += len(batch)
            self._log(f"{len(batch)} completion(s) not delivered: {exc}")
            return
        except FleetRequestError as exc:
            self._counts["completions_lost"] += len(batch)
            self._log(f"{len(batch)} completion(s) not delivered: {exc}")
            return
        again = self._settle(node, batch, results, own, ends)
        if again:
            await asyncio.sleep(COMPLETION_RETRY_MS / 1000)
            await self._deliver_to(node, [item for item in batch if item.key in again], ends)

    def _settle(
        self,
        node: str,
        batch: list[CompletionItem],
        results: list[ItemResult],
        own: bool,
        ends: dict[str, int],
    ) -> set[str]:
        """Count a batch's results; the keys answered `node_unavailable` to send again, while
        their leases last (`ends`)."""
        outcomes = {
            item.key: "pushed_back" if item.site_retry_after_s else item.outcome for item in batch
        }
        refused: list[ItemResult] = []
        late = 0
        again: set[str] = set()
        answered_at = _now_ms()
        last_try = answered_at + COMPLETION_RETRY_MS + MIN_MARGIN_MS
        for result in results:
            retry = not result.ok and result.error == "node_unavailable"
            if retry and ends.get(result.key, 0) > last_try:
                again.add(result.key)
                continue
            if result.ok:
                outcome = outcomes.get(result.key, "rendered")
                self._counts[outcome] += 1
                if own:
                    self._per_node[node]["completed"] += 1
                if outcome in ("failed", "pushed_back"):
                    self._failed_rate.add()
                else:
                    self._rendered_rate.add()
            else:
                self._counts["refused"] += 1
                refused.append(result)
                if ends.get(result.key, 0) <= answered_at:
                    late += 1
        self._counts["refused_late"] += late
        if refused:
            # One line a batch: a node that left refuses all it granted at once.
            first = refused[0]
            where = f" (leases of {node}{'' if own else ', sent to another node'})" if node else ""
            after = f", {late} answered after their lease's end" if late else ""
            self._log(
                f"{len(refused)} completion(s) refused{where}{after}: {first.detail or first.error}"
            )
        return again

    async def _watch_node(self) -> None:
        while True:
            try:
                if self.directory is not None and self.directory.clustered:
                    client = self.directory.any_client()
                    if client is None:
                        raise LookupError("no live node")
                    status, body = await client.queue_state(CLUSTER_QUEUE_STATE_PATH)
                else:
                    client = self.client
                    if self.directory is not None:
                        client = self.directory.any_client()
                    if client is None:
                        raise LookupError("no node")
                    status, body = await client.queue_state()
                self.node_view = summarize_queue_state(status, body)
            except Exception as exc:  # a view only: never let it stop the fleet
                self.node_view = NodeView(status=f"unreachable ({type(exc).__name__})")
            await asyncio.sleep(self.config.state_every_s)


def _task(work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
    return asyncio.create_task(work)


async def _cancel(task: asyncio.Task[object] | asyncio.Task[None] | asyncio.Task[bool]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
