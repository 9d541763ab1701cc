"""renderqueue shared memory: the structures worker 0 writes and every worker reads.

POSIX shared memory (posix_ipc + mmap), fixed numpy layouts, no mutex anywhere:
our own C11 atomics (`shm._atomics`) under a ready ring, a lease table, a site
table and state buffers. Each module's docstring gives its protocol.
"""

from shm.keys import key_hash, key_hashes, use_secret
from shm.leases import Grant, KeyLeaseState, LeaseStatistics, LeaseTable, Refusal
from shm.ring import ReadyEntry, ReadyRing, RingStatistics
from shm.segment import (
    LAYOUT_VERSION,
    LayoutMismatch,
    SegmentError,
    SegmentInUse,
    SegmentMissing,
    segment_name,
)
from shm.sites import SiteInfo, SiteStatistics, SiteTable
from shm.state import StateBuffer, StateBufferStatistics, StateSnapshot

__all__ = [
    "LAYOUT_VERSION",
    "Grant",
    "KeyLeaseState",
    "LayoutMismatch",
    "LeaseStatistics",
    "LeaseTable",
    "ReadyEntry",
    "ReadyRing",
    "Refusal",
    "RingStatistics",
    "SegmentError",
    "SegmentInUse",
    "SegmentMissing",
    "SiteInfo",
    "SiteStatistics",
    "SiteTable",
    "StateBuffer",
    "StateBufferStatistics",
    "StateSnapshot",
    "key_hash",
    "key_hashes",
    "segment_name",
    "use_secret",
]
