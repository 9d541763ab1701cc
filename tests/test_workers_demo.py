"""`renderqueue demo` (what `make run` starts): the example schedule loads as shipped, and
the demo node serves it and prints where to look."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from node_harness import REPO, unique, wait_for

from store import open_store
from workers.demo import EXAMPLES, load_example


def example_lines() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLES / "schedule.jsonl").read_text().splitlines()]


def test_the_example_loads_as_shipped(tmp_path: Path) -> None:
    now = time.time_ns() // 1_000_000
    lines = example_lines()
    store = open_store(str(tmp_path / "demo.sqlite"))
    try:
        loaded = load_example(store, EXAMPLES, now)
        assert loaded.rows == len(lines) == store.count()
        assert 2000 <= loaded.rows <= 10_000
        assert loaded.due == sum(1 for line in lines if int(line["due_in_s"]) <= 0)
        assert 0 < loaded.due < loaded.rows
        routes = {route.route: route for route in store.routes()}
        assert len({line["route"] for line in lines}) == len(routes) >= 4
        assert routes["legacy"].paused and not routes["product"].paused
        first = lines[0]
        row = store.get(str(first["key"]))
        assert row is not None
        assert row.next_render_at == now + int(first["due_in_s"]) * 1000
        cadences = {line.get("cadence_s") for line in lines}
        assert len(cadences) >= 3  # rows with and without their own cadence
    finally:
        store.close()


def test_demo_serves_the_example_and_prints_the_addresses(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")}
    # A lease snapshot left beside a database the demo loads afresh names old rows.
    leftover = tmp_path / "demo.sqlite.leases"
    leftover.write_bytes(b"a previous run's leases")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "workers.cli",
            "demo",
            "--db",
            str(tmp_path / "demo.sqlite"),
            "--port",
            "0",
            "--instance",
            unique("td"),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        lines: list[str] = []
        for line in process.stdout:
            lines.append(line)
            if "stop:" in line:
                break
        text = "".join(lines)
        base = next(word for word in text.split() if word.startswith("http://"))
        assert "/prerender_admin/queue-state" in text and "/metrics" in text
        assert "/console" in text
        assert not leftover.exists()
        with httpx.Client(base_url=base) as client:
            wait_for(lambda: client.get("/readyz").status_code == 200, 60, "the demo to be ready")
            leases = client.post("/v1/claims", json={"max": 5, "worker": "demo"}).json()["leases"]
        assert len(leases) == 5
        assert all(lease["key"].startswith("https://shop.example/") for lease in leases)
    finally:
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
