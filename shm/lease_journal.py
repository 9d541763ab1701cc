"""The lease journal: every lease a process grants, renews and ends, appended to a file of
its own, so an audit can prove from the nodes' own records that no key was held by two
leases at once (`bench/harness/history.py` merges them with what a fleet saw).

Off unless asked for (`lease_journal_dir`): a record is one fixed-size row written by the
process that changed the lease. Its instants are read so that a recorded lease lies
inside the real one: a grant's after its compare-and-swap, an end's before, so two
recorded leases of one key overlap only if two real ones did (the caller's `now`, read
before the grant, could be older than an end another process made meanwhile). Expiries
are the table's own. A process appends with `O_APPEND` and one `write` per
batch: a process killed mid-batch loses at most that batch's tail, never another
process's rows. The file name carries the node and the pid, so a node's leases that a
restart adopted (granted by one process, ended by another) join up by node and token.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import numpy as np
import numpy.typing as npt

from shm.segment import now_ms

GRANTED, RENEWED, ENDED = 1, 2, 3

RECORD = np.dtype(
    [
        ("kind", "<u1"),
        ("key_hash", "<u8"),
        ("token", "<u8"),
        ("at_ms", "<i8"),  # when the process changed the lease (epoch ms)
        ("until_ms", "<i8"),  # the lease's expiry after the change (ENDED: the instant)
    ]
)

_NAME = re.compile(r"^leases-(?P<node>[A-Za-z0-9_.-]+)-(?P<pid>\d+)\.bin$")


class LeaseJournal:
    """One process's journal; `write` appends rows of `RECORD`."""

    def __init__(
        self,
        directory: Path,
        node: str,
        pid: int | None = None,
        clock: Callable[[], int] = now_ms,
    ) -> None:
        self.clock = clock
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", node):
            raise ValueError(f"a journal's node name must be a plain file name, got {node!r}")
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"leases-{node}-{pid or os.getpid()}.bin"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def granted(self, key_hash: int, token: int, until_ms: int) -> None:
        """Just after the grant's compare-and-swap."""
        self.write(GRANTED, (key_hash,), (token,), self.clock(), (until_ms,))

    def renewed(self, key_hash: int, token: int, until_ms: int) -> None:
        self.write(RENEWED, (key_hash,), (token,), self.clock(), (until_ms,))

    def ended(self, key_hash: int, token: int, began_ms: int) -> None:
        """`began_ms`: `clock()` read before the end's compare-and-swap."""
        self.write(ENDED, (key_hash,), (token,), began_ms, (began_ms,))

    def write(
        self,
        kind: int,
        key_hashes: Iterable[int],
        tokens: Iterable[int],
        at_ms: int,
        until_ms: Iterable[int],
    ) -> None:
        hashes = np.fromiter(key_hashes, dtype=np.uint64)
        rows = np.zeros(len(hashes), dtype=RECORD)
        rows["kind"] = kind
        rows["key_hash"] = hashes
        rows["token"] = np.fromiter(tokens, dtype=np.uint64, count=len(hashes))
        rows["at_ms"] = at_ms
        rows["until_ms"] = np.fromiter(until_ms, dtype=np.int64, count=len(hashes))
        if len(rows):
            os.write(self._fd, rows.tobytes())

    def close(self) -> None:
        os.close(self._fd)


class JournaledLease(msgspec.Struct, frozen=True, kw_only=True):
    """A lease as its node recorded it: held from `granted_ms` until `held_until_ms`."""

    node: str
    key_hash: int
    token: int
    granted_ms: int
    held_until_ms: int  # its end, or its last expiry when no end was recorded


def read_journals(*directories: Path) -> list[JournaledLease]:
    """Every lease in the directories' journals (one missing has none), renewals and ends
    joined to their grants by node and token (a file named as a journal that does not
    parse as one is refused, naming it)."""
    by_node: dict[str, list[npt.NDArray[np.void]]] = {}
    paths = [p for d in directories if d.is_dir() for p in d.iterdir()]
    for path in sorted(paths):
        found = _NAME.match(path.name)
        if found is None:
            continue
        raw = path.read_bytes()
        whole = len(raw) - len(raw) % RECORD.itemsize  # a killed writer's torn tail
        rows = np.frombuffer(raw[:whole], dtype=RECORD)
        if len(rows) and not np.isin(rows["kind"], (GRANTED, RENEWED, ENDED)).all():
            raise ValueError(f"{path} is not a lease journal (unknown record kinds)")
        by_node.setdefault(found["node"], []).append(rows)
    leases: list[JournaledLease] = []
    for node, parts in by_node.items():
        rows = np.concatenate(parts)
        rows = rows[np.argsort(rows["at_ms"], kind="stable")]
        open_: dict[tuple[int, int], list[int]] = {}  # (hash, token): [granted, until]
        for kind, key_hash, token, at, until in rows.tolist():
            lease = (key_hash, token)
            if kind == GRANTED:
                previous = open_.pop(lease, None)
                if previous is not None:  # a token used again: the earlier lease ended
                    leases.append(_lease(node, lease, previous))
                open_[lease] = [at, until]
            elif lease in open_:
                held = open_[lease]
                if kind == RENEWED:
                    held[1] = until
                else:
                    leases.append(_lease(node, lease, [held[0], min(held[1], at)]))
                    del open_[lease]
        leases.extend(_lease(node, lease, held) for lease, held in open_.items())
    return leases


def _lease(node: str, lease: tuple[int, int], held: list[int]) -> JournaledLease:
    return JournaledLease(
        node=node, key_hash=lease[0], token=lease[1], granted_ms=held[0], held_until_ms=held[1]
    )
