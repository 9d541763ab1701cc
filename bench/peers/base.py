"""The two faces a peer queue shows the harness.

A `Peer` lives in the parent: it creates its tables, loads the rows, churns
them and drops everything at the end. A `Claimant` lives in a claimant process
(or in the parent for the growth probe): it claims due keys, pushing each one's
due time to its lease's end, and completes them, rescheduling by cadence.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from bench.harness.workload import Rows


class Spec(msgspec.Struct, frozen=True, kw_only=True):
    """What a claimant process needs to connect to a loaded peer (picklable, small)."""

    kind: str
    params: dict[str, str] = {}


class Claimant(Protocol):
    def claim(self, n: int, now_ms: int, lease_ms: int) -> list[str]:
        """Up to n due keys, most overdue first, each pushed to now_ms + lease_ms."""
        ...

    def complete(self, keys: list[str], now_ms: int) -> None:
        """Each key rendered: due again one cadence from now."""
        ...

    def close(self) -> None: ...


class Peer(Protocol):
    name: str

    def load(self, rows: Rows) -> None: ...

    def churn(self, rows: Rows, plan: list[tuple[int, int]]) -> None: ...

    def spec(self) -> Spec: ...

    def drop(self) -> None: ...
