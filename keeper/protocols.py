"""What the keeper needs of the shared-memory structures, as small protocols.

The keeper's core never sees these; the runner does. `shm.ReadyRing`,
`shm.LeaseTable` and `shm.StateBuffer` satisfy them, and so do the plain
in-memory stand-ins the tests use.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from shm.sites import BlockReason, Configured, SiteBlock


class ReadyRingLike(Protocol):
    @property
    def generation(self) -> int:
        """The live generation; the next publish makes it one more (one writer)."""
        ...

    def publish_slices(
        self,
        source: bytearray,
        starts: npt.NDArray[np.int64],
        lengths: npt.NDArray[np.int64],
        due_at: npt.NDArray[np.int64],
        class_id: npt.NDArray[np.int32],
        key_hash: npt.NDArray[np.uint64],
        now_ms: int,
        cadence_s: npt.NDArray[np.uint32] | None = None,
        site_hash: npt.NDArray[np.uint64] | None = None,
    ) -> int:
        """Replace the published set with these entries, key i being
        source[starts[i] : starts[i] + lengths[i]]; returns the new generation. Without
        `site_hash` every entry says 0 (no site)."""
        ...

    def remaining(self) -> int:
        """Entries of the live generation not claimed yet."""
        ...

    def published_count(self) -> int:
        """Entries the live generation was published with (a publish past the ring's
        capacity or arena is cut short)."""
        ...


class LeaseStatisticsLike(Protocol):
    @property
    def live_leases(self) -> int: ...
    @property
    def held_keys(self) -> int: ...
    @property
    def hold_events(self) -> int: ...
    @property
    def refusals_taken(self) -> int: ...
    @property
    def refusals_held(self) -> int: ...
    @property
    def refusals_probe_full(self) -> int: ...


class LeaseTableLike(Protocol):
    def blocked_mask(
        self, key_hashes: npt.NDArray[np.uint64], now_ms: int
    ) -> npt.NDArray[np.bool_]:
        """For each hash, True if the key is leased or held back now."""
        ...

    def blocked_until(
        self, key_hashes: npt.NDArray[np.uint64], now_ms: int
    ) -> npt.NDArray[np.int64]:
        """For each hash, until when (epoch ms) its key is leased or held back; 0: neither."""
        ...

    def statistics(self, now_ms: int | None = None) -> LeaseStatisticsLike: ...

    def live_leases(
        self, now_ms: int
    ) -> tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]:
        """(key hashes, expiries, site hashes, tokens) of the leases live at `now_ms`."""
        ...


class SiteTableLike(Protocol):
    """shm.sites.SiteTable, as the keeper's publish reads it."""

    def allowances(self, site_hashes: npt.NDArray[np.uint64], now_ms: int) -> npt.NDArray[np.int64]:
        """How many more grants each site can take at `now_ms`: -1 no limit, 0 none."""
        ...

    def reserve_version(self) -> int:
        """A settings version older than any configure made after this call."""
        ...

    def configure_as_of(
        self,
        site_hash: int,
        max_in_flight: int | None,
        min_interval_ms: int | None,
        version: int,
    ) -> Configured:
        """Put a site's own settings in force (None: the node's default) unless settings
        of a newer version are (`superseded`), or the table has no room (`no_room`)."""
        ...

    def block(self, site_hash: int, until_ms: int, reason: BlockReason) -> int:
        """Block the site until `until_ms` (a longer block stays)."""
        ...

    def blocks(self, now_ms: int) -> list[SiteBlock]:
        """Every site blocked past `now_ms`."""
        ...

    def take_permit(self, site_hash: int, now_ms: int, lease_ms: int) -> int:
        """A permit until now + lease_ms under the site's cap; its end, 0 when none was
        taken (the site is full, or has no cap)."""
        ...


class StateBufferLike(Protocol):
    def write(self, payload: bytes, now_ms: int) -> int: ...


class WriteMarksLike(Protocol):
    """shm.marks.WriteMarks, the keeper's side."""

    def set_view(self, generation: int, delivered_below: int) -> None: ...

    def write_classes(self, classes: Sequence[tuple[str, bool]], now_ms: int) -> bool: ...

    def write_owners(self, nodes: Sequence[str], now_ms: int) -> int: ...

    def confirm_until(self, monotonic_ms: int) -> None: ...

    def hear_keeper(self, monotonic_ms: int) -> None: ...

    def raise_lease_ceiling(self, wall_ms: int) -> None: ...

    def take_lease_asked(self) -> int: ...
