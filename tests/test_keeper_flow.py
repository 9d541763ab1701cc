"""Flow per minute: counts land in their minute, old minutes roll off, came-due is read once."""

from __future__ import annotations

from keeper.flow import MINUTE_MS, FlowLog

T = 1_800_000_000_000 - 1_800_000_000_000 % MINUTE_MS


def test_counts_land_in_their_minute_and_roll_off_after_an_hour() -> None:
    flow = FlowLog()
    flow.add(T, added=2, removed=1)
    flow.add(T + 59_999, triggered=3)
    flow.add(T + MINUTE_MS, rescheduled=4)
    minutes = flow.minutes(T + MINUTE_MS)
    assert len(minutes) == 60
    assert (minutes[-2].added, minutes[-2].removed, minutes[-2].triggered) == (2, 1, 3)
    assert minutes[-1].rescheduled == 4 and minutes[-1].minute_at == T + MINUTE_MS
    later = flow.minutes(T + 60 * MINUTE_MS)
    assert sum(m.added for m in later) == 0 and sum(m.rescheduled for m in later) == 4
    flow.add(T + 60 * MINUTE_MS, added=1)  # reuses the ring slot of minute T
    assert flow.minutes(T + 60 * MINUTE_MS)[-1].added == 1


def test_came_due_is_read_when_each_minute_starts_never_for_the_past_at_start() -> None:
    flow = FlowLog()
    asked: list[int] = []

    def due_in(minute: int) -> int:
        asked.append(minute)
        return minute % 7

    flow.tick(T + 5_000, due_in)
    assert asked == [T // MINUTE_MS], "at start only the current minute"
    flow.tick(T + 9_000, due_in)
    assert asked == [T // MINUTE_MS], "each minute once"
    flow.tick(T + 3 * MINUTE_MS, due_in)
    assert asked[1:] == [T // MINUTE_MS + 1, T // MINUTE_MS + 2, T // MINUTE_MS + 3]
    assert flow.minutes(T + 3 * MINUTE_MS)[-1].came_due == (T // MINUTE_MS + 3) % 7
