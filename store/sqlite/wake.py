"""Commit wake-ups across processes: a hint that the feed may have moved, never the truth.

Each open subscription owns one POSIX semaphore, under a fresh name kept in
its consumer's `feed_consumers` row, and unlinks it when it closes (or its
consumer's next subscription does, after a crash). A writer posts every consumer's semaphore
after each commit, but only when its value is 0: the consumer polls after each
wake, so one pending post covers any number of commits, and the count of a
consumer that is gone stays bounded at 1. The consumer-side `wait` falls back
to `PRAGMA data_version` polling (in the subscription), so a lost or late post
costs latency, never an event.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import threading
import time

import msgspec
import posix_ipc

_PREFIX_CHARS = re.compile(r"/?[A-Za-z0-9._-]{1,100}")
REFRESH_S = 0.1  # how stale a writer's list of consumers' semaphores may get


class WakeStatistics(msgspec.Struct, frozen=True, kw_only=True):
    targets: int  # consumers' semaphores this writer posts
    posts: int  # posts made (a post is skipped while one is pending)
    skipped: int  # posts skipped because the consumer had one pending already
    refreshes: int
    errors: int  # semaphores that could not be opened or posted (a consumer dropped meanwhile)


def wake_prefix(path: str | os.PathLike[str], wake_name: str | None) -> str:
    """The common start of this database's semaphore names."""
    if wake_name is not None:
        if _PREFIX_CHARS.fullmatch(wake_name) is None:
            raise ValueError(
                f"wake_name {wake_name!r}: at most 100 of A-Z a-z 0-9 . _ -, optionally after '/'"
            )
        return "/" + wake_name.lstrip("/")
    digest = hashlib.blake2b(os.fsencode(os.path.realpath(path)), digest_size=6).hexdigest()
    return f"/rq.{digest}"


def new_wake_name(prefix: str) -> str:
    """A fresh name per registration, so a writer never keeps posting a dropped semaphore."""
    return f"{prefix}.{secrets.token_hex(4)}"


def unlink(name: str) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_semaphore(name)


class WakeWaiter:
    """The consumer's end: made by each subscription, unlinked when it closes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._semaphore = posix_ipc.Semaphore(name, posix_ipc.O_CREAT, initial_value=0)

    def wait(self, timeout_s: float) -> bool:
        try:
            self._semaphore.acquire(max(0.0, timeout_s))
        except posix_ipc.BusyError:
            return False
        return True

    def take(self) -> bool:
        """Take a pending post without waiting; whether there was one."""
        if self._semaphore.value:  # cheap, where a refused acquire raises
            try:
                self._semaphore.acquire(0)
            except posix_ipc.BusyError:
                return False
            return True
        return False

    def clear(self) -> None:
        """Take a pending post without waiting: the poll about to run covers its commit."""
        self.take()

    def close(self) -> None:
        self._semaphore.close()


def open_waiter(name: str) -> WakeWaiter | None:
    """The consumer's semaphore, or None where POSIX semaphores are unavailable."""
    try:
        return WakeWaiter(name)
    except (posix_ipc.Error, OSError):
        return None


class WakePoster:
    """The writer's end: posts every registered consumer after a commit. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._targets: dict[str, posix_ipc.Semaphore] = {}
        self._posting: tuple[posix_ipc.Semaphore, ...] = ()
        self._refreshed_at = -1.0
        self._posts = 0
        self._skipped = 0
        self._refreshes = 0
        self._errors = 0

    def due(self) -> bool:
        return time.monotonic() - self._refreshed_at >= REFRESH_S

    def refresh(self, names: list[str]) -> None:
        """Post exactly these semaphores from now on (opening new ones, closing dropped ones)."""
        with self._lock:
            self._refreshed_at = time.monotonic()
            self._refreshes += 1
            wanted = set(names)
            for name in [n for n in self._targets if n not in wanted]:
                self._targets.pop(name).close()
            for name in wanted.difference(self._targets):
                try:
                    self._targets[name] = posix_ipc.Semaphore(name)
                except posix_ipc.ExistentialError:
                    # Its consumer has not created it yet, or was dropped: next refresh.
                    self._errors += 1
            self._posting = tuple(self._targets.values())

    def post(self) -> None:
        for semaphore in self._posting:
            try:
                if semaphore.value == 0:
                    semaphore.release()
                    self._posts += 1
                else:
                    self._skipped += 1
            except posix_ipc.Error:
                self._errors += 1

    def statistics(self) -> WakeStatistics:
        return WakeStatistics(
            targets=len(self._posting),
            posts=self._posts,
            skipped=self._skipped,
            refreshes=self._refreshes,
            errors=self._errors,
        )

    def close(self) -> None:
        with self._lock:
            for semaphore in self._targets.values():
                semaphore.close()
            self._targets.clear()
            self._posting = ()
