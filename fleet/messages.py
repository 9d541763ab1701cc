"""The node's fleet API bodies, as msgspec Structs.

The claim's request and response (and the lease in it) are the node's own Structs from
`wire.schemas`, so the claim cannot drift between the two sides. The rest are the client's
views: responses tolerate fields they do not know, so a newer node can add some; requests
leave out optional fields they do not set. Times are epoch ms, tokens opaque strings.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from wire.schemas import DEFAULT_LEASE_S, ClaimRequest, ClaimResponse, Lease

__all__ = [
    "DEFAULT_LEASE_S",
    "ClaimRequest",
    "ClaimResponse",
    "ClusterMember",
    "ClusterNodes",
    "CompletionItem",
    "CompletionsRequest",
    "ItemResult",
    "Lease",
    "Outcome",
    "Problem",
    "RenewItem",
    "RenewRequest",
    "ResultsResponse",
    "Unready",
]

# not_found: the origin answered 404 or 410 (the node retires a row after a streak).
Outcome = Literal["rendered", "failed", "gone", "not_found"]


class CompletionItem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    key: str
    token: str
    outcome: Outcome
    next_render_at: int | None = None
    # The origin turned the render away for this long (a 429 or 503's Retry-After): the
    # node blocks the key's whole site until then and hands the key back.
    site_retry_after_s: float | None = None
    # A rendered page differed from its last render, or not (None: not known).
    changed: bool | None = None


class CompletionsRequest(msgspec.Struct, frozen=True, kw_only=True):
    items: list[CompletionItem]


class ItemResult(msgspec.Struct, frozen=True, kw_only=True):
    """One item's fate in a completions or renew call; `error` is e.g. "lease_not_held",
    or "not_owner" with `owner`."""

    key: str
    ok: bool
    error: str | None = None
    lease_expires_at: int | None = None  # renew only
    detail: str | None = None  # in a cluster: which node said what, when not ok
    owner: str | None = None  # with not_owner: the node that owns the key now
    lease_ms: int | None = None  # renew only: the term the node renewed, from its answer


class ResultsResponse(msgspec.Struct, frozen=True, kw_only=True):
    results: list[ItemResult]


class RenewItem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    key: str
    token: str
    lease_s: int | None = None


class RenewRequest(msgspec.Struct, frozen=True, kw_only=True):
    items: list[RenewItem]


class Unready(msgspec.Struct, frozen=True, kw_only=True):
    """The body of a 503: the node's status (e.g. "unready", "loading")."""

    status: str = "unready"


class Problem(msgspec.Struct, frozen=True, kw_only=True):
    """An RFC 9457 application/problem+json body."""

    type: str = "about:blank"
    title: str = ""
    status: int = 0
    detail: str | None = None


class ClusterMember(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    url: str


class ClusterNodes(msgspec.Struct, frozen=True, kw_only=True):
    """GET /v1/cluster: the live nodes; a single node (`clustered` false) lists itself."""

    node: str
    clustered: bool = False
    nodes: list[ClusterMember] = []
