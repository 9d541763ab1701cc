"""sitemap.source: gzip undone, sizes capped (declared and streamed), children located."""

from __future__ import annotations

import gzip
import io
from pathlib import Path

import pytest
from sitemap_helpers import GIB, NonSeekable, gzip_bomb, http_server, many_urls

from sitemap.errors import SitemapError
from sitemap.source import (
    SourceLimits,
    child_opener_for,
    fetch_url,
    open_document,
    open_location,
    url_child_opener,
)

SMALL = SourceLimits(max_bytes=10_000, max_download_bytes=10_000)


def read_all(data: bytes | NonSeekable, limits: SourceLimits = SMALL) -> bytes:
    raw = io.BytesIO(data) if isinstance(data, bytes) else data
    return open_document(raw, location="x", limits=limits).read()  # type: ignore[arg-type]


def test_plain_and_gzip_read_the_same() -> None:
    doc = many_urls(10)
    assert read_all(doc) == doc
    assert read_all(gzip.compress(doc)) == doc
    assert read_all(NonSeekable(gzip.compress(doc))) == doc


def test_uncompressed_over_the_cap() -> None:
    with pytest.raises(SitemapError) as caught:
        read_all(b" " * 10_001)
    assert caught.value.reason == "too_large"


def test_gzip_declared_size_refused_before_decompressing() -> None:
    bomb = gzip_bomb(b"<urlset>", size=64 << 20)  # declares 64 MiB + 12 in its trailer
    with pytest.raises(SitemapError, match="declares 67,108,876 bytes") as caught:
        read_all(bomb, SourceLimits(max_bytes=50 << 20, max_download_bytes=50 << 20))
    assert caught.value.reason == "too_large"


def test_gzip_bomb_without_a_declared_size_stops_at_the_cap() -> None:
    bomb = gzip_bomb(b"<urlset>", size=64 << 20, single_member=False)
    stream = NonSeekable(bomb)
    with pytest.raises(SitemapError, match="decompressed") as caught:
        read_all(stream, SourceLimits(max_bytes=1 << 20, max_download_bytes=50 << 20))
    assert caught.value.reason == "too_large"


def test_corrupt_gzip() -> None:
    data = bytearray(gzip.compress(many_urls(50)))
    data[30:40] = b"\xff" * 10
    with pytest.raises(SitemapError) as caught:
        read_all(bytes(data))
    assert caught.value.reason == "malformed"


def test_fetch_url_and_its_caps() -> None:
    doc = many_urls(5)
    with http_server() as server:
        ok = server.add("/s.xml", doc)
        assert fetch_url(ok, limits=SMALL).read() == doc
        missing = server.url + "/nope.xml"
        with pytest.raises(SitemapError, match="HTTP 404") as caught:
            fetch_url(missing, limits=SMALL)
        assert caught.value.reason == "fetch_failed"
        # 1 GB declared by Content-Length: refused before a body byte is read
        huge = server.add("/huge.xml", b"<urlset>", headers={"Content-Length": str(GIB)})
        with pytest.raises(SitemapError, match="Content-Length declares 1,073,741,824") as caught:
            fetch_url(huge, limits=SourceLimits())
        assert caught.value.reason == "too_large"
        # no declared length (chunked): the streamed count stops it
        chunked = server.add(
            "/chunked.xml", b"x" * 20_000, headers={"Content-Length": "", "Connection": "close"}
        )
        with pytest.raises(SitemapError) as caught:
            fetch_url(chunked, limits=SMALL)
        assert caught.value.reason in ("too_large", "fetch_failed")


def test_fetch_unreachable() -> None:
    with pytest.raises(SitemapError) as caught:
        fetch_url("http://127.0.0.1:9/s.xml", limits=SMALL)
    assert caught.value.reason == "fetch_failed"


def test_open_location_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SitemapError, match="cannot open") as caught:
        open_location(str(tmp_path / "missing.xml"), limits=SMALL)
    assert caught.value.reason == "fetch_failed"


def test_file_children_are_found_beside_the_index_by_name_only(tmp_path: Path) -> None:
    (tmp_path / "child.xml.gz").write_bytes(b"child")
    outside = tmp_path.parent / f"outside-{tmp_path.name}.xml"
    outside.write_bytes(b"secret")
    open_child = child_opener_for(str(tmp_path / "sitemap.xml"), limits=SMALL)
    where, stream = open_child("https://shop.example/sitemaps/child.xml.gz")
    assert where == str(tmp_path / "child.xml.gz")
    assert stream.read() == b"child"
    stream.close()
    # directories in a loc are never followed: ../ cannot reach outside the index's folder
    with pytest.raises(SitemapError, match="not found beside the index"):
        open_child(f"../{outside.name}/../{outside.name}x")
    with pytest.raises(SitemapError, match="names no file"):
        open_child("https://shop.example/")
    outside.unlink()


def test_url_children_resolve_relative_locs() -> None:
    with http_server() as server:
        server.add("/maps/child.xml", b"child")
        open_child = child_opener_for(server.url + "/maps/index.xml", limits=SMALL)
        where, stream = open_child("child.xml")
        assert where == server.url + "/maps/child.xml"
        assert stream.read() == b"child"
        with pytest.raises(SitemapError, match="absolute"):
            url_child_opener(limits=SMALL)("child.xml")
