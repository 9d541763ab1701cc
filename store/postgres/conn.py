"""Connections to PostgreSQL, and what their failures mean to a caller.

Every connection is in autocommit mode: a statement is a transaction, and the store's
batches are single statements. A lost connection (the server restarted, the backend
terminated) is `StoreUnavailable`; the connection is dropped and the next call opens
a new one. A lock not granted within the caller's patience, or a statement that ran
past its timeout, is `StoreBusy`. A statement is all or nothing either way; only a
connection lost during its commit leaves the caller unsure whether it happened, and the
caller is never told it did.

No wait for the server is unbounded. A server that vanishes (no reset, no answer: a
host gone, a network partition, a firewall that dropped the connection's state) is
noticed by TCP: keepalives on an idle connection, `tcp_user_timeout` on one with data
unacknowledged. A server whose host answers TCP but whose PostgreSQL does not (a
stopped or wedged server, a proxy or pooler in between that stopped forwarding) is
noticed by the connection's own deadline: every wait for an answer ends at the
session's statement timeout plus ANSWER_MARGIN_S, and then the connection is closed,
its outcome unknown, as a lost one is. Either way the caller hears StoreUnavailable.

The session's `statement_timeout` and `idle_in_transaction_session_timeout` are set
only where nobody configured them: a value from the URL's `options` (or PGOPTIONS),
the role, the database or the server's configuration wins, and the deadline follows
the statement timeout in effect (none when that is 0). The libpq parameters are
likewise filled in only where the URL names none. A statement that legitimately runs
long (a migration, a vacuum, a count of a whole table) runs in `long_statements()`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import errors
from psycopg.abc import RV, PQGen
from psycopg.conninfo import conninfo_to_dict

from store.errors import StoreBusy, StoreFull, StoreUnavailable

APPLICATION_NAME = "renderqueue"

# A server that has not completed a connection in this long is down or out of reach.
CONNECT_TIMEOUT_S = 5
# An idle connection (the feed's LISTEN, a quiet worker's) is probed after this much
# silence, then every KEEPALIVES_INTERVAL_S: a dead one is found before it is next used.
KEEPALIVES_IDLE_S = 3
KEEPALIVES_INTERVAL_S = 1
# Probes unanswered before the kernel drops the connection (TCP_USER_TIMEOUT_MS, when
# shorter, ends it first).
KEEPALIVES_COUNT = 3
# Data sent and unacknowledged this long: the server's host or the path to it is gone.
# A LAN retransmits several times within it, and a member's heartbeat (every 2 s, dead
# after 12 s) gives up on a dead connection in time to land one on a new connection.
TCP_USER_TIMEOUT_MS = 5_000
# The node's statements take milliseconds; one still running after this is stuck (a
# plan gone wrong, a server overloaded), and a writing one holds every feed's horizon.
STATEMENT_TIMEOUT_MS = 5_000
# The store's transactions send their statements back to back; a session idle inside
# one this long has lost its client, and holds its row locks and every feed's horizon.
IDLE_IN_TRANSACTION_TIMEOUT_MS = 10_000
# Upgrades and upkeep (a migration, a vacuum after a long backlog, a count of the whole
# table) on the largest table a cluster holds; past this, such a statement is stuck.
LONG_STATEMENT_TIMEOUT_MS = 3_600_000
# Beyond the statement timeout, how long a wait for the server's answer (its own
# cancellation included, which travels in milliseconds) lasts before the connection is
# given up as unanswering.
ANSWER_MARGIN_S = 2.0

# libpq's parameters, each used unless the URL gives its own.
LIBPQ_DEFAULTS: dict[str, str | int] = {
    "connect_timeout": CONNECT_TIMEOUT_S,
    "keepalives": 1,
    "keepalives_idle": KEEPALIVES_IDLE_S,
    "keepalives_interval": KEEPALIVES_INTERVAL_S,
    "keepalives_count": KEEPALIVES_COUNT,
    "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
}
# The session's settings, each set where nobody configured one (module note).
SESSION_DEFAULTS_MS: dict[str, int] = {
    "statement_timeout": STATEMENT_TIMEOUT_MS,
    "idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_TIMEOUT_MS,
}
_CONFIGURED = """
SELECT name, source <> 'default', setting::bigint FROM pg_settings WHERE name = ANY(%s)
"""


class StoreConnection(psycopg.Connection[tuple[Any, ...]]):
    """A psycopg connection whose waits for the server end at `answer_timeout_s`."""

    # Set by `connect`: the session settings this module may change, the statement
    # timeout in effect (ms; 0: none), and the lock timeout last set (-1: not set here).
    # Until then, the session's first statements are bounded as a short one is.
    owned: frozenset[str] = frozenset()
    statement_timeout_ms: int = STATEMENT_TIMEOUT_MS
    lock_timeout_ms: int = -1
    unanswered = False  # closed because the server did not answer in time

    @property
    def answer_timeout_s(self) -> float | None:
        """How long a statement's wait for the server lasts; None: as long as TCP holds."""
        if self.statement_timeout_ms <= 0:
            return None
        return self.statement_timeout_ms / 1000 + ANSWER_MARGIN_S

    def wait(self, gen: PQGen[RV], interval: float = 0.1, timeout: float | None = None) -> RV:
        if timeout is not None:  # a caller's own (notifies()): its expiry is no failure
            return super().wait(gen, interval, timeout)
        limit_s = self.answer_timeout_s
        if limit_s is None:
            return super().wait(gen, interval)
        try:
            return super().wait(_answered_by(gen, time.monotonic() + limit_s), interval)
        except _Unanswered:
            # Mid-protocol, the connection is of no further use; closing it is also what
            # ends the session once the server hears again.
            self.unanswered = True
            self.close()
            raise psycopg.OperationalError(
                f"no answer from the server in {limit_s:g} s (the statement timeout and "
                f"{ANSWER_MARGIN_S:g} s); connection closed"
            ) from None


class _Unanswered(Exception):
    pass


def _answered_by(gen: PQGen[RV], deadline: float) -> PQGen[RV]:
    """`gen`, given up once the socket has stayed silent past `deadline`. psycopg's wait
    resumes a generator with READY_NONE every `interval` the socket is silent, so the
    deadline is seen within one."""
    try:
        wait = next(gen)
        while True:
            ready = yield wait
            if not ready and time.monotonic() >= deadline:
                raise _Unanswered
            wait = gen.send(ready)
    except StopIteration as done:
        result: RV = done.value
        return result


Conn = StoreConnection


def connect(url: str, *, application_name: str = APPLICATION_NAME) -> Conn:
    """An autocommit connection with the module's bounds; StoreUnavailable when the server
    cannot be reached.

    JIT compilation is off for the session. Every statement here is a short one, and the
    planner turns JIT on from its cost estimate alone: on a table it misjudges (a log or
    schedule just loaded in bulk and not yet analyzed) a feed poll that runs in under a
    millisecond would first compile for tens. Set after connecting, not through libpq's
    `options`, which would replace any the URL carries; so are the timeouts."""
    given = conninfo_to_dict(url)
    params: dict[str, Any] = {k: v for k, v in LIBPQ_DEFAULTS.items() if k not in given}
    if "PGCONNECT_TIMEOUT" in os.environ:
        params.pop("connect_timeout", None)  # the environment's own, as libpq reads it
    try:
        conn = StoreConnection.connect(
            url, autocommit=True, application_name=application_name, **params
        )
        try:
            _set_session(conn)
        except BaseException:
            conn.close()
            raise
    except psycopg.OperationalError as exc:
        raise StoreUnavailable(f"cannot connect to PostgreSQL ({_first_line(exc)})") from None
    return conn


def _set_session(conn: Conn) -> None:
    configured = {
        str(name): (bool(theirs), int(setting))
        for name, theirs, setting in conn.execute(
            _CONFIGURED, (list(SESSION_DEFAULTS_MS),)
        ).fetchall()
    }
    owned = frozenset(name for name, (theirs, _) in configured.items() if not theirs)
    settings = ["SET jit = off"]
    settings += [f"SET {name} = {SESSION_DEFAULTS_MS[name]}" for name in sorted(owned)]
    conn.execute("; ".join(settings))
    conn.owned = owned
    if "statement_timeout" in owned:
        conn.statement_timeout_ms = STATEMENT_TIMEOUT_MS
    else:
        conn.statement_timeout_ms = configured.get("statement_timeout", (True, 0))[1]


def limit(conn: Conn, *, statement_timeout_ms: int, lock_timeout_ms: int | None = None) -> None:
    """Set the session's statement timeout (where it is this module's to set) and lock
    timeout (None: as it is), in one round trip, and only what changed."""
    settings = []
    if "statement_timeout" in conn.owned and conn.statement_timeout_ms != statement_timeout_ms:
        settings.append(f"SET statement_timeout = {int(statement_timeout_ms)}")
    if lock_timeout_ms is not None and conn.lock_timeout_ms != lock_timeout_ms:
        settings.append(f"SET lock_timeout = {int(lock_timeout_ms)}")
    if not settings:
        return
    before = conn.statement_timeout_ms
    if "statement_timeout" in conn.owned:
        # The SET itself is a short statement: bounded by the shorter of the two, not by
        # the long timeout it may be ending.
        conn.statement_timeout_ms = min(
            (ms for ms in (before, statement_timeout_ms) if ms > 0), default=0
        )
    try:
        conn.execute("; ".join(settings))
    except BaseException:
        conn.statement_timeout_ms = before
        raise
    if "statement_timeout" in conn.owned:
        conn.statement_timeout_ms = statement_timeout_ms
    if lock_timeout_ms is not None:
        conn.lock_timeout_ms = lock_timeout_ms


@contextlib.contextmanager
def long_statements(
    conn: psycopg.Connection[Any], timeout_ms: int = LONG_STATEMENT_TIMEOUT_MS
) -> Iterator[None]:
    """Statements in the block may run `timeout_ms` (and their deadline with them), then
    the short timeout is back; a statement timeout configured elsewhere is left as is."""
    if not isinstance(conn, StoreConnection) or "statement_timeout" not in conn.owned:
        yield
        return
    before = conn.statement_timeout_ms
    limit(conn, statement_timeout_ms=timeout_ms)
    try:
        yield
    finally:
        if not conn.closed:
            limit(conn, statement_timeout_ms=before)


@contextlib.contextmanager
def translated(what: str) -> Iterator[None]:
    """Raise the store's errors for psycopg's: busy and unavailable are for callers to act on."""
    try:
        yield
    except errors.LockNotAvailable as exc:
        raise StoreBusy(f"{what}: a lock was not granted in time ({_first_line(exc)})") from None
    except errors.QueryCanceled as exc:  # the statement timeout, or a cancel request
        raise StoreBusy(
            f"{what}: the statement ran past its timeout or was cancelled ({_first_line(exc)})"
        ) from None
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
