"""The embedded backend: one SQLite file in WAL mode, for a single node.

What a SQLite backend is made of, module by module:

- `store`: `SqliteStore`, the `store.base.ScheduleStore` on stdlib sqlite3;
- `schema` and `sql`: the versioned schema, its log triggers, and the statements;
- `conn`: connections and the bounded retry while another writer holds the lock;
- `feed`: a consumer's cursor over the trigger-filled log (`SqliteSubscription`);
- `feed_ring` and `wake`: writers hand each commit's log records to the consumers in
  shared memory and post their semaphores, so a consumer need not poll the file;
- `upkeep`: WAL checkpoints and the log's floor, on a thread off the writers' path;
- `wal`: the WAL's length read from its wal-index, without a connection (the supervisor's);
- `backup`: a consistent copy while the node runs (`renderqueue backup`).
"""

from store.sqlite.store import SqliteStore, StoreStatistics

__all__ = ["SqliteStore", "StoreStatistics"]
