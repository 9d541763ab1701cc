"""Every request and response body of the HTTP API, as msgspec Structs.

The shapes are a contract with the console, the fleet client and checks from outside;
`/openapi.json` is generated from these classes, so the two never drift. Requests refuse
unknown fields so a misspelt option fails loudly instead of being ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from store.rows import MAX_KEY_BYTES, Route, Row
from store.validate import ROUTE_NAME

Key = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=MAX_KEY_BYTES,
        description=f"The URL or path to render; UTF-8, at most {MAX_KEY_BYTES} bytes.",
    ),
]
LeaseToken = Annotated[
    str,
    Meta(
        pattern=r"^[0-9]{1,20}$",
        description="A lease token: a 64-bit unsigned integer, sent as a decimal string.",
    ),
]
RouteName = Annotated[
    str,
    Meta(
        pattern=f"^{ROUTE_NAME.pattern}$",
        description="A route: lower-case letters, digits, '_', '.', '-'; at most 64.",
    ),
]
CadenceS = Annotated[int, Meta(ge=1, le=10 * 366 * 86400, description="Whole seconds.")]
EpochMs = Annotated[int, Meta(ge=0, le=2**53 - 1, description="Epoch milliseconds.")]
LeaseS = Annotated[int, Meta(ge=5, le=3600)]
Outcome = Literal["rendered", "failed", "gone"]
MAX_ITEMS = 1000
MAX_SCHEDULE_ITEMS = 10_000


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of request bodies."""


class Body(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of response bodies; absent optionals are left out, not sent as null."""


# --- fleet ---------------------------------------------------------------------------------


class ClaimRequest(Request, frozen=True):
    max: Annotated[int, Meta(ge=1, le=MAX_ITEMS)]
    worker: Annotated[str, Meta(min_length=1, max_length=256, description="The claimant.")]
    lease_s: LeaseS = 300
    wait_s: Annotated[float, Meta(ge=0, le=30)] = 0


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    token: LeaseToken
    route: str
    due_at: int
    lease_expires_at: int
    sitemap: bool
    cadence_s: int


class ClaimResponse(msgspec.Struct, frozen=True, kw_only=True):
    leases: list[Lease]
    status: str


class NodeStatus(Body, frozen=True):
    """The 503 body while the node is not ready to grant claims."""

    status: str
    detail: str | None = None
    retry_after_s: int | None = None


class CompletionItem(Request, frozen=True):
    key: Key
    token: LeaseToken
    outcome: Outcome
    next_render_at: EpochMs | None = None


class CompletionsRequest(Request, frozen=True):
    items: Annotated[list[CompletionItem], Meta(min_length=1, max_length=MAX_ITEMS)]


class ItemResult(Body, frozen=True):
    key: str
    ok: bool
    error: str | None = None


class ItemResults(msgspec.Struct, frozen=True, kw_only=True):
    results: list[ItemResult]


class RenewItem(Request, frozen=True):
    key: Key
    token: LeaseToken
    lease_s: LeaseS | None = None


class RenewRequest(Request, frozen=True):
    items: Annotated[list[RenewItem], Meta(min_length=1, max_length=MAX_ITEMS)]


class RenewResult(Body, frozen=True):
    key: str
    ok: bool
    lease_expires_at: int | None = None
    error: str | None = None


class RenewResults(msgspec.Struct, frozen=True, kw_only=True):
    results: list[RenewResult]


# --- schedule ------------------------------------------------------------------------------


class ScheduleUpsert(Request, frozen=True):
    key: Key
    route: RouteName
    cadence_s: CadenceS | None = None
    sitemap: bool = False
    next_render_at: EpochMs | None = None


class ScheduleRequest(Request, frozen=True):
    upsert: Annotated[list[ScheduleUpsert], Meta(max_length=MAX_SCHEDULE_ITEMS)] = []
    delete: Annotated[list[Key], Meta(max_length=MAX_SCHEDULE_ITEMS)] = []


class ScheduleResult(msgspec.Struct, frozen=True, kw_only=True):
    upserted: int
    deleted: int


class RouteUpdate(Request, frozen=True):
    default_cadence_s: CadenceS | None = None
    paused: bool | None = None


class Routes(msgspec.Struct, frozen=True, kw_only=True):
    routes: list[Route]
    default_cadence_s: int


class SettingsUpdate(Request, frozen=True):
    default_cadence_s: CadenceS


class NodeSettings(msgspec.Struct, frozen=True, kw_only=True):
    default_cadence_s: int


# --- admin ---------------------------------------------------------------------------------


class Health(Body, frozen=True):
    status: str
    worker: int | None = None
    pid: int | None = None


class Readiness(Body, frozen=True):
    status: str
    published_at: int | None = None
    publish_age_ms: int | None = None
    generation: int | None = None


class Explain(Body, frozen=True):
    key: str
    exists: bool
    claimable: bool
    reason: str
    now: int
    row: Row | None = None
    cadence_s: int | None = None
    route_paused: bool | None = None
    render_class: dict[str, Any] | None = None
    rank: float | None = None
    lease: dict[str, Any] | None = None


class Overview(Body, frozen=True):
    now: int
    node: str
    instance: str
    worker: int
    status: str
    leases: dict[str, Any]
    ring: dict[str, Any]
    publish_age_ms: int | None = None
    supervisor: dict[str, Any] | None = None
    state_age_ms: int | None = None
    keeper: dict[str, Any] | None = None  # the keeper's KeeperStatistics, from worker 0
    completions: dict[str, Any] | None = None  # this worker's CompletionQueue.statistics()
