"""Key hashes: the 64-bit identity a key has in shared memory.

The ready ring carries each key's hash, the lease table is keyed by it and a cluster
divides its keys by it (keeper/ownership.py), so every process of every node must
compute the same value for the same bytes: Python's own `hash()` is salted per
process, so this is SipHash-2-4, in the C extension (hashlib costs a Python call and
an object per key, and the keeper hashes every event and every walked row). 0 marks
an empty lease slot, so a hash of 0 is mapped to 1.

The hash is keyed by a secret the store makes once per database (`hash_secret` in
store/base.py), so every node of a cluster has the same one and nobody else does.
An unkeyed hash would let someone who picks URLs (a sitemap) craft two keys that
share a hash, and so one lease: a refused claim or a skipped render for those keys
(never one key granted to two workers, since the keeper compares key bytes on its
walks). Without the secret, colliding keys cannot be chosen.

A process hashes under one secret, set once with `use_secret` before any key is
hashed (a worker, from what the supervisor read from the store): hashes made under
two secrets in one process would name the same key twice. Hashing before it is set
raises. The secret never leaves the store and the processes that hash; what is
written down beside hashes (the lease snapshot) is its `fingerprint`.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shm import _atomics

SECRET_BYTES = 16
# Domain separation: the fingerprint is no other BLAKE2b value of the secret.
_FINGERPRINT_PERSON = b"rq-secret-print"
# Site hashes are keyed by a secret derived from the key secret, so a site named like a
# key never shares its hash.
_SITE_PERSON = b"rq-site-hash"
NO_SITE = 0  # the site hash of a key that names no host: no site's settings apply
SITE_MAX_BYTES = 253  # the longest DNS name
# A site pattern's name: dot-separated labels (site_pattern).
_SITE_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")

key_hash = _atomics.key_hash  # the C function itself: no Python frame on the event path
# site_hash(site_of(key[, pattern])) in one C call (the rules of site_of, in C beside the
# hash): the keeper takes each new row's site with its key hash, on every event and
# walked row, under its route's site pattern.
key_site_hash = _atomics.key_site_hash

_secret: bytes | None = None
_site_secret: bytes | None = None


class SecretConflict(RuntimeError):
    """The process already hashes keys under another secret."""


def check_secret(secret: object, where: str) -> bytes:
    """`secret` as bytes if it is a hash secret, else ValueError naming `where`."""
    if not isinstance(secret, bytes | bytearray | memoryview):
        raise ValueError(f"the hash secret in {where} is a {type(secret).__name__}, not bytes")
    raw = bytes(secret)
    if len(raw) != SECRET_BYTES:
        raise ValueError(
            f"the hash secret in {where} is {len(raw)} bytes; renderqueue makes "
            f"{SECRET_BYTES}, so it was not written by renderqueue"
        )
    return raw


def use_secret(secret: bytes) -> None:
    """Key this process's hashes with `secret`. Setting the same secret again is a no-op;
    another one raises SecretConflict (hashes already made would no longer match)."""
    global _secret
    raw = check_secret(secret, "use_secret")
    if _secret is not None:
        if not hmac.compare_digest(_secret, raw):
            raise SecretConflict(
                f"this process hashes keys under the secret {fingerprint(_secret):016x}, "
                f"not {fingerprint(raw):016x}"
            )
        return
    global _site_secret
    site_secret = _derive_site_secret(raw)
    _atomics.set_hash_secret(raw)
    _atomics.set_site_secret(site_secret)
    _secret = raw
    _site_secret = site_secret


def forget_secret() -> None:
    """Hash nothing until the next use_secret: for a process that hosts one node after
    another (a test or bench harness), once the first is closed and its hashes are void."""
    global _secret, _site_secret
    _atomics.clear_hash_secret()
    _secret = None
    _site_secret = None


def secret_in_use() -> bytes | None:
    """The secret `use_secret` set, or None."""
    return _secret


def fingerprint(secret: bytes) -> int:
    """A 64-bit name for `secret` that reveals nothing of it: what is stored beside
    hashes, to tell whether they were made under the same secret."""
    digest = hashlib.blake2b(
        check_secret(secret, "fingerprint"), digest_size=8, person=_FINGERPRINT_PERSON
    ).digest()
    return int.from_bytes(digest, "little")


def keyed_hash(secret: bytes, key: bytes) -> int:
    """`key_hash` of `key` as a process hashing under `secret` computes it: for a tool or
    test looking at another database than its own."""
    return _atomics.siphash24(check_secret(secret, "keyed_hash"), key) or 1


def key_hashes(keys: Sequence[bytes]) -> npt.NDArray[np.uint64]:
    """`key_hash` of each key, as a uint64 array (one C call)."""
    hashes = np.empty(len(keys), dtype=np.uint64)
    _atomics.key_hashes_into(keys, hashes)
    return hashes


def key_site_hashes(
    keys: Sequence[bytes],
    patterns: tuple[bytes, ...] = (),
    which: npt.NDArray[np.int32] | None = None,
) -> npt.NDArray[np.uint64]:
    """`key_site_hash` of each key, as a uint64 array (one C call); with `patterns`, each
    key under `patterns[which[i]]`."""
    hashes = np.empty(len(keys), dtype=np.uint64)
    if which is None:
        _atomics.key_site_hashes_into(keys, hashes)
    else:
        _atomics.key_site_hashes_into(keys, hashes, patterns, np.ascontiguousarray(which, np.int32))
    return hashes


def _derive_site_secret(secret: bytes) -> bytes:
    return hashlib.blake2b(secret, digest_size=SECRET_BYTES, person=_SITE_PERSON).digest()


def site_of(key: bytes, pattern: bytes = b"") -> bytes:
    """The site a key belongs to: its URL's host, lower-cased, without a trailing dot, a
    port, credentials or a leading `www.`; b"" when the key names no host (no `scheme://`).

    Politeness is owed to an origin, and `www.example.com` and `example.com` are one
    origin's two names far more often than two origins. A route may name its keys' site
    instead (`pattern`, as `site_pattern` checks it): `*.NAME` makes NAME the site of
    every host under NAME and of NAME itself (other hosts keep their own), and a plain
    NAME is the site of every key of the route. `key_site_hash` follows the same rules in
    C (shm/csrc/hash.c): a change here is made there too."""
    if pattern and not pattern.startswith(b"*."):
        return pattern
    host = _host_of(key)
    if pattern and host:
        name = pattern[2:]
        if host == name or host.endswith(b"." + name):
            return name
    return host


def site_pattern(pattern: str) -> bytes:
    """A route's site pattern checked, as `site_of` takes it; ValueError saying why not.

    `*.NAME` or `NAME`, at most SITE_MAX_BYTES in all, where NAME is a host name as
    `site_of` names a site (lower-case letters, digits, `-`, `_` and dots; no port,
    trailing dot or leading `www.`), so that `PUT /v1/sites/NAME` reaches the site the
    pattern makes. A wildcard's NAME has a dot in it: one site for a whole top-level
    domain is refused as a mistake. wire.schemas.SitePattern says the same as a regex."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"site_pattern {pattern!r}: *.NAME or NAME, NAME a host name")
    wildcard = pattern.startswith("*.")
    name = pattern[2:] if wildcard else pattern
    if len(pattern) > SITE_MAX_BYTES or not _SITE_NAME.fullmatch(name):
        raise ValueError(
            f"site_pattern {pattern[:80]!r}: *.NAME or NAME, at most {SITE_MAX_BYTES} "
            f"characters, NAME a host name: labels of lower-case letters, digits, '-' and "
            f"'_' joined by single dots"
        )
    raw = name.encode()
    named = site_of(b"x://" + raw)
    if named != raw:
        suggested = ("*." if wildcard else "") + named.decode()
        raise ValueError(
            f"site_pattern {pattern!r}: a key's URL names that site {named.decode()!r} (no "
            f"trailing dot or leading www.); use {suggested!r}"
        )
    if wildcard and "." not in name:
        raise ValueError(
            f"site_pattern {pattern!r}: a wildcard names a domain with a dot in it, not a "
            f"top-level domain"
        )
    return raw if not wildcard else pattern.encode()


def _host_of(key: bytes) -> bytes:
    start = key.find(b"://")
    if start < 0:
        return b""
    start += 3
    end = len(key)
    for stop in (b"/", b"?", b"#"):
        at = key.find(stop, start, end)
        if at >= 0:
            end = at
    host = key[start:end]
    at = host.rfind(b"@")
    if at >= 0:
        host = host[at + 1 :]
    if host.startswith(b"["):  # an IPv6 literal keeps its colons
        close = host.find(b"]")
        host = host[: close + 1] if close >= 0 else host
    else:
        colon = host.find(b":")
        if colon >= 0:
            host = host[:colon]
    host = host.lower().rstrip(b".")
    if host.startswith(b"www."):
        host = host[4:]
    return host[:SITE_MAX_BYTES]


def site_hash(site: bytes) -> int:
    """The 64-bit identity of a site name (`site_of`'s answer, or a name an operator
    gives), under this process's secret; NO_SITE for b"". Hashing before use_secret
    raises."""
    if not site:
        return NO_SITE
    if _site_secret is None:
        raise RuntimeError("site_hash before use_secret: this process hashes under no secret")
    return _atomics.siphash24(_site_secret, site) or 1


def keyed_site_hash(secret: bytes, site: bytes) -> int:
    """`site_hash` of `site` as a process hashing under `secret` computes it."""
    if not site:
        return NO_SITE
    return (
        _atomics.siphash24(_derive_site_secret(check_secret(secret, "keyed_site_hash")), site) or 1
    )
