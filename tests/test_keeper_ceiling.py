"""The lease ceiling's decisions: how far ahead the keeper keeps it, and when it writes."""

from __future__ import annotations

from keeper.ceiling import ASKS_WINDOW_MS, CEILING_SLACK_MS, LeaseCeiling, capped_term_ms

POLL, MAX_LEASE = 1_000, 300_000
T0 = 1_000_000


def ceiling() -> LeaseCeiling:
    return LeaseCeiling(max_lease_ms=MAX_LEASE, poll_ms=POLL)


def test_before_any_ask_the_ceiling_covers_only_the_margin_then_follows_the_asks() -> None:
    c = ceiling()
    assert c.due(T0)
    first = c.target(T0, leases_end_ms=0)
    c.published(first)
    # A node's first claims get a short term: only the margin, a step ahead.
    assert first - T0 < 10_000 and capped_term_ms(300_000, first, T0) > 0
    c.asked(30_000, T0 + POLL)
    assert c.due(T0 + POLL)
    raised = c.target(T0 + POLL, leases_end_ms=0)
    # Every lease asked for is granted whole until the keeper's next read.
    assert capped_term_ms(30_000, raised, T0 + 2 * POLL) == 30_000
    c.published(raised)
    assert not c.due(T0 + 2 * POLL)


def test_the_lead_is_the_longest_ask_of_the_last_minute_at_most_the_cap() -> None:
    c = ceiling()
    c.asked(10 * MAX_LEASE, T0)
    assert c.lead_ms() == MAX_LEASE + c.margin_ms
    c.asked(5_000, T0 + 1_000)
    assert c.lead_ms() == MAX_LEASE + c.margin_ms  # the long ask is still in the window
    c.asked(0, T0 + ASKS_WINDOW_MS + 500)  # nothing asked since: the newest ask stands
    assert c.lead_ms() == 5_000 + c.margin_ms
    c.asked(0, T0 + 10 * ASKS_WINDOW_MS)  # none in the window: the last lead is kept
    assert c.lead_ms() == 5_000 + c.margin_ms


def test_it_is_written_a_step_ahead_never_lowered_and_covers_live_leases() -> None:
    c = ceiling()
    c.asked(6_000, T0)
    target = c.target(T0, leases_end_ms=0)
    assert target > T0 + c.lead_ms()  # a step past the lead: not rewritten every read
    c.published(target)
    steps = 0
    for now in range(T0, T0 + 60_000, POLL):
        if c.due(now):
            c.published(c.target(now, leases_end_ms=0))
            steps += 1
        assert c.published_ms - now >= c.lead_ms() - POLL
    assert 0 < steps < 60  # raised every few reads, not at each
    # Shorter asks never lower it, and a live lease (one adopted from a previous run)
    # past the lead holds it up.
    c.published(T0)
    assert c.published_ms > T0
    assert c.target(T0, leases_end_ms=T0 + 10 * MAX_LEASE) == T0 + 10 * MAX_LEASE


def test_a_term_ends_by_the_ceiling_less_the_slack() -> None:
    assert capped_term_ms(30_000, T0 + 100_000, T0) == 30_000
    assert capped_term_ms(30_000, T0 + 10_000, T0) == 10_000 - CEILING_SLACK_MS
    assert capped_term_ms(30_000, 0, T0) <= 0  # none published: nothing is granted
