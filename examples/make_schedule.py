"""Regenerates examples/schedule.jsonl and examples/routes.json (deterministic).

    .venv/bin/python examples/make_schedule.py

A small shop: a few thousand URLs across several routes and cadences, about a third of
them due when loaded. `due_in_s` is relative to the moment the demo loads the file, so the
example never goes stale; a negative value is overdue by that many seconds.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_CADENCE_S = 86_400
ROUTES = [
    {"route": "home", "default_cadence_s": 300, "paused": False},
    {"route": "product", "default_cadence_s": 3_600, "paused": False},
    {"route": "category", "default_cadence_s": 21_600, "paused": False},
    {"route": "article", "default_cadence_s": 86_400, "paused": False},
    {"route": "search", "paused": False},  # no default: the global default applies
    {"route": "legacy", "default_cadence_s": 3_600, "paused": True},
]
# route -> (rows, share from a sitemap, share carrying their own cadence, that cadence)
SHAPE = {
    "home": (6, 1.0, 0.0, None),
    "product": (2_000, 0.8, 0.1, 900),
    "category": (400, 1.0, 0.0, None),
    "article": (800, 0.6, 0.25, 604_800),
    "search": (300, 0.0, 0.0, None),
    "legacy": (120, 0.5, 0.0, None),
}
DUE_SHARE = 0.33


def main() -> None:
    rng = random.Random(20_251_130)
    defaults = {r["route"]: r.get("default_cadence_s") for r in ROUTES}
    lines: list[str] = []
    for route, (count, sitemap_share, own_share, own_cadence) in SHAPE.items():
        for i in range(count):
            row: dict[str, object] = {"key": key_for(route, i), "route": route}
            cadence = defaults[route] or DEFAULT_CADENCE_S
            if own_cadence is not None and rng.random() < own_share:
                row["cadence_s"] = own_cadence
                cadence = own_cadence
            row["sitemap"] = rng.random() < sitemap_share
            if rng.random() < DUE_SHARE:
                row["due_in_s"] = -rng.randint(0, 2 * cadence)
            else:
                row["due_in_s"] = rng.randint(1, cadence)
            lines.append(json.dumps(row, separators=(",", ":")))
    (HERE / "schedule.jsonl").write_text("\n".join(lines) + "\n")
    settings = {"default_cadence_s": DEFAULT_CADENCE_S, "routes": ROUTES}
    (HERE / "routes.json").write_text(json.dumps(settings, indent=2) + "\n")
    print(f"{len(lines)} rows, {len(ROUTES)} routes")


def key_for(route: str, i: int) -> str:
    if route == "home":
        return [
            "https://shop.example/",
            "https://shop.example/de/",
            "https://shop.example/fr/",
            "https://shop.example/es/",
            "https://shop.example/it/",
            "https://shop.example/nl/",
        ][i]
    if route == "product":
        return f"https://shop.example/p/sku-{10_000 + i}"
    if route == "category":
        return f"https://shop.example/c/{i // 20}/{i % 20}"
    if route == "article":
        return f"https://shop.example/journal/{2019 + i // 160}/post-{i}"
    if route == "search":
        return f"https://shop.example/search?q=term-{i}"
    return f"https://shop.example/old/{i}.html"


if __name__ == "__main__":
    main()
