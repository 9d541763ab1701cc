"""open_store: which URL opens which backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from store.sqlite import SqliteStore
from store.url import open_store


def test_sqlite_urls_and_bare_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    absolute = tmp_path / "abs.db"
    store = open_store(f"sqlite:///{absolute}")  # sqlite:// + / + /abs/path
    assert isinstance(store, SqliteStore) and store.path == absolute
    store.close()
    bare = open_store(str(tmp_path / "bare.db"))
    assert isinstance(bare, SqliteStore) and bare.path == tmp_path / "bare.db"
    bare.close()
    monkeypatch.chdir(tmp_path)
    relative = open_store("sqlite:///rel.db")
    assert isinstance(relative, SqliteStore) and os.path.exists(tmp_path / "rel.db")
    relative.close()


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("mysql://x", "unknown scheme"),
        ("sqlite://", "sqlite:///"),
        ("sqlite:///:memory:", "plain database file"),
        ("", "non-empty"),
    ],
)
def test_refused_urls(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        open_store(url)
