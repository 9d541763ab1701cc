"""The bench runner: `python -m bench all [--quick]` or `python -m bench <section> [--quick]`.

Each section runs in its own process, so one section's memory and threads never
bleed into the next one's figures. A section fails the run when it exits
non-zero, writes no JSON, or leaves a promised row unmeasured without saying it
is pending. `--quick` checks that every row is produced, never what it says.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from bench.harness import report, standing

SECTIONS = (
    "store",
    "shm",
    "keeper",
    "node",
    "sites",
    "site_owners",
    "cadence",
    "stages",
    "hot",
    "sitemap",
    "single",
    "peers",
    "churn",
    "restart",
    "postgres",
    "cluster",
    "faults",
)
# Run only by name (`python -m bench soak --minutes N`), never by `all`: they take minutes
# of a machine on purpose.
ON_DEMAND = ("soak", "soak_postgres")
BENCH_DIR = Path(__file__).resolve().parent
SECTIONS_DIR = BENCH_DIR / "sections"
# Tracked: the published summary and the charts it links, nothing else (`publish`).
PUBLISHED_DIR = BENCH_DIR / "results"
# A hang guard per section, well above the longest quick section (faults: thirteen
# cluster scenarios on real nodes, each waiting out real leases and TTLs, and slower by
# half again when other jobs share the machine's two cores).
QUICK_TIMEOUT_S = 1200
FULL_TIMEOUT_S = 4 * 3600
# The quick run's longest sections, which mostly wait (on real leases and TTLs, on the
# peers' loads): with `--jobs` above 1 they start first and the rest fill in beside them.
LONGEST_FIRST = ("faults", "peers", "cluster", "postgres")


class SectionRun(msgspec.Struct, kw_only=True):
    section: str
    status: str  # ok | failed | missing rows | timed out
    elapsed_s: float = 0.0
    returncode: int | None = None
    gaps: list[str] = []
    pending: dict[str, str] = {}
    results: str = ""  # the section's JSON, relative to the repository
    detail: str = ""


class Summary(msgspec.Struct, kw_only=True):
    quick: bool
    command: str
    started_at_ms: int
    elapsed_s: float
    ok: bool
    sections: list[SectionRun]
    machine: dict[str, str]


def exists(section: str, directory: Path = SECTIONS_DIR) -> bool:
    return (directory / f"{section}.py").is_file()


def run_section(
    section: str,
    quick: bool,
    timeout_s: float,
    *,
    package: str = "bench.sections",
    cwd: Path | None = None,
    extra: Sequence[str] = (),
) -> tuple[SectionRun, str]:
    """Run one section in a child process; returns its record and its markdown."""
    cwd = cwd or BENCH_DIR.parent
    module = f"{package.replace('.', '/')}/{section}.py"
    if not exists(section, cwd / package.replace(".", "/")):
        report.progress(f"{section}: FAILED: no {module}")
        return SectionRun(section=section, status="failed", detail=f"no {module}"), ""
    path = report.results_path(section, quick)
    # A stale file from an earlier run must never pass for this run's output.
    path.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        f"{package}.{section}",
        *(["--quick"] if quick else []),
        *extra,
    ]
    report.progress(f"{section}: running {' '.join(command[1:])}")
    started = time.monotonic()
    # stderr is inherited so the section's progress shows live; stdout is its tables.
    child = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    with _running_lock:
        _running.add(child)
    try:
        stdout_text, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_section(child)
        elapsed = round(time.monotonic() - started, 1)
        report.progress(f"{section}: TIMED OUT after {elapsed} s")
        return SectionRun(section=section, status="timed out", elapsed_s=elapsed), ""
    except BaseException:
        stop_section(child)
        raise
    finally:
        with _running_lock:
            _running.discard(child)
    done = subprocess.CompletedProcess(command, child.returncode, stdout_text)
    elapsed = round(time.monotonic() - started, 1)
    record = SectionRun(
        section=section,
        status="ok",
        elapsed_s=elapsed,
        returncode=done.returncode,
        results=_shown(path),
    )
    stdout = done.stdout or ""
    if stdout:
        sys.stdout.write(stdout)
        sys.stdout.flush()
    if not path.is_file():
        record.status = "failed"
        record.detail = f"wrote no {record.results}"
    else:
        record, stdout = _check(record, path, stdout)
    if done.returncode != 0 and record.status == "ok":
        record.status = "failed"
        record.detail = f"exit status {done.returncode}" + (
            f": {record.detail}" if record.detail else ""
        )
    report.progress(f"{section}: {record.status} in {elapsed} s {record.detail}".rstrip())
    return record, stdout


# Sections running now: a run stopped while sections run side by side stops each of them
# (`run_sections`), not only the one its main thread waits on.
_running: set[subprocess.Popen[str]] = set()
_running_lock = threading.Lock()


def run_sections(
    sections: Sequence[str],
    quick: bool,
    timeout_s: float,
    *,
    jobs: int = 1,
    extra: Sequence[str] = (),
    package: str = "bench.sections",
    cwd: Path | None = None,
) -> list[tuple[SectionRun, str]]:
    """Each section's record and markdown, in `sections`' order; up to `jobs` at once."""

    def one(section: str) -> tuple[SectionRun, str]:
        return run_section(section, quick, timeout_s, package=package, cwd=cwd, extra=extra)

    if jobs <= 1 or len(sections) <= 1:
        out = []
        for position, section in enumerate(sections, 1):
            report.progress(f"section {position}/{len(sections)}: {section}")
            out.append(one(section))
        return out
    first = [section for section in LONGEST_FIRST if section in sections]
    order = first + [section for section in sections if section not in first]
    report.progress(f"{len(sections)} sections, {jobs} at a time: {', '.join(order)}")
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="section")
    try:
        futures = {section: pool.submit(one, section) for section in order}
        return [futures[section].result() for section in sections]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        with _running_lock:
            running = list(_running)
        for child in running:
            stop_section(child)
        raise
    finally:
        pool.shutdown(wait=True)


def stop_section(child: subprocess.Popen[str]) -> None:
    """SIGTERM first, so the section drops its tables, segments and files; then SIGKILL."""
    child.terminate()
    try:
        child.wait(30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(10)


def _shown(path: Path) -> str:
    try:
        return str(path.relative_to(BENCH_DIR.parent))
    except ValueError:
        return str(path)


def _check(record: SectionRun, path: Path, stdout: str) -> tuple[SectionRun, str]:
    try:
        result = report.load(path)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # A section that writes its own JSON shape still ran; its rows cannot be checked.
        record.detail = f"rows unchecked: {path.name} is not a bench.harness.report result ({exc})"
        if "|" not in stdout:
            record.status = "missing rows"
            record.gaps = ["printed no markdown table"]
        return record, stdout
    record.pending = dict(result.pending)
    # A section that judged its own run (the soak) names what broke in its raw record; the
    # runner repeats it last, where a log's tail shows it after the section's long tables.
    failures = result.raw.get("failures")
    if isinstance(failures, list) and failures:
        record.detail = "; ".join(str(f) for f in failures)[:2000]
    record.gaps = report.missing(result)
    if not result.figures:
        record.gaps.append("produced no rows")
    if record.gaps:
        record.status = "missing rows"
        record.detail = f"{len(record.gaps)} promised figure(s) not produced"
    return record, report.markdown(result)


def write_summary(summary: Summary, tables: list[tuple[str, str]]) -> Path:
    stem = "summary-quick" if summary.quick else "summary"
    report.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    json_path = report.RESULTS_DIR / f"{stem}.json"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=1))
    lines = [
        "# renderqueue benchmarks" + (" (quick)" if summary.quick else ""),
        "",
        f"Made by `{summary.command}` in {summary.elapsed_s:.0f} s on "
        f"{summary.machine.get('cpus', '?')} CPUs ({summary.machine.get('platform', '')}), "
        f"load {summary.machine.get('load_avg_1m', '?')} at the start. "
        "Method and caveats: `bench/README.md`.",
        "",
        "| section | status | time (s) | note |",
        "|---|---|---|---|",
    ]
    for run in summary.sections:
        note = run.detail or ("; ".join(f"{k}: {v}" for k, v in run.pending.items()))
        lines.append(f"| {run.section} | {run.status} | {run.elapsed_s:.0f} | {note} |")
    lines.append("")
    for run in summary.sections:
        if run.gaps:
            lines.append(f"Missing in {run.section}:")
            lines.extend(f"- {gap}" for gap in run.gaps)
            lines.append("")
    results = _results(summary)
    seed = standing.against_seed(results)
    if seed:
        lines += ["## Against the seed (every figure the seed gives)", "", *seed, ""]
    peers = standing.against_peers(results)
    if peers:
        lines += [
            "## Against the peers and baselines (our best arm ÷ the best other column)",
            "",
            *peers,
            "",
        ]
    for section, markdown in tables:
        if markdown.strip():
            lines += [f"## {section}", "", markdown.strip(), ""]
            lines += _chart_link(section, summary.quick)
    md_path = report.RESULTS_DIR / f"{stem}.md"
    md_path.write_text("\n".join(lines))
    return md_path


def _chart_link(section: str, quick: bool) -> list[str]:
    chart = f"{section}-quick.png" if quick else f"{section}.png"
    return [f"Chart: [{chart}]({chart})", ""] if (report.RESULTS_DIR / chart).is_file() else []


def resummarize(quick: bool) -> Path:
    """The summary again from the saved results (after the report's format improved), with
    the tables of any section run on its own since (`python -m bench soak`) appended."""
    stem = "summary-quick" if quick else "summary"
    summary = msgspec.json.decode((report.RESULTS_DIR / f"{stem}.json").read_bytes(), type=Summary)
    tables = []
    for run in summary.sections:
        path = report.results_path(run.section, quick)
        markdown = ""
        if run.status in ("ok", "missing rows") and path.is_file():
            markdown = report.markdown(report.load(path))
        tables.append((run.section, markdown))
    path = write_summary(summary, tables)
    ran = {run.section for run in summary.sections}
    alone = []
    for section in sorted(set(SECTIONS + ON_DEMAND + tuple(_sections_present())) - ran):
        result_path = report.results_path(section, quick)
        try:
            result = report.load(result_path)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        command = f"python -m bench {section}" + (" --quick" if quick else "")
        alone += [f"## {section} (run alone: `{command}`)", "", report.markdown(result).strip(), ""]
        alone += _chart_link(section, quick)
    if alone:
        path.write_text(path.read_text().rstrip("\n") + "\n\n" + "\n".join(alone))
    report.progress(f"summary: {path}")
    return path


def _sections_present() -> list[str]:
    return sorted(p.stem for p in SECTIONS_DIR.glob("*.py") if not p.stem.startswith("_"))


def publish(path: Path, published: Path = PUBLISHED_DIR) -> list[Path]:
    """Copy a summary and the charts it links into the tracked bench/results/ (the only
    figures the repository keeps); the per-run JSON stays where the run wrote it."""
    text = path.read_text()
    published.mkdir(parents=True, exist_ok=True)
    copied = [published / "summary.md"]
    shutil.copyfile(path, copied[0])
    for chart in sorted(set(re.findall(r"\]\(([\w.-]+\.png)\)", text))):
        shutil.copyfile(path.parent / chart, published / chart)
        copied.append(published / chart)
    return copied


def _results(summary: Summary) -> list[report.SectionResult]:
    found = []
    for run in summary.sections:
        path = report.results_path(run.section, summary.quick)
        if run.status in ("ok", "missing rows") and path.is_file():
            try:
                found.append(report.load(path))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "section",
        help=f"'all', 'publish' (copy the last full run's summary and charts into "
        f"bench/results/), or one of: {', '.join(SECTIONS + ON_DEMAND)}",
    )
    parser.add_argument("--quick", action="store_true", help="scaled down; checks rows only")
    parser.add_argument("--timeout", type=float, default=None, help="per section, seconds")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="sections run at once; a quick run's only (a full run's figures need the "
        "machine to themselves)",
    )
    parser.add_argument(
        "--resummarize",
        action="store_true",
        help="run nothing: rewrite the summary from the last run's results files",
    )
    # Flags the runner does not know (soak's --minutes) go to a single section.
    args, extra = parser.parse_known_args(argv)
    if extra and args.section == "all":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    # SIGTERM as an exception: subprocess.run then kills the running section on its way
    # out, so a stopped run leaves no section (and no claimant or node) behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.section == "publish":
        # The last full run's summary, rebuilt from its results, into bench/results/.
        if not (report.RESULTS_DIR / "summary.json").is_file():
            parser.error(f"no full run to publish in {report.RESULTS_DIR}: run `make bench` first")
        for path in publish(resummarize(quick=False)):
            report.progress(f"published: {_shown(path)}")
        return 0
    if args.resummarize:
        resummarize(args.quick)
        return 0
    quick: bool = args.quick
    if args.jobs < 1 or (args.jobs > 1 and not quick):
        parser.error("--jobs takes 1, or more with --quick: a full run's sections run alone")
    timeout_s = args.timeout or (QUICK_TIMEOUT_S if quick else FULL_TIMEOUT_S)
    if args.section == "all":
        sections: tuple[str, ...] = SECTIONS
    elif args.section in SECTIONS or exists(args.section):
        sections = (args.section,)
    else:
        parser.error(f"no section {args.section!r}; known: {', '.join(SECTIONS)}")
    started_ms = report.now_ms()
    machine = report.machine_info()
    done = run_sections(sections, quick, timeout_s, jobs=args.jobs, extra=extra)
    runs = [record for record, _ in done]
    tables = [(record.section, markdown) for record, markdown in done]
    failed = [r for r in runs if r.status != "ok"]
    command = "make bench-quick" if quick and args.section == "all" else "make bench"
    if args.section != "all":
        command = f".venv/bin/python -m bench {args.section}" + (" --quick" if quick else "")
        command += "".join(f" {flag}" for flag in extra)
    summary = Summary(
        quick=quick,
        command=command,
        started_at_ms=started_ms,
        elapsed_s=round((report.now_ms() - started_ms) / 1000, 1),
        ok=not failed,
        sections=runs,
        machine=machine,
    )
    if args.section == "all":
        path = write_summary(summary, tables)
        report.progress(f"summary: {path}")
    for run in runs:
        report.progress(f"  {run.section:8} {run.status:14} {run.elapsed_s:7.1f} s  {run.detail}")
        for gap in run.gaps:
            report.progress(f"      missing: {gap}")
        for what, why in run.pending.items():
            report.progress(f"      pending: {what}: {why}")
    if failed:
        report.progress(f"FAILED: {', '.join(r.section for r in failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
