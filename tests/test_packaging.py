"""The package as an operator gets it: `python -m build` makes an sdist and, from it, a wheel
with both C extensions compiled; the wheel installs into a fresh virtual environment and,
run from outside the checkout (which is then not importable), reports its version, serves
a scratch SQLite store and grants a claim over HTTP.

Building takes a while, so one module-scoped fixture builds and installs once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_harness import REPO, now_ms, unique, wait_for

from api.version import VERSION
from workers.segments import SegmentNames

SHM_SOURCES = ("module", "words", "ring", "leases", "hash", "sites")
KEEPER_SOURCES = ("module", "index", "select", "moves", "buckets")
PACKAGE_DATA = ("api/console.html", "shm/_atomics.pyi", "keeper/_native.pyi", "api/py.typed")


@dataclass(frozen=True)
class Installed:
    sdist: Path
    wheel: Path
    venv: Path
    outside: Path  # a directory away from the checkout, the commands' working directory

    @property
    def command(self) -> Path:
        return self.venv / "bin" / "renderqueue"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def environ(self) -> dict[str, str]:
        """The environment less anything that would point back into the checkout."""
        dropped = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")
        return {
            k: v
            for k, v in os.environ.items()
            if k not in dropped and not k.startswith("RENDERQUEUE_")
        }

    def run(self, *args: str | Path, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(a) for a in args],
            cwd=self.outside,
            env=self.environ(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )


def checked(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, f"{done.args} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def copy_sources(to: Path) -> None:
    """The files git tracks or would track (what a clean clone would build from), so the
    build writes nothing into the checkout (its build/ and egg-info land in the copy)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted but not yet committed is listed too
            target = to / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("packaging")
    source, dist, outside = root / "src", root / "dist", root / "elsewhere"
    outside.mkdir()
    copy_sources(source)
    # No flags: the sdist first, then the wheel built from the unpacked sdist in an
    # isolated environment, so a C file or header the sdist lacks fails the build.
    checked(
        subprocess.run(
            [sys.executable, "-m", "build", "--outdir", str(dist), str(source)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
    )
    (sdist,) = dist.glob("renderqueue-*.tar.gz")
    (wheel,) = dist.glob("renderqueue-*.whl")
    venv = root / "venv"
    checked(
        subprocess.run(
            [sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True, timeout=300
        )
    )
    found = Installed(sdist=sdist, wheel=wheel, venv=venv, outside=outside)
    checked(found.run(found.python, "-m", "pip", "install", "-q", wheel, timeout_s=1800))
    return found


def test_the_sdist_carries_the_c_sources_headers_and_package_data(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as sdist:
        prefix = f"renderqueue-{VERSION}/"
        names = {name.removeprefix(prefix) for name in sdist.getnames()}
    for name in SHM_SOURCES:
        assert f"shm/csrc/{name}.c" in names
    for name in KEEPER_SOURCES:
        assert f"keeper/csrc/{name}.c" in names
    assert {"shm/csrc/atomics.h", "keeper/csrc/native.h", "setup.py", "pyproject.toml"} <= names
    assert set(PACKAGE_DATA) <= names


def test_the_wheel_holds_both_extensions_compiled_and_the_package_data(
    installed: Installed,
) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    compiled = {
        n.split("/")[0] + "." + n.split("/")[1].split(".")[0] for n in names if n.endswith(".so")
    }
    assert compiled == {"shm._atomics", "keeper._native"}
    assert set(PACKAGE_DATA) <= names
    assert not [n for n in names if "/csrc/" in n]  # the C stays in the sdist
    metadata = wheel_metadata(installed.wheel)
    assert f"Version: {VERSION}" in metadata
    # PostgreSQL support is an extra, with the floor the change feed needs.
    assert "Provides-Extra: postgres" in metadata
    assert 'Requires-Dist: psycopg[binary]>=3.2; extra == "postgres"' in metadata
    assert not [
        line
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist: psycopg") and "extra ==" not in line
    ]


def wheel_metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return archive.read(name).decode()


def test_the_installed_command_is_the_wheels_and_says_its_version(installed: Installed) -> None:
    done = checked(installed.run(installed.command, "--version"))
    assert done.stdout.strip() == f"renderqueue {VERSION}"
    where = checked(
        installed.run(
            installed.python,
            "-c",
            "import api, shm._atomics as a, keeper._native as n; "
            "print(api.__file__); print(a.__file__); print(n.__file__)",
        )
    )
    for path in where.stdout.split():
        assert Path(path).is_relative_to(installed.venv), path  # not the checkout's


class ServedNode:
    """`renderqueue serve` from the installed wheel, its JSON log lines kept."""

    def __init__(self, installed: Installed, *args: str) -> None:
        self.instance = unique("pk")
        self.process = subprocess.Popen(
            [str(installed.command), "serve", "--port", "0", "--instance", self.instance, *args],
            cwd=installed.outside,
            env=installed.environ(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            with contextlib.suppress(ValueError):
                self.events.append(json.loads(line))

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in list(self.events) if e.get("event") == name), None)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        SegmentNames.for_instance(self.instance).remove()
        return self.process.returncode


@pytest.fixture
def served(installed: Installed) -> Iterator[ServedNode]:
    node = ServedNode(
        installed, "--db", str(installed.outside / f"{unique('scratch')}.sqlite"), "--workers", "1"
    )
    try:
        yield node
    finally:
        node.stop()


def test_the_installed_node_serves_and_grants_a_claim(served: ServedNode) -> None:
    def listening() -> dict[str, Any] | None:
        assert served.process.poll() is None, "\n".join(served.lines[-30:])
        return served.event("listening")

    port = int(wait_for(listening, 120, "the node to listen", 0.1)["port"])
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        wait_for(lambda: client.get("/readyz").status_code == 200, 120, "the node to be ready", 0.1)
        due = now_ms() - 60_000
        rows = [
            {"key": f"https://example.test/p/{i}", "route": "page", "next_render_at": due}
            for i in range(3)
        ]
        written = client.post("/v1/schedule", json={"upsert": rows})
        assert written.status_code == 200, written.text

        def granted() -> list[dict[str, Any]]:
            answer = client.post("/v1/claims", json={"max": 10, "worker": "pkg"})
            assert answer.status_code in (200, 503), answer.text
            return answer.json().get("leases", []) if answer.status_code == 200 else []

        leases = wait_for(granted, 120, "a claim to grant the new rows", 0.1)
        assert {lease["key"] for lease in leases} <= {row["key"] for row in rows}
        metrics = client.get("/metrics").text
        assert f'renderqueue_build_info{{version="{VERSION}"}} 1' in metrics
    assert served.stop() == 0


def test_postgresql_without_its_extra_is_a_clear_error(installed: Installed) -> None:
    done = installed.run(
        installed.command,
        "serve",
        "--db",
        "postgresql://127.0.0.1:5432/test",
        "--port",
        "0",
        "--instance",
        unique("pg"),
    )
    assert done.returncode != 0
    assert "renderqueue[postgres]" in done.stderr, done.stderr[-2000:]


def test_a_sqlite_node_loads_no_postgresql_module() -> None:
    """Without the extra: the node's modules import, and a PostgreSQL URL says what to
    install (the wheel test proves it installed; this one, in every run, that it holds)."""
    script = (
        "import sys\n"
        "sys.modules['psycopg'] = None\n"
        "import api.app, workers.cli, workers.supervisor, workers.worker, keeper.runner\n"
        "from store import open_store\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('store.postgres'))\n"
        "try:\n"
        "    open_store('postgresql://127.0.0.1/test')\n"
        "except ValueError as exc:\n"
        "    print(exc)\n"
        "print(loaded)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    said, loaded = done.stdout.strip().splitlines()
    assert "pip install 'renderqueue[postgres]'" in said
    assert loaded == "[]"


def test_every_package_of_the_checkout_is_in_the_wheels_list() -> None:
    """pyproject.toml lists the packages by hand; one left off would be missing from the
    wheel while every test run from the checkout still imports it."""
    import tomllib

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(module.parent.relative_to(REPO).parts)
        for module in REPO.rglob("*.py")
        # sitecustomize.py: a directory a bench puts on a node's PYTHONPATH, no package
        if len(module.relative_to(REPO).parts) > 1
        and module.name != "sitecustomize.py"
        and (REPO / module.relative_to(REPO).parts[0] / "__init__.py").exists()
        and not {"tests", ".venv", "build", "var", "__pycache__"}
        & set(module.relative_to(REPO).parts)
    }
    assert listed == found
