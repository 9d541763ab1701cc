"""The node's fleet API bodies, as msgspec Structs (the shapes are the node issue's).

Responses tolerate fields they do not know, so a newer node can add some; requests
leave out optional fields they do not set. Times are epoch ms, tokens decimal strings.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Outcome = Literal["rendered", "failed", "gone"]


class ClaimRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    max: int  # 1..1000
    worker: str
    lease_s: int = 300  # 5..3600
    wait_s: int = 0  # 0..30: long-poll until the next publish when nothing is due


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    token: str
    route: str
    due_at: int
    lease_expires_at: int
    sitemap: bool = False
    cadence_s: int | None = None


class ClaimResponse(msgspec.Struct, frozen=True, kw_only=True):
    leases: list[Lease]
    status: str = "ready"


class CompletionItem(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    key: str
    token: str
    outcome: Outcome
    next_render_at: int | None = None


class CompletionsRequest(msgspec.Struct, frozen=True, kw_only=True):
    items: list[CompletionItem]


class ItemResult(msgspec.Struct, frozen=True, kw_only=True):
    """One item's fate in a completions or renew call; `error` is e.g. "lease_not_held"."""

    key: str
    ok: bool
    error: str | None = None
    lease_expires_at: int | None = None  # renew only


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
