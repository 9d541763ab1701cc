"""A key whose renders always fail: its retries space out (2 lease lengths, then 4, 8, ...
capped at its cadence), counted and explained; then it renders and the backoff resets.

The API's clock is moved by the test; the ring is published as the keeper would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from node_harness import local_node, now_ms

import api.admin
import api.claims
import api.completions
import api.status
from api import admin, metrics
from api.app import build_services
from api.claims import grant_from_ring
from api.completions import apply
from shm import key_hash
from store.rows import RowWrite
from wire.schemas import CompletionsRequest, RenderNow


def render_metrics(node: Any) -> str:
    """/metrics as the node's worker serves it, with its completion queue idle."""
    return metrics.render(node, build_services(node).completions.statistics())


KEY = "https://shop.example/always-fails"
LEASE_MS = 30_000
CADENCE_S = 300  # caps the hold: 60, 120, 240, then 300 s


class Clock:
    def __init__(self) -> None:
        self.now = now_ms()

    def __call__(self) -> int:
        return self.now


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, Clock]]:
    clock = Clock()
    for module in (api.claims, api.completions, api.admin, api.status):
        monkeypatch.setattr(module, "now_ms", clock)
    with local_node(tmp_path / "node.sqlite") as (node, _, _):
        node.store.write(
            upsert=[
                RowWrite(
                    key=KEY, route="product", next_render_at=clock.now - 1000, cadence_s=CADENCE_S
                )
            ]
        )
        yield node, clock


def publish(node: Any, now: int) -> None:
    """The keeper's publish: the key, if it is not held (the keeper skips blocked keys)."""
    hashed = key_hash(KEY.encode())
    blocked = node.leases.blocked_mask(np.array([hashed], dtype=np.uint64), now)[0]
    keys = [] if blocked else [KEY.encode()]
    node.ring.publish(
        keys,
        np.full(len(keys), now - 1000, dtype=np.int64),
        np.zeros(len(keys), dtype=np.int32),
        np.full(len(keys), hashed, dtype=np.uint64),
        now,
        np.full(len(keys), CADENCE_S, dtype=np.uint32),
    )


def claim(node: Any, clock: Clock) -> list[Any]:
    publish(node, clock.now)
    return grant_from_ring(node, 1, LEASE_MS)


def complete(node: Any, lease: Any, outcome: str) -> Any:
    item = {"key": lease.key, "token": lease.token, "outcome": outcome}
    request = msgspec.convert({"items": [item]}, CompletionsRequest)
    ((result,),) = [answer.results for answer in apply(node, [request], wait=True)]
    return result


def test_retries_space_out_then_a_render_resets(setup: tuple[Any, Clock]) -> None:
    node, clock = setup
    waits = []
    for attempt in range(1, 6):
        (lease,) = claim(node, clock)
        failed_at = clock.now
        result = complete(node, lease, "failed")
        assert result.ok and result.held_until is not None
        waits.append((result.held_until - failed_at) // 1000)
        explained = admin.explain(node, KEY)
        assert explained.state == "held" and explained.held_for == "failed"
        assert explained.attempts_in_a_row == attempt
        assert "renders failed" in explained.reason
        # Held: not published, not claimable, until the hold ends.
        clock.now = result.held_until - 1
        assert claim(node, clock) == []
        clock.now = result.held_until
    # 2 lease lengths, then 4, 8, capped at the cadence.
    assert waits == [60, 120, 240, 300, 300]
    # The row stayed due all along: a failure does not reschedule it.
    row = node.store.get(KEY)
    assert row.last_outcome == "failed" and row.next_render_at < clock.now
    assert node.leases.statistics().failures == 5
    assert "renderqueue_failure_backoffs_total 5" in render_metrics(node)
    # It renders: rescheduled by its cadence, and the misses are forgiven.
    (lease,) = claim(node, clock)
    assert complete(node, lease, "rendered").ok
    state = node.leases.state(key_hash(KEY.encode()), clock.now)
    assert state.misses == 0 and not state.held
    assert node.store.get(KEY).next_render_at == clock.now + CADENCE_S * 1000
    # Due again, it fails once more: the backoff starts over at 2 lease lengths.
    clock.now += CADENCE_S * 1000
    (lease,) = claim(node, clock)
    result = complete(node, lease, "failed")
    assert result.held_until - clock.now == 2 * LEASE_MS


def test_render_now_ends_the_hold(setup: tuple[Any, Clock]) -> None:
    node, clock = setup
    (lease,) = claim(node, clock)
    complete(node, lease, "failed")
    assert claim(node, clock) == []
    explained = admin.render_now(node, RenderNow(key=KEY))
    assert explained.state == "claimable" and explained.attempts_in_a_row is None
    assert node.leases.statistics().forgiven == 1
    (again,) = claim(node, clock)
    assert again.key == KEY


def test_a_stale_token_cannot_fail_a_key(setup: tuple[Any, Clock]) -> None:
    node, clock = setup
    (lease,) = claim(node, clock)
    assert complete(node, lease, "rendered").ok
    stale = complete(node, lease, "failed")
    assert not stale.ok and stale.error == "lease_not_held"
    assert node.leases.statistics().failures == 0


def test_the_lease_table_alone(tmp_path: Path) -> None:
    """LeaseTable.fail without the API: the same spacing, from the hold word."""
    from node_harness import unique

    from shm import Grant, LeaseTable

    table = LeaseTable.create("/" + unique("bf"), 1024)
    try:
        hashed, now, holds = key_hash(b"k"), 1_000_000, []
        for _ in range(6):
            granted = table.grant(hashed, now, 5_000, 60_000)
            assert type(granted) is Grant
            until = table.fail(hashed, granted.token, now + 1)
            assert until is not None
            holds.append(until - now - 1)
            assert table.grant(hashed, until - 1, 5_000, 60_000).reason == "held"  # type: ignore[union-attr]
            assert table.fail(hashed, granted.token, now + 2) is None  # stale now
            now = until
        assert holds == [10_000, 20_000, 40_000, 60_000, 60_000, 60_000]
        assert table.census(now - 1).held_keys == 1
        assert table.statistics().held_keys == 1
    finally:
        table.close()
        table.unlink()
