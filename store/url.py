"""Choosing a backend from a store URL."""

from __future__ import annotations

from store.base import ScheduleStore


def open_store(url: str, *, wake_name: str | None = None) -> ScheduleStore:
    """`sqlite:///relative/path`, `sqlite:////absolute/path` or a bare path: SqliteStore.

    The three slashes follow the usual SQL URL form: what comes after `sqlite:///`
    is the path as written, so an absolute path keeps its own leading slash.
    PostgreSQL (`postgresql://`) is the cluster backend, not built yet.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"store URL must be a non-empty string, got {url!r}")
    scheme, sep, rest = url.partition("://")
    if not sep:
        path = url
    elif scheme == "sqlite":
        if not rest.startswith("/") or rest == "/":
            raise ValueError(
                f"store URL {url!r}: write sqlite:///relative/path or sqlite:////absolute/path"
            )
        path = rest[1:]
    elif scheme in ("postgresql", "postgres"):
        raise ValueError(
            f"store URL {url!r}: the PostgreSQL backend is not built yet; "
            "use sqlite:///path (or a bare path) for the embedded store"
        )
    else:
        raise ValueError(f"store URL {url!r}: unknown scheme {scheme!r}; use sqlite:///path")
    if path == ":memory:" or "?" in path:
        raise ValueError(
            f"store URL {url!r}: the store needs a plain database file path (the change feed "
            "is read by other connections and processes)"
        )
    from store.sqlite import SqliteStore

    return SqliteStore(path, wake_name=wake_name)
