"""Boundary checks: each bad field is a ValueError that names the field and the row."""

from __future__ import annotations

import pytest

from store.rows import Completion, RowWrite
from store.validate import (
    check_completions,
    check_consumer,
    check_deletes,
    check_key,
    check_route_name,
    check_upserts,
)


def good(**changes: object) -> RowWrite:
    fields: dict[str, object] = {"key": "/p/1", "route": "product", "next_render_at": 1_000}
    fields.update(changes)
    return RowWrite(**fields)  # type: ignore[arg-type]


def test_a_good_batch_passes() -> None:
    check_upserts([good(), good(key="/p/2", cadence_s=60, sitemap=True)])
    check_deletes(["/p/3"], [good()])
    check_key("x" * 2048)
    check_key("é" * 1024)  # 2,048 UTF-8 bytes exactly


@pytest.mark.parametrize(
    ("row", "words"),
    [
        (good(key=""), ["upsert[1]", "key is empty"]),
        (good(key="/a\x00b"), ["upsert[1]", "NUL"]),
        (good(key="/é\x00b"), ["upsert[1]", "NUL"]),
        (good(key="x" * 2049), ["upsert[1]", "2049 UTF-8 bytes", "2048"]),
        (good(key="é" * 1025), ["upsert[1]", "2050 UTF-8 bytes"]),
        (good(key="\ud800"), ["upsert[1]", "not valid UTF-8"]),
        (good(key=7), ["upsert[1]", "key must be a string"]),
        (good(route="Product"), ["upsert[1]", "route", "'Product'"]),
        (good(route=""), ["upsert[1]", "route"]),
        (good(route="-x"), ["upsert[1]", "route"]),
        (good(route="a" * 65), ["upsert[1]", "route"]),
        (good(route="pro duct"), ["upsert[1]", "route"]),
        (good(cadence_s=0), ["upsert[1]", "cadence_s", "positive whole number"]),
        (good(cadence_s=-5), ["upsert[1]", "cadence_s"]),
        (good(cadence_s=1.5), ["upsert[1]", "cadence_s"]),
        (good(cadence_s=60.0), ["upsert[1]", "cadence_s"]),
        (good(cadence_s=True), ["upsert[1]", "cadence_s"]),
        (good(cadence_s="60"), ["upsert[1]", "cadence_s"]),
        (good(cadence_s=2**31), ["upsert[1]", "cadence_s", "limit"]),
        (good(next_render_at=2**63), ["upsert[1]", "next_render_at", "outside"]),
        (good(next_render_at=1.0), ["upsert[1]", "next_render_at", "integer"]),
        (good(next_render_at=True), ["upsert[1]", "next_render_at"]),
        (good(next_render_at=None), ["upsert[1]", "next_render_at"]),
        (good(sitemap=1), ["upsert[1]", "sitemap"]),
    ],
)
def test_a_bad_row_names_the_field_and_the_row(row: RowWrite, words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        check_upserts([good(key="/ok"), row])
    for word in words:
        assert word in str(caught.value)


def test_route_names_accepted() -> None:
    for name in ("product", "p", "0", "a.b-c_d", "a" * 64):
        assert check_route_name(name) == name


def test_bad_deletes() -> None:
    with pytest.raises(ValueError, match=r"delete\[1\].*key is empty"):
        check_deletes(["/a", ""], [])
    with pytest.raises(ValueError, match="one string"):
        check_deletes("/a", [])
    with pytest.raises(ValueError, match="also in upsert"):
        check_deletes(["/p/1"], [good()])


@pytest.mark.parametrize(
    ("item", "words"),
    [
        (Completion(key="", outcome="rendered", now=1), ["completion[0]", "key is empty"]),
        (Completion(key="/a", outcome="done", now=1), ["completion[0]", "outcome"]),  # type: ignore[arg-type]
        (Completion(key="/a", outcome="rendered", now=1.5), ["completion[0]", "now"]),  # type: ignore[arg-type]
        (Completion(key="/a", outcome="failed", now=False), ["completion[0]", "now"]),
        (
            Completion(key="/a", outcome="rendered", now=1, next_render_at=2.0),  # type: ignore[arg-type]
            ["completion[0]", "next_render_at"],
        ),
    ],
)
def test_bad_completions(item: Completion, words: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        check_completions([item])
    for word in words:
        assert word in str(caught.value)


def test_consumer_names() -> None:
    assert check_consumer("keeper") == "keeper"
    for bad in ("", "x" * 201, None):
        with pytest.raises(ValueError, match="consumer"):
            check_consumer(bad)
