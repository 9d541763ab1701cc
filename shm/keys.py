"""Key hashes: the 64-bit identity a key has in shared memory.

The ready ring carries each key's hash and the lease table is keyed by it, so
every process must compute the same value for the same bytes: Python's own
`hash()` is salted per process, so this is XXH64 with seed 0, in the C
extension (BLAKE2b in Python cost about 0.4 us a key, and the keeper hashes
every event and every walked row). 0 marks an empty lease slot, so a hash of 0
is mapped to 1.

XXH64 is not collision resistant: someone who controls URLs could craft two
that share a hash, and so one lease. What that buys is a refused claim or a
skipped render for those two keys (the keeper compares key bytes on its walks
and counts a collision), never one key granted to two workers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shm import _atomics

key_hash = _atomics.key_hash  # the C function itself: no Python frame on the event path


def key_hashes(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """`key_hash` of each key, as a uint64 array (one C call)."""
    hashes = np.empty(len(keys), dtype=np.uint64)
    _atomics.key_hashes_into(keys, hashes)
    return hashes
