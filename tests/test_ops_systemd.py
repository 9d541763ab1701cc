"""The example systemd unit: systemd's own verifier accepts it, its sandbox scores as
hardened by systemd's own analysis, and what it runs is a command this build takes."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workers import cli

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "ops" / "systemd" / "renderqueue@.service"
INSTALLED_AT = "/opt/renderqueue/bin/renderqueue"
# systemd-analyze security's overall exposure, in its tenths (0 safest .. 100): 2.5 and
# under reads "OK" there.
MAX_EXPOSURE = 25


def directives() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def test_the_unit_speaks_notify_and_keeps_shared_memory_writable() -> None:
    unit = directives()
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert int(unit["WatchdogSec"][0]) > 0 and unit["KillMode"] == ["mixed"]
    assert unit["ProtectSystem"] == ["strict"] and unit["NoNewPrivileges"] == ["yes"]
    assert "/dev/shm" in unit["ReadWritePaths"][0].split()
    assert unit["RemoveIPC"] == ["no"]  # a crashed node's lease table is adopted at restart


def test_the_unit_runs_a_command_this_build_takes() -> None:
    (command,) = directives()["ExecStart"]
    program, *args = shlex.split(command.replace("%i", "web1"))
    assert program == INSTALLED_AT
    parsed = cli.build_parser().parse_args(args)
    assert parsed.command == "serve" and parsed.config == "/etc/renderqueue/web1.toml"


@pytest.fixture
def instance_unit(tmp_path: Path) -> Path:
    """The unit as installed, for instance web1, its program this venv's `renderqueue`
    (the verifier checks that it is executable)."""
    if shutil.which("systemd-analyze") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is not installed; .ci/run installs Debian's systemd")
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    program = Path(sys.executable).parent / "renderqueue"
    template = tmp_path / "renderqueue@.service"
    template.write_text(UNIT.read_text().replace(INSTALLED_AT, str(program)))
    instance = tmp_path / "renderqueue@web1.service"
    instance.symlink_to(template.name)
    return instance


def test_systemd_verifies_the_unit(instance_unit: Path) -> None:
    done = subprocess.run(
        ["systemd-analyze", "verify", str(instance_unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr


def test_systemd_scores_the_sandbox_as_hardened(instance_unit: Path) -> None:
    done = subprocess.run(
        [
            "systemd-analyze",
            "security",
            "--offline=true",
            f"--threshold={MAX_EXPOSURE}",
            "--no-pager",
            str(instance_unit),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "Unknown option" in done.stderr or "unrecognized option" in done.stderr:
        pytest.skip(f"this systemd-analyze cannot analyse a unit file offline: {done.stderr}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr
