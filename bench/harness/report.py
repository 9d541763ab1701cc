"""What every section bench reports, and how it is printed and saved.

A section builds a `SectionResult` of `Figure`s and calls `emit(result)`: the
markdown tables go to stdout, the JSON to `var/bench/<name>[-quick].json`.
The runner (`python -m bench`) reads that JSON back and fails the run when a
promised figure is missing, so a section says up front what it will produce
(`promised`) and says why a column is absent (`pending`) instead of faking it.
"""

from __future__ import annotations

import math
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal

import msgspec

from shm.segment import now_ms as now_ms  # re-exported for bench.__main__

REPO = Path(__file__).resolve().parents[2]
# A run's figures stay out of the work tree (var/ is ignored): only `python -m bench
# publish` copies a summary and its charts into the tracked bench/results/. Overridable so
# the harness's own tests never touch a real run's results.
RESULTS_DIR = Path(os.environ.get("RENDERQUEUE_BENCH_RESULTS") or REPO / "var" / "bench")

Better = Literal["lower", "higher"]


class Figure(msgspec.Struct, frozen=True, kw_only=True):
    """One row of one table: our figure beside the seed's and each peer's."""

    table: str
    what: str
    unit: str = ""
    ours: float | None = None
    seed: float | None = None  # the seed's figure in `unit`, when it gives one number
    seed_text: str = ""  # the seed's figure as it states it ("0.16-0.25", "under 2")
    target: str = ""  # what ours must be ("lower", "<= 150")
    better: Better = "lower"
    peers: dict[str, float | None] = {}
    note: str = ""

    @property
    def key(self) -> str:
        return f"{self.table}/{self.what}"


class SectionResult(msgspec.Struct, kw_only=True):
    section: str
    quick: bool
    started_at_ms: int
    elapsed_s: float = 0.0
    ours_label: str = "ours"
    promised: list[str] = []  # Figure.key of every row the section must produce
    pending: dict[str, str] = {}  # a column or row key that cannot be measured yet -> why
    figures: list[Figure] = []
    machine: dict[str, str] = {}
    raw: dict[str, object] = {}  # the section's own detail (samples, rounds, settings)


def machine_info() -> dict[str, str]:
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
    }
    try:
        import psutil

        info["load_avg_1m"] = f"{psutil.getloadavg()[0]:.2f}"
        info["memory_gb"] = f"{psutil.virtual_memory().total / 2**30:.1f}"
    except Exception:  # psutil is a dependency, but a report must never fail on it
        pass
    return info


def new_result(section: str, quick: bool, *, ours_label: str = "ours") -> SectionResult:
    return SectionResult(
        section=section,
        quick=quick,
        started_at_ms=now_ms(),
        ours_label=ours_label,
        machine=machine_info(),
    )


def results_path(section: str, quick: bool) -> Path:
    return RESULTS_DIR / (f"{section}-quick.json" if quick else f"{section}.json")


def missing(result: SectionResult) -> list[str]:
    """Promised rows (or cells) that were not produced and are not declared pending."""
    by_key = {figure.key: figure for figure in result.figures}
    gaps: list[str] = []
    for key in result.promised:
        figure = by_key.get(key)
        if figure is None:
            if key not in result.pending:
                gaps.append(f"{key}: row absent")
            continue
        ours_pending = key in result.pending or result.ours_label in result.pending
        if not _present(figure.ours) and not ours_pending:
            gaps.append(f"{key}: {result.ours_label} not measured")
        for peer, value in figure.peers.items():
            if not _present(value) and peer not in result.pending and key not in result.pending:
                gaps.append(f"{key}: {peer} not measured")
    return gaps


def _present(value: float | None) -> bool:
    return value is not None and not (isinstance(value, float) and math.isnan(value))


def fmt(value: float | None) -> str:
    if not _present(value):
        return "—"
    assert value is not None
    magnitude = abs(value)
    if magnitude == 0:
        return "0"
    if magnitude >= 100_000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def ratio(ours: float | None, other: float | None) -> str:
    """ours ÷ other, as `0.42×`; below 1 means ours is smaller."""
    if not _present(ours) or not _present(other) or not other:
        return "—"
    assert ours is not None and other is not None
    return f"{ours / other:.2f}×"


def verdict(figure: Figure, other: float | None) -> str:
    if not _present(figure.ours) or not _present(other):
        return ""
    assert figure.ours is not None and other is not None
    if figure.ours == other:
        return "="
    ahead = figure.ours < other if figure.better == "lower" else figure.ours > other
    return "ahead" if ahead else "behind"


def markdown(result: SectionResult) -> str:
    """One markdown table per `Figure.table`, in order of first appearance."""
    tables: dict[str, list[Figure]] = {}
    for figure in result.figures:
        tables.setdefault(figure.table, []).append(figure)
    out: list[str] = []
    scale = " (quick: scaled down; figures are not the full-scale ones)" if result.quick else ""
    out.append(f"### {result.section}{scale}\n")
    for table, figures in tables.items():
        out.append(f"#### {table}\n")
        out.extend(_table_lines(result, figures))
        out.append("")
    if result.pending:
        out.append("Pending (not measured in this run):\n")
        out.extend(f"- {what}: {why}" for what, why in sorted(result.pending.items()))
        out.append("")
    return "\n".join(out)


def _table_lines(result: SectionResult, figures: Sequence[Figure]) -> list[str]:
    peers: list[str] = []
    for figure in figures:
        peers.extend(p for p in figure.peers if p not in peers)
    has_seed = any(f.seed is not None or f.seed_text for f in figures)
    has_target = any(f.target for f in figures)
    has_note = any(f.note for f in figures)
    head = ["what", "unit"]
    if has_seed:
        head += ["seed", result.ours_label, f"{result.ours_label} ÷ seed"]
    else:
        head += [result.ours_label]
    for peer in peers:
        head += [peer, f"÷ {peer}"]
    if has_target:
        head.append("target")
    if has_note:
        head.append("note")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for figure in figures:
        ours = _cell(result, figure, result.ours_label, figure.ours)
        cells = [figure.what, figure.unit]
        if has_seed:
            seed = figure.seed_text or fmt(figure.seed)
            cells += [seed, ours, ratio(figure.ours, figure.seed)]
        else:
            cells += [ours]
        for peer in peers:
            value = figure.peers.get(peer)
            cells += [_cell(result, figure, peer, value), ratio(figure.ours, value)]
        if has_target:
            cells.append(figure.target)
        if has_note:
            cells.append(figure.note)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cell(result: SectionResult, figure: Figure, column: str, value: float | None) -> str:
    if _present(value):
        return fmt(value)
    if column in result.pending or figure.key in result.pending or result.section in result.pending:
        return "pending"
    return "—"


def write(result: SectionResult) -> Path:
    path = results_path(result.section, result.quick)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(result), indent=1))
    tmp.replace(path)
    return path


def emit(result: SectionResult) -> int:
    """Finish a section: print its tables, save its JSON; non-zero if a promise is unmet."""
    result.elapsed_s = round((now_ms() - result.started_at_ms) / 1000, 3)
    print(markdown(result), flush=True)
    path = write(result)
    gaps = missing(result)
    progress(f"{result.section}: wrote {path}")
    for gap in gaps:
        progress(f"{result.section}: MISSING {gap}")
    return 1 if gaps else 0


def load(path: Path) -> SectionResult:
    return msgspec.json.decode(path.read_bytes(), type=SectionResult)


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so a stopped section still runs its cleanup
    (drops its tables, unlinks its shared memory, removes its files)."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def thread_cpu_s(thread: threading.Thread) -> float:
    """A thread's CPU seconds so far (its own clock); 0.0 for one that is not running."""
    if thread.ident is None or not thread.is_alive():
        return 0.0
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def percentile(samples: Sequence[float] | Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of the samples, or None when there are none."""
    ordered = sorted(samples)
    if not ordered:
        return None
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])
