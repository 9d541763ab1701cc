"""The PostgreSQL schema and its versioned migrations.

The change log is filled by statement-level triggers in the writing transaction, so
a write and its entries commit together or not at all. Each entry carries the
writing transaction's id (`xid`, a 64-bit xid8 that never wraps) and a `seq` from a
sequence. Several transactions write at once and commit in any order, so no single
position orders the log by commit: a reader pages it by the keyset `(xid, seq)` and
reads only entries below its statement's snapshot xmin, every one of which belongs
to a finished transaction (see store.postgres.feed).

Each logging trigger also sends a NOTIFY with a constant payload, a wake-up hint for
the feed's listeners; a session (or database) that sets `renderqueue.notify` to `off`
sends none, for writers that need throughput more than the keeper's wake-up: listeners
then find its entries by their fallback look.

`feed_state.origin` names the cluster and database that wrote the log. A dump
restored elsewhere keeps the log's xids but not its origin: the store then treats
the log and the saved cursors as new (store.postgres.store.PostgresStore).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from store import schema
from store.errors import StoreError
from store.rows import DEFAULT_RETIRE_AFTER, MAX_RETIRE_AFTER
from store.schema import KIND_ROUTE, KIND_ROW, KIND_SETTINGS, KIND_SITE
from store.secret import new_secret

NOTIFY_CHANNEL = "renderqueue_feed"
# Taken for the whole of a migration, so nodes starting at once migrate one at a time.
MIGRATION_LOCK = 0x7265_6E64_6572_7175  # "renderqu"


def _logged(table: str, event: str, kind: int, column: str, rows: str) -> list[str]:
    """A statement-level AFTER trigger logging every row the statement touched."""
    name = f"{table}_logged_{event.lower()}"
    return [
        f"""CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO change_log (kind, key) SELECT {kind}, {column} FROM {rows};
            IF FOUND AND coalesce(current_setting('renderqueue.notify', true), '') <> 'off'
            THEN
                PERFORM pg_notify('{NOTIFY_CHANNEL}', '');
            END IF;
            RETURN NULL;
        END $$""",
        f"""CREATE TRIGGER {name} AFTER {event} ON {table}
        REFERENCING {"OLD" if event == "DELETE" else "NEW"} TABLE AS {rows}
        FOR EACH STATEMENT EXECUTE FUNCTION {name}()""",
    ]


# render_schedule leaves room in each page: a completion rewrites its row, and with room
# beside it the new version stays on the page and skips the index (a HOT update).
_V1 = [
    """CREATE TABLE render_schedule (
        key text PRIMARY KEY COLLATE "C" CHECK (key <> ''),
        route text NOT NULL,
        cadence_s integer CHECK (cadence_s IS NULL OR cadence_s > 0),
        sitemap boolean NOT NULL,
        next_render_at bigint NOT NULL,
        last_rendered_at bigint,
        last_outcome text,
        version bigint NOT NULL
    ) WITH (fillfactor = 85)""",
    # Versions only grow, across a delete and re-insert of the same key too.
    "CREATE SEQUENCE render_schedule_version AS bigint",
    """CREATE TABLE routes (
        route text PRIMARY KEY COLLATE "C",
        default_cadence_s integer CHECK (default_cadence_s IS NULL OR default_cadence_s > 0),
        paused boolean NOT NULL DEFAULT false
    )""",
    """CREATE TABLE settings (
        name text PRIMARY KEY COLLATE "C",
        value bigint NOT NULL
    )""",
    """CREATE TABLE change_log (
        xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
        seq bigint GENERATED ALWAYS AS IDENTITY,
        kind smallint NOT NULL,
        key text NOT NULL,
        PRIMARY KEY (xid, seq)
    )""",
    # One row per registered consumer: pruning never passes the lowest live cursor here.
    """CREATE TABLE feed_consumers (
        consumer text PRIMARY KEY,
        xid xid8 NOT NULL,
        seq bigint NOT NULL,
        saved_at timestamptz NOT NULL DEFAULT now()
    )""",
    # floor: every entry at or above (floor_xid, floor_seq) is present.
    """CREATE TABLE feed_state (
        id integer PRIMARY KEY CHECK (id = 1),
        origin text NOT NULL,
        floor_xid xid8 NOT NULL,
        floor_seq bigint NOT NULL,
        resyncs bigint NOT NULL DEFAULT 0
    )""",
    """INSERT INTO feed_state (id, origin, floor_xid, floor_seq)
    VALUES (1, '', '0'::xid8, 0)""",
    *_logged("render_schedule", "INSERT", KIND_ROW, "key", "changed"),
    *_logged("render_schedule", "UPDATE", KIND_ROW, "key", "changed"),
    *_logged("render_schedule", "DELETE", KIND_ROW, "key", "changed"),
    *_logged("routes", "INSERT", KIND_ROUTE, "route", "changed"),
    *_logged("routes", "UPDATE", KIND_ROUTE, "route", "changed"),
    *_logged("routes", "DELETE", KIND_ROUTE, "route", "changed"),
    *_logged("settings", "INSERT", KIND_SETTINGS, "name", "changed"),
    *_logged("settings", "UPDATE", KIND_SETTINGS, "name", "changed"),
]

# The cluster's members (store.postgres.membership). Liveness is judged by the database's
# clock: a node is live while its heartbeat is younger than the TTL, and a node that
# stopped cleanly has `left_at` set. `lease_horizon_ms` is when the last lease the node
# has granted ends (its clock), for the nodes that take over its keys.
_V2 = [
    """CREATE TABLE nodes (
        node text PRIMARY KEY,
        url text NOT NULL,
        instance text NOT NULL,
        started_at timestamptz NOT NULL DEFAULT now(),
        heartbeat_at timestamptz NOT NULL DEFAULT now(),
        left_at timestamptz,
        lease_horizon_ms bigint NOT NULL DEFAULT 0,
        max_lease_ms bigint NOT NULL DEFAULT 0
    )""",
]

# The key hashes' secret (store/secret.py): one row, written with the table, so every
# node of the cluster reads the same one.
_V3 = [
    """CREATE TABLE hash_secret (
        id integer PRIMARY KEY CHECK (id = 1),
        secret bytea NOT NULL
    )""",
]


def _seed_secret(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    conn.execute("INSERT INTO hash_secret (id, secret) VALUES (1, %s)", (new_secret(),))


# Every start of a node is a new incarnation, numbered from a sequence so a number is
# never reused: a paused process that wakes up under an old number is told apart from
# the one that replaced it. `acked_view` holds the incarnations of the live nodes whose
# view the node has adopted and enforced (it grants and renews no key it lost in that
# view); `lease_handover` holds its live leases on the keys it does not own in that
# view, in the database's clock, so the new owners fence exactly those keys. The
# cluster's timing settings and identity live once, in `cluster_settings`.
_V4 = [
    "CREATE SEQUENCE node_incarnation AS bigint",
    """ALTER TABLE nodes
        ADD COLUMN incarnation bigint NOT NULL DEFAULT 0,
        ADD COLUMN host text NOT NULL DEFAULT '',
        ADD COLUMN pid integer NOT NULL DEFAULT 0,
        ADD COLUMN acked_view bigint[] NOT NULL DEFAULT '{}',
        ADD COLUMN acked_at timestamptz""",
    """CREATE TABLE lease_handover (
        node text NOT NULL,
        incarnation bigint NOT NULL,
        key_hash bigint NOT NULL,
        expires_at_ms bigint NOT NULL
    )""",
    "CREATE INDEX lease_handover_node ON lease_handover (node, incarnation)",
    """CREATE TABLE cluster_settings (
        id integer PRIMARY KEY CHECK (id = 1),
        ttl_ms bigint NOT NULL,
        heartbeat_ms bigint NOT NULL,
        max_lease_ms bigint NOT NULL,
        secret_fingerprint bigint NOT NULL,
        protocol integer NOT NULL,
        set_by text NOT NULL,
        set_at timestamptz NOT NULL DEFAULT now()
    )""",
]

# Sites' own politeness settings (shm/sites.py); a site with neither set has no row. The
# cluster's site defaults and failure policy are stored with its other settings, as one
# value every node must match (store.postgres.membership).
_V5 = [
    """CREATE TABLE site_settings (
        site text PRIMARY KEY COLLATE "C" CHECK (site <> ''),
        max_in_flight integer CHECK (max_in_flight IS NULL OR max_in_flight >= 0),
        min_interval_ms integer CHECK (min_interval_ms IS NULL OR min_interval_ms >= 0),
        CHECK (max_in_flight IS NOT NULL OR min_interval_ms IS NOT NULL)
    )""",
    *_logged("site_settings", "INSERT", KIND_SITE, "site", "changed"),
    *_logged("site_settings", "UPDATE", KIND_SITE, "site", "changed"),
    *_logged("site_settings", "DELETE", KIND_SITE, "site", "changed"),
    "ALTER TABLE cluster_settings ADD COLUMN site_policy text NOT NULL DEFAULT ''",
]

# What divides the cluster's keys (the `ownership` setting: "key" or "site"), stored with
# its other settings; and each handed-over lease's site, so a node that gains a site
# whole counts the leases it was handed against the site's cap until they end.
_V6 = [
    """ALTER TABLE cluster_settings ADD COLUMN ownership text NOT NULL DEFAULT 'key'
        CHECK (ownership IN ('key', 'site'))""",
    "ALTER TABLE lease_handover ADD COLUMN site_hash bigint NOT NULL DEFAULT 0",
]

# Adaptive cadence (store.cadence): a row's learned cadence and recent history, and a
# route's adaptation (all four set, or none). A constant default adds no row rewrite.
_V7 = [
    """ALTER TABLE render_schedule
        ADD COLUMN learned_cadence_s integer
            CHECK (learned_cadence_s IS NULL OR learned_cadence_s > 0),
        ADD COLUMN change_history integer NOT NULL DEFAULT 0""",
    """ALTER TABLE routes
        ADD COLUMN adapt_min_s integer,
        ADD COLUMN adapt_max_s integer,
        ADD COLUMN adapt_inc double precision,
        ADD COLUMN adapt_dec double precision""",
]

# A route's site pattern (shm.keys.site_pattern checks it; None: each key's own host).
_V8 = ["ALTER TABLE routes ADD COLUMN site_pattern text"]

# A site's block handed over with the site (ownership by site): a row with no key (key
# hash 0, which no key has) whose block_reason is set, until expires_at_ms.
_V9 = [
    """ALTER TABLE lease_handover ADD COLUMN block_reason text
        CHECK (block_reason IN ('retry_after', 'failures'))""",
]

# Rows that retire: a streak of `not_found` outcomes, and once it reaches the route's
# `retire_after`, when and why the row retired (kept, never due). The partial index lists
# the retired rows by key without reading the others.
_V10 = [
    """ALTER TABLE render_schedule
        ADD COLUMN not_found_streak integer NOT NULL DEFAULT 0,
        ADD COLUMN retired_at bigint,
        ADD COLUMN retired_reason text""",
    f"""ALTER TABLE routes ADD COLUMN retire_after integer NOT NULL
        DEFAULT {DEFAULT_RETIRE_AFTER}
        CHECK (retire_after BETWEEN 1 AND {MAX_RETIRE_AFTER})""",
    "CREATE INDEX render_schedule_retired ON render_schedule (key) WHERE retired_at IS NOT NULL",
]

# A handed-over lease's token (shm.leases; 0 where it was not known), so a completion of
# it can land after its node left, and what became of it: `completed` there (the new
# owners still fence it until it ends), or `taken_back` by the node's next start, which
# restored it into its own lease table and alone completes it from then on.
_V11 = [
    """ALTER TABLE lease_handover
        ADD COLUMN token bigint NOT NULL DEFAULT 0,
        ADD COLUMN settled text CHECK (settled IN ('completed', 'taken_back'))""",
]

# Rows looked up by key alone: a completion's UPDATE reads each of its keys, and the feed's
# poll each entry's row. Keys are URLs, long and sharing their prefixes, so the primary
# key's B-tree is several times the size of a hash index of them, and once the table is
# larger than the server's buffers each lookup through it reads pages the hash index
# keeps cached. The primary key stays for uniqueness, an upsert's conflict and the walks'
# key order. Built in the migration's transaction, where writes wait for it; an operator
# may build it beforehand, concurrently, and the migration then finds it.
_V12 = ["CREATE INDEX IF NOT EXISTS render_schedule_key_lookup ON render_schedule USING hash (key)"]

# Index i holds the statements that take a database from version i to i + 1.
MIGRATIONS: list[list[str]] = [_V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8, _V9, _V10, _V11, _V12]
LATEST = len(MIGRATIONS)


def schema_version(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    """The database's schema version; 0 when renderqueue has never written to it."""
    found = conn.execute(
        "SELECT to_regclass('schema_version') IS NOT NULL,"
        " to_regclass('render_schedule') IS NOT NULL"
    ).fetchone()
    assert found is not None
    has_version, has_schedule = found
    if not has_version:
        if has_schedule:
            raise StoreError(
                "the database has a render_schedule table but no schema_version table: "
                "it was not made by renderqueue; use another database"
            )
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return int(row[0] or 0) if row is not None else 0  # type: ignore[call-overload]


_RECORD = "INSERT INTO schema_version (version) VALUES (%s)"
STEPS = schema.Steps(MIGRATIONS, schema_version, _RECORD, {3: _seed_secret})


@contextmanager
def _advisory_lock(conn: psycopg.Connection[tuple[object, ...]]) -> Iterator[None]:
    """One node's migration at a time, and its transaction, begun once the lock is held.
    (Begun before, it would keep the catalog as it was: taking an advisory lock reads no
    invalidations, so the table another node just created would still look absent, and
    CREATE TABLE would fail.)"""
    conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK,))
    try:
        with conn.transaction():
            yield
    finally:
        if not conn.closed:
            conn.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK,))


def migrate(conn: psycopg.Connection[tuple[object, ...]], where: str) -> int:
    """Bring the database to LATEST in one transaction; returns the version found before.

    The connection must be in autocommit mode. Idempotent, and safe with many nodes
    starting at once: they migrate in turn (`_advisory_lock`).
    """
    return schema.migrate(conn, STEPS, _advisory_lock, where)
