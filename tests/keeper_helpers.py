"""Shared by the keeper tests: plain in-memory stand-ins for the store and shared memory.

They implement the same protocols as the real ones (store.base.ScheduleStore,
keeper.protocols), with no mocking: a dict table with a change log whose
events carry current state, a ring that keeps what was published, a lease
table that is a dict of blocked hashes, a state buffer that keeps payloads.
Knobs let a test fail the feed, write without logging (a missed write), or
run a hook inside a walk (an event landing mid-walk).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.config import KeeperConfig
from keeper.core import KeeperCore
from keeper.protocols import SiteTableLike
from keeper.runner import Keeper
from keeper.state import QueueState, decode_queue_state
from store.base import (
    Cursor,
    CursorAhead,
    CursorBelowFloor,
    FeedBatch,
    FeedStatistics,
    RowsRead,
    StoreCounters,
    Writability,
)
from store.cadence import Adaptation
from store.rows import (
    Completion,
    FeedEvent,
    NodeRecord,
    Route,
    RouteEvent,
    Row,
    RowEvent,
    RowWrite,
    SettingsEvent,
    SiteEvent,
    SiteSettings,
)

NOW = 1_800_000_000_000
Hashes = npt.NDArray[np.uint64]
ROUTES = ["product", "category", "home"]


def core_with_dues(dues: list[int], config: KeeperConfig | None = None) -> KeeperCore:
    """A keeper holding /p/0, /p/1, ... due at NOW + each due (ms), over three routes,
    every fourth from a sitemap."""
    core = KeeperCore(config or KeeperConfig())
    core.apply_events(
        [
            RowEvent(
                key=f"/p/{i}",
                row=Row(
                    key=f"/p/{i}",
                    route=ROUTES[i % 3],
                    cadence_s=None,
                    sitemap=i % 4 == 0,
                    next_render_at=NOW + due,
                    version=i + 1,
                ),
            )
            for i, due in enumerate(dues)
        ],
        NOW,
    )
    return core


class ManualClock:
    def __init__(self, at: int = NOW) -> None:
        self.at = at

    def __call__(self) -> int:
        return self.at

    def advance(self, ms: int) -> None:
        self.at += ms


class MemorySubscription:
    def __init__(self, store: MemoryStore, position: int) -> None:
        self._store = store
        self.position = position
        self.closed = False
        self.polls = self.events = 0
        self.woken = self.timeouts = 0  # waits that found the log ahead, or did not

    @property
    def cursor(self) -> Cursor:
        return Cursor(token=str(self.position))

    def poll(self, limit: int = 1000) -> FeedBatch:
        store = self._store
        store.polls += 1
        if self.closed:
            raise RuntimeError("poll on a closed subscription")
        if store.fail_polls:
            store.fail_polls -= 1
            raise ConnectionError("feed failed (test)")
        entries = store.log[self.position : self.position + limit]
        self.position += len(entries)
        self.polls += 1
        self.events += len(entries)
        return FeedBatch(
            events=[store.current(e) for e in entries],
            cursor=self.cursor,
            more=len(entries) == limit,
        )

    def wait(self, timeout_s: float) -> bool:
        more = self.position < len(self._store.log)
        if more:
            self.woken += 1
        else:
            self.timeouts += 1
        return more

    def quiet(self) -> bool:
        return False

    def has_delivered(self, cursor: Cursor) -> bool:
        return self.position >= int(cursor.token)

    def delivered_below(self) -> int:
        return self.position + 1

    def save(self) -> None:
        self._store.saved[self._store.consumer] = self.position

    def statistics(self) -> FeedStatistics:
        return FeedStatistics(
            polls=self.polls,
            events=self.events,
            log_entries=self.events,
            coalesced=0,
            woken=self.woken,
            noticed=0,
            timeouts=self.timeouts,
        )

    def close(self) -> None:
        self.closed = True


class MemoryStore:
    """A schedule table with a change log; delivery re-reads the current row."""

    remote = False
    membership = None  # a node alone

    def __init__(self) -> None:
        self.rows: dict[str, Row] = {}
        self.route_table: dict[str, Route] = {}
        self.default_cadence = 86_400
        self.site_table: dict[str, SiteSettings] = {}
        self.log: list[tuple[str, str]] = []  # (kind, key or route name)
        self.floor = 0  # entries below this were pruned
        self.seq = 0
        self.saved: dict[str, int] = {}
        self.consumer = "keeper"
        self.fail_polls = 0
        self.polls = 0  # polls made by its subscriptions
        self.fail_subscribes = 0
        self.walk_hook: Callable[[str | None], None] | None = None
        self.walks = 0

    # -- writing ---------------------------------------------------------------------

    @property
    def write_position(self) -> int:
        return self.seq

    def write(self, upsert: Sequence[RowWrite] = (), delete: Sequence[str] = ()) -> None:
        for w in upsert:
            self.seq += 1
            self.rows[w.key] = Row(
                key=w.key,
                route=w.route,
                cadence_s=w.cadence_s,
                sitemap=w.sitemap,
                next_render_at=w.next_render_at,
                version=self.seq,
            )
            self.log.append(("row", w.key))
        for key in delete:
            self.seq += 1
            self.rows.pop(key, None)
            self.log.append(("row", key))

    def put(self, key: str, due: int, route: str = "product", **fields: object) -> None:
        self.write([RowWrite(key=key, route=route, next_render_at=due, **fields)])  # type: ignore[arg-type]

    def retire(self, key: str, at: int) -> None:
        """Retire a row as a streak of not_found outcomes would (logged)."""
        self.seq += 1
        self.rows[key] = msgspec.structs.replace(
            self.rows[key], retired_at=at, retired_reason="not_found", version=self.seq
        )
        self.log.append(("row", key))

    def silent(self, row: Row | None, key: str | None = None) -> None:
        """Change the table with no log entry: a write the feed never delivers."""
        if row is None:
            assert key is not None
            self.rows.pop(key, None)
            return
        self.seq += 1
        self.rows[row.key] = msgspec.structs.replace(row, version=self.seq)

    def complete(self, items: Sequence[Completion], *, wait: bool = True) -> list[Row | None]:
        raise NotImplementedError

    def set_route(
        self,
        route: str,
        *,
        default_cadence_s: int | None = None,
        paused: bool | None = None,
        clear_default_cadence: bool = False,
        adapt: Adaptation | None = None,
        clear_adapt: bool = False,
        site_pattern: str | None = None,
        clear_site_pattern: bool = False,
        retire_after: int | None = None,
    ) -> Route:
        old = self.route_table.get(route, Route(route=route))
        new = Route(
            route=route,
            default_cadence_s=None
            if clear_default_cadence
            else default_cadence_s
            if default_cadence_s is not None
            else old.default_cadence_s,
            paused=paused if paused is not None else old.paused,
            adapt=None if clear_adapt else adapt if adapt is not None else old.adapt,
            site_pattern=None
            if clear_site_pattern
            else site_pattern
            if site_pattern is not None
            else old.site_pattern,
        )
        self.route_table[route] = new
        self.log.append(("route", route))
        return new

    def set_default_cadence_s(self, seconds: int) -> None:
        self.default_cadence = seconds
        self.log.append(("settings", ""))

    def set_site(self, settings: SiteSettings) -> SiteSettings | None:
        if settings.empty:
            self.site_table.pop(settings.site, None)
        else:
            self.site_table[settings.site] = settings
        self.log.append(("site", settings.site))
        return None if settings.empty else settings

    # -- reading ---------------------------------------------------------------------

    def current(self, entry: tuple[str, str]) -> FeedEvent:
        kind, name = entry
        if kind == "row":
            return RowEvent(key=name, row=self.rows.get(name))
        if kind == "route":
            return RouteEvent(route=self.route_table[name])
        if kind == "site":
            return SiteEvent(settings=self.site_table.get(name) or SiteSettings(site=name))
        return SettingsEvent(default_cadence_s=self.default_cadence)

    def get(self, key: str) -> Row | None:
        return self.rows.get(key)

    def get_many(self, keys: Sequence[str]) -> dict[str, Row]:
        return {k: self.rows[k] for k in keys if k in self.rows}

    def get_many_at(self, keys: Sequence[str]) -> RowsRead:
        return RowsRead(rows=list(self.get_many(keys).values()), head=self.feed_head())

    def walk_at(self, after: str | None, limit: int) -> RowsRead:
        return RowsRead(rows=self.walk(after, limit), head=self.feed_head())

    def walk(self, after: str | None, limit: int) -> list[Row]:
        self.walks += 1
        if self.walk_hook is not None:
            self.walk_hook(after)
        keys = sorted(self.rows)
        start = 0 if after is None else bisect.bisect_right(keys, after)
        return [self.rows[k] for k in keys[start : start + limit]]

    def retired(self, after: str | None = None, limit: int = 100) -> list[Row]:
        keys = [k for k in sorted(self.rows) if after is None or k > after]
        return [self.rows[k] for k in keys if self.rows[k].retired_at is not None][:limit]

    def count(self) -> int:
        return len(self.rows)

    def routes(self) -> list[Route]:
        return list(self.route_table.values())

    def default_cadence_s(self) -> int:
        return self.default_cadence

    def sites(self) -> list[SiteSettings]:
        return sorted(self.site_table.values(), key=lambda s: s.site)

    def get_site(self, site: str) -> SiteSettings | None:
        return self.site_table.get(site)

    def hash_secret(self) -> bytes:
        return b"memory-store-key"

    def feed_head(self) -> Cursor:
        return Cursor(token=str(len(self.log)))

    def subscribe(self, consumer: str, cursor: Cursor | None = None) -> MemorySubscription:
        if self.fail_subscribes:
            self.fail_subscribes -= 1
            raise ConnectionError("subscribe failed (test)")
        self.consumer = consumer
        position = int(cursor.token) if cursor is not None else self.saved.get(consumer, 0)
        if position < self.floor:
            raise CursorBelowFloor(f"{position} < {self.floor}")
        if position > len(self.log):
            raise CursorAhead(f"{position} > {len(self.log)}")
        return MemorySubscription(self, position)

    def writability(self) -> Writability:
        return Writability(writable=True, refused=0)

    def counters(self) -> StoreCounters:
        return StoreCounters(
            writability=self.writability(), transactions=0, rows_written=0, busy_refused=0
        )

    def close(self) -> None:
        pass


class MemoryRing:
    def __init__(self) -> None:
        self.generation = 0
        self.published_at = 0
        self.keys: list[bytes] = []
        self.due_at: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self.cadence_s: npt.NDArray[np.uint32] = np.empty(0, dtype=np.uint32)
        self.site_hash: npt.NDArray[np.uint64] = np.empty(0, dtype=np.uint64)
        self.taken = 0  # entries of the live generation claimed (by `take`)
        self.fail = False

    def take(self, n: int) -> list[bytes]:
        """What a claimant's ReadyRing.claim would take."""
        taken = self.keys[self.taken : self.taken + n]
        self.taken += len(taken)
        return taken

    def remaining(self) -> int:
        return len(self.keys) - self.taken

    def published_count(self) -> int:
        return len(self.keys)

    def publish(
        self,
        keys: Sequence[bytes],
        due_at: npt.NDArray[np.int64],
        class_id: npt.NDArray[np.int32],
        key_hash: npt.NDArray[np.uint64],
        now_ms: int,
        cadence_s: npt.NDArray[np.uint32] | None = None,
        site_hash: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        if self.fail:
            raise OSError("ring unavailable (test)")
        assert len(keys) == len(due_at) == len(class_id) == len(key_hash)
        assert cadence_s is not None and len(cadence_s) == len(keys)
        assert site_hash is None or len(site_hash) == len(keys)
        self.keys = list(keys)
        self.due_at = due_at.copy()
        self.cadence_s = cadence_s.copy()
        self.site_hash = (
            np.zeros(len(keys), dtype=np.uint64) if site_hash is None else site_hash.copy()
        )
        self.taken = 0
        self.published_at = now_ms
        self.generation += 1
        return self.generation

    def publish_slices(
        self,
        source: bytearray,
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        due_at: npt.NDArray[np.int64],
        class_id: npt.NDArray[np.int32],
        key_hash: npt.NDArray[np.uint64],
        now_ms: int,
        cadence_s: npt.NDArray[np.uint32] | None = None,
        site_hash: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        pairs = zip(starts.tolist(), lengths.tolist(), strict=True)
        keys = [bytes(source[s : s + n]) for s, n in pairs]
        return self.publish(keys, due_at, class_id, key_hash, now_ms, cadence_s, site_hash)


class LeaseStats(msgspec.Struct, frozen=True):
    live_leases: int = 0
    held_keys: int = 0
    hold_events: int = 0
    refusals_taken: int = 0
    refusals_held: int = 0
    refusals_probe_full: int = 0


class MemoryLeases:
    """Blocked hashes (leased or held), as the lease table's blocked_mask reports them.
    `ends`: a blocked hash's end, where a test gives one (blocked_until); a hash without
    reads as blocked for the next millisecond, so every publish asks again."""

    def __init__(self) -> None:
        self.blocked: set[int] = set()
        self.ends: dict[int, int] = {}

    def blocked_mask(
        self, key_hashes: npt.NDArray[np.uint64], now_ms: int
    ) -> npt.NDArray[np.bool_]:
        return np.fromiter(
            (int(h) in self.blocked for h in key_hashes), dtype=np.bool_, count=len(key_hashes)
        )

    def blocked_until(
        self, key_hashes: npt.NDArray[np.uint64], now_ms: int
    ) -> npt.NDArray[np.int64]:
        return np.fromiter(
            (
                self.ends.get(int(h), now_ms + 1) if int(h) in self.blocked else 0
                for h in key_hashes
            ),
            dtype=np.int64,
            count=len(key_hashes),
        )

    def statistics(self, now_ms: int | None = None) -> LeaseStats:
        return LeaseStats(live_leases=len(self.blocked))

    def live_leases(self, now_ms: int) -> tuple[Hashes, npt.NDArray[np.int64], Hashes, Hashes]:
        """Every blocked hash as a lease that ends in a minute (what a hand-over sends),
        of no site, its token its place in the list plus one."""
        hashes = np.array(sorted(self.blocked), dtype=np.uint64)
        ends = np.full(len(hashes), now_ms + 60_000, dtype=np.int64)
        tokens = np.arange(1, len(hashes) + 1, dtype=np.uint64)
        return hashes, ends, np.zeros(len(hashes), dtype=np.uint64), tokens


class MemoryStateBuffer:
    def __init__(self) -> None:
        self.writes: list[tuple[bytes, int]] = []

    def write(self, payload: bytes, now_ms: int) -> int:
        self.writes.append((payload, now_ms))
        return len(self.writes)

    def last(self) -> bytes:
        return self.writes[-1][0]


RIG_CONFIG = KeeperConfig(
    walk_chunk=10, load_chunk=10, best_k=100, verify_interval_s=3600, top_check=5
)


class Rig:
    """A Keeper over the stand-ins below on a manual clock, stepped by hand."""

    def __init__(
        self,
        rows: int = 35,
        config: KeeperConfig = RIG_CONFIG,
        site_table: SiteTableLike | None = None,
    ) -> None:
        self.clock = ManualClock()
        self.store = MemoryStore()
        for i in range(rows):
            self.store.put(f"/k{i:03}", NOW - 1000 * i)
        self.ring = MemoryRing()
        self.leases = MemoryLeases()
        self.state = MemoryStateBuffer()
        self.statistics = MemoryStateBuffer()  # the keeper's statistics records
        self.site_list = MemoryStateBuffer()  # the sites listings
        self.keeper = Keeper(
            self.store,
            self.ring,
            self.leases,
            self.state,
            config,
            node="n1",
            clock=self.clock,
            statistics_buffer=self.statistics,
            site_list_buffer=self.site_list,
            site_table=site_table,
        )

    def states(self) -> list[QueueState]:
        return [decode_queue_state(payload) for payload, _ in self.state.writes]

    def last(self) -> QueueState:
        return decode_queue_state(self.state.last())

    def steps(self, n: int, advance_ms: int = 0) -> None:
        for _ in range(n):
            self.clock.advance(advance_ms)
            self.keeper.step()

    def held(self) -> dict[str, tuple[int, int]]:
        queue = self.keeper.core.queue
        return {
            r.key: (r.due_at, r.version)
            for r in (queue.held_slot(s) for s in queue.slots.live_slots().tolist())
        }

    def table(self) -> dict[str, tuple[int, int]]:
        return {k: (r.next_render_at, r.version) for k, r in self.store.rows.items()}


def member_record(
    name: str, *, live: bool = True, age: int = 0, incarnation: int = 0, max_lease_ms: int = 10_000
) -> NodeRecord:
    """A member row as the store reads it: `name` live (or not), its heartbeat `age` ms old."""
    return NodeRecord(
        node=name,
        url="",
        instance=name,
        started_at_ms=0,
        heartbeat_age_ms=age,
        left=False,
        live=live,
        lease_horizon_ms=0,
        max_lease_ms=max_lease_ms,
        incarnation=incarnation,
    )
