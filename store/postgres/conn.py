"""Connections to PostgreSQL, and what their failures mean to a caller.

Every connection is in autocommit mode: a statement is a transaction, and the store's
batches are single statements. A lost connection (the server restarted, the backend
terminated) is `StoreUnavailable`; the connection is dropped and the next call opens
a new one. A lock not granted within the caller's patience is `StoreBusy`. A statement
is all or nothing either way; only a connection lost during its commit leaves the caller
unsure whether it happened, and the caller is never told it did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import errors

from store.errors import StoreBusy, StoreFull, StoreUnavailable

Conn = psycopg.Connection[tuple[Any, ...]]

CONNECT_TIMEOUT_S = 5
APPLICATION_NAME = "renderqueue"


def connect(url: str, *, application_name: str = APPLICATION_NAME) -> Conn:
    """An autocommit connection; StoreUnavailable when the server cannot be reached.

    JIT compilation is off for the session. Every statement here is a short one, and the
    planner turns JIT on from its cost estimate alone: on a table it misjudges (a log or
    schedule just loaded in bulk and not yet analyzed) a feed poll that runs in under a
    millisecond would first compile for tens. Set after connecting, not through libpq's
    `options`, which would replace any the URL carries."""
    try:
        conn = psycopg.connect(
            url,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT_S,
            application_name=application_name,
        )
        try:
            conn.execute("SET jit = off")
        except BaseException:
            conn.close()
            raise
    except psycopg.OperationalError as exc:
        raise StoreUnavailable(f"cannot connect to PostgreSQL ({_first_line(exc)})") from None
    return conn


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Raise the store's errors for psycopg's: busy and unavailable are for callers to act on."""
    try:
        yield
    except (errors.LockNotAvailable, errors.QueryCanceled) as exc:
        raise StoreBusy(f"{what}: a lock was not granted in time ({_first_line(exc)})") from None
    except errors.TransactionRollback as exc:  # a deadlock or serialization failure
        raise StoreBusy(f"{what}: rolled back by the server ({_first_line(exc)})") from None
    except (errors.DiskFull, errors.IoError) as exc:
        raise StoreFull(
            f"{what}: the server's disk refused the write ({_first_line(exc)}); nothing was "
            "written, and writes work again once it has room"
        ) from None
    except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
        raise StoreUnavailable(
            f"{what}: the connection to PostgreSQL failed ({_first_line(exc)}); "
            "no write was confirmed and none is half-done"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
