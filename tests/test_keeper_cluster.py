"""The keeper's cluster view: ownership follows the live list, and keys gained from
another node are fenced for as long as the evidence says: until the node acknowledges the
view, then only the leases it handed over; the worst case only for a node that died."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from keeper.cluster import HANDED_MARGIN_MS, ClusterView
from keeper.ownership import placements, winners
from store.rows import HandedBlock, Handover, MemberList, NodeRecord

TTL, WINDOW, LEASE = 12_000, 6_000, 30_000
T0 = 1_000_000
INCARNATIONS = {"a": 1, "b": 2, "c": 3}


def record(
    node: str,
    *,
    live: bool = True,
    age: int = 0,
    left: bool = False,
    horizon: int = 0,
    acked: tuple[int, ...] = (),
    incarnation: int | None = None,
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
        incarnation=INCARNATIONS[node] if incarnation is None else incarnation,
        acked_view=acked,
    )


def members(
    records: list[NodeRecord], now: int, handovers: list[Handover] | None = None, offset: int = 0
) -> MemberList:
    return MemberList(
        records=records, db_now_ms=now + offset, handovers=handovers or [], with_handovers=True
    )


def view(me: str, predecessor_until_ms: int = 0) -> ClusterView:
    return ClusterView(
        me,
        ttl_ms=TTL,
        grant_window_ms=WINDOW,
        max_lease_ms=LEASE,
        incarnation=INCARNATIONS[me],
        predecessor_until_ms=predecessor_until_ms,
    )


def stay(cluster: ClusterView, records: list[NodeRecord], start: int, end: int, **kw: Any) -> None:
    """Read the same list every second from `start` to `end`, as the keeper does: the node
    stays confirmed (a gap past the grant window would make it a joiner again)."""
    for at in range(start, end, 1000):
        cluster.observe(members(records, at, **kw), at)
    cluster.observe(members(records, end, **kw), end)


def everyone_acked(nodes: list[str]) -> tuple[int, ...]:
    return tuple(sorted(INCARNATIONS[n] for n in nodes))


def settled(me: str, nodes: list[str]) -> ClusterView:
    """A node that joined `nodes` long ago: its own join's fences have ended by T0."""
    cluster = view(me)
    acked = everyone_acked(nodes)
    cluster.observe(
        members([record(n, acked=acked) for n in nodes], T0 - 10 * LEASE), T0 - 10 * LEASE
    )
    stay(cluster, [record(n, acked=acked) for n in nodes], T0 - 10 * LEASE, T0)
    assert cluster.blocked_mask(KEYS, T0) is None
    return cluster


KEYS = np.random.default_rng(3).integers(0, 2**63, 20_000, dtype=np.int64).astype(np.uint64)


def test_a_single_node_owns_everything_and_fences_nothing() -> None:
    cluster = view("a")
    assert cluster.observe(members([record("a")], T0), T0)
    assert cluster.ownership.owns_all
    assert cluster.blocked_mask(KEYS, T0) is None
    assert cluster.unacknowledged  # it has a view to acknowledge


def test_a_joiner_waits_for_the_others_acknowledgement_not_for_the_worst_case() -> None:
    cluster = view("c")
    assert cluster.observe(members([record("a"), record("b"), record("c")], T0), T0)
    owned = cluster.ownership.owns_many(KEYS)
    assert 0.3 < owned.mean() < 0.37
    blocked = cluster.blocked_mask(KEYS[owned], T0 + 1000)
    assert blocked is not None and blocked.all()  # every key it owns was a or b's
    assert cluster.awaiting
    stats = cluster.statistics(T0)
    assert {f.reason for f in stats.fences} == {"awaiting"}
    assert stats.fenced_until == T0 + WINDOW + LEASE  # the worst case, should none answer
    # a acknowledges a view holding c, handing nothing over: a's keys are free at once.
    acked = everyone_acked(["a", "b", "c"])
    now = T0 + 1500
    cluster.observe(members([record("a", acked=acked), record("b"), record("c")], now), now)
    before = np.array(["a", "b"])[winners(KEYS, ["a", "b"])]
    blocked = cluster.blocked_mask(KEYS[owned], now)
    assert blocked is not None and (blocked == (before[owned] == "b")).all()
    # b too: nothing is fenced, long before the worst case.
    now += 500
    cluster.observe(
        members([record("a", acked=acked), record("b", acked=acked), record("c")], now), now
    )
    assert cluster.blocked_mask(KEYS, now) is None
    assert not cluster.awaiting


def test_a_hand_over_fences_exactly_its_keys_each_until_its_lease_ends() -> None:
    cluster = view("c")
    cluster.observe(members([record("a"), record("b"), record("c")], T0), T0)
    owned = cluster.ownership.owns_many(KEYS)
    mine = KEYS[owned]
    leased = mine[:5]
    offset = 7_000  # the database's clock runs 7 s ahead of this node's
    # Three live, one ended a margin ago (fenced no more), one long over.
    ends = [T0 + 3_000 + offset, T0 + 3_000 + offset, T0 + 9_000 + offset, T0 - 1_000 + offset, 1]
    handover = Handover(node="a", incarnation=1, key_hashes=leased.tolist(), expires_at_ms=ends)
    acked = everyone_acked(["a", "b", "c"])
    now = T0 + 100
    read = members(
        [record("a", acked=acked), record("b", acked=acked), record("c")],
        now,
        [handover],
        offset,
    )
    cluster.observe(read, now)
    blocked = cluster.blocked_mask(mine, now)
    assert blocked is not None and blocked.sum() == 3 and blocked[:3].all()
    stats = cluster.statistics(now)
    assert [(f.node, f.reason, f.keys) for f in stats.fences] == [("a", "handed over", 3)]
    # Each until its end in this node's clock and a margin past it, never early.
    ending = cluster.blocked_mask(mine, T0 + 3_000 + HANDED_MARGIN_MS - 1)
    assert ending is not None and ending.sum() == 3
    later = cluster.blocked_mask(mine, T0 + 3_000 + HANDED_MARGIN_MS)
    assert later is not None and later.sum() == 1 and later[2]
    cluster.observe(msgspec.structs.replace(read, db_now_ms=T0 + 8_000 + offset), T0 + 8_000)
    assert cluster.blocked_mask(mine, T0 + 9_000 + HANDED_MARGIN_MS) is None


def test_the_others_fence_nothing_when_a_node_joins() -> None:
    cluster = settled("a", ["a", "b"])
    assert cluster.observe(members([record("a"), record("b"), record("c")], T0 + 500), T0 + 500)
    assert cluster.blocked_mask(KEYS, T0 + 600) is None
    assert not cluster.gains  # a join only takes keys away: no walk for rows gained
    assert cluster.unacknowledged and cluster.live_incarnations() == [1, 2, 3]
    cluster.acknowledged()
    assert not cluster.unacknowledged


def test_a_restart_under_the_same_name_is_a_change_of_view() -> None:
    cluster = settled("a", ["a", "b"])
    cluster.acknowledged()
    restarted = [record("a"), record("b", incarnation=9)]
    assert not cluster.observe(members(restarted, T0 + 500), T0 + 500)  # ownership unchanged
    assert cluster.unacknowledged  # but b's new incarnation must hear a enforces it
    assert cluster.live_incarnations() == [1, 9]


def test_a_dead_nodes_keys_are_fenced_from_its_last_heartbeat_and_only_those() -> None:
    cluster = settled("a", ["a", "b", "c"])
    before = np.array(["a", "b", "c"])[winners(KEYS, ["a", "b", "c"])]
    now = T0 + 1_000
    dead = [record("a"), record("b"), record("c", live=False, age=13_000)]
    assert cluster.observe(members(dead, now), now)
    owned = cluster.ownership.owns_many(KEYS)
    assert cluster.gains
    blocked = cluster.blocked_mask(KEYS, now)
    assert blocked is not None
    assert (blocked == (before == "c")).all()  # c's keys, wherever they went
    assert owned[before == "c"].any()  # some of them came here
    end = now - 13_000 + TTL + WINDOW + LEASE
    assert cluster.statistics(now).fenced_until == end
    later = [record("a"), record("b"), record("c", live=False, age=30_000)]
    stay(cluster, later, now, end - 1)
    assert cluster.blocked_mask(KEYS, end) is None


def test_a_dead_node_with_a_published_lease_ceiling_is_fenced_until_it() -> None:
    """c published that none of its leases ends after a ceiling short of its worst case:
    its keys wait only until then (in this view's clock: the database's less the offset,
    and a margin for the clocks it crossed), and a ceiling past the worst case changes
    nothing."""
    offset = 250_000  # the database's clock runs this far ahead of this view's
    now = T0 + 1_000
    ceiling = now - 13_000 + TTL + 4_000  # well inside the worst case's LEASE
    for horizon, end in (
        (ceiling, ceiling + HANDED_MARGIN_MS),
        (now + 10 * LEASE, now - 13_000 + TTL + WINDOW + LEASE),
    ):
        cluster = settled("a", ["a", "b", "c"])
        dead = [
            record("a"),
            record("b"),
            record("c", live=False, age=13_000, horizon=horizon + offset),
        ]
        cluster.observe(members(dead, now, offset=offset), now)
        assert cluster.statistics(now).fenced_until == end
        stay(cluster, dead, now, end - 1, offset=offset)
        assert cluster.blocked_mask(KEYS, end - 1) is not None
        assert cluster.blocked_mask(KEYS, end) is None


def test_a_node_awaited_that_dies_is_fenced_by_its_worst_case() -> None:
    cluster = view("c")
    cluster.observe(members([record("a"), record("b"), record("c")], T0), T0)
    acked = everyone_acked(["a", "b", "c"])
    now = T0 + 20_000
    read = [record("a", live=False, age=15_000), record("b", acked=acked), record("c")]
    cluster.observe(members(read, now), now)
    stats = cluster.statistics(now)
    # What c gained from a when it joined (bound since then by the join's worst case) and
    # what a held when it died (its own worst case, from its last heartbeat).
    dead = [f for f in stats.fences if f.node == "a"]
    assert [f.reason for f in dead] == ["dead", "dead"]
    assert [f.until_ms for f in dead] == [T0 + WINDOW + LEASE, now - 15_000 + TTL + WINDOW + LEASE]


def test_a_node_that_left_cleanly_fences_only_what_it_handed_over() -> None:
    cluster = settled("a", ["a", "b"])
    before = np.array(["a", "b"])[winners(KEYS, ["a", "b"])]
    bs = KEYS[before == "b"]
    handover = Handover(
        node="b", incarnation=2, key_hashes=bs[:10].tolist(), expires_at_ms=[T0 + 4000] * 10
    )
    gone = [record("a"), record("b", live=False, left=True, horizon=T0 + 4000)]
    cluster.observe(members(gone, T0 + 10, [handover]), T0 + 10)
    blocked = cluster.blocked_mask(KEYS, T0 + 20)
    assert blocked is not None and blocked.sum() == 10
    assert cluster.blocked_mask(KEYS, T0 + 4000 + HANDED_MARGIN_MS) is None
    # One that left with no lease live fences nothing.
    again = settled("a", ["a", "b"])
    quiet = [record("a"), record("b", live=False, left=True, horizon=T0 - 1)]
    again.observe(members(quiet, T0 + 10), T0 + 10)
    assert again.blocked_mask(KEYS, T0 + 20) is None


def test_a_restart_whose_lease_table_was_lost_fences_its_own_share() -> None:
    cluster = view("a", predecessor_until_ms=T0 + 5_000)
    acked = everyone_acked(["a", "b"])
    cluster.observe(members([record("a"), record("b", acked=acked)], T0), T0)
    owned = cluster.ownership.owns_many(KEYS)
    blocked = cluster.blocked_mask(KEYS[owned], T0 + 1)
    assert blocked is not None and blocked.mean() > 0.9  # its own share, nearly all of it
    assert cluster.blocked_mask(KEYS[owned], T0 + 5_000) is None


def test_a_node_that_cannot_confirm_it_is_live_grants_nothing() -> None:
    cluster = settled("a", ["a", "b"])
    assert cluster.confirmed(T0 + WINDOW)
    assert cluster.confirmed_until() == T0 + WINDOW
    blocked = cluster.blocked_mask(KEYS, T0 + WINDOW + 1)
    assert blocked is not None and blocked.all()
    cluster.failed()
    assert cluster.statistics(T0 + WINDOW + 1).read_failures == 1
    # Dropped from the list (its heartbeat lapsed): it owns nothing, then rejoins fenced.
    lapsed = [record("a", live=False, age=TTL + 1), record("b")]
    assert cluster.observe(members(lapsed, T0 + 20_000), T0 + 20_000)
    assert not cluster.ownership.owns_many(KEYS).any()
    assert cluster.observe(members([record("a"), record("b")], T0 + 21_000), T0 + 21_000)
    owned = cluster.ownership.owns_many(KEYS)
    blocked = cluster.blocked_mask(KEYS[owned], T0 + 21_000)
    assert blocked is not None and blocked.all()


def test_an_acknowledgement_read_without_its_hand_over_ends_no_fence() -> None:
    cluster = view("c")
    acked = everyone_acked(["a", "b", "c"])
    read = [record("a", acked=acked), record("b", acked=acked), record("c")]
    unread = MemberList(records=read, db_now_ms=T0)  # the hand-overs were not read
    cluster.observe(unread, T0)
    owned = cluster.ownership.owns_many(KEYS)
    blocked = cluster.blocked_mask(KEYS[owned], T0)
    assert blocked is not None and blocked.all() and cluster.awaiting
    cluster.observe(members(read, T0 + 1000), T0 + 1000)
    assert cluster.blocked_mask(KEYS, T0 + 1000) is None


def test_a_node_whose_confirmation_lapsed_comes_back_as_a_joiner() -> None:
    """Its reads failed past the grant window (a database outage): the others may have
    declared it dead and leased its keys, whatever the list looks like when it returns."""
    cluster = settled("a", ["a", "b"])
    cluster.acknowledged()
    owned = cluster.ownership.owns_many(KEYS)
    back = T0 + WINDOW + 5_000
    # b saw a dead meanwhile and acknowledged a view without it: a's keys wait for b.
    without_a = (INCARNATIONS["b"],)
    cluster.observe(members([record("a"), record("b", acked=without_a)], back), back)
    blocked = cluster.blocked_mask(KEYS[owned], back)
    assert blocked is not None and blocked.all() and cluster.unacknowledged
    # b sees a back and acknowledges it, handing nothing over: a grants again.
    acked = everyone_acked(["a", "b"])
    cluster.observe(members([record("a"), record("b", acked=acked)], back + 900), back + 900)
    assert cluster.blocked_mask(KEYS[owned], back + 900) is None
    # Had b never seen it go, its acknowledgement already holds a: nothing waits.
    again = settled("a", ["a", "b"])
    again.observe(members([record("a"), record("b", acked=acked)], back), back)
    assert again.blocked_mask(KEYS, back) is None


def test_a_superseded_incarnation_is_not_live() -> None:
    cluster = settled("a", ["a", "b"])
    replaced = [record("a", incarnation=7), record("b")]
    cluster.observe(members(replaced, T0 + 100), T0 + 100)
    assert not cluster.confirmed(T0 + WINDOW + 101)
    assert not cluster.ownership.owns_many(KEYS).any()


def test_the_fenced_count_is_the_blocked_mask_by_fence() -> None:
    """c died silent and b left with ten leases handed over: the count says how many of
    the due keys each fence holds back, and in all exactly what blocked_mask blocks."""
    cluster = settled("a", ["a", "b", "c"])
    before = np.array(["a", "b", "c"])[winners(KEYS, ["a", "b", "c"])]
    handed = KEYS[before == "b"][:10]
    handover = Handover(
        node="b", incarnation=2, key_hashes=handed.tolist(), expires_at_ms=[T0 + 4000] * 10
    )
    read = [
        record("a"),
        record("b", live=False, left=True, horizon=T0 + 4000),
        record("c", live=False, age=13_000),
    ]
    cluster.observe(members(read, T0 + 10, [handover]), T0 + 10)
    now = T0 + 100
    owned = cluster.ownership.owns_many(KEYS)
    due = KEYS[owned][::2]  # the rows due now: any subset of the keys it owns
    assert cluster.fencing(now)
    counted = cluster.count_fenced(due, now)
    blocked = cluster.blocked_mask(due, now)
    assert blocked is not None and counted.due == int(blocked.sum()) > 0
    by = {(r.node, r.reason): r for r in counted.reasons}
    assert set(by) == {("b", "handed over"), ("c", "dead")}
    assert by["b", "handed over"].due == int(np.isin(due, handed).sum())
    assert (
        by["b", "handed over"].keys == 10
        and by["b", "handed over"].until_ms == T0 + 4000 + HANDED_MARGIN_MS
    )
    assert by["c", "dead"].due == int(np.isin(due, KEYS[before == "c"]).sum())
    assert by["c", "dead"].keys is None
    assert counted.until_ms == max(r.until_ms for r in counted.reasons)
    assert counted.until_ms == cluster.statistics(now).fenced_until
    # Once every fence has ended there is nothing to count, and a count finds nothing.
    end = counted.until_ms
    stay(cluster, read, now, end, handovers=[handover])
    assert not cluster.fencing(end)
    assert cluster.count_fenced(due, end).due == 0 and not cluster.count_fenced(due, end).reasons


def test_an_unconfirmed_membership_fences_every_due_key() -> None:
    cluster = settled("a", ["a", "b"])
    later = T0 + WINDOW + 1
    assert cluster.fencing(later)
    counted = cluster.count_fenced(KEYS[:100], later)
    assert counted.due == 100 and counted.until_ms == 0
    assert [(r.node, r.reason, r.due, r.until_ms) for r in counted.reasons] == [
        ("a", "unconfirmed", 100, 0)
    ]
    empty = cluster.count_fenced(KEYS[:0], later)
    assert empty.due == 0 and [r.due for r in empty.reasons] == [0]


SITES = np.random.default_rng(5).integers(1, 2**63, 40, dtype=np.int64).astype(np.uint64)


def test_owned_by_site_a_dead_nodes_sites_are_fenced_whole_and_handed_leases_count() -> None:
    """Keys placed by their site: 20,000 keys over 40 sites (and a few with none). A site
    has one owner; a dead node's fence holds back every key of its sites, wherever they
    went; a hand-over's leases on a site come back as permits to take, its blocks as
    blocks."""
    sites = SITES[np.arange(len(KEYS)) % len(SITES)]
    sites[:50] = 0  # no site: placed by the key's own hash
    placed = placements(KEYS, sites, True)
    cluster = ClusterView(
        "a",
        ttl_ms=TTL,
        grant_window_ms=WINDOW,
        max_lease_ms=LEASE,
        incarnation=1,
        by_site=True,
    )
    acked = everyone_acked(["a", "b", "c"])
    everyone = [record(n, acked=acked) for n in ("a", "b", "c")]
    cluster.observe(members(everyone, T0 - 10 * LEASE), T0 - 10 * LEASE)
    stay(cluster, everyone, T0 - 10 * LEASE, T0)
    before = np.array(["a", "b", "c"])[winners(placed, ["a", "b", "c"])]
    for site in SITES.tolist():  # one owner per site
        assert len(set(before[sites == np.uint64(site)].tolist())) == 1
    now = T0 + 1_000
    dead = [record("a", acked=acked), record("b", acked=acked), record("c", live=False, age=13_000)]
    assert cluster.observe(members(dead, now), now)
    blocked = cluster.blocked_mask(KEYS, now, lambda hashes: placements(hashes, sites, True))
    assert blocked is not None and (blocked == (before == "c")).all()
    # b leaves cleanly, handing over two leases of one of its sites and one of a key with
    # none: a permit to take for each of the site's, until its lease ends (this clock).
    of_b = [s for s in SITES.tolist() if before[sites == np.uint64(s)][0] == "b"]
    site = of_b[0]
    keys = [*KEYS[sites == np.uint64(site)][:2].tolist(), int(KEYS[0])]
    handover = Handover(
        node="b",
        incarnation=2,
        key_hashes=keys,
        expires_at_ms=[now + 4_000, now + 6_000, now + 5_000],
        site_hashes=[site, site, 0],
        blocks=[HandedBlock(site, now + 7_000, "retry_after")],
    )
    later = now + 500
    gone = [record("a"), record("b", live=False, left=True, horizon=now + 6_000), dead[2]]
    cluster.observe(members(gone, later, [handover]), later)
    [(permit_sites, ends)] = cluster.handed_permits
    assert permit_sites.tolist() == [site, site]
    assert ends.tolist() == [now + 4_000 + HANDED_MARGIN_MS, now + 6_000 + HANDED_MARGIN_MS]
    # Its block goes with it, put in force a little past its end (never early).
    assert cluster.handed_blocks == [(site, now + 7_000 + HANDED_MARGIN_MS, "retry_after")]
