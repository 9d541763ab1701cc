"""Input checks at the store's boundary: a bad field is a ValueError naming the field and the row.

Every check runs before a transaction opens, so a batch with one bad row writes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from shm import keys
from store.cadence import Adaptation, check_adaptation
from store.rows import MAX_KEY_BYTES, MAX_RETIRE_AFTER, Completion, RowWrite, SiteSettings

ROUTE_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
OUTCOMES = frozenset(("rendered", "failed", "gone", "not_found"))
# Bounds that keep `now + 1000 * cadence` inside SQLite's 64-bit integers.
MAX_CADENCE_S = 2**31 - 1  # 68 years
MAX_TIME_MS = 2**62
MAX_CONSUMER_CHARS = 200
# A site is a host name as shm.keys.site_of gives it: lower-case, no port, path or space.
MAX_SITE_BYTES = 253
SITE_NAME = re.compile(r"[^\sA-Z/?#@]+")
MAX_SITE_IN_FLIGHT = 4096  # shm.sites.MAX_IN_FLIGHT: the most permits a site can have
MAX_SITE_INTERVAL_MS = 86_400_000  # a day
MAX_PAGE = 1000  # rows in one page of a listing (ScheduleStore.retired)


def _where(what: str, index: int | None, key: object) -> str:
    if index is None:
        return what
    shown = repr(key)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{what}[{index}] (key {shown})"


def check_key(key: object, *, what: str = "key", index: int | None = None) -> str:
    if (
        isinstance(key, str)
        and key
        and key.isascii()
        and len(key) <= MAX_KEY_BYTES
        and "\x00" not in key
    ):
        return key  # the common case, without building the error prefix
    where = _where(what, index, key)
    if not isinstance(key, str):
        raise ValueError(f"{where}: key must be a string, got {type(key).__name__}")
    if not key:
        raise ValueError(f"{where}: key is empty")
    if "\x00" in key:
        # No URL holds one, and PostgreSQL's text cannot: refused on every backend alike.
        raise ValueError(f"{where}: key holds a NUL character (\\x00)")
    if key.isascii():  # one byte a character: no encoding needed to know the size
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(
                f"{where}: key is {len(key)} UTF-8 bytes, over the {MAX_KEY_BYTES} limit"
            )
        return key
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: key is not valid UTF-8 ({exc.reason})") from None
    if size > MAX_KEY_BYTES:
        raise ValueError(f"{where}: key is {size} UTF-8 bytes, over the {MAX_KEY_BYTES} limit")
    return key


_known_routes: set[str] = set()  # names that passed: few, and checked on every row


def check_keys(keys: Sequence[str], *, what: str) -> list[str]:
    """A list of keys to read: each checked, each once (a backend that joins the list
    would return a repeated key's row twice)."""
    if isinstance(keys, str):
        raise ValueError(f"{what}: expected a sequence of keys, got one string")
    for index, key in enumerate(keys):
        check_key(key, what=what, index=index)
    return list(dict.fromkeys(keys))


def check_route_name(route: object, *, where: str = "route") -> str:
    if isinstance(route, str) and route in _known_routes:
        return route
    if not isinstance(route, str) or ROUTE_NAME.fullmatch(route) is None:
        raise ValueError(
            f"{where}: route name {route!r} must match {ROUTE_NAME.pattern} "
            "(lower-case letters, digits, '_', '.', '-'; at most 64)"
        )
    if len(_known_routes) < 10_000:
        _known_routes.add(route)
    return route


def check_cadence(value: object, *, where: str, optional: bool) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: must be a positive whole number of seconds, got {value!r}")
    if value > MAX_CADENCE_S:
        raise ValueError(f"{where}: {value} s is over the {MAX_CADENCE_S} s limit")
    return value


def check_time(value: object, *, where: str, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: must be integer epoch milliseconds, got {value!r}")
    if not -MAX_TIME_MS <= value <= MAX_TIME_MS:
        raise ValueError(f"{where}: {value} is outside +-2**62 epoch milliseconds")
    return value


def check_upserts(rows: Sequence[RowWrite]) -> None:
    for index, row in enumerate(rows):
        if not isinstance(row, RowWrite):
            raise ValueError(f"upsert[{index}]: expected a RowWrite, got {type(row).__name__}")
        check_key(row.key, what="upsert", index=index)
        cadence, at = row.cadence_s, row.next_render_at
        if (
            type(row.route) is str
            and row.route in _known_routes
            and (cadence is None or (type(cadence) is int and 0 < cadence <= MAX_CADENCE_S))
            and type(at) is int
            and -MAX_TIME_MS <= at <= MAX_TIME_MS
            and type(row.sitemap) is bool
        ):
            continue  # the common case, without building the error prefix
        where = _where("upsert", index, row.key)
        check_route_name(row.route, where=f"{where}: route")
        check_cadence(cadence, where=f"{where}: cadence_s", optional=True)
        check_time(at, where=f"{where}: next_render_at")
        if not isinstance(row.sitemap, bool):
            raise ValueError(f"{where}: sitemap must be true or false, got {row.sitemap!r}")


def check_deletes(keys: Sequence[str], upserted: Sequence[RowWrite]) -> None:
    if isinstance(keys, str):
        raise ValueError("delete: expected a sequence of keys, got one string")
    for index, key in enumerate(keys):
        check_key(key, what="delete", index=index)
    if keys and upserted:
        both = set(keys).intersection(row.key for row in upserted)
        if both:
            shown = sorted(both)[:3]
            raise ValueError(
                f"delete: {len(both)} key(s) also in upsert of the same batch "
                f"(e.g. {shown!r}); the intended end state is ambiguous"
            )


def check_completions(items: Sequence[Completion]) -> None:
    for index, item in enumerate(items):
        if not isinstance(item, Completion):
            raise ValueError(f"completion[{index}]: expected a Completion, got {type(item)}")
        check_key(item.key, what="completion", index=index)
        at, now, changed = item.next_render_at, item.now, item.changed
        if (
            item.outcome in OUTCOMES
            and type(now) is int
            and -MAX_TIME_MS <= now <= MAX_TIME_MS
            and (at is None or (type(at) is int and -MAX_TIME_MS <= at <= MAX_TIME_MS))
            and (changed is None or (type(changed) is bool and item.outcome == "rendered"))
        ):
            continue  # the common case, without building the error prefix
        where = _where("completion", index, item.key)
        if item.outcome not in OUTCOMES:
            raise ValueError(
                f"{where}: outcome {item.outcome!r} is not one of {', '.join(sorted(OUTCOMES))}"
            )
        check_time(item.now, where=f"{where}: now")
        check_time(item.next_render_at, where=f"{where}: next_render_at", optional=True)
        if type(changed) is not bool:
            raise ValueError(f"{where}: changed must be true, false or absent, got {changed!r}")
        raise ValueError(
            f"{where}: changed is said of a rendered page only, not of outcome {item.outcome!r}"
        )


def check_consumer(name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_CONSUMER_CHARS:
        raise ValueError(
            f"consumer: name must be a non-empty string of at most {MAX_CONSUMER_CHARS} "
            f"characters, got {name!r}"
        )
    return name


def check_route_change(
    route: object,
    default_cadence_s: object,
    paused: object,
    clear_default_cadence: bool,
    adapt: object = None,
    clear_adapt: bool = False,
    retire_after: object = None,
) -> tuple[bool, bool]:
    """A `set_route` call's arguments; returns whether the default cadence is written (set,
    or cleared back to the global default) and whether the adaptation is (set or cleared)."""
    check_route_name(route)
    check_cadence(default_cadence_s, where="default_cadence_s", optional=True)
    if paused is not None and not isinstance(paused, bool):
        raise ValueError(f"paused: must be true or false, got {paused!r}")
    if retire_after is not None and (
        type(retire_after) is not int or not 1 <= retire_after <= MAX_RETIRE_AFTER
    ):
        raise ValueError(
            f"retire_after: must be a whole number 1..{MAX_RETIRE_AFTER}, got {retire_after!r}"
        )
    if clear_default_cadence and default_cadence_s is not None:
        raise ValueError("default_cadence_s: cannot both set and clear it")
    if adapt is not None:
        if not isinstance(adapt, Adaptation):
            raise ValueError(f"adapt: expected an Adaptation, got {type(adapt).__name__}")
        check_adaptation(adapt)
        if clear_adapt:
            raise ValueError("adapt: cannot both set and clear it")
    return (
        default_cadence_s is not None or clear_default_cadence,
        adapt is not None or clear_adapt,
    )


def check_site_pattern_change(site_pattern: object, clear_site_pattern: bool) -> bool:
    """A `set_route` call's site pattern; returns whether it is written (set or cleared)."""
    if site_pattern is not None:
        if clear_site_pattern:
            raise ValueError("site_pattern: cannot both set and clear it")
        if not isinstance(site_pattern, str):
            raise ValueError(f"site_pattern: a string, got {type(site_pattern).__name__}")
        keys.site_pattern(site_pattern)
    return site_pattern is not None or clear_site_pattern


def check_site_settings(settings: SiteSettings) -> SiteSettings:
    """A site's name in the form site_of gives, and its settings in range."""
    site = settings.site
    if not isinstance(site, str) or not site or not SITE_NAME.fullmatch(site):
        raise ValueError(
            f"site {site!r}: a host name, lower-case, with no port, path, credentials or space"
        )
    if len(site.encode("utf-8")) > MAX_SITE_BYTES:
        raise ValueError(f"site {site[:40]!r}...: over {MAX_SITE_BYTES} bytes")
    for name, value, top in (
        ("max_in_flight", settings.max_in_flight, MAX_SITE_IN_FLIGHT),
        ("min_interval_ms", settings.min_interval_ms, MAX_SITE_INTERVAL_MS),
    ):
        if value is not None and (type(value) is not int or not 0 <= value <= top):
            raise ValueError(f"site {site}: {name} {value!r} is outside 0..{top}")
    return settings


def check_page(after: object, limit: object) -> None:
    """A page of a listing by key: after a key (None: from the first), at most `limit`."""
    if after is not None:
        check_key(after, what="after")
    if type(limit) is not int or not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit: must be a whole number 1..{MAX_PAGE}, got {limit!r}")
