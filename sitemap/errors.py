"""Why a sitemap document was refused as a whole (nothing is written when one is raised)."""

from __future__ import annotations

from typing import Literal

SitemapErrorReason = Literal[
    "unsafe_xml",  # a DTD entity, an external reference: XXE and billion-laughs shapes
    "too_large",  # more bytes than the cap, compressed or decompressed
    "malformed",  # not well-formed XML, or a broken gzip stream
    "not_a_sitemap",  # a root other than <urlset> or <sitemapindex>
    "fetch_failed",  # a URL source or child sitemap could not be read
    "index_limit",  # an index with too many children, or nested too deep
]


class SitemapError(Exception):
    """A document-level refusal, with a message a person can act on."""

    def __init__(self, reason: SitemapErrorReason, message: str, *, location: str = "") -> None:
        self.reason: SitemapErrorReason = reason
        self.location = location
        where = f"{location}: " if location else ""
        super().__init__(f"{where}{message}")
