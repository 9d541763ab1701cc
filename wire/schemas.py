"""Every request and response body of the HTTP API, as msgspec Structs.

The shapes are a contract with the console, the fleet client and checks from outside;
`/openapi.json` is generated from these classes, so the two never drift. Requests refuse
unknown fields so a misspelt option fails loudly instead of being ignored.

A rule JSON Schema cannot say with its own keywords is said beside the type it governs,
as an `x-` keyword the server's own check reads from the same constant (a key's size in
UTF-8 bytes, a batch's keys being distinct), so a generator or a fuzzer can honour it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from keeper.core import MAX_DUE_MS
from keeper.state import SITES_LISTED
from store.cadence import DEFAULT_DEC, DEFAULT_INC, MAX_INC
from store.rows import MAX_KEY_BYTES, MAX_RETIRE_AFTER, Route, Row
from store.validate import MAX_PAGE, ROUTE_NAME

# The store refuses a key with a NUL (PostgreSQL's text cannot hold one) or past
# MAX_KEY_BYTES of UTF-8 (store.validate.check_key, which every path that takes a key
# runs); JSON Schema counts characters, so the byte limit is a keyword of its own.
KEY_PATTERN = "^[^\\u0000]*$"
MAX_UTF8_BYTES_KEYWORD = "x-maxUtf8Bytes"
Key = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=MAX_KEY_BYTES,
        description=f"The URL or path to render: at most {MAX_KEY_BYTES} characters and at "
        f"most {MAX_KEY_BYTES} bytes of UTF-8, with no NUL character.",
        extra_json_schema={"pattern": KEY_PATTERN, MAX_UTF8_BYTES_KEYWORD: MAX_KEY_BYTES},
    ),
]
LEASE_TOKEN_PATTERN = r"^(?:[A-Za-z0-9_.-]{1,64}:)?[0-9]{1,20}$"
_LEASE_TOKEN_TEXT = (
    "A lease token, opaque to clients: a 64-bit unsigned integer as a decimal string, "
    "prefixed in a cluster with the granting node's name and a colon (`node-a:4294967297`), "
    "so any node can route a completion or renewal to it."
)
LeaseToken = Annotated[str, Meta(pattern=LEASE_TOKEN_PATTERN, description=_LEASE_TOKEN_TEXT)]
# The same rule on a request's items, checked by api.schedule.check_items in the loop that
# checks their keys: msgspec runs a pattern through `re` for every item, which costs more
# than the rest of a 100-item body's decoding.
ItemToken = Annotated[
    str, Meta(description=_LEASE_TOKEN_TEXT, extra_json_schema={"pattern": LEASE_TOKEN_PATTERN})
]
SitesTop = Annotated[
    int,
    Meta(ge=1, le=SITES_LISTED, description=f"How many sites: 1 to {SITES_LISTED}."),
]
RouteName = Annotated[
    str,
    Meta(
        pattern=f"^{ROUTE_NAME.pattern}$",
        description="A route: lower-case letters, digits, '_', '.', '-'; at most 64.",
    ),
]
CadenceS = Annotated[int, Meta(ge=1, le=10 * 366 * 86400, description="Whole seconds.")]
RetireAfter = Annotated[
    int,
    Meta(
        ge=1,
        le=MAX_RETIRE_AFTER,
        description="The route's rows retire after this many `not_found` outcomes in a row.",
    ),
]
PageLimit = Annotated[
    int, Meta(ge=1, le=MAX_PAGE, description=f"At most this many rows: 1 to {MAX_PAGE}.")
]
# Before the year 10000: the keeper holds no row due later (keeper.core.MAX_DUE_MS), and a
# row it cannot hold would be accepted here and then never served.
EpochMs = Annotated[
    int, Meta(ge=0, le=MAX_DUE_MS - 1, description="Epoch milliseconds, before the year 10000.")
]
MIN_LEASE_S = 5
MAX_LEASE_S = 3600
# Whole seconds. A node may cap leases lower (its max_lease_s, a cluster's setting): its
# document states that node's cap (api.openapi, which finds this keyword naming the
# setting; a site's max in flight is capped the same way, by site_permits_max).
LEASE_CAP_KEYWORD = "x-capByNodeSetting"
LeaseS = Annotated[
    int,
    Meta(
        ge=MIN_LEASE_S,
        le=MAX_LEASE_S,
        description="The lease's length in whole seconds.",
        extra_json_schema={LEASE_CAP_KEYWORD: "max_lease_s"},
    ),
]
DEFAULT_LEASE_S = 300
# not_found: the origin answered 404 or 410 (store.rows.Completion).
Outcome = Literal["rendered", "failed", "gone", "not_found"]
MAX_ITEMS = 1000
MAX_WAIT_S = 30  # a claim's longest poll
MAX_SCHEDULE_ITEMS = 10_000
MAX_ADAPT_INC = MAX_INC


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of request bodies."""


class Body(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of response bodies; absent optionals are left out, not sent as null."""


# --- fleet ---------------------------------------------------------------------------------


# The node decodes ClaimRequest and the fleet client (fleet.client) encodes it, and the other
# way round for ClaimResponse: one definition each, so the two sides cannot drift. (Comments,
# not docstrings: a docstring would become the description in /openapi.json.)
class ClaimRequest(Request, frozen=True, omit_defaults=True):
    max: Annotated[int, Meta(ge=1, le=MAX_ITEMS)]
    worker: Annotated[str, Meta(min_length=1, max_length=256, description="The claimant.")]
    # Absent: DEFAULT_LEASE_S, or the node's max_lease_s when that is shorter (a cluster's cap).
    lease_s: LeaseS | None = None
    wait_s: Annotated[float, Meta(ge=0, le=MAX_WAIT_S)] = 0
    # The previous batch's results, applied before anything is granted, as a completions
    # request's items are: one round trip does both.
    complete: (
        Annotated[
            list[CompletionItem],
            Meta(
                min_length=1,
                max_length=MAX_ITEMS,
                description="Results to apply first, as `POST /v1/completions` items; "
                "answered in the response's `completed`.",
            ),
        ]
        | None
    ) = None


# Positional too: a claim builds its leases column by column (api.claims).
class Lease(msgspec.Struct, frozen=True, omit_defaults=True):
    key: str
    token: LeaseToken
    route: str
    due_at: int
    lease_expires_at: int
    sitemap: bool
    cadence_s: int
    # In a cluster: the node that granted the lease (its completion and renewals belong
    # there; any node forwards them). Absent on a single node.
    node: str | None = None
    # The lease's term as the node granted it: it ends this long after the node answered.
    # A client whose clock may differ from the node's counts it from when it asked, which
    # is never later than the grant (lease_expires_at is in the node's clock).
    lease_ms: int | None = None


class ClaimResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    leases: list[Lease]
    # `ready` (the keeper is publishing) or `draining` (it is not, and these came from its
    # last published set); `unready` and `stalled` are answered 503 (NodeStatus). A fenced
    # node says so in `fenced` and `detail`, not here: a fleet built before would refuse
    # a status it does not know.
    status: Literal["ready", "draining"]
    # With no leases, in a cluster: due keys this node owns but may not grant yet (gained
    # from another node whose leases on them may live), and why, until when.
    fenced: int | None = None
    detail: str | None = None
    # The request's `complete` items, each answered as `POST /v1/completions` answers it.
    completed: list[ItemResult] | None = None


class NodeStatus(Body, frozen=True):
    """The 503 body while the node is not ready to grant claims."""

    status: str
    detail: str | None = None
    retry_after_s: int | None = None
    # A claim's `complete` items, applied before the node found it could not grant.
    completed: list[ItemResult] | None = None


# An origin's Retry-After, in seconds: at most a day.
MAX_SITE_RETRY_AFTER_S = 86_400
SiteRetryAfterS = Annotated[
    float,
    Meta(
        gt=0,
        le=MAX_SITE_RETRY_AFTER_S,
        description="The origin turned the render away for this long (HTTP 429 or 503 with "
        "Retry-After): its whole site is blocked until then, and the key is handed back "
        "(its outcome is not applied: nothing written, due time unchanged, no failure "
        "counted).",
    ),
]


Changed = Annotated[
    bool,
    Meta(
        description="A `rendered` item only: whether the render differed from the last one "
        "(the fleet decides, by a content hash for example). The row records it, and where "
        "its route adapts (`adapt`) its cadence follows: unchanged lengthens it, changed "
        "shortens it. Absent: not known, nothing recorded.",
    ),
]


class CompletionItem(Request, frozen=True):
    # api.openapi merges this into the component: `changed` is said of a rendered page only.
    # As if/then, not a top-level anyOf: a client generator makes each branch of an anyOf
    # a type of its own and loses the item's fields (openapi-python-client: Any).
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "if": {"required": ["changed"], "properties": {"changed": {"type": "boolean"}}},
        "then": {"properties": {"outcome": {"const": "rendered"}}},
    }

    key: Key
    token: ItemToken
    outcome: Outcome
    next_render_at: EpochMs | None = None
    site_retry_after_s: SiteRetryAfterS | None = None
    changed: Changed | None = None


class CompletionsRequest(Request, frozen=True):
    items: Annotated[list[CompletionItem], Meta(min_length=1, max_length=MAX_ITEMS)]


class ItemResult(Body, frozen=True):
    key: str
    ok: bool
    error: str | None = None
    # A `failed` result: the key is held back until then (epoch ms), 2 lease lengths after
    # a first failure, doubling with each one in a row, capped at its cadence.
    held_until: int | None = None
    # The key's site is blocked until then (epoch ms): by this item's site_retry_after_s,
    # or by the failure streak this item's failure completed (shm.sites).
    site_blocked_until: int | None = None
    # A `not_found` result: the row's not_found outcomes in a row, and, once they reach
    # its route's retire_after, when it retired (epoch ms): it is never granted again
    # until an upsert of its key or render-now revives it.
    not_found_streak: int | None = None
    retired_at: int | None = None
    # In a cluster, why an item another node granted was not applied (which node, and what
    # it answered); `error` is then `lease_not_held` or `node_unavailable` (retry it).
    detail: str | None = None


class ItemResults(msgspec.Struct, frozen=True, kw_only=True):
    results: list[ItemResult]


class RenewItem(Request, frozen=True):
    key: Key
    token: ItemToken
    lease_s: LeaseS | None = None


class RenewRequest(Request, frozen=True):
    items: Annotated[list[RenewItem], Meta(min_length=1, max_length=MAX_ITEMS)]


class RenewResult(Body, frozen=True):
    key: str
    ok: bool
    lease_expires_at: int | None = None
    # lease_not_held, or not_owner: the key moved to `owner` (another node of the
    # cluster), or this node cannot confirm it is a member; the render must stop.
    error: str | None = None
    detail: str | None = None  # as ItemResult.detail
    owner: str | None = None
    lease_ms: int | None = None  # as Lease.lease_ms: the renewed term, from the answer


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
    """Upserts and deletes, written in one transaction. At least one item in all. A key given
    more than once is written once: its last upsert stands, and a delete of it wins over
    any upsert of it (deletes apply after upserts)."""

    # api.openapi merges this into the component: "at least one item" is a rule across
    # both fields, which no one field's type can say; api.schedule.write enforces it.
    json_schema_extra: ClassVar[dict[str, Any]] = {
        "anyOf": [
            {"required": ["upsert"], "properties": {"upsert": {"minItems": 1}}},
            {"required": ["delete"], "properties": {"delete": {"minItems": 1}}},
        ]
    }

    upsert: Annotated[list[ScheduleUpsert], Meta(max_length=MAX_SCHEDULE_ITEMS)] = []
    delete: Annotated[list[Key], Meta(max_length=MAX_SCHEDULE_ITEMS)] = []


class ScheduleResult(msgspec.Struct, frozen=True, kw_only=True):
    upserted: int
    deleted: int


class RowPage(Body, frozen=True):
    """Rows by key, a page at a time (a retired one with `retired_at` and
    `retired_reason`): ask again with `after` set to `next_after` for the next page
    (absent: this is the last one)."""

    rows: list[Row]
    next_after: str | None = None


# `min_s` is at most `max_s`: a rule across two fields that JSON Schema cannot say, stated
# beside it as this keyword (tests/schemathesis.toml counts the 422 that enforces it).
NOT_ABOVE_KEYWORD = "x-notAbove"


class AdaptUpdate(Request, frozen=True):
    """Adaptive cadence for a route's rows (store.cadence): each render that says `changed`
    moves the row's cadence along a ladder from `min_s` to `max_s` in steps of sqrt(2):
    unchanged x(1 + inc), changed x(1 - dec), to the nearest step and at least one. The
    defaults are Apache Nutch's AdaptiveFetchSchedule's."""

    json_schema_extra: ClassVar[dict[str, Any]] = {NOT_ABOVE_KEYWORD: ["min_s", "max_s"]}

    min_s: CadenceS
    max_s: CadenceS
    inc: Annotated[float, Meta(gt=0, le=MAX_ADAPT_INC)] = DEFAULT_INC
    dec: Annotated[float, Meta(gt=0, lt=1)] = DEFAULT_DEC


# shm.keys.site_pattern's rules, all of them: a pattern the document allows is stored.
SitePattern = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=253,
        pattern=r"^(?!(\*\.)?www\.)(\*\.[a-z0-9_-]+(\.[a-z0-9_-]+)+|[a-z0-9_-]+(\.[a-z0-9_-]+)*)$",
        description="The site of the route's keys. `*.example.com`: `example.com` for "
        "example.com and every host under it (other hosts keep their own site); "
        "`example.com` (no `*.`): that one site for every key of the route. A name is "
        "written as a key's site is named: lower-case, no port, trailing dot or leading "
        "`www.`.",
    ),
]


class RouteUpdate(Request, frozen=True):
    """Absent fields stay as they are; `default_cadence_s: null` clears the route's default
    (its rows then follow the global default); `adapt: null` turns adaptive cadence off.
    Turning it off, or moving its `min_s` or `max_s`, forgets what the route's rows learned
    (their learned cadences were steps of the old ladder). `site_pattern: null` clears the
    route's site pattern (its keys' sites are then their hosts)."""

    default_cadence_s: CadenceS | msgspec.UnsetType | None = msgspec.UNSET
    paused: bool | None = None
    adapt: AdaptUpdate | msgspec.UnsetType | None = msgspec.UNSET
    site_pattern: SitePattern | msgspec.UnsetType | None = msgspec.UNSET
    retire_after: RetireAfter | None = None


class Routes(msgspec.Struct, frozen=True, kw_only=True):
    routes: list[Route]
    default_cadence_s: int


class SettingsUpdate(Request, frozen=True):
    default_cadence_s: CadenceS


class NodeSettings(msgspec.Struct, frozen=True, kw_only=True):
    default_cadence_s: int


# --- sites ---------------------------------------------------------------------------------

SiteName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=259,
        pattern=r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*(?::[0-9]{1,5})?$",
        description="A site: its host name (ASCII; an IDN in its xn-- form), as a key's URL "
        "names it, or the name a route's `site_pattern` gives its keys. Lower-cased, and a "
        "port, trailing dots and a leading `www.` are dropped, as for a key's site; at most 253 "
        "characters after that.",
    ),
]
SiteMaxInFlight = Annotated[
    int,
    Meta(
        ge=0,
        le=4096,
        description="At most this many leases live at once on the site's keys (0: none "
        "granted); at most this node's site_permits_max.",
        extra_json_schema={LEASE_CAP_KEYWORD: "site_permits_max"},
    ),
]
SiteIntervalMs = Annotated[
    int, Meta(ge=0, le=86_400_000, description="At least this many ms between two grants.")
]


class SiteUpdate(Request, frozen=True):
    """Absent fields stay as they are; null clears the site's own value (the node's
    default applies again)."""

    max_in_flight: SiteMaxInFlight | msgspec.UnsetType | None = msgspec.UNSET
    min_interval_ms: SiteIntervalMs | msgspec.UnsetType | None = msgspec.UNSET


class SiteLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_in_flight: int | None  # null: no cap
    min_interval_ms: int | None  # null (own settings only): the node's default


class SiteState(msgspec.Struct, frozen=True, kw_only=True):
    """One site on this node: its own settings (stored, shared by every node), what grants
    follow now (its own, else the node's defaults), and its state in shared memory."""

    site: str
    settings: SiteLimits  # the site's own; null fields: the node's default
    in_force: SiteLimits
    in_flight: int  # leases holding one of its permits now
    blocked_until: int | None = None  # epoch ms, while blocked
    blocked_reason: Literal["retry_after", "failures"] | None = None
    last_grant_at: int | None = None  # the last grant that passed its spacing
    failure_streak: int = 0  # failed renders in a row, within the window
    failure_block_ms: int = 0  # the last failure block's length; the next doubles it
    # Due rows of the site on this node, from the keeper's last sites listing; null when
    # the listing is not available or does not reach the site.
    due: int | None = None


# In flight per site over the last hour (api.site_history): the supervisor counts every
# live lease by its site each second and keeps each minute's peak.
HISTORY_MINUTES = 60
HISTORY_SITES = 16  # the sites with the highest peaks over the hour, each with its series
HISTORY_LATEST = 64  # the sites with the most leases at the last count
SiteHashHex = Annotated[
    str,
    Meta(
        pattern="^[0-9a-f]{16}$",
        description="The site's 64-bit hash under this cluster's secret, in hex: it names a "
        "site the keeper's listing does not (a site with no due rows listed).",
    ),
]
InFlightCount = Annotated[int, Meta(ge=0)]
PeakPerMinute = Annotated[
    list[InFlightCount | None], Meta(max_length=HISTORY_MINUTES)
]  # null: not counted in that minute (the node was not running)
HistorySiteName = Annotated[str, Meta(min_length=1, max_length=253)]


class SiteSeries(Body, frozen=True):
    site_hash: SiteHashHex
    peak: InFlightCount  # its highest count over the hour
    # Each minute's highest count, aligned with SitesInFlight.minutes; 0 also when the site
    # was below the minute's kept sites (HISTORY_LATEST of each count).
    in_flight: PeakPerMinute
    site: HistorySiteName | None = None  # null: not among the keeper's listed sites


class SiteCount(Body, frozen=True):
    site_hash: SiteHashHex
    in_flight: InFlightCount
    site: HistorySiteName | None = None


class SitesInFlight(Body, frozen=True):
    """Leases in flight per site, each minute's peak over the last hour, as this node's
    supervisor counted them (every live lease, capped site or not)."""

    node: str
    minutes: Annotated[list[int], Meta(max_length=HISTORY_MINUTES)]  # each minute's first ms
    total: PeakPerMinute  # every lease in flight, sites or not: each minute's peak
    sites: Annotated[list[SiteSeries], Meta(max_length=HISTORY_SITES)]  # highest peak first
    latest: Annotated[list[SiteCount], Meta(max_length=HISTORY_LATEST)]  # at sampled_at
    sampled_at: int | None = None  # the supervisor's last count (epoch ms); null: none yet
    age_ms: int | None = None  # how old that count is, at the answer

    def __post_init__(self) -> None:
        # Read from shared memory: a record that does not hold together is refused whole.
        steps = [b - a for a, b in zip(self.minutes, self.minutes[1:], strict=False)]
        if any(step != 60_000 for step in steps) or any(m % 60_000 for m in self.minutes):
            raise ValueError("minutes must be consecutive whole minutes")
        if len(self.total) != len(self.minutes) or any(
            len(s.in_flight) != len(self.minutes) for s in self.sites
        ):
            raise ValueError("every series must have a value per minute")


class RenderNow(Request, frozen=True):
    key: Key


# --- admin ---------------------------------------------------------------------------------


class Health(Body, frozen=True):
    status: str
    worker: int | None = None
    pid: int | None = None


class Readiness(Body, frozen=True):
    status: str  # ready | draining | fenced (200); unready | stalled (503): api.status
    reason: str | None = None
    published_at: int | None = None
    publish_age_ms: int | None = None
    generation: int | None = None
    fenced: int | None = None  # in a cluster: due keys its fences hold back
    fenced_until: int | None = None  # when the last one ends (epoch ms; 0: not known)


ExplainState = Literal["missing", "paused", "leased", "held", "not_due", "claimable", "retired"]


class Explain(Body, frozen=True):
    key: str
    exists: bool
    claimable: bool
    reason: str
    now: int
    state: ExplainState = "missing"
    # Held back: until when, and why (`failed`: its renders failed; `unanswered`: its
    # leases expired with no result), after how many such attempts in a row.
    held_until: int | None = None
    held_for: Literal["failed", "unanswered"] | None = None
    attempts_in_a_row: int | None = None
    row: Row | None = None
    # The key's site: its URL's host, lower-cased, without www., or what its route's site
    # pattern names (absent: none).
    site: str | None = None
    cadence_s: int | None = None
    # Where the row's route adapts, or its renders said whether the page changed: its
    # learned cadence, its step on the route's ladder (0: min_s) out of how many, and its
    # recent renders, oldest first (true: changed).
    learned_cadence_s: int | None = None
    ladder_step: int | None = None
    ladder_steps: int | None = None
    recent_changes: list[bool] | None = None
    route_paused: bool | None = None
    render_class: dict[str, Any] | None = None
    rank: float | None = None
    lease: dict[str, Any] | None = None


class SiteEntry(Body, frozen=True):
    site: str  # the host, lower-cased, without www., port or credentials; or its route's pattern's
    due: int  # its due rows held by this node (routes not paused)
    held: int  # its rows held by this node
    oldest_due_at: int  # the earliest due time among its due rows (epoch ms)
    oldest_age_s: float  # how long that row has been due, now
    # From this node's site table, now: for a capped site, its cap and the leases live on
    # its keys (the site table counts permits only where there is a cap); for any site, a
    # block in force (until when, and why: the origin's Retry-After or failed renders).
    max_in_flight: int | None = None
    in_flight: int | None = None
    blocked_until: int | None = None
    blocked_reason: Literal["retry_after", "failures"] | None = None


class SitesListing(Body, frozen=True):
    """This node's sites by due rows, as of the keeper's last full report."""

    node: str
    generated_at: int  # when the keeper counted (epoch ms)
    age_ms: int  # how old the counts are
    sites_held: int  # sites with a row held by this node
    sites_with_due: int  # of them, those with a due row
    no_site_due: int  # due rows whose key names no host (paths): no site
    truncated: bool  # more sites have due rows than are listed here
    sites: list[SiteEntry]  # most due first; ties: the longest waiting first


class Overview(Body, frozen=True):
    now: int
    node: str
    instance: str
    worker: int
    status: str  # the claim status (api.status): ready, draining, stalled, unready
    status_reason: str
    pid: int
    lease_view: dict[str, Any]  # api.status.LeaseView: in flight from the lease census
    leases: dict[str, Any]
    ring: dict[str, Any]
    publish_age_ms: int | None = None
    supervisor: dict[str, Any] | None = None
    state_age_ms: int | None = None
    keeper: dict[str, Any] | None = None  # the keeper's KeeperStatistics, from worker 0
    keeper_statistics_age_ms: int | None = None  # since the keeper wrote that record
    completions: dict[str, Any] | None = None  # this worker's CompletionQueue.statistics()
    store: dict[str, Any] | None = None  # store.base.Writability, as this worker found it


# --- cluster -------------------------------------------------------------------------------


class ClusterMember(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    url: str  # where the fleet and the other nodes reach it (its advertised URL)
    started_at: int  # epoch ms, by the database's clock (0: unknown)
    heartbeat_age_ms: int  # by the database's clock, as of the read
    answering: bool = False  # the node that answered this request


class ClusterNodes(msgspec.Struct, frozen=True, kw_only=True):
    """GET /v1/cluster: the live nodes. A single node (SQLite) lists itself."""

    node: str  # the node answering
    version: str  # the answering node's renderqueue version
    clustered: bool  # False: a single node, not a cluster member
    ttl_s: float  # a node silent this long is dead
    nodes: list[ClusterMember]
