"""The peer comparison as a PNG: throughput and claim latency per arm, and growth."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import report

if TYPE_CHECKING:
    from bench.peers import Config, PeerRun


def save(figure: Any, result: report.SectionResult, *, dpi: int) -> Path:
    """The section's chart beside its results (`<section>.png`, `-quick` when scaled down)."""
    figure.tight_layout()
    stem = result.section + ("-quick" if result.quick else "")
    path = report.RESULTS_DIR / f"{stem}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


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
    return save(figure, result, dpi=90)


def _two_at_100(arm: Any, peer: str, complete: bool) -> bool:
    from bench.postgres import CLAIMANTS

    return (arm.peer, arm.complete, arm.batch, arm.claimants) == (peer, complete, 100, CLAIMANTS)


def postgres_chart(result: report.SectionResult, puts: dict[str, Any], claims: list[Any]) -> Path:
    """bench/postgres: put latency by arm, NOTIFY's cost, claims beside SKIP LOCKED, and
    where the CPU per claimed key goes."""
    from bench.postgres import OURS, SHAPES, SKIP_LOCKED

    figure, axes = plt.subplots(2, 2, figsize=(17, 11))
    (put_axis, notify_axis), (claim_axis, cpu_axis) = axes
    names = [n for n, arm in puts.items() if arm.writes]
    ys = range(len(names))
    for offset, q in ((-0.2, 50), (0.2, 99)):
        put_axis.barh(
            [y + offset for y in ys],
            [puts[n].put_us(q) or 0 for n in names],
            0.4,
            label=f"put p{q}",
        )
    put_axis.set_yticks(list(ys), names, fontsize=8)
    put_axis.set_xscale("log")
    put_axis.set_xlabel("µs")
    put_axis.set_title("single-row puts by arm (lower is better)")
    put_axis.legend(fontsize=8)
    put_axis.invert_yaxis()
    pairs = [
        (n, f"{n}, NOTIFY off")
        for n in names
        if f"{n}, NOTIFY off" in puts and puts[f"{n}, NOTIFY off"].writes
    ]
    xs = range(len(pairs))
    for offset, which, label in ((-0.2, 0, "NOTIFY on (shipped)"), (0.2, 1, "NOTIFY off")):
        notify_axis.bar(
            [x + offset for x in xs],
            [
                puts[pair[which]].writes / puts[pair[which]].seconds
                if puts[pair[which]].seconds
                else 0
                for pair in pairs
            ],
            0.4,
            label=label,
        )
    notify_axis.set_xticks(list(xs), [p[0].replace(", ", "\n") for p in pairs], fontsize=8)
    notify_axis.set_ylabel("writes/s, all writers")
    notify_axis.set_title("NOTIFY's cost: throughput with the log trigger's NOTIFY on and off")
    notify_axis.legend(fontsize=8)
    notify_axis.grid(axis="y", alpha=0.3)
    modes = list(SHAPES)
    labels = [
        f"{'claim+complete' if c else 'claims alone'}\nbatch {b}\n{n} claimants"
        for c, b, n in modes
    ]
    for offset, peer in ((-0.2, OURS), (0.2, SKIP_LOCKED)):
        by = {(a.complete, a.batch, a.claimants): a for a in claims if a.peer == peer}
        claim_axis.bar(
            [i + offset for i in range(len(modes))],
            [by[m].keys_per_s if m in by else 0 for m in modes],
            0.4,
            label=peer,
        )
    claim_axis.set_xticks(range(len(modes)), labels, fontsize=8)
    claim_axis.set_ylabel("keys/s")
    claim_axis.set_title("claims through HTTP beside SKIP LOCKED (higher is better)")
    claim_axis.legend(fontsize=8)
    claim_axis.grid(axis="y", alpha=0.3)
    stacks = [
        (peer, complete)
        for complete in (False, True)
        for peer in (OURS, SKIP_LOCKED)
        if any(_two_at_100(a, peer, complete) for a in claims)
    ]
    groups = [
        "claimants",
        "node worker 0",
        "node worker 1",
        "node supervisor",
        "PostgreSQL backends",
    ]
    bottoms = [0.0] * len(stacks)
    for group in groups:
        heights = []
        for peer, complete in stacks:
            arm = next(a for a in claims if _two_at_100(a, peer, complete))
            heights.append(arm.cpu_us_per_key(group) or 0.0)
        cpu_axis.bar(range(len(stacks)), heights, 0.6, bottom=bottoms, label=group)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    cpu_axis.set_xticks(
        range(len(stacks)),
        [f"{p}\n{'claim+complete' if c else 'claims alone'}" for p, c in stacks],
        fontsize=8,
    )
    cpu_axis.set_ylabel("CPU µs per claimed key")
    cpu_axis.set_title("where the CPU goes, batch 100, two claimants")
    cpu_axis.legend(fontsize=8)
    cpu_axis.grid(axis="y", alpha=0.3)
    scale = "quick, scaled down" if result.quick else "full scale"
    figure.suptitle(
        f"renderqueue on PostgreSQL ({scale}); {result.machine.get('cpus', '?')} CPUs, "
        f"load {result.machine.get('load_avg_1m', '?')} at the start, one run"
    )
    return save(figure, result, dpi=90)


def soak_chart(result: report.SectionResult, series: dict[str, Any]) -> Path:
    """bench/soak: claims/s, claim p99, due and each node process's RSS over the run, with
    the faults marked."""
    figure, axes = plt.subplots(4, 1, figsize=(14, 15), sharex=True)
    claims, p99, due, rss = axes
    for axis, key, title, unit in (
        (claims, "claims_per_s", "keys granted per second (5 s buckets)", "keys/s"),
        (p99, "claim_p99_ms", "claim p99, first-attempt answers (10 s buckets)", "ms"),
        (due, "due", "due (queue-state, while it vouches)", "rows"),
    ):
        points = series[key]
        axis.plot([p[0] for p in points], [p[1] for p in points], ".-", linewidth=1, markersize=2)
        axis.set_title(title)
        axis.set_ylabel(unit)
        axis.grid(alpha=0.3)
    p99.set_yscale("log")
    for label, points in sorted(series["rss_mb"].items()):
        rss.plot([p[0] for p in points], [p[1] for p in points], linewidth=1, label=label)
    rss.set_title("RSS per node process (a new pid after each kill or restart)")
    rss.set_ylabel("MB")
    rss.set_xlabel("seconds from the start of the load")
    rss.grid(alpha=0.3)
    rss.legend(fontsize=7, ncol=4)
    colours = {"kill": "red", "stop": "orange", "restart": "purple"}
    for axis in axes:
        for start, end, kind in series["faults"]:
            colour = colours.get(kind, "brown")
            if end - start >= 0.5:  # a stop, a restart: the span it lasted
                axis.axvspan(start, end, color=colour, alpha=0.15, linewidth=0)
            axis.axvline(start, color=colour, alpha=0.5, linewidth=0.8)
    backend = result.raw.get("backend", "")
    config: Any = result.raw.get("config") or {}
    figure.suptitle(
        f"renderqueue soak on {backend}, {config.get('minutes', 0):g} min; faults: "
        "kill (red), SIGSTOP worker 0 (orange), restart (purple), PostgreSQL backends (brown); "
        f"{result.machine.get('cpus', '?')} CPUs, load {result.machine.get('load_avg_1m', '?')}",
        fontsize=10,
    )
    return save(figure, result, dpi=80)


def stages_chart(result: report.SectionResult, stages: dict[int, dict[str, float]]) -> Path:
    """bench/stages: a key's CPU by stage, one stacked bar per batch size."""
    # (stage, legend, the stages inside it, drawn apart)
    parts: tuple[tuple[str, str, tuple[str, ...]], ...] = (
        ("post-grant read", "claim: post-grant read", ()),
        ("claim", "claim: the rest", ("post-grant read",)),
        ("UPDATE statements", "completion: UPDATE statements", ()),
        ("feed handoff", "completion: feed handoff", ()),
        (
            "store.complete",
            "completion: rest of store.complete",
            ("UPDATE statements", "feed handoff"),
        ),
        ("completion", "completion: the API's part", ("store.complete",)),
        ("keeper", "keeper thread", ()),
    )
    batches = sorted(stages)
    figure, axis = plt.subplots(figsize=(11, 2.4 + 1.1 * len(batches)))
    left = [0.0] * len(batches)
    for label, name, inside in parts:
        values = []
        for batch in batches:
            spent = stages[batch]
            value = spent.get(label, 0.0)
            values.append(max(0.0, value - sum(spent.get(m, 0.0) for m in inside)))
        axis.barh([f"batch {b}" for b in batches], values, left=left, label=name)
        left = [a + b for a, b in zip(left, values, strict=True)]
    axis.set_xlabel("CPU µs per claimed and completed key (lower is better)")
    axis.grid(axis="x", alpha=0.3)
    axis.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    config: Any = result.raw.get("config") or {}
    figure.suptitle(
        f"Where a key's CPU goes, in process: {config.get('rows', 0):,} rows, 20% due "
        f"({'quick' if result.quick else 'full scale'}; {result.machine.get('cpus', '?')} CPUs, "
        f"load {result.machine.get('load_avg_1m', '?')})",
        fontsize=10,
    )
    return save(figure, result, dpi=80)
