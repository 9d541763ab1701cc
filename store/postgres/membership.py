"""The cluster's members, kept in the shared database's `nodes` table.

A node joins (its row: name, advertised URL, a new incarnation, host and pid),
heartbeats, and leaves on a clean stop (`left_at`, and its live leases handed over).
Liveness is judged by the database's clock, never a node's: a node is live while it has
not left and its heartbeat is younger than the TTL. Every node reads the same table, so
every node computes the same live set once it has read it after a change.

Identity is an incarnation, not a name. Every start takes a new number from a sequence;
a heartbeat, an acknowledgement and a leave name it, so a process that was paused while
another took its name over changes nothing and learns it was superseded. A name belongs
to one live incarnation at a time: a second process joining under a live name is
refused, unless the holder is a dead process of this same host (a crash, restarted).

The cluster's timing settings, the key-hash secret's fingerprint, the membership
protocol, the site policy (the default per-site cap and spacing, the highest cap a
site may be given, the failure block) and what divides the keys among the nodes (their
own hash or their site's) are stored once (`cluster_settings`). A node whose
values differ from the live cluster's is refused at join, with both values named; with
no live node the joiner's values become the cluster's, so changing them means stopping
every node first.

A lease outlives its node's leave: the node hands it over (`lease_handover`, with its
token), and until it ends a completion of it lands through any other node, which
settles the hand-over row (`settle_completed`) in the completion's transaction. The
node's next start takes back the leases it restored (`NodeMembership.take_back`) and
drops those settled meanwhile, so one lease is completed once, wherever it lands.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from store.errors import StoreError
from store.postgres.conn import Conn, connect, translated
from store.rows import HandedBlock, Handover, MemberList, NodeRecord

DEFAULT_TTL_S = 12.0  # a node whose last heartbeat is older than this is dead
# Bumped on any change to what nodes promise each other (fences, hand-over, tokens): a
# node of another protocol is refused at join rather than splitting ownership.
PROTOCOL = 2


class NameTaken(StoreError):
    """Another live node holds this node's name."""


class SettingsDiffer(StoreError):
    """This node's cluster settings differ from the live cluster's."""


class ClusterSettingsRecord(msgspec.Struct, frozen=True, kw_only=True):
    ttl_ms: int
    heartbeat_ms: int
    max_lease_ms: int
    secret_fingerprint: int
    protocol: int = PROTOCOL
    # workers.config: the site_* settings as one value (every node must enforce alike).
    site_policy: str = ""
    ownership: str = "key"  # workers.config: "key" or "site"


class Joined(msgspec.Struct, frozen=True, kw_only=True):
    incarnation: int
    predecessor: NodeRecord | None  # the row this start replaced (a restart of the name)
    settings_set: bool  # no node was live: this node's settings became the cluster's


class Beat(msgspec.Struct, frozen=True, kw_only=True):
    """A heartbeat's answer: `superseded` when the row is no longer this incarnation's."""

    superseded: bool
    db_now_ms: int = 0


_NODE_COLUMNS = """node, url, instance,
       (extract(epoch FROM started_at) * 1000)::bigint,
       (extract(epoch FROM now() - heartbeat_at) * 1000)::bigint,
       left_at IS NOT NULL,
       left_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(ttl)s),
       lease_horizon_ms, max_lease_ms, incarnation, acked_view, host, pid"""

_NODES = f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY node"
_DB_NOW = "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint"

_SETTINGS = """SELECT ttl_ms, heartbeat_ms, max_lease_ms, secret_fingerprint, protocol,
    site_policy, ownership
FROM cluster_settings WHERE id = 1 FOR UPDATE"""
_SET_SETTINGS = """INSERT INTO cluster_settings AS c
    (id, ttl_ms, heartbeat_ms, max_lease_ms, secret_fingerprint, protocol, site_policy,
     ownership, set_by)
VALUES (1, %(ttl_ms)s, %(heartbeat_ms)s, %(max_lease_ms)s, %(secret_fingerprint)s,
        %(protocol)s, %(site_policy)s, %(ownership)s, %(node)s)
ON CONFLICT (id) DO UPDATE SET ttl_ms = excluded.ttl_ms, heartbeat_ms = excluded.heartbeat_ms,
    max_lease_ms = excluded.max_lease_ms, secret_fingerprint = excluded.secret_fingerprint,
    protocol = excluded.protocol, site_policy = excluded.site_policy,
    ownership = excluded.ownership,
    set_by = excluded.set_by, set_at = now()"""
_LIVE_OTHERS = """SELECT count(*) FROM nodes WHERE node <> %(node)s AND left_at IS NULL
    AND heartbeat_at > now() - make_interval(secs => %(ttl)s)"""
_ROW = f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node = %(node)s FOR UPDATE"

_JOIN = """
INSERT INTO nodes AS n (node, url, instance, max_lease_ms, incarnation, host, pid)
VALUES (%(node)s, %(url)s, %(instance)s, %(max_lease_ms)s, nextval('node_incarnation'),
        %(host)s, %(pid)s)
ON CONFLICT (node) DO UPDATE SET
    url = excluded.url, instance = excluded.instance, started_at = now(),
    heartbeat_at = now(), left_at = NULL, lease_horizon_ms = 0,
    max_lease_ms = excluded.max_lease_ms, incarnation = excluded.incarnation,
    host = excluded.host, pid = excluded.pid, acked_view = '{}', acked_at = NULL
RETURNING incarnation
"""

_HEARTBEAT = """
UPDATE nodes SET heartbeat_at = now(), url = %(url)s
WHERE node = %(node)s AND incarnation = %(incarnation)s AND left_at IS NULL
RETURNING (extract(epoch FROM clock_timestamp()) * 1000)::bigint
"""

# Only while the row is this live incarnation's and its heartbeat is within half the TTL
# (the grant window): a raise can then never commit after the others read the node dead
# (a heartbeat past the TTL), so the ceiling they read for a dead node is its last.
_RAISE_CEILING = """
UPDATE nodes SET lease_horizon_ms = GREATEST(lease_horizon_ms, %(horizon)s)
WHERE node = %(node)s AND incarnation = %(incarnation)s AND left_at IS NULL
  AND heartbeat_at > clock_timestamp() - make_interval(secs => %(fresh_s)s)
RETURNING lease_horizon_ms
"""

_LEAVE = """
UPDATE nodes SET left_at = now(), lease_horizon_ms = %(horizon)s
WHERE node = %(node)s AND incarnation = %(incarnation)s
"""

_ACK = """
UPDATE nodes SET acked_view = %(view)s, acked_at = now()
WHERE node = %(node)s AND incarnation = %(incarnation)s AND left_at IS NULL
RETURNING node
"""
# Only this incarnation's: a predecessor's hand-over stays until its leases end, since
# the nodes that took its keys may still be reading it.
_CLEAR_HANDOVER = (
    "DELETE FROM lease_handover WHERE node = %(node)s AND incarnation = %(incarnation)s"
)
_HANDOVER = """INSERT INTO lease_handover
    (node, incarnation, key_hash, expires_at_ms, site_hash, token)
SELECT %(node)s, %(incarnation)s, h, e, s, k
FROM unnest(%(hashes)s::bigint[], %(expires)s::bigint[], %(sites)s::bigint[],
            %(tokens)s::bigint[]) AS t(h, e, s, k)"""
_HANDOVER_BLOCKS = """INSERT INTO lease_handover
    (node, incarnation, key_hash, expires_at_ms, site_hash, block_reason)
SELECT %(node)s, %(incarnation)s, 0, e, s, r
FROM unnest(%(ends)s::bigint[], %(sites)s::bigint[], %(reasons)s::text[]) AS t(e, s, r)"""
# A lease handed over by an incarnation that has left (or been replaced), still live and
# neither completed nor taken back by the node's next start: completed here, once. The
# row stays, so the new owners fence the key until the lease would have ended.
_SETTLE_COMPLETED = """UPDATE lease_handover AS h SET settled = 'completed'
FROM unnest(%(hashes)s::bigint[], %(tokens)s::bigint[]) AS t(key_hash, token)
WHERE h.node = %(node)s AND h.key_hash = t.key_hash AND h.token = t.token AND h.token <> 0
  AND h.settled IS NULL
  AND h.expires_at_ms > (extract(epoch FROM clock_timestamp()) * 1000)::bigint
  AND NOT EXISTS (SELECT 1 FROM nodes AS n WHERE n.node = h.node
                  AND n.incarnation = h.incarnation AND n.left_at IS NULL)
RETURNING h.key_hash, h.token"""
# A start's restored leases, taken back from its predecessors' hand-overs: from then on
# only this node completes them.
_TAKE_BACK = """UPDATE lease_handover AS h SET settled = 'taken_back'
FROM unnest(%(hashes)s::bigint[], %(tokens)s::bigint[]) AS t(key_hash, token)
WHERE h.node = %(node)s AND h.incarnation <> %(incarnation)s AND h.key_hash = t.key_hash
  AND h.token = t.token AND h.token <> 0 AND h.settled IS NULL"""
_COMPLETED_ELSEWHERE = """SELECT key_hash, token FROM lease_handover
WHERE node = %(node)s AND incarnation <> %(incarnation)s AND settled = 'completed'
  AND expires_at_ms > (extract(epoch FROM clock_timestamp()) * 1000)::bigint"""
_READ_HANDOVERS = """SELECT node, incarnation, key_hash, expires_at_ms, site_hash, block_reason
FROM lease_handover
WHERE expires_at_ms > (extract(epoch FROM clock_timestamp()) * 1000)::bigint"""

# Rows of nodes gone this long are of no use to anyone: the keys they leased are free.
_FORGET = """
DELETE FROM nodes
WHERE heartbeat_at < now() - make_interval(secs => %s) AND node <> %s
"""
_FORGET_HANDOVERS = """DELETE FROM lease_handover
WHERE expires_at_ms < (extract(epoch FROM clock_timestamp()) * 1000)::bigint"""
FORGET_AFTER_S = 86_400.0


def _signed(values: Sequence[int]) -> list[int]:
    """Unsigned 64-bit key hashes as PostgreSQL's signed bigint (the same bits)."""
    return np.asarray(values, dtype=np.uint64).view(np.int64).tolist()  # type: ignore[no-any-return]


def _unsigned(values: Sequence[int]) -> list[int]:
    return np.asarray(values, dtype=np.int64).view(np.uint64).tolist()  # type: ignore[no-any-return]


def _lease_set(found: Sequence[tuple[Any, ...]]) -> set[tuple[int, int]]:
    """(key hash, token) pairs read back from lease_handover, unsigned as the lease table
    keeps them."""
    hashes = _unsigned([int(row[0]) for row in found])
    tokens = _unsigned([int(row[1]) for row in found])
    return set(zip(hashes, tokens, strict=True))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NodeMembership:
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
        heartbeat_s: float = 2.0,
        secret_fingerprint: int = 0,
        site_policy: str = "",
        ownership: str = "key",
    ) -> None:
        self.store_url = url
        self.node = node
        self.instance = instance
        self.advertised_url = advertised_url
        self.ttl_s = ttl_s
        self.max_lease_ms = max_lease_ms
        self.heartbeat_s = heartbeat_s
        self.secret_fingerprint = secret_fingerprint
        self.site_policy = site_policy
        self.ownership = ownership
        self.incarnation = 0
        self.host = socket.gethostname()
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

    @property
    def settings(self) -> ClusterSettingsRecord:
        return ClusterSettingsRecord(
            ttl_ms=round(self.ttl_s * 1000),
            heartbeat_ms=round(self.heartbeat_s * 1000),
            max_lease_ms=self.max_lease_ms,
            secret_fingerprint=_signed([self.secret_fingerprint])[0],
            site_policy=self.site_policy,
            ownership=self.ownership,
        )

    def join(self) -> Joined:
        """Register as a new incarnation; NameTaken if a live process has the name,
        SettingsDiffer if the live cluster runs with other settings."""
        conn = self._connection()
        mine = self.settings
        try:
            with translated("join"), conn.transaction():
                found = conn.execute(_SETTINGS).fetchone()
                others = conn.execute(_LIVE_OTHERS, {"node": self.node, "ttl": self.ttl_s})
                live_others = int(others.fetchone()[0])  # type: ignore[index]
                if found is not None and live_others:
                    theirs = ClusterSettingsRecord(
                        ttl_ms=found[0],
                        heartbeat_ms=found[1],
                        max_lease_ms=found[2],
                        secret_fingerprint=found[3],
                        protocol=found[4],
                        site_policy=found[5],
                        ownership=found[6],
                    )
                    if theirs != mine:
                        raise SettingsDiffer(_differences(mine, theirs))
                settings_set = found is None or (not live_others and found is not None)
                if settings_set:
                    conn.execute(_SET_SETTINGS, {**msgspec.to_builtins(mine), "node": self.node})
                rows = conn.execute(_ROW, {"node": self.node, "ttl": self.ttl_s}).fetchall()
                predecessor = _records(rows)[0] if rows else None
                # A live row is another process's, unless it is a dead process of this
                # host: the same node crashed and restarted within the TTL.
                crashed_here = predecessor is not None and (
                    predecessor.host == self.host and not _pid_alive(predecessor.pid)
                )
                if predecessor is not None and predecessor.live and not crashed_here:
                    raise NameTaken(
                        f"node name {self.node!r} is taken by a live node at "
                        f"{predecessor.url} (host {predecessor.host or '?'}, pid "
                        f"{predecessor.pid or '?'}, incarnation {predecessor.incarnation}); "
                        "give this node another name (setting `node`), or stop that one "
                        "first"
                    )
                params = {
                    "node": self.node,
                    "url": self.advertised_url,
                    "instance": self.instance,
                    "max_lease_ms": self.max_lease_ms,
                    "host": self.host,
                    "pid": os.getpid(),
                }
                incarnation = int(conn.execute(_JOIN, params).fetchone()[0])  # type: ignore[index]
        except StoreError:
            conn.close()
            raise
        self.incarnation = incarnation
        self._run("join", _FORGET, (FORGET_AFTER_S, self.node))
        self._run("join", _FORGET_HANDOVERS, ())
        return Joined(incarnation=incarnation, predecessor=predecessor, settings_set=settings_set)

    def heartbeat(self) -> Beat:
        """Prove this incarnation is alive; superseded when its row is gone, left or taken
        (it must then grant nothing more: another incarnation may own its keys)."""
        params = {"node": self.node, "incarnation": self.incarnation, "url": self.advertised_url}
        found = self._run("heartbeat", _HEARTBEAT, params)
        if not found:
            return Beat(superseded=True)
        return Beat(superseded=False, db_now_ms=int(found[0][0]))

    def db_now_ms(self) -> int:
        return int(self._run("clock", _DB_NOW, ())[0][0])

    def leave(self, handover: Handover) -> None:
        """Leave now, handing over the live leases: the others fence exactly those keys
        until each lease ends (`handover` is in the database's clock)."""
        conn = self._connection()
        horizon = max(handover.expires_at_ms, default=0)
        try:
            with translated("leave"), conn.transaction():
                write_handover(conn, self.node, self.incarnation, handover)
                conn.execute(
                    _LEAVE,
                    {"node": self.node, "incarnation": self.incarnation, "horizon": horizon},
                )
        except StoreError:
            conn.close()
            raise

    def take_back(self, leases: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Take back the restored `leases` (key hash, token) that this node's earlier
        incarnations handed over, so no other node completes them from now on; returns
        those of them another node completed meanwhile, which the caller ends."""
        conn = self._connection()
        params = {
            "node": self.node,
            "incarnation": self.incarnation,
            "hashes": _signed([h for h, _ in leases]),
            "tokens": _signed([t for _, t in leases]),
        }
        try:
            with translated("take back"), conn.transaction():
                conn.execute(_TAKE_BACK, params)
                found = conn.execute(_COMPLETED_ELSEWHERE, params).fetchall()
        except StoreError:
            conn.close()
            raise
        done = _lease_set(found)
        return [lease for lease in leases if lease in done]

    def nodes(self) -> list[NodeRecord]:
        """Every known node, live or not, by name."""
        return read_members(self._connection(), self.ttl_s).records

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _differences(mine: ClusterSettingsRecord, theirs: ClusterSettingsRecord) -> str:
    names = {
        "ttl_ms": ("node_ttl_s", 1000),
        "heartbeat_ms": ("heartbeat_s", 1000),
        "max_lease_ms": ("max_lease_s", 1000),
        "secret_fingerprint": ("the key-hash secret's fingerprint", 0),
        "protocol": ("the membership protocol", 0),
    }
    parts = []
    for field, (name, scale) in names.items():
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            shown = (a / scale, b / scale) if scale else (a, b)
            parts.append(f"{name}: this node {shown[0]:g}, the cluster {shown[1]:g}")
    if mine.ownership != theirs.ownership:
        parts.append(f"ownership: this node {mine.ownership}, the cluster {theirs.ownership}")
    if mine.site_policy != theirs.site_policy:
        parts.append(
            f"the site settings (site_*): this node {mine.site_policy or 'none'}, "
            f"the cluster {theirs.site_policy or 'none'}"
        )
    return (
        "this node's cluster settings differ from the live cluster's ("
        + "; ".join(parts)
        + "); start it with the cluster's values, or stop every node to change them"
    )


def _records(found: Sequence[tuple[Any, ...]]) -> list[NodeRecord]:
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
            incarnation=int(incarnation),
            acked_view=tuple(int(i) for i in acked or ()),
            host=str(host),
            pid=int(pid),
        )
        for (
            node,
            url,
            instance,
            started,
            age,
            left,
            live,
            horizon,
            max_lease,
            incarnation,
            acked,
            host,
            pid,
        ) in found
    ]


def read_members(conn: Conn, ttl_s: float, handovers: bool = False) -> MemberList:
    """The member list (and, when asked, every live hand-over), with the database's clock.

    The hand-overs are read after the rows: a row's acknowledgement and its hand-over
    commit together, so an acknowledgement seen in the first statement has its hand-over
    (or a later one, which covers no fewer of the keys it lost) visible to the second."""
    with translated("nodes"), conn.transaction():
        records = _records(conn.execute(_NODES, {"ttl": ttl_s}).fetchall())
        db_now = int(conn.execute(_DB_NOW).fetchone()[0])  # type: ignore[index]
        found = conn.execute(_READ_HANDOVERS).fetchall() if handovers else []
    by_owner: dict[tuple[str, int], tuple[list[int], list[int], list[int]]] = {}
    blocks: dict[tuple[str, int], list[HandedBlock]] = {}
    for node, incarnation, hashed, expires, site, reason in found:
        owner = (str(node), int(incarnation))
        hashes, ends, sites = by_owner.setdefault(owner, ([], [], []))
        if reason is not None:
            unsigned = _unsigned([int(site)])[0]
            blocks.setdefault(owner, []).append(HandedBlock(unsigned, int(expires), str(reason)))
            continue
        hashes.append(int(hashed))
        ends.append(int(expires))
        sites.append(int(site))
    return MemberList(
        records=records,
        db_now_ms=db_now,
        with_handovers=handovers,
        handovers=[
            Handover(
                node=n,
                incarnation=i,
                key_hashes=_unsigned(h),
                expires_at_ms=e,
                site_hashes=_unsigned(s),
                blocks=blocks.get((n, i), []),
            )
            for (n, i), (h, e, s) in by_owner.items()
        ],
    )


def read_nodes(conn: Conn, ttl_s: float) -> list[NodeRecord]:
    return read_members(conn, ttl_s).records


def write_handover(conn: Conn, node: str, incarnation: int, handover: Handover) -> None:
    conn.execute(_CLEAR_HANDOVER, {"node": node, "incarnation": incarnation})
    if handover.key_hashes:
        conn.execute(
            _HANDOVER,
            {
                "node": node,
                "incarnation": incarnation,
                "hashes": _signed(handover.key_hashes),
                "expires": list(handover.expires_at_ms),
                # A hand-over made without its sites (none known) says 0: no site; without
                # its tokens, 0: no completion can name the lease.
                "sites": _signed(handover.site_hashes or [0] * len(handover.key_hashes)),
                "tokens": _signed(handover.tokens or [0] * len(handover.key_hashes)),
            },
        )
    if handover.blocks:
        conn.execute(
            _HANDOVER_BLOCKS,
            {
                "node": node,
                "incarnation": incarnation,
                "ends": [block.until_ms for block in handover.blocks],
                "sites": _signed([block.site_hash for block in handover.blocks]),
                "reasons": [block.reason for block in handover.blocks],
            },
        )


def raise_lease_ceiling(
    conn: Conn, node: str, incarnation: int, horizon_ms: int, ttl_s: float
) -> bool:
    """Publish that no lease of this incarnation ends after `horizon_ms` (the database's
    clock; the ceiling only rises). False when the row did not take it: superseded,
    left, or its heartbeat too old for a raise to be safe (see _RAISE_CEILING)."""
    params = {
        "node": node,
        "incarnation": incarnation,
        "horizon": horizon_ms,
        "fresh_s": ttl_s / 2,
    }
    with translated("lease ceiling"):
        return bool(conn.execute(_RAISE_CEILING, params).fetchall())


def settle_completed(conn: Conn, node: str, leases: Sequence[tuple[int, int]]) -> list[bool]:
    """Which of `leases` (key hash, token), handed over by `node` once it left, this
    transaction completes: each only once, and only while it lives (`_SETTLE_COMPLETED`)."""
    found = conn.execute(
        _SETTLE_COMPLETED,
        {
            "node": node,
            "hashes": _signed([h for h, _ in leases]),
            "tokens": _signed([t for _, t in leases]),
        },
    ).fetchall()
    settled = _lease_set(found)
    return [lease in settled for lease in leases]


def acknowledge(
    conn: Conn, node: str, incarnation: int, view: Sequence[int], handover: Handover
) -> bool:
    """Say this incarnation enforces the view of `view` (incarnations), and hand over its
    live leases on keys it does not own there, in one transaction. False when the row is
    no longer this incarnation's (superseded: it acknowledges nothing)."""
    with translated("acknowledge"), conn.transaction():
        done = conn.execute(
            _ACK, {"node": node, "incarnation": incarnation, "view": list(view)}
        ).fetchall()
        if not done:
            return False
        write_handover(conn, node, incarnation, handover)
    return True
