"""`GET /metrics`: Prometheus text format, built from the keeper's queue-state record, its
statistics record, the supervisor's (with each worker's report of its own counts,
api.report), and the shared-memory primitives' `statistics()`, never re-derived from the
table.

Gauges an autoscaler reads: `renderqueue_due_claimable` (work a fleet can be granted now;
`renderqueue_due` counts fenced keys too) and `renderqueue_in_flight`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from api.completions import CompletionQueueStatistics
from api.node import Node
from api.report import WorkerReport, report_from, worker_report
from api.status import claim_status, fences_of, lease_view, supervisor_statistics
from api.version import VERSION
from keeper.state import (
    ClassRow,
    QueueState,
    decode_queue_state,
    liveness,
    state_age_ms,
    vouches,
)
from shm.segment import now_ms
from store.base import PostgresCounters, SqliteCounters

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CLAIM_STATUSES = ("ready", "draining", "fenced", "stalled", "unready")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


@dataclass
class Exposition:
    lines: list[str] = field(default_factory=list)

    def metric(
        self,
        name: str,
        kind: str,
        help_text: str,
        samples: Iterable[tuple[dict[str, str], float | int | None]],
    ) -> None:
        rendered = [
            f"{name}{_labels(labels)} {_number(value)}"
            for labels, value in samples
            if value is not None
        ]
        if not rendered:
            return
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        self.lines.extend(rendered)

    def gauge(self, name: str, help_text: str, value: float | int | None, **labels: str) -> None:
        self.metric(name, "gauge", help_text, [(labels, value)])

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{key}="{_escape(str(value))}"' for key, value in sorted(labels.items()))
    return "{" + inner + "}"


def _number(value: float | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def render(node: Node, completions: CompletionQueueStatistics) -> str:
    """`completions`: this worker's completion queue's counts, for its own report."""
    now = now_ms()
    out = Exposition()
    leases = node.leases.statistics()
    ring = node.ring.statistics()
    status = claim_status(node, now, fences=True)
    out.gauge(
        "renderqueue_build_info",
        "Always 1; its version label is this node's renderqueue version.",
        1,
        version=VERSION,
    )
    out.gauge(
        "renderqueue_ready",
        "1 while this node can grant a claim (ready, draining the keeper's last set, or "
        "fenced until its fences end).",
        status.can_grant,
    )
    out.metric(
        "renderqueue_claim_status",
        "gauge",
        "1 for this node's claim status now: ready, draining (the keeper is not publishing; "
        "claims take its last set), fenced (in a cluster: every due key it owns is fenced), "
        "stalled (that set is drained), unready.",
        [({"status": name}, name == status.status) for name in CLAIM_STATUSES],
    )
    published_at = node.ring.published_at
    out.gauge(
        "renderqueue_publish_age_seconds",
        "Seconds since the keeper last published the ready ring.",
        (now - published_at) / 1000 if published_at else None,
    )
    out.gauge(
        "renderqueue_ready_ring_remaining",
        "Unclaimed entries left in the last published ring.",
        ring.remaining,
    )
    view = lease_view(node, supervisor_statistics(node), now)
    out.gauge(
        "renderqueue_in_flight",
        "Live leases: granted, not answered, not expired (a census of the lease table, at "
        "most a few seconds old).",
        view.in_flight,
    )
    out.gauge(
        "renderqueue_leases_expired_unanswered",
        "Leases that expired with no result and are not yet settled into their holds.",
        view.expired_unanswered,
    )
    out.gauge(
        "renderqueue_held_keys",
        "Keys held back now: leases that expired with no result, and failed renders.",
        view.held_keys,
    )
    out.metric(
        "renderqueue_failure_backoffs_total",
        "counter",
        "Failed renders that held their key back (2 lease lengths, doubling with each "
        "failure in a row, capped at its cadence).",
        [({}, leases.failures)],
    )
    out.metric(
        "renderqueue_holds_forgiven_total",
        "counter",
        "Holds ended by an operator's render-now.",
        [({}, leases.forgiven)],
    )
    out.metric(
        "renderqueue_lease_refusals_total",
        "counter",
        "Grants refused, by reason; a full probe window can refuse well below 100% occupancy.",
        [
            ({"reason": "taken"}, leases.refusals_taken),
            ({"reason": "held"}, leases.refusals_held),
            ({"reason": "probe_full"}, leases.refusals_probe_full),
        ],
    )
    out.metric(
        "renderqueue_lease_hold_events_total",
        "counter",
        "Leases that expired with no result and so started a hold on their key.",
        [({}, leases.hold_events)],
    )
    out.metric(
        "renderqueue_leases_granted_total", "counter", "Leases granted.", [({}, leases.grants)]
    )
    out.gauge("renderqueue_lease_table_occupancy", "Share of lease slots in use.", leases.occupancy)
    if node.marks is not None:
        marks = node.marks.statistics()
        out.metric(
            "renderqueue_claim_rows_total",
            "counter",
            "Granted keys, by how the claim answered them: from the ring entry (nothing wrote "
            "the key through this node since the keeper's view) or after reading the row.",
            [
                ({"answered": "from_ring"}, marks.answered_from_ring),
                ({"answered": "after_read"}, marks.read_after_grant),
            ],
        )
    _site_metrics(out, node)
    supervisor = supervisor_statistics(node)
    _supervisor_metrics(out, supervisor, now)
    _worker_metrics(out, worker_reports(node, completions, supervisor), now)
    _keeper_metrics(out, node, now)
    snapshot = node.state.read()
    if snapshot is None:
        out.gauge("renderqueue_keeper_live", "1 while the keeper is live.", 0)
        out.gauge("renderqueue_counts_trusted", "1 while queue counts are served.", 0)
        return out.text()
    state = decode_queue_state(snapshot.payload)
    seen = liveness(state, now)
    trusted = vouches(state, now)
    out.gauge("renderqueue_keeper_live", "1 while the keeper is live.", seen.live)
    out.gauge(
        "renderqueue_counts_trusted",
        "1 while the keeper vouches for its counts; the count gauges are left out otherwise.",
        trusted,
    )
    out.gauge("renderqueue_keeper_exact", "1 once the keeper matches the table.", state.trust.exact)
    out.gauge(
        "renderqueue_state_age_seconds",
        "Age of the keeper's counts.",
        state_age_ms(state, now) / 1000,
    )
    out.gauge(
        "renderqueue_feed_lag_seconds",
        "Since the keeper last read the change feed to its end, or the time it has been held "
        "back by an open transaction, whichever is longer.",
        state.trust.feed_lag_ms / 1000,
    )
    out.gauge(
        "renderqueue_feed_held_back_seconds",
        "How long one transaction still running has held the change feed back (PostgreSQL: "
        "it holds the snapshot's xmin; see renderqueue_feed_held_by_pid).",
        state.trust.feed_held_back_ms / 1000,
    )
    out.gauge(
        "renderqueue_feed_held_by_pid",
        "The PostgreSQL backend pid of the transaction holding the feed back (0: none).",
        state.trust.feed_held_by_pid,
    )
    out.metric(
        "renderqueue_keeper_repairs_total",
        "counter",
        "Rows the keeper's self-checks put right, by kind (gained: a membership change).",
        [
            ({"kind": kind}, count)
            for kind, count in msgspec.structs.asdict(state.trust.repairs).items()
        ],
    )
    if trusted:
        _count_metrics(out, state)
    return out.text()


def _site_metrics(out: Exposition, node: Node) -> None:
    if node.sites is None:
        return
    sites = node.sites.statistics()
    out.metric(
        "renderqueue_site_skips_total",
        "counter",
        "Keys a claim skipped for their site (they keep their place), by reason: capped "
        "(every permit live), spacing (inside min_interval_ms), blocked (Retry-After or a "
        "failure streak), table_full (no room in the site table for a site that needs it).",
        [
            ({"reason": "capped"}, sites.skips_capped),
            ({"reason": "spacing"}, sites.skips_spacing),
            ({"reason": "blocked"}, sites.skips_blocked),
            ({"reason": "table_full"}, sites.skips_full),
        ],
    )
    out.metric(
        "renderqueue_site_blocks_total",
        "counter",
        "Sites blocked, by reason: retry_after (an origin's Retry-After on a completion), "
        "failures (failed renders in a row).",
        [
            ({"reason": "retry_after"}, sites.blocks_retry_after),
            ({"reason": "failures"}, sites.blocks_failures),
        ],
    )
    out.metric(
        "renderqueue_site_permits_taken_total",
        "counter",
        "Site permits taken by grants and renewals (capped sites).",
        [({}, sites.permits_taken)],
    )
    out.gauge(
        "renderqueue_site_entries",
        "Sites with an entry in the site table (settings, a block, or leases under a cap or "
        "spacing); renderqueue_site_table_capacity is its size.",
        sites.entries,
    )
    out.gauge("renderqueue_site_table_capacity", "Entries the site table holds.", sites.capacity)


def _supervisor_metrics(out: Exposition, stats: dict[str, Any] | None, now: int) -> None:
    if stats is None:
        return
    membership_metrics(out, stats.get("membership"), now)
    workers = stats.get("workers") or []
    out.gauge(
        "renderqueue_workers_ready",
        "Worker processes serving.",
        sum(1 for worker in workers if worker.get("state") == "ready"),
    )
    out.metric(
        "renderqueue_worker_restarts_total",
        "counter",
        "Worker processes respawned by the supervisor, by worker index.",
        [({"worker": str(worker["index"])}, worker.get("restarts", 0)) for worker in workers],
    )
    _wal_metrics(out, stats.get("wal"))


def membership_metrics(out: Exposition, membership: dict[str, Any] | None, now: int) -> None:
    """A cluster node's heartbeat, from the supervisor's record (workers.membership): the
    age says a heartbeat that stopped landing before the node's row ages out of the view."""
    if not membership:
        return
    last = membership.get("last_heartbeat_at") or 0
    out.gauge(
        "renderqueue_cluster_heartbeat_age_seconds",
        "Seconds since this node's last heartbeat landed in the store (absent before the "
        "first). Past the node TTL, the others count this node gone.",
        max(0, now - last) / 1000 if last else None,
    )
    out.metric(
        "renderqueue_cluster_heartbeat_failures_total",
        "counter",
        "Heartbeats that failed (the store unreachable), since the node started.",
        [({}, membership.get("failures", 0))],
    )


def worker_reports(
    node: Node, completions: CompletionQueueStatistics, supervisor: dict[str, Any] | None
) -> dict[int, WorkerReport]:
    """Every worker's latest report from the supervisor's record, by index, and this
    worker's own counts as they are now. A report that does not check is left out."""
    reports: dict[int, WorkerReport] = {}
    for worker in (supervisor or {}).get("workers") or []:
        if isinstance(worker, dict) and type(worker.get("index")) is int:
            report = report_from(worker.get("report"))
            if report is not None:
                reports[worker["index"]] = report
    reports[node.settings.worker] = worker_report(node, completions)
    return dict(sorted(reports.items()))


Reader = Callable[[WorkerReport], float | int | None]


def _by_worker(
    reports: dict[int, WorkerReport], read: Reader, **labels: str
) -> list[tuple[dict[str, str], float | int | None]]:
    return [({"worker": str(index), **labels}, read(report)) for index, report in reports.items()]


def _sqlite(read: Callable[[SqliteCounters], float | int]) -> Reader:
    return lambda r: None if r.store.sqlite is None else read(r.store.sqlite)


def _postgres(read: Callable[[PostgresCounters], float | int]) -> Reader:
    return lambda r: None if r.store.postgres is None else read(r.store.postgres)


def _worker_metrics(out: Exposition, reports: dict[int, WorkerReport], now: int) -> None:
    """Counts each worker process keeps of itself, labelled by worker: whichever worker
    answers the scrape, every series is the same process's count, so rates hold. A series
    of one backend's counts is left out on the other (a None sample is not written)."""
    series: list[tuple[str, str, str, Reader]] = [
        (
            "renderqueue_worker_report_age_seconds",
            "gauge",
            "Age of the worker's last report of its own counts (they come about once a second).",
            lambda r: max(0, now - r.written_at) / 1000,
        ),
        (
            "renderqueue_store_writable",
            "gauge",
            "0 from a write the store's disk refused (full or failing) until a write "
            "succeeds; 1 otherwise.",
            lambda r: r.store.writability.writable,
        ),
        (
            "renderqueue_store_writes_refused_total",
            "counter",
            "Writes the store's disk refused (answered 507).",
            lambda r: r.store.writability.refused,
        ),
        (
            "renderqueue_store_transactions_total",
            "counter",
            "Write transactions the worker committed.",
            lambda r: r.store.transactions,
        ),
        (
            "renderqueue_store_rows_written_total",
            "counter",
            "Rows the worker's transactions wrote.",
            lambda r: r.store.rows_written,
        ),
        (
            "renderqueue_store_busy_refused_total",
            "counter",
            "Store calls given up after waiting out the lock other writers held (503).",
            lambda r: r.store.busy_refused,
        ),
        (
            "renderqueue_completion_requests_total",
            "counter",
            "Completion requests the worker answered.",
            lambda r: r.completions.requests,
        ),
        (
            "renderqueue_completion_transactions_total",
            "counter",
            "Transactions that committed completions: fewer than the requests when requests "
            "that arrived while one waited for the lock committed with it.",
            lambda r: r.completions.transactions,
        ),
        (
            "renderqueue_completion_timeouts_total",
            "counter",
            "Completion requests answered 503 after the store's lock wait.",
            lambda r: r.completions.timed_out,
        ),
        (
            "renderqueue_claims_waiting",
            "gauge",
            "Claims long-polling on the worker (wait_s) for the keeper's next publish: fleet "
            "workers idle for want of due work.",
            lambda r: r.claims_waiting,
        ),
        (
            "renderqueue_store_lane_pending",
            "gauge",
            "Store calls the worker has queued or running on its store lane, the one thread "
            "that makes them off the event loop.",
            lambda r: None if r.lane is None else r.lane.pending,
        ),
        (
            "renderqueue_store_lane_running_seconds",
            "gauge",
            "How long the store call the worker's lane is making now has waited (0: none): "
            "a store that stopped answering shows here first.",
            lambda r: None if r.lane is None else r.lane.running_s,
        ),
        (
            "renderqueue_store_lane_calls_total",
            "counter",
            "Store calls the worker's lane made.",
            lambda r: None if r.lane is None else r.lane.calls,
        ),
        (
            "renderqueue_store_lane_shed_total",
            "counter",
            "Store calls answered 503 untried: queued behind a call that found the store "
            "unavailable.",
            lambda r: None if r.lane is None else r.lane.shed,
        ),
        (
            "renderqueue_sqlite_busy_retries_total",
            "counter",
            "Write transactions tried again because another process held SQLite's write lock.",
            _sqlite(lambda c: c.busy_retries),
        ),
        (
            "renderqueue_sqlite_checkpoint_errors_total",
            "counter",
            "Upkeep rounds (a checkpoint or raising the log's floor) that failed; the "
            "upkeep thread goes on.",
            _sqlite(lambda c: c.checkpoint_errors),
        ),
        (
            "renderqueue_sqlite_checkpoint_longest_seconds",
            "gauge",
            "The longest checkpoint the worker's upkeep thread has run.",
            _sqlite(lambda c: c.longest_checkpoint_ms / 1000),
        ),
        (
            "renderqueue_postgres_reconnects_total",
            "counter",
            "PostgreSQL connections the worker replaced after one was lost.",
            _postgres(lambda c: c.reconnects),
        ),
        (
            "renderqueue_postgres_write_rollbacks_total",
            "counter",
            "Writes the server rolled back (deadlocks) and the worker retried.",
            _postgres(lambda c: c.rollbacks),
        ),
    ]
    for name, kind, help_text, read in series:
        out.metric(name, kind, help_text, _by_worker(reports, read))
    out.metric(
        "renderqueue_sqlite_checkpoints_total",
        "counter",
        "Checkpoints the worker's upkeep thread ran, by kind: passive (copies what it can, "
        "blocks nobody), restart (let the WAL start over) and restart_busy (a restart that "
        "could not get its turn in time).",
        [
            sample
            for kind, read in (
                ("passive", _sqlite(lambda c: c.checkpoints)),
                ("restart", _sqlite(lambda c: c.restarts)),
                ("restart_busy", _sqlite(lambda c: c.restarts_busy)),
            )
            for sample in _by_worker(reports, read, kind=kind)
        ],
    )


def _wal_metrics(out: Exposition, wal: object) -> None:
    """A SQLite store's WAL as the supervisor last read it (none on PostgreSQL)."""
    fields = ("frames", "checkpointed", "file_bytes")
    if not isinstance(wal, dict) or not all(type(wal.get(name)) is int for name in fields):
        return
    out.gauge(
        "renderqueue_sqlite_wal_frames",
        "Pages in the SQLite store's write-ahead log since it last started over.",
        wal["frames"],
    )
    out.gauge(
        "renderqueue_sqlite_wal_uncheckpointed_frames",
        "Of those, pages no checkpoint has copied into the database yet. Growing without "
        "end, checkpoints cannot finish: a reader holds an old snapshot.",
        wal["frames"] - wal["checkpointed"],
    )
    out.gauge(
        "renderqueue_sqlite_wal_file_bytes",
        "Length of the write-ahead log's file (it keeps its length when the log starts over).",
        wal["file_bytes"],
    )


def _keeper_metrics(out: Exposition, node: Node, now: int) -> None:
    """From the keeper's statistics record alone; none before its first or if it is unreadable."""
    stats = node.read_keeper_statistics()
    if stats is None:
        return
    if stats.cluster is not None:
        held = fences_of(stats.cluster, now)
        out.gauge(
            "renderqueue_cluster_members",
            "Live nodes in this node's view of the cluster, itself included while it is live.",
            len(stats.cluster.view),
        )
        out.gauge(
            "renderqueue_cluster_confirmed",
            "1 while this node has read itself live within the grant window; 0: it grants "
            "and renews nothing.",
            stats.cluster.confirmed,
        )
        out.gauge(
            "renderqueue_cluster_fenced_keys",
            "Due keys this node owns but may not grant yet: gained from another node whose "
            "leases on them may live, or all of them while its membership is unconfirmed "
            "(counted at the keeper's full report).",
            0 if held is None else held.due,
        )
        out.gauge(
            "renderqueue_cluster_fence_until_seconds",
            "When this node's last fence ends (epoch seconds; 0: no fence).",
            stats.cluster.fenced_until / 1000,
        )
        out.gauge(
            "renderqueue_cluster_lease_ceiling_seconds",
            "No lease this node grants or renews ends after this (epoch seconds, published "
            "in its row; 0: none yet): the others wait a silent death out until then.",
            stats.cluster.lease_ceiling / 1000,
        )
        out.metric(
            "renderqueue_cluster_lease_ceiling_failures_total",
            "counter",
            "Raises of the lease ceiling that failed or that the node's row refused.",
            [({}, stats.cluster.lease_ceiling_failures)],
        )
    for name, help_text, value in (
        ("feed_events", "Change-feed events the keeper applied.", stats.events),
        (
            "feed_failures",
            "Change-feed failures (each closes the feed to reopen).",
            stats.feed_failures,
        ),
        ("feed_reopens", "Change-feed reopens after a failure.", stats.feed_reopens),
        (
            "cursor_resets",
            "Reopens at the feed's head: the cursor was pruned or ahead.",
            stats.cursor_resets,
        ),
        ("resyncs", "Walks of the table to repair a feed gap.", stats.resyncs),
        ("walk_errors", "Walk chunks whose read failed (retried).", stats.walk_errors),
        ("publish_failures", "Publishes into the ready ring that failed.", stats.publish.failures),
    ):
        out.metric(f"renderqueue_keeper_{name}_total", "counter", help_text, [({}, value)])
    out.metric(
        "renderqueue_keeper_state_write_failures_total",
        "counter",
        "The keeper's writes into shared memory that failed, by record.",
        [
            ({"record": "queue_state"}, stats.state_write_failures),
            ({"record": "statistics"}, stats.statistics_write_failures),
        ],
    )
    out.gauge(
        "renderqueue_keeper_memory_bytes",
        "Bytes of the keeper's queue buffers, as of its last full report.",
        stats.memory_bytes,
    )
    out.metric(
        "renderqueue_keeper_publishes_total",
        "counter",
        "Publishes into the ready ring: on the publish interval, or early because claims "
        "took the ring below its refill mark (a refill).",
        [
            ({"reason": "interval"}, stats.publish.publishes - stats.publish.refills),
            ({"reason": "refill"}, stats.publish.refills),
        ],
    )
    out.gauge(
        "renderqueue_keeper_leased_rows_passed",
        "Leased rows the keeper's last publish passed over without probing the lease "
        "table (marked leased by an earlier publish): about the fleet's work in flight "
        "among the best due rows.",
        stats.publish.last_passed,
    )
    if stats.skips is not None:
        out.gauge(
            "renderqueue_keeper_skip_table_entries",
            "Entries the keeper's table of leased rows holds, live or dead (20 bytes "
            "each; sized by the work in flight, not by the queue).",
            stats.skips.capacity,
        )
    out.gauge(
        "renderqueue_keeper_short_slice",
        "1 if the keeper's thread got the shortest scheduler slice (Linux 6.12+).",
        stats.short_slice,
    )
    feed = stats.feed
    if feed is not None:
        out.metric(
            "renderqueue_keeper_feed_waits_total",
            "counter",
            "The keeper's feed waits by what ended them: a writer's post, a commit seen by "
            "polling data_version, or the timeout (since the feed last opened).",
            [
                ({"ended_by": "post"}, feed.woken),
                ({"ended_by": "data_version"}, feed.noticed),
                ({"ended_by": "timeout"}, feed.timeouts),
            ],
        )
        out.metric(
            "renderqueue_keeper_feed_polls_total",
            "counter",
            "Reads of the change feed by the keeper (since the feed last opened).",
            [({}, feed.polls)],
        )
        out.metric(
            "renderqueue_keeper_feed_log_entries_total",
            "counter",
            "Change log entries those reads delivered (since the feed last opened), "
            "counted before a key's entries in one read fold into one event.",
            [({}, feed.log_entries)],
        )
        if feed.log_retained is not None:  # the feed prunes the log itself (PostgreSQL)
            out.gauge(
                "renderqueue_feed_log_entries",
                "Entries the change log held after the feed's last pruning round (counted "
                "up to a million). Growing round after round, a consumer's saved cursor "
                "holds it: a node gone without leaving, until its cursor expires.",
                feed.log_retained,
            )
            out.metric(
                "renderqueue_feed_prune_failures_total",
                "counter",
                "Pruning rounds of the change log that failed (since the feed last opened).",
                [({}, feed.prune_failures)],
            )


def _count_metrics(out: Exposition, state: QueueState) -> None:
    now = state.now
    out.gauge(
        "renderqueue_due",
        "Due rows of routes not paused, fenced ones included (in a cluster, this node's).",
        now.due,
    )
    out.gauge(
        "renderqueue_due_claimable",
        "Of those, the rows no cluster fence holds back (claimable work; all on one node).",
        now.claimable,
    )
    out.metric(
        "renderqueue_due_by_source",
        "gauge",
        "Due rows by where they came from.",
        [({"source": "sitemap"}, now.due_sitemap), ({"source": "discovered"}, now.due_discovered)],
    )
    out.gauge("renderqueue_due_paused", "Due rows waiting on a paused route.", now.paused)
    out.gauge("renderqueue_unclaimed", "Due rows not in flight (estimate).", now.unclaimed_estimate)
    out.gauge("renderqueue_rows", "Rows the keeper holds.", now.held)
    retired = state.retired
    out.gauge(
        "renderqueue_rows_retired",
        "Retired rows (kept, never due: a streak of not_found outcomes retired them); "
        "deleted rows are not counted.",
        retired.total,
    )
    out.metric(
        "renderqueue_rows_retired_by_route",
        "gauge",
        "Retired rows per route (routes with none are left out).",
        [({"route": route}, count) for route, count in retired.by_route.items()],
    )
    out.gauge(
        "renderqueue_oldest_claimable_age_seconds",
        "Now minus the earliest due time among claimable rows.",
        state.autoscale.oldest_claimable_age_s,
    )
    coming = state.coming
    out.metric(
        "renderqueue_coming",
        "gauge",
        "Rows coming due within a window.",
        [
            ({"within": "15m"}, coming.due_15m),
            ({"within": "60m"}, coming.due_60m),
            ({"within": "24h"}, coming.due_24h),
        ],
    )
    lateness = state.lateness
    out.metric(
        "renderqueue_class_due",
        "gauge",
        "Due rows per class (route x cadence x cadence from row x sitemap).",
        [(_class_labels(row), row.due) for row in lateness.classes],
    )
    out.metric(
        "renderqueue_class_oldest_lateness_cadences",
        "gauge",
        "The oldest due row's lateness per class, in cadences (how far behind each class is).",
        [(_class_labels(row), row.oldest_lateness) for row in lateness.classes],
    )
    out.metric(
        "renderqueue_class_oldest_due_age_seconds",
        "gauge",
        "How long the oldest due row per class had been due at the keeper's count (classes "
        "of routes not paused).",
        [
            (_class_labels(row), _due_age_s(state.trust.counts_at, row.oldest_due_at))
            for row in lateness.classes
            if not row.paused
        ],
    )
    edges = lateness.edges
    for source, counts in (("sitemap", lateness.sitemap), ("discovered", lateness.discovered)):
        out.metric(
            f"renderqueue_due_lateness_{source}",
            "gauge",
            f"Due {source} rows by lateness in cadences; `ge` is each bin's lower edge.",
            [({"ge": _edge(edge)}, count) for edge, count in zip(edges, counts, strict=False)],
        )


def _due_age_s(counted_at: int, oldest_due_at: int | None) -> float | None:
    return None if oldest_due_at is None else max(0.0, (counted_at - oldest_due_at) / 1000)


def _class_labels(row: ClassRow) -> dict[str, str]:
    return {
        "route": row.route,
        "cadence_s": str(row.cadence_s),
        "cadence_from_row": "true" if row.cadence_from_row else "false",
        "sitemap": "true" if row.sitemap else "false",
    }


def _edge(edge: float) -> str:
    return str(int(edge)) if float(edge).is_integer() else repr(edge)
