"""The supervisor's side of cluster membership: join, heartbeat, leave.

The supervisor outlives its workers (a respawned worker 0 reloads; the node stays a
member meanwhile), so it keeps the node's row: it joins before any worker spawns,
heartbeats on a thread of its own every `heartbeat_s`, and on a clean stop leaves once
its workers have exited, saying when its last lease ends. A heartbeat that finds the
row gone or taken joins again. Which keys the node owns is the keeper's business: it
reads the member list itself.
"""

from __future__ import annotations

import logging
import threading

import msgspec

from shm.segment import now_ms
from store.errors import StoreError
from store.postgres.membership import Membership
from workers import logs

log = logs.get_logger("membership")


class MembershipStatistics(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    url: str
    joined_at: int  # epoch ms (0: not joined)
    heartbeats: int
    failures: int  # heartbeats that failed (the store was unreachable)
    rejoins: int  # heartbeats that found the row gone and joined again
    last_heartbeat_at: int  # epoch ms of the last heartbeat that landed (0: none)
    left: bool


class MembershipHeartbeat:
    def __init__(self, membership: Membership, interval_s: float) -> None:
        self.membership = membership
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._joined_at = 0
        self._heartbeats = self._failures = self._rejoins = 0
        self._last = 0
        self._left = False

    def join(self) -> None:
        """Join now (raises NameTaken or the store's error), then heartbeat on a thread."""
        self.membership.join()
        self._joined_at = self._last = now_ms()
        logs.event(
            log,
            "cluster_joined",
            node=self.membership.node,
            url=self.membership.advertised_url,
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if not self.membership.heartbeat():
                    self.membership.join()
                    self._rejoins += 1
                    logs.event(log, "cluster_rejoined", logging.WARNING, node=self.membership.node)
                self._heartbeats += 1
                self._last = now_ms()
            except StoreError as exc:
                self._failures += 1
                logs.event(log, "heartbeat_failed", logging.WARNING, error=str(exc))
            except Exception:  # never let the thread die: the node would look dead
                self._failures += 1
                log.exception("heartbeat failed")

    def leave(self, lease_horizon_ms: int) -> None:
        """Stop heartbeating and leave; the others take this node's keys after the horizon."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if not self._joined_at:
            return
        try:
            self.membership.leave(lease_horizon_ms)
            self._left = True
            logs.event(
                log,
                "cluster_left",
                node=self.membership.node,
                lease_horizon_ms=lease_horizon_ms,
            )
        except StoreError as exc:
            # The row ages out instead: the others wait a TTL more before taking over.
            logs.event(log, "leave_failed", logging.WARNING, error=str(exc))
        finally:
            self.membership.close()

    def statistics(self) -> MembershipStatistics:
        return MembershipStatistics(
            node=self.membership.node,
            url=self.membership.advertised_url,
            joined_at=self._joined_at,
            heartbeats=self._heartbeats,
            failures=self._failures,
            rejoins=self._rejoins,
            last_heartbeat_at=self._last,
            left=self._left,
        )
