"""fleet.runner: the claim / renew / complete loops and the graceful stop, first against a
scripted in-process node (exact control of leases and timing), then `renderqueue fleet
--simulate` end to end against a real node."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from fleet.client import AsyncFleetClient
from fleet.messages import Lease
from fleet.renderers import RenderResult
from fleet.runner import FleetConfig, FleetRunner, FleetStatistics

REPO = Path(__file__).resolve().parent.parent


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class ScriptedNode:
    """The fleet API over a dict of due keys: enough of a node to drive the runner."""

    def __init__(self, keys: list[str], *, lease_s_cap: int = 3600) -> None:
        self.due = list(keys)
        self.leases: dict[str, tuple[str, int]] = {}  # key -> (token, expires_at)
        self.completed: list[tuple[str, str]] = []
        self.refuse_renewal: set[str] = set()
        self.taken_back: set[str] = set()  # leases it ends before their completion lands
        self.refusal: dict[str, object] = {"error": "lease_not_held"}  # what a refusal says
        self.fail_renewals = False  # every renewal answered 500, as a node in trouble does
        # Completion requests answered node_unavailable before one is taken: a node
        # forwarding to one that is restarting.
        self.unavailable_completions = 0
        self.renewals: list[str] = []
        self.claims = 0
        self.completion_requests = 0
        self.carried = 0  # completion items that came on claims
        self._token = 0
        # The node's clock less the fleet's: its lease_expires_at are in its own clock,
        # and each lease says its term (lease_ms) as a real node does.
        self.clock_ahead_ms = 0

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        path = request.url.path
        if path == "/v1/claims":
            self.claims += 1
            # Completions it carries are applied first, as /v1/completions applies them.
            completed = None
            if "complete" in body:
                self.carried += len(body["complete"])
                completed = self._complete(body["complete"])
            granted: list[dict[str, object]] = []
            while self.due and len(granted) < body["max"]:
                key = self.due.pop(0)
                self._token += 1
                expires = now_ms() + body["lease_s"] * 1000
                self.leases[key] = (str(self._token), expires)
                granted.append(
                    {
                        "key": key,
                        "token": str(self._token),
                        "route": "product",
                        "due_at": 0,
                        "lease_expires_at": expires + self.clock_ahead_ms,
                        "sitemap": False,
                        "cadence_s": 3600,
                        "lease_ms": body["lease_s"] * 1000,
                    }
                )
            if not granted and body.get("wait_s"):
                await asyncio.sleep(min(body["wait_s"], 0.05))
            answer: dict[str, object] = {"leases": granted, "status": "ready"}
            if completed is not None:
                answer["completed"] = completed
            return httpx.Response(200, json=answer)
        if path == "/v1/completions":
            self.completion_requests += 1
            return httpx.Response(200, json={"results": self._complete(body["items"])})
        if path == "/v1/leases/renew":
            results = []
            for item in body["items"]:
                self.renewals.append(item["key"])
                if self.fail_renewals:
                    return httpx.Response(500)
                held = self.leases.get(item["key"])
                if held is None or held[0] != item["token"] or item["key"] in self.refuse_renewal:
                    self.leases.pop(item["key"], None)
                    results.append({"key": item["key"], "ok": False, **self.refusal})
                    continue
                expires = now_ms() + item["lease_s"] * 1000
                self.leases[item["key"]] = (held[0], expires)
                results.append({"key": item["key"], "ok": True, "lease_expires_at": expires})
            return httpx.Response(200, json={"results": results})
        if path == "/prerender_admin/queue-state":
            return httpx.Response(200, json={"now": {"due": len(self.due), "status": "ready"}})
        return httpx.Response(404)

    def _complete(self, items: list[dict[str, Any]]) -> list[dict[str, object]]:
        if self.unavailable_completions > 0:
            self.unavailable_completions -= 1
            unavailable = {"ok": False, "error": "node_unavailable", "detail": "restarting"}
            return [{"key": item["key"], **unavailable} for item in items]
        results: list[dict[str, object]] = []
        for item in items:
            held = self.leases.get(item["key"])
            if held is None or held[0] != item["token"] or item["key"] in self.taken_back:
                results.append({"key": item["key"], "ok": False, "error": "lease_not_held"})
                continue
            del self.leases[item["key"]]
            self.completed.append((item["key"], item["outcome"]))
            results.append({"key": item["key"], "ok": True})
        return results


def run_fleet(
    node: ScriptedNode,
    renderer: Callable[[Lease], Awaitable[RenderResult]],
    config: FleetConfig,
    *,
    stop_when: Callable[[FleetRunner], bool],
    stop_twice: bool = False,
) -> tuple[FleetStatistics, list[str]]:
    log: list[str] = []

    async def go() -> FleetStatistics:
        client = AsyncFleetClient("http://node", transport=httpx.MockTransport(node.handle))
        runner = FleetRunner(client, renderer, config, log=log.append)

        async def stopper() -> None:
            while not stop_when(runner):
                await asyncio.sleep(0.01)
            runner.request_stop()
            if stop_twice:
                await asyncio.sleep(0.05)
                runner.request_stop()

        stopping = asyncio.create_task(stopper())
        try:
            return await asyncio.wait_for(runner.run(), 60)
        finally:
            stopping.cancel()
            await client.aclose()

    return asyncio.run(go()), log


async def quick(lease: Lease) -> RenderResult:
    await asyncio.sleep(0.001)
    return RenderResult(outcome="gone" if lease.key.endswith("-gone") else "rendered")


def test_a_completion_refused_while_its_lease_lasts_is_not_counted_late() -> None:
    """`refused_late` counts only refusals answered after the lease's end as the fleet
    counts it: a lease the node ended early is a refusal of another kind."""
    node = ScriptedNode(["k0", "k1", "k2"])
    node.taken_back.add("k1")
    stats, log = run_fleet(
        node,
        quick,
        FleetConfig(concurrency=4, wait_s=1, state_every_s=0),
        stop_when=lambda runner: runner.statistics().rendered + runner.statistics().refused == 3,
    )
    assert (stats.rendered, stats.refused, stats.refused_late) == (2, 1, 0)
    refusals = [line for line in log if "refused" in line]
    assert refusals and not any("after their lease's end" in line for line in refusals), log


def test_renders_every_key_once_and_completes_it() -> None:
    keys = [f"k{i}" for i in range(200)] + ["x-gone"]
    node = ScriptedNode(keys)
    stats, _ = run_fleet(
        node,
        quick,
        FleetConfig(concurrency=16, wait_s=1, state_every_s=0),
        stop_when=lambda runner: len(node.completed) == len(keys),
    )
    assert sorted(key for key, _ in node.completed) == sorted(keys)
    assert dict(node.completed)["x-gone"] == "gone"
    assert (stats.rendered, stats.gone, stats.failed, stats.refused) == (200, 1, 0, 0)
    assert stats.claimed == 201 and stats.in_flight == 0
    assert not node.leases


def test_concurrency_is_a_ceiling() -> None:
    node = ScriptedNode([f"k{i}" for i in range(60)])
    peak = 0
    running = 0

    async def counting(lease: Lease) -> RenderResult:
        nonlocal peak, running
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.005)
        running -= 1
        return RenderResult(outcome="rendered")

    run_fleet(
        node,
        counting,
        FleetConfig(concurrency=5, wait_s=1, state_every_s=0),
        stop_when=lambda _: len(node.completed) == 60,
    )
    assert peak == 5


def test_graceful_stop_finishes_in_flight_and_claims_no_more() -> None:
    node = ScriptedNode([f"k{i}" for i in range(100)])
    started: list[str] = []

    async def slow(lease: Lease) -> RenderResult:
        started.append(lease.key)
        await asyncio.sleep(0.3)
        return RenderResult(outcome="rendered")

    stats, log = run_fleet(
        node,
        slow,
        FleetConfig(concurrency=4, wait_s=1, grace_s=10, state_every_s=0),
        stop_when=lambda runner: runner.statistics().in_flight == 4,
    )
    assert len(started) == 4, "a claim went out after the stop"
    assert sorted(key for key, _ in node.completed) == sorted(started)
    assert all(outcome == "rendered" for _, outcome in node.completed)
    assert stats.rendered == 4 and stats.aborted == 0
    assert len(node.due) == 96 and not node.leases
    assert any("stopping" in line for line in log)


def test_grace_period_over_cuts_renders_short_and_completes_them_failed() -> None:
    node = ScriptedNode([f"k{i}" for i in range(10)])

    async def endless(lease: Lease) -> RenderResult:
        await asyncio.sleep(3600)
        return RenderResult(outcome="rendered")

    stats, _ = run_fleet(
        node,
        endless,
        FleetConfig(concurrency=3, wait_s=1, grace_s=0.3, state_every_s=0),
        stop_when=lambda runner: runner.statistics().in_flight == 3,
    )
    assert stats.aborted == 3 and stats.failed == 3
    assert [outcome for _, outcome in node.completed] == ["failed"] * 3
    assert not node.leases, "a cut-short render left its lease to expire"


def test_second_stop_skips_the_grace_period() -> None:
    node = ScriptedNode([f"k{i}" for i in range(10)])

    async def endless(lease: Lease) -> RenderResult:
        await asyncio.sleep(3600)
        return RenderResult(outcome="rendered")

    stats, log = run_fleet(
        node,
        endless,
        FleetConfig(concurrency=2, wait_s=1, grace_s=3600, state_every_s=0),
        stop_when=lambda runner: runner.statistics().in_flight == 2,
        stop_twice=True,
    )
    assert stats.aborted == 2  # within run_fleet's 60 s guard, not the hour of grace
    assert any("cutting renders in flight short" in line for line in log)


def test_long_renders_are_renewed_and_a_lost_lease_is_abandoned() -> None:
    node = ScriptedNode(["keep", "lose"])
    node.refuse_renewal.add("lose")
    cancelled: list[str] = []

    async def long(lease: Lease) -> RenderResult:
        try:
            await asyncio.sleep(4.0)  # past half of the 5 s lease: renewal is due
        except asyncio.CancelledError:
            cancelled.append(lease.key)
            raise
        return RenderResult(outcome="rendered")

    stats, log = run_fleet(
        node,
        long,
        # the 5 s lease is renewed once under half its term (checked every 0.1 s)
        FleetConfig(concurrency=2, lease_s=5, wait_s=1, state_every_s=0, renew_every_s=0.1),
        stop_when=lambda _: len(node.completed) == 1 and len(cancelled) == 1,
    )
    assert "keep" in node.renewals and "lose" in node.renewals
    assert cancelled == ["lose"]
    assert node.completed == [("keep", "rendered")]
    assert stats.leases_lost == 1 and stats.renewed >= 1 and stats.leases_expired == 0
    assert any("lease lost on lose (lease_not_held)" in line for line in log)


def test_a_completion_answered_node_unavailable_is_sent_again_while_its_lease_lasts() -> None:
    """The granting node is restarting (another node forwards to it and says so): the
    fleet sends the completion again until it lands, never drops it as refused."""
    node = ScriptedNode(["a", "b"])
    node.unavailable_completions = 2
    stats, _ = run_fleet(
        node,
        quick,
        FleetConfig(concurrency=2, lease_s=30, wait_s=1, state_every_s=0),
        stop_when=lambda _: len(node.completed) == 2,
    )
    assert sorted(node.completed) == [("a", "rendered"), ("b", "rendered")]
    assert node.unavailable_completions == 0 and stats.refused == 0


def test_results_ride_on_the_next_claim_to_their_node() -> None:
    keys = [f"k{i}" for i in range(120)]
    node = ScriptedNode(keys)
    stats, _ = run_fleet(
        node,
        quick,
        FleetConfig(concurrency=8, wait_s=1, state_every_s=0, completion_linger_s=1.0),
        stop_when=lambda runner: len(node.completed) == len(keys),
    )
    assert sorted(key for key, _ in node.completed) == sorted(keys)
    assert (stats.rendered, stats.refused, stats.completions_lost) == (120, 0, 0)
    # Every slot a render frees is claimed again at once, with its result on that claim; the
    # results left when the keys run out go on their own.
    assert node.carried >= 100 and node.carried + node.completion_requests * 8 >= 120


def test_without_carrying_results_go_on_their_own() -> None:
    node = ScriptedNode([f"k{i}" for i in range(40)])
    stats, _ = run_fleet(
        node,
        quick,
        FleetConfig(concurrency=8, wait_s=1, state_every_s=0, carry_completions=False),
        stop_when=lambda runner: len(node.completed) == 40,
    )
    assert node.carried == 0 and stats.rendered == 40 and node.completion_requests > 0


def test_a_carried_result_answered_node_unavailable_is_sent_again() -> None:
    node = ScriptedNode([f"k{i}" for i in range(6)])
    node.unavailable_completions = 1
    stats, _ = run_fleet(
        node,
        quick,
        FleetConfig(concurrency=1, lease_s=30, wait_s=1, state_every_s=0, completion_linger_s=1.0),
        stop_when=lambda _: len(node.completed) == 6,
    )
    assert node.carried > 0 and node.unavailable_completions == 0
    assert sorted(key for key, _ in node.completed) == [f"k{i}" for i in range(6)]
    assert (stats.rendered, stats.refused, stats.completions_lost) == (6, 0, 0)


def test_a_renewal_refused_for_any_reason_abandons_the_render_and_names_the_owner() -> None:
    """A node answers `not_owner` with the key's owner now: a field the fleet's types must
    take, and a refusal like any other."""
    node = ScriptedNode(["moved"])
    node.refuse_renewal.add("moved")
    node.refusal = {"error": "not_owner", "owner": "node-b", "detail": "owned by node-b"}
    cancelled: list[str] = []

    async def endless(lease: Lease) -> RenderResult:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(lease.key)
            raise
        return RenderResult(outcome="rendered")

    stats, log = run_fleet(
        node,
        endless,
        FleetConfig(concurrency=1, lease_s=5, wait_s=1, state_every_s=0, renew_every_s=0.1),
        stop_when=lambda runner: (
            runner.statistics().leases_lost == 1 and runner.statistics().in_flight == 0
        ),
    )
    assert cancelled == ["moved"] and node.completed == []
    assert stats.leases_lost == 1 and stats.leases_expired == 0
    assert any(
        "lease lost on moved (not_owner, owner node-b: owned by node-b)" in line for line in log
    ), log


def render_stubbornly(
    node: ScriptedNode,
) -> tuple[list[Lease], list[int], FleetStatistics, list[str]]:
    """Run one render that never ends on its own and returns a result once cancelled, until
    the fleet gives its lease up: (the leases rendered, when each was cancelled, the
    fleet's statistics, its log)."""
    leases: list[Lease] = []
    cancelled_at: list[int] = []

    async def stubborn(lease: Lease) -> RenderResult:
        leases.append(lease)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled_at.append(now_ms())
        return RenderResult(outcome="rendered")

    stats, log = run_fleet(
        node,
        stubborn,
        FleetConfig(concurrency=1, lease_s=5, wait_s=1, state_every_s=0, renew_every_s=0.1),
        stop_when=lambda runner: (
            runner.statistics().leases_expired == 1 and runner.statistics().in_flight == 0
        ),
    )
    return leases, cancelled_at, stats, log


def test_failing_renewals_abandon_the_render_before_its_lease_ends() -> None:
    """Every renewal fails (500s, retried): the render is cut off before its lease ends,
    and a renderer that shrugs the cancel off and returns a result is not completed."""
    node = ScriptedNode(["stuck"])
    node.fail_renewals = True
    leases, cancelled_at, stats, log = render_stubbornly(node)
    assert "stuck" in node.renewals, "no renewal was tried"
    assert len(cancelled_at) == 1 and cancelled_at[0] < leases[0].lease_expires_at
    assert node.completed == [] and "stuck" in node.leases, "a completion went out"
    assert stats.leases_expired == 1 and stats.leases_lost == 0
    assert stats.rendered == stats.failed == stats.refused == 0
    assert any("lease expiring on stuck with no renewal" in line for line in log), log


def test_a_node_whose_clock_runs_ahead_cannot_stretch_a_lease() -> None:
    """The node's clock is a minute ahead, so its lease_expires_at is a minute late by
    this clock: the fleet counts the granted term from its own ask, and stops the render
    before the lease really ends."""
    node = ScriptedNode(["skewed"])
    node.fail_renewals = True
    node.clock_ahead_ms = 60_000
    _, cancelled_at, stats, _ = render_stubbornly(node)
    _, really_ends = node.leases["skewed"]
    assert len(cancelled_at) == 1 and cancelled_at[0] < really_ends
    assert node.completed == [] and stats.leases_expired == 1


def test_a_renderer_that_raises_is_a_failed_render_not_a_dead_fleet() -> None:
    node = ScriptedNode(["a", "b"])

    async def broken(lease: Lease) -> RenderResult:
        if lease.key == "a":
            raise RuntimeError("browser crashed")
        return RenderResult(outcome="rendered")

    _, log = run_fleet(
        node,
        broken,
        FleetConfig(concurrency=2, wait_s=1, state_every_s=0),
        stop_when=lambda _: len(node.completed) == 2,
    )
    assert dict(node.completed) == {"a": "failed", "b": "rendered"}
    assert any("browser crashed" in line for line in log)


def test_a_refused_claim_is_fatal() -> None:
    async def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(403, json={"title": "Forbidden", "detail": "wrong scope"})

    async def go() -> FleetStatistics:
        client = AsyncFleetClient("http://node", transport=httpx.MockTransport(handle))
        runner = FleetRunner(client, quick, FleetConfig(state_every_s=0))
        try:
            return await asyncio.wait_for(runner.run(), 30)
        finally:
            await client.aclose()

    stats = asyncio.run(go())
    assert stats.fatal is not None and "wrong scope" in stats.fatal


# -- real nodes ------------------------------------------------------------------------


class RecordingTransport(httpx.AsyncHTTPTransport):
    """The real transport, noting the path of every request the fleet sends."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return await super().handle_async_request(request)


def run_fleet_at(
    url: str,
    renderer: Callable[[Lease], Awaitable[RenderResult]],
    config: FleetConfig,
    *,
    stop_when: Callable[[FleetRunner], bool],
) -> tuple[FleetStatistics, list[str], list[str]]:
    """(statistics, log, the paths of the requests the fleet sent)."""
    log: list[str] = []
    transport = RecordingTransport()

    async def go() -> FleetStatistics:
        client = AsyncFleetClient(url, transport=transport)
        runner = FleetRunner(client, renderer, config, log=log.append)

        async def stopper() -> None:
            while not stop_when(runner):
                await asyncio.sleep(0.01)
            runner.request_stop()

        stopping = asyncio.create_task(stopper())
        try:
            return await asyncio.wait_for(runner.run(), 120)
        finally:
            stopping.cancel()
            await client.aclose()

    return asyncio.run(go()), log, transport.paths


def test_a_render_outliving_its_lease_on_a_frozen_node_is_cut_off_before_the_lease_ends(
    tmp_path: Path,
) -> None:
    """The node (supervisor and worker) is SIGSTOPped as the render starts: renewals go
    unanswered, the render must stop before the node's lease ends, and nothing is
    completed for it."""
    from node_harness import node_db, node_process, seed_rows

    from store import open_store

    (key,) = seed_rows(node_db(tmp_path), 1)
    leases: list[Lease] = []
    cancelled_at: list[int] = []
    with node_process(tmp_path, workers=1) as node:
        assert node.process is not None
        frozen = [node.process.pid, node.worker_pid(0)]

        async def outlives(lease: Lease) -> RenderResult:
            leases.append(lease)
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled_at.append(now_ms())
                raise
            return RenderResult(outcome="rendered")

        try:
            stats, log, paths = run_fleet_at(
                node.url,
                outlives,
                FleetConfig(concurrency=1, lease_s=10, wait_s=1, state_every_s=0),
                stop_when=lambda runner: (
                    runner.statistics().leases_expired == 1 and runner.statistics().in_flight == 0
                ),
            )
        finally:
            for pid in frozen:
                os.kill(pid, signal.SIGCONT)
        store = open_store(str(node.db))
        try:
            (row,) = store.walk(None, 10)
        finally:
            store.close()
    assert [lease.key for lease in leases] == [key]
    assert len(cancelled_at) == 1 and cancelled_at[0] < leases[0].lease_expires_at
    assert "/v1/leases/renew" in paths, "no renewal was tried"
    assert "/v1/completions" not in paths
    assert row.last_outcome is None and row.last_rendered_at is None
    assert stats.leases_expired == 1 and stats.leases_lost == 0
    assert stats.rendered == stats.failed == stats.refused == stats.completions_lost == 0
    assert any(f"lease expiring on {key} with no renewal" in line for line in log), log


def test_a_renewal_a_real_node_refuses_abandons_the_render_at_once(tmp_path: Path) -> None:
    """The lease is completed behind the fleet's back (as a worker that took the key over
    would): its next renewal is refused, and the render stops then, not at its deadline."""
    from node_harness import node_db, seed_rows, thread_node

    from fleet.messages import CompletionItem

    (key,) = seed_rows(node_db(tmp_path), 1)
    cancelled: list[str] = []
    with thread_node(tmp_path) as node:
        node.wait_published()

        async def overtaken(lease: Lease) -> RenderResult:
            async with AsyncFleetClient(node.url) as other:
                (done,) = await other.complete(
                    [CompletionItem(key=lease.key, token=lease.token, outcome="rendered")]
                )
            assert done.ok, done
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(lease.key)
                raise
            return RenderResult(outcome="rendered")

        stats, log, paths = run_fleet_at(
            node.url,
            overtaken,
            FleetConfig(concurrency=1, lease_s=10, wait_s=1, state_every_s=0, renew_every_s=0.2),
            stop_when=lambda runner: (
                runner.statistics().leases_lost == 1 and runner.statistics().in_flight == 0
            ),
        )
    assert cancelled == [key]
    assert "/v1/completions" not in paths
    # refused, not lapsed: it stopped on the answer, long before its deadline
    assert stats.leases_lost == 1 and stats.leases_expired == 0
    assert stats.rendered == stats.failed == stats.refused == 0
    assert any(f"lease lost on {key} (lease_not_held)" in line for line in log), log


# -- `renderqueue fleet --simulate` against a real node -------------------------------


def queue_due(client: httpx.Client) -> int | None:
    from fleet.nodeview import summarize_queue_state

    response = client.get("/prerender_admin/queue-state")
    if response.status_code != 200:
        return None
    return summarize_queue_state(response.status_code, response.json()).due


def test_simulated_fleet_drains_a_real_node(tmp_path: Path) -> None:
    from node_harness import due_in_table, node_process, seed_rows, wait_for

    count = 400
    cadence_s = 3600
    keys = seed_rows(tmp_path / "node.sqlite", count, due_share=1.0, cadence_s=cadence_s)
    with node_process(tmp_path, workers=2) as node, node.client() as admin:
        from store import open_store

        store = open_store(str(node.db))
        try:
            before = {row.key: row for row in store.walk(None, count + 10)}
        finally:
            store.close()
        started_ms = now_ms()
        fleet = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fleet.cli",
                "--node",
                node.url,
                "--concurrency",
                "16",
                "--simulate",
                "--render-ms",
                "20",
                "--failure-rate",
                "0",
                "--lease-s",
                "60",
                "--wait-s",
                "2",
                "--progress-every",
                "0.5",
                "--stats-json",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")},
        )
        try:
            wait_for(lambda: queue_due(admin) == 0, 120, "the node's due count to reach 0")
            wait_for(lambda: due_in_table(node.db, now_ms()) == 0, 60, "no due row in the table")
        finally:
            fleet.send_signal(signal.SIGTERM)
            output, _ = fleet.communicate(timeout=60)
        text = output.decode()
        assert fleet.returncode == 0, text
        store = open_store(str(node.db))
        try:
            after = {row.key: row for row in store.walk(None, count + 10)}
        finally:
            store.close()
    stats = json.loads(text.strip().splitlines()[-1])
    # every due key rendered exactly once in this cadence window
    assert set(after) == set(keys)
    for key in keys:
        row = after[key]
        assert row.last_outcome == "rendered", key
        assert row.last_rendered_at is not None
        assert row.next_render_at == row.last_rendered_at + cadence_s * 1000
        assert row.last_rendered_at >= started_ms and row.version > before[key].version
    # ...and once only: the node granted each key once and accepted each completion once
    assert stats["claimed"] == count
    assert stats["rendered"] == count and stats["failed"] == 0 and stats["refused"] == 0
    # plain progress lines when stdout is not a TTY, with the node's numbers in them
    assert "rendered" in text and "node ready" in text
    assert msgspec.json.decode(text.strip().splitlines()[-1])["in_flight"] == 0


def test_an_origin_that_answers_429_blocks_its_site_for_the_fleet(tmp_path: Path) -> None:
    """A renderer whose origin answers 429 with Retry-After: 3 says so on stderr: the
    fleet hands the key back with site_retry_after_s, the node renders no key of that site
    for 3 s (every other site goes on), then its keys come back, the pushed-back one first,
    in their order."""
    from node_harness import node_db, thread_node

    from fleet.renderers import CommandRenderer
    from store import open_store
    from store.rows import RowWrite

    now = now_ms()
    store = open_store(str(node_db(tmp_path)))
    slow = [f"https://slow.example/p/{i}" for i in range(4)]
    store.write(
        [
            RowWrite(key=key, route="product", cadence_s=3600, next_render_at=now - 9_000_000 + i)
            for i, key in enumerate(slow)
        ]
        + [
            RowWrite(
                key=f"https://fill.example/p/{i}",
                route="product",
                cadence_s=3600,
                next_render_at=now - 60_000 + i,
            )
            for i in range(30)
        ]
    )
    store.close()
    log_file, pushed = tmp_path / "renders.log", tmp_path / "pushed"
    script = tmp_path / "origin.py"
    script.write_text(
        "import sys, time, pathlib\n"
        "key, start = sys.argv[1], time.time()\n"
        f"pushed = pathlib.Path({str(pushed)!r})\n"
        "code = 0\n"
        "if 'slow.example' in key and not pushed.exists():\n"
        "    pushed.write_text(key)\n"
        "    print('HTTP 429 Too Many Requests\\nRETRY-AFTER 3', file=sys.stderr)\n"
        "    code = 1\n"
        f"with open({str(log_file)!r}, 'a') as f:\n"
        "    f.write(f'{key} {start} {time.time()}\\n')\n"
        "sys.exit(code)\n"
    )
    renderer = CommandRenderer(f"{sys.executable} {script} {{key}}")

    def rendered() -> list[tuple[str, float, float]]:
        if not log_file.exists():
            return []
        return [
            (key, float(start), float(end))
            for key, start, end in (line.split() for line in log_file.read_text().splitlines())
        ]

    with thread_node(tmp_path) as node:
        node.wait_published()
        stats, _, _ = run_fleet_at(
            node.url,
            renderer,
            FleetConfig(
                concurrency=1, lease_s=30, wait_s=1, state_every_s=0, completion_linger_s=0
            ),
            stop_when=lambda runner: sum("slow" in r[0] for r in rendered()) >= 5,
        )
        with node.client() as client:
            site = client.get("/v1/sites/slow.example").json()
    renders = rendered()
    first = renders[0]
    assert first[0] == slow[0] and stats.pushed_back == 1
    after = [r for r in renders[1:] if "slow" in r[0]]
    # The block lands with the completion, which the fleet sends once the render ended: a
    # claim made in between can still take one more key of the site, at once.
    early = [r for r in after if r[1] < first[2] + 3.0 - 0.05]
    assert all(start < first[2] + 0.3 for _, start, _ in early), early
    late = [key for key, _, _ in after[len(early) :]]
    assert late == [slow[0]] + [k for k in slow[1:] if k not in {r[0] for r in early}]
    assert any("fill" in key and start < first[2] + 3.0 for key, start, _ in renders)
    assert site["blocked_until"] is None and site["failure_streak"] == 0


def test_a_renderer_that_says_changed_teaches_an_adaptive_route(tmp_path: Path) -> None:
    """`fleet --exec` with a renderer printing `CHANGED no` or `CHANGED yes`: each
    completion carries `changed`, and the node's adaptive route moves each row's cadence
    one step of its ladder, up or down; a renderer that says nothing teaches nothing."""
    from node_harness import node_db, thread_node

    from fleet.renderers import CommandRenderer
    from store import open_store
    from store.cadence import Adaptation, history_of, ladder
    from store.rows import RowWrite

    adapt = Adaptation(min_s=600, max_s=86_400)
    rungs = ladder(adapt.min_s, adapt.max_s)
    now = now_ms()
    keys = ["https://a.example/same", "https://a.example/new", "https://a.example/quiet"]
    store = open_store(str(node_db(tmp_path)))
    store.set_route("product", adapt=adapt)
    store.write(
        [RowWrite(key=k, route="product", cadence_s=2400, next_render_at=now - 1000) for k in keys]
    )
    store.close()
    log_file = tmp_path / "renders.log"
    script = tmp_path / "render.py"
    script.write_text(
        "import sys\n"
        "key = sys.argv[1]\n"
        "if key.endswith('same'): print('hash unchanged\\nCHANGED no', file=sys.stderr)\n"
        "if key.endswith('new'): print('CHANGED yes', file=sys.stderr)\n"
        f"with open({str(log_file)!r}, 'a') as f:\n"
        "    f.write(key + '\\n')\n"
    )
    renderer = CommandRenderer(f"{sys.executable} {script} {{key}}")
    with thread_node(tmp_path) as node:
        node.wait_published()
        stats, _, _ = run_fleet_at(
            node.url,
            renderer,
            FleetConfig(concurrency=3, lease_s=30, wait_s=1, state_every_s=0),
            stop_when=lambda runner: runner.statistics().rendered >= 3,
        )
        rows = node.store.get_many(keys)
    assert stats.rendered == 3
    start = rungs.index(2400)
    same, new, quiet = (rows[k] for k in keys)
    assert same.learned_cadence_s == rungs[start + 1] and history_of(same.change_history) == [False]
    assert new.learned_cadence_s == rungs[start - 1] and history_of(new.change_history) == [True]
    assert quiet.learned_cadence_s is None and quiet.change_history == 0


def test_a_renderer_that_says_not_found_retires_its_rows(tmp_path: Path) -> None:
    """`fleet --exec` with an origin answering 404: a `NOT-FOUND` line (any exit status) or
    exit 44 is a `not_found` completion, counted apart; a route retiring at the first one
    retires those rows, and the rendered one is not touched."""
    from node_harness import node_db, thread_node

    from fleet.renderers import CommandRenderer
    from store import open_store
    from store.rows import RowWrite

    now = now_ms()
    keys = ["https://a.example/said", "https://a.example/exit", "https://a.example/alive"]
    store = open_store(str(node_db(tmp_path)))
    store.set_route("gone", retire_after=1)
    store.write(
        [RowWrite(key=k, route="gone", cadence_s=3600, next_render_at=now - 1000) for k in keys]
    )
    store.close()
    script = tmp_path / "render.py"
    script.write_text(
        "import sys\n"
        "key = sys.argv[1]\n"
        "if key.endswith('said'): print('HTTP 404\\nNOT-FOUND 404', file=sys.stderr); sys.exit(1)\n"
        "if key.endswith('exit'): sys.exit(44)\n"
    )
    renderer = CommandRenderer(f"{sys.executable} {script} {{key}}")
    with thread_node(tmp_path) as node:
        node.wait_published()
        stats, _, _ = run_fleet_at(
            node.url,
            renderer,
            FleetConfig(concurrency=3, lease_s=30, wait_s=1, state_every_s=0),
            stop_when=lambda runner: (
                runner.statistics().not_found + runner.statistics().rendered >= 3
            ),
        )
        rows = node.store.get_many(keys)
    assert (stats.not_found, stats.rendered, stats.failed) == (2, 1, 0)
    said, exited, alive = (rows[k] for k in keys)
    assert said.retired_reason == "not_found" and exited.retired_reason == "not_found"
    assert said.retired_at is not None and exited.retired_at is not None
    assert alive.retired_at is None and alive.last_outcome == "rendered"
