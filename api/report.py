"""What a worker tells its supervisor of itself, about once a second: the counts only its
own process holds (its store object's writes, its completion queue, its store lane). The
supervisor keeps each worker's latest report in its shared record, so any worker can serve
every worker's counts on `/metrics`, and a scrape does not depend on which worker answers it.

A report travels as one line on the worker's status pipe (`report ` and its JSON). It is
written whole or not at all: under PIPE_BUF bytes a pipe write is atomic, and the pipe is
non-blocking, so a supervisor that is not reading costs a report, never the event loop.
"""

from __future__ import annotations

import select
from typing import TYPE_CHECKING

import msgspec

from api.completions import CompletionQueueStatistics
from api.lane import LaneStatistics
from shm.segment import now_ms
from store.base import StoreCounters

if TYPE_CHECKING:  # the supervisor reads reports without the API's node
    from api.node import Node

REPORT_PREFIX = b"report "
# A pipe write of at most PIPE_BUF bytes is never split or interleaved with another.
MAX_REPORT_BYTES = select.PIPE_BUF
# A disk error's message, as the report carries it; in UTF-8 at most 4 bytes a character,
# with the counts, well under MAX_REPORT_BYTES.
MAX_REASON_CHARS = 500


class WorkerReport(msgspec.Struct, frozen=True, kw_only=True):
    written_at: int  # ms since the epoch
    store: StoreCounters
    completions: CompletionQueueStatistics
    lane: LaneStatistics | None = None  # its store lane (api.lane); None from older builds
    claims_waiting: int = 0  # claims long-polling on it (api.node.Node.claims_waiting)


def worker_report(node: Node, completions: CompletionQueueStatistics) -> WorkerReport:
    store = node.store.counters()
    reason = store.writability.reason
    if len(reason) > MAX_REASON_CHARS:  # the one free-form string: it must not cost the report
        writability = msgspec.structs.replace(
            store.writability, reason=reason[: MAX_REASON_CHARS - 1] + "…"
        )
        store = msgspec.structs.replace(store, writability=writability)
    return WorkerReport(
        written_at=now_ms(),
        store=store,
        completions=completions,
        lane=node.lane.statistics(),
        claims_waiting=node.claims_waiting,
    )


def encode_report_line(report: WorkerReport) -> bytes | None:
    """The status-pipe line; None if it would not fit in one atomic write."""
    line = REPORT_PREFIX + msgspec.json.encode(report) + b"\n"
    return line if len(line) <= MAX_REPORT_BYTES else None


def decode_report_line(line: bytes) -> WorkerReport | None:
    """A report line's record; None for any other line or one that is not a valid report."""
    if not line.startswith(REPORT_PREFIX):
        return None
    try:
        return msgspec.json.decode(line[len(REPORT_PREFIX) :], type=WorkerReport)
    except msgspec.DecodeError:  # malformed, or valid JSON of another shape
        return None


def report_from(value: object) -> WorkerReport | None:
    """A report as the supervisor's record carries it (decoded untyped), checked."""
    try:
        return msgspec.convert(value, WorkerReport)
    except msgspec.ValidationError:
        return None
