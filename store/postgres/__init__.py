"""The cluster backend: PostgreSQL, shared by every node.

What a PostgreSQL backend is made of, module by module:

- `store`: `PostgresStore`, the `store.base.ScheduleStore` on psycopg 3, one autocommit
  connection per thread, every batch one statement;
- `schema` and `sql`: the versioned schema, its statement-level log triggers (which also
  NOTIFY), and the statements;
- `conn`: connections, and what a lost connection or a refused lock means to a caller;
- `feed`: a consumer's `(xid, seq)` keyset cursor over the log (`PostgresSubscription`),
  its LISTEN wake-ups, and pruning.

Unlike SQLite's, this backend needs no shared memory, semaphores or checkpoints: the
server does what those do for the embedded file.
"""

from store.postgres.feed import PostgresFeedStatistics, PostgresSubscription
from store.postgres.store import PostgresStore, PostgresStoreStatistics

__all__ = [
    "PostgresFeedStatistics",
    "PostgresStore",
    "PostgresStoreStatistics",
    "PostgresSubscription",
]
