"""Adaptive cadence: a row's cadence follows what its renders found.

Decisions only, no I/O: the store applies them inside a completion's transaction (each
backend reads the row and its route, asks `learn`, writes what it answers), and the bench
simulates a corpus with the same functions.

A route that adapts names `{min_s, max_s, inc, dec}`. A render that found the page
unchanged lengthens the row's cadence by x(1 + inc); one that found it changed shortens it
by x(1 - dec); the result is clamped to [min_s, max_s]. The defaults are those of Apache
Nutch's AdaptiveFetchSchedule (`db.fetch.schedule.adaptive.inc_rate` 0.4 and
`dec_rate` 0.2).

Learned cadences live on a ladder: min_s, then steps of a factor sqrt(2), then max_s. The
keeper's classes are route x cadence x sitemap and its merge over class heads needs one
cadence per class, so a route's learned cadences must be few: at most
2 * log2(max_s / min_s) + 2 of them, 64 at the widest. A move is quantised to the nearest
rung (in ratio), and a move that would round back to the rung it left takes one rung in
its direction instead, so a rate smaller than half a rung still moves the row. With the
defaults every observation moves exactly one rung: x1.4 is nearest to x1.414, x0.8 to
x0.707. Why a ladder, why the store decides, why a moved ladder forgets:
docs/decisions/0013-adaptive-cadence-on-a-ladder.md.
"""

from __future__ import annotations

import bisect
import functools
import math

import msgspec

DEFAULT_INC = 0.4
DEFAULT_DEC = 0.2
LADDER_RATIO = math.sqrt(2.0)
MAX_INC = 10.0  # x11 per unchanged render: past that a ladder's top is one render away
MAX_CADENCE_S = 2**31 - 1  # as store.validate's: now + 1000 * cadence fits 64 bits
# The recent history kept per row: the last HISTORY_LEN outcomes as bits (1: changed),
# the newest lowest, under a leading 1 that marks how many there are (0: none yet).
HISTORY_LEN = 16


class Adaptation(msgspec.Struct, frozen=True, kw_only=True):
    """A route's adaptive cadence: its ladder's ends and its rates."""

    min_s: int
    max_s: int
    inc: float = DEFAULT_INC
    dec: float = DEFAULT_DEC


class Learned(msgspec.Struct, frozen=True, kw_only=True):
    """What one observation leaves on a row."""

    cadence_s: int | None  # None: the route does not adapt, nothing learned
    history: int


def check_adaptation(adapt: Adaptation, *, where: str = "adapt") -> Adaptation:
    """The settings in range, or ValueError naming the field."""
    for name in ("min_s", "max_s"):
        value = getattr(adapt, name)
        if type(value) is not int or not 1 <= value <= MAX_CADENCE_S:
            raise ValueError(
                f"{where}.{name}: must be whole seconds from 1 to {MAX_CADENCE_S}, got {value!r}"
            )
    if adapt.min_s > adapt.max_s:
        raise ValueError(f"{where}: min_s {adapt.min_s} is above max_s {adapt.max_s}")
    inc, dec = adapt.inc, adapt.dec
    if isinstance(inc, bool) or not isinstance(inc, int | float) or not 0 < inc <= MAX_INC:
        raise ValueError(f"{where}.inc: must be above 0 and at most {MAX_INC}, got {inc!r}")
    if isinstance(dec, bool) or not isinstance(dec, int | float) or not 0 < dec < 1:
        raise ValueError(f"{where}.dec: must be above 0 and below 1, got {dec!r}")
    return adapt


@functools.lru_cache(maxsize=256)
def ladder(min_s: int, max_s: int) -> tuple[int, ...]:
    """The rungs from min_s to max_s, increasing, whole seconds: min_s * sqrt(2)**k rounded,
    each distinct, then max_s."""
    rungs = [min_s]
    k = 1
    while True:
        value = round(min_s * LADDER_RATIO**k)
        if value >= max_s:
            break
        if value > rungs[-1]:
            rungs.append(value)
        k += 1
    if max_s > rungs[-1]:
        rungs.append(max_s)
    return tuple(rungs)


def rung_of(rungs: tuple[int, ...], cadence_s: float) -> int:
    """The index of the rung nearest `cadence_s` by ratio (clamped to the ladder)."""
    if cadence_s <= rungs[0]:
        return 0
    if cadence_s >= rungs[-1]:
        return len(rungs) - 1
    above = bisect.bisect_left(rungs, cadence_s)
    below = above - 1
    # Nearest in log terms: compare the ratios, not the differences.
    return above if rungs[above] / cadence_s < cadence_s / rungs[below] else below


def next_cadence_s(adapt: Adaptation, current_s: int, changed: bool) -> int:
    """The rung a row at `current_s` (on the ladder or not: it is quantised first) moves to
    after one render that found the page changed or not."""
    rungs = ladder(adapt.min_s, adapt.max_s)
    here = rung_of(rungs, current_s)
    factor = (1.0 - adapt.dec) if changed else (1.0 + adapt.inc)
    there = rung_of(rungs, rungs[here] * factor)
    if there == here:  # a rate under half a rung: still one rung in its direction
        there = max(here - 1, 0) if changed else min(here + 1, len(rungs) - 1)
    return rungs[there]


def record(history: int, changed: bool) -> int:
    """`history` with one more observation, keeping the last HISTORY_LEN."""
    bits = (max(history, 1) << 1) | int(changed)
    top = 1 << HISTORY_LEN
    if bits >= top << 1:
        bits = (bits & (top - 1)) | top
    return bits


def history_of(history: int) -> list[bool]:
    """The recorded observations, oldest first (True: changed)."""
    if history <= 1:
        return []
    count = history.bit_length() - 1
    return [bool(history >> i & 1) for i in range(count - 1, -1, -1)]


def learn(
    adapt: Adaptation | None,
    learned_s: int | None,
    fixed_s: int,
    history: int,
    changed: bool,
) -> Learned:
    """One render's observation on a row: its learned cadence (None where the route does not
    adapt) and its history. A row that learned nothing yet starts from its fixed cadence
    (its own, else its route's default, else the global one)."""
    history = record(history, changed)
    if adapt is None:
        return Learned(cadence_s=None, history=history)
    start = fixed_s if learned_s is None else learned_s
    return Learned(cadence_s=next_cadence_s(adapt, start, changed), history=history)


def rung_index(adapt: Adaptation, cadence_s: int) -> int:
    """Where a learned cadence stands on its route's ladder (0: min_s)."""
    return rung_of(ladder(adapt.min_s, adapt.max_s), cadence_s)


def forgets_learned(before: Adaptation | None, after: Adaptation | None) -> bool:
    """Whether a route's change must forget what its rows learned: their learned cadences
    are rungs of its ladder, which went, or moved its ends (new rates keep them)."""
    if before is None:
        return False
    return after is None or (after.min_s, after.max_s) != (before.min_s, before.max_s)
