"""sitemap.rules: routes by URL pattern, from TOML, with clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from sitemap.rules import RouteMatch, RouteRules, RouteRulesError, glob_to_regex

RULES = """
default_route = "page"

[[rules]]
route = "home"
path = "/"

[[rules]]
route = "product"
path = "/p/*"
cadence_s = 86400

[[rules]]
route = "category"
path = "/c/**"

[[rules]]
route = "search"
regex = "[?&]q="
host = "Shop.Example"
"""


def test_first_match_wins_and_defaults() -> None:
    rules = RouteRules.from_toml(RULES)
    assert rules.match("https://shop.example/") == RouteMatch(route="home", cadence_s=None)
    assert rules.match("https://shop.example") == RouteMatch(route="home", cadence_s=None)
    assert rules.match("https://shop.example/p/boot-1?colour=red") == RouteMatch(
        route="product", cadence_s=86400
    )
    # * stays inside one segment; ** crosses segments
    assert rules.match("https://shop.example/p/boot-1/reviews").route == "page"  # type: ignore[union-attr]
    assert rules.match("https://shop.example/c/a/b/c/").route == "category"  # type: ignore[union-attr]
    assert rules.match("https://shop.example/find?q=boot").route == "search"  # type: ignore[union-attr]
    # host-limited rule does not match elsewhere
    assert rules.match("https://other.example/find?q=boot").route == "page"  # type: ignore[union-attr]


def test_no_default_route_means_no_match() -> None:
    rules = RouteRules.from_toml('[[rules]]\nroute = "home"\npath = "/"\n')
    assert rules.match("https://e.com/other") is None


def test_glob() -> None:
    assert glob_to_regex("/a/*.html").fullmatch("/a/b.html")
    assert not glob_to_regex("/a/*.html").fullmatch("/a/b/c.html")
    assert glob_to_regex("/a/**.html").fullmatch("/a/b/c.html")
    assert glob_to_regex("/x?z").fullmatch("/xyz")
    assert not glob_to_regex("/x?z").fullmatch("/x/z")
    assert glob_to_regex("/a+b(c)").fullmatch("/a+b(c)")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules = [", "not valid TOML"),
        ('[[rules]]\nroute = "x"\n', "exactly one of path"),
        ('[[rules]]\nroute = "x"\npath = "/"\nregex = "."\n', "exactly one of path"),
        ('[[rules]]\nroute = "x"\nregex = "("\n', "does not compile"),
        ('[[rules]]\nroute = "x"\npath = "/"\ncadence_s = 0\n', "positive"),
        ('[[rules]]\nroute = "x"\npath = "/"\npattern = "/"\n', "pattern"),
        ('[[rules]]\nroute = ""\npath = "/"\n', "must match"),
        ('[[rules]]\nroute = "Product Pages"\npath = "/"\n', "must match"),
        ('default_route = "Page"\n', "must match"),
        ("default_route = 3\n", "default_route"),
    ],
)
def test_bad_rules_are_refused_with_a_reason(text: str, message: str) -> None:
    with pytest.raises(RouteRulesError) as caught:
        RouteRules.from_toml(text, source="r.toml")
    assert message in str(caught.value)
    assert "r.toml" in str(caught.value)


def test_load_the_example_rules() -> None:
    path = Path(__file__).parent.parent / "examples" / "route-rules.toml"
    rules = RouteRules.load(path)
    assert rules.match("https://shop.example/p/x-1").route == "product"  # type: ignore[union-attr]
    assert rules.match("https://shop.example/about").route == "page"  # type: ignore[union-attr]


def test_load_missing_file(tmp_path: Path) -> None:
    with pytest.raises(RouteRulesError, match="cannot read"):
        RouteRules.load(tmp_path / "nope.toml")
