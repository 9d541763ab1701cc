"""What a sitemap entry's text fields mean to the schedule: cadence, lastmod, a usable key.

changefreq -> cadence (whole seconds):
    always  -> 900 (a floor: "always" cannot mean re-render continuously)
    hourly  -> 3,600      daily -> 86,400      weekly -> 604,800
    monthly -> 2,592,000 (30 days)            yearly -> 31,536,000 (365 days)
    never   -> 31,536,000: an archived page is still served, so it is rendered once
               and then yearly, not skipped
    absent or unknown -> None: the route rule's cadence, else the route's default

lastmod accepts every W3C datetime form (YYYY, YYYY-MM, YYYY-MM-DD, and with a time
of hh:mm, hh:mm:ss or hh:mm:ss.s, each with Z or +hh:mm / -hh:mm). A missing time
zone is read as UTC, as search engines do; anything else is unparseable and the URL
is imported as if it had no lastmod.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone
from urllib.parse import urlsplit

from store.rows import MAX_KEY_BYTES

ALWAYS_FLOOR_S = 900

CHANGEFREQ_CADENCE_S: dict[str, int] = {
    "always": ALWAYS_FLOOR_S,
    "hourly": 3_600,
    "daily": 86_400,
    "weekly": 604_800,
    "monthly": 2_592_000,
    "yearly": 31_536_000,
    "never": 31_536_000,
}


def cadence_for_changefreq(changefreq: str | None) -> int | None:
    """The cadence for a changefreq value; None when absent or not a protocol value."""
    if changefreq is None:
        return None
    return CHANGEFREQ_CADENCE_S.get(changefreq.strip().lower())


_W3C_DATETIME = re.compile(
    r"""
    (?P<year>\d{4})
    (?: -(?P<month>\d{2})
        (?: -(?P<day>\d{2})
            (?: T(?P<hour>\d{2}):(?P<minute>\d{2})
                (?: :(?P<second>\d{2}) (?: [.,](?P<fraction>\d+) )? )?
                (?P<tz> Z | [+-]\d{2}:?\d{2} )?
            )?
        )?
    )?
    """,
    re.VERBOSE | re.IGNORECASE,
)


def parse_w3c_datetime(text: str) -> int | None:
    """Epoch milliseconds for a W3C datetime (any of its six forms), else None."""
    match = _W3C_DATETIME.fullmatch(text.strip())
    if match is None:
        return None
    part = match.groupdict()
    tz_text = part["tz"]
    zone: timezone = UTC
    if tz_text and tz_text.upper() != "Z":
        sign = -1 if tz_text[0] == "-" else 1
        digits = tz_text[1:].replace(":", "")
        offset = timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
        if offset >= timedelta(hours=24):
            return None
        zone = timezone(sign * offset)
    fraction = part["fraction"] or "0"
    try:
        moment = datetime(
            int(part["year"]),
            int(part["month"] or 1),
            int(part["day"] or 1),
            int(part["hour"] or 0),
            int(part["minute"] or 0),
            int(part["second"] or 0),
            int(fraction[:6].ljust(6, "0")),
            tzinfo=zone,
        )
    except ValueError:  # month 13, hour 25, February 30...
        return None
    return int(moment.timestamp() * 1000)


# whitespace (Unicode's too) and control characters cannot appear in a URL as written
_UNSAFE_CHARACTER = re.compile(r"[\s\x00-\x1f\x7f]")


def url_problem(loc: str | None) -> str | None:
    """Why `loc` cannot be a schedule key (a short reason), or None if it can."""
    if loc is None or not loc:
        return "missing_loc"
    if len(loc.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return "too_long"
    if _UNSAFE_CHARACTER.search(loc) is not None:
        return "bad_url"
    try:
        parts = urlsplit(loc)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        return "bad_url"
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        return "bad_url"
    return None
