"""Full counts of the held queue from its per-(class, minute) tallies: numpy, not rows.

Due now is exact to the millisecond (the current minute's rows are read one by
one); the coming windows and the lateness bins are at minute resolution: rows
are placed by their due minute, and lateness is taken at the minute's first
millisecond, so a row is never shown less late than it is.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.queue import HeldQueue
from keeper.sites import NO_SITE_ID
from keeper.slots import NO_PLACE
from keeper.tallies import KEY_SPAN, MINUTE_MS
from shm.keys import site_of

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


def _last_minute_at_least(lateness: float, now_ms: int, cadence_ms: float) -> int:
    """The latest minute whose first millisecond is at least `lateness` cadences late."""

    def late(minute: int) -> float:
        return (now_ms - minute * MINUTE_MS) / cadence_ms  # as a row-by-row count computes it

    minute = int((now_ms - lateness * cadence_ms) // MINUTE_MS)
    while late(minute + 1) >= lateness:
        minute += 1
    while late(minute) < lateness:
        minute -= 1
    return minute


def count_queue(queue: HeldQueue, now_ms: int) -> QueueCounts:
    table = queue.classes
    tallies = queue.tallies
    buckets = queue.buckets
    n_bins = len(LATENESS_EDGES)
    now_minute = now_ms // MINUTE_MS
    paused = table.paused_mask().tolist()
    sitemap = table.sitemap_mask().tolist()
    class_ids = queue.class_ids_in_use()
    cadence = [table.get(c).cadence_s * 1000.0 for c in class_ids]

    # One pass over bucket entries for every class: the rows due in the current minute
    # (counted row by row, to the millisecond) and each class's first bucket (its
    # earliest rows, for the oldest due time).
    read: list[int] = []
    owner: list[int] = []
    is_head: list[bool] = []
    low = now_minute * MINUTE_MS
    for position, class_id in enumerate(class_ids):
        starts = buckets.starts[class_id]
        ids = buckets.ids[class_id]
        first = max(0, bisect_right(starts, low) - 1)
        end = max(bisect_left(starts, low + MINUTE_MS), first + 1)
        for bucket in ids[first:end]:
            read.append(bucket)
            owner.append(position)
            is_head.append(False)
        read.append(ids[0])
        owner.append(position)
        is_head.append(True)
    slots, which = buckets.live_of(read)
    dues = queue.slots.items()["due"][slots]
    row_owner = np.take(np.array(owner, dtype=np.intp), which)
    head = np.take(np.array(is_head, dtype=np.bool_), which)
    current = ~head & (dues // MINUTE_MS == now_minute)
    due_now = current & (dues <= now_ms)
    n_classes = len(class_ids)
    due_now_owner = row_owner[due_now]
    lateness = (now_ms - dues[due_now]) / np.take(np.array(cadence), due_now_owner)
    bins = np.searchsorted(LATENESS_EDGES, lateness, "right") - 1
    late_now = np.bincount(due_now_owner * n_bins + bins, minlength=n_classes * n_bins).reshape(
        n_classes, n_bins
    )
    rest_now = np.bincount(row_owner[current & ~due_now], minlength=n_classes)
    oldest = np.full(n_classes, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(oldest, row_owner[head], dues[head])

    # Then the tallies, every class at once: counts between minute boundaries are
    # differences of one prefix sum over all the classes' dense ranges laid end to end.
    ahead = [1, 15, *range(60, 60 * HOURS_AHEAD + 1, 60)]
    dense = [tallies.dense(c) for c in class_ids]
    bases = np.array([base for base, _ in dense], dtype=np.int64)
    lengths = np.array([len(d) for _, d in dense], dtype=np.int64)
    offsets = np.zeros(n_classes, dtype=np.int64)
    if n_classes > 1:
        np.cumsum(lengths[:-1], out=offsets[1:])
    prefix = np.zeros(int(lengths.sum()) + 1, dtype=np.int64)
    if n_classes:
        np.cumsum(np.concatenate([d for _, d in dense]), out=prefix[1:])
    del dense
    # Rows due before each boundary minute: the current minute, the coming windows,
    # and for each lateness edge the first minute less late than it.
    marks = np.empty((n_classes, 1 + len(ahead) + n_bins - 1), dtype=np.int64)
    marks[:, 0] = now_minute
    marks[:, 1 : 1 + len(ahead)] = now_minute + np.array(ahead, dtype=np.int64)
    for e, edge in enumerate(LATENESS_EDGES[1:]):
        marks[:, 1 + len(ahead) + e] = [
            min(now_minute, _last_minute_at_least(edge, now_ms, c) + 1) for c in cadence
        ]
    index = np.clip(marks - bases[:, None], 0, lengths[:, None])
    below = prefix[offsets[:, None] + index] - prefix[offsets][:, None]
    held = prefix[offsets + lengths] - prefix[offsets]
    position_of = {class_id: position for position, class_id in enumerate(class_ids)}
    for key, n in tallies.outside.items():
        class_id, minute = divmod(key, KEY_SPAN)
        row = position_of.get(class_id)
        if row is not None:
            below[row] += n * (minute < marks[row])
            held[row] += n
    past = below[:, :1]
    edges = below[:, 1 + len(ahead) :]
    late = np.concatenate((past, edges), axis=1)
    late[:, :-1] -= edges
    late += late_now
    windows = below[:, 1 : 1 + len(ahead)]
    in_15 = int((windows[:, 1] - windows[:, 0] + rest_now).sum())
    hours = windows[:, 2:] - np.concatenate((windows[:, :1], windows[:, 2:-1]), axis=1)
    by_hour = hours.sum(axis=0).tolist() if n_classes else [0] * HOURS_AHEAD
    by_hour[0] += int(rest_now.sum())
    due_of = late.sum(axis=1).tolist()
    held_of = held.tolist()
    late_of = late.tolist()
    due_total = due_sitemap = paused_due = paused_held = 0
    counted: list[ClassCounts] = []
    for position, class_id in enumerate(class_ids):
        due = due_of[position]
        if paused[class_id]:
            paused_due += due
            paused_held += held_of[position]
        else:
            due_total += due
            due_sitemap += due if sitemap[class_id] else 0
        counted.append(
            ClassCounts(
                class_id=class_id,
                held=held_of[position],
                due=due,
                oldest_due_at=int(oldest[position]) if due else None,
                lateness=late_of[position],
            )
        )
    return QueueCounts(
        at=now_ms,
        held=len(queue),
        due=due_total,
        due_sitemap=due_sitemap,
        due_discovered=due_total - due_sitemap,
        paused_due=paused_due,
        paused_held=paused_held,
        due_15m=in_15,
        due_60m=by_hour[0],
        due_24h=sum(by_hour),
        next_24h_by_hour=by_hour,
        classes=counted,
    )


def due_in_minute(queue: HeldQueue, minute: int) -> int:
    """Rows whose due time falls in `minute` (for the flow's "came due")."""
    return sum(queue.tallies.count(c, minute) for c in queue.class_ids_in_use())


def due_slots(queue: HeldQueue, now_ms: int) -> npt.NDArray[np.intp]:
    """The slots of the rows `count_queue` counts as due (due, route not paused), in one
    pass over the slot records."""
    items = queue.slots.items()
    place = items["place"].view(np.uint64)
    picked = np.flatnonzero((place != np.uint64(NO_PLACE)) & (items["due"] <= now_ms))
    paused = queue.classes.paused_mask()
    if paused.any():
        buckets = (place[picked] >> np.uint64(32)).astype(np.intp)
        class_of = np.frombuffer(queue.buckets.b_class, dtype=np.intc)
        picked = picked[~paused[class_of[buckets]]]
        del class_of
    del items, place  # a live view of the records would stop the slot table from growing
    return picked


def due_key_hashes(queue: HeldQueue, now_ms: int) -> npt.NDArray[np.uint64]:
    """The key hashes of the rows `count_queue` counts as due: what the cluster's fences
    are counted against."""
    hashes: npt.NDArray[np.uint64] = queue.slots.hashes().take(due_slots(queue, now_ms))
    return hashes


class SiteCount(msgspec.Struct, frozen=True, kw_only=True):
    site: str  # its name: shm.keys.site_of of one of its keys, under its route's pattern
    site_hash: int
    due: int  # its due rows (routes not paused)
    held: int  # its rows held
    oldest_due_at: int  # the earliest due time among its due rows


class SiteCounts(msgspec.Struct, frozen=True, kw_only=True):
    at: int
    held: int  # sites holding a row
    with_due: int  # sites with a due row
    no_site_due: int  # due rows whose key names no host (no site)
    top: list[SiteCount]  # the sites with the most due rows, most first


def count_sites(queue: HeldQueue, now_ms: int, top: int) -> SiteCounts:
    """Due rows per site, exact (the rows `count_queue` counts as due), and the `top`
    sites by due (ties: the one waiting longest first, then by site hash). One pass over
    the slot records, then numpy over the due rows' site ids (dense: a `bincount`, not a
    sort of hashes); only the listed sites are named, each from one of its due keys."""
    slots = due_slots(queue, now_ms)
    dues = queue.slots.dues().take(slots)
    ids = np.frombuffer(queue.site_ids, dtype=np.int32).take(slots)
    n_ids = queue.sites.table.slots
    per_site = np.bincount(ids, minlength=n_ids)
    earliest = np.full(n_ids, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(earliest, ids, dues)
    one_key = np.full(n_ids, -1, dtype=np.intp)
    one_key[ids] = slots  # any due row of each site: it names the site
    no_site_due = int(per_site[NO_SITE_ID])
    per_site[NO_SITE_ID] = 0
    sited = np.flatnonzero(per_site)
    hashes = queue.sites.hashes().take(sited)
    order = np.lexsort((hashes, earliest[sited], -per_site[sited]))[: max(0, top)]
    rows = [
        SiteCount(
            site=site_of(
                queue.slots.key(int(one_key[site])), queue.site_pattern_of(int(one_key[site]))
            ).decode(errors="replace"),
            site_hash=int(hashes[i]),
            due=int(per_site[site]),
            held=queue.sites.held_rows(site),
            oldest_due_at=int(earliest[site]),
        )
        for i, site in zip(order.tolist(), sited[order].tolist(), strict=True)
    ]
    return SiteCounts(
        at=now_ms, held=len(queue.sites), with_due=len(sited), no_site_due=no_site_due, top=rows
    )
