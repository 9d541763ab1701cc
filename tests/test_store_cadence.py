"""store.cadence: the adaptive cadence's decisions, pure."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from store.cadence import (
    HISTORY_LEN,
    Adaptation,
    check_adaptation,
    history_of,
    ladder,
    learn,
    next_cadence_s,
    record,
    rung_index,
    rung_of,
)

HOUR_TO_WEEK = Adaptation(min_s=3600, max_s=7 * 86400)


def test_ladder_steps_by_root_two_from_min_to_max() -> None:
    rungs = ladder(3600, 7 * 86400)
    assert rungs[0] == 3600 and rungs[-1] == 7 * 86400
    assert list(rungs) == sorted(set(rungs))
    for low, high in itertools.pairwise(rungs[:-1]):
        assert high / low == pytest.approx(math.sqrt(2), rel=0.01)
    assert len(rungs) <= 2 * math.log2(7 * 24) + 2


def test_ladder_of_small_cadences_has_distinct_rungs() -> None:
    assert ladder(1, 4) == (1, 2, 3, 4)
    assert ladder(5, 5) == (5,)


def test_rung_of_is_the_nearest_by_ratio() -> None:
    rungs = (100, 141, 200)
    assert rung_of(rungs, 50) == 0
    assert rung_of(rungs, 118) == 0  # 118/100 = 1.18 < 141/118 = 1.195
    assert rung_of(rungs, 120) == 1
    assert rung_of(rungs, 10**9) == 2


def test_defaults_are_nutch_adaptive_fetch_schedule() -> None:
    assert (HOUR_TO_WEEK.inc, HOUR_TO_WEEK.dec) == (0.4, 0.2)


def test_unchanged_climbs_one_rung_each_and_changed_comes_down() -> None:
    rungs = ladder(HOUR_TO_WEEK.min_s, HOUR_TO_WEEK.max_s)
    cadence = 3600
    seen = []
    for _ in range(5):
        cadence = next_cadence_s(HOUR_TO_WEEK, cadence, changed=False)
        seen.append(cadence)
    assert seen == list(rungs[1:6])
    assert next_cadence_s(HOUR_TO_WEEK, cadence, changed=True) == rungs[4]


def test_clamped_at_both_ends() -> None:
    assert next_cadence_s(HOUR_TO_WEEK, 3600, changed=True) == 3600
    assert next_cadence_s(HOUR_TO_WEEK, 7 * 86400, changed=False) == 7 * 86400
    assert next_cadence_s(HOUR_TO_WEEK, 60, changed=False) == ladder(3600, 7 * 86400)[1]
    assert next_cadence_s(HOUR_TO_WEEK, 10**8, changed=True) == ladder(3600, 7 * 86400)[-2]


def test_a_rate_under_half_a_rung_still_moves_one() -> None:
    slow = Adaptation(min_s=100, max_s=10_000, inc=0.05, dec=0.05)
    assert next_cadence_s(slow, 100, changed=False) == 141
    assert next_cadence_s(slow, 141, changed=True) == 100


def test_a_large_rate_moves_several_rungs() -> None:
    fast = Adaptation(min_s=100, max_s=100_000, inc=3.0, dec=0.2)
    assert rung_index(fast, next_cadence_s(fast, 100, changed=False)) == 4  # x4: two doublings


def test_learn_starts_from_the_fixed_cadence_and_keeps_history() -> None:
    first = learn(HOUR_TO_WEEK, None, 7200, 0, changed=False)
    assert first.cadence_s == ladder(3600, 7 * 86400)[3]  # 7200 is rung 2; one up
    assert history_of(first.history) == [False]
    second = learn(HOUR_TO_WEEK, first.cadence_s, 7200, first.history, changed=True)
    assert second.cadence_s == 7200
    assert history_of(second.history) == [False, True]


def test_learn_without_adaptation_records_only() -> None:
    found = learn(None, None, 3600, 0, changed=True)
    assert found.cadence_s is None and history_of(found.history) == [True]


@given(st.lists(st.booleans(), max_size=40))
def test_history_keeps_the_last_outcomes_in_order(outcomes: list[bool]) -> None:
    history = 0
    for changed in outcomes:
        history = record(history, changed)
    assert history_of(history) == outcomes[-HISTORY_LEN:]
    assert history < 1 << (HISTORY_LEN + 1)


@given(
    st.integers(1, 10**6),
    st.integers(1, 10**7),
    st.floats(0.01, 10.0),
    st.floats(0.01, 0.99),
    st.lists(st.booleans(), max_size=60),
)
def test_every_learned_cadence_is_a_rung(
    low: int, span: int, inc: float, dec: float, outcomes: list[bool]
) -> None:
    adapt = check_adaptation(Adaptation(min_s=low, max_s=low + span, inc=inc, dec=dec))
    rungs = set(ladder(adapt.min_s, adapt.max_s))
    cadence: int | None = None
    for changed in outcomes:
        cadence = learn(adapt, cadence, 86_400, 0, changed).cadence_s
        assert cadence in rungs


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"min_s": 100, "max_s": 10}, "above max_s"),
        ({"min_s": 0, "max_s": 10}, "min_s"),
        ({"min_s": 1, "max_s": 2**31}, "max_s"),
        ({"min_s": 1, "max_s": 10, "inc": 0}, "inc"),
        ({"min_s": 1, "max_s": 10, "inc": -0.5}, "inc"),
        ({"min_s": 1, "max_s": 10, "inc": 11}, "inc"),
        ({"min_s": 1, "max_s": 10, "dec": 1}, "dec"),
        ({"min_s": 1, "max_s": 10, "dec": 0}, "dec"),
        ({"min_s": 1, "max_s": 10, "dec": float("nan")}, "dec"),
        ({"min_s": 1.5, "max_s": 10}, "min_s"),
    ],
)
def test_bad_settings_are_refused(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_adaptation(Adaptation(**settings))  # type: ignore[arg-type]
