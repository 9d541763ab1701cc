"""`/metrics` over real HTTP: valid Prometheus text, built from the keeper's record and the
lease table, with the counts left out whenever the keeper cannot vouch for them."""

from __future__ import annotations

import re
from pathlib import Path

from node_harness import seed_rows, thread_node, wait_for

SAMPLE = re.compile(r'^([a-z_:][a-z0-9_:]*)(\{([a-z_]+="[^"]*",?)*\})? (-?[0-9.e+-]+|NaN)$')


def parse(text: str) -> dict[str, float]:
    """Every line is a HELP, a TYPE or a sample; samples keyed by name and labels."""
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            assert kind in ("gauge", "counter") and name not in typed
            typed.add(name)
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        assert match.group(1) in typed, f"sample before its TYPE: {line!r}"
        key = line.rsplit(" ", 1)[0]
        assert key not in samples, f"duplicate sample {key}"
        samples[key] = float(line.rsplit(" ", 1)[1])
    return samples


def test_before_the_keeper_no_counts(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 10)
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        response = client.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = parse(response.text)
    assert samples["renderqueue_ready"] == 0
    assert samples["renderqueue_keeper_live"] == 0
    assert "renderqueue_due" not in samples


def test_counts_and_leases(tmp_path: Path) -> None:
    seed_rows(tmp_path / "node.sqlite", 200, due_share=0.25)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()
        leases = client.post("/v1/claims", json={"max": 10, "worker": "t"}).json()["leases"]
        assert len(leases) == 10
        samples = parse(client.get("/metrics").text)
        assert samples["renderqueue_ready"] == 1
        assert samples["renderqueue_keeper_live"] == 1
        assert samples["renderqueue_counts_trusted"] == 1
        assert samples["renderqueue_due"] == 50
        assert samples["renderqueue_in_flight"] == 10
        assert samples["renderqueue_oldest_claimable_age_seconds"] > 0
        assert samples["renderqueue_publish_age_seconds"] >= 0
        assert samples["renderqueue_feed_lag_seconds"] >= 0
        for reason in ("taken", "held", "probe_full"):
            assert f'renderqueue_lease_refusals_total{{reason="{reason}"}}' in samples
        assert "renderqueue_held_keys" in samples
        classes = [key for key in samples if key.startswith("renderqueue_class_due{")]
        assert classes and sum(samples[key] for key in classes) == 50
        # Completed work leaves the due count once the keeper has seen it.
        items = [
            {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
            for lease in leases
        ]
        client.post("/v1/completions", json={"items": items})

        def due_after() -> float | None:
            found = parse(client.get("/metrics").text).get("renderqueue_due")
            return found if found == 40 else None

        wait_for(due_after, 30, "renderqueue_due to fall to 40", 0.2)
