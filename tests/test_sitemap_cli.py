"""`renderqueue import-sitemap`: files, URLs and stdin into a real store; exit codes and
reports a person can act on."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sitemap_helpers import http_server, index, many_urls, url_xml, urlset

from sitemap.cli import main
from store import open_store

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def count_rows(db: Path) -> int:
    store = open_store(str(db))
    try:
        return store.count()
    finally:
        store.close()


def test_example_site_into_a_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "s.sqlite"
    argv = [
        str(EXAMPLES / "site" / "sitemap.xml"),
        "--route-rules",
        str(EXAMPLES / "route-rules.toml"),
        "--db",
        str(db),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "imported 4,007, updated 0, skipped 2" in out
    assert "bad_url 2" in out and "relative-loc-is-not-a-url" in out
    assert count_rows(db) == 4007
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["imported"] == 0
    assert report["skipped_by_reason"] == {"bad_url": 2, "unchanged": 4007}


def test_refused_document_exits_1_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "evil.xml"
    bad.write_bytes(
        b'<?xml version="1.0"?><!DOCTYPE urlset [<!ENTITY x SYSTEM "file:///etc/passwd">]>'
        b"<urlset><url><loc>https://e.com/&x;</loc></url></urlset>"
    )
    db = tmp_path / "s.sqlite"
    assert main([str(bad), "--db", str(db)]) == 1
    err = capsys.readouterr().err
    assert "refused, nothing written" in err and "entity" in err
    assert count_rows(db) == 0


def test_oversized_by_the_cap_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big = tmp_path / "big.xml.gz"
    big.write_bytes(gzip.compress(many_urls(2000)))
    db = tmp_path / "s.sqlite"
    assert main([str(big), "--db", str(db), "--max-bytes", "10000"]) == 1
    assert "over the 10,000-byte cap" in capsys.readouterr().err
    assert count_rows(db) == 0


def test_bad_rules_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nroute = "Product"\npath = "/p/*"\n')
    assert main([str(EXAMPLES / "site" / "sitemap.xml"), "--route-rules", str(rules)]) == 2
    assert "must match" in capsys.readouterr().err


def test_url_source_with_index_children_fetched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "s.sqlite"
    with http_server() as server:
        server.add("/maps/a.xml.gz", gzip.compress(many_urls(30)))
        server.add("/maps/b.xml", many_urls(20, start=30))
        # relative child locs resolve against the index's URL
        server.add("/maps/index.xml", index("a.xml.gz", server.url + "/maps/b.xml"))
        assert main([server.url + "/maps/index.xml", "--db", str(db), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["imported"], report["sitemaps_read"]) == (50, 3)
    assert count_rows(db) == 50


def test_stdin_source_through_the_real_command(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    data = urlset(url_xml("https://e.com/p/1", "2024-01-01", "daily"), url_xml("bad"))
    done = subprocess.run(
        [sys.executable, "-m", "workers.cli", "import-sitemap", "-", "--db", str(db)],
        input=gzip.compress(data),
        capture_output=True,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("RENDERQUEUE_")},
        timeout=60,
    )
    if done.returncode != 0 and b"import-sitemap" not in done.stdout + done.stderr:
        pytest.skip(f"renderqueue's dispatcher not ready: {done.stderr.decode()[-300:]}")
    assert done.returncode == 0, done.stderr.decode()
    assert b"imported 1, updated 0, skipped 1" in done.stdout
    assert count_rows(db) == 1
