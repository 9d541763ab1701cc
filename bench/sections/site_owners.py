"""site_owners: what owning keys by site (the `ownership = "site"` setting) costs a cluster
in balance, against owning them by key.

    .venv/bin/python -m bench site_owners [--quick]

Owned by site, every key of a site has one node (rendezvous on the site's hash), whose
site table then enforces the site's cap and blocks exactly; the price is that a node's
share of the work is a sum of whole sites. This measures that price with the cluster's
own code: the keys are hashed as a node hashes them (`shm.keys.key_hashes`,
`key_site_hashes`, under a hash secret), placed as the keeper places them
(`keeper.ownership.placements`) and divided by `keeper.ownership.winners` over the node
names a, b, c. Nothing else runs: the figures are shares, not times.

Two workloads of 200,000 due keys (quick 20,000):

- **one dominant site**: 60% of the due keys on one site, the rest over 999 sites whose
  sizes fall as 1/rank (a few large customers, a long tail);
- **no dominant site**: 1,000 sites sized 1/rank, the largest about 13% of the keys.

Each is divided over 2 and 3 nodes under 40 secrets (quick 8): the secret decides which
node wins which site, so the spread over secrets is the spread a cluster may get. Per
arm: the busiest node's share of the due keys (mean and worst over the secrets), and
the share of keys that move to a third node joining two (rendezvous moves only what the
newcomer wins; by site, whole sites).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.harness import report

SECTION = "site_owners"
T_SHARE = "the busiest node's share of due keys (mean over hash secrets; worst in the note)"
T_MOVED = "keys moved to a third node joining two"
NODES = ("a", "b", "c")
DOMINANT_SHARE = 0.6


def _sizes(keys: int, sites: int, dominant: float | None) -> list[int]:
    """Keys per site: sizes falling as 1/rank, the first `dominant` of all when given."""
    rest = keys - (round(keys * dominant) if dominant is not None else 0)
    tail = sites - (1 if dominant is not None else 0)
    weights = 1.0 / np.arange(1, tail + 1)
    counts = np.floor(weights / weights.sum() * rest).astype(np.int64)
    counts[0] += rest - int(counts.sum())
    sizes: list[int] = [int(count) for count in counts]
    return ([keys - rest] if dominant is not None else []) + sizes


def _keys(sizes: list[int]) -> list[bytes]:
    return [
        f"https://s{site:04d}.example/p/{n:07d}".encode()
        for site, count in enumerate(sizes)
        for n in range(count)
    ]


def _owners(
    keys: list[bytes], secret: bytes, nodes: tuple[str, ...]
) -> dict[str, npt.NDArray[np.intp]]:
    """Each key's owner index in `nodes`, by key and by site, under `secret`."""
    from keeper.ownership import placements, winners
    from shm.keys import forget_secret, key_hashes, key_site_hashes, use_secret

    use_secret(secret)
    try:
        hashes = key_hashes(keys)
        sites = key_site_hashes(keys)
    finally:
        forget_secret()
    return {
        "key": winners(placements(hashes, None, False), nodes),
        "site": winners(placements(hashes, sites, True), nodes),
    }


def measure(sizes: list[int], secrets: list[bytes]) -> dict[str, Any]:
    """Per ownership: the busiest node's share at 2 and 3 nodes, and the share moved to
    the third node's join, for every secret."""
    keys = _keys(sizes)
    out: dict[str, Any] = {
        mode: {"busiest_2": [], "busiest_3": [], "moved_on_join": [], "shares_3": []}
        for mode in ("key", "site")
    }
    for secret in secrets:
        two = _owners(keys, secret, NODES[:2])
        three = _owners(keys, secret, NODES)
        for mode in ("key", "site"):
            shares_2 = np.bincount(two[mode], minlength=2) / len(keys)
            shares_3 = np.bincount(three[mode], minlength=3) / len(keys)
            arm = out[mode]
            arm["busiest_2"].append(float(shares_2.max()))
            arm["busiest_3"].append(float(shares_3.max()))
            arm["shares_3"].append(sorted(shares_3.tolist(), reverse=True))
            # The names are in order, so index i is the same node in both views.
            arm["moved_on_join"].append(float(np.mean(two[mode] != three[mode])))
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(float(np.mean(values)), 4),
        "min": round(float(np.min(values)), 4),
        "max": round(float(np.max(values)), 4),
    }


def chart(result: report.SectionResult, arms: dict[str, dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    from bench.harness.charts import save

    figure, (shares, moved) = plt.subplots(1, 2, figsize=(13, 5))
    labels: list[str] = []
    for group, (workload, nodes) in enumerate((w, n) for w in arms for n in (2, 3)):
        for offset, (mode, colour) in enumerate((("key", "tab:blue"), ("site", "tab:orange"))):
            values = arms[workload][mode][f"busiest_{nodes}"]
            mean = float(np.mean(values))
            shares.bar(
                group + (offset - 0.5) * 0.38,
                mean,
                0.38,
                color=colour,
                yerr=[[mean - min(values)], [max(values) - mean]],
                capsize=4,
                label=f"by {mode}" if group == 0 else None,
            )
        labels.append(f"{workload}\n{nodes} nodes")
    position = len(labels)
    for nodes, x in ((2, 0.5), (3, 1 / 3)):
        shares.axhline(x, color="grey", linestyle=":", linewidth=1)
        shares.text(position - 0.5, x, f"1/{nodes}", va="bottom", ha="right", fontsize=8)
    shares.set_xticks(range(len(labels)), labels, fontsize=7)
    shares.set_ylim(0, 1)
    shares.set_ylabel("busiest node's share of due keys")
    shares.set_title("balance: mean over secrets, bar = min..max")
    shares.legend(fontsize=8)
    for index, arm in enumerate(arms.values()):
        for offset, (mode, colour) in enumerate((("key", "tab:blue"), ("site", "tab:orange"))):
            values = arm[mode]["moved_on_join"]
            xs = np.full(len(values), index * 3 + offset, dtype=float)
            moved.scatter(
                xs, values, color=colour, alpha=0.6, label=f"by {mode}" if not index else None
            )
    moved.axhline(1 / 3, color="grey", linestyle=":", linewidth=1)
    moved.set_xticks(
        [i * 3 + o for i in range(len(arms)) for o in (0, 1)],
        [f"{w}\nby {m}" for w in arms for m in ("key", "site")],
        fontsize=7,
    )
    moved.set_ylim(0, 1)
    moved.set_ylabel("share of keys moved")
    moved.set_title("a third node joins two: keys it takes, one dot per secret")
    moved.legend(fontsize=8)
    scale = "quick, scaled down" if result.quick else "full scale"
    figure.suptitle(f"ownership by key vs by site ({scale}); shares from the cluster's own hashing")
    save(figure, result, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench site_owners", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="scaled down; checks rows only")
    quick: bool = parser.parse_args(argv).quick
    report.exit_on_sigterm()
    result = report.new_result(SECTION, quick, ours_label="by site")
    keys = 20_000 if quick else 200_000
    rng = np.random.default_rng(29)
    secrets = [rng.bytes(16) for _ in range(8 if quick else 40)]
    workloads = {
        "one site 60%": _sizes(keys, 1000, DOMINANT_SHARE),
        "no dominant site": _sizes(keys, 1000, None),
    }
    arms: dict[str, dict[str, Any]] = {}
    for name, sizes in workloads.items():
        report.progress(f"site_owners: {name}, {keys:,} keys, {len(secrets)} secrets")
        arms[name] = measure(sizes, secrets)
    for name, arm in arms.items():
        largest = workloads[name][0] / keys
        for nodes in (2, 3):
            site = _summary(arm["site"][f"busiest_{nodes}"])
            by_key = _summary(arm["key"][f"busiest_{nodes}"])
            result.figures.append(
                report.Figure(
                    table=T_SHARE,
                    what=f"{name} (largest site {largest:.0%}), {nodes} nodes",
                    unit="share",
                    ours=site["mean"],
                    peers={"by key": by_key["mean"]},
                    note=f"by site worst {site['max']:.3f}, best {site['min']:.3f}; "
                    f"by key worst {by_key['max']:.3f}; even 1/{nodes} = {1 / nodes:.3f}",
                )
            )
        site_moved = _summary(arm["site"]["moved_on_join"])
        key_moved = _summary(arm["key"]["moved_on_join"])
        result.figures.append(
            report.Figure(
                table=T_MOVED,
                what=f"{name}, 2 nodes to 3",
                unit="share",
                ours=site_moved["mean"],
                peers={"by key": key_moved["mean"]},
                note=f"by site {site_moved['min']:.3f}..{site_moved['max']:.3f} over secrets "
                f"(whole sites move); by key {key_moved['min']:.3f}..{key_moved['max']:.3f}",
            )
        )
    result.promised = [figure.key for figure in result.figures]
    result.raw = {
        "keys": keys,
        "secrets": len(secrets),
        "site_sizes_head": {name: sizes[:5] for name, sizes in workloads.items()},
        "arms": arms,
        "cpus": os.cpu_count() or 0,
    }
    chart(result, arms)
    return report.emit(result)


if __name__ == "__main__":
    raise SystemExit(main())
