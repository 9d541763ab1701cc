"""A full disk: schedule writes and completions are a 507 problem naming the cause, never
a 500; claims and reads go on; /metrics and the overview say the store is not writable;
nothing refused is half-written; writes resume by themselves once space returns.

The node's SQLite files live on a small tmpfs that the test fills (mounting one needs
root: elsewhere the test skips, saying so)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from node_harness import node_db, seed_rows, thread_node

from store.errors import StoreFull
from store.postgres.conn import translated


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Every free byte of the file system taken by one file."""
    filler = directory / "filler"
    with filler.open("wb") as out:
        chunk = b"\0" * 65536
        try:
            while True:
                out.write(chunk)
                out.flush()
        except OSError:
            pass
    return filler


def upserts(prefix: str, count: int) -> dict[str, Any]:
    return {
        "upsert": [
            {"key": f"{prefix}{i}", "route": "product", "next_render_at": 1, "cadence_s": 60}
            for i in range(count)
        ]
    }


def test_a_full_disk_is_507_with_its_cause_and_writes_resume_when_space_returns(
    small_disk: Path,
) -> None:
    seed_rows(node_db(small_disk), 50)
    with thread_node(small_disk) as node:
        node.wait_published()
        with node.client() as client:
            assert client.post("/v1/schedule", json=upserts("/before/", 5)).status_code == 200
            filler = fill(small_disk)
            # SQLite writes into space its files already hold until it needs more: batches
            # go in until one needs a new block. Every answer is a 200 or the 507.
            for batch in range(400):
                refused = client.post("/v1/schedule", json=upserts(f"/refused{batch}/", 500))
                if refused.status_code != 200:
                    break
            assert refused.status_code == 507, refused.text
            assert refused.headers["content-type"] == "application/problem+json"
            assert refused.headers["retry-after"]
            problem = refused.json()
            assert problem["title"] == "Store full" and "full" in problem["detail"]
            # Claims go on, and so do completions' refusals: a 507, not a 500. SQLite's
            # files keep a little room of their own (its WAL's, written from the start
            # again after a checkpoint), so a small write may still land: each that does
            # is a whole 200, and the first refused is the 507 looked for. 50 due rows
            # make 16 claims of 3.
            for _ in range(16):
                claimed = client.post("/v1/claims", json={"max": 3, "worker": "w"})
                assert claimed.status_code == 200 and claimed.json()["leases"], claimed.text
                items = [
                    {"key": lease["key"], "token": lease["token"], "outcome": "rendered"}
                    for lease in claimed.json()["leases"]
                ]
                done = client.post("/v1/completions", json={"items": items})
                if done.status_code != 200:
                    break
                assert all(result["ok"] for result in done.json()["results"]), done.text
            assert done.status_code == 507, done.text
            assert client.get("/v1/schedule", params={"key": "/before/0"}).status_code == 200
            metrics = client.get("/metrics").text
            assert 'renderqueue_store_writable{worker="0"} 0' in metrics
            assert (
                'renderqueue_store_writes_refused_total{worker="0"} 2' in metrics
            )  # the batch, the completion
            store = client.get("/prerender_admin/overview").json()["store"]
            assert store["writable"] is False and "full" in store["reason"]

            os.unlink(filler)
            again = client.post("/v1/schedule", json=upserts("/after/", 5))
            assert again.status_code == 200, again.text
            retried = client.post("/v1/completions", json={"items": items})
            assert retried.status_code == 200
            assert all(result["ok"] for result in retried.json()["results"])
            assert 'renderqueue_store_writable{worker="0"} 1' in client.get("/metrics").text
            # Nothing of the refused batch landed, all of the later one did.
            for key in (f"/refused{batch}/0", f"/refused{batch}/499"):
                assert client.get("/v1/schedule", params={"key": key}).status_code == 404
            assert client.get("/v1/schedule", params={"key": "/after/4"}).status_code == 200
        assert node.store.count() == 50 + 5 + 500 * batch + 5


def test_the_servers_disk_full_or_io_error_is_store_full() -> None:
    """PostgreSQL's own refusals (SQLSTATE 53100, 58030) map to StoreFull, as SQLite's do."""
    for error in (psycopg.errors.DiskFull, psycopg.errors.IoError):
        with pytest.raises(StoreFull, match="disk refused the write"), translated("write"):
            raise error("could not extend file: No space left on device")
