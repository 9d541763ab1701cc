"""A worker's report to its supervisor: one line, whole or not at all, and only a valid
report is taken from the pipe or from the supervisor's record."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import msgspec
import pytest
from node_harness import node_db, seed_rows, thread_node

from api.completions import CompletionQueueStatistics
from api.lane import StoreLane
from api.node import Node
from api.report import (
    MAX_REASON_CHARS,
    MAX_REPORT_BYTES,
    REPORT_PREFIX,
    WorkerReport,
    decode_report_line,
    encode_report_line,
    report_from,
    worker_report,
)
from store.base import PostgresCounters, SqliteCounters, StoreCounters, Writability


def a_report(reason: str = "") -> WorkerReport:
    return WorkerReport(
        written_at=1_700_000_000_000,
        store=StoreCounters(
            writability=Writability(writable=not reason, refused=3, reason=reason),
            transactions=7,
            rows_written=700,
            busy_refused=1,
            sqlite=SqliteCounters(
                busy_retries=2,
                checkpoints=5,
                restarts=1,
                restarts_busy=0,
                checkpoint_errors=0,
                longest_checkpoint_ms=12.5,
            ),
        ),
        completions=CompletionQueueStatistics(
            requests=9, waited=1, joined=2, transactions=6, busy_attempts=1, timed_out=0
        ),
        claims_waiting=4,
    )


def test_a_report_goes_through_its_line_unchanged() -> None:
    report = a_report()
    line = encode_report_line(report)
    assert line is not None and line.startswith(REPORT_PREFIX) and line.endswith(b"\n")
    assert line.count(b"\n") == 1
    assert decode_report_line(line.rstrip(b"\n")) == report
    assert report_from(msgspec.to_builtins(report)) == report
    postgres = msgspec.structs.replace(
        report,
        store=msgspec.structs.replace(
            report.store, sqlite=None, postgres=PostgresCounters(reconnects=1, rollbacks=2)
        ),
    )
    line = encode_report_line(postgres)
    assert line is not None and decode_report_line(line.rstrip(b"\n")) == postgres


def test_a_report_that_would_not_be_one_atomic_write_is_not_sent() -> None:
    assert encode_report_line(a_report(reason="x" * MAX_REPORT_BYTES)) is None
    # The reason strings a store writes are far shorter: a real one fits with room.
    line = encode_report_line(a_report(reason="disk I/O error " * 20))
    assert line is not None and len(line) < MAX_REPORT_BYTES // 2


@pytest.mark.parametrize(
    "line",
    [
        b"ready",
        b"report ",
        b"report not json",
        b"report []",
        b'report {"written_at": 1}',
        b"report " + msgspec.json.encode({**msgspec.to_builtins(a_report()), "written_at": "x"}),
        b"reportx" + msgspec.json.encode(a_report()),
    ],
)
def test_what_is_not_a_report_is_refused(line: bytes) -> None:
    assert decode_report_line(line) is None


def test_a_record_that_is_not_a_report_is_refused() -> None:
    good = msgspec.to_builtins(a_report())
    assert report_from(None) is None
    assert report_from({**good, "store": {"transactions": -1}}) is None
    assert report_from({**good, "completions": "all of them"}) is None


@pytest.mark.usefixtures("node_backend")  # on SQLite, then on PostgreSQL
def test_a_workers_report_counts_its_writes(tmp_path: Path) -> None:
    seed_rows(node_db(tmp_path), 10)
    with thread_node(tmp_path) as node:
        before = worker_report(node.node, node.services.completions.statistics())
        upsert = [
            {"key": f"https://r.example/{i}", "route": "r", "next_render_at": 1} for i in range(25)
        ]
        with node.client() as client:
            for _ in range(3):
                assert client.post("/v1/schedule", json={"upsert": upsert}).status_code == 200
        after = worker_report(node.node, node.services.completions.statistics())
    assert after.store.transactions - before.store.transactions == 3
    assert after.store.rows_written - before.store.rows_written == 75
    assert after.store.writability.writable
    assert (after.store.sqlite is None) != (after.store.postgres is None)
    assert after.written_at >= before.written_at


def test_a_long_disk_error_is_cut_so_the_report_still_goes() -> None:
    class Store:
        def counters(self) -> StoreCounters:
            return a_report(reason="\u00e9" * 10_000).store

    node = cast(Node, SimpleNamespace(store=Store(), lane=StoreLane(), claims_waiting=0))
    report = worker_report(node, a_report().completions)
    reason = report.store.writability.reason
    assert len(reason) == MAX_REASON_CHARS and reason.endswith("…")
    assert not report.store.writability.writable
    line = encode_report_line(report)
    assert line is not None and decode_report_line(line.rstrip(b"\n")) == report
