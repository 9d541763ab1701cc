"""The lease table: exclusive grants and hold-back state, shared by every worker.

Fixed capacity, open addressing, a bounded window of 8 slots starting at the
key hash's position. No mutex: every change is a compare-and-swap on one
slot's 64-bit state word, done in C (`shm._atomics.Leases`) so a grant is one
call over the whole window.

A slot is (key hash, state, hold, spare), 32 bytes (`SLOT`). The state word
packs phase (free, leased, held, removing), misses, a 16-bit token and a time
(lease expiry or hold end, epoch ms), so the decision "is this key's lease
live?" and the change "grant it" are the same word:

- **Grant** reads the window; a live lease refuses (`taken`), a hold refuses
  (`held`), a window with neither the key nor an empty slot refuses
  (`probe_full`, which can happen well below 100% occupancy). Otherwise one CAS
  takes the key's slot (inserting the key first by CAS on an empty slot's key
  word). Exactly one claimant wins while a lease is live. Two claimants that
  insert the same key at the same moment can land in two slots; the winner of a
  grant re-reads the key's other slots and backs off if one holds a live lease,
  which makes at most one of two racing grants survive.
- **Tokens** fence renew and complete: the token names the slot and the grant
  (slot index << 16 | 16-bit counter). A stale token matches nothing live and
  changes nothing.
- **Hold-back**: a lease that expires with no result (noticed lazily, at grant
  or sweep) raises the key's misses and holds the key back from its expiry for
  min(2**misses * lease, cadence): 2 lease lengths, then 4, 8, ... capped at
  the cadence. `complete` (a result: rendered, failed, gone) resets the misses.
  `state` and `blocked_mask` read an expired, unanswered lease as the hold it
  will become, without writing.
- **Failures back off**: `fail` (a `failed` result) ends the lease and holds the
  key back from now as an unanswered expiry would, raising the misses, so a page
  that always fails is retried after 2 lease lengths, then 4, 8, ... capped at
  its cadence, not at every publish. Only `complete` (rendered, gone) resets it;
  `forgive` (an operator's "render now") ends a key's hold and its misses.
- **Reclaiming** empties a slot in three steps: CAS its state word to `removing`
  (stamped with the remover's pid), clear the key, then give the state word a
  stamp never used before. A grant can never start on a `removing` slot, so a
  live lease is never broken, and a claimant that read the slot before it was
  emptied can never CAS it afterwards (no ABA): that is why the state word is
  always read before the key. A grant that finds its window full takes a slot
  another key no longer needs (a completed lease, or a hold that ended
  `KEEP_MISSES_MS` ago) this way itself; the **sweep** (one process at a time,
  elected by a CAS on a pid word; a dead sweeper's claim is taken over) walks
  the whole table: it settles expired leases, reclaims completed slots and
  holds that ended `keep_misses_ms` ago, and finishes removals whose remover
  died between its steps.

The window is bounded and probing is linear, so clusters fill windows early:
with random keys and no completed slots to take, the first `probe_full` comes
well below half occupancy, and refusals grow with it (`python -m bench.shm`
measures them; bench/results/shm.json). Size the table well above the leases in flight
plus the keys held back, and sweep it (the keeper, every few seconds).

A claimant SIGKILLed at any point leaves at worst a lease that expires on time,
an inserted key with no lease, or a half-emptied slot; the next sweep reclaims
the last two.

**Tag lanes** (a byte per slot beside the slots, 1/32 of their size): a grant sets
bit (hash & 7) of the key in its slot's lane before the CAS that leases it, and
only a removal clears a lane, while the slot is parked. A window whose eight lanes
lack a key's bit holds no lease or hold of it, so `blocked_mask` probes only the
few keys whose bit is set somewhere in their window: the keeper asks about every
candidate of a publish, nearly all of them absent from the table.

**Live counters** (occupied, leased, held) are kept by the ops with atomic adds,
in each process's counter stripe (its own cache lines, so claimants on two cores
never bounce one line), so `statistics()` sums a few words instead of scanning the
table. They count states, not time: an expired, unanswered lease
stays leased and an ended hold stays held until a grant of the key or a sweep
settles it; after a sweep at `now` they equal `census(now)`, the full scan. A
process killed between a CAS and its count can leave a counter one off;
`recount()` rebuilds counters and lanes from the slots (after an import).

**Sites** (shm/sites.py): a table given a `SiteTable` (`use_sites`) takes a key's site
permit and spacing before the lease's CAS (`grant(..., site_hash=)`; a skipped key is a
`Refusal` with the site's reason) and gives them back if the CAS fails. A site word per
slot, beside the slots, names the site of the key its grant's winner leased, and a bit of
the hold word says whether the lease holds a permit, so renewals move the permit with
the lease (before it when extending, after it when shortening) and results free it after
the lease ends: a permit never ends before its lease. `lease_site` tells a completion
which site its outcome counts for. A table whose slots were imported (a snapshot, a
survivor) holds no permits of the new site table: the import clears the bits.

**The secret's fingerprint**: the creator records which hash secret the keys are hashed
under (`shm.keys.fingerprint`, in a control word), so the next start of a node killed
whole can tell whether the table it left is keyed as its own before adopting its slots
(shm/lease_survivor.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from shm._atomics import LEASE_LAYOUT, SITE_LAYOUT, Leases, Words
from shm.keys import fingerprint
from shm.lease_journal import GRANTED, LeaseJournal
from shm.segment import HEADER_BYTES, Segment, align
from shm.segment import now_ms as wall_clock_ms

if TYPE_CHECKING:
    from shm.sites import SiteTable

KIND = "lease_table"
PROBE_WINDOW = LEASE_LAYOUT["probe"]
# "reserved" is the counted-hold word (SLOT_COUNTED in csrc/leases.c): which HELD state
# word the live held counter includes. recount() rewrites it, so a copy may carry any.
SLOT = np.dtype([("key_hash", "<u8"), ("state", "<u8"), ("hold", "<u8"), ("reserved", "<u8")])
SLOT_WORDS = LEASE_LAYOUT["slot_words"]
assert SLOT.itemsize == SLOT_WORDS * 8
_STATE_WORD = 1  # the state word's index in a slot (SLOT)
# Misses of a hold that ended this long ago are forgotten (by a sweep, or by a grant
# that needs the slot).
KEEP_MISSES_MS = LEASE_LAYOUT["keep_misses_ms"]

_CTRL = HEADER_BYTES
_SLOTS = align(_CTRL + LEASE_LAYOUT["ctrl_words"] * 8)
RefusalReason = Literal[
    "taken", "held", "probe_full", "site_capped", "site_spacing", "site_blocked", "site_full"
]
_REASONS: dict[int, RefusalReason] = {
    LEASE_LAYOUT["refused_taken"]: "taken",
    LEASE_LAYOUT["refused_held"]: "held",
    LEASE_LAYOUT["refused_probe_full"]: "probe_full",
}
_GRANTED = LEASE_LAYOUT["granted"]
_SECRET_PRINT_WORD = _CTRL // 8 + LEASE_LAYOUT["secret_print"]
_PHASE_LEASED = 1  # PH_LEASED in csrc/leases.c
_HOLD_PERMIT = np.uint64(1 << LEASE_LAYOUT["hold_permit_bit"])
_SITE_PERMIT = SITE_LAYOUT["permit"]
_SITE_REFUSALS: dict[int, RefusalReason] = {
    SITE_LAYOUT["capped"]: "site_capped",
    SITE_LAYOUT["spacing"]: "site_spacing",
    SITE_LAYOUT["blocked"]: "site_blocked",
    SITE_LAYOUT["full"]: "site_full",
}


def _tags_offset(capacity: int) -> int:
    return align(_SLOTS + capacity * SLOT.itemsize)


def _sites_offset(capacity: int) -> int:
    # The tag lanes: a byte per slot, in words, plus one (see LEASE_TAG_WORDS).
    return align(_tags_offset(capacity) + ((capacity + 7) // 8 + 1) * 8)


def table_size(capacity: int, _extra: int = 0) -> int:
    return align(_sites_offset(capacity) + capacity * 8)


class Grant(msgspec.Struct, frozen=True):
    key_hash: int
    token: int
    expires_at: int


class Refusal(msgspec.Struct, frozen=True):
    reason: RefusalReason
    # lease expiry or hold end; for a site's refusal, its block's or spacing's end or its
    # earliest permit's; 0 when there is none (probe_full, site_full)
    until: int


class KeyLeaseState(msgspec.Struct, frozen=True):
    leased: bool
    lease_expires_at: int
    held: bool
    held_until: int
    misses: int


class LeaseStatistics(msgspec.Struct, frozen=True):
    """Counters the ops keep (O(1) to read). Time passing changes no counter: a lease
    that expired unanswered counts as live, and an ended hold as held, until a grant of
    the key or a sweep settles it (the supervisor sweeps every lease_sweep_interval_s,
    10 s by default). `census()` counts the same from a full scan, exact at a time."""

    capacity: int
    occupied: int
    occupancy: float
    live_leases: int  # granted, not yet completed nor settled as expired
    held_keys: int  # holds started, not yet seen ended by a sweep or taken by a grant
    grants: int
    renewals: int
    completions: int
    expiries: int
    hold_events: int  # each expiry with no result that started a hold
    refusals_taken: int
    refusals_held: int
    refusals_probe_full: int
    stale_tokens: int  # renew/complete refused: the token's lease is not live
    inserts: int
    reclaimed: int
    conflicts: int  # grants reverted because a duplicate slot held a live lease
    sweeps: int
    failures: int = 0  # failed results that held their key back (fail)
    forgiven: int = 0  # holds an operator released (forgive)


class LeaseCensus(msgspec.Struct, frozen=True):
    """A full scan of the table at `now` (milliseconds of work on a large table)."""

    now: int
    occupied: int  # slots with a key, removals under way left out
    live_leases: int  # expiry after now
    held_keys: int  # held back at now, expired unanswered leases read as their holds
    expired_unanswered: int
    removing: int  # slots a remover parked (a dead one's are finished by a sweep)


class LeaseTable:
    """Use `create` (the owner) or `attach` (any spawned process)."""

    def __init__(self, segment: Segment) -> None:
        self._segment = segment
        self.name = segment.name
        self.capacity = segment.capacity
        self._words = segment.register(Words(segment.mmap))
        self._c = segment.register(
            Leases(
                segment.mmap,
                _CTRL,
                _SLOTS,
                _tags_offset(self.capacity),
                _sites_offset(self.capacity),
                self.capacity,
            )
        )
        self._sites: SiteTable | None = None
        # Every grant, renewal and end this process makes, when an audit asks for them.
        self.journal: LeaseJournal | None = None

    @classmethod
    def create(
        cls, name: str, capacity: int = 1 << 16, *, secret: bytes | None = None
    ) -> LeaseTable:
        """A fresh table. `secret`: the hash secret its keys are hashed under, recorded by
        its fingerprint so the next start can tell whether a killed run's table is keyed
        as its own (shm/lease_survivor.py); a table made without one is never adopted."""
        if not PROBE_WINDOW <= capacity <= 2**32:
            raise ValueError(f"lease table capacity must be in {PROBE_WINDOW}..2**32")
        table = cls(Segment.create(name, KIND, table_size(capacity), capacity, 0, SLOT.itemsize))
        if secret is not None:
            table._words.store(_SECRET_PRINT_WORD, fingerprint(secret))
        return table

    @classmethod
    def attach(cls, name: str) -> LeaseTable:
        return cls(Segment.attach(name, KIND, SLOT.itemsize, table_size))

    @property
    def secret_print(self) -> int:
        """The fingerprint of the hash secret the creator recorded (shm.keys); 0 if none."""
        return int(self._words.load(_SECRET_PRINT_WORD))

    @property
    def owner_pid(self) -> int:
        return self._segment.owner_pid

    @property
    def created_at(self) -> int:
        return self._segment.created_at

    def use_sites(self, sites: SiteTable | None) -> None:
        """Take and give back site permits and spacing with this table's leases."""
        self._sites = sites

    @property
    def sites(self) -> SiteTable | None:
        return self._sites

    # -------------------------------------------------------------- claim path

    def grant(
        self, key_hash: int, now_ms: int, lease_ms: int, cadence_ms: int, site_hash: int = 0
    ) -> Grant | Refusal:
        """An exclusive lease on the key until now + lease_ms, or why not. With a site
        table and a site, the site's permit and spacing come first (a skip is a Refusal
        with the site's reason) and are given back if the lease is refused."""
        sites = self._sites
        if site_hash and sites is not None:
            taken, expires, previous = sites.acquire_codes(site_hash, now_ms, lease_ms, 0)
            refused = _SITE_REFUSALS.get(taken)
            if refused is not None:
                return Refusal(reason=refused, until=expires)
            code, token, until = self._c.grant(
                key_hash, now_ms, lease_ms, cadence_ms, site_hash, taken == _SITE_PERMIT
            )
            if code != _GRANTED:
                sites.undo_codes(site_hash, expires, now_ms, previous)
        else:
            code, token, until = self._c.grant(
                key_hash, now_ms, lease_ms, cadence_ms, site_hash, False
            )
        if code == _GRANTED:
            if self.journal is not None:
                self.journal.granted(key_hash, token, until)
            return Grant(key_hash=key_hash, token=token, expires_at=until)
        return Refusal(reason=_REASONS[code], until=until)

    def grant_batch(
        self,
        key_hashes: npt.NDArray[np.uint64],
        site_hashes: npt.NDArray[np.uint64],
        cadence_ms: npt.NDArray[np.uint64],
        now_ms: int,
        lease_ms: int,
    ) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """`grant` for each key in order, in one C call: (tokens, expiries), a token 0
        where none was granted (its expiry then the refusal's `until`). A hash of 0 is
        skipped. Site permits and spacing are taken inside the call, as `grant` takes them."""
        hashes = np.ascontiguousarray(key_hashes, dtype=np.uint64)
        tokens = np.empty(hashes.shape[0], dtype=np.uint64)
        expires = np.empty(hashes.shape[0], dtype=np.uint64)
        self._c.grant_batch(
            hashes,
            np.ascontiguousarray(site_hashes, dtype=np.uint64),
            np.ascontiguousarray(cadence_ms, dtype=np.uint64),
            now_ms,
            lease_ms,
            None if self._sites is None else self._sites.c_table,
            tokens,
            expires,
        )
        if self.journal is not None:
            won = np.flatnonzero(tokens)
            if won.size:  # every grant's instant, read after the batch's last CAS
                self.journal.write(
                    GRANTED, hashes[won].tolist(), tokens[won].tolist(), self.journal.clock(),
                    expires[won].tolist(),
                )  # fmt: skip
        return tokens, expires

    def holds(self, key_hash: int, token: int, now_ms: int) -> bool:
        """True while the token's lease is live."""
        return bool(self._c.holds(key_hash, token, now_ms))

    def lease_site(self, key_hash: int, token: int, now_ms: int) -> int | None:
        """The site hash the token's live lease was granted under (0: none), or None if
        the lease is not live."""
        held = self._c.lease_of(key_hash, token, now_ms)
        return None if held is None else int(held[1])

    def renew(self, key_hash: int, token: int, now_ms: int, lease_ms: int) -> int | None:
        """Move the lease's expiry to now + lease_ms; None (nothing changed) if not held.

        A lease holding a site permit moves it along: first the permit when the lease
        grows, first the lease when it shrinks, so the permit never ends before it. A
        permit gone from its word (its site table is newer than the lease, or a renewal
        was killed between its two moves) is taken anew under the cap; when the site is
        full the lease is renewed without one, and no longer frees one at its end."""
        expires = self._renew(key_hash, token, now_ms, lease_ms)
        if expires is not None and self.journal is not None:
            self.journal.renewed(key_hash, token, expires)
        return expires

    def _renew(self, key_hash: int, token: int, now_ms: int, lease_ms: int) -> int | None:
        new = now_ms + lease_ms
        for _ in range(8):
            held = self._c.lease_of(key_hash, token, now_ms)
            sites = self._sites
            if held is None or sites is None or not held[1] or not held[2]:
                expires: int = self._c.renew(key_hash, token, now_ms, lease_ms, 0)
                return None if expires < 0 else expires
            before, site, _ = held
            if new < before:
                expires = self._c.renew(key_hash, token, now_ms, lease_ms, before)
                if expires >= 0:
                    sites.extend(site, before, new)
                    return expires
                continue
            moved = sites.extend(site, before, new)
            fresh = 0 if moved else sites.take_permit(site, now_ms, lease_ms)
            if not moved and not fresh:
                self._c.drop_permit(key_hash, token)
            expires = self._c.renew(key_hash, token, now_ms, lease_ms, before)
            if expires >= 0:
                return expires
            if moved:  # another renewal moved the lease first: put the permit back
                sites.extend(site, new, before)
            elif fresh:
                sites.release(site, fresh)
        return None

    def complete(self, key_hash: int, token: int, now_ms: int) -> bool:
        """A result for the key (or a hand-back): end the lease and reset its misses, then
        free its site permit. False if not held."""
        began = 0 if self.journal is None else self.journal.clock()
        expires, site, permit = self._c.complete(key_hash, token, now_ms)
        if permit and self._sites is not None:
            self._sites.release(site, expires)
        if expires != 0 and self.journal is not None:
            self.journal.ended(key_hash, token, began)
        return expires != 0

    def fail(self, key_hash: int, token: int, now_ms: int) -> int | None:
        """A failed render: end the lease and hold the key back from now as a missed lease
        would (misses + 1), then free its site permit. The hold's end, or None (nothing
        changed) if not held."""
        began = 0 if self.journal is None else self.journal.clock()
        until, expires, site, permit = self._c.fail(key_hash, token, now_ms)
        if permit and self._sites is not None:
            self._sites.release(site, expires)
        if until >= 0 and self.journal is not None:
            self.journal.ended(key_hash, token, began)
        return None if until < 0 else int(until)

    def forgive(self, key_hash: int, now_ms: int) -> int:
        """End the key's holds and forget its misses (an operator's "render now"); a live
        lease is left alone. The number of slots released."""
        released: int = self._c.forgive(key_hash, now_ms)
        return released

    # ------------------------------------------------------------------ keeper

    def state(self, key_hash: int, now_ms: int) -> KeyLeaseState:
        leased, expires, held, held_until, misses = self._c.state(key_hash, now_ms)
        return KeyLeaseState(
            leased=leased,
            lease_expires_at=expires,
            held=held,
            held_until=held_until,
            misses=misses,
        )

    def blocked_mask(self, key_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        """For each hash, True if the key is leased or held now (one C call)."""
        hashes = np.ascontiguousarray(key_hashes, dtype=np.uint64)
        out = np.zeros(hashes.shape[0], dtype=np.bool_)
        self._c.blocked_mask(hashes, out, now_ms)
        return out

    def blocked_until(self, key_hashes: np.ndarray, now_ms: int) -> np.ndarray:
        """For each hash, until when (epoch ms) its key is leased or held: a lease's end,
        or a hold's; 0 if neither now. A lease that ends unanswered may earn a hold, which
        a later call reads (one C call)."""
        hashes = np.ascontiguousarray(key_hashes, dtype=np.uint64)
        out = np.zeros(hashes.shape[0], dtype=np.int64)
        self._c.blocked_until(hashes, out, now_ms)
        return out

    def sweep(self, now_ms: int, keep_misses_ms: int = KEEP_MISSES_MS) -> int:
        """Reclaim dead slots; never breaks a live lease. 0 if another process is sweeping."""
        reclaimed: int = self._c.sweep(now_ms, keep_misses_ms)
        return max(reclaimed, 0)

    def statistics(self, now_ms: int | None = None) -> LeaseStatistics:
        """O(1): the live counters and the per-process stripes; `now_ms` is unused (the
        counters need no clock) and kept for callers that pass it."""
        del now_ms
        occupied, live, held = (max(count, 0) for count in self._c.live())
        sums = self._c.totals()

        def total(name: str) -> int:
            return sums[LEASE_LAYOUT[f"s_{name}"]]

        return LeaseStatistics(
            capacity=self.capacity,
            occupied=occupied,
            occupancy=occupied / self.capacity,
            live_leases=live,
            held_keys=held,
            grants=total("grants"),
            renewals=total("renewals"),
            completions=total("completions"),
            expiries=total("expiries"),
            hold_events=total("hold_events"),
            refusals_taken=total("refused_taken"),
            refusals_held=total("refused_held"),
            refusals_probe_full=total("refused_probe_full"),
            stale_tokens=total("stale_tokens"),
            inserts=total("inserts"),
            reclaimed=total("reclaimed"),
            conflicts=total("conflicts"),
            sweeps=total("sweeps"),
            failures=self._words.load(_CTRL // 8 + LEASE_LAYOUT["failures"]),
            forgiven=self._words.load(_CTRL // 8 + LEASE_LAYOUT["forgiven"]),
        )

    def census(self, now_ms: int | None = None) -> LeaseCensus:
        """Exact counts at `now_ms` from a full scan; for tests and tools, not for paths
        that run often (statistics() is the cheap one)."""
        now = now_ms if now_ms is not None else wall_clock_ms()
        occupied, live, held, expired, removing = self._c.census(now)
        return LeaseCensus(
            now=now,
            occupied=occupied,
            live_leases=live,
            held_keys=held,
            expired_unanswered=expired,
            removing=removing,
        )

    def live_leases(self, now_ms: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(key hashes, expiries, site hashes, tokens) of every lease live at `now_ms`, from
        a scan of the slots: what a node hands over when it loses keys or leaves. A slot
        changed during the scan is read as either its old or its new word, each a whole
        64-bit load; a slot's site word is written just after its lease's CAS, so a lease
        granted during the scan may show the slot's previous site (or 0)."""
        mmap = self._segment.mmap
        view = np.frombuffer(mmap, dtype=SLOT, count=self.capacity, offset=_SLOTS)
        words = np.frombuffer(
            mmap, dtype=np.uint64, count=self.capacity, offset=_sites_offset(self.capacity)
        )
        try:
            state = view["state"].copy()
            hashes = view["key_hash"].copy()
            sites = words.copy()
        finally:
            del view, words
        expiry = (state >> np.uint64(LEASE_LAYOUT["time_shift"])).astype(np.int64)
        phase = state & np.uint64(LEASE_LAYOUT["phase_mask"])
        live = (phase == _PHASE_LEASED) & (expiry > now_ms)
        slots = np.flatnonzero(live).astype(np.uint64)
        counters = (state[live] >> np.uint64(LEASE_LAYOUT["token_shift"])) & np.uint64(
            LEASE_LAYOUT["token_mask"]
        )
        return hashes[live], expiry[live], sites[live], (slots << np.uint64(16)) | counters

    def live_by_site(self, now_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """(site hashes, live leases of each) at `now_ms`, from a scan of the slots and
        their site words, most leases first; site 0 (keys that name no host) included.
        Every live lease counts, whether or not its site is capped (the site table counts
        permits only where there is a cap). A slot changed during the scan is read as its
        old or its new word, so the counts are those of some instant of each slot."""
        words = np.frombuffer(
            self._segment.mmap, dtype="<u8", count=self.capacity * SLOT_WORDS, offset=_SLOTS
        )
        site_words = np.frombuffer(
            self._segment.mmap,
            dtype="<u8",
            count=self.capacity,
            offset=_sites_offset(self.capacity),
        )
        try:
            # A state word is its expiry shifted over the phase, misses and token: a live
            # lease's is at least (now + 1) << shift.
            state = words[_STATE_WORD::SLOT_WORDS]
            live_from = np.uint64(now_ms + 1) << np.uint64(LEASE_LAYOUT["time_shift"])
            phase = state & np.uint64(LEASE_LAYOUT["phase_mask"])
            live = np.flatnonzero((phase == _PHASE_LEASED) & (state >= live_from))
            sites = site_words[live]
        finally:
            del words, site_words, state
        hashes, counts = np.unique(sites, return_counts=True)
        order = np.argsort(-counts, kind="stable")
        return hashes[order], counts[order].astype(np.int64)

    def recount(self, now_ms: int | None = None) -> None:
        """Rebuild the live counters and tag lanes from the slots: after slots were
        written whole (an import). Only while no other process uses the table."""
        self._c.recount(now_ms if now_ms is not None else wall_clock_ms())

    # ----------------------------------------------------------------- closing

    def close(self) -> None:
        """Release the C views, then unmap. Idempotent; never raises BufferError."""
        self._segment.close()

    def unlink(self) -> None:
        self._segment.unlink()

    def __enter__(self) -> LeaseTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- snapshots

    def export_slots(self) -> np.ndarray:
        """A copy of every slot (`SLOT` records, by index), for a snapshot; consistent only
        once no other process changes the table (the supervisor's, after its workers)."""
        view = np.frombuffer(self._segment.mmap, dtype=SLOT, count=self.capacity, offset=_SLOTS)
        try:
            return view.copy()
        finally:
            del view  # the mapping must not stay exported, or close() cannot unmap it

    def import_slots(self, slots: np.ndarray) -> None:
        """Write exported slots into this fresh table, each at its own index (tokens name
        the index). Only before any other process uses the table: plain stores, no CAS.

        A removal that was under way is finished here (its remover is gone), and the
        incarnation counter starts past every stamp the slots carry, so a stamp is still
        never reused (see remove_slot in csrc/leases.c)."""
        if slots.dtype != SLOT or slots.shape != (self.capacity,):
            raise ValueError(
                f"slots of {slots.dtype} x {slots.shape} do not fit this table "
                f"({SLOT} x {self.capacity})"
            )
        words = slots.copy()
        state = words["state"]
        phase = state & np.uint64(LEASE_LAYOUT["phase_mask"])
        token = (state >> np.uint64(LEASE_LAYOUT["token_shift"])) & np.uint64(
            LEASE_LAYOUT["token_mask"]
        )
        time_shift = np.uint64(LEASE_LAYOUT["time_shift"])
        stamped = (phase == 0) & (token == 0)  # emptied slots: their time is a stamp
        incarnation = int((state[stamped] >> time_shift).max(initial=0))
        removing = np.flatnonzero(phase == LEASE_LAYOUT["phase_removing"])
        stamps = np.arange(incarnation + 1, incarnation + 1 + removing.size, dtype=np.uint64)
        words["key_hash"][removing] = 0
        words["state"][removing] = stamps << time_shift
        words["hold"][removing] = 0
        words["reserved"][removing] = 0
        # The permits imported leases held belong to the old run's site table.
        words["hold"] &= ~_HOLD_PERMIT
        view = np.frombuffer(self._segment.mmap, dtype=SLOT, count=self.capacity, offset=_SLOTS)
        try:
            if view["key_hash"].any() or view["state"].any():
                raise ValueError(f"lease table {self.name} is in use; import into a fresh one")
            view[:] = words
        finally:
            del view
        self._words.store(_CTRL // 8 + LEASE_LAYOUT["incarnation"], incarnation + removing.size)
        self.recount()
