"""The keeper's decisions, with no I/O: apply events, walk chunks, repairs, selection.

The runner feeds this object what it read (feed batches, table chunks, point
reads) and a clock reading; everything here is deterministic given those, so
the logic is tested without processes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper._native import FeedShape
from keeper.classes import DEFAULT_CADENCE_S, Classifier, ClassTable, Reclassified
from keeper.config import KeeperConfig
from keeper.flow import FlowLog
from keeper.ownership import Ownership, OwnEverything, placement, placements
from keeper.queue import (
    ADDED,
    REMOVED,
    RESCHEDULED,
    TRIGGERED,
    HeldQueue,
)
from keeper.retired import RetiredRows
from keeper.select import Allowances, BlockedMask, BlockEnds, Selection
from keeper.tallies import MINUTE_MS
from keeper.walk import RepairTally, Walk, WalkReason
from shm import key_hash, key_hashes
from shm.keys import key_site_hash, key_site_hashes
from store.rows import (
    MAX_KEY_BYTES,
    FeedEvent,
    LogRecord,
    Route,
    RouteEvent,
    Row,
    RowEvent,
    SettingsEvent,
    SiteEvent,
    SiteSettings,
    row_event_from,
)

log = logging.getLogger("renderqueue.keeper")

MAX_DUE_MS = 253_402_300_800_000  # year 10000: keeps a due minute inside its bucket-key span
LOG_EVERY = 1000  # after the first few, log one unreadable row in this many
# Records apply_records leaves to the Python path are taken one at a time, until more
# than this many and more than 1 in _REFUSED_SHARE of the batch so far were: then the
# rest of their batch goes as events (KeeperCore.apply_records).
_REFUSED_ONE_BY_ONE = 8
_REFUSED_SHARE = 4
# A walked chunk, checked: encoded keys, their rows, class ids, due times, versions.
CheckedRows = tuple[
    list[bytes], Sequence[Row], npt.NDArray[np.int32], npt.NDArray[np.int64], npt.NDArray[np.int64]
]
_EMPTY = (
    np.empty(0, dtype=np.int32),
    np.empty(0, dtype=np.int64),
    np.empty(0, dtype=np.int64),
)


def _batch_keys(events: Sequence[FeedEvent]) -> tuple[list[bytes], list[int]]:
    """Each row event's key, encoded, and its hash, for the batch at once (one call into
    the hash for all of them); hash -1 marks keys to encode one by one (a bad key)."""
    try:
        keys = [
            (e.key if e.row is None else e.row.key).encode() if type(e) is RowEvent else b""
            for e in events
        ]
    except (AttributeError, UnicodeEncodeError, TypeError):
        return [b""] * len(events), [-1] * len(events)
    return keys, key_hashes(keys).tolist()


class CoreCounters(msgspec.Struct, kw_only=True):
    events: int = 0  # feed events applied (rows, routes, settings)
    row_events: int = 0
    route_events: int = 0
    settings_events: int = 0
    site_events: int = 0
    unreadable: int = 0  # rows skipped as unreadable (walks and events)
    collisions: int = 0  # walked keys whose 64-bit hash a different held key has
    unowned: int = 0  # row events for keys this node does not own
    reclassifications: int = 0  # settings changes that moved at least one class
    rows_reclassified: int = 0
    rows_resited: int = 0  # held rows whose site was taken again (a route's site pattern)
    dropped_unowned: int = 0  # rows dropped after an ownership change
    retired_events: int = 0  # row events that found their row retired


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def row_problem(row: Row) -> str | None:
    """Why the keeper cannot hold a row, or None when it can."""
    if not isinstance(row.key, str):
        return f"key is a {type(row.key).__name__}"
    try:
        size = len(row.key.encode())
    except UnicodeEncodeError:
        return "key is not valid UTF-8"
    if size == 0 or size > MAX_KEY_BYTES:
        return f"key is {size} bytes"
    if not isinstance(row.route, str) or not row.route:
        return f"route is {row.route!r}"
    if row.cadence_s is not None and (not _is_int(row.cadence_s) or row.cadence_s <= 0):
        return f"cadence_s is {row.cadence_s!r}"
    learned = row.learned_cadence_s
    if learned is not None and (not _is_int(learned) or learned <= 0):
        return f"learned_cadence_s is {learned!r}"
    if not _is_int(row.next_render_at) or not 0 <= row.next_render_at < MAX_DUE_MS:
        return f"next_render_at is {row.next_render_at!r}"
    if not _is_int(row.version) or row.version < 0:
        return f"version is {row.version!r}"
    if not isinstance(row.sitemap, bool):
        return f"sitemap is {row.sitemap!r}"
    return None


def _repairs(walk: Walk) -> bool:
    """Whether what the walk finds differing is a repair (a write the feed missed), not
    rows it loads or gains."""
    return walk.reason in ("verify", "resync")


class KeeperCore:
    def __init__(self, config: KeeperConfig, ownership: Ownership | None = None) -> None:
        self.config = config
        self.classes = ClassTable(config.sitemap_boost)
        self.classifier = Classifier(self.classes)
        self.queue = HeldQueue(self.classes)
        # Retired rows this node owns: never in the queue, counted apart (keeper.retired).
        self.retired = RetiredRows()
        # What the queue's C event path takes a feed row event to be; the classifier's
        # cache is cleared in place, never replaced.
        self._feed_shape = FeedShape(RowEvent, self.classifier.cache, MAX_DUE_MS)
        self.flow = FlowLog()
        self.ownership: Ownership = ownership if ownership is not None else OwnEverything()
        self.counters = CoreCounters()
        self.repairs = RepairTally()  # every repair ever made, by any check
        self._touched: dict[int, int] | None = None
        self._windows = 0
        self._epoch = 0
        # Rows marked for removal after an ownership change: (slots, their hashes), and
        # how many are done (see drop_unowned).
        self._unowned: tuple[npt.NDArray[np.int32], npt.NDArray[np.uint64]] | None = None
        self._unowned_done = 0
        # Sites' own settings to put in force (the site table is shared memory: the
        # runner applies them, see take_site_settings).
        self._site_settings: list[SiteSettings] = []

    # -- settings ------------------------------------------------------------------

    @property
    def routes(self) -> Mapping[str, Route]:
        return self.classifier.routes

    @property
    def default_cadence_s(self) -> int:
        return self.classifier.default_cadence_s

    def load_settings(
        self, routes: Sequence[Route], default_cadence_s: int = DEFAULT_CADENCE_S
    ) -> Reclassified:
        return self._resettle({r.route: r for r in routes}, default_cadence_s)

    def load_sites(self, sites: Sequence[SiteSettings]) -> None:
        """Every site's own settings, as the store holds them when the feed opens."""
        self._site_settings.extend(sites)

    def take_site_settings(self) -> list[SiteSettings]:
        """Site settings loaded or delivered since the last take, in order: the runner puts
        them in force in the node's site table."""
        taken, self._site_settings = self._site_settings, []
        return taken

    def apply_route(self, route: Route) -> Reclassified:
        routes = dict(self.classifier.routes)
        routes[route.route] = route
        return self._resettle(routes, self.classifier.default_cadence_s)

    def apply_default_cadence(self, seconds: int) -> Reclassified:
        return self._resettle(dict(self.classifier.routes), seconds)

    def _resettle(self, routes: dict[str, Route], default_cadence_s: int) -> Reclassified:
        """Reclassify held rows in memory: a relabel per class, never a reload; and re-site
        the rows of each route whose site pattern changed."""
        before = self.classifier.routes
        for name in before.keys() | routes.keys():
            old, new = before.get(name), routes.get(name)
            pattern = None if new is None else new.site_pattern
            if (None if old is None else old.site_pattern) != pattern:
                resited = self.queue.set_site_pattern(name, (pattern or "").encode())
                self.counters.rows_resited += resited
        self.classifier.set_settings(routes, default_cadence_s)
        plan = self.classifier.plan()
        if not plan:
            return Reclassified(classes=0, rows=0)
        sizes = self.queue.class_sizes()
        rows = 0
        for class_id, identity in plan:
            rows += int(sizes[class_id]) if class_id < len(sizes) else 0
            target = self.classes.find(identity)
            if target is None:
                self.classes.relabel(class_id, identity)
            else:
                self.queue.move_class(class_id, target)
                self.classes.forget(class_id)
        self.counters.reclassifications += 1
        self.counters.rows_reclassified += rows
        return Reclassified(classes=len(plan), rows=rows)

    # -- touch windows -------------------------------------------------------------

    def open_window(self) -> int:
        """Start recording which keys events touch; returns the window's token."""
        self._epoch += 1
        if self._touched is None:
            self._touched = {}
        self._windows += 1
        return self._epoch

    def close_window(self, token: int) -> None:
        self._windows = max(0, self._windows - 1)
        if self._windows == 0:
            self._touched = None

    def touched_since(self, h: int, token: int) -> bool:
        touched = self._touched
        return touched is not None and touched.get(h, -1) >= token

    # -- events --------------------------------------------------------------------

    def apply_events(self, events: Sequence[FeedEvent], now_ms: int) -> None:
        """Apply feed events in order; each carries current state, so replays are harmless.

        Row events between two settings events form a run, whose keys are hashed in one
        call; then row by row. (Not a numpy path for whole runs: its numpy calls per class
        cost more than the interpreted moves they would replace.)
        """
        tally = [0] * 6
        run_start = 0
        for i, event in enumerate(events):
            if type(event) is RowEvent:
                continue
            self._apply_rows(events[run_start:i], now_ms, tally)
            run_start = i + 1
            if isinstance(event, RouteEvent):
                self.counters.route_events += 1
                self.apply_route(event.route)
            elif isinstance(event, SettingsEvent):
                self.counters.settings_events += 1
                self.apply_default_cadence(event.default_cadence_s)
            elif isinstance(event, SiteEvent):
                self.counters.site_events += 1
                self._site_settings.append(event.settings)
        self._apply_rows(events[run_start:], now_ms, tally)
        self._applied(len(events), tally, now_ms)

    def apply_records(self, records: list[LogRecord], now_ms: int) -> None:
        """apply_events for a batch of row records (store.base.RowRecords, the SQLite feed
        ring's): the same decisions, made from the records themselves. Runs of held rows
        moving within their class go through one C call (QueueView.apply_records) with no
        Row or RowEvent made; a record it does not take (a new row, a delete, a retired
        row, anything doubtful) is made an event and takes the Python path; once those
        are a large share of the batch the rest goes that way too: a batch of new rows
        is not slower for having been tried in C."""
        tally = [0] * 6
        self._apply_records(records, now_ms, tally)
        self._applied(len(records), tally, now_ms)

    def _applied(self, events: int, tally: list[int], now_ms: int) -> None:
        """Count a batch of feed events and what their moves did to the queue's flow."""
        self.counters.events += events
        self.flow.add(
            now_ms,
            added=tally[ADDED],
            triggered=tally[TRIGGERED],
            rescheduled=tally[RESCHEDULED],
            removed=tally[REMOVED],
        )

    def _apply_records(self, records: list[LogRecord], now_ms: int, tally: list[int]) -> None:
        n = len(records)
        if not n:
            return
        try:
            keys = [r[2].encode() for r in records]
        except (AttributeError, UnicodeEncodeError):
            # _apply_rows sorts the bad key out, event by event
            self._apply_rows([row_event_from(r) for r in records], now_ms, tally)
            return
        hashes = key_hashes(keys)  # uint64: apply_records reads them as they are
        if not self.ownership.owns_all:
            kept = self._drop_unowned(keys, hashes, tally)
            if kept is not None:
                self.counters.row_events += n - len(kept)  # as _apply_rows counts them
                records = [records[i] for i in kept]
                hashes = hashes[kept]
                n = len(records)
        self.queue.tallies.now_minute = now_ms // MINUTE_MS
        apply_records = self.queue.apply_records
        shape, touched, epoch = self._feed_shape, self._touched, self._epoch
        i = taken = refused = 0
        while i < n:
            j = apply_records(records, i, hashes, shape, touched, epoch, now_ms, tally)
            taken += j - i
            if j > i:  # a run, ended by its end or by a bucket's rebuild or tidy
                i = j
                continue
            refused += 1
            # records[i] is not C's: it is taken by itself, as an event. Once refusals are
            # many and a large share of the batch so far, the rest goes as events (a batch
            # of new rows would otherwise pay both paths a row).
            many = refused > _REFUSED_ONE_BY_ONE and refused * _REFUSED_SHARE > i
            end = n if many else i + 1
            self._apply_rows([row_event_from(r) for r in records[i:end]], now_ms, tally)
            i = end
        self.counters.row_events += taken

    def _apply_rows(self, events: Sequence[FeedEvent], now_ms: int, tally: list[int]) -> None:
        if not events:
            return
        self.counters.row_events += len(events)
        keys, hashes = _batch_keys(events)
        # Ownership is judged for the whole batch at once; only a batch whose keys could
        # not be hashed together (-1) is judged key by key, below.
        owns = None
        by_site = self.ownership.by_site
        if not self.ownership.owns_all:
            if hashes and hashes[0] < 0:
                owns = self.ownership.owns
            else:
                events, keys, hashes = self._drop_unowned_events(events, keys, hashes, tally)
        queue = self.queue
        retired = self.retired
        # HeldQueue.upsert, unrolled: its C path first (most events move a held row
        # within its class), the rest only when that returns -1. A Python call per event
        # would be a large share of an event's budget.
        queue.tallies.now_minute = now_ms // MINUTE_MS
        moved = queue.moved
        upsert_unmoved = queue.upsert_unmoved
        class_id = self.classifier.class_id
        known = self.classifier.cache.get
        touched = self._touched
        epoch = self._epoch
        shape = self._feed_shape
        apply_moves = queue.apply_moves
        rows = events if type(events) is list else list(events)
        i, n = 0, len(rows)
        while i < n:
            # Runs of held rows moving within their class, in C; it stops at the first
            # event it does not take whole, which the loop below takes.
            i = apply_moves(rows, i, hashes, shape, touched, epoch, now_ms, tally)
            if i >= n:
                break
            event, key, h = rows[i], keys[i], hashes[i]
            i += 1
            assert type(event) is RowEvent
            row = event.row
            if h < 0:  # the batch's keys could not all be encoded at once
                try:
                    key = (event.key if row is None else row.key).encode()
                except (AttributeError, UnicodeEncodeError):
                    self._unreadable(row, "event", key=event.key)
                    continue
                h = key_hash(key)
            if touched is not None:
                touched[h] = epoch
            if row is None:
                tally[queue.remove(h)] += 1
                retired.discard(h)
                continue
            if owns is not None and not owns(placement(h, key_site_hash(key), by_site)):
                self.counters.unowned += 1
                tally[queue.remove(h)] += 1
                retired.discard(h)
                continue
            if row.retired_at is not None:
                # Never due: out of the queue, counted apart until an upsert revives it.
                if not isinstance(row.route, str) or row.key != event.key:
                    self._unreadable(row, "event")
                    continue
                self.counters.retired_events += 1
                tally[queue.remove(h)] += 1
                placed = placement(h, key_site_hash(key), True) if by_site else None
                retired.put(h, row.route, placed)
                continue
            if retired:
                retired.discard(h)
            cadence = row.scheduled_cadence_s
            due = row.next_render_at
            version = row.version
            # The checks a feed row must pass before anything changes (a bad field must
            # not leave half a row), inline: this is the per-event path.
            if not (
                type(due) is int
                and type(version) is int
                and 0 <= due < MAX_DUE_MS
                and version >= 0
                and (cadence is None or (type(cadence) is int and cadence > 0))
                and row.key == event.key
            ):
                self._unreadable(row, "event")
                continue
            try:
                cls = known((row.route, cadence, row.sitemap))
                if cls is None:
                    cls = class_id(row.route, cadence, row.sitemap)
            except TypeError:  # an unhashable field
                self._unreadable(row, "event")
                continue
            done = moved(h, cls, due, version, now_ms)
            if done < 0:
                done = upsert_unmoved(key, h, cls, due, version, now_ms)
            tally[done] += 1

    def _drop_unowned_events(
        self,
        events: Sequence[FeedEvent],
        keys: list[bytes],
        hashes: list[int],
        tally: list[int],
    ) -> tuple[Sequence[FeedEvent], list[bytes], list[int]]:
        """The batch's events for keys this node owns (`_drop_unowned`)."""
        kept = self._drop_unowned(keys, np.array(hashes, dtype=np.uint64), tally)
        if kept is None:
            return events, keys, hashes
        return [events[i] for i in kept], [keys[i] for i in kept], [hashes[i] for i in kept]

    def _drop_unowned(
        self, keys: list[bytes], hashes: npt.NDArray[np.uint64], tally: list[int]
    ) -> list[int] | None:
        """The places of the batch's keys this node owns, judged at once (None: all of
        them); a key another node owns is removed if it is held, and counted. A key's
        entries all go the same way, so each key's order is kept."""
        ownership = self.ownership
        sites = key_site_hashes(keys) if ownership.by_site else None
        owned = ownership.owns_many(placements(hashes, sites, ownership.by_site))
        if owned.all():
            return None
        queue, touched, epoch = self.queue, self._touched, self._epoch
        for h in hashes[~owned].tolist():
            if touched is not None:
                touched[h] = epoch
            self.counters.unowned += 1
            tally[queue.remove(h)] += 1
            self.retired.discard(h)
        return np.flatnonzero(owned).tolist()

    def _unreadable(self, row: Row | None, where: str, key: object = None) -> None:
        self.counters.unreadable += 1
        n = self.counters.unreadable
        if n <= 10 or n % LOG_EVERY == 0:
            shown = repr(row.key if row is not None else key)[:200]
            why = (row_problem(row) if row is not None else None) or "invalid key"
            log.warning(
                "keeper: skipped unreadable row %s from the %s (%s); %d so far",
                shown,
                where,
                why,
                n,
            )

    # -- walks ---------------------------------------------------------------------

    def begin_walk(self, reason: WalkReason, now_ms: int) -> Walk:
        judges = reason != "load" or len(self.queue) > 0
        if reason == "load":
            self.queue.buckets.begin_load()
        return Walk(reason, self.open_window(), now_ms, judges=judges)

    def apply_walked(self, walk: Walk, rows: Sequence[Row], now_ms: int) -> None:
        """Apply one chunk of a walk: rows no event touched since the walk began."""
        walk.chunks += 1
        walk.rows += len(rows)
        if rows:
            walk.after = rows[-1].key
        if any(row.retired_at is not None for row in rows):
            rows = self._walked_retired(walk, rows, now_ms)
        checked = self._check_chunk(rows)
        if checked is None:
            checked = self._check_rows(walk, rows)
        keys, good, class_ids, dues, versions = checked
        count = len(keys)
        if not count:
            return
        hashes = key_hashes(keys)
        keep = np.ones(count, dtype=np.bool_)
        ownership = self.ownership
        if not ownership.owns_all:
            sites = key_site_hashes(keys) if ownership.by_site else None
            keep &= ownership.owns_many(placements(hashes, sites, ownership.by_site))
        touched = self._touched
        if touched:
            token = walk.token
            fresh = np.fromiter(
                (touched.get(h, -1) < token for h in hashes.tolist()), dtype=np.bool_, count=count
            )
            walk.repairs.skipped_touched += int(np.count_nonzero(keep & ~fresh))
            keep &= fresh
        if self.retired:
            # Retired when the keeper last looked, in the table and not retired now: a
            # revival the feed did not deliver (the row's add below counts the repair).
            self.retired.discard_many(hashes[keep].tolist())
        slots = self.queue.slots.find_many(hashes)
        absent = np.flatnonzero(keep & (slots < 0))
        held = np.flatnonzero(keep & (slots >= 0))
        if len(absent):
            subset = len(absent) < count
            added = self.queue.add_many(
                [keys[i] for i in absent.tolist()] if subset else keys,
                hashes[absent] if subset else hashes,
                class_ids[absent] if subset else class_ids,
                dues[absent] if subset else dues,
                versions[absent] if subset else versions,
                now_ms,
            )
            walk.mark_seen(added)
            if walk.reason == "load":
                walk.loaded += len(absent)
            elif walk.reason == "membership":
                walk.repairs.gained += len(absent)
            else:
                walk.repairs.missed_added += len(absent)
            self.flow.add(now_ms, added=len(absent))
        if len(held):
            # Held rows equal to the table are the rule: compare in numpy, look closer
            # only at the ones that differ.
            held_slots = slots[held]
            records = np.take(self.queue.slots.items(), held_slots)
            b_class = np.frombuffer(self.queue.buckets.b_class, dtype=np.int32)
            held_class = b_class[records["place"] >> 32]
            differ = (
                (records["due"] != dues[held])
                | (records["version"] != versions[held])
                | (held_class != class_ids[held])
            )
            suspect = held[differ]
            if len(suspect):
                self._compare(
                    walk.repairs, [good[i] for i in suspect.tolist()], slots[suspect], now_ms
                )
            walk.mark_seen(held_slots)

    def _walked_retired(self, walk: Walk, rows: Sequence[Row], now_ms: int) -> list[Row]:
        """A walked chunk's retired rows, taken out of the queue and counted apart (unless
        an event touched them since the walk began); returns the chunk's other rows."""
        retired = [row for row in rows if row.retired_at is not None]
        keys: list[bytes] = []
        for row in retired:
            try:
                keys.append(row.key.encode())
            except (AttributeError, UnicodeEncodeError):
                keys.append(b"")
        hashed = key_hashes(keys)
        ownership = self.ownership
        sites = key_site_hashes(keys) if ownership.by_site else None
        placed = placements(hashed, sites, ownership.by_site)
        owned = (
            np.ones(len(keys), dtype=np.bool_)
            if ownership.owns_all
            else ownership.owns_many(placed)
        ).tolist()
        hashes = hashed.tolist()
        for row, key, h, own, at in zip(retired, keys, hashes, owned, placed.tolist(), strict=True):
            if not key or not isinstance(row.route, str) or not row.route:
                walk.unreadable += 1
                self._unreadable(row, f"{walk.reason} walk")
                continue
            if not own:
                continue
            if self.touched_since(h, walk.token):
                walk.repairs.skipped_touched += 1
                continue
            walk.retired_seen.add(h)
            removed = self.queue.remove(h) == REMOVED
            if removed:
                self.flow.add(now_ms, removed=1)
            if (self.retired.put(h, row.route, at) or removed) and _repairs(walk):
                walk.repairs.missed_changed += 1
        return [row for row in rows if row.retired_at is None]

    CheckedRows = tuple[
        list[bytes],
        Sequence[Row],
        npt.NDArray[np.int32],
        npt.NDArray[np.int64],
        npt.NDArray[np.int64],
    ]

    def _check_chunk(self, rows: Sequence[Row]) -> CheckedRows | None:
        """A walked chunk's columns, checked column by column; None if any row looks wrong
        (then `_check_rows` sorts the rows out one by one)."""
        if not rows:
            return [], rows, *_EMPTY
        keys_text = [r.key for r in rows]
        due_list = [r.next_render_at for r in rows]
        version_list = [r.version for r in rows]
        cadences = [r.scheduled_cadence_s for r in rows]
        routes = [r.route for r in rows]
        sitemaps = [r.sitemap for r in rows]
        if not (
            set(map(type, keys_text)) == {str}
            and set(map(type, due_list)) == {int}
            and set(map(type, version_list)) == {int}
            and set(map(type, cadences)) <= {int, type(None)}
            and set(map(type, routes)) == {str}
            and set(map(type, sitemaps)) == {bool}
            and "" not in routes
        ):
            return None
        try:
            keys = [k.encode() for k in keys_text]
            dues = np.array(due_list, dtype=np.int64)
            versions = np.array(version_list, dtype=np.int64)
            own = np.array([c if c is not None else 1 for c in cadences], dtype=np.int64)
        except (UnicodeEncodeError, OverflowError):
            return None
        sizes = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
        if (
            dues.min() < 0
            or dues.max() >= MAX_DUE_MS
            or versions.min() < 0
            or own.min() <= 0
            or sizes.min() == 0
            or sizes.max() > MAX_KEY_BYTES
        ):
            return None
        known = self.classifier.cached
        class_id = self.classifier.class_id
        ids = [known(shape) for shape in zip(routes, cadences, sitemaps, strict=True)]
        for i in [i for i, c in enumerate(ids) if c is None]:
            ids[i] = class_id(routes[i], cadences[i], sitemaps[i])
        return keys, rows, np.array(ids, dtype=np.int32), dues, versions

    def _check_rows(self, walk: Walk, rows: Sequence[Row]) -> CheckedRows:
        """Row by row: the unreadable ones are logged, counted and skipped."""
        keys: list[bytes] = []
        good: list[Row] = []
        classes: list[int] = []
        for row in rows:
            problem = row_problem(row)
            if problem is not None:
                walk.unreadable += 1
                self._unreadable(row, f"{walk.reason} walk")
                continue
            keys.append(row.key.encode())
            good.append(row)
            classes.append(self.classifier.class_of_row(row))
        return (
            keys,
            good,
            np.array(classes, dtype=np.int32),
            np.array([r.next_render_at for r in good], dtype=np.int64),
            np.array([r.version for r in good], dtype=np.int64),
        )

    def _compare(
        self, tally: RepairTally, rows: Sequence[Row], slots: npt.NDArray[np.int32], now_ms: int
    ) -> None:
        """Repair held rows that differ from the table, unless the keeper's is newer."""
        queue = self.queue
        class_id = self.classifier.class_id
        for row, slot in zip(rows, slots.tolist(), strict=True):
            key = row.key.encode()
            if queue.slots.key(slot) != key:
                self.counters.collisions += 1
                continue
            wanted = class_id(row.route, row.scheduled_cadence_s, row.sitemap)
            held_version = queue.version_of(slot)
            if (
                queue.due_of(slot) == row.next_render_at
                and held_version == row.version
                and queue.class_of(slot) == wanted
            ):
                continue
            if row.version < held_version:
                tally.held_newer += 1
                continue
            queue.upsert(key, queue.hash_of(slot), wanted, row.next_render_at, row.version, now_ms)
            tally.missed_changed += 1

    def finish_walk(self, walk: Walk, now_ms: int) -> None:
        """End a walk: held rows it never saw, and no event touched, are gone from the table."""
        if walk.done:
            return
        stale = walk.unseen(self.queue.slots.live_slots())
        removed = 0
        for slot in stale.tolist():
            if self.touched_since(self.queue.hash_of(slot), walk.token):
                continue
            self.queue.remove_slot(slot)
            removed += 1
        walk.repairs.missed_removed += removed
        if removed:
            self.flow.add(now_ms, removed=removed)
        for h in self.retired.hashes():
            if h not in walk.retired_seen and not self.touched_since(h, walk.token):
                self.retired.discard(h)
                walk.repairs.missed_removed += 1
        walk.finished_at = now_ms
        self.close_window(walk.token)
        self.repairs.add(walk.repairs)
        if walk.reason == "load":
            self.queue.buckets.end_load()
            self.queue.fit()

    def abandon_walk(self, walk: Walk) -> None:
        """Stop a walk without its sweep (e.g. the feed failed under it)."""
        if not walk.done:
            self.close_window(walk.token)
            self.repairs.add(walk.repairs)
        if walk.reason == "load":
            self.queue.buckets.end_load()

    # -- point checks --------------------------------------------------------------

    def reconcile(
        self, keys: Sequence[str], table: Mapping[str, Row], token: int, now_ms: int
    ) -> RepairTally:
        """Compare point-read rows with the held ones; repair any no event touched since."""
        tally = RepairTally()
        queue = self.queue
        for key in keys:
            encoded = key.encode()
            h = key_hash(encoded)
            if self.touched_since(h, token):
                tally.skipped_touched += 1
                continue
            row = table.get(key)
            slot = queue.slot_of(h)
            if row is None:
                if slot >= 0:
                    queue.remove_slot(slot)
                    tally.missed_removed += 1
                if self.retired.discard(h):
                    tally.missed_removed += 1
                continue
            if row_problem(row) is not None:
                self._unreadable(row, "point read")
                continue
            if row.retired_at is not None:
                if slot >= 0:
                    queue.remove_slot(slot)
                by_site = self.ownership.by_site
                placed = placement(h, key_site_hash(encoded), True) if by_site else None
                if self.retired.put(h, row.route, placed) or slot >= 0:
                    tally.missed_changed += 1
                continue
            if self.retired.discard(h):
                tally.missed_changed += 1
            if slot < 0:
                queue.upsert(
                    encoded,
                    h,
                    self.classifier.class_of_row(row),
                    row.next_render_at,
                    row.version,
                    now_ms,
                )
                tally.missed_added += 1
                continue
            self._compare(tally, [row], np.array([slot], dtype=np.int32), now_ms)
        self.repairs.add(tally)
        return tally

    # -- ownership -----------------------------------------------------------------

    def mark_unowned(self) -> int:
        """After an ownership change: mark every held row this node no longer owns, for
        drop_unowned to remove; returns how many. Marks left from an earlier change are
        replaced."""
        self._unowned, self._unowned_done = None, 0
        if self.ownership.owns_all:
            return 0
        if self.retired:
            retired = self.retired.hashes()
            placed = np.array(self.retired.placements(retired), dtype=np.uint64)
            for h in np.array(retired, dtype=np.uint64)[~self.ownership.owns_many(placed)].tolist():
                self.retired.discard(h)
        live = self.queue.slots.live_slots()
        hashes = self.queue.slots.hashes()[live]
        gone = ~self.ownership.owns_many(self.placements_of(hashes, live))
        if gone.any():
            self._unowned = (live[gone], hashes[gone])
        return int(np.count_nonzero(gone))

    def placements_of(
        self, hashes: npt.NDArray[np.uint64], slots: npt.NDArray[np.int32] | None = None
    ) -> npt.NDArray[np.uint64]:
        """What ownership is judged on for held rows (keeper.ownership.placements): their
        key hashes, or by site their hosts' sites' hashes (as an event or a walked row is
        placed: a route's site pattern does not move keys between nodes). `slots`: the
        rows' slots, when known; else found from the hashes (a hash not held is placed as
        a key with no site)."""
        if not self.ownership.by_site:
            return hashes
        if slots is None:
            slots = self.queue.slots.find_many(hashes)
        held = slots >= 0
        sites = np.zeros(len(hashes), dtype=np.uint64)
        sites[held] = self.queue.host_site_hashes(slots[held])
        return placements(hashes, sites, True)

    @property
    def dropping(self) -> bool:
        """Rows marked by mark_unowned are still held: counts are not this node's share,
        and a publish must pass over them (Publisher.blocked)."""
        return self._unowned is not None

    def drop_unowned(self, limit: int | None = None) -> int:
        """Remove up to `limit` (None: all) of the rows mark_unowned marked; returns how
        many went. A join moves a third of a node's rows at once, and removing them is a
        Python step a row: done in chunks, the keeper follows the feed in between.
        A marked slot whose hash changed meanwhile was removed by an event (and may hold
        another key now): it is passed over."""
        if self._unowned is None:
            return 0
        slots, hashes = self._unowned
        start = self._unowned_done
        end = len(slots) if limit is None else min(len(slots), start + limit)
        queue = self.queue
        removed = 0
        for slot, h in zip(slots[start:end].tolist(), hashes[start:end].tolist(), strict=True):
            if queue.hash_of(slot) == h:
                queue.remove_slot(slot)
                removed += 1
        self._unowned_done = end
        if end >= len(slots):
            self._unowned, self._unowned_done = None, 0
        self.counters.dropped_unowned += removed
        return removed

    # -- selection -----------------------------------------------------------------

    def select(
        self,
        k: int,
        now_ms: int,
        blocked: BlockedMask | None = None,
        expect_blocked: int = 0,
        allowances: Allowances | None = None,
        block_ends: BlockEnds | None = None,
    ) -> Selection:
        """The best k claimable rows; `allowances`: each site's grants left now (the
        SiteTable's, read by the caller), which limits each capped site's share;
        `block_ends`: the lease table's, to pass over leased rows for a while."""
        return self.queue.best(
            k, now_ms, blocked, expect_blocked, allowances, self.config.site_slack, block_ends
        )
