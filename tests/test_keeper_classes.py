"""Classes and rank as DESIGN.md defines them; ids relabel in place on a settings change."""

from __future__ import annotations

from keeper.classes import (
    DEFAULT_CADENCE_S,
    Classifier,
    ClassTable,
    RenderClass,
    classify,
    rank,
)
from store.rows import Route, Row


def row(route: str = "product", cadence: int | None = None, sitemap: bool = False) -> Row:
    return Row(key="/k", route=route, cadence_s=cadence, sitemap=sitemap, next_render_at=0)


def test_class_is_route_cadence_its_source_and_sitemap() -> None:
    routes = {"product": Route(route="product", default_cadence_s=3600)}
    assert classify(row(), routes, 600) == RenderClass("product", 3600, False, False)
    assert classify(row(cadence=3600), routes, 600) == RenderClass("product", 3600, True, False)
    assert classify(row("blog", sitemap=True), routes, 600) == RenderClass("blog", 600, False, True)
    assert classify(row("blog"), {}, DEFAULT_CADENCE_S).cadence_s == 86_400


def test_rank_is_lateness_in_cadences_plus_the_sitemap_boost() -> None:
    hourly = RenderClass("p", 3600, False, False)
    assert rank(0, 1_800_000, hourly, 2.0) == 0.5
    assert rank(0, 1_800_000, RenderClass("p", 3600, False, True), 2.0) == 2.5
    assert rank(1_800_000, 0, hourly, 2.0) == -0.5


def test_a_route_default_change_relabels_the_class_in_place() -> None:
    table = ClassTable(1.0)
    classifier = Classifier(table)
    classifier.set_settings({"p": Route(route="p", default_cadence_s=60)}, 86_400)
    plain = classifier.class_id("p", None, False)
    own = classifier.class_id("p", 60, False)
    assert plain != own and table.cadence_ms()[plain] == 60_000
    classifier.set_settings({"p": Route(route="p", default_cadence_s=120, paused=True)}, 86_400)
    assert classifier.plan() == [(plain, RenderClass("p", 120, False, False))]
    table.relabel(plain, RenderClass("p", 120, False, False))
    assert classifier.class_id("p", None, False) == plain
    assert table.cadence_ms()[plain] == 120_000 and table.paused(plain) and table.paused(own)
