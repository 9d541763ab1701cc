"""Rendezvous ownership: stable, balanced, and moving only what a join or leave must."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from keeper.ownership import Rendezvous, node_hash, winners


def hashes(n: int, seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**63, n, dtype=np.int64).astype(np.uint64)


def test_vectorised_and_scalar_owners_agree() -> None:
    keys = hashes(3000)
    nodes = ["node-a", "node-b", "node-c"]
    owners = winners(keys, nodes)
    for index, name in enumerate(nodes):
        scalar = Rendezvous(name, nodes)
        assert [scalar.owns(int(k)) for k in keys] == (owners == index).tolist()


def test_shares_are_balanced() -> None:
    counts = np.bincount(winners(hashes(300_000), ["a", "b", "c"]), minlength=3)
    assert counts.min() > 0.32 * 300_000 and counts.max() < 0.345 * 300_000


def test_a_join_moves_keys_only_to_the_newcomer_and_a_leave_only_the_leavers() -> None:
    keys = hashes(100_000)
    three = ["a", "b", "c"]
    before = np.array(three)[winners(keys, three)]
    after_join = np.array([*three, "d"])[winners(keys, [*three, "d"])]
    moved = before != after_join
    assert set(after_join[moved]) == {"d"}
    assert 0.22 < moved.mean() < 0.28
    after_leave = np.array(["a", "c"])[winners(keys, ["a", "c"])]
    moved = before != after_leave
    assert set(before[moved]) == {"b"}  # exactly the leaver's keys move
    assert moved.sum() == (before == "b").sum()


def test_node_hashes_do_not_depend_on_the_process() -> None:
    code = "from keeper.ownership import node_hash; print(node_hash('node-a'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    other = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(other.stdout) == node_hash("node-a")


def test_rendezvous_owns_its_share_and_bumps_its_generation_on_change_only() -> None:
    keys = hashes(5000)
    mine = Rendezvous("b")
    assert mine.owns_all and mine.generation == 1
    assert not mine.set_nodes(["b"])
    assert mine.set_nodes(["c", "a", "b"]) and mine.generation == 2
    assert not mine.owns_all
    owned = mine.owns_many(keys)
    assert owned.tolist() == [mine.owns(int(k)) for k in keys]
    assert owned.tolist() == (winners(keys, ["a", "b", "c"]) == 1).tolist()
    mine.set_nodes(["a", "c"])  # not live: owns nothing
    assert not mine.owns_many(keys).any() and not mine.owns(int(keys[0]))
