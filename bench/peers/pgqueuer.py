"""PgQueuer (the PyPI package) draining the same jobs, through its own queries.

One job per row, its payload the key, `execute_after` the due time. PgQueuer
dequeues by priority then job id, never by due time, so it cannot hand out the
most overdue row first; it has no in-place reschedule of a queued job either.
So here a churn is cancel + enqueue, and a completion is the job logged as
successful + the next render enqueued one cadence ahead (two statements). A
claim is its `dequeue`, whose lease is the heartbeat timeout rather than a due
time pushed forward.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import psycopg
from pgqueuer.adapters.persistence import qb
from pgqueuer.adapters.persistence.queries import Queries
from pgqueuer.domain.settings import DBSettings
from pgqueuer.ports.repository import EntrypointExecutionParameter

from bench.harness.workload import PG_DSN, ROUTES, Rows, unique_suffix
from bench.peers.base import Spec

ENTRYPOINT = "render"
CADENCE_S = dict(ROUTES)


def queries_for(connection: psycopg.AsyncConnection[Any], prefix: str) -> Queries:
    from pgqueuer.adapters.drivers.psycopg import PsycopgDriver

    settings = DBSettings(prefix=prefix)
    return Queries(
        PsycopgDriver(connection),
        qbe=qb.QueryBuilderEnvironment(settings=settings),
        qbq=qb.QueryQueueBuilder(settings=settings),
        qbs=qb.QuerySchedulerBuilder(settings=settings),
    )


def _route_of(key: str) -> str:
    return key.split("/")[3]


class PgQueuerPeer:
    name = "PgQueuer"

    def __init__(self, dsn: str = PG_DSN) -> None:
        self.dsn = dsn
        self.prefix = f"rqbench_{unique_suffix()}_"
        self.loop = asyncio.new_event_loop()
        self.connection = self.loop.run_until_complete(
            psycopg.AsyncConnection.connect(dsn, autocommit=True)
        )
        self.queries = queries_for(self.connection, self.prefix)
        self.loop.run_until_complete(self.queries.install())
        self.job_ids: dict[int, int] = {}  # row index -> its queued job

    def _enqueue(self, rows: Rows, indexes: list[int], dues: list[int], now_ms: int) -> None:
        ids = self.loop.run_until_complete(
            self.queries.enqueue(
                [ENTRYPOINT] * len(indexes),
                [rows.keys[i].encode() for i in indexes],
                [0] * len(indexes),
                execute_after=[timedelta(milliseconds=max(0, due - now_ms)) for due in dues],
            )
        )
        for index, job_id in zip(indexes, ids, strict=True):
            self.job_ids[index] = int(job_id)

    def load(self, rows: Rows) -> None:
        import time

        now_ms = time.time_ns() // 1_000_000
        for part in rows.chunks(5000):
            indexes = list(part)
            self._enqueue(rows, indexes, [rows.next_render_at[i] for i in indexes], now_ms)

    def churn(self, rows: Rows, plan: list[tuple[int, int]]) -> None:
        import time

        now_ms = time.time_ns() // 1_000_000
        for start in range(0, len(plan), 1000):
            part = plan[start : start + 1000]
            cancelled = [self.job_ids[i] for i, _ in part]
            self.loop.run_until_complete(self.queries.mark_job_as_cancelled(cancelled))  # type: ignore[arg-type]
            self._enqueue(rows, [i for i, _ in part], [due for _, due in part], now_ms)
        # A long-running queue has planner statistics (autovacuum's ANALYZE); a fresh load
        # has none, and PgQueuer's dequeue plan is then far worse than it would be live.
        table = self.queries.qbe.settings.queue_table
        self.loop.run_until_complete(self.connection.execute(f"ANALYZE {table}"))

    def spec(self) -> Spec:
        return Spec(kind="pgqueuer", params={"dsn": self.dsn, "prefix": self.prefix})

    def drop(self) -> None:
        self.loop.run_until_complete(self.queries.uninstall())
        self.loop.run_until_complete(self.connection.close())
        self.loop.close()


class PgQueuerClaimant:
    def __init__(self, params: dict[str, str]) -> None:
        self.loop = asyncio.new_event_loop()
        self.connection = self.loop.run_until_complete(
            psycopg.AsyncConnection.connect(params["dsn"], autocommit=True)
        )
        self.queries = queries_for(self.connection, params["prefix"])
        self.manager = uuid.uuid4()
        self.entrypoints = {ENTRYPOINT: EntrypointExecutionParameter(concurrency_limit=0)}
        self.held: dict[str, Any] = {}  # key -> the dequeued job, for its completion

    def claim(self, n: int, now_ms: int, lease_ms: int) -> list[str]:
        jobs = self.loop.run_until_complete(
            self.queries.dequeue(
                batch_size=n,
                entrypoints=self.entrypoints,  # type: ignore[arg-type]
                queue_manager_id=self.manager,  # type: ignore[arg-type]
                global_concurrency_limit=None,
                heartbeat_timeout=timedelta(milliseconds=lease_ms),
            )
        )
        keys = []
        for job in jobs:
            key = (job.payload or b"").decode()
            self.held[key] = job
            keys.append(key)
        return keys

    def complete(self, keys: list[str], now_ms: int) -> None:
        jobs = [self.held.pop(key) for key in keys]
        self.loop.run_until_complete(
            self.queries.log_jobs([(job, "successful", None) for job in jobs])
        )
        self.loop.run_until_complete(
            self.queries.enqueue(
                [ENTRYPOINT] * len(keys),
                [key.encode() for key in keys],
                [0] * len(keys),
                execute_after=[timedelta(seconds=CADENCE_S[_route_of(key)]) for key in keys],
            )
        )

    def close(self) -> None:
        self.loop.run_until_complete(self.connection.close())
        self.loop.close()
