"""One site's settings and state: `PUT /v1/sites/{site}`, `GET /v1/sites/{site}`.

A site's own settings are stored (the `site_settings` table, shared by every node of a
cluster) and reach every node's keeper through the change feed, which puts them in the
node's site table (shm/sites.py); the worker that handled the PUT puts them in at once
too, so its own next claim already follows them, and a keeper that read the site's row
before this write puts nothing older over them (keeper.runner, `_apply_sites`). The
state (permits in flight, block, last grant, failure streak) is this node's shared memory.
"""

from __future__ import annotations

import msgspec

from api.node import Node
from api.problems import invalid_field
from api.schedule import store_error
from api.site_list import due_of
from shm.keys import site_hash, site_of
from shm.segment import now_ms
from store.rows import SiteSettings
from wire.schemas import SiteLimits, SiteState, SiteUpdate


def site_name(raw: str) -> str:
    """A site as a key's URL names it: `site_of`'s rules (lower-case, no port, trailing
    dots or leading `www.`) applied to a host given alone."""
    return site_of(b"x://" + raw.encode("ascii", "replace")).decode("ascii", "replace")


def set_site(node: Node, raw: str, update: SiteUpdate) -> SiteState:
    site = site_name(raw)
    current = node.store.get_site(site) or SiteSettings(site=site)
    cap = current.max_in_flight
    if not isinstance(update.max_in_flight, msgspec.UnsetType):
        cap = update.max_in_flight
    interval = current.min_interval_ms
    if not isinstance(update.min_interval_ms, msgspec.UnsetType):
        interval = update.min_interval_ms
    most = node.settings.site_permits_max
    if cap is not None and cap > most:
        raise invalid_field(
            "$.max_in_flight",
            f"{cap} is over this node's site_permits_max ({most}), the most permits a site has",
        )
    settings = SiteSettings(site=site, max_in_flight=cap, min_interval_ms=interval)
    try:
        node.store.set_site(settings)
    except ValueError as exc:
        raise store_error(exc) from None
    if node.sites is not None:
        # The keeper puts it in too when the feed delivers it; this worker's next claim
        # need not wait for that.
        node.sites.configure(site_hash(site.encode()), cap, interval)
    return _state(node, settings)


def get_site(node: Node, raw: str) -> SiteState:
    site = site_name(raw)
    return _state(node, node.store.get_site(site) or SiteSettings(site=site))


def _state(node: Node, settings: SiteSettings) -> SiteState:
    own = SiteLimits(max_in_flight=settings.max_in_flight, min_interval_ms=settings.min_interval_ms)
    now = now_ms()
    due = due_of(node, settings.site, now)
    if node.sites is None:
        return SiteState(
            site=settings.site,
            settings=own,
            in_force=SiteLimits(
                max_in_flight=settings.max_in_flight,
                min_interval_ms=settings.min_interval_ms or 0,
            ),
            in_flight=0,
            due=due,
        )
    info = node.sites.info(site_hash(settings.site.encode()), now)
    blocked = info.blocked_until > now
    return SiteState(
        site=settings.site,
        settings=own,
        in_force=SiteLimits(max_in_flight=info.max_in_flight, min_interval_ms=info.min_interval_ms),
        in_flight=info.in_flight,
        blocked_until=info.blocked_until if blocked else None,
        blocked_reason=info.blocked_reason if blocked else None,
        last_grant_at=info.last_grant_at or None,
        failure_streak=info.failure_streak,
        failure_block_ms=info.failure_block_ms,
        due=due,
    )
