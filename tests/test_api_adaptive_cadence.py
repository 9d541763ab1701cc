"""Adaptive cadence over real HTTP on both backends: a route turned adaptive, a key whose
renders say `changed` climbs its route's ladder and comes down, `explain` shows where it
stands, the keeper holds it in the class of its learned cadence; bad settings are refused
and change nothing; 10k rows spread over the ladder keep the class count bounded and
queue-state exact."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_harness import ThreadNode, due_in_table, now_ms, seed_rows, thread_node, wait_for

from store.cadence import Adaptation, ladder
from store.rows import Completion

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

KEY = "https://news.example/front"
RUNGS = ladder(60, 86_400)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, node_backend: str) -> Iterator[ThreadNode]:
    with thread_node(tmp_path_factory.mktemp(f"adapt-{node_backend}")) as running:
        running.wait_published()
        yield running


def claim(client: httpx.Client, key: str) -> dict[str, Any]:
    def granted() -> dict[str, Any] | None:
        leases = client.post("/v1/claims", json={"max": 10, "worker": "t", "wait_s": 1}).json()
        return next((x for x in leases["leases"] if x["key"] == key), None)

    found: dict[str, Any] = wait_for(granted, 30, f"a lease on {key}")
    return found


def render(client: httpx.Client, key: str, changed: bool) -> dict[str, Any]:
    """Claim the key and complete it, due again at once so the next claim finds it."""
    lease = claim(client, key)
    item = {
        "key": key,
        "token": lease["token"],
        "outcome": "rendered",
        "changed": changed,
        "next_render_at": now_ms(),
    }
    done = client.post("/v1/completions", json={"items": [item]})
    assert done.status_code == 200 and done.json()["results"][0]["ok"], done.text
    explained: dict[str, Any] = client.get("/prerender_admin/explain", params={"key": key}).json()
    return explained


def keeper_class_cadences(client: httpx.Client, route: str) -> set[int]:
    state = client.get("/prerender_admin/queue-state")
    if state.status_code != 200:
        return set()
    classes = state.json()["lateness"]["classes"]
    return {c["cadence_s"] for c in classes if c["route"] == route and c["due"]}


def test_unchanged_renders_climb_the_ladder_and_a_change_comes_down(node: ThreadNode) -> None:
    with node.client() as client:
        put = client.put("/v1/routes/news", json={"adapt": {"min_s": 60, "max_s": 86_400}})
        assert put.status_code == 200, put.text
        assert put.json()["adapt"] == {"min_s": 60, "max_s": 86_400, "inc": 0.4, "dec": 0.2}
        upsert = {"key": KEY, "route": "news", "cadence_s": 60, "next_render_at": now_ms() - 1}
        assert client.post("/v1/schedule", json={"upsert": [upsert]}).status_code == 200
        for step in range(1, 6):
            explained = render(client, KEY, changed=False)
            assert explained["learned_cadence_s"] == RUNGS[step]
            assert explained["ladder_step"] == step
            assert explained["ladder_steps"] == len(RUNGS)
            assert explained["cadence_s"] == RUNGS[step]
        assert explained["recent_changes"] == [False] * 5
        assert explained["row"]["cadence_s"] == 60  # its own, kept under the learned one
        explained = render(client, KEY, changed=True)
        assert (explained["learned_cadence_s"], explained["ladder_step"]) == (RUNGS[4], 4)
        assert explained["recent_changes"] == [False] * 5 + [True]
        # The keeper took the row from the feed into the class of its learned cadence.
        wait_for(
            lambda: keeper_class_cadences(client, "news") == {RUNGS[4]},
            30,
            "the keeper's class of the learned cadence",
        )
        # Turning adaptation off forgets what was learned: the row's own cadence again.
        off = client.put("/v1/routes/news", json={"adapt": None})
        assert off.status_code == 200 and off.json()["adapt"] is None
        explained = client.get("/prerender_admin/explain", params={"key": KEY}).json()
        assert "learned_cadence_s" not in explained and explained["cadence_s"] == 60
        assert "ladder_step" not in explained
        assert explained["recent_changes"] == [False] * 5 + [True]
        wait_for(
            lambda: keeper_class_cadences(client, "news") == {60},
            30,
            "the keeper's class of the row's own cadence",
        )


def test_bad_settings_and_items_are_refused_and_change_nothing(node: ThreadNode) -> None:
    with node.client() as client:
        good = {"min_s": 300, "max_s": 3600, "inc": 0.5, "dec": 0.25}
        assert client.put("/v1/routes/strict", json={"adapt": good}).status_code == 200
        for adapt, field in (
            ({"min_s": 3600, "max_s": 300}, "min_s"),
            ({"min_s": 0, "max_s": 300}, "min_s"),
            ({"min_s": 60, "max_s": 300, "inc": 0}, "inc"),
            ({"min_s": 60, "max_s": 300, "inc": -0.5}, "inc"),
            ({"min_s": 60, "max_s": 300, "inc": 11}, "inc"),
            ({"min_s": 60, "max_s": 300, "dec": 1}, "dec"),
            ({"min_s": 60, "max_s": 300, "dec": 0}, "dec"),
            ({"min_s": 60}, "max_s"),
            ({"min_s": 60, "max_s": 300, "rate": 1}, "rate"),
            ({"min_s": 60.5, "max_s": 300}, "min_s"),
        ):
            refused = client.put(
                "/v1/routes/strict", json={"adapt": adapt, "default_cadence_s": 600}
            )
            assert refused.status_code == 422, (adapt, refused.text)
            assert field in refused.json()["detail"], (adapt, refused.text)
        routes = {r["route"]: r for r in client.get("/v1/routes").json()["routes"]}
        assert routes["strict"]["adapt"] == good and routes["strict"]["default_cadence_s"] is None
        # `changed` is said of a rendered page only: the whole request is refused.
        key = "https://strict.example/a"
        upsert = {"key": key, "route": "strict", "next_render_at": now_ms() - 1}
        client.post("/v1/schedule", json={"upsert": [upsert]})
        lease = claim(client, key)
        before = client.get("/v1/schedule", params={"key": key}).json()
        item = {"key": key, "token": lease["token"], "outcome": "failed", "changed": True}
        refused = client.post("/v1/completions", json={"items": [item]})
        assert refused.status_code == 422 and "changed" in refused.text
        assert client.get("/v1/schedule", params={"key": key}).json() == before
        item = {"key": key, "token": lease["token"], "outcome": "rendered", "changed": True}
        assert client.post("/v1/completions", json={"items": [item]}).json()["results"][0]["ok"]


def test_ten_thousand_learned_rows_keep_classes_bounded_and_counts_exact(
    tmp_path: Path,
) -> None:
    node_path = tmp_path / "node"
    node_path.mkdir()
    with thread_node(node_path) as running:
        store = running.store
        adapt = Adaptation(min_s=3600, max_s=30 * 86_400)
        store.set_route("product", adapt=adapt)
        keys = seed_rows(running.db, 10_000, due_share=0.5)
        picker = random.Random(7)
        now = now_ms()
        # Each row a run of renders of its own (0 to 12, changed with its own odds), so the
        # learned cadences spread over the whole ladder; half stay due.
        odds = {key: picker.random() for key in keys}
        for round_number in range(12):
            items = [
                Completion(
                    key=key,
                    outcome="rendered",
                    now=now,
                    changed=picker.random() < odds[key],
                    next_render_at=now - 1000 if index % 2 == 0 else None,
                )
                for index, key in enumerate(keys)
                if index % 13 > round_number
            ]
            for start in range(0, len(items), 1000):
                store.complete(items[start : start + 1000])
        learned = {
            row.learned_cadence_s
            for start in range(0, len(keys), 2000)
            for row in store.get_many(keys[start : start + 2000]).values()
        }
        rungs = ladder(adapt.min_s, adapt.max_s)
        assert None in learned and len(learned - {None}) >= len(rungs) // 2
        # Due rows are due since before now, the others not for an hour: the table's count
        # holds while the keeper catches up with the completions' feed.
        due = due_in_table(running.db, now_ms())
        with running.client() as client:

            def caught_up() -> dict[str, Any] | None:
                served = client.get("/prerender_admin/queue-state")
                body: dict[str, Any] = served.json()
                exact = served.status_code == 200 and body["trust"]["exact"]
                counts = exact and (body["now"]["held"], body["now"]["due"])
                return body if counts == (10_000, due) else None

            wait_for(caught_up, 60, f"queue-state's exact counts: 10,000 held, {due} due", 0.2)
        statistics = running.node.read_keeper_statistics()
        assert statistics is not None
        # route x cadence x from-row x sitemap: the rows' own cadence (3600) and the rungs.
        assert statistics.classes <= 2 * (len(rungs) + 1)
