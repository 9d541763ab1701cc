"""fleet.renderers: a real command per key (exit status -> outcome, no shell, killed on
timeout or cancel) and the simulated render-time distribution."""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import pytest

from fleet.messages import Lease
from fleet.renderers import (
    CommandRenderer,
    SimulatedRenderer,
    changed_of,
    command_arguments,
    retry_after_of,
    says_not_found,
)


def lease(key: str = "https://e.com/a?b=1&c=2", route: str = "product") -> Lease:
    return Lease(
        key=key, token="1", route=route, due_at=0, lease_expires_at=0, sitemap=False, cadence_s=3600
    )


PY = sys.executable


def test_arguments_substitute_without_a_shell() -> None:
    hostile = lease("https://e.com/x'; touch /tmp/pwned; echo '")
    args = command_arguments(f'{PY} render.py --url "{{key}}" --route {{route}}', hostile)
    assert args == [PY, "render.py", "--url", hostile.key, "--route", "product"]


def test_exit_status_decides_the_outcome(tmp_path: Path) -> None:
    marker = tmp_path / "seen"
    script = tmp_path / "render.py"
    script.write_text(
        "import sys, pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text(sys.argv[1])\n"
        "code = {'ok': 0, 'gone': 10}.get(sys.argv[1].rsplit('/', 1)[1], 3)\n"
        "if code == 3: print('render failed: timeout waiting for selector', file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    renderer = CommandRenderer(f"{PY} {script} {{key}}")

    async def go(key: str) -> tuple[str, str]:
        result = await renderer(lease(key))
        return result.outcome, result.detail

    assert asyncio.run(go("https://e.com/ok")) == ("rendered", "")
    assert marker.read_text() == "https://e.com/ok"
    assert asyncio.run(go("https://e.com/gone")) == ("gone", "")
    outcome, detail = asyncio.run(go("https://e.com/broken"))
    assert outcome == "failed"
    assert detail.startswith("exit 3") and "timeout waiting for selector" in detail


def test_a_retry_after_line_or_exit_75_is_the_origin_pushing_back(tmp_path: Path) -> None:
    script = tmp_path / "render.py"
    script.write_text(
        "import sys\n"
        "name = sys.argv[1].rsplit('/', 1)[1]\n"
        "if name == 'said': print('got 429\\nRETRY-AFTER 5', file=sys.stderr); sys.exit(1)\n"
        "if name == 'said-ok': print('retry-after: 2.5', file=sys.stderr); sys.exit(0)\n"
        "if name == 'tempfail': sys.exit(75)\n"
        "print('RETRY-AFTER soon', file=sys.stderr); sys.exit(3)\n"
    )
    renderer = CommandRenderer(f"{PY} {script} {{key}}", retry_after_s=30)

    def go(key: str) -> tuple[str, float | None]:
        result = asyncio.run(renderer(lease(f"https://e.com/{key}")))
        return result.outcome, result.site_retry_after_s

    assert go("said") == ("failed", 5.0)
    assert go("said-ok") == ("failed", 2.5)  # the line wins over any exit status
    assert go("tempfail") == ("failed", 30.0)  # EX_TEMPFAIL: the default wait
    assert go("garbled") == ("failed", None)  # no number: an ordinary failure
    assert retry_after_of(b"RETRY-AFTER 1\nRETRY-AFTER 999999\n") == 86_400.0
    assert retry_after_of(b"RETRY-AFTER 0\n") is None
    assert retry_after_of(b"x RETRY-AFTER 5\n") is None  # a line of its own
    with pytest.raises(ValueError, match="retry-after default"):
        CommandRenderer("r {key}", retry_after_s=0)


def test_a_changed_line_says_whether_a_rendered_page_changed(tmp_path: Path) -> None:
    script = tmp_path / "render.py"
    script.write_text(
        "import sys\n"
        "name = sys.argv[1].rsplit('/', 1)[1]\n"
        "if name == 'same': print('hash ok\\nCHANGED no', file=sys.stderr)\n"
        "if name == 'new': print('CHANGED: Yes', file=sys.stderr)\n"
        "if name == 'twice': print('CHANGED yes\\nCHANGED 0', file=sys.stderr)\n"
        "if name == 'broken': print('CHANGED yes', file=sys.stderr); sys.exit(2)\n"
    )
    renderer = CommandRenderer(f"{PY} {script} {{key}}")

    def go(key: str) -> tuple[str, bool | None]:
        result = asyncio.run(renderer(lease(f"https://e.com/{key}")))
        return result.outcome, result.changed

    assert go("same") == ("rendered", False)
    assert go("new") == ("rendered", True)
    assert go("twice") == ("rendered", False)  # the last line counts
    assert go("silent") == ("rendered", None)  # nothing said: nothing learned
    assert go("broken") == ("failed", None)  # said of a rendered page only
    assert changed_of(b"x CHANGED yes\n") is None  # a line of its own
    assert changed_of(b"CHANGED maybe\n") is None


def test_a_not_found_line_or_exit_44_is_the_origin_saying_404(tmp_path: Path) -> None:
    script = tmp_path / "render.py"
    script.write_text(
        "import sys\n"
        "name = sys.argv[1].rsplit('/', 1)[1]\n"
        "if name == 'said': print('HTTP 404\\nNOT-FOUND 404', file=sys.stderr); sys.exit(1)\n"
        "if name == 'said-ok': print('not-found', file=sys.stderr); sys.exit(0)\n"
        "if name == 'both': print('NOT-FOUND\\nRETRY-AFTER 5', file=sys.stderr); sys.exit(1)\n"
        "if name == 'exit': sys.exit(44)\n"
        "print('NOT-FOUND 500', file=sys.stderr); sys.exit(3)\n"
    )
    renderer = CommandRenderer(f"{PY} {script} {{key}}")

    def go(key: str) -> tuple[str, float | None]:
        result = asyncio.run(renderer(lease(f"https://e.com/{key}")))
        return result.outcome, result.site_retry_after_s

    assert go("said") == ("not_found", None)
    assert go("said-ok") == ("not_found", None)  # the line wins over any exit status
    assert go("exit") == ("not_found", None)
    assert go("both") == ("failed", 5.0)  # a push-back says more: the site waits
    assert go("garbled") == ("failed", None)  # not 404 or 410: an ordinary failure
    assert says_not_found(b"NOT-FOUND: 410\n") and not says_not_found(b"x NOT-FOUND\n")
    # Another exit status can mean it, or none.
    assert (
        asyncio.run(
            CommandRenderer(f"{PY} {script} {{key}}", not_found_exit=None)(
                lease("https://e.com/exit")
            )
        ).outcome
        == "failed"
    )


def test_a_hostile_key_runs_no_second_command(tmp_path: Path) -> None:
    pwned = tmp_path / "pwned"
    renderer = CommandRenderer(f"{PY} -c 'import sys; sys.exit(0)' {{key}}")
    result = asyncio.run(renderer(lease(f"https://e.com/$(touch {pwned}); touch {pwned}")))
    assert result.outcome == "rendered"
    assert not pwned.exists()


def test_timeout_kills_the_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    # the render forks a child (as a browser would) and both hang
    script.write_text(
        "import os, sys, time, pathlib\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(600)\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(pid))\n"
        "time.sleep(600)\n"
    )
    renderer = CommandRenderer(f"{PY} {script} {{key}}", timeout_s=1.0)
    result = asyncio.run(renderer(lease()))
    assert result.outcome == "failed" and "timed out" in result.detail
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the render's child process outlived the timeout")


def test_cancel_kills_the_command(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = tmp_path / "hang.py"
    script.write_text(
        "import os, time, pathlib\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))\n"
        "time.sleep(600)\n"
    )
    renderer = CommandRenderer(f"{PY} {script} {{key}}")

    async def go() -> int:
        task = asyncio.create_task(renderer(lease()))
        async with asyncio.timeout(30):
            while not pid_file.exists() or not pid_file.read_text():
                await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return int(pid_file.read_text())

    pid = asyncio.run(go())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_command_template_is_checked_up_front() -> None:
    with pytest.raises(ValueError, match="must contain"):
        CommandRenderer("render.sh")
    with pytest.raises(ValueError):
        CommandRenderer("render.sh '{key}")


def test_simulated_distribution_and_failure_rate() -> None:
    renderer = SimulatedRenderer(mean_ms=500, failure_rate=0.2, rng=random.Random(3))
    draws = [renderer.draw_ms() for _ in range(20_000)]
    assert statistics.fmean(draws) == pytest.approx(500, rel=0.05)
    assert statistics.median(draws) < 500  # log-normal: a long right tail
    fast = SimulatedRenderer(mean_ms=0, failure_rate=0.2, rng=random.Random(4))

    async def outcomes() -> list[str]:
        return [(await fast(lease())).outcome for _ in range(5000)]

    failed = asyncio.run(outcomes()).count("failed")
    assert 850 < failed < 1150
    with pytest.raises(ValueError):
        SimulatedRenderer(failure_rate=1.5)
