"""The durable schedule's records: what crosses the store's boundary.

Times are integer epoch milliseconds everywhere; cadences are whole seconds.
"""

from __future__ import annotations

from typing import Literal

import msgspec

MAX_KEY_BYTES = 2048
Outcome = Literal["rendered", "failed", "gone"]


class Row(msgspec.Struct, frozen=True, kw_only=True):
    """One row of `render_schedule`, as stored."""

    key: str
    route: str
    cadence_s: int | None  # None: the route's default, then the global default
    sitemap: bool
    next_render_at: int
    last_rendered_at: int | None = None
    last_outcome: str | None = None
    version: int = 0


class RowWrite(msgspec.Struct, frozen=True, kw_only=True):
    """An upsert of one row; the store assigns `version` and keeps render history."""

    key: str
    route: str
    next_render_at: int
    cadence_s: int | None = None
    sitemap: bool = False


class Route(msgspec.Struct, frozen=True, kw_only=True):
    route: str
    default_cadence_s: int | None = None
    paused: bool = False


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A render's result for one key, applied by `ScheduleStore.complete`.

    `rendered` sets next_render_at to `next_render_at` if given, else now + the
    row's effective cadence; `failed` keeps the row due; `gone` deletes it.
    """

    key: str
    outcome: Outcome
    now: int
    next_render_at: int | None = None


class RowEvent(msgspec.Struct, frozen=True, kw_only=True, tag="row"):
    """The key's current row, or None when the row is gone (events are state, not deltas)."""

    key: str
    row: Row | None


class RouteEvent(msgspec.Struct, frozen=True, kw_only=True, tag="route"):
    route: Route


class SettingsEvent(msgspec.Struct, frozen=True, kw_only=True, tag="settings"):
    default_cadence_s: int


FeedEvent = RowEvent | RouteEvent | SettingsEvent
