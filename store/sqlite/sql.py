"""The statements SqliteStore runs."""

from __future__ import annotations

import msgspec

from store.rows import DEFAULT_RETIRE_AFTER, LEARNING_COLUMNS, ROUTE_COLUMNS, ROW_COLUMNS
from store.schema import DEFAULT_CADENCE_S, DEFAULT_CADENCE_SETTING
from store.sqlite.schema import NEXT_SEQ

UPSERT = f"""
INSERT INTO render_schedule (key, route, cadence_s, sitemap, next_render_at, version)
VALUES (?, ?, ?, ?, ?, {NEXT_SEQ})
ON CONFLICT (key) DO UPDATE SET
    route = excluded.route,
    cadence_s = excluded.cadence_s,
    sitemap = excluded.sitemap,
    next_render_at = excluded.next_render_at,
    version = excluded.version,
    learned_cadence_s = CASE WHEN render_schedule.route = excluded.route
        THEN render_schedule.learned_cadence_s END,
    not_found_streak = 0,
    retired_at = NULL,
    retired_reason = NULL
"""

DELETE = "DELETE FROM render_schedule WHERE key = ?"

GET = f"SELECT {ROW_COLUMNS} FROM render_schedule WHERE key = ?"

# Driven by the key list (CROSS JOIN keeps that order), one primary-key seek per key;
# `key IN (SELECT value FROM json_each(?))` would first build and sort an ephemeral index
# of the list, a cost per key the driven join does not pay.
# The list must name each key once (SqliteStore dedupes it): a repeat would repeat a row.
GET_MANY = f"""
SELECT {", ".join(f"r.{c}" for c in ROW_COLUMNS.split(", "))}
FROM json_each(?) AS j CROSS JOIN render_schedule AS r ON r.key = j.value
"""

WALK_FIRST = f"SELECT {ROW_COLUMNS} FROM render_schedule ORDER BY key LIMIT ?"
WALK_AFTER = f"SELECT {ROW_COLUMNS} FROM render_schedule WHERE key > ? ORDER BY key LIMIT ?"
# A read transaction is one snapshot: the plain reads, followed by the feed's head.
GET_MANY_AT = GET_MANY
WALK_AT_FIRST = WALK_FIRST
WALK_AT_AFTER = WALK_AFTER


def key_list(keys: list[str]) -> str:
    """GET_MANY's parameter: the keys as a JSON array."""
    return msgspec.json.encode(keys).decode()


# Retired rows by key, from the partial index on them.
RETIRED = f"""
SELECT {ROW_COLUMNS} FROM render_schedule
WHERE retired_at IS NOT NULL AND key > ? ORDER BY key LIMIT ?
"""

GLOBAL_CADENCE = (
    f"coalesce((SELECT value FROM settings WHERE name = '{DEFAULT_CADENCE_SETTING}'), "
    f"{DEFAULT_CADENCE_S})"
)

# complete() applies each round of a batch (no key twice) with one statement per outcome,
# the round's keys given as a JSON array. `key IN (SELECT value FROM json_each(:keys))`
# sorts the keys into an ephemeral index and updates the rows in key order: on a large
# table that is cheaper per key than a join driven by the list (UPDATE ... FROM), which
# meets the rows in the list's order.

# NEXT_SEQ is read once per statement; this one names the updated row, so SQLite reads it
# again for each row, after the previous row's trigger logged its entry: each row's
# version is the seq of its own log entry, as with one statement per row.
_NEXT_SEQ_PER_ROW = (
    "(SELECT coalesce(max(seq), 0) + 1 + 0 * render_schedule.version FROM change_log)"
)

_CADENCE_MS = f"""1000 * coalesce(
    render_schedule.learned_cadence_s,
    render_schedule.cadence_s,
    (SELECT default_cadence_s FROM routes WHERE routes.route = render_schedule.route),
    {GLOBAL_CADENCE})"""

# Any outcome but not_found ends a row's streak of them, and revives it if retired.
_STREAK_ENDS = "not_found_streak = 0, retired_at = NULL, retired_reason = NULL"

# The usual round: every rendered key completed at one `now`, with one `next_render_at`
# (mostly None: now + the row's effective cadence).
COMPLETE_RENDERED = f"""
UPDATE render_schedule SET
    last_rendered_at = :now,
    next_render_at = coalesce(:next_render_at, :now + {_CADENCE_MS}),
    last_outcome = 'rendered',
    {_STREAK_ENDS},
    version = {_NEXT_SEQ_PER_ROW}
WHERE key IN (SELECT value FROM json_each(:keys))
RETURNING {ROW_COLUMNS}
"""

# Any other round: each key's [key, now, next_render_at], joined to its row.
COMPLETE_RENDERED_EACH = f"""
UPDATE render_schedule SET
    last_rendered_at = c.now,
    next_render_at = coalesce(c.next_render_at, c.now + {_CADENCE_MS}),
    last_outcome = 'rendered',
    {_STREAK_ENDS},
    version = {_NEXT_SEQ_PER_ROW}
FROM (
    SELECT json_extract(value, '$[0]') AS key, json_extract(value, '$[1]') AS now,
           json_extract(value, '$[2]') AS next_render_at
    FROM json_each(:items)
) AS c
WHERE render_schedule.key = c.key
RETURNING {", ".join(f"render_schedule.{c}" for c in ROW_COLUMNS.split(", "))}
"""

# Rendered keys whose completions said whether the page changed: each key's [key, now,
# next_render_at, learned cadence, history], as store.cadence decided from LEARNING's read
# in the same transaction.
COMPLETE_OBSERVED = f"""
UPDATE render_schedule SET
    last_rendered_at = c.now,
    next_render_at = coalesce(c.next_render_at, c.now + 1000 * coalesce(
        c.learned,
        render_schedule.cadence_s,
        (SELECT default_cadence_s FROM routes WHERE routes.route = render_schedule.route),
        {GLOBAL_CADENCE})),
    learned_cadence_s = c.learned,
    change_history = c.history,
    last_outcome = 'rendered',
    {_STREAK_ENDS},
    version = {_NEXT_SEQ_PER_ROW}
FROM (
    SELECT json_extract(value, '$[0]') AS key, json_extract(value, '$[1]') AS now,
           json_extract(value, '$[2]') AS next_render_at, json_extract(value, '$[3]') AS learned,
           json_extract(value, '$[4]') AS history
    FROM json_each(:items)
) AS c
WHERE render_schedule.key = c.key
RETURNING {", ".join(f"render_schedule.{c}" for c in ROW_COLUMNS.split(", "))}
"""

# What store.cadence needs of each observed key's row and route, and the global default.
LEARNING = f"""
SELECT {LEARNING_COLUMNS}
FROM json_each(?) AS j CROSS JOIN render_schedule AS r ON r.key = j.value
LEFT JOIN routes AS rt ON rt.route = r.route
"""

# A failure keeps the row due: next_render_at and last_rendered_at stay as they were.
COMPLETE_FAILED = f"""
UPDATE render_schedule SET
    last_outcome = 'failed', {_STREAK_ENDS}, version = {_NEXT_SEQ_PER_ROW}
WHERE key IN (SELECT value FROM json_each(:keys))
RETURNING {ROW_COLUMNS}
"""

# The origin answered 404 or 410: rescheduled a cadence on (or at the item's
# next_render_at), with no render's time, and one more in the row's streak; the streak's
# retire_after'th (its route's, else the default) retires it. Each key's [key, now,
# next_render_at], as COMPLETE_RENDERED_EACH. SET reads the row as it was before.
_RETIRES = f"""render_schedule.not_found_streak + 1 >= coalesce(
    (SELECT retire_after FROM routes WHERE routes.route = render_schedule.route),
    {DEFAULT_RETIRE_AFTER})"""
COMPLETE_NOT_FOUND = f"""
UPDATE render_schedule SET
    next_render_at = coalesce(c.next_render_at, c.now + {_CADENCE_MS}),
    last_outcome = 'not_found',
    not_found_streak = render_schedule.not_found_streak + 1,
    retired_at = CASE WHEN {_RETIRES}
        THEN coalesce(render_schedule.retired_at, c.now) ELSE NULL END,
    retired_reason = CASE WHEN {_RETIRES} THEN 'not_found' ELSE NULL END,
    version = {_NEXT_SEQ_PER_ROW}
FROM (
    SELECT json_extract(value, '$[0]') AS key, json_extract(value, '$[1]') AS now,
           json_extract(value, '$[2]') AS next_render_at
    FROM json_each(:items)
) AS c
WHERE render_schedule.key = c.key
RETURNING {", ".join(f"render_schedule.{c}" for c in ROW_COLUMNS.split(", "))}
"""

COMPLETE_GONE = "DELETE FROM render_schedule WHERE key IN (SELECT value FROM json_each(:keys))"

ROUTES = f"SELECT {ROUTE_COLUMNS} FROM routes ORDER BY route"
ROUTES_NAMED = f"SELECT {ROUTE_COLUMNS} FROM routes WHERE route IN (SELECT value FROM json_each(?))"
# Inside a write transaction, which holds the database's one write lock until it ends.
ROUTE_FOR_UPDATE = f"SELECT {ROUTE_COLUMNS} FROM routes WHERE route = ?"

SET_ROUTE = f"""
INSERT INTO routes (route, default_cadence_s, paused, adapt_min_s, adapt_max_s, adapt_inc,
                    adapt_dec, site_pattern, retire_after)
VALUES (:route, :cadence, coalesce(:paused, 0), :min_s, :max_s, :inc, :dec, :site_pattern,
        coalesce(:retire_after, {DEFAULT_RETIRE_AFTER}))
ON CONFLICT (route) DO UPDATE SET
    default_cadence_s = CASE WHEN :set_cadence THEN :cadence ELSE default_cadence_s END,
    paused = coalesce(:paused, paused),
    adapt_min_s = CASE WHEN :set_adapt THEN :min_s ELSE adapt_min_s END,
    adapt_max_s = CASE WHEN :set_adapt THEN :max_s ELSE adapt_max_s END,
    adapt_inc = CASE WHEN :set_adapt THEN :inc ELSE adapt_inc END,
    adapt_dec = CASE WHEN :set_adapt THEN :dec ELSE adapt_dec END,
    site_pattern = CASE WHEN :set_site_pattern THEN :site_pattern ELSE site_pattern END,
    retire_after = coalesce(:retire_after, retire_after)
RETURNING {ROUTE_COLUMNS}
"""

# A route's ladder moved or went: its rows' learned cadences were rungs of the old one.
FORGET_LEARNED = (
    f"UPDATE render_schedule SET learned_cadence_s = NULL, version = {_NEXT_SEQ_PER_ROW} "
    "WHERE route = ? AND learned_cadence_s IS NOT NULL"
)

SITES = "SELECT site, max_in_flight, min_interval_ms FROM site_settings ORDER BY site"
SITE = "SELECT site, max_in_flight, min_interval_ms FROM site_settings WHERE site = ?"
SITES_NAMED = (
    "SELECT site, max_in_flight, min_interval_ms FROM site_settings "
    "WHERE site IN (SELECT value FROM json_each(?))"
)
SET_SITE = """
INSERT INTO site_settings (site, max_in_flight, min_interval_ms)
VALUES (:site, :max_in_flight, :min_interval_ms)
ON CONFLICT (site) DO UPDATE SET
    max_in_flight = excluded.max_in_flight, min_interval_ms = excluded.min_interval_ms
"""
DELETE_SITE = "DELETE FROM site_settings WHERE site = ?"

GET_DEFAULT_CADENCE = f"SELECT {GLOBAL_CADENCE}"
GET_HASH_SECRET = "SELECT secret FROM hash_secret WHERE id = 1"

SET_DEFAULT_CADENCE = f"""
INSERT INTO settings (name, value) VALUES ('{DEFAULT_CADENCE_SETTING}', ?)
ON CONFLICT (name) DO UPDATE SET value = excluded.value
"""

HEAD = "SELECT coalesce(max(seq), 0) FROM change_log"
LAST_ENTRY = "SELECT seq, stamp FROM change_log ORDER BY seq DESC LIMIT 1"
# The log's entries after a seq, without their rows: a writer that knows the rows its
# transaction left (complete) pairs them itself rather than joining again (POLL).
ENTRIES_AFTER = "SELECT seq, kind, key, stamp FROM change_log WHERE seq > ? ORDER BY seq LIMIT ?"
FLOOR = "SELECT floor FROM feed_state WHERE id = 1"
STAMP_AT = "SELECT stamp FROM change_log WHERE seq = ?"

# One statement reads the log after a cursor and each row it names, in one snapshot.
POLL = """
SELECT l.seq, l.kind, l.key, l.stamp,
       r.route, r.cadence_s, r.sitemap, r.next_render_at, r.last_rendered_at,
       r.last_outcome, r.version, r.learned_cadence_s, r.change_history,
       r.not_found_streak, r.retired_at, r.retired_reason
FROM change_log AS l
LEFT JOIN render_schedule AS r ON l.kind = 0 AND r.key = l.key
WHERE l.seq > ?
ORDER BY l.seq
LIMIT ?
"""

CONSUMER = "SELECT seq, stamp, wake FROM feed_consumers WHERE consumer = ?"
SAVE_CONSUMER = """
INSERT INTO feed_consumers (consumer, seq, stamp, wake, saved_at) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (consumer) DO UPDATE SET
    seq = excluded.seq, stamp = excluded.stamp, wake = excluded.wake, saved_at = excluded.saved_at
"""
WAKE_NAMES = "SELECT wake FROM feed_consumers"
