"""The site table: per-site politeness, shared by every worker, enforced where a lease is
granted.

A site is a key's host (`shm.keys.site_of`) or a name a route gives; its 64-bit hash
(`shm.keys.site_hash`) keys this table. Per site: its own settings (max in flight, min
interval between grants; else the node's defaults), a block (until when, and why: an
origin's Retry-After or a streak of failed renders), the time of its last grant, its
failure streak and failure-block length, and its permits. Fixed capacity, open
addressing, an 8-slot probe window from the site hash's position; the keys and state
words sit in arrays of their own, so a window is a cache line or two. No mutex: every
change is a compare-and-swap on one word, in C (`shm._atomics.Sites`).

**Timed permits** make the cap exact across processes and safe against SIGKILL. A site
with cap N has N permit words, each 0 (free) or the expiry of the lease it covers:

- A grant first takes a permit (a CAS from a free or expired word to the lease's expiry,
  `now + lease_ms`), then counts the site's live permits again; of two claimants racing
  for the last permit the later CAS sees the earlier one's word and gives its own back,
  so the count never passes the cap. Only then is the lease CASed (`LeaseTable.grant`),
  with the same `now` and length, so the permit's word is the lease's expiry.
- A renewal moves the permit's word before the lease's when it extends it, after when it
  shortens it; completion, failure and hand-back end the lease first, then free the
  permit. So a permit never ends before its lease, and a claimant killed at any point
  leaves at worst a permit that expires with (or shortly after) its lease: nothing leaks
  for longer than a lease.
- Permits carry no owner: two with one word are interchangeable, and freeing either
  leaves the others covering the leases left. A stale release (the lease already over)
  can only free words that have expired anyway.
- Lowering a cap below the permits live admits nothing until the count drops below the
  new cap (every take counts all of a site's words); raising it lets more words be
  taken, each under the same count. A site's words are `permits` (the table's
  `permits_per_site`), the highest cap it can be given.

**Spacing** (`min_interval_ms`): a grant moves the site's last-grant word to now by CAS,
only if now is at least the interval past it, so the times of two grants of a site are
never closer than the interval.

**Blocks** only grow (a CAS to a later end). A completion's `site_retry_after_s` blocks
the site for that long (`block`); `outcome` counts failed renders in a row across the
site's keys and blocks it on the streak's limit'th, doubling the block each time until a
success (docs/decisions/0011-site-caps-by-timed-permits.md says why the defaults).

**Entries.** A site needs an entry only when it has settings, a block, live permits, a
spacing or failure memory (with a default cap every site that is granted does). A
window with no room refuses a grant that needs an entry (`table_full`): the cap is a promise
to an origin, so it fails closed. A sweep (one process at a time, elected by CAS, the
supervisor's) empties entries idle for `keep_ms`: it parks the entry, checks it again and
empties or restores it; an operation verifies the entry's state word after its CAS and
gives back what it wrote if the entry was parked meanwhile. Two inserts of one site
racing a removal in its window can leave it two entries; every decision reads all of
them (permits summed, the newest settings, the latest block and grant), so nothing
depends on there being one.

`allowances` tells the keeper, for many sites in one call, how many more grants each
can take now, so its publish does not fill the ring with keys of a full site.
"""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt

from shm._atomics import SITE_LAYOUT, STRIPE_WORDS, Sites, Words
from shm.segment import HEADER_BYTES, Segment, align

KIND = "site_table"
PROBE_WINDOW = SITE_LAYOUT["probe"]
MAX_IN_FLIGHT = SITE_LAYOUT["cap_max"]  # the most permits a site can have
MAX_INTERVAL_MS = SITE_LAYOUT["interval_max"]
BODY_HEAD_WORDS = SITE_LAYOUT["body_head"]
MAX_CAPACITY = 1 << 26

_CTRL = HEADER_BYTES
_SLOTS = align(_CTRL + SITE_LAYOUT["ctrl_words"] * 8)
_W = _CTRL // 8

SkipReason = Literal["capped", "spacing", "blocked", "table_full"]
BlockReason = Literal["retry_after", "failures"]
# What a configure did: put the settings in force, found newer ones in force (they stay),
# or found no room for the site's entry.
Configured = Literal["in_force", "superseded", "no_room"]
_CONFIGURED: dict[int, Configured] = {1: "in_force", -1: "superseded", 0: "no_room"}
_GRANTED = SITE_LAYOUT["granted"]
_PERMIT = SITE_LAYOUT["permit"]
_SKIPS: dict[int, SkipReason] = {
    SITE_LAYOUT["capped"]: "capped",
    SITE_LAYOUT["spacing"]: "spacing",
    SITE_LAYOUT["blocked"]: "blocked",
    SITE_LAYOUT["full"]: "table_full",
}
_BLOCK_CODES: dict[BlockReason, int] = {
    "retry_after": SITE_LAYOUT["reason_retry_after"],
    "failures": SITE_LAYOUT["reason_failures"],
}
_BLOCK_REASONS = {code: reason for reason, code in _BLOCK_CODES.items()}
PERMIT_ONLY = SITE_LAYOUT["permit_only"]


def table_size(capacity: int, permits: int) -> int:
    return align(_SLOTS + capacity * 8 * (2 + BODY_HEAD_WORDS + permits))


class FailurePolicy(msgspec.Struct, frozen=True, kw_only=True):
    """Failed renders in a row (across a site's keys) that block the site: `streak` of
    them within `window_ms` of the first, for `block_ms`, doubled on each repeat up to
    `block_max_ms`, until a success. `streak` 0: never."""

    streak: int = 5
    window_ms: int = 60_000
    block_ms: int = 60_000
    block_max_ms: int = 1_800_000


class Acquired(msgspec.Struct, frozen=True):
    """A grant may go ahead. `expires_at`: the permit's word (the lease must end there), 0
    when the site has no cap; `previous_last`: the site's last grant before this one, -1
    when it has no spacing; both for `undo`."""

    site_hash: int
    now: int
    expires_at: int
    previous_last: int


class Skipped(msgspec.Struct, frozen=True):
    reason: SkipReason
    until: int  # when the block or spacing ends, or the earliest permit does; 0 if unknown


class SiteInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One site at `now`. `max_in_flight` and `min_interval_ms` are in force (the site's
    own, else the node's default; None: uncapped); `*_set` say whether they are the
    site's own."""

    site_hash: int
    entries: int
    max_in_flight: int | None
    max_in_flight_set: bool
    min_interval_ms: int
    min_interval_set: bool
    in_flight: int  # live permits
    next_permit_free_at: int  # the earliest live permit's end, 0 if none
    blocked_until: int  # 0 if never blocked
    blocked_reason: BlockReason | None
    last_grant_at: int
    failure_streak: int
    failure_block_ms: int  # the last failure block's length, doubled by the next
    grants: int
    skips: int


class SiteBlock(msgspec.Struct, frozen=True):
    """A site blocked until `until` (ms) for `reason`."""

    site_hash: int
    until: int
    reason: BlockReason


class SiteStatistics(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int
    permits_per_site: int
    default_max_in_flight: int | None
    default_min_interval_ms: int
    entries: int  # live entries
    grants: int  # grants that passed a site's cap or spacing
    permits_taken: int
    skips_capped: int
    skips_spacing: int
    skips_blocked: int
    skips_full: int
    releases: int
    extends: int
    conflicts: int  # takes given back: racing claimants would have passed a cap
    undone: int  # acquisitions given back because their lease grant failed
    blocks_retry_after: int
    blocks_failures: int
    inserts: int
    reclaimed: int
    sweeps: int


class SiteTable:
    """Use `create` (the owner: the supervisor) or `attach` (any spawned process)."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.name = segment.name
        self.capacity = segment.capacity
        self.permits = segment.extra_size
        self._words = segment.register(Words(segment.mmap))
        self._c = segment.register(Sites(segment.mmap, _CTRL, _SLOTS, self.capacity, self.permits))
        # The C calls themselves, for the lease table's grant (shm.leases): a Python frame
        # and a Struct per key would be a third of a grant's cost.
        self.acquire_codes = self._c.acquire
        self.undo_codes = self._c.undo
        # The table itself, for the lease table's batch grant, which calls it inside C.
        self.c_table = self._c

    @classmethod
    def create(
        cls,
        name: str,
        capacity: int = 1 << 14,
        permits: int = 64,
        *,
        default_max_in_flight: int | None = None,
        default_min_interval_ms: int = 0,
        failures: FailurePolicy | None = None,
    ) -> SiteTable:
        if not PROBE_WINDOW <= capacity <= MAX_CAPACITY:
            raise ValueError(f"site table capacity must be in {PROBE_WINDOW}..{MAX_CAPACITY}")
        if not 1 <= permits <= MAX_IN_FLIGHT:
            raise ValueError(f"permits per site must be in 1..{MAX_IN_FLIGHT}")
        if default_max_in_flight is not None and not 1 <= default_max_in_flight <= permits:
            raise ValueError(
                f"the default max in flight ({default_max_in_flight}) must be in 1..{permits} "
                "(the permits a site has)"
            )
        if not 0 <= default_min_interval_ms <= MAX_INTERVAL_MS:
            raise ValueError(f"the default min interval must be in 0..{MAX_INTERVAL_MS} ms")
        policy = failures or FailurePolicy()
        segment = Segment.create(
            name, KIND, table_size(capacity, permits), capacity, permits, BODY_HEAD_WORDS * 8
        )
        table = cls(segment)
        words = table._words
        words.store(_W + SITE_LAYOUT["default_cap"], (default_max_in_flight or -1) + 1)
        words.store(_W + SITE_LAYOUT["default_interval"], default_min_interval_ms)
        words.store(_W + SITE_LAYOUT["fail_streak"], policy.streak)
        words.store(_W + SITE_LAYOUT["fail_window"], policy.window_ms)
        words.store(_W + SITE_LAYOUT["fail_block"], policy.block_ms)
        words.store(_W + SITE_LAYOUT["fail_block_max"], max(policy.block_max_ms, policy.block_ms))
        return table

    @classmethod
    def attach(cls, name: str) -> SiteTable:
        return cls(Segment.attach(name, KIND, BODY_HEAD_WORDS * 8, table_size))

    @property
    def default_max_in_flight(self) -> int | None:
        stored = int(self._words.load(_W + SITE_LAYOUT["default_cap"]))
        return stored - 1 if stored else None

    @property
    def default_min_interval_ms(self) -> int:
        return int(self._words.load(_W + SITE_LAYOUT["default_interval"]))

    # ------------------------------------------------------------ claim path

    def acquire(self, site_hash: int, now_ms: int, lease_ms: int) -> Acquired | Skipped:
        """Before a lease on a key of the site: a permit until now + lease_ms (a capped
        site) and the spacing, or why the key is skipped. Site hash 0: always granted."""
        code, until, previous = self._c.acquire(site_hash, now_ms, lease_ms, 0)
        if code in (_PERMIT, _GRANTED):
            return Acquired(site_hash, now_ms, until, previous)
        return Skipped(_SKIPS[code], until)

    def undo(self, acquired: Acquired) -> None:
        """Give back an acquisition whose lease grant failed."""
        self._c.undo(acquired.site_hash, acquired.expires_at, acquired.now, acquired.previous_last)

    def take_permit(self, site_hash: int, now_ms: int, lease_ms: int) -> int:
        """A permit until now + lease_ms under the cap alone (no spacing, no block): a
        renewal whose permit is gone. Its expiry, or 0 if the site is full."""
        code, until, _ = self._c.acquire(site_hash, now_ms, lease_ms, PERMIT_ONLY)
        return int(until) if code == _PERMIT else 0

    def release(self, site_hash: int, expires_at: int) -> bool:
        """Free the permit of a lease that ended; its word is the lease's expiry."""
        return bool(self._c.release_permit(site_hash, expires_at))

    def extend(self, site_hash: int, expires_at: int, new_expires_at: int) -> bool:
        """Move a permit's word (a renewal); False if the site has no permit at that word."""
        return bool(self._c.extend(site_hash, expires_at, new_expires_at))

    # ------------------------------------------------------- settings, blocks

    def configure(
        self, site_hash: int, max_in_flight: int | None, min_interval_ms: int | None
    ) -> bool:
        """A site's own settings, newer than any in force; None for either: the node's
        default. False if the site needed an entry and its window had no room."""
        return self.configure_as_of(site_hash, max_in_flight, min_interval_ms, 0) != "no_room"

    def reserve_version(self) -> int:
        """The latest settings version; any `configure` after this call takes a newer one.
        Settings read from the store after it and written with it (`configure_as_of`)
        never overwrite newer ones another process put in force meanwhile. Reserving
        moves no version, so it may be done as often as the keeper drains its feed."""
        version: int = self._c.reserve_version()
        return version

    def configure_as_of(
        self,
        site_hash: int,
        max_in_flight: int | None,
        min_interval_ms: int | None,
        version: int,
    ) -> Configured:
        """`configure` with a reserved version (0: a new one): `superseded` when settings
        of a newer version are in force, which stay."""
        done = self._c.configure(
            site_hash,
            -1 if max_in_flight is None else max_in_flight,
            -1 if min_interval_ms is None else min_interval_ms,
            version,
        )
        return _CONFIGURED[done]

    def block(self, site_hash: int, until_ms: int, reason: BlockReason) -> int:
        """Block the site until `until_ms` (a longer block stays); the block's end, 0 if the
        site had no entry and its window no room."""
        return int(self._c.block(site_hash, until_ms, _BLOCK_CODES[reason]))

    def outcome(self, site_hash: int, now_ms: int, *, failed: bool) -> int:
        """A render's outcome at the site: a success ends its failure streak; a failure
        extends it, and the streak's limit'th blocks the site. The end of a block this
        started, or 0."""
        return int(self._c.outcome(site_hash, now_ms, failed))

    # ------------------------------------------------------------------ reads

    def allowances(self, site_hashes: npt.NDArray[np.uint64], now_ms: int) -> npt.NDArray[np.int64]:
        """How many more grants each site can take now (one C call): -1 unlimited; 0 when
        blocked, inside its spacing or with every permit live; else its free permits, at
        most 1 for a site with a spacing. Site hash 0 (no site): -1."""
        hashes = np.ascontiguousarray(site_hashes, dtype=np.uint64)
        out = np.empty(hashes.shape[0], dtype=np.int64)
        self._c.allowances(hashes, out, now_ms)
        return out

    def info(self, site_hash: int, now_ms: int) -> SiteInfo:
        (
            entries,
            cap_set,
            cap,
            interval_set,
            interval,
            in_flight,
            soonest,
            until,
            reason,
            last,
            streak,
            penalty,
            grants,
            skips,
        ) = self._c.info(site_hash, now_ms)
        return SiteInfo(
            site_hash=site_hash,
            entries=entries,
            max_in_flight=None if cap < 0 else cap,
            max_in_flight_set=bool(cap_set),
            min_interval_ms=interval,
            min_interval_set=bool(interval_set),
            in_flight=in_flight,
            next_permit_free_at=soonest,
            blocked_until=until,
            blocked_reason=_BLOCK_REASONS.get(reason),
            last_grant_at=last,
            failure_streak=streak,
            failure_block_ms=penalty,
            grants=grants,
            skips=skips,
        )

    def blocks(self, now_ms: int) -> list[SiteBlock]:
        """Every site blocked past `now_ms`: a scan of the entries' site hashes, then each
        site read as `info` reads it (every entry of it). What a node hands over with the
        sites it no longer owns."""
        keys = np.frombuffer(
            self._segment.mmap, dtype=np.uint64, count=self.capacity, offset=_SLOTS
        )
        try:
            sites = np.unique(keys[keys != 0]).tolist()
        finally:
            del keys
        found: list[SiteBlock] = []
        for site in sites:
            until, reason = self._c.info(site, now_ms)[7:9]
            named = _BLOCK_REASONS.get(reason)
            if until > now_ms and named is not None:
                found.append(SiteBlock(site, until, named))
        return found

    def sweep(self, now_ms: int, keep_ms: int = 60_000) -> int:
        """Empty entries idle for `keep_ms` (nothing set, blocked, live or remembered); 0 if
        another process is sweeping."""
        reclaimed: int = self._c.sweep(now_ms, keep_ms)
        return max(reclaimed, 0)

    def statistics(self) -> SiteStatistics:
        sums = self._c.totals()
        assert len(sums) == STRIPE_WORDS

        def total(name: str) -> int:
            return int(sums[SITE_LAYOUT[f"s_{name}"]])

        return SiteStatistics(
            capacity=self.capacity,
            permits_per_site=self.permits,
            default_max_in_flight=self.default_max_in_flight,
            default_min_interval_ms=self.default_min_interval_ms,
            entries=max(total("live"), 0),
            grants=total("grants"),
            permits_taken=total("permits"),
            skips_capped=total("capped"),
            skips_spacing=total("spacing"),
            skips_blocked=total("blocked"),
            skips_full=total("full"),
            releases=total("releases"),
            extends=total("extends"),
            conflicts=total("conflicts"),
            undone=total("undone"),
            blocks_retry_after=total("blocks_retry_after"),
            blocks_failures=total("blocks_failed"),
            inserts=total("inserts"),
            reclaimed=total("reclaimed"),
            sweeps=total("sweeps"),
        )

    # ---------------------------------------------------------------- closing

    def close(self) -> None:
        """Release the C views, then unmap. Idempotent; never raises BufferError."""
        self._segment.close()

    def unlink(self) -> None:
        self._segment.unlink()

    def __enter__(self) -> SiteTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
