"""Where renderqueue stands: every figure the seed gives, and every peer row, in two tables.

The runner puts these at the top of the summary, so the closing note can quote
them as they are: ahead or behind, row by row, from one run.
"""

from __future__ import annotations

from bench.harness import report

EXACT_TARGETS = {"0", "1", "equal", "every row"}
# Columns that are our own other arms (the HTTP path, another worker), not peers to beat.
OURS_OTHER_ARMS = {"renderqueue HTTP", "worker 1", "one process"}


def _verdict(figure: report.Figure, other: float | None) -> str:
    if figure.ours is None or other is None:
        return "not measured"
    if figure.target in EXACT_TARGETS:
        return "meets" if figure.ours == other else "misses"
    return {"ahead": "better", "behind": "worse", "=": "equal"}.get(
        report.verdict(figure, other), ""
    )


def _label(result: report.SectionResult, figure: report.Figure) -> str:
    """The row's name, with its table's when the section repeats it (one row per scale)."""
    repeats = sum(1 for f in result.figures if f.what == figure.what)
    return f"{figure.what} ({figure.table})" if repeats > 1 else figure.what


def against_seed(results: list[report.SectionResult]) -> list[str]:
    lines = [
        "| section | what | unit | seed | ours | ours ÷ seed | standing |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = 0
    for result in results:
        for figure in result.figures:
            if figure.seed is None:
                continue
            rows += 1
            lines.append(
                f"| {result.section} | {_label(result, figure)} | {figure.unit} | "
                f"{figure.seed_text or report.fmt(figure.seed)} | {report.fmt(figure.ours)} | "
                f"{report.ratio(figure.ours, figure.seed)} | {_verdict(figure, figure.seed)} |"
            )
    return lines if rows else []


def against_peers(results: list[report.SectionResult]) -> list[str]:
    """Each peer row: ours beside the best peer, and how many peers ours is ahead of."""
    lines = [
        "| section | what | unit | ours | best peer | its figure | ours ÷ it | ahead of |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = 0
    for result in results:
        for figure in result.figures:
            peers = {
                name: value
                for name, value in figure.peers.items()
                if name not in OURS_OTHER_ARMS and value is not None
            }
            if not peers or figure.target in EXACT_TARGETS:
                continue
            pick = min if figure.better == "lower" else max
            best = pick(peers, key=lambda name: peers[name])
            ahead = sum(1 for value in peers.values() if report.verdict(figure, value) == "ahead")
            rows += 1
            lines.append(
                f"| {result.section} | {_label(result, figure)} | {figure.unit} | "
                f"{report.fmt(figure.ours)} | "
                f"{best} | {report.fmt(peers[best])} | {report.ratio(figure.ours, peers[best])} | "
                f"{ahead} of {len(peers)} |"
            )
    return lines if rows else []
