"""What a worker hands the API: its settings and its handles on the node's shared state.

One `Node` per worker process. Its store is used only from the event loop's thread: the
calls are sub-millisecond point reads and short writes, and a thread-pool hop would cost
more than the call itself. Completions wait for the write lock on the loop, not in the
store (api.completions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from api.completions import CompletionQueue
from api.routebook import RouteBook
from keeper.state import KeeperStatistics, decode_keeper_statistics
from shm import LeaseTable, ReadyRing, StateBuffer
from store.base import ScheduleStore


class ApiSettings(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    instance: str
    worker: int = 0
    fleet_token: str | None = None
    admin_token: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    # A long poll re-checks the ring's generation this often; the keeper publishes about
    # once a second, so 25 ms adds little latency and costs nothing measurable.
    poll_interval_s: float = 0.025
    retry_after_s: int = 1
    sitemap_boost: float = 1.0  # the keeper's, so explain ranks a row as the keeper does
    sitemap_route_rules: str | None = None  # a TOML file of URL-pattern rules


@dataclass(eq=False)
class Node:
    settings: ApiSettings
    store: ScheduleStore
    ring: ReadyRing
    leases: LeaseTable
    state: StateBuffer
    supervisor_state: StateBuffer | None = None
    keeper_statistics: StateBuffer | None = None  # written by the keeper (worker 0's thread)
    routes: RouteBook = field(init=False)
    completions: CompletionQueue = field(init=False)

    def __post_init__(self) -> None:
        self.routes = RouteBook(self.store)
        self.completions = CompletionQueue(self)

    def read_keeper_statistics(self) -> KeeperStatistics | None:
        """The keeper's last statistics record; None before its first, or when the payload
        does not decode as one (another build's record): never an error to serve."""
        if self.keeper_statistics is None:
            return None
        snapshot = self.keeper_statistics.read()
        if snapshot is None:
            return None
        try:
            return decode_keeper_statistics(snapshot.payload)
        except msgspec.DecodeError:
            return None

    def ready(self) -> bool:
        """Claims are granted only after the keeper's first publish into this node's ring."""
        return self.ring.generation > 0 and self.ring.published_at > 0
