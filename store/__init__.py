"""renderqueue's durable side: the schedule table and its exact change feed.

`open_store(url)` picks the backend; `store.base` is the interface both backends
implement, `store.rows` the records that cross it.
"""

from store.base import (
    Cursor,
    CursorAhead,
    CursorBelowFloor,
    FeedBatch,
    RowsRead,
    ScheduleStore,
    Subscription,
)
from store.errors import SchemaTooNew, StoreBusy, StoreError, StoreFull, StoreUnavailable
from store.rows import (
    Completion,
    FeedEvent,
    Route,
    RouteEvent,
    Row,
    RowEvent,
    RowWrite,
    SettingsEvent,
    SiteEvent,
    SiteSettings,
)
from store.url import open_store

__all__ = [
    "Completion",
    "Cursor",
    "CursorAhead",
    "CursorBelowFloor",
    "FeedBatch",
    "FeedEvent",
    "Route",
    "RouteEvent",
    "Row",
    "RowEvent",
    "RowWrite",
    "RowsRead",
    "ScheduleStore",
    "SchemaTooNew",
    "SettingsEvent",
    "SiteEvent",
    "SiteSettings",
    "StoreBusy",
    "StoreError",
    "StoreFull",
    "StoreUnavailable",
    "Subscription",
    "open_store",
]
