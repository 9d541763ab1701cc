"""`renderqueue fleet`: usage errors, failure sampling, and `--exec` against a real node
with a SIGINT stop in the middle of renders."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleet.cli import _sampled_failures, main

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--node", "http://x"], "one of the arguments --exec --simulate is required"),
        (["--node", "http://x", "--simulate", "--exec", "a {key}"], "not allowed with"),
        (["--node", "http://x", "--exec", "render.sh"], "must contain {key}"),
        (["--node", "http://x", "--simulate", "--lease-s", "2"], "--lease-s must be within"),
        (["--node", "http://x", "--simulate", "--wait-s", "31"], "--wait-s must be within"),
        (["--node", "http://x", "--simulate", "--concurrency", "0"], "at least 1"),
        (["--node", "http://x", "--simulate", "--failure-rate", "2"], "failure_rate"),
    ],
)
def test_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_failure_lines_are_sampled() -> None:
    seen: list[str] = []
    log = _sampled_failures(seen.append, keep=True, per_window=3, window_s=3600)
    for i in range(100):
        log(f"failed k{i}: exit 1")
    log("stopping: no new claims")
    assert seen == [
        "failed k0: exit 1",
        "failed k1: exit 1",
        "failed k2: exit 1",
        "stopping: no new claims",
    ]
    silent: list[str] = []
    log = _sampled_failures(silent.append, keep=False)
    log("failed k: simulated failure")
    log("fatal: refused")
    assert silent == ["fatal: refused"]


def test_hidden_failures_are_counted_when_the_window_turns() -> None:
    seen: list[str] = []
    log = _sampled_failures(seen.append, keep=True, per_window=1, window_s=0.05)
    log("failed a")
    log("failed b")
    log("failed c")
    time.sleep(0.1)
    log("failed d")
    assert seen == [
        "failed a",
        "... and 2 more failure(s) not shown (--verbose shows all)",
        "failed d",
    ]


def test_exec_outcomes_and_a_sigint_stop_against_a_real_node(tmp_path: Path) -> None:
    from node_harness import node_process, now_ms, wait_for

    from store import open_store
    from store.rows import RowWrite

    now = now_ms()
    keys = {
        "https://e.com/ok-1": "rendered",
        "https://e.com/ok-2": "rendered",
        "https://e.com/gone-1": "gone",
        "https://e.com/fail-1": "failed",
        "https://e.com/slow-1": "rendered",
    }
    store = open_store(str(tmp_path / "node.sqlite"))
    store.write(
        upsert=[
            RowWrite(key=key, route="page", next_render_at=now - 1000, cadence_s=3600)
            for key in keys
        ]
    )
    store.close()
    started = tmp_path / "slow-started"
    script = tmp_path / "render.py"
    script.write_text(
        "import pathlib, sys, time\n"
        "key = sys.argv[1]\n"
        "if 'slow' in key:\n"
        f"    pathlib.Path({str(started)!r}).write_text(key)\n"
        "    time.sleep(3)\n"
        "if 'gone' in key: sys.exit(10)\n"
        "if 'fail' in key:\n"
        "    print('net::ERR_CONNECTION_REFUSED', file=sys.stderr); sys.exit(2)\n"
    )
    with node_process(tmp_path, workers=2) as node:
        fleet = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.cli",
                "fleet",
                "--node",
                node.url,
                "--concurrency",
                "4",
                "--exec",
                f"{sys.executable} {script} {{key}}",
                "--wait-s",
                "1",
                "--grace-s",
                "30",
                "--stats-json",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")},
        )
        try:
            wait_for(started.exists, 60, "the slow render to start")
            time.sleep(0.3)  # the quick ones are done by now; the slow one is mid-render
            fleet.send_signal(signal.SIGINT)
            output, _ = fleet.communicate(timeout=60)
        finally:
            if fleet.poll() is None:
                fleet.kill()
        text = output.decode()
        assert fleet.returncode == 0, text
        store = open_store(str(node.db))
        try:
            rows = store.get_many(list(keys))
        finally:
            store.close()
    assert "stopping: no new claims" in text
    assert "net::ERR_CONNECTION_REFUSED" in text  # a failed command's stderr is shown
    assert "https://e.com/gone-1" not in rows  # gone deletes the row
    for key in ("https://e.com/ok-1", "https://e.com/ok-2", "https://e.com/slow-1"):
        # the slow render finished within the grace period and was completed
        assert rows[key].last_outcome == "rendered", (key, text)
        assert rows[key].next_render_at > now + 3_000_000
    assert rows["https://e.com/fail-1"].last_outcome == "failed"
