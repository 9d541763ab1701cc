"""The retired rows a keeper owns: never held (never due), counted apart, by route.

A retired row stays in the table (its reason and when), so the feed and the walks deliver
it like any row; the keeper takes it out of its queue and keeps its key hash and route
here instead, so queue-state counts retired rows per route exactly, as it counts held
ones: every event, walk and point read that moves a key into or out of retirement moves
it here. Memory is a dict entry a retired row (they are expected to be few beside the
held ones).
"""

from __future__ import annotations

from collections.abc import Iterable


class RetiredRows:
    def __init__(self) -> None:
        self._route_of: dict[int, str] = {}
        self._by_route: dict[str, int] = {}
        # What ownership is judged on, where it is not the key's own hash (a cluster that
        # owns keys by site: keeper.ownership.placements).
        self._placed: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._route_of)

    def __contains__(self, key_hash: int) -> bool:
        return key_hash in self._route_of

    def put(self, key_hash: int, route: str, placed: int | None = None) -> bool:
        """Count the key as retired under `route`; True when that changed anything.
        `placed`: its placement, when that is not its own hash."""
        if placed is not None and placed != key_hash:
            self._placed[key_hash] = placed
        old = self._route_of.get(key_hash)
        if old == route:
            return False
        if old is not None:
            self._drop_route(old)
        self._route_of[key_hash] = route
        self._by_route[route] = self._by_route.get(route, 0) + 1
        return True

    def discard(self, key_hash: int) -> bool:
        """The key is no longer retired (revived, deleted, or not this node's); True when
        it was."""
        old = self._route_of.pop(key_hash, None)
        if old is None:
            return False
        self._placed.pop(key_hash, None)
        self._drop_route(old)
        return True

    def discard_many(self, key_hashes: Iterable[int]) -> int:
        """`discard` for each hash that is here; returns how many were."""
        if not self._route_of:
            return 0
        found = self._route_of.keys() & set(key_hashes)
        for key_hash in found:
            self.discard(key_hash)
        return len(found)

    def hashes(self) -> list[int]:
        return list(self._route_of)

    def placements(self, key_hashes: Iterable[int]) -> list[int]:
        """Each key's placement, as `put` was given it."""
        placed = self._placed
        return [placed.get(h, h) for h in key_hashes]

    def by_route(self) -> dict[str, int]:
        """Retired rows per route, the routes by name."""
        return dict(sorted(self._by_route.items()))

    def _drop_route(self, route: str) -> None:
        left = self._by_route[route] - 1
        if left:
            self._by_route[route] = left
        else:
            del self._by_route[route]
