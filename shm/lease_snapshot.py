"""The lease table on disk across a graceful restart, so live leases outlive the node.

The table lives in POSIX shared memory, which the supervisor unlinks when it exits. A
SIGTERM stop promises that live leases stay valid for their term: so after its workers
have exited, the supervisor `save`s the table's slots to a file beside the database, and
the next start `restore`s them into the fresh table before any worker spawns. Tokens name
the slot index, so every slot comes back at its own index, and a fleet worker's token
from before the restart still completes its key; the key is not granted to anyone else
while its lease lives. An expired lease comes back as what it is (the table turns an
expired unanswered lease into a hold lazily), and so do holds.

Only a graceful stop (SIGTERM) writes a snapshot. A quick stop (SIGINT) writes none and
unlinks the table: the next start begins with an empty table, a fleet worker's
completion then comes back `lease_not_held`, and its key may be granted again. A crash
(SIGKILL, a fault) writes none either, but leaves the table in shared memory, which the
next start adopts instead (shm/lease_survivor.py, which also says why a surviving table
wins over a snapshot file).

The file is a fixed header and the raw slots (`shm.leases.SLOT`, little-endian):

    magic "rqlease\\0", lease layout version, capacity, slot size, written_at (epoch ms),
    instance (64 bytes, NUL padded), the hash secret's fingerprint, CRC-32 of the
    header's other fields and the slots.

The slots are keyed by key hashes, which are keyed by the database's secret
(shm/keys.py): under another secret no key would find its slot, so the snapshot names
the secret by its fingerprint (never the secret itself, which stays in the store).

It is written to a temporary file, fsynced, renamed over the path and the directory
fsynced, so a reader sees a whole snapshot or none. `restore` checks every field before
it touches the table: a wrong magic, version, slot size, capacity (the configured
capacity changed: the slots could not stay at their indexes), instance, secret (the node
now opens another database), size or checksum, or a time in the future, rejects the file
whole. A rejected file is renamed aside (`<path>.rejected`) and the node starts with an
empty table: it never crashes on a bad snapshot and never loads half of one. A snapshot
that was loaded is removed, so a crash later cannot bring back leases that have since
ended.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from pathlib import Path

import msgspec
import numpy as np

from shm.keys import fingerprint
from shm.leases import SLOT, LeaseTable
from shm.segment import LAYOUT_VERSION

MAGIC = b"rqlease\x00"
# magic, layout version, capacity, slot bytes, written_at, instance, secret fingerprint,
# crc32, padding
HEADER = struct.Struct("<8sQQQq64sQI4x")
_CHECKED = struct.Struct("<8sQQQq64sQ")  # the header fields the checksum covers
INSTANCE_BYTES = 64
# Clocks of one machine across a restart: a snapshot from further ahead is not ours.
MAX_FUTURE_MS = 5 * 60 * 1000
REJECTED_SUFFIX = ".rejected"
# A snapshot a surviving lease table made obsolete (shm/lease_survivor.py).
SUPERSEDED_SUFFIX = ".superseded"


class SnapshotRejected(Exception):
    """The file is not a snapshot this table can take; the message says why."""


class Saved(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    bytes: int
    occupied: int
    live_leases: int
    held_keys: int


class Restored(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    written_at: int
    age_ms: int
    occupied: int
    live_leases: int
    held_keys: int
    removed: bool  # False: the file could not be removed, and a later start would reload it


class Rejected(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    reason: str
    moved_to: str | None  # None if the file could not be renamed aside either


def _encode_instance(instance: str) -> bytes:
    raw = instance.encode("utf-8")
    if len(raw) > INSTANCE_BYTES:
        raise ValueError(f"instance {instance!r} is longer than {INSTANCE_BYTES} bytes")
    return raw


def save(
    path: str | os.PathLike[str],
    table: LeaseTable,
    *,
    instance: str,
    secret: bytes,
    now_ms: int,
) -> Saved:
    """Write the table's slots, whose hashes were made under `secret`, to `path`
    atomically. Only once no other process changes the table. Raises OSError (the file
    is then left as it was)."""
    slots = table.export_slots()
    body = slots.tobytes()
    fields = (MAGIC, LAYOUT_VERSION, table.capacity, SLOT.itemsize, now_ms)
    instance_raw = _encode_instance(instance)
    secret_print = fingerprint(secret)
    checked = _CHECKED.pack(*fields, instance_raw, secret_print)
    checksum = zlib.crc32(body, zlib.crc32(checked))
    header = HEADER.pack(*fields, instance_raw, secret_print, checksum)
    target = Path(path)
    temporary = target.with_name(f"{target.name}.tmp{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            with os.fdopen(fd, "wb", closefd=False) as file:
                file.write(header)
                file.write(body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _fsync_directory(target.parent)
    census = table.census(now_ms)
    return Saved(
        path=str(target),
        bytes=len(header) + len(body),
        occupied=census.occupied,
        live_leases=census.live_leases,
        held_keys=census.held_keys,
    )


def _fsync_directory(directory: Path) -> None:
    # The rename is durable only once the directory is; some filesystems refuse the open.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read(
    path: str | os.PathLike[str], *, capacity: int, instance: str, secret: bytes, now_ms: int
) -> tuple[np.ndarray, int]:
    """The slots of a valid snapshot for this table, hashed under `secret`, and when it
    was written; raises SnapshotRejected naming the first field that is wrong, or
    OSError."""
    expected_size = HEADER.size + capacity * SLOT.itemsize
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        head = file.read(HEADER.size)
        if len(head) < HEADER.size:
            raise SnapshotRejected(f"truncated: {size} bytes, shorter than the header")
        (
            magic,
            version,
            stored_capacity,
            slot_bytes,
            written_at,
            raw_instance,
            stored_print,
            checksum,
        ) = HEADER.unpack(head)
        if magic != MAGIC:
            raise SnapshotRejected(f"not a lease snapshot (magic {magic!r})")
        if version != LAYOUT_VERSION:
            raise SnapshotRejected(
                f"lease layout version {version}, this build reads {LAYOUT_VERSION}"
            )
        if slot_bytes != SLOT.itemsize:
            raise SnapshotRejected(f"{slot_bytes}-byte slots, this build has {SLOT.itemsize}")
        if stored_capacity != capacity:
            raise SnapshotRejected(
                f"capacity {stored_capacity}, the table has {capacity} (lease_slots changed); "
                "tokens name slot indexes, so the slots cannot move to another table size"
            )
        if size != expected_size:
            raise SnapshotRejected(
                f"{size} bytes, a snapshot of {capacity} slots has {expected_size} (truncated?)"
            )
        body = file.read(expected_size - HEADER.size + 1)
    if len(body) != expected_size - HEADER.size:
        raise SnapshotRejected("the file changed size while it was read")
    if zlib.crc32(body, zlib.crc32(head[: _CHECKED.size])) != checksum:
        raise SnapshotRejected("checksum mismatch: the file is corrupt")
    stored_instance = raw_instance.rstrip(b"\x00").decode("utf-8", errors="replace")
    if stored_instance != instance:
        raise SnapshotRejected(
            f"written by instance {stored_instance!r}, this node is {instance!r} (set "
            f"instance = {stored_instance!r} to take its leases)"
        )
    if stored_print != fingerprint(secret):
        raise SnapshotRejected(
            f"its key hashes were made under the hash secret {stored_print:016x}, this "
            f"node's database has {fingerprint(secret):016x} (another database): no key "
            "would find its lease"
        )
    if not 0 < written_at <= now_ms + MAX_FUTURE_MS:
        raise SnapshotRejected(f"written_at {written_at} ms is not a time before now ({now_ms})")
    return np.frombuffer(body, dtype=SLOT), written_at


def restore(
    path: str | os.PathLike[str],
    table: LeaseTable,
    *,
    instance: str,
    secret: bytes,
    now_ms: int,
) -> Restored | Rejected | None:
    """Load a snapshot into the fresh `table` and remove the file; None if there is none.

    Never raises for a bad file: it is renamed aside and reported as `Rejected`, and the
    table is left empty."""
    target = Path(path)
    if not target.exists():
        return None
    try:
        slots, written_at = read(
            target, capacity=table.capacity, instance=instance, secret=secret, now_ms=now_ms
        )
        table.import_slots(slots)
    except (SnapshotRejected, OSError, ValueError) as exc:
        reason = str(exc) if isinstance(exc, SnapshotRejected) else f"{type(exc).__name__}: {exc}"
        return Rejected(path=str(target), reason=reason, moved_to=_move_aside(target))
    census = table.census(now_ms)
    try:
        target.unlink(missing_ok=True)
        removed = True
    except OSError:
        removed = False
    return Restored(
        path=str(target),
        written_at=written_at,
        age_ms=now_ms - written_at,
        occupied=census.occupied,
        live_leases=census.live_leases,
        held_keys=census.held_keys,
        removed=removed,
    )


def set_aside(path: str | os.PathLike[str], suffix: str) -> str | None:
    """Rename the snapshot at `path` to `<path><suffix>` so no start loads it; the new
    name, or None if there was no file or it could not be renamed."""
    target = Path(path)
    return _move_aside(target, suffix) if target.exists() else None


def _move_aside(target: Path, suffix: str = REJECTED_SUFFIX) -> str | None:
    aside = target.with_name(target.name + suffix)
    try:
        os.replace(target, aside)
    except OSError:
        return None
    return str(aside)
