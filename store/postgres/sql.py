"""The statements PostgresStore runs.

Every batch is one statement over arrays (`unnest`), so a write is one round trip and,
in autocommit, one transaction: all or nothing. The arrays travel in binary (`%b`):
psycopg's text form quotes each element after a regular-expression test, which on a
hundred-key batch cost the worker more than the database spent on the statement.
Reads that must agree with the feed's position return their snapshot's xmin and xmax
beside the rows, from the same statement (`HORIZON`); xid8 values travel as text and
become Python ints here.
"""

from __future__ import annotations

from store.rows import DEFAULT_RETIRE_AFTER, LEARNING_COLUMNS, ROUTE_COLUMNS, ROW_COLUMNS
from store.schema import (
    DEFAULT_CADENCE_S,
    DEFAULT_CADENCE_SETTING,
    KIND_ROUTE,
    KIND_SETTINGS,
    KIND_SITE,
)

_R_COLUMNS = ", ".join(f"r.{c}" for c in ROW_COLUMNS.split(", "))

# The statement's own snapshot: every transaction below xmin has finished, and every one
# this statement sees committed is below xmax.
HORIZON = """
SELECT pg_snapshot_xmin(s)::text::bigint AS xmin, pg_snapshot_xmax(s)::text::bigint AS xmax
FROM pg_current_snapshot() AS s
"""

# Rows are locked in key order, so two batches sharing keys cannot deadlock.
_UPSERT = """
INSERT INTO render_schedule AS r (key, route, cadence_s, sitemap, next_render_at, version)
SELECT k, rt, c, s, n, nextval('render_schedule_version')
FROM unnest(%(keys)b::text[], %(routes)b::text[], %(cadences)b::integer[],
            %(sitemaps)b::boolean[], %(nexts)b::bigint[]) AS t(k, rt, c, s, n)
ORDER BY k
ON CONFLICT (key) DO UPDATE SET
    route = excluded.route,
    cadence_s = excluded.cadence_s,
    sitemap = excluded.sitemap,
    next_render_at = excluded.next_render_at,
    version = excluded.version,
    learned_cadence_s = CASE WHEN r.route = excluded.route THEN r.learned_cadence_s END,
    not_found_streak = 0,
    retired_at = NULL,
    retired_reason = NULL
"""
_DELETE = "DELETE FROM render_schedule WHERE key = ANY(%(deletes)b::text[])"

# Each write answers its transaction's xid: its feed position (shm.marks).
XID = "pg_current_xact_id()::text::bigint"
UPSERT = f"WITH up AS ({_UPSERT} RETURNING 1) SELECT {XID}"
DELETE = f"WITH gone AS ({_DELETE} RETURNING 1) SELECT {XID}"
UPSERT_AND_DELETE = (
    f"WITH gone AS ({_DELETE} RETURNING 1), up AS ({_UPSERT} RETURNING 1) SELECT {XID}"
)

GET = f"SELECT {ROW_COLUMNS} FROM render_schedule WHERE key = %s"
GET_MANY = f"SELECT {ROW_COLUMNS} FROM render_schedule WHERE key = ANY(%b::text[])"

GET_MANY_AT = f"""
WITH h AS ({HORIZON})
SELECT h.xmin, h.xmax, {_R_COLUMNS}
FROM h LEFT JOIN render_schedule AS r ON r.key = ANY(%b::text[])
"""


def key_list(keys: list[str]) -> list[str]:
    """GET_MANY's parameter: the keys as an array, in binary."""
    return keys


WALK_FIRST = f"SELECT {ROW_COLUMNS} FROM render_schedule ORDER BY key LIMIT %s"
WALK_AFTER = f"SELECT {ROW_COLUMNS} FROM render_schedule WHERE key > %s ORDER BY key LIMIT %s"
# Retired rows by key, from the partial index on them.
RETIRED = f"""
SELECT {ROW_COLUMNS} FROM render_schedule
WHERE retired_at IS NOT NULL AND key > %s ORDER BY key LIMIT %s
"""
_WALK_AT = """
WITH h AS ({horizon})
SELECT h.xmin, h.xmax, {columns}
FROM h LEFT JOIN LATERAL (
    SELECT * FROM render_schedule {where} ORDER BY key LIMIT %s
) AS r ON true
ORDER BY r.key
"""
WALK_AT_FIRST = _WALK_AT.format(horizon=HORIZON, columns=_R_COLUMNS, where="")
WALK_AT_AFTER = _WALK_AT.format(horizon=HORIZON, columns=_R_COLUMNS, where="WHERE key > %s::text")

GLOBAL_CADENCE = (
    f"coalesce((SELECT value FROM settings WHERE name = '{DEFAULT_CADENCE_SETTING}'), "
    f"{DEFAULT_CADENCE_S})"
)

# Any outcome but not_found ends a row's streak of them, and revives it if retired.
_STREAK_ENDS = "not_found_streak = 0, retired_at = NULL, retired_reason = NULL"
_CADENCE_MS = f"""1000::bigint * coalesce(
    r.learned_cadence_s,
    r.cadence_s,
    (SELECT default_cadence_s FROM routes WHERE routes.route = r.route),
    {GLOBAL_CADENCE})"""
# A not_found outcome's streak reaches its route's retire_after (SET reads the old row).
_RETIRES = f"""r.not_found_streak + 1 >= coalesce(
    (SELECT retire_after FROM routes WHERE routes.route = r.route), {DEFAULT_RETIRE_AFTER})"""

# One round of completions (no key twice) in one statement: each outcome's change is a
# data-modifying CTE over the round's items (`c`, in key order, so two rounds sharing
# keys lock them in one order). A failure keeps the row due; a not_found reschedules it a
# cadence on, with no render's time, and retires it at the end of its streak. The last
# row, keyed NULL, carries the transaction's xid in the version column.
_COMPLETE_ITEMS = """
    SELECT * FROM unnest(%(keys)b::text[], %(outcomes)b::text[], %(nows)b::bigint[],
                         %(nexts)b::bigint[], %(observed)b::boolean[], %(learned)b::integer[],
                         %(histories)b::integer[])
        AS c(key, outcome, now, next_at, observed, learned, history)
"""
# The usual round, every item rendered at one time with nothing observed: the keys travel
# as the only array (psycopg builds each array element by element in Python), and no CTE
# runs for an outcome the round does not have.
_COMPLETE_RENDERED_ITEMS = """
    SELECT key, 'rendered'::text AS outcome, %(now)s::bigint AS now,
           %(next_at)s::bigint AS next_at, false AS observed, NULL::integer AS learned,
           NULL::integer AS history
    FROM unnest(%(keys)b::text[]) AS c(key)
"""
_RENDERED = f"""
rendered AS (
    UPDATE render_schedule AS r SET
        last_rendered_at = c.now,
        learned_cadence_s = CASE WHEN c.observed THEN c.learned ELSE r.learned_cadence_s END,
        change_history = CASE WHEN c.observed THEN c.history ELSE r.change_history END,
        next_render_at = coalesce(c.next_at, c.now + 1000::bigint * coalesce(
            CASE WHEN c.observed THEN c.learned ELSE r.learned_cadence_s END,
            r.cadence_s,
            (SELECT default_cadence_s FROM routes WHERE routes.route = r.route),
            {GLOBAL_CADENCE})),
        last_outcome = 'rendered',
        {_STREAK_ENDS},
        version = nextval('render_schedule_version')
    FROM c WHERE c.key = r.key AND c.outcome = 'rendered'
    RETURNING {_R_COLUMNS}
)"""
_OTHER_OUTCOMES = f"""
failed AS (
    UPDATE render_schedule AS r SET
        last_outcome = 'failed',
        {_STREAK_ENDS},
        version = nextval('render_schedule_version')
    FROM c WHERE c.key = r.key AND c.outcome = 'failed'
    RETURNING {_R_COLUMNS}
),
not_found AS (
    UPDATE render_schedule AS r SET
        next_render_at = coalesce(c.next_at, c.now + {_CADENCE_MS}),
        last_outcome = 'not_found',
        not_found_streak = r.not_found_streak + 1,
        retired_at = CASE WHEN {_RETIRES} THEN coalesce(r.retired_at, c.now) ELSE NULL END,
        retired_reason = CASE WHEN {_RETIRES} THEN 'not_found' ELSE NULL END,
        version = nextval('render_schedule_version')
    FROM c WHERE c.key = r.key AND c.outcome = 'not_found'
    RETURNING {_R_COLUMNS}
),
gone AS (
    DELETE FROM render_schedule AS r USING c WHERE c.key = r.key AND c.outcome = 'gone'
    RETURNING r.key
)"""
_XID_ROW = f"""
SELECT NULL::text, NULL::text, NULL::integer, NULL::boolean, NULL::bigint, NULL::bigint,
    NULL::text, {XID}, NULL::integer, NULL::integer, NULL::integer, NULL::bigint, NULL::text
"""
COMPLETE = f"""
WITH c AS ({_COMPLETE_ITEMS} ORDER BY key), {_RENDERED}, {_OTHER_OUTCOMES}
SELECT * FROM rendered UNION ALL SELECT * FROM failed UNION ALL SELECT * FROM not_found
UNION ALL {_XID_ROW}"""
COMPLETE_RENDERED = f"""
WITH c AS ({_COMPLETE_RENDERED_ITEMS} ORDER BY key), {_RENDERED}
SELECT * FROM rendered UNION ALL {_XID_ROW}"""

# What store.cadence needs of each observed key's row and route, the rows locked in key
# order (as COMPLETE locks them) until the round's COMPLETE writes what it decided.
LEARNING = f"""
SELECT {LEARNING_COLUMNS}
FROM render_schedule AS r LEFT JOIN routes AS rt ON rt.route = r.route
WHERE r.key = ANY(%b::text[])
ORDER BY r.key
FOR UPDATE OF r
"""

COUNT = "SELECT count(*) FROM render_schedule"

ROUTES = f"SELECT {ROUTE_COLUMNS} FROM routes ORDER BY route"
# The route as it was, locked until the change commits: two changes of its ladder cannot
# cross between the read and FORGET_LEARNED.
ROUTE_FOR_UPDATE = f"SELECT {ROUTE_COLUMNS} FROM routes WHERE route = %s FOR UPDATE"

SET_ROUTE = f"""
INSERT INTO routes AS r (route, default_cadence_s, paused, adapt_min_s, adapt_max_s,
                         adapt_inc, adapt_dec, site_pattern, retire_after)
VALUES (%(route)s, %(cadence)s, coalesce(%(paused)s, false), %(min_s)s, %(max_s)s, %(inc)s,
        %(dec)s, %(site_pattern)s, coalesce(%(retire_after)s::integer, {DEFAULT_RETIRE_AFTER}))
ON CONFLICT (route) DO UPDATE SET
    default_cadence_s = CASE WHEN %(set_cadence)s THEN %(cadence)s ELSE r.default_cadence_s END,
    paused = coalesce(%(paused)s, r.paused),
    adapt_min_s = CASE WHEN %(set_adapt)s THEN %(min_s)s ELSE r.adapt_min_s END,
    adapt_max_s = CASE WHEN %(set_adapt)s THEN %(max_s)s ELSE r.adapt_max_s END,
    adapt_inc = CASE WHEN %(set_adapt)s THEN %(inc)s ELSE r.adapt_inc END,
    adapt_dec = CASE WHEN %(set_adapt)s THEN %(dec)s ELSE r.adapt_dec END,
    site_pattern = CASE WHEN %(set_site_pattern)s THEN %(site_pattern)s ELSE r.site_pattern END,
    retire_after = coalesce(%(retire_after)s::integer, r.retire_after)
RETURNING {ROUTE_COLUMNS}
"""

# A route's ladder moved or went: its rows' learned cadences were rungs of the old one.
FORGET_LEARNED = """
UPDATE render_schedule SET learned_cadence_s = NULL,
    version = nextval('render_schedule_version')
WHERE route = %s AND learned_cadence_s IS NOT NULL
"""

SITES = "SELECT site, max_in_flight, min_interval_ms FROM site_settings ORDER BY site"
SITE = "SELECT site, max_in_flight, min_interval_ms FROM site_settings WHERE site = %s"
SET_SITE = """
INSERT INTO site_settings (site, max_in_flight, min_interval_ms)
VALUES (%(site)s, %(max_in_flight)s, %(min_interval_ms)s)
ON CONFLICT (site) DO UPDATE SET
    max_in_flight = excluded.max_in_flight, min_interval_ms = excluded.min_interval_ms
"""
DELETE_SITE = "DELETE FROM site_settings WHERE site = %s"

GET_DEFAULT_CADENCE = f"SELECT {GLOBAL_CADENCE}"
GET_HASH_SECRET = "SELECT secret FROM hash_secret WHERE id = 1"

SET_DEFAULT_CADENCE = f"""
INSERT INTO settings (name, value) VALUES ('{DEFAULT_CADENCE_SETTING}', %s)
ON CONFLICT (name) DO UPDATE SET value = excluded.value
"""

# The feed's position after every finished transaction: entries from xmin on may still
# come (a transaction running now commits later), so a cursor starts at (xmin, 0).
HEAD = HORIZON

# One statement is one snapshot: the entries below its xmin after the cursor, each row
# entry with its row's current state, the floor, and whether committed entries wait at
# or past xmin (held back by a transaction still running). Each entry's row is a lookup
# by key of its own (LATERAL, LIMIT 1 so the planner cannot turn it into a join that
# reads the whole table; through the keys' hash index, schema._V12), and `pending` is
# read once, from the log index's last entry, in the materialized horizon: the cost of a
# poll follows its entries, not the table.
# POLL's columns: the poll's own (horizon, floor, pending), then per entry its xid and a
# store.rows.LogRecord (seq, kind, key, a stamp the SQLite ring has and this log has not,
# the row's columns after its key, the sitemap flag as the integer SQLite stores), so a
# row entry's record is one slice.
POLL_XID = 5
POLL_KIND = 7
POLL_KEY = 8
POLL_RECORD = slice(6, 22)
# What a route, settings or site entry names is read by POLL_DETAILS, after the poll and
# only when it delivered such an entry (rare: an operator's change), and appended to the
# entry: the route's columns after its name, the setting's value, and the site's (found,
# max_in_flight, min_interval_ms). A lateral join for each of them in POLL would be
# rescanned for every row entry, which it never matches. A later read is as exact as one
# in the poll's snapshot: each entry is delivered with its target's state when read, and
# any change after that has an entry still to come.
_ROUTE_AFTER_NAME = ROUTE_COLUMNS.split(", ")[1:]
_NO_ROUTE = ", ".join("NULL" for _ in _ROUTE_AFTER_NAME)  # typed by the routes branch
POLL_ROUTE = slice(POLL_RECORD.stop, POLL_RECORD.stop + len(_ROUTE_AFTER_NAME))
POLL_SETTING = POLL_ROUTE.stop
POLL_SITE = slice(POLL_SETTING + 1, POLL_SETTING + 4)
# What is appended for a target not found: a route or setting that is gone (paused, NOT
# NULL, reads None), a site with no settings of its own (found False).
POLL_DETAILS_MISSING = (None,) * (POLL_SITE.start - POLL_ROUTE.start) + (False, None, None)
POLL_DETAILS = f"""
SELECT {KIND_ROUTE}, {ROUTE_COLUMNS}, NULL::bigint, NULL::boolean, NULL::integer, NULL::integer
FROM routes WHERE route = ANY(%(routes)s::text[])
UNION ALL
SELECT {KIND_SETTINGS}, name, {_NO_ROUTE}, value, NULL, NULL, NULL
FROM settings WHERE name = ANY(%(settings)s::text[])
UNION ALL
SELECT {KIND_SITE}, site, {_NO_ROUTE}, NULL, true, max_in_flight, min_interval_ms
FROM site_settings WHERE site = ANY(%(sites)s::text[])
"""
POLL = """
WITH h AS MATERIALIZED (
    SELECT pg_snapshot_xmin(s) AS xmin, pg_snapshot_xmax(s) AS xmax,
           coalesce((SELECT xid FROM change_log ORDER BY xid DESC LIMIT 1)
                    >= pg_snapshot_xmin(s), false)
               AS pending
    FROM pg_current_snapshot() AS s
)
SELECT h.xmin::text::bigint, h.xmax::text::bigint,
       f.floor_xid::text::bigint, f.floor_seq,
       h.pending,
       l.xid::text::bigint,
       l.seq, l.kind, l.key, 0,
       r.route, r.cadence_s, r.sitemap::int, r.next_render_at, r.last_rendered_at,
       r.last_outcome, r.version, r.learned_cadence_s, r.change_history,
       r.not_found_streak, r.retired_at, r.retired_reason
FROM h CROSS JOIN feed_state AS f
LEFT JOIN LATERAL (
    SELECT * FROM change_log
    WHERE (xid, seq) > (%(xid)s::text::xid8, %(seq)s) AND xid < h.xmin
    ORDER BY xid, seq LIMIT %(limit)s
) AS l ON true
LEFT JOIN LATERAL (
    SELECT * FROM render_schedule WHERE l.kind = 0 AND key = l.key LIMIT 1
) AS r ON true
WHERE f.id = 1
ORDER BY l.xid, l.seq
"""

FLOOR = "SELECT floor_xid::text::bigint, floor_seq, origin, resyncs FROM feed_state WHERE id = 1"

# Pruning, a chunk at a time: the chunk's last entry read from the log's index, then the
# range up to it deleted by the same index. Not `DELETE ... WHERE (xid, seq) IN (SELECT
# ... LIMIT n)`: PostgreSQL plans that as a hash join over a scan of the whole log, so
# each chunk read every entry and a round cost the square of the log's length.
# Parameters: after (xid, seq), floor (xid, seq), and the chunk's size less one (OFFSET).
# (The output's names are not the columns': `ORDER BY xid` must name the indexed column,
# not the converted output, or the log is sorted whole.)
PRUNE_CHUNK_END = """
SELECT xid::text::bigint AS end_xid, seq AS end_seq FROM change_log
WHERE (xid, seq) > (%s::text::xid8, %s) AND (xid, seq) < (%s::text::xid8, %s)
ORDER BY xid, seq OFFSET %s LIMIT 1
"""
# after (xid, seq), the chunk's last entry (xid, seq): both ends' entries known to exist.
PRUNE_THROUGH = """
DELETE FROM change_log
WHERE (xid, seq) > (%s::text::xid8, %s) AND (xid, seq) <= (%s::text::xid8, %s)
"""
# after (xid, seq), floor (xid, seq): the last chunk, shorter than the rest.
PRUNE_BELOW = """
DELETE FROM change_log
WHERE (xid, seq) > (%s::text::xid8, %s) AND (xid, seq) < (%s::text::xid8, %s)
"""

CONSUMER = "SELECT xid::text::bigint, seq FROM feed_consumers WHERE consumer = %s"
SAVE_CONSUMER = """
INSERT INTO feed_consumers (consumer, xid, seq, saved_at)
VALUES (%s, %s::text::xid8, %s, now())
ON CONFLICT (consumer) DO UPDATE SET xid = excluded.xid, seq = excluded.seq, saved_at = now()
"""
CONSUMERS = "SELECT consumer, xid::text::bigint, seq FROM feed_consumers"
DROP_CONSUMER = "DELETE FROM feed_consumers WHERE consumer = %s RETURNING consumer"

# Who holds the feed back: the backend whose transaction is the snapshot's xmin.
HOLDER = """
SELECT pid FROM pg_stat_activity
WHERE backend_xid IS NOT NULL
  AND backend_xid::text::bigint = %s::bigint %% 4294967296
LIMIT 1
"""
