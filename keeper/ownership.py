"""Which rows this node holds: the one seam the cluster work fills.

A single node owns every row. A cluster keeper plugs in rendezvous hashing
over the live node list; a change of `generation` tells the keeper to drop
rows it no longer owns and run a verification walk that adds rows gained.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import numpy.typing as npt


class Ownership(Protocol):
    @property
    def generation(self) -> int: ...

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

    def owns(self, key_hash: int) -> bool:
        return True

    def owns_many(self, key_hashes: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        return np.ones(len(key_hashes), dtype=np.bool_)
