"""`renderqueue demo --cluster 3` (what `make cluster` starts), briefly: three nodes on a
real PostgreSQL with the example schedule loaded once, a simulated fleet rendering across
them, the cluster queue-state exact over all three; SIGINT stops it all and every node
leaves the cluster."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
from conftest import schema_url
from node_harness import REPO, wait_for


def test_demo_cluster_smoke(pg_database: str, tmp_path: Path) -> None:
    import psycopg

    schema = f"d_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_database, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    url = schema_url(pg_database, schema)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")}
    env["PYTHONPATH"] = str(REPO)
    command = [sys.executable, "-m", "workers.cli", "demo", "--cluster", "3", "--db", url]
    command += ["--port", "0", "--workers", "1"]
    # Its own directory: the nodes' lease snapshots land under ./var there.
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for raw in process.stdout:
            lines.append(raw.decode(errors="replace").rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    try:

        def address() -> str | None:
            for line in lines:
                found = re.search(r"cluster queue-state\s+(\S+)", line)
                if found:
                    return found.group(1)
            if process.poll() is not None:
                raise AssertionError("the demo exited:\n" + "\n".join(lines[-40:]))
            return None

        state_url = wait_for(address, 120, "the demo's addresses", 0.2)
        consoles = [line for line in lines if "console" in line and "/console" in line]
        assert len(consoles) == 3, lines

        def exact_and_rendering() -> dict[str, Any] | None:
            response = httpx.get(state_url, timeout=10)
            if response.status_code != 200:
                return None
            body: dict[str, Any] = response.json()
            rendered = body["flow"]["last_hour"]["rescheduled"]
            return body if len(body["nodes"]) == 3 and rendered > 0 else None

        body = wait_for(exact_and_rendering, 180, "an exact cluster rendering", 0.5)
        assert sorted(n["node"] for n in body["nodes"]) == ["node-1", "node-2", "node-3"]
        assert body["now"]["held"] >= 3626  # the example schedule, held once across three
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
        try:
            code = process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert code == 0, "\n".join(lines[-40:])
    from store.postgres import PostgresStore

    store = PostgresStore(url)
    try:
        members = store.nodes(12.0)
    finally:
        store.close()
    assert sorted(m.node for m in members) == ["node-1", "node-2", "node-3"]
    assert all(m.left and not m.live for m in members), members
