"""Schedule endpoints: batch upsert and delete of rows, a point read, routes and the global
default cadence. Writes are all or nothing; bad input is refused before the store sees it,
and a ValueError from the store (it validates too) becomes a 422 as well."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

import msgspec

from api.node import Node
from api.problems import ApiError, invalid_field, not_found
from store import validate
from store.cadence import Adaptation
from store.rows import Route, Row, RowWrite
from wire.schemas import (
    LEASE_TOKEN_PATTERN,
    CompletionItem,
    NodeSettings,
    RenewItem,
    Routes,
    RouteUpdate,
    RowPage,
    ScheduleRequest,
    ScheduleResult,
    SettingsUpdate,
)

_LEASE_TOKEN = re.compile(LEASE_TOKEN_PATTERN)


def check_key(key: str, field: str) -> None:
    """A key in a body, by the store's own rules (store.validate): 422 naming the field,
    before the store is asked (a query's key: api.params)."""
    try:
        validate.check_key(key)
    except ValueError as exc:
        reason = str(exc).partition(": ")[2] or str(exc)
        raise invalid_field(field, reason) from None


def check_items(items: Sequence[CompletionItem | RenewItem]) -> None:
    """A completion's or renewal's items: each key by the store's rules and each token by
    the document's pattern (wire.schemas.ItemToken). The whole request is refused (422
    naming the item) before any item is applied or sent to another node."""
    for index, item in enumerate(items):
        check_key(item.key, f"$.items[{index}].key")
        token = item.token
        # A single node's tokens are plain decimals, which need no regex.
        if not (token.isascii() and token.isdigit() and len(token) <= 20) and (
            _LEASE_TOKEN.search(token) is None
        ):
            raise invalid_field(
                f"$.items[{index}].token", f"Expected `str` matching regex {LEASE_TOKEN_PATTERN!r}"
            )


def store_error(exc: ValueError) -> ApiError:
    return ApiError(422, "Invalid request", str(exc))


def write(node: Node, request: ScheduleRequest) -> ScheduleResult:
    """One transaction. A key given more than once is written once (ScheduleRequest): its
    last upsert stands, and a delete wins over an upsert; the counts are what was written.
    The document cannot make a client's batch distinct, so the node settles it instead of
    refusing a body the document calls valid (and PostgreSQL's upsert would refuse a key
    twice in one statement)."""
    if not request.upsert and not request.delete:
        raise invalid_field("$", "nothing to do: give `upsert` or `delete`")
    now = time.time_ns() // 1_000_000
    upserts: dict[str, RowWrite] = {}
    for index, item in enumerate(request.upsert):
        check_key(item.key, f"$.upsert[{index}].key")
        upserts[item.key] = RowWrite(
            key=item.key,
            route=item.route,
            next_render_at=now if item.next_render_at is None else item.next_render_at,
            cadence_s=item.cadence_s,
            sitemap=item.sitemap,
        )
    for index, key in enumerate(request.delete):
        check_key(key, f"$.delete[{index}]")
    deletes = list(dict.fromkeys(request.delete))
    for key in deletes:
        upserts.pop(key, None)
    try:
        node.store.write(upsert=list(upserts.values()), delete=deletes)
    except ValueError as exc:
        raise store_error(exc) from None
    node.stamp_keys_written([*upserts, *deletes])
    return ScheduleResult(upserted=len(upserts), deleted=len(deletes))


DEFAULT_PAGE = 100


def read(node: Node, params: dict[str, str]) -> Row | RowPage:
    """GET /v1/schedule: one row by key, or a page of rows (all, or the retired ones)."""
    retired = msgspec.convert(params["retired"], bool, strict=False)
    key = params.get("key")
    if key is not None:
        row = get_row(node, key)
        if retired and row.retired_at is None:
            raise not_found(f"the row with key {key!r} is not retired")
        return row
    limit = int(params["limit"])
    after = params.get("after")
    try:
        rows = node.store.retired(after, limit) if retired else node.store.walk(after, limit)
    except ValueError as exc:
        raise store_error(exc) from None
    return RowPage(rows=rows, next_after=rows[-1].key if len(rows) == limit else None)


def get_row(node: Node, key: str) -> Row:
    row = node.store.get(key)
    if row is None:
        raise not_found(f"no row has key {key!r}")
    return row


def routes(node: Node) -> Routes:
    return Routes(routes=node.store.routes(), default_cadence_s=node.store.default_cadence_s())


def set_route(node: Node, route: str, update: RouteUpdate) -> Route:
    """`default_cadence_s`, `adapt` and `site_pattern`: absent leaves it, a value sets it,
    null clears it."""
    cadence = update.default_cadence_s
    if isinstance(cadence, msgspec.UnsetType):
        cadence = None
    pattern = update.site_pattern
    given = update.adapt
    adapt = None
    if given is not None and not isinstance(given, msgspec.UnsetType):
        adapt = Adaptation(min_s=given.min_s, max_s=given.max_s, inc=given.inc, dec=given.dec)
        if adapt.min_s > adapt.max_s:
            raise invalid_field(
                "$.adapt.min_s", f"{adapt.min_s} is above max_s {adapt.max_s}: nothing changed"
            )
    try:
        result = node.store.set_route(
            route,
            default_cadence_s=cadence,
            paused=update.paused,
            clear_default_cadence=update.default_cadence_s is None,
            adapt=adapt,
            clear_adapt=update.adapt is None,
            site_pattern=None if isinstance(pattern, msgspec.UnsetType) else pattern,
            clear_site_pattern=pattern is None,
            retire_after=update.retire_after,
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
