"""Each peer the bench compares hands out exactly the due rows, each once, and a completion
reschedules by cadence: the comparison is only fair if every peer does the same work."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from bench.harness.workload import Workload, due_count, generate
from bench.peers.base import Peer
from bench.sections.peers import open_claimant

ROWS = 400


def drain(make_peer: Callable[[], Peer], *, takes_our_clock: bool = True) -> None:
    workload = Workload(rows=ROWS, now_ms=time.time_ns() // 1_000_000)
    rows = generate(workload)
    due = due_count(rows, workload.now_ms)
    assert 0 < due < ROWS
    peer = make_peer()
    try:
        peer.load(rows)
        first, second = open_claimant(peer.spec()), open_claimant(peer.spec())
        now = time.time_ns() // 1_000_000
        claimed: list[str] = []
        for turn in range(ROWS):
            got = (first if turn % 2 else second).claim(7, now, 60_000)
            if not got:
                break
            claimed.extend(got)
        assert len(claimed) == len(set(claimed)), "a key was handed out twice"
        due_keys = {k for k, at in zip(rows.keys, rows.next_render_at, strict=True) if at <= now}
        assert set(claimed) == due_keys
        # Completed keys are due a cadence later, so nothing is claimable again. The first
        # batch went to `second` (turn 0), which holds those keys' leases or jobs.
        second.complete(claimed[:5], now)
        assert first.claim(10, now + 1000, 60_000) == []
        if takes_our_clock:
            # Past the lease's end the uncompleted keys are due again; the completed are not.
            later = now + 120_000
            again = first.claim(ROWS, later, 60_000)
            newly_due = {
                k for k, at in zip(rows.keys, rows.next_render_at, strict=True) if now < at <= later
            }
            assert set(again) == set(claimed[5:]) | newly_due
        first.close()
        second.close()
    finally:
        peer.drop()


def test_sqlite_index_scan_peer() -> None:
    from bench.peers.sql import SqlitePeer

    drain(SqlitePeer)


def test_postgres_skip_locked_peer(postgres_dsn: str) -> None:
    from bench.peers.sql import PostgresPeer

    drain(lambda: PostgresPeer(postgres_dsn))


def test_redis_sorted_set_peer(redis_url: str) -> None:
    from bench.peers.redis import RedisPeer

    drain(lambda: RedisPeer(redis_url))


def test_pgqueuer_peer(postgres_dsn: str) -> None:
    from bench.peers.pgqueuer import PgQueuerPeer

    # PgQueuer reads the database's clock (NOW()), so its leases can't be run forward.
    drain(lambda: PgQueuerPeer(postgres_dsn), takes_our_clock=False)


@pytest.mark.parametrize("fraction", [0.0, 0.2])
def test_workload_due_share(fraction: float) -> None:
    workload = Workload(rows=20_000, now_ms=1_700_000_000_000, due_fraction=fraction)
    rows = generate(workload)
    share = due_count(rows, workload.now_ms) / len(rows)
    assert abs(share - fraction) < 0.02
    assert all(70 <= len(key) <= 90 for key in rows.keys[:100])
