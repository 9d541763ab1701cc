"""The worker's route book (api.routebook): reading it never calls the store; it is fresh
for its TTL after a reload, and not after an invalidate, even one made while a reload
(on another thread: the store lane) was reading."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from api.routebook import RouteBook
from store.rows import Route, Row


class Routes:
    """A store's routes and default, counting reads; `during` runs inside a read."""

    def __init__(self) -> None:
        self.table = {"product": Route(route="product", default_cadence_s=600, paused=False)}
        self.default = 3600
        self.reads = 0
        self.during: Callable[[], None] | None = None

    def routes(self) -> list[Route]:
        self.reads += 1
        found = list(self.table.values())
        if self.during is not None:
            during, self.during = self.during, None
            during()
        return found

    def default_cadence_s(self) -> int:
        return self.default


def row(route: str, cadence_s: int | None = None) -> Row:
    return Row(
        key="/k",
        route=route,
        cadence_s=cadence_s,
        sitemap=False,
        next_render_at=0,
        last_rendered_at=None,
        last_outcome=None,
        version=1,
    )


def test_the_book_is_read_only_when_refreshed_and_an_invalidate_beats_a_reload() -> None:
    store = Routes()
    book = RouteBook(cast(Any, store), ttl_s=60)
    assert not book.fresh and book.routes() == {} and store.reads == 0
    book.refresh()
    assert book.fresh and store.reads == 1
    assert book.grant_cadence_s(row("product")) == 600
    assert book.grant_cadence_s(row("other")) == 3600
    assert book.grant_cadence_s(row("product", 60)) == 60
    book.refresh()
    assert store.reads == 1  # fresh: no read

    # A route paused through this worker: invalidated; a reload that read before the
    # invalidate installs what it read but is not fresh, so the next use reads again.
    store.table["product"] = Route(route="product", default_cadence_s=600, paused=True)
    book.invalidate()
    assert not book.fresh
    store.during = book.invalidate
    book.refresh()
    assert store.reads == 2 and not book.fresh
    book.refresh()
    assert store.reads == 3 and book.fresh
    assert book.paused("product") and book.grant_cadence_s(row("product")) is None
