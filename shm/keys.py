"""Key hashes: the 64-bit identity a key has in shared memory.

The ready ring carries each key's hash and the lease table is keyed by it, so
every process must compute the same value for the same bytes: Python's own
`hash()` is salted per process, so this is BLAKE2b with an 8-byte digest (no
key, no salt). A cryptographic hash keeps crafted URLs from colliding on
purpose, which would make two keys share one lease. 0 marks an empty lease slot,
so a digest of 0 is mapped to 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np


def key_hash(key: bytes) -> int:
    """The stable, nonzero 64-bit hash of a key."""
    value = int.from_bytes(blake2b(key, digest_size=8).digest(), "little")
    return value or 1


def key_hashes(keys: Sequence[bytes]) -> np.ndarray:
    """`key_hash` of each key, as a uint64 array."""
    digests = b"".join(blake2b(key, digest_size=8).digest() for key in keys)
    hashes = np.frombuffer(digests, dtype="<u8").astype(np.uint64)
    hashes[hashes == 0] = 1
    return hashes
