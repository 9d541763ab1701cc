"""Classes and rank: the order the queue serves rows in, without ever rescoring.

A class is route x cadence x (cadence came off the row or not) x sitemap flag. A row's
own cadence is what it learned where its route adapts (store.cadence), else its
`cadence_s`: learned cadences are rungs of the route's ladder, so they add at most a
ladder's rungs to a route's classes.
Every row of one class shares its cadence and boost, so within a class an
earlier due time always ranks higher and the best K is a merge over class heads.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import numpy as np
import numpy.typing as npt

from store.rows import Route, Row

DEFAULT_CADENCE_S = 86_400  # the global default when none was ever set


class RenderClass(msgspec.Struct, frozen=True):
    route: str
    cadence_s: int
    cadence_from_row: bool
    sitemap: bool


def effective_cadence_s(
    route: str, row_cadence_s: int | None, routes: Mapping[str, Route], default_cadence_s: int
) -> tuple[int, bool]:
    """The cadence a row renders at, and whether it came off the row itself."""
    if row_cadence_s is not None:
        return row_cadence_s, True
    known = routes.get(route)
    if known is not None and known.default_cadence_s is not None:
        return known.default_cadence_s, False
    return default_cadence_s, False


def classify(row: Row, routes: Mapping[str, Route], default_cadence_s: int) -> RenderClass:
    cadence_s, from_row = effective_cadence_s(
        row.route, row.scheduled_cadence_s, routes, default_cadence_s
    )
    return RenderClass(row.route, cadence_s, from_row, row.sitemap)


def rank(due_at: int, now_ms: int, cls: RenderClass, sitemap_boost: float) -> float:
    """Lateness relative to the row's cadence, plus the sitemap boost: higher serves first."""
    boost = sitemap_boost if cls.sitemap else 0.0
    return (now_ms - due_at) / (cls.cadence_s * 1000.0) + boost


class ClassTable:
    """Interns classes as small integer ids, kept stable while rows hold them.

    An id's identity can be relabelled in place when a route's default or the
    global default changes: every row of the class moves together, so the
    queue reclassifies without touching a single row.
    """

    def __init__(self, sitemap_boost: float) -> None:
        self.sitemap_boost = sitemap_boost
        self._classes: list[RenderClass] = []
        self._ids: dict[RenderClass, int] = {}
        self._paused_routes: set[str] = set()
        self._cadence_ms = np.zeros(16, dtype=np.float64)
        self._boost = np.zeros(16, dtype=np.float64)
        self._paused = np.zeros(16, dtype=np.bool_)
        self._sitemap = np.zeros(16, dtype=np.bool_)

    def __len__(self) -> int:
        return len(self._classes)

    def intern(self, cls: RenderClass) -> int:
        found = self._ids.get(cls)
        if found is not None:
            return found
        class_id = len(self._classes)
        self._classes.append(cls)
        self._ids[cls] = class_id
        if class_id >= len(self._cadence_ms):
            grow = len(self._cadence_ms) * 2
            self._cadence_ms = np.resize(self._cadence_ms, grow)
            self._boost = np.resize(self._boost, grow)
            self._paused = np.resize(self._paused, grow)
            self._sitemap = np.resize(self._sitemap, grow)
        self._set_arrays(class_id, cls)
        return class_id

    def get(self, class_id: int) -> RenderClass:
        return self._classes[class_id]

    def find(self, cls: RenderClass) -> int | None:
        return self._ids.get(cls)

    def relabel(self, class_id: int, cls: RenderClass) -> None:
        """Give an id a new identity; the caller made sure no other id has it."""
        old = self._classes[class_id]
        if self._ids.get(old) == class_id:
            del self._ids[old]
        self._classes[class_id] = cls
        self._ids[cls] = class_id
        self._set_arrays(class_id, cls)

    def forget(self, class_id: int) -> None:
        """Retire an id whose rows moved elsewhere; its number is never reused."""
        old = self._classes[class_id]
        if self._ids.get(old) == class_id:
            del self._ids[old]

    def is_current(self, class_id: int) -> bool:
        return self._ids.get(self._classes[class_id]) == class_id

    def set_paused_routes(self, routes: set[str]) -> None:
        self._paused_routes = set(routes)
        for class_id, cls in enumerate(self._classes):
            self._paused[class_id] = cls.route in self._paused_routes

    def paused(self, class_id: int) -> bool:
        return bool(self._paused[class_id])

    def cadence_ms(self) -> npt.NDArray[np.float64]:
        """Per class id, the cadence in ms (a view: valid until the next intern)."""
        return self._cadence_ms[: len(self._classes)]

    def boost(self) -> npt.NDArray[np.float64]:
        return self._boost[: len(self._classes)]

    def paused_mask(self) -> npt.NDArray[np.bool_]:
        return self._paused[: len(self._classes)]

    def sitemap_mask(self) -> npt.NDArray[np.bool_]:
        return self._sitemap[: len(self._classes)]

    def _set_arrays(self, class_id: int, cls: RenderClass) -> None:
        self._cadence_ms[class_id] = cls.cadence_s * 1000.0
        self._boost[class_id] = self.sitemap_boost if cls.sitemap else 0.0
        self._paused[class_id] = cls.route in self._paused_routes
        self._sitemap[class_id] = cls.sitemap


class Reclassified(msgspec.Struct, frozen=True, kw_only=True):
    classes: int  # class ids whose identity changed
    rows: int  # rows whose class changed


class Classifier:
    """A row's class id under the current routes and default cadence, cached per shape."""

    def __init__(self, table: ClassTable, default_cadence_s: int = DEFAULT_CADENCE_S) -> None:
        self.table = table
        self.routes: dict[str, Route] = {}
        self.default_cadence_s = default_cadence_s
        # (route, the row's own cadence, sitemap) -> class id; the event path reads it directly
        self.cache: dict[tuple[str, int | None, bool], int] = {}

    def class_id(self, route: str, cadence_s: int | None, sitemap: bool) -> int:
        shape = (route, cadence_s, sitemap)
        found = self.cache.get(shape)
        if found is None:
            cadence, from_row = effective_cadence_s(
                route, cadence_s, self.routes, self.default_cadence_s
            )
            found = self.table.intern(RenderClass(route, cadence, from_row, sitemap))
            self.cache[shape] = found
        return found

    def cached(self, shape: tuple[str, int | None, bool]) -> int | None:
        """The class id of (route, row cadence, sitemap) if already known, else None."""
        return self.cache.get(shape)

    def class_of_row(self, row: Row) -> int:
        return self.class_id(row.route, row.scheduled_cadence_s, row.sitemap)

    def set_settings(self, routes: Mapping[str, Route], default_cadence_s: int) -> None:
        self.routes = dict(routes)
        self.default_cadence_s = default_cadence_s
        self.cache.clear()
        self.table.set_paused_routes({r.route for r in self.routes.values() if r.paused})

    def plan(self) -> list[tuple[int, RenderClass]]:
        """Class ids whose identity the current settings change, with their new identity.

        Only classes whose cadence did not come off the row can change: their
        cadence is the route's default or the global default.
        """
        changes: list[tuple[int, RenderClass]] = []
        for class_id in range(len(self.table)):
            if not self.table.is_current(class_id):
                continue
            cls = self.table.get(class_id)
            if cls.cadence_from_row:
                continue
            cadence, _ = effective_cadence_s(cls.route, None, self.routes, self.default_cadence_s)
            if cadence != cls.cadence_s:
                changes.append((class_id, RenderClass(cls.route, cadence, False, cls.sitemap)))
        return changes
