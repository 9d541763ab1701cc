"""Shared-memory segments: one POSIX shared memory object, one header, one layout.

A segment is created by one owner process (the node's supervisor) and attached
by name from processes that were spawned, not forked: nothing is inherited, so
everything a reader needs is in the segment itself. The first 256 bytes are a
header described by the numpy dtype `HEADER`:

    magic, layout_version, kind, total_size, capacity, extra_size, item_size,
    owner_pid, created_at, and (on a cache line of its own) generation.

The creator writes every field, then the magic last with a release store, so an
attacher that sees the magic sees the rest. Attach refuses a wrong magic, another
layout version, another kind, another item size or a size that disagrees with
either the header or the mapping, with `LayoutMismatch` naming the segment and
what differs: a process from another build must never read a layout it does not
know.

Create refuses a name whose owner is alive (`SegmentInUse`). A segment whose
owner is dead (or whose pid now belongs to a younger process) is stale, left by a
crashed run: it is unlinked and created afresh. The owner unlinks at exit, even
without an explicit `unlink()`. Names carry an instance id (`segment_name`), so
two nodes on one machine never collide.

`close()` releases every C view registered on the segment before closing the
mapping; if something else still holds a buffer on it, the mapping is left to
the garbage collector rather than raising BufferError at shutdown.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import mmap
import os
import re
import time
from typing import Protocol, TypeVar

import numpy as np
import posix_ipc
import psutil

from shm._atomics import STRIPE_WORDS, STRIPES, Words

log = logging.getLogger(__name__)

MAGIC = int.from_bytes(b"rqshm\x00\x00\x01", "little")
# Bump whenever any layout (header, ring, lease table, state buffer) changes, or the
# key hash that the ring carries and the lease table is keyed by (3: XXH64; 4: the
# lease table's live counters, tag lanes and counted-hold word; 5: the ring entry's
# cadence; 6: the lease table's live counters in the process stripes; 7: SipHash-2-4
# under the database's secret; 8: the write marks' owners view; 9: the ring entry's
# site hash; 10: the lease table's site words and the hold word's permit bit; 11: the
# write marks' lease ceiling and longest lease asked).
LAYOUT_VERSION = 12
HEADER_BYTES = 256
CACHE_LINE = 64

_HEADER_FIELDS: dict[str, tuple[str, int]] = {
    "magic": ("<u8", 0),
    "layout_version": ("<u8", 8),
    "kind": ("S16", 16),
    "total_size": ("<u8", 32),
    "capacity": ("<u8", 40),
    "extra_size": ("<u8", 48),
    "item_size": ("<u8", 56),
    "owner_pid": ("<u8", 64),
    "created_at": ("<u8", 72),
    "generation": ("<u8", 128),  # a cache line of its own: bumped on every publish
}
HEADER = np.dtype(
    {
        "names": list(_HEADER_FIELDS),
        "formats": [fmt for fmt, _ in _HEADER_FIELDS.values()],
        "offsets": [offset for _, offset in _HEADER_FIELDS.values()],
        "itemsize": HEADER_BYTES,
    }
)
_WORD = {name: offset // 8 for name, (_, offset) in _HEADER_FIELDS.items()}
GENERATION_WORD = _WORD["generation"]
_NAME_PART = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# A just-created segment may not have its header yet; attach and create wait this
# long for the creator before judging it.
_INIT_WAIT_S = 1.0

_owned: dict[str, int] = {}


class SegmentError(Exception):
    """Base of the shared-memory segment errors."""


class LayoutMismatch(SegmentError):
    """Attach refused: the segment's header disagrees with this build's layout."""


class SegmentInUse(SegmentError):
    """Create refused: a live process owns a segment of that name."""


class SegmentMissing(SegmentError, LookupError):
    """Attach refused: no segment of that name exists."""


class Releasable(Protocol):
    def release(self) -> None: ...


_R = TypeVar("_R", bound=Releasable)


class SizeRule(Protocol):
    """The total size this build's layout needs for a header's capacity and extra size."""

    def __call__(self, capacity: int, extra_size: int, /) -> int: ...


def segment_name(instance: str, part: str) -> str:
    """The POSIX name of one part of one node's shared memory: "/rq-<instance>-<part>"."""
    for label, value in (("instance", instance), ("part", part)):
        if not _NAME_PART.match(value):
            raise ValueError(f"shared memory {label} {value!r} must be 1-64 of [A-Za-z0-9_.-]")
    return f"/rq-{instance}-{part}"


def remove(name: str) -> bool:
    """Unlink a segment by name; False if there was none. For supervisors and tests."""
    _owned.pop(name, None)
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def align(offset: int, to: int = CACHE_LINE) -> int:
    return (offset + to - 1) // to * to


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def monotonic_ms() -> int:
    """CLOCK_MONOTONIC, which every process of the machine shares."""
    return time.monotonic_ns() // 1_000_000


def _owner_alive(pid: int, created_at: int) -> bool:
    """True if `pid` is a running process that existed when the segment was made."""
    if pid <= 0:
        return False
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        started_ms = int(process.create_time() * 1000)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True
    # create_time has clock-tick resolution; a process started after the segment
    # was created cannot be its owner: the pid was reused.
    return started_ms <= created_at + 2_000


def _read_header(mm: mmap.mmap) -> np.void:
    view = np.frombuffer(mm, dtype=HEADER, count=1)
    header: np.void = view[0].copy()
    del view
    return header


def _kind(header: np.void) -> str:
    return bytes(header["kind"]).rstrip(b"\x00").decode("ascii", "replace")


class Segment:
    """One mapped segment. Use `create` or `attach`; never construct directly."""

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.size = len(mm)
        self.owner = owner
        self.replaced_stale = False
        self._shm = shm
        self._mm: mmap.mmap | None = mm
        self._views: list[Releasable] = []
        self.words = self.register(Words(mm, 0, HEADER_BYTES))

    # ---------------------------------------------------------------- create

    @classmethod
    def create(
        cls, name: str, kind: str, size: int, capacity: int, extra_size: int, item_size: int
    ) -> Segment:
        """Create and initialise a segment; replace a stale one; refuse a live one."""
        replaced = False
        for _ in range(5):
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
                break
            except posix_ipc.ExistentialError:
                replaced = _replace_if_stale(name) or replaced
        else:
            raise SegmentInUse(f"shared memory segment {name} keeps reappearing; another creator?")
        mm = mmap.mmap(shm.fd, size)
        shm.close_fd()
        header = np.frombuffer(mm, dtype=HEADER, count=1)
        header["layout_version"] = LAYOUT_VERSION
        header["kind"] = kind.encode("ascii")
        header["total_size"] = size
        header["capacity"] = capacity
        header["extra_size"] = extra_size
        header["item_size"] = item_size
        header["owner_pid"] = os.getpid()
        header["created_at"] = now_ms()
        del header
        segment = cls(name, shm, mm, owner=True)
        segment.replaced_stale = replaced
        segment.words.store(_WORD["magic"], MAGIC)
        _owned[name] = os.getpid()
        return segment

    # ---------------------------------------------------------------- attach

    @classmethod
    def attach(cls, name: str, kind: str, item_size: int, expected_size: SizeRule) -> Segment:
        """Map an existing segment after checking its header against this build."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SegmentMissing(
                f"shared memory segment {name} does not exist: is the node running, "
                "with the same instance id?"
            ) from None
        deadline = time.monotonic() + _INIT_WAIT_S
        while shm.size < HEADER_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
        if (size := shm.size) < HEADER_BYTES:
            shm.close_fd()
            raise LayoutMismatch(
                f"shared memory segment {name}: {size} bytes, smaller than the "
                f"{HEADER_BYTES}-byte header"
            )
        mm = mmap.mmap(shm.fd, shm.size)
        shm.close_fd()
        segment = cls(name, shm, mm, owner=False)
        try:
            segment._check(kind, item_size, expected_size)
        except BaseException:
            segment.close()
            raise
        return segment

    def _check(self, kind: str, item_size: int, expected_size: SizeRule) -> None:
        deadline = time.monotonic() + _INIT_WAIT_S
        magic = self.words.load(_WORD["magic"])
        while magic == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
            magic = self.words.load(_WORD["magic"])
        if magic != MAGIC:
            raise LayoutMismatch(
                f"shared memory segment {self.name}: magic {magic:#018x}, expected {MAGIC:#018x} "
                "(not a renderqueue segment, or never initialised)"
            )
        header = self.header()
        differences = []
        if int(header["layout_version"]) != LAYOUT_VERSION:
            differences.append(
                f"layout version {int(header['layout_version'])}, this build reads {LAYOUT_VERSION}"
            )
        if _kind(header) != kind:
            differences.append(f"kind {_kind(header)!r}, expected {kind!r}")
        if int(header["item_size"]) != item_size:
            differences.append(
                f"item size {int(header['item_size'])} bytes, this build's is {item_size}"
            )
        total = int(header["total_size"])
        if total != self.size:
            differences.append(f"header says {total} bytes but the segment has {self.size}")
        if not differences:
            want = expected_size(int(header["capacity"]), int(header["extra_size"]))
            if want != total:
                differences.append(
                    f"size {total} bytes, this build's layout for capacity "
                    f"{int(header['capacity'])} needs {want}"
                )
        if differences:
            raise LayoutMismatch(
                f"shared memory segment {self.name} refused: " + "; ".join(differences)
            )

    # ----------------------------------------------------------------- access

    @property
    def mmap(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"shared memory segment {self.name} is closed")
        return self._mm

    @property
    def closed(self) -> bool:
        return self._mm is None

    def register(self, view: _R) -> _R:
        """Track a C view so close() can release it before the mapping closes."""
        self._views.append(view)
        return view

    def header(self) -> np.void:
        return _read_header(self.mmap)

    @property
    def capacity(self) -> int:
        return int(self.header()["capacity"])

    @property
    def extra_size(self) -> int:
        return int(self.header()["extra_size"])

    @property
    def owner_pid(self) -> int:
        return int(self.header()["owner_pid"])

    @property
    def created_at(self) -> int:
        return int(self.header()["created_at"])

    @property
    def generation(self) -> int:
        return int(self.words.load(GENERATION_WORD))

    def set_generation(self, generation: int) -> None:
        self.words.store(GENERATION_WORD, generation)

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Release the views, then the mapping. Idempotent; never raises BufferError."""
        for view in reversed(self._views):
            view.release()
        self._views.clear()
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            mm.close()
        except BufferError:
            # Someone still holds a numpy view or memoryview on the mapping; the
            # mapping goes when they do. Shutdown must not fail over it.
            log.debug("shared memory segment %s: mapping still exported at close", self.name)

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until closed). Idempotent."""
        remove(self.name)


def _replace_if_stale(name: str) -> bool:
    """Unlink `name` if its owner is dead; raise SegmentInUse if it is alive."""
    try:
        shm = posix_ipc.SharedMemory(name)
    except posix_ipc.ExistentialError:
        return False  # gone meanwhile: just retry the create
    try:
        deadline = time.monotonic() + _INIT_WAIT_S
        while shm.size < HEADER_BYTES and time.monotonic() < deadline:
            time.sleep(0.01)
        if shm.size < HEADER_BYTES:
            reason = f"{shm.size} bytes, never initialised"
        else:
            mm = mmap.mmap(shm.fd, HEADER_BYTES)
            words = Words(mm, 0, HEADER_BYTES)
            try:
                magic = words.load(_WORD["magic"])
                while magic == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                    magic = words.load(_WORD["magic"])
                header = _read_header(mm)
            finally:
                words.release()
                mm.close()
            pid, created = int(header["owner_pid"]), int(header["created_at"])
            if magic == 0:
                reason = "its creator never finished writing the header"
            elif magic != MAGIC:
                raise SegmentInUse(
                    f"shared memory segment {name} exists and is not a renderqueue segment "
                    f"(magic {magic:#018x}); refusing to replace it"
                )
            elif pid == os.getpid():
                raise SegmentInUse(f"shared memory segment {name} is already owned by this process")
            elif _owner_alive(pid, created):
                raise SegmentInUse(
                    f"shared memory segment {name} is owned by live process {pid} "
                    f"(kind {_kind(header)!r}, created at {created} ms); is another node "
                    "running with the same instance id?"
                )
            else:
                reason = f"owner pid {pid} is dead"
    finally:
        shm.close_fd()
    log.warning("shared memory segment %s is stale (%s); replacing it", name, reason)
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)
    return True


@atexit.register
def _unlink_owned() -> None:
    """The owner unlinks its segments on exit (a forked child inherits no ownership)."""
    me = os.getpid()
    for name, pid in list(_owned.items()):
        if pid == me:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(name)
    _owned.clear()


def stripe_sums(words: Words, first: int, counters: int) -> list[int]:
    """The first `counters` words of the per-process counter stripes (STRIPES stripes of
    STRIPE_WORDS words from word `first`), each summed across the stripes."""
    sums = [0] * counters
    for stripe in range(STRIPES):
        base = first + stripe * STRIPE_WORDS
        for i in range(counters):
            sums[i] += words.load(base + i)
    return sums
