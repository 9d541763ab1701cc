"""The peer comparison as a PNG: throughput and claim latency per arm, and growth."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import report

if TYPE_CHECKING:
    from bench.peers import Config, PeerRun


def peer_chart(result: report.SectionResult, runs: dict[str, PeerRun], config: Config) -> Path:
    from bench.peers import BATCHES, PEER_ORDER

    names = [name for name in PEER_ORDER if name in runs and not runs[name].error]
    arms = [(complete, batch) for complete in (False, True) for batch in BATCHES]
    labels = [f"{'claim+complete' if c else 'claim'}\nbatch {b}" for c, b in arms]
    figure, (throughput, latency, growth) = plt.subplots(1, 3, figsize=(18, 5.5))
    width = 0.8 / max(1, len(names))
    for position, name in enumerate(names):
        by_arm = {(a.complete, a.batch): a for a in runs[name].arms}
        xs = [i + position * width for i in range(len(arms))]
        rates = [by_arm[arm].keys_per_s if arm in by_arm else 0 for arm in arms]
        p50s = [(by_arm[arm].claim_p50_us or 0) if arm in by_arm else 0 for arm in arms]
        throughput.bar(xs, rates, width, label=name)
        latency.bar(xs, p50s, width, label=name)
        points = sorted(runs[name].growth, key=lambda g: g.rows)
        growth.plot(
            [g.rows for g in points],
            [g.claim_p50_us or float("nan") for g in points],
            marker="o",
            label=name,
        )
    centre = [i + width * (len(names) - 1) / 2 for i in range(len(arms))]
    for axis, title, unit in (
        (throughput, "claimed keys/s (2 claimants; higher is better)", "keys/s"),
        (latency, "claim p50 (lower is better)", "µs"),
    ):
        axis.set_xticks(centre, labels)
        axis.set_yscale("log")
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.grid(axis="y", alpha=0.3)
    growth.set_xscale("log")
    growth.set_yscale("log")
    growth.set_title("claim p50 vs table size (1 claimant, batch 10)")
    growth.set_xlabel("rows")
    growth.set_ylabel("µs")
    growth.grid(alpha=0.3)
    throughput.legend(fontsize=8)
    scale = "quick, scaled down" if result.quick else "full scale"
    figure.suptitle(
        f"renderqueue vs peers: {config.rows:,} rows, 20% due, churned ({scale}); "
        f"{result.machine.get('cpus', '?')} CPUs, one run"
    )
    figure.tight_layout()
    path = report.RESULTS_DIR / ("peers-quick.png" if result.quick else "peers.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path
