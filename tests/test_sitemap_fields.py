"""sitemap.fields: changefreq cadences, every W3C datetime form, usable keys."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from sitemap.fields import (
    ALWAYS_FLOOR_S,
    cadence_for_changefreq,
    parse_w3c_datetime,
    url_problem,
)


def ms(*args: int) -> int:
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)  # type: ignore[arg-type,misc]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2024", ms(2024, 1, 1)),
        ("2024-03", ms(2024, 3, 1)),
        ("2024-03-05", ms(2024, 3, 5)),
        ("2024-03-05T10:20Z", ms(2024, 3, 5, 10, 20)),
        ("2024-03-05T10:20+01:00", ms(2024, 3, 5, 9, 20)),
        ("2024-03-05T10:20:30Z", ms(2024, 3, 5, 10, 20, 30)),
        ("2024-03-05T10:20:30-05:30", ms(2024, 3, 5, 15, 50, 30)),
        ("2024-03-05T10:20:30.45Z", ms(2024, 3, 5, 10, 20, 30) + 450),
        ("2024-03-05T10:20:30.123456789+00:00", ms(2024, 3, 5, 10, 20, 30) + 123),
        ("  2024-03-05T10:20:30Z \n", ms(2024, 3, 5, 10, 20, 30)),
        ("2024-03-05T10:20:30", ms(2024, 3, 5, 10, 20, 30)),  # no zone: UTC
        ("2024-03-05t10:20:30z", ms(2024, 3, 5, 10, 20, 30)),
    ],
)
def test_w3c_datetime_forms(text: str, expected: int) -> None:
    assert parse_w3c_datetime(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "yesterday",
        "24-03-05",
        "2024-13-01",
        "2024-02-30",
        "2024-03-05T25:00Z",
        "2024-03-05 10:20Z",
        "2024-03-05T10:20:30+25:00",
        "2024-3-5",
    ],
)
def test_w3c_datetime_rejects(text: str) -> None:
    assert parse_w3c_datetime(text) is None


def test_changefreq_cadences() -> None:
    assert cadence_for_changefreq("always") == ALWAYS_FLOOR_S == 900
    assert cadence_for_changefreq("hourly") == 3600
    assert cadence_for_changefreq(" Daily ") == 86400
    assert cadence_for_changefreq("weekly") == 604800
    assert cadence_for_changefreq("monthly") == 2592000
    assert cadence_for_changefreq("yearly") == 31536000
    assert cadence_for_changefreq("never") == 31536000
    assert cadence_for_changefreq("sometimes") is None
    assert cadence_for_changefreq(None) is None


@pytest.mark.parametrize(
    ("loc", "problem"),
    [
        ("https://example.com/a?b=1#c", None),
        ("http://[::1]:8080/x", None),
        ("https://bücher.example/straße", None),
        (None, "missing_loc"),
        ("", "missing_loc"),
        ("/relative/path", "bad_url"),
        ("ftp://example.com/a", "bad_url"),
        ("javascript:alert(1)", "bad_url"),
        ("https://exa mple.com/", "bad_url"),
        ("https://example.com/a\tb", "bad_url"),
        ("https:///no-host", "bad_url"),
        ("https://example.com:99999/", "bad_url"),
        ("https://example.com/" + "a" * 2048, "too_long"),
    ],
)
def test_url_problem(loc: str | None, problem: str | None) -> None:
    assert url_problem(loc) == problem
