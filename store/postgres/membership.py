"""The cluster's members, kept in the shared database's `nodes` table.

A node joins (its row: name, advertised URL, instance, start time), heartbeats, and
leaves on a clean stop (`left_at`, and when its last lease ends). Liveness is judged by
the database's clock, never a node's: a node is live while it has not left and its
heartbeat is younger than the TTL. Every node reads the same table, so every node
computes the same live set once it has read it after a change.

A name belongs to one live node at a time: a second node joining under the name of a
live one is refused (two keepers would each think they own the other's rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from store.errors import StoreError
from store.postgres.conn import Conn, connect, translated
from store.rows import NodeRecord

DEFAULT_TTL_S = 12.0  # a node whose last heartbeat is older than this is dead


class NameTaken(StoreError):
    """Another live node holds this node's name."""


_NODES = """
SELECT node, url, instance,
       (extract(epoch FROM started_at) * 1000)::bigint,
       (extract(epoch FROM now() - heartbeat_at) * 1000)::bigint,
       left_at IS NOT NULL,
       left_at IS NULL AND heartbeat_at > now() - make_interval(secs => %s),
       lease_horizon_ms, max_lease_ms
FROM nodes ORDER BY node
"""

_JOIN = """
INSERT INTO nodes AS n (node, url, instance, max_lease_ms)
VALUES (%(node)s, %(url)s, %(instance)s, %(max_lease_ms)s)
ON CONFLICT (node) DO UPDATE SET
    url = excluded.url, instance = excluded.instance, started_at = now(),
    heartbeat_at = now(), left_at = NULL, lease_horizon_ms = 0,
    max_lease_ms = excluded.max_lease_ms
WHERE n.instance = excluded.instance OR n.left_at IS NOT NULL
   OR n.heartbeat_at <= now() - make_interval(secs => %(ttl)s)
RETURNING node
"""

_HEARTBEAT = """
UPDATE nodes SET heartbeat_at = now(), url = %(url)s
WHERE node = %(node)s AND instance = %(instance)s AND left_at IS NULL
RETURNING node
"""

_LEAVE = """
UPDATE nodes SET left_at = now(), lease_horizon_ms = %(horizon)s
WHERE node = %(node)s AND instance = %(instance)s
"""

# Rows of nodes gone this long are of no use to anyone: the keys they leased are free.
_FORGET = """
DELETE FROM nodes
WHERE heartbeat_at < now() - make_interval(secs => %s) AND node <> %s
"""
FORGET_AFTER_S = 86_400.0


class Membership:
    """One node's membership: join, heartbeat, leave, and reading the member list.

    On a connection of its own (a heartbeat must not wait behind the node's other work).
    Not thread-safe: one thread calls it.
    """

    def __init__(
        self,
        url: str,
        node: str,
        *,
        instance: str,
        advertised_url: str,
        ttl_s: float = DEFAULT_TTL_S,
        max_lease_ms: int = 0,
    ) -> None:
        self.store_url = url
        self.node = node
        self.instance = instance
        self.advertised_url = advertised_url
        self.ttl_s = ttl_s
        self.max_lease_ms = max_lease_ms
        self._conn: Conn | None = None

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.store_url, application_name="renderqueue-membership")
        return self._conn

    def _run(
        self, what: str, statement: str, params: Sequence[Any] | Mapping[str, Any]
    ) -> list[tuple[Any, ...]]:
        conn = self._connection()
        try:
            with translated(what):
                cursor = conn.execute(statement, params)
                return cursor.fetchall() if cursor.description else []
        except StoreError:
            conn.close()
            raise

    def join(self) -> None:
        """Register (or come back under the same name); NameTaken if a live node has it."""
        params = {
            "node": self.node,
            "url": self.advertised_url,
            "instance": self.instance,
            "max_lease_ms": self.max_lease_ms,
            "ttl": self.ttl_s,
        }
        if not self._run("join", _JOIN, params):
            holder = next((n for n in self.nodes() if n.node == self.node), None)
            where = f" at {holder.url} (instance {holder.instance})" if holder else ""
            raise NameTaken(
                f"node name {self.node!r} is taken by a live node{where}; give this node "
                "another name (setting `node`), or stop that one first"
            )
        self._run("join", _FORGET, (FORGET_AFTER_S, self.node))

    def heartbeat(self) -> bool:
        """Prove this node is alive; False when its row is gone or taken (join again)."""
        params = {"node": self.node, "instance": self.instance, "url": self.advertised_url}
        return bool(self._run("heartbeat", _HEARTBEAT, params))

    def leave(self, lease_horizon_ms: int) -> None:
        """Leave now: the others take this node's keys once its last lease ends."""
        params = {"node": self.node, "instance": self.instance, "horizon": lease_horizon_ms}
        self._run("leave", _LEAVE, params)

    def nodes(self) -> list[NodeRecord]:
        """Every known node, live or not, by name."""
        return read_nodes(self._connection(), self.ttl_s)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def read_nodes(conn: Conn, ttl_s: float) -> list[NodeRecord]:
    with translated("nodes"):
        found = conn.execute(_NODES, (ttl_s,)).fetchall()
    return [
        NodeRecord(
            node=str(node),
            url=str(url),
            instance=str(instance),
            started_at_ms=int(started),
            heartbeat_age_ms=max(0, int(age)),
            left=bool(left),
            live=bool(live),
            lease_horizon_ms=int(horizon),
            max_lease_ms=int(max_lease),
        )
        for node, url, instance, started, age, left, live, horizon, max_lease in found
    ]
