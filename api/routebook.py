"""This worker's view of routes and the global default cadence, cached for a second.

Every grant needs the row's effective cadence (the lease table's hold cap) and whether its
route is paused; reading the routes table per claim would cost more than the claim. A
route change made through this worker is seen at once, one made elsewhere within a second,
and the keeper stops publishing a paused route's keys on its own within its publish period.

Reading the book never reads the store: whoever uses it makes it fresh first (`refresh`,
a store call, made where the worker makes its store calls: api.lane), so a claim on the
event loop never waits on the store unless the book is stale. A book is the result of one
reload, replaced whole, so a reader on another thread sees one reload's routes and default
together; a reload that began before an `invalidate` does not count as fresh.
"""

from __future__ import annotations

import time

import msgspec

from keeper.classes import effective_cadence_s
from store.base import ScheduleStore
from store.rows import Route, Row

TTL_S = 1.0


class _Book(msgspec.Struct, frozen=True):
    routes: dict[str, Route]
    default_cadence_s: int
    loaded_at: float  # monotonic, when its reload began
    generation: int  # the book's generation when its reload began


class RouteBook:
    def __init__(self, store: ScheduleStore, ttl_s: float = TTL_S) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._generation = 0  # raised by every invalidate()
        self._book = _Book({}, 0, -1e18, -1)

    @property
    def fresh(self) -> bool:
        """Loaded within the TTL, and since the last invalidate()."""
        book = self._book
        return book.generation == self._generation and time.monotonic() - book.loaded_at < (
            self._ttl_s
        )

    def refresh(self) -> None:
        """Reload unless fresh: a store call (module note)."""
        if not self.fresh:
            self.reload()

    def reload(self) -> None:
        generation = self._generation
        began = time.monotonic()
        routes = {route.route: route for route in self._store.routes()}
        default_cadence_s = self._store.default_cadence_s()
        self._book = _Book(routes, default_cadence_s, began, generation)

    def invalidate(self) -> None:
        """A route or the default changed through this worker: the next use reloads."""
        self._generation += 1

    def route(self, name: str) -> Route | None:
        return self._book.routes.get(name)

    def routes(self) -> dict[str, Route]:
        return self._book.routes

    @property
    def default_cadence_s(self) -> int:
        return self._book.default_cadence_s

    def paused(self, route: str) -> bool:
        found = self._book.routes.get(route)
        return found is not None and found.paused

    def grant_cadence_s(self, row: Row) -> int | None:
        """The row's effective cadence, or None while its route is paused (no grant)."""
        book = self._book
        route = book.routes.get(row.route)
        if route is not None and route.paused:
            return None
        own = row.scheduled_cadence_s
        if own is not None:
            return own
        if route is not None and route.default_cadence_s is not None:
            return route.default_cadence_s
        return book.default_cadence_s

    def cadence_s(self, row: Row) -> int:
        """The row's own cadence, else its route's default, else the global default."""
        book = self._book
        cadence_s, _ = effective_cadence_s(
            row.route, row.scheduled_cadence_s, book.routes, book.default_cadence_s
        )
        return cadence_s
