"""The keeper's cluster view: ownership follows the live list, and keys gained from
another node are fenced until that node's leases on them have surely ended."""

from __future__ import annotations

import numpy as np

from keeper.cluster import ClusterView
from keeper.ownership import winners
from store.rows import NodeRecord

TTL, WINDOW, LEASE = 12_000, 6_000, 30_000
T0 = 1_000_000


def record(
    node: str, *, live: bool = True, age: int = 0, left: bool = False, horizon: int = 0
) -> NodeRecord:
    return NodeRecord(
        node=node,
        url=f"http://{node}",
        instance=node,
        started_at_ms=0,
        heartbeat_age_ms=age,
        left=left,
        live=live,
        lease_horizon_ms=horizon,
        max_lease_ms=LEASE,
    )


def view(me: str) -> ClusterView:
    return ClusterView(me, ttl_ms=TTL, grant_window_ms=WINDOW, max_lease_ms=LEASE)


def settled(me: str, nodes: list[str]) -> ClusterView:
    """A node that joined `nodes` long ago: its own join's fences have ended by T0."""
    cluster = view(me)
    cluster.observe([record(n) for n in nodes], T0 - 10 * LEASE)
    cluster.observe([record(n) for n in nodes], T0)
    assert cluster.blocked_mask(KEYS, T0) is None
    return cluster


KEYS = np.random.default_rng(3).integers(0, 2**63, 20_000, dtype=np.int64).astype(np.uint64)


def test_a_single_node_owns_everything_and_fences_nothing() -> None:
    cluster = view("a")
    assert cluster.observe([record("a")], T0)
    assert cluster.ownership.owns_all
    assert cluster.blocked_mask(KEYS, T0) is None


def test_a_node_joining_a_live_cluster_fences_its_keys_for_a_grant_window_and_a_lease() -> None:
    cluster = view("c")
    assert cluster.observe([record("a"), record("b"), record("c")], T0)
    owned = cluster.ownership.owns_many(KEYS)
    assert 0.3 < owned.mean() < 0.37
    blocked = cluster.blocked_mask(KEYS[owned], T0 + 1000)
    assert blocked is not None and blocked.all()  # every key it owns was a or b's
    end = T0 + WINDOW + LEASE
    assert cluster.statistics(T0).fenced_until == end
    cluster.observe([record("a"), record("b"), record("c")], end - 10)  # stays confirmed
    assert cluster.blocked_mask(KEYS[owned], end) is None


def test_the_others_fence_nothing_when_a_node_joins() -> None:
    cluster = settled("a", ["a", "b"])
    assert cluster.observe([record("a"), record("b"), record("c")], T0 + 500)
    assert cluster.blocked_mask(KEYS, T0 + 600) is None
    assert not cluster.gains  # a join only takes keys away: no walk for rows gained


def test_a_dead_nodes_keys_are_fenced_from_its_last_heartbeat_and_only_those() -> None:
    cluster = settled("a", ["a", "b", "c"])
    before = np.array(["a", "b", "c"])[winners(KEYS, ["a", "b", "c"])]
    now = T0 + 15_000
    assert cluster.observe([record("a"), record("b"), record("c", live=False, age=13_000)], now)
    owned = cluster.ownership.owns_many(KEYS)
    assert cluster.gains
    blocked = cluster.blocked_mask(KEYS, now)
    assert blocked is not None
    assert (blocked == (before == "c")).all()  # c's keys, wherever they went
    assert owned[before == "c"].any()  # some of them came here
    end = now - 13_000 + TTL + WINDOW + LEASE
    assert cluster.statistics(now).fenced_until == end
    cluster.observe([record("a"), record("b"), record("c", live=False, age=30_000)], end - 1)
    assert cluster.blocked_mask(KEYS, end) is None


def test_a_node_that_left_cleanly_is_fenced_until_its_last_lease_ends() -> None:
    cluster = settled("a", ["a", "b"])
    horizon = T0 + 4000
    cluster.observe([record("a"), record("b", live=False, left=True, horizon=horizon)], T0 + 10)
    blocked = cluster.blocked_mask(KEYS, T0 + 20)
    assert blocked is not None and 0.4 < blocked.mean() < 0.6
    assert cluster.blocked_mask(KEYS, horizon) is None
    # One that left with no lease live fences nothing.
    again = settled("a", ["a", "b"])
    again.observe([record("a"), record("b", live=False, left=True, horizon=T0 - 1)], T0 + 10)
    assert again.blocked_mask(KEYS, T0 + 20) is None


def test_a_node_that_cannot_confirm_it_is_live_grants_nothing() -> None:
    cluster = settled("a", ["a", "b"])
    assert cluster.confirmed(T0 + WINDOW)
    blocked = cluster.blocked_mask(KEYS, T0 + WINDOW + 1)
    assert blocked is not None and blocked.all()
    cluster.failed()
    assert cluster.statistics(T0 + WINDOW + 1).read_failures == 1
    # Dropped from the list (its heartbeat lapsed): it owns nothing, then rejoins fenced.
    assert cluster.observe([record("a", live=False, age=TTL + 1), record("b")], T0 + 20_000)
    assert not cluster.ownership.owns_many(KEYS).any()
    assert cluster.observe([record("a"), record("b")], T0 + 21_000)
    owned = cluster.ownership.owns_many(KEYS)
    blocked = cluster.blocked_mask(KEYS[owned], T0 + 21_000)
    assert blocked is not None and blocked.all()
