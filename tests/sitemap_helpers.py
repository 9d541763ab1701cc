"""Shared by the sitemap tests: sitemap documents, gzip bombs, a real loopback HTTP server."""

from __future__ import annotations

import contextlib
import gzip
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NS = 'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9"'
GIB = 1 << 30


def url_xml(
    loc: str, lastmod: str | None = None, changefreq: str | None = None, extra: str = ""
) -> str:
    parts = [f"<url><loc>{loc}</loc>"]
    if lastmod is not None:
        parts.append(f"<lastmod>{lastmod}</lastmod>")
    if changefreq is not None:
        parts.append(f"<changefreq>{changefreq}</changefreq>")
    return "".join([*parts, extra, "</url>"])


def urlset(*urls: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset {NS}>' + "".join(urls)).encode() + (
        b"</urlset>"
    )


def many_urls(count: int, host: str = "https://shop.example", start: int = 0) -> bytes:
    return urlset(*(url_xml(f"{host}/p/item-{i}") for i in range(start, start + count)))


def index(*locs: str) -> bytes:
    body = "".join(f"<sitemap><loc>{loc}</loc></sitemap>" for loc in locs)
    return f'<?xml version="1.0"?><sitemapindex {NS}>{body}</sitemapindex>'.encode()


def gzip_bomb(prefix: bytes, size: int = GIB, *, single_member: bool = True) -> bytes:
    """`prefix` then `size` bytes of spaces, gzipped (inside a comment, so well-formed as far
    as it goes). A single member carries the true size in its trailer; concatenated small
    members carry only the last member's, so only a streaming cap can catch them."""
    chunk = b" " * (1 << 20)
    if not single_member:
        member = gzip.compress(chunk, compresslevel=9, mtime=0)
        return gzip.compress(prefix + b"<!--", mtime=0) + member * (size // len(chunk))
    compressor = zlib.compressobj(1, zlib.DEFLATED, 31)
    out = [compressor.compress(prefix + b"<!--")]
    out.extend(compressor.compress(chunk) for _ in range(size // len(chunk)))
    out.append(compressor.flush())
    return b"".join(out)


class NonSeekable:
    """A pipe-like stream: no seek, no declared size to peek at."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)
        self._pos = 0
        self.closed = False

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = len(self._data) - self._pos
        out = bytes(self._data[self._pos : self._pos + n])
        self._pos += len(out)
        return out

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


class Served:
    """What the loopback server answers: path -> (status, headers, body)."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, dict[str, str], bytes]] = {}
        self.url = ""

    def add(
        self, path: str, body: bytes, *, status: int = 200, headers: dict[str, str] | None = None
    ) -> str:
        self.routes[path] = (status, headers or {}, body)
        return self.url + path


@contextlib.contextmanager
def http_server() -> Iterator[Served]:
    served = Served()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, headers, body = served.routes.get(self.path, (404, {}, b"not found"))
            self.send_response(status)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    served.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()
