"""The supervisor's side of cluster membership: join, heartbeat, leave.

The supervisor outlives its workers (a respawned worker 0 reloads; the node stays a
member meanwhile), so it keeps the node's row: it joins before any worker spawns,
heartbeats on a thread of its own every `heartbeat_s`, and on a clean stop leaves once
its workers have exited, handing its live leases over. A heartbeat that finds the row
no longer this incarnation's (taken by a newer start of the name, or gone) never joins
again: the node is superseded and stops, since another process may own its keys. Each
heartbeat also measures this node's clock against the database's, so instants another
node reads (a hand-over's lease ends) are written in the database's clock. Which keys
the node owns is the keeper's business: it reads the member list itself.

The heartbeat vouches for the whole node, so it is withheld while the keeper is silent
(not gone round its loop for a TTL: a stopped or hung worker 0). Such a node grants
nothing, yet the others would leave its share alone as long as its row is fresh; without
its heartbeat they read it as dead and take the share over, fenced by its lease ceiling
as for any silent death. Once the keeper is heard again the heartbeats resume and the
node rejoins as after a network outage.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from shm.leases import LeaseTable
from shm.segment import monotonic_ms, now_ms
from store.errors import StoreError
from store.rows import HandedBlock, Handover
from workers import logs

if TYPE_CHECKING:  # PostgreSQL support is an extra; a SQLite node never loads it
    from store.postgres.membership import Joined, NodeMembership

log = logs.get_logger("membership")


class MembershipStatistics(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    url: str
    joined_at: int  # epoch ms (0: not joined)
    heartbeats: int
    failures: int  # heartbeats that failed (the store was unreachable)
    last_heartbeat_at: int  # epoch ms of the last heartbeat that landed (0: none)
    left: bool
    incarnation: int = 0
    superseded: bool = False  # another start of this name holds the row: the node stops
    clock_offset_ms: int = 0  # the database's clock less this node's, at the last heartbeat
    withheld: int = 0  # heartbeats not sent because the keeper was silent
    keeper_silent_ms: int = 0  # how long the keeper has not been heard (0: heard lately)


class MembershipHeartbeat:
    def __init__(
        self,
        membership: NodeMembership,
        interval_s: float,
        on_superseded: Callable[[], None] | None = None,
        keeper_heard_at: Callable[[], int] | None = None,
        keeper_silence_ms: int = 0,
    ) -> None:
        """`keeper_heard_at`: when (CLOCK_MONOTONIC ms) the keeper was last heard; a
        heartbeat is withheld while that is more than `keeper_silence_ms` ago."""
        self.membership = membership
        self.interval_s = interval_s
        self._on_superseded = on_superseded
        self._keeper_heard_at = keeper_heard_at
        self._keeper_silence_ms = keeper_silence_ms
        self._withheld = 0
        self._withholding = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._joined_at = 0
        self._heartbeats = self._failures = 0
        self._last = 0
        self._left = False
        self.superseded = False
        self.offset_ms = 0

    def join(self) -> Joined:
        """Join now (raises NameTaken, SettingsDiffer or the store's error), measure the
        clocks, then heartbeat on a thread."""
        joined = self.membership.join()
        self._joined_at = self._last = now_ms()
        self._measure(self.membership.db_now_ms(), self._joined_at)
        logs.event(
            log,
            "cluster_joined",
            node=self.membership.node,
            url=self.membership.advertised_url,
            incarnation=joined.incarnation,
            replaced=None if joined.predecessor is None else joined.predecessor.incarnation,
            settings_set=joined.settings_set,
            clock_offset_ms=self.offset_ms,
            withheld=self._withheld,
            keeper_silent_ms=self.keeper_silent_ms(),
        )
        self._thread.start()
        return joined

    def _measure(self, db_ms: int, sent: int) -> None:
        """The offset of the database's clock, read between `sent` and now, taken at the
        round trip's midpoint."""
        self.offset_ms = db_ms - (sent + now_ms()) // 2

    def keeper_silent_ms(self) -> int:
        """How long the keeper has not been heard; 0 while it is within its limit."""
        if self._keeper_heard_at is None:
            return 0
        silent = monotonic_ms() - self._keeper_heard_at()
        return silent if silent > self._keeper_silence_ms else 0

    def _withhold(self) -> bool:
        """Whether to skip this heartbeat for a silent keeper; says so on each change."""
        silent = self.keeper_silent_ms()
        if silent and not self._withholding:
            logs.event(
                log,
                "heartbeat_withheld",
                logging.WARNING,
                node=self.membership.node,
                keeper_silent_ms=silent,
                detail="the keeper has not gone round its loop for longer than the node TTL: "
                "the node stops vouching for itself, so the others take its share over",
            )
        elif not silent and self._withholding:
            logs.event(log, "heartbeat_resumed", node=self.membership.node)
        self._withholding = bool(silent)
        if silent:
            self._withheld += 1
        return bool(silent)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._withhold():
                continue
            try:
                sent = now_ms()
                beat = self.membership.heartbeat()
                if beat.superseded:
                    self.superseded = True
                    logs.event(
                        log,
                        "cluster_superseded",
                        logging.ERROR,
                        node=self.membership.node,
                        incarnation=self.membership.incarnation,
                        detail="this node's row is gone or belongs to a newer start of its "
                        "name: this process grants nothing more and stops",
                    )
                    if self._on_superseded is not None:
                        self._on_superseded()
                    return
                self._measure(beat.db_now_ms, sent)
                self._heartbeats += 1
                self._last = now_ms()
            except StoreError as exc:
                self._failures += 1
                logs.event(log, "heartbeat_failed", logging.WARNING, error=str(exc))
            except Exception:  # never let the thread die: the node would look dead
                self._failures += 1
                log.exception("heartbeat failed")

    def leave(self, leases: LeaseTable) -> None:
        """Stop heartbeating and leave, handing over the live leases: the others fence
        exactly those keys, each until its lease ends."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if not self._joined_at or self.superseded:
            return
        try:
            now = now_ms()
            hashes, expiries, sites, tokens = leases.live_leases(now)
            # Owned by site, the sites' blocks go with them (each is this node's alone).
            table = leases.sites if self.membership.ownership == "site" else None
            handover = Handover(
                node=self.membership.node,
                incarnation=self.membership.incarnation,
                key_hashes=hashes.tolist(),
                expires_at_ms=(expiries + self.offset_ms).tolist(),
                site_hashes=sites.tolist(),
                tokens=tokens.tolist(),
                blocks=[
                    HandedBlock(block.site_hash, block.until + self.offset_ms, block.reason)
                    for block in (table.blocks(now) if table is not None else [])
                ],
            )
            self.membership.leave(handover)
            self._left = True
            logs.event(
                log,
                "cluster_left",
                node=self.membership.node,
                handed_over=len(handover.key_hashes),
                site_blocks=len(handover.blocks),
                lease_horizon_ms=max(handover.expires_at_ms, default=0),
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
            last_heartbeat_at=self._last,
            left=self._left,
            incarnation=self.membership.incarnation,
            superseded=self.superseded,
            clock_offset_ms=self.offset_ms,
            withheld=self._withheld,
            keeper_silent_ms=self.keeper_silent_ms(),
        )
