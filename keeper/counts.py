"""Full counts of the held queue from its per-(class, minute) tallies: numpy, not rows.

Due now is exact to the millisecond (the current minute's rows are read one by
one); the coming windows and the lateness bins are at minute resolution: rows
are placed by their due minute, and lateness is taken at the minute's first
millisecond, so a row is never shown less late than it is.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.queue import HeldQueue
from keeper.tallies import MINUTE_MS

# Lateness in cadences: a due row falls in [edge_i, edge_i+1); the last bin is open.
LATENESS_EDGES: tuple[float, ...] = (0.0, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0)
HOURS_AHEAD = 24


class ClassCounts(msgspec.Struct, frozen=True, kw_only=True):
    class_id: int
    held: int
    due: int
    oldest_due_at: int | None  # the earliest due time among the class's due rows
    lateness: list[int]  # due rows per LATENESS_EDGES bin


class QueueCounts(msgspec.Struct, frozen=True, kw_only=True):
    at: int
    held: int
    due: int  # due rows of routes not paused
    due_sitemap: int
    due_discovered: int
    paused_due: int  # due rows waiting on a paused route
    paused_held: int
    due_15m: int  # not yet due, due before the end of the 15th minute from now
    due_60m: int
    due_24h: int
    next_24h_by_hour: list[int]
    classes: list[ClassCounts]  # every class holding a row, by class id
    tallies: int  # distinct (class, minute) pairs held


def _whole(value: Any) -> int:
    """A count summed through float weights (numpy's bincount), back to an exact int."""
    return int(value + 0.5)


def _ints(values: npt.NDArray[Any]) -> list[int]:
    return [int(v) for v in np.rint(values)]


def count_queue(queue: HeldQueue, now_ms: int) -> QueueCounts:
    table = queue.classes
    n_classes = len(table)
    n_bins = len(LATENESS_EDGES)
    now_minute = now_ms // MINUTE_MS
    cadence = table.cadence_ms()
    paused = table.paused_mask()
    sitemap = table.sitemap_mask()
    t_class, t_minute, t_count = queue.tallies.columns()
    dues = queue.slots.dues()
    weights = t_count.astype(np.float64)  # freed tallies count 0 and so add nothing

    held = np.bincount(t_class, weights=weights, minlength=n_classes)
    past = t_minute < now_minute
    past_class = t_class[past]
    past_weights = weights[past]
    due = np.bincount(past_class, weights=past_weights, minlength=n_classes)
    lateness = (now_ms - t_minute[past] * MINUTE_MS) / cadence[past_class]
    bins = np.searchsorted(LATENESS_EDGES, lateness, side="right") - 1
    late = np.bincount(
        past_class * n_bins + bins, weights=past_weights, minlength=n_classes * n_bins
    ).reshape(n_classes, n_bins)

    # The current minute: due rows counted exactly, the rest go to the coming windows.
    current = t_minute == now_minute
    current_rest = 0
    for class_id in np.unique(t_class[current & (t_count > 0)]).tolist():
        member_dues = dues[queue.minute_slots(class_id, now_minute)]
        is_due = member_dues <= now_ms
        n_due = int(np.count_nonzero(is_due))
        current_rest += len(member_dues) - n_due
        if n_due:
            due[class_id] += n_due
            lat = (now_ms - member_dues[is_due]) / cadence[class_id]
            for b in (np.searchsorted(LATENESS_EDGES, lat, side="right") - 1).tolist():
                late[class_id, b] += 1

    ahead = t_minute - now_minute
    soon = (ahead >= 1) & (ahead < HOURS_AHEAD * 60)
    by_hour = np.bincount(ahead[soon] // 60, weights=weights[soon], minlength=HOURS_AHEAD)
    by_hour[0] += current_rest
    in_15 = float(weights[soon & (ahead < 15)].sum()) + current_rest

    classes: list[ClassCounts] = []
    for class_id in np.flatnonzero(held > 0.5).tolist():
        oldest = None
        if due[class_id] > 0.5:
            oldest = queue.oldest_due(class_id)
        classes.append(
            ClassCounts(
                class_id=class_id,
                held=_whole(held[class_id]),
                due=_whole(due[class_id]),
                oldest_due_at=oldest,
                lateness=_ints(late[class_id]),
            )
        )
    running = ~paused
    return QueueCounts(
        at=now_ms,
        held=len(queue),
        due=_whole(due[running].sum()),
        due_sitemap=_whole(due[running & sitemap].sum()),
        due_discovered=_whole(due[running & ~sitemap].sum()),
        paused_due=_whole(due[paused].sum()),
        paused_held=_whole(held[paused].sum()),
        due_15m=_whole(in_15),
        due_60m=_whole(by_hour[0]),
        due_24h=_whole(by_hour.sum()),
        next_24h_by_hour=_ints(by_hour),
        classes=classes,
        tallies=len(queue.tallies),
    )


def due_in_minute(queue: HeldQueue, minute: int) -> int:
    """Rows whose due time falls in `minute` (for the flow's "came due")."""
    _, t_minute, t_count = queue.tallies.columns()
    return int(t_count[t_minute == minute].sum())
