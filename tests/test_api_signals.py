"""Honest signals: the claim status (ready, draining, stalled, unready) on /readyz, claims
and /metrics; in flight without expired leases, and expired_unanswered counting them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from node_harness import local_node, now_ms

from api import admin, claims, metrics
from api.app import build_services
from api.status import claim_status, lease_view
from shm import key_hash
from store.rows import RowWrite
from wire.schemas import ClaimRequest


def render_metrics(node: Any) -> str:
    """/metrics as the node's worker serves it, with its completion queue idle."""
    return metrics.render(node, build_services(node).completions.statistics())


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Any]:
    with local_node(tmp_path / "node.sqlite") as (found, _, _):
        yield found


def seed(node: Any, count: int) -> list[str]:
    now = now_ms()
    keys = [f"https://shop.example/s/{i}" for i in range(count)]
    node.store.write(
        upsert=[
            RowWrite(key=k, route="product", next_render_at=now - 1000, cadence_s=600) for k in keys
        ]
    )
    return keys


def publish(node: Any, keys: list[str], at: int) -> None:
    node.ring.publish(
        [k.encode() for k in keys],
        np.full(len(keys), at - 1000, dtype=np.int64),
        np.zeros(len(keys), dtype=np.int32),
        np.array([key_hash(k.encode()) for k in keys], dtype=np.uint64),
        at,
        np.full(len(keys), 600, dtype=np.uint32),
    )


def claim(node: Any, n: int) -> Any:
    return asyncio.run(claims.claim(node, ClaimRequest(max=n, worker="t")))


def readyz(node: Any) -> tuple[int, dict[str, Any]]:
    response = admin.readyz(node)
    return response.status_code, json.loads(bytes(response.body))


def gauge(text: str, name: str) -> str:
    (line,) = [line for line in text.splitlines() if line.startswith(name + " ")]
    return line.split()[-1]


def test_unready_before_the_first_publish(node: Any) -> None:
    assert claim_status(node).status == "unready"
    code, body = readyz(node)
    assert code == 503 and body["status"] == "unready" and "not published" in body["reason"]
    refused = claim(node, 1)
    assert refused.status_code == 503 and json.loads(refused.body)["status"] == "unready"


def test_ready_draining_stalled(node: Any) -> None:
    keys = seed(node, 3)
    publish(node, keys, now_ms())
    code, body = readyz(node)
    assert code == 200 and body["status"] == "ready"
    granted = claim(node, 1)
    assert granted.status == "ready" and len(granted.leases) == 1
    # The keeper stops publishing: its last set still has two entries, claims drain it.
    publish(node, keys[1:], now_ms() - 10_000)
    status = claim_status(node)
    assert status.status == "draining" and status.remaining == 2
    code, body = readyz(node)
    assert code == 200 and body["status"] == "draining" and "2 entries left" in body["reason"]
    assert 'renderqueue_claim_status{status="draining"} 1' in render_metrics(node)
    drained = claim(node, 5)
    assert drained.status == "draining" and len(drained.leases) == 2
    # Drained with the keeper not publishing: nothing can be granted.
    assert claim_status(node).status == "stalled"
    code, body = readyz(node)
    assert code == 503 and body["status"] == "stalled" and "drained" in body["reason"]
    refused = claim(node, 1)
    assert refused.status_code == 503 and json.loads(refused.body)["status"] == "stalled"
    assert refused.headers["retry-after"] == "1"
    text = render_metrics(node)
    assert gauge(text, "renderqueue_ready") == "0"
    assert 'renderqueue_claim_status{status="stalled"} 1' in text
    # A publish brings it back.
    publish(node, [], now_ms())
    assert readyz(node)[1]["status"] == "ready"


def test_in_flight_leaves_out_expired_leases(node: Any) -> None:
    now = now_ms()
    live = node.leases.grant(key_hash(b"live"), now, 60_000, 600_000)
    node.leases.grant(key_hash(b"expired"), now - 10_000, 5_000, 600_000)
    assert live.expires_at > now
    # The counters alone still count the expired lease as live.
    assert node.leases.statistics().live_leases == 2
    view = lease_view(node)
    assert (view.in_flight, view.expired_unanswered) == (1, 1)
    assert view.held_keys == 1  # the expired lease reads as the hold it becomes
    text = render_metrics(node)
    assert gauge(text, "renderqueue_in_flight") == "1"
    assert gauge(text, "renderqueue_leases_expired_unanswered") == "1"
    body = json.loads(bytes(admin.queue_state(node).body))
    assert body["now"]["in_flight"] == 1 and body["now"]["leases"]["expired_unanswered"] == 1


def test_a_fresh_supervisor_census_is_used(node: Any) -> None:
    import msgspec

    now = now_ms()
    node.leases.grant(key_hash(b"a"), now, 60_000, 600_000)
    census = {"now": now, "live_leases": 1, "expired_unanswered": 0, "held_keys": 0}
    view = lease_view(node, {"lease_census": census}, now)
    assert view.source == "supervisor" and view.in_flight == 1
    stale = {**census, "now": now - 60_000}
    assert lease_view(node, {"lease_census": stale}, now).source == "worker"
    assert msgspec.to_builtins(view)["source"] == "supervisor"


@pytest.fixture
def member(tmp_path: Path) -> Iterator[tuple[Any, Any]]:
    """A cluster's node confirmed live for a minute, with a keeper statistics buffer the
    test writes: (node, segments)."""
    import dataclasses
    import time

    import msgspec

    with local_node(tmp_path / "node.sqlite", marks=True) as (found, _, segments):
        node = dataclasses.replace(
            found,
            settings=msgspec.structs.replace(found.settings, node="a", clustered=True),
            keeper_statistics=segments.keeper,
        )
        segments.marks.confirm_until(int(time.monotonic() * 1000) + 60_000)
        segments.marks.raise_lease_ceiling(now_ms() + 600_000)
        yield node, segments


def write_fences(segments: Any, *, due: int, claimable: int, until: int, **more: Any) -> None:
    """A keeper statistics record whose last count found `due` keys fenced by one awaiting
    fence on b's share, ending at `until`."""
    import msgspec
    from keeper_helpers import Rig

    from keeper.state import (
        ClusterStatistics,
        Fence,
        FenceCount,
        FencedGroup,
        encode_keeper_statistics,
    )

    now = now_ms()
    fences = [Fence(node="b", view=("a", "b"), until_ms=until, reason="awaiting")]
    cluster = ClusterStatistics(
        node="a",
        view=["a", "b"],
        generation=1,
        confirmed=True,
        confirmed_at=now,
        changes=1,
        reads=1,
        read_failures=0,
        fences=fences if until > now else [],
        fenced_until=until if until > now else 0,
        fenced=FencedGroup(
            due=due,
            until_ms=until,
            reasons=[FenceCount(node="b", reason="awaiting", due=due, until_ms=until)],
        ),
        claimable=claimable,
        counted_at=now,
    )
    record = msgspec.structs.replace(Rig().keeper.statistics(), cluster=cluster, **more)
    segments.keeper.write(encode_keeper_statistics(record), now)


def test_a_cluster_node_whose_due_keys_are_all_fenced_says_so_everywhere(
    member: tuple[Any, Any],
) -> None:
    node, segments = member
    until = now_ms() + 30_000
    write_fences(segments, due=5, claimable=0, until=until)
    publish(node, [], now_ms())
    code, body = readyz(node)
    assert code == 200 and body["status"] == "fenced"
    assert body["fenced"] == 5 and body["fenced_until"] == until
    assert "all 5 due keys of this node are fenced" in body["reason"]
    assert "gained from node 'b', until it acknowledges" in body["reason"]
    # A claim is answered, with nothing granted and why; its status is still the contract's.
    answered = claim(node, 3)
    assert answered.leases == [] and answered.status == "ready" and answered.fenced == 5
    assert answered.detail.startswith("nothing granted: all 5 due keys of this node are fenced")
    text = render_metrics(node)
    assert 'renderqueue_claim_status{status="fenced"} 1' in text
    assert gauge(text, "renderqueue_ready") == "1"
    assert gauge(text, "renderqueue_cluster_fenced_keys") == "5"
    assert float(gauge(text, "renderqueue_cluster_fence_until_seconds")) == until / 1000
    overview = admin.overview(node, build_services(node).completions.statistics())
    assert overview.status == "fenced"


def test_a_cluster_node_with_some_keys_fenced_is_ready_and_says_how_many(
    member: tuple[Any, Any],
) -> None:
    node, segments = member
    write_fences(segments, due=3, claimable=7, until=now_ms() + 30_000)
    publish(node, [], now_ms())
    code, body = readyz(node)
    assert code == 200 and body["status"] == "ready" and body["fenced"] == 3
    assert "3 of the 10 due keys of this node are fenced" in body["reason"]
    assert claim(node, 1).fenced == 3


def test_a_count_whose_fences_have_all_ended_since_says_nothing_is_fenced(
    member: tuple[Any, Any],
) -> None:
    node, segments = member
    write_fences(segments, due=5, claimable=0, until=now_ms() - 1)
    publish(node, [], now_ms())
    code, body = readyz(node)
    assert code == 200 and body["status"] == "ready" and "fenced" not in body
    answered = claim(node, 1)
    assert answered.fenced is None and answered.detail is None
    assert gauge(render_metrics(node), "renderqueue_cluster_fenced_keys") == "0"


def test_an_unconfirmed_membership_is_unready_and_says_why(member: tuple[Any, Any]) -> None:
    import time

    node, segments = member
    publish(node, [], now_ms())
    segments.marks.confirm_until(int(time.monotonic() * 1000) - 5_000)
    code, body = readyz(node)
    assert code == 503 and body["status"] == "unready"
    assert "has not confirmed it is a live member of the cluster" in body["reason"]
    refused = claim(node, 1)
    assert refused.status_code == 503 and json.loads(refused.body)["status"] == "unready"
    segments.marks.confirm_until(0)
    code, body = readyz(node)
    assert code == 503 and "not (yet) confirmed as a live member" in body["reason"]


def test_a_node_whose_lease_ceiling_ran_out_is_unready_and_says_why(
    tmp_path: Path,
) -> None:
    """Its keeper could not raise the ceiling in the database: confirmed or not, a node
    grants and renews nothing that could end past the ceiling the others may wait for."""
    import dataclasses
    import time

    import msgspec

    with local_node(tmp_path / "node.sqlite", marks=True) as (found, _, segments):
        node = dataclasses.replace(
            found, settings=msgspec.structs.replace(found.settings, node="a", clustered=True)
        )
        segments.marks.confirm_until(int(time.monotonic() * 1000) + 60_000)
        segments.marks.raise_lease_ceiling(now_ms() + 1_500)  # less than a term past the slack
        publish(node, [], now_ms())
        code, body = readyz(node)
        assert code == 503 and body["status"] == "unready"
        assert "lease ceiling has run out" in body["reason"]
        segments.marks.raise_lease_ceiling(now_ms() + 600_000)
        code, body = readyz(node)
        assert code == 200 and body["status"] == "ready"


def test_a_single_node_reads_no_fences(node: Any) -> None:
    publish(node, [], now_ms())
    code, body = readyz(node)
    assert code == 200 and body["status"] == "ready" and "fenced" not in body
    assert "renderqueue_cluster_fenced_keys" not in render_metrics(node)
