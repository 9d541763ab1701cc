"""Choosing a backend from a store URL."""

from __future__ import annotations

from store.base import ScheduleStore


def open_store(
    url: str, *, wake_name: str | None = None, page_cache_kib: int | None = None
) -> ScheduleStore:
    """`sqlite:///relative/path`, `sqlite:////absolute/path` or a bare path: SqliteStore.

    The three slashes follow the usual SQL URL form: what comes after `sqlite:///`
    is the path as written, so an absolute path keeps its own leading slash.
    `postgresql://user@host:port/dbname` (or `postgres://`): PostgresStore, the cluster
    backend; the URL is libpq's, so its query string may carry libpq's options.

    `page_cache_kib`: SQLite's page cache for each of the store's connections (the
    PostgreSQL server keeps its own).
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
        try:
            from store.postgres import PostgresStore
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith("psycopg"):
                raise
            raise ValueError(
                f"store URL {url!r}: PostgreSQL support is not installed "
                "(pip install 'renderqueue[postgres]')"
            ) from exc
        return PostgresStore(url)
    else:
        raise ValueError(
            f"store URL {url!r}: unknown scheme {scheme!r}; use sqlite:///path or postgresql://"
        )
    if path == ":memory:" or "?" in path:
        raise ValueError(
            f"store URL {url!r}: the store needs a plain database file path (the change feed "
            "is read by other connections and processes)"
        )
    from store.sqlite import SqliteStore
    from store.sqlite.conn import PAGE_CACHE_KIB

    cache = PAGE_CACHE_KIB if page_cache_kib is None else page_cache_kib
    return SqliteStore(path, wake_name=wake_name, page_cache_kib=cache)
