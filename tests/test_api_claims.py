"""The claim path over real HTTP: grants, completions, renewals, stale tokens, 503 before the
first publish, long polls, and eight processes racing through two workers."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from node_harness import (
    FLEET_TOKEN,
    ThreadNode,
    api_settings_for,
    claims_waiting,
    due_in_table,
    feed_position,
    local_node,
    node_db,
    node_process,
    now_ms,
    publish_with_cadence,
    seed_rows,
    thread_node,
    unique,
    wait_for,
)

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")


def claim(client: httpx.Client, n: int, **extra: Any) -> httpx.Response:
    return client.post("/v1/claims", json={"max": n, "worker": "test", **extra})


def complete(client: httpx.Client, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    response = client.post("/v1/completions", json={"items": items})
    assert response.status_code == 200, response.text
    results: list[dict[str, Any]] = response.json()["results"]
    return results


def test_503_with_retry_after_before_the_first_publish(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        response = claim(client, 5)
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json()["status"] == "unready"
        assert client.get("/readyz").status_code == 503
        # The same node grants once the keeper has published.
        node.start_keeper()
        node.wait_published()
        response = claim(client, 5)
        assert response.status_code == 200
        assert response.json()["status"] == "ready"
        assert len(response.json()["leases"]) == 5
        assert client.get("/readyz").status_code == 200


def test_a_lease_carries_the_row_and_a_decimal_token(live_node: ThreadNode) -> None:
    before = now_ms()
    with live_node.client() as client:
        leases = claim(client, 100, lease_s=60).json()["leases"]
    # Only the 20 due rows are claimable, each granted once.
    assert len(leases) == 20
    assert len({lease["key"] for lease in leases}) == 20
    for lease in leases:
        assert set(lease) == {
            "key",
            "token",
            "route",
            "due_at",
            "lease_expires_at",
            "lease_ms",
            "sitemap",
            "cadence_s",
        }
        assert lease["token"].isdigit() and 0 < int(lease["token"]) < 2**64
        assert lease["route"] == "product" and lease["cadence_s"] == 3600
        assert lease["due_at"] <= before
        assert before + 60_000 <= lease["lease_expires_at"] <= now_ms() + 60_000
        assert lease["lease_ms"] == 60_000
    # Most overdue first, within one class (same route, cadence and sitemap flag).
    for flag in (True, False):
        dues = [lease["due_at"] for lease in leases if lease["sitemap"] is flag]
        assert dues == sorted(dues)


def test_completions_apply_each_outcome(live_node: ThreadNode) -> None:
    with live_node.client() as client:
        leases = claim(client, 3).json()["leases"]
        rendered, failed, gone = leases
        stamp = now_ms()
        results = complete(
            client,
            [
                {"key": rendered["key"], "token": rendered["token"], "outcome": "rendered"},
                {"key": failed["key"], "token": failed["token"], "outcome": "failed"},
                {"key": gone["key"], "token": gone["token"], "outcome": "gone"},
            ],
        )
        # A failure keeps the row due and holds the key back: 2 lease lengths (600 s).
        held_until = results[1].pop("held_until")
        assert stamp + 600_000 <= held_until <= now_ms() + 600_000
        assert results == [
            {"key": rendered["key"], "ok": True},
            {"key": failed["key"], "ok": True},
            {"key": gone["key"], "ok": True},
        ]
        row = client.get("/v1/schedule", params={"key": rendered["key"]}).json()
        assert stamp + 3_600_000 <= row["next_render_at"] <= now_ms() + 3_600_000
        assert row["last_outcome"] == "rendered"
        row = client.get("/v1/schedule", params={"key": failed["key"]}).json()
        assert row["next_render_at"] == failed["due_at"]  # still due
        assert client.get("/v1/schedule", params={"key": gone["key"]}).status_code == 404


def test_rendered_with_an_explicit_next_render_at(live_node: ThreadNode) -> None:
    with live_node.client() as client:
        (lease,) = claim(client, 1).json()["leases"]
        when = now_ms() + 42_000
        item = {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
        assert complete(client, [{**item, "next_render_at": when}])[0]["ok"] is True
        assert (
            client.get("/v1/schedule", params={"key": lease["key"]}).json()["next_render_at"]
            == when
        )


def test_stale_and_unknown_tokens_change_nothing(live_node: ThreadNode) -> None:
    with live_node.client() as client:
        (lease,) = claim(client, 1).json()["leases"]
        row_before = client.get("/v1/schedule", params={"key": lease["key"]}).json()
        wrong = str(int(lease["token"]) ^ 1)
        results = complete(
            client,
            [
                {"key": lease["key"], "token": wrong, "outcome": "rendered"},
                {"key": "https://nowhere.example/", "token": lease["token"], "outcome": "gone"},
                {"key": lease["key"], "token": "99999999999999999999", "outcome": "gone"},
            ],
        )
        assert [r["error"] for r in results] == ["lease_not_held"] * 3
        assert all(r["ok"] is False for r in results)
        assert client.get("/v1/schedule", params={"key": lease["key"]}).json() == row_before
        # The real token still holds the lease; once used, it is stale.
        item = {"key": lease["key"], "token": lease["token"], "outcome": "failed"}
        (result,) = complete(client, [item])
        assert result["ok"] is True and result["held_until"] > now_ms()
        assert complete(client, [item]) == [
            {"key": lease["key"], "ok": False, "error": "lease_not_held"}
        ]
        # A key twice in one batch: only the first result counts.
        (other,) = claim(client, 1).json()["leases"]
        item = {"key": other["key"], "token": other["token"], "outcome": "rendered"}
        assert [r["ok"] for r in complete(client, [item, item])] == [True, False]


def test_one_lease_completed_by_concurrent_requests_counts_once(live_node: ThreadNode) -> None:
    """Four clients send the same results for the same leases at once: each lease's
    result counts once, every other copy is stale."""
    with live_node.client() as client:
        leases = claim(client, 20).json()["leases"]
    items = [
        {"key": lease["key"], "token": lease["token"], "outcome": "rendered"} for lease in leases
    ]
    outcomes: list[list[dict[str, Any]]] = []

    def send() -> None:
        with live_node.client() as own:
            outcomes.append(complete(own, items))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, lease in enumerate(leases):
        oks = [results[i]["ok"] for results in outcomes]
        assert oks.count(True) == 1, (lease["key"], oks)
        errors = {results[i].get("error") for results in outcomes if not results[i]["ok"]}
        assert errors == {"lease_not_held"}


def test_renew_extends_only_a_held_lease(live_node: ThreadNode) -> None:
    with live_node.client() as client:
        (lease,) = claim(client, 1, lease_s=10).json()["leases"]
        response = client.post(
            "/v1/leases/renew",
            json={
                "items": [
                    {"key": lease["key"], "token": lease["token"], "lease_s": 120},
                    {"key": lease["key"], "token": str(int(lease["token"]) + 1)},
                ]
            },
        )
        assert response.status_code == 200
        held, stale = response.json()["results"]
        assert (
            held["ok"] is True and held["lease_expires_at"] >= lease["lease_expires_at"] + 100_000
        )
        assert stale == {"key": lease["key"], "ok": False, "error": "lease_not_held"}


def test_a_renewal_with_a_key_the_store_refuses_is_422_for_the_whole_request(
    live_node: ThreadNode,
) -> None:
    with live_node.client() as client:
        (lease,) = claim(client, 1, lease_s=10).json()["leases"]
        for bad in ("a\x00b", "\u00e9" * 1025):  # a NUL; 1,025 characters but 2,050 bytes
            items = [{"key": lease["key"], "token": lease["token"], "lease_s": 600}]
            items.append({"key": bad, "token": lease["token"]})
            response = client.post("/v1/leases/renew", json={"items": items})
            assert response.status_code == 422, response.text
            assert response.json()["field"] == "$.items[1].key"
        # Nothing was renewed: the lease still ends when it did.
        state = client.get("/prerender_admin/explain", params={"key": lease["key"]}).json()
        assert state["lease"]["lease_expires_at"] == lease["lease_expires_at"]


def test_wait_s_long_polls_until_work_is_published(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 5, due_share=0.0)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_published()
        assert claim(client, 5).json()["leases"] == []

        def add_due_row() -> None:
            # Once the claim is waiting: granted at once, it would prove nothing of the wait.
            wait_for(lambda: claims_waiting(client), 20, "the claim to long-poll")
            body = {"upsert": [{"key": "https://shop.example/new", "route": "product"}]}
            assert client.post("/v1/schedule", json=body).status_code == 200

        writer = threading.Thread(target=add_due_row)
        writer.start()
        leases = claim(client, 5, wait_s=20).json()["leases"]
        writer.join()
        assert [lease["key"] for lease in leases] == ["https://shop.example/new"]
        assert claims_waiting(client) == 0


# --- eight processes racing through two workers ----------------------------------------


def claimant(url: str, rounds_without_work: int, out: Any) -> None:
    """Claim in batches until the node has nothing left; report every (key, token)."""
    granted: list[tuple[str, str]] = []
    idle = 0
    refusals = 0
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {FLEET_TOKEN}"}, timeout=60
    ) as client:
        while idle < rounds_without_work:
            response = client.post(
                "/v1/claims", json={"max": 100, "worker": "racer", "lease_s": 300, "wait_s": 2}
            )
            # A loaded machine can leave the keeper's set briefly stale: the node says so
            # with 503 + Retry-After, and a fleet client waits and asks again.
            if response.status_code == 503 and "retry-after" in response.headers and refusals < 30:
                refusals += 1
                time.sleep(float(response.headers["retry-after"]))
                continue
            if response.is_error:
                raise AssertionError(f"HTTP {response.status_code}: {response.text[:300]}")
            leases = response.json()["leases"]
            idle = 0 if leases else idle + 1
            granted.extend((lease["key"], lease["token"]) for lease in leases)
    out.put(granted)


def completer(url: str, leases: list[tuple[str, str]], out: Any) -> None:
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {FLEET_TOKEN}"}, timeout=60
    ) as client:
        ok = 0
        for start in range(0, len(leases), 500):
            items = [
                {"key": key, "token": token, "outcome": "rendered"}
                for key, token in leases[start : start + 500]
            ]
            response = client.post("/v1/completions", json={"items": items})
            response.raise_for_status()
            ok += sum(1 for result in response.json()["results"] if result["ok"])
    out.put(ok)


@pytest.mark.slow
def test_eight_processes_race_and_no_key_is_granted_twice(tmp_path: Path) -> None:
    total = 20_000
    seed_rows(node_db(tmp_path), total + 500, due_share=total / (total + 500))
    context = multiprocessing.get_context("spawn")
    with node_process(tmp_path, workers=2, tokens=True) as node:
        out = context.Queue()
        racers = [context.Process(target=claimant, args=(node.url, 2, out)) for _ in range(8)]
        for racer in racers:
            racer.start()
        batches = [out.get(timeout=240) for _ in racers]
        for racer in racers:
            racer.join(30)
        granted = [pair for batch in batches for pair in batch]
        keys = [key for key, _ in granted]
        # Every due key once, and only due keys: none granted twice while leased.
        assert len(keys) == len(set(keys))
        assert len(keys) == total
        # Both workers served claims (the kernel spreads connections over them).
        with node.client() as admin:
            overview = admin.get("/prerender_admin/overview").json()
        assert overview["leases"]["live_leases"] >= total

        shares = [granted[i::4] for i in range(4)]
        for share in shares:
            context.Process(target=completer, args=(node.url, share, out)).start()
        assert sum(out.get(timeout=240) for _ in shares) == total

        with node.client() as admin:

            def exact() -> Any:
                response = admin.get("/prerender_admin/queue-state")
                if response.status_code != 200:
                    return None
                state = response.json()
                return state if state["now"]["due"] == due_in_table(node.db, now_ms()) else None

            state = wait_for(exact, 60, "queue-state's due count to match the table", 0.5)
        assert state["now"]["due"] == 0


def test_a_result_landing_between_read_and_grant_is_not_granted_again(tmp_path: Path) -> None:
    """The race the double read closes: worker A reads a due row, worker B's completion
    commits and releases the lease, then A's grant succeeds. A must hand the key back."""
    import numpy as np

    from api.claims import grant_from_ring
    from api.node import Node
    from shm import key_hash
    from store import open_store
    from store.rows import Completion
    from workers.segments import SegmentNames, Segments

    db = node_db(tmp_path)
    keys = seed_rows(db, 3)
    raced = keys[1]

    class RacingStore:
        """A real store; right after its first read another writer renders one key."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.armed = True

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def get_many(self, keys: Any) -> Any:
            rows = self.inner.get_many(keys)
            if self.armed:
                self.armed = False
                other = open_store(str(db))
                other.complete([Completion(key=raced, outcome="rendered", now=now_ms())])
                other.close()
            return rows

    segments = Segments.create(
        SegmentNames.for_instance(unique("tr")), ring_entries=64, lease_slots=1024
    )
    store = RacingStore(open_store(db))
    try:
        node = Node(
            settings=api_settings_for(),
            store=store,
            ring=segments.ring,
            leases=segments.leases,
            state=segments.state,
        )
        now = now_ms()
        hashes = np.array([key_hash(k.encode()) for k in keys], dtype=np.uint64)
        segments.ring.publish(
            [k.encode() for k in keys],
            np.full(3, now - 1000, dtype=np.int64),
            np.zeros(3, dtype=np.int32),
            hashes,
            now,
        )
        leases = grant_from_ring(node, 10, 60_000)
        assert sorted(lease.key for lease in leases) == [keys[0], keys[2]]
        assert not segments.leases.state(key_hash(raced.encode()), now_ms()).leased
    finally:
        store.close()
        segments.close()
        segments.unlink()


@pytest.mark.parametrize("on_lane", [False, True], ids=["inline", "on_lane"])
def test_a_claim_whose_store_read_fails_hands_back_every_lease_it_took(
    tmp_path: Path, on_lane: bool
) -> None:
    """Leases are granted before the rows are read; a read that fails (the store
    unavailable: the claim answers 503) hands them all back, since none was answered. They
    are not left to run out unanswered, which would hold the keys back after."""
    from api.claims import grant, grant_from_ring
    from shm import key_hash
    from store.errors import StoreUnavailable

    db = node_db(tmp_path)
    keys = seed_rows(db, 4)
    with local_node(db) as (node, store, segments):  # no marks: every grant is read

        class Unavailable:
            def __getattr__(self, name: str) -> Any:
                return getattr(store, name)

            def get_many(self, keys: Any) -> Any:
                raise StoreUnavailable("get_many: no answer from the server")

        publish_with_cadence(node, keys, 3600)
        node.store = cast(Any, Unavailable())
        node.lane.hot_inline = not on_lane
        with pytest.raises(StoreUnavailable):
            if on_lane:
                asyncio.run(grant(node, 10, 60_000))
            else:
                grant_from_ring(node, 10, 60_000)
        assert node.lane.statistics().calls == (2 if on_lane else 0)  # routes, then rows
        now = now_ms()
        for key in keys:
            state = segments.leases.state(key_hash(key.encode()), now)
            assert not state.leased and not state.held, key
        node.store = store
        publish_with_cadence(node, keys, 3600)  # the failed claim took the ring's entries
        assert sorted(lease.key for lease in grant_from_ring(node, 10, 60_000)) == keys


def test_an_entry_rendered_since_its_publish_is_handed_back(tmp_path: Path) -> None:
    """Entries that carry their cadence are granted before their row is read; the read
    after the grant is the check. A key whose result committed (and whose lease ended)
    after the publish is handed back, not granted a second time."""
    from api.claims import grant_from_ring
    from shm import key_hash
    from store.rows import Completion

    db = node_db(tmp_path)
    keys = seed_rows(db, 3)
    with local_node(db) as (node, store, segments):
        publish_with_cadence(node, keys, 3600)
        store.complete([Completion(key=keys[1], outcome="rendered", now=now_ms())])
        leases = grant_from_ring(node, 10, 60_000)
        assert sorted(lease.key for lease in leases) == [keys[0], keys[2]]
        assert all(lease.cadence_s == 3600 for lease in leases)
        assert not segments.leases.state(key_hash(keys[1].encode()), now_ms()).leased


@pytest.mark.parametrize("published_cadence_s", [3600, 0])
def test_an_entry_retired_since_its_publish_is_handed_back(
    tmp_path: Path, published_cadence_s: int
) -> None:
    """A row retired after the publish by a `not_found` that also set it due at once is
    handed back: retired is never due, whatever its render time says. Both reads count:
    after the grant (an entry with its cadence) and before it (an entry without)."""
    from api.claims import grant_from_ring
    from shm import key_hash
    from store.rows import Completion

    db = node_db(tmp_path)
    keys = seed_rows(db, 2)
    with local_node(db) as (node, store, segments):
        store.set_route("product", retire_after=1)
        publish_with_cadence(node, keys, published_cadence_s)
        now = now_ms()
        (row,) = store.complete(
            [Completion(key=keys[1], outcome="not_found", now=now, next_render_at=now)]
        )
        assert row is not None and row.retired_at is not None and row.next_render_at <= now
        leases = grant_from_ring(node, 10, 60_000)
        assert [lease.key for lease in leases] == [keys[0]]
        assert not segments.leases.state(key_hash(keys[1].encode()), now_ms()).leased


def test_a_grant_takes_its_hold_cap_from_the_ring_entry(tmp_path: Path) -> None:
    """The hold after a lease expires unanswered is min(2 lease lengths, cadence): with a
    1 s lease, the entry's 1 s cadence caps it at 1 s where the row's 3,600 s would not."""
    from api.claims import grant_from_ring
    from shm import key_hash

    db = node_db(tmp_path)
    keys = seed_rows(db, 1, cadence_s=3600)
    with local_node(db) as (node, _, segments):
        publish_with_cadence(node, keys, 1)
        (lease,) = grant_from_ring(node, 1, 1000)
        assert lease.cadence_s == 3600  # what the fleet is told is the row's
        time.sleep((lease.lease_expires_at - now_ms()) / 1000 + 0.05)
        state = segments.leases.state(key_hash(keys[0].encode()), now_ms())
        assert state.held and state.held_until - lease.lease_expires_at == 1000


def test_entries_nothing_wrote_since_the_view_are_answered_unread(tmp_path: Path) -> None:
    """With write marks, a granted entry whose key no write through this node touched since
    the publish's view is answered from the entry: the row's route, due time and cadence
    as the keeper published them, and no read."""
    from api.claims import grant_from_ring

    db = node_db(tmp_path)
    keys = seed_rows(db, 3, cadence_s=3600)
    with local_node(db, marks=True) as (node, store, segments):
        due_at = now_ms() - 1000
        publish_with_cadence(node, keys, 3600, view=feed_position(store), due_at=due_at)
        leases = grant_from_ring(node, 10, 60_000)
        assert sorted(lease.key for lease in leases) == keys
        assert {(lease.route, lease.due_at, lease.cadence_s) for lease in leases} == {
            ("product", due_at, 3600)
        }
        stats = segments.marks.statistics()
        assert (stats.answered_from_ring, stats.read_after_grant) == (3, 0)


def test_a_completion_through_the_node_after_the_view_is_read_and_handed_back(
    tmp_path: Path,
) -> None:
    """The double grant the read exists for, with marks: a key completed through this node
    after the keeper's view, published again from that view, is read and handed back;
    with a view of 0 (a keeper that cannot vouch) every grant is read."""
    from api.claims import grant_from_ring
    from api.completions import apply
    from wire.schemas import CompletionItem, CompletionsRequest

    db = node_db(tmp_path)
    keys = seed_rows(db, 3, cadence_s=3600)
    with local_node(db, marks=True) as (node, store, segments):
        view = feed_position(store)
        publish_with_cadence(node, keys[:1], 3600, view=view)
        (lease,) = grant_from_ring(node, 1, 60_000)
        item = CompletionItem(key=lease.key, token=lease.token, outcome="rendered")
        (answer,) = apply(node, [CompletionsRequest(items=[item])], wait=True)
        assert answer.results[0].ok
        # The keeper has not read the completion yet: its next publish still has the key.
        publish_with_cadence(node, keys[:1], 3600, view=view)
        assert grant_from_ring(node, 1, 60_000) == []
        assert segments.marks.statistics().read_after_grant == 1
        # A view that vouches for nothing reads every grant, even of untouched keys.
        publish_with_cadence(node, keys[1:], 3600, view=0)
        assert len(grant_from_ring(node, 10, 60_000)) == 2
        stats = segments.marks.statistics()
        assert (stats.answered_from_ring, stats.read_after_grant) == (1, 3)


def test_a_schedule_write_through_the_node_after_the_view_is_honoured(tmp_path: Path) -> None:
    """A key rescheduled (to tomorrow) or deleted through this node's API after the view
    is read at its grant and handed back, not granted on the stale entry."""
    from api.claims import grant_from_ring
    from api.schedule import write
    from wire.schemas import ScheduleRequest, ScheduleUpsert

    db = node_db(tmp_path)
    keys = seed_rows(db, 3, cadence_s=3600)
    with local_node(db, marks=True) as (node, store, segments):
        publish_with_cadence(node, keys, 3600, view=feed_position(store))
        later = ScheduleUpsert(key=keys[0], route="product", next_render_at=now_ms() + 86_400_000)
        write(node, ScheduleRequest(upsert=[later], delete=[keys[1]]))
        leases = grant_from_ring(node, 10, 60_000)
        assert [lease.key for lease in leases] == [keys[2]]
        stats = segments.marks.statistics()
        assert (stats.answered_from_ring, stats.read_after_grant) == (1, 2)


def test_a_live_node_answers_claims_from_the_ring(live_node: ThreadNode) -> None:
    """The keeper vouches for its publishes: claims on a live node are answered unread,
    and a key completed through the node is not granted again from a later publish."""
    seed_rows(live_node.db, 40, cadence_s=3600)
    live_node.wait_exact()
    with live_node.client() as client:
        first = claim(client, 20).json()["leases"]
        results = complete(
            client, [{"key": x["key"], "token": x["token"], "outcome": "rendered"} for x in first]
        )
        assert all(r["ok"] for r in results)
        rest: list[dict[str, Any]] = []
        deadline = time.monotonic() + 20
        while len(rest) < 20 and time.monotonic() < deadline:
            rest += claim(client, 20, wait_s=1).json()["leases"]
    assert {x["key"] for x in first}.isdisjoint(x["key"] for x in rest)
    assert len(rest) == 20
    assert live_node.segments.marks.statistics().answered_from_ring > 0
