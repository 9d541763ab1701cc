"""Schedule endpoints: batch upsert and delete of rows, a point read, routes and the global
default cadence. Writes are all or nothing; bad input is refused before the store sees it,
and a ValueError from the store (it validates too) becomes a 422 as well."""

from __future__ import annotations

import time

import msgspec

from api.node import Node
from api.problems import ApiError, invalid_field, invalid_query, not_found
from api.schemas import (
    NodeSettings,
    RouteName,
    Routes,
    RouteUpdate,
    ScheduleRequest,
    ScheduleResult,
    SettingsUpdate,
)
from store.rows import MAX_KEY_BYTES, Route, Row, RowWrite

ROUTE_PATTERN_TEXT = "lower-case letters, digits, '_', '.', '-'; at most 64 characters"


def check_key(key: str, field: str) -> None:
    try:
        size = len(key.encode())
    except UnicodeEncodeError:
        raise invalid_field(field, "the key is not valid UTF-8") from None
    if size > MAX_KEY_BYTES:
        raise invalid_field(field, f"the key is {size} bytes of UTF-8; at most {MAX_KEY_BYTES}")


def store_error(exc: ValueError) -> ApiError:
    return ApiError(422, "Invalid request", str(exc))


def write(node: Node, request: ScheduleRequest) -> ScheduleResult:
    now = time.time_ns() // 1_000_000
    upserts: list[RowWrite] = []
    seen: dict[str, str] = {}
    for index, item in enumerate(request.upsert):
        field = f"$.upsert[{index}].key"
        check_key(item.key, field)
        if item.key in seen:
            raise invalid_field(field, f"the key also appears at {seen[item.key]}")
        seen[item.key] = field
        upserts.append(
            RowWrite(
                key=item.key,
                route=item.route,
                next_render_at=now if item.next_render_at is None else item.next_render_at,
                cadence_s=item.cadence_s,
                sitemap=item.sitemap,
            )
        )
    for index, key in enumerate(request.delete):
        field = f"$.delete[{index}]"
        check_key(key, field)
        if key in seen:
            raise invalid_field(field, f"the key also appears at {seen[key]}")
        seen[key] = field
    if not upserts and not request.delete:
        raise invalid_field("$", "nothing to do: give `upsert` or `delete`")
    try:
        node.store.write(upsert=upserts, delete=request.delete)
    except ValueError as exc:
        raise store_error(exc) from None
    return ScheduleResult(upserted=len(upserts), deleted=len(request.delete))


def get_row(node: Node, key: str | None) -> Row:
    if not key:
        raise invalid_query("key", "required: the row's key")
    check_key(key, "key")
    row = node.store.get(key)
    if row is None:
        raise not_found(f"no row has key {key!r}")
    return row


def routes(node: Node) -> Routes:
    return Routes(routes=node.store.routes(), default_cadence_s=node.store.default_cadence_s())


def check_route_name(route: str) -> None:
    try:
        msgspec.convert(route, RouteName)
    except msgspec.ValidationError:
        raise invalid_query("route", ROUTE_PATTERN_TEXT) from None


def set_route(node: Node, route: str, update: RouteUpdate) -> Route:
    check_route_name(route)
    try:
        result = node.store.set_route(
            route, default_cadence_s=update.default_cadence_s, paused=update.paused
        )
    except ValueError as exc:
        raise store_error(exc) from None
    node.routes.invalidate()
    return result


def set_settings(node: Node, update: SettingsUpdate) -> NodeSettings:
    try:
        node.store.set_default_cadence_s(update.default_cadence_s)
    except ValueError as exc:
        raise store_error(exc) from None
    node.routes.invalidate()
    return NodeSettings(default_cadence_s=node.store.default_cadence_s())
