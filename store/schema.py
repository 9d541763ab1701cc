"""What both backends' schemas share: the change log's kinds, the global default cadence,
and `migrate`, which brings a database to its backend's latest schema version.

Each backend keeps its own statements (`Steps`) and its own way of making one migration
at a time (`lock`): SQLite's write lock, a PostgreSQL advisory lock.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from store.errors import refuse_newer

# What a change log entry names: a row's key, a route, a setting or a site.
KIND_ROW = 0
KIND_ROUTE = 1
KIND_SETTINGS = 2
KIND_SITE = 3
# The global default cadence: its row in the settings table, and its value while unset.
DEFAULT_CADENCE_SETTING = "default_cadence_s"
DEFAULT_CADENCE_S = 86_400


class Executes(Protocol):
    """A DB-API connection, as far as a migration uses one."""

    def execute(self, query: str, params: Any = ..., /) -> Any: ...


C = TypeVar("C", bound=Executes)


@dataclass(frozen=True)
class Steps(Generic[C]):
    """A backend's migrations. `statements[i]` takes a database from version i to i + 1;
    `seeds[v]` fills what version v's tables start with that SQL cannot make (random bytes
    from Python's `secrets`), after that version's statements, in the same transaction;
    `version_of` reads the version (0: renderqueue never wrote here); `record` inserts
    one version (its parameter in the backend's style)."""

    statements: list[list[str]]
    version_of: Callable[[C], int]
    record: str
    seeds: dict[int, Callable[[C], None]] = field(default_factory=dict)

    @property
    def latest(self) -> int:
        return len(self.statements)


def migrate(
    conn: C, steps: Steps[C], lock: Callable[[C], AbstractContextManager[object]], where: str
) -> int:
    """Bring the database to `steps.latest` in one transaction; returns the version found
    before. SchemaTooNew for a database a newer renderqueue wrote.

    `lock(conn)` holds the one migration at a time and the transaction it runs in: the
    version is read again under it, since another process may have migrated meanwhile.
    """
    found = steps.version_of(conn)
    refuse_newer(found, steps.latest, where)
    if found == steps.latest:
        return found
    with lock(conn):
        found = steps.version_of(conn)
        refuse_newer(found, steps.latest, where)
        if found == 0:
            conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for version in range(found, steps.latest):
            for statement in steps.statements[version]:
                conn.execute(statement)
            if (seed := steps.seeds.get(version + 1)) is not None:
                seed(conn)
            conn.execute(steps.record, (version + 1,))
    return found
