"""The SQLite schema and its versioned migrations.

The change log is filled by triggers inside the writing transaction, so a write
and its log entry commit together or not at all. With one writer at a time, seq
order is commit order. `seq` is the rowid (max + 1), not AUTOINCREMENT: pruning
never removes the newest entry, so a committed seq is never reused all the same
(a rolled-back transaction takes its seqs back with it, unseen), and each write
skips AUTOINCREMENT's extra `sqlite_sequence` page, one more page written and synced
per commit. Each entry carries a random `stamp` so a cursor can tell its
entry from a different one that reused the seq after the log was rolled back by
a power loss.

A row's `version` is the seq of the log entry its write made, so versions only
grow, even across a delete and re-insert of the same key.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

from store import schema
from store.errors import StoreError
from store.rows import DEFAULT_RETIRE_AFTER, MAX_RETIRE_AFTER
from store.schema import KIND_SITE
from store.secret import new_secret

# Every TRIM_EVERY-th log entry's write removes up to TRIM_ENTRIES below the floor (about a
# page): the log can shrink four times as fast as it grows, and the page holding its oldest
# entries is rewritten once per 16 writes rather than by every one.
TRIM_EVERY = 16
TRIM_ENTRIES = 64

# The seq the next log entry will take, read inside the writing statement.
NEXT_SEQ = "(SELECT coalesce(max(seq), 0) + 1 FROM change_log)"

_V1 = [
    """CREATE TABLE render_schedule (
        key TEXT PRIMARY KEY NOT NULL CHECK (key <> ''),
        route TEXT NOT NULL,
        cadence_s INTEGER CHECK (cadence_s IS NULL OR cadence_s > 0),
        sitemap INTEGER NOT NULL CHECK (sitemap IN (0, 1)),
        next_render_at INTEGER NOT NULL,
        last_rendered_at INTEGER,
        last_outcome TEXT,
        version INTEGER NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE routes (
        route TEXT PRIMARY KEY NOT NULL,
        default_cadence_s INTEGER CHECK (default_cadence_s IS NULL OR default_cadence_s > 0),
        paused INTEGER NOT NULL DEFAULT 0 CHECK (paused IN (0, 1))
    ) WITHOUT ROWID""",
    """CREATE TABLE settings (
        name TEXT PRIMARY KEY NOT NULL,
        value INTEGER NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE change_log (
        seq INTEGER PRIMARY KEY,
        kind INTEGER NOT NULL,
        key TEXT NOT NULL,
        stamp INTEGER NOT NULL
    )""",
    # One row per registered consumer: pruning never passes the lowest cursor here.
    """CREATE TABLE feed_consumers (
        consumer TEXT PRIMARY KEY NOT NULL,
        seq INTEGER NOT NULL,
        stamp INTEGER NOT NULL,
        wake TEXT NOT NULL,
        saved_at INTEGER NOT NULL
    ) WITHOUT ROWID""",
    # floor: every log entry with seq >= floor is present (0: nothing was ever pruned).
    """CREATE TABLE feed_state (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        floor INTEGER NOT NULL,
        resyncs INTEGER NOT NULL
    )""",
    "INSERT INTO feed_state (id, floor, resyncs) VALUES (1, 0, 0)",
    """CREATE TRIGGER render_schedule_logged_insert AFTER INSERT ON render_schedule BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (0, NEW.key, random());
    END""",
    """CREATE TRIGGER render_schedule_logged_update AFTER UPDATE ON render_schedule BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (0, NEW.key, random());
    END""",
    """CREATE TRIGGER render_schedule_logged_delete AFTER DELETE ON render_schedule BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (0, OLD.key, random());
    END""",
    """CREATE TRIGGER routes_logged_insert AFTER INSERT ON routes BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (1, NEW.route, random());
    END""",
    """CREATE TRIGGER routes_logged_update AFTER UPDATE ON routes BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (1, NEW.route, random());
    END""",
    """CREATE TRIGGER routes_logged_delete AFTER DELETE ON routes BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (1, OLD.route, random());
    END""",
    """CREATE TRIGGER settings_logged_insert AFTER INSERT ON settings BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (2, NEW.name, random());
    END""",
    """CREATE TRIGGER settings_logged_update AFTER UPDATE ON settings BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES (2, NEW.name, random());
    END""",
]

# Writes trim log entries below the floor, so the log shrinks by small steps
# inside the writers' own transactions instead of in bulk deletes that hold the write
# lock for milliseconds. Only entries below the committed floor go: the floor is raised
# first (SqliteStore.raise_floor), and the entry at the floor stays.
_V2 = [
    f"""CREATE TRIGGER change_log_trimmed AFTER INSERT ON change_log
    WHEN NEW.seq % {TRIM_EVERY} = 0 BEGIN
        DELETE FROM change_log WHERE seq < min(
            (SELECT floor FROM feed_state WHERE id = 1),
            (SELECT min(seq) FROM change_log) + {TRIM_ENTRIES});
    END""",
]

# The key hashes' secret (store/secret.py): one row, written with the table.
_V3 = [
    """CREATE TABLE hash_secret (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        secret BLOB NOT NULL
    )""",
]


# Sites' own politeness settings (shm/sites.py); a site with neither set has no row.
_V4 = [
    """CREATE TABLE site_settings (
        site TEXT PRIMARY KEY NOT NULL CHECK (site <> ''),
        max_in_flight INTEGER CHECK (max_in_flight IS NULL OR max_in_flight >= 0),
        min_interval_ms INTEGER CHECK (min_interval_ms IS NULL OR min_interval_ms >= 0),
        CHECK (max_in_flight IS NOT NULL OR min_interval_ms IS NOT NULL)
    ) WITHOUT ROWID""",
    f"""CREATE TRIGGER site_settings_logged_insert AFTER INSERT ON site_settings BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES ({KIND_SITE}, NEW.site, random());
    END""",
    f"""CREATE TRIGGER site_settings_logged_update AFTER UPDATE ON site_settings BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES ({KIND_SITE}, NEW.site, random());
    END""",
    f"""CREATE TRIGGER site_settings_logged_delete AFTER DELETE ON site_settings BEGIN
        INSERT INTO change_log (kind, key, stamp) VALUES ({KIND_SITE}, OLD.site, random());
    END""",
]


# Adaptive cadence (store.cadence): a row's learned cadence and recent history, and a
# route's adaptation (all four set, or none).
_V5 = [
    """ALTER TABLE render_schedule ADD COLUMN learned_cadence_s INTEGER
        CHECK (learned_cadence_s IS NULL OR learned_cadence_s > 0)""",
    "ALTER TABLE render_schedule ADD COLUMN change_history INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE routes ADD COLUMN adapt_min_s INTEGER",
    "ALTER TABLE routes ADD COLUMN adapt_max_s INTEGER",
    "ALTER TABLE routes ADD COLUMN adapt_inc REAL",
    "ALTER TABLE routes ADD COLUMN adapt_dec REAL",
]


def _seed_secret(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO hash_secret (id, secret) VALUES (1, ?)", (new_secret(),))


# A route's site pattern (shm.keys.site_pattern checks it; NULL: each key's own host).
_V6 = ["ALTER TABLE routes ADD COLUMN site_pattern TEXT"]

# Rows that retire: a streak of `not_found` outcomes, and once it reaches the route's
# `retire_after`, when and why the row retired (kept, never due). The partial index lists
# the retired rows by key without reading the others.
_V7 = [
    "ALTER TABLE render_schedule ADD COLUMN not_found_streak INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE render_schedule ADD COLUMN retired_at INTEGER",
    "ALTER TABLE render_schedule ADD COLUMN retired_reason TEXT",
    f"""ALTER TABLE routes ADD COLUMN retire_after INTEGER NOT NULL
        DEFAULT {DEFAULT_RETIRE_AFTER}
        CHECK (retire_after BETWEEN 1 AND {MAX_RETIRE_AFTER})""",
    "CREATE INDEX render_schedule_retired ON render_schedule (key) WHERE retired_at IS NOT NULL",
]

# Index i holds the statements that take a database from version i to i + 1.
MIGRATIONS: list[list[str]] = [_V1, _V2, _V3, _V4, _V5, _V6, _V7]
LATEST = len(MIGRATIONS)


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def schema_version(conn: sqlite3.Connection) -> int:
    """The database's schema version; 0 for an empty file."""
    tables = _tables(conn)
    if "schema_version" not in tables:
        if "render_schedule" in tables or "change_log" in tables:
            raise StoreError("the database has renderqueue tables but no schema_version table")
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


_RECORD = "INSERT INTO schema_version (version) VALUES (?)"
STEPS = schema.Steps(MIGRATIONS, schema_version, _RECORD, {3: _seed_secret})


@contextmanager
def _write_lock(conn: sqlite3.Connection) -> Iterator[None]:
    """SQLite's one writer at a time, and the migration's transaction."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def migrate(conn: sqlite3.Connection, where: str) -> int:
    """Bring the database to LATEST in one transaction; returns the version found before.

    The connection must be in autocommit mode (isolation_level=None).
    """
    return schema.migrate(conn, STEPS, _write_lock, where)
