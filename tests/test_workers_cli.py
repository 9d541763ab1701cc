"""The `renderqueue` command: settings errors name the setting, subcommands dispatch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from workers import cli

REPO = Path(__file__).resolve().parent.parent


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")}
    return subprocess.run(
        [sys.executable, "-m", "workers.cli", *args],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_version_is_the_packages() -> None:
    from importlib.metadata import version

    from api.version import VERSION

    done = run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"renderqueue {VERSION}"
    assert version("renderqueue") == VERSION  # the metadata reads the one definition


def test_a_bad_flag_value_names_the_setting(tmp_path: Path) -> None:
    done = run("serve", "--db", str(tmp_path / "x.sqlite"), "--port", "eighty")
    assert done.returncode == 2
    assert "setting `port` (from --port)" in done.stderr


def test_a_bad_environment_value_names_the_variable(tmp_path: Path) -> None:
    done = run("serve", "--db", str(tmp_path / "x.sqlite"), env={"RENDERQUEUE_WORKERS": "0"})
    assert done.returncode == 2
    assert "setting `workers` (from RENDERQUEUE_WORKERS)" in done.stderr


def test_a_public_host_without_tokens_is_refused(tmp_path: Path) -> None:
    done = run("serve", "--db", str(tmp_path / "x.sqlite"), "--host", "0.0.0.0")
    assert done.returncode == 2
    assert "setting `host`" in done.stderr and "RENDERQUEUE_ADMIN_TOKEN" in done.stderr


def test_a_bad_config_file_is_reported(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text("workers = 'many'\n")
    done = run("serve", "--config", str(config))
    assert done.returncode == 2
    assert "setting `workers`" in done.stderr and str(config) in done.stderr


def test_tokens_are_not_flags() -> None:
    done = run("serve", "--admin-token", "x" * 32)
    assert done.returncode == 2
    assert "unrecognized arguments" in done.stderr


def test_the_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "renderqueue"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for command in ("serve", "demo", "fleet", "import-sitemap"):
        assert command in done.stdout


@pytest.mark.parametrize(
    ("command", "module"), [("fleet", "fleet.cli"), ("import-sitemap", "sitemap.cli")]
)
def test_subcommands_dispatch_to_their_modules(command: str, module: str) -> None:
    pytest.importorskip(module)
    done = run(command, "--help")
    assert done.returncode == 0, done.stderr
    assert f"renderqueue {command}" in done.stdout


def test_a_missing_subcommand_module_is_a_clear_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(cli.DELEGATED, "fleet", ("no_such_module.cli", "the simulated fleet"))
    assert cli.main(["fleet", "--node", "http://x"]) == 2
    assert "the simulated fleet is not available" in capsys.readouterr().err
