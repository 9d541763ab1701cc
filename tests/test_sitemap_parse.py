"""sitemap.parse: real sitemap shapes stream out as entries; unsafe XML is refused."""

from __future__ import annotations

import io

import pytest

from sitemap.errors import SitemapError
from sitemap.parse import FEED_BYTES, SitemapRef, UrlEntry, parse_document

NS = 'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9"'


def entries(xml: str | bytes) -> list[UrlEntry | SitemapRef]:
    data = xml.encode() if isinstance(xml, str) else xml
    return list(parse_document(io.BytesIO(data), location="test.xml"))


def test_plain_urlset_with_all_fields() -> None:
    xml = f"""<?xml version="1.0" encoding="UTF-8"?>
    <urlset {NS}>
      <url>
        <loc>
          https://example.com/a
        </loc>
        <lastmod>2024-03-01</lastmod>
        <changefreq>daily</changefreq>
        <priority>0.8</priority>
      </url>
      <url><loc>https://example.com/b</loc></url>
    </urlset>"""
    document = parse_document(io.BytesIO(xml.encode()), location="test.xml")
    assert document.kind == "urlset"
    assert list(document) == [
        UrlEntry(
            loc="https://example.com/a", lastmod="2024-03-01", changefreq="daily", priority="0.8"
        ),
        UrlEntry(loc="https://example.com/b"),
    ]


def test_sitemap_index() -> None:
    xml = f"""<sitemapindex {NS}>
      <sitemap><loc>https://example.com/s1.xml.gz</loc><lastmod>2024-01-01T00:00:00Z</lastmod></sitemap>
      <sitemap><loc>https://example.com/s2.xml</loc></sitemap>
    </sitemapindex>"""
    document = parse_document(io.BytesIO(xml.encode()))
    assert document.kind == "sitemapindex"
    assert list(document) == [
        SitemapRef(loc="https://example.com/s1.xml.gz", lastmod="2024-01-01T00:00:00Z"),
        SitemapRef(loc="https://example.com/s2.xml"),
    ]


def test_extensions_never_shadow_the_page_loc() -> None:
    # image:loc, news:*, xhtml:link carry their own URLs; only the page's <loc> counts,
    # even when an extension element comes first.
    xml = f"""<urlset {NS}
        xmlns:image="http://www.google.com/schemas/sitemap-image/1.1"
        xmlns:news="http://www.google.com/schemas/sitemap-news/0.9"
        xmlns:xhtml="http://www.w3.org/1999/xhtml"
        xmlns:video="http://www.google.com/schemas/sitemap-video/1.1">
      <url>
        <image:image><image:loc>https://cdn.example.com/1.jpg</image:loc></image:image>
        <xhtml:link rel="alternate" hreflang="de" href="https://example.com/de/a"/>
        <loc>https://example.com/a</loc>
        <news:news>
          <news:publication><news:name>Paper</news:name><news:language>en</news:language></news:publication>
          <news:publication_date>2024-03-01T10:00:00+01:00</news:publication_date>
          <news:title>Title</news:title>
        </news:news>
        <video:video><video:title>v</video:title></video:video>
      </url>
    </urlset>"""
    assert entries(xml) == [UrlEntry(loc="https://example.com/a")]


def test_no_namespace_and_the_old_google_namespace() -> None:
    assert entries("<urlset><url><loc>https://e.com/x</loc></url></urlset>") == [
        UrlEntry(loc="https://e.com/x")
    ]
    old = '<urlset xmlns="http://www.google.com/schemas/sitemap/0.84"><url><loc>https://e.com/y</loc></url></urlset>'
    assert entries(old) == [UrlEntry(loc="https://e.com/y")]


def test_missing_optional_fields_and_empty_loc() -> None:
    xml = f"<urlset {NS}><url><loc/></url><url><lastmod>2024</lastmod></url></urlset>"
    assert entries(xml) == [UrlEntry(loc=None), UrlEntry(loc=None, lastmod="2024")]


def test_cdata_and_escaped_loc() -> None:
    xml = f"""<urlset {NS}>
      <url><loc><![CDATA[https://e.com/a?x=1&y=2]]></loc></url>
      <url><loc>https://e.com/b?x=1&amp;y=2</loc></url>
    </urlset>"""
    assert [entry.loc for entry in entries(xml)] == [
        "https://e.com/a?x=1&y=2",
        "https://e.com/b?x=1&y=2",
    ]


def test_a_harmless_doctype_is_allowed() -> None:
    xml = f"<!DOCTYPE urlset><urlset {NS}><url><loc>https://e.com/a</loc></url></urlset>"
    assert entries(xml) == [UrlEntry(loc="https://e.com/a")]


def test_memory_is_bounded_the_tree_is_cleared_as_entries_stream() -> None:
    entry = "<url><loc>https://e.com/{:06d}</loc></url>"
    total = 100_000
    xml = f"<urlset {NS}>" + "".join(entry.format(i) for i in range(total)) + "</urlset>"
    document = parse_document(io.BytesIO(xml.encode()))
    count = sum(1 for _ in document)
    assert count == total
    # At most what one feed of the parser produced is held, not the document:
    # 100,000 entries (3.7 MB) never sit in memory together.
    per_feed = FEED_BYTES // len(entry.format(0)) + 1
    assert 0 < document.most_buffered <= per_feed < total // 3


def test_not_a_sitemap() -> None:
    with pytest.raises(SitemapError) as caught:
        entries("<html><body>hello</body></html>")
    assert caught.value.reason == "not_a_sitemap"
    assert "<html>" in str(caught.value)


@pytest.mark.parametrize(
    "xml",
    [
        "",
        f"<urlset {NS}><url><loc>https://e.com/a</loc></url>",  # truncated
        f"<urlset {NS}><url><loc>https://e.com/a</url></urlset>",  # mismatched tag
    ],
)
def test_malformed(xml: str) -> None:
    with pytest.raises(SitemapError) as caught:
        entries(xml)
    assert caught.value.reason == "malformed"


EXTERNAL_ENTITY = f"""<?xml version="1.0"?>
<!DOCTYPE urlset [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<urlset {NS}><url><loc>https://e.com/&xxe;</loc></url></urlset>"""

BILLION_LAUGHS = f"""<?xml version="1.0"?>
<!DOCTYPE lolz [
 <!ENTITY lol "lol">
 <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
 <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
 <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
 <!ENTITY lol9 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
]>
<urlset {NS}><url><loc>https://e.com/&lol9;</loc></url></urlset>"""

PARAMETER_ENTITY = f"""<?xml version="1.0"?>
<!DOCTYPE urlset [<!ENTITY % remote SYSTEM "http://127.0.0.1:9/evil.dtd"> %remote;]>
<urlset {NS}/>"""


@pytest.mark.parametrize(
    "xml",
    [EXTERNAL_ENTITY, BILLION_LAUGHS, PARAMETER_ENTITY],
    ids=["external-entity", "billion-laughs", "parameter-entity"],
)
def test_entity_attacks_are_refused_before_any_entry(xml: str) -> None:
    with pytest.raises(SitemapError) as caught:
        entries(xml)
    assert caught.value.reason == "unsafe_xml"
    assert "entit" in str(caught.value)
