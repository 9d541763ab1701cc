"""GET /v1/sites: this node's sites by due rows, from the keeper's sites listing.

The keeper counts the due rows of every site at each full report (keeper.counts,
`count_sites`) and writes the first SITES_LISTED by due into a state buffer of its own;
any worker serves them from there, without the keeper. The counts are served under the
rule queue-state's are (keeper.state.vouches): only while the keeper is live, exact and
ready and its counts are fresh, and only the listing taken at the report queue-state's
counts come from; otherwise 503, never stale or partial figures. What is live per site
(leases in flight, the cap in force, a block) is read from this node's site table
(shm.sites) at the request, for the listed sites only.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from api.body import json_response
from api.node import Node
from keeper.state import (
    SiteList,
    SiteRow,
    decode_queue_state,
    decode_site_list,
    liveness,
    vouches,
)
from shm.segment import now_ms
from shm.sites import SiteInfo
from wire.schemas import NodeStatus, SiteEntry, SitesListing

DEFAULT_TOP = 20


def sites(node: Node, top: int) -> SitesListing | Response:
    now = now_ms()
    listing, why = _listing(node, now)
    if listing is None:
        return json_response(
            NodeStatus(status="unavailable", detail=why, retry_after_s=node.settings.retry_after_s),
            503,
            headers={"Retry-After": str(node.settings.retry_after_s)},
        )
    group = listing.sites
    shown = group.top[:top]
    table = node.sites
    infos = (
        [None] * len(shown)
        if table is None
        else [table.info(h, now) for h in listing.site_hashes[: len(shown)]]
    )
    return SitesListing(
        node=listing.node,
        generated_at=listing.generated_at,
        age_ms=max(0, now - listing.generated_at),
        sites_held=group.held,
        sites_with_due=group.with_due,
        no_site_due=group.no_site_due,
        truncated=group.with_due > len(shown),
        sites=[_entry(row, info, now) for row, info in zip(shown, infos, strict=True)],
    )


def _entry(row: SiteRow, info: SiteInfo | None, now: int) -> SiteEntry:
    entry = SiteEntry(
        site=row.site,
        due=row.due,
        held=row.held,
        oldest_due_at=row.oldest_due_at,
        oldest_age_s=max(0.0, (now - row.oldest_due_at) / 1000),
    )
    if info is None:
        return entry
    blocked = info.blocked_until > now
    capped = info.max_in_flight is not None
    return msgspec.structs.replace(
        entry,
        in_flight=info.in_flight if capped else None,
        max_in_flight=info.max_in_flight,
        blocked_until=info.blocked_until if blocked else None,
        blocked_reason=info.blocked_reason if blocked else None,
    )


def due_of(node: Node, site: str, now: int) -> int | None:
    """One site's due rows from the listing (GET /v1/sites/{site}): 0 when the listing
    holds every site with due rows and not this one; None when it cannot say (no listing
    served now, or the site is past the listed ones)."""
    listing, _ = _listing(node, now)
    if listing is None:
        return None
    for row in listing.sites.top:
        if row.site == site:
            return row.due
    return None if listing.truncated else 0


def _listing(node: Node, now: int) -> tuple[SiteList | None, str]:
    """The keeper's listing if it may be served now, else None and why not."""
    state = node.state.read()
    if state is None:
        return None, "the keeper has not reported yet"
    reported = decode_queue_state(state.payload)
    if not vouches(reported, now):
        seen = liveness(reported, now)
        reason = seen.reason if not seen.live else reported.trust.exact_reason
        return None, f"the keeper does not vouch for its counts: {reason or reported.now.status}"
    if node.site_list is None:
        return None, "this node has no sites listing"
    snapshot = node.site_list.read()
    if snapshot is None:
        return None, "the keeper has not listed its sites yet"
    try:
        listing = decode_site_list(snapshot.payload)
    except msgspec.DecodeError:
        return None, "the sites listing is of another build"
    if listing.generated_at != reported.trust.counts_at:
        return None, "the sites listing is not of the keeper's last report yet"
    return listing, ""
