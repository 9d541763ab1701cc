"""This worker's view of routes and the global default cadence, cached for a second.

Every grant needs the row's effective cadence (the lease table's hold cap) and whether its
route is paused; reading the routes table per claim would cost more than the claim. A
route change made through this worker is seen at once, one made elsewhere within a second,
and the keeper stops publishing a paused route's keys on its own within its publish period.
"""

from __future__ import annotations

import time

from keeper.classes import effective_cadence_s
from store.base import ScheduleStore
from store.rows import Route, Row

TTL_S = 1.0


class RouteBook:
    def __init__(self, store: ScheduleStore, ttl_s: float = TTL_S) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._routes: dict[str, Route] = {}
        self._default_cadence_s = 0
        self._loaded_at = -1e18

    def _fresh(self) -> None:
        if time.monotonic() - self._loaded_at >= self._ttl_s:
            self.reload()

    def reload(self) -> None:
        self._routes = {route.route: route for route in self._store.routes()}
        self._default_cadence_s = self._store.default_cadence_s()
        self._loaded_at = time.monotonic()

    def invalidate(self) -> None:
        self._loaded_at = -1e18

    def route(self, name: str) -> Route | None:
        self._fresh()
        return self._routes.get(name)

    def routes(self) -> dict[str, Route]:
        self._fresh()
        return self._routes

    @property
    def default_cadence_s(self) -> int:
        self._fresh()
        return self._default_cadence_s

    def paused(self, route: str) -> bool:
        found = self.route(route)
        return found is not None and found.paused

    def grant_cadence_s(self, row: Row) -> int | None:
        """The row's effective cadence, or None while its route is paused (no grant)."""
        self._fresh()
        route = self._routes.get(row.route)
        if route is not None and route.paused:
            return None
        if row.cadence_s is not None:
            return row.cadence_s
        if route is not None and route.default_cadence_s is not None:
            return route.default_cadence_s
        return self._default_cadence_s

    def cadence_s(self, row: Row) -> int:
        """The row's own cadence, else its route's default, else the global default."""
        self._fresh()
        cadence_s, _ = effective_cadence_s(
            row.route, row.cadence_s, self._routes, self._default_cadence_s
        )
        return cadence_s
