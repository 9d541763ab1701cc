"""The bench runner's own contract: a section fails the run when it crashes, writes no
results, or leaves a promised row unmeasured; a missing section fails."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import uuid
from pathlib import Path

import msgspec
import psutil
import pytest
from node_harness import wait_for

from bench import __main__ as runner
from bench.harness import report

SECTION = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from bench.harness import report

    def main(argv=None):
        result = report.new_result(Path(__file__).stem, "--quick" in sys.argv)
        result.figures = [
            report.Figure(table="t", what="made", unit="us", ours=OURS, seed=2.0,
                          peers={"peer": PEER}),
        ]
        result.promised = ["t/made"] + EXTRA
        result.pending = PENDING
        result.raw = RAW
        status = report.emit(result)
        return EXIT or status

    if __name__ == "__main__":
        sys.exit(main())
    """
)


@pytest.fixture
def sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    results = tmp_path / "results"
    monkeypatch.setenv("RENDERQUEUE_BENCH_RESULTS", str(results))
    monkeypatch.setattr(report, "RESULTS_DIR", results)
    # The fake sections import the real bench package, so the repository must be on the path.
    repo = Path(runner.__file__).resolve().parent.parent
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{repo}")
    package = tmp_path / "fakebench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    return tmp_path


def write_section(root: Path, **values: object) -> str:
    name = f"s_{uuid.uuid4().hex[:8]}"
    defaults: dict[str, object] = {
        "OURS": 1.0,
        "PEER": 3.0,
        "EXTRA": [],
        "PENDING": {},
        "EXIT": 0,
        "RAW": {},
    }
    defaults.update(values)
    header = "".join(f"{key} = {value!r}\n" for key, value in defaults.items())
    (root / "fakebench" / f"{name}.py").write_text(header + SECTION)
    return name


def run(root: Path, name: str) -> runner.SectionRun:
    record, _ = runner.run_section(name, True, 60, package="fakebench", cwd=root)
    return record


def test_a_section_that_produces_every_promised_row_passes(sandbox: Path) -> None:
    record = run(sandbox, write_section(sandbox))
    assert record.status == "ok", record
    assert record.gaps == []


def test_an_unmeasured_cell_or_an_absent_row_fails(sandbox: Path) -> None:
    assert run(sandbox, write_section(sandbox, PEER=None)).status == "missing rows"
    absent = run(sandbox, write_section(sandbox, EXTRA=["t/never made"]))
    assert absent.status == "missing rows"
    assert absent.gaps == ["t/never made: row absent"]


def test_a_declared_pending_column_is_reported_not_failed(sandbox: Path) -> None:
    record = run(sandbox, write_section(sandbox, PEER=None, PENDING={"peer": "pending: node"}))
    assert record.status == "ok"
    assert record.pending == {"peer": "pending: node"}


def test_a_crashing_section_fails(sandbox: Path) -> None:
    assert run(sandbox, write_section(sandbox, EXIT=3)).status == "failed"
    broken = sandbox / "fakebench" / "broken.py"
    broken.write_text("raise SystemExit('boom')\n")
    record = run(sandbox, "broken")
    assert record.status == "failed"
    assert "wrote no" in record.detail


def test_a_failed_judgement_is_named_in_the_runners_last_word(sandbox: Path) -> None:
    judged = {"failures": ["2 HTTP 5xx answer(s)"]}
    record = run(sandbox, write_section(sandbox, EXIT=1, RAW=judged))
    assert record.status == "failed"
    assert record.detail == "exit status 1: 2 HTTP 5xx answer(s)"


def test_a_stale_result_file_never_passes_for_a_new_run(sandbox: Path) -> None:
    report.RESULTS_DIR.mkdir(parents=True)
    (report.RESULTS_DIR / "silent-quick.json").write_text("{}")
    (sandbox / "fakebench" / "silent.py").write_text("print('| a |')\n")
    assert run(sandbox, "silent").status == "failed"


def test_a_missing_section_fails(sandbox: Path) -> None:
    record = run(sandbox, "nothing_here")
    assert record.status == "failed"
    assert "no fakebench/nothing_here.py" in record.detail


def test_sections_run_side_by_side_answer_in_the_order_asked(sandbox: Path) -> None:
    good = [write_section(sandbox), write_section(sandbox, OURS=5.0)]
    crashing = write_section(sandbox, EXIT=3)
    asked = [good[0], crashing, good[1]]
    done = runner.run_sections(asked, True, 60, jobs=2, package="fakebench", cwd=sandbox)
    assert [record.section for record, _ in done] == asked
    assert [record.status for record, _ in done] == ["ok", "failed", "ok"]
    assert "| 5" in done[2][1] and "| 1" in done[0][1]


def test_a_run_stopped_while_sections_run_side_by_side_stops_every_one(sandbox: Path) -> None:
    pids = sandbox / "pids"
    pids.mkdir()
    release = sandbox / "release"
    # Each section runs until it is stopped or released; a released one leaves a mark.
    sleeper = textwrap.dedent(
        f"""
        import os, pathlib, time
        pathlib.Path({str(pids)!r}, str(os.getpid())).write_text("")
        while not pathlib.Path({str(release)!r}).exists():
            time.sleep(0.05)
        pathlib.Path({str(sandbox)!r}, f"released_{{os.getpid()}}").write_text("")
        """
    )
    names = [f"sleeper_{n}" for n in range(2)]
    for name in names:
        (sandbox / "fakebench" / f"{name}.py").write_text(sleeper)
    returned = threading.Event()

    def interrupt_once_both_run() -> None:
        wait_for(lambda: len(list(pids.iterdir())) == 2, 60, "both sections to start")
        os.kill(os.getpid(), signal.SIGUSR1)
        # A runner that left its sections running would wait on them for ever: release
        # them, and the marks they leave fail the test.
        if not returned.wait(60):
            release.write_text("")

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, stop)
    trigger = threading.Thread(target=interrupt_once_both_run, daemon=True)
    try:
        trigger.start()
        with pytest.raises(KeyboardInterrupt):
            runner.run_sections(names, True, 600, jobs=2, package="fakebench", cwd=sandbox)
        returned.set()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        trigger.join(120)
    started = [int(path.name) for path in pids.iterdir()]
    assert len(started) == 2
    assert not list(sandbox.glob("released_*")), "a section ran on after the run was stopped"

    # The runner waits for each child it stops: none is left, not even a zombie.
    assert not any(psutil.pid_exists(pid) for pid in started)


def test_markdown_puts_the_seed_and_each_peer_beside_ours() -> None:
    result = report.new_result("x", False, ours_label="renderqueue")
    result.figures = [
        report.Figure(table="T", what="p50", unit="us", ours=50.0, seed=100.0, peers={"pg": 200.0})
    ]
    text = report.markdown(result)
    header = next(line for line in text.splitlines() if line.startswith("| what"))
    assert "seed" in header and "renderqueue" in header and "÷ pg" in header
    row = next(line for line in text.splitlines() if line.startswith("| p50"))
    assert "0.50×" in row and "0.25×" in row


def test_percentile_is_nearest_rank() -> None:
    samples = list(range(1, 101))
    assert report.percentile(samples, 50) == 50
    assert report.percentile(samples, 99) == 99
    assert report.percentile([], 50) is None


def test_standing_rows_say_better_worse_meets_and_ahead_of() -> None:
    from bench.harness import standing as report_standing

    result = report.new_result("s", False)
    result.figures = [
        report.Figure(table="T", what="p50", unit="us", ours=50.0, seed=100.0),
        report.Figure(table="T", what="rate", unit="/s", ours=5.0, seed=10.0, better="higher"),
        report.Figure(table="T", what="rows", ours=9.0, seed=10.0, target="every row"),
        report.Figure(
            table="T", what="claim", unit="us", ours=2.0, peers={"a": 1.0, "b": 3.0, "c": None}
        ),
    ]
    seed = "\n".join(report_standing.against_seed([result]))
    assert "| p50 | us | 100 | 50.0 | 0.50× | better |" in seed
    assert "| rate | /s | 10.0 | 5.00 | 0.50× | worse |" in seed
    assert "| misses |" in seed
    peers = "\n".join(report_standing.against_peers([result]))
    assert "| claim | us | 2.00 | a | 1.00 | 2.00× | 1 of 2 |" in peers


def test_node_split_rows_of_a_side_that_served_nothing_are_pending_not_missing() -> None:
    from bench.sections import node

    def arm(claimants: int, share: float, zero_us: float | None) -> node.ArmResult:
        return node.ArmResult(
            peer=node.OURS, batch=100, claimants=claimants, keys=100, seconds=1.0,
            keys_per_s=100.0, claim_p50_us=10.0, claim_p99_us=20.0, complete_p50_us=None,
            complete_p99_us=None, granted_twice=0, worker0_share=share,
            worker0_claim_p50_us=zero_us, worker0_claim_p99_us=zero_us,
            others_claim_p50_us=10.0, others_claim_p99_us=20.0,
        )  # fmt: skip

    arms = [arm(1, 0.5, 12.0), arm(4, 0.0, None)]
    result = report.new_result("node", True, ours_label=node.OURS)
    config = msgspec.structs.replace(node.QUICK, claimants=(1, 4))
    result.figures = node.figures(arms, {"p50_us": 1.0, "p99_us": 2.0}, {}, config)
    result.promised = [figure.key for figure in result.figures]

    def split_gaps() -> list[str]:
        return [gap for gap in report.missing(result) if gap.startswith(node.SPLIT_TABLE)]

    assert len(split_gaps()) == 2  # worker 0's p50 and p99 of the 4-claimant arm
    result.pending.update(node._unserved_splits(result.figures, arms))
    assert split_gaps() == []
    pending = [key for key in result.pending if key.startswith(node.SPLIT_TABLE)]
    assert sorted(pending) == sorted(
        f"{node.SPLIT_TABLE}/batch 100, 4 claimants: claim {pct}" for pct in ("p50", "p99")
    )


def test_restart_figures_compare_the_restart_with_the_fresh_start_per_row_of_memory() -> None:
    from bench.sections import restart

    empty = {"rss_bytes": 100_000_000, "keeper_bytes": 0, "held": 0}
    after = {"rss_bytes": 250_000_000, "keeper_bytes": 120_000_000, "held": 1_000_000}
    raw = {
        "fresh_start_s": 4.0, "http_restart_s": 6.0, "http_load_s": 50.0, "empty": empty,
        "after_http": after, "after_restart": after, "fresh": after,
    }  # fmt: skip
    by_what = {figure.what: figure for figure in restart.figures(raw, 1_000_000)}
    assert by_what["restart ÷ fresh start"].ours == 1.5
    assert by_what["rows through HTTP"].ours == 20_000
    memory = by_what["worker 0 resident memory per row, after a restart on them"]
    assert memory.ours == 150.0 and memory.target == "<= 150"
    assert by_what["the keeper's own count per row, started on a fresh table"].ours == 120.0
    result = report.new_result("restart", True)
    result.figures = restart.figures({}, 1_000_000)  # a run that failed before measuring
    result.promised = [figure.key for figure in result.figures]
    assert len(report.missing(result)) == len(result.figures)


def test_the_stages_stopwatch_counts_cpu_inside_a_function_and_puts_it_back() -> None:
    from bench.sections.stages import Stopwatch

    class Owner:
        @staticmethod
        def busy(n: int) -> int:
            return sum(i * i for i in range(n))

    original = Owner.busy
    watch = Stopwatch()
    watch.wrap(Owner, "busy", "busy")
    with watch.timing():
        assert Owner.busy(200_000) == original(200_000)
        assert Owner.busy is not original
    assert Owner.busy is original
    assert watch.spent["busy"] > 0
    spent = watch.spent["busy"]
    Owner.busy(200_000)  # unwrapped again: no longer counted
    assert watch.spent["busy"] == spent


def test_a_run_writes_its_figures_where_git_ignores_them() -> None:
    import subprocess

    repo = Path(runner.__file__).resolve().parent.parent
    default = repo / "var" / "bench"
    assert repo == report.REPO
    for name in ("peers.json", "summary.md", "peers-quick.png"):
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", str(default / name)], cwd=repo, check=False
        )
        assert ignored.returncode == 0, f"var/bench/{name} is not ignored by git"


def test_publish_copies_the_summary_and_the_charts_it_links_only(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.md").write_text("# s\n\nChart: [peers.png](peers.png)\n")
    (run_dir / "peers.png").write_bytes(b"png")
    (run_dir / "peers.json").write_text("{}")
    (run_dir / "other.png").write_bytes(b"unlinked")
    published = tmp_path / "published"
    copied = runner.publish(run_dir / "summary.md", published)
    assert sorted(p.name for p in copied) == ["peers.png", "summary.md"]
    assert sorted(p.name for p in published.iterdir()) == ["peers.png", "summary.md"]


def test_a_quick_section_run_leaves_the_tracked_tree_as_it_was(tmp_path: Path) -> None:
    """The cheapest real section (shm, seconds), run as a user runs it, with its figures
    sent to a scratch directory: nothing under bench/ is written, added or changed."""
    import os
    import subprocess
    import sys

    repo = Path(runner.__file__).resolve().parent.parent

    def status() -> str:
        return subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=all", "--", "bench"],
            cwd=repo,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    before = status()
    env = {**os.environ, "RENDERQUEUE_BENCH_RESULTS": str(tmp_path / "results")}
    subprocess.run(
        [sys.executable, "-m", "bench", "shm", "--quick"],
        cwd=repo,
        env=env,
        capture_output=True,
        check=True,
        timeout=300,
    )
    assert (tmp_path / "results" / "shm-quick.json").is_file()
    assert status() == before


def test_publish_without_a_full_run_says_so_and_changes_nothing(
    sandbox: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("bench.__main__.signal.signal", lambda *args: None)  # keep ours
    with pytest.raises(SystemExit) as stopped:
        runner.main(["publish"])
    assert stopped.value.code == 2
    assert not report.RESULTS_DIR.exists()
