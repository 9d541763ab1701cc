"""The workload every section and peer gets: generated rows of realistic URLs over four
routes and cadences, a share of them due, and the churn a live store carries.

Generation is seeded, so every peer in a run loads the same rows.
"""

from __future__ import annotations

import os
import random
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec

ROUTES = (("product", 3600), ("category", 21600), ("article", 86400), ("search", 604800))
KEY_PREFIX = "https://shop.example.com/"
DEFAULT_LEASE_MS = 15 * 60 * 1000  # outlives every arm, so no lease lapses mid-run
PG_DSN = os.environ.get("RENDERQUEUE_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("RENDERQUEUE_BENCH_REDIS", "redis://127.0.0.1:6379/0")


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """`rows` rows, `due_fraction` of them due at `now_ms`, the rest due within a cadence."""

    rows: int
    now_ms: int
    due_fraction: float = 0.2
    seed: int = 7


class Rows(msgspec.Struct, kw_only=True):
    """The workload's rows as columns (cheap to build and to hand to a bulk load)."""

    keys: list[str]
    routes: list[str]
    cadences_s: list[int]
    sitemaps: list[bool]
    next_render_at: list[int]

    def __len__(self) -> int:
        return len(self.keys)

    def chunks(self, size: int) -> Iterator[range]:
        for start in range(0, len(self.keys), size):
            yield range(start, min(start + size, len(self.keys)))


SLUGS = (
    "organic-cotton-crew-neck-t-shirt",
    "stainless-steel-water-bottle-750ml",
    "wireless-noise-cancelling-headphones",
    "handmade-ceramic-coffee-mug-set",
    "waterproof-hiking-boots-women",
)


def key_of(index: int) -> str:
    """A realistic URL of 70 to 90 bytes: `https://shop.example.com/<route>/<slug>-<id>`."""
    route = ROUTES[index % len(ROUTES)][0]
    return f"{KEY_PREFIX}{route}/{SLUGS[index % len(SLUGS)]}-{index:08d}"


def due_at(rng: random.Random, now_ms: int, cadence_s: int, due_fraction: float) -> int:
    """Due `due_fraction` of the time (up to a cadence late), else within the next cadence."""
    return now_ms + int((rng.random() - due_fraction) * cadence_s * 1000)


def generate(workload: Workload) -> Rows:
    rng = random.Random(workload.seed)
    rows = Rows(keys=[], routes=[], cadences_s=[], sitemaps=[], next_render_at=[])
    for index in range(workload.rows):
        route, cadence_s = ROUTES[index % len(ROUTES)]
        rows.keys.append(key_of(index))
        rows.routes.append(route)
        rows.cadences_s.append(cadence_s)
        rows.sitemaps.append(index % 3 == 0)
        rows.next_render_at.append(due_at(rng, workload.now_ms, cadence_s, workload.due_fraction))
    return rows


def churn_plan(workload: Workload, rows: Rows, fraction: float) -> list[tuple[int, int]]:
    """(row index, new due time) for `fraction` of the rows, keeping the due share."""
    rng = random.Random(workload.seed + 1)
    picked = rng.sample(range(len(rows)), int(len(rows) * fraction))
    return [
        (i, due_at(rng, workload.now_ms, rows.cadences_s[i], workload.due_fraction)) for i in picked
    ]


def due_count(rows: Rows, now_ms: int) -> int:
    return sum(1 for due in rows.next_render_at if due <= now_ms)


def unique_suffix() -> str:
    return f"{os.getpid()}_{uuid.uuid4().hex[:8]}"


def reachable(host: str, port: int) -> str | None:
    """None when a TCP connection opens, else why it did not."""
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as exc:
        return f"{host}:{port} unreachable ({exc})"
    return None


def row_writes(rows: Rows, indexes: range | list[int]) -> list[Any]:
    from store.rows import RowWrite

    return [
        RowWrite(
            key=rows.keys[i],
            route=rows.routes[i],
            next_render_at=rows.next_render_at[i],
            cadence_s=rows.cadences_s[i],
            sitemap=rows.sitemaps[i],
        )
        for i in indexes
    ]
