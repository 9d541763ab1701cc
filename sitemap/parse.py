"""A streaming, defused parse of one sitemap or sitemap-index document (sitemaps.org 0.9).

Memory stays bounded: no element tree is built at all. The parser's target keeps the
few fields of the entry being read, and entries are handed out after each feed, so
a 50,000-URL file never exists in memory as a whole. defusedxml refuses
entity declarations (billion laughs, quadratic blowup) and external references (XXE)
before a single entry is produced. Elements are matched by namespace and depth, so
an extension's own <image:loc> or <xhtml:link href> is never read as a page's <loc>.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO, Literal
from xml.etree.ElementTree import ParseError

import defusedxml
import msgspec
from defusedxml.ElementTree import DefusedXMLParser

from sitemap.errors import SitemapError

SITEMAP_NAMESPACES = frozenset(
    {
        "",  # sitemaps in the wild often omit the namespace
        "http://www.sitemaps.org/schemas/sitemap/0.9",
        "http://www.google.com/schemas/sitemap/0.9",
        "http://www.google.com/schemas/sitemap/0.84",
    }
)

DocumentKind = Literal["urlset", "sitemapindex"]

# Bytes handed to expat per feed. Expat 2.5 (the one CPython 3.11 bundles) rescans a
# token that spans feeds from its start on every feed, so one huge text or comment
# token costs (size / feed)^2 / 2 feed-lengths of work: with the 16 KiB feeds of
# ElementTree.iterparse, a 50 MB comment took over two minutes; with 1 MiB it takes
# about a second. The price is read-ahead: up to one feed's entries exist at once.
FEED_BYTES = 1 << 20


class UrlEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One <url> of a urlset, its fields as written (whitespace trimmed), unvalidated."""

    loc: str | None
    lastmod: str | None = None
    changefreq: str | None = None
    priority: str | None = None


class SitemapRef(msgspec.Struct, frozen=True, kw_only=True):
    """One <sitemap> of a sitemap index."""

    loc: str | None
    lastmod: str | None = None


def _split(tag: str) -> tuple[str, str]:
    """expat's "uri}local" (its namespace separator is "}") into (uri, local)."""
    namespace, _, local = tag.rpartition("}")
    return namespace, local


def _shown(tag: str) -> str:
    namespace, local = _split(tag)
    return f"{{{namespace}}}{local}" if namespace else local


_URL_FIELDS = frozenset({"loc", "lastmod", "changefreq", "priority"})
_SITEMAP_FIELDS = frozenset({"loc", "lastmod"})


class _NotASitemap(Exception):
    def __init__(self, tag: str) -> None:
        self.tag = tag


class _SitemapTarget:
    """The parser's target: keeps only the fields of each entry, builds no element tree.

    ElementTree's TreeBuilder would build an Element per tag, extension tags
    included; this keeps one small dict per entry and hands entries out per feed.
    Tags arrive as expat writes them, "namespace-uri}local".
    """

    def __init__(self) -> None:
        self.kind: DocumentKind | None = None
        self.entries: list[UrlEntry | SitemapRef] = []
        self._depth = 0
        self._entry_local = ""
        self._wanted: frozenset[str] = frozenset()
        self._in_entry = False
        self._fields: dict[str, str | None] = {}
        self._field: str | None = None
        self._text: list[str] = []
        # tag -> its local name if in a sitemap namespace, else "": tags repeat endlessly
        self._local: dict[str, str] = {}

    def _sitemap_local(self, tag: str) -> str:
        local = self._local.get(tag)
        if local is None:
            namespace, name = _split(tag)
            local = self._local[tag] = name if namespace in SITEMAP_NAMESPACES else ""
        return local

    def start(self, tag: str, attributes: list[str]) -> None:
        self._depth += 1
        depth = self._depth
        if depth == 3:
            if self._in_entry:
                local = self._sitemap_local(tag)
                if local in self._wanted and local not in self._fields:
                    self._field = local
                    self._text = []
        elif depth == 2:
            self._in_entry = self._sitemap_local(tag) == self._entry_local
            self._fields = {}
        elif depth == 1:
            namespace, local = _split(tag)
            if namespace not in SITEMAP_NAMESPACES or local not in ("urlset", "sitemapindex"):
                raise _NotASitemap(_shown(tag))
            self.kind = "urlset" if local == "urlset" else "sitemapindex"
            self._entry_local = "url" if local == "urlset" else "sitemap"
            self._wanted = _URL_FIELDS if local == "urlset" else _SITEMAP_FIELDS

    def data(self, text: str) -> None:
        if self._field is not None:
            self._text.append(text)

    def end(self, tag: str) -> None:
        depth = self._depth
        self._depth -= 1
        if depth == 3:
            if self._field is not None:
                self._fields[self._field] = "".join(self._text).strip() or None
                self._field = None
        elif depth == 2 and self._in_entry:
            self._in_entry = False
            fields = self._fields
            if self.kind == "urlset":
                self.entries.append(
                    UrlEntry(
                        loc=fields.get("loc"),
                        lastmod=fields.get("lastmod"),
                        changefreq=fields.get("changefreq"),
                        priority=fields.get("priority"),
                    )
                )
            else:
                self.entries.append(
                    SitemapRef(loc=fields.get("loc"), lastmod=fields.get("lastmod"))
                )

    def close(self) -> None:
        return None

    def install(self, parser: DefusedXMLParser) -> None:
        """Take expat's element and text callbacks straight from the parser.

        ElementTree's XMLParser would rebuild every tag name and attribute dict in
        Python before calling a target; a sitemap needs neither. defusedxml's entity
        and external-reference handlers stay as they are.
        """
        expat = parser.parser
        expat.StartElementHandler = self.start
        expat.EndElementHandler = self.end
        expat.CharacterDataHandler = self.data


class SitemapDocument:
    """One document: its kind is known after the root element, then entries stream out.

    Use as an iterator of UrlEntry (urlset) or SitemapRef (sitemapindex). Raises
    SitemapError for unsafe, malformed, oversized or non-sitemap input; entries
    already yielded stay valid, so callers that must write nothing on error
    consume the whole document before writing.
    """

    def __init__(self, stream: BinaryIO, *, location: str) -> None:
        self.location = location
        self._stream = stream
        self._target = _SitemapTarget()
        self._parser = DefusedXMLParser(
            target=self._target,
            forbid_dtd=False,  # a bare DOCTYPE is harmless; its entities are not
            forbid_entities=True,
            forbid_external=True,
        )
        self._target.install(self._parser)
        self._done = False
        self.most_buffered = 0  # the most entries held at once: what bounds memory
        while self._target.kind is None and not self._done:
            self._feed()
        if self._target.kind is None:
            raise SitemapError("malformed", "empty document", location=location)
        self.kind: DocumentKind = self._target.kind

    def _feed(self) -> None:
        """Parse one more chunk (or finish the document), translating every failure."""
        try:
            data = self._stream.read(FEED_BYTES)
            if data:
                self._parser.feed(data)
            else:
                self._done = True
                self._parser.close()
        except _NotASitemap as exc:
            raise SitemapError(
                "not_a_sitemap",
                f"the root element is <{exc.tag}>, not a sitemaps.org <urlset> or <sitemapindex>",
                location=self.location,
            ) from None
        except defusedxml.EntitiesForbidden as exc:
            raise SitemapError(
                "unsafe_xml",
                f"entity declarations are refused (entity {exc.name!r}); a sitemap needs "
                "none, and they are how billion-laughs and external-entity attacks work",
                location=self.location,
            ) from exc
        except defusedxml.ExternalReferenceForbidden as exc:
            raise SitemapError(
                "unsafe_xml",
                f"external references are refused (system id {exc.sysid!r})",
                location=self.location,
            ) from exc
        except defusedxml.DefusedXmlException as exc:
            raise SitemapError("unsafe_xml", f"refused: {exc}", location=self.location) from exc
        except ParseError as exc:
            line, column = exc.position
            message = str(exc).split(":", 1)[0]
            raise SitemapError(
                "malformed",
                f"not well-formed XML at line {line}, column {column} ({message})",
                location=self.location,
            ) from exc

    def __iter__(self) -> Iterator[UrlEntry | SitemapRef]:
        target = self._target
        while True:
            if target.entries:
                entries = target.entries
                target.entries = []
                self.most_buffered = max(self.most_buffered, len(entries))
                yield from entries
            if self._done:
                return
            self._feed()


def parse_document(stream: BinaryIO, *, location: str = "<input>") -> SitemapDocument:
    """Start parsing: reads up to the root element, raising SitemapError if unfit."""
    return SitemapDocument(stream, location=location)
