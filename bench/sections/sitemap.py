"""Sitemap import: URLs per second and peak memory for a 50,000-URL, 50 MB sitemap.

`python -m bench sitemap [--quick]`

The file is generated per run: 50,000 URLs (quick: 5,000) padded to the protocol's
size with what real sitemaps carry (image:image blocks, xhtml:link alternates,
lastmod in every W3C form), just under 50 MB (quick: 5 MB). Each arm runs in a
fresh spawned process, so its peak RSS (ru_maxrss) is its own; "peak memory" is
that peak minus the process's RSS just before the import began (interpreter and
imports excluded). Arms, interleaved over rounds (3, quick 1), medians reported:

- import, plain: `sitemap.importer.import_sitemap` from the file into a fresh
  SQLite store (parse, spool, write in 1,000-row transactions);
- import, gzip: the same document gzipped;
- parse only: the importer's read pass with a target that writes nothing, to split
  parse cost from write cost;
- whole-tree parse (the peer): `defusedxml.ElementTree.parse` of the document and
  a walk of its <url> elements, the way a non-streaming importer reads it.

The seed states no figure for sitemap import; the columns are ours and the peer's.
"""

from __future__ import annotations

import argparse
import gzip
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec

from bench.harness import report

TABLE = "sitemap import: 50,000 URLs, 50 MB"
QUICK_TABLE = "sitemap import: 5,000 URLs, 5 MB"
PEER = "whole-tree parse"
NS = (
    'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9" '
    'xmlns:image="http://www.google.com/schemas/sitemap-image/1.1" '
    'xmlns:xhtml="http://www.w3.org/1999/xhtml"'
)
PROTOCOL_MAX = 52_428_800


class Config(msgspec.Struct, frozen=True, kw_only=True):
    urls: int
    target_bytes: int
    rounds: int


FULL = Config(urls=50_000, target_bytes=PROTOCOL_MAX - 500_000, rounds=3)
QUICK = Config(urls=5_000, target_bytes=(PROTOCOL_MAX - 500_000) // 10, rounds=1)


class ArmResult(msgspec.Struct, frozen=True, kw_only=True):
    arm: str
    urls: int
    seconds: float
    cpu_seconds: float
    peak_mb: float
    imported: int = 0


_LASTMODS = (
    "2025-05-{day:02d}",
    "2025-05-{day:02d}T10:{minute:02d}:00Z",
    "2025-05-{day:02d}T10:{minute:02d}:00.250+02:00",
    "2025-05-{day:02d}T10:{minute:02d}-05:00",
)
_LANGUAGES = ("de", "fr", "es", "it", "nl", "pt", "pl", "sv")


def _entry(i: int, images: int) -> str:
    loc = f"https://shop.example/p/category-{i % 97}/alpine-trail-boot-{i:06d}"
    lastmod = _LASTMODS[i % 4].format(day=1 + i % 28, minute=i % 60)
    parts = [
        f"<url><loc>{loc}</loc><lastmod>{lastmod}</lastmod>",
        "<changefreq>daily</changefreq><priority>0.7</priority>",
    ]
    parts.extend(
        f'<xhtml:link rel="alternate" hreflang="{lang}" '
        f'href="https://shop.example/{lang}/p/{i:06d}"/>'
        for lang in _LANGUAGES
    )
    parts.extend(
        f"<image:image><image:loc>https://cdn.shop.example/img/{i:06d}-{n}.jpg"
        f"</image:loc><image:title>Boot {i} view {n}</image:title></image:image>"
        for n in range(images)
    )
    parts.append("</url>\n")
    return "".join(parts)


def generate(path: Path, config: Config) -> int:
    """A urlset of `config.urls` entries, padded with image blocks toward `target_bytes`."""
    per_entry = config.target_bytes / config.urls
    bare = len(_entry(0, 0))
    per_image = len(_entry(0, 1)) - bare
    images = max(0, int((per_entry - bare) // per_image))
    with open(path, "w", encoding="utf-8") as out:
        out.write(f'<?xml version="1.0" encoding="UTF-8"?>\n<urlset {NS}>\n')
        for i in range(config.urls):
            out.write(_entry(i, images))
        out.write("</urlset>\n")
    size = path.stat().st_size
    if size > PROTOCOL_MAX:
        raise SystemExit(f"generated {size:,} bytes, over the protocol's {PROTOCOL_MAX:,}")
    return size


def _rss_mb() -> float:
    import psutil

    return float(psutil.Process().memory_info().rss) / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class _NullTarget:
    def get_many(self, keys: Sequence[str]) -> dict[str, object]:
        return {}

    def write(self, upsert: Sequence[object] = (), delete: Sequence[str] = ()) -> None:
        pass

    def routes(self) -> list[object]:
        return []

    def default_cadence_s(self) -> int:
        return 86_400


def _arm(arm: str, path: str, workdir: str, conn: Connection) -> None:
    from sitemap.importer import import_sitemap
    from sitemap.rules import RouteRules

    rules = RouteRules.default()
    if arm == "peer":
        import defusedxml.ElementTree as safe_etree

    store = None
    if arm in ("plain", "gzip"):
        from store import open_store

        store = open_store(os.path.join(workdir, f"{arm}-{os.getpid()}.sqlite"))
    if arm == "gzip":
        path += ".gz"
    before = _rss_mb()
    base_peak = _peak_mb()
    now = time.time_ns() // 1_000_000
    started = time.perf_counter()
    cpu_started = time.process_time()
    imported = 0
    if arm == "peer":
        tree = safe_etree.parse(path)
        urls = 0
        for element in tree.getroot():
            loc = element.find("{http://www.sitemaps.org/schemas/sitemap/0.9}loc")
            if loc is not None and loc.text:
                urls += 1
    else:
        source = open(path, "rb")  # noqa: SIM115 - the importer closes it
        target = store if store is not None else _NullTarget()
        result = import_sitemap(source, target, rules, now)  # type: ignore[arg-type]
        urls = result.urls_seen
        imported = result.imported
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu_started
    peak = max(_peak_mb(), base_peak)
    if store is not None:
        store.close()
    conn.send(
        msgspec.msgpack.encode(
            ArmResult(
                arm=arm,
                urls=urls,
                seconds=seconds,
                cpu_seconds=cpu_seconds,
                peak_mb=peak - before,
                imported=imported,
            )
        )
    )
    conn.close()


def run_arm(arm: str, path: Path, workdir: Path) -> ArmResult:
    context = mp.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_arm, args=(arm, str(path), str(workdir), child))
    process.start()
    child.close()
    try:
        payload = parent.recv()
    except EOFError:
        process.join(60)
        raise RuntimeError(f"arm {arm} died (exit {process.exitcode}) before reporting") from None
    process.join(600)
    if process.exitcode != 0:
        raise RuntimeError(f"arm {arm} exited {process.exitcode}")
    return msgspec.msgpack.decode(payload, type=ArmResult)


ARMS = ("plain", "gzip", "parse", "peer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5,000 URLs, 5 MB, one round")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    config = QUICK if args.quick else FULL
    table = QUICK_TABLE if args.quick else TABLE
    result = report.new_result("sitemap", args.quick)
    result.promised = [
        f"{table}/import rate per CPU second, plain XML into SQLite",
        f"{table}/import rate, plain XML into SQLite",
        f"{table}/import rate, gzipped",
        f"{table}/parse rate, no writes",
        f"{table}/peak memory during import",
    ]
    workdir = Path(tempfile.mkdtemp(prefix=f"bench-sitemap-{os.getpid()}-"))
    try:
        path = workdir / "sitemap.xml"
        report.progress(f"sitemap: generating {config.urls:,} URLs")
        size = generate(path, config)
        with open(path, "rb") as plain, gzip.open(f"{path}.gz", "wb", compresslevel=6) as packed:
            shutil.copyfileobj(plain, packed)
        report.progress(f"sitemap: {size:,} bytes; {config.rounds} round(s) of {len(ARMS)} arms")
        runs: dict[str, list[ArmResult]] = {arm: [] for arm in ARMS}
        for round_number in range(config.rounds):
            order = ARMS if round_number % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                outcome = run_arm(arm, path, workdir)
                if outcome.urls != config.urls:
                    raise RuntimeError(f"arm {arm} saw {outcome.urls} URLs of {config.urls}")
                if arm in ("plain", "gzip") and outcome.imported != config.urls:
                    raise RuntimeError(f"arm {arm} imported {outcome.imported}")
                runs[arm].append(outcome)
                report.progress(
                    f"sitemap: round {round_number + 1} {arm}: "
                    f"{outcome.urls / outcome.seconds:,.0f} URLs/s, "
                    f"{outcome.urls / max(outcome.cpu_seconds, 1e-9):,.0f} URLs/CPU-s, "
                    f"peak +{outcome.peak_mb:.0f} MB"
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def rate(arm: str) -> float:
        return statistics.median(run.urls / run.seconds for run in runs[arm])

    def cpu_rate(arm: str) -> float:
        return statistics.median(run.urls / max(run.cpu_seconds, 1e-9) for run in runs[arm])

    def peak(arm: str) -> float:
        return statistics.median(run.peak_mb for run in runs[arm])

    result.figures = [
        report.Figure(
            table=table,
            what="import rate per CPU second, plain XML into SQLite",
            unit="URLs/CPU-s",
            ours=round(cpu_rate("plain")),
            better="higher",
            note="the import's own CPU: steadier than wall time on a shared machine",
        ),
        report.Figure(
            table=table,
            what="parse rate per CPU second, no writes",
            unit="URLs/CPU-s",
            ours=round(cpu_rate("parse")),
            better="higher",
            peers={PEER: round(cpu_rate("peer"))},
        ),
        report.Figure(
            table=table,
            what="import rate, plain XML into SQLite",
            unit="URLs/s",
            ours=round(rate("plain")),
            better="higher",
            note="parse, spool, then 1,000-row transactions; the store's feed triggers included",
        ),
        report.Figure(
            table=table,
            what="import rate, gzipped",
            unit="URLs/s",
            ours=round(rate("gzip")),
            better="higher",
        ),
        report.Figure(
            table=table,
            what="parse rate, no writes",
            unit="URLs/s",
            ours=round(rate("parse")),
            better="higher",
            peers={PEER: round(rate("peer"))},
            note="streaming defused parse + validation + spool vs a whole-tree parse",
        ),
        report.Figure(
            table=table,
            what="peak memory during import",
            unit="MB",
            ours=round(peak("plain"), 1),
            better="lower",
            peers={PEER: round(peak("peer"), 1)},
            note="peak RSS over the RSS before the import, in a fresh process",
        ),
        report.Figure(
            table=table,
            what="peak memory, parse only",
            unit="MB",
            ours=round(peak("parse"), 1),
            better="lower",
            peers={PEER: round(peak("peer"), 1)},
        ),
    ]
    result.raw = {
        "config": msgspec.to_builtins(config),
        "file_bytes": size,
        "runs": {
            arm: [msgspec.to_builtins(run) for run in arm_runs] for arm, arm_runs in runs.items()
        },
        "command": "python -m bench sitemap" + (" --quick" if args.quick else ""),
    }
    return report.emit(result)


if __name__ == "__main__":
    raise SystemExit(main())
