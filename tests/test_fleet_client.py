"""fleet.client: the retry rules against scripted responses, then against a real node
(long-poll wake-up, renewal past a lease's first term, 503 + Retry-After while the node
starts, completions fenced by tokens)."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from fleet.client import (
    AsyncFleetClient,
    FleetCancelled,
    FleetClient,
    FleetRequestError,
    FleetUnavailable,
    RetryPolicy,
    backoff_delay,
    parse_retry_after,
)
from fleet.messages import CompletionItem, Lease

LEASE = {
    "key": "https://e.com/a",
    "token": "42",
    "route": "product",
    "due_at": 1,
    "lease_expires_at": 2,
    "sitemap": True,
    "cadence_s": 3600,
}


def scripted(
    *responses: httpx.Response | Exception,
) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    seen: list[httpx.Request] = []
    queue = list(responses)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        item = queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    return httpx.MockTransport(handle), seen


def ok_claim(*leases: dict[str, object]) -> httpx.Response:
    return httpx.Response(200, json={"leases": list(leases), "status": "ready"})


def unready(retry_after: str) -> httpx.Response:
    return httpx.Response(503, headers={"Retry-After": retry_after}, json={"status": "loading"})


def sync_client(
    transport: httpx.MockTransport, sleeps: list[float], **kwargs: object
) -> FleetClient:
    return FleetClient(
        "http://node",
        token="fleet-secret",
        worker="w1",
        transport=transport,
        sleep=sleeps.append,
        rng=random.Random(1),
        **kwargs,  # type: ignore[arg-type]
    )


def test_claim_body_headers_and_typed_result() -> None:
    transport, seen = scripted(ok_claim(LEASE))
    with sync_client(transport, []) as client:
        leases = client.claim(5, lease_s=60, wait_s=7)
    assert leases == [msgspec.convert(LEASE, Lease)]
    request = seen[0]
    assert request.url.path == "/v1/claims"
    assert request.headers["authorization"] == "Bearer fleet-secret"
    assert msgspec.json.decode(request.content) == {
        "max": 5,
        "worker": "w1",
        "lease_s": 60,
        "wait_s": 7,
    }
    # the long-poll gets the wait on top of the ordinary timeout
    assert request.extensions["timeout"]["read"] == pytest.approx(10 + 7)


def test_503_retry_after_is_honoured_without_using_the_error_budget() -> None:
    transport, seen = scripted(
        unready("2"), unready("3"), unready("1"), unready("1"), ok_claim(LEASE)
    )
    sleeps: list[float] = []
    with sync_client(transport, sleeps, retry=RetryPolicy(attempts=1)) as client:
        assert len(client.claim(1)) == 1
        stats = client.statistics()
    assert len(seen) == 5
    # each wait is the node's Retry-After plus at most 10% (+50 ms) of jitter
    for slept, asked in zip(sleeps, [2, 3, 1, 1], strict=True):
        assert asked <= slept <= asked * 1.1 + 0.05
    assert stats.unready_waits == 4 and stats.retries == 0


def test_unready_past_max_unready_s_gives_up() -> None:
    transport, _ = scripted(*[unready("0") for _ in range(50)])
    clock = iter(range(0, 1000, 10))

    policy = RetryPolicy(max_unready_s=25)
    with (
        sync_client(transport, [], retry=policy) as client,
        pytest.MonkeyPatch.context() as patch,
    ):
        patch.setattr(time, "monotonic", lambda: float(next(clock)))
        with pytest.raises(FleetUnavailable, match="node loading for more than 25 s"):
            client.claim(1)


def test_errors_back_off_exponentially_with_jitter_then_give_up() -> None:
    transport, seen = scripted(
        httpx.ConnectError("refused"),
        httpx.Response(500, text="boom"),
        httpx.ReadTimeout("slow"),
        httpx.Response(502),
        httpx.Response(503),  # a 503 without Retry-After is an error, not "unready"
    )
    sleeps: list[float] = []
    policy = RetryPolicy(attempts=4, base_s=1.0, factor=2.0, cap_s=5.0)
    with (
        sync_client(transport, sleeps, retry=policy) as client,
        pytest.raises(FleetUnavailable, match="gave up after 4 retries"),
    ):
        client.claim(1)
    assert len(seen) == 5
    # equal jitter: within [step/2, step] for steps 1, 2, 4, then the cap 5
    for slept, step in zip(sleeps, [1, 2, 4, 5], strict=True):
        assert step / 2 <= slept <= step
    stats = client.statistics()
    assert (stats.transport_errors, stats.server_errors, stats.retries) == (2, 3, 4)


def test_jitter_spreads_a_fleet() -> None:
    policy = RetryPolicy(base_s=1.0, cap_s=100.0)
    rng = random.Random(7)
    delays = {round(backoff_delay(policy, 3, rng), 3) for _ in range(50)}
    assert len(delays) > 40
    assert all(2.0 <= delay <= 4.0 for delay in delays)


def test_429_waits_at_least_its_retry_after() -> None:
    transport, _ = scripted(httpx.Response(429, headers={"Retry-After": "4"}), ok_claim())
    sleeps: list[float] = []
    with sync_client(transport, sleeps) as client:
        assert client.claim(1) == []
    assert sleeps[0] >= 4


def test_4xx_is_raised_at_once_with_the_problem_detail() -> None:
    problem = {
        "type": "about:blank",
        "title": "Unauthorized",
        "status": 401,
        "detail": "a fleet or admin token is required",
    }
    transport, seen = scripted(
        httpx.Response(401, json=problem, headers={"content-type": "application/problem+json"})
    )
    with sync_client(transport, []) as client, pytest.raises(FleetRequestError) as caught:
        client.claim(1)
    assert len(seen) == 1
    assert caught.value.status == 401
    assert "token is required" in str(caught.value)


def test_renew_and_complete_bodies() -> None:
    lease = msgspec.convert(LEASE, Lease)
    transport, seen = scripted(
        httpx.Response(
            200, json={"results": [{"key": lease.key, "ok": True, "lease_expires_at": 9}]}
        ),
        httpx.Response(
            200, json={"results": [{"key": lease.key, "ok": False, "error": "lease_not_held"}]}
        ),
    )
    with sync_client(transport, []) as client:
        renewed = client.renew([lease], lease_s=30)
        completed = client.complete(
            [CompletionItem(key=lease.key, token=lease.token, outcome="rendered")]
        )
        assert client.renew([]) == [] and client.complete([]) == []
    assert renewed[0].ok and renewed[0].lease_expires_at == 9
    assert not completed[0].ok and completed[0].error == "lease_not_held"
    assert msgspec.json.decode(seen[0].content) == {
        "items": [{"key": lease.key, "token": "42", "lease_s": 30}]
    }
    assert msgspec.json.decode(seen[1].content) == {
        "items": [{"key": lease.key, "token": "42", "outcome": "rendered"}]
    }


def test_cancel_cuts_a_sync_wait_short() -> None:
    transport, _ = scripted(*[unready("30") for _ in range(5)])
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    client = FleetClient("http://node", transport=transport)
    with pytest.raises(FleetCancelled):  # not after five 30 s waits: the event cut in
        client.claim(1, cancel=cancel)
    client.close()


def test_parse_retry_after_forms() -> None:
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:10 GMT", now_s=1445412480.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now_s=1445412490.0) == 0.0


def test_async_client_honours_retry_after() -> None:
    calls: list[httpx.Request] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) < 3:
            return unready("0")
        return ok_claim(LEASE)

    async def go() -> list[Lease]:
        async with AsyncFleetClient(
            "http://node", transport=httpx.MockTransport(handle), worker="aw"
        ) as client:
            leases = await client.claim(2, wait_s=1)
            assert client.statistics().unready_waits == 2
            return leases

    leases = asyncio.run(go())
    assert [lease.key for lease in leases] == [LEASE["key"]]
    assert msgspec.json.decode(calls[0].content)["worker"] == "aw"


# -- against a real node --------------------------------------------------------------


@pytest.fixture
def node(tmp_path: Path) -> Iterator[object]:
    from node_harness import node_process

    with node_process(tmp_path, workers=2) as running:
        yield running


def test_real_node_503_with_retry_after_during_start_up(tmp_path: Path) -> None:
    from node_harness import thread_node, wait_for

    # The keeper starts only after the client has met the node unready, so the 503 (and
    # its Retry-After) is certain rather than a race with the first publish.
    with thread_node(tmp_path, keeper=False) as node:
        with node.client() as admin:
            admin.post("/v1/schedule", json={"upsert": [{"key": "k-start", "route": "page"}]})
        with FleetClient(node.url, worker="early") as client:
            result: list[list[Lease]] = []
            claimer = threading.Thread(target=lambda: result.append(client.claim(10)))
            claimer.start()
            wait_for(lambda: client.statistics().unready_waits > 0, 10, "a 503 waited out")
            node.start_keeper()
            claimer.join(30)
            stats = client.statistics()
    assert [lease.key for lease in result[0]] == ["k-start"]
    assert stats.unready_waits >= 1


def test_real_node_long_poll_wakes_when_a_row_comes_due(node: object) -> None:
    from node_harness import NodeProcess, claims_waiting, wait_for

    assert isinstance(node, NodeProcess)
    with FleetClient(node.url, worker="poller") as client, node.client() as admin:
        result: list[list[Lease]] = []
        poller = threading.Thread(target=lambda: result.append(client.claim(5, wait_s=30)))
        poller.start()
        # Once the claim is waiting: granted at once, it would prove nothing of the wake.
        wait_for(lambda: claims_waiting(admin), 30, "the claim to long-poll")
        response = admin.post(
            "/v1/schedule",
            json={"upsert": [{"key": "https://e.com/woken", "route": "product"}]},
        )
        assert response.status_code == 200, response.text
        poller.join(40)
    # one claim, one answer: had the publish not woken it, it would have come back empty
    # (a 503 "not ready, retry" from a keeper slowed by a loaded machine is waited out,
    # and is not an empty answer)
    assert result and [lease.key for lease in result[0]] == ["https://e.com/woken"]
    stats = client.statistics()
    assert stats.requests - stats.unready_waits == 1


def test_real_node_renewal_keeps_a_lease_past_its_first_term(tmp_path: Path) -> None:
    from node_harness import node_process, seed_rows

    seed_rows(tmp_path / "node.sqlite", 1)
    with (
        node_process(tmp_path, workers=2) as node,
        FleetClient(node.url, worker="holder") as holder,
        FleetClient(node.url, worker="rival") as rival,
    ):
        leases = holder.claim(1, lease_s=5)
        assert len(leases) == 1
        lease = leases[0]
        first_term_ends = lease.lease_expires_at
        deadline = first_term_ends + 2_500
        while time.time_ns() // 1_000_000 < deadline:
            results = holder.renew([lease], lease_s=5)
            assert results[0].ok, results
            # the rival sees nothing to claim: the key stays leased past its first term
            assert rival.claim(1, lease_s=5) == []
            time.sleep(1.5)
        assert (results[0].lease_expires_at or 0) > first_term_ends
        done = holder.complete(
            [CompletionItem(key=lease.key, token=lease.token, outcome="rendered")]
        )
        assert done[0].ok, done
        # a second completion with the same token is fenced off
        again = holder.complete(
            [CompletionItem(key=lease.key, token=lease.token, outcome="rendered")]
        )
        assert not again[0].ok and again[0].error == "lease_not_held"
