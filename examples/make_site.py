"""Generate the example shop's sitemaps: an index and gzipped children, ~4,000 URLs.

    .venv/bin/python examples/make_site.py                  # rewrite examples/site/
    .venv/bin/python examples/make_site.py --out var/site --base-time now

The committed files use a fixed base time, so they are reproducible byte for byte;
`--base-time now` dates every lastmod in the last few days instead, so an import
spreads the first renders over each route's cadence rather than making all due at
once. Two URLs are bad on purpose (a relative loc, a loc with a space): an import
reports them as skipped.
"""

from __future__ import annotations

import argparse
import gzip
import random
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from xml.sax.saxutils import escape

HOST = "https://shop.example"
SITEMAP_NS = "http://www.sitemaps.org/schemas/sitemap/0.9"
IMAGE_NS = "http://www.google.com/schemas/sitemap-image/1.1"
XHTML_NS = "http://www.w3.org/1999/xhtml"
FIXED_BASE = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)

WORDS = [
    "alpine",
    "amber",
    "arc",
    "atlas",
    "aurora",
    "basalt",
    "birch",
    "blue",
    "bold",
    "cedar",
    "cloud",
    "coral",
    "crest",
    "delta",
    "drift",
    "dune",
    "ember",
    "fern",
    "field",
    "flint",
    "frost",
    "glade",
    "granite",
    "harbor",
    "hazel",
    "iris",
    "ivory",
    "jade",
    "juniper",
    "kelp",
    "lagoon",
    "linen",
    "lumen",
    "maple",
    "meadow",
    "mesa",
    "mist",
    "moss",
    "nova",
    "oak",
    "onyx",
    "opal",
    "orbit",
    "pine",
    "prairie",
    "quartz",
    "rain",
    "reef",
    "ridge",
    "river",
    "sage",
    "sand",
    "shore",
    "sierra",
    "slate",
    "solar",
    "spruce",
    "stone",
    "storm",
    "summit",
    "tide",
    "timber",
    "trail",
    "tundra",
    "vale",
    "willow",
    "wind",
]
KINDS = [
    "jacket",
    "boot",
    "tent",
    "lamp",
    "mug",
    "pack",
    "stove",
    "chair",
    "rope",
    "glove",
    "scarf",
    "bottle",
    "knife",
    "map",
]


def _lastmod(moment: datetime, form: int) -> str:
    """Every W3C datetime form appears somewhere in the example."""
    if form == 0:
        return moment.strftime("%Y-%m-%d")
    if form == 1:
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    if form == 2:
        return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "+00:00"
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M") + "-00:00"


def _url(
    loc: str, moment: datetime | None, changefreq: str | None, extra: str = "", form: int = 1
) -> str:
    parts = [f"<url><loc>{escape(loc)}</loc>"]
    if moment is not None:
        parts.append(f"<lastmod>{_lastmod(moment, form)}</lastmod>")
    if changefreq is not None:
        parts.append(f"<changefreq>{changefreq}</changefreq>")
    parts.append(extra)
    parts.append("</url>")
    return "".join(parts)


def _urlset(entries: list[str]) -> bytes:
    head = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<urlset xmlns="{SITEMAP_NS}" xmlns:image="{IMAGE_NS}" xmlns:xhtml="{XHTML_NS}">\n'
    )
    return (head + "\n".join(entries) + "\n</urlset>\n").encode()


def build(base: datetime, rng: random.Random) -> dict[str, list[str]]:
    def recent(max_days: float) -> datetime:
        return base - timedelta(seconds=rng.uniform(0, max_days * 86400))

    home = [
        _url(
            f"{HOST}/",
            recent(0.2),
            "hourly",
            f'<xhtml:link rel="alternate" hreflang="de" href="{HOST}/de/"/>',
        )
    ]
    for page in ("about", "contact", "shipping", "returns", "careers", "press"):
        home.append(_url(f"{HOST}/{page}", recent(90), "monthly", form=0))
    home.append(_url("/p/relative-loc-is-not-a-url", None, "daily"))  # bad on purpose
    home.append(_url(f"{HOST}/search?q=a b", None, None))  # bad on purpose

    categories = []
    for i in range(200):
        slug = f"{rng.choice(WORDS)}-{rng.choice(KINDS)}s"
        categories.append(_url(f"{HOST}/c/{slug}/{i}/", recent(1), "hourly", form=i % 4))

    products = []
    for i in range(3000):
        slug = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.choice(KINDS)}"
        image = (
            f"<image:image><image:loc>{HOST}/img/{i}.jpg</image:loc></image:image>"
            if i % 3 == 0
            else ""
        )
        changefreq = None if i % 10 == 0 else "daily"  # some leave it to the route's rule
        products.append(_url(f"{HOST}/p/{slug}-{i}", recent(3), changefreq, image, form=i % 4))

    articles = []
    for i in range(800):
        when = recent(400)
        slug = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-guide-{i}"
        articles.append(
            _url(f"{HOST}/blog/{when.year}/{slug}", when, "weekly" if i % 5 else None, form=i % 4)
        )
    return {
        "sitemap-pages.xml": home,
        "sitemap-categories.xml.gz": categories,
        "sitemap-products-1.xml.gz": products[:1500],
        "sitemap-products-2.xml.gz": products[1500:],
        "sitemap-articles.xml.gz": articles,
    }


def write_site(out: Path, base: datetime, seed: int = 6) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = build(base, random.Random(seed))
    written = []
    index = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<sitemapindex xmlns="{SITEMAP_NS}">',
    ]
    for name, entries in files.items():
        body = _urlset(entries)
        if name.endswith(".gz"):
            body = gzip.compress(body, compresslevel=9, mtime=0)
        path = out / name
        path.write_bytes(body)
        written.append(path)
        index.append(
            f"<sitemap><loc>{HOST}/{name}</loc>"
            f"<lastmod>{base.strftime('%Y-%m-%dT%H:%M:%SZ')}</lastmod></sitemap>"
        )
    index.append("</sitemapindex>\n")
    path = out / "sitemap.xml"
    path.write_text("\n".join(index))
    written.append(path)
    return written


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "site")
    parser.add_argument("--base-time", default="fixed", help='"fixed" (2025-06-01) or "now"')
    args = parser.parse_args(argv)
    base = datetime.now(UTC) if args.base_time == "now" else FIXED_BASE
    paths = write_site(args.out, base)
    total = sum(path.stat().st_size for path in paths)
    print(f"wrote {len(paths)} files, {total:,} bytes, under {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
