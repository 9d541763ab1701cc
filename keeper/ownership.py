"""Which rows this node holds: the one seam the cluster work fills.

A single node owns every row. A cluster keeper uses rendezvous (highest random
weight) hashing over the live node list: each (key, node) pair is scored by mixing
the key's stored 64-bit hash with the node's, and the highest score owns the key. A
join moves to the newcomer only the keys it now wins; a leave moves only the leaver's
keys, about 1/N of them. A change of `generation` tells the keeper to drop rows it no
longer owns and run a verification walk that adds rows gained.

What is hashed is a key's *placement*: its own hash, or, when the cluster owns keys by
site (the `ownership = "site"` setting), its site's hash, so every key of a site has
one owner, whose site table then enforces the site's cap, spacing and blocks exactly
(docs/decisions/0012-sites-owned-whole.md). A key that names no site is placed by its
own hash either way.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shm.keys import NO_SITE


class Ownership(Protocol):
    @property
    def generation(self) -> int: ...

    @property
    def by_site(self) -> bool:
        """True when keys are placed by their site's hash (`placements`)."""
        ...

    @property
    def owns_all(self) -> bool:
        """True when every key is owned, so the per-event check can be skipped."""
        ...

    def owns(self, key_hash: int) -> bool: ...

    def owns_many(self, key_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]: ...


class OwnEverything:
    """A single node: every row is this node's."""

    generation = 0
    owns_all = True
    by_site = False

    def owns(self, key_hash: int) -> bool:
        return True

    def owns_many(self, key_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        return np.ones(len(key_hashes), dtype=np.bool_)


_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=1024)
def node_hash(name: str) -> int:
    """A node's 64-bit identity for rendezvous hashing: stable across processes and
    releases (never Python's salted `hash`)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def mix(values: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, vectorised: a key hash XOR a node hash scores the pair."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def mix_one(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def placements(
    key_hashes: npt.NDArray[np.uint64], site_hashes: npt.NDArray[np.uint64] | None, by_site: bool
) -> npt.NDArray[np.uint64]:
    """The hashes ownership is decided on: the keys' own, or by site each key's site hash
    (a key with no site: its own). `site_hashes` may be None only when not by site."""
    if not by_site:
        return key_hashes
    if site_hashes is None:
        raise ValueError("placements: owned by site, but no site hashes given")
    placed: npt.NDArray[np.uint64] = np.where(
        site_hashes != np.uint64(NO_SITE), site_hashes, key_hashes
    ).astype(np.uint64, copy=False)
    return placed


def placement(key_hash: int, site_hash: int, by_site: bool) -> int:
    """`placements` of one key."""
    return site_hash if by_site and site_hash != NO_SITE else key_hash


def winners(key_hashes: npt.NDArray[np.uint64], nodes: Sequence[str]) -> npt.NDArray[np.intp]:
    """For each key, the index in `nodes` of its owner: the highest score wins."""
    if not nodes:
        raise ValueError("winners: no nodes")
    hashes = np.asarray(key_hashes)
    if hashes.dtype != np.uint64:
        # A float array (numpy's choice for a list of ints past 2**63) would round them.
        raise TypeError(f"winners: key hashes must be uint64, got {hashes.dtype}")
    best = mix(hashes ^ np.uint64(node_hash(nodes[0])))
    owner = np.zeros(len(hashes), dtype=np.intp)
    for index, name in enumerate(nodes[1:], 1):
        score = mix(hashes ^ np.uint64(node_hash(name)))
        better = score > best
        best = np.where(better, score, best)
        owner[better] = index
    return owner


class Rendezvous:
    """This node's share of the keys: those whose highest-scoring node, over the live
    node list, is this one. `set_nodes` bumps the generation when the list changes.
    Its methods take placements (`placements`); `by_site` says which the callers make."""

    def __init__(self, me: str, nodes: Sequence[str] = (), *, by_site: bool = False) -> None:
        self.me = me
        self.by_site = by_site
        self.generation = 0
        self.nodes: tuple[str, ...] = ()
        self._me_index = -1
        self._hashes: list[int] = []
        self.set_nodes(nodes or (me,))

    def set_nodes(self, nodes: Sequence[str]) -> bool:
        ordered = tuple(sorted(set(nodes)))
        if ordered == self.nodes:
            return False
        self.nodes = ordered
        self._me_index = ordered.index(self.me) if self.me in ordered else -1
        self._hashes = [node_hash(name) for name in ordered]
        self.generation += 1
        return True

    @property
    def owns_all(self) -> bool:
        return self.nodes == (self.me,)

    def owns(self, placed: int) -> bool:
        if self._me_index < 0:
            return False
        best_index, best = 0, -1
        for index, node in enumerate(self._hashes):
            score = mix_one(placed ^ node)
            if score > best:
                best_index, best = index, score
        return best_index == self._me_index

    def owns_many(self, key_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        if self._me_index < 0:
            return np.zeros(len(key_hashes), dtype=np.bool_)
        if self.owns_all:
            return np.ones(len(key_hashes), dtype=np.bool_)
        owned: npt.NDArray[np.bool_] = winners(key_hashes, self.nodes) == self._me_index
        return owned
