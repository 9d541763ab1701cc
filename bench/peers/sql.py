"""The two SQL peers: the old design (SQLite, an index on next_render_at and an
indexed claim scan) and PostgreSQL `FOR UPDATE SKIP LOCKED` on an index on the
due column. Each claim pushes the due time to the lease's end, so the index
scan only ever meets unleased due rows: each peer at its best."""

from __future__ import annotations

import json
import shutil
import sqlite3
import tempfile
from pathlib import Path

import psycopg

from bench.harness.workload import PG_DSN, Rows, unique_suffix
from bench.peers.base import Spec

SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS render_schedule (
    key TEXT PRIMARY KEY,
    route TEXT NOT NULL,
    cadence_s INTEGER,
    sitemap INTEGER NOT NULL,
    next_render_at INTEGER NOT NULL,
    last_rendered_at INTEGER,
    last_outcome TEXT,
    version INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS render_schedule_due ON render_schedule (next_render_at);
"""

SQLITE_CLAIM = """
UPDATE render_schedule SET next_render_at = :lease_end, version = version + 1
WHERE key IN (
    SELECT key FROM render_schedule WHERE next_render_at <= :now
    ORDER BY next_render_at LIMIT :n
)
RETURNING key
"""

SQLITE_COMPLETE = """
UPDATE render_schedule
SET next_render_at = :now + cadence_s * 1000, last_rendered_at = :now,
    last_outcome = 'rendered', version = version + 1
WHERE key IN (SELECT value FROM json_each(:keys))
"""


def sqlite_connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, timeout=30)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    return db


class SqlitePeer:
    name = "SQLite index scan"

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"rqbench_sqlite_{unique_suffix()}_"))
        self.path = str(self.dir / "schedule.db")
        self.db = sqlite_connect(self.path)
        self.db.executescript(SQLITE_SCHEMA)

    def load(self, rows: Rows) -> None:
        self.db.execute("BEGIN")
        self.db.executemany(
            "INSERT INTO render_schedule (key, route, cadence_s, sitemap, next_render_at)"
            " VALUES (?, ?, ?, ?, ?)",
            zip(
                rows.keys,
                rows.routes,
                rows.cadences_s,
                rows.sitemaps,
                rows.next_render_at,
                strict=True,
            ),
        )
        self.db.execute("COMMIT")
        self.db.execute("ANALYZE")

    def churn(self, rows: Rows, plan: list[tuple[int, int]]) -> None:
        for start in range(0, len(plan), 1000):
            self.db.execute("BEGIN")
            self.db.executemany(
                "UPDATE render_schedule SET next_render_at = ?, version = version + 1"
                " WHERE key = ?",
                ((due, rows.keys[i]) for i, due in plan[start : start + 1000]),
            )
            self.db.execute("COMMIT")

    def spec(self) -> Spec:
        return Spec(kind="sqlite", params={"path": self.path})

    def drop(self) -> None:
        self.db.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class SqliteClaimant:
    def __init__(self, params: dict[str, str]) -> None:
        self.db = sqlite_connect(params["path"])

    def claim(self, n: int, now_ms: int, lease_ms: int) -> list[str]:
        cursor = self.db.execute(
            SQLITE_CLAIM, {"lease_end": now_ms + lease_ms, "now": now_ms, "n": n}
        )
        return [key for (key,) in cursor.fetchall()]

    def complete(self, keys: list[str], now_ms: int) -> None:
        self.db.execute(SQLITE_COMPLETE, {"now": now_ms, "keys": json.dumps(keys)})

    def close(self) -> None:
        self.db.close()


def pg_connect(dsn: str = PG_DSN) -> psycopg.Connection[tuple[object, ...]]:
    db = psycopg.connect(dsn, autocommit=True)
    # Matches SQLite's WAL + synchronous=NORMAL: durable order, no fsync per commit.
    db.execute("SET synchronous_commit = off")
    return db


class PostgresPeer:
    name = "PostgreSQL SKIP LOCKED"

    def __init__(self, dsn: str = PG_DSN) -> None:
        self.dsn = dsn
        self.table = f"rqbench_{unique_suffix()}"
        self.db = pg_connect(dsn)
        self.db.execute(
            f"""CREATE TABLE {self.table} (
                key text PRIMARY KEY,
                route text NOT NULL,
                cadence_s integer,
                sitemap boolean NOT NULL,
                next_render_at bigint NOT NULL,
                last_rendered_at bigint,
                last_outcome text,
                version bigint NOT NULL DEFAULT 0)"""
        )
        self.db.execute(f"CREATE INDEX {self.table}_due ON {self.table} (next_render_at)")

    def load(self, rows: Rows) -> None:
        with (
            self.db.cursor() as cursor,
            cursor.copy(
                f"COPY {self.table} (key, route, cadence_s, sitemap, next_render_at) FROM STDIN"
            ) as copy,
        ):
            for i in range(len(rows)):
                copy.write_row(
                    (
                        rows.keys[i],
                        rows.routes[i],
                        rows.cadences_s[i],
                        rows.sitemaps[i],
                        rows.next_render_at[i],
                    )
                )
        self.db.execute(f"ANALYZE {self.table}")

    def churn(self, rows: Rows, plan: list[tuple[int, int]]) -> None:
        for start in range(0, len(plan), 1000):
            part = plan[start : start + 1000]
            self.db.execute(
                f"""UPDATE {self.table} t SET next_render_at = v.due, version = t.version + 1
                FROM unnest(%s::text[], %s::bigint[]) AS v(key, due) WHERE t.key = v.key""",
                ([rows.keys[i] for i, _ in part], [due for _, due in part]),
            )
        self.db.execute(f"ANALYZE {self.table}")

    def spec(self) -> Spec:
        return Spec(kind="postgres", params={"dsn": self.dsn, "table": self.table})

    def drop(self) -> None:
        self.db.execute(f"DROP TABLE IF EXISTS {self.table}")
        self.db.close()


class PostgresClaimant:
    def __init__(self, params: dict[str, str]) -> None:
        table = params["table"]
        self.db = pg_connect(params["dsn"])
        self.claim_sql = f"""
            WITH picked AS (
                SELECT key FROM {table} WHERE next_render_at <= %(now)s
                ORDER BY next_render_at LIMIT %(n)s FOR UPDATE SKIP LOCKED)
            UPDATE {table} t SET next_render_at = %(lease_end)s, version = t.version + 1
            FROM picked WHERE t.key = picked.key RETURNING t.key"""
        self.complete_sql = f"""
            UPDATE {table} SET next_render_at = %(now)s + cadence_s * 1000::bigint,
                last_rendered_at = %(now)s, last_outcome = 'rendered', version = version + 1
            WHERE key = ANY(%(keys)s)"""

    def claim(self, n: int, now_ms: int, lease_ms: int) -> list[str]:
        cursor = self.db.execute(
            self.claim_sql, {"now": now_ms, "n": n, "lease_end": now_ms + lease_ms}, prepare=True
        )
        return [str(key) for (key,) in cursor.fetchall()]

    def complete(self, keys: list[str], now_ms: int) -> None:
        self.db.execute(self.complete_sql, {"now": now_ms, "keys": keys}, prepare=True)

    def close(self) -> None:
        self.db.close()
