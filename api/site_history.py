"""In flight per site over the last hour: `GET /v1/sites-in-flight`.

The supervisor counts every live lease by its site at each lease census (every second,
`LeaseTable.live_by_site`) and keeps, per minute of the last hour, each site's highest
count (at most HISTORY_LATEST sites a minute) and the highest total (`InFlightHistory`).
After each count it writes the hour into a state buffer of its own (segment `sitehist`):
the HISTORY_SITES sites with the highest peaks, each with its per-minute series, and the
last count's sites, named from the keeper's sites listing. Any worker serves the record
from there, decoded into its typed shape and checked, so a page opened now shows the
past hour. The history is the supervisor's memory: it starts empty with the node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import msgspec
import numpy as np
import numpy.typing as npt
from starlette.responses import Response

from api.body import json_response
from api.node import Node
from shm.segment import now_ms
from wire.schemas import (
    HISTORY_LATEST,
    HISTORY_MINUTES,
    HISTORY_SITES,
    NodeStatus,
    SiteCount,
    SiteSeries,
    SitesInFlight,
)

MINUTE_MS = 60_000
# How long the supervisor waits before reading the keeper's listing again for a site it
# cannot name yet (the listing changes at each full report, every few seconds).
NAME_RETRY_MS = 5_000
# Every field at its widest: names of 253 bytes, counts of 32 bits (a buffer this size
# always holds a record; tests/test_api_site_history.py checks it).
HISTORY_BYTES = 64 * 1024

_decoder = msgspec.msgpack.Decoder(SitesInFlight)


class _Minute:
    __slots__ = ("peaks", "total")

    def __init__(self) -> None:
        self.total = 0
        self.peaks: dict[int, int] = {}


class InFlightHistory:
    """The supervisor's hour: per minute, each site's and the total's highest count."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._minutes: dict[int, _Minute] = {}  # minute number -> its peaks
        self._latest: list[tuple[int, int]] = []  # (site hash, in flight) at the last count
        self._sampled_at: int | None = None
        self._names: dict[int, str] = {}
        self._names_tried_at = -NAME_RETRY_MS

    def record(
        self,
        now: int,
        site_hashes: npt.NDArray[np.uint64],
        counts: npt.NDArray[np.int64],
    ) -> None:
        """One count: `LeaseTable.live_by_site`'s arrays (most leases first)."""
        minute = now // MINUTE_MS
        slot = self._minutes.get(minute)
        if slot is None:
            slot = self._minutes[minute] = _Minute()
            for old in [m for m in self._minutes if m <= minute - HISTORY_MINUTES]:
                del self._minutes[old]
        slot.total = max(slot.total, int(counts.sum()))
        latest = [
            (h, c)
            for h, c in zip(site_hashes.tolist(), counts.tolist(), strict=True)
            if h != 0  # keys that name no host: in the total only
        ][:HISTORY_LATEST]
        for h, c in latest:
            if c > slot.peaks.get(h, 0):
                slot.peaks[h] = c
        if len(slot.peaks) > HISTORY_LATEST:
            kept = sorted(slot.peaks.items(), key=lambda item: -item[1])[:HISTORY_LATEST]
            slot.peaks = dict(kept)
        self._latest = latest
        self._sampled_at = now

    def _shown(self) -> list[tuple[int, int]]:
        """(site hash, peak) of the HISTORY_SITES sites with the highest peaks."""
        peaks: dict[int, int] = {}
        for slot in self._minutes.values():
            for h, c in slot.peaks.items():
                peaks[h] = max(peaks.get(h, 0), c)
        return sorted(peaks.items(), key=lambda item: (-item[1], item[0]))[:HISTORY_SITES]

    def name(self, now: int, lookup: Callable[[], Mapping[int, str]]) -> None:
        """Name the sites the record shows; `lookup` reads the keeper's listing (hash to
        name), asked only when one is unnamed, at most every NAME_RETRY_MS."""
        wanted = {h for h, _ in self._shown()} | {h for h, _ in self._latest}
        self._names = {h: n for h, n in self._names.items() if h in wanted}
        if wanted <= self._names.keys() or now - self._names_tried_at < NAME_RETRY_MS:
            return
        self._names_tried_at = now
        listed = lookup()
        for h in wanted - self._names.keys():
            found = listed.get(h)
            if found is not None:
                self._names[h] = found

    def snapshot(self, now: int) -> SitesInFlight:
        minute = now // MINUTE_MS
        span = range(minute - HISTORY_MINUTES + 1, minute + 1)
        slots = [self._minutes.get(m) for m in span]
        return SitesInFlight(
            node=self.node,
            sampled_at=self._sampled_at,
            minutes=[m * MINUTE_MS for m in span],
            total=[None if s is None else s.total for s in slots],
            sites=[
                SiteSeries(
                    site=self._names.get(h),
                    site_hash=f"{h:016x}",
                    peak=peak,
                    in_flight=[None if s is None else s.peaks.get(h, 0) for s in slots],
                )
                for h, peak in self._shown()
            ],
            latest=[
                SiteCount(site=self._names.get(h), site_hash=f"{h:016x}", in_flight=c)
                for h, c in self._latest
            ],
        )


def encode(record: SitesInFlight) -> bytes:
    return msgspec.msgpack.encode(record)


def decode(payload: bytes) -> SitesInFlight:
    """The record, typed and checked (SitesInFlight.__post_init__); raises
    msgspec.DecodeError (a ValidationError too) for anything else."""
    return _decoder.decode(payload)


def sites_in_flight(node: Node) -> SitesInFlight | Response:
    """The supervisor's record; before its first count (or with no supervisor: an embedded
    node) an hour with no minute counted; 503 only for a record that does not decode."""
    now = now_ms()
    snapshot = None if node.site_history is None else node.site_history.read()
    if snapshot is None:
        return InFlightHistory(node.settings.node).snapshot(now)
    try:
        record = decode(snapshot.payload)
    except msgspec.DecodeError as exc:
        return json_response(
            NodeStatus(
                status="unavailable",
                detail=f"the in-flight history is unreadable (another build's?): {exc}",
                retry_after_s=node.settings.retry_after_s,
            ),
            503,
            headers={"Retry-After": str(node.settings.retry_after_s)},
        )
    if record.sampled_at is None:
        return record
    return msgspec.structs.replace(record, age_ms=max(0, now - record.sampled_at))
