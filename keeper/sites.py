"""The held rows' sites: a 4-byte site id per row, and a table of the sites held.

A row's site (shm.keys: its URL's host, without `www.`, or what its route's site pattern
names) is what politeness is counted by: per-site counts, the listing of sites by due,
and the publish's per-site allowances (keeper/select.py). It is computed once, with the
key hash, when a row enters the queue (an event or a walked row): the key never changes
while its slot lives, so its site changes only with its route's pattern (a move to
another route, or a new pattern: HeldQueue.set_site_pattern re-sites the route's rows),
and a row's other moves never touch it.

Per row the queue keeps the site's id (`HeldQueue.site_ids`, an int32 column parallel to
the slot records) rather than its 64-bit hash: half the bytes, and a dense id makes the
report's per-site counts one `bincount` over the due rows where hashes would need a sort.
The sites themselves are a `SlotTable` keyed by site hash (no key bytes: a site's name
is `site_of` any held key of it, taken for the few sites a report lists), whose slot
number is the id; each site counts its held rows and is dropped with its last one. A
site costs some 60 bytes, so ids beat a hash column (8 bytes a row) unless sites
average fewer than 15 rows. Id 0 is "no site" (keys that name no host, hash `NO_SITE`):
always present, never listed, never capped.
"""

from __future__ import annotations

from array import array

import msgspec
import numpy as np
import numpy.typing as npt

from keeper.slots import SlotTable
from shm.keys import NO_SITE

NO_SITE_ID = 0


class HeldSitesStatistics(msgspec.Struct, frozen=True, kw_only=True):
    sites: int  # sites holding at least one row, "no site" not counted
    ids: int  # site ids ever handed out (live + free)


class HeldSites:
    def __init__(self) -> None:
        self.table = SlotTable(64)
        # Held rows per site id (0 for a free id).
        self.rows: array[int] = array("q")
        none = self.table.add(NO_SITE, b"")
        assert none == NO_SITE_ID
        self.rows.append(0)

    def __len__(self) -> int:
        """Sites holding a row, "no site" not counted."""
        return len(self.table) - 1

    def intern(self, site_hash: int) -> int:
        """The id of the site whose hash is `site_hash`, counting one more row of it (a
        site not held yet is added)."""
        site = self.table.find(site_hash)
        if site < 0:
            site = self.table.add(site_hash, b"")
            if site == len(self.rows):
                self.rows.append(0)
        self.rows[site] += 1
        return site

    def intern_many(self, site_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.int32]:
        """`intern` for many rows at once (a walked chunk): their site ids. One C probe
        a row; only the sites not held yet are sorted out and added."""
        ids = self.table.find_many(site_hashes)
        new = ids < 0
        if new.any():
            distinct = np.unique(site_hashes[new])
            added = self.table.add_many(distinct, [b""] * len(distinct))
            grow = self.table.slots - len(self.rows)
            if grow > 0:
                self.rows.frombytes(bytes(8 * grow))
            ids[new] = added[np.searchsorted(distinct, site_hashes[new])]
        rows = np.frombuffer(self.rows, dtype=np.int64)
        np.add.at(rows, ids, 1)
        del rows  # a live view would stop the array from growing
        return ids

    def release(self, site: int) -> None:
        """One row of `site` is no longer held; the site goes with its last row."""
        left = self.rows[site] - 1
        self.rows[site] = left
        if left == 0 and site != NO_SITE_ID:
            self.table.remove(site)

    def release_many(self, ids: npt.NDArray[np.int32]) -> None:
        """`release` for many rows at once (a route re-sited)."""
        rows = np.frombuffer(self.rows, dtype=np.int64)
        np.subtract.at(rows, ids, 1)
        emptied = [site for site in np.unique(ids).tolist() if rows[site] == 0]
        del rows  # a live view would stop the array from growing
        for site in emptied:
            if site != NO_SITE_ID:
                self.table.remove(site)

    def hashes(self) -> npt.NDArray[np.uint64]:
        """The site hash of each id (a free id's is 0): a view, drop it before sites are
        added."""
        return self.table.hashes()

    def held_rows(self, site: int) -> int:
        return self.rows[site]

    def nbytes(self) -> int:
        return self.table.nbytes() + len(self.rows) * 8

    def statistics(self) -> HeldSitesStatistics:
        return HeldSitesStatistics(sites=len(self), ids=self.table.slots)
