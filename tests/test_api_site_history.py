"""GET /v1/sites-in-flight: the supervisor's hour of leases in flight per site.

The history's bookkeeping on its own (peaks per minute, the hour's bound, the sites kept,
naming), a record from shared memory checked when read, and a real node: leases claimed
and left open are counted by site, capped or not, and named from the keeper's listing.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from node_harness import (
    ADMIN_TOKEN,
    FLEET_TOKEN,
    NodeProcess,
    node_db,
    now_ms,
    seed_rows,
    thread_node,
    wait_for,
)

from api.site_history import (
    HISTORY_BYTES,
    MINUTE_MS,
    NAME_RETRY_MS,
    InFlightHistory,
    decode,
    encode,
)
from shm.keys import site_of
from wire.schemas import HISTORY_LATEST, HISTORY_MINUTES, HISTORY_SITES, SitesInFlight

T0 = 1_800_000 * MINUTE_MS  # a whole minute


def counts(pairs: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    ordered = sorted(pairs.items(), key=lambda item: -item[1])
    return (
        np.array([h for h, _ in ordered], dtype=np.uint64),
        np.array([c for _, c in ordered], dtype=np.int64),
    )


def test_each_minute_keeps_its_peaks_and_the_hour_is_bounded() -> None:
    history = InFlightHistory("n")
    history.record(T0 + 1_000, *counts({1: 3, 2: 1, 0: 4}))
    history.record(T0 + 2_000, *counts({1: 2, 2: 5}))
    history.record(T0 + MINUTE_MS + 5_000, *counts({2: 1}))
    record = history.snapshot(T0 + MINUTE_MS + 5_000)
    assert len(record.minutes) == HISTORY_MINUTES and record.minutes[-1] == T0 + MINUTE_MS
    # Before the first count: not counted (null), never 0.
    assert record.total[-3:] == [None, 8, 1]
    by_hash = {s.site_hash: s for s in record.sites}
    assert [s.site_hash for s in record.sites] == [f"{2:016x}", f"{1:016x}"]  # peak first
    assert by_hash[f"{1:016x}"].in_flight[-2:] == [3, 0] and by_hash[f"{1:016x}"].peak == 3
    assert by_hash[f"{2:016x}"].in_flight[-2:] == [5, 1]
    assert [(c.site_hash, c.in_flight) for c in record.latest] == [(f"{2:016x}", 1)]
    # An hour on, the first minutes are gone and the memory with them.
    history.record(T0 + HISTORY_MINUTES * MINUTE_MS, *counts({7: 1}))
    later = history.snapshot(T0 + HISTORY_MINUTES * MINUTE_MS)
    assert later.total[0] == 1 and later.total[-1] == 1 and later.total.count(None) == 58
    assert [s.site_hash for s in later.sites] == [f"{2:016x}", f"{7:016x}"]
    history.record(T0 + 3 * HISTORY_MINUTES * MINUTE_MS, *counts({}))
    assert len(history._minutes) == 1


def test_the_sites_kept_are_bounded() -> None:
    history = InFlightHistory("n")
    many = {h: h for h in range(1, 3 * HISTORY_LATEST)}
    history.record(T0, *counts(many))
    history.record(T0 + 1, *counts({1: 10_000}))  # a small site's burst, later that minute
    record = history.snapshot(T0 + 1)
    assert len(record.sites) == HISTORY_SITES and len(record.latest) == 1
    assert record.sites[0].site_hash == f"{1:016x}" and record.sites[0].peak == 10_000
    assert len(history._minutes[T0 // MINUTE_MS].peaks) == HISTORY_LATEST
    assert record.total[-1] == sum(range(1, 3 * HISTORY_LATEST))  # the minute's peak


def test_sites_are_named_from_the_listing_and_asked_rarely() -> None:
    history = InFlightHistory("n")
    asked: list[int] = []

    def lookup(names: dict[int, str]) -> Any:
        def read() -> dict[int, str]:
            asked.append(1)
            return names

        return read

    history.record(T0, *counts({1: 2, 2: 1}))
    history.name(T0, lookup({1: "a.example"}))
    history.name(T0 + 1, lookup({1: "a.example", 2: "b.example"}))  # too soon
    assert len(asked) == 1
    history.name(T0 + NAME_RETRY_MS, lookup({1: "a.example", 2: "b.example"}))
    assert len(asked) == 2
    history.name(T0 + 3 * NAME_RETRY_MS, lookup({}))  # every shown site named: not asked
    assert len(asked) == 2
    record = history.snapshot(T0)
    assert [s.site for s in record.sites] == ["a.example", "b.example"]


def test_the_widest_record_fits_its_buffer() -> None:
    history = InFlightHistory("n" * 64)
    names = {}
    for minute in range(HISTORY_MINUTES):
        base = (minute + 1) << 40
        pairs = {base + i: (1 << 31) - i for i in range(HISTORY_LATEST)}
        history.record(T0 + minute * MINUTE_MS, *counts(pairs))
        names.update({h: ("x" * 249 + f"{i:04d}") for i, h in enumerate(pairs)})
    last = T0 + (HISTORY_MINUTES - 1) * MINUTE_MS
    history.name(last, lambda: names)
    payload = encode(history.snapshot(last))
    assert len(payload) < HISTORY_BYTES
    assert decode(payload).latest[0].site is not None


@pytest.mark.parametrize(
    "change",
    [
        {"total": [1]},  # a value short
        {"minutes": [T0 + 1]},  # not a whole minute
        {"sites": [{"site_hash": "zz", "peak": 1, "in_flight": [1]}]},
        {"latest": [{"site_hash": f"{1:016x}", "in_flight": -1}]},
    ],
)
def test_a_record_that_does_not_hold_together_is_refused(change: dict[str, Any]) -> None:
    good = {"node": "n", "sampled_at": T0, "minutes": [T0], "total": [1], "sites": [], "latest": []}
    assert decode(msgspec.msgpack.encode(good)).total == [1]
    bad = good | change
    if "total" in change:
        bad["minutes"] = [T0, T0 + MINUTE_MS]
    with pytest.raises(msgspec.DecodeError):
        decode(msgspec.msgpack.encode(bad))


def test_no_count_yet_is_an_empty_hour_and_an_unreadable_record_503(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 3)
    with (
        thread_node(tmp_path, keeper=False, tokens=True) as node,
        node.client(ADMIN_TOKEN) as client,
    ):
        first = client.get("/v1/sites-in-flight")
        assert first.status_code == 200, first.text
        assert "sampled_at" not in first.json() and set(first.json()["total"]) == {None}
        node.segments.site_history.write(b"\x93\x01\x02", now_ms())
        response = client.get("/v1/sites-in-flight")
        assert response.status_code == 503, response.text
        assert "unreadable" in response.json()["detail"]
        assert response.headers["retry-after"] == "1"


SITES = [("https://a.example/p/", 40), ("https://www.b.example/q/", 30), ("/no/site/", 5)]


def test_a_node_counts_its_leases_by_site(tmp_path: Path) -> None:
    db = node_db(tmp_path)
    for prefix, rows in SITES:
        seed_rows(db, rows, prefix=prefix)
    process = NodeProcess(tmp_path, workers=1, tokens=True)
    process.start()
    try:
        with process.client(ADMIN_TOKEN) as admin, process.client(FLEET_TOKEN) as fleet:
            wait_for(
                lambda: admin.get("/v1/sites").status_code == 200, 60, "the sites listing", 0.2
            )
            capped = admin.put("/v1/sites/b.example", json={"max_in_flight": 4})
            assert capped.status_code == 200, capped.text
            granted = fleet.post("/v1/claims", json={"max": 40, "worker": "t", "lease_s": 600})
            assert granted.status_code == 200, granted.text
            by_site = Counter(site_of(g["key"].encode()).decode() for g in granted.json()["leases"])
            assert by_site["b.example"] == 4

            def counted() -> SitesInFlight | None:
                got = admin.get("/v1/sites-in-flight")
                if got.status_code != 200:
                    return None
                record = msgspec.json.decode(got.content, type=SitesInFlight)
                named = {c.site: c.in_flight for c in record.latest}
                wanted = {site: n for site, n in by_site.items() if site}
                total = len(granted.json()["leases"])
                return record if named == wanted and record.total[-1] == total else None

            record = wait_for(counted, 30, "the supervisor's count of the leases", 0.2)
            shown = {s.site: s for s in record.sites}
            assert shown["b.example"].in_flight[-1] == 4 and shown["b.example"].peak == 4
            assert shown["a.example"].in_flight[-1] == by_site["a.example"]
            assert record.age_ms is not None and len(record.minutes) == HISTORY_MINUTES
    finally:
        process.stop()
