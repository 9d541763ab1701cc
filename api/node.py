"""What a worker hands the API: its settings and its handles on the node's shared state.
Plain data: the services the handlers share (api.services) are built beside it by the
app (api.app), each with only what it uses.

One `Node` per worker process. No request waits on its store on the event loop: store
calls are made on the worker's store lane (api.lane), one thread, so a store that stops
answering holds only the requests that need it, never `/healthz`, `/readyz` or
`/metrics`. On SQLite the claim path's reads and the completions stay on the loop, where
they take microseconds and a thread hop would cost more than the call; completions wait
for the write lock on the loop, not in the store (api.completions).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from api.lane import StoreLane
from api.routebook import RouteBook
from keeper.state import KeeperStatistics, decode_keeper_statistics
from shm import LeaseTable, ReadyRing, SiteTable, StateBuffer, key_hashes
from shm.marks import WriteMarks
from store.base import ScheduleStore


class ApiSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The settings a worker's API reads. No defaults here: they are the node's settings
    (workers.config.api_settings fills every field), so a value has one source."""

    node: str
    instance: str
    worker: int
    fleet_token: str | None
    admin_token: str | None
    metrics_token: str | None  # read-only (api.auth)
    metrics_open_on_loopback: bool
    max_body_bytes: int
    # A long poll re-checks the ring's generation this often.
    poll_interval_s: float
    retry_after_s: int
    # The keeper's stall_after_s: a ring published longer ago than this is a keeper that
    # is not publishing, and claims drain what it published last (api.status).
    stall_after_ms: int
    sitemap_boost: float  # the keeper's, so explain ranks a row as the keeper does
    sitemap_route_rules: str | None  # a TOML file of URL-pattern rules
    # In a cluster another node takes this one's keys once its leases could have ended:
    # leases are capped at max_lease_s, and a keeper that stops publishing stops grants
    # at once (no draining: its last set may hold keys that have moved since).
    clustered: bool
    max_lease_s: int
    ownership: Literal["key", "site"]  # what divides a cluster's keys (workers.config)
    # Where the fleet and the other nodes reach this node (workers.config advertised), and
    # the member list's TTL: GET /v1/cluster lists the nodes live by it.
    advertised_url: str
    node_ttl_s: float
    # The highest max_in_flight a site may be given here (the site table's permit words).
    site_permits_max: int
    # A peer asked for its queue-state, or handed a completion another node granted, has
    # this long to answer; past it the peer is named as missing (never waited on).
    peer_timeout_s: float


def read_keeper_statistics(buffer: StateBuffer | None) -> KeeperStatistics | None:
    """The keeper's last statistics record; None before its first, or when the payload
    does not decode as one (another build's record): never an error to serve."""
    if buffer is None:
        return None
    snapshot = buffer.read()
    if snapshot is None:
        return None
    try:
        return decode_keeper_statistics(snapshot.payload)
    except msgspec.DecodeError:
        return None


@dataclass(eq=False)
class Node:
    settings: ApiSettings
    store: ScheduleStore
    ring: ReadyRing
    leases: LeaseTable
    state: StateBuffer
    supervisor_state: StateBuffer | None = None
    keeper_statistics: StateBuffer | None = None  # written by the keeper (worker 0's thread)
    site_list: StateBuffer | None = None  # the keeper's sites listing (keeper.state.SiteList)
    # In flight per site over the last hour, the supervisor's (api.site_history).
    site_history: StateBuffer | None = None
    # Without them every granted row is read back (tests that build a bare node).
    marks: WriteMarks | None = None
    # Where its store calls are made; a worker opens its store on it (api.lane).
    lane: StoreLane = field(default_factory=StoreLane)
    # Per-site caps, spacing and blocks (shm.sites); None: the lease table's, if it has one.
    sites: SiteTable | None = None
    # The routes and settings, read through a short cache shared by the worker's handlers.
    routes: RouteBook = field(init=False)
    # This worker's own lease census (taken at, census) when the supervisor's is missing.
    own_census: tuple[int, dict[str, Any]] | None = field(default=None, init=False)
    # Claims long-polling on this worker now (api.claims.claim): fleet workers idle for
    # want of due work. Only the worker's event loop changes it.
    claims_waiting: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.lane.hot_inline = not self.store.remote
        if self.sites is None:
            self.sites = self.leases.sites
        elif self.leases.sites is not self.sites:
            self.leases.use_sites(self.sites)
        self.routes = RouteBook(self.store)

    def read_keeper_statistics(self) -> KeeperStatistics | None:
        return read_keeper_statistics(self.keeper_statistics)

    def stamp_written(self, hashes: Sequence[int]) -> None:
        """Mark keys as written by this thread's last commit (shm.marks): after the commit,
        before the write is answered or its lease released. On the thread that wrote: a
        store's write position is its own thread's (api.lane)."""
        if self.marks is not None and hashes:
            self.marks.stamp(hashes, self.store.write_position)

    def stamp_keys_written(self, keys: Iterable[str]) -> None:
        if self.marks is not None:
            self.stamp_written(key_hashes([key.encode() for key in keys]).tolist())

    def ready(self) -> bool:
        """Claims are granted only after the keeper's first publish into this node's ring."""
        return self.ring.generation > 0 and self.ring.published_at > 0
