"""What both SQL backends do the same way, written once: each thread's connection state,
write health, and the reads and settings that differ only in their SQL.

A backend subclasses `SqlStore` with its connection type and thread state, gives it its
statements (`Statements`: its `sql` module), and fills in the hooks: how a thread's state
opens and closes, how a read and a logged change run (retries, transactions, errors),
and how rows are read with the feed's head. Its writes, completions and feed are its own.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, Self, TypeVar

import msgspec

from store.base import (
    Cursor,
    Membership,
    PostgresCounters,
    RowsRead,
    SqliteCounters,
    StoreCounters,
    Writability,
    WriteHealth,
)
from store.cadence import Adaptation, forgets_learned
from store.errors import StoreError
from store.rows import Route, Row, RowWrite, SiteSettings, route_from, row_from, site_settings_from
from store.schema import Executes
from store.secret import checked
from store.validate import (
    check_cadence,
    check_deletes,
    check_key,
    check_keys,
    check_page,
    check_route_change,
    check_site_pattern_change,
    check_site_settings,
    check_upserts,
)

T = TypeVar("T")


class Statements(Protocol):
    """A backend's statements for the shared methods, in its dialect and parameter style:
    its `sql` module. The `*_AT` reads return rows its `SqlStore._read_at` pairs with the
    feed's head; ROUTE_FOR_UPDATE reads a route as it stands before a change, held until
    the change commits."""

    GET: str
    GET_MANY: str  # takes key_list(keys)
    GET_MANY_AT: str
    WALK_FIRST: str  # (limit,)
    WALK_AFTER: str  # (after, limit)
    WALK_AT_FIRST: str
    WALK_AT_AFTER: str
    RETIRED: str  # (after, limit)
    ROUTES: str
    ROUTE_FOR_UPDATE: str
    SET_ROUTE: str  # named parameters (SqlStore.set_route)
    FORGET_LEARNED: str
    SITES: str
    SITE: str
    SET_SITE: str  # named parameters: SiteSettings' fields
    DELETE_SITE: str
    GET_DEFAULT_CADENCE: str
    SET_DEFAULT_CADENCE: str
    GET_HASH_SECRET: str

    def key_list(self, keys: list[str]) -> object:
        """Distinct keys as GET_MANY's parameter."""
        ...


class ThreadState(ABC):
    """One thread's connection and what its writes committed (StoreCounters)."""

    def __init__(self) -> None:
        self.transactions = 0
        self.rows_written = 0

    @property
    @abstractmethod
    def busy_refused(self) -> int:
        """Writes given up after the lock wait: StoreBusy."""


C = TypeVar("C", bound=Executes)
S = TypeVar("S", bound=ThreadState)


class SqlStore(ABC, Generic[C, S]):
    """The shared part of a SQL backend of `store.base.ScheduleStore`.

    Thread-safety: one store may be shared by the threads of one process; each thread has
    its own state and connection (threading.local). Use a store only in the process that
    opened it.
    """

    def __init__(self, statements: Statements, where: str) -> None:
        """`where`: the database as messages name it (never with a password)."""
        self.where = where
        self._sql = statements
        self._pid = os.getpid()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._states: list[S] = []
        self._health = WriteHealth()
        self._closed = False

    # -- the backend's hooks -------------------------------------------------------------

    @abstractmethod
    def _open_state(self) -> S:
        """A new thread's state (a backend may open its connection here or when used)."""

    @abstractmethod
    def _close_state(self, state: S) -> None:
        """Close a thread's connection, from any thread, once the store is closed."""

    @abstractmethod
    def _read(self, what: str, body: Callable[[C], T]) -> T:
        """`body` as a read on this thread's connection."""

    @abstractmethod
    def _change(self, what: str, body: Callable[[C], T], *, rows: int, several: bool) -> T:
        """`body` as one logged write of `rows` rows; `several`: its statements must commit
        together (a single statement is all or nothing on its own)."""

    @abstractmethod
    def _write_rows(self, upsert: Sequence[RowWrite], delete: Sequence[str]) -> None:
        """Upsert and delete in one logged transaction; both checked, not both empty."""

    @abstractmethod
    def _read_at(self, what: str, statement: str, params: tuple[object, ...]) -> RowsRead:
        """The rows an `*_AT` statement reads and the feed's head, in one snapshot."""

    @abstractmethod
    def feed_head(self) -> Cursor: ...

    @abstractmethod
    def _backend_counters(self, states: list[S]) -> SqliteCounters | PostgresCounters: ...

    @property
    def membership(self) -> Membership | None:
        """None: a backend that keeps a cluster's member list says so."""
        return None

    # -- threads -------------------------------------------------------------------------

    def _state(self) -> S:
        state: S | None = getattr(self._local, "state", None)
        if state is not None:
            return state
        if self._closed:
            raise StoreError(f"the store at {self.where} is closed")
        if os.getpid() != self._pid:
            raise StoreError(
                f"this {type(self).__name__} for {self.where} was opened in process "
                f"{self._pid}; open a new one in each process"
            )
        state = self._open_state()
        self._local.state = state
        with self._lock:
            self._states.append(state)
        return state

    def _thread_states(self) -> list[S]:
        with self._lock:
            return list(self._states)

    def writability(self) -> Writability:
        return self._health.statistics()

    def counters(self) -> StoreCounters:
        states = self._thread_states()
        backend = self._backend_counters(states)
        return StoreCounters(
            writability=self.writability(),
            transactions=sum(s.transactions for s in states),
            rows_written=sum(s.rows_written for s in states),
            busy_refused=sum(s.busy_refused for s in states),
            sqlite=backend if isinstance(backend, SqliteCounters) else None,
            postgres=backend if isinstance(backend, PostgresCounters) else None,
        )

    def close(self) -> None:
        """Close every thread's connection; the object is unusable afterwards."""
        with self._lock:
            self._closed = True
            states, self._states = self._states, []
        for state in states:
            self._close_state(state)
        self._local = threading.local()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- rows ----------------------------------------------------------------------------

    def write(self, upsert: Sequence[RowWrite] = (), delete: Sequence[str] = ()) -> None:
        if not isinstance(upsert, list | tuple):
            upsert = list(upsert)  # iterated twice below: an iterator would write nothing
        if not isinstance(delete, list | tuple | str):
            delete = list(delete)
        check_upserts(upsert)
        check_deletes(delete, upsert)
        if upsert or delete:
            self._write_rows(upsert, delete)

    def get(self, key: str) -> Row | None:
        check_key(key)
        found = self._read("get", lambda c: c.execute(self._sql.GET, (key,)).fetchone())
        return None if found is None else row_from(found)

    def get_many(self, keys: Sequence[str]) -> dict[str, Row]:
        wanted = check_keys(keys, what="get_many")
        if not wanted:
            return {}
        params = (self._sql.key_list(wanted),)
        found = self._read("get_many", lambda c: c.execute(self._sql.GET_MANY, params).fetchall())
        return {values[0]: row_from(values) for values in found}

    def get_many_at(self, keys: Sequence[str]) -> RowsRead:
        wanted = check_keys(keys, what="get_many")
        if not wanted:
            return RowsRead(rows=[], head=self.feed_head())
        return self._read_at("get_many_at", self._sql.GET_MANY_AT, (self._sql.key_list(wanted),))

    def walk(self, after: str | None, limit: int) -> list[Row]:
        statement, params = self._walk(after, limit, self._sql.WALK_FIRST, self._sql.WALK_AFTER)
        found = self._read("walk", lambda c: c.execute(statement, params).fetchall())
        return [row_from(values) for values in found]

    def walk_at(self, after: str | None, limit: int) -> RowsRead:
        first, rest = self._sql.WALK_AT_FIRST, self._sql.WALK_AT_AFTER
        return self._read_at("walk_at", *self._walk(after, limit, first, rest))

    @staticmethod
    def _walk(
        after: str | None, limit: int, first: str, rest: str
    ) -> tuple[str, tuple[object, ...]]:
        if limit < 1:
            raise ValueError(f"walk: limit must be at least 1, got {limit}")
        return (first, (limit,)) if after is None else (rest, (after, limit))

    def retired(self, after: str | None = None, limit: int = 100) -> list[Row]:
        check_page(after, limit)
        params = ("" if after is None else after, limit)
        found = self._read("retired", lambda c: c.execute(self._sql.RETIRED, params).fetchall())
        return [row_from(values) for values in found]

    # -- routes, sites and the global default --------------------------------------------

    def routes(self) -> list[Route]:
        found = self._read("routes", lambda c: c.execute(self._sql.ROUTES).fetchall())
        return [route_from(values) for values in found]

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
        """Create or change a route. None leaves a field as it is (a new route: no default
        cadence, not paused, fixed cadences, the default retire_after);
        `clear_default_cadence` sends the route back to the global default;
        `adapt`/`clear_adapt` as ScheduleStore.set_route says; `clear_site_pattern` sends
        its keys back to their hosts' sites.
        """
        set_cadence, set_adapt = check_route_change(
            route,
            default_cadence_s,
            paused,
            clear_default_cadence,
            adapt,
            clear_adapt,
            retire_after,
        )
        set_pattern = check_site_pattern_change(site_pattern, clear_site_pattern)
        params = {
            "route": route,
            "cadence": default_cadence_s,
            "set_cadence": set_cadence,
            "paused": paused,
            "set_adapt": set_adapt,
            "min_s": None if adapt is None else adapt.min_s,
            "max_s": None if adapt is None else adapt.max_s,
            "inc": None if adapt is None else float(adapt.inc),
            "dec": None if adapt is None else float(adapt.dec),
            "site_pattern": site_pattern,
            "set_site_pattern": set_pattern,
            "retire_after": retire_after,
        }
        sql = self._sql

        def body(conn: C) -> Route:
            before = conn.execute(sql.ROUTE_FOR_UPDATE, (route,)).fetchone()
            after = route_from(conn.execute(sql.SET_ROUTE, params).fetchone())
            if before is not None and forgets_learned(route_from(before).adapt, after.adapt):
                conn.execute(sql.FORGET_LEARNED, (route,))
            return after

        return self._change("set_route", body, rows=1, several=True)

    def default_cadence_s(self) -> int:
        statement = self._sql.GET_DEFAULT_CADENCE
        found = self._read("default", lambda c: c.execute(statement).fetchone())
        return int(found[0])

    def set_default_cadence_s(self, seconds: int) -> None:
        check_cadence(seconds, where="default_cadence_s", optional=False)
        statement = self._sql.SET_DEFAULT_CADENCE
        self._change(
            "set_default_cadence_s",
            lambda c: c.execute(statement, (seconds,)),
            rows=1,
            several=False,
        )

    def sites(self) -> list[SiteSettings]:
        found = self._read("sites", lambda c: c.execute(self._sql.SITES).fetchall())
        return [site_settings_from(values) for values in found]

    def get_site(self, site: str) -> SiteSettings | None:
        found = self._read("site", lambda c: c.execute(self._sql.SITE, (site,)).fetchone())
        return None if found is None else site_settings_from(found)

    def set_site(self, settings: SiteSettings) -> SiteSettings | None:
        check_site_settings(settings)
        if settings.empty:
            gone = (settings.site,)
            statement = self._sql.DELETE_SITE
            self._change("set_site", lambda c: c.execute(statement, gone), rows=1, several=False)
            return None
        params = msgspec.structs.asdict(settings)
        statement = self._sql.SET_SITE
        self._change("set_site", lambda c: c.execute(statement, params), rows=1, several=False)
        return settings

    def hash_secret(self) -> bytes:
        statement = self._sql.GET_HASH_SECRET
        found = self._read("hash_secret", lambda c: c.execute(statement).fetchone())
        return checked(None if found is None else found[0], self.where)
