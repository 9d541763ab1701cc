"""Where sitemap bytes come from: a file, a URL, stdin; gzip undone; every byte counted.

Sizes are capped twice: the bytes read from the source (compressed, if gzip) and the
bytes handed to the parser after decompression, so a small gzip bomb stops at the cap
rather than at the end of memory. A declared size (HTTP Content-Length, the gzip
trailer of a seekable file) over the cap is refused before anything is parsed.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
import sys
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import BinaryIO
from urllib.parse import urljoin, urlsplit

import httpx
import msgspec

from sitemap.errors import SitemapError

# sitemaps.org: a sitemap file may be at most 50 MB (52,428,800 bytes) uncompressed.
PROTOCOL_MAX_BYTES = 52_428_800
GZIP_MAGIC = b"\x1f\x8b"
_READ_CHUNK = 64 * 1024


class SourceLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_bytes: int = PROTOCOL_MAX_BYTES  # after decompression: what the XML parser sees
    max_download_bytes: int = PROTOCOL_MAX_BYTES  # on the wire / on disk
    fetch_timeout_s: float = 30.0


class CappedReader(io.RawIOBase):
    """A read-only stream that refuses to yield more than `limit` bytes in total.

    Decompression and transport errors surface here as SitemapError, so whoever
    drives the parser sees one exception type for a document that cannot be read.
    """

    def __init__(
        self,
        inner: BinaryIO,
        limit: int,
        *,
        location: str,
        what: str,
        also_close: BinaryIO | None = None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._also_close = also_close  # GzipFile leaves the file it was given open
        self._limit = limit
        self._location = location
        self._what = what
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        want = min(len(buffer), self._limit - self.count + 1)
        try:
            data = self._inner.read(want)
        except (gzip.BadGzipFile, EOFError, zlib.error, OSError) as exc:
            raise SitemapError(
                "malformed", f"the {self._what} stream is corrupt ({exc})", location=self._location
            ) from exc
        got = len(data)
        self.count += got
        if self.count > self._limit:
            raise SitemapError(
                "too_large",
                f"more than {self._limit:,} {self._what} bytes; refused (the sitemaps.org "
                f"limit is {PROTOCOL_MAX_BYTES:,} bytes uncompressed per file)",
                location=self._location,
            )
        buffer[:got] = data
        return got

    def close(self) -> None:
        try:
            self._inner.close()
            if self._also_close is not None:
                self._also_close.close()
        finally:
            super().close()


class _Prefixed(io.RawIOBase):
    """Bytes already read to sniff the format, then the rest of the stream."""

    def __init__(self, prefix: bytes, rest: BinaryIO) -> None:
        super().__init__()
        self._prefix = prefix
        self._rest = rest

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if self._prefix:
            got = min(len(buffer), len(self._prefix))
            buffer[:got] = self._prefix[:got]
            self._prefix = self._prefix[got:]
            return got
        data = self._rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        try:
            self._rest.close()
        finally:
            super().close()


def _read_exactly(stream: BinaryIO, n: int) -> bytes:
    out = b""
    while len(out) < n:
        data = stream.read(n - len(out))
        if not data:
            break
        out += data
    return out


def _gzip_declared_size(stream: BinaryIO) -> int | None:
    """The gzip trailer's ISIZE (size mod 2**32) when the stream can seek, else None."""
    try:
        if not stream.seekable():
            return None
        here = stream.tell()
        end = stream.seek(0, os.SEEK_END)
        if end < 18:
            stream.seek(here)
            return None
        stream.seek(end - 4)
        (size,) = struct.unpack("<I", _read_exactly(stream, 4))
        stream.seek(here)
        return int(size)
    except (OSError, ValueError):
        return None


def open_document(stream: BinaryIO, *, location: str, limits: SourceLimits) -> BinaryIO:
    """Wrap a raw byte stream: gunzip if it starts with the gzip magic, cap every size."""
    raw = CappedReader(stream, limits.max_download_bytes, location=location, what="input")
    head = _read_exactly(raw, 2)  # type: ignore[arg-type]
    body: BinaryIO = io.BufferedReader(_Prefixed(head, raw))  # type: ignore[arg-type]
    if head == GZIP_MAGIC:
        declared = _gzip_declared_size(stream)
        if declared is not None and declared > limits.max_bytes:
            raise SitemapError(
                "too_large",
                f"the gzip trailer declares {declared:,} bytes uncompressed, over the "
                f"{limits.max_bytes:,}-byte cap; refused before decompressing",
                location=location,
            )
        body = gzip.GzipFile(fileobj=body, mode="rb")  # type: ignore[assignment]
        what = "decompressed"
    else:
        what = "input"
    capped = CappedReader(body, limits.max_bytes, location=location, what=what, also_close=stream)
    return io.BufferedReader(capped, buffer_size=_READ_CHUNK)


def bytes_counted(document: BinaryIO) -> int:
    """How many bytes a stream from open_document has handed to its reader so far."""
    raw = getattr(document, "raw", None)
    return raw.count if isinstance(raw, CappedReader) else 0


def is_url(location: str) -> bool:
    return urlsplit(location).scheme in ("http", "https")


def fetch_url(url: str, *, limits: SourceLimits, client: httpx.Client | None = None) -> BinaryIO:
    """GET a URL into a spooled temporary file (memory up to 1 MiB, then disk), capped."""
    own = client is None
    http = client or httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=True)
    spool = tempfile.SpooledTemporaryFile(max_size=1 << 20)  # noqa: SIM115 - returned open
    try:
        with http.stream("GET", url) as response:
            if response.status_code != 200:
                raise SitemapError(
                    "fetch_failed", f"GET returned HTTP {response.status_code}", location=url
                )
            declared = response.headers.get("content-length")
            if (
                declared is not None
                and declared.isdigit()
                and int(declared) > limits.max_download_bytes
            ):
                raise SitemapError(
                    "too_large",
                    f"Content-Length declares {int(declared):,} bytes, over the "
                    f"{limits.max_download_bytes:,}-byte cap; refused before reading",
                    location=url,
                )
            total = 0
            # raw bytes: a gzip Content-Encoding is undone by httpx, a .gz body is kept as is
            for chunk in response.iter_bytes(_READ_CHUNK):
                total += len(chunk)
                if total > limits.max_download_bytes:
                    raise SitemapError(
                        "too_large",
                        f"more than {limits.max_download_bytes:,} bytes downloaded; refused",
                        location=url,
                    )
                spool.write(chunk)
    except httpx.HTTPError as exc:
        spool.close()
        raise SitemapError("fetch_failed", f"could not fetch ({exc})", location=url) from exc
    except BaseException:
        spool.close()
        raise
    finally:
        if own:
            http.close()
    spool.seek(0)
    return spool  # type: ignore[return-value]


def open_location(location: str, *, limits: SourceLimits) -> BinaryIO:
    """A raw stream for `-` (stdin), an http(s) URL, or a file path."""
    if location == "-":
        return sys.stdin.buffer
    if is_url(location):
        return fetch_url(location, limits=limits)
    try:
        return open(location, "rb")
    except OSError as exc:
        raise SitemapError(
            "fetch_failed", f"cannot open ({exc.strerror})", location=location
        ) from exc


ChildOpener = Callable[[str], tuple[str, BinaryIO]]
"""Given a child sitemap's <loc> from an index: (where it was read from, its raw bytes)."""


def child_opener_for(location: str, *, limits: SourceLimits) -> ChildOpener:
    """How an index read from `location` finds its children.

    From a URL, a child is fetched (relative locs resolved against the index URL).
    From a file, a child is the file of the same name beside the index: a site's
    sitemaps are published together, and a loc's directories are never followed, so
    an index cannot point the importer at an arbitrary local path. From stdin,
    children must be absolute URLs.
    """
    if is_url(location):

        def open_url_child(loc: str) -> tuple[str, BinaryIO]:
            url = urljoin(location, loc)
            if not is_url(url):
                raise SitemapError("fetch_failed", "child is not an http(s) URL", location=loc)
            return url, fetch_url(url, limits=limits)

        return open_url_child
    if location == "-":

        def open_stdin_child(loc: str) -> tuple[str, BinaryIO]:
            if not is_url(loc):
                raise SitemapError(
                    "fetch_failed",
                    "an index read from stdin can only name absolute http(s) children",
                    location=loc,
                )
            return loc, fetch_url(loc, limits=limits)

        return open_stdin_child
    directory = Path(location).resolve().parent

    def open_file_child(loc: str) -> tuple[str, BinaryIO]:
        name = PurePosixPath(urlsplit(loc).path).name
        if name in ("", ".", ".."):
            raise SitemapError("fetch_failed", "child loc names no file", location=loc)
        path = directory / name
        try:
            return str(path), open(path, "rb")
        except OSError as exc:
            raise SitemapError(
                "fetch_failed",
                f"child sitemap not found beside the index (looked for {path}: {exc.strerror})",
                location=loc,
            ) from exc

    return open_file_child


def url_child_opener(*, limits: SourceLimits) -> ChildOpener:
    """Children fetched by absolute URL: for a server handed an index's bytes."""

    def open_child(loc: str) -> tuple[str, BinaryIO]:
        if not is_url(loc):
            raise SitemapError("fetch_failed", "child is not an absolute http(s) URL", location=loc)
        return loc, fetch_url(loc, limits=limits)

    return open_child
