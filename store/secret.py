"""The hash secret: 16 random bytes made once per database, read by every process.

Key hashes are keyed by it (shm/keys.py), so URLs cannot be chosen to share a hash.
It lives in the database so that every node of a cluster, and every restart, hashes
alike: the migration that adds its table writes it in the same transaction, so it
exists exactly once, whichever node migrates first. It is never changed: hashes made
under it sit in shared memory and in the lease snapshot.
"""

from __future__ import annotations

import secrets

from shm.keys import SECRET_BYTES, check_secret
from store.errors import StoreError


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def checked(value: object, where: str) -> bytes:
    """The stored secret as bytes; StoreError if it is missing or not one renderqueue
    made (a hand edit, a bad restore): hashing under it would split the cluster."""
    if value is None:
        raise StoreError(f"{where} has no hash secret (its hash_secret row is missing)")
    try:
        return check_secret(value, where)
    except ValueError as exc:
        raise StoreError(str(exc)) from None
