"""`/metrics` over real HTTP: valid Prometheus text, built from the keeper's record and the
lease table, with the counts left out whenever the keeper cannot vouch for them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from node_harness import (
    metric_samples,
    node_db,
    now_ms,
    readme_series,
    seed_rows,
    thread_node,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

from keeper.state import KeeperStatistics, decode_keeper_statistics, encode_keeper_statistics
from store.rows import RowWrite

# Every node here runs on SQLite, then on PostgreSQL (conftest.node_backend).
pytestmark = pytest.mark.usefixtures("node_backend")

SUPERVISOR_WAL_SERIES = "renderqueue_sqlite_wal_"
PRUNING_SERIES = ("renderqueue_feed_log_entries", "renderqueue_feed_prune_failures_total")
CLUSTER_SERIES = (
    "renderqueue_cluster_fenced_keys",
    "renderqueue_cluster_fence_until_seconds",
    "renderqueue_cluster_lease_ceiling_seconds",
    "renderqueue_cluster_lease_ceiling_failures_total",
    "renderqueue_cluster_members",
    "renderqueue_cluster_confirmed",
)
# From the supervisor's record of a cluster node's heartbeat (workers.membership).
MEMBERSHIP_SERIES = (
    "renderqueue_cluster_heartbeat_age_seconds",
    "renderqueue_cluster_heartbeat_failures_total",
)


def test_before_the_keeper_no_counts(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        response = client.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = metric_samples(response.text)
    assert samples["renderqueue_ready"] == 0
    assert samples["renderqueue_keeper_live"] == 0
    assert "renderqueue_due" not in samples
    assert not [key for key in samples if key.startswith(KEEPER_SERIES)]


def test_the_build_info_names_this_version(tmp_path: Path) -> None:
    from api.version import VERSION

    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        samples = metric_samples(client.get("/metrics").text)
    assert samples[f'renderqueue_build_info{{version="{VERSION}"}}'] == 1


def test_counts_and_leases(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 200, due_share=0.25)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()
        leases = client.post("/v1/claims", json={"max": 10, "worker": "t"}).json()["leases"]
        assert len(leases) == 10
        samples = metric_samples(client.get("/metrics").text)
        assert samples["renderqueue_ready"] == 1
        assert samples["renderqueue_keeper_live"] == 1
        assert samples["renderqueue_counts_trusted"] == 1
        assert samples["renderqueue_due"] == 50
        assert samples["renderqueue_in_flight"] == 10
        answered = [
            samples[f'renderqueue_claim_rows_total{{answered="{how}"}}']
            for how in ("from_ring", "after_read")
        ]
        assert sum(answered) == 10
        assert samples["renderqueue_oldest_claimable_age_seconds"] > 0
        assert samples["renderqueue_publish_age_seconds"] >= 0
        assert samples["renderqueue_feed_lag_seconds"] >= 0
        # Any transaction open on the server holds it, another test's too: only its presence.
        assert "renderqueue_feed_held_back_seconds" in samples
        assert "renderqueue_feed_held_by_pid" in samples
        for reason in ("taken", "held", "probe_full"):
            assert f'renderqueue_lease_refusals_total{{reason="{reason}"}}' in samples
        assert "renderqueue_held_keys" in samples
        classes = [key for key in samples if key.startswith("renderqueue_class_due{")]
        assert classes and sum(samples[key] for key in classes) == 50
        # Each class's oldest due row's age, beside its lateness in cadences.
        for key in classes:
            labels = key.removeprefix("renderqueue_class_due")
            age = samples[f"renderqueue_class_oldest_due_age_seconds{labels}"]
            cadences = samples[f"renderqueue_class_oldest_lateness_cadences{labels}"]
            cadence_s = float(labels.split('cadence_s="')[1].split('"')[0])
            assert age > 0 and age == pytest.approx(cadences * cadence_s, rel=1e-6)

        # The ten leases are the best due rows: the first publish that finds them leased
        # marks them in the keeper's skip table (keeper.skips), which then exists.
        def skip_table() -> bool:
            text = client.get("/metrics").text
            return bool(metric_samples(text).get("renderqueue_keeper_skip_table_entries"))

        wait_for(skip_table, 30, "the keeper's skip table, after marking the leased rows", 0.1)
        # Completed work leaves the due count once the keeper has seen it.
        items = [
            {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
            for lease in leases
        ]
        client.post("/v1/completions", json={"items": items})

        def due_after() -> float | None:
            found = metric_samples(client.get("/metrics").text).get("renderqueue_due")
            return found if found == 40 else None

        wait_for(due_after, 30, "renderqueue_due to fall to 40", 0.2)


# The series built from the keeper's statistics record (not from queue-state).
KEEPER_SERIES = (
    "renderqueue_keeper_feed_",
    "renderqueue_keeper_resyncs_",
    "renderqueue_keeper_walk_errors_",
    "renderqueue_keeper_cursor_resets_",
    "renderqueue_keeper_publish_failures_",
    "renderqueue_keeper_state_write_failures_",
    "renderqueue_keeper_memory_",
    "renderqueue_keeper_short_slice",
    "renderqueue_keeper_leased_rows_passed",
    "renderqueue_keeper_skip_table_",
)


def keeper_record(node: Any) -> KeeperStatistics | None:
    snapshot = node.segments.keeper.read()
    return None if snapshot is None else decode_keeper_statistics(snapshot.payload)


def test_the_keepers_statistics_record_is_served_as_keeper_series(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 40, due_share=0.5)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()
        node.store.write(
            [RowWrite(key="https://shop.example/new", route="product", next_render_at=1)]
        )

        def applied() -> KeeperStatistics | None:
            record = keeper_record(node)
            return record if record is not None and record.events >= 1 else None

        wait_for(applied, 30, "a record with the write applied", 0.05)
        node.stop_keeper()  # the record holds still from here
        record = keeper_record(node)
        response = client.get("/metrics")
    assert response.status_code == 200 and record is not None
    samples = metric_samples(response.text)
    assert samples["renderqueue_keeper_feed_events_total"] == record.events >= 1
    assert samples["renderqueue_keeper_feed_failures_total"] == record.feed_failures == 0
    assert samples["renderqueue_keeper_feed_reopens_total"] == record.feed_reopens
    assert samples["renderqueue_keeper_cursor_resets_total"] == record.cursor_resets
    assert samples["renderqueue_keeper_resyncs_total"] == record.resyncs
    assert samples["renderqueue_keeper_walk_errors_total"] == record.walk_errors
    assert samples["renderqueue_keeper_publish_failures_total"] == record.publish.failures
    assert samples["renderqueue_keeper_memory_bytes"] == record.memory_bytes > 0
    assert samples["renderqueue_keeper_short_slice"] == int(record.short_slice)
    failures = "renderqueue_keeper_state_write_failures_total"
    assert samples[f'{failures}{{record="queue_state"}}'] == record.state_write_failures == 0
    assert samples[f'{failures}{{record="statistics"}}'] == record.statistics_write_failures == 0
    feed = record.feed
    assert feed is not None and feed.events >= 1
    waits = "renderqueue_keeper_feed_waits_total"
    assert samples[f'{waits}{{ended_by="post"}}'] == feed.woken
    assert samples[f'{waits}{{ended_by="data_version"}}'] == feed.noticed
    assert samples[f'{waits}{{ended_by="timeout"}}'] == feed.timeouts
    assert samples["renderqueue_keeper_feed_polls_total"] == feed.polls >= 1
    assert samples["renderqueue_keeper_feed_log_entries_total"] == feed.log_entries >= 1
    publishes = "renderqueue_keeper_publishes_total"
    publish = record.publish
    assert samples[f'{publishes}{{reason="refill"}}'] == publish.refills
    assert samples[f'{publishes}{{reason="interval"}}'] == publish.publishes - publish.refills
    assert publish.publishes >= 1


def test_the_feeds_pruning_is_served_where_the_feed_prunes(tmp_path: Path) -> None:
    """A PostgreSQL feed prunes the log itself and counts it; a SQLite one does not, and its
    record leaves the count out (the store's writers prune there)."""
    assert set(PRUNING_SERIES) <= readme_series()[0]  # the README names what is tested here
    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path) as node, node.client() as client:

        def with_feed() -> KeeperStatistics | None:
            record = keeper_record(node)
            return record if record is not None and record.feed is not None else None

        record = wait_for(with_feed, 30, "the keeper's record with its feed", 0.05)
        node.stop_keeper()  # nothing overwrites the records written below
        assert record.feed is not None
        retained, failures = PRUNING_SERIES
        for counted, failed in ((1234, 2), (None, 0)):
            feed = msgspec.structs.replace(record.feed, log_retained=counted, prune_failures=failed)
            payload = encode_keeper_statistics(msgspec.structs.replace(record, feed=feed))
            node.segments.keeper.write(payload, now_ms())
            samples = metric_samples(client.get("/metrics").text)
            assert samples.get(retained) == counted
            assert samples.get(failures) == (failed if counted is not None else None)


def test_the_skip_series_come_from_the_keepers_record(tmp_path: Path) -> None:
    """The leased rows the last publish passed over, and the skip table's size, are the
    record's; a record without a skip table leaves its size out."""
    from keeper.state import SkipStatistics

    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path) as node, node.client() as client:
        record = wait_for(lambda: keeper_record(node), 30, "the keeper's record", 0.05)
        node.stop_keeper()  # nothing overwrites the records written below
        for passed, skips in ((7, SkipStatistics(marked=9, capacity=2048, rebuilds=1)), (0, None)):
            publish = msgspec.structs.replace(record.publish, last_passed=passed)
            written = msgspec.structs.replace(record, publish=publish, skips=skips)
            node.segments.keeper.write(encode_keeper_statistics(written), now_ms())
            samples = metric_samples(client.get("/metrics").text)
            assert samples["renderqueue_keeper_leased_rows_passed"] == passed
            assert samples.get("renderqueue_keeper_skip_table_entries") == (
                None if skips is None else 2048
            )


def test_the_cluster_fence_series_come_from_the_keepers_record_in_a_cluster(
    tmp_path: Path,
) -> None:
    """A cluster's keeper record carries its fences and its count of the due keys they
    hold back; a single node's carries no cluster, and the series are left out."""
    from keeper.state import ClusterStatistics, Fence, FenceCount, FencedGroup

    assert set(CLUSTER_SERIES) <= readme_series()[0]  # the README names what is tested here
    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path) as node, node.client() as client:
        record = wait_for(lambda: keeper_record(node), 30, "the keeper's record", 0.05)
        node.stop_keeper()  # nothing overwrites the records written below
        fenced_keys, until_seconds, ceiling_seconds, ceiling_failures, members, confirmed = (
            CLUSTER_SERIES
        )
        assert fenced_keys not in metric_samples(client.get("/metrics").text)
        now = now_ms()
        until = now + 60_000
        cluster = ClusterStatistics(
            node="test",
            view=["other", "test"],
            generation=2,
            confirmed=True,
            confirmed_at=now,
            changes=2,
            reads=3,
            read_failures=0,
            fences=[Fence(node="other", view=(), until_ms=until, reason="handed over", keys=9)],
            fenced_until=until,
            fenced=FencedGroup(
                due=4,
                until_ms=until,
                reasons=[
                    FenceCount(node="other", reason="handed over", due=4, until_ms=until, keys=9)
                ],
            ),
            claimable=6,
            counted_at=now,
            lease_ceiling=now + 9_000,
            lease_ceiling_failures=2,
        )
        payload = encode_keeper_statistics(msgspec.structs.replace(record, cluster=cluster))
        node.segments.keeper.write(payload, now_ms())
        samples = metric_samples(client.get("/metrics").text)
        assert samples[fenced_keys] == 4
        assert samples[until_seconds] == until / 1000
        assert samples[ceiling_seconds] == (now + 9_000) / 1000
        assert samples[ceiling_failures] == 2
        assert samples[members] == 2
        assert samples[confirmed] == 1
        unconfirmed = msgspec.structs.replace(cluster, view=["other"], confirmed=False)
        payload = encode_keeper_statistics(msgspec.structs.replace(record, cluster=unconfirmed))
        node.segments.keeper.write(payload, now_ms())
        samples = metric_samples(client.get("/metrics").text)
        assert samples[members] == 1
        assert samples[confirmed] == 0


def test_an_unreadable_keeper_record_leaves_its_series_out_and_is_no_error(
    tmp_path: Path,
) -> None:
    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        for payload in (b"\xc1 not msgpack", msgspec.msgpack.encode({"phase": "live"})):
            node.segments.keeper.write(payload, now_ms())
            response = client.get("/metrics")
            assert response.status_code == 200
            samples = metric_samples(response.text)
            assert samples["renderqueue_ready"] == 0
            assert not [key for key in samples if key.startswith(KEEPER_SERIES)]
            overview = client.get("/prerender_admin/overview")
            assert overview.status_code == 200 and "keeper" not in overview.json()


def test_the_wal_series_come_from_the_supervisors_record_and_only_when_well_formed(
    tmp_path: Path,
) -> None:
    with thread_node(tmp_path, keeper=False) as node, node.client() as client:
        wal = {"page_size": 4096, "frames": 70, "checkpointed": 50, "file_bytes": 300_000}
        node.segments.supervisor.write(msgspec.msgpack.encode({"wal": wal}), now_ms())
        samples = metric_samples(client.get("/metrics").text)
        assert samples[f"{SUPERVISOR_WAL_SERIES}frames"] == 70
        assert samples[f"{SUPERVISOR_WAL_SERIES}uncheckpointed_frames"] == 20
        assert samples[f"{SUPERVISOR_WAL_SERIES}file_bytes"] == 300_000
        for bad in (
            None,
            "70",
            {"frames": 70},
            {**wal, "frames": "70"},
            {**wal, "file_bytes": 1.5},
        ):
            node.segments.supervisor.write(msgspec.msgpack.encode({"wal": bad}), now_ms())
            response = client.get("/metrics")
            assert response.status_code == 200
            assert not [
                k for k in metric_samples(response.text) if k.startswith(SUPERVISOR_WAL_SERIES)
            ], bad


def test_prometheus_clients_own_parser_reads_every_series_the_readme_names(
    tmp_path: Path, node_backend: str
) -> None:
    seed_rows(node_db(tmp_path), 20)
    with thread_node(tmp_path) as node, node.client() as client:
        node.wait_exact()
        (lease,) = client.post("/v1/claims", json={"max": 1, "worker": "t"}).json()["leases"]
        item = {"key": lease["key"], "token": lease["token"], "outcome": "failed"}
        client.post("/v1/completions", json={"items": [item]})

        def with_keeper_series() -> str | None:
            text = client.get("/metrics").text
            return text if "renderqueue_keeper_feed_events_total" in text else None

        text = wait_for(with_keeper_series, 30, "the keeper's statistics series", 0.1)
    families = list(text_string_to_metric_families(text))
    samples = {sample.name for family in families for sample in family.samples}
    assert samples == {
        key.split("{")[0] for key in metric_samples(text)
    }  # both parsers read it alike
    exact, prefixes = readme_series()
    assert exact  # the README still names some
    # A SQLite store's WAL is read by the supervisor, which a node in this process lacks:
    # test_workers_supervisor checks those series on a node process.
    exact = {name for name in exact if not name.startswith(SUPERVISOR_WAL_SERIES)}
    # Served only by a feed that prunes (PostgreSQL), after its first round: the test of
    # the feed's pruning series checks them.
    exact -= set(PRUNING_SERIES)
    # Served only by a cluster's node: the test of the fence series checks them, and
    # tests/test_ops_prometheus.py scrapes the heartbeat's from real nodes.
    exact -= set(CLUSTER_SERIES) | set(MEMBERSHIP_SERIES)
    # Served only while a row is retired: tests/test_api_retire.py checks it.
    exact.discard("renderqueue_rows_retired_by_route")
    # A worker's counts of the other backend's store are not served.
    other = "renderqueue_postgres_" if node_backend == "sqlite" else "renderqueue_sqlite_"
    exact = {name for name in exact if not name.startswith(other)}
    assert exact - samples == set()
    for prefix in prefixes:
        assert any(name.startswith(prefix) for name in samples), prefix
    assert {family.type for family in families} <= {"gauge", "counter"}


def test_a_cluster_nodes_heartbeat_series_come_from_the_supervisors_record() -> None:
    """The heartbeat's age and failures, from the supervisor's membership record; no age
    before the first heartbeat lands, and no series at all off a cluster."""
    from api.metrics import Exposition, membership_metrics

    now = now_ms()
    for membership, age, failures in (
        ({"last_heartbeat_at": now - 2500, "failures": 3}, 2.5, 3),
        ({"last_heartbeat_at": 0, "failures": 1}, None, 1),
        (None, None, None),
    ):
        out = Exposition()
        membership_metrics(out, membership, now)
        samples = metric_samples(out.text()) if out.lines else {}
        assert samples.get("renderqueue_cluster_heartbeat_age_seconds") == age
        assert samples.get("renderqueue_cluster_heartbeat_failures_total") == failures
    assert set(MEMBERSHIP_SERIES) <= readme_series()[0]  # the operator's reference names them
