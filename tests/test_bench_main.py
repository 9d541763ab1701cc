"""The bench runner's own contract: a section fails the run when it crashes, writes no
results, or leaves a promised row unmeasured; a missing section fails."""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

from bench import __main__ as runner
from bench import report

SECTION = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from bench import report

    def main(argv=None):
        result = report.new_result(Path(__file__).stem, "--quick" in sys.argv)
        result.figures = [
            report.Figure(table="t", what="made", unit="us", ours=OURS, seed=2.0,
                          peers={"peer": PEER}),
        ]
        result.promised = ["t/made"] + EXTRA
        result.pending = PENDING
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


def test_a_stale_result_file_never_passes_for_a_new_run(sandbox: Path) -> None:
    report.RESULTS_DIR.mkdir(parents=True)
    (report.RESULTS_DIR / "silent-quick.json").write_text("{}")
    (sandbox / "fakebench" / "silent.py").write_text("print('| a |')\n")
    assert run(sandbox, "silent").status == "failed"


def test_a_missing_section_fails(sandbox: Path) -> None:
    record = run(sandbox, "nothing_here")
    assert record.status == "failed"
    assert "no bench/nothing_here.py" in record.detail


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
    from bench import report_standing

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
