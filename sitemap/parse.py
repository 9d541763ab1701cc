"""A streaming, defused parse of one sitemap or sitemap-index document (sitemaps.org 0.9).

Memory stays bounded: each <url> or <sitemap> element is handed out and then cleared
from the tree, so a 50,000-URL file never exists as a whole tree. defusedxml refuses
entity declarations (billion laughs, quadratic blowup) and external references (XXE)
before a single entry is produced. Elements are matched by namespace and depth, so
an extension's own <image:loc> or <xhtml:link href> is never read as a page's <loc>.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO, Literal, cast
from xml.etree.ElementTree import Element, ParseError, TreeBuilder, XMLPullParser

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
# about a second. The price is read-ahead: up to one feed's elements exist at once.
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
    if tag.startswith("{"):
        namespace, _, local = tag[1:].partition("}")
        return namespace, local
    return "", tag


def _text(element: Element) -> str | None:
    text = (element.text or "").strip()
    return text or None


class SitemapDocument:
    """One document: its kind is known after the root element, then entries stream out.

    Use as an iterator of UrlEntry (urlset) or SitemapRef (sitemapindex). Raises
    SitemapError for unsafe, malformed, oversized or non-sitemap input; entries
    already yielded stay valid, so callers that must write nothing on error
    consume the whole document before writing.
    """

    def __init__(self, stream: BinaryIO, *, location: str) -> None:
        self.location = location
        self._events = self._pull(stream)
        self.kind: DocumentKind = self._read_root()

    @staticmethod
    def _pull(stream: BinaryIO) -> Iterator[tuple[str, Element]]:
        expat = DefusedXMLParser(
            target=TreeBuilder(),
            forbid_dtd=False,  # a bare DOCTYPE is harmless; its entities are not
            forbid_entities=True,
            forbid_external=True,
        )
        parser = XMLPullParser(events=("start", "end"), _parser=expat)
        while data := stream.read(FEED_BYTES):
            parser.feed(data)
            yield from cast(Iterator[tuple[str, Element]], parser.read_events())
        parser.close()
        yield from cast(Iterator[tuple[str, Element]], parser.read_events())

    def _next_event(self) -> tuple[str, Element] | None:
        try:
            return next(self._events)
        except StopIteration:
            return None
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
            raise SitemapError(
                "malformed",
                f"not well-formed XML at line {line}, column {column} ({exc.msg})",
                location=self.location,
            ) from exc

    def _read_root(self) -> DocumentKind:
        event = self._next_event()
        if event is None:
            raise SitemapError("malformed", "empty document", location=self.location)
        _, root = event
        namespace, local = _split(root.tag)
        if namespace not in SITEMAP_NAMESPACES or local not in ("urlset", "sitemapindex"):
            raise SitemapError(
                "not_a_sitemap",
                f"the root element is <{root.tag}>, not a sitemaps.org <urlset> or <sitemapindex>",
                location=self.location,
            )
        self._root = root
        return "urlset" if local == "urlset" else "sitemapindex"

    def __iter__(self) -> Iterator[UrlEntry | SitemapRef]:
        entry_tag = "url" if self.kind == "urlset" else "sitemap"
        depth = 1  # the root's start was consumed by _read_root
        fields: dict[str, str | None] = {}
        in_entry = False
        while (event := self._next_event()) is not None:
            action, element = event
            if action == "start":
                depth += 1
                if depth == 2:
                    namespace, local = _split(element.tag)
                    in_entry = local == entry_tag and namespace in SITEMAP_NAMESPACES
                    fields = {}
                continue
            if depth == 3 and in_entry:
                namespace, local = _split(element.tag)
                if namespace in SITEMAP_NAMESPACES and local not in fields:
                    fields[local] = _text(element)
            elif depth == 2:
                if in_entry:
                    yield self._entry(fields)
                in_entry = False
                # Drop what the tree builder kept: this is what bounds memory.
                self._root.clear()
            depth -= 1

    def _entry(self, fields: dict[str, str | None]) -> UrlEntry | SitemapRef:
        if self.kind == "urlset":
            return UrlEntry(
                loc=fields.get("loc"),
                lastmod=fields.get("lastmod"),
                changefreq=fields.get("changefreq"),
                priority=fields.get("priority"),
            )
        return SitemapRef(loc=fields.get("loc"), lastmod=fields.get("lastmod"))


def parse_document(stream: BinaryIO, *, location: str = "<input>") -> SitemapDocument:
    """Start parsing: reads up to the root element, raising SitemapError if unfit."""
    return SitemapDocument(stream, location=location)
